#!/usr/bin/env bash
# The project's GPU check: ONE device call of at most 7 minutes on a cold machine (torch 2.11 and its Triton
# there, no package registry, 16 CPU cores, an empty Triton cache). Every stage runs under its own timeout, and the
# timeouts add up to 450 s, so the call ends in time even when a stage hangs; a stage that times out or fails is
# reported and the next one still runs. A task's device time is 15 minutes, and each start and give-back cost ~90 s
# of it (2026-12-04), so one check leaves time for one rerun of a stage, not of the whole.
#
#   device run:  OUT=$OUT bash benchmarks/gpu_check.sh          (timeout_s 500 leaves room for the packing)
#
# The stages (budget, in seconds):
#   1. the COMPILED kernels against the PyTorch references: pytest -n 16 tests/kernels (26-35 s measured on an
#      H200 with a cold cache, 2026-11-30 and 12-04)                                                         45
#   2. optimizer steps under torch.cuda.set_sync_debug_mode("error") (step() never waits on the host),
#      gradients made on a side stream read before their memory is reused (streams, rule 4; issue 20.4), and
#      cuda_graph=True against eager steps, bit for bit, with real CUDA graphs and NCCL (issue 20.6), also
#      across an unfreeze (session 14: those steps are captured now); last, whether BatchNorm with a bf16
#      weight beside float32 statistics fails on CUDA as attach()'s check assumes (session 17)               40
#   3. the kernel microbenchmarks (GB/s, % of a device-to-device copy, the PyTorch way beside; first, since
#      session 37, the optimizer's norm pass with four blocks per program against one)                         35
#   4. the optimizer step at 125M and 1B against fused torch AdamW, FSDP2 and torch Muon, and ShardedAdamW's
#      bucket_cap_mb sweep (host ms and wall ms apart: issue 20's measure), with cuda_graph=True at 25 and
#      400 MB; the default step kernel by kernel (--kernels, torch.profiler's device time: the 1B step is
#      device-bound and 0.5 ms over its target, session 32); at 25 MB the step's scalars in launches against
#      the torch ops they replaced in session 34 (--scalars-ab, side by side); and for the models in
#      TIMELINE_MODELS (125M) the default step's host timeline, event by event (--host-timeline: each call and
#      kernel launch from the step's start; the 125M step is host-bound, session 35; since session 38 also the
#      step's host calls under torch.profiler: on CUDA, the runtime's and the driver's); then the HF Trainer's
#      loop: after a backward, torch's clip over param.grad + step beside opt.clip_grad_norm_ + step (session
#      38: one read of the gradients for both norms). ShardedAdamW, torch AdamW, the kernel table and the sweep
#      are measured first: a model stopped by the stage's timeout still writes what it measured (session 35) 60
#   5. end to end, side by side on the same model, data and seed (benchmarks.e2e): torch AMP and ShardedAdamW
#      with and without overlap, at 85M and 302M, two rounds each, round-robin (the host's speed drifts by up
#      to +-30 % on that machine and every configuration is host-bound there: one run each compared the
#      machine's moods; see benchmarks/e2e.py; 12 runs of 14-19 s each on the H200). FSDP2, ShardedMuon and
#      cuda_graph=True: add them to E2E_RUNS                                                                  230
#   host. the host time of the GPU code path on this machine's own CPU (benchmarks.host_overhead: the dry-run
#      driver, nothing launched; per bucket, per parameter, the example's iteration at its 302M layout, and
#      the 125M step's host timeline, stage 4's --host-timeline without CUDA: on one CPU, their difference is
#      what only CUDA costs): what the development machine measures between GPU runs, measured here, so that
#      its figures can be read as this host's (session 31; ~12 s warm with the example's iteration, session
#      32; the timeline adds ~6 s, session 35)                                                               40
#   6. (not in the default set since 2026-12-04, when it answered its question) one traced training iteration
#      (torch.profiler, host and device timelines) of the example at 302M, with and without overlap_comm +
#      attach; PROFILE_ARGS="... --profile-with-stack" adds the Python functions. The chrome traces are
#      packed; the top ops by host and by device time go to results.md                                       40
#   train. (not in the default set) the example's 300 steps, loss and tokens/s                              120
#
# What comes back: a device call returns at most 8 files from $OUT. The script leaves exactly three: results.md
# (every table), env.txt, and gpu_check.tar.gz (every log, JSON row, metrics.jsonl and plot; no checkpoints).
# Commit results.md as benchmarks/results/<gpu>-<date>.md with env.txt's provenance.
#
# Knobs (CI runs this script on CPU with small values, so it cannot rot between GPU runs): PY (the interpreter;
# the GPU image has python3), TESTS (pytest targets), XDIST (pytest's -n value, empty for none), BENCH_ARGS (extra
# benchmarks.run arguments), MODELS (benchmarks.step models), STEP_ARGS (extra benchmarks.step arguments),
# BUCKET_CAPS (the sweep), E2E_RUNS ("model:nproc:steps:configs[:rounds]" items, configs comma-separated), TRAIN_STEPS,
# TRAIN_ARGS, PROFILE_ARGS (the traced model), PROFILE_STEPS (the traced step, the last), PROFILE_MODES (overlap
# no-overlap), HOST_ARGS (benchmarks.host_overhead arguments), TIMELINE_MODELS (stage 4's models with a host
# timeline), STAGES (which of 1 2 3 4 5 host 6 train to run),
# T1..T6, THOST, TTRAIN (the stage timeouts).
# Where a machine lacks pytest/hypothesis: pip install --target .gpu_deps pytest hypothesis, and carry .gpu_deps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
WORK="$OUT/gpu_check"  # everything but results.md and env.txt; packed at the end
mkdir -p "$WORK"
export PYTHONPATH="$PWD:$PWD/.gpu_deps${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
TESTS=${TESTS:-tests/kernels}
XDIST=${XDIST-16}
BENCH_ARGS=${BENCH_ARGS:---sizes 4194304,67108864 --reps 5}
MODELS=${MODELS:-125M 1B}
STEP_ARGS=${STEP_ARGS:---reps 5 --graph-caps 25 400 --kernels --scalars-ab 25}
TIMELINE_MODELS=${TIMELINE_MODELS:-125M}  # (the models whose step also gets --host-timeline: the host-bound one)
BUCKET_CAPS=${BUCKET_CAPS:-25 100 400 2000}
E2E_RUNS=${E2E_RUNS:-85M:1:15:amp,sharded,sharded-overlap:2 302M:1:15:amp,sharded,sharded-overlap:2}
TRAIN_STEPS=${TRAIN_STEPS:-300}
TRAIN_ARGS=${TRAIN_ARGS:-}
PROFILE_ARGS=${PROFILE_ARGS:---n-layer 24 --n-head 16 --n-embd 1024 --block-size 256 --batch-size 16 --grad-accum 2}
PROFILE_STEPS=${PROFILE_STEPS:-6}
PROFILE_MODES=${PROFILE_MODES:-overlap no-overlap}
HOST_ARGS=${HOST_ARGS:---reps 10 --param-rounds 30 --model-rounds 20}
STAGES=" ${STAGES:-1 2 3 4 5 host} "
T1=${T1:-45} T2=${T2:-40} T3=${T3:-35} T4=${T4:-60} T5=${T5:-230} THOST=${THOST:-40} T6=${T6:-40} TTRAIN=${TTRAIN:-120}
stage() { [[ "$STAGES" == *" $1 "* ]]; }
status=0
note() { echo "$1" | tee -a "$OUT/results.md"; }
ran() {  # ran <name> <exit code>: record a failure or a timeout in the results, so nothing is lost silently
  if [ "$2" -eq 124 ]; then note "**stage $1 timed out** (see its log in gpu_check.tar.gz)"; status=1
  elif [ "$2" -ne 0 ]; then note "**stage $1 failed** (exit $2; see its log in gpu_check.tar.gz)"; status=1; fi
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
  $PY -c "import torch, triton, platform; print('torch', torch.__version__, 'triton', triton.__version__, 'python', platform.python_version())"
  echo "git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo +dirty) $(date -u +%Y-%m-%dT%H:%MZ)"
  nproc; } | tee "$OUT/env.txt"
echo "# GPU check $(head -n 1 "$OUT/env.txt")" >> "$OUT/results.md"
if stage 1; then
  echo "== 1. compiled kernels vs references (timeout ${T1}s)"
  # every failure is wanted (a GPU run is rare): no -x; the full log packed, its tail here and in results.md
  timeout "$T1" $PY -m pytest -q -rf -p no:cacheprovider ${XDIST:+-n $XDIST} $TESTS > "$WORK/kernel_tests.log" 2>&1
  ran 1 $?
  tail -n 20 "$WORK/kernel_tests.log"
  { echo; echo "## Kernel tests (compiled)"; echo; echo '```'; grep -E "passed|failed|FAILED|error" "$WORK/kernel_tests.log" | tail -n 15; echo '```'; } >> "$OUT/results.md"
fi
if stage 2; then
  echo "== 2. step() without host sync (timeout ${T2}s)"
  timeout "$T2" $PY -m benchmarks.sync_check > "$WORK/sync_check.log" 2>&1
  ran 2 $?
  tail -n 12 "$WORK/sync_check.log"
  { echo; echo "## Sync check"; echo; echo '```'; tail -n 12 "$WORK/sync_check.log"; echo '```'; } >> "$OUT/results.md"
fi
if stage 3; then
  echo "== 3. kernel microbenchmarks (timeout ${T3}s)"
  timeout "$T3" $PY -m benchmarks.run --out "$WORK" --markdown "$OUT/results.md" $BENCH_ARGS > "$WORK/bench.log" 2>&1
  ran 3 $?
  tail -n 5 "$WORK/bench.log"
fi
if stage 4; then
  echo "== 4. optimizer step and bucket_cap_mb sweep (timeout ${T4}s for all models)"
  deadline=$((SECONDS + T4))
  for model in $MODELS; do
    left=$((deadline - SECONDS)); [ "$left" -gt 0 ] || { ran "4 ($model)" 124; continue; }
    timeline=""
    case " $TIMELINE_MODELS " in *" $model "*) timeline="--host-timeline" ;; esac
    timeout "$left" $PY -m benchmarks.step --model "$model" --out "$WORK" --markdown "$OUT/results.md" \
      --bucket-caps $BUCKET_CAPS $STEP_ARGS $timeline >> "$WORK/step.log" 2>&1
    ran "4 ($model)" $?
  done
  tail -n 12 "$WORK/step.log"
fi
if stage 5; then
  echo "== 5. end to end against torch AMP and FSDP2 (timeout ${T5}s for all runs)"
  deadline=$((SECONDS + T5))
  for run in $E2E_RUNS; do
    IFS=: read -r model nproc steps configs rounds <<< "$run"
    left=$((deadline - SECONDS)); [ "$left" -gt 0 ] || { ran "5 ($model)" 124; continue; }
    timeout "$left" $PY -m benchmarks.e2e --model "$model" --nproc "$nproc" --steps "$steps" --rounds "${rounds:-1}" \
      --configs ${configs//,/ } --out "$WORK/e2e" --markdown "$OUT/results.md" >> "$WORK/e2e.log" 2>&1
    ran "5 ($model)" $?
  done
  tail -n 20 "$WORK/e2e.log"
fi
if stage host; then
  echo "== host. the host time of the GPU code path on this machine's CPU (dry-run driver; timeout ${THOST}s)"
  env -u TRITON_INTERPRET timeout "$THOST" $PY -m benchmarks.host_overhead --out "$WORK/host_overhead.json" \
    $HOST_ARGS > "$WORK/host_overhead.log" 2>&1
  ran host $?
  tail -n 12 "$WORK/host_overhead.log"
  { echo; echo "## Host time of the GPU code path on this machine's CPU (benchmarks.host_overhead, dry-run driver)"
    echo; echo '```'; tail -n 60 "$WORK/host_overhead.log"; echo '```'; } >> "$OUT/results.md"
fi
if stage 6; then
  echo "== 6. one traced iteration, with and without overlap_comm (timeout ${T6}s for both)"
  deadline=$((SECONDS + T6))
  for mode in $PROFILE_MODES; do
    left=$((deadline - SECONDS)); [ "$left" -gt 0 ] || { ran "6 ($mode)" 124; continue; }
    timeout "$left" $PY -m torch.distributed.run --standalone --nproc-per-node 1 examples/train_gpt.py --no-progress \
      --no-save --steps "$PROFILE_STEPS" --profile-step "$PROFILE_STEPS" --"$mode" --out-dir "$WORK/profile-$mode" \
      $PROFILE_ARGS >> "$WORK/profile.log" 2>&1
    ran "6 ($mode)" $?
    { echo; echo "## Traced iteration (step $PROFILE_STEPS), --$mode"; echo; echo '```'
      cat "$WORK/profile-$mode/tritonshard/profile_step$PROFILE_STEPS.txt" 2>/dev/null || echo "no trace"; echo '```'
    } >> "$OUT/results.md"
  done
  tail -n 5 "$WORK/profile.log"
fi
if stage train; then
  echo "== train. examples/train_gpt.py, 1 GPU (NCCL), $TRAIN_STEPS steps (timeout ${TTRAIN}s)"
  timeout "$TTRAIN" $PY -m torch.distributed.run --standalone --nproc-per-node 1 examples/train_gpt.py --no-progress \
    --steps "$TRAIN_STEPS" --grad-accum 4 --no-save --out-dir "$WORK/train" $TRAIN_ARGS > "$WORK/train.log" 2>&1
  ran train $?
  tail -n 5 "$WORK/train.log"
  $PY -m benchmarks.train_summary "$WORK/train/tritonshard/metrics.jsonl" >> "$OUT/results.md" || status=1
fi
# pack: at most 8 files come back from a device call; leave three
tar czf "$OUT/gpu_check.tar.gz" -C "$OUT" gpu_check && rm -rf "$WORK"
echo "== results: $OUT/results.md, $OUT/env.txt, $OUT/gpu_check.tar.gz (exit $status)"
exit $status
