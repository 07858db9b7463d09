"""The conformance suite on every installed, available backend (gloo, mpi, toy; nccl with a GPU),
world sizes 1-4; plus the one command a third-party author runs on their own backend."""

import os
import subprocess
import sys

import pytest
from plugdist.testing.conformance import conformance_results, test_conformance  # noqa: F401


@pytest.mark.timeout(300)
def test_third_party_author_command_runs_suite_on_toy_backend() -> None:
    """The documented command, as an author would type it, on a backend that implements only
    send/recv: every other op must come from composition and pass."""
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "plugdist.testing.conformance",
           "--plugdist-backend", "toy", "--plugdist-world-sizes", "3", "-q",
           "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280,
                          cwd=os.path.dirname(__file__),
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTEST_ADDOPTS": ""})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "passed" in last and "failed" not in last, last
