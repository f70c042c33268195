#!/usr/bin/env bash
# One device call: GPU tests, then the offline benchmarks of issue 4. Logs under $OUT (device tool).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 150 python3 -m pytest -q -x test_specdec.py -k "gpu or transformers or spec_equals" 2>&1 | tail -15 | tee $OUT/gpu_tests.log
[ -n "$KTEST" ] && [ -f _sections/test_kernels.py ] && timeout 120 python3 -m pytest -q _sections/test_kernels.py 2>&1 | tail -8 | tee $OUT/kernel_tests.log
for args in "$@"; do
  echo "=== bench $args"
  eval timeout 240 python3 bench.py $args 2>&1 | tail -6 | tee -a $OUT/bench.log
done
