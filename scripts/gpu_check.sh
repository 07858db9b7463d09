#!/usr/bin/env bash
# One-command GPU verification of the NCCL plugin, for a bare machine with one (or more) GPUs and
# no network: its preinstalled python3 must have torch (CUDA build), cupy and NCCL, pytest,
# pluggy and mpi4py; everything else comes from the wheel folder that `make gpu-wheels` fills
# (.gpu-wheels/, gitignored: copy it along with the tree).
#
# Installs the repo's distributions offline into .gpu-venv (a venv with --system-site-packages,
# so the image's torch/cupy/NCCL are used as they are), then runs plugins/nccl/tests/test_nccl.py and the
# conformance suite on nccl at world sizes 1 and 2. World size 2 runs on one GPU if there is only
# one: each rank gets its own NCCL_HOSTID (NCCL otherwise refuses two ranks on one device) and
# the ranks talk over loopback sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
# NCCL_SOCKET_IFNAME=lo). Prints one verdict line and writes junit XML plus summary.json.
#
# Usage: scripts/gpu_check.sh [RESULTS_DIR]   (default: $OUT if set, else gpu-check-results)
# Environment: PYTHON (default python3), GPU_WHEELS (.gpu-wheels), GPU_VENV (.gpu-venv),
# GPU_CHECK_DRY_RUN=1 (run every step without a GPU: the GPU tests skip; verdict DRY-RUN),
# GPU_CHECK_SETUP_ONLY=1 (stop after the install, verdict SETUP: to run other GPU scripts),
# GPU_CHECK_WORKERS=N (run plugins/nccl/tests/test_nccl.py on N pytest-xdist workers, when the image has
# pytest-xdist: the tests share the GPU; a few minutes become about one).
# Exit status: 0 PASS (or a clean dry run), 1 FAIL, 2 cannot run here (no CUDA device, ...).
set -uo pipefail
cd "$(dirname "$0")/.."
results=${1:-${OUT:-gpu-check-results}}
mkdir -p "$results"
results=$(cd "$results" && pwd)
rm -f "$results/summary.json"
python=${PYTHON:-python3}
wheels=${GPU_WHEELS:-.gpu-wheels}
venv=${GPU_VENV:-.gpu-venv}
log=$results/gpu-check.log
: >"$log"

verdict() {  # verdict STATUS EXIT_CODE TEXT: print the one line, write summary.json, exit
  "$python" - "$results/summary.json" "$1" "$3" <<'PY' 2>/dev/null || true
import json, sys, time
from pathlib import Path
path = Path(sys.argv[1])
summary = json.loads(path.read_text()) if path.exists() else {}
summary.update(verdict=sys.argv[2], detail=sys.argv[3],
               time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
path.write_text(json.dumps(summary, indent=2) + "\n")
PY
  echo "GPU CHECK: $1 $3"
  exit "$2"
}

# 1. a CUDA device, seen by the image's torch
probe=$("$python" - <<'PY' 2>&1
import sys
try:
    import torch
except Exception as exc:
    sys.exit(f"no CUDA device: torch cannot be imported by this python ({exc})")
if not torch.cuda.is_available():
    build = "a CPU-only torch build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build"
    sys.exit(f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, {build})")
print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, python {sys.version.split()[0]}")
PY
)
probe_rc=$?
dry=${GPU_CHECK_DRY_RUN:-0}
if [ $probe_rc -ne 0 ] && [ "$dry" != 1 ]; then
  verdict FAIL 2 "(${probe##*$'\n'})"
fi
echo "gpu-check: $probe" | tee -a "$log"

# 2. offline install: wheels for what the image lacks, then the repo's distributions (editable)
[ -d "$wheels" ] && ls "$wheels"/*.whl >/dev/null 2>&1 ||
  verdict FAIL 2 "(no wheel folder $wheels: run 'make gpu-wheels' where PyPI is reachable and copy it along)"
pip_of_venv=("$venv/bin/python" -m pip)
if [ ! -x "$venv/bin/python" ]; then
  if ! "$python" -m venv --system-site-packages "$venv" >>"$log" 2>&1; then
    # an image without ensurepip: a venv without pip, served by $python's own pip
    rm -rf "$venv"
    "$python" -m venv --system-site-packages --without-pip "$venv" >>"$log" 2>&1 ||
      verdict FAIL 2 "($python -m venv failed, see $log)"
  fi
  # what $python sees (its own site-packages too, when it is itself a virtualenv), the new
  # venv sees after its own packages
  "$venv/bin/python" - "$python" <<'PY' >>"$log" 2>&1
import subprocess, sys, sysconfig
from pathlib import Path
parent = subprocess.run([sys.argv[1], "-c", "import site, sys; print('\\n'.join(sys.path))"],
                        capture_output=True, text=True, check=True).stdout.split()
(Path(sysconfig.get_paths()["purelib"]) / "_gpu_check_parent.pth").write_text(
    "\n".join(p for p in parent if p.endswith("-packages")) + "\n")
PY
fi
vpy=$venv/bin/python
"$vpy" -m pip --version >/dev/null 2>&1 || pip_of_venv=("$python" -m pip --python "$vpy")
pipi=("${pip_of_venv[@]}" install -q --disable-pip-version-check --no-index --find-links "$wheels")
"${pipi[@]}" "setuptools>=77.0.3" stevedore structlog pytest-timeout >>"$log" 2>&1 ||
  verdict FAIL 2 "(installing from $wheels failed, see $log)"
dists=(-e core -e plugins/nccl -e plugins/gloo -e plugins/debug -e plugins/toy)
"${pipi[@]}" --no-deps --no-build-isolation "${dists[@]}" >>"$log" 2>&1 ||
  verdict FAIL 2 "(editable install of the repo failed, see $log)"
"$vpy" -c "import plugdist_nccl; print('gpu-check: plugdist-nccl availability:', *plugdist_nccl.availability())" 2>&1 | tee -a "$log"
[ "${GPU_CHECK_SETUP_ONLY:-0}" = 1 ] && verdict SETUP 0 "($venv is ready; its python: $vpy)"

# 3. the tests: world sizes 1 and 2 (two ranks share a GPU when there is one)
export PLUGDIST_TEST_RANKS_PER_GPU=2 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo
export NCCL_IB_DISABLE=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN} PYTHONUNBUFFERED=1
run() {  # run NAME PYTEST-ARGS...: one pytest session with its own junit file
  local name=$1; shift
  echo "gpu-check: $name: pytest $*" | tee -a "$log"
  timeout "${GPU_CHECK_STEP_TIMEOUT:-1500}" "$vpy" -m pytest -q -rfEs -p no:cacheprovider \
    --junitxml="$results/$name.xml" "$@" 2>&1 | tee -a "$log" | tail -25
}
workers=${GPU_CHECK_WORKERS:-1}
parallel=()
if [ "$workers" -gt 1 ] && "$vpy" -c "import xdist" 2>/dev/null; then
  parallel=(-n "$workers")
fi
run nccl-tests "${parallel[@]}" plugins/nccl/tests/test_nccl.py -k "not conformance_on_gpus"
run conformance-nccl --pyargs plugdist.testing.conformance --plugdist-backend nccl \
  --plugdist-world-sizes 1,2

# 4. the verdict, from the junit files
line=$("$python" - "$results" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
root = Path(sys.argv[1])
totals = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
per = {}
for name in ("nccl-tests", "conformance-nccl"):
    f = root / f"{name}.xml"
    if not f.exists():
        per[name] = "no result (pytest did not finish)"
        totals["errors"] += 1
        continue
    c = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for case in ET.parse(f).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        key = "failed" if "failure" in kinds else "errors" if "error" in kinds else \
            "skipped" if "skipped" in kinds else "passed"
        c[key] += 1
    per[name] = c
    for k, v in c.items():
        totals[k] += v
ok = totals["failed"] == totals["errors"] == 0 and totals["passed"] > 0
summary = json.loads((root / "summary.json").read_text()) if (root / "summary.json").exists() else {}
summary.update({"totals": totals, "runs": per})
(root / "summary.json").write_text(json.dumps(summary, indent=2))
print(("PASS" if ok else "FAIL") + " " + ", ".join(f"{v} {k}" for k, v in totals.items()))
PY
)
status=${line%% *}
detail="(${line#* }; junit and log in $results)"
if [ "$dry" = 1 ]; then
  [ "$status" = PASS ] && verdict DRY-RUN 0 "(no GPU: ${probe##*$'\n'}; ${line#* })"
  verdict FAIL 1 "(dry run: ${line#* }; see $log)"
fi
[ "$status" = PASS ] && verdict PASS 0 "$detail"
verdict FAIL 1 "$detail"
