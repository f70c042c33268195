#!/usr/bin/env bash
# The GPU gate: one device call on the H200 (an H100 80GB runs it too), under 10 minutes. A change to kernels.py or specdec.py lands only with
# a GPU_VERIFIED that this script wrote for exactly those files (README, "Development").
#   bash tools/gpu_check.sh            (in the repository root on the GPU machine; logs and GPU_VERIFIED under $OUT)
# 1. the first-run snippet: MTP on the shipped model, bf16, CUDA graphs (64 tokens);
# 2. every `gpu` test in test_specdec.py and every kernel test, compiled for the GPU (pytest -k "gpu or kernel";
#    in 8 processes when pytest-xdist is importable);
# 3. the losslessness sweep (tools/lossless_sweep.py): every method == speculation off on the shipped model; and
#    again (shorter) on the attention's long-cache path (--long-cache: more key pieces than programs);
# 4. losslessness at the real shapes (tools/invariance_check.py): random bf16 27B / 35B-A3B weights, speculation off
#    batched and every model-free / random-drafter method alone and batched == speculation off alone;
# 5. FP8 weights (--quantization fp8): the sweep of 3 on the FP8 toy model, the check of 4 on the FP8 27B and 35B-A3B.
# On success it writes GPU_VERIFIED: date, GPU, versions, the summary lines, sha256 of kernels.py and specdec.py.
# The GPU image has no xgrammar (the sweeps' JSON-schema requests need it): `bash tools/fetch_wheels.sh` here
# downloads its wheels into .whl/, and the device call carries .whl; this script installs them first.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
if ! python3 -c "import xgrammar" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -c "import xgrammar" 2>/dev/null; then  # fail at once, not after the tests (README, "Development")
  echo "FAIL: xgrammar cannot be imported: run 'bash tools/fetch_wheels.sh' on the CPU machine and carry .whl"; exit 1
fi
hashes=$(sha256sum kernels.py specdec.py)             # the files as checked (before anything runs)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
versions=$(python3 -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')")
echo "$gpu; $versions"
t0=$(date +%s); ok=1

echo "== 1. snippet"
timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/snippet.log" || ok=0
from specdec import LLM, SamplingParams
llm = LLM(model="models/toy", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
out = llm.generate(["def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n"],
                   SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0].outputs[0]
print(repr(out.text))
print(f"snippet: {len(out.token_ids)} tokens; {llm.engine.stats.summary()}")
assert len(out.token_ids) == 64
PY
snippet=$(grep -o '^snippet: [0-9]* tokens; SpecDecoding metrics: Mean acceptance length: [0-9.]*' "$OUT/snippet.log")

echo "   ($(( $(date +%s) - t0 )) s so far)"; echo "== 2. pytest -k 'gpu or kernel'"
# with pytest-xdist (carried as a wheel, README), 8 processes share the GPU: Triton's compiles, most of this
# step's time, run side by side (H200: 53 s instead of 238)
par=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider test_specdec.py -k "gpu or kernel" $par \
  > "$OUT/gpu_tests.log" 2>&1 || ok=0
tail -15 "$OUT/gpu_tests.log"
tests=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$OUT/gpu_tests.log" | tail -1 | tr -d '=' | xargs)

echo "   ($(( $(date +%s) - t0 )) s so far)"; echo "== 3. losslessness sweep"
timeout ${SWEEP_TIMEOUT:-300} python3 tools/lossless_sweep.py > "$OUT/sweep.log" 2>&1 || ok=0
grep -v '^{' "$OUT/sweep.log" | tail -20
sweep=$(grep '^lossless sweep:' "$OUT/sweep.log")

echo "   ($(( $(date +%s) - t0 )) s so far)"; echo "== 3b. the sweep with the attention's long-cache path (small key pieces)"
timeout ${SWEEP_TIMEOUT:-300} python3 tools/lossless_sweep.py --long-cache --prompts 8 --gen 128 \
  --methods "mtp k=3" "ngram k=4" "draft_model k=4" "dflash k=7" "dspark k=8" > "$OUT/sweep-long.log" 2>&1 || ok=0
grep -v '^{' "$OUT/sweep-long.log" | tail -8
sweepl=$(grep '^lossless sweep:' "$OUT/sweep-long.log" | sed 's/^lossless sweep:/long-cache sweep:/')

echo "   ($(( $(date +%s) - t0 )) s so far)"; echo "== 4. real-shape invariance check"
timeout ${INVARIANCE_TIMEOUT:-240} python3 tools/invariance_check.py > "$OUT/invariance.log" 2>&1 || ok=0
grep -v '^{' "$OUT/invariance.log" | tail -20
inv=$(grep '^invariance check:' "$OUT/invariance.log")

echo "   ($(( $(date +%s) - t0 )) s so far)"; echo "== 5. FP8 weights: the sweep and the real-shape check"
timeout ${SWEEP_TIMEOUT:-300} python3 tools/lossless_sweep.py -q fp8 --gen 128 > "$OUT/sweep-fp8.log" 2>&1 || ok=0
grep -v '^{' "$OUT/sweep-fp8.log" | tail -12
sweep8=$(grep '^lossless sweep:' "$OUT/sweep-fp8.log")
timeout ${INVARIANCE_TIMEOUT:-240} python3 tools/invariance_check.py -q fp8 --prompts 4 --gen 32 > "$OUT/invariance-fp8.log" 2>&1 || ok=0
grep -v '^{' "$OUT/invariance-fp8.log" | tail -20
inv8=$(grep '^invariance check:' "$OUT/invariance-fp8.log")

secs=$(( $(date +%s) - t0 ))
summary="gpu_check: ${snippet:-snippet failed}; tests: ${tests:-none}; ${sweep:-sweep failed}; \
${sweepl:-long-cache sweep failed}; ${inv:-invariance check failed}; ${sweep8:-FP8 sweep failed}; \
${inv8:-FP8 invariance check failed}; ${secs} s"
echo "$summary"
if [ $ok = 1 ] && [ -n "$sweep" ] && [ -n "$sweepl" ] && [ -n "$inv" ] && [ -n "$sweep8" ] && [ -n "$inv8" ]; then
  { echo "GPU-verified $(date -u +%Y-%m-%dT%H:%MZ) on $gpu ($versions)"
    echo "$summary"
    echo "$hashes"; } > GPU_VERIFIED
  cp GPU_VERIFIED "$OUT/"
  echo "PASS: GPU_VERIFIED written"
else
  echo "FAIL: no GPU_VERIFIED written"; exit 1
fi
