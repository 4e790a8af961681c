#!/usr/bin/env bash
# The test suite: set up, lint, then unit tests (in-process) and integration tests (one shared local
# Ray instance, 2 CPU workers, gloo). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
export OMP_NUM_THREADS=1 RAY_AUTH_MODE=disabled
exec .venv/bin/python -m pytest tests -ra "$@"
