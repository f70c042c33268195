"""Train a small byte-level BPE tokenizer in the Qwen3.5/3.6 tokenizer.json layout.

    python tools/make_tokenizer.py DIR [--vocab-size 1000]

NFC normalizer, the Qwen regex Split + ByteLevel pre-tokenizer, ByteLevel decoder, and Qwen-style
added tokens after the BPE vocabulary. Used for the tiny test checkpoints (on a few stdlib files).
"""
import json
import os
import sys
import sysconfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specdec import QWEN_PATTERN  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NONSPECIAL = ["<tool_call>", "</tool_call>", "<think>", "</think>"]  # special=false in Qwen3.5, like these
EXTRA_TEXT = [
    "Café naïve résumé – déjà vu; Ångström, Straße, İstanbul, ŞİŞLİ",
    "Cafe\u0301 nai\u0308ve re\u0301sume\u0301 (decomposed accents)",
    "中文分词测试：我们今天去公园散步。日本語のテキストも少し。한국어 문장도 있습니다.",
    "Emoji 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🚀✨",
    "Привет, мир! Ελληνικά γράμματα. العربية مرحبا. हिन्दी पाठ।",
    "numbers 1234567890 3.14159 1e-9 0x1F 1,000,000",
    "tabs\tand\t\tspaces    and\n\nnewlines\r\n\r\n   trailing   ",
]


def _corpus():
    stdlib = sysconfig.get_paths()["stdlib"]
    for name in ["textwrap.py", "json/decoder.py", "json/encoder.py", "string.py", "glob.py", "shlex.py"]:
        with open(os.path.join(stdlib, name), encoding="utf-8") as f:
            yield f.read()
    yield from EXTRA_TEXT * 20


def make_tiny_tokenizer(dirpath, vocab_size=1000, eos_token="<|im_end|>", corpus=None, extra_special=()):
    """Train the BPE and save tokenizer.json (+ tokenizer_config.json) into dirpath. Returns dirpath."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(models.BPE(unk_token=None, byte_fallback=False))
    hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(corpus if corpus is not None else _corpus(), trainer)
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL + list(extra_special)])
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in NONSPECIAL])
    os.makedirs(dirpath, exist_ok=True)
    hf.save(os.path.join(dirpath, "tokenizer.json"))
    if eos_token:
        with open(os.path.join(dirpath, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": eos_token, "add_bos_token": False}, f)
    return dirpath


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--vocab-size", type=int, default=1000)
    a = ap.parse_args()
    print(make_tiny_tokenizer(a.dir, a.vocab_size))
