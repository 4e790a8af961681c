#!/usr/bin/env bash
# Wheels for an offline CUDA machine that has torch and accelerate but not ray, optuna or deepspeed, and
# perhaps a transformers older than raytrainer's lower bound, so this project's transformers comes too
# (bench/gpu.sh installs what it finds in WHEEL_DIR). Run here, with network; writes WHEEL_DIR
# (default .whl/). Ray's wheel (79 MB) is repacked without its Java jar, RLlib and the dashboard's web
# client, none of which a raytrainer run loads, to fit a 64 MiB transfer with the rest.
#
#   bash bench/gpu_wheels.sh [WHEEL_DIR]     # Python 3.12, x86-64 manylinux (override with PY_VERSION)
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
py="${PY_VERSION:-3.12}"
mkdir -p "$dir"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# Versions as in this project's environment; the offline machine brings its own torch.
ray_v="$(.venv/bin/python -c 'import ray; print(ray.__version__)')"
ds_v="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("deepspeed"))')"
tf_v="$(.venv/bin/python -c 'import transformers; print(transformers.__version__)')"
binary=(jsonschema jsonschema-specifications referencing rpds-py pydantic pydantic-core annotated-types
        typing-inspection tensorboardX hjson)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$tmp" "ray==$ray_v" "transformers==$tf_v" "${binary[@]}"
# DeepSpeed publishes only a source distribution: build its pure-Python wheel (ops compile at run time).
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$tmp" "deepspeed==$ds_v"

.venv/bin/python - "$tmp" "$dir" <<'EOF'
import base64, hashlib, pathlib, shutil, sys, zipfile

src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
DROP = ("ray/jars/", "ray/rllib/", "ray/dashboard/client/")
for wheel in sorted(src.glob("*.whl")):
    out = dst / wheel.name
    if not wheel.name.startswith("ray-"):
        shutil.copy(wheel, out)
        continue
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        record = None
        for info in zin.infolist():
            if info.filename.startswith(DROP):
                continue
            if info.filename.endswith(".dist-info/RECORD"):
                record = info
                continue
            zout.writestr(info, zin.read(info.filename), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        lines = [l for l in zin.read(record).decode().splitlines() if not l.startswith(DROP)]
        zout.writestr(record, "\n".join(lines) + "\n")
for wheel in sorted(dst.glob("*.whl")):
    print(f"{wheel.stat().st_size / 2**20:7.1f} MiB  {wheel.name}")
print(f"{sum(w.stat().st_size for w in dst.glob('*.whl')) / 2**20:7.1f} MiB  in all")
EOF
