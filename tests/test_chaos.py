"""The chaos soak (benchmarks/chaos.py), short: one round of every fault kind on gloo under
plugdist-run --replace-failed, and every invariant checked from the workers' records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.resilience

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["kill", "segv", "stop", "gil", "two", "during_shrink", "join_kill", "transfer"]


@pytest.mark.timeout(600)
def test_a_round_of_every_fault_kind_breaks_no_invariant(tmp_path: Path) -> None:
    report_file = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--backend", "gloo",
         "--faults", str(len(KINDS)), "--mean-interval", "2", "--seed", "1",
         "--dir", str(tmp_path / "records"), "--json", str(report_file)],
        capture_output=True, text=True, timeout=560)
    assert report_file.exists(), f"no report:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    report = json.loads(report_file.read_text())
    assert report["violations"] == [], done.stdout[-5000:]
    assert done.returncode == 0, done.stdout[-3000:]
    assert report["faults_by_kind"] == {k: 1 for k in sorted(KINDS)}, report
    assert report["final_world"] == 4 and report["committed_steps"] > 0, report
