#!/usr/bin/env bash
# The from_pretrained fine-tuning tests (FSDP and ZeRO-3, plain and LoRA, 2 Ray workers) under one
# transformers version, in a virtual environment of its own, with this checkout's raytrainer on PYTHONPATH.
# Run it for each end of the supported range (the lowest version pyproject.toml declares and the newest):
#   bash scripts/test_transformers_range.sh 5.23.0            creates .venv-transformers-5.23.0 (once)
#   bash scripts/test_transformers_range.sh 5.24.0 -k fsdp    extra args go to pytest
#   VENV=/path/to/venv bash scripts/test_transformers_range.sh 5.23.0    an existing venv (installs into it)
# Every install goes through constraints.txt (it pins torch: an unpinned one downloads a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: $0 <transformers version> [pytest args]}"
shift
venv="${VENV:-.venv-transformers-$version}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
installed="$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)' 2>/dev/null || true)"
if [ "$installed" != "$version" ]; then
  # the project and its test dependencies, then the transformers version asked for
  "$venv/bin/pip" install -q -c constraints.txt -e ".[test]" peft
  "$venv/bin/pip" install -q -c constraints.txt "transformers==$version"
fi
"$venv/bin/python" -c 'import transformers; print("transformers", transformers.__version__)'
export OMP_NUM_THREADS=1 RAY_AUTH_MODE=disabled PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$venv/bin/python" -m pytest tests/integration/test_from_pretrained.py -q "$@"
