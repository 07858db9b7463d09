"""Every process-spawning harness notices a rank that failed and reports it within seconds.

run_world (the testing harness) and the benchmarks built on it (plugdist-bench,
benchmarks/ddp_bench.py) stop the other ranks a few seconds after the first failure, instead of
letting them wait for the dead rank until a timeout, and name the failed rank's error.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import _harness_workers as hw
import plugdist
import pytest
from plugdist.testing import WorldError, run_world

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(100)
def test_a_rank_that_raises_or_dies_stops_the_world_within_seconds() -> None:
    start = time.monotonic()
    with pytest.raises(WorldError) as info:
        run_world(hw.one_raises_one_dies_one_waits, 3, timeout=90)
    elapsed = time.monotonic() - start
    # without the failure watch, rank 2 would sleep until the 90 s timeout
    assert elapsed < 60, f"took {elapsed:.0f}s to notice the failed ranks"
    report = str(info.value)
    assert "failed first" in report and "stopped" in report, report
    assert "ValueError: planted failure on rank 0" in report, report
    results = info.value.results
    assert results[0].exception_type == "ValueError"
    assert results[1].exitcode == 7, results[1]
    assert not results[2].ok and results[2].exitcode != 0, results[2]


@pytest.mark.timeout(100)
def test_expect_errors_still_waits_for_every_rank_to_report() -> None:
    # the caller asked for every rank's own outcome: no rank is cut short after a failure
    results = run_world(hw.first_raises_second_returns_later, 2, args=(3.0,), timeout=90,
                        expect_errors=True, failure_grace=0.5)
    assert results[0].exception_type == "ValueError", results[0]
    assert results[1].ok and results[1].value == "finished", results[1]


@pytest.mark.timeout(100)
def test_mpiexec_world_stops_on_a_rank_error_within_seconds() -> None:
    if not plugdist.is_backend_available("mpi"):
        pytest.skip("plugdist-mpi is not installed")
    start = time.monotonic()
    with pytest.raises(WorldError) as info:
        run_world(hw.last_raises_others_wait, 2, launcher="mpiexec", timeout=90)
    assert time.monotonic() - start < 60
    assert "RuntimeError: planted failure on rank 1" in str(info.value), str(info.value)


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.mark.timeout(100)
def test_plugdist_bench_exits_1_with_the_rank_error() -> None:
    res = _run([sys.executable, "-m", "plugdist._tools.bench", "--backend", "no-such-backend",
                "--nproc", "2", "-e", "8", "--timeout", "80"], timeout=90)
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr.startswith("plugdist-bench: world of 2 ranks failed"), res.stderr
    assert "no-such-backend" in res.stderr


@pytest.mark.timeout(150)
def test_ddp_bench_runs_over_mpi_and_fails_cleanly() -> None:
    if not plugdist.is_backend_available("mpi"):
        pytest.skip("plugdist-mpi is not installed")
    small = ["--layers", "1", "--width", "16", "--batch", "4", "--warmup", "1", "--iters", "2",
             "--rounds", "1", "--variants", "torch,plugdist"]
    bench = str(REPO / "benchmarks" / "ddp_bench.py")
    res = _run([sys.executable, bench, "--backend", "mpi", *small], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "backend mpi (torch: gloo)" in res.stdout and "ratio plugdist/torch" in res.stdout
    res = _run([sys.executable, bench, "--backend", "no-such-backend", *small], timeout=60)
    assert res.returncode == 1 and "ddp_bench: world of 2 ranks failed" in res.stderr, res.stderr


@pytest.mark.timeout(300)
def test_a_rank_that_corrupts_its_heap_is_reported_with_its_stacks() -> None:
    results = run_world(hw.frees_a_block_twice, 2, timeout=240, expect_errors=True,
                        crash_backtraces=True)
    assert results[0].ok and results[0].value == "fine"
    crashed = results[1]
    assert crashed.exitcode == -6, crashed  # SIGABRT, raised by glibc's heap check
    assert "double free" in crashed.stderr_tail
    # faulthandler: the Python stack of the thread that crashed
    assert "Fatal Python error: Aborted" in crashed.stderr_tail
    assert "frees_a_block_twice" in crashed.stderr_tail
    # the core, read by gdb: the crashing thread's native frames
    if shutil.which("gdb") is None:
        assert "gdb is not installed" in crashed.native_backtrace
    else:
        frames = crashed.native_backtrace.split("== every thread")[0]
        assert "== the thread that crashed" in frames, crashed.native_backtrace
        assert "abort" in frames and "free" in frames, crashed.native_backtrace
    assert results[0].native_backtrace == ""
