#!/usr/bin/env bash
# Mutation testing of specdec's core with mutmut (a tool to run by hand, not part of CI).
#
#     bash tools/mutation.sh [WORK_DIR]        # default /tmp/specdec-mutation; hours on 2 cores, run it with nohup
#     python tools/mutation_report.py [WORK_DIR]   # per-function scores, survivors, and the ones judged equivalent
#
# What is mutated (tools/mutation_functions.py): the verification (rejection_sample), the commit / rollback (GatedDeltaNet's
# verify-mode forward that stashes the per-token inputs, GatedDeltaNet.commit and Qwen36.commit that replay them,
# and the replay itself on the CPU: kernels.gdn_recurrent_gated / gdn_recurrent_ref / conv_window_ref), stop
# handling (Engine._emit), the ngram lookup, the MTP chain and its commit, and the speculative-config validation.
# mutmut writes every mutant of both files into WORK_DIR/mutants (one-time, ~10 minutes), records which selected
# test calls which function, then runs each mutant of FUNCTIONS against the tests that call its function (fastest
# first, stopping at the first failure), two at a time (--max-children).
#
# Which tests (TESTS below): the fast, relevant ones of test_specdec.py - the sampler's, the ngram cases, the
# spec-config errors, greedy speculation == plain decoding (logprobs too) on the predictable tiny target, the
# oracle's stops inside accepted runs, rollback against token-by-token decoding, the MTP chain against its
# step-by-step reference, the GDN kernels against their references, our logits against transformers, and the two
# sampled end-to-end tests. Not the server, the drafters, the GGUF and the toy model's tests (slow; they do not
# call these functions in ways the selected ones miss).
#
# The work is done in a copy of the tracked files (not the checkout): mutmut needs its own directory layout.
# mutmut 3.8 is pip-installed if missing. OMP_NUM_THREADS=1: mutmut forks workers from a process that has
# imported torch (forked OpenMP thread pools can hang), and two one-thread workers use the two cores.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-/tmp/specdec-mutation}"

mapfile -t FUNCTIONS < <(python "$ROOT/tools/mutation_functions.py")  # mutant-name patterns
TESTS="rejection_sampler or ngram_lookup or spec_config or greedy_spec_equals_plain or verify_commit_with_oracle \
or rollback or stops_inside or mtp_chain or gdn or causal_conv or logits_match_transformers or request_errors \
or test_sampled_"

python -c "import mutmut" 2>/dev/null || python -m pip install -q "mutmut==3.8.1"
mkdir -p "$WORK"
(cd "$ROOT" && git ls-files | grep -v '^models/' | tar -cf - -T -) | (cd "$WORK" && tar -xf -)
cat > "$WORK/setup.cfg" <<EOF
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
cd "$WORK"
export OMP_NUM_THREADS=1
mutmut run --max-children "${MAX_CHILDREN:-2}" "${FUNCTIONS[@]}"
python "$ROOT/tools/mutation_report.py" "$WORK"
