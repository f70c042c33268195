"""Train the toy target's drafters by self-distillation: the DFlash and DSpark block drafters (block 8) and the
plain-Qwen3 draft LM of method draft_model.

    python tools/train_drafters.py --target models/toy --out models --train dflash,dspark,draft   # H200: 475 s
    python tools/train_drafters.py --target models/toy --out models --train mtp --seconds 180     # H200: 235 s
(what shipped, session 22: two device calls; the defaults train all four in one 420 s loop, not run as such)

Needs models/toy (tools/train_toy.py) and its train_log.json (the held-out files are left out here too).
The drafters are built and loaded by the engine's own code (read_block_config / BlockDrafter / load_weights)
from a checkpoint written in the published layout, trained through the engine's inference forward
(write_context + the non-causal block forward, PyTorch references), and written back in that layout:
  toy-dflash/   z-lab DFlashDraftModel: 2 Qwen3 layers, taps = outputs of target layers 1, 3, 5
  toy-dspark/   DeepSpec Qwen3DSparkModel: the same backbone, the anchor also predicts, Markov head rank 64,
                confidence head
  toy-draft/    a plain Qwen3 LM (model_type qwen3; --draft-layers layers, the target's hidden size, 4 / 2
                heads of 64, MLP 2 x hidden, tied embeddings initialised from the target's), next-token loss on
                the generated part of each sequence: it learns to predict the target's own greedy tokens, which
                is what draft_model's acceptance measures (--draft-layers 0: not trained)
Data (self-distillation, as in the DFlash paper): random stdlib windows of --distill-prompt tokens, each
extended by the target's own greedy continuation (--distill-gen tokens, the engine's prefill + decode forward),
generated once up front; anchors lie in the generated part, so every label is the target's greedy token
(--distill-seqs 0: raw data windows as labels instead).
Training (DFlash paper / DeepSpec): random anchors a per sequence; the block [x_a, MASK x 7] at positions
a..a+7 sees the target's context strictly before a and its whole block; DFlash slot j predicts x_{a+j},
DSpark slot j predicts x_{a+j+1} with the Markov bias W2 W1[x_{a+j}] (teacher forcing); cross-entropy
weighted exp(-(j-1)/4); the confidence head learns whether the slot's argmax is right (BCE).
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench  # noqa: E402
import kernels as K  # noqa: E402
import specdec as sd  # noqa: E402
from corpus import read, split, stdlib_files  # noqa: E402

BLOCK, TAPS, RANK, GAMMA = 8, [1, 3, 5], 64, 4.0


def draft_config(method, tcfg, mask_id):
    cfg = {"model_type": "qwen3", "hidden_size": tcfg.hidden_size, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 2 * tcfg.hidden_size,
           "vocab_size": tcfg.vocab_size, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": tcfg.rope_theta,
           "max_position_embeddings": 4096, "attention_bias": False, "tie_word_embeddings": False,
           "layer_types": ["full_attention"] * 2, "block_size": BLOCK, "num_target_layers": tcfg.num_hidden_layers}
    if method == "dflash":
        cfg.update(architectures=["DFlashDraftModel"], auto_map={"AutoModel": "dflash.DFlashDraftModel"},
                   dflash_config={"mask_token_id": mask_id, "target_layer_ids": TAPS})
    else:
        cfg.update(architectures=["Qwen3DSparkModel"], target_layer_ids=TAPS, mask_token_id=mask_id,
                   markov_rank=RANK, markov_head_type="vanilla", enable_confidence_head=True,
                   confidence_head_with_markov=True, num_anchors=512)
    return cfg


def init_weights(cfg, method, seed):
    g = torch.Generator().manual_seed(seed)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    r = lambda *s: torch.randn(*s, generator=g) * 0.02
    w = {"fc.weight": r(H, len(TAPS) * H), "hidden_norm.weight": torch.ones(H), "norm.weight": torch.ones(H)}
    for i in range(cfg["num_hidden_layers"]):
        w.update(bench.random_qwen3_layer(f"layers.{i}.", H, nh, nkv, hd, I, r, torch.ones))
    if method == "dspark":
        w.update({"markov_head.markov_w1.weight": r(V, RANK), "markov_head.markov_w2.weight": torch.zeros(V, RANK),
                  "confidence_head.proj.weight": r(1, H + RANK), "confidence_head.proj.bias": torch.zeros(1)})
    return w


def lm_config(tcfg, layers, eos):
    """The draft LM's config.json: plain Qwen3 (attention only: on a CPU a pass is a few hundred ops fewer than
    a GDN layer's, and a commit needs no state replay)."""
    H = tcfg.hidden_size
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": H,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "intermediate_size": 2 * H, "vocab_size": tcfg.vocab_size, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "rope_theta": tcfg.rope_theta, "max_position_embeddings": 4096, "attention_bias": False,
            "tie_word_embeddings": True, "eos_token_id": eos}


def lm_init(cfg, target, seed):
    """Random layers (std 0.02, norms 1), the embedding (tied: the lm_head too) copied from the target's."""
    g = torch.Generator().manual_seed(seed)
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    r = lambda *s: torch.randn(*s, generator=g) * 0.02
    w = {"model.embed_tokens.weight": target.embed_tokens.weight.detach().float().cpu(),
         "model.norm.weight": torch.ones(H)}
    for i in range(cfg["num_hidden_layers"]):
        w.update(bench.random_qwen3_layer(f"model.layers.{i}.", H, cfg["num_attention_heads"],
                                          cfg["num_key_value_heads"], cfg["head_dim"], I, r, torch.ones))
    return w


def build_lm(path, device):
    """The draft LM through the engine's loader (specdec.load_draft_lm's steps, unfused), trainable fp32."""
    top = sd.read_config(path, "draft_model")
    fields, types = sd.qwen3_fields(top, f"draft_model {path}")
    c = sd.DraftConfig(**fields, windows=[None] * len(types), causal=[True] * len(types))
    with torch.device("meta"):
        net = sd.Qwen3LM(c)
    sources = sd.checkpoint_sources(sd.checkpoint_tensors(path), lambda n: n[len("model."):] if n.startswith("model.") else n)
    net = sd.load_weights(net, sources, torch.float32, device, path)
    for p in net.parameters():
        p.requires_grad_(True)
    return net.train(), c


def lm_loss(net, c, ids, lo):
    """Next-token cross-entropy of the draft LM over ids [B, L] at the positions that predict ids[:, lo:] (the
    target's greedy tokens when distilling) -> (loss, accuracy)."""
    B, L = ids.shape
    dev = ids.device
    cache = sd.KVCache(c, B, L, torch.float32, dev)
    h = net(ids, sd.Ctx(cache, torch.arange(B, device=dev), torch.zeros(B, dtype=torch.long, device=dev), L, "prefill"))
    logits, labels = net.logits(h[:, lo - 1:-1]), ids[:, lo:]
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return loss, (logits.argmax(-1) == labels).float().mean()


def build_mtp(path, tcfg, device):
    """The target checkpoint's MTP head alone, unfused and trainable fp32 (the target itself stays frozen)."""
    sources = sd.checkpoint_sources(sd.checkpoint_tensors(path), lambda n: sd.internal_name(n, path))
    with torch.device("meta"):
        head = sd.MTPHead(tcfg)
    head = sd.load_weights(head, {n[4:]: v for n, v in sources.items() if n.startswith("mtp.")}, torch.float32,
                           device, path)
    for p in head.parameters():
        p.requires_grad_(True)
    return head.train()


def mtp_loss(head, target, tcfg, st, h, ids, lo, anchors, depth):
    """The MTP head chained as MTPProposer runs it, teacher-forced on the target's greedy tokens -> (loss,
    per-depth accuracy). Depth 1 over every position t (as prefill and the commit pass write its cache):
    u_t = MTP(h_t, x_{t+1}) at t predicts x_{t+2}. Depth j >= 2 at anchors a: u = MTP(u_prev, x_{a+j}) at a+j-1
    predicts x_{a+j+1}, its attention over depth 1's cache below a + 1 and the chain's own entries (each row its
    own slot): on the accepted path the drafts fed back are the true tokens, so this is the chain's exact input.
    st: the target's State (mtp=True), h [B, L, H] its final hidden (no grad); labels only past lo."""
    B, L = ids.shape
    dev = ids.device
    slots, zero = torch.arange(B, device=dev), torch.zeros(B, dtype=torch.long, device=dev)
    emb = target.embed_tokens(ids)                                                   # frozen
    u1 = head(emb[:, 1:-1], h[:, :-2], sd.Ctx(st, slots, zero, L, "decode"))         # [B, L-2, H]
    s0 = max(lo - 2, 0)
    logits = target.logits(u1[:, s0:])
    labels = ids[:, s0 + 2:]
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    acc = [(logits.argmax(-1) == labels).float().mean()]
    m = anchors.shape[1]
    S = B * m
    rows, a = torch.arange(B, device=dev).repeat_interleave(m), anchors.reshape(-1)
    st2 = sd.State(tcfg, S, L, torch.float32, dev, mtp=True)
    st2.kv["mtp"] = tuple(c[rows].detach().clone() for c in st.kv["mtp"])           # depth 1's entries, per anchor
    u = u1[rows, a]                                                                  # [S, H]
    for j in range(2, depth + 1):
        pos = a + j - 1
        u = head(emb[rows, a + j][:, None], u[:, None], sd.Ctx(st2, torch.arange(S, device=dev), pos,
                                                                int(pos.max()) + 1, "decode"))[:, 0]
        lg, lab = target.logits(u), ids[rows, a + j + 1]
        loss = loss + F.cross_entropy(lg, lab)
        acc.append((lg.argmax(-1) == lab).float().mean())
    return loss / depth, acc


def save_mtp(head, path):
    """The trained head's tensors back into the target checkpoint (names mtp.*, dtypes as stored)."""
    from safetensors.torch import load_file, save_file
    f = os.path.join(path, "model.safetensors")
    w = load_file(f)
    for n, p in head.named_parameters():
        w["mtp." + n] = p.detach().to(w["mtp." + n].dtype).cpu().contiguous()
    save_file(w, f)


def save(path, cfg, tensors, dtype):
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    save_file({k: v.detach().to(dtype).cpu().contiguous() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))


def build(path, method, device):
    """The drafter through the engine's loader, unfused and trainable (fp32)."""
    c = sd.read_block_config(path, method)
    from safetensors import safe_open
    f = os.path.join(path, "model.safetensors")
    with safe_open(f, "pt") as st:
        shapes = {n: tuple(st.get_slice(n).get_shape()) for n in st.keys()}
    with torch.device("meta"):
        net = sd.BlockDrafter(c, shapes)
    net = sd.load_weights(net, sd.checkpoint_sources({n: f for n in shapes}), torch.float32, device, path)
    for p in net.parameters():
        p.requires_grad_(True)
    return net.train(), c


_block_attention = sd.block_attention
def opt_step(opt, net, loss, lr):
    """One optimiser step of net on loss at learning rate lr (gradients clipped to norm 1)."""
    for pg in opt.param_groups:
        pg["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()


_attention = K.attention


def masked_block_attention(q, k_cache, v_cache, slots, pos, kv_len, causal=False, window=None):
    """sd.block_attention through its batched masked path (a window wider than any sequence): the same result
    as the kernel's, without the reference's per-row host loop over thousands of training blocks."""
    return _block_attention(q, k_cache, v_cache, slots, pos, kv_len, causal, window or 1 << 30)


def batched_attention(q, k_cache, v_cache, slots, pos, kv_len, chunk=None, window=None):
    """K.attention for training: the kernel where it runs (the frozen target), else sd.block_attention's batched
    masked path, causal (every row at once; the reference loops over the rows on the host: the MTP chain's 512
    rows a step)."""
    if K._fast(q):
        return _attention(q, k_cache, v_cache, slots, pos, kv_len, chunk, window)
    return masked_block_attention(q, k_cache, v_cache, slots, pos, kv_len, causal=True).contiguous()


def block_loss(net, c, method, target, ids, feats, anchors, mask_id):
    """ids [B, L]; feats [B, L, n_taps*H] (no grad); anchors [B, m] -> (loss, per-slot accuracy)."""
    B, m = anchors.shape
    S, dev = B * m, ids.device
    rows = torch.arange(B, device=dev).repeat_interleave(m)                          # sequence of each slot
    a = anchors.reshape(-1)                                                          # [S]
    L = ids.shape[1]
    cache = sd.KVCache(c, S, L + BLOCK, torch.float32, dev)
    slots = torch.arange(S, device=dev)
    # context: every slot gets its sequence's context; the block (written at a..a+7) hides what lies beyond
    net.write_context(feats[rows], sd.Ctx(cache, slots, torch.zeros(S, dtype=torch.long, device=dev), L, "prefill"))
    off = torch.arange(BLOCK, device=dev)
    block_ids = torch.full((S, BLOCK), mask_id, device=dev)
    block_ids[:, 0] = ids[rows, a]
    x = target.embed_tokens(block_ids)                                               # [S, Q, H] (frozen)
    h = net(x, sd.Ctx(cache, slots, a, int(a.max()) + BLOCK, "prefill"))              # [S, Q, H]
    if method == "dflash":  # slot j >= 1 predicts x_{a+j}
        logits, labels, w = target.logits(h[:, 1:]), ids[rows[:, None], a[:, None] + off[1:]], off[1:]
    else:  # slot j predicts x_{a+j+1}; Markov bias from the true previous token x_{a+j}
        prev = ids[rows[:, None], a[:, None] + off]                                  # [S, Q]
        e1 = net.markov_head.markov_w1(prev)                                         # [S, Q, r]
        logits = target.logits(h) + net.markov_head.markov_w2(e1).float()
        labels, w = ids[rows[:, None], a[:, None] + off + 1], off + 1
    weight = torch.exp(-(w.float() - 1) / GAMMA)                                     # [Q']
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(S, -1)
    loss = (ce * weight).sum(1).mean() / weight.sum()
    right = (logits.argmax(-1) == labels).float()
    if method == "dspark" and net.confidence_head is not None:
        conf = net.confidence_head.proj(torch.cat([h, e1], -1)).squeeze(-1)
        loss = loss + F.binary_cross_entropy_with_logits(conf, right) * 0.1
    return loss, right.mean(0)


@torch.no_grad()
def greedy_corpus(target, tcfg, data, n_seq, prompt_len, gen_len, batch, device, generator):
    """n_seq random windows of prompt_len data tokens, each extended by the target's greedy continuation of
    gen_len tokens: per `batch` rows, the engine's prefill forward over the prompts, then one decode step per
    token (what Engine does at temperature 0, without stopping at EOS). -> LongTensor [n_seq, prompt_len + gen_len]
    on the CPU."""
    L = prompt_len + gen_len
    starts = torch.randint(0, len(data) - prompt_len + 1, (n_seq,), generator=generator)
    out = torch.empty(n_seq, L, dtype=torch.long)
    K.USE_TRITON = device.type == "cuda"  # the frozen target runs the kernels
    try:
        for i in range(0, n_seq, batch):
            s = starts[i:i + batch]
            B = len(s)
            ids = torch.stack([data[j:j + prompt_len] for j in s]).to(device)
            st = sd.State(tcfg, B, L, torch.float32, device)
            slots = torch.arange(B, device=device)
            h = target(ids, sd.Ctx(st, slots, torch.zeros(B, dtype=torch.long, device=device), prompt_len, "prefill"))
            tok = target.logits(h[:, -1]).argmax(-1)                                 # [B], at position prompt_len
            seq = [ids, tok[:, None]]
            for t in range(prompt_len, L - 1):  # feed the token at position t, get the one at t + 1
                pos = torch.full((B,), t, dtype=torch.long, device=device)
                h = target(tok[:, None], sd.Ctx(st, slots, pos, t + 1, "decode"))
                tok = target.logits(h[:, 0]).argmax(-1)
                seq.append(tok[:, None])
            out[i:i + B] = torch.cat(seq, 1).cpu()
    finally:
        K.USE_TRITON = False
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=os.path.join(ROOT, "models", "toy"))
    ap.add_argument("--out", default=os.path.join(ROOT, "models"))
    ap.add_argument("--seconds", type=float, default=420, help="training time for the drafters together")
    ap.add_argument("--seq-len", type=int, default=None, help="training sequence length (default 256; when "
                    "distilling it is --distill-prompt + --distill-gen, and must equal that if given)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--anchors", type=int, default=16, help="blocks per sequence")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-files", type=int, default=None)
    ap.add_argument("--distill-seqs", type=int, default=32768, help="sequences of the target's greedy "
                    "continuations to train on (self-distillation); 0: raw data windows as labels")
    ap.add_argument("--distill-prompt", type=int, default=16, help="data tokens of prompt per distilled sequence")
    ap.add_argument("--distill-gen", type=int, default=240, help="greedy target tokens generated per sequence")
    ap.add_argument("--distill-batch", type=int, default=2048, help="sequences generated at once")
    ap.add_argument("--distill-refresh", type=int, default=0, help="every this many steps, regenerate "
                    "--distill-batch random rows of the corpus (0: never)")
    ap.add_argument("--draft-layers", type=int, default=2, help="layers of the plain-Qwen3 draft LM written to "
                    "OUT/toy-draft (0: none)")
    ap.add_argument("--train", default="dflash,dspark,draft,mtp", help="which drafters to train (comma-separated); "
                    "mtp fine-tunes the target's MTP head in place (TARGET/model.safetensors, its mtp.* tensors)")
    ap.add_argument("--mtp-depth", type=int, default=3, help="MTP chain steps trained (1: the head alone, as "
                    "tools/train_toy.py trains it)")
    ap.add_argument("--mtp-lr", type=float, default=5e-4, help="the MTP head's peak learning rate (fine-tuning)")
    a = ap.parse_args(argv)
    distill = a.distill_seqs > 0
    if distill:
        if a.distill_prompt < 1 or a.distill_gen < BLOCK + 2:
            ap.error(f"--distill-prompt must be >= 1 and --distill-gen >= {BLOCK + 2} (anchors lie in the generated part)")
        if a.seq_len is not None and a.seq_len != a.distill_prompt + a.distill_gen:
            ap.error(f"--seq-len {a.seq_len} must equal --distill-prompt + --distill-gen = "
                     f"{a.distill_prompt + a.distill_gen} when distilling (or leave --seq-len out)")
        a.seq_len = a.distill_prompt + a.distill_gen
    elif a.seq_len is None:
        a.seq_len = 256
    K.USE_TRITON = False  # differentiable references for the drafters (the frozen target runs the kernels)
    K.CPU_FAST = False  # on a CPU too: the fast paths (oneDNN's packed linears) have no backward
    sd.block_attention = masked_block_attention
    K.attention = batched_attention
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    dev = torch.device(a.device)
    target, tcfg, tok = sd.load_model(a.target, torch.float32, dev)
    for p in target.parameters():
        p.requires_grad_(False)
    mask_id = tok.id_of("<|mask|>")
    root, files = stdlib_files()
    with open(os.path.join(os.path.dirname(a.target), "train_log.json")) as fh:
        held = set(json.load(fh)["held_out_files"])
    train_f = [f for f in split(files, root)[0] if os.path.relpath(f, root) not in held][:a.max_files]
    stream = []
    for t in (read(f) for f in train_f):
        if t:
            stream += tok.encode(t, allow_special=False) + [tok.id_of("<|endoftext|>")]
    data = torch.tensor(stream)
    print(f"[data] {len(train_f)} files, {len(data) / 1e6:.2f}M tokens", flush=True)
    which = set(a.train.split(","))
    if which - {"dflash", "dspark", "draft", "mtp"}:
        ap.error(f"--train: unknown {sorted(which - {'dflash', 'dspark', 'draft', 'mtp'})}")
    nets = {}
    for i, method in enumerate(m for m in ("dflash", "dspark") if m in which):
        path = os.path.join(a.out, f"toy-{method}")
        cfg = draft_config(method, tcfg, mask_id)
        save(path, cfg, init_weights(cfg, method, seed=i), torch.float32)
        nets[method] = build(path, method, dev) + (path, cfg)
    lm = None
    if a.draft_layers > 0 and "draft" in which:
        path = os.path.join(a.out, "toy-draft")
        cfg = lm_config(tcfg, a.draft_layers, tok.id_of("<|endoftext|>"))
        save(path, cfg, lm_init(cfg, target, seed=2), torch.float32)
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):  # a runnable model dir
            with open(os.path.join(a.target, f)) as src, open(os.path.join(path, f), "w") as dst:
                dst.write(src.read())
        lm = build_lm(path, dev) + (path, cfg)
    opts = {m: torch.optim.AdamW([p for p in n[0].parameters() if p.is_floating_point()], lr=a.lr,
                                 betas=(0.9, 0.95), weight_decay=0.0) for m, n in nets.items()}
    if lm is not None:
        opts["draft"] = torch.optim.AdamW(lm[0].parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    mtp = build_mtp(a.target, tcfg, dev) if "mtp" in which else None
    if mtp is not None:
        opts["mtp"] = torch.optim.AdamW(mtp.parameters(), lr=a.mtp_lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    L, B = a.seq_len, a.batch
    corpus, lo = None, 1  # lo: the first position an anchor may take
    if distill:
        gen = lambda n: greedy_corpus(target, tcfg, data, n, a.distill_prompt, a.distill_gen, a.distill_batch, dev, g)
        t1 = time.time()
        corpus, lo = gen(a.distill_seqs), a.distill_prompt
        print(f"[distill] {a.distill_seqs} sequences x ({a.distill_prompt} prompt + {a.distill_gen} greedy) tokens: "
              f"{a.distill_seqs * a.distill_gen:,} generated tokens in {time.time() - t1:.1f}s", flush=True)
    step, t0 = 0, time.time()
    while time.time() - t0 < a.seconds:
        frac = (time.time() - t0) / a.seconds
        lr = a.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * frac))
        if corpus is not None:
            if a.distill_refresh and step and step % a.distill_refresh == 0:
                n = min(a.distill_batch, len(corpus))
                corpus[torch.randperm(len(corpus), generator=g)[:n]] = gen(n)
            ids = corpus[torch.randint(0, len(corpus), (B,), generator=g)].to(dev)
        else:
            starts = torch.randint(0, len(data) - L - 1, (B,), generator=g)
            ids = torch.stack([data[s:s + L] for s in starts]).to(dev)
        with torch.no_grad():
            K.USE_TRITON = dev.type == "cuda"
            st = sd.State(tcfg, B, L, torch.float32, dev, mtp=mtp is not None)
            h, aux = target(ids, sd.Ctx(st, torch.arange(B, device=dev), torch.zeros(B, dtype=torch.long, device=dev),
                                        L, "prefill"), tuple(TAPS))
            feats = torch.cat(aux, -1)                                               # taps in layer order = TAPS
            K.USE_TRITON = False
        anchors = torch.randint(lo, L - BLOCK - 1, (B, a.anchors), generator=g).to(dev)
        row = {"step": step}
        for m, (net, c, _, _) in nets.items():
            loss, acc = block_loss(net, c, m, target, ids, feats, anchors, mask_id)
            opt_step(opts[m], net, loss, lr)
            row[m] = round(loss.item(), 3)
            row[m + "-acc"] = [round(x, 2) for x in acc.tolist()]
        if lm is not None:  # the draft LM: the target's next tokens from the tokens alone
            loss, acc = lm_loss(lm[0], lm[1], ids, max(lo, 1))
            opt_step(opts["draft"], lm[0], loss, lr)
            row["draft"], row["draft-acc"] = round(loss.item(), 3), round(acc.item(), 3)
        if mtp is not None:  # the target's MTP head, chained a.mtp_depth steps
            at = torch.randint(max(lo - 2, 0), L - a.mtp_depth - 1, (B, a.anchors), generator=g).to(dev)
            loss, acc = mtp_loss(mtp, target, tcfg, st, h, ids, lo, at, a.mtp_depth)
            opt_step(opts["mtp"], mtp, loss, lr * a.mtp_lr / a.lr)
            row["mtp"], row["mtp-acc"] = round(loss.item(), 3), [round(x.item(), 3) for x in acc]
        if step % 20 == 0:
            print(f"[train] {row}", flush=True)
        step += 1
    for m, (net, c, path, cfg) in nets.items():
        save(path, cfg, dict(net.named_parameters()), torch.bfloat16)
    if lm is not None:  # the checkpoint's names (model.*; the tied lm_head is the embedding)
        save(lm[2], lm[3], {"model." + n: p for n, p in lm[0].named_parameters()}, torch.bfloat16)
    if mtp is not None:
        save_mtp(mtp, a.target)
    wrote = [n[2] for n in nets.values()] + ([lm[2]] if lm is not None else []) + ([a.target] if mtp is not None else [])
    print(f"[done] {step} steps in {time.time() - t0:.0f}s; wrote " + ", ".join(wrote), flush=True)


if __name__ == "__main__":
    main()
