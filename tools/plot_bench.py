"""Plot bench.py results.

    python tools/plot_bench.py OUT.png LOG [LOG ...]                 aggregate tok/s against concurrency
    python tools/plot_bench.py --x prompt OUT.png LOG [LOG ...]      TPOT against prompt length (batch 1)

Each LOG is bench.py's output (its last JSON line is read); one panel per log, one line per method.
"""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out, logs, x="batch"):
    fig, axes = plt.subplots(1, len(logs), figsize=(6 * len(logs), 4.2), squeeze=False)
    for ax, log in zip(axes[0], logs):
        res = json.loads([l for l in open(log) if l.startswith("{")][-1])
        series = {}
        for r in res["rows"]:
            name = r["method"] if r["method"] == "off" else f"{r['method']} k={r['k']}"
            if x == "batch":
                series.setdefault(name, []).append((r["batch"], r["decode_tok_s_aggregate"]))
            elif r["batch"] == 1:
                series.setdefault(name, []).append((r["prompt_len"], r["tpot_ms"]))
        for name, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        xs = sorted({p[0] for pts in series.values() for p in pts})
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(v) for v in xs])
        ax.set_xlabel("concurrency (batch)" if x == "batch" else "prompt length (tokens), batch 1")
        ax.set_ylabel("aggregate tok/s" if x == "batch" else "TPOT (ms)")
        if x != "batch":
            ax.set_ylim(bottom=0)
        ax.set_title(f"{res['model']} ({res['dtype'].replace('torch.', '')}), synthetic acceptance")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    args = sys.argv[1:]
    x = "batch"
    if args[:1] == ["--x"]:
        x, args = args[1], args[2:]
    main(args[0], args[1:], x)
