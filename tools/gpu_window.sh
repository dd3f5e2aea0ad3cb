#!/usr/bin/env bash
# One GPU window (issue 63): every check lorafleet makes on a CUDA card, as a few steps of at most ~9 minutes each,
# so that a lent GPU host whose calls run 10 minutes at most and carry 64 MiB at most takes them back to back, and
# the same steps rehearsed on CPU (--cpu) in every CI run (`make rehearse-gpu`), so that nothing but CUDA itself is
# first seen on the card. docs/guides/gpu-processes.md#the-gpu-window has the whole sequence and its budget.
#
#   tools/gpu_window.sh [--cpu] STEP OUT
#
# STEP, in the window's order (each one device call; `stage N` shares a call with the step after it):
#   stage N           install staged chunk .gpu/cN (tools/stage_gpu.py; the call carries .gpu/cN); GPU only
#   tier              the GPU process tier (tests/gpu/test_gpu_processes.py): 3 replicas and the trainer on GPU 0
#   bench-sync-turns  make bench-gpu PARTS=sync,turns (publish latency, tokens/s in sync windows, multi-turn reuse)
#   bench-pipeline    make bench-gpu PARTS=pipeline (the async loop through the proxy against TRL alone)
#   canary-noise      the canary's noise and tolerance: the tiny model, then the real SmolLM2-135M (bf16 on GPU)
#   demo              make demo GPU=1 TASK=tasks/arithmetic.py (the real model learns to add); on CPU 2 steps
#   pages             the benchmark pages rendered strictly against what the steps above wrote (docsite.page_check)
#   all               every step but `stage`, in order (the whole CPU rehearsal: ~35 min on a busy 2-core machine)
#   ci                `all` on the tiny model only: no real-model canary noise, no demo (CI's share, ~15 min)
# Each step writes its JSON, its report and a logs.tgz under OUT/STEP/ (at most 8 files: what a device call brings
# back); the JSON a benchmark page reads is copied into bench/results by hand from there, once it is a real GPU run.
# GPU_PYTHON (default /tmp/lorafleet-gpu/venv/bin/python, where `stage` installs) runs everything on the GPU; on CPU,
# .venv's python (make setup). A failing step fails the script (exit 1) after packing its logs.
set -euo pipefail
cd "$(dirname "$0")/.."

device=gpu
if [ "${1:-}" = "--cpu" ]; then device=cpu; shift; fi
step=${1:?usage: tools/gpu_window.sh [--cpu] STEP OUT (STEP: stage N, tier, bench-sync-turns, bench-pipeline, canary-noise, demo, all)}
shift
chunk=
if [ "$step" = stage ]; then chunk=${1:?stage needs the chunk number}; shift; fi
out=${1:?usage: tools/gpu_window.sh [--cpu] STEP OUT}
mkdir -p "$out"
out=$(cd "$out" && pwd)
prefix=/tmp/lorafleet-gpu
if [ "$device" = gpu ]; then
  python=${GPU_PYTHON:-$prefix/venv/bin/python}
  make_python=(GPU_PYTHON="$python")
else
  python=.venv/bin/python
  make_python=()
fi
export LORAFLEET_ENV_FILE= PYTHONUNBUFFERED=1

say() { printf '\n==> [%s %s] %s (%s)\n' "$device" "${current:-}" "$*" "$(date -u +%T)"; }

# pack DEST PATH...: the step's logs as one file a device call brings back (16 MiB at most a file): weights, checkpoints,
# tokenizers and the content store left out; a pack still over the limit is dropped with a warning, so the rest comes back.
pack() {
  local dest=$1; shift
  local present=()
  local path
  for path in "$@"; do [ -e "$path" ] && present+=("$path"); done
  [ ${#present[@]} -gt 0 ] || return 0
  tar czf "$dest/logs.tgz" --ignore-failed-read --exclude='*.safetensors' --exclude='*.bin' --exclude='*.gguf' \
    --exclude='tokenizer.json' --exclude='.content' --exclude='*.pt' --exclude='*.pth' "${present[@]}" 2>/dev/null || true
  if [ "$(stat -c %s "$dest/logs.tgz" 2>/dev/null || echo 0)" -gt $((15 * 1024 * 1024)) ]; then
    echo "pack: $dest/logs.tgz is over 15 MiB; dropped (the call would not bring it back)"
    rm -f "$dest/logs.tgz"
  fi
}

step_stage() {
  [ "$device" = gpu ] || { echo "stage: GPU only (CPU uses make setup's .venv)"; return 0; }
  # The checkout's own stage_gpu.py, not the chunk's copy: a chunk packed before a change to the tool (a renamed
  # module in its check list) would otherwise fail its check on the card.
  python3 tools/stage_gpu.py install ".gpu/c$chunk" "$prefix" | tee "$1/stage-$chunk.log"
}

step_tier() {
  local dest=$1 rc=0
  # -rA: what the tests print (the canary's distances and tolerance, the reward) reaches the log and gpu-tier.json
  local tier_args="-v -rA --durations=20 --basetemp=results/gpu/tmp -p no:cacheprovider"
  rm -rf results/gpu
  if [ "$device" = gpu ]; then
    make --no-print-directory test-gpu-processes GPUS=0 "${make_python[@]}" \
      PYTEST_ARGS="$tier_args" || rc=$?
    cp bench/results/gpu-tier.json "$dest/" 2>/dev/null || true
  else
    mkdir -p results/gpu
    # shellcheck disable=SC2086  # tier_args is a list of words on purpose
    LORAFLEET_GPU_REHEARSAL=cpu "$python" -m pytest -m gpu tests/gpu/test_gpu_processes.py $tier_args \
      --junitxml results/gpu/gpu-processes.xml 2>&1 | tee results/gpu/gpu-processes.log || rc=$?
    "$python" bench/gpu_tier_report.py --xml results/gpu/gpu-processes.xml --out "$dest/gpu-tier.json" || rc=1
  fi
  cp results/gpu/gpu-processes.xml "$dest/" 2>/dev/null || true
  pack "$dest" results/gpu
  return "$rc"
}

step_bench() {  # $1: OUT/STEP, $2: the parts
  local dest=$1 rc=0
  "$python" bench/gpu_bench.py --device "$device" --parts "$2" --out-dir "$dest" \
    --work results/bench-gpu-work-"$device" 2>&1 | tee "$dest/bench.log" || rc=$?
  pack "$dest" results/bench-gpu-work-"$device"/logs
  return "$rc"
}

models="tiny smollm2-135m"  # the canary noise's models (`ci`: the tiny one)

step_canary_noise() {
  local dest=$1 rc=0 model seconds model_rc log
  local cuda=()
  seconds=45  # on the GPU: about 20 probe rounds under traffic per model, both models inside one call
  if [ "$device" = gpu ]; then cuda=(--device cuda --eager); else seconds=20; fi
  for model in $models; do
    model_rc=0
    "$python" bench/canary_noise.py "${cuda[@]}" --model "$model" --seconds "$seconds" \
      --work "results/canary-noise-$model" --out "$dest/bench-canary-noise-$device-$model.json" 2>&1 \
      | tail -n 40 >"$dest/canary-noise-$model.log" || model_rc=$?
    if [ "$model_rc" -eq 0 ]; then
      tail -n 3 "$dest/canary-noise-$model.log"
    else  # the whole traceback and each replica's last words: a CI log is all a failure there leaves
      rc=$model_rc
      cat "$dest/canary-noise-$model.log"
      for log in results/canary-noise-"$model"/logs/*; do
        if [ -f "$log" ]; then echo "--- $log (last 20 lines)"; tail -n 20 "$log"; fi
      done
    fi
  done
  pack "$dest" results/canary-noise-tiny/logs results/canary-noise-smollm2-135m/logs
  return "$rc"
}

step_demo() {
  local dest=$1 rc=0
  if [ "$device" = gpu ]; then
    # One call: the task's own wall budget (15 min, sized for 2 CPU cores) cut to DEMO_WALL_S, replicas eager (a
    # minute to start instead of three); the environment wins over a task's defaults.
    RUN_MAX_WALL_S=${DEMO_WALL_S:-240} VLLM_EXTRA_ARGS=--enforce-eager make --no-print-directory demo GPU=1 GPUS=0 \
      TASK=tasks/arithmetic.py "${make_python[@]}" 2>&1 | tee "$dest/demo.log" || rc=$?
    cp results/demo-gpu-arithmetic/report.json results/demo-gpu-arithmetic/report.png "$dest/" 2>/dev/null || true
    pack "$dest" results/demo-gpu-arithmetic/logs results/demo-gpu-arithmetic/work/adapters/runs
  else  # the same command line on CPU, two steps: every piece of the run, not the learning (make demo's own)
    "$python" -m lorafleet_ops.commands.cli demo --task tasks/arithmetic.py --steps 2 --eval-every 2 \
      --out results/rehearse-demo 2>&1 | tee "$dest/demo.log" || rc=$?
    cp results/rehearse-demo/report.json "$dest/" 2>/dev/null || true
    pack "$dest" results/rehearse-demo/logs results/rehearse-demo/work/adapters/runs
  fi
  return "$rc"
}

# The pages that will read the GPU's files, rendered strictly against the files this run wrote (CPU: under the GPU's
# page names, the same schema): every value they read must be there (lorafleet_ops.docsite.page_check).
step_pages() {
  local dest=$1 rc=0 pages
  pages="$dest/as-page-names"
  mkdir -p "$pages"
  cp "$out"/tier/gpu-tier.json "$out"/bench-sync-turns/bench-gpu-{sync,turns}.json \
    "$out"/bench-pipeline/bench-gpu-pipeline.json "$pages/" || rc=$?
  local model
  for model in $models; do
    cp "$out/canary-noise/bench-canary-noise-$device-$model.json" "$pages/bench-canary-noise-gpu-$model.json" || rc=$?
  done
  "$python" -m lorafleet_ops.docsite.page_check docs/benchmarks/gpu.md "$pages"/gpu-tier.json \
    "$pages"/bench-gpu-{sync,turns,pipeline}.json || rc=$?
  "$python" -m lorafleet_ops.docsite.page_check docs/benchmarks/canary.md "$pages"/bench-canary-noise-gpu-*.json \
    || rc=$?
  return "$rc"
}

run_step() {
  local name=$1 dest
  current=$name
  dest="$out/$name"
  mkdir -p "$dest"
  say "start"
  local began=$SECONDS rc=0
  case $name in
    stage) step_stage "$dest" || rc=$? ;;
    tier) step_tier "$dest" || rc=$? ;;
    bench-sync-turns) step_bench "$dest" sync,turns || rc=$? ;;
    bench-pipeline) step_bench "$dest" pipeline || rc=$? ;;
    canary-noise) step_canary_noise "$dest" || rc=$? ;;
    demo) step_demo "$dest" || rc=$? ;;
    pages) step_pages "$dest" || rc=$? ;;
    *) echo "unknown step $name" >&2; return 2 ;;
  esac
  say "done in $((SECONDS - began)) s, exit $rc"
  return "$rc"
}

if [ "$step" = all ] || [ "$step" = ci ]; then
  failed=()
  names="tier bench-sync-turns bench-pipeline canary-noise demo pages"
  if [ "$step" = ci ]; then models=tiny; names=${names/ demo/}; fi
  for name in $names; do
    run_step "$name" || failed+=("$name")
  done
  if [ ${#failed[@]} -gt 0 ]; then echo "gpu window ($device): FAILED: ${failed[*]}"; exit 1; fi
  echo "gpu window ($device): every step passed"
else
  run_step "$step"
fi
