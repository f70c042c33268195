"""Losslessness at the real shapes: random bf16 weights of the 27B / 35B-A3B (bench.py's presets), where near-ties
are common, so a row computed differently in a verify or a batch than alone shows up as a different greedy token.

    python tools/invariance_check.py [--models 27b 35b-a3b] [--prompts 8] [--gen 64] [--device cuda]

For each model: 8 random prompts of mixed lengths (17..512 tokens; half of them a repeated segment, so ngram finds
drafts), 64 greedy tokens. Speculation off with each prompt alone is the reference; compared with it, token for
token: speculation off with the 8 as one batch, and MTP k=1, MTP k=3, ngram k=4 and DFlash (a random drafter, block
16) each alone and as one batch of 8 (standard verification: random drafts are mostly rejected, so every step
still runs a verify of k+1 tokens whose first row must equal the decode row). Prints one line per config and the
summary line ("invariance check: ..."); exit status 1 on any difference.
"""
import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bench  # noqa: E402
import specdec as sd  # noqa: E402

CONFIGS = {"off": None,
           "mtp k=1": {"method": "mtp", "num_speculative_tokens": 1},
           "mtp k=3": {"method": "mtp", "num_speculative_tokens": 3},
           "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
           "dflash k=15": {"method": "dflash", "num_speculative_tokens": 15}}


def prompts_for(V, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.linspace(17, 512, n).long().tolist()
    out = []
    for i, m in enumerate(lens):
        if i % 2:  # a repeated segment: ngram drafts from it
            out.append(torch.randint(0, V, (min(48, m),), generator=g).repeat(m // 48 + 1)[:m].tolist())
        else:
            out.append(torch.randint(0, V, (m,), generator=g).tolist())
    return out


def run(model, spec, prompts, gen, batch, device, dtype):
    eng = sd.Engine(model, None, spec, 8, max(map(len, prompts)) + gen + 40, dtype, device)
    sp = sd.SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    outs = []
    for s in range(0, len(prompts), batch):
        reqs = [eng.add_request(p, sp) for p in prompts[s:s + batch]]
        while eng.has_work():
            eng.step()
        outs += [r.output_ids for r in reqs]
    stats = eng.stats
    del eng, reqs
    # each config on a clean device: an engine's graphs and caches live in reference cycles that only the
    # collector frees (session 48's gate: the 35B-A3B's 16th engine in this process, beside 70 GB of bf16
    # weights, failed to capture a graph, "operation failed due to a previous error during capture"; the
    # engines left by earlier configs were the suspect)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return outs, stats


def check(name, n_prompts, gen, device, dtype, drafter_dir, log=print, quantization=None):
    model, cfg = bench.random_model(name, dtype, device, quantization=quantization)
    prompts = prompts_for(cfg.vocab_size, n_prompts)
    ref, _ = run(model, None, prompts, gen, 1, device, dtype)
    rows, compared, differing = {}, 0, 0
    for label, spec in CONFIGS.items():
        if spec is not None and spec["method"] == "dflash":
            spec = dict(spec, model=bench.random_drafter(os.path.join(drafter_dir, name), "dflash", name))
        spec = sd.SpeculativeConfig.from_json(spec)
        for batch in ((8,) if spec is None else (1, 8)):
            t0 = time.perf_counter()
            outs, stats = run(model, spec, prompts, gen, batch, device, dtype)
            diff = [(i, next((j for j, (a, b) in enumerate(zip(o, r)) if a != b), len(r)))
                    for i, (o, r) in enumerate(zip(outs, ref)) if o != r]
            toks = sum(map(len, ref))
            compared += toks
            differing += len(diff)
            acc = f", mean acceptance length {stats.mean_acceptance_length:.2f}" if spec is not None else ""
            key = f"{name}{' ' + quantization if quantization else ''} {label} batch {batch}"
            rows[key] = dict(tokens=toks, differing=diff, seconds=time.perf_counter() - t0)
            log(f"{key:32s} {len(outs)} sequences, {toks} tokens compared, {len(diff)} differing{acc}"
                + (f"  (prompt, first token) {diff}" if diff else ""))
    del model
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows, compared, differing


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["27b", "35b-a3b"], choices=list(bench.PRESETS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("-q", "--quantization", default=None, help="fp8: the random weights quantized (bench.random_model)")
    a = ap.parse_args()
    device, dtype = sd.resolve_device_dtype(a.device, a.dtype)
    rows, compared, differing = {}, 0, 0
    with tempfile.TemporaryDirectory() as d:
        for name in a.models:
            r, c, n = check(name, a.prompts, a.gen, device, dtype, d, quantization=a.quantization)
            rows.update(r)
            compared += c
            differing += n
    what = f"{device.type} {str(dtype)[6:]}" + (f", {a.quantization} weights" if a.quantization else "")
    summary = (f"invariance check: {', '.join(a.models)} ({what}), {len(rows)} runs, "
               f"{compared} tokens compared, {differing} sequences differing")
    print(summary)
    print(json.dumps(dict(summary=summary, rows=rows)))
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
