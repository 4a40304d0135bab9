#!/usr/bin/env bash
# The GPU suite in one run: the CUDA tests and the GPU benchmarks, most valuable first, within a device lease of 15
# minutes (start-up, install and copying back included). CSVs, figures and a log in OUTDIR. Nothing is installed and
# nothing is fetched: the project runs from this checkout through PYTHONPATH.
#
#   bash scripts/gpu_suite.sh [OUTDIR] [--quick] [--dry-run]
#
#   OUTDIR     where the results go (default: $OUT, the device tool's folder, else ./gpu_suite_out)
#   --quick    at most 3 minutes: kernels, speed (GELU and SiLU), offload
#   --dry-run  on CPU (or FEWBIT_GPU_DRY_RUN=1): the CUDA tests are collected and skip, every benchmark runs its
#              --tiny mode, Triton interpreted
#
# Stages, in this order, each under its own time limit (seconds; SUITE_<STAGE>_S overrides one) and all of them
# within SUITE_BUDGET_S (default 360, --quick 180): a stage never gets more than what is left, less 5 s for
# stopping it, so the commands take at most the budget in all; the next stage runs whatever the previous one did.
#
#   env      30   devices and versions -> env.txt
#   kernels  85   (quick 65) correctness of every kernel: pytest -m cuda on the few-bit kernels (compiled Triton
#                 against the pure-torch reference, codes and gradients bitwise; the one-pass forward's y against
#                 torch's CUDA op, bitwise; non-finite inputs) -> kernels.xml
#   speed    80   (quick 50) few-bit against native, forward and backward (benchmarks/gpu_speed.py) -> gpu_speed.csv
#   offload  45   (quick 20) activation offloading (benchmarks/gpu_offload.py) -> gpu_offload.csv
#   planner  45   (not in --quick) the memory planner's predicted against measured peak (benchmarks/planner.py)
#                 -> gpu_planner.csv
#   tests    45   (not in --quick) the other CUDA tests (models under torch.compile, memory, offload, reversible,
#                 BLPA) -> tests.xml
#
# Each stage writes its files into OUTDIR as it goes (the benchmarks append CSV rows as they measure), so a run cut
# off still brings back what it measured. SUITE_STAGES="kernels speed" runs only those. The exit status is 0 when
# every stage run passed, else 1 (2: bad usage, or no GPU without --dry-run).
#
# OUTDIR keeps at most 8 files (what the device tool brings back): log.txt (everything printed), env.txt,
# kernels.xml, tests.xml (JUnit), gpu_speed.csv, gpu_offload.csv, gpu_planner.csv, and more.tar.gz with the figures
# (gpu_speed.png, gpu_planner.png) and any other file a stage left there.
set -euo pipefail

usage() {
  echo "usage: bash scripts/gpu_suite.sh [OUTDIR] [--quick] [--dry-run]" >&2
  exit 2
}
DRY=${FEWBIT_GPU_DRY_RUN:-0}
QUICK=0
TARGET=
for argument in "$@"; do
  case "$argument" in
  --dry-run) DRY=1 ;;
  --quick) QUICK=1 ;;
  -*) usage ;;
  *)
    [ -z "$TARGET" ] || usage
    TARGET=$argument
    ;;
  esac
done
[ -n "$TARGET" ] || TARGET=${OUT:-gpu_suite_out}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$TARGET"
OUT=$(cd "$TARGET" && pwd)
PYTHON=${PYTHON:-python3}
if [ "$QUICK" = 1 ]; then
  STAGES=${SUITE_STAGES:-env kernels speed offload}
  BUDGET=${SUITE_BUDGET_S:-180}
else
  STAGES=${SUITE_STAGES:-env kernels speed offload planner tests}
  BUDGET=${SUITE_BUDGET_S:-360}
fi
STOP_S=5 # SIGINT at a stage's limit, SIGKILL this much later

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1 # Triton kernels on CPU tensors, through the interpreter
  TINY=--tiny
else
  # compiled kernels: tests/conftest.py defaults TRITON_INTERPRET to 1 (the CPU test suite), which on a GPU would run
  # every Triton kernel in the interpreter; Triton reads it when a kernel module is imported
  export TRITON_INTERPRET=0
  TINY=
fi

# the few-bit kernels' CUDA tests: the first stage; the other CUDA tests are the last one
KERNEL_TESTS=(tests/runtime/fewbit/test_cuda_kernels.py tests/runtime/fewbit/test_one_pass.py
  tests/runtime/fewbit/test_nonfinite.py)

RESULTS=()
FAILED=0
STARTED=$SECONDS

stage_limit() { # stage_limit NAME FULL QUICK: the stage's limit in seconds, never more than the budget left
  local var limit left
  var="SUITE_$(echo "$1" | tr '[:lower:]' '[:upper:]')_S"
  limit=${!var:-$([ "$QUICK" = 1 ] && echo "$3" || echo "$2")}
  left=$((BUDGET - (SECONDS - STARTED) - STOP_S))
  [ "$left" -lt "$limit" ] && limit=$left
  echo "$limit"
}

run_stage() { # run_stage NAME SECONDS COMMAND...: run it under a time limit, record how it ended, never stop here
  local name=$1 limit=$2 start status=0
  shift 2
  case " $STAGES " in *" $name "*) ;; *)
    RESULTS+=("$name: not run (SUITE_STAGES)")
    return 0
    ;;
  esac
  if [ "$limit" -le 0 ]; then
    RESULTS+=("$name: not run (the ${BUDGET}s budget is spent)")
    FAILED=1
    return 0
  fi
  echo
  echo "=== stage $name (limit ${limit}s, $((SECONDS - STARTED))s of ${BUDGET}s used): $*"
  start=$SECONDS
  # SIGINT first: pytest and the benchmarks stop cleanly and write what they have; SIGKILL STOP_S later (a function
  # of this script runs in a bash of its own, which inherits it: see the exports below)
  declare -F "$1" >/dev/null && set -- bash -c '"$@"' "$name" "$@"
  timeout --signal=INT --kill-after="$STOP_S" "$limit" "$@" || status=$?
  local took=$((SECONDS - start))
  if [ "$status" = 0 ]; then
    RESULTS+=("$name: ok (${took}s)")
  elif [ "$status" = 124 ] || [ "$status" = 137 ]; then
    RESULTS+=("$name: TIMED OUT after ${took}s (limit ${limit}s)")
    FAILED=1
  else
    RESULTS+=("$name: FAILED with exit status $status (${took}s)")
    FAILED=1
  fi
  echo "=== stage $name ended: ${RESULTS[-1]}"
}

environment() {
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "mode: $([ "$DRY" = 1 ] && echo 'dry run (CPU, tiny)' || echo 'GPU')$([ "$QUICK" = 1 ] && echo ', quick')"
    echo "commit: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo 'unknown (no .git)')"
    # the code measured, also where the checkout came without .git (the device tool copies the working tree)
    echo "code sha256: $(cd "$ROOT" && find fewbit_design benchmarks tests scripts -type f \( -name '*.py' -o \
      -name '*.sh' -o -name '*.json' \) | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16)"
    echo "host: $(uname -srm), $(nproc) CPU cores"
    echo "nvidia-smi -L:"
    timeout 5 nvidia-smi -L 2>&1 || echo "  (no nvidia-smi)"
    timeout 5 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv \
      2>&1 || true
    timeout 15 "$PYTHON" - <<'EOF'
import importlib, os, platform, sys
import torch
print(f"python: {platform.python_version()} ({sys.executable})")
print(f"torch: {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
for name in ("triton", "transformers", "numpy", "numba", "pytest", "xdist", "timm"):
    try:
        print(f"{name}: {importlib.import_module(name).__version__}")
    except Exception as error:  # noqa: BLE001 - a report, not a check
        print(f"{name}: not importable ({type(error).__name__})")
print(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
          f"capability {p.major}.{p.minor}")
else:
    print("device: none (torch.cuda.is_available() is False)")
EOF
  } 2>&1 | tee "$OUT/env.txt"
}

cuda_tests() { # cuda_tests JUNIT PATH...: pytest -m cuda on PATH..., in parallel where pytest-xdist is there
  local junit=$1 workers=() timeout_option=() large=0
  shift
  "$PYTHON" -c "import xdist" 2>/dev/null && workers=(-n "$([ "$DRY" = 1 ] && echo 2 || echo 8)")
  "$PYTHON" -c "import pytest_timeout" 2>/dev/null && timeout_option=(--timeout 60)
  # the large-tensor cases (2^28 and more than 2^31 elements) only on a GPU, and not in --quick
  [ "$DRY" = 1 ] || [ "$QUICK" = 1 ] || large=1
  FEWBIT_CUDA_LARGE=$large "$PYTHON" -m pytest -m cuda -q -rfEs -p no:cacheprovider "${workers[@]}" \
    "${timeout_option[@]}" --continue-on-collection-errors --durations=10 --junitxml="$OUT/$junit" "$@"
}

main() {
  echo "gpu_suite: $([ "$DRY" = 1 ] && echo 'DRY RUN on CPU' || echo 'GPU run')$([ "$QUICK" = 1 ] && echo ' (quick)')" \
    "from $ROOT into $OUT, budget ${BUDGET}s"
  echo "stages: $STAGES"
  if [ "$DRY" != 1 ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_suite: no CUDA device (torch.cuda.is_available() is False); on CPU run with --dry-run" >&2
    return 2
  fi
  cd "$ROOT"
  run_stage env "$(stage_limit env 30 30)" environment

  run_stage kernels "$(stage_limit kernels 85 65)" cuda_tests kernels.xml "${KERNEL_TESTS[@]}"

  local speed=()
  [ "$QUICK" = 1 ] && [ "$DRY" != 1 ] && speed=(--activations gelu,silu --bits 3,1,8 --sizes 24,28)
  run_stage speed "$(stage_limit speed 80 50)" "$PYTHON" benchmarks/gpu_speed.py $TINY "${speed[@]}" \
    --budget-seconds "$(($(stage_limit speed 80 50) - 15))" --out "$OUT/gpu_speed.csv" --figure "$OUT/gpu_speed.png"
  run_stage offload "$(stage_limit offload 45 20)" "$PYTHON" benchmarks/gpu_offload.py $TINY --scale 4 \
    --steps "$([ "$QUICK" = 1 ] && echo 2 || echo 3)" --budget-seconds 15 --out "$OUT/gpu_offload.csv"
  local device=cuda
  [ "$DRY" = 1 ] && device=cpu
  run_stage planner "$(stage_limit planner 45 0)" "$PYTHON" benchmarks/planner.py $TINY --device "$device" \
    --models gpt2 --gpt2-shape gpt2-small --steps 5 --tolerance 0.05 --threads 8 \
    --csv "$OUT/gpu_planner.csv" --figure "$OUT/gpu_planner.png"
  local ignore=()
  for path in "${KERNEL_TESTS[@]}"; do ignore+=(--ignore="$path"); done
  run_stage tests "$(stage_limit tests 45 0)" cuda_tests tests.xml "${ignore[@]}" tests

  bundle
  echo
  echo "=== gpu_suite summary ($([ "$DRY" = 1 ] && echo 'dry run' || echo 'GPU')$([ "$QUICK" = 1 ] && echo ', quick'))," \
    "$((SECONDS - STARTED))s of ${BUDGET}s"
  printf '  %s\n' "${RESULTS[@]}"
  echo "  files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
  return "$FAILED"
}

bundle() { # at most 8 files in OUTDIR: the figures and anything unexpected go into more.tar.gz
  local keep=" log.txt env.txt kernels.xml tests.xml gpu_speed.csv gpu_offload.csv gpu_planner.csv more.tar.gz "
  local extra=()
  for file in $(cd "$OUT" && ls -A); do
    case "$keep" in *" $file "*) ;; *) extra+=("$file") ;; esac
  done
  [ ${#extra[@]} -gt 0 ] || return 0
  echo "bundling into more.tar.gz: ${extra[*]}"
  tar -C "$OUT" -czf "$OUT/more.tar.gz" "${extra[@]}" && (cd "$OUT" && rm -rf "${extra[@]}")
}

# the functions that run_stage starts through `timeout` (a separate process): exported to the bash it runs
export -f environment cuda_tests
export OUT PYTHON DRY QUICK ROOT
status=0
main 2>&1 | tee "$OUT/log.txt" || status=$? # pipefail: main's status
exit "$status"
