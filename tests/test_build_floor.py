"""Every distribution of the repo installs offline (``--no-build-isolation --no-deps``, the way
the GPU check installs them) with nothing but the setuptools floor its ``[build-system]``
declares: a fresh virtualenv, pip, and that one setuptools wheel."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".gpu-wheels"  # filled by `make gpu-wheels`
PROJECTS = sorted([ROOT / "pyproject.toml", *ROOT.glob("core/pyproject.toml"),
                   *ROOT.glob("plugins/*/pyproject.toml"),
                   *ROOT.glob("integrations/*/pyproject.toml"),
                   *ROOT.glob("tests/plugins/*/pyproject.toml")])


def _floor(path: Path) -> str:
    requires = tomllib.loads(path.read_text())["build-system"]["requires"]
    [setuptools] = [r for r in requires if r.startswith("setuptools")]
    match = re.fullmatch(r"setuptools>=([0-9.]+)", setuptools.replace(" ", ""))
    if match is None:
        raise AssertionError(f"{path}: setuptools requirement {setuptools!r} has no >= floor")
    return match.group(1)


def _floor_wheel(version: str, tmp: Path) -> Path:
    name = f"setuptools-{version}.0-py3-none-any.whl" if version.count(".") == 1 else \
        f"setuptools-{version}-py3-none-any.whl"
    for folder in (WHEELS, tmp):
        if (folder / name).exists():
            return folder / name
    got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                          "--only-binary=:all:", "-d", str(tmp), f"setuptools=={version}"],
                         capture_output=True, text=True)
    if got.returncode != 0 or not (tmp / name).exists():
        pytest.skip(f"setuptools {version} wheel neither in {WHEELS} (make gpu-wheels) nor "
                    f"downloadable: {got.stderr.strip()[-300:]}")
    return tmp / name


def test_every_distribution_declares_the_same_floor() -> None:
    floors = {str(p.relative_to(ROOT)): _floor(p) for p in PROJECTS}
    assert len(PROJECTS) >= 8, floors
    assert set(floors.values()) == {"77.0.3"}, floors


# 52-68 s here; 171 s, and once past 240 s, while other jobs loaded the machine
@pytest.mark.timeout(400)
def test_offline_editable_install_with_only_the_floor(tmp_path: Path) -> None:
    floor = _floor(ROOT / "core" / "pyproject.toml")
    wheel = _floor_wheel(floor, tmp_path / "wheels")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "uninstall", "-y", "setuptools", "wheel"], capture_output=True)
    subprocess.run([*pip, "install", "--no-index", str(wheel)], check=True)
    editables = [arg for p in PROJECTS if p.parent != ROOT
                 for arg in ("-e", str(p.parent))]
    done = subprocess.run([*pip, "install", "--no-index", "--no-deps", "--no-build-isolation",
                           *editables, "-e", str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    # `wheel` looked up before importing setuptools, which (71 on) puts its own vendored copy of
    # wheel on sys.path
    code = ("import importlib.metadata as m; "
            "has_wheel = 'wheel' in {d.metadata['Name'] for d in m.distributions()}; "
            "import setuptools; "
            "eps = {e.name for e in m.entry_points(group='plugdist.backends')}; "
            "print(setuptools.__version__, m.version('plugdist'), sorted(eps)); "
            "print(has_wheel)")
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True)
    versions, has_wheel = out.stdout.splitlines()
    assert versions.startswith(f"{wheel.name.split('-')[1]} 0.1.0 "), versions
    assert "'nccl'" in versions and "'gloo'" in versions, versions
    assert has_wheel == "False"  # built without the separate `wheel` package
