#!/usr/bin/env bash
# Installs everything the tests need (see scripts/setup.sh) and runs the whole test suite on all cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
bash scripts/setup.sh test
exec "$PYTHON" -m pytest -n "${PYTEST_WORKERS:-auto}" "$@"
