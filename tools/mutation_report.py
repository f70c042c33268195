"""The mutation run's results (tools/mutation.sh), per group and function: killed, survived, equivalent, score.

    python tools/mutation_report.py [WORK_DIR [RERUN_DIR]]     (default /tmp/specdec-mutation)

RERUN_DIR: a copy of some groups' directories where survivors were run again (mutmut run NAME ...) after tests were
added; its verdicts replace WORK_DIR's for the mutants it ran (those with a verdict there).

Reads mutmut's results (WORK_DIR/GROUP/mutants/*.meta, for each group that was run) and its mutated sources,
shows each survivor as the line it changes, and matches survivors against tools/mutation_equivalent.txt: mutants
that cannot change what the code does (each with its reason), keyed by function and the changed line (before ->
after), not by mutmut's numbers, which move when the source does. Score = killed / (mutants - equivalent); timeouts
count as killed. Ends with one JSON line.
"""
import difflib
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from mutation_functions import GROUPS  # noqa: E402

STATUS = {1: "killed", 3: "killed", 0: "survived", 36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout",
          255: "timeout", 33: "no tests", 5: "no tests", None: "not run"}


def functions_in(path, prefix):
    """{name: source lines} of prefix's original and mutants in mutmut's generated file."""
    funcs, cur, indent = {}, None, 0
    pat = re.compile(r"^(\s*)def (" + re.escape(prefix) + r"__mutmut_(?:orig|\d+))\(")
    for line in open(path, encoding="utf-8").read().splitlines():
        m = pat.match(line)
        if m:
            cur, indent = m.group(2), len(m.group(1))
            funcs[cur] = [line]
        elif cur is not None:
            if line.strip() and len(line) - len(line.lstrip()) <= indent and not line.lstrip().startswith(")"):
                cur = None
            else:
                funcs[cur].append(line)
    return funcs


def change(funcs, prefix, name):
    """The mutant's changed lines as 'before -> after' (stripped, joined)."""
    orig = funcs[prefix + "__mutmut_orig"]
    body = [line.replace(name, prefix + "__mutmut_orig") for line in funcs[name]]
    diff = [d for d in difflib.unified_diff(orig, body, lineterm="", n=0)
            if d[:1] in "+-" and d[:3] not in ("+++", "---")]
    old = " ".join(d[1:].strip() for d in diff if d[0] == "-")
    new = " ".join(d[1:].strip() for d in diff if d[0] == "+")
    return f"{old} -> {new}"


def equivalents():
    """{(function, change): reason} from tools/mutation_equivalent.txt (blocks: 'function | change' then '  reason')."""
    out, key = {}, None
    for line in open(os.path.join(ROOT, "tools", "mutation_equivalent.txt"), encoding="utf-8"):
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith(" "):
            out[key] = (out.get(key, "") + " " + line.strip()).strip()
        else:
            fn, _, ch = line.rstrip("\n").partition(" | ")
            key = (fn.strip(), ch.strip())
            out[key] = ""
    return out


def main():
    work = sys.argv[1] if len(sys.argv) > 1 else "/tmp/specdec-mutation"
    rerun_dir = sys.argv[2] if len(sys.argv) > 2 else None
    eq, used, rows, survivors = equivalents(), set(), [], []
    runs = [(group, module, prefix, os.path.join(work, group, "mutants", module + ".py"))
            for group, spec in GROUPS.items() for module, prefixes in spec["functions"].items() for prefix in prefixes]
    for group, module, prefix, src in runs:
        if not os.path.exists(src + ".meta"):                                   # a group not run (yet)
            continue
        meta = json.load(open(src + ".meta"))["exit_code_by_key"]
        rerun = os.path.join(rerun_dir, group, "mutants", module + ".py.meta") if rerun_dir else ""
        if os.path.exists(rerun):
            meta.update({k: v for k, v in json.load(open(rerun))["exit_code_by_key"].items() if v is not None})
        funcs = functions_in(src, prefix)
        names = sorted((n for n in funcs if not n.endswith("orig")), key=lambda n: int(n.rsplit("_", 1)[1]))
        count = dict(killed=0, timeout=0, survived=0, equivalent=0, other=0)
        for name in names:
            status = STATUS.get(meta.get(f"{module}.{name}"), "other")
            if status == "survived":
                ch = change(funcs, prefix, name)
                key = (prefix, ch)
                if key in eq:
                    used.add(key)
                    status = "equivalent"
                else:
                    survivors.append((f"{module}.{name}", ch))
            count[status if status in count else "other"] += 1
        real = len(names) - count["equivalent"]
        score = (count["killed"] + count["timeout"]) / real if real else 1.0
        rows.append(dict(group=group, function=f"{module}.{prefix}", mutants=len(names), **count,
                         score=round(score, 4)))
    print(f"{'function':<46} {'mutants':>7} {'killed':>6} {'timeout':>7} {'equiv':>5} {'surv':>4} {'other':>5} "
          f"{'score':>6}")
    for r in rows:
        print(f"{r['function']:<46} {r['mutants']:>7} {r['killed']:>6} {r['timeout']:>7} {r['equivalent']:>5} "
              f"{r['survived']:>4} {r['other']:>5} {100 * r['score']:>5.1f}%")
    groups = {}
    for name in [r["group"] for r in rows] + ["all"]:
        part = [r for r in rows if name in ("all", r["group"])]
        tot = {k: sum(r[k] for r in part) for k in ("mutants", "killed", "timeout", "equivalent", "survived", "other")}
        real = tot["mutants"] - tot["equivalent"]
        tot["score"] = round((tot["killed"] + tot["timeout"]) / real, 4) if real else 1.0
        groups[name] = tot
    for name, tot in groups.items():
        print(f"{'group ' + name:<46} {tot['mutants']:>7} {tot['killed']:>6} {tot['timeout']:>7} "
              f"{tot['equivalent']:>5} {tot['survived']:>4} {tot['other']:>5} {100 * tot['score']:>5.1f}%")
    if survivors:
        print("\nsurvivors (neither killed nor listed as equivalent):")
        for name, ch in survivors:
            print(f"  {name}: {ch}")
    stale = [k for k in eq if k not in used]
    if stale:
        print(f"\n{len(stale)} entries of mutation_equivalent.txt matched no survivor (killed now, or the code moved)")
    print(json.dumps(dict(total=groups["all"], groups=groups, functions=rows, survivors=[n for n, _ in survivors])))


if __name__ == "__main__":
    main()
