#!/usr/bin/env bash
# What a user installs, and nothing else: a clean venv, `pip install -c constraints.txt .` (no extras), then
# the in-process quick start (the demo with --num_workers 0), a resume from a checkpoint, and a 2-worker run with
# a lost worker resumed (scripts/plain_install_check.py). A dependency missing from pyproject.toml fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${PLAIN_VENV:-/tmp/raytrainer-plain-$$}
work=$(mktemp -d)
trap 'rm -rf "$work"; [ -z "${PLAIN_VENV:-}" ] && rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -c constraints.txt .
export OMP_NUM_THREADS=1 RAY_AUTH_MODE=disabled
# the demo in this process, from the installed package (not the source tree)
(cd "$work" && "$venv/bin/python" "$OLDPWD/examples/train_digits.py" --num_workers 0 --output_dir "$work/demo" \
    --report_to none)
(cd "$work" && "$venv/bin/python" "$OLDPWD/scripts/plain_install_check.py" "$work")
