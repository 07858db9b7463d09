"""Testing helpers for plugdist and for third-party backend authors.

* :func:`run_world` starts real processes (or one ``mpiexec``), runs a function on each rank and
  returns every rank's result, with a per-rank report on errors and hangs (and, for a rank that
  crashed, its threads' stacks); :func:`heap_check_env` gives its ranks glibc's heap checks;
  :func:`wait_for` waits for a condition with a deadline (a test's way to wait, never a count of
  sleeps).
* :mod:`plugdist.testing.conformance` is the conformance suite; run it against any installed
  backend with ``pytest --pyargs plugdist.testing.conformance --plugdist-backend NAME``.
"""

from plugdist.testing.harness import (
    RankResult,
    WorldError,
    free_port,
    heap_check_env,
    run_world,
    wait_for,
)

__all__ = ["run_world", "RankResult", "WorldError", "free_port", "heap_check_env", "wait_for"]
