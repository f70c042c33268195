"""test_specdec.py - the tests, in three tiers: logic (configs, sampler, loaders), kernels (reference vs
fast), end to end (our logits vs transformers, lossless speculation, CLI). CPU, fp32, tiny checkpoints
written here in the real published layouts. Run: python -m pytest -q test_specdec.py

Also a tool: `python test_specdec.py make-tiny DIR [--moe]` writes a tiny random checkpoint.
"""
import concurrent.futures
import dataclasses
import functools
import gc
import http.client
import json
import math
import os
import random
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import struct
import sys
import sysconfig
import threading
import time
import types
import unicodedata
import unittest.mock
import urllib.request
import weakref

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # the Triton kernels run through the interpreter on CPU: set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import gguf
except ImportError:  # the GPU image has no gguf package: the GGUF tests skip there
    gguf = None
needs_gguf = pytest.mark.skipif(gguf is None, reason="needs the gguf package")

import bench
import kernels as K
import specdec as sd
from specdec import LLM, SamplingParams, ConfigError


def _interpreter_patches_once_per_launch():
    """The Triton interpreter (3.6-3.9) rebinds triton.language's builtins to its own (_patch_lang) before each
    kernel launch, restoring them after it, and again before every call of a @triton.jit helper inside the
    kernel (our _gemv_tile, tl.sum's combine function, ...), where nothing is restored: with the launch's
    bindings already in place that second rebinding changes nothing, but it walks the language modules each
    time (inspect.getmembers) and took ~30 % of the kernel tests' time (test_kernel_gemv_then: 29.8 -> 21.2 s).
    Here a helper's call rebinds a module's builtins only the first time in a launch (keyed by the helper's
    module); the launch itself rebinds as before. Skipped where the interpreter's internals differ."""
    try:
        import triton.runtime.interpreter as interp
    except ImportError:
        return
    grid_call, patch = getattr(interp.GridExecutor, "__call__", None), getattr(interp, "_patch_lang", None)
    if grid_call is None or patch is None or not hasattr(interp, "_LangPatchScope"):
        return
    seen = set()

    def launch(self, *args, **kwargs):
        seen.clear()
        return grid_call(self, *args, **kwargs)

    def patch_once(fn):
        if id(fn.__globals__) in seen:
            return interp._LangPatchScope()  # (an empty scope: nothing to restore)
        seen.add(id(fn.__globals__))
        return patch(fn)

    interp.GridExecutor.__call__, interp._patch_lang = launch, patch_once


def _interpreter_np_dtypes_cached():
    """The interpreter maps a Triton dtype to numpy's (_get_np_dtype) for every value an op makes, building a dict
    of 19 numpy dtypes each time (~9 us; 8 % of the kernel tests' time): here the answer is kept per element type
    (the same function's answer, so the same values). Skipped where the interpreter has no such function."""
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interp
    except ImportError:
        return
    get = getattr(interp, "_get_np_dtype", None)
    if get is None:
        return
    known = {}

    def np_dtype(tt):
        elem = tt.element_ty if isinstance(tt, tl.block_type) else tt
        if isinstance(elem, tl.pointer_type):                      # (unhashable; uint64 addresses)
            return get(elem)
        if elem not in known:
            known[elem] = get(elem)
        return known[elem]

    interp._get_np_dtype = np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_patches_once_per_launch()
    _interpreter_np_dtypes_cached()

HERE = ROOT = os.path.dirname(os.path.abspath(__file__))

# ==============================================================================================
# Tiny checkpoints in the published layouts
# ==============================================================================================

def tiny_text_config(moe=False, tie=False, mtp=True, vocab=1024, layers=4):
    cfg = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "hidden_size": 64, "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "full_attention_interval": 4, "vocab_size": vocab, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "max_position_embeddings": 4096, "tie_word_embeddings": tie, "attn_output_gate": True,
        "attention_bias": False, "mtp_num_hidden_layers": 1 if mtp else 0, "mtp_use_dedicated_embeddings": False,
        "mamba_ssm_dtype": "float32", "eos_token_id": None, "dtype": "float32",
    }
    if moe:
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    else:
        cfg.update(intermediate_size=128)
    return cfg


def random_weights(cfg, seed=0, mtp=True, per_expert=False):
    """Random tensors under text-only HF names (model.*, lm_head, mtp.*)."""
    g = torch.Generator().manual_seed(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    r = lambda *s, std=0.08: torch.randn(*s, generator=g) * std
    norm = lambda n: torch.randn(n, generator=g) * 0.1   # zero-centred norms: effective scale 1 + w
    w = {"model.embed_tokens.weight": r(V, H, std=0.5), "model.norm.weight": norm(H)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = r(V, H, std=0.3)
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    Hk, Hv, dk, dv = (cfg[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim"))
    C = 2 * Hk * dk + Hv * dv

    def attn(p):
        w.update({p + "self_attn.q_proj.weight": r(2 * nh * hd, H), p + "self_attn.k_proj.weight": r(nkv * hd, H),
                  p + "self_attn.v_proj.weight": r(nkv * hd, H), p + "self_attn.o_proj.weight": r(H, nh * hd),
                  p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)})

    def ffn(p):
        if "num_experts" in cfg:
            E, I, S = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
            w[p + "mlp.gate.weight"] = r(E, H, std=0.3)
            gu, dn = r(E, 2 * I, H), r(E, H, I)
            if per_expert:
                for e in range(E):
                    w[p + f"mlp.experts.{e}.gate_proj.weight"] = gu[e, :I].clone()
                    w[p + f"mlp.experts.{e}.up_proj.weight"] = gu[e, I:].clone()
                    w[p + f"mlp.experts.{e}.down_proj.weight"] = dn[e].clone()
            else:
                w[p + "mlp.experts.gate_up_proj"], w[p + "mlp.experts.down_proj"] = gu, dn
            w.update({p + "mlp.shared_expert.gate_proj.weight": r(S, H), p + "mlp.shared_expert.up_proj.weight": r(S, H),
                      p + "mlp.shared_expert.down_proj.weight": r(H, S), p + "mlp.shared_expert_gate.weight": r(1, H)})
        else:
            I = cfg["intermediate_size"]
            w.update({p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
                      p + "mlp.down_proj.weight": r(H, I)})
        w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"] = norm(H), norm(H)

    for i, t in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        if t == "full_attention":
            attn(p)
        else:
            w.update({p + "linear_attn.in_proj_qkv.weight": r(C, H), p + "linear_attn.in_proj_z.weight": r(Hv * dv, H),
                      p + "linear_attn.in_proj_b.weight": r(Hv, H), p + "linear_attn.in_proj_a.weight": r(Hv, H),
                      p + "linear_attn.conv1d.weight": r(C, 1, 4, std=0.3),
                      p + "linear_attn.dt_bias": torch.rand(Hv, generator=g) + 0.5,
                      p + "linear_attn.A_log": torch.log(torch.rand(Hv, generator=g) * 8 + 0.5),
                      p + "linear_attn.norm.weight": 1 + norm(dv), p + "linear_attn.out_proj.weight": r(H, Hv * dv)})
        ffn(p)
    if mtp:
        w.update({"mtp.fc.weight": r(H, 2 * H), "mtp.pre_fc_norm_embedding.weight": norm(H),
                  "mtp.pre_fc_norm_hidden.weight": norm(H), "mtp.norm.weight": norm(H)})
        attn("mtp.layers.0.")
        ffn("mtp.layers.0.")
    return w


def cycles(V, g, lo=3, hi=9):
    """A permutation of range(V) made of cycles of lo..hi ids (the last may be shorter): nxt[x]."""
    order, nxt, i = torch.randperm(V, generator=g).tolist(), list(range(V)), 0
    while i < V:
        c = order[i:i + int(torch.randint(lo, hi + 1, (), generator=g))]
        for a, b in zip(c, c[1:] + c[:1]):
            nxt[a] = b
        i += len(c)
    return torch.tensor(nxt)


def bigram_hidden(w):
    """What the target's final norm makes of each token's embedding alone [V, H] (text-only names)."""
    e = w["model.embed_tokens.weight"]
    return e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w["model.norm.weight"])


PREDICTABLE_MIX = 0.1  # the mixers' and MLPs' output projections, scaled


def make_predictable(w, cfg, seed):
    """Random tensors -> a target that a drafter can predict, so speculative tests see multi-token acceptance:
    - every mixer's and MLP's output projection scaled by PREDICTABLE_MIX: the last token decides most of the next
      one (a bigram model), while the context still moves every logit (~0.2 on average: wrong GDN or KV state
      shows in the logprobs, and flips ~15 % of the greedy tokens);
    - the lm_head rows tilted toward a permutation of the vocabulary made of short cycles (cycles()): the bigram
      then walks a cycle, so greedy text repeats (ngram drafts it), with some tokens tilted too weakly to win;
    - the MTP head wired to that bigram: fc passes the normed embedding through (plus a little of the hidden
      state), its final norm is the target's;
    - the last id (unused by the tokenizer; the block drafters' mask token) has a zero embedding;
    - the two ids before id 0 in its cycle get the strongest tilt: id 0 then likely follows two steps after the
      first (a padding draft, -1, is fed to the target as id 0: wrongly accepted, it would show); id 1 is a cycle
      of its own, strongly tilted: after drafts ending in 1 the bonus token is likely 1 again.
    Measured on SPEC_PROMPTS (48 tokens): mtp k=4 4.05 tokens per step, ngram k=4 4.45; 3 of the 5 outputs cycle."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed + 100)
    for n in w:
        if n.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")):
            w[n] = w[n] * PREDICTABLE_MIX
    w["model.embed_tokens.weight"][V - 1] = 0
    h = bigram_hidden(w)
    scale = 0.25 + 2 * torch.rand(V, 1, generator=g)
    nxt = cycles(V, g)
    before1 = int((nxt == 1).nonzero())
    nxt[before1], nxt[1], scale[1] = nxt[1], 1, 1.25                             # id 1 follows itself
    before = int((nxt == 0).nonzero())
    scale[before] = scale[int((nxt == before).nonzero())] = 2.25                 # x -> y -> 0 likely (padding ids)
    head = "model.embed_tokens.weight" if cfg["tie_word_embeddings"] else "lm_head.weight"
    assert head == "lm_head.weight", "a predictable target needs its own lm_head"
    tilt = scale * h / h.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    w[head] = w[head].index_add(0, nxt, tilt)                                    # row nxt[x] += tilt toward h(x)
    if "mtp.fc.weight" in w:
        w["mtp.fc.weight"] = torch.cat([torch.eye(H), torch.randn(H, H, generator=g) * 0.01], 1)
        w["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(H)
        w["mtp.norm.weight"] = w["model.norm.weight"].clone()
    return w


def save_tensors(path, w, shards=1):
    """model.safetensors, or `shards` model-*-of-*.safetensors with model.safetensors.index.json."""
    from safetensors.torch import save_file
    names = sorted(w)
    if shards == 1:
        save_file({k: w[k].contiguous() for k in names}, os.path.join(path, "model.safetensors"))
        return
    index = {}
    for s in range(shards):
        part = names[s::shards]
        f = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: w[k].contiguous() for k in part}, os.path.join(path, f))
        index.update({k: f for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": index}, fh)


def write_tiny_checkpoint(path, moe=False, tie=False, mtp=True, wrapper=True, shards=1, per_expert=False, seed=0,
                          tokenizer=True, extra=None, drop=None, predictable=False, sizes=None, bf16=False):
    """Write config.json, generation_config.json, tokenizer files and safetensors in the published layout:
    `wrapper` = multimodal Qwen3_5ForConditionalGeneration names (model.language_model.*, a vision tower
    that must be skipped) else text-only Qwen3_5ForCausalLM names (model.*). `predictable`: make_predictable.
    `sizes`: text_config entries over tiny_text_config's. `bf16`: the tensors stored in bf16 (as published)."""
    os.makedirs(path, exist_ok=True)
    tok_vocab = 0
    if tokenizer:
        sys.path.insert(0, os.path.join(HERE, "tools"))
        from make_tokenizer import make_tiny_tokenizer
        make_tiny_tokenizer(path)
        with open(os.path.join(path, "tokenizer.json")) as fh:
            tj = json.load(fh)
        tok_vocab = len(tj["model"]["vocab"]) + len(tj["added_tokens"])
    text = {**tiny_text_config(moe, tie, mtp, vocab=max(1024, (tok_vocab + 63) // 64 * 64)), **(sizes or {})}
    if tokenizer:
        ids = {t["content"]: t["id"] for t in tj["added_tokens"]}
        text["eos_token_id"] = ids["<|endoftext|>"]
    w = random_weights(text, seed, mtp, per_expert)
    if predictable:
        w = make_predictable(w, text, seed)
    if wrapper:
        top = {"model_type": "qwen3_5_moe" if moe else "qwen3_5",
               "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
               "text_config": text, "vision_config": {"depth": 1, "hidden_size": 16}, "tie_word_embeddings": tie}
        w = {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in w.items()}
        w["model.visual.patch_embed.proj.weight"] = torch.zeros(16, 3, 2, 4, 4)
    else:
        top = dict(text, architectures=["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"])
    w.update(extra or {})
    for name in drop or []:
        w.pop(name)
    if bf16:
        w = {k: v.bfloat16() for k, v in w.items()}
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(top, fh, indent=1)
    if tokenizer:
        with open(os.path.join(path, "generation_config.json"), "w") as fh:
            json.dump({"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "do_sample": True}, fh)
    save_tensors(path, w, shards)
    return path


def hf_model(path):
    """The same checkpoint in transformers' text-only Qwen3_5(Moe)ForCausalLM (pure-torch paths)."""
    from safetensors.torch import load_file
    import transformers
    with open(os.path.join(path, "config.json")) as fh:
        top = json.load(fh)
    text = top.get("text_config", top)
    moe = "moe" in text["model_type"]
    cls_cfg = transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig
    cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    cfg = cls_cfg(**{k: v for k, v in text.items() if k not in ("model_type", "dtype")})
    m = cls(cfg).eval()
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    w = {}
    for f in files:
        w.update(load_file(os.path.join(path, f)))
    sd_ = {}
    for k, v in w.items():
        if k.startswith(("mtp.", "model.visual.")):
            continue
        sd_[k.replace("model.language_model.", "model.")] = v
    missing, unexpected = m.load_state_dict(sd_, strict=False)
    ok = lambda k: "rotary" in k or (k == "lm_head.weight" and cfg.tie_word_embeddings)
    assert not unexpected and all(ok(k) for k in missing), (missing, unexpected)
    if cfg.tie_word_embeddings:
        m.tie_weights()
    return m


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tinymoe")), moe=True)


# ==============================================================================================
# Tier 1: logic
# ==============================================================================================

def test_gdn_chunked_equals_recurrent():
    torch.manual_seed(0)
    for B, T, Hk, Hv in ((1, 1, 2, 2), (2, 63, 2, 6), (1, 130, 3, 3)):
        q, k = torch.randn(B, T, Hk, 16), torch.randn(B, T, Hk, 16)
        v = torch.randn(B, T, Hv, 8)
        g, beta = -torch.rand(B, T, Hv) * 3, torch.rand(B, T, Hv)
        s1 = torch.randn(B + 1, Hv, 16, 8)
        s2 = s1.clone()
        slots = torch.arange(B) + 1
        o1 = K.gdn_recurrent(q, k, v, g, beta, s1, slots)
        o2 = K.gdn_chunked(q, k, v, g, beta, s2, slots)
        assert (o1 - o2).abs().max() < 1e-4 and (s1 - s2).abs().max() < 1e-4
        assert torch.equal(s1[0], s2[0])  # untouched slot


def test_gdn_recurrent_n_keep_equals_prefix():
    """A verify over T tokens that keeps n: the state equals running only the first n tokens."""
    torch.manual_seed(1)
    B, T = 3, 5
    q, k, v = torch.randn(B, T, 2, 8), torch.randn(B, T, 2, 8), torch.randn(B, T, 4, 8)
    g, beta = -torch.rand(B, T, 4), torch.rand(B, T, 4)
    s0 = torch.randn(B, 4, 8, 8)
    n = torch.tensor([0, 2, 5])
    s1 = s0.clone()
    K.gdn_recurrent(q, k, v, g, beta, s1, torch.arange(B), n)
    for b in range(B):
        s2 = s0[b:b + 1].clone()
        nb = int(n[b])
        if nb:
            K.gdn_recurrent(q[b:b + 1, :nb], k[b:b + 1, :nb], v[b:b + 1, :nb], g[b:b + 1, :nb], beta[b:b + 1, :nb],
                            s2, torch.tensor([0]))
        assert torch.allclose(s1[b], s2[0], atol=1e-6)


def test_seeded_sampling_reproducible(tiny):
    llm = LLM(model=tiny, device="cpu")
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=123)
    a = llm.generate(["hello world"], p)[0].outputs[0].token_ids
    b = llm.generate(["hello world"], p)[0].outputs[0].token_ids
    c = llm.generate(["hello world"], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=7))[0]
    assert a == b and len(a) == 12
    assert c.outputs[0].token_ids != a


def ngram_reference(ctx, k, lo, hi):
    """Prompt lookup as README.md states it, written plainly: of the suffixes of ctx with lo..hi tokens that also occur
    earlier (an occurrence may overlap the suffix but not be it), the longest; its earliest occurrence; the up to k
    tokens that follow that occurrence."""
    N, best = len(ctx), None
    for n in range(lo, hi + 1):                                   # shortest first: a longer match replaces it
        suffix = list(ctx[N - n:]) if n < N else None
        starts = [i for i in range(N - n) if suffix is not None and list(ctx[i:i + n]) == suffix]
        if starts:
            best = (n, starts[0])
    return [] if best is None else list(ctx[best[0] + best[1]:best[0] + best[1] + k])


NGRAM_CASES = [  # (ctx, k, lo, hi, drafts): each tells one rule from its plausible wrong version
    ([1, 2, 3, 4, 2, 3], 4, 2, 3, [4, 2, 3]),                     # vLLM's docstring example
    ([1, 2, 7, 1, 2, 8, 1, 2], 3, 2, 2, [7, 1, 2]),               # earliest occurrence ([8, 1, 2]: the latest)
    ([3, 8, 2, 3, 9, 2, 3], 3, 1, 2, [9, 2, 3]),                  # longest n-gram ([8, 2, 3]: the 1-gram [3] first)
    ([3, 8, 2, 3, 9, 5, 2, 3], 3, 1, 1, [8, 2, 3]),               # hi = 1: only 1-grams
    ([0, 2, 3, 5, 1, 2, 3, 6, 1, 2, 3], 3, 1, 3, [6, 1, 2]),      # the 3-gram [1, 2, 3]
    ([0, 2, 3, 5, 1, 2, 3, 6, 1, 2, 3], 3, 1, 2, [5, 1, 2]),      # hi = 2 caps it: the 2-gram [2, 3], earliest
    ([3, 8, 2, 3], 3, 2, 4, []),                                  # lo = 2: the 1-gram match does not count
    ([3, 8, 2, 3], 3, 1, 4, [8, 2, 3]),                           # lo = 1: it does
    ([4, 5], 2, 1, 1, []),                                        # the suffix itself is no occurrence
    ([7], 3, 1, 5, []),                                           # one token: nothing earlier
    ([1, 1, 1], 5, 1, 5, [1]),                                    # n <= N - 1; overlapping match; runs to the end
    ([6, 6, 6, 6, 6], 2, 3, 3, [6, 6]),                           # k caps the drafts
    ([2, 9, 9, 2, 5, 2], 4, 1, 1, [9, 9, 2, 5]),                  # exactly k tokens after the first 2
]


@pytest.mark.parametrize("ctx,k,lo,hi,want", NGRAM_CASES)
def test_ngram_lookup_cases(ctx, k, lo, hi, want):
    assert ngram_reference(ctx, k, lo, hi) == want               # the reference is right on the hand-made cases
    assert sd.ngram_lookup(ctx, k, lo, hi) == want


def test_ngram_lookup_matches_reference():
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        ctx = torch.randint(0, 4, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        lo = int(torch.randint(1, 4, (1,), generator=g))
        hi = lo + int(torch.randint(0, 3, (1,), generator=g))
        k = int(torch.randint(1, 6, (1,), generator=g))
        assert sd.ngram_lookup(ctx, k, lo, hi) == ngram_reference(ctx, k, lo, hi), (ctx, k, lo, hi)


def test_top_k_top_p_masks():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    p = sd.target_probs(logits, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    assert (p[0, 2:] == 0).all() and abs(float(p.sum()) - 1) < 1e-6
    p = sd.target_probs(logits, torch.tensor([1.0]), torch.tensor([-1]), torch.tensor([0.5]))
    assert p[0, 0] == 1.0  # the top token alone holds > 0.5 of the mass


# ==============================================================================================
# Tier 3: end to end against transformers
# ==============================================================================================

def our_logits(llm, ids, mode):
    """All-position logits of a prompt: one chunked prefill, or one token at a time."""
    st = llm.engine.runner.state
    st.reset(0)
    slots = torch.tensor([0])
    x = torch.tensor([ids])
    with torch.inference_mode():
        if mode == "prefill":
            return llm.model.logits(llm.model(x, sd.Ctx(st, slots, torch.tensor([0]), len(ids), "prefill")))[0]
        out = [llm.model.logits(llm.model(x[:, t:t + 1], sd.Ctx(st, slots, torch.tensor([t]), t + 1, "decode")))[0, 0]
               for t in range(len(ids))]
        return torch.stack(out)


@pytest.mark.parametrize("kind", ["dense", "moe", "dense-tied-text-sharded", "moe-per-expert-text", "dense-bf16"])
def test_logits_match_transformers(kind, tmp_path, monkeypatch):
    """Our fp32 logits == transformers' within 1e-4, prefill and decode; "bf16": a checkpoint of bf16 values (as
    published), whose small CPU steps take FBGEMM's fp16-weight GEMM (kernels._fp16_weight; counted)."""
    moe = kind.startswith("moe")
    path = write_tiny_checkpoint(str(tmp_path / kind), moe=moe, tie="tied" in kind, wrapper="text" not in kind,
                                 shards=2 if "sharded" in kind else 1, per_expert="per-expert" in kind, seed=3,
                                 bf16="bf16" in kind)
    calls = []
    real = K._fp16
    monkeypatch.setattr(K, "_fp16", lambda rows, wp: calls.append(1) or real(rows, wp))
    llm = LLM(model=path, device="cpu", dtype="float32")
    hf = hf_model(path) if "per-expert" not in kind else None
    if hf is None:  # the per-expert layout must load to the same model as the fused one
        fused = write_tiny_checkpoint(str(tmp_path / "fused"), moe=True, wrapper=False, seed=3)
        hf = hf_model(fused)
    ids = torch.randint(0, llm.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    for mode in ("prefill", "decode"):
        ours = our_logits(llm, ids, mode)
        err = (ours - ref).abs().max().item()
        assert err <= 1e-4, (mode, err)
    assert bool(calls) == ("bf16" in kind and K._fp16_gemm_here())


@pytest.mark.parametrize("moe", [False, True])
def test_greedy_matches_transformers_generate(moe, tiny, tiny_moe):
    path = tiny_moe if moe else tiny
    llm = LLM(model=path, device="cpu")
    hf = hf_model(path)
    ids = llm.tokenizer.encode("def fibonacci(n):\n    if n < 2:")
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref


def test_prompt_logprobs_equal_a_whole_forward(tiny):
    """prompt_logprobs against an independent reference: transformers' forward over the whole prompt in one
    pass, log_softmax. Chunked prefill (280-token pieces, their logits taken 256 rows at a time) and an MTP
    drafter must not change them; position 0 has none (None), each position holds the prompt token (its rank:
    tokens at least as likely) and the 3 most likely (ranks 1..3); -1 gives the whole vocabulary. A request
    without prompt_logprobs in the same batch gets None and the same tokens as alone."""
    ids = torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf_model(tiny)(torch.tensor([ids])).logits[0].double().log_softmax(-1)    # [300, V]
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    llm = LLM(tiny, device="cpu", max_num_batched_tokens=280, speculative_config=mtp, max_logprobs=-1)
    tok = llm.get_tokenizer()
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    asks = dataclasses.replace(plain, prompt_logprobs=3)
    out, other = llm.generate([ids, ids[:12]], [asks, plain], use_tqdm=False)
    assert other.prompt_logprobs is None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    assert out.outputs[0].token_ids == llm.generate(ids, plain, use_tqdm=False)[0].outputs[0].token_ids
    for i, d in enumerate(out.prompt_logprobs[1:], 1):
        lp, t = ref[i - 1], ids[i]                                            # row i-1 predicts token i
        top = lp.topk(3)
        assert list(d)[:3] == top.indices.tolist() and set(d) == set(top.indices.tolist()) | {t}
        assert all(abs(d[x].logprob - float(lp[x])) < 1e-4 for x in d)
        assert d[t].rank == int((lp >= lp[t]).sum()) and [d[x].rank for x in list(d)[:3]] == [1, 2, 3]
        assert all(d[x].decoded_token == tok.decode([x]) for x in d)
    whole = llm.generate(ids[:5], dataclasses.replace(plain, prompt_logprobs=-1), use_tqdm=False)[0]
    assert [len(d) for d in whole.prompt_logprobs[1:]] == [1024] * 4
    assert all(abs(d[x].logprob - float(ref[i, x])) < 1e-4 for i, d in enumerate(whole.prompt_logprobs[1:])
               for x in range(0, 1024, 97))


def test_logprob_rows_against_a_sorted_reference():
    g = torch.Generator().manual_seed(28)
    T, V = 4, 9
    logits = torch.randn(T, V, generator=g) * 2
    lp = logits.double().log_softmax(-1)
    order = lp.argsort(-1, descending=True).tolist()
    toks = [order[0][0], order[1][1], order[2][5], order[3][8]]                # 1st, 2nd, 6th and last
    for n_top in (2, 0, -1):
        m = V if n_top == -1 else n_top
        for t, row in enumerate(sd.logprob_rows(logits, toks, n_top)):
            want = [(order[t][r], r + 1) for r in range(m)]
            if toks[t] not in order[t][:m]:
                want.append((toks[t], order[t].index(toks[t]) + 1))
            assert [(i, r) for i, _, r in row] == want, (n_top, t)
            assert all(abs(v - float(lp[t, i])) < 1e-5 for i, v, _ in row)


class OneDevice(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails every op whose tensor arguments (0-dim ones aside: Python scalars) are on more than one device, which
    CUDA refuses and the meta device does not always; a meta tensor read back to the host (.tolist()) reads as
    zeros, so a host-side loop runs on."""
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        devices = {t.device for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
        assert len(devices) <= 1, f"{func} mixes {devices}"
        if func is torch.ops.aten._to_copy.default and args[0].is_meta and kwargs.get("device") == torch.device("cpu"):
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        return func(*args, **kwargs)


def test_logprob_rows_stays_on_the_logits_device():
    meta = torch.device("meta")
    with OneDevice():
        rows = sd.logprob_rows(torch.randn(3, 10, device=meta), [4, 5, 6], 2)
    assert len(rows) == 3


def test_truncate_prompt_tokens(tiny):
    """truncate_prompt_tokens keeps the prompt's last N tokens (-1: max_model_len of them), as vLLM: the
    output equals generating from those tokens alone; vLLM's messages for bad values and N > max_model_len."""
    llm = LLM(tiny, device="cpu", max_model_len=64)
    ids = torch.randint(0, 1024, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    cut, alone = llm.generate([ids, ids[-8:]], [dataclasses.replace(sp, truncate_prompt_tokens=8), sp],
                              use_tqdm=False)
    assert cut.prompt_token_ids == ids[-8:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    text = llm.generate("a b c d e f g", dataclasses.replace(sp, truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert text.prompt_token_ids == llm.tokenizer.encode("a b c d e f g")[-3:]
    assert llm.generate(ids, dataclasses.replace(sp, truncate_prompt_tokens=-1),
                        use_tqdm=False)[0].prompt_token_ids == ids  # 40 <= max_model_len: all kept
    too_many = "truncate_prompt_tokens value (65) is greater than max_model_len (64). Please, select a"
    with pytest.raises(ConfigError, match=re.escape(too_many)):
        llm.generate([ids, ids], [sp, dataclasses.replace(sp, truncate_prompt_tokens=65)], use_tqdm=False)
    assert not llm.engine.has_work()  # the refused batch left nothing queued
    for bad in (0, -2, 1.5):
        msg = f"truncate_prompt_tokens must be an integer >= 1 or -1, got {bad}"
        with pytest.raises(ConfigError, match=re.escape(msg)):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ConfigError, match=re.escape("prompt_logprobs must be non-negative or -1, got -2.")):
        SamplingParams(prompt_logprobs=-2)


def test_offline_api_as_vllm(tiny_spec, capsys):
    """The everyday vLLM snippets: LLM(model, **engine_args) (an unknown argument a TypeError), generate with
    a progress bar (use_tqdm, on by default), Logprob objects, chat with chat_template_kwargs,
    get_tokenizer(), and get_metrics() as vLLM's metric objects under vLLM's names, the per-position
    acceptance a Vector."""
    with pytest.raises(TypeError, match="no_such_engine_arg"):
        LLM(tiny_spec, device="cpu", no_such_engine_arg=1)
    llm = LLM(tiny_spec, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    capsys.readouterr()
    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    outs = llm.generate(["def fib(n):", "hello"], sp)
    bar = capsys.readouterr().err
    assert "Processed prompts" in bar and "2/2" in bar and "est. speed input" in bar
    llm.generate("hello", sp, use_tqdm=False)
    assert capsys.readouterr().err == ""
    over = "Requested prompt logprobs of 1024, which is greater than max allowed: 20"  # -1: all 1024
    with pytest.raises(ValueError, match=re.escape(over)):
        llm.generate("hello", SamplingParams(prompt_logprobs=-1))
    tok = llm.get_tokenizer()
    o = outs[0].outputs[0]
    assert tok.decode(o.token_ids) == o.text and outs[0].prompt_token_ids == tok.encode("def fib(n):")
    for i, t in enumerate(o.token_ids):
        lp = o.logprobs[i][t]
        assert isinstance(lp, sd.Logprob) and lp.logprob <= 0 and lp.rank >= 1
        assert lp.decoded_token == tok.decode([t])
        assert [v.rank for v in list(o.logprobs[i].values())[:2]] == [1, 2]
    cum = sum(o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids))
    assert o.cumulative_logprob == pytest.approx(cum)
    msgs = [{"role": "user", "content": "hi"}]
    chat = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4),
                    chat_template_kwargs={"enable_thinking": False})
    assert chat[0].prompt_token_ids == tok.encode(sd.apply_chat_template(msgs, True, False))
    assert chat[0].prompt_token_ids != tok.encode(sd.apply_chat_template(msgs, True, True))
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False)  # as transformers
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert ids == chat[0].prompt_token_ids and text == sd.apply_chat_template(msgs, True, False)
    plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert tok.decode(ids, skip_special_tokens=True) == plain != text
    metrics = llm.get_metrics()
    assert {type(m).__name__ for m in metrics} == {"Counter", "Vector", "Gauge", "Histogram"}
    by = {(m.name, m.labels.get("finished_reason")): m for m in metrics}
    st = llm.engine.stats
    assert by["vllm:spec_decode_num_drafts", None].value == st.num_drafts > 0
    assert by["vllm:spec_decode_num_draft_tokens", None].value == st.num_draft_tokens
    assert by["vllm:spec_decode_num_accepted_tokens", None].value == st.num_accepted_tokens > 0
    per_pos = by["vllm:spec_decode_num_accepted_tokens_per_pos", None]
    assert isinstance(per_pos, sd.Vector) and per_pos.values == st.accepted_per_pos
    assert len(per_pos.values) == 2
    assert sum(per_pos.values) == st.num_accepted_tokens
    assert by["vllm:generation_tokens", None].value == 12 * 3 + 4
    n_prompt = sum(len(r.prompt_token_ids) for r in outs + chat) + len(tok.encode("hello"))
    assert by["vllm:prompt_tokens", None].value == n_prompt
    assert by["vllm:request_success", "length"].value == 4
    assert by["vllm:num_requests_running", None].value == by["vllm:num_requests_waiting", None].value == 0
    ttft = by["vllm:time_to_first_token_seconds", None]
    assert ttft.count == ttft.buckets["+Inf"] == 4
    assert per_pos.labels == {"model_name": tiny_spec, "engine": "0"}
    # chat_template_kwargs go over the template's own arguments, as vLLM merges them (not the messages)
    over = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=1),
                    chat_template_kwargs={"enable_thinking": False, "add_generation_prompt": False})
    assert over[0].prompt_token_ids == tok.encode(sd.apply_chat_template(msgs, False, False))
    with pytest.raises(ConfigError, match="may not set messages"):
        llm.chat(msgs, chat_template_kwargs={"messages": []})


def test_chat_continues_the_final_message(tiny_spec):
    """vLLM's continue_final_message (LLM.chat; the server's in test_chat_continue_and_echo_through_the_server):
    the chat rendered without what follows its last message's text, so that the model goes on with an answer the
    caller began. The reference: the whole chat's rendering less the template's end of turn after that text.
    Where the template trims the text, the cut follows it (transformers'); vLLM's message when
    add_generation_prompt is set too; a final message with no text, or one the template drops, is refused."""
    llm = LLM(tiny_spec, device="cpu")
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "write fib"}, {"role": "assistant", "content": "def fib(n):"}]
    whole = sd.apply_chat_template(msgs, False, True)
    assert whole.endswith("def fib(n):<|im_end|>\n")
    want = whole[:-len("<|im_end|>\n")]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.chat(msgs, sp, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt_token_ids == tok.encode(want)
    assert out[0].outputs[0].token_ids == llm.generate(want, sp, use_tqdm=False)[0].outputs[0].token_ids
    kwargs = llm.chat(msgs, sp, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False,
                                                                      "continue_final_message": True})
    assert kwargs[0].prompt_token_ids == out[0].prompt_token_ids
    # content parts: the last text part goes on
    parts = [msgs[0], {"role": "assistant", "content": [{"type": "text", "text": "def fib(n):"}]}]
    assert llm.chat(parts, sp, use_tqdm=False, add_generation_prompt=False,
                    continue_final_message=True)[0].prompt_token_ids == out[0].prompt_token_ids
    # the cut is where the message's text ends, whatever text follows it: its end of turn ("<" + "<|im_end|>"),
    # its own tool calls (named as the text), a closing tag the text spells ("[end]")
    cut = lambda m, t=None: (t or sd.ChatTemplate()).render(m, None, False, True)  # noqa: E731
    turn = lambda text: sd.apply_chat_template([msgs[0], {"role": "assistant", "content": text}], False, True)
    assert cut([msgs[0], {"role": "assistant", "content": "<"}]) == turn("<")[:-len("<|im_end|>\n")]
    call = {"function": {"name": "get", "arguments": '{"get": "get"}'}}
    called = [msgs[0], {"role": "assistant", "content": "get", "tool_calls": [call]}]
    assert cut(called) == turn("get")[:-len("<|im_end|>\n")]
    # an empty answer opens the turn after its header (the template trims the text, and the cut its whitespace)
    assert turn("").endswith("</think>\n\n<|im_end|>\n")
    assert cut([msgs[0], {"role": "assistant", "content": ""}]) == turn("")[:-len("\n\n<|im_end|>\n")]
    verbatim = sd.ChatTemplate("{% for m in messages %}[{{ m.role }}]{{ m.content }}[end]{% endfor %}")
    trimmed = sd.ChatTemplate("{% for m in messages %}[{{ m.role }}]{{ m.content | trim }}[end]{% endfor %}")
    spaced = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  a b  "}]
    assert cut(spaced, verbatim) == "[user]hi[end][assistant]  a b  "
    assert cut(spaced, trimmed) == "[user]hi[end][assistant]a b"
    assert cut([spaced[0], {"role": "assistant", "content": "end"}], verbatim) == "[user]hi[end][assistant]end"
    with pytest.raises(ConfigError, match=re.escape("Cannot set both `continue_final_message` and "
                                                    "`add_generation_prompt` to True.")):
        llm.chat(msgs, sp, continue_final_message=True)  # add_generation_prompt's default is True (vLLM)
    with pytest.raises(ConfigError, match="the final message has no text to continue"):
        llm.chat([msgs[0], {"role": "assistant", "content": None, "tool_calls": [call]}], sp,
                 add_generation_prompt=False, continue_final_message=True)
    dropped = sd.ChatTemplate("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    with pytest.raises(ValueError, match="the final message does not appear in the chat"):
        dropped.render(msgs, None, False, True)


# ==============================================================================================
# Speculative decoding: lossless, rollback, rejection sampler, configs
# ==============================================================================================

SPEC_PROMPTS = ["def fib(n):\n    return fib(n-1) + fib(n-2)\n\ndef fib(", "hello", "a b c a b c a b",
                "import os\nimport sys\nimport os\n", "x = 1\ny = 2\nx = 1\ny = 2\nx ="]
SPEC_CONFIGS = [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}] + \
               [{"method": "mtp", "num_speculative_tokens": k} for k in (1, 2, 4)]


@pytest.fixture(scope="session")
def tiny_spec(tmp_path_factory):
    """The tiny target made predictable (make_predictable): its MTP head and the ngram lookup get drafts accepted."""
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_spec")), predictable=True)


@pytest.fixture(scope="session")
def spec_off(tiny_spec):
    llm = LLM(model=tiny_spec, device="cpu")
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    return sp, llm.generate(SPEC_PROMPTS, sp), llm.generate(SPEC_PROMPTS[:1], sp)


def assert_multi_token(stats, k, at_least):
    """Speculation did its work: mean acceptance length (tokens per verify step) >= at_least, some steps accepted
    all k drafts (bonus tokens), and (k > 1) some accepted a part of them. Without acceptance every step emits one
    token (length 1.0), and a lossless check could not see what happens inside a multi-token run."""
    assert stats.num_drafts > 0
    assert stats.mean_acceptance_length >= at_least, (stats.mean_acceptance_length, at_least)
    assert stats.accepted_per_pos[k - 1] > 0                                     # all k accepted
    assert k == 1 or stats.accepted_per_pos[0] > stats.accepted_per_pos[k - 1]  # runs that end inside the drafts


@pytest.mark.parametrize("cfg", SPEC_CONFIGS, ids=lambda c: f"{c['method']}{c['num_speculative_tokens']}")
def test_greedy_spec_equals_plain(cfg, tiny_spec, spec_off):
    sp, ref, ref1 = spec_off
    llm = LLM(model=tiny_spec, device="cpu", speculative_config=cfg)
    one = llm.generate(SPEC_PROMPTS[:1], sp)[0].outputs[0]
    assert one.token_ids == ref1[0].outputs[0].token_ids
    outs = llm.generate(SPEC_PROMPTS, sp)  # a batch of 5 prompts of different lengths
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b, t in zip(o.outputs[0].logprobs, r.outputs[0].logprobs, r.outputs[0].token_ids):
            assert abs(a[t].logprob - b[t].logprob) <= 1e-5  # measured worst 5.5e-6 (kernels.exact, .linear)
            assert set(a) == set(b)
    k = cfg["num_speculative_tokens"]
    assert_multi_token(llm.engine.stats, k, 1 + 0.5 * k)  # measured: ngram 3.70, 4.45; mtp 1.91, 2.71, 4.05


class OracleProposer:
    """Proposes the true greedy continuation `truth` (prompt's first id -> plain decoding's output ids), with planted
    mistakes when `mistakes`: exercises full acceptance (bonus tokens), partial acceptance and rejection at position
    0, whatever a draft model's quality. Without mistakes every draft is accepted: each step emits k+1 tokens."""
    def __init__(self, k, truth, vocab_size, mistakes=True):
        self.k, self.truth, self.vocab_size, self.mistakes, self.step = k, truth, vocab_size, mistakes, 0

    def prefill(self, *a):
        pass

    def commit(self, *a):
        pass

    def propose(self, batch):
        reqs = batch.reqs
        d = torch.full((len(reqs), self.k), -1)
        for b, r in enumerate(reqs):
            n = len(r.output_ids)
            seq = self.truth[r.prompt_ids[0]][n:n + self.k]
            d[b, :len(seq)] = torch.tensor(seq)
            wrong = (self.step + b) % (self.k + 2)  # position of a planted wrong token (none if >= k)
            if self.mistakes and wrong < len(seq):
                d[b, wrong] = (d[b, wrong] + 1) % self.vocab_size
        self.step += 1
        return d, None


def test_verify_commit_with_oracle_drafts(tiny_spec, spec_off):
    sp, ref, _ = spec_off
    llm = LLM(model=tiny_spec, device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    prompts = [llm.tokenizer.encode(p) for p in SPEC_PROMPTS]
    truth = {p[0]: r.outputs[0].token_ids for p, r in zip(prompts, ref)}
    assert len(truth) == len(prompts)
    llm.engine.runner.proposer = OracleProposer(4, truth, llm.cfg.vocab_size)
    outs = llm.generate(prompts, sp)
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    s = llm.engine.stats
    assert s.accepted_per_pos[3] > 0 and s.num_accepted_tokens < s.num_draft_tokens  # full and partial acceptance


def mtp_chain_reference(model, ids, k, temp=None, u=None):
    """MTP drafts after the committed tokens ids (prompt + output; the last not yet seen by the target), from scratch
    with the MTP module, step by step: target hidden states h_t over ids[:-1]; the MTP layer over positions
    t = 0..L-1 fed (h_t, ids[t+1]) (L = len(ids) - 1); its output at L-1 gives d1; step j (1..k-1) runs at position
    L-1+j fed (its own previous output, d_j). Greedy: argmax; temp: d_j drawn by inverse CDF with u[j] from
    q_j = softmax(logits / temp). -> (drafts, [q_j] or None)."""
    L = len(ids) - 1
    st = sd.State(model.cfg, 1, L + k + 1, torch.float32, "cpu", mtp=True)
    x, slot = torch.tensor([ids]), torch.tensor([0])
    ctx = lambda p, n, mode="decode": sd.Ctx(st, slot, torch.tensor([p]), n, mode)
    with torch.inference_mode():
        h = model(x[:, :L], ctx(0, L, "prefill"))                                    # [1, L, H]
        g = model.mtp(model.embed_tokens(x[:, 1:]), h, ctx(0, L))[:, -1]             # [1, H] at position L-1
        out, qs = [], []
        for j in range(k):
            if j > 0:
                g = model.mtp(model.embed_tokens(torch.tensor([[out[-1]]])), g[:, None], ctx(L - 1 + j, L + j))[:, 0]
            logits = model.logits(g)[0]
            if temp is None:
                out.append(int(logits.argmax()))
                continue
            q = (logits / temp).softmax(-1)
            qs.append(q)
            out.append(min(int((q.cumsum(-1) <= u[j] * q.sum()).sum()), len(q) - 1))
    return out, (qs if temp is not None else None)


def test_accepted_draft_of_id_0_is_verified_as_0(tiny_spec):
    """A draft of token id 0 goes into the verify as 0 (only padding, -1, is fed as 0) and counts as drafted: an
    oracle proposing plain decoding's own continuation, which holds id 0 at a draft position, has every draft
    accepted; outputs equal plain decoding and num_accepted_tokens == num_draft_tokens. Prompts: single tokens whose
    greedy bigram walk (bigram_laws) passes through 0."""
    plain = LLM(model=tiny_spec, device="cpu", max_num_seqs=8)
    nxt = bigram_laws(plain).argmax(-1)
    walks = [torch.arange(nxt.shape[0])]
    for _ in range(10):
        walks.append(nxt[walks[-1]])
    walks = torch.stack(walks, 1)
    starts = [s for s in range(1, nxt.shape[0]) if bool((walks[s, 2:10] == 0).any())][:8]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[s] for s in starts]
    truth = {p[0]: o.outputs[0].token_ids for p, o in zip(prompts, plain.generate(prompts, sp))}
    prompts = [p for p in prompts if 0 in truth[p[0]][1:12]]                     # 0 at a draft position
    assert prompts
    spec = LLM(model=tiny_spec, device="cpu", max_num_seqs=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    oracle = OracleProposer(3, truth, spec.cfg.vocab_size, mistakes=False)
    drafted, propose = [], oracle.propose
    oracle.propose = lambda batch: drafted.append(propose(batch)[0]) or (drafted[-1], None)
    spec.engine.runner.proposer = oracle
    outs = spec.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [truth[p[0]] for p in prompts]
    assert any(bool((d == 0).any()) for d in drafted)
    s = spec.engine.stats
    assert s.num_accepted_tokens == s.num_draft_tokens == sum(int((d >= 0).sum()) for d in drafted) > 0


def test_spec_step_hands_q_and_taps_on(tiny_spec):
    """ModelRunner._spec_step hands the proposer's q to the acceptance (probabilistic MTP drafting: the very tensor
    propose returned) and the verify's taps to the proposer's commit (MTP reads none: an empty list, not None)."""
    llm = LLM(model=tiny_spec, device="cpu", speculative_config={
        "method": "mtp", "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"})
    runner = llm.engine.runner
    proposed, accepted, committed = [], [], []
    propose, accept, commit = runner.proposer.propose, runner.accept, runner.proposer.commit
    runner.proposer.propose = lambda batch: proposed.append(propose(batch)) or proposed[-1]
    runner.accept = lambda reqs, logits, drafts, q: accepted.append(q) or accept(reqs, logits, drafts, q)
    runner.proposer.commit = lambda batch, h, taps, *a: committed.append(taps) or commit(batch, h, taps, *a)
    out = llm.generate(SPEC_PROMPTS[:2], SamplingParams(temperature=0.8, max_tokens=8, seed=0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert len(proposed) == len(accepted) == len(committed) > 0
    assert all(q is p[1] and q is not None for q, p in zip(accepted, proposed))
    assert all(taps == [] for taps in committed)


@pytest.mark.parametrize("ckpt,drafting", [("tiny", "probabilistic"), ("tiny_spec", "probabilistic"),
                                           ("tiny_spec", "greedy")])
def test_mtp_chain_equals_step_by_step_reference(ckpt, drafting, request, monkeypatch):
    """MTPProposer's k = 3 drafts (and q, when drafting is probabilistic) at every position == mtp_chain_reference,
    right after the prefill and after each of 4 verify steps (its commit: MTP cache over the accepted tokens, the
    hidden state kept at the last one), three requests with different lengths in one batch, the third greedy
    (temperature 0: probabilistic drafting draws its drafts at temperature 1e-5, the argmax chain). tiny: random
    weights, where positions and fed hidden states move the draft laws a lot; tiny_spec: drafts get accepted.
    The MTP layer in the weights' own fp32 (a CPU drafts in bf16 by default: test_cpu_bf16_mtp_drafts)."""
    monkeypatch.setattr(K, "CPU_DRAFT_DTYPE", None)
    path, k = request.getfixturevalue(ckpt), 3
    llm = LLM(model=path, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": k,
                                                             "draft_sample_method": drafting})
    e, m, runner = llm.engine, llm.model, llm.engine.runner
    prompts = [llm.tokenizer.encode(p) for p in SPEC_PROMPTS[2:5]]
    temps = [0.8, 0.8, 0.0]
    reqs = [e.add_request(p, SamplingParams(temperature=t, max_tokens=30, seed=i, ignore_eos=True))
            for i, (p, t) in enumerate(zip(prompts, temps))]
    e.step()                                                                       # prefills
    accepted = 0
    for _ in range(5):
        running = [r for r in e.slots if r is not None]
        assert len(running) == 3
        saved = [r.gen.get_state() for r in running]
        with torch.inference_mode():
            drafts, q = runner.proposer.propose(runner.batch(running))
        for b, r in enumerate(running):
            u = torch.rand(k, generator=torch.Generator().set_state(saved[b])) if drafting != "greedy" else None
            temp = (temps[b] or 1e-5) if drafting != "greedy" else None
            want, q_ref = mtp_chain_reference(m, r.tokens, k, temp, u)
            assert drafts[b].tolist() == want
            if q_ref is not None:
                assert (q[b] - torch.stack(q_ref)).abs().max() <= 1e-5
        for r, st in zip(running, saved):
            r.gen.set_state(st)                                                    # the step draws them again
        before = e.stats.num_accepted_tokens
        e.step()
        accepted += e.stats.num_accepted_tokens - before
    assert ckpt == "tiny" or accepted >= 3                                         # commits after accepted drafts


@pytest.mark.parametrize("asynchronous", [False, True])
def test_mtp_chain_and_target_attention_reads_are_bounded(tiny_spec, asynchronous, monkeypatch):
    """Every attention call of a speculative run (target prefill / decode / verify, the MTP chain and its commit)
    gets what Ctx promises: kv_len an int with max(pos) + T <= kv_len <= the cache length (the keys it may read).
    Synchronous steps compute it from the host's lengths, asynchronous ones pass the cache length."""
    seen, attention = [], K.attention

    def checked(q, k_cache, v_cache, slots, pos, kv_len, **kw):                   # (kw: the output gate)
        assert isinstance(kv_len, int) and int((pos + q.shape[1]).max()) <= kv_len <= k_cache.shape[1], kv_len
        seen.append(q.shape[1])
        return attention(q, k_cache, v_cache, slots, pos, kv_len, **kw)
    monkeypatch.setattr(K, "attention", checked)
    llm = LLM(model=tiny_spec, device="cpu", async_scheduling=asynchronous,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    out = llm.generate(SPEC_PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 12 for o in out) and llm.engine.stats.num_accepted_tokens > 0
    assert {1, 4} <= set(seen)                                                     # decode-sized and verify calls


def test_proposer_without_an_engine(tiny, monkeypatch):
    """A proposer's whole world is a ProposerIO (the target, its state, device copies, graph calls: here eager) and
    the Batch of each step: no Engine. MTP's chained drafts from its caches == the MTP layer recomputed from scratch
    over the whole sequence for each draft (greedy: the tokens; probabilistic: q); ngram's == prompt lookup over
    each request's tokens. (MTP in fp32, as the recomputation: kernels.CPU_DRAFT_DTYPE None.)"""
    monkeypatch.setattr(K, "CPU_DRAFT_DTYPE", None)
    cpu = torch.device("cpu")
    model, cfg, _ = sd.load_model(tiny, torch.float32, cpu, want_mtp=True)
    state = sd.State(cfg, 2, 64, torch.float32, cpu, mtp=True)
    io = sd.ProposerIO(model, state, num_slots=2, max_model_len=60, dtype=torch.float32, device=cpu,
                       h2d=lambda data, dtype=None: torch.as_tensor(data, dtype=dtype),
                       call=lambda name, fn, kv_len, inputs: fn(kv_len, **inputs))
    k = 3
    greedy, sampled = (sd.MTPProposer(sd.SpeculativeConfig(method="mtp", num_speculative_tokens=k,
                                                           draft_sample_method=m), io)
                       for m in ("greedy", "probabilistic"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (9, 6)]
    ctx = lambda slot, pos, n, mode="prefill": sd.Ctx(state, torch.tensor([slot]), torch.tensor([pos]), n, mode)
    with torch.inference_mode():
        seqs = []
        for slot, p in enumerate(prompts):
            state.reset(slot)
            h = model(torch.tensor([p]), ctx(slot, 0, len(p)))
            t = int(model.logits(h[:, -1]).argmax())                      # the first sampled token, at len(p)
            for prop in (greedy, sampled):
                prop.prefill(types.SimpleNamespace(slot=slot), h, (), torch.tensor([p[1:] + [t]]), 0)
            seqs.append((p, t, h))
        reqs = [types.SimpleNamespace(tokens=p + [t], params=SamplingParams(temperature=0.7),
                                      gen=torch.Generator().manual_seed(i)) for i, (p, t, _) in enumerate(seqs)]
        batch = sd.Batch(reqs, torch.tensor([0, 1]), torch.tensor([len(p) for p in prompts]),
                         torch.tensor([t for _, t, _ in seqs]), host_knows_pos=True)
        for prop in (greedy, sampled):
            drafts, q = prop.propose(batch)
            assert drafts.shape == (2, k) and (q is None) == (prop is greedy)
            for row, (p, t, h) in enumerate(seqs):                        # from scratch, in a fresh slot each time
                hidden, nxt = h, p[1:] + [t]
                for j in range(k):
                    u = model.mtp(model.embed_tokens(torch.tensor([nxt])), hidden, ctx(2, 0, len(nxt), "decode"))
                    logits = model.logits(u[0, -1])                        # [V] at the draft's position
                    if q is None:
                        assert int(drafts[row, j]) == int(logits.argmax())
                    else:
                        assert torch.allclose(q[row, j], (logits / 0.7).softmax(-1), atol=1e-5)
                    hidden, nxt = torch.cat([hidden, u[:, -1:]], 1), nxt + [int(drafts[row, j])]
    ngram = ngram_with_history(io, 3, 1, 2, [[1, 2, 3, 1, 2], [5, 6, 7]])
    d, q = ngram.propose(sd.Batch([None] * 2, torch.tensor([0, 1]), torch.tensor([4, 2]), torch.tensor([2, 7]), True))
    assert d.tolist() == [[3, 1, 2], [-1, -1, -1]] and q is None


def ngram_with_history(io, k, lo, hi, histories):
    """An NgramProposer whose slot i has seen histories[i]: a prompt of all but its last token, prefilled, whose
    first sampled token is the last (as ModelRunner.prefill hands them over)."""
    ngram = sd.NgramProposer(sd.SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=lo,
                                                  prompt_lookup_max=hi), io)
    for slot, toks in enumerate(histories):
        req = types.SimpleNamespace(slot=slot, prompt_ids=toks[:-1])
        ngram.prefill(req, None, (), torch.tensor([toks[1:]], device=io.device), 0)
    return ngram


def eager_io(num_slots, max_model_len, device="cpu"):
    """A ProposerIO with no target: eager calls, plain device copies."""
    device = torch.device(device)
    return sd.ProposerIO(None, None, num_slots=num_slots, max_model_len=max_model_len, dtype=torch.float32,
                         device=device, h2d=lambda data, dtype=None: torch.as_tensor(data, dtype=dtype, device=device),
                         call=lambda name, fn, kv_len, inputs: fn(kv_len, **inputs))


def test_ngram_drafts_stop_at_max_model_len():
    """NgramProposer drafts at most max_model_len - len(tokens) tokens (vLLM: no draft beyond the model's length):
    k = 3, max_model_len 12, a repeating context: 4 short of it 3 drafts, 3 short 3, 2 short 2, 1 short 1, none at
    the length."""
    lengths = (8, 9, 10, 11, 12)
    ngram = ngram_with_history(eager_io(5, 12), 3, 1, 2, [([1, 2, 3, 4] * 3)[:n] for n in lengths])
    d, q = ngram.propose(sd.Batch([None] * 5, torch.arange(5), torch.tensor(lengths) - 1, torch.zeros(5), True))
    assert d.tolist() == [[1, 2, 3], [2, 3, 4], [3, 4, -1], [4, -1, -1], [-1, -1, -1]] and q is None


def check_ngram_device_equals_host(device, rounds, B, lengths, seed=0):
    """ngram on the device == ngram_lookup (the host reference) for B slots with random histories (small
    vocabularies and repeats, so that matches of every length occur), after a prefill and then after random steps
    committed as the engine commits them (the step's tokens, -1 after the emitted ones)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda hi, n=(): torch.randint(0, hi, n, generator=g)
    for _ in range(rounds):
        k, lo = int(rnd(6)) + 1, int(rnd(3)) + 1
        hi = lo + int(rnd(4))
        L = max(lengths) + 40
        hists = []
        for _ in range(B):
            V, n = int(rnd(6)) + 2, lengths[int(rnd(len(lengths)))]
            h = rnd(V, (n,)).tolist()
            if int(rnd(3)) == 0:                                           # a periodic text
                h = (h[:int(rnd(8)) + 1] * n)[:n]
            hists.append(h)
        ngram = ngram_with_history(eager_io(B, L, device), k, lo, hi, hists)
        for step in range(3):
            pos = torch.tensor([len(h) - 1 for h in hists], device=device)
            d, _ = ngram.propose(sd.Batch([None] * B, torch.arange(B, device=device), pos, pos, True))
            for b, h in enumerate(hists):
                want = sd.ngram_lookup(h, min(k, L - len(h)), lo, hi) if L > len(h) else []
                assert d[b].tolist() == want + [-1] * (k - len(want)), (h, k, lo, hi)
            n_acc = rnd(k + 1, (B,))                                         # a step: n accepted + one more token
            tokens = torch.full((B, k + 1), -1)
            for b, h in enumerate(hists):
                new = [h[i % len(h)] if int(rnd(2)) else int(rnd(6)) for i in range(int(n_acc[b]) + 1)]
                tokens[b, :len(new)] = torch.tensor(new)
                h += new
            ngram.commit(sd.Batch([None] * B, torch.arange(B, device=device), pos, pos, True), None, (), None,
                         n_acc.to(device), tokens.to(device))


def test_ngram_device_equals_host():
    check_ngram_device_equals_host("cpu", rounds=60, B=4, lengths=(2, 3, 5, 17, 60))


def test_rollback_equals_token_by_token(tiny):
    """GDN conv/recurrent states after a verify with partial acceptance == decoding the accepted tokens one by one."""
    llm = LLM(model=tiny, device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    m, st = llm.model, llm.engine.runner.state
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 500, (1, 9), generator=g)
    tail = torch.randint(0, 500, (2, 5), generator=g)  # rows 0, 1: [last token, d1..d4]
    n_keep = torch.tensor([3, 1])
    with torch.inference_mode():
        for s in (0, 1):
            st.reset(s)
            m(prompt, sd.Ctx(st, torch.tensor([s]), torch.tensor([0]), 9, "prefill"))
        ctx = sd.Ctx(st, torch.tensor([0, 1]), torch.tensor([9, 9]), 14, "verify")
        m(tail, ctx)
        m.commit(ctx, n_keep)
        spec = {i: (st.conv[i][:2].clone(), st.rec[i][:2].clone()) for i in st.conv}
        for s in (0, 1):
            st.reset(s)
            m(prompt, sd.Ctx(st, torch.tensor([s]), torch.tensor([0]), 9, "prefill"))
            for t in range(int(n_keep[s])):
                m(tail[s:s + 1, t:t + 1], sd.Ctx(st, torch.tensor([s]), torch.tensor([9 + t]), 10 + t, "decode"))
    for i in st.conv:
        assert torch.allclose(spec[i][0], st.conv[i][:2], atol=1e-6)
        assert torch.allclose(spec[i][1], st.rec[i][:2], atol=1e-5)


def test_rejection_sampler_greedy():
    logits = torch.randn(3, 4, 10)
    am = logits.argmax(-1)
    drafts = torch.stack([am[0, :3], torch.tensor([am[1, 0], (am[1, 1] + 1) % 10, am[1, 2]]), torch.tensor([-1, -1, -1])])
    z = torch.zeros(3)
    tok, n = sd.rejection_sample(logits, drafts, None, z, torch.full((3,), -1), torch.ones(3), torch.rand(3, 3), torch.rand(3, 4))
    assert n.tolist() == [3, 1, 0]
    assert tok[0].tolist() == am[0].tolist()                                   # all accepted + bonus
    assert tok[1].tolist() == [am[1, 0], am[1, 1], -1, -1]                     # correction = argmax
    assert tok[2].tolist() == [am[2, 0], -1, -1, -1]
    tok2, n2 = sd.rejection_sample(logits, drafts, None, z, torch.full((3,), -1), torch.ones(3), torch.rand(3, 3),
                                   torch.rand(3, 4), all_greedy=True)  # the host shortcut gives the same
    assert torch.equal(tok2, tok) and torch.equal(n2, n)


def chi2_sf(x, dof):
    """P(X > x) for X ~ chi-square with dof degrees of freedom (the regularised upper incomplete gamma function)."""
    half = lambda v: torch.tensor(v / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(half(dof), half(x)))


def goodness_of_fit(counts, law):
    """Pearson's chi-square p-value of counts [V] (int) against law [V]; a count where law is 0 gives p = 0."""
    counts, law = counts.double(), law.double()
    if counts[law == 0].sum() > 0:
        return 0.0
    m = law > 0
    if int(m.sum()) == 1:
        return 1.0
    expected = counts.sum() * law[m]
    return chi2_sf(float(((counts[m] - expected) ** 2 / expected).sum()), int(m.sum()) - 1)


def target_law(logits, temperature, top_k, top_p):
    """The law a sampled token must follow, written out: logits / temperature, the top_k largest kept (-1: all),
    then the smallest set of the largest probabilities whose mass reaches top_p, renormalised. logits [V]."""
    p = (logits.double() / temperature).softmax(-1)
    order = p.argsort(descending=True).tolist()
    keep = order[:top_k] if top_k > 0 else order
    p = torch.zeros_like(p).index_put_((torch.tensor(keep),), p[keep] / p[keep].sum())
    kept, mass = [], 0.0
    for i in keep:
        if mass >= top_p:
            break
        kept.append(i)
        mass += float(p[i])
    out = torch.zeros_like(p)
    out[kept] = p[kept] / p[kept].sum()
    return out


RS_GROUPS = [(1.0, -1, 1.0), (1.3, 6, 0.95)]  # (temperature, top_k, top_p) of even and odd rows


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("drafting", ["one_hot", "full_q", "one_hot_padded"])
def test_rejection_sampler_distribution_every_position(k, drafting):
    """Lossless sampling, position by position: over the rows whose step reaches position j (n >= j), the token
    emitted there follows the target law p_j, for j = 0..k (j = k: the bonus token). The drafts at positions > j
    and the uniforms of position j are independent of reaching j, so this holds for any q. Drafts: one-hot q (a
    draft per row, draft_probs None: greedy drafting), full q (drafts sampled from q_j, draft_probs = q_j), or
    one-hot with -1 padding after a random number of real drafts (ngram without a long enough match). Also the
    acceptance rate at each position equals its law: sum_x min(p_j, q_j) (full q), E_d min(1, p_j(d)) (one-hot).

    Bounds: every check is a test at false-alarm rate 1e-6 (chi-square p-value; binomial z = 4.9), at most 16 checks
    per case: a correct sampler fails a case with probability < 2e-5. The seed is fixed, so the run is reproducible;
    the rate says what a failure means. Two row groups with different temperature / top-k / top-p, interleaved."""
    g = torch.Generator().manual_seed(k)
    V, N = 8, 240_000
    likely = torch.randint(0, V, (k + 1,), generator=g)                          # a likely token per position, so
    logits = torch.randn(k + 1, V, generator=g) + 2.5 * F.one_hot(likely, V)     # that runs reach position k often
    q_logits = torch.randn(k, V, generator=g) + 2.0 * F.one_hot(likely[:k], V)   # per position: different laws
    if drafting != "full_q":                                                     # one-hot drafts never use the last
        q_logits[:, V - 1] = float("-inf")                                       # id (q's width is V, not max + 1)
    q_law = q_logits.softmax(-1)                                                 # q_j (full) or the draft mix (one-hot)
    drafts = torch.stack([torch.multinomial(q_law[j], N, replacement=True, generator=g) for j in range(k)], 1)
    n_real = torch.full((N,), k)
    if drafting == "one_hot_padded":
        n_real = torch.randint(0, 2 * k + 1, (N,), generator=g).clamp(max=k)      # half the rows: no padding
        drafts[torch.arange(k)[None] >= n_real[:, None]] = -1
    draft_probs = q_law.expand(N, k, V) if drafting == "full_q" else None
    group = torch.arange(N) % 2
    temperature = torch.tensor([RS_GROUPS[i][0] for i in group.tolist()])
    top_k = torch.tensor([RS_GROUPS[i][1] for i in group.tolist()])
    top_p = torch.tensor([RS_GROUPS[i][2] for i in group.tolist()])
    tok, n = sd.rejection_sample(logits.expand(N, k + 1, V).clone(), drafts, draft_probs, temperature, top_k, top_p,
                                 torch.rand(N, k, generator=g), torch.rand(N, k + 1, generator=g))
    assert tok.shape == (N, k + 1) and bool((n >= 0).all()) and bool((n <= n_real).all())
    emitted = torch.arange(k + 1)[None] <= n[:, None]
    assert bool((tok[emitted] >= 0).all()) and bool((tok[emitted] < V).all()) and bool((tok[~emitted] == -1).all())
    assert torch.equal(tok[:, :k][torch.arange(k)[None] < n[:, None]], drafts[torch.arange(k)[None] < n[:, None]])
    z = 4.9                                                                      # two-sided normal 1e-6
    for gi, (temp, tk, tp) in enumerate(RS_GROUPS):
        p = torch.stack([target_law(logits[j], temp, tk, tp) for j in range(k + 1)])
        for j in range(k + 1):
            reach = (group == gi) & (n >= j)
            assert int(reach.sum()) > 2000, (gi, j)
            counts = torch.bincount(tok[reach, j], minlength=V)
            assert goodness_of_fit(counts, p[j]) > 1e-6, (gi, j, counts.tolist(), p[j].tolist())
            if j == k:
                continue
            has = reach & (n_real > j)                                         # a real draft at position j
            if drafting == "full_q":
                rate = float(torch.minimum(p[j], q_law[j].double()).sum())
            else:
                rate = float((q_law[j].double() * p[j].clamp(max=1)).sum())   # p <= 1 already: E_d p_j(d)
            m, acc = int(has.sum()), int((n[has] > j).sum())
            assert abs(acc / m - rate) <= z * math.sqrt(rate * (1 - rate) / m) + 1e-9, (gi, j, acc / m, rate)
            if drafting == "one_hot_padded":
                assert int((n[reach & (n_real == j)] > j).sum()) == 0            # a -1 draft is never accepted


def test_rejection_sampler_edges():
    """Edge cases of the ratio test, each with its reason:
    - u = 0 (torch.rand can return it) never accepts a draft the target gives probability 0 (outside its top-k);
    - p == q with the draft's probability subnormal and u just below 1: u * q(d) rounds to q(d), the draft is rejected
      and max(0, p - q) is all zero: the next token is drawn from p (another row's residual is not);
    - temperature exactly 1e-5 is sampled, not greedy (SamplingParams.greedy is temperature < 1e-5, and plain decoding
      samples it): between two tied top logits the sampled law is 1/2 each, so a draft of the second is accepted;
    - a draft its own law gave probability 0 (q(d) = 0: vLLM rejects it rather than divide by zero) is rejected even
      with u = 0 and p(d) > 0, and the next token comes from max(0, p - q)."""
    V = 6
    logits = torch.tensor([[3.0, 2.5, 1.0, 0.0, -1.0, -2.0]] * 2)[None]          # B = 1, k = 1
    for draft_probs in (None, torch.full((1, 1, V), 1.0 / V)):
        tok, n = sd.rejection_sample(logits, torch.tensor([[4]]), draft_probs, torch.ones(1), torch.tensor([2]),
                                     torch.ones(1), torch.zeros(1, 1), torch.full((1, 2), 0.5))
        assert int(n[0]) == 0 and int(tok[0, 0]) in (0, 1)
    zlog = torch.tensor([[0.0, -100.0, 1.0, 0.5, 0.2, 0.1], [2.0, -1.0, 0.0, 0.0, 0.0, 0.0]])  # row 0: p(1) ~ 4e-44
    zl = zlog[:, None].expand(2, 2, V).clone()                                  # k = 1
    p = sd.target_probs(zl.reshape(-1, V), torch.ones(4), torch.full((4,), -1), torch.ones(4)).view(2, 2, V)
    assert 0 < float(p[0, 0, 1]) < 1e-38                                          # subnormal
    q = p[:, :1].clone()
    q[1, 0] = torch.tensor([0.0, 0.2, 0.2, 0.2, 0.2, 0.2])                        # row 1: residual mass on id 0
    below_one = torch.tensor(1.0).nextafter(torch.tensor(0.0))
    tok, n = sd.rejection_sample(zl, torch.tensor([[1], [3]]), q, torch.ones(2), torch.full((2,), -1), torch.ones(2),
                                 torch.tensor([[below_one], [0.99]]), torch.zeros(2, 2))
    assert n.tolist() == [0, 0] and tok[:, 0].tolist() == [0, 0]                  # the first id with mass, both rows
    tie = torch.tensor([[1.0, 4.0, 0.0, 4.0, 2.0, 0.0]] * 2)[None]
    assert not SamplingParams(temperature=1e-5).greedy
    tok, n = sd.rejection_sample(tie, torch.tensor([[3]]), None, torch.full((1,), 1e-5), torch.full((1,), -1),
                                 torch.ones(1), torch.full((1, 1), 0.25), torch.full((1, 2), 0.5))
    assert int(n[0]) == 1 and int(tok[0, 0]) == 3
    q0 = torch.zeros(1, 1, V)
    q0[0, 0, 0] = 1.0                                                             # q all on id 0; the draft is 2
    tok, n = sd.rejection_sample(logits, torch.tensor([[2]]), q0, torch.ones(1), torch.full((1,), -1), torch.ones(1),
                                 torch.zeros(1, 1), torch.full((1, 2), 0.5))
    assert int(n[0]) == 0 and int(tok[0, 0]) not in (0, -1)                       # p(2) > 0; residual: not id 0


def test_rejection_sampler_stays_on_the_logits_device():
    """Every tensor rejection_sample makes is on the logits' device (the GPU in production): run on the meta device,
    where an operation mixing in a CPU tensor fails. Greedy, sampled with one-hot q, sampled with full q."""
    B, k, V, meta = 3, 2, 7, torch.device("meta")
    args = lambda temp: (torch.randn(B, k + 1, V, device=meta), torch.zeros(B, k, dtype=torch.long, device=meta))
    rest = lambda temp: (torch.full((B,), temp, device=meta), torch.full((B,), -1, device=meta),
                         torch.ones(B, device=meta), torch.rand(B, k, device=meta), torch.rand(B, k + 1, device=meta))
    for temp, q, greedy in ((0.0, None, True), (1.0, None, False), (1.0, torch.rand(B, k, V, device=meta), False)):
        tok, n = sd.rejection_sample(*args(temp), q, *rest(temp), all_greedy=greedy, filtered=False)
        assert tok.device == meta and n.device == meta and tok.shape == (B, k + 1) and n.shape == (B,)


def test_rejection_sampler_mixed_greedy_and_sampled_rows():
    """Greedy rows (temperature 0) in a batch with sampled rows decide exactly as an all-greedy batch does."""
    g = torch.Generator().manual_seed(5)
    B, k, V = 64, 3, 10
    logits = torch.randn(B, k + 1, V, generator=g)
    am = logits.argmax(-1)
    drafts = am[:, :k].clone()
    wrong = torch.randint(0, k + 1, (B,), generator=g)                            # first wrong draft (k: none)
    for b in range(B):
        if wrong[b] < k:
            drafts[b, wrong[b]] = (drafts[b, wrong[b]] + 1) % V
    drafts[::7, 1:] = -1                                                         # some padded rows
    temperature = torch.where(torch.arange(B) % 2 == 0, torch.zeros(B), torch.full((B,), 0.9))
    args = (torch.full((B,), -1), torch.ones(B), torch.rand(B, k, generator=g), torch.rand(B, k + 1, generator=g))
    tok, n = sd.rejection_sample(logits, drafts, None, temperature, *args)
    greedy = torch.arange(0, B, 2)
    tok_g, n_g = sd.rejection_sample(logits[greedy], drafts[greedy], None, torch.zeros(len(greedy)),
                                     *(a[greedy] for a in args), all_greedy=True)
    assert torch.equal(tok[greedy], tok_g) and torch.equal(n[greedy], n_g)
    for i, b in enumerate(greedy.tolist()):                                      # and that is the argmax rule
        real = int((drafts[b] >= 0).sum())
        want = min(int(wrong[b]), real)
        assert int(n_g[i]) == want and tok_g[i, :want + 1].tolist() == am[b, :want + 1].tolist()


# ==============================================================================================
# Logits processors (issue 24): each against a reference written out by hand, per verify position
# ==============================================================================================

cpu_h2d = functools.partial(sd.h2d, torch.device("cpu"))  # process_logits' h2d for host tensors


def processed_reference(logits, prompt, history, p, stop_ids, bad_words):
    """One position's logits after vLLM's processors, token by token in plain Python (history: the tokens
    emitted before this position, i.e. the output so far and the drafts before it). logits: V floats."""
    V, inf = len(logits), float("inf")
    x = [float(v) for v in logits]
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else -inf for t, v in enumerate(x)]
    if len(history) < p.min_tokens:
        x = [-inf if t in stop_ids or t in p.stop_token_ids else v for t, v in enumerate(x)]
    for t in range(V):
        c = history.count(t)
        if t in prompt or c:
            x[t] = min(x[t] / p.repetition_penalty, 1e30) if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    for w in bad_words:
        if len(w) == 1 or (len(history) >= len(w) - 1 and history[len(history) - len(w) + 1:] == w[:-1]):
            x[w[-1]] = -inf
    return x


def processor_rows(rows):
    """(params, prompt, output, bad words' ids) per row -> the row objects process_logits reads."""
    return [types.SimpleNamespace(params=p, prompt_ids=pr, output_ids=out, bad_words_ids=bw) for p, pr, out, bw in rows]


def assert_processed_as_reference(got, logits, rows, drafts, stop_ids):
    for b, (p, prompt, out, bw) in enumerate(rows):
        for i in range(logits.shape[1]):
            history = out + [t for t in drafts[b][:i] if t >= 0]
            want = processed_reference(logits[b, i].tolist(), prompt, history, p, stop_ids, bw)
            torch.testing.assert_close(got[b, i], torch.tensor(want), rtol=1e-6, atol=1e-6, msg=f"row {b} pos {i}")


def test_logits_processors_per_position_match_hand_reference():
    """process_logits on a verify step (k = 3, V = 10) against processed_reference at every position, with
    the history = output + d1..di: repetition (prompt + output), frequency and presence penalties (output
    only), logit_bias, allowed_token_ids, min_tokens masking EOS and stop ids by position, and bad words of
    one and of two tokens (the two-token word is completed by a draft in one row). A -1 draft counts as
    nothing."""
    g = torch.Generator().manual_seed(3)
    V, k = 10, 3
    SP = SamplingParams
    rows = [  # (params, prompt, output, drafts, bad words' ids)
        (SP(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.9), [1, 2], [3, 3, 4],
         [3, 5, 1], []),
        (SP(logit_bias={7: 2.5, 0: -3.0}, min_tokens=5, stop_token_ids=[8]), [4], [1, 2], [9, 7, 2], []),
        (SP(allowed_token_ids=[2, 3, 5, 9], presence_penalty=-0.5), [5], [], [2, -1, -1], []),
        (SP(bad_words=["x"], repetition_penalty=0.8), [6], [2, 6], [4, 5, 6], [[6], [4, 5]]),
        (SP(temperature=0), [0], [1], [2, 3, 4], []),  # no processor: unchanged
    ]
    stop_ids = [9]
    logits = torch.randn(len(rows), k + 1, V, generator=g) * 3
    without_drafts = [(p, pr, out, bw) for p, pr, out, d, bw in rows]
    drafts = [d for _, _, _, d, _ in rows]
    got = sd.process_logits(logits, torch.tensor(drafts), processor_rows(without_drafts), stop_ids, cpu_h2d)
    assert_processed_as_reference(got, logits, without_drafts, drafts, stop_ids)
    inf = float("-inf")
    assert [bool(got[3, i, 5] == inf) for i in range(k + 1)] == [False, True, False, False]  # d1 = 4: bad 5
    assert [bool(got[1, i, 8] == inf) for i in range(k + 1)] == [True, True, True, False]  # output 2 + i < 5
    assert torch.equal(got[4], logits[4])


def test_bad_words_of_three_and_four_tokens_per_position():
    g = torch.Generator().manual_seed(21)
    V, k = 10, 3
    words = [[1, 2, 3], [4, 5, 6, 7]]
    SP = SamplingParams
    rows = [(SP(bad_words=["x"]), [0], [8, 1], words),     # d1 = 2 completes 1 2: position 1 bans 3
            (SP(bad_words=["x"]), [0], [4], words),        # d1 d2 = 5 6 complete 4 5 6: position 2 bans 7
            (SP(bad_words=["x"]), [0], [1, 2], words)]     # position 0 bans 3; d2 d3 = 1 2: position 3 too
    drafts = [[2, 9, 9], [5, 6, 0], [0, 1, 2]]
    logits = torch.randn(len(rows), k + 1, V, generator=g) * 3
    got = sd.process_logits(logits, torch.tensor(drafts), processor_rows(rows), [9], cpu_h2d)
    assert_processed_as_reference(got, logits, rows, drafts, [9])
    banned = {(b, i, t) for b in range(3) for i in range(k + 1) for t in range(V) if got[b, i, t] == float("-inf")}
    assert banned == {(0, 1, 3), (1, 2, 7), (2, 0, 3), (2, 3, 3)}


def test_penalties_count_the_draft_in_a_one_draft_verify():
    g = torch.Generator().manual_seed(22)
    V = 8
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3)
    rows = [(p, [0], [1, 1], []), (p, [0], [2], [])]
    drafts = [[3], [2]]                                  # a new token; the output's token again
    logits = torch.randn(2, 2, V, generator=g) * 2
    got = sd.process_logits(logits, torch.tensor(drafts), processor_rows(rows), [7], cpu_h2d)
    assert_processed_as_reference(got, logits, rows, drafts, [7])


def test_allowed_token_ids_on_every_row():
    g = torch.Generator().manual_seed(23)
    V = 9
    SP = SamplingParams
    rows = [(SP(allowed_token_ids=[1, 4]), [0], [], []), (SP(allowed_token_ids=[0, 2, 3]), [0], [5], [])]
    logits = torch.randn(2, 1, V, generator=g)
    got = sd.process_logits(logits, None, processor_rows(rows), [8], cpu_h2d)
    assert_processed_as_reference(got, logits, rows, [[], []], [8])
    as_bools = [(SP(allowed_token_ids=[False, True]), [0], [], [])]  # ids pass the check as ints (bool is one)
    as_ints = [(SP(allowed_token_ids=[0, 1]), [0], [], [])]
    assert torch.equal(sd.process_logits(logits[:1], None, processor_rows(as_bools), [], cpu_h2d),
                       sd.process_logits(logits[:1], None, processor_rows(as_ints), [], cpu_h2d))


def test_integer_penalties_of_any_size_act_as_their_values():
    g = torch.Generator().manual_seed(24)
    V, k = 8, 2
    rows = [(SamplingParams(repetition_penalty=2 ** 70, frequency_penalty=1, presence_penalty=-2), [1], [2, 2], [])]
    drafts = [[3, 2]]
    logits = torch.randn(1, k + 1, V, generator=g) * 2
    got = sd.process_logits(logits, torch.tensor(drafts), processor_rows(rows), [7], cpu_h2d)
    assert_processed_as_reference(got, logits, rows, drafts, [7])


def test_logits_processors_stay_on_the_logits_device():
    meta = torch.device("meta")
    B, k, V = 2, 2, 11
    SP = SamplingParams
    rows = processor_rows([(SP(logit_bias={3: 1.0}, allowed_token_ids=[1, 3, 5], min_tokens=4,
                               repetition_penalty=1.3, presence_penalty=0.5), [1, 2], [3], [[6]]),
                           (SP(frequency_penalty=0.7, bad_words=["x"]), [4], [5, 5], [[0, 7]])])
    h2d = functools.partial(sd.h2d, meta)
    masks = torch.ones(B, k + 1, V, dtype=torch.bool, device=meta)
    for T, drafts in ((k + 1, torch.zeros(B, k, dtype=torch.long, device=meta)), (1, None)):
        with OneDevice():
            x = sd.process_logits(torch.randn(B, T, V, device=meta), drafts, rows, [9], h2d, masks[:, :T])
        assert x.device == meta and x.shape == (B, T, V)


def test_top_p_drops_a_token_once_the_mass_above_it_reaches_p():
    # equal tokens (sums exact in float): vLLM keeps the fewest tokens whose mass reaches top_p, as target_law
    for V, top_p, n_kept in ((4, 0.5, 2), (4, 0.75, 3), (8, 0.25, 2), (8, 0.5, 4)):
        logits = torch.zeros(1, V)
        got = sd.target_probs(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([top_p]))
        assert int((got[0] > 0).sum()) == n_kept, (V, top_p)
        torch.testing.assert_close(got[0].double(), target_law(logits[0], 1.0, -1, top_p))


def test_a_row_without_filters_keeps_every_token_beside_filtered_rows():
    # a row's law does not depend on its batch mates: with top_k 0 and top_p 1 it is the plain softmax, also when
    # another row's top-k sends the batch through the filters (a float cumsum over 1000 tokens passes 1.0)
    x = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 3
    top_k = torch.zeros(64, dtype=torch.long)
    top_k[-1] = 5
    got = sd.target_probs(x, torch.ones(64), top_k, torch.ones(64))
    assert torch.equal(got[:63], sd.target_probs(x[:63], torch.ones(63), top_k[:63], torch.ones(63)))
    assert bool((got[:63] > 0).all())
    assert int((got[63] > 0).sum()) == 5


def test_min_tokens_must_be_an_integer():
    with pytest.raises(sd.ConfigError, match="min_tokens must be an integer, got 2.5"):
        SamplingParams(min_tokens=2.5)
    assert SamplingParams(min_tokens=3).min_tokens == 3


def test_min_p_and_top_k_zero_filters():
    """target_probs' min_p drops the tokens below min_p x the top probability (after temperature), then top-k
    and top-p apply (vLLM's order); top_k 0 keeps every token, as -1 does."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 12, generator=g) * 2
    temp = torch.tensor([1.0, 0.7, 1.3, 1.0])
    min_p = torch.tensor([0.0, 0.1, 0.3, 0.05])
    top_k = torch.tensor([0, 0, 5, 0])
    got = sd.target_probs(logits, temp, top_k, torch.ones(4), None, min_p)
    for b in range(4):
        p = (logits[b].double() / temp[b]).softmax(-1)
        keep = [t for t in range(12) if p[t] >= min_p[b] * p.max()]
        if top_k[b] > 0:
            keep = sorted(keep, key=lambda t: -p[t])[:int(top_k[b])]
        want = torch.zeros(12, dtype=torch.float64)
        want[keep] = p[keep] / p[keep].sum()
        torch.testing.assert_close(got[b].double(), want, rtol=1e-5, atol=1e-6)
    off = sd.target_probs(logits, temp, torch.zeros(4, dtype=torch.long), torch.ones(4))
    torch.testing.assert_close(off, sd.target_probs(logits, temp, torch.full((4,), -1), torch.ones(4)))


def test_top_k_one_keeps_only_the_argmax():
    g = torch.Generator().manual_seed(25)
    logits = torch.randn(3, 9, generator=g)
    want = F.one_hot(logits.argmax(-1), 9).float()
    for filtered in (None, True):
        got = sd.target_probs(logits, torch.ones(3), torch.ones(3, dtype=torch.long), torch.ones(3), filtered)
        assert torch.equal(got, want), filtered


def test_top_k_off_and_top_p_one_keep_every_token():
    g = torch.Generator().manual_seed(26)
    N, V = 64, 1000
    logits = torch.randn(N, V, generator=g) * 3
    for top_k in (0, -1):
        got = sd.target_probs(logits, torch.ones(N), torch.full((N,), top_k), torch.ones(N))
        assert bool((got > 0).all()), top_k
        torch.testing.assert_close(got.double(), logits.double().softmax(-1), rtol=1e-5, atol=0)


def test_temperature_at_the_greedy_bound_is_sampled_at_it():
    logits = torch.tensor([[0.0, 1e-5, 2e-5, 3e-5, -1e-5]])
    got = sd.target_probs(logits, torch.tensor([1e-5]), torch.zeros(1, dtype=torch.long), torch.ones(1))
    torch.testing.assert_close(got.double(), (logits.double() / 1e-5).softmax(-1), rtol=1e-5, atol=1e-7)


def test_min_p_one_keeps_only_the_most_likely_tokens():
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.0], [3.0, 0.0, 1.0, 2.0, -2.0]])
    got = sd.target_probs(logits, torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2), None,
                          torch.ones(2))
    assert torch.equal(got, torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]]))


def test_target_probs_stays_on_the_logits_device():
    meta = torch.device("meta")
    N, V = 3, 11
    full = lambda v: torch.full((N,), v, device=meta)
    with OneDevice():
        p = sd.target_probs(torch.randn(N, V, device=meta), full(0.8), full(4), full(0.9), True, full(0.1))
    assert p.device == meta and p.shape == (N, V)


def test_sample_from_draws_only_tokens_with_mass():
    probs = torch.tensor([[0.0, 0.0, 0.25, 0.0, 0.75, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    below_one = float(torch.tensor(1.0).nextafter(torch.tensor(0.0)))
    assert sd.sample_from(probs, torch.zeros(2)).tolist() == [2, 1]                # u = 0: the first with mass
    assert sd.sample_from(probs, torch.full((2,), below_one)).tolist() == [4, 1]   # u < 1: the last with mass


def test_sample_from_draws_only_tokens_with_mass_when_the_mass_is_subnormal():
    tiny = torch.tensor(1e-45)                                                     # u x mass rounds to the mass
    assert float(tiny) > 0 and float(tiny * 0.9) == float(tiny)
    probs = torch.zeros(2, 5)
    probs[0, 1], probs[1, 4] = tiny, tiny
    assert sd.sample_from(probs, torch.full((2,), 0.9)).tolist() == [1, 4]
    # subnormal masses spread over several tokens, the last token without mass (a normal mass cannot round up:
    # for u <= 1 - 2^-24, u x mass stays below it in fp32)
    g = torch.Generator().manual_seed(0)
    probs = torch.randint(0, 4, (512, 7), generator=g).float() * float(tiny)
    probs[:, -1] = 0
    probs[:, 0] += float(tiny)                                                     # every row has some mass
    mass, u = probs.sum(-1), torch.rand(512, generator=g)
    assert bool(((u * mass) == mass).any())                                        # the case this test is for
    idx = sd.sample_from(probs, u)
    assert bool((probs.gather(1, idx[:, None]) > 0).all())


def processed_law(logits, prompt, history, p, stop_ids):
    """The law a token must follow at a position with this history: processed_reference, then temperature and
    min_p (drop below min_p x the top probability), renormalised. logits [V] -> [V] float64."""
    x = torch.tensor(processed_reference(logits.tolist(), prompt, history, p, stop_ids, []),
                     dtype=torch.float64)
    law = (x / p.temperature).softmax(-1)
    law[law < p.min_p * law.max()] = 0
    return law / law.sum()


@pytest.mark.parametrize("drafting", ["one_hot", "full_q"])
def test_rejection_sampler_distribution_with_processors(drafting):
    """Lossless sampling with logits processors (repetition, frequency and presence penalties, logit_bias,
    min_p): process_logits then rejection_sample, k = 2. The law at position j depends on the drafts before it
    (they are in the penalties' history), so the check is per draft prefix: over the rows whose step reaches j
    with drafts d1..dj, the token emitted at j follows processed_law(output + d1..dj) - position 0 once,
    position 1 per d1, position 2 (the bonus) per (d1, d2) seen in more than 2000 such rows. Chi-square at
    false-alarm rate 1e-6 each (at most 1 + 8 + 64 checks: a correct sampler fails with probability
    < 1e-4)."""
    g = torch.Generator().manual_seed(11)
    V, k, N = 8, 2, 240_000
    likely = torch.tensor([3, 5, 3])                                              # output [3, 0, 3] repeats 3
    logits = torch.randn(k + 1, V, generator=g) + 2.0 * F.one_hot(likely, V)
    q_logits = torch.randn(k, V, generator=g) + 2.0 * F.one_hot(likely[:k], V)
    q_law = q_logits.softmax(-1)
    drafts = torch.stack([torch.multinomial(q_law[j], N, replacement=True, generator=g) for j in range(k)], 1)
    draft_probs = q_law.expand(N, k, V) if drafting == "full_q" else None
    p = SamplingParams(temperature=0.9, repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.7,
                       min_p=0.05, logit_bias={5: 1.5, 2: -1.0})
    prompt, out, stop_ids = [1, 2], [3, 0, 3], [7]
    row, = processor_rows([(p, prompt, out, [])])
    x = sd.process_logits(logits.expand(N, k + 1, V), drafts, [row] * N, stop_ids, cpu_h2d)
    temp, top_k, top_p = torch.full((N,), p.temperature), torch.zeros(N, dtype=torch.long), torch.ones(N)
    tok, n = sd.rejection_sample(x, drafts, draft_probs, temp, top_k, top_p, torch.rand(N, k, generator=g),
                                 torch.rand(N, k + 1, generator=g), min_p=torch.full((N,), p.min_p))
    checks = 0
    for j in range(k + 1):
        prefixes = {tuple(d) for d in drafts[:, :j].tolist()}
        for prefix in prefixes:
            reach = (n >= j) & (drafts[:, :j] == torch.tensor(prefix, dtype=torch.long)).all(1)
            if int(reach.sum()) <= 2000:
                continue
            law = processed_law(logits[j], prompt, out + list(prefix), p, stop_ids)
            counts = torch.bincount(tok[reach, j], minlength=V)
            assert goodness_of_fit(counts, law) > 1e-6, (j, prefix, counts.tolist(), law.tolist())
            checks += 1
    assert checks >= 5, checks  # position 0, at least 2 values of d1 and 2 prefixes at the bonus


def two_sample_pvalue(xs, ys, min_count=10):
    """Chi-square p-value that two equally large samples of hashable outcomes come from one law; outcomes seen fewer
    than min_count times in both together are pooled into one cell. Statistic sum (a - b)^2 / (a + b)."""
    import collections
    assert len(xs) == len(ys)
    a, b = collections.Counter(xs), collections.Counter(ys)
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= min_count]
    ca = torch.tensor([a[k] for k in keys] + [len(xs) - sum(a[k] for k in keys)], dtype=torch.float64)
    cb = torch.tensor([b[k] for k in keys] + [len(ys) - sum(b[k] for k in keys)], dtype=torch.float64)
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    if len(ca) < 2:
        return 1.0
    return chi2_sf(float(((ca - cb) ** 2 / (ca + cb)).sum()), len(ca) - 1)


SAMPLED_ALPHA = 1e-3  # false-alarm rate of each two-sample check below (seeds are fixed: the run is reproducible)


def test_sampled_distribution_same_with_speculation(tiny_spec):
    """temperature 1, top-p 0.9, MTP k = 2 (drafts accepted, some with the bonus): each of the first 4 generated
    tokens, and the pair of the 2nd and 3rd, follow the same law with and without speculation (two-sample chi-square
    over 300 seeds per prompt, at false-alarm rate SAMPLED_ALPHA per check). Token 0 comes from the prefill in both;
    tokens 1..3 from the first speculative step (token 3: its bonus when both drafts are accepted). The second prompt
    repeats id 1, which follows itself with probability ~0.6 (make_predictable): drafts [1, 1], then a bonus that is
    1 again - the case where drawing the bonus from the residual p - q instead of p would show."""
    kw = dict(temperature=1.0, top_p=0.9, max_tokens=4, ignore_eos=True)
    same_law_with_and_without_mtp(tiny_spec, [kw, kw], min_bonus=50)


def same_law_with_and_without_mtp(tiny_spec, kw, min_bonus):
    """The two prompts ("a b c a b c a b" and [1, 1, 1]), each with 300 seeds and its sampling parameters kw[0] /
    kw[1], without speculation and with MTP k = 2: each of the first 4 tokens, and the pair of the 2nd and 3rd,
    follow the same law (two-sample chi-square, SAMPLED_ALPHA per check); MTP accepted drafts with the bonus at
    least min_bonus times and rejected some."""
    prompts = ["a b c a b c a b", [1, 1, 1]] * 300
    ps = [SamplingParams(seed=i // 2, **kw[i % 2]) for i in range(len(prompts))]
    outs = []
    for cfg in (None, {"method": "mtp", "num_speculative_tokens": 2}):
        llm = LLM(model=tiny_spec, device="cpu", speculative_config=cfg, max_num_seqs=8)
        outs.append([tuple(o.outputs[0].token_ids) for o in llm.generate(prompts, ps)])
    assert all(len(t) == 4 for o in outs for t in o)
    s = llm.engine.stats
    assert s.accepted_per_pos[1] >= min_bonus and s.num_accepted_tokens < s.num_draft_tokens  # bonuses, rejections
    for group in (0, 1):
        a, b = outs[0][group::2], outs[1][group::2]
        for pos in range(4):
            assert two_sample_pvalue([t[pos] for t in a], [t[pos] for t in b]) > SAMPLED_ALPHA, (group, pos)
        assert two_sample_pvalue([t[1:3] for t in a], [t[1:3] for t in b]) > SAMPLED_ALPHA, group


def bigram_laws(llm):
    """The next-token law after each single token [V, V] (one prefill of V one-token rows, temperature 1)."""
    m, V = llm.model, llm.model.cfg.vocab_size
    st = sd.State(m.cfg, V, 2, torch.float32, "cpu")
    with torch.inference_mode():
        h = m(torch.arange(V)[:, None], sd.Ctx(st, torch.arange(V), torch.zeros(V, dtype=torch.long), 1, "prefill"))
        return m.logits(h[:, 0]).softmax(-1)


def test_sampled_ngram_with_padding_rows(tiny_spec):
    """Sampling with ngram: rows with drafts beside rows whose lookup found nothing (all -1: padding) in one verify.
    No -1 is ever emitted, and each of the first 3 tokens keeps its law (two-sample chi-square against speculation
    off, false-alarm rate SAMPLED_ALPHA per check). The no-match prompt is the token y whose likely next token a is
    likely followed by id 0 (a padding draft is fed to the target as 0: accepting it would emit -1 there); the match
    prompt is the likeliest 17-token greedy walk of the bigram laws, which cycles."""
    plain = LLM(model=tiny_spec, device="cpu", max_num_seqs=8)
    P = bigram_laws(plain)
    via = P * P[:, 0][None]                                                      # [y, a]: y -> a -> 0
    via.fill_diagonal_(0)                                                        # a == y would be a match
    y = int(via.sum(-1).argmax())
    assert float(via[y].sum()) > 0.3
    walks = [torch.arange(P.shape[0])]                                           # from every id, 16 likeliest steps
    for _ in range(16):
        walks.append(P[walks[-1]].argmax(-1))
    walks = torch.stack(walks, 1)                                                # [V, 17]: they enter a cycle
    odds = P[walks[:, :-1], walks[:, 1:]].log().sum(-1)
    walk = walks[int(odds.argmax())].tolist()                                    # a repeating text: ngram drafts
    assert len(set(walk)) < 10
    prompts = [[y], walk] * 300                                                  # no match / a match, interleaved
    ps = [SamplingParams(temperature=1.0, max_tokens=3, seed=i // 2, ignore_eos=True) for i in range(len(prompts))]
    spec = LLM(model=tiny_spec, device="cpu", max_num_seqs=8, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    verified = []
    propose = spec.engine.runner.proposer.propose
    spec.engine.runner.proposer.propose = lambda batch: verified.append(propose(batch)) or verified[-1]
    outs = [[tuple(o.outputs[0].token_ids) for o in llm.generate(prompts, ps)] for llm in (plain, spec)]
    assert all(min(t) >= 0 and len(t) == 3 for o in outs for t in o)
    padded = [bool(((d < 0).all(1)).any() and (d >= 0).any(1).any()) for d, _ in verified]
    assert sum(padded) >= 20                                                     # verifies mixing both kinds of row
    assert spec.engine.stats.num_accepted_tokens > 0
    for group in (0, 1):
        for pos in range(3):
            a, b = ([t[pos] for t in o[group::2]] for o in outs)
            assert two_sample_pvalue(a, b) > SAMPLED_ALPHA, (group, pos)


# -- Logits processors end to end: lossless with every method, n and best_of (issue 24) --------------------

JSON_SCHEMA = {"type": "object", "required": ["ok", "kind", "tags"], "additionalProperties": False,
               "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "bb", "ccc"]},
                              "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}}}


def check_schema(text):
    """The text is one JSON object that JSON_SCHEMA accepts (its rules written out)."""
    obj = json.loads(text)
    assert set(obj) == {"ok", "kind", "tags"} and isinstance(obj["ok"], bool), obj
    assert obj["kind"] in ("a", "bb", "ccc") and len(obj["tags"]) <= 3 and set(obj["tags"]) <= {"x", "y"}, obj


def processed_params(eos):
    """A batch mixing rows with and without processors, greedy (one per PROCESSED_PROMPTS). Rows 0 and 3 have
    negative penalties, so the output repeats tokens inside a verify window (a penalty that missed the drafts
    before its position would change the argmax there: measured with mtp and draft_model). Row 1 biases EOS up
    so much that it is the argmax everywhere: min_tokens alone holds it back until output token 24."""
    return [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=-1.5,
                           frequency_penalty=-0.5),
            SamplingParams(temperature=0, max_tokens=30, min_tokens=24, logit_bias={eos: 60.0, 5: -50.0}),
            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logit_bias={10: 2.0},
                           bad_words=["import"], repetition_penalty=0.7),
            SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": JSON_SCHEMA,
                                                                             "disable_any_whitespace": True})]


PROCESSED_PROMPTS = SPEC_PROMPTS[:4] + ['{"ok":true,"kind":"bb","tags":["x"]}\n{"ok":false,"kind":"a",'
                                       '"tags":[]}\n']


@pytest.fixture(scope="module")
def processed_off(tiny_spec):
    llm = LLM(model=tiny_spec, device="cpu")
    params = processed_params(llm.tokenizer.eos_token_id)
    return params, [o.outputs[0] for o in llm.generate(PROCESSED_PROMPTS, params)]


@pytest.mark.parametrize("method", ["mtp", "ngram", "draft_model"])
def test_greedy_spec_equals_plain_with_processors(method, tiny_spec, processed_off):
    """Greedy speculation (k = 3) equals speculation off with penalties, min_tokens, logit_bias, bad words and
    a JSON-schema constraint, in one batch with a plain row: every processor sees at verify position i the
    output followed by d1..di, and the grammar masks each position and rejects the drafts it forbids.
    draft_model: the target as its own draft. The constrained output is a JSON object its schema accepts,
    ended by EOS."""
    cfg = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        cfg.update(prompt_lookup_min=1, prompt_lookup_max=3)
    if method == "draft_model":
        cfg["model"] = tiny_spec
    llm = LLM(model=tiny_spec, device="cpu", speculative_config=cfg)
    params, ref = processed_off
    res = llm.generate(PROCESSED_PROMPTS, params)
    outs = [o.outputs[0] for o in res]
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.token_ids == r.token_ids, (i, o.text, r.text)
    assert len(outs[1].token_ids) == 25 and outs[1].finish_reason == "stop"  # 24 held back, then EOS
    assert outs[4].finish_reason == "stop", outs[4].text
    check_schema(outs[4].text)
    s = llm.engine.stats
    assert s.num_accepted_tokens >= 20, s.summary()  # drafts were accepted inside processed steps
    model_drafts = res[:2] if method != "ngram" else []  # (ngram finds nothing to look up in rows 0 and 1)
    assert all(r.metrics["num_accepted_tokens"] > 0 for r in model_drafts + [res[3]])  # processed rows accept
    if method == "ngram":  # its drafts come from the JSON in the prompt: some pass the grammar, accepted
        assert res[4].metrics["num_accepted_tokens"] > 0


def test_sampled_distribution_with_processors_same_with_speculation(tiny_spec):
    """Sampling with processors (presence, frequency and repetition penalties, min_p, logit_bias, top_k 20)
    keeps its law under MTP k = 2: each of the first 4 tokens, and the pair of the 2nd and 3rd, follow the
    same law with and without speculation (two-sample chi-square over 300 seeds per prompt, SAMPLED_ALPHA per
    check). Negative penalties on one prompt (repeats: drafts accepted with the bonus); a strong frequency
    penalty on the other ([1, 1, 1], where 1 follows itself). This checks the engine's wiring end to end (a
    verify that skipped the processors fails it); the law per draft prefix is
    test_rejection_sampler_distribution_with_processors'."""
    base = dict(temperature=1.0, max_tokens=4, ignore_eos=True)
    kw = [dict(base, presence_penalty=-0.5, frequency_penalty=-0.3, repetition_penalty=0.9, min_p=0.02),
          dict(base, presence_penalty=0.3, frequency_penalty=1.5, repetition_penalty=1.2, min_p=0.05,
               logit_bias={2: 1.0, 7: -2.0}, top_k=20)]
    same_law_with_and_without_mtp(tiny_spec, kw, min_bonus=30)


def test_n_samples_and_best_of(tiny_spec):
    """n = 4 gives 4 outputs (index 0..3) whose seeded results are reproducible and are the requests seeded
    seed + i; best_of = 4, n = 2 gives the 2 of those 4 with the highest cumulative logprob (the sum of each
    emitted token's logprob, which logprobs=0 reports), best first. With MTP k = 2 (one engine throughout: the
    seeded tokens are reproducible on it). Greedy n > 1 and best_of < n are refused, as in vLLM."""
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    llm = LLM(model=tiny_spec, device="cpu", speculative_config=mtp)
    sp = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    first = llm.generate("a b c a b", sp)[0]
    again = llm.generate("a b c a b", sp)[0]
    assert len(first.outputs) == 4 and [o.index for o in first.outputs] == [0, 1, 2, 3]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1  # independent samples, not one copied
    one = lambda **kw: llm.generate("a b c a b", dataclasses.replace(sp, n=1, **kw))[0].outputs[0]
    single = [one(seed=7 + i) for i in range(4)]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in single]
    scored = [one(seed=7 + i, logprobs=0) for i in range(4)]
    cums = [sum(d[t].logprob for d, t in zip(o.logprobs, o.token_ids)) for o in scored]
    best = llm.generate("a b c a b", dataclasses.replace(sp, n=2, best_of=4))[0].outputs
    order = sorted(range(4), key=lambda i: -cums[i])[:2]
    assert [o.token_ids for o in best] == [scored[i].token_ids for i in order]
    assert [o.cumulative_logprob for o in best] == pytest.approx([cums[i] for i in order], abs=1e-4)
    with pytest.raises(ConfigError, match="n must be 1 when using greedy sampling, got 4"):
        SamplingParams(n=4, temperature=0)
    with pytest.raises(ConfigError, match="best_of must be greater than or equal to n"):
        SamplingParams(n=4, best_of=2)


def test_min_tokens_stop_strings_and_special_tokens(tiny_spec):
    """The text side of the new fields, with the answer forced by logit_bias (greedy): a stop string is not
    looked for before min_tokens tokens (vLLM), and then cuts the text at its first occurrence in the new
    text's window, keeping it with include_stop_str_in_output; skip_special_tokens=False keeps an added
    special token's text, which the default drops; min_tokens holds back an EOS that logit_bias makes the
    argmax."""
    llm = LLM(model=tiny_spec, device="cpu")
    tok = llm.tokenizer
    x, im_start, eos = tok.encode("x")[0], tok.id_of("<|im_start|>"), tok.eos_token_id
    forced = lambda t, **kw: llm.generate("hello", SamplingParams(temperature=0, logit_bias={t: 100.0}, **kw))[0]
    o = forced(x, max_tokens=10, stop=["xx"]).outputs[0]
    assert (o.token_ids, o.text, o.finish_reason, o.stop_reason) == ([x, x], "", "stop", "xx")
    o = forced(x, max_tokens=10, stop=["xx"], min_tokens=5).outputs[0]
    assert (len(o.token_ids), o.text, o.finish_reason) == (6, "xxxx", "stop")
    o = forced(x, max_tokens=10, stop=["xx"], min_tokens=5, include_stop_str_in_output=True).outputs[0]
    assert (len(o.token_ids), o.text) == (6, "xxxxxx")
    assert forced(im_start, max_tokens=3).outputs[0].text == ""
    assert forced(im_start, max_tokens=3, skip_special_tokens=False).outputs[0].text == "<|im_start|>" * 3
    o = forced(eos, max_tokens=10, min_tokens=3).outputs[0]
    assert len(o.token_ids) == 4 and eos not in o.token_ids[:3] and o.token_ids[3] == eos
    assert o.finish_reason == "stop"


@pytest.mark.parametrize("method", ["mtp", "ngram", "draft_model", "dflash"])
def test_n_samples_share_the_prefill(method, tiny_spec, ckpts, monkeypatch):
    """n = 4 prefills the prompt once: the others copy the slot (the target's KV and GDN states, the proposer's
    caches; MTP redoes its last prompt position with each sample's own first token). Each sample equals the
    request seeded seed + i prefilled alone, token for token, with sampled drafts accepted and rejected, so a
    copy that missed any state would show. With max_num_seqs 2 only one sibling holds a slot when the prompt
    is done: the others are prefilled alone, with the same result."""
    target = ckpts["target"] if method == "dflash" else tiny_spec
    cfg = {"method": method, "num_speculative_tokens": 3}
    cfg.update({"ngram": dict(prompt_lookup_min=1, prompt_lookup_max=3), "draft_model": dict(model=target),
                "dflash": dict(model=ckpts["dflash"])}.get(method, {}))
    prompt = [1, 1, 1]  # 1 follows itself often (make_predictable): every method's drafts are accepted
    sp = SamplingParams(n=4, temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)  # first tokens differ
    for max_num_seqs, prefills_wanted in ((8, 1), (2, 3)):
        llm = LLM(model=target, device="cpu", speculative_config=cfg, max_num_seqs=max_num_seqs)
        alone = [llm.generate(prompt, dataclasses.replace(sp, n=1, seed=5 + i))[0].outputs[0].token_ids
                 for i in range(4)]
        prefills = []
        real = sd.ModelRunner.prefill
        monkeypatch.setattr(sd.ModelRunner, "prefill", lambda self, req, *a: prefills.append(req) or
                            real(self, req, *a))
        out = llm.generate(prompt, sp)[0]
        monkeypatch.undo()
        assert [o.token_ids for o in out.outputs] == alone, max_num_seqs
        assert len({r.id for r in prefills}) == prefills_wanted
        assert out.metrics["num_accepted_tokens"] > 0
        assert len({o.token_ids[0] for o in out.outputs}) > 1  # so a fork that kept the first's token would show


# ==============================================================================================
# GGUF targets
# ==============================================================================================

def gguf_from_checkpoint(path, out, ftype, with_mtp=True):
    from safetensors.torch import load_file
    with open(os.path.join(path, "config.json")) as fh:
        top = json.load(fh)
    w = load_file(os.path.join(path, "model.safetensors"))
    write_gguf(top.get("text_config", top), w, out, ftype, os.path.join(path, "tokenizer.json"), with_mtp)
    return out


@needs_gguf
@pytest.mark.parametrize("ftype,bound", [("F32", 1e-4), ("BF16", 1e-2), ("Q8_0", 3e-2)])
@pytest.mark.parametrize("moe", [False, True])
def test_gguf_logits_equal_safetensors(ftype, bound, moe, tiny, tiny_moe, tmp_path):
    """Same logits as the safetensors load: max abs difference <= 1e-4 in F32 (it is exact); for BF16 and Q8_0
    the bound is on the relative error ||ours - ref|| / ||ref||: bf16 rounds each weight by <= 2^-9 relative and
    Q8_0 by <= (block max)/254, compounded over the layers: 1e-2 and 3e-2 (measured 0.007 and 0.023)."""
    src = tiny_moe if moe else tiny
    f = gguf_from_checkpoint(src, str(tmp_path / f"m-{ftype}.gguf"), ftype)
    a, b = LLM(model=src, device="cpu"), LLM(model=f, device="cpu")
    ids = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = our_logits(a, ids, "prefill")
    out = our_logits(b, ids, "prefill")
    err = (out - ref).abs().max().item() if ftype == "F32" else ((out - ref).norm() / ref.norm()).item()
    assert err <= bound, err
    assert b.tokenizer.encode("def f(x):\n  return 'é'") == a.tokenizer.encode("def f(x):\n  return 'é'")


@needs_gguf
def test_gguf_mtp_greedy_lossless_and_refusals(tiny_spec, tmp_path):
    f = gguf_from_checkpoint(tiny_spec, str(tmp_path / "m.gguf"), "F32")
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(model=f, device="cpu").generate(["a b c a b"], sp)[0].outputs[0].token_ids
    spec = LLM(model=f, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert spec.generate(["a b c a b"], sp)[0].outputs[0].token_ids == ref
    assert_multi_token(spec.engine.stats, 2, 2.0)                                # the GGUF's MTP block drafts
    nomtp = gguf_from_checkpoint(tiny_spec, str(tmp_path / "nomtp.gguf"), "F32", with_mtp=False)
    with pytest.raises(ConfigError, match="no MTP block"):
        LLM(model=nomtp, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ConfigError, match="'dspark' is refused for a GGUF target"):
        LLM(model=f, device="cpu",
            speculative_config={"method": "dspark", "model": tiny_spec, "num_speculative_tokens": 7})


# ==============================================================================================
# FP8 weights: Qwen's block-FP8 checkpoints as they are, and --quantization fp8
# ==============================================================================================

# The linears Qwen's FP8 files quantize (attention, GDN in_proj_qkv / in_proj_z / out_proj, MLP, shared expert,
# routed experts per expert or fused, the MTP layer's); the rest stays unquantized (pitfalls.md §1)
FP8_TENSOR = re.compile(r".*\.((q|k|v|o|gate|up|down)_proj|in_proj_(qkv|z)|out_proj)\.weight"
                        r"|.*\.experts\.(gate_up|down)_proj")
FP8_BLOCKS = dict(head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32, moe_intermediate_size=128,
                  shared_expert_intermediate_size=128)  # sizes whose FP8 projections fill whole 128-row blocks


def read_tensors(path):
    from safetensors.torch import load_file
    return {k: v for f in sorted(os.listdir(path)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(path, f)).items()}


def rewrite(src, dst, tensors, quant, shards=1):
    """A copy of checkpoint src (config, tokenizer) with these tensors and quantization_config (None: none)."""
    import shutil
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_tensors(dst, tensors, shards)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg.pop("quantization_config", None)
    if quant is not None:
        cfg["quantization_config"] = quant
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    return dst


def to_fp8(src, dst, scale_dtype=torch.bfloat16, shards=1, keep=()):
    """Checkpoint src in Qwen's published FP8 layout: FP8_TENSOR as e4m3 + weight_scale_inv by K.fp8_quantize
    (scales in scale_dtype: bf16 as Qwen's files, fp32 as some exports; a fused gate_up_proj by halves, gate's
    block rows then up's), the rest as it was; quantization_config with the per-layer modules_to_not_convert of
    what stays unquantized. It lists `layers.i.mlp.gate` next to FP8 `layers.i.mlp.gate_proj` (the router's name:
    the 35B's lists have it; dense layers get it too), which a substring match takes for gate_proj. `keep`: more
    entries for the list."""
    out, listed = {}, set(keep)
    for n, t in read_tensors(src).items():
        if not FP8_TENSOR.fullmatch(n):
            out[n] = t
            listed.add(n.removesuffix(".weight"))
            continue
        halves = t.chunk(2, -2) if n.endswith("gate_up_proj") else [t]
        qs = [K.fp8_quantize(h) for h in halves]
        out[n] = torch.cat([q for q, _ in qs], -2)
        out[n + "_scale_inv"] = torch.cat([s for _, s in qs], -2).to(scale_dtype)
        if n.endswith("mlp.gate_proj.weight"):
            listed.add(n.replace("gate_proj.weight", "gate"))
    quant = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
             "modules_to_not_convert": sorted(listed)}
    return rewrite(src, dst, out, quant, shards)


def blockwise(q, s):
    """q [..., N, K] e4m3 times the scale of its 128 x 128 block, s [..., ceil(N/128), ceil(K/128)]: fp32, exact."""
    N, Kd = q.shape[-2:]
    return q.float() * s.float().repeat_interleave(128, -2)[..., :N, :].repeat_interleave(128, -1)[..., :Kd]


def dequantized(fp8, dst):
    """The unquantized model an FP8 checkpoint stands for: each e4m3 weight times the scale of its block (a fused
    gate_up_proj by halves), no scales, no quantization_config."""
    w = read_tensors(fp8)
    out = {}
    for n, t in w.items():
        if n.endswith("_scale_inv"):
            continue
        if t.dtype != torch.float8_e4m3fn:
            out[n] = t
            continue
        halves = 2 if n.endswith("gate_up_proj") else 1
        parts = zip(t.chunk(halves, -2), w[n + "_scale_inv"].chunk(halves, -2))
        out[n] = torch.cat([blockwise(q, s) for q, s in parts], -2)
    return rewrite(fp8, dst, out, None)


FP8_KINDS = ["dense", "dense-blocks-text-sharded", "moe-per-expert", "moe-blocks-fp32-scales"]
FUSED = ("in_proj", "in_proj_qkvz", "in_proj_ba", "qkv", "gate_up", "router_shared", "router_gate")


def unfuse(model):
    """Undo fuse_projections: the projections' own weights (views of the fused ones) are used again."""
    for m in model.modules():
        for attr in FUSED:
            if hasattr(m, attr):
                delattr(m, attr)
                delattr(m, attr + "_scale")
    return model


@pytest.mark.parametrize("kind", FP8_KINDS)
def test_fp8_checkpoint_logits_equal_dequantized(kind, tmp_path):
    """A checkpoint in Qwen's FP8 layout (to_fp8) loads as FP8 and computes what the unquantized model of its
    dequantized weights computes (fp32 math): max abs logit difference <= 1e-5, prefill and decode (measured 0:
    the same GEMMs). Compared unfused: each model fuses what its kinds allow (FP8: qkv | z and b | a apart, ...),
    and other GEMM widths round differently on the CPU (measured 1e-5 to 2.5e-5 on logits up to ~10). Fused,
    the FP8 model gives its unfused logits to fp32 rounding (<= 1e-5 x the largest). "blocks": sizes where every
    FP8 projection fuses (GDN qkv | z, attention q | k | v, MLP and shared-expert gate | up), else some stay
    apart."""
    moe, blocks = kind.startswith("moe"), "blocks" in kind
    src = write_tiny_checkpoint(str(tmp_path / "src"), moe=moe, wrapper="text" not in kind, seed=4,
                                per_expert="per-expert" in kind, sizes=FP8_BLOCKS if blocks else None)
    scale = torch.float32 if "fp32" in kind else torch.bfloat16
    fp8 = to_fp8(src, str(tmp_path / "fp8"), scale, shards=2 if "sharded" in kind else 1)
    llm, ref = LLM(model=fp8, device="cpu"), LLM(model=dequantized(fp8, str(tmp_path / "deq")), device="cpu")
    m = llm.model
    gdn, attn, mlp = m.layers[0].linear_attn, m.layers[3].self_attn, m.layers[0].mlp
    assert gdn.in_proj_qkv.weight.dtype == sd.FP8 and gdn.in_proj_qkv.weight_scale_inv.dtype == torch.float32
    assert gdn.in_proj_a.weight.dtype == torch.float32 and hasattr(gdn, "in_proj_ba")  # kept, and fused apart
    assert m.mtp.layers[0].self_attn.o_proj.weight.dtype == sd.FP8 and m.mtp.fc.weight.dtype == torch.float32
    if moe:
        assert mlp.experts.gate_up_proj.dtype == sd.FP8 and mlp.gate.weight.dtype == torch.float32
        assert mlp.shared_expert.gate_proj.weight.dtype == sd.FP8 and hasattr(mlp, "router_gate")
    assert blocks == hasattr(gdn, "in_proj_qkvz") == hasattr(attn, "qkv")
    assert hasattr(mlp.shared_expert if moe else mlp, "gate_up") == (blocks or not moe)  # moe: I = 32 < a block
    ids = torch.randint(0, llm.cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    fused = {mode: our_logits(llm, ids, mode) for mode in ("prefill", "decode")}
    unfuse(llm.model)
    unfuse(ref.model)
    for mode in ("prefill", "decode"):
        ours = our_logits(llm, ids, mode)
        assert (ours - our_logits(ref, ids, mode)).abs().max() <= 1e-5, mode
        assert (fused[mode] - ours).abs().max() <= 1e-5 * ours.abs().max(), mode


@pytest.fixture(scope="module")
def fp8_target(ckpts, tmp_path_factory):
    """ckpts' target (make_predictable) in the FP8 layout: the drafters built for it (same embeddings, lm_head and
    final norm, which stay unquantized) draft for it too; and its spec-off greedy outputs."""
    d = tmp_path_factory.mktemp("fp8")
    fp8 = to_fp8(ckpts["target"], str(d / "fp8"))
    ref = LLM(model=fp8, device="cpu").generate(SPEC_PROMPTS[:3], GREEDY)
    return fp8, [o.outputs[0].token_ids for o in ref]


FP8_SPEC = {"mtp": (None, {"method": "mtp", "num_speculative_tokens": 3}),
            "ngram": (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
            "draft_model": ("qwen3_draft", {"method": "draft_model", "num_speculative_tokens": 3}),
            "draft_hybrid": ("hybrid_draft", {"method": "draft_model", "num_speculative_tokens": 2}),
            "dflash": ("dflash", {"method": "dflash", "num_speculative_tokens": 3}),
            "dspark": ("dspark", {"method": "dspark", "num_speculative_tokens": 4})}


@pytest.mark.parametrize("name", list(FP8_SPEC))
def test_fp8_greedy_spec_equals_plain(name, ckpts, fp8_target):
    """Greedy speculation on an FP8 target (its MTP head FP8 too) gives exactly its output without speculation,
    batch 1 and a batch of 3 prompts, every method; and drafts get accepted (multi-token steps)."""
    fp8, ref = fp8_target
    key, cfg = FP8_SPEC[name]
    llm = LLM(model=fp8, device="cpu", speculative_config={**cfg, "model": ckpts[key]} if key else cfg)
    assert llm.generate(SPEC_PROMPTS[:1], GREEDY)[0].outputs[0].token_ids == ref[0]
    assert [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS[:3], GREEDY)] == ref
    assert llm.engine.stats.mean_acceptance_length >= 1.5, llm.engine.stats


def test_fp8_mtp_head_drafts_as_dequantized(fp8_target, tmp_path):
    """The FP8 MTP layer drafts what its dequantized weights draft: the same tokens accepted at each position."""
    fp8, _ = fp8_target
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    runs = []
    for path in (fp8, dequantized(fp8, str(tmp_path / "deq"))):
        llm = LLM(model=path, device="cpu", speculative_config=spec)
        if path != fp8:  # both pick drafts from the same FP8 copy of the (unquantized) lm_head
            m = llm.model
            m.draft_head = sd.fp8_head(m)
        out = llm.generate(SPEC_PROMPTS[:2], GREEDY)
        runs.append(([o.outputs[0].token_ids for o in out], llm.engine.stats.accepted_per_pos))
    assert runs[0] == runs[1] and runs[0][1][1] > 0


def test_fp8_target_drafts_from_an_fp8_lm_head(fp8_target, tiny):
    """An FP8 target's drafts are picked from its lm_head quantized block-wise (draft_logits), made in pieces of
    whole blocks (the same bits as at once) when a method drafts through the target's lm_head; the verify's
    logits stay the unquantized lm_head's. An unquantized target, or no speculation, keeps no copy."""
    llm = LLM(model=fp8_target[0], device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    m = llm.model
    w = (m.embed_tokens if m.lm_head is None else m.lm_head).weight
    q, s = m.draft_head
    assert q.dtype == sd.FP8 and q.shape == w.shape and w.dtype == torch.float32
    whole = K.fp8_quantize(w)
    assert torch.equal(q.float(), whole[0].float()) and torch.equal(s, whole[1])
    part = types.SimpleNamespace(lm_head=types.SimpleNamespace(weight=w[:300]))
    small, at_once = sd.fp8_head(part, rows=128), K.fp8_quantize(w[:300])
    assert torch.equal(small[0].float(), at_once[0].float()) and torch.equal(small[1], at_once[1])
    h = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(0))
    want = h.double() @ K.fp8_dequantize_ref(*whole).double().T
    assert (m.draft_logits(h).double() - want).abs().max() <= 1e-4 * want.abs().max()
    assert not torch.equal(m.draft_logits(h), m.logits(h))                # the verify's: the fp32 lm_head
    assert (m.logits(h).double() - h.double() @ w.double().T).abs().max() <= 1e-4 * want.abs().max()
    assert LLM(model=fp8_target[0], device="cpu").model.draft_head is None
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    assert LLM(model=fp8_target[0], device="cpu", speculative_config=spec).model.draft_head is None
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    assert LLM(model=tiny, device="cpu", speculative_config=spec).model.draft_head is None


def test_drafts_through_target_head(tmp_path):
    """Which drafts read the target's lm_head (and so, on an FP8 target, its FP8 copy): MTP's, and a DFlash /
    DSpark drafter's without an lm_head of its own; not ngram's, draft_model's, or a drafter that ships one."""
    from safetensors.torch import save_file
    own, none = tmp_path / "own", tmp_path / "none"
    for d, names in ((own, ["fc.weight", "lm_head.weight"]), (none, ["fc.weight"])):
        d.mkdir()
        save_file({n: torch.zeros(2, 2) for n in names}, str(d / "model.safetensors"))
    spec = lambda method, model=None: types.SimpleNamespace(method=method, model=model)  # noqa: E731
    assert sd.drafts_through_target_head(spec("mtp")) and not sd.drafts_through_target_head(None)
    assert not sd.drafts_through_target_head(spec("ngram"))
    assert not sd.drafts_through_target_head(spec("draft_model", str(none)))
    for method in ("dflash", "dspark"):
        assert sd.drafts_through_target_head(spec(method, str(none)))
        assert not sd.drafts_through_target_head(spec(method, str(own)))


def test_fp8_target_with_a_missing_drafter_is_refused(fp8_target, tmp_path):
    """An FP8 target (which asks whether the drafter ships an lm_head) with a drafter path that holds no
    checkpoint: the drafter's own one-line error, not a traceback from reading its tensors."""
    spec = {"method": "dflash", "model": str(tmp_path / "missing"), "num_speculative_tokens": 3}
    with pytest.raises(sd.ConfigError, match="no config.json"):
        LLM(model=fp8_target[0], device="cpu", speculative_config=spec)


@pytest.mark.parametrize("moe", [False, True])
def test_quantization_fp8_at_load_equals_fp8_checkpoint(moe, tmp_path):
    """--quantization fp8 on an unquantized checkpoint is the FP8 checkpoint K.fp8_quantize makes of the same
    weights (fp32 scales: as they are in memory): the same logits, bit for bit; the same flag on that FP8
    checkpoint changes nothing. The KV caches and GDN states stay in the model dtype."""
    src = write_tiny_checkpoint(str(tmp_path / "src"), moe=moe, sizes=FP8_BLOCKS if moe else None, seed=6)
    fp8 = to_fp8(src, str(tmp_path / "fp8"), torch.float32)
    llms = [LLM(model=src, device="cpu", quantization="fp8"), LLM(model=fp8, device="cpu"),
            LLM(model=fp8, device="cpu", quantization="fp8")]
    ids = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = [our_logits(llm, ids, "prefill") for llm in llms]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    m, st = llms[0].model, llms[0].engine.runner.state
    assert m.layers[0].linear_attn.out_proj.weight.dtype == sd.FP8 and m.embed_tokens.weight.dtype == torch.float32
    assert st.kv[3][0].dtype == st.conv[0].dtype == torch.float32 and st.rec[0].dtype == torch.float32


@pytest.mark.parametrize("kind", ["dense", "moe", "moe-fp8"])
def test_bench_make_cyclic(kind, monkeypatch):
    """bench.make_cyclic (bench.py --cyclic, the ngram rows of tools/gpu_benchmarks.sh): greedy text continues the
    cycle of its prompt, which is what lets ngram find drafts on random weights; on a MoE only once its routed
    experts' down projections are scaled too, and with FP8 weights by their block scales."""
    cfg = dict(tiny_text_config(moe=kind != "dense"), vocab_size=512)
    monkeypatch.setitem(bench.PRESETS, "tiny-cyc", cfg)
    model, c = bench.random_model("tiny-cyc", torch.float32, torch.device("cpu"),
                                  quantization="fp8" if "fp8" in kind else None)
    with torch.no_grad():  # routed experts whose outputs outweigh the embeddings, as at the real shapes
        for name, p in model.named_parameters():
            if name.endswith("experts.down_proj_scale_inv" if "fp8" in kind else "experts.down_proj"):
                p.mul_(100)
    cyc = bench.make_cyclic(model, period=16)
    eng = sd.Engine(model, None, None, 2, 96, torch.float32, torch.device("cpu"))
    sp = sd.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reqs = [eng.add_request(cyc[i].roll(5 * i).repeat(3)[:40 + i].tolist(), sp) for i in range(2)]
    while eng.has_work():
        eng.step()
    for i, r in enumerate(reqs):
        want = cyc[i].roll(5 * i).repeat(6)[40 + i:40 + i + 24].tolist()
        assert r.output_ids == want, (kind, i)


def test_bench_true_floor(monkeypatch, capsys):
    """bench.py --true-floor on a MoE: routed_experts counts the distinct experts of the target's actual routing per
    decode / verify step (between top_k and min(E, rows x top_k); a verify of k+1 tokens routes to at least as many
    as a decode step of one), and true_floor_ms is the step's bytes (linear_weights' plus that many experts per MoE
    layer) at the given rate; the command line prints each row as it is measured, then the table and the JSON."""
    cfg = dict(tiny_text_config(moe=True), num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32)
    monkeypatch.setitem(bench.PRESETS, "tiny-moe", cfg)
    cpu = torch.device("cpu")
    model, c = bench.random_model("tiny-moe", torch.float32, cpu)
    E, k = c.num_experts, c.num_experts_per_tok
    one = bench.routed_experts(model, None, 1, 8, cpu, torch.float32, steps=3)
    assert one == k                                                                # one token: its k experts
    four = bench.routed_experts(model, None, 4, 8, cpu, torch.float32, steps=3)
    spec = sd.SpeculativeConfig.from_json({"method": "mtp", "num_speculative_tokens": 3})
    verify = bench.routed_experts(model, spec, 1, 8, cpu, torch.float32, steps=3)
    assert k < four <= min(E, 4 * k) and k < verify <= min(E, 4 * k)
    moes = sum(isinstance(layer.mlp, sd.MoE) for layer in model.layers)
    dense = sum(w.numel() * 4 for w in bench.linear_weights(model, 0))
    per = (2 * 32 * 64 + 64 * 32) * 4                                              # gate_up + down of one expert, fp32
    assert math.isclose(bench.true_floor_ms(model, 3.0, 100.0), (dense + 3.0 * moes * per) / 100e9 * 1e3)
    capsys.readouterr()
    bench.main(["--random-weights", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--batch", "1", "2",
                "--prompt-len", "8", "--gen-len", "4", "--enforce-eager", "--true-floor"])   # the command line's rows
    out = capsys.readouterr().out.strip().splitlines()
    rows = json.loads(out[-1])["rows"]
    assert [r["experts_per_layer"] for r in rows][0] == k and all(r["tpot_over_true_floor"] > 0 for r in rows)
    # each row also printed as soon as it was measured, before the table (a run cut short keeps those)
    assert [line.split(":")[1] for line in out if line.startswith("# measured:")] == [
        f" off k=0 batch {r['batch']} prompt 8" for r in rows]


def test_bench_stall_report(monkeypatch, capsys):
    """bench.py says why a row's timed run stalled: run_batch records its longest engine step against the median
    one (here one step made 80 ms longer), the CUDA graphs captured during it (none on the CPU) and the garbage
    collector's passes (one forced inside that step), and the command line prints a `# stall` line for that row."""
    cpu = torch.device("cpu")
    model, _ = bench.random_model("tiny", torch.float32, cpu)
    step, done = sd.Engine.step, []

    def slow_step(self):  # once, midway through the timed run (its requests want 16 tokens, the warm-up's 2 and 4)
        if not done and any(r is not None and r.params.max_tokens == 16 and len(r.output_ids) >= 8
                            for r in self.slots):
            done.append(1)
            gc.collect()
            time.sleep(0.08)
        return step(self)
    monkeypatch.setattr(sd.Engine, "step", slow_step)
    r = bench.run_batch(model, None, 2, 8, 16, cpu, torch.float32, True)
    assert done and r["late_graph_captures"] == 0 and r["gc_passes"] >= 1 and r["gc_ms"] > 0
    assert r["max_step_ms"] >= 80 and r["max_step_ms"] > 5 * r["median_step_ms"] + 1
    done.clear()
    capsys.readouterr()
    bench.main(["--random-weights", "tiny", "--device", "cpu", "--dtype", "float32", "--batch", "2",
                "--prompt-len", "8", "--gen-len", "16", "--enforce-eager", "--no-floor"])
    out = capsys.readouterr().out
    assert "# stall in that run: longest step" in out and "garbage-collector passes" in out


def test_bench_step_ids_route_like_text(monkeypatch):
    """The steps bench.py's verify cost and tools/profile_step.py time run random token ids (step_ids), so a MoE
    verify of T tokens routes to more than one token's top-k experts, as on real text (with all-zero ids, as
    before, every token chose the same k experts: the 35B-A3B's T = 16 verify then read 8 experts a layer, not
    ~78); step_experts counts them for the step the graph runs."""
    cfg = dict(tiny_text_config(moe=True), num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32)
    monkeypatch.setitem(bench.PRESETS, "tiny-moe", cfg)
    cpu = torch.device("cpu")
    model, c = bench.random_model("tiny-moe", torch.float32, cpu)
    ids = bench.step_ids(model, 2, 8)
    assert ids.shape == (2, 8) and ids.unique().numel() > 1 and torch.equal(ids, bench.step_ids(model, 2, 8))
    runner = sd.ModelRunner(model, None, 2, 64, torch.float32, cpu)
    k = c.num_experts_per_tok
    assert bench.step_experts(runner, 1, 1, 8) == k                                # one token: its k experts
    assert k < bench.step_experts(runner, 1, 8, 8) <= c.num_experts               # eight tokens: more
    dense, _ = bench.random_model("tiny", torch.float32, cpu)
    assert bench.step_experts(sd.ModelRunner(dense, None, 1, 64, torch.float32, cpu), 1, 4, 8) is None


def test_bench_random_model_fp8():
    """bench.py --random-weights --quantization fp8: the FP8_WEIGHTS in FP8, the rest as made; logits near the
    unquantized model's (block-FP8 keeps ~2 significant digits per weight)."""
    cpu = torch.device("cpu")
    plain, cfg = bench.random_model("tiny", torch.float32, cpu)
    fp8, _ = bench.random_model("tiny", torch.float32, cpu, quantization="fp8")
    params = dict(fp8.named_parameters())
    for n, p in plain.named_parameters():
        assert (params[n].dtype == sd.FP8) == n.endswith(sd.FP8_WEIGHTS) == (n + "_scale_inv" in params), n
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    out = []
    for m in (plain, fp8):
        st = sd.State(cfg, 1, 16, torch.float32, "cpu")
        with torch.inference_mode():
            out.append(m.logits(m(ids, sd.Ctx(st, torch.arange(1), torch.zeros(1, dtype=torch.long), 12, "prefill"))))
    assert ((out[1] - out[0]).norm() / out[0].norm()).item() < 0.05
    ws = bench.linear_weights(fp8, 0)                                              # what a decode step reads
    assert {w.dtype for w in ws} == {sd.FP8, torch.float32} and sum(w.numel() for w in ws) == \
        sum(w.numel() for w in bench.linear_weights(plain, 0))
    assert plain.draft_head is None and fp8.draft_head[0].dtype == sd.FP8      # the drafts' lm_head, as LLM's
    assert bench.random_model("tiny", torch.float32, cpu, quantization="fp8", draft_head=False)[0].draft_head is None
    assert torch.equal(fp8.draft_head[0].float(), sd.fp8_head(fp8)[0].float())


def test_load_format_dummy(tmp_path):
    """vLLM's --load-format dummy: a directory with only a config.json (bench.py --write-config) loads with random
    weights through the one loader, the same bits as bench.py's --random-weights (bf16 and FP8: --quantization
    fp8, or an FP8 quantization_config, whose modules_to_not_convert stay unquantized); --tokenizer names another
    directory's tokenizer; each wrong combination is one ConfigError line."""
    cpu, d = torch.device("cpu"), str(tmp_path / "tiny")
    assert bench.main(["--write-config", "tiny", d]) == 0
    assert sorted(os.listdir(d)) == ["config.json", "tokenizer.json", "tokenizer_config.json"]

    def same(llm, quantization=None):
        want, _ = bench.random_model("tiny", torch.float32, cpu, quantization=quantization)
        got = dict(llm.model.named_parameters())
        assert got.keys() == dict(want.named_parameters()).keys()
        for n, p in want.named_parameters():
            assert got[n].dtype == p.dtype and torch.equal(got[n].float(), p.float()), n
    short = dict(device="cpu", max_model_len=512)  # (the config's 262144 positions: a KV cache of 3 s to zero)
    llm = LLM(model=d, load_format="dummy", speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **short)
    same(llm)
    assert llm.model.mtp is not None and llm.cfg.hidden_size == bench.PRESETS["tiny"]["hidden_size"]
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    same(LLM(model=d, load_format="dummy", quantization="fp8", **short), "fp8")

    with open(os.path.join(d, "config.json")) as f:  # an FP8 config: quantized as made, its listed module kept
        cfg = json.load(f)
    fp8_dir = str(tmp_path / "fp8")
    os.makedirs(fp8_dir)
    listed = "model.language_model.layers.1.mlp.down_proj"
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "modules_to_not_convert": [listed]}
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    fp8 = LLM(model=fp8_dir, load_format="dummy", tokenizer=d, **short)
    params = dict(fp8.model.named_parameters())
    assert params["layers.1.mlp.down_proj.weight"].dtype == torch.float32
    assert params["layers.0.mlp.down_proj.weight"].dtype == sd.FP8 and "layers.0.mlp.down_proj.weight_scale_inv" in params
    assert fp8.get_tokenizer().encode("def fib(n):") == llm.get_tokenizer().encode("def fib(n):")

    for kwargs, msg in [(dict(model=fp8_dir, load_format="dummy"), "no tokenizer.json"),
                        (dict(model=d, load_format="pt"), "load_format 'pt' .* not supported; specdec reads auto, "
                                                          "safetensors, gguf, dummy"),
                        (dict(model=d, load_format="gguf"), "--load-format gguf needs a .gguf file"),
                        (dict(model=d, load_format="dummy", tokenizer=str(tmp_path)), "no tokenizer.json")]:
        with pytest.raises(sd.ConfigError, match=msg):
            LLM(device="cpu", **kwargs)


QUANT_REFUSALS = [
    ({"quant_method": m}, f"unsupported quantization: quant_method '{m}'; specdec loads unquantized checkpoints and "
                          "Qwen's block-FP8 ones")
    for m in ("compressed-tensors", "awq", "gptq", "modelopt", "bitsandbytes", "mxfp4")] + [
    ({"fmt": "e5m2"}, "unsupported FP8 format fmt='e5m2'; only e4m3 is implemented"),
    ({"weight_block_size": [64, 64]}, r"unsupported FP8 weight_block_size \[64, 64\]; only \[128, 128\] blocks"),
    ({"weight_block_size": None}, "unsupported FP8 weight_block_size None"),
    ({"activation_scheme": "static"}, "unsupported FP8 activation_scheme 'static'; only dynamic is implemented")]


def test_fp8_refusals(tiny, ckpts, fp8_target, tmp_path):
    """Each refusal is one ConfigError line naming what was found: another quant_method or FP8 variant (config.json
    alone), a module modules_to_not_convert lists that has FP8 scales, an e4m3 weight without its scales, a
    quantized drafter, another --quantization value (LLM, CLI)."""
    fp8, _ = fp8_target
    base = json.load(open(os.path.join(fp8, "config.json")))
    for i, (edit, msg) in enumerate(QUANT_REFUSALS):
        os.makedirs(d := str(tmp_path / f"c{i}"))
        quant = {**base["quantization_config"], **edit}
        json.dump({**base, "quantization_config": {k: v for k, v in quant.items() if v is not None}},
                  open(os.path.join(d, "config.json"), "w"))
        with pytest.raises(ConfigError, match=msg):
            LLM(model=d, device="cpu")
    listed = to_fp8(tiny, str(tmp_path / "listed"), keep=["model.language_model.layers.0.mlp.up_proj"])
    with pytest.raises(ConfigError, match="'layers.0.mlp.up_proj' is listed in modules_to_not_convert, but the "
                                          "checkpoint has FP8 scales for it"):
        LLM(model=listed, device="cpu")
    w = read_tensors(fp8)
    del w["model.language_model.layers.1.mlp.down_proj.weight_scale_inv"]
    unscaled = rewrite(fp8, str(tmp_path / "unscaled"), w, base["quantization_config"])
    with pytest.raises(ConfigError, match="tensor 'model.language_model.layers.1.mlp.down_proj.weight' is "
                                          r"torch.float8_e4m3fn without block scales"):
        LLM(model=unscaled, device="cpu")
    for method, draft in (("draft_model", fp8), ("dflash", to_fp8(ckpts["dflash"], str(tmp_path / "dflash8")))):
        spec = {"method": method, "model": draft, "num_speculative_tokens": 2}
        with pytest.raises(ConfigError, match=f"{method}.* is quantized \\(quant_method 'fp8'\\); specdec runs "
                                              "drafters unquantized"):
            LLM(model=ckpts["target"], device="cpu", speculative_config=spec)
    with pytest.raises(ConfigError, match=r"quantization='awq' \(--quantization\) is not supported; specdec "
                                          "supports fp8"):
        LLM(model=tiny, device="cpu", quantization="awq")


# ==============================================================================================
# Errors: loader and speculative config (each with its message)
# ==============================================================================================

def _edit_config(path, fn):
    f = os.path.join(path, "config.json")
    with open(f) as fh:
        c = json.load(fh)
    fn(c)
    with open(f, "w") as fh:
        json.dump(c, fh)


LOADER_ERRORS = {
    "missing tensor": (dict(drop=["model.language_model.layers.0.linear_attn.A_log"]),
                       "missing tensor 'layers.0.linear_attn.A_log'"),
    "unexpected tensor": (dict(extra={"model.language_model.layers.0.foo.weight": torch.zeros(2)}),
                          "unexpected tensor 'layers.0.foo.weight'"),
    "unknown prefix": (dict(extra={"encoder.weight": torch.zeros(2)}), "unexpected tensor 'encoder.weight'"),
    "wrong shape": (dict(extra={"model.language_model.norm.weight": torch.zeros(63)}),
                    r"tensor 'model.language_model.norm.weight' has shape \(63,\), expected \(64,\)"),
    "model type": (dict(edit=lambda c: c.update(model_type="llama")), "unsupported model_type 'llama'"),
    "text model type": (dict(edit=lambda c: c["text_config"].update(model_type="qwen3_next")),
                        "unsupported text model_type 'qwen3_next'"),
    "rope type": (dict(edit=lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn")),
                  "unsupported rope_type 'yarn'"),
    "no gate": (dict(edit=lambda c: c["text_config"].update(attn_output_gate=False)),
                "unsupported config: attn_output_gate=False"),
    "no weights": (dict(edit="rm-weights"), "no model.safetensors"),
    # a config's numbers missing or of another type: one line naming the file and the key (session 48; before: a
    # KeyError, a TypeError or RuntimeError inside torch, a division by zero, or garbage from rope_theta 0)
    **{f"config {m}": (dict(edit=lambda c, e=e: e(c, c["text_config"])), r"config\.json: .*" + re.escape(m)) for e, m in [
        (lambda top, t: t.pop("hidden_size"), "the text config has no 'hidden_size'"),
        (lambda top, t: t.update(hidden_size="64"), "hidden_size must be a positive integer, got '64'"),
        (lambda top, t: t.update(hidden_size=64.0), "hidden_size must be a positive integer, got 64.0"),
        (lambda top, t: t.update(vocab_size=-5), "vocab_size must be a positive integer, got -5"),
        (lambda top, t: t.update(num_key_value_heads=0), "num_key_value_heads must be a positive integer, got 0"),
        (lambda top, t: t.update(full_attention_interval=0), "full_attention_interval must be a positive integer"),
        (lambda top, t: t.update(rms_norm_eps="1e-6"), "rms_norm_eps must be a positive number, got '1e-6'"),
        (lambda top, t: t.update(max_position_embeddings="4096"), "max_position_embeddings must be a positive integer"),
        (lambda top, t: t.update(rope_parameters=[1, 2]), "rope_parameters must be a JSON object"),
        (lambda top, t: t["rope_parameters"].update(partial_rotary_factor=2), "partial_rotary_factor must be at most 1"),
        (lambda top, t: t["rope_parameters"].update(rope_theta=0), "rope_theta must be a positive number, got 0"),
        (lambda top, t: t.update(eos_token_id="8192"), "eos_token_id must be a token id or a list of them"),
        (lambda top, t: top.update(text_config=None), "needs a text_config object, got 'None'"),
        (lambda top, t: top.update(quantization_config="fp8"), "quantization_config must be a JSON object")]},
}


@pytest.mark.parametrize("case", list(LOADER_ERRORS))
def test_loader_errors(case, tmp_path):
    kw, msg = LOADER_ERRORS[case]
    kw = dict(kw)
    edit = kw.pop("edit", None)
    path = write_tiny_checkpoint(str(tmp_path / "c"), **kw)
    if edit == "rm-weights":
        os.remove(os.path.join(path, "model.safetensors"))
    elif edit:
        _edit_config(path, edit)
    with pytest.raises(ConfigError, match=msg):
        LLM(model=path, device="cpu")


def test_fp32_a_log_in_bf16_model_and_vision_skipped(tiny):
    llm = LLM(model=tiny, device="cpu", dtype="bfloat16")
    gdn = llm.model.layers[0].linear_attn
    assert gdn.A_log.dtype == torch.float32 and gdn.in_proj_qkv.weight.dtype == torch.bfloat16
    assert llm.model.mtp is not None  # the mtp.* head is built and loaded
    assert len(llm.generate("hi", SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids) == 4


def json_error(text):
    """The json module's own message for text."""
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        return str(e)


VLLM_ONLY = "is a vLLM method that specdec does not implement; " \
            "accepted methods: mtp, dflash, dspark, ngram, draft_model (and the *_mtp aliases of mtp)"
SPEC_ERRORS = [  # (config, the whole message): the user-facing text, vLLM's own where vLLM has one
    ({"method": "eagle3", "model": "x", "num_speculative_tokens": 2}, f"speculative method 'eagle3' {VLLM_ONLY}"),
    ({"method": "ngram_gpu", "num_speculative_tokens": 2}, f"speculative method 'ngram_gpu' {VLLM_ONLY}"),
    ({"method": "foo", "num_speculative_tokens": 2}, "unknown speculative method 'foo'; accepted methods: mtp, dflash, "
                                                     "dspark, ngram, draft_model (and the *_mtp aliases of mtp)"),
    ({"method": 3, "num_speculative_tokens": 2}, "speculative method must be a string, got 3"),
    ({"method": "mtp", "num_speculative_tokens": 2, "bogus": 1}, "unknown speculative config key 'bogus' (extra keys are "
     "forbidden, as in vLLM); accepted keys: " + ", ".join(sorted(f.name for f in dataclasses.fields(sd.SpeculativeConfig)))),
    ({"method": "mtp", "num_speculative_tokens": 2, "tensor_parallel_size": 1}, "'tensor_parallel_size' is not a valid "
     "argument in the speculative_config. Please pass 'draft_tensor_parallel_size' instead."),
    ({"method": "mtp"}, "num_speculative_tokens must be provided with speculative model unless the draft model config "
                        "contains an n_predict parameter."),
    ({"method": "ngram"}, "num_speculative_tokens must be provided with speculative model unless the draft model config "
                          "contains an n_predict parameter."),
    ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer, got 0"),
    ({"method": "mtp", "num_speculative_tokens": -1}, "num_speculative_tokens must be a positive integer, got -1"),
    ({"method": "mtp", "num_speculative_tokens": True}, "num_speculative_tokens must be a positive integer, got True"),
    ({"method": "mtp", "num_speculative_tokens": 2.0}, "num_speculative_tokens must be a positive integer, got 2.0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "prompt_lookup_min must be a positive integer, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": True},
     "prompt_lookup_max must be a positive integer, got True"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": "3"},
     "prompt_lookup_min must be a positive integer, got '3'"),
    ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 0},     # (vLLM: ge=1 whatever the method)
     "prompt_lookup_max must be a positive integer, got 0"),
    ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_min": "3"},
     "prompt_lookup_min must be a positive integer, got '3'"),
    ({"method": "dflash", "num_speculative_tokens": 2}, "num_speculative_tokens was provided but without speculative model."),
    ({"method": "draft_model", "num_speculative_tokens": 2},
     "num_speculative_tokens was provided but without speculative model."),
    ({"method": "mtp", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size=2 cannot "
     "be other value than 1 or target model tensor_parallel_size (1 in specdec)"),
    ({"method": "mtp", "num_speculative_tokens": 2, "quantization": "fp8"},
     "draft quantization 'fp8' is not supported; specdec runs drafts in the target's dtype"),
    ({"method": "mtp", "num_speculative_tokens": 2, "max_model_len": 0}, "max_model_len must be a positive integer, got 0"),
    ({"method": "mtp", "num_speculative_tokens": 2, "max_model_len": "8"},
     "max_model_len must be a positive integer, got '8'"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "block"},
     "rejection_sample_method must be 'standard' or 'synthetic', got 'block'"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"}, "rejection_sample_method "
     "'synthetic' needs exactly one of synthetic_acceptance_rates and synthetic_acceptance_length"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [1.0, 1.0], "synthetic_acceptance_length": 2.0}, "rejection_sample_method "
     "'synthetic' needs exactly one of synthetic_acceptance_rates and synthetic_acceptance_length"),
    ({"method": "mtp", "num_speculative_tokens": 2, "synthetic_acceptance_length": 2.0},
     "synthetic_acceptance_rates / synthetic_acceptance_length need rejection_sample_method 'synthetic'"),
    ({"method": "mtp", "num_speculative_tokens": 2, "synthetic_acceptance_rates": [1.0, 1.0]},
     "synthetic_acceptance_rates / synthetic_acceptance_length need rejection_sample_method 'synthetic'"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [0.5]}, "synthetic_acceptance_rates must be a list of 2 numbers in [0, 1], got [0.5]"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [1.0, -0.5]},
     "synthetic_acceptance_rates must be a list of 2 numbers in [0, 1], got [1.0, -0.5]"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [1.5, 1.0]},
     "synthetic_acceptance_rates must be a list of 2 numbers in [0, 1], got [1.5, 1.0]"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": "0.5"}, "synthetic_acceptance_rates must be a list of 2 numbers in [0, 1], got '0.5'"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [0.5, 0.9]}, "synthetic_acceptance_rates must be non-increasing, got [0.5, 0.9]"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_length": 3.5},
     "synthetic_acceptance_length must be in [1, num_speculative_tokens + 1 = 3], got 3.5"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_length": 0.5},
     "synthetic_acceptance_length must be in [1, num_speculative_tokens + 1 = 3], got 0.5"),
    ({"method": "mtp", "num_speculative_tokens": 2, "draft_sample_method": "beam"},
     "draft_sample_method must be 'greedy' or 'probabilistic', got 'beam'"),
    ({"method": "mtp", "num_speculative_tokens": 2, "dspark_draft_topk": 4},
     "dspark_draft_topk is only valid with method 'dspark'"),
    ({"method": "dspark", "num_speculative_tokens": 4, "dspark_draft_topk": 0},
     "dspark_draft_topk must be an integer >= 1, got 0"),
    ({"method": "dspark", "num_speculative_tokens": 4, "dspark_draft_topk": 2.5},
     "dspark_draft_topk must be an integer >= 1, got 2.5"),
    ({"method": "mtp", "num_speculative_tokens": 2, "enforce_eager": "yes"}, "enforce_eager must be true or false, got 'yes'"),
    ({"method": "mtp", "num_speculative_tokens": 2, "disable_padded_drafter_batch": True}, "speculative config key "
     "'disable_padded_drafter_batch' is a vLLM option specdec does not support (only False is accepted)"),
    ({"model": "my.pkg.Proposer", "num_speculative_tokens": 2}, f"speculative method 'custom_class' {VLLM_ONLY}"),
    ("{not json", "speculative config is not valid JSON: " + json_error("{not json")),
    ("[1, 2]", "speculative config must be a JSON object, got list"),
    ("3", "speculative config must be a JSON object, got int"),
]


@pytest.mark.parametrize("cfg,msg", SPEC_ERRORS, ids=[m[:40] for _, m in SPEC_ERRORS])
def test_spec_config_errors(cfg, msg):
    with pytest.raises(ConfigError) as e:
        sd.SpeculativeConfig.from_json(cfg if isinstance(cfg, str) else json.dumps(cfg))
    assert str(e.value) == msg


def test_spec_config_inference_and_aliases(tmp_path):
    c = sd.SpeculativeConfig.from_json({"model": "ngram", "num_speculative_tokens": 3})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 5)
    assert sd.SpeculativeConfig.from_json(c) is c and sd.SpeculativeConfig.from_json(None) is None
    c = sd.SpeculativeConfig.from_json('{"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 3}')
    assert (c.method, c.model, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", "[ngram]", 3, 3)
    c = sd.SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2})
    assert (c.model, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 5)   # vLLM sets model = "ngram"
    c = sd.SpeculativeConfig.from_json({"method": "mtp", "num_speculative_tokens": 2, "quantization": "None",
                                        "draft_tensor_parallel_size": 1, "enforce_eager": True, "max_model_len": 9,
                                        "disable_padded_drafter_batch": False, "draft_sample_method": "probabilistic"})
    assert (c.method, c.model, c.enforce_eager, c.max_model_len, c.draft_sample_method) == \
        ("mtp", None, True, 9, "probabilistic")
    dotted = tmp_path / "my.draft"                                       # a dotted name that is a directory: a model
    dotted.mkdir()
    os.chdir(tmp_path)
    try:
        assert sd.SpeculativeConfig.from_json({"model": "my.draft", "num_speculative_tokens": 1}).method == "draft_model"
    finally:
        os.chdir(HERE)
    assert sd.SpeculativeConfig.from_json({"model": "org.pkg/Draft", "num_speculative_tokens": 1}).method == \
        "draft_model"
    c = sd.SpeculativeConfig.from_json({"method": "dspark", "model": "d", "num_speculative_tokens": 4,
                                        "dspark_draft_topk": 1})
    assert (c.method, c.dspark_draft_topk) == ("dspark", 1)
    c = sd.SpeculativeConfig.from_json({"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method":
                                        "synthetic", "synthetic_acceptance_rates": [1.0, 0.5, 0.0]})
    assert c.conditional_rates() == [1.0, 0.5, 0.0]
    for length in (1, 4):                                                # the ends of [1, k + 1]
        c = sd.SpeculativeConfig.from_json({"method": "mtp", "num_speculative_tokens": 3,
                                            "rejection_sample_method": "synthetic", "synthetic_acceptance_length": length})
        assert c.conditional_rates() == ([0.0] * 3 if length == 1 else [1.0] * 3)
    c = sd.SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 7})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (7, 7)
    assert sd.SpeculativeConfig.from_json({"model": "some/draft", "num_speculative_tokens": 3}).method == "draft_model"
    for alias in ("qwen3_5_mtp", "qwen3_next_mtp", "deepseek_mtp"):
        with pytest.warns(UserWarning, match=f"method `{alias}` is deprecated and replaced with mtp"):
            assert sd.SpeculativeConfig.from_json({"method": alias, "num_speculative_tokens": 1}).method == "mtp"
    c = sd.SpeculativeConfig.from_json({"method": "mtp", "num_speculative_tokens": 4, "rejection_sample_method": "synthetic",
                                        "synthetic_acceptance_length": 2.5})
    assert c.conditional_rates() == [1.0, 0.5, 0.0, 0.0]


def test_synthetic_acceptance_rates(tiny):
    """rejection_sample_method synthetic (a benchmark mode): with conditional rates [1, 0.5, 0] every first draft
    is accepted, a second about half the time, a third never, whatever the tokens are."""
    check_synthetic_acceptance(tiny, "cpu")


def check_synthetic_acceptance(tiny, device):
    llm = LLM(model=tiny, device=device, dtype="float32", max_num_seqs=4, speculative_config={
        "method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rates": [1.0, 0.5, 0.0]})
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], sp)
    s = llm.engine.stats
    assert all(len(o.outputs[0].token_ids) == 120 for o in outs)
    assert s.num_drafts >= 100 and s.accepted_per_pos[0] == s.num_drafts and s.accepted_per_pos[2] == 0
    assert 0.35 < s.accepted_per_pos[1] / s.num_drafts < 0.65                  # 0.5, binomial sd ~0.04 here
    return llm.engine.runner


def test_synthetic_sample_accepts_by_rate_within_the_real_drafts():
    g = torch.Generator().manual_seed(27)
    B, k, V = 4, 3, 12
    logits = torch.randn(B, k + 1, V, generator=g)
    drafts = torch.tensor([[0, 5, 0], [3, -1, -1], [0, 0, 0], [7, 8, 9]])      # id 0 is a real draft
    real = [3, 1, 3, 3]
    cases = [([1.0, 1.0, 0.0], [0.0, 0.0, 0.0], 2),                               # rate 0: never, even at u = 0
             ([1.0, 1.0, 0.0], [0.5, 0.5, 0.5], 2), ([1.0, 0.5, 0.0], [0.3, 0.7, 0.0], 1)]
    for rates, u, accepted in cases:
        tokens, n = sd.synthetic_sample(logits, drafts, torch.tensor(rates), torch.tensor([u] * B))
        assert n.tolist() == [min(accepted, r) for r in real]
        assert tokens.shape == (B, k + 1)
        for b in range(B):
            m = int(n[b])
            assert tokens[b, :m].tolist() == drafts[b, :m].tolist()
            assert int(tokens[b, m]) == int(logits[b, m].argmax())


def test_mtp_without_head_fails_at_load(tmp_path):
    path = write_tiny_checkpoint(str(tmp_path / "nomtp"), mtp=False)
    with pytest.raises(ConfigError, match="no mtp.\\* tensors \\(the MTP head is missing\\)"):
        LLM(model=path, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_request_errors(tiny):
    llm = LLM(model=tiny, device="cpu", max_model_len=64)
    out = llm.generate([[1] * 60], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (4, "length")  # vLLM's LLM: the output stops at the context
    with pytest.raises(ConfigError, match="maximum context length is 64 tokens. However, you requested 70 tokens"):
        llm.engine.add_request([1] * 60, SamplingParams(max_tokens=10))  # the server's rule (vLLM's server)
    with pytest.raises(ConfigError, match="prompt is empty"):
        llm.generate([[]], SamplingParams())
    for bad, msg in ((dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(max_tokens=0), "max_tokens"),
                     (dict(top_k=-2), "top_k must be 0 \\(disable\\), or at least 1, got -2"),
                     # a value of another type: refused here, not by the step it would fail (which, offline, left
                     # its request in the engine to fail every later generate)
                     (dict(stop=[5]), "stop must be a string or a list of strings"), (dict(stop=5), "stop must be"),
                     (dict(logprobs=1.5), "logprobs must be an integer"), (dict(logprobs="1"), "logprobs must"),
                     (dict(seed=1.5), "seed must be an integer"), (dict(seed=2 ** 70), "seed must be an integer"),
                     (dict(temperature=None), "temperature must be a number"), (dict(max_tokens=4.5), "max_tokens"),
                     (dict(bad_words=[5]), "bad_words must be a list of strings")):
        with pytest.raises(ConfigError, match=msg):
            SamplingParams(**bad)
    with pytest.raises(ConfigError, match="list of token ids \\(integers\\)"):
        llm.generate({"prompt_token_ids": [474.0, 286.0]}, SamplingParams(max_tokens=2))
    launch, calls = llm.engine.runner.launch, []

    def fail_once(*a, **kw):  # a step that raises: that call's requests end, the engine goes on
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return launch(*a, **kw)
    llm.engine.runner.launch = fail_once
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert all(r is None for r in llm.engine.slots) and not llm.engine.waiting
    out = llm.generate(["a"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3
    unseeded = LLM(model=tiny, device="cpu", max_model_len=64, seed=None)  # vLLM's seed None: not a fixed seed
    assert len(unseeded.generate([[1]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    for choice in ("ab", {"a": 1}):  # a string or a dict is not a list of strings (a string passed before)
        with pytest.raises(ConfigError, match="choice must be a non-empty list of strings"):
            llm.generate([[1]], SamplingParams(max_tokens=2, structured_outputs=sd.StructuredOutputsParams(
                choice=choice)))
    with pytest.raises(ValueError, match="tool call arguments are not valid JSON"):  # nested past the recursion limit
        sd._tool_call_object({"function": {"name": "f", "arguments": "[" * 5000}})


def test_sampling_params_cross_field_checks():
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    assert SamplingParams(min_tokens=100, max_tokens=None).max_tokens is None
    with pytest.raises(ConfigError, match=re.escape("min_tokens must be less than or equal to max_tokens=4, got 5.")):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(n=3, best_of=3).best_of == 3
    with pytest.raises(ConfigError, match=re.escape("best_of must be greater than or equal to n, got n=3 and "
                                                    "best_of=2.")):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ConfigError, match=re.escape("n must be 1 when using greedy sampling, got 2.")):
        SamplingParams(n=2, temperature=0)
    assert SamplingParams(temperature=0, best_of=1).greedy
    with pytest.raises(ConfigError, match=re.escape("best_of must be 1 when using greedy sampling, got 2.")):
        SamplingParams(temperature=0, best_of=2)


def emit_reference(tok, stream, params, eos, room):
    """A request's output after the tokens of `stream`, by vLLM's stop rules written plainly: tokens are appended one
    at a time; the token that stops the request (a stop id, or EOS unless ignore_eos) adds no text unless
    include_stop_str_in_output, nor do special ids (vLLM's detokenizer); the text is the decode of the text's ids
    whenever that does not end in U+FFFD (else it stays as it was: tokenizers' DecodeStream holds an unfinished
    character, and never releases it if the request ends there); after each token, the first of params.stop (in its
    order) found in the text ends the output (the text cut before it; the token stays), else the tokenizer's EOS
    (stop_reason None), else a stop id or another EOS (the generation config's join stop_token_ids: stop_reason its
    id), else max_tokens or the context (room: tokens left). -> (ids, text, finish_reason, stop_reason)."""
    ids, text_ids, text = [], [], ""
    for t in stream:
        ids.append(t)
        stop_token = t in params.stop_token_ids or (t in eos and not params.ignore_eos)
        if not (stop_token and not params.include_stop_str_in_output) and t not in tok._special_id_set:
            text_ids.append(t)
            if not tok.decode(text_ids).endswith("\ufffd"):
                text = tok.decode(text_ids)
            hit = next((x for x in params.stop if x in text), None)
            if hit is not None:
                return ids, text[:text.index(hit)], "stop", hit
        if stop_token:
            return ids, text, "stop", None if t == tok.eos_token_id and not params.ignore_eos else t
        if len(ids) >= min(params.max_tokens, room):
            return ids, text, "length", None
    return ids, text, None, None


def test_stops_inside_runs_match_the_stop_rules(tiny):
    """Engine._emit, fed token runs of 1 to 5 tokens at a time (a speculative step's accepted run) with logits, against
    emit_reference on 300 random requests: output ids, text, finish and stop reasons; logprobs (top-2 or top-0, and the
    token's, from the logits); the stream callback's count per run; first / finish times; the slot freed at the finish.
    Streams of ASCII tokens with EOS and special ids mixed in, some with a character split over two tokens; stop
    strings that span token boundaries, start the text, occur twice within one token, or never occur; stop ids;
    several stops per request."""
    llm = LLM(model=tiny, device="cpu", max_num_seqs=1, max_model_len=64)
    e, tok = llm.engine, llm.tokenizer
    V = llm.model.cfg.vocab_size
    ascii_ids = [i for i in range(tok.vocab_size) if i not in tok._special_id_set and tok.token_bytes(i)
                 and all(32 <= c < 127 for c in tok.token_bytes(i))]
    twice = [i for i in ascii_ids if any(tok.token_bytes(i).count(c) >= 2 for c in set(tok.token_bytes(i)))]
    byte = {tok.token_bytes(i)[0]: i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1}
    dangling = [i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) >= 2 and 32 <= tok.token_bytes(i)[0] < 127
                and 0xC2 <= tok.token_bytes(i)[-1] <= 0xF4]                      # ASCII, then a character's first byte
    assert dangling
    eos = sorted(e.stop_ids)
    g = torch.Generator().manual_seed(0)
    pick = lambda xs: xs[int(torch.randint(len(xs), (), generator=g))]
    for trial in range(300):
        n = int(torch.randint(1, 30, (), generator=g))
        stream = [pick(ascii_ids) for _ in range(n)]
        for _ in range(int(torch.randint(0, 3, (), generator=g))):              # EOS / special ids inside
            stream[int(torch.randint(n, (), generator=g))] = pick(eos + sorted(tok._special_id_set))
        if trial % 7 == 0:
            stream[0] = pick(twice)
        if trial % 6 == 1:                                                       # a 2-byte character split over
            at = 1 + int(torch.randint(n, (), generator=g))                      # two tokens (a stop between them:
            stream[at:at + 1] = [byte[0xC3], byte[0xA9]]                         # the dangling byte is never released)
            n = len(stream)
        text = tok.decode([t for t in stream if t not in eos and t not in tok._special_id_set])
        stops = []
        for _ in range(int(torch.randint(0, 3, (), generator=g))):
            kind = int(torch.randint(4, (), generator=g))
            a = int(torch.randint(len(text) + 1, (), generator=g))
            cand = [text[a:a + 3], text[:2], "\x01never", "".join(chr(c) for c in tok.token_bytes(stream[0]))][kind]
            if kind == 3 and trial % 7 == 0:                                     # a character twice in token 0
                b = tok.token_bytes(stream[0])
                cand = chr(next(c for c in b if b.count(c) >= 2))
            if cand:
                stops.append(cand)
        if trial % 13 == 5:                                                      # a stop string ends where a token
            stream[0] = pick(dangling)                                           # leaves a partial character: the cut
            stops.insert(0, chr(tok.token_bytes(stream[0])[0]))                  # text gets no U+FFFD from it
        params = SamplingParams(temperature=0, max_tokens=int(torch.randint(1, 32, (), generator=g)), stop=stops,
                                stop_token_ids=[pick(stream)] if trial % 3 == 0 else None, ignore_eos=trial % 4 == 0,
                                logprobs=[2, 0, None, None, None][trial % 5])
        prompt = [pick(ascii_ids) for _ in range(int(torch.randint(1, 31, (), generator=g)))]
        req = e.add_request(prompt, params)
        e.waiting.remove(req)
        req.slot, e.slots[0] = 0, req
        calls = []
        req.on_update = lambda r, k: calls.append((r, k))
        want = emit_reference(tok, stream, req.params, set(eos), e.max_model_len - len(prompt))
        at, runs, first = 0, [], None
        while at < len(stream) and not req.finished:
            k = int(torch.randint(1, 6, (), generator=g))
            logits = torch.randn(k, V, generator=g)
            before = len(req.output_ids)
            e._emit(req, stream[at:at + k], logits)
            runs.append((len(req.output_ids) - before, logits))
            first = first or req.first_token_time
            assert req.first_token_time == first and first is not None
            at += k
        assert (req.output_ids, req.text, req.finish_reason, req.stop_reason) == want, (trial, stream, params)
        assert req.tokens == prompt + req.output_ids and calls == [(req, m) for m, _ in runs]
        assert (req.finish_time is not None) == req.finished == (e.slots[0] is None) == (req.slot is None)
        if req.logprobs is not None:
            lps = [lg[i].double().log_softmax(-1) for m, lg in runs for i in range(m)]
            assert len(req.logprobs) == len(req.output_ids)
            for d, lp, t in zip(req.logprobs, lps, req.output_ids):
                top = set(lp.topk(params.logprobs).indices.tolist()) | {t}             # logprobs=0: the token's only
                assert set(d) == top and all(abs(d[x].logprob - float(lp[x])) < 1e-5 for x in top)
        e.slots[0] = None


@pytest.mark.parametrize("asynchronous", [False, True])
def test_step_returns_the_requests_it_gave_tokens(tiny_spec, asynchronous):
    """Engine.step returns exactly the requests whose output grew in it, and the outputs equal plain synchronous
    decoding's. Three MTP requests in one batch, the first (slot 0) stopped by a stop id after 3 tokens: with
    asynchronous steps the step launched before that stop was read still holds it; that step's tokens for it are
    dropped, the other rows' are emitted."""
    plain = LLM(model=tiny_spec, device="cpu", max_num_seqs=3)
    prompts = [plain.tokenizer.encode(p) for p in SPEC_PROMPTS[:3]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = plain.generate(prompts[:1], greedy)[0].outputs[0].token_ids
    stop = next(t for i, t in enumerate(first) if i >= 2 and t not in first[:i])       # first met at index >= 2
    params = [dataclasses.replace(greedy, stop_token_ids=[stop]), greedy, greedy]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert len(want[0]) < 12 and want[0][-1] == stop
    llm = LLM(model=tiny_spec, device="cpu", max_num_seqs=3, async_scheduling=asynchronous,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    e = llm.engine
    reqs = [e.add_request(p, sp) for p, sp in zip(prompts, params)]
    dropped = 0
    while e.has_work():
        before = [len(r.output_ids) for r in reqs]
        stale = e.pending is not None and reqs[0] in e.pending.reqs and reqs[0].finished  # read back in this step
        touched = e.step()
        grew = [r for r, n in zip(reqs, before) if len(r.output_ids) > n]
        assert sorted(map(id, touched)) == sorted(map(id, grew))
        dropped += stale and len(grew) > 0                                       # the others' tokens emitted
    assert [r.output_ids for r in reqs] == want
    assert e.runner.async_steps == asynchronous and (dropped > 0) == asynchronous


def test_stops_inside_speculative_steps(tiny_spec, spec_off):
    """EOS / stop ids / stop strings / max_tokens cut the accepted run where plain decoding stops (MTP k = 4)."""
    sp, ref, _ = spec_off
    full = ref[0].outputs[0]
    plain = LLM(model=tiny_spec, device="cpu")
    spec = LLM(model=tiny_spec, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 4})
    stop_id = full.token_ids[7]
    text = full.text
    stop_str = text[len(text) // 2: len(text) // 2 + 3]
    for p in (SamplingParams(temperature=0, max_tokens=11, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]),
              SamplingParams(temperature=0, max_tokens=40, stop=[stop_str], ignore_eos=True)):
        a, b = plain.generate([SPEC_PROMPTS[0]], p)[0].outputs[0], spec.generate([SPEC_PROMPTS[0]], p)[0].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason, b.stop_reason)
    assert b.finish_reason == "stop" and b.stop_reason == stop_str and stop_str not in b.text
    assert spec.engine.stats.mean_acceptance_length >= 2.0                   # the stops met multi-token runs


def oracle_stop_cases(tok, prompts, outs, k):
    """Stops that plain decoding meets at a token emitted at each offset of a run of the no-mistakes oracle (token 0
    from the prefill, then k+1 tokens a step: offset (i - 1) % (k + 1); offset k = the bonus token): per kind and
    offset, the first prompt and index i where it is the first stop. -> {(kind, offset): (prompt, i, kwargs)}."""
    import codecs
    cases = {}
    for p, ids in zip(prompts, outs):
        utf8, text, starts = codecs.getincrementaldecoder("utf-8")(errors="replace"), "", [0]
        for t in ids:                                                            # the streamed text: bytes of a
            if t not in tok._special_id_set:                                     # partial character wait
                text += utf8.decode(tok.token_bytes(t))
            starts.append(len(text))                                             # text before token j
        for i in range(1, len(ids)):
            o = (i - 1) % (k + 1)
            if ids[i] not in ids[:i]:
                cases.setdefault(("stop_id", o), (p, i, dict(stop_token_ids=[ids[i]])))
                cases.setdefault(("eos", o), (p, i, dict(eos=ids[i])))
            s = text[starts[i] - 2:starts[i] + 1]                                # 2 characters of i-1, 1 of i
            if starts[i] - starts[i - 1] >= 2 and starts[i + 1] > starts[i] and text.find(s) == starts[i] - 2:
                cases.setdefault(("stop_string", o), (p, i, dict(stop=[s])))
            cases.setdefault(("max_tokens", o), (p, i, dict(max_tokens=i + 1)))
    return cases


def test_stops_inside_accepted_runs(tiny_spec, spec_off):
    """Every draft accepted (an oracle proposing plain decoding's own tokens, k = 3: each step emits 4 tokens): a stop
    met at each offset of a run - first draft, middle, last draft, bonus token - ends the output exactly where plain
    decoding ends it: stop ids, EOS, stop strings spanning two tokens, max_tokens. Output ids, text, finish and stop
    reasons (hence the token count) equal, and it is the intended token."""
    sp, ref, _ = spec_off
    k, kinds = 3, ("stop_id", "eos", "stop_string", "max_tokens")
    plain = LLM(model=tiny_spec, device="cpu", max_num_seqs=16)
    spec = LLM(model=tiny_spec, device="cpu", max_num_seqs=16,
               speculative_config={"method": "ngram", "num_speculative_tokens": k})
    prompts = [plain.tokenizer.encode(p) for p in SPEC_PROMPTS]
    truth = {p[0]: r.outputs[0].token_ids for p, r in zip(prompts, ref)}
    spec.engine.runner.proposer = OracleProposer(k, truth, spec.cfg.vocab_size, mistakes=False)
    cases = oracle_stop_cases(plain.tokenizer, prompts, [r.outputs[0].token_ids for r in ref], k)
    assert set(cases) == {(kind, o) for kind in kinds for o in range(k + 1)}    # every kind at every offset
    keys = sorted(cases)
    outs = []
    for llm in (plain, spec):
        batch = [key for key in keys if key[0] != "eos"]                         # one batch: stops at every offset
        params = [SamplingParams(temperature=0, ignore_eos=True, **{"max_tokens": 48, **cases[key][2]})
                  for key in batch]
        got = dict(zip(batch, llm.generate([cases[key][0] for key in batch], params)))
        for key in keys:
            if key[0] == "eos":                                                  # the model's EOS, for this case
                p, _, args = cases[key]
                llm.engine.stop_ids = {args["eos"]}                             # (the tokenizer's: no stop_reason)
                llm.engine.eos_id = args["eos"]
                got[key] = llm.generate([p], SamplingParams(temperature=0, max_tokens=48))[0]
        outs.append({key: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                           o.outputs[0].stop_reason) for key, o in got.items()})
    for key in keys:
        (kind, o), (p, i, args), a = key, cases[key], outs[0][key]
        assert outs[1][key] == a, key
        assert len(a[0]) == i + 1 and a[2] == ("length" if kind == "max_tokens" else "stop"), key
        reason = {"stop_id": args.get("stop_token_ids", [None])[0], "stop_string": args.get("stop", [None])[0]}
        assert a[3] == reason.get(kind), key
    s = spec.engine.stats
    assert s.num_accepted_tokens == s.num_draft_tokens and s.accepted_per_pos[k - 1] > 0   # every draft accepted


# ==============================================================================================
# CLI
# ==============================================================================================

def run_cli(*args):
    return subprocess.run([sys.executable, os.path.join(HERE, "specdec.py"), *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))


def test_cli_generates_with_stats_and_speculation(tiny_spec, capsys):
    """specdec.py's main (in this process: test_default_model_is_the_shipped_toy runs the real command): the
    stats line, and with MTP the same text and vLLM's speculative-decoding lines, drafts accepted."""
    base = ["--model", tiny_spec, "--prompt", "a b c a b", "--max-tokens", "16", "--device", "cpu", "--ignore-eos"]
    assert sd.main(base) == 0
    plain = capsys.readouterr()
    assert "prompt tokens:" in plain.err and "generated tokens: 16" in plain.err and "tok/s" in plain.err
    assert sd.main(base + ["--speculative-config", '{"method":"mtp","num_speculative_tokens":2}']) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out and spec.out.strip()
    mal = re.search(r"Mean acceptance length: ([0-9.]+)", spec.err)
    assert mal and float(mal[1]) >= 1.5, spec.err                                # drafts accepted (measured 2.12)
    assert re.search(r"Accepted throughput: [\d.]+ tokens/s, Drafted throughput: [\d.]+ tokens/s", spec.err)


@pytest.mark.parametrize("args,msg", [
    (["--speculative-config", '{"method":"eagle","num_speculative_tokens":1}'], "'eagle' is a vLLM method"),
    (["--speculative-config", '{"method":"mtp"}'], "num_speculative_tokens must be provided"),
    (["--model", "/nonexistent/dir"], "does not exist"),
    (["--dtype", "int3"], "unsupported dtype"),
    (["--device", "tpu"], "device 'tpu' (--device) is not available here"),
    (["--model", "Qwen/Qwen3.6-NotCached"], "hf download Qwen/Qwen3.6-NotCached"),
    (["--tensor_parallel_size", "2"], "tensor parallelism is not supported yet"),
    (["-q", "gptq"], "quantization='gptq' (--quantization) is not supported; specdec supports fp8"),
])
def test_cli_errors_are_one_line(args, msg, tiny, capsys):
    """specdec.py's main in this process (a subprocess per case cost ~1.5 s of imports; the README command's
    test runs the real one): a nonzero exit and one error line, no traceback."""
    code = exit_code(sd.main, ["--model", tiny, "--device", "cpu", *args])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code != 0 and out == "" and len(lines) == 1 and msg in lines[0], err
    assert "Traceback" not in err


def exit_code(main, argv):
    """main(argv)'s exit status, whether returned or raised (argparse's errors raise SystemExit)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


SPEEDUP = (r"\[speculation: ([\d.]+) tok/s vs ([\d.]+) tok/s without \(([\d.]+)x, medians of "
           + str(sd.COMPARE_ROUNDS) + r" runs each\), ")


def test_cli_compare_plain_prints_the_speedup_line(capsys):
    """The README's first command (its specdec.py part, run in this process on the shipped toy model)
    prints the speed-up line: both median rates, their ratio, and "same 64 tokens: yes" from comparing
    the runs' tokens; the text streamed is plain decoding's text."""
    readme = open(os.path.join(HERE, "README.md")).read()
    cmd = re.search(r"```bash\n(.*?)\n```", readme, re.S)[1].split(" && ")[-1]
    argv = shlex.split(cmd)
    assert argv[:2] == ["python", "specdec.py"] and "--compare-plain" in argv, cmd
    assert sd.main(argv[2:] + ["--device", "cpu"]) == 0
    out = capsys.readouterr()
    m = re.search("^" + SPEEDUP + r"same 64 tokens: yes\]$", out.err, re.M)
    assert m, out.err
    assert float(m[3]) == pytest.approx(float(m[1]) / float(m[2]), abs=0.006)
    assert "Mean acceptance length" in out.err
    plain = LLM(TOY, device="cpu", max_num_seqs=1)
    want = plain.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=64), False)
    assert out.out == want[0].outputs[0].text


def test_cli_compare_plain_says_when_tokens_differ(capsys):
    """The tokens check compares token lists: sampled runs (temperature 1) differ from the plain run, and
    the line says where and why; one token changed in one run of speedup_line's input makes it say no."""
    mtp = '{"method":"mtp","num_speculative_tokens":2}'
    argv = ["--model", TOY, "--device", "cpu", "--max-tokens", "16", "--temperature", "1"]
    assert sd.main(argv + ["--speculative-config", mtp, "--compare-plain"]) == 0
    err = capsys.readouterr().err
    differ = r"same tokens: no \(a run differs from the first plain run at token \d+\); sampled"
    assert re.search(SPEEDUP + differ, err), err
    plain = [(100.0, [5, 6, 7]), (120.0, [5, 6, 7]), (110.0, [5, 6, 7])]
    line = sd.speedup_line([(200.0, [5, 6, 7]), (300.0, [5, 6, 7]), (250.0, [5, 6, 7])], plain, True)
    assert line == ("speculation: 250.0 tok/s vs 110.0 tok/s without (2.27x, medians of 3 runs each), "
                    "same 3 tokens: yes")
    line = sd.speedup_line([(200.0, [5, 6, 7]), (300.0, [5, 9, 7]), (250.0, [5, 6, 7])], plain, True)
    assert line.endswith("same tokens: no (a run differs from the first plain run at token 1)")
    assert "sampled" not in line
    assert sd.speedup_line([(1.0, [5, 6])], [(1.0, [5, 6, 7])], True).endswith("at token 2)")
    assert sd.main(["--model", TOY, "--device", "cpu", "--max-tokens", "4", "--compare-plain"]) == 2
    err = capsys.readouterr().err
    assert "--compare-plain compares speculation with plain decoding" in err and len(err.splitlines()) == 1


def test_cli_help_documents_every_flag(monkeypatch, capsys):
    """--help exits 0 and lists, each with its help text, the CLI's flags and the engine flags README.md names
    (main's argparse in this process, COLUMNS at 80: argparse's width without a terminal, as a subprocess had)."""
    monkeypatch.setenv("COLUMNS", "80")
    assert exit_code(sd.main, ["--help"]) == 0
    r = capsys.readouterr()
    assert r.out.startswith("usage:"), r.err
    readme = open(os.path.join(HERE, "README.md")).read()
    named = set(re.findall(r"`(--[a-z-]+)`", readme[readme.index("Every flag"):readme.index("The CLI streams")]))
    assert {"--model", "--speculative-config", "--max-num-seqs", "--async-scheduling"} <= named
    for flag in named | {"--prompt", "--max-tokens", "--temperature", "--top-p", "--top-k", "--device", "--chat",
                         "--ignore-eos", "--no-thinking", "--compare-plain"}:
        m = re.search(r"^  (?:-\w, )?" + re.escape(flag) + r"\b[^\n]*?(?: {2,}|\n {10,})(\S[^\n]*)", r.out, re.M)
        assert m, flag                                                             # an option line with its help


# ==============================================================================================
# Tokenizer (vs HF tokenizers) and chat template
# ==============================================================================================

from specdec import IncrementalDecoder, Tokenizer, apply_chat_template  # noqa: E402
sys.path.insert(0, os.path.join(HERE, 'tools'))
from make_tokenizer import EXTRA_TEXT, NONSPECIAL, SPECIAL, make_tiny_tokenizer  # noqa: E402

SAMPLES = EXTRA_TEXT + [
    "def foo(x):\n    return x ** 2  # square\n\n\nclass Bar:\n\tpass\n",
    "It's, I'm, we'll, they've, you'd, IT'S, She'LL 'twas",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm</think>\n\nok<|endoftext|>",
    "x<|im_end|>y <think>z</think>", "<|im_end", "<<|im_start|>>", "", " ", "\n", "   \n\t \n  ", "a\u0301\u0302",
    "\u00a0nbsp\u2003em\u3000ideographic", "mixed日本語and English123漢字", "e\u0301\u0301\u0301", "ǅungla ﬁ ①②",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    from tokenizers import Tokenizer as HFTokenizer
    return HFTokenizer.from_file(os.path.join(tiny_dir, "tokenizer.json"))


def _read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _long_sample():
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "difflib.py"), encoding="utf-8") as f:
        return f.read()[:30000]  # not in the training corpus


def test_matches_hf_ids_and_decode(tok, hf):
    for text in SAMPLES + [_long_sample()]:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text[:80]
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids, skip_special=True) == hf.decode(ids, skip_special_tokens=True)


def test_allow_special_false_matches_hf(tok, hf, tiny_dir):
    from tokenizers import Tokenizer as HFTokenizer
    hf2 = HFTokenizer.from_file(os.path.join(tiny_dir, "tokenizer.json"))
    hf2.encode_special_tokens = True  # HF: special added tokens are encoded as text, others still matched
    for text in SAMPLES:
        assert tok.encode(text, allow_special=False) == hf2.encode(text, add_special_tokens=False).ids, text
    ids = tok.encode("a<|im_end|>b<think>", allow_special=False)
    assert tok.special_ids["<|im_end|>"] not in ids and tok.special_ids["<think>"] in ids


def test_roundtrip_nfc(tok):
    for text in SAMPLES + [_long_sample()]:
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)
    assert tok.encode("Cafe\u0301") == tok.encode("Caf\u00e9")


def test_attributes(tok, hf, tiny_dir):
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    assert tok.eos_token_id == tok.special_ids["<|im_end|>"] == hf.token_to_id("<|im_end|>")
    assert set(tok.special_ids) == set(SPECIAL + NONSPECIAL)
    assert tok.id_of("<think>") == hf.token_to_id("<think>")
    assert tok.id_of("Ġ") == tok.id_of(" ") == hf.token_to_id("Ġ")
    assert tok.token_bytes(tok.id_of("Ġ")) == b" " and tok.token_bytes(10 ** 9) == b""
    with pytest.raises(KeyError):
        tok.id_of("definitely not one token")
    # decode(skip_special) drops <|im_end|> (special) but keeps <think> (an added, non-special token)
    ids = tok.encode("<think>a</think><|im_end|>")
    assert tok.decode(ids, skip_special=True) == "<think>a</think>"
    os.remove(os.path.join(tiny_dir, "tokenizer_config.json"))  # eos falls back to <|im_end|>
    try:
        assert Tokenizer.from_dir(tiny_dir).eos_token_id == tok.special_ids["<|im_end|>"]
    finally:
        with open(os.path.join(tiny_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "<|im_end|>"}, f)
    t2 = Tokenizer(_read_json(os.path.join(tiny_dir, "tokenizer.json"))["model"]["vocab"], None,
                   {"<|endoftext|>": 5000})
    assert t2.eos_token_id == 5000 and t2.vocab_size == 5001


def test_ids_not_in_merge_order(tiny_dir, tmp_path):
    """Permute the ids of merged tokens (merges unchanged), write merges as "a b" strings and add an orphan
    token that no merge makes: HF must still be matched id for id."""
    from tokenizers import Tokenizer as HFTokenizer
    tj = _read_json(os.path.join(tiny_dir, "tokenizer.json"))
    vocab, merges = tj["model"]["vocab"], tj["model"]["merges"]
    merged = [a + b for a, b in merges]
    ids = sorted(vocab[t] for t in merged)
    vocab.update({t: i for t, i in zip(merged, reversed(ids))})  # reverse the merge order
    # an orphan X+Y: tiktoken would merge X, Y into it (and take it whole as a piece); HF BPE never does
    x, y = "Ġthe", "re"
    assert x in vocab and y in vocab and x + y not in vocab
    vocab[orphan := x + y] = len(vocab)
    for t in tj["added_tokens"]:
        t["id"] += 1
    tj["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    tok, hf = Tokenizer.from_dir(str(tmp_path)), HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok._rank_to_id is not None  # the merge-priority rank table is in use
    for text in SAMPLES + [_long_sample(), " there", "in there, theres"]:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text[:80]
        assert tok.decode(ids) == unicodedata.normalize("NFC", text)
    assert tok.decode([vocab[orphan]]) == " there" and tok.id_of(orphan) == vocab[orphan]
    assert tok.id_of("<|im_end|>") == hf.token_to_id("<|im_end|>")
    # with HF's ignore_merges a pre-token that is a vocab token is taken whole, also an orphan that no two
    # mergeable tokens spell, like "俱乐部" in Qwen3.5 (one that two tokens spell, like " there", can't be exact)
    tj["model"]["ignore_merges"] = True
    vocab[whole := "ĠÅĭÃ¶Å¾"] = vocab.pop(orphan)  # " ŋöž"
    assert not any(whole[:k] in vocab and whole[k:] in vocab for k in range(1, len(whole)))
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    tok, hf = Tokenizer.from_dir(str(tmp_path)), HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in SAMPLES + [_long_sample(), "in theres", " ŋöž", "a ŋöž, ŋöžu ŋö"]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids, text[:80]
    assert tok.encode(" ŋöž") == [vocab[whole]]


def test_gguf_style_constructor(tok, hf, tiny_dir):
    """GGUF gives a token list by id + "a b" merges + token types; merges=None means rank = id."""
    tj = _read_json(os.path.join(tiny_dir, "tokenizer.json"))
    tokens = sorted(tj["model"]["vocab"], key=tj["model"]["vocab"].get)
    added = {t["content"]: t["id"] for t in tj["added_tokens"]}
    for merges in ([" ".join(m) for m in tj["model"]["merges"]], None):
        t = Tokenizer({s: i for i, s in enumerate(tokens)}, merges, added, special=SPECIAL)
        for text in SAMPLES:
            assert t.encode(text) == hf.encode(text, add_special_tokens=False).ids


def test_rejects_unknown_structure(tiny_dir, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers
    base = _read_json(os.path.join(tiny_dir, "tokenizer.json"))

    def load(tj):
        (tmp_path / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
        return Tokenizer.from_dir(str(tmp_path))

    wp = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match="WordPiece"):
        load(json.loads(wp.to_str()))
    meta = json.loads(wp.to_str())
    meta["model"] = {"type": "BPE", "vocab": {"▁a": 0}, "merges": []}
    meta["pre_tokenizer"] = json.loads(pre_tokenizers.Metaspace().__getstate__())
    with pytest.raises(ValueError, match="pre-tokenizer"):
        load(meta)
    for patch, msg in [({"byte_fallback": True}, "byte_fallback"), ({"vocab": {"a": 0, "b": 1}}, "single-byte"),
                       ({"vocab": {**base["model"]["vocab"], "▁x": 9999}}, "byte alphabet"),
                       ({"merges": [["Ġ", "zzz"]]}, "not in the vocab")]:
        tj = json.loads(json.dumps(base))
        tj["model"].update(patch)
        with pytest.raises(ValueError, match=msg):
            load(tj)
    tj = json.loads(json.dumps(base))
    tj["normalizer"] = {"type": "NFKC"}
    with pytest.raises(ValueError, match="normalizer"):
        load(tj)


def test_incremental_decoder(tok):
    text = "Emoji 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 中文 é<|im_end|>🚀 done"
    ids = tok.encode(text)
    assert any(not tok.token_bytes(i).decode("utf-8", "ignore") for i in ids)  # some ids are partial chars
    dec = IncrementalDecoder(tok)
    pieces = [dec.add(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == dec.text == tok.decode(ids) == text == tok.decode(torch.tensor(ids))
    dec = IncrementalDecoder(tok, skip_special=True)  # lists of ids work too
    assert dec.add(ids[:3]) + dec.add(ids[3:]) == text.replace("<|im_end|>", "")
    dec = IncrementalDecoder(tok)  # a truncated character is held (and never released: vLLM's DecodeStream)
    part = tok.encode("😀")[:-1]
    assert dec.add(part) == "" and dec.text == ""


def test_chat_template_system_user():
    msgs = [{"role": "system", "content": "You are helpful. "}, {"role": "user", "content": "Hi!\n"}]
    base = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    assert apply_chat_template(msgs) == base + "<|im_start|>assistant\n<think>\n"
    assert apply_chat_template(msgs, enable_thinking=False) == base + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert apply_chat_template(msgs, add_generation_prompt=False) == base
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert apply_chat_template(parts, add_generation_prompt=False) == "<|im_start|>user\nab<|im_end|>\n"


def test_chat_template_multi_turn_reasoning():
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "<think>\nR2\n</think>\n\nA2"},
        {"role": "user", "content": "Q3"},
    ]
    head = ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n"
            "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
            "<|im_start|>assistant\nA2<|im_end|>\n<|im_start|>user\nQ3<|im_end|>\n")
    assert apply_chat_template(msgs) == head + "<|im_start|>assistant\n<think>\n"
    # preserve_thinking (Qwen3.6) keeps all historical reasoning
    kept = apply_chat_template(msgs, preserve_thinking=True, add_generation_prompt=False)
    assert "<|im_start|>assistant\n<think>\nR1\n</think>\n\nA1<|im_end|>\n" in kept
    assert "<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>\n" in kept
    # assistant turns after the last user query keep their reasoning (an empty one still gets the block)
    tail = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": " R "},
            {"role": "assistant", "content": "B"}]
    assert apply_chat_template(tail, add_generation_prompt=False) == (
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nR\n</think>\n\nA<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nB<|im_end|>\n")


def test_chat_template_tool_results_and_errors():
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "calling"},
            {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}]
    assert apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\ncalling<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response><|im_end|>\n")
    with pytest.raises(ValueError, match="system"):
        apply_chat_template([{"role": "user", "content": "Q"}, {"role": "system", "content": "S"}])
    with pytest.raises(ValueError, match="user query"):
        apply_chat_template([{"role": "system", "content": "S"}])
    with pytest.raises(ValueError, match="text"):
        apply_chat_template([{"role": "user", "content": [{"type": "image", "image": "x.png"}]}])


# ==============================================================================================
# GGUF reader / writer round trips
# ==============================================================================================

import numpy as np  # noqa: E402
from pathlib import Path  # noqa: E402
from specdec import GGUF_NO_MTP_MESSAGE, _gguf_tensor, _vhead_perm, read_gguf  # noqa: E402

# the writer: llama.cpp's converter (conversion/qwen.py) in miniature, the inverse of specdec's read_gguf
_HF_TOP, _HF_BLK, _HF_NEXTN = ({v: k for k, v in d.items()} for d in (sd._GGUF_TOP, sd._GGUF_BLK, sd._GGUF_NEXTN))


def gguf_has_mtp(src):
    """Whether a GGUF (a path, or the text_config read_gguf gave for it) has an MTP block."""
    if isinstance(src, dict):
        return src.get("mtp_num_hidden_layers", 0) > 0
    import gguf
    return any(".nextn." in t.name for t in gguf.GGUFReader(src).tensors)


def write_gguf(hf_config, tensors, out_path, ftype="F16", tokenizer_json_path=None, with_mtp=True):
    """Write HF text-only tensors as llama.cpp's converter does. ftype: F32 | F16 | BF16 | Q8_0;
    with_mtp=False is the converter's --no-mtp. Without a tokenizer.json, a byte-level vocab is written."""
    import gguf
    Q, c, g = gguf.GGMLQuantizationType, hf_config, hf_config.get
    qtype, ftype_id = {"F32": (Q.F32, 0), "F16": (Q.F16, 1), "BF16": (Q.BF16, 32), "Q8_0": (Q.Q8_0, 7)}[ftype]
    n, n_mtp = c["num_hidden_layers"], g("mtp_num_hidden_layers", 0) if with_mtp else 0
    hf = {k.replace("model.language_model.", "model."): t for k, t in tensors.items()
          if "visual." not in k and (n_mtp or not k.startswith("mtp."))}
    for k in [k for k in hf if k.endswith(".experts.0.gate_proj.weight")]:  # per-expert checkpoints -> fused
        p = k[: -len("0.gate_proj.weight")]
        st = lambda w: torch.stack([hf.pop(f"{p}{e}.{w}_proj.weight") for e in range(c["num_experts"])])  # noqa
        hf[p + "gate_up_proj"], hf[p + "down_proj"] = torch.cat([st("gate"), st("up")], 1), st("down")

    w = gguf.GGUFWriter(out_path, "qwen35moe" if "num_experts" in c else "qwen35")
    rp, hd = g("rope_parameters") or {}, c["head_dim"]
    for add, v in [  # the converter's keys, in its order; None = not written
            (w.add_type, gguf.GGUFType.MODEL), (w.add_block_count, n + n_mtp),
            (w.add_context_length, c["max_position_embeddings"]), (w.add_embedding_length, c["hidden_size"]),
            (w.add_feed_forward_length, g("intermediate_size")), (w.add_head_count, c["num_attention_heads"]),
            (w.add_head_count_kv, c["num_key_value_heads"]),
            (w.add_rope_dimension_sections, (list(rp.get("mrope_section", [11, 11, 10])) + [0] * 4)[:4]),
            (w.add_rope_freq_base, rp.get("rope_theta", g("rope_theta"))),
            (w.add_layer_norm_rms_eps, c["rms_norm_eps"]),
            (w.add_expert_count, g("num_experts")), (w.add_expert_used_count, g("num_experts_per_tok")),
            (w.add_key_length, hd), (w.add_value_length, hd), (w.add_file_type, ftype_id),
            (w.add_expert_feed_forward_length, g("moe_intermediate_size")),
            (w.add_expert_shared_feed_forward_length, g("shared_expert_intermediate_size")),
            (w.add_ssm_conv_kernel, c["linear_conv_kernel_dim"]), (w.add_ssm_state_size, c["linear_key_head_dim"]),
            (w.add_ssm_group_count, c["linear_num_key_heads"]), (w.add_ssm_time_step_rank, c["linear_num_value_heads"]),
            (w.add_ssm_inner_size, c["linear_value_head_dim"] * c["linear_num_value_heads"]),
            (w.add_full_attention_interval, g("full_attention_interval", 4)),
            (w.add_rope_dimension_count, int(hd * rp.get("partial_rotary_factor", g("partial_rotary_factor", 0.25)))),
            (w.add_nextn_predict_layers, n_mtp or None), (w.add_quantization_version, gguf.GGML_QUANT_VERSION)]:
        if v is not None:
            add(v)
    _write_vocab(w, c, tokenizer_json_path)

    for name, t in hf.items():
        t = t.float()
        if sd._is_shifted_norm(name):
            t = t + 1.0
        elif name.endswith(".A_log"):
            t = -torch.exp(t)
        t = sd._gdn_reorder(name, t.squeeze(1) if name.endswith(".conv1d.weight") else t, c, to_gguf=True)
        m = re.fullmatch(r"(model|mtp)\.layers\.(\d+)\.(.+)", name)
        b = m and int(m[2]) + (n if m[1] == "mtp" else 0)
        if m is None:  # mtp.fc and the 3 MTP norms go into every MTP block
            out = [(_HF_TOP[name], t)] if name in _HF_TOP else [
                (f"blk.{j}.{_HF_NEXTN[name]}", t) for j in range(n, n + n_mtp)]
        elif m[3] == "mlp.experts.gate_up_proj":  # [E, 2I, H] -> gate, up [E, I, H] (ne {H, I, E})
            i = t.shape[1] // 2
            out = [(f"blk.{b}.ffn_gate_exps.weight", t[:, :i]), (f"blk.{b}.ffn_up_exps.weight", t[:, i:])]
        else:
            out = [(f"blk.{b}.{_HF_BLK[m[3]]}", t)]
        for gname, t in out:  # the converter keeps 1-D tensors, norms, routers and the conv in F32
            a = t.contiguous().numpy()
            f32 = a.ndim <= 1 or gname.endswith("_norm.weight") or not gname.endswith(".weight") or re.search(
                r"\.(ffn_gate_inp|ffn_gate_inp_shexp|ssm_conv1d)\.weight$", gname)
            q = Q.F32 if f32 else qtype
            try:
                data = gguf.quants.quantize(a, q)
            except gguf.QuantError:  # row length not a multiple of the block: F16, as the converter does
                q, data = Q.F16, a.astype(np.float16)
            w.add_tensor(gname, data, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_vocab(w, c, tokenizer_json_path):
    """tokenizer.ggml.* as the converter writes them: model gpt2, pre qwen35, ids up to vocab_size, gaps [PADi]."""
    eos = c.get("eos_token_id")
    eos, merges, template = eos[0] if isinstance(eos, list) else eos, [], None
    if tokenizer_json_path is None:  # the GPT-2 byte alphabet (specdec's), then the specials
        vocab = dict(sd.BYTE_OF_CHAR)
        special = {s: True for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
        vocab.update({s: 256 + j for j, s in enumerate(special)})
    else:
        tj = json.loads(Path(tokenizer_json_path).read_text(encoding="utf-8"))
        vocab = dict(tj["model"]["vocab"]) | {a["content"]: a["id"] for a in tj.get("added_tokens", [])}
        merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]
        special = {a["content"]: a.get("special", False) for a in tj.get("added_tokens", [])}
        tc = Path(tokenizer_json_path).with_name("tokenizer_config.json")
        tc = json.loads(tc.read_text(encoding="utf-8")) if tc.exists() else {}
        e = tc.get("eos_token")  # the converter's SpecialVocab takes eos from tokenizer_config.json first
        eos, template = vocab.get(e.get("content") if isinstance(e, dict) else e, eos), tc.get("chat_template")
    rev = {i: t for t, i in vocab.items()}
    tokens = [rev.get(i, f"[PAD{i}]") for i in range(c["vocab_size"])]
    types = [5 if i not in rev else 1 if t not in special else 3 if special[t] or (t[:2], t[-2:]) == ("<|", "|>")
             else 4 for i, t in enumerate(tokens)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types(types)
    for add, v in ((w.add_token_merges, merges), (w.add_eos_token_id, eos), (w.add_chat_template, template)):
        if v or v == 0:
            add(v)


Q = gguf.GGMLQuantizationType if gguf else None

DENSE = dict(
    model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=4,
    intermediate_size=48,  # ffn_down rows of 48: Q8_0 falls back to F16
    num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, full_attention_interval=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.5, mrope_section=[3, 3, 2],
                         mrope_interleaved=True),
    rms_norm_eps=1e-6, vocab_size=300, tie_word_embeddings=False, mtp_num_hidden_layers=1,
    max_position_embeddings=4096, eos_token_id=258, hidden_act="silu", attn_output_gate=True, attention_bias=False)
MOE = {k: v for k, v in DENSE.items() if k != "intermediate_size"}
MOE.update(model_type="qwen3_5_moe_text", tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, shared_expert_intermediate_size=32)


def hf_tensors(c, seed=0, mtp=True):
    """Random tensors in HF text-only names and shapes (§3); asymmetric values so any wrong permutation shows."""
    g = torch.Generator().manual_seed(seed)
    R = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    H, hd, nh, nkv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    hk, hv, dk, dv = (c[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                      "linear_key_head_dim", "linear_value_head_dim"))
    C = 2 * hk * dk + hv * dv

    def layer(p, kind):
        t = {p + "input_layernorm.weight": 0.1 * R(H), p + "post_attention_layernorm.weight": 0.1 * R(H)}
        if kind == "full_attention":
            a = p + "self_attn."
            t.update({a + "q_proj.weight": R(2 * nh * hd, H), a + "k_proj.weight": R(nkv * hd, H),
                      a + "v_proj.weight": R(nkv * hd, H), a + "o_proj.weight": R(H, nh * hd),
                      a + "q_norm.weight": 0.1 * R(hd), a + "k_norm.weight": 0.1 * R(hd)})
        else:
            a = p + "linear_attn."
            t.update({a + "in_proj_qkv.weight": R(C, H), a + "in_proj_z.weight": R(hv * dv, H),
                      a + "in_proj_b.weight": R(hv, H), a + "in_proj_a.weight": R(hv, H),
                      a + "conv1d.weight": R(C, 1, c["linear_conv_kernel_dim"]), a + "dt_bias": R(hv),
                      a + "A_log": R(hv), a + "norm.weight": 1 + 0.1 * R(dv), a + "out_proj.weight": R(H, hv * dv)})
        m = p + "mlp."
        if "num_experts" in c:
            E, I, Is = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
            t.update({m + "gate.weight": R(E, H), m + "experts.gate_up_proj": R(E, 2 * I, H),
                      m + "experts.down_proj": R(E, H, I), m + "shared_expert.gate_proj.weight": R(Is, H),
                      m + "shared_expert.up_proj.weight": R(Is, H), m + "shared_expert.down_proj.weight": R(H, Is),
                      m + "shared_expert_gate.weight": R(1, H)})
        else:
            I = c["intermediate_size"]
            t.update({m + "gate_proj.weight": R(I, H), m + "up_proj.weight": R(I, H),
                      m + "down_proj.weight": R(H, I)})
        return t

    t = {"model.embed_tokens.weight": R(c["vocab_size"], H), "model.norm.weight": 0.1 * R(H)}
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = R(c["vocab_size"], H)
    for i, kind in enumerate(c["layer_types"]):
        t.update(layer(f"model.layers.{i}.", kind))
    if mtp:
        t.update({"mtp.fc.weight": R(H, 2 * H), "mtp.pre_fc_norm_embedding.weight": 0.1 * R(H),
                  "mtp.pre_fc_norm_hidden.weight": 0.1 * R(H), "mtp.norm.weight": 0.1 * R(H)})
        t.update(layer("mtp.layers.0.", "full_attention"))
    return t


def assert_close(name, got, ref, ftype):
    """Round-trip bounds: F32 exact (norms stored as 1 + w and A_log stored as -exp(A_log): 1e-6);
    F16 / BF16: unit roundoff 2^-11 / 2^-8 relative; Q8_0: 0.6 * row amax / 127 (half a step + f16 scale)."""
    got, ref = got.float(), ref.float()
    assert got.shape == ref.shape, name
    err = (got - ref).abs()
    if ftype == "F32":
        shifted = name.endswith(("norm.weight", "A_log")) or "pre_fc_norm" in name
        bound = torch.full_like(ref, 1e-6 if shifted else 0.0)
    elif ftype == "Q8_0" and ref.shape[-1] % 32 == 0:  # row amax: out_proj's blocks run over permuted columns
        bound = 0.6 * ref.abs().amax(-1, keepdim=True) / 127 + 1e-6
    else:  # F16, BF16 (and Q8_0 tensors that fell back to F16)
        bound = ref.abs() * (2.0 ** -8 if ftype == "BF16" else 2.0 ** -11) + 1e-6
    assert bool((err <= bound).all()), f"{name}: max err {err.max():.3g}"


@needs_gguf
@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("ftype", ["F32", "F16", "BF16", "Q8_0"])
def test_roundtrip(tmp_path, cfg, ftype):
    ref = hf_tensors(cfg)
    path = str(tmp_path / "m.gguf")
    write_gguf(cfg, ref, path, ftype)
    got_cfg, got, tok = read_gguf(path)
    assert got_cfg == cfg
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].dtype == torch.float32
        assert_close(k, got[k], ref[k], ftype)
    assert gguf_has_mtp(got_cfg) and gguf_has_mtp(path)


@needs_gguf
def test_stored_layout_follows_converter(tmp_path):
    """Look inside the file: names, V-head tiling (head g*R + r at r*H_k + g), norm +1, -exp(A_log), conv squeeze,
    expert split and ne order, metadata keys, and which tensors stay F32 / fall back to F16 at Q8_0."""
    c, ref = DENSE, hf_tensors(DENSE)
    path = str(tmp_path / "m.gguf")
    write_gguf(c, ref, path, "Q8_0")
    r = gguf.GGUFReader(path)
    raw = {t.name: t for t in r.tensors}
    meta = lambda k: r.fields[k].contents()  # noqa: E731
    assert meta("general.architecture") == "qwen35" and meta("qwen35.block_count") == 5
    assert meta("qwen35.nextn_predict_layers") == 1 and meta("qwen35.rope.dimension_sections") == [3, 3, 2, 0]
    assert meta("qwen35.ssm.inner_size") == 64 and meta("qwen35.ssm.group_count") == 2
    assert meta("qwen35.ssm.time_step_rank") == 4 and meta("qwen35.rope.dimension_count") == 16
    assert meta("tokenizer.ggml.model") == "gpt2" and meta("tokenizer.ggml.pre") == "qwen35"
    types = {n: t.tensor_type for n, t in raw.items()}
    assert types["blk.0.attn_norm.weight"] == Q.F32 and types["blk.0.ssm_conv1d.weight"] == Q.F32
    assert types["blk.0.ssm_a"] == Q.F32 and types["blk.0.ssm_dt.bias"] == Q.F32
    assert types["blk.0.ffn_down.weight"] == Q.F16 and types["blk.0.ffn_gate.weight"] == Q.Q8_0  # 48 % 32 != 0
    assert types["blk.4.nextn.eh_proj.weight"] == Q.Q8_0 and types["blk.4.nextn.enorm.weight"] == Q.F32
    assert list(raw["blk.0.ssm_conv1d.weight"].shape) == [4, 128]  # ne order
    # exact F32 values for the transforms that stay F32
    hk, R, dv = 2, 2, 16
    tiled = [g * R + r_ for r_ in range(R) for g in range(hk)]  # tiled position r*hk+g holds grouped head g*R+r
    L = "model.layers.0.linear_attn."
    f32 = lambda n: torch.from_numpy(np.array(raw[n].data))  # noqa: E731
    assert torch.allclose(f32("blk.0.ssm_a"), -torch.exp(ref[L + "A_log"][tiled]))
    assert torch.equal(f32("blk.0.ssm_dt.bias"), ref[L + "dt_bias"][tiled])
    assert torch.equal(f32("blk.0.ssm_norm.weight"), ref[L + "norm.weight"])  # gated norm: not shifted
    assert torch.allclose(f32("blk.0.attn_norm.weight"), ref["model.layers.0.input_layernorm.weight"] + 1)
    assert torch.allclose(f32("blk.4.nextn.enorm.weight"), ref["mtp.pre_fc_norm_embedding.weight"] + 1)
    assert torch.allclose(f32("blk.4.nextn.shared_head_norm.weight"), ref["mtp.norm.weight"] + 1)
    conv = f32("blk.0.ssm_conv1d.weight")  # [C, 4]; q, k channels untouched, v channels tiled by head
    w = ref[L + "conv1d.weight"][:, 0]
    assert torch.equal(conv[:64], w[:64])
    assert torch.equal(conv[64:].reshape(4, dv, 4), w[64:].reshape(4, dv, 4)[tiled])

    # the file's tensor names are what gguf-py's own name map gives for the HF names
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, 5)
    expect = {tmap.get_name(k.replace(".dt_bias", ".dt_proj.bias"), try_suffixes=(".weight", ".bias"))
              for k in ref if not k.startswith("mtp.")}
    assert expect == {n for n in raw if not n.startswith("blk.4.")}


@needs_gguf
def test_moe_experts_and_vhead_rows(tmp_path):
    c, ref = MOE, hf_tensors(MOE)
    path = str(tmp_path / "m.gguf")
    write_gguf(c, ref, path, "F32")
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert "output.weight" not in raw  # tied
    E, I, H = 4, 32, 64
    gu, down = ref["model.layers.0.mlp.experts.gate_up_proj"], ref["model.layers.0.mlp.experts.down_proj"]
    assert list(raw["blk.0.ffn_gate_exps.weight"].shape) == [H, I, E]  # ne {H, I, E}
    assert list(raw["blk.0.ffn_down_exps.weight"].shape) == [I, H, E]  # ne {I, H, E}
    assert np.array_equal(raw["blk.0.ffn_gate_exps.weight"].data, gu[:, :I].numpy())
    assert np.array_equal(raw["blk.0.ffn_up_exps.weight"].data, gu[:, I:].numpy())
    assert np.array_equal(raw["blk.0.ffn_down_exps.weight"].data, down.numpy())
    mtp_gu = ref["mtp.layers.0.mlp.experts.gate_up_proj"]
    assert np.array_equal(raw["blk.4.ffn_gate_exps.weight"].data, mtp_gu[:, :I].numpy())
    tiled = [0, 2, 1, 3]
    L = "model.layers.1.linear_attn."
    z = torch.from_numpy(np.array(raw["blk.1.attn_gate.weight"].data)).reshape(4, 16, H)
    assert torch.equal(z, ref[L + "in_proj_z.weight"].reshape(4, 16, H)[tiled])
    out = torch.from_numpy(np.array(raw["blk.1.ssm_out.weight"].data)).reshape(H, 4, 16)
    assert torch.equal(out, ref[L + "out_proj.weight"].reshape(H, 4, 16)[:, tiled])
    qkv = torch.from_numpy(np.array(raw["blk.1.attn_qkv.weight"].data))
    assert torch.equal(qkv[:64], ref[L + "in_proj_qkv.weight"][:64])
    assert torch.equal(qkv[64:].reshape(4, 16, H), ref[L + "in_proj_qkv.weight"][64:].reshape(4, 16, H)[tiled])
    b = torch.from_numpy(np.array(raw["blk.1.ssm_beta.weight"].data))
    assert torch.equal(b, ref[L + "in_proj_b.weight"][tiled])


@needs_gguf
def test_vhead_perm_formula():
    hk, R, d = 3, 2, 2  # grouped head g*R + r -> tiled position r*hk + g (§5.4)
    x = torch.arange(hk * R * d)
    y = _vhead_perm(x, 0, hk, R, d).view(hk * R, d)
    for g in range(hk):
        for r in range(R):
            assert torch.equal(y[r * hk + g], x.view(hk * R, d)[g * R + r])
    assert torch.equal(_vhead_perm(y.flatten(), 0, R, hk, d), x)  # inverse
    m = torch.randn(5, hk * R * d)  # along columns (out_proj)
    assert torch.equal(_vhead_perm(_vhead_perm(m, 1, hk, R, d), 1, R, hk, d), m)
    g, r = 2, 1
    assert torch.equal(_vhead_perm(m, 1, hk, R, d).view(5, hk * R, d)[:, r * hk + g], m.view(5, hk * R, d)[:, g * R + r])


@needs_gguf
def test_no_mtp(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_gguf(DENSE, hf_tensors(DENSE), path, "F16", with_mtp=False)  # = convert_hf_to_gguf.py --no-mtp
    cfg, t, _ = read_gguf(path)
    assert cfg["num_hidden_layers"] == 4 and cfg["mtp_num_hidden_layers"] == 0
    assert not any(k.startswith("mtp.") for k in t)
    assert not gguf_has_mtp(cfg) and not gguf_has_mtp(path)
    assert "--no-mtp" in GGUF_NO_MTP_MESSAGE and "mtp.*" in GGUF_NO_MTP_MESSAGE
    path2 = str(tmp_path / "m2.gguf")  # a checkpoint without mtp.* tensors, exported without --no-mtp
    write_gguf(DENSE, hf_tensors(DENSE, mtp=False), path2, "F16")
    cfg2, t2, _ = read_gguf(path2)
    assert cfg2["num_hidden_layers"] == 4 and cfg2["mtp_num_hidden_layers"] == 0 and set(t2) == set(t)


@needs_gguf
def test_dtype_and_per_expert_input(tmp_path):
    ref = hf_tensors(MOE)
    per_expert = {}
    for k, v in ref.items():  # transformers' save_pretrained form: per-expert 2-D tensors
        if k.endswith("experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            for e in range(4):
                per_expert[f"{p}{e}.gate_proj.weight"], per_expert[f"{p}{e}.up_proj.weight"] = v[e].chunk(2)
        elif k.endswith("experts.down_proj"):
            for e in range(4):
                per_expert[f"{k[:-len('down_proj')]}{e}.down_proj.weight"] = v[e]
        else:
            per_expert[k.replace("model.", "model.language_model.", 1)] = v.to(torch.bfloat16)
    path = str(tmp_path / "m.gguf")
    write_gguf(MOE, per_expert, path, "BF16")
    _, got, _ = read_gguf(path, dtype=torch.bfloat16)
    assert set(got) == set(ref)
    assert all(v.dtype == (torch.float32 if k.endswith("A_log") else torch.bfloat16) for k, v in got.items())
    k = "model.layers.2.mlp.experts.gate_up_proj"
    assert torch.equal(got[k], ref[k].bfloat16())


@needs_gguf
def test_tokenizer_as_transformers_for_vllm_users():
    """What vLLM users call on llm.get_tokenizer() (a transformers tokenizer in vLLM): tokenizer(text) and of a list,
    len, eos_token, batch_decode, get_vocab, convert_ids_to_tokens / convert_tokens_to_ids: transformers' answers on
    the shipped toy's tokenizer."""
    from transformers import AutoTokenizer
    ref, tok = AutoTokenizer.from_pretrained(TOY), LLM(TOY, device="cpu", max_model_len=64).get_tokenizer()
    texts = ["def fib(n):\n    return n", "città <think>x</think> <|im_end|>", ""]
    for t in texts + [texts]:
        assert tok(t) == dict(ref(t))
    assert len(tok) == len(ref) and tok.eos_token == ref.eos_token and tok.eos_token_id == ref.eos_token_id
    ids = [ref(t)["input_ids"] for t in texts]
    for skip in (False, True):
        assert tok.batch_decode(ids, skip_special_tokens=skip) == ref.batch_decode(ids, skip_special_tokens=skip)
    assert tok.get_vocab() == ref.get_vocab()
    some = [0, 255, 474, 7440, 8192, 8194, 8198]
    names = ref.convert_ids_to_tokens(some)
    assert tok.convert_ids_to_tokens(some) == names and tok.convert_ids_to_tokens(474) == names[2]
    assert tok.convert_tokens_to_ids(names) == some and tok.convert_tokens_to_ids(names[3]) == 7440


def test_tokenizer(tmp_path):
    tj = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "\u0120": 3, "\u0120ab": 4},
                    "merges": ["a b", ["\u0120", "ab"]]},
          "added_tokens": [{"id": 5, "content": "<|endoftext|>", "special": True},
                           {"id": 6, "content": "<|im_end|>", "special": True},
                           {"id": 7, "content": "<think>", "special": False}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    tc = {"eos_token": "<|im_end|>", "chat_template": "{{x}}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tc))
    path = str(tmp_path / "m.gguf")
    write_gguf(DENSE, hf_tensors(DENSE), path, "F16", str(tmp_path / "tokenizer.json"))
    cfg, _, tok = read_gguf(path)
    assert tok["tokens"][:8] == ["a", "b", "ab", "\u0120", "\u0120ab", "<|endoftext|>", "<|im_end|>", "<think>"]
    assert len(tok["tokens"]) == 300 and tok["tokens"][299] == "[PAD299]"
    assert tok["token_types"][:8] == [1, 1, 1, 1, 1, 3, 3, 4] and tok["token_types"][8] == 5
    assert tok["merges"] == ["a b", "\u0120 ab"]
    assert tok["model"] == "gpt2" and tok["pre"] == "qwen35" and tok["chat_template"] == "{{x}}"
    assert tok["eos_token_id"] == 6 == cfg["eos_token_id"] and tok["eos_token"] == "<|im_end|>"
    assert tok["vocab"] == tj["model"]["vocab"]
    assert tok["added_tokens"] == {"<|endoftext|>": 5, "<|im_end|>": 6, "<think>": 7}
    assert tok["special_tokens"] == ["<|endoftext|>", "<|im_end|>"]
    assert tok["stop_token_ids"] == [5, 6] and r"[\p{L}\p{M}]+" in tok["pattern"]
    path3 = str(tmp_path / "m3.gguf")
    write_gguf(DENSE, hf_tensors(DENSE), path3, "F16")
    _, _, tok3 = read_gguf(path3)
    assert len(tok3["vocab"]) == 256 and tok3["tokens"][32] == "\u0120" and tok3["tokens"][65] == "A"
    assert tok3["eos_token_id"] == 258 and tok3["eos_token"] == "<|im_end|>"


@needs_gguf
def test_k_quants_and_bad_arch(tmp_path):
    rng = np.random.default_rng(0)
    path = str(tmp_path / "q.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for qt, off, scales in ((Q.Q4_K, 0, [0.01, 0.001]), (Q.Q5_K, 0, [0.01, 0.001]), (Q.Q6_K, 208, [0.01])):
        ts = gguf.GGML_QUANT_SIZES[qt][1]  # bytes per 256-value super-block; f16 scales at `off`
        blocks = rng.integers(0, 256, size=(3, 2, ts), dtype=np.uint8)  # 3 rows x 2 super-blocks
        blocks[..., off:off + 2 * len(scales)] = np.array(scales, np.float16).view(np.uint8)
        w.add_tensor(qt.name, blocks.reshape(3, 2 * ts), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for rt in gguf.GGUFReader(path).tensors:
        t = _gguf_tensor(rt)
        assert t.shape == (3, 512) and t.dtype == torch.float32 and torch.isfinite(t).all()
        assert np.array_equal(t.numpy(), gguf.quants.dequantize(rt.data, rt.tensor_type))
    with pytest.raises(ValueError, match="llama"):
        read_gguf(path)


@needs_gguf
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_transformers_logits_roundtrip(tmp_path, moe):
    """A real transformers Qwen3.5 model's state_dict -> GGUF -> read_gguf -> load_state_dict(strict): same logits."""
    tf = pytest.importorskip("transformers")
    kw = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              vocab_size=300, max_position_embeddings=512, tie_word_embeddings=False)
    if moe:
        cfg, M = tf.Qwen3_5MoeTextConfig(**kw, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32), tf.Qwen3_5MoeForCausalLM
    else:
        cfg, M = tf.Qwen3_5TextConfig(**kw, intermediate_size=48), tf.Qwen3_5ForCausalLM
    torch.manual_seed(0)
    m = M(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in n else 0.3))
    path = str(tmp_path / "m.gguf")
    write_gguf({**cfg.to_dict(), "mtp_num_hidden_layers": 0}, m.state_dict(), path, "F32")
    got_cfg, tensors, _ = read_gguf(path)
    assert got_cfg["layer_types"] == cfg.layer_types
    m2 = M(cfg).eval()
    m2.load_state_dict(tensors, strict=True)
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(m2(ids).logits, m(ids).logits, rtol=1e-5, atol=1e-5)


# ==============================================================================================
# GPU (skipped without CUDA)
# ==============================================================================================

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("cfg", [None, {"method": "mtp", "num_speculative_tokens": 2},
                                 {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}])
def test_gpu_graphs_equal_eager(cfg, tiny_spec):
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = []
    for eager in (True, False):
        llm = LLM(model=tiny_spec, device="cuda", dtype="float32", speculative_config=cfg, enforce_eager=eager)
        outs.append([o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, sp)])
    assert outs[0] == outs[1]


@cuda
def test_gpu_ngram_device_equals_host():
    check_ngram_device_equals_host("cuda", rounds=20, B=8, lengths=(2, 4, 33, 700, 8192))


@cuda
def test_gpu_bf16_spec_equals_plain(tiny_spec):
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(model=tiny_spec, device="cuda").generate(SPEC_PROMPTS[:1], sp)]
    llm = LLM(model=tiny_spec, device="cuda", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS[:1], sp)] == ref
    assert llm.engine.stats.mean_acceptance_length >= 1.5                     # multi-token steps


@cuda
def test_gpu_synthetic_acceptance_rates(tiny):
    """test_synthetic_acceptance_rates with CUDA graphs, where a synthetic step is one captured graph (as a real greedy step is) whose
    uniforms come from the device's generator, new at every replay."""
    runner = check_synthetic_acceptance(tiny, "cuda")
    assert {key[0] for key in runner.graphs.graphs} == {"spec-step"}


# ==============================================================================================
# Server (server.py in a subprocess) and the serving benchmark
# ==============================================================================================

NGRAM = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":1,"prompt_lookup_max":2}'
ENV = dict(os.environ, OMP_NUM_THREADS="1")  # a tiny model: intra-op threads only spin against the HTTP threads


# ==============================================================================================
# Server processes and raw HTTP
# ==============================================================================================

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, log_dir, *args, prelude=None, env=None, command=None):
        """server.py in a subprocess; `prelude`: Python run first in that process (e.g. to inject faults);
        `command`: the arguments as a user types them (instead of --model MODEL --device cpu ARGS)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = os.path.join(log_dir, f"server-{self.port}.log")
        main = [os.path.join(ROOT, "server.py")] if prelude is None else \
            ["-c", f"{prelude}\nimport sys, server\nsys.exit(server.main())"]
        args = [*command] if command is not None else ["--model", model, "--device", "cpu", *args]
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen([sys.executable, *main, *args, "--port", str(self.port)], stdout=fh,
                                         stderr=subprocess.STDOUT, cwd=ROOT, env=dict(ENV, **(env or {})))
        deadline = time.time() + 120
        while True:
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("server did not start:\n" + open(self.log).read())
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=1).status == 200:
                    return
            except OSError:
                time.sleep(0.1)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def request(self, method, path, body=None, headers=None, timeout=60):
        """-> (status, headers, body bytes); a dict body is sent as JSON."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body)
                headers = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()

    def post(self, path, body, **kw):
        status, _, data = self.request("POST", path, body, **kw)
        return status, json.loads(data) if data else None

    def metrics(self):
        status, headers, data = self.request("GET", "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse_prometheus(data.decode())


def sse_events(data):
    """The bench's framing: split on blank lines, strip 'data: ', stop at [DONE]."""
    events = [e for e in data.decode().split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]" and data.endswith(b"data: [DONE]\n\n")
    return [json.loads(e[6:]) for e in events[:-1]]


def open_stream(srv, body):
    """Start a streaming completion; returns (connection, response) once the headers are in."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def parse_prometheus(text):
    """Text format 0.0.4 -> {(name, ((label, value), ...)): float}; checks TYPE lines and histogram invariants."""
    types, out = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram") and name not in types
            types[name] = kind
            continue
        if not line or line.startswith("# HELP "):
            continue
        m = SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        name, labels, value = m[1], tuple(re.findall(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"', m[2] or "")), float(m[3])
        family = next(n for n in (name, re.sub(r"_(bucket|sum|count)$", "", name)) if n in types)
        assert (types[family] == "counter") == name.endswith("_total")  # a counter's TYPE line names it _total
        out[(name, labels)] = value
    for name, kind in types.items():  # cumulative buckets, +Inf == _count
        if kind == "histogram":
            buckets = [v for (n, _), v in out.items() if n == name + "_bucket"]
            assert buckets == sorted(buckets) and buckets[-1] == metric(out, name + "_count")
    return out


def wait_idle(srv, timeout=5):
    """/metrics once the gauges (a snapshot taken after each engine step) show nothing running or waiting."""
    t0 = time.time()
    while True:
        m = srv.metrics()
        if metric(m, "vllm:num_requests_running") == metric(m, "vllm:num_requests_waiting") == 0:
            return m
        assert time.time() - t0 < timeout, "requests still running or waiting"
        time.sleep(0.05)


def metric(samples, name, **labels):
    """Sum of a metric's samples whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, str(x)) in ls for k, x in labels.items()))


def srv_model(srv):
    return json.loads(srv.request("GET", "/v1/models")[2])["data"][0]["root"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_server")), predictable=True)  # ngram accepts


def server_fixture(name, *flags, prelude=None):
    """A module-scoped fixture called `name`: a server on the tiny checkpoint started with these flags (and
    prelude, code run before it starts), stopped after the module's tests."""
    @pytest.fixture(scope="module", name=name)
    def running(tiny_model, tmp_path_factory):
        s = Server(tiny_model, str(tmp_path_factory.mktemp("logs")), *flags, prelude=prelude)
        yield s
        s.stop()
    return running


srv = server_fixture("srv", "--max-num-seqs", "4", "--served-model-name", "tiny")
# one slot, a queue of one, an API key
srv_small = server_fixture("srv_small", "--max-num-seqs", "1", "--max-queue", "1", "--api-key", "sekrit")
srv_spec = server_fixture("srv_spec", "--speculative-config", NGRAM, "--served-model-name", "tiny")


# ==============================================================================================
# Endpoints through the official client
# ==============================================================================================

def test_health_and_models(srv, tiny_model):
    status, headers, data = srv.request("GET", "/health")
    assert status == 200 and data == b""
    status, _, data = srv.request("GET", "/v1/models")
    card = json.loads(data)["data"][0]
    assert status == 200 and json.loads(data)["object"] == "list"
    assert card["id"] == "tiny" and card["object"] == "model" and card["owned_by"] == "vllm"
    assert card["permission"][0]["object"] == "model_permission" and card["permission"][0]["allow_sampling"]
    assert card["root"] == tiny_model and card["parent"] is None and card["max_model_len"] == 4096


def test_sampling_fields_on_both_endpoints(srv_spec, tiny_model):
    """Issue 24's fields through both endpoints (ngram speculation on): the whole set is accepted; a greedy
    logit_bias of +100 on one token makes the answer that token repeated; allowed_token_ids keeps the answer
    inside them; a JSON schema (structured_outputs, guided_json, response_format json_schema) gives text that
    parses against it; n = 3 gives 3 choices, seeded and reproducible, streamed with their indexes too;
    best_of keeps n of them."""
    tok = sd.Tokenizer.from_dir(tiny_model)
    x, y = tok.encode("x")[0], tok.encode("y")[0]

    def answer(path, out, i=0):
        c = out["choices"][i]
        return c["text"] if path == "/v1/completions" else c["message"]["content"]

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "bb"]}},
              "required": ["ok", "kind"], "additionalProperties": False}
    endpoints = (("/v1/completions", {"prompt": "hello"}), ("/v1/chat/completions", {"messages": CHAT}))
    for path, base in endpoints:
        every = dict(base, max_tokens=6, temperature=0.8, seed=3, presence_penalty=1.5, frequency_penalty=0.5,
                     repetition_penalty=1.1, min_p=0.05, top_k=0, min_tokens=2, logit_bias={"5": 2},
                     bad_words=["the"], include_stop_str_in_output=True, skip_special_tokens=False,
                     spaces_between_special_tokens=False, ignore_eos=True,
                     allowed_token_ids=list(range(1000)))
        status, out = srv_spec.post(path, every)
        assert status == 200 and out["usage"]["completion_tokens"] == 6, out
        status, out = srv_spec.post(path, dict(base, max_tokens=5, temperature=0, logit_bias={str(x): 100},
                                               ignore_eos=True))
        assert status == 200 and answer(path, out) == "x" * 5, out
        status, out = srv_spec.post(path, dict(base, max_tokens=8, temperature=1.0, seed=1, ignore_eos=True,
                                               allowed_token_ids=[x, y]))
        assert status == 200 and set(answer(path, out)) <= {"x", "y"} and len(answer(path, out)) == 8, out
        strict = {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}
        status, out = srv_spec.post(path, dict(base, max_tokens=40, temperature=0, **strict))
        text = answer(path, out)
        assert status == 200 and out["choices"][0]["finish_reason"] == "stop", out
        obj = json.loads(text)
        assert set(obj) == {"ok", "kind"} and isinstance(obj["ok"], bool) and obj["kind"] in ("a", "bb"), text
        texts = []  # the three spellings of one schema (whitespace allowed: the random model likes it) agree
        named = {"name": "s", "schema": schema}
        for constraint in ({"structured_outputs": {"json": schema}}, {"guided_json": schema},
                           {"response_format": {"type": "json_schema", "json_schema": named}}):
            status, out = srv_spec.post(path, dict(base, max_tokens=12, temperature=0, **constraint))
            assert status == 200, out
            texts.append(answer(path, out))
        assert texts[0].startswith("{") and texts[0] == texts[1] == texts[2], texts
        body = dict(base, max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
        status, out = srv_spec.post(path, body)
        assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert out["usage"]["completion_tokens"] == 18
        assert srv_spec.post(path, body)[1]["choices"] == out["choices"]
        status, best = srv_spec.post(path, dict(body, n=1, best_of=3))
        assert status == 200 and len(best["choices"]) == 1
        assert answer(path, best) in [answer(path, out, i) for i in range(3)]
        raw = srv_spec.request("POST", path, dict(body, stream=True))[2]
        chunks = [c for e in sse_events(raw) for c in e["choices"]]
        for i in range(3):
            mine = [c for c in chunks if c["index"] == i]
            got = "".join(c["text"] if "text" in c else c["delta"].get("content") or "" for c in mine)
            assert got == answer(path, out, i), (i, got)



def test_completions_batch_of_prompts(srv):
    """/v1/completions with a list of prompts (strings or token-id lists), as vLLM serves it: n choices per prompt,
    prompt i's at indices i * n .. i * n + n - 1, each what that prompt alone gets (greedy; seeded samples), echo
    per prompt, the usage summed over prompts (each prompt's tokens counted once); streamed the same, every chunk
    naming its index, the usage chunk last."""
    ids = srv.post("/tokenize", {"prompt": "one two three"})[1]["tokens"]
    batch = ["hello there", ids, "a b c a b"]
    body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    alone = [srv.post("/v1/completions", dict(body, prompt=p))[1] for p in batch]
    status, out = srv.post("/v1/completions", dict(body, prompt=batch, echo=True))
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2]
    for p, a, c in zip(batch, alone, out["choices"]):
        echo = p if isinstance(p, str) else "one two three"
        assert c["text"] == echo + a["choices"][0]["text"], (p, c)
    assert out["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert out["usage"]["completion_tokens"] == 15
    sampled = dict(body, temperature=1.0, seed=5, n=2)
    status, out = srv.post("/v1/completions", dict(sampled, prompt=batch[::2]))
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for i, p in enumerate(batch[::2]):
        one = srv.post("/v1/completions", dict(sampled, prompt=p))[1]["choices"]
        assert [c["text"] for c in out["choices"][2 * i:2 * i + 2]] == [c["text"] for c in one], p
    raw = srv.request("POST", "/v1/completions", dict(sampled, prompt=batch[::2], stream=True,
                                                        stream_options={"include_usage": True}))[2]
    events = sse_events(raw)
    chunks = [c for e in events[:-1] for c in e["choices"]]
    for i in range(4):
        assert "".join(c["text"] for c in chunks if c["index"] == i) == out["choices"][i]["text"], i
    assert events[-1]["choices"] == [] and events[-1]["usage"] == out["usage"]


def test_openai_client_completions(srv):
    import openai
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    full = client.completions.create(model="tiny", prompt="def fib(n):", max_tokens=12, temperature=0)
    assert full.id.startswith("cmpl-") and full.object == "text_completion" and full.model == "tiny"
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert full.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="tiny", prompt="def fib(n):", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]].count("length") == 1
    assert chunks[-2].choices[0].finish_reason == "length"
    # token-id prompt, echo, logprobs
    ids = [10, 20, 30, 40]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.usage.prompt_tokens == 4 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(5)]
    assert all(len(t) >= 2 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    e = client.completions.create(model="tiny", prompt="hello there", max_tokens=3, temperature=0, echo=True)
    assert e.choices[0].text.startswith("hello there") and len(e.choices[0].text) > len("hello there")


def test_openai_client_chat(srv):
    import openai
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_completion_tokens=10, temperature=0,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True})
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion" and msg.role == "assistant"
    assert full.usage.completion_tokens == 10 and full.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == msg.content
    assert [c.choices[0].finish_reason for c in chunks[:-1]].count("length") == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    thinking = client.chat.completions.create(**dict(kw, extra_body={"ignore_eos": True}))  # enable_thinking default
    from specdec import Tokenizer, apply_chat_template
    tok = Tokenizer.from_dir(srv_model(srv))
    n_prompt = lambda think: len(tok.encode(apply_chat_template(kw["messages"], True, think)))
    assert (full.usage.prompt_tokens, thinking.usage.prompt_tokens) == (n_prompt(False), n_prompt(True))
    lp = client.chat.completions.create(**kw, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert len(lp) == 10 and all(len(t.top_logprobs) == 2 and t.bytes for t in lp)
    assert lp[0].top_logprobs[0].logprob >= lp[0].top_logprobs[1].logprob
    no_gen = srv.post("/v1/chat/completions", dict(kw["extra_body"], messages=kw["messages"], max_tokens=2,
                                                   add_generation_prompt=False))[1]
    assert no_gen["usage"]["prompt_tokens"] < full.usage.prompt_tokens
    # chat_template_kwargs go over the template's own arguments, as vLLM merges them (not the messages)
    over = {"enable_thinking": False, "add_generation_prompt": False}
    st, body = srv.post("/v1/chat/completions", dict(messages=kw["messages"], max_tokens=2, chat_template_kwargs=over))
    assert st == 200 and body["usage"]["prompt_tokens"] == no_gen["usage"]["prompt_tokens"]
    st, body = srv.post("/v1/chat/completions", dict(messages=kw["messages"], max_tokens=2,
                                                     chat_template_kwargs={"messages": []}))
    check_error(st, body, 400, "chat_template_kwargs", "chat_template_kwargs may not set messages")


def test_chat_continue_and_echo_through_the_server(srv):
    """continue_final_message and chat's echo on /v1/chat/completions, as vLLM: the prompt is the chat less what
    follows the final (assistant) message's text, the answer equals /v1/completions' on that prompt, and with
    echo the begun text leads the content (streamed: in a chunk of its own after the role's); echo after a
    user's message adds nothing; both continue_final_message and add_generation_prompt: vLLM's 400."""
    from specdec import Tokenizer, apply_chat_template
    tok = Tokenizer.from_dir(srv_model(srv))
    msgs = [{"role": "user", "content": "write fib"}, {"role": "assistant", "content": "def fib(n):"}]
    prompt = apply_chat_template(msgs, False, True)[:-len("<|im_end|>\n")]
    body = dict(messages=msgs, add_generation_prompt=False, continue_final_message=True, max_tokens=6,
                temperature=0, ignore_eos=True)
    st, plain = srv.post("/v1/completions", dict(prompt=prompt, max_tokens=6, temperature=0, ignore_eos=True))
    assert st == 200
    text = plain["choices"][0]["text"]
    st, got = srv.post("/v1/chat/completions", body)
    assert st == 200 and got["usage"]["prompt_tokens"] == len(tok.encode(prompt)) == plain["usage"]["prompt_tokens"]
    assert got["choices"][0]["message"]["content"] == text
    assert "prompt_logprobs" not in got
    st, echoed = srv.post("/v1/chat/completions", dict(body, echo=True))
    assert st == 200 and echoed["choices"][0]["message"]["content"] == "def fib(n):" + text
    plps = echoed["prompt_logprobs"]  # echo implies the prompt's logprobs (top_logprobs of them: 0)
    assert len(plps) == got["usage"]["prompt_tokens"] and plps[0] is None and all(len(p) == 1 for p in plps[1:])
    usage = {"include_usage": True, "continuous_usage_stats": True}
    status, _, data = srv.request("POST", "/v1/chat/completions", dict(body, echo=True, stream=True,
                                                                       stream_options=usage))
    events = [e for e in sse_events(data) if e["choices"]]
    chunks = [e["choices"][0]["delta"] for e in events]
    assert status == 200 and chunks[0] == {"role": "assistant", "content": ""}
    assert chunks[1] == {"content": "def fib(n):"}
    assert [e["usage"]["completion_tokens"] for e in events[:2]] == [0, 0]
    assert "".join(c.get("content") or "" for c in chunks) == "def fib(n):" + text
    asked = dict(messages=msgs[:1], max_tokens=3, temperature=0, ignore_eos=True)
    answers = [srv.post("/v1/chat/completions", dict(asked, echo=echo))[1]["choices"][0]["message"]["content"]
               for echo in (False, True)]
    assert answers[0] == answers[1]
    # without a generation prompt the answer's role is the last message's (vLLM), so echo repeats its text
    st, own = srv.post("/v1/chat/completions", dict(asked, add_generation_prompt=False, echo=True))
    assert st == 200 and own["choices"][0]["message"]["role"] == "user"
    assert own["choices"][0]["message"]["content"].startswith("write fib")
    st, both = srv.post("/v1/chat/completions", dict(body, add_generation_prompt=True))
    check_error(st, both, 400, "continue_final_message",
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    st, both = srv.post("/v1/chat/completions", dict(messages=msgs, chat_template_kwargs={
        "continue_final_message": True}))
    check_error(st, both, 400, "chat_template_kwargs", "Cannot set both `continue_final_message`")


def test_prompt_fields_through_the_server(srv):
    """prompt_logprobs on both endpoints (completions: in the choice; chat: beside the choices), echo with
    logprobs (the prompt's tokens lead the logprobs, the first with none; streamed too),
    truncate_prompt_tokens on both, and vLLM's messages for bad values. The prompt logprobs equal the offline
    API's on the same model."""
    ids = [10, 20, 30, 40, 50, 60]
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0}
    status, r = srv.post("/v1/completions", dict(body, prompt_logprobs=2))
    plps = r["choices"][0]["prompt_logprobs"]
    assert status == 200 and plps[0] is None and len(plps) == len(ids)
    llm = LLM(srv_model(srv), device="cpu")
    ref = llm.generate(ids, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2), use_tqdm=False)[0]
    for got, want in zip(plps[1:], ref.prompt_logprobs[1:]):
        assert list(got) == [str(t) for t in want] and all(
            abs(got[str(t)]["logprob"] - v.logprob) < 1e-4 and got[str(t)]["rank"] == v.rank and
            got[str(t)]["decoded_token"] == v.decoded_token for t, v in want.items())
    status, e = srv.post("/v1/completions", dict(body, echo=True, logprobs=1))
    lp = e["choices"][0]["logprobs"]
    tok = llm.get_tokenizer()
    assert lp["tokens"][:6] == [tok.decode([t]) for t in ids] and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and len(lp["tokens"]) == 9
    assert e["choices"][0]["prompt_logprobs"][0] is None
    assert all(abs(lp["token_logprobs"][i] - ref.prompt_logprobs[i][t].logprob) < 1e-4
               for i, t in enumerate(ids[1:], 1))
    assert e["choices"][0]["text"].startswith(tok.decode(ids))
    assert lp["text_offset"][6] == len(tok.decode(ids))
    status, _, data = srv.request("POST", "/v1/completions", dict(body, echo=True, logprobs=1, stream=True))
    chunks = [c["choices"][0]["logprobs"] for c in sse_events(data)]
    assert status == 200 and sum((c["token_logprobs"] for c in chunks), []) == lp["token_logprobs"]
    status, c = srv.post("/v1/completions", dict(body, truncate_prompt_tokens=2, echo=True))
    assert c["usage"]["prompt_tokens"] == 2 and c["choices"][0]["text"].startswith(tok.decode(ids[-2:]))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, whole = srv.post("/v1/chat/completions", chat)
    status, cut = srv.post("/v1/chat/completions", dict(chat, truncate_prompt_tokens=4, prompt_logprobs=0))
    assert status == 200 and whole["usage"]["prompt_tokens"] > 4 and cut["usage"]["prompt_tokens"] == 4
    assert len(cut["prompt_logprobs"]) == 4 and all(len(d) == 1 for d in cut["prompt_logprobs"][1:])
    chat_body = dict(chat, stream=True, prompt_logprobs=1)
    for path, bad, param, fragment in [
            ("/v1/completions", dict(body, prompt_logprobs=1, stream=True), "prompt_logprobs",
             "`prompt_logprobs` are not available when `stream=True`."),
            ("/v1/chat/completions", chat_body, "prompt_logprobs", "are not available when `stream=True`."),
            ("/v1/completions", dict(body, prompt_logprobs=-2), "prompt_logprobs",
             "`prompt_logprobs` must be a positive value or -1."),
            ("/v1/completions", dict(body, prompt_logprobs=21), "prompt_logprobs",
             "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
            ("/v1/completions", dict(body, prompt_logprobs="two"), "prompt_logprobs", "must be an integer"),
            ("/v1/completions", dict(body, truncate_prompt_tokens=0), "truncate_prompt_tokens",
             "truncate_prompt_tokens must be an integer >= 1 or -1, got 0"),
            ("/v1/chat/completions", dict(chat, truncate_prompt_tokens=5000), "truncate_prompt_tokens",
             "truncate_prompt_tokens value (5000) is greater than max_model_len (4096)")]:
        check_error(*srv.post(path, bad), 400, param, fragment)


def test_sse_framing_and_stop_strings(srv):
    body = {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = srv.post("/v1/completions", body)[1]["choices"][0]["text"]
    status, headers, data = srv.request("POST", "/v1/completions", dict(body, stream=True,
                                                                         stream_options={"include_usage": True}))
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    chunks = sse_events(data)
    assert len({c["id"] for c in chunks}) == 1 and chunks[-1]["choices"] == [] and chunks[-1]["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert sum(c["choices"][0]["finish_reason"] is not None for c in chunks[:-1]) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == full
    # a stop string inside the greedy output: text ends before it, and no prefix of it was streamed
    stop = full[10:13]
    want = full[:full.index(stop)]
    r = srv.post("/v1/completions", dict(body, stop=["never-matches", stop]))[1]["choices"][0]
    assert (r["text"], r["finish_reason"], r["stop_reason"]) == (want, "stop", stop)
    chunks = sse_events(srv.request("POST", "/v1/completions", dict(body, stop=stop, stream=True))[2])
    assert "".join(c["choices"][0]["text"] for c in chunks) == want and chunks[-1]["choices"][0]["stop_reason"] == stop
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # a stop token id: generation ends on (and includes) its first occurrence, stop_reason is the id
    from specdec import Tokenizer
    tok = Tokenizer.from_dir(srv_model(srv))
    tokens = srv.post("/v1/completions", dict(body, logprobs=0))[1]["choices"][0]["logprobs"]["tokens"]
    t = next(t for t in tokens[3:] if t.isascii() and len(tok.encode(t)) == 1)
    r = srv.post("/v1/completions", dict(body, stop_token_ids=[tok.encode(t)[0]]))[1]
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] == tok.encode(t)[0]
    assert r["usage"]["completion_tokens"] == tokens.index(t) + 1


# ==============================================================================================
# Errors
# ==============================================================================================

BAD = [  # (path, body, status, param or None, message fragment)
    ("/v1/completions", {"prompt": "x", "max_tokens": "5x"}, 400, "max_tokens", "must be an integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", "must be an integer, got 2.5"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature", "non-negative"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "must be a number"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "x", "n": 2, "temperature": 0}, 400, "n", "n must be 1 when using greedy"),
    ("/v1/completions", {"prompt": ""}, 400, None, "empty"),
    ("/v1/completions", {"prompt": []}, 400, None, "empty"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "required"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt", "token ids"),
    ("/v1/completions", {"prompt": ["a", 5]}, 400, "prompt", "a list of either"),
    ("/v1/completions", {"prompt": ["a", [1, 2], []]}, 400, None, "empty"),
    ("/v1/completions", {"prompt": ["a"] * 70, "max_tokens": 2}, 400, "prompt",
     "this request needs 70 sequences (70 prompt(s) x 1 samples), more than the server takes at once: 68"),
    ("/v1/completions", {"prompt": [5000]}, 400, None, "out of range"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, None,
     "This model's maximum context length is 4096 tokens. However, you requested 5001 tokens"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream=True"),
    ("/v1/completions", {"prompt": "x", "logprobs": -2}, 400, "logprobs", "`logprobs` must be a positive value or -1."),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs",  # -1: the whole vocabulary, above 20
     "Requested sample logprobs of 1024, which is greater than max allowed: 20"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop", "stop"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", "must be in [-2, 2]"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "The model `gpt-4` does not exist."),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", "`logprobs` must be set to true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}, 400,
     "messages", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000}, 400,
     None, "maximum context length"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model",
     "The model `nope` does not exist."),
    # found by fuzzing the server (session 34): each was accepted, or a 500, before
    ("/v1/completions", {"prompt": "x", "stop": ["a", ""]}, 400, "stop", "stop cannot contain an empty string."),
    ("/v1/completions", {"prompt": "x", "stop": ""}, 400, "stop", "stop cannot contain an empty string."),
    ("/v1/completions", {"prompt": "x", "guided_choice": "abc"}, 400, "guided_choice", "a list of strings"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": {"yes": 1}}}, 400, "structured_outputs",
     "a list of strings"),
    ("/v1/completions", {"prompt": "x", "response_format": {}}, 400, "response_format", "is not supported"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["w"] * 4097}, 400, "bad_words", "at most 4096"),
    ("/v1/completions", {"prompt": "x", "stop": ["w"] * 4097}, 400, "stop", "at most 4096"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "none",
                              "tools": [{"type": "function", "function": {"name": "a>b"}}]}, 400, "tools",
     "cannot contain whitespace"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 5000}}]},
        {"role": "user", "content": "y"}]}, 400, "messages", "not valid JSON"),
]


def check_error(status, body, want_status, param, fragment):
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == want_status
    assert fragment in err["message"] and (param is None or err["param"] == param), err


def test_errors_do_not_disturb_running_requests(srv):
    conn, resp = open_stream(srv, {"prompt": "busy", "max_tokens": 300, "ignore_eos": True, "temperature": 0,
                                   "stream_options": {"include_usage": True}})
    try:
        for path, body, status, param, fragment in BAD:
            check_error(*srv.post(path, body), status, param, fragment)
        for raw, ctype, want, frag in ((b'{"prompt": "x",', "application/json", 400, "not valid JSON"),
                                       (b'["x"]', "application/json", 400, "JSON object"),
                                       (b'{"prompt": NaN}', "application/json", 400, "not valid JSON"),
                                       # nested below json's recursion limit, above what the server reads
                                       (b'{"prompt": "x", "temperature": ' + b"[" * 980 + b"1" + b"]" * 980 + b"}",
                                        "application/json", 400, "levels deep"),
                                       (b'{"prompt": "x"}', "text/plain", 415, "Only 'application/json'")):
            status, _, data = srv.request("POST", "/v1/completions", raw, {"Content-Type": ctype})
            check_error(status, json.loads(data), want, None, frag)
        status, _, data = srv.request("GET", "/v1/nope")
        assert status == 404 and json.loads(data)["error"]["code"] == 404
        assert srv.request("GET", "/v1/completions")[0] == 405
        ok = srv.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "unknown_field": {"a": 1}, "user": "u"})
        assert ok[0] == 200 and ok[1]["usage"]["completion_tokens"] == 2
        events = sse_events(resp.read())
        assert events[-1]["usage"]["completion_tokens"] == 300
    finally:
        conn.close()


def test_auth_and_queue_full(srv_small):
    s, key = srv_small, {"Authorization": "Bearer sekrit"}
    body = {"prompt": "hi", "max_tokens": 2}
    assert s.post("/v1/completions", body) == (401, {"error": "Unauthorized"})
    assert s.post("/v1/completions", body, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert s.request("GET", "/v1/models")[0] == 401 and s.request("GET", "/v1/nope")[0] == 401
    assert s.request("GET", "/health")[0] == 200 and s.request("GET", "/metrics")[0] == 200
    assert s.request("GET", "/v1/models", headers=key)[0] == 200
    assert s.post("/v1/completions", body, headers=key)[0] == 200
    # one slot + a queue of one: a third request gets 503 while two long ones are in
    long = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    conns = []
    try:
        for _ in range(2):
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps(long), {"Content-Type": "application/json", **key})
            assert conn.getresponse().status == 200  # headers come once the engine has queued it
            conns.append(conn)
        check_error(*s.post("/v1/completions", body, headers=key), 503, None, "capacity")
    finally:
        for conn in conns:  # both clients leave: the running one and the waiting one are aborted
            conn.close()
    t0 = time.time()  # the server notices within a poll interval (0.5 s) and frees both places
    while (status := s.post("/v1/completions", body, headers=key)[0]) == 503 and time.time() - t0 < 5:
        time.sleep(0.1)
    assert status == 200
    assert metric(wait_idle(s), "vllm:request_success_total", finished_reason="abort") == 2


# ==============================================================================================
# Concurrency, disconnects, metrics
# ==============================================================================================

def test_concurrent_streams_match_sequential(srv):
    bodies = [{"prompt": f"request number {i}: " + "abc " * i, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}} for i in range(12)]
    out = [None] * 12

    def run(i):
        status, _, data = srv.request("POST", "/v1/completions", bodies[i])
        out[i] = (status, sse_events(data))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, (status, events) in enumerate(out):
        assert status == 200 and events[-1]["usage"]["completion_tokens"] == 16
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        alone = srv.post("/v1/completions", dict(bodies[i], stream=False, stream_options=None))[1]
        assert text == alone["choices"][0]["text"] and alone["usage"]["completion_tokens"] == 16


def test_disconnect_frees_slot(srv):
    before = wait_idle(srv)
    streams = [open_stream(srv, {"prompt": f"long {i}", "max_tokens": 4000, "ignore_eos": True}) for i in range(4)]
    for conn, resp in streams:
        assert resp.readline().startswith(b"data: ")  # generating (chunked-encoding framing is read by http.client)
    quiet = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)  # non-streaming: noticed while waiting
    quiet.request("POST", "/v1/completions", json.dumps({"prompt": "q", "max_tokens": 4000, "ignore_eos": True}),
                  {"Content-Type": "application/json"})
    time.sleep(0.3)
    for conn, resp in streams:
        conn.close()
        resp.close()
    quiet.close()
    t0 = time.time()
    r = srv.post("/v1/completions", {"prompt": "quick", "max_tokens": 8})
    assert r[0] == 200 and time.time() - t0 < 4  # 4 x 4000 tokens would take far longer
    after = wait_idle(srv)
    aborted = lambda m: metric(m, "vllm:request_success_total", finished_reason="abort")
    assert aborted(after) - aborted(before) == 5


def test_metrics_counters(srv):
    before = wait_idle(srv)
    r = srv.post("/v1/completions", {"prompt": "count me", "max_tokens": 7, "ignore_eos": True})[1]
    after = wait_idle(srv)
    d = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)
    assert d("vllm:prompt_tokens_total") == r["usage"]["prompt_tokens"]
    assert d("vllm:generation_tokens_total") == 7
    assert d("vllm:request_success_total", finished_reason="length") == 1
    assert d("vllm:time_to_first_token_seconds_count") == 1 and d("vllm:e2e_request_latency_seconds_count") == 1
    assert d("vllm:inter_token_latency_seconds_count") == 6  # one per later step (no speculation: 1 token each)
    # vLLM's per-request histograms (at its end) and tokens per engine step; no preemption, no prefix cache
    n_prompt = r["usage"]["prompt_tokens"]
    assert d("vllm:request_prompt_tokens_count") == 1 and d("vllm:request_prompt_tokens_sum") == n_prompt
    assert d("vllm:request_generation_tokens_sum") == 7 and d("vllm:request_params_max_tokens_sum") == 7
    assert d("vllm:request_params_n_count") == 1 and d("vllm:request_params_n_bucket", le="1.0") == 1
    assert d("vllm:request_time_per_output_token_seconds_count") == 1
    assert d("vllm:iteration_tokens_total_sum") == n_prompt + 7 and d("vllm:iteration_tokens_total_count") == 7
    # (1-2-5 buckets up to max_model_len: 7 falls in le="10.0", not le="5.0")
    assert d("vllm:request_params_max_tokens_bucket", le="10.0") == 1
    assert d("vllm:request_params_max_tokens_bucket", le="5.0") == 0
    for name in ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert metric(after, name) == 0
    assert all(ls[:2] == (("model_name", "tiny"), ("engine", "0")) for (_, ls) in after)
    assert not any(n.startswith("vllm:spec_decode") for n, _ in after)  # only with a speculative config


def test_spec_decode_metrics(srv_spec, srv):
    before = wait_idle(srv_spec)
    body = {"prompt": "one two three one two three one two three one two", "max_tokens": 32, "temperature": 0,
            "ignore_eos": True}
    r = srv_spec.post("/v1/completions", body)[1]
    after = wait_idle(srv_spec)
    d = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)
    drafts, accepted = d("vllm:spec_decode_num_drafts_total"), d("vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [d("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=i) for i in range(3)]
    assert drafts > 0 and d("vllm:spec_decode_num_draft_tokens_total") >= drafts
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert per_pos[2] > 0                                      # whole drafts accepted (a predictable tiny_model)
    assert sum(1 for n, _ in after if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total") == 3
    assert r["usage"]["completion_tokens"] == 32
    assert r["choices"][0]["text"] == srv.post("/v1/completions", dict(body, model="tiny"))[1]["choices"][0]["text"]


def test_bench_serve(srv_spec):
    """bench.py serve, checked against what it does not compute: the server's own counters (scraped here before and
    after, with this file's Prometheus parser) and the wall time of the run. Token and request counts and the
    spec-decode counters equal the server's; the client's TTFT and end-to-end latency intervals contain the
    server's (its clock starts before the request reaches the server and stops after the chunk left it). Greedy:
    sampled at the server's default temperature, some runs drew no n-gram match at all (no drafts: no spec keys)."""
    before = wait_idle(srv_spec)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "serve", "--url", srv_spec.url, "--num-prompts",
                        "8", "--max-concurrency", "4", "--prompt-len", "24", "--gen-len", "12", "--seed", "1",
                        "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el"],
                       capture_output=True, text=True, timeout=120, env=ENV)
    wall = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr
    after = wait_idle(srv_spec)
    d = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert "Serving Benchmark Result" in p.stdout
    assert res["completed"] == d("vllm:request_success_total") == 8 and res["failed"] == 0
    assert res["total_input_tokens"] == d("vllm:prompt_tokens_total") == 8 * 24
    assert res["total_output_tokens"] == d("vllm:generation_tokens_total") == 8 * 12
    assert 0 < res["duration"] < wall and res["output_throughput"] == pytest.approx(96 / res["duration"])
    server_mean = lambda h: 1e3 * d(h + "_sum") / d(h + "_count")                     # ms
    assert d("vllm:time_to_first_token_seconds_count") == d("vllm:e2e_request_latency_seconds_count") == 8
    assert res["mean_ttft_ms"] >= server_mean("vllm:time_to_first_token_seconds") > 0
    assert res["mean_e2el_ms"] >= server_mean("vllm:e2e_request_latency_seconds") > 0
    assert res["mean_e2el_ms"] >= res["mean_ttft_ms"] and res["median_ttft_ms"] <= res["p99_ttft_ms"]
    assert 1 <= res["max_concurrent_requests"] <= 4 and 0 < res["max_output_tokens_per_s"] <= 96
    n, acc = d("vllm:spec_decode_num_drafts_total"), d("vllm:spec_decode_num_accepted_tokens_total")
    assert res["spec_decode_num_drafts"] == n > 0 and res["spec_decode_accepted_tokens"] == acc
    assert res["spec_decode_draft_tokens"] == d("vllm:spec_decode_num_draft_tokens_total")
    per_pos = [d("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=i) for i in range(3)]
    assert res["spec_decode_per_position_acceptance_rates"] == pytest.approx([a / n for a in per_pos])
    assert res["spec_decode_acceptance_length"] == pytest.approx(1 + acc / n)


def test_bench_summarize_matches_numpy():
    """bench.summarize's mean / median / std / p99 (ms) against numpy's (linear-interpolation percentile)."""
    import numpy as np
    sys.path.insert(0, ROOT)
    import bench
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 100, 101):
        xs = (torch.rand(n, generator=g) * 3).tolist()
        got, a = bench.summarize(xs), np.array(xs)
        want = {"mean": a.mean(), "median": np.median(a), "std": a.std(), "p99": np.percentile(a, 99)}
        assert got == pytest.approx({k: 1e3 * v for k, v in want.items()}, rel=1e-12, abs=1e-9), n
    assert bench.summarize([]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def write_lines(path, *lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_bench_load_dataset_custom_and_sharegpt(tmp_path):
    """bench.load_dataset: custom JSONL (blank lines skipped, output_tokens kept) and ShareGPT (the first human
    turn; fewer than two turns or no human turn: skipped); --seed's shuffle is deterministic, --disable-shuffle
    keeps the file's order; fewer entries than asked: cycled, or with oversample=False the file's count."""
    lines = [json.dumps({"prompt": f"p{i}", **({"output_tokens": i} if i % 3 == 0 and i else {})}) for i in range(10)]
    custom = write_lines(tmp_path / "c.jsonl", *lines[:5], "", *lines[5:])
    order = bench.load_dataset("custom", custom, 10, shuffle=False)
    assert order == [(f"p{i}", i if i in (3, 6, 9) else None) for i in range(10)]
    a, b = bench.load_dataset("custom", custom, 10, seed=1), bench.load_dataset("custom", custom, 10, seed=1)
    assert a == b and sorted(a) == sorted(order) and a != order
    assert bench.load_dataset("custom", custom, 10, seed=2) != a
    assert bench.load_dataset("custom", custom, 4, shuffle=False) == order[:4]
    assert bench.load_dataset("custom", custom, 25, shuffle=False) == (order * 3)[:25]
    assert bench.load_dataset("custom", custom, 25, shuffle=False, oversample=False) == order
    assert bench.load_dataset("custom", custom, 25, seed=1, oversample=False) == a
    turn = lambda who, text: {"from": who, "value": text}
    sharegpt = tmp_path / "s.json"
    sharegpt.write_text(json.dumps([
        {"id": "a", "conversations": [turn("human", "first?"), turn("gpt", "yes"), turn("human", "later")]},
        {"id": "b", "conversations": [turn("human", "alone")]},                         # no reply: skipped
        {"id": "c", "conversations": []},
        {"id": "d", "conversations": [turn("system", "be brief"), turn("human", "second?"), turn("gpt", "no")]},
        {"id": "e", "conversations": [turn("gpt", "hello"), turn("gpt", "anyone?")]}]))   # no human turn
    assert bench.load_dataset("sharegpt", str(sharegpt), 5, shuffle=False) == \
        [("first?", None), ("second?", None)] * 2 + [("first?", None)]
    assert bench.load_dataset("sharegpt", str(sharegpt), 5, shuffle=False, oversample=False) == \
        [("first?", None), ("second?", None)]


def stub_bench_server(monkeypatch, prompt_tokens):
    """bench.py serve against no server: model "m", no /metrics, each request answered at once with 2 tokens (and
    the usage's prompt_tokens given, None: no usage). -> the list the request bodies are appended to."""
    monkeypatch.setattr(bench, "http_get", lambda url, path, headers, timeout=30: b'{"data": [{"id": "m"}]}')
    monkeypatch.setattr(bench, "scrape_spec", lambda url, headers, settle=0.0: None)
    sent = []

    def send(url, endpoint, body, headers, timeout):
        sent.append(body)
        return {"ok": True, "start": time.perf_counter(), "ttft": 0.01, "itl": [0.01], "latency": 0.02,
                "output_tokens": 2, "prompt_tokens": prompt_tokens, "chunks": 2, "error": ""}
    monkeypatch.setattr(bench, "send", send)
    return sent


def test_bench_datasets_with_a_local_tokenizer(tmp_path, monkeypatch, capsys):
    """With the model's tokenizer on the client (--model or --tokenizer a directory), as vllm bench serve: a ShareGPT
    request's max_tokens is its recorded reply's length in tokens (--sharegpt-output-len fixes it) and vLLM's
    length filter drops pairs of a prompt or reply under 4 tokens; custom and spec_bench prompts to the completions
    endpoint get the model's chat template (--skip-chat-template: custom's as they are); spec_bench reads
    Spec-Bench's question.jsonl (first turns; --spec-bench-category) with max_tokens 256 (vLLM's default)."""
    tok = sd.Tokenizer.from_dir(TOY)
    turn = lambda who, text: {"from": who, "value": text}
    reply = "It is a list of numbers in the order they were given, one per line."
    sharegpt = tmp_path / "s.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [turn("human", "What does this function return when called?"), turn("gpt", reply)]},
        {"conversations": [turn("human", "Hi"), turn("gpt", reply)]},                   # prompt < 4 tokens
        {"conversations": [turn("human", "Tell me about the weather today"), turn("gpt", "Ok")]}]))  # reply < 4
    got = bench.load_dataset("sharegpt", str(sharegpt), 3, shuffle=False, oversample=False, tok=tok)
    assert got == [("What does this function return when called?", len(tok.encode(reply)))]
    got = bench.load_dataset("sharegpt", str(sharegpt), 3, shuffle=False, oversample=False, tok=tok, output_len=9)
    assert [m for _, m in got] == [9, 9]  # a fixed length skips the reply's check, not the prompt's
    questions = write_lines(tmp_path / "q.jsonl", json.dumps({"category": "math", "turns": ["2 + 2?", "and 3?"]}),
                            json.dumps({"category": "coding", "turns": ["Write fib."]}))
    assert bench.load_dataset("spec_bench", questions, 2, shuffle=False, oversample=False, category="coding") == \
        [("Write fib.", None)]
    sent = stub_bench_server(monkeypatch, prompt_tokens=5)
    template = sd.ChatTemplate.from_checkpoint(TOY, tok)
    for flags, want in ((["--dataset-name", "spec_bench", "--dataset-path", questions],
                         [(template.render([{"role": "user", "content": q}]), 256) for q in ("2 + 2?", "Write fib.")]),
                        (["--dataset-name", "custom", "--dataset-path", write_lines(tmp_path / "c.jsonl", json.dumps(
                            {"prompt": "hello"})), "--num-prompts", "1", "--skip-chat-template"], [("hello", 256)])):
        sent.clear()
        assert bench.serve_benchmark(["--model", TOY, "--disable-shuffle", "--no-oversample"] + flags) == 0
        assert [(b["prompt"], b["max_tokens"]) for b in sent] == want
        capsys.readouterr()


def test_bench_dataset_errors(tmp_path, capsys):
    """Bad dataset input: exit status 1 and one `error:` line naming the problem and the file (and line), before
    the server is asked (none listens at port 1: its error would be a different line)."""
    c = lambda name, *lines: ("custom", write_lines(tmp_path / name, *lines))
    cases = [
        (("custom", None), "error: --dataset-name custom needs --dataset-path"),
        (("sharegpt", None), "error: --dataset-name sharegpt needs --dataset-path"),
        (("random", str(tmp_path)), "error: --dataset-path needs --dataset-name custom, sharegpt or spec_bench"),
        (("custom", str(tmp_path / "gone.jsonl")), f"error: cannot read {tmp_path}/gone.jsonl: No such file or "
                                                   "directory"),
        (("custom", str(tmp_path)), f"error: cannot read {tmp_path}: Is a directory"),
        (c("notjson.jsonl", '{"prompt": "ok"}', '{"prompt": "cut'),
         f"error: {tmp_path}/notjson.jsonl:2: not JSON (column 12: Unterminated string starting at)"),
        (c("noprompt.jsonl", '{"prompt": "ok"}', '', '{"text": "no prompt key"}'),
         f'error: {tmp_path}/noprompt.jsonl:3: no "prompt" string'),
        (c("list.jsonl", '["prompt"]'), f'error: {tmp_path}/list.jsonl:1: no "prompt" string'),
        (c("out.jsonl", '{"prompt": "x", "output_tokens": 0}'),
         f'error: {tmp_path}/out.jsonl:1: "output_tokens" must be a positive integer, not 0'),
        (c("empty.jsonl", "", "  "), f"error: {tmp_path}/empty.jsonl: no prompts in it"),
        (("sharegpt", write_lines(tmp_path / "s1.json", "[", '{"conversations": []},', "]")),
         f"error: {tmp_path}/s1.json:3: not JSON (column 1: Expecting value)"),
        (("sharegpt", write_lines(tmp_path / "s2.json", '{"conversations": []}')),
         f"error: {tmp_path}/s2.json: not a JSON list of conversations"),
        (("sharegpt", write_lines(tmp_path / "s3.json", '[{"conversations": []}, {"turns": []}]')),
         f'error: {tmp_path}/s3.json: entry 1: no "conversations" list'),
        (("sharegpt", write_lines(tmp_path / "s4.json", '[{"conversations": [{"from": "gpt", "value": "x"}]}]')),
         f"error: {tmp_path}/s4.json: no conversation with an answered human turn"),
        (("spec_bench", None), "error: --dataset-name spec_bench needs --dataset-path"),
        (("spec_bench", write_lines(tmp_path / "q.jsonl", '{"turns": "not a list"}')),
         f'error: {tmp_path}/q.jsonl:1: no "turns" list of strings'),
    ]
    for (name, path), want in cases:
        argv = ["--url", "http://127.0.0.1:1", "--dataset-name", name] + (["--dataset-path", path] if path else [])
        assert bench.serve_benchmark(argv) == 1, want
        out, err = capsys.readouterr()
        assert (out, err) == ("", want + "\n")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "serve", "--dataset-name", "custom",
                        "--dataset-path", cases[6][0][1]], capture_output=True, text=True, timeout=120, env=ENV)
    assert (p.returncode, p.stdout, p.stderr) == (1, "", cases[6][1] + "\n")  # the command line: no traceback


def test_bench_flag_errors_are_one_line(tmp_path, capsys):
    """bench.py's bad flags: an `error:` line each (exit 1 / 2), no traceback; serve's before the server is asked
    (none listens at port 1), the offline benchmark's before a model is built or as the engine refuses it."""
    for flags, want in ((["--request-rate", "0"], "--request-rate must be > 0"),
                        (["--request-rate", "-1"], "--request-rate must be > 0"),
                        (["--extra-body", "{bad"], "--extra-body is not valid JSON"),
                        (["--extra-body", "[1]"], "--extra-body must be a JSON object"),
                        (["--max-concurrency", "0"], "--max-concurrency must be greater than 0"),  # (vLLM's)
                        (["--max-concurrency", "-1"], "--max-concurrency must be greater than 0"),
                        (["--num-prompts", "0"], "--num-prompts must be at least 1"),
                        (["--random-input-len", "0"], "the random dataset needs prompts of at least one token"),
                        (["--base-url", "127.0.0.1:8000"], "--base-url '127.0.0.1:8000' (or --host / --port): use"),
                        (["--base-url", "http://127.0.0.1:abc", "--model", "x"], "--base-url 'http://127.0.0.1:abc'"),
                        (["--save-result", "--result-dir", str(tmp_path / "f" / "x")], None)):
        if want is None:  # a result dir that cannot be made: a file where a directory should be
            (tmp_path / "f").write_text("")
            want = "--result-dir"
        assert bench.serve_benchmark(["--url", "http://127.0.0.1:1", "--num-prompts", "2"] + flags
                                     if "--base-url" not in flags else flags) == 1, want
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("error: " + want) and err.count("\n") == 1, err
    small = ["--batch", "1", "--prompt-len", "8", "--gen-len", "8"]
    for flags, want in ((["--batch", "0"], "--batch must be at least 1"), (["--gen-len", "0"], "--gen-len must be"),
                        (["--gen-len", "1"], "--gen-len must be at least 2, not 1"),  # (TPOT needs a second token)
                        (["--speculative-config", "{bad"], "--speculative-config '{bad' is not valid JSON"),
                        (["--model", str(tmp_path / "none")], "no config.json"),
                        (["--max-model-len", "4"], "maximum context length is 4 tokens")):
        code = exit_code(bench.main, small + flags)                                 # (in this process)
        err = capsys.readouterr().err
        last = err.splitlines()[-1]  # (argparse's usage lines before a flag's error, as any command line)
        assert code == 2 and "Traceback" not in err and want in last, err


def test_bench_serve_as_vllm_bench_serve(capsys):
    """vllm bench serve's ways: a --base-url path leads every request's (vLLM: base_url + endpoint; it was dropped),
    --ready-check-timeout-sec waits for the server even with --model given (it asked nothing then), --burstiness inf
    spaces the arrivals evenly (it was a traceback), flags take underscores, and the result has endpoint_type and a
    null label without --label."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    paths, ids = [], []

    class Fake(BaseHTTPRequestHandler):  # an OpenAI-compatible server under /prefix: models, one chunk, usage
        def do_GET(self):
            paths.append(self.path)
            body = b'{"data": [{"id": "m"}]}' if self.path == "/prefix/v1/models" else b"nope"
            self.send_response(200 if self.path == "/prefix/v1/models" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            paths.append(self.path)
            ids.append(self.headers["X-Request-Id"])
            self.rfile.read(int(self.headers["Content-Length"]))
            chunks = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                      {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]
            body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"
            self.send_response(200 if self.path == "/prefix/v1/completions" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/prefix"
        assert bench.serve_benchmark(["--base_url", url, "--num_prompts", "3", "--model", "m", "--request-rate", "200",
                                      "--burstiness", "inf", "--ready-check-timeout-sec", "5", "--random-input-len",
                                      "4", "--request-id-prefix", "run7-", "--save-detailed"]) == 0
        res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert res["generated_texts"] == ["ab"] * 3  # (--save-detailed: each request's text, as vLLM's)
        assert res["completed"] == 3 and res["endpoint_type"] == "openai" and res["label"] is None
        assert paths[0] == "/prefix/v1/models" and paths.count("/prefix/v1/completions") == 3
        assert sorted(ids) == ["run7-0", "run7-1", "run7-2"]  # --request-id-prefix: each request's X-Request-Id
    finally:
        httpd.shutdown()


def test_bench_latency_and_throughput_as_vllm(tmp_path, capsys):
    """bench.py latency / throughput: vllm bench latency / throughput's flags, printed lines and --output-json, on
    the offline engine (they were unrecognized arguments); bad counts and models are one error line."""
    out_json = str(tmp_path / "lat.json")
    assert bench.main(["latency", "--device", "cpu", "--input-len", "8", "--output-len", "4", "--batch-size", "2",
                       "--num-iters-warmup", "0", "--num_iters", "3", "--output-json", out_json]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"Avg latency: [\d.e-]+ seconds", lines[0])
    assert [ln.split("%")[0] for ln in lines[1:]] == ["10", "25", "50", "75", "90", "99"]
    res = json.load(open(out_json))
    assert set(res) == {"avg_latency", "latencies", "percentiles"} and len(res["latencies"]) == 3
    assert min(res["latencies"]) <= res["percentiles"]["50"] <= max(res["latencies"])
    out_json = str(tmp_path / "tp.json")
    assert bench.main(["throughput", "--device", "cpu", "--input-len", "16", "--output-len", "8", "--num-prompts", "6",
                       "--n", "2", "--output-json", out_json]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^Throughput: [\d.]+ requests/s, [\d.]+ total tokens/s, [\d.]+ output tokens/s$", out, re.M)
    assert "Total num prompt tokens:  96" in out and "Total num output tokens:  96" in out  # 6 x 2 samples x 8
    res = json.load(open(out_json))
    assert res["num_requests"] == 6 and res["total_num_tokens"] == 96 + 96 and res["tokens_per_second"] > 0
    assert exit_code(bench.main, ["latency", "--num-iters", "0"]) == 2
    assert "--num-iters must be at least 1" in capsys.readouterr().err
    assert bench.main(["throughput", "--model", str(tmp_path / "none"), "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_bench_serve_input_tokens_without_usage(tmp_path, monkeypatch, capsys):
    """Without the server's usage, a token-id prompt's input tokens are its length; a text prompt's are unknown:
    total_input_tokens is None (and the table says unknown), not --prompt-len."""
    sent = stub_bench_server(monkeypatch, prompt_tokens=None)
    assert bench.serve_benchmark(["--num-prompts", "3", "--prompt-len", "7"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["dataset_name"] == "random" and res["total_input_tokens"] == 21 and res["total_token_throughput"] > 0
    path = write_lines(tmp_path / "p.jsonl", '{"prompt": "def f(x):"}', '{"prompt": "import os", "output_tokens": 4}')
    sent.clear()
    assert bench.serve_benchmark(["--num-prompts", "3", "--dataset-name", "custom", "--dataset-path", path,
                                  "--disable-shuffle"]) == 0
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1])
    assert res["total_input_tokens"] is None and res["total_token_throughput"] is None and res["prompt_len"] is None
    assert re.search(r"^Total input tokens: +unknown", out, re.M) and "Total token throughput" not in out
    assert "Dataset:" not in out and re.search(r"=\n(Successful requests:)", out)  # vLLM's table: no dataset line
    # (a custom prompt's max_tokens: its output_tokens, else vLLM's --custom-output-len default, 256)
    assert [(b["prompt"], b["max_tokens"]) for b in sent] == [("def f(x):", 256), ("import os", 4), ("def f(x):", 256)]
    sent.clear()
    assert bench.serve_benchmark(["--num-prompts", "1", "--dataset-name", "custom", "--dataset-path", path, "--seed",
                                  "3", "--endpoint", "/v1/chat/completions", "--gen-len", "9"]) == 0
    assert sent[0]["messages"] == [{"role": "user", "content": sent[0]["messages"][0]["content"]}]
    assert (sent[0]["messages"][0]["content"], sent[0]["max_completion_tokens"]) in (("def f(x):", 9), ("import os", 4))


def test_bench_serve_vllm_flags(tmp_path, monkeypatch, capsys):
    """bench.py serve under vllm bench serve's flags and defaults (a stubbed server records what is sent): --host /
    --port / --base-url make the URL, --header the headers; sampling flags go into every body only when given;
    ignore_eos is on for the random dataset and off for files unless asked; --random-range-ratio and
    --random-prefix-len shape the prompts; --num-warmups requests are sent but not counted; --percentile-metrics /
    --metric-percentiles pick the latency keys; --save-result / --append-result / --result-dir write the JSON line
    (with --metadata) to vLLM's file name; bad values give one `error:` line."""
    urls, sent = [], []
    monkeypatch.setattr(bench, "http_get", lambda url, path, headers, timeout=30: urls.append(url) or
                        b'{"data": [{"id": "org/m"}]}')
    monkeypatch.setattr(bench, "scrape_spec", lambda url, headers, settle=0.0: None)

    def send(url, endpoint, body, headers, timeout):
        sent.append((url, endpoint, body, dict(headers)))
        return {"ok": True, "start": time.perf_counter(), "ttft": 0.01, "itl": [0.01, 0.02], "latency": 0.04,
                "output_tokens": 3, "prompt_tokens": None, "chunks": 3, "error": ""}
    monkeypatch.setattr(bench, "send", send)
    run = lambda *argv: (bench.serve_benchmark(list(argv)), capsys.readouterr())
    code, cap = run("--host", "10.0.0.7", "--port", "9001", "--num-prompts", "4", "--random-input-len", "20",
                    "--random-output-len", "6", "--header", "x-a=1", "x-b=two=2", "--top-k", "5", "--min-p", "0.1",
                    "--num-warmups", "2", "--metric-percentiles", "50,99.9", "--percentile-metrics", "ttft,e2el")
    assert code == 0 and urls[0] == "http://10.0.0.7:9001" and len(sent) == 6        # 2 warm-ups + 4 counted
    assert all(u == "http://10.0.0.7:9001" and h["x-a"] == "1" and h["x-b"] == "two=2" for u, _, _, h in sent)
    bodies = [b for _, _, b, _ in sent]
    assert bodies[0] == bodies[1] == bodies[2] and all(b["ignore_eos"] and b["top_k"] == 5 and b["min_p"] == 0.1
                                                       and "temperature" not in b and b["max_tokens"] == 6
                                                       and len(b["prompt"]) == 20 for b in bodies)
    res = json.loads(cap.out.strip().splitlines()[-1])
    assert res["completed"] == 4 and res["total_output_tokens"] == 12 and res["model_id"] == "org/m"
    assert {k for k in res if k.endswith("_ms")} == {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p50", "p99.9")
                                                     for m in ("ttft", "e2el")}
    assert "P99.9 TTFT (ms):" in cap.out and "Peak concurrent requests:" in cap.out and "--temperature" in cap.err
    code, cap = run("--base-url", "http://h:1/", "--num-prompts", "40", "--random-input-len", "10",
                    "--random-range-ratio", "0.5", "--random-prefix-len", "3", "--random-output-len", "8",
                    "--temperature", "0", "--no-ignore-eos")
    bodies = [b for _, _, b, _ in sent[6:]]
    assert code == 0 and urls[-1] == "http://h:1" and all(b["temperature"] == 0 and "ignore_eos" not in b
                                                          for b in bodies)
    assert all(len(b["prompt"]) in range(3 + 5, 3 + 15 + 1) and 4 <= b["max_tokens"] <= 12 for b in bodies)
    assert len({len(b["prompt"]) for b in bodies}) > 1 and len({tuple(b["prompt"][:3]) for b in bodies}) == 1
    path = write_lines(tmp_path / "p.jsonl", '{"prompt": "def f(x):"}')
    sent.clear()
    common = ("--dataset-name", "custom", "--dataset-path", path, "--num-prompts", "2", "--max-concurrency", "1")
    code, cap = run(*common, "--save-result", "--result-dir", str(tmp_path / "a"), "--metadata", "gpu=h200",
                    "--label", "toy")
    assert code == 0 and not any("ignore_eos" in b for _, _, b, _ in sent)           # a file: vLLM's default, off
    files = os.listdir(tmp_path / "a")
    assert len(files) == 1 and re.fullmatch(r"toy-infqps-concurrency1-m-\d{8}-\d{6}\.json", files[0])
    saved = json.loads((tmp_path / "a" / files[0]).read_text())
    assert saved == json.loads(cap.out.strip().splitlines()[-1]) and saved["gpu"] == "h200" and "ttfts" not in saved
    for _ in range(2):
        code, cap = run(*common, "--append-result", "--result-filename", str(tmp_path / "r.json"), "--save-detailed")
    saved = [json.loads(x) for x in (tmp_path / "r.json").read_text().splitlines()]
    assert len(saved) == 2 and saved[1] == json.loads(cap.out.strip().splitlines()[-1])
    assert saved[1]["ttfts"] == [0.01, 0.01] and saved[1]["output_lens"] == [3, 3] and saved[1]["errors"] == ["", ""]
    assert saved[1]["generated_texts"] == ["", ""] and len(saved[1]["start_times"]) == 2  # (the stand-in sends none)
    for argv, want in [(["--backend", "openai-chat"], "error: --backend openai-chat needs a chat endpoint "
                                                      "(--endpoint /v1/chat/completions), not /v1/completions"),
                       (["--percentile-metrics", "ttft,goodput"], "error: --percentile-metrics 'ttft,goodput': use "
                                                                  "some of ttft,tpot,itl,e2el,client_queue_time,"
                                                                  "e2el_including_client_queue"),
                       (["--metric-percentiles", "99,x"], "error: --metric-percentiles '99,x': numbers in [0, 100], "
                                                          "e.g. 25,50,99"),
                       (["--random-range-ratio", "1.5"], "error: --random-range-ratio must be in [0, 1), not 1.5"),
                       (["--header", "novalue"], "error: --header 'novalue': use KEY=VALUE")]:
        code, cap = run(*argv)
        assert (code, cap.out, cap.err) == (1, "", want + "\n")


def test_bench_serve_goodput_and_burstiness(monkeypatch, capsys):
    """--goodput: the requests within every objective (TTFT 10 / 20 / 30 / 40 ms here, E2EL 20 ms more) per second;
    without it request_goodput is None; bad objectives and --burstiness <= 0 are one `error:` line."""
    monkeypatch.setattr(bench, "http_get", lambda url, path, headers, timeout=30: b'{"data": [{"id": "m"}]}')
    monkeypatch.setattr(bench, "scrape_spec", lambda url, headers, settle=0.0: None)
    n = iter(range(1, 100))

    def send(url, endpoint, body, headers, timeout):
        ttft = 0.01 * next(n)
        return {"ok": True, "start": time.perf_counter(), "ttft": ttft, "itl": [0.01, 0.01], "latency": ttft + 0.02,
                "output_tokens": 3, "prompt_tokens": None, "chunks": 3, "error": ""}
    monkeypatch.setattr(bench, "send", send)
    argv = ["--num-prompts", "4", "--random-input-len", "5", "--max-concurrency", "1", "--request-rate", "1000",
            "--burstiness", "0.5"]
    assert bench.serve_benchmark(argv + ["--goodput", "ttft:25", "e2el:50"]) == 0
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1])
    assert res["request_goodput"] * res["duration"] == pytest.approx(2) and "Request goodput (req/s):" in out
    assert res["burstiness"] == 0.5
    assert bench.serve_benchmark(argv + ["--goodput", "tpot:11"]) == 0               # TPOT 10 ms: all four
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["request_goodput"] * res["duration"] == pytest.approx(4)
    assert bench.serve_benchmark(argv) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["request_goodput"] is None
    for bad, want in ((["--goodput", "itl:5"], "error: --goodput 'itl:5': use KEY:MS with KEY ttft, tpot or e2el "
                                                 "and MS >= 0"),
                      (["--burstiness", "0"], "error: --burstiness must be > 0, not 0.0")):
        assert bench.serve_benchmark(argv + bad) == 1 and capsys.readouterr().err == want + "\n"


def test_bench_peaks():
    """bench.peaks, vLLM's peak output tokens in one second and peak concurrency, on a hand-made timeline (exact
    binary fractions, seconds after the first start): tokens at 0.5, 0.75 | 1.25 | 2.75 (request a), 0.875 | 1,
    1.125 (b), 1.25 (c); in flight a [0, 2.75), b [0.75, 1.125), c [1.125, 1.25)."""
    rec = lambda start, ttft, itl: {"ok": True, "start": start, "ttft": ttft, "itl": itl, "latency": ttft + sum(itl)}
    t0 = 0.5  # the seconds count from the first start, not from the clock's zero
    a, b, c = rec(t0, 0.5, [0.25, 0.5, 1.5]), rec(t0 + 0.75, 0.125, [0.125, 0.125]), rec(t0 + 1.125, 0.125, [])
    assert bench.peaks([a, b]) == (3.0, 2)
    assert bench.peaks([a, b, c, dict(c, ok=False, start=t0 + 1)]) == (4.0, 2)  # c starts as b ends: not 3
    assert bench.peaks([dict(a, ok=False)]) == (0.0, 0)


def test_bench_serve_custom_dataset(srv_spec, tmp_path):
    """bench.py serve --dataset-name custom against server.py: the text prompts go as completion prompts (and as
    the chat user message), oversampled to --num-prompts (or not, with --no-oversample); an output_tokens line
    sets its max_tokens; input and output token totals equal the server's counters."""
    path = write_lines(tmp_path / "code.jsonl", json.dumps({"prompt": "def fib(n):\n    "}),
                       json.dumps({"prompt": "import os\nimport sys\n", "output_tokens": 5}),
                       json.dumps({"prompt": "class Stack:\n    def __init__(self):"}))
    want_out = sum(m or 12 for _, m in bench.load_dataset("custom", path, 5, seed=1))
    for endpoint, extra, n, out in (("/v1/completions", [], 5, want_out), ("/v1/chat/completions",
                                                                          ["--no-oversample"], 3, 12 + 5 + 12)):
        before = wait_idle(srv_spec)
        p = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "serve", "--url", srv_spec.url,
                            "--endpoint", endpoint, "--dataset-name", "custom", "--dataset-path", path,
                            "--num-prompts", "5", "--max-concurrency", "2", "--gen-len", "12", "--seed", "1",
                            "--ignore-eos", *extra],
                           capture_output=True, text=True, timeout=120, env=ENV)
        assert p.returncode == 0, p.stderr
        after = wait_idle(srv_spec)
        d = lambda name: metric(after, name) - metric(before, name)  # noqa: E731
        res = json.loads(p.stdout.strip().splitlines()[-1])
        assert res["dataset_name"] == "custom" and res["dataset_path"] == path
        assert res["num_prompts"] == res["completed"] == d("vllm:request_success_total") == n and res["failed"] == 0
        assert res["total_input_tokens"] == d("vllm:prompt_tokens_total") > 0
        assert res["total_output_tokens"] == d("vllm:generation_tokens_total") == out


def test_cpu_speed_held_out_jsonl(tmp_path):
    """tools/cpu_speed.py --serve-dataset held-out: eval_toy.py's held-out prompts, written as a custom JSONL that
    bench.load_dataset reads, each text encoding back to about its 128 tokens."""
    if not os.path.isdir(TOY):
        pytest.skip("models/toy not present")
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import cpu_speed
    tok = sd.Tokenizer.from_dir(TOY)
    n = cpu_speed.write_held_out(tok, 6, str(tmp_path / "h.jsonl"))
    if n == 0:
        pytest.skip("none of the held-out stdlib files on this machine")
    rows = bench.load_dataset("custom", str(tmp_path / "h.jsonl"), 6, shuffle=False, oversample=False)
    assert len(rows) == n <= 6 and all(m is None for _, m in rows)
    assert all(abs(len(tok.encode(t, allow_special=False)) - 128) <= 2 for t, _ in rows)
    assert any("def " in t or "import " in t for t, _ in rows)                          # code, not random ids


def test_bad_startup_is_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    """server.py's main in this process (a subprocess each cost ~1.5 s of imports; the Server fixtures start the
    real one): a bad config or checkpoint exits nonzero with one `error:` line, before any socket is opened."""
    import server as srvmod

    def opened(*a, **kw):
        raise AssertionError("a server was started")
    monkeypatch.setattr(srvmod, "Server", opened)
    for args in (["--model", tiny_model, "--speculative-config", '{"method":"eagle","num_speculative_tokens":2}'],
                 ["--model", str(tmp_path / "missing")],
                 ["--model", str(tmp_path)]):
        code = exit_code(srvmod.main, ["--port", str(free_port()), "--device", "cpu", *args])
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert code != 0 and len(lines) == 1 and lines[0].startswith("error: "), err
        assert "a server was started" not in err and "Traceback" not in err


# ==============================================================================================
# Bad input: every numeric field bounded at the API boundary (issue 22)
# ==============================================================================================

BIG = 10 ** 20  # past int64: it once reached the engine and killed it ("Overflow when unpacking long long")
CHAT = [{"role": "user", "content": "x"}]
CORPUS = [  # (class, path, body, status, param, message fragment or None); each must leave /health at 200
    ("top_k beyond int64", "/v1/completions", {"top_k": BIG}, 200, None, None),  # as vLLM: no filter
    ("top_k 0 disables (vLLM)", "/v1/completions", {"top_k": 0}, 200, None, None),
    ("top_k hugely negative", "/v1/completions", {"top_k": -BIG}, 400, "top_k", "0 (disable), or at least 1"),
    ("top_k not an integer", "/v1/completions", {"top_k": 1.5}, 400, "top_k", "must be an integer"),
    ("seed beyond int64", "/v1/completions", {"seed": BIG}, 400, "seed", "less than or equal to 9223372036854775807"),
    ("seed at 2**63", "/v1/completions", {"seed": 2 ** 63}, 400, "seed", "less than or equal to"),
    ("seed below int64", "/v1/completions", {"seed": -BIG}, 400, "seed",
     "greater than or equal to -9223372036854775808"),
    ("seed int64 max", "/v1/completions", {"seed": 2 ** 63 - 1}, 200, None, None),
    ("seed int64 min", "/v1/completions", {"seed": -2 ** 63}, 200, None, None),
    ("seed -1 is none (vLLM)", "/v1/completions", {"seed": -1}, 200, None, None),
    ("seed as a string of an integer (pydantic's lax mode, as vLLM)", "/v1/completions", {"seed": "7"}, 200, None, None),
    ("seed as a word", "/v1/completions", {"seed": "seven"}, 400, "seed", "must be an integer"),
    ("temperature inf (1e999)", "/v1/completions", {"temperature": 1e999}, 400, "temperature",
     "temperature must be a finite number, got Infinity."),
    ("temperature -inf", "/v1/completions", {"temperature": -1e999}, 400, "temperature", "finite number"),
    ("temperature huge integer", "/v1/completions", {"temperature": 10 ** 400}, 400, "temperature",
     "must be in [0, 2]"),
    ("temperature above 2", "/v1/completions", {"temperature": 2.5}, 400, "temperature", "must be in [0, 2]"),
    ("temperature 2", "/v1/completions", {"temperature": 2}, 200, None, None),
    ("temperature negative", "/v1/completions", {"temperature": -0.1}, 400, "temperature", "non-negative"),
    ("top_p inf", "/v1/completions", {"top_p": 1e999}, 400, "top_p", "must be in (0, 1]"),
    ("top_p huge integer", "/v1/completions", {"top_p": 10 ** 400}, 400, "top_p", "must be in (0, 1]"),
    ("max_tokens beyond int64", "/v1/completions", {"max_tokens": BIG}, 400, None, "maximum context length"),
    ("max_tokens hugely negative", "/v1/completions", {"max_tokens": -BIG}, 400, "max_tokens", "at least 1"),
    ("max_tokens not an integer", "/v1/completions", {"max_tokens": 2.5}, 400, "max_tokens", "must be an integer"),
    ("max_tokens null is the default", "/v1/completions", {"max_tokens": None}, 200, None, None),
    ("max_completion_tokens huge", "/v1/chat/completions", {"max_completion_tokens": BIG}, 400, None,
     "maximum context length"),
    ("max_completion_tokens 0", "/v1/chat/completions", {"max_completion_tokens": 0}, 400, "max_completion_tokens",
     "at least 1"),
    ("logprobs beyond int64", "/v1/completions", {"logprobs": BIG}, 400, "logprobs", "greater than max allowed: 20"),
    ("logprobs 21", "/v1/completions", {"logprobs": 21}, 400, "logprobs", "greater than max allowed: 20"),
    ("logprobs 20", "/v1/completions", {"logprobs": 20}, 200, None, None),
    ("logprobs hugely negative", "/v1/completions", {"logprobs": -BIG}, 400, "logprobs", "positive value or -1"),
    ("top_logprobs huge", "/v1/chat/completions", {"logprobs": True, "top_logprobs": BIG}, 400, "top_logprobs",
     "greater than max allowed"),
    ("top_logprobs negative", "/v1/chat/completions", {"logprobs": True, "top_logprobs": -5}, 400, "top_logprobs",
     "`top_logprobs` must be a positive value or -1."),
    ("top_logprobs 0 alone (vLLM)", "/v1/chat/completions", {"top_logprobs": 0}, 200, None, None),
    ("n 0", "/v1/completions", {"n": 0}, 400, "n", "n must be at least 1, got 0."),
    ("n beyond int64", "/v1/completions", {"n": BIG}, 400, "n", "n must be at most 16384"),
    ("n 2 greedy", "/v1/completions", {"n": 2, "temperature": 0}, 400, "n",
     "n must be 1 when using greedy sampling"),
    ("n 2", "/v1/chat/completions", {"n": 2}, 200, None, None),
    ("best_of below n", "/v1/completions", {"n": 3, "best_of": 2}, 400, "best_of",
     "best_of must be greater than or equal to n"),
    ("logit_bias out of vocab", "/v1/completions", {"logit_bias": {str(BIG): 1}}, 400, None, "out-of-vocab"),
    ("logit_bias key not an id", "/v1/completions", {"logit_bias": {"x": 1}}, 400, "logit_bias",
     "cannot be converted to integer token IDs"),
    ("logit_bias huge", "/v1/completions", {"logit_bias": {"5": BIG}}, 200, None, None),  # clamped to 100
    ("allowed_token_ids out of vocab", "/v1/completions", {"allowed_token_ids": [BIG]}, 400,
     "allowed_token_ids", "allowed_token_ids contains out-of-vocab token id!"),
    ("allowed_token_ids empty", "/v1/completions", {"allowed_token_ids": []}, 400, "allowed_token_ids",
     "allowed_token_ids is not None and empty!"),
    ("bad_words empty word", "/v1/completions", {"bad_words": [""]}, 400, "bad_words",
     "cannot contain an empty"),
    ("bad_words", "/v1/chat/completions", {"bad_words": ["the"]}, 200, None, None),
    ("min_tokens over max_tokens", "/v1/completions", {"min_tokens": 3}, 400, "min_tokens",
     "min_tokens must be less than or equal to max_tokens=2, got 3."),
    ("regex that does not compile", "/v1/completions", {"structured_outputs": {"regex": "("}}, 400, None,
     "the structured_outputs regex cannot be compiled: Regex parsing error"),
    ("json schema that is not JSON", "/v1/chat/completions", {"guided_json": "{bad"}, 400, None,
     "the structured_outputs json cannot be compiled"),
    ("two constraints", "/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, 400,
     "structured_outputs", "only use one kind of structured outputs constraint"),
    ("response_format json_object", "/v1/chat/completions", {"response_format": {"type": "json_object"}}, 200,
     None, None),
    ("response_format unknown", "/v1/chat/completions", {"response_format": {"type": "xml"}}, 400,
     "response_format", "not supported"),
    ("presence_penalty inf", "/v1/completions", {"presence_penalty": 1e999}, 400, "presence_penalty",
     "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty -3", "/v1/completions", {"frequency_penalty": -3}, 400, "frequency_penalty", "[-2, 2]"),
    ("presence_penalty in range", "/v1/completions", {"presence_penalty": 0.5}, 200, None, None),
    ("presence_penalty 0", "/v1/completions", {"presence_penalty": 0}, 200, None, None),
    ("repetition_penalty inf", "/v1/completions", {"repetition_penalty": 1e999}, 400, "repetition_penalty",
     "finite number"),
    ("repetition_penalty 0", "/v1/completions", {"repetition_penalty": 0}, 400, "repetition_penalty",
     "greater than zero"),
    ("min_p 2", "/v1/completions", {"min_p": 2}, 400, "min_p", "min_p must be in [0, 1], got 2."),
    ("min_tokens negative", "/v1/completions", {"min_tokens": -BIG}, 400, "min_tokens", "greater than or equal to 0"),
    ("best_of 0", "/v1/completions", {"best_of": 0}, 400, "best_of", "at least 1"),
    ("stop_token_ids beyond int64", "/v1/completions", {"stop_token_ids": [BIG]}, 400, "stop_token_ids",
     "out-of-vocab token ids. Vocabulary size: 1024"),
    ("stop_token_ids negative", "/v1/completions", {"stop_token_ids": [-1]}, 400, "stop_token_ids", "out-of-vocab"),
    ("prompt token beyond int64", "/v1/completions", {"prompt": [BIG]}, 400, None, "out of range"),
    ("prompt token negative", "/v1/completions", {"prompt": [-1]}, 400, None, "out of range"),
    ("echo of a token out of range", "/v1/completions", {"prompt": [BIG], "echo": True}, 400, None, "out of range"),
    ("echo as a number other than 0 / 1", "/v1/completions", {"echo": 2}, 400, "echo", "must be a boolean"),
    ("stream as a string pydantic does not read", "/v1/completions", {"stream": "maybe"}, 400, "stream",
     "must be a boolean"),
]
RAW_CORPUS = [  # (class, raw body, fragment): bodies json.dumps cannot write; all 400
    ("NaN literal", b'{"prompt": "x", "temperature": NaN}', "not valid JSON"),
    ("Infinity literal", b'{"prompt": "x", "top_p": -Infinity}', "not valid JSON"),
    ("integer of 5000 digits", b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
    ("nesting 100000 deep", b"[" * 100000 + b"]" * 100000, "not valid JSON"),
    ("bytes that are not UTF-8", b'{"prompt": "\xff\xfe"}', "not valid JSON"),
    # a \u escape of a lone UTF-16 surrogate: json reads it into a str UTF-8 cannot encode (the 404 naming the
    # model, echo and the Responses API's fields once failed to send it: a dropped connection or a 500)
    ("a lone surrogate in the model's name", b'{"prompt": "x", "model": "\\ud800"}', "lone UTF-16 surrogate"),
    ("a lone surrogate echoed", b'{"prompt": "x\\udfff", "echo": true, "max_tokens": 2}', "lone UTF-16 surrogate"),
    ("a lone surrogate as a key", b'{"prompt": "x", "\\ud83d": 1}', "lone UTF-16 surrogate"),
]


def test_bad_input_corpus_leaves_the_server_healthy(srv):
    assert len(CORPUS) + len(RAW_CORPUS) >= 50
    for name, path, fields, want, param, fragment in CORPUS:
        base = {"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}
        raw = json.dumps({**base, "max_tokens": 2, **fields}).replace("Infinity", "1e999")  # valid JSON, read as inf
        status, _, data = srv.request("POST", path, raw, {"Content-Type": "application/json"})
        body = json.loads(data)
        if want == 200:
            assert status == 200 and body["usage"]["completion_tokens"] >= 1, (name, body)
        else:
            check_error(status, body, want, param, fragment)
        assert srv.request("GET", "/health")[0] == 200, name
    for name, raw, fragment in RAW_CORPUS:
        status, _, data = srv.request("POST", "/v1/completions", raw, {"Content-Type": "application/json"})
        check_error(status, json.loads(data), 400, None, fragment)
        assert srv.request("GET", "/health")[0] == 200, name
    pair = b'{"prompt": "\\ud83d\\ude00", "echo": true, "max_tokens": 2}'  # a surrogate pair: one code point
    status, _, data = srv.request("POST", "/v1/completions", pair, {"Content-Type": "application/json"})
    assert status == 200 and json.loads(data)["choices"][0]["text"].startswith("\U0001F600")
    # a top_k past the vocabulary keeps every token: the same seeded sample as no top_k at all
    body = {"prompt": "seeded", "max_tokens": 12, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    same = [srv.post("/v1/completions", dict(body, top_k=k))[1]["choices"][0]["text"] for k in (BIG, -1, 1024)]
    assert same[0] == same[1] == same[2]


# ==============================================================================================
# HTTP framing over a raw socket, read timeouts, the connection cap, half-closed clients
# ==============================================================================================

def raw_http(port, data, half_close=False, method=None, timeout=10):
    """Send raw bytes; -> (status, headers, body) of the answer, parsed by http.client (which insists on a
    status line and skips interim "100 Continue" answers)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        r = http.client.HTTPResponse(s, method=method)
        r.begin()
        return r.status, dict(r.getheaders()), r.read()


def post_head(path="/v1/completions", length=None, extra="", ctype="application/json"):
    n = "" if length is None else f"Content-Length: {length}\r\n"
    t = "" if ctype is None else f"Content-Type: {ctype}\r\n"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n{t}{n}{extra}\r\n".encode()


def check_http_error(answer, want, fragment=""):
    status, headers, data = answer
    err = json.loads(data)["error"]
    assert status == want and err["code"] == want and fragment in err["message"], (status, err)
    assert headers["Content-Type"] == "application/json"
    return headers


def test_http_framing(srv):
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    for method in ("PUT", "DELETE", "OPTIONS", "PATCH"):
        headers = check_http_error(raw_http(srv.port, f"{method} /v1/completions HTTP/1.1\r\n\r\n".encode()), 405)
        assert headers["Allow"] == "POST"
    assert check_http_error(raw_http(srv.port, post_head("/health", 0)), 405)["Allow"] == "GET, HEAD"
    check_http_error(raw_http(srv.port, b"BREW /health HTTP/1.1\r\n\r\n"), 501, "BREW")
    # HEAD where GET exists: the GET's headers, no body (the next answer on the connection parses cleanly)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"HEAD /v1/models HTTP/1.1\r\n\r\n")
        head = http.client.HTTPResponse(s, method="HEAD")
        head.begin()
        assert head.status == 200 and int(head.getheader("Content-Length")) > 0 and head.read() == b""
        s.sendall(b"GET /health HTTP/1.1\r\n\r\n")
        nxt = http.client.HTTPResponse(s)
        nxt.begin()
        assert nxt.status == 200 and nxt.read() == b""
    # a body shorter than its Content-Length, the client half-closed: refused, not taken as complete
    check_http_error(raw_http(srv.port, post_head(length=len(body) + 10) + body, half_close=True), 400, "ended after")
    # one valid Content-Length or none: RFC 9112 (request smuggling)
    for lengths in ((len(body), len(body)), (len(body), 3)):
        extra = "".join(f"Content-Length: {n}\r\n" for n in lengths)
        check_http_error(raw_http(srv.port, post_head(extra=extra) + body), 400, "Content-Length")
    for bad_length in ("abc", "-5", "+5", "0x10", "5, 5", "", "99999999999999999999"):
        check_http_error(raw_http(srv.port, post_head(length=bad_length) + body), 400, "Content-Length")
    check_http_error(raw_http(srv.port, post_head(extra="Transfer-Encoding: chunked\r\n") + b"0\r\n\r\n"), 411)
    check_http_error(raw_http(srv.port, post_head(length=len(body), extra="Transfer-Encoding: chunked\r\n") + body),
                     400)
    # a bad request line: an answer with a status line all the same
    for line in (b"GARBAGE", b"GET /", b"GET / HTTP/x", b"GET / HTTP/1.1 extra"):
        check_http_error(raw_http(srv.port, line + b"\r\n\r\n"), 400)
    check_http_error(raw_http(srv.port, b"GET /health HTTP/2.0\r\n\r\n"), 505)
    check_http_error(raw_http(srv.port, b"GET /health HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n"), 431)
    # the media type, then the size: both before any of the body is read
    for ctype in (None, "text/plain", "application/jsonx"):
        check_http_error(raw_http(srv.port, post_head(length=len(body), ctype=ctype) + body), 415,
                         "Only 'application/json' is allowed")
    t0 = time.time()
    check_http_error(raw_http(srv.port, post_head(length=(1 << 26) + 1)), 413)  # no body sent at all
    assert time.time() - t0 < 2
    status, _, data = raw_http(srv.port, post_head(length=len(body)) + body)
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 2
    assert srv.request("GET", "/health")[0] == 200


def test_api_key_checked_before_the_body(srv_small):
    port, key = srv_small.port, "Authorization: Bearer sekrit\r\n"
    t0 = time.time()  # 50 MB announced, none sent: the 401 comes at once (no wait for the body)
    assert raw_http(port, post_head(length=50_000_000))[:2][0] == 401 and time.time() - t0 < 2
    # a client that waits for "100 Continue": none before a refusal; after the checks, one, then the answer
    status, _, data = raw_http(port, post_head(length=10, extra="Expect: 100-continue\r\n"))
    assert status == 401 and json.loads(data) == {"error": "Unauthorized"}
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(post_head(length=len(body), extra=key + "Expect: 100-continue\r\n"))
        assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        r = http.client.HTTPResponse(s)
        r.begin()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2
    # a small body sent with a refused request is read and dropped: the connection serves the next request
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for request, want in ((post_head(length=len(body)) + body, 401), (b"GET /health HTTP/1.1\r\n\r\n", 200)):
            s.sendall(request)
            r = http.client.HTTPResponse(s)
            r.begin()
            assert r.status == want
            r.read()


# a 1 s request timeout and at most 4 open connections
srv_limits = server_fixture("srv_limits", "--max-num-seqs", "2", "--request-timeout", "1", "--max-connections", "4")


def closed_after(sock, send=b"", gap=0.0, limit=5.0):
    """Seconds until the server closes `sock` (it reads b""), while sending `send` a byte every `gap` seconds;
    also what came back."""
    t0, got, sent = time.time(), b"", 0
    sock.settimeout(0.05)
    while time.time() - t0 < limit:
        if sent < len(send) and time.time() - t0 >= sent * gap:
            sock.send(send[sent:sent + 1])
            sent += 1
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        if not data:
            return time.time() - t0, got
        got += data
    raise AssertionError(f"the server did not close the connection within {limit} s ({sent} bytes sent)")


def test_read_timeouts(srv_limits):
    port = srv_limits.port
    with socket.create_connection(("127.0.0.1", port)) as s:  # a silent client
        took, got = closed_after(s)
        assert 0.8 < took < 3 and got == b""
    with socket.create_connection(("127.0.0.1", port)) as s:  # headers trickled a byte every 0.2 s: a deadline
        took, got = closed_after(s, send=b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 100, gap=0.2)
        assert 0.8 < took < 3 and got == b""
    with socket.create_connection(("127.0.0.1", port)) as s:  # a body that stops coming: 408
        s.sendall(post_head(length=100) + b'{"prompt":')
        took, got = closed_after(s)
        assert 0.8 < took < 3 and got.startswith(b"HTTP/1.1 408 ") and b'"code": 408' in got
    with socket.create_connection(("127.0.0.1", port)) as s:  # keep-alive: idle after an answer, then closed
        s.sendall(b"GET /health HTTP/1.1\r\n\r\n")
        took, got = closed_after(s)
        assert got.startswith(b"HTTP/1.1 200 ") and 0.8 < took < 3
    assert srv_limits.request("GET", "/health")[0] == 200


def test_client_reset_is_not_logged_as_an_error(srv_limits):
    """A keep-alive client that exits resets its connection (SO_LINGER 0: an RST, as a benchmark client's exit
    does): the server goes on, and its log shows no traceback for it."""
    before = open(srv_limits.log).read().count("Traceback")
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", srv_limits.port))
        s.sendall(b"GET /health HTTP/1.1\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
        time.sleep(0.1)  # the server waits for the next request on it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    time.sleep(0.3)
    assert srv_limits.request("GET", "/health")[0] == 200
    time.sleep(0.5)  # the reset connection's thread has run (its traceback, if any, is in the log)
    assert open(srv_limits.log).read().count("Traceback") == before


def test_connection_cap(srv_limits):
    time.sleep(1.5)  # every earlier connection has ended: closed by its client or timed out (1 s)
    held = [socket.create_connection(("127.0.0.1", srv_limits.port), timeout=5) for _ in range(4)]
    try:
        time.sleep(0.2)  # all four accepted, each with its thread
        t0 = time.time()
        check_http_error(raw_http(srv_limits.port, b"GET /health HTTP/1.1\r\n\r\n"), 503, "--max-connections 4")
        assert time.time() - t0 < 1
        for s in held:  # the four were admitted: each is served
            s.sendall(b"GET /health HTTP/1.1\r\n\r\n")
            r = http.client.HTTPResponse(s)
            r.begin()
            assert r.status == 200
    finally:
        for s in held:
            s.close()
    t0 = time.time()
    while (status := raw_http(srv_limits.port, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")[0]) != 200:
        assert time.time() - t0 < 3, status
        time.sleep(0.05)


def test_a_large_grammar_does_not_stall_other_requests(srv):
    """A request whose grammar takes seconds to compile (an enum of 8000 strings) is compiled by its own handler
    thread (EngineLoop._compile; the engine thread's compile is then a hit in xgrammar's cache): a stream running
    beside it keeps getting its tokens (before, the engine thread compiled it and every request in flight stopped
    for as long), a small grammar sent meanwhile is answered first (compiles one at a time made it wait), and the
    request is answered with one of its choices."""
    pytest.importorskip("xgrammar")
    choices = [f"option number {i}" for i in range(8000)]
    got = {}

    def big():
        t = time.perf_counter()
        got["status"], got["out"] = srv.post("/v1/completions", {"prompt": "pick", "max_tokens": 40, "temperature": 0,
                                                                 "structured_outputs": {"choice": choices}},
                                             timeout=120)
        got["end"] = time.perf_counter()
        got["took"] = got["end"] - t

    def small():  # a small grammar sent while the big one compiles: compiled at once, not after it
        t = time.perf_counter()
        status, out = srv.post("/v1/completions", {"prompt": "yes?", "max_tokens": 3, "temperature": 0,
                                                   "structured_outputs": {"choice": ["yes", "no"]}})
        got["small"] = (status, out["choices"][0]["text"], time.perf_counter() - t)
    conn, r = open_stream(srv, {"prompt": "stall", "max_tokens": 1500, "ignore_eos": True, "temperature": 0})
    try:
        assert r.readline().startswith(b"data: ")                                   # the stream is running
        th = threading.Thread(target=big)
        th.start()
        time.sleep(0.2)                                                              # (its compile under way)
        threading.Thread(target=small).start()
        gaps, last = [], time.perf_counter()
        while th.is_alive():
            if not r.readline():                                                     # (the stream ended first)
                break
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        th.join()
    finally:
        conn.close()
    assert got["status"] == 200 and got["out"]["choices"][0]["text"] in choices, got
    assert got["took"] > 0.5 and max(gaps) < 0.3 * got["took"], (max(gaps), got["took"])
    # the small one answered at once (one compile at a time made it wait for most of the big one's ~2 s compile)
    assert got["small"][:2] in ((200, "yes"), (200, "no")) and got["small"][2] < 0.4 * got["took"], got


def test_kept_alive_answers_do_not_wait_for_the_clients_ack(srv):
    """An answer's headers and body are two writes: on a kept-alive connection the body waited for the client's
    delayed ACK of the headers (Nagle's algorithm: ~40 ms more for every non-streamed answer after a connection's
    first, as the openai client reuses connections); the server's sockets send at once (TCP_NODELAY)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    took = []
    try:
        for _ in range(7):
            t0 = time.perf_counter()
            conn.request("GET", "/version")
            r = conn.getresponse()
            assert r.status == 200 and r.read()
            took.append(time.perf_counter() - t0)
    finally:
        conn.close()
    assert statistics.median(took[1:]) < 0.025, took  # (~0.04 each before)


def test_refused_requests_count_no_aborts(srv):
    """A request refused after some of its sequences were queued (a batch whose third prompt is too long: 400) has
    them withdrawn without counting them as aborted requests in /metrics (vLLM refuses it before any runs); the
    first two prompts' requests were counted as aborts before."""
    aborted = lambda m: metric(m, "vllm:request_success_total", finished_reason="abort")  # noqa: E731
    before = wait_idle(srv)
    # (200 tokens each: the first two are still running when the third is refused and they are withdrawn)
    st, r = srv.post("/v1/completions", {"prompt": ["a b", "c d", [5] * 10000], "max_tokens": 200, "ignore_eos": True})
    check_error(st, r, 400, None, "maximum context length")
    after = wait_idle(srv)
    assert aborted(after) == aborted(before) and metric(after, "vllm:request_success_total") == metric(
        before, "vllm:request_success_total")
    assert srv.post("/v1/completions", {"prompt": "a b", "max_tokens": 2})[0] == 200  # (and the server goes on)


def test_half_closed_client_gets_its_answer(srv):
    before = wait_idle(srv)

    def ask(stream):  # (both at once: the server batches them, so the test takes the time of one)
        # 1500 tokens: long enough to span two of the server's checks on a fast CPU (400 took 0.75 s on one)
        body = json.dumps({"prompt": "half", "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
                           "stream": stream}).encode()
        t0 = time.time()
        answer = raw_http(srv.port, post_head(length=len(body)) + body, half_close=True, timeout=60)
        return time.time() - t0, answer
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(ask, (False, True)))
    for stream, (took, (status, headers, data)) in zip((False, True), answers):  # (each its own connection)
        assert took > 1.0  # the server looks for gone clients every 0.5 s: it saw this one's half-close
        assert status == 200
        if stream:
            events = [e for e in data.decode().split("\n\n") if e.strip() and not e.startswith(":")]  # SSE comments
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        else:
            assert json.loads(data)["usage"]["completion_tokens"] == 1500
    aborted = lambda m: metric(m, "vllm:request_success_total", finished_reason="abort")
    assert aborted(wait_idle(srv)) == aborted(before)


# ==============================================================================================
# Fault isolation: faults injected into the engine of a server process
# ==============================================================================================

FAULTS = '''
import specdec
init, prefill, launch = specdec.Engine.__init__, specdec.ModelRunner.prefill, specdec.ModelRunner.launch
marked = lambda req, mark: req.prompt_ids[:3] == [mark] * 3
engines = []

def _init(self, *a, **kw):
    engines.append(self)
    init(self, *a, **kw)

def _prefill(self, req, *a):
    if marked(req, 7) or "PREFILL-FAULT" in engines[0].tokenizer.decode(req.prompt_ids):
        raise RuntimeError("injected fault in a prefill")
    return prefill(self, req, *a)

def _launch(self, reqs):
    if any(marked(r, 8) for r in reqs) and engines[0].waiting:  # once another request waits for a slot
        raise ValueError("injected fault in a batched step")
    if any(marked(r, 9) for r in reqs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
    return launch(self, reqs)

specdec.Engine.__init__, specdec.ModelRunner.prefill, specdec.ModelRunner.launch = _init, _prefill, _launch
'''


srv_faulty = server_fixture("srv_faulty", "--max-num-seqs", "2", prelude=FAULTS)


def test_device_fault_classification():
    import server
    assert server.device_fault(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert server.device_fault(RuntimeError("CUDA error: device-side assert triggered"))
    assert not server.device_fault(ValueError("Overflow when unpacking long long"))
    assert not server.device_fault(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))


def test_fault_in_one_prefill_leaves_the_others_running(srv_faulty):
    s, errors = srv_faulty, lambda m: metric(m, "vllm:request_success_total", finished_reason="error")
    before = wait_idle(s)
    body = {"prompt": "the other request", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    conn, resp = open_stream(s, dict(body, stream_options={"include_usage": True}))
    try:
        first = resp.readline()
        assert first.startswith(b"data: ")  # running
        status, err = s.post("/v1/completions", {"prompt": [7, 7, 7, 1, 2], "max_tokens": 5})
        check_error(status, err, 500, None, "RuntimeError: injected fault in a prefill")
        assert s.request("GET", "/health")[0] == 200
        events = sse_events(first + resp.read())
    finally:
        conn.close()
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert events[-1]["usage"]["completion_tokens"] == 200 and events[-2]["choices"][0]["finish_reason"] == "length"
    assert text == s.post("/v1/completions", body)[1]["choices"][0]["text"]  # untouched: the same greedy text
    assert errors(wait_idle(s)) - errors(before) == 1


def test_fault_in_a_responses_stream_is_an_error_event(srv_faulty):
    """A /v1/responses stream whose request the engine fails ends with OpenAI's `error` event (code 500, the
    fault named) after response.created, instead of chat's data line; the server goes on. A stored response asked
    for (GET /v1/responses/{id}) is vLLM's 404: nothing is stored."""
    s = srv_faulty
    status, _, data = s.request("POST", "/v1/responses", {"input": "PREFILL-FAULT", "stream": True,
                                                          "max_output_tokens": 4})
    blocks = [b for b in data.decode().split("\n\n") if b.strip() and not b.startswith(":")]
    events = [json.loads(b.split("data: ", 1)[1]) for b in blocks]
    assert status == 200 and [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1]["code"] == 500 and "injected fault in a prefill" in events[-1]["message"]
    assert all(b.startswith(f"event: {e['type']}\n") for b, e in zip(blocks, events))
    status, err = s.post("/v1/responses", {"input": "after", "max_output_tokens": 2})
    assert status == 200 and err["status"] in ("completed", "incomplete")
    status, _, err = s.request("GET", "/v1/responses/resp_123")
    check_error(status, json.loads(err), 404, None, "Response with id 'resp_123' not found")


def test_fault_in_a_batched_step_ends_its_batch_only(srv_faulty):
    s, errors = srv_faulty, lambda m: metric(m, "vllm:request_success_total", finished_reason="error")
    before = wait_idle(s)
    long = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    streams = [open_stream(s, dict(long, prompt=p)) for p in ("running", [8, 8, 8, 1])]  # both slots
    waiter = {}
    thread = threading.Thread(target=lambda: waiter.update(r=s.post("/v1/completions", {"prompt": "waiting",
                                                                                        "max_tokens": 8})))
    try:
        firsts = [resp.readline() for _, resp in streams]
        assert all(first.startswith(b"data: ") for first in firsts)
        thread.start()  # it waits for a slot; the marked request's next step then fails
        for first, (_, resp) in zip(firsts, streams):  # the batch ends: an error event, [DONE] (as vLLM streams)
            events = sse_events(first + resp.read())
            assert "ValueError: injected fault in a batched step" in events[-1]["error"]["message"]
            assert events[-1]["error"]["code"] == 500
        thread.join(60)
    finally:
        for conn, _ in streams:
            conn.close()
    assert waiter["r"][0] == 200 and waiter["r"][1]["usage"]["completion_tokens"] == 8  # the waiting one went on
    assert s.request("GET", "/health")[0] == 200
    assert s.post("/v1/completions", {"prompt": "after", "max_tokens": 4})[1]["usage"]["completion_tokens"] == 4
    assert errors(wait_idle(s)) - errors(before) == 2


def test_device_fault_exits_the_process(tiny_model, tmp_path):
    s = Server(tiny_model, str(tmp_path), prelude=FAULTS)
    try:
        status, err = s.post("/v1/completions", {"prompt": [9, 9, 9, 1], "max_tokens": 5})
        check_error(status, err, 500, None, "CUDA error: an illegal memory access")
        assert s.proc.wait(timeout=30) != 0  # a supervisor restarts it; it does not linger at 503
    finally:
        s.stop()
    lines = [line for line in open(s.log).read().splitlines() if "fatal engine error" in line]
    assert lines == ["specdec server: fatal engine error, exiting: RuntimeError: CUDA error: an illegal memory "
                     "access was encountered (injected)"]


# ==============================================================================================
# The shipped toy model: real acceptance on held-out stdlib files (tools/eval_toy.py, fewer prompts)
# ==============================================================================================

TOY = os.path.join(HERE, "models", "toy")


@pytest.mark.skipif(not os.path.isdir(TOY), reason="models/toy not present")
def test_toy_model_acceptance_and_lossless():
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import eval_toy
    methods = {k: v for k, v in eval_toy.METHODS.items() if v["method"] in sd.PROPOSERS}
    prompts, rows = eval_toy.evaluate(TOY, "cpu", "float32", 3, 128, 96, methods)
    assert len(prompts) == 3
    for name, r in rows.items():
        if name != "off":
            assert r["equal_to_off"], name
    assert rows["mtp k=1"]["mean_acceptance_length"] >= 1.5
    assert rows["mtp k=3"]["mean_acceptance_length"] >= 2.0
    if "dflash block 8" in rows:  # the trained block drafters: 3.53 and 4.21 on these prompts (3.38 and 4.29 on
        # the 8-prompt CPU evaluation in models/README.md)
        dflash, dspark = (rows[f"{m} block 8"]["mean_acceptance_length"] for m in ("dflash", "dspark"))
        assert dflash >= 2.5 and dspark >= dflash


def test_train_drafters_batched_attention_is_the_reference():
    """tools/train_drafters.py trains the MTP chain through a batched masked attention (the reference loops over
    rows on the host): equal to kernels.attention_ref, each row at its own position and slot, decode and prefill
    lengths, GQA."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import train_drafters
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(6, 40, 2, 64, generator=g), torch.randn(6, 40, 2, 64, generator=g)
    for T in (1, 5, 33):
        q = torch.randn(3, T, 4, 64, generator=g)
        slots, pos = torch.tensor([4, 0, 2]), torch.tensor([2, 5, 0])
        ref = K.attention_ref(q, kc, vc, slots, pos, 38)
        torch.testing.assert_close(train_drafters.batched_attention(q, kc, vc, slots, pos, 38), ref,
                                   rtol=1e-5, atol=1e-5)


def test_default_model_is_the_shipped_toy():
    if not os.path.isdir(TOY):
        pytest.skip("models/toy not present")
    r = run_cli("--prompt", "def fib(n):", "--max-tokens", "12", "--device", "cpu")
    assert r.returncode == 0 and "generated tokens: 12" in r.stderr, r.stderr


# ==============================================================================================
# Tier 2: kernels (Triton vs PyTorch reference; interpreted on CPU, compiled on the GPU)
# ==============================================================================================

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _interpretable():
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(K._rms_norm_kernel, InterpretedFunction)


KERNELS_RUN = K.triton is not None and (CUDA or _interpretable())
needs_kernels = pytest.mark.skipif(not KERNELS_RUN, reason="Triton kernels cannot run here (see module doc)")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def fast(fn, *args, **kw):
    """Call a public kernels.py function on its Triton path (interpreted on CPU), with every buffer the
    wrapper allocates filled with NaN (or -7) first, so an element the kernel forgets shows up."""
    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device)
    old = K.USE_TRITON, K.INTERPRET, K._empty
    K.USE_TRITON, K.INTERPRET, K._empty = True, not CUDA, poisoned
    try:
        return fn(*args, **kw)
    finally:
        K.USE_TRITON, K.INTERPRET, K._empty = old


def rel(out, ref):
    """Relative error ||out - ref|| / ||ref|| in fp32 (inf when out has NaNs)."""
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}  # (the interpreter rounds fp32 -> bf16 by truncation)
DTYPES = [torch.float32, torch.bfloat16]


def gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(*shape, g, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


# ==============================================================================================
# Small odd shapes (CPU interpreter or GPU)
# ==============================================================================================

@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("I", [24, 1100])
def test_kernel_silu_mul(dtype, I):
    g = gen(5)
    h = randn(3, 5, 2 * I, g=g, dtype=dtype)
    assert rel(fast(K.silu_mul, h), K.silu_mul_ref(h)) <= TOL[dtype]
    hs = randn(2, 3, 2 * I + 8, g=g, dtype=dtype)[..., :2 * I]                    # a strided view
    assert rel(fast(K.silu_mul, hs), K.silu_mul_ref(hs)) <= TOL[dtype]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [24, 1100])
def test_kernel_sigmoid_mul(dtype, D):
    """The attention output gate x * sigmoid(gate), the gate the strided second half of per-head [query | gate]."""
    g = gen(D)
    qg = randn(2, 3, 4, 2 * D, g=g, dtype=dtype, scale=3)
    x = randn(2, 3, 4, D, g=g, dtype=dtype)
    y = fast(K.sigmoid_mul, x, qg[..., D:])
    assert y.shape == x.shape and rel(y, K.sigmoid_mul_ref(x, qg[..., D:])) <= TOL[dtype]


def test_fused_projections_equal_separate(tiny):
    """fuse_projections (done at load) computes what the separate projections compute."""
    fused = LLM(model=tiny, device="cpu").model
    with torch.device("meta"):
        plain = sd.Qwen36(fused.cfg)
    plain.load_state_dict({k: v.clone() for k, v in fused.state_dict().items()}, assign=True)
    sd.init_rope(plain, "cpu")
    assert hasattr(fused.layers[0].linear_attn, "in_proj") and not hasattr(plain.layers[0].linear_attn, "in_proj")
    ids = torch.randint(0, 500, (2, 11), generator=torch.Generator().manual_seed(0))
    outs = []
    for m in (fused, plain):
        st = sd.State(m.cfg, 2, 16, torch.float32, "cpu")
        with torch.inference_mode():
            outs.append(m(ids, sd.Ctx(st, torch.arange(2), torch.zeros(2, dtype=torch.long), 11, "prefill")))
    assert (outs[0] - outs[1]).abs().max() < 1e-5


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [40, 256])
def test_kernel_rms_norms(dtype, D):
    g = gen(0)
    x = randn(3, 5, D, g=g, dtype=dtype)
    w = randn(D, g=g, dtype=dtype, scale=0.1)
    assert rel(fast(K.rms_norm, x, w, 1e-6), K.rms_norm_ref(x, w, 1e-6)) <= TOL[dtype]
    qg = randn(2, 3, 4, 2 * D, g=g, dtype=dtype)                                   # q half of q_proj: strided
    q = qg[..., :D]
    assert rel(fast(K.rms_norm, q, w, 1e-6), K.rms_norm_ref(q, w, 1e-6)) <= TOL[dtype]
    z = randn(3, 5, D, g=g, dtype=dtype)
    wg = 1 + randn(D, g=g, dtype=dtype, scale=0.1)
    assert rel(fast(K.gated_rms_norm, x, z, wg, 1e-6), K.gated_rms_norm_ref(x, z, wg, 1e-6)) <= TOL[dtype]
    x4 = randn(2, 3, 4, D, g=g, dtype=dtype)                                      # GDN: z's heads sliced from the
    z4 = randn(2, 3, 4 * D + 9, g=g, dtype=dtype)[..., 5:5 + 4 * D].view(2, 3, 4, D)  # in_proj output (no view of
    assert rel(fast(K.gated_rms_norm, x4, z4, wg, 1e-6), K.gated_rms_norm_ref(x4, z4, wg, 1e-6)) <= TOL[dtype]  # rows)
    assert rel(fast(K.plain_rms_norm, q, wg, 1e-6), K.plain_rms_norm_ref(q, wg, 1e-6)) <= TOL[dtype]  # Qwen3's


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 5, 63])
def test_kernel_causal_conv(dtype, T):
    g = gen(T)
    B, C, Kc, S = 3, 300, 4, 6
    x = randn(B, T, C + 8, g=g, dtype=dtype)[..., :C]                                # strided rows
    w = randn(C, 1, Kc, g=g, dtype=dtype, scale=0.5)[:, 0]                           # [C, K] view, like the model
    pool = randn(S, C, Kc - 1, g=g, dtype=dtype)
    slots = torch.tensor([4, 0, 2], device=DEV)
    keeps = [None, torch.zeros(B, dtype=torch.long, device=DEV),
             torch.tensor([0, min(2, T), T], device=DEV)]
    for n_keep in keeps:
        p1, p2 = pool.clone(), pool.clone()
        y = fast(K.causal_conv, x, p1, slots, w, n_keep)
        y_ref = K.causal_conv_ref(x, p2, slots, w, n_keep)
        assert rel(y, y_ref) <= TOL[dtype], n_keep
        assert torch.equal(p1, p2), n_keep                                         # windows: exact copies
        if n_keep is not None:                                                     # the commit: the window only
            p3 = pool.clone()
            K.conv_window_ref(x, p3, slots, n_keep)
            assert torch.equal(p3, p2)


def gdn_inputs(B, T, Hk, Hv, dk, dv, dtype, seed):
    """q, k, v as strided slices of one conv output, like GatedDeltaNet.split; g fp32, beta in dtype."""
    g_ = gen(seed)
    y = randn(B, T, 2 * Hk * dk + Hv * dv, g=g_, dtype=dtype)
    q, k, v = y.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    q, k, v = q.reshape(B, T, Hk, dk), k.reshape(B, T, Hk, dk), v.reshape(B, T, Hv, dv)
    g = -torch.rand(B, T, Hv, generator=g_, device=DEV) * 2
    beta = torch.rand(B, T, Hv, generator=g_, device=DEV).to(dtype)
    return q, k, v, g, beta


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 5])
def test_kernel_gdn_recurrent(dtype, T):
    B, Hk, Hv, dk, dv, S = 3, 2, 6, 24, 20, 5
    q, k, v, g, beta = gdn_inputs(B, T, Hk, Hv, dk, dv, dtype, seed=T)
    pool = randn(S, Hv, dk, dv, g=gen(99), scale=0.3)
    slots = torch.tensor([3, 1, 4], device=DEV)
    for n_keep in [None, torch.zeros(B, dtype=torch.long, device=DEV), torch.tensor([0, min(2, T), T], device=DEV)]:
        p1, p2 = pool.clone(), pool.clone()
        o = fast(K.gdn_recurrent, q, k, v, g, beta, p1, slots, n_keep)
        o_ref = K.gdn_recurrent_ref(q, k, v, g, beta, p2, slots, n_keep)
        assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
        assert rel(o, o_ref) <= TOL[dtype], n_keep
        assert rel(p1, p2) <= 1e-5, n_keep                                         # states stay fp32
        untouched = [s for s in range(S) if s not in slots.tolist()]
        assert torch.equal(p1[untouched], pool[untouched])
        if n_keep is not None:
            for b in range(B):
                if int(n_keep[b]) == 0:
                    assert torch.equal(p1[slots[b]], pool[slots[b]])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_gdn_recurrent_gated(dtype):
    B, T, Hk, Hv, dk, dv = 2, 5, 1, 3, 16, 12
    q, k, v, _, _ = gdn_inputs(B, T, Hk, Hv, dk, dv, dtype, seed=3)
    g_ = gen(4)
    a = randn(B, T, Hv, g=g_, dtype=dtype, scale=8)                                # some past softplus' threshold 20
    b = randn(B, T, Hv, g=g_, dtype=dtype, scale=2)
    A_log, dt_bias = randn(Hv, g=g_, dtype=dtype, scale=0.5), randn(Hv, g=g_, dtype=dtype) + 10
    pool = randn(B, Hv, dk, dv, g=g_, scale=0.3)
    slots, n_keep = torch.tensor([1, 0], device=DEV), torch.tensor([4, 2], device=DEV)
    p1, p2 = pool.clone(), pool.clone()
    o = fast(K.gdn_recurrent_gated, q, k, v, a, b, A_log, dt_bias, p1, slots, n_keep)
    g, beta = K.gdn_gates(a, b, A_log, dt_bias)
    o_ref = K.gdn_recurrent_ref(q, k, v, g, beta, p2, slots, n_keep)
    assert rel(o, o_ref) <= TOL[dtype] and rel(p1, p2) <= (1e-5 if dtype == torch.float32 else 1e-2)
    C, W = 37, 3                                                                   # the commit's conv window:
    x = randn(B, T, C + 4, g=g_, dtype=dtype)[..., 2:2 + C]                         # strided conv inputs
    cpool = randn(3, C, W, g=g_, dtype=dtype)
    for keep in (n_keep, torch.tensor([0, 5], device=DEV)):  # the commit: states only, n_keep tokens (0: untouched)
        p3, p_ref = pool.clone(), pool.clone()
        assert fast(K.gdn_recurrent_gated, q, k, v, a, b, A_log, dt_bias, p3, slots, keep, outputs=False) is None
        K.gdn_recurrent_ref(q, k, v, g, beta, p_ref, slots, keep)                  # the reference's states
        assert rel(p3, p_ref) <= (1e-5 if dtype == torch.float32 else 1e-2), keep
        for i in range(B):
            assert int(keep[i]) > 0 or torch.equal(p3[slots[i]], pool[slots[i]])
        # plain decoding reaches its states one token at a time (T = 1 launches, outputs on): the commit's must be
        # those bit for bit, or speculation would not reproduce plain decoding's logits exactly
        p4 = pool.clone()
        for t in range(T):
            r = torch.tensor([i for i in range(B) if t < int(keep[i])], dtype=torch.long, device=DEV)
            if len(r):
                one = lambda x_: x_[r, t:t + 1]
                fast(K.gdn_recurrent_gated, one(q), one(k), one(v), one(a), one(b), A_log, dt_bias, p4, slots[r])
        assert torch.equal(p3, p4), keep
        p5, c5, c6 = pool.clone(), cpool.clone(), cpool.clone()                    # + the conv window, one launch
        fast(K.gdn_recurrent_gated, q, k, v, a, b, A_log, dt_bias, p5, slots, keep, outputs=False, conv=(x, c5))
        K.causal_conv_ref(x, c6, slots, randn(C, W + 1, g=g_, dtype=dtype), keep)
        assert torch.equal(p5, p3) and torch.equal(c5, c6) and not torch.equal(c5, cpool)


@needs_kernels
def test_kernel_gdn_long_and_chunked():
    B, T, Hk, Hv, dk, dv = 2, 63, 2, 4, 16, 16
    q, k, v, g, beta = gdn_inputs(B, T, Hk, Hv, dk, dv, torch.float32, seed=7)
    pool = randn(B + 1, Hv, dk, dv, g=gen(8), scale=0.3)
    slots = torch.tensor([2, 0], device=DEV)
    p1, p2, p3 = pool.clone(), pool.clone(), pool.clone()
    o1 = fast(K.gdn_recurrent, q, k, v, g, beta, p1, slots)
    o2 = fast(K.gdn_chunked, q, k, v, g, beta, p2, slots)
    o_ref = K.gdn_chunked_ref(q, k, v, g, beta, p3, slots)
    assert rel(o1, o_ref) <= 1e-5 and rel(p1, p3) <= 1e-5
    assert rel(o2, o_ref) <= 1e-5 and rel(p2, p3) <= 1e-5
    assert torch.equal(p1[1], pool[1])


def kv_setup(B, L, nkv, d, pos, T, dtype, seed, S=None):
    """A position-indexed cache with each row's keys 0 .. pos+T-1 filled, and a copy whose stale
    positions (>= pos+T) hold NaN: a kernel that reads past a row's own end would produce NaN."""
    g = gen(seed)
    S = S or B + 1
    kc, vc = randn(S, L, nkv, d, g=g, dtype=dtype), randn(S, L, nkv, d, g=g, dtype=dtype)
    slots = torch.randperm(S, generator=torch.Generator().manual_seed(seed))[:B].to(DEV)
    kp, vp = kc.clone(), vc.clone()
    for b in range(B):
        kp[slots[b], pos[b] + T:] = float("nan")
        vp[slots[b], pos[b] + T:] = float("nan")
    return kc, vc, kp, vp, slots


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 5])
def test_kernel_attention_decode(dtype, T):
    B, nh, nkv, d, L = 3, 6, 2, 32, 300
    pos = [0, 70, 250]
    kc, vc, kp, vp, slots = kv_setup(B, L, nkv, d, pos, T, dtype, seed=T)
    q = randn(B, T, nh, d, g=gen(T + 10), dtype=dtype)
    pos_t = torch.tensor(pos, device=DEV)
    kv_len = max(pos) + T
    ref = K.attention_ref(q, kc, vc, slots, pos_t, kv_len)
    assert rel(fast(K.attention, q, kp, vp, slots, pos_t, kv_len), ref) <= TOL[dtype]
    assert rel(fast(K.attention, q, kp, vp, slots, pos_t, L), ref) <= TOL[dtype]    # kv_len: any upper bound
    assert rel(fast(K.attention, q, kp, vp, slots, pos_t, L, 64), ref) <= TOL[dtype]  # 64-key pieces
    for nsplit in (1, 3, 7):
        o = fast(K._attention_launch, q, kp, vp, slots, pos_t, kv_len, nsplit=nsplit)
        assert rel(o, ref) <= TOL[dtype], nsplit


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 4])
def test_kernel_attention_output_gate(dtype, T):
    """attention's gate (the gated attention's output gate, the [query | gate] projection's strided gate half): the
    launch that combines the key pieces multiplies by sigmoid(gate) with sigmoid_mul's arithmetic, bit for bit,
    on the invariant path (fixed key pieces), at explicit splits and unsplit (sigmoid_mul after the kernel)."""
    B, nh, nkv, d, L = 2, 4, 2, 32, 300
    pos = [9, 140]
    kc, vc, kp, vp, slots = kv_setup(B, L, nkv, d, pos, T, dtype, seed=T + 3)
    qg = randn(B, T, nh, 2 * d, g=gen(T + 20), dtype=dtype)                        # per head [query | gate]
    q, gate = qg[..., :d], qg[..., d:]
    pos_t = torch.tensor(pos, device=DEV)
    for kw in ({}, {"nsplit": 1}, {"nsplit": 3}, {"nsplit": 7}):
        plain = fast(K._attention_launch, q, kp, vp, slots, pos_t, L, **kw)
        gated = fast(K._attention_launch, q, kp, vp, slots, pos_t, L, gate=gate, **kw)
        assert torch.equal(gated, fast(K.sigmoid_mul, plain, gate)), kw
    ref = K.sigmoid_mul_ref(K.attention_ref(q, kc, vc, slots, pos_t, L), gate)
    assert rel(fast(K.attention, q, kp, vp, slots, pos_t, L, gate=gate), ref) <= TOL[dtype]
    assert torch.equal(K.attention(q, kc, vc, slots, pos_t, L, gate=gate),          # the CPU / reference path
                       K.sigmoid_mul(K.attention(q, kc, vc, slots, pos_t, L), gate))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_attention_prefill(dtype):
    B, T, nh, nkv, d, L = 1, 63, 4, 1, 32, 160
    pos = [40]                                                                     # a second prefill chunk
    kc, vc, kp, vp, slots = kv_setup(B, L, nkv, d, pos, T, dtype, seed=5)
    q = randn(B, T, nh, d, g=gen(6), dtype=dtype)
    pos_t = torch.tensor(pos, device=DEV)
    ref = K.attention_ref(q, kc, vc, slots, pos_t, pos[0] + T)
    assert rel(fast(K.attention, q, kp, vp, slots, pos_t, pos[0] + T), ref) <= TOL[dtype]
    assert rel(fast(K._attention_launch, q, kp, vp, slots, pos_t, L, nsplit=2), ref) <= TOL[dtype]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5])
def test_kernel_attention_prep(dtype, T):
    B, nh, nkv, hd, L = 2, 6, 2, 32, 3000
    g = gen(T)
    qg = randn(B, T, nh, 2 * hd, g=g, dtype=dtype)                                 # [query | gate] per head
    k, v = randn(B, T, nkv, hd, g=g, dtype=dtype), randn(B, T, nkv, hd, g=g, dtype=dtype)
    qw, kw = randn(hd, g=g, dtype=dtype, scale=0.1), randn(hd, g=g, dtype=dtype, scale=0.1)
    inv_freq = 1.0 / 1e7 ** (torch.arange(0, hd // 4, 2, device=DEV).float() / (hd // 4))  # partial: rd = hd/4
    kc, vc = randn(B + 1, L, nkv, hd, g=g, dtype=dtype), randn(B + 1, L, nkv, hd, g=g, dtype=dtype)
    slots, pos = torch.tensor([2, 0], device=DEV), torch.tensor([7, 2900], device=DEV)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q = fast(K.attention_prep, qg, k, v, qw, kw, 1e-6, inv_freq, k1, v1, slots, pos)
    q_ref = K.attention_prep_ref(qg, k, v, qw, kw, 1e-6, inv_freq, k2, v2, slots, pos)
    assert rel(q, q_ref) <= TOL[dtype] and rel(k1, k2) <= TOL[dtype] and torch.equal(v1, v2)
    changed = (k1 != kc).any(-1).any(-1)                                            # [S, L]: rows written
    for b in range(B):
        assert changed[slots[b], pos[b]:pos[b] + T].all()
    assert changed.sum() == B * T


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5])
def test_kernel_attention_prep_plain(dtype, T):
    """Qwen3's layers (the drafters): plain q/k norm weights, full rotary; and a cache write without queries."""
    if dtype != torch.float32 and not CUDA:
        pytest.skip("bf16 plain mode runs on the GPU only: the interpreter emulates bf16 casts by truncation, and a "
                    "full rotation chains more of them than the zero-centred check, past bf16's tolerance")
    B, nh, nkv, hd, L = 2, 6, 2, 32, 3000
    g = gen(T + 20)
    q3 = randn(B, T, nh, hd, g=g, dtype=dtype)
    k, v = randn(B, T, nkv, hd, g=g, dtype=dtype), randn(B, T, nkv, hd, g=g, dtype=dtype)
    qw3, kw3 = 1 + randn(hd, g=g, dtype=dtype, scale=0.1), 1 + randn(hd, g=g, dtype=dtype, scale=0.1)
    inv3 = 1.0 / 1e6 ** (torch.arange(0, hd, 2, device=DEV).float() / hd)
    kc, vc = randn(B + 1, L, nkv, hd, g=g, dtype=dtype), randn(B + 1, L, nkv, hd, g=g, dtype=dtype)
    slots, pos = torch.tensor([2, 0], device=DEV), torch.tensor([7, 2900], device=DEV)
    for qq in (q3, k[:, :, :0]):
        k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        q = fast(K.attention_prep, qq, k, v, qw3, kw3, 1e-6, inv3, k1, v1, slots, pos, plain=True)
        q_ref = K.attention_prep_ref(qq, k, v, qw3, kw3, 1e-6, inv3, k2, v2, slots, pos, plain=True)
        assert q.shape == q_ref.shape and rel(k1, k2) <= TOL[dtype] and torch.equal(v1, v2)
        assert q.numel() == 0 or rel(q, q_ref) <= TOL[dtype]
        assert not torch.equal(k1, kc)


@needs_kernels
@pytest.mark.parametrize("E,k", [(12, 3), (256, 8)])
def test_kernel_moe_route(E, k):
    for dtype in DTYPES:  # bf16 logits tie often: then only the chosen values must agree, not the order
        logits = randn(7, E, g=gen(E), dtype=dtype, scale=2)
        w, idx = fast(K.moe_route, logits, k)
        w_ref, idx_ref = K.moe_route_ref(logits, k)
        assert idx.dtype == torch.long and torch.equal(logits.gather(1, idx), logits.gather(1, idx_ref))
        assert torch.equal(idx, idx_ref) or dtype != torch.float32
        assert rel(w, w_ref) <= 1e-6
        # ties (logits 0, 1, 2: exact in bf16 too): the largest first and, of equal ones, the lowest expert first
        tied = torch.randint(0, 3, (7, E), generator=torch.Generator().manual_seed(E)).to(DEV, dtype)  # (a CPU draw)
        want = [sorted(range(E), key=lambda e: (-row[e], e))[:k] for row in tied.float().tolist()]
        assert fast(K.moe_route, tied, k)[1].tolist() == want


@needs_kernels
@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 3, 5, 17])
def test_kernel_moe_experts(dtype, N, invariant, monkeypatch):
    """Both ways through the pairs: one program per pair (decode and verify: N = 1, 3, and every N under
    BATCH_INVARIANT), and grouped by expert through tl.dot (N = 5, 17 without it, as prefill runs)."""
    monkeypatch.setattr(K, "BATCH_INVARIANT", invariant)
    E, k, H, I = 6, 2, 40, 24
    g = gen(N)
    x = randn(N, H, g=g, dtype=dtype)
    gate_up, down = randn(E, 2 * I, H, g=g, dtype=dtype, scale=0.2), randn(E, H, I, g=g, dtype=dtype, scale=0.2)
    w, idx = K.moe_route_ref(randn(N, E, g=g), k)
    assert N != 3 or idx.unique().numel() < idx.numel()                          # an expert two tokens chose
    ref = K.moe_experts_ref(x, w, idx, gate_up, down)
    tol = TOL[dtype] * (3 if dtype == torch.bfloat16 else 1)                      # the reference rounds more often
    assert rel(fast(K.moe_experts, x, w, idx, gate_up, down), ref) <= tol
    # the fused epilogue: + sigmoid(gate) * shared + residual; the gate a strided column as the fused GEMM gives it
    sh, res = randn(N, H, g=g, dtype=dtype), randn(N, H, g=g, dtype=dtype)
    gate = randn(N, 3, g=g, dtype=dtype)[:, 1:2]
    use, K.USE_TRITON = K.USE_TRITON, False
    try:
        ref_e = K.moe_experts(x, w, idx, gate_up, down, sh, gate, res)             # the reference path
    finally:
        K.USE_TRITON = use
    assert torch.equal(ref_e, res + (ref + torch.sigmoid(gate) * sh))
    old = K._MOE_CHUNK
    K._MOE_CHUNK = 4                                                               # several launches per call
    try:
        assert rel(fast(K.moe_experts, x, w, idx, gate_up, down), ref) <= tol
        assert rel(fast(K.moe_experts, x, w, idx, gate_up, down, sh, gate, res), ref_e) <= tol
    finally:
        K._MOE_CHUNK = old
    assert rel(fast(K.moe_experts, x, w, idx, gate_up, down, sh, gate, None), ref + torch.sigmoid(gate) * sh) <= tol


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 3, 17])
def test_kernel_moe_experts_then_norm(dtype, N, monkeypatch):
    """The next RMSNorm done by the launch that sums the experts (MOE_SUM_NORM): (rms_norm(out), out) as the
    experts' sum and a separate rms_norm launch give them, decode / verify pairs and the grouped path alike (bit
    for bit on the interpreter and in bf16; fp32 on the H200 within 1e-6: a row's program there reduces its
    squares in another layout than _rms_norm_kernel's 16-row programs at this width)."""
    monkeypatch.setattr(K, "BATCH_INVARIANT", False)
    E, k, H, I = 6, 2, 40, 24
    g = gen(N + 100)
    x, sh, res = (randn(N, H, g=g, dtype=dtype) for _ in range(3))
    gate_up, down = randn(E, 2 * I, H, g=g, dtype=dtype, scale=0.2), randn(E, H, I, g=g, dtype=dtype, scale=0.2)
    gate = randn(N, 3, g=g, dtype=dtype)[:, 1:2]
    w, idx = K.moe_route_ref(randn(N, E, g=g), k)
    nw = randn(H, g=g, dtype=dtype, scale=0.1)
    for args in ((None, None, None), (sh, gate, res)):
        monkeypatch.setattr(K, "MOE_SUM_NORM", False)
        out0 = fast(K.moe_experts, x, w, idx, gate_up, down, *args)
        n0 = fast(K.rms_norm, out0, nw, 1e-6)
        monkeypatch.setattr(K, "MOE_SUM_NORM", True)
        n1, out1 = fast(K.moe_experts, x, w, idx, gate_up, down, *args, then=(nw, 1e-6))
        if dtype == torch.float32 and CUDA:
            assert rel(out1, out0) <= 1e-6 and rel(n1, n0) <= 1e-6
        else:
            assert torch.equal(out1, out0) and torch.equal(n1, n0)
        assert rel(n1, K.rms_norm_ref(out0, nw, 1e-6)) <= TOL[dtype]
        monkeypatch.setattr(K, "USE_TRITON", False)                                # the reference path
        n2, out2 = K.moe_experts(x, w, idx, gate_up, down, *args, then=(nw, 1e-6))
        assert torch.equal(n2, K.rms_norm(out2, nw, 1e-6))


@needs_kernels
@pytest.mark.parametrize("B,V", [(1, 100), (3, 1000)])
def test_kernel_markov_greedy(B, V):
    """DSpark's greedy Markov stage: the fused kernels' drafts == the reference loop's; ties to the first maximum."""
    g = gen(V)
    Kq, R = 4, 24
    U = randn(B, Kq, V, g=g, scale=2)
    w1, w2 = randn(V, R, g=g), randn(V, R, g=g, scale=0.3)
    anchor = torch.randint(0, V, (B,), generator=g, device=DEV)
    e0 = F.embedding(anchor, w1)
    assert torch.equal(fast(K.markov_greedy, U, e0, w1, w2), K.markov_greedy_ref(U, e0, w1, w2))
    U2 = torch.zeros_like(U)
    U2[:, :, 7] = U2[:, :, V - 3] = 50.0                                           # a tie across blocks
    ref = K.markov_greedy_ref(U2, e0, w1, torch.zeros_like(w2))
    assert torch.equal(ref, torch.full_like(ref, 7))
    assert torch.equal(fast(K.markov_greedy, U2, e0, w1, torch.zeros_like(w2)), ref)


@pytest.mark.skipif(CUDA or K.triton is None or KERNELS_RUN, reason="kernel tests ran in this process")
def test_kernels_interpreted_in_a_fresh_process():
    """triton was imported before TRITON_INTERPRET=1 could be set: run the kernel tests again where it is."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-k", "test_kernel_", "-p", "no:cacheprovider",
                        os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.abspath(K.__file__)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


# ==============================================================================================
# Real model shapes and CUDA graphs (GPU only)
# ==============================================================================================

@needs_cuda
@pytest.mark.parametrize("B,T", [(1, 1), (1, 17), (8, 4)])
def test_kernel_gpu_gdn_27b(B, T):
    Hk, Hv, d = 16, 48, 128
    q, k, v, g, beta = gdn_inputs(B, T, Hk, Hv, d, d, torch.bfloat16, seed=T)
    pool = randn(B + 1, Hv, d, d, g=gen(1), scale=0.1)
    slots = torch.arange(B, device=DEV) + 1
    n_keep = torch.randint(0, T + 1, (B,), device=DEV)
    for nk in (None, n_keep):
        p1, p2 = pool.clone(), pool.clone()
        o = fast(K.gdn_recurrent, q, k, v, g, beta, p1, slots, nk)
        assert rel(o, K.gdn_recurrent_ref(q, k, v, g, beta, p2, slots, nk)) <= 1e-2
        assert rel(p1, p2) <= 1e-5 and torch.equal(p1[0], pool[0])
    a, b_ = randn(B, T, Hv, g=gen(5), dtype=torch.bfloat16), randn(B, T, Hv, g=gen(6), dtype=torch.bfloat16)
    A_log, dt_bias = randn(Hv, g=gen(7), dtype=torch.bfloat16), randn(Hv, g=gen(8), dtype=torch.bfloat16)
    p1, p2 = pool.clone(), pool.clone()
    o = fast(K.gdn_recurrent_gated, q, k, v, a, b_, A_log, dt_bias, p1, slots, n_keep)
    o_ref = K.gdn_recurrent_ref(q, k, v, *K.gdn_gates(a, b_, A_log, dt_bias), p2, slots, n_keep)
    assert rel(o, o_ref) <= 1e-2 and rel(p1, p2) <= 1e-2                          # beta rounds to bf16
    conv_x = randn(B, T, 2 * Hk * d + Hv * d, g=gen(2), dtype=torch.bfloat16)
    cw = randn(conv_x.shape[-1], 4, g=gen(3), dtype=torch.bfloat16, scale=0.5)
    cp = randn(B + 1, conv_x.shape[-1], 3, g=gen(4), dtype=torch.bfloat16)
    c1, c2 = cp.clone(), cp.clone()
    y = fast(K.causal_conv, conv_x, c1, slots, cw, n_keep)
    assert rel(y, K.causal_conv_ref(conv_x, c2, slots, cw, n_keep)) <= 1e-2 and torch.equal(c1, c2)


@needs_cuda
@pytest.mark.parametrize("B,T,pos0", [(1, 1, 3000), (2, 17, 5000), (1, 2048, 1000)])
def test_kernel_gpu_attention_27b(B, T, pos0):
    nh, nkv, d, L = 24, 4, 256, 8192
    pos = [pos0 + 37 * b for b in range(B)]
    kc, vc, kp, vp, slots = kv_setup(B, L, nkv, d, pos, T, torch.bfloat16, seed=B)
    q = randn(B, T, nh, d, g=gen(0), dtype=torch.bfloat16)
    pos_t = torch.tensor(pos, device=DEV)
    ref = K.attention_ref(q, kc, vc, slots, pos_t, max(pos) + T)
    assert rel(fast(K.attention, q, kp, vp, slots, pos_t, L), ref) <= 1e-2
    qg, kx = randn(B, T, nh, 2 * d, g=gen(1), dtype=torch.bfloat16), randn(B, T, nkv, d, g=gen(2), dtype=torch.bfloat16)
    w = randn(d, g=gen(3), dtype=torch.bfloat16, scale=0.1)
    inv_freq = 1.0 / 1e7 ** (torch.arange(0, 64, 2, device=DEV).float() / 64)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q1 = fast(K.attention_prep, qg, kx, kx, w, w, 1e-6, inv_freq, k1, v1, slots, pos_t)
    q2 = K.attention_prep_ref(qg, kx, kx, w, w, 1e-6, inv_freq, k2, v2, slots, pos_t)
    assert rel(q1, q2) <= 1e-2 and rel(k1, k2) <= 1e-2 and torch.equal(v1, v2)


@needs_cuda
@pytest.mark.parametrize("N", [1, 17, 136])
def test_kernel_gpu_moe_35b(N):
    E, k, H, I = 256, 8, 2048, 512
    g = gen(N)
    x = randn(N, H, g=g, dtype=torch.bfloat16)
    gate_up = randn(E, 2 * I, H, g=g, dtype=torch.bfloat16, scale=0.02)
    down = randn(E, H, I, g=g, dtype=torch.bfloat16, scale=0.02)
    logits = randn(N, E, g=g, dtype=torch.bfloat16)
    w, idx = fast(K.moe_route, logits, k)
    w_ref, idx_ref = K.moe_route_ref(logits, k)
    assert torch.equal(logits.gather(1, idx), logits.gather(1, idx_ref)) and rel(w, w_ref) <= 1e-6
    assert rel(fast(K.moe_experts, x, w, idx, gate_up, down), K.moe_experts_ref(x, w, idx, gate_up, down)) <= 2e-2


@needs_cuda
def test_kernel_gpu_cuda_graph_capture():
    """Every decode-step kernel captures into one CUDA graph (no host syncs, no dynamic sizes) and
    the replay, after the inputs change in place, matches eager."""
    B, T = 2, 5
    q, k, v, g, beta = gdn_inputs(B, T, 16, 48, 128, 128, torch.bfloat16, seed=0)
    pool = randn(B + 1, 48, 128, 128, g=gen(1), scale=0.1)
    slots, n_keep = torch.tensor([2, 0], device=DEV), torch.tensor([3, 0], device=DEV)
    kc, vc, _, _, _ = kv_setup(B, 4096, 4, 256, [100, 900], T, torch.bfloat16, seed=2, S=3)
    qa = randn(B, T, 24, 256, g=gen(3), dtype=torch.bfloat16)
    pos = torch.tensor([100, 900], device=DEV)
    x = randn(B * T, 2048, g=gen(4), dtype=torch.bfloat16)
    gate_up = randn(256, 1024, 2048, g=gen(5), dtype=torch.bfloat16, scale=0.02)
    down = randn(256, 2048, 512, g=gen(6), dtype=torch.bfloat16, scale=0.02)
    logits = randn(B * T, 256, g=gen(7), dtype=torch.bfloat16)
    nw = randn(2048, g=gen(8), dtype=torch.bfloat16, scale=0.1)

    def step(p):
        o1 = K.gdn_recurrent(q, k, v, g, beta, p, slots, n_keep)
        o2 = K.attention(qa, kc, vc, slots, pos, 4096)
        w, idx = K.moe_route(logits, 8)
        o3 = K.moe_experts(K.rms_norm(x, nw, 1e-6), w, idx, gate_up, down)
        return o1, o2, o3

    assert K.USE_TRITON
    p_graph = pool.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(pool.clone())                                                         # compile before capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(p_graph)
    for t in (q, qa, x, logits):
        t.copy_(torch.randn_like(t))
    pos.copy_(torch.tensor([2000, 300], device=DEV))
    p_graph.copy_(pool)
    graph.replay()
    p_eager = pool.clone()
    for o, e in zip(outs, step(p_eager)):
        assert torch.equal(o, e)
    assert torch.equal(p_graph, p_eager)


# ==============================================================================================
# Model drafters: dflash, dspark, draft_model (tiny drafter checkpoints in each published layout)
# ==============================================================================================

TARGET_LAYERS = 4  # write_tiny_checkpoint: 3 GDN layers + 1 full attention, hidden 64


# ==============================================================================================
# Tiny drafter checkpoints in the published layouts
# ==============================================================================================

def target_tensors(target):
    from safetensors.torch import load_file
    w = load_file(os.path.join(target, "model.safetensors"))
    emb = w["model.language_model.embed_tokens.weight"]
    return emb, w.get("lm_head.weight", emb)


def qwen3_config(vocab, layers=2, types=None, **kw):
    cfg = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": layers,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
           "vocab_size": vocab, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000,
           "max_position_embeddings": 4096, "attention_bias": False, "tie_word_embeddings": False,
           "layer_types": types or ["full_attention"] * layers, "sliding_window": None, "use_sliding_window": False}
    return {**cfg, **kw}


def qwen3_layers(cfg, g, prefix="", copy=False):
    """Random Qwen3 decoder layers (plain norms: weights around 1). copy: layers that carry what attention reads
    through - value and output projections near the identity (n_kv * head_dim must be the hidden size), MLP output
    scaled by PREDICTABLE_MIX - for the block drafters of a make_predictable target (predictive_backbone)."""
    H, nh, nkv, hd, I = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                          "intermediate_size"))
    r = lambda *s: torch.randn(*s, generator=g) * 0.1
    one = lambda n: 1 + torch.randn(n, generator=g) * 0.1
    w = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        w.update(bench.random_qwen3_layer(p, H, nh, nkv, hd, I, r, one))
        if copy:
            assert nkv * hd == H == nh * hd
            w[p + "self_attn.v_proj.weight"] = torch.eye(H) + r(H, H) * 0.1
            w[p + "self_attn.o_proj.weight"] = torch.eye(H) + r(H, H) * 0.1
            w[p + "mlp.down_proj.weight"] = w[p + "mlp.down_proj.weight"] * PREDICTABLE_MIX
    return w


def save(path, cfg, w):
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    return path


def backbone(cfg, n_taps, seed, fc_in=None):
    g = torch.Generator().manual_seed(seed)
    H = cfg["hidden_size"]
    return {"fc.weight": torch.randn(H, fc_in or n_taps * H, generator=g) * 0.1,
            "hidden_norm.weight": 1 + torch.randn(H, generator=g) * 0.1,
            "norm.weight": 1 + torch.randn(H, generator=g) * 0.1, **qwen3_layers(cfg, g)}


def predictive_backbone(cfg, n_taps, seed, target, out_scale=1.0, fc_in=None):
    """A block drafter for a make_predictable target that predicts the token after the anchor: the mask slots' input
    is zero (the target's mask embedding), so their queries are zero and their attention output is what the anchor
    (and, faintly, the context: hidden_norm ~0.01) holds, carried through by copy layers; the final norm is the
    target's, times out_scale. Every mask slot then predicts what the target predicts after the anchor alone (the
    bigram), and DFlash's first draft is accepted as often as the target follows its bigram."""
    from safetensors.torch import load_file
    w = backbone(cfg, n_taps, seed, fc_in)
    g = torch.Generator().manual_seed(seed + 1)
    w.update(qwen3_layers(cfg, g, copy=True))
    w["hidden_norm.weight"] = w["hidden_norm.weight"] * 0.01
    tnorm = load_file(os.path.join(target, "model.safetensors"))["model.language_model.norm.weight"]
    w["norm.weight"] = (1 + tnorm) * out_scale
    return w


def write_dflash(path, target, ids=(0, 2), block=4, seed=0, reduced=False, fc_in=None):
    """z-lab layout: model_type qwen3, DFlashDraftModel, dflash_config; a sliding (causal) + a full layer. The
    weights: predictive_backbone (for the target of the `ckpts` fixture, a make_predictable one)."""
    emb, head = target_tensors(target)
    V = emb.shape[0]
    cfg = qwen3_config(V, types=["sliding_attention", "full_attention"], sliding_window=6, architectures=[
        "DFlashDraftModel"], auto_map={"AutoModel": "dflash.DFlashDraftModel"}, block_size=block,
        num_target_layers=TARGET_LAYERS, dflash_config={"mask_token_id": V - 1, "target_layer_ids": list(ids)},
        num_key_value_heads=4)
    w = predictive_backbone(cfg, len(ids), seed, target, fc_in=fc_in)
    if reduced:  # a reduced draft vocab: its own lm_head rows and d2t offsets (target id = id + d2t[id])
        keep = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:V // 2]).values
        cfg["draft_vocab_size"] = len(keep)
        w["lm_head.weight"], w["d2t"], w["t2d"] = head[keep], keep - torch.arange(len(keep)), torch.zeros(V, dtype=torch.bool)
    return save(path, cfg, w)


def dspark_parts(target, ids, block, rank, seed):
    """DSpark for a make_predictable target: predictive_backbone with its base logits scaled down (out_scale 0.05),
    and a Markov head of rank = hidden size that is the target's bigram: W1[prev] = bigram_hidden (what the target's
    final norm makes of prev's embedding), W2 = the lm_head. Each draft is then the bigram's pick after the previous
    one (the anchor first): the chain an MTP head wired to the bigram drafts too."""
    from safetensors.torch import load_file
    emb, head = target_tensors(target)
    V = emb.shape[0]
    layer_cfg = qwen3_config(V, num_key_value_heads=4)
    w = predictive_backbone(layer_cfg, len(ids), seed, target, out_scale=0.05)
    tw = load_file(os.path.join(target, "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 1)
    bigram = bigram_hidden({"model.embed_tokens.weight": emb,
                            "model.norm.weight": tw["model.language_model.norm.weight"]})
    assert rank == bigram.shape[1]
    w.update({"markov_head.markov_w1.weight": bigram.clone(), "markov_head.markov_w2.weight": head.clone(),
              "confidence_head.proj.weight": torch.randn(1, 64 + rank, generator=g) * 0.1,
              "confidence_head.proj.bias": torch.zeros(1)})
    fields = {"block_size": block, "mask_token_id": V - 1, "markov_rank": rank, "markov_head_type": "vanilla",
              "enable_confidence_head": True, "confidence_head_with_markov": True, "num_anchors": 512}
    return layer_cfg, w, fields, emb, head


def write_dspark_native(path, target, ids=(-1, 1, 3), block=4, rank=64, seed=0):
    """DeepSpec layout: a Qwen3 config copy + top-level DSpark fields; full draft state dict (embed, lm_head)."""
    layer_cfg, w, fields, emb, head = dspark_parts(target, ids, block, rank, seed)
    cfg = {**layer_cfg, **fields, "architectures": ["Qwen3DSparkModel"], "num_target_layers": TARGET_LAYERS,
           "target_layer_ids": list(ids)}
    return save(path, cfg, {**w, "embed_tokens.weight": emb.clone(), "lm_head.weight": head.clone()})


def write_dspark_speculators(path, target, ids=(-1, 1, 3), block=4, rank=64, seed=0):
    """speculators layout: nested transformer_layer_config, aux ids in vLLM's semantics (= ours + 1)."""
    layer_cfg, w, fields, emb, head = dspark_parts(target, ids, block, rank, seed)
    cfg = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
           "transformer_layer_config": layer_cfg, "draft_vocab_size": emb.shape[0], "target_hidden_size": None,
           "aux_hidden_state_layer_ids": [i + 1 for i in ids], "sample_from_anchor": True,
           "sliding_window_non_causal": False, **fields,
           "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block}],
                                  "verifier": {"name_or_path": target, "architectures": ["Qwen3_5ForCausalLM"]}}}
    return save(path, cfg, {**w, "verifier_norm.weight": torch.ones(64)})  # a training-only tensor, skipped


def write_qwen3_lm(path, vocab, seed=0, tie=True, like=None):
    """A plain Qwen3 causal LM in the HF layout (model.*, lm_head). like: a make_predictable target whose embedding,
    lm_head and final norm it takes, its layers' output projections scaled by PREDICTABLE_MIX: it drafts the
    target's bigram (plus its own small context term)."""
    cfg = qwen3_config(vocab, tie_word_embeddings=tie and like is None)
    g = torch.Generator().manual_seed(seed)
    w = {"model.embed_tokens.weight": torch.randn(vocab, 64, generator=g) * 0.5,
         "model.norm.weight": 1 + torch.randn(64, generator=g) * 0.1, **qwen3_layers(cfg, g, "model.")}
    if not tie or like is not None:
        w["lm_head.weight"] = torch.randn(vocab, 64, generator=g) * 0.3
    if like is not None:
        t = like_target(like)
        w.update({"model.embed_tokens.weight": t["model.language_model.embed_tokens.weight"],
                  "lm_head.weight": t["lm_head.weight"],
                  "model.norm.weight": 1 + t["model.language_model.norm.weight"]})
        for n in w:
            if n.endswith(("o_proj.weight", "down_proj.weight")):
                w[n] = w[n] * PREDICTABLE_MIX
    return save(path, cfg, w)


def like_target(target):
    """The tensors a draft shares with a make_predictable target so that it drafts the same bigram: embedding,
    lm_head, final norm (wrapper names)."""
    from safetensors.torch import load_file
    w = load_file(os.path.join(target, "model.safetensors"))
    return {n: w[n].clone() for n in ("model.language_model.embed_tokens.weight", "lm_head.weight",
                                      "model.language_model.norm.weight")}


# ==============================================================================================
# Fixtures: the target, the drafters, spec-off references, one LLM per drafter config
# ==============================================================================================

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A make_predictable target and drafters built to predict it (predictive_backbone, dspark_parts, like_target):
    every method gets drafts accepted, so lossless checks and the drafters' own cache commits see accepted runs."""
    d = tmp_path_factory.mktemp("drafters")
    t = write_tiny_checkpoint(str(d / "target"), predictable=True)
    return {"target": t, "dflash": write_dflash(str(d / "dflash"), t),
            "dflash_small_vocab": write_dflash(str(d / "dflash_v"), t, reduced=True, seed=3),
            "dspark": write_dspark_native(str(d / "dspark"), t),
            "dspark_spec": write_dspark_speculators(str(d / "dspark_spec"), t),
            "hybrid_draft": write_tiny_checkpoint(str(d / "hybrid_draft"), mtp=False, seed=5, predictable=True,
                                                  extra=like_target(t)),
            "qwen3_draft": write_qwen3_lm(str(d / "qwen3_draft"), 1024, like=t)}


CONFIGS = {  # name -> (checkpoint key, speculative config); the first of each method also runs the mixed batch
    "dflash": ("dflash", {"method": "dflash", "num_speculative_tokens": 3}),
    "dspark": ("dspark", {"method": "dspark", "num_speculative_tokens": 4}),
    "draft_hybrid": ("hybrid_draft", {"method": "draft_model", "num_speculative_tokens": 2}),
    "dspark_spec": ("dspark_spec", {"method": "dspark", "num_speculative_tokens": 4}),
    "draft_self": ("target", {"method": "draft_model", "num_speculative_tokens": 3}),  # the target as its own draft
    "draft_qwen3": ("qwen3_draft", {"method": "draft_model", "num_speculative_tokens": 3}),
}
MIXED = ("dflash", "dspark", "draft_hybrid", "draft_qwen3")
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def make_llm(ckpts, name, **extra):
    key, cfg = CONFIGS[name]
    return LLM(model=ckpts["target"], device="cpu", speculative_config={**cfg, "model": ckpts[key], **extra})


@pytest.fixture(scope="module")
def reference(ckpts):
    llm = LLM(model=ckpts["target"], device="cpu")
    return [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def runs(ckpts):
    """name -> (llm, batch-1 output, batch-5 outputs or None, batch-1 metrics), run lazily once."""
    cache = {}

    def get(name):
        if name not in cache:
            llm = make_llm(ckpts, name)
            one = llm.generate(SPEC_PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
            before = sd.SpecStats(**vars(llm.engine.stats))
            before.accepted_per_pos = list(before.accepted_per_pos)
            five = [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, GREEDY)] if name in MIXED else None
            cache[name] = llm, one, five, before
        return cache[name]
    return get


# ==============================================================================================
# Lossless greedy speculation, acceptance sanity, layouts
# ==============================================================================================

@pytest.mark.parametrize("name", list(CONFIGS))
def test_drafters_greedy_spec_equals_plain(name, runs, reference):
    llm, one, five, _ = runs(name)
    assert one == reference[0]                                  # batch 1
    assert five in (None, reference)                            # a mixed batch of 5 prompts of different lengths
    s, k = llm.engine.stats, CONFIGS[name][1]["num_speculative_tokens"]
    # measured (batch 1 + batch 5 where run): dflash 1.80, dspark 4.32, draft_hybrid 2.30, draft_qwen3 3.22
    if name == "draft_self":  # the target as its own draft: every draft is accepted (tests the draft's rollback)
        assert s.num_drafts > 0 and s.num_accepted_tokens == s.num_draft_tokens
    elif name == "dflash":  # its mask slots all draft the bigram after the anchor (predictive_backbone): d1 only
        assert s.mean_acceptance_length >= 1.5 and s.accepted_per_pos[0] > 0
    else:
        assert_multi_token(s, k, 1 + 0.5 * k)


ASYNC_CONFIGS = [None, {"method": "mtp", "num_speculative_tokens": 3}, "dflash", "dspark", "draft_hybrid"]


def async_case(ckpts, cfg, variants):
    """Run one scenario under each variant (LLM kwargs) and return the outputs: more prompts than slots (slots are
    reused while a step is in flight), requests that stop at different steps (max_tokens, stop strings, stop ids),
    seeded sampling, an abort in flight."""
    spec = {**CONFIGS[cfg][1], "model": ckpts[CONFIGS[cfg][0]]} if isinstance(cfg, str) else cfg
    g = torch.Generator().manual_seed(1)
    prompts = [SPEC_PROMPTS[i % 5] + " x" * i for i in range(7)]
    ref_llm = LLM(model=ckpts["target"], max_num_seqs=3, speculative_config=spec, **variants[0])
    full = [o.outputs[0] for o in ref_llm.generate(prompts[1:3], SamplingParams(temperature=0, max_tokens=30,
                                                                                 ignore_eos=True))]
    params = [SamplingParams(temperature=0, max_tokens=int(torch.randint(1, 30, (), generator=g)), ignore_eos=True)
              for _ in prompts]
    params[1] = SamplingParams(temperature=0, max_tokens=30, stop=[full[0].text[10:13]], ignore_eos=True)
    params[2] = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[full[1].token_ids[9]])
    params[3] = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=25, seed=7, ignore_eos=True)
    params[4] = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)  # the victim: aborted before its end
    params[5] = SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True)  # steps with it: synchronous
    outs = []
    for kw in variants:
        llm = LLM(model=ckpts["target"], max_num_seqs=3, speculative_config=spec, **kw)
        e = llm.engine
        reqs = [e.add_request(llm.tokenizer.encode(p), sp) for p, sp in zip(prompts, params)]
        victim, in_flight = reqs[4], 0
        while e.has_work():
            e.step()
            in_flight += e.pending is not None
            if victim.slot is not None and len(victim.output_ids) >= 2 and not victim.finished:
                e.abort(victim)  # its slot is reused while a step holding it is still in flight
        outs.append([(r.output_ids, r.text, r.finish_reason, r.stop_reason, r.logprobs) for r in reqs])
        assert (in_flight > 0) == e.runner.async_steps
        assert spec is None or e.stats.mean_acceptance_length >= 1.5, e.stats   # multi-token steps (ckpts' drafters)
    assert outs[0][4][2] == "abort" and outs[0][1][2] == "stop" and outs[0][2][2] == "stop"
    return outs


@pytest.mark.parametrize("cfg", ASYNC_CONFIGS, ids=lambda c: c if isinstance(c, str) else (c or {}).get("method", "off"))
def test_async_steps_equal_synchronous(cfg, ckpts):
    """Asynchronous scheduling (step n+1 launched before step n is read back; the default with CUDA graphs, forced
    here on the CPU) gives exactly the synchronous outputs. The extra step a stop leaves in flight is dropped."""
    sync, asyn = async_case(ckpts, cfg, [dict(device="cpu", async_scheduling=False),
                                         dict(device="cpu", async_scheduling=True)])
    assert asyn == sync


@cuda
@pytest.mark.parametrize("cfg", ASYNC_CONFIGS, ids=lambda c: c if isinstance(c, str) else (c or {}).get("method", "off"))
def test_gpu_async_graphs_equal_eager(cfg, ckpts):
    """On the GPU: captured graphs with asynchronous steps (the default) == eager synchronous steps, fp32."""
    eager, graphs = async_case(ckpts, cfg, [dict(device="cuda", dtype="float32", enforce_eager=True),
                                            dict(device="cuda", dtype="float32")])
    assert [r[:4] for r in graphs] == [r[:4] for r in eager]
    for a, b in zip(graphs[5][4], eager[5][4]):  # logprobs: same tokens, values to fp32 kernel noise
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) <= 1e-4 for t in a)


class CaptureRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Stands in for CUDA-graph capture on the CPU: records the storages that ops inside any capture read but that
    were allocated outside every capture. A real graph keeps only raw pointers to those, so each must outlive the
    capture, or every replay reads freed (and soon reused) memory - what broke every speculative method on the H200
    in 0d2d4b3 (a verify's n_keep zeros made by the Ctx, which died after the capture)."""
    def __init__(self):
        super().__init__()
        self.pool, self.outside, self.dead = {}, {}, []  # storage id -> weak ref (made in a capture: the graph
        # pool) or (weak ref, what read it) (made outside); ids of freed storages can be reused, hence the refs

    @staticmethod
    def storage(t):
        """(id, weak ref) of what holds t's data: its storage; for an opaque tensor, which has none (oneDNN's
        packed weights of the CPU linears, kernels._packed), the tensor itself."""
        if t.is_mkldnn:
            ref = weakref.ref(t)
            return ("opaque", id(t)), types.SimpleNamespace(expired=lambda: ref() is None)
        from torch.multiprocessing.reductions import StorageWeakRef
        return t.untyped_storage()._cdata, StorageWeakRef(t.untyped_storage())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if not isinstance(t, torch.Tensor):
                continue
            sid, ref = self.storage(t)
            if sid in self.pool and not self.pool[sid].expired():
                continue
            if sid in self.outside and not self.outside[sid][0].expired():
                continue
            if sid in self.outside:  # freed, and its id now names another storage
                self.dead.append(self.outside[sid][1])
            what = f"{func} reads {str(t.dtype)[6:]}{list(t.shape)}"
            self.outside[sid] = (ref, what)
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                sid, ref = self.storage(t)
                if not (sid in self.outside and not self.outside[sid][0].expired()):
                    self.pool[sid] = ref
        return out

    def freed(self):
        import gc
        gc.collect()
        return sorted(set(self.dead) | {what for ref, what in self.outside.values() if ref.expired()})


@pytest.mark.parametrize("cfg", ASYNC_CONFIGS + ["draft_qwen3"],
                         ids=lambda c: c if isinstance(c, str) else (c or {}).get("method", "off"))
def test_graph_inputs_outlive_capture(cfg, ckpts, monkeypatch):
    """Every tensor a captured graph reads (target decode / verify / commit, every drafter graph) is owned by
    something that lives as long as the graph. Runs the engine's capture paths on the CPU with torch.cuda's graph
    API replaced by CaptureRecorder (replays do nothing: only the captures are checked, not the outputs)."""
    rec = CaptureRecorder()

    class FakeGraph:
        def replay(self):
            pass

    import contextlib

    @contextlib.contextmanager
    def capture(graph, pool=None):
        with rec:
            yield
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    spec = {**CONFIGS[cfg][1], "model": ckpts[CONFIGS[cfg][0]]} if isinstance(cfg, str) else cfg
    llm = LLM(model=ckpts["target"], device="cpu", max_num_seqs=2, speculative_config=spec)
    runner = llm.engine.runner
    runner.graphs = sd.GraphRunner(runner.state)
    llm.generate(SPEC_PROMPTS[:3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    llm.generate(SPEC_PROMPTS[:2], SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=0))
    names = {key[0] for key in runner.graphs.graphs}
    # decode; with speculation, greedy steps captured whole and the sampled one by pieces (verify, drafter)
    assert names == {"decode"} if cfg is None else ({"spec-step", "verify"} <= names and len(names) >= 3)
    assert rec.outside, "nothing was recorded"
    assert rec.freed() == [], "captured graphs read tensors freed after their capture"


class EagerGraphs(sd.GraphRunner):
    """GraphRunner for the CPU whose 'graphs' re-run their function on the static inputs at each replay and copy the
    results into the outputs the capture made: the engine's graph paths (buckets, padding rows on the dummy slot,
    static inputs and outputs, a step captured whole) run for real without CUDA."""
    def __init__(self, state):
        with unittest.mock.patch.object(torch.cuda, "graph_pool_handle", lambda: None):  # no CUDA here
            super().__init__(state)

    def capture(self, key, Bp, fn, inputs, then=None):
        g = types.SimpleNamespace(then=None, n_keep=torch.zeros(Bp, dtype=torch.long))
        g.static = {n: torch.full((Bp, *t.shape[1:]), self.pad(n), dtype=t.dtype) for n, t in inputs.items()}
        g.out = fn(self.kv_len, **g.static)                      # the 'capture': on the padding inputs

        def replay():
            for o, new in zip(g.out, fn(self.kv_len, **g.static)):
                if o is not None:
                    o.copy_(new)
        g.graph = types.SimpleNamespace(replay=replay)
        if then is not None:
            then(n_keep=g.n_keep, **g.static)
            g.then = types.SimpleNamespace(replay=lambda: then(n_keep=g.n_keep, **g.static))
        self.graphs[key] = g
        return g


@pytest.mark.parametrize("cfg", [{"method": "mtp", "num_speculative_tokens": 3},
                                 {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                                 "dflash", "dspark", "draft_hybrid", "draft_qwen3"],
                         ids=lambda c: c if isinstance(c, str) else c["method"])
def test_one_graph_steps_equal_plain(cfg, ckpts, reference):
    """Greedy speculative steps as one graph each (ModelRunner._one_graph: _whole_step with every piece inside,
    padding rows on the dummy slot at position 0), run through EagerGraphs: the same tokens as speculation off, alone
    and in a batch of 5 (bucket 8: 3 padding rows), with multi-token acceptance; a sampled request beside them takes
    the step by pieces (its uniforms come from the host)."""
    spec = {**CONFIGS[cfg][1], "model": ckpts[CONFIGS[cfg][0]]} if isinstance(cfg, str) else cfg
    llm = LLM(model=ckpts["target"], device="cpu", speculative_config=spec)
    runner = llm.engine.runner
    runner.graphs = EagerGraphs(runner.state)
    assert [llm.generate(SPEC_PROMPTS[:1], GREEDY)[0].outputs[0].token_ids] == reference[:1]
    assert [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, GREEDY)] == reference
    names = {key[:2] for key in runner.graphs.graphs}
    assert {n for n, _ in names} == {"spec-step"} and {("spec-step", 1), ("spec-step", 8)} <= names  # no pieces
    k, s = spec["num_speculative_tokens"], llm.engine.stats
    if cfg == "dflash":  # its mask slots all draft the bigram after the anchor: d1 only (as in the test above)
        assert s.mean_acceptance_length >= 1.5 and s.accepted_per_pos[0] > 0
    else:
        assert_multi_token(s, k, 1 + 0.5 * k)
    out = llm.generate(SPEC_PROMPTS[:2], [GREEDY, SamplingParams(temperature=0.8, max_tokens=8, seed=1)])
    assert out[0].outputs[0].token_ids == reference[0]
    assert ("verify", 2) in {key[:2] for key in runner.graphs.graphs}             # by pieces: the sampled row


def test_warmup_leaves_no_trace(tiny_spec):
    """LLM.warmup (the server calls it at start-up to capture every graph) runs dummy requests through every batch
    bucket, then resets the counters: what follows is as if it had not run - the same tokens, and the same drafts
    accepted (a draft state the warm-up left behind would change them)."""
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fresh = LLM(model=tiny_spec, device="cpu", max_num_seqs=3, speculative_config=spec)
    ref = fresh.generate(SPEC_PROMPTS[:2], sp)
    llm = LLM(model=tiny_spec, device="cpu", max_num_seqs=3, speculative_config=spec)
    llm.warmup(force=True)
    assert llm.engine.stats.num_drafts == 0 and not llm.engine.has_work()
    out = llm.generate(SPEC_PROMPTS[:2], sp)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert [o.request_id for o in out] == [o.request_id for o in ref]
    assert vars(llm.engine.stats) == vars(fresh.engine.stats) and fresh.engine.stats.num_accepted_tokens > 0
    short = LLM(model=tiny_spec, device="cpu", max_model_len=8, speculative_config=spec)
    short.warmup(force=True)  # its dummy prompts fit a short max_model_len (a server started with one)
    assert not short.engine.has_work() and short.engine.num_requests == 0


def check_warmup_captures_every_bucket(cfg, ckpts, device):
    spec = {**CONFIGS[cfg][1], "model": ckpts[CONFIGS[cfg][0]]} if isinstance(cfg, str) else cfg
    llm = LLM(model=ckpts["target"], device=device, dtype="float32", max_num_seqs=5, speculative_config=spec)
    runner = llm.engine.runner
    if device == "cpu":
        runner.graphs = EagerGraphs(runner.state)
        runner.proposer.accepted_only = False  # MTP's commit on a CPU takes the accepted rows: shapes CUDA never runs
    llm.warmup()
    keys = set(runner.graphs.graphs)
    assert runner.graphs.buckets == [1, 2, 4, 5]
    assert {(n, b) for n in ("spec-step", "verify") for b in (1, 2, 4, 5)} <= {key[:2] for key in keys}
    assert llm.engine.stats.num_drafts == 0 and llm.engine.num_requests == 0
    for temperature in (0, 0.8):
        llm.generate(SPEC_PROMPTS[:5], [SamplingParams(temperature=temperature, max_tokens=3 + 4 * i, seed=i,
                                                       ignore_eos=True) for i in range(5)])
        assert set(runner.graphs.graphs) == keys
    assert llm.engine.stats.num_drafts > 0


WARMUP_CONFIGS = [{"method": "mtp", "num_speculative_tokens": 2}, "draft_qwen3"]


@pytest.mark.parametrize("cfg", WARMUP_CONFIGS, ids=lambda c: c if isinstance(c, str) else c["method"])
def test_warmup_captures_every_bucket(cfg, ckpts):
    """Engine.warmup captures every graph a later run takes, at every batch bucket and for both kinds of step
    (greedy: the step whole; sampled: by pieces), so that no request in flight waits for a capture (bench.py's
    '# stall' found captures of 160-290 ms inside timed 27B runs). Through EagerGraphs on the CPU: after the
    warm-up, batches that shrink as their requests stop at different lengths, greedy and sampled, capture
    nothing new."""
    check_warmup_captures_every_bucket(cfg, ckpts, "cpu")


@cuda
@pytest.mark.parametrize("cfg", WARMUP_CONFIGS, ids=lambda c: c if isinstance(c, str) else c["method"])
def test_gpu_warmup_captures_every_bucket(cfg, ckpts):
    """The same with the real CUDA graphs (and asynchronous steps)."""
    check_warmup_captures_every_bucket(cfg, ckpts, "cuda")


def test_dspark_layouts_load_to_the_same_drafter(runs):
    native, _, _, m_native = runs("dspark")
    spec, _, _, m_spec = runs("dspark_spec")
    a, b = native.engine.runner.proposer, spec.engine.runner.proposer
    assert a.taps == b.taps == (-1, 1, 3) and a.order == b.order and (a.Q, a.out) == (b.Q, b.out) == (4, slice(0, 4))
    pa, pb = dict(a.net.named_parameters()), dict(b.net.named_parameters())
    assert set(pa) - set(pb) == {"embed_tokens.weight", "lm_head.weight"}  # native ships copies of the target's
    assert all(torch.equal(pa[n], pb[n]) for n in pb)
    assert torch.equal(pa["embed_tokens.weight"], native.model.embed_tokens.weight)
    assert vars(m_native) == vars(m_spec)                       # same drafts, hence the same acceptance


def test_bench_speculators_dspark_drafter(tmp_path):
    """bench.py --drafter-layout speculators on the tiny preset: the drafter it writes (speculators DSpark: nested
    layer config, vLLM's aux ids, block 8, a reduced draft vocabulary with d2t, t2d, Markov and confidence heads)
    loads through specdec's loader as DSpark, and greedy speculation with it equals speculation off. To get drafts
    accepted, the target is made cyclic (bench.make_cyclic) and the Markov head rewritten to that cycle:
    W2[d] = W1[the id before d], so the bias picks the previous token's successor when the draft vocabulary (half
    the ids) has it (measured: 36 of 344 draft tokens accepted, by position 21 9 5 1 0 0 0 0)."""
    from safetensors.torch import load_file, save_file
    cpu = torch.device("cpu")
    with pytest.raises(sd.ConfigError, match="DSpark drafters only"):
        bench.random_drafter(str(tmp_path / "x"), "dflash", "tiny", layout="speculators")
    # seed 1: with seed 0 the draft vocabulary would be the cyclic model's first 8 cycles exactly (both draw
    # randperm(V) from seed 0) and every draft would be accepted
    path = bench.random_drafter(str(tmp_path / "dspark"), "dspark", "tiny", layout="speculators", seed=1)
    with open(os.path.join(path, "config.json")) as fh:
        top = json.load(fh)
    assert top["speculators_model_type"] == "dspark" and top["aux_hidden_state_layer_ids"] == [1, 3, 4]
    model, _ = bench.random_model("tiny", torch.float32, cpu)
    cyc = bench.make_cyclic(model)
    V = model.cfg.vocab_size
    before = torch.empty(V, dtype=torch.long)
    before[cyc.flatten()] = cyc.roll(1, 1).flatten()                        # the id before each in its cycle
    f = os.path.join(path, "model.safetensors")
    w = load_file(f)
    keep = torch.arange(len(w["d2t"])) + w["d2t"]                           # draft id -> target id
    w1 = torch.randn(V, 256, generator=torch.Generator().manual_seed(0)) * 0.25
    w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"] = w1.bfloat16(), w1[before[keep]].bfloat16()
    save_file(w, f)

    def generate(spec):
        eng = sd.Engine(model, None, spec, 2, 96, torch.float32, cpu, enforce_eager=True, enable_chunked_prefill=False)
        sp = sd.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        reqs = [eng.add_request(cyc[i].roll(3 * i).repeat(2)[:24 + i].tolist(), sp) for i in range(2)]  # cyclic text
        while eng.has_work():
            eng.step()
        return eng, [r.output_ids for r in reqs]
    off = generate(None)[1]
    eng, out = generate(sd.SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 8,
                                                        "model": path}))
    prop = eng.runner.proposer
    c = prop.cfg
    assert (c.block_size, c.target_layer_ids, c.from_anchor, c.markov_rank) == (8, [0, 2, 3], True, 256)
    assert c.draft_vocab_size == prop.net.draft_vocab_size == 512 and prop.net.lm_head.weight.shape == (512, 64)
    assert torch.equal(prop.net.d2t + torch.arange(512), keep)                          # offsets, loaded as written
    assert prop.net.confidence_head is not None and prop.net.embed_tokens is None    # the target's embeddings
    assert "t2d" not in dict(prop.net.named_parameters())                               # training-only: skipped
    assert out == off
    s = eng.stats
    assert s.num_accepted_tokens > 0 and s.accepted_per_pos[1] > 0, vars(s)   # the d2t path committed drafts


def test_bench_drafter_layout_speculators_cli(tmp_path, capsys):
    """bench.py --random-drafter --drafter-layout speculators --drafter-shape: the drafter written with the overrides
    (aux ids as given: vLLM's), run as the dspark config's model, the layout in the result JSON."""
    argv = ["--random-weights", "tiny", "--device", "cpu", "--dtype", "float32", "--prompt-len", "16", "--gen-len",
            "8", "--random-drafter", str(tmp_path), "--drafter-layout", "speculators", "--drafter-shape", "layers=2",
            "aux_ids=2,4", "--speculative-config", '{"method":"dspark","num_speculative_tokens":8}']
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1])
    assert res["drafter_layout"] == "speculators" and "NOT a published layout" in out
    (row,) = res["rows"]
    path = row["spec"]["model"]
    assert row["method"] == "dspark" and path == str(tmp_path / "dsparkspeculators")
    c = sd.read_block_config(path, "dspark")
    assert (c.num_hidden_layers, c.target_layer_ids, c.block_size) == (2, [1, 3], 8)
    assert bench.main(argv[:-2] + ["--drafter-shape", "width=3"] + argv[-2:]) == 2      # one error line
    assert "unknown keys" in capsys.readouterr().err
    with pytest.raises(SystemExit):                                              # one error line, no traceback
        bench.main(argv[:-2] + ["--drafter-shape", "layers=two"] + argv[-2:])
    assert "--drafter-shape wants KEY=INTEGER" in capsys.readouterr().err


def llm_stats(d):
    return sd.SpecStats(**d)


def test_reduced_vocab_dflash_and_dspark_topk(ckpts, reference):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = reference[0][:24]
    llm = LLM(model=ckpts["target"], device="cpu", speculative_config={
        "method": "dflash", "model": ckpts["dflash_small_vocab"], "num_speculative_tokens": 3})
    assert llm.engine.runner.proposer.net.d2t is not None
    assert llm.generate(SPEC_PROMPTS[:1], sp)[0].outputs[0].token_ids == ref
    s = llm.engine.stats  # d1 right when the bigram's pick is in the draft vocab (measured 1.53 a step)
    assert s.mean_acceptance_length >= 1.3 and s.accepted_per_pos[0] > 0
    # top-k = the whole vocab changes nothing; a small top-k still verifies losslessly
    metrics = []
    for topk in (None, 1024, 3):
        llm = make_llm(ckpts, "dspark", dspark_draft_topk=topk)
        assert llm.generate(SPEC_PROMPTS[:1], sp)[0].outputs[0].token_ids == ref
        metrics.append(vars(llm.engine.stats))
    assert metrics[0] == metrics[1]
    assert_multi_token(llm_stats(metrics[0]), 4, 3.0)                            # measured 3.86
    # top-3 of the base logits (each slot: the bigram after the anchor) holds d1's pick only: measured 2.0
    assert llm_stats(metrics[2]).mean_acceptance_length >= 1.5


def pooled_fit(counts, expected, min_expected=5):
    """Pearson chi-square p-value of counts [V] against expected counts [V] (a sum of the laws the draws came from),
    cells expecting fewer than min_expected pooled into one; a count where nothing was expected gives p = 0."""
    counts, expected = counts.double(), expected.double()
    if counts[expected <= 0].sum() > 0:
        return 0.0
    big = expected >= min_expected
    c = torch.cat([counts[big], counts[~big].sum()[None]])
    x = torch.cat([expected[big], expected[~big].sum()[None]])
    c, x = c[x > 0], x[x > 0]
    return 1.0 if len(c) < 2 else chi2_sf(float(((c - x) ** 2 / x).sum()), len(c) - 1)


@pytest.mark.parametrize("name", ["dflash", "dspark", "draft_self", "draft_qwen3"])
def test_probabilistic_drafts_follow_their_q(name, ckpts):
    """Probabilistic drafting: at each position the drafts are draws from the q the proposer hands to verification.
    Pooled over every proposal of 120 seeded requests (temperature 1.6: laws spread over many ids): the draft counts
    against the sum of their q rows (chi-square) and the mean probability q gave its draft against its expectation
    (z-test), false-alarm rate 1e-6 each; q rows sum to 1 and are positive at the draft. The ratio test with that q
    then accepts drafts (draft_self: q = p, so nearly all)."""
    llm = make_llm(ckpts, name, draft_sample_method="probabilistic")
    e, k, V = llm.engine.runner, llm.engine.runner.k, llm.model.cfg.vocab_size
    seen, propose = [], e.proposer.propose
    e.proposer.propose = lambda batch: seen.append(propose(batch)) or seen[-1]
    n = 120
    ps = [SamplingParams(temperature=1.6, max_tokens=6, seed=i, ignore_eos=True) for i in range(n)]
    outs = llm.generate([SPEC_PROMPTS[i % 5] for i in range(n)], ps)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    d, q = torch.cat([x[0] for x in seen]), torch.cat([x[1] for x in seen])       # [R, k], [R, k, V]
    assert d.shape[0] >= n and torch.allclose(q.sum(-1), torch.ones(q.shape[:2]), atol=1e-5)
    assert bool((q.gather(-1, d[..., None]) > 0).all())
    for j in range(k):
        qj, dj = q[:, j].double(), d[:, j]
        assert pooled_fit(torch.bincount(dj, minlength=V), qj.sum(0)) > 1e-6, j
        # the probability each draft had: E q(d) = sum q^2 per row if d ~ q (a q sharper or flatter than the draws'
        # law, e.g. another temperature, moves it); z-test, two-sided false-alarm rate 1e-6
        got, m2, m3 = qj.gather(1, dj[:, None])[:, 0], qj.pow(2).sum(1), qj.pow(3).sum(1)
        z = float((got - m2).sum() / (m3 - m2 ** 2).sum().sqrt())
        assert abs(z) < 4.9, (j, z)
    s = llm.engine.stats
    assert s.num_accepted_tokens >= (0.9 if name == "draft_self" else 0.2) * s.num_draft_tokens, vars(s)


@pytest.mark.parametrize("name,extra", [("dflash_small_vocab", {}), ("dspark", {"dspark_draft_topk": 5})])
def test_probabilistic_q_is_the_sampled_distribution(name, extra, ckpts):
    """q over the target vocab: rows sum to 1, zero off the draft vocab (d2t) or outside the top-k, > 0 at the draft."""
    method = "dflash" if name.startswith("dflash") else "dspark"
    llm = LLM(model=ckpts["target"], device="cpu", speculative_config={
        "method": method, "model": ckpts[name], "num_speculative_tokens": 4, "draft_sample_method": "probabilistic",
        **extra})
    e, prop = llm.engine, llm.engine.runner.proposer
    req = e.add_request(llm.tokenizer.encode(SPEC_PROMPTS[0]), SamplingParams(temperature=0.7, max_tokens=8, seed=1))
    e.step()                                                    # prefill: context K/V for the prompt
    with torch.inference_mode():
        d, q = prop.propose(e.runner.batch([req]))
    assert q.shape == (1, 4, 1024) and torch.allclose(q.sum(-1), torch.ones(1, 4))
    assert bool((q.gather(-1, d[..., None]) > 0).all())
    nonzero = (q > 0).sum(-1)
    assert bool((nonzero <= (5 if extra else 512)).all())


# ==============================================================================================
# Rollback: draft caches / states after speculative steps == a from-scratch recompute
# ==============================================================================================

def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rot(x, pos, theta):
    """Full NeoX RoPE. x [1, T, h, d]; pos [T]."""
    d = x.shape[-1]
    f = pos[:, None].float() / theta ** (torch.arange(0, d, 2).float() / d)         # [T, d/2]
    cos, sin = torch.cat([f.cos()] * 2, -1)[:, None], torch.cat([f.sin()] * 2, -1)[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def zlab_block_hidden(net, cfg, feats, block):
    """DFlash/DSpark drafting as z-lab/DeepSpec write it, with no cache: every layer's K/V = [context, block],
    context = hidden_norm(fc(taps)) of the committed tokens (no input_layernorm); masks from z-lab's rule."""
    P, Q = feats.shape[1], block.shape[1]
    ctx, x = rms(F.linear(feats, net.fc.weight), net.hidden_norm.weight), block
    qpos, kpos = torch.arange(P, P + Q)[:, None], torch.arange(P + Q)[None]
    for i, layer in enumerate(net.layers):
        a = layer.self_attn
        h = rms(x, layer.input_layernorm.weight)
        kv = torch.cat([ctx, h], 1)
        q = rot(rms(F.linear(h, a.q_proj.weight).view(1, Q, a.nh, a.hd), a.q_norm.weight), qpos[:, 0], cfg.rope_theta)
        k = rot(rms(F.linear(kv, a.k_proj.weight).view(1, P + Q, a.nkv, a.hd), a.k_norm.weight), kpos[0], cfg.rope_theta)
        v = F.linear(kv, a.v_proj.weight).view(1, P + Q, a.nkv, a.hd)
        seen = torch.ones(Q, P + Q, dtype=torch.bool)
        if cfg.causal[i]:
            seen &= kpos <= qpos
        if cfg.windows[i]:
            seen &= (qpos - kpos < cfg.windows[i]) & ((kpos - qpos < cfg.windows[i]) | cfg.causal[i])
        g = a.nh // a.nkv
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1),
                                           v.transpose(1, 2).repeat_interleave(g, 1), attn_mask=seen)
        x = x + F.linear(o.transpose(1, 2).reshape(1, Q, -1), a.o_proj.weight)
        x = x + layer.mlp(rms(x, layer.post_attention_layernorm.weight))
    return rms(x, net.norm.weight)


def committed(llm, five):
    """(slot, prompt + generated tokens) of the 5-prompt batch run (admitted in order into slots 0..4)."""
    return [(slot, llm.tokenizer.encode(p) + out) for slot, (p, out) in enumerate(zip(SPEC_PROMPTS, five))]


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_block_cache_equals_fresh_prefill_and_zlab(name, ckpts, monkeypatch):
    """After the 48-token batch run (mostly rejected drafts), each slot's context K/V over its committed tokens
    equals a fresh prefill's; and the next block's logits equal z-lab's cache-free formulation. The drafter in
    the weights' own fp32, as z-lab's (a CPU drafts in bf16 by default: kernels.cpu_draft)."""
    monkeypatch.setattr(K, "CPU_DRAFT_DTYPE", None)
    llm = make_llm(ckpts, name)
    llm.generate(SPEC_PROMPTS[:1], GREEDY)
    five = [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, GREEDY)]
    e, prop = llm.engine.runner, llm.engine.runner.proposer
    free = llm.engine.max_num_seqs - 1                          # a slot the 5 prompts did not use
    with torch.inference_mode():
        for slot, toks in committed(llm, five):
            n = len(toks) - 1                                   # all but the last token have context K/V
            got = [prop.cache.kv[i][j][slot, :n].clone() for i in prop.cache.kv for j in (0, 1)]
            e.state.reset(free)
            ctx = sd.Ctx(e.state, torch.tensor([free]), torch.tensor([0]), n, "prefill")
            h, taps = e.model(torch.tensor([toks[:n]]), ctx, prop.taps)
            prop.prefill(types.SimpleNamespace(slot=free), h, taps, None, 0)
            want = [prop.cache.kv[i][j][free, :n] for i in prop.cache.kv for j in (0, 1)]
            assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in zip(got, want))
            anchor = torch.tensor([toks[-1]])
            U = prop.block_logits(n + prop.Q, torch.tensor([slot]), torch.tensor([n]), anchor)
            feats = torch.cat([taps[i] for i in prop.order], -1)
            block = torch.cat([prop.embed(anchor)[:, None], prop.mask_vec.expand(1, prop.Q - 1, -1)], 1)
            ref = prop.logits(zlab_block_hidden(prop.net, prop.cfg, feats, block)[:, prop.out])
            assert torch.allclose(U, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["draft_hybrid", "draft_qwen3"])
def test_cpu_draft_passes(name, ckpts):
    """On a CPU draft_model's first pass takes max(n) new tokens (a decode when every row has that many) and a
    hybrid draft feeds each later pass d_j alone as a decode, its GDN states saved and put back: the same drafts,
    tokens and acceptance, and after every step the same draft states (GDN conv and recurrent states of every
    slot, KV up to what each slot consumed) as the GPU's passes (DraftModelProposer.cpu_passes False: k+1 tokens
    in verify mode, then [d1..dj]): bit for bit alone; in a batch whose rows have different n within 1e-6 (there
    a GDN verify's q and k arrive with the tokens innermost, the conv's layout, and torch sums their squares in
    another order than a decode's: ~1e-9 apart)."""
    llms = [make_llm(ckpts, name) for _ in range(2)]
    llms[1].engine.runner.proposer.cpu_passes = False
    sp = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=3)]
    for prompts in (SPEC_PROMPTS[:1], SPEC_PROMPTS[:3]):
        same = torch.equal if len(prompts) == 1 else (lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-6))
        reqs = [[llm.engine.add_request(llm.tokenizer.encode(p), sp[i % 2]) for i, p in enumerate(prompts)]
                for llm in llms]
        while not all(r.finished for r in reqs[0] + reqs[1]):
            for llm in llms:
                llm.engine.step()
            p0, p1 = (llm.engine.runner.proposer for llm in llms)
            assert [r.output_ids for r in reqs[0]] == [r.output_ids for r in reqs[1]]
            assert torch.equal(p0.start, p1.start) and torch.equal(p0.new_n, p1.new_n)
            for i in p0.state.rec:
                assert same(p0.state.rec[i], p1.state.rec[i]) and same(p0.state.conv[i], p1.state.conv[i])
            for r in reqs[0]:
                if r.slot is not None:
                    n = int(p0.start[r.slot])
                    assert all(same(a[r.slot, :n], b[r.slot, :n])
                               for i in p0.state.kv for a, b in zip(p0.state.kv[i], p1.state.kv[i]))
    s0, s1 = (llm.engine.stats for llm in llms)
    assert s0.num_draft_tokens == s1.num_draft_tokens and s0.accepted_per_pos == s1.accepted_per_pos
    assert s0.num_accepted_tokens > s0.num_drafts > 0


@pytest.mark.parametrize("name", ["draft_hybrid", "draft_qwen3"])
def test_draft_model_state_equals_fresh_prefill(name, ckpts, monkeypatch):
    """A draft's KV (and a hybrid draft's GDN conv/recurrent states) after the batch run == a prefill over the tokens
    it consumed. The attention-only draft keeps the KV of its accepted drafts from the passes that drafted them.
    The draft in the weights' own fp32, as the prefill (a CPU drafts in bf16 by default: kernels.cpu_draft)."""
    monkeypatch.setattr(K, "CPU_DRAFT_DTYPE", None)
    llm = make_llm(ckpts, name)
    llm.generate(SPEC_PROMPTS[:1], GREEDY)
    five = [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, GREEDY)]
    prop = llm.engine.runner.proposer
    m, st = prop.model, prop.state
    free = llm.engine.max_num_seqs - 1
    with torch.inference_mode():
        for slot, toks in committed(llm, five):
            n = int(prop.start[slot])                           # tokens the draft has consumed
            k = CONFIGS[name][1]["num_speculative_tokens"]
            assert len(toks) - k - 1 <= n                       # one step behind: at most k+1 tokens
            if prop.recurrent:
                assert n < len(toks)  # (an attention-only draft may have cached accepted drafts past max_tokens)
            n = min(n, len(toks))
            st.reset(free)
            m(torch.tensor([toks[:n]]), sd.Ctx(st, torch.tensor([free]), torch.tensor([0]), n, "prefill"))
            for i in st.conv:
                assert torch.allclose(st.conv[i][slot], st.conv[i][free], atol=1e-5)
                assert torch.allclose(st.rec[i][slot], st.rec[i][free], atol=1e-4)
            assert st.kv and all(torch.allclose(st.kv[i][j][slot, :n], st.kv[i][j][free, :n], atol=1e-4)
                                 for i in st.kv for j in (0, 1))


# ==============================================================================================
# Building blocks
# ==============================================================================================

def block_attention_reference(q, kc, vc, slots, pos, causal, window=None):
    """Attention of T queries at positions pos[b] + t over the slot's keys, plainly, in float64: a query sees keys
    0 .. pos[b] + T - 1 (non-causal block) or 0 .. its own position (causal); with a causal window W only the last
    W of those (its own position - W < key); query head h reads KV head h // group."""
    assert window is None or causal
    B, T, nh, d = q.shape
    group = nh // kc.shape[2]
    out = torch.zeros(B, T, nh, d, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            last = int(pos[b]) + (t if causal else T - 1)
            first = 0 if window is None else max(0, last - window + 1)
            for h in range(nh):
                keys = kc[slots[b], first:last + 1, h // group].double()           # [L, d]
                p = (keys @ q[b, t, h].double() / math.sqrt(d)).softmax(0)
                out[b, t, h] = p @ vc[slots[b], first:last + 1, h // group].double()
    return out


@needs_kernels
@pytest.mark.parametrize("T", [1, 4, 16])
def test_kernel_attention_sliding_window(T):
    """A drafter's causal sliding-window layer (z-lab's DFlash drafters: 4 of 5 layers) in the attention kernel:
    == block_attention_reference with the window, for windows shorter than, across and longer than the cached
    prefix, in one key piece and in several (64-key pieces, one entirely before the window), kv_len an upper
    bound; keys before the window hold NaN, so reading one shows; and block_attention's masked path (CPU) ==
    the same reference."""
    g = gen(T)
    B, nh, nkv, d, L = 3, 4, 2, 16, 400
    kc, vc = randn(B + 1, L, nkv, d, g=g), randn(B + 1, L, nkv, d, g=g)
    q = randn(B, T, nh, d, g=g)
    slots, pos = torch.tensor([3, 0, 1], device=DEV), torch.tensor([0, 37, 300], device=DEV)
    for W in (5, 70, 1000):
        ref = block_attention_reference(q.cpu(), kc.cpu(), vc.cpu(), slots.cpu(), pos.cpu(), True, W)
        kp, vp = kc.clone(), vc.clone()
        for b in range(B):
            first = max(0, int(pos[b]) - W + 1)                                   # the first query's first key
            kp[slots[b], :first] = float("nan")
            vp[slots[b], :first] = float("nan")
        for chunk in (64, 512):
            got = fast(K.attention, q, kp, vp, slots, pos, L, chunk, window=W)
            assert rel(got.cpu(), ref) <= TOL[torch.float32], (W, chunk)
        masked = sd.block_attention(q.cpu(), kc.cpu(), vc.cpu(), slots.cpu(), pos.cpu(), L, causal=True, window=W)
        assert rel(masked, ref) <= TOL[torch.float32], W


@needs_kernels
@pytest.mark.skipif(CUDA, reason="counts the interpreter's launches on CPU tensors; on a CUDA machine CPU tensors "
                                 "take the reference path")
def test_block_attention_folded_kernel_equals_masked_reference(monkeypatch):
    """DFlash / DSpark block attention without a window: the non-causal block folded into the head axis and served
    by the causal attention kernel as one decode token (and the causal case), through the Triton kernel
    (interpreted on CPU), against block_attention_reference; the windowed masked path against it too."""
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(3, 40, 2, 16, generator=g), torch.randn(3, 40, 2, 16, generator=g)
    q, slots, pos = torch.randn(2, 5, 4, 16, generator=g), torch.tensor([2, 0]), torch.tensor([17, 30])
    launches, launch = [], K._attention_launch
    monkeypatch.setattr(K, "_attention_launch", lambda *a, **kw: launches.append(a[0].shape) or launch(*a, **kw))
    for causal in (False, True):
        ref = block_attention_reference(q, kc, vc, slots, pos, causal)
        got = fast(sd.block_attention, q, kc, vc, slots, pos, 35, causal=causal)
        assert launches[-1] == ((2, 1, 20, 16) if not causal else (2, 5, 4, 16))  # folded: 4 heads x 5 queries
        assert rel(got, ref) <= TOL[torch.float32], causal
        assert rel(sd.block_attention(q, kc, vc, slots, pos, 35, causal=causal, window=10 ** 6), ref) <= 1e-6
    assert len(launches) == 2


def test_plain_qwen3_draft_matches_transformers(ckpts, tmp_path):
    import transformers
    path = write_qwen3_lm(str(tmp_path / "q3"), 256, seed=7, tie=False)
    cfg = json.load(open(os.path.join(path, "config.json")))
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{k: v for k, v in cfg.items() if k != "model_type"}))
    from safetensors.torch import load_file
    missing, unexpected = hf.load_state_dict(load_file(os.path.join(path, "model.safetensors")), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    io = types.SimpleNamespace(model=types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=256)),
                               num_slots=1, dtype=torch.float32, device=torch.device("cpu"))
    m, st = sd.load_draft_lm(path, io, 64)
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = m.logits(m(ids, sd.Ctx(st, torch.tensor([0]), torch.tensor([0]), 11, "prefill")))
        ref = hf.eval()(ids).logits
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tie", [True, False])
def test_plain_qwen3_draft_norms_either_side(tmp_path, monkeypatch, tie):
    """A plain Qwen3 draft's RMSNorms done by the linear after them (linear's norm: _linear_small's loads on
    the GPU) or by the one before them (its then, K.PlainNorm: the split-K sum's launch) -- Qwen3LM.forward picks
    by K.norm_in_loads: the same hidden states and logits, bit for bit, with the skip connections and the final
    norm where they belong (checked against transformers above)."""
    path = write_qwen3_lm(str(tmp_path / "q3"), 256, seed=3, tie=tie)
    io = types.SimpleNamespace(model=types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=256)),
                               num_slots=1, dtype=torch.float32, device=torch.device("cpu"))
    m, st = sd.load_draft_lm(path, io, 64)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    outs, thens = [], []
    plain_norm = K.plain_rms_norm
    monkeypatch.setattr(K, "plain_rms_norm", lambda *a: thens.append(1) or plain_norm(*a))
    for loads in (True, False):
        monkeypatch.setattr(K, "norm_in_loads", lambda x, loads=loads: loads)
        with torch.inference_mode():
            h = m(ids, sd.Ctx(st, torch.tensor([0]), torch.tensor([0]), 9, "prefill"))
            outs.append((h, m.logits(h)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert len(thens) == 2 * (2 * len(m.layers) + 1)  # each mode: two norms a layer and the final one


# ==============================================================================================
# Refusals
# ==============================================================================================

def refusal_cases(ckpts, d):
    t = ckpts["target"]
    return {
        "taps beyond depth": ({"method": "dflash", "model": write_dflash(d + "/deep", t, ids=(0, 4)),
                               "num_speculative_tokens": 3}, "reference layers that do not exist in the target"),
        "fc size": ({"method": "dflash", "model": write_dflash(d + "/fc", t, fc_in=3 * 64), "num_speculative_tokens": 3},
                    "DFlash drafter expects 192 concatenated aux hidden features but received 128"),
        "dspark K < block": ({"method": "dspark", "model": ckpts["dspark"], "num_speculative_tokens": 3},
                             r"DSpark requires num_speculative_tokens >= dspark_block_size \(4\); got 3"),
        "dspark no model": ({"method": "dspark", "num_speculative_tokens": 4}, "needs 'model'"),
        "layout vs method": ({"method": "dflash", "model": ckpts["dspark_spec"], "num_speculative_tokens": 3},
                             "is a dspark checkpoint: use method 'dspark'"),
        "vocab": ({"method": "draft_model", "model": write_qwen3_lm(d + "/v", 512), "num_speculative_tokens": 2},
                  "Target and draft model should have the same vocabulary size. Target model vocab_size=1024. Draft "
                  "model vocab_size=512. Using models with different tokenizers"),
        "draft type": ({"method": "draft_model", "model": save(d + "/llama", {"model_type": "llama"}, {}),
                        "num_speculative_tokens": 2}, r"the draft must be a Qwen3.5/3.6 .* or plain Qwen3"),
    }


def test_drafter_refusals(ckpts, tmp_path):
    for case, (cfg, msg) in refusal_cases(ckpts, str(tmp_path)).items():
        with pytest.raises(ConfigError, match=msg):
            LLM(model=ckpts["target"], device="cpu", speculative_config=cfg)


# ==============================================================================================
# Triton GEMV (kernels.linear's small-M path)
# ==============================================================================================

def gemv(x, w, always=True, residual=None):
    """kernels.linear through fast(), with GEMV_ALWAYS: the Triton GEMV for any eligible shape (M <= 16)."""
    old = K.GEMV_ALWAYS
    K.GEMV_ALWAYS = always
    try:
        return fast(K.linear, x, w, residual)
    finally:
        K.GEMV_ALWAYS = old


@pytest.fixture
def gemv_calls(monkeypatch):
    """The configs of the _gemv_launch calls made (each a (BN, BK, SPLIT, stages, warps) tuple)."""
    calls, launch = [], K._gemv_launch
    monkeypatch.setattr(K, "_gemv_launch", lambda x, w, cfg, r=None, s=None, then=None: calls.append(cfg)
                        or launch(x, w, cfg, r, s, then))
    return calls


@needs_kernels
@pytest.mark.parametrize("N,Kin", [(70, 48), (24, 200)])                          # wide; tall (K >= 3N): split-K
@pytest.mark.parametrize("M", [1, 2, 5, 16, 17, 32])                               # BM = 1, 16, 32
def test_kernel_gemv(M, N, Kin, gemv_calls):
    g = gen(M * N)
    w = randn(N, Kin, g=g)
    x = randn(M, Kin, g=g)
    y = gemv(x, w)
    assert y.shape == (M, N) and y.dtype == x.dtype and rel(y, F.linear(x, w)) <= TOL[torch.float32]
    assert len(gemv_calls) == 1 and gemv_calls[0][2] == (1 if N > Kin else 4)
    xs = randn(1, M, Kin + 8, g=g)[..., :Kin]                                      # leading dims, strided rows
    y = gemv(xs, w)
    assert y.shape == (1, M, N) and rel(y, F.linear(xs, w)) <= TOL[torch.float32] and len(gemv_calls) == 2
    r = randn(1, M, N, g=g)                                                        # the skip connection
    y = gemv(xs, w, residual=r)
    assert rel(y, r + F.linear(xs, w)) <= TOL[torch.float32] and len(gemv_calls) == 3
    exact_ = r.double() + xs.double() @ w.double().T                              # the reference path (CPU) against
    assert rel(K.linear(xs, w, r), exact_) <= 1e-6 and len(gemv_calls) == 3        # float64; and row by row, each
    for i in range(M):                                                             # row as if it were alone
        assert torch.equal(K.linear(xs[:, i:i + 1], w), K.linear(xs, w)[:, i:i + 1]) or CUDA


@needs_kernels
def test_kernel_gemv_dispatch(gemv_calls):
    """Without GEMV_ALWAYS the CPU keeps its row-wise reference; ineligible inputs always take F.linear."""
    g = gen(0)
    w, x = randn(24, 200, g=g), randn(5, 200, g=g)
    if not CUDA:
        assert rel(gemv(x, w, always=False), F.linear(x, w)) <= 1e-6 and not gemv_calls
    for xi, wi in [(randn(33, 200, g=g), w),                                       # M > 32
                   (x, randn(200, 24, g=g).t()),                                   # w not contiguous
                   (x.double(), w.double())]:                                      # fp64
        assert torch.allclose(gemv(xi, wi), F.linear(xi, wi), atol=1e-5)
    with pytest.raises(RuntimeError):                                              # mixed dtypes: F.linear refuses
        gemv(x, w.double())
    assert not gemv_calls
    # the rule on CUDA without BATCH_INVARIANT (27B shapes, bf16; M = 1, 8): Triton where the H200 measurements
    # say it wins
    shapes = [(34816, 5120), (5120, 17408), (16480, 5120), (248320, 5120), (5120, 6144), (14336, 5120)]
    old, K.BATCH_INVARIANT = K.BATCH_INVARIANT, False
    try:
        wins = {(N, Kin): [K._gemv_config(M, N, Kin, True, torch.bfloat16) is not None for M in (1, 8)]
                for N, Kin in shapes}
        tiny = K._gemv_config(1, 64, 64, True, torch.bfloat16)
    finally:
        K.BATCH_INVARIANT = old
    assert wins == {(34816, 5120): [True, False], (5120, 17408): [True, True], (16480, 5120): [True, True],
                    (248320, 5120): [True, True], (5120, 6144): [True, False], (14336, 5120): [True, False]}
    assert tiny is None                                                                # tiny: cuBLAS
    # with BATCH_INVARIANT (the default): every bf16 / fp16 step of up to INVARIANT_ROWS rows, any shape
    assert K.BATCH_INVARIANT
    for M in (1, 8, 17, K.INVARIANT_ROWS):
        assert K._gemv_config(M, 64, 64, True, torch.bfloat16) == "rows"
    assert K._gemv_config(K.INVARIANT_ROWS + 1, 64, 64, True, torch.bfloat16) is None  # prefill: cuBLAS
    assert K._gemv_config(1, 248320, 5120, True, torch.float32) is None                # fp32: cuBLAS


GEMV_SHAPES = [(N, K) for N in (64, 512, 1281, 2048, 4096, 5120, 6144, 8192, 14336, 16480, 17408, 25600, 34816,
                                51200, 248320) for K in (512, 2048, 5120, 6144, 17408)]


@needs_kernels
def test_kernel_gemv_every_gpu_config():
    """Every tile configuration the tuned GPU rule (_gemv_config on CUDA without BATCH_INVARIANT, bf16, M = 1..32, the
    27B / 35B shapes and around them) can choose computes x @ w^T (F.linear in float64 is the reference; run here through the
    interpreter on small odd shapes: the blocks' masks and the split-K sum, with the GPU's block sizes). And the
    rule's documented invariants: fp32 always cuBLAS; K split only for tall weights (K >= 3N), never at M = 1."""
    cfgs = {}                                                                     # config -> the M it serves
    old, K.BATCH_INVARIANT = K.BATCH_INVARIANT, False                              # the tuned rule
    try:
        for M in range(1, 33):
            for N, Kin in GEMV_SHAPES:
                c = K._gemv_config(M, N, Kin, True, torch.bfloat16)
                assert K._gemv_config(M, N, Kin, True, torch.float32) is None
                if c is not None:
                    assert c[2] == 1 or (Kin >= 3 * N and M > 1), (M, N, Kin, c)
                    cfgs.setdefault(c, set()).add(M)
    finally:
        K.BATCH_INVARIANT = old
    assert len(cfgs) >= 5
    g = gen(1)
    for c in sorted(cfgs):
        # each configuration at the fewest and the most rows the rule gives it (on the GPU a config chosen for
        # M = 1, BK = 1024, does not fit shared memory with the 32-row tile of M = 17: never launched so)
        for M, (N, Kin) in zip(sorted({min(cfgs[c]), max(cfgs[c])}) * 2, ((37, 300), (70, 212), (9, 530))):
            x, w, r = randn(M, Kin, g=g), randn(N, Kin, g=g), randn(M, N, g=g)
            y = fast(K._gemv_launch, x, w, c, r)
            assert rel(y, r.double() + x.double() @ w.double().T) <= TOL[torch.float32], (c, M, N, Kin)


@needs_cuda
@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("N,Kin", [(5120, 17408), (248320, 5120)])                # 27B: MLP down, lm_head
@pytest.mark.parametrize("M", [1, 8, 17])
def test_kernel_gpu_gemv_27b(M, N, Kin, invariant, gemv_calls, monkeypatch):
    monkeypatch.setattr(K, "BATCH_INVARIANT", invariant)
    w = randn(N, Kin, g=gen(0), dtype=torch.bfloat16, scale=Kin ** -0.5)
    x = randn(M, Kin, g=gen(1), dtype=torch.bfloat16)
    y = fast(K.linear, x, w)                                                       # the measured rule picks Triton
    want = "rows" if invariant else (4 if Kin > N and M > 1 else 1)               # (M = 1: unsplit)
    assert len(gemv_calls) == 1 and (gemv_calls[0] if invariant else gemv_calls[0][2]) == want
    exact_ = F.linear(x.float(), w.float())
    # bf16 inputs, fp32 accumulation, one bf16 rounding (~2^-9 relative): as close to exact as cuBLAS is
    assert y.dtype == torch.bfloat16 and rel(y, exact_) <= 4e-3 and rel(y, F.linear(x, w)) <= 6e-3
    assert ((y.float() - exact_).abs() <= 2 ** -7 * exact_.abs() + 1e-2).all()
    s = torch.cuda.Stream()                                                        # CUDA-graph safe, deterministic
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        K.linear(x, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = K.linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(yg, K.linear(x, w))


# ==============================================================================================
# Batch invariance: a decode / verify row gets the same bits whatever the batch and T (kernels.BATCH_INVARIANT)
# ==============================================================================================
# The kernels' tests compare a row alone (B = 1, T = 1: a decode token) with the same row inside a verify step
# (T = 4) and inside batches of 2, 5 and 8 rows of other data, bit for bit. Through the interpreter on the CPU (fp32
# dots) and, with the `gpu` tests, compiled in bf16 at the real models' shapes on the H200.

@pytest.fixture
def rowwise_dot(monkeypatch):
    """The interpreter's tl.dot, one row at a time. It multiplies a tile with numpy's matmul, whose BLAS rounds a
    row differently by its place in the tile (seen here: OpenBLAS sgemm); a GPU's MMA computes each row of a tile
    alone. Row by row, the interpreter checks what the kernels control: tiles, key pieces and their merge order."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as I

    def values(t):  # e4m3 operands are held as bytes: their values in fp16, as the interpreter's own dot takes them
        fp8 = t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating()
        return I._convert_float(t.data, t.dtype, tl.float16, None).view(np.float16) if fp8 else t.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = values(a), values(b)
        rows = [np.matmul(a_data[i:i + 1], b_data, dtype=d.data.dtype) for i in range(a_data.shape[0])]
        return I.TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)
    if not CUDA:
        monkeypatch.setattr(I.InterpreterBuilder, "create_dot", create_dot)


def linear_rows_case(N, Kin, dtype, sizes=(2, 5, 8, 17, 40, 136), residual=False, seed=0, fp8=False, small=False):
    """(alone, [rows of steps of other sizes at the same row]) of the row-invariant linear: row x0 alone, then as
    row 0 and as the last row of steps of M rows (in the tiles of kernels._rows_bm, or _fp8_bm). fp8: the
    weight quantized (K.fp8_quantize), through the FP8 kernel; w is then (q, scale). small: kernels._linear_small
    (the drafters') instead."""
    g = gen(seed)
    w = randn(N, Kin, g=g, dtype=dtype, scale=Kin ** -0.5)
    cfg, extra = "rows", ()
    if fp8:
        w, s = K.fp8_quantize(w)
        cfg, extra = "fp8", (s,)
    run = (lambda x, r: fast(K._linear_small, x, w, r)) if small else \
        (lambda x, r: fast(K._gemv_launch, x, w, cfg, r, *extra))
    x0, r0 = randn(1, Kin, g=g, dtype=dtype), randn(1, N, g=g, dtype=dtype) if residual else None
    alone = run(x0, r0)
    got = []
    for M in sizes:
        xs, rs = randn(M, Kin, g=g, dtype=dtype), randn(M, N, g=g, dtype=dtype) if residual else None
        for at in (0, M - 1):
            xs[at] = x0[0]
            if residual:
                rs[at] = r0[0]
            if at == 0 and M == 2:                      # row 0 beside another row (M > 2: rows 1 .. M-2 are)
                got.append(run(xs, rs)[:1])
        y = run(xs, rs)
        got += [y[:1], y[M - 1:]]                       # x0 as the step's first and last row, one launch
    return (w, *extra) if fp8 else w, x0, r0, alone, got


@needs_kernels
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("N,Kin", [(70, 48), (24, 200), (130, 1100)])              # small; tall (split-K); 2 splits
def test_kernel_rows_linear_invariant(N, Kin, residual, rowwise_dot):
    w, x0, r0, alone, got = linear_rows_case(N, Kin, torch.float32, residual=residual, seed=N)
    ref = F.linear(x0, w) + (r0 if residual else 0)
    assert rel(alone, ref) <= TOL[torch.float32]
    assert all(torch.equal(y, alone) for y in got)


@needs_kernels
def test_kernel_rows_linear_tall_tiles(monkeypatch, rowwise_dot):
    """kernels.ROWS_CONFIG_32 / ROWS_CONFIG_64: other BN, stages and warps at the 32- and 64-row tile heights
    (steps of 17-32 and 33-256 rows), BK and the K split the shape's, keep a row's bits those of the row alone."""
    N, Kin = 70, 300
    cpu = torch.device("cpu")
    base = K._rows_config(N, Kin, cpu)
    monkeypatch.setitem(K.ROWS_CONFIG_32, (N, Kin), (32, 2, 4))                     # 3 N blocks instead of 2
    monkeypatch.setitem(K.ROWS_CONFIG_64, (N, Kin), (16, 3, 8))                     # 5 N blocks
    assert K._rows_tiles(N, Kin, 17, cpu) == ((32, base[1], base[2], 2, 4), 32)
    assert K._rows_tiles(N, Kin, 16, cpu) == (base, 16)
    assert K._rows_tiles(N, Kin, 33, cpu) == ((16, base[1], base[2], 3, 8), 64)
    assert K._rows_tiles(N, Kin, 256, cpu) == ((16, base[1], base[2], 3, 8), 64)
    w, x0, r0, alone, got = linear_rows_case(N, Kin, torch.float32, (17, 32, 33, 40), residual=True, seed=1)
    assert rel(alone, F.linear(x0, w) + r0) <= TOL[torch.float32]
    assert all(torch.equal(y, alone) for y in got)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 5])
def test_kernel_linear_route(dtype, M, monkeypatch):
    """A MoE router's linear with then=Route (MoE.forward): (y, w, idx) are the linear's output and moe_route of its
    first E columns, bit for bit, whether the K split's summing launch routes (_gemv_sum_route_kernel: the logits
    rounded to y's dtype first) or moe_route runs after an unsplit linear; the routing as moe_route_ref's. With
    Route's swiglu (the shared expert's [gate | up] after the router and its gate), h is silu_mul of those columns
    bit for bit, written by the same launch."""
    E, k, N, Kin = 12, 3, 12 + 1 + 16, 512                                       # router | shared gate | more
    g = gen(M)
    x, wt = randn(M, Kin, g=g, dtype=dtype), randn(N, Kin, g=g, dtype=dtype, scale=Kin ** -0.5)
    for split in (1, 2, 4):
        monkeypatch.setitem(K.ROWS_CONFIG, (N, Kin), (16, 64, split, 2, 4))
        y0 = fast(K._gemv_launch, x, wt, "rows")
        w0, i0 = fast(K.moe_route, y0[:, :E], k)
        y, w, i = fast(K._gemv_launch, x, wt, "rows", then=K.Route(k, E))
        assert torch.equal(y, y0) and torch.equal(w, w0) and torch.equal(i, i0), split
        w_ref, i_ref = K.moe_route_ref(y0[:, :E], k)
        assert torch.equal(y0.gather(1, i), y0.gather(1, i_ref)) and rel(w, w_ref) <= 1e-6
        h0 = fast(K.silu_mul, y0[:, E + 1:])                         # the shared expert's SwiGLU, its own launch
        y, w, i, h = fast(K._gemv_launch, x, wt, "rows", then=K.Route(k, E, swiglu=E + 1))
        assert torch.equal(y, y0) and torch.equal(w, w0) and torch.equal(i, i0) and torch.equal(h, h0), split
        assert h.shape == (M, (N - E - 1) // 2) and rel(h, K.silu_mul_ref(y0[:, E + 1:])) <= TOL[dtype]
    y, w, i = K.linear(x, wt, then=K.Route(k, E))                                  # the reference path
    assert torch.equal(y, K.linear(x, wt)) and torch.equal(i, K.moe_route(y[:, :E], k)[1])
    y, w, i, h = K.linear(x, wt, then=K.Route(k, E, swiglu=E + 1))
    assert torch.equal(h, K.silu_mul(y[:, E + 1:]))


def test_rows_tiles_fit_shared_memory(monkeypatch):
    """_rows_tiles cuts a tile's stages to the GPU's shared memory (an H200 gives a program 232448 bytes): the
    35B-A3B o_proj's 32 x 512 tile keeps its 4 stages at 16 rows (48 KiB a stage in bf16) and gets 2 at 64 rows
    (96 KiB), where 4 would fail to launch (OutOfResources); BK and the split, a row's bits, stay."""
    monkeypatch.setattr(K, "_shared_memory", lambda device: 232448)
    cpu, shape = torch.device("cpu"), (2048, 4096)
    BN, BK, SPLIT, stages, warps = K.ROWS_CONFIG[shape]
    assert (BK, stages) == (512, 4)
    assert K._rows_tiles(*shape, 1, cpu) == ((BN, BK, SPLIT, 4, warps), 16)
    assert K._rows_tiles(*shape, 40, cpu) == ((BN, BK, SPLIT, 2, warps), 64)
    assert K._rows_tiles(*shape, 40, cpu, esize=4)[0][3] == 1                      # fp32: 192 KiB a stage


@needs_kernels
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("N,Kin", [(70, 48), (24, 200), (9, 300)])                 # ragged N blocks and K
def test_kernel_linear_small(N, Kin, residual):
    """The drafters' small linear (kernels.drafting()): within fp32 rounding of x @ w^T [+ r], and a row's bits
    do not depend on how many rows share the step; linear() takes it inside drafting() only."""
    w, x0, r0, alone, got = linear_rows_case(N, Kin, torch.float32, (2, 5, 8, 40, 64), residual, N, small=True)
    ref = (x0.double() @ w.double().t() + (r0.double() if residual else 0)).float()
    assert rel(alone, ref) <= TOL[torch.float32]
    assert all(torch.equal(y, alone) for y in got)
    calls = []
    real = K._linear_small
    try:
        K._linear_small = lambda *a: calls.append(1) or real(*a)
        fast(K.linear, x0, w)
        assert calls == []
        with K.drafting():
            assert torch.equal(fast(K.linear, x0, w, r0), alone) and calls == [1]
    finally:
        K._linear_small = real


@needs_kernels
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("pre", ["norm", "swiglu"])
def test_kernel_linear_small_pre(pre, dt, monkeypatch):
    """A drafter's small linear with Qwen3's RMSNorm in its load of x (linear's norm) or SwiGLU on its output
    (linear's then = "swiglu", w = [gate | up]), fused inside drafting() only (one kernel): the same bits as the
    linear and the norm or SwiGLU kernel (it repeats their roundings), 1 and 2 rows, odd sizes, a residual (with
    the norm); in fp32 within rounding of the reference."""
    g = gen(3)
    N, Kin, eps = 70, 200, 1e-6
    w = randn(2 * N if pre == "swiglu" else N, Kin, g=g, dtype=dt)
    nw = randn(Kin, g=g, dtype=dt)
    calls, real = [], K._linear_small
    monkeypatch.setattr(K, "_linear_small", lambda *a: calls.append(len(a)) or real(*a))
    for M in (1, 2):
        x = randn(M, Kin, g=g, dtype=dt)
        r = randn(M, N, g=g, dtype=dt) if pre == "norm" else None
        kw = dict(norm=(nw, eps)) if pre == "norm" else dict(then="swiglu")
        if pre == "norm":
            two = lambda: fast(K.linear, fast(K.plain_rms_norm, x, nw, eps), w, r)
        else:
            two = lambda: fast(K.silu_mul, fast(K.linear, x, w))
        calls.clear()
        with K.drafting():
            got = fast(K.linear, x, w, r, **kw)
            assert calls == [5]                                                     # fused: one kernel
            assert torch.equal(got, two())                                          # == two kernels
        calls.clear()
        outside = fast(K.linear, x, w, r, **kw)                                    # outside: two kernels
        assert calls == [] and torch.equal(outside, two())
        if dt == torch.float32:
            if pre == "norm":
                ref = K.plain_rms_norm_ref(x, nw, eps).double() @ w.double().t() + r.double()
            else:
                ref = K.silu_mul_ref((x.double() @ w.double().t()))
            assert rel(got, ref) <= TOL[dt]


@needs_kernels
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("then", ["swiglu", "norm", "norm+residual", "plain+residual"])
def test_kernel_gemv_then(then, fp8, gemv_calls, rowwise_dot):
    """linear's then fused into the split-K sum of the Triton GEMV (_gemv_sum_swiglu_kernel,
    _gemv_sum_norm_kernel: the GEMM's last step, the skip connection and the SwiGLU or the next RMSNorm in one
    launch; plain: Qwen3's RMSNorm, K.PlainNorm): the bits of the unfused kernels (the linear, then silu_mul,
    rms_norm or plain_rms_norm), bf16 and fp32, the bf16 and the FP8 GEMV; a row's bits do not depend on the
    other rows (alone, and rows 0 and M-1 of M = 5 and 17: both row tiles); the same through linear(), which
    also applies then where nothing is split (N > K: no split here)."""
    g = gen(7)
    N, Kin, eps = 24, 1024, 1e-6                                  # tall: K split 2-4 ways (CPU and GPU rules)
    for dt in DTYPES:
        w = randn(N, Kin, g=g, dtype=dt, scale=Kin ** -0.5)
        cfg, scale = "fp8" if fp8 else "rows", None
        if fp8:
            w, scale = K.fp8_quantize(w.float())
        nw = randn(N, g=g, dtype=dt, scale=0.1)
        plain = then.startswith("plain")
        if plain:
            nw = nw + 1                                               # a plain weight: about 1
        arg = "swiglu" if then == "swiglu" else K.PlainNorm((nw, eps)) if plain else (nw, eps)
        run = lambda x, r, t: fast(K._gemv_launch, x, w, cfg, r, scale, t)
        x0 = randn(1, Kin, g=g, dtype=dt)
        r0 = randn(1, N, g=g, dtype=dt) if then.endswith("+residual") else None

        def two(x, r):
            y = run(x, r, None)
            if then == "swiglu":
                return fast(K.silu_mul, y)
            return fast(K.plain_rms_norm if plain else K.rms_norm, y, nw, eps), y
        alone = run(x0, r0, arg)
        want = two(x0, r0)
        if then == "swiglu":
            assert alone.shape == (1, N // 2) and torch.equal(alone, want)
        else:
            assert torch.equal(alone[1], want[1]) and torch.equal(alone[0], want[0])
        for M in (5, 17):
            xs = randn(M, Kin, g=g, dtype=dt)
            rs = randn(M, N, g=g, dtype=dt) if r0 is not None else None
            for at in (0, M - 1):
                xs[at] = x0[0]
                if rs is not None:
                    rs[at] = r0[0]
            got = run(xs, rs, arg)                                    # x0 as the first and the last row
            for a, b in zip(got if then != "swiglu" else [got], alone if then != "swiglu" else [alone]):
                assert torch.equal(a[:1], b) and torch.equal(a[M - 1:], b)
        assert (K._fp8_config if fp8 else K._rows_config)(N, Kin, x0.device)[1 if fp8 else 2] > 1  # K is split
        if dt == torch.float32:  # within rounding of the reference
            y = (K.linear_w8a8_ref(x0, w, scale) if fp8 else x0 @ w.t()) + (r0 if r0 is not None else 0)
            ref = (K.silu_mul_ref(y) if then == "swiglu" else K.plain_rms_norm_ref(y, nw, eps) if plain
                   else K.rms_norm_ref(y, nw, eps))
            assert rel(alone if then == "swiglu" else alone[0], ref) <= TOL[dt]
    K.GEMV_ALWAYS, old = True, K.GEMV_ALWAYS
    try:  # through linear(): then fused (this tall weight) or after it (a wide one: no split), the same bits
        wide = randn(2 * Kin, 48, g=g)
        for wt, sc, xt, nt in [(w, scale, randn(3, Kin, g=g, dtype=dt), nw), (wide, None, randn(3, 48, g=g),
                                                                           randn(2 * Kin, g=g, scale=0.1))]:
            t = "swiglu" if then == "swiglu" else K.PlainNorm((nt, eps)) if plain else (nt, eps)
            rt = randn(3, wt.shape[0], g=g, dtype=xt.dtype) if then.endswith("+residual") else None
            n0 = len(gemv_calls)
            out = fast(K.linear, xt, wt, rt, scale=sc, then=t)
            y = fast(K.linear, xt, wt, rt, scale=sc)
            want = (fast(K.silu_mul, y) if then == "swiglu"
                    else (fast(K.plain_rms_norm if plain else K.rms_norm, y, nt, eps), y))
            assert len(gemv_calls) == n0 + 2
            assert all(torch.equal(a, b) for a, b in zip(*([out, want] if then != "swiglu" else [[out], [want]])))
    finally:
        K.GEMV_ALWAYS = old


@needs_kernels
@pytest.mark.parametrize("N,Kin", [(70, 48), (24, 1024)])                         # one K tile; tall: split-K
def test_kernel_gemv_prefetch(N, Kin, monkeypatch):
    """_gemv_kernel's PRE (GEMV_PREFETCH inside drafting(): its first K tile before the loop, on the GPU loaded
    before the PDL wait) adds the same products in the same order as the plain loop: the same bits at every row
    tile (M = 1, 16, 17 rows), with and without the skip connection and a K split, bf16 and fp32, the
    row-invariant tiles and the GEMV's own."""
    g = gen(N + Kin)
    for dt in DTYPES:
        w = randn(N, Kin, g=g, dtype=dt, scale=Kin ** -0.5)
        for M in (1, 16, 17):
            x, r = randn(M, Kin, g=g, dtype=dt), randn(M, N, g=g, dtype=dt)
            for cfg in ("rows", (16, 32, 4 if Kin >= 3 * N else 1, 1, 4)):
                outs = []
                for pre in (False, True):
                    monkeypatch.setattr(K, "GEMV_PREFETCH", pre)
                    with K.drafting():                                           # (PRE: a drafter's step only)
                        outs.append([fast(K._gemv_launch, x, w, cfg, res) for res in (None, r)])
                assert all(torch.equal(a, b) for a, b in zip(*outs)), (dt, M, cfg)
                assert rel(outs[1][1], r.float() + x.float() @ w.float().t()) <= TOL[dt]
    assert (K._rows_config(N, Kin, w.device)[2] > 1) == (Kin >= 3 * N)             # the tall weight's K is split


def attention_rows_case(nh, nkv, d, dtype, pos=300, L=1500, seed=0, chunk=None):
    """The attention of one query row at position pos: alone (T = 1) with kv_len pos + 1 and the cache length L, as
    token 0 of a T = 4 verify, and as row 3 / 7 of batches of 5 / 8 sequences at other positions (key pieces of
    `chunk` keys: kernels.attention's)."""
    g = gen(seed)
    S = 9
    kc, vc = randn(S, L, nkv, d, g=g, dtype=dtype), randn(S, L, nkv, d, g=g, dtype=dtype)
    q0 = randn(1, 1, nh, d, g=g, dtype=dtype)
    slot0 = torch.tensor([4], device=DEV)
    pos0 = torch.tensor([pos], device=DEV)
    alone = fast(K.attention, q0, kc, vc, slot0, pos0, pos + 1, chunk)
    got = [fast(K.attention, q0, kc, vc, slot0, pos0, L, chunk)]                          # a graph's kv_len
    qv = torch.cat([q0, randn(1, 3, nh, d, g=g, dtype=dtype)], 1)                  # verify: [t0, d1, d2, d3]
    got.append(fast(K.attention, qv, kc, vc, slot0, pos0, pos + 4, chunk)[:, :1])
    for B, at in ((2, 1), (5, 3), (8, 7)):
        qb = randn(B, 1, nh, d, g=g, dtype=dtype)
        qb[at] = q0[0]
        slots = torch.tensor([s for s in range(S) if s != 4][:B], device=DEV)
        slots[at] = 4
        posb = torch.randint(0, L - 8, (B,), generator=torch.Generator().manual_seed(seed)).to(DEV)
        posb[at] = pos
        got.append(fast(K.attention, qb, kc, vc, slots, posb, L, chunk)[at:at + 1])
    return alone, got


@needs_kernels
@pytest.mark.parametrize("pos", [5, 300, 1100])                      # 1, 3, 9 pieces of 128 keys (1, 1, 3 of 512)
@pytest.mark.parametrize("chunk", [None, 512])                                      # ATTN_CHUNK (128); 512
def test_kernel_attention_invariant(pos, chunk, rowwise_dot):
    alone, got = attention_rows_case(4, 2, 32, torch.float32, pos=pos, seed=pos, chunk=chunk)
    assert torch.isfinite(alone).all() and all(torch.equal(y, alone) for y in got)


@needs_kernels
@pytest.mark.parametrize("pos", [5, 40, 200])                        # 1, 3 and 13 pieces of 16 keys, 3 programs
def test_kernel_attention_long_cache(pos, rowwise_dot, monkeypatch):
    """More key pieces than ATTN_PROGRAMS (a graph's kv_len is the whole cache, max_model_len): program i takes
    pieces i, i + P, ... and the partials stay at P per row whatever kv_len is (kv_len = 50 x the cache here). A
    row still gets one arithmetic (alone, at the cache's length and far past it, token 0 of a verify, a row of
    batches: bit for bit) and the reference's values."""
    monkeypatch.setattr(K, "ATTN_PROGRAMS", 3)
    grids, kernel = [], K._attention_kernel

    class Recorded:  # the kernel, its launch grids recorded
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]
    monkeypatch.setattr(K, "_attention_kernel", Recorded())
    alone, got = attention_rows_case(4, 2, 32, torch.float32, pos=pos, L=300, seed=pos, chunk=16)
    assert torch.isfinite(alone).all() and all(torch.equal(y, alone) for y in got)
    assert max(g[2] for g in grids) == 3                                            # programs along the keys
    g = gen(pos)
    kc, vc = randn(9, 300, 2, 32, g=g), randn(9, 300, 2, 32, g=g)
    q = randn(2, 1, 4, 32, g=g)
    slots, pos_t = torch.tensor([4, 1], device=DEV), torch.tensor([pos, 299 - pos], device=DEV)
    far = fast(K.attention, q, kc, vc, slots, pos_t, 50 * 300, 16)
    assert torch.equal(far, fast(K.attention, q, kc, vc, slots, pos_t, 300, 16))
    assert rel(far, K.attention_ref(q, kc, vc, slots, pos_t, 300)) <= TOL[torch.float32]


def gdn_rows_case(Hk, Hv, dk, dv, dtype, seed=0):
    """The GDN recurrence (gates inside) of one sequence: a decode step (T = 1) alone; token 0 of a T = 4 verify
    (states untouched) then its commit of 2 tokens against two decode steps (the states, bit for bit); the decode
    step as row 5 of a batch of 8. Returns {what: (a, b)} of the tensors that must be equal."""
    g = gen(seed)
    T = 4
    q, k = randn(1, T, Hk, dk, g=g, dtype=dtype), randn(1, T, Hk, dk, g=g, dtype=dtype)
    v = randn(1, T, Hv, dv, g=g, dtype=dtype)
    a, b = randn(1, T, Hv, g=g, dtype=dtype, scale=2), randn(1, T, Hv, g=g, dtype=dtype)
    A_log, dt_bias = randn(Hv, g=g, scale=0.5), randn(Hv, g=g, dtype=dtype)
    pool = randn(9, Hv, dk, dv, g=g, scale=0.3)
    slot = torch.tensor([4], device=DEV)
    run = lambda p, *x, **kw: fast(K.gdn_recurrent_gated, *x, A_log, dt_bias, p, kw.pop("slots", slot), **kw)
    p1 = pool.clone()
    o1 = run(p1, q[:, :1], k[:, :1], v[:, :1], a[:, :1], b[:, :1])                 # decode token 0
    s1 = p1.clone()
    run(p1, q[:, 1:2], k[:, 1:2], v[:, 1:2], a[:, 1:2], b[:, 1:2])                 # decode token 1
    s2 = p1.clone()
    pv = pool.clone()
    ov = run(pv, q, k, v, a, b, n_keep=torch.zeros(1, dtype=torch.long, device=DEV))  # verify: outputs only
    pairs = {"verify token 0 == decode": (ov[:, :1], o1), "verify keeps the state": (pv.clone(), pool)}
    run(pv, q, k, v, a, b, n_keep=torch.tensor([2], device=DEV), outputs=False)    # the commit of 2 tokens
    pairs["commit of 2 == 2 decode steps"] = (pv, s2)
    B, at = 8, 5
    qb, kb = randn(B, 1, Hk, dk, g=g, dtype=dtype), randn(B, 1, Hk, dk, g=g, dtype=dtype)
    vb, ab, bb = (randn(B, 1, *t.shape[2:], g=g, dtype=dtype) for t in (v, a, b))
    for t, t0 in ((qb, q), (kb, k), (vb, v), (ab, a), (bb, b)):
        t[at] = t0[0, :1]
    slots = torch.tensor([0, 1, 2, 3, 5, 4, 6, 7], device=DEV)                      # row 5 -> slot 4
    pb = pool.clone()
    ob = run(pb, qb, kb, vb, ab, bb, slots=slots)
    pairs["batch row == alone"] = (ob[at:at + 1], o1)
    pairs["batch state == alone"] = (pb[4], s1[4])
    return pairs


@needs_kernels
def test_kernel_gdn_invariant():
    pairs = gdn_rows_case(2, 4, 16, 16, torch.float32, seed=3)
    assert [n for n, (x, y) in pairs.items() if not torch.equal(x, y)] == []


@needs_cuda
@pytest.mark.parametrize("N,Kin", [(16480, 5120), (14336, 5120), (5120, 6144), (34816, 5120), (5120, 17408),
                                   (248320, 5120), (12352, 2048), (9216, 2048), (2048, 4096), (1281, 2048),
                                   (2048, 512), (248320, 2048), (8256, 256), (1024, 256), (256, 1024),
                                   (6144, 1024), (248320, 1024)])                  # draft_model's 0.6B-shaped LM
def test_kernel_gpu_invariance_linear(N, Kin):
    """bf16 at the 27B / 35B-A3B / toy / 0.6B draft LM linear shapes: a row alone == the row in steps of 2 .. 136
    rows (a 16-row tile alone; a 32-row tile at 17 rows, with ROWS_CONFIG_32's tiles where it has the shape; 64-row
    tiles at 40 and 136, with ROWS_CONFIG_64's)."""
    _, _, _, alone, got = linear_rows_case(N, Kin, torch.bfloat16, residual=N <= 5120)
    assert all(torch.equal(y, alone) for y in got)


@needs_cuda
@pytest.mark.parametrize("N,Kin", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)])  # Qwen3-0.6B's
def test_kernel_gpu_linear_small(N, Kin):
    """bf16 at draft_model's Qwen3-0.6B shapes: a row alone == the row in steps of 2 .. 64 rows; close to the
    fp32 product; and a chain of small linears (inside kernels.drafting()), norms, SwiGLU and attention
    launched with PDL (kernels._pdl) inside a CUDA graph gives the bits of the same chain launched plainly,
    replay after replay."""
    w, x0, r0, alone, got = linear_rows_case(N, Kin, torch.bfloat16, (2, 5, 8, 40, 64), N <= 1024, small=True)
    assert all(torch.equal(y, alone) for y in got)
    assert rel(alone, (x0.float() @ w.float().t() + (r0.float() if r0 is not None else 0))) <= 1e-2
    g = gen(1)
    ws = [randn(n, k, g=g, dtype=torch.bfloat16, scale=k ** -0.5) for n, k in [(4096, 1024), (1024, 2048),
                                                                                (6144, 1024), (1024, 3072)] * 3]
    nw = randn(1024, g=g, dtype=torch.bfloat16)
    kc, vc, _, _, _ = kv_setup(2, 1024, 8, 128, [100, 600], 1, torch.bfloat16, seed=2, S=3)
    slots, pos = torch.tensor([2, 0], device=DEV), torch.tensor([100, 600], device=DEV)
    x = randn(2, 1024, g=g, dtype=torch.bfloat16)

    def chain():
        h = x
        for i in range(0, len(ws), 4):
            a = K.plain_rms_norm(h, nw, 1e-6)
            q = K.linear(a, ws[i])[:, :2048].reshape(2, 1, 16, 128)
            o = K.attention(q, kc, vc, slots, pos, 1024, 128).reshape(2, 2048)
            h = K.linear(o, ws[i + 1], h)
            u = K.silu_mul(K.linear(K.plain_rms_norm(h, nw, 1e-6), ws[i + 2]))
            h = K.linear(u, ws[i + 3], h)
        return h
    with K.drafting():
        plain = chain()
        K._PDL_DEVICES[x.device] = False          # the same kernels without PDL: same bits
        try:
            assert torch.equal(chain(), plain)
        finally:
            del K._PDL_DEVICES[x.device]
        graph = torch.cuda.CUDAGraph()
        chain()
        with torch.cuda.graph(graph):
            out = chain()
    for _ in range(3):
        graph.replay()
        assert torch.equal(out, plain)


@needs_cuda
@pytest.mark.parametrize("nh,nkv,d", [(24, 4, 256), (16, 2, 256), (4, 2, 64)])    # 27B, 35B-A3B, the toy
@pytest.mark.parametrize("pos", [7, 700, 5000])
def test_kernel_gpu_invariance_attention(nh, nkv, d, pos):
    alone, got = attention_rows_case(nh, nkv, d, torch.bfloat16, pos=pos, L=6000, seed=pos)
    assert torch.isfinite(alone).all() and all(torch.equal(y, alone) for y in got)


@needs_cuda
@pytest.mark.parametrize("Hk,Hv,dk", [(16, 48, 128), (16, 32, 128), (2, 4, 64)])  # 27B, 35B-A3B, the toy
def test_kernel_gpu_invariance_gdn(Hk, Hv, dk):
    pairs = gdn_rows_case(Hk, Hv, dk, dk, torch.bfloat16)
    assert [n for n, (x, y) in pairs.items() if not torch.equal(x, y)] == []


def moe_rows_case(E, I, H, k, dtype, sizes=(2, 5, 8, 40, 136), seed=0, fp8=False):
    """The MoE experts (router weights and ids given) of token x0 alone, then as the first and the last token of
    steps of N tokens (other tokens' experts overlap its own), with the shared expert and the residual. fp8: the
    experts quantized (fp8_experts)."""
    g = gen(seed)
    gu, dn = randn(E, 2 * I, H, g=g, dtype=dtype, scale=H ** -0.5), randn(E, H, I, g=g, dtype=dtype, scale=I ** -0.5)
    scales = ()
    if fp8:
        gu, dn, *scales = fp8_experts(gu, dn)

    def tokens(N):
        x, sh, gt, res = (randn(N, d, g=g, dtype=dtype) for d in (H, H, 1, H))
        idx = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(seed + i))[:k]
                           for i in range(N)]).to(DEV)
        w = torch.rand(N, k, generator=torch.Generator().manual_seed(seed + N)).to(DEV).softmax(-1)
        return [x, w, idx, sh, gt, res]
    one = tokens(1)
    run = lambda x, w, idx, sh, gt, res: fast(K.moe_experts, x, w, idx, gu, dn, sh, gt, res, *scales)
    alone = run(*one)
    got = []
    for N in sizes:
        many = tokens(N)
        for at in (0, N - 1):
            for t, t0 in zip(many, one):
                t[at] = t0[0]
            if at == 0 and N == 2:                      # token 0 beside another token (N > 2: 1 .. N-2 are)
                got.append(run(*many)[:1])
        y = run(*many)
        got += [y[:1], y[N - 1:]]                       # x0 as the step's first and last token, one launch
    return alone, got


@needs_kernels
def test_kernel_moe_invariant():
    alone, got = moe_rows_case(16, 24, 40, 4, torch.float32, sizes=(2, 5, 9))     # 9 x 4 pairs > 16 experts
    assert all(torch.equal(y, alone) for y in got)


@needs_cuda
def test_kernel_gpu_invariance_moe():
    """bf16 at the 35B-A3B's expert shapes (256 experts, top 8): a token alone == the token in steps of 2 .. 136
    tokens (more pairs than experts from 40 tokens on)."""
    alone, got = moe_rows_case(256, 512, 2048, 8, torch.bfloat16)
    assert all(torch.equal(y, alone) for y in got)


# ==============================================================================================
# FP8 weights: block quantization, the FP8 linear and FP8 experts against their dequantizing references
# ==============================================================================================

def fp8_experts(gate_up, down):
    """MoE experts in the FP8 layout kernels.moe_experts takes: gate and up quantized apart (their blocks stacked,
    gate's first), down as is -> (gate_up q, down q, gate_up scale, down scale)."""
    I = down.shape[2]
    (gq, gs), (uq, us), (dq, ds) = K.fp8_quantize(gate_up[:, :I]), K.fp8_quantize(gate_up[:, I:]), K.fp8_quantize(down)
    return torch.cat([gq, uq], 1), dq, torch.cat([gs, us], 1), ds


@pytest.mark.parametrize("N,Kin", [(70, 200), (256, 128), (129, 300)])
def test_fp8_quantize_blocks(N, Kin):
    """Qwen's block format: one scale per 128 x 128 block, the block's largest |w| maps to 448 (e4m3's largest
    finite value), dequantization is within half an e4m3 step of w; an all-zero block stays zero."""
    w = torch.randn(N, Kin, generator=torch.Generator().manual_seed(N)) * 0.05
    w[:128, :128] = 0 if N >= 128 and Kin >= 128 else w[:128, :128]
    q, s = K.fp8_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.dtype == torch.float32
    assert s.shape == (-(-N // 128), -(-Kin // 128))
    d = K.fp8_dequantize_ref(q, s)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk, qb = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)], q[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            if blk.abs().max() == 0:
                assert (qb.float() == 0).all()
                continue
            assert qb.float().abs().max() == 448 and torch.isclose(s[i, j], blk.abs().max() / 448)
    assert ((d - w).abs() <= 2 ** -4 * w.abs() + 2 ** -9 * s.max()).all()           # e4m3: 3 mantissa bits


@needs_kernels
@pytest.mark.parametrize("N,Kin", [(70, 200), (130, 300), (24, 400)])             # odd; 2 row blocks; tall: split-K
def test_kernel_fp8_dequantize(N, Kin):
    q, s = K.fp8_quantize(randn(N, Kin, g=gen(N)))
    assert torch.equal(fast(K.fp8_dequantize, q, s, torch.float32), K.fp8_dequantize_ref(q, s))  # exact in fp32
    d, ref = fast(K.fp8_dequantize, q, s, torch.bfloat16), K.fp8_dequantize_ref(q, s, torch.bfloat16)
    assert torch.equal(d, ref) if CUDA else rel(d, ref) <= TOL[torch.bfloat16]    # (the interpreter truncates)


@needs_kernels
@pytest.mark.parametrize("N,Kin", [(70, 200), (130, 300), (24, 400)])
@pytest.mark.parametrize("M", [1, 5, 17, 40])                                      # 16-row tiles; 32-row tiles
def test_kernel_fp8_linear(M, N, Kin, gemv_calls):
    """The FP8 decode linear (W8A8: each row quantized per 128-column group inside the GEMV, e4m3 products, block
    scales on each tile's fp32 sums) against its reference (linear_w8a8_ref: both operands dequantized, an fp32
    product); with the residual; fp32 steps of any length take it (bf16 prefill's dispatch: test_kernel_w8a8_linear)."""
    g = gen(M * N)
    q, s = K.fp8_quantize(randn(N, Kin, g=g, scale=Kin ** -0.5))
    x, r = randn(M, Kin, g=g), randn(M, N, g=g)
    y = fast(K.linear, x, q, scale=s)
    assert y.shape == (M, N) and rel(y, K.linear_w8a8_ref(x, q, s)) <= TOL[torch.float32]
    assert rel(fast(K.linear, x, q, r, scale=s), K.linear_w8a8_ref(x, q, s, r)) <= TOL[torch.float32]
    assert gemv_calls == ["fp8", "fp8"]
    if M == 1:                                              # a prefill-sized fp32 step: the GEMV too (fp32 sums)
        xb = randn(K.INVARIANT_ROWS + 1, Kin, g=g)
        assert rel(fast(K.linear, xb, q, scale=s), K.linear_w8a8_ref(xb, q, s)) <= TOL[torch.float32]
        assert len(gemv_calls) == 3
    with pytest.raises(AssertionError, match="block scales"):
        K.linear(x, q)
    # bf16 activations: rows far outside fp16's range (3e5 > 65504) and far below it (1e-7 < fp16's smallest
    # normal) come out as accurate as the others (each row group's own fp32 scale), each row within bf16's
    # tolerance of the W8A8 reference (the kernel's e4m3 values are the reference's: power-of-two scales)
    xb = randn(M, Kin, g=g, dtype=torch.bfloat16)
    xb[0] *= 3e5
    xb[-1] *= 1e-7
    y, ref = fast(K.linear, xb, q, scale=s), K.linear_w8a8_ref(xb, q, s)
    assert torch.isfinite(y).all() and all(rel(y[i], ref[i]) <= TOL[torch.bfloat16] for i in range(M))


@needs_kernels
@pytest.mark.parametrize("N,Kin", [(24, 400), (130, 256)])                        # N, K past the tiles' edge
def test_kernel_fp8_tma_equals_plain_loads(N, Kin, monkeypatch):
    """The FP8 decode linear's weight tiles through a tensor descriptor (TMA on the GPU, kernels._fp8_desc) give
    the bits of plain masked loads, the tiles past N and K (the copy engine's zero fill) included; a row stride off
    16 bytes, or FP8_TMA off, takes plain loads."""
    g = gen(N + Kin)
    q, s = K.fp8_quantize(randn(N, Kin, g=g, scale=Kin ** -0.5))
    x, r = randn(5, Kin, g=g), randn(5, N, g=g)
    assert K._fp8_desc(q, 16) is not None and K._fp8_desc(K.fp8_quantize(randn(8, 200, g=g))[0], 16) is None
    y = fast(K.linear, x, q, r, scale=s)
    assert rel(y, K.linear_w8a8_ref(x, q, s, r)) <= TOL[torch.float32]
    monkeypatch.setattr(K, "FP8_TMA", False)
    assert K._fp8_desc(q, 16) is None and torch.equal(fast(K.linear, x, q, r, scale=s), y)


@needs_kernels
@pytest.mark.parametrize("M,Kin", [(1, 200), (37, 300), (130, 128)])
def test_kernel_fp8_act_quant(M, Kin):
    """Prefill's activation quantization: one scale per row and 128-column group, the smallest power of two
    that brings the group's largest |x| to at most 448; the kernel's e4m3 values and scales == the
    reference's (their bits: -0 too); dequantized within half an e4m3 step."""
    x = randn(M, Kin, g=gen(M), dtype=torch.bfloat16)
    x[0, :128] = 0                                                                 # an all-zero group: scale 1
    if Kin > 128:  # negative values that round to zero (-0 in e4m3, as torch converts them), and -0 itself
        x[-1, 128:140] = torch.tensor([-1e-4, 1e-4, -0.0, 0.0, -3e-3, 3e-3, 8, -1e-6, 2e-6, -5e-5, 1, -1])
    q, s = K.fp8_act_quant_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (M, -(-Kin // 128)) and s[0, 0] == 1
    amax = F.pad(x.float().abs(), (0, s.shape[1] * 128 - Kin)).view(M, -1, 128).amax(-1)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)                              # powers of two
    assert ((amax / s <= 448) & ((amax / s > 224) | (amax == 0))).all()                   # the smallest
    e = torch.zeros(3, 128)        # the edges: amax 448 * 2^10, just above it, an fp32 subnormal
    e[0, 5], e[1, 7], e[2, 0] = 448 * 2.0 ** 10, -449 * 2.0 ** 10, 2.0 ** -140
    assert K.fp8_act_quant_ref(e)[1].flatten().tolist() == [2.0 ** 10, 2.0 ** 11, 2.0 ** -126]
    assert torch.equal(fast(K.fp8_act_quant, e)[1], K.fp8_act_quant_ref(e)[1])
    sx = s.repeat_interleave(128, 1)[:, :Kin]                 # each element's scale; below 2^-6 e4m3 steps 2^-9
    assert ((K.fp8_dequantize_ref(q[:, None], s[:, None]).view(M, Kin) - x.float()).abs()
            <= 2 ** -4 * x.float().abs() + 2 ** -10 * sx).all()
    qk, sk = fast(K.fp8_act_quant, x)
    assert torch.equal(qk.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sk, s)


@needs_kernels
@pytest.mark.parametrize("N,Kin", [(70, 200), (130, 300)])
@pytest.mark.parametrize("M", [1, 17, 40])
def test_kernel_w8a8_linear(M, N, Kin, monkeypatch):
    """Prefill's W8A8 GEMM against its reference (activations quantized per token group, both dequantized, fp32
    product), with the residual; and (once a shape) the dispatch: a bf16 prefill step of more than FP8_KERNEL_ROWS
    rows takes it."""
    g = gen(M + N)
    q, s = K.fp8_quantize(randn(N, Kin, g=g, scale=Kin ** -0.5))
    x, r = randn(M, Kin, g=g, dtype=torch.bfloat16), randn(M, N, g=g, dtype=torch.bfloat16)
    assert rel(fast(K.linear_w8a8, x, q, s), K.linear_w8a8_ref(x, q, s)) <= TOL[torch.bfloat16]
    assert rel(fast(K.linear_w8a8, x, q, s, r), K.linear_w8a8_ref(x, q, s, r)) <= TOL[torch.bfloat16]
    assert rel(K.linear_w8a8_ref(x, q, s), K.linear_fp8_ref(x.float(), q, s)) <= 0.1   # activations: e4m3
    if M > 1:
        return                                                                     # the dispatch: once a shape
    calls, w8a8 = [], K.linear_w8a8
    monkeypatch.setattr(K, "linear_w8a8", lambda *a: calls.append(a[0].shape) or w8a8(*a))
    with K.not_invariant():
        xp = randn(K.FP8_KERNEL_ROWS + 1, Kin, g=g, dtype=torch.bfloat16)
        assert rel(fast(K.linear, xp, q, scale=s), K.linear_w8a8_ref(xp, q, s)) <= TOL[torch.bfloat16]
        fast(K.linear, xp[:K.FP8_KERNEL_ROWS], q, scale=s)                          # the decode GEMV
        assert rel(fast(K.linear, xp.float(), q, scale=s), K.linear_w8a8_ref(xp.float(), q, s)) <= TOL[torch.float32]
    assert calls == [xp.shape]                                                     # (fp32: the GEMV's fp32 sums)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)                                          # fp32 and bf16 activations
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("N,Kin", [(70, 48), (24, 200), (130, 300)])             # 2 row blocks, 3 K blocks
def test_kernel_fp8_rows_linear_invariant(N, Kin, residual, dtype, rowwise_dot):
    """A row of the FP8 linear alone == the same row in steps of 2 .. 136 rows (decode == verify == batch)."""
    (q, s), x0, r0, alone, got = linear_rows_case(N, Kin, dtype, residual=residual, seed=N, fp8=True)
    assert rel(alone, K.linear_w8a8_ref(x0, q, s, r0)) <= TOL[dtype]
    assert all(torch.equal(y, alone) for y in got)


@needs_kernels
@pytest.mark.parametrize("N", [1, 3, 17])                                          # by pair; by expert
def test_kernel_fp8_moe_experts(N):
    """FP8 experts (I = 24: gate's and up's scale blocks apart) against the dequantizing reference, by pair and by
    expert, with the epilogue."""
    E, k, H, I = 6, 2, 40, 24
    g = gen(N)
    x = randn(N, H, g=g)
    gu, dn, gs, ds = fp8_experts(randn(E, 2 * I, H, g=g, scale=0.2), randn(E, H, I, g=g, scale=0.2))
    w, idx = K.moe_route_ref(randn(N, E, g=g), k)
    ref = K.moe_experts_fp8_ref(x, w, idx, gu, dn, gs, ds)
    assert rel(fast(K.moe_experts, x, w, idx, gu, dn, gate_up_scale=gs, down_scale=ds), ref) <= TOL[torch.float32]
    sh, res, gate = randn(N, H, g=g), randn(N, H, g=g), randn(N, 1, g=g)
    want = res + ref + torch.sigmoid(gate) * sh
    assert rel(fast(K.moe_experts, x, w, idx, gu, dn, sh, gate, res, gs, ds), want) <= TOL[torch.float32]
    assert rel(K.moe_experts(x, w, idx, gu, dn, sh, gate, res, gs, ds), want) <= 1e-6   # the reference path


@needs_kernels
def test_kernel_fp8_moe_invariant():
    alone, got = moe_rows_case(16, 24, 40, 4, torch.float32, sizes=(2, 5, 9), fp8=True)
    assert all(torch.equal(y, alone) for y in got)


FP8_SHAPES = [(16384, 5120), (14336, 5120), (5120, 6144), (34816, 5120), (5120, 17408),      # 27B
              (12288, 2048), (9216, 2048), (2048, 4096), (1024, 2048), (2048, 512)]          # 35B-A3B


@needs_cuda
@pytest.mark.parametrize("N,Kin", FP8_SHAPES)
def test_kernel_gpu_fp8_linear(N, Kin, monkeypatch):
    """bf16 activations, FP8 weights at the real FP8 shapes: as close to the W8A8 reference as the output's
    bf16 rounding allows (the same e4m3 values, fp32 sums per 128-column block), and to the weight-only
    product as e4m3 activations allow; a row alone == the row in steps of 2 .. 136 rows; CUDA-graph safe."""
    (q, s), x0, r0, alone, got = linear_rows_case(N, Kin, torch.bfloat16, residual=N <= 5120, fp8=True)
    r32 = None if r0 is None else r0.float()
    assert rel(alone, K.linear_w8a8_ref(x0.float(), q, s, r32)) <= 4e-3
    assert rel(alone, K.linear_fp8_ref(x0.float(), q, s, r32)) <= 0.05
    assert all(torch.equal(y, alone) for y in got)
    assert K._fp8_desc(q, K._fp8_config(N, Kin, q.device)[0]) is not None      # the weight tiles by TMA ...
    monkeypatch.setattr(K, "FP8_TMA", False)                                      # ... == plain loads, bit for bit
    assert torch.equal(K.linear(x0, q, r0, scale=s), alone)
    monkeypatch.undo()
    x = randn(8, Kin, g=gen(2), dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    K.linear(x, q, scale=s)
    with torch.cuda.graph(graph):
        yg = K.linear(x, q, scale=s)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(yg, K.linear(x, q, scale=s))


@needs_cuda
@pytest.mark.parametrize("N,Kin", [(34816, 5120), (5120, 17408)])                  # 27B gate_up, down
def test_kernel_gpu_w8a8(N, Kin):
    """Prefill's W8A8 GEMM on the FP8 tensor cores at the 27B shapes, a 2048-token chunk (ragged: 2047 rows):
    the activation quantization equals the reference's bits; the product is as close to the reference's fp32
    one as bf16 rounding allows, and to the weight-only product as e4m3 activations allow."""
    q, s = K.fp8_quantize(randn(N, Kin, g=gen(0), scale=Kin ** -0.5))
    x = randn(2047, Kin, g=gen(1), dtype=torch.bfloat16)
    a, sa = K.fp8_act_quant(x)
    a2, sa2 = K.fp8_act_quant_ref(x)
    assert torch.equal(a.view(torch.uint8), a2.view(torch.uint8)) and torch.equal(sa, sa2)
    y = K.linear_w8a8(x, q, s)
    assert rel(y, K.linear_w8a8_ref(x, q, s)) <= 4e-3
    assert rel(y, K.linear_fp8_ref(x.float(), q, s)) <= 0.05


@needs_cuda
def test_kernel_gpu_fp8_moe():
    """FP8 experts at the 35B-A3B's shapes: a token alone == the token in steps of 2 .. 136 tokens, and close to
    the dequantizing reference."""
    alone, got = moe_rows_case(256, 512, 2048, 8, torch.bfloat16, fp8=True)
    assert all(torch.equal(y, alone) for y in got)


def test_reference_logits_batch_invariant(tiny):
    """The CPU reference path (fp32): a token's logits are the same bits as a decode token alone, as token 0 of a
    T = 4 verify, and as a row of a batch of 3 decode tokens (the property speculation's losslessness rests on)."""
    llm = LLM(model=tiny, device="cpu", max_num_seqs=3)
    m, st = llm.model, llm.engine.runner.state
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 500, (3, 9), generator=g)
    nxt = torch.randint(0, 500, (3, 4), generator=g)

    def fresh():
        with torch.inference_mode():
            for s in range(3):
                st.reset(s)
                m(prompts[s:s + 1], sd.Ctx(st, torch.tensor([s]), torch.tensor([0]), 9, "prefill"))

    def logits(ids, slots, mode):
        with torch.inference_mode():
            ctx = sd.Ctx(st, torch.tensor(slots), torch.full((len(slots),), 9), 9 + ids.shape[1], mode)
            return m.logits(m(ids, ctx))
    fresh()
    alone = logits(nxt[1:2, :1], [1], "decode")[0, 0]
    fresh()
    verify = logits(nxt[1:2], [1], "verify")[0, 0]
    fresh()
    batch = logits(nxt[:, :1], [0, 1, 2], "decode")[1, 0]
    assert torch.equal(verify, alone) and torch.equal(batch, alone)


def test_chunked_prefill_equals_whole(tiny):
    """A prompt prefilled in pieces of 7 tokens (chunked prefill) leaves the same KV cache, GDN conv windows and
    recurrent states, MTP hidden state and first-token logits as one whole prefill (fp32, within 1e-5)."""
    prompt = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    got = []
    for budget in (None, 7):
        llm = LLM(model=tiny, device="cpu", max_num_seqs=2, max_num_batched_tokens=budget,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
        runner = llm.engine.runner
        assert runner.prefill_chunk == (budget or 2048)
        req = sd.Request("x", prompt, SamplingParams(temperature=0), None, 0)
        req.slot = 1
        with torch.inference_mode():
            tok, logits = runner.prefill(req)
        st = runner.state
        got.append((tok, logits, [kv[i][1, :40] for kv in st.kv.values() for i in (0, 1)],
                    [c[1] for c in st.conv.values()], [r[1] for r in st.rec.values()],
                    runner.proposer.hidden[1]))
    (t0, l0, kv0, c0, r0, h0), (t1, l1, kv1, c1, r1, h1) = got
    assert t0 == t1 and rel(l1, l0) < 1e-5 and rel(h1, h0) < 1e-5
    assert len(kv0) and len(c0) and len(r0)
    for a, b in zip(kv0 + c0 + r0, kv1 + c1 + r1):
        assert rel(b, a) < 1e-5


def test_chunked_prefill_keeps_running_streams(tiny):
    """A long prompt admitted while a request decodes is prefilled in pieces (max_num_batched_tokens 8 minus the
    running request's k+1 = 3 verify tokens leaves less than a piece, so at most one piece per step, and fewer
    while the pieces have had their share of the time: PrefillShare) and the running request gets tokens in every
    one of those steps; both outputs equal plain decoding (speculation off, whole prefill), token for token."""
    check_chunked_prefill_keeps_running_streams(tiny, "cpu")


@needs_cuda
def test_gpu_chunked_prefill_keeps_running_streams(tiny):
    """The same on the GPU: CUDA graphs, the asynchronous loop, the pieces timed by CUDA events."""
    check_chunked_prefill_keeps_running_streams(tiny, "cuda")


def check_chunked_prefill_keeps_running_streams(tiny, device):
    g = torch.Generator().manual_seed(2)
    short = torch.randint(0, 500, (4,), generator=g).tolist()
    long_ = torch.randint(0, 500, (60,), generator=g).tolist()
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=tiny, device=device, dtype="float32", max_num_seqs=2,
                                                   enable_chunked_prefill=False).generate([short, long_], sp)]
    llm = LLM(model=tiny, device=device, dtype="float32", max_num_seqs=2, max_num_batched_tokens=8,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    eng = llm.engine
    a = eng.add_request(short, sp)
    eng.step()
    eng.step()
    assert a.output_ids and not eng.prefilling
    b = eng.add_request(long_, sp)
    pieces = 0
    while not b.output_ids:
        n_a = len(a.output_ids)
        done_before = b.prefilled
        eng.step()
        pieces += b.prefilled > done_before
        assert b.prefilled - done_before in (0, 8) or b.prefilled == 60
        assert len(a.output_ids) > n_a or a.finished
    assert pieces == 8  # ceil(60 / 8)
    while eng.has_work():
        eng.step()
    assert [a.output_ids, b.output_ids] == plain


def test_prefill_share_spaces_the_pieces():
    """PrefillShare on a fake clock (CPU timing): decode steps of 10 ms, a long prompt's pieces of 30 ms. The
    pieces take close to PREFILL_SHARE = 0.4 of the time and never more, so the streams' time per token stays
    within 1 / (1 - 0.4) of the 10 ms; right after a piece a continuing prompt waits while a new prompt's first
    piece may go; nothing decoding resets what is owed."""
    t = [0.0]
    share = sd.PrefillShare(0.4, "cpu", clock=lambda: t[0])
    pieces = steps = 0
    for _ in range(2000):
        if share.ready(continuing=True):
            start = share.mark()
            t[0] += 0.030
            share.stop(start)
            pieces += 1
            assert share.ready(continuing=False) and not share.ready(continuing=True)
        t[0] += 0.010
        steps += 1
    assert 0.35 < pieces * 0.030 / t[0] <= 0.4
    assert t[0] / steps <= 0.010 / (1 - 0.4)
    share.alone()
    assert share.ready(continuing=True)


def test_chunked_prefill_budget_error(tiny):
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(2\) must be greater than or equal to "
                                          r"max_num_seqs \(4\)"):
        LLM(model=tiny, device="cpu", max_num_seqs=4, max_num_batched_tokens=2)

def test_prefill_alone_steps_invariant(tiny, monkeypatch):
    """Only prefill leaves batch invariance (K.not_invariant: a prompt is prefilled alone, nothing to be invariant
    against); every verify step of the target runs with it, and the opt-out (VLLM_BATCH_INVARIANT=0) stays off."""
    seen = []
    real = sd.Qwen36.forward
    monkeypatch.setattr(sd.Qwen36, "forward", lambda self, ids, ctx, *a: (
        seen.append((ctx.mode, K.BATCH_INVARIANT)), real(self, ids, ctx, *a))[1])
    llm = LLM(model=tiny, device="cpu", max_num_seqs=2, speculative_config={"method": "mtp",
                                                                               "num_speculative_tokens": 2})
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for invariant in (True, False):
        monkeypatch.setattr(K, "BATCH_INVARIANT", invariant)
        seen.clear()
        llm.generate([[5, 6, 7], [8, 9, 10, 11]], sp)
        assert {m for m, _ in seen} == {"prefill", "verify"}
        assert all(on == (invariant and mode != "prefill") for mode, on in seen), seen
        assert K.BATCH_INVARIANT == invariant


# ==============================================================================================
# Qwen3.6 recipes as vLLM users type them (issue 23): the chat template, the parsers, model names, memory
# ==============================================================================================

# A chat template written in the published Qwen3.6 style (tools in the system turn, tool calls in history, tool
# responses in user turns, thinking kept after the last query or with preserve_thinking, enable_thinking)
QWEN36_TEMPLATE = r"""{%- macro text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if 'text' in part -%}
                {{- part.text -}}
            {%- else -%}
                {{- raise_exception('Only text content is supported.') -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is not none and content is defined -%}
        {{- raise_exception('Unexpected content type.') -}}
    {%- endif -%}
{%- endmacro -%}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- set system = text(messages[0].content)|trim if messages[0].role == 'system' else none %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + tool|tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
    {%- if system %}
        {{- '\n\n' + system }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif system is not none %}
    {{- '<|im_start|>system\n' + system + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' %}
        {%- set content = text(message.content)|trim %}
        {%- if not (content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = text(message.content)|trim %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if (preserve_thinking is defined and preserve_thinking is true) or loop.index0 > ns.last_query_index %}
            {{- '<think>\n' + reasoning|trim + '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if loop.first %}
                {{- '\n\n' if content|trim else '' }}
            {%- else %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n<function=' + fn.name + '>\n' }}
            {%- for name, value in (fn.arguments or {})|items %}
                {{- '<parameter=' + name + '>\n' + (value if value is string else value|tojson) + '\n</parameter>\n' }}
            {%- endfor %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.previtem and loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n<think>\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather — città, région",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"},
        "ratio": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": "array"},
        "note": {"type": ["string", "null"]}, "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}}
RUN_CODE = {"type": "function", "function": {"name": "run_code", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}}}}
TOOLS = [WEATHER, RUN_CODE]
CONVERSATIONS = [
    [{"role": "system", "content": "You are helpful. "}, {"role": "user", "content": "Hi!\n"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need a tool.", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                       "arguments": {"city": "Paris", "days": 3,
                                                                     "opts": {"a": [1, None, True]}}}},
         {"id": "c2", "type": "function", "function": {"name": "run_code", "arguments": {"code": "a\n<b>"}}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
     {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "done"}]},
     {"role": "assistant", "content": "<think>\nthinking again\n</think>\n\nSunny."},
     {"role": "user", "content": "Thanks"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "Q1"},
     {"role": "assistant", "content": None, "tool_calls": [{"type": "function",
                                                             "function": {"name": "get_weather", "arguments": {}}}]},
     {"role": "tool", "content": "r"}],
]


def test_chat_template_renders_as_transformers():
    """The checkpoint's template, rendered by specdec's sandboxed Jinja, is byte for byte transformers'
    apply_chat_template (what vLLM calls) on the same chats; the built-in fallback renders them the same way."""
    import transformers
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(TOY, "tokenizer.json"),
                                              chat_template=QWEN36_TEMPLATE, eos_token="<|im_end|>")
    ours, fallback = sd.ChatTemplate(QWEN36_TEMPLATE, {"eos_token": "<|im_end|>"}), sd.ChatTemplate(None)
    for conv in CONVERSATIONS:
        for kw in ({}, {"enable_thinking": False}, {"preserve_thinking": True}, {"add_generation_prompt": False}):
            for tools in (None, TOOLS):
                kw = dict(kw)
                gen = kw.pop("add_generation_prompt", True)
                want = hf.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=gen, **kw)
                assert ours.render(conv, tools, gen, **kw) == want
                assert fallback.render(conv, tools, gen, **kw) == want
    # as vLLM: tool call arguments arrive as JSON text, reasoning as `reasoning`, and `developer` is `system`
    wire = json.loads(json.dumps(CONVERSATIONS[1]))
    for call in wire[2]["tool_calls"]:
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    wire[2]["reasoning"] = wire[2].pop("reasoning_content")
    wire[0]["role"] = "developer"
    assert ours.render(wire, TOOLS) == ours.render(CONVERSATIONS[1], TOOLS) == fallback.render(wire, TOOLS)
    for bad, msg in [([{"role": "user", "content": "x"}, {"role": "system", "content": "S"}], "at the beginning"),
                     ([{"role": "system", "content": "S"}], "No user query"),
                     ([{"role": "user", "content": [{"type": "image_url"}]}], "Only text content"),
                     ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                       "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}], "not valid JSON")]:
        with pytest.raises(ValueError, match=msg):
            ours.render(bad)


def test_chat_template_from_the_checkpoint_sandboxed(tmp_path):
    """chat_template.jinja first, then tokenizer_config.json's chat_template (a string or named list); none:
    the built-in template. The sandbox keeps templates from Python's internals; transformers' globals work."""
    src = TOY
    for name in ("config.json", "tokenizer.json"):
        os.symlink(os.path.join(src, name), tmp_path / name)
    cfg = {"eos_token": {"content": "<|im_end|>"}, "chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ eos_token }}{{ messages|length }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    msgs = [{"role": "user", "content": "hi"}]
    assert sd.ChatTemplate.from_checkpoint(str(tmp_path)).render(msgs) == "<|im_end|>1"
    (tmp_path / "chat_template.jinja").write_text("{{ strftime_now('%Y') | length }}{{ [1, 'é'] | tojson(indent=1) }}"
                                                  "{% generation %}G{% endgeneration %}")
    t = sd.ChatTemplate.from_checkpoint(str(tmp_path))
    assert t.origin.endswith("chat_template.jinja") and t.render(msgs) == '4[\n 1,\n "é"\n]G'
    assert sd.ChatTemplate.from_checkpoint(TOY).source is None  # the toy ships none: the built-in one
    assert sd.ChatTemplate("{{ messages.__class__ }}").render(msgs) == ""  # unsafe: undefined, as in transformers
    for evil in ("{{ ''.__class__.__mro__ }}", "{{ messages.__class__.__base__ }}", "{% set ns = namespace(_x=1) %}",
                 "{{ raise_exception('refused by the template') }}", "{{ cycler.__init__.__globals__ }}"):
        with pytest.raises(ValueError, match="chat template"):
            sd.ChatTemplate(evil).render(msgs)
    with pytest.raises(ConfigError, match="does not compile"):
        sd.ChatTemplate("{% if %}")
    with pytest.raises(ConfigError, match="no such file"):
        sd.ChatTemplate.from_arg("/no/such/template.jinja")


import server as srvmod  # noqa: E402  (the parsers are pure functions of text: tested here without a server)

QWEN_ANSWER = ("The user wants weather.\nI should call <tool_call> tools</think>\n\nI will check.\n\n"
               "<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
               "<parameter=days>\n3\n</parameter>\n<parameter=hot>\nTrue\n</parameter>\n<parameter=ratio>\n2.5\n"
               "</parameter>\n<parameter=opts>\n{\"unit\": \"C\", \"n\": [1, 2]}\n</parameter>\n<parameter=tags>\n"
               "['a', 'b']\n</parameter>\n<parameter=note>\nnull\n</parameter>\n<parameter=limit>\nNone\n"
               "</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
               "<function=run_code>\n<parameter=code>\nif a < b:\n    print('</parameter>')\n<x>y</x>\n\n"
               "</parameter>\n</function>\n</tool_call>")
PARSER_CASES = [  # (start, parser, answer, reasoning, content, [(name, arguments)])
    ("thinking", "qwen3_coder", QWEN_ANSWER, "The user wants weather.\nI should call <tool_call> tools",
     "\n\nI will check.\n\n",
     [("get_weather", '{"city": "São Paulo", "days": 3, "hot": true, "ratio": 2.5, "opts": {"unit": "C", "n": '
                      '[1, 2]}, "tags": ["a", "b"], "note": null, "limit": null, "extra": "42"}'),
      ("run_code", '{"code": "if a < b:\\n    print(\'</parameter>\')\\n<x>y</x>\\n"}')]),
    ("thinking", "qwen3_coder", "no end of thinking <tool_call", "no end of thinking <tool_call", None, []),
    ("thinking", None, "R</think>\n\nA <think> B", "R", "\n\nA <think> B", []),
    ("answer", None, "R</think>\n\nA", "", "R</think>\n\nA", []),  # thinking off: all is content
    ("maybe", None, "<think>R</think>A", "R", "A", []),  # a model that opens its own thinking
    ("maybe", None, "plain", "", "plain", []),
    ("thinking", "qwen3_coder", "R\n<tool_call>\n<function=run_code>\n<parameter=code>\nx=1\n</parameter>\n</function>"
     "\n</tool_call>", "R\n", None, [("run_code", '{"code": "x=1"}')]),  # a call ends the thinking (Qwen3.5+)
    ("thinking", "qwen3_coder", "R<tool_call>\n<function=run_code>\n</function>\n</tool_call></think>A", "R",
     "</think>A", [("run_code", "{}")]),  # ... before a later </think>, streamed or not
    ("answer", "qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nRo", "", None,
     [("get_weather", "{}")]),  # cut off inside a value: the call closes with what is complete
    ("answer", "qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n<paramet", "",
     None, [("get_weather", '{"days": 3}')]),
    ("answer", "qwen3_coder", "<tool_call>\n<functi", "", "<tool_call>\n<functi", []),  # no name yet: no call
    ("answer", "qwen3_coder", "see <tool_call>\nnot a call</tool_call> and <tool_call>\n<function=a b>\n</function>"
     "</tool_call>", "", "see <tool_call>\nnot a call</tool_call> and <tool_call>\n<function=a b>\n</function>"
     "</tool_call>", []),  # malformed calls stay in the content
    ("answer", "qwen3_coder", "Done: <b>x</b>\n<tool_call>\n<function=run_code>\n</function>\n</tool_call>\nAfter.",
     "", "Done: <b>x</b>\n\nAfter.", [("run_code", "{}")]),  # the text around a call as it is
    ("answer", "hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
     '</tool_call>\n<tool_call>\n{"name": "run_code", "arguments": "{\\"code\\": \\"</x>\\"}"}\n</tool_call>', "",
     "Sure.\n", [("get_weather", '{"city": "Paris", "days": 3}'), ("run_code", '{"code": "</x>"}')]),
    ("answer", "hermes", '<tool_call>\n{"name": bad json}\n</tool_call>\n<tool_call>\n{"name": "cut", "argu', "",
     '<tool_call>\n{"name": bad json}\n</tool_call>\n<tool_call>\n{"name": "cut", "argu', []),
]


def stream_in_chunks(stream, text, size):
    """Feed `text` as the engine's growing text (`size` characters a step), then once more, final: the deltas
    summed."""
    got = {"reasoning": "", "content": "", "calls": []}
    for end in [*range(size, len(text), size), len(text)]:
        for final in ((False, True) if end == len(text) else (False,)):
            d = stream.feed(text[:end], final)
            got["reasoning"] += d.get("reasoning", "")
            got["content"] += d.get("content", "")
            for c in d.get("tool_calls", []):
                if c["index"] == len(got["calls"]):
                    assert c["function"]["name"] and c["id"] and c["type"] == "function"  # the name comes first
                    got["calls"].append([c["function"]["name"], ""])
                got["calls"][c["index"]][1] += c["function"]["arguments"]
    return got


@pytest.mark.parametrize("case", range(len(PARSER_CASES)))
def test_reasoning_and_tool_parsers_in_every_chunking(case):
    """vLLM's qwen3 reasoning parser and qwen3_coder / hermes tool parsers on answers written as text: the whole
    answer's fields, and the same fields summed from a stream cut into chunks of every size (chunks that end
    in the middle of a tag, several tags in one chunk as a speculative step brings them)."""
    start, parser, text, reasoning, content, calls = PARSER_CASES[case]
    make = lambda: srvmod.ChatStream(start, parser and srvmod.TOOL_PARSERS[parser](TOOLS))  # noqa: E731
    whole = make()
    whole.feed(text, True)
    assert (whole.reasoning, whole.content or None) == (reasoning, content or None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.calls] == calls
    for args in (a for _, a in calls):
        json.loads(args)
    for size in range(1, len(text) + 1):
        got = stream_in_chunks(make(), text, size)
        assert (got["reasoning"], got["content"], got["calls"]) == (reasoning, content or "", [list(c) for c in calls])


def test_parsers_stream_as_they_answer_on_random_text():
    """Text made of the tags' pieces, streamed in random chunk sizes through every start x parser: never an
    exception, every call's arguments valid JSON, and the stream's deltas add up to the whole answer."""
    pieces = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", "<think>",
              "</think>", "\n", " ", "get_weather", "days", ">", "{", "}", '"name"', ":", "3", "null", "<", "a b",
              '{"name": "get_weather", "arguments": {"days": 1}}', "<tool_call>\n<function=get_weather>\n"]
    odd = [{"type": "function", "function": {"name": "f", "parameters": {"properties": [1]}}},  # schemas a
           {"type": "function", "function": {"name": "g", "parameters": {"properties": {"a": {"anyOf": 5}}}}}]  # client
    stream = srvmod.ChatStream("answer", srvmod.Qwen3CoderParser(odd))  # may send: no types, values stay text
    stream.feed("<tool_call>\n<function=g>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>", True)
    assert stream.calls[0]["function"]["arguments"] == '{"a": "1"}'
    rnd = random.Random(0)
    for _ in range(120):
        text = "".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 30)))
        for start in ("thinking", "answer", "maybe", None):
            for parser in ("qwen3_coder", "hermes", None):
                make = lambda: srvmod.ChatStream(start, parser and srvmod.TOOL_PARSERS[parser](TOOLS))  # noqa: E731
                whole = make()
                whole.feed(text, True)
                calls = [[c["function"]["name"], c["function"]["arguments"]] for c in whole.calls]
                for _, args in calls:
                    json.loads(args)
                got = stream_in_chunks(make(), text, rnd.randint(1, 5))
                assert (got["reasoning"], got["content"], got["calls"]) == (whole.reasoning, whole.content or "", calls)


def test_qwen3_coder_values_that_do_not_parse_stay_text():
    """A parameter's text becomes its schema's type where it parses, else stays text: an integer of more digits
    than Python converts (4300) was a 500 (ValueError) before session 34."""
    integer = {"type": "integer"}
    assert srvmod.typed_value("42", integer) == 42 and srvmod.typed_value("4x", integer) == "4x"
    assert srvmod.typed_value("9" * 4400, integer) == "9" * 4400
    assert srvmod.depth_and_unencodable({"a": [1, {"b": []}]}) == (4, None) and srvmod.depth_and_unencodable(5)[0] == 0
    assert srvmod.depth_and_unencodable({"k": [{"\ud800": "é"}]}) == (3, "\ud800")  # a key too


def test_metrics_kv_usage_and_phase_times():
    """vllm:kv_cache_usage_perc counts the slots' positions in use (a prompt in chunked prefill: its pieces so
    far); the queue time ends when a slot is given, not at the first token (chunked prefill spans steps)."""
    from collections import deque
    m, R = srvmod.Metrics("m", 0), types.SimpleNamespace
    a, b = R(tokens=[0] * 30, prefilled=30), R(tokens=[0] * 50, prefilled=20)
    eng = R(slots=[a, None, b, None], waiting=[], prefilling=deque([b]), max_num_seqs=4, max_model_len=100,
            stats=sd.SpecStats())
    m.after_step(eng)
    assert m.kv_usage == (30 + 20) / 400 and 'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.125' in m.render()
    job = srvmod.Job([1, 2, 3], SamplingParams())
    job.t_arrival, job.t_scheduled = 10.0, 11.0  # given a slot at 11 (EngineLoop), first token at 13
    m.on_update(job, R(prompt_ids=[1, 2, 3], finished=False), 1, 13.0, 12.5)
    assert m.hist[srvmod.QUEUE][1:] == [1.0, 1] and m.hist[srvmod.PREFILL][1:] == [2.0, 1]


def test_hub_ids_resolve_in_the_local_cache(tmp_path, monkeypatch):
    """Qwen/Qwen3.6-27B -> $HF_HUB_CACHE/models--Qwen--Qwen3.6-27B/snapshots/<refs/main>; absent: one line that
    names the path looked in and the command that would download it. Nothing is fetched."""
    hub = tmp_path / "hub"
    repo = hub / "models--Qwen--Qwen3.6-Toy"
    for rev in ("0ld", "c0ffee"):
        (repo / "snapshots" / rev).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee\n")
    for name in os.listdir(TOY):
        os.symlink(os.path.join(TOY, name), repo / "snapshots" / "c0ffee" / name)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # $HF_HOME/hub
    assert sd.resolve_model("Qwen/Qwen3.6-Toy") == str(repo / "snapshots" / "c0ffee")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert sd.resolve_model("Qwen/Qwen3.6-Toy") == str(repo / "snapshots" / "c0ffee")
    assert sd.resolve_model(TOY) == TOY
    llm = LLM("Qwen/Qwen3.6-Toy", device="cpu", max_num_seqs=1)
    assert llm.model_path == str(repo / "snapshots" / "c0ffee")
    with pytest.raises(ConfigError) as e:
        sd.resolve_model("Qwen/Qwen3.6-27B")
    assert str(hub / "models--Qwen--Qwen3.6-27B") in str(e.value) and "hf download Qwen/Qwen3.6-27B" in str(e.value)
    assert one_line_error(["Qwen/Qwen3.6-27B", "--port", "1"]).count("hf download Qwen/Qwen3.6-27B") == 1


def test_memory_arithmetic_sizes_the_slots(tiny):
    """state_bytes is what State allocates; the default max_model_len is the model's if max_num_seqs + 1 slots
    of it fit in the budget, else the largest that fits; an asked length that does not fit is one clear line."""
    cfg = sd.ModelConfig.from_hf(tiny)
    for mtp in (False, True):
        st = sd.State(cfg, 3, 100, torch.float32, "cpu", mtp=mtp)
        have = sum(t.numel() * t.element_size() for t in [*sum(st.kv.values(), ()), *st.conv.values(),
                                                          *st.rec.values()])
        per_pos, per_slot = sd.state_bytes(cfg, torch.float32, mtp)
        assert have == 4 * (100 * per_pos + per_slot)
    per_pos, per_slot = 1000, 5000  # 9 slots, 3 extra positions each
    n, line = sd.size_slots(per_pos, per_slot, 8, 3, 10 ** 9, "test", 4096)
    assert n == 4096 and "max_model_len 4096 (the model's limit)" in line and "9 slots (8 + 1 for padding)" in line
    n, line = sd.size_slots(per_pos, per_slot, 8, 3, 9 * (1000 * 1000 + 5000) + 1, "test", 4096)
    assert n == 997 and "the largest that fits; the model allows 4096" in line
    assert 9 * ((n + 3) * per_pos + per_slot) <= 9 * (1000 * 1000 + 5000) + 1 < 9 * ((n + 4) * per_pos + per_slot)
    n, _ = sd.size_slots(per_pos, per_slot, 8, 3, 10 ** 9, "test", 4096, want=2048)
    assert n == 2048
    with pytest.raises(ConfigError, match=r"max_model_len=4096: one sequence needs .* the largest that fits one "
                                          r"sequence is 97: lower --max-model-len or raise --gpu-memory-utilization"):
        sd.size_slots(per_pos, per_slot, 8, 3, 2 * (100 * per_pos + per_slot), "test", 4096, want=4096)
    with pytest.raises(ConfigError, match=r"--max-num-seqs 8 slots of max_model_len=100 need .*; 4 fit"):
        sd.size_slots(per_pos, per_slot, 8, 3, 5 * (103 * per_pos + per_slot), "test", 4096, want=100)
    with pytest.MonkeyPatch.context() as mp:  # CUDA's count, without a GPU: 0.9 x total - held, at most free
        mp.setattr(torch.cuda, "mem_get_info", lambda device: (50 * sd.GiB, 100 * sd.GiB))
        mp.setattr(torch.cuda, "memory_reserved", lambda device: 30 * sd.GiB)
        assert sd.memory_budget(torch.device("cuda"), 0.9)[0] == 50 * sd.GiB
        budget, basis = sd.memory_budget(torch.device("cuda"), 0.5)
        assert budget == 20 * sd.GiB and "0.5 x 100.00 GiB GPU memory - 30.00 GiB held" in basis
    llm = LLM(tiny, device="cpu", max_num_seqs=2)
    assert llm.max_model_len == cfg.max_position_embeddings and "system memory available" in llm.memory_report
    err = one_line_error([tiny, "--device", "cpu", "--max-model-len", "4k", "--gpu-memory-utilization", "1e-9"])
    assert "max_model_len=4000: one sequence needs" in err


def test_memory_counts_the_drafter(ckpts, monkeypatch):
    """A drafter's weights and caches are counted before it loads (drafter_bytes), as vLLM's profiling counts a
    draft model's: with a budget that holds the target's slots at the model's limit but not the drafter beside
    them, max_model_len shrinks until everything allocated (the target's state, the drafter's weights and
    caches) fits the budget. (Before, the target took the whole budget and the drafter's cache came on top.)"""
    cfg = sd.ModelConfig.from_hf(ckpts["target"])
    per_pos, per_slot = sd.state_bytes(cfg, torch.float32)
    limit = cfg.max_position_embeddings
    budget = 3 * ((limit + 8) * per_pos + per_slot)          # 2 sequences + the padding slot: the target alone fits
    monkeypatch.setattr(sd, "memory_budget", lambda device, utilization: (budget, "test"))
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)                       # noqa: E731
    caches = lambda st: [*sum(st.kv.values(), ()), *st.conv.values(), *st.rec.values()]    # noqa: E731
    for key, spec in (("qwen3_draft", {"method": "draft_model", "num_speculative_tokens": 3}),
                      ("hybrid_draft", {"method": "draft_model", "num_speculative_tokens": 2}),
                      ("dflash", {"method": "dflash", "num_speculative_tokens": 3})):
        llm = LLM(model=ckpts["target"], device="cpu", max_num_seqs=2, speculative_config={**spec, "model": ckpts[key]})
        runner, p = llm.engine.runner, llm.engine.runner.proposer
        drafter = (p.model, p.state) if spec["method"] == "draft_model" else (p.net, p.cache)
        used = nbytes(caches(runner.state)) + nbytes(caches(drafter[1])) + nbytes(drafter[0].parameters())
        assert llm.max_model_len < limit and used <= budget, (key, llm.max_model_len, used, budget)
        assert "the drafter's" in llm.memory_report
    assert LLM(model=ckpts["target"], device="cpu", max_num_seqs=2).max_model_len == limit     # without one


def test_generation_config_gives_the_sampling_defaults(tmp_path):
    """vLLM's --generation-config auto | vllm | FOLDER and --override-generation-config: what a request leaves
    unset, repetition_penalty and min_p included (vLLM's get_diff_sampling_param keys)."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 7,
         "repetition_penalty": 1.0, "eos_token_id": [1, 2]}))
    d = sd.generation_defaults(str(tmp_path))
    assert d == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 7, "repetition_penalty": 1.0}
    assert sd.generation_defaults(str(tmp_path), "vllm") == {}
    assert sd.generation_defaults(TOY, str(tmp_path), '{"top_k": 0}') == dict(d, top_k=-1)
    got = sd.generation_defaults(str(tmp_path), override={"repetition_penalty": 1.1, "min_p": 0.05})
    assert (got["repetition_penalty"], got["min_p"]) == (1.1, 0.05)
    assert sd.SamplingParams(**got).repetition_penalty == 1.1  # the offline API's defaults (get_default_...)
    with pytest.raises(ConfigError, match="repetition_penalty must be greater than zero"):
        sd.generation_defaults(str(tmp_path), override={"repetition_penalty": 0})
    with pytest.raises(ConfigError, match="top_p must be in"):
        sd.generation_defaults(str(tmp_path), override='{"top_p": 0}')
    with pytest.raises(ConfigError, match="no generation_config.json there"):
        sd.generation_defaults(TOY, str(tmp_path / "nowhere"))
    p = srvmod.sampling_params({}, None, None, 1024, d)  # a request that leaves them unset
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.6, 20, 0.95, 7)
    p = srvmod.sampling_params({"min_p": 0.2}, None, None, 1024, got)  # the server's defaults: vLLM's too
    assert (p.repetition_penalty, p.min_p) == (1.1, 0.2)
    p = srvmod.sampling_params({"temperature": 0, "top_p": 1, "max_tokens": 50}, 50, None, 1024, d)
    assert (p.temperature, p.top_p, p.max_tokens) == (0, 1, 7)  # max_new_tokens caps (vLLM)


def test_generation_config_penalty_defaults_reach_requests(tiny_spec, tmp_path):
    """Issue 23's last point: a checkpoint whose generation_config.json sets repetition_penalty and min_p starts
    (it was refused while the sampler lacked them) and a request that leaves them unset gets them, as vLLM's
    --generation-config auto does; a request's own value wins."""
    import shutil
    path = shutil.copytree(tiny_spec, tmp_path / "ckpt")
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.0, repetition_penalty=0.5, min_p=0.1, max_new_tokens=16)
    (path / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(model=str(path), device="cpu")
    d = llm.get_default_sampling_params()
    assert (d.repetition_penalty, d.temperature, d.max_tokens) == (0.5, 0.0, 16)
    prompt = "a b c a b c a b"
    auto = llm.generate(prompt)[0].outputs[0].token_ids
    explicit = llm.generate(prompt, SamplingParams(temperature=0, repetition_penalty=0.5, max_tokens=16))
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))
    assert auto == explicit[0].outputs[0].token_ids != plain[0].outputs[0].token_ids


def test_speculative_config_infers_as_vllm(tmp_path, tiny):
    """The method from a draft model's name or architecture, mtp from a Qwen3.5/3.6 model_type (here: the
    target itself), num_speculative_tokens from n_predict; "auto" accepted where vLLM means the default."""
    def draft(name, **cfg):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        return str(tmp_path / name)
    spec = lambda **kw: sd.SpeculativeConfig.from_json(kw, target=tiny)  # noqa: E731
    assert spec(model=draft("my-dflash-b16", model_type="qwen3"), num_speculative_tokens=15).method == "dflash"
    assert spec(model=draft("d1", model_type="qwen3", architectures=["Qwen3DSparkModel"], n_predict=7)).method \
        == "dspark"
    assert spec(model=str(tmp_path / "d1")).num_speculative_tokens == 7
    with pytest.raises(ConfigError, match="num_speculative_tokens:9 must be divisible by n_predict=7"):
        spec(model=str(tmp_path / "d1"), num_speculative_tokens=9)
    with pytest.raises(ConfigError, match="'eagle3' is a vLLM method"):
        spec(model=draft("Qwen3-8B_eagle3", model_type="llama"), num_speculative_tokens=3)
    c = spec(model=tiny)  # the target's own checkpoint: its MTP layer, k = mtp_num_hidden_layers
    assert (c.method, c.model, c.num_speculative_tokens) == ("mtp", None, 1)
    with pytest.raises(ConfigError, match="specdec's mtp drafts with the target's own MTP head"):
        spec(model=draft("other", model_type="qwen3_5", text_config={"mtp_num_hidden_layers": 1}))
    assert spec(model=str(tmp_path / "other"), method="draft_model", num_speculative_tokens=2).method == \
        "draft_model"  # an explicit method is kept
    c = spec(method="mtp", num_speculative_tokens=2, kv_cache_dtype="auto", attention_backend="auto",
             moe_backend="auto")
    assert c.method == "mtp"
    with pytest.raises(ConfigError, match="'kv_cache_dtype' is a vLLM option .*only None or 'auto'"):
        spec(method="mtp", num_speculative_tokens=2, kv_cache_dtype="fp8")


def test_vllm_command_line_spelling_and_refusals(tiny, capsys):
    """Underscores as dashes, human-readable ints, the positional model; the flags of other issues parse and
    refuse in one line; the help says that no remote code runs."""
    assert sd.vllm_argv(["--max_model_len=2k", "--speculative_config", '{"a_b": 1}', "models/x_y"]) == \
        ["--max-model-len=2k", "--speculative-config", '{"a_b": 1}', "models/x_y"]
    assert [sd.human_int(v) for v in ("4096", "32k", "32K", "1.5k", "1M")] == [4096, 32000, 32768, 1500, 1048576]
    assert sd.max_len_arg("auto") == sd.max_len_arg("-1") == "auto"
    with pytest.raises(SystemExit):
        srvmod.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for flag in ("--served-model-name", "--gpu-memory-utilization", "--reasoning-parser", "--tool-call-parser",
                 "--enable-auto-tool-choice", "--chat-template", "--default-chat-template-kwargs",
                 "--generation-config", "--override-generation-config", "--enable-log-requests",
                 "--tensor-parallel-size", "--quantization", "--trust-remote-code", "MODEL"):
        assert flag in help_text
    assert "never runs code from a checkpoint" in help_text
    with pytest.raises(SystemExit):  # argparse's usage line and its error
        srvmod.main([tiny, "--max-model-len", "lots"])
    assert "argument --max-model-len: invalid integer 'lots' (e.g. 4096, 32k, 32K)" in capsys.readouterr().err
    for args, msg in [(["-tp", "8"], "tensor_parallel_size=8 (--tensor-parallel-size): tensor parallelism is not "
                                     "supported yet"),
                      (["--quantization", "awq"], "quantization='awq' (--quantization) is not supported; "
                                                  "specdec supports fp8"),
                      (["--reasoning_parser", "deepseek_r1"], "--reasoning-parser 'deepseek_r1' is not supported"),
                      (["--tool-call-parser", "llama3_json"], "--tool-call-parser 'llama3_json' is not supported"),
                      (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
                      (["--default-chat-template-kwargs", "{no"], "--default-chat-template-kwargs is not valid JSON"),
                      (["--default-chat-template-kwargs", '{"messages": []}'], "may not set messages"),
                      (["--max-model-len", "0"], "max_model_len must be a positive integer"),
                      (["--chat-template", "/no/such.jinja"], "no such file"),
                      (["--generation-config", "/nowhere"], "no generation_config.json there"),
                      (["--override-generation-config", '{"repetition_penalty": 0}'],
                       "repetition_penalty must be greater than zero, got 0.")]:
        assert msg in one_line_error([tiny, "--device", "cpu", *args])


def one_line_error(argv):
    """server.main(argv) in this process: it must fail with exactly one line on stderr (returned)."""
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert srvmod.main([*argv, "--port", "1"]) == 1
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err.getvalue(), lines
    return lines[0]


# ==============================================================================================
# Qwen3.6 recipes through the server (issue 23): the recipe's command line, scripted answers
# ==============================================================================================

# A model that answers as scripted: a prompt holding a key gets that answer's tokens (then <|im_end|>), three
# tokens a step with the MTP config below (so a tag may arrive in the middle of a step); other prompts, the model's
SCRIPT = """
import weakref, specdec
ANSWERS = %r
TOK, STATE = [], weakref.WeakKeyDictionary()
init, prefill, read = specdec.Engine.__init__, specdec.ModelRunner.prefill, specdec.ModelRunner.read

def _init(self, model, tokenizer, *a, **kw):
    TOK.append(tokenizer)
    init(self, model, tokenizer, *a, **kw)

def take(req, n):
    if req not in STATE:
        prompt = TOK[0].decode(req.prompt_ids)
        key = next((k for k in ANSWERS if k in prompt), None)
        STATE[req] = [None if key is None else TOK[0].encode(ANSWERS[key]) + [TOK[0].eos_token_id], 0]
    ids, i = STATE[req]
    if ids is None:
        return None
    STATE[req][1] = i + n
    return (ids[i:] + ids[-1:] * n)[:n]

def _prefill(self, req, *piece):
    out = prefill(self, req, *piece)  # None until the prompt's last piece (chunked prefill)
    return out and ((take(req, 1) or [out[0]])[0], out[1])

def _read(p):
    rows = []
    for req, row in zip(p.reqs, read(p)):
        k = len(row) - 3  # a speculative step's row: k + 1 tokens, then accepted and drafted counts
        toks = take(req, k + 1)
        rows.append(row if toks is None else toks + [k, k])
    return rows

specdec.Engine.__init__, specdec.ModelRunner.prefill = _init, _prefill
specdec.ModelRunner.read = staticmethod(_read)
"""
ANSWERS = {
    "CASE-TOOLS": QWEN_ANSWER,
    "CASE-TEXT": "Some thinking\n</think>\n\nThe answer is 42.",
    "CASE-FORCED": "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
    "CASE-REQUIRED": "<tool_call>\n<function=run_code>\n<parameter=code>\nx = 1\n</parameter>\n</function>\n"
                     "</tool_call>",
    "CASE-BROKEN": "x</think>\n\n<tool_call>\n<function=bad name>\n</function></tool_call>",
}
MTP2 = '{"method":"mtp","num_speculative_tokens":2}'


@pytest.fixture(scope="module")
def srv_scripted(tiny_model, tmp_path_factory):
    s = Server(tiny_model, str(tmp_path_factory.mktemp("logs")), "--reasoning-parser", "qwen3",
               "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--speculative-config", MTP2,
               "--served-model-name", "tiny", "qwen", "--default-chat-template-kwargs", '{"preserve_thinking": true}',
               "--enable-log-requests", prelude=SCRIPT % (ANSWERS,))
    yield s
    s.stop()


def chat_both_ways(client, **kw):
    """A chat answered whole and streamed: (the whole message, its finish_reason, the streamed chunks summed)."""
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    got = {"reasoning": "", "content": "", "calls": [], "finish": [], "ids": {c.id for c in chunks}}
    for c in chunks[:-1]:
        d = c.choices[0].delta
        got["reasoning"] += getattr(d, "reasoning_content", None) or ""
        got["content"] += d.content or ""
        for t in d.tool_calls or []:
            if t.index == len(got["calls"]):
                got["calls"].append([t.function.name, ""])
            got["calls"][t.index][1] += t.function.arguments or ""
        got["finish"].append(c.choices[0].finish_reason)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0 and len(got["ids"]) == 1
    assert [f for f in got["finish"] if f] == [whole.finish_reason]
    return whole.message, whole.finish_reason, got


@pytest.mark.parametrize("parser", ["qwen3_coder", "hermes"])
def test_forced_tool_calls_hold_to_the_schema(tiny_spec, parser, capfd):
    """tool_choice named or "required" (server.forced_calls): xgrammar's structural tag of the parser's format as
    the request's grammar. A random model held to it writes a call the parser reads, with arguments of the schema's
    types (a boolean, one of an enum), greedy and sampled, and speculating (MTP k=2: the grammar's masks per
    draft position); required: a call of one of the tools first."""
    import server as srvmod
    mode = {"type": "function", "function": {"name": "set_mode", "parameters": {"type": "object", "required": [
        "on", "mode"], "properties": {"on": {"type": "boolean"}, "mode": {"type": "string", "enum": ["fast", "slow"]}}}}}
    ping = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
    app = types.SimpleNamespace(tool_parser_name=parser)
    llm = LLM(tiny_spec, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    for choice, tools in (("set_mode", [mode, ping]), ("required", [mode, ping])):
        so = srvmod.forced_calls(app, tools, choice, True)
        for t in (0.0, 1.0):
            o = llm.generate("Set it.", SamplingParams(temperature=t, seed=3, max_tokens=160,
                                                      structured_outputs=so), use_tqdm=False)[0].outputs[0]
            chat = srvmod.ChatStream(None, srvmod.TOOL_PARSERS[parser](tools))
            chat.feed(o.text, True)
            assert o.text.startswith("<tool_call>\n") and chat.calls, (choice, t, o.text)
            call = chat.calls[0]["function"]
            args = json.loads(call["arguments"])
            if choice == "set_mode":
                assert o.finish_reason == "stop" and len(chat.calls) == 1 and not (chat.content or "").strip()
            assert call["name"] in ("set_mode", "ping") and (call["name"] == "set_mode") == (args != {})
            if call["name"] == "set_mode":
                # (an XML call's string value keeps the whitespace around it, which its grammar allows)
                mode_value = args["mode"].strip() if parser == "qwen3_coder" else args["mode"]
                assert set(args) == {"on", "mode"} and isinstance(args["on"], bool) and mode_value in ("fast", "slow")
    assert "cannot accept" not in capfd.readouterr().err  # drafts the masks refuse never reach xgrammar's matcher
    with pytest.raises(srvmod.ApiError, match=r"held to by a grammar: Unsupported type \"nonsense\"$"):
        srvmod.forced_calls(app, [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "nonsense"}}}}}], "f", True)


def test_reasoning_and_tool_calls_through_the_server(srv_scripted):
    """--reasoning-parser qwen3 --tool-call-parser qwen3_coder, with three tokens a step: whole and streamed
    (name first, then the arguments), tool history, tool messages and the developer role in the request;
    parallel_tool_calls false keeps the first of two calls; an answer held to a grammar comes without thinking
    (before, the grammar held the reasoning, and the content was null)."""
    import openai
    client = openai.OpenAI(base_url=srv_scripted.url + "/v1", api_key="unused")
    history = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Weather? CASE-TOOLS"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c0", "content": "cold"}, {"role": "user", "content": "CASE-TOOLS"}]
    msg, finish, got = chat_both_ways(client, model="qwen", messages=history, tools=TOOLS, max_tokens=1000)
    want = [(c[0], c[1]) for c in PARSER_CASES[0][5]]
    assert finish == "tool_calls" and [(c.function.name, c.function.arguments) for c in msg.tool_calls] == want
    assert msg.reasoning_content == msg.reasoning == PARSER_CASES[0][3] and msg.content == "\n\nI will check.\n\n"
    assert (got["reasoning"], got["content"], [tuple(c) for c in got["calls"]]) == \
        (msg.reasoning_content, msg.content, want)
    msg, finish, got = chat_both_ways(client, model="qwen", messages=history, tools=TOOLS, max_tokens=1000,
                                      parallel_tool_calls=False)                 # vLLM: the first call only
    assert finish == "tool_calls" and [(c.function.name, c.function.arguments) for c in msg.tool_calls] == want[:1]
    assert [tuple(c) for c in got["calls"]] == want[:1] and msg.content == got["content"] == "\n\nI will check.\n\n"
    text = [{"role": "user", "content": "CASE-TEXT"}]
    msg, finish, got = chat_both_ways(client, model="tiny", messages=text, max_tokens=100)
    assert (msg.reasoning_content, msg.content, finish) == ("Some thinking\n", "\n\nThe answer is 42.", "stop")
    assert (got["reasoning"], got["content"]) == ("Some thinking\n", "\n\nThe answer is 42.")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    msg, _, got = chat_both_ways(client, model="tiny", messages=text, max_tokens=100, extra_body=off)
    assert msg.reasoning_content is None and msg.content == got["content"] == ANSWERS["CASE-TEXT"]
    for held in ({"guided_choice": ["yes", "no"]}, {"response_format": {"type": "json_object"}}):
        msg, finish, got = chat_both_ways(client, model="tiny", messages=[{"role": "user", "content": "pick"}],
                                          max_tokens=40, temperature=0, extra_body=held)
        assert not msg.reasoning_content and msg.content == got["content"], msg        # held answers: no thinking
        assert msg.content in ("yes", "no") if "guided_choice" in held else msg.content[:1] in ("{", "["), msg
    msg, finish, _ = chat_both_ways(client, model="tiny", messages=[{"role": "user", "content": "CASE-BROKEN"}],
                                    tools=TOOLS, max_tokens=100)
    assert not msg.tool_calls and finish == "stop" and "<function=bad name>" in msg.content
    msg, finish, got = chat_both_ways(client, model="tiny", messages=[{"role": "user", "content": "CASE-FORCED"}],
                                      tools=TOOLS, max_tokens=100,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("get_weather", '{"city": "Rome"}')]
    assert got["calls"] == [["get_weather", '{"city": "Rome"}']] and finish == "stop"  # vLLM: named calls "stop"
    msg, finish, got = chat_both_ways(client, model="tiny", messages=[{"role": "user", "content": "CASE-REQUIRED"}],
                                      tools=TOOLS, max_tokens=100, tool_choice="required")
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("run_code", '{"code": "x = 1"}')]
    assert got["calls"] == [["run_code", '{"code": "x = 1"}']] and finish == "tool_calls" and not msg.content
    assert [m.id for m in client.models.list().data] == ["tiny", "qwen"]  # every --served-model-name
    n_prompt = lambda **kw: srv_scripted.post("/tokenize", {"model": "tiny", "messages": text, **kw})[1]["count"]
    assert n_prompt(tools=TOOLS) > n_prompt() > 0
    log = open(srv_scripted.log).read()  # --enable-log-requests; --default-chat-template-kwargs preserve_thinking
    assert "Received request chatcmpl-" in log and "assistant\\n<think>\\n\\n</think>\\n\\n<tool_call>" in log
    assert "reasoning parser: qwen3; tool-call parser: qwen3_coder (auto tool choice)" in log


def test_responses_api(srv_scripted):
    """POST /v1/responses through the official client (its types parse every object and event): the answer as
    output items (reasoning, message with output_text, function_call) that say what the same chat request says,
    whole and streamed (deltas adding up to the items, sequence numbers in order, response.completed last);
    instructions and function-call history as input items; max_output_tokens cutting it short; the usage's
    reasoning tokens; vLLM's stateless refusals (background, previous_response_id) and malformed input as 400s
    naming the field."""
    import openai
    client = openai.OpenAI(base_url=srv_scripted.url + "/v1", api_key="unused")
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]

    def both_ways(**kw):
        whole = client.responses.create(model="tiny", **kw)
        events = list(client.responses.create(model="tiny", stream=True, **kw))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
        assert events[-1].type == "response.completed" and whole.id.startswith("resp_")
        final = events[-1].response
        assert [(o.type, o.model_dump(exclude={"id", "call_id"})) for o in final.output] == \
            [(o.type, o.model_dump(exclude={"id", "call_id"})) for o in whole.output]
        summed = {"reasoning": "", "text": "", "arguments": ""}
        for e in events:
            kind = {"response.reasoning_text.delta": "reasoning", "response.output_text.delta": "text",
                    "response.function_call_arguments.delta": "arguments"}.get(e.type)
            if kind:
                summed[kind] += e.delta
        return whole, summed, [e.type for e in events]

    r, summed, types = both_ways(input="CASE-TEXT", max_output_tokens=100)
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.status == "completed"
    assert r.output[0].content[0].text == summed["reasoning"] == "Some thinking\n"
    assert r.output_text == summed["text"] == "\n\nThe answer is 42."
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the tokens of "Some thinking\n", before </think> (vLLM's count_reasoning_tokens; it was always 0)
    thinking = srv_scripted.post("/tokenize", {"model": "tiny", "prompt": "Some thinking\n"})[1]["count"]
    assert r.usage.output_tokens_details.reasoning_tokens == thinking > 0
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 2
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "CASE-TEXT"}],
                                          max_tokens=100).choices[0].message
    assert (chat.reasoning_content, chat.content) == (r.output[0].content[0].text, r.output_text)
    r, summed, _ = both_ways(input="CASE-TOOLS", tools=tools, max_output_tokens=1000)
    calls = [(o.name, o.arguments) for o in r.output if o.type == "function_call"]
    assert calls == [(c[0], c[1]) for c in PARSER_CASES[0][5]] and summed["arguments"] == "".join(a for _, a in calls)
    assert [o.type for o in r.output][:2] == ["reasoning", "message"] and r.output_text == "\n\nI will check.\n\n"
    history = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
               {"type": "function_call", "call_id": "c0", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
               {"type": "function_call_output", "call_id": "c0", "output": "cold"},
               {"role": "user", "content": "CASE-TEXT"}]
    r = client.responses.create(model="tiny", input=history, instructions="Be brief.", tools=tools,
                                max_output_tokens=100)
    assert r.output_text == "\n\nThe answer is 42." and r.instructions == "Be brief."
    with_history = r.usage.input_tokens
    assert with_history > client.responses.create(model="tiny", input="CASE-TEXT").usage.input_tokens
    r = client.responses.create(model="tiny", input="CASE-TEXT", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    for fields, param, fragment in [({"background": True}, "background", "background mode needs stored responses"),
                                    ({"previous_response_id": "resp_1"}, "previous_response_id", "send the conversation"),
                                    ({"input": []}, "input", "'input' must be a string or a non-empty list"),
                                    ({"input": [{"type": "web_search_call"}]}, "input", "not supported"),
                                    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input",
                                     "images and files are not supported"),
                                    ({"tools": [{"type": "web_search"}]}, "tools", "built-in tools are not supported"),
                                    ({"instructions": 5}, "instructions", "'instructions' must be a string"),
                                    # the chat path's checks name this request's fields (chat's before session 34)
                                    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
                                    ({"input": [{"role": "robot", "content": "x"}]}, "input", "role"),
                                    ({"text": {"format": {"type": "xml"}}}, "text.format", "is not supported")]:
        status, body = srv_scripted.post("/v1/responses", {"model": "tiny", "input": "CASE-TEXT", **fields})
        check_error(status, body, 400, param, fragment)



def test_responses_reasoning_items_join_their_turn(srv_scripted):
    """A Responses input's reasoning item is the reasoning of the assistant turn it opens, which the calls (or the
    answer) after it join, as vLLM builds it: a tool loop's prompt is then the chat's for the same turns, where
    the template shows that reasoning (after the last user message); before, the item was dropped."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    user, result = {"role": "user", "content": "weather?"}, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    items = [user, {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "SECRET REASON"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    turns = [user, {"role": "assistant", "content": None, "reasoning_content": "SECRET REASON", "tool_calls": [call]},
             result]
    count = lambda msgs: srv_scripted.post("/tokenize", {"model": "tiny", "messages": msgs})[1]["count"]  # noqa: E731
    st, r = srv_scripted.post("/v1/responses", {"model": "tiny", "input": items, "max_output_tokens": 1})
    assert st == 200 and r["usage"]["input_tokens"] == count(turns)
    assert count(turns) > count([user, {"role": "assistant", "content": None, "tool_calls": [call]}, result])
    answered = [user, items[1], {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "ok"}]
    st, r = srv_scripted.post("/v1/responses", {"model": "tiny", "input": answered, "max_output_tokens": 1})
    assert st == 200 and r["usage"]["input_tokens"] == count(
        [user, {"role": "assistant", "content": "It is sunny.", "reasoning_content": "SECRET REASON"}, answered[3]])


def test_responses_pass_vllm_sampling_fields(srv):
    """vLLM's Responses request takes structured_outputs and include_stop_str_in_output as its chat does (they were
    ignored: the answer was free text), and truncation only as "auto" (the input's last max_model_len tokens) or
    "disabled"."""
    body = {"model": "tiny", "input": "yes or no?", "max_output_tokens": 4, "temperature": 0}
    st, r = srv.post("/v1/responses", dict(body, structured_outputs={"choice": ["yes", "no"]}))
    assert st == 200 and r["output"][-1]["content"][0]["text"] in ("yes", "no")
    assert srv.post("/v1/responses", dict(body, truncation="auto"))[0] == 200
    st, r = srv.post("/v1/responses", dict(body, truncation="sometimes"))
    check_error(st, r, 400, "truncation", "'truncation' must be \"auto\" or \"disabled\"")

def test_forced_calls_without_a_parser_are_json(tiny_spec, srv):
    """tool_choice named or "required" on a server without --tool-call-parser, as vLLM serves them (before: a 400
    asking for a parser): the answer held to JSON (server.json_calls: a named function's arguments under its
    schema; required's array of {name, parameters}) and read back as tool_calls (server.JsonCalls), a named call's
    arguments streamed as they come, required's calls once its array is whole; finish_reason "stop" for a named
    call, "tool_calls" for required; content "" (vLLM's message)."""
    import server as srvmod
    mode = {"type": "function", "function": {"name": "set_mode", "parameters": {"type": "object", "required": [
        "on", "mode"], "properties": {"on": {"type": "boolean"}, "mode": {"type": "string", "enum": ["fast", "slow"]}}}}}
    ping = {"type": "function", "function": {"name": "ping"}}
    assert srvmod.json_calls([mode, ping], "ping") is None  # a tool without parameters: not held (vLLM)
    named = srvmod.json_calls([mode, ping], "set_mode")
    assert named.json == mode["function"]["parameters"]
    required = srvmod.json_calls([mode, ping], "required").json
    assert required["type"] == "array" and required["minItems"] == 1
    assert [o["properties"]["name"]["enum"] for o in required["items"]["anyOf"]] == [["set_mode"], ["ping"]]
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    # the parser: a named call's arguments grow with the text; required's array is read once whole
    chat = srvmod.ChatStream(None, srvmod.JsonCalls("set_mode"))
    first = chat.feed('{"on": tr', False)["tool_calls"][0]
    assert first["function"] == {"name": "set_mode", "arguments": '{"on": tr'} and first["id"].startswith(
        "chatcmpl-tool-")
    assert chat.feed('{"on": true}', True) == {"tool_calls": [{"index": 0, "function": {"arguments": "ue}"}}]}
    chat = srvmod.ChatStream(None, srvmod.JsonCalls("required"))
    assert chat.feed('[{"name": "ping", "parameters": {}}, {"name": "set_mode", "param', False) == {}
    chat.feed('[{"name": "ping", "parameters": {}}, {"name": "set_mode", "parameters": {"on": false, '
              '"mode": "café"}}]', True)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in chat.calls] == [
        ("ping", "{}"), ("set_mode", '{"on": false, "mode": "café"}')]
    cut = srvmod.ChatStream(None, srvmod.JsonCalls("required"))
    assert cut.feed('[{"name": "set_mo', True) == {"content": '[{"name": "set_mo'} and not cut.calls  # max_tokens
    # a random model held to the grammar writes calls the parser reads (its whitespace held to none here, so
    # that it ends: vLLM's grammar allows any, which a random model may spend max_tokens on)
    llm = LLM(tiny_spec, device="cpu")
    for choice in ("set_mode", "required"):
        so = dataclasses.replace(srvmod.json_calls([mode, ping], choice), disable_any_whitespace=True)
        for t in (0.0, 1.0):
            o = llm.generate("Set it.", SamplingParams(temperature=t, seed=3, max_tokens=200,
                                                      structured_outputs=so), use_tqdm=False)[0].outputs[0]
            chat = srvmod.ChatStream(None, srvmod.JsonCalls(choice))
            chat.feed(o.text, True)
            assert o.finish_reason == "stop" and chat.calls and not chat.content, (choice, t, o.text)
            for call in chat.calls:
                args = json.loads(call["function"]["arguments"])
                if call["function"]["name"] == "set_mode":
                    assert set(args) == {"on", "mode"} and isinstance(args["on"], bool) and args["mode"] in (
                        "fast", "slow")
                else:
                    assert call["function"]["name"] == "ping" and choice == "required"
    # through the server (no --tool-call-parser): the message and the stream's pieces agree
    body = {"messages": CHAT, "tools": [mode, ping], "max_tokens": 12, "temperature": 0}
    for choice, finish in (({"type": "function", "function": {"name": "set_mode"}}, "stop"), ("required", None)):
        st, r = srv.post("/v1/chat/completions", dict(body, tool_choice=choice))
        msg = r["choices"][0]["message"]
        assert st == 200 and (msg["content"] == "" if msg["tool_calls"] else  # (12 tokens may cut required's
                              r["choices"][0]["finish_reason"] == "length" and msg["content"][:1] == "["), r  # array)
        if choice != "required":
            assert msg["content"] == ""
            assert [c["function"]["name"] for c in msg["tool_calls"]] == ["set_mode"]
            assert msg["tool_calls"][0]["function"]["arguments"].startswith("{")
            assert r["choices"][0]["finish_reason"] in (finish, "length")
            status, _, data = srv.request("POST", "/v1/chat/completions", dict(body, tool_choice=choice,
                                                                               stream=True))
            pieces = [t["function"].get("arguments", "") for e in sse_events(data) if e["choices"]
                      for t in e["choices"][0]["delta"].get("tool_calls", [])]
            assert status == 200 and "".join(pieces) == msg["tool_calls"][0]["function"]["arguments"]


def test_stream_usage_request_ids_and_refusals(srv):
    """vLLM's stream_options: include_usage defaults to true once stream_options is given ({} sends the usage chunk;
    before, none), null or false sends none; continuous_usage_stats gives each chunk its own choice's tokens so far
    (before: the earlier choices' counted in). The response id is cmpl- / chatcmpl- and the X-Request-Id header,
    else the body's request_id (vLLM's _base_request_id). priority other than 0 and use_beam_search are refused as
    vLLM refuses them without priority scheduling / as unsupported (they were ignored); allowed_token_ids are kept
    once each; an unknown structured_outputs key is named in one line."""
    body = {"prompt": "a b", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True}
    for opts, last in (({}, 3), ({"include_usage": None}, None), ({"include_usage": False}, None)):
        status, _, data = srv.request("POST", "/v1/completions", dict(body, stream_options=opts))
        usage = [e["usage"] for e in sse_events(data) if e.get("usage")]
        assert status == 200 and [u["completion_tokens"] for u in usage] == ([] if last is None else [last]), opts
    status, _, data = srv.request("POST", "/v1/completions", dict(body, n=2, temperature=1.0, seed=1, stream_options={
        "continuous_usage_stats": True}))
    events = sse_events(data)
    per_choice = {}
    for e in events[:-1]:  # each chunk: its own choice's tokens so far (choice 1's used to start at choice 0's 3)
        i = e["choices"][0]["index"]
        assert per_choice.get(i, 0) < e["usage"]["completion_tokens"] <= 3
        per_choice[i] = e["usage"]["completion_tokens"]
    assert per_choice == {0: 3, 1: 3} and events[-1]["usage"]["completion_tokens"] == 6
    chat = {"messages": CHAT, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    status, _, data = srv.request("POST", "/v1/chat/completions", dict(chat, stream=True, stream_options={}))
    assert status == 200 and sse_events(data)[-1]["usage"]["completion_tokens"] == 2
    status, _, data = srv.request("POST", "/v1/completions", dict(body, stream=False), headers={"X-Request-Id": "r-7"})
    assert status == 200 and json.loads(data)["id"] == "cmpl-r-7"
    st, r = srv.post("/v1/chat/completions", dict(chat, request_id="mine"))
    assert st == 200 and r["id"] == "chatcmpl-mine"
    status, _, data = srv.request("POST", "/v1/chat/completions", dict(chat, request_id="mine", stream=True),
                                  headers={"X-Request-Id": "hdr"})
    assert {e["id"] for e in sse_events(data)} == {"chatcmpl-hdr"}
    check_error(*srv.post("/v1/completions", dict(body, stream=False, priority=3)), 400, "priority",
                "Got priority 3 but Priority scheduling is not enabled.")
    assert srv.post("/v1/completions", dict(body, stream=False, priority=0))[0] == 200
    check_error(*srv.post("/v1/chat/completions", dict(chat, use_beam_search=True)), 400, "use_beam_search",
                "not supported")
    # allowed_token_ids: each id once (the engine builds its mask from the list every step)
    import server as srvmod
    app = types.SimpleNamespace(tokenizer=None, vocab=1024, llm=types.SimpleNamespace(default_sampling={}, max_model_len=64,
                                                                                  max_logprobs=20))
    params = srvmod.parse_completion(app, {"prompt": [1, 2], "allowed_token_ids": [5, 3, 5] * 1000})[1]
    assert params.allowed_token_ids == [3, 5]
    # structured_outputs: vLLM's disable_fallback accepted (one backend here); a key specdec lacks named, in one
    # line (it was Python's "__init__() got an unexpected keyword argument")
    assert srv.post("/v1/completions", dict(body, stream=False, structured_outputs={
        "choice": ["a", "b"], "disable_fallback": True}))[0] == 200
    st, r = srv.post("/v1/completions", dict(body, stream=False, structured_outputs={
        "json": {"type": "object"}, "whitespace_pattern": " "}))
    check_error(st, r, 400, "structured_outputs", 'structured_outputs: "whitespace_pattern" is not supported')
    assert "__init__" not in r["error"]["message"]


def test_echo_without_generation_and_invocations(srv):
    """Completions' echo with max_tokens 0 (vLLM: scoring a text) answers the prompt alone: its text, its tokens'
    logprobs, finish_reason "length" and one completion token counted (vLLM makes one and drops it); streamed, the
    same text; max_tokens 0 without echo stays vLLM's 400. POST /invocations (SageMaker's) takes a chat request or a
    completion by its fields, as vLLM routes it."""
    body = {"prompt": "def fib(n):", "max_tokens": 0, "echo": True, "temperature": 0}
    st, r = srv.post("/v1/completions", dict(body, logprobs=1))
    c = r["choices"][0]
    n_prompt = r["usage"]["prompt_tokens"]
    assert st == 200 and c["text"] == "def fib(n):" and c["finish_reason"] == "length"
    assert len(c["logprobs"]["tokens"]) == n_prompt and "".join(c["logprobs"]["tokens"]) == "def fib(n):"
    assert c["logprobs"]["token_logprobs"][0] is None and r["usage"]["completion_tokens"] == 1
    status, _, data = srv.request("POST", "/v1/completions", dict(body, stream=True))
    assert status == 200 and "".join(e["choices"][0]["text"] for e in sse_events(data)) == "def fib(n):"
    check_error(*srv.post("/v1/completions", dict(body, echo=False)), 400, "max_tokens",
                "max_tokens must be at least 1")
    st, r = srv.post("/invocations", {"prompt": "a", "max_tokens": 2})
    assert st == 200 and r["object"] == "text_completion"
    st, r = srv.post("/invocations", {"messages": CHAT, "max_tokens": 2})
    assert st == 200 and r["object"] == "chat.completion"
    check_error(*srv.post("/invocations", {"input": "x"}), 400, None, "Cannot find suitable handler for request")


def test_return_token_ids(srv):
    """vLLM's return_token_ids (RL frameworks read the tokens, not the text): completions' choices carry the
    answer's token_ids and the prompt_token_ids, chat's choices the token_ids and the response the
    prompt_token_ids; streamed, each chunk the ids it brings and the first the prompt's (it was ignored). The ids
    are the text's: /detokenize gives it back. return_tokens_as_token_ids names the logprobs' tokens "token_id:N"."""
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    st, r = srv.post("/v1/completions", body)
    c = r["choices"][0]
    assert st == 200 and c["prompt_token_ids"] == [5, 6, 7] and len(c["token_ids"]) == 6
    assert srv.post("/detokenize", {"tokens": c["token_ids"]})[1]["prompt"] == c["text"]
    status, _, data = srv.request("POST", "/v1/completions", dict(body, stream=True))
    events = sse_events(data)
    assert events[0]["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == c["token_ids"]
    assert "token_ids" not in srv.post("/v1/completions", dict(body, return_token_ids=False))[1]["choices"][0]
    # return_tokens_as_token_ids: the logprobs' tokens as "token_id:N" (vLLM), on both endpoints
    lp = srv.post("/v1/completions", dict(body, logprobs=1, return_tokens_as_token_ids=True))[1]["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(k.startswith("token_id:") for d in lp["top_logprobs"] for k in d)
    st, r = srv.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "temperature": 0, "logprobs": True,
                                              "top_logprobs": 1, "return_tokens_as_token_ids": True})
    entry = r["choices"][0]["logprobs"]["content"][0]
    assert entry["token"].startswith("token_id:") and bytes(entry["bytes"]).decode() == entry["token"]
    chat = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    st, r = srv.post("/v1/chat/completions", chat)
    assert st == 200 and len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"]
    ids = r["choices"][0]["token_ids"]
    assert len(ids) == 5 and srv.post("/detokenize", {"tokens": ids})[1]["prompt"] == r["choices"][0]["message"]["content"]
    status, _, data = srv.request("POST", "/v1/chat/completions", dict(chat, stream=True))
    events = sse_events(data)
    assert events[0]["prompt_token_ids"] == r["prompt_token_ids"]
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == ids


def test_values_pydantic_converts(srv):
    """vLLM's request models read JSON in pydantic's lax mode, so a vLLM client may send 2.0 or "2" for an integer,
    "0" for a number, 1 or "true" for a boolean: the same answer as the exact types (they were 400s); what
    pydantic refuses (2.5 for an integer, "hot" for a number) stays a 400 (the BAD corpus)."""
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 1, "seed": 3}
    want = srv.post("/v1/completions", body)[1]["choices"][0]
    for loose in ({"max_tokens": 4.0}, {"max_tokens": "4"}, {"temperature": "0"}, {"logprobs": True},
                  {"ignore_eos": "true"}, {"ignore_eos": 1}, {"seed": "3"}, {"n": 1.0}):
        st, r = srv.post("/v1/completions", dict(body, **loose))
        assert st == 200 and r["choices"][0]["text"] == want["text"], (loose, r)
        assert r["choices"][0]["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    st, r = srv.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "logprobs": 1, "top_logprobs": "2"})
    assert st == 200 and len(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


def test_cors_as_vllm(srv):
    """vLLM's CORS (Starlette's middleware, --allowed-origins / --allowed-methods / --allowed-headers /
    --allow-credentials, default ["*"]): a browser's preflight gets 200 "OK" with the allowed methods and the
    headers it asked for, before the route's method check (it was 405); an answer to a request with an Origin
    says Access-Control-Allow-Origin; one without says nothing. Named origins and credentials: the origin itself
    and Vary, and a preflight from elsewhere is "Disallowed CORS origin"."""
    import server as srvmod
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type, authorization"}
    status, headers, data = srv.request("OPTIONS", "/v1/chat/completions", headers=pre)
    assert status == 200 and data == b"OK" and headers["Access-Control-Allow-Origin"] == "*"
    assert headers["Access-Control-Allow-Headers"] == "content-type, authorization"
    assert "POST" in headers["Access-Control-Allow-Methods"] and headers["Access-Control-Max-Age"] == "600"
    status, headers, _ = srv.request("GET", "/v1/models", headers={"Origin": "http://app.example"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    assert "Access-Control-Allow-Origin" not in srv.request("GET", "/v1/models")[1]
    assert srv.request("OPTIONS", "/v1/models")[0] == 405  # no preflight: the route's methods, as before
    named = srvmod.Cors(["http://app.example"], ["GET", "POST"], ["content-type"], True)
    assert named.origin_headers("http://app.example") == {"Access-Control-Allow-Origin": "http://app.example",
                                                          "Vary": "Origin", "Access-Control-Allow-Credentials": "true"}
    assert named.origin_headers("http://evil.example") == {}
    assert named.preflight("http://app.example", "POST", "Content-Type")[:2] == (200, b"OK")
    assert named.preflight("http://evil.example", "PUT", "x-other")[:2] == (400, b"Disallowed CORS origin, method, headers")
    ap = srvmod.build_parser()
    a = ap.parse_args(["--allowed-origins", '["http://a"]', "--allow-credentials"])
    assert a.allowed_origins == ["http://a"] and a.allowed_methods == ["*"] and a.allow_credentials
    with pytest.raises(SystemExit):
        ap.parse_args(["--allowed-origins", "http://a"])  # not a JSON list


def test_tool_request_errors(srv, srv_scripted):
    """vLLM's refusals, as 400s that name the field."""
    body = {"messages": CHAT, "tools": TOOLS, "max_tokens": 2}
    for server, fields, param, fragment in [
            (srv, {}, "tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
            (srv_scripted, {"tools": None, "tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
            (srv_scripted, {"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
             "does not match any of the specified `tools`"),
            (srv_scripted, {"tool_choice": "sometimes"}, "tool_choice", "Invalid value for `tool_choice`"),
            (srv_scripted, {"tools": [{"type": "function"}]}, "tools", "'tools' must be a list"),
            (srv_scripted, {"messages": [{"role": "robot", "content": "x"}]}, "messages", "'role' must be one of"),
            (srv_scripted, {"messages": [*CHAT, {"role": "assistant", "tool_calls": [
                {"function": {"name": "f", "arguments": "{not json"}}]}, *CHAT]}, "messages", "not valid JSON"),
            (srv_scripted, {"chat_template": "{{ 1 }}"}, "chat_template", "untrusted chat template")]:
        status, r = server.post("/v1/chat/completions", {**body, **fields})
        check_error(status, r, 400, param, fragment)
    assert srv.post("/v1/chat/completions", {**body, "tool_choice": "none"})[0] == 200


def test_the_recipe_command_line(tmp_path):
    """The acceptance recipe, as typed: `python server.py models/toy --served-model-name toy --max-model-len 2048
    --gpu-memory-utilization 0.9 --reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser qwen3_coder
    --speculative-config ...`; the official client's tool and streaming calls come back well formed; the
    endpoints scripts use; vLLM's metrics and its periodic SpecDecoding line."""
    import openai
    cmd = ["models/toy", "--served-model-name", "toy", "--max-model-len", "2048", "--gpu-memory-utilization", "0.9",
           "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
           "--speculative-config", MTP2]
    s = Server(None, str(tmp_path), command=cmd, env={"VLLM_LOG_STATS_INTERVAL": "0.2"})
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused")
        kw = dict(model="toy", messages=[{"role": "user", "content": "def fib(n):"}], tools=TOOLS, temperature=0,
                  max_completion_tokens=24)
        before = s.metrics()
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        assert r.object == "chat.completion" and c.message.role == "assistant" and r.usage.completion_tokens <= 24
        assert c.finish_reason in ("stop", "length", "tool_calls") and isinstance(c.message.tool_calls, list)
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens > 0
        summed = "".join((getattr(ch.choices[0].delta, "reasoning_content", None) or "") +
                         (ch.choices[0].delta.content or "") for ch in chunks if ch.choices)
        assert summed == (c.message.reasoning_content or "") + (c.message.content or "")
        after = wait_idle(s)
        d = lambda name: metric(after, name) - metric(before, name)  # noqa: E731
        for name in ("request_queue_time", "request_prefill_time", "request_decode_time", "request_inference_time"):
            assert d(f"vllm:{name}_seconds_count") == 2 and metric(after, f"vllm:{name}_seconds_bucket", le="7680.0")
        assert metric(after, "vllm:kv_cache_usage_perc") == 0  # idle: no slot in use
        assert json.loads(s.request("GET", "/version")[2])["version"]
        assert s.request("GET", "/ping")[0] == s.request("POST", "/ping")[0] == 200
        ids = s.post("/tokenize", {"model": "toy", "prompt": "def fib(n):", "return_token_strs": True})[1]
        assert ids["count"] == len(ids["tokens"]) == len(ids["token_strs"]) > 0 and ids["max_model_len"] == 2048
        assert s.post("/detokenize", {"model": "toy", "tokens": ids["tokens"]})[1] == {"prompt": "def fib(n):"}
        check_error(*s.post("/detokenize", {"tokens": [10 ** 9]}), 400, "tokens", "out of range")
        time.sleep(0.5)
    finally:
        s.stop()
    log = open(s.log).read()
    assert "max_model_len 2048 (--max-model-len)" in log and "of system memory available" in log
    assert re.search(r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ "
                     r"tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: [\d.]+%", log), log
    assert re.search(r"SpecDecoding metrics: Mean acceptance length: [\d.]+, Accepted throughput: [\d.]+ tokens/s, "
                     r"Drafted throughput: [\d.]+ tokens/s, Accepted: \d+ tokens, Drafted: \d+ tokens, Per-position "
                     r"acceptance rate: [\d.]+, [\d.]+, Avg Draft acceptance rate: [\d.]+%", log), log


def test_server_stats_log(capsys):
    """server.StatsLog, vLLM's periodic lines: nothing before the interval ends; then the interval's prompt and
    generation throughput, the running / waiting requests and KV usage now, and the interval's spec-decode counts
    with their throughputs; an idle interval right after a busy one still prints its zeros, the next one nothing."""
    m, stats = srvmod.Metrics("m", 2), sd.SpecStats()
    log = srvmod.StatsLog(10.0)
    # t0 an integer: then t0 + 30 - (t0 + 20) is 10 exactly; from a monotonic reading such as 4070.6331104378664 it
    # rounds below 10, the interval, and that tick printed nothing (a flaky failure, seen once in session 50's suite)
    log.t = t0 = 1000.0
    m.prompt_tokens, m.generation_tokens, m.running, m.waiting, m.kv_usage = 100, 50, 2, 1, 0.25
    stats.add(2, 2), stats.add(2, 1), stats.add(2, 0), stats.add(2, 1)
    log.tick(m, stats, t0 + 5)
    assert capsys.readouterr().err == ""
    log.tick(m, stats, t0 + 10)
    assert capsys.readouterr().err.splitlines() == [
        "Engine 000: Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 2 reqs, "
        "Waiting: 1 reqs, GPU KV cache usage: 25.0%, Prefix cache hit rate: 0.0%",
        "SpecDecoding metrics: Mean acceptance length: 2.00, Accepted throughput: 0.40 tokens/s, Drafted throughput: "
        "0.80 tokens/s, Accepted: 4 tokens, Drafted: 8 tokens, Per-position acceptance rate: 0.750, 0.250, Avg Draft "
        "acceptance rate: 50.0%"]
    m.generation_tokens += 20
    stats.add(2, 2)
    log.tick(m, stats, t0 + 20)                                       # only this interval's counts
    assert capsys.readouterr().err.splitlines()[1].startswith("SpecDecoding metrics: Mean acceptance length: 3.00, "
                                                              "Accepted throughput: 0.20 tokens/s")
    m.running = m.waiting = 0
    log.tick(m, stats, t0 + 30)
    assert capsys.readouterr().err.splitlines() == [
        "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, "
        "Waiting: 0 reqs, GPU KV cache usage: 25.0%, Prefix cache hit rate: 0.0%"]
    log.tick(m, stats, t0 + 40)
    assert capsys.readouterr().err == ""


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="write a tiny random Qwen3.6 checkpoint (published layout)")
    ap.add_argument("cmd", choices=["make-tiny"])
    ap.add_argument("dir")
    ap.add_argument("--moe", action="store_true")
    a = ap.parse_args()
    print(write_tiny_checkpoint(a.dir, moe=a.moe))


# ----------------------------------------------------------------------------------------------
# The CPU fast path (kernels.CPU_FAST): what runs on a CPU, against the references it replaces
# ----------------------------------------------------------------------------------------------

@pytest.fixture
def one_thread():
    """One intra-op thread, as ModelRunner runs a CPU engine, then the count before back: what an earlier test
    left set must not decide a test's result."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("path", ["fp16", "dnn", "dnn padded", "dnn rows alone", "bmm"])
@pytest.mark.parametrize("N,Kin", [(8256, 256), (2048, 256), (256, 1024), (1352, 256), (1536, 256),
                                   (256, 256), (512, 256), (4, 256), (1, 256), (1, 512), (256, 512),
                                   (776, 256)])
def test_cpu_linear_row_invariant(N, Kin, path, monkeypatch, one_thread):
    """The CPU linear, every way it runs (oneDNN's GEMM with one call per step where _dnn_rows passes on this
    CPU, or one 1-row call per row where it fails; steps of 1-3 rows padded to 4 with zero rows
    (kernels.CPU_PADDED); without oneDNN one batched call, every row its own (1, in) @ (in, out) product; a weight of
    bf16 values through FBGEMM's fp16-weight GEMM, every call of it counted): a row
    alone == the row in steps of 2 .. 40 rows at any offset, bit for bit (the toy's shapes and some odd ones;
    F.linear's GEMM fails this on this CPU: M = 1, 2-3 and >= 4 round differently), and == F.linear within fp32;
    padded, a row alone has the bits of its unpadded 1-row call. At one thread, the engine's: at two the bmm
    path's rows round differently on session 18's Xeon, which the test saw only when run without the tests that
    set one first."""
    monkeypatch.setattr(K, "CPU_PADDED", frozenset())
    if path == "dnn rows alone":
        monkeypatch.setattr(K, "_dnn_rows", lambda w, M, dtype=None: False)
    if path == "bmm":
        monkeypatch.setattr(K, "_dnn_ok", lambda w: False)
    g = torch.Generator().manual_seed(N + Kin)
    w, x = torch.randn(N, Kin, generator=g), torch.randn(48, Kin, generator=g)
    fp16_calls = []
    real_fp16 = K._fp16
    monkeypatch.setattr(K, "_fp16", lambda rows, wp: fp16_calls.append(rows.shape[0]) or real_fp16(rows, wp))
    if path == "fp16":
        w = w.bfloat16().float()                                                  # a bf16 checkpoint's values
    alone = torch.cat([K._linear_cpu(x[i:i + 1], w) for i in range(48)])
    assert bool(fp16_calls) == (path == "fp16" and K._fp16_gemm_here())          # (fp32 weights: not fp16s)
    if path == "dnn padded":
        pads = K._dnn_rows(w, 4)                 # does a 4-row call give each row its bits? (its check's calls first)
        shapes = []
        real = K._dnn
        monkeypatch.setattr(K, "_dnn", lambda rows, wp: shapes.append(rows.shape[0]) or real(rows, wp))
        monkeypatch.setattr(K, "CPU_PADDED", frozenset({1, 2, 3}))
        assert torch.equal(torch.cat([K._linear_cpu(x[i:i + 1], w) for i in range(48)]), alone)
        assert torch.equal(K._linear_cpu(x[5:8], w), alone[5:8])
        assert set(shapes) == {4} if pads else 4 not in shapes                    # padded: every call 4 rows
    for M in (2, 3, 4, 5, 8, 9, 13, 16, 17, 40):
        for s in (0, 3, 8 - (M % 8)):
            assert torch.equal(K._linear_cpu(x[s:s + M], w), alone[s:s + M]), (M, s)
    assert torch.equal(K._linear_cpu(x[:6].view(2, 3, Kin), w).view(6, N), alone[:6])     # [B, T, in]
    assert torch.allclose(alone, F.linear(x, w), rtol=1e-5, atol=1e-4)
    w2 = w.clone()
    K._linear_cpu(x[:1], w2)
    w2.mul_(2)                                                                    # written in place: a fresh w^T
    assert torch.equal(K._linear_cpu(x[:1], w2), K._linear_cpu(x[:1], w2.clone()))


def test_cpu_token_steps_keep_rows_alone_at_any_size(tiny_spec, monkeypatch):
    """The target's decode and verify steps keep each row's 1-row bits however many rows they have
    (kernels.token_steps); other CPU steps of more than CPU_MKL_ROWS rows (prefill chunks) take F.linear. Here the
    limit is 0 and F.linear a stand-in whose row r gets r * 1e-3 added (MKL's rows depend on the call's size too, by
    rounding): greedy MTP k=3 over five prompts at once (20-row verifies) equals plain decoding (5-row steps)
    token for token, and the stand-in did run (the prompts' prefills, the drafts)."""
    real = F.linear
    sizes = []

    def skewed(x, w, b=None):
        y = real(x, w, b)
        rows = y.reshape(-1, y.shape[-1])
        sizes.append(rows.shape[0])
        return (rows + torch.arange(rows.shape[0], dtype=y.dtype)[:, None] * 1e-3).view(y.shape)
    monkeypatch.setattr(K, "CPU_MKL_ROWS", 0)
    monkeypatch.setattr(F, "linear", skewed)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(model=tiny_spec, device="cpu").generate(SPEC_PROMPTS, sp)
    llm = LLM(model=tiny_spec, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    outs = llm.generate(SPEC_PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert max(sizes) > 1 and llm.engine.stats.mean_acceptance_length > 1.5


def test_cpu_fp16_weight_gemm(monkeypatch, one_thread):
    """kernels._fp16_weight: a weight whose elements times 2^s are all fp16s (bf16 values over a range fp16's can
    hold at some scale, as a bf16 checkpoint's) goes to FBGEMM's fp16-weight GEMM as w * 2^s, and 2^-s times its
    result has the bits of the same GEMM on the unscaled weight (a power of two changes no rounding of a normal
    result; each row as in its own call padded to _fp16_base_rows rows), within fp32 rounding of the float64 product; fp32 values, too wide a range, a zero or NaN weight, one
    so small that 2^s would overflow, CPU_FP16 off, no FBGEMM or a quantized engine without it: None, and linear()
    takes oneDNN's fp32 GEMM (the same values within fp32)."""
    if not K._fp16_gemm_here():
        pytest.skip("this torch has no FBGEMM fp16 GEMM")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 96, generator=g)
    w = torch.randn(40, 96, generator=g).half().float()                          # fp16s: max ~4, so s = 12
    packed = K._fp16_weight(w)
    assert packed is not None and packed[1].item() == 2.0 ** -14                   # max |w| * 2^14 in [2^15, 2^16)
    unscaled = torch.ops.quantized.linear_prepack_fp16(w, None)
    y = K._fp16_rows_call(x, w, packed)
    P = K._fp16_base_rows(w, lambda r: K._fp16(r, packed[0]))                     # (1 where FBGEMM rounds rows alike)
    assert torch.equal(y, K._fp16_padded_bits(lambda r: K._fp16(r, unscaled), x, P))
    ref = x.double() @ w.double().t()
    assert ((y.double() - ref).abs() / ref.abs().clamp_min(1)).max() < 1e-5
    tiny = (torch.randn(40, 96, generator=g) * 1e-6).bfloat16().float()          # bf16s far below fp16's range
    assert K._fp16_weight(tiny) is not None
    assert torch.equal(K.linear(x, tiny), K._fp16_rows_call(x, tiny, K._fp16_weight(tiny)))
    assert torch.allclose(K.linear(x, tiny), x @ tiny.t(), rtol=1e-5, atol=1e-12)
    wide = tiny.clone()
    wide[0, 0] = 2.0 ** -60                        # ~2^42 below the max: under fp16's smallest subnormal at any s
    zero, nan = torch.zeros(40, 96), w.clone()
    nan[3, 3] = float("nan")
    minute = (torch.randn(40, 96, generator=g) * 1e-35).bfloat16().float()       # 2^s would overflow fp32
    for v in (torch.randn(40, 96, generator=g), wide, zero, nan, minute):
        assert K._fp16_weight(v) is None
    assert torch.allclose(K.linear(x, wide), x @ wide.t(), rtol=1e-5, atol=1e-12)
    assert torch.allclose(K.linear(x, minute), x @ minute.t(), rtol=1e-5, atol=0)
    if "qnnpack" in torch.backends.quantized.supported_engines:                  # an engine without the fp16 GEMM
        engine = torch.backends.quantized.engine
        torch.backends.quantized.engine = "qnnpack"
        try:
            w4 = w.clone()
            assert K._fp16_weight(w4) is None and torch.allclose(K.linear(x, w4), x @ w.t(), rtol=1e-5, atol=1e-5)
        finally:
            torch.backends.quantized.engine = engine
    monkeypatch.setattr(K, "CPU_FP16", False)
    assert K._fp16_weight(w.clone()) is None
    monkeypatch.setattr(K, "CPU_FP16", True)
    monkeypatch.setattr(K, "_FP16_GEMM", [False])                                # a torch without FBGEMM
    w3 = w.clone()
    assert K._fp16_weight(w3) is None and torch.allclose(K.linear(x, w3), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_cpu_rows_calibration(monkeypatch):
    """kernels.calibrate_cpu_rows pads the step sizes (1-3 rows) whose timed steps ran faster padded, times each
    size with and without, keeps its choice per model (key) and sets CPU_PADDED from it, and times nothing more for
    a model whose 1-token step is slower than CALIBRATE_STEP_S or calls oneDNN nowhere (its weights on the fp16-weight
    GEMM); a step it cannot pad (oneDNN's 4-row call not giving each row its 1-row bits: _dnn_rows) is not padded
    whatever CPU_PADDED says."""
    monkeypatch.setattr(K, "_CALIBRATED", {})
    monkeypatch.setattr(K, "CPU_PADDED", frozenset())
    calls = []

    def dnn(f):  # a stand-in step that calls oneDNN (as a model of fp32 weights does)
        def step(M):
            K._DNN_CALLS[0] += 1
            return f(M)
        return step

    @dnn
    def step(M):  # a stand-in for a model's step of M rows: faster padded at M = 2 only
        calls.append((M, M in K.CPU_PADDED))
        time.sleep(0.002 if (M == 2) == (M in K.CPU_PADDED) else 0.02)
    nodnn = []
    assert K.calibrate_cpu_rows(lambda M: nodnn.append(M), "no oneDNN") == set() and nodnn == [1, 1]
    assert K.calibrate_cpu_rows(step, "a") == {2} and K.CPU_PADDED == {2}
    assert calls[:2] == [(1, False), (1, False)]                       # a first step, then one timed alone
    assert all(calls[2:].count((M, p)) == 4 for M in (1, 2, 3) for p in (0, 1)) and len(calls) == 26
    K.CPU_PADDED = frozenset()
    n = len(calls)
    assert K.calibrate_cpu_rows(step, "a") == {2} and K.CPU_PADDED == {2} and len(calls) == n  # kept per key
    assert K.calibrate_cpu_rows(dnn(lambda M: time.sleep(0.02 if M in K.CPU_PADDED else 0.002)), "b") == set()
    slow = []                                                 # a step slower than CALIBRATE_STEP_S: not timed further
    monkeypatch.setattr(K, "CALIBRATE_STEP_S", 0.005)
    assert K.calibrate_cpu_rows(dnn(lambda M: slow.append(M) or time.sleep(0.01)), "c") == set() and slow == [1, 1]
    w, x = torch.randn(64, 32), torch.randn(2, 32)
    shapes = []
    monkeypatch.setattr(K, "_ROWS_ALONE", {})
    monkeypatch.setattr(K, "_dnn", lambda rows, wp: shapes.append(rows.shape[0]) or rows @ w.t()
                        + torch.arange(rows.shape[0])[:, None] * 1e-3)                  # rows differ by place
    monkeypatch.setattr(K, "CPU_PADDED", frozenset({1, 2, 3}))
    assert not K._dnn_rows(w, 4) and not K._dnn_rows(w, 2)
    shapes.clear()
    assert torch.equal(K.linear(x[1:2], w), K.linear(x, w)[1:2]) and shapes == [1, 1, 1]      # alone, alone, alone


def test_cpu_padded_steps_equal_unpadded(tiny_spec, monkeypatch):
    """Greedy MTP (k = 1, 3) and plain decoding, one request and three at once, with every short CPU step padded to 4
    rows (kernels.CPU_PADDED {1, 2, 3}: decode steps of 1 and 3 rows, k = 1's 2-row verify) and with none: the same
    tokens and the same logprobs, bit for bit, and the padded runs called oneDNN with 4 rows more often; the engine
    calibrated the model (kernels._CALIBRATED) when it was built."""
    calibrated = len(K._CALIBRATED)
    LLM(model=tiny_spec, device="cpu", max_model_len=64)
    assert len(K._CALIBRATED) >= max(1, calibrated)
    monkeypatch.setattr(K, "calibrate_cpu_rows", lambda step, key: K.CPU_PADDED)  # the tests' choice stays
    real, fours = K._dnn, []
    monkeypatch.setattr(K, "_dnn", lambda rows, wp: fours.append(rows.shape[0] == 4) or real(rows, wp))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 1}, {"method": "mtp", "num_speculative_tokens": 3}):
        for prompts in (SPEC_PROMPTS[:1], SPEC_PROMPTS[:3]):
            got, n4 = [], []
            for padded in (frozenset(), frozenset({1, 2, 3})):
                monkeypatch.setattr(K, "CPU_PADDED", padded)
                llm = LLM(model=tiny_spec, device="cpu", speculative_config=spec)
                fours.clear()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                n4.append(sum(fours))
                got.append([(o.outputs[0].token_ids, [{t: l.logprob for t, l in d.items()}
                                                      for d in o.outputs[0].logprobs]) for o in outs])
            assert got[0] == got[1] and n4[1] > n4[0], (spec, len(prompts), n4)


def test_cpu_dnn_rows_check(monkeypatch):
    """_dnn_rows, the check at first use that lets a CPU step's rows share one oneDNN call (and _rows_alone's
    for the bmm without oneDNN): it refuses a GEMM whose row bits depend on the row's place in the call or on
    the other rows (stand-ins for oneDNN / the bmm that do so on purpose, so the test does not depend on this
    CPU), and linear() then computes each row alone, with the bits of a 1-row step. (On this CI class's CPU, AMD EPYC Zen 5, oneDNN itself passes at the toy's
    shapes: test_cpu_linear_row_invariant runs whichever path the check picks.)"""
    w, x = torch.randn(64, 32), torch.randn(3, 32)
    for bad in (lambda x, wp: x @ w.t() + torch.arange(x.shape[0])[:, None] * 1e-3,  # row r gets r * 1e-3
                lambda x, wp: x @ w.t() + x.sum(0, keepdim=True)[:, :1] * 1e-3):   # depends on the others
        monkeypatch.setattr(K, "_ROWS_ALONE", {})
        monkeypatch.setattr(K, "_dnn", bad)
        assert K._dnn_rows(w, 1) and not K._dnn_rows(w, 3)
        assert torch.equal(K.linear(x[1:2], w), K.linear(x, w)[1:2])             # row 1 alone == in the step
    monkeypatch.setattr(K, "_dnn_ok", lambda w: False)                           # without oneDNN: the bmm
    real = K._bmm
    for bad in (lambda r, w: real(r, w) + torch.arange(r.shape[0])[:, None] * 1e-3,
                lambda r, w: real(r, w) + r.sum(0, keepdim=True)[:, :1] * 1e-3):
        monkeypatch.setattr(K, "_ROWS_ALONE", {})
        monkeypatch.setattr(K, "_bmm", bad)
        assert torch.equal(K.linear(x[1:2], w), K.linear(x, w)[1:2])
        assert [v for k, v in K._ROWS_ALONE.items() if k[0] == "bmm"] == [False]


def test_cpu_gdn_invariant_to_input_layout():
    """The CPU GDN recurrence on q, k, v laid out with T innermost (the CPU causal conv's output): token 0 of a
    T = 4 or 5 verify, alone or in a batch, == the same token decoded alone, bit for bit (the l2 norm of q and k
    sums each row in one order whatever the layout; before, a verify row differed by ~5e-9)."""
    g = torch.Generator().manual_seed(3)
    Hk, Hv, dk, dv = 2, 4, 64, 64
    r = lambda *s: torch.randn(*s, generator=g)
    for _ in range(4):  # (a different summation order changes a row's bits only for some values)
        base = [r(Hk, dk), r(Hk, dk), r(Hv, dv), r(Hv), r(Hv)]
        A_log, dt_bias, pool = r(Hv), r(Hv), r(8, Hv, dk, dv) * 0.1
        rows = layout_rows(r, base, A_log, dt_bias, pool, Hk, Hv, dk, dv)
        assert K._cpu_fast(rows[0]) and all(torch.equal(x, rows[0]) for x in rows[1:])


def layout_rows(r, base, A_log, dt_bias, pool, Hk, Hv, dk, dv):
    """test_cpu_gdn_invariant_to_input_layout's outputs of token 0 (the same inputs and state each time)."""
    rows = []
    for B, T in [(1, 1), (1, 4), (2, 4), (4, 5)]:
        q, k, v = (r(B, h, d, T).permute(0, 3, 1, 2) for h, d in ((Hk, dk), (Hk, dk), (Hv, dv)))  # T innermost
        a, b = r(B, T, Hv), r(B, T, Hv)
        for t, x in zip((q, k, v, a, b), base):
            t[0, 0] = x
        p = pool.clone()
        with torch.inference_mode():
            o = K.gdn_recurrent_gated(q, k, v, a, b, A_log, dt_bias, p, torch.arange(B),
                                      torch.zeros(B, dtype=torch.long) if T > 1 else None)
        rows.append(o[0, 0])
    return rows


@pytest.mark.parametrize("slot_list", [[3, 1, 4], [1, 2, 3]])
def test_cpu_gdn_and_conv_fast_equal_reference(slot_list):
    """The CPU fast GDN recurrence and causal conv against the references (fp32: outputs within 1e-5, states
    within 1e-5, conv windows exact), and batch / T invariance bit for bit: a token alone (T = 1, B = 1) ==
    token 0 of a T = 4 verify == its row in a batch of 3; a verify (n_keep 0) writes nothing; a commit
    (outputs=False) leaves the states the full step would. Slots in any order (a gather and a scatter) and
    in a run (the pool's rows in place: _slot_run)."""
    g = torch.Generator().manual_seed(5)
    B, T, Hk, Hv, dk, dv, S, C, W = 3, 4, 2, 4, 16, 12, 5, 40, 3
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale
    y = r(B, T, 2 * Hk * dk + Hv * dv)
    q, k, v = (t.reshape(B, T, h, -1) for t, h in zip(y.split([Hk * dk, Hk * dk, Hv * dv], -1), (Hk, Hk, Hv)))
    a, b = r(B, T, Hv, scale=4), r(B, T, Hv, scale=2)
    A_log, dt_bias = r(Hv, scale=0.5), r(Hv)
    pool, slots = r(S, Hv, dk, dv, scale=0.3), torch.tensor(slot_list)
    assert (K._slot_run(slots, pool) is None) == (slot_list == [3, 1, 4])
    for n_keep in (None, torch.zeros(B, dtype=torch.long), torch.tensor([0, 2, 4])):
        p1, p2 = pool.clone(), pool.clone()
        o = K._gdn_recurrent_cpu(q, k, v, a, b, A_log, dt_bias, p1, slots, n_keep, True)
        o_ref = K.gdn_recurrent_ref(q, k, v, *K.gdn_gates(a, b, A_log, dt_bias), p2, slots, n_keep)
        assert rel(o, o_ref) <= 1e-5 and rel(p1, p2) <= 1e-5, n_keep
        if n_keep is not None:
            p3 = pool.clone()
            assert K._gdn_recurrent_cpu(q, k, v, a, b, A_log, dt_bias, p3, slots, n_keep, False) is None
            assert torch.equal(p3, p1)
            assert torch.equal(p1[slots[n_keep == 0]], pool[slots[n_keep == 0]])
    p1, p2, zeros, keep = pool.clone(), pool.clone(), torch.zeros(B, dtype=torch.long), torch.tensor([0, 2, 4])
    K._gdn_recurrent_cpu(q, k, v, a, b, A_log, dt_bias, p1, slots, zeros, True)       # a verify, then its commit:
    K._gdn_recurrent_cpu(q, k, v, a, b, A_log, dt_bias, p1, slots, keep, False)       # from the verify's states
    K._gdn_recurrent_cpu(q, k, v, a, b, A_log, dt_bias, p2, slots, keep, False)       # replayed
    assert torch.equal(p1, p2) and p1._specdec_verify is None
    outs = {}
    for name, rows, t in (("alone", [1], 1), ("verify", [1], T), ("batch", [0, 1, 2], 1)):
        p = pool.clone()
        o = K._gdn_recurrent_cpu(q[rows, :t], k[rows, :t], v[rows, :t], a[rows, :t], b[rows, :t], A_log,
                                 dt_bias, p, slots[rows], torch.zeros(len(rows), dtype=torch.long), True)
        outs[name] = o[rows.index(1), 0]
    assert torch.equal(outs["verify"], outs["alone"]) and torch.equal(outs["batch"], outs["alone"])
    x, wc, cpool = r(B, T, C + 4)[..., 2:2 + C], r(C, W + 1, scale=0.5), r(S, C, W)
    if slot_list == [1, 2, 3]:  # in place == gathered, bit for bit: the same rows, slots reversed (no run)
        rev, perm = torch.tensor([3, 2, 1]), [0, 3, 2, 1, 4]
        for n_keep in (None, torch.zeros(B, dtype=torch.long)):
            p1, p2, c1, c2 = pool.clone(), pool[perm].clone(), cpool.clone(), cpool[perm].clone()
            o1 = K._gdn_recurrent_cpu(q, k, v, a, b, A_log, dt_bias, p1, slots, n_keep, True)
            o2 = K._gdn_recurrent_cpu(q, k, v, a, b, A_log, dt_bias, p2, rev, n_keep, True)
            assert torch.equal(o1, o2) and torch.equal(p1[slots], p2[rev])
            y1, y2 = K._causal_conv_cpu(x, c1, slots, wc, n_keep), K._causal_conv_cpu(x, c2, rev, wc, n_keep)
            assert torch.equal(y1, y2) and torch.equal(c1[slots], c2[rev])
    for n_keep in (None, torch.zeros(B, dtype=torch.long), torch.tensor([0, 2, 4])):
        c1, c2 = cpool.clone(), cpool.clone()
        yc = K._causal_conv_cpu(x, c1, slots, wc, n_keep)
        assert torch.equal(yc, K.causal_conv_ref(x, c2, slots, wc, n_keep)) and torch.equal(c1, c2)
    c1, c2, keep = cpool.clone(), cpool.clone(), torch.tensor([0, 2, 4])
    K._causal_conv_cpu(x, c1, slots, wc, torch.zeros(B, dtype=torch.long))        # a verify, then its commit:
    K._conv_commit_cpu(x, c1, slots, keep)                                        # from the verify's sequence
    K.conv_window_ref(x, c2, slots, keep)
    assert torch.equal(c1, c2) and c1._specdec_verify is None
    K._conv_commit_cpu(x, c1, slots, keep)                                        # none kept: the reference
    K.conv_window_ref(x, c2, slots, keep)
    assert torch.equal(c1, c2)


@pytest.mark.parametrize("B,T,Hk,Hv", [(1, 5, 1, 2), (2, 3, 1, 1), (1, 1, 1, 2)])
def test_cpu_gdn_few_heads(B, T, Hk, Hv):
    """The CPU GDN recurrence at the draft model's head counts (one key head, two value heads) and one head
    of each, where its per-token views have broadcast strides: outputs and states against the reference
    (fp32, within 1e-5) for a verify (n_keep 0) and its commit; the verify's token 0 == the token alone, bit
    for bit."""
    g = torch.Generator().manual_seed(B * 10 + T)
    dk, dv = 16, 8
    q, k = (torch.randn(B, T, Hk, dk, generator=g) for _ in range(2))
    v = torch.randn(B, T, Hv, dv, generator=g)
    a, b = torch.randn(B, T, Hv, generator=g) * 3, torch.randn(B, T, Hv, generator=g)
    A_log, dt_bias = torch.randn(Hv, generator=g) * 0.5, torch.randn(Hv, generator=g)
    pool, slots = torch.randn(4, Hv, dk, dv, generator=g) * 0.3, torch.arange(B) + 1
    zeros, keep = torch.zeros(B, dtype=torch.long), torch.full((B,), T)
    p1, p2 = pool.clone(), pool.clone()
    o = K._gdn_recurrent_cpu(q, k, v, a, b, A_log, dt_bias, p1, slots, zeros, True)
    o_ref = K.gdn_recurrent_ref(q, k, v, *K.gdn_gates(a, b, A_log, dt_bias), p2, slots, zeros)
    assert rel(o, o_ref) <= 1e-5 and torch.equal(p1, pool)
    K._gdn_recurrent_cpu(q, k, v, a, b, A_log, dt_bias, p1, slots, keep, False)      # the commit: snapshots
    K.gdn_recurrent_ref(q, k, v, *K.gdn_gates(a, b, A_log, dt_bias), p2, slots, keep)
    assert rel(p1, p2) <= 1e-5
    first = [t[:, :1] for t in (q, k, v, a, b)]
    alone = K._gdn_recurrent_cpu(*first, A_log, dt_bias, pool.clone(), slots, None, True)
    assert torch.equal(alone[:, 0], o[:, 0])

def test_cpu_norms_fast():
    """The CPU fast norms (torch's LayerNorm over [x, -x]) against the references (fp32, within 2e-6), and a row's
    bits whatever the number of rows (1 .. 70)."""
    g = torch.Generator().manual_seed(3)
    for D in (64, 256):
        x, z = (torch.randn(70, D, generator=g) * 2 for _ in range(2))
        w = torch.randn(D, generator=g) * 0.1
        assert (K.rms_norm(x, w, 1e-6) - K.rms_norm_ref(x, w, 1e-6)).abs().max() <= 2e-6
        assert (K.gated_rms_norm(x, z, w, 1e-6) - K.gated_rms_norm_ref(x, z, w, 1e-6)).abs().max() <= 2e-6
        for fn in (lambda i, j: K.rms_norm(x[i:j], w, 1e-6),
                   lambda i, j: K.gated_rms_norm(x[i:j], z[i:j], w, 1e-6)):
            alone = torch.cat([fn(i, i + 1) for i in range(70)])
            assert all(torch.equal(fn(0, M), alone[:M]) for M in range(2, 71))


def test_cpu_attention_fast_equals_reference():
    """The CPU fast attention (a KV head's query heads as one product's rows, each query over its own keys)
    against the reference (fp32, within 1e-5), and a query's bits alone == as token 2 of a T = 4 verify ==
    as a row of a batch of 3."""
    g = torch.Generator().manual_seed(9)
    B, T, nh, nkv, d, S, Lc = 3, 4, 4, 2, 16, 5, 40
    q = torch.randn(B, T, nh, d, generator=g)
    kc, vc = torch.randn(S, Lc, nkv, d, generator=g), torch.randn(S, Lc, nkv, d, generator=g)
    slots, pos = torch.tensor([4, 0, 2]), torch.tensor([7, 0, 20])
    o = K._attention_cpu(q, kc, vc, slots, pos)
    assert rel(o, K.attention_ref(q, kc, vc, slots, pos, 24)) <= 1e-5
    alone = K._attention_cpu(q[1:2, 2:3], kc, vc, slots[1:2], pos[1:2] + 2)[0, 0]
    batch = K._attention_cpu(q[:, 2:3], kc, vc, slots, pos + 2)[1, 0]
    assert torch.equal(o[1, 2], alone) and torch.equal(batch, alone)


@pytest.mark.parametrize("plain", [False, True])
def test_cpu_attention_prep_fast(plain):
    """The CPU fast attention_prep (RoPE from a table of the reference's cos / sin, q and k heads rotated
    together) against the reference (fp32: q and the cache writes within 2e-6; the table regrown past its
    end), and a token's bits alone == as token 2 of a T = 4 step == as a row of a batch of 3."""
    g = torch.Generator().manual_seed(11)
    B, T, nh, nkv, hd, S, L = 3, 4, 4, 2, 32, 6, 700
    qg, k, v = torch.randn(B, T, nh, 2 * hd, generator=g), *torch.randn(2, B, T, nkv, hd, generator=g)
    qw, kw = torch.randn(hd, generator=g) * 0.1, torch.randn(hd, generator=g) * 0.1
    inv_freq = sd.rope_inv_freq(8, 1e4)
    slots, pos = torch.tensor([4, 0, 2]), torch.tensor([7, 0, 690])                # 690 + 3: past 256 rows
    caches = [[torch.zeros(S, L, nkv, hd) for _ in range(2)] for _ in range(2)]
    assert K._rope_table(inv_freq, 10, torch.float32)[0].shape == (256, 8)        # made for 256 positions
    q = K._attention_prep_cpu(qg, k, v, qw, kw, 1e-6, inv_freq, *caches[0], slots, pos, plain)
    q_ref = K.attention_prep_ref(qg, k, v, qw, kw, 1e-6, inv_freq, *caches[1], slots, pos, plain)
    assert (q - q_ref).abs().max() <= 2e-6 and K._rope_table(inv_freq, 1, torch.float32)[0].shape == (694, 8)
    assert all((a - b).abs().max() <= 2e-6 for a, b in zip(caches[0], caches[1]))
    prep = lambda rows, t0, t1: K._attention_prep_cpu(qg[rows, t0:t1], k[rows, t0:t1], v[rows, t0:t1], qw, kw,
                                                      1e-6, inv_freq, *caches[0], slots[rows], pos[rows] + t0,
                                                      plain)
    alone = prep([1], 2, 3)[0, 0]
    assert torch.equal(prep([1], 0, 4)[0, 2], alone) and torch.equal(prep([0, 1, 2], 2, 3)[1, 0], alone)
    # more than 4 rows (the cache written by index_put_ rather than row by row): as the reference
    i = [0, 1, 2, 0, 1, 2]
    q6 = K._attention_prep_cpu(qg[i, :2], k[i, :2], v[i, :2], qw, kw, 1e-6, inv_freq, *caches[0],
                               torch.tensor([4, 0, 2, 1, 3, 5]), torch.tensor([7, 0, 20, 3, 9, 1]), plain)
    q6_ref = K.attention_prep_ref(qg[i, :2], k[i, :2], v[i, :2], qw, kw, 1e-6, inv_freq, *caches[1],
                                  torch.tensor([4, 0, 2, 1, 3, 5]), torch.tensor([7, 0, 20, 3, 9, 1]), plain)
    assert (q6 - q6_ref).abs().max() <= 2e-6 and torch.equal(q6[1, 0], prep([1], 0, 1)[0, 0])
    assert all((a - b).abs().max() <= 2e-6 for a, b in zip(caches[0], caches[1]))


def test_cpu_argmax():
    """kernels.argmax (numpy's on a CPU) == torch's argmax: random rows, ties (the first maximum), NaNs (the
    first NaN), -inf / inf rows, a strided view, 1-d to 3-d."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 300, generator=g)
    x[0, 1, [7, 200]] = 9.0                                                       # a tie
    x[1, 2, [11, 40]] = float("nan")
    x[2, 0] = float("-inf")
    x[2, 1, 5] = float("inf")
    x[2, 3, [4, 9]] = float("inf")
    for t in (x, x[:, :, ::3], x[0], x[1, 2], torch.zeros(4, 6)):
        got = K.argmax(t)
        assert got.dtype == torch.long and torch.equal(got, t.argmax(-1)), t.shape


def test_cpu_markov_greedy():
    """DSpark's greedy Markov stage on a CPU (numpy's argmax each step) == the reference loop's drafts,
    batched and alone, and ties to the first maximum."""
    g = torch.Generator().manual_seed(6)
    B, Kq, V, R = 3, 8, 700, 24
    U = torch.randn(B, Kq, V, generator=g) * 2
    w1, w2 = torch.randn(V, R, generator=g), torch.randn(V, R, generator=g) * 0.3
    e0 = F.embedding(torch.tensor([5, 77, 600]), w1)
    want = K.markov_greedy_ref(U, e0, w1, w2)
    assert torch.equal(K.markov_greedy(U, e0, w1, w2), want) and len(set(want.flatten().tolist())) > 10
    assert torch.equal(K.markov_greedy(U[1:2], e0[1:2], w1, w2), want[1:2])
    U2 = torch.zeros_like(U)
    U2[:, :, 7] = U2[:, :, V - 3] = 50.0                                           # a tie
    assert torch.equal(K.markov_greedy(U2, e0, w1, torch.zeros_like(w2)), torch.full((B, Kq), 7))

def test_cpu_greedy_accept(tiny_spec, monkeypatch):
    """A CPU step whose rows are all greedy accepts through greedy_verify (no uniforms drawn): the same tokens
    and counts as rejection_sample's greedy rows (its general path, all_greedy off, drafts with padding), and
    end to end the same tokens as speculation off, rejection_sample never called."""
    g = torch.Generator().manual_seed(4)
    B, k, V = 6, 3, 50
    logits = torch.randn(B, k + 1, V, generator=g)
    drafts = logits[:, :k].argmax(-1)
    drafts[1, 0] += 1                                                            # rejected at once
    drafts[2, 2] = (drafts[2, 2] + 1) % V                                        # the last rejected
    drafts[3, 1:] = -1                                                           # padding
    zeros = torch.zeros(B)
    u_acc, u_smp = torch.rand(B, k, generator=g), torch.rand(B, k + 1, generator=g)
    want = sd.rejection_sample(logits, drafts, None, zeros, torch.zeros(B, dtype=torch.long), torch.ones(B),
                               u_acc, u_smp, all_greedy=False)
    got = sd.greedy_verify(logits, drafts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1].tolist() == [3, 0, 2, 1, 3, 3]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    off = LLM(model=tiny_spec, device="cpu").generate(SPEC_PROMPTS[:2], sp, use_tqdm=False)
    mtp = LLM(model=tiny_spec, device="cpu",
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    monkeypatch.setattr(sd, "rejection_sample", lambda *a, **kw: pytest.fail("rejection_sample was called"))
    outs = mtp.generate(SPEC_PROMPTS[:2], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in off]
    assert mtp.engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("N,Kin,path", [(776, 256, "bf16"), (388, 128, "bmm"), (256, 256, "bmm"),
                                        (388, 128, "bmm rows alone"), (256, 256, "bf16, bmm=False")])
def test_cpu_draft_linear(N, Kin, path, monkeypatch):
    """kernels.cpu_draft: inside it a CPU linear of an fp32 weight computes on bf16 copies (the bf16 product
    of the rounded input and weight, within bf16's rounding of the result), or for a small weight (at most
    DRAFT_BMM_SIZE elements) in fp32 as per-row products (_bmm; within fp32 of F.linear), one call for all rows
    or, where the check at first use fails, one per row; either way a row alone == the row in steps of 2 .. 17
    rows bit for bit (which of the two runs depends on the weight, not on the rows), and fp32 comes back;
    cpu_draft(bmm=False) (the block drafters) takes bf16 for small weights too; outside it (or with
    CPU_DRAFT_DTYPE None) the fp32 linear, bit for bit."""
    if path.startswith("bf16"):
        try:  # oneDNN's bf16 GEMM needs AVX-512 (or AVX-NE-CONVERT): not on an AVX2 CPU, where the engine keeps fp32
            torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), None)
        except RuntimeError:
            pytest.skip("oneDNN has no bf16 GEMM on this CPU")
    monkeypatch.setattr(K, "CPU_DRAFT_DTYPE", torch.bfloat16)  # (the default where the CPU has AVX512-BF16)
    if path == "bmm rows alone":
        monkeypatch.setattr(K, "_rows_alone", lambda *a: False)
    g = torch.Generator().manual_seed(8)
    w, x = torch.randn(N, Kin, generator=g), torch.randn(17, Kin, generator=g)
    fp32 = K.linear(x, w)
    with K.cpu_draft(bmm=path != "bf16, bmm=False"):
        y = K.linear(x, w)
        alone = torch.cat([K.linear(x[i:i + 1], w) for i in range(17)])
        assert all(torch.equal(K.linear(x[:M], w), alone[:M]) for M in (2, 3, 4, 8, 17))
    assert y.dtype == torch.float32 and torch.equal(y, alone)
    if path.startswith("bf16"):
        ref = x.bfloat16().double() @ w.bfloat16().double().t()
        assert not torch.equal(y, fp32)
        assert ((y - ref).abs() / ref.abs().clamp(min=1.0)).max() <= 2 ** -8
    else:
        assert N * Kin <= K.DRAFT_BMM_SIZE and torch.allclose(y, F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert torch.equal(K.linear(x, w), fp32)                                      # outside: fp32 as before
    monkeypatch.setattr(K, "CPU_DRAFT_DTYPE", None)
    with K.cpu_draft():
        assert torch.equal(K.linear(x, w), fp32)


def test_cpu_bf16_mtp_drafts(tiny_spec, spec_off, monkeypatch):
    """MTP drafting in bf16 on a CPU (the default; kernels.cpu_draft): greedy output == speculation off for
    k = 1 and 3, and its drafts are accepted about as often as the fp32 drafter's (mean acceptance length at
    least 95 % of it; measured here 1.88 vs 1.90 at k = 1, 3.31 vs 3.38 at k = 3; the toy: 2.357 vs 2.374)."""
    sp, ref, _ = spec_off
    sp = dataclasses.replace(sp, logprobs=None)
    for k in (1, 3):
        lengths = {}
        for dtype in (None, torch.bfloat16):
            monkeypatch.setattr(K, "CPU_DRAFT_DTYPE", dtype)
            mtp = {"method": "mtp", "num_speculative_tokens": k}
            llm = LLM(model=tiny_spec, device="cpu", speculative_config=mtp)
            outs = llm.generate(SPEC_PROMPTS, sp, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref], (k, dtype)
            lengths[dtype] = llm.engine.stats.mean_acceptance_length
        assert lengths[torch.bfloat16] >= 0.95 * lengths[None] and lengths[None] > 1.5, lengths

def test_cpu_mtp_commit_accepted_rows(tiny_spec):
    """On a CPU the MTP commit passes only the positions up to the furthest accepted one through the MTP
    layer: the same tokens, the same acceptance counts, and after every step the same kept MTP hidden states
    and MTP KV cache (up to each slot's committed length) bit for bit as committing all k+1 positions, alone
    and batched."""
    cfg = {"method": "mtp", "num_speculative_tokens": 3}
    llms = [LLM(model=tiny_spec, device="cpu", speculative_config=cfg) for _ in range(2)]
    llms[1].engine.runner.proposer.accepted_only = False
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for prompts in (SPEC_PROMPTS[:1], SPEC_PROMPTS[:3]):
        reqs = [[llm.engine.add_request(llm.tokenizer.encode(p), sp) for p in prompts] for llm in llms]
        while not all(r.finished for r in reqs[0] + reqs[1]):
            for llm in llms:
                llm.engine.step()
            mtps = [llm.engine.runner.proposer for llm in llms]
            assert torch.equal(mtps[0].hidden, mtps[1].hidden)
            for r0, r1 in zip(*reqs):
                n = len(r0.tokens) - 1                                          # positions the MTP KV holds
                assert r0.tokens == r1.tokens and r0.slot == r1.slot
                if r0.slot is not None:
                    for c0, c1 in zip(*(llm.engine.runner.state.kv["mtp"] for llm in llms)):
                        assert torch.equal(c0[r0.slot, :n], c1[r1.slot, :n])
    s0, s1 = (llm.engine.stats for llm in llms)
    assert s0.num_draft_tokens == s1.num_draft_tokens and s0.accepted_per_pos == s1.accepted_per_pos
    assert s0.num_accepted_tokens > s0.num_drafts > 0


@needs_kernels
@pytest.mark.parametrize("k,lo,hi", [(4, 2, 5), (3, 1, 1), (6, 1, 4)])
def test_kernel_ngram_lookup(k, lo, hi):
    """The ngram kernel == its reference == the host lookup (specdec.ngram_lookup) on random histories: small
    vocabularies and periodic texts (matches of every length), rows of 2..3000 tokens in a buffer of 3100 (blocks
    of 1024 positions: the longest match in a later block wins, a tie keeps the earlier one), room 0..k+1, and a
    padding row (last 0)."""
    g = torch.Generator().manual_seed(k * 100 + hi)
    S, W = 9, 3100
    hist = torch.randint(0, 3, (S, W), generator=g)
    lengths = [2, 3, 9, 700, 1025, 2049, 3000, 1500]
    for s, n in enumerate(lengths):
        if s % 2:
            per = int(torch.randint(1, 9, (1,), generator=g))
            hist[s, :n] = hist[s, :per].repeat(n // per + 1)[:n]
    slots = torch.tensor([3, 0, 1, 2, 4, 5, 6, 7, 8])
    last = torch.tensor([lengths[s] - 1 if s < len(lengths) else 0 for s in slots.tolist()])
    room = torch.randint(0, k + 2, (len(slots),), generator=g)
    args = [t.to(DEV) for t in (hist, slots, last, room)]
    out = fast(K.ngram_lookup, *args, k, lo, hi).cpu()
    ref = K.ngram_lookup_ref(hist, slots, last, room, k, lo, hi)
    assert out.tolist() == ref.tolist()
    for b, s in enumerate(slots.tolist()):
        n = int(last[b]) + 1
        want = sd.ngram_lookup(hist[s, :n].tolist(), min(k, int(room[b])), lo, hi) if n > 1 else []
        assert ref[b].tolist() == want + [-1] * (k - len(want)), (b, s)


# ==============================================================================================
# vLLM's offline API, session 47
# ==============================================================================================

@pytest.fixture(scope="module")
def toy47():
    if not os.path.isdir(TOY):
        pytest.skip("models/toy not present")
    return LLM(TOY, device="cpu", max_num_seqs=4, max_model_len=256)


def test_s47_logprobs_true_is_one_and_minus_one_is_all(tiny):
    """vLLM's SamplingParams.__post_init__ turns logprobs / prompt_logprobs True into 1 (True crashed a step:
    topk(k=True)); _verify_args takes -1 (the whole vocabulary) for both, as far as max_logprobs lets it; any other
    type is refused when the params are made, naming the field."""
    assert SamplingParams(logprobs=True).logprobs == 1 and SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    llm = LLM(model=tiny, device="cpu", max_model_len=64, max_logprobs=-1)
    V = llm.cfg.vocab_size
    sp = SamplingParams(max_tokens=2, temperature=0, logprobs=-1, prompt_logprobs=True)
    out = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 3
    assert all(1 <= len(d) <= 2 for d in out.prompt_logprobs[1:])        # the top one, and the prompt's token
    assert [len(d) for d in out.outputs[0].logprobs] == [V, V]
    llm.max_logprobs = 20                                                   # vLLM's default cap: -1 is V > 20
    with pytest.raises(ValueError, match=f"Requested sample logprobs of {V}, which is greater than max allowed: 20"):
        llm.generate([[5]], sp, use_tqdm=False)
    for bad in (False, 1.5, "1"):
        with pytest.raises(ConfigError, match="prompt_logprobs must be an integer"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ConfigError, match=re.escape("logprobs must be non-negative or -1, got -2.")):
        SamplingParams(logprobs=-2)


def test_s47_stop_token_text_left_out(toy47):
    """vLLM's detokenizer (v1/engine/detokenizer.py, update(new_token_ids, stop_terminated)) leaves the text of the
    token that stop-terminated the request out of `text` unless include_stop_str_in_output; token_ids keep it."""
    llm = toy47
    greedy = SamplingParams(max_tokens=20, temperature=0)
    ids = llm.generate("def f():", greedy, use_tqdm=False)[0].outputs[0].token_ids
    t = ids[1]
    sp = dataclasses.replace(greedy, stop_token_ids=[t])
    out = llm.generate("def f():", sp, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ids[:ids.index(t) + 1], "stop", t)
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1]) != llm.tokenizer.decode(out.token_ids)
    inc = llm.generate("def f():", dataclasses.replace(sp, include_stop_str_in_output=True), use_tqdm=False)
    assert inc[0].outputs[0].text == llm.tokenizer.decode(out.token_ids)
    # an EOS is a stop token too: its text only with include_stop_str_in_output and skip_special_tokens off
    eos = llm.tokenizer.eos_token_id
    forced = SamplingParams(max_tokens=4, temperature=0, logit_bias={eos: 100})
    for flags, text in ((dict(), ""), (dict(skip_special_tokens=False), ""),
                        (dict(skip_special_tokens=False, include_stop_str_in_output=True), llm.tokenizer.decode([eos]))):
        o = llm.generate("def", dataclasses.replace(forced, **flags), use_tqdm=False)[0].outputs[0]
        assert (o.token_ids, o.text) == ([eos], text), flags


def test_s47_server_stop_token_text_left_out(srv):
    """The server's text (whole and streamed) is the engine's: it ends before the stop token id's text too (and
    before a character the tokens before it left unfinished, which vLLM's detokenizer never releases then)."""
    from specdec import Tokenizer
    body = {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    tok = Tokenizer.from_dir(srv_model(srv))
    tokens = srv.post("/v1/completions", dict(body, logprobs=0))[1]["choices"][0]["logprobs"]["tokens"]
    t = next(t for t in tokens[3:] if t.isascii() and t.strip() and len(tok.encode(t)) == 1)
    stop = dict(body, stop_token_ids=[tok.encode(t)[0]])
    c = srv.post("/v1/completions", dict(stop, include_stop_str_in_output=True))[1]["choices"][0]
    assert c["text"].endswith(t) and c["text"] == tok.decode(c["token_ids"])
    ids = c["token_ids"][:-1]
    want = next(tok.decode(ids[:j]) for j in range(len(ids), -1, -1) if not tok.decode(ids[:j]).endswith("\ufffd"))
    r = srv.post("/v1/completions", stop)[1]["choices"][0]
    assert (r["text"], r["finish_reason"], r["stop_reason"]) == (want, "stop", tok.encode(t)[0])
    chunks = sse_events(srv.request("POST", "/v1/completions", dict(stop, stream=True))[2])
    assert "".join(c["choices"][0]["text"] for c in chunks) == want


def test_s47_generation_config_eos_stop_reason(toy47):
    """vLLM's SamplingParams.update_from_generation_config adds the generation config's EOS ids other than the
    tokenizer's to stop_token_ids (unless ignore_eos), so a request they end has stop_reason = the id; the
    tokenizer's EOS (check_stop's eos_token_id) ends it with stop_reason None."""
    llm = toy47
    eos = llm.tokenizer.eos_token_id
    other = next(e for e in llm.cfg.eos_token_ids if e != eos)
    out = llm.generate('if __name__ == "__main__":\n    main()\n', SamplingParams(max_tokens=60, temperature=0),
                       use_tqdm=False)[0].outputs[0]
    assert (out.token_ids[-1], out.finish_reason, out.stop_reason) == (other, "stop", other)
    for t, extra, want in ((eos, {}, ("stop", None)), (other, {}, ("stop", other)),
                           (other, dict(ignore_eos=True), ("length", None)),        # not a stop id then
                           (eos, dict(ignore_eos=True, stop_token_ids=[eos]), ("stop", eos))):
        sp = SamplingParams(max_tokens=3, temperature=0, logit_bias={t: 100}, **extra)
        o = llm.generate("def", sp, use_tqdm=False)[0].outputs[0]
        assert (o.finish_reason, o.stop_reason) == want, (t, extra)


def test_s47_offline_checks_the_prompt_alone(tiny):
    """vLLM's LLM.generate checks only the prompt (input_processor._validate_prompt_len: longer than max_model_len,
    or as long, leaving no room for a token, is refused); prompt + max_tokens may exceed it: the output stops at
    max_model_len with finish_reason "length". (The server keeps its 400 for prompt + max_tokens > max_model_len.)"""
    llm = LLM(model=tiny, device="cpu", max_model_len=32)
    outs = llm.generate([[1] * 30, [2]], SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs] == [(2, "length"), (31, "length")]
    for n, msg in ((32, "The decoder prompt (length 32) plus the number of requested output tokens (at least 1) is "
                        "longer than the maximum model length of 32. Make sure that `max_model_len` is no smaller "
                        "than the number of text tokens (prompt + requested output tokens)."),
                   (33, "The decoder prompt (length 33) is longer than the maximum model length of 32. Make sure that "
                        "`max_model_len` is no smaller than the number of text tokens.")):
        with pytest.raises(ConfigError, match=re.escape(msg)):
            llm.generate([[1], [1] * n], SamplingParams(max_tokens=4), use_tqdm=False)
        assert not llm.engine.waiting and all(s is None for s in llm.engine.slots)   # none of that batch stays


def test_s47_generate_and_chat_take_vllms_arguments(tiny):
    """vLLM's LLM.generate(prompts, sampling_params, *, use_tqdm, lora_request, priority, tokenization_kwargs) takes
    any Sequence of SamplingParams (a tuple raised AttributeError); LLM.chat(messages, sampling_params, use_tqdm,
    lora_request, chat_template, chat_template_content_format, add_generation_prompt, ...) in that order. The
    arguments specdec has no use for are accepted at their defaults; other values are ConfigErrors (vLLM's
    input_processor._validate_lora message for a LoRA request)."""
    llm = LLM(model=tiny, device="cpu", max_model_len=64)
    sp = SamplingParams(temperature=0, max_tokens=3)
    want = [o.outputs[0].token_ids for o in llm.generate(["a", "b"], [sp, sp], use_tqdm=False)]
    got = llm.generate(["a", "b"], (sp, sp), use_tqdm=False, lora_request=None, priority=[0, 0],
                       tokenization_kwargs=None)
    assert [o.outputs[0].token_ids for o in got] == want
    msgs = [{"role": "user", "content": "hi"}]
    ref = llm.chat(msgs, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.chat(msgs, sp, False, None, None, "auto", True)[0].outputs[0].token_ids == ref
    for kw, msg in ((dict(lora_request="adapter"), "Got lora_request adapter but LoRA is not enabled!"),
                    (dict(priority=[0, 1]), "Got priority 1 but Priority scheduling is not enabled."),
                    (dict(tokenization_kwargs={"truncation": True}), "tokenization_kwargs=")):
        with pytest.raises(ConfigError, match=re.escape(msg)):
            llm.generate(["a", "b"], sp, use_tqdm=False, **kw)
    for kw in (dict(chat_template_content_format="openai"), dict(mm_processor_kwargs={"x": 1}),
               dict(lora_request=["adapter"])):
        with pytest.raises(ConfigError):
            llm.chat(msgs, sp, use_tqdm=False, **kw)
    assert not llm.engine.waiting and all(s is None for s in llm.engine.slots)


def test_s47_unused_engine_args(tiny, capsys):
    """vLLM's engine arguments that change nothing here (UNUSED_ENGINE_ARGS) are accepted by LLM(...) and as flags
    at the values where that is true (they were TypeErrors); other values are ConfigErrors naming the argument
    and its flag; an unknown keyword stays a TypeError (vLLM's EngineArgs). --max-logprobs reaches LLM."""
    ok = dict(disable_log_stats=True, enable_prefix_caching=False, swap_space=0, block_size=16, revision=None,
              kv_cache_dtype="auto", tokenizer_mode="auto")
    llm = LLM(model=tiny, device="cpu", max_model_len=32, **ok)
    assert len(llm.generate([[1]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 2
    for name, value in (("enable_prefix_caching", True), ("kv_cache_dtype", "fp8"), ("revision", "main"),
                        ("swap_space", -1), ("block_size", 0), ("tokenizer_mode", "slow"),
                        ("disable_log_stats", "yes")):
        with pytest.raises(ConfigError, match=re.escape(f"{name}={value!r} (--{name.replace('_', '-')}) is not "
                                                        "supported")):
            LLM(model=tiny, device="cpu", max_model_len=32, **{name: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'enable_lora'"):
        LLM(model=tiny, device="cpu", enable_lora=True)
    import argparse
    ap = argparse.ArgumentParser()
    sd.add_engine_args(ap)
    a = ap.parse_args(sd.vllm_argv(["--model", tiny, "--device", "cpu", "--max-model-len", "32", "--disable-log-stats",
                                    "--no-enable-prefix-caching", "--kv-cache-dtype", "auto", "--block-size", "16",
                                    "--swap-space", "0", "--revision", "", "--max_logprobs", "-1"]))
    with pytest.raises(ConfigError, match="revision=''"):                  # a revision names one: refused
        sd.llm_from_args(a)
    a.revision = None
    assert sd.llm_from_args(a).max_logprobs == -1
    assert sd.main(["--model", tiny, "--device", "cpu", "--max-tokens", "2", "--enable-prefix-caching"]) == 2
    assert "enable_prefix_caching=True (--enable-prefix-caching) is not supported" in capsys.readouterr().err


def test_s47_speculative_max_model_len_never_shrinks_the_target(tiny):
    """vLLM's speculative max_model_len (config/speculative.py, _maybe_override_draft_max_model_len) is the draft
    model's context: larger than the target's is an error, smaller leaves the target's alone; ngram has no draft
    model and ignores it. specdec shrank the target's context to it."""
    for method, n in (("ngram", 16), ("mtp", 16), ("ngram", 100)):
        spec = {"method": method, "num_speculative_tokens": 2, "max_model_len": n}
        assert LLM(model=tiny, device="cpu", max_model_len=64, speculative_config=spec).max_model_len == 64
    with pytest.raises(ConfigError, match=re.escape("speculative_max_model_len=100 cannot be larger than "
                                                    "target_max_model_len=64")):
        LLM(model=tiny, device="cpu", max_model_len=64,
            speculative_config={"method": "mtp", "num_speculative_tokens": 2, "max_model_len": 100})


def test_s47_prompt_lookup_with_another_method_is_zero():
    """vLLM's SpeculativeConfig.__post_init__ sets prompt_lookup_min / max to 0 for a method other than ngram (it
    raises nothing); specdec refused them ("only valid with method 'ngram'")."""
    c = sd.SpeculativeConfig.from_json({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
                                        "prompt_lookup_max": 4})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("mtp", 0, 0)
    c = sd.SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)


def test_s47_fixed_masks_are_made_once_a_request(monkeypatch):
    """allowed_token_ids and a penalized request's prompt tokens go to the device once a request (fixed_mask, kept
    on it), not at every step: per_row sent each list again every step, so one request with a long list (the server
    saw 0.01 -> 0.16-0.33 s gaps in another request's stream) slowed every request beside it. The processed logits
    are the hand reference's at every step."""
    V = 10
    rows = [(SamplingParams(allowed_token_ids=[2, 3, 5, 9], presence_penalty=-0.5), [5], [1], []),
            (SamplingParams(repetition_penalty=1.7), [1, 2, 2], [3], [])]
    objs = processor_rows(rows)
    calls = []
    real = sd.per_row
    monkeypatch.setattr(sd, "per_row", lambda ids, *a, **kw: calls.append([list(r) for r in ids]) or real(ids, *a, **kw))
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        logits = torch.randn(2, 2, V, generator=g)
        drafts = [[4], [2]]
        got = sd.process_logits(logits, torch.tensor(drafts), objs, [], cpu_h2d)
        assert_processed_as_reference(got, logits, rows, drafts, [])
        fixed = [c for c in calls if c in ([[2, 3, 5, 9]], [[]], [[5]], [[1, 2, 2]])]
        assert len(fixed) == 4, (step, calls)  # the allowed lists ([] for row 1) and the prompts: the first step only
        for r, (_, _, out, _) in zip(objs, rows):
            r.output_ids = out + [step]  # the next step's history
        rows = [(p, pr, out + [step], bw) for p, pr, out, bw in rows]


# ==============================================================================================
# The tokenizer and detokenizer against HF tokenizers and vLLM, session 48
# ==============================================================================================

def test_s48_added_tokens_found_before_nfc(tiny_dir, hf):
    """HF splits the added tokens out of the text as written and normalizes (NFC) only the text between them:
    "<|im_end|>" + U+0338 (combining long solidus) is EOS and the mark, not "<|im_end|" + "≯" (U+003E U+0338
    composes to U+226F); with special tokens as text (HF's encode_special_tokens) the whole text is normalized."""
    from tokenizers import Tokenizer as HFTokenizer
    tok = Tokenizer.from_dir(tiny_dir)
    plain = HFTokenizer.from_file(os.path.join(tiny_dir, "tokenizer.json"))
    plain.encode_special_tokens = True
    texts = ["<|im_end|>\u0338", "a<think>\u0338b</think>\u0338c", "e\u0301<|im_start|>x\u0338", "\u0338<|im_end|>",
             "x<|im_end|>\u0338<|im_end|>\u0338\u0338", "\u1fef<|im_end|>\u0338", "<<|im_start|>\u0338>"]
    assert any(tok.encode(t) != tok.encode(unicodedata.normalize("NFC", t)) for t in texts)  # the case exists
    for t in texts:
        assert tok.encode(t) == hf.encode(t, add_special_tokens=False).ids, t
        assert tok.encode(t, allow_special=False) == plain.encode(t, add_special_tokens=False).ids, t


def test_s48_bad_words_spelled_as_vllm_encodes_them(tiny_dir, hf):
    """vLLM's SamplingParams.update_from_tokenizer encodes each bad word with encode(add_special_tokens=False),
    which turns an added token's text into its id: bad_words=["<|im_end|>"] bans EOS (before: the word's
    letters, which the model never writes, so nothing was banned)."""
    eng = types.SimpleNamespace(tokenizer=Tokenizer.from_dir(tiny_dir))
    for word in ("<|im_end|>", "x<|endoftext|>", " hello<think>"):
        plain = hf.encode(word.lstrip(), add_special_tokens=False).ids
        spaced = hf.encode(" " + word.lstrip(), add_special_tokens=False).ids
        want = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        assert sd.Engine.bad_word_ids(eng, word) == want, word
    assert sd.Engine.bad_word_ids(eng, "<|im_end|>") == [[eng.tokenizer.id_of("<|im_end|>")]]


def _decode_stream_pieces(hf, prompt, ids):
    """vLLM's FastIncrementalDetokenizer: a DecodeStream primed with the prompt's suffix (its choice of suffix),
    then one step per output id; None -> ""."""
    from tokenizers.decoders import DecodeStream
    stream = DecodeStream(skip_special_tokens=False)
    suffix = prompt
    if len(prompt) > 4:
        for i in range(4, min(len(prompt) + 1, 24)):
            if "\ufffd" not in hf.decode(prompt[-i:], skip_special_tokens=False):
                suffix = prompt[-i:]
                break
    for t in suffix:
        stream.step(hf, t)
    return [stream.step(hf, t) or "" for t in ids]


def test_s48_detokenizer_releases_text_as_vllm(tiny_dir, hf):
    """IncrementalDecoder against tokenizers' DecodeStream as vLLM drives it (the reference: another library):
    text is released only when it does not end in U+FFFD (a space before a split character waits for it), a
    prompt that ends mid-character is completed by the output, and an unfinished character at the end is never
    released. Random prompts and outputs cut from encodings of mixed-script text, at every split point."""
    tok = Tokenizer.from_dir(tiny_dir)
    rng = random.Random(48)
    alphabet = ["a", " ", "\n", "é", "日本", "😀", "👨\u200d👩", "\U0001d400", " \U0001d400", "<|im_end|>", "中文 "]
    held_once = completed = 0
    for _ in range(150):
        ids = tok.encode("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))))
        cut = rng.randint(0, len(ids))
        prompt, out = ids[:cut], ids[cut:]
        dec = IncrementalDecoder(tok, prompt=prompt)
        got = [dec.add([t]) for t in out]
        assert got == _decode_stream_pieces(hf, prompt, out), (prompt, out)
        held_once += any(g == "" and tok.token_bytes(t) for g, t in zip(got, out))
        completed += bool(got) and got[0] != "" and not tok.decode(out[:1]).startswith(got[0][:1])
    assert held_once and completed  # both cases were drawn


def test_s48_engine_text_completes_and_drops_split_characters(toy47):
    """Through the engine: an output that completes the prompt's last character starts with that character;
    one that ends mid-character leaves it out of the text (token_ids keep it), as vLLM's detokenizer."""
    llm = toy47
    tok = llm.get_tokenizer()
    c = tok.encode("\U0001d400")
    assert len(c) > 1
    prompt = tok.encode("x = '") + c[:-1]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, allowed_token_ids=c[-1:]),
                       use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.text) == (c[-1:], "\U0001d400")
    out = llm.generate({"prompt_token_ids": tok.encode("x = '")},
                       SamplingParams(max_tokens=1, allowed_token_ids=c[:1]), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.text) == (c[:1], "")


def test_s48_tokenizer_call_arguments(tiny_dir):
    """tokenizer(text, split_special_tokens=True) treats special tokens' text as text (transformers'); an argument
    specdec's tokenizer does not implement is refused by name instead of ignored."""
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer.from_dir(tiny_dir)
    ref = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tiny_dir, "tokenizer.json"))
    for text in ("a<|im_end|>b<think>c", ["x<|endoftext|>", "y"]):
        for split in (False, True):
            want = ref(text, split_special_tokens=split)["input_ids"]
            assert tok(text, split_special_tokens=split)["input_ids"] == want
    assert tok("ab", padding=False, truncation=None)["input_ids"] == tok.encode("ab")
    for kw in ({"return_tensors": "pt"}, {"truncation": True, "max_length": 2}, {"padding": True}, {"foo": 1}):
        with pytest.raises(TypeError, match=f"{next(iter(kw))}=.*not supported by specdec's tokenizer"):
            tok("ab", **kw)


def test_s48_continue_final_message_must_appear_whole():
    """transformers refuses continue_final_message when the final message's text is not in the rendered chat (a
    template that moved inline reasoning out of it); specdec rendered a cut chat that was not the message."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x</think>\n\ny</think>z"}]
    with pytest.raises(ValueError, match="final message does not appear"):
        sd.ChatTemplate().render(msgs, add_generation_prompt=False, continue_final_message=True)
    msgs[-1]["content"] = [{"type": "text", "text": "Sure, "}]
    assert sd.ChatTemplate().render(msgs, add_generation_prompt=False, continue_final_message=True).endswith("Sure,")


def test_s48_child_seeds_are_seed_plus_index(toy47):
    """vLLM seeds a request's n samples seed + i on copies of its params (ParentRequest._get_child_sampling_params:
    no check again), so a parent seed of -2 gives a child seeded -1 (not unseeded: it repeats run to run), and a
    seed near 2**63 - 1 gives children past int64's range rather than an error."""
    llm = toy47
    sp = SamplingParams(temperature=1.0, seed=-2, n=3, max_tokens=12)
    assert [c.seed for c in sp.samples()] == [-2, -1, 0] and sp.seed == -2 and sp.n == 3
    runs = [[c.token_ids for c in llm.generate(["def f(x):"], sp, use_tqdm=False)[0].outputs] for _ in range(2)]
    assert runs[0] == runs[1] and len({tuple(t) for t in runs[0]}) > 1
    big = SamplingParams(temperature=1.0, seed=2 ** 63 - 1, n=2, max_tokens=3)
    assert [len(c.token_ids) for c in llm.generate("def", big, use_tqdm=False)[0].outputs] == [3, 3]


def test_s48_detokenize_false(toy47):
    """vLLM's detokenize=False: the same tokens, no text (the output processor has no tokenizer for the request, so
    the logprobs' decoded_token is None too); stop strings are refused with vLLM's message."""
    llm = toy47
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=1, prompt_logprobs=1)
    on = llm.generate("def fib(n):", sp, use_tqdm=False)[0]
    off = llm.generate("def fib(n):", dataclasses.replace(sp, detokenize=False), use_tqdm=False)[0]
    assert off.outputs[0].token_ids == on.outputs[0].token_ids and on.outputs[0].text and off.outputs[0].text == ""
    assert all(lp.decoded_token is None for d in off.outputs[0].logprobs + off.prompt_logprobs[1:] for lp in d.values())
    assert all(lp.decoded_token is not None for d in on.outputs[0].logprobs for lp in d.values())
    with pytest.raises(ConfigError, match=re.escape("stop strings are only supported when detokenize is True.")):
        SamplingParams(detokenize=False, stop=["x"])


@pytest.mark.parametrize("call, message", [
    (lambda llm: SamplingParams(structured_outputs=sd.StructuredOutputsParams(json_object=False)),
     "structured_outputs.json_object must be True if set; omit structured_outputs to disable structured outputs"),
    (lambda llm: llm.generate(["a", "b"], [], use_tqdm=False), "The lengths of prompts and sampling_params"),
    (lambda llm: llm.generate({"prompt_token_ids": "abc"}, use_tqdm=False),
     "a prompt's 'prompt_token_ids' must be a list of token ids, got 'abc'"),
    (lambda llm: llm.generate({"prompt": [5, 6]}, use_tqdm=False), "a prompt's 'prompt' must be a string"),
    (lambda llm: SamplingParams(logit_bias={198: "x"}), "logit_bias values must be numbers"),
    (lambda llm: llm.generate(5, use_tqdm=False), "prompts: a prompt .* or a list of them, got '5'"),
    (lambda llm: llm.chat("hello", use_tqdm=False), "messages: a conversation .* got 'hello'"),
    (lambda llm: llm.generate(["x"], {"max_tokens": 2}, use_tqdm=False), "sampling_params: a SamplingParams or"),
])
def test_s48_offline_arguments_refused_by_name(toy47, call, message):
    """Arguments of the wrong kind get one error naming what is wrong (before: json_object=False still constrained
    the output to JSON; an empty list of params used the defaults; a text under prompt_token_ids was tokenized; the
    rest were TypeErrors / AttributeErrors from deep inside), and the engine goes on."""
    with pytest.raises(ValueError, match=message):
        call(toy47)
    assert toy47.generate("def", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


# ==============================================================================================
# Damaged checkpoints: one line naming the problem (session 48's adversarial pass over loading)
# ==============================================================================================

def _toy_copy(tmp_path, name="ck"):
    if not os.path.isdir(TOY):
        pytest.skip("models/toy not present")
    d = tmp_path / name
    shutil.copytree(TOY, d)
    return str(d)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"])
def test_s48_invalid_json_names_its_file(tmp_path, name):
    """A file that is not JSON is named in the error (json's own message names no file)."""
    d = _toy_copy(tmp_path)
    with open(os.path.join(d, name), "w") as fh:
        fh.write("{'not': json")
    with pytest.raises(ValueError, match=re.escape(os.path.join(d, name)) + ": this .*is not valid JSON"):
        LLM(d, device="cpu", max_model_len=64)


def test_s48_generation_config_of_other_types(tmp_path):
    """generation_config.json that is not an object, or whose eos_token_id is not ids: one line naming it."""
    d = _toy_copy(tmp_path)
    for bad in ([1], {"eos_token_id": "8192"}, {"eos_token_id": [None]}):
        with open(os.path.join(d, "generation_config.json"), "w") as fh:
            json.dump(bad, fh)
        with pytest.raises(ConfigError, match="generation_config.json"):
            LLM(d, device="cpu", max_model_len=64)


def _shard(d, names_by_file, src=None):
    """Rewrite d's weights as the given shards {file: [tensor names]} (from the toy's own tensors)."""
    from safetensors.torch import load_file, save_file
    w = load_file(os.path.join(src or TOY, "model.safetensors"))
    os.remove(os.path.join(d, "model.safetensors"))
    for f, names in names_by_file.items():
        save_file({n: w[n].clone() for n in names}, os.path.join(d, f))
    return sorted(w)


def test_s48_shards_a_tensor_in_two_files_or_misplaced(tmp_path):
    """The index's weight_map is read: a tensor in two shards (one a zeroed copy, which the last file read used to
    win: garbage text, exit 0) and an entry whose shard lacks the tensor are refused; an entry outside the directory
    too. A well-formed sharded checkpoint still loads and decodes as the single file does."""
    names = _shard(_toy_copy(tmp_path, "probe"), {"a.safetensors": []})
    half = len(names) // 2
    ref = LLM(TOY, device="cpu", max_model_len=64).generate("def f():", SamplingParams(temperature=0, max_tokens=6),
                                                            use_tqdm=False)[0].outputs[0].token_ids
    d = _toy_copy(tmp_path, "ok")
    _shard(d, {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]})
    index = {"weight_map": {n: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, n in enumerate(names)}}
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as fh:
        json.dump(index, fh)
    out = LLM(d, device="cpu", max_model_len=64).generate("def f():", SamplingParams(temperature=0, max_tokens=6),
                                                          use_tqdm=False)[0].outputs[0].token_ids
    assert out == ref
    dup = _toy_copy(tmp_path, "dup")
    _shard(dup, {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:] + names[:1]})
    shutil.copy(os.path.join(d, "model.safetensors.index.json"), dup)
    with pytest.raises(ConfigError, match=f"tensor {re.escape(names[0])} is in both model-00001"):
        LLM(dup, device="cpu", max_model_len=64)
    moved = json.loads(json.dumps(index))
    moved["weight_map"][names[0]] = "model-00002-of-00002.safetensors"
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as fh:
        json.dump(moved, fh)
    with pytest.raises(ConfigError, match=f"tensor {re.escape(names[0])} is mapped to model-00002-of-00002"):
        LLM(d, device="cpu", max_model_len=64)
    moved["weight_map"][names[0]] = "/etc/passwd"
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as fh:
        json.dump(moved, fh)
    with pytest.raises(ConfigError, match="'/etc/passwd' is outside the checkpoint directory"):
        LLM(d, device="cpu", max_model_len=64)


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage"])
def test_s48_unreadable_safetensors_named(tmp_path, damage):
    """A truncated, empty or foreign weights file (an interrupted download) is one line naming it, in the target and
    in a drafter (before: safetensors' traceback)."""
    d = _toy_copy(tmp_path)
    f = os.path.join(d, "model.safetensors")
    data = open(f, "rb").read()
    with open(f, "wb") as fh:
        fh.write({"truncate": data[:len(data) // 2], "empty": b"", "garbage": os.urandom(4096)}[damage])
    with pytest.raises(ConfigError, match=re.escape(f) + ": not a readable safetensors file"):
        LLM(d, device="cpu", max_model_len=64)
    draft = _toy_copy(tmp_path, "draft")
    shutil.rmtree(draft)
    shutil.copytree(os.path.join(os.path.dirname(TOY), "toy-draft"), draft)
    shutil.copy(f, os.path.join(draft, "model.safetensors"))
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        LLM(TOY, device="cpu", max_model_len=64,
            speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2})


def test_s48_mtp_with_no_mtp_layers_in_config(tmp_path):
    """method mtp on a checkpoint whose config says mtp_num_hidden_layers 0 (its mtp.* tensors then unused): one line
    (before: TypeError 'NoneType' object is not callable inside the first step)."""
    d = _toy_copy(tmp_path)
    _edit_config(d, lambda c: c["text_config"].update(mtp_num_hidden_layers=0))
    with pytest.raises(ConfigError, match="mtp_num_hidden_layers 0"):
        LLM(d, device="cpu", max_model_len=64, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


@needs_gguf
@pytest.mark.parametrize("key, message", [
    (b"qwen35.rope.freq_base", "the GGUF metadata has no qwen35.rope.freq_base"),
    (b"qwen35.attention.layer_norm_rms_epsilon", "has no qwen35.attention.layer_norm_rms_epsilon"),
    (b"qwen35.block_count", "has no qwen35.block_count"),
    (b"qwen35.embedding_length", "has no qwen35.embedding_length"),
    (b"tokenizer.ggml.merges", "has no tokenizer.ggml.merges"),
    (b"tokenizer.ggml.model", "tokenizer.ggml.model None: specdec reads byte-level BPE"),
])
def test_s48_gguf_missing_metadata_named(tmp_path, key, message):
    """A GGUF file without a metadata key specdec needs is refused naming the key (before: a missing float became
    NaN weights and the text '!!!!!!!!' with exit 0; no merges tokenized wrongly; a missing integer a TypeError).
    The key is renamed in place (same length), as a damaged or hand-edited file would have it."""
    src = str(tmp_path / "ok.gguf")
    gguf_from_checkpoint(TOY, src, "F32")
    data = open(src, "rb").read()
    assert data.count(key) >= 1
    bad = str(tmp_path / "bad.gguf")
    with open(bad, "wb") as fh:
        fh.write(data.replace(key, key[:-1] + b"_", 1))
    with pytest.raises(ConfigError, match=re.escape(bad) + ": .*" + re.escape(message)):
        LLM(bad, device="cpu", max_model_len=64)


@needs_gguf
def test_s48_gguf_truncated_or_a_folder(tmp_path):
    """A truncated GGUF file and a folder named *.gguf: one line each, saying what is wrong."""
    src = str(tmp_path / "ok.gguf")
    gguf_from_checkpoint(TOY, src, "F32")
    data = open(src, "rb").read()
    for cut in (len(data) // 2, len(data) - 1000, 64):
        bad = str(tmp_path / f"cut{cut}.gguf")
        with open(bad, "wb") as fh:
            fh.write(data[:cut])
        with pytest.raises(ConfigError, match=re.escape(bad) + ": .*(not a readable GGUF file|truncated)"):
            LLM(bad, device="cpu", max_model_len=64)
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(ConfigError, match="not a file"):
        LLM(str(tmp_path / "dir.gguf"), device="cpu", max_model_len=64)


def test_s48_model_argument_of_another_type():
    """LLM(model=123) / model="" are one line (a TypeError inside os.path before; "" silently took the toy model)."""
    for bad in (123, "", ["models/toy"]):
        with pytest.raises(ConfigError, match="model must be a path or a Hugging Face model id"):
            LLM(model=bad, device="cpu")


def test_s48_explicit_mtp_with_another_model_refused(tmp_path, tiny):
    """{"method": "mtp", "model": X}: vLLM loads the MTP layer from X; specdec drafts with the target's own head, so
    an X that is not the target (or does not exist) is refused in one line instead of ignored; the target itself,
    or no model, is mtp as before."""
    spec = lambda **kw: sd.SpeculativeConfig.from_json(kw, target=tiny)  # noqa: E731
    for other in (str(tmp_path / "nonexistent"), TOY):
        with pytest.raises(ConfigError, match="specdec's mtp drafts with the target's own MTP head"):
            spec(method="mtp", model=other, num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="specdec's mtp drafts with the target's own MTP head"):
        spec(method="qwen3_next_mtp", model=TOY, num_speculative_tokens=2)
    for c in (spec(method="mtp", model=tiny, num_speculative_tokens=2), spec(method="mtp", num_speculative_tokens=2)):
        assert (c.method, c.model, c.num_speculative_tokens) == ("mtp", None, 2)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["dflash_config"].update(mask_token_id="x"), "mask_token_id must be a non-negative integer, got 'x'"),
    (lambda c: c.update(block_size=0), "block_size must be a positive integer, got 0"),
    (lambda c: c.update(block_size=-3), "block_size must be a positive integer, got -3"),
    (lambda c: c["dflash_config"].update(target_layer_ids="1,3"), "target_layer_ids must be a list of layer numbers"),
])
def test_s48_dflash_config_values_checked(tmp_path, edit, message):
    """A DFlash drafter's mask_token_id, block_size and target_layer_ids of the wrong type or range are one line
    naming the key (before: int()'s message naming nothing, or a block of 0 / -3 tokens accepted)."""
    src = os.path.join(os.path.dirname(TOY), "toy-dflash")
    if not os.path.isdir(src):
        pytest.skip("models/toy-dflash not present")
    d = str(tmp_path / "dflash")
    shutil.copytree(src, d)
    assert "DFlashDraftModel" in _read_json(os.path.join(d, "config.json"))["architectures"]
    _edit_config(d, edit)
    with pytest.raises(ConfigError, match=re.escape(message)):
        sd.read_block_config(d, "dflash")


# ==============================================================================================
# Loading refusals left alone in session 48, session 49
# =======================================================================================



def _s49_retype(path, name, dtype):
    """Checkpoint path with tensor `name` stored in dtype (bool: its positive entries), as a damaged export has it."""
    from safetensors.torch import load_file, save_file
    f = os.path.join(path, "model.safetensors")
    w = load_file(f)
    w[name] = w[name] > 0 if dtype == torch.bool else w[name].to(dtype)
    save_file(w, f)
    return path


S49_DRAFTERS = {  # layout -> (writer(path, target), method, k)
    "dflash": (write_dflash, "dflash", 3),
    "dflash_small_vocab": (lambda p, t: write_dflash(p, t, reduced=True), "dflash", 3),
    "dspark": (write_dspark_native, "dspark", 4),
    "dspark_spec": (write_dspark_speculators, "dspark", 4),
    "qwen3_draft": (lambda p, t: write_qwen3_lm(p, 1024), "draft_model", 2),
    "hybrid_draft": (lambda p, t: write_tiny_checkpoint(p, mtp=False, seed=5), "draft_model", 2),
}


@pytest.mark.parametrize("layout, name, dtype, message", [
    ("dflash", "layers.0.self_attn.q_proj.weight", torch.int32, "is torch.int32, expected a floating-point weight"),
    ("dflash", "layers.0.mlp.up_proj.weight", torch.bool, "is torch.bool, expected a floating-point weight"),
    ("dflash", "fc.weight", torch.int64, "is torch.int64, expected a floating-point weight"),
    ("dflash_small_vocab", "d2t", torch.float32, r"is torch.float32, expected torch.int64 \(integer ids\)"),
    ("dspark", "markov_head.markov_w1.weight", torch.int16, "is torch.int16, expected a floating-point weight"),
    ("dspark_spec", "layers.1.self_attn.k_proj.weight", torch.bool, "is torch.bool, expected a floating-point"),
    ("qwen3_draft", "model.layers.0.self_attn.v_proj.weight", torch.int8, "is torch.int8, expected a floating"),
    ("hybrid_draft", "model.language_model.layers.0.mlp.gate_proj.weight", torch.int32, "is torch.int32, expected"),
    (None, "model.language_model.layers.3.self_attn.k_proj.weight", torch.bool, "is torch.bool, expected a floating"),
])
def test_s49_load_integer_or_bool_weights_refused(tmp_path, tiny, layout, name, dtype, message):
    """A tensor of an integer or bool dtype where a floating weight belongs (or a floating d2t, the reduced
    vocabulary's integer offsets) is one line naming the tensor and its dtype, in every drafter layout and in the
    target (load_weights, the one loader). Before: a projection that fuses (q | k | v, gate | up) was cast silently
    by torch.cat and the drafter ran on the cast weights; the others failed inside a matmul, a float d2t inside an
    index."""
    if layout is None:
        target = _s49_retype(shutil.copytree(tiny, str(tmp_path / "target")), name, dtype)
        with pytest.raises(ConfigError, match=f"tensor '{re.escape(name)}' {message}"):
            LLM(model=target, device="cpu", max_model_len=64)
        return
    write, method, k = S49_DRAFTERS[layout]
    draft = write(str(tmp_path / "draft"), tiny)
    LLM(model=tiny, device="cpu", max_model_len=64,        # as written it loads
        speculative_config={"method": method, "model": draft, "num_speculative_tokens": k})
    _s49_retype(draft, name, dtype)
    with pytest.raises(ConfigError, match=f"tensor '{re.escape(name)}' {message}.*{re.escape(draft)}"):
        LLM(model=tiny, device="cpu", max_model_len=64,
            speculative_config={"method": method, "model": draft, "num_speculative_tokens": k})


def test_s49_load_integer_mask_embedding_refused(tmp_path, tiny):
    """A block drafter's mask_embedding.pt of an integer dtype is refused naming the file (before: cast silently)."""
    draft = write_dflash(str(tmp_path / "draft"), tiny)
    torch.save(torch.ones(64, dtype=torch.long), os.path.join(draft, "mask_embedding.pt"))
    with pytest.raises(ConfigError, match="mask_embedding.pt: the mask embedding is torch.int64, expected a floating"):
        LLM(model=tiny, device="cpu", max_model_len=64,
            speculative_config={"method": "dflash", "model": draft, "num_speculative_tokens": 3})


@pytest.mark.parametrize("aux", ["1,3", ["0", "2"], [[0], [2]], [True, False], [], 2, None, [1.0, 2.0]])
def test_s49_load_speculators_aux_ids_of_another_type(tmp_path, tiny, aux):
    """The speculators layout's aux_hidden_state_layer_ids that is not a list of layer numbers (a string, strings,
    nested lists, bools, empty, missing) is one line naming the field (before: a TypeError from `i - 1`, a KeyError,
    or bools taken as layers 0 and -1)."""
    draft = write_dspark_speculators(str(tmp_path / "dspark"), tiny)
    assert sd.read_block_config(draft, "dspark").target_layer_ids == [-1, 1, 3]
    _edit_config(draft, lambda c: c.pop("aux_hidden_state_layer_ids") if aux is None
                 else c.update(aux_hidden_state_layer_ids=aux))
    with pytest.raises(ConfigError, match=re.escape(f"(speculators dspark): aux_hidden_state_layer_ids must be a "
                                                    f"list of layer numbers, got {aux!r}")):
        sd.read_block_config(draft, "dspark")


def test_s49_load_bf16_checkpoint_declaring_fp8_refused(tmp_path):
    """A bf16 checkpoint whose config.json declares Qwen's FP8 quantization_config, its linears bf16 without
    weight_scale_inv: one line naming the first such tensor (vLLM's fp8 loader wants float8 weights with scales
    there; before: loaded as bf16, silently). Modules that modules_to_not_convert lists are bf16 by right: with every
    linear listed the same files load, unquantized; and Qwen's FP8 layout (to_fp8) still loads as FP8."""
    src = write_tiny_checkpoint(str(tmp_path / "src"), bf16=True, sizes=FP8_BLOCKS)
    quant = json.load(open(os.path.join(to_fp8(src, str(tmp_path / "fp8")), "config.json")))["quantization_config"]
    bf16 = rewrite(src, str(tmp_path / "bf16"), read_tensors(src), quant)
    first = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"
    with pytest.raises(ConfigError, match=re.escape(f"{bf16}: tensor '{first}' is torch.bfloat16 without block "
                                                    f"scales (no {first}_scale_inv beside it), but the config's "
                                                    "quantization_config is FP8 and modules_to_not_convert does not "
                                                    "list 'layers.0.linear_attn.in_proj_qkv'")):
        LLM(model=bf16, device="cpu", max_model_len=64)
    listed = dict(quant, modules_to_not_convert=quant["modules_to_not_convert"] + [first.removesuffix(".weight")])
    second = rewrite(src, str(tmp_path / "bf16b"), read_tensors(src), listed)
    with pytest.raises(ConfigError, match="tensor 'model.language_model.layers.0.linear_attn.in_proj_z.weight' is "
                                          "torch.bfloat16 without block scales"):
        LLM(model=second, device="cpu", max_model_len=64)                           # the next one is named
    every = dict(quant, modules_to_not_convert=sorted(n.removesuffix(".weight") for n in read_tensors(src)))
    llm = LLM(model=rewrite(src, str(tmp_path / "all"), read_tensors(src), every), device="cpu", max_model_len=64)
    assert not any(p.dtype == sd.FP8 for p in llm.model.parameters())
    assert LLM(model=str(tmp_path / "fp8"), device="cpu", max_model_len=64).model.layers[0].mlp.up_proj.weight.dtype \
        == sd.FP8


def test_s49_load_drafter_hub_id_not_in_cache(tmp_path, tiny, monkeypatch):
    """A drafter named by a hub id that the local Hugging Face cache lacks gets the target's line: the path looked in
    and `hf download` (before: "no config.json", as if the id were a directory). The config still parses (vLLM infers
    the method from the name, as test_spec_config_inference_and_aliases checks); the drafter's loader refuses. One
    in the cache loads from its snapshot."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    name = "z-lab/Qwen3.6-27B-DFlash"
    repo = tmp_path / "hub" / "models--z-lab--Qwen3.6-27B-DFlash"
    for method, what in (("dflash", "dflash draft"), ("dspark", "dspark draft"), ("draft_model", "draft_model"),
                         (None, "dflash draft")):                               # None: dflash, from the name
        spec = {"method": method, "model": name, "num_speculative_tokens": 4}
        with pytest.raises(ConfigError) as e:
            LLM(model=tiny, device="cpu", max_model_len=64, speculative_config=spec)
        assert str(e.value).startswith(f"{what} '{name}' is not a local path") and "\n" not in str(e.value)
        assert f"looked in {repo}/snapshots" in str(e.value) and f"`hf download {name}`" in str(e.value)
    (repo / "snapshots").mkdir(parents=True)
    shutil.copytree(write_dflash(str(tmp_path / "dflash"), tiny), repo / "snapshots" / "abc")
    llm = LLM(model=tiny, device="cpu", max_model_len=64,
              speculative_config={"method": "dflash", "model": name, "num_speculative_tokens": 3})
    assert llm.spec.model == str(repo / "snapshots" / "abc")


# ==============================================================================================
# The server against a hostile client, session 49
# ==============================================================================================
# A careless or hostile client's input gets a 400 naming the field (vLLM's error body), never a wrong reading of it,
# and never makes the other requests wait. This section's server refuses to tokenize bad words on its engine thread
# (the loop that steps every request): that is the handler threads' work, as it is vLLM's front end's.

ENGINE_THREAD_TOKENIZES_NO_BAD_WORDS = '''
import threading, specdec
bad_word_ids = specdec.Engine.bad_word_ids

def _bad_word_ids(self, word):
    if threading.current_thread().name == "engine":
        raise RuntimeError("bad words tokenized on the engine thread")
    return bad_word_ids(self, word)

specdec.Engine.bad_word_ids = _bad_word_ids
'''

srv_s49 = server_fixture("srv_s49", "--max-num-seqs", "4", prelude=ENGINE_THREAD_TOKENIZES_NO_BAD_WORDS)


def test_s49_server_stream_options_are_booleans(srv_s49):
    """stream_options' include_usage and continuous_usage_stats are booleans read as vLLM's pydantic reads them:
    "false" is false (before: any non-empty string was true, so the usage came), "abc" or a list is a 400 naming
    the field, before the stream starts (before: accepted); include_usage null is false, {} has the usage."""
    body = {"prompt": "x", "max_tokens": 3, "stream": True}

    def events(opts):
        status, _, data = srv_s49.request("POST", "/v1/completions", dict(body, stream_options=opts))
        assert status == 200, data
        return sse_events(data)
    for opts in ({"include_usage": "false"}, {"include_usage": None}, {"include_usage": 0}):
        assert all("usage" not in e for e in events(opts)), opts
    assert events({})[-1]["usage"]["completion_tokens"] == 3
    every = events({"include_usage": "true", "continuous_usage_stats": "yes"})
    assert all(e["usage"] is not None for e in every) and every[-1]["usage"]["completion_tokens"] == 3
    for opts, name in (({"include_usage": "abc"}, "stream_options.include_usage"),
                       ({"continuous_usage_stats": [1]}, "stream_options.continuous_usage_stats")):
        check_error(*srv_s49.post("/v1/completions", dict(body, stream_options=opts)), 400, name, "must be a boolean")
        check_error(*srv_s49.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "stream": True,
                                                           "stream_options": opts}), 400, name, "must be a boolean")


def test_s49_server_model_of_another_type(srv_s49):
    """A `model` that is not a string (a list, an object, a number) is a 400 naming the field, as vLLM's (before: a
    404 "The model `['x']` does not exist." with Python's spelling of it); an unknown name stays a 404."""
    name = srv_model(srv_s49)
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}), ("/tokenize", {"prompt": "x"})):
        for model in ([name], {"id": name}, 5):
            check_error(*srv_s49.post(path, dict(body, model=model)), 400, "model", "'model' must be a string")
        check_error(*srv_s49.post(path, dict(body, model="nope")), 404, "model", "The model `nope` does not exist.")
        assert srv_s49.post(path, dict(body, model=name))[0] == 200


def test_s49_server_content_parts_of_other_types(srv_s49):
    """A chat content part is read as text only if its type is a text type (text, input_text, output_text): one of
    another type (a typo, an image) or none is a 400 naming it, as vLLM's "Unsupported chat content part type"
    (before: any part with a "text" string was read as text, whatever its type, and an image part got only "must be
    a string or a list of text parts")."""
    def post(part, path="/v1/chat/completions"):
        return srv_s49.post(path, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, part]}],
                                   "max_tokens": 1})
    for part, fragment in (({"type": "txet", "text": "b"}, 'content part type "txet" is not supported'),
                           ({"text": "b"}, "a content part has no 'type'"),
                           ({"type": "image_url", "image_url": {"url": "data:,"}},
                            'content part type "image_url" is not supported')):
        for path in ("/v1/chat/completions", "/tokenize"):
            check_error(*post(part, path), 400, "messages", "messages[0]: " + fragment)
    for kind in ("text", "input_text", "output_text"):
        assert post({"type": kind, "text": "b"})[0] == 200
    check_error(*post({"type": "input_text", "text": None}), 400, "messages", "must be a string or a list of text "
                "parts")  # (a null "text" part is skipped, as vLLM's: test_s51_server_null_text_part_skipped)


def test_s49_server_bad_words_tokenized_off_the_engine_thread(srv_s49):
    """A request's bad words are tokenized by its handler thread: the engine thread (which steps every request) only
    gets their token ids. Before, it tokenized them as it admitted the request, every other request waiting: 100
    words of 100 KB held a small request up 0.1 -> 1.8 s (this server's engine thread refuses to: a 500 before).
    Each of n samples and of a batch's prompts is held to them; a word of no tokens is a 400 naming bad_words."""
    base = {"prompt": "x", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    status, free = srv_s49.post("/v1/completions", base)
    assert status == 200, free
    first = free["choices"][0]["token_ids"][0]
    word = srv_s49.post("/detokenize", {"tokens": [first]})[1]["prompt"]
    tok = sd.Tokenizer.from_dir(srv_model(srv_s49))
    if tok.encode(word.lstrip()) != [first]:
        pytest.skip(f"the greedy first token {word!r} is not a word of its own")
    for more in ({}, {"n": 2, "temperature": 1.0, "seed": 1}, {"prompt": ["x", "x"]}):
        status, out = srv_s49.post("/v1/completions", dict(base, bad_words=[word], **more))
        assert status == 200, out
        assert all(first not in c["token_ids"] for c in out["choices"]) and len(out["choices"]) == 1 + bool(more)
    check_error(*srv_s49.post("/v1/completions", dict(base, bad_words=["  "])), 400, "bad_words",
                "bad_words entries must tokenize to at least one token")
    assert srv_s49.request("GET", "/health")[0] == 200


def test_s49_server_long_bad_words_checked_from_their_last_tokens():
    """banned_tokens (each step of a request with bad words, in the loop that steps every request) compares a bad
    word's tokens whole only where the history ends with its next-to-last token: before, each step copied every
    word (4096 words of 1000 tokens made the other requests' steps 7x slower for the request's life). The same
    bans: a one-token word always, a longer one where its other tokens end the history (drafts included)."""
    slices = []

    class Word(list):
        def __getitem__(self, k):
            if isinstance(k, slice):
                slices.append(k)
            return super().__getitem__(k)
    row = types.SimpleNamespace(output_ids=[1, 2, 3], bad_words_ids=[Word([5] * 999 + [6]), Word([4, 6]), Word([9])])
    assert sd.banned_tokens(row, [4, 7], 3) == [(0, 9), (1, 6), (1, 9), (2, 9)]
    assert slices == [slice(None, -1)]  # the two-token word's, where the history ends with its 4; never the long one
    row.output_ids = [0] + [5] * 999
    assert sd.banned_tokens(row, [], 1) == [(0, 6), (0, 9)]


def test_s49_server_hostile_requests_beside_good_ones(srv_s49):
    """Bad requests of every kind sent at once with good ones: each bad one gets its 400 (JSON, naming the problem),
    the good ones their greedy answers as when alone, and the server stays healthy with nothing left running."""
    good = [{"prompt": f"def f{i}(x):", "max_tokens": 12, "temperature": 0, "ignore_eos": True} for i in range(4)]
    alone = [srv_s49.post("/v1/completions", b)[1]["choices"][0]["text"] for b in good]
    bad = [(b'{"prompt": "x",', "not valid JSON"), ({"prompt": [10 ** 9]}, "out of range"),
           ({"prompt": "x", "max_tokens": 10 ** 30}, "maximum context length"),
           ({"prompt": "x", "stop": ["a", ""]}, "empty string"), ({"prompt": "x", "logprobs": 10 ** 9}, "logprobs"),
           ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "abc"}}, "include_usage"),
           ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"), ({"prompt": "x", "model": ["x"]}, "'model' must be"),
           ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "image_url")]
    with concurrent.futures.ThreadPoolExecutor(len(good) + len(bad)) as pool:
        goods = [pool.submit(srv_s49.post, "/v1/completions", b) for b in good]
        path = lambda b: "/v1/chat/completions" if isinstance(b, dict) and "messages" in b else "/v1/completions"
        bads = [pool.submit(srv_s49.request, "POST", path(b), b, {"Content-Type": "application/json"}) for b, _ in bad]
        for f, want in zip(goods, alone):
            status, out = f.result()
            assert status == 200 and out["choices"][0]["text"] == want
        for f, (_, fragment) in zip(bads, bad):
            status, _, data = f.result()
            assert status == 400 and fragment in json.loads(data)["error"]["message"], data
    assert srv_s49.request("GET", "/health")[0] == 200
    wait_idle(srv_s49)


# ==============================================================================================
# Drafter and GGUF loading leftovers, session 49
# ==============================================================================================

@pytest.mark.parametrize("content, message", [
    (torch.ones(63), r"the mask embedding has shape \(63,\), expected hidden_size \(64\) elements"),
    (torch.ones(2, 64), r"the mask embedding has shape \(2, 64\), expected hidden_size \(64\) elements"),
    ({"embedding": torch.ones(32)}, r"the mask embedding has shape \(32,\), expected hidden_size \(64\)"),
    ({"emb": torch.ones(64)}, r"a dict without an 'embedding' key \(keys \['emb'\]\)"),
    ([1.0] * 64, r"holds a list, expected the mask embedding, a tensor of hidden_size \(64\) elements"),
    ({"embedding": "x"}, r"holds a str, expected the mask embedding"),
    (b"", r"not a readable torch.save file \(EOFError\)"),
    (b"PK\x03\x04" + bytes(60), r"not a readable torch.save file \(RuntimeError\)"),
    (bytes(range(256)) * 4, r"not a readable torch.save file \(\w+\)"),
], ids=["63", "2x64", "dict-32", "dict-no-embedding", "list", "dict-str", "empty", "cut-zip", "foreign"])
def test_s49_load2_mask_embedding_damaged_named(tmp_path, tiny, content, message):
    """A block drafter's mask_embedding.pt of the wrong size, a dict without 'embedding', not a tensor, or not a
    readable torch.save file (empty, cut, foreign bytes): one line naming the file (before: a wrong size loaded and
    failed inside the first draft, or none; the rest a KeyError, AttributeError or the unpickler's traceback). The
    layouts as exported, [H], [1, H] and {"embedding": [H]}, still load, as the trained mask."""
    draft = write_dflash(str(tmp_path / "draft"), tiny)
    f = os.path.join(draft, "mask_embedding.pt")
    spec = {"method": "dflash", "model": draft, "num_speculative_tokens": 3}
    for good in (torch.full((64,), 0.5), torch.full((1, 64), 0.5), {"embedding": torch.full((64,), 0.5)}):
        torch.save(good, f)
        llm = LLM(model=tiny, device="cpu", max_model_len=64, speculative_config=spec)
        assert torch.equal(llm.engine.runner.proposer.mask_vec.float(), torch.full((64,), 0.5))
    if isinstance(content, bytes):
        with open(f, "wb") as fh:
            fh.write(content)
    else:
        torch.save(content, f)
    with pytest.raises(ConfigError, match=re.escape(f) + ": " + message):
        LLM(model=tiny, device="cpu", max_model_len=64, speculative_config=spec)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("transformer_layer_config"), "transformer_layer_config must be a JSON object (the draft "
                                                  "layers' Qwen3 config), got 'None'"),
    (lambda c: c.update(transformer_layer_config=[64, 2]), "transformer_layer_config must be a JSON object"),
    (lambda c: c.update(transformer_layer_config="qwen3"), "transformer_layer_config must be a JSON object"),
    (lambda c: c["transformer_layer_config"].pop("hidden_size"), "transformer_layer_config: the config has no "
                                                                 "'hidden_size'"),
    (lambda c: c["transformer_layer_config"].pop("num_attention_heads"), "transformer_layer_config: the config "
                                                                         "has no 'num_attention_heads'"),
    (lambda c: c["transformer_layer_config"].update(num_hidden_layers="2"), "transformer_layer_config: "
                                                                            "num_hidden_layers must be a positive "
                                                                            "integer, got '2'"),
    (lambda c: c["transformer_layer_config"].update(intermediate_size=0), "intermediate_size must be a positive "
                                                                          "integer, got 0"),
    (lambda c: c["transformer_layer_config"].update(num_key_value_heads=2.5), "num_key_value_heads must be a "
                                                                              "positive integer, got 2.5"),
    (lambda c: c["transformer_layer_config"].update(rms_norm_eps="1e-6"), "rms_norm_eps must be a positive "
                                                                          "number, got '1e-6'"),
    (lambda c: c["transformer_layer_config"].update(rope_parameters=[1]), "rope_parameters must be a JSON "
                                                                          "object, got '[1]'"),
], ids=["missing", "list", "str", "no-hidden_size", "no-heads", "str-layers", "zero-intermediate", "float-kv-heads",
        "str-eps", "rope-list"])
def test_s49_load2_speculators_layer_config_checked(tmp_path, tiny, edit, message):
    """The speculators layout's transformer_layer_config missing or not an object, or a number in it missing or of
    another type: one line naming the field (before: a KeyError, an AttributeError, or a layer_types complaint for
    num_hidden_layers "2")."""
    draft = write_dspark_speculators(str(tmp_path / "dspark"), tiny)
    assert sd.read_block_config(draft, "dspark").num_hidden_layers == 2
    _edit_config(draft, edit)
    with pytest.raises(ConfigError, match=re.escape(f"{draft} (speculators dspark)") + ".*" + re.escape(message)):
        sd.read_block_config(draft, "dspark")


def test_s49_load2_qwen3_fields_checked_in_other_layouts(tmp_path, tiny):
    """The same check (qwen3_fields) in the z-lab layout's top-level config and a plain Qwen3 draft_model: a missing
    number is named (before: KeyError 'vocab_size' / 'intermediate_size')."""
    draft = write_dflash(str(tmp_path / "dflash"), tiny)
    _edit_config(draft, lambda c: c.pop("vocab_size"))
    with pytest.raises(ConfigError, match=re.escape(f"{draft} (z-lab DFlashDraftModel): the config has no "
                                                    "'vocab_size'")):
        sd.read_block_config(draft, "dflash")
    lm = write_qwen3_lm(str(tmp_path / "qwen3"), 1024)
    _edit_config(lm, lambda c: c.pop("intermediate_size"))
    with pytest.raises(ConfigError, match=re.escape(f"draft_model {lm}: the config has no 'intermediate_size'")):
        LLM(model=tiny, device="cpu", max_model_len=64,
            speculative_config={"method": "draft_model", "model": lm, "num_speculative_tokens": 2})


@needs_gguf
@pytest.mark.parametrize("moe, name, dtype", [
    (False, "token_embd.weight", np.int32),
    (False, "blk.0.attn_qkv.weight", np.int8),
    (False, "blk.1.attn_norm.weight", np.int16),
    (False, "blk.2.ssm_a", np.int64),
    (True, "blk.0.ffn_up_exps.weight", np.int16),
])
def test_s49_load2_gguf_integer_tensor_refused(tmp_path, monkeypatch, tiny, tiny_moe, moe, name, dtype):
    """A GGUF tensor stored with an integer type (I8 / I16 / I32 / I64) where every qwen35 tensor is a float weight:
    one line naming the tensor and its GGUF type (before: gguf-py's NotImplementedError traceback, or a silent cast
    to the model dtype where the reader converts integers). Written by write_gguf, the named tensor handed to the
    GGUF writer as an integer array (the writer then records its type as I8 .. I64)."""
    add_tensor = gguf.GGUFWriter.add_tensor

    def add(self, gname, data, raw_shape=None, raw_dtype=None, **kw):
        if gname == name:  # the float values, rounded: an integer tensor of the same shape
            return add_tensor(self, gname, np.round(np.asarray(data, np.float32) * 100).astype(dtype), **kw)
        return add_tensor(self, gname, data, raw_shape, raw_dtype, **kw)
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add)
    f = gguf_from_checkpoint(tiny_moe if moe else tiny, str(tmp_path / "m.gguf"), "F32")
    monkeypatch.undo()
    kind = {np.int8: "I8", np.int16: "I16", np.int32: "I32", np.int64: "I64"}[dtype]
    assert {t.name: t.tensor_type.name for t in gguf.GGUFReader(f).tensors}[name] == kind
    with pytest.raises(ConfigError, match=re.escape(f"{f}: tensor {name} is stored as GGUF type {kind}, an integer "
                                                    "type; expected a float (F32, F16, BF16) or quantized weight")):
        LLM(model=f, device="cpu", max_model_len=64)


# ==============================================================================================
# The server's vLLM parity nits, session 49
# ==============================================================================================
# Where the server differed from vLLM in what a refused request leaves behind, the field an error names, or the
# content it reads: a batch is checked whole before any prompt runs, errors name the request's field (by its path
# when nested), and a chat's refusal and thinking parts are read as text.

def test_s49_parity_batch_checked_before_any_prompt_runs(srv_s49):
    """A /v1/completions batch whose last prompt is bad (too long for the context, an id out of the vocabulary,
    empty) is refused before any of its prompts runs, as vLLM validates every prompt first: nothing of it is counted
    in /metrics (before, the good prompts before it ran, and were counted as successes, tokens and all)."""
    names = ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
    for bad_prompt, fragment in (([5] * 5000, "maximum context length"), ([10 ** 9], "out of range"),
                                 ("", "the prompt is empty")):
        for good in (["a b", "c d", "e f"], [[5, 6], [7, 8], [9, 10]]):
            before = wait_idle(srv_s49)
            status, out = srv_s49.post("/v1/completions", {"prompt": good + [bad_prompt], "max_tokens": 1})
            check_error(status, out, 400, None, fragment)
            after = wait_idle(srv_s49)
            assert [metric(after, n) for n in names] == [metric(before, n) for n in names], (good, bad_prompt)
    status, out = srv_s49.post("/v1/completions", {"prompt": ["a b", "c d"], "max_tokens": 1})
    assert status == 200 and len(out["choices"]) == 2  # (a good batch still runs whole)


def test_s49_parity_logit_bias_out_of_vocab_names_the_field(srv_s49):
    """A logit_bias token id outside the vocabulary is a 400 naming logit_bias, with vLLM's message (its
    VLLMValidationError's parameter); before, param was null, the engine's refusal naming no field."""
    for bias in ({"-1": 1}, {str(10 ** 6): 2, "0": 1}):
        for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 1}), ("/v1/responses", {"input": "x"}),
                           ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})):
            check_error(*srv_s49.post(path, dict(body, logit_bias=bias)), 400, "logit_bias",
                        "in logit_bias contain out-of-vocab token ids. Vocabulary size:")
    assert srv_s49.post("/v1/completions", {"prompt": "x", "max_tokens": 1, "logit_bias": {"0": 1}})[0] == 200


def test_s49_parity_responses_max_output_tokens_named_as_sent(srv_s49):
    """/v1/responses reads max_output_tokens by its own name: a value of another type is a 400 naming
    max_output_tokens in its message (vLLM's pydantic error names it so; before: "'max_tokens' must be an
    integer", the chat field it becomes). One below 1 keeps vLLM's message, which its SamplingParams gives the
    max_tokens made of it; a numeric string is read as pydantic reads it."""
    for v in ("abc", [1], 1.5):
        check_error(*srv_s49.post("/v1/responses", {"input": "x", "max_output_tokens": v}), 400, "max_output_tokens",
                    "'max_output_tokens' must be an integer")
    check_error(*srv_s49.post("/v1/responses", {"input": "x", "max_output_tokens": 0}), 400, "max_output_tokens",
                "max_tokens must be at least 1, got 0.")
    status, out = srv_s49.post("/v1/responses", {"input": "x", "max_output_tokens": "2", "ignore_eos": True})
    assert status == 200 and out["usage"]["output_tokens"] == 2, out


def test_s49_parity_nested_fields_named_by_their_path(srv_s49):
    """An error in a nested field names it by its path, as OpenAI's errors do (vLLM's pydantic errors give the same
    path in their message): stream_options.include_usage, stream_options.continuous_usage_stats, text.format (before:
    include_usage, continuous_usage_stats, format, and text for the Responses format's other errors)."""
    stream = {"prompt": "x", "max_tokens": 1, "stream": True}
    for opts, name in (({"include_usage": "abc"}, "stream_options.include_usage"),
                       ({"continuous_usage_stats": [1]}, "stream_options.continuous_usage_stats")):
        check_error(*srv_s49.post("/v1/completions", dict(stream, stream_options=opts)), 400, name,
                    f"'{name}' must be a boolean")
    for fmt, fragment in ((5, "'text.format' must be an object"), ({"type": "xml"}, "is not supported"),
                          ({"type": "json_schema", "schema": 5}, "json_schema")):
        check_error(*srv_s49.post("/v1/responses", {"input": "x", "text": {"format": fmt}}), 400, "text.format",
                    fragment)
    check_error(*srv_s49.post("/v1/responses", {"input": "x", "text": 5}), 400, "text", "'text' must be an object")


def test_s49_parity_refusal_and_thinking_parts_read_as_text(srv_s49):
    """A chat content part of type refusal or thinking is read as text, from its "refusal" or "thinking" key, as
    vLLM's chat parser reads them (its TEXT_PART_TYPES): the prompt is that of a text part of the same text (before:
    a 400, "content part type ... is not supported"); one whose text is not a string is still a 400."""
    def tokens(parts):
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": parts},
                {"role": "user", "content": "again"}]
        status, out = srv_s49.post("/tokenize", {"messages": msgs})
        assert status == 200, out
        return out["tokens"]
    text = lambda s: {"type": "text", "text": s}  # noqa: E731
    assert tokens([{"type": "refusal", "refusal": "no way"}]) == tokens([text("no way")]) != tokens([text("sure")])
    assert tokens([text("a"), {"type": "thinking", "thinking": "b"}]) == tokens([text("a"), text("b")])
    msgs = [{"role": "user", "content": [text("q"), {"type": "thinking", "thinking": "hm"}]},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}, {"role": "user", "content": "x"}]
    assert srv_s49.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 1})[0] == 200
    refusal_as_text = [{"role": "user", "content": [{"type": "refusal", "text": "no"}]}]  # (its text is "refusal")
    check_error(*srv_s49.post("/v1/chat/completions", {"messages": refusal_as_text, "max_tokens": 1}), 400, "messages",
                "must be a string or a list of text parts")


# ==============================================================================================
# bench.py against careless input, session 49
# ==============================================================================================
# A vLLM user's bad flags, files and servers: one `error:` line naming the problem (argparse's, or serve's before the
# server is asked), a failed request for a bad reply, never a traceback, and never a value read as another.

def serve_fails_at_once(argv, capsys):
    """bench.py serve's exit status and its one stderr line, against no server (port 1: nothing listens)."""
    code = bench.serve_benchmark(["--url", "http://127.0.0.1:1", "--num-prompts", "2"] + argv)
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    return code, err.rstrip("\n")


def test_s49_bench_serve_counts_refused_not_replaced(tmp_path, capsys):
    """A zero or negative output length, prefix, timeout or SLO is refused before the server is asked; before, a 0
    of --random-output-len (and --custom- / --spec-bench-output-len) was read as "not given" and the default 128
    (256) sent, a negative one sent as max_tokens, a negative prefix dropped, --timeout 0 failed every request with
    an OS error, and --goodput ttft:nan counted no request good. vLLM's --custom-output-len -1 (each line's own
    output_tokens) is accepted."""
    c = write_lines(tmp_path / "c.jsonl", '{"prompt": "x"}')
    s = write_lines(tmp_path / "s.json", "[]")
    for argv, want in ((["--random-output-len", "0"], "--random-output-len must be at least 1, not 0"),
                       (["--output-len", "-3"], "--output-len must be at least 1, not -3"),
                       (["--dataset-name", "custom", "--dataset-path", c, "--custom-output-len", "0"],
                        "--custom-output-len must be at least 1, not 0"),
                       (["--dataset-name", "sharegpt", "--dataset-path", s, "--sharegpt-output-len", "-2"],
                        "--sharegpt-output-len must be at least 1, not -2"),
                       (["--dataset-name", "spec_bench", "--dataset-path", c, "--spec-bench-output-len", "0"],
                        "--spec-bench-output-len must be at least 1, not 0"),
                       (["--random-prefix-len", "-3"], "the random dataset needs prompts of at least one token "
                                                       "(--random-input-len 1024 + --random-prefix-len -3, neither "
                                                       "negative)"),
                       (["--timeout", "0"], "--timeout must be > 0 seconds, not 0.0"),
                       (["--timeout", "nan"], "--timeout must be > 0 seconds, not nan"),
                       (["--goodput", "ttft:nan"], "--goodput 'ttft:nan': use KEY:MS with KEY ttft, tpot or e2el and "
                                                   "MS >= 0")):
        assert serve_fails_at_once(argv, capsys) == (1, "error: " + want), argv
    code, err = serve_fails_at_once(["--dataset-name", "custom", "--dataset-path", c, "--custom-output-len", "-1",
                                     "--skip-chat-template"], capsys)
    assert code == 1 and err.startswith("error: cannot reach http://127.0.0.1:1/v1/models")  # (accepted: asked)


def test_s49_bench_serve_flags_named_before_the_run(tmp_path, capsys):
    """A port out of range names the URL it makes (before: "--base-url None"); a result file in a directory that is
    not there, and an HTTP header without a name, are refused before the run (before: found after it, or a
    traceback from http.client with --model given); latency's --output-json likewise (before: after the run)."""
    for argv, want in (
            (["--port", "99999"], "--base-url 'http://127.0.0.1:99999' (or --host / --port): use "
                                  "http://HOST[:PORT][/PATH]"),
            (["--save-result", "--result-filename", str(tmp_path / "gone" / "r.json")],
             f"--result-filename '{tmp_path}/gone/r.json': no directory {tmp_path}/gone"),
            (["--append-result", "--result-dir", str(tmp_path / "d"), "--result-filename", "sub/r.json"],
             f"--result-filename 'sub/r.json': no directory {tmp_path}/d/sub"),
            (["--model", "m", "--header", "=x"], "--header '=x': use KEY=VALUE, KEY not empty")):
        argv = argv if "--port" not in argv else ["--port", "99999", "--num-prompts", "2"]
        code = bench.serve_benchmark((["--url", "http://127.0.0.1:1", "--num-prompts", "2"] if "--port" not in argv
                                      else []) + argv)
        out, err = capsys.readouterr()
        assert (code, out, err) == (1, "", f"error: {want}\n"), argv
    t0 = time.perf_counter()
    code = exit_code(bench.main, ["latency", "--device", "cpu", "--input-len", "4", "--output-len", "2", "--batch-size",
                                  "1", "--num-iters-warmup", "0", "--num-iters", "1", "--output-json",
                                  str(tmp_path / "gone" / "lat.json")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and time.perf_counter() - t0 < 5  # (no engine built: before the run)
    assert err.splitlines()[-1] == (f"bench.py latency: error: --output-json '{tmp_path}/gone/lat.json': no "
                                    f"directory {tmp_path}/gone")  # (its prog is named: the subcommand's parser)


def test_s49_bench_offline_counts_refused(capsys):
    """The offline benchmark's --max-model-len, --stall, --verify-cost and --ngram-cost below 1 are argparse's error
    (before: 0 was read as "not given" and a negative one failed inside the engine, or, on CUDA, in a step of -1
    tokens), and --random-drafter / --random-draft-lm need the --random-weights preset they are shaped for (before: a
    KeyError traceback)."""
    small = ["--device", "cpu", "--batch", "1", "--prompt-len", "8", "--gen-len", "4", "--no-draft-time"]
    spec = lambda m: ["--speculative-config", json.dumps({"method": m, "num_speculative_tokens": 2})]  # noqa: E731
    for flags, want in ((["--max-model-len", "0"], "--max-model-len must be at least 1, not 0"),
                        (["--max-model-len", "-5"], "--max-model-len must be at least 1, not -5"),
                        (["--stall", "0"], "--stall must be at least 1, not 0"),
                        (["--verify-cost", "4", "-1"], "--verify-cost must be at least 1, not -1"),
                        (["--ngram-cost", "0"], "--ngram-cost must be at least 1, not 0"),
                        (["--random-drafter", "/nonexistent/d"] + spec("dflash"),
                         "--random-drafter needs --random-weights (the preset the drafter is shaped for)"),
                        (["--random-draft-lm", "/nonexistent/d"] + spec("draft_model"),
                         "--random-draft-lm needs --random-weights (the preset the drafter is shaped for)")):
        code = exit_code(bench.main, small + flags)
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err and err.splitlines()[-1].endswith(": error: " + want), err


def test_s49_bench_sharegpt_reply_of_another_shape(tmp_path):
    """A ShareGPT reply turn that is not an object, read with a local tokenizer, is a reply without text (vLLM's
    length filter then drops the pair, unless --sharegpt-output-len fixes the length); before: AttributeError."""
    tok = sd.Tokenizer.from_dir(TOY)
    path = tmp_path / "s.json"
    human = {"from": "human", "value": "What does this function return when it is called?"}
    path.write_text(json.dumps([{"conversations": [human, "a reply as a bare string"]},
                                {"conversations": [human, {"from": "gpt", "value": "It returns the sum of both."}]}]))
    got = bench.load_dataset("sharegpt", str(path), 2, shuffle=False, oversample=False, tok=tok)
    assert got == [(human["value"], len(tok.encode("It returns the sum of both.")))]
    got = bench.load_dataset("sharegpt", str(path), 2, shuffle=False, oversample=False, tok=tok, output_len=7)
    assert got == [(human["value"], 7)] * 2


def serve_stub_http(replies):
    """A server on a free port: GET /v1/models answers replies["models"] (bytes), POST the SSE lines of
    replies["chunks"] (strings, each sent as `data: ...`, then [DONE]). -> (url, shutdown)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Stub(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def do_GET(self):
            body = replies["models"]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write("".join(f"data: {c}\n\n" for c in replies["chunks"] + ["[DONE]"]).encode())

        def log_message(self, *a):
            pass
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}", httpd.shutdown


def test_s49_bench_malformed_stream_chunks_fail_the_request(capsys):
    """A stream chunk not of the OpenAI shape (not an object, choices or delta of another type, a usage count that is
    not a whole number) fails that request with an error naming the chunk; before, it raised in the request's
    thread and the run ended in a traceback (TypeError on its missing record, or on summing a string count)."""
    replies = {"models": b'{"data": [{"id": "m"}]}', "chunks": []}
    url, shutdown = serve_stub_http(replies)
    text = '{"choices": [{"text": "a"}]}'
    try:
        for chunks in (["[1]"], ["null"], ['{"choices": {"a": 1}}'], ['{"choices": ["x"]}'],
                       ['{"choices": [{"text": 5}]}'], ['{"choices": [{"delta": "x"}]}'], [text, '{"usage": [1]}'],
                       [text, '{"usage": {"completion_tokens": "5", "prompt_tokens": 3}}'],
                       [text, '{"usage": {"completion_tokens": 2, "prompt_tokens": -3}}']):
            replies["chunks"] = chunks
            rec = bench.send(url, "/v1/completions", {"prompt": [1]}, {}, 10)
            assert not rec["ok"] and rec["error"] == f"malformed stream chunk: {chunks[-1].encode()!r}", rec
            code = bench.serve_benchmark(["--url", url, "--num-prompts", "2", "--random-input-len", "3"])
            out, err = capsys.readouterr()
            res = json.loads(out.strip().splitlines()[-1])
            assert code == 1 and (res["completed"], res["failed"]) == (0, 2) and "Traceback" not in err
            assert err.splitlines()[-1] == "error: " + rec["error"]
        replies["chunks"] = [text, '{"usage": {"completion_tokens": 1, "prompt_tokens": 3}}']
        assert bench.send(url, "/v1/completions", {"prompt": [1]}, {}, 10)["ok"]
    finally:
        shutdown()


def test_s49_bench_models_list_and_non_http_server(capsys):
    """/v1/models answered without a model (an empty list, another shape, not JSON) is one line saying so (before: a
    TypeError traceback, or "cannot reach ...: list index out of range"), and a server that does not speak HTTP at
    that port is one line too (before: http.client's BadStatusLine traceback)."""
    replies = {"models": b"", "chunks": []}
    url, shutdown = serve_stub_http(replies)
    try:
        for body in (b'{"data": []}', b"[1]", b"<html>"):
            replies["models"] = body
            assert bench.serve_benchmark(["--url", url, "--num-prompts", "1"]) == 1
            assert capsys.readouterr() == ("", f"error: {url}/v1/models: no model listed in its answer {body!r}\n")
    finally:
        shutdown()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()

    def not_http():  # answers each connection with an SSH banner, as an SSH server at a mistyped port
        while True:
            try:
                c, _ = sock.accept()
            except OSError:
                return
            c.recv(65536)
            c.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            c.close()
    threading.Thread(target=not_http, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        assert bench.serve_benchmark(["--url", url, "--num-prompts", "1"]) == 1
        assert capsys.readouterr() == ("", f"error: cannot reach {url}/v1/models: BadStatusLine: SSH-2.0-OpenSSH_9.6\n")
    finally:
        sock.close()


def test_s49_bench_unreadable_metrics_are_none(monkeypatch):
    """/metrics that cannot be read is None (no spec-decode keys), whatever the reason: a header http.client refuses
    (it raised ValueError with --model given, a traceback) or lines not in Prometheus' text format."""
    def refuse(url, path, headers, timeout=30):
        raise ValueError("Invalid header value b'a\\nb'")
    monkeypatch.setattr(bench, "http_get", refuse)
    assert bench.scrape_spec("http://h", {}) is None
    for text in (b"vllm:spec_decode_num_drafts_total abc", b"vllm:num_requests_running", b"vllm:num_requests_waiting x",
                 b'vllm:spec_decode_num_accepted_tokens_per_pos_total{pos="0"} 1'):
        monkeypatch.setattr(bench, "http_get", lambda url, path, headers, timeout=30: text)
        assert bench.scrape_spec("http://h", {}) is None, text
    text = b"vllm:spec_decode_num_drafts_total 3"
    monkeypatch.setattr(bench, "http_get", lambda url, path, headers, timeout=30: text)
    assert bench.scrape_spec("http://h", {})["drafts"] == 3.0


# ==============================================================================================
# Two small mends, session 49
# ==============================================================================================

@pytest.mark.parametrize("key, value, where", [
    ("sample_from_anchor", "false", "top"), ("sliding_window_non_causal", "true", "top"),
    ("is_causal", 1, "top"), ("use_swa", "no", "dflash_config"), ("causal", [True], "dflash_config")])
def test_s49_block_drafter_booleans_are_booleans(tmp_path, tiny, key, value, where):
    """A block drafter's boolean switches (sample_from_anchor, is_causal / causal, sliding_window_non_causal,
    use_swa) of another JSON type are one line naming the switch (before: read by truthiness, so a string "false"
    was true: a DSpark drafter attending causally, or a refusal about sample_from_anchor=true)."""
    draft = (write_dspark_speculators if key in ("sample_from_anchor", "sliding_window_non_causal") else write_dflash)(
        str(tmp_path / "d"), tiny)
    method = "dspark" if key in ("sample_from_anchor", "sliding_window_non_causal") else "dflash"
    sd.read_block_config(draft, method)
    _edit_config(draft, lambda c: (c if where == "top" else c.setdefault("dflash_config", {})).update({key: value}))
    name = "is_causal / causal" if key in ("is_causal", "causal") else key
    with pytest.raises(ConfigError, match=re.escape(f"{name} must be true or false, got {value!r}")):
        sd.read_block_config(draft, method)


def test_s49_cli_says_when_no_drafts_were_proposed(tiny, capsys):
    """ngram on a prompt without a repeated n-gram and 2 tokens proposes nothing: the CLI says so, instead of vLLM's
    acceptance line with an empty per-position list ("Per-position acceptance rate: , ")."""
    spec = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":4,"prompt_lookup_max":4}'
    assert sd.main(["--model", tiny, "--prompt", "a b", "--max-tokens", "2", "--device", "cpu", "--ignore-eos",
                    "--speculative-config", spec]) == 0
    err = capsys.readouterr().err
    assert "[SpecDecoding metrics: no drafts were proposed]" in err and "Per-position acceptance rate: ," not in err


# ==============================================================================================
# JSON files whose value is not an object, session 49's review
# ==============================================================================================

@pytest.mark.parametrize("file, what", [("config.json", "config"), ("tokenizer.json", "tokenizer"),
                                        ("generation_config.json", "generation config"),
                                        ("draft config.json", "config")])
def test_s49_json_files_that_are_not_objects(tmp_path, tiny, file, what):
    """A checkpoint's config.json, tokenizer.json, generation_config.json or a drafter's config.json holding a JSON
    value that is not an object (here a list) is one line naming the file (read_json(..., obj=True)), not an
    AttributeError from .get."""
    model = str(tmp_path / "model")
    shutil.copytree(tiny, model)
    spec = None
    if file.startswith("draft"):
        draft = write_dflash(str(tmp_path / "dflash"), model)
        spec, file = {"method": "dflash", "model": draft, "num_speculative_tokens": 3}, "config.json"
        path = os.path.join(draft, file)
    else:
        path = os.path.join(model, file)
    with open(path, "w") as fh:
        json.dump([1, 2], fh)
    with pytest.raises(ValueError, match=re.escape(f"{path}: a {what} is a JSON object, got '[1, 2]'")):
        LLM(model=model, device="cpu", max_model_len=64, speculative_config=spec)


# ==============================================================================================
# FBGEMM's fp16 GEMM where it rounds a row by the size of its call (an AVX2 CPU), session 50
# ==============================================================================================

def _size_rounding_gemm(w):
    """A stand-in for FBGEMM's fp16 GEMM on the AVX2 EPYC of session 50 (so the test does not depend on this
    CPU): a row rounds one way in a 1-row call, another in a 2-row call, a third in larger calls, except the
    last row of a call of 7, 13, 19 .. rows (a 6-row block's leftover), which rounds as in a 1-row call."""
    def gemm(x, wp):
        M = x.shape[0]
        tag = [1 if M == 1 or (M % 6 == 1 and r == M - 1) else 2 if M == 2 else 3 for r in range(M)]
        return (x.double() @ w.double().t() + torch.tensor(tag, dtype=torch.float64)[:, None] * 1e-3).float()
    return gemm


def test_s50_fp16_rows_padded_where_the_gemm_rounds_by_size(monkeypatch):
    """kernels._fp16_rows_call where the GEMM rounds a row by the size of its call: each row takes the bits of its
    own call padded to P = 3 rows (_fp16_base_rows: the fewest rows whose bits a 16-row call gives), and a step
    of M rows is one call of C >= M rows (_fp16_call_rows: 7 -> 8, 13 -> 14), not one call per row; a row alone
    == the row in steps of 2 .. 40 rows at any offset, bit for bit. A GEMM that rounds every size differently
    (no P works) runs row by row, each row in its own 1-row call (as before), still the same bits."""
    g = torch.Generator().manual_seed(50)
    w, x = torch.randn(24, 32, generator=g), torch.randn(48, 32, generator=g)
    packed = (None, torch.tensor(1.0))
    for gemm, P in ((_size_rounding_gemm(w), 3),
                    (lambda x, wp: (x.double() @ w.double().t() + x.shape[0] * 1e-3).float(), 1)):
        calls = []
        monkeypatch.setattr(K, "_FP16_ROWS", {})
        monkeypatch.setattr(K, "_fp16", lambda x, wp: calls.append(x.shape[0]) or gemm(x, wp))
        alone = torch.cat([K._fp16_rows_call(x[i:i + 1], w, packed) for i in range(48)])
        assert K._FP16_ROWS[(24, 32, torch.get_num_threads())] == P
        assert torch.allclose(alone, x @ w.t() + (3e-3 if P == 3 else 1e-3), atol=1e-5)   # padded: the 3-row bits
        for M in range(2, 41):
            for s in (0, 5, 48 - M):
                assert torch.equal(K._fp16_rows_call(x[s:s + M], w, packed), alone[s:s + M]), (P, M, s)
        calls.clear()
        for M, C in ((1, 3), (2, 3), (4, 4), (7, 8), (13, 14)):
            K._fp16_rows_call(x[:M], w, packed)
            assert calls[-1:] == ([C] if P == 3 else [1]) and (P == 3 or calls[-M:] == [1] * M), (M, calls)
    assert [k for k, v in K._FP16_ROWS.items() if len(k) == 4 and v == 0]           # row by row: C = 0


# ==============================================================================================
# GGUF tensor types gguf-py does not dequantize, session 50
# ==============================================================================================

@needs_gguf
def test_s50_gguf_f64_tensors_load_and_unknown_types_are_one_line(tmp_path, monkeypatch, tiny):
    """A GGUF whose tensors are F64 (llama.cpp's writers allow it) loads, and its logits equal the F32 file's bit for
    bit (the same values, cast to fp32); a tensor of a type the installed gguf package cannot dequantize (here
    Q8_1, llama.cpp's intermediate type) is one line naming the tensor and the type. Before: gguf-py's
    NotImplementedError traceback for both."""
    f32 = gguf_from_checkpoint(tiny, str(tmp_path / "f32.gguf"), "F32")
    add_tensor = gguf.GGUFWriter.add_tensor
    name = "blk.0.attn_qkv.weight"

    def as_f64(self, gname, data, raw_shape=None, raw_dtype=None, **kw):
        return add_tensor(self, gname, np.asarray(data, np.float32).astype(np.float64), **kw)
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", as_f64)
    f64 = gguf_from_checkpoint(tiny, str(tmp_path / "f64.gguf"), "F32")
    monkeypatch.undo()
    assert {t.tensor_type.name for t in gguf.GGUFReader(f64).tensors} == {"F64"}
    ids = list(range(3, 40))
    a, b = (our_logits(LLM(model=f, device="cpu", max_model_len=64), ids, "prefill") for f in (f32, f64))
    assert torch.equal(a, b)

    Q = gguf.GGMLQuantizationType
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]

    def q8_1(self, gname, data, raw_shape=None, raw_dtype=None, **kw):
        if gname == name:  # each row as Q8_1 blocks of zero bytes (a type gguf-py stores but cannot dequantize)
            rows, cols = np.asarray(data).shape
            return add_tensor(self, gname, np.zeros((rows, cols // block * size), np.uint8), raw_dtype=Q.Q8_1, **kw)
        return add_tensor(self, gname, data, raw_shape, raw_dtype, **kw)
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", q8_1)
    bad = gguf_from_checkpoint(tiny, str(tmp_path / "q8_1.gguf"), "F32")
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=re.escape(f"{bad}: tensor {name} is stored as GGUF type Q8_1, which the "
                                                    "installed gguf package (")):
        LLM(model=bad, device="cpu", max_model_len=64)


# ==============================================================================================
# A block drafter's draft_vocab_size and sliding window, session 50
# ==============================================================================================

@pytest.mark.parametrize("key, value, where, named", [
    ("draft_vocab_size", "64", "top", "draft_vocab_size"), ("draft_vocab_size", 0, "top", "draft_vocab_size"),
    ("draft_vocab_size", -3, "top", "draft_vocab_size"), ("draft_vocab_size", True, "top", "draft_vocab_size"),
    ("swa_window_size", "2048", "dflash_config", "dflash_config.swa_window_size"),
    ("swa_window_size", -5, "dflash_config", "dflash_config.swa_window_size"),
    ("swa_window_size", 1.5, "dflash_config", "dflash_config.swa_window_size"),
    ("sliding_window", "8", "top", "sliding_window")])
def test_s50_block_drafter_vocab_and_window_typed(tmp_path, tiny, key, value, where, named):
    """A DFlash drafter's draft_vocab_size and its sliding layers' window must be positive integers: one line naming
    the key. Before: a string or bool draft_vocab_size was a TypeError inside torch, a negative one a RuntimeError, 0
    was read as absent; a string window failed inside the first generate (a TypeError from the attention mask), a
    negative or fractional one was taken as given (the drafter's sliding layer then saw no keys)."""
    d = write_dflash(str(tmp_path / "dflash"), tiny, reduced=True)   # a sliding (causal) layer and a full one
    path = os.path.join(d, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    (cfg.setdefault("dflash_config", {}) if where == "dflash_config" else cfg)[key] = value
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    with pytest.raises(ConfigError, match=re.escape(f"{named} must be a positive integer, got {value!r}")):
        LLM(model=tiny, device="cpu", max_model_len=64,
            speculative_config={"method": "dflash", "model": d, "num_speculative_tokens": 3})


# ==============================================================================================
# A tiny repetition penalty saturates instead of overflowing, session 51
# ==============================================================================================

def test_s51_tiny_repetition_penalty_saturates():
    """A repetition penalty too small for fp32 (1e-300 is 0 there; 1e-40 lifts a logit of 100 past fp32's range)
    lifts a seen token's positive logit to PENALIZED_MAX, not to inf: the processed logits are finite and equal the
    plain-Python reference, and a sampled request draws from the lifted tokens (each a token of its prompt or of its
    output so far), with finite logprobs. Before: inf logits, NaN probabilities, and every sampled token was id
    8255 (past the toy's tokenizer: empty text)."""
    g = torch.Generator().manual_seed(51)
    V, k = 8, 2
    for rep in (1e-300, 1e-40):
        rows = [(SamplingParams(repetition_penalty=rep), [1, 4], [2], [])]
        drafts = [[3, 5]]
        logits = torch.randn(1, k + 1, V, generator=g) * 3 + 1
        got = sd.process_logits(logits, torch.tensor(drafts), processor_rows(rows), [7], cpu_h2d)
        assert torch.isfinite(got).all()
        assert_processed_as_reference(got, logits, rows, drafts, [7])
    llm = LLM(model=TOY, device="cpu")
    prompt = llm.tokenizer.encode("def fib(n):")
    out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=1,
                                                repetition_penalty=1e-300), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12
    for i, t in enumerate(out.token_ids):
        assert t in prompt + list(out.token_ids[:i]), (i, t, out.token_ids)
        assert math.isfinite(out.logprobs[i][t].logprob)


# ==============================================================================================
# An Engine built directly checks its sizes, session 51
# ==============================================================================================

@pytest.mark.parametrize("field, value", [("max_model_len", -5), ("max_model_len", 0), ("max_model_len", 1.5),
                                          ("max_model_len", "8"), ("max_model_len", True), ("max_num_seqs", 0),
                                          ("max_num_seqs", 2.0), ("max_num_batched_tokens", -1)])
def test_s51_engine_built_directly_checks_its_sizes(field, value):
    """specdec.Engine (the scheduler, which LLM builds after checking its arguments) refuses a size that is not a
    positive integer with one line naming it. Before: max_model_len -5 was a RuntimeError from torch.zeros, 1.5 a
    TypeError there, "8" a TypeError from str + int, and 0 built an engine that refused every request."""
    llm = LLM(model=TOY, device="cpu", max_model_len=64)
    args = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=None)
    args[field] = value
    with pytest.raises(ConfigError, match=re.escape(f"{field} must be a positive integer, got {value!r}")):
        sd.Engine(llm.engine.runner.model, llm.tokenizer, None, args["max_num_seqs"], args["max_model_len"],
                  torch.float32, torch.device("cpu"), max_num_batched_tokens=args["max_num_batched_tokens"])


# ==============================================================================================
# bench.py serve's lengths, ramp-up and result keys as vllm bench serve's, session 51
# ==============================================================================================
# vllm/benchmarks/serve.py (009e6d4): main_async maps --output-len onto every dataset's own length flag (ShareGPT's
# too) and --input-len onto --random-input-len; get_request paces a ramp-up's arrivals; the result keeps latencies,
# queue_times and rtfx, with the ramp's flags and rps_change_events.

def test_s51_bench_output_len_sets_every_dataset(tmp_path, monkeypatch, capsys):
    """--output-len fixes a ShareGPT request's max_tokens (and so skips vLLM's check of the reply's length), over
    --sharegpt-output-len; --random-output-len is the random dataset's alone; --input-len wins over
    --random-input-len in either order. Before: --output-len was an alias of --random-output-len, used only where a
    request had no length (so ShareGPT with a tokenizer kept each reply's), and on custom prompts it was 9, not
    vLLM's 256."""
    reply = "It is a list of numbers in the order they were given, one per line."
    turn = lambda who, text: {"from": who, "value": text}  # noqa: E731
    sharegpt = tmp_path / "s.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [turn("human", "What does this function return when called?"), turn("gpt", reply)]},
        {"conversations": [turn("human", "Tell me about the weather today"), turn("gpt", "Ok")]}]))  # reply < 4
    custom = write_lines(tmp_path / "c.jsonl", json.dumps({"prompt": "def f(x):"}))
    sent = stub_bench_server(monkeypatch, prompt_tokens=5)
    share = ["--model", TOY, "--dataset-name", "sharegpt", "--dataset-path", str(sharegpt), "--disable-shuffle",
             "--no-oversample"]
    n_reply = len(sd.Tokenizer.from_dir(TOY).encode(reply))
    for flags, want in ((share + ["--output-len", "9"], [9, 9]),
                        (share + ["--sharegpt-output-len", "20", "--output-len", "7"], [7, 7]),
                        (share + ["--gen-len", "6"], [6, 6]),                     # (our older name of --output-len)
                        (share + ["--random-output-len", "9"], [n_reply]),      # the recorded reply's length
                        (["--dataset-name", "custom", "--dataset-path", custom, "--skip-chat-template",
                          "--num-prompts", "1", "--random-output-len", "9"], [256]),
                        (["--dataset-name", "custom", "--dataset-path", custom, "--skip-chat-template",
                          "--num-prompts", "1", "--output-len", "5", "--custom-output-len", "30"], [5]),
                        (["--num-prompts", "2", "--output-len", "4", "--random-output-len", "6"], [4, 4])):
        sent.clear()
        assert bench.serve_benchmark(flags) == 0, flags
        capsys.readouterr()
        assert [b["max_tokens"] for b in sent] == want, flags
    for flags in (["--input-len", "5", "--random-input-len", "7"], ["--random-input-len", "7", "--prompt-len", "5"]):
        sent.clear()
        assert bench.serve_benchmark(["--num-prompts", "2"] + flags) == 0
        res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert [len(b["prompt"]) for b in sent] == [5, 5] and res["prompt_len"] == 5, flags
    assert serve_fails_at_once(["--output-len", "0"], capsys) == (1, "error: --output-len must be at least 1, not 0")


def test_s51_bench_ramp_up_schedule():
    """vLLM's ramp (get_request): request i of n at start + (end - start) * i / (n - 1) requests/s (exponential:
    start * (end / start) ** (i / (n - 1))), each request after a gap at its own rate, the first too; a fixed finite
    rate's gaps are rescaled to end at n / rate seconds, a ramp's are not; rps_change_events lists each whole rate
    passed, stamped at the arrival of the first request at or above it."""
    import datetime
    assert [bench.ramp_rate("linear", 1, 5, i, 5) for i in range(5)] == [1, 2, 3, 4, 5]
    assert [bench.ramp_rate("exponential", 1, 16, i, 5) for i in range(5)] == pytest.approx([1, 2, 4, 8, 16])
    assert bench.ramp_rate("linear", 3, 9, 0, 1) == 3                                   # one request: the start rate
    rng = random.Random(0)
    offsets, rates = bench.arrival_schedule(4, float("inf"), float("inf"), rng, ("linear", 2, 8))
    assert rates == [2, 4, 6, 8] and offsets == pytest.approx([1 / 2, 1 / 2 + 1 / 4, 1 / 2 + 1 / 4 + 1 / 6,
                                                               1 / 2 + 1 / 4 + 1 / 6 + 1 / 8])
    offsets, rates = bench.arrival_schedule(5, 10.0, 1.0, rng)                          # Poisson, rescaled
    assert rates == [10.0] * 5 and offsets[-1] == pytest.approx(0.5) and 0 < offsets[0] < offsets[1] < offsets[-1]
    offsets, _ = bench.arrival_schedule(3, 4.0, float("inf"), rng)
    assert offsets == pytest.approx([0.25, 0.5, 0.75])
    assert bench.arrival_schedule(3, float("inf"), 1.0, rng) == ([0.0] * 3, [float("inf")] * 3)
    wall0 = 1_700_000_000.0
    events = bench.rps_change_events(2, [2, 2.5, 4.9, 5.0, 7.5], [0.1, 0.2, 0.3, 0.4, 0.5], wall0)
    stamp = lambda dt: datetime.datetime.fromtimestamp(wall0 + dt).isoformat()  # noqa: E731
    assert events == [{"rps": 2, "timestamp": stamp(0)}, {"rps": 3, "timestamp": stamp(0.3)},
                      {"rps": 4, "timestamp": stamp(0.3)}, {"rps": 5, "timestamp": stamp(0.4)},
                      {"rps": 6, "timestamp": stamp(0.5)}, {"rps": 7, "timestamp": stamp(0.5)}]


def test_s51_bench_serve_ramp_up(tmp_path, monkeypatch, capsys):
    """--ramp-up-strategy / --ramp-up-start-rps / --ramp-up-end-rps: the requests go out on the ramp's schedule, the
    result records the three flags, request_rate "inf" and rps_change_events, the file is named as vLLM's; vLLM's
    rules are one `error:` line each (and the two rates without a strategy, which vLLM ignores, are refused).
    Before: unrecognized arguments."""
    import datetime
    stub_bench_server(monkeypatch, prompt_tokens=5)
    argv = ["--num-prompts", "5", "--random-input-len", "4", "--ramp-up-strategy", "linear", "--ramp-up-start-rps",
            "20", "--ramp-up-end-rps", "60", "--save-result", "--save-detailed", "--result-dir", str(tmp_path)]
    t0 = time.perf_counter()
    assert bench.serve_benchmark(argv) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    offsets = [sum(1 / r for r in (20, 30, 40, 50, 60)[:i + 1]) for i in range(5)]   # rates 20, 30, ... 60 req/s
    starts = [s - t0 for s in res["start_times"]]
    assert all(s >= dt - 1e-3 for s, dt in zip(starts, offsets)), (starts, offsets)  # none before its arrival
    assert (res["ramp_up_strategy"], res["ramp_up_start_rps"], res["ramp_up_end_rps"]) == ("linear", 20, 60)
    assert res["request_rate"] == "inf" and [e["rps"] for e in res["rps_change_events"]] == list(range(20, 61))
    stamps = [datetime.datetime.fromisoformat(e["timestamp"]) for e in res["rps_change_events"]]
    assert stamps == sorted(stamps) and len(set(stamps)) == 5                        # the start, then 4 arrivals
    files = os.listdir(tmp_path)
    assert len(files) == 1 and re.fullmatch(r"openai-ramp-up-linear-20qps-60qps-m-\d{8}-\d{6}\.json", files[0])
    ramp = ["--ramp-up-strategy", "exponential", "--ramp-up-start-rps", "2", "--ramp-up-end-rps", "8"]
    for flags, want in (
            (ramp + ["--request-rate", "5"], "--ramp-up-strategy sets the request rate: leave out --request-rate 5"),
            (ramp[:4], "--ramp-up-strategy needs both --ramp-up-start-rps and --ramp-up-end-rps"),
            (ramp[2:], "--ramp-up-start-rps and --ramp-up-end-rps need --ramp-up-strategy (linear or exponential)"),
            (["--ramp-up-strategy", "linear"] + ramp[2:3] + ["0"] + ramp[4:],
             "--ramp-up-start-rps must be at least 1 (the first request's rate), not 0"),
            (ramp[:2] + ["--ramp-up-start-rps", "-1"] + ramp[4:],
             "--ramp-up-start-rps must be at least 1 (the first request's rate), not -1"),
            (ramp[:2] + ["--ramp-up-start-rps", "9"] + ramp[4:],
             "--ramp-up-end-rps 8 is below --ramp-up-start-rps 9: the ramp goes up")):
        assert serve_fails_at_once(flags, capsys) == (1, "error: " + want), flags
    monkeypatch.undo()  # (vLLM's check is of a finite rate: --request-rate inf is accepted, and the server asked)
    code, err = serve_fails_at_once(ramp + ["--request-rate", "inf"], capsys)
    assert code == 1 and err.startswith("error: cannot reach http://127.0.0.1:1/v1/models")


def test_s51_bench_serve_result_keys_of_vllm(monkeypatch, capsys):
    """The result keys of vLLM's that were missing: latencies and queue_times (kept without --save-detailed, as
    vLLM's), rtfx (0.0: no audio), and with --max-concurrency the percentile metrics client_queue_time and (at a
    finite rate) e2el_including_client_queue, in the table under vLLM's headings; asked for without
    --max-concurrency, they are left out with a warning. Before: missing, and the two names refused."""
    monkeypatch.setattr(bench, "http_get", lambda url, path, headers, timeout=30: b'{"data": [{"id": "m"}]}')
    monkeypatch.setattr(bench, "scrape_spec", lambda url, headers, settle=0.0: None)

    def send(url, endpoint, body, headers, timeout):  # 50 ms a request
        st = time.perf_counter()
        time.sleep(0.05)
        return {"ok": True, "start": st, "ttft": 0.01, "itl": [0.01], "latency": time.perf_counter() - st,
                "output_tokens": 2, "prompt_tokens": 4, "chunks": 2, "error": "", "text": ""}
    monkeypatch.setattr(bench, "send", send)
    argv = ["--num-prompts", "3", "--random-input-len", "4", "--request-rate", "1000", "--percentile-metrics",
            "e2el,client_queue_time,e2el_including_client_queue", "--metric-percentiles", "50"]
    assert bench.serve_benchmark(argv + ["--max-concurrency", "1"]) == 0
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1])
    q, lat = res["queue_times"], res["latencies"]
    assert len(q) == len(lat) == 3 and all(x >= 0.05 for x in lat) and res["rtfx"] == 0.0
    assert q[0] < q[1] and q[1] >= 0.04 and q[2] >= 0.09                             # one at a time: each waits
    for name, xs in (("client_queue_time", q), ("e2el_including_client_queue", [a + b for a, b in zip(lat, q)])):
        assert {k: res[f"{k}_{name}_ms"] for k in ("mean", "median", "std", "p50")} == bench.summarize(xs, [50])
    for row in ("-------------Client-side Queueing--------------", "Mean Client Queue Time (ms):",
                "P50 Client Queue Time (ms):", "-------Queue-inclusive End-to-end Latency-------",
                "Median E2EL incl. Client Queue (ms):"):
        assert row in out, row
    assert bench.serve_benchmark(argv) == 0
    cap = capsys.readouterr()
    res = json.loads(cap.out.strip().splitlines()[-1])
    assert not any("client_queue" in k for k in res) and "mean_e2el_ms" in res and len(res["queue_times"]) == 3
    assert "warning: --percentile-metrics client_queue_time needs --max-concurrency; left out, as vLLM does" in cap.err
    assert "Client-side Queueing" not in cap.out


# ==============================================================================================
# Null text parts and --default-chat-template-kwargs as vLLM reads them, session 51
# ==============================================================================================

S51_FLAG_TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "the server's tool",
                                                     "parameters": {"type": "object", "properties": {}}}}]
S51_REQUEST_TOOLS = [{"type": "function", "function": {"name": "fetch", "description": "the request's tool",
                                                       "parameters": {"type": "object", "properties": {}}}}]
# add_generation_prompt / continue_final_message that the request's own fields override, tools that stand in
# for a request's, and a default that a request's null or "auto" leaves in place
S51_DEFAULTS = {"add_generation_prompt": False, "continue_final_message": True, "tools": S51_FLAG_TOOLS,
                "enable_thinking": False}
srv_s51 = server_fixture("srv_s51", "--max-num-seqs", "2", "--default-chat-template-kwargs", json.dumps(S51_DEFAULTS))


def s51_tokens(srv, messages, **fields):
    """The chat's prompt ids as /tokenize renders it (the chat endpoint's render_chat)."""
    status, body = srv.post("/tokenize", {"messages": messages, **fields})
    assert status == 200, body
    return body["tokens"]


def test_s51_server_null_text_part_skipped(srv):
    """A chat content part of type text (or refusal) whose text is null, or missing, is skipped, as vLLM's chat
    parser skips it (PART_TYPES_TO_SKIP_NONE_CONTENT, vllm 0.34.0): the prompt is the one without it, on
    /tokenize and /v1/chat/completions. Before: a 400 "must be a string or a list of text parts". Still a 400: a
    message of nothing but such parts (vLLM's request model refuses it), an input_text, output_text or thinking part
    with a null text (vLLM does not skip those), a null input_text in the Responses API's input (vLLM's request
    model refuses it)."""
    hi = {"type": "text", "text": "hi"}
    plain = s51_tokens(srv, [{"role": "user", "content": [hi]}])
    for empty in ({"type": "text", "text": None}, {"type": "text"}, {"type": "refusal", "refusal": None}):
        assert s51_tokens(srv, [{"role": "user", "content": [empty, hi]}]) == plain, empty
        assert s51_tokens(srv, [{"role": "user", "content": [hi, empty]}]) == plain, empty
    answered = [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]
    with_null = [answered[0], {"role": "assistant", "content": [{"type": "refusal", "refusal": None},
                                                                 {"type": "text", "text": "a"}]}]
    assert s51_tokens(srv, with_null) == s51_tokens(srv, answered)
    status, body = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": None}, hi]}], "max_tokens": 1})
    assert status == 200, body
    for only in ([{"type": "text", "text": None}], [{"type": "refusal", "refusal": None}, {"type": "text"}]):
        check_error(*srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": only}],
                                                       "max_tokens": 1}), 400, "messages", "must be a string or a list")
    for kind, key in (("input_text", "text"), ("output_text", "text"), ("thinking", "thinking")):
        check_error(*srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": kind, key: None}, hi]}], "max_tokens": 1}), 400, "messages",
            "must be a string or a list of text parts")
    check_error(*srv.post("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": None}, {"type": "input_text", "text": "hi"}]}], "max_output_tokens": 1}),
        400, "input", "content parts must be")


def test_s51_default_chat_template_kwargs_reserved_keys_taken():
    """--default-chat-template-kwargs takes add_generation_prompt, continue_final_message and tools, as vLLM
    does (before: "may not set ..." and no start). The first two are dropped, since each request's own fields go
    over them in vLLM's merge (ChatParams.with_defaults); the messages and documents are still refused."""
    parse = lambda value: srvmod.chat_options(srvmod.build_parser().parse_args(  # noqa: E731
        ["m", "--default-chat-template-kwargs", value]))
    assert parse(json.dumps(S51_DEFAULTS)).kwargs == {"tools": S51_FLAG_TOOLS, "enable_thinking": False}
    for key in ("messages", "documents"):
        with pytest.raises(ConfigError, match=f"may not set {key}"):
            parse(json.dumps({key: []}))


def test_s51_default_chat_template_kwargs_merge_as_vllm(srv_s51):
    """How the server's default kwargs meet a request, as vLLM 0.34.0 merges them (merge_kwargs over
    ChatParams.with_defaults, OnlineRenderer.preprocess_chat): the request's add_generation_prompt and
    continue_final_message fields win over the defaults' (so a plain request gets its generation prompt and a
    chat completion is not refused as "both"); the defaults' tools are the template's for a request with no tools,
    a request's own tools replace them; a request's chat_template_kwargs value of null or "auto" leaves the
    default in place (here enable_thinking false), any other value goes over it."""
    from specdec import apply_chat_template
    tok = sd.Tokenizer.from_dir(srv_model(srv_s51))
    msgs = [{"role": "user", "content": "hello"}]
    want = lambda gen=True, think=False, tools=S51_FLAG_TOOLS: tok.encode(  # noqa: E731
        apply_chat_template(msgs, gen, think, False, tools))
    assert s51_tokens(srv_s51, msgs) == want()
    assert s51_tokens(srv_s51, msgs, add_generation_prompt=False) == want(gen=False)
    assert s51_tokens(srv_s51, msgs, tools=S51_REQUEST_TOOLS) == want(tools=S51_REQUEST_TOOLS)
    assert s51_tokens(srv_s51, msgs, chat_template_kwargs={"tools": None}) == want()
    for unset in (None, "auto"):
        assert s51_tokens(srv_s51, msgs, chat_template_kwargs={"enable_thinking": unset}) == want(), unset
    assert s51_tokens(srv_s51, msgs, chat_template_kwargs={"enable_thinking": True}) == want(think=True)
    status, body = srv_s51.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert status == 200 and body["usage"]["prompt_tokens"] == len(want()), body
