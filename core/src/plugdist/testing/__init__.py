"""Testing helpers for plugdist and for third-party backend authors.

* :func:`run_world` starts real processes (or one ``mpiexec``), runs a function on each rank and
  returns every rank's result, with a per-rank report on errors and hangs.
* :mod:`plugdist.testing.conformance` is the conformance suite; run it against any installed
  backend with ``pytest --pyargs plugdist.testing.conformance --plugdist-backend NAME``.
"""

from .harness import RankResult, WorldError, free_port, run_world

__all__ = ["run_world", "RankResult", "WorldError", "free_port"]
