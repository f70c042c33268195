"""The GPU gate's losslessness sweep: greedy output with every speculative method equals speculation off, token for
token, on the shipped toy model (bf16, CUDA graphs and asynchronous steps on: the engine's defaults on the GPU).

    python tools/lossless_sweep.py [--device cuda] [--dtype bfloat16] [--prompts 16] [--gen 256] [--methods ...]

For each method (speculation off too), against speculation off with each prompt alone:
- the prompts each alone, and the prompts as batches of 8;
- prompts of 1 .. 10 tokens (1, 2, k, k+1, k+2 for every k here: a prompt of 1+k tokens is no verify step), alone;
- a batch of 8 where requests stop mid-step (stop strings, a stop token id, max_tokens) beside requests that go on,
  and one request aborted while the others continue (its output must be a prefix of speculation off's);
- vLLM's logits processors: 8 requests with penalties, min_tokens, logit_bias, bad words (a batch of 8), and 4
  constrained to a JSON schema (their outputs parse), each == speculation off alone with the same parameters.
Prompts: code windows of held-out stdlib files (as tools/eval_toy.py takes them), short code openings, and random
token ids (ngram finds no draft there at first, so ngram steps with and without drafts share a batch).
Prints one line per method, then the summary line ("lossless sweep: ..."), then one JSON line. Exit status 1 on
any difference.
"""
import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import specdec as sd  # noqa: E402
from eval_toy import held_out_prompts  # noqa: E402

MODELS = os.path.join(ROOT, "models")
METHODS = {
    "mtp k=1": {"method": "mtp", "num_speculative_tokens": 1},
    "mtp k=2": {"method": "mtp", "num_speculative_tokens": 2},
    "mtp k=3": {"method": "mtp", "num_speculative_tokens": 3},
    "mtp k=5": {"method": "mtp", "num_speculative_tokens": 5},
    "mtp k=8": {"method": "mtp", "num_speculative_tokens": 8},
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "draft_model k=4": {"method": "draft_model", "model": os.path.join(MODELS, "toy-draft"),
                        "num_speculative_tokens": 4},
    "dflash k=7": {"method": "dflash", "model": os.path.join(MODELS, "toy-dflash"), "num_speculative_tokens": 7},
    "dspark k=8": {"method": "dspark", "model": os.path.join(MODELS, "toy-dspark"), "num_speculative_tokens": 8},
}


def make_prompts(tok, n, vocab):
    """n prompts: half held-out code windows of 24..300 tokens, a quarter short code openings, a quarter random ids."""
    n_code, n_rand = n // 2, n // 4
    code = held_out_prompts(tok, n_code, 300, MODELS)
    code = [p[:24 + (276 * i) // max(1, n_code - 1)] for i, p in enumerate(code)]
    openings = ["def fib(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):", "for i in range(",
                "# Licensed under", "with open(path) as f:", "try:\n    import json\nexcept", "x = [1, 2, 3]\n"]
    short = [tok.encode(t) for t in openings[:n - n_code - n_rand]]
    g = torch.Generator().manual_seed(0)
    rand = [torch.randint(0, vocab, (int(m),), generator=g).tolist() for m in torch.randint(8, 64, (n_rand,), generator=g)]
    mixed = []  # interleaved: every batch of 8 mixes the three kinds
    for i in range(len(code)):
        mixed += [kind[i] for kind in (code, short, rand) if i < len(kind)]
    return mixed


def run(llm, prompts, params, batch, abort=None):
    """Outputs (token ids, text, finish reason, stop reason) of prompts, `batch` at a time; abort (index, after n
    tokens) cancels that request once it has n tokens while the others continue."""
    e, outs = llm.engine, []
    for s in range(0, len(prompts), batch):
        reqs = [e.add_request(p, sp) for p, sp in zip(prompts[s:s + batch], params[s:s + batch])]
        while e.has_work():
            e.step()
            if abort is not None and s <= abort[0] < s + batch:
                r = reqs[abort[0] - s]
                if not r.finished and len(r.output_ids) >= abort[1]:
                    e.abort(r)
        outs += [(r.output_ids, r.text, r.finish_reason, r.stop_reason) for r in reqs]
    return outs


def stop_case(ref_full, prompts, gen):
    """8 requests: stop strings, a stop id and max_tokens that end mid-step, beside requests that run to the end
    (request 7 is aborted on the way). Stops are taken from speculation off's own output."""
    params = []
    for i in range(8):
        ids, text = ref_full[i][0], ref_full[i][1]
        kw = dict(temperature=0, max_tokens=gen, ignore_eos=True)
        if i in (0, 1):  # a stop string from the middle of the text (it spans tokens)
            j = len(text) // 3 + 5 * i
            kw["stop"] = [text[j:j + 3]]
        elif i == 2:
            kw["stop_token_ids"] = [ids[gen // 2 + 1]]
        elif i in (3, 4):
            kw["max_tokens"] = (gen // 5 + 1, gen // 2 + 3)[i - 3]
        params.append(sd.SamplingParams(**kw))
    return prompts[:8], params


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"},
                                          "ok": {"type": "boolean"}}, "required": ["name", "size", "ok"]}


def processor_case(prompts, gen, vocab):
    """8 requests with vLLM's logits processors (issue 24): penalties (Qwen's presence_penalty 1.5 among them),
    min_tokens, a logit_bias, bad words; and 4 requests constrained to a JSON schema (xgrammar). Each position of a
    verify step must see its own history, so speculation on == off."""
    pen = [sd.SamplingParams(temperature=0, max_tokens=gen // 2, ignore_eos=i % 2 == 0, min_tokens=gen // 8,
                             presence_penalty=1.5 if i % 4 < 2 else 0.0, frequency_penalty=0.4 * (i % 3),
                             repetition_penalty=(1.0, 1.15, 1.3)[i % 3], logit_bias={(37 * i) % vocab: -3.0},
                             bad_words=["import"] if i == 5 else None)
           for i in range(8)]
    js = [sd.SamplingParams(temperature=0, max_tokens=96, structured_outputs={"json": SCHEMA})] * 4
    return prompts[:8] + prompts[8:12], pen + js


def sweep(device, dtype, n_prompts, gen, methods, edge_gen=64, log=print, quantization=None):
    base = sd.LLM(model=os.path.join(MODELS, "toy"), device=device, dtype=dtype, quantization=quantization)
    tok, vocab = base.tokenizer, base.cfg.vocab_size
    prompts = make_prompts(tok, n_prompts, vocab)
    edges = [prompts[0][:n] for n in range(1, 11)]
    full = [sd.SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)] * len(prompts)
    short = [sd.SamplingParams(temperature=0, max_tokens=edge_gen, ignore_eos=True)] * len(edges)
    t0 = time.perf_counter()
    ref = run(base, prompts, full, 1)
    ref_edges = run(base, edges, short, 1)
    s_prompts, s_params = stop_case(ref, prompts, gen)
    ref_stops = run(base, s_prompts, s_params, 1)
    p_prompts, p_params = processor_case(prompts, gen, vocab)
    ref_proc = run(base, p_prompts, p_params, 1)
    assert all(isinstance(json.loads(r[1]), dict) for r in ref_proc[8:] if r[2] == "stop"), "JSON does not parse"
    assert [r[2] for r in ref_stops[:5]] == ["stop"] * 3 + ["length"] * 2, "the stop case does not stop mid-run"
    no_draft = [sum(not sd.ngram_lookup(p, 4, 2, 5) for p in prompts[s:s + 8]) for s in range(0, len(prompts), 8)]
    log(f"reference (speculation off, each alone): {len(prompts)} prompts x {gen} tokens, {len(edges)} edge prompts, "
        f"{time.perf_counter() - t0:.1f} s; prompts per batch of 8 without an ngram draft at their first step: "
        f"{no_draft}")
    del base
    rows, total_seqs, total_toks, total_diff = {}, 0, 0, 0
    for name, cfg in {"off": None, **methods}.items():
        t0 = time.perf_counter()
        llm = sd.LLM(model=os.path.join(MODELS, "toy"), device=device, dtype=dtype, speculative_config=cfg,
                     quantization=quantization)
        got = {"alone": run(llm, prompts, full, 1), "batch8": run(llm, prompts, full, 8),
               "edges": run(llm, edges, short, 1), "stops+abort": run(llm, s_prompts, s_params, 8, abort=(7, gen // 4)),
               "processors": run(llm, p_prompts, p_params, 8)}
        want = {"alone": ref, "batch8": ref, "edges": ref_edges, "stops+abort": ref_stops, "processors": ref_proc}
        diffs, seqs, toks = {}, 0, 0
        for part in got:
            for i, (a, b) in enumerate(zip(got[part], want[part])):
                seqs += 1
                toks += len(b[0])
                if part == "stops+abort" and i == 7:  # aborted: a prefix of speculation off's output
                    same = a[2] == "abort" and a[0] == b[0][:len(a[0])] and len(a[0]) >= gen // 4
                else:
                    same = a == b
                if not same:
                    first = next((j for j, (x, y) in enumerate(zip(a[0], b[0])) if x != y), min(len(a[0]), len(b[0])))
                    diffs.setdefault(part, []).append((i, first))
        m = llm.engine.stats
        ndiff = sum(len(v) for v in diffs.values())
        rows[name] = dict(sequences=seqs, tokens=toks, differing=ndiff, diffs=diffs, seconds=time.perf_counter() - t0,
                          mean_acceptance_length=m.mean_acceptance_length if cfg else None)
        total_seqs, total_toks, total_diff = total_seqs + seqs, total_toks + toks, total_diff + ndiff
        acc = f", mean acceptance length {m.mean_acceptance_length:.2f}" if cfg else ""
        log(f"{name:16s} {seqs} sequences, {toks} tokens compared, {ndiff} differing{acc}, "
            f"{rows[name]['seconds']:.1f} s" + (f"  DIFFS {diffs}" if diffs else ""))
        del llm
    what = f"{device} {dtype}" + (f", {quantization} weights" if quantization else "")
    summary = (f"lossless sweep: {len(rows)} configs ({what}), {total_seqs} sequences, {total_toks} tokens "
               f"compared, {total_diff} differing")
    return summary, rows, total_diff


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--edge-gen", type=int, default=64)
    ap.add_argument("--methods", nargs="*", default=None, help="names from METHODS (default: all)")
    ap.add_argument("-q", "--quantization", default=None, help="fp8: the toy model's weights quantized at load")
    ap.add_argument("--long-cache", action="store_true", help="the attention's key pieces and programs made small "
                    "(kernels.ATTN_CHUNK 64, DRAFT_ATTN_CHUNK 32, ATTN_PROGRAMS 2), so that every row spans more "
                    "pieces than programs: the path a cache of max_model_len >= 32768 takes at the real sizes")
    a = ap.parse_args()
    if a.long_cache:
        sd.K.ATTN_CHUNK, sd.K.DRAFT_ATTN_CHUNK, sd.K.ATTN_PROGRAMS = 64, 32, 2
    methods = {k: v for k, v in METHODS.items() if a.methods is None or k in a.methods}
    summary, rows, ndiff = sweep(a.device, a.dtype, a.prompts, a.gen, methods, a.edge_gen, quantization=a.quantization)
    print(summary)
    print(json.dumps(dict(summary=summary, rows=rows)))
    return 1 if ndiff else 0


if __name__ == "__main__":
    sys.exit(main())
