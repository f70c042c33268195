"""Where a target step's device time goes, on the GPU, at the real shapes with random weights.

    python tools/profile_step.py --random-weights 27b --steps 1x1 8x1 1x2 1x16 --kernels 1x1 8x1 --gemms 1 8

--steps BxT: captured-graph replay time of one target step (B sequences, T tokens each; T > 1 = verify + commit)
             at context length --ctx, random tokens (bench.step_ids: a MoE routes them as text; for a MoE the
             distinct experts a layer they read).
--kernels BxT: one eager step under torch.profiler, CUDA time summed per kernel name (top 25; a kernel
             launched with PDL, kernels._pdl, counts its wait for the kernel before it).
--gemms M:   every weight shape the step multiplies by, all weights of that shape chained in one CUDA graph:
             cuBLAS (what the engine runs) against a split-K Triton GEMV, in GB/s (bf16 weights only).
-q fp8:      the weights quantized as --quantization fp8 does; --no-pdl: every kernel launched without
             programmatic dependent launch, so that --kernels gives each kernel's own time.
--ab NAME=V1,V2[,...]: instead of --kernels / --gemms, an A/B of a kernels.py switch in one process: --steps timed
             with kernels.NAME set to each value in turn (a fresh ModelRunner each, its graphs captured under it),
             the values' rows interleaved over --rounds rounds, e.g. --ab MOE_SUM_NORM=False,True.
--draft-lm B [B ...]: instead, draft_model's propose step (k = 4, a random Qwen3-0.6B-shaped draft LM): graph
             replay time and an eager step's kernels, at these batch sizes; with --ab, the graph's time under each
             value (captured afresh for each, interleaved over --rounds rounds) and each value's median, e.g.
             --draft-lm 1 2 4 8 --ab GEMV_PREFETCH=False,True.
Not part of the engine: a measuring tool for deciding which kernels to write next.
"""
import argparse
import ast
import collections
import contextlib
import functools
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bench  # noqa: E402
import specdec as sd  # noqa: E402


@triton.jit
def _gemv(p_x, p_w, p_y, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    i_n, i_k = tl.program_id(0), tl.program_id(1)
    rn = i_n * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(i_k * BK, K, BK * SPLIT):
        rk = k0 + tl.arange(0, BK)
        w = tl.load(p_w + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        if BM == 1:
            x = tl.load(p_x + rk, mask=rk < K, other=0.0).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x[None, :], 1)[None, :]
        else:
            x = tl.load(p_x + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            acc += tl.dot(x, tl.trans(w))
    m = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT == 1:
        tl.store(p_y + rm[:, None] * N + rn[None, :], acc.to(p_y.dtype.element_ty), mask=m)
    else:
        tl.atomic_add(p_y + rm[:, None] * N + rn[None, :], acc, mask=m)


def triton_gemv(x, w, BN, BK, split, stages, warps, y):
    M, K = x.shape
    N = w.shape[0]
    BM = 1 if M == 1 else 16
    if split > 1:
        y.zero_()
    _gemv[(triton.cdiv(N, BN), split)](x, w, y, M, N, K, BM=BM, BN=BN, BK=BK, SPLIT=split, num_warps=warps,
                                        num_stages=stages)
    return y


def step_weights(model):
    """The weights one step multiplies by, fused as the engine runs them (bench.linear_weights, no experts)."""
    return bench.linear_weights(model, 0)


def gemms(model, Ms):
    by_shape = collections.defaultdict(list)
    for w in step_weights(model):
        by_shape[tuple(w.shape)].append(w)
    tot = {}
    for M in Ms:
        print(f"## GEMMs at M={M}: shape x count, cuBLAS us/GEMM (GB/s), best Triton us/GEMM (GB/s) [config]")
        tot_c = tot_t = 0.0
        for shape, ws in sorted(by_shape.items(), key=lambda kv: -kv[0][0] * kv[0][1] * len(kv[1])):
            N, K = shape
            x = torch.randn(M, K, device="cuda", dtype=ws[0].dtype)
            gb = N * K * 2 / 1e9
            c = bench.graph_ms(lambda: [x @ w.t() for w in ws]) / len(ws)
            best = None
            for BN, BK in ((16, 512), (32, 256), (64, 256), (64, 128), (128, 128)):
                ctas = triton.cdiv(N, BN)
                split = 1
                while ctas * split < 264 and K // (BK * split * 2) >= 2:
                    split *= 2
                for stages, warps in ((3, 4), (4, 4), (4, 8)):
                    ys = [torch.empty(M, N, device="cuda", dtype=torch.float32 if split > 1 else x.dtype) for _ in ws]
                    try:
                        t = bench.graph_ms(lambda: [triton_gemv(x, w, BN, BK, split, stages, warps, y)
                                                    for w, y in zip(ws, ys)])
                    except Exception:  # out of resources for this config
                        continue
                    t /= len(ws)
                    if best is None or t < best[0]:
                        best = (t, f"BN{BN} BK{BK} split{split} st{stages} w{warps}")
            ref = x @ ws[0].t()
            got = triton_gemv(x, ws[0], 64, 256, 4, 3, 4, torch.empty(M, N, device="cuda", dtype=torch.float32))
            err = (got.float() - ref.float()).abs().max().item()
            tot_c += c * len(ws) * 1e3
            tot_t += best[0] * len(ws) * 1e3
            print(f"{N}x{K} x{len(ws)}: cuBLAS {c * 1e3:.1f} us ({gb / c * 1e3:.0f} GB/s) | Triton {best[0] * 1e3:.1f} us "
                  f"({gb / best[0] * 1e3:.0f} GB/s) [{best[1]}] max|diff| {err:.3g}", flush=True)
        print(f"total per step: cuBLAS {tot_c / 1e3:.2f} ms, best Triton per shape {tot_t / 1e3:.2f} ms", flush=True)
        tot[M] = (tot_c, tot_t)
    return tot


def kernel_table(fn, title, reps=1, top=25):
    """fn() run reps times eagerly under torch.profiler (after one warm-up run): CUDA time and launches per
    kernel name, per run, the top ones printed under `title`."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            agg[ev.name][0] += ev.device_time / reps
            agg[ev.name][1] += 1
    total = sum(v[0] for v in agg.values())
    print(f"## {title}: {total / 1e3:.3f} ms device time, {sum(v[1] for v in agg.values()) // reps} launches")
    for name, (us, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{us:9.1f} us {100 * us / total:5.1f}% {n // reps:5d}x  {name[:110]}")


def draft_lm(batches, target="27b", k=4, ctx=512, switch=None, rounds=3):
    """draft_model's propose step (a random Qwen3-0.6B-shaped draft, bench.random_draft_lm, with the target's
    vocabulary; no target loaded): its CUDA graph's replay time, then one eager step's kernels (with PDL,
    kernels._pdl, a kernel's time includes its wait for the one before). switch ("NAME=V1,V2", --ab): instead,
    the graph's time under each value of that kernels.py switch, captured afresh for each, the values
    interleaved over rounds, and each value's median."""
    import types
    dev = torch.device("cuda")
    path = bench.random_draft_lm("/tmp/profile-draft-lm", target)
    vocab = types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=bench.PRESETS[target]["vocab_size"]))
    io = sd.ProposerIO(vocab, None, max(batches), ctx + 2 * k + 2, torch.bfloat16, dev,
                       h2d=lambda x, d=None: torch.as_tensor(x, dtype=d, device=dev), call=None)
    pr = sd.DraftModelProposer(types.SimpleNamespace(num_speculative_tokens=k, draft_sample_method="greedy",
                                                     model=path), io)
    with torch.inference_mode():
        for s in range(max(batches)):  # each slot's cache over a ctx-token prompt
            ids = torch.randint(0, 1000, (1, ctx), device=dev)
            pr.model(ids, sd.Ctx(pr.state, torch.tensor([s], device=dev), torch.zeros(1, dtype=torch.long,
                                                                                      device=dev), ctx, "prefill"))
        runs = {}  # batch size -> the propose step over its first pass's tokens (as propose), a graph's kv_len
        for B in batches:
            slots, start = torch.arange(B, device=dev), torch.full((B,), ctx, device=dev)
            ids = torch.randint(0, 1000, (B, pr.width), device=dev)
            runs[B] = functools.partial(pr._draft, pr.state.max_len, slots, start, ids,
                                        torch.full((B,), pr.width, device=dev))
        if not switch:
            for B, run in runs.items():
                print(f"draft_model propose, batch {B}, k={k}: {bench.graph_ms(run):.3f} ms (graph replay)",
                      flush=True)
                kernel_table(run, f"kernels of one eager propose, batch {B}", top=10)
            return
        name, values = parse_switch(switch)
        times = collections.defaultdict(list)  # (B, value) -> ms per round
        for r in range(rounds):
            for B, run in runs.items():
                for v in values:
                    with kernels_switch(name, v):
                        times[B, v].append(bench.graph_ms(run, iters=50))
                    print(f"round {r} batch {B} {name}={v!r}: {times[B, v][-1]:.3f} ms", flush=True)
    for (B, v), ts in times.items():
        print(f"draft_model propose, batch {B}, k={k}, {name}={v!r}: {statistics.median(ts):.3f} ms (graph replay, "
              f"median of {len(ts)})")


def parse_switch(switch):
    """"NAME=V1,V2" -> (NAME, [V1, V2]): a kernels.py switch and its values (Python literals, tuples too:
    "GDN_TILE=(16,1),(32,2)")."""
    name, values = switch.split("=", 1)
    assert hasattr(sd.K, name), f"kernels.py has no {name}"
    return name, ast.literal_eval(f"[{values}]")


@contextlib.contextmanager
def kernels_switch(name, value):
    """kernels.NAME set to value inside the block, restored after."""
    old = getattr(sd.K, name)
    setattr(sd.K, name, value)
    try:
        yield
    finally:
        setattr(sd.K, name, old)


def ab(model, steps, ctx, switch, rounds):
    """--ab: the captured steps under each value of a kernels.py switch, the values' rows interleaved by round."""
    name, values = parse_switch(switch)
    steps = [tuple(map(int, s.split("x"))) for s in steps]
    built = []  # per value: its runner (the graphs' memory) and its graphs, one a step
    for v in values:
        with kernels_switch(name, v), torch.inference_mode():
            runner = sd.ModelRunner(model, None, max(8, *(B for B, _ in steps)), ctx + 64, torch.bfloat16,
                                    torch.device("cuda"))
            built.append((runner, [bench.target_graph(runner, B, T, ctx) for B, T in steps]))
    for r in range(rounds):
        for v, (_, graphs) in zip(values, built):
            ms = [bench.step_ms(g, iters=100) for g in graphs]
            print(f"round {r} {name}={v!r}: " + "  ".join(f"B={B} T={T} {t:.3f} ms" for (B, T), t in zip(steps, ms)),
                  flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random-weights", default="27b", choices=list(bench.PRESETS))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", nargs="*", default=["1x1", "8x1", "1x2", "1x16"])
    ap.add_argument("--kernels", nargs="*", default=["1x1"])
    ap.add_argument("--gemms", type=int, nargs="*", default=[])
    ap.add_argument("-q", "--quantization", default=None, choices=["fp8"], help="the weights in FP8, as bench.py -q")
    ap.add_argument("--no-pdl", action="store_true",
                    help="kernels without programmatic dependent launch: each kernel's time in --kernels is its own")
    ap.add_argument("--ab", default=None, metavar="NAME=V1,V2",
                    help="time --steps (or --draft-lm's propose graph) under each value of the kernels.py "
                    "switch NAME, interleaved (an A/B)")
    ap.add_argument("--rounds", type=int, default=3, help="--ab: rounds over the values")
    ap.add_argument("--draft-lm", type=int, nargs="*", default=None, metavar="B",
                    help="only draft_model's propose step (Qwen3-0.6B shapes) at these batch sizes")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.no_pdl:
        sd.K._PDL_DEVICES[torch.device("cuda", torch.cuda.current_device())] = False
    if a.draft_lm:
        return draft_lm(a.draft_lm, a.random_weights, switch=a.ab, rounds=a.rounds)
    model, cfg = bench.random_model(a.random_weights, torch.bfloat16, torch.device("cuda"), quantization=a.quantization)
    ws = bench.linear_weights(model, cfg.num_experts_per_tok)
    print(f"# {a.random_weights}: GEMM floor (per-projection weights, as bench.py) M=1 "
          f"{bench.gemm_floor(ws, 1):.2f} ms; fused weights as the engine runs them "
          f"{bench.gemm_floor(step_weights(model), 1):.2f} ms", flush=True)
    if a.ab:
        return ab(model, a.steps, a.ctx, a.ab, a.rounds)
    runner = sd.ModelRunner(model, None, 8, a.ctx + 64, torch.bfloat16, torch.device("cuda"))
    with torch.inference_mode():
        for s in a.steps:
            B, T = map(int, s.split("x"))
            g = bench.target_graph(runner, B, T, a.ctx)
            ms = bench.step_ms(g)
            e = bench.step_experts(runner, B, T, a.ctx)
            print(f"step B={B} T={T}: {ms:.3f} ms (graph replay)" + (f", {e:.1f} experts a layer" if e else ""),
                  flush=True)
        for s in a.kernels:
            B, T = map(int, s.split("x"))
            ids = bench.step_ids(runner.model, B, T).cuda()
            ctx = sd.Ctx(runner.state, torch.arange(B, device="cuda"), torch.full((B,), a.ctx, device="cuda"),
                         a.ctx + T, "verify" if T > 1 else "decode")

            def fwd():
                h = model(ids, ctx)
                model.logits(h)
                if T > 1:
                    model.commit(ctx, torch.full((B,), T, device="cuda"))
            kernel_table(fwd, f"kernels of one eager step B={B} T={T}", reps=3)
    if a.gemms:
        gemms(model, a.gemms)


if __name__ == "__main__":
    main()
