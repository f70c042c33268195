"""bench.py - how fast specdec runs, in vLLM's metric language, against the floors measured in the same run.

    python bench.py --random-weights 27b --batch 1 8 --prompt-len 512 --gen-len 128
    python bench.py --random-weights 27b --speculative-config '{"method":"mtp","num_speculative_tokens":1,
        "rejection_sample_method":"synthetic","synthetic_acceptance_rates":[0.85]}'
    python bench.py --model PATH --speculative-config '{"method":"ngram","num_speculative_tokens":4}'
    python bench.py serve --url http://127.0.0.1:8000 --num-prompts 32 --max-concurrency 4

Offline mode reports TTFT, TPOT, tok/s per sequence and aggregate, acceptance, the weight bandwidth achieved,
and the GEMM-only floor (every linear layer's GEMM chained in one CUDA graph, as in h200-anchors.md) with our
TPOT as a ratio of it. A table first, then one JSON line last.
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch

import specdec as sd

PRESETS = {  # the real text_config shapes (qwen36-architecture.md §1.3, §1.4)
    "27b": dict(model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64, intermediate_size=17408,
                num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320,
                mtp_num_hidden_layers=1, eos_token_id=248044,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
    "35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                    linear_key_head_dim=128, linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=248320,
                    mtp_num_hidden_layers=1, eos_token_id=248044,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
    "tiny": dict(model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=1024,
                 mtp_num_hidden_layers=1, eos_token_id=0,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
}


def random_model(name, dtype, device, seed=0):
    """The real-shape model with random weights made on the device (no checkpoint)."""
    cfg = sd.ModelConfig.from_dict(PRESETS[name])
    with torch.device("meta"):
        model = sd.Qwen36(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name_, p in list(model.named_parameters()):
        mod = model.get_submodule(name_.rsplit(".", 1)[0]) if "." in name_ else model
        leaf = name_.rsplit(".", 1)[-1]
        if leaf == "A_log":
            t = torch.empty(p.shape, device=device).uniform_(0, 2.7, generator=gen)
        elif leaf == "dt_bias" or name_.endswith("linear_attn.norm.weight"):
            t = torch.ones(p.shape, device=device, dtype=dtype)
        elif "norm" in name_:
            t = torch.zeros(p.shape, device=device, dtype=dtype)
        else:
            t = torch.empty(p.shape, device=device, dtype=dtype).normal_(0, 0.02, generator=gen)
        mod._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
    for mod in model.modules():
        if isinstance(mod, sd.Attention):
            rd = cfg.rotary_dim
            mod.inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, rd, 2, device=device).float() / rd)
    return model.eval(), cfg


def linear_weights(model, moe_active=None):
    """The weight matrices one decode step reads: every linear layer and the lm_head (for MoE: the router,
    `moe_active` experts per layer and the shared expert). Returns a list of [out, in] tensors."""
    ws = []
    for name, mod in model.named_modules():
        if name.startswith("mtp"):
            continue
        if isinstance(mod, torch.nn.Linear):
            ws.append(mod.weight)
        elif isinstance(mod, sd.MoE):
            for e in range(moe_active):
                ws += [mod.experts.gate_up_proj[e], mod.experts.down_proj[e]]
    if model.lm_head is None:  # tied: the embedding is the lm_head (an untied lm_head is a Linear, counted above)
        ws.append(model.embed_tokens.weight)
    return ws


def gemm_floor(ws, M, iters=20):
    """ms per step of a CUDA graph chaining x @ W^T over all weights at M tokens."""
    xs = {w.shape[1]: torch.randn(M, w.shape[1], device=w.device, dtype=w.dtype) for w in ws}
    outs = [None] * len(ws)

    def chain():
        for i, w in enumerate(ws):
            outs[i] = xs[w.shape[1]] @ w.t()
    chain()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g, outs
    return statistics.median(times)


def run_batch(model, spec, B, prompt_len, gen_len, device, dtype, enforce_eager, seed=0):
    """B concurrent requests of random prompts; returns per-request timings and acceptance stats."""
    k = spec.num_speculative_tokens if spec else 0
    eng = sd.Engine(model, None, spec, B, prompt_len + gen_len + 8, dtype, device, seed, enforce_eager)
    g = torch.Generator().manual_seed(seed)
    V = model.cfg.vocab_size
    sp = sd.SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    # warm-up: captures the graphs of this batch size (and compiles kernels) outside the timed run
    warm = [eng.add_request(torch.randint(0, V, (prompt_len,), generator=g).tolist(), sd.SamplingParams(
        temperature=0, max_tokens=min(8, gen_len), ignore_eos=True)) for _ in range(B)]
    while eng.has_work():
        eng.step()
    eng.stats = sd.SpecStats()
    reqs = [eng.add_request(torch.randint(0, V, (prompt_len,), generator=g).tolist(), sp) for _ in range(B)]
    torch.cuda.synchronize() if device.type == "cuda" else None
    t0 = time.perf_counter()
    for r in reqs:
        r.arrival_time = t0
    while eng.has_work():
        eng.step()
    t1 = time.perf_counter()
    ttft = [r.first_token_time - r.arrival_time for r in reqs]
    tpot = [(r.finish_time - r.first_token_time) / (len(r.output_ids) - 1) for r in reqs]
    n_out = sum(len(r.output_ids) for r in reqs)
    st = eng.stats
    del eng
    return dict(ttft_ms=1e3 * statistics.mean(ttft), tpot_ms=1e3 * statistics.mean(tpot), wall_s=t1 - t0,
                tok_s_per_seq=1 / statistics.mean(tpot), tok_s_aggregate=n_out / (t1 - t0),
                decode_tok_s_aggregate=B / statistics.mean(tpot), num_drafts=st.num_drafts,
                mean_acceptance_length=st.mean_acceptance_length if st.num_drafts else None,
                draft_acceptance_rate=st.draft_acceptance_rate if st.num_drafts else None)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        from bench_serve import serve_benchmark  # noqa  (the HTTP client lives beside the offline bench)
        return serve_benchmark(argv[1:])
    ap = argparse.ArgumentParser(description="specdec offline benchmark")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory or .gguf")
    src.add_argument("--random-weights", choices=list(PRESETS), help="real-shape model with random weights")
    ap.add_argument("--speculative-config", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-floor", action="store_true", help="skip the GEMM-only floor")
    ap.add_argument("--no-triton", action="store_true", help="PyTorch references instead of the Triton kernels")
    a = ap.parse_args(argv)
    device, dtype = sd.resolve_device_dtype(a.device, a.dtype)
    sd.K.USE_TRITON = not a.no_triton
    spec = sd.SpeculativeConfig.from_json(a.speculative_config)
    if a.random_weights or not a.model:
        model, cfg = random_model(a.random_weights or "tiny", dtype, device)
        label = a.random_weights or "tiny"
    else:
        model, cfg, _ = sd.load_model(a.model, dtype, device, want_mtp=spec is not None and spec.method == "mtp")
        label = a.model
    k = spec.num_speculative_tokens if spec else 0
    ws = linear_weights(model, cfg.num_experts_per_tok)
    wbytes = sum(w.numel() * w.element_size() for w in ws)
    rows = []
    for B in a.batch:
        r = run_batch(model, spec, B, a.prompt_len, a.gen_len, device, dtype, a.enforce_eager)
        r.update(batch=B, method=spec.method if spec else "off", k=k)
        if device.type == "cuda" and not a.no_floor:
            r["floor_ms"] = gemm_floor(ws, B * (k + 1))
            r["floor_ms_m1"] = gemm_floor(ws, B)
            r["tpot_over_floor"] = r["tpot_ms"] / r["floor_ms_m1"]
        rows.append(r)
    # acceptance from a separate small engine is not needed: the last run's stats are on the rows
    print(f"# bench {label} dtype={dtype} prompt={a.prompt_len} gen={a.gen_len} spec={a.speculative_config} "
          f"weights read/step={wbytes / 1e9:.2f} GB")
    hdr = ["batch", "TTFT ms", "TPOT ms", "tok/s/seq", "tok/s agg", "GB/s weights", "floor ms", "TPOT/floor", "accept len"]
    print(" | ".join(f"{h:>11}" for h in hdr))
    for r in rows:
        bw = wbytes / (r["tpot_ms"] * 1e-3) / 1e9
        r["weight_GBps"] = bw
        vals = [r["batch"], r["ttft_ms"], r["tpot_ms"], r["tok_s_per_seq"], r["decode_tok_s_aggregate"], bw,
                r.get("floor_ms_m1", float("nan")), r.get("tpot_over_floor", float("nan")),
                r["mean_acceptance_length"] or float("nan")]
        print(" | ".join(f"{v:>11.2f}" if isinstance(v, float) else f"{v:>11}" for v in vals))
    print(json.dumps({"model": label, "dtype": str(dtype), "prompt_len": a.prompt_len, "gen_len": a.gen_len,
                      "speculative_config": a.speculative_config, "weight_bytes": wbytes, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
