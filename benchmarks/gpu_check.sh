#!/usr/bin/env bash
# The project's GPU check, one prepared script for a lent GPU machine (torch 2.11 and its Triton there, no package
# registry). Well under 5 minutes on an H200:
#   1. the COMPILED kernels against the PyTorch references (tests/kernels on CUDA; RNE bit-exactness included),
#   2. ShardedAdamW steps under torch.cuda.set_sync_debug_mode("error") (step() never waits on the host),
#   3. the microbenchmark table (1M..256M elements) and the end-to-end step at 125M parameters.
#
# The lent H200 image has pytest and hypothesis (device/KINDS.md, 2026-11). Where a machine lacks them, install them
# here into .gpu_deps (git-ignored, on PYTHONPATH below) and carry that folder:
#   pip install --target .gpu_deps pytest hypothesis ; device run: carry [".gpu_deps"]
# Command: OUT=$OUT bash benchmarks/gpu_check.sh   (about 3 minutes of a 15-minute budget: leave room for a rerun)
# Everything it writes lands in $OUT (default benchmarks/out/gpu): logs, results.csv/json, plots, results.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/.gpu_deps${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/env.txt"
echo "== 1. compiled kernels vs references"
timeout 240 python -m pytest -q -x -p no:cacheprovider tests/kernels 2>&1 | tail -n 30 | tee "$OUT/kernel_tests.log" || status=1
echo "== 2. step() without host sync"
timeout 60 python -m benchmarks.sync_check 2>&1 | tail -n 20 | tee "$OUT/sync_check.log" || status=1
echo "== 3. benchmarks"
timeout 300 python -m benchmarks.run --out "$OUT" --markdown "$OUT/results.md" 2>&1 | tee "$OUT/bench.log" || status=1
timeout 120 python -m benchmarks.step --model 125M --out "$OUT" 2>&1 | tee "$OUT/step.log" || status=1
exit $status
