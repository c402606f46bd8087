#!/usr/bin/env bash
# The project's GPU check, one prepared script for a lent GPU machine (torch 2.11 and its Triton there, no package
# registry). Expected 3-5 minutes on an H200 with a warm Triton cache; a cold cache compiles every specialization
# first (tens of seconds per kernel family), so the step timeouts are generous and add up to more than the 600 s of
# one device command: run it as two calls, the second within the machine's idle window (its Triton cache stays):
#   OUT=$OUT STAGES="1 2" bash benchmarks/gpu_check.sh      (timeouts 300 + 120 s)
#   OUT=$OUT STAGES="3 4" bash benchmarks/gpu_check.sh      (timeouts 200 + 2 x 130 + 120 s)
# Each call writes its own $OUT (fetch both); results.md of the second holds the tables. The stages:
#   1. the COMPILED kernels against the PyTorch references (tests/kernels on CUDA; RNE bit-exactness included),
#   2. ShardedAdamW steps under torch.cuda.set_sync_debug_mode("error") (step() never waits on the host),
#   3. the microbenchmark table (1M..256M elements) and the end-to-end step at 125M and 1B parameters,
#   4. the training example (the project's main job) on the GPU: loss after 300 steps, tokens/s (16 sequences x 4
#      micro-batches on one rank: the global batch of `make train`'s 2 ranks x 16 x 2, so the loss compares with
#      the CPU figure in the README).
#
# The lent H200 image has pytest and hypothesis (device/KINDS.md, 2026-11). Where a machine lacks them, install them
# here into .gpu_deps (git-ignored, on PYTHONPATH below) and carry that folder:
#   pip install --target .gpu_deps pytest hypothesis ; device run: carry [".gpu_deps"]
# Without STAGES every stage runs (CI on CPU, or a GPU with a warm cache and time to spare).
#
# Knobs (CI runs this script on CPU with small values, so it cannot rot between GPU runs): PY (the interpreter;
# the GPU image has python3, maybe no python), TESTS (pytest targets), BENCH_ARGS (extra benchmarks.run
# arguments), MODELS (benchmarks.step models), STEP_ARGS (extra benchmarks.step arguments), TRAIN_STEPS (steps of
# the training example), TRAIN_ARGS (extra training-example arguments), STAGES (which of 1-4 to run).
# Everything it writes lands in $OUT (default benchmarks/out/gpu): logs, results.csv/json, plots, results.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/.gpu_deps${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
TESTS=${TESTS:-tests/kernels}
BENCH_ARGS=${BENCH_ARGS:-}
MODELS=${MODELS:-125M 1B}
TRAIN_STEPS=${TRAIN_STEPS:-300}
STEP_ARGS=${STEP_ARGS:-}
TRAIN_ARGS=${TRAIN_ARGS:-}
STAGES=" ${STAGES:-1 2 3 4} "
stage() { [[ "$STAGES" == *" $1 "* ]]; }
status=0
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/env.txt"
if stage 1; then
  echo "== 1. compiled kernels vs references"
  # every failure is wanted (a GPU run is rare): no -x; the full log in $OUT, its tail here
  timeout 300 $PY -m pytest -q -rf -p no:cacheprovider $TESTS > "$OUT/kernel_tests.log" 2>&1 || status=1
  tail -n 40 "$OUT/kernel_tests.log"
fi
if stage 2; then
  echo "== 2. step() without host sync"
  timeout 120 $PY -m benchmarks.sync_check > "$OUT/sync_check.log" 2>&1 || status=1
  tail -n 20 "$OUT/sync_check.log"
fi
if stage 3; then
  echo "== 3. benchmarks"
  timeout 200 $PY -m benchmarks.run --out "$OUT" --markdown "$OUT/results.md" $BENCH_ARGS 2>&1 | tee "$OUT/bench.log" \
    || status=1
  for model in $MODELS; do
    timeout 130 $PY -m benchmarks.step --model $model --out "$OUT" --markdown "$OUT/results.md" $STEP_ARGS 2>&1 \
      | tee -a "$OUT/step.log" || status=1
  done
fi
if stage 4; then
  echo "== 4. the main job: examples/train_gpt.py, 1 GPU (NCCL), $TRAIN_STEPS steps"
  timeout 120 $PY -m torch.distributed.run --standalone --nproc-per-node 1 examples/train_gpt.py --no-progress \
    --steps "$TRAIN_STEPS" --grad-accum 4 --ckpt-interval 0 --out-dir "$OUT/train" $TRAIN_ARGS > "$OUT/train.log" 2>&1 \
    || status=1
  tail -n 5 "$OUT/train.log"
  $PY -m benchmarks.train_summary "$OUT/train/tritonshard/metrics.jsonl" >> "$OUT/results.md" || status=1
fi
exit $status
