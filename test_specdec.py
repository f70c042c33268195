"""test_specdec.py - the tests, in three tiers: logic (configs, sampler, loaders), kernels (reference vs
fast), end to end (our logits vs transformers, lossless speculation, CLI). CPU, fp32, tiny checkpoints
written here in the real published layouts. Run: python -m pytest -q test_specdec.py

Also a tool: `python test_specdec.py make-tiny DIR [--moe]` writes a tiny random checkpoint.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import kernels as K
import specdec as sd
from specdec import LLM, SamplingParams, ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))

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


def write_tiny_checkpoint(path, moe=False, tie=False, mtp=True, wrapper=True, shards=1, per_expert=False, seed=0,
                          tokenizer=True, extra=None, drop=None):
    """Write config.json, generation_config.json, tokenizer files and safetensors in the published layout:
    `wrapper` = multimodal Qwen3_5ForConditionalGeneration names (model.language_model.*, a vision tower
    that must be skipped) else text-only Qwen3_5ForCausalLM names (model.*)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    tok_vocab = 0
    if tokenizer:
        sys.path.insert(0, os.path.join(HERE, "tools"))
        from make_tokenizer import make_tiny_tokenizer
        make_tiny_tokenizer(path)
        with open(os.path.join(path, "tokenizer.json")) as fh:
            tj = json.load(fh)
        tok_vocab = len(tj["model"]["vocab"]) + len(tj["added_tokens"])
    text = tiny_text_config(moe, tie, mtp, vocab=max(1024, (tok_vocab + 63) // 64 * 64))
    if tokenizer:
        ids = {t["content"]: t["id"] for t in tj["added_tokens"]}
        text["eos_token_id"] = ids["<|endoftext|>"]
    w = random_weights(text, seed, mtp, per_expert)
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
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(top, fh, indent=1)
    if tokenizer:
        with open(os.path.join(path, "generation_config.json"), "w") as fh:
            json.dump({"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "do_sample": True}, fh)
    names = sorted(w)
    if shards == 1:
        save_file({k: w[k].contiguous() for k in names}, os.path.join(path, "model.safetensors"))
    else:
        index = {}
        for s in range(shards):
            part = names[s::shards]
            f = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: w[k].contiguous() for k in part}, os.path.join(path, f))
            index.update({k: f for k in part})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {}, "weight_map": index}, fh)
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
    eng = llm.engine
    st = eng.state
    st.reset(0)
    slots = torch.tensor([0])
    x = torch.tensor([ids])
    with torch.inference_mode():
        if mode == "prefill":
            return llm.model.logits(llm.model(x, sd.Ctx(st, slots, torch.tensor([0]), len(ids), "prefill")))[0]
        out = [llm.model.logits(llm.model(x[:, t:t + 1], sd.Ctx(st, slots, torch.tensor([t]), t + 1, "decode")))[0, 0]
               for t in range(len(ids))]
        return torch.stack(out)


@pytest.mark.parametrize("kind", ["dense", "moe", "dense-tied-text-sharded", "moe-per-expert-text"])
def test_logits_match_transformers(kind, tmp_path):
    moe = kind.startswith("moe")
    path = write_tiny_checkpoint(str(tmp_path / kind), moe=moe, tie="tied" in kind, wrapper="text" not in kind,
                                 shards=2 if "sharded" in kind else 1, per_expert="per-expert" in kind, seed=3)
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
