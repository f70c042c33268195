"""kernels.py - the hot paths of specdec: each a plain PyTorch reference, then a Triton kernel beside it.

Every public function here is called by the model in specdec.py. Each section holds the PyTorch
reference (`*_ref`: slow, obviously correct, the one the CPU tests and transformers comparisons use),
then the Triton kernel(s), then the host wrapper (checks dtypes/strides, allocates, picks the grid).
The public function dispatches: the kernel on CUDA tensors when `USE_TRITON`, else the reference.
Tests flip `INTERPRET` to run the kernels on CPU through Triton's interpreter, which only works when
TRITON_INTERPRET=1 was set before triton was first imported.

Everything a decode/verify step launches here is CUDA-graph safe: no host syncs, no data-dependent
allocation sizes, per-row positions/slots read from device tensors inside the kernels.

Shapes: B = sequences in the batch, T = tokens per sequence in this step, S = state slots,
H_k / H_v = GDN key / value heads, d_k / d_v = their head dims, C = GDN conv channels, N = tokens,
E = experts, k = experts per token, I = expert intermediate size.
"""
import contextlib
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (e.g. macOS): the references serve everywhere
    triton = None

    class tl:  # just enough for the kernel signatures below to be defined
        constexpr = None
try:  # host-side tensor descriptors: the FP8 decode linear's weight tiles by TMA (_fp8_desc)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None
try:  # programmatic dependent launch (Hopper and later): see _pdl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

USE_TRITON = True  # the Triton kernels on CUDA tensors; False: references everywhere
INTERPRET = False  # tests: also take the Triton path on CPU tensors (needs TRITON_INTERPRET=1 at import)
_jit = triton.jit if triton is not None else (lambda fn: fn)
# A kernel whose arguments T (tokens per row) must not be specialised: Triton compiles a separate kernel for
# an integer argument equal to 1, so a decode step (T = 1) would run other machine code than a verify
# (T = k+1).
_jit_any_T = triton.jit(do_not_specialize=["T"]) if triton is not None else (lambda fn: fn)
_jit_any_M = triton.jit(do_not_specialize=["M"]) if triton is not None else (lambda fn: fn)  # same, rows M


def _fast(x):
    """Take the Triton path for this tensor?"""
    return USE_TRITON and triton is not None and (x.is_cuda or INTERPRET)


def _p2(n):
    """Next power of two >= n (block sizes must be powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a, b):
    return -(-a // b)


def _empty(shape, dtype, device):
    """Every output and scratch buffer of the wrappers (tests swap in a NaN-filled version to check
    that the kernels write each element they return or read back)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _rows(x):
    """View x [..., D] as rows [N, D] with unit stride along D, copying only if no such view exists."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.contiguous().view(-1, x.shape[-1])


def exact(fn, x):
    """fn(x) for an elementwise fn; on the CPU in float64, rounded back to x's dtype. CPU SIMD math rounds an
    element differently in a vector lane and in the scalar tail, so an fp32 result would depend on the
    tensor's length; the references use this so a token's result does not depend on how many tokens share
    the step (spec-on logprobs == spec-off's). CUDA computes every element alike: fn(x) as it is."""
    return fn(x) if x.is_cuda or x.dtype == torch.float64 else fn(x.double()).to(x.dtype)


def _dot_dtype(t):
    """The dtype tl.dot multiplies in: t's own, but fp32 under the interpreter (numpy has no bf16)."""
    if t.dtype == torch.float32 or not t.is_cuda:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[t.dtype]


_SM_COUNT = {}


def _sm_count(device):
    """Streaming multiprocessors of a CUDA device (cached: a host query, never inside a graph replay)."""
    if device.type != "cuda":
        return 4  # the interpreter: small, so that tests still exercise several splits
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


_SHARED_MEMORY = {}


def _shared_memory(device):
    """Bytes of shared memory a CUDA device gives one program, as Triton checks a launch against it (cached; a
    host query, never inside a graph replay; the interpreter: no limit)."""
    if device.type != "cuda":
        return 1 << 30
    if device not in _SHARED_MEMORY:
        i = torch.cuda.current_device() if device.index is None else device.index
        _SHARED_MEMORY[device] = triton.runtime.driver.active.utils.get_device_properties(i)["max_shared_mem"]
    return _SHARED_MEMORY[device]


DRAFTING = False  # inside drafting(): small linears through _linear_small, the others' GEMV with PRE (GEMV_PREFETCH)
_PDL_DEVICES = {}

# A CPU linear of more rows than this takes F.linear (MKL's GEMM: faster for a prefill chunk, whose bits speculation
# on and off share, but a row's bits there depend on how many rows the call has), except inside token_steps()
TOKEN_STEPS = False  # inside token_steps(): the target's decode and verify steps (ModelRunner._forward)
CPU_MKL_ROWS = 256


@contextlib.contextmanager
def token_steps():
    """The target's decode and verify steps: on a CPU their linears keep each row's 1-row bits at any number of
    rows (the reference's loop over rows, the fast path's _linear_cpu), where a step of more than CPU_MKL_ROWS
    rows took F.linear before session 45 (72 requests at MTP k=3 verify 288 rows: their logprobs then differed
    from speculation off's by ~7e-6, and greedy tokens can differ at a near-tie). Nothing changes on a GPU."""
    global TOKEN_STEPS
    old = TOKEN_STEPS
    TOKEN_STEPS = True
    try:
        yield
    finally:
        TOKEN_STEPS = old


@contextlib.contextmanager
def drafting():
    """A drafter's step (draft_model's LM: ~12 small kernels per layer and pass, each reading a few MB): the
    time goes to each kernel's start and ramp rather than to bytes. Inside this context linears of small
    weights take _linear_small, which loads its weights before waiting (PDL, _pdl) for the kernel before it.
    Drafts need no batch invariance (every emitted token is the target's, verified), so a drafter's linear
    takes the faster kernel for its row count. Measured on the H200 (tools/tile_sweep.py pdl): 28 layers of
    Qwen3-0.6B's four linears at 1 row chained in a CUDA graph, 5.6 us per linear through the row-invariant
    kernel, 4.5 through _linear_small, 3.0 with PDL (at 8 rows: 6.8, 11.8 and, the row-invariant kernel with
    PDL, 6.3)."""
    global DRAFTING
    old = DRAFTING
    DRAFTING = True
    try:
        yield
    finally:
        DRAFTING = old


def _pdl(x):
    """Launch x's kernel with programmatic dependent launch (PDL)? On a CUDA device of compute capability >=
    9. With PDL a kernel may start while the one before it runs, and waits (gdc_wait) before it reads or
    writes anything that kernel touches; every such kernel lets its successor start at once
    (gdc_launch_dependents): a chain stays correct because each kernel writes only after the wait, by which
    time all kernels before it have finished. It changes when kernels start, not what they compute (the same
    bits). The kernels that take it: norms, SwiGLU, attention and its prep, the linears, the MoE's sum of
    experts (since session 23). Measured on the H200 (session 11, the target's captured step, random weights):
    35B-A3B 3.30 -> 2.96 ms at batch 1, 27B FP8 9.47 -> 9.32, 27B bf16 14.18 -> 14.11. Not kept: PDL on the
    MoE experts' pair kernels (their many early programs crowd the kernel before them: 35B batch 8 6.17 -> 7.15
    ms in session 11; session 23, at most 8 pairs only: 35B bf16 batch 1 2.81 ms, but 2.98 together with the
    sum's PDL, 2.81 with the sum's alone), and on the causal conv, the GDN recurrence, the sigmoid gate and the
    router (a few % better at T = 2..4, worse at T = 1 and batch 8)."""
    if not (x.is_cuda and gdc_wait is not None):
        return False
    if x.device not in _PDL_DEVICES:
        _PDL_DEVICES[x.device] = torch.cuda.get_device_capability(x.device)[0] >= 9
    return _PDL_DEVICES[x.device]


def _launch(pdl):
    """The launch options for a kernel started with (or without) PDL."""
    return {"launch_pdl": True} if pdl else {}


@_jit
def _pdl_sync(PDL: tl.constexpr):
    # at a PDL kernel's start: let the next kernel launch, then wait for the one before (see _pdl)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


def _derived(w, name, fn):
    """fn(w) for a weight, made once and kept on the tensor (remade if w is written in place): the CPU fast
    path's transposed / shifted weights."""
    key = "_specdec_" + name
    cached = getattr(w, key, None)
    version = -1 if w.is_inference() else w._version  # (an inference tensor has no version counter)
    if cached is None or cached[0] != version:
        cached = (version, fn(w.detach()))
        setattr(w, key, cached)
    return cached[1]


CPU_FAST = True  # the CPU fast paths (False: the references, as the tests' oracles run them)


def _cpu_fast(x):
    return CPU_FAST and not x.is_cuda


def _slot_run(slots, pool):
    """s0 where slots [B] are s0, s0 + 1, .., s0 + B - 1 (a lone request's decode is one) and pool [S, ...] is
    contiguous, else None. The CPU fast paths then read and write the step's rows of a state pool as the view
    pool[s0:s0 + B], in place, instead of a gather (index / index_select: a copy) and a scatter (index_put_:
    ~12 us a call on the toy, a slice's copy_ ~4). The same values, so the same bits."""
    s = slots.tolist()
    return s[0] if pool.is_contiguous() and s == list(range(s[0], s[0] + len(s))) else None


# A drafter's linears on a CPU (cpu_draft): a copy of the weight in this dtype (None: the weight's own, as the
# target's linears). Drafts decide only how many tokens a verify accepts, never which (the target verifies
# every one), so a drafter needs no fp32 (the CPU runs fp32 for the target's sake: its logits equal
# transformers' within 1e-4); on the GPU a drafter runs in the checkpoint's bf16 anyway. bf16 where the CPU
# multiplies bf16 in hardware (AVX512-BF16); elsewhere oneDNN would emulate it, and fp32 stays.
CPU_DRAFT_DTYPE = torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else None
_CPU_DRAFT = False  # inside cpu_draft()
_DRAFT_BMM = True  # inside cpu_draft(): small weights through the fp32 bmm (_linear_draft_cpu)


@contextlib.contextmanager
def cpu_draft(bmm=True):
    """Inside: a CPU linear (the small-step path, _linear_cpu) of an fp32 weight computes in CPU_DRAFT_DTYPE,
    its input rounded to it, on a copy of the weight packed once, and returns fp32; a small weight's in fp32
    by per-row products, cheaper than a oneDNN call, and since session 45 a weight of bf16 values (a bf16
    checkpoint's) through the target's fp16-weight GEMM, in fp32 (_linear_draft_cpu). MTP's passes and draft logits run
    inside it (specdec.MTPProposer): on the toy (AVX512-BF16, one process, MTP k=3 alternating with fp32
    drafting, 10 rounds) 216 -> 251 tok/s, the mean acceptance length over four prompts 2.374 -> 2.357; k=1
    220 -> 237. draft_model's passes too (specdec.DraftModelProposer), and with bmm=False (every weight through
    oneDNN in bf16: they run 8 or more rows a request, where the bmm costs more) the block drafters'
    (specdec.BlockProposer). Nothing else changes, and nothing on a GPU (the flags are read by the CPU path
    only)."""
    global _CPU_DRAFT, _DRAFT_BMM
    old = _CPU_DRAFT, _DRAFT_BMM
    _CPU_DRAFT, _DRAFT_BMM = True, bmm
    try:
        yield
    finally:
        _CPU_DRAFT, _DRAFT_BMM = old


def argmax(x):
    """x.argmax(-1): the index of each row's first maximum (a NaN counts as the maximum, as in torch). For
    fp32 CPU tensors through numpy, whose argmax is vectorised where torch's CPU argmax is not: a verify's
    logits [1, 4, 8256] on the toy 22-41 -> 4 us, a decode's [1, 8256] 6-12 -> 2.5 us (test_cpu_argmax pins
    the indices, ties and NaNs included). Not under a dispatch mode (meta or fake tensors, the tests'
    graph-capture recorder): numpy works outside torch's dispatcher, so such a mode would not see the op."""
    if (CPU_FAST and x.device.type == "cpu" and x.dtype == torch.float32
            and torch.utils._python_dispatch._get_current_dispatch_mode() is None):
        return torch.as_tensor(x.numpy().argmax(-1))
    return x.argmax(-1)


# ----------------------------------------------------------------------------------------------
# RMSNorm variants
# ----------------------------------------------------------------------------------------------

def rms_norm_ref(x, weight, eps):
    xf = x.float()
    y = xf * exact(torch.rsqrt, xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def plain_rms_norm_ref(x, weight, eps):
    """Qwen3's RMSNorm (the drafters' layers): w * norm(x_f32).to(dtype), the product in w's dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def gated_rms_norm_ref(x, z, weight, eps):
    xf = x.float().contiguous()  # (x may be a transposed view: torch then sums the rows in an order set by T)
    y = (xf * exact(torch.rsqrt, xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = weight * y
    return (y * exact(F.silu, z.float())).to(x.dtype)


@_jit
def _norm_scale(b_x, b_rstd, b_w, dt: tl.constexpr, PLAIN: tl.constexpr):
    # an RMSNorm's last step, in fp32 (the caller rounds): x * rstd scaled by the weight, zero-centred (1 + w) or,
    # PLAIN, Qwen3's w * (x * rstd).to(dt) -- the one arithmetic of every kernel that normalises, so that a norm done
    # inside another launch has the bits of _rms_norm_kernel's
    if PLAIN:
        return (b_x * b_rstd).to(dt).to(tl.float32) * b_w
    return b_x * b_rstd * (1.0 + b_w)


@_jit
def _rms_norm_kernel(p_x, p_w, p_y, p_z, N, D, eps, s_x, s_z, NZ, s_z1,
                     BR: tl.constexpr, BD: tl.constexpr, GATED: tl.constexpr,
                     ROUND_MID: tl.constexpr, PLAIN: tl.constexpr, PDL: tl.constexpr):
    # one program normalises BR rows of length D (BD >= D); all statistics in fp32
    _pdl_sync(PDL)
    i_r = tl.program_id(0)
    o_r = (i_r * BR + tl.arange(0, BR)).to(tl.int64)
    o_d = tl.arange(0, BD)
    m = (o_r < N)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(p_x + o_r[:, None] * s_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)                               # [BR]
    b_w = tl.load(p_w + o_d, mask=o_d < D, other=0.0).to(tl.float32)
    # Qwen3's w * norm(x).to(dtype) (PLAIN: also GATED's first step), else the zero-centred (1 + w)
    b_y = _norm_scale(b_x, b_rstd[:, None], b_w[None, :], p_y.dtype.element_ty, PLAIN)
    if GATED:  # then * silu(z), with the reference's roundings
        if ROUND_MID:
            b_y = b_y.to(p_y.dtype.element_ty).to(tl.float32)
        o_z = (o_r // NZ) * s_z + (o_r % NZ) * s_z1                             # z's row r (see _norm_launch)
        b_z = tl.load(p_z + o_z[:, None] + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        b_y = b_y * (b_z * tl.sigmoid(b_z))
    tl.store(p_y + o_r[:, None] * D + o_d[None, :], b_y.to(p_y.dtype.element_ty), mask=m)


def _norm_launch(x, weight, eps, z=None, plain=False):
    D = x.shape[-1]
    assert weight.shape == (D,) and weight.is_contiguous(), "weight must be a contiguous [D] vector"
    xr = _rows(x)
    N = xr.shape[0]
    y = _empty(x.shape, x.dtype, x.device)
    zr = None
    if z is not None:  # z [R, NZ, D], row r at (r // NZ) * s_z + (r % NZ) * s_z1: GDN's gate heads, sliced
        assert z.shape == x.shape, "x and z must have the same shape"  # from in_proj's output, need no copy
        zr = (z if z.stride(-1) == 1 else z.contiguous()).reshape(-1, *([D] if z.dim() < 2 else z.shape[-2:]))
        zr = zr if zr.dim() == 3 else zr.view(1, -1, D)
    BD = _p2(D)
    BR = max(1, min(16, 2048 // BD))
    mid_round = torch.promote_types(weight.dtype, x.dtype) == x.dtype and x.dtype != torch.float32
    pdl = _pdl(x)
    _rms_norm_kernel[(_cdiv(N, BR),)](
        xr, weight, y, zr if zr is not None else xr, N, D, eps, xr.stride(0),
        zr.stride(0) if zr is not None else 0, zr.shape[1] if zr is not None else 1,
        zr.stride(1) if zr is not None else 0, BR=BR, BD=BD, GATED=z is not None, ROUND_MID=mid_round,
        PLAIN=plain or z is not None, PDL=pdl, num_warps=min(8, max(1, BR * BD // 256)), **_launch(pdl))
    return y


def _rms_norm_cpu(x, weight, eps):
    """The CPU fast path of rms_norm: torch's LayerNorm kernel over [x, -x], one fused op where the reference
    takes ten (F.rms_norm, what ran before, is a composite of eight ops on a CPU: 13 -> 5.4 us a call on the
    toy; the toy's plain decoding 5 % faster, measured with two processes side by side). [x, -x] has mean
    zero (up to rounding), so LayerNorm's variance is x's mean square and the first half of its output is
    RMSNorm(x); the weight (1 + w) is repeated over both halves. LayerNorm reduces each row on its own: a
    row's bits do not depend on the other rows (test_cpu_norms_fast); within 1e-6 of the reference."""
    w = _derived(weight, "(1+w)x2", lambda w: (1.0 + w.float()).repeat(2))
    y = _rms_normalize_cpu(x.float(), eps, w)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _rms_normalize_cpu(xf, eps, w2=None):
    """xf [..., D] (fp32) * rsqrt(mean(xf^2) + eps), times w2's first half if given ([2D]: the weight repeated):
    LayerNorm over [xf, -xf], whose mean is zero (_rms_norm_cpu). The CPU's RMSNorms and the GDN gated norm's and
    attention's q / k norms go through it."""
    D = xf.shape[-1]
    return F.layer_norm(torch.cat([xf, -xf], -1), (2 * D,), w2, None, eps)[..., :D]


def rms_norm(x, weight, eps):
    """Zero-centred RMSNorm (Qwen3.5): y = x_f32 * rsqrt(mean(x^2) + eps) * (1 + w_f32), cast back.
    x [..., D] (any strides with a unit last stride, e.g. the query half of q_proj's output), weight [D].
    Returns a new contiguous [..., D] tensor in x's dtype."""
    if _fast(x):
        return _norm_launch(x, weight, eps)
    if _cpu_fast(x):
        return _rms_norm_cpu(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def plain_rms_norm(x, weight, eps):
    """Qwen3's RMSNorm (plain weight): w * (x_f32 * rsqrt(mean(x^2) + eps)).to(dtype). x [..., D], weight [D]
    of x's dtype (another dtype: the reference, whose product then promotes). Returns [..., D]."""
    if _fast(x) and weight.dtype == x.dtype:
        return _norm_launch(x, weight, eps, plain=True)
    return plain_rms_norm_ref(x, weight, eps)


def gated_rms_norm(x, z, weight, eps):
    """GDN output norm (plain weight, gate after the norm): w * norm(x).to(dtype) * silu(z_f32).
    x, z [..., d_v], weight [d_v]. Returns [..., d_v] in x's dtype."""
    if _fast(x):
        return _norm_launch(x, weight, eps, z=z)
    if _cpu_fast(x):  # the normalisation as _rms_norm_cpu's one LayerNorm over [x, -x] (F.rms_norm: a
        # composite of eight ops on a CPU, ~30 us a call on the toy against ~7)
        y = _rms_normalize_cpu(x.float(), eps).to(x.dtype)
        return (weight * y * exact(F.silu, z.float())).to(x.dtype)
    return gated_rms_norm_ref(x, z, weight, eps)


# ----------------------------------------------------------------------------------------------
# FP8 weights: Qwen's block format (e4m3 values, one fp32 scale per 128 x 128 block)
# ----------------------------------------------------------------------------------------------
# A quantized weight W [N, K] is stored as q [N, K] float8_e4m3fn and scale [ceil(N/128), ceil(K/128)]
# (the checkpoints' `weight_scale_inv`): W[n, k] = q[n, k] * scale[n // 128, k // 128]. On the GPU the linears
# run W8A8, as vLLM runs these checkpoints (`activation_scheme: dynamic`): each row of the activations is
# quantized to e4m3 in groups of 128 columns (one fp32 scale per row and group: the smallest power of two that
# brings its largest |x| to at most 448, as DeepGEMM's UE8M0 scales: x / s is then exact), and
# the e4m3 x e4m3 products run on the FP8 tensor cores with fp32 sums, each 128-column block's sum scaled by
# the row's group scale times the weight block's scale. Decode / verify steps (_fp8_gemv_kernel) quantize their
# rows inside the GEMV as they load them; prefill quantizes them first and runs a GEMM (linear_w8a8). Both
# quantize a row alone, so a row's result does not depend on the other rows. The CPU dequantizes the weights and
# runs the unquantized path. MoE experts carry the same layout per expert (weight-only: e4m3 -> fp16 in the
# expert kernels).

FP8_BLOCK = 128
FP8_MAX = 448.0  # e4m3's largest finite value
FP8 = getattr(torch, "float8_e4m3fn", None)


def fp8_quantize(w, block=FP8_BLOCK):
    """w [..., N, K] -> (q float8_e4m3fn [..., N, K], scale fp32 [..., ceil(N/block), ceil(K/block)]): each
    block scaled so that its largest |w| becomes 448 (an all-zero block gets scale 1 and zeros)."""
    *lead, N, K = w.shape
    nb, kb = _cdiv(N, block), _cdiv(K, block)
    wp = F.pad(w.float(), (0, kb * block - K, 0, nb * block - N)).view(*lead, nb, block, kb, block)
    amax = wp.abs().amax(dim=(-3, -1))                                               # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wp / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*lead, nb * block, kb * block)[..., :N, :K].contiguous(), scale


def fp8_dequantize_ref(q, scale, dtype=torch.float32):
    """q [..., N, K] e4m3 and its block scales -> W [..., N, K] = q * scale of its block, in dtype (the
    product is exact in fp32: 4 significant bits times a bf16 or fp32 scale)."""
    N, K = q.shape[-2:]
    s = scale.float().repeat_interleave(FP8_BLOCK, -2)[..., :N, :].repeat_interleave(FP8_BLOCK, -1)[..., :K]
    return (q.float() * s).to(dtype)


@_jit
def _fp8_dequantize_kernel(p_q, p_s, p_w, N, K, KB, BN: tl.constexpr, BK: tl.constexpr):
    # program (N block, K block) of BN x BK <= 128 x 128: w = q * scale of the tile's block
    i_n, i_k = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = i_k * BK + tl.arange(0, BK)
    m = (o_n < N)[:, None] & (o_k < K)[None, :]
    s = tl.load(p_s + (i_n * BN // 128) * KB + i_k * BK // 128)
    p = o_n[:, None].to(tl.int64) * K + o_k[None, :]
    b_w = tl.load(p_q + p, mask=m, other=0.0).to(tl.float32) * s
    tl.store(p_w + p, b_w.to(p_w.dtype.element_ty), mask=m)


def fp8_dequantize(q, scale, dtype):
    """fp8_dequantize_ref, on CUDA by a Triton kernel (prefill dequantizes a weight, then runs cuBLAS)."""
    if not (_fast(q) and q.dim() == 2):
        return fp8_dequantize_ref(q, scale, dtype)
    N, K = q.shape
    w = _empty((N, K), dtype, q.device)
    BN, BK = (64, 128) if q.is_cuda else (32, 32)
    _fp8_dequantize_kernel[(_cdiv(N, BN), _cdiv(K, BK))](q, scale, w, N, K, scale.shape[1], BN=BN, BK=BK,
                                                        num_warps=4)
    return w


# ----------------------------------------------------------------------------------------------
# Linear layers: cuBLAS, or a Triton GEMV / skinny GEMM for decode-sized steps where it beats cuBLAS
# ----------------------------------------------------------------------------------------------
# y [M, N] = x [M, K] @ w [N, K]^T for M <= 32 rows (a decode or verify step: B * T tokens), w the
# weight [out = N, in = K] (row-major, contiguous), x rows with a unit stride along K. One program per
# (block of BN output features, K split): it streams its [BN, K / SPLIT] slice of w once, BK columns
# at a time, in fp32: for M == 1 (BM = 1) the products x_k * w_nk add up elementwise in a [BN, BK] tile
# that is summed over k once after the loop; for M > 1, tl.dot of the M rows (padded to BM = 16) with
# the tile (BM = 32 for 17 to 32 rows). SPLIT == 1: the program writes y directly. SPLIT > 1 (tall
# weights at M > 1, K >= 3N: too few output blocks to fill the GPU): each program writes its fp32 partial sums
# to part [SPLIT, M, N], and _gemv_sum_kernel adds the SPLIT partials in a fixed order and rounds once to x's
# dtype (deterministic, unlike atomics; no zeroing launch). The step is bandwidth-bound (w is read once), so
# the tiles only need to keep enough loads in flight on every multiprocessor. With a residual r [M, N]
# (the MLP's skip connection) the last kernel adds it before its one rounding: y = r + x @ w^T.

GEMV_ALWAYS = False  # tests: take the Triton GEMV for every eligible shape (the interpreter: any M <= 32)
GEMV_PREFETCH = True  # inside drafting(): _gemv_kernel's PRE, its first weight tile loaded before the PDL wait
# for the kernel before. Measured on the H200 (session 25, one device call, A/B rounds interleaved; BENCHMARKS.md):
# draft_model's propose graph (Qwen3-0.6B shapes, k = 4) 3.21 / 4.15 / 5.05 / 5.12 -> 3.21 / 4.10 / 4.87 / 4.98 ms
# at batch 1 / 2 / 4 / 8; the 27B's target steps slower with it (13.99 -> 14.51 ms at batch 1, 15.28 -> 15.67 at
# batch 8: a big GEMV's programs, started early, crowd the kernel before them), the 35B-A3B's level (2.80 ms):
# so a drafter's step only

# Batch invariance (the default). Speculation is lossless only if a verify row (T = k+1) computes exactly what
# the same token's decode row (T = 1) would, and concurrency changes no token only if a row's result does not
# depend on the other rows of its step. In bf16 near-ties are common enough that a different rounding flips a
# greedy token (the losslessness sweep of tools/lossless_sweep.py saw it at T = 2 on the toy model). So with
# BATCH_INVARIANT every decode / verify row gets one arithmetic whatever M, T and the batch are:
#   - linear layers of up to INVARIANT_ROWS rows (bf16 / fp16, CUDA): one Triton kernel whose K chunks and K
#     split are a function of the weight's shape alone (_rows_config), rows in tl.dot tiles of 16 rows (32
#     up to 32 rows, 64 above: _rows_bm), each height with its own BN / stages / warps (_rows_tiles; a row's
#     products do not depend on the other rows of its tile, nor on its height or width); cuBLAS picks its
#     algorithm by M and is left to prefill;
#   - attention: keys split at fixed multiples of ATTN_CHUNK, the splits merged in order, one query-tile
#     shape;
#   - the GDN recurrence: one value-block size and warp count.
# False: the fastest kernel per step shape (cuBLAS by M, the M = 1 GEMV, splits by load): a token may then
# differ between speculation on and off, or between batch sizes, at near-ties.
BATCH_INVARIANT = os.environ.get("VLLM_BATCH_INVARIANT", "1") != "0"  # vLLM's variable; here on unless "0"
INVARIANT_ROWS = 256  # decode and verify steps (max_num_seqs x (k+1) rows); prefill runs under
                      # not_invariant()
ROWS_BM = 64  # the row-invariant linear's row tile above 32 rows (16 up to 16, 32 up to 32): see _rows_bm


def _rows_bm(M):
    """Rows per tile of the row-invariant linear for a step of M rows. A row's bits do not depend on the
    tile's height: tl.dot computes each row of a tile alone, adding its K products in the same order (BK
    chunks, k16 steps) whatever the tile. Measured on the H200 (tools/tile_sweep.py rowsbm): the same bits
    with tiles of 16, 32, 64 and 128 rows at the 27B shapes; the `gpu` invariance tests check a row alone
    (a 16-row tile) against it in steps of 17, 40 and 136 rows (32- and 64-row tiles) at every real shape.
    16-row tiles are the fastest up to 16 rows; above, every tile reads the weights again, and 64-row tiles
    read them 4x less (27B, 128 rows: MLP gate_up 321 -> 174 us, lm_head 2535 -> 1049 us; cuBLAS 93 / 643).
    Steps of 17 to 32 rows (DSpark's 17-token verify, MTP k=3 at batch 8) take 32-row tiles: one tile reads
    the weights once either way, and a 32-row one holds half the rows in registers and shared memory
    (BENCHMARKS.md, session 28: the target's 17- to 32-token steps against 64-row tiles)."""
    return 16 if M <= 16 else 32 if M <= 32 else ROWS_BM


@contextlib.contextmanager
def not_invariant():
    """Prefill runs inside this: each prompt is prefilled alone (one request per forward, whatever else runs),
    by the same kernels with speculation on and off, so its rows need no invariance; cuBLAS and the wide tiles
    are faster there (27B, a 256-token prompt through the row-invariant kernel took 2.6x the time to first
    token)."""
    global BATCH_INVARIANT
    old = BATCH_INVARIANT
    BATCH_INVARIANT = False
    try:
        yield
    finally:
        BATCH_INVARIANT = old


# (N, K) -> the tiles _rows_config gives that weight shape: the fastest at M = 1 of tools/tile_sweep.py rows on the
# H200 (us at M = 1 / 16; the M = 1 GEMV of BATCH_INVARIANT = False, and cuBLAS, at M = 1 in brackets). 27B: in_proj
# 40.6 / 41.2 (40.2, 42.7), qkv 36.0 / 36.8 (35.3, 37.2), o_proj and out_proj 18.6 / 19.5 (17.1, 18.6), gate_up 85.9 /
# 89.8 (84.0, 84.8), down 43.9 / 45.1 (42.9, 49.8), lm_head 557.8 / 573.7 (550.9, 590.0); 35B-A3B (tools/tile_sweep.py
# rowswide, session 39: us at M = 1 / 16 with the split-K sum, the tiles before in brackets): in_proj 14.6 / 15.4
# (16.6 / 17.7), qkv 12.8 / 13.6 (16.1 / 15.8), o_proj and out_proj 7.2 / 7.2 (10.3 / 10.9), router | shared gate |
# shared gate_up 4.9 / 4.8 (6.2 / 6.3), shared down 2.5 / 2.6 (4.0 / 4.2), lm_head 223.7 (221.1). Above 16 rows every
# 64-row tile reads the weights again: at M = 128 (8 x 16-token verifies) 1.5-2x cuBLAS's time (16-row tiles: 2.4-4x):
# invariance's price for big verifies. The 27B's o_proj / out_proj and down split K 8 ways since session 18, when
# their split-K sum took the skip connection and the next RMSNorm (linear's then): each linear and its epilogue
# chained over 8 distinct weights in a CUDA graph, M = 1, us at K split 2 / 4 / 8: o_proj 21.6 / 21.2 / 20.9, down
# 50.8 / 50.1 / 47.8; split 3, the tiles before, with the sum and the norm as two launches: 24.7 and 59.7
# (.scratch/s18/epi.py, device call 3; the FP8 tiles' splits measured best as they were).
ROWS_CONFIG = {
    (16480, 5120): (64, 128, 1, 4, 4), (14336, 5120): (64, 128, 1, 4, 4), (5120, 6144): (64, 128, 8, 4, 4),
    (34816, 5120): (128, 128, 2, 3, 8), (5120, 17408): (64, 128, 8, 4, 4), (248320, 5120): (64, 256, 1, 3, 4),
    (12352, 2048): (32, 256, 1, 4, 4), (9216, 2048): (32, 256, 2, 3, 4), (2048, 4096): (32, 512, 2, 4, 4),
    (1281, 2048): (32, 512, 2, 4, 4), (2048, 512): (32, 512, 1, 4, 4), (248320, 2048): (64, 256, 1, 3, 4),
    (776, 256): (16, 256, 1, 4, 4), (768, 256): (16, 256, 1, 4, 4), (256, 256): (16, 256, 1, 4, 4),
    (2048, 256): (16, 256, 1, 4, 4), (256, 1024): (32, 128, 4, 4, 4), (8256, 256): (64, 64, 1, 5, 4),
    # draft_model's Qwen3-0.6B-shaped LM (tile_sweep.py rows-0.6b; us at M = 1, the rule's tiles in brackets):
    # qkv 5.0 (6.2), o_proj 5.4 (6.2), gate_up 6.2 (7.3), down 6.1 (6.9), lm_head 114.3 (115.0)
    (4096, 1024): (32, 256, 1, 4, 4), (1024, 2048): (32, 256, 4, 4, 4), (6144, 1024): (32, 128, 1, 4, 4),
    (1024, 3072): (32, 128, 4, 4, 4), (248320, 1024): (64, 128, 1, 4, 4)}

# (N, K) -> (BN, num_stages, num_warps) at the 32-row tile height (steps of 17-32 rows, _rows_bm) where faster
# than ROWS_CONFIG's: BK and the K split, which fix the order of a row's sums, stay the shape's (_rows_tiles).
# tools/tile_sweep.py rows17 on the H200 (session 28; us at 17 rows, ROWS_CONFIG's tiles in brackets; a row's bits the
# same as alone): 27B GDN in_proj 40.8 (51.2), qkv 37.8 (45.2), gate_up 91.3 (102.4), down 50.5 (52.1), lm_head 573.5
# (580.0). 35B-A3B (rows17-35b, session 40): GDN in_proj 15.2 (18.5), qkv 15.5 (16.2), shared down 2.8 (3.0); its
# o_proj / out_proj, router | shared and lm_head within 0.4 us of their tiles: kept.
ROWS_CONFIG_32 = {(16480, 5120): (128, 4, 4), (14336, 5120): (128, 4, 4), (34816, 5120): (32, 2, 4),
                  (5120, 17408): (128, 2, 4), (248320, 5120): (128, 3, 8),
                  (12352, 2048): (32, 3, 4), (9216, 2048): (64, 3, 4), (2048, 512): (16, 4, 4)}

# The same at the 64-row tile height (steps of 33-256 rows: ngram / draft_model k = 4 at batch 7-8, DFlash's
# 16-token verify at batch 3-8). tools/tile_sweep.py rows40 on the H200 (session 30; us at 40 / 128 rows,
# ROWS_CONFIG's tiles in brackets; a row's bits the same as alone): 27B GDN in_proj 41.4 / 57.7 (44.9 / 67.1), qkv
# 38.3 / 57.0 (41.6 / 64.8), o_proj and out_proj 25.6 / 44.5 (28.1 / 48.0), gate_up 99.8 / 164.2 (109.9 / 173.1),
# down 54.9 / 75.7 (57.5 / 91.7); lm_head keeps its tiles (623.7 at 40). draft_model's Qwen3-0.6B-shaped LM never
# runs 33+ rows (an attention-only draft's first pass is 2 tokens a request: 16 rows at batch 8; its logits one row
# a request), so its shapes have no entry here. 35B-A3B (rows40-35b, session 40; us at 40 / 128 rows): GDN in_proj
# 17.8 / 24.6 (18.9 / 33.3), qkv 17.5 / 27.9 (20.5 / 36.8); its other shapes within 0.1 us at 40 rows: kept.
ROWS_CONFIG_64 = {(16480, 5120): (128, 4, 8), (14336, 5120): (64, 3, 4), (5120, 6144): (64, 2, 4),
                  (34816, 5120): (64, 2, 4), (5120, 17408): (128, 4, 4),
                  (12352, 2048): (64, 3, 4), (9216, 2048): (64, 3, 4)}
ROWS_TALL = {32: ROWS_CONFIG_32, 64: ROWS_CONFIG_64}  # tile height -> its (N, K) -> (BN, stages, warps)


def _rows_config(N, K, device):
    """(BN, BK, SPLIT, num_stages, num_warps) of the row-invariant skinny GEMM for w [N, K]: a function of the
    shape (and of the GPU's size) only, never of M. A measured entry of ROWS_CONFIG, else a rule: enough
    programs to fill the GPU, with a K split when the N blocks alone are too few
    (each split keeps at least two BK chunks); the splits are added in a fixed order."""
    if (N, K) in ROWS_CONFIG:
        return ROWS_CONFIG[(N, K)]
    BN, BK = 64, min(128, _p2(K))
    blocks = _cdiv(N, BN)
    split = max(1, min(8, (2 * _sm_count(device)) // blocks, K // (2 * BK)))
    return BN, BK, split, 4 if K >= 4096 else 3, 4


def _rows_tiles(N, K, M, device, esize=2):
    """((BN, BK, SPLIT, num_stages, num_warps), BM) of the row-invariant linear for a step of M rows: the row
    tile's height (_rows_bm) and the shape's tiles (_rows_config), with ROWS_CONFIG_32's / ROWS_CONFIG_64's BN,
    stages and warps at the 32- / 64-row heights (ROWS_TALL); BK and SPLIT are the shape's at every height, so a
    row's products and sums are the same, in the same order. The stages are cut to what fits in the GPU's shared
    memory (each holds an x tile [BM, BK] and a w tile [BN, BK] of esize-byte elements): a BK measured at 16 rows
    may not fit 4 stages at 64 (stages do not change a row's bits)."""
    (BN, BK, SPLIT, stages, warps), BM = _rows_config(N, K, device), _rows_bm(M)
    if (N, K) in ROWS_TALL.get(BM, ()):
        BN, stages, warps = ROWS_TALL[BM][(N, K)]
    stages = max(1, min(stages, _shared_memory(device) // ((BM + BN) * BK * esize)))
    return (BN, BK, SPLIT, stages, warps), BM


def _gemv_config(M, N, K, cuda, dtype):
    """(BN, BK, SPLIT, num_stages, num_warps) of the Triton GEMV for x [M, K] @ w [N, K]^T, or None for
    cuBLAS. Measured on an H200 in bf16 (each shape's weights chained in a CUDA graph, against cuBLAS in
    the same graph; the Qwen3.6-27B shapes (hidden 5120) and some 2048-wide ones, M = 1, 2, 8, 16):
      M == 1, N*K >= 2^23: Triton wins on every such shape (2-25%, o_proj and qkv too), unsplit:
        BN x BK = 8 x 1024 for N < 4096, 16 x 512 for N <= 8192 (MLP down too), else 16 x 256, but 32 x 256
        for 15360 < N < 32768 (GDN in_proj; 16-row blocks make ~1000 programs there, a poor last wave).
      M > 1 (the dot path): wide weights (N >= 16384: lm_head, GDN in_proj) unsplit, and tall ones (K >= 3N
        and N*K >= 2^24: MLP down) split-K 4 ways; elsewhere cuBLAS is as fast or faster: attention qkv /
        o_proj, GDN out_proj, and 25600 <= N < 51200 (MLP gate_up, 34816: 400 to 800 programs of 64 rows
        leave a part-filled second wave at 3 per SM; a tie, +-2% from run to run).
      M == 1, 2^20 <= N*K < 2^23 (35B: 1281 x 2048, 2048 x 512): 4-row blocks, all of K at once.
      17 <= M <= 32 (DSpark's 17-token verify; BM = 32): the M > 1 rules, measured at M = 17 (cuBLAS takes the
        same time at M = 16 and 17; MLP down 51.5 -> 46.1 us, lm_head 600 -> 593, GDN in_proj 43.3 -> 42.7);
        M = 18 .. 32 is not measured.
    These rules apply with BATCH_INVARIANT = False; with it (the default), every bf16 / fp16 step of up to
    INVARIANT_ROWS rows on CUDA takes _rows_tiles' instead.
    fp32 stays with cuBLAS (3x slower in Triton at M = 8, an fp32 'ieee' dot; mixed at M = 1). Off CUDA
    (the interpreter; GEMV_ALWAYS only): small blocks, so that tests cover the loops, the masks and
    split-K."""
    tall = K >= 3 * N
    if not cuda:
        return (16, 32, 4 if tall else 1, 1, 4) if GEMV_ALWAYS else None
    if dtype != torch.float32:
        if BATCH_INVARIANT:
            return "rows" if M <= INVARIANT_ROWS else None
        # small (35B's router | shared gate_up, shared down): latency bound; cuBLAS 4.5 / 3.7 us, these 4-row
        # blocks 3.5 / 2.6
        if M == 1 and 1 << 20 <= N * K < 1 << 23:
            return (4, min(2048, _p2(K)), 1, 2, 4)
        if M == 1 and N * K >= 1 << 23:
            if N < 4096:
                return (8, 1024, 1, 4, 8)
            if N <= 8192:
                return (16, 512, 1, 4, 8)
            return (32, 256, 1, 4, 4) if 15360 < N < 32768 else (16, 256, 1, 4, 4)
        if M > 1 and N >= 16384 and not 25600 <= N < 51200:
            return (64, 128, 1, 3, 4)
        if M > 1 and tall and N * K >= 1 << 24:
            return (32, 128, 4, 3, 4) if N >= 4096 else (32, 256, 4, 4, 4)
    if GEMV_ALWAYS:
        return (64, 128, 4 if tall else 1, 3, 4)
    return None


@_jit
def _gemv_w(p_wb, k0, K, m_n, BK: tl.constexpr):
    # the weight tile [BN, BK] of _gemv_kernel's K tile at k0, its columns and their mask
    o_k = k0 + tl.arange(0, BK)
    m_k = o_k < K
    return tl.load(p_wb + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0), o_k, m_k


@_jit
def _gemv_tile(p_x, b_acc, b_acc1, b_w, o_m, o_k, m_k, M, s_x, BM: tl.constexpr, DOT: tl.constexpr,
               PREC: tl.constexpr):
    # one K tile of _gemv_kernel: its products added to the running sums (b_acc1: M == 1, elementwise)
    if BM == 1:
        b_x = tl.load(p_x + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_acc1 += b_w.to(tl.float32) * b_x[None, :]
    else:
        b_x = tl.load(p_x + o_m[:, None] * s_x + o_k[None, :], mask=(o_m < M)[:, None] & m_k[None, :], other=0.0)
        b_acc += tl.dot(b_x.to(DOT), tl.trans(b_w.to(DOT)), input_precision=PREC)
    return b_acc, b_acc1


@_jit
def _gemv_kernel(p_x, p_w, p_y, p_r, M, N, K, s_x, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 SPLIT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, RES: tl.constexpr, PDL: tl.constexpr,
                 PRE: tl.constexpr):
    # program (row tile, N block, K split): y[row tile, N block] (SPLIT == 1) or
    # part[split, row tile, N block] (SPLIT > 1) = x[row tile, K slice] @ w[N block, K slice]^T, K slice =
    # columns k0 .. k0 + BK - 1 for k0 = split * BK, (split + SPLIT) * BK, ... in fp32. Row tiles are the
    # fastest grid axis: the programs that read one weight tile run side by side (the repeats come from L2).
    # PDL: see _pdl. PRE: the first K tile taken before the loop, its weights loaded before the PDL wait (weights
    # are never written inside a step), so that they stream while the kernel before finishes; the same products
    # in the same order as without it, so the same bits
    i_m, i_n, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_bn = tl.arange(0, BN)
    o_n = i_n * BN + o_bn
    o_m = i_m * BM + tl.arange(0, BM)
    m_n = o_n < N
    p_wb = p_w + (i_n * BN).to(tl.int64) * K + o_bn[:, None] * K                       # [BN, 1] weight rows
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    b_acc1 = tl.zeros([BN, BK], dtype=tl.float32)  # M == 1: products, summed over BK only after the loop
    k_first = i_k * BK
    if PRE:
        if PDL:
            gdc_launch_dependents()
        b_w, o_k, m_k = _gemv_w(p_wb, k_first, K, m_n, BK)
        if PDL:
            gdc_wait()
        b_acc, b_acc1 = _gemv_tile(p_x, b_acc, b_acc1, b_w, o_m, o_k, m_k, M, s_x, BM, DOT, PREC)
        k_first += BK * SPLIT
    else:
        _pdl_sync(PDL)
    for k0 in range(k_first, K, BK * SPLIT):
        b_w, o_k, m_k = _gemv_w(p_wb, k0, K, m_n, BK)
        b_acc, b_acc1 = _gemv_tile(p_x, b_acc, b_acc1, b_w, o_m, o_k, m_k, M, s_x, BM, DOT, PREC)
    if BM == 1:
        b_acc = tl.sum(b_acc1, 1)[None, :]
    m_y = (o_m < M)[:, None] & m_n[None, :]
    if RES:  # SPLIT == 1 only (split-K adds it in _gemv_sum_kernel)
        b_acc += tl.load(p_r + o_m[:, None] * N + o_n[None, :], mask=m_y, other=0.0).to(tl.float32)
    p_out = p_y + i_k * M * N + o_m[:, None] * N + o_n[None, :]
    tl.store(p_out, b_acc.to(p_y.dtype.element_ty), mask=m_y)


@_jit
def _split_sum(p_part, o, m, MN, SPLIT: tl.constexpr):
    # the split-K partials [SPLIT, M * N] fp32 at flat offsets o (a tensor of any shape), added in order from zero:
    # the one arithmetic of every launch that sums a GEMV's K split
    b = tl.zeros(o.shape, dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        b += tl.load(p_part + s * MN + o, mask=m, other=0.0)
    return b


@_jit
def _split_swiglu(p_part, p_h, o, M, N, I, OFF, SPLIT: tl.constexpr):
    # h at flat offsets o over [M, I] = silu(gate) * up, gate and up columns OFF + j and OFF + I + j of the partials'
    # rows of N: each summed (_split_sum) and rounded to h's dtype as a sum launch writes y, then _silu_mul_kernel's
    # arithmetic
    m = o < M * I
    o_g = (o // I) * N + OFF + o % I
    dt = p_h.dtype.element_ty
    b_g = _split_sum(p_part, o_g, m, M * N, SPLIT).to(dt).to(tl.float32)
    b_u = _split_sum(p_part, o_g + I, m, M * N, SPLIT).to(dt).to(tl.float32)
    tl.store(p_h + o, (b_g / (1.0 + tl.exp(-b_g)) * b_u).to(dt), mask=m)


@_jit
def _gemv_sum_kernel(p_part, p_y, p_r, MN, SPLIT: tl.constexpr, BS: tl.constexpr, RES: tl.constexpr,
                     PDL: tl.constexpr):
    # y = [r +] sum over the SPLIT partials [SPLIT, M * N] fp32, in order, rounded once
    _pdl_sync(PDL)
    o = tl.program_id(0) * BS + tl.arange(0, BS)
    m = o < MN
    b_y = _split_sum(p_part, o, m, MN, SPLIT)
    if RES:
        b_y += tl.load(p_r + o, mask=m, other=0.0).to(tl.float32)
    tl.store(p_y + o, b_y.to(p_y.dtype.element_ty), mask=m)


@_jit
def _gemv_sum_swiglu_kernel(p_part, p_y, M, I, SPLIT: tl.constexpr, BS: tl.constexpr, PDL: tl.constexpr):
    # y [M, I] = silu(g) * up, g and up the split-K sums of columns j and I + j of the partials [SPLIT, M, 2I]:
    # each summed in order and rounded as _gemv_sum_kernel writes it, then _silu_mul_kernel's arithmetic
    _pdl_sync(PDL)
    _split_swiglu(p_part, p_y, tl.program_id(0) * BS + tl.arange(0, BS), M, 2 * I, I, 0, SPLIT)  # over M * I


@_jit
def _gemv_sum_norm_kernel(p_part, p_r, p_w, p_h, p_y, M, N, eps, SPLIT: tl.constexpr, BD: tl.constexpr,
                          RES: tl.constexpr, PLAIN: tl.constexpr, PDL: tl.constexpr):
    # program (row): h = [r +] the split-K sum of the row's partials [SPLIT, M, N], in order, rounded once (what
    # _gemv_sum_kernel writes), and y = rms_norm(h) with a zero-centred weight (PLAIN: Qwen3's plain one), as
    # _rms_norm_kernel computes it from h: the GEMM's last step, the skip connection and the next RMSNorm in one
    # launch
    _pdl_sync(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)[None, :]                                                   # [1, BD]: one row
    m = o_d < N
    b_x = _split_sum(p_part, i_r * N + o_d, m, M * N, SPLIT)
    if RES:
        b_x += tl.load(p_r + i_r * N + o_d, mask=m, other=0.0).to(tl.float32)
    b_x = b_x.to(p_h.dtype.element_ty)
    tl.store(p_h + i_r * N + o_d, b_x, mask=m)
    b_x = b_x.to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, 1) / N + eps)                                # [1]
    b_w = tl.load(p_w + o_d, mask=m, other=0.0).to(tl.float32)
    b_y = _norm_scale(b_x, b_rstd[:, None], b_w, p_y.dtype.element_ty, PLAIN)
    tl.store(p_y + i_r * N + o_d, b_y.to(p_y.dtype.element_ty), mask=m)


SWIGLU_BS = 256  # _gemv_sum_swiglu_kernel's outputs per program
NORM_WARPS = 8   # _gemv_sum_norm_kernel's warps (one program per row)


class PlainNorm(tuple):
    """linear's `then` for Qwen3's plain RMSNorm (a drafter's layers): its (weight, eps), marked plain (a bare
    (weight, eps) is the target's zero-centred one)."""


def _norm_then(then, N, dtype=None):
    """then's (weight, eps) where it is an RMSNorm over N columns (a linear's `then`: apply_then) that a sum launch
    can do with rms_norm's / plain_rms_norm's bits, else None: a plain one (PlainNorm) only for rows of dtype with a
    weight of the same dtype (as plain_rms_norm's kernel; dtype None: a launch without a plain form)."""
    if not (isinstance(then, tuple) and then[0].shape == (N,)):
        return None
    return None if isinstance(then, PlainNorm) and then[0].dtype != dtype else then


def apply_then(y, then):
    """What a linear's output goes through next, unfused: then None (nothing), "swiglu" (silu_mul: y [..., 2I]
    = [gate | up] -> [..., I]), (weight, eps) of a zero-centred RMSNorm (-> (rms_norm(y), y)) or of a plain one
    (PlainNorm: -> (plain_rms_norm(y), y)), or a MoE router's Route (-> (y, moe_route's w and idx of its first
    n_experts columns[, silu_mul of its columns from swiglu]), y [N, out])."""
    if then is None:
        return y
    if then == "swiglu":
        return silu_mul(y)
    if isinstance(then, Route):
        rest = () if then.swiglu is None else (silu_mul(y[:, then.swiglu:]),)
        return (y, *moe_route(y[:, :then.n_experts], then.top_k), *rest)
    return (plain_rms_norm if isinstance(then, PlainNorm) else rms_norm)(y, *then), y


def _gemv_launch(x, w, cfg, residual=None, scale=None, then=None):
    """x [..., K] (M rows), w [N, K] contiguous of x's dtype (or e4m3 with its block scales `scale`), cfg from
    _gemv_config ("rows": _rows_tiles' tiles and row height for M; "fp8": _fp8_gemv_kernel with _fp8_config's
    tiles), residual None or [..., N] -> [residual +] x @ w^T [..., N], through `then` (apply_then): where the K
    split needs a second launch to add its partials, that launch also does `then` (_gemv_sum_swiglu_kernel,
    _gemv_sum_norm_kernel, _gemv_sum_route_kernel)."""
    N, K = w.shape
    xr = _rows(x)
    M = xr.shape[0]
    y = _empty((*x.shape[:-1], N), x.dtype, x.device)
    r = y if residual is None else residual.contiguous()                             # [M, N] rows, like y
    assert M >= 1 and xr.shape[1] == K and w.is_contiguous()
    pdl = _pdl(x)
    if cfg == "fp8":  # tiles of the weight's shape alone; rows 16 a tile up to 16, _fp8_bm's above
        assert w.dtype == FP8 and scale.dtype == torch.float32 and scale.is_contiguous()
        assert scale.shape == (_cdiv(N, FP8_BLOCK), _cdiv(K, FP8_BLOCK))
        (BN, SPLIT, stages, warps), BM = _fp8_config(N, K, x.device), _fp8_bm(M)
        grid = (_cdiv(M, BM), _cdiv(N, BN), SPLIT)
        out = y if SPLIT == 1 else _empty((SPLIT, M, N), torch.float32, x.device)
        desc = _fp8_desc(w, BN)
        _fp8_gemv_kernel[grid](xr, w, w if desc is None else desc, scale, out, r, M, N, K, xr.stride(0),
                               scale.shape[1], BM=BM, BN=BN, SPLIT=SPLIT,
                               EXACT=x.dtype == torch.float32 or not x.is_cuda,
                               RES=residual is not None and SPLIT == 1, TMA=desc is not None, PDL=pdl,
                               num_stages=stages, num_warps=warps, **_launch(pdl))
    else:
        assert scale is None and w.dtype == x.dtype
        if cfg == "rows":
            (BN, BK, SPLIT, stages, warps), BM = _rows_tiles(N, K, M, x.device, x.element_size())
        else:
            (BN, BK, SPLIT, stages, warps), BM = cfg, 1 if M == 1 else (16 if M <= 16 else 32)
            assert M <= 32
        dot = _dot_dtype(x)
        grid = (_cdiv(M, BM), _cdiv(N, BN), SPLIT)
        out = y if SPLIT == 1 else _empty((SPLIT, M, N), torch.float32, x.device)
        _gemv_kernel[grid](xr, w, out, r, M, N, K, xr.stride(0), BM=BM, BN=BN, BK=BK, SPLIT=SPLIT, DOT=dot,
                           PREC="ieee" if dot == tl.float32 else "tf32", RES=residual is not None and SPLIT == 1,
                           PDL=pdl, PRE=GEMV_PREFETCH and DRAFTING, num_stages=stages, num_warps=warps, **_launch(pdl))
    if SPLIT == 1:
        return apply_then(y, then)
    if isinstance(then, Route) and residual is None:  # a MoE router: its top-k in the sum's launch
        return _sum_route_launch(out, y, M, N, SPLIT, then, pdl)
    if then == "swiglu" and residual is None:  # (the partials hold [gate | up] rows: N = 2I)
        I = N // 2
        y = _empty((*x.shape[:-1], I), x.dtype, x.device)
        BS = min(SWIGLU_BS, _p2(M * I))
        _gemv_sum_swiglu_kernel[(_cdiv(M * I, BS),)](out, y, M, I, SPLIT=SPLIT, BS=BS, PDL=pdl, num_warps=4,
                                                     **_launch(pdl))
        return y
    if _norm_then(then, N, x.dtype) is not None:
        nw, eps = then
        h = y
        y = _empty(h.shape, x.dtype, x.device)
        BD = _p2(N)
        _gemv_sum_norm_kernel[(M,)](out, r, nw.contiguous(), h, y, M, N, eps, SPLIT=SPLIT, BD=BD,
                                    RES=residual is not None, PLAIN=isinstance(then, PlainNorm), PDL=pdl,
                                    num_warps=min(NORM_WARPS, max(1, BD // 256)), **_launch(pdl))
        return y, h
    BS = min(1024, _p2(M * N))
    _gemv_sum_kernel[(_cdiv(M * N, BS),)](out, y, r, M * N, SPLIT=SPLIT, BS=BS, RES=residual is not None,
                                          PDL=pdl, num_warps=4, **_launch(pdl))
    return apply_then(y, then)


def linear_fp8_ref(x, q, scale, residual=None):
    """The weight-only FP8 linear's reference (the CPU's path): dequantize in fp32, multiply in fp32, round once
    to x's dtype."""
    y = x.float() @ fp8_dequantize_ref(q, scale).t()
    return (y if residual is None else residual.float() + y).to(x.dtype)


# Prefill (W8A8, as vLLM runs Qwen's FP8 checkpoints): the activations quantized per token in groups of 128
# columns (e4m3, one fp32 scale per row and group: a power of two, below), then one GEMM on the FP8 tensor
# cores whose fp32 partial sums per 128-column block are scaled by the row's group scale times the weight
# block's scale. Twice the bf16 tensor cores' rate, and no dequantized copy of the weight. Prefill is shared
# by speculation on and off, so it need not compute what a decode row computes.

def fp8_act_quant_ref(x, group=FP8_BLOCK):
    """x [M, K] -> (q e4m3 [M, K], scale fp32 [M, ceil(K/group)]): each row's groups of `group` columns
    divided by a power of two, the smallest that brings their largest |x| to at most 448 (never below
    2^-126; an all-zero group: scale 1). Dividing by a power of two is exact, so q is x / scale rounded
    once, to nearest even, as e4m3 (amax / 448 as the scale, vLLM's choice, costs an exact division per
    element in the decode GEMV, whose loop is short of bandwidth: 2.5x slower on the H200; its fast division
    rounds differently)."""
    M, K = x.shape
    kb = _cdiv(K, group)
    xp = F.pad(x.float(), (0, kb * group - K)).view(M, kb, group)
    amax = xp.abs().amax(-1)
    m, E = torch.frexp(amax)                           # amax = m * 2^E, m in [0.5, 1); 448 = 0.875 * 2^9
    e = (E - 9 + (m > 0.875).int()).clamp(min=-126)    # the smallest e with amax <= 448 * 2^e
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), e), torch.ones_like(amax))
    q = (xp / scale[..., None]).to(FP8)
    return q.view(M, kb * group)[:, :K].contiguous(), scale


def linear_w8a8_ref(x, q, scale, residual=None):
    """The W8A8 linear's reference: x quantized per token group, both dequantized, multiplied in fp32, rounded
    once to x's dtype."""
    xq, xs = fp8_act_quant_ref(_rows(x))
    xd = xq.float() * xs.repeat_interleave(FP8_BLOCK, 1)[:, :xq.shape[1]]        # a scale per row and group
    y = xd @ fp8_dequantize_ref(q, scale).t()
    y = y.view(*x.shape[:-1], q.shape[0])
    return (y if residual is None else residual.float() + y).to(x.dtype)


@_jit
def _pow2_scales(b_x):
    # b_x [R, 128] fp32 -> (s, 1 / s) [R]: fp8_act_quant_ref's scale of each line, read off the bits of its
    # largest |x|, amax = m * 2^E with m in [1, 2): amax <= 448 * 2^e (448 = 1.75 * 2^8) first holds at e =
    # E - 8, or E - 7 when m > 1.75; e >= -126; an all-zero line: 1
    amax = tl.max(tl.abs(b_x), 1)
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.where(amax > 0, tl.maximum(e, -126), 0)
    return ((e + 127) << 23).to(tl.float32, bitcast=True), ((127 - e) << 23).to(tl.float32, bitcast=True)


@_jit
def _e4m3_groups(b_x):
    # b_x [R, 128] fp32 (a row's group of 128 columns per line) -> (q, s): s [R] fp8_act_quant_ref's
    # power-of-two scale, q [R, 128] = x / s on e4m3's grid (fp32 values that convert to e4m3 exactly)
    s, r = _pow2_scales(b_x)
    b_v = b_x * r[:, None]                                                     # exact, |v| <= 448
    # |v| rounded to e4m3's grid here, to nearest and ties to even (its step is 2^(e-3) for |v| in [2^e,
    # 2^(e+1)), 2^-9 below 2^-6), so that the conversion after is exact (Triton's interpreter rounds some
    # values wrongly: 124 -> 64, 31 -> 16); then v's sign bit, so that a negative value rounding to zero
    # gives -0 as torch's conversion does
    b_bits = b_v.to(tl.int32, bitcast=True)
    b_a = tl.abs(b_v)
    e = tl.maximum(((b_a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((e + 124) << 23).to(tl.float32, bitcast=True)                        # 2^(e - 3)
    inv = ((130 - e) << 23).to(tl.float32, bitcast=True)                         # 2^(3 - e): exact products
    b_r = ((b_a * inv + 12582912.0) - 12582912.0) * step                    # (1.5 * 2^23: round to even)
    return (b_r.to(tl.int32, bitcast=True) | (b_bits & -2147483648)).to(tl.float32, bitcast=True), s


@_jit
def _fp8_act_quant_kernel(p_x, p_q, p_s, K, KB, s_x, G: tl.constexpr, GB: tl.constexpr):
    # program (row, GB groups of G columns): q = x / s, s each group's power-of-two scale (fp8_act_quant_ref)
    i_m, i_g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_g = i_g * GB + tl.arange(0, GB)                                                 # [GB] groups
    o = o_g[:, None] * G + tl.arange(0, G)[None, :]                                   # [GB, G] columns
    b_x = tl.load(p_x + i_m * s_x + o, mask=o < K, other=0.0).to(tl.float32)
    b_q, s = _e4m3_groups(b_x)
    tl.store(p_q + i_m * K + o, b_q.to(p_q.dtype.element_ty), mask=o < K)
    tl.store(p_s + i_m * KB + o_g, s, mask=o_g < KB)


def fp8_act_quant(x):
    """fp8_act_quant_ref, on CUDA by a Triton kernel (one program per row and 8 groups)."""
    if not _fast(x):
        return fp8_act_quant_ref(x)
    M, K = x.shape
    KB = _cdiv(K, FP8_BLOCK)
    q, s = _empty((M, K), FP8, x.device), _empty((M, KB), torch.float32, x.device)
    _fp8_act_quant_kernel[(M, _cdiv(KB, 8))](x, q, s, K, KB, x.stride(0), G=FP8_BLOCK, GB=8, num_warps=4)
    return q, s


@_jit
def _w8a8_kernel(p_a, p_as, p_w, p_ws, p_y, p_r, M, N, K, KB, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, RES: tl.constexpr):
    # program (M block, N block): y = sum over K blocks of (a_blk @ w_blk^T) * a_scale[row, blk] *
    # w_scale[blk] [+ r]; BN and BK divide 128 (one weight scale per tile, one activation scale per row)
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_a = tl.load(p_a + o_m[:, None].to(tl.int64) * K + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                      other=0.0)
        b_w = tl.load(p_w + o_n[:, None].to(tl.int64) * K + o_k[None, :], mask=m_n[:, None] & m_k[None, :],
                      other=0.0)
        b_sa = tl.load(p_as + o_m * KB + k0 // 128, mask=m_m, other=0.0)                  # [BM]
        s_w = tl.load(p_ws + (i_n * BN // 128) * KB + k0 // 128)
        b_acc += tl.dot(b_a, tl.trans(b_w)) * (b_sa * s_w)[:, None]
    m_y = m_m[:, None] & m_n[None, :]
    p = o_m[:, None].to(tl.int64) * N + o_n[None, :]
    if RES:
        b_acc += tl.load(p_r + p, mask=m_y, other=0.0).to(tl.float32)
    tl.store(p_y + p, b_acc.to(p_y.dtype.element_ty), mask=m_y)


def linear_w8a8(x, q, scale, residual=None):
    """x [..., K] @ (q * scale)^T [+ residual] with x quantized per token group (fp8_act_quant): prefill's FP8
    GEMM. On the CPU (no Triton): linear_w8a8_ref."""
    if not _fast(x):
        return linear_w8a8_ref(x, q, scale, residual)
    N, K = q.shape
    xr = _rows(x)
    M = xr.shape[0]
    assert scale.shape == (_cdiv(N, FP8_BLOCK), _cdiv(K, FP8_BLOCK)) and scale.dtype == torch.float32
    a, sa = fp8_act_quant(xr)
    y = _empty((*x.shape[:-1], N), x.dtype, x.device)
    r = y if residual is None else residual.contiguous()
    # tools/tile_sweep.py w8a8 on the H200, 2048 rows at the 27B shapes: 64 x 128 x 128 tiles, 3-4 stages,
    # 4 warps are the fastest (870-923 TFLOP/s; cuBLAS bf16 787-799 on the same shapes; 128 x 128 x 128 with
    # 8 warps 3-9 % slower)
    BM, BN, BK, stages, warps = (64, 128, 128, 3, 4) if x.is_cuda else (16, 32, 32, 1, 4)
    _w8a8_kernel[(_cdiv(M, BM), _cdiv(N, BN))](a, sa, q, scale, y, r, M, N, K, scale.shape[1], BM=BM, BN=BN,
                                               BK=BK, RES=residual is not None, num_stages=stages,
                                               num_warps=warps)
    return y


@_jit
def _fp8_gemv_kernel(p_x, p_w, w_desc, p_s, p_y, p_r, M, N, K, s_x, KB, BM: tl.constexpr, BN: tl.constexpr,
                     SPLIT: tl.constexpr, EXACT: tl.constexpr, RES: tl.constexpr, TMA: tl.constexpr,
                     PDL: tl.constexpr):
    # Decode / verify W8A8 (x [M, K] rows, w e4m3 [N, K], s its block scales [*, KB]): program (row tile, N
    # block, K split) sums over its K blocks k0 = split * 128, (split + SPLIT) * 128, ...: (w_tile [BN, 128]
    # @ xq_tile^T [128, BM]) * w_scale * x_scale[row], xq_tile the rows' group of 128 columns quantized in
    # registers as they are loaded (no extra launch): x / s with fp8_act_quant's power-of-two scale s, an
    # exact product by 1 / s, rounded to e4m3 by the hardware's conversion (to nearest even) on the GPU: the
    # same e4m3 values as fp8_act_quant_ref's, at a multiply per element (the loop is short of bandwidth: an
    # IEEE division per element made the 27B's linears 2.5x slower on the H200). The weight tile is the
    # dot's first operand (BN = 64 or 128 rows of a wgmma, the BM = 16 or 32 rows of x its N: _fp8_bm), fed
    # to the FP8 tensor cores as it was loaded. EXACT (fp32 rows; the interpreter, whose e4m3 conversion rounds some
    # values wrongly): fp8_act_quant's rounding in arithmetic and an fp32 dot. Either way the result is
    # linear_w8a8_ref's to fp32 rounding, and a row is quantized alone: its result does not depend on the
    # other rows. BN divides 128 (a tile lies in one scale block). TMA: the weight tiles come through w_desc,
    # a tensor descriptor of w with [BN, 128] boxes (_fp8_desc; the copy engine fills what lies past N or K
    # with zeros, as the masked load does): the same tile, so the same bits. Writes y [M, N] (SPLIT == 1) or
    # the fp32 partials part [SPLIT, M, N] (_gemv_sum_kernel adds them in order).
    _pdl_sync(PDL)
    i_m, i_n, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = i_m * BM + tl.arange(0, BM)
    m_n, m_m = o_n < N, o_m < M
    p_wb = p_w + o_n[:, None].to(tl.int64) * K
    b_acc = tl.zeros([BN, BM], dtype=tl.float32)                                     # y^T tile
    for k0 in range(i_k * 128, K, 128 * SPLIT):
        o_k = k0 + tl.arange(0, 128)
        m_k = o_k < K
        if TMA:
            b_w = w_desc.load([i_n * BN, k0])                                                 # [BN, 128] e4m3
        else:
            b_w = tl.load(p_wb + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_x = tl.load(p_x + o_m[:, None] * s_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                      other=0.0).to(tl.float32)                                               # [BM, 128]
        s_w = tl.load(p_s + (i_n * BN // 128) * KB + k0 // 128)
        if EXACT:
            b_q, b_sx = _e4m3_groups(b_x)
            b_p = tl.dot(b_w.to(tl.float32), tl.trans(b_q), input_precision="ieee")
        else:
            b_sx, b_inv = _pow2_scales(b_x)                                                      # [BM]
            b_q = (b_x * b_inv[:, None]).to(p_w.dtype.element_ty, fp_downcast_rounding="rtne")
            b_p = tl.dot(b_w, tl.trans(b_q))
        b_acc += b_p * (b_sx * s_w)[None, :]
    m_y = m_n[:, None] & m_m[None, :]
    o_y = o_m[None, :] * N + o_n[:, None]                                             # [BN, BM] offsets
    if RES:  # SPLIT == 1 only
        b_acc += tl.load(p_r + o_y, mask=m_y, other=0.0).to(tl.float32)
    tl.store(p_y + i_k * M * N + o_y, b_acc.to(p_y.dtype.element_ty), mask=m_y)


# FP8 weights (N, K) -> (BN, SPLIT, num_stages, num_warps) of _fp8_gemv_kernel: the fastest at M = 1 of
# tools/tile_sweep.py fp8 on the H200 (session 17, device call 3, weight tiles by TMA: us per weight, many copies
# chained in a CUDA graph; session 10's tiles with plain loads in brackets). 27B: GDN in_proj (qkv | z) 24.1
# (26.4), attention qkv 21.9 (24.3), o_proj / out_proj 12.8 (14.2), MLP gate_up 48.2 (50.3), down 26.8 (29.0):
# 7.1 ms of FP8 linears per token against 7.6. 35B-A3B: GDN in_proj 9.9, qkv 8.5, o_proj 7.4, shared expert's
# gate | up 4.9, shared down 3.4 (4.1 at session 11's tiles). Other shapes: the rule below. The 27B's MLP down
# takes 4 warps, not the 8 fastest there at one row: tools/tile_sweep.py fp8rows (session 30), 2-16 rows in one
# 16-row tile, 4 warps 1.8-2.2 % faster (8 rows: 27.7 -> 27.1 us), the same bits; at one row 27.0 -> 27.2 us alone,
# and the same in the step (27B FP8 off, one process, two rounds: batch 1 8.577 -> 8.576 ms, batch 8 9.769 -> 9.744).
FP8_ROWS_CONFIG = {
    (16384, 5120): (128, 2, 4, 4), (14336, 5120): (128, 2, 4, 4), (5120, 6144): (128, 8, 3, 4),
    (34816, 5120): (128, 4, 3, 4), (5120, 17408): (128, 8, 3, 4),
    (12288, 2048): (128, 4, 3, 8), (9216, 2048): (128, 4, 3, 4), (2048, 4096): (128, 4, 4, 8),
    (1024, 2048): (128, 4, 3, 8), (2048, 512): (64, 2, 3, 8)}


def _fp8_config(N, K, device):
    """Tiles of _fp8_gemv_kernel for an FP8 weight [N, K]: a function of the shape alone, never of M (the
    row-invariant rule), BN dividing 128 (every tile in one scale block)."""
    if device.type != "cuda":
        return (16, 4 if K >= 3 * N else 1, 1, 4)  # the interpreter: small tiles, the K split covered
    if (N, K) in FP8_ROWS_CONFIG:
        return FP8_ROWS_CONFIG[(N, K)]
    BN = 128 if N >= 8192 else 64
    blocks, kb = _cdiv(N, BN), _cdiv(K, 128)
    split = max(1, min(8, _p2(max(1, 2 * _sm_count(device) // blocks)), kb // 4))     # ~2 programs per SM
    return BN, split, 3, 8 if BN == 128 else 4


FP8_TMA = True  # _fp8_gemv_kernel's weight tiles through the tensor memory accelerator where it can: _fp8_desc


def _fp8_desc(w, BN):
    """A tensor descriptor of the e4m3 weight w [N, K] with [BN, 128] boxes (made once per weight and BN), or
    None where the tiles take plain loads: FP8_TMA off, no Triton descriptors, a GPU without TMA (compute
    capability < 9), or a row stride or base not on 16 bytes (TMA's rule). The interpreter takes it too, so the
    CPU tests cover its indexing and its zero fill past N and K. Measured on the H200 (session 17, tools/
    tile_sweep.py fp8: each FP8 shape at M = 1 chained over distinct weights in a CUDA graph, us, plain loads at
    the same tiles in brackets): 27B GDN in_proj 24.1 (25.6), attention qkv 21.9 (23.1), o_proj 12.8 (13.2),
    MLP gate_up 48.2 (49.6), down 26.8 (28.3); 35B-A3B 9.9 (10.2), 8.5 (8.8), 7.4 (8.0), 4.9 (5.3), 3.4 (3.2);
    the same bits at every shape."""
    if not FP8_TMA or TensorDescriptor is None or w.shape[1] % 16 or w.data_ptr() % 16:
        return None
    return _derived(w, f"tma{BN}", lambda w: TensorDescriptor.from_tensor(w, [BN, FP8_BLOCK])
                    if not w.is_cuda or torch.cuda.get_device_capability(w.device)[0] >= 9 else None)


FP8_BM = 32  # _fp8_gemv_kernel's row tile above 16 rows (16 up to 16): see _fp8_bm


def _fp8_bm(M):
    """Rows per tile of _fp8_gemv_kernel for a step of M rows, as _rows_bm for the bf16 kernel: each row of a
    tile is quantized alone and its column of the tl.dot sums its products in one order whatever the tile's
    height, so a row's bits do not depend on it. Measured on the H200 (tools/tile_sweep.py fp8bm, session 16):
    the same bits with tiles of 16, 32, 64 and 128 rows at every 27B / 35B-A3B FP8 shape, and a row alone ==
    the row in steps of 17, 40 and 136. Above 16 rows every tile reads the weights again. The 27B's FP8 linears
    of one step (its 48 GDN, 16 attention and 64 MLP layers' weights from the sweep's times), ms at 17 / 32 / 64
    / 128 rows: tiles of 16 rows 11.7 / 12.1 / 20.7 / 39.4, of 32 10.7 / 9.7 / 16.2 / 30.6, of 64 15.5 / 15.9 /
    16.7 / 30.7, of 128 33.9 / 33.8 / 35.0 / 35.6 (7.5 at 1 row)."""
    return 16 if M <= 16 else FP8_BM


# Without BATCH_INVARIANT (prefill) steps of more rows take the W8A8 GEMM: each row tile of the GEMV streams
# the weights again (27B: ~7.6 ms per tile).
FP8_KERNEL_ROWS = 48


def _linear_fp8(x, q, scale, residual, then=None):
    """x @ (q * scale)^T [+ residual], W8A8 on the GPU: decode and verify steps (up to INVARIANT_ROWS rows;
    FP8_KERNEL_ROWS without BATCH_INVARIANT, as in prefill) through the GEMV that quantizes its rows as it
    reads them (_fp8_gemv_kernel), longer bf16 / fp16 steps through the W8A8 GEMM (linear_w8a8), fp32 steps
    of any length through the GEMV (its EXACT form: fp32 sums, which the FP8 tensor cores do not keep). The
    CPU dequantizes the weight to x's dtype and takes linear's path (the row-invariant reference, the
    dequantized weight kept with q: a scale changed in place without q is not seen)."""
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (_fast(x) and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and (residual is None or residual.dtype == x.dtype)):
        if 1 <= M and (M <= (INVARIANT_ROWS if BATCH_INVARIANT else FP8_KERNEL_ROWS) or x.dtype == torch.float32):
            return _gemv_launch(x, q, "fp8", residual, scale, then)  # decode, verify; fp32 (EXACT) any step
        return apply_then(linear_w8a8(x, q, scale, residual), then)                      # prefill
    if not x.is_cuda:  # the CPU: the dequantized weight made once (the toy models are small)
        w = _derived(q, f"fp8_{x.dtype}", lambda q: fp8_dequantize_ref(q, scale, x.dtype))
        return apply_then(linear(x, w, residual), then)
    return apply_then(linear(x, fp8_dequantize(q, scale, x.dtype), residual), then)


def linear(x, w, residual=None, scale=None, norm=None, then=None):
    """x @ w^T, x [..., in], w [out, in]; with residual [..., out]: residual + x @ w^T (a skip connection,
    added inside the Triton kernel's last step, before its one rounding). On the GPU (bf16 / fp16): steps of
    up to INVARIANT_ROWS rows through the row-invariant Triton kernel (BATCH_INVARIANT), or, without it,
    cuBLAS except steps of at most 32 rows on the weight shapes where the Triton GEMV is faster
    (_gemv_config). The CPU reference computes decode and verify steps (token_steps(); other steps up to
    CPU_MKL_ROWS rows) one row at a time, so that a token's
    result does not depend on how many tokens share the step (BLAS picks other kernels for M = 1 and M = k+1):
    spec-on logprobs then equal spec-off's. The CPU fast path (CPU_FAST) gets the same property without a
    Python loop per row: see _linear_cpu. An FP8 weight (e4m3, with its block scales `scale`): _linear_fp8.
    What x goes through first: norm = (weight, eps), Qwen3's RMSNorm (plain_rms_norm). What the output goes
    through next (apply_then): then = "swiglu", w = [gate | up] [2I, in] and silu(gate) * up [..., I] is returned
    (silu_mul); then = (weight, eps), a zero-centred RMSNorm, and (rms_norm(y), y) is returned (y: the output
    with the residual, the layer's new residual stream). Fused where it saves a launch, with the roundings of
    the kernels it replaces: the Triton GEMV's split-K sum does `then` (_gemv_launch), and inside drafting() a
    small linear (_linear_small) does the norm as it loads x and the SwiGLU as it writes."""
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (DRAFTING and _fast(x) and w.dtype != FP8 and then in (None, "swiglu") and _small_linear(M, w, x, residual)
            and (norm is None or norm[0].dtype == x.dtype) and (then is None or residual is None)):
        return _linear_small(x, w, residual, norm, then == "swiglu")
    if norm is not None:
        x = plain_rms_norm(x, *norm)
    if w.dtype == FP8:
        assert scale is not None, "an FP8 weight needs its block scales"
        return _linear_fp8(x, w, scale, residual, then)
    if (_fast(x) and 1 <= M <= max(32, INVARIANT_ROWS) and w.dim() == 2 and w.is_contiguous()
            and w.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and w.device == x.device and (residual is None or residual.dtype == x.dtype)):
        cfg = _gemv_config(M, w.shape[0], w.shape[1], x.is_cuda, x.dtype)
        if cfg is not None and (cfg == "rows" or M <= 32):
            return _gemv_launch(x, w, cfg, residual, then=then)
    if x.is_cuda or (M > CPU_MKL_ROWS and not TOKEN_STEPS):
        y = F.linear(x, w)
    elif _cpu_fast(x) and w.dim() == 2 and (_dnn_ok(w) or w.shape[0] % 16 == 0):
        y = _linear_cpu(x, w)
    else:
        rows = x.reshape(-1, x.shape[-1])
        y = torch.stack([F.linear(r, w) for r in rows]).view(*x.shape[:-1], w.shape[0])
    return apply_then(y if residual is None else residual + y, then)


def _transposed(w):
    """w^T [in, out] contiguous, made once per weight (_derived)."""
    return _derived(w, "t", lambda w: w.t().contiguous())


_ROWS_ALONE = {}  # (how, out, in, rows, threads[, dtype]) -> does one call of so many rows give each row
                  # its bits alone?


def _dnn_ok(w):
    """Can w's products take oneDNN's GEMM here? fp32 weights (what was measured), a torch built with it."""
    return w.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _packed(w, dtype=None):
    """w packed for oneDNN's linear (its blocked layout, made once per weight: _derived); dtype: of a copy of
    w in that dtype (a drafter's, _linear_draft_cpu)."""
    if dtype is None or dtype == w.dtype:
        return _derived(w, "dnn", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None))
    return _derived(w, f"dnn_{dtype}", lambda w: torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None))


def _dnn(x, wp):
    return torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], "")


def _bmm(rows, w):
    """rows [M, in] @ w^T, every row its own (1, in) @ (in, out) product: one bmm of x [M, 1, in] and w^T
    expanded to [M, in, out], each batch entry its own product. -> [M, out]."""
    M, (N, Kin) = rows.shape[0], w.shape
    return torch.bmm(rows[:, None], _transposed(w).expand(M, Kin, N)).view(M, N)


def _bmm_rows(rows, w):
    """_bmm of rows [M, in], each row with the bits of its own 1-row call (_rows_call)."""
    fn = lambda x: _bmm(x, w)  # noqa: E731
    return _rows_call(rows, fn, lambda M: _rows_alone("bmm", w, M, fn, w.dtype))


def _rows_call(rows, fn, alone):
    """fn (a GEMM) of rows [M, in], each row with the bits of its own 1-row call: one M-row call where alone(M)
    (the check at first use, _rows_alone: per weight shape, M and thread count) finds that it gives them, else
    one call per row. The CPU's three GEMMs (_bmm_rows, _dnn_rows_call, _fp16_rows_call) go through it."""
    M = rows.shape[0]
    if M == 1 or alone(M):
        return fn(rows)
    return torch.cat([fn(r) for r in rows.split(1)])


def _rows_alone(how, w, M, fn, dtype):
    """Does fn's call of M rows [M, in] (of dtype) give every row the bits of that row's own 1-row call, for w's
    shape, on the running CPU and thread count? Checked at first use (M random rows, each against its call
    alone; the GEMM's arithmetic does not depend on the values) and remembered under `how` (the GEMM's name)."""
    key = (how, *w.shape, M, torch.get_num_threads()) + (() if dtype == w.dtype else (dtype,))
    if key not in _ROWS_ALONE:
        x = torch.randn(M, w.shape[1], generator=torch.Generator().manual_seed(M)).to(dtype)
        y = fn(x)
        _ROWS_ALONE[key] = all(torch.equal(fn(x[i:i + 1]), y[i:i + 1]) for i in range(M))
    return _ROWS_ALONE[key]


def _dnn_rows(w, M, dtype=None):
    """Does oneDNN's call of M rows give every row the bits of that row's own 1-row call (_rows_alone; dtype:
    for w's copy in that dtype)?"""
    wp = _packed(w, dtype)
    return _rows_alone("dnn", w, M, lambda x: _dnn(x, wp), dtype or w.dtype)


# fp32 CPU steps of M < CPU_PAD_ROWS rows, for M in CPU_PADDED, call oneDNN with CPU_PAD_ROWS rows, zero rows added
# (_dnn_rows_call): on some CPUs oneDNN streams weights from memory faster for a few rows than for one or two.
# calibrate_cpu_rows picks the M by timing the model's own steps; empty: no padding.
CPU_PAD_ROWS = 4
CPU_PADDED = frozenset()
_ZERO_ROWS = {}  # (n, in, dtype) -> n zero rows [n, in] (read only): what a padded call adds


def _zero_rows(n, k, dtype):
    if (n, k, dtype) not in _ZERO_ROWS:
        _ZERO_ROWS[n, k, dtype] = torch.zeros(n, k, dtype=dtype)
    return _ZERO_ROWS[n, k, dtype]


_DNN_CALLS = [0]  # _dnn_rows_call's calls (calibrate_cpu_rows: does a model's step call oneDNN at all?)


def _dnn_rows_call(rows, w, dtype=None):
    """oneDNN's GEMM of rows [M, in] (in dtype, default w's) with w's packed copy in that dtype, each row with the
    bits of its own 1-row call: one call where _dnn_rows finds that it gives them, else one call per row. An fp32
    step of M rows, M in CPU_PADDED, is called with CPU_PAD_ROWS rows (zeros after its own) where _dnn_rows finds
    such a call giving each row its 1-row bits: the same bits, faster where calibrate_cpu_rows measured it so."""
    _DNN_CALLS[0] += 1
    wp = _packed(w, dtype)
    M = rows.shape[0]
    if M in CPU_PADDED and rows.dtype == torch.float32 and _dnn_rows(w, CPU_PAD_ROWS, dtype):
        return _dnn(torch.cat([rows, _zero_rows(CPU_PAD_ROWS - M, rows.shape[1], rows.dtype)]), wp)[:M]
    return _rows_call(rows, lambda x: _dnn(x, wp), lambda M: _dnn_rows(w, M, dtype))


# fp32 CPU linears through FBGEMM's fp16-weight GEMM (torch.ops.quantized.linear_dynamic_fp16), for a weight w
# whose every element times a power of two 2^s is an fp16 (a bf16 checkpoint's weights, as the toy's, all are at
# the s _fp16_weight picks): that GEMM widens each fp16 weight to fp32 in registers and multiplies and sums in
# fp32, so its products are x * (w * 2^s) exactly, its sums fp32 sums, and 2^-s times its result (exact where
# the result is not subnormal) is an fp32 x @ w^T in FBGEMM's summation order, read from half the bytes oneDNN's fp32 GEMM streams. The toy's 63
# checkpoint weights cycling from memory (one thread, this CI class's 2-core EPYC, session 45), 1 / 4 / 16 rows:
# 1.26 / 1.89 / 4.33 ms a pass against oneDNN fp32's 2.97 / 3.22 / 5.14. False: oneDNN's fp32 GEMM for all.
CPU_FP16 = True
_FP16_GEMM = []  # [can this torch pack an fp16 weight for FBGEMM?], found at first use


def _fp16_gemm_here():
    if not _FP16_GEMM:
        try:
            wp = torch.ops.quantized.linear_prepack_fp16(torch.ones(16, 16), None)
            _FP16_GEMM.append(torch.equal(torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 16), wp),
                                          torch.full((1, 16), 16.0)))
        except (RuntimeError, AttributeError, NotImplementedError):  # no FBGEMM (an ARM build: QNNPACK only)
            _FP16_GEMM.append(False)
    return _FP16_GEMM[0]


def _fp16_weight(w):
    """(w * 2^s packed for FBGEMM's fp16 GEMM, 2^-s as a 0-d tensor) for an fp32 weight, s the largest power with
    max |w| * 2^s < 2^16 (fp16's largest is 65504; a bf16 value below 2^16 is at most 65280), where every element
    of w * 2^s is an fp16 exactly and 2^s and 2^-s are normal fp32 numbers; else None (an fp32 checkpoint's
    weights, too wide a range, no FBGEMM here, or a quantized engine that has none). Made once per weight
    (_derived)."""
    def make(w):
        m = w.abs().max().item() if w.numel() else 0.0
        if not (CPU_FP16 and 0 < m < math.inf and _fp16_gemm_here()):
            return None
        s = 16 - math.frexp(m)[1]                   # m = f * 2^e, f in [0.5, 1): m * 2^s = f * 2^16
        if abs(s) > 126:                            # (a weight below ~1e-34: 2^s would overflow fp32)
            return None
        ws = w * 2.0 ** s                           # exact (a power of two, both within fp32's normal range)
        if not torch.equal(ws.half().float(), ws):
            return None
        try:
            packed = torch.ops.quantized.linear_prepack_fp16(ws, None)
        except RuntimeError:                        # torch.backends.quantized.engine set to one without it
            return None
        return packed, torch.tensor(2.0 ** -s)      # (a 0-d tensor: mul_ by a Python float wraps it, 3 us against 1)
    return _derived(w, "fp16", make) if CPU_FP16 and w.dtype == torch.float32 else None


def _fp16(x, wp):
    return torch.ops.quantized.linear_dynamic_fp16(x, wp)


def _fp16_rows_call(rows, w, packed):
    """rows [M, in] @ w^T through FBGEMM's fp16 GEMM on packed = _fp16_weight(w), each row with the bits of its
    own call padded to P rows (P = _fp16_base_rows: 1 where FBGEMM rounds a row alike in calls of any size, so
    no padding), whatever the step's size: one call of C >= M rows (zero rows after the step's, C from
    _fp16_call_rows) where a check found such a call giving each row those bits, else one padded call per row.

    Why pad: on an AVX2 EPYC (no AVX-512; session 50) FBGEMM rounds a row one way in 1-row calls, another in
    2-row calls and a third in calls of 3 or more, except some rows of calls of 7, 14, 31, 32, 37 or 38 rows
    (of 1 .. 40; those go up to 8, 15, 33 or 39). There every step of M >= 2 rows went row by row: the
    toy's 53 linears, cycling from memory, 1 / 4 / 8 rows 6.6 / 23.4 / 42 ms a pass (1-row calls), where one
    call of 3 / 4 / 9 rows takes 6.6 / 6.9 / 11.4 (P = 3; 1 row alone 5.5). On the AVX-512 Zen 5 of session 45
    FBGEMM rounds every size alike: P = 1, C = M."""
    wp, scale = packed
    fn = lambda x: _fp16(x, wp)  # noqa: E731
    rows = rows.contiguous()
    M, Kin = rows.shape
    P = _fp16_base_rows(w, fn)
    C = _fp16_call_rows(w, fn, M, P)
    if C == M:
        y = fn(rows)
    elif C:
        y = fn(torch.cat([rows, _zero_rows(C - M, Kin, rows.dtype)]))[:M]
    else:
        y = _fp16_padded_bits(fn, rows, P)
    return y.mul_(scale)


FP16_BASE_ROWS = 4  # the most rows _fp16_base_rows pads a row to (its bits then define the row's)
_FP16_ROWS = {}     # (out, in, threads) -> P; (out, in, threads, M) -> C (0: row by row): _fp16_rows_call's calls


def _fp16_padded_bits(fn, x, P):
    """Each row of x [M, in] through fn in its own call padded to P rows: [M, out] (a row's defined bits)."""
    zeros = _zero_rows(P - 1, x.shape[1], x.dtype)
    return torch.cat([fn(torch.cat([r, zeros]))[:1] for r in x.split(1)])


def _fp16_base_rows(w, fn):
    """P: the fewest rows (1 .. FP16_BASE_ROWS) to which a row is padded in its own fp16 call such that a call of
    16 rows gives each of them those bits (the bits most verify and batch rows then get), 1 where none does (a
    row's bits then those of its 1-row call, as before session 50: a step takes one call where _fp16_call_rows
    finds one giving them, else runs row by row). Checked at first use per weight shape and thread count, on
    random rows (the GEMM's arithmetic does not depend on the values)."""
    key = (*w.shape, torch.get_num_threads())
    if key not in _FP16_ROWS:
        x = torch.randn(16, w.shape[1], generator=torch.Generator().manual_seed(16))
        y = fn(x)
        _FP16_ROWS[key] = next((P for P in range(1, FP16_BASE_ROWS + 1)
                                if torch.equal(_fp16_padded_bits(fn, x, P), y)), 1)
    return _FP16_ROWS[key]


def _fp16_call_rows(w, fn, M, P):
    """C: the fewest rows, from max(M, P) up to 8 more, of a call that gives each of its rows the bits of its own
    call padded to P rows (a step of M rows is called with C - M zero rows after its own), or 0 where none of
    these does (one padded call per row). Checked at first use per weight shape, thread count and M."""
    key = (*w.shape, torch.get_num_threads(), M)
    if key not in _FP16_ROWS:
        _FP16_ROWS[key] = 0
        for C in range(max(M, P), max(M, P) + 9):
            x = torch.randn(C, w.shape[1], generator=torch.Generator().manual_seed(C))
            if torch.equal(fn(x), _fp16_padded_bits(fn, x, P)):
                _FP16_ROWS[key] = C
                break
    return _FP16_ROWS[key]


_CALIBRATED = {}  # a model's calibration key -> the CPU_PADDED calibrate_cpu_rows chose for it
CALIBRATE_STEP_S = 0.05  # a model whose 1-token step takes longer is not timed (nor padded): 26 steps would be long


def calibrate_cpu_rows(step, key, rounds=3):
    """Sets CPU_PADDED for a model: for M = 1 .. CPU_PAD_ROWS - 1, step(M) (one forward of M rows through the
    model) timed with M padded and not, the two alternating, `rounds` times each after one call of each; M is
    padded where that is at least 2 % faster (medians). Only the speed differs (see _dnn_rows_call). Done once per
    key (the model's weight shapes) in a process. On this CI class's 2-core EPYC in session 43 (the toy's 42 MB
    of packed fp32 weights streamed from memory at 14-16 GB/s, one after another: 1 / 2 / 3 / 4 rows 2.77 /
    3.08 / 2.67 / 2.55 ms a pass) it chose {2}, {1, 2} or {2, 3} (a 1-row step gains 1-3 %, near the margin; MTP
    k=1's 2-row verify 11-13 %); on session 14's host of the same class (1 / 4 rows 1.57 / 2.04 ms) padding a
    1-row step would have lost. Nothing is timed for a model whose steps call oneDNN nowhere (a bf16 checkpoint's
    weights take the fp16-weight GEMM, _fp16_weight): padding could not change its speed."""
    global CPU_PADDED
    if key not in _CALIBRATED:
        CPU_PADDED = frozenset()
        step(1)                                 # (a first step packs the weights)
        calls = _DNN_CALLS[0]
        t = time.perf_counter()
        step(1)
        small = time.perf_counter() - t <= CALIBRATE_STEP_S
        _CALIBRATED[key] = _padded_faster(step, rounds) if small and _DNN_CALLS[0] > calls else frozenset()
    CPU_PADDED = _CALIBRATED[key]
    return CPU_PADDED


def _padded_faster(step, rounds):
    """calibrate_cpu_rows's timing: the M in 1 .. CPU_PAD_ROWS - 1 whose step(M) ran at least 2 % faster padded
    (medians of `rounds` alternating calls each, after one call of each: oneDNN's primitives and _dnn_rows's
    checks for the padded shapes), each M timed with the ones chosen before it padded."""
    global CPU_PADDED
    chosen = set()
    for M in range(1, CPU_PAD_ROWS):
        times = {False: [], True: []}
        for r in range(rounds + 1):
            for pad in ((False, True) if r % 2 == 0 else (True, False)):
                CPU_PADDED = frozenset(chosen | ({M} if pad else set()))
                t = time.perf_counter()
                step(M)
                times[pad].append(time.perf_counter() - t)
        if statistics.median(times[True][1:]) < 0.98 * statistics.median(times[False][1:]):
            chosen.add(M)
    return frozenset(chosen)


def _linear_cpu(x, w):
    """x @ w^T for a CPU step (a decode or verify step, token_steps(), or up to CPU_MKL_ROWS rows), a row's bits
    the same whatever the step's other rows and size. F.linear's own GEMM (MKL) does not give that: on this CI
    class's CPU (AMD EPYC Zen 5, MKL 2024.2) it rounds M = 1, 2-3 and >= 4 rows differently, hence the
    reference's loop over rows.

    What runs, fp32: a weight whose values times some 2^s are all fp16s (a bf16 checkpoint's) through FBGEMM's
    fp16-weight GEMM (_fp16_weight, _fp16_rows_call: half the bytes, the same fp32 arithmetic; the toy's plain
    decoding 137 -> ~195 tok/s on this CI class, session 45), one M-row call where a check at first use finds
    that it gives each row its 1-row bits (every M of 2..33 at every toy shape, one and two threads, on the
    AVX-512 EPYC), or where FBGEMM rounds by the call's size (the AVX2 EPYC of session 50) the bits of its call
    padded to 3 rows, one call of M or a few more rows.
    Other fp32 weights: oneDNN's GEMM on the weight packed once (_packed), and a row's bits are by definition
    those of its own 1-row call. A step of M rows takes one M-row call where a check at first use (_dnn_rows,
    per weight shape, M and thread count) found that call giving each row exactly those bits on the running
    CPU, else one 1-row call per row. On this CPU every M of 1..64 passes at every toy shape, and the M-row
    call reads the weights once: all 33 toy weights cycling from memory (1 thread), 1 / 4 / 8 / 16 rows: 1.57
    / 2.04 / 2.47 / 3.18 ms, where 1-row products (the bmm below) take 1.99 / 3.65 / 5.47 / 9.27 (MKL's own
    GEMM, not invariant, 4 rows of lm_head 8256 x 256: 336 us, oneDNN 116). Without oneDNN (or another
    dtype): every row its own (1, in) @ (in, out) product, all rows in one bmm(x [M, 1, in], w^T expanded to
    [M, in, out]), each batch entry its own product, where a check at first use finds that each row gets its
    1-row bits (_bmm_rows; on session 18's Xeon it did not at two threads), else one bmm per row; only for out a
    multiple of 16 (on the AVX2 EPYC of session 10, out = 70 or 250 rounded every other row differently; such
    widths take the reference's loop).
    test_cpu_linear_row_invariant pins the four paths, test_cpu_dnn_rows_check the check,
    test_cpu_fp16_weight_gemm the fp16 path's scaling and refusals,
    test_s50_fp16_rows_padded_where_the_gemm_rounds_by_size its padding."""
    rows = x.reshape(-1, x.shape[-1])
    if _CPU_DRAFT and CPU_DRAFT_DTYPE is not None and _dnn_ok(w):
        y = _linear_draft_cpu(rows, w)
    elif (half := _fp16_weight(w)) is not None:
        y = _fp16_rows_call(rows, w, half)
    else:
        y = _dnn_rows_call(rows, w) if _dnn_ok(w) else _bmm_rows(rows, w)
    return y.view(*x.shape[:-1], w.shape[0])


# A drafter's weights of at most this many elements take the fp32 bmm (_linear_draft_cpu)
DRAFT_BMM_SIZE = 1 << 17


def _linear_draft_cpu(rows, w):
    """A drafter's rows [M, in] @ w^T inside cpu_draft(), each row's bits those of its own 1-row call (as
    _linear_cpu: a draft does not depend on its batch). A small weight (out x in <= DRAFT_BMM_SIZE: the toy
    draft model's qkv, o_proj and down, 256 wide (its gate | up, 1024 x 256, is larger), and MTP's 256 x 256
    and fc) in fp32 through _bmm: a oneDNN call costs ~20 us on this CPU whatever its size, the bmm 5-16 us at
    1..5 rows there (us a call, hot, against oneDNN in bf16, measured on the earlier 128-wide toy draft:
    388 x 128 at 1 / 5 rows 5 / 16 against 28 / 39, 768 x 128 8 / 25 against 30 / 27, 256 x 256 6 / 17
    against 23 / 25; at 8 rows 27-37 against 25-35), as _bmm_rows (one bmm of M rows where that gives each row
    the bits of its own 1-row call, else one per row). The others: FBGEMM's fp16-weight GEMM in fp32 as the
    target's (_fp16_weight: a bf16 checkpoint's weights; the MTP head's lm_head is the target's, packed once for
    both; against the bf16 oneDNN below, the toy's block drafters 2 % faster, session 45); else oneDNN on w's
    CPU_DRAFT_DTYPE copy (packed once), the rows rounded to that dtype, the result back in w's dtype; one M-row
    call where _rows_alone / _dnn_rows find it giving each row its bits alone. Which runs depends on w (and the
    caller's cpu_draft(bmm)) alone, not on M."""
    if _DRAFT_BMM and w.numel() <= DRAFT_BMM_SIZE:
        return _bmm_rows(rows, w)
    if (half := _fp16_weight(w)) is not None:
        return _fp16_rows_call(rows, w, half)
    return _dnn_rows_call(rows.to(CPU_DRAFT_DTYPE), w, CPU_DRAFT_DTYPE).to(w.dtype)


# _linear_small takes at most SMALL_ROWS rows (its programs take them one after another: on the H200 2.9 us
# per linear at 1 row, 11.4 at 8, against 5.6 and 6.9 for the row-invariant kernel), of a weight of at most
# SMALL_K inputs and 2^24 elements (draft_model's LM; not its lm_head)
SMALL_ROWS = 2
SMALL_K = 4096


DRAFT_SUM_NORM = True  # a plain Qwen3 draft's RMSNorms, where not in _linear_small's loads, done by the split-K
                       # sum of the linear before them (False: linear's norm, a launch of its own before the GEMV)


def norm_in_loads(x):
    """Do a drafter's linears over x's rows take the RMSNorm before them in their loads (linear's norm: inside
    drafting(), at most SMALL_ROWS rows on the GPU: _linear_small), rather than from the linear before them (its
    `then`: the split-K sum's launch does it, one launch fewer a norm)? (Qwen3LM.forward)"""
    return not DRAFT_SUM_NORM or (DRAFTING and _fast(x) and x.numel() // x.shape[-1] <= SMALL_ROWS)


def _small_linear(M, w, x, residual):
    """Does x [M rows] @ w^T take _linear_small (inside drafting())?"""
    N, K = w.shape
    return (1 <= M <= SMALL_ROWS and w.dim() == 2 and w.is_contiguous() and w.dtype == x.dtype
            and x.shape[-1] == K
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and K <= SMALL_K
            and N * K <= 1 << 24 and (residual is None or residual.dtype == x.dtype))


@_jit_any_M
def _linear_small_kernel(p_x, p_w, p_y, p_r, p_n, M, N, K, s_x, eps, BN: tl.constexpr, BK: tl.constexpr,
                         RES: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr, PDL: tl.constexpr):
    # program (block of BN outputs): its weight rows [BN, K] whole (BK >= K), loaded before the wait for the
    # kernel before it (weights are never written inside a step), then each of the M rows on its own: the same
    # products and the same sum for a row whatever M is (M is not specialised), so rows do not depend on each
    # other; residual added in fp32 before the one rounding. NORM: x's row goes through Qwen3's RMSNorm (weight
    # p_n) first, with _rms_norm_kernel's roundings (PLAIN). SWIGLU: w is [gate | up] (2N rows), the program
    # also holds the up rows of its BN outputs, and writes silu(gate) * up, each half rounded to the
    # activation dtype first (the GEMM's output), then _silu_mul_kernel's arithmetic
    i_n = tl.program_id(0)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_n, m_k = o_n < N, o_k < K
    dt = p_y.dtype.element_ty
    if PDL:
        gdc_launch_dependents()
    p_wb = p_w + o_n[:, None].to(tl.int64) * K + o_k[None, :]
    b_w = tl.load(p_wb, mask=m_n[:, None] & m_k[None, :], other=0.0)
    if SWIGLU:
        b_wu = tl.load(p_wb + N * K, mask=m_n[:, None] & m_k[None, :], other=0.0)
    if NORM:
        b_n = tl.load(p_n + o_k, mask=m_k, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    for m in range(M):
        b_x = tl.load(p_x + m * s_x + o_k, mask=m_k, other=0.0).to(tl.float32)
        if NORM:
            b_rstd = tl.rsqrt(tl.sum(b_x * b_x, 0) / K + eps)
            b_x = _norm_scale(b_x, b_rstd, b_n, dt, True).to(dt).to(tl.float32)
        b_y = tl.sum(b_w.to(tl.float32) * b_x[None, :], 1)                               # [BN]
        if SWIGLU:
            b_u = tl.sum(b_wu.to(tl.float32) * b_x[None, :], 1).to(dt).to(tl.float32)
            b_y = b_y.to(dt).to(tl.float32)
            b_y = b_y / (1.0 + tl.exp(-b_y)) * b_u
        if RES:
            b_y += tl.load(p_r + m * N + o_n, mask=m_n, other=0.0).to(tl.float32)
        tl.store(p_y + m * N + o_n, b_y.to(p_y.dtype.element_ty), mask=m_n)


def _linear_small(x, w, residual=None, norm=None, swiglu=False):
    """[residual +] norm(x) @ w^T for a small weight w [N, K] and a few rows x [..., K] (a drafter's pass,
    drafting()): one kernel whose programs each hold BN whole weight rows. BN = 8: on the H200 a GEMV of this
    form took 2.8 us per linear of Qwen3-0.6B's chain with PDL, 3.0 with BN = 4 and 3.3 with BN = 16 (one
    activation row; at 8 rows: SMALL_ROWS). norm: as
    linear's, applied to each row as it is loaded; swiglu: linear's then = "swiglu" (w [2I, K] -> [..., I]), on
    the way out."""
    N, K = w.shape
    assert not (swiglu and residual is not None), "_linear_small: SwiGLU's output takes no residual"
    N = N // 2 if swiglu else N
    xr = _rows(x)
    M = xr.shape[0]
    y = _empty((*x.shape[:-1], N), x.dtype, x.device)
    r = y if residual is None else residual.contiguous()
    nw, eps = norm if norm is not None else (w, 0.0)
    BN, BK = 8, _p2(K)
    pdl = _pdl(x)
    _linear_small_kernel[(_cdiv(N, BN),)](xr, w, y, r, nw, M, N, K, xr.stride(0), eps, BN=BN, BK=BK,
                                          RES=residual is not None, NORM=norm is not None, SWIGLU=swiglu,
                                          PDL=pdl, num_warps=8 if (2 if swiglu else 1) * BN * BK > 16384 else 4,
                                          **_launch(pdl))
    return y


# ----------------------------------------------------------------------------------------------
# SwiGLU activation over a fused [gate | up] projection
# ----------------------------------------------------------------------------------------------

def silu_mul_ref(h):
    I = h.shape[-1] // 2
    return exact(F.silu, h[..., :I]) * h[..., I:]


@_jit
def _silu_mul_kernel(p_h, p_y, I, s_h, BI: tl.constexpr, PDL: tl.constexpr):
    # program (row, block of I): y = silu(gate) * up in fp32, rounded once to the activation dtype
    _pdl_sync(PDL)
    i_r, i_c = tl.program_id(0), tl.program_id(1)
    o = i_c * BI + tl.arange(0, BI)
    m = o < I
    g = tl.load(p_h + i_r * s_h + o, mask=m, other=0.0).to(tl.float32)
    u = tl.load(p_h + i_r * s_h + I + o, mask=m, other=0.0).to(tl.float32)
    tl.store(p_y + i_r * I + o, (g / (1.0 + tl.exp(-g)) * u).to(p_y.dtype.element_ty), mask=m)


def silu_mul(h):
    """SwiGLU's silu(gate) * up from one fused projection h [..., 2I] (gate first). Returns [..., I].
    The reference rounds silu(gate) to h's dtype before the multiply (as F.silu(g) * u does); the
    kernel keeps it in fp32, so bf16 results may differ by one rounding."""
    if not _fast(h):
        return silu_mul_ref(h)
    I = h.shape[-1] // 2
    rows = _rows(h)
    y = _empty((*h.shape[:-1], I), h.dtype, h.device)
    BI = min(_p2(I), 1024)
    pdl = _pdl(h)
    _silu_mul_kernel[(rows.shape[0], _cdiv(I, BI))](rows, y, I, rows.stride(0), BI=BI, PDL=pdl, num_warps=4,
                                                    **_launch(pdl))
    return y


def sigmoid_mul_ref(x, gate):
    return x * exact(torch.sigmoid, gate)


@_jit
def _sigmoid_mul_kernel(p_x, p_g, p_y, D, s_x, s_g, BD: tl.constexpr):
    # program (row, block of D): y = x * sigmoid(gate), the sigmoid rounded to x's dtype as the reference's is
    i_r, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o = i_c * BD + tl.arange(0, BD)
    m = o < D
    g = tl.load(p_g + i_r * s_g + o, mask=m, other=0.0).to(tl.float32)
    sg = (1.0 / (1.0 + tl.exp(-g))).to(p_y.dtype.element_ty).to(tl.float32)
    x = tl.load(p_x + i_r * s_x + o, mask=m, other=0.0).to(tl.float32)
    tl.store(p_y + i_r * D + o, (x * sg).to(p_y.dtype.element_ty), mask=m)


def sigmoid_mul(x, gate):
    """The gated attention's output gate: x * sigmoid(gate), x and gate [..., D] of one dtype (gate may be a
    strided view, e.g. the gate half of q_proj's per-head [query | gate] output). One launch where torch takes
    three (the gate's copy, the sigmoid, the product). Returns a contiguous [..., D]."""
    if not _fast(x):
        return sigmoid_mul_ref(x, gate)
    assert x.shape == gate.shape and x.dtype == gate.dtype, "x and gate must match"
    xr, gr = _rows(x), _rows(gate)
    y = _empty(x.shape, x.dtype, x.device)
    D = x.shape[-1]
    BD = min(_p2(D), 1024)
    _sigmoid_mul_kernel[(xr.shape[0], _cdiv(D, BD))](xr, gr, y, D, xr.stride(0), gr.stride(0), BD=BD,
                                                     num_warps=4)
    return y


# ----------------------------------------------------------------------------------------------
# Causal depthwise conv over the GDN mixed_qkv channels, with its rolling window state
# ----------------------------------------------------------------------------------------------

def causal_conv_ref(x, conv_pool, slots, weight, n_keep=None):
    B, T, C = x.shape
    K = weight.shape[1]
    past = conv_pool[slots]                                     # [B, C, K-1]
    seq = torch.cat([past, x.transpose(1, 2).to(past.dtype)], dim=2)  # [B, C, K-1+T]
    w = weight.to(seq.dtype)
    # the taps summed in order, y_t = sum_j w_j u_{t-K+1+j}: the same arithmetic for every token whatever T is
    y = seq[:, :, 0:T] * w[:, 0, None]
    for j in range(1, K):
        y = y + seq[:, :, j:j + T] * w[:, j, None]              # [B, C, T]
    y = exact(F.silu, y).transpose(1, 2).to(x.dtype)
    conv_window_ref(x, conv_pool, slots, n_keep)
    return y


def conv_window_ref(x, conv_pool, slots, n_keep=None):
    """The window after the first n_keep[b] tokens of x [B, T, C] (all T if None): the last K-1 entries of
    seq = [window, x] up to there (unchanged where n_keep[b] == 0)."""
    B, T, C = x.shape
    W = conv_pool.shape[2]
    seq = torch.cat([conv_pool[slots], x.transpose(1, 2).to(conv_pool.dtype)], dim=2)  # [B, C, K-1+T]
    if n_keep is None:
        conv_pool[slots] = seq[:, :, T:]
    else:
        idx = n_keep.view(B, 1, 1) + torch.arange(W, device=x.device).view(1, 1, W)
        conv_pool[slots] = seq.gather(2, idx.expand(B, C, W))


@_jit
def _causal_conv_kernel(p_x, p_pool, p_slots, p_w, p_keep, p_y, T, C,
                        s_xb, s_xt, s_ps, s_pc, s_pk, s_wc, s_wk,
                        K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr,
                        HAS_KEEP: tl.constexpr):
    # program (b, channel block, token block): y[t] = silu(sum_j w[j] * seq[t + j]), where seq is the
    # slot's K-1 past inputs followed by x. Only token block 0 reads the past window (BT >= K-1 or a
    # single block), so it alone may overwrite it afterwards.
    i_b, i_c, i_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_c = i_c * BC + tl.arange(0, BC)
    o_t = i_t * BT + tl.arange(0, BT)
    m_c, m_t = o_c < C, o_t < T
    slot = tl.load(p_slots + i_b)
    p_past = p_pool + slot * s_ps + o_c * s_pc                                      # [BC] window rows
    p_xb = p_x + i_b * s_xb
    b_acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        b_w = tl.load(p_w + o_c * s_wc + j * s_wk, mask=m_c, other=0.0).to(tl.float32)
        src = o_t + j - (K - 1)                                                 # input index; < 0: the window
        m_x = ((src >= 0) & m_t)[:, None] & m_c[None, :]
        m_p = ((src < 0) & m_t)[:, None] & m_c[None, :]
        b_in = tl.load(p_xb + src[:, None] * s_xt + o_c[None, :], mask=m_x, other=0.0).to(tl.float32)
        b_in += tl.load(p_past[None, :] + (src + K - 1)[:, None] * s_pk, mask=m_p, other=0.0).to(tl.float32)
        b_acc += b_in * b_w[None, :]
    b_y = b_acc * tl.sigmoid(b_acc)
    p_y_t = p_y + (i_b * T + o_t.to(tl.int64))[:, None] * C + o_c[None, :]
    tl.store(p_y_t, b_y.to(p_y.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])
    if i_t == 0:
        n = T
        if HAS_KEEP:
            n = tl.load(p_keep + i_b).to(tl.int32)
        if n > 0:
            _conv_window(p_xb, p_past, o_c, m_c, n, s_xt, s_pk, K - 1, BW)


@_jit
def _conv_window(p_xb, p_past, o_c, m_c, n, s_xt, s_pk, KW: tl.constexpr, BW: tl.constexpr):
    # channels o_c of one sequence: the window [KW] becomes seq[n .. n+KW-1] of seq = [old window, x] (x at
    # p_xb, token stride s_xt); p_past [BC] points at each channel's window (stride s_pk). Used by the conv
    # kernel and by the GDN commit.
    o_w = tl.arange(0, BW)
    w_src = n + o_w - KW
    m_w = m_c[:, None] & (o_w < KW)[None, :]
    b_new = tl.load(p_xb + w_src[None, :] * s_xt + o_c[:, None], mask=m_w & (w_src >= 0)[None, :],
                    other=0.0).to(tl.float32)
    b_new += tl.load(p_past[:, None] + (w_src + KW)[None, :] * s_pk, mask=m_w & (w_src < 0)[None, :],
                     other=0.0).to(tl.float32)
    tl.debug_barrier()  # every thread has read the old window before any writes the new one
    tl.store(p_past[:, None] + o_w[None, :] * s_pk, b_new.to(p_past.dtype.element_ty), mask=m_w)


def _causal_conv_launch(x, conv_pool, slots, weight, n_keep):
    B, T, C = x.shape
    K = weight.shape[1]
    assert conv_pool.shape[1:] == (C, K - 1) and weight.shape == (C, K), "conv_pool / weight shapes"
    assert slots.dtype == torch.long and (n_keep is None or n_keep.dtype == torch.long)
    if x.stride(2) != 1:
        x = x.contiguous()
    y = _empty((B, T, C), x.dtype, x.device)
    BT = min(_p2(T), 16)
    assert BT >= K - 1 or BT >= T  # only token block 0 may read the old window (see the kernel)
    BC = 128
    grid = (B, _cdiv(C, BC), _cdiv(T, BT))
    _causal_conv_kernel[grid](
        x, conv_pool, slots, weight, n_keep if n_keep is not None else slots, y, T, C,
        x.stride(0), x.stride(1), conv_pool.stride(0), conv_pool.stride(1), conv_pool.stride(2),
        weight.stride(0), weight.stride(1),
        K=K, BT=BT, BC=BC, BW=_p2(K - 1), HAS_KEEP=n_keep is not None, num_warps=4)
    return y


def causal_conv(x, conv_pool, slots, weight, n_keep=None):
    """silu(depthwise causal conv) over x, continuing from each slot's window of past inputs.

    x [B, T, C] pre-conv inputs; conv_pool [S, C, K-1] past inputs (oldest first); slots [B] long;
    weight [C, K] (tap K-1 multiplies the current token); n_keep [B] long or None.
    Returns y [B, T, C]. The window of slot b becomes the last K-1 inputs after its first n_keep[b]
    tokens (all T when n_keep is None; unchanged when n_keep[b] == 0) - that is how a verify step
    leaves the window untouched (the commit after it moves the window with the GDN state:
    gdn_recurrent_gated's conv argument). The kernel accumulates in fp32 and rounds once
    (the reference rounds the conv and the silu).
    """
    if _fast(x):
        return _causal_conv_launch(x, conv_pool, slots, weight, n_keep)
    if _cpu_fast(x):
        return _causal_conv_cpu(x, conv_pool, slots, weight, n_keep)
    return causal_conv_ref(x, conv_pool, slots, weight, n_keep)


# ----------------------------------------------------------------------------------------------
# Gated DeltaNet: recurrent (decode / verify / commit) and chunked (prefill)
# ----------------------------------------------------------------------------------------------

def _gdn_prep(q, k, v, g, beta):
    """l2-normalise q, k (fp32, eps inside the sqrt), scale q by d_k^-0.5 and repeat the key heads
    over their group of value heads. Returns fp32 tensors [B, H_v, T, d]."""
    Hk, Hv = q.shape[2], v.shape[2]
    q, k = (t.float().contiguous() for t in (q, k))  # (strided views: torch would sum d in an order set by T)
    q = q * exact(torch.rsqrt, (q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * exact(torch.rsqrt, (k * k).sum(-1, keepdim=True) + 1e-6)
    if Hv != Hk:  # value head j reads key head j // (H_v / H_k)
        q, k = (t.repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    return q, k, v, g.float().transpose(1, 2), beta.float().transpose(1, 2)


def gdn_recurrent_ref(q, k, v, g, beta, state_pool, slots, n_keep=None):
    B, T = q.shape[:2]
    dtype = v.dtype
    q, k, v, g, beta = _gdn_prep(q, k, v, g, beta)
    S = state_pool[slots].float()                               # [B, H_v, d_k, d_v]
    keep = S.clone() if n_keep is not None else None
    out = torch.empty_like(v)                                   # [B, H_v, T, d_v]
    for t in range(T):  # (per-token slices made contiguous: the same arithmetic whatever T is)
        q_t, k_t, v_t = q[:, :, t].contiguous(), k[:, :, t].contiguous(), v[:, :, t].contiguous()
        S = S * exact(torch.exp, g[:, :, t])[..., None, None]
        kv = torch.einsum("bhkv,bhk->bhv", S, k_t)
        delta = beta[:, :, t, None] * (v_t - kv)
        S = S + k_t[..., None] * delta[:, :, None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", S, q_t)
        if n_keep is not None:
            keep = torch.where((n_keep == t + 1).view(B, 1, 1, 1), S, keep)
    state_pool[slots] = (S if n_keep is None else keep).to(state_pool.dtype)
    return out.transpose(1, 2).to(dtype)


def gdn_chunked_ref(q, k, v, g, beta, state_pool, slots, chunk=64):
    B, T = q.shape[:2]
    dtype = v.dtype
    q, k, v, g, beta = _gdn_prep(q, k, v, g, beta)              # [B, H, T, d]
    S = state_pool[slots].float()
    out = torch.empty_like(v)
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        qc, kc, vc, bc = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], beta[:, :, s:e]
        G = g[:, :, s:e].cumsum(-1)                             # [B, H, c]
        c = e - s
        lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        diff = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        kk = kc @ kc.transpose(-1, -2)                          # [B, H, c, c]
        A = (bc[..., None] * diff * kk).masked_fill(
            lower.logical_not() | torch.eye(c, dtype=torch.bool, device=q.device), 0)
        rhs = bc[..., None] * (vc - G.exp()[..., None] * (kc @ S))
        U = torch.linalg.solve_triangular(A + torch.eye(c, device=q.device), rhs, upper=False,
                                          unitriangular=True)
        out[:, :, s:e] = G.exp()[..., None] * (qc @ S) + (diff * (qc @ kc.transpose(-1, -2))) @ U
        S = G[..., -1, None, None].exp() * S + (kc * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2) @ U
    state_pool[slots] = S.to(state_pool.dtype)
    return out.transpose(1, 2).to(dtype)


@_jit_any_T
def _gdn_recurrent_kernel(p_q, p_k, p_v, p_g, p_beta, p_alog, p_dtb, p_state, p_slots, p_keep, p_o, T, scale,
                          s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_bb, s_bt,
                          HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, HAS_KEEP: tl.constexpr, GATES: tl.constexpr,
                          OUT: tl.constexpr, p_cx, p_cp, C, s_cxb, s_cxt, s_cps, s_cpc, s_cpk,
                          CONV: tl.constexpr, KW: tl.constexpr, BCW: tl.constexpr, BW: tl.constexpr):
    # program (b * H_v + h, d_v block): the [d_k, BV] slice of one head's fp32 state stays in
    # registers over all T tokens; it is read once and written at most once (after token n_keep).
    # With GATES, p_g / p_beta hold the raw projections a, b and the gates are computed here.
    # Without OUT (a commit: state only) the loop stops after token n_keep and writes no outputs.
    i_bh, i_v = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HV, i_bh % HV
    i_hk = i_h // GROUP                                                              # the shared key head
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < DK, o_v < DV
    m_s = m_k[:, None] & m_v[None, :]
    slot = tl.load(p_slots + i_b)
    n_keep = T
    if HAS_KEEP:
        n_keep = tl.load(p_keep + i_b).to(tl.int32)
    # a commit that also moves the causal conv's window (KW = K-1 past inputs): this program's channels
    if CONV:
        o_c = (i_h * tl.num_programs(1) + i_v) * BCW + tl.arange(0, BCW)
        if n_keep > 0:
            _conv_window(p_cx + i_b * s_cxb, p_cp + slot * s_cps + o_c * s_cpc, o_c, o_c < C, n_keep, s_cxt,
                         s_cpk, KW, BW)
    if GATES:
        b_decay = -tl.exp(tl.load(p_alog + i_h).to(tl.float32))
        b_dtb = tl.load(p_dtb + i_h).to(tl.float32)
    p_s = p_state + slot * (HV * DK * DV) + i_h * (DK * DV) + o_k[:, None] * DV + o_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0)                                          # [BK, BV] fp32
    p_q = p_q + i_b * s_qb + i_hk * s_qh + o_k
    p_k = p_k + i_b * s_kb + i_hk * s_kh + o_k
    p_v = p_v + i_b * s_vb + i_h * s_vh + o_v
    p_g = p_g + i_b * s_gb + i_h
    p_beta = p_beta + i_b * s_bb + i_h
    p_o = p_o + (i_b * T * HV + i_h) * DV + o_v
    # token t's inputs are loaded during step t-1, so the loop never waits on global memory
    n_q = tl.load(p_q, mask=m_k, other=0.0)
    n_k = tl.load(p_k, mask=m_k, other=0.0)
    n_v = tl.load(p_v, mask=m_v, other=0.0)
    n_g = tl.load(p_g)
    n_beta = tl.load(p_beta)
    n_steps = T
    if not OUT:
        n_steps = n_keep
    for t in range(n_steps):
        b_q, b_k, b_v = n_q.to(tl.float32), n_k.to(tl.float32), n_v.to(tl.float32)
        b_g, b_beta = n_g.to(tl.float32), n_beta.to(tl.float32)
        t_n = tl.minimum(t + 1, T - 1)                                            # (the last re-reads itself)
        n_q = tl.load(p_q + t_n * s_qt, mask=m_k, other=0.0)
        n_k = tl.load(p_k + t_n * s_kt, mask=m_k, other=0.0)
        n_v = tl.load(p_v + t_n * s_vt, mask=m_v, other=0.0)
        n_g = tl.load(p_g + t_n * s_gt)
        n_beta = tl.load(p_beta + t_n * s_bt)
        # g = -exp(A_log) softplus(a + dt_bias) (torch's threshold 20); beta = sigmoid(b) in b's dtype
        if GATES:
            b_x = b_g + b_dtb
            b_sp = tl.where(b_x < -15.0, tl.exp(b_x),
                            tl.log(1.0 + tl.exp(tl.minimum(b_x, 20.0))))  # ~log1p(e^x)
            b_g = b_decay * tl.where(b_x > 20.0, b_x, b_sp)
            b_beta = tl.sigmoid(b_beta).to(p_beta.dtype.element_ty).to(tl.float32)
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6) * scale
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        b_s = b_s * tl.exp(b_g)                                                      # decay before the read
        b_d = b_beta * (b_v - tl.sum(b_s * b_k[:, None], 0))                         # [BV] delta
        b_s = b_s + b_k[:, None] * b_d[None, :]
        if OUT:
            b_o = tl.sum(b_s * b_q[:, None], 0)                                      # [BV]
            tl.store(p_o + t * (HV * DV), b_o.to(p_o.dtype.element_ty), mask=m_v)
        if t + 1 == n_keep:
            tl.store(p_s, b_s, mask=m_s)


# BATCH_INVARIANT: the recurrence's (value block, warps) at every B and T. Measured on the H200 (session 36,
# tools/tile_sweep.py gdn, us per 27B layer, (16, 1) -> (32, 2)): B = 1 T = 1 3.95 -> 4.78, T = 2 4.56 -> 5.65,
# T = 16 13.0 -> 17.5; B = 8 T = 1 19.6 -> 16.1, T = 2 19.6 -> 17.6. A whole FP8 27B step (profile_step.py --ab
# GDN_TILE): B = 1 +0.01 ms (T = 16 +0.14), B = 8 -0.11 ms: batch 8 reads 8 states, and wider tiles move them
# at 3.1 TB/s against 2.6.
GDN_TILE = (32, 2)


def _gdn_recurrent_launch(q, k, v, g, beta, state_pool, slots, n_keep, A_log=None, dt_bias=None, outputs=True,
                          conv=None):
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    assert k.shape == q.shape and v.shape[:2] == (B, T) and g.shape == beta.shape == (B, T, Hv)
    assert Hv % Hk == 0, "value heads must be a multiple of key heads"
    assert (state_pool.dtype == torch.float32 and state_pool.is_contiguous()
            and state_pool.shape[1:] == (Hv, Dk, Dv))
    assert slots.dtype == torch.long and (n_keep is None or n_keep.dtype == torch.long)
    assert T >= 1
    q, k, v, g, beta = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, g, beta))
    assert outputs or n_keep is not None, "a state-only pass needs n_keep"
    o = _empty((B, T, Hv, Dv), v.dtype, v.device) if outputs else v                # (no outputs: not written)
    BK = _p2(Dk)
    if BATCH_INVARIANT:  # one tile at every B and T: the tile and warps set how d_k is summed (GDN_TILE)
        BV, warps = min(_p2(Dv), GDN_TILE[0]), GDN_TILE[1]
    else:
        # value blocks, measured on the H200 (27B: H_v 48, d 128; us per layer, BV 8 / 1 warp before): B = 1: 16
        # / 1 warp (T = 1: 4.4 -> 3.8, T = 2: 5.5 -> 4.6, T = 16: 18.1 -> 13.1); more programs than ~1536
        # (B = 8): 32 / 2 warps (T = 1: 22.9 -> 16.5, T = 2: 23.6 -> 17.7), the state then moves at ~3 TB/s
        BV = min(_p2(Dv), 32 if B * Hv * _cdiv(Dv, 16) > 1536 else 16)
        warps = max(1, BK * BV // 2048)
    gates = A_log is not None
    assert not gates or (A_log.is_contiguous() and dt_bias.is_contiguous()
                         and A_log.shape == dt_bias.shape == (Hv,))
    extra = dict(p_cx=q, p_cp=state_pool, C=0, s_cxb=0, s_cxt=0, s_cps=0, s_cpc=0, s_cpk=0, CONV=False,
                 KW=1, BCW=1, BW=1)                                                 # (no conv window)
    if conv is not None:  # the commit's conv window, spread over the programs: BCW channels each
        cx, cp = conv
        cx = cx if cx.stride(2) == 1 else cx.contiguous()
        C, KW = cp.shape[1], cp.shape[2]
        assert not outputs and n_keep is not None and cx.shape == (B, T, C)
        extra = dict(p_cx=cx, p_cp=cp, C=C, s_cxb=cx.stride(0), s_cxt=cx.stride(1), s_cps=cp.stride(0),
                     s_cpc=cp.stride(1), s_cpk=cp.stride(2), CONV=True, KW=KW,
                     BCW=_p2(_cdiv(C, Hv * _cdiv(Dv, BV))), BW=_p2(KW))
    _gdn_recurrent_kernel[(B * Hv, _cdiv(Dv, BV))](
        q, k, v, g, beta, A_log if gates else g, dt_bias if gates else g, state_pool, slots,
        n_keep if n_keep is not None else slots, o, T, Dk ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        HV=Hv, GROUP=Hv // Hk, DK=Dk, DV=Dv, BK=BK, BV=BV, HAS_KEEP=n_keep is not None, GATES=gates,
        OUT=outputs, num_warps=warps, **extra)
    return o if outputs else None


def gdn_recurrent(q, k, v, g, beta, state_pool, slots, n_keep=None):
    """The gated delta rule, one token at a time (decode, verify, and the commit after a verify).

    q, k [B, T, H_k, d_k]; v [B, T, H_v, d_v]; g (log decay, <= 0), beta [B, T, H_v];
    state_pool [S, H_v, d_k, d_v] fp32; slots [B]. Per token and value head:
        S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
    Returns o [B, T, H_v, d_v] in v's dtype. Slot b's state becomes the state after its first
    n_keep[b] tokens (after all T if n_keep is None; unchanged where n_keep[b] == 0).
    q, k, v may be strided views (e.g. slices of the conv output) as long as their last stride is 1.
    """
    if _fast(q):
        return _gdn_recurrent_launch(q, k, v, g, beta, state_pool, slots, n_keep)
    return gdn_recurrent_ref(q, k, v, g, beta, state_pool, slots, n_keep)


def gdn_chunked(q, k, v, g, beta, state_pool, slots, chunk=64):
    """The gated delta rule over a long sequence, in chunks (prefill). Same arguments and result as
    gdn_recurrent with n_keep=None; it agrees with it up to fp32 rounding.

    Within a chunk, with G = cumsum(g), the state update unrolls to
        U = (I + A)^-1 [beta * (V - exp(G) K S0)],  A[t, j] = beta_t exp(G_t - G_j) k_t.k_j  (j < t)
        O = exp(G) Q S0 + (exp(G_t - G_j) q_t.k_j)_{j<=t} U
        S = exp(G_last) S0 + (K * exp(G_last - G))^T U
    so each chunk costs a few matrix products and one triangular solve instead of C token steps.
    The fast path is still the fused recurrent kernel (one launch, T sequential steps per program).
    """
    if _fast(q):
        return _gdn_recurrent_launch(q, k, v, g, beta, state_pool, slots, None)
    return gdn_chunked_ref(q, k, v, g, beta, state_pool, slots, chunk)


def gdn_gates(a, b, A_log, dt_bias):
    """The GDN gates from their raw projections, as Qwen3.5 computes them:
    g = -exp(A_log) * softplus(a_f32 + dt_bias) (fp32), beta = sigmoid(b) (b's dtype).
    a, b [B, T, H_v]; A_log, dt_bias [H_v]. Returns (g, beta)."""
    return -exact(torch.exp, A_log.float()) * exact(F.softplus, a.float() + dt_bias), exact(torch.sigmoid, b)


def _gdn_recurrent_cpu(q, k, v, a, b, A_log, dt_bias, state_pool, slots, n_keep, outputs):
    """The CPU fast path of gdn_recurrent_gated: the reference's arithmetic in fewer ops. The gates in one
    float64 pass rounded once (exp, softplus, sigmoid: CPU SIMD rounds a float32 element differently in a
    vector lane and in the scalar tail, so float32 transcendentals would depend on how many tokens share the
    step - kernels.exact); the state updated in place; the row products S^T k and S^T q as bmm calls, each
    (1, d_k) @ (d_k, d_v) product its own batch entry (as the reference's einsum), so a row's bits do not
    depend on B or T; a verify (n_keep all 0) writes no state but keeps its state after each token on the
    pool (64 KiB per layer and token on the toy model), and the commit after it copies from there instead of
    replaying (the replay the GPU kernel does costs a second pass of T tokens); any other commit stops after
    max(n_keep) tokens."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    G = Hv // Hk                                                 # value heads per key head
    keep = None if n_keep is None else n_keep.tolist()
    steps = T if keep is None or outputs else max(keep)
    if steps == 0:
        return None
    snap = getattr(state_pool, "_specdec_verify", None)
    if not outputs and snap is not None and snap[0] is q and torch.equal(snap[1], slots):
        # the commit after this layer's verify: its states after each token were kept (the same arithmetic
        # the replay would do, so the same bits); a copy instead of a second pass over the tokens
        for i, (s, n) in enumerate(zip(slots.tolist(), keep)):
            if n:
                state_pool[s] = snap[2][n - 1, i]
        state_pool._specdec_verify = None
        return None
    verify = outputs and keep is not None and not any(keep)
    neg_A = _derived(A_log, "-exp", lambda w: -torch.exp(w.double()))                # [H_v] float64
    dt_b = _derived(dt_bias, "f64", lambda w: w.double())
    decay = torch.exp(neg_A * F.softplus(a.double() + dt_b)).float()            # [B, T, H_v]
    beta = torch.sigmoid(b.double()).float()
    # [B, T, 2 H_k, d_k], normalised together; contiguous, so that each row's sum of squares takes one order
    # whatever layout q and k come in (the CPU conv's output has T innermost: a verify row differed by ~5e-9)
    qk = torch.cat([q, k], 2).float().contiguous()
    qk = qk * torch.rsqrt((qk * qk).sum(-1, keepdim=True).double() + 1e-6).float()
    qf, kf = qk[:, :, :Hk] * Dk ** -0.5, qk[:, :, Hk:]
    # token-major, each key head repeated over its value heads once here, and every (batch row, head) one
    # entry of 3-d bmm calls, rather than broadcast by matmul per token (which expands and copies it again);
    # a verify's state after token t is written straight into its snapshot (no copy). Per token three ops:
    # S *= decay; delta = v - S^T k and S += (beta k) delta^T as baddbmm (a product and its sum in one call;
    # beta goes on k for all tokens at once); then o = S^T q (a verify: for all tokens at once, from the
    # snapshots). q and k are l2-normalised together. On the toy, us a call (B = 1, one process, the code
    # before alternating with this): T = 1 76 -> 70, T = 4 128 -> 109, T = 8 189 -> 158. Token t's slices
    # are contiguous [R, ., .] blocks
    R = B * Hv                                                   # bmm entries: (row, value head)
    per_token = lambda t, d: (t.transpose(0, 1).reshape(T, B, Hk, -1, 1, d).expand(T, B, Hk, G, 1, d)
                              .reshape(T, R, 1, d))
    per_value = lambda t, d: t.transpose(0, 1).reshape(T, R, 1, d)  # a value head's own (no repeat)
    qf, kf, vf = per_token(qf, Dk), per_token(kf, Dk), per_value(v.float(), Dv)  # [T, R, 1, d]
    decay = per_value(decay, 1)                                  # [T, R, 1, 1]
    kbeta = (kf * per_value(beta, 1)).transpose(-1, -2)          # [T, R, d_k, 1]: beta k, a column
    in_place = state_pool.dtype == torch.float32 and (keep is None or verify)  # (a commit stops rows early)
    s0 = _slot_run(slots, state_pool) if in_place else None
    if s0 is None:
        S = state_pool.index_select(0, slots).float().view(R, Dk, Dv)  # a copy: the pool is written back below
    else:  # the pool's own rows: a decode updates them in place, a verify only reads them (into snaps[0])
        S = state_pool[s0:s0 + B].view(R, Dk, Dv)
    out = torch.empty(T, R, 1, Dv) if outputs else None
    snaps = torch.empty(T, R, Dk, Dv) if verify else None        # a verify's state after each token
    for t in range(steps):
        S = torch.mul(S, decay[t], out=snaps[t]) if verify else S.mul_(decay[t])
        delta = torch.baddbmm(vf[t], kf[t], S, alpha=-1)                 # [R, 1, d_v]: v - S^T k
        S.baddbmm_(kbeta[t], delta)                                      # S + (beta k) delta^T
        if outputs and not verify:
            torch.bmm(qf[t], S, out=out[t])                              # S^T q
        if keep is not None:
            done = [i for i, n in enumerate(keep) if n == t + 1]
            if done:
                state_pool[slots[done]] = S.view(B, Hv, Dk, Dv)[done]
    if verify:  # every token's S^T q from its snapshot, one bmm of T R entries (each entry its own product)
        torch.bmm(qf.reshape(T * R, 1, Dk), snaps.view(T * R, Dk, Dv), out=out.view(T * R, 1, Dv))
    if keep is None and s0 is None:
        state_pool[slots] = S.view(B, Hv, Dk, Dv)
    state_pool._specdec_verify = (q, slots.clone(), snaps.view(T, B, Hv, Dk, Dv)) if verify else None
    return out.view(T, B, Hv, Dv).transpose(0, 1).reshape(B, T, Hv, Dv).to(v.dtype) if outputs else None


def _causal_conv_cpu(x, conv_pool, slots, weight, n_keep):
    """The CPU fast path of causal_conv: the reference's taps, summed in the same order, and the window
    moved from the same [window, x] sequence (a verify, n_keep all 0, leaves it)."""
    B, T, C = x.shape
    K = weight.shape[1]
    s0 = _slot_run(slots, conv_pool)                            # the rows as a view of the pool (no gather)
    past = conv_pool[slots] if s0 is None else conv_pool[s0:s0 + B]
    seq = torch.cat([past, x.transpose(1, 2).to(conv_pool.dtype)], dim=2)  # [B, C, K-1+T]
    w = weight.to(seq.dtype).t()[:, :, None].unbind(0)          # K taps [C, 1] (three ops rather than 2 K)
    u = seq.unfold(2, T, 1).unbind(2)                           # K views seq[:, :, j:j + T] (two ops, not K)
    y = u[0] * w[0]
    for j in range(1, K):
        y += u[j] * w[j]                                        # [B, C, T]
    keep = None if n_keep is None else n_keep.tolist()
    if keep is None and s0 is not None:
        conv_pool[s0:s0 + B] = seq[:, :, T:]                    # a slice's copy_ (no scatter)
    elif keep is None:
        conv_pool[slots] = seq[:, :, T:]
    elif any(keep):
        conv_window_ref(x, conv_pool, slots, n_keep)
    # a verify (n_keep all 0) keeps its [window, x] for the commit after it (_conv_commit_cpu)
    conv_pool._specdec_verify = (x, slots.clone(), seq) if keep is not None and not any(keep) else None
    return F.silu(y.transpose(1, 2).double()).to(x.dtype)


def _conv_commit_cpu(x, conv_pool, slots, n_keep):
    """conv_window_ref for the commit after a verify on the CPU: each row's window becomes seq[n .. n+K-2] of
    the [window, x] sequence the verify's _causal_conv_cpu kept (the same values: one copy per row instead of
    rebuilding and gathering the sequence). With the state copies by slot number in _gdn_recurrent_cpu: the
    toy's 6 GDN layers' commit, MTP k=1, 235 -> 149 us a step."""
    kept = getattr(conv_pool, "_specdec_verify", None)
    conv_pool._specdec_verify = None
    if kept is None or kept[0] is not x or not torch.equal(kept[1], slots):
        return conv_window_ref(x, conv_pool, slots, n_keep)
    W = conv_pool.shape[2]
    for i, (s, n) in enumerate(zip(slots.tolist(), n_keep.tolist())):
        if n:
            conv_pool[s] = kept[2][i, :, n:n + W]


def gdn_recurrent_gated(q, k, v, a, b, A_log, dt_bias, state_pool, slots, n_keep=None, outputs=True,
                        conv=None):
    """gdn_recurrent(q, k, v, *gdn_gates(a, b, A_log, dt_bias), state_pool, slots, n_keep) in one launch:
    the gates are computed inside the recurrent kernel (saves ~8 tiny launches per GDN layer and step).
    a, b [B, T, H_v] raw projections in_proj_a(x), in_proj_b(x); A_log, dt_bias [H_v].
    outputs=False (the commit after a verify: n_keep given): only the states advance, over n_keep[b] tokens
    instead of T, and no outputs are written; returns None. With conv = (x [B, T, C] the conv's inputs,
    conv_pool [S, C, K-1]) that commit also moves the causal conv's window (conv_window_ref: the window
    causal_conv(x, conv_pool, slots, w, n_keep) leaves) in the same launch: one launch per GDN layer per
    commit."""
    if _fast(q):
        return _gdn_recurrent_launch(q, k, v, a, b, state_pool, slots, n_keep, A_log, dt_bias, outputs, conv)
    if conv is not None:
        assert not outputs, "conv: the commit's window only"
        (_conv_commit_cpu if _cpu_fast(q) else conv_window_ref)(*conv, slots, n_keep)
    if _cpu_fast(q):
        return _gdn_recurrent_cpu(q, k, v, a, b, A_log, dt_bias, state_pool, slots, n_keep, outputs)
    o = gdn_recurrent_ref(q, k, v, *gdn_gates(a, b, A_log, dt_bias), state_pool, slots, n_keep)
    return o if outputs else None


# ----------------------------------------------------------------------------------------------
# Attention inputs: q/k RMSNorm + partial RoPE + KV-cache write, fused (optional entry point)
# ----------------------------------------------------------------------------------------------

def rope_ref(x, pos, T, inv_freq):
    """Partial NeoX RoPE on the first rotary_dim channels of each head. x [B, T, h, d]; pos [B]."""
    rd = inv_freq.numel() * 2
    p = (pos[:, None] + torch.arange(T, device=x.device)[None]).float()          # [B, T]
    freqs = p[..., None] * inv_freq                                              # [B, T, rd/2]
    c, s = exact(torch.cos, freqs), exact(torch.sin, freqs)
    cos = torch.cat([c, c], -1).to(x.dtype)[:, :, None]                         # [B, T, 1, rd]
    sin = torch.cat([s, s], -1).to(x.dtype)[:, :, None]
    xr, xp = x[..., :rd], x[..., rd:]
    rot = torch.cat([-xr[..., rd // 2:], xr[..., :rd // 2]], -1)
    return torch.cat([xr * cos + rot * sin, xp], -1)


def attention_prep_ref(qg, k, v, q_norm_w, k_norm_w, eps, inv_freq, k_cache, v_cache, slots, pos,
                       plain=False):
    B, T, _, hd = k.shape
    norm = plain_rms_norm_ref if plain else rms_norm_ref
    q = rope_ref(norm(qg[..., :hd], q_norm_w, eps), pos, T, inv_freq)
    k = rope_ref(norm(k, k_norm_w, eps), pos, T, inv_freq)
    at = pos[:, None] + torch.arange(T, device=k.device)[None]                   # [B, T] positions
    k_cache[slots[:, None], at] = k.to(k_cache.dtype)
    v_cache[slots[:, None], at] = v.to(v_cache.dtype)
    return q


def _rope_table(inv_freq, n, dtype):
    """cos and sin [n, rotary_dim] (each half repeated, as rope_ref builds them) for positions 0 .. n-1, in
    dtype: rope_ref's own values (fp32 position * inv_freq, float64 cos / sin rounded), made once per
    inv_freq and dtype and regrown (to twice the size) when a position passes its end."""
    key = "_specdec_rope_" + str(dtype)
    table = getattr(inv_freq, key, None)
    if table is None or table[0].shape[0] < n:
        p = torch.arange(max(n, 2 * (0 if table is None else table[0].shape[0]), 256)).float()
        freqs = p[:, None] * inv_freq                                               # [L, rd/2]
        c, s = exact(torch.cos, freqs), exact(torch.sin, freqs)
        table = (torch.cat([c, c], -1).to(dtype), torch.cat([s, s], -1).to(dtype))   # [L, rd] each
        setattr(inv_freq, key, table)
    return table


def _attention_prep_cpu(qg, k, v, q_norm_w, k_norm_w, eps, inv_freq, k_cache, v_cache, slots, pos, plain):
    """The CPU fast path of attention_prep: the reference's arithmetic in fewer ops. First: cos / sin
    looked up in a table of the reference's own values (_rope_table) instead of recomputed in float64 each
    call, q's and k's heads rotated together (116 -> 60 us a call on the toy at T = 1..8). Then (session
    14): q's and k's heads normed together (fp32: one LayerNorm over [x, -x] as _rms_norm_cpu, then each
    head's weight), and a lone row (B = 1) takes its cos / sin and writes the cache as slices (no index /
    index_put_: ~12 us a call on the toy, a slice's copy ~4): one process, alternating, medians of 9 on a
    loaded machine, B = 1 T = 1 82 -> 58 us, T = 4 89 -> 68, B = 4 85 -> 79. Element by element the same
    operations as rope_ref, and each head normed alone, so a token's bits do not depend on T or B."""
    B, T, nh, _ = qg.shape
    nkv, hd = k.shape[2], k.shape[3]
    rd = 2 * inv_freq.numel()
    if qg.dtype == k.dtype == q_norm_w.dtype == k_norm_w.dtype == torch.float32:
        qk = torch.cat([qg[..., :hd], k], 2)                                      # [B, T, nh + nkv, hd]
        wq, wk = (w if plain else _derived(w, "1+w", lambda w: 1.0 + w) for w in (q_norm_w, k_norm_w))
        w = torch.cat([wq.expand(nh, hd), wk.expand(nkv, hd)])                    # [nh + nkv, hd]
        qk = _rms_normalize_cpu(qk, eps) * w
    else:
        norm = plain_rms_norm_ref if plain else (lambda x, w, eps: _rms_norm_cpu(x.contiguous(), w, eps))
        qk = torch.cat([norm(qg[..., :hd], q_norm_w, eps), norm(k, k_norm_w, eps)], 2)  # [B, T, nh + nkv, hd]
    rows = list(zip(slots.tolist(), pos.tolist()))                               # (slot, first position)
    cos, sin = _rope_table(inv_freq, max(p for _, p in rows) + T, qk.dtype)
    if B == 1:
        p = rows[0][1]
        cos, sin = cos[None, p:p + T, None], sin[None, p:p + T, None]             # [1, T, 1, rd]
    else:
        at = pos[:, None] + torch.arange(T, device=k.device)[None]               # [B, T] positions
        cos, sin = cos[at][:, :, None], sin[at][:, :, None]                      # [B, T, 1, rd]
    xr = qk[..., :rd]
    rot = torch.cat([-xr[..., rd // 2:], xr[..., :rd // 2]], -1)
    qk = torch.cat([xr * cos + rot * sin, qk[..., rd:]], -1)
    if B == 1:
        (s, p), = rows
        k_cache[s, p:p + T] = qk[0, :, nh:]
        v_cache[s, p:p + T] = v[0]
    else:
        k_cache[slots[:, None], at] = qk[:, :, nh:].to(k_cache.dtype)
        v_cache[slots[:, None], at] = v.to(v_cache.dtype)
    return qk[:, :, :nh].contiguous()


@_jit
def _attention_prep_kernel(p_qg, p_k, p_v, p_qw, p_kw, p_freq, p_kc, p_vc, p_slots, p_pos, p_q, T, eps,
                           s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_cs, s_cl, s_ch,
                           s_vs, s_vl, s_vhh, NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
                           BD: tl.constexpr, RD: tl.constexpr, PLAIN: tl.constexpr, PDL: tl.constexpr):
    # program (b * T + t, head): heads [0, NH) are queries -> p_q, [NH, NH+NKV) keys -> k cache,
    # then values -> v cache. q/k rows: zero-centred RMSNorm (PLAIN: Qwen3's w * norm(x).to(dtype)),
    # then RoPE on the first RD channels
    # (out_j = y_j cos - y_{j+RD/2} sin, out_{j+RD/2} = y_{j+RD/2} cos + y_j sin), with the reference's
    # roundings to the activation dtype after the norm, after cos/sin, each product and the sum.
    _pdl_sync(PDL)
    i_bt, i_h = tl.program_id(0), tl.program_id(1)
    i_b, i_t = i_bt // T, i_bt % T
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    slot = tl.load(p_slots + i_b)
    at = tl.load(p_pos + i_b) + i_t                                                  # this token's position
    if i_h >= NH + NKV:  # a value row: a plain copy into the cache
        i_v = i_h - NH - NKV
        b_v = tl.load(p_v + i_b * s_vb + i_t * s_vt + i_v * s_vh + o_d, mask=m_d, other=0.0)
        tl.store(p_vc + slot * s_vs + at * s_vl + i_v * s_vhh + o_d, b_v.to(p_vc.dtype.element_ty), mask=m_d)
    else:
        if i_h < NH:
            p_row = p_qg + i_b * s_qb + i_t * s_qt + i_h * s_qh
            p_w = p_qw
        else:
            p_row = p_k + i_b * s_kb + i_t * s_kt + (i_h - NH) * s_kh
            p_w = p_kw
        o_p = tl.where(o_d < RD // 2, o_d + RD // 2, tl.where(o_d < RD, o_d - RD // 2, o_d))  # RoPE partner
        b_x = tl.load(p_row + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_xp = tl.load(p_row + o_p, mask=m_d, other=0.0).to(tl.float32)
        b_rstd = tl.rsqrt(tl.sum(b_x * b_x, 0) / D + eps)
        dt = p_k.dtype.element_ty
        b_w = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_wp = tl.load(p_w + o_p, mask=m_d, other=0.0).to(tl.float32)
        b_y = _norm_scale(b_x, b_rstd, b_w, dt, PLAIN).to(dt).to(tl.float32)
        b_yp = _norm_scale(b_xp, b_rstd, b_wp, dt, PLAIN).to(dt).to(tl.float32)
        b_f = at.to(tl.float32) * tl.load(p_freq + o_d % (RD // 2), mask=o_d < RD, other=0.0)
        b_cos = tl.cos(b_f).to(dt).to(tl.float32)
        b_sin = tl.sin(b_f).to(dt).to(tl.float32)
        b_rot = tl.where(o_d < RD // 2, -b_yp, b_yp)
        b_r = (b_y * b_cos).to(dt).to(tl.float32) + (b_rot * b_sin).to(dt).to(tl.float32)
        b_out = tl.where(o_d < RD, b_r, b_y)
        if i_h < NH:
            tl.store(p_q + (i_bt * NH + i_h) * D + o_d, b_out.to(p_q.dtype.element_ty), mask=m_d)
        else:
            tl.store(p_kc + slot * s_cs + at * s_cl + (i_h - NH) * s_ch + o_d,
                     b_out.to(p_kc.dtype.element_ty), mask=m_d)


def attention_prep(qg, k, v, q_norm_w, k_norm_w, eps, inv_freq, k_cache, v_cache, slots, pos, plain=False):
    """Everything between the q/k/v projections and attention(), in one launch (the unfused path is
    ~35 small launches per attention layer and step):
        q = rope(rms_norm(qg[..., :hd], q_norm_w)), k = rope(rms_norm(k, k_norm_w)),
        k_cache[slots[b], pos[b] + t] = k[b, t], v_cache[slots[b], pos[b] + t] = v[b, t].
    qg [B, T, nh, >= hd] (q_proj's output per head: query channels first, e.g. [query | gate]);
    k, v [B, T, n_kv, hd]; q_norm_w, k_norm_w [hd] (zero-centred); inv_freq [rotary_dim / 2] fp32;
    k_cache, v_cache [S, L, n_kv, hd]; slots, pos [B] long. Returns q [B, T, nh, hd] (contiguous).
    plain: Qwen3's q/k norms (plain weights, the drafters' layers); nh may be 0 (a cache write only)."""
    if _cpu_fast(qg) and not _fast(qg):
        return _attention_prep_cpu(qg, k, v, q_norm_w, k_norm_w, eps, inv_freq, k_cache, v_cache, slots, pos,
                                   plain)
    if not _fast(qg) or (plain and not q_norm_w.dtype == k_norm_w.dtype == qg.dtype):
        return attention_prep_ref(qg, k, v, q_norm_w, k_norm_w, eps, inv_freq, k_cache, v_cache, slots, pos,
                                  plain)
    B, T, nh, _ = qg.shape
    nkv, hd = k.shape[2:]
    assert v.shape == k.shape and k_cache.shape[2:] == (nkv, hd) and v_cache.shape == k_cache.shape
    assert qg.dtype == k.dtype == v.dtype and inv_freq.dtype == torch.float32 and inv_freq.is_contiguous()
    assert q_norm_w.is_contiguous() and k_norm_w.is_contiguous() and slots.dtype == pos.dtype == torch.long
    qg, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (qg, k, v))
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    q = _empty((B, T, nh, hd), qg.dtype, qg.device)
    pdl = _pdl(qg)
    _attention_prep_kernel[(B * T, nh + 2 * nkv)](
        qg, k, v, q_norm_w, k_norm_w, inv_freq, k_cache, v_cache, slots, pos, q, T, eps,
        qg.stride(0), qg.stride(1), qg.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NH=nh, NKV=nkv, D=hd, BD=_p2(hd), RD=2 * inv_freq.numel(), PLAIN=plain, PDL=pdl,
        num_warps=1 if hd <= 128 else 2, **_launch(pdl))
    return q


# ----------------------------------------------------------------------------------------------
# Attention over the position-indexed KV cache (prefill, decode and verify)
# ----------------------------------------------------------------------------------------------

def _attention_cpu(q, k_cache, v_cache, slots, pos):
    """The CPU fast path of attention for steps of T <= 32 tokens per row: as the reference, each query alone
    over exactly its own p + t + 1 keys (so its bits do not depend on T or B), in five ops instead of
    fifteen: the query heads of a KV head as the rows of one product with that head's keys (no repeated
    K / V copies), no mask (the slice is the visible keys). bmm rather than matmul (the same product without
    matmul's checks and views: ~1.2 us a call on the toy, two calls per query), the second written straight
    into the output, and each row's queries and outputs as one unbind: ~11 -> 6 torch calls a query; on the
    toy (one process, alternating, medians of 9) B = 1 T = 4 88 -> 72 us, T = 8 163 -> 126, B = 4 T = 4
    343 -> 264, the same bits."""
    B, T, nh, d = q.shape
    nkv = k_cache.shape[2]
    out = torch.empty(B, T, nkv, nh // nkv, d)                           # fp32, each query's [n_kv, rep, d]
    qf = q.float().reshape(B, T, nkv, nh // nkv, d) * d ** -0.5     # scaled once (toy, T = 8: 140 -> 120 us)
    for b, (s, p) in enumerate(zip(slots.tolist(), pos.tolist())):
        kb = k_cache[s, :p + T].float().permute(1, 2, 0)                   # [n_kv, d, L] (strides fixed)
        vb = v_cache[s, :p + T].float().transpose(0, 1)                    # [n_kv, L, d]
        for t, (q_t, o_t) in enumerate(zip(qf[b].unbind(0), out[b].unbind(0))):
            L = p + t + 1
            scores = torch.bmm(q_t, kb[..., :L])                           # [n_kv, rep, L]
            torch.bmm(scores.softmax(-1), vb[:, :L], out=o_t)              # written in place (no copy)
    return out.view(B, T, nh, d).to(q.dtype)


def attention_ref(q, k_cache, v_cache, slots, pos, kv_len):
    B, T, nh, d = q.shape
    rep = nh // k_cache.shape[2]
    out = torch.empty_like(q)
    # Each row over exactly its own keys; short steps (decode, verify) one query at a time, so a token's
    # result does not depend on how many tokens the step holds (spec-on logprobs == spec-off's); prefill
    # chunks under a causal mask. (Reads slots/pos on the host: use the kernel inside CUDA graphs.)
    for b in range(B):
        s, p = int(slots[b]), int(pos[b])
        for t0, t1 in ([(t, t + 1) for t in range(T)] if T <= 32 else [(0, T)]):
            L = p + t1
            k, v = (c[s, :L].float().repeat_interleave(rep, dim=1).transpose(0, 1)
                    for c in (k_cache, v_cache))
            scores = (q[b, t0:t1].float().transpose(0, 1) @ k.transpose(-1, -2)) * d ** -0.5  # [nh, t, L]
            visible = (torch.arange(L, device=q.device)[None]
                       <= p + torch.arange(t0, t1, device=q.device)[:, None])
            scores = scores.masked_fill(~visible, float("-inf"))
            out[b, t0:t1] = (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
    return out


@_jit
def _attention_keys(b_q, b_qpos, p_kb, p_vb, s_kl, s_vl, lo, hi, b_m, b_l, b_acc, qk_scale, m_d,
                    BN: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, WINDOW: tl.constexpr):
    # the online softmax of a query tile over keys [lo, hi) in tiles of BN: returns (max, sum, acc). A tile
    # that a row does not see leaves its three values exactly as they were (scores -inf: weight 0, rescale 1)
    for start in range(lo, hi, BN):
        o_n = start + tl.arange(0, BN)
        m_n = o_n < hi
        b_k = tl.load(p_kb + o_n[:, None] * s_kl, mask=m_n[:, None] & m_d[None, :], other=0.0).to(DOT)  # [BN, BD]
        b_sc = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * qk_scale           # [BM, BN], log2 units
        b_vis = m_n[None, :] & (o_n[None, :] <= b_qpos[:, None])
        if WINDOW > 0:
            b_vis = b_vis & (o_n[None, :] > b_qpos[:, None] - WINDOW)
        b_sc = tl.where(b_vis, b_sc, float("-inf"))
        b_mn = tl.maximum(b_m, tl.max(b_sc, 1))
        b_mu = tl.where(b_mn == float("-inf"), 0.0, b_mn)                            # rows with nothing yet
        b_p = tl.exp2(b_sc - b_mu[:, None])
        b_alpha = tl.exp2(b_m - b_mu)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_v = tl.load(p_vb + o_n[:, None] * s_vl, mask=m_n[:, None] & m_d[None, :], other=0.0).to(DOT)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(DOT), b_v, input_precision=PREC)
        b_m = b_mn
    return b_m, b_l, b_acc


@_jit_any_T
def _attention_kernel(p_q, p_k, p_v, p_slots, p_pos, p_o, p_part, p_ml, T, NM, NSPLIT, qk_scale,
                      s_qb, s_qt, s_qh, s_ks, s_kl, s_kh, s_vs, s_vl, s_vh, CHUNK: tl.constexpr,
                      NH: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
                      PREC: tl.constexpr, WINDOW: tl.constexpr, MANY: tl.constexpr, PDL: tl.constexpr):
    # program (b, kv head * NM + query tile, split). A query tile holds BM rows r = t * GROUP + g: the
    # GROUP query heads sharing this KV head, for consecutive new tokens t, so each K/V tile loaded
    # serves them all. Keys run up to the tile's own causal end pos + t_max + 1 (never kv_len); with
    # SPLIT that range is cut into NSPLIT equal pieces (flash-decoding), or, with CHUNK > 0, into pieces of
    # CHUNK keys starting at multiples of CHUNK (the same pieces for a key whatever T and the tile are:
    # batch-invariant), program i_s taking pieces i_s, i_s + NSPLIT, ... below the end, in order, into one
    # softmax state (so the grid does not grow with the cache: a graph's kv_len is the cache length); the
    # partial softmax states (acc, max, sum) go to p_part / p_ml for _attention_combine_kernel (a program with
    # no piece writes none: the combine stops before it). A row's result depends on its own keys and CHUNK,
    # NSPLIT, BN alone (_attention_keys); MANY: kv_len holds more than NSPLIT pieces (else the loop over a
    # program's later pieces is left out: it would run no step). WINDOW > 0 (a drafter's sliding-window layer): a query at position p
    # sees only keys p - WINDOW < key <= p; each piece's loop starts at the tile's first such key.
    _pdl_sync(PDL)
    i_b, i_hm, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_kv, i_m = i_hm // NM, i_hm % NM
    o_r = i_m * BM + tl.arange(0, BM)
    t_r, h_r = o_r // GROUP, i_kv * GROUP + o_r % GROUP
    m_r = o_r < GROUP * T
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    slot = tl.load(p_slots + i_b)
    pos = tl.load(p_pos + i_b)
    p_qr = p_q + i_b * s_qb + t_r[:, None] * s_qt + h_r[:, None] * s_qh + o_d[None, :]
    b_q = tl.load(p_qr, mask=m_r[:, None] & m_d[None, :], other=0.0).to(DOT)  # [BM, BD]
    b_qpos = pos + t_r                                                               # [BM] last visible key
    end = pos + tl.minimum((i_m * BM + BM - 1) // GROUP, T - 1) + 1
    lo = 0
    hi = end
    per = CHUNK
    if SPLIT:
        if CHUNK == 0:
            per = tl.cdiv(tl.cdiv(end, NSPLIT), BN) * BN
        lo = tl.minimum(i_s * per, end)
        hi = tl.minimum(lo + per, end)
    w_lo = 0
    if WINDOW > 0:  # keys before the tile's first query's window are seen by no row of the tile
        w_lo = pos + (i_m * BM) // GROUP - WINDOW + 1
        lo = tl.maximum(lo, tl.minimum(w_lo, hi))
    p_kb = p_k + slot * s_ks + i_kv * s_kh + o_d[None, :]
    p_vb = p_v + slot * s_vs + i_kv * s_vh + o_d[None, :]
    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, BD], dtype=tl.float32)
    b_m, b_l, b_acc = _attention_keys(b_q, b_qpos, p_kb, p_vb, s_kl, s_vl, lo, hi, b_m, b_l, b_acc, qk_scale,
                                      m_d, BN, DOT, PREC, WINDOW)                    # the first piece
    if MANY:  # a cache of more than NSPLIT pieces: this program's later ones
        for piece in range(i_s + NSPLIT, tl.cdiv(end, CHUNK), NSPLIT):
            lo = piece * CHUNK
            hi = tl.minimum(lo + CHUNK, end)
            lo = tl.maximum(lo, tl.minimum(w_lo, hi))
            b_m, b_l, b_acc = _attention_keys(b_q, b_qpos, p_kb, p_vb, s_kl, s_vl, lo, hi, b_m, b_l, b_acc,
                                              qk_scale, m_d, BN, DOT, PREC, WINDOW)
    o_row = (i_b * T + t_r.to(tl.int64)) * NH + h_r                                   # [BM] output row
    m_o = m_r[:, None] & m_d[None, :]
    if SPLIT:
        m_w = m_r
        if CHUNK > 0:  # a program with no piece writes nothing (the combine stops before it)
            m_w = m_r & (o_r * 0 + i_s * CHUNK < end)
        o_part = o_row * NSPLIT + i_s
        tl.store(p_part + o_part[:, None] * D + o_d[None, :], b_acc, mask=m_w[:, None] & m_d[None, :])
        tl.store(p_ml + o_part * 2, b_m, mask=m_w)
        tl.store(p_ml + o_part * 2 + 1, b_l, mask=m_w)
    else:
        b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
        tl.store(p_o + o_row[:, None] * D + o_d[None, :], b_o.to(p_o.dtype.element_ty), mask=m_o)


@_jit
def _attention_combine_kernel(p_part, p_ml, p_o, p_pos, p_g, T, NH, NSPLIT, s_gb, s_gt, s_gh, CHUNK: tl.constexpr,
                              D: tl.constexpr, BD: tl.constexpr, GATE: tl.constexpr, PDL: tl.constexpr):
    # program per output row (b, t, head): merge the partial softmax states one after the other, in order:
    # all NSPLIT, or with CHUNK > 0 those of the programs that held a piece below the row's own end (its
    # position + 1): the others wrote nothing and hold no key of this row (an empty state changes nothing, so
    # the result does not depend on how many trail the last key). The first is the start (the same values
    # as merging it into nothing), read while the row's position loads. GATE: the gated attention's output
    # gate on the way out, o * sigmoid(gate [B, T, NH, D]), the row rounded first and the sigmoid rounded to
    # o's dtype (_sigmoid_mul_kernel's arithmetic): its launch saved
    i_r = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    n = NSPLIT
    if CHUNK > 0:  # the step's positions are no kernel's output in the chain (inputs): read before the wait
        i_bt = i_r // NH
        n = tl.minimum(NSPLIT, tl.cdiv(tl.load(p_pos + i_bt // T) + i_bt % T + 1, CHUNK))
    _pdl_sync(PDL)
    b_m = tl.load(p_ml + i_r * NSPLIT * 2 + tl.arange(0, 1))
    b_l = tl.load(p_ml + i_r * NSPLIT * 2 + 1 + tl.arange(0, 1))
    b_acc = tl.load(p_part + i_r * NSPLIT * D + o_d, mask=o_d < D, other=0.0)
    for s in range(1, n):
        o_p = i_r * NSPLIT + s
        m_s = tl.load(p_ml + o_p * 2 + tl.arange(0, 1))
        l_s = tl.load(p_ml + o_p * 2 + 1 + tl.arange(0, 1))
        a_s = tl.load(p_part + o_p * D + o_d, mask=o_d < D, other=0.0)
        m_n = tl.maximum(b_m, m_s)
        m_u = tl.where(m_n == float("-inf"), 0.0, m_n)                               # nothing seen yet
        c_old, c_new = tl.exp2(b_m - m_u), tl.exp2(m_s - m_u)
        b_acc = b_acc * c_old + a_s * c_new
        b_l = b_l * c_old + l_s * c_new
        b_m = m_n
    dt = p_o.dtype.element_ty
    b_o = (b_acc / b_l).to(dt)
    if GATE:
        i_bt = i_r // NH
        p_gr = p_g + (i_bt // T) * s_gb + (i_bt % T) * s_gt + (i_r % NH) * s_gh
        b_g = tl.load(p_gr + o_d, mask=o_d < D, other=0.0).to(tl.float32)
        b_sg = (1.0 / (1.0 + tl.exp(-b_g))).to(dt).to(tl.float32)
        b_o = (b_o.to(tl.float32) * b_sg).to(dt)
    tl.store(p_o + i_r * D + o_d, b_o, mask=o_d < D)


ATTN_CHUNK = 128  # BATCH_INVARIANT decode / verify (T <= 64): keys split at multiples of this many (512 before
                  # session 17: at short contexts one program per KV head read nearly all keys in one loop; the
                  # 27B FP8 step at context 512, H200, no PDL: attention 414 -> 135 us, the step 9.224 -> 8.958 ms)
DRAFT_ATTN_CHUNK = 64  # the drafters' layers: few KV heads at short contexts, so a 512-key piece is one
                       # program's long serial loop; 128-key pieces spread it (draft_model: 5.5 -> 4.6 ms), 64-key
                       # pieces (one key tile each) more (session 24, H200, 3 interleaved rounds: draft_model's
                       # propose graph 3.35 -> 3.22 ms at batch 1, 5.59 -> 5.18 at batch 8; 32: 3.32 / 5.27)
ATTN_PROGRAMS = 64  # BATCH_INVARIANT: at most this many programs (>= 2) along a row's keys, program i taking
                   # pieces i, i + 64, ...: a graph's kv_len is the cache length (max_model_len), and a grid and
                   # a combine of one piece each made every step pay for the whole cache (131072 positions: 1024
                   # pieces of 128 keys a layer)


def _attention_launch(q, k_cache, v_cache, slots, pos, kv_len, nsplit=None, chunk=None, window=None,
                      gate=None):
    B, T, nh, d = q.shape
    nkv = k_cache.shape[2]
    assert nh % nkv == 0 and k_cache.shape[3] == d and v_cache.shape == k_cache.shape
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and q.dtype == k_cache.dtype
    assert slots.dtype == torch.long and pos.dtype == torch.long
    if q.stride(3) != 1:
        q = q.contiguous()
    G = nh // nkv
    many = False
    if BATCH_INVARIANT and T <= 64 and nsplit is None:  # decode / verify: one tile shape, fixed key pieces
        BM, BN, chunk = 16, 64 if d <= 128 else 32, chunk or ATTN_CHUNK
        nsplit = min(_cdiv(kv_len, chunk), ATTN_PROGRAMS)  # the same for every kv_len past 64 pieces
        many = 1 < nsplit < _cdiv(kv_len, chunk)
    else:
        chunk = 0
        BM = max(16, min(64, _p2(G * T)))
        BN = 64 if d <= 128 or BM <= 32 else 32
    NM = _cdiv(G * T, BM)
    if nsplit is None:  # enough programs to fill the GPU, at least 128 keys a split (kv_len: upper bound)
        nsplit = max(1, min(64, _cdiv(kv_len, 128), _cdiv(2 * _sm_count(q.device), B * nkv * NM)))
    o = _empty((B, T, nh, d), q.dtype, q.device)
    part = ml = o
    if nsplit > 1:
        part = _empty((B * T * nh, nsplit, d), torch.float32, q.device)
        ml = _empty((B * T * nh, nsplit, 2), torch.float32, q.device)
    dot = _dot_dtype(q)
    pdl = _pdl(q)
    _attention_kernel[(B, nkv * NM, nsplit)](
        q, k_cache, v_cache, slots, pos, o, part, ml, T, NM, nsplit, d ** -0.5 * math.log2(math.e),
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), CHUNK=chunk,
        NH=nh, GROUP=G, D=d, BD=_p2(d), BM=BM, BN=BN, SPLIT=nsplit > 1, DOT=dot,
        PREC="ieee" if dot == tl.float32 else "tf32", WINDOW=window or 0, MANY=many, PDL=pdl,
        num_warps=8 if BM * _p2(d) >= 64 * 256 else 4, num_stages=2, **_launch(pdl))
    if nsplit == 1:
        return o if gate is None else sigmoid_mul(o, gate)
    g = o if gate is None else gate
    assert gate is None or (gate.shape == o.shape and gate.dtype == o.dtype and gate.stride(3) == 1)
    _attention_combine_kernel[(B * T * nh,)](part, ml, o, pos, g, T, nh, nsplit, g.stride(0), g.stride(1),
                                             g.stride(2), CHUNK=chunk, D=d, BD=_p2(d), GATE=gate is not None,
                                             PDL=pdl, num_warps=4, **_launch(pdl))
    return o


def attention(q, k_cache, v_cache, slots, pos, kv_len, chunk=None, window=None, gate=None):
    """Causal GQA attention of T new queries per sequence over the slot's cached keys.

    q [B, T, n_h, d]; k_cache, v_cache [S, L, n_kv, d] (the new tokens already written at
    positions pos[b] .. pos[b]+T-1); slots, pos [B] long; kv_len: an int >= max(pos) + T, the cache
    prefix to look at. Query t of sequence b sees keys 0 .. pos[b]+t. Returns [B, T, n_h, d].
    The kernel reads keys only up to each row's own pos[b]+T, so kv_len may be any upper bound (e.g.
    max_model_len inside CUDA graphs); it only sizes the split of long contexts. chunk: the key pieces of
    BATCH_INVARIANT decode / verify steps (ATTN_CHUNK if None); a fixed number, so that a row's sums do not
    depend on T or the batch. window W (a drafter's sliding-window layer; the Triton path only): query t sees
    keys pos[b]+t-W+1 .. pos[b]+t. gate [B, T, n_h, d] (the gated attention's): the output times sigmoid(gate),
    as sigmoid_mul(attention(...), gate) computes it; on the GPU in the launch that combines the key pieces.
    """
    if _fast(q):
        return _attention_launch(q, k_cache, v_cache, slots, pos, kv_len, chunk=chunk, window=window, gate=gate)
    assert window is None, "a sliding window needs the Triton kernel (specdec.block_attention masks elsewhere)"
    if _cpu_fast(q) and q.shape[1] <= 32:
        o = _attention_cpu(q, k_cache, v_cache, slots, pos)
    else:
        o = attention_ref(q, k_cache, v_cache, slots, pos, kv_len)
    return o if gate is None else sigmoid_mul(o, gate)


# ----------------------------------------------------------------------------------------------
# MoE routing and experts
# ----------------------------------------------------------------------------------------------

def moe_route_ref(router_logits, top_k):
    probs = router_logits.float().softmax(-1)
    w, idx = probs.topk(top_k, dim=-1)
    return w / w.sum(-1, keepdim=True), idx


def moe_experts_ref(x, w, idx, gate_up, down):
    out = torch.zeros_like(x)
    I = down.shape[2]
    for e in idx.unique().tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        h = x[tok] @ gate_up[e].t()
        h = F.silu(h[:, :I]) * h[:, I:]
        out.index_add_(0, tok, ((h @ down[e].t()) * w[tok, slot, None].to(x.dtype)).to(x.dtype))
    return out


@_jit
def _route_row(b_x, o_e, E, p_w, p_idx, i_n, TOPK: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    # one token's routing from its logits b_x [BE] (fp32, -inf from E on): fp32 softmax over the experts, top-k
    # by repeated maxima (ties: the lowest expert), renormalised over the chosen k, stored as row i_n of w and
    # idx [N, TOPK]. One key per expert, its probability's fp32 bits (an order-keeping integer for p >= 0) above
    # its index reversed: one integer maximum a step finds the largest p and, of equal ones, the lowest expert
    b_p = tl.exp(b_x - tl.max(b_x, 0))
    b_p = b_p / tl.sum(b_p, 0)
    b_key = (b_p.to(tl.int32, bitcast=True).to(tl.int64) << 16) | (BE - 1 - o_e)
    b_key = tl.where(o_e < E, b_key, -1)
    o_k = tl.arange(0, BK)
    b_w = tl.zeros([BK], dtype=tl.float32)
    b_i = tl.zeros([BK], dtype=tl.int64)
    for j in tl.static_range(TOPK):
        k_top = tl.max(b_key, 0)
        i_top = BE - 1 - (k_top & 0xFFFF)
        b_w = tl.where(o_k == j, (k_top >> 16).to(tl.int32).to(tl.float32, bitcast=True), b_w)
        b_i = tl.where(o_k == j, i_top, b_i)
        b_key = tl.where(o_e == i_top, -1, b_key)
    b_w = b_w / tl.sum(b_w, 0)
    tl.store(p_w + i_n * TOPK + o_k, b_w, mask=o_k < TOPK)
    tl.store(p_idx + i_n * TOPK + o_k, b_i, mask=o_k < TOPK)


def _route_sizes(E, top_k):
    """_route_row's compile-time sizes (TOPK, BE, BK) for top_k of E experts; its keys hold an expert's index in
    their low 16 bits, hence at most 2^16 experts."""
    assert E <= 1 << 16, "a route's keys hold an expert's index in 16 bits"
    return dict(TOPK=top_k, BE=_p2(E), BK=_p2(top_k))


@_jit
def _moe_route_kernel(p_logits, p_w, p_idx, E, s_n, TOPK: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    # program per token: its logits, routed (_route_row)
    i_n = tl.program_id(0).to(tl.int64)
    o_e = tl.arange(0, BE)
    b_x = tl.load(p_logits + i_n * s_n + o_e, mask=o_e < E, other=float("-inf")).to(tl.float32)
    _route_row(b_x, o_e, E, p_w, p_idx, i_n, TOPK, BE, BK)


@_jit
def _gemv_sum_route_kernel(p_part, p_y, p_w, p_idx, p_h, M, N, E, n_sum, I, OFF, SPLIT: tl.constexpr,
                           BS: tl.constexpr, TOPK: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                           SW: tl.constexpr, SBS: tl.constexpr, PDL: tl.constexpr):
    # a MoE router's split-K linear (linear's then = Route): programs below n_sum add the SPLIT partials
    # [SPLIT, M * N] fp32 in order and round once, as _gemv_sum_kernel; program n_sum + m adds row m's first E
    # (its router logits) the same way, rounds them to y's dtype (the bits moe_route would read from y) and
    # routes the token (_route_row): the router's top-k without a launch of its own. With SW (Route's swiglu:
    # the shared expert's [gate | up], 2I columns from OFF), the programs after those write h [M, I] =
    # silu(gate) * up from the partials (_split_swiglu, as _gemv_sum_swiglu_kernel): its SwiGLU without a launch
    _pdl_sync(PDL)
    pid = tl.program_id(0)
    if pid < n_sum:
        o = pid * BS + tl.arange(0, BS)
        m = o < M * N
        tl.store(p_y + o, _split_sum(p_part, o, m, M * N, SPLIT).to(p_y.dtype.element_ty), mask=m)
    elif pid < n_sum + M:
        i_n = (pid - n_sum).to(tl.int64)
        o_e = tl.arange(0, BE)
        m_e = o_e < E
        b_x = _split_sum(p_part, i_n * N + o_e, m_e, M * N, SPLIT)
        b_x = tl.where(m_e, b_x.to(p_y.dtype.element_ty).to(tl.float32), float("-inf"))
        _route_row(b_x, o_e, E, p_w, p_idx, i_n, TOPK, BE, BK)
    elif SW:
        _split_swiglu(p_part, p_h, (pid - n_sum - M) * SBS + tl.arange(0, SBS), M, N, I, OFF, SPLIT)  # over M * I


class Route:
    """linear's `then` for a MoE router whose first n_experts outputs are the router logits: linear returns
    (y, w, idx), w and idx moe_route(y[..., :n_experts], top_k)'s; with swiglu (a column: the shared expert's
    [gate | up] fills y from there to its end) also h = silu_mul(y[..., swiglu:]). Done by the launch that adds
    a split-K GEMV's partials (_gemv_sum_route_kernel), else by moe_route and silu_mul after the linear
    (apply_then)."""
    def __init__(self, top_k, n_experts, swiglu=None):
        self.top_k, self.n_experts, self.swiglu = top_k, n_experts, swiglu


def _sum_route_launch(part, y, M, N, SPLIT, route, pdl):
    """The split-K partials part [SPLIT, M, N] -> (y [M, N], w, idx[, h]): _gemv_sum_route_kernel."""
    E, k, off = route.n_experts, route.top_k, route.swiglu
    assert E <= N, "a route's experts are the first of the linear's columns"
    w = _empty((M, k), torch.float32, y.device)
    idx = _empty((M, k), torch.long, y.device)
    BS = min(1024, _p2(M * N))
    n_sum = _cdiv(M * N, BS)
    I = 0 if off is None else (N - off) // 2
    assert off is None or (0 < off and off + 2 * I == N), "a route's swiglu: [gate | up] to y's last column"
    h = _empty((M, I), y.dtype, y.device) if off is not None else y
    SBS = min(SWIGLU_BS, _p2(max(1, M * I)))
    n_sw = _cdiv(M * I, SBS)
    _gemv_sum_route_kernel[(n_sum + M + n_sw,)](part, y, w, idx, h, M, N, E, n_sum, I, off or 0, SPLIT=SPLIT,
                                                BS=BS, SW=off is not None, SBS=SBS, PDL=pdl, num_warps=4,
                                                **_route_sizes(E, k), **_launch(pdl))
    return (y, w, idx) if off is None else (y, w, idx, h)


def moe_route(router_logits, top_k):
    """fp32 softmax over experts, top-k, renormalised. router_logits [N, E] ->
    (w [N, k] fp32, idx [N, k] long)."""
    if _fast(router_logits):
        N, E = router_logits.shape
        lg = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        w = _empty((N, top_k), torch.float32, lg.device)
        idx = _empty((N, top_k), torch.long, lg.device)
        _moe_route_kernel[(N,)](lg, w, idx, E, lg.stride(0), num_warps=1, **_route_sizes(E, top_k))
        return w, idx
    return moe_route_ref(router_logits, top_k)


# Two ways through the N*k (token, expert) pairs. With many pairs (P > E: prefill, big batches) they are
# first grouped by expert on the device (a counting sort, no host sync: order [P] lists the pairs expert by
# expert, pairs of expert e at order[off[e] : off[e+1]]), and each expert kernel program takes one expert and a
# block of its output features and runs its pairs BT at a time through tl.dot, so an expert's weights are read
# once however many tokens chose it. Decode and verify (P <= E, and every step under BATCH_INVARIANT) take a
# grid over the pairs, no grouping: each program runs one token through one expert, GEMV-style, so an expert
# two tokens chose is read twice, the second time mostly from L2. Measured on the H200 (session 20, 35B-A3B
# bf16 random weights, graph replay of a whole target step, tools/profile_step.py) against the expert's first
# pair (its leader) running all of its pairs one after another: batch 1, T = 1 / 2 / 4 / 16: 2.91 / 3.64 /
# 4.56 / 9.77 ms -> 2.82 / 3.40 / 4.15 / 8.39; batch 8, T = 1 / 2: 6.16 / 9.53 -> 5.43 / 8.03 (a leader's
# serial loop over its pairs was the step's straggler, and the grouping its own launch). (Those steps' tokens
# were all one id, so they all chose the same experts; with random ids, session 21: 2.83 / 3.53 / 4.54 / 9.86
# and 6.41 / 9.73 ms, 8 / 16 / 31 / 101 and 58 / 103 experts a layer.) The pair kernels' tiles, per weight
# dtype (MOE_PAIR_TILES): a pair's bits depend on the sums' widths (gate_up's BH, down's BI) and layouts, so
# one tile serves every step, decode and verify alike.
_MOE_CHUNK = 1024  # tokens per launch (a host loop only for long prefills)
# {FP8 experts?: ((gate_up BI, BH, warps, stages), (down BO, BI, warps, stages))}, measured on the H200 (35B: E 256,
# I 512, H 2048, k 8, random routing; python tools/tile_sweep.py moe-fp8 moe-bf16, session 21), us per layer at
# 1 / 2 / 8 / 16 tokens. bf16: gate_up 16 x 512, 4 warps 11.8 / 19.8 / 63.7 / 113.8 (the best at 1 and 2 tokens;
# 128 x 128, 8 warps: 20.9 / 23.5 / 59.7 / 107.8); down 4 x 128, 1 warp 6.8 / 11.0 / 32.3 / 56.7 (4 x 256, 2
# warps, before: 7.3 / 11.2 / 33.8 / 61.4). FP8: gate_up 32 x 256, 8 warps 10.0 / 12.3 / 39.9 / 73.7 (bf16's
# tile, before: 9.8 / 17.1 / 56.4 / 105.2: e4m3 halves a tile's bytes, so it takes more rows); down 32 x 256, 4
# warps 5.5 / 8.7 / 26.3 / 48.0 (before: 7.9 / 12.6 / 40.2 / 76.9).
MOE_PAIR_TILES = {False: ((16, 512, 4, 3), (4, 128, 1, 3)), True: ((32, 256, 8, 3), (32, 256, 4, 3))}
MOE_SUM_NORM = True  # the next RMSNorm done by _moe_sum_kernel (moe_experts' then; False: its own launch)


@_jit
def _moe_group_kernel(p_idx, p_order, p_off, P, BP: tl.constexpr):
    # program per expert e: its pairs go to order[off[e] + rank], off[e] = #pairs of experts < e
    e = tl.program_id(0)
    o_p = tl.arange(0, BP)
    b_ids = tl.load(p_idx + o_p, mask=o_p < P, other=2147483647)
    b_hit = b_ids == e
    off = tl.sum((b_ids < e).to(tl.int32), 0)
    b_rank = tl.cumsum(b_hit.to(tl.int32), 0) - 1
    tl.store(p_order + off + b_rank, o_p, mask=b_hit)
    tl.store(p_off + e, off)
    tl.store(p_off + e + 1, off + tl.sum(b_hit.to(tl.int32), 0))  # (expert e+1 writes the same value)


@_jit
def _moe_gate_up_kernel(p_x, p_order, p_off, p_gu, p_sc, p_h, H, I, s_x, s_ge, s_gr, s_se, IB, HB,
                        TOPK: tl.constexpr, BT: tl.constexpr, BI: tl.constexpr, BH: tl.constexpr,
                        DOT: tl.constexpr, PREC: tl.constexpr, SCALED: tl.constexpr):
    # program (expert, I block): h[pair, I block] = silu(x W_gate^T) * (x W_up^T) for the expert's pairs,
    # BT at a time. SCALED (FP8 experts; BI, BH divide 128): scales [E, 2 IB, HB], gate's row blocks, then
    # up's.
    i_e, i_i = tl.program_id(0), tl.program_id(1)
    e = i_e.to(tl.int64)
    p_sg = p_sc + e * s_se + (i_i * BI // 128) * HB                                # gate's scale row
    p_su = p_sg + IB * HB                                                           # up's
    start, end = tl.load(p_off + e), tl.load(p_off + e + 1)
    o_i = i_i * BI + tl.arange(0, BI)
    m_i = o_i < I
    p_g = p_gu + e * s_ge + o_i[None, :] * s_gr                                     # [1, BI] gate rows
    p_u = p_gu + e * s_ge + (I + o_i)[None, :] * s_gr                               # [1, BI] up rows
    for r0 in range(start, end, BT):
        o_t = r0 + tl.arange(0, BT)
        m_t = o_t < end
        b_pair = tl.load(p_order + o_t, mask=m_t, other=0).to(tl.int64)             # [BT]
        b_tok = b_pair // TOPK
        b_g = tl.zeros([BT, BI], dtype=tl.float32)
        b_u = tl.zeros([BT, BI], dtype=tl.float32)
        for h0 in range(0, H, BH):
            o_h = h0 + tl.arange(0, BH)
            m_h = o_h < H
            b_x = tl.load(p_x + b_tok[:, None] * s_x + o_h[None, :], mask=m_t[:, None] & m_h[None, :],
                          other=0.0).to(DOT)
            m_w = m_h[:, None] & m_i[None, :]
            b_wg = tl.load(p_g + o_h[:, None], mask=m_w, other=0.0).to(DOT)          # [BH, BI]
            b_wu = tl.load(p_u + o_h[:, None], mask=m_w, other=0.0).to(DOT)
            if SCALED:
                b_g = tl.fma(tl.dot(b_x, b_wg, input_precision=PREC), tl.load(p_sg + h0 // 128), b_g)
                b_u = tl.fma(tl.dot(b_x, b_wu, input_precision=PREC), tl.load(p_su + h0 // 128), b_u)
            else:
                b_g += tl.dot(b_x, b_wg, input_precision=PREC)
                b_u += tl.dot(b_x, b_wu, input_precision=PREC)
        b_h = b_g * tl.sigmoid(b_g) * b_u
        tl.store(p_h + b_pair[:, None] * I + o_i[None, :], b_h.to(p_h.dtype.element_ty),
                 mask=m_t[:, None] & m_i[None, :])


@_jit
def _moe_down_kernel(p_h, p_order, p_off, p_w, p_dn, p_sc, p_y, H, I, s_de, s_dr, s_se, IB,
                     BT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, DOT: tl.constexpr,
                     PREC: tl.constexpr, SCALED: tl.constexpr):
    # program (expert, H block): y[pair, H block] = w_pair * (h[pair] W_down^T) for the expert's pairs,
    # BT at a time. SCALED (FP8 experts; BO, BI divide 128): scales [E, HB, IB].
    i_e, i_o = tl.program_id(0), tl.program_id(1)
    e = i_e.to(tl.int64)
    p_sd = p_sc + e * s_se + (i_o * BO // 128) * IB                                # the H block's scale row
    start, end = tl.load(p_off + e), tl.load(p_off + e + 1)
    o_o = i_o * BO + tl.arange(0, BO)
    m_o = o_o < H
    p_d = p_dn + e * s_de + o_o[None, :] * s_dr                                     # [1, BO] down rows
    for r0 in range(start, end, BT):
        o_t = r0 + tl.arange(0, BT)
        m_t = o_t < end
        b_pair = tl.load(p_order + o_t, mask=m_t, other=0).to(tl.int64)
        b_y = tl.zeros([BT, BO], dtype=tl.float32)
        for i0 in range(0, I, BI):
            o_i = i0 + tl.arange(0, BI)
            m_i = o_i < I
            b_h = tl.load(p_h + b_pair[:, None] * I + o_i[None, :], mask=m_t[:, None] & m_i[None, :],
                          other=0.0)
            b_wd = tl.load(p_d + o_i[:, None], mask=m_i[:, None] & m_o[None, :], other=0.0)  # [BI, BO]
            if SCALED:
                b_p = tl.dot(b_h.to(DOT), b_wd.to(DOT), input_precision=PREC)
                b_y = tl.fma(b_p, tl.load(p_sd + i0 // 128), b_y)
            else:
                b_y += tl.dot(b_h.to(DOT), b_wd.to(DOT), input_precision=PREC)
        b_y *= tl.load(p_w + b_pair, mask=m_t, other=0.0)[:, None]
        tl.store(p_y + b_pair[:, None] * H + o_o[None, :], b_y, mask=m_t[:, None] & m_o[None, :])


@_jit
def _moe_gate_up_pair_kernel(p_x, p_idx, p_gu, p_sc, p_h, H, I, s_x, s_ge, s_gr, s_se, IB, HB,
                             TOPK: tl.constexpr, BI: tl.constexpr, BH: tl.constexpr, SCALED: tl.constexpr):
    # decode and verify: program (pair, I block), one token through one expert like the GEMV at M = 1: products
    # of [BI, BH] gate and up weight tiles with x, summed over BH after the loop. SCALED (FP8; BI divides 128):
    # x times each column's block scale, for gate and for up.
    i_p, i_i = tl.program_id(0), tl.program_id(1)
    pair = i_p.to(tl.int64)
    e = tl.load(p_idx + pair)
    p_sg = p_sc + e * s_se + (i_i * BI // 128) * HB                                # gate's scale row
    p_su = p_sg + IB * HB                                                           # up's
    o_i = i_i * BI + tl.arange(0, BI)
    m_i = o_i < I
    p_g = p_gu + e * s_ge + o_i[:, None].to(tl.int64) * s_gr                        # [BI, 1] gate rows
    p_u = p_gu + e * s_ge + (I + o_i)[:, None].to(tl.int64) * s_gr                  # [BI, 1] up rows
    b_g = tl.zeros([BI, BH], dtype=tl.float32)
    b_u = tl.zeros([BI, BH], dtype=tl.float32)
    for h0 in range(0, H, BH):
        o_h = h0 + tl.arange(0, BH)
        m_h = o_h < H
        b_x = tl.load(p_x + (pair // TOPK) * s_x + o_h, mask=m_h, other=0.0).to(tl.float32)[None, :]
        b_xg, b_xu = b_x, b_x
        if SCALED:
            b_xg = b_x * tl.load(p_sg + o_h // 128, mask=m_h, other=0.0)[None, :]
            b_xu = b_x * tl.load(p_su + o_h // 128, mask=m_h, other=0.0)[None, :]
        m_w = m_i[:, None] & m_h[None, :]
        b_g += tl.load(p_g + o_h[None, :], mask=m_w, other=0.0).to(tl.float32) * b_xg
        b_u += tl.load(p_u + o_h[None, :], mask=m_w, other=0.0).to(tl.float32) * b_xu
    g, u = tl.sum(b_g, 1), tl.sum(b_u, 1)
    tl.store(p_h + pair * I + o_i, (g * tl.sigmoid(g) * u).to(p_h.dtype.element_ty), mask=m_i)


@_jit
def _moe_down_pair_kernel(p_h, p_idx, p_w, p_dn, p_sc, p_y, H, I, s_de, s_dr, s_se, IB,
                          BO: tl.constexpr, BI: tl.constexpr, SCALED: tl.constexpr):
    # decode and verify: program (pair, H block): y[pair, H block] = w_pair * (h[pair] W_down^T), GEMV-style.
    # SCALED (FP8; BO divides 128): h times each column's block scale.
    i_p, i_o = tl.program_id(0), tl.program_id(1)
    pair = i_p.to(tl.int64)
    e = tl.load(p_idx + pair)
    p_sd = p_sc + e * s_se + (i_o * BO // 128) * IB                                # the H block's scale row
    o_o = i_o * BO + tl.arange(0, BO)
    m_o = o_o < H
    p_d = p_dn + e * s_de + o_o[:, None].to(tl.int64) * s_dr                        # [BO, 1] down rows
    b_y = tl.zeros([BO, BI], dtype=tl.float32)
    for i0 in range(0, I, BI):
        o_i = i0 + tl.arange(0, BI)
        m_i = o_i < I
        b_h = tl.load(p_h + pair * I + o_i, mask=m_i, other=0.0).to(tl.float32)[None, :]
        if SCALED:
            b_h = b_h * tl.load(p_sd + o_i // 128, mask=m_i, other=0.0)[None, :]
        b_y += tl.load(p_d + o_i[None, :], mask=m_o[:, None] & m_i[None, :], other=0.0).to(tl.float32) * b_h
    tl.store(p_y + pair * H + o_o, tl.sum(b_y, 1) * tl.load(p_w + pair), mask=m_o)


@_jit
def _moe_sum_kernel(p_y, p_out, p_sh, p_g, p_res, p_nw, p_nrm, H, s_g, eps, TOPK: tl.constexpr, BH: tl.constexpr,
                    SHARED: tl.constexpr, RES: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    # out[n] = sum_j y[n, j] in a fixed order (deterministic, unlike atomics)
    #          [+ sigmoid(g[n]) * shared[n]] [+ residual[n]], all in fp32, rounded once;
    # NORM (one program a row, BH >= H): also nrm[n] = the next zero-centred RMSNorm of out[n], as
    # _rms_norm_kernel computes it from out (at the real widths, one [1, BH] row and its warps there too: the
    # same bits; at narrow widths its programs take 16 rows, whose fp32 sums may round differently)
    _pdl_sync(PDL)
    i_n, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_h = i_h * BH + tl.arange(0, BH)[None, :]                                       # [1, BH]: one row's piece
    m = o_h < H
    b_o = tl.zeros([1, BH], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        b_o += tl.load(p_y + (i_n * TOPK + j) * H + o_h, mask=m, other=0.0)
    if SHARED:
        g = tl.load(p_g + i_n * s_g).to(tl.float32)
        b_o += tl.load(p_sh + i_n * H + o_h, mask=m, other=0.0).to(tl.float32) / (1.0 + tl.exp(-g))
    if RES:
        b_o += tl.load(p_res + i_n * H + o_h, mask=m, other=0.0).to(tl.float32)
    b_o = b_o.to(p_out.dtype.element_ty)
    tl.store(p_out + i_n * H + o_h, b_o, mask=m)
    if NORM:
        b_x = b_o.to(tl.float32)
        b_rstd = tl.rsqrt(tl.sum(b_x * b_x, 1) / H + eps)                           # [1]
        b_w = tl.load(p_nw + o_h, mask=m, other=0.0).to(tl.float32)
        b_y = _norm_scale(b_x, b_rstd[:, None], b_w, p_nrm.dtype.element_ty, False)
        tl.store(p_nrm + i_n * H + o_h, b_y.to(p_nrm.dtype.element_ty), mask=m)


def _moe_experts_launch(x, w, idx, gate_up, down, shared=None, shared_gate=None, residual=None, gu_scale=None,
                        dn_scale=None, norm=None):
    N, H = x.shape
    E, I2, _ = gate_up.shape
    I, k = I2 // 2, idx.shape[1]
    assert gate_up.shape == (E, 2 * I, H) and down.shape == (E, H, I) and w.shape == idx.shape
    assert gate_up.stride(2) == 1 and down.stride(2) == 1 and idx.dtype == torch.long
    scaled = gu_scale is not None
    IB, HB = _cdiv(I, FP8_BLOCK), _cdiv(H, FP8_BLOCK)
    if scaled:  # FP8 experts: gate's block rows then up's (so I need not be a multiple of 128); down's
        assert gate_up.dtype == down.dtype == FP8 and gu_scale.shape == (E, 2 * IB, HB)
        assert dn_scale.shape == (E, HB, IB) and gu_scale.is_contiguous() and dn_scale.is_contiguous()
        assert gu_scale.dtype == dn_scale.dtype == torch.float32
    gs, ds = (gu_scale, dn_scale) if scaled else (gate_up, down)                    # (unused when not)
    gss, dss = (gs.stride(0), ds.stride(0)) if scaled else (0, 0)
    x = x if x.stride(1) == 1 else x.contiguous()
    idx, w = idx.contiguous(), w.float().contiguous()
    out = _empty(x.shape, x.dtype, x.device)
    nrm = out if norm is None else _empty(x.shape, x.dtype, x.device)               # the next RMSNorm's output
    nw, eps = (out, 0.0) if norm is None else norm                                 # (unused without a norm)
    dot = _dot_dtype(x)
    prec = "ieee" if dot == tl.float32 else "tf32"
    pdl = _pdl(x)
    for s in range(0, N, _MOE_CHUNK):
        e_ = min(N, s + _MOE_CHUNK)
        xs, ids, ws, P = x[s:e_], idx[s:e_], w[s:e_], (e_ - s) * k
        h = _empty((P, I), x.dtype, x.device)                               # [P, I]
        y = _empty((P, H), torch.float32, x.device)                         # [P, H]
        # decode and verify: grid over pairs, GEMV-style tiles (measured, 35B: see the note above); with
        # BATCH_INVARIANT every decode / verify step (each pair's products do not depend on the other pairs)
        if P <= E or (BATCH_INVARIANT and e_ - s <= INVARIANT_ROWS):
            (gBI, gBH, g_warps, g_stages), (dBO, dBI, d_warps, d_stages) = MOE_PAIR_TILES[scaled]
            _moe_gate_up_pair_kernel[(P, _cdiv(I, gBI))](
                xs, ids, gate_up, gs, h, H, I, xs.stride(0), gate_up.stride(0), gate_up.stride(1), gss, IB, HB,
                TOPK=k, BI=gBI, BH=min(gBH, _p2(H)), SCALED=scaled, num_warps=g_warps,
                num_stages=g_stages)
            _moe_down_pair_kernel[(P, _cdiv(H, dBO))](
                h, ids, ws, down, ds, y, H, I, down.stride(0), down.stride(1), dss, IB,
                BO=dBO, BI=min(dBI, _p2(I)), SCALED=scaled, num_warps=d_warps,
                num_stages=d_stages)
        else:  # many pairs: grid over experts, each expert's weights read once for all its pairs (tl.dot)
            order = _empty((P,), torch.int32, x.device)                     # pairs, grouped by expert
            off = _empty((E + 1,), torch.int32, x.device)                   # expert e: order[off[e]:off[e+1]]
            BP = _p2(P)
            _moe_group_kernel[(E,)](ids, order, off, P, BP=BP, num_warps=4 if BP <= 2048 else 8)
            _moe_gate_up_kernel[(E, _cdiv(I, 16))](
                xs, order, off, gate_up, gs, h, H, I, xs.stride(0), gate_up.stride(0), gate_up.stride(1), gss,
                IB, HB, TOPK=k, BT=16, BI=16, BH=min(128 if scaled else 256, max(16, _p2(H))), DOT=dot,
                PREC=prec, SCALED=scaled, num_warps=4)
            _moe_down_kernel[(E, _cdiv(H, 32))](
                h, order, off, ws, down, ds, y, H, I, down.stride(0), down.stride(1), dss, IB,
                BT=16, BO=32, BI=min(128, max(16, _p2(I))), DOT=dot, PREC=prec, SCALED=scaled, num_warps=4)
        sh, gt, res = (out if t is None else t[s:e_] for t in (shared, shared_gate, residual))
        BH = 512 if norm is None else _p2(H)                                        # NORM: a row a program
        _moe_sum_kernel[(e_ - s, _cdiv(H, BH))](y, out[s:e_], sh, gt, res, nw, nrm[s:e_], H, gt.stride(0), eps,
                                                TOPK=k, BH=BH, SHARED=shared is not None, RES=residual is not None,
                                                NORM=norm is not None, PDL=pdl,
                                                num_warps=4 if norm is None else min(NORM_WARPS, max(1, BH // 256)),
                                                **_launch(pdl))
    return out if norm is None else (nrm, out)


def moe_experts_fp8_ref(x, w, idx, gate_up, down, gu_scale, dn_scale):
    """FP8 experts' reference: each expert's weights dequantized (gate's and up's blocks apart), then
    moe_experts_ref."""
    I = down.shape[2]
    IB = _cdiv(I, FP8_BLOCK)
    gu = torch.cat([fp8_dequantize_ref(gate_up[:, :I], gu_scale[:, :IB]),
                    fp8_dequantize_ref(gate_up[:, I:], gu_scale[:, IB:])], 1)
    return moe_experts_ref(x, w, idx, gu.to(x.dtype), fp8_dequantize_ref(down, dn_scale, x.dtype))


def moe_experts(x, w, idx, gate_up, down, shared=None, shared_gate=None, residual=None, gate_up_scale=None,
                down_scale=None, then=None):
    """sum_k w_k * down_e(silu(gate_e x) * up_e x) for each token's chosen experts.
    x [N, H]; w, idx [N, k]; gate_up [E, 2I, H] (gate rows first); down [E, H, I]. Returns [N, H].
    The MoE layer's epilogue rides along: with `shared` [N, H] and `shared_gate` [N, 1] (the shared expert's
    output and its gate logit) + sigmoid(shared_gate) * shared; with `residual` [N, H] + residual
    (the layer's skip). The kernels keep fp32 accumulators, sum the k experts and the epilogue in fp32 and
    round once (one launch); the reference rounds to x's dtype after each product and each op, as the unfused
    model does, and accumulates the experts in x's dtype (and syncs with the host).
    FP8 experts (e4m3 gate_up / down): gate_up_scale [E, 2 ceil(I/128), ceil(H/128)] (gate's block rows, then
    up's) and down_scale [E, ceil(H/128), ceil(I/128)]; the kernels scale each block's products in fp32.
    then: what the output goes through next (apply_then): the next layer's RMSNorm (weight, eps) returns
    (rms_norm(out), out), done by the kernel that sums the experts (MOE_SUM_NORM) as rms_norm does it."""
    if _fast(x):
        if shared is not None:
            shared = (shared if shared.stride(1) == 1 and shared.stride(0) == shared.shape[1]
                      else shared.contiguous())
        if residual is not None:
            residual = (residual if residual.stride(1) == 1 and residual.stride(0) == residual.shape[1]
                        else residual.contiguous())
        norm = _norm_then(then, x.shape[-1]) if MOE_SUM_NORM else None
        norm = norm if norm is not None and norm[0].is_contiguous() else None
        y = _moe_experts_launch(x, w, idx, gate_up, down, shared, shared_gate, residual, gate_up_scale,
                                down_scale, norm)
        return y if norm is not None else apply_then(y, then)
    if gate_up_scale is not None:
        out = moe_experts_fp8_ref(x, w, idx, gate_up, down, gate_up_scale, down_scale)
    else:
        out = moe_experts_ref(x, w, idx, gate_up, down)
    if shared is not None:
        out = out + torch.sigmoid(shared_gate) * shared
    return apply_then(out if residual is None else residual + out, then)


# ----------------------------------------------------------------------------------------------
# DSpark's Markov stage, greedy: K sequential steps, each a GEMV over the whole vocabulary and an argmax
# ----------------------------------------------------------------------------------------------
# U [B, K, V] fp32 base draft logits; e0 [B, r] = W1[anchor]; w1 [V, r] (token -> Markov embedding),
# w2 [V, r] (embedding -> logit bias). Step j: d_j = argmax_v(U[:, j, v] + (w2 e)_v) (first maximum), then
# e = w1[d_j]. Two launches per step: _markov_logits_kernel (program per block of BN vocabulary rows: the
# block's logits for every row b, its maximum and first argmax into partials [B, V / BN]) and
# _markov_pick_kernel (program per row: the first maximum over the partials, the draft, and w1's row for
# the next step). w2 is read once per step (bandwidth-bound, like the GEMV at M = 1 with its blocks).

def markov_greedy_ref(U, e0, w1, w2):
    e, ds = e0, []
    for j in range(U.shape[1]):
        d = (U[:, j] + F.linear(e, w2).float()).argmax(-1)
        ds.append(d)
        e = F.embedding(d, w1)
    return torch.stack(ds, 1)


def _markov_greedy_cpu(U, e0, w1, w2):
    """The CPU fast path of markov_greedy: the reference's products and sums (F.linear, the same GEMM), each
    step's argmax through numpy (kernels.argmax: ~8 us a step saved on the toy's [1, 8256]) and w1's row by
    indexing. The same drafts as the reference (test_cpu_markov_greedy)."""
    e, ds = e0, []
    for j in range(U.shape[1]):
        d = argmax(U[:, j] + F.linear(e, w2).float())                          # [B]
        ds.append(d)
        e = w1[d]                                                              # [B, r]
    return torch.stack(ds, 1)


@_jit
def _markov_logits_kernel(p_u, p_w2, p_e, p_pv, p_pi, B, V, R, s_ub, NB, BN: tl.constexpr, BR: tl.constexpr):
    i_n = tl.program_id(0)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < V
    o_r = tl.arange(0, BR)
    m_r = o_r < R
    b_w = tl.load(p_w2 + o_n[:, None].to(tl.int64) * R + o_r[None, :], mask=m_n[:, None] & m_r[None, :],
                  other=0.0).to(tl.float32)                                          # [BN, BR]
    for b in range(B):
        b_e = tl.load(p_e + b * R + o_r, mask=m_r, other=0.0).to(tl.float32)
        # rounded like a Linear's output
        b_l = tl.sum(b_w * b_e[None, :], 1).to(p_w2.dtype.element_ty).to(tl.float32)
        b_l += tl.load(p_u + b * s_ub + o_n, mask=m_n, other=0.0)
        b_l = tl.where(m_n, b_l, float("-inf"))
        mx = tl.max(b_l, 0)
        tl.store(p_pv + b * NB + i_n, mx)
        tl.store(p_pi + b * NB + i_n, tl.min(tl.where(b_l == mx, o_n, 2147483647), 0))


@_jit
def _markov_pick_kernel(p_pv, p_pi, p_w1, p_e, p_d, NB, R, j, s_d, BNB: tl.constexpr, BR: tl.constexpr):
    b = tl.program_id(0)
    best_v = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 2147483647, tl.int32)
    for c0 in range(0, NB, BNB):  # blocks in order: a later block wins only with a strictly larger maximum
        o = c0 + tl.arange(0, BNB)
        m = o < NB
        b_v = tl.load(p_pv + b * NB + o, mask=m, other=float("-inf"))
        b_i = tl.load(p_pi + b * NB + o, mask=m, other=2147483647)
        c_v = tl.max(b_v, 0)
        c_i = tl.min(tl.where(b_v == c_v, b_i, 2147483647), 0)
        best_i = tl.where(c_v > best_v, c_i, best_i)
        best_v = tl.maximum(best_v, c_v)
    tl.store(p_d + b * s_d + j, best_i.to(tl.int64))
    o_r = tl.arange(0, BR)
    m_r = o_r < R
    tl.store(p_e + b * R + o_r, tl.load(p_w1 + best_i.to(tl.int64) * R + o_r, mask=m_r, other=0.0), mask=m_r)


def markov_greedy(U, e0, w1, w2):
    """DSpark's greedy Markov stage: drafts [B, K] long from base logits U [B, K, V] (fp32), e0 = w1[anchor]
    [B, r], w1 [V, r], w2 [V, r] (one vocabulary: a reduced draft vocabulary maps ids between the steps, which
    the caller's own loop handles). Ties go to the first maximum, as torch.argmax."""
    if _cpu_fast(U) and not _fast(U):
        return _markov_greedy_cpu(U, e0, w1, w2)
    if not _fast(U):
        return markov_greedy_ref(U, e0, w1, w2)
    B, Kq, V = U.shape
    R = w2.shape[1]
    assert w1.shape == w2.shape == (V, R) and w1.is_contiguous() and w2.is_contiguous() and U.stride(2) == 1
    BN, BR = 128, _p2(R)  # H200, V 248320, r 256, 16 steps: 560 us (BN 16: 605; w2's bytes alone: 484)
    NB = _cdiv(V, BN)
    e = _empty((B, R), w1.dtype, U.device)
    e.copy_(e0)
    pv, pi = _empty((B, NB), torch.float32, U.device), _empty((B, NB), torch.int32, U.device)
    d = _empty((B, Kq), torch.long, U.device)
    for j in range(Kq):
        _markov_logits_kernel[(NB,)](U[:, j], w2, e, pv, pi, B, V, R, U.stride(0), NB, BN=BN, BR=BR,
                                     num_warps=4)
        _markov_pick_kernel[(B,)](pv, pi, w1, e, d, NB, R, j, d.stride(0), BNB=min(4096, _p2(NB)), BR=BR,
                                  num_warps=4)
    return d


# ----------------------------------------------------------------------------------------------
# Prompt lookup (method ngram), on the device
# ----------------------------------------------------------------------------------------------

def ngram_lookup_ref(hist, slots, last, room, k, lo, hi):
    """vLLM's prompt lookup for a batch of rows, in whole-tensor ops. hist [S, W] long: each slot's tokens
    at positions 0..last (beyond: anything); slots, last, room [B] long: the row's slot, the position of its
    last token, how many drafts may follow it. For every earlier end position e < last, m[e] = how many tokens
    ending at e equal the tokens ending at last (up to hi); the longest match n = max(m) wins if n >= lo, at
    its earliest e; the drafts are the up to k tokens after e (never past last). Returns drafts [B, k] long,
    -1 = none."""
    h = hist[slots]                                                           # [B, W]
    B, W = h.shape
    e = torch.arange(W, device=h.device)
    hp = F.pad(h, (hi - 1, 0), value=-1)                                      # hp[:, p] = h[:, p - (hi - 1)]
    run = e[None] < last[:, None]                                             # earlier end positions only
    m = torch.zeros(B, W, dtype=torch.int32, device=h.device)
    for i in range(hi):                                                       # h[e - i] == h[last - i] ...
        tok = h.gather(1, (last - i).clamp(min=0)[:, None])
        run = run & (hp[:, hi - 1 - i:hi - 1 - i + W] == tok)     # (e < last and e - i >= 0: last > i)
        m += run                                                              # ... for every i so far
    n = m.max(1).values                                                       # [B] the longest match
    first = torch.where(m >= n[:, None], e[None], W).min(1).values            # [B] its earliest end
    idx = first[:, None] + 1 + torch.arange(k, device=h.device)               # [B, k] the tokens after it
    ok = (n >= lo)[:, None] & (idx <= last[:, None]) & (idx - first[:, None] <= room[:, None])
    return torch.where(ok, h.gather(1, idx.clamp(max=W - 1)), -1)


@_jit
def _ngram_kernel(p_hist, p_slots, p_last, p_room, p_out, W, s_h, K: tl.constexpr, LO: tl.constexpr,
                  HI: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr):
    b = tl.program_id(0)
    row = p_hist + tl.load(p_slots + b) * s_h
    last = tl.load(p_last + b)
    best_n = tl.full([], 0, tl.int32)
    best_e = tl.full([], 0, tl.int64)
    for e0 in range(0, last, BW):  # blocks in order: a later block wins only with a strictly longer match
        o_e = e0 + tl.arange(0, BW)
        m = tl.zeros([BW], tl.int32)
        for i in tl.static_range(HI):  # m[e] == i: h[e - j] == h[last - j] for every j < i
            tok = tl.load(row + tl.maximum(last - i, 0))
            ok = (m == i) & (o_e < last) & (o_e >= i)        # (so last > i: h[last - i] exists)
            x = tl.load(row + o_e - i, mask=ok, other=-1)
            m += (ok & (x == tok)).to(tl.int32)
        c_n = tl.max(m, 0)
        c_e = tl.min(tl.where(m == c_n, o_e, W), 0)
        best_e = tl.where(c_n > best_n, c_e, best_e)
        best_n = tl.maximum(best_n, c_n)
    o_k = tl.arange(0, BK)
    idx = best_e + 1 + o_k
    n_d = tl.where(best_n >= LO, tl.minimum(tl.load(p_room + b), K), 0)          # how many drafts at most
    ok = (o_k < n_d) & (idx <= last)
    d = tl.load(row + idx, mask=ok, other=-1)
    tl.store(p_out + b * K + o_k, tl.where(ok, d, -1), mask=o_k < K)


def ngram_lookup(hist, slots, last, room, k, lo, hi):
    """ngram_lookup_ref on the GPU: one program per row, over its history up to its own last position (so the
    cost follows the history's length, not the buffer's), with no host sync (it runs inside a CUDA graph)."""
    if not _fast(hist):
        return ngram_lookup_ref(hist, slots, last, room, k, lo, hi)
    assert hist.dtype == slots.dtype == last.dtype == room.dtype == torch.long and hist.stride(1) == 1
    out = _empty((slots.shape[0], k), torch.long, hist.device)
    _ngram_kernel[(slots.shape[0],)](hist, slots, last, room, out, hist.shape[1], hist.stride(0), K=k, LO=lo,
                                     HI=hi, BW=1024, BK=_p2(k), num_warps=4)
    return out
