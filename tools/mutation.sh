#!/usr/bin/env bash
# Mutation testing of specdec's core with mutmut (a tool to run by hand, not part of CI), one group at a time.
#
#     bash tools/mutation.sh [GROUP ...]            # default: every group; WORK (env) default /tmp/specdec-mutation
#     python tools/mutation_report.py [WORK]        # per-function scores, survivors, and the ones judged equivalent
#
# After adding tests against survivors, run just those again in a copy of their group (a run in place resets the
# group's other verdicts when mutmut sees new tests): cp -r WORK/GROUP RERUN/GROUP, copy test_specdec.py there, set
# its setup.cfg's -k to the group's current tests, `cd RERUN/GROUP && mutmut run NAME ...`; then
# `python tools/mutation_report.py WORK RERUN` takes the rerun's verdicts for those mutants.
#
# The groups (tools/mutation_functions.py): verify (rejection_sample), commit (the GDN verify that stashes each
# layer's per-token inputs, the commits that replay the accepted prefix, ModelRunner._spec_step that calls them,
# and the replay itself on the CPU: kernels.gdn_recurrent_gated / gdn_recurrent_ref / conv_window_ref), stops
# (Engine._emit, Engine._finish), ngram (ngram_lookup, NgramProposer.propose), mtp (the MTP chain, its commit,
# draft_noise / draft_pick), config (the speculative config's validation) and sampling (the logits processors,
# target_probs' filters, sample_from, greedy / synthetic verification, logprob_rows, SamplingParams.check). Each
# group has its own selection of fast, relevant tests (a -k expression): mutmut records which of them call which
# function, then runs each mutant against the tests that call its function, stopping at the first failure, two
# mutants at a time. A group's results stay in WORK/GROUP, so a group that was run is usable while the others run.
#
# The work is done in a copy of the tracked files (not the checkout): mutmut needs its own directory layout. In
# that copy every function outside the group gets "# pragma: no mutate block" on its header line (a comment), so
# mutmut generates, traces and runs only the group's mutants. mutmut 3.8 is pip-installed if missing.
# OMP_NUM_THREADS=1: mutmut forks workers from a process that has imported torch (forked OpenMP thread pools can
# hang), and two one-thread workers use two cores.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${WORK:-/tmp/specdec-mutation}"
FN="$ROOT/tools/mutation_functions.py"
SELECTED=("$@")
[ ${#SELECTED[@]} -gt 0 ] || mapfile -t SELECTED < <(python "$FN" groups)

python -c "import mutmut" 2>/dev/null || python -m pip install -q "mutmut==3.8.1"
export OMP_NUM_THREADS=1
for GROUP in "${SELECTED[@]}"; do
    DIR="$WORK/$GROUP"
    mapfile -t PATTERNS < <(python "$FN" patterns "$GROUP")
    TESTS="$(python "$FN" tests "$GROUP")"
    mkdir -p "$DIR"
    (cd "$ROOT" && git ls-files | grep -v '^models/' | tar -cf - -T -) | (cd "$DIR" && tar -xf -)
    python "$FN" mark "$GROUP" "$DIR"
    cat > "$DIR/setup.cfg" <<EOF
[mutmut]
source_paths =
    specdec.py
    kernels.py
also_copy =
    server.py
    bench.py
    README.md
    tools
pytest_add_cli_args_test_selection =
    test_specdec.py
    -k
    $TESTS
pytest_add_cli_args =
    -p
    no:cacheprovider
EOF
    echo "== $GROUP: $TESTS"
    (cd "$DIR" && time mutmut run --max-children "${MAX_CHILDREN:-2}" "${PATTERNS[@]}")
done
python "$ROOT/tools/mutation_report.py" "$WORK"
