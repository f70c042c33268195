"""Plot bench.py results: aggregate tok/s against concurrency, one line per method.

    python tools/plot_bench.py OUT.png LOG [LOG ...]

Each LOG is bench.py's output (its last JSON line is read); one panel per log.
"""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out, logs):
    fig, axes = plt.subplots(1, len(logs), figsize=(6 * len(logs), 4.2), squeeze=False)
    for ax, log in zip(axes[0], logs):
        res = json.loads([l for l in open(log) if l.startswith("{")][-1])
        series = {}
        for r in res["rows"]:
            name = r["method"] if r["method"] == "off" else f"{r['method']} k={r['k']}"
            series.setdefault(name, []).append((r["batch"], r["decode_tok_s_aggregate"]))
        for name, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.set_xlabel("concurrency (batch)")
        ax.set_ylabel("aggregate tok/s")
        ax.set_title(f"{res['model']} ({res['dtype'].replace('torch.', '')}), synthetic acceptance")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
