"""bench.py - how fast specdec runs, in vLLM's metric language, against the floors measured in the same run.

    python bench.py --random-weights 27b --batch 1 8 --prompt-len 512 --gen-len 128
    python bench.py --random-weights 27b --speculative-config '{"method":"mtp","num_speculative_tokens":1,
        "rejection_sample_method":"synthetic","synthetic_acceptance_rates":[0.85]}'
    python bench.py --model PATH --speculative-config '{"method":"ngram","num_speculative_tokens":4}'
    python bench.py serve --base-url http://127.0.0.1:8000 --num-prompts 32 --max-concurrency 4
    python bench.py serve --dataset-name custom --dataset-path prompts.jsonl    (or sharegpt, a ShareGPT .json, or
        spec_bench, Spec-Bench's question.jsonl; --model DIR: its tokenizer counts and templates them, as vLLM's)
    python bench.py latency --input-len 32 --output-len 128 --batch-size 8     (vllm bench latency; and throughput)

Serve mode is `vllm bench serve` (its flags and defaults: --host / --port / --base-url, --backend, --random-input-len
/ --random-output-len / --random-range-ratio / --random-prefix-len, --burstiness, --goodput, --percentile-metrics /
--metric-percentiles, --save-result / --result-dir / --result-filename / --metadata, the sampling flags,
--num-warmups, --header; its result table, peaks included, and result JSON), against any OpenAI-compatible server.

Offline mode reports TTFT, TPOT, tok/s per sequence and aggregate, acceptance, the weight bandwidth achieved,
and the GEMM-only floor (every weight matrix the step reads, fused as the engine runs them, each GEMM by cuBLAS,
chained in one CUDA graph as in h200-anchors.md) with our TPOT as a ratio of it. Each row as a `# measured:` line
as soon as it is measured (a run cut short keeps those), then a table, then one JSON line last. A row whose timed
run stalled (its longest step over 5x the median, or a CUDA graph captured only then) gets a `# stall` line: the
step times, the late captures and the garbage collector's passes (each row's JSON carries them too).
For a MoE, --true-floor adds what that GEMM chain is not: the bytes a step reads, with the distinct experts of its
actual routing (routed_experts), at the copy rate measured in the same run (true_floor_ms).
"""
import argparse
import dataclasses
import gc
import http.client
import json
import math
import os
import random
import shutil
import statistics
import sys
import threading
import time
import uuid
from datetime import datetime
from urllib.parse import urlsplit

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


def random_model(name, dtype, device, seed=0, quantization=None, draft_head=True):
    """The real-shape model with random weights made on the device (no checkpoint): specdec's --load-format
    dummy on the preset's config; quantization "fp8": quantized as they are made, as --quantization fp8 does,
    with the drafts' FP8 lm_head unless draft_head is False (specdec.add_draft_head: the copy LLM makes where the
    drafts go through the target's lm_head, so that bench times their draft step as the engine runs it)."""
    if quantization not in (None, "none", "fp8"):
        raise sd.ConfigError(f"--quantization {quantization!r} is not supported; only fp8")
    cfg = sd.ModelConfig.from_dict(PRESETS[name])
    sources = sd.dummy_sources(cfg, dtype, device, seed)
    model = sd.build_model(cfg, sources, dtype, device, f"random {name}", quantize=quantization == "fp8")
    sd.add_draft_head(model, quantization, draft_head)
    return model, cfg


TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "toy")  # the shipped model


def write_config(preset, out):
    """A model directory without weights: the preset's config.json (text-only, as ModelConfig reads it) and a
    tokenizer (the toy's: its ids are a small part of the preset's vocabulary; the others decode to nothing).
    specdec loads it with --load-format dummy."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dict(PRESETS[preset], max_position_embeddings=262144, tie_word_embeddings=False), f, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOY, name), out)
    print(f"wrote {out}/config.json ({preset}) and the toy's tokenizer: run it with --load-format dummy")
    return out


def make_cyclic(model, period=64, seed=0):
    """Make a random-weight model continue cyclic text, as a real model continues repeated text: the vocabulary
    split into cycles of `period` ids, every mixer's and MLP's output projection (a MoE's routed experts' too)
    scaled by 1e-4 (FP8 weights: their block scales), so that the final hidden state is the normed embedding of the
    last token, nearly, and the lm_head row of each id's successor in its cycle tilted toward that hidden state
    (its logit ~ sqrt(hidden_size), the others' ~ 1). Greedy text then walks the cycle of the prompt's last token:
    prompt lookup finds drafts as on real text, and a rejected draft is followed by the cycle's next id. Speed is
    unchanged for dense GEMMs (they do not depend on values); a MoE's routing, and so its speed, follows the
    hidden states, which differ here. Returns the cycles [V // period, period]."""
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    cyc = torch.randperm(V, generator=g)[:V // period * period].view(-1, period)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, p in params.items():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")):
                (params[name + "_scale_inv"] if p.dtype == sd.FP8 else p).mul_(1e-4)
        assert model.lm_head is not None, "a cyclic model needs its own lm_head"
        dev, head = model.embed_tokens.weight.device, model.lm_head.weight
        src, dst = cyc.flatten().to(dev), cyc.roll(-1, 1).flatten().to(dev)
        h = model.embed_tokens.weight[src].float()
        head[dst] += (h / h.norm(dim=-1, keepdim=True)).to(head.dtype)
    model.cycles = cyc
    return cyc


def random_qwen3_layer(prefix, H, nh, nkv, hd, I, rand, norm=lambda n: torch.ones(n, dtype=torch.bfloat16)):
    """One Qwen3 decoder layer's tensors (specdec's table) under `prefix`: rand(*shape) for the matrices, norm(n)
    for the norm weights (default ones)."""
    return {prefix + n: norm(*s) if n.endswith("norm.weight") else rand(*s)
            for n, s in sd.qwen3_layer_tensors(H, nh, nkv, hd, I).items()}


def random_bf16(seed):
    """rand(*shape) -> a host bf16 tensor of N(0, 0.02^2) values, from one seeded stream (drawn on the GPU where
    there is one): the random drafters' weights."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    return lambda *s: (torch.randn(*s, device=dev, generator=g) * 0.02).to(torch.bfloat16).cpu()


def write_checkpoint(path, cfg, w):
    """config.json (cfg) and model.safetensors (w, {name: tensor}) in directory path -> path."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    save_file(w, os.path.join(path, "model.safetensors"))
    return path


def random_drafter(path, method, target, layers=5, block=16, rank=256, seed=0, sliding=0, window=2048, layout="ours",
                   shape=None):
    """A random DFlash (z-lab layout) or DSpark (DeepSpec layout) drafter shaped for the target preset; with
    layout "speculators", a DSpark one in the speculators format instead (speculators_dspark: its own shape
    table, `shape` overriding it; `layers` and `block` are then not used). Otherwise: `layers`
    Qwen3 layers of the target's hidden size, taps spread over the target's depth, block `block`; the first
    `sliding` layers sliding-window (`window` keys, causal) and the rest full. For the 27B, DFlash with
    sliding=4 is z-lab/Qwen3.6-27B-DFlash's published shape (shared/reference: 5 layers, 4 sliding-window
    2048 + 1 full, 32 / 8 heads of 128, taps [1, 16, 31, 46, 61], mask id 248070; which layer is the full
    one is our guess: the last)."""
    if layout == "speculators":
        if method != "dspark":
            raise sd.ConfigError(f"--drafter-layout speculators writes DSpark drafters only, not {method}: run the "
                                 f"{method} configs in a separate call with --drafter-layout ours or zlab")
        return speculators_dspark(path, target, rank, seed, sliding, window, **(shape or {}))
    t = PRESETS[target]
    H, L, V = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]
    nh, nkv, hd, I = max(H // 160, 2), max(H // 640, 1), min(128, H // 2), t.get("intermediate_size", 4 * H)
    ids = [1 + round(i * (L - 4) / (layers - 1)) for i in range(layers)]
    cfg = {"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": layers, "num_attention_heads": nh,
           "num_key_value_heads": nkv, "head_dim": hd, "intermediate_size": I, "vocab_size": V, "hidden_act": "silu",
           "rms_norm_eps": 1e-6, "rope_theta": 10000000, "max_position_embeddings": 262144, "attention_bias": False,
           "tie_word_embeddings": False, "block_size": block, "num_target_layers": L,
           "layer_types": ["sliding_attention"] * sliding + ["full_attention"] * (layers - sliding),
           "sliding_window": window if sliding else None}
    if method == "dflash":
        cfg.update(architectures=["DFlashDraftModel"], dflash_config={"mask_token_id": V - 250, "target_layer_ids": ids})
    else:
        cfg.update(architectures=["Qwen3DSparkModel"], target_layer_ids=ids, mask_token_id=V - 250, markov_rank=rank,
                   markov_head_type="vanilla", enable_confidence_head=False)
    r = random_bf16(seed)
    w = {"fc.weight": r(H, len(ids) * H), "hidden_norm.weight": torch.ones(H, dtype=torch.bfloat16),
         "norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    for i in range(layers):
        w.update(random_qwen3_layer(f"layers.{i}.", H, nh, nkv, hd, I, r))
    if method == "dspark":
        w.update({"markov_head.markov_w1.weight": r(V, rank), "markov_head.markov_w2.weight": r(V, rank)})
    return write_checkpoint(path, cfg, w)


SPECULATORS_DSPARK = {  # target preset -> the shape of a speculators-format DSpark drafter for it (see below)
    # RedHatAI/Qwen3.6-35B-A3B-speculator.dspark, as far as it is known (its config.json is not available to us):
    #   aux_ids: its training command's --target-layer-ids, which speculators writes unchanged into
    #     aux_hidden_state_layer_ids (vLLM's ids: the stream entering layer L; the loader takes 1 off)
    #   layers 5, block 8: the sibling RedHatAI DSpark cards ("5-layer Qwen3-style backbone", max draft 8) [assumed]
    #   heads 16 / kv_heads 2 / head_dim 256: the verifier's, which speculators' draft config copies [assumed]
    #   intermediate 6144: the verifier (MoE) has no dense intermediate_size; speculators then falls back to
    #     3 x hidden (one version seen; another uses the active experts' width, 8 x 512 + 512 = 4608) [assumed]
    #   draft_vocab 24576 with d2t: a RedHatAI DFlash for Qwen3.5-35B-A3B's reduced vocabulary [assumed]
    "35b-a3b": dict(aux_ids=[2, 10, 20, 30, 37], layers=5, block=8, heads=16, kv_heads=2, head_dim=256,
                    intermediate=6144, draft_vocab=24576, verifier="Qwen/Qwen3.6-35B-A3B",
                    published="RedHatAI/Qwen3.6-35B-A3B-speculator.dspark (shape partly assumed)"),
    # NOT a published layout (no speculators DSpark for a 27B is known): the same rules on the 27B, the taps
    # z-lab's 27B DFlash ones ([1, 16, 31, 46, 61], ours) in vLLM's ids, the verifier's dense intermediate size
    "27b": dict(aux_ids=[2, 17, 32, 47, 62], layers=5, block=8, heads=24, kv_heads=4, head_dim=256,
                intermediate=17408, draft_vocab=24576, verifier="Qwen/Qwen3.6-27B",
                published=None),
    # the tests' tiny target (aux id 4 = its last layer's output, the largest id speculators allows)
    "tiny": dict(aux_ids=[1, 3, 4], layers=5, block=8, heads=4, kv_heads=2, head_dim=32, intermediate=128,
                 draft_vocab=512, verifier="tiny", published=None),
}


SHAPE_KEYS = ("aux_ids", "layers", "block", "heads", "kv_heads", "head_dim", "intermediate", "draft_vocab")


def speculators_dspark(path, target, rank=256, seed=0, sliding=0, window=2048, **shape):
    """A random DSpark drafter in the vllm-project/speculators format, for the target preset: config.json with
    speculators_model_type "dspark", architectures ["DSparkSpeculator"], the Qwen3 layer config nested
    (transformer_layer_config), aux_hidden_state_layer_ids in vLLM's semantics (specdec takes 1 off),
    block_size, mask_token_id, draft_vocab_size, target_hidden_size, sample_from_anchor true, a vanilla Markov
    head of rank `rank`, the confidence head (with Markov) and speculators_config; weights fc, hidden_norm,
    layers.*, norm, lm_head [draft vocab], d2t (target id = id + d2t[id]), t2d, markov_head.markov_w1 [V, r]
    / markov_w2 [V_d, r], confidence_head.proj [1, H + r] (no embed_tokens: the target's). The shape is
    SPECULATORS_DSPARK[target] (its comments say which parts are assumptions), updated by `shape` (keys:
    aux_ids layers block heads kv_heads head_dim intermediate draft_vocab); the first `sliding` layers
    sliding-window (`window` keys) and the rest full (assumed all full)."""
    if target not in SPECULATORS_DSPARK:
        raise sd.ConfigError(f"--drafter-layout speculators: no shape for target {target!r} "
                             f"(known: {', '.join(SPECULATORS_DSPARK)})")
    if set(shape) - set(SHAPE_KEYS):
        raise sd.ConfigError(f"--drafter-shape: unknown keys {sorted(set(shape) - set(SHAPE_KEYS))} "
                             f"(known: {' '.join(SHAPE_KEYS)})")
    c = {**SPECULATORS_DSPARK[target], **shape}
    t = PRESETS[target]
    H, L, V, Vd = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"], c["draft_vocab"]
    n, nh, nkv, hd, I = c["layers"], c["heads"], c["kv_heads"], c["head_dim"], c["intermediate"]
    aux = list(c["aux_ids"])
    if not all(0 <= i <= L for i in aux) or Vd > V:
        raise sd.ConfigError(f"speculators drafter for {target}: aux ids {aux} must lie in 0..{L} and the draft "
                             f"vocabulary {Vd} must not exceed {V}")
    layer_cfg = {"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": n, "num_attention_heads": nh,
                 "num_key_value_heads": nkv, "head_dim": hd, "intermediate_size": I, "vocab_size": V,
                 "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000000,
                 "max_position_embeddings": 262144, "attention_bias": False, "tie_word_embeddings": False,
                 "layer_types": ["sliding_attention"] * sliding + ["full_attention"] * (n - sliding),
                 "sliding_window": window if sliding else None}
    cfg = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
           "transformer_layer_config": layer_cfg, "aux_hidden_state_layer_ids": aux, "block_size": c["block"],
           "mask_token_id": V - 250, "draft_vocab_size": Vd, "target_hidden_size": H,  # mask: 248070 (Qwen3.5/3.6)
           "sliding_window_non_causal": False, "sample_from_anchor": True, "markov_rank": rank,
           "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
           "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy",
                                                        "speculative_tokens": c["block"]}],
                                  "verifier": {"name_or_path": c["verifier"], "architectures": [
                                      "Qwen3_5MoeForConditionalGeneration" if "moe" in t["model_type"]
                                      else "Qwen3_5ForConditionalGeneration"]}}}
    r = random_bf16(seed)
    keep = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:Vd].sort().values  # draft -> target
    ones = lambda m: torch.ones(m, dtype=torch.bfloat16)                                  # noqa: E731
    w = {"fc.weight": r(H, len(aux) * H), "hidden_norm.weight": ones(H), "norm.weight": ones(H),
         "lm_head.weight": r(Vd, H),                                                       # draft vocab rows
         "d2t": keep - torch.arange(Vd),                                                   # target id - draft id
         "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, keep, True),               # training-only: skipped
         "markov_head.markov_w1.weight": r(V, rank), "markov_head.markov_w2.weight": r(Vd, rank),
         "confidence_head.proj.weight": r(1, H + rank), "confidence_head.proj.bias": ones(1)}  # loaded, unused
    for i in range(n):
        w.update(random_qwen3_layer(f"layers.{i}.", H, nh, nkv, hd, I, r))
    return write_checkpoint(path, cfg, w)


DRAFT_LM = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                intermediate_size=3072)  # Qwen3-0.6B's shapes, with the target's vocabulary (draft_model rows)


def random_draft_lm(path, target, seed=0):
    """A random plain-Qwen3 draft LM (Qwen3-0.6B shapes, the target preset's vocabulary) for method draft_model."""
    c, V = DRAFT_LM, PRESETS[target]["vocab_size"]
    H, I, nh, nkv, hd = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    cfg = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **c, "vocab_size": V, "hidden_act": "silu",
           "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 262144, "attention_bias": False,
           "tie_word_embeddings": True}
    r = random_bf16(seed)
    w = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    for i in range(c["num_hidden_layers"]):
        w.update(random_qwen3_layer(f"model.layers.{i}.", H, nh, nkv, hd, I, r))
    return write_checkpoint(path, cfg, w)


def hf_generate_tpot(name, prompt_len, gen_len, device, dtype=torch.bfloat16, seed=0):
    """Hugging Face transformers' generate (greedy, batch 1) on the preset's shapes with random weights, built
    directly on the device: ms per output token after the first (one generate of 1 token is the prefill)."""
    import transformers
    c = {k: v for k, v in PRESETS[name].items() if k != "model_type"}
    moe = "moe" in PRESETS[name]["model_type"]
    cfg = (transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig)(**c)
    cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            m = cls(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def gen(model, n):
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync()
        assert out.shape[1] == prompt_len + n
        return time.perf_counter() - t
    gen(m, 2)  # warm-up
    t1, tn = gen(m, 1), gen(m, gen_len)
    del m
    if sync is torch.cuda.synchronize:
        torch.cuda.empty_cache()
    return dict(ttft_ms=1e3 * t1, tpot_ms=1e3 * (tn - t1) / (gen_len - 1), transformers=transformers.__version__)


def linear_weights(model, moe_active=None):
    """The weight matrices one decode step reads, as the engine multiplies by them: projections fused at load
    (GDN in_proj, attention qkv, MLP gate_up; FP8: GDN in_proj_qkvz and in_proj_ba, the MoE's router_gate) as one
    matrix each, every other linear layer, the lm_head; for MoE also `moe_active` experts per layer. Returns a
    list of [out, in] tensors (FP8 ones float8_e4m3fn: their fp32 block scales, 1/16384 of the bytes, are left
    out)."""
    ws, fused_parts = [], set()
    for name, mod in model.named_modules():
        if name.startswith("mtp"):
            continue
        for attr, parts in (("in_proj", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
                            ("in_proj_qkvz", ("in_proj_qkv", "in_proj_z")), ("in_proj_ba", ("in_proj_b", "in_proj_a")),
                            ("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj")),
                            ("router_shared", ("gate", "shared_expert_gate", "shared_expert.gate_proj",
                                               "shared_expert.up_proj")),
                            ("router_gate", ("gate", "shared_expert_gate"))):
            if isinstance(getattr(mod, attr, None), torch.Tensor):
                ws.append(getattr(mod, attr))
                fused_parts.update(id(mod.get_submodule(p)) for p in parts)
        if isinstance(mod, torch.nn.Linear) and id(mod) not in fused_parts:
            ws.append(mod.weight)
        elif isinstance(mod, sd.MoE):
            for e in range(moe_active):
                ws += [mod.experts.gate_up_proj[e], mod.experts.down_proj[e]]
    if model.lm_head is None:  # tied: the embedding is the lm_head (an untied lm_head is a Linear, counted above)
        ws.append(model.embed_tokens.weight)
    return ws


def replay_ms(replay, iters=20):
    """Median ms of replay() (one or more CUDA graph replays), timed with events."""
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_ms(fn, iters=20):
    """ms of fn's kernels captured in one CUDA graph (fn runs once eagerly first: compiles, cuBLAS picks)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    ms = replay_ms(g.replay, iters)
    del g
    return ms


def copy_gbps(device, nbytes=1 << 30):
    """Memory traffic (read + write) of a device-to-device copy of nbytes by an elementwise kernel in a CUDA graph,
    GB/s: the rate a step that reads each of its bytes once can reach at best. (Not Tensor.copy_: captured, it is
    a memcpy node, which measured 2.76 TB/s on the H200 where kernels reach 4.2.)"""
    src = torch.zeros(nbytes // 4, dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (graph_ms(lambda: torch.bitwise_not(src, out=dst)) * 1e-3) / 1e9


def expert_counts(model, run, max_rows=None):
    """Distinct routed experts of each MoE layer call while run() runs the model (calls of more than max_rows rows
    left out): a hook on each MoE layer recomputes the router's top-k of the rows it gets, as the model routes
    them. Returns the counts, one per layer call ([] for a dense model)."""
    counts = []

    def hook(mod, args, out):
        x = args[0].reshape(-1, args[0].shape[-1])
        if max_rows is None or x.shape[0] <= max_rows:
            counts.append(sd.K.moe_route(sd.K.linear(x, mod.gate.weight), mod.top_k)[1].unique().numel())
    hooks = [layer.mlp.register_forward_hook(hook) for layer in model.layers if isinstance(layer.mlp, sd.MoE)]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return counts


def routed_experts(model, spec, B, prompt_len, device, dtype, steps=8, seed=1):
    """Distinct routed experts per MoE layer per decode / verify step, counted from the actual routing: B
    requests of random prompts decoded eagerly for `steps` steps (speculation as in `spec`), expert_counts over
    the target's MoE layers (steps of at most B * (k+1) rows: prefill and the drafter's layers are not counted).
    Returns the mean over layers and steps."""
    k = spec.num_speculative_tokens if spec else 0

    def run():
        eng = sd.Engine(model, None, spec, B, prompt_len + 2 * steps * (k + 1) + 8, dtype, device, seed, True,
                        enable_chunked_prefill=False)
        g = torch.Generator().manual_seed(seed)
        for _ in range(B):
            eng.add_request(torch.randint(0, model.cfg.vocab_size, (prompt_len,), generator=g).tolist(),
                            sd.SamplingParams(temperature=0, max_tokens=steps * (k + 1), ignore_eos=True))
        for _ in range(steps + 1):
            if eng.has_work():
                eng.step()
    counts = expert_counts(model, run, B * (k + 1))
    return sum(counts) / max(len(counts), 1)


def true_floor_ms(model, experts, gbps):
    """ms to read once what a target step reads (every linear weight outside the routed experts, as
    linear_weights lists them, plus `experts` distinct experts' gate_up and down in each MoE layer) at the
    measured copy rate."""
    dense = sum(w.numel() * w.element_size() for w in linear_weights(model, 0))
    moes = [layer.mlp.experts for layer in model.layers if isinstance(layer.mlp, sd.MoE)]
    per = sum((e.gate_up_proj[0].numel() + e.down_proj[0].numel()) * e.gate_up_proj.element_size() for e in moes)
    return (dense + experts * per) / (gbps * 1e9) * 1e3


def gemm_floor(ws, M, iters=20):
    """ms per step of a CUDA graph chaining x @ W^T over all weights at M tokens (cuBLAS; FP8 weights through
    kernels.linear's FP8 path, with unit block scales: the time does not depend on the values)."""
    dt = next((w.dtype for w in ws if w.dtype != sd.FP8), torch.bfloat16)
    xs = {w.shape[1]: torch.randn(M, w.shape[1], device=w.device, dtype=dt) for w in ws}
    B = sd.K.FP8_BLOCK
    ones = [torch.ones(-(-w.shape[0] // B), -(-w.shape[1] // B), device=w.device) if w.dtype == sd.FP8 else None
            for w in ws]
    outs = [None] * len(ws)

    def chain():
        for i, w in enumerate(ws):
            outs[i] = xs[w.shape[1]] @ w.t() if ones[i] is None else sd.K.linear(xs[w.shape[1]], w, scale=ones[i])
    return graph_ms(chain, iters)


class TimedProposer:
    """A proposer whose propose() is timed, the device synced on both sides (two syncs per step: for a separate
    short run only); all else is the wrapped proposer's. .times: seconds per call."""
    def __init__(self, proposer, device):
        self.proposer = proposer
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.times = []

    def __getattr__(self, name):  # prefill, commit, taps
        return getattr(self.proposer, name)

    def propose(self, batch):
        self.sync()
        t0 = time.perf_counter()
        out = self.proposer.propose(batch)
        self.sync()
        self.times.append(time.perf_counter() - t0)
        return out


def run_batch(model, spec, B, prompt_len, gen_len, device, dtype, enforce_eager, seed=0, async_steps=None,
              max_model_len=None, draft_time=True):
    """B concurrent requests of random prompts; returns per-request timings and acceptance stats. For ngram the
    prompt is a random 64-token segment repeated, so that prompt lookup finds matches. max_model_len: the
    engine's (its caches' length, which its CUDA graphs' attention is sized for); None: just what the rows need."""
    k = spec.num_speculative_tokens if spec else 0
    eng = sd.Engine(model, None, spec, B, max_model_len or prompt_len + gen_len + 8 + 2 * k, dtype, device, seed,
                    enforce_eager, async_steps, enable_chunked_prefill=False)  # the admitting step prefills all
    g = torch.Generator().manual_seed(seed)
    V = model.cfg.vocab_size

    def prompt():
        cyc = getattr(model, "cycles", None)
        if cyc is not None:  # a model made cyclic: one of its cycles from a random id, repeated
            i, j = torch.randint(0, cyc.numel(), (2,), generator=g).tolist()
            c = cyc[i % cyc.shape[0]].roll(j % cyc.shape[1])
            return c.repeat(prompt_len // c.numel() + 1)[:prompt_len].tolist()
        if spec is not None and spec.method == "ngram":
            return torch.randint(0, V, (64,), generator=g).repeat(prompt_len // 64 + 1)[:prompt_len].tolist()
        return torch.randint(0, V, (prompt_len,), generator=g).tolist()

    sp = sd.SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    # warm-up, outside the timed run: compiles the kernels for these prompts and steps (request i stops k + 2 tokens
    # after request i - 1), then Engine.warmup captures the graphs of every batch bucket up to B, which a timed batch
    # shrinks through as its requests finish at different steps (speculative steps emit different counts).
    for i in range(B):
        eng.add_request(prompt(), sd.SamplingParams(temperature=0, max_tokens=min(2 + (k + 2) * i, gen_len),
                                                    ignore_eos=True))
    while eng.has_work():
        eng.step()
    eng.warmup()  # and every bucket for certain: the requests above can stop in the same step, skipping one
    eng.stats = sd.SpecStats()
    reqs = [eng.add_request(prompt(), sp) for _ in range(B)]
    torch.cuda.synchronize() if device.type == "cuda" else None
    # what could stall the timed run, recorded to explain an outlier row: graphs captured only now (a bucket the
    # warm-up missed), the garbage collector's passes, and the longest engine step against the median one
    graphs = eng.runner.graphs.graphs if eng.runner.graphs is not None else {}
    n_graphs, gc_ms, gc_t = len(graphs), [], []

    def gc_cb(phase, info):
        if phase == "start":
            gc_t.append(time.perf_counter())
        else:
            gc_ms.append(1e3 * (time.perf_counter() - gc_t.pop()))
    gc.callbacks.append(gc_cb)
    t0 = time.perf_counter()
    for r in reqs:
        r.arrival_time = t0
    eng.step()  # admits all B requests: each prefilled on its own, each emitting its first token
    t_first = time.perf_counter()
    steps = []
    while eng.has_work():
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    t1 = time.perf_counter()
    gc.callbacks.remove(gc_cb)
    stalls = dict(late_graph_captures=len(graphs) - n_graphs, gc_passes=len(gc_ms), gc_ms=sum(gc_ms),
                  max_step_ms=1e3 * max(steps, default=0), median_step_ms=1e3 * statistics.median(steps or [0]))
    ttft = [r.first_token_time - r.arrival_time for r in reqs]
    # decode time per output token once the batch is running (from the end of the admitting step, so that the
    # other requests' prefills are not counted in the first request's TPOT)
    tpot = [(r.finish_time - t_first) / (len(r.output_ids) - 1) for r in reqs]
    n_out = sum(len(r.output_ids) for r in reqs)
    st = eng.stats
    draft_ms = None
    if spec is not None and draft_time:  # the drafter's time per step, in a separate short run (it syncs the device)
        timed = eng.runner.proposer = TimedProposer(eng.runner.proposer, device)
        eng.runner.whole_steps = False  # steps by pieces: a step captured whole has no propose() to time
        for _ in range(2):  # the first round untimed: the pieces' graphs are captured, and kernels compiled, lazily
            timed.times = []
            for _ in range(B):
                eng.add_request(prompt(), sd.SamplingParams(temperature=0, max_tokens=min(32, gen_len),
                                                            ignore_eos=True))
            while eng.has_work():
                eng.step()
        # the median step: as the batch shrinks, a bucket the first round did not reach is captured in the
        # second (one step of tens of ms, which a mean would spread over the others)
        draft_ms = 1e3 * statistics.median(timed.times) if timed.times else None
    del eng
    return dict(ttft_ms=1e3 * statistics.mean(ttft), tpot_ms=1e3 * statistics.mean(tpot), wall_s=t1 - t0,
                tok_s_per_seq=1 / statistics.mean(tpot), tok_s_aggregate=n_out / (t1 - t0),
                decode_tok_s_aggregate=B / statistics.mean(tpot), num_drafts=st.num_drafts, draft_ms_per_step=draft_ms,
                mean_acceptance_length=st.mean_acceptance_length if st.num_drafts else None,
                draft_acceptance_rate=st.draft_acceptance_rate if st.num_drafts else None, **stalls)


def run_stall(model, spec, streams, prompt_len, long_len, gen_len, device, dtype, budget, chunked, seed=0):
    """`streams` requests decode; 24 steps after each has 16 tokens a long_len-token prompt arrives. Returns the
    streams' inter-token latencies (host time between a stream's token emissions, per token) in those 24 steps
    and while it was prefilled, and its TTFT. Warm-up first (graphs, and one long prompt alone: its kernels compile)."""
    k = spec.num_speculative_tokens if spec else 0
    eng = sd.Engine(model, None, spec, streams + 1, long_len + gen_len + 8 + 2 * k, dtype, device, seed,
                    max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    g = torch.Generator().manual_seed(seed)
    V = model.cfg.vocab_size
    prompt = lambda n: torch.randint(0, V, (n,), generator=g).tolist()
    for i in range(streams + 1):
        eng.add_request(prompt(prompt_len), sd.SamplingParams(temperature=0, max_tokens=2 + (k + 2) * i,
                                                              ignore_eos=True))
    eng.add_request(prompt(long_len), sd.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while eng.has_work():
        eng.step()
    sp = sd.SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    marks = {}
    reqs = [eng.add_request(prompt(prompt_len), sp) for _ in range(streams)]
    for r in reqs:
        r.on_update = lambda r, n: marks.setdefault(r.id, []).append((time.perf_counter(), n))
    while min(len(r.output_ids) for r in reqs) < 16:  # every stream admitted and running
        eng.step()
    t_steady = time.perf_counter()
    for _ in range(24):
        eng.step()
    t_arrive = time.perf_counter()
    long_req = eng.add_request(prompt(long_len), sd.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while not long_req.output_ids:
        eng.step()
        assert not any(r.finished for r in reqs), "gen_len too short: a stream finished during the prefill"
    t_first = long_req.first_token_time
    for r in reqs + [long_req]:
        eng.abort(r)
    while eng.has_work():
        eng.step()
    before, during = [], []
    for r in reqs:
        m = marks[r.id]
        for (t0, _), (t1, n) in zip(m, m[1:]):
            if t0 >= t_steady:
                (before if t1 <= t_arrive else during if t0 < t_first else []).extend([(t1 - t0) / n] * n)
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]
    return dict(streams=streams, prompt_len=prompt_len, long_len=long_len, budget=budget, chunked=chunked,
                ttft_long_ms=1e3 * (t_first - t_arrive), tpot_before_ms=1e3 * statistics.mean(before),
                tpot_during_ms=1e3 * statistics.mean(during), p99_itl_during_ms=1e3 * pct(during, 0.99),
                max_itl_during_ms=1e3 * max(during), tokens_during=len(during))


# ==============================================================================================
# Serving benchmark: `vllm bench serve`'s numbers against a running OpenAI-compatible server
# (standard library only; the same request bodies and metric definitions as vLLM)
# ==============================================================================================

WORDS = ("the of and to in is it that for on with as was at by be this from or have an are not but what all were "
         "when we there can one your which their said if do will each about how up out them then she many some so "
         "these would other into has more her two like him see time could no make than first been its who now "
         "people my made over did down only way find use may water long little very after words called just where "
         "most know get through back much before go good new write our used me man too any day same right look "
         "think also around another came come work three word must because does part even place well").split()


def under(url, path):
    """path under the base URL's own path (vLLM: base_url + endpoint): http://h:p/prefix + /v1/models."""
    return urlsplit(url).path.rstrip("/") + path


def connect(url, timeout):
    u = urlsplit(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return cls(u.hostname, u.port or (443 if u.scheme == "https" else 80), timeout=timeout)


def http_get(url, path, headers, timeout=30):
    conn = connect(url, timeout)
    try:
        conn.request("GET", under(url, path), headers=headers)
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"GET {path}: HTTP {r.status} {data[:200]!r}")
        return data
    finally:
        conn.close()


def scrape_spec(url, headers, settle=0.0):
    """Sum the vllm:spec_decode_* counters over their label sets (None if /metrics cannot be read). The server's
    metrics are a snapshot taken after each engine step, so right after the last stream ends they may lag its
    last step: with settle > 0, read again (for up to settle seconds) until the gauges show no request running or
    waiting."""
    names = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted"}
    busy = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    t0 = time.perf_counter()
    while True:
        out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
        queued = 0.0
        try:  # (ValueError: a header http.client refuses, or lines not of Prometheus' text format: unreadable too)
            for line in http_get(url, "/metrics", headers).decode().splitlines():
                if line.startswith(busy):
                    queued += float(line.rsplit(" ", 1)[1])
                if not line.startswith("vllm:spec_decode_"):
                    continue
                head, value = line.rsplit(" ", 1)
                name = head.split("{")[0]
                if name in names:
                    out[names[name]] += float(value)
                elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                    pos = int(head.split('position="')[1].split('"')[0])
                    out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + float(value)
        except (OSError, RuntimeError, ValueError, IndexError, http.client.HTTPException):
            return None
        if queued == 0 or time.perf_counter() - t0 >= settle:
            return out
        time.sleep(0.05)


def send(url, endpoint, body, headers, timeout):
    """One streaming request, timed as vllm bench serve times it."""
    rec = {"ok": False, "ttft": 0.0, "itl": [], "latency": 0.0, "output_tokens": None, "prompt_tokens": None,
           "chunks": 0, "error": "", "text": ""}
    conn = connect(url, timeout)
    st = rec["start"] = time.perf_counter()
    data = b""  # the chunk being read
    try:
        conn.request("POST", under(url, endpoint), body=json.dumps(body), headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            rec["error"] = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return rec
        last = None
        while True:
            line = resp.readline()
            if not line:
                break
            now = time.perf_counter()
            line = line.strip()
            if not line.startswith(b"data:"):  # blank separators and ": ping" comments
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                rec["error"] = str(chunk["error"])
                return rec
            if chunk.get("choices"):  # TTFT at the first chunk with choices, even if its text is empty
                c = chunk["choices"][0]
                rec["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                if last is None:
                    rec["ttft"] = now - st
                else:
                    rec["itl"].append(now - last)
                last = now
                rec["chunks"] += 1
            elif chunk.get("usage"):
                rec["output_tokens"] = chunk["usage"].get("completion_tokens")
                rec["prompt_tokens"] = chunk["usage"].get("prompt_tokens")
                if any(n is not None and (type(n) is not int or n < 0) for n in (rec["output_tokens"],
                                                                                  rec["prompt_tokens"])):
                    raise TypeError("usage")  # (summed into the totals: a count that is not one fails the request)
        if last is None:
            rec["error"] = "no content chunk received"
            return rec
        rec["latency"] = last - st  # the usage-only chunk does not advance E2EL
        if rec["output_tokens"] is None:  # no usage chunk: count chunks (exact without speculation)
            rec["output_tokens"] = rec["chunks"]
        rec["ok"] = True
    except (OSError, ValueError, http.client.HTTPException) as e:
        rec["error"] = f"{type(e).__name__}: {str(e).strip()}"  # (a bad status line ends in its newline)
    except (AttributeError, TypeError, KeyError, IndexError):  # a chunk not of the OpenAI shape: this request fails,
        rec.update(error=f"malformed stream chunk: {data[:200]!r}", output_tokens=None, prompt_tokens=None)  # not all
    finally:
        conn.close()
    return rec


def first_model(data):
    """The first model's id in a /v1/models answer (vLLM: data[0].id), or a ValueError saying that it lists none."""
    try:
        return json.loads(data)["data"][0]["id"]
    except (ValueError, TypeError, KeyError, IndexError):  # not JSON, or not of the OpenAI list's shape
        raise ValueError(f"no model listed in its answer {data[:200]!r}") from None


def local_tokenizer(a):
    """(Tokenizer, ChatTemplate) of --tokenizer or --model where either names a local checkpoint (a directory, or a
    hub id in the local cache) with a tokenizer.json, else (None, None): what vllm bench serve counts and templates
    a dataset's prompts with, on the client."""
    for name in (a.tokenizer, a.model):
        try:
            path = sd.resolve_model(name) if name else None
        except sd.ConfigError:
            path = None
        if path and os.path.isfile(os.path.join(path, "tokenizer.json")):
            tok = sd.Tokenizer.from_dir(path)
            return tok, sd.ChatTemplate.from_checkpoint(path, tok)
    return None, None


class DatasetError(ValueError):
    """A dataset file that cannot be used: serve_benchmark prints it as one `error:` line."""


def valid_sequence(prompt_len, output_len, fixed_output):
    """vLLM's ShareGPT filter (is_valid_sequence): a prompt and a reply of 4 tokens or more (the reply's length not
    checked when --sharegpt-output-len fixes it), a prompt of 1024 at most, both together 2048 at most."""
    return (prompt_len >= 4 and (fixed_output or output_len >= 4) and prompt_len <= 1024
            and prompt_len + output_len <= 2048)


def load_dataset(name, path, num_prompts, seed=0, shuffle=True, oversample=True, tok=None, output_len=None,
                 category=None):
    """The prompts of a dataset file, as vllm bench serve reads them: [(text, max_tokens or None)], shuffled with
    `seed` unless shuffle=False, then cut to num_prompts or, with fewer entries, cycled up to it (unless
    oversample=False: the file's count). custom: JSON lines, each {"prompt": str}, an optional "output_tokens"
    (that request's max_tokens). sharegpt: a JSON list of {"conversations": [{"from": "human", "value": str},
    {"from": "gpt", ...}, ...]}; the first human turn is the prompt and the turn after it the reply; conversations
    without those are skipped (vLLM skips those of fewer than two turns). With a tokenizer `tok`, as vLLM: each
    request's max_tokens is its reply's length in tokens (or output_len, --sharegpt-output-len), and pairs outside
    vLLM's lengths are skipped (valid_sequence); without one, max_tokens is output_len (None: the caller's).
    spec_bench: Spec-Bench's question.jsonl, each {"turns": [str, ...], "category": str}: the first turn is the
    prompt, only `category`'s if given (vLLM's SpecBench). Raises DatasetError naming the file and line."""
    if not path:
        raise DatasetError(f"--dataset-name {name} needs --dataset-path")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    def parse(s, line=None):  # JSON, or the error naming the file's line (line None: the decoder's own count)
        try:
            return json.loads(s)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{line or e.lineno}: not JSON (column {e.colno}: {e.msg})") from None

    entries = []
    if name == "custom":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            obj = parse(line, n)
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise DatasetError(f'{path}:{n}: no "prompt" string')
            out = obj.get("output_tokens")
            if out is not None and (type(out) is not int or out < 1):  # type(): true is an int to isinstance
                raise DatasetError(f'{path}:{n}: "output_tokens" must be a positive integer, not {out!r}')
            entries.append((obj["prompt"], out))
    elif name == "spec_bench":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            obj = parse(line, n)
            turns = obj.get("turns") if isinstance(obj, dict) else None
            if not (isinstance(turns, list) and turns and isinstance(turns[0], str)):
                raise DatasetError(f'{path}:{n}: no "turns" list of strings')
            if category is None or obj.get("category") == category:
                entries.append((turns[0], None))
    elif name == "sharegpt":
        data = parse(text)
        if not isinstance(data, list):
            raise DatasetError(f"{path}: not a JSON list of conversations")
        for i, item in enumerate(data):
            turns = item.get("conversations") if isinstance(item, dict) else None
            if not isinstance(turns, list):
                raise DatasetError(f'{path}: entry {i}: no "conversations" list')
            at = next((j for j, t in enumerate(turns) if isinstance(t, dict) and t.get("from") == "human"), None)
            if at is None or at + 1 >= len(turns):  # no human turn, or none answered
                continue
            human, reply = turns[at], turns[at + 1]
            if not isinstance(human.get("value"), str):
                raise DatasetError(f'{path}: entry {i}: the human turn has no "value" string')
            if tok is None:
                entries.append((human["value"], output_len))
                continue
            n_in = len(tok.encode(human["value"]))
            said = reply.get("value") if isinstance(reply, dict) else None  # (a reply turn of another shape: no text)
            n_out = output_len or len(tok.encode(said if isinstance(said, str) else ""))
            if valid_sequence(n_in, n_out, output_len is not None):
                entries.append((human["value"], n_out))
    else:
        raise DatasetError(f"unknown dataset {name!r}")
    if not entries:
        raise DatasetError({"custom": f"{path}: no prompts in it",
                            "spec_bench": f"{path}: no questions in it" + (f" of category {category!r}" if category
                                                                            else "")}.get(
            name, f"{path}: no conversation with an answered human turn" + (" within vLLM's lengths" if tok else "")))
    if shuffle:
        random.Random(seed).shuffle(entries)
    if oversample:  # cycle through the file again (vLLM draws the extra requests at random from it)
        entries = [entries[i % len(entries)] for i in range(num_prompts)]
    return entries[:num_prompts]


def random_prompts(rng, n, prompt_len, chat, output_len=None, range_ratio=0.0, prefix_len=0):
    """vllm bench serve's random dataset: [(prompt, max_tokens)], each prompt prefix_len tokens shared by all (the
    same prefix every request) and then its own random ones: token ids, or (the chat endpoint, which takes text)
    random words. With range_ratio r, each request's own length and its max_tokens are drawn uniformly from
    [L * (1 - r), L * (1 + r)] (vLLM's --random-range-ratio); at r = 0 they are prompt_len and output_len
    (output_len None: --gen-len's)."""
    if not 0 <= range_ratio < 1:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), not {range_ratio}")
    pick = (lambda: rng.choice(WORDS)) if chat else (lambda: rng.randrange(1000))
    span = lambda L: L if range_ratio == 0 else rng.randint(int(L * (1 - range_ratio)), int(L * (1 + range_ratio)))
    prefix = [pick() for _ in range(prefix_len)]
    out = []
    for _ in range(n):
        toks = prefix + [pick() for _ in range(span(prompt_len))]
        out.append((" ".join(toks) if chat else toks, None if output_len is None else max(1, span(output_len))))
    return out


def peaks(results):
    """vllm bench serve's peak output token throughput and peak concurrency over successful requests (records of
    send(): start, ttft, itl, latency, on one clock): the most tokens whose arrival falls in one whole second
    counted from the first start, and the most requests in flight at once (each over [start, start + latency))."""
    ok = [r for r in results if r["ok"]]
    if not ok:
        return 0.0, 0
    t0 = min(r["start"] for r in ok)
    per_second = {}
    for r in ok:
        t = r["start"] + r["ttft"]
        for gap in [0.0] + r["itl"]:
            t += gap
            per_second[int(t - t0)] = per_second.get(int(t - t0), 0) + 1
    events = sorted([(r["start"], 1) for r in ok] + [(r["start"] + r["latency"], -1) for r in ok])
    now = peak = 0
    for _, step in events:  # at equal times the end (-1) sorts first: half-open intervals
        now += step
        peak = max(peak, now)
    return float(max(per_second.values())), peak


def ramp_rate(strategy, start, end, i, n):
    """vLLM's rate (requests/s) of request i of n under --ramp-up-strategy: start for the first, end for the last,
    and between them linear or exponential (geometric) in the request's number, not in time."""
    progress = i / max(n - 1, 1)
    if strategy == "linear":
        return start + (end - start) * progress
    return start * (end / start) ** progress


def arrival_schedule(n, rate, burstiness, rng, ramp=None):
    """vllm bench serve's arrivals (get_request): ([seconds after the run's start at which each of n requests is
    sent], [the rate each was sent at]). Each request, the first too, waits a gap drawn at its rate: none at an
    infinite rate, 1 / rate at an infinite burstiness, else gamma-distributed with shape burstiness and mean
    1 / rate (burstiness 1: Poisson). ramp: (strategy, start, end), each request's rate from ramp_rate; without
    it vLLM rescales the summed gaps of a finite rate to end at exactly n / rate seconds, so that runs of
    different seeds send at the same average rate."""
    rates = [rate if ramp is None else ramp_rate(*ramp, i, n) for i in range(n)]
    offsets, t = [], 0.0
    for r in rates:
        if not math.isinf(r):
            t += 1 / r if math.isinf(burstiness) else rng.gammavariate(burstiness, 1 / (r * burstiness))
        offsets.append(t)
    if ramp is None and t > 0:
        offsets = [x * (n / rate) / t for x in offsets]
    return offsets, rates


def rps_change_events(start_rps, rates, offsets, wall0):
    """vLLM's result key rps_change_events of a ramp-up: the whole rates it passes through, each stamped (ISO, local
    time) when the first request at or above it arrives; the start rate at the run's start (wall0, time.time())."""
    events, last = [{"rps": start_rps, "timestamp": datetime.fromtimestamp(wall0).isoformat()}], start_rps
    for r, dt in zip(rates, offsets):
        if int(r) > last:
            stamp = datetime.fromtimestamp(wall0 + dt).isoformat()
            events += [{"rps": v, "timestamp": stamp} for v in range(last + 1, int(r) + 1)]
            last = int(r)
    return events


def pct_name(p):
    """vLLM's name of a percentile in keys and labels: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def percentile(xs, p):
    """numpy's percentile (linear interpolation) of sorted xs."""
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def summarize(xs, percentiles=(99,)):
    """mean / median / std / p<each percentile> in ms; numpy's linear-interpolation percentile; zeros for an empty
    list."""
    out = {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{pct_name(p)}": 0.0 for p in percentiles}}
    if not xs:
        return out
    s = sorted(xs)
    for p in percentiles:
        out[f"p{pct_name(p)}"] = 1e3 * percentile(s, p)
    out.update(mean=1e3 * statistics.fmean(s), median=1e3 * statistics.median(s), std=1e3 * statistics.pstdev(s))
    return out


# --percentile-metrics' names: (the table's heading, its rows' name), vLLM's; the last two only with --max-concurrency
# (the second also at a finite --request-rate): a request's wait for a slot, and its latency with that wait
PERCENTILE_METRICS = {"ttft": ("Time to First Token", "TTFT"),
                      "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
                      "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL"),
                      "client_queue_time": ("Client-side Queueing", "Client Queue Time"),
                      "e2el_including_client_queue": ("Queue-inclusive End-to-end Latency", "E2EL incl. Client Queue")}


def key_values(items, flag):
    """vLLM's KEY=VALUE list arguments (--header, --metadata) as a dict."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise DatasetError(f"{flag} {item!r}: use KEY=VALUE")
        k, v = item.split("=", 1)
        if not k.strip():  # (an HTTP header with no name: http.client refuses it mid-run)
            raise DatasetError(f"{flag} {item!r}: use KEY=VALUE, KEY not empty")
        out[k.strip()] = v.strip()
    return out


def serve_args(argv):
    """vllm bench serve's command line (the options specdec implements, under vLLM's names and defaults; our older
    names --url, --prompt-len, --gen-len stay as aliases; an underscore in a flag's name works as a dash, as in
    vLLM)."""
    ap = argparse.ArgumentParser(prog="bench.py serve", description="vllm bench serve's metrics against a server")
    ap.add_argument("--backend", choices=["openai", "vllm", "openai-chat"], default="openai",
                    help="openai / vllm: the completions endpoint; openai-chat: --endpoint /v1/chat/completions")
    ap.add_argument("--label", default=None, help="the result file's prefix (default: --backend)")
    ap.add_argument("--base-url", "--url", dest="base_url", default=None,
                    help="server base URL (default: http://--host:--port)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    ap.add_argument("--header", nargs="*", metavar="KEY=VALUE", help="extra HTTP headers of every request")
    ap.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    ap.add_argument("--served-model-name", default=None, help="the model name sent in the requests (default: "
                                                               "--model)")
    ap.add_argument("--tokenizer", default=None, help="accepted; prompts are sent as token ids or text, and the "
                                                      "server's usage counts tokens")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals/s (inf: all at once)")
    ap.add_argument("--burstiness", type=float, default=1.0, help="with a finite --request-rate: gamma-distributed "
                    "gaps of this shape (1: Poisson; below 1 burstier, above more even)")
    ap.add_argument("--ramp-up-strategy", choices=["linear", "exponential"], default=None,
                    help="instead of --request-rate: a rate that grows from --ramp-up-start-rps (the first request's) "
                         "to --ramp-up-end-rps (the last one's), linearly or geometrically in the request's number")
    ap.add_argument("--ramp-up-start-rps", type=int, default=None, help="with --ramp-up-strategy: the first rate")
    ap.add_argument("--ramp-up-end-rps", type=int, default=None, help="with --ramp-up-strategy: the last rate")
    ap.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                    help="service-level objectives (ttft, tpot, e2el in ms): request goodput counts the requests "
                         "within all of them")
    ap.add_argument("--num-warmups", type=int, default=0, help="requests (the first prompt) sent and waited for "
                                                                "before the timed run")
    ap.add_argument("--ready-check-timeout-sec", type=int, default=0,
                    help="wait up to this long for the server's /v1/models to answer (0: do not wait)")
    ap.add_argument("--dataset-name", choices=["random", "custom", "sharegpt", "spec_bench"], default="random",
                    help="random: --random-input-len random token ids (random words to the chat endpoint); custom: "
                         "a JSONL file of {\"prompt\": ...} (an optional \"output_tokens\": that request's "
                         "max_tokens); sharegpt: a ShareGPT JSON file, its first human turns (max_tokens: the "
                         "recorded reply's length, given a local tokenizer); spec_bench: Spec-Bench's question.jsonl. "
                         "custom and spec_bench prompts to /v1/completions get the model's chat template when a "
                         "local tokenizer is found (--tokenizer or --model: a directory), as vLLM's")
    ap.add_argument("--custom-output-len", type=int, default=None, help="custom dataset: max_tokens (vLLM: 256)")
    ap.add_argument("--skip-chat-template", action="store_true", help="custom dataset: send the prompts as they are")
    ap.add_argument("--sharegpt-output-len", type=int, default=None,
                    help="sharegpt: max_tokens of every request (default: the recorded reply's length)")
    ap.add_argument("--spec-bench-output-len", type=int, default=None, help="spec_bench: max_tokens (vLLM: 256)")
    ap.add_argument("--spec-bench-category", default=None, help="spec_bench: only this category's questions")
    ap.add_argument("--dataset-path", default=None, help="the file of --dataset-name custom or sharegpt")
    ap.add_argument("--disable-shuffle", action="store_true", help="the file's order (default: shuffled with --seed)")
    ap.add_argument("--no-oversample", action="store_true",
                    help="with fewer entries than --num-prompts, send each once (default: cycle through them again)")
    ap.add_argument("--random-input-len", dest="input_len", type=int, default=1024, help="random dataset: prompt "
                                                                                         "tokens")
    ap.add_argument("--random-output-len", type=int, default=128, help="random dataset: max_tokens of every request")
    # vLLM's general lengths: given, each sets its datasets' own flags, over them (vllm bench serve's main_async)
    ap.add_argument("--input-len", "--prompt-len", dest="general_input_len", type=int, default=None,
                    help="sets --random-input-len (the one dataset here whose prompt length is chosen)")
    ap.add_argument("--output-len", "--gen-len", dest="output_len", type=int, default=None,
                    help="sets --random-, --sharegpt-, --custom- and --spec-bench-output-len (a custom line's own "
                         "output_tokens still come first)")
    ap.add_argument("--random-range-ratio", type=float, default=0.0,
                    help="random dataset: each prompt's and output's length drawn from [L(1-r), L(1+r)]")
    ap.add_argument("--random-prefix-len", type=int, default=0, help="random dataset: a prefix of this many tokens "
                                                                     "shared by every prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                    help="send ignore_eos (default: on for the random dataset, as vLLM; off for files)")
    for name, kind in (("temperature", float), ("top-p", float), ("top-k", int), ("min-p", float),
                       ("frequency-penalty", float), ("presence-penalty", float), ("repetition-penalty", float)):
        ap.add_argument(f"--{name}", type=kind, default=None, help="sent only if given (else the server default)")
    ap.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    ap.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                    help="comma-separated, of " + ", ".join(PERCENTILE_METRICS) + ": the latencies reported")
    ap.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles of each, e.g. 25,50,99")
    ap.add_argument("--save-result", action="store_true", help="write the result JSON to a file")
    ap.add_argument("--append-result", action="store_true", help="append it as a line to the file")
    ap.add_argument("--save-detailed", action="store_true", help="with per-request lists (lengths, start times "
                                                                 "(perf_counter, as vLLM's), TTFTs, ITLs, the "
                                                                 "generated texts, errors)")
    ap.add_argument("--result-dir", default=None)
    ap.add_argument("--result-filename", default=None,
                    help="default: LABEL-RATEqps[-concurrencyN]-MODEL-YYYYmmdd-HHMMSS.json")
    ap.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="written into the result file")
    ap.add_argument("--disable-tqdm", action="store_true", help="accepted (no progress bar is drawn)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--request-id-prefix", default=f"bench-{uuid.uuid4().hex[:8]}-",
                    help="each request's X-Request-Id is this and its number (default: bench-<random>-)")
    ap.add_argument("--logprobs", type=int, default=None, help="completions: logprobs of each request (vLLM's)")
    return ap.parse_args(sd.vllm_argv(sys.argv[2:] if argv is None else argv))


def serve_benchmark(argv=None):
    """bench.py serve: send a dataset's prompts to an OpenAI-compatible server as vllm bench serve does (streamed,
    at --request-rate, at most --max-concurrency in flight), print vLLM's result table and then one JSON line
    (what --save-result writes). Returns the exit status: 1 when no request succeeded or the input is bad."""
    a = serve_args(argv)
    chat = "chat" in a.endpoint
    rng = random.Random(a.seed)  # the random dataset's prompts, then the Poisson arrivals
    try:  # [(prompt, max_tokens or None)], made or read before the server is asked
        if a.custom_output_len == -1:  # vLLM's -1: each line's own output_tokens (here they always come first)
            a.custom_output_len = None
        for flag, n in (("--output-len", a.output_len), ("--random-output-len", a.random_output_len),
                        ("--custom-output-len", a.custom_output_len), ("--sharegpt-output-len", a.sharegpt_output_len),
                        ("--spec-bench-output-len", a.spec_bench_output_len)):
            if n is not None and n < 1:  # (0 read as "not given" below would silently send the default instead)
                raise DatasetError(f"{flag} must be at least 1, not {n}")
        # vLLM's general lengths win over the datasets' own flags, whichever came first on the command line; so
        # --output-len fixes a ShareGPT request's max_tokens as --sharegpt-output-len does (not its recorded reply's
        # length), while --random-output-len is the random dataset's alone
        if a.general_input_len is not None:
            a.input_len = a.general_input_len
        if a.output_len is not None:
            a.random_output_len = a.sharegpt_output_len = a.custom_output_len = a.spec_bench_output_len = a.output_len
        # max_tokens where a request has none of its own: vLLM's defaults (custom and spec_bench 256); ShareGPT's
        # reply lengths need a tokenizer, and without one 128 is a stand-in (the warning below says so)
        default_len = {"random": a.random_output_len, "custom": a.custom_output_len or 256,
                       "spec_bench": a.spec_bench_output_len or 256, "sharegpt": a.sharegpt_output_len or 128}[
            a.dataset_name]
        if a.backend == "openai-chat" and not chat:
            raise DatasetError(f"--backend openai-chat needs a chat endpoint (--endpoint /v1/chat/completions), "
                               f"not {a.endpoint}")
        metrics = [m.strip() for m in a.percentile_metrics.split(",") if m.strip()]
        if not metrics or any(m not in PERCENTILE_METRICS for m in metrics):
            raise DatasetError(f"--percentile-metrics {a.percentile_metrics!r}: use some of "
                               + ",".join(PERCENTILE_METRICS))
        for m, needs in (("client_queue_time", "--max-concurrency"),
                         ("e2el_including_client_queue", "--max-concurrency and a finite --request-rate")):
            if m in metrics and not (a.max_concurrency and (m == "client_queue_time" or math.isfinite(a.request_rate))):
                print(f"warning: --percentile-metrics {m} needs {needs}; left out, as vLLM does", file=sys.stderr)
        try:
            pcts = [float(p) for p in a.metric_percentiles.split(",")]
        except ValueError:
            pcts = [-1.0]
        if not pcts or any(not 0 <= p <= 100 for p in pcts):
            raise DatasetError(f"--metric-percentiles {a.metric_percentiles!r}: numbers in [0, 100], e.g. 25,50,99")
        extra_headers, metadata = key_values(a.header, "--header"), key_values(a.metadata, "--metadata")
        if not a.burstiness > 0:
            raise DatasetError(f"--burstiness must be > 0, not {a.burstiness}")
        if a.max_concurrency is not None and a.max_concurrency <= 0:  # vLLM's message
            raise DatasetError("--max-concurrency must be greater than 0")
        if a.num_prompts < 1:
            raise DatasetError(f"--num-prompts must be at least 1, not {a.num_prompts}")
        if a.dataset_name == "random" and (a.input_len < 0 or a.random_prefix_len < 0 or
                                           a.input_len + a.random_prefix_len < 1):
            raise DatasetError(f"the random dataset needs prompts of at least one token (--random-input-len "
                               f"{a.input_len} + --random-prefix-len {a.random_prefix_len}, neither negative)")
        if not a.timeout > 0:  # (0 makes every socket non-blocking, and each request fails with an OS error)
            raise DatasetError(f"--timeout must be > 0 seconds, not {a.timeout}")
        base = urlsplit(a.base_url or f"http://{a.host}:{a.port}")
        try:
            base.port  # (raises on a port that is not a number or out of range)
        except ValueError:
            base = None
        if base is None or base.scheme not in ("http", "https") or not base.hostname:
            raise DatasetError(f"--base-url {a.base_url or f'http://{a.host}:{a.port}'!r} (or --host / --port): use "
                               f"http://HOST[:PORT][/PATH]")
        if not a.request_rate > 0:  # (inf, the default: every request at once)
            raise DatasetError(f"--request-rate must be > 0 (requests a second; inf: all at once), "
                               f"not {a.request_rate}")
        ramp = None  # vLLM's rules (main_async), each one line
        if a.ramp_up_strategy is None:  # (vLLM ignores the two without it: here they are a mistake named)
            if a.ramp_up_start_rps is not None or a.ramp_up_end_rps is not None:
                raise DatasetError("--ramp-up-start-rps and --ramp-up-end-rps need --ramp-up-strategy (linear or "
                                   "exponential)")
        else:
            if math.isfinite(a.request_rate):
                raise DatasetError(f"--ramp-up-strategy sets the request rate: leave out --request-rate "
                                   f"{a.request_rate:g}")
            if a.ramp_up_start_rps is None or a.ramp_up_end_rps is None:
                raise DatasetError("--ramp-up-strategy needs both --ramp-up-start-rps and --ramp-up-end-rps")
            # vLLM refuses a negative start, and a start of 0 fails there too, being the first request's rate
            # (exponential's own check, linear's assertion in get_request)
            if a.ramp_up_start_rps < 1:
                raise DatasetError(f"--ramp-up-start-rps must be at least 1 (the first request's rate), not "
                                   f"{a.ramp_up_start_rps}")
            if a.ramp_up_end_rps < a.ramp_up_start_rps:
                raise DatasetError(f"--ramp-up-end-rps {a.ramp_up_end_rps} is below --ramp-up-start-rps "
                                   f"{a.ramp_up_start_rps}: the ramp goes up")
            ramp = (a.ramp_up_strategy, a.ramp_up_start_rps, a.ramp_up_end_rps)
        try:
            extra_body = json.loads(a.extra_body) if a.extra_body else {}
        except ValueError as e:
            raise DatasetError(f"--extra-body is not valid JSON: {e}") from None
        if not isinstance(extra_body, dict):
            raise DatasetError(f"--extra-body must be a JSON object, not {a.extra_body}")
        if a.result_dir and (a.save_result or a.append_result):  # found out now, not after the run
            try:
                os.makedirs(a.result_dir, exist_ok=True)
            except OSError as e:
                raise DatasetError(f"--result-dir {a.result_dir!r}: {e.strerror}") from None
        folder = os.path.dirname(os.path.join(a.result_dir or "", a.result_filename or ""))
        if (a.save_result or a.append_result) and folder and not os.path.isdir(folder):  # (as --result-dir's)
            raise DatasetError(f"--result-filename {a.result_filename!r}: no directory {folder}")
        slo = {}
        for pair in a.goodput or []:
            k, _, v = pair.partition(":")
            try:
                slo[k] = float(v)
            except ValueError:
                slo[k] = -1.0
            if k not in ("ttft", "tpot", "e2el") or not slo[k] >= 0:  # (nan: no request would ever be good)
                raise DatasetError(f"--goodput {pair!r}: use KEY:MS with KEY ttft, tpot or e2el and MS >= 0")
        if a.dataset_name == "random":
            if a.dataset_path:
                raise DatasetError("--dataset-path needs --dataset-name custom, sharegpt or spec_bench")
            prompts = random_prompts(rng, a.num_prompts, a.input_len, chat, a.random_output_len, a.random_range_ratio,
                                     a.random_prefix_len)
        else:
            tok, template = local_tokenizer(a)
            prompts = load_dataset(a.dataset_name, a.dataset_path, a.num_prompts, a.seed,
                                   shuffle=not a.disable_shuffle, oversample=not a.no_oversample, tok=tok,
                                   output_len=a.sharegpt_output_len, category=a.spec_bench_category)
            templated = a.dataset_name == "spec_bench" or (a.dataset_name == "custom" and not a.skip_chat_template)
            if templated and not chat:  # (the chat endpoint's server applies its own)
                if template is None:
                    print("warning: no local tokenizer (--tokenizer or --model: a directory), so the prompts go "
                          "without the model's chat template (vLLM applies it)", file=sys.stderr)
                else:
                    prompts = [(template.render([{"role": "user", "content": p}]), m) for p, m in prompts]
            elif a.dataset_name == "sharegpt" and tok is None and a.sharegpt_output_len is None:
                print(f"warning: no local tokenizer (--tokenizer or --model: a directory): max_tokens "
                      f"{default_len} for every request (--output-len or --sharegpt-output-len to choose it), not its "
                      f"recorded reply's length, and no length filter",
                      file=sys.stderr)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    ignore_eos = a.dataset_name == "random" if a.ignore_eos is None else a.ignore_eos
    num = len(prompts)  # --no-oversample: maybe fewer than --num-prompts
    url = (a.base_url or f"http://{a.host}:{a.port}").rstrip("/")  # (its path, if any, leads every request's)
    headers = {"Content-Type": "application/json", **extra_headers}
    if a.api_key:
        headers["Authorization"] = f"Bearer {a.api_key}"
    deadline = time.perf_counter() + a.ready_check_timeout_sec
    while True:  # the server's first model (without --model), or with --ready-check-timeout-sec its readiness
        try:
            if a.model is None or a.ready_check_timeout_sec > 0:
                listed = first_model(http_get(url, "/v1/models", headers))
            model = a.model or listed
            break
        except (OSError, RuntimeError, ValueError, http.client.HTTPException) as e:  # (the last: not an HTTP server)
            if time.perf_counter() >= deadline:
                print(f"error: {url}/v1/models: {e}" if isinstance(e, ValueError) else
                      f"error: cannot reach {url}/v1/models: {type(e).__name__}: {str(e).strip()}", file=sys.stderr)
                return 1
            time.sleep(1.0)
    if a.temperature is None:
        print("warning: no --temperature: the server's default applies (vLLM's: 1.0, sampled); --temperature 0 "
              "for greedy", file=sys.stderr)
    sampling = {k: v for k, v in (("temperature", a.temperature), ("top_p", a.top_p), ("top_k", a.top_k),
                                  ("min_p", a.min_p), ("frequency_penalty", a.frequency_penalty),
                                  ("presence_penalty", a.presence_penalty),
                                  ("repetition_penalty", a.repetition_penalty)) if v is not None}
    bodies = []
    for prompt, max_tokens in prompts:  # the bodies vllm bench serve sends (openai / openai-chat backends)
        max_tokens = max_tokens or default_len
        name = a.served_model_name or model
        if chat:
            body = {"model": name, "messages": [{"role": "user", "content": prompt}],
                    "max_completion_tokens": max_tokens}
        else:
            body = {"model": name, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": max_tokens,
                    "logprobs": a.logprobs}
        body.update(stream=True, stream_options={"include_usage": True})
        if ignore_eos:
            body["ignore_eos"] = True
        body.update(sampling)
        body.update(extra_body)
        bodies.append(body)

    def run(batch, tag="", offsets=None, t0=None):
        """Send the bodies, request i at t0 + offsets[i] (perf_counter's clock; offsets None: all at once), at most
        --max-concurrency in flight. -> (records, arrivals): a request that waits for a slot has arrived at its
        scheduled time (vLLM's arrivals do not wait for the semaphore), so its wait is its client queue time."""
        results = [None] * len(batch)
        slots = threading.Semaphore(a.max_concurrency or len(batch))

        def worker(i):
            try:
                # each request's id (vLLM: --request-id-prefix and its number, as the x-request-id header)
                own = dict(headers, **{"X-Request-Id": f"{a.request_id_prefix}{tag}{i}"})
                results[i] = send(url, a.endpoint, batch[i], own, a.timeout)
            finally:
                slots.release()
        t0 = time.perf_counter() if t0 is None else t0
        arrivals = [t0 + (offsets[i] if offsets else 0.0) for i in range(len(batch))]
        threads = []
        for i in range(len(batch)):
            time.sleep(max(0.0, arrivals[i] - time.perf_counter()))
            slots.acquire()
            threads.append(threading.Thread(target=worker, args=(i,), daemon=True))
            threads[-1].start()
        for t in threads:
            t.join()
        return results, arrivals

    if a.num_warmups > 0:  # all at once, as vLLM's (neither --request-rate nor the ramp paces them)
        run([bodies[0]] * a.num_warmups, "warmup-")
    offsets, rates = arrival_schedule(num, a.request_rate, a.burstiness, rng, ramp)
    before = scrape_spec(url, headers)
    wall0, t0 = time.time(), time.perf_counter()  # (the ramp's events are stamped on the wall clock, as vLLM's)
    results, arrivals = run(bodies, offsets=offsets, t0=t0)
    duration = time.perf_counter() - t0
    after = scrape_spec(url, headers, settle=5.0)  # once the server's snapshot has the run's last step

    ok = [r for r in results if r["ok"]]
    # input tokens: the server's usage; else a token-id prompt's length; a text prompt's count only the server's
    # tokenizer knows, so then the total is unknown (None) rather than a guess
    ins = [r["prompt_tokens"] if r["prompt_tokens"] is not None else
           len(b["prompt"]) if isinstance(b.get("prompt"), list) else None for r, b in zip(results, bodies)]
    ok_ins = [n for n, r in zip(ins, results) if r["ok"]]
    n_in = None if None in ok_ins else sum(ok_ins)
    n_out = sum(r["output_tokens"] for r in ok)
    peak_tok_s, peak_requests = peaks(results)
    res = {"bench": "serve", "date": time.strftime("%Y%m%d-%H%M%S"), "backend": a.backend,
           "endpoint_type": a.backend, "label": a.label, "endpoint": a.endpoint, "model_id": model, "model": model,
           "tokenizer_id": a.tokenizer or model, **metadata, "dataset_name": a.dataset_name,
           "dataset_path": a.dataset_path, "num_prompts": num,
           "request_rate": a.request_rate if math.isfinite(a.request_rate) else "inf", "burstiness": a.burstiness,
           "max_concurrency": a.max_concurrency, "prompt_len": a.input_len if a.dataset_name == "random" else None,
           "gen_len": default_len, "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
           "total_input_tokens": n_in, "total_output_tokens": n_out, "request_throughput": len(ok) / duration,
           "output_throughput": n_out / duration,
           "total_token_throughput": None if n_in is None else (n_in + n_out) / duration,
           "max_output_tokens_per_s": peak_tok_s, "max_concurrent_requests": peak_requests,
           "request_goodput": None,
           # vLLM keeps these two lists without --save-detailed: each request's end-to-end latency (0 if it failed)
           # and its client queue time (from its arrival to its send, the wait for a --max-concurrency slot)
           "latencies": [r["latency"] for r in results],
           "queue_times": [r["start"] - t for r, t in zip(results, arrivals)],
           "rtfx": 0.0}  # (vLLM's inverse real-time factor: seconds of input audio a second; no audio is sent here)
    if ramp is not None:
        res.update(ramp_up_strategy=a.ramp_up_strategy, ramp_up_start_rps=a.ramp_up_start_rps,
                   ramp_up_end_rps=a.ramp_up_end_rps,
                   rps_change_events=rps_change_events(a.ramp_up_start_rps, rates, offsets, wall0))
    tpot = lambda r: (r["latency"] - r["ttft"]) / (r["output_tokens"] - 1)  # a request of > 1 output token
    if slo:  # vLLM's: a request is good if each objective holds (its TPOT 0 with one output token)
        per = {"ttft": lambda r: r["ttft"], "e2el": lambda r: r["latency"],
               "tpot": lambda r: tpot(r) if r["output_tokens"] > 1 else 0.0}
        good = sum(all(per[k](r) * 1e3 <= v for k, v in slo.items()) for r in ok)
        res["request_goodput"] = good / duration
    series = {"ttft": [r["ttft"] for r in ok], "tpot": [tpot(r) for r in ok if r["output_tokens"] > 1],
              "itl": [x for r in ok for x in r["itl"]], "e2el": [r["latency"] for r in ok]}
    queued = [q for q, r in zip(res["queue_times"], results) if r["ok"]]
    if a.max_concurrency:  # vLLM's two client-queue metrics: only where a slot can be waited for, and the second
        series["client_queue_time"] = queued  # only at a finite rate (at inf every request arrives at once)
        if math.isfinite(a.request_rate):
            series["e2el_including_client_queue"] = [r["latency"] + q for q, r in zip(queued, ok)]
    for name in [m for m in metrics if m in series]:  # (one without its series: skipped, as vLLM's, and warned of)
        for stat, v in summarize(series[name], pcts).items():
            res[f"{stat}_{name}_ms"] = v
    if before is not None and after is not None and after["drafts"] > before["drafts"]:
        d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
        res.update(spec_decode_acceptance_rate=100 * d["accepted"] / d["draft_tokens"] if d["draft_tokens"] else 0.0,
                   spec_decode_acceptance_length=1 + d["accepted"] / d["drafts"],
                   spec_decode_num_drafts=int(d["drafts"]), spec_decode_draft_tokens=int(d["draft_tokens"]),
                   spec_decode_accepted_tokens=int(d["accepted"]),
                   spec_decode_per_position_acceptance_rates=[(after["per_pos"][p] - before["per_pos"].get(p, 0.0))
                                                              / d["drafts"] for p in sorted(after["per_pos"])])
    if a.save_detailed:
        res.update(input_lens=ins, output_lens=[r["output_tokens"] if r["ok"] else 0 for r in results],
                   start_times=[r.get("start", 0.0) for r in results], ttfts=[r["ttft"] for r in results],
                   generated_texts=[r.get("text", "") for r in results],
                   itls=[r["itl"] for r in results], errors=[r["error"] for r in results])
    errors = sorted({r["error"] for r in results if not r["ok"]})

    # vLLM's table, then one JSON line
    line = lambda label, v, f="": print(f"{label:<40} {v:<10{f}}")
    head = lambda s, c="-": print(f"{s:{c}^50}")
    head(" Serving Benchmark Result ", "=")
    line("Successful requests:", len(ok))
    line("Failed requests:", res["failed"])
    if a.max_concurrency:
        line("Maximum request concurrency:", a.max_concurrency)
    if math.isfinite(a.request_rate):
        line("Request rate configured (RPS):", a.request_rate, ".2f")
    line("Benchmark duration (s):", duration, ".2f")
    line("Total input tokens:", "unknown" if n_in is None else n_in)  # a text prompt without usage
    line("Total generated tokens:", n_out)
    line("Request throughput (req/s):", res["request_throughput"], ".2f")
    if slo:
        line("Request goodput (req/s):", res["request_goodput"], ".2f")
    line("Output token throughput (tok/s):", res["output_throughput"], ".2f")
    line("Peak output token throughput (tok/s):", peak_tok_s, ".2f")
    line("Peak concurrent requests:", peak_requests, ".2f")
    if n_in is not None:
        line("Total token throughput (tok/s):", res["total_token_throughput"], ".2f")
    for name in [m for m in metrics if m in series]:
        heading, short = PERCENTILE_METRICS[name]
        head(heading)
        for stat, label in [("mean", "Mean"), ("median", "Median")] + [(f"p{pct_name(p)}", f"P{pct_name(p)}")
                                                                       for p in pcts]:
            line(f"{label} {short} (ms):", res[f"{stat}_{name}_ms"], ".2f")
    if "spec_decode_num_drafts" in res:
        head("Speculative Decoding")
        line("Acceptance rate (%):", res["spec_decode_acceptance_rate"], ".2f")
        line("Acceptance length:", res["spec_decode_acceptance_length"], ".2f")
        line("Drafts:", res["spec_decode_num_drafts"])
        line("Draft tokens:", res["spec_decode_draft_tokens"])
        line("Accepted tokens:", res["spec_decode_accepted_tokens"])
        print("Per-position acceptance (%):")
        for p, r in enumerate(res["spec_decode_per_position_acceptance_rates"]):
            line(f"  Position {p}:", 100 * r, ".2f")
    head("", "=")
    for e in errors[:5]:
        print(f"error: {e}", file=sys.stderr)
    if a.save_result or a.append_result:
        conc = f"-concurrency{a.max_concurrency}" if a.max_concurrency is not None else ""
        rate = (f"ramp-up-{a.ramp_up_strategy}-{a.ramp_up_start_rps}qps-{a.ramp_up_end_rps}qps" if ramp else
                f"{res['request_rate']}qps")  # (vLLM's names: the ramp's in place of the rate)
        path = a.result_filename or f"{a.label or a.backend}-{rate}{conc}-{model.split('/')[-1]}-{res['date']}.json"
        if a.result_dir:  # (made before the run)
            path = os.path.join(a.result_dir, path)
        try:
            with open(path, "a" if a.append_result else "w", encoding="utf-8") as f:
                if a.append_result and f.tell():
                    f.write("\n")
                json.dump(res, f)
        except OSError as e:  # (the results still go to stdout below)
            print(f"error: cannot write the result to {path}: {e.strerror}", file=sys.stderr)
            ok = False
    print(json.dumps(res), flush=True)
    return 0 if ok else 1  # an exit status; the results are the JSON line


def at_least(ap, checks):
    """argparse's error for the first (flag, value, least) whose value is below least."""
    for flag, v, least in checks:
        if v < least:
            ap.error(f"{flag} must be at least {least}, not {v}")


def engine_benchmark(kind, argv):
    """bench.py latency / throughput: vllm bench latency / throughput on the offline engine (LLM.generate), with
    their flags, defaults, printed lines and --output-json. latency: one batch of --batch-size random prompts of
    --input-len token ids, --output-len tokens each (ignore_eos, temperature 1), timed --num-iters times after
    --num-iters-warmup; throughput: --num-prompts such requests at once, their tokens over the time they took.
    Engine flags as specdec.py's (--model, --speculative-config, --device, ...). Returns the exit status."""
    ap = argparse.ArgumentParser(prog=f"bench.py {kind}", description=f"vllm bench {kind} on specdec's engine")
    sd.add_engine_args(ap)
    if kind == "latency":
        ap.add_argument("--input-len", type=int, default=32)
        ap.add_argument("--output-len", type=int, default=128)
        ap.add_argument("--batch-size", type=int, default=8)
        ap.add_argument("--num-iters-warmup", type=int, default=10)
        ap.add_argument("--num-iters", type=int, default=30)
    else:
        ap.add_argument("--dataset-name", choices=["random"], default="random", help="random token ids (vLLM's)")
        ap.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=1024)
        ap.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128)
        ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--n", type=int, default=1, help="sequences per prompt")
    ap.add_argument("--output-json", default=None, help="write the results here as JSON")
    ap.add_argument("--disable-detokenize", action="store_true", help="accepted (the text costs little here)")
    a = ap.parse_args(sd.vllm_argv(argv))
    counts = [("--batch-size", a.batch_size, 1), ("--num-iters", a.num_iters, 1),
              ("--num-iters-warmup", a.num_iters_warmup, 0)] if kind == "latency" else [("--num-prompts", a.num_prompts, 1)]
    at_least(ap, [("--input-len", a.input_len, 1), ("--output-len", a.output_len, 1), ("--n", a.n, 1)] + counts)
    if a.output_json and not os.path.isdir(os.path.dirname(a.output_json) or "."):  # found out now, not after the run
        ap.error(f"--output-json {a.output_json!r}: no directory {os.path.dirname(a.output_json)}")
    try:
        llm = sd.llm_from_args(a)
        rng = random.Random(a.seed)
        vocab = min(10000, llm.cfg.vocab_size)  # vLLM draws ids below 10000
        n = a.batch_size if kind == "latency" else a.num_prompts
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(a.input_len)]} for _ in range(n)]
        sp = sd.SamplingParams(n=a.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=a.output_len)

        def run():  # -> (seconds, output tokens)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            return time.perf_counter() - t0, sum(len(c.token_ids) for o in outs for c in o.outputs)
        if kind == "latency":
            for _ in range(a.num_iters_warmup):
                run()
            lat = [run()[0] for _ in range(a.num_iters)]
            pct = {p: percentile(sorted(lat), p) for p in (10, 25, 50, 75, 90, 99)}
            print(f"Avg latency: {statistics.mean(lat)} seconds")
            for p, v in pct.items():
                print(f"{p}% percentile latency: {v} seconds")
            res = {"avg_latency": statistics.mean(lat), "latencies": lat, "percentiles": pct}
        else:
            run_s, n_out = run()
            n_in = a.input_len * n
            print(f"Throughput: {n / run_s:.2f} requests/s, {(n_in + n_out) / run_s:.2f} total tokens/s, "
                  f"{n_out / run_s:.2f} output tokens/s")
            print(f"Total num prompt tokens:  {n_in}")
            print(f"Total num output tokens:  {n_out}")
            res = {"elapsed_time": run_s, "num_requests": n, "total_num_tokens": n_in + n_out,
                   "requests_per_second": n / run_s, "tokens_per_second": (n_in + n_out) / run_s}
    except sd.ConfigError as e:  # what the engine refuses (a model path, a config, a length): one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.output_json:
        try:
            with open(a.output_json, "w", encoding="utf-8") as f:
                json.dump(res, f, indent=4)
        except OSError as e:
            print(f"error: cannot write {a.output_json}: {e.strerror}", file=sys.stderr)
            return 1
    return 0


def step_ids(model, B, T, seed=0):
    """Random token ids [B, T] for a measured step. Not all equal: a MoE routes each token by its hidden state,
    and B x T copies of one token choose the same top-k experts, so such a step reads 8 experts a layer where
    real text's B x T tokens read many more (35B-A3B: ~15 at T = 2, ~78 at T = 16)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (B, T), generator=g)


def target_graph(runner, B, T, pos, seed=0):
    """The captured graph record of the target step over B rows of T random tokens (step_ids) at position pos
    (rows in slots 0..B-1): replaying .graph (and .then after a verify, the commit) re-runs it."""
    mode = "verify" if T > 1 else "decode"
    fn, then = runner.steps[mode]
    dev = runner.device
    inputs = dict(ids=step_ids(runner.model, B, T, seed).to(dev),
                  pos=torch.full((B,), pos, dtype=torch.long, device=dev), slots=torch.arange(B, device=dev))
    return runner.graphs.run(mode, fn, inputs, then)


def step_ms(g, iters=20):
    """Median ms of one target step's replay: a target_graph record's graph and, after a verify, its commit's."""
    return replay_ms(lambda: (g.graph.replay(), g.then.replay() if g.then is not None else None), iters)


def step_experts(runner, B, T, pos, seed=0):
    """Distinct routed experts per MoE layer of the step target_graph(runner, B, T, pos, seed) runs (expert_counts
    over an eager forward of the same ids); None for a dense model."""
    model, dev = runner.model, runner.device
    ctx = sd.Ctx(runner.state, torch.arange(B, device=dev), torch.full((B,), pos, device=dev), pos + T,
                 "verify" if T > 1 else "decode")

    def run():
        with torch.inference_mode():
            model(step_ids(model, B, T, seed).to(dev), ctx)
    counts = expert_counts(model, run) if any(isinstance(layer.mlp, sd.MoE) for layer in model.layers) else []
    return sum(counts) / len(counts) if counts else None


def verify_costs(model, Ts, device, dtype):
    """ms per target step over T random tokens at batch 1 (captured graph, mode verify for T > 1, decode for
    T = 1), and for a MoE the distinct experts per layer that step reads: {T: (ms, experts or None)}."""
    runner = sd.ModelRunner(model, None, 1, 1024, dtype, device)
    out = {}
    for T in Ts:
        g = target_graph(runner, 1, T, 0)
        ms = step_ms(g)
        out[T] = (ms, step_experts(runner, 1, T, 0))
    del runner
    return out


def ngram_cost(hist_len, device, B=8, k=4):
    """ms of device time of one ngram propose over B slots with hist_len-token histories (the lookup of the
    default window, 2..5 tokens, on a random text of 64 token ids), captured in a CUDA graph as the engine runs
    it."""
    spec = sd.SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                                           "prompt_lookup_max": 5})
    io = sd.ProposerIO(None, None, B, hist_len + 1, torch.bfloat16, device, h2d=None, call=None)
    ngram = sd.NgramProposer(spec, io)
    ngram.hist[:, :hist_len] = torch.randint(0, 64, (B + 1, hist_len), device=device)
    slots, pos = torch.arange(B, device=device), torch.full((B,), hist_len - 1, device=device)
    return graph_ms(lambda: ngram._propose(0, slots, pos))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        return serve_benchmark(argv[1:])
    if argv and argv[0] in ("latency", "throughput"):
        return engine_benchmark(argv[0], argv[1:])
    ap = argparse.ArgumentParser(description="specdec offline benchmark")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory or .gguf")
    src.add_argument("--random-weights", choices=list(PRESETS), help="real-shape model with random weights")
    ap.add_argument("--speculative-config", action="append", default=None,
                    help="JSON; repeat it to compare several in one run; 'off' = no speculation (default: off)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[512], help="one or more (rows for each)")
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=None, help="the engine's max_model_len (its caches' "
                    "length, as a user's engine gets by default: the model's limit or what fits); default: just "
                    "what the rows need (prompt + gen + 8 + 2k)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("-q", "--quantization", default=None, help="fp8: block-FP8 weights, quantized at load (as "
                    "specdec's --quantization fp8; with --random-weights, after they are made)")
    ap.add_argument("--no-draft-head", action="store_true", help="FP8 models: MTP / DFlash / DSpark draft through "
                    "the bf16 lm_head, without the FP8 copy LLM makes (specdec.fp8_head): the A/B of that copy")
    ap.add_argument("--device", default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="asynchronous steps (default: on with CUDA graphs)")
    ap.add_argument("--no-floor", action="store_true", help="skip the GEMM-only floor")
    ap.add_argument("--no-draft-time", action="store_true", help="skip the drafter's time per step (its own "
                    "run of B prompts twice: at long prompts most of a row's time is their prefills)")
    ap.add_argument("--true-floor", action="store_true", help="MoE models: also the bytes a step reads (the "
                    "distinct experts of its actual routing, routed_experts) at the same run's copy rate; per token "
                    "for speculative rows (the target's step only, over the mean acceptance length)")
    ap.add_argument("--no-triton", action="store_true", help="PyTorch references instead of the Triton kernels "
                    "(implies --enforce-eager)")
    ap.add_argument("--random-drafter", default=None, help="with --random-weights: write a random DFlash/DSpark "
                    "drafter of the target's shape (5 layers, block 16; speculators: its own) to this directory first; use it as the "
                    "speculative config's model (its method picks the layout: the first dflash/dspark config)")
    ap.add_argument("--drafter-layout", default="ours", choices=["ours", "zlab", "speculators"],
                    help="with --random-drafter: zlab = DFlash drafters with 4 sliding-window (2048) layers and 1 "
                    "full one, as z-lab's published Qwen3.6-27B-DFlash (ours: 5 full layers); speculators = DSpark "
                    "drafters in the vllm-project/speculators format (dspark configs only; needs "
                    "num_speculative_tokens >= its block, 8). For 35b-a3b shaped like "
                    "RedHatAI/Qwen3.6-35B-A3B-speculator.dspark: its taps from its training command "
                    "(aux_hidden_state_layer_ids 2 10 20 30 37, vLLM's ids: specdec reads 1 9 19 29 36); assumed "
                    "(its config.json is not available): 5 layers, block 8, 16 / 2 heads of 256 (the verifier's), "
                    "intermediate 6144 (3 x hidden), a reduced draft vocabulary of 24576 with d2t; speculators' "
                    "defaults: Markov rank 256 (vanilla), a confidence head (loaded, unused). For 27b the same "
                    "rules (taps [2, 17, 32, 47, 62], 24 / 4 heads, intermediate 17408): not a published layout")
    ap.add_argument("--drafter-shape", nargs="+", default=[], metavar="KEY=VALUE",
                    help="with --drafter-layout speculators: override the assumed shape, keys "
                    + " ".join(SHAPE_KEYS) + " (aux_ids comma-separated, vLLM's ids), e.g. intermediate=4608")
    ap.add_argument("--random-draft-lm", default=None, help="with --random-weights: write a random Qwen3-0.6B-shaped "
                    "draft LM with the target's vocabulary to this directory; draft_model configs without a model use it")
    ap.add_argument("--write-config", nargs=2, metavar=("PRESET", "DIR"), default=None,
                    help="write a preset's config.json and the shipped toy's tokenizer to DIR and stop: a model "
                    "directory for `server.py --model DIR --load-format dummy` (the real shapes, random weights)")
    ap.add_argument("--hf-baseline", action="store_true", help="also time Hugging Face transformers' generate on the "
                    "same shapes (random weights, batch 1, first prompt length), after our rows")
    ap.add_argument("--verify-cost", type=int, nargs="*", default=None,
                    help="also time one target step over each of these token counts (batch 1), vs T = 1")
    ap.add_argument("--cyclic", action="store_true", help="with --random-weights: make the model continue the "
                    "cyclic text of its prompts (make_cyclic), so that ngram finds drafts as on real text")
    ap.add_argument("--ngram-cost", type=int, default=None, metavar="HIST_LEN",
                    help="also time one ngram lookup at batch 8 over HIST_LEN-token histories (device time)")
    ap.add_argument("--stall", type=int, default=None, metavar="LONG_LEN",
                    help="instead of the rows: --batch streams decode while a LONG_LEN-token prompt arrives; "
                    "their inter-token latency before and during its prefill, its TTFT (one row per budget)")
    ap.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[2048],
                    help="with --stall: the step budgets to compare (chunked prefill); 0 = chunked prefill off")
    a = ap.parse_args(argv)
    # (--gen-len: two tokens at least, or there is no time per output token after the first)
    at_least(ap, [("--batch", min(a.batch), 1), ("--prompt-len", min(a.prompt_len), 1), ("--gen-len", a.gen_len, 2)]
             # (given flags only: a 0 here was read as "not given", and a negative one failed inside the engine)
             + [(flag, v, 1) for flag, v in (("--max-model-len", a.max_model_len), ("--stall", a.stall),
                                             ("--ngram-cost", a.ngram_cost),
                                             ("--verify-cost", min(a.verify_cost or [1]))) if v is not None])
    for flag, v in (("--random-drafter", a.random_drafter), ("--random-draft-lm", a.random_draft_lm)):
        if v and not a.random_weights:  # (shaped for the target preset: there is none without it)
            ap.error(f"{flag} needs --random-weights (the preset the drafter is shaped for)")
    try:
        return offline(ap, a)
    except sd.ConfigError as e:  # what the engine refuses (a model path, a config, a length): one line
        print(f"error: {e}", file=sys.stderr)
        return 2


def offline(ap, a):
    """The offline benchmark of main's arguments: its table, then one JSON line."""
    device, dtype = sd.resolve_device_dtype(a.device, a.dtype)
    if a.write_config:
        preset, out = a.write_config
        if preset not in PRESETS:
            ap.error(f"--write-config: unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        write_config(preset, out)
        return 0
    sd.K.USE_TRITON = not a.no_triton
    a.enforce_eager |= a.no_triton  # the references read positions on the host: not capturable
    raw = []
    for c in a.speculative_config or ["off"]:
        try:
            raw.append(None if c == "off" else json.loads(c))
        except ValueError as e:
            ap.error(f"--speculative-config {c!r} is not valid JSON: {e}")
    try:
        shape = {k: [int(i) for i in v.split(",")] if k == "aux_ids" else int(v)
                 for k, v in (kv.split("=", 1) for kv in a.drafter_shape)}
    except ValueError:
        ap.error(f"--drafter-shape wants KEY=INTEGER (aux_ids=A,B,...), got {' '.join(a.drafter_shape)}")
    if a.random_drafter:
        for c in raw:
            if c and c.get("method") in ("dflash", "dspark"):
                sliding = 4 if a.drafter_layout == "zlab" and c["method"] == "dflash" else 0
                c["model"] = random_drafter(os.path.join(a.random_drafter, c["method"] + a.drafter_layout),
                                            c["method"], a.random_weights, sliding=sliding, layout=a.drafter_layout,
                                            shape=shape)
        if a.drafter_layout == "speculators":  # say what the drafter stands for
            t = SPECULATORS_DSPARK[a.random_weights]
            print(f"# speculators DSpark drafter for {a.random_weights}: "
                  + (f"shaped like {t['published']}" if t["published"] else "NOT a published layout (the same "
                     "rules as for 35b-a3b)") + (f"; overridden: {shape}" if shape else ""))
    if a.random_draft_lm:
        for c in raw:
            if c and c.get("method") == "draft_model" and "model" not in c:
                c["model"] = random_draft_lm(a.random_draft_lm, a.random_weights)
    specs = [None if c is None else sd.SpeculativeConfig.from_json(c) for c in raw]
    # the FP8 lm_head copy, where LLM would make it for one of the configs run (specdec.drafts_through_target_head)
    head = not a.no_draft_head and any(sd.drafts_through_target_head(s) for s in specs)
    if a.random_weights or not a.model:
        model, cfg = random_model(a.random_weights or "tiny", dtype, device, quantization=a.quantization,
                                  draft_head=head)
        if a.cyclic:
            make_cyclic(model)
        label = a.random_weights or "tiny"
    else:
        want_mtp = any(s is not None and s.method == "mtp" for s in specs)
        model, cfg, _ = sd.load_model(a.model, dtype, device, want_mtp=want_mtp, quantization=a.quantization)
        sd.add_draft_head(model, a.quantization, head)
        label = a.model
    if a.stall:
        print(f"# stall {label} dtype={dtype}: {a.batch[0]} streams (prompt {a.prompt_len[0]}) decoding while a "
              f"{a.stall}-token prompt arrives")
        out = []
        for budget in a.max_num_batched_tokens:
            r = run_stall(model, specs[0], a.batch[0], a.prompt_len[0], a.stall, a.gen_len, device, dtype,
                          budget or 2048, budget != 0)
            out.append(r)
            print(f"chunked prefill {'off' if not budget else f'on, budget {budget}'}: TTFT of the long prompt "
                  f"{r['ttft_long_ms']:.0f} ms; streams' TPOT before {r['tpot_before_ms']:.2f} ms, during "
                  f"{r['tpot_during_ms']:.2f} ms ({r['tpot_during_ms'] / r['tpot_before_ms']:.2f}x), p99 ITL "
                  f"during {r['p99_itl_during_ms']:.1f} ms, max {r['max_itl_during_ms']:.1f} ms")
        print(json.dumps({"model": label, "stall": out}))
        return 0
    ws = linear_weights(model, cfg.num_experts_per_tok)
    wbytes = sum(w.numel() * w.element_size() for w in ws)
    floors = {}
    floor = lambda M: floors.setdefault(M, gemm_floor(ws, M))
    gbps = None  # the copy rate, measured once (--true-floor; 100 GB/s stands in off CUDA)
    rows = []
    for P in a.prompt_len:
        for spec in specs:
            k = spec.num_speculative_tokens if spec else 0
            for B in a.batch:
                r = run_batch(model, spec, B, P, a.gen_len, device, dtype, a.enforce_eager,
                              async_steps=a.async_scheduling, max_model_len=a.max_model_len,
                              draft_time=not a.no_draft_time)
                gc.collect()  # the engine's caches (it holds reference cycles) before the next row's
                torch.cuda.empty_cache() if device.type == "cuda" else None
                r.update(batch=B, prompt_len=P, method=spec.method if spec else "off", k=k,
                         spec=dataclasses.asdict(spec) if spec else None)
                if device.type == "cuda" and not a.no_floor:
                    r["floor_ms"] = floor(B)
                    r["tpot_over_floor"] = r["tpot_ms"] / r["floor_ms"]
                if a.true_floor and cfg.moe:
                    gbps = gbps or (copy_gbps(device) if device.type == "cuda" else 100.0)
                    r["experts_per_layer"] = routed_experts(model, spec, B, P, device, dtype)
                    r["true_floor_ms"] = (true_floor_ms(model, r["experts_per_layer"], gbps)
                                          / (r["mean_acceptance_length"] or 1))
                    r["tpot_over_true_floor"] = r["tpot_ms"] / r["true_floor_ms"]
                    r["copy_GBps"] = gbps
                    print(f"# {r['method']} batch {B}: {r['experts_per_layer']:.1f} distinct experts per MoE layer "
                          f"per step; true floor {r['true_floor_ms']:.2f} ms per token at {gbps:.0f} GB/s; TPOT / "
                          f"true floor {r['tpot_over_true_floor']:.2f}")
                off = next((x for x in rows if x["method"] == "off" and x["batch"] == B and x["prompt_len"] == P), None)
                r["speedup_vs_off"] = off["tpot_ms"] / r["tpot_ms"] if off else None
                r["weight_GBps"] = wbytes / (r["tpot_ms"] * 1e-3) / 1e9
                rows.append(r)
                extra = "".join(f", {name} {r[key]:.2f}" for name, key in (
                    ("x off", "speedup_vs_off"), ("accept len", "mean_acceptance_length"),
                    ("draft ms", "draft_ms_per_step")) if r.get(key) is not None)
                print(f"# measured: {r['method']} k={k} batch {B} prompt {P}: TTFT {r['ttft_ms']:.1f} ms, TPOT "
                      f"{r['tpot_ms']:.2f} ms{extra}", flush=True)
                if r["late_graph_captures"] or r["max_step_ms"] > 5 * r["median_step_ms"] + 1:
                    print(f"# stall in that run: longest step {r['max_step_ms']:.1f} ms (median "
                          f"{r['median_step_ms']:.2f}); graphs captured during it {r['late_graph_captures']}; "
                          f"{r['gc_passes']} garbage-collector passes, {r['gc_ms']:.1f} ms", flush=True)
    costs = verify_costs(model, sorted(set([1] + a.verify_cost)), device, dtype) \
        if a.verify_cost and device.type == "cuda" else None
    if a.ngram_cost and device.type == "cuda":
        ms = ngram_cost(a.ngram_cost, device)
        print(f"# ngram lookup, batch 8, {a.ngram_cost}-token histories: {1e3 * ms:.1f} us of device time per step")
    hf = None
    if a.hf_baseline:
        del model, ws
        torch.cuda.empty_cache() if device.type == "cuda" else None
        hf = hf_generate_tpot(a.random_weights or "tiny", a.prompt_len[0], min(a.gen_len, 16), device)
        hf.update(prompt_len=a.prompt_len[0], gen_len=min(a.gen_len, 16))
        off = next((x for x in rows if x["method"] == "off" and x["batch"] == 1 and x["prompt_len"] == a.prompt_len[0]), None)
        hf["our_speedup"] = hf["tpot_ms"] / off["tpot_ms"] if off else None
    print(f"# bench {label} dtype={dtype} quantization={a.quantization} prompt={a.prompt_len} gen={a.gen_len} "
          f"weights read/step={wbytes / 1e9:.2f} GB")
    hdr = ["method", "k", "batch", "prompt", "TTFT ms", "TPOT ms", "tok/s/seq", "tok/s agg", "GB/s wts", "floor ms",
           "TPOT/floor", "x off", "accept len", "draft ms"]
    print(" | ".join(f"{h:>10}" for h in hdr))
    nan = float("nan")
    for r in rows:
        vals = [r["method"], r["k"], r["batch"], r["prompt_len"], r["ttft_ms"], r["tpot_ms"], r["tok_s_per_seq"],
                r["decode_tok_s_aggregate"], r["weight_GBps"], r.get("floor_ms", nan), r.get("tpot_over_floor", nan),
                r["speedup_vs_off"] or nan, r["mean_acceptance_length"] or nan, r["draft_ms_per_step"] or nan]
        print(" | ".join(f"{v:>10.2f}" if isinstance(v, float) else f"{v:>10}" for v in vals))
    result = {"model": label, "dtype": str(dtype), "quantization": a.quantization, "prompt_len": a.prompt_len,
              "gen_len": a.gen_len, "weight_bytes": wbytes, "rows": rows}
    if a.random_drafter:
        result["drafter_layout"] = a.drafter_layout
    if costs is not None:
        print("# target step cost at batch 1 (random tokens): " + ", ".join(
            f"T={T}: {ms:.2f} ms ({ms / costs[1][0]:.3f}x" + (f", {e:.1f} experts a layer)" if e else ")")
            for T, (ms, e) in costs.items()))
        result["verify_cost_ms"] = {T: ms for T, (ms, e) in costs.items()}
        if costs[1][1] is not None:
            result["verify_cost_experts"] = {T: e for T, (ms, e) in costs.items()}
    if hf is not None:
        print(f"# transformers {hf['transformers']} generate (greedy, batch 1, prompt {hf['prompt_len']}, same shapes, "
              f"random weights): TTFT {hf['ttft_ms']:.1f} ms, TPOT {hf['tpot_ms']:.1f} ms; ours "
              + (f"{hf['our_speedup']:.1f}x faster" if hf["our_speedup"] else "(no off row at batch 1)"))
        result["transformers"] = hf
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
