#!/usr/bin/env bash
# The whole GPU suite in one run (issue 23.1): the CUDA tests, then the GPU benchmarks; CSVs, figures and a log in
# OUTDIR. Nothing is installed and nothing is fetched: the project runs from this checkout through PYTHONPATH.
#
#   bash scripts/gpu_suite.sh OUTDIR              on a machine with a CUDA GPU (under 9 minutes on an H100)
#   bash scripts/gpu_suite.sh OUTDIR --dry-run    on CPU (or FEWBIT_GPU_DRY_RUN=1): the CUDA tests are collected and
#                                                 skip, every benchmark runs its --tiny mode, Triton interpreted
#
# Stages, each under its own time limit (seconds; SUITE_<STAGE>_S overrides one; worst case 8.5 minutes in all), the
# next one runs whatever the previous one did: env (devices and versions -> env.txt), tests 210 s (pytest -m cuda ->
# tests.xml), speed 120 s (benchmarks/gpu_speed.py), offload 80 s (benchmarks/gpu_offload.py), planner 70 s
# (benchmarks/planner.py on CUDA).
# SUITE_STAGES="tests speed" runs only those. The exit status is 0 when every stage passed, else 1 (2: bad usage).
#
# OUTDIR gets at most 8 files (what the device tool brings back): log.txt (everything printed), env.txt, tests.xml
# (JUnit), gpu_speed.csv, gpu_speed.png, gpu_offload.csv, gpu_planner.csv, gpu_planner.png; any other file a stage
# leaves there is packed into more.tar.gz (then the figures go into it too, to stay within 8 files).
set -euo pipefail

usage() {
  echo "usage: bash scripts/gpu_suite.sh OUTDIR [--dry-run]" >&2
  exit 2
}
[ $# -ge 1 ] || usage
OUT=$1
DRY=${FEWBIT_GPU_DRY_RUN:-0}
[ "${2:-}" = "--dry-run" ] && DRY=1
[ $# -le 2 ] || usage
[ $# -lt 2 ] || [ "$2" = "--dry-run" ] || usage
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
STAGES=${SUITE_STAGES:-env tests speed offload planner}

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

RESULTS=()
FAILED=0

stage_limit() { # stage_limit NAME DEFAULT: the stage's time limit in seconds
  local var
  var="SUITE_$(echo "$1" | tr '[:lower:]' '[:upper:]')_S"
  echo "${!var:-$2}"
}

run_stage() { # run_stage NAME SECONDS COMMAND...: run it under a time limit, record how it ended, never stop here
  local name=$1 limit=$2 start status=0
  shift 2
  case " $STAGES " in *" $name "*) ;; *)
    RESULTS+=("$name: not run (SUITE_STAGES)")
    return 0
    ;;
  esac
  echo
  echo "=== stage $name ($([ "$limit" = 0 ] && echo 'no limit' || echo "limit ${limit}s")): $*"
  start=$SECONDS
  if declare -F "$1" >/dev/null; then # a function of this script (quick; it limits its own commands)
    "$@" || status=$?
  else # SIGINT first: pytest and the benchmarks stop cleanly and write what they have; SIGKILL 20 s later
    timeout --signal=INT --kill-after=20 "$limit" "$@" || status=$?
  fi
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
    echo "mode: $([ "$DRY" = 1 ] && echo 'dry run (CPU, tiny)' || echo 'GPU')"
    echo "commit: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo 'unknown (no .git)')"
    # the code measured, also where the checkout came without .git (the device tool copies the working tree)
    echo "code sha256: $(cd "$ROOT" && find fewbit_design benchmarks tests scripts -type f \( -name '*.py' -o \
      -name '*.sh' -o -name '*.json' \) | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16)"
    echo "host: $(uname -srm), $(nproc) CPU cores"
    echo "nvidia-smi -L:"
    timeout 30 nvidia-smi -L 2>&1 || echo "  (no nvidia-smi)"
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv \
      2>&1 || true
    timeout 60 "$PYTHON" - <<'EOF'
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

main() {
  echo "gpu_suite: $([ "$DRY" = 1 ] && echo 'DRY RUN on CPU' || echo 'GPU run') from $ROOT into $OUT"
  echo "stages: $STAGES"
  if [ "$DRY" != 1 ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_suite: no CUDA device (torch.cuda.is_available() is False); on CPU run with --dry-run" >&2
    return 2
  fi
  run_stage env 0 environment

  # the CUDA tests: every test marked 'cuda' (conftest.py skips them without a GPU), in parallel where pytest-xdist
  # is there; the large-tensor cases (2^28, 2^31 elements) only on a GPU; a test stuck for 120 s fails alone (where
  # pytest-timeout is there); a test module that cannot be imported there does not stop the others
  local workers=() timeout_option=() large=0
  "$PYTHON" -c "import xdist" 2>/dev/null && workers=(-n "$([ "$DRY" = 1 ] && echo 2 || echo 8)")
  "$PYTHON" -c "import pytest_timeout" 2>/dev/null && timeout_option=(--timeout 120)
  [ "$DRY" = 1 ] || large=1
  run_stage tests "$(stage_limit tests 210)" env FEWBIT_CUDA_LARGE=$large "$PYTHON" -m pytest -m cuda -q -rfEs \
    -p no:cacheprovider "${workers[@]}" "${timeout_option[@]}" --continue-on-collection-errors --durations=15 \
    --junitxml="$OUT/tests.xml" "$ROOT/tests"

  run_stage speed "$(stage_limit speed 120)" "$PYTHON" "$ROOT/benchmarks/gpu_speed.py" $TINY --budget-seconds 95 \
    --out "$OUT/gpu_speed.csv" --figure "$OUT/gpu_speed.png"
  run_stage offload "$(stage_limit offload 80)" "$PYTHON" "$ROOT/benchmarks/gpu_offload.py" $TINY --scale 4 \
    --steps 3 --budget-seconds 30 --out "$OUT/gpu_offload.csv"
  local device=cuda
  [ "$DRY" = 1 ] && device=cpu
  run_stage planner "$(stage_limit planner 70)" "$PYTHON" "$ROOT/benchmarks/planner.py" $TINY --device "$device" \
    --models gpt2 --gpt2-shape gpt2-small --steps 5 --tolerance 0.05 --threads 8 \
    --csv "$OUT/gpu_planner.csv" --figure "$OUT/gpu_planner.png"

  bundle
  echo
  echo "=== gpu_suite summary ($([ "$DRY" = 1 ] && echo 'dry run' || echo 'GPU')), ${SECONDS}s in all"
  printf '  %s\n' "${RESULTS[@]}"
  echo "  files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
  return "$FAILED"
}

bundle() { # at most 8 files in OUTDIR: anything unexpected (and then the figures) goes into more.tar.gz
  local keep=" log.txt env.txt tests.xml gpu_speed.csv gpu_offload.csv gpu_planner.csv gpu_speed.png gpu_planner.png "
  local extra=()
  for file in $(cd "$OUT" && ls -A); do
    case "$keep" in *" $file "*) ;; *) extra+=("$file") ;; esac
  done
  [ ${#extra[@]} -gt 0 ] || return 0
  extra+=($(cd "$OUT" && ls gpu_speed.png gpu_planner.png 2>/dev/null))
  echo "bundling into more.tar.gz: ${extra[*]}"
  tar -C "$OUT" -czf "$OUT/more.tar.gz" "${extra[@]}" && (cd "$OUT" && rm -rf "${extra[@]}")
}

status=0
main 2>&1 | tee "$OUT/log.txt" || status=$? # pipefail: main's status
exit "$status"
