"""Paste the section files under _sections/ into specdec.py (development helper, removed once merged)."""
import os
import re
import sys
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
path = os.path.join(root, "specdec.py")
s = open(path).read()
for name, f in (("TOKENIZER", "tokenizer.py"), ("GGUF", "gguf_io.py")):
    if name not in sys.argv[1:]:
        continue
    lines = open(os.path.join(root, "_sections", f)).read().splitlines()
    i = next(i for i, l in enumerate(lines) if l.startswith("# ----"))
    body = f"#@@{name}-BEGIN@@\n" + "\n".join(lines[i:]).rstrip() + f"\n#@@{name}-END@@\n"
    if f"#@@{name}@@\n" in s:
        s = s.replace(f"#@@{name}@@\n", body)
    else:
        s = re.sub(rf"#@@{name}-BEGIN@@\n.*?#@@{name}-END@@\n", lambda m: body, s, flags=re.S)
open(path, "w").write(s)
