"""specdec.py - speculative decoding for the Qwen3.6 hybrid models (Gated DeltaNet + gated attention).

One file, read top to bottom: configs -> tokenizer -> model -> state -> proposers -> verification &
sampling -> engine -> loading -> API -> CLI.

    python specdec.py --model PATH --prompt "def fib(n):" --max-tokens 64
    python specdec.py --model PATH --speculative-config '{"method":"mtp","num_speculative_tokens":2}' ...

    from specdec import LLM, SamplingParams
    llm = LLM(model=PATH, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    print(llm.generate(["hello"], SamplingParams(max_tokens=16))[0].outputs[0].text)
"""
import argparse
import codecs
import dataclasses
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
from pathlib import Path

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

    @classmethod
    def from_dict(cls, cfg, top=None):
        """From a text_config dict (`top` = the wrapper config, for fields it may carry instead)."""
        top = top or {}
        mt = cfg.get("model_type", "qwen3_5_text")
        if mt not in ("qwen3_5_text", "qwen3_5_moe_text"):
            raise ConfigError(f"unsupported text model_type {mt!r}; supported: qwen3_5_text, qwen3_5_moe_text")
        moe = mt == "qwen3_5_moe_text"
        for key, want in (("attn_output_gate", True), ("attention_bias", False)):
            if cfg.get(key, want) != want:
                raise ConfigError(f"unsupported config: {key}={cfg[key]!r} (only {want} is implemented)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu is implemented")
        n = cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        if types is None:
            every = cfg.get("full_attention_interval", 4)
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
        if len(types) != n or set(types) - {"full_attention", "linear_attention"}:
            raise ConfigError(f"layer_types must list {n} entries of full_attention/linear_attention, got {types}")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"unsupported rope_type {rope_type!r}; only default (M-)RoPE is implemented")
        eos = cfg.get("eos_token_id", top.get("eos_token_id"))
        tie = cfg.get("tie_word_embeddings", top.get("tie_word_embeddings", False))
        if moe and cfg.get("mlp_only_layers"):
            raise ConfigError("unsupported config: mlp_only_layers (every layer of qwen3_5_moe is MoE)")
        return cls(
            moe=moe, model_type=mt, hidden_size=cfg["hidden_size"], num_hidden_layers=n, layer_types=list(types),
            vocab_size=cfg["vocab_size"], num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            linear_num_key_heads=cfg["linear_num_key_heads"], linear_num_value_heads=cfg["linear_num_value_heads"],
            linear_key_head_dim=cfg["linear_key_head_dim"], linear_value_head_dim=cfg["linear_value_head_dim"],
            linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
            intermediate_size=0 if moe else cfg["intermediate_size"],
            num_experts=cfg.get("num_experts", 0) if moe else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if moe else 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0) if moe else 0,
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) if moe else 0,
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 1e7)),
            partial_rotary_factor=rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), tie_word_embeddings=bool(tie),
            mtp_num_hidden_layers=cfg.get("mtp_num_hidden_layers", 0),
            max_position_embeddings=cfg.get("max_position_embeddings", 262144),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )

    @classmethod
    def from_hf(cls, path):
        """Read `config.json` (multimodal wrapper or text-only) and `generation_config.json` from a directory."""
        f = os.path.join(path, "config.json")
        if not os.path.isfile(f):
            raise ConfigError(f"{path}: no config.json (expected a Hugging Face checkpoint directory or a .gguf file)")
        with open(f) as fh:
            top = json.load(fh)
        mt = top.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"unsupported model_type {mt!r} in {f}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        text = top["text_config"] if mt in ("qwen3_5", "qwen3_5_moe") else top
        if mt in ("qwen3_5", "qwen3_5_moe") and "model_type" not in text:
            text = dict(text, model_type=mt + "_text")
        cfg = cls.from_dict(text, top)
        gen = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen):
            with open(gen) as fh:
                eos = json.load(fh).get("eos_token_id")
            for e in [eos] if isinstance(eos, int) else (eos or []):
                if e not in cfg.eos_token_ids:
                    cfg.eos_token_ids.append(e)
        return cfg


@dataclass
class SamplingParams:
    """Per-request sampling, as vLLM's SamplingParams (the subset specdec implements)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: list = None
    stop_token_ids: list = None
    ignore_eos: bool = False
    seed: int = None
    logprobs: int = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.temperature < 0:
            raise ConfigError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ConfigError(f"logprobs must be non-negative, got {self.logprobs}")

    @property
    def greedy(self):
        return self.temperature < 1e-5


# ==============================================================================================
# Speculative config: vLLM's --speculative-config JSON object
# ==============================================================================================

SPEC_METHODS = ("mtp", "dflash", "dspark", "ngram", "draft_model")
VLLM_ONLY_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "suffix", "ngram_gpu", "custom_class",
                     "extract_hidden_states")
# vLLM keys that specdec accepts only at their default value (a different value is refused by name)
UNSUPPORTED_KEYS = {"moe_backend": None, "attention_backend": None, "kv_cache_dtype": None, "code_revision": None,
                    "index_share_for_mtp_iteration": None, "disable_padded_drafter_batch": False,
                    "disable_eagle_block_drop": False, "use_local_argmax_reduction": False,
                    "use_heterogeneous_vocab": False, "parallel_drafting": False,
                    "num_speculative_tokens_per_batch_size": None, "enable_adaptive_verification": False,
                    "draft_load_config": None, "suffix_decoding_max_tree_depth": 24,
                    "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
                    "suffix_decoding_min_token_prob": 0.1}


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
    def from_json(cls, obj):
        """Parse a JSON string or dict; every problem is a ConfigError with a one-line message."""
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
                if obj[key] != UNSUPPORTED_KEYS[key]:
                    raise ConfigError(f"speculative config key {key!r} is a vLLM option specdec does not support "
                                      f"(only its default {UNSUPPORTED_KEYS[key]!r} is accepted)")
                del obj[key]
            elif key not in known:
                raise ConfigError(f"unknown speculative config key {key!r} (extra keys are forbidden, as in vLLM); "
                                  f"accepted keys: {', '.join(sorted(known))}")
        return cls(**obj)

    def __post_init__(self):
        m = self.method
        if m is None:  # vLLM's inference: "ngram" model -> ngram, a dotted class path -> custom_class, else draft_model
            if self.model in ("ngram", "[ngram]"):
                m = "ngram"
            elif self.model and "/" not in self.model and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", self.model) \
                    and not os.path.exists(self.model):
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
            raise ConfigError(f"unknown speculative method {m!r}; accepted methods: {', '.join(SPEC_METHODS)} "
                              f"(and the *_mtp aliases of mtp)")
        self.method = m
        k = self.num_speculative_tokens
        if self.model is None and k is not None:
            if m in ("dflash", "draft_model"):
                raise ConfigError("num_speculative_tokens was provided but without speculative model.")
            self.model = m if m == "ngram" else None  # mtp / dspark: the target checkpoint itself
        if k is None:
            raise ConfigError("num_speculative_tokens must be provided with speculative model unless the draft "
                              "model config contains an n_predict parameter.")
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ConfigError(f"num_speculative_tokens must be a positive integer, got {k!r}")
        if m == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ConfigError(f"{name} must be a positive integer, got {v!r}")
            if lo > hi:
                raise ConfigError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ConfigError("prompt_lookup_min / prompt_lookup_max are only valid with method 'ngram'")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ConfigError(f"draft_tensor_parallel_size={self.draft_tensor_parallel_size} cannot be other value "
                              "than 1 or target model tensor_parallel_size (1 in specdec)")
        if self.quantization not in (None, "none", "None"):
            raise ConfigError(f"draft quantization {self.quantization!r} is not supported; specdec runs drafts "
                              "in the target's dtype")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ConfigError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if self.rejection_sample_method not in ("standard", "synthetic"):
            raise ConfigError(f"rejection_sample_method must be 'standard' or 'synthetic', got "
                              f"{self.rejection_sample_method!r}")
        rates, length = self.synthetic_acceptance_rates, self.synthetic_acceptance_length
        if self.rejection_sample_method == "synthetic":
            if (rates is None) == (length is None):
                raise ConfigError("rejection_sample_method 'synthetic' needs exactly one of "
                                  "synthetic_acceptance_rates and synthetic_acceptance_length")
            if rates is not None:
                if not isinstance(rates, list) or len(rates) != k or any(not 0 <= r <= 1 for r in rates):
                    raise ConfigError(f"synthetic_acceptance_rates must be a list of {k} numbers in [0, 1], got {rates!r}")
                if any(b > a for a, b in zip(rates, rates[1:])):
                    raise ConfigError(f"synthetic_acceptance_rates must be non-increasing, got {rates!r}")
            elif not 1 <= length <= k + 1:
                raise ConfigError(f"synthetic_acceptance_length must be in [1, num_speculative_tokens + 1 = {k + 1}], "
                                  f"got {length!r}")
        elif rates is not None or length is not None:
            raise ConfigError("synthetic_acceptance_rates / synthetic_acceptance_length need "
                              "rejection_sample_method 'synthetic'")
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise ConfigError(f"draft_sample_method must be 'greedy' or 'probabilistic', got {self.draft_sample_method!r}")
        if self.dspark_draft_topk is not None:
            if m != "dspark":
                raise ConfigError("dspark_draft_topk is only valid with method 'dspark'")
            if not isinstance(self.dspark_draft_topk, int) or self.dspark_draft_topk < 1:
                raise ConfigError(f"dspark_draft_topk must be an integer >= 1, got {self.dspark_draft_topk!r}")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")

    def conditional_rates(self):
        """Synthetic mode: the probability of accepting position i given that positions < i were accepted."""
        if self.synthetic_acceptance_rates is not None:
            return list(self.synthetic_acceptance_rates)
        L, k = self.synthetic_acceptance_length, self.num_speculative_tokens
        whole = int(math.floor(L - 1))
        return [1.0 if i < whole else (L - 1 - whole if i == whole else 0.0) for i in range(k)]

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
    def __init__(self, vocab, merges=None, added_tokens=None, pattern=QWEN_PATTERN, eos_token=None,
                 special=None, nfc=True, ignore_merges=False):
        """vocab: byte-level token string -> id; merges: "a b" strings or [a, b] pairs in priority order
        (None: ids are the merge ranks, as in tiktoken files); added_tokens: text -> id, matched whole;
        special: the added tokens that decode(skip_special=True) drops (default: all of them);
        ignore_merges: HF's flag, a pre-token that is a vocab token is taken whole even if no merge makes it."""
        added_tokens = dict(added_tokens or {})
        self.nfc, self._vocab = nfc, vocab
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

        # tiktoken merges the adjacent pair whose *merged token* has the lowest rank; HF BPE applies the
        # merge with the lowest *merge index*. So a token's tiktoken rank must be its merge priority.
        if merges is None:  # tiktoken-style vocab: ids are the ranks
            order = sorted(vocab, key=vocab.get)
        else:
            prio = {}
            for p, m in enumerate(merges):
                a, b = m.split(" ") if isinstance(m, str) else m
                if a not in vocab or b not in vocab or a + b not in vocab:
                    raise ValueError(f"merge {m!r} refers to a token that is not in the vocab")
                prio.setdefault(a + b, p)  # several merges making one token: the first one wins
            # "orphans" (multi-byte tokens no merge makes) are unreachable in HF BPE: leave them out. With
            # ignore_merges HF takes a pre-token that is an orphan whole, like tiktoken does; add the orphans
            # no two mergeable tokens spell, as tiktoken can only ever take those whole too.
            order = sorted((t for t in vocab if len(tok_bytes[t]) == 1), key=vocab.get) + sorted(prio, key=prio.get)
            if ignore_merges:
                have = {tok_bytes[t] for t in order}
                order += sorted((t for t in vocab if t not in prio and len(b := tok_bytes[t]) > 1
                                 and not any(b[:k] in have and b[k:] in have for k in range(1, len(b)))), key=vocab.get)
        merged_ids = [vocab[t] for t in order if len(tok_bytes[t]) > 1 and (merges is None or t in prio)]
        if all(i < j for i, j in zip(merged_ids, merged_ids[1:])):  # ids follow merge order: rank = id
            self._rank_to_id = None
            ranks = {tok_bytes[t]: vocab[t] for t in order}
            specials = added_tokens
        else:  # ranks follow merge order, and a table maps them back to ids
            self._rank_to_id = [vocab[t] for t in order] + list(added_tokens.values())
            ranks = {tok_bytes[t]: r for r, t in enumerate(order)}
            specials = {t: len(order) + k for k, t in enumerate(added_tokens)}
        self._enc = tiktoken.Encoding("specdec", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
        if eos_token is None:
            eos_token = next((t for t in ("<|im_end|>", "<|endoftext|>") if t in added_tokens), None)
        self.eos_token_id = None if eos_token is None else self.id_of(eos_token)

    @classmethod
    def from_dir(cls, path):
        """Load a HF tokenizer.json (+ tokenizer_config.json for eos_token) of the Qwen3.5 kind."""
        with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
            tj = json.load(f)
        model = tj.get("model") or {}
        if model.get("type") != "BPE":
            raise ValueError(f"tokenizer.json: model type {model.get('type')!r} is not supported, only byte-level BPE")
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
                raise ValueError(f"tokenizer.json: added token {t['content']!r} uses lstrip/rstrip/single_word")
            added[t["content"]] = t["id"]
            if t.get("special"):
                special.add(t["content"])
        eos = None
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
        return cls(model["vocab"], model.get("merges", []), added, steps[0]["pattern"]["Regex"], eos,
                   special, nfc=norm == "NFC", ignore_merges=bool(model.get("ignore_merges")))

    def encode(self, text, allow_special=True):
        """Text -> ids. Added tokens in the text become single ids (with allow_special=False only the
        non-special ones, e.g. <think>, as HF does with encode_special_tokens=True)."""
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        allowed = self._nonspecial | self._special if allow_special else self._nonspecial
        ids = self._enc.encode(text, allowed_special=allowed, disallowed_special=())
        return ids if self._rank_to_id is None else [self._rank_to_id[r] for r in ids]

    def token_bytes(self, i):
        return self._bytes[i] if 0 <= i < self.vocab_size else b""

    def decode_bytes(self, ids, skip_special=False):
        ids = ids.tolist() if hasattr(ids, "tolist") else ids  # torch/numpy ids too
        ids = [ids] if isinstance(ids, int) else ids
        skip = self._special_id_set if skip_special else ()
        return b"".join(self.token_bytes(i) for i in ids if i not in skip)

    def decode(self, ids, skip_special=False):
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

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
    """Streams text out of token ids; bytes of a not yet complete UTF-8 character are held back."""

    def __init__(self, tokenizer, skip_special=False):
        self.tok, self.skip_special = tokenizer, skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything emitted so far, for the caller's stop-string checks

    def add(self, ids):
        new = self._utf8.decode(self.tok.decode_bytes(ids, self.skip_special))
        self.text += new
        return new

    def flush(self):
        new = self._utf8.decode(b"", final=True)  # a dangling partial character becomes U+FFFD
        self.text += new
        return new


def _content_text(content):
    # message content: a string, None, or a list of {"type": "text", "text": ...} parts
    if content is None or isinstance(content, str):
        return content or ""
    if any("text" not in part for part in content):
        raise ValueError("only text content parts are supported (no images, video or audio)")
    return "".join(part["text"] for part in content)


def apply_chat_template(messages, add_generation_prompt=True, enable_thinking=True, preserve_thinking=False,
                        tools=None):
    """Qwen3.5/3.6 chat prompt (ChatML), following the published chat_template.jinja for text-only chats."""
    if tools:
        raise ValueError("tool definitions are not supported by this chat template")
    texts = [_content_text(m.get("content")).strip() for m in messages]
    # the last real user query (not a tool response): assistant turns after it keep their reasoning
    is_query = [m["role"] == "user" and not (t.startswith("<tool_response>") and t.endswith("</tool_response>"))
                for m, t in zip(messages, texts)]
    last_query = max((i for i, q in enumerate(is_query) if q), default=None)
    if last_query is None:
        raise ValueError("no user query found in messages")
    out = []
    for i, (m, text) in enumerate(zip(messages, texts)):
        role = m["role"]
        if role == "system" and i > 0:
            raise ValueError("a system message must be the first message")
        if role in ("system", "user"):
            out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
        elif role == "assistant":
            if m.get("tool_calls"):
                raise ValueError("assistant tool_calls are not supported by this chat template")
            reasoning = m.get("reasoning_content")
            if not isinstance(reasoning, str):
                reasoning = ""
                if "</think>" in text:  # reasoning written inline as <think>...</think>
                    reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                    text = text.split("</think>")[-1].lstrip("\n")
            if preserve_thinking or i > last_query:
                out.append(f"<|im_start|>assistant\n<think>\n{reasoning.strip()}\n</think>\n\n{text}<|im_end|>\n")
            else:
                out.append(f"<|im_start|>assistant\n{text}<|im_end|>\n")
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

# ==============================================================================================
# Model
# ==============================================================================================

class Linear(nn.Linear):
    """nn.Linear without bias, through kernels.linear (batch-invariant on the CPU reference path)."""
    def __init__(self, n_in, n_out, bias=False):
        super().__init__(n_in, n_out, bias=False)

    def forward(self, x):
        return K.linear(x, self.weight)


class RMSNorm(nn.Module):
    """Qwen3.5/3.6's zero-centred RMSNorm: the stored weight w scales by (1 + w). plain=True: Qwen3's (the
    drafters' layers), y = w * (x_f32 * rsqrt(mean(x^2) + eps)).to(dtype)."""
    def __init__(self, dim, eps, plain=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if plain else torch.zeros(dim))
        self.eps, self.plain = eps, plain

    def forward(self, x):
        return (K.plain_rms_norm if self.plain else K.rms_norm)(x, self.weight, self.eps)


@dataclass
class Ctx:
    """What one forward step needs besides the tokens: which state slots, at which positions, how."""
    state: "State"
    slots: torch.Tensor          # [B] long, state slot of each row
    pos: torch.Tensor            # [B] long, position of each row's first token
    kv_len: int                  # cache prefix attention must look at (>= max(pos) + T)
    mode: str = "decode"         # "prefill" (chunked GDN), "decode" (T tokens, commit all), "verify"
    no_write: "torch.Tensor | None" = field(init=False, default=None)  # verify: [B] zeros, the GDN kernels' n_keep

    def __post_init__(self):
        # A verify leaves the GDN states as they are (n_keep = 0). The zeros are the state's own, allocated once: a
        # tensor made here would die with the Ctx, and a CUDA graph captured with this Ctx would then read freed
        # memory on every replay (in 0d2d4b3 it did: garbage n_keep, illegal memory accesses on the H200).
        if self.mode == "verify":
            self.no_write = self.state.keep_none[:self.slots.shape[0]]



class Attention(nn.Module):
    """Gated full attention: per-head [query | gate] from q_proj, q/k RMSNorm, partial RoPE, GQA."""
    def __init__(self, cfg, layer_id):
        super().__init__()
        self.layer_id, self.nh, self.nkv, self.hd = layer_id, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H = cfg.hidden_size
        self.q_proj = Linear(H, 2 * self.nh * self.hd, bias=False)
        self.k_proj = Linear(H, self.nkv * self.hd, bias=False)
        self.v_proj = Linear(H, self.nkv * self.hd, bias=False)
        self.o_proj = Linear(self.nh * self.hd, H, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        rd = cfg.rotary_dim
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, rd, 2).float() / rd), persistent=False)

    def forward(self, x, ctx):
        B, T, _ = x.shape
        if hasattr(self, "qkv"):  # fused after loading: one GEMM, views of its output
            qg, k, v = K.linear(x, self.qkv).split([2 * self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        else:
            qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qg = qg.view(B, T, self.nh, 2 * self.hd)                                     # per head [query | gate]
        k, v = k.view(B, T, self.nkv, self.hd), v.view(B, T, self.nkv, self.hd)
        k_cache, v_cache = ctx.state.kv[self.layer_id]
        # q/k norm + RoPE, and k, v written into the cache at positions pos[b] + t (one kernel on the GPU)
        q = K.attention_prep(qg, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.inv_freq,
                             k_cache, v_cache, ctx.slots, ctx.pos)                   # [B, T, nh, hd]
        o = K.attention(q, k_cache, v_cache, ctx.slots, ctx.pos, ctx.kv_len)       # [B, T, nh, hd]
        return self.o_proj(K.sigmoid_mul(o, qg[..., self.hd:]).view(B, T, -1))     # output gate: sigmoid(gate)


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule; its state is a conv window plus a d_k x d_v matrix per head."""
    def __init__(self, cfg, layer_id):
        super().__init__()
        self.layer_id, self.cfg = layer_id, cfg
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

    def forward(self, x, ctx):
        B, T, _ = x.shape
        st = ctx.state
        c = self.cfg
        if hasattr(self, "in_proj"):  # fused after loading: one GEMM, views of its output
            mixed, z, b, a = K.linear(x, self.in_proj).split(
                [c.conv_dim, c.value_dim, c.linear_num_value_heads, c.linear_num_value_heads], -1)
        else:
            mixed, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        # mixed [B, T, C] pre-conv inputs; z [B, T, value_dim] output gate; a, b [B, T, H_v] raw decay / beta
        z = z.reshape(B, T, -1, c.linear_value_head_dim)
        # a verify passes n_keep = zeros (ctx.no_write): the states stay; commit() advances them afterwards
        y = K.causal_conv(mixed, st.conv[self.layer_id], ctx.slots, self.conv1d.weight[:, 0], ctx.no_write)
        q, k, v = self.split(y, B, T)
        if ctx.mode == "prefill" and T > 1:
            g, beta = K.gdn_gates(a, b, self.A_log, self.dt_bias)  # beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
            o = K.gdn_chunked(q, k, v, g, beta, st.rec[self.layer_id], ctx.slots)
        else:  # the gates are computed inside the recurrent kernel
            o = K.gdn_recurrent_gated(q, k, v, a, b, self.A_log, self.dt_bias, st.rec[self.layer_id], ctx.slots,
                                      ctx.no_write)
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
        return self.out_proj(o.reshape(B, T, -1))

    def commit(self, ctx, n_keep):
        """After a verify: advance the conv window and recurrent state by the first n_keep[b] tokens."""
        mixed, q, k, v, a, b = ctx.state.stash.pop(self.layer_id)  # states only: the verify made the outputs
        K.gdn_recurrent_gated(q, k, v, a, b, self.A_log, self.dt_bias, ctx.state.rec[self.layer_id], ctx.slots, n_keep,
                              outputs=False, conv=(mixed, ctx.state.conv[self.layer_id]))  # + conv window: one launch


class MLP(nn.Module):
    def __init__(self, H, I):
        super().__init__()
        self.gate_proj = Linear(H, I, bias=False)
        self.up_proj = Linear(H, I, bias=False)
        self.down_proj = Linear(I, H, bias=False)

    def forward(self, x, residual=None):
        """down(silu(gate x) * up x) [+ residual: the layer's skip connection, added by the down GEMM's kernel]."""
        if hasattr(self, "gate_up"):  # fused after loading (fuse_projections): one GEMM, one activation kernel
            return K.linear(K.silu_mul(K.linear(x, self.gate_up)), self.down_proj.weight, residual)
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return y if residual is None else residual + y


class MoE(nn.Module):
    """Top-k routed experts (fp32 softmax, renormalised) plus one shared expert behind a sigmoid gate."""
    def __init__(self, cfg):
        super().__init__()
        H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.gate = Linear(H, E, bias=False)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))  # [E, 2I, H]: gate rows, then up rows
        self.experts.down_proj = nn.Parameter(torch.zeros(E, H, I))         # [E, H, I]
        self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(H, 1, bias=False)

    def forward(self, x, residual=None):
        """The routed experts plus the gated shared expert [+ residual], as one output (one fused epilogue)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                                # [N, H]
        if hasattr(self, "router_shared"):  # fused after loading: router | shared gate | shared gate_up, one GEMM
            E, I = self.experts.gate_up_proj.shape[0], self.shared_expert.down_proj.weight.shape[1]
            logits, sg, gu = K.linear(x, self.router_shared).split([E, 1, 2 * I], -1)
            shared = self.shared_expert.down_proj(K.silu_mul(gu))
        else:
            logits, sg, shared = self.gate(x), self.shared_expert_gate(x), self.shared_expert(x)
        w, idx = K.moe_route(logits, self.top_k)
        res = None if residual is None else residual.reshape(-1, shape[-1])
        return K.moe_experts(x, w, idx, self.experts.gate_up_proj, self.experts.down_proj, shared, sg, res).view(shape)


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

    def forward(self, x, ctx):
        mixer = self.self_attn if hasattr(self, "self_attn") else self.linear_attn
        y, x = K.add_rms_norm(mixer(self.input_layernorm(x), ctx), x, self.post_attention_layernorm.weight,
                              self.post_attention_layernorm.eps)                     # x + mixer, and its norm
        return self.mlp(y, residual=x)                                               # x + mlp(y)


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
        return self.norm(self.layers[0](x, ctx))


class Qwen36(nn.Module):
    """The text decoder. forward() returns final-norm hidden states; logits() applies the lm_head
    only where logits are needed. Parameter names are the checkpoint's, minus `model.[language_model.]`."""
    def __init__(self, cfg, with_mtp=True):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, t == "full_attention") for i, t in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPHead(cfg) if with_mtp and cfg.mtp_num_hidden_layers > 0 else None

    def forward(self, ids, ctx, taps=()):
        """Final-norm hidden states [B, T, H]; with `taps` (layer ids, "output of layer i", -1 = the
        embeddings) also the list of those layers' outputs, for drafters that read them (DFlash, DSpark)."""
        x = self.embed_tokens(ids)                                                   # [B, T, H]
        aux = [x] if -1 in taps else []
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx)
            if i in taps:
                aux.append(x)
        return (self.norm(x), aux) if taps else self.norm(x)

    def logits(self, h):
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return K.linear(h, w).float()

    def commit(self, ctx, n_keep):
        """Bring every GDN layer's state to the end of the accepted prefix of the last verify."""
        for layer in self.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.commit(ctx, n_keep)


def fuse_projections(model):
    """For inference: concatenate the projections that read the same input (GDN in_proj_qkv/z/b/a, attention
    q/k/v, MLP gate/up; MoE router, shared-expert gate and shared expert gate/up) into one weight each; the
    original parameters become views of it, so nothing is stored twice. A decode step then launches one GEMM
    where it launched four, three or two (MoE: four small GEMMs, which are launch-bound, become one)."""
    def fuse(mod, attr, linears):
        w = torch.cat([l.weight for l in linears])
        setattr(mod, attr, w)
        at = 0
        for l in linears:
            n = l.weight.shape[0]
            l.weight = nn.Parameter(w[at:at + n], requires_grad=False)
            at += n
    in_moe = set()
    for m in model.modules():  # parents before children: a MoE's shared expert is fused with its router
        if isinstance(m, GatedDeltaNet):
            fuse(m, "in_proj", [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a])
        elif isinstance(m, Attention):
            fuse(m, "qkv", [m.q_proj, m.k_proj, m.v_proj])
        elif isinstance(m, MoE):
            se = m.shared_expert
            fuse(m, "router_shared", [m.gate, m.shared_expert_gate, se.gate_proj, se.up_proj])
            in_moe.add(id(se))
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
        self.dummy_slot, self.max_len = num_slots, max_len
        self.kv, self.conv, self.rec, self.stash = {}, {}, {}, {}
        self.keep_none = torch.zeros(S, dtype=torch.long, device=device)  # n_keep = 0 per row: a verify (Ctx)
        kv_shape = (S, max_len, cfg.num_key_value_heads, cfg.head_dim)
        ids = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] + (["mtp"] if mtp else [])
        for i in ids:
            self.kv[i] = (torch.zeros(kv_shape, dtype=dtype, device=device), torch.zeros(kv_shape, dtype=dtype, device=device))
        for i, t in enumerate(cfg.layer_types):
            if t == "linear_attention":
                self.conv[i] = torch.zeros(S, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
                self.rec[i] = torch.zeros(S, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                          cfg.linear_value_head_dim, dtype=torch.float32, device=device)

    def reset(self, slot):
        """A new sequence starts from zero GDN state (stale KV beyond its length is never read)."""
        for t in (*self.conv.values(), *self.rec.values()):
            t[slot].zero_()


# ==============================================================================================
# Proposers: draft k tokens per sequence. One interface (a class taking (engine, spec)):
#   prefill(engine, req, hidden, ids, pos)   see a prompt chunk (model drafters fill their caches):
#       hidden [1, T, H] final-norm target states at positions pos.., ids [1, T] the next token of each
#   propose(engine, reqs) -> (drafts [B, k] long, -1 = no draft; draft_probs [B, k, V] or None)
#   commit(engine, reqs, hidden, ids, n_acc, tokens)   see the verified step [B, k+1], keep the accepted prefix
#   taps (optional attribute): target layers whose outputs the proposer reads; after every target forward
#       (prefill chunk or verify) engine.aux holds them, [B, T, H] each, in the same order
# ==============================================================================================

def ngram_lookup_ref(ctx, k, lo, hi):
    """vLLM's prompt lookup, plainly: the longest suffix n-gram of ctx (lo <= n <= hi) that occurred earlier, its
    earliest occurrence, and up to k tokens that followed it."""
    N = len(ctx)
    for n in range(min(hi, N - 1), lo - 1, -1):
        tail = ctx[N - n:]
        for start in range(0, N - n):
            if ctx[start:start + n] == tail:
                return ctx[start + n:start + n + k]
    return []


def ngram_lookup(ctx, k, lo, hi):
    """ngram_lookup_ref vectorised with numpy (it runs on the host every step, over prompt + output)."""
    a = np.asarray(ctx, dtype=np.int64)
    N = len(a)
    for n in range(min(hi, N - 1), lo - 1, -1):
        hits = (np.lib.stride_tricks.sliding_window_view(a[:N - 1], n) == a[N - n:]).all(1)  # starts 0 .. N-n-1
        if hits.any():
            start = int(hits.argmax())
            return ctx[start + n:start + n + k]
    return []


class NgramProposer:
    def __init__(self, engine, spec):
        self.k, self.lo, self.hi = spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max

    def prefill(self, engine, req, hidden, ids, pos):
        pass

    def propose(self, engine, reqs):
        drafts = torch.full((len(reqs), self.k), -1, dtype=torch.long)
        for b, r in enumerate(reqs):
            room = engine.max_model_len - len(r.tokens)
            d = ngram_lookup(r.tokens, min(self.k, room), self.lo, self.hi) if room > 0 else []
            drafts[b, :len(d)] = torch.tensor(d, dtype=torch.long)
        return engine.h2d(drafts), None

    def commit(self, engine, reqs, hidden, ids, n_acc, tokens):
        pass


def draft_noise(engine, reqs, k):
    """Per-request inputs of probabilistic drafting: temperatures [B] and uniforms [B, k] from each
    request's generator (drawn on the host so a captured graph can take them as inputs)."""
    t = engine.h2d([r.params.temperature if not r.params.greedy else 1e-5 for r in reqs])
    return t, engine.h2d(torch.stack([torch.rand(k, generator=r.gen) for r in reqs]))


def draft_pick(logits, temp=None, u=None):
    """Greedy drafting (temp None: argmax, verified as one-hot q) or probabilistic drafting (sample with the
    uniforms u [B] from softmax(logits / temp), which is returned as q)."""
    if temp is None:
        return logits.argmax(-1), None
    q = (logits / temp[:, None]).softmax(-1)
    return sample_from(q, u), q


class MTPProposer:
    """The target's own MTP layer, chained k times. Its KV cache ("mtp") gets one entry per target
    position: (h_t, embed(x_{t+1})) at position t, written over the prompt at prefill and over the
    accepted tokens after each verify. The MTP output hidden at the last committed position is kept
    per slot; propose() turns it into d1 and feeds its own output back for d2..dk. On the GPU the
    whole chain, and the commit pass, run as captured graphs."""
    def __init__(self, engine, spec):
        self.engine, self.k, self.greedy = engine, spec.num_speculative_tokens, spec.draft_sample_method == "greedy"
        m = engine.model
        self.hidden = torch.zeros(engine.max_num_seqs + 1, m.cfg.hidden_size, dtype=engine.dtype, device=engine.device)

    def _run(self, engine, ids, hidden, slots, pos, kv_len):
        m = engine.model
        return m.mtp(m.embed_tokens(ids), hidden, Ctx(engine.state, slots, pos, kv_len, "decode"))

    def prefill(self, engine, req, hidden, ids, pos):
        # ids: the chunk's tokens shifted left by one (the next token of each position)
        T = ids.shape[1]
        out = self._run(engine, ids, hidden, engine.slot_tensor([req]), torch.tensor([pos], device=engine.device), pos + T)
        self.hidden[req.slot] = out[0, -1]

    def _chain(self, kv_len, slots, pos, temp=None, u=None):
        m, drafts, probs = self.engine.model, [], []
        h = self.hidden[slots]                                                       # [B, H]
        for j in range(self.k):
            if j > 0:
                h = self._run(self.engine, drafts[-1][:, None], h[:, None], slots, pos + j, kv_len)[:, 0]
            d, q = draft_pick(m.logits(h), temp, None if u is None else u[:, j])
            drafts.append(d)
            probs.append(q)
        return torch.stack(drafts, 1), None if temp is None else torch.stack(probs, 1)

    def propose(self, engine, reqs):
        inputs = dict(slots=engine.cur_slots, pos=engine.cur_pos - 1)                # position of the kept hidden
        if not self.greedy:
            inputs["temp"], inputs["u"] = draft_noise(engine, reqs, self.k)
        return engine.call("mtp-propose", self._chain, engine.kv_len(reqs, self.k - 1, engine.state.max_len), inputs)

    def _commit(self, kv_len, slots, pos, nxt, hidden, n_acc):
        out = self._run(self.engine, nxt, hidden, slots, pos, kv_len)                 # [B, k+1, H]
        self.hidden[slots] = out[torch.arange(out.shape[0], device=out.device), n_acc]
        return ()

    def commit(self, engine, reqs, hidden, ids, n_acc, tokens):
        # position p+i gets (h_{p+i}, x_{p+i+1}): the drafts, with the correction/bonus token at n_acc
        rows = torch.arange(ids.shape[0], device=ids.device)
        nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)
        nxt[rows, n_acc] = tokens[rows, n_acc]
        engine.call("mtp-commit", self._commit, engine.kv_len(reqs, ids.shape[1], engine.state.max_len),
                    dict(slots=engine.cur_slots, pos=engine.cur_pos, nxt=nxt, hidden=hidden, n_acc=n_acc))


PROPOSERS = {"ngram": NgramProposer, "mtp": MTPProposer}  # method -> class(engine, spec)


# ==============================================================================================
# Model drafters: dflash, dspark (block drafters on the target's taps) and draft_model
# ==============================================================================================
# dflash, dspark: block drafters reading the target's hidden-state taps; draft_model: a separate small LM.
# Facts from z-lab/dflash, deepseek-ai/DeepSpec, vllm-project/speculators and vLLM (shared/reference/
# speculative-methods.md §5, §6, §8).
#
# A block drafter is a stack of plain Qwen3 layers (RMSNorm x*w, not zero-centred; no output gate; full NeoX RoPE)
# with its own KV cache, indexed by position. Committed tokens enter it as "context" K/V: c = hidden_norm(fc(concat
# taps)), then per layer k = RoPE(k_norm(k_proj(c))), v = v_proj(c) (no input_layernorm). A draft is one forward
# over [anchor, mask x (Q-1)] at positions P..P+Q-1, each query seeing all context before P and the whole block.
# DFlash: Q = K+1, mask slot j predicts position P+j. DSpark: Q = K, slot j predicts P+j+1 (the anchor predicts
# too), then a low-rank Markov bias is added token by token. Rejected context needs no rollback: the next block
# overwrites those positions before anything reads them.

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


def qwen3_fields(d, where):
    """DraftConfig fields of a Qwen3 config dict, and its layer_types."""
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: unsupported hidden_act {d['hidden_act']!r}; only silu is implemented")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"{where}: unsupported RoPE scaling {rope!r}; only default RoPE is implemented")
    n = d["num_hidden_layers"]
    types = d.get("layer_types") or ["sliding_attention" if d.get("use_sliding_window") and
                                     i >= d.get("max_window_layers", n) else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - {"full_attention", "sliding_attention"}:
        raise ConfigError(f"{where}: layer_types must list {n} full_attention/sliding_attention entries, got {types}")
    return dict(hidden_size=d["hidden_size"], num_hidden_layers=n, num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
                head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
                intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"],
                rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", d.get("rope_theta", 1e6)),
                attention_bias=bool(d.get("attention_bias", False)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False))), types


def read_config(path, what):
    f = os.path.join(str(path), "config.json")
    if not os.path.isfile(f):
        raise ConfigError(f"{what} {path}: no config.json (expected a Hugging Face checkpoint directory)")
    with open(f) as fh:
        return json.load(fh)


def read_block_config(path, method):
    """config.json of a DFlash/DSpark draft in any published layout -> DraftConfig (ids in our tap convention)."""
    top = read_config(path, f"{method} draft")
    arch, smt = top.get("architectures") or [], top.get("speculators_model_type")
    if smt in ("dflash", "dspark"):  # speculators: the layer config nested, aux ids in vLLM's "entering layer L"
        kind, base, dc, layout = smt, top["transformer_layer_config"], {}, f"speculators {smt}"
        ids = [i - 1 for i in top["aux_hidden_state_layer_ids"]]
        from_anchor = top.get("sample_from_anchor", smt == "dspark")
    elif "DFlashDraftModel" in arch:  # z-lab
        kind, base, dc, layout = "dflash", top, top.get("dflash_config") or {}, "z-lab DFlashDraftModel"
        ids, from_anchor = dc.get("target_layer_ids"), dc.get("sample_from_anchor", False)
    elif "Qwen3DSparkModel" in arch or ("DSparkDraftModel" in arch and top.get("model_type") == "qwen3"):  # DeepSpec
        kind, base, dc, layout = "dspark", top, top.get("dflash_config") or {}, "DeepSpec Qwen3DSparkModel"
        ids, from_anchor = top.get("target_layer_ids"), True
    else:
        raise ConfigError(f"{method} draft {path}: not a DFlash/DSpark checkpoint (architectures {arch}); expected "
                          "DFlashDraftModel (z-lab), Qwen3DSparkModel (DeepSpec) or speculators_model_type dflash/dspark")
    where = f"{method} draft {path} ({layout})"
    if kind != method:
        raise ConfigError(f"{where} is a {kind} checkpoint: use method {kind!r}")
    fields, types = qwen3_fields(base, where)
    for key, ok in (("use_aux_hidden_state", (True,)), ("attention_sink_bias", (False,)),
                    ("projector_type", (None, "linear")), ("markov_head_type", ("vanilla",))):
        v = dc.get(key, top.get(key, ok[0]))
        if v not in ok:
            raise ConfigError(f"{where}: {key}={v!r} is not supported (only {ok[0]!r})")
    if ids is None or (mask := dc.get("mask_token_id", top.get("mask_token_id"))) is None:
        raise ConfigError(f"{where}: the config must give target_layer_ids and mask_token_id")
    if method == "dflash" and from_anchor:
        raise ConfigError(f"{where}: sample_from_anchor=true is not supported for dflash")
    # attention per layer, vLLM's rule: sliding layers (or all with use_swa) get the window; is_causal, then
    # dflash_config.causal, override the default "sliding layers are causal" (speculators: unless non-causal)
    sliding = [t == "sliding_attention" for t in types]
    if dc.get("use_swa") and not any(sliding):
        sliding = [True] * len(types)
    window = dc.get("swa_window_size", base.get("sliding_window"))
    if any(sliding) and not window:
        raise ConfigError(f"{where}: sliding attention needs a window (dflash_config.swa_window_size or sliding_window)")
    forced = top.get("is_causal", dc.get("causal"))
    causal = [bool(forced) if forced is not None else s and not top.get("sliding_window_non_causal", False)
              for s in sliding]
    return DraftConfig(**fields, windows=[window if s else None for s in sliding], causal=causal,
                       block_size=int(top.get("block_size", dc.get("block_size", 16))), mask_token_id=int(mask),
                       target_layer_ids=list(ids), from_anchor=bool(from_anchor),
                       draft_vocab_size=top.get("draft_vocab_size"),
                       markov_rank=int(dc.get("markov_rank", top.get("markov_rank", 0))),
                       confidence_with_markov=bool(top.get("confidence_head_with_markov", False)))


def block_attention(q, k_cache, v_cache, slots, pos, kv_len, causal=False, window=None):
    """Attention of T queries at positions pos[b]..pos[b]+T-1 over the slot's cached keys (the block's own
    keys already written). Non-causal (DFlash/DSpark blocks): every query sees all keys < pos[b]+T; causal: keys up
    to its own position. A sliding `window` W (z-lab's rule) also requires q_pos - k_pos < W and, when non-causal,
    k_pos - q_pos < W. q [B, T, n_h, d]; k_cache, v_cache [S, L, n_kv, d]; slots, pos [B]; kv_len >= max(pos)+T.
    Returns [B, T, n_h, d]. Without a window this is kernels.attention (the GPU kernel); else a masked reference."""
    B, T, nh, d = q.shape
    if window is None and causal:
        return K.attention(q, k_cache, v_cache, slots, pos, kv_len)
    if window is None:
        # non-causal = every query placed at the block's last position: fold the T queries into the head axis
        # (head h*T + t keeps KV head h // group), so the causal kernel serves it as one decode token
        qf = q.transpose(1, 2).reshape(B, 1, nh * T, d)
        return K.attention(qf, k_cache, v_cache, slots, pos + T - 1, kv_len).view(B, nh, T, d).transpose(1, 2)
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
    """Qwen3 attention (per-head q/k RMSNorm, full NeoX RoPE, GQA, no output gate) over a position-indexed cache."""
    def __init__(self, c, layer_id):
        super().__init__()
        self.layer_id, self.nh, self.nkv, self.hd = layer_id, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.causal, self.window = c.causal[layer_id], c.windows[layer_id]
        H, b = c.hidden_size, c.attention_bias
        self.q_proj = nn.Linear(H, self.nh * self.hd, bias=b)
        self.k_proj = nn.Linear(H, self.nkv * self.hd, bias=b)
        self.v_proj = nn.Linear(H, self.nkv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=b)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps, plain=True)
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps, plain=True)
        self.theta = c.rope_theta
        self.register_buffer("inv_freq", torch.zeros(self.hd // 2), persistent=False)  # set by load_weights

    def write_kv(self, x, ctx, q=None):
        """k = RoPE(k_norm(k_proj(x))), v = v_proj(x) into the cache at ctx.pos.. (x [B, T, H]); with the query
        projection q [B, T, nh, hd] also returns RoPE(q_norm(q)). One kernel on the GPU (kernels.attention_prep)."""
        B, T, _ = x.shape
        k, v = self.k_proj(x).view(B, T, self.nkv, self.hd), self.v_proj(x).view(B, T, self.nkv, self.hd)
        k_cache, v_cache = ctx.state.kv[self.layer_id]
        return K.attention_prep(k[:, :, :0] if q is None else q, k, v, self.q_norm.weight, self.k_norm.weight,
                                self.k_norm.eps, self.inv_freq, k_cache, v_cache, ctx.slots, ctx.pos, plain=True)

    def forward(self, x, ctx):
        B, T, _ = x.shape
        q = self.write_kv(x, ctx, self.q_proj(x).view(B, T, self.nh, self.hd))
        k_cache, v_cache = ctx.state.kv[self.layer_id]
        o = block_attention(q, k_cache, v_cache, ctx.slots, ctx.pos, ctx.kv_len, self.causal, self.window)
        return self.o_proj(o.reshape(B, T, -1))                                     # [B, T, H]


class Qwen3Layer(nn.Module):
    def __init__(self, c, layer_id):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, plain=True)
        self.self_attn = Qwen3Attention(c, layer_id)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, plain=True)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def forward(self, x, ctx):
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3LM(nn.Module):
    """A plain Qwen3 causal LM (draft_model), with Qwen36's interface: forward -> final-norm hidden, logits, commit."""
    def __init__(self, c):
        super().__init__()
        self.cfg = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Qwen3Layer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, plain=True)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, ids, ctx):
        x = self.embed_tokens(ids)                                                   # [B, T, H]
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)

    logits = Qwen36.logits

    def commit(self, ctx, n_keep):
        pass  # attention only: the position-indexed cache needs no rollback


class KVCache:
    """Per-layer K, V caches [slots + 1, max_len, n_kv, head_dim] of a draft network (last slot: padding rows).
    Shaped like State for the Qwen3 layers; nothing recurrent, so nothing to reset or roll back."""
    def __init__(self, c, num_slots, max_len, dtype, device):
        shape = (num_slots + 1, max_len, c.num_key_value_heads, c.head_dim)
        self.kv = {i: (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                   for i in range(c.num_hidden_layers)}
        self.conv, self.rec, self.stash, self.dummy_slot, self.max_len = {}, {}, {}, num_slots, max_len
        self.keep_none = torch.zeros(num_slots + 1, dtype=torch.long, device=device)  # as State's

    def reset(self, slot):
        pass


DRAFT_SKIP = ("t2d", "verifier_norm.weight", "verifier_lm_head.weight")  # training-only tensors (speculators)


def load_weights(module, tensors, dtype, device, where, rename=lambda n: n):
    """Fill a module built on the meta device from {checkpoint name: file}: every parameter found with its shape,
    every tensor used (integer tensors such as d2t keep their dtype); RoPE frequencies computed on the device."""
    from safetensors import safe_open
    want, have, handles = dict(module.named_parameters()), {rename(n): n for n in tensors}, {}
    for m, n in have.items():
        if m not in want:
            raise ConfigError(f"unexpected tensor {n!r} in {where}")
    for m, p in want.items():
        if m not in have:
            raise ConfigError(f"missing tensor {m!r} in {where}")
        f = tensors[have[m]]
        if f not in handles:
            handles[f] = safe_open(f, "pt")
        t = handles[f].get_tensor(have[m])
        if tuple(t.shape) != tuple(p.shape):
            raise ConfigError(f"tensor {have[m]!r} in {where} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        t = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
        mod, _, leaf = m.rpartition(".")
        module.get_submodule(mod)._parameters[leaf] = nn.Parameter(t, requires_grad=False)
    for a in module.modules():
        if isinstance(a, Qwen3Attention):
            a.inv_freq = 1.0 / a.theta ** (torch.arange(0, a.hd, 2, device=device).float() / a.hd)
    return module.eval()


class BlockDrafter(nn.Module):
    """The DFlash/DSpark draft network. Parameter names are the checkpoint's; the optional parts (own embed_tokens
    and lm_head, d2t, Markov head, confidence head) exist iff the checkpoint has them (`shapes`)."""
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
        self.d2t = nn.Parameter(torch.zeros(Vd, dtype=torch.long), requires_grad=False) if "d2t" in shapes else None
        self.markov_head = self.confidence_head = None
        if r:  # DSpark: bias_k = W2 . W1[prev]; W1 embeds target ids [V, r], W2 projects to draft logits [V_d, r]
            self.markov_head = nn.Module()
            self.markov_head.markov_w1 = nn.Embedding(V, r)
            self.markov_head.markov_w2 = nn.Linear(r, Vd, bias=False)
        if "confidence_head.proj.weight" in shapes:  # loaded, unused: fixed-block verification (no scheduler)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(H + (r if c.confidence_with_markov else 0), 1)
        self.draft_vocab_size = Vd

    def write_context(self, feats, ctx):
        """Context K/V of committed tokens from their concatenated target taps feats [B, T, n_taps * H_target]."""
        c = self.hidden_norm(self.fc(feats))                                         # [B, T, H]
        for layer in self.layers:
            layer.self_attn.write_kv(c, ctx)

    def forward(self, x, ctx):
        """x [B, Q, H] block embeddings at positions ctx.pos.. -> final-norm hidden [B, Q, H]."""
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


class BlockProposer:
    """method dflash / dspark: the block drafter, its KV cache (context written at prefill and after each verify),
    and drafting: one block forward, then argmax/sampling (DFlash) or the Markov stage (DSpark)."""
    def __init__(self, engine, spec):
        m, path, K, tcfg = spec.method, spec.model, spec.num_speculative_tokens, engine.model.cfg
        if path is None:
            raise ConfigError(f"method {m!r} needs 'model': the path of a {m} draft checkpoint "
                              "(Qwen3.5/3.6 targets do not ship one)")
        c, where = read_block_config(path, m), f"{m} draft {path}"
        L, ids = tcfg.num_hidden_layers, c.target_layer_ids
        if any(not -1 <= i < L for i in ids):
            raise ConfigError(f"{where}: target_layer_ids {ids} reference layers that do not exist in the target "
                              f"model ({L} layers: valid ids are -1 (embeddings) .. {L - 1}, 'output of layer i')")
        if m == "dspark" and K < c.block_size:  # vLLM's message
            raise ConfigError(f"DSpark requires num_speculative_tokens >= dspark_block_size ({c.block_size}); got {K}. "
                              f"Smaller values produce incorrect output. Use num_speculative_tokens={c.block_size} "
                              "or larger.")
        if c.vocab_size != tcfg.vocab_size:
            raise ConfigError(f"{where}: vocab_size {c.vocab_size} differs from the target's {tcfg.vocab_size}")
        from safetensors import safe_open
        tensors, shapes = {n: f for n, f in checkpoint_tensors(path).items() if n not in DRAFT_SKIP}, {}
        for f in set(tensors.values()):  # the header's shapes decide the optional parts and fc's input size
            with safe_open(f, "pt") as st:
                shapes.update({n: tuple(st.get_slice(n).get_shape()) for n in st.keys() if n in tensors})
        if "fc.weight" not in shapes:
            raise ConfigError(f"missing tensor 'fc.weight' in {where}")
        got = len(ids) * tcfg.hidden_size
        if shapes["fc.weight"][1] != got:  # vLLM's message
            raise ConfigError(f"DFlash drafter expects {shapes['fc.weight'][1]} concatenated aux hidden features but "
                              f"received {got} ({len(ids)} taps x hidden {tcfg.hidden_size}). This usually means the "
                              "draft model's target_layer_ids reference layers that do not exist in the target model "
                              "(incompatible draft/target pair).")
        with torch.device("meta"):
            net = BlockDrafter(c, shapes)
        self.net = fuse_projections(load_weights(net, tensors, engine.dtype, engine.device, where))  # MLP gate/up
        Vd = net.draft_vocab_size
        if Vd > tcfg.vocab_size or (Vd < tcfg.vocab_size and (net.d2t is None or net.lm_head is None)):
            raise ConfigError(f"{where}: draft vocabulary {Vd} vs the target's {tcfg.vocab_size}: a reduced draft "
                              "vocabulary needs the draft's lm_head and d2t; a larger one is not supported")
        if c.hidden_size != tcfg.hidden_size and (net.embed_tokens is None or net.lm_head is None):
            raise ConfigError(f"{where}: hidden_size {c.hidden_size} differs from the target's {tcfg.hidden_size}, so "
                              "the draft must ship its own embed_tokens and lm_head")
        if not 0 <= c.mask_token_id < tcfg.vocab_size:
            raise ConfigError(f"{where}: mask_token_id {c.mask_token_id} is outside the vocabulary")
        self.embed = net.embed_tokens or engine.model.embed_tokens
        self.mask_vec = self.embed.weight[c.mask_token_id]                           # [H]
        override = os.path.join(path, "mask_embedding.pt")  # some checkpoints ship a trained mask embedding
        if os.path.isfile(override):
            e = torch.load(override, weights_only=True)
            e = e["embedding"] if isinstance(e, dict) else e
            self.mask_vec = e.reshape(-1).to(engine.device, engine.dtype)
        self.logits = (lambda h: net.lm_head(h).float()) if net.lm_head is not None else engine.model.logits
        self.method, self.k, self.greedy = m, K, spec.draft_sample_method == "greedy"
        self.topk, self.V = spec.dspark_draft_topk, tcfg.vocab_size
        if self.topk is not None and self.topk > Vd:
            raise ConfigError(f"dspark_draft_topk={self.topk} exceeds the draft vocabulary ({Vd})")
        self.Q = K if c.from_anchor else K + 1                                       # block queries
        self.out = slice(0, K) if c.from_anchor else slice(1, K + 1)                 # the slots that draft
        self.taps = tuple(sorted(set(ids)))  # Qwen36.forward returns taps in layer order; self.order restores ours
        self.order = [self.taps.index(i) for i in ids]
        self.cache = KVCache(c, engine.max_num_seqs, engine.max_model_len + self.Q + K + 1, engine.dtype, engine.device)
        self.cfg = c

    # Drafting and the context write after a verify go through engine.call: captured graphs on the GPU (inputs
    # are device tensors, batch first; kv_len is then the cache length), eager elsewhere.
    def _context(self, kv_len, slots, pos, feats):
        self.net.write_context(feats, Ctx(self.cache, slots, pos, kv_len))
        return ()

    def _feats(self, engine):
        return torch.cat([engine.aux[i] for i in self.order], -1)                   # [B, T, n_taps * H_target]

    def prefill(self, engine, req, hidden, ids, pos):  # eager: prompt chunks come in any length
        self._context(0, engine.slot_tensor([req]), torch.tensor([pos], device=engine.device), self._feats(engine))

    def commit(self, engine, reqs, hidden, ids, n_acc, tokens):
        # all k+1 verified positions (a fixed shape): positions past the accepted prefix lie inside the next block,
        # which overwrites them before any query reads them
        engine.call(f"{self.method}-context", self._context, 0,
                    dict(slots=engine.cur_slots, pos=engine.cur_pos, feats=self._feats(engine)))

    def propose(self, engine, reqs):
        inputs = dict(slots=engine.cur_slots, pos=engine.cur_pos, anchor=engine.cur_last)  # the anchor and its position
        if not self.greedy:
            inputs["temp"], inputs["u"] = draft_noise(engine, reqs, self.k)
        return engine.call(f"{self.method}-propose", self._draft, engine.kv_len(reqs, self.Q, self.cache.max_len), inputs)

    def block_logits(self, kv_len, slots, pos, anchor):
        """The block forward over [anchor, mask x (Q-1)] at pos..: base draft logits [B, K, V_d] (fp32)."""
        x = torch.cat([self.embed(anchor)[:, None], self.mask_vec.expand(anchor.shape[0], self.Q - 1, -1)], 1)
        return self.logits(self.net(x, Ctx(self.cache, slots, pos, kv_len))[:, self.out])

    def _draft(self, kv_len, slots, pos, anchor, temp=None, u=None):
        U = self.block_logits(kv_len, slots, pos, anchor)                           # [B, K, V_d]
        if self.net.markov_head is None and self.topk is None:
            d, q = self._pick(U, temp, u)
        else:
            d, q = self._markov(U, anchor, temp, u)
        if self.net.d2t is not None and q is not None:                               # draft vocab -> target vocab
            cols = self._tid(torch.arange(q.shape[-1], device=q.device))
            q = q.new_zeros(*q.shape[:2], self.V).index_copy_(-1, cols, q)
        return self._tid(d), q

    def _tid(self, d):
        return d if self.net.d2t is None else d + self.net.d2t[d]

    def _pick(self, logits, temp, u):
        """draft_pick over positions: logits [B, n, V_d]; temp [B] (None: greedy argmax, verified as one-hot q);
        u [B, n] uniforms. Probabilistic: samples of softmax(logits / temp), returned as q [B, n, V_d]."""
        if temp is None:
            return logits.argmax(-1), None
        q = (logits / temp[:, None, None]).softmax(-1)
        return sample_from(q.flatten(0, 1), u.flatten()).view(u.shape), q

    def _markov(self, U, anchor, temp, u):
        """DSpark's sequential stage: logits_j = U_j + W2 . W1[prev], prev = the anchor, then each new draft (as a
        target id). With dspark_draft_topk the bias goes on the top-k base logits only, the rest -inf. A fixed-length
        loop of device ops without host syncs, so it runs inside the captured drafting graph."""
        head = self.net.markov_head
        if temp is None and not self.topk and head is not None and self.net.d2t is None:  # greedy: fused kernels
            return K.markov_greedy(U, head.markov_w1(anchor), head.markov_w1.weight, head.markov_w2.weight), None
        if self.topk:
            vals, idx = U.topk(self.topk, -1)                                        # [B, K, k]
        prev, ds, qs = anchor, [], []
        for j in range(U.shape[1]):
            e = head.markov_w1(prev) if head is not None else None                   # [B, r]
            if self.topk:
                bias = 0 if e is None else (head.markov_w2.weight[idx[:, j]] @ e[..., None])[..., 0]  # [B, k]
                lj = torch.full_like(U[:, j], float("-inf")).scatter_(-1, idx[:, j], (vals[:, j] + bias).float())
            else:
                lj = U[:, j] + head.markov_w2(e).float()                             # [B, V_d]
            d, q = self._pick(lj[:, None], temp, None if u is None else u[:, j:j + 1])
            ds.append(d[:, 0])
            qs.append(q)
            prev = self._tid(d[:, 0])
        return torch.stack(ds, 1), None if temp is None else torch.cat(qs, 1)


def load_draft_lm(path, engine, max_len):
    """draft_model's LM and its state: a Qwen3.5/3.6 checkpoint (specdec's model, GDN states with stash/commit) or a
    plain Qwen3 one (Qwen3Layer stack, KV cache only)."""
    top, tv = read_config(path, "draft_model"), engine.model.cfg.vocab_size
    mt = top.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES + ("qwen3",):
        raise ConfigError(f"draft_model {path}: model_type {mt!r} is not supported; the draft must be a Qwen3.5/3.6 "
                          f"({', '.join(SUPPORTED_MODEL_TYPES)}) or plain Qwen3 (qwen3) checkpoint")
    fields, types = qwen3_fields(top, f"draft_model {path}") if mt == "qwen3" else (None, None)
    dv = fields["vocab_size"] if fields else ModelConfig.from_hf(path).vocab_size
    if dv != tv:  # vLLM's message
        raise ConfigError(f"Target and draft model should have the same vocabulary size. Target model vocab_size={tv}. "
                          f"Draft model vocab_size={dv}. Using models with different tokenizers can cause out-of-bounds "
                          "errors during speculative decoding.")
    args = (engine.max_num_seqs, max_len, engine.dtype, engine.device)
    if fields is None:
        try:
            model, cfg, _ = load_model(path, engine.dtype, engine.device)
        except FileNotFoundError as e:
            raise ConfigError(f"draft_model {path}: {e}") from None
        return model, State(cfg, *args)
    c = DraftConfig(**fields, windows=[top.get("sliding_window") if t == "sliding_attention" else None for t in types],
                    causal=[True] * len(types))
    tensors = {n: f for n, f in checkpoint_tensors(path).items() if not (c.tie_word_embeddings and n == "lm_head.weight")}
    with torch.device("meta"):
        model = Qwen3LM(c)
    model = load_weights(model, tensors, engine.dtype, engine.device, f"draft_model {path}",
                         rename=lambda n: n[len("model."):] if n.startswith("model.") else n)
    return model, KVCache(c, *args)


class DraftModelProposer:
    """method draft_model: a small LM drafts k tokens autoregressively with its own caches, one token behind the
    target like vLLM. At each propose a first pass feeds it the tokens committed since the last one (right-padded to
    k+1, verify mode) and commits exactly those into its GDN states (stash + replay, as the target does); d1 comes
    from the last real position. Drafts d2..dk come from verify-mode passes that never write the GDN states (over
    [d1..dj] for a hybrid draft, just d_j for an attention-only one), so nothing needs rolling back."""
    def __init__(self, engine, spec):
        self.k, self.greedy = spec.num_speculative_tokens, spec.draft_sample_method == "greedy"
        self.model, self.state = load_draft_lm(spec.model, engine, engine.max_model_len + 2 * self.k + 2)
        self.recurrent = bool(self.state.rec)
        # per slot, on the device: the tokens committed since its last propose (1 after the prompt, the accepted
        # n+1 after a verify; right-padded to k+1), how many, and the position of the first
        S, dev = engine.max_num_seqs + 1, engine.device
        self.new_ids = torch.zeros(S, self.k + 1, dtype=torch.long, device=dev)
        self.new_n, self.start = torch.ones(S, dtype=torch.long, device=dev), torch.zeros(S, dtype=torch.long, device=dev)

    def prefill(self, engine, req, hidden, ids, pos):
        T, slots = hidden.shape[1], engine.slot_tensor([req])
        if pos == 0:
            self.state.reset(req.slot)
        chunk = torch.tensor([req.prompt_ids[pos:pos + T]], device=engine.device)
        self.model(chunk, Ctx(self.state, slots, torch.tensor([pos], device=engine.device), pos + T, "prefill"))
        if pos + T == len(req.prompt_ids):  # ids' last is the first sampled token: the first propose consumes it
            self.new_ids[req.slot, 0], self.new_n[req.slot], self.start[req.slot] = ids[0, -1], 1, pos + T

    def propose(self, engine, reqs):
        s = engine.cur_slots
        inputs = dict(slots=s, start=self.start[s], ids=self.new_ids[s], n=self.new_n[s])
        if not self.greedy:
            inputs["temp"], inputs["u"] = draft_noise(engine, reqs, self.k)
        return engine.call("draft-propose", self._draft, engine.kv_len(reqs, 2 * self.k + 1, self.state.max_len), inputs)

    def _draft(self, kv_len, slots, start, ids, n, temp=None, u=None):
        ctx = Ctx(self.state, slots, start, kv_len, "verify")
        h = self.model(ids, ctx)                                                     # [B, k+1, H]
        self.model.commit(ctx, n)                                                    # keep exactly the new tokens
        h = h[torch.arange(ids.shape[0], device=ids.device), n - 1]                  # [B, H] at each anchor
        p1, drafts, probs = start + n, [], []                                        # p1: position of d1
        for j in range(self.k):
            if j > 0:
                x, pos = (torch.stack(drafts, 1), p1) if self.recurrent else (drafts[-1][:, None], p1 + j - 1)
                h = self.model(x, Ctx(self.state, slots, pos, kv_len, "verify"))[:, -1]
            d, q = draft_pick(self.model.logits(h), temp, None if u is None else u[:, j])
            drafts.append(d)
            probs.append(q)
        return torch.stack(drafts, 1), None if temp is None else torch.stack(probs, 1)

    def commit(self, engine, reqs, hidden, ids, n_acc, tokens):
        s = engine.cur_slots  # the next propose's first pass consumes the accepted tokens
        self.new_ids[s], self.new_n[s], self.start[s] = tokens.clamp(min=0), n_acc + 1, engine.cur_pos + 1


PROPOSERS.update(dflash=BlockProposer, dspark=BlockProposer, draft_model=DraftModelProposer)

# ==============================================================================================
# Verification & sampling
# ==============================================================================================

def target_probs(logits, temperature, top_k, top_p, filtered=None):
    """The target distribution p that sampling and verification draw from: temperature, then top-k,
    then top-p, then softmax (vLLM's order). logits [N, V] fp32; temperature/top_k/top_p [N]
    tensors (temperature 0 rows get 1: they are only ever argmax'ed). Returns probs [N, V] fp32.
    `filtered` (optional, known on the host): whether any row has top-k or top-p; None reads it from the device."""
    t = torch.where(temperature < 1e-5, torch.ones_like(temperature), temperature)
    x = logits / t[:, None]
    if filtered is None:
        filtered = bool((top_k > 0).any()) or bool((top_p < 1).any())
    if filtered:
        srt, order = x.sort(dim=-1, descending=True)
        V = x.shape[-1]
        rank = torch.arange(V, device=x.device)[None]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
        drop = rank >= k[:, None]                                                    # top-k
        p = srt.masked_fill(drop, float("-inf")).softmax(-1)
        drop |= (p.cumsum(-1) - p) > top_p[:, None]                                  # top-p: keep the set reaching p
        drop[:, 0] = False
        x = x.scatter(-1, order, srt.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


def sample_from(probs, u):
    """Inverse-CDF sampling: one uniform u [N] in [0, 1) per row of probs [N, V] (need not sum to 1)."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return idx.clamp_(max=probs.shape[-1] - 1)


def rejection_sample(logits, drafts, draft_probs, temperature, top_k, top_p, u_accept, u_sample, all_greedy=None,
                     filtered=None):
    """Verify k drafts per sequence against the target (vLLM's `standard` rules), as a pure function.

    logits [B, k+1, V] fp32 target logits at [last token, d1..dk]; drafts [B, k] long (-1 = padding,
    always rejected); draft_probs [B, k, V] or None (= one-hot q at the draft); temperature, top_k,
    top_p [B]; u_accept [B, k], u_sample [B, k+1] uniforms in [0, 1).
    Greedy rows (temperature 0) accept while draft == argmax, then emit the argmax. Random rows accept
    d_i with probability min(1, p_i(d_i)/q_i(d_i)); the first rejected position is resampled from
    norm(max(0, p_i - q_i)); when all k are accepted a bonus token is drawn from p_{k+1}.
    Returns tokens [B, k+1] (-1 after the emitted ones) and num_accepted [B] (bonus excluded).
    `all_greedy` (optional, known on the host) skips the target distribution when every row is greedy; `filtered`
    is passed to target_probs.
    """
    B, k1, V = logits.shape
    k = k1 - 1
    greedy = temperature < 1e-5
    rows = torch.arange(B, device=logits.device)
    pos = torch.arange(k1, device=logits.device)[None]
    if all_greedy:
        argmax = logits.argmax(-1)                                                   # [B, k+1]
        n = torch.cumprod(((drafts == argmax[:, :k]) & (drafts >= 0)).long(), dim=1).sum(1)
        tokens = torch.where(pos < n[:, None], torch.cat([drafts, drafts[:, :1]], 1), torch.full_like(argmax, -1))
        tokens[rows, n] = argmax[rows, n]
        return tokens, n
    rep = lambda t: t.repeat_interleave(k1)
    p = target_probs(logits.reshape(-1, V), rep(temperature), rep(top_k), rep(top_p), filtered).view(B, k1, V)
    argmax = logits.argmax(-1)                                                       # [B, k+1]
    d = drafts.clamp(min=0)
    p_d = p[:, :k].gather(-1, d[..., None])[..., 0]                                  # [B, k]
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.gather(-1, d[..., None])[..., 0]
    ok = torch.where(greedy[:, None], drafts == argmax[:, :k], (q_d > 0) & (u_accept * q_d < p_d))
    ok &= drafts >= 0
    n = torch.cumprod(ok.long(), dim=1).sum(1)                                       # accepted prefix length
    # the token after the accepted prefix: greedy -> argmax; random -> residual at a rejection, p at the bonus
    p_n = p[rows, n]                                                                 # [B, V]
    d_n = drafts[rows, n.clamp(max=k - 1)]                                          # draft at the stop (if any)
    q_n = F.one_hot(d_n.clamp(min=0), V).to(p.dtype) if draft_probs is None else draft_probs[rows, n.clamp(max=k - 1)]
    q_n = q_n * (d_n >= 0)[:, None]                                                  # padding has q = 0
    resid = torch.where((n < k)[:, None], (p_n - q_n).clamp(min=0), p_n)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_n)                 # p == q: any draw from p
    extra = torch.where(greedy, argmax[rows, n], sample_from(resid, u_sample[rows, n]))
    tokens = torch.where(pos < n[:, None], torch.cat([drafts, drafts[:, :1]], 1), torch.full_like(argmax, -1))
    tokens[rows, n] = extra
    return tokens, n


# ==============================================================================================
# Engine: slots, requests, the step loop, stops, metrics
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

    @property
    def mean_acceptance_length(self):
        return 1 + self.num_accepted_tokens / max(self.num_drafts, 1)

    @property
    def draft_acceptance_rate(self):
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    def summary(self):
        per_pos = ", ".join(f"{a / max(self.num_drafts, 1):.3f}" for a in self.accepted_per_pos)
        return (f"SpecDecoding metrics: Mean acceptance length: {self.mean_acceptance_length:.2f}, "
                f"Accepted: {self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {per_pos}, Avg Draft acceptance rate: {100 * self.draft_acceptance_rate:.1f}%")


class Request:
    """One sequence: its tokens, sampling parameters, output so far, slot and stop state."""
    def __init__(self, rid, prompt_ids, params, tokenizer, seed):
        self.id, self.prompt_ids, self.params = rid, list(prompt_ids), params
        self.output_ids, self.text = [], ""
        self.tokens = list(prompt_ids)  # prompt + output, kept up to date by Engine._emit (read every step)
        self.logprobs = [] if params.logprobs is not None else None
        self.finish_reason = self.stop_reason = self.slot = None
        self.gen = torch.Generator().manual_seed(params.seed if params.seed is not None else seed)
        self.detok = IncrementalDecoder(tokenizer) if tokenizer is not None else None  # None: token ids only
        self.spec = SpecStats()
        self.arrival_time, self.first_token_time, self.finish_time = time.perf_counter(), None, None
        self.on_update = None  # callback(req, n_new_tokens), e.g. the server's stream

    @property
    def finished(self):
        return self.finish_reason is not None


class GraphRunner:
    """CUDA graphs captured by hand for the target's decode (T = 1) and verify (T = k+1) steps, one per batch
    bucket (1, 2, 4, 8), sharing one memory pool. Inputs are copied into static buffers; padding rows point at
    the dummy slot. A verify graph's GDN stash and the commit graph that replays it use the same tensors."""
    def __init__(self, engine):
        self.e = engine
        self.buckets = [b for b in (1, 2, 4, 8, 16, 32) if b < engine.max_num_seqs] + [engine.max_num_seqs]
        self.graphs = {}
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, B, T, mode):
        e, st = self.e, self.e.state
        dev = e.device
        g = types.SimpleNamespace()  # static inputs, outputs and the graphs of one (bucket, T)
        g.ids, g.pos = torch.zeros(B, T, dtype=torch.long, device=dev), torch.zeros(B, dtype=torch.long, device=dev)
        g.slots = torch.full((B,), st.dummy_slot, dtype=torch.long, device=dev)
        g.n_keep = torch.zeros(B, dtype=torch.long, device=dev)
        ctx = Ctx(st, g.slots, g.pos, st.max_len, mode)
        fwd = lambda: e.model(g.ids, ctx, e.taps) if e.taps else (e.model(g.ids, ctx), None)
        for _ in range(2):  # warm every kernel (Triton compiles, cuBLAS picks) on this shape before capture
            g.h, g.aux = fwd()
            g.logits = e.model.logits(g.h)
            if mode == "verify":
                e.model.commit(ctx, g.n_keep)
        torch.cuda.synchronize()
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.h, g.aux = fwd()
            g.logits = e.model.logits(g.h)
        g.commit = None
        if mode == "verify":  # replays the stash the verify graph just wrote (same tensors on every replay)
            g.commit = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.commit, pool=self.pool):
                e.model.commit(ctx, g.n_keep)
        st.stash.clear()
        self.graphs[(B, T)] = g
        return g

    def run(self, ids, pos, slots, mode):
        """Replay the smallest bucket that fits, or return None (the caller runs eagerly)."""
        B, T = ids.shape
        Bp = next((b for b in self.buckets if b >= B), None)
        if Bp is None:
            return None
        g = self.graphs.get((Bp, T)) or self.capture(Bp, T, mode)
        g.ids[:B].copy_(ids)
        g.pos[:B].copy_(pos)
        g.slots[:B].copy_(slots)
        if Bp > B:
            g.ids[B:].zero_()
            g.pos[B:].zero_()
            g.slots[B:].fill_(self.e.state.dummy_slot)
        g.graph.replay()
        return g

    def call(self, name, fn, inputs):
        """Replay (capturing on first use) fn(kv_len, **inputs) for the smallest bucket that fits, with
        static input buffers: rows beyond the batch get slot = dummy, temperature 1, everything else 0.
        Returns fn's outputs (a tuple of tensors or None) cut to the batch, or None if no bucket fits."""
        B = next(iter(inputs.values())).shape[0]
        Bp = next((b for b in self.buckets if b >= B), None)
        if Bp is None:
            return None
        key = (name, Bp) + tuple(t.shape[1:] for t in inputs.values())
        pad = lambda n: self.e.state.dummy_slot if n == "slots" else (1 if n == "temp" else 0)
        if key not in self.graphs:
            static = {n: torch.full((Bp, *t.shape[1:]), pad(n), dtype=t.dtype, device=t.device) for n, t in inputs.items()}
            for _ in range(2):
                fn(self.e.state.max_len, **static)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = fn(self.e.state.max_len, **static)
            self.graphs[key] = (graph, static, out)
        graph, static, out = self.graphs[key]
        for n, t in inputs.items():
            static[n][:B].copy_(t)
            if Bp > B:
                static[n][B:].fill_(pad(n))
        graph.replay()
        return tuple(None if o is None else o[:B] for o in out)

    def commit(self, g, n_keep):
        g.n_keep.zero_()
        g.n_keep[:n_keep.shape[0]].copy_(n_keep)
        g.commit.replay()


class Engine:
    def __init__(self, model, tokenizer, spec, max_num_seqs, max_model_len, dtype, device, seed=0, enforce_eager=False,
                 async_steps=None):
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.max_num_seqs, self.max_model_len, self.dtype, self.device, self.seed = max_num_seqs, max_model_len, dtype, device, seed
        self.k = spec.num_speculative_tokens if spec else 0
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_ids = set(model.cfg.eos_token_ids) | ({eos} if eos is not None else set())
        self.special_ids = set(tokenizer._special_id_set) if tokenizer is not None else set()  # skipped in text
        self.state = State(model.cfg, max_num_seqs, max_model_len + self.k + 1, dtype, device, mtp=spec is not None and spec.method == "mtp")
        self.slots = [None] * max_num_seqs
        self.waiting = deque()
        self.stats = SpecStats()
        self.prefill_chunk = 2048
        self.proposer = None
        if spec is not None:
            self.proposer = PROPOSERS[spec.method](self, spec)
            self.synthetic = torch.tensor(spec.conditional_rates(), device=device) \
                if spec.rejection_sample_method == "synthetic" else None
        self.num_requests = 0
        self.time_drafts, self.draft_seconds, self.spec_steps = False, 0.0, 0
        self.graphs = GraphRunner(self) if device.type == "cuda" and not enforce_eager else None
        # Per slot, on the device: the token the slot's next step feeds and its position. Steps read their inputs
        # from here and write them back, so launching a step needs nothing from the host.
        self.next_ids = torch.zeros(max_num_seqs + 1, dtype=torch.long, device=device)
        self.next_pos = torch.zeros(max_num_seqs + 1, dtype=torch.long, device=device)
        # Asynchronous steps (default with CUDA graphs): step n+1 is launched before step n's tokens are read back,
        # so the host's work (stop checks, detokenising, the next launch) overlaps the device's. A request's stop
        # is then seen one step late: the extra step's tokens are dropped. Ngram drafts from the host's tokens,
        # so it runs synchronously; so does a speculative config with enforce_eager (its eager drafter reads them).
        host_drafts = spec is not None and (spec.method == "ngram" or spec.enforce_eager)
        self.async_steps = (self.graphs is not None if async_steps is None else async_steps) and not host_drafts
        self.pending = None  # the launched step whose tokens the host has not read yet
        # target layers whose outputs the proposer reads (DFlash/DSpark taps); the last forward's are in self.aux
        self.taps, self.aux = tuple(getattr(self.proposer, "taps", ())), None

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_ids, params, rid=None):
        if not prompt_ids:
            raise ConfigError("the prompt is empty: at least one prompt token is needed")
        bad = [t for t in prompt_ids if not 0 <= t < self.model.cfg.vocab_size]
        if bad:
            raise ConfigError(f"prompt token id {bad[0]} is out of range [0, {self.model.cfg.vocab_size})")
        if params.max_tokens is None and len(prompt_ids) >= self.max_model_len:
            raise ConfigError(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                              f"request has {len(prompt_ids)} input tokens. Please reduce the length of the input messages.")
        n, m = len(prompt_ids), params.max_tokens or (self.max_model_len - len(prompt_ids))
        if n + m > self.max_model_len:
            raise ConfigError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                              f"requested {n + m} tokens ({n} in the messages, {m} in the completion). Please reduce "
                              f"the length of the messages or completion.")
        params = dataclasses.replace(params, max_tokens=m)
        self.num_requests += 1
        req = Request(rid if rid is not None else str(self.num_requests), prompt_ids, params, self.tokenizer,
                      self.seed + self.num_requests)
        self.waiting.append(req)
        return req

    def abort(self, req):
        """Cancel a request (e.g. its client went away): its slot frees at once."""
        if req in self.waiting:
            self.waiting.remove(req)
        if not req.finished:
            req.finish_reason = "abort"
        self._release(req)

    def _release(self, req):
        if req.slot is not None and self.slots[req.slot] is req:
            self.slots[req.slot] = None
        req.slot = None

    def has_work(self):
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def call(self, name, fn, kv_len, inputs):
        """Run a drafter step fn(kv_len, **inputs) -> tuple of tensors: as a captured graph on the GPU, else eagerly
        (also when the speculative config says enforce_eager: vLLM's override for the draft)."""
        eager = self.graphs is None or (self.spec is not None and self.spec.enforce_eager)
        out = None if eager else self.graphs.call(name, fn, inputs)
        return out if out is not None else fn(kv_len, **inputs)

    def h2d(self, data, dtype=None):
        """Host data (a list or CPU tensor) on the engine's device without waiting for the device: through pinned
        memory, copied asynchronously. (A copy from pageable memory waits until every queued kernel has run,
        which would stall the host once per copy and undo asynchronous steps.)"""
        t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def slot_tensor(self, reqs):
        return self.h2d([r.slot for r in reqs], torch.long)

    def set_batch(self, reqs):
        """The device inputs of a step over reqs: slots, the position of each row's last token, that token [B].
        Kept as cur_slots / cur_pos / cur_last for the proposers of this step."""
        self.cur_slots = slots = self.slot_tensor(reqs)
        self.cur_pos, self.cur_last = self.next_pos[slots], self.next_ids[slots]
        return self.cur_slots, self.cur_pos, self.cur_last

    def kv_len(self, reqs, extra, cap):
        """How far this step's attention reads (eager paths): last position + extra when the host knows the
        positions (synchronous steps), else cap (the cache length: an async step's positions live on the device)."""
        return cap if self.async_steps else max(len(r.tokens) - 1 for r in reqs) + extra

    # -- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self):
        """Admit waiting requests into free slots (prefill each), then one decode or speculative step for
        every running request. Returns the requests that got new tokens."""
        touched = []
        while self.waiting and None in self.slots:
            req = self.waiting.popleft()
            req.slot = self.slots.index(None)
            self.slots[req.slot] = req
            self._prefill(req)
            touched.append(req)
        running = [r for r in self.slots if r is not None and r not in touched and not self._ends_in_flight(r)]
        launched = self._launch(running) if running else None
        done, self.pending = self.pending, launched
        if done is not None:
            touched += self._finish(done)
        if self.pending is not None and not (self.async_steps and all(r.logprobs is None for r in running)):
            done, self.pending = self.pending, None  # synchronous: read this step back now
            touched += self._finish(done)
        return touched

    def _ends_in_flight(self, r):
        """r is in the step in flight, which surely ends it (it yields >= 1 token): another step would be wasted."""
        return (self.pending is not None and r in self.pending.reqs and
                (len(r.output_ids) + 1 >= r.params.max_tokens or len(r.tokens) + 1 >= self.max_model_len))

    def _launch(self, reqs):
        """Queue one decode or speculative step for reqs on the device; returns it as a pending step."""
        slots, pos, last = self.set_batch(reqs)
        return (self._spec_step if self.spec else self._decode_step)(reqs, slots, pos, last)

    def _pending(self, reqs, out, logits):
        """Start copying a step's result rows out [B, n] to the host (pinned memory, no wait)."""
        host, event = out, None
        if out.is_cuda:
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return types.SimpleNamespace(reqs=reqs, host=host, event=event, logits=logits)

    def _finish(self, p):
        """Read a launched step back and emit its tokens (requests that finished meanwhile are skipped)."""
        if p.event is not None:
            p.event.synchronize()
        rows, live = p.host.tolist(), []
        for b, r in enumerate(p.reqs):
            if r.finished:  # stopped by the step before, or aborted: this step's tokens are not part of it
                continue
            toks = rows[b]
            if self.spec is not None:  # [tokens (k+1), n accepted, n drafted]
                toks, n, n_draft = toks[:-2], toks[-2], toks[-1]
                r.spec.add(n_draft, n)
                self.stats.add(n_draft, n)
                toks = toks[:n + 1]
            self._emit(r, toks, p.logits[b])
            live.append(r)
        return live

    def _prefill(self, req):
        self.state.reset(req.slot)
        ids, n = req.prompt_ids, len(req.prompt_ids)
        slots = self.slot_tensor([req])
        for s in range(0, n, self.prefill_chunk):
            chunk = torch.tensor([ids[s:s + self.prefill_chunk]], device=self.device)
            T = chunk.shape[1]
            ctx = Ctx(self.state, slots, torch.tensor([s], device=self.device), s + T, "prefill")
            h, self.aux = self.model(chunk, ctx, self.taps) if self.taps else (self.model(chunk, ctx), None)
            if s + T == n:
                logits = self.model.logits(h[:, -1])                                  # [1, V]
                tok = self._sample(logits, [req])
            if self.proposer is not None:
                nxt = ids[s + 1:s + T + 1] + ([int(tok[0])] if s + T == n else [])
                self.proposer.prefill(self, req, h, torch.tensor([nxt], device=self.device), s)
        self.next_ids[req.slot], self.next_pos[req.slot] = tok[0], n
        self._emit(req, [int(tok[0])], logits)

    def _sample(self, logits, reqs):
        """Sample one token per row of logits [B, V] with each request's own generator."""
        if all(r.params.greedy for r in reqs):  # decided on the host: no device sync
            return logits.argmax(-1)
        f = lambda name: self.h2d([getattr(r.params, name) for r in reqs])
        greedy = f("greedy")
        p = target_probs(logits, f("temperature").float(), f("top_k"), f("top_p").float(), self._filtered(reqs))
        u = self.h2d(torch.stack([torch.rand((), generator=r.gen) for r in reqs]))
        return torch.where(greedy, logits.argmax(-1), sample_from(p, u))

    @staticmethod
    def _filtered(reqs):
        return any(r.params.top_k > 0 or r.params.top_p < 1 for r in reqs)

    def _target(self, reqs, ids, pos, slots, mode):
        """One target forward over ids [B, T] at positions pos [B] in slots [B]: (hidden, logits, commit-fn)."""
        B, T = ids.shape
        g = self.graphs.run(ids, pos, slots, mode) if self.graphs is not None else None
        if g is not None:
            self.aux = [a[:B] for a in g.aux] if g.aux is not None else None
            return g.h[:B], g.logits[:B], lambda n_keep: self.graphs.commit(g, n_keep)
        ctx = Ctx(self.state, slots, pos, self.kv_len(reqs, T, self.state.max_len), mode)
        h, self.aux = self.model(ids, ctx, self.taps) if self.taps else (self.model(ids, ctx), None)
        return h, self.model.logits(h), lambda n_keep: self.model.commit(ctx, n_keep)

    def _advance(self, slots, last, pos):
        """The next step's inputs, on the device. Positions are capped below max_model_len: a step launched
        after a request's final one (async) is dropped, but must still write inside the caches."""
        self.next_ids[slots] = last
        self.next_pos[slots] = pos.clamp(max=self.max_model_len - 1)

    def _decode_step(self, reqs, slots, pos, last):
        h, logits, _ = self._target(reqs, last[:, None], pos, slots, "decode")
        toks = self._sample(logits[:, 0], reqs)                                       # [B]
        self._advance(slots, toks, pos + 1)
        return self._pending(reqs, toks[:, None], logits)

    def _spec_step(self, reqs, slots, pos, last):
        B, k = len(reqs), self.k
        if self.time_drafts:  # bench.py: the drafter's share of a step (costs two syncs per step)
            torch.cuda.synchronize() if self.device.type == "cuda" else None
            t0 = time.perf_counter()
        drafts, q = self.proposer.propose(self, reqs)                                 # [B, k]
        if self.time_drafts:
            torch.cuda.synchronize() if self.device.type == "cuda" else None
            self.draft_seconds, self.spec_steps = self.draft_seconds + time.perf_counter() - t0, self.spec_steps + 1
        ids = torch.cat([last[:, None], drafts.clamp(min=0)], 1)                     # [B, k+1]
        h, logits, commit = self._target(reqs, ids, pos, slots, "verify")             # [B, k+1, H], [B, k+1, V]
        f = lambda name, dt: self.h2d([getattr(r.params, name) for r in reqs], dt)
        u_acc = self.h2d(torch.stack([torch.rand(k, generator=r.gen) for r in reqs]))
        u_smp = self.h2d(torch.stack([torch.rand(k + 1, generator=r.gen) for r in reqs]))
        rows = torch.arange(B, device=self.device)
        if self.synthetic is not None:  # benchmark mode: accept by the given rates, whatever the tokens are
            n = torch.minimum(torch.cumprod((u_acc < self.synthetic).long(), 1).sum(1), (drafts >= 0).sum(1))
            tokens = torch.cat([drafts, drafts[:, :1]], 1).clone()                    # (real drafts only)
            tokens[rows, n] = logits[rows, n].argmax(-1)
        else:
            tokens, n = rejection_sample(logits, drafts, q, f("temperature", torch.float32), f("top_k", torch.long),
                                         f("top_p", torch.float32), u_acc, u_smp,
                                         all_greedy=all(r.params.greedy for r in reqs), filtered=self._filtered(reqs))
        commit(n + 1)
        self.proposer.commit(self, reqs, h, ids, n, tokens)
        self._advance(slots, tokens[rows, n], pos + n + 1)
        return self._pending(reqs, torch.cat([tokens, n[:, None], (drafts >= 0).sum(1, keepdim=True)], 1), logits)

    # -- output --------------------------------------------------------------------------------
    def _emit(self, req, toks, logits):
        """Append tokens one by one, stopping exactly where plain decoding would stop. logits [n, V]."""
        p = req.params
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        emitted = 0
        for i, t in enumerate(toks):
            req.output_ids.append(t)
            req.tokens.append(t)
            emitted += 1
            if req.logprobs is not None:
                lp = logits[i].float().log_softmax(-1)
                top = lp.topk(p.logprobs) if p.logprobs else None
                d = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist()))
                d[t] = float(lp[t])
                req.logprobs.append(d)
            if req.detok is not None and not (t in self.stop_ids or t in self.special_ids):
                old = len(req.text)
                req.text += req.detok.add([t])
                for s in p.stop:
                    j = req.text.find(s, max(0, old - len(s) + 1))
                    if j >= 0:
                        req.text, req.finish_reason, req.stop_reason = req.text[:j], "stop", s
                        break
            if req.finished:
                break
            if t in p.stop_token_ids:
                req.finish_reason, req.stop_reason = "stop", t
            elif t in self.stop_ids and not p.ignore_eos:
                req.finish_reason = "stop"
            elif len(req.output_ids) >= p.max_tokens or len(req.tokens) >= self.max_model_len:
                req.finish_reason = "length"
            if req.finished:
                break
        if req.finished:
            if req.detok is not None and not isinstance(req.stop_reason, str):
                req.text += req.detok.flush()
            req.finish_time = time.perf_counter()
            self._release(req)
        if req.on_update is not None:
            req.on_update(req, emitted)


# ==============================================================================================
# Loading: safetensors (sharded, multimodal names, fused or per-expert MoE) and GGUF
# ==============================================================================================

def checkpoint_tensors(path):
    """{name: (file, dtype-str, shape)} for a directory of model.safetensors or sharded model-*.safetensors."""
    from safetensors import safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"{path}: no model.safetensors, model-*.safetensors or model.safetensors.index.json found")
    out = {}
    for f in files:
        full = os.path.join(path, f)
        if not os.path.isfile(full):
            raise ConfigError(f"{path}: shard {f} listed in the index is missing")
        with safe_open(full, "pt") as st:
            for name in st.keys():
                out[name] = full
    return out


SKIP_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")  # the vision tower: not used


def internal_name(name):
    """Checkpoint name -> our parameter name (None = skipped by a named rule)."""
    if name.startswith(SKIP_PREFIXES):
        return None
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    if name.startswith(("lm_head.", "mtp.")):
        return name
    return "?" + name


def load_model(path, dtype, device, want_mtp=False):
    """Build the model from a checkpoint directory or .gguf file; every parameter is checked by name and shape."""
    if str(path).endswith(".gguf"):
        cfg, tensors, tok = read_gguf_model(path, dtype)
        get = lambda n: tensors[n]
        names = {internal_name(n): n for n in tensors}
    else:
        cfg = ModelConfig.from_hf(path)
        files = checkpoint_tensors(path)
        from safetensors import safe_open
        handles = {}

        def get(n):
            f = files[n]
            if f not in handles:
                handles[f] = safe_open(f, "pt")
            return handles[f].get_tensor(n)
        names = {}
        for n in files:
            m = internal_name(n)
            if m is not None and m.startswith("?"):
                raise ConfigError(f"unexpected tensor {n!r} in {path} (not a Qwen3.5/3.6 text-decoder weight)")
            if m is not None:
                names[m] = n
        tok = Tokenizer.from_dir(path)
    has_mtp = any(n.startswith("mtp.") for n in names)
    if want_mtp and not has_mtp and str(path).endswith(".gguf"):
        raise ConfigError(f"{path}: {GGUF_NO_MTP_MESSAGE}")
    if want_mtp and not has_mtp:
        raise ConfigError(f"{path}: method 'mtp' needs the checkpoint's MTP head, but it has no mtp.* tensors "
                          "(the MTP head is missing)")
    if not has_mtp or cfg.mtp_num_hidden_layers == 0:
        names = {m: n for m, n in names.items() if not m.startswith("mtp.")}
    # per-expert MoE tensors (experts.{e}.{gate,up,down}_proj.weight) are stacked into the fused layout
    per_expert = {}
    for m in list(names):
        hit = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", m)
        if hit:
            per_expert.setdefault(hit[1], {})[(int(hit[2]), hit[3])] = names.pop(m)
    with torch.device("meta"):
        model = Qwen36(cfg, with_mtp=has_mtp)
    expected = dict(model.named_parameters())
    for prefix, parts in per_expert.items():
        E = cfg.num_experts
        missing = [f"{prefix}.{e}.{w}_proj.weight" for e in range(E) for w in ("gate", "up", "down") if (e, w) not in parts]
        if missing:
            raise ConfigError(f"missing tensor {missing[0]!r} in {path}")
        names[prefix + ".gate_up_proj"] = [(parts[(e, "gate")], parts[(e, "up")]) for e in range(E)]
        names[prefix + ".down_proj"] = [parts[(e, "down")] for e in range(E)]
    for m in names:
        if m not in expected:
            raise ConfigError(f"unexpected tensor {m!r} in {path} for this config")
    for m in expected:
        if m not in names:
            raise ConfigError(f"missing tensor {m!r} in {path}")
    items = list(expected.items())
    bar = None
    if len(items) > 200:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(items), desc="loading weights", unit="tensor", file=sys.stderr)
        except ImportError:
            pass
    for m, p in items:
        src = names[m]
        if isinstance(src, list):  # per-expert checkpoints
            t = torch.stack([torch.cat([get(s[0]), get(s[1])], 0) if isinstance(s, tuple) else get(s) for s in src])
        else:
            t = get(src)
        if tuple(t.shape) != tuple(p.shape):
            raise ConfigError(f"tensor {src if isinstance(src, str) else m!r} has shape {tuple(t.shape)}, "
                              f"expected {tuple(p.shape)}")
        keep_fp32 = m.endswith("A_log")  # the GDN decay stays fp32 (fp32 in the checkpoint)
        t = t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
        mod = model.get_submodule(m.rsplit(".", 1)[0]) if "." in m else model
        mod._parameters[m.rsplit(".", 1)[-1]] = nn.Parameter(t, requires_grad=False)
        if bar:
            bar.update()
    if bar:
        bar.close()
    for mod in model.modules():  # non-checkpoint buffers (RoPE frequencies) are computed on the device
        if isinstance(mod, Attention):
            rd = cfg.rotary_dim
            mod.inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, rd, 2, device=device).float() / rd)
    return fuse_projections(model.eval()), cfg, tok


# ==============================================================================================
# GGUF loading (llama.cpp qwen35 / qwen35moe files)
# ==============================================================================================
# llama.cpp GGUF files (arch `qwen35` / `qwen35moe`) <-> HF text-only names and layouts. read_gguf undoes every
# transform of llama.cpp's converter (conversion/qwen.py: Qwen3_5TextModel / Qwen3_5MoeTextModel), so its tensors
# go into the same loader as safetensors; write_gguf applies them (used by tests). ggml lists dims innermost first
# (`ne`); the gguf reader hands back numpy arrays in PyTorch order (reversed ne): 2-D [out, in], experts
# [E, I, H] (gate, up) and [E, H, I] (down), as HF stores them.

GGUF_NO_MTP_MESSAGE = (
    "this GGUF file has no MTP block (no blk.N.nextn.* tensors), so `method: mtp` cannot run on it. Re-export it "
    "with llama.cpp's convert_hf_to_gguf.py WITHOUT `--no-mtp`, from a Hugging Face checkpoint that has the mtp.* "
    "tensors (older converters drop them: use a recent llama.cpp), or pick another speculative method.")

_GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}  # no output.weight = tied embeddings
_GGUF_BLK = {  # blk.N.<key> -> model.layers.N.<value>; the MTP block's ordinary tensors -> mtp.layers.0.<value>
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
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
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight", "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",  # only with --fuse-gate-up-exps: cat([gate, up], 1)
}  # the default ffn_gate_exps + ffn_up_exps [E, I, H] are re-fused into mlp.experts.gate_up_proj [E, 2I, H]
_GGUF_NEXTN = {"nextn.eh_proj.weight": "mtp.fc.weight", "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
               "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
               "nextn.shared_head_norm.weight": "mtp.norm.weight"}  # in block num_hidden_layers
_GGUF_SKIP = ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight")  # optional; the shared ones are used
_HF_TOP, _HF_BLK, _HF_NEXTN = ({v: k for k, v in d.items()} for d in (_GGUF_TOP, _GGUF_BLK, _GGUF_NEXTN))

_PRETOKENIZE = {  # split regex by tokenizer.ggml.pre (\p{..} needs the `regex` module)
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+"}


def _vhead_perm(t, dim, a, b, d):
    """View `dim` as [a, b, d] and swap a and b. HF grouped -> GGUF tiled value heads: a = H_k, b = R = H_v / H_k
    (head g*R + r moves to r*H_k + g, where ggml's broadcast repeat pairs it with key head g);
    GGUF -> HF: a = R, b = H_k."""
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
    """Zero-centred RMSNorm weights, stored by the converter as 1 + w (the GDN gated norm is not). The MTP pre-fc
    norms count: the converter tests `endswith("norm.weight")` after renaming them to enorm / hnorm."""
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight") or "pre_fc_norm_" in name


def _gguf_tensor(rt):
    """ReaderTensor -> torch, PyTorch order. F32 / F16 / BF16 stay views of the file mapping; quantised types
    (Q8_0, Q4_K, Q5_K, Q6_K, ...) are dequantised to fp32 by gguf.quants."""
    import gguf
    Q = gguf.GGMLQuantizationType
    if rt.tensor_type in (Q.F32, Q.F16):
        return torch.from_numpy(rt.data)
    if rt.tensor_type == Q.BF16:  # the reader gives raw bytes [..., 2n]
        return torch.from_numpy(rt.data.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(gguf.quants.dequantize(rt.data, rt.tensor_type))


def _f32(x):  # GGUF floats are float32: give back the shortest repr (1e-06, not 9.99999997e-07)
    return float(str(np.float32(x)))


def read_gguf(path, dtype=torch.float32):
    """-> (text_config in HF form, {HF text-only name: tensor in `dtype`}, tokenizer dict) from a qwen35 /
    qwen35moe GGUF. The MTP block (blk.<num_hidden_layers>) comes back as mtp.*."""
    import gguf
    r = gguf.GGUFReader(path, "c")  # copy-on-write mmap: torch views need no copy of the file
    meta = lambda key, default=None: r.fields[key].contents() if key in r.fields else default  # noqa: E731
    arch = meta("general.architecture")
    if arch not in ("qwen35", "qwen35moe"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} (specdec reads 'qwen35' and 'qwen35moe')")
    k = lambda key, default=None: meta(f"{arch}.{key}", default)  # noqa: E731
    byname = {t.name: t for t in r.tensors}
    nextn = k("nextn_predict_layers", 0)
    n = k("block_count") - nextn  # block_count includes the MTP layers
    hd, hv = k("attention.key_length"), k("ssm.time_step_rank")
    cfg = dict(
        model_type="qwen3_5_moe_text" if arch == "qwen35moe" else "qwen3_5_text", hidden_size=k("embedding_length"),
        num_hidden_layers=n, num_attention_heads=k("attention.head_count"),
        num_key_value_heads=k("attention.head_count_kv"), head_dim=hd,
        linear_num_key_heads=k("ssm.group_count"), linear_num_value_heads=hv, linear_key_head_dim=k("ssm.state_size"),
        linear_value_head_dim=k("ssm.inner_size") // hv, linear_conv_kernel_dim=k("ssm.conv_kernel"),
        full_attention_interval=k("full_attention_interval", 4),
        layer_types=["linear_attention" if f"blk.{i}.ssm_a" in byname else "full_attention" for i in range(n)],
        rope_parameters=dict(rope_type="default", rope_theta=_f32(k("rope.freq_base")),
                             partial_rotary_factor=k("rope.dimension_count") / hd,
                             mrope_section=list(k("rope.dimension_sections", [11, 11, 10, 0]))[:3],
                             mrope_interleaved=True),
        rms_norm_eps=_f32(k("attention.layer_norm_rms_epsilon")),
        vocab_size=int(byname["token_embd.weight"].shape[1]),  # ne = {H, V}
        tie_word_embeddings="output.weight" not in byname,
        mtp_num_hidden_layers=nextn if any(x.startswith(f"blk.{n}.nextn.") for x in byname) else 0,
        max_position_embeddings=k("context_length"), eos_token_id=meta("tokenizer.ggml.eos_token_id"),
        hidden_act="silu", attn_output_gate=True, attention_bias=False)
    if k("feed_forward_length") is not None:
        cfg["intermediate_size"] = k("feed_forward_length")
    if arch == "qwen35moe":
        cfg.update(num_experts=k("expert_count"), num_experts_per_tok=k("expert_used_count"),
                   moe_intermediate_size=k("expert_feed_forward_length"),
                   shared_expert_intermediate_size=k("expert_shared_feed_forward_length"))

    tensors, split = {}, {}
    for name, rt in byname.items():
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        i, leaf = (int(m[1]), m[2]) if m else (-1, name)
        pre = f"model.layers.{i}." if i < n else f"mtp.layers.{i - n}."
        if leaf in _GGUF_SKIP or (leaf.startswith("nextn.") and i != n):  # nextn.* is copied into every MTP block
            continue
        if leaf in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            split.setdefault(pre, {})[leaf] = _gguf_tensor(rt).to(dtype)  # [E, I, H]
            continue
        hf = _GGUF_TOP.get(name) if m is None else _GGUF_NEXTN.get(leaf) or (
            pre + _GGUF_BLK[leaf] if leaf in _GGUF_BLK else None)
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
        tensors[pre + "mlp.experts.gate_up_proj"] = torch.cat([d["ffn_gate_exps.weight"], d["ffn_up_exps.weight"]], 1)

    toks = meta("tokenizer.ggml.tokens", [])
    types = meta("tokenizer.ggml.token_type", [1] * len(toks))  # 1 normal, 3 control, 4 user-defined, 5 unused
    eos, pre_tok = meta("tokenizer.ggml.eos_token_id"), meta("tokenizer.ggml.pre")
    added = {t: i for i, (t, ty) in enumerate(zip(toks, types)) if ty in (3, 4)}
    stops = {eos, meta("tokenizer.ggml.eot_token_id"), added.get("<|im_end|>"), added.get("<|endoftext|>")}
    tok = dict(model=meta("tokenizer.ggml.model"), pre=pre_tok, pattern=_PRETOKENIZE.get(pre_tok), tokens=toks,
               token_types=types, merges=meta("tokenizer.ggml.merges", []), eos_token_id=eos,
               eos_token=toks[eos] if eos is not None and eos < len(toks) else None,
               bos_token_id=meta("tokenizer.ggml.bos_token_id"), pad_token_id=meta("tokenizer.ggml.padding_token_id"),
               chat_template=meta("tokenizer.chat_template"), added_tokens=added,
               special_tokens=[t for t, ty in zip(toks, types) if ty == 3],  # dropped by skip_special decoding
               vocab={t: i for i, (t, ty) in enumerate(zip(toks, types)) if ty not in (3, 4, 5)},
               stop_token_ids=sorted(s for s in stops if s is not None))
    return cfg, tensors, tok


def gguf_has_mtp(src):
    """Whether a GGUF (a path, or the text_config read_gguf gave for it) has an MTP block; else GGUF_NO_MTP_MESSAGE."""
    if isinstance(src, dict):
        return src.get("mtp_num_hidden_layers", 0) > 0
    import gguf
    return any(".nextn." in t.name for t in gguf.GGUFReader(src).tensors)


def write_gguf(hf_config, tensors, out_path, ftype="F16", tokenizer_json_path=None, with_mtp=True):
    """Write HF text-only tensors as llama.cpp's converter does (for tests). ftype: F32 | F16 | BF16 | Q8_0;
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
        if _is_shifted_norm(name):
            t = t + 1.0
        elif name.endswith(".A_log"):
            t = -torch.exp(t)
        t = _gdn_reorder(name, t.squeeze(1) if name.endswith(".conv1d.weight") else t, c, to_gguf=True)
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
    if tokenizer_json_path is None:  # GPT-2 byte alphabet (printable bytes as themselves, others from U+0100 on)
        keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
        other = iter(range(256, 512))
        vocab = {chr(b if b in keep else next(other)): b for b in range(256)}
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


def read_gguf_model(path, dtype):
    """A .gguf file -> (ModelConfig, tensors under HF text-only names, Tokenizer)."""
    try:
        text, tensors, tok = read_gguf(path, dtype)
        cfg = ModelConfig.from_dict(text)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{path}: {e}") from None
    cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(tok["stop_token_ids"]))
    tokenizer = Tokenizer(tok["vocab"], tok["merges"], tok["added_tokens"], tok["pattern"] or QWEN_PATTERN,
                          tok["eos_token"], special=tok["special_tokens"])
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
    outputs: list
    finished: bool = True
    metrics: dict = None


def resolve_device_dtype(device, dtype):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype in (None, "auto"):
        dtype = "bfloat16" if str(device).startswith("cuda") else "float32"
    dtypes = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
              "float32": torch.float32, "float": torch.float32, "fp32": torch.float32}
    if dtype not in dtypes and not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unsupported dtype {dtype!r}; choose one of auto, bfloat16, float16, float32")
    return torch.device(device), dtypes.get(dtype, dtype)


class LLM:
    def __init__(self, model=None, speculative_config=None, dtype="auto", device=None, max_model_len=None,
                 max_num_seqs=8, seed=0, enforce_eager=False, async_scheduling=None):
        spec = SpeculativeConfig.from_json(speculative_config)
        model = model or default_model_path()
        if spec is not None and spec.method == "dspark" and str(model).endswith(".gguf"):
            raise ConfigError("method 'dspark' is refused for a GGUF target: its hidden-state taps come from a "
                              "re-quantised copy of the model the drafter was not trained on; use the safetensors "
                              "checkpoint as the target")
        if not os.path.exists(model):
            raise ConfigError(f"model path {model!r} does not exist")
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        self.model, self.cfg, self.tokenizer = load_model(model, self.dtype, self.device,
                                                          want_mtp=spec is not None and spec.method == "mtp")
        max_len = max_model_len or min(self.cfg.max_position_embeddings, 4096)
        if max_len > self.cfg.max_position_embeddings:
            raise ConfigError(f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                              f"{self.cfg.max_position_embeddings}")
        if spec is not None and spec.max_model_len is not None:
            max_len = min(max_len, spec.max_model_len)
        self.model_path, self.max_model_len, self.spec = model, max_len, spec
        self.engine = Engine(self.model, self.tokenizer, spec, max_num_seqs, max_len, self.dtype, self.device, seed,
                             enforce_eager, async_scheduling)

    def encode_prompt(self, prompt):
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            return self.encode_prompt(prompt.get("prompt_token_ids", prompt.get("prompt")))
        return None, list(prompt)

    def generate(self, prompts, sampling_params=None):
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        reqs = []
        for p, sp in zip(prompts, params):
            text, ids = self.encode_prompt(p)
            reqs.append((text, self.engine.add_request(ids, sp)))
        while any(not r.finished for _, r in reqs):
            self.engine.step()
        return [self._output(text, r) for text, r in reqs]

    def chat(self, messages, sampling_params=None, enable_thinking=True, add_generation_prompt=True):
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [apply_chat_template(m, add_generation_prompt, enable_thinking) for m in convs]
        return self.generate(prompts, sampling_params)

    def _output(self, text, r):
        cum = sum(d[t] for d, t in zip(r.logprobs, r.output_ids)) if r.logprobs is not None else None
        s = r.spec
        metrics = {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                   "num_accepted_tokens": s.num_accepted_tokens, "accepted_per_pos": list(s.accepted_per_pos),
                   "mean_acceptance_length": s.mean_acceptance_length} if self.spec else None
        out = CompletionOutput(0, r.text, list(r.output_ids), cum, r.logprobs, r.finish_reason, r.stop_reason)
        return RequestOutput(r.id, text, r.prompt_ids, [out], True, metrics)

    def get_metrics(self):
        return self.engine.stats

    def warmup(self, force=False):
        """Compile the kernels and capture the CUDA graphs of every batch bucket before serving (vLLM captures at
        start-up): max_num_seqs dummy requests stopping k+2 tokens apart, so the batch shrinks through every
        bucket. Nothing without graphs (CPU, enforce_eager) unless forced: nothing to capture. Counters reset after."""
        e = self.engine
        if e.graphs is None and not force:
            return
        prompt = list(range(1, 17))
        for i in range(e.max_num_seqs):
            n = min(2 + (e.k + 2) * i, self.max_model_len - len(prompt))
            e.add_request(prompt, SamplingParams(temperature=0, max_tokens=max(n, 1), ignore_eos=True))
        while e.has_work():
            e.step()
        e.stats, e.num_requests = SpecStats(), 0


def default_model_path():
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "toy")
    if os.path.isdir(here):
        return here
    raise ConfigError("no --model given and no shipped model at models/toy; pass --model PATH "
                      "(python tools/make_tiny.py /tmp/tiny makes a tiny random checkpoint)")


# ==============================================================================================
# CLI
# ==============================================================================================

def add_engine_args(ap):
    """Flags shared by specdec.py, server.py and bench.py (vLLM's names)."""
    ap.add_argument("--model", default=None, help="checkpoint directory (HF safetensors) or .gguf file "
                                                   "(default: the shipped toy model in models/)")
    ap.add_argument("--speculative-config", default=None, help="vLLM's speculative config as JSON, e.g. "
                    '\'{"method":"mtp","num_speculative_tokens":2}\' (methods: ' + ", ".join(SPEC_METHODS) + ")")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), bfloat16, float16, float32")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--max-model-len", type=int, default=None, help="max prompt + output tokens (default min(model, 4096))")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="max concurrent sequences (slots)")
    ap.add_argument("--seed", type=int, default=0, help="engine seed (requests without a seed derive theirs from it)")
    ap.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="launch step n+1 before reading step n back (default: on with CUDA graphs)")


def llm_from_args(a):
    return LLM(model=a.model, speculative_config=a.speculative_config, dtype=a.dtype, device=a.device,
               max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs, seed=a.seed, enforce_eager=a.enforce_eager,
               async_scheduling=a.async_scheduling)


def main(argv=None):
    ap = argparse.ArgumentParser(description="specdec: generate text with a Qwen3.6 model, optionally speculating")
    add_engine_args(ap)
    ap.add_argument("--prompt", default="def fib(n):", help="the prompt text")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat template")
    ap.add_argument("--no-thinking", action="store_true", help="with --chat: enable_thinking=False")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens to generate")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exact argmax)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    ap.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1 = all)")
    ap.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    a = ap.parse_args(argv)
    try:
        llm = llm_from_args(a)
        prompt = a.prompt
        if a.chat:
            prompt = apply_chat_template([{"role": "user", "content": prompt}], True, not a.no_thinking)
        params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                                seed=a.seed, ignore_eos=a.ignore_eos)
        eng = llm.engine
        req = eng.add_request(llm.tokenizer.encode(prompt), params)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shown = [0]

    def show(r, n):
        sys.stdout.write(r.text[shown[0]:])
        sys.stdout.flush()
        shown[0] = len(r.text)
    req.on_update = show
    t0 = time.perf_counter()
    while not req.finished:
        eng.step()
    t1 = time.perf_counter()
    n = len(req.output_ids)
    ttft = req.first_token_time - t0
    rate = (n - 1) / (t1 - req.first_token_time) if n > 1 and t1 > req.first_token_time else float("nan")
    print(f"\n[prompt tokens: {len(req.prompt_ids)}, generated tokens: {n}, time to first token: {ttft * 1e3:.1f} ms, "
          f"{rate:.1f} tok/s, finish: {req.finish_reason}]", file=sys.stderr)
    if llm.spec is not None:
        print(f"[{req.spec.summary()}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
