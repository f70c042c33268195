"""kernels.py - the hot paths of specdec, each as a plain PyTorch reference first.

Every function here is called by the model in specdec.py. Each section holds the PyTorch
reference (slow, obviously correct, the one the CPU tests and transformers comparisons use) and,
where it pays on the GPU, a Triton kernel beside it with the same signature. `USE_TRITON` picks the
fast path on CUDA tensors; tests flip it to compare both (on CPU through TRITON_INTERPRET=1).

Shapes: B = sequences in the batch, T = tokens per sequence in this step, S = state slots,
H_k / H_v = GDN key / value heads, d_k / d_v = their head dims, C = GDN conv channels.
"""
import math

import torch
import torch.nn.functional as F

USE_TRITON = True  # flipped by tests; only ever used for CUDA tensors (or under TRITON_INTERPRET=1)


# ----------------------------------------------------------------------------------------------
# RMSNorm variants
# ----------------------------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    """Zero-centred RMSNorm (Qwen3.5): y = x_f32 * rsqrt(mean(x^2) + eps) * (1 + w_f32), cast back.
    x [..., D], weight [D]."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x, z, weight, eps):
    """GDN output norm (plain weight, gate after the norm): w * norm(x).to(dtype) * silu(z_f32).
    x, z [..., d_v], weight [d_v]."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = weight * y
    return (y * F.silu(z.float())).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Causal depthwise conv over the GDN mixed_qkv channels, with its rolling window state
# ----------------------------------------------------------------------------------------------

def causal_conv(x, conv_pool, slots, weight, n_keep=None):
    """silu(depthwise causal conv) over x, continuing from each slot's window of past inputs.

    x [B, T, C] pre-conv inputs; conv_pool [S, C, K-1] past inputs (oldest first); slots [B] long;
    weight [C, K] (tap K-1 multiplies the current token); n_keep [B] long or None.
    Returns y [B, T, C]. The window of slot b becomes the last K-1 inputs after its first n_keep[b]
    tokens (all T when n_keep is None; unchanged when n_keep[b] == 0) - that is how a verify step
    leaves the window untouched and the commit after it keeps only the accepted tokens.
    """
    B, T, C = x.shape
    K = weight.shape[1]
    past = conv_pool[slots]                                     # [B, C, K-1]
    seq = torch.cat([past, x.transpose(1, 2).to(past.dtype)], dim=2)  # [B, C, K-1+T]
    w = weight.to(seq.dtype)
    y = F.conv1d(seq, w.unsqueeze(1), groups=C)                 # [B, C, T]
    y = F.silu(y).transpose(1, 2).to(x.dtype)
    if n_keep is None:
        conv_pool[slots] = seq[:, :, T:]
    else:
        idx = n_keep.view(B, 1, 1) + torch.arange(K - 1, device=x.device).view(1, 1, K - 1)
        conv_pool[slots] = seq.gather(2, idx.expand(B, C, K - 1))
    return y


# ----------------------------------------------------------------------------------------------
# Gated DeltaNet: recurrent (decode / verify / commit) and chunked (prefill)
# ----------------------------------------------------------------------------------------------

def _gdn_prep(q, k, v, g, beta):
    """l2-normalise q, k (fp32, eps inside the sqrt), scale q by d_k^-0.5 and repeat the key heads
    over their group of value heads. Returns fp32 tensors [B, H_v, T, d]."""
    Hk, Hv = q.shape[2], v.shape[2]
    q, k = (t.float() for t in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if Hv != Hk:  # value head j reads key head j // (H_v / H_k)
        q, k = (t.repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    return q, k, v, g.float().transpose(1, 2), beta.float().transpose(1, 2)


def gdn_recurrent(q, k, v, g, beta, state_pool, slots, n_keep=None):
    """The gated delta rule, one token at a time (decode, verify, and the commit after a verify).

    q, k [B, T, H_k, d_k]; v [B, T, H_v, d_v]; g (log decay, <= 0), beta [B, T, H_v];
    state_pool [S, H_v, d_k, d_v] fp32; slots [B]. Per token and value head:
        S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
    Returns o [B, T, H_v, d_v] in v's dtype. Slot b's state becomes the state after its first
    n_keep[b] tokens (after all T if n_keep is None; unchanged where n_keep[b] == 0).
    """
    B, T = q.shape[:2]
    dtype = v.dtype
    q, k, v, g, beta = _gdn_prep(q, k, v, g, beta)
    S = state_pool[slots].float()                               # [B, H_v, d_k, d_v]
    keep = S.clone() if n_keep is not None else None
    out = torch.empty_like(v)                                   # [B, H_v, T, d_v]
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        kv = torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])
        delta = beta[:, :, t, None] * (v[:, :, t] - kv)
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, :, t])
        if n_keep is not None:
            keep = torch.where((n_keep == t + 1).view(B, 1, 1, 1), S, keep)
    state_pool[slots] = (S if n_keep is None else keep).to(state_pool.dtype)
    return out.transpose(1, 2).to(dtype)


def gdn_chunked(q, k, v, g, beta, state_pool, slots, chunk=64):
    """The gated delta rule over a long sequence, in chunks (prefill). Same arguments and result as
    gdn_recurrent with n_keep=None; it agrees with it up to fp32 rounding.

    Within a chunk, with G = cumsum(g), the state update unrolls to
        U = (I + A)^-1 [beta * (V - exp(G) K S0)],  A[t, j] = beta_t exp(G_t - G_j) k_t.k_j  (j < t)
        O = exp(G) Q S0 + (exp(G_t - G_j) q_t.k_j)_{j<=t} U
        S = exp(G_last) S0 + (K * exp(G_last - G))^T U
    so each chunk costs a few matrix products and one triangular solve instead of C token steps.
    """
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
        A = (bc[..., None] * diff * kk).masked_fill(lower.logical_not() | torch.eye(c, dtype=torch.bool, device=q.device), 0)
        rhs = bc[..., None] * (vc - G.exp()[..., None] * (kc @ S))
        U = torch.linalg.solve_triangular(A + torch.eye(c, device=q.device), rhs, upper=False, unitriangular=True)
        out[:, :, s:e] = G.exp()[..., None] * (qc @ S) + (diff * (qc @ kc.transpose(-1, -2))) @ U
        S = G[..., -1, None, None].exp() * S + (kc * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2) @ U
    state_pool[slots] = S.to(state_pool.dtype)
    return out.transpose(1, 2).to(dtype)


# ----------------------------------------------------------------------------------------------
# Attention over the position-indexed KV cache (prefill, decode and verify)
# ----------------------------------------------------------------------------------------------

def attention(q, k_cache, v_cache, slots, pos, kv_len):
    """Causal GQA attention of T new queries per sequence over the slot's cached keys.

    q [B, T, n_h, d]; k_cache, v_cache [S, L, n_kv, d] (the new tokens already written at
    positions pos[b] .. pos[b]+T-1); slots, pos [B] long; kv_len: an int >= max(pos) + T, the cache
    prefix to look at. Query t of sequence b sees keys 0 .. pos[b]+t. Returns [B, T, n_h, d].
    """
    B, T, nh, d = q.shape
    nkv = k_cache.shape[2]
    k = k_cache[slots, :kv_len].float()                         # [B, L, n_kv, d]
    v = v_cache[slots, :kv_len].float()
    k, v = (t.repeat_interleave(nh // nkv, dim=2).transpose(1, 2) for t in (k, v))  # [B, n_h, L, d]
    scores = (q.float().transpose(1, 2) @ k.transpose(-1, -2)) * d ** -0.5        # [B, n_h, T, L]
    qpos = pos[:, None] + torch.arange(T, device=q.device)[None]                  # [B, T]
    visible = torch.arange(kv_len, device=q.device)[None, None] <= qpos[..., None]  # [B, T, L]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    p = scores.softmax(-1)
    return (p @ v).transpose(1, 2).to(q.dtype)


# ----------------------------------------------------------------------------------------------
# MoE routing and experts
# ----------------------------------------------------------------------------------------------

def moe_route(router_logits, top_k):
    """fp32 softmax over experts, top-k, renormalised. router_logits [N, E] -> (w [N, k] fp32, idx [N, k])."""
    probs = router_logits.float().softmax(-1)
    w, idx = probs.topk(top_k, dim=-1)
    return w / w.sum(-1, keepdim=True), idx


def moe_experts(x, w, idx, gate_up, down):
    """sum_k w_k * down_e(silu(gate_e x) * up_e x) for each token's chosen experts.
    x [N, H]; w, idx [N, k]; gate_up [E, 2I, H] (gate rows first); down [E, H, I]. Returns [N, H]."""
    out = torch.zeros_like(x)
    I = down.shape[2]
    for e in idx.unique().tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        h = x[tok] @ gate_up[e].t()
        h = F.silu(h[:, :I]) * h[:, I:]
        out.index_add_(0, tok, ((h @ down[e].t()) * w[tok, slot, None].to(x.dtype)).to(x.dtype))
    return out
