"""Acceptance of every speculative method on the shipped toy model, on held-out stdlib files.

    python tools/eval_toy.py [--device cpu|cuda] [--dtype float32|bfloat16] [--prompts 8] [--gen 128] [-q fp8]
    python tools/eval_toy.py --loss [-q fp8]       (held-out loss, nats/token, as tools/train_toy.py measures it)
    python tools/eval_toy.py --speed --device cuda --dtype bfloat16 --methods "ngram k=4" "draft_model k=4"

--speed adds each method's decoding speed at batch 1 on these prompts (real acceptance): after every prompt alone
untimed (graph capture, kernel compilation), every prompt alone, generated tokens over the time (prefill
included), and its ratio to speculation off's.

Prompts: the first 128 tokens of windows taken from the held-out files listed in models/train_log.json (read
from this machine's stdlib; files missing here are skipped). Greedy, 128 generated tokens. For each method:
mean acceptance length, draft acceptance rate, and whether the tokens equal speculation-off's. Prints a
markdown table, then one JSON line.
"""
import argparse
import json
import os
import sys
import sysconfig
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import specdec as sd  # noqa: E402

METHODS = {
    "mtp k=1": {"method": "mtp", "num_speculative_tokens": 1},
    "mtp k=3": {"method": "mtp", "num_speculative_tokens": 3},
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "draft_model k=4": {"method": "draft_model", "model": os.path.join(ROOT, "models", "toy-draft"),
                        "num_speculative_tokens": 4},
    "dflash block 8": {"method": "dflash", "model": os.path.join(ROOT, "models", "toy-dflash"),
                       "num_speculative_tokens": 7},
    "dspark block 8": {"method": "dspark", "model": os.path.join(ROOT, "models", "toy-dspark"),
                       "num_speculative_tokens": 8},
}
METHODS = {k: v for k, v in METHODS.items() if os.path.isdir(v.get("model", ROOT))}  # drafters not trained: left out


def held_out_prompts(tok, n, plen, models_dir):
    with open(os.path.join(models_dir, "train_log.json")) as fh:
        files = json.load(fh)["held_out_files"]
    root = sysconfig.get_paths()["stdlib"]
    prompts = []
    for f in files:
        p = os.path.join(root, f)
        if not os.path.isfile(p) or f.startswith("encodings/cp"):  # code-page tables are not code
            continue
        ids = tok.encode(open(p, encoding="utf-8").read(), allow_special=False)
        for s in range(0, len(ids) - plen - 128, max(1, (len(ids) - plen) // 3))[:2]:
            prompts.append(ids[s:s + plen])
    return prompts[:n]


def held_out_loss(model_dir, device, dtype, quantization=None, L=512, n=64):
    """Mean -log p(token) over the first n windows of L tokens of the held-out files (each file's tokens then
    <|endoftext|>, in train_log.json's order, as tools/train_toy.py evaluates), from prompt logprobs."""
    llm = sd.LLM(model=model_dir, device=device, dtype=dtype, quantization=quantization, max_model_len=L + 8)
    with open(os.path.join(os.path.dirname(model_dir), "train_log.json")) as fh:
        files = json.load(fh)["held_out_files"]
    root, tok, ids = sysconfig.get_paths()["stdlib"], llm.tokenizer, []
    for f in files:
        if os.path.isfile(os.path.join(root, f)):
            ids += tok.encode(open(os.path.join(root, f), encoding="utf-8").read(), allow_special=False)
            ids.append(llm.cfg.eos_token_ids[0])
    windows = [ids[i * L:(i + 1) * L] for i in range(min(n, len(ids) // L))]
    outs = llm.generate(windows, sd.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    lps = [next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]]
    return -sum(lps) / len(lps), len(windows)


def batch1_tok_s(llm, prompts, sp):
    """Generated tokens per second with every prompt alone (batch 1), the host's clock around each; after the
    same pass untimed, which makes the batch-1 graphs and every kernel variant the prompts reach (on a cold Triton
    cache a warm-up of one prompt left compiles in the timed pass: session 37's H200, draft_model 1.16x, and 2.08x
    in the next run of the same code, its kernels then in the cache)."""
    sync = torch.cuda.synchronize if torch.device(llm.engine.runner.device).type == "cuda" else lambda: 0
    for p in prompts:
        llm.generate([p], sp, use_tqdm=False)
    n, secs = 0, 0.0
    for p in prompts:
        sync()
        t = time.perf_counter()
        out = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
        sync()
        secs += time.perf_counter() - t
        n += len(out.token_ids)
    return n / secs


def evaluate(model_dir, device, dtype, n_prompts, plen, gen, methods, quantization=None, speed=False):
    base = sd.LLM(model=model_dir, device=device, dtype=dtype, quantization=quantization)
    prompts = held_out_prompts(base.tokenizer, n_prompts, plen, os.path.dirname(model_dir))
    sp = sd.SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    t = time.perf_counter()
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, sp)]
    rows = {"off": dict(seconds=time.perf_counter() - t)}
    if speed:
        rows["off"]["tok_s_batch1"] = batch1_tok_s(base, prompts, sp)
    for name, cfg in methods.items():
        try:
            llm = sd.LLM(model=model_dir, device=device, dtype=dtype, speculative_config=cfg,
                         quantization=quantization)
        except sd.ConfigError as e:
            rows[name] = dict(error=str(e))
            continue
        t = time.perf_counter()
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        s = llm.engine.stats
        rows[name] = dict(mean_acceptance_length=s.mean_acceptance_length, draft_acceptance_rate=s.draft_acceptance_rate,
                          per_position=[a / max(s.num_drafts, 1) for a in s.accepted_per_pos],
                          equal_to_off=outs == ref, seconds=time.perf_counter() - t)
        if speed:
            rows[name]["tok_s_batch1"] = v = batch1_tok_s(llm, prompts, sp)
            rows[name]["x_off_batch1"] = v / rows["off"]["tok_s_batch1"]
    return prompts, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "toy"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("-q", "--quantization", default=None, help="fp8: the weights quantized at load")
    ap.add_argument("--loss", action="store_true", help="the held-out loss instead of the acceptance table")
    ap.add_argument("--methods", nargs="*", default=None, help="names from METHODS (default: all)")
    ap.add_argument("--speed", action="store_true", help="also each method's batch-1 tok/s and its ratio to off")
    a = ap.parse_args()
    methods = {k: v for k, v in METHODS.items() if a.methods is None or k in a.methods}
    if a.loss:
        loss, n = held_out_loss(a.model, a.device, a.dtype, a.quantization)
        print(f"held-out loss: {loss:.4f} nats/token ({n} windows of 512 tokens; {a.device} {a.dtype}, "
              f"weights {a.quantization or 'as stored'})")
        return
    prompts, rows = evaluate(a.model, a.device, a.dtype, a.prompts, a.prompt_len, a.gen, methods, a.quantization,
                             a.speed)
    sp_head, sp_rule = (" batch-1 tok/s | x off |", "---|---|") if a.speed else ("", "")
    speed = lambda r: f" {r['tok_s_batch1']:.1f} | {r.get('x_off_batch1', 1):.2f} |" if a.speed else ""
    print("| method | mean acceptance length | draft acceptance rate | per position | == spec off | seconds |" + sp_head)
    print("|---|---|---|---|---|---|" + sp_rule)
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | not run: {r['error']} | | | | |")
        elif name == "off":
            print(f"| off | 1 | | | | {r['seconds']:.1f} |" + speed(r))
        else:
            pp = ", ".join(f"{x:.2f}" for x in r["per_position"])
            print(f"| {name} | {r['mean_acceptance_length']:.2f} | {r['draft_acceptance_rate']:.2f} | {pp} | "
                  f"{r['equal_to_off']} | {r['seconds']:.1f} |" + speed(r))
    print(json.dumps({"device": a.device, "dtype": a.dtype, "quantization": a.quantization, "prompts": len(prompts), "prompt_len": a.prompt_len,
                      "gen": a.gen, "rows": rows}))


if __name__ == "__main__":
    main()
