"""Plot bench.py results.

    python tools/plot_bench.py --all DIR [OUTDIR]                    every plot of BENCHMARKS.md from the logs that
                                                                     `bash tools/gpu_benchmarks.sh` writes in DIR
    python tools/plot_bench.py OUT.png LOG [LOG ...]                 aggregate tok/s against concurrency
    python tools/plot_bench.py --x prompt OUT.png LOG [LOG ...]      TPOT against prompt length (batch 1; the logs'
                                                                     rows in one panel)
    python tools/plot_bench.py --x speedup OUT.png LOG [LOG ...]     speed-up over off per method and k (batch 1, 8)
    python tools/plot_bench.py --x fp8 OUT.png BF16_LOG FP8_LOG      FP8 against bf16 weights: TPOT per row

Each LOG is bench.py's output (its last JSON line is read); one panel per log (prompt, fp8: one panel), one line
or bar group per method. --all writes, into OUTDIR (default: the repository root, where BENCHMARKS.md links them):
bench_tok_s_vs_concurrency.png (bench-27b.log, bench-35b.log, with the ngram rows of bench-27b-ngram.log and
bench-35b-ngram.log where they exist), bench_tpot_vs_prompt_len.png (bench-sweep.log and, if it exists,
bench-sweep-131072.log),
bench_speedup_per_method.png (bench-27b.log, bench-35b.log), bench_fp8_vs_bf16.png (bench-bf16-27b.log,
bench-fp8-27b.log: the `fp8` part); a plot whose logs are missing is skipped with a line saying so. No tensor
parallel plot: specdec runs on one GPU (tensor_parallel_size 1 only).
"""
import json
import os
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def result(log):
    """bench.py's last JSON line of a log: the run's settings and its rows."""
    return json.loads([line for line in open(log) if line.startswith("{")][-1])


def with_ngram(log):
    """A part's result, with the ngram rows of its run on the cyclic model (bench-<part>-ngram.log beside it, from
    gpu_benchmarks.sh) where that log exists; their "x off" is against that run's own off row."""
    res = result(log)
    extra = log[:-len(".log")] + "-ngram.log"
    if os.path.exists(extra):
        res = dict(res, rows=res["rows"] + [r for r in result(extra)["rows"] if r["method"] != "off"])
    return res


def label(r):
    return r["method"] if r["method"] == "off" else f"{r['method']} k={r['k']}"


def title(res):
    q = f", {res['quantization']} weights" if res.get("quantization") else ""
    return f"{res['model']} ({res['dtype'].replace('torch.', '')}{q}), synthetic acceptance"


def lines(ax, res, x):
    """One line per method: aggregate tok/s against batch, or TPOT against prompt length at batch 1."""
    series = {}
    for r in res["rows"]:
        if x == "batch":
            series.setdefault(label(r), []).append((r["batch"], r["decode_tok_s_aggregate"]))
        elif r["batch"] == 1:
            series.setdefault(label(r), []).append((r["prompt_len"], r["tpot_ms"]))
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


def bars(ax, groups, series, ylabel):
    """Grouped bars: series {name: [value per group]} side by side in each group."""
    width = 0.8 / max(1, len(series))
    for i, (name, vals) in enumerate(series.items()):
        ax.bar([g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))], vals, width, label=name)
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)


def speedup(ax, res):
    """speed-up over speculation off (same run, same batch) per method and k, at batch 1 and 8."""
    rows = [r for r in res["rows"] if r["method"] != "off"]
    names = list(dict.fromkeys(label(r) for r in rows))
    by = {(label(r), r["batch"]): r.get("speedup_vs_off") or 0.0 for r in rows}
    bars(ax, names, {f"batch {b}": [by.get((n, b), 0.0) for n in names] for b in (1, 8)}, "x speculation off")
    ax.axhline(1.0, color="grey", lw=0.8)


def fp8(ax, bf16, fp8_):
    """TPOT of the same rows (method, k, batch) with bf16 and with FP8 weights, from two runs."""
    def key(r):
        return f"{label(r)}, batch {r['batch']}"
    t16 = {key(r): r["tpot_ms"] for r in bf16["rows"]}
    t8 = {key(r): r["tpot_ms"] for r in fp8_["rows"]}
    names = [k for k in t8 if k in t16]
    bars(ax, names, {"bf16": [t16[n] for n in names], "fp8": [t8[n] for n in names]}, "TPOT (ms)")


def main(out, logs, x="batch"):
    if x == "fp8":
        fig, ax = plt.subplots(figsize=(7, 4.2))
        bf16, fp8_ = result(logs[0]), result(logs[1])
        fp8(ax, bf16, fp8_)
        prompt = fp8_["prompt_len"]
        prompt = ", ".join(map(str, prompt)) if isinstance(prompt, list) else prompt
        ax.set_title(f"{bf16['model']}: bf16 vs FP8 weights (prompt {prompt}), synthetic acceptance")
        axes = [ax]
    elif x == "prompt":
        fig, ax = plt.subplots(figsize=(6, 4.2))
        runs = [result(log) for log in logs]
        lines(ax, dict(runs[0], rows=[r for res in runs for r in res["rows"]]), x)
        ax.set_title(title(runs[0]))
        axes = [ax]
    else:
        fig, grid = plt.subplots(1, len(logs), figsize=(6 * len(logs), 4.2), squeeze=False)
        axes = grid[0]
        for ax, log in zip(axes, logs):
            res = with_ngram(log)
            speedup(ax, res) if x == "speedup" else lines(ax, res, x)
            ax.set_title(title(res))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


# (file, --x, the logs it needs, the logs it takes as well where they exist)
PLOTS = [("bench_tok_s_vs_concurrency.png", "batch", ["bench-27b.log", "bench-35b.log"], []),
         ("bench_tpot_vs_prompt_len.png", "prompt", ["bench-sweep.log"], ["bench-sweep-131072.log"]),
         ("bench_speedup_per_method.png", "speedup", ["bench-27b.log", "bench-35b.log"], []),
         ("bench_fp8_vs_bf16.png", "fp8", ["bench-bf16-27b.log", "bench-fp8-27b.log"], [])]


def all_plots(logdir, outdir=ROOT):
    for name, x, logs, optional in PLOTS:
        paths = [os.path.join(logdir, log) for log in logs]
        missing = [p for p in paths if not os.path.exists(p)]
        paths += [p for p in (os.path.join(logdir, log) for log in optional) if os.path.exists(p)]
        if missing:
            print(f"{name}: skipped (no {', '.join(missing)})")
        else:
            main(os.path.join(outdir, name), paths, x)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--all"]:
        all_plots(*args[1:3])
        sys.exit(0)
    x = "batch"
    if args[:1] == ["--x"] and len(args) > 1:
        x, args = args[1], args[2:]
    if len(args) < 2 or args[0].startswith("-") or x not in {kind for _, kind, _, _ in PLOTS}:
        sys.exit(__doc__)  # -h / --help, a missing log or an unknown --x: the usage above, no traceback
    main(args[0], args[1:], x)
