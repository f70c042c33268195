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
            assert abs(a[t] - b[t]) <= 1e-5 * max(1.0, abs(b[t]))
            assert set(a) == set(b)
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
    """temperature 1, top-p 0.9: the first 3 generated tokens follow the same law with and without speculation."""
    import collections
    prompt = "a b c a b c a b"
    counts = []
    for cfg in (None, {"method": "mtp", "num_speculative_tokens": 2}):
        llm = LLM(model=tiny, device="cpu", speculative_config=cfg, max_num_seqs=8)
        ps = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, seed=s, ignore_eos=True) for s in range(600)]
        outs = llm.generate([prompt] * len(ps), ps)
        counts.append(collections.Counter(tuple(o.outputs[0].token_ids[:2]) for o in outs))
    keys = [k for k in set(counts[0]) | set(counts[1]) if counts[0][k] + counts[1][k] >= 10]
    a = torch.tensor([counts[0][k] for k in keys], dtype=torch.float64)
    b = torch.tensor([counts[1][k] for k in keys], dtype=torch.float64)
    chi2 = float(((a - b) ** 2 / (a + b)).sum())  # two-sample chi-square, dof = len(keys) - 1
    dof = len(keys) - 1
    assert dof >= 3 and chi2 < dof + 4 * math.sqrt(2 * dof) + 10, (chi2, dof)


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
