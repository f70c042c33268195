"""specdec.py - speculative decoding for the Qwen3.6 hybrid models (Gated DeltaNet + gated attention).

    python specdec.py --model PATH --prompt "def fib(n):" --max-tokens 64
    python specdec.py --model PATH --speculative-config '{"method":"mtp","num_speculative_tokens":2}' ...

    from specdec import LLM, SamplingParams
    llm = LLM(model=PATH, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    print(llm.generate(["hello"], SamplingParams(max_tokens=16))[0].outputs[0].text)

One file, read top to bottom; a banner opens each section:
    Configs             ModelConfig (a text_config; MODEL_CHECKS)
    Model               Qwen36 = embeddings, DecoderLayers (Attention or GatedDeltaNet, MLP or MoE), MTPHead;
                        pure functions of (tokens, Ctx), the state comes in through Ctx
    State               State: every slot's KV caches and GDN states, allocated once
    Speculative config  SpeculativeConfig: vLLM's JSON object, its rules in SPEC_CHECKS
    Proposers           the interface (Batch, ProposerIO); ngram and mtp
    Model drafters      dflash and dspark (BlockProposer, BlockDrafter, KVCache), draft_model (Qwen3LM)
    Verification        SamplingParams; the logits processors (process_logits, Grammar); rejection_sample
                        (every method, lossless), synthetic_sample (benchmarks), sampling
    Engine              ModelRunner runs the steps (GraphRunner: the CUDA graphs); Engine schedules requests
    Tokenizer           Tokenizer (byte-level BPE on tiktoken), IncrementalDecoder; ChatTemplate (the
                        checkpoint's Jinja template, sandboxed; apply_chat_template, the built-in fallback)
    Loading             load_model -> load_weights, the one loader; block-FP8 weights (declare_fp8;
                        --quantization fp8: quantized_sources); --load-format dummy (dummy_sources); GGUF
                        files (read_gguf); hub ids in the local Hugging Face cache (resolve_model); slot
                        memory (size_slots); generation_defaults
    API, CLI            LLM (generate, chat, get_metrics; vLLM's engine-argument names and outputs), main

Each speculative method is one proposer class (PROPOSERS):
    ngram        NgramProposer         prompt lookup on the device
    mtp          MTPProposer           the checkpoint's MTP layer, chained k times
    dflash       DFlashProposer        a block drafter over the target's hidden-state taps
    dspark       DSparkProposer        a block drafter plus a Markov head
    draft_model  DraftModelProposer    a small separate LM

One speculative step (ModelRunner._spec_step): the proposer drafts d1..dk; the target verifies
[last, d1..dk] in one forward; rejection_sample accepts a prefix and adds one token; the target's GDN states
and the proposer's caches commit to it; each slot's next input advances, on the device. Engine.step admits
requests, launches a step and reads the step before back (asynchronous steps), emitting its tokens and
applying the stops.
"""
import argparse
import copy
import dataclasses
import datetime
import functools
import importlib.metadata
import itertools
import json
import math
import os
import re
import sys
import time
import types
import unicodedata
import warnings
from collections import deque
from dataclasses import dataclass, field

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels as K


class ConfigError(ValueError):
    """A bad model config, speculative config, checkpoint or request: the message says what and why."""


# ==============================================================================================
# Configs
# ==============================================================================================

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")

# What ModelConfig.check accepts of a text_config: (key, its default, accepted values, message: {v} the value)
MODEL_CHECKS = [
    ("model_type", "qwen3_5_text", ("qwen3_5_text", "qwen3_5_moe_text"),
     "unsupported text model_type {v!r}; supported: qwen3_5_text, qwen3_5_moe_text"),
    ("attn_output_gate", True, (True,),
     "unsupported config: attn_output_gate={v!r} (only True is implemented)"),
    ("attention_bias", False, (False,),
     "unsupported config: attention_bias={v!r} (only False is implemented)"),
    ("hidden_act", "silu", ("silu",), "unsupported hidden_act {v!r}; only silu is implemented"),
]

# The text_config's numbers: (key, required, kind); kind "int" a positive integer, "int0" a non-negative one,
# "float" a positive number. A missing required key or another type is refused naming the key (it was a KeyError,
# a TypeError deep in torch, or a division by zero).
_POS_INT, _INT0, _POS_FLOAT = "a positive integer", "a non-negative integer", "a positive number"
CONFIG_NUMBERS = [*[(k, True, _POS_INT) for k in ("hidden_size", "num_hidden_layers", "vocab_size",
                                                   "num_attention_heads", "num_key_value_heads",
                                                   "linear_num_key_heads", "linear_num_value_heads",
                                                   "linear_key_head_dim", "linear_value_head_dim")],
                  *[(k, False, _POS_INT) for k in ("head_dim", "linear_conv_kernel_dim", "intermediate_size",
                                                    "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                    "shared_expert_intermediate_size", "max_position_embeddings",
                                                    "full_attention_interval")],
                  ("mtp_num_hidden_layers", False, _INT0),
                  *[(k, False, _POS_FLOAT) for k in ("rms_norm_eps", "rope_theta", "partial_rotary_factor")]]


def _config_number(v, kind):
    if kind == _POS_FLOAT:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    return isinstance(v, int) and not isinstance(v, bool) and (v >= 0 if kind == _INT0 else v > 0)


def read_json(path, what="file", obj=False):
    """A JSON file's value; a file that is not JSON (json's message alone named none), or with obj=True one whose
    value is not a JSON object, is a ConfigError naming it."""
    try:
        with open(path, encoding="utf-8") as fh:
            v = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: this {what} is not valid JSON ({e})") from None
    if obj and not isinstance(v, dict):
        raise ConfigError(f"{path}: a {what} is a JSON object, got {str(v)[:80]!r}")
    return v


# What ModelConfig.from_hf accepts of a checkpoint's `quantization_config` (Qwen's block-FP8): as MODEL_CHECKS
QUANT_CHECKS = [
    ("quant_method", None, ("fp8",),
     "unsupported quantization: quant_method {v!r}; specdec loads unquantized checkpoints and Qwen's "
     "block-FP8 ones (quant_method 'fp8', fmt e4m3, weight_block_size [128, 128])"),
    ("fmt", "e4m3", ("e4m3",), "unsupported FP8 format fmt={v!r}; only e4m3 is implemented"),
    ("weight_block_size", None, ([128, 128],),
     "unsupported FP8 weight_block_size {v!r}; only [128, 128] blocks are implemented"),
    ("activation_scheme", "dynamic", ("dynamic",),
     "unsupported FP8 activation_scheme {v!r}; only dynamic is implemented (weight-only scales)"),
]


def _eos_ids(v):
    """Whether v is what a config may give as eos_token_id: None, a token id, or a list of them."""
    return v is None or _config_number(v, _INT0) or (isinstance(v, list) and all(_config_number(t, _INT0) for t in v))


def _layer_types(cfg):
    """Per layer "linear_attention" (GDN) or "full_attention": as listed, or each
    full_attention_interval-th."""
    types = cfg.get("layer_types")
    if types is None:
        every = cfg.get("full_attention_interval", 4)
        n = cfg["num_hidden_layers"]
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    return types


def _rope(cfg):
    return dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})


def check_quantization(quant, where):
    """A checkpoint's quantization_config -> "fp8", or a ConfigError naming what it found (QUANT_CHECKS)."""
    for key, default, accepted, message in QUANT_CHECKS:
        v = quant.get(key, default)
        if v not in accepted:
            raise ConfigError(f"{where}: " + message.format(v=v))
    return "fp8"


@dataclass
class ModelConfig:
    """The text decoder's hyper-parameters, as in a Qwen3.5/3.6 `text_config`."""
    moe: bool
    hidden_size: int
    num_hidden_layers: int
    layer_types: list                 # "linear_attention" (GDN) or "full_attention", per layer
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    intermediate_size: int = 0        # dense MLP
    num_experts: int = 0              # MoE
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    max_position_embeddings: int = 262144
    eos_token_ids: list = field(default_factory=list)
    model_type: str = "qwen3_5_text"
    quantization: str = None          # "fp8": the checkpoint stores block-FP8 weights (quantization_config)
    modules_to_not_convert: list = field(default_factory=list)  # the modules it keeps unquantized (our names)

    def __post_init__(self):
        self.rotary_dim = int(self.head_dim * self.partial_rotary_factor)
        self.key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        self.value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                              f"linear_num_key_heads={self.linear_num_key_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                              f"num_key_value_heads={self.num_key_value_heads}")

    @staticmethod
    def check(cfg):
        """Refuse a text_config specdec does not implement or cannot read: its numbers (CONFIG_NUMBERS),
        MODEL_CHECKS, layer types, RoPE, MoE layers."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"the text config must be a JSON object, got {str(cfg)[:80]!r}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_parameters must be a JSON object, got {str(rope)[:80]!r}")
        dense = cfg.get("model_type", "qwen3_5_text") == "qwen3_5_text"
        for key, required, kind in CONFIG_NUMBERS:
            v = rope.get(key, cfg.get(key)) if key in ("rope_theta", "partial_rotary_factor") else cfg.get(key)
            if v is None and (required or (key == "intermediate_size" and dense)):
                raise ConfigError(f"the text config has no {key!r}")
            if v is not None and not _config_number(v, kind):
                raise ConfigError(f"the text config's {key} must be {kind}, got {v!r}")
        if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) > 1:
            raise ConfigError(f"partial_rotary_factor must be at most 1, got "
                              f"{rope.get('partial_rotary_factor', cfg.get('partial_rotary_factor'))!r}")
        for key, default, accepted, message in MODEL_CHECKS:
            if cfg.get(key, default) not in accepted:
                raise ConfigError(message.format(v=cfg[key]))
        n = cfg["num_hidden_layers"]
        types = _layer_types(cfg)
        if len(types) != n or set(types) - {"full_attention", "linear_attention"}:
            raise ConfigError(f"layer_types must list {n} entries of full_attention/linear_attention, "
                              f"got {types}")
        rope = _rope(cfg)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"unsupported rope_type {rope_type!r}; only default (M-)RoPE is implemented")
        if cfg.get("model_type") == "qwen3_5_moe_text" and cfg.get("mlp_only_layers"):
            raise ConfigError("unsupported config: mlp_only_layers (every layer of qwen3_5_moe is MoE)")

    @classmethod
    def from_dict(cls, cfg, top=None):
        """From a text_config dict (`top` = the wrapper config, for fields it may carry instead)."""
        cls.check(cfg)
        top = top or {}
        mt = cfg.get("model_type", "qwen3_5_text")
        moe = mt == "qwen3_5_moe_text"
        moe_key = lambda key: cfg.get(key, 0) if moe else 0                            # MoE fields only
        rope = _rope(cfg)
        eos = cfg.get("eos_token_id", top.get("eos_token_id"))
        if not _eos_ids(eos):
            raise ConfigError(f"eos_token_id must be a token id or a list of them, got {eos!r}")
        tie = cfg.get("tie_word_embeddings", top.get("tie_word_embeddings", False))
        return cls(
            moe=moe,
            model_type=mt,
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            layer_types=list(_layer_types(cfg)),
            vocab_size=cfg["vocab_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            linear_num_key_heads=cfg["linear_num_key_heads"],
            linear_num_value_heads=cfg["linear_num_value_heads"],
            linear_key_head_dim=cfg["linear_key_head_dim"],
            linear_value_head_dim=cfg["linear_value_head_dim"],
            linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
            intermediate_size=0 if moe else cfg["intermediate_size"],
            num_experts=moe_key("num_experts"),
            num_experts_per_tok=moe_key("num_experts_per_tok"),
            moe_intermediate_size=moe_key("moe_intermediate_size"),
            shared_expert_intermediate_size=moe_key("shared_expert_intermediate_size"),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 1e7)),
            partial_rotary_factor=rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(tie),
            mtp_num_hidden_layers=cfg.get("mtp_num_hidden_layers", 0),
            max_position_embeddings=cfg.get("max_position_embeddings", 262144),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )

    @classmethod
    def from_hf(cls, path):
        """Read a directory's `config.json` (multimodal wrapper or text-only) and `generation_config.json`."""
        f = os.path.join(path, "config.json")
        if not os.path.isfile(f):
            raise ConfigError(f"{path}: no config.json (expected a Hugging Face checkpoint directory or a "
                              ".gguf file)")
        top = read_json(f, "config", obj=True)
        mt = top.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"unsupported model_type {mt!r} in {f}; supported: "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        text = top.get("text_config") if mt in ("qwen3_5", "qwen3_5_moe") else top
        if not isinstance(text, dict):
            raise ConfigError(f"{f}: model_type {mt!r} needs a text_config object, got {str(text)[:80]!r}")
        if mt in ("qwen3_5", "qwen3_5_moe") and "model_type" not in text:
            text = dict(text, model_type=mt + "_text")
        try:
            cfg = cls.from_dict(text, top)
        except ConfigError as e:
            raise ConfigError(f"{f}: {e}") from None
        quant = top.get("quantization_config", text.get("quantization_config"))
        if quant is not None and not isinstance(quant, dict):
            raise ConfigError(f"{f}: quantization_config must be a JSON object, got {str(quant)[:80]!r}")
        if quant is not None:
            cfg.quantization = check_quantization(quant, f)
            cfg.modules_to_not_convert = [e.removeprefix("model.language_model.").removeprefix("model.")
                                          for e in quant.get("modules_to_not_convert") or []]
        gen = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen):
            g = read_json(gen, "generation config")
            eos = g.get("eos_token_id") if isinstance(g, dict) else None
            if not isinstance(g, dict) or not _eos_ids(eos):
                raise ConfigError(f"{gen}: a JSON object whose eos_token_id is a token id or a list of them, got "
                                  f"{str(g)[:80]!r}")
            for e in [eos] if isinstance(eos, int) else (eos or []):
                if e not in cfg.eos_token_ids:
                    cfg.eos_token_ids.append(e)
        return cfg


# ==============================================================================================
# Model
# ==============================================================================================

def rope_inv_freq(dim, theta, device=None):
    """RoPE's inverse frequencies theta^(-2i/dim), i < dim/2, for the first `dim` dims of a head (fp32)."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, device=device).float() / dim)


def init_rope(model, device):
    """RoPE frequencies are no checkpoint tensors: computed on the device once the weights are there."""
    for m in model.modules():
        if hasattr(m, "rope_dim"):
            m.inv_freq = rope_inv_freq(m.rope_dim, m.rope_theta, device)
    return model


FP8 = K.FP8  # float8_e4m3fn, the block-FP8 weights' dtype


class Linear(nn.Linear):
    """nn.Linear without bias, through kernels.linear (batch-invariant on the CPU reference path). Block-FP8
    (an FP8 checkpoint, --quantization fp8): weight float8_e4m3fn [N, K] and weight_scale_inv fp32
    [ceil(N/128), ceil(K/128)], W = weight x the scale of its 128 x 128 block (the checkpoint's names)."""
    def __init__(self, n_in, n_out, bias=False):
        super().__init__(n_in, n_out, bias=False)
        self.register_parameter("weight_scale_inv", None)                           # None: not FP8

    def forward(self, x, residual=None, then=None):
        return K.linear(x, self.weight, residual, scale=self.weight_scale_inv, then=then)


class RMSNorm(nn.Module):
    """Qwen3.5/3.6's zero-centred RMSNorm: the stored weight w scales by (1 + w). plain=True: Qwen3's (the
    drafters' layers), y = w * (x_f32 * rsqrt(mean(x^2) + eps)).to(dtype)."""
    def __init__(self, dim, eps, plain=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if plain else torch.zeros(dim))
        self.eps = eps
        self.plain = plain

    def forward(self, x):
        return (K.plain_rms_norm if self.plain else K.rms_norm)(x, self.weight, self.eps)

    @property
    def args(self):
        """(weight, eps): what kernels.linear's norm / then take (as then, a plain one is marked K.PlainNorm)."""
        return K.PlainNorm((self.weight, self.eps)) if self.plain else (self.weight, self.eps)


def project(x, mod, attr, *linears):
    """What the linears (all reading x) compute: views of one GEMM where fuse_projections fused them as
    mod.<attr> (its block scales mod.<attr>_scale, or None), else one GEMM each."""
    if not hasattr(mod, attr):
        return [l(x) for l in linears]
    y = K.linear(x, getattr(mod, attr), scale=getattr(mod, attr + "_scale"))
    return y.split([l.weight.shape[0] for l in linears], -1)


@dataclass
class Ctx:
    """What one forward step needs besides the tokens: which state slots, at which positions, how."""
    state: "State"
    slots: torch.Tensor          # [B] long, state slot of each row
    pos: torch.Tensor            # [B] long, position of each row's first token
    kv_len: int                  # cache prefix attention must look at (>= max(pos) + T)
    mode: str = "decode"         # "prefill" (chunked GDN), "decode" (T tokens, commit all), "verify"
    no_write: "torch.Tensor | None" = field(init=False, default=None)  # verify: [B] zeros, GDN n_keep

    def __post_init__(self):
        # A verify leaves the GDN states as they are (n_keep = 0). The zeros are the state's own, allocated
        # once: a tensor made here would die with the Ctx, and a CUDA graph captured with this Ctx would then
        # read freed memory on every replay (in 0d2d4b3 it did: garbage n_keep, illegal memory accesses on the
        # H200).
        if self.mode == "verify":
            self.no_write = self.state.keep_none[:self.slots.shape[0]]


class Attention(nn.Module):
    """Gated full attention: per-head [query | gate] from q_proj, q/k RMSNorm, partial RoPE, GQA."""
    def __init__(self, cfg, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim  # sizes
        H = cfg.hidden_size
        self.q_proj = Linear(H, 2 * self.nh * self.hd, bias=False)
        self.k_proj = Linear(H, self.nkv * self.hd, bias=False)
        self.v_proj = Linear(H, self.nkv * self.hd, bias=False)
        self.o_proj = Linear(self.nh * self.hd, H, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.rope_dim, self.rope_theta = cfg.rotary_dim, cfg.rope_theta                # partial RoPE
        self.register_buffer("inv_freq", rope_inv_freq(self.rope_dim, self.rope_theta), persistent=False)

    def forward(self, x, ctx, residual=None, then=None):
        """o_proj(attention(x)) [+ residual], through then (kernels.linear's: the next RMSNorm)."""
        B, T, _ = x.shape
        qg, k, v = project(x, self, "qkv", self.q_proj, self.k_proj, self.v_proj)  # fused after loading
        qg = qg.view(B, T, self.nh, 2 * self.hd)                                     # per head [query | gate]
        k, v = k.view(B, T, self.nkv, self.hd), v.view(B, T, self.nkv, self.hd)
        k_cache, v_cache = ctx.state.kv[self.layer_id]
        # q/k norm + RoPE, and k, v written into the cache at positions pos[b] + t (one kernel on the GPU)
        q = K.attention_prep(qg, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.inv_freq,
                             k_cache, v_cache, ctx.slots, ctx.pos)                   # [B, T, nh, hd]
        # [B, T, nh, hd], times the output gate sigmoid(gate) (on the GPU in the attention's last launch)
        o = K.attention(q, k_cache, v_cache, ctx.slots, ctx.pos, ctx.kv_len, gate=qg[..., self.hd:])
        return self.o_proj(o.view(B, T, -1), residual, then)


class GatedDeltaNet(nn.Module):
    """Linear attention by the gated delta rule; its state: a conv window and a d_k x d_v matrix per head."""
    def __init__(self, cfg, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.cfg = cfg
        H, C, Kc = cfg.hidden_size, cfg.conv_dim, cfg.linear_conv_kernel_dim
        self.in_proj_qkv = Linear(H, C, bias=False)
        self.in_proj_z = Linear(H, cfg.value_dim, bias=False)
        self.in_proj_b = Linear(H, cfg.linear_num_value_heads, bias=False)
        self.in_proj_a = Linear(H, cfg.linear_num_value_heads, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(C, 1, Kc))
        self.dt_bias = nn.Parameter(torch.ones(cfg.linear_num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.linear_num_value_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(cfg.linear_value_head_dim))
        self.out_proj = Linear(cfg.value_dim, H, bias=False)

    def split(self, y, B, T):
        c = self.cfg
        q, k, v = y.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        return (q.reshape(B, T, c.linear_num_key_heads, -1), k.reshape(B, T, c.linear_num_key_heads, -1),
                v.reshape(B, T, c.linear_num_value_heads, -1))

    def forward(self, x, ctx, residual=None, then=None):
        """out_proj(the gated delta rule over x) [+ residual], through then (the next RMSNorm)."""
        B, T, _ = x.shape
        st = ctx.state
        c = self.cfg
        if hasattr(self, "in_proj"):  # fused after loading: one GEMM, views of its output
            mixed, z, b, a = project(x, self, "in_proj", self.in_proj_qkv, self.in_proj_z, self.in_proj_b,
                                     self.in_proj_a)
        else:  # FP8: qkv | z (FP8) and b | a (bf16) fused apart, as vLLM does; or not fused
            mixed, z = project(x, self, "in_proj_qkvz", self.in_proj_qkv, self.in_proj_z)
            b, a = project(x, self, "in_proj_ba", self.in_proj_b, self.in_proj_a)
        # mixed [B, T, C] pre-conv inputs; z [B, T, value_dim] output gate; a, b [B, T, H_v] raw decay / beta
        z = z.reshape(B, T, -1, c.linear_value_head_dim)
        # a verify passes n_keep = zeros (ctx.no_write): the states stay; commit() advances them afterwards
        y = K.causal_conv(mixed, st.conv[self.layer_id], ctx.slots, self.conv1d.weight[:, 0], ctx.no_write)
        q, k, v = self.split(y, B, T)
        if ctx.mode == "prefill" and T > 1:
            # beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
            g, beta = K.gdn_gates(a, b, self.A_log, self.dt_bias)
            o = K.gdn_chunked(q, k, v, g, beta, st.rec[self.layer_id], ctx.slots)
        else:  # the gates are computed inside the recurrent kernel
            o = K.gdn_recurrent_gated(q, k, v, a, b, self.A_log, self.dt_bias, st.rec[self.layer_id],
                                      ctx.slots, ctx.no_write)
        if ctx.mode == "verify":
            # Rollback by replay: a verify leaves the state untouched and keeps its per-token inputs; commit()
            # re-runs the accepted prefix. Measured against per-position snapshots (27B layer, H_v=48, d=128):
            # memory per slot per layer 41 KiB vs 6 MiB at T=2 and 326 KiB vs 48 MiB at T=16 (snapshots for
            # 8 slots x 48 layers x 16 positions would be 18 GiB). Time: the CPU reference replays 1.7-2.2x
            # slower (it recomputes), but the GPU kernel is bound by state bytes: replay moves 3 state passes
            # (verify read, commit read + write) whatever T is, snapshots 1 + T passes - equal at T = 2,
            # 5.7x fewer bytes for replay at T = 16. Hence replay.
            st.stash[self.layer_id] = (mixed, q, k, v, a, b)
        o = K.gated_rms_norm(o, z, self.norm.weight, self.cfg.rms_norm_eps)
        return self.out_proj(o.reshape(B, T, -1), residual, then)

    def commit(self, ctx, n_keep):
        """After a verify: advance the conv window and recurrent state by the first n_keep[b] tokens."""
        mixed, q, k, v, a, b = ctx.state.stash.pop(self.layer_id)  # states only: the verify made the outputs
        st = ctx.state
        i = self.layer_id
        K.gdn_recurrent_gated(q, k, v, a, b, self.A_log, self.dt_bias, st.rec[i], ctx.slots, n_keep,
                              outputs=False, conv=(mixed, st.conv[i]))          # + the conv window


class MLP(nn.Module):
    def __init__(self, H, I):
        super().__init__()
        self.gate_proj = Linear(H, I, bias=False)
        self.up_proj = Linear(H, I, bias=False)
        self.down_proj = Linear(I, H, bias=False)

    def forward(self, x, residual=None, norm=None, then=None):
        """down(silu(gate x) * up x) [+ residual: the layer's skip connection, added by the down GEMM]; norm:
        (weight, eps) of a Qwen3 RMSNorm to apply to x first (inside the gate/up GEMM: kernels.linear); then:
        the next RMSNorm's (weight, eps), done with down's last step (returns (its output, the sum))."""
        if hasattr(self, "gate_up"):  # fused after loading (fuse_projections): one GEMM, one activation
            h = K.linear(x, self.gate_up, scale=self.gate_up_scale, norm=norm, then="swiglu")  # silu(g) * up
            return self.down_proj(h, residual, then)
        x = x if norm is None else K.plain_rms_norm(x, *norm)
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return K.apply_then(y if residual is None else residual + y, then)


class MoE(nn.Module):
    """Top-k routed experts (fp32 softmax, renormalised) plus one shared expert behind a sigmoid gate."""
    def __init__(self, cfg):
        super().__init__()
        H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.gate = Linear(H, E, bias=False)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))  # [E, 2I, H]: gate rows, up rows
        self.experts.down_proj = nn.Parameter(torch.zeros(E, H, I))         # [E, H, I]
        for name in ("gate_up_proj_scale_inv", "down_proj_scale_inv"):  # FP8: fp32 scales (declare_fp8)
            self.experts.register_parameter(name, None)
        self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(H, 1, bias=False)
        # the fused router linears' top-k (and the shared expert's SwiGLU after router | shared gate)
        self.route, self.route_swiglu = K.Route(self.top_k, E), K.Route(self.top_k, E, swiglu=E + 1)

    def forward(self, x, residual=None, then=None):
        """The routed experts plus the gated shared expert [+ residual], as one output (a fused epilogue);
        then: the next RMSNorm, as MLP's (done by the launch that sums the experts: kernels.moe_experts)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                                # [N, H]
        E = self.experts.gate_up_proj.shape[0]
        if hasattr(self, "router_shared"):  # fused after loading: router | shared gate | shared gate_up
            # the router's top-k (w, idx [N, k]) and the shared expert's SwiGLU (h [N, I]) done with the linear
            y, w, idx, h = K.linear(x, self.router_shared, then=self.route_swiglu)
            sg, shared = y[:, E:E + 1], self.shared_expert.down_proj(h)
        elif hasattr(self, "router_gate"):  # FP8: router | shared gate (bf16) fused apart from the shared expert
            y, w, idx = K.linear(x, self.router_gate, scale=self.router_gate_scale, then=self.route)
            sg, shared = y[:, E:], self.shared_expert(x)
        else:  # not fused
            w, idx = K.moe_route(self.gate(x), self.top_k)
            sg, shared = self.shared_expert_gate(x), self.shared_expert(x)
        res = None if residual is None else residual.reshape(-1, shape[-1])
        ex = self.experts
        y = K.moe_experts(x, w, idx, ex.gate_up_proj, ex.down_proj, shared, sg, res,
                          gate_up_scale=ex.gate_up_proj_scale_inv, down_scale=ex.down_proj_scale_inv, then=then)
        return y.view(shape) if then is None else tuple(t.view(shape) for t in y)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id, full_attention):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if full_attention:
            self.self_attn = Attention(cfg, layer_id)
        else:
            self.linear_attn = GatedDeltaNet(cfg, layer_id)
        self.mlp = MoE(cfg) if cfg.moe else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, x, ctx, next_norm):
        """h = input_layernorm(x), x the residual stream -> (next_norm(x'), x'), x' = x + mixer(h) + mlp(...):
        each skip connection and the RMSNorm after it are done with the GEMM before them (kernels.linear's
        then: one launch with its split-K sum), so the layer before made h, and this one makes the next's."""
        mixer = self.self_attn if hasattr(self, "self_attn") else self.linear_attn
        y, x = mixer(h, ctx, residual=x, then=self.post_attention_layernorm.args)  # x + mixer(h), its norm
        return self.mlp(y, residual=x, then=next_norm.args)                      # x + mlp(y), next norm


class MTPHead(nn.Module):
    """The checkpoint's multi-token-prediction head: fc(cat[norm(embed(x_{t+1})), norm(h_t)]) -> one
    full-attention layer (own KV cache, state layer id "mtp") -> norm; shares embedding and lm_head."""
    def __init__(self, cfg):
        super().__init__()
        H = cfg.hidden_size
        self.fc = Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "mtp", full_attention=True)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(self, emb, hidden, ctx):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], -1))
        layer = self.layers[0]
        return layer(layer.input_layernorm(x), x, ctx, self.norm)[0]


class Qwen36(nn.Module):
    """The text decoder. forward() returns final-norm hidden states; logits() applies the lm_head
    only where logits are needed. Parameter names are the checkpoint's, minus `model.[language_model.]`."""
    def __init__(self, cfg, with_mtp=True):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, t == "full_attention")
                                    for i, t in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.mtp = MTPHead(cfg) if with_mtp and cfg.mtp_num_hidden_layers > 0 else None
        self.draft_head = None  # (e4m3, scales): the lm_head in FP8 for the drafts of an FP8 target (fp8_head)

    def forward(self, ids, ctx, taps=()):
        """Final-norm hidden states [B, T, H]; with `taps` (layer ids, "output of layer i", -1 = the
        embeddings) also the list of those layers' outputs, for drafters that read them (DFlash, DSpark)."""
        x = self.embed_tokens(ids)                                                   # [B, T, H]
        aux = [x] if -1 in taps else []
        L = self.layers
        h = L[0].input_layernorm(x)                        # the others' come with the layer before (next_norm)
        for i, layer in enumerate(L):
            h, x = layer(h, x, ctx, L[i + 1].input_layernorm if i + 1 < len(L) else self.norm)
            if i in taps:
                aux.append(x)
        return (h, aux) if taps else h

    def logits(self, h):
        return (K.linear(h, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(h)).float()

    def draft_logits(self, h):
        """The logits the drafts are picked from (the MTP head; DFlash / DSpark without their own lm_head):
        logits(h), or on an FP8 target its lm_head's FP8 copy (draft_head): half the bytes of the bf16 lm_head,
        which the verify keeps. A draft decides only how many tokens a verify accepts, never which."""
        if self.draft_head is None:
            return self.logits(h)
        return K.linear(h, self.draft_head[0], scale=self.draft_head[1]).float()

    def commit(self, ctx, n_keep):
        """Bring every GDN layer's state to the end of the accepted prefix of the last verify."""
        for layer in self.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.commit(ctx, n_keep)


def fuse_projections(model):
    """For inference: concatenate the projections that read the same input (GDN in_proj_qkv/z/b/a, attention
    q/k/v, MLP gate/up; MoE router, shared-expert gate and shared expert gate/up) into one weight each; the
    original parameters become views of it, so nothing is stored twice. A decode step then launches one GEMM
    where it launched four, three or two (MoE: four small GEMMs, which are launch-bound, become one).
    Only projections of one kind fuse: unquantized ones, or FP8 ones of whole 128-row blocks (their block
    scales then concatenate too). So in an FP8 model GDN's qkv | z (FP8) and b | a (bf16) fuse apart, as in
    vLLM, and so do the MoE's router | shared-expert gate (bf16) and the shared expert's gate | up (FP8);
    projections that cannot fuse stay apart (the forwards run them one by one)."""
    def fuse(mod, attr, linears):
        B = K.FP8_BLOCK
        scales = [getattr(l, "weight_scale_inv", None) for l in linears]          # drafters: nn.Linear
        fp8 = scales[0] is not None
        if any((s is not None) != fp8 for s in scales):
            return False
        if fp8 and any(l.weight.shape[0] % B for l in linears):  # a block would straddle two parts
            return False
        w = torch.cat([l.weight for l in linears])
        s = torch.cat(scales) if fp8 else None
        setattr(mod, attr, w)
        setattr(mod, attr + "_scale", s)
        at = 0
        for l in linears:
            n = l.weight.shape[0]
            l.weight = nn.Parameter(w[at:at + n], requires_grad=False)
            if fp8:
                l.weight_scale_inv = nn.Parameter(s[at // B:(at + n) // B], requires_grad=False)
            at += n
        return True
    in_moe = set()
    for m in model.modules():  # parents before children: a MoE's shared expert is fused with its router
        if isinstance(m, GatedDeltaNet):
            parts = [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]
            if not fuse(m, "in_proj", parts):
                fuse(m, "in_proj_qkvz", parts[:2])
                fuse(m, "in_proj_ba", parts[2:])
        elif isinstance(m, Attention) or (isinstance(m, Qwen3Attention) and m.q_proj.bias is None):
            fuse(m, "qkv", [m.q_proj, m.k_proj, m.v_proj])
        elif isinstance(m, MoE):
            se = m.shared_expert
            if fuse(m, "router_shared", [m.gate, m.shared_expert_gate, se.gate_proj, se.up_proj]):
                in_moe.add(id(se))
            else:
                fuse(m, "router_gate", [m.gate, m.shared_expert_gate])
        elif isinstance(m, MLP) and id(m) not in in_moe:
            fuse(m, "gate_up", [m.gate_proj, m.up_proj])
    return model


# ==============================================================================================
# State: allocated once per engine
# ==============================================================================================

class State:
    """All per-sequence state, for `num_slots` sequences plus one dummy slot (the last) for padding rows.

    kv[i]   = (K, V) caches [slots, max_len, n_kv, head_dim] of attention layer i (and "mtp")
    conv[i] = the last K-1 pre-conv inputs [slots, conv_dim, K-1] of GDN layer i (model dtype)
    rec[i]  = the recurrent state [slots, H_v, d_k, d_v] of GDN layer i (fp32)
    stash   = per-token GDN inputs of the last verify step, replayed by commit() for the accepted prefix
    """
    def __init__(self, cfg, num_slots, max_len, dtype, device, mtp=False):
        S = num_slots + 1
        self.dummy_slot = num_slots                                   # the last slot: padding rows
        self.max_len = max_len
        self.kv = {}                                                  # layer id -> (K, V)
        self.conv = {}                                                # GDN layer id -> conv window
        self.rec = {}                                                 # GDN layer id -> recurrent state
        self.stash = {}                                               # GDN layer id -> a verify's inputs
        self.keep_none = torch.zeros(S, dtype=torch.long, device=device)  # n_keep = 0 per row: a verify (Ctx)
        kv_shape = (S, max_len, cfg.num_key_value_heads, cfg.head_dim)
        ids = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] + (["mtp"] if mtp else [])
        for i in ids:
            self.kv[i] = (torch.zeros(kv_shape, dtype=dtype, device=device),
                          torch.zeros(kv_shape, dtype=dtype, device=device))
        for i, t in enumerate(cfg.layer_types):
            if t == "linear_attention":
                K1 = cfg.linear_conv_kernel_dim - 1
                self.conv[i] = torch.zeros(S, cfg.conv_dim, K1, dtype=dtype, device=device)
                self.rec[i] = torch.zeros(S, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                          cfg.linear_value_head_dim, dtype=torch.float32, device=device)

    def reset(self, slot):
        """A new sequence starts from zero GDN state (stale KV beyond its length is never read)."""
        for t in (*self.conv.values(), *self.rec.values()):
            t[slot].zero_()


def copy_slot(state, src, dst, n):
    """Slot dst becomes a copy of slot src after its first n positions (a State, or a drafter's KVCache):
    K/V of positions 0..n-1 and the GDN states. How n > 1 samples of one prompt share its prefill."""
    for k, v in state.kv.values():
        k[dst, :n] = k[src, :n]
        v[dst, :n] = v[src, :n]
    for t in (*state.conv.values(), *state.rec.values()):
        t[dst] = t[src]


# ==============================================================================================
# Speculative config: vLLM's --speculative-config JSON object
# ==============================================================================================

SPEC_METHODS = ("mtp", "dflash", "dspark", "ngram", "draft_model")
VLLM_ONLY_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "suffix", "ngram_gpu", "custom_class",
                     "extract_hidden_states")
# vLLM keys that specdec accepts only at their default value (a different value is refused by name)
UNSUPPORTED_KEYS = {
    "moe_backend": None, "attention_backend": None, "kv_cache_dtype": None, "code_revision": None,
    "index_share_for_mtp_iteration": None, "disable_padded_drafter_batch": False,
    "disable_eagle_block_drop": False, "use_local_argmax_reduction": False, "use_heterogeneous_vocab": False,
    "parallel_drafting": False, "num_speculative_tokens_per_batch_size": None,
    "enable_adaptive_verification": False, "draft_load_config": None, "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1}
NEUTRAL_KEYS = {"kv_cache_dtype": "auto", "attention_backend": "auto", "moe_backend": "auto"}  # vLLM's "auto"
# What vLLM infers the method from when a draft `model` is given without one (config.py's SpeculativeConfig):
# a name containing these, else the draft's architectures, else its model_type
METHOD_BY_NAME = (("eagle-", "eagle"), ("eagle3", "eagle3"), ("dflash", "dflash"), ("dspark", "dspark"))
METHOD_BY_ARCH = {"MuseGlimmerAssistantModel": "dflash", "Qwen3DSparkModel": "dspark"}
MTP_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_5_mtp",
                   "qwen3_next_mtp")  # vLLM rewrites these draft configs to an MTP model


CLASS_PATH = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+"  # a dotted Python path (vLLM: custom_class)


def _positive_int(v):
    return _config_number(v, _POS_INT)


# What SpeculativeConfig.check accepts once the method and k are known, in this order: (field, accepted(value,
# config), message: {v} the value, {k} num_speculative_tokens, {k1} k + 1)
SPEC_CHECKS = [
    ("draft_tensor_parallel_size", lambda v, c: v in (None, 1),
     "draft_tensor_parallel_size={v} cannot be other value than 1 or target model tensor_parallel_size "
     "(1 in specdec)"),
    ("quantization", lambda v, c: v in (None, "none", "None"),
     "draft quantization {v!r} is not supported; specdec runs drafts in the target's dtype"),
    ("max_model_len", lambda v, c: v is None or (isinstance(v, int) and v >= 1),
     "max_model_len must be a positive integer, got {v!r}"),
    ("rejection_sample_method", lambda v, c: v in ("standard", "synthetic"),
     "rejection_sample_method must be 'standard' or 'synthetic', got {v!r}"),
    ("synthetic_acceptance_rates",                                     # not without synthetic mode
     lambda v, c: c.synthetic or (v is None and c.synthetic_acceptance_length is None),
     "synthetic_acceptance_rates / synthetic_acceptance_length need rejection_sample_method 'synthetic'"),
    ("synthetic_acceptance_rates",                                     # synthetic mode: one of the two
     lambda v, c: not c.synthetic or (v is None) != (c.synthetic_acceptance_length is None),
     "rejection_sample_method 'synthetic' needs exactly one of synthetic_acceptance_rates and "
     "synthetic_acceptance_length"),
    ("synthetic_acceptance_rates",
     lambda v, c: v is None or (isinstance(v, list) and len(v) == c.num_speculative_tokens
                                and all(0 <= r <= 1 for r in v)),
     "synthetic_acceptance_rates must be a list of {k} numbers in [0, 1], got {v!r}"),
    ("synthetic_acceptance_rates", lambda v, c: v is None or not any(b > a for a, b in zip(v, v[1:])),
     "synthetic_acceptance_rates must be non-increasing, got {v!r}"),
    ("synthetic_acceptance_length", lambda v, c: v is None or 1 <= v <= c.num_speculative_tokens + 1,
     "synthetic_acceptance_length must be in [1, num_speculative_tokens + 1 = {k1}], got {v!r}"),
    ("draft_sample_method", lambda v, c: v in ("greedy", "probabilistic"),
     "draft_sample_method must be 'greedy' or 'probabilistic', got {v!r}"),
    ("dspark_draft_topk", lambda v, c: v is None or c.method == "dspark",
     "dspark_draft_topk is only valid with method 'dspark'"),
    ("dspark_draft_topk", lambda v, c: v is None or (isinstance(v, int) and v >= 1),
     "dspark_draft_topk must be an integer >= 1, got {v!r}"),
    ("enforce_eager", lambda v, c: v is None or isinstance(v, bool),
     "enforce_eager must be true or false, got {v!r}"),
]


@dataclass
class SpeculativeConfig:
    """vLLM's speculative config (same keys, same validation rules, same meaning)."""
    method: str = None
    model: str = None
    num_speculative_tokens: int = None
    prompt_lookup_min: int = None
    prompt_lookup_max: int = None
    draft_tensor_parallel_size: int = None
    quantization: str = None
    max_model_len: int = None
    revision: str = None
    enforce_eager: bool = None
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: list = None
    synthetic_acceptance_length: float = None
    draft_sample_method: str = "greedy"
    dspark_draft_topk: int = None

    @classmethod
    def from_json(cls, obj, target=None):
        """Parse a JSON string or dict; every problem is a ConfigError with a one-line message. `target`: the
        target checkpoint's path (a draft `model` that is the target itself may be inferred as mtp)."""
        if isinstance(obj, SpeculativeConfig) or obj is None:
            return obj
        if isinstance(obj, str):
            try:
                obj = json.loads(obj)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"speculative config must be a JSON object, got {type(obj).__name__}")
        obj = dict(obj)
        if "tensor_parallel_size" in obj:
            raise ConfigError("'tensor_parallel_size' is not a valid argument in the speculative_config. "
                              "Please pass 'draft_tensor_parallel_size' instead.")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in list(obj):
            if key in UNSUPPORTED_KEYS:
                neutral = (UNSUPPORTED_KEYS[key],) + ((NEUTRAL_KEYS[key],) if key in NEUTRAL_KEYS else ())
                if obj[key] not in neutral:
                    raise ConfigError(f"speculative config key {key!r} is a vLLM option specdec does not "
                                      f"support (only {' or '.join(map(repr, neutral))} is accepted)")
                del obj[key]
            elif key not in known:
                raise ConfigError(f"unknown speculative config key {key!r} (extra keys are forbidden, as in "
                                  f"vLLM); accepted keys: {', '.join(sorted(known))}")
        return cls(**infer_from_draft(obj, target))

    def __post_init__(self):
        self.check()

    @property
    def synthetic(self):
        return self.rejection_sample_method == "synthetic"

    def check(self):
        """vLLM's validation, and its defaults: the method (inferred as vLLM infers it; `*_mtp` aliases are
        mtp), the model (mtp and dspark draft with the target's), ngram's lookup window; then SPEC_CHECKS."""
        self.method = self._method()
        k = self.num_speculative_tokens
        if self.model is None and k is not None:
            if self.method in ("dflash", "draft_model"):
                raise ConfigError("num_speculative_tokens was provided but without speculative model.")
            self.model = "ngram" if self.method == "ngram" else None
        if k is None:
            raise ConfigError("num_speculative_tokens must be provided with speculative model unless the "
                              "draft model config contains an n_predict parameter.")
        if not _positive_int(k):
            raise ConfigError(f"num_speculative_tokens must be a positive integer, got {k!r}")
        if self.method == "ngram":
            self._lookup_window()
        else:  # vLLM: the lookup window is ngram's; another method sets it to 0 (a value given is still checked)
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                v = getattr(self, name)
                if v is not None and not _positive_int(v):
                    raise ConfigError(f"{name} must be a positive integer, got {v!r}")
                setattr(self, name, 0)
        for name, accepted, message in SPEC_CHECKS:
            v = getattr(self, name)
            if not accepted(v, self):
                raise ConfigError(message.format(v=v, k=k, k1=k + 1))

    def _method(self):
        m = self.method
        if m is None:  # vLLM: model "ngram" -> ngram, a dotted class path -> custom_class, else draft_model
            if self.model in ("ngram", "[ngram]"):
                m = "ngram"
            elif (self.model and "/" not in self.model and re.fullmatch(CLASS_PATH, self.model)
                  and not os.path.exists(self.model)):
                m = "custom_class"
            else:
                m = "draft_model"
        if not isinstance(m, str):
            raise ConfigError(f"speculative method must be a string, got {m!r}")
        if m.endswith("_mtp"):
            warnings.warn(f"method `{m}` is deprecated and replaced with mtp.")
            m = "mtp"
        if m in VLLM_ONLY_METHODS:
            raise ConfigError(f"speculative method {m!r} is a vLLM method that specdec does not implement; "
                              f"accepted methods: {', '.join(SPEC_METHODS)} (and the *_mtp aliases of mtp)")
        if m not in SPEC_METHODS:
            raise ConfigError(f"unknown speculative method {m!r}; accepted methods: "
                              f"{', '.join(SPEC_METHODS)} (and the *_mtp aliases of mtp)")
        return m

    def _lookup_window(self):
        """ngram: [prompt_lookup_min, prompt_lookup_max], 5/5 by default; one given stands for both."""
        lo = self.prompt_lookup_min
        hi = self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _positive_int(v):
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if lo > hi:
            raise ConfigError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        self.prompt_lookup_min = lo
        self.prompt_lookup_max = hi

    def conditional_rates(self):
        """Synthetic mode: the probability of accepting position i given that positions < i were accepted."""
        if self.synthetic_acceptance_rates is not None:
            return list(self.synthetic_acceptance_rates)
        L, k = self.synthetic_acceptance_length, self.num_speculative_tokens
        whole = int(math.floor(L - 1))
        return [1.0 if i < whole else (L - 1 - whole if i == whole else 0.0) for i in range(k)]


def infer_from_draft(obj, target=None):
    """What vLLM reads from a draft checkpoint named by `model`: without a method, the method (a name with
    eagle-/eagle3/dflash/dspark, else the draft's architectures, else an MTP model_type: a Qwen3.5/3.6
    checkpoint drafts with its MTP layer); without num_speculative_tokens, the draft's n_predict. A hub id
    `model` becomes its snapshot in the local Hugging Face cache. -> the config dict, completed."""
    model = obj.get("model")
    if not isinstance(model, str) or model in ("ngram", "[ngram]"):
        return obj
    path = model if os.path.exists(model) else find_in_hf_cache(model)
    cfg = {}
    if path is not None and os.path.isfile(os.path.join(path, "config.json")):
        cfg = read_json(os.path.join(path, "config.json"), "config", obj=True)
    obj = dict(obj, model=path or model)
    method = obj.get("method")
    if isinstance(method, str) and (method == "mtp" or method.endswith("_mtp")):  # vLLM would load the MTP
        # layer from `model`; specdec's is the target's own
        if target is None or path is None or not os.path.samefile(path, target):
            raise ConfigError(f"method 'mtp' with model {model!r}: specdec's mtp drafts with the target's own "
                              "MTP head: leave 'model' out (or name the target), or pass \"method\": "
                              "\"draft_model\" to draft with that model as a separate LM")
        return dict(obj, model=None)
    archs, model_type, n_predict = cfg.get("architectures") or [], cfg.get("model_type"), cfg.get("n_predict")
    if obj.get("method") is None:
        method = next((m for key, m in METHOD_BY_NAME if key in model.lower()), None)
        method = method or next((METHOD_BY_ARCH[a] for a in archs if a in METHOD_BY_ARCH), None)
        if method is None and "DSparkDraftModel" in archs and model_type == "qwen3":
            method = "dspark"
        if method is None and model_type in ("medusa", "mlp_speculator"):
            method = model_type
        if method is None and model_type in MTP_MODEL_TYPES:
            same = target is not None and path is not None and os.path.samefile(path, target)
            if not same:
                raise ConfigError(f"the draft model {model!r} is a {model_type} checkpoint, which vLLM "
                                  "runs as method 'mtp' with that checkpoint's MTP layer; specdec's mtp "
                                  "drafts with the target's own MTP head: leave 'model' out for that, or "
                                  "pass \"method\": \"draft_model\" to draft with this model as a separate "
                                  "LM")
            method, obj["model"] = "mtp", None
            n_predict = (cfg.get("text_config") or cfg).get("mtp_num_hidden_layers")
        obj = dict(obj, method=method) if method is not None else obj
    k = obj.get("num_speculative_tokens")
    if _positive_int(n_predict):
        if k is None:
            obj["num_speculative_tokens"] = n_predict  # vLLM: "Default to max value defined in draft config"
        elif _positive_int(k) and k > n_predict and k % n_predict:
            raise ConfigError(f"num_speculative_tokens:{k} must be divisible by n_predict={n_predict}")
    return obj


# ==============================================================================================
# Proposers: draft k tokens per sequence
# ==============================================================================================
# One interface. A proposer is built as cls(spec, io), where io (ProposerIO) is all it may use of the
# engine; each step hands it the Batch of running rows.
#   prefill(req, hidden, taps, ids, pos)   see a prompt chunk at positions pos.. (model drafters fill their
#       caches): hidden [1, T, H] the target's final-norm states, taps the outputs of the target layers it
#       reads (.taps), ids [1, T] the next token of each position
#   propose(batch) -> (drafts [B, k] long, -1 = no draft; draft_probs [B, k, V] or None)
#   commit(batch, hidden, taps, ids, n_acc, tokens)   see the verified step over ids [B, k+1]; keep the
#       accepted prefix
#   fork(src, dst, n, token, hidden)   slot dst gets slot src's caches after its n-token prompt, but its own
#       first token [1] (hidden [1, 1, H]: the target's last prompt position); n > 1 samples share a prefill
#   taps: the target layers whose outputs it reads (DFlash/DSpark), [B, T, H] each, in its order; () if none

@dataclass
class Batch:
    """The rows of one step: the requests and, on the device, each row's slot, last position, last token."""
    reqs: list                # [B] requests
    slots: torch.Tensor       # [B] long, the state slot of each row
    pos: torch.Tensor         # [B] long, the position of each row's last token (the step's first input)
    last: torch.Tensor        # [B] long, each row's last token
    host_knows_pos: bool      # synchronous steps; an asynchronous step's positions live on the device only

    def kv_len(self, extra, cap):
        """How far an eager step's attention reads: the last position + extra when the host knows the
        positions, else cap (the cache length)."""
        return max(len(r.tokens) for r in self.reqs) - 1 + extra if self.host_knows_pos else cap


@dataclass
class ProposerIO:
    """What a proposer may use of the engine, and nothing more (a test builds one without an Engine)."""
    model: nn.Module          # the target: its embeddings, lm_head, MTP head and config
    state: "State"            # the target's state (the MTP layer's KV cache, layer id "mtp", lives there)
    num_slots: int            # max_num_seqs; a drafter's caches get one slot more: the padding rows' dummy
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    h2d: object               # h2d(host data, dtype=None) -> device tensor, without waiting for the device
    call: object              # call(name, fn, kv_len, inputs) -> fn(kv_len, **inputs): a CUDA graph when on


def ngram_lookup(ctx, k, lo, hi):
    """vLLM's prompt lookup on the host (what kernels.ngram_lookup computes on the device): the longest suffix
    n-gram of ctx (lo <= n <= hi) that occurred earlier, its earliest occurrence, and up to k tokens that
    followed it. Vectorised with numpy (the tests hold a plain-loop reference)."""
    a = np.asarray(ctx, dtype=np.int64)
    N = len(a)
    for n in range(min(hi, N - 1), lo - 1, -1):
        hits = (np.lib.stride_tricks.sliding_window_view(a[:N - 1], n) == a[N - n:]).all(1)  # starts 0..N-n-1
        if hits.any():
            start = int(hits.argmax())
            return ctx[start + n:start + n + k]
    return []


class NgramProposer:
    """method ngram: prompt lookup over each request's tokens, on the device (kernels.ngram_lookup). Each
    slot's tokens are kept in hist: the prompt at prefill, each step's accepted tokens at commit. Nothing is
    read from the host, so ngram steps run asynchronously and, on the GPU, as captured graphs."""
    taps = ()

    def __init__(self, spec, io):
        self.io = io
        self.k = spec.num_speculative_tokens
        self.lo = spec.prompt_lookup_min
        self.hi = spec.prompt_lookup_max
        W = io.max_model_len + self.k + 1     # a step writes its k+1 tokens after positions < max_model_len
        self.hist = torch.zeros(io.num_slots + 1, W, dtype=torch.long, device=io.device)   # [slots + 1, W]

    def prefill(self, req, hidden, taps, ids, pos):
        # ids [1, T]: the next token of each position of the chunk, i.e. the tokens at pos+1..pos+T
        if pos == 0:
            self.hist[req.slot, 0] = req.prompt_ids[0]
        self.hist[req.slot, pos + 1:pos + 1 + ids.shape[1]] = ids[0]

    def _propose(self, kv_len, slots, pos):
        room = self.io.max_model_len - 1 - pos                          # drafts may end at max_model_len
        return K.ngram_lookup(self.hist, slots, pos, room, self.k, self.lo, self.hi), None

    def propose(self, batch):
        return self.io.call("ngram-propose", self._propose, 0, dict(slots=batch.slots, pos=batch.pos))

    def _commit(self, kv_len, slots, pos, tokens):
        # the step's tokens (the accepted drafts and the next one; -1 after them) at pos+1..; what follows the
        # emitted ones is overwritten by later steps before a lookup can read it (it reads positions <= last)
        at = pos[:, None] + 1 + torch.arange(tokens.shape[1], device=pos.device)         # [B, k+1]
        self.hist[slots[:, None], at] = tokens
        return ()

    def commit(self, batch, hidden, taps, ids, n_acc, tokens):
        self.io.call("ngram-commit", self._commit, 0, dict(slots=batch.slots, pos=batch.pos, tokens=tokens))

    def fork(self, src, dst, n, token, hidden):
        self.hist[dst, :n] = self.hist[src, :n]  # the prompt, then the sample's own first token
        self.hist[dst, n] = token[0]


def draft_noise(io, reqs, k):
    """Per-request inputs of probabilistic drafting: temperatures [B] and uniforms [B, k] from each
    request's generator (drawn on the host so a captured graph can take them as inputs)."""
    t = io.h2d([r.params.temperature if not r.params.greedy else 1e-5 for r in reqs])
    return t, io.h2d(torch.stack([torch.rand(k, generator=r.gen) for r in reqs]))


def draft_pick(logits, temp=None, u=None):
    """Greedy drafting (temp None: argmax, verified as one-hot q) or probabilistic drafting (sample with the
    uniforms u [B] from softmax(logits / temp), which is returned as q)."""
    if temp is None:
        return K.argmax(logits), None
    q = (logits / temp[:, None]).softmax(-1)
    return sample_from(q, u), q


class MTPProposer:
    """The target's own MTP layer, chained k times. Its KV cache ("mtp") gets one entry per target
    position: (h_t, embed(x_{t+1})) at position t, written over the prompt at prefill and over the
    accepted tokens after each verify. The MTP output hidden at the last committed position is kept
    per slot; propose() turns it into d1 and feeds its own output back for d2..dk. On the GPU the
    whole chain, and the commit pass, run as captured graphs."""
    taps = ()
    accepted_only = True  # on a CPU the commit pass takes the accepted positions only (commit)

    def __init__(self, spec, io):
        self.io = io
        self.model = io.model
        self.k = spec.num_speculative_tokens
        self.greedy = spec.draft_sample_method == "greedy"
        H = io.model.cfg.hidden_size
        self.hidden = torch.zeros(io.num_slots + 1, H, dtype=io.dtype, device=io.device)  # [slots + 1, H]

    def _run(self, ids, hidden, slots, pos, kv_len):
        m = self.model
        with K.cpu_draft():  # on a CPU the MTP layer's linears in bf16 (kernels.cpu_draft); the GPU: as is
            return m.mtp(m.embed_tokens(ids), hidden, Ctx(self.io.state, slots, pos, kv_len, "decode"))

    def _logits(self, h):
        with K.cpu_draft():  # the draft's lm_head too (the target's verify keeps fp32)
            return self.model.draft_logits(h)

    def prefill(self, req, hidden, taps, ids, pos):
        # ids: the chunk's tokens shifted left by one (the next token of each position)
        slots = self.io.h2d([req.slot], torch.long)
        out = self._run(ids, hidden, slots, self.io.h2d([pos]), pos + ids.shape[1])
        self.hidden[req.slot] = out[0, -1]

    def _chain(self, kv_len, slots, pos, temp=None, u=None):
        drafts = []
        probs = []
        h = self.hidden[slots]                                                       # [B, H]
        for j in range(self.k):
            if j > 0:
                h = self._run(drafts[-1][:, None], h[:, None], slots, pos + j, kv_len)[:, 0]
            d, q = draft_pick(self._logits(h), temp, None if u is None else u[:, j])
            drafts.append(d)
            probs.append(q)
        return torch.stack(drafts, 1), None if temp is None else torch.stack(probs, 1)

    def propose(self, batch):
        inputs = dict(slots=batch.slots, pos=batch.pos - 1)                   # where the kept hidden is
        if not self.greedy:
            inputs["temp"], inputs["u"] = draft_noise(self.io, batch.reqs, self.k)
        kv_len = batch.kv_len(self.k - 1, self.io.state.max_len)
        return self.io.call("mtp-propose", self._chain, kv_len, inputs)

    def _commit(self, kv_len, slots, pos, nxt, hidden, n_acc):
        out = self._run(nxt, hidden, slots, pos, kv_len)                              # [B, k+1, H]
        self.hidden[slots] = out[torch.arange(out.shape[0], device=out.device), n_acc]
        return ()

    def commit(self, batch, hidden, taps, ids, n_acc, tokens):
        # position p+i gets (h_{p+i}, x_{p+i+1}): the drafts, with the correction/bonus token at n_acc
        rows = torch.arange(ids.shape[0], device=ids.device)
        nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)
        nxt[rows, n_acc] = tokens[rows, n_acc]
        if self.accepted_only and self.io.device.type == "cpu":
            # On a CPU the host knows n_acc at no cost: only the positions up to the furthest accepted one
            # pass through the MTP layer (the others' KV, like a shorter row's beyond its own n_acc, is
            # rewritten by later steps before anything reads it); each row's result is the same bits (MTP
            # k=3 on the toy: 4 rows -> 2.7 on average; test_cpu_mtp_commit_accepted_rows)
            m = int(n_acc.max()) + 1
            nxt, hidden = nxt[:, :m], hidden[:, :m]
        inputs = dict(slots=batch.slots, pos=batch.pos, nxt=nxt, hidden=hidden, n_acc=n_acc)
        self.io.call("mtp-commit", self._commit, batch.kv_len(nxt.shape[1], self.io.state.max_len), inputs)

    def fork(self, src, dst, n, token, hidden):
        # the MTP KV came with the target's State; its last position holds (h_{n-1}, the first token): redo it
        out = self._run(token[None], hidden, self.io.h2d([dst], torch.long), self.io.h2d([n - 1]), n)
        self.hidden[dst] = out[0, -1]


# ==============================================================================================
# Model drafters: dflash, dspark (block drafters on the target's taps) and draft_model
# ==============================================================================================
# dflash, dspark: block drafters reading the target's hidden-state taps; draft_model: a separate small LM.
# Facts from z-lab/dflash, deepseek-ai/DeepSpec, vllm-project/speculators and vLLM (shared/reference/
# speculative-methods.md §5, §6, §8).
#
# A block drafter is a stack of plain Qwen3 layers (RMSNorm x*w, not zero-centred; no output gate; full NeoX
# RoPE) with its own KV cache, indexed by position. Committed tokens enter it as "context" K/V: c =
# hidden_norm(fc(concat taps)), then per layer k = RoPE(k_norm(k_proj(c))), v = v_proj(c) (no
# input_layernorm). A draft is one forward over [anchor, mask x (Q-1)] at positions P..P+Q-1, each query
# seeing all context before P and the whole block. DFlash: Q = K+1, mask slot j predicts position P+j.
# DSpark: Q = K, slot j predicts P+j+1 (the anchor predicts too), then a low-rank Markov bias is added token
# by token. Rejected context needs no rollback: the next block overwrites those positions before anything
# reads them.

@dataclass
class DraftConfig:
    """A Qwen3 draft network: layer hyper-parameters, plus what a DFlash/DSpark drafter adds."""
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    windows: list = None              # per layer: sliding window or None
    causal: list = None               # per layer: causal attention? (a plain LM: all)
    block_size: int = 0
    mask_token_id: int = None
    target_layer_ids: list = None     # "output of layer i" of the target, -1 = its embeddings
    from_anchor: bool = False         # DSpark: the anchor slot is a prediction position too
    draft_vocab_size: int = None      # rows of the draft's own lm_head (reduced vocab needs d2t)
    markov_rank: int = 0
    confidence_with_markov: bool = False


# A Qwen3 drafter config's numbers (qwen3_fields), as CONFIG_NUMBERS for the target: (key, required, kind)
QWEN3_NUMBERS = [*[(k, True, _POS_INT) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                  "intermediate_size", "vocab_size")],
                 *[(k, False, _POS_INT) for k in ("num_key_value_heads", "head_dim")],
                 *[(k, False, _POS_FLOAT) for k in ("rms_norm_eps", "rope_theta")]]


def qwen3_fields(d, where):
    """DraftConfig fields of a Qwen3 config dict, and its layer_types. A number missing or of another type is
    refused naming the key (it was a KeyError, or a TypeError inside torch)."""
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: unsupported hidden_act {d['hidden_act']!r}; only silu is implemented")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: rope_parameters must be a JSON object, got {str(rope)[:80]!r}")
    for key, required, kind in QWEN3_NUMBERS:
        v = rope.get(key, d.get(key)) if key == "rope_theta" else d.get(key)
        if v is None and required:
            raise ConfigError(f"{where}: the config has no {key!r}")
        if v is not None and not _config_number(v, kind):
            raise ConfigError(f"{where}: {key} must be {kind}, got {v!r}")
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"{where}: unsupported RoPE scaling {rope!r}; only default RoPE is implemented")
    n = d["num_hidden_layers"]
    sliding = lambda i: d.get("use_sliding_window") and i >= d.get("max_window_layers", n)     # noqa: E731
    types = d.get("layer_types") or ["sliding_attention" if sliding(i) else "full_attention"
                                     for i in range(n)]
    if len(types) != n or set(types) - {"full_attention", "sliding_attention"}:
        raise ConfigError(f"{where}: layer_types must list {n} full_attention/sliding_attention entries, "
                          f"got {types}")
    fields = dict(hidden_size=d["hidden_size"], num_hidden_layers=n,
                  num_attention_heads=d["num_attention_heads"],
                  num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
                  head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
                  intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"],
                  rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                  rope_theta=rope.get("rope_theta", d.get("rope_theta", 1e6)),
                  attention_bias=bool(d.get("attention_bias", False)),
                  tie_word_embeddings=bool(d.get("tie_word_embeddings", False)))
    return fields, types


def read_config(path, what):
    """A drafter's config.json; a quantized drafter (FP8 or other) is refused: drafters run unquantized. A hub id
    the local cache lacks gets resolve_model's line, with its `hf download` hint."""
    f = os.path.join(str(path), "config.json")
    if not os.path.exists(path) and HUB_ID.fullmatch(str(path)):  # a hub id that infer_from_draft did not find
        raise not_in_hf_cache(str(path), what)                    # in the cache: the target's line and hint
    if not os.path.isfile(f):
        raise ConfigError(f"{what} {path}: no config.json (expected a Hugging Face checkpoint directory)")
    top = read_json(f, "config", obj=True)
    for c in (top, top.get("text_config") or {}, top.get("transformer_layer_config") or {}):
        if isinstance(c, dict) and c.get("quantization_config"):
            if not isinstance(c["quantization_config"], dict):
                raise ConfigError(f"{f}: quantization_config must be a JSON object")
            method = c["quantization_config"].get("quant_method")
            raise ConfigError(f"{what} {path} is quantized (quant_method {method!r}); specdec runs drafters "
                              "unquantized, in the target's dtype: use the drafter's bf16 checkpoint")
    return top


def _layer_ids(v):
    """Whether v is what a drafter config gives as its target layers: a non-empty list of layer numbers."""
    return isinstance(v, list) and len(v) > 0 and all(isinstance(i, int) and not isinstance(i, bool) for i in v)


def block_layout(top, method, path):
    """The published layout of a DFlash/DSpark config.json -> (the method it is for, its layer config, its
    dflash_config, the layout's name, the target layer ids (our convention), whether the anchor drafts)."""
    arch = top.get("architectures") or []
    smt = top.get("speculators_model_type")
    if smt in ("dflash", "dspark"):  # speculators: the layer config nested, vLLM's aux ids ("entering L")
        aux = top.get("aux_hidden_state_layer_ids")
        if not _layer_ids(aux):
            raise ConfigError(f"{method} draft {path} (speculators {smt}): aux_hidden_state_layer_ids must be a "
                              f"list of layer numbers, got {aux!r}")
        ids = [i - 1 for i in aux]
        from_anchor = top.get("sample_from_anchor", smt == "dspark")
        layer = top.get("transformer_layer_config")  # the drafter's Qwen3 config: qwen3_fields reads it
        if not isinstance(layer, dict):
            raise ConfigError(f"{method} draft {path} (speculators {smt}): transformer_layer_config must be a JSON "
                              f"object (the draft layers' Qwen3 config), got {str(layer)[:80]!r}")
        return smt, layer, {}, f"speculators {smt}", ids, from_anchor
    if "DFlashDraftModel" in arch:  # z-lab
        dc = top.get("dflash_config") or {}
        ids = dc.get("target_layer_ids")
        return "dflash", top, dc, "z-lab DFlashDraftModel", ids, dc.get("sample_from_anchor", False)
    if "Qwen3DSparkModel" in arch or ("DSparkDraftModel" in arch and top.get("model_type") == "qwen3"):
        dc = top.get("dflash_config") or {}                                          # DeepSpec
        return "dspark", top, dc, "DeepSpec Qwen3DSparkModel", top.get("target_layer_ids"), True
    raise ConfigError(f"{method} draft {path}: not a DFlash/DSpark checkpoint (architectures {arch}); "
                      "expected DFlashDraftModel (z-lab), Qwen3DSparkModel (DeepSpec) or "
                      "speculators_model_type dflash/dspark")


def read_block_config(path, method):
    """config.json of a DFlash/DSpark draft in any published layout -> DraftConfig (ids in our convention)."""
    top = read_config(path, f"{method} draft")
    kind, base, dc, layout, ids, from_anchor = block_layout(top, method, path)
    where = f"{method} draft {path} ({layout})"
    if kind != method:
        raise ConfigError(f"{where} is a {kind} checkpoint: use method {kind!r}")
    fields, types = qwen3_fields(base, where if base is top else f"{where} transformer_layer_config")
    for key, ok in (("use_aux_hidden_state", (True,)), ("attention_sink_bias", (False,)),
                    ("projector_type", (None, "linear")), ("markov_head_type", ("vanilla",))):
        v = dc.get(key, top.get(key, ok[0]))
        if v not in ok:
            raise ConfigError(f"{where}: {key}={v!r} is not supported (only {ok[0]!r})")
    if ids is None or (mask := dc.get("mask_token_id", top.get("mask_token_id"))) is None:
        raise ConfigError(f"{where}: the config must give target_layer_ids and mask_token_id")
    forced = top.get("is_causal", dc.get("causal"))
    non_causal = top.get("sliding_window_non_causal", False)
    for key, v in (("sample_from_anchor", from_anchor), ("is_causal / causal", forced),
                   ("sliding_window_non_causal", non_causal), ("use_swa", dc.get("use_swa"))):
        if v is not None and not isinstance(v, bool):  # JSON true / false: a string "false" is not false
            raise ConfigError(f"{where}: {key} must be true or false, got {v!r}")
    if method == "dflash" and from_anchor:
        raise ConfigError(f"{where}: sample_from_anchor=true is not supported for dflash")
    block = top.get("block_size", dc.get("block_size", 16))
    rank = dc.get("markov_rank", top.get("markov_rank", 0))
    vocab = top.get("draft_vocab_size")  # (absent: the lm_head's rows)
    numbers = [("mask_token_id", mask, _INT0), ("block_size", block, _POS_INT), ("markov_rank", rank, _INT0)]
    if vocab is not None:
        numbers.append(("draft_vocab_size", vocab, _POS_INT))
    for key, v, kind in numbers:
        if not _config_number(v, kind):
            raise ConfigError(f"{where}: {key} must be {kind}, got {v!r}")
    if not _layer_ids(ids):
        raise ConfigError(f"{where}: target_layer_ids must be a list of layer numbers, got {ids!r}")
    # attention per layer, vLLM's rule: sliding layers (or all with use_swa) get the window; is_causal, then
    # dflash_config.causal, override the default "sliding layers are causal" (speculators: unless non-causal)
    sliding = [t == "sliding_attention" for t in types]
    if dc.get("use_swa") and not any(sliding):
        sliding = [True] * len(types)
    window = dc.get("swa_window_size", base.get("sliding_window"))
    if any(sliding) and not window:
        raise ConfigError(f"{where}: sliding attention needs a window (dflash_config.swa_window_size or "
                          "sliding_window)")
    if any(sliding) and not _config_number(window, _POS_INT):
        key = "dflash_config.swa_window_size" if "swa_window_size" in dc else "sliding_window"
        raise ConfigError(f"{where}: {key} must be a positive integer, got {window!r}")
    causal = [forced if forced is not None else s and not non_causal for s in sliding]
    return DraftConfig(**fields, windows=[window if s else None for s in sliding], causal=causal,
                       block_size=int(top.get("block_size", dc.get("block_size", 16))),
                       mask_token_id=int(mask), target_layer_ids=list(ids), from_anchor=bool(from_anchor),
                       draft_vocab_size=vocab,
                       markov_rank=int(dc.get("markov_rank", top.get("markov_rank", 0))),
                       confidence_with_markov=bool(top.get("confidence_head_with_markov", False)))


def block_attention(q, k_cache, v_cache, slots, pos, kv_len, causal=False, window=None):
    """Attention of T queries at positions pos[b]..pos[b]+T-1 over the slot's cached keys (the block's own
    keys already written). Non-causal (DFlash/DSpark blocks): every query sees all keys < pos[b]+T; causal:
    keys up to its own position. A sliding `window` W (z-lab's rule) also requires q_pos - k_pos < W and,
    when non-causal, k_pos - q_pos < W. q [B, T, n_h, d]; k_cache, v_cache [S, L, n_kv, d]; slots, pos [B];
    kv_len >= max(pos)+T. Returns [B, T, n_h, d]. Causal, or without a window, this is kernels.attention (the
    GPU kernel, in the drafters' key pieces: DRAFT_ATTN_CHUNK; a causal window inside it, on the Triton path:
    z-lab's sliding layers are causal); else a masked reference."""
    B, T, nh, d = q.shape
    chunk = K.DRAFT_ATTN_CHUNK  # every caller is a drafter's layer (Qwen3Attention)
    if causal and (window is None or K._fast(q)):
        return K.attention(q, k_cache, v_cache, slots, pos, kv_len, chunk, window=window)
    if window is None:
        # non-causal = every query placed at the block's last position: fold the T queries into the head axis
        # (head h*T + t keeps KV head h // group), so the causal kernel serves it as one decode token
        qf = q.transpose(1, 2).reshape(B, 1, nh * T, d)
        o = K.attention(qf, k_cache, v_cache, slots, pos + T - 1, kv_len, chunk)
        return o.view(B, nh, T, d).transpose(1, 2)
    g = nh // k_cache.shape[2]
    k, v = (c[slots, :kv_len].float().repeat_interleave(g, 2).transpose(1, 2) for c in (k_cache, v_cache))
    s = (q.float().transpose(1, 2) @ k.transpose(-1, -2)) * d ** -0.5                # [B, n_h, T, L]
    qp = (pos[:, None] + torch.arange(T, device=q.device))[..., None]               # [B, T, 1]
    kp = torch.arange(kv_len, device=q.device)                                       # [L]
    seen = (kp <= qp if causal else kp < (pos + T)[:, None, None]) & (qp - kp < window)
    if not causal:
        seen &= kp - qp < window
    p = s.masked_fill(~seen[:, None], float("-inf")).softmax(-1)
    return (p @ v).transpose(1, 2).to(q.dtype)


class Qwen3Attention(nn.Module):
    """Qwen3 attention (per-head q/k RMSNorm, full NeoX RoPE, GQA, no output gate), position-indexed cache."""
    def __init__(self, c, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim  # sizes
        self.causal = c.causal[layer_id]
        self.window = c.windows[layer_id]
        H, b = c.hidden_size, c.attention_bias
        lin = (lambda i, o: nn.Linear(i, o, bias=True)) if b else Linear  # Linear: kernels.linear, no bias
        self.q_proj = lin(H, self.nh * self.hd)
        self.k_proj = lin(H, self.nkv * self.hd)
        self.v_proj = lin(H, self.nkv * self.hd)
        self.o_proj = lin(self.nh * self.hd, H)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps, plain=True)
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps, plain=True)
        self.rope_dim, self.rope_theta = self.hd, c.rope_theta                          # full RoPE
        self.register_buffer("inv_freq", rope_inv_freq(self.rope_dim, self.rope_theta), persistent=False)

    def write_kv(self, x, ctx, q=None):
        """k = RoPE(k_norm(k_proj(x))), v = v_proj(x) into the cache at ctx.pos.. (x [B, T, H]); with the
        query projection q [B, T, nh * hd] also returns RoPE(q_norm(q)) [B, T, nh, hd]. One kernel on the
        GPU."""
        B, T, _ = x.shape
        k, v = self.k_proj(x), self.v_proj(x)
        return self._prep(k[..., :0] if q is None else q, k, v, ctx)

    def _prep(self, q, k, v, ctx):
        """q/k norms + RoPE, k and v into the cache at ctx.pos.. (q, k, v [B, T, heads * hd]); RoPE(q)."""
        B, T, _ = k.shape
        k_cache, v_cache = ctx.state.kv[self.layer_id]
        nq = q.shape[-1] // self.hd
        return K.attention_prep(q.view(B, T, nq, self.hd), k.view(B, T, self.nkv, self.hd),
                                v.view(B, T, self.nkv, self.hd), self.q_norm.weight, self.k_norm.weight,
                                self.k_norm.eps, self.inv_freq, k_cache, v_cache, ctx.slots, ctx.pos,
                                plain=True)

    def forward(self, x, ctx, residual=None, norm=None, then=None):
        """o_proj(attention(x)) [+ residual: the layer's skip connection, added by the o_proj GEMM]; norm:
        (weight, eps) of the RMSNorm to apply to x first (inside the q/k/v GEMM: kernels.linear); then: the
        next RMSNorm, done with o_proj's last step (returns (its output, the sum))."""
        B, T, _ = x.shape
        k_cache, v_cache = ctx.state.kv[self.layer_id]
        if hasattr(self, "qkv"):  # fused after loading (no bias): one GEMM, views of its output
            kv_dim = self.nkv * self.hd
            q = self._prep(*K.linear(x, self.qkv, norm=norm).split([self.nh * self.hd, kv_dim, kv_dim], -1),
                           ctx)
        else:
            x = x if norm is None else K.plain_rms_norm(x, *norm)
            q = self.write_kv(x, ctx, self.q_proj(x))
        o = block_attention(q, k_cache, v_cache, ctx.slots, ctx.pos, ctx.kv_len, self.causal, self.window)
        o = o.reshape(B, T, -1)
        if isinstance(self.o_proj, Linear):
            return self.o_proj(o, residual, then)                                    # [B, T, H]
        return K.apply_then(self.o_proj(o) if residual is None else residual + self.o_proj(o), then)


class Qwen3Layer(nn.Module):
    def __init__(self, c, layer_id):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, plain=True)
        self.self_attn = Qwen3Attention(c, layer_id)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, plain=True)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def forward(self, x, ctx, h=None, next_norm=None):
        """x' = x + attn(norm1(x)), then x' + mlp(norm2(x')). Each norm is done by the GEMM after it (kernels.linear's
        norm: at one or two rows inside drafting() one kernel for both, _linear_small) or, given h = norm1(x) and
        the norm after the layer, by the GEMM before it (the split-K sum's launch: linear's then; Qwen3LM.forward
        picks) -> (next_norm(x''), x'')."""
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        if h is None:
            x = self.self_attn(x, ctx, residual=x, norm=n1.args)                     # x + attn(norm1(x))
            return self.mlp(x, residual=x, norm=n2.args)                              # x + mlp(norm2(x))
        h, x = self.self_attn(h, ctx, residual=x, then=n2.args)                       # x + attn(h), its norm2
        return self.mlp(h, residual=x, then=next_norm.args)                           # x + mlp(h), next norm


def qwen3_layer_tensors(H, nh, nkv, hd, I):
    """A plain Qwen3 decoder layer's checkpoint tensors {name: shape} (Qwen3Layer's parameters), in the
    order the random-weight writers (bench.py, tools/train_drafters.py, the tests) draw them."""
    return {"self_attn.q_proj.weight": (nh * hd, H), "self_attn.k_proj.weight": (nkv * hd, H),
            "self_attn.v_proj.weight": (nkv * hd, H), "self_attn.o_proj.weight": (H, nh * hd),
            "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
            "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
            "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}


class Qwen3LM(nn.Module):
    """A plain Qwen3 causal LM (draft_model) with Qwen36's interface: forward (final-norm hidden), logits,
    commit."""
    def __init__(self, c):
        super().__init__()
        self.cfg = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Qwen3Layer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, plain=True)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, ids, ctx):
        x = self.embed_tokens(ids)                                                   # [B, T, H]
        L = self.layers
        if K.norm_in_loads(x):  # each norm inside the linear after it
            for layer in L:
                x = layer(x, ctx)
            return self.norm(x)
        h = L[0].input_layernorm(x)  # the others' come with the layer before (the split-K sum's then)
        for i, layer in enumerate(L):
            h, x = layer(x, ctx, h, L[i + 1].input_layernorm if i + 1 < len(L) else self.norm)
        return h

    logits = Qwen36.logits

    def commit(self, ctx, n_keep):
        pass  # attention only: the position-indexed cache needs no rollback


class KVCache:
    """Per-layer K, V caches [slots + 1, max_len, n_kv, head_dim] of a draft network (last slot: padding
    rows). Shaped like State for the Qwen3 layers; nothing recurrent, so nothing to reset or roll back."""
    def __init__(self, c, num_slots, max_len, dtype, device):
        shape = (num_slots + 1, max_len, c.num_key_value_heads, c.head_dim)
        self.kv = {i: (torch.zeros(shape, dtype=dtype, device=device),
                       torch.zeros(shape, dtype=dtype, device=device))
                   for i in range(c.num_hidden_layers)}
        self.conv = {}                                                # nothing recurrent
        self.rec = {}
        self.stash = {}
        self.dummy_slot = num_slots
        self.max_len = max_len
        self.keep_none = torch.zeros(num_slots + 1, dtype=torch.long, device=device)  # as State's

    def reset(self, slot):
        pass

    @staticmethod
    def bytes_per_pos(layers, n_kv, head_dim, dtype):
        """What __init__ allocates per position of a slot (K and V of every layer)."""
        return layers * 2 * n_kv * head_dim * torch.empty((), dtype=dtype).element_size()


DRAFT_SKIP = ("t2d", "verifier_norm.weight", "verifier_lm_head.weight")  # training-only tensors (speculators)


class BlockDrafter(nn.Module):
    """The DFlash/DSpark draft network. Parameter names are the checkpoint's; the optional parts (own
    embed_tokens and lm_head, d2t, Markov head, confidence head) exist iff the checkpoint has them
    (`shapes`)."""
    def __init__(self, c, shapes):
        super().__init__()
        H, V, r = c.hidden_size, c.vocab_size, c.markov_rank
        Vd = c.draft_vocab_size or (shapes["lm_head.weight"][0] if "lm_head.weight" in shapes else V)
        self.fc = nn.Linear(shapes["fc.weight"][1], H, bias=False)                    # [H, n_taps * H_target]
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps, plain=True)
        self.layers = nn.ModuleList(Qwen3Layer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(H, c.rms_norm_eps, plain=True)
        self.embed_tokens = nn.Embedding(V, H) if "embed_tokens.weight" in shapes else None
        self.lm_head = nn.Linear(H, Vd, bias=False) if "lm_head.weight" in shapes else None
        self.d2t = None                                                              # draft id -> target id
        if "d2t" in shapes:
            self.d2t = nn.Parameter(torch.zeros(Vd, dtype=torch.long), requires_grad=False)
        self.markov_head = self.confidence_head = None
        if r:  # DSpark: bias_k = W2 . W1[prev]; W1 embeds target ids [V, r], W2 [V_d, r] makes draft logits
            self.markov_head = nn.Module()
            self.markov_head.markov_w1 = nn.Embedding(V, r)
            self.markov_head.markov_w2 = nn.Linear(r, Vd, bias=False)
        if "confidence_head.proj.weight" in shapes:  # loaded, unused: fixed-block verification (no scheduler)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(H + (r if c.confidence_with_markov else 0), 1)
        self.draft_vocab_size = Vd

    def write_context(self, feats, ctx):
        """Context K/V of committed tokens from their concatenated target taps feats [B, T, n_taps *
        H_target]."""
        c = self.hidden_norm(self.fc(feats))                                         # [B, T, H]
        for layer in self.layers:
            layer.self_attn.write_kv(c, ctx)

    def forward(self, x, ctx):
        """x [B, Q, H] block embeddings at positions ctx.pos.. -> final-norm hidden [B, Q, H]."""
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


class BlockProposer:
    """The block drafters' common part (dflash, dspark): the draft network, its KV cache (context K/V
    written at prefill and after each verify) and the block forward over [anchor, mask x (Q-1)], whose
    logits a subclass turns into drafts (_sample)."""
    method = None

    def __init__(self, spec, io):
        m = self.method
        if spec.model is None:
            raise ConfigError(f"method {m!r} needs 'model': the path of a {m} draft checkpoint "
                              "(Qwen3.5/3.6 targets do not ship one)")
        path = spec.model
        K = spec.num_speculative_tokens
        tcfg = io.model.cfg
        c = read_block_config(path, m)
        where = f"{m} draft {path}"
        self.check(c, K, tcfg, where)
        net = self.net = self._load_net(path, c, tcfg, where, io)
        self.embed = net.embed_tokens or io.model.embed_tokens
        self.mask_vec = self.embed.weight[c.mask_token_id]                           # [H]
        override = os.path.join(path, "mask_embedding.pt")  # some checkpoints ship a trained mask embedding
        if os.path.isfile(override):
            self.mask_vec = self._mask_embedding(override, self.mask_vec.numel()).to(io.device, io.dtype)
        self.logits = (lambda h: net.lm_head(h).float()) if net.lm_head is not None else io.model.draft_logits
        self.io = io
        self.k = K
        self.greedy = spec.draft_sample_method == "greedy"
        self.V = tcfg.vocab_size
        self.Q = self.queries(c, K)                                                  # block queries
        self.out = slice(0, K) if c.from_anchor else slice(1, K + 1)                 # the slots that draft
        self.taps = tuple(sorted(set(c.target_layer_ids)))   # the target gives them in layer order: .order
        self.order = [self.taps.index(i) for i in c.target_layer_ids]
        self.cache = KVCache(c, io.num_slots, io.max_model_len + self.extra(c, K), io.dtype, io.device)
        self.cfg = c

    @staticmethod
    def _mask_embedding(f, H):
        """mask_embedding.pt: a tensor of H elements, or a dict holding it under "embedding" -> [H]. Anything else
        is one line naming the file: a wrong size or type failed deep inside the first draft, or not at all."""
        try:
            e = torch.load(f, weights_only=True)  # weights_only: a pickle may hold only tensors and plain types
        except Exception as err:  # an empty, cut or foreign file: UnpicklingError, EOFError, IndexError, struct.error..
            raise ConfigError(f"{f}: not a readable torch.save file ({type(err).__name__}); expected the mask "
                              f"embedding, a tensor of hidden_size ({H}) elements") from None
        if isinstance(e, dict):
            if "embedding" not in e:
                raise ConfigError(f"{f}: a dict without an 'embedding' key (keys {sorted(map(str, e))[:8]}); "
                                  f"expected the mask embedding, a tensor of hidden_size ({H}) elements")
            e = e["embedding"]
        if not isinstance(e, torch.Tensor):
            raise ConfigError(f"{f}: holds a {type(e).__name__}, expected the mask embedding, a tensor of "
                              f"hidden_size ({H}) elements")
        if not e.is_floating_point():  # as load_weights: an int / bool tensor is refused, not cast
            raise ConfigError(f"{f}: the mask embedding is {e.dtype}, expected a floating-point tensor")
        if e.numel() != H:  # [H] or [1, H] as exported; reshape(-1) of any other size was a wrong-sized query
            raise ConfigError(f"{f}: the mask embedding has shape {tuple(e.shape)}, expected hidden_size ({H}) "
                              "elements")
        return e.reshape(-1)

    @staticmethod
    def queries(c, K):
        """The block's queries: the anchor's slot drafts too (from_anchor) or not."""
        return K if c.from_anchor else K + 1

    @classmethod
    def extra(cls, c, K):
        """The positions its cache holds past max_model_len."""
        return cls.queries(c, K) + K + 1

    def check(self, c, K, tcfg, where):
        """Refuse a drafter that does not fit the target."""
        L = tcfg.num_hidden_layers
        ids = c.target_layer_ids
        if any(not -1 <= i < L for i in ids):
            raise ConfigError(f"{where}: target_layer_ids {ids} reference layers that do not exist in the "
                              f"target model ({L} layers: valid ids are -1 (embeddings) .. {L - 1}, "
                              "'output of layer i')")
        if c.vocab_size != tcfg.vocab_size:
            raise ConfigError(f"{where}: vocab_size {c.vocab_size} differs from the target's "
                              f"{tcfg.vocab_size}")

    @staticmethod
    def _load_net(path, c, tcfg, where, io):
        """The draft network, loaded; the checkpoint's shapes decide its optional parts and fc's input."""
        from safetensors import safe_open
        tensors = {n: f for n, f in checkpoint_tensors(path).items() if n not in DRAFT_SKIP}
        shapes = {}
        for f in set(tensors.values()):
            with safe_open(f, "pt") as st:
                shapes.update({n: tuple(st.get_slice(n).get_shape()) for n in st.keys() if n in tensors})
        if "fc.weight" not in shapes:
            raise ConfigError(f"missing tensor 'fc.weight' in {where}")
        n_taps = len(c.target_layer_ids)
        got = n_taps * tcfg.hidden_size
        if shapes["fc.weight"][1] != got:  # vLLM's message
            raise ConfigError(f"DFlash drafter expects {shapes['fc.weight'][1]} concatenated aux hidden "
                              f"features but received {got} ({n_taps} taps x hidden {tcfg.hidden_size}). "
                              "This usually means the draft model's target_layer_ids reference layers that "
                              "do not exist in the target model (incompatible draft/target pair).")
        with torch.device("meta"):
            net = BlockDrafter(c, shapes)
        net = fuse_projections(load_weights(net, checkpoint_sources(tensors), io.dtype, io.device, where))
        Vd, V = net.draft_vocab_size, tcfg.vocab_size
        if Vd > V or (Vd < V and (net.d2t is None or net.lm_head is None)):
            raise ConfigError(f"{where}: draft vocabulary {Vd} vs the target's {V}: a reduced draft "
                              "vocabulary needs the draft's lm_head and d2t; a larger one is not supported")
        if c.hidden_size != tcfg.hidden_size and (net.embed_tokens is None or net.lm_head is None):
            raise ConfigError(f"{where}: hidden_size {c.hidden_size} differs from the target's "
                              f"{tcfg.hidden_size}, so the draft must ship its own embed_tokens and lm_head")
        if not 0 <= c.mask_token_id < V:
            raise ConfigError(f"{where}: mask_token_id {c.mask_token_id} is outside the vocabulary")
        return net

    # Drafting and the context write after a verify go through io.call: captured graphs on the GPU (inputs are
    # device tensors, batch first; kv_len is then the cache length), eager elsewhere.
    def _context(self, kv_len, slots, pos, feats):
        with K.cpu_draft(bmm=False):  # as _draft
            self.net.write_context(feats, Ctx(self.cache, slots, pos, kv_len))
        return ()

    def _feats(self, taps):
        return torch.cat([taps[i] for i in self.order], -1)                         # [B, T, n_taps * H_t]

    def prefill(self, req, hidden, taps, ids, pos):  # eager: prompt chunks come in any length
        slots = self.io.h2d([req.slot], torch.long)
        self._context(0, slots, self.io.h2d([pos]), self._feats(taps))

    def commit(self, batch, hidden, taps, ids, n_acc, tokens):
        # all k+1 verified positions (a fixed shape): positions past the accepted prefix lie inside the next
        # block, which overwrites them before any query reads them. On a CPU (the host knows n_acc at no
        # cost) only the positions up to the furthest accepted one (as MTPProposer.commit)
        feats = self._feats(taps)
        if self.io.device.type == "cpu":
            feats = feats[:, :int(n_acc.max()) + 1]
        inputs = dict(slots=batch.slots, pos=batch.pos, feats=feats)
        self.io.call(f"{self.method}-context", self._context, 0, inputs)

    def fork(self, src, dst, n, token, hidden):
        copy_slot(self.cache, src, dst, n)  # the prompt's context K/V (the first token is the next anchor)

    def propose(self, batch):
        inputs = dict(slots=batch.slots, pos=batch.pos, anchor=batch.last)          # the anchor, its position
        if not self.greedy:
            inputs["temp"], inputs["u"] = draft_noise(self.io, batch.reqs, self.k)
        kv_len = batch.kv_len(self.Q, self.cache.max_len)
        return self.io.call(f"{self.method}-propose", self._draft, kv_len, inputs)

    def block_logits(self, kv_len, slots, pos, anchor):
        """The block forward over [anchor, mask x (Q-1)] at pos..: base draft logits [B, K, V_d] (fp32)."""
        x = torch.cat([self.embed(anchor)[:, None], self.mask_vec.expand(anchor.shape[0], self.Q - 1, -1)], 1)
        return self.logits(self.net(x, Ctx(self.cache, slots, pos, kv_len))[:, self.out])

    def _draft(self, kv_len, slots, pos, anchor, temp=None, u=None):
        with K.cpu_draft(bmm=False):  # on a CPU the drafter's linears in bf16 (kernels.cpu_draft)
            U = self.block_logits(kv_len, slots, pos, anchor)                       # [B, K, V_d]
        d, q = self._sample(U, anchor, temp, u)
        if self.net.d2t is not None and q is not None:                              # draft -> target vocab
            cols = self._tid(torch.arange(q.shape[-1], device=q.device))
            q = q.new_zeros(*q.shape[:2], self.V).index_copy_(-1, cols, q)
        return self._tid(d), q

    def _tid(self, d):
        return d if self.net.d2t is None else d + self.net.d2t[d]

    def _pick(self, logits, temp, u):
        """draft_pick over positions: logits [B, n, V_d]; temp [B] (None: greedy argmax, verified as one-hot
        q); u [B, n] uniforms. Probabilistic: samples of softmax(logits / temp), returned as q [B, n, V_d]."""
        if temp is None:
            return K.argmax(logits), None
        q = (logits / temp[:, None, None]).softmax(-1)
        return sample_from(q.flatten(0, 1), u.flatten()).view(u.shape), q


class DFlashProposer(BlockProposer):
    """method dflash: mask slot j of the block drafts position P+j (Q = K+1), by argmax or sampling."""
    method = "dflash"

    def _sample(self, U, anchor, temp, u):
        return self._pick(U, temp, u)


class DSparkProposer(BlockProposer):
    """method dspark: every slot drafts, the anchor's too (Q = K), and the Markov head biases each draft by
    the one before it, token by token on the device."""
    method = "dspark"

    def __init__(self, spec, io):
        super().__init__(spec, io)
        self.topk = spec.dspark_draft_topk
        if self.topk is not None and self.topk > self.net.draft_vocab_size:
            raise ConfigError(f"dspark_draft_topk={self.topk} exceeds the draft vocabulary "
                              f"({self.net.draft_vocab_size})")

    def check(self, c, K, tcfg, where):
        super().check(c, K, tcfg, where)
        if K < c.block_size:  # vLLM's message
            raise ConfigError(f"DSpark requires num_speculative_tokens >= dspark_block_size "
                              f"({c.block_size}); got {K}. Smaller values produce incorrect output. "
                              f"Use num_speculative_tokens={c.block_size} or larger.")

    def _sample(self, U, anchor, temp, u):
        """DSpark's sequential stage: logits_j = U_j + W2 . W1[prev], prev = the anchor, then each new
        draft (as a target id). With dspark_draft_topk the bias goes on the top-k base logits only, the
        rest -inf. A fixed-length loop of device ops without host syncs: it runs inside the drafting graph."""
        head = self.net.markov_head
        if head is None and self.topk is None:
            return self._pick(U, temp, u)
        if temp is None and not self.topk and self.net.d2t is None:  # greedy: fused kernels
            w1, w2 = head.markov_w1, head.markov_w2
            return K.markov_greedy(U, w1(anchor), w1.weight, w2.weight), None
        if self.topk:
            vals, idx = U.topk(self.topk, -1)                                        # [B, K, k]
        prev = anchor
        ds = []
        qs = []
        for j in range(U.shape[1]):
            e = head.markov_w1(prev) if head is not None else None                   # [B, r]
            if self.topk:
                bias = 0 if e is None else (head.markov_w2.weight[idx[:, j]] @ e[..., None])[..., 0]  # [B, k]
                lj = torch.full_like(U[:, j], float("-inf"))                     # [B, V_d]: -inf but top-k
                lj.scatter_(-1, idx[:, j], (vals[:, j] + bias).float())
            else:
                lj = U[:, j] + head.markov_w2(e).float()                             # [B, V_d]
            d, q = self._pick(lj[:, None], temp, None if u is None else u[:, j:j + 1])
            ds.append(d[:, 0])
            qs.append(q)
            prev = self._tid(d[:, 0])
        return torch.stack(ds, 1), None if temp is None else torch.cat(qs, 1)


def load_draft_lm(path, io, max_len):
    """draft_model's LM and its state: a Qwen3.5/3.6 checkpoint (specdec's model, GDN states with
    stash/commit) or a plain Qwen3 one (Qwen3Layer stack, KV cache only)."""
    top = read_config(path, "draft_model")
    tv = io.model.cfg.vocab_size
    mt = top.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES + ("qwen3",):
        raise ConfigError(f"draft_model {path}: model_type {mt!r} is not supported; the draft must be a "
                          f"Qwen3.5/3.6 ({', '.join(SUPPORTED_MODEL_TYPES)}) or plain Qwen3 (qwen3) "
                          "checkpoint")
    fields, types = qwen3_fields(top, f"draft_model {path}") if mt == "qwen3" else (None, None)
    dv = fields["vocab_size"] if fields else ModelConfig.from_hf(path).vocab_size
    if dv != tv:  # vLLM's message
        raise ConfigError(f"Target and draft model should have the same vocabulary size. Target model "
                          f"vocab_size={tv}. Draft model vocab_size={dv}. Using models with different "
                          "tokenizers can cause out-of-bounds errors during speculative decoding.")
    args = (io.num_slots, max_len, io.dtype, io.device)
    if fields is None:
        try:
            model, cfg, _ = load_model(path, io.dtype, io.device)
        except FileNotFoundError as e:
            raise ConfigError(f"draft_model {path}: {e}") from None
        return model, State(cfg, *args)
    windows = [top.get("sliding_window") if t == "sliding_attention" else None for t in types]
    c = DraftConfig(**fields, windows=windows, causal=[True] * len(types))
    tied = c.tie_word_embeddings
    tensors = {n: f for n, f in checkpoint_tensors(path).items() if not (tied and n == "lm_head.weight")}
    with torch.device("meta"):
        model = Qwen3LM(c)
    sources = checkpoint_sources(tensors, lambda n: n[len("model."):] if n.startswith("model.") else n)
    model = fuse_projections(load_weights(model, sources, io.dtype, io.device, f"draft_model {path}"))
    return model, KVCache(c, *args)


class DraftModelProposer:
    """method draft_model: a small LM drafts k tokens autoregressively with its own caches, one token behind
    the target like vLLM. At each propose a first pass feeds it the tokens committed since the last one
    (right-padded to k+1, verify mode) and commits exactly those into its GDN states (stash + replay, as the
    target does); an attention-only draft has cached the accepted drafts below d_k while drafting, so its
    first pass takes only what is left (right-padded to 2: d_k if accepted, the bonus token). d1 comes from
    the last real position. Drafts d2..dk come from verify-mode passes that
    never write the GDN states (over [d1..dj] for a hybrid draft, just d_j for an attention-only one), so
    nothing needs rolling back."""
    taps = ()
    cpu_passes = True  # on a CPU: shorter passes (_passes; False: the GPU's, as test_cpu_draft_passes's reference)

    def __init__(self, spec, io):
        self.io = io
        self.k = spec.num_speculative_tokens
        self.greedy = spec.draft_sample_method == "greedy"
        self.model, self.state = load_draft_lm(spec.model, io, io.max_model_len + self.extra(self.k))
        self.recurrent = bool(self.state.rec)
        self.width = self.k + 1 if self.recurrent else 2  # tokens in a propose's first pass (commit)
        # per slot, on the device: the tokens committed since its last propose that it has not cached (1
        # after the prompt, up to n+1 after a verify; right-padded to width), how many, the first's position
        S = io.num_slots + 1
        self.new_ids = torch.zeros(S, self.width, dtype=torch.long, device=io.device)     # [S, width]
        self.new_n = torch.ones(S, dtype=torch.long, device=io.device)                    # [S]
        self.start = torch.zeros(S, dtype=torch.long, device=io.device)                   # [S]

    @staticmethod
    def extra(k):
        """The positions its caches hold past max_model_len."""
        return 2 * k + 2

    def prefill(self, req, hidden, taps, ids, pos):
        T = hidden.shape[1]
        slots = self.io.h2d([req.slot], torch.long)
        if pos == 0:
            self.state.reset(req.slot)
        chunk = self.io.h2d([req.prompt_ids[pos:pos + T]])
        pos_t = self.io.h2d([pos])
        self.model(chunk, Ctx(self.state, slots, pos_t, pos + T, "prefill"))
        if pos + T == len(req.prompt_ids):  # ids' last is the first sampled token: the first propose eats it
            self.new_ids[req.slot, 0] = ids[0, -1]
            self.new_n[req.slot] = 1
            self.start[req.slot] = pos + T

    def propose(self, batch):
        s = batch.slots
        inputs = dict(slots=s, start=self.start[s], ids=self.new_ids[s], n=self.new_n[s])
        if not self.greedy:
            inputs["temp"], inputs["u"] = draft_noise(self.io, batch.reqs, self.k)
        kv_len = batch.kv_len(2 * self.k + 1, self.state.max_len)
        return self.io.call("draft-propose", self._draft, kv_len, inputs)

    def _draft(self, kv_len, slots, start, ids, n, temp=None, u=None):
        # drafting(): on the GPU small linears load their weights before waiting; cpu_draft(): on a CPU the
        # draft's linears take the drafter's path, fp32 bmm for the small ones, bf16 for the rest (kernels.py)
        with K.drafting(), K.cpu_draft():
            return self._passes(kv_len, slots, start, ids, n, temp, u)

    def _passes(self, kv_len, slots, start, ids, n, temp, u):
        cpu = self.cpu_passes and self.io.device.type == "cpu"
        mode = "verify"
        if cpu:  # the host knows n at no cost: the first pass over max(n) tokens, and where every row has that
            m = max(1, int(n.max()))  # many (a lone request always), as a decode (its states advance over all:
            ids = ids[:, :m]  # no per-token snapshots, no commit; padding rows of a graph have n = 0)
            mode = "decode" if bool((n == m).all()) else "verify"
        ctx = Ctx(self.state, slots, start, kv_len, mode)
        h = self.model(ids, ctx)                                                     # [B, m, H]
        if mode == "verify":
            self.model.commit(ctx, n)                                                # keep the new tokens
        h = h[torch.arange(ids.shape[0], device=ids.device), n - 1]                  # [B, H] at each anchor
        p1 = start + n                                                               # [B] position of d1
        # On a CPU a hybrid draft feeds d_j alone as a decode pass, its GDN states saved first and put back
        # after (fewer tokens per pass, no snapshots); elsewhere [d1..dj] in verify mode, which writes none
        saved = self._save(slots) if cpu and self.recurrent else None
        later = "verify" if saved is None else "decode"  # the mode of the passes after the first
        drafts = []
        probs = []
        for j in range(self.k):
            if j > 0:
                if self.recurrent and saved is None:
                    h = self.model(torch.stack(drafts, 1), Ctx(self.state, slots, p1, kv_len, "verify"))[:, -1]
                else:
                    h = self.model(drafts[-1][:, None], Ctx(self.state, slots, p1 + j - 1, kv_len, later))[:, -1]
            d, q = draft_pick(self.model.logits(h), temp, None if u is None else u[:, j])
            drafts.append(d)
            probs.append(q)
        if saved is not None:
            self._restore(slots, saved)
        return torch.stack(drafts, 1), None if temp is None else torch.stack(probs, 1)

    def _save(self, slots):
        """Copies of the slots' GDN conv windows and recurrent states ({layer: (conv, rec)})."""
        st = self.state
        return {i: (st.conv[i].index_select(0, slots), st.rec[i].index_select(0, slots)) for i in st.rec}

    def _restore(self, slots, saved):
        for i, (conv, rec) in saved.items():
            self.state.conv[i].index_copy_(0, slots, conv)
            self.state.rec[i].index_copy_(0, slots, rec)

    def commit(self, batch, hidden, taps, ids, n_acc, tokens):
        s = batch.slots  # the next propose's first pass consumes the committed tokens it has not cached
        skip = 0  # a hybrid draft replays them all into its GDN states
        if not self.recurrent:  # an attention-only draft cached d1..d(k-1) at their positions while
            skip = n_acc.clamp(max=self.k - 1)  # drafting: the accepted ones are right; left: d_k, the bonus
            tokens = tokens.gather(1, skip[:, None] + torch.arange(2, device=tokens.device))   # [B, 2]
        self.new_ids[s] = tokens.clamp(min=0)
        self.new_n[s] = n_acc + 1 - skip
        self.start[s] = batch.pos + 1 + skip

    def fork(self, src, dst, n, token, hidden):
        copy_slot(self.state, src, dst, n)  # its caches over the prompt; the first propose eats the token
        self.new_ids[dst, 0] = token[0]
        self.new_n[dst] = 1
        self.start[dst] = n


PROPOSERS = {"ngram": NgramProposer, "mtp": MTPProposer, "dflash": DFlashProposer, "dspark": DSparkProposer,
             "draft_model": DraftModelProposer}  # method -> class(spec, io)


# ==============================================================================================
# Verification & sampling
# ==============================================================================================

# -- Sampling parameters: vLLM's SamplingParams and its structured outputs ---------------------------

# What SamplingParams.check accepts: (field, accepted(value), message: {v} the value); vLLM's messages
_number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
_integer = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
SAMPLING_CHECKS = [  # the types first: a value of another type is refused here, not by a step that it would fail
    *[(f, _number, f + " must be a number, got {v!r}.") for f in ("presence_penalty", "frequency_penalty",
                                                                   "repetition_penalty", "temperature", "top_p",
                                                                   "min_p")],
    ("max_tokens", lambda v: v is None or _integer(v), "max_tokens must be an integer, got {v!r}."),
    ("logprobs", lambda v: v is None or _integer(v), "logprobs must be an integer, got {v!r}."),
    ("prompt_logprobs", lambda v: v is None or _integer(v), "prompt_logprobs must be an integer, got {v!r}."),
    ("seed", lambda v: v is None or (_integer(v) and -2 ** 63 <= v < 2 ** 63),
     "seed must be an integer of int64's range, got {v!r}."),
    ("stop", lambda v: all(isinstance(x, str) for x in v), "stop must be a string or a list of strings, got {v!r}."),
    ("bad_words", lambda v: all(isinstance(x, str) for x in v), "bad_words must be a list of strings, got {v!r}."),
    ("n", lambda v: isinstance(v, int) and v >= 1, "n must be at least 1, got {v}."),
    ("presence_penalty", lambda v: -2 <= v <= 2, "presence_penalty must be in [-2, 2], got {v}."),
    ("frequency_penalty", lambda v: -2 <= v <= 2, "frequency_penalty must be in [-2, 2], got {v}."),
    ("repetition_penalty", math.isfinite, "repetition_penalty must be a finite number, got {v}."),
    ("repetition_penalty", lambda v: v > 0, "repetition_penalty must be greater than zero, got {v}."),
    ("temperature", math.isfinite, "temperature must be a finite number, got {v}."),
    ("temperature", lambda v: not v < 0, "temperature must be non-negative, got {v}."),
    ("temperature", lambda v: v <= 2, "temperature must be in [0, 2], got {v}."),
    ("top_p", lambda v: 0 < v <= 1, "top_p must be in (0, 1], got {v}."),
    ("top_k", lambda v: isinstance(v, int), "top_k must be an integer, got {v!r}"),
    ("top_k", lambda v: v >= -1, "top_k must be 0 (disable), or at least 1, got {v}."),
    ("min_p", lambda v: 0 <= v <= 1, "min_p must be in [0, 1], got {v}."),
    ("max_tokens", lambda v: v is None or not v < 1, "max_tokens must be at least 1, got {v}."),
    ("min_tokens", lambda v: isinstance(v, int), "min_tokens must be an integer, got {v!r}"),
    ("min_tokens", lambda v: v >= 0, "min_tokens must be greater than or equal to 0, got {v}."),
    ("logprobs", lambda v: v is None or v >= -1, "logprobs must be non-negative or -1, got {v}."),
    ("prompt_logprobs", lambda v: v is None or v >= -1, "prompt_logprobs must be non-negative or -1, got {v}."),
    ("truncate_prompt_tokens", lambda v: v is None or (isinstance(v, int) and (v >= 1 or v == -1)),
     "truncate_prompt_tokens must be an integer >= 1 or -1, got {v}"),
    ("stop", lambda v: all(v), "stop cannot contain an empty string."),
    ("stop_token_ids", lambda v: all(isinstance(t, int) for t in v),
     "stop_token_ids must contain only integers, got {v}."),
    ("bad_words", lambda v: all(v), "bad_words cannot contain an empty string. Got bad_words={v}"),
    ("allowed_token_ids", lambda v: v is None or len(v) > 0, "allowed_token_ids is not None and empty!"),
    ("detokenize", lambda v: isinstance(v, bool), "detokenize must be True or False, got {v!r}."),
]
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """vLLM's structured_outputs: exactly one constraint (a JSON schema, a regex, a choice among strings, an
    EBNF grammar, or any JSON object), compiled by xgrammar when a request carries it (Grammar)."""
    json: object = None                 # a JSON schema: a dict or its JSON text
    regex: str = None
    choice: list = None
    grammar: str = None                 # EBNF (GBNF), as xgrammar reads it
    json_object: bool = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        if self.json_object is False:  # vLLM's check (False would still select the JSON constraint here)
            raise ConfigError("structured_outputs.json_object must be True if set; omit structured_outputs to "
                              "disable structured outputs")
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            what = "multiple are" if given else "none are"
            raise ConfigError(f"You {'can only' if given else 'must'} use one kind of structured outputs "
                              f"constraint but {what} specified: {dataclasses.asdict(self)}")


@dataclass
class SamplingParams:
    """Per-request sampling, as vLLM's SamplingParams: its fields, defaults and messages. The logits
    processors (penalties, logit_bias, allowed_token_ids, bad_words, min_tokens, structured_outputs) run
    in process_logits at every position of a step, so speculation keeps them lossless."""
    n: int = 1                          # outputs per prompt (independent samples)
    best_of: int = None                 # sample this many, return the n with the highest cumulative logprob
    presence_penalty: float = 0.0       # - penalty if the token occurs in the output so far
    frequency_penalty: float = 0.0      # - penalty x its count in the output so far
    repetition_penalty: float = 1.0     # divides a positive logit (multiplies a negative) of a token seen in
    temperature: float = 1.0            # the prompt or the output
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: off
    min_p: float = 0.0                  # drop tokens below min_p x the top token's probability
    seed: int = None
    stop: list = None
    stop_token_ids: list = None
    bad_words: list = None              # words whose last token is masked when the output would complete them
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0                 # EOS and stop_token_ids are masked before this many output tokens
    logprobs: int = None                # per output token: its logprob and the N most likely (-1: all)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # accepted; byte-level BPE decodes without adding spaces
    logit_bias: dict = None             # {token id: bias}, added to the logits (bias clamped to [-100, 100])
    allowed_token_ids: list = None      # only these may be sampled
    structured_outputs: StructuredOutputsParams = None
    prompt_logprobs: int = None         # per prompt token: its logprob and the N most likely (-1: all)
    truncate_prompt_tokens: int = None  # keep only the prompt's last N tokens (-1: max_model_len)
    detokenize: bool = True             # False: token ids only (the outputs' text stays "")

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids", "bad_words"):
            if not isinstance(getattr(self, name), (list, tuple, type(None))):
                raise ConfigError(f"{name} must be a list, got {getattr(self, name)!r}.")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        self.bad_words = list(dict.fromkeys(self.bad_words or []))
        if self.seed == -1:
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):  # vLLM: True means 1
            if getattr(self, name) is True:
                setattr(self, name, 1)
        if self.logit_bias:
            bad = [t for t in self.logit_bias if not _is_int_like(t)]
            if bad:
                raise ConfigError(f"logit_bias contains key(s) that cannot be converted to integer token "
                                  f"IDs: {bad!r}")
            bad = {t: b for t, b in self.logit_bias.items() if not _number(b)}
            if bad:
                raise ConfigError(f"logit_bias values must be numbers, got {bad!r}")
            self.logit_bias = {int(t): float(min(100, max(-100, b))) for t, b in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.check()
        if self.greedy:  # vLLM: greedy ignores the filters
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def check(self):
        for name, accepted, message in SAMPLING_CHECKS:
            v = getattr(self, name)
            if not accepted(v):
                raise ConfigError(message.format(v=v))
        if self.stop and not self.detokenize:
            raise ConfigError("stop strings are only supported when detokenize is True. Set detokenize=True to "
                              "use stop.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ConfigError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got "
                              f"{self.min_tokens}.")
        if self.best_of is not None and not (isinstance(self.best_of, int) and self.best_of >= self.n):
            raise ConfigError(f"best_of must be greater than or equal to n, got n={self.n} and "
                              f"best_of={self.best_of}.")
        if self.greedy and self.n > 1:
            raise ConfigError(f"n must be 1 when using greedy sampling, got {self.n}.")
        if self.greedy and (self.best_of or 1) > 1:
            raise ConfigError(f"best_of must be 1 when using greedy sampling, got {self.best_of}.")

    @property
    def greedy(self):
        return self.temperature < 1e-5

    def samples(self):
        """One SamplingParams per sample of the request: best_of (default n) of them, n = 1 each, the i-th
        seeded seed + i when a seed is given (as vLLM seeds its n children)."""
        m = self.best_of or self.n
        if m == 1:
            return [self]
        children = [copy.copy(self) for _ in range(m)]  # copies, not checked again (vLLM's): a child's seed
        for i, child in enumerate(children):              # -1 stays -1, and seed + i may pass 2**63 - 1
            child.n, child.best_of, child.seed = 1, None, None if self.seed is None else self.seed + i
        return children

    @property
    def ranked(self):
        """best_of > n: the samples are ranked by their cumulative logprob, the best n returned."""
        return (self.best_of or self.n) > self.n

    @property
    def penalized(self):
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def needs_history(self):
        """Whether the processors read the output so far (then the host must know it: synchronous steps)."""
        grammar = self.structured_outputs is not None
        return self.penalized or bool(self.min_tokens or self.bad_words) or grammar

    @property
    def processed(self):
        """Whether a logits processor applies (else the plain sampler runs, at no extra cost)."""
        return self.needs_history or bool(self.logit_bias) or self.allowed_token_ids is not None


def _is_int_like(t):
    try:
        int(t)
        return True
    except (TypeError, ValueError):
        return False


# -- Logits processors: vLLM's per-request logit edits, at every position of a step ------------------
# A verify step scores k+1 positions at once; position i must see exactly what plain decoding would have
# seen there: the output so far followed by the drafts d1..di (those are the tokens emitted before it if
# it is reached at all). So each processor runs per position with that history, and greedy speculation
# equals plain decoding, sampled speculation keeps p. Order (vLLM's MRV2 sampler): logit bias, allowed
# ids, min_tokens, then the penalties, then bad words and the grammar's mask; temperature, min_p, top-k and
# top-p come after, in target_probs.

def per_row(ids, V, device, h2d, values=None):
    """[B, V] float on the device from per-row lists of token ids: how often each id occurs in its row's list
    (values None), or the sum of its values (values: per row a list beside its ids). Built there from the ids,
    so only they cross over, not B x V numbers."""
    b = [i for i, row in enumerate(ids) for _ in row]
    t = [t for row in ids for t in row]
    out = torch.zeros(len(ids), V, device=device)
    if t:
        v = [1.0] * len(t) if values is None else [x for row in values for x in row]
        out.index_put_((h2d(b, torch.long), h2d(t, torch.long)), h2d(v, torch.float32), accumulate=True)
    return out


def fixed_mask(row, name, ids, V, device, h2d):
    """A [V] bool of ids that do not change while the request runs (its allowed_token_ids, its prompt's tokens),
    made at its first processed step and kept on the request (row): per_row would send them to the device at every
    step, and a request with a long list (an allowed list of 200,000 ids, a 100k-token prompt with penalties) would
    slow the steps of every request beside it."""
    mask = getattr(row, "_mask_" + name, None)
    if mask is None:
        mask = per_row([ids], V, device, h2d)[0] > 0
        setattr(row, "_mask_" + name, mask)
    return mask


def banned_tokens(row, drafts, T):
    """(position, token) pairs a row may not emit in a step of T positions: the last token of a bad word whose
    other tokens end the history there (a one-token bad word: always). drafts: the row's drafts (host)."""
    out = []
    for i in range(T):
        history = row.output_ids + drafts[:i]
        for w in row.bad_words_ids:
            # the history's last token first: a long word is compared whole (a copy of its tokens) only where it may
            # end here, not at every step (4096 words of 1000 tokens made every request's steps 7x slower)
            if len(w) == 1 or (len(history) >= len(w) - 1 and history[-1] == w[-2]
                               and history[len(history) - len(w) + 1:] == w[:-1]):
                out.append((i, w[-1]))
    return out


# The most a repetition penalty lifts a positive logit to: a penalty below ~1e-28 (1e-300 is 0 as an fp32) would
# divide past fp32's range, and infinite logits make NaN probabilities (a sampled request then drew an id past the
# tokenizer's). 1e30 still survives temperature's division (at least 1e-5); the tokens it lifts then tie.
PENALIZED_MAX = 1e30


def process_logits(logits, drafts, rows, stop_ids, h2d, masks=None):
    """vLLM's logits processors, per position of a step. logits [B, T, V] (T = k+1 in a verify, 1 in a
    decode); drafts [B, T-1] long (-1 = padding) or None; rows: per row an object with .params
    (SamplingParams), .prompt_ids, .output_ids (the output before this step), .bad_words_ids (each bad word's
    token ids); stop_ids: the model's EOS ids (min_tokens masks them and the row's stop_token_ids);
    masks: [B, T, V] bool, the grammar's allowed tokens (None: no grammar). Returns new logits [B, T, V]
    fp32. Position i's history is the output followed by d1..di."""
    B, T, V = logits.shape
    dev = logits.device
    x = logits.float().clone()
    ps = [r.params for r in rows]
    each = lambda name: h2d([getattr(p, name) for p in ps], torch.float32)[:, None, None]  # noqa: E731
    if any(p.logit_bias for p in ps):
        biases = [p.logit_bias or {} for p in ps]
        x += per_row([list(b) for b in biases], V, dev, h2d, [list(b.values()) for b in biases])[:, None]
    if any(p.allowed_token_ids is not None for p in ps):
        allowed = torch.stack([fixed_mask(r, "allowed", p.allowed_token_ids or [], V, dev, h2d)
                               for p, r in zip(ps, rows)])                                      # [B, V]
        anything = h2d([p.allowed_token_ids is None for p in ps], torch.bool)[:, None]           # [B, 1]
        x.masked_fill_(~(allowed | anything)[:, None], float("-inf"))
    if any(p.min_tokens for p in ps):  # position i emits output token number len(output) + i
        need = h2d([p.min_tokens - len(r.output_ids) for p, r in zip(ps, rows)], torch.long)      # [B]
        early = torch.arange(T, device=dev)[None] < need[:, None]                                  # [B, T]
        stops = per_row([sorted({*stop_ids, *p.stop_token_ids}) for p in ps], V, dev, h2d) > 0   # [B, V]
        x.masked_fill_(early[..., None] & stops[:, None], float("-inf"))
    if any(p.penalized for p in ps):
        counts = per_row([r.output_ids for r in rows], V, dev, h2d)[:, None].expand(B, T, V)   # [B, T, V]
        if T > 1:  # position i also counts d1..di
            d = F.one_hot(drafts.clamp(min=0), V).float() * (drafts >= 0)[..., None]           # [B, T-1, V]
            counts = counts + F.pad(d.cumsum(1), (0, 0, 1, 0))
        prompt = torch.stack([fixed_mask(r, "prompt", r.prompt_ids, V, dev, h2d) for r in rows])   # [B, V]
        seen = prompt[:, None] | (counts > 0)                                                    # [B, T, V]
        rep = each("repetition_penalty")  # a positive logit over a tiny one saturates at PENALIZED_MAX (not inf)
        x = torch.where(seen, torch.where(x > 0, (x / rep).clamp(max=PENALIZED_MAX), x * rep), x)
        x -= each("frequency_penalty") * counts + each("presence_penalty") * (counts > 0)
    if any(r.bad_words_ids for r in rows):
        d = drafts.tolist() if drafts is not None else [[]] * B  # (waits for the drafts: bad words only)
        hits = [(b, i, t) for b, r in enumerate(rows) for i, t in banned_tokens(r, d[b], T)]
        if hits:
            b, i, t = zip(*hits)
            x[h2d(list(b), torch.long), h2d(list(i), torch.long), h2d(list(t), torch.long)] = float("-inf")
    if masks is not None:
        x.masked_fill_(~masks, float("-inf"))
    return x


# -- Structured outputs: xgrammar (vLLM's default backend), imported only when a request asks for it ----

def grammar_compiler(tokenizer, V, stop_ids):
    """An xgrammar compiler for our tokenizer: each id's bytes; added tokens (<|im_end|>, <think>) and ids
    past the tokenizer get none, so a grammar never spells text with them, and only stop_ids may end it."""
    import xgrammar as xgr
    added = set(tokenizer.special_ids.values())
    vocab = [b"" if i in added else tokenizer.token_bytes(i) for i in range(V)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=V, stop_token_ids=sorted(stop_ids))
    return xgr.GrammarCompiler(info)


def ebnf_literal(s):
    return json.dumps(s, ensure_ascii=False)  # "..." with \" \\ \n escaped: an EBNF string literal


def compile_grammar(compiler, so):
    """StructuredOutputsParams -> xgrammar's compiled grammar, or a ConfigError that names the problem."""
    try:
        if so.json is not None:
            schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
            return compiler.compile_json_schema(schema, any_whitespace=not so.disable_any_whitespace)
        if so.json_object is not None:
            return compiler.compile_builtin_json_grammar()
        if so.regex is not None:
            return compiler.compile_regex(so.regex)
        if so.choice is not None:
            if not (isinstance(so.choice, list) and so.choice and all(isinstance(c, str) for c in so.choice)):
                raise ConfigError("structured_outputs choice must be a non-empty list of strings")
            return compiler.compile_grammar("root ::= " + " | ".join(ebnf_literal(c) for c in so.choice))
        return compiler.compile_grammar(so.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        kind = next(k for k in STRUCTURED_KINDS if getattr(so, k) is not None)
        raise ConfigError(f"the structured_outputs {kind} cannot be compiled: {xgrammar_reason(e)}") from None


def xgrammar_reason(e):
    """An xgrammar error's message less the "[time] file:line: " (and "Check failed: (...) is false: ") its C++
    side puts before it."""
    return re.sub(r"^\[[\d:]+\] \S+: (Check failed: \(\S+\) is false: )?", "", str(e).strip())


def unpack_bitmask(bitmask, V):
    """xgrammar's token bitmask [N, ceil(V / 32)] int32 (bit j of word w: token 32w + j allowed) -> [N, V]
    bool, on the bitmask's device."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    return ((bitmask[..., None] >> bits) & 1).bool().flatten(-2)[..., :V]


class Grammar:
    """A request's grammar in force: an xgrammar matcher over the output so far (Engine._emit advances it). A
    step's masks come from walking it through the step's drafts and back (rollback): position i's mask is the
    grammar's after d1..di; the first draft it refuses ends the drafts (rejected, as vLLM does)."""
    def __init__(self, compiled):
        import xgrammar as xgr
        self.xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)  # rollback is unlimited in xgrammar >= 0.2

    def masks(self, drafts, V):
        """drafts: a list (host) of k ids (-1 padding) -> (bitmask [k+1, ceil(V / 32)] int32, how many of the
        drafts the grammar allows). Positions past the end of the grammar allow everything."""
        m = self.matcher
        bitmask = self.xgr.allocate_token_bitmask(len(drafts) + 1, V)          # all allowed
        if not m.is_terminated():
            m.fill_next_token_bitmask(bitmask, 0)
        n = 0
        for d in drafts:  # (a draft the mask refuses is not offered to the matcher: it logs each refused token)
            if d < 0 or m.is_terminated() or not (int(bitmask[n, d // 32]) >> (d % 32)) & 1 or not m.accept_token(d):
                break
            n += 1
            if not m.is_terminated():
                m.fill_next_token_bitmask(bitmask, n)
        m.rollback(n)
        return bitmask, n

    def accept(self, token):
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)


def target_probs(logits, temperature, top_k, top_p, filtered=None, min_p=None):
    """The target distribution p that sampling and verification draw from: temperature, then min_p, then
    top-k, then top-p, then softmax (vLLM's order). logits [N, V] fp32; temperature/top_k/top_p [N] tensors
    (temperature 0 rows get 1: they are only ever argmax'ed); top_k <= 0 keeps every token; min_p [N] or None
    (none). Returns probs [N, V] fp32. `filtered` (optional, known on the host): whether any row has top-k or
    top-p; None reads it from the device."""
    t = torch.where(temperature < 1e-5, torch.ones_like(temperature), temperature)
    x = logits / t[:, None]
    if min_p is not None:  # a token below min_p x the top token's probability is dropped
        p = x.softmax(-1)
        x = x.masked_fill(p < min_p[:, None] * p.max(-1, keepdim=True).values, float("-inf"))
    if filtered is None:
        filtered = bool((top_k > 0).any()) or bool((top_p < 1).any())
    if filtered:
        srt, order = x.sort(dim=-1, descending=True)
        V = x.shape[-1]
        rank = torch.arange(V, device=x.device)[None]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
        drop = rank >= k[:, None]                                                    # top-k
        p = srt.masked_fill(drop, float("-inf")).softmax(-1)
        # top-p (vLLM's rule): drop a token once the tokens ranked above it hold top_p of the mass; rows with
        # top_p 1 drop nothing (a float cumsum can pass 1.0 and would cut their tail)
        drop |= ((p.cumsum(-1) - p) >= top_p[:, None]) & (top_p < 1)[:, None]
        drop[:, 0] = False
        x = x.scatter(-1, order, srt.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


def sample_from(probs, u):
    """Inverse-CDF sampling: one uniform u [N] in [0, 1) per row of probs [N, V] (need not sum to 1). The
    point u x mass is kept strictly below the mass: rounded up to it (u near 1, or a subnormal mass) it would
    pass every entry of the CDF and land on the last token, whatever its probability."""
    cdf = probs.cumsum(-1)
    mass = cdf[:, -1]
    x = torch.minimum(u * mass, mass.nextafter(torch.zeros_like(mass)))
    idx = torch.searchsorted(cdf, x[:, None], right=True)[:, 0]
    return idx.clamp_(max=probs.shape[-1] - 1)                                       # an all-zero row


def greedy_verify(logits, drafts):
    """rejection_sample when every row is greedy: accept while draft == argmax, then emit the argmax.
    logits [B, k+1, V], drafts [B, k] (-1 = padding) -> tokens [B, k+1] (-1 after the emitted), n [B]."""
    k = drafts.shape[1]
    argmax = K.argmax(logits)                                                        # [B, k+1]
    n = torch.cumprod(((drafts == argmax[:, :k]) & (drafts >= 0)).long(), dim=1).sum(1)
    padded = torch.cat([drafts, drafts[:, :1]], 1)                                   # [B, k+1]
    pos = torch.arange(k + 1, device=logits.device)[None]
    rows = torch.arange(drafts.shape[0], device=logits.device)
    tokens = torch.where(pos < n[:, None], padded, torch.full_like(argmax, -1))      # the accepted drafts
    tokens[rows, n] = argmax[rows, n]
    return tokens, n


def rejection_sample(logits, drafts, draft_probs, temperature, top_k, top_p, u_accept, u_sample,
                     all_greedy=None, filtered=None, min_p=None):
    """Verify k drafts per sequence against the target (vLLM's `standard` rules), as a pure function.

    logits [B, k+1, V] fp32 target logits at [last token, d1..dk]; drafts [B, k] long (-1 = padding,
    always rejected); draft_probs [B, k, V] or None (= one-hot q at the draft); temperature, top_k, top_p [B];
    u_accept [B, k], u_sample [B, k+1] uniforms in [0, 1).
    Greedy rows (temperature 0) accept while draft == argmax, then emit the argmax. Random rows accept d_i
    with probability min(1, p_i(d_i)/q_i(d_i)); the first rejected position is resampled from
    norm(max(0, p_i - q_i)); when all k are accepted a bonus token is drawn from p_{k+1}.
    Returns tokens [B, k+1] (-1 after the emitted ones) and num_accepted [B] (bonus excluded).
    `all_greedy` (optional, known on the host) skips the target distribution when every row is greedy;
    `filtered` and `min_p` [B] (None: none) are passed to target_probs. The logits processors, if any, have
    already run on `logits` (process_logits): p is the processed distribution, q is the drafter's.
    """
    B, k1, V = logits.shape
    k = k1 - 1
    greedy = temperature < 1e-5
    rows = torch.arange(B, device=logits.device)
    pos = torch.arange(k1, device=logits.device)[None]
    if all_greedy:
        return greedy_verify(logits, drafts)
    rep = lambda t: t.repeat_interleave(k1)
    mp = None if min_p is None else rep(min_p)
    p = target_probs(logits.reshape(-1, V), rep(temperature), rep(top_k), rep(top_p), filtered, mp)
    p = p.view(B, k1, V)
    argmax = logits.argmax(-1)                                                       # [B, k+1]
    d = drafts.clamp(min=0)
    p_d = p[:, :k].gather(-1, d[..., None])[..., 0]                                  # [B, k]
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.gather(-1, d[..., None])[..., 0]
    ok = torch.where(greedy[:, None], drafts == argmax[:, :k], (q_d > 0) & (u_accept * q_d < p_d))
    ok &= drafts >= 0
    n = torch.cumprod(ok.long(), dim=1).sum(1)                                       # accepted prefix length
    # the token after the accepted prefix: greedy -> argmax; random -> residual at a rejection, p at the bonus
    p_n = p[rows, n]                                                                 # [B, V]
    stop = n.clamp(max=k - 1)
    d_n = drafts[rows, stop]                                                     # the draft at the stop
    q_n = F.one_hot(d_n.clamp(min=0), V).to(p.dtype) if draft_probs is None else draft_probs[rows, stop]
    q_n = q_n * (d_n >= 0)[:, None]                                                  # padding has q = 0
    resid = torch.where((n < k)[:, None], (p_n - q_n).clamp(min=0), p_n)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_n)                 # p == q: any draw from p
    extra = torch.where(greedy, argmax[rows, n], sample_from(resid, u_sample[rows, n]))
    padded = torch.cat([drafts, drafts[:, :1]], 1)                                   # [B, k+1]
    tokens = torch.where(pos < n[:, None], padded, torch.full_like(argmax, -1))      # the accepted drafts
    tokens[rows, n] = extra
    return tokens, n


def synthetic_sample(logits, drafts, rates, u_accept):
    """Benchmark mode (vLLM's `synthetic` rejection_sample_method), not lossless: accept draft i with the
    conditional probability rates[i] whatever the tokens are (never past the real drafts), then emit the
    target's argmax. logits [B, k+1, V]; drafts [B, k] (-1 = padding); rates [k]; u_accept [B, k]. Returns
    tokens [B, k+1] and num_accepted [B], as rejection_sample."""
    rows = torch.arange(drafts.shape[0], device=drafts.device)
    n = torch.minimum(torch.cumprod((u_accept < rates).long(), 1).sum(1), (drafts >= 0).sum(1))
    tokens = torch.cat([drafts, drafts[:, :1]], 1)                               # the drafts, then the argmax
    tokens[rows, n] = logits[rows, n].argmax(-1)
    return tokens, n


# ==============================================================================================
# Engine: ModelRunner runs the steps, Engine schedules the requests (nano-vllm's split)
# ==============================================================================================

@dataclass
class SpecStats:
    """vLLM's spec-decode counters: a draft = one verify step of one request with k > 0 drafts."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list = field(default_factory=list)

    def add(self, n_draft, n_acc):
        if n_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += n_draft
        self.num_accepted_tokens += n_acc
        self.accepted_per_pos += [0] * (n_draft - len(self.accepted_per_pos))
        for i in range(n_acc):
            self.accepted_per_pos[i] += 1

    def absorb(self, other):
        """Add another's counts (a prompt's n samples report together)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        pairs = itertools.zip_longest(self.accepted_per_pos, other.accepted_per_pos, fillvalue=0)
        self.accepted_per_pos = [a + b for a, b in pairs]

    @property
    def mean_acceptance_length(self):
        return 1 + self.num_accepted_tokens / max(self.num_drafts, 1)

    @property
    def draft_acceptance_rate(self):
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    def summary(self, elapsed=None):
        """vLLM's log line; with `elapsed` (seconds the counts took) its two throughputs too."""
        per_pos = ", ".join(f"{a / max(self.num_drafts, 1):.3f}" for a in self.accepted_per_pos)
        rates = "" if elapsed is None else (
            f"Accepted throughput: {self.num_accepted_tokens / max(elapsed, 1e-9):.2f} tokens/s, "
            f"Drafted throughput: {self.num_draft_tokens / max(elapsed, 1e-9):.2f} tokens/s, ")
        return (f"SpecDecoding metrics: Mean acceptance length: {self.mean_acceptance_length:.2f}, {rates}"
                f"Accepted: {self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {per_pos}, "
                f"Avg Draft acceptance rate: {100 * self.draft_acceptance_rate:.1f}%")


@dataclass
class Logprob:
    """A token's log-probability, as vLLM's: with its rank in the distribution (1: the most likely) and its
    text alone. Outputs hold one {token id: Logprob} per position."""
    logprob: float
    rank: int = None
    decoded_token: str = None


def logprob_rows(logits, toks, n_top):
    """vLLM's logprobs of rows of logits [T, V] (the model's own distribution, before any sampling
    parameter) -> per row, (token, logprob, rank) for the n_top most likely tokens (-1: all; ranks 1..n_top),
    then for the row's token toks[t] unless among them: its rank counts the tokens at least as likely."""
    lp = logits.float().log_softmax(-1)                                  # [T, V]
    chosen = lp.gather(1, torch.as_tensor(toks, device=lp.device)[:, None])  # [T, 1]
    ranks = (lp >= chosen).sum(1)                                        # [T]
    n = lp.shape[1] if n_top == -1 else n_top
    top = lp.topk(n, dim=1)                                              # [T, n]
    rows = []
    for t, ids, vals, v, r in zip(toks, top.indices.tolist(), top.values.tolist(), chosen[:, 0].tolist(),
                                  ranks.tolist()):
        rows.append(list(zip(ids, vals, range(1, n + 1))) + ([] if t in ids else [(t, v, r)]))
    return rows


def truncate_prompt(ids, n, max_model_len):
    """vLLM's truncate_prompt_tokens: the prompt's last n tokens (-1: max_model_len of them)."""
    if n is None:
        return list(ids)
    n = max_model_len if n == -1 else n
    if n > max_model_len:
        raise ConfigError(f"truncate_prompt_tokens value ({n}) is greater than max_model_len "
                          f"({max_model_len}). Please, select a smaller truncation size.")
    return list(ids)[-n:]


class Request:
    """One sequence: its tokens, sampling parameters, output so far, slot and stop state."""
    def __init__(self, rid, prompt_ids, params, tokenizer, seed):
        self.id = rid
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.output_ids = []
        self.text = ""
        self.tokens = list(prompt_ids)  # prompt + output, kept up to date by Engine._emit (read every step)
        self.logprobs = [] if params.logprobs is not None else None
        self.prompt_rows = [] if params.prompt_logprobs is not None else None  # logprob_rows, as prefilled
        self.prompt_logprobs = None  # then, once prefilled: None (position 0), {token id: Logprob} per token
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None  # (best_of sets it too)
        self.bad_words_ids = []  # each bad word's token ids (Engine.add_request)
        self.grammar = None      # its structured-output Grammar, if it asks for one
        self.fork_of = None      # n > 1: the sibling whose prefill it copies (Engine._prefill)
        self.prompt_end = None   # (logits [1, V], hidden [1, 1, H]) at its prompt's end, until forked
        self.finish_reason = None
        self.stop_reason = None
        self.slot = None
        self.prefilled = 0  # prompt tokens prefilled so far (chunked prefill spreads them over steps)
        self.gen = torch.Generator().manual_seed(params.seed if params.seed is not None else seed)
        self.detok = (IncrementalDecoder(tokenizer, prompt=self.prompt_ids)
                      if tokenizer is not None and params.detokenize else None)  # None: token ids only
        self.spec = SpecStats()
        self.arrival_time = time.perf_counter()
        self.first_token_time = None
        self.finish_time = None
        self.on_update = None  # callback(req, n_new_tokens), e.g. the server's stream

    @property
    def finished(self):
        return self.finish_reason is not None

    @property
    def reads_logits(self):
        """Whether emitting reads the step's logits (logprobs): then its steps are synchronous."""
        return self.cumulative_logprob is not None


def h2d(device, data, dtype=None):
    """Host data (a list or CPU tensor) on the device without waiting for the device: through pinned memory,
    copied asynchronously. (A copy from pageable memory waits until every queued kernel has run, which would
    stall the host once per copy and undo asynchronous steps.)"""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class GraphRunner:
    """CUDA graphs captured by hand (nano-vllm's way) for every step that runs often: the target's decode
    (T = 1), its verify (T = k+1) with the GDN commit after it, and the drafters' steps. One capture path:
    a step fn(kv_len, **inputs) -> tuple of tensors is captured per batch bucket (1, 2, 4, 8, ..,
    max_num_seqs) and input shape, all in one memory pool. Its inputs are copied into static buffers that
    its record owns (as it owns the outputs); padding rows beyond the batch get slot = the dummy slot,
    temperature 1, everything else 0. A batch no bucket holds runs eagerly (the caller's fallback)."""
    def __init__(self, state):
        self.buckets = self.bucket_sizes(state.dummy_slot)           # dummy_slot = max_num_seqs
        self.dummy_slot = state.dummy_slot
        self.kv_len = state.max_len   # a graph serves every position: its attention may read the whole cache
        self.graphs = {}              # (name, bucket, input shapes) -> record: static inputs, outputs, graphs
        self.pool = torch.cuda.graph_pool_handle()

    @staticmethod
    def bucket_sizes(max_num_seqs):
        return [b for b in (1, 2, 4, 8, 16, 32) if b < max_num_seqs] + [max_num_seqs]

    def pad(self, name):
        return self.dummy_slot if name == "slots" else (1 if name == "temp" else 0)

    def run(self, name, fn, inputs, then=None):
        """Replay fn's graph for the smallest bucket that holds the batch (capturing it on first use) and
        return its record (outputs in .out, bucket-sized), or None when no bucket fits. inputs: device
        tensors, batch first. then: see capture."""
        B = next(iter(inputs.values())).shape[0]
        Bp = next((b for b in self.buckets if b >= B), None)
        if Bp is None:
            return None
        key = (name, Bp, *[t.shape[1:] for t in inputs.values()])
        g = self.graphs.get(key) or self.capture(key, Bp, fn, inputs, then)
        for n, t in inputs.items():
            g.static[n][:B].copy_(t)
            if Bp > B:
                g.static[n][B:].fill_(self.pad(n))
        g.graph.replay()
        return g

    def capture(self, key, Bp, fn, inputs, then=None):
        """Static inputs for bucket Bp, two warm-up runs on them (Triton compiles, cuBLAS picks: nothing may
        tune inside a capture), then the capture. `then` (after a verify, the commit:
        then(n_keep=.., **inputs)) is a second graph captured right after fn's, reading what fn leaves in the
        state (the GDN stash)."""
        g = types.SimpleNamespace(then=None)
        g.static = {n: torch.full((Bp, *t.shape[1:]), self.pad(n), dtype=t.dtype, device=t.device)
                    for n, t in inputs.items()}
        g.n_keep = torch.zeros(Bp, dtype=torch.long, device=next(iter(inputs.values())).device)
        for _ in range(2):
            fn(self.kv_len, **g.static)
            if then is not None:
                then(n_keep=g.n_keep, **g.static)
        torch.cuda.synchronize()
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.out = fn(self.kv_len, **g.static)
        if then is not None:
            g.then = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.then, pool=self.pool):
                then(n_keep=g.n_keep, **g.static)
        self.graphs[key] = g
        return g

    def replay_then(self, g, n_keep):
        g.n_keep.zero_()
        g.n_keep[:n_keep.shape[0]].copy_(n_keep)
        g.then.replay()


class ModelRunner:
    """Runs the steps on the device. Owns the State (allocated once: max_num_seqs slots + a dummy slot for
    padding rows), the proposer, the CUDA graphs and each slot's next input (token and position, on the
    device); prefills a request, launches one decode or speculative step over a batch of running requests,
    and starts copying its tokens to the host, which reads them back later (asynchronous steps: a step later).
    """
    def __init__(self, model, spec, max_num_seqs, max_model_len, dtype, device, enforce_eager=False,
                 async_steps=None):
        self.model = model
        self.max_model_len = max_model_len
        self.device = device
        if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # One intra-op thread: a CPU step is a few hundred small ops, and with two OpenMP threads each
            # waits at a barrier for the other; on a busy 2-core machine that made the toy model 9x slower
            # (64 tokens, load average 10: 1.4 vs 12.5 tok/s). OMP_NUM_THREADS set by the user wins.
            torch.set_num_threads(1)
        self.k = spec.num_speculative_tokens if spec else 0
        mtp = spec is not None and spec.method == "mtp"
        self.state = State(model.cfg, max_num_seqs, max_model_len + self.k + 1, dtype, device, mtp=mtp)
        self.h2d = functools.partial(h2d, device)
        self.prefill_chunk = 2048
        self.graphs = GraphRunner(self.state) if device.type == "cuda" and not enforce_eager else None
        self.eager_drafts = spec is not None and bool(spec.enforce_eager)  # vLLM's override, for the draft
        # With graphs, greedy speculative steps run as one captured graph each (_one_graph) when nothing in
        # them comes from the host (synthetic acceptance too: its uniforms then come from the device's
        # generator); `inside` is set while such a step is captured (its pieces run eagerly).
        self.whole_steps = (spec is not None and not self.eager_drafts
                            and spec.draft_sample_method == "greedy")
        self.inside = False
        self.pinned = {}  # (shape, dtype) -> a ring of pinned host buffers for the steps' rows (_pinned)
        # Per slot, on the device: the token the slot's next step feeds and its position. Steps read their
        # inputs from here and write them back, so launching a step needs nothing from the host.
        self.next_ids = torch.zeros(max_num_seqs + 1, dtype=torch.long, device=device)
        self.next_pos = torch.zeros(max_num_seqs + 1, dtype=torch.long, device=device)
        # Asynchronous steps (default with CUDA graphs): step n+1 is launched before step n's tokens are
        # read back, so the host's work (stop checks, detokenising, the next launch) overlaps the device's.
        # A request's stop is then seen one step late: the extra step's tokens are dropped. A speculative
        # config with enforce_eager runs synchronously (its eager drafter reads the host's positions).
        host_drafts = spec is not None and spec.enforce_eager
        default_async = self.graphs is not None
        self.async_steps = (default_async if async_steps is None else async_steps) and not host_drafts
        # the target's steps: fn(kv_len, ids, pos, slots) -> (hidden, logits, *taps), and the one after it
        self.steps = {"decode": (functools.partial(self._forward, mode="decode"), None),
                      "verify": (functools.partial(self._forward, mode="verify"), self._commit)}
        self.proposer = None
        if spec is not None:
            io = ProposerIO(model, self.state, max_num_seqs, max_model_len, dtype, device, h2d=self.h2d,
                            call=self.call)
            self.proposer = PROPOSERS[spec.method](spec, io)
            if spec.rejection_sample_method == "synthetic":  # benchmarks: accept by the given rates
                self.rates = torch.tensor(spec.conditional_rates(), device=device)
                self.accept = self._synthetic_sample
            else:
                self.accept = self._rejection_sample
        self.taps = tuple(getattr(self.proposer, "taps", ()))  # target layers the proposer reads (DFlash)
        self.stop_ids = ()  # the model's EOS ids, which min_tokens masks (the Engine sets them)
        if device.type == "cpu" and K.CPU_FAST and dtype == torch.float32 and self.state.max_len >= K.CPU_PAD_ROWS:
            self._calibrate_cpu()

    def _calibrate_cpu(self):
        """kernels.calibrate_cpu_rows for this model: which short steps (1-3 rows) run faster with oneDNN's calls
        padded to 4 rows (the same bits), timed on forwards of 1-3 tokens through the dummy slot (whose state only
        padding rows use). One setting a process: the last model built sets it."""
        slot, pos = self.h2d([self.state.dummy_slot], torch.long), self.h2d([0], torch.long)
        key = tuple((name, tuple(p.shape)) for name, p in self.model.named_parameters())
        with torch.inference_mode():
            K.calibrate_cpu_rows(lambda M: self._forward(M, torch.zeros(1, M, dtype=torch.long), pos, slot,
                                                         "decode"), key)

    # -- inputs ------------------------------------------------------------------------------
    def batch(self, reqs):
        """The Batch of a step over reqs: slots, and each row's last position and token (on the device)."""
        slots = self.h2d([r.slot for r in reqs], torch.long)
        return Batch(reqs, slots, self.next_pos[slots], self.next_ids[slots], not self.async_steps)

    def _advance(self, slots, last, pos):
        """The next step's inputs, on the device. Positions are capped below max_model_len: a step launched
        after a request's final one (async) is dropped, but must still write inside the caches."""
        self.next_ids[slots] = last
        self.next_pos[slots] = pos.clamp(max=self.max_model_len - 1)

    def call(self, name, fn, kv_len, inputs):
        """A drafter's step fn(kv_len, **inputs) -> tuple of tensors: its CUDA graph, or eagerly without
        graphs (or when the speculative config says enforce_eager) and when no bucket fits."""
        eager = self.graphs is None or self.eager_drafts or self.inside
        g = None if eager else self.graphs.run(name, fn, inputs)
        if g is None:
            return fn(kv_len, **inputs)
        B = next(iter(inputs.values())).shape[0]
        return tuple([None if o is None else o[:B] for o in g.out])

    # -- the target ----------------------------------------------------------------------------
    def _hidden(self, ids, ctx):
        """The target's final-norm hidden states and the outputs of the layers the proposer reads."""
        return self.model(ids, ctx, self.taps) if self.taps else (self.model(ids, ctx), ())

    def _forward(self, kv_len, ids, pos, slots, mode):
        """The target over ids [B, T] at positions pos.. of slots -> hidden [B, T, H], logits, *taps. (On a CPU
        each row's bits do not depend on the step's size, however many rows it has: kernels.token_steps.)"""
        with K.token_steps():
            h, taps = self._hidden(ids, Ctx(self.state, slots, pos, kv_len, mode))
            return (h, self.model.logits(h), *taps)

    def _commit(self, ids, pos, slots, n_keep):
        """After a verify: each GDN layer's state advances by the first n_keep [B] tokens (its stash)."""
        self.model.commit(Ctx(self.state, slots, pos, 0), n_keep)

    def _target(self, batch, ids, mode):
        """One target step over ids [B, T] at the batch's positions: its graph, or eagerly when none fits.
        Returns hidden [B, T, H], logits [B, T, V], taps, and commit(n_keep) (after a verify)."""
        fn, then = self.steps[mode]
        inputs = dict(ids=ids, pos=batch.pos, slots=batch.slots)
        g = None if self.graphs is None or self.inside else self.graphs.run(mode, fn, inputs, then)
        if g is None:
            h, logits, *taps = fn(batch.kv_len(ids.shape[1], self.state.max_len), **inputs)
            return h, logits, taps, lambda n_keep: then(n_keep=n_keep, **inputs)
        B = ids.shape[0]
        h, logits, *taps = [o[:B] for o in g.out]
        return h, logits, taps, lambda n_keep: self.graphs.replay_then(g, n_keep)

    # -- steps -----------------------------------------------------------------------------------
    def prefill(self, req, start=0, end=None):
        """Prompt tokens start..end (default: all) of a new request through the target and the proposer,
        in pieces of prefill_chunk tokens at fixed offsets (the same arithmetic whatever else runs). Returns
        the first token (an int: the host waits for it) and its logits [1, V] once the prompt is done, else
        None."""
        ids = req.prompt_ids
        n = len(ids)
        end = n if end is None else end
        if start == 0:
            self.state.reset(req.slot)
        slots = self.h2d([req.slot], torch.long)
        with K.not_invariant():  # one prompt alone: nothing to be invariant against (kernels.BATCH_INVARIANT)
            for s in range(start, end, self.prefill_chunk):
                chunk = self.h2d([ids[s:min(s + self.prefill_chunk, end)]])  # no wait for the step in flight
                T = chunk.shape[1]
                pos = self.h2d([s])
                h, taps = self._hidden(chunk, Ctx(self.state, slots, pos, s + T, "prefill"))
                if req.prompt_rows is not None:
                    self._prompt_logprobs(req, h[0], s)
                if s + T == n:
                    logits = self.model.logits(h[:, -1])                              # [1, V]
                    tok = self._sample(logits, [req])
                    req.prompt_end = (logits, h[:, -1:])  # what its forks need (Engine._prefill)
                if self.proposer is not None:
                    nxt = ids[s + 1:s + T + 1] + ([int(tok[0])] if s + T == n else [])
                    self.proposer.prefill(req, h, taps, self.h2d([nxt]), s)
        if end < n:
            return None
        self.next_ids[req.slot] = tok[0]
        self.next_pos[req.slot] = n
        return int(tok[0]), logits

    def _prompt_logprobs(self, req, h, s):
        """The logprobs of the prompt tokens that the rows h [T, H] of a piece from position s predict (the
        last prompt position predicts the first output token: none), onto req.prompt_rows. Only a request
        that asks pays for it: the lm_head over its prompt, 256 rows at a time (the logits [256, V])."""
        ids = req.prompt_ids[s + 1:s + 1 + h.shape[0]]
        for a in range(0, len(ids), 256):
            piece = ids[a:a + 256]
            logits = self.model.logits(h[a:a + len(piece)])                  # [rows, V]
            req.prompt_rows += logprob_rows(logits, piece, req.params.prompt_logprobs)

    def fork(self, src, dst):
        """dst has the prompt src has just prefilled: its slot becomes a copy of src's (the target's state and
        the proposer's caches) instead of a second prefill, and it samples its own first token from the
        prompt's logits with its own generator. Returns (token, logits) as prefill does."""
        n = len(src.prompt_ids)
        logits, hidden = src.prompt_end
        copy_slot(self.state, src.slot, dst.slot, n)
        tok = self._sample(logits, [dst])
        if self.proposer is not None:
            self.proposer.fork(src.slot, dst.slot, n, tok, hidden)
        self.next_ids[dst.slot] = tok[0]
        self.next_pos[dst.slot] = n
        return int(tok[0]), logits

    def launch(self, reqs):
        """Queue one decode or speculative step over reqs on the device; returns it as a pending step."""
        batch = self.batch(reqs)
        if self.proposer is None:
            return self._decode_step(batch)
        whole = self.graphs is not None and self.whole_steps and self._greedy_only(reqs)
        out = self._one_graph(batch) if whole else None
        return self._pending(reqs, *(out or self._spec_step(batch)))

    def _decode_step(self, batch):
        h, logits, taps, _ = self._target(batch, batch.last[:, None], "decode")
        toks = self._sample(logits[:, 0], batch.reqs)                                 # [B]
        self._advance(batch.slots, toks, batch.pos + 1)
        return self._pending(batch.reqs, toks[:, None], logits)

    def _spec_step(self, batch):
        """One speculative step, as DESIGN.md tells it: propose, verify, accept, commit, advance. Returns the
        rows for the host, [tokens (k+1), n accepted, n drafted] each, and the verify's logits."""
        drafts, q = self.proposer.propose(batch)                          # [B, k], [B, k, V] or None
        ids = torch.cat([batch.last[:, None], drafts.clamp(min=0)], 1)    # [B, k+1]: last, d1..dk
        h, logits, taps, commit = self._target(batch, ids, "verify")      # [B, k+1, H], [B, k+1, V]
        tokens, n = self.accept(batch.reqs, logits, drafts, q)            # [B, k+1], [B] drafts accepted
        commit(n + 1)                                                     # GDN states after last, d1..dn
        self.proposer.commit(batch, h, taps, ids, n, tokens)
        rows = torch.arange(ids.shape[0], device=self.device)
        self._advance(batch.slots, tokens[rows, n], batch.pos + n + 1)    # next: the (n+1)-th token
        n_drafted = (drafts >= 0).sum(1, keepdim=True)                    # [B, 1]
        return torch.cat([tokens, n[:, None], n_drafted], 1), logits      # [B, k+3] for the host

    # -- a speculative step as one CUDA graph ------------------------------------------------------
    @staticmethod
    def _greedy_only(reqs):
        """Nothing in a step over these requests comes from the host: no sampling uniforms, no logits
        processors (their tables and masks are the host's), no logprobs."""
        return all(r.params.greedy and not r.params.processed and not r.reads_logits for r in reqs)

    def _whole_step(self, kv_len, slots):
        """_spec_step over the rows in slots, a function of device tensors only: every input comes from the
        slots' next token and position (the padding rows' dummy slot: position 0)."""
        pos = self.next_pos[slots] * (slots != self.state.dummy_slot)
        return self._spec_step(Batch(None, slots, pos, self.next_ids[slots], host_knows_pos=False))

    def _one_graph(self, batch):
        """A greedy speculative step as one CUDA graph, _whole_step captured with its pieces (proposer,
        target, commits) inside it rather than as graphs of their own: one launch instead of ~6 graphs and
        ~50 kernels from the host, which is what a small model's step costs. None when no bucket fits."""
        self.inside = True  # the pieces run eagerly inside this capture
        try:
            g = self.graphs.run("spec-step", self._whole_step, dict(slots=batch.slots))
        finally:
            self.inside = False
        return None if g is None else tuple(o[:batch.slots.shape[0]] for o in g.out)

    # -- sampling --------------------------------------------------------------------------------
    def _process(self, reqs, logits, drafts=None):
        """The requests' logits processors over logits [B, T, V] (process_logits), drafts [B, T-1] or None.
        A request with a grammar gets its masks from walking the drafts (on the host: one wait per step);
        the drafts it refuses become -1 (rejected). Returns (logits [B, T, V] fp32, drafts)."""
        B, T, V = logits.shape
        masks = None
        if any(r.grammar is not None for r in reqs):
            d = drafts.tolist() if drafts is not None else [[] for _ in reqs]
            bitmask = torch.full((B, T, (V + 31) // 32), -1, dtype=torch.int32)          # all allowed
            for b, r in enumerate(reqs):
                if r.grammar is not None:
                    bitmask[b], n = r.grammar.masks(d[b], V)
                    d[b][n:] = [-1] * (len(d[b]) - n)
            masks = unpack_bitmask(self.h2d(bitmask), V)                                 # [B, T, V]
            drafts = self.h2d(d, torch.long) if drafts is not None else None
        return process_logits(logits, drafts, reqs, self.stop_ids, self.h2d, masks), drafts

    def _min_p(self, reqs):
        return self.h2d([r.params.min_p for r in reqs], torch.float32) if any(r.params.min_p for r in reqs) \
            else None

    def _sample(self, logits, reqs):
        """Sample one token per row of logits [B, V] with each request's own generator."""
        if any(r.params.processed for r in reqs):  # decided on the host: plain requests pay nothing
            logits = self._process(reqs, logits[:, None])[0][:, 0]
        if all(r.params.greedy for r in reqs):  # decided on the host: no device sync
            return K.argmax(logits)
        f = lambda name: self.h2d([getattr(r.params, name) for r in reqs])
        greedy = f("greedy")
        temperature = f("temperature").float()
        p = target_probs(logits, temperature, f("top_k"), f("top_p").float(), self._filtered(reqs),
                         self._min_p(reqs))
        u = self.h2d(torch.stack([torch.rand((), generator=r.gen) for r in reqs]))
        return torch.where(greedy, logits.argmax(-1), sample_from(p, u))

    @staticmethod
    def _filtered(reqs):
        return any(r.params.top_k > 0 or r.params.top_p < 1 for r in reqs)

    def _uniforms(self, reqs):
        """A verify's uniforms from each request's generator: u_accept [B, k], u_sample [B, k+1]."""
        u_acc = self.h2d(torch.stack([torch.rand(self.k, generator=r.gen) for r in reqs]))
        u_smp = self.h2d(torch.stack([torch.rand(self.k + 1, generator=r.gen) for r in reqs]))
        return u_acc, u_smp

    def _rejection_sample(self, reqs, logits, drafts, q):
        """rejection_sample with each request's sampling parameters, on the processed logits (reqs None: a
        whole-step graph, every row greedy and without processors). On a CPU such a step takes greedy_verify
        too, without the uniforms a greedy row never reads and rejection_sample's arguments: the acceptance
        0.25 -> 0.19 ms a step on the toy, MTP k=3 (the tokens are the same: rejection_sample's greedy rows
        are greedy_verify's; test_cpu_greedy_accept)."""
        if reqs is None or (self.device.type == "cpu" and self._greedy_only(reqs)):
            return greedy_verify(logits, drafts)
        u_acc, u_smp = self._uniforms(reqs)
        if any(r.params.processed for r in reqs):
            logits, drafts = self._process(reqs, logits, drafts)
        f = lambda name, dtype: self.h2d([getattr(r.params, name) for r in reqs], dtype)
        return rejection_sample(logits, drafts, q, f("temperature", torch.float32), f("top_k", torch.long),
                                f("top_p", torch.float32), u_acc, u_smp,
                                all_greedy=all(r.params.greedy for r in reqs), filtered=self._filtered(reqs),
                                min_p=self._min_p(reqs))

    def _synthetic_sample(self, reqs, logits, drafts, q):
        """synthetic_sample with the configured rates; the uniforms are drawn as for rejection_sample, or
        (reqs None: a whole-step graph, which takes nothing from the host) by the device's default generator,
        whose draws a CUDA graph captures and renews at every replay. A benchmark mode: either way each draft
        is accepted with its rate, and the step runs as a real greedy step does, as one graph."""
        if reqs is None:
            u_acc = torch.rand(drafts.shape, device=drafts.device)
        else:
            u_acc, _ = self._uniforms(reqs)
        return synthetic_sample(logits, drafts, self.rates, u_acc)

    # -- read-back ------------------------------------------------------------------------------
    def _pending(self, reqs, out, logits):
        """Start copying a step's result rows out [B, n] to the host (pinned memory, no wait)."""
        host = out
        event = None
        if out.is_cuda:
            host = self._pinned(out.shape, out.dtype)
            host.copy_(out, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return types.SimpleNamespace(reqs=reqs, host=host, event=event, logits=logits)

    def _pinned(self, shape, dtype):
        """A pinned host buffer for a step's rows, from a ring of three per shape: allocating pinned memory
        every step costs host time (torch.profiler: aten::pin_memory in every step), and at most two steps
        are pending at once (the one being read back and the one launched before it is read)."""
        ring = self.pinned.setdefault((tuple(shape), dtype), [])
        if len(ring) < 3:
            ring.append(torch.empty(shape, dtype=dtype, pin_memory=True))
        else:
            ring.append(ring.pop(0))  # the oldest: read back two steps ago
        return ring[-1]

    @staticmethod
    def read(p):
        """A pending step's rows on the host (waits for its copy)."""
        if p.event is not None:
            p.event.synchronize()
        return p.host.tolist()


PREFILL_SHARE = 0.4  # the share of the device's time that prompt pieces get while other requests decode


class PrefillShare:
    """Chunked prefill beside running requests: a long prompt's pieces get at most `share` of the device's
    time, so the streams keep their pace. Wall time accrues share x elapsed of credit, every piece's device
    time is paid from it once known, and what is left is capped at 0 (no saved-up bursts); a prompt's later
    pieces wait while the credit is below 0 or earlier pieces' device time is not known yet. Over a long
    prompt the streams' time per token grows at most 1 / (1 - share)-fold (1.67x at 0.4; the step with a
    piece is one long step) and the prompt prefills at `share` of its speed alone. Alone (nothing decoding):
    full speed."""
    def __init__(self, share, device, clock=time.perf_counter):
        self.share, self.clock = share, clock
        self.cuda = torch.device(device).type == "cuda"
        self.credit, self.last, self.out = 0.0, None, []  # out: the timed pieces' (start, end), unpaid

    def ready(self, continuing):
        """May this step prefill? continuing: the next prompt has pieces done (a new prompt's first piece
        goes at once)."""
        now = self.clock()
        if self.last is not None:
            self.credit += self.share * (now - self.last)
        self.last = now
        while self.out and (not self.cuda or self.out[0][1].query()):  # pieces that have run (no wait)
            a, b = self.out.pop(0)
            self.credit -= a.elapsed_time(b) / 1e3 if self.cuda else b - a
        if self.out:
            return not continuing
        self.credit = min(0.0, self.credit)
        return self.credit >= 0 or not continuing

    def mark(self):
        """A point in time around this step's pieces: the host's clock on the CPU (pieces run synchronously
        there), a CUDA event on the GPU (they run later, asynchronously)."""
        if not self.cuda:
            return self.clock()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, start):
        """The pieces begun at `start` (a mark) end here: their time is paid once they have run."""
        self.out.append((start, self.mark()))

    def alone(self):
        """Nothing decodes: no sharing, and nothing owed."""
        self.credit, self.last, self.out = 0.0, None, []


class Engine:
    """The scheduler: requests wait in a FIFO queue for one of max_num_seqs slots; each step admits what
    fits, prefills (chunked prefill: up to max_num_batched_tokens per step, counting the running requests'
    tokens; a long prompt's pieces get at most PREFILL_SHARE of the time beside them: PrefillShare),
    launches one step over the running requests on the ModelRunner, reads the step before back and emits
    its tokens, stopping each request exactly where plain decoding stops (EOS, stop ids and strings,
    max_tokens, max_model_len). Counts vLLM's spec-decode metrics."""
    def __init__(self, model, tokenizer, spec, max_num_seqs, max_model_len, dtype, device, seed=0,
                 enforce_eager=False, async_steps=None, max_num_batched_tokens=None,
                 enable_chunked_prefill=True):
        # (LLM, the CLI, the server and bench check these too; an Engine built directly gets the same lines)
        for name, v in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                        ("max_num_batched_tokens", 1 if max_num_batched_tokens is None else max_num_batched_tokens)):
            if not _positive_int(v):
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        budget = 2048 if max_num_batched_tokens is None else max_num_batched_tokens
        if budget < max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens ({budget}) must be greater than or equal to "
                              f"max_num_seqs ({max_num_seqs}).")
        self.runner = ModelRunner(model, spec, max_num_seqs, max_model_len, dtype, device, enforce_eager,
                                  async_steps)
        self.chunked = enable_chunked_prefill
        self.max_num_batched_tokens = budget
        if self.chunked:  # a prompt's pieces: budget tokens each, at fixed offsets
            self.runner.prefill_chunk = budget
        self.tokenizer = tokenizer
        self.spec = spec
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.vocab_size = model.cfg.vocab_size
        # (vLLM's seed None: unseeded; the requests' generators still need a base, drawn once)
        self.seed = int(torch.randint(2 ** 31, ())) if seed is None else seed
        self.eos_id = getattr(tokenizer, "eos_token_id", None)  # the tokenizer's: it stops with stop_reason None
        self.stop_ids = set(model.cfg.eos_token_ids) | ({self.eos_id} if self.eos_id is not None else set())
        self.runner.stop_ids = sorted(self.stop_ids)
        self.grammars = None  # the xgrammar compiler, made when a request first asks for structured outputs
        self.special_ids = set(tokenizer._special_id_set) if tokenizer is not None else set()  # not in text
        self.slots = [None] * max_num_seqs
        self.waiting = deque()
        self.prefilling = deque()  # admitted (a slot each), prompt not yet all prefilled; FIFO
        self.stats = SpecStats()
        self.num_requests = 0
        self.pending = None  # the launched step whose tokens the host has not read yet
        self.share = PrefillShare(PREFILL_SHARE, device)  # the prefill's time beside running requests

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_ids, params, rid=None, fork_of=None, output_fits=True, bad_words_ids=None):
        """Queue a request; fork_of: a request added before with the same prompt, whose prefill it copies.
        output_fits: prompt + max_tokens must fit in max_model_len (vLLM's server refuses the request otherwise);
        False: only the prompt must leave room for a token, the output stops at max_model_len ("length"), as in
        vLLM's LLM.generate (input_processor._validate_prompt_len checks the prompt alone). bad_words_ids: the
        bad words' token sequences (bad_words_token_ids) when the caller made them already, as the server does on
        its own threads (vLLM's front end does): the loop that steps every request then does not tokenize them."""
        prompt_ids, m = self.check_request(prompt_ids, params, output_fits)
        params = copy.copy(params)  # (not dataclasses.replace: its checks would make a child's seed -1 None)
        params.max_tokens = m
        if bad_words_ids is None:
            bad_words_ids = self.bad_words_token_ids(params.bad_words)
        grammar = self.grammar(params.structured_outputs) if params.structured_outputs is not None else None
        self.num_requests += 1
        req = Request(rid if rid is not None else str(self.num_requests), prompt_ids, params, self.tokenizer,
                      self.seed + self.num_requests)
        req.bad_words_ids = bad_words_ids
        req.grammar = grammar
        req.fork_of = fork_of if fork_of is not None and fork_of.prompt_ids == req.prompt_ids else None
        self.waiting.append(req)
        return req

    def check_request(self, prompt_ids, params, output_fits=True):
        """The checks add_request makes of a prompt and its parameters, alone (nothing is queued): the prompt not
        empty, its ids in the vocabulary, it and max_tokens inside max_model_len (output_fits as add_request's), the
        parameters' token ids in the vocabulary; raises ConfigError with vLLM's messages. -> (the prompt's ids after
        truncate_prompt_tokens, the max_tokens it gets). The server checks every prompt of a batch with it before it
        queues any (vLLM refuses the request before any of it runs), on its handler threads."""
        if not prompt_ids:
            raise ConfigError("the prompt is empty: at least one prompt token is needed")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"prompt token id {bad[0]} is out of range [0, {self.vocab_size})")
        prompt_ids = truncate_prompt(prompt_ids, params.truncate_prompt_tokens, self.max_model_len)
        n = len(prompt_ids)
        if not output_fits and n >= self.max_model_len:  # vLLM's messages
            more = " plus the number of requested output tokens (at least 1)" if n == self.max_model_len else ""
            need = " (prompt + requested output tokens)" if more else ""
            raise ConfigError(f"The decoder prompt (length {n}){more} is longer than the maximum model length of "
                              f"{self.max_model_len}. Make sure that `max_model_len` is no smaller than the number "
                              f"of text tokens{need}.")
        if params.max_tokens is None and n >= self.max_model_len:
            raise ConfigError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"your request has {n} input tokens. Please reduce the length of the input "
                              "messages.")
        m = params.max_tokens or (self.max_model_len - n)
        if not output_fits:  # the output stops where the context ends
            m = min(m, self.max_model_len - n)
        if n + m > self.max_model_len:
            raise ConfigError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"you requested {n + m} tokens ({n} in the messages, {m} in the completion). "
                              f"Please reduce the length of the messages or completion.")
        self.check_token_ids(params)
        return prompt_ids, m

    def check_token_ids(self, p):
        """The request's token ids inside the vocabulary, with vLLM's messages."""
        V = self.vocab_size
        for name, ids in (("stop_token_ids", p.stop_token_ids), ("logit_bias", p.logit_bias or {})):
            wrong = [t for t in ids if not 0 <= t < V]
            if wrong:
                raise ConfigError(f"token_id(s) {wrong} in {name} contain out-of-vocab token ids. Vocabulary "
                                  f"size: {V}")
        if p.allowed_token_ids is not None and not all(
                isinstance(t, int) and 0 <= t < V for t in p.allowed_token_ids):
            raise ConfigError("allowed_token_ids contains out-of-vocab token id!")

    def bad_word_ids(self, word):
        """A bad word's token sequences, as vLLM tokenizes it (encode(add_special_tokens=False): an added
        token's text is its id, "<|im_end|>" bans EOS): the word (left-stripped), and with a leading space when
        that spells it with other tokens of the same count (so it is banned mid-text too)."""
        if self.tokenizer is None:
            raise ConfigError("bad_words need a tokenizer")
        plain = self.tokenizer.encode(word.lstrip())
        if not plain:
            raise ConfigError("bad_words entries must tokenize to at least one token.")
        spaced = self.tokenizer.encode(" " + word.lstrip())
        return [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])

    def bad_words_token_ids(self, words):
        """Every token sequence that the bad words ban (bad_word_ids of each)."""
        return [ids for w in words for ids in self.bad_word_ids(w)]

    def grammar(self, so):
        """A request's Grammar: its constraint compiled by xgrammar (ConfigError when it cannot be)."""
        if self.tokenizer is None:
            raise ConfigError("Structured outputs requires a tokenizer")
        if self.grammars is None:
            try:
                import xgrammar  # noqa: F401
            except ImportError:
                raise ConfigError("structured_outputs need the xgrammar package (pip install xgrammar)") \
                    from None
            self.grammars = grammar_compiler(self.tokenizer, self.vocab_size, self.stop_ids)
        return Grammar(compile_grammar(self.grammars, so))

    def abort(self, req):
        """Cancel a request (e.g. its client went away): its slot frees at once."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)
        if not req.finished:
            req.finish_reason = "abort"
        self._release(req)

    def _release(self, req):
        if req.slot is not None and self.slots[req.slot] is req:
            self.slots[req.slot] = None
        req.slot = None

    def has_work(self):
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def warmup(self, force=False):
        """Capture the CUDA graph of every batch bucket, for both kinds of speculative step (greedy ones whole,
        sampled ones by pieces), before the first real request: a graph captured later stalls every request in
        flight for its capture (160-290 ms at the 27B's shapes, measured). Bucket b gets b dummy requests at
        once, so their first step runs exactly b rows. (Requests stopping at staggered lengths, the first form
        of this, can skip a bucket: two of them may stop in the same step.) Nothing without graphs (CPU,
        enforce_eager) unless forced. The counters reset after; the slots' states are reset by each prefill."""
        graphs = self.runner.graphs
        if graphs is None and not force:
            return
        prompt = list(range(1, min(17, self.max_model_len)))  # a short --max-model-len holds it and a token
        n = max(1, min(3, self.max_model_len - len(prompt)))
        kinds = [dict(temperature=0)] + ([dict(temperature=1.0, seed=0)] if self.spec is not None else [])
        for b in GraphRunner.bucket_sizes(self.max_num_seqs):
            for kind in kinds:
                for _ in range(b):
                    self.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True, **kind))
                while self.has_work():
                    self.step()
        self.stats = SpecStats()
        self.num_requests = 0

    # -- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self):
        """Admit waiting requests into free slots, prefill, then one decode or speculative step for every
        running request. Returns the requests that got new tokens."""
        while self.waiting and None in self.slots:
            req = self.waiting.popleft()
            req.slot = self.slots.index(None)
            self.slots[req.slot] = req
            self.prefilling.append(req)
        running = [r for r in self.slots
                   if r is not None and r not in self.prefilling and not self._ends_in_flight(r)]
        budget = self.max_num_batched_tokens - len(running) * (self.runner.k + 1)
        touched = []
        if not (self.chunked and running):
            self.share.alone()
            touched = self._prefill(budget)
        elif self.prefilling and self.share.ready(continuing=self.prefilling[0].prefilled > 0):
            start = self.share.mark()
            touched = self._prefill(budget)
            self.share.stop(start)
        done = self.pending
        if done is not None and any(r.params.needs_history for r in running):
            touched += self._finish(done)  # the processors read the output so far: the host must have it
            done = self.pending = None
            running = [r for r in running if not r.finished]
        self.pending = self.runner.launch(running) if running else None  # launched before `done` is read
        if done is not None:
            touched += self._finish(done)
        stay_async = self.runner.async_steps and not any(r.reads_logits or r.params.needs_history
                                                         for r in running)  # they read the host's view
        if self.pending is not None and not stay_async:
            done = self.pending  # synchronous: read this step back now
            self.pending = None
            touched += self._finish(done)
        return touched

    def _prefill(self, budget):
        """Prefill waiting prompts, first come first served: whole prompts, or with chunked prefill pieces of
        runner.prefill_chunk tokens while the step's budget lasts (one piece at least). Requests whose prompt
        is done emit their first token; returned."""
        touched = []
        first = True
        while self.prefilling:
            req = self.prefilling[0]
            req.fork_of = None  # its parent went first and is gone without forking it: prefill it alone
            n = len(req.prompt_ids)
            end = min(n, req.prefilled + self.runner.prefill_chunk) if self.chunked else n
            if self.chunked and not first and end - req.prefilled > budget:
                break
            first = False
            try:
                out = self.runner.prefill(req, req.prefilled, end)
            except Exception as e:
                e.failed_request = req  # this request's own prefill failed: the others can go on (server.py)
                raise
            budget -= end - req.prefilled
            req.prefilled = end
            if out is None:
                continue
            self.prefilling.popleft()
            if req.prompt_rows is not None:
                req.prompt_logprobs = [None] + self.logprob_dicts(req.prompt_rows, req.params.detokenize)
                req.prompt_rows = None
            forks = [f for f in self.prefilling if f.fork_of is req]  # its siblings with a slot: copies
            outs = [out] + [self.runner.fork(req, f) for f in forks]  # (before req's emit may free its slot)
            req.prompt_end = None
            for r, o in zip([req, *forks], outs):
                if r is not req:
                    self.prefilling.remove(r)
                    r.prefilled = len(r.prompt_ids)
                    r.prompt_logprobs = req.prompt_logprobs  # the same prompt
                self._emit(r, [o[0]], o[1])
                touched.append(r)
        return touched

    def _ends_in_flight(self, r):
        """r is in the step in flight, which surely ends it (it yields >= 1 token): another step is waste."""
        return (self.pending is not None and r in self.pending.reqs and
                (len(r.output_ids) + 1 >= r.params.max_tokens or len(r.tokens) + 1 >= self.max_model_len))

    def _finish(self, p):
        """Read a launched step back and emit its tokens (requests that finished meanwhile are skipped)."""
        rows = self.runner.read(p)
        live = []
        for b, r in enumerate(p.reqs):
            if r.finished:  # stopped by the step before, or aborted: this step's tokens are not part of it
                continue
            toks = rows[b]
            if self.spec is not None:  # [tokens (k+1), n accepted, n drafted]
                n = toks[-2]
                n_draft = toks[-1]
                r.spec.add(n_draft, n)
                self.stats.add(n_draft, n)
                toks = toks[:n + 1]
            self._emit(r, toks, p.logits[b])
            live.append(r)
        return live

    # -- output --------------------------------------------------------------------------------
    def logprob_dicts(self, rows, detokenize=True):
        """logprob_rows as vLLM gives them: {token id: Logprob} per row, with each token's text (None with
        detokenize=False: vLLM's output processor then has no tokenizer for the request)."""
        tok = self.tokenizer if detokenize else None
        text = (lambda t: tok.decode([t])) if tok is not None else (lambda t: None)
        return [{t: Logprob(v, r, text(t)) for t, v, r in row} for row in rows]

    def _emit(self, req, toks, logits):
        """Append tokens one by one, stopping exactly where plain decoding would stop. logits [n, V]."""
        p = req.params
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        emitted = 0
        lps = None if req.logprobs is None else self.logprob_dicts(logprob_rows(logits[:len(toks)], toks,
                                                                                  p.logprobs), p.detokenize)
        for i, t in enumerate(toks):
            req.output_ids.append(t)
            req.tokens.append(t)
            emitted += 1
            if req.grammar is not None:
                req.grammar.accept(t)
            if req.reads_logits:
                req.cumulative_logprob += float(logits[i].float().log_softmax(-1)[t])
            if req.logprobs is not None:
                req.logprobs.append(lps[i])
            # not in the text (vLLM's detokenizer): the token that stop-terminates the request, unless
            # include_stop_str_in_output (it stays in token_ids); a special token, with skip_special_tokens
            stop_token = t in p.stop_token_ids or (t in self.stop_ids and not p.ignore_eos)
            special = t in self.special_ids and p.skip_special_tokens
            unseen = special or (stop_token and not p.include_stop_str_in_output)
            if req.detok is not None and not unseen:
                old = len(req.text)
                req.text += req.detok.add([t])
                for s in p.stop if len(req.output_ids) > p.min_tokens else ():  # vLLM: not before min_tokens
                    j = req.text.find(s, max(0, old - len(s) + 1))
                    if j >= 0:
                        req.text = req.text[:j + len(s) if p.include_stop_str_in_output else j]
                        req.finish_reason = "stop"
                        req.stop_reason = s
                        break
            if req.finished:
                break
            if stop_token:  # vLLM: the tokenizer's EOS has no stop_reason; the generation config's other EOS ids
                req.finish_reason = "stop"  # join stop_token_ids (update_from_generation_config): their id is it
                req.stop_reason = None if t == self.eos_id and not p.ignore_eos else t
            elif len(req.output_ids) >= p.max_tokens or len(req.tokens) >= self.max_model_len:
                req.finish_reason = "length"
            if req.finished:
                break
        if req.finished:  # (text the detokenizer still holds, an unfinished character, is dropped: vLLM)
            req.finish_time = time.perf_counter()
            self._release(req)
        if req.on_update is not None:
            req.on_update(req, emitted)


# ==============================================================================================
# Tokenizer: byte-level BPE on tiktoken, incremental decoding, the Qwen3.6 chat format
# ==============================================================================================
# Qwen3.5/3.6 use a byte-level BPE (HF `tokenizers` layout). We run it on tiktoken: the pre-tokenizer
# regex is tiktoken's pat_str, the BPE vocab its mergeable ranks, the added tokens its special tokens.

QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
                r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def _gpt2_byte_chars():
    # GPT-2 byte-level alphabet: printable bytes stand for themselves, the other 68 map to U+0100..
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


BYTE_OF_CHAR = {c: b for b, c in _gpt2_byte_chars().items()}
# str.translate table: byte-level char -> latin-1 char of its byte; any other char -> U+0100 (not latin-1)
_TO_LATIN1 = {cp: BYTE_OF_CHAR.get(chr(cp), 0x100) for cp in range(0x144)}


class Tokenizer:
    chat_template = None  # a GGUF file's template text (tokenizer.chat_template); directories: ChatTemplate
    template = None  # the ChatTemplate apply_chat_template renders (LLM sets the checkpoint's)

    def __init__(self, vocab, merges=None, added_tokens=None, pattern=QWEN_PATTERN, eos_token=None,
                 special=None, nfc=True, ignore_merges=False):
        """vocab: byte-level token string -> id; merges: "a b" strings or [a, b] pairs in priority order
        (None: ids are the merge ranks, as in tiktoken files); added_tokens: text -> id, matched whole;
        special: the added tokens that decode(skip_special=True) drops (default: all of them);
        ignore_merges: HF's flag, a pre-token that is a vocab token is taken whole (no merge need make it)."""
        added_tokens = dict(added_tokens or {})
        self.nfc = nfc
        self._vocab = vocab
        try:
            tok_bytes = {t: t.translate(_TO_LATIN1).encode("latin-1") for t in vocab}
        except UnicodeEncodeError:
            bad = next(t for t in vocab if any(c not in BYTE_OF_CHAR for c in t))
            raise ValueError(f"vocab is not byte-level BPE: token {bad!r} has characters outside the GPT-2 "
                             "byte alphabet") from None
        if len({b for b in tok_bytes.values() if len(b) == 1}) != 256:
            raise ValueError("vocab is not byte-level BPE: it lacks some of the 256 single-byte tokens")
        # id -> bytes for every id we know; ids nobody uses decode to b"" (HF skips unknown ids too)
        self.vocab_size = max([*vocab.values(), *added_tokens.values()]) + 1
        self._bytes = [b""] * self.vocab_size
        for t, i in vocab.items():
            self._bytes[i] = tok_bytes[t]
        for t, i in added_tokens.items():
            self._bytes[i] = t.encode("utf-8")
        self.special_ids = dict(added_tokens)  # every added token, e.g. "<think>" too
        self._special = set(added_tokens) if special is None else set(special) & set(added_tokens)
        self._special_id_set = {added_tokens[t] for t in self._special}
        self._nonspecial = set(added_tokens) - self._special  # HF always matches these, like <think>

        order, merged = self._merge_order(vocab, tok_bytes, merges, ignore_merges)
        merged_ids = [vocab[t] for t in order if len(tok_bytes[t]) > 1 and t in merged]
        if all(i < j for i, j in zip(merged_ids, merged_ids[1:])):  # ids follow merge order: rank = id
            self._rank_to_id = None
            ranks = {tok_bytes[t]: vocab[t] for t in order}
            specials = added_tokens
        else:  # ranks follow merge order, and a table maps them back to ids
            self._rank_to_id = [vocab[t] for t in order] + list(added_tokens.values())
            ranks = {tok_bytes[t]: r for r, t in enumerate(order)}
            specials = {t: len(order) + k for k, t in enumerate(added_tokens)}
        self._enc = tiktoken.Encoding("specdec", pat_str=pattern, mergeable_ranks=ranks,
                                      special_tokens=specials)
        if eos_token is None:
            eos_token = next((t for t in ("<|im_end|>", "<|endoftext|>") if t in added_tokens), None)
        self.eos_token_id = None if eos_token is None else self.id_of(eos_token)

    @staticmethod
    def _merge_order(vocab, tok_bytes, merges, ignore_merges):
        """The tokens in tiktoken rank order, and those that merges make (all, for a tiktoken-style vocab).
        tiktoken merges the adjacent pair whose *merged token* has the lowest rank; HF BPE applies the merge
        with the lowest *merge index*. So a token's tiktoken rank must be its merge priority."""
        if merges is None:  # tiktoken-style vocab: ids are the ranks
            return sorted(vocab, key=vocab.get), vocab
        prio = {}
        for p, m in enumerate(merges):
            a, b = m.split(" ") if isinstance(m, str) else m
            if a not in vocab or b not in vocab or a + b not in vocab:
                raise ValueError(f"merge {m!r} refers to a token that is not in the vocab")
            prio.setdefault(a + b, p)  # several merges making one token: the first one wins
        # "orphans" (multi-byte tokens no merge makes) are unreachable in HF BPE: leave them out. With
        # ignore_merges HF takes a pre-token that is an orphan whole, like tiktoken does; add the orphans
        # no two mergeable tokens spell, as tiktoken can only ever take those whole too.
        singles = sorted((t for t in vocab if len(tok_bytes[t]) == 1), key=vocab.get)
        order = singles + sorted(prio, key=prio.get)
        if ignore_merges:
            have = {tok_bytes[t] for t in order}
            spelled = lambda b: any(b[:k] in have and b[k:] in have for k in range(1, len(b)))  # noqa: E731
            orphans = (t for t in vocab
                       if t not in prio and len(tok_bytes[t]) > 1 and not spelled(tok_bytes[t]))
            order += sorted(orphans, key=vocab.get)
        return order, prio

    @classmethod
    def from_dir(cls, path):
        """Load a HF tokenizer.json (+ tokenizer_config.json for eos_token) of the Qwen3.5 kind."""
        tj = read_json(os.path.join(path, "tokenizer.json"), "tokenizer", obj=True)
        model = tj.get("model") or {}
        if model.get("type") != "BPE":
            raise ValueError(f"tokenizer.json: model type {model.get('type')!r} is not supported, only "
                             "byte-level BPE")
        for key in ("byte_fallback", "continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(key):
                raise ValueError(f"tokenizer.json: BPE option {key}={model[key]!r} is not supported")
        pre = tj.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        kinds = [s.get("type") for s in steps]
        if (kinds != ["Split", "ByteLevel"] or "Regex" not in steps[0].get("pattern", {})
                or steps[0].get("behavior") != "Isolated" or steps[0].get("invert")
                or steps[1].get("add_prefix_space") or steps[1].get("use_regex")):
            raise ValueError(f"tokenizer.json: pre-tokenizer {kinds} is not the byte-level "
                             "Split(regex, isolated) + ByteLevel(no prefix space, no regex) layout")
        if (tj.get("decoder") or {}).get("type") != "ByteLevel":
            raise ValueError("tokenizer.json: decoder is not ByteLevel")
        norm = (tj.get("normalizer") or {}).get("type")
        if norm not in (None, "NFC"):
            raise ValueError(f"tokenizer.json: normalizer {norm!r} is not supported (only NFC or none)")
        added, special = {}, set()
        for t in tj.get("added_tokens", []):
            if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
                raise ValueError(f"tokenizer.json: added token {t['content']!r} uses "
                                 "lstrip/rstrip/single_word")
            added[t["content"]] = t["id"]
            if t.get("special"):
                special.add(t["content"])
        eos = None
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            tc = read_json(cfg_path, "tokenizer config")
            eos = tc.get("eos_token") if isinstance(tc, dict) else None
            eos = eos.get("content") if isinstance(eos, dict) else eos
        return cls(model["vocab"], model.get("merges", []), added, steps[0]["pattern"]["Regex"], eos,
                   special, nfc=norm == "NFC", ignore_merges=bool(model.get("ignore_merges")))

    def encode(self, text, allow_special=True, add_special_tokens=True):
        """Text -> ids. Added tokens in the text become single ids (with allow_special=False only the
        non-special ones, e.g. <think>, as HF does with encode_special_tokens=True). add_special_tokens:
        transformers' argument, accepted; Qwen's tokenizer adds no BOS/EOS either way."""
        allowed = self._nonspecial | self._special if allow_special else self._nonspecial
        if self.nfc and not unicodedata.is_normalized("NFC", text):
            # HF matches the added tokens in the text as written and normalizes only the text between them
            # ("<|im_end|>" + U+0338 would otherwise become "<|im_end|" + U+226F)
            pieces = self._added_re(frozenset(allowed)).split(text) if allowed else [text]
            ids = []
            for i, piece in enumerate(pieces):  # odd i: an added token
                if i % 2:
                    ids.append(self._enc.encode_single_token(piece.encode("utf-8")))
                elif piece:
                    ids += self._enc.encode_ordinary(unicodedata.normalize("NFC", piece))
        else:
            ids = self._enc.encode(text, allowed_special=allowed, disallowed_special=())
        return ids if self._rank_to_id is None else [self._rank_to_id[r] for r in ids]

    @functools.lru_cache(maxsize=4)  # noqa: B019 (two sets a tokenizer, the tokenizer lives as long as its LLM)
    def _added_re(self, allowed):
        """A regex whose split() gives [text, added token, text, ...]: the leftmost, longest one first, as HF."""
        return re.compile("(" + "|".join(re.escape(t) for t in sorted(allowed, key=len, reverse=True)) + ")")

    def token_bytes(self, i):
        return self._bytes[i] if 0 <= i < self.vocab_size else b""

    def decode_bytes(self, ids, skip_special=False):
        ids = ids.tolist() if hasattr(ids, "tolist") else ids  # torch/numpy ids too
        ids = [ids] if isinstance(ids, int) else ids
        skip = self._special_id_set if skip_special else ()
        return b"".join(self.token_bytes(i) for i in ids if i not in skip)

    def decode(self, ids, skip_special=False, skip_special_tokens=None):  # the latter: transformers' name
        skip = skip_special if skip_special_tokens is None else skip_special_tokens
        return self.decode_bytes(ids, skip).decode("utf-8", errors="replace")

    def apply_chat_template(self, conversation, tools=None, add_generation_prompt=False, tokenize=True,
                            **kwargs):
        """transformers' apply_chat_template, which vLLM users call on llm.get_tokenizer(): the chat through
        the checkpoint's template (LLM sets `template`; else the built-in one), kwargs to the template
        (enable_thinking=False, ...). -> the prompt's ids, or its text with tokenize=False."""
        text = (self.template or ChatTemplate()).render(conversation, tools, add_generation_prompt, **kwargs)
        return self.encode(text) if tokenize else text

    # -- what vLLM users call on llm.get_tokenizer() (a transformers tokenizer there): the same answers --
    # transformers' tokenizer(...) arguments at the values that change nothing here (others are refused)
    _CALL_DEFAULTS = {"padding": (False, "do_not_pad"), "truncation": (False, None, "do_not_truncate"),
                      "max_length": (None,), "return_tensors": (None,), "return_attention_mask": (None, True),
                      "return_token_type_ids": (None, False)}

    def __call__(self, text, add_special_tokens=True, split_special_tokens=False, **kwargs):
        """transformers' tokenizer(text): {"input_ids", "attention_mask"} of a string or of a list of them.
        split_special_tokens=True: special tokens' text is plain text (encode's allow_special=False)."""
        for k, v in kwargs.items():
            if k not in self._CALL_DEFAULTS or v not in self._CALL_DEFAULTS[k]:
                raise TypeError(f"tokenizer(..., {k}={v!r}): not supported by specdec's tokenizer (it takes "
                                "text or a list of texts, add_special_tokens and split_special_tokens)")
        enc = functools.partial(self.encode, allow_special=not split_special_tokens)
        ids = [enc(t) for t in text] if isinstance(text, (list, tuple)) else enc(text)
        mask = [[1] * len(i) for i in ids] if isinstance(text, (list, tuple)) else [1] * len(ids)
        return {"input_ids": ids, "attention_mask": mask}

    def __len__(self):
        return self.vocab_size

    @property
    def eos_token(self):
        return None if self.eos_token_id is None else self.convert_ids_to_tokens(self.eos_token_id)

    def batch_decode(self, sequences, skip_special_tokens=False, **kwargs):
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def get_vocab(self):
        """Token (byte-level form, or an added token's text) -> id, as transformers' get_vocab."""
        return {**self._vocab, **self.special_ids}

    def convert_ids_to_tokens(self, ids):
        names = getattr(self, "_names", None)
        if names is None:
            names = self._names = {i: t for t, i in self.get_vocab().items()}
        return names.get(ids) if isinstance(ids, int) else [names.get(i) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        vocab = self.get_vocab()
        return vocab.get(tokens) if isinstance(tokens, str) else [vocab.get(t) for t in tokens]

    def id_of(self, token):
        """Id of an added token ("<|im_end|>"), a vocab token in byte-level form ("Ġthe"), or a plain
        text that is exactly one token (" the")."""
        if token in self.special_ids:
            return self.special_ids[token]
        if token in self._vocab:
            return self._vocab[token]
        try:
            r = self._enc.encode_single_token(token.encode("utf-8"))
        except KeyError:
            raise KeyError(f"{token!r} is not a single token") from None
        return r if self._rank_to_id is None else self._rank_to_id[r]


class IncrementalDecoder:
    """Streams text out of token ids as vLLM's detokenizer does (tokenizers' DecodeStream): the bytes since the
    last release are held while their text ends in U+FFFD (a character split over tokens comes out whole, and
    the text of the same tokens before it waits with it) and released whole once it does not; what is held when
    the request ends is never released. prompt: the prompt's ids, run through first with their text dropped,
    so an output that completes the prompt's last, unfinished character starts with that character (vLLM primes
    its stream with the prompt's last tokens)."""

    def __init__(self, tokenizer, skip_special=False, prompt=()):
        self.tok = tokenizer
        self.skip_special = skip_special
        self._held = b""
        self.text = ""
        for i in list(prompt)[-8:]:  # 8 tokens hold at least one whole character (at most 4 bytes)
            self.add([i])
        self.text = ""  # everything emitted so far, for the caller's stop-string checks

    def add(self, ids):
        held = self._held + self.tok.decode_bytes(ids, self.skip_special)
        new = held.decode("utf-8", errors="replace")
        if new.endswith("\ufffd"):  # an unfinished character (or a U+FFFD itself: DecodeStream waits too)
            self._held, new = held, ""
        else:
            self._held = b""
        self.text += new
        return new


# -- Chat templates ---------------------------------------------------------------------------
# A chat becomes a prompt through the checkpoint's own Jinja template (chat_template.jinja, `chat_template` in
# tokenizer_config.json, or the GGUF's tokenizer.chat_template), rendered as transformers and vLLM render it:
# a sandboxed environment (no Python internals reachable from a template) with transformers' globals and
# filters. apply_chat_template, the published Qwen3.6 template written in Python, is the fallback for a
# checkpoint that ships none (the toy models).

def _content_text(content):
    # message content: a string, None, or a list of {"type": "text", "text": ...} parts
    if content is None or isinstance(content, str):
        return content or ""
    if any("text" not in part for part in content):
        raise ValueError("only text content parts are supported (no images, video or audio)")
    return "".join(part["text"] for part in content)


# The system turn the Qwen3.6 template writes when tools are given: the tools' JSON between these two
QWEN_TOOLS_HEAD = "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
QWEN_TOOLS_TAIL = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\n"
    "multiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls "
    "MUST follow the specified format: an inner <function=...></function> block must be nested within "
    "<tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional "
    "reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If "
    "there is no function call available, answer the question like normal with your current knowledge and do "
    "not tell the user about function calls\n</IMPORTANT>")


def _qwen_tool_calls(calls, content):
    """An assistant turn's tool calls in the Qwen3.6 XML form (arguments: strings as they are, else JSON)."""
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function", call)
        sep = ("\n\n" if content.strip() else "") if i == 0 else "\n"
        out.append(f"{sep}<tool_call>\n<function={fn['name']}>\n")
        for name, value in (fn.get("arguments") or {}).items():
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            out.append(f"<parameter={name}>\n{text}\n</parameter>\n")
        out.append("</function>\n</tool_call>")
    return "".join(out)


def apply_chat_template(messages, add_generation_prompt=True, enable_thinking=True, preserve_thinking=False,
                        tools=None):
    """Qwen3.5/3.6 chat prompt (ChatML, thinking, tools), as the published chat_template.jinja renders a
    text-only chat whose messages went through chat_messages (tool call arguments are objects)."""
    if not messages:
        raise ValueError("No messages provided.")
    texts = [_content_text(m.get("content")).strip() for m in messages]
    # the last real user query (not a tool response): assistant turns after it keep their reasoning
    tool_result = lambda t: t.startswith("<tool_response>") and t.endswith("</tool_response>")  # noqa: E731
    is_query = [m["role"] == "user" and not tool_result(t) for m, t in zip(messages, texts)]
    last_query = max((i for i, q in enumerate(is_query) if q), default=None)
    if last_query is None:
        raise ValueError("no user query found in messages")
    system = texts[0] if messages[0]["role"] == "system" else None
    out = []
    if tools:
        listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        system_text = f"\n\n{system}" if system else ""
        out.append(QWEN_TOOLS_HEAD + listed + QWEN_TOOLS_TAIL + system_text + "<|im_end|>\n")
    elif system is not None:
        out.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    for i, (m, text) in enumerate(zip(messages, texts)):
        role = m["role"]
        if role == "system":
            if i > 0:
                raise ValueError("a system message must be the first message")
        elif role == "user":
            out.append(f"<|im_start|>user\n{text}<|im_end|>\n")
        elif role == "assistant":
            reasoning = m.get("reasoning_content")
            if not isinstance(reasoning, str):
                reasoning = ""
                if "</think>" in text:  # reasoning written inline as <think>...</think>
                    reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                    text = text.split("</think>")[-1].lstrip("\n")
            keep = preserve_thinking or i > last_query
            think = f"<think>\n{reasoning.strip()}\n</think>\n\n" if keep else ""
            calls = _qwen_tool_calls(m.get("tool_calls") or [], text)
            out.append(f"<|im_start|>assistant\n{think}{text}{calls}<|im_end|>\n")
        elif role == "tool":  # consecutive tool results share one user turn
            first = i > 0 and messages[i - 1]["role"] != "tool"
            last = i + 1 == len(messages) or messages[i + 1]["role"] != "tool"
            out.append(("<|im_start|>user" if first else "") + f"\n<tool_response>\n{text}\n</tool_response>"
                       + ("<|im_end|>\n" if last else ""))
        else:
            raise ValueError(f"unexpected message role {role!r}")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n<think>\n" + ("" if enable_thinking else "\n</think>\n\n"))
    return "".join(out)


def _tool_call_object(call):
    """A history tool call with its `arguments` (JSON text on the wire) as the object templates iterate."""
    call = dict(call)
    fn = call["function"] = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError) as e:  # RecursionError: JSON nested ~1000 deep
            raise ValueError(f"tool call arguments are not valid JSON ({e}): {args[:40]!r}") from None
    if not isinstance(args if args is not None else {}, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {json.dumps(args)[:40]}")
    fn["arguments"] = args or {}
    return call


def chat_messages(messages, developer_as_system=True):
    """Messages as templates read them, prepared as vLLM and transformers prepare them: keys whose value is
    None dropped, a tool call's `arguments` parsed to an object, the reasoning under `reasoning_content` (also
    taken from `reasoning`, vLLM's newer name), and OpenAI's `developer` role as `system` for a template that
    does not know it."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("role") == "developer" and developer_as_system:
            m["role"] = "system"
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        if m.get("tool_calls"):
            m["tool_calls"] = [_tool_call_object(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: plain json.dumps (Jinja's own escapes HTML characters), with its options
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """`dict` in a template: builds dicts, and exposes nothing of the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses attribute names starting with "_" (a way towards Python internals)."""

    def __init__(*args, **kwargs):  # jinja2's signature: `self` may be an attribute name too
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _GenerationBlock(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} (marks the assistant's tokens for training): rendered as is."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


@functools.lru_cache(maxsize=1)
def _jinja_env():
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, namespace=_Namespace, dict=_TemplateDict(),
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env


class ChatTemplate:
    """How a chat becomes a prompt: a Jinja template (`source`) rendered with the tokenizer's special tokens
    (bos_token, eos_token, ...) as variables, or, with no source, the built-in apply_chat_template."""
    SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")
    # set by render itself, not by chat_template_kwargs
    RESERVED = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message")

    def __init__(self, source=None, special_tokens=None, origin="the built-in Qwen3.6 template"):
        self.source, self.origin = source, origin
        self.special_tokens = dict(special_tokens or {})
        try:
            self.template = None if source is None else _jinja_env().from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ConfigError(f"chat template from {origin} does not compile: {e}") from None
        self.knows_developer = source is not None and "developer" in source

    @classmethod
    def from_checkpoint(cls, path, tokenizer=None):
        """The template a checkpoint ships: chat_template.jinja, else tokenizer_config.json's `chat_template`
        (a string, or a list of named templates: "default"), else a GGUF's; else the built-in one."""
        if str(path).endswith(".gguf"):
            eos = getattr(tokenizer, "eos_token_id", None)
            special = {} if eos is None else {"eos_token": tokenizer.decode([eos])}
            source = getattr(tokenizer, "chat_template", None)
            return cls(source, special, f"{path} (tokenizer.chat_template)") if source else cls(None, special)
        cfg = {}
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            cfg = read_json(cfg_path, "tokenizer config")
            cfg = cfg if isinstance(cfg, dict) else {}
        special = {k: v.get("content") if isinstance(v, dict) else v
                   for k in cls.SPECIAL_TOKENS if (v := cfg.get(k)) is not None}
        jinja_path = os.path.join(path, "chat_template.jinja")
        source = cfg.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}]: the one named "default"
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                return cls(f.read(), special, jinja_path)
        if isinstance(source, str):
            return cls(source, special, f"{cfg_path} (chat_template)")
        return cls(None, special)

    @classmethod
    def from_arg(cls, value, special_tokens=None):
        """--chat-template, as vLLM takes it: a file's path, or the template itself in one line."""
        if os.path.isfile(value):
            with open(value, encoding="utf-8") as f:
                return cls(f.read(), special_tokens, value)
        if "{" not in value:
            raise ConfigError(f"--chat-template {value!r}: no such file (give a template file's path, or the "
                              "template itself)")
        return cls(value, special_tokens, "--chat-template")

    def render(self, messages, tools=None, add_generation_prompt=True, continue_final_message=False, **kwargs):
        """The prompt text. kwargs: the chat_template_kwargs (enable_thinking, preserve_thinking, ...). A
        template's own refusal (raise_exception) or failure is a ValueError with its message.
        continue_final_message (vLLM's, from transformers): the chat rendered whole and cut just after the last
        message's text, so that the model goes on with that message (an answer the caller began) instead of
        closing it (_mark_final_message); it cannot be combined with add_generation_prompt."""
        clash = [k for k in self.RESERVED if k in kwargs]
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        messages = chat_messages(messages, developer_as_system=not self.knows_developer)
        if continue_final_message:
            final, messages[-1] = messages[-1], _mark_final_message(messages[-1])
        if self.template is None:
            thinking = kwargs.get("enable_thinking") is not False  # the template's "is false" / "is true"
            text = apply_chat_template(messages, add_generation_prompt, thinking,
                                       kwargs.get("preserve_thinking") is True, tools)
        else:
            try:
                text = self.template.render(messages=messages, tools=tools, documents=None,
                                            add_generation_prompt=add_generation_prompt,
                                            **{**self.special_tokens, **kwargs})
            except jinja2.exceptions.TemplateError as e:  # raise_exception(...), an undefined name, the sandbox
                raise ValueError(f"chat template: {e}") from None
            except Exception as e:  # the template is the checkpoint's code: whatever it raises is about this chat
                raise ValueError(f"chat template: {type(e).__name__}: {e}") from None
        return _cut_at_mark(text, final) if continue_final_message else text


# continue_final_message's mark: put after the last message's text before rendering, the rendering cut where it
# lands (as transformers 5 does), so that text the template writes after the message (its end of turn, the
# message's tool calls) is never taken for the message's own, whatever the text is; the trailing space tells
# whether the template trims the message (then its trailing whitespace goes too)
FINAL_MARK = "SPECDEC_CONTINUE_FINAL_MESSAGE "


def _mark_final_message(message):
    """The last message (a copy) with FINAL_MARK after its text (a string, or its last text part)."""
    content = message.get("content")
    if isinstance(content, list):
        at = next((i for i in reversed(range(len(content))) if isinstance(content[i], dict)
                   and isinstance(content[i].get("text"), str)), None)
        if at is not None:
            content = [*content[:at], {**content[at], "text": content[at]["text"] + FINAL_MARK}, *content[at + 1:]]
            return {**message, "content": content}
    elif isinstance(content, str):
        return {**message, "content": content + FINAL_MARK}
    raise ValueError("continue_final_message is set but the final message has no text to continue")


def _cut_at_mark(text, final):
    """The rendered chat up to FINAL_MARK (its last occurrence; trailing whitespace dropped too where the
    template trimmed the mark's own). final: the message as given, whose text must be in the render whole
    (transformers' check: a template that reworded it, e.g. moved inline reasoning out of it, is refused)."""
    missing = ValueError("continue_final_message is set but the final message does not appear in the chat "
                         "after applying the chat template")
    at, trimmed = text.rfind(FINAL_MARK), text.rfind(FINAL_MARK.rstrip())
    if at >= 0:
        text = text[:at]
    elif trimmed >= 0:
        text = text[:trimmed].rstrip()
    else:
        raise missing
    content = final.get("content")
    if isinstance(content, list):  # its last text part, as _mark_final_message marked
        content = next(p["text"] for p in reversed(content) if isinstance(p, dict) and isinstance(p.get("text"), str))
    if content.strip() not in text:
        raise missing
    return text


# ==============================================================================================
# Loading: safetensors (sharded, multimodal names, fused or per-expert MoE) and GGUF
# ==============================================================================================

def checkpoint_tensors(path):
    """{tensor name: path of the file holding it} for a directory of model.safetensors or sharded
    model-*.safetensors (with or without model.safetensors.index.json). A tensor in two files, an index entry
    whose file lacks it or lies outside the directory, and a file that is not safetensors are ConfigErrors."""
    from safetensors import safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    mapped = None
    if os.path.isfile(index):
        top = read_json(index, "index")
        mapped = top.get("weight_map") if isinstance(top, dict) else None
        if not isinstance(mapped, dict) or not all(isinstance(f, str) for f in mapped.values()):
            raise ConfigError(f"{index}: no weight_map of tensor names to file names")
        outside = next((f for f in mapped.values() if os.path.isabs(f) or ".." in f.split("/")), None)
        if outside is not None:
            raise ConfigError(f"{index}: shard {outside!r} is outside the checkpoint directory")
        files = sorted(set(mapped.values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"{path}: no model.safetensors, model-*.safetensors or "
                          "model.safetensors.index.json found")
    out = {}
    for f in files:
        full = os.path.join(path, f)
        if not os.path.isfile(full):
            listed = "listed in the index " if mapped is not None else ""
            raise ConfigError(f"{path}: shard {f} {listed}is missing (or not a file)")
        try:
            with safe_open(full, "pt") as st:
                names = list(st.keys())
        except Exception as e:  # safetensors' own error: truncated, not safetensors, a bad header
            raise ConfigError(f"{full}: not a readable safetensors file ({e})") from None
        for name in names:
            if name in out:
                raise ConfigError(f"{path}: tensor {name} is in both {os.path.basename(out[name])} and {f}")
            out[name] = full
    for name, f in (mapped or {}).items():
        if out.get(name) != os.path.join(path, f):
            raise ConfigError(f"{index}: tensor {name} is mapped to {f}, which does not hold it")
    return out


def checkpoint_sources(files, rename=lambda n: n):
    """{our parameter name: (checkpoint name, read() -> tensor)} from {checkpoint name: safetensors file};
    rename maps a checkpoint name to ours (None: skipped). Each file opens once; tensors are read on use."""
    from safetensors import safe_open
    handles = {}

    def read(name):
        f = files[name]
        if f not in handles:
            handles[f] = safe_open(f, "pt")
        return handles[f].get_tensor(name)
    return {m: (n, functools.partial(read, n)) for n in files if (m := rename(n)) is not None}


def load_weights(module, sources, dtype, device, where):
    """The one loader: fill a module built on the meta device from sources {our parameter name: (checkpoint
    name, read())}. Every parameter must be found with its shape and every source used, else a ConfigError
    names the tensor. Floating tensors become `dtype` (the GDN decay A_log and FP8 block scales become fp32,
    FP8 weights stay float8_e4m3fn; integer ones such as d2t keep theirs; an integer or bool tensor where a
    floating one belongs, or the other way round, is refused); RoPE frequencies are computed on the device."""
    want = dict(module.named_parameters())
    for m in sources:
        if m not in want:
            raise ConfigError(f"unexpected tensor {m!r} in {where}")
    for m in want:
        if m not in sources:
            raise ConfigError(f"missing tensor {m!r} in {where}")
    bar = None
    if len(want) > 200:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(want), desc="loading weights", unit="tensor", file=sys.stderr)
        except ImportError:
            pass
    for m, p in want.items():
        name, read = sources[m]
        t = read()
        if tuple(t.shape) != tuple(p.shape):
            raise ConfigError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)} "
                              f"({where})")
        # an int / bool tensor where a weight goes was cast silently by fuse_projections' torch.cat, or failed deep
        # inside a matmul; a float d2t cannot index
        if t.is_floating_point() != p.is_floating_point():
            raise ConfigError(f"tensor {name!r} is {t.dtype}, expected " + ("a floating-point weight" if
                              p.is_floating_point() else f"{p.dtype} (integer ids)") + f" ({where})")
        if (t.dtype == FP8) != (p.dtype == FP8):  # declare_fp8 made p FP8 where the scales are
            raise ConfigError(f"tensor {name!r} is {t.dtype} " + ("without block scales (no _scale_inv "
                              "beside it)" if t.dtype == FP8 else "but has block scales: FP8 weights are "
                              "torch.float8_e4m3fn") + f" ({where})")
        keep = (FP8 if p.dtype == FP8 else torch.float32 if m.endswith(("A_log", "_scale_inv"))
                else dtype if t.is_floating_point() else t.dtype)
        mod, _, leaf = m.rpartition(".")
        module.get_submodule(mod)._parameters[leaf] = nn.Parameter(t.to(device=device, dtype=keep),
                                                                    requires_grad=False)
        if bar:
            bar.update()
    if bar:
        bar.close()
    return init_rope(module, device).eval()


SKIP_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")  # the vision tower


def internal_name(name, where):
    """The target's name table: checkpoint name -> our parameter name (None: skipped by a named rule)."""
    if name.startswith(SKIP_PREFIXES):
        return None
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    if name.startswith(("lm_head.", "mtp.")):
        return name
    raise ConfigError(f"unexpected tensor {name!r} in {where} (not a Qwen3.5/3.6 text-decoder weight)")


def stack_experts(sources, num_experts, where):
    """Per-expert MoE tensors (experts.{e}.{gate,up,down}_proj.weight) become sources of the fused layout:
    gate_up_proj [E, 2I, H] (gate rows, then up) and down_proj [E, H, I]. FP8 checkpoints: their
    weight_scale_inv likewise, gate_up_proj_scale_inv [E, 2 ceil(I/128), ceil(H/128)] (gate's blocks, then
    up's: K.moe_experts' layout for any I) and down_proj_scale_inv [E, ceil(H/128), ceil(I/128)]."""
    parts = {}
    for m in list(sources):
        hit = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight(_scale_inv)?", m)
        if hit:
            parts.setdefault((hit[1], hit[4] or ""), {})[(int(hit[2]), hit[3])] = sources.pop(m)[1]
    E = num_experts
    for (prefix, scale), p in parts.items():
        missing = [f"{prefix}.{e}.{w}_proj.weight{scale}" for e in range(E) for w in ("gate", "up", "down")
                   if (e, w) not in p]
        if missing:
            raise ConfigError(f"missing tensor {missing[0]!r} in {where}")

        def gate_up(p=p):
            return torch.stack([torch.cat([p[(e, "gate")](), p[(e, "up")]()], 0) for e in range(E)])

        def down(p=p):
            return torch.stack([p[(e, "down")]() for e in range(E)])
        for name, read in ((f"{prefix}.gate_up_proj{scale}", gate_up), (f"{prefix}.down_proj{scale}", down)):
            sources[name] = (name, read)
    return sources


# -- Block-FP8 weights: Qwen's FP8 checkpoints as they are, or --quantization fp8 at load ---------------
# A weight P in FP8 is float8_e4m3fn with a parameter P_scale_inv beside it (fp32): a Linear's weight and
# weight_scale_inv, the routed experts' gate_up_proj / down_proj and their *_scale_inv (stack_experts). Qwen's
# files keep embed_tokens, lm_head, the norms, GDN's conv1d, A_log, dt_bias, in_proj_a and in_proj_b (48 or 32
# rows: less than a block), the router mlp.gate, shared_expert_gate and mtp.fc unquantized; --quantization fp8
# quantizes what they quantize (FP8_WEIGHTS). The KV caches and GDN states stay in the model dtype.

FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj",
               "up_proj", "down_proj")
FP8_WEIGHTS = tuple(f".{n}.weight" for n in FP8_LINEARS) + (".experts.gate_up_proj", ".experts.down_proj")
QUANTIZATIONS = ("fp8",)  # --quantization (vLLM's flag); none: the checkpoint's own


def quantize_weight(name, w):
    """K.fp8_quantize(w) -> (e4m3 weight, fp32 block scales); the experts' gate_up_proj [E, 2I, H] by halves,
    so that its scales are gate's blocks, then up's (K.moe_experts' layout, for any I)."""
    if not name.endswith("gate_up_proj"):
        return K.fp8_quantize(w)
    (qg, sg), (qu, su) = (K.fp8_quantize(h) for h in w.chunk(2, -2))
    return torch.cat([qg, qu], -2), torch.cat([sg, su], -2)


def quantized_sources(sources, device, not_convert=()):
    """--quantization fp8 at load: each FP8_WEIGHTS source is read, moved to the device and quantized there
    when the loader comes to it (one weight at a time: the unquantized model is never whole in memory); its
    scale becomes the source of <name>_scale_inv. Modules in not_convert (a config's modules_to_not_convert)
    stay unquantized."""
    for m in [m for m in sources if m.endswith(FP8_WEIGHTS) and m.rpartition(".")[0] not in not_convert]:
        name, read = sources[m]
        q = functools.cache(lambda m=m, read=read: quantize_weight(m, read().to(device)))
        sources[m] = (name, lambda q=q: q()[0])
        sources[m + "_scale_inv"] = (name + "_scale_inv", lambda q=q: q()[1])
    return sources


def declare_fp8(model, sources, not_convert, where):
    """Before loading, on the meta model: each weight P whose P_scale_inv is among the sources, where its
    module has room for one (a Linear, the routed experts), becomes float8_e4m3fn with an fp32 P_scale_inv
    [..., ceil(N/128), ceil(K/128)] (gate_up_proj: 2 ceil(I/128) rows, gate's then up's). The scales decide;
    a module that the checkpoint's modules_to_not_convert lists must have none, and an FP8_WEIGHTS one that it
    does not list must have them (as in vLLM's fp8 loader: a bf16 checkpoint whose config says FP8 is refused,
    not run as bf16). Its entries name whole modules (model.language_model.layers.0.mlp.gate; ModelConfig keeps
    our names, layers.0.mlp.gate): a substring match lets the router `mlp.gate` swallow `mlp.gate_proj`, whose
    scales are then lost."""
    B = K.FP8_BLOCK
    for name, p in list(model.named_parameters()):
        mod, _, leaf = name.rpartition(".")
        m = model.get_submodule(mod)
        if name.endswith(FP8_WEIGHTS) and mod not in not_convert and name in sources \
                and name + "_scale_inv" not in sources:
            ckpt, read = sources[name]  # (read for its dtype: one tensor, on the way out)
            raise ConfigError(f"{where}: tensor {ckpt!r} is {read().dtype} without block scales (no "
                              f"{ckpt}_scale_inv beside it), but the config's quantization_config is FP8 and "
                              f"modules_to_not_convert does not list {mod!r}")
        if name + "_scale_inv" not in sources or leaf + "_scale_inv" not in m._parameters:
            continue
        if mod in not_convert:
            raise ConfigError(f"{where}: {mod!r} is listed in modules_to_not_convert, but the checkpoint has "
                              f"FP8 scales for it ({sources[name + '_scale_inv'][0]!r})")
        *lead, N, Kd = p.shape
        rows = 2 * -(-N // 2 // B) if leaf == "gate_up_proj" else -(-N // B)
        weight = torch.empty(p.shape, dtype=FP8, device="meta")
        scale = torch.empty(*lead, rows, -(-Kd // B), device="meta")                # fp32
        m._parameters[leaf] = nn.Parameter(weight, requires_grad=False)
        m._parameters[leaf + "_scale_inv"] = nn.Parameter(scale, requires_grad=False)
    return model


LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")  # vLLM's --load-format values that specdec reads


def dummy_sources(cfg, dtype, device, seed=0):
    """vLLM's --load-format dummy: random weights for every parameter of the model of cfg, made on the device
    when the loader reads them, in its order from one seeded generator: N(0, 0.02) matrices, zero norms (they
    are zero-centred: weight 1 + w), ones for the GDN gated norm and dt_bias, A_log uniform in [0, 2.7] (fp32).
    Benchmarks run the real shapes with them; the text they produce is noise."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def make(name, shape):
        if name.endswith("A_log"):
            return torch.empty(shape, device=device).uniform_(0, 2.7, generator=gen)
        if name.endswith(("dt_bias", "linear_attn.norm.weight")):
            return torch.ones(shape, device=device, dtype=dtype)
        if "norm" in name:
            return torch.zeros(shape, device=device, dtype=dtype)
        return torch.empty(shape, device=device, dtype=dtype).normal_(0, 0.02, generator=gen)
    with torch.device("meta"):
        params = Qwen36(cfg).named_parameters()
    return {m: (m, functools.partial(make, m, tuple(p.shape))) for m, p in params}


def build_model(cfg, sources, dtype, device, where, quantize=False):
    """The model of cfg, filled from sources {checkpoint or our name: (name, read())} by the one loader:
    per-expert tensors stacked, the sources quantized to block-FP8 as they are read (quantize: --quantization
    fp8, or dummy weights for an FP8 config), FP8 declared where the scales are, projections fused."""
    with torch.device("meta"):
        model = Qwen36(cfg, with_mtp=any(m.startswith("mtp.") for m in sources))
    sources = stack_experts(sources, cfg.num_experts, where)
    if quantize:
        sources = quantized_sources(sources, device, cfg.modules_to_not_convert)
    if quantize or cfg.quantization == "fp8":
        declare_fp8(model, sources, cfg.modules_to_not_convert, where)
    model = fuse_projections(load_weights(model, sources, dtype, device, where))
    if quantize and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # free the unquantized weights' blocks: memory_budget counts what is held
    return model


def fp8_head(model, rows=16384):
    """The model's lm_head (or tied embeddings) quantized block-wise for the drafts of an FP8 target
    (Qwen36.draft_head, draft_logits), rows at a time (whole blocks, the same result): 248320 x 5120 in fp32 at
    once would be 5 GB. Made by LLM when the drafts go through the target's lm_head
    (drafts_through_target_head), before the memory budget (which counts it)."""
    w = (model.embed_tokens if model.lm_head is None else model.lm_head).weight
    parts = [K.fp8_quantize(w[i:i + rows]) for i in range(0, w.shape[0], rows)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def add_draft_head(model, quantization, wanted):
    """Give an FP8 target (quantized at load, quantization "fp8", or an FP8 checkpoint) the FP8 copy of its
    lm_head for the drafts (fp8_head -> Qwen36.draft_head, read by draft_logits) when wanted: when its drafts
    go through the target's lm_head (drafts_through_target_head). A bf16 target keeps none. LLM and bench.py
    decide it here."""
    if wanted and "fp8" in (quantization, model.cfg.quantization):
        model.draft_head = fp8_head(model)


def drafts_through_target_head(spec):
    """Whether spec's drafts are picked from the target's lm_head (Qwen36.draft_logits): MTP's always, a DFlash /
    DSpark drafter's unless its checkpoint ships an lm_head of its own (spec.model: a checkpoint directory, as
    drafter_bytes has checked)."""
    if spec is None or spec.method not in ("mtp", "dflash", "dspark"):
        return False
    return spec.method == "mtp" or spec.model is None or "lm_head.weight" not in checkpoint_tensors(spec.model)


def load_model(path, dtype, device, want_mtp=False, quantization=None, load_format="auto", tokenizer=None):
    """Build the model from a checkpoint directory or .gguf file -> (model, ModelConfig, Tokenizer).
    quantization "fp8": block-FP8 weights quantized at load (an FP8 checkpoint loads as FP8 without it).
    load_format (vLLM's --load-format): auto (the path decides), safetensors, gguf, or dummy (the directory's
    config.json with random weights: dummy_sources). tokenizer: a directory with tokenizer.json to use instead
    of the model's (vLLM's --tokenizer)."""
    gguf = str(path).endswith(".gguf")
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format {load_format!r} (--load-format) is not supported; specdec reads "
                          f"{', '.join(LOAD_FORMATS)}")
    if gguf != (load_format == "gguf") and load_format != "auto":
        raise ConfigError(f"--load-format {load_format} needs " + ("a .gguf file" if load_format == "gguf" else
                          "a model directory with a config.json") + f", got {path}")
    if gguf:
        cfg, tensors, tok = read_gguf_model(path, dtype)
        sources = {internal_name(n, path): (n, functools.partial(tensors.__getitem__, n)) for n in tensors}
    else:
        cfg = ModelConfig.from_hf(path)
        tok = None
        sources = dummy_sources(cfg, dtype, device) if load_format == "dummy" else \
            checkpoint_sources(checkpoint_tensors(path), lambda n: internal_name(n, path))
    if tokenizer is not None or tok is None:
        where = tokenizer or path
        if not os.path.isfile(os.path.join(where, "tokenizer.json")):
            raise ConfigError(f"{where}: no tokenizer.json" + ("" if tokenizer else " (a --load-format dummy "
                              "directory needs one, or --tokenizer naming a directory that has one)"))
        tok = Tokenizer.from_dir(where)
    has_mtp = any(m.startswith("mtp.") for m in sources)
    if want_mtp and not has_mtp and gguf:
        raise ConfigError(f"{path}: {GGUF_NO_MTP_MESSAGE}")
    if want_mtp and not has_mtp:
        raise ConfigError(f"{path}: method 'mtp' needs the checkpoint's MTP head, but it has no mtp.* "
                          "tensors (the MTP head is missing)")
    if want_mtp and cfg.mtp_num_hidden_layers == 0:
        raise ConfigError(f"{path}: method 'mtp' needs the checkpoint's MTP head, but its config says "
                          "mtp_num_hidden_layers 0")
    if not has_mtp or cfg.mtp_num_hidden_layers == 0:
        sources = {m: s for m, s in sources.items() if not m.startswith("mtp.")}
    fp8 = quantization == "fp8" or cfg.quantization == "fp8"
    quantize = fp8 and (cfg.quantization is None or load_format == "dummy")  # else the checkpoint's own FP8
    return build_model(cfg, sources, dtype, device, path, quantize), cfg, tok


# ==============================================================================================
# GGUF loading (llama.cpp qwen35 / qwen35moe files)
# ==============================================================================================
# llama.cpp GGUF files (arch `qwen35` / `qwen35moe`) <-> HF text-only names and layouts. read_gguf undoes
# every transform of llama.cpp's converter (conversion/qwen.py: Qwen3_5TextModel / Qwen3_5MoeTextModel), so
# its tensors go into the same loader as safetensors; the tests' write_gguf applies them. ggml lists dims
# innermost first (`ne`); the gguf reader hands back numpy arrays in PyTorch order (reversed ne): 2-D [out,
# in], experts [E, I, H] (gate, up) and [E, H, I] (down), as HF stores them.

GGUF_NO_MTP_MESSAGE = (
    "this GGUF file has no MTP block (no blk.N.nextn.* tensors), so `method: mtp` cannot run on it. "
    "Re-export it with llama.cpp's convert_hf_to_gguf.py WITHOUT `--no-mtp`, from a Hugging Face checkpoint "
    "that has the mtp.* tensors (older converters drop them: use a recent llama.cpp), or pick another "
    "speculative method.")

_GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}  # no output.weight = tied embeddings
# blk.N.<key> -> model.layers.N.<value>; the MTP block's ordinary tensors -> mtp.layers.0.<value>
_GGUF_BLK = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log", "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",  # only with --fuse-gate-up-exps: cat([gate, up])
}  # the default ffn_gate_exps + ffn_up_exps [E, I, H] are re-fused into mlp.experts.gate_up_proj [E, 2I, H]
_GGUF_NEXTN = {"nextn.eh_proj.weight": "mtp.fc.weight",
               "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
               "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
               "nextn.shared_head_norm.weight": "mtp.norm.weight"}  # in block num_hidden_layers
_GGUF_SKIP = ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight")  # optional: the shared ones serve

_PRETOKENIZE = {  # split regex by tokenizer.ggml.pre (\p{..} needs the `regex` module)
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
              r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+"}


def _vhead_perm(t, dim, a, b, d):
    """View `dim` as [a, b, d] and swap a and b. HF grouped -> GGUF tiled value heads: a = H_k, b = R = H_v
    / H_k (head g*R + r moves to r*H_k + g, where ggml's broadcast repeat pairs it with key head g); GGUF ->
    HF: a = R, b = H_k."""
    dim, s = dim % t.ndim, list(t.shape)
    return t.reshape(s[:dim] + [a, b, d] + s[dim + 1:]).transpose(dim, dim + 1).reshape(s)


def _gdn_reorder(name, t, cfg, to_gguf):
    """The converter's V-head reorder (when H_k != H_v) or its inverse, on a tensor under its HF name."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if hk == hv or ".linear_attn." not in name:
        return t
    a, b = (hk, hv // hk) if to_gguf else (hv // hk, hk)
    dv, qk = cfg["linear_value_head_dim"], 2 * hk * cfg["linear_key_head_dim"]
    leaf = name.rsplit(".linear_attn.", 1)[1]
    if leaf in ("in_proj_qkv.weight", "conv1d.weight"):  # q, k rows (channels) stay; v rows are reordered
        return torch.cat([t[:qk], _vhead_perm(t[qk:], 0, a, b, dv)])
    if leaf in ("in_proj_z.weight", "out_proj.weight"):  # rows of z; columns of out_proj
        return _vhead_perm(t, 0 if leaf == "in_proj_z.weight" else 1, a, b, dv)
    if leaf in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
        return _vhead_perm(t, 0, a, b, 1)
    return t  # linear_attn.norm.weight [d_v] is shared by all heads


def _is_shifted_norm(name):
    """Zero-centred RMSNorm weights, stored by the converter as 1 + w (the GDN gated norm is not). The MTP
    pre-fc norms count: the converter tests `endswith("norm.weight")` after renaming them to enorm / hnorm."""
    gated = name.endswith("linear_attn.norm.weight")
    return name.endswith("norm.weight") and not gated or "pre_fc_norm_" in name


def _gguf_tensor(rt):
    """ReaderTensor -> torch, PyTorch order. F32 / F16 / BF16 stay views of the file mapping; quantised types
    (Q8_0, Q4_K, Q5_K, Q6_K, ...) are dequantised to fp32 by gguf.quants."""
    import gguf
    Q = gguf.GGMLQuantizationType
    # every qwen35 tensor is a float weight: one of an integer type is damage, refused as load_weights does, not cast
    if rt.tensor_type in (Q.I8, Q.I16, Q.I32, Q.I64):
        raise ValueError(f"tensor {rt.name} is stored as GGUF type {Q(rt.tensor_type).name}, an integer type; "
                         "expected a float (F32, F16, BF16) or quantized weight")
    try:
        if rt.tensor_type in (Q.F32, Q.F16, Q.F64):  # (F64: llama.cpp's writers allow it; cast to the dtype later)
            return torch.from_numpy(rt.data)
        if rt.tensor_type == Q.BF16:  # the reader gives raw bytes [..., 2n]
            return torch.from_numpy(rt.data.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(gguf.quants.dequantize(rt.data, rt.tensor_type))
    except NotImplementedError:  # a type gguf-py cannot dequantize (was its traceback)
        raise ValueError(f"tensor {rt.name} is stored as GGUF type {Q(rt.tensor_type).name}, which the installed gguf "
                         f"package ({importlib.metadata.version('gguf')}) cannot dequantize") from None
    except (ValueError, TypeError, IndexError) as e:  # numpy's words for a short or damaged file
        raise ValueError(f"tensor {rt.name}: its data cannot be read ({e}); is the file truncated?") from None


REQUIRED = object()  # read_gguf's marker of a metadata key that must be there


def _f32(x):  # GGUF floats are float32: give back the shortest repr (1e-06, not 9.99999997e-07)
    return float(str(np.float32(x)))


def read_gguf(path, dtype=torch.float32):
    """-> (text_config in HF form, {HF text-only name: tensor in `dtype`}, tokenizer dict) from a qwen35 /
    qwen35moe GGUF. The MTP block (blk.<num_hidden_layers>) comes back as mtp.*."""
    import gguf
    try:
        r = gguf.GGUFReader(path, "c")  # copy-on-write mmap: torch views need no copy of the file
    except (ValueError, KeyError, TypeError, IndexError, OSError) as e:  # a truncated file: numpy's words
        raise ValueError(f"not a readable GGUF file ({type(e).__name__}: {e})") from None
    meta = lambda key, default=None: r.fields[key].contents() if key in r.fields else default  # noqa: E731
    arch = meta("general.architecture")
    if arch not in ("qwen35", "qwen35moe"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} (specdec reads 'qwen35' and 'qwen35moe')")
    byname = {t.name: t for t in r.tensors}

    def k(key, default=REQUIRED):  # a key of the architecture; without a default it must be there
        v = meta(f"{arch}.{key}", None if default is REQUIRED else default)
        if v is None and default is REQUIRED:
            raise ValueError(f"the GGUF metadata has no {arch}.{key}")
        return v
    cfg = _gguf_config(k, meta, arch, byname)
    return cfg, _gguf_tensors(byname, cfg, dtype, path), _gguf_tokenizer(meta)


def _gguf_config(k, meta, arch, byname):
    """The text_config from the file's metadata (k: a key of the architecture) and tensor names."""
    nextn = k("nextn_predict_layers", 0)
    if not all(isinstance(v, int) for v in (nextn, k("block_count"), k("attention.key_length"),
                                           k("ssm.time_step_rank"), k("ssm.inner_size"),
                                           k("rope.dimension_count"))):
        raise ValueError("the GGUF metadata's layer counts and sizes must be integers")
    n = k("block_count") - nextn  # block_count includes the MTP layers
    hd = k("attention.key_length")
    hv = k("ssm.time_step_rank")
    rope = dict(rope_type="default", rope_theta=_f32(k("rope.freq_base")),
                partial_rotary_factor=k("rope.dimension_count") / hd,
                mrope_section=list(k("rope.dimension_sections", [11, 11, 10, 0]))[:3], mrope_interleaved=True)
    cfg = dict(
        model_type="qwen3_5_moe_text" if arch == "qwen35moe" else "qwen3_5_text",
        hidden_size=k("embedding_length"), num_hidden_layers=n, num_attention_heads=k("attention.head_count"),
        num_key_value_heads=k("attention.head_count_kv"), head_dim=hd,
        linear_num_key_heads=k("ssm.group_count"),
        linear_num_value_heads=hv, linear_key_head_dim=k("ssm.state_size"),
        linear_value_head_dim=k("ssm.inner_size") // hv, linear_conv_kernel_dim=k("ssm.conv_kernel"),
        full_attention_interval=k("full_attention_interval", 4),
        layer_types=["linear_attention" if f"blk.{i}.ssm_a" in byname else "full_attention"
                     for i in range(n)],
        rope_parameters=rope, rms_norm_eps=_f32(k("attention.layer_norm_rms_epsilon")),
        vocab_size=int(_gguf_need(byname, "token_embd.weight").shape[1]),  # ne = {H, V}
        tie_word_embeddings="output.weight" not in byname,
        mtp_num_hidden_layers=nextn if any(x.startswith(f"blk.{n}.nextn.") for x in byname) else 0,
        max_position_embeddings=k("context_length"), eos_token_id=meta("tokenizer.ggml.eos_token_id"),
        hidden_act="silu", attn_output_gate=True, attention_bias=False)
    if k("feed_forward_length", None) is not None:
        cfg["intermediate_size"] = k("feed_forward_length")
    if arch == "qwen35moe":
        cfg.update(num_experts=k("expert_count"), num_experts_per_tok=k("expert_used_count"),
                   moe_intermediate_size=k("expert_feed_forward_length"),
                   shared_expert_intermediate_size=k("expert_shared_feed_forward_length"))
    return cfg


def _gguf_tensors(byname, cfg, dtype, path):
    """{HF text-only name: tensor}: names through the tables, every converter transform undone."""
    n = cfg["num_hidden_layers"]
    tensors = {}
    split = {}
    for name, rt in byname.items():
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        i, leaf = (int(m[1]), m[2]) if m else (-1, name)
        pre = f"model.layers.{i}." if i < n else f"mtp.layers.{i - n}."
        if leaf in _GGUF_SKIP or (leaf.startswith("nextn.") and i != n):  # nextn.*: copied to every MTP block
            continue
        if leaf in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            split.setdefault(pre, {})[leaf] = _gguf_tensor(rt).to(dtype)  # [E, I, H]
            continue
        if m is None:
            hf = _GGUF_TOP.get(name)
        else:
            hf = _GGUF_NEXTN.get(leaf) or (pre + _GGUF_BLK[leaf] if leaf in _GGUF_BLK else None)
        if hf is None:
            raise ValueError(f"unexpected tensor {name!r} in GGUF file {path}")
        t = _gguf_tensor(rt)
        if _is_shifted_norm(hf):
            t = t.float() - 1.0
        elif hf.endswith(".A_log"):  # stored as -exp(A_log)
            t = torch.log(-t.double())
        t = _gdn_reorder(hf, t, cfg, to_gguf=False)
        if hf.endswith(".conv1d.weight"):
            t = t.unsqueeze(1)  # [C, K] -> [C, 1, K]
        tensors[hf] = t.to(torch.float32 if hf.endswith(".A_log") else dtype)  # the GDN decay stays fp32
    for pre, d in split.items():  # gate rows first, then up
        gate_up = torch.cat([d["ffn_gate_exps.weight"], d["ffn_up_exps.weight"]], 1)
        tensors[pre + "mlp.experts.gate_up_proj"] = gate_up
    return tensors


def _gguf_need(byname, name):
    if name not in byname:
        raise ValueError(f"the GGUF file has no tensor {name}")
    return byname[name]


def _gguf_tokenizer(meta):
    """The tokenizer.ggml.* metadata as a dict (read_gguf_model builds the Tokenizer from it). llama.cpp's
    byte-level BPE ("gpt2") only, with its tokens and merges (llama.cpp refuses a file without them too)."""
    if meta("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"tokenizer.ggml.model {meta('tokenizer.ggml.model')!r}: specdec reads byte-level BPE "
                         "('gpt2') tokenizers only")
    if not meta("tokenizer.ggml.tokens"):
        raise ValueError("the GGUF metadata has no tokenizer.ggml.tokens")
    toks = meta("tokenizer.ggml.tokens", [])
    types = meta("tokenizer.ggml.token_type", [1] * len(toks))  # 1 normal, 3 control, 4 user, 5 unused
    if not meta("tokenizer.ggml.merges") and any(len(t) > 1 for t, ty in zip(toks, types) if ty == 1):
        raise ValueError("the GGUF metadata has no tokenizer.ggml.merges (its vocabulary has multi-byte tokens, "
                         "which only merges reach)")
    eos = meta("tokenizer.ggml.eos_token_id")
    pre_tok = meta("tokenizer.ggml.pre")
    added = {t: i for i, (t, ty) in enumerate(zip(toks, types)) if ty in (3, 4)}
    stops = {eos, meta("tokenizer.ggml.eot_token_id"), added.get("<|im_end|>"), added.get("<|endoftext|>")}
    return dict(
        model=meta("tokenizer.ggml.model"), pre=pre_tok, pattern=_PRETOKENIZE.get(pre_tok), tokens=toks,
        token_types=types, merges=meta("tokenizer.ggml.merges", []), eos_token_id=eos,
        eos_token=toks[eos] if eos is not None and eos < len(toks) else None,
        bos_token_id=meta("tokenizer.ggml.bos_token_id"),
        pad_token_id=meta("tokenizer.ggml.padding_token_id"),
        chat_template=meta("tokenizer.chat_template"), added_tokens=added,
        special_tokens=[t for t, ty in zip(toks, types) if ty == 3],  # dropped by skip_special decoding
        vocab={t: i for i, (t, ty) in enumerate(zip(toks, types)) if ty not in (3, 4, 5)},
        stop_token_ids=sorted(s for s in stops if s is not None))


def read_gguf_model(path, dtype):
    """A .gguf file -> (ModelConfig, tensors under HF text-only names, Tokenizer)."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: not a file (a .gguf model is one file)")
    try:
        text, tensors, tok = read_gguf(path, dtype)
        cfg = ModelConfig.from_dict(text)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{path}: {e}") from None
    cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(tok["stop_token_ids"]))
    tokenizer = Tokenizer(tok["vocab"], tok["merges"], tok["added_tokens"], tok["pattern"] or QWEN_PATTERN,
                          tok["eos_token"], special=tok["special_tokens"])
    tokenizer.chat_template = tok["chat_template"]  # the file's own template (ChatTemplate.from_checkpoint)
    return cfg, tensors, tokenizer


# ==============================================================================================
# API: LLM(...).generate / .chat, shaped like vLLM's offline API
# ==============================================================================================

@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float
    logprobs: list
    finish_reason: str
    stop_reason: object = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str
    prompt_token_ids: list
    prompt_logprobs: list  # with SamplingParams.prompt_logprobs: None, then {token id: Logprob} per token
    outputs: list
    finished: bool = True
    metrics: dict = None


# -- get_metrics(): vLLM's metric objects (vllm/v1/metrics/reader.py), under vLLM's Prometheus names -----

@dataclass
class Metric:
    name: str
    labels: dict


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):  # vllm:spec_decode_num_accepted_tokens_per_pos: one counter per draft position
    values: list


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict  # upper bound (a string, "+Inf" last) -> observations up to it


REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]  # vLLM's, for request latencies (seconds)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # vLLM's, for the time to first token


def histogram(name, labels, bounds, values):
    """A Histogram of values over the buckets bounds (cumulative counts, as Prometheus keeps them)."""
    buckets = {repr(float(b)): sum(v <= b for v in values) for b in bounds}
    return Histogram(name, labels, len(values), float(sum(values)), {**buckets, "+Inf": len(values)})


def resolve_device_dtype(device, dtype):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda") or (kind == "cuda" and not torch.cuda.is_available()):
        raise ConfigError(f"device {device!r} (--device) is not available here: use cpu"
                          + (" or cuda" if torch.cuda.is_available() else " (this torch has no CUDA device)"))
    if dtype in (None, "auto"):
        dtype = "bfloat16" if str(device).startswith("cuda") else "float32"
    dtypes = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
              "half": torch.float16, "float32": torch.float32, "float": torch.float32, "fp32": torch.float32}
    if dtype not in dtypes and not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unsupported dtype {dtype!r}; choose one of auto, bfloat16, float16, float32")
    return torch.device(device), dtypes.get(dtype, dtype)


# -- Model names: a local path, or a hub id found in the local Hugging Face cache -------------------

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # Org/Name


def hf_hub_cache():
    """Where huggingface_hub keeps models: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    home = os.environ.get("HF_HOME") or os.path.join(cache, "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def find_in_hf_cache(name):
    """A hub id's snapshot in the cache, models--Org--Name/snapshots/<the commit refs/main names> (without
    refs/main: the only snapshot), or None."""
    if not isinstance(name, str) or not HUB_ID.fullmatch(name):
        return None
    snapshots = os.path.join(hf_hub_cache(), "models--" + name.replace("/", "--"), "snapshots")
    ref = os.path.join(os.path.dirname(snapshots), "refs", "main")
    if os.path.isfile(ref):
        with open(ref) as f:
            path = os.path.join(snapshots, f.read().strip())
        return path if os.path.isdir(path) else None
    found = os.listdir(snapshots) if os.path.isdir(snapshots) else []
    return os.path.join(snapshots, found[0]) if len(found) == 1 else None


def resolve_model(name):
    """A model named as vLLM users name it: a local directory or .gguf file as it is; a hub id
    (Qwen/Qwen3.6-27B) as its snapshot in the local Hugging Face cache. Nothing is ever downloaded."""
    if not isinstance(name, (str, os.PathLike)) or not str(name):
        raise ConfigError(f"model must be a path or a Hugging Face model id, got {name!r}")
    name = os.fspath(name)
    if os.path.exists(name):
        return name
    path = find_in_hf_cache(name)
    if path is not None:
        return path
    if not HUB_ID.fullmatch(name):
        raise ConfigError(f"model path {name!r} does not exist")
    raise not_in_hf_cache(name)


def not_in_hf_cache(name, what="model"):
    """The one line for a hub id that is neither a local path nor in the cache (the target's, a drafter's)."""
    repo = os.path.join(hf_hub_cache(), "models--" + name.replace("/", "--"))
    return ConfigError(f"{what} {name!r} is not a local path, and the Hugging Face cache has no snapshot of "
                       f"it (looked in {repo}/snapshots for the commit refs/main names); specdec does not "
                       f"download: fetch it with `hf download {name}`, or set HF_HUB_CACHE / HF_HOME to the "
                       "cache that has it")


# -- Memory: the static slots' KV caches and GDN states (vLLM's --gpu-memory-utilization) ------------

GiB = 1 << 30


def state_bytes(cfg, dtype, mtp=False):
    """What State allocates for one slot: (bytes per position: K and V of every attention layer, and of the
    MTP layer with method mtp; bytes per slot: every GDN layer's conv window and fp32 recurrent state)."""
    el = torch.empty((), dtype=dtype).element_size()
    n_attn = cfg.layer_types.count("full_attention") + int(mtp)
    n_gdn = cfg.layer_types.count("linear_attention")
    per_pos = n_attn * 2 * cfg.num_key_value_heads * cfg.head_dim * el
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return per_pos, n_gdn * (cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * el + rec)


def drafter_bytes(spec, dtype):
    """What a drafter network will take, counted from its checkpoint before it loads, so that the slots are sized
    with it (vLLM's memory profiling counts a draft model's too): (weight bytes, its caches' bytes per position
    and per slot, the positions they hold past max_model_len). Zeros for ngram and mtp (the MTP layer is the
    target's: state_bytes counts it), and for a drafter the proposer will refuse (its own error says why)."""
    if spec is None or spec.method not in ("dflash", "dspark", "draft_model") or spec.model is None:
        return 0, 0, 0, 0
    from safetensors import safe_open
    K, path = spec.num_speculative_tokens, spec.model
    if spec.method == "draft_model":
        top = read_config(path, "draft_model")
        if top.get("model_type") == "qwen3":
            c, _ = qwen3_fields(top, f"draft_model {path}")
            layers, n_kv, hd = c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"]
            per_pos, per_slot = KVCache.bytes_per_pos(layers, n_kv, hd, dtype), 0
        elif top.get("model_type") in SUPPORTED_MODEL_TYPES:
            per_pos, per_slot = state_bytes(ModelConfig.from_hf(path), dtype)
        else:
            return 0, 0, 0, 0
        extra = DraftModelProposer.extra(K)
    else:
        c = read_block_config(path, spec.method)
        per_pos = KVCache.bytes_per_pos(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, dtype)
        per_slot = 0
        extra = BlockProposer.extra(c, K)
    numel = 0
    for f, names in itertools.groupby(sorted(checkpoint_tensors(path).items(), key=lambda t: t[1]),
                                      key=lambda t: t[1]):
        with safe_open(f, "pt") as st:                                   # each file opened once
            numel += sum(math.prod(st.get_slice(name).get_shape()) for name, _ in names)
    return numel * torch.empty((), dtype=dtype).element_size(), per_pos, per_slot, extra


def memory_budget(device, utilization):
    """(bytes the slots may take, how they were counted). CUDA, as vLLM: the fraction of the GPU's total
    memory, less what this process holds already (the weights), and no more than is free. CPU: the fraction of
    the system memory available now (MemAvailable, with the weights already loaded)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
        budget = min(utilization * total - held, free)
        return int(budget), (f"{utilization} x {total / GiB:.2f} GiB GPU memory - {held / GiB:.2f} GiB held "
                             f"by the weights, at most the {free / GiB:.2f} GiB free")
    avail = None
    if os.path.isfile("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            kib = [int(line.split()[1]) for line in f if line.startswith("MemAvailable:")]
            avail = kib[0] * 1024 if kib else None
    if avail is None:  # not Linux
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(utilization * avail), (f"{utilization} x {avail / GiB:.2f} GiB of system memory available "
                                      "(CPU: the memory available after loading the weights)")


def size_slots(per_pos, per_slot, num_seqs, extra, budget, basis, limit, want=None):
    """The max_model_len the slots get, and the start-up line that shows the arithmetic. Each of num_seqs + 1
    slots (the last pads batches) holds max_model_len + extra positions (per_pos bytes each) and per_slot
    bytes of GDN state. want None: the model's limit if it fits, else the largest that fits."""
    need = lambda slots, n: slots * ((n + extra) * per_pos + per_slot)  # noqa: E731
    fits = lambda slots: (budget // slots - per_slot) // max(per_pos, 1) - extra  # noqa: E731  (largest n)
    slots = num_seqs + 1
    n = limit if want is None else want
    why = "the model's limit" if want is None else "--max-model-len"
    if need(slots, n) > budget and want is None and fits(slots) >= 1:
        n, why = fits(slots), f"the largest that fits; the model allows {limit}"
    have = f"{budget / GiB:.2f} GiB ({basis})"
    if need(slots, n) > budget:
        if fits(2) < n:  # not even one sequence (and the padding slot)
            raise ConfigError(f"max_model_len={n}: one sequence needs {need(2, n) / GiB:.2f} GiB of KV cache "
                              f"and state (with the padding slot), more than the {have}; the largest that "
                              f"fits one sequence is {max(fits(2), 0)}: lower --max-model-len or raise "
                              "--gpu-memory-utilization")
        most = budget // need(1, n) - 1
        raise ConfigError(f"--max-num-seqs {num_seqs} slots of max_model_len={n} need "
                          f"{need(slots, n) / GiB:.2f} GiB of KV cache and state, more than the {have}; "
                          f"{most} fit: lower --max-num-seqs or --max-model-len, or raise "
                          "--gpu-memory-utilization")
    return n, (f"KV cache and state: {slots} slots ({num_seqs} + 1 for padding) x (({n} + {extra}) positions "
               f"x {per_pos} B + {per_slot} B) = {need(slots, n) / GiB:.3f} GiB of {have}; max_model_len {n} "
               f"({why})")


# -- Sampling defaults: the model's generation_config.json (vLLM's --generation-config) -------------

GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")  # vLLM's


def _json_arg(value, what):
    if value is None or isinstance(value, dict):
        return dict(value or {})
    try:
        obj = json.loads(value)
    except ValueError as e:
        raise ConfigError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{what} must be a JSON object, got {value!r}")
    return obj


def generation_defaults(model, generation_config="auto", override=None):
    """What a request that leaves them unset gets, as vLLM's --generation-config: "auto" reads the model's
    generation_config.json, "vllm" none, a folder that folder's; --override-generation-config's JSON goes on
    top. -> {temperature, top_p, top_k, min_p, repetition_penalty, max_tokens (its max_new_tokens)} as given
    there."""
    cfg, where = {}, "vLLM's defaults"
    if generation_config != "vllm":
        auto = generation_config in (None, "auto")
        own = os.path.dirname(model) if str(model).endswith(".gguf") else model
        folder = own if auto else generation_config
        where = os.path.join(folder, "generation_config.json")
        if os.path.isfile(where):
            cfg = read_json(where, "generation config", obj=True)
        elif not auto:
            raise ConfigError(f"--generation-config {generation_config!r}: no generation_config.json there "
                              "(give a folder that has one, 'auto' for the model's, or 'vllm' for none)")
    cfg.update(_json_arg(override, "--override-generation-config"))
    out = {k: cfg[k] for k in GENERATION_KEYS if cfg.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    if out.get("top_k") == 0:
        out["top_k"] = -1  # vLLM: 0 disables top-k too
    try:
        SamplingParams(**out)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"the generation config ({where} and overrides): {e}") from None
    return out


# -- The offline API ------------------------------------------------------------------------------

def _unused_request_args(lora_request, priority, tokenization_kwargs):
    """vLLM's per-call arguments of LLM.generate / chat that specdec has no use for: accepted at their defaults
    (no LoRA, priority 0, the tokenizer's own settings), refused otherwise with vLLM's message where it has one."""
    each = lambda v: v if isinstance(v, (list, tuple)) else [v]  # noqa: E731 (one value, or one per prompt)
    lora = next((r for r in each(lora_request) if r is not None), None)
    if lora is not None:
        raise ConfigError(f"Got lora_request {lora} but LoRA is not enabled!")
    p = next((p for p in each(priority) if p not in (None, 0)), None)
    if p is not None:
        raise ConfigError(f"Got priority {p} but Priority scheduling is not enabled.")
    if tokenization_kwargs:
        raise ConfigError(f"tokenization_kwargs={tokenization_kwargs!r}: specdec tokenizes prompts with the "
                          "tokenizer's own settings only (None or {})")


# vLLM engine arguments that change nothing in specdec, accepted (by LLM and the CLI) where that is true: name ->
# (its flag's argparse keywords: vLLM's default, accepted(value), what is accepted and why)
UNUSED_ENGINE_ARGS = {
    "disable_log_stats": (dict(action="store_true"), lambda v: isinstance(v, bool),
                          "true or false (server.py: no periodic throughput / spec-decode lines; LLM logs none)"),
    "enable_prefix_caching": (dict(action=argparse.BooleanOptionalAction, default=None), lambda v: not v,
                              "off: prefix caching is not implemented (every prompt is prefilled)"),
    "swap_space": (dict(type=float, default=4), lambda v: _number(v) and v >= 0,
                   "GiB >= 0 (nothing is swapped: a sequence keeps its slot)"),
    "block_size": (dict(type=int, default=None), lambda v: v is None or _positive_int(v),
                   "a positive integer (caches are per slot, indexed by position: no blocks)"),
    "revision": (dict(default=None), lambda v: v is None, "None (a local model: no hub revisions)"),
    "kv_cache_dtype": (dict(default="auto"), lambda v: v == "auto", "'auto' (the KV cache has the model's dtype)"),
    "tokenizer_mode": (dict(default="auto"), lambda v: v == "auto", "'auto' (specdec's own BPE tokenizer)"),
}


def check_unused_engine_args(args):
    """LLM's keywords beyond its own: UNUSED_ENGINE_ARGS at an accepted value; any other name is a TypeError, as
    vLLM's EngineArgs raises."""
    for name, value in args.items():
        if name not in UNUSED_ENGINE_ARGS:
            raise TypeError(f"LLM.__init__() got an unexpected keyword argument '{name}'")
        _, accepted, what = UNUSED_ENGINE_ARGS[name]
        if not accepted(value):
            raise ConfigError(f"{name}={value!r} (--{name.replace('_', '-')}) is not supported; specdec takes "
                              f"{what}")


class LLM:
    """vLLM's offline API: LLM(model, **engine_args), then generate / chat (RequestOutputs with Logprob
    objects), get_tokenizer, get_metrics (vLLM's metric objects). The engine arguments have vLLM's names (an
    unknown one is a TypeError, as in vLLM); quantization="fp8" quantizes the weights at load (an FP8
    checkpoint is FP8 without it); tensor_parallel_size is accepted at 1 only (not yet implemented),
    trust_remote_code is accepted and changes nothing (specdec runs no checkpoint code), as are the others of
    UNUSED_ENGINE_ARGS where they change nothing."""

    def __init__(self, model=None, speculative_config=None, dtype="auto", device=None, max_model_len=None,
                 max_num_seqs=8, seed=0, enforce_eager=False, async_scheduling=None,
                 max_num_batched_tokens=None, enable_chunked_prefill=True, gpu_memory_utilization=0.9,
                 generation_config="auto", override_generation_config=None,
                 tensor_parallel_size=1, quantization=None, trust_remote_code=False, max_logprobs=20,
                 load_format="auto", tokenizer=None, **unused):
        check_unused_engine_args(unused)  # vLLM's that change nothing here (UNUSED_ENGINE_ARGS)
        if tensor_parallel_size not in (None, 1):
            raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} (--tensor-parallel-size): tensor "
                              "parallelism is not supported yet; specdec runs the model on one device")
        quantization = None if quantization in ("None", "none") else quantization
        if quantization not in (None, *QUANTIZATIONS):
            raise ConfigError(f"quantization={quantization!r} (--quantization) is not supported; specdec "
                              "supports fp8 (block-wise FP8 weights, quantized at load) or none (the "
                              "checkpoint's own: unquantized, Qwen's FP8, or GGUF dequantised at load)")
        if not 0 < gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        name = default_model_path() if model is None else model
        model = resolve_model(name)
        spec = SpeculativeConfig.from_json(speculative_config, target=model)
        if spec is not None and spec.method == "dspark" and str(model).endswith(".gguf"):
            raise ConfigError("method 'dspark' is refused for a GGUF target: its hidden-state taps come from "
                              "a re-quantised copy of the model the drafter was not trained on; use the "
                              "safetensors checkpoint as the target")
        self.default_sampling = generation_defaults(model, generation_config, override_generation_config)
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        want_mtp = spec is not None and spec.method == "mtp"
        tokenizer = None if tokenizer is None else resolve_model(tokenizer)
        self.model, self.cfg, self.tokenizer = load_model(model, self.dtype, self.device, want_mtp,
                                                          quantization, load_format, tokenizer)
        want = None if max_model_len in (None, "auto", -1) else max_model_len
        if want is not None and (isinstance(want, bool) or not (isinstance(want, int) and want >= 1)):
            raise ConfigError(f"max_model_len must be a positive integer, or auto / -1 (fit), got {want!r}")
        limit = self.cfg.max_position_embeddings
        if want is not None and want > limit:
            raise ConfigError(f"max_model_len={want} exceeds the model's max_position_embeddings={limit}")
        if spec is not None and spec.method != "ngram" and spec.max_model_len is not None:
            # vLLM (_maybe_override_draft_max_model_len): the draft's context, never above the target's, which it
            # leaves alone; specdec's drafters share the target's slots, so it is only checked (ngram: ignored)
            target = limit if want is None else want
            if spec.max_model_len > target:
                raise ConfigError(f"speculative_max_model_len={spec.max_model_len} cannot be larger than "
                                  f"target_max_model_len={target}")
        k = spec.num_speculative_tokens if spec else 0
        d_weights, d_pos, d_slot, d_extra = drafter_bytes(spec, self.dtype)  # loaded later, counted now
        add_draft_head(self.model, quantization, drafts_through_target_head(spec))  # (before the budget)
        budget, basis = memory_budget(self.device, gpu_memory_utilization)
        per_pos, per_slot = state_bytes(self.cfg, self.dtype, want_mtp)
        if d_weights:
            basis += f", less the drafter's {d_weights / GiB:.2f} GiB of weights"
        max_len, self.memory_report = size_slots(per_pos + d_pos, per_slot + d_slot, max_num_seqs,
                                                 max(k + 1, d_extra), budget - d_weights, basis, limit, want)
        if d_weights:
            self.memory_report += f" (per position: the target's {per_pos} B + the drafter's {d_pos} B)"
        self.model_path = model
        self.model_name = name  # as given: vLLM's model_name label in get_metrics()
        self.max_model_len = max_len
        self.spec = spec
        self.chat_template = ChatTemplate.from_checkpoint(tokenizer or model, self.tokenizer)
        self.tokenizer.template = self.chat_template  # get_tokenizer().apply_chat_template renders with it
        self.engine = Engine(self.model, self.tokenizer, spec, max_num_seqs, max_len, self.dtype, self.device,
                             seed, enforce_eager, async_scheduling, max_num_batched_tokens,
                             enable_chunked_prefill)
        self.done = []  # (prompt tokens, output tokens, finish reason, TTFT, E2E) of each finished request
        self.max_logprobs = max_logprobs  # the most logprobs / prompt_logprobs a request may ask for; -1: any

    def encode_prompt(self, prompt):
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):  # vLLM's TokensPrompt / TextPrompt: each key with its own type
            key = "prompt_token_ids" if "prompt_token_ids" in prompt else "prompt"
            value = prompt.get(key)
            if isinstance(value, str) != (key == "prompt"):
                want = "a string" if key == "prompt" else "a list of token ids"
                raise ConfigError(f"a prompt's {key!r} must be {want}, got {str(value)[:80]!r}")
            return self.encode_prompt(value)
        if not (isinstance(prompt, (list, tuple)) and all(_integer(t) for t in prompt)):
            raise ConfigError(f"a prompt is a string, a list of token ids (integers) or a dict with 'prompt' or "
                              f"'prompt_token_ids', got {str(prompt)[:80]!r}")
        return None, list(prompt)

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self):
        """SamplingParams with the model's generation-config defaults (what generate uses without any)."""
        return SamplingParams(**self.default_sampling)

    def generate(self, prompts, sampling_params=None, use_tqdm=True, *, lora_request=None, priority=None,
                 tokenization_kwargs=None):
        """Complete prompts (a string, a prompt's token ids, {"prompt"} / {"prompt_token_ids"}, or a list of
        them) with one SamplingParams or a sequence of one per prompt (default: the generation config's), batched
        by the engine. use_tqdm: a progress bar over the requests, as vLLM's (or a tqdm-like class to make it).
        lora_request, priority, tokenization_kwargs: vLLM's, accepted at their defaults (_unused_request_args)."""
        _unused_request_args(lora_request, priority, tokenization_kwargs)
        one_ids = isinstance(prompts, list) and prompts and isinstance(prompts[0], int)  # a prompt's ids
        single = isinstance(prompts, (str, dict)) or one_ids
        if not (single or isinstance(prompts, (list, tuple))):
            raise ConfigError(f"prompts: a prompt (a string, its token ids, a dict) or a list of them, got "
                              f"{str(prompts)[:80]!r}")
        prompts = [prompts] if single else list(prompts)
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if not (isinstance(params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in params)):
            raise ConfigError(f"sampling_params: a SamplingParams or a list of them (one per prompt), got "
                              f"{str(sampling_params)[:80]!r}")
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
        for sp in params:
            self._check_logprobs(sp)
        reqs = []
        try:
            for p, sp in zip(prompts, params):
                text, ids = self.encode_prompt(p)
                reqs.append((text, sp, self.add_samples(ids, sp)))
        except Exception:  # one prompt refused (too long, ...): none of the batch stays queued
            for _, _, rs in reqs:
                for r in rs:
                    self.engine.abort(r)
            raise
        bar = self._progress(use_tqdm, len(reqs))
        t0 = time.perf_counter()
        while any(not r.finished for _, _, rs in reqs for r in rs):
            try:
                self.engine.step()
            except Exception:  # this call's requests end (as the server ends those of a step that failed), so
                for _, _, rs in reqs:  # that the engine does not step them again in the next call
                    for r in rs:
                        if not r.finished:
                            self.engine.abort(r)
                raise
            done = [rs for _, _, rs in reqs if all(r.finished for r in rs)]
            if bar is not None and len(done) > bar.n:
                dt = max(time.perf_counter() - t0, 1e-9)
                n_in = sum(len(rs[0].prompt_ids) for rs in done)
                n_out = sum(len(r.output_ids) for rs in done for r in rs)
                bar.set_postfix_str(f"est. speed input: {n_in / dt:.2f} toks/s, output: {n_out / dt:.2f} "
                                    "toks/s", refresh=False)
                bar.update(len(done) - bar.n)
        if bar is not None:
            bar.close()
        self.done += [(len(r.prompt_ids), len(r.output_ids), r.finish_reason,
                       r.first_token_time - r.arrival_time, r.finish_time - r.arrival_time)
                      for _, _, rs in reqs for r in rs]
        return [self._output(text, sp, rs) for text, sp, rs in reqs]

    def add_samples(self, ids, sp):
        """A prompt's requests, one per sample (SamplingParams.samples). The first is prefilled; the others
        copy its slot (the prompt's KV cache, GDN states and the proposer's caches) when they hold a slot by
        then."""
        reqs = []
        for child in sp.samples():
            reqs.append(self.engine.add_request(ids, child, fork_of=reqs[0] if reqs else None, output_fits=False))
            if sp.ranked:  # best_of ranks them by their cumulative logprob
                reqs[-1].cumulative_logprob = 0.0
        return reqs

    def _check_logprobs(self, sp):
        """vLLM's cap (max_logprobs) on the logprobs a request asks for; -1 means the whole vocabulary."""
        for kind, n in (("sample", sp.logprobs), ("prompt", sp.prompt_logprobs)):
            n = self.cfg.vocab_size if n == -1 else n
            if n is not None and self.max_logprobs != -1 and n > self.max_logprobs:
                raise ValueError(f"Requested {kind} logprobs of {n}, which is greater than max allowed: "
                                 f"{self.max_logprobs}")

    @staticmethod
    def _progress(use_tqdm, total):
        if not use_tqdm:
            return None
        if callable(use_tqdm):  # vLLM: a tqdm class (or a function making a bar) may be given
            make = use_tqdm
        else:
            from tqdm import tqdm as make
        return make(total=total, desc="Processed prompts", dynamic_ncols=True)

    def chat(self, messages, sampling_params=None, use_tqdm=True, lora_request=None, chat_template=None,
             chat_template_content_format="auto", add_generation_prompt=True, continue_final_message=False,
             tools=None, chat_template_kwargs=None, tokenization_kwargs=None, mm_processor_kwargs=None, *,
             enable_thinking=None):
        """One conversation (a list of messages) or several, through the model's chat template (or the
        `chat_template` given: a path or the template text), as vLLM's LLM.chat (its arguments in its order;
        the content format is the template's own: "auto" only; no multimodal inputs: mm_processor_kwargs None)."""
        _unused_request_args(lora_request, None, tokenization_kwargs)
        if chat_template_content_format != "auto" or mm_processor_kwargs is not None:
            raise ConfigError(f"chat_template_content_format={chat_template_content_format!r}, mm_processor_kwargs="
                              f"{mm_processor_kwargs!r}: specdec takes only 'auto' and None (its chat template "
                              "reads the messages as they are; no multimodal inputs)")
        template = self.chat_template
        if chat_template is not None:
            template = ChatTemplate.from_arg(chat_template, template.special_tokens)
        kwargs = dict(chat_template_kwargs or {})
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        # as vLLM, chat_template_kwargs go over the template's own arguments (not the messages or documents)
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
        tools = kwargs.pop("tools", tools)
        clash = [k for k in ChatTemplate.RESERVED if k in kwargs]  # (before the call: `messages` would clash there)
        if clash:
            raise ConfigError(f"chat_template_kwargs may not set {', '.join(clash)}")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        is_chat = lambda c: isinstance(c, (list, tuple)) and all(isinstance(m, dict) for m in c)  # noqa: E731
        if not (isinstance(convs, (list, tuple)) and all(is_chat(c) for c in convs)):
            raise ConfigError(f"messages: a conversation (a list of message dicts) or a list of them, got "
                              f"{str(messages)[:80]!r}")
        try:
            prompts = [template.render(m, tools, add_generation_prompt, continue_final_message, **kwargs)
                       for m in convs]
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return self.generate(prompts, sampling_params, use_tqdm)

    def _output(self, text, sp, reqs):
        """A prompt's RequestOutput: its samples in order, or with best_of the n of highest cumulative logprob
        (vLLM's ranking), best first."""
        if sp.ranked:
            reqs = sorted(reqs, key=lambda r: -r.cumulative_logprob)[:sp.n]
        outs = [CompletionOutput(i, r.text, list(r.output_ids), r.cumulative_logprob, r.logprobs,
                                 r.finish_reason, r.stop_reason) for i, r in enumerate(reqs)]
        metrics = None
        if self.spec:
            s = SpecStats()
            for r in reqs:
                s.absorb(r.spec)
            metrics = {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                       "num_accepted_tokens": s.num_accepted_tokens, "accepted_per_pos": s.accepted_per_pos,
                       "mean_acceptance_length": s.mean_acceptance_length}
        first = reqs[0]
        return RequestOutput(first.id, text, first.prompt_ids, first.prompt_logprobs, outs, True, metrics)

    def get_metrics(self):
        """vLLM's LLM.get_metrics(): a list of Counter / Vector / Gauge / Histogram under vLLM's names (the
        Prometheus names less _total): the engine's queue, the tokens and requests that generate() finished,
        their time to first token and end-to-end latency, and with a speculative config the spec-decode
        counters, accepted tokens per draft position a Vector. The raw counters: engine.stats (SpecStats)."""
        labels = {"model_name": self.model_name, "engine": "0"}
        e = self.engine
        out = [Gauge("vllm:num_requests_running", dict(labels), sum(r is not None for r in e.slots)),
               Gauge("vllm:num_requests_waiting", dict(labels), len(e.waiting)),
               Counter("vllm:prompt_tokens", dict(labels), sum(d[0] for d in self.done)),
               Counter("vllm:generation_tokens", dict(labels), sum(d[1] for d in self.done))]
        for reason in ("stop", "length", "abort", "error"):
            n = sum(d[2] == reason for d in self.done)
            out.append(Counter("vllm:request_success", dict(labels, finished_reason=reason), n))
        out.append(histogram("vllm:time_to_first_token_seconds", dict(labels), TTFT_BUCKETS,
                             [d[3] for d in self.done]))
        out.append(histogram("vllm:e2e_request_latency_seconds", dict(labels), REQUEST_BUCKETS,
                             [d[4] for d in self.done]))
        if self.spec is not None:  # as vLLM: only with a speculative config
            st = e.stats
            for what in ("drafts", "draft_tokens", "accepted_tokens"):
                out.append(Counter(f"vllm:spec_decode_num_{what}", dict(labels), getattr(st, f"num_{what}")))
            k = self.spec.num_speculative_tokens
            per_pos = list(st.accepted_per_pos) + [0] * (k - len(st.accepted_per_pos))
            out.append(Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels), per_pos))
        return out

    def warmup(self, force=False):
        """Compile the kernels and capture the CUDA graphs of every batch bucket before serving (vLLM
        captures at start-up): Engine.warmup. Nothing without graphs (CPU, enforce_eager) unless forced."""
        self.engine.warmup(force)


def default_model_path():
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "toy")
    if os.path.isdir(here):
        return here
    raise ConfigError("no --model given and no shipped model at models/toy; pass --model PATH "
                      "(python test_specdec.py make-tiny /tmp/tiny writes a tiny random checkpoint)")


# ==============================================================================================
# CLI
# ==============================================================================================

def vllm_argv(argv):
    """vLLM's spelling of flags: an underscore in a flag's name is a dash (--max_model_len=4096)."""
    out = []
    for a in argv:
        if a.startswith("--"):
            name, eq, value = a.partition("=")
            a = name.replace("_", "-") + eq + value
        out.append(a)
    return out


def human_int(value):
    """vLLM's human-readable integers: 32k = 32000, 32K = 32768 (k, m, g decimal; K, M, G binary)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", value.strip())
    if not m or ("." in m[1] and m[2] not in ("k", "m", "g")):
        raise argparse.ArgumentTypeError(f"invalid integer {value!r} (e.g. 4096, 32k, 32K)")
    if m[2] in ("k", "m", "g"):
        return int(float(m[1]) * 1000 ** (1 + "kmg".index(m[2])))
    return int(m[1]) * 1024 ** ("KMG".index(m[2]) + 1 if m[2] else 0)


def max_len_arg(value):
    return "auto" if value.strip() in ("auto", "-1") else human_int(value)


def add_engine_args(ap):
    """Flags shared by specdec.py and server.py: vLLM's engine arguments (the names of LLM's keywords)."""
    ap.add_argument("--model", default=None, help="checkpoint directory (HF safetensors), .gguf file, or a "
                    "hub id (Org/Name) in the local Hugging Face cache (default: the shipped toy model in "
                    "models/)")
    ap.add_argument("--speculative-config", default=None, help="vLLM's speculative config as JSON, e.g. "
                    '\'{"method":"mtp","num_speculative_tokens":2}\' (methods: ' + ", ".join(SPEC_METHODS)
                    + ")")
    ap.add_argument("--dtype", default="auto",
                    help="auto (bfloat16 on GPU, float32 on CPU), bfloat16, float16, float32")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--max-model-len", type=max_len_arg, default=None,
                    help="max prompt + output tokens, e.g. 4096, 32k, 32K; auto or -1: fit (default: the "
                    "model's limit if --max-num-seqs slots of it fit in --gpu-memory-utilization, else the "
                    "largest that fits)")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="max concurrent sequences (slots)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="fraction of the memory the KV caches and GDN states of the slots may use: of the "
                    "GPU's memory (less the weights); on the CPU, of the system memory available after "
                    "loading (default 0.9)")
    ap.add_argument("--seed", type=int, default=0,
                    help="engine seed (requests without a seed derive theirs from it)")
    ap.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="launch step n+1 before reading step n back (default: on with CUDA graphs)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens per step, the running requests' included; with chunked prefill a long "
                         "prompt is prefilled in pieces of this many tokens beside the running requests "
                         "(default 2048)")
    ap.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                    help="prefill long prompts in pieces between the running requests' steps, so they keep "
                         "their pace (default: on; off: each prompt is prefilled whole when admitted)")
    ap.add_argument("--generation-config", default="auto", help="sampling defaults: auto (the model's "
                    "generation_config.json), vllm (none), or a folder with a generation_config.json")
    ap.add_argument("--override-generation-config", default=None,
                    help="JSON object over the generation config, e.g. '{\"temperature\": 0.6}'")
    ap.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, help="not supported yet (only 1)")
    ap.add_argument("-q", "--quantization", default=None, help="fp8: block-wise FP8 weights (128 x 128 "
                    "blocks, as Qwen's FP8 checkpoints), quantized at load; default: the checkpoint's own "
                    "(an FP8 checkpoint loads as FP8)")
    ap.add_argument("--trust-remote-code", action="store_true", help="accepted for vLLM's command lines; it "
                    "changes nothing: specdec never runs code from a checkpoint")
    ap.add_argument("--load-format", default="auto", choices=LOAD_FORMATS, help="auto (the model path decides), "
                    "safetensors, gguf, or dummy: random weights of the directory's config.json (benchmarks at "
                    "the real shapes without the checkpoint; drafters still load their own)")
    ap.add_argument("--tokenizer", default=None, help="a directory (or hub id in the local cache) whose "
                    "tokenizer.json and chat template to use instead of the model's")
    ap.add_argument("--max-logprobs", type=int, default=20, help="the most logprobs / prompt_logprobs a request "
                    "may ask for; -1: the whole vocabulary (default 20)")
    for name, (kw, _, what) in UNUSED_ENGINE_ARGS.items():
        ap.add_argument("--" + name.replace("_", "-"), **kw, help=f"vLLM's; specdec takes {what}")


def llm_from_args(a):
    return LLM(model=a.model, speculative_config=a.speculative_config, dtype=a.dtype, device=a.device,
               max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs, seed=a.seed,
               enforce_eager=a.enforce_eager, async_scheduling=a.async_scheduling,
               max_num_batched_tokens=a.max_num_batched_tokens,
               enable_chunked_prefill=a.enable_chunked_prefill,
               gpu_memory_utilization=a.gpu_memory_utilization, generation_config=a.generation_config,
               override_generation_config=a.override_generation_config,
               tensor_parallel_size=a.tensor_parallel_size, quantization=a.quantization,
               trust_remote_code=a.trust_remote_code, load_format=a.load_format, tokenizer=a.tokenizer,
               max_logprobs=a.max_logprobs, **{name: getattr(a, name) for name in UNUSED_ENGINE_ARGS})


COMPARE_ROUNDS = 5  # --compare-plain: timed runs with and without speculation, interleaved, after a warm-up


def main(argv=None):
    ap = argparse.ArgumentParser(description="specdec: generate text with a Qwen3.6 model, optionally "
                                             "speculating")
    add_engine_args(ap)
    ap.add_argument("--prompt", default="def fib(n):", help="the prompt text")
    ap.add_argument("--chat", action="store_true",
                    help="wrap the prompt as one user turn of the model's chat template")
    ap.add_argument("--chat-template", default=None, help="with --chat: this template (a file or the text) "
                    "instead of the model's")
    ap.add_argument("--no-thinking", action="store_true", help="with --chat: enable_thinking=False")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens to generate")
    ap.add_argument("--temperature", type=float, default=None,
                    help="0 = greedy (exact argmax) (default: the generation config's, else 0)")
    ap.add_argument("--top-p", type=float, default=None,
                    help="nucleus sampling mass (default: the generation config's, else 1)")
    ap.add_argument("--top-k", type=int, default=None,
                    help="keep the k most likely tokens, -1 = all (default: the generation config's, "
                    "else -1)")
    ap.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    ap.add_argument("--compare-plain", action="store_true",
                    help="with --speculative-config: also decode the prompt without speculation (a second "
                    f"engine of one slot on the same weights), {COMPARE_ROUNDS} runs each after a warm-up, "
                    "and print the speed-up line: both median tok/s, their ratio, and whether every run's "
                    "tokens are the same")
    a = ap.parse_args(vllm_argv(sys.argv[1:] if argv is None else argv))
    try:
        llm = llm_from_args(a)
        if a.compare_plain and llm.spec is None:
            raise ConfigError("--compare-plain compares speculation with plain decoding: it needs "
                              "--speculative-config")
        prompt = a.prompt
        if a.chat:
            template = llm.chat_template
            if a.chat_template is not None:
                template = ChatTemplate.from_arg(a.chat_template, template.special_tokens)
            prompt = template.render([{"role": "user", "content": prompt}], enable_thinking=not a.no_thinking)
        flags = {k: getattr(a, k) for k in ("temperature", "top_p", "top_k") if getattr(a, k) is not None}
        params = SamplingParams(**{"temperature": 0.0, **llm.default_sampling, **flags,  # flags > config
                                   "max_tokens": a.max_tokens, "seed": a.seed, "ignore_eos": a.ignore_eos})
        ids = llm.tokenizer.encode(prompt)
        eng = llm.engine
        req = eng.add_request(ids, params)  # checked here (a prompt too long: one error line)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shown = [0]

    def show(r, n):
        sys.stdout.write(r.text[shown[0]:])
        sys.stdout.flush()
        shown[0] = len(r.text)
    if a.compare_plain:
        return compare_plain(llm, a, req, ids, params, show)
    req.on_update = show
    t0, t1, rate = decode_alone(eng, req)
    print_stats(llm, req, t0, t1, rate)
    return 0


def decode_alone(eng, req):
    """Step eng until req, its only request, finishes. Returns (start, end, tok/s), the rate as the CLI counts
    it: the tokens after the first over the time after the first (the prompt's prefill is not in it)."""
    t0 = time.perf_counter()
    while not req.finished:
        eng.step()
    t1 = time.perf_counter()
    n = len(req.output_ids)
    rate = (n - 1) / (t1 - req.first_token_time) if n > 1 and t1 > req.first_token_time else float("nan")
    return t0, t1, rate


def print_stats(llm, req, t0, t1, rate):
    """The CLI's stats line (and vLLM's acceptance line when speculating), on stderr."""
    print(f"\n[prompt tokens: {len(req.prompt_ids)}, generated tokens: {len(req.output_ids)}, "
          f"time to first token: {(req.first_token_time - t0) * 1e3:.1f} ms, {rate:.1f} tok/s, "
          f"finish: {req.finish_reason}]", file=sys.stderr)
    if llm.spec is not None:  # (no drafts at all, e.g. ngram without a match: said so, not a line of empty rates)
        print(f"[{req.spec.summary(t1 - t0)}]" if req.spec.num_drafts else "[SpecDecoding metrics: no drafts were "
              "proposed]", file=sys.stderr)


def compare_plain(llm, a, first, ids, params, show):
    """--compare-plain: the prompt decoded with speculation (llm's engine) and without (a second engine of one
    slot on the same weights and length), COMPARE_ROUNDS times each, interleaved so that load from elsewhere
    hits both, after one warm-up run each (a first run pays one-time costs: on a CPU the weights' packing and
    the row checks of kernels._dnn_rows; on a GPU the CUDA graphs' capture). Streams the first timed
    speculative run's text, prints its stats, then the speed-up line (speedup_line)."""
    plain = Engine(llm.model, llm.tokenizer, None, 1, llm.max_model_len, llm.dtype, llm.device, a.seed,
                   a.enforce_eager, a.async_scheduling, a.max_num_batched_tokens, a.enable_chunked_prefill)
    decode_alone(llm.engine, first)                               # the warm-ups
    decode_alone(plain, plain.add_request(ids, params))
    runs = {"spec": [], "plain": []}  # (tok/s, tokens) of each timed run
    for i in range(COMPARE_ROUNDS):
        for name, eng in (("plain", plain), ("spec", llm.engine)):
            req = eng.add_request(ids, params)
            if name == "spec" and i == 0:
                req.on_update = show
            t0, t1, rate = decode_alone(eng, req)
            runs[name].append((rate, list(req.output_ids)))
            if req.on_update is not None:
                print_stats(llm, req, t0, t1, rate)
    print(f"[{speedup_line(runs['spec'], runs['plain'], params.greedy)}]", file=sys.stderr)
    return 0


def speedup_line(spec, plain, greedy):
    """The --compare-plain line from the runs with and without speculation, each a list of (tok/s, tokens):
    the median rates, their ratio, and whether every run's tokens equal the first plain run's, compared token
    by token (greedy decoding must give the same tokens; sampled ones agree in distribution only)."""
    rate_s = sorted(r for r, _ in spec)[len(spec) // 2]
    rate_p = sorted(r for r, _ in plain)[len(plain) // 2]
    ref = plain[0][1]
    differ = [toks for _, toks in spec + plain if toks != ref]
    if not differ:
        same = f"same {len(ref)} tokens: yes"
    else:
        other = differ[0]
        first = next((i for i, (x, y) in enumerate(zip(other, ref)) if x != y), min(len(other), len(ref)))
        same = f"same tokens: no (a run differs from the first plain run at token {first})"
        if not greedy:
            same += "; sampled: speculation keeps the distribution, not the tokens"
    return (f"speculation: {rate_s:.1f} tok/s vs {rate_p:.1f} tok/s without ({rate_s / rate_p:.2f}x, "
            f"medians of {len(spec)} runs each), {same}")


if __name__ == "__main__":
    sys.exit(main())
