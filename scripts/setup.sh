#!/usr/bin/env bash
# Installs fewbit-design into the active Python environment (make and activate a venv first if you want one).
#   bash scripts/setup.sh          the design toolkit and the runtime with Hugging Face support (the README's Python
#                                  example runs right after): torch for this machine, transformers, accelerate
#   bash scripts/setup.sh design   the design toolkit alone (numpy, scipy, numba, click, matplotlib; no torch)
#   bash scripts/setup.sh test     everything the tests need (the runtime, pytest, triton, the docs build)
# torch (scripts/torch_install.py decides, and logs one "setup:" line saying what and why):
#   a torch that imports is kept (say a CUDA build you installed yourself);
#   no torch and an NVIDIA driver (nvidia-smi works): torch==2.13.0, the default build, from the default index;
#   no torch and no NVIDIA driver: the CPU build from https://download.pytorch.org/whl/cpu, so a CPU machine never
#   downloads the multi-GB CUDA build; if that index cannot be reached (5 s probe), from the default index.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
case "${1:-}" in
  "")
    "$PYTHON" scripts/torch_install.py
    "$PYTHON" -m pip install --quiet -e ".[models]"
    ;;
  design)
    "$PYTHON" -m pip install --quiet -e .
    ;;
  test)
    "$PYTHON" scripts/torch_install.py
    "$PYTHON" -m pip install --quiet -e ".[test]"
    ;;
  *)
    echo "setup: unknown argument '$1': use no argument (design toolkit and runtime), 'design' or 'test'" >&2
    exit 2
    ;;
esac
