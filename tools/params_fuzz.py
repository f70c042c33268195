"""Greedy output under random sampling parameters: every speculative method equals speculation off, field by field.

    python tools/params_fuzz.py [--cases 200] [--seed 1000] [--device cpu] [--dtype float32] [--methods ...]

tools/lossless_sweep.py compares token ids for a fixed set of requests; this draws --cases random requests (each
case a batch of 1, 3 or 8 prompts, each prompt with its own parameters) from vLLM's SamplingParams: max_tokens,
the three penalties, min_tokens, stop strings (with include_stop_str_in_output), stop_token_ids, ignore_eos,
logprobs, prompt_logprobs, logit_bias, allowed_token_ids, bad_words, a structured output (a choice, a regex or a
JSON schema), skip_special_tokens, truncate_prompt_tokens and detokenize, all greedy. Each case runs once with
speculation off and once per method (max_num_seqs 8), and every output is compared whole: text, token ids,
finish_reason, stop_reason, cumulative logprob and every logprob (to 3 decimals here: a verify's logprobs come
from the same logits as decode's, within rounding on a GPU), prompt logprobs, prompt ids, or the same one-line
error. A case that speculation off refuses (e.g. stop strings with detokenize=False) must be refused alike.
Prompts: held-out code windows of tools/eval_toy.py and four short code openings. Prints one line per method
and the differing cases' fields; exit status 1 on any difference.
"""
import argparse
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import specdec as sd  # noqa: E402
from eval_toy import held_out_prompts  # noqa: E402  (this folder: sys.path[0] when run as a script)
from lossless_sweep import METHODS as SWEEP_METHODS  # noqa: E402

M = os.path.join(ROOT, "models")
# one configuration per method, as the gate's sweep writes them
METHODS = {name: SWEEP_METHODS[name]
           for name in ("mtp k=3", "ngram k=4", "draft_model k=4", "dflash k=7", "dspark k=8")}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def random_params(r):
    """One request's greedy SamplingParams (as a dict), each field present with its own probability."""
    p = dict(temperature=0.0, max_tokens=r.choice([1, 2, 3, 5, 8, 17, 40, 64]))
    maybe = lambda prob: r.random() < prob  # noqa: E731
    if maybe(0.3):
        p["presence_penalty"] = r.choice([-1.0, 0.5, 1.5])
    if maybe(0.3):
        p["frequency_penalty"] = r.choice([-0.5, 0.3, 1.0])
    if maybe(0.3):
        p["repetition_penalty"] = r.choice([0.8, 1.2, 2.0])
    if maybe(0.3):
        p["min_tokens"] = min(p["max_tokens"], r.choice([1, 3, 10]))
    if maybe(0.3):
        p["stop"] = r.sample(["\n", "(", " =", "return", ":", "  ", "self", "def"], r.randint(1, 3))
    if maybe(0.2):
        p["include_stop_str_in_output"] = True
    if maybe(0.2):
        p["stop_token_ids"] = [r.randrange(8192) for _ in range(3)] + [198]
    if maybe(0.2):
        p["ignore_eos"] = True
    if maybe(0.3):
        p["logprobs"] = r.choice([0, 1, 5])
    if maybe(0.15):
        p["prompt_logprobs"] = r.choice([0, 2])
    if maybe(0.2):
        p["logit_bias"] = {r.randrange(8192): r.choice([-100, 5, 10, 100]) for _ in range(3)}
    if maybe(0.1):
        p["allowed_token_ids"] = [r.randrange(8192) for _ in range(40)] + [198, 220, 286]
    if maybe(0.15):
        p["bad_words"] = r.sample([" fib", " self", " return", "(n", " =", " if"], 2)
    if maybe(0.1):
        p["structured_outputs"] = sd.StructuredOutputsParams(choice=["yes", "no", "maybe so"])
    elif maybe(0.1):
        p["structured_outputs"] = sd.StructuredOutputsParams(regex=r"[a-z_]+\([a-z, ]*\)")
    elif maybe(0.05):
        p["structured_outputs"] = sd.StructuredOutputsParams(json=SCHEMA)
    if maybe(0.1):
        p["skip_special_tokens"] = False
    if maybe(0.1):
        p["truncate_prompt_tokens"] = r.choice([3, 20])
    if maybe(0.05):
        p["detokenize"] = False
    return p


def digest(outs):
    """Every field of the outputs, logprobs rounded to 3 decimals."""
    lp = lambda d: sorted((t, round(v.logprob, 3), v.rank, v.decoded_token) for t, v in d.items())  # noqa: E731
    res = []
    for o in outs:
        plp = None if o.prompt_logprobs is None else [None if d is None else lp(d) for d in o.prompt_logprobs]
        for c in o.outputs:
            res.append(dict(text=c.text, ids=list(c.token_ids), finish=c.finish_reason, stop=c.stop_reason,
                            cum=None if c.cumulative_logprob is None else round(c.cumulative_logprob, 2),
                            logprobs=None if c.logprobs is None else [lp(d) for d in c.logprobs],
                            prompt_logprobs=plp, prompt_ids=list(o.prompt_token_ids)))
    return res


def run(llm, prompts, params):
    try:
        return digest(llm.generate(prompts, [sd.SamplingParams(**p) for p in params], use_tqdm=False))
    except sd.ConfigError as e:
        return f"ConfigError: {e}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1000, help="case i draws from random.Random(seed + i)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    a = ap.parse_args()
    kw = dict(device=a.device, dtype=a.dtype, max_num_seqs=8)
    off = sd.LLM(os.path.join(M, "toy"), **kw)
    texts = [off.tokenizer.decode(p) for p in held_out_prompts(off.tokenizer, 12, 200, M)]
    texts += ["def fib(n):", "import os\n", "class Stack:\n    def __init__(self):", "for i in range("]
    cases = []
    for i in range(a.cases):
        r = random.Random(a.seed + i)
        B = r.choice([1, 1, 3, 8])
        cases.append(([r.choice(texts) for _ in range(B)], [random_params(r) for _ in range(B)]))
    t0 = time.time()
    want = [run(off, *c) for c in cases]
    refused = sum(isinstance(w, str) for w in want)
    print(f"speculation off: {a.cases} cases ({refused} refused), {time.time() - t0:.0f} s", flush=True)
    del off
    bad = 0
    for name in a.methods:
        llm = sd.LLM(os.path.join(M, "toy"), speculative_config=METHODS[name], **kw)
        differing = []
        for i, c in enumerate(cases):
            got = run(llm, *c)
            if got != want[i]:
                differing.append(i)
                if len(differing) <= 3:  # the first few cases' differing fields
                    print(f"  DIFF {name} case {i}: {c[1]}")
                    pairs = [(want[i], got)] if isinstance(got, str) or isinstance(want[i], str) else \
                        [({k: x[k] for k in x if x[k] != y[k]}, {k: y[k] for k in x if x[k] != y[k]})
                         for x, y in zip(want[i], got) if x != y]
                    for x, y in pairs:
                        print(f"    off:  {str(x)[:300]}\n    spec: {str(y)[:300]}")
        bad += len(differing)
        print(f"{name}: {a.cases} cases, {len(differing)} differing ({time.time() - t0:.0f} s)", flush=True)
        del llm
    print(f"params fuzz: {len(a.methods)} methods x {a.cases} cases ({a.device} {a.dtype}), {bad} differing")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
