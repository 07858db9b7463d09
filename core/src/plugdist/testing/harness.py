"""Run a function on N real processes and collect what each rank returned.

Each rank is a fresh ``python -m plugdist.testing.worker`` process (or all ranks one ``mpiexec``),
so nothing is shared but the loopback network and a scratch directory. The function is passed by
reference (module and name), so it must be defined at module level; the parent's ``sys.path``
is handed to the children so test modules import the same way.
"""

from __future__ import annotations

import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plugdist._launcher.rendezvous import free_port
from plugdist.errors import DistError, WorldError

__all__ = ["run_world", "RankResult", "WorldError", "free_port", "mpiexec_path", "FAILURE_GRACE",
           "heap_check_env"]

# seconds the other ranks get, once one failed, to finish or report their own error
FAILURE_GRACE = 3.0



def wait_for(condition: Callable[[], Any], timeout: float, interval: float = 0.01) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds, asked every ``interval``
    seconds (blocking). It is asked once more at the deadline, so a condition that holds by
    then counts even on a machine too busy to wake in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return bool(condition())

@dataclass
class RankResult:
    """What one rank did: its return value, or its traceback, or that it never finished."""

    rank: int
    value: Any = None
    error: str | None = None      # formatted traceback of an exception raised by the function
    exception_type: str | None = None
    exitcode: int | None = None   # None: still running when the world was stopped
    stderr_tail: str = ""
    native_backtrace: str = ""    # gdb's, from the core of a rank that crashed (crash_backtraces)

    @property
    def ok(self) -> bool:
        return self.error is None and self.exitcode == 0


def mpiexec_path() -> str:
    """The ``mpiexec`` next to this interpreter (a pip-installed MPI's), else the one on PATH."""
    candidate = Path(sys.executable).with_name("mpiexec")
    return str(candidate) if candidate.exists() else "mpiexec"


def heap_check_env() -> dict[str, str]:
    """The environment that gives a process glibc's debugging malloc (``libc_malloc_debug.so``,
    glibc 2.34+, with ``MALLOC_CHECK_=3``): every ``malloc``/``free`` checks the blocks it
    touches and a corrupted heap aborts the process at once, with glibc's message, near the
    write that corrupted it rather than at some later ``malloc_consolidate``. Empty where this
    glibc has no such library. Pass it as ``run_world(env=...)``."""
    libc = None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith("libc.so."):
                    libc = path
                    break
    except OSError:
        return {}
    if libc is None:
        return {}
    debug = os.path.join(os.path.dirname(libc), "libc_malloc_debug.so.0")
    if not os.path.exists(debug):
        return {}
    preload = " ".join(p for p in (debug, os.environ.get("LD_PRELOAD", "")) if p)
    return {"LD_PRELOAD": preload, "MALLOC_CHECK_": "3"}


def _launcher_for(backend: str | None) -> str:
    if backend is None:
        return "subprocess"
    from plugdist._registry import BACKENDS, registry
    try:
        factory = registry.load(BACKENDS, backend)
    except DistError:
        return "subprocess"
    return getattr(factory, "launcher", "subprocess")


def run_world(fn: Callable[..., Any], world_size: int, *, backend: str | None = None,
              init_method: str | None = None, timeout: float = 120.0, args: Sequence[Any] = (),
              kwargs: dict[str, Any] | None = None, env: dict[str, str] | None = None,
              launcher: str | None = None, expect_errors: bool = False,
              group_timeout: float | None = None,
              failure_grace: float = FAILURE_GRACE,
              crash_backtraces: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh processes.

    With ``backend``, each rank first calls ``plugdist.init_process_group(backend, ...)`` and
    afterwards ``destroy_process_group()``. Blocks until every rank exited, or ``timeout``
    seconds passed, or — unless ``expect_errors`` — ``failure_grace`` seconds after the first
    rank failed (raised, crashed or exited without a result: its peers would otherwise wait for
    it until their group timeout); then stops the stragglers (SIGTERM, then SIGKILL). Returns
    each rank's return value, in rank order. Raises :class:`WorldError` with a per-rank report
    when a rank failed or hung — unless ``expect_errors``, which waits for every rank (bounded by
    ``timeout``: the caller wants each rank's own outcome) and returns the :class:`RankResult`
    list instead. ``launcher`` is ``"subprocess"`` or ``"mpiexec"``; by default the backend's
    ``launcher`` attribute decides.

    A rank that dies of a signal has every thread's Python stack in its output (faulthandler).
    With ``crash_backtraces`` its core is dumped as well (each rank then runs in its own
    directory under the world's scratch directory, where the kernel's default ``core_pattern``
    writes it) and gdb's native backtrace of every thread goes into its result and the report;
    the core is deleted with the scratch directory. Needs gdb; where there is none, or the
    system sends cores elsewhere, the report says so.
    """
    launcher = launcher or _launcher_for(backend)
    with tempfile.TemporaryDirectory(prefix="plugdist-world-") as tmp:
        spec = dict(module=fn.__module__, name=fn.__qualname__, args=tuple(args),
                    kwargs=dict(kwargs or {}), backend=backend, init_method=init_method,
                    sys_path=list(sys.path), out_dir=tmp, group_timeout=group_timeout,
                    core_dir=os.path.join(tmp, "cores") if crash_backtraces else None)
        if fn.__module__ == "__main__":
            raise ValueError("run_world needs a function importable by module name, not one "
                             "defined in __main__")
        spec_path = os.path.join(tmp, "spec.pkl")
        with open(spec_path, "wb") as f:
            pickle.dump(spec, f)
        base_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1",
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        cmd = [sys.executable, "-m", "plugdist.testing.worker", spec_path]
        procs: list[subprocess.Popen] = []
        err_files = []
        if launcher == "mpiexec":
            err = open(os.path.join(tmp, "mpiexec.err"), "wb")
            err_files.append(err)
            procs.append(subprocess.Popen([mpiexec_path(), "-n", str(world_size), *cmd],
                                          env=base_env, stdout=err, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        else:
            port = free_port()
            for rank in range(world_size):
                err = open(os.path.join(tmp, f"rank{rank}.err"), "wb")
                err_files.append(err)
                rank_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                procs.append(subprocess.Popen(cmd, env=rank_env, stdout=err,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        hung = False
        watch = None if expect_errors else _FailureWatch(tmp, procs, launcher)
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if now > deadline:
                    hung = True
                    break
                if watch is not None and watch.first_failure(now) is not None \
                        and now > watch.failed_at + failure_grace:
                    break
                time.sleep(0.02)
        finally:
            _stop(procs)
            for f in err_files:
                f.close()
        results = _collect(tmp, world_size, procs, launcher)
        if crash_backtraces:
            for r in results:
                r.native_backtrace = _native_backtrace(os.path.join(tmp, "cores", f"rank{r.rank}"),
                                                       r.exitcode)
    failed = [r for r in results if not r.ok]
    if expect_errors:
        return results
    if failed or hung:
        first = watch.failed_rank if watch is not None else None
        raise WorldError(_report(results, hung, timeout, first, failure_grace), results)
    return [r.value for r in results]


class _FailureWatch:
    """Notices the first rank that failed while the world runs: a process that exited non-zero
    or without a result, or (under mpiexec, one process for all ranks) an error result."""

    def __init__(self, tmp: str, procs: list[subprocess.Popen], launcher: str) -> None:
        self._tmp, self._procs, self._launcher = tmp, procs, launcher
        self._read: set[str] = set()
        self.failed_rank: int | None = None
        self.failed_at = 0.0

    def first_failure(self, now: float) -> int | None:
        """The first failed rank seen so far (-1: the mpiexec process itself), else None."""
        if self.failed_rank is None:
            rank = self._scan()
            if rank is not None:
                self.failed_rank, self.failed_at = rank, now
        return self.failed_rank

    def _scan(self) -> int | None:
        if self._launcher != "mpiexec":
            for rank, p in enumerate(self._procs):
                code = p.poll()
                if code is not None and (code != 0 or not self._has_result(rank)):
                    return rank
            return None
        for name in os.listdir(self._tmp):
            if name.startswith("rank") and name.endswith(".pkl") and name not in self._read:
                self._read.add(name)
                with open(os.path.join(self._tmp, name), "rb") as f:
                    if pickle.load(f)[0] != "ok":
                        return int(name[4:-4])
        code = self._procs[0].poll()
        return -1 if code not in (None, 0) else None

    def _has_result(self, rank: int) -> bool:
        return os.path.exists(os.path.join(self._tmp, f"rank{rank}.pkl"))


def _stop(procs: list[subprocess.Popen], grace: float = 3.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        if not live:
            break
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace
        while time.monotonic() < end and any(p.poll() is None for p in live):
            time.sleep(0.02)
    for p in procs:
        if p.poll() is None:
            p.wait()


def _tail(path: str, lines: int = 60) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _collect(tmp: str, world_size: int, procs: list[subprocess.Popen],
             launcher: str) -> list[RankResult]:
    results = []
    for rank in range(world_size):
        proc = procs[0] if launcher == "mpiexec" else procs[rank]
        err_path = os.path.join(tmp, "mpiexec.err" if launcher == "mpiexec" else f"rank{rank}.err")
        res = RankResult(rank=rank, stderr_tail=_tail(err_path))
        out = os.path.join(tmp, f"rank{rank}.pkl")
        if os.path.exists(out):
            with open(out, "rb") as f:
                status, payload, etype = pickle.load(f)
            res.exitcode = proc.returncode if launcher != "mpiexec" else 0
            if status == "ok":
                res.value = payload
            else:
                res.error, res.exception_type = payload, etype
            if launcher != "mpiexec" and proc.returncode not in (0, None) and status == "ok":
                res.error = f"exited with {proc.returncode} after returning"
        else:
            res.exitcode = proc.returncode if proc.returncode is not None else None
            if res.exitcode is None or res.exitcode < 0 or res.exitcode > 0:
                res.exitcode = res.exitcode if res.exitcode is not None else -1
            res.error = "no result: the rank crashed, was killed, or hung"
        results.append(res)
    return results


# signals whose default action dumps core
_CORE_SIGNALS = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL,
                           signal.SIGFPE, signal.SIGQUIT, signal.SIGSYS, signal.SIGTRAP})
_GDB_TIMEOUT = 90.0  # seconds gdb may take to read a core (torch's libraries are large: 10-30 s)


def _native_backtrace(directory: str, exitcode: int | None) -> str:
    """gdb's backtrace of every thread in the core dumped in ``directory`` ("" when the rank
    left no core and did not die of a signal that dumps one)."""
    core = _core_file(directory)
    if core is None:
        if exitcode is None or -exitcode not in _CORE_SIGNALS:
            return ""
        try:
            pattern = Path("/proc/sys/kernel/core_pattern").read_text().strip()
        except OSError:
            pattern = "unknown"
        return (f"no core was dumped (core_pattern {pattern!r}, hard core limit "
                f"{_core_limit()}): no native backtrace")
    gdb = shutil.which("gdb")
    if gdb is None:
        return f"core dumped ({os.path.getsize(core)} bytes), but gdb is not installed"
    cmd = [gdb, "-batch", "-nx", "-q", "-ex", "set pagination off",
           "-ex", "echo \\n== the thread that crashed\\n", "-ex", "bt 40",
           "-ex", "echo \\n== every thread\\n", "-ex", "thread apply all bt 16",
           os.path.realpath(sys.executable), core]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                              timeout=_GDB_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return f"gdb did not read the core within {_GDB_TIMEOUT:.0f} s"
    keep = [line for line in done.stdout.splitlines()
            if line.startswith(("#", "==", "Thread ", "Program terminated", "Core was"))]
    return "\n".join(keep) if keep else f"gdb found no backtrace: {done.stderr.strip()[-500:]}"


def _core_file(directory: str) -> str | None:
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    return next((os.path.join(directory, n) for n in names
                 if n == "core" or n.startswith("core.")), None)


def _core_limit() -> str:
    """The hard limit on core size, which a rank raises its own limit to."""
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    return "unlimited" if hard == resource.RLIM_INFINITY else f"{hard} bytes"


def _report(results: list[RankResult], hung: bool, timeout: float, first_failed: int | None,
            grace: float) -> str:
    if hung:
        stopped = f" (stopped after {timeout:.0f}s)"
    elif first_failed is not None:
        who = "mpiexec" if first_failed < 0 else f"rank {first_failed}"
        stopped = (f" ({who} failed first; ranks still running {grace:.0f}s later were "
                   f"stopped)")
    else:
        stopped = ""
    lines = [f"world of {len(results)} ranks failed{stopped}"]
    for r in results:
        if r.ok:
            lines.append(f"--- rank {r.rank}: ok")
            continue
        last = r.error.strip().splitlines()[-1] if r.error else ""
        lines.append(f"--- rank {r.rank}: exit {r.exitcode}: {last}")
        if r.error and "\n" in r.error:
            lines.append(r.error.rstrip())
        if r.stderr_tail:
            tail = "\n".join("    " + s for s in r.stderr_tail.splitlines())
            lines.append("    output tail:\n" + tail)
        if r.native_backtrace:
            lines.append("    native backtrace (gdb, from its core):\n"
                         + "\n".join("    " + s for s in r.native_backtrace.splitlines()))
    return "\n".join(lines)
