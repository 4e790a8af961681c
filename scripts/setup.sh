#!/usr/bin/env bash
# Creates .venv (if missing) and installs raytrainer into it, editable, torch pinned by constraints.txt.
#   bash scripts/setup.sh              the package alone: what scripts/demo.sh needs
#   bash scripts/setup.sh test,docs    with those extras: what scripts/test.sh needs
# It installs again when pyproject.toml or constraints.txt changed, or when extras are asked for that the
# last install did not have.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.raytrainer-installed  # the extras of the last install, one per line
missing=0
for extra in ${extras//,/ }; do
  grep -qx "$extra" "$stamp" 2>/dev/null || missing=1
done
if [ ! -f "$stamp" ] || [ "$missing" = 1 ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  # what was installed before stays installed: ask for it again with the new extras
  all=$(printf '%s\n' ${extras//,/ } $(cat "$stamp" 2>/dev/null) | sort -u | paste -sd, -)
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c constraints.txt -e ".${all:+[$all]}"
  printf '%s\n' ${all//,/ } > "$stamp"
fi
