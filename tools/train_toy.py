"""Train the small Qwen3.6-architecture model family that ships in models/ (one H200, a few minutes).

    python tools/train_toy.py --out models --seconds 330 --drafter-seconds 420     # everything in models/

Data: the Python standard library's source on this machine (sysconfig stdlib, site-packages excluded), split
by a hash of each file's path: 2% of files are held out for evaluation. Tokenizer: an 8k byte-level BPE in
the Qwen tokenizer.json layout (tools/make_tokenizer.py) with <|endoftext|>, <|im_start|>, <|im_end|> and a
<|mask|> token for block drafters. Trained for --seconds:
  toy/        the target: Qwen3.6 dense hybrid (GDN + gated attention 3:1), ~11.7M parameters, with an MTP head
              trained jointly (loss on x_{t+2} from (h_t, x_{t+1})); multimodal layout, bf16 safetensors
then, against the finished target, its drafters by self-distillation (tools/train_drafters.py, --drafter-seconds;
0 skips them):
  toy-dflash/, toy-dspark/, toy-draft/ (method draft_model: a 2-layer plain Qwen3 LM; until session 22 a
  ~1M-parameter hybrid of the target's family trained here beside it on the raw data)
The engine's own modules are trained (through its inference forward with a fresh State per batch, PyTorch
reference kernels), so what ships is exactly what runs.
"""
import argparse
import json
import math
import os
import shlex
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import kernels as K  # noqa: E402
import specdec as sd  # noqa: E402
from corpus import read, split, stdlib_files  # noqa: E402
from make_tokenizer import make_tiny_tokenizer  # noqa: E402

TARGET = dict(hidden_size=256, num_hidden_layers=8, intermediate_size=1024, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=64, linear_value_head_dim=64, mtp_num_hidden_layers=1)


def text_config(shape, vocab, eos):
    layers = shape["num_hidden_layers"]
    return dict(shape, model_type="qwen3_5_text", vocab_size=vocab, hidden_act="silu", rms_norm_eps=1e-6,
                layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
                full_attention_interval=4, linear_conv_kernel_dim=4, max_position_embeddings=4096,
                tie_word_embeddings=True, attn_output_gate=True, attention_bias=False, eos_token_id=eos,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True},
                mtp_use_dedicated_embeddings=False, mamba_ssm_dtype="float32", dtype="bfloat16")


def init_model(cfg, device, seed):
    torch.manual_seed(seed)
    model = sd.Qwen36(cfg).to(device)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        with torch.no_grad():
            if leaf == "A_log":
                p.copy_(torch.log(torch.empty_like(p).uniform_(1, 16)))
            elif leaf == "dt_bias":
                p.copy_(torch.log(torch.expm1(torch.empty_like(p).uniform_(1e-3, 1e-1))))  # softplus^-1 of dt
            elif name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()
            elif name.endswith("conv1d.weight"):
                p.normal_(0, 0.2)
            else:
                p.normal_(0, 0.02)
    return sd.init_rope(model, device)


def forward_loss(model, ids, mtp_weight=0.0):
    """Next-token loss (and the MTP loss on x_{t+2}) through the engine's own prefill forward."""
    B, L = ids.shape
    cfg = model.cfg
    st = sd.State(cfg, B, L, torch.float32, ids.device, mtp=model.mtp is not None)
    ctx = sd.Ctx(st, torch.arange(B, device=ids.device), torch.zeros(B, dtype=torch.long, device=ids.device), L,
                 "prefill")
    h = model(ids, ctx)
    loss = F.cross_entropy(model.logits(h[:, :-1]).reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    if mtp_weight and model.mtp is not None:
        u = model.mtp(model.embed_tokens(ids[:, 1:-1]), h[:, :-2], sd.Ctx(st, ctx.slots, ctx.pos, L, "decode"))
        mtp = F.cross_entropy(model.logits(u).reshape(-1, cfg.vocab_size), ids[:, 2:].reshape(-1))
        return loss + mtp_weight * mtp, loss.detach(), mtp.detach()
    return loss, loss.detach(), None


def export(model, cfg_dict, path, tok_dir, wrapper=True):
    """Our parameter names -> the published layout (multimodal wrapper: model.language_model.*, mtp.*)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    w = {}
    for name, p in model.named_parameters():
        key = name if name.startswith("mtp.") else ("model.language_model." if wrapper else "model.") + name
        w[key] = p.detach().to(torch.float32 if name.endswith("A_log") else torch.bfloat16).cpu().contiguous()
    save_file(w, os.path.join(path, "model.safetensors"))
    top = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": cfg_dict,
           "tie_word_embeddings": True} if wrapper else dict(cfg_dict, architectures=["Qwen3_5ForCausalLM"])
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(top, fh, indent=1)
    for f in ("tokenizer.json", "tokenizer_config.json") if os.path.abspath(tok_dir) != os.path.abspath(path) else ():
        with open(os.path.join(tok_dir, f)) as src, open(os.path.join(path, f), "w") as dst:
            dst.write(src.read())
    tj = json.load(open(os.path.join(tok_dir, "tokenizer.json")))
    ids = {t["content"]: t["id"] for t in tj["added_tokens"]}
    with open(os.path.join(path, "generation_config.json"), "w") as fh:
        json.dump({"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "do_sample": False}, fh)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "models"))
    ap.add_argument("--seconds", type=float, default=300, help="training time budget (both models together)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-files", type=int, default=None, help="use only this many training files (smoke tests)")
    ap.add_argument("--drafter-args", default="", help="more tools/train_drafters.py arguments, e.g. a small "
                    "'--distill-seqs 8 --distill-gen 32' for a CPU smoke run")
    ap.add_argument("--drafter-seconds", type=float, default=420, help="then train the drafters "
                    "(tools/train_drafters.py) this long; 0: skip")
    a = ap.parse_args()
    K.USE_TRITON = False  # training runs the differentiable PyTorch references
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = torch.device(a.device)
    t0 = time.time()
    root, files = stdlib_files()
    train_f, held_f = split(files, root)
    train_f = train_f[:a.max_files] if a.max_files else train_f
    texts = [t for t in (read(f) for f in train_f) if t]
    tok_dir = os.path.join(a.out, "toy")
    make_tiny_tokenizer(tok_dir, vocab_size=8192, corpus=texts, extra_special=["<|mask|>"])
    tok = sd.Tokenizer.from_dir(tok_dir)
    eos = tok.id_of("<|endoftext|>")
    stream = []
    for t in texts:
        stream += tok.encode(t, allow_special=False) + [eos]
    data = torch.tensor(stream, dtype=torch.long)
    held = []
    for t in (read(f) for f in held_f):
        held += tok.encode(t, allow_special=False) + [eos] if t else []
    held = torch.tensor(held, dtype=torch.long)
    vocab = (tok.vocab_size + 63) // 64 * 64
    print(f"[data] {len(train_f)} train files, {len(held_f)} held-out; {len(data) / 1e6:.1f}M train tokens, "
          f"{len(held) / 1e3:.0f}k held-out; vocab {tok.vocab_size} -> {vocab} rows; {time.time() - t0:.0f}s", flush=True)
    cfgs = {"toy": text_config(TARGET, vocab, eos)}
    models = {n: init_model(sd.ModelConfig.from_dict(c), dev, seed=i) for i, (n, c) in enumerate(cfgs.items())}
    for n, m in models.items():
        print(f"[model] {n}: {sum(p.numel() for p in m.parameters()) / 1e6:.2f}M parameters", flush=True)
    opts = {n: torch.optim.AdamW(m.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1) for n, m in models.items()}
    g = torch.Generator().manual_seed(0)
    L, B = a.seq_len, a.batch
    step, t_start, log = 0, time.time(), []
    while time.time() - t_start < a.seconds:
        frac = (time.time() - t_start) / a.seconds
        lr = a.lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * frac))
        starts = torch.randint(0, len(data) - L - 1, (B,), generator=g)
        ids = torch.stack([data[s:s + L] for s in starts]).to(dev)
        row = {"step": step, "t": round(time.time() - t_start, 1)}
        for n, m in models.items():
            for pg in opts[n].param_groups:
                pg["lr"] = lr
            loss, main_loss, mtp_loss = forward_loss(m, ids, mtp_weight=0.5)
            opts[n].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opts[n].step()
            row[n] = round(main_loss.item(), 4) if step % 25 == 0 else None
            if mtp_loss is not None and step % 25 == 0:
                row[n + "-mtp"] = round(mtp_loss.item(), 4)
        if step % 25 == 0:
            log.append(row)
            print(f"[train] {row}", flush=True)
        step += 1
    # held-out loss
    ev = {}
    with torch.no_grad():
        n_eval = min(len(held) // L, 64)
        ids = held[:n_eval * L].view(n_eval, L).to(dev)
        for n, m in models.items():
            losses = [forward_loss(m, ids[i:i + 8], mtp_weight=0.5) for i in range(0, n_eval, 8)]
            ev[n] = sum(x[1].item() for x in losses) / len(losses)
            if losses[0][2] is not None:
                ev[n + "-mtp"] = sum(x[2].item() for x in losses) / len(losses)
    print(f"[eval] held-out loss (nats/token): {ev}", flush=True)
    for n, m in models.items():
        export(m, cfgs[n], os.path.join(a.out, n), tok_dir)
    with open(os.path.join(a.out, "train_log.json"), "w") as fh:
        json.dump({"steps": step, "seconds": a.seconds, "seq_len": L, "batch": B, "held_out_loss": ev,
                   "train_tokens": len(data), "held_out_tokens": len(held), "held_out_files":
                   [os.path.relpath(f, root) for f in held_f], "log": log}, fh, indent=1)
    print(f"[done] {step} steps in {time.time() - t0:.0f}s total; wrote {a.out}/toy", flush=True)
    if a.drafter_seconds > 0:
        import train_drafters
        train_drafters.main(["--target", os.path.join(a.out, "toy"), "--out", a.out, "--seconds", str(a.drafter_seconds),
                             "--device", a.device] + (["--max-files", str(a.max_files)] if a.max_files else [])
                            + shlex.split(a.drafter_args))


if __name__ == "__main__":
    main()
