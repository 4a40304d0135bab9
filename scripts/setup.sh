#!/usr/bin/env bash
# Installs fewbit-design into the active Python environment (make and activate a venv first if you want one).
#   bash scripts/setup.sh          the design toolkit (numpy, scipy, numba, click, matplotlib)
#   bash scripts/setup.sh test     plus the runtime and test dependencies (torch, pytest, triton)
# torch: if none is installed, the CPU build torch==2.13.0 is installed. An existing torch (say a CUDA build
# you installed yourself) is kept, so this never pulls a multi-GB CUDA build onto a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if [ "${1:-}" = "test" ]; then
  if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet "torch==2.13.0"
  fi
  "$PYTHON" -m pip install --quiet -e ".[test]"
else
  "$PYTHON" -m pip install --quiet -e .
fi
