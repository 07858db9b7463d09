#!/usr/bin/env bash
# Fill the wheel folder that `scripts/gpu_check.sh` installs from on a GPU machine without
# network: the core's dependencies that such a machine's image lacks (stevedore, structlog),
# pytest-timeout, the setuptools floor of the repo's [build-system] tables, and what they need.
# Only pure-Python wheels (py3-none-any, no compiled files) are accepted: they install on the
# GPU image's Python 3.12 whatever Python ran this. Needs PyPI. Usage: scripts/gpu_wheels.sh [FOLDER] (default .gpu-wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.gpu-wheels}
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=${PYTHON:-.venv/bin/python}
floor=$(sed -n 's/^requires = \["setuptools>=\([0-9.]*\)"\].*/\1/p' core/pyproject.toml)
[ -n "$floor" ] || { echo "gpu-wheels: no setuptools floor in core/pyproject.toml" >&2; exit 1; }
case $floor in *.*.*) ;; *) floor=$floor.0 ;; esac
mkdir -p "$dest"
# resolved for the GPU image's Python (GPU_PYTHON_VERSION to change it)
"$python" -m pip download -q --disable-pip-version-check --only-binary=:all: \
  --python-version "${GPU_PYTHON_VERSION:-3.12}" --implementation py --abi none --platform any \
  -d "$dest" "stevedore>=5.0" "structlog>=23.1" "pytest-timeout>=2.2" "setuptools==$floor" \
  2> >(grep -v "^WARNING: Location" >&2)
bad=$(find "$dest" -name '*.whl' ! -name '*-none-any.whl' -printf '%f\n')
if [ -n "$bad" ]; then
  echo "gpu-wheels: not pure-Python, would not install on another Python: $bad" >&2
  exit 1
fi
for wheel in "$dest"/*.whl; do
  "$python" - "$wheel" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))
    text = z.read(meta).decode()
compiled = [n for n in zipfile.ZipFile(sys.argv[1]).namelist()
            if n.endswith((".so", ".pyd", ".dylib"))]
if "Root-Is-Purelib: true" not in text or compiled:
    sys.exit(f"gpu-wheels: {sys.argv[1]} is not pure Python ({compiled or 'not purelib'})")
PY
done
echo "gpu-wheels: $(ls "$dest"/*.whl | wc -l) pure-Python wheels in $dest: $(cd "$dest" && ls *.whl | tr '\n' ' ')"
