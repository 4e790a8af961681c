#!/usr/bin/env bash
# The main job: set up (the package alone, no test or docs extra), then train the digits classifier on 2 Ray
# workers (extra args go to the script).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/train_digits.py "$@"
