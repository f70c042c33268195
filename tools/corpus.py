"""The toy models' corpus: the Python standard library's .py files, split into train and held-out files by a hash
of their path (the same split everywhere: train_toy.py trains on it, train_drafters.py and eval_toy.py leave the
held-out files out)."""
import hashlib
import os
import sysconfig


def stdlib_files():
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, _, files in os.walk(root):
        if "site-packages" in d or "dist-packages" in d:
            continue
        out += [os.path.join(d, f) for f in files if f.endswith(".py")]
    return root, sorted(out)


def split(files, root):
    """Deterministic: a file is held out when the hash of its path relative to the stdlib is < 2%."""
    held = lambda f: int(hashlib.sha256(os.path.relpath(f, root).encode()).hexdigest(), 16) % 100 < 2
    return [f for f in files if not held(f)], [f for f in files if held(f)]


def read(f):
    try:
        with open(f, encoding="utf-8") as fh:
            return fh.read()
    except (UnicodeDecodeError, OSError):
        return None
