#!/usr/bin/env bash
# One device call: GPU tests, then benchmark commands (each argument is one `bench.py` argument string).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
[ -n "$GPU_TESTS" ] && timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q test_specdec.py -k "$GPU_TESTS" 2>&1 | tail -25 | tee $OUT/gpu_tests.log
for args in "$@"; do
  echo "=== bench $args" | tee -a $OUT/bench.log
  eval timeout ${BENCH_TIMEOUT:-300} python3 bench.py $args 2>&1 | tail -14 | tee -a $OUT/bench.log
done
