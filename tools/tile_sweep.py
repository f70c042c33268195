"""The measurements behind the decode tiles in kernels.py, on the GPU (H200: what BENCHMARKS.md cites).

    python tools/tile_sweep.py [moe-fp8] [moe-bf16] [gdn] [gemv] [markov] [rows] [rows-0.6b] [rows17[-m]] [rows40[-m]]
        [rowsbm[-m]] [fp8] [fp8read] [rowsread[-m]] [rowswide[-m]] [fp8bm] [fp8rows[-35b-a3b]] [w8a8] [pdl]
                                                                                          (default: moe-bf16 gdn gemv markov)

Each candidate runs over many layers' worth of distinct weights / states chained in one CUDA graph (so nothing
stays in L2), timed per launch:
  moe-fp8, moe-bf16 (or moe): the 35B MoE decode / verify pair kernels' tiles (kernels.MOE_PAIR_TILES), FP8
          experts / bf16, at 1, 2, 8 and 16 tokens, random routing
  gdn:    the GDN recurrent kernel (27B heads) over value blocks x warps, at B x T = 1x1, 8x1, 1x2, 1x16, 8x2 and the
          state-only commit
  gemv:   the Triton GEMV against cuBLAS at M = 17 and 16 (27B shapes) and M = 1 (35B's small shapes)
  markov: DSpark's greedy Markov stage (V 248320, r 256, 16 steps) over block sizes
  rows:   the batch-invariant linear (one tile config per weight shape, any M) against cuBLAS and the per-M GEMV
          (rows-0.6b: draft_model's Qwen3-0.6B-shaped LM only, at 1, 8 and 16 rows)
  rows17: the batch-invariant linear at 17 rows in 32-row tiles (27B shapes): ROWS_CONFIG's tiles against variants
          of BN, stages and warps with its BK and K split (kernels.ROWS_CONFIG_32), and the same bits as a row alone
  rows40: the same at 40 rows in 64-row tiles (kernels.ROWS_CONFIG_64; the 27B's shapes, also timed at 64 and 128
          rows); rows17-<m>, rows40-<m>: model m's shapes (35b, toy, 0.6b)
  rowsbm: the batch-invariant linear's row tiles (kernels._rows_bm: 16, 32, 64, 128 rows) at 1-136 rows: time, and
          the same bits whatever the tile (rowsbm-27b, rowsbm-35b, rowsbm-toy, rowsbm-0.6b: one model's shapes)
  fp8:    the FP8 decode linear's tiles (kernels.FP8_ROWS_CONFIG) at the 27B / 35B-A3B FP8 shapes, M = 1,
          against a device copy of the same bytes and the same tiles with plain loads (kernels.FP8_TMA off: time,
          bits) (the FP8 MoE pair kernels: moe-fp8, each with its whole layer beside bf16's in moe-bf16)
  fp8rows: the FP8 decode linear at 8 and 16 rows (27B shapes; fp8rows-35b-a3b: the 35B-A3B's): FP8_ROWS_CONFIG's
          tiles against every BN / stages / warps with its K split, and which of them keep a row's bits
  fp8read: how far the FP8 decode linear is from reading its weights at all (27B shapes, M = 1): a read-only kernel
          (xor of the e4m3 bytes as int32 words; plain loads and TMA, tiles x stages x warps x K splits), and the
          linear's own loop in variants (G 128-column blocks an iteration; PRE: x quantized before, so the loop only
          loads it), against the linear at FP8_ROWS_CONFIG's tiles (whose time includes its split-K sum's launch)
  rowsread[-m]: the row-invariant linear at M = 1 (ROWS_CONFIG's tiles, with its split-K sum) against fp8read's
          read-only kernel on the same bf16 bytes (BN x bytes x stages x warps x K split, plain loads and TMA), model
          m's shapes (default 35b) and the shapes' per-token sum
  rowswide[-m]: the row-invariant linear's tiles (ROWS_CONFIG) against a wider candidate set than rows' (16- and
          32-row tiles, BK 256 / 512, 3 / 4 stages, 4 / 8 warps, 1 / 2 / 4 / 8 K splits) at M = 1 and 16, each with its
          split-K sum, model m's shapes but the lm_head (default 35b), the best four also at 40 rows; a row's bits
          are set by BK and the split, so a candidate serves every M (at 32- and 64-row tiles with fewer stages
          where the shared memory needs: kernels._rows_tiles)
  fp8bm:  the FP8 decode linear's row tiles (kernels._fp8_bm) at 1-136 rows: time, and the same bits whatever the tile
  w8a8:   prefill's W8A8 GEMM (kernels._w8a8_kernel) over tile candidates at a 2048-token chunk (27B FP8 shapes),
          against cuBLAS bf16 on the same shapes and against dequantize + cuBLAS
  pdl:    draft_model's small linears chained in a graph: the row-invariant kernel, _linear_small, and
          _linear_small with programmatic dependent launch (kernels.drafting())
Not part of the engine: a measuring tool for choosing kernel configurations.
"""
import contextlib
import os
import sys

import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels as K  # noqa: E402

dev = "cuda"
bf = torch.bfloat16


@contextlib.contextmanager
def entry_kept(table, key):
    """Inside: a part may set (or pop) a kernels.py tile table's entry for key; after: the entry as kernels.py has
    it, so that the parts run after this one measure kernels.py's tiles."""
    had, kept = key in table, table.get(key)
    try:
        yield
    finally:
        table.pop(key, None)
        if had:
            table[key] = kept


def graph_time(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1000  # us per replay


def gdn(B, T, keep=None, L=48, out=True):
    Hk, Hv, D = 16, 48, 128
    pools = [torch.randn(B, Hv, D, D, device=dev) * 0.01 for _ in range(L)]
    q = torch.randn(B, T, Hk, D, device=dev, dtype=torch.bfloat16)
    kk = torch.randn(B, T, Hk, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, T, Hv, D, device=dev, dtype=torch.bfloat16)
    a = torch.randn(B, T, Hv, device=dev, dtype=torch.bfloat16); b = torch.randn(B, T, Hv, device=dev, dtype=torch.bfloat16)
    A_log = torch.randn(Hv, device=dev); dtb = torch.randn(Hv, device=dev)
    slots = torch.arange(B, device=dev)
    n_keep = None if keep is None else torch.full((B,), keep, device=dev, dtype=torch.long)
    o = torch.empty(B, T, Hv, D, device=dev, dtype=torch.bfloat16)
    print(f"== GDN recurrent B={B} T={T} keep={keep} out={out}: us per layer (27B: Hv=48 D=128)")
    for BV, nw in [(8, 1), (8, 2), (16, 1), (16, 2), (16, 4), (32, 2), (32, 4), (64, 4), (64, 8), (128, 8)]:
        f = lambda: [K._gdn_recurrent_kernel[(B * Hv, K._cdiv(D, BV))](
            q, kk, v, a, b, A_log, dtb, pools[l], slots, n_keep if n_keep is not None else slots, o, T, D ** -0.5,
            q.stride(0), q.stride(1), q.stride(2), kk.stride(0), kk.stride(1), kk.stride(2),
            v.stride(0), v.stride(1), v.stride(2), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            HV=Hv, GROUP=Hv // Hk, DK=D, DV=D, BK=D, BV=BV, HAS_KEEP=n_keep is not None, GATES=True,
            OUT=out, p_cx=q, p_cp=pools[l], C=0, s_cxb=0, s_cxt=0, s_cps=0, s_cpc=0, s_cpk=0, CONV=False, KW=1,
            BCW=1, BW=1, num_warps=nw) for l in range(L)]
        t = graph_time(f) / L
        nbytes = B * Hv * D * D * 4 * 2
        print(f"  BV{BV:4d} w{nw}: {t:7.2f} us  state {nbytes / t / 1e6:.2f} TB/s")


def gemms(M, shapes, cfgs, copies=8):
    print(f"== GEMMs M={M}: us per GEMM")
    for (N, Kd) in shapes:
        ws = [torch.randn(N, Kd, device=dev, dtype=bf) * 0.02 for _ in range(copies)]
        x = torch.randn(M, Kd, device=dev, dtype=bf)
        line = [f"{N}x{Kd}"]
        t = graph_time(lambda: [F.linear(x, w) for w in ws]) / copies
        line.append(f"cuBLAS {t:.1f} ({N * Kd * 2 / t / 1e3:.0f} GB/s)")
        ref = F.linear(x, ws[0]).float()
        for c in cfgs:
            try:
                t = graph_time(lambda: [K._gemv_launch(x, w, c) for w in ws]) / copies
                err = (K._gemv_launch(x, ws[0], c).float() - ref).abs().max().item()
                line.append(f"{c}: {t:.1f} ({N * Kd * 2 / t / 1e3:.0f}) e{err:.3f}")
            except Exception as e:  # noqa
                line.append(f"{c}: ERR {type(e).__name__}")
        print("  " + " | ".join(line))


ROWS_SHAPES = {  # the linears of a decode / verify step (fused weights), N x K
    "27b": [(16480, 5120), (14336, 5120), (5120, 6144), (34816, 5120), (5120, 17408), (248320, 5120)],
    "35b": [(12352, 2048), (9216, 2048), (2048, 4096), (1281, 2048), (2048, 512), (248320, 2048)],
    "toy": [(776, 256), (768, 256), (256, 256), (2048, 256), (256, 1024), (8256, 256)],
    "0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (248320, 1024)]}  # draft_model's Qwen3-0.6B
ROWS_CANDIDATES = [(64, 128, 4, 4), (32, 128, 4, 4), (64, 256, 3, 4), (128, 128, 3, 8), (32, 256, 4, 4),
                   (64, 64, 5, 4), (128, 64, 4, 4), (16, 256, 4, 4)]  # (BN, BK, stages, warps); splits below


def rows(Ms=(1, 16, 128), copies=8, models=None):
    """The row-invariant linear (kernels' BATCH_INVARIANT path): per shape, cuBLAS and the old per-M GEMV rule
    against the rule's tiles and candidates (each with K splits 1, 2, 4, 8 where the N blocks are too few), at M
    rows; then the best candidate by M = 1 time (ties: M = 16), as a ROWS_CONFIG line."""
    best = {}
    for model, shapes in ROWS_SHAPES.items():
        if models and model not in models:
            continue
        for (N, Kd) in shapes:
            n = min(64, max(copies, (256 << 20) // (N * Kd * 2) + 1))            # > L2 in all (but tiny ones)
            ws = [torch.randn(N, Kd, device=dev, dtype=bf) * 0.02 for _ in range(n)]
            res = {}
            with entry_kept(K.ROWS_CONFIG, (N, Kd)):
                for M in Ms:
                    x = torch.randn(M, Kd, device=dev, dtype=bf)
                    res[("cuBLAS", M)] = graph_time(lambda: [F.linear(x, w) for w in ws]) / n
                    old = K.BATCH_INVARIANT
                    K.BATCH_INVARIANT = False
                    c = K._gemv_config(M, N, Kd, True, bf)
                    K.BATCH_INVARIANT = old
                    if c is not None and M <= 32:
                        res[("old gemv", M)] = graph_time(lambda: [K._gemv_launch(x, w, c) for w in ws]) / n
                    K.ROWS_CONFIG.pop((N, Kd), None)
                    res[("rule " + str(K._rows_config(N, Kd, x.device)), M)] = \
                        graph_time(lambda: [K._gemv_launch(x, w, "rows") for w in ws]) / n
                    for (BN, BK, st, nw) in ROWS_CANDIDATES:
                        if BK > 2 * K._p2(Kd):
                            continue
                        for sp in (1, 2, 4, 8):
                            if sp > 1 and (K._cdiv(N, BN) * sp > 8 * K._sm_count(x.device) or Kd // (2 * BK) < sp):
                                continue
                            K.ROWS_CONFIG[(N, Kd)] = (BN, BK, sp, st, nw)
                            try:
                                res[((BN, BK, sp, st, nw), M)] = \
                                    graph_time(lambda: [K._gemv_launch(x, w, "rows") for w in ws]) / n
                            except Exception as e:  # noqa
                                print(f"  {(BN, BK, sp, st, nw)}: {type(e).__name__}")
                            K.ROWS_CONFIG.pop((N, Kd))
            cands = {c for c, M in res if isinstance(c, tuple)}
            pick = min(cands, key=lambda c: (round(res[(c, 1)], 1), res[(c, Ms[1])]))
            best[(N, Kd)] = pick
            gb = N * Kd * 2 / 1e3
            print(f"== {model} {N}x{Kd} ({gb / 1e3:.1f} MB): us (TB/s at M=1)")
            for name in ["cuBLAS", "old gemv"] + [c for c, M in res if isinstance(c, str) and c.startswith("rule")][:1] \
                    + [pick]:
                row = [f"M={M} {res[(name, M)]:.1f}" for M in Ms if (name, M) in res]
                if (name, 1) in res:
                    row.append(f"{gb / res[(name, 1)] / 1e3:.2f} TB/s")
                print(f"  {str(name):28s} " + "  ".join(row))
            del ws
    print("ROWS_CONFIG = {" + ", ".join(f"{k}: {v}" for k, v in best.items()) + "}")


def tile_variants(BNs, set_tiles, timed, same_bits):
    """Every (BN, stages, warps) variant of a linear's tiles, each set by set_tiles(BN, stages, warps) (BK and the K
    split are left as they are): [(us, (BN, stages, warps), same bits as the row alone)], fastest first."""
    res = []
    for BN in BNs:
        for st in (2, 3, 4):
            for nw in (4, 8):
                set_tiles(BN, st, nw)
                try:
                    res.append((timed(), (BN, st, nw), same_bits()))
                except Exception as e:  # noqa  (out of shared memory)
                    print(f"  {(BN, st, nw)}: {type(e).__name__}")
    return sorted(res)


def variants_line(res, base):
    """The time of the base tiles' variant, the three fastest, and the variants whose bits differ."""
    tb = next((f"{t:.1f} us" for t, v, same in res if v == base), "not among the variants")
    return (f"{base} {tb}; fastest: " + "; ".join(f"{v} {t:.1f} us, same bits {same}" for t, v, same in res[:3])
            + "; bits differ: " + (", ".join(str(v) for _, v, same in res if not same) or "none"))


def rows_tall(M=17, model="27b", copies=8, also=()):
    """The row-invariant linear at M rows per shape, in the tiles of its height (_rows_bm: 32 rows for 17-32, 64
    for 33-256): ROWS_CONFIG's tiles against every BN / stages / warps with the same BK and K split (what a row's
    sums depend on), us per weight; whether rows 0 and M-1 equal the rows alone (ROWS_CONFIG's tiles, a 16-row
    tile) bit for bit; the three fastest and the variants whose bits differ; at the rows in `also`, the base and
    the fastest variant again. Prints the ROWS_CONFIG_32 / ROWS_CONFIG_64 entries (BN, stages, warps) of the
    variants faster than ROWS_CONFIG's tiles at M (and, with `also`, not slower at those rows) that keep the bits."""
    BM = K._rows_bm(M)
    table = K.ROWS_TALL[BM]
    best = {}
    for (N, Kd) in ROWS_SHAPES[model]:
        with entry_kept(table, (N, Kd)):                      # later parts see kernels.py's tiles
            table.pop((N, Kd), None)                          # the base: ROWS_CONFIG's tiles
            BN, BK, split, st, nw = K._rows_config(N, Kd, torch.device(dev))
            n = min(64, max(copies, (256 << 20) // (N * Kd * 2) + 1))
            ws = [torch.randn(N, Kd, device=dev, dtype=bf) * 0.02 for _ in range(n)]
            x = torch.randn(max((M, *also)), Kd, device=dev, dtype=bf)
            alone = [K._gemv_launch(x[r:r + 1], ws[0], "rows") for r in (0, M - 1)]

            def set_tiles(*v):
                table[(N, Kd)] = v

            def same():
                y = K._gemv_launch(x[:M], ws[0], "rows")
                return torch.equal(y[:1], alone[0]) and torch.equal(y[M - 1:M], alone[1])

            timed = lambda m=M: graph_time(lambda: [K._gemv_launch(x[:m], w, "rows") for w in ws]) / n  # noqa: E731
            res = tile_variants((16, 32, 64, 128), set_tiles, timed, same)
            print(f"== {model} {N}x{Kd} at M={M} ({BM}-row tiles), ROWS_CONFIG (BK {BK}, split {split}) "
                  + variants_line(res, (BN, st, nw)), flush=True)
            pick = res[0][1] if res and res[0][1] != (BN, st, nw) and res[0][2] else None
            for m in also:
                row = []
                for v in [(BN, st, nw)] + ([pick] if pick else []):
                    set_tiles(*v)
                    row.append((v, timed(m)))
                print(f"   at M={m}: " + "; ".join(f"{v} {t:.1f} us" for v, t in row), flush=True)
                if pick and row[1][1] > row[0][1]:
                    pick = None
        if pick:
            best[(N, Kd)] = pick
        del ws
    print(f"ROWS_CONFIG_{BM} = {{" + ", ".join(f"{k}: {v}" for k, v in best.items()) + "}")


rows_bm_of = K._rows_bm


def rows_bm(Ms=(1, 8, 16, 17, 24, 32, 40, 64, 128, 136), copies=8, models=None):
    """The row-invariant linear with row tiles of 16, 32, 64 and 128 rows (kernels._rows_bm; ROWS_CONFIG's tiles
    otherwise), at M rows, against cuBLAS; whether the tiles give the same bits, and whether a row alone equals the
    same row inside steps of 40 and 136 rows, bit for bit."""
    for model, shapes in ROWS_SHAPES.items():
        if models and model not in models:
            continue
        for (N, Kd) in shapes:
            n = min(64, max(copies, (256 << 20) // (N * Kd * 2) + 1))
            ws = [torch.randn(N, Kd, device=dev, dtype=bf) * 0.02 for _ in range(n)]
            xs = torch.randn(max(Ms), Kd, device=dev, dtype=bf)
            print(f"== {model} {N}x{Kd} {K._rows_config(N, Kd, xs.device)}: us at M = {list(Ms)}")
            print("  cuBLAS   " + " ".join(f"{graph_time(lambda: [F.linear(xs[:M], w) for w in ws]) / n:7.1f}"
                                          for M in Ms))
            outs = {}
            for bm in (16, 32, 64, 128):
                K._rows_bm = lambda M, bm=bm: bm
                try:
                    outs[bm] = K._gemv_launch(xs, ws[0], "rows")
                except Exception as e:  # noqa  (128 rows x the lm_head's tiles: out of shared memory)
                    outs[bm] = None
                    print(f"  BM {bm}: {type(e).__name__}")
            print("  the same bits with row tiles of 16 / 32 / 64 / 128 (M = 136): "
                  + " ".join(str(outs[bm] is not None and torch.equal(outs[16], outs[bm])) for bm in (32, 64, 128)))
            for bm in (16, 32, 64, 128):
                K._rows_bm = lambda M, bm=bm: bm
                try:
                    ts = [graph_time(lambda: [K._gemv_launch(xs[:M], w, "rows") for w in ws]) / n for M in Ms]
                    alone = K._gemv_launch(xs[:1], ws[0], "rows")
                    inv = all(torch.equal(K._gemv_launch(xs[:M], ws[0], "rows")[r:r + 1], K._gemv_launch(
                        xs[r:r + 1], ws[0], "rows")) for M in (40, 136) for r in (0, M - 1))
                    inv = inv and torch.equal(K._gemv_launch(xs[:136], ws[0], "rows")[:1], alone)
                    print(f"  BM {bm:3d}   " + " ".join(f"{t:7.1f}" for t in ts) + f"   invariant {inv}")
                except Exception as e:  # noqa
                    print(f"  BM {bm:3d}   {type(e).__name__}: {str(e)[:200]}")
            K._rows_bm = rows_bm_of
            del ws


FP8_SHAPES = {"27b": [(16384, 5120), (14336, 5120), (5120, 6144), (34816, 5120), (5120, 17408)],
              "35b-a3b": [(12288, 2048), (9216, 2048), (2048, 4096), (1024, 2048), (2048, 512)]}


def fp8_bm(Ms=(1, 16, 17, 32, 64, 128, 136), copies=8):
    """The FP8 decode linear (kernels._fp8_gemv_kernel) with row tiles of 16, 32, 64 and 128 rows (kernels._fp8_bm;
    FP8_ROWS_CONFIG's tiles otherwise) at M rows, us per weight; whether the tiles give the same bits at M = 136,
    and whether a row alone (a 16-row tile) equals the same row inside steps of 17, 40 and 136 rows, bit for bit."""
    for model, shapes in FP8_SHAPES.items():
        for (N, Kd) in shapes:
            n = min(64, max(copies, (256 << 20) // (N * Kd) + 1))
            qs = [K.fp8_quantize(torch.randn(N, Kd, device=dev) * 0.02) for _ in range(n)]
            xs = torch.randn(max(Ms), Kd, device=dev, dtype=bf)
            print(f"== {model} {N}x{Kd} {K._fp8_config(N, Kd, xs.device)}: us at M = {list(Ms)}", flush=True)
            run = lambda M: K._gemv_launch(xs[:M], qs[0][0], "fp8", None, qs[0][1])  # noqa: E731
            outs = {}
            for bm in (16, 32, 64, 128):
                K._fp8_bm = lambda M, bm=bm: 16 if M <= 16 else bm
                try:
                    outs[bm] = run(136)
                    ts = [graph_time(lambda: [K._gemv_launch(xs[:M], q, "fp8", None, sc) for q, sc in qs]) / n
                          for M in Ms]
                    alone = lambda r: K._gemv_launch(xs[r:r + 1], qs[0][0], "fp8", None, qs[0][1])  # noqa: E731
                    inv = all(torch.equal(run(M)[r:r + 1], alone(r)) for M in (17, 40, 136) for r in (0, M - 1))
                    print(f"  BM {bm:3d}   " + " ".join(f"{t:7.1f}" for t in ts) + f"   row alone == in step {inv}"
                          + f"; bits == BM 16 at M = 136: {torch.equal(outs[16], outs[bm])}", flush=True)
                except Exception as e:  # noqa  (shared memory / registers)
                    outs[bm] = None
                    print(f"  BM {bm:3d}   {type(e).__name__}: {str(e)[:200]}", flush=True)
            K._fp8_bm = fp8_bm_of
            del qs


fp8_bm_of = K._fp8_bm


def fp8_rows(Ms=(8, 16), model="27b"):
    """The FP8 decode linear at M rows (2-16: one 16-row tile, as one row) per shape: FP8_ROWS_CONFIG's tiles
    (chosen at M = 1) against every BN / stages / warps with its K split, us per weight; whether rows 0 and M-1
    equal the rows alone under FP8_ROWS_CONFIG's tiles, bit for bit; the three fastest, and every variant whose
    bits differ (a tile that depended on the step's rows would have to avoid those)."""
    for (N, Kd) in FP8_SHAPES[model]:
        base = K._fp8_config(N, Kd, torch.device(dev))
        BN, split, st, nw = base
        n = min(64, max(8, (256 << 20) // (N * Kd) + 1))
        qs = [K.fp8_quantize(torch.randn(N, Kd, device=dev) * 0.02) for _ in range(n)]
        xs = torch.randn(max(Ms), Kd, device=dev, dtype=bf)
        run = lambda M, q=qs[0]: K._gemv_launch(xs[:M], q[0], "fp8", None, q[1])  # noqa: E731
        alone = [K._gemv_launch(xs[r:r + 1], qs[0][0], "fp8", None, qs[0][1]) for r in range(max(Ms))]

        def set_tiles(BN, st, nw):
            K.FP8_ROWS_CONFIG[(N, Kd)] = (BN, split, st, nw)

        for M in Ms:
            def same(M=M):
                y = run(M)
                return torch.equal(y[:1], alone[0]) and torch.equal(y[M - 1:M], alone[M - 1])

            with entry_kept(K.FP8_ROWS_CONFIG, (N, Kd)):
                res = tile_variants((32, 64, 128), set_tiles, lambda: graph_time(lambda: [run(M, q) for q in qs]) / n,
                                    same)
            print(f"== {model} fp8 {N}x{Kd} M={M}, FP8_ROWS_CONFIG (split {split}) " + variants_line(res, (BN, st, nw)),
                  flush=True)
        del qs


def fp8(Ms=(1, 8, 16, 64)):
    """Every tile candidate (BN, SPLIT, stages, warps) of the FP8 decode linear (kernels._fp8_gemv_kernel) at M = 1
    over enough distinct weights to defeat L2 (us per weight); the best, its time at larger M, the bf16
    row-invariant kernel at M = 1 and a copy of the FP8 bytes (read + write, so its GB/s counts both). Prints the
    table for kernels.FP8_ROWS_CONFIG."""
    cands = [(BN, S, st, wp) for BN in (64, 128) for S in (1, 2, 4, 8) for st in (3, 4, 6) for wp in (4, 8)]
    best_all = {}
    for model, shapes in FP8_SHAPES.items():
        for (N, Kd) in shapes:
            n = min(64, (512 << 20) // (N * Kd) + 1)
            qs = [K.fp8_quantize(torch.randn(N, Kd, device=dev) * 0.02) for _ in range(n)]
            xs = torch.randn(max(Ms), Kd, device=dev, dtype=bf)
            with entry_kept(K.FP8_ROWS_CONFIG, (N, Kd)):  # each shape measured at kernels.py's tiles of the others
                res = []
                for c in cands:
                    if K._cdiv(N, c[0]) * c[1] < 64 and N * Kd > 1 << 24 or K._cdiv(Kd, 128) < 2 * c[1]:
                        continue
                    K.FP8_ROWS_CONFIG[(N, Kd)] = c
                    try:
                        t = graph_time(lambda: [K._gemv_launch(xs[:1], q, "fp8", None, s) for q, s in qs]) / n
                        res.append((t, c))
                    except Exception as e:  # noqa  (shared memory)
                        pass
                res.sort()
                t, c = res[0]
                K.FP8_ROWS_CONFIG[(N, Kd)] = c
                best_all[(N, Kd)] = c
                byts = N * Kd
                dst = [torch.empty_like(q) for q, _ in qs]
                tc = graph_time(lambda: [d.copy_(q) for d, (q, _) in zip(dst, qs)]) / n
                ws = [torch.randn(N, Kd, device=dev, dtype=bf) * 0.02 for _ in range(min(n, 32))]
                tb = graph_time(lambda: [K._gemv_launch(xs[:1], w, "rows") for w in ws]) / len(ws)
                tM = [graph_time(lambda: [K._gemv_launch(xs[:M], q, "fp8", None, s) for q, s in qs]) / n for M in Ms]
                y = K._gemv_launch(xs[:16], qs[0][0], "fp8", None, qs[0][1])
                K.FP8_TMA = False  # plain loads at the same tiles: time and bits
                try:
                    tp = graph_time(lambda: [K._gemv_launch(xs[:1], q, "fp8", None, s) for q, s in qs]) / n
                    same = torch.equal(y, K._gemv_launch(xs[:16], qs[0][0], "fp8", None, qs[0][1]))
                finally:
                    K.FP8_TMA = True
                print(f"== {model} {N}x{Kd}: best {c} {t:.1f} us ({byts / t / 1e3:.0f} GB/s); next "
                      + ", ".join(f"{c2} {t2:.1f}" for t2, c2 in res[1:4])
                      + f"; at M = {list(Ms)}: " + " ".join(f"{x:.1f}" for x in tM)
                      + f"; copy {tc:.1f} us ({2 * byts / tc / 1e3:.0f} GB/s r+w); bf16 rows kernel {tb:.1f} us"
                      + f"; plain loads (FP8_TMA off) {tp:.1f} us, same bits {same}", flush=True)
            del qs, ws, dst
    print("FP8_ROWS_CONFIG = {" + ", ".join(f"{k}: {v}" for k, v in best_all.items()) + "}")


@triton.jit
def _read_kernel(p_w, desc, p_y, N, KW, s_w, SPLIT, BN: tl.constexpr, BKW: tl.constexpr, TMA: tl.constexpr):
    # fp8read's ceiling: program (N block, K split) xors its [BN, BKW] int32 tiles together (no arithmetic to
    # speak of), so its time is the time to read them
    i_n, i_k = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BN, BKW], dtype=tl.int32)
    for k0 in range(i_k * BKW, KW, BKW * SPLIT):
        if TMA:
            w = desc.load([i_n * BN, k0])
        else:
            o_k = k0 + tl.arange(0, BKW)
            w = tl.load(p_w + o_n[:, None].to(tl.int64) * s_w + o_k[None, :],
                        mask=(o_n[:, None] < N) & (o_k[None, :] < KW), other=0)
        acc = acc ^ w
    tl.store(p_y + i_k * N + o_n, tl.xor_sum(acc, 1), mask=o_n < N)


@triton.jit
def _fp8_loop_kernel(p_x, p_xs, w_desc, p_s, p_y, M, N, KD, s_x, KB, SPLIT, BM: tl.constexpr, BN: tl.constexpr,
                     G: tl.constexpr, PRE: tl.constexpr):
    # fp8read's variants of kernels._fp8_gemv_kernel's loop (TMA weight tiles, x quantized in the loop as there;
    # PRE: x e4m3 rows and their group scales p_xs loaded instead), G blocks of 128 columns an iteration (G must
    # divide KD / 128); writes the fp32 partials [SPLIT, M, N]
    i_m, i_n, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = i_m * BM + tl.arange(0, BM)
    m_n, m_m = o_n < N, o_m < M
    b_acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(i_k * 128 * G, KD, 128 * G * SPLIT):
        for g in tl.static_range(G):
            kg = k0 + g * 128
            o_k = kg + tl.arange(0, 128)
            m_x = m_m[:, None] & (o_k < KD)[None, :]
            b_w = w_desc.load([i_n * BN, kg])
            s_w = tl.load(p_s + (i_n * BN // 128) * KB + kg // 128)
            if PRE:
                b_q = tl.load(p_x + o_m[:, None] * s_x + o_k[None, :], mask=m_x, other=0.0)
                b_sx = tl.load(p_xs + o_m * KB + kg // 128, mask=m_m, other=0.0)
            else:
                b_x = tl.load(p_x + o_m[:, None] * s_x + o_k[None, :], mask=m_x, other=0.0).to(tl.float32)
                b_sx, b_inv = K._pow2_scales(b_x)
                b_q = (b_x * b_inv[:, None]).to(tl.float8e4nv, fp_downcast_rounding="rtne")
            b_acc += tl.dot(b_w, tl.trans(b_q)) * (b_sx * s_w)[None, :]
    tl.store(p_y + i_k * M * N + o_m[None, :] * N + o_n[:, None], b_acc, mask=m_n[:, None] & m_m[None, :])


def read_only_best(ws, BNs, BKBs, splits):
    """_read_kernel over distinct weights ws (the same shape, viewed as int32 [N, K / 4 bytes]) in a graph, every
    BN x bytes (BKBs) x stages x warps x K split (at most one split per tile of bytes), plain loads and TMA: {"TMA" |
    "loads": (µs per weight, (BN, bytes, stages, warps, split))} of each kind's fastest."""
    N, KW = ws[0].shape
    y = torch.empty(max(splits), N, dtype=torch.int32, device=dev)
    best = {}
    for BN, BKB, st, wp, tma in itertools.product(BNs, BKBs, (3, 4), (4, 8), (False, True)):
        if BN * BKB > 64 * 1024:
            continue
        descs = [K.TensorDescriptor.from_tensor(w, [BN, BKB // 4]) if tma else w for w in ws]
        for S in splits:
            if KW // (BKB // 4) < S:
                continue
            grid = (triton.cdiv(N, BN), S)
            t = graph_time(lambda: [_read_kernel[grid](w, d, y, N, KW, w.stride(0), S, BN=BN, BKW=BKB // 4, TMA=tma,
                                                       num_stages=st, num_warps=wp)
                                    for w, d in zip(ws, descs)]) / len(ws)
            kind = "TMA" if tma else "loads"
            if kind not in best or t < best[kind][0]:
                best[kind] = (t, (BN, BKB, st, wp, S))
    return best


def fp8read(per_token=(48, 16, 64, 64, 64)):
    """fp8read (see the header): µs per weight at M = 1 over distinct weights in a graph; the 27B's FP8 linears per
    token (GDN in_proj x 48, attention qkv x 16, o_proj / out_proj, MLP gate_up and down x 64) for each."""
    tot = {}
    for (N, Kd), reps in zip(FP8_SHAPES["27b"], per_token):
        n = min(64, (768 << 20) // (N * Kd) + 1)
        qs = [K.fp8_quantize(torch.randn(N, Kd, device=dev) * 0.02) for _ in range(n)]
        x = torch.randn(1, Kd, device=dev, dtype=bf)
        xq, xs = K.fp8_act_quant(x)
        KB = Kd // 128
        ours = graph_time(lambda: [K._gemv_launch(x, q, "fp8", None, s) for q, s in qs]) / n
        ref = K._gemv_launch(x, qs[0][0], "fp8", None, qs[0][1]).float()
        ws = [q.view(torch.int32) for q, _ in qs]
        best = {f"read, {kind}": (t, c) for kind, (t, c) in
                read_only_best(ws, (64, 128, 256), (256, 512), (1, 2, 4, 8)).items()}
        for BN, G, st, wp, pre in itertools.product((64, 128), (1, 2), (3, 4), (4, 8), (False, True)):
            descs = [K.TensorDescriptor.from_tensor(q, [BN, 128]) for q, _ in qs]
            xa, xsa = (xq, xs) if pre else (x, x)
            for S in (1, 2, 4, 8, 16):
                part = torch.empty(S, 1, N, device=dev)
                grid = (1, triton.cdiv(N, BN), S)
                run = lambda d, s: _fp8_loop_kernel[grid](xa, xsa, d, s, part, 1, N, Kd, xa.stride(0), KB, S, BM=16,
                                                          BN=BN, G=G, PRE=pre, num_stages=st, num_warps=wp)
                t = graph_time(lambda: [run(d, s) for d, (q, s) in zip(descs, qs)]) / n
                run(descs[0], qs[0][1])
                err = ((part.sum(0) - ref).abs().max() / ref.abs().max()).item()  # (ref: rounded to bf16)
                key = f"loop G={G}" + (", x quantized before" if pre else "")
                if key not in best or t < best[key][0]:
                    best[key] = (t, (BN, st, wp, S), err)
        print(f"== 27B {N}x{Kd}: the linear (FP8_ROWS_CONFIG {K.FP8_ROWS_CONFIG.get((N, Kd))}, with its sum) "
              f"{ours:.1f} us ({N * Kd / ours / 1e3:.0f} GB/s)", flush=True)
        tot["the linear"] = tot.get("the linear", 0) + reps * ours
        for key, v in best.items():
            print(f"   {key}: {v[0]:.1f} us ({N * Kd / v[0] / 1e3:.0f} GB/s) at {v[1]}"
                  + (f", max error {v[2]:.1e} of the largest output" if len(v) > 2 else ""), flush=True)
            tot[key] = tot.get(key, 0) + reps * v[0]
        del qs, ws
        torch.cuda.empty_cache()
    print("the 27B's FP8 linears per token, ms: " + ", ".join(f"{k} {v / 1e3:.3f}" for k, v in tot.items()))


ROWS_PER_TOKEN = {"35b": (30, 10, 40, 40, 40, 1), "27b": (48, 16, 64, 64, 64, 1)}  # ROWS_SHAPES' uses a token


def rows_read(model="35b"):
    """rowsread (see the header): µs per weight at M = 1 over distinct weights in a graph, and per token."""
    tot = [0.0, 0.0]
    for (N, Kd), reps in zip(ROWS_SHAPES[model], ROWS_PER_TOKEN[model]):
        n = max(1, min(64, (768 << 20) // (2 * N * Kd) + 1))
        ws = [torch.randn(N, Kd, device=dev, dtype=bf) * 0.02 for _ in range(n)]
        x = torch.randn(1, Kd, device=dev, dtype=bf)
        ours = graph_time(lambda: [K._gemv_launch(x, w, "rows") for w in ws]) / n
        wi = [w.view(torch.int32) for w in ws]
        best = min((t, c[:4] + (kind,) + c[4:]) for kind, (t, c) in
                   read_only_best(wi, (16, 32, 64, 128), (256, 512, 1024), (1, 2, 4, 8, 16)).items())
        b = 2 * N * Kd
        print(f"== {model} {N}x{Kd} (x{reps} a token): the linear (ROWS_CONFIG {K.ROWS_CONFIG.get((N, Kd))}, with its "
              f"sum) {ours:.1f} us ({b / ours / 1e3:.0f} GB/s); read-only {best[0]:.1f} us ({b / best[0] / 1e3:.0f} "
              f"GB/s) at {best[1]}", flush=True)
        tot[0] += reps * ours
        tot[1] += reps * best[0]
        del ws, wi
        torch.cuda.empty_cache()
    print(f"{model} per token: the linear {tot[0] / 1e3:.3f} ms, read-only {tot[1] / 1e3:.3f} ms")


def rows_wide(model="35b"):
    """rowswide (see the header): µs per weight at M = 1 / 16 over distinct weights in a graph; the four best by M = 1
    a shape, with their time at 40 rows (64-row tiles, whose stages kernels._rows_tiles cuts to the shared memory:
    a BK 512 tile fits 4 stages at 16 rows, 2 at 64), and what the best would save a token at M = 1."""
    gain = 0.0
    for (N, Kd), reps in zip(ROWS_SHAPES[model], ROWS_PER_TOKEN[model]):
        if N > 100000:  # the lm_head: at the read rate already (rowsread)
            continue
        n = max(8, min(64, (512 << 20) // (2 * N * Kd) + 1))
        ws = [torch.randn(N, Kd, device=dev, dtype=bf) * 0.02 for _ in range(n)]
        xs = torch.randn(40, Kd, device=dev, dtype=bf)
        cur = K.ROWS_CONFIG.get((N, Kd))
        t = lambda M: graph_time(lambda: [K._gemv_launch(xs[:M], w, "rows") for w in ws]) / n
        base = (t(1), t(16), t(40))
        res = []
        with entry_kept(K.ROWS_CONFIG, (N, Kd)):
            for BN, BK, st, wp, sp in itertools.product((16, 32), (256, 512), (3, 4), (4, 8), (1, 2, 4, 8)):
                if BK > Kd or Kd // BK < sp:
                    continue
                K.ROWS_CONFIG[(N, Kd)] = (BN, BK, sp, st, wp)  # (kernels._rows_tiles fits stages to shared memory)
                res.append((t(1), t(16), (BN, BK, sp, st, wp)))
            res.sort()
            tall = []
            for _, _, c in res[:4]:  # the best four at 40 rows
                K.ROWS_CONFIG[(N, Kd)] = c
                tall.append(t(40))
        print(f"== {model} {N}x{Kd} (x{reps} a token): ROWS_CONFIG {cur} M=1 / 16 / 40 {base[0]:.1f} / {base[1]:.1f} / "
              f"{base[2]:.1f} us; best at M=1: " + "; ".join(f"{c} {a:.1f} / {b:.1f} / {m:.1f}"
                                                            for (a, b, c), m in zip(res, tall)), flush=True)
        if res:
            gain += reps * max(0.0, base[0] - res[0][0])
        del ws
        torch.cuda.empty_cache()
    print(f"{model}: the best candidates would take {gain / 1e3:.3f} ms a token off at M = 1")


MOE_GU = [(16, 512, 4, 3), (8, 512, 2, 3), (16, 1024, 8, 3), (32, 512, 8, 3), (8, 1024, 4, 3), (16, 256, 4, 3),
          (32, 256, 4, 3), (32, 256, 8, 3), (64, 256, 8, 3), (64, 256, 4, 3), (128, 256, 8, 3), (64, 128, 4, 3),
          (128, 128, 8, 3), (64, 512, 8, 3), (8, 256, 2, 3)]
MOE_DN = [(4, 256, 2, 3), (8, 256, 2, 3), (16, 256, 4, 3), (16, 512, 4, 3), (8, 512, 4, 3), (4, 128, 1, 3),
          (8, 128, 2, 3), (16, 128, 2, 3), (32, 256, 4, 3), (8, 256, 4, 3), (32, 512, 8, 2)]


def moe_tiles(N=1, scaled=True, L=12):
    """The 35B MoE pair kernels, FP8 experts (SCALED, block scales) or bf16: tile candidates for gate/up (BI, BH,
    warps, stages) and down (BO, BI, warps, stages) at N tokens (random routing, a token's k experts distinct), us
    per layer and TB/s of the distinct experts' bytes; the whole layer at the current tiles
    (kernels._moe_experts_launch) first. (BH of gate/up and BI of down are the sums' widths: a pair's bits depend
    on them, so one tile serves every N.)"""
    E, I, H, k = 256, 512, 2048, 8
    ws = []
    for _ in range(L):
        gu, dn = torch.randn(E, 2 * I, H, device=dev, dtype=bf) * 0.02, torch.randn(E, H, I, device=dev, dtype=bf) * 0.02
        if scaled:
            (gq, gs), (uq, us), (dq, ds) = K.fp8_quantize(gu[:, :I]), K.fp8_quantize(gu[:, I:]), K.fp8_quantize(dn)
            ws.append((torch.cat([gq, uq], 1), dq, torch.cat([gs, us], 1).contiguous(), ds))
        else:
            ws.append((gu, dn, None, None))
        del gu, dn
    x = torch.randn(N, H, device=dev, dtype=bf)
    idx = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(N)])
    w = torch.rand(N, k, device=dev).softmax(-1)
    P = N * k
    h = torch.empty(P, I, device=dev, dtype=bf); y = torch.empty(P, H, device=dev)
    ne = len(set(idx.flatten().tolist()))
    es = 1 if scaled else 2
    gb, db = 2 * I * H * ne * es, I * H * ne * es                                   # expert bytes per layer
    IB, HB = K._cdiv(I, 128), K._cdiv(H, 128)
    tf = graph_time(lambda: [K._moe_experts_launch(x, w, idx, a, b, None, None, None, c, d) for a, b, c, d in ws]) / L
    print(f"== MoE pairs {'FP8' if scaled else 'bf16'}, N={N} ({ne} experts a layer): whole layer {tf:.1f} us "
          f"(current tiles)", flush=True)
    res = []
    for (BI, BH, nw, ns) in MOE_GU:
        f = lambda: [K._moe_gate_up_pair_kernel[(P, K._cdiv(I, BI))](
            x, idx, a, a if c is None else c, h, H, I, x.stride(0), a.stride(0), a.stride(1),
            0 if c is None else c.stride(0), IB, HB, TOPK=k, BI=BI, BH=BH, SCALED=scaled, num_warps=nw, num_stages=ns)
            for a, b, c, d in ws]
        try:
            t = graph_time(f) / L
            res.append((t, f"gate/up BI{BI} BH{BH} w{nw} s{ns}", gb / t / 1e6))
        except Exception as e:  # noqa  (resources)
            print(f"  gate/up BI{BI} BH{BH} w{nw} s{ns}: {type(e).__name__}")
    for (BO, BI, nw, ns) in MOE_DN:
        f = lambda: [K._moe_down_pair_kernel[(P, K._cdiv(H, BO))](
            h, idx, w, b, b if d is None else d, y, H, I, b.stride(0), b.stride(1), 0 if d is None else d.stride(0),
            IB, BO=BO, BI=BI, SCALED=scaled, num_warps=nw, num_stages=ns) for a, b, c, d in ws]
        try:
            t = graph_time(f) / L
            res.append((t, f"down BO{BO} BI{BI} w{nw} s{ns}", db / t / 1e6))
        except Exception as e:  # noqa
            print(f"  down BO{BO} BI{BI} w{nw} s{ns}: {type(e).__name__}")
    for t, name, tbs in res:
        print(f"  {name:32s} {t:7.1f} us  {tbs:5.2f} TB/s", flush=True)


def w8a8(M=2048):
    """The W8A8 prefill GEMM's tiles at M rows: us per weight for each candidate, the best, cuBLAS bf16 and
    dequantize + cuBLAS on the same shape (the activation quantization timed apart)."""
    cands = [(BM, BN, 128, st, wp) for BM in (64, 128) for BN in (64, 128) for st in (3, 4, 5) for wp in (4, 8)]
    for N, Kd in FP8_SHAPES["27b"]:
        q, s = K.fp8_quantize(torch.randn(N, Kd, device=dev) * 0.02)
        x = torch.randn(M, Kd, device=dev, dtype=bf)
        a, sa = K.fp8_act_quant(x)
        y = torch.empty(M, N, device=dev, dtype=bf)
        res = []
        for BM, BN, BK, st, wp in cands:
            grid = (K._cdiv(M, BM), K._cdiv(N, BN))
            try:
                t = graph_time(lambda: K._w8a8_kernel[grid](a, sa, q, s, y, y, M, N, Kd, s.shape[1], BM=BM, BN=BN,
                                                             BK=BK, RES=False, num_stages=st, num_warps=wp))
                res.append((t, (BM, BN, BK, st, wp)))
            except Exception:  # noqa  (shared memory)
                pass
        res.sort()
        w = torch.randn(N, Kd, device=dev, dtype=bf) * 0.02
        tb = graph_time(lambda: F.linear(x, w))
        td = graph_time(lambda: F.linear(x, K.fp8_dequantize(q, s, bf)))
        tq = graph_time(lambda: K.fp8_act_quant(x))
        flop = 2 * M * N * Kd
        print(f"== 27b {N}x{Kd} at M = {M}: best {res[0][1]} {res[0][0]:.0f} us ({flop / res[0][0] / 1e6:.0f} "
              f"TFLOP/s); next {[(round(t), c) for t, c in res[1:4]]}; cuBLAS bf16 {tb:.0f} us "
              f"({flop / tb / 1e6:.0f} TFLOP/s); dequantize + cuBLAS {td:.0f} us; activation quantization {tq:.0f} us")


def pdl(L=28):
    """draft_model's Qwen3-0.6B linears chained as in its passes (qkv -> o_proj -> gate_up -> down, each reading
    the last output; L layers of distinct weights) in one CUDA graph, at 1 and 8 rows: the row-invariant kernel
    and _linear_small, launched plainly and with PDL (kernels._pdl)."""
    shapes = ROWS_SHAPES["0.6b"][:4]
    ws = [[torch.randn(N, Kd, device=dev, dtype=bf) * 0.03 for (N, Kd) in shapes] for _ in range(L)]
    for M in (1, 8):
        x0 = torch.randn(M, 1024, device=dev, dtype=bf)

        def chain(fn):
            x = x0
            for lw in ws:
                for w in lw:
                    x = fn(x[:, :w.shape[1]].contiguous(), w)
            return x
        outs = {}
        for with_pdl in (False, True):
            K._PDL_DEVICES[x0.device] = with_pdl
            for name, fn in [("row-invariant", lambda x, w: K._gemv_launch(x, w, "rows")),
                             ("_linear_small", K._linear_small)]:
                t = graph_time(lambda: chain(fn))
                y = chain(fn)
                same = f" (same bits: {torch.equal(y, outs[name])})" if with_pdl else ""
                outs[name] = y
                print(f"== 0.6b chain, M = {M}: {name}{' with PDL' if with_pdl else ''} {t / (4 * L):.2f} us "
                      f"per linear{same}")
        del K._PDL_DEVICES[x0.device]


def markov(B=1, Kq=16, V=248320, R=256):
    print(f"== Markov B={B} K={Kq} V={V} R={R}: us per draft (all {Kq} steps); floor {Kq * V * R * 2 / 4.2e6:.0f} us")
    U = torch.randn(B, Kq, V, device=dev)
    w1 = torch.randn(V, R, device=dev, dtype=bf) * 0.05
    w2 = torch.randn(V, R, device=dev, dtype=bf) * 0.05
    e0 = w1[torch.randint(0, V, (B,), device=dev)]
    ref = K.markov_greedy(U, e0, w1, w2)
    for BN, nw, nwp in [(16, 4, 8), (32, 4, 8), (64, 4, 8), (64, 8, 8), (128, 8, 8), (128, 4, 4), (256, 8, 4), (32, 8, 8)]:
        BR = K._p2(R)
        NB = K._cdiv(V, BN)
        e = torch.empty(B, R, device=dev, dtype=bf)
        pv, pi = torch.empty(B, NB, device=dev), torch.empty(B, NB, device=dev, dtype=torch.int32)
        d = torch.empty(B, Kq, device=dev, dtype=torch.long)

        def run():
            e.copy_(e0)
            for j in range(Kq):
                K._markov_logits_kernel[(NB,)](U[:, j], w2, e, pv, pi, B, V, R, U.stride(0), NB, BN=BN, BR=BR, num_warps=nw)
                K._markov_pick_kernel[(B,)](pv, pi, w1, e, d, NB, R, j, d.stride(0), BNB=min(4096, K._p2(NB)), BR=BR,
                                            num_warps=nwp)
        t = graph_time(run)
        print(f"  BN{BN} w{nw} pick w{nwp}: {t:.1f} us  equal={torch.equal(d, ref)}")



def main():
    parts = sys.argv[1:] or ["moe-bf16", "gdn", "gemv", "markov"]
    if "rows" in parts:
        rows()
    if "rows-0.6b" in parts:  # draft_model's Qwen3-0.6B shapes, at its decode / first-pass rows (batch 1 and 8: an
        rows(Ms=(1, 8, 16), models=["0.6b"])  # attention-only draft's first pass is 2 tokens a request)
    for m in ROWS_SHAPES:  # rows17 / rows40: the 27B's shapes; rows17-35b etc.: another model's
        if f"rows17-{m}" in parts or (m == "27b" and "rows17" in parts):
            rows_tall(17, m)
        if f"rows40-{m}" in parts or (m == "27b" and "rows40" in parts):  # ngram / draft_model k=4 at batch 8 (40
            rows_tall(40, m, also=(64, 128))                                  # rows), 8 x 16-token verifies (128)
    if "rowsbm" in parts:  # rowsbm-27b etc.: one model's shapes
        rows_bm()
    for m in ROWS_SHAPES:
        if f"rowsbm-{m}" in parts:
            rows_bm(models=[m])
    if "fp8" in parts:
        fp8()
    if "fp8read" in parts:
        fp8read()
    for m in ROWS_PER_TOKEN:  # rowsread: the 35B-A3B's shapes; rowsread-27b: the 27B's
        if f"rowsread-{m}" in parts or (m == "35b" and "rowsread" in parts):
            rows_read(m)
    for m in ROWS_PER_TOKEN:  # rowswide: the 35B-A3B's shapes; rowswide-27b: the 27B's
        if f"rowswide-{m}" in parts or (m == "35b" and "rowswide" in parts):
            rows_wide(m)
    if "fp8bm" in parts:
        fp8_bm()
    for m in FP8_SHAPES:  # fp8rows: the 27B's shapes; fp8rows-35b-a3b: the 35B-A3B's
        if f"fp8rows-{m}" in parts or (m == "27b" and "fp8rows" in parts):
            fp8_rows(model=m)
    if "w8a8" in parts:
        w8a8()
    if "pdl" in parts:
        pdl()
    torch.manual_seed(0)
    for name, scaled in (("moe-fp8", True), ("moe-bf16", False), ("moe", False)):  # moe: moe-bf16's old name
        if name in parts:
            for N in (1, 2, 8, 16):
                moe_tiles(N, scaled)
    if "gdn" in parts:
        for B, T, keep, out in [(1, 1, None, True), (8, 1, None, True), (1, 2, None, True), (1, 16, None, True),
                                (8, 2, None, True), (1, 2, 2, False), (1, 16, 7, False)]:
            gdn(B, T, keep, out=out)
    if "gemv" in parts:
        S27 = [(34816, 5120), (5120, 17408), (16480, 5120), (5120, 6144), (248320, 5120), (14336, 5120)]
        gemms(17, S27, [(64, 128, 1, 3, 4), (32, 128, 1, 3, 4), (64, 64, 1, 3, 4), (64, 128, 4, 3, 4),
                        (32, 128, 4, 3, 4), (32, 256, 4, 4, 4)])
        gemms(16, S27, [(64, 128, 1, 3, 4), (32, 128, 4, 3, 4)])
        gemms(1, [(1281, 2048), (2048, 512), (9216, 2048)],
              [(8, 1024, 1, 4, 8), (16, 512, 1, 4, 8), (8, 512, 1, 4, 4), (4, 512, 1, 4, 4), (4, 2048, 1, 2, 4),
               (16, 256, 1, 4, 4), (8, 256, 1, 3, 4), (2, 512, 1, 2, 2), (4, 1024, 1, 2, 4)], copies=40)
    if "markov" in parts:
        markov()


if __name__ == "__main__":
    main()
