#!/usr/bin/env bash
# Installs fewbit-design into the active Python environment (make and activate a venv first if you want one).
#   bash scripts/setup.sh          the design toolkit (numpy, scipy, numba, click, matplotlib)
#   bash scripts/setup.sh test     plus the runtime and test dependencies (torch, pytest, triton)
# torch (scripts/torch_install.py decides, and logs one "setup:" line saying what and why):
#   a torch that imports is kept (say a CUDA build you installed yourself);
#   no torch and an NVIDIA driver (nvidia-smi works): torch==2.13.0, the default build, from the default index;
#   no torch and no NVIDIA driver: the CPU build from https://download.pytorch.org/whl/cpu, so a CPU machine never
#   downloads the multi-GB CUDA build; if that index cannot be reached (5 s probe), from the default index.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if [ "${1:-}" = "test" ]; then
  "$PYTHON" scripts/torch_install.py
  "$PYTHON" -m pip install --quiet -e ".[test]"
else
  "$PYTHON" -m pip install --quiet -e .
fi
