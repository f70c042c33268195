#!/usr/bin/env bash
# The H200 benchmark set behind BENCHMARKS.md, in one device call (outputs under $OUT).
#   bash tools/gpu_benchmarks.sh [27b] [35b] [sweep] [toy] [serve]      (default: all five; BENCHMARKS.md's tables)
#   bash tools/gpu_benchmarks.sh targets | drafters | mtp   (the issues' target rows at 256 tokens; retrain the toy's
#                                                           drafters, its MTP head: one device call each)
#   bash tools/gpu_benchmarks.sh fp8                  (FP8 weights: the FP8 issue's target rows, the same rows in bf16,
#                                                      MTP without the drafts' FP8 lm_head: its A/B)
#   bash tools/gpu_benchmarks.sh 27b-fp8 35b-fp8      (the 27b / 35b parts' rows with FP8 weights, no transformers)
#   bash tools/gpu_benchmarks.sh issues               (the open issues' rows: 18 at the tight length and at 32768,
#                                                      the toy's ngram / draft_model, 20's 35B-A3B rows; ~4 min)
#   bash tools/gpu_benchmarks.sh issue20              (issue 20's 35B-A3B rows alone, as in issues; ~1 min)
#   bash tools/gpu_benchmarks.sh serve-27b            (bench.py serve against server.py at the 27B shapes, random
#                                                      weights through --load-format dummy; off and MTP k=1; ~4 min)
#   bash tools/gpu_benchmarks.sh layouts              (published drafter layouts: DSpark in the speculators format
#                                                      on the 35B-A3B and DFlash in z-lab's on the 27B, batch 1
#                                                      and 8, with their draft time)
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
parts=${*:-27b 35b sweep toy serve}
MTP='"method":"mtp","rejection_sample_method":"synthetic"'
SYN='"rejection_sample_method":"synthetic","synthetic_acceptance_length":6.5'
# ngram / draft_model k=4: a flat conditional rate of 0.82 (vLLM wants non-increasing rates), whose mean acceptance
# length 3.50 is what both methods reach with real drafts on the shipped toy model (H200 bf16: 3.51 and 3.49)
NG='"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":2,"prompt_lookup_max":5,"rejection_sample_method":"synthetic","synthetic_acceptance_rates":[0.82,0.82,0.82,0.82]'
DM='"method":"draft_model","num_speculative_tokens":4,"rejection_sample_method":"synthetic","synthetic_acceptance_rates":[0.82,0.82,0.82,0.82]'

# bench.py serve (128 tokens a request) against server.py, started once without speculation and once with SPEC, at
# concurrency 1, 4 and 8 (PER x concurrency prompts): serve_rows NAME SPEC PER "SERVER ARGS" "BENCH ARGS"; logs
# $OUT/NAME.log, the servers' $OUT/server-NAME-off.log and -spec.log
serve_rows() {
  local name=$1 per=$3 server=($4) bench=($5) spec args pid c
  for spec in off "$2"; do
    args=(); [ "$spec" != off ] && args=(--speculative-config "$spec")
    python3 server.py "${server[@]}" --port 8123 "${args[@]}" \
      > $OUT/server-$name-$([ "$spec" = off ] && echo off || echo spec).log 2>&1 & pid=$!
    for i in $(seq 300); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8123/health')" 2>/dev/null && break; sleep 1; done
    for c in 1 4 8; do
      echo "=== $name spec=$spec concurrency=$c"
      timeout 150 python3 bench.py serve --url http://127.0.0.1:8123 --num-prompts $((c * per)) --max-concurrency $c \
        --gen-len 128 "${bench[@]}" --percentile-metrics ttft,tpot,itl,e2el 2>&1
    done
    kill $pid; wait $pid 2>/dev/null
  done 2>&1 | tee $OUT/$name.log
}
# issue 20's rows: the 35B-A3B off (true floor), verify cost, MTP k=1 and DFlash at batch 1 and 8
issue20_rows() {
  timeout 190 python3 bench.py --random-weights 35b-a3b --true-floor --batch 1 8 --prompt-len 512 --gen-len 128 \
    --random-drafter /tmp/drafters-35b --verify-cost 2 4 16 --speculative-config off \
    --speculative-config "{$MTP,\"num_speculative_tokens\":1,\"synthetic_acceptance_rates\":[0.85]}" \
    --speculative-config "{\"method\":\"dflash\",\"num_speculative_tokens\":15,$SYN}" 2>&1 | tee $OUT/bench-issue20.log | grep -v '^{'
}
for p in $parts; do case $p in
27b|35b|27b-fp8|35b-fp8)  # synthetic acceptance at the published rates, concurrency 1-8, every method, transformers
  # in the same run (bf16 only); the -fp8 parts: the same rows with --quantization fp8 (issue 27's FP8 table); ngram
  # in a second run (bench-<part>-ngram.log, below)
  m=${p%-fp8}; w=$([ $m = 27b ] && echo 27b || echo 35b-a3b); tf=(); [ $m = 35b ] && tf=(--true-floor)  # MoE floor
  q=(--hf-baseline); qn=(); [ $m != $p ] && q=(-q fp8) && qn=(-q fp8)
  timeout 560 python3 bench.py --random-weights $w --batch 1 2 4 8 --prompt-len 512 --gen-len 64 "${tf[@]}" "${q[@]}" \
    --random-drafter /tmp/drafters-$m --random-draft-lm /tmp/draft-lm-$m --verify-cost 2 4 16 \
    --speculative-config off \
    --speculative-config "{$MTP,\"num_speculative_tokens\":1,\"synthetic_acceptance_rates\":[0.85]}" \
    --speculative-config "{$MTP,\"num_speculative_tokens\":2,\"synthetic_acceptance_rates\":[0.85,0.82]}" \
    --speculative-config "{$MTP,\"num_speculative_tokens\":3,\"synthetic_acceptance_rates\":[0.85,0.82,0.82]}" \
    --speculative-config "{\"method\":\"dflash\",\"num_speculative_tokens\":15,$SYN}" \
    --speculative-config "{\"method\":\"dspark\",\"num_speculative_tokens\":16,$SYN}" \
    --speculative-config "{$DM}" 2>&1 | tee $OUT/bench-$p.log | grep -v '^{'
  # ngram on the model made cyclic (bench --cyclic): a random-weight model never repeats its random prompts, so there
  # ngram finds nothing to draft; with its own off row for the same-run ratio (the 35B's routing differs there, and
  # --true-floor counts experts on random prompts: left out)
  timeout 300 python3 bench.py --random-weights $w --cyclic --batch 1 2 4 8 --prompt-len 512 --gen-len 64 --no-floor \
    "${qn[@]}" --speculative-config off --speculative-config "{$NG}" 2>&1 | tee $OUT/bench-$p-ngram.log \
    | grep -v '^{' ;;
fp8)  # the FP8 issue's rows: --quantization fp8 on the random weights; its floor is every FP8 matrix through the FP8
      # kernel plus the bf16 ones through cuBLAS, in one CUDA graph (bench.gemm_floor)
  timeout 330 python3 bench.py --random-weights 27b -q fp8 --batch 1 8 --prompt-len 256 --gen-len 128 \
    --random-drafter /tmp/drafters-27b --verify-cost 2 16 --speculative-config off \
    --speculative-config "{$MTP,\"num_speculative_tokens\":1,\"synthetic_acceptance_rates\":[0.85]}" \
    --speculative-config "{\"method\":\"dflash\",\"num_speculative_tokens\":15,$SYN}" 2>&1 | tee $OUT/bench-fp8-27b.log | grep -v '^{'
  # the same MTP rows with the drafts through the bf16 lm_head (bench.py --no-draft-head): the FP8 copy's A/B
  timeout 120 python3 bench.py --random-weights 27b -q fp8 --batch 1 8 --prompt-len 256 --gen-len 128 --no-floor \
    --no-draft-head --speculative-config off \
    --speculative-config "{$MTP,\"num_speculative_tokens\":1,\"synthetic_acceptance_rates\":[0.85]}" 2>&1 \
    | tee $OUT/bench-fp8-27b-no-draft-head.log | grep -v '^{'
  timeout 100 python3 bench.py --random-weights 27b -q fp8 --batch 1 --prompt-len 4096 --gen-len 4 --no-floor 2>&1 | tee $OUT/bench-fp8-prefill-4096.log | grep -v '^{'
  timeout 100 python3 bench.py --random-weights 35b-a3b -q fp8 --batch 1 --prompt-len 256 --gen-len 128 --true-floor 2>&1 | tee $OUT/bench-fp8-35b.log | grep -v '^{'
  timeout 200 python3 bench.py --random-weights 27b --batch 1 8 --prompt-len 256 --gen-len 128 \
    --random-drafter /tmp/drafters-27b --speculative-config off \
    --speculative-config "{$MTP,\"num_speculative_tokens\":1,\"synthetic_acceptance_rates\":[0.85]}" \
    --speculative-config "{\"method\":\"dflash\",\"num_speculative_tokens\":15,$SYN}" 2>&1 | tee $OUT/bench-bf16-27b.log | grep -v '^{' ;;
issue20)  # issue 20's 35B-A3B rows alone (~1 min; fits one device call beside the gate)
  issue20_rows ;;
issues)  # issue 18 (ngram / draft_model at 0.82, tight and a user's max_model_len), its toy row, issue 20's rows
  for L in tight 32768; do
    a=(); [ $L != tight ] && a=(--max-model-len $L)
    timeout 250 python3 bench.py --random-weights 27b --cyclic --batch 1 8 --prompt-len 512 --gen-len 128 --no-floor \
      --random-draft-lm /tmp/draft-lm-27b --ngram-cost 8192 "${a[@]}" --speculative-config off \
      --speculative-config "{$NG}" --speculative-config "{$DM}" 2>&1 | tee $OUT/bench-issue18-$L.log | grep -v '^{'
  done
  timeout 100 python3 tools/eval_toy.py --speed --device cuda --dtype bfloat16 --gen 256 \
    --methods "ngram k=4" "draft_model k=4" 2>&1 | tee $OUT/eval-toy-issue18.log | grep -v '^{'
  issue20_rows ;;
layouts)  # issue 27: a random DSpark in the speculators format shaped like RedHatAI/Qwen3.6-35B-A3B-speculator.dspark
         # (block 8, reduced draft vocab 24576 with d2t; partly assumed: bench.py --help), k = 8 at the same synthetic
         # acceptance length as the DFlash / DSpark rows; "draft ms" is the drafter's time per step
  timeout 250 python3 bench.py --random-weights 35b-a3b --batch 1 8 --prompt-len 512 --gen-len 128 \
    --random-drafter /tmp/drafters-35b --drafter-layout speculators --speculative-config off \
    --speculative-config "{\"method\":\"dspark\",\"num_speculative_tokens\":8,$SYN}" 2>&1 | tee $OUT/bench-35b-speculators.log | grep -v '^{'
  # and a random DFlash in z-lab's layout shaped like z-lab/Qwen3.6-27B-DFlash (4 sliding-window layers of 2048
  # keys and 1 full, block 16), beside the 27B's off row
  timeout 250 python3 bench.py --random-weights 27b --batch 1 8 --prompt-len 512 --gen-len 128 \
    --random-drafter /tmp/drafters-27b --drafter-layout zlab --speculative-config off \
    --speculative-config "{\"method\":\"dflash\",\"num_speculative_tokens\":15,$SYN}" 2>&1 | tee $OUT/bench-27b-zlab.log | grep -v '^{' ;;
targets)  # the rows the GPU and drafter issues set targets on, with 256 tokens per request (less acceptance noise)
  timeout 400 python3 bench.py --random-weights 27b --batch 1 8 --prompt-len 512 --gen-len 256 \
    --random-drafter /tmp/drafters-27b --verify-cost 2 16 --speculative-config off \
    --speculative-config "{$MTP,\"num_speculative_tokens\":1,\"synthetic_acceptance_rates\":[0.85]}" \
    --speculative-config "{\"method\":\"dflash\",\"num_speculative_tokens\":15,$SYN}" \
    --speculative-config "{\"method\":\"dspark\",\"num_speculative_tokens\":16,$SYN}" 2>&1 | tee $OUT/bench-targets-27b.log | grep -v '^{'
  timeout 100 python3 bench.py --random-weights 27b --batch 1 --prompt-len 4096 --gen-len 4 --no-floor 2>&1 | tee $OUT/bench-prefill-4096.log | grep -v '^{'
  timeout 150 python3 bench.py --random-weights 35b-a3b --batch 1 --prompt-len 512 --gen-len 256 --true-floor 2>&1 | tee $OUT/bench-targets-35b.log | grep -v '^{'
  timeout 90 python3 tools/profile_step.py --draft-lm 1 8 2>&1 | tee $OUT/draft-lm.log | grep -v '^loading' ;;
drafters)  # retrain the toy's DFlash / DSpark drafters and its draft LM (tools/train_drafters.py, as shipped in
           # session 22; ~8 min) and evaluate every method on the GPU; the models come back under $OUT/m
  timeout 560 python3 tools/train_drafters.py --train dflash,dspark,draft 2>&1 | tee $OUT/train-drafters.log | tail -2
  for d in toy-dflash toy-dspark toy-draft; do mkdir -p $OUT/m/$d; cp models/$d/config.json models/$d/model.safetensors $OUT/m/$d/; done
  timeout 120 python3 tools/eval_toy.py --device cuda --dtype bfloat16 --prompts 8 --gen 256 2>&1 | tee $OUT/eval-toy-gpu.log | grep -v '^{' ;;
mtp)  # fine-tune the toy's MTP head chained (tools/train_drafters.py --train mtp, as shipped in session 22; ~4 min):
      # its mtp.* tensors come back as $OUT/mtp.safetensors (the whole checkpoint is over the 16 MiB a file)
  timeout 330 python3 tools/train_drafters.py --train mtp --seconds 180 2>&1 | tee $OUT/train-mtp.log | tail -2
  python3 -c "from safetensors.torch import load_file, save_file; import sys; w = load_file('models/toy/model.safetensors'); save_file({k: v for k, v in w.items() if k.startswith('mtp.')}, sys.argv[1])" $OUT/mtp.safetensors
  timeout 120 python3 tools/eval_toy.py --device cuda --dtype bfloat16 --prompts 8 --gen 256 --methods "mtp k=1" "mtp k=3" 2>&1 | tee $OUT/eval-toy-mtp.log | grep -v '^{' ;;
sweep)  # TPOT against prompt length, batch 1: speculation off, MTP k=1 / 3 and DFlash (27B); 131072 apart (its
        # prefill alone takes a while, and a failure there keeps the shorter rows)
  for L in "512 2048 8192 32768" 131072; do
    d=(); [ "$L" = 131072 ] && d=(--no-draft-time)  # (each 131072-token prefill takes ~38 s: two a row, not four)
    timeout 400 python3 bench.py --random-weights 27b --batch 1 --prompt-len $L --gen-len 32 --no-floor "${d[@]}" \
      --random-drafter /tmp/drafters-27b --speculative-config off \
      --speculative-config "{$MTP,\"num_speculative_tokens\":1,\"synthetic_acceptance_rates\":[0.85]}" \
      --speculative-config "{$MTP,\"num_speculative_tokens\":3,\"synthetic_acceptance_rates\":[0.85,0.82,0.82]}" \
      --speculative-config "{\"method\":\"dflash\",\"num_speculative_tokens\":15,$SYN}" \
      2>&1 | tee $OUT/bench-sweep$([ "$L" = 131072 ] && echo -131072).log | grep -v '^{'
  done ;;
toy)  # the shipped model: real acceptance, bf16 on the GPU, and each method's batch-1 speed against off (--speed)
  timeout 300 python3 tools/eval_toy.py --speed --device cuda --dtype bfloat16 --prompts 8 --gen 256 2>&1 | tee $OUT/eval-toy-gpu.log | grep -v '^{'
  timeout 200 python3 bench.py --model models/toy --batch 1 2 4 8 --prompt-len 128 --gen-len 128 \
    --speculative-config off --speculative-config '{"method":"mtp","num_speculative_tokens":1}' \
    --speculative-config '{"method":"mtp","num_speculative_tokens":3}' \
    --speculative-config '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":2}' \
    --speculative-config '{"method":"draft_model","model":"models/toy-draft","num_speculative_tokens":4}' \
    --speculative-config '{"method":"dflash","model":"models/toy-dflash","num_speculative_tokens":7}' \
    --speculative-config '{"method":"dspark","model":"models/toy-dspark","num_speculative_tokens":8}' \
    2>&1 | tee $OUT/bench-toy.log | grep -v '^{' ;;
serve)  # bench.py serve against server.py on the toy model, with and without MTP
  serve_rows serve-toy '{"method":"mtp","num_speculative_tokens":3}' 8 "--model models/toy" "--prompt-len 128" ;;
serve-27b)  # bench.py serve against server.py at the 27B shapes: --load-format dummy on bench.py --write-config's
  # directory (random weights, the toy's tokenizer), off and MTP k=1 at a synthetic 0.85, prompt 512, 128 tokens
  python3 bench.py --write-config 27b /tmp/q27 > /dev/null
  serve_rows serve-27b "{$MTP,\"num_speculative_tokens\":1,\"synthetic_acceptance_rates\":[0.85]}" 4 \
    "--model /tmp/q27 --load-format dummy --max-model-len 4096" "--prompt-len 512 --ignore-eos" ;;
esac; done
# the plots of BENCHMARKS.md from whichever of their logs this run wrote (tools/plot_bench.py --all; needs matplotlib)
if python3 -c "import matplotlib" 2>/dev/null; then python3 tools/plot_bench.py --all $OUT $OUT | grep -v skipped || true; fi
