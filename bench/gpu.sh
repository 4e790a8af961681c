#!/usr/bin/env bash
# The GPU path in one command, on any CUDA machine with torch and transformers (no network needed):
# the GPU tests (tests/gpu) and the MFU benchmark (bench/mfu.py), raw figures and logs into OUT_DIR.
#
#   bash bench/gpu.sh OUT_DIR
#
# Wheels in WHEEL_DIR (default .whl/, made with bench/gpu_wheels.sh where there is network) are installed
# first into a private folder, for a machine without ray / deepspeed: without them the Ray and DeepSpeed
# tests are skipped and the benchmark has no Ray row. Environment: GPU_TESTS=0 skips the tests;
# MFU_ARGS replaces the benchmark's arguments (default --variants); MFU=0 skips the benchmark.
# OUT_DIR gets: env.txt, gpu-tests.log, gpu-tests.xml, mfu.log, mfu.json, mfu.md, logs.tar.gz (per-side logs).
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:?usage: bash bench/gpu.sh OUT_DIR}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
wheels="${WHEEL_DIR:-$repo/.whl}"
python="${PYTHON:-python3}"
status=0

if compgen -G "$wheels/*.whl" >/dev/null; then
  site="$(mktemp -d)/site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl \
    || { echo "installing the wheels in $wheels failed" >&2; exit 1; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
cd "$repo"

{
  date -u +"date: %Y-%m-%d %H:%M UTC"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
  "$python" - <<'PY'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version())
for dist in ("transformers", "accelerate", "ray", "deepspeed", "optuna"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "not installed")
PY
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

if [ "${GPU_TESTS:-1}" != 0 ]; then
  "$python" -m pytest tests/gpu -m gpu -v -rA -p no:cacheprovider --junitxml "$out/gpu-tests.xml" \
    2>&1 | tee "$out/gpu-tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

if [ "${MFU:-1}" != 0 ]; then
  work="$(mktemp -d)"
  # shellcheck disable=SC2086
  "$python" bench/mfu.py ${MFU_ARGS:---variants} --check --out "$out/mfu.json" --md "$out/mfu.md" \
    --workdir "$work" 2>&1 | tee "$out/mfu.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  tar czf "$out/logs.tar.gz" -C "$work" --exclude='*/rt' --exclude='*/hf' . 2>/dev/null
fi
exit $status
