"""The MPI plugin (plugdist-mpi) against real worlds started by the venv's ``mpiexec`` (MPICH).

One world per size (2, 3, 4) runs every check of ``_mpi_workers.py`` (beside this file) on
every rank; each check is then its own test, failing with the message of every rank where it
failed. The 2-rank world runs MPI at ``MPI_THREAD_SERIALIZED``, the others at mpi4py's default
``MULTIPLE``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import _mpi_workers as workers
import pytest
from plugdist._backend.reduce_op import ReduceOp
from plugdist._group.process_group import OPS
from plugdist._registry import BACKENDS, registry
from plugdist.testing import run_world
from plugdist.testing.harness import mpiexec_path
from plugdist_mpi import MPIProcessGroup

pytestmark = pytest.mark.skipif(
    shutil.which(mpiexec_path()) is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs mpi4py and mpiexec: pip install 'plugdist-mpi[mpich]'")

WORLD_TIMEOUT = 150.0
THREAD_LEVEL = {2: "serialized", 3: "multiple", 4: "multiple"}
# MPICH's non-blocking reduce algorithm: plugdist's default (world 2), the user's (world 3),
# MPICH's own with plugdist's tuning off (world 4); the worlds check what they got
IREDUCE = {2: ({}, "tsp_tree"),
           3: ({"MPIR_CVAR_IREDUCE_INTRA_ALGORITHM": "tsp_ring"}, "tsp_ring"),
           4: ({"PLUGDIST_MPI_TUNE": "0"}, "")}


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"world{n}")
def world_results(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    n = request.param
    env, want = IREDUCE[n]
    results = run_world(workers.mpi_checks, n, backend="mpi", timeout=WORLD_TIMEOUT,
                        group_timeout=60.0, env={"PLUGDIST_MPI_THREAD_LEVEL": THREAD_LEVEL[n],
                                                 "PLUGDIST_TEST_IREDUCE": want, **env})
    return n, results


@pytest.mark.timeout(WORLD_TIMEOUT + 60)
@pytest.mark.parametrize("check", list(workers.CHECKS))
def test_mpi_world(world_results: tuple[int, list[dict]], check: str) -> None:
    n, results = world_results
    assert len(results) == n
    assert all(check in r for r in results), f"{check} did not run on every rank"
    failures = [r[check] for r in results if r[check]]
    assert not failures, "\n".join(failures)


# -- in-process checks: metadata, discovery, no import-time side effects -------------------------
def test_entry_point_and_capabilities() -> None:
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=BACKENDS)}
    assert eps.get("mpi") == "plugdist_mpi:MPIProcessGroup"
    assert registry.load(BACKENDS, "mpi") is MPIProcessGroup
    caps = MPIProcessGroup.static_capabilities()
    assert all(caps.is_native(op, "cpu") for op in OPS)
    assert not caps.is_native("all_reduce", "cuda")
    assert caps.reduce_ops == frozenset(ReduceOp) - {ReduceOp.AVG}
    assert caps.any_source_recv
    assert MPIProcessGroup.launcher == "mpiexec"
    dist_meta = importlib.metadata.metadata("plugdist-mpi")
    requires = " ".join(dist_meta.get_all("Requires-Dist") or [])
    for dep in ("plugdist", "torch>=2.3", "mpi4py>=3.1", "numpy", 'extra == "mpich"'):
        assert dep in requires, (dep, requires)
    pkg = Path(__import__("plugdist_mpi").__file__).parent
    assert (pkg / "py.typed").exists()


@pytest.mark.timeout(60)
def test_import_is_lazy_and_thread_level_checked() -> None:
    """Importing plugdist_mpi must not initialize MPI; a thread level it cannot use is refused
    with the reason, from is_available and from construction alike."""
    code = (
        "import sys, plugdist_mpi\n"
        "assert 'mpi4py.MPI' not in sys.modules, 'import initialized MPI'\n"
        "ok, why = plugdist_mpi.MPIProcessGroup.is_available()\n"
        "print(ok, why)\n"
    )
    env = {**os.environ, "PLUGDIST_MPI_THREAD_LEVEL": "funneled"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("False") and "'serialized' or 'multiple'" in out.stdout, out.stdout
    code2 = (
        "import plugdist_mpi\n"
        "ok, why = plugdist_mpi.MPIProcessGroup.is_available()\n"
        "assert ok and 'MPICH' in why and 'thread level multiple' in why, why\n"
        "import mpi4py\n"
        "# MPI was initialized by plugdist (after tuning), and mpi4py still finalizes it at exit\n"
        "assert mpi4py.rc.initialize is True and mpi4py.rc.finalize is True\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PLUGDIST_MPI_THREAD_LEVEL"}
    out = subprocess.run([sys.executable, "-c", code2], capture_output=True, text=True,
                         timeout=50, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("library, preset, tune, want", [
    ("MPICH Version:      5.0.2\nMPICH Release date: ...", None, None, "tsp_tree"),
    ("MPICH Version:      4.0\n", None, None, "tsp_tree"),
    ("MPICH Version:      5.0.2\n", "tsp_ring", None, "tsp_ring"),   # the user's value wins
    ("MPICH Version:      5.0.2\n", None, "0", None),                # tuning turned off
    ("MPICH Version:      3.4.3\n", None, None, None),  # 3.x names its algorithms otherwise
    ("Open MPI v5.0.5, package: Open MPI", None, None, None),
])
def test_mpich_defaults_only_where_they_are_known_to_be_valid(
        monkeypatch: pytest.MonkeyPatch, library: str, preset: str | None, tune: str | None,
        want: str | None) -> None:
    from plugdist_mpi import _mpi

    var = "MPIR_CVAR_IREDUCE_INTRA_ALGORITHM"
    for name, value in ((var, preset), (_mpi.TUNE_ENV, tune)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    tuned = _mpi._tune(library)
    assert os.environ.get(var) == want
    assert tuned == ({var: want} if want and not preset else {})
