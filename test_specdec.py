"""test_specdec.py - the tests, in three tiers: logic (configs, sampler, loaders), kernels (reference vs
fast), end to end (our logits vs transformers, lossless speculation, CLI). CPU, fp32, tiny checkpoints
written here in the real published layouts. Run: python -m pytest -q test_specdec.py

Also a tool: `python test_specdec.py make-tiny DIR [--moe]` writes a tiny random checkpoint.
"""
import http.client
import json
import math
import os
import re
import socket
import subprocess
import sys
import sysconfig
import threading
import types
import time
import unicodedata
import urllib.request

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

import kernels as K
import specdec as sd
from specdec import LLM, SamplingParams, ConfigError

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


def test_ngram_lookup_matches_reference_and_vllm_example():
    assert sd.ngram_lookup([1, 2, 3, 4, 2, 3], 4, 2, 3) == [4, 2, 3]  # vLLM's docstring example
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        ctx = torch.randint(0, 4, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        lo = int(torch.randint(1, 4, (1,), generator=g))
        hi = lo + int(torch.randint(0, 3, (1,), generator=g))
        assert sd.ngram_lookup(ctx, 5, lo, hi) == sd.ngram_lookup_ref(ctx, 5, lo, hi), (ctx, lo, hi)


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


# ==============================================================================================
# Speculative decoding: lossless, rollback, rejection sampler, configs
# ==============================================================================================

SPEC_PROMPTS = ["def fib(n):\n    return fib(n-1) + fib(n-2)\n\ndef fib(", "hello", "a b c a b c a b",
                "import os\nimport sys\nimport os\n", "x = 1\ny = 2\nx = 1\ny = 2\nx ="]
SPEC_CONFIGS = [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}] + \
               [{"method": "mtp", "num_speculative_tokens": k} for k in (1, 2, 4)]


@pytest.fixture(scope="session")
def spec_off(tiny):
    llm = LLM(model=tiny, device="cpu")
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    return sp, llm.generate(SPEC_PROMPTS, sp), llm.generate(SPEC_PROMPTS[:1], sp)


@pytest.mark.parametrize("cfg", SPEC_CONFIGS, ids=lambda c: f"{c['method']}{c['num_speculative_tokens']}")
def test_greedy_spec_equals_plain(cfg, tiny, spec_off):
    sp, ref, ref1 = spec_off
    llm = LLM(model=tiny, device="cpu", speculative_config=cfg)
    one = llm.generate(SPEC_PROMPTS[:1], sp)[0].outputs[0]
    assert one.token_ids == ref1[0].outputs[0].token_ids
    outs = llm.generate(SPEC_PROMPTS, sp)  # a batch of 5 prompts of different lengths
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b, t in zip(o.outputs[0].logprobs, r.outputs[0].logprobs, r.outputs[0].token_ids):
            assert abs(a[t] - b[t]) <= 1e-5  # measured worst 5.5e-6 (kernels.exact, kernels.linear)
            assert set(a) == set(b)
    if cfg["method"] == "mtp" or cfg.get("prompt_lookup_min") == 1:  # these always find a draft
        assert llm.get_metrics().num_drafts > 0


class OracleProposer:
    """Proposes the true greedy continuation with planted mistakes: exercises full acceptance (bonus
    tokens), partial acceptance and rejection at position 0, whatever the draft model's quality."""
    def __init__(self, k, truth):
        self.k, self.truth, self.step = k, truth, 0

    def prefill(self, *a):
        pass

    def commit(self, *a):
        pass

    def propose(self, engine, reqs):
        d = torch.full((len(reqs), self.k), -1)
        for b, r in enumerate(reqs):
            n = len(r.output_ids)
            seq = self.truth[r.prompt_ids[0]][n:n + self.k]
            d[b, :len(seq)] = torch.tensor(seq)
            wrong = (self.step + b) % (self.k + 2)  # position of a planted wrong token (none if >= k)
            if wrong < len(seq):
                d[b, wrong] = (d[b, wrong] + 1) % engine.model.cfg.vocab_size
        self.step += 1
        return d, None


def test_verify_commit_with_oracle_drafts(tiny, spec_off):
    sp, ref, _ = spec_off
    llm = LLM(model=tiny, device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    prompts = [llm.tokenizer.encode(p) for p in SPEC_PROMPTS]
    truth = {p[0]: r.outputs[0].token_ids for p, r in zip(prompts, ref)}
    assert len(truth) == len(prompts)
    llm.engine.proposer = OracleProposer(4, truth)
    outs = llm.generate(prompts, sp)
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    s = llm.get_metrics()
    assert s.accepted_per_pos[3] > 0 and s.num_accepted_tokens < s.num_draft_tokens  # full and partial acceptance


def test_rollback_equals_token_by_token(tiny):
    """GDN conv/recurrent states after a verify with partial acceptance == decoding the accepted tokens one by one."""
    llm = LLM(model=tiny, device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    m, st = llm.model, llm.engine.state
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


@pytest.mark.parametrize("full_q", [False, True])
def test_rejection_sampler_preserves_distribution(full_q):
    """Emitted first token ~ p for random p, q: chi-square over 200k trials (fixed seed)."""
    g = torch.Generator().manual_seed(0)
    V, N = 6, 200_000
    p_logits = torch.randn(V, generator=g) * 1.5
    p = p_logits.softmax(-1)
    q = (torch.randn(V, generator=g) * 1.5).softmax(-1)
    if full_q:
        drafts = torch.multinomial(q, N, replacement=True, generator=g)[:, None]
        draft_probs = q.expand(N, 1, V)
    else:
        drafts = torch.full((N, 1), 2)            # a deterministic draft: one-hot q
        draft_probs = None
    logits = p_logits.expand(N, 2, V).clone()
    tok, n = sd.rejection_sample(logits, drafts, draft_probs, torch.ones(N), torch.full((N,), -1), torch.ones(N),
                                 torch.rand(N, 1, generator=g), torch.rand(N, 2, generator=g))
    counts = torch.bincount(tok[:, 0], minlength=V).double()
    chi2 = float(((counts - N * p.double()) ** 2 / (N * p.double())).sum())
    assert chi2 < 20.5, chi2  # 99.9% quantile of chi-square with 5 dof
    assert 0 < float(n.float().mean()) < 1


def test_sampled_distribution_same_with_speculation(tiny):
    """temperature 1, top-p 0.9: each of the first 3 generated tokens follows the same law with and without
    speculation (two-sample chi-square over 600 seeds each; the first token comes from the prefill in both)."""
    import collections
    prompt = "a b c a b c a b"
    outs = []
    for cfg in (None, {"method": "mtp", "num_speculative_tokens": 2}):
        llm = LLM(model=tiny, device="cpu", speculative_config=cfg, max_num_seqs=8)
        ps = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, seed=s, ignore_eos=True) for s in range(600)]
        outs.append([o.outputs[0].token_ids for o in llm.generate([prompt] * len(ps), ps)])
    for pos in range(3):
        counts = [collections.Counter(t[pos] for t in o) for o in outs]
        keys = [k for k in set(counts[0]) | set(counts[1]) if counts[0][k] + counts[1][k] >= 10]
        a = torch.tensor([counts[0][k] for k in keys], dtype=torch.float64)
        b = torch.tensor([counts[1][k] for k in keys], dtype=torch.float64)
        a, b = torch.cat([a, 600 - a.sum(0, keepdim=True)]), torch.cat([b, 600 - b.sum(0, keepdim=True)])  # + "rare"
        chi2 = float(((a - b) ** 2 / (a + b).clamp(min=1)).sum())  # two-sample chi-square, dof = bins - 1
        dof = len(keys)
        assert dof >= 3 and chi2 < dof + 4 * math.sqrt(2 * dof) + 10, (pos, chi2, dof)


# ==============================================================================================
# GGUF targets
# ==============================================================================================

def gguf_from_checkpoint(path, out, ftype, with_mtp=True):
    from safetensors.torch import load_file
    with open(os.path.join(path, "config.json")) as fh:
        top = json.load(fh)
    w = load_file(os.path.join(path, "model.safetensors"))
    sd.write_gguf(top.get("text_config", top), w, out, ftype, os.path.join(path, "tokenizer.json"), with_mtp)
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
def test_gguf_mtp_greedy_lossless_and_refusals(tiny, tmp_path):
    f = gguf_from_checkpoint(tiny, str(tmp_path / "m.gguf"), "F32")
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(model=f, device="cpu").generate(["a b c a b"], sp)[0].outputs[0].token_ids
    spec = LLM(model=f, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert spec.generate(["a b c a b"], sp)[0].outputs[0].token_ids == ref
    nomtp = gguf_from_checkpoint(tiny, str(tmp_path / "nomtp.gguf"), "F32", with_mtp=False)
    with pytest.raises(ConfigError, match="no MTP block"):
        LLM(model=nomtp, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ConfigError, match="'dspark' is refused for a GGUF target"):
        LLM(model=f, device="cpu", speculative_config={"method": "dspark", "model": tiny, "num_speculative_tokens": 7})


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


SPEC_ERRORS = [
    ({"method": "eagle3", "model": "x", "num_speculative_tokens": 2}, "'eagle3' is a vLLM method that specdec does not implement; accepted methods: mtp, dflash, dspark, ngram, draft_model"),
    ({"method": "ngram_gpu", "num_speculative_tokens": 2}, "'ngram_gpu' is a vLLM method"),
    ({"method": "foo", "num_speculative_tokens": 2}, "unknown speculative method 'foo'; accepted methods: mtp, dflash"),
    ({"method": "mtp", "num_speculative_tokens": 2, "bogus": 1}, "unknown speculative config key 'bogus'"),
    ({"method": "mtp", "num_speculative_tokens": 2, "tensor_parallel_size": 1}, "Please pass 'draft_tensor_parallel_size' instead"),
    ({"method": "mtp"}, "num_speculative_tokens must be provided"),
    ({"method": "ngram"}, "num_speculative_tokens must be provided"),
    ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer, got 0"),
    ({"method": "mtp", "num_speculative_tokens": -1}, "must be a positive integer, got -1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be a positive integer"),
    ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "only valid with method 'ngram'"),
    ({"method": "dflash", "num_speculative_tokens": 2}, "num_speculative_tokens was provided but without speculative model."),
    ({"method": "mtp", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "cannot be other value than 1"),
    ({"method": "mtp", "num_speculative_tokens": 2, "quantization": "fp8"}, "draft quantization 'fp8' is not supported"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "block"}, "must be 'standard' or 'synthetic'"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"}, "needs exactly one of"),
    ({"method": "mtp", "num_speculative_tokens": 2, "synthetic_acceptance_length": 2.0}, "need rejection_sample_method 'synthetic'"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.5]}, "must be a list of 2 numbers"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.5, 0.9]}, "must be non-increasing"),
    ({"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 3.5}, r"must be in \[1, num_speculative_tokens \+ 1 = 3\]"),
    ({"method": "mtp", "num_speculative_tokens": 2, "draft_sample_method": "beam"}, "draft_sample_method must be 'greedy' or 'probabilistic'"),
    ({"method": "mtp", "num_speculative_tokens": 2, "dspark_draft_topk": 4}, "dspark_draft_topk is only valid with method 'dspark'"),
    ({"method": "mtp", "num_speculative_tokens": 2, "disable_padded_drafter_batch": True}, "'disable_padded_drafter_batch' is a vLLM option specdec does not support"),
    ({"model": "my.pkg.Proposer", "num_speculative_tokens": 2}, "'custom_class' is a vLLM method"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
]


@pytest.mark.parametrize("cfg,msg", SPEC_ERRORS, ids=[m[:40] for _, m in SPEC_ERRORS])
def test_spec_config_errors(cfg, msg):
    with pytest.raises(ConfigError, match=msg):
        sd.SpeculativeConfig.from_json(cfg if isinstance(cfg, str) else json.dumps(cfg))


def test_spec_config_inference_and_aliases():
    c = sd.SpeculativeConfig.from_json({"model": "ngram", "num_speculative_tokens": 3})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 5)
    c = sd.SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 7})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (7, 7)
    assert sd.SpeculativeConfig.from_json({"model": "some/draft", "num_speculative_tokens": 3}).method == "draft_model"
    for alias in ("qwen3_5_mtp", "qwen3_next_mtp", "deepseek_mtp"):
        with pytest.warns(UserWarning, match=f"method `{alias}` is deprecated and replaced with mtp"):
            assert sd.SpeculativeConfig.from_json({"method": alias, "num_speculative_tokens": 1}).method == "mtp"
    c = sd.SpeculativeConfig.from_json({"method": "mtp", "num_speculative_tokens": 4, "rejection_sample_method": "synthetic",
                                        "synthetic_acceptance_length": 2.5})
    assert c.conditional_rates() == [1.0, 0.5, 0.0, 0.0]


def test_mtp_without_head_fails_at_load(tmp_path):
    path = write_tiny_checkpoint(str(tmp_path / "nomtp"), mtp=False)
    with pytest.raises(ConfigError, match="no mtp.\\* tensors \\(the MTP head is missing\\)"):
        LLM(model=path, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_request_errors(tiny):
    llm = LLM(model=tiny, device="cpu", max_model_len=64)
    with pytest.raises(ConfigError, match="maximum context length is 64 tokens. However, you requested 70 tokens"):
        llm.generate([[1] * 60], SamplingParams(max_tokens=10))
    with pytest.raises(ConfigError, match="prompt is empty"):
        llm.generate([[]], SamplingParams())
    for bad, msg in ((dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(max_tokens=0), "max_tokens"),
                     (dict(top_k=0), "top_k")):
        with pytest.raises(ConfigError, match=msg):
            SamplingParams(**bad)


def test_stops_inside_speculative_steps(tiny, spec_off):
    """EOS / stop ids / stop strings / max_tokens cut the accepted run where plain decoding stops."""
    sp, ref, _ = spec_off
    full = ref[0].outputs[0]
    plain = LLM(model=tiny, device="cpu")
    spec = LLM(model=tiny, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 4})
    stop_id = full.token_ids[7]
    text = full.text
    stop_str = text[len(text) // 2: len(text) // 2 + 3]
    for p in (SamplingParams(temperature=0, max_tokens=11, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]),
              SamplingParams(temperature=0, max_tokens=40, stop=[stop_str], ignore_eos=True)):
        a, b = plain.generate([SPEC_PROMPTS[0]], p)[0].outputs[0], spec.generate([SPEC_PROMPTS[0]], p)[0].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason, b.stop_reason)
    assert b.finish_reason == "stop" and b.stop_reason == stop_str and stop_str not in b.text


# ==============================================================================================
# CLI
# ==============================================================================================

def run_cli(*args):
    return subprocess.run([sys.executable, os.path.join(HERE, "specdec.py"), *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))


def test_cli_generates_with_stats_and_speculation(tiny):
    base = ["--model", tiny, "--prompt", "a b c a b", "--max-tokens", "8", "--device", "cpu", "--ignore-eos"]
    plain = run_cli(*base)
    assert plain.returncode == 0, plain.stderr
    assert "prompt tokens:" in plain.stderr and "generated tokens: 8" in plain.stderr and "tok/s" in plain.stderr
    spec = run_cli(*base, "--speculative-config", '{"method":"mtp","num_speculative_tokens":2}')
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and spec.stdout.strip()
    assert "Mean acceptance length" in spec.stderr


@pytest.mark.parametrize("args,msg", [
    (["--speculative-config", '{"method":"eagle","num_speculative_tokens":1}'], "'eagle' is a vLLM method"),
    (["--speculative-config", '{"method":"mtp"}'], "num_speculative_tokens must be provided"),
    (["--model", "/nonexistent/dir"], "does not exist"),
    (["--dtype", "int3"], "unsupported dtype"),
])
def test_cli_errors_are_one_line(args, msg, tiny):
    r = run_cli("--model", tiny, "--device", "cpu", *args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_cli_help_documents_every_flag():
    r = run_cli("--help")
    for flag in ("--model", "--prompt", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--dtype",
                 "--device", "--max-model-len", "--chat", "--speculative-config", "--enforce-eager"):
        assert flag in r.stdout


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
    pieces = [dec.add(i) for i in ids] + [dec.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == dec.text == tok.decode(ids) == text == tok.decode(torch.tensor(ids))
    dec = IncrementalDecoder(tok, skip_special=True)  # lists of ids work too
    assert dec.add(ids[:3]) + dec.add(ids[3:]) + dec.flush() == text.replace("<|im_end|>", "")
    dec = IncrementalDecoder(tok)  # a truncated character comes out as one U+FFFD on flush
    part = tok.encode("😀")[:-1]
    assert dec.add(part) == "" and dec.flush() == "\ufffd" == tok.decode(part)


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
    with pytest.raises(ValueError, match="tool"):
        apply_chat_template(msgs, tools=[{"type": "function", "function": {"name": "f"}}])
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
from specdec import GGUF_NO_MTP_MESSAGE, _gguf_tensor, _vhead_perm, gguf_has_mtp, read_gguf, write_gguf  # noqa: E402

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
def test_gpu_graphs_equal_eager(cfg, tiny):
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = []
    for eager in (True, False):
        llm = LLM(model=tiny, device="cuda", dtype="float32", speculative_config=cfg, enforce_eager=eager)
        outs.append([o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, sp)])
    assert outs[0] == outs[1]


@cuda
def test_gpu_bf16_spec_equals_plain(tiny):
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(model=tiny, device="cuda").generate(SPEC_PROMPTS[:1], sp)]
    llm = LLM(model=tiny, device="cuda", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS[:1], sp)] == ref


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
    def __init__(self, model, log_dir, *args, prelude=None):
        """server.py in a subprocess; `prelude`: Python run first in that process (e.g. to inject faults)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = os.path.join(log_dir, f"server-{self.port}.log")
        main = [os.path.join(ROOT, "server.py")] if prelude is None else \
            ["-c", f"{prelude}\nimport sys, server\nsys.exit(server.main())"]
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen([sys.executable, *main, "--model", model, "--device", "cpu", "--port",
                                          str(self.port), *args], stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env=ENV)
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
        family = next(n for n in (name, re.sub(r"_(total|bucket|sum|count)$", "", name)) if n in types)
        assert types[family] != "counter" or name.endswith("_total")
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
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_server")))


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
    assert card["id"] == "tiny" and card["object"] == "model" and card["owned_by"] == "specdec"
    assert card["root"] == tiny_model and card["parent"] is None and card["max_model_len"] == 4096


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
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "must be an integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature", "non-negative"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "must be a number"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n", "n=1"),
    ("/v1/completions", {"prompt": ""}, 400, None, "empty"),
    ("/v1/completions", {"prompt": []}, 400, None, "empty"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "required"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "only one prompt per request is supported"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt", "token ids"),
    ("/v1/completions", {"prompt": [5000]}, 400, None, "out of range"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, None,
     "This model's maximum context length is 4096 tokens. However, you requested 5001 tokens"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream=True"),
    ("/v1/completions", {"prompt": "x", "logprobs": -2}, 400, "logprobs", "`logprobs` must be a positive value or -1."),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs",  # -1: the whole vocabulary, above 20
     "Requested sample logprobs of 1024, which is greater than max allowed: 20"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop", "stop"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
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
    assert sum(1 for n, _ in after if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total") == 3
    assert r["usage"]["completion_tokens"] == 32
    assert r["choices"][0]["text"] == srv.post("/v1/completions", dict(body, model="tiny"))[1]["choices"][0]["text"]


def test_bench_serve(srv_spec):
    bench = os.path.join(ROOT, "bench.py")
    cmd = [bench, "serve"]
    env = ENV
    p = subprocess.run([sys.executable, *cmd, "--url", srv_spec.url, "--num-prompts", "8", "--max-concurrency", "4",
                        "--prompt-len", "24", "--gen-len", "12", "--seed", "1"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert "Serving Benchmark Result" in p.stdout
    assert res["completed"] == 8 and res["failed"] == 0
    assert res["total_input_tokens"] == 8 * 24 and res["total_output_tokens"] == 8 * 12
    assert res["output_throughput"] == pytest.approx(96 / res["duration"])
    assert 0 < res["median_ttft_ms"] <= res["p99_ttft_ms"] and res["mean_tpot_ms"] > 0 and res["mean_itl_ms"] > 0
    assert res["mean_e2el_ms"] >= res["mean_ttft_ms"]
    n, acc = res["spec_decode_num_drafts"], res["spec_decode_accepted_tokens"]
    assert n > 0 and res["spec_decode_acceptance_length"] == pytest.approx(1 + acc / n)
    assert res["spec_decode_acceptance_rate"] == pytest.approx(100 * acc / res["spec_decode_draft_tokens"])
    assert len(res["spec_decode_per_position_acceptance_rates"]) == 3
    assert sum(res["spec_decode_per_position_acceptance_rates"]) == pytest.approx(acc / n)


def test_bad_startup_is_one_line(tiny_model, tmp_path):
    for args in (["--model", tiny_model, "--speculative-config", '{"method":"eagle","num_speculative_tokens":2}'],
                 ["--model", str(tmp_path / "missing")],
                 ["--model", str(tmp_path)]):
        p = subprocess.run([sys.executable, os.path.join(ROOT, "server.py"), "--port", str(free_port()), *args],
                           capture_output=True, text=True, timeout=120, env=ENV)
        lines = p.stderr.strip().splitlines()
        assert p.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr


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
    ("seed as a string", "/v1/completions", {"seed": "7"}, 400, "seed", "must be an integer"),
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
    ("n beyond int64", "/v1/completions", {"n": BIG}, 400, "n", "only n=1"),
    ("presence_penalty inf", "/v1/completions", {"presence_penalty": 1e999}, 400, "presence_penalty",
     "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty -3", "/v1/completions", {"frequency_penalty": -3}, 400, "frequency_penalty", "[-2, 2]"),
    ("presence_penalty in range", "/v1/completions", {"presence_penalty": 0.5}, 400, "presence_penalty",
     "not supported"),
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
    ("echo as a number", "/v1/completions", {"echo": 1}, 400, "echo", "must be a boolean"),
    ("stream as a string", "/v1/completions", {"stream": "yes"}, 400, "stream", "must be a boolean"),
]
RAW_CORPUS = [  # (class, raw body, fragment): bodies json.dumps cannot write; all 400
    ("NaN literal", b'{"prompt": "x", "temperature": NaN}', "not valid JSON"),
    ("Infinity literal", b'{"prompt": "x", "top_p": -Infinity}', "not valid JSON"),
    ("integer of 5000 digits", b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
    ("nesting 100000 deep", b"[" * 100000 + b"]" * 100000, "not valid JSON"),
    ("bytes that are not UTF-8", b'{"prompt": "\xff\xfe"}', "not valid JSON"),
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


def test_half_closed_client_gets_its_answer(srv):
    before = wait_idle(srv)
    for stream in (False, True):
        body = json.dumps({"prompt": "half", "max_tokens": 400, "ignore_eos": True, "temperature": 0,
                           "stream": stream}).encode()
        t0 = time.time()
        status, headers, data = raw_http(srv.port, post_head(length=len(body)) + body, half_close=True, timeout=60)
        took = time.time() - t0
        assert took > 1.0  # the server looks for gone clients every 0.5 s: it saw this one's half-close
        assert status == 200
        if stream:
            events = [e for e in data.decode().split("\n\n") if e.strip() and not e.startswith(":")]  # SSE comments
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        else:
            assert json.loads(data)["usage"]["completion_tokens"] == 400
    aborted = lambda m: metric(m, "vllm:request_success_total", finished_reason="abort")
    assert aborted(wait_idle(srv)) == aborted(before)


# ==============================================================================================
# Fault isolation: faults injected into the engine of a server process
# ==============================================================================================

FAULTS = '''
import specdec
prefill, decode_step = specdec.Engine._prefill, specdec.Engine._decode_step
marked = lambda req, mark: req.prompt_ids[:3] == [mark] * 3

def _prefill(self, req):
    if marked(req, 7):
        raise RuntimeError("injected fault in a prefill")
    return prefill(self, req)

def _decode_step(self, reqs, *args):
    if any(marked(r, 8) for r in reqs) and self.waiting:  # once another request waits for a slot
        raise ValueError("injected fault in a batched step")
    if any(marked(r, 9) for r in reqs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
    return decode_step(self, reqs, *args)

specdec.Engine._prefill, specdec.Engine._decode_step = _prefill, _decode_step
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
    if "dflash block 8" in rows:  # the trained block drafters: 3.24 and 3.91 on these prompts (2.83 and 3.29 on
        # the 8-prompt CPU evaluation in models/README.md)
        dflash, dspark = (rows[f"{m} block 8"]["mean_acceptance_length"] for m in ("dflash", "dspark"))
        assert dflash >= 2.5 and dspark >= dflash


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
    for m in plain.modules():
        if isinstance(m, sd.Attention):
            rd = fused.cfg.rotary_dim
            m.inv_freq = 1.0 / fused.cfg.rope_theta ** (torch.arange(0, rd, 2).float() / rd)
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
    r = randn(3, 5, D, g=g, dtype=dtype)
    y, h = fast(K.add_rms_norm, x, r, w, 1e-6)
    y_ref, h_ref = K.add_rms_norm_ref(x, r, w, 1e-6)
    assert (torch.equal(h, h_ref) if CUDA else rel(h, h_ref) <= TOL[dtype]) and rel(y, y_ref) <= TOL[dtype]
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
        p3, p4 = pool.clone(), pool.clone()
        assert fast(K.gdn_recurrent_gated, q, k, v, a, b, A_log, dt_bias, p3, slots, keep, outputs=False) is None
        fast(K.gdn_recurrent_gated, q, k, v, a, b, A_log, dt_bias, p4, slots, keep)
        assert torch.equal(p3, p4)
        p5, c5, c6 = pool.clone(), cpool.clone(), cpool.clone()                    # + the conv window, one launch
        fast(K.gdn_recurrent_gated, q, k, v, a, b, A_log, dt_bias, p5, slots, keep, outputs=False, conv=(x, c5))
        K.causal_conv_ref(x, c6, slots, randn(C, W + 1, g=g_, dtype=dtype), keep)
        assert torch.equal(p5, p4) and torch.equal(c5, c6) and not torch.equal(c5, cpool)


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
    for nsplit in (1, 3, 7):
        o = fast(K._attention_launch, q, kp, vp, slots, pos_t, kv_len, nsplit=nsplit)
        assert rel(o, ref) <= TOL[dtype], nsplit


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
    # Qwen3's layers (the drafters): plain q/k norm weights, full rotary; and a cache write without queries.
    # (bf16 only on the GPU: the interpreter emulates bf16 casts by truncation, and a full rotation chains more
    # of them than the zero-centred check above, past bf16's tolerance, which is not a kernel error)
    if dtype != torch.float32 and not CUDA:
        return
    q3 = qg[..., :hd]
    inv3 = 1.0 / 1e6 ** (torch.arange(0, hd, 2, device=DEV).float() / hd)
    qw3, kw3 = 1 + qw, 1 + kw
    for qq in (q3, k[:, :, :0]):
        k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        q = fast(K.attention_prep, qq, k, v, qw3, kw3, 1e-6, inv3, k1, v1, slots, pos, plain=True)
        q_ref = K.attention_prep_ref(qq, k, v, qw3, kw3, 1e-6, inv3, k2, v2, slots, pos, plain=True)
        assert q.shape == q_ref.shape and rel(k1, k2) <= TOL[dtype] and torch.equal(v1, v2)
        assert q.numel() == 0 or rel(q, q_ref) <= TOL[dtype]


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


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 3, 5, 17])
def test_kernel_moe_experts(dtype, N):
    E, k, H, I = 6, 2, 40, 24                    # N=1, 3: by pair (N=3: experts shared by tokens); else by expert
    g = gen(N)
    x = randn(N, H, g=g, dtype=dtype)
    gate_up, down = randn(E, 2 * I, H, g=g, dtype=dtype, scale=0.2), randn(E, H, I, g=g, dtype=dtype, scale=0.2)
    w, idx = K.moe_route_ref(randn(N, E, g=g), k)
    assert N != 3 or idx.unique().numel() < idx.numel()                          # a leader with several pairs
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
    r = randn(N, H, g=g, dtype=torch.bfloat16)
    nw = randn(H, g=g, dtype=torch.bfloat16, scale=0.1)
    y, h = fast(K.add_rms_norm, x, r, nw, 1e-6)
    y_ref, h_ref = K.add_rms_norm_ref(x, r, nw, 1e-6)
    assert torch.equal(h, h_ref) and rel(y, y_ref) <= 1e-2


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


def qwen3_layers(cfg, g, prefix=""):
    """Random Qwen3 decoder layers (plain norms: weights around 1)."""
    H, nh, nkv, hd, I = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                          "intermediate_size"))
    r = lambda *s: torch.randn(*s, generator=g) * 0.1
    one = lambda n: 1 + torch.randn(n, generator=g) * 0.1
    w = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        w.update({p + "self_attn.q_proj.weight": r(nh * hd, H), p + "self_attn.k_proj.weight": r(nkv * hd, H),
                  p + "self_attn.v_proj.weight": r(nkv * hd, H), p + "self_attn.o_proj.weight": r(H, nh * hd),
                  p + "self_attn.q_norm.weight": one(hd), p + "self_attn.k_norm.weight": one(hd),
                  p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
                  p + "mlp.down_proj.weight": r(H, I), p + "input_layernorm.weight": one(H),
                  p + "post_attention_layernorm.weight": one(H)})
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


def write_dflash(path, target, ids=(0, 2), block=4, seed=0, reduced=False, fc_in=None):
    """z-lab layout: model_type qwen3, DFlashDraftModel, dflash_config; a sliding (causal) + a full layer."""
    emb, head = target_tensors(target)
    V = emb.shape[0]
    cfg = qwen3_config(V, types=["sliding_attention", "full_attention"], sliding_window=6, architectures=[
        "DFlashDraftModel"], auto_map={"AutoModel": "dflash.DFlashDraftModel"}, block_size=block,
        num_target_layers=TARGET_LAYERS, dflash_config={"mask_token_id": V - 1, "target_layer_ids": list(ids)})
    w = backbone(cfg, len(ids), seed, fc_in)
    if reduced:  # a reduced draft vocab: its own lm_head rows and d2t offsets (target id = id + d2t[id])
        keep = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:V // 2]).values
        cfg["draft_vocab_size"] = len(keep)
        w["lm_head.weight"], w["d2t"], w["t2d"] = head[keep], keep - torch.arange(len(keep)), torch.zeros(V, dtype=torch.bool)
    return save(path, cfg, w)


def dspark_parts(target, ids, block, rank, seed):
    emb, head = target_tensors(target)
    V = emb.shape[0]
    layer_cfg = qwen3_config(V)
    w = backbone(layer_cfg, len(ids), seed)
    g = torch.Generator().manual_seed(seed + 1)
    w.update({"markov_head.markov_w1.weight": torch.randn(V, rank, generator=g) * 0.5,
              "markov_head.markov_w2.weight": torch.randn(V, rank, generator=g) * 0.5,
              "confidence_head.proj.weight": torch.randn(1, 64 + rank, generator=g) * 0.1,
              "confidence_head.proj.bias": torch.zeros(1)})
    fields = {"block_size": block, "mask_token_id": V - 1, "markov_rank": rank, "markov_head_type": "vanilla",
              "enable_confidence_head": True, "confidence_head_with_markov": True, "num_anchors": 512}
    return layer_cfg, w, fields, emb, head


def write_dspark_native(path, target, ids=(-1, 1, 3), block=4, rank=8, seed=0):
    """DeepSpec layout: a Qwen3 config copy + top-level DSpark fields; full draft state dict (embed, lm_head)."""
    layer_cfg, w, fields, emb, head = dspark_parts(target, ids, block, rank, seed)
    cfg = {**layer_cfg, **fields, "architectures": ["Qwen3DSparkModel"], "num_target_layers": TARGET_LAYERS,
           "target_layer_ids": list(ids)}
    return save(path, cfg, {**w, "embed_tokens.weight": emb.clone(), "lm_head.weight": head.clone()})


def write_dspark_speculators(path, target, ids=(-1, 1, 3), block=4, rank=8, seed=0):
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


def write_qwen3_lm(path, vocab, seed=0, tie=True):
    """A plain Qwen3 causal LM in the HF layout (model.*, lm_head)."""
    cfg = qwen3_config(vocab, tie_word_embeddings=tie)
    g = torch.Generator().manual_seed(seed)
    w = {"model.embed_tokens.weight": torch.randn(vocab, 64, generator=g) * 0.5,
         "model.norm.weight": 1 + torch.randn(64, generator=g) * 0.1, **qwen3_layers(cfg, g, "model.")}
    if not tie:
        w["lm_head.weight"] = torch.randn(vocab, 64, generator=g) * 0.3
    return save(path, cfg, w)


# ==============================================================================================
# Fixtures: the target, the drafters, spec-off references, one LLM per drafter config
# ==============================================================================================

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("drafters")
    t = write_tiny_checkpoint(str(d / "target"))
    return {"target": t, "dflash": write_dflash(str(d / "dflash"), t),
            "dflash_small_vocab": write_dflash(str(d / "dflash_v"), t, reduced=True, seed=3),
            "dspark": write_dspark_native(str(d / "dspark"), t),
            "dspark_spec": write_dspark_speculators(str(d / "dspark_spec"), t),
            "hybrid_draft": write_tiny_checkpoint(str(d / "hybrid_draft"), mtp=False, seed=5),
            "qwen3_draft": write_qwen3_lm(str(d / "qwen3_draft"), 1024)}


CONFIGS = {  # name -> (checkpoint key, speculative config); the first of each method also runs the mixed batch
    "dflash": ("dflash", {"method": "dflash", "num_speculative_tokens": 3}),
    "dspark": ("dspark", {"method": "dspark", "num_speculative_tokens": 4}),
    "draft_hybrid": ("hybrid_draft", {"method": "draft_model", "num_speculative_tokens": 2}),
    "dspark_spec": ("dspark_spec", {"method": "dspark", "num_speculative_tokens": 4}),
    "draft_self": ("target", {"method": "draft_model", "num_speculative_tokens": 3}),  # the target as its own draft
    "draft_qwen3": ("qwen3_draft", {"method": "draft_model", "num_speculative_tokens": 3}),
}
MIXED = ("dflash", "dspark", "draft_hybrid")
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
            before = sd.SpecStats(**vars(llm.get_metrics()))
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
    s = llm.get_metrics()
    assert s.num_drafts > 0
    if name == "draft_self":  # the target as its own draft: every draft is accepted (tests the draft's rollback)
        assert s.num_accepted_tokens == s.num_draft_tokens


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
        assert (in_flight > 0) == e.async_steps
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
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-4 for t in a)


class CaptureRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Stands in for CUDA-graph capture on the CPU: records the storages that ops inside any capture read but that
    were allocated outside every capture. A real graph keeps only raw pointers to those, so each must outlive the
    capture, or every replay reads freed (and soon reused) memory - what broke every speculative method on the H200
    in 0d2d4b3 (a verify's n_keep zeros made by the Ctx, which died after the capture)."""
    def __init__(self):
        super().__init__()
        self.pool, self.outside, self.dead = {}, {}, []  # storage id -> weak ref (made in a capture: the graph
        # pool) or (weak ref, what read it) (made outside); ids of freed storages can be reused, hence the refs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef
        kwargs = kwargs or {}
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if not isinstance(t, torch.Tensor):
                continue
            sid = t.untyped_storage()._cdata
            if sid in self.pool and not self.pool[sid].expired():
                continue
            if sid in self.outside and not self.outside[sid][0].expired():
                continue
            if sid in self.outside:  # freed, and its id now names another storage
                self.dead.append(self.outside[sid][1])
            what = f"{func} reads {str(t.dtype)[6:]}{list(t.shape)}"
            self.outside[sid] = (StorageWeakRef(t.untyped_storage()), what)
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                sid = t.untyped_storage()._cdata
                if not (sid in self.outside and not self.outside[sid][0].expired()):
                    self.pool[sid] = StorageWeakRef(t.untyped_storage())
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
    llm.engine.graphs = sd.GraphRunner(llm.engine)
    llm.generate(SPEC_PROMPTS[:3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(llm.engine.graphs.graphs) >= (1 if cfg is None else 3)  # decode (and verify, drafter) captures ran
    assert rec.outside, "nothing was recorded"
    assert rec.freed() == [], "captured graphs read tensors freed after their capture"


def test_warmup_leaves_no_trace(tiny):
    """LLM.warmup (the server calls it at start-up to capture every graph) runs dummy requests through every batch
    bucket, then resets the counters: what follows is as if it had not run."""
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(model=tiny, device="cpu", max_num_seqs=3, speculative_config=spec).generate(SPEC_PROMPTS[:2], sp)
    llm = LLM(model=tiny, device="cpu", max_num_seqs=3, speculative_config=spec)
    llm.warmup(force=True)
    assert llm.get_metrics().num_drafts == 0 and not llm.engine.has_work()
    out = llm.generate(SPEC_PROMPTS[:2], sp)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert [o.request_id for o in out] == [o.request_id for o in ref]


def test_dspark_layouts_load_to_the_same_drafter(runs):
    native, _, _, m_native = runs("dspark")
    spec, _, _, m_spec = runs("dspark_spec")
    a, b = native.engine.proposer, spec.engine.proposer
    assert a.taps == b.taps == (-1, 1, 3) and a.order == b.order and (a.Q, a.out) == (b.Q, b.out) == (4, slice(0, 4))
    pa, pb = dict(a.net.named_parameters()), dict(b.net.named_parameters())
    assert set(pa) - set(pb) == {"embed_tokens.weight", "lm_head.weight"}  # native ships copies of the target's
    assert all(torch.equal(pa[n], pb[n]) for n in pb)
    assert torch.equal(pa["embed_tokens.weight"], native.model.embed_tokens.weight)
    assert vars(m_native) == vars(m_spec)                       # same drafts, hence the same acceptance


def test_reduced_vocab_dflash_and_dspark_topk(ckpts, reference):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = reference[0][:24]
    llm = LLM(model=ckpts["target"], device="cpu", speculative_config={
        "method": "dflash", "model": ckpts["dflash_small_vocab"], "num_speculative_tokens": 3})
    assert llm.engine.proposer.net.d2t is not None
    assert llm.generate(SPEC_PROMPTS[:1], sp)[0].outputs[0].token_ids == ref
    # top-k = the whole vocab changes nothing; a small top-k still verifies losslessly
    metrics = []
    for topk in (None, 1024, 3):
        llm = make_llm(ckpts, "dspark", dspark_draft_topk=topk)
        assert llm.generate(SPEC_PROMPTS[:1], sp)[0].outputs[0].token_ids == ref
        metrics.append(vars(llm.get_metrics()))
    assert metrics[0] == metrics[1]


@pytest.mark.parametrize("name", ["dflash", "dspark", "draft_self", "draft_qwen3"])
def test_probabilistic_drafting_runs(name, ckpts):
    llm = make_llm(ckpts, name, draft_sample_method="probabilistic")
    ps = [SamplingParams(temperature=0.8, max_tokens=16, seed=s, ignore_eos=True) for s in range(3)]
    outs = llm.generate(SPEC_PROMPTS[:3], ps)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    s = llm.get_metrics()
    assert s.num_drafts > 0
    if name == "draft_self":  # q == p: the ratio test accepts (almost) everything
        assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens


@pytest.mark.parametrize("name,extra", [("dflash_small_vocab", {}), ("dspark", {"dspark_draft_topk": 5})])
def test_probabilistic_q_is_the_sampled_distribution(name, extra, ckpts):
    """q over the target vocab: rows sum to 1, zero off the draft vocab (d2t) or outside the top-k, > 0 at the draft."""
    method = "dflash" if name.startswith("dflash") else "dspark"
    llm = LLM(model=ckpts["target"], device="cpu", speculative_config={
        "method": method, "model": ckpts[name], "num_speculative_tokens": 4, "draft_sample_method": "probabilistic",
        **extra})
    e, prop = llm.engine, llm.engine.proposer
    req = e.add_request(llm.tokenizer.encode(SPEC_PROMPTS[0]), SamplingParams(temperature=0.7, max_tokens=8, seed=1))
    e.step()                                                    # prefill: context K/V for the prompt
    with torch.inference_mode():
        e.set_batch([req])
        d, q = prop.propose(e, [req])
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
def test_block_cache_equals_fresh_prefill_and_zlab(name, runs):
    """After the 48-token batch run (mostly rejected drafts), each slot's context K/V over its committed tokens
    equals a fresh prefill's; and the next block's logits equal z-lab's cache-free formulation."""
    llm, _, five, _ = runs(name)
    e, prop = llm.engine, llm.engine.proposer
    free = e.max_num_seqs - 1                                   # a slot the 5 prompts did not use
    with torch.inference_mode():
        for slot, toks in committed(llm, five):
            n = len(toks) - 1                                   # all but the last token have context K/V
            got = [prop.cache.kv[i][j][slot, :n].clone() for i in prop.cache.kv for j in (0, 1)]
            e.state.reset(free)
            ctx = sd.Ctx(e.state, torch.tensor([free]), torch.tensor([0]), n, "prefill")
            h, e.aux = e.model(torch.tensor([toks[:n]]), ctx, prop.taps)
            prop.prefill(e, types.SimpleNamespace(slot=free), h, None, 0)
            want = [prop.cache.kv[i][j][free, :n] for i in prop.cache.kv for j in (0, 1)]
            assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in zip(got, want))
            anchor = torch.tensor([toks[-1]])
            U = prop.block_logits(n + prop.Q, torch.tensor([slot]), torch.tensor([n]), anchor)
            feats = torch.cat([e.aux[i] for i in prop.order], -1)
            block = torch.cat([prop.embed(anchor)[:, None], prop.mask_vec.expand(1, prop.Q - 1, -1)], 1)
            ref = prop.logits(zlab_block_hidden(prop.net, prop.cfg, feats, block)[:, prop.out])
            assert torch.allclose(U, ref, atol=1e-4, rtol=1e-4)


def test_draft_model_state_equals_fresh_prefill(runs):
    """A hybrid draft's GDN conv/recurrent states and KV after the batch run == a prefill over the tokens it consumed."""
    llm, _, five, _ = runs("draft_hybrid")
    prop = llm.engine.proposer
    m, st = prop.model, prop.state
    free = llm.engine.max_num_seqs - 1
    with torch.inference_mode():
        for slot, toks in committed(llm, five):
            n = int(prop.start[slot])                           # tokens the draft has consumed
            assert len(toks) - 3 <= n < len(toks)               # one step behind: at most k+1 = 3 tokens
            st.reset(free)
            m(torch.tensor([toks[:n]]), sd.Ctx(st, torch.tensor([free]), torch.tensor([0]), n, "prefill"))
            for i in st.conv:
                assert torch.allclose(st.conv[i][slot], st.conv[i][free], atol=1e-5)
                assert torch.allclose(st.rec[i][slot], st.rec[i][free], atol=1e-4)
            assert all(torch.allclose(st.kv[i][0][slot, :n], st.kv[i][0][free, :n], atol=1e-4) for i in st.kv)


# ==============================================================================================
# Building blocks
# ==============================================================================================

def test_block_attention_folded_kernel_equals_masked_reference():
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(3, 40, 2, 16, generator=g), torch.randn(3, 40, 2, 16, generator=g)
    q, slots, pos = torch.randn(2, 5, 4, 16, generator=g), torch.tensor([2, 0]), torch.tensor([17, 30])
    fold = sd.block_attention(q, kc, vc, slots, pos, 35)               # the non-causal path through K.attention
    ref = sd.block_attention(q, kc, vc, slots, pos, 35, window=10 ** 6)
    assert torch.allclose(fold, ref, atol=1e-5)
    assert torch.allclose(sd.block_attention(q, kc, vc, slots, pos, 35, causal=True),
                          sd.block_attention(q, kc, vc, slots, pos, 35, causal=True, window=10 ** 6), atol=1e-5)


def test_plain_qwen3_draft_matches_transformers(ckpts, tmp_path):
    import transformers
    path = write_qwen3_lm(str(tmp_path / "q3"), 256, seed=7, tie=False)
    cfg = json.load(open(os.path.join(path, "config.json")))
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{k: v for k, v in cfg.items() if k != "model_type"}))
    from safetensors.torch import load_file
    missing, unexpected = hf.load_state_dict(load_file(os.path.join(path, "model.safetensors")), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    engine = types.SimpleNamespace(model=types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=256)),
                                   max_num_seqs=1, dtype=torch.float32, device=torch.device("cpu"))
    m, st = sd.load_draft_lm(path, engine, 64)
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = m.logits(m(ids, sd.Ctx(st, torch.tensor([0]), torch.tensor([0]), 11, "prefill")))
        ref = hf.eval()(ids).logits
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4)


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
    monkeypatch.setattr(K, "_gemv_launch", lambda x, w, cfg, r=None: calls.append(cfg) or launch(x, w, cfg, r))
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
    assert torch.equal(K.linear(xs, w, r), r + K.linear(xs, w))                   # the reference path


@needs_kernels
def test_kernel_gemv_dispatch(gemv_calls):
    """Without GEMV_ALWAYS the CPU keeps its row-wise reference; ineligible inputs always take F.linear."""
    g = gen(0)
    w, x = randn(24, 200, g=g), randn(5, 200, g=g)
    ref = K.linear(x, w)                                                           # the plain CPU / cuBLAS path
    if not CUDA:
        assert torch.equal(gemv(x, w, always=False), ref) and not gemv_calls
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
    from triton.runtime import interpreter as I

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        rows = [np.matmul(a.data[i:i + 1], b.data, dtype=d.data.dtype) for i in range(a.data.shape[0])]
        return I.TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)
    if not CUDA:
        monkeypatch.setattr(I.InterpreterBuilder, "create_dot", create_dot)


def linear_rows_case(N, Kin, dtype, sizes=(2, 5, 8, 17, 40), residual=False, seed=0):
    """(alone, [rows of steps of other sizes at the same row]) of the row-invariant linear: row x0 alone, then as
    row 0 and as the last row of steps of M rows."""
    g = gen(seed)
    w = randn(N, Kin, g=g, dtype=dtype, scale=Kin ** -0.5)
    x0, r0 = randn(1, Kin, g=g, dtype=dtype), randn(1, N, g=g, dtype=dtype) if residual else None
    alone = fast(K._gemv_launch, x0, w, "rows", r0)
    got = []
    for M in sizes:
        xs, rs = randn(M, Kin, g=g, dtype=dtype), randn(M, N, g=g, dtype=dtype) if residual else None
        for at in (0, M - 1):
            xs[at] = x0[0]
            if residual:
                rs[at] = r0[0]
            got.append(fast(K._gemv_launch, xs, w, "rows", rs)[at:at + 1])
    return w, x0, r0, alone, got


@needs_kernels
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("N,Kin", [(70, 48), (24, 200), (130, 1100)])              # small; tall (split-K); 2 splits
def test_kernel_rows_linear_invariant(N, Kin, residual, rowwise_dot):
    w, x0, r0, alone, got = linear_rows_case(N, Kin, torch.float32, residual=residual, seed=N)
    ref = F.linear(x0, w) + (r0 if residual else 0)
    assert rel(alone, ref) <= TOL[torch.float32]
    assert all(torch.equal(y, alone) for y in got)


def attention_rows_case(nh, nkv, d, dtype, pos=300, L=1500, seed=0):
    """The attention of one query row at position pos: alone (T = 1) with kv_len pos + 1 and the cache length L, as
    token 0 of a T = 4 verify, and as row 3 / 7 of batches of 5 / 8 sequences at other positions."""
    g = gen(seed)
    S = 9
    kc, vc = randn(S, L, nkv, d, g=g, dtype=dtype), randn(S, L, nkv, d, g=g, dtype=dtype)
    q0 = randn(1, 1, nh, d, g=g, dtype=dtype)
    slot0 = torch.tensor([4], device=DEV)
    pos0 = torch.tensor([pos], device=DEV)
    alone = fast(K.attention, q0, kc, vc, slot0, pos0, pos + 1)
    got = [fast(K.attention, q0, kc, vc, slot0, pos0, L)]                          # a graph's kv_len
    qv = torch.cat([q0, randn(1, 3, nh, d, g=g, dtype=dtype)], 1)                  # verify: [t0, d1, d2, d3]
    got.append(fast(K.attention, qv, kc, vc, slot0, pos0, pos + 4)[:, :1])
    for B, at in ((2, 1), (5, 3), (8, 7)):
        qb = randn(B, 1, nh, d, g=g, dtype=dtype)
        qb[at] = q0[0]
        slots = torch.tensor([s for s in range(S) if s != 4][:B], device=DEV)
        slots[at] = 4
        posb = torch.randint(0, L - 8, (B,), generator=torch.Generator().manual_seed(seed)).to(DEV)
        posb[at] = pos
        got.append(fast(K.attention, qb, kc, vc, slots, posb, L)[at:at + 1])
    return alone, got


@needs_kernels
@pytest.mark.parametrize("pos", [5, 300, 1100])                                    # 1, 1 and 3 key pieces
def test_kernel_attention_invariant(pos, rowwise_dot):
    alone, got = attention_rows_case(4, 2, 32, torch.float32, pos=pos, seed=pos)
    assert torch.isfinite(alone).all() and all(torch.equal(y, alone) for y in got)


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
                                   (2048, 512), (248320, 2048), (8256, 256), (1024, 256), (256, 1024)])
def test_kernel_gpu_invariance_linear(N, Kin):
    """bf16 at the 27B / 35B-A3B / toy linear shapes: a row alone == the row in steps of 2 .. 40 rows."""
    _, _, _, alone, got = linear_rows_case(N, Kin, torch.bfloat16, residual=N <= 5120)
    assert all(torch.equal(y, alone) for y in got)


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


def test_reference_logits_batch_invariant(tiny):
    """The CPU reference path (fp32): a token's logits are the same bits as a decode token alone, as token 0 of a
    T = 4 verify, and as a row of a batch of 3 decode tokens (the property speculation's losslessness rests on)."""
    llm = LLM(model=tiny, device="cpu", max_num_seqs=3)
    m, st = llm.model, llm.engine.state
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

if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="write a tiny random Qwen3.6 checkpoint (published layout)")
    ap.add_argument("cmd", choices=["make-tiny"])
    ap.add_argument("dir")
    ap.add_argument("--moe", action="store_true")
    a = ap.parse_args()
    print(write_tiny_checkpoint(a.dir, moe=a.moe))
