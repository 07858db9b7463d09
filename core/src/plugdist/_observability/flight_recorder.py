"""The flight recorder: the last ops of every group of this process, dumped in torch's format.

One ring buffer per process (as torch's), filled by :mod:`plugdist._observability.observe` with
one entry per
op of every group and backend, and written as torch's flight-recorder dump (a pickled dict:
``version`` "2.10", ``pg_config``, ``pg_status``, ``entries``) to
``TORCH_FR_DUMP_TEMP_FILE<global rank>``, so torch's analyzer reads it::

    python -m torch.distributed.flight_recorder.fr_trace DIR    # or: torchfrtrace DIR

Switches (read when a group is built): ``TORCH_FR_BUFFER_SIZE`` (entries kept; 0 or unset: off)
or ``TORCH_DISTRIBUTED_DEBUG``/``PLUGDIST_DEBUG`` ``DETAIL`` (2000 entries unless the buffer size
says otherwise). ``TORCH_FR_DUMP_TEMP_FILE`` (default ``/tmp/nccl_trace_rank_``, torch's) is the
dump path prefix. ``PLUGDIST_FR_DUMP_SIGNAL`` (default ``SIGUSR1``; ``OFF``: none) dumps on a
signal. ``PLUGDIST_FR_STACK_DEPTH`` (default 0) is how many caller frames each entry keeps; an
entry without frames that is still in flight at a dump gets its thread's stack at that moment
(where a hung op waits), at no cost per op.

Dumps happen on request (:func:`dump_flight_recorder`), on that signal, and when an op of a
recorded group fails with a ``DistError`` (a timeout, a dead rank, a DETAIL mismatch) or stays
in flight past its group's timeout: the rank that sees it dumps and asks every member of the
group to dump too, through the group's store (key ``flight_recorder/dump``), which a watcher
thread polls (``PLUGDIST_FR_POLL_S``, default 1 s) while recording is on.

Profiling names are ``<prefix>:<op>``: the prefix is the backend's name where torch's analyzer
knows it (``gloo``, ``nccl``, ...) and ``gloo`` otherwise (mpi, toy, third parties), since the
analyzer refuses any other prefix and treats ``gloo`` with no backend-specific rule; the real
backend is in the group's ``desc`` (``plugdist:<backend>``) and each entry's ``backend``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import pickle
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plugdist._debug_level import DebugLevel, get_debug_level
from plugdist._log import get_logger
from plugdist.errors import DistError

if TYPE_CHECKING:
    from plugdist.store.api import Store


__all__ = ["FlightRecorder", "Entry", "recorder", "dump_flight_recorder", "dump_path",
           "VERSION", "BUFFER_ENV", "DUMP_FILE_ENV", "SIGNAL_ENV", "DEFAULT_CAPACITY"]

VERSION = "2.10"  # the dump format torch 2.13 writes and its analyzer reads
BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
DUMP_FILE_ENV = "TORCH_FR_DUMP_TEMP_FILE"
SIGNAL_ENV = "PLUGDIST_FR_DUMP_SIGNAL"
POLL_ENV = "PLUGDIST_FR_POLL_S"
DEFAULT_CAPACITY = 2000
DEFAULT_DUMP_FILE = "/tmp/nccl_trace_rank_"
REQUEST_KEY = "flight_recorder/dump"
_NO_FRAMES: list[tuple[Any, int]] = []  # shared, never mutated
_OWN_FILES = frozenset({__file__, __file__.replace("flight_recorder.py", "observe.py")})

# prefixes torch's analyzer accepts (fr_trace's Op); any other backend is recorded as gloo
_KNOWN_PREFIXES = frozenset({"nccl", "ncclx", "xccl", "gloo", "rccl", "rcclx", "mccl", "hccl"})
_FALLBACK_PREFIX = "gloo"
# plugdist's op names that torch's analyzer spells otherwise
_TORCH_OPS = {"all_gather_into_tensor": "_all_gather_base",
              "reduce_scatter_tensor": "_reduce_scatter_base"}
DEPTH_ENV = "PLUGDIST_FR_STACK_DEPTH"
DEFAULT_DEPTH = 0  # caller frames kept per entry: each costs a frame object per op
LIVE_DEPTH = 16  # frames of an op still in flight, read from its thread when dumping


def dump_path(rank: int) -> Path:
    """Where this rank's dump goes: ``TORCH_FR_DUMP_TEMP_FILE`` + rank."""
    return Path(f"{os.environ.get(DUMP_FILE_ENV) or DEFAULT_DUMP_FILE}{rank}")


def _capacity() -> int:
    raw = os.environ.get(BUFFER_ENV, "").strip()
    if raw:
        try:
            return max(0, int(raw))
        except ValueError:
            raise ValueError(f"{BUFFER_ENV}={raw!r} is not a number of entries") from None
    return DEFAULT_CAPACITY if get_debug_level() is DebugLevel.DETAIL else 0


class Entry:
    """One op as this rank saw it: created when the op arrives (``scheduled``), ``started`` once
    handed to the backend, ``completed`` when it finished (a failed op keeps its state and
    records ``error``). Mutated by the recorder only."""

    __slots__ = ("record_id", "group", "op", "collective_seq_id", "p2p_seq_id", "peer",
                 "inputs", "outputs", "state", "time_created_ns", "time_started_ns",
                 "time_completed_ns", "error", "frames", "thread")

    def __init__(self, record_id: int, group: _Group, op: str, coll: int, p2p: int,
                 peer: int | None, inputs: list[Any], outputs: list[Any],
                 frames: list[tuple[Any, int]]) -> None:
        self.record_id = record_id
        self.group = group
        self.op = op
        self.collective_seq_id = coll
        self.p2p_seq_id = p2p
        self.peer = peer
        self.inputs = inputs  # (shape, dtype) pairs
        self.outputs = outputs
        self.state = "scheduled"
        self.time_created_ns = time.time_ns()
        self.time_started_ns: int | None = None
        self.time_completed_ns: int | None = None
        self.error: str | None = None
        self.frames = frames
        self.thread = threading.get_ident()

    def to_dict(self, live: dict[int, Any]) -> dict[str, Any]:
        """The entry in torch's terms; ``live`` (thread id -> current frame) gives an op still
        in flight its thread's stack, when it kept none of its own."""
        g = self.group
        frames = self.frames
        if not frames and self.state != "completed" and self.thread in live:
            frames = _stack(live[self.thread], LIVE_DEPTH)
        is_p2p = self.op in ("send", "recv")
        op = _TORCH_OPS.get(self.op, self.op)
        if self.op == "send":
            op = f"send {g.rank}->{self.peer}"
        elif self.op == "recv":
            op = f"recv {g.rank}<-{-1 if self.peer is None else self.peer}"
        started = self.time_started_ns
        done = self.time_completed_ns
        return {
            "record_id": self.record_id, "pg_id": g.uid, "process_group": (g.name, g.desc),
            "collective_seq_id": self.collective_seq_id, "p2p_seq_id": self.p2p_seq_id,
            "op_id": self.record_id, "profiling_name": f"{g.prefix}:{op}",
            "time_created_ns": self.time_created_ns,
            "input_sizes": [list(s) for s, _ in self.inputs],
            "input_dtypes": [_dtype_name(d) for _, d in self.inputs],
            "output_sizes": [list(s) for s, _ in self.outputs],
            "output_dtypes": [_dtype_name(d) for _, d in self.outputs],
            "state": self.state, "time_discovered_started_ns": started,
            "time_discovered_completed_ns": done, "retired": done is not None,
            "timeout_ms": g.timeout_ns // 1_000_000, "is_p2p": is_p2p,
            "duration_ms": None if done is None or started is None else (done - started) / 1e6,
            "frames": [{"name": code.co_name, "filename": code.co_filename, "line": line}
                       for code, line in frames],
            "thread_id": str(self.thread), "thread_name": "", "backend": g.backend,
            "error": self.error,
        }


def _stack(f: Any, depth: int) -> list[tuple[Any, int]]:
    """Up to ``depth`` frames from ``f`` outwards, skipping the recorder's own."""
    frames: list[tuple[Any, int]] = []
    while f is not None and len(frames) < depth:
        if f.f_code.co_filename not in _OWN_FILES:
            frames.append((f.f_code, f.f_lineno))
        f = f.f_back
    return frames


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class _Group:
    """What the recorder knows of one group: identity, sequence numbers, and its store."""

    _uids = itertools.count()

    def __init__(self, name: str, backend: str, rank: int, global_ranks: tuple[int, ...],
                 timeout_s: float, store: Store | None) -> None:
        self.name = name
        self.backend = backend
        self.prefix = backend if backend in _KNOWN_PREFIXES else _FALLBACK_PREFIX
        self.desc = f"plugdist:{backend}"
        self.rank = rank
        self.global_ranks = global_ranks
        self.timeout_ns = int(timeout_s * 1e9)
        self.store = store
        self.uid = next(self._uids)
        self.collectives = 0
        self.p2p = 0
        self.last_started = -1
        self.last_completed = -1
        self.requests_seen = 0


class FlightRecorder:
    """The process's recorder (one: :data:`recorder`). ``on`` is read on every op. Thread-safe:
    entries are appended atomically; a dump copies them under the lock."""

    def __init__(self) -> None:
        self.on = False
        self.capacity = 0
        self._ring: deque[Entry] = deque(maxlen=1)
        self._ids = itertools.count()
        self._lock = threading.RLock()  # re-entrant: a signal's dump may interrupt record()
        self._groups: dict[str, _Group] = {}
        self.global_rank: int | None = None
        self.depth = DEFAULT_DEPTH
        self._watcher: threading.Thread | None = None
        self._stop_at_exit = False  # stop() registered with atexit
        self._stop = threading.Event()
        self._dumped_for: set[int] = set()  # record ids of overdue entries already dumped for

    # -- groups ----------------------------------------------------------------------------------
    def add_group(self, pg: Any, store: Store | None, global_ranks: tuple[int, ...],
                  global_rank: int) -> None:
        """Record ``pg`` (called when it is built); turns recording on if the settings ask."""
        capacity = _capacity()
        depth = os.environ.get(DEPTH_ENV, "").strip()
        with self._lock:
            if depth.isdigit():
                self.depth = int(depth)
            if capacity and capacity != self.capacity:
                self._ring = deque(self._ring, maxlen=capacity)
                self.capacity = capacity
            self.on = self.on or capacity > 0
            self.global_rank = global_rank
            self._groups[pg.group_name] = _Group(
                pg.group_name, pg.backend_name, pg.rank(), global_ranks,
                pg.timeout.total_seconds(), store)
        if self.on:
            self._start_watcher()
            _install_signal_handler()

    def remove_group(self, pg: Any) -> None:
        with self._lock:
            self._groups.pop(pg.group_name, None)

    def _group(self, pg: Any) -> _Group:
        g = self._groups.get(pg.group_name)
        if g is None:  # a group built outside build_group (tests, hand-made groups)
            ranks = tuple(pg.options.global_ranks) or tuple(range(pg.size()))
            with self._lock:
                g = self._groups.setdefault(pg.group_name, _Group(
                    pg.group_name, pg.backend_name, pg.rank(), ranks,
                    pg.timeout.total_seconds(), None))
        return g

    # -- entries ---------------------------------------------------------------------------------
    def record(self, pg: Any, op: str, inputs: list[Any], outputs: list[Any],
               peer: int | None) -> Entry:
        """A new ``scheduled`` entry for ``op`` on ``pg`` (kept only when recording is on)."""
        g = self._group(pg)
        if op == "send" or op == "recv":
            g.p2p += 1
        else:
            g.collectives += 1
        depth = self.depth
        frames = _stack(sys._getframe(1), depth) if depth else _NO_FRAMES
        entry = Entry(next(self._ids), g, op, g.collectives, g.p2p, peer, inputs, outputs,
                      frames)
        if self.on:
            self._ring.append(entry)
        return entry

    def started(self, entry: Entry, now: bool = False) -> None:
        """Mark ``entry`` handed to the backend; ``now``: at its creation (one clock read less:
        this machine's clock costs ~0.2 us a read)."""
        if entry.time_started_ns is None:
            entry.time_started_ns = entry.time_created_ns if now else time.time_ns()
            entry.state = "started"
            if entry.op != "send" and entry.op != "recv":
                entry.group.last_started = entry.collective_seq_id

    def finished(self, entry: Entry, error: BaseException | None) -> None:
        """Mark ``entry`` completed, or record ``error``; on a DistError, dump everywhere."""
        if error is None:
            entry.time_completed_ns = time.time_ns()
            entry.state = "completed"
            if entry.op != "send" and entry.op != "recv":
                entry.group.last_completed = entry.collective_seq_id
            return
        entry.error = f"{type(error).__name__}: {error}"
        if self.on and isinstance(error, DistError):
            self.dump_everywhere(entry.group,
                                 f"{entry.op} #{entry.collective_seq_id} failed: "
                                 f"{type(error).__name__}")

    # -- dumps -----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The dump: torch's flight-recorder dict."""
        with self._lock:
            entries = list(self._ring) if self.on else []
            groups = list(self._groups.values())
        live = sys._current_frames()
        return {
            "version": VERSION, "comm_lib_version": "",
            "pg_config": {g.name: {"name": g.name, "desc": g.desc, "backend": g.backend,
                                   "ranks": str(list(g.global_ranks))} for g in groups},
            "pg_status": {g.name: {"last_enqueued_collective": g.collectives,
                                   "last_started_collective": g.last_started,
                                   "last_completed_collective": g.last_completed}
                          for g in groups},
            "entries": [e.to_dict(live) for e in entries],
        }

    def dump(self, reason: str, path: str | os.PathLike[str] | None = None) -> Path | None:
        """Write the dump (pickled, replacing an earlier one) to ``path`` (default
        :func:`dump_path`). Returns the path, or None when it could not be written (logged,
        never raised: a dump must not hide the error that caused it)."""
        rank = self.global_rank if self.global_rank is not None else 0
        target = Path(path) if path is not None else dump_path(rank)
        log = get_logger(rank=rank)
        try:
            data = pickle.dumps(self.snapshot())
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
        except Exception as err:  # noqa: BLE001 - see the docstring
            log.warning("flight_recorder_dump_failed", path=str(target), error=str(err))
            return None
        log.info("flight_recorder_dumped", path=str(target), reason=reason)
        return target

    def dump_everywhere(self, group: _Group, reason: str) -> None:
        """Dump here, then ask every member of ``group`` to dump (through its store)."""
        self.dump(reason)
        store = group.store
        if store is None:
            return
        try:
            group.requests_seen = store.add(REQUEST_KEY, 1)  # ours: not to be answered again
        except Exception as err:  # noqa: BLE001 - the store may be what failed
            get_logger(rank=self.global_rank, group=group.name).warning(
                "flight_recorder_dump_request_failed", error=str(err))

    # -- the watcher: peers' dump requests, ops in flight past their timeout ---------------------
    def _start_watcher(self) -> None:
        with self._lock:
            if self._watcher is not None and self._watcher.is_alive():
                return
            self._stop.clear()
            self._watcher = threading.Thread(target=self._watch, name="plugdist-flight-recorder",
                                             daemon=True)
            self._watcher.start()
            if not self._stop_at_exit:
                # a daemon thread still inside a C++ store call when the interpreter ends
                # aborts the process ("terminate called without an active exception")
                self._stop_at_exit = True
                atexit.register(self.stop)

    def _watch(self) -> None:
        period = float(os.environ.get(POLL_ENV) or 1.0)
        while not self._stop.wait(period):
            with self._lock:
                groups = list(self._groups.values())
            for g in groups:
                self._answer_requests(g)
            self._check_overdue()

    def _answer_requests(self, g: _Group) -> None:
        if g.store is None:
            return
        try:  # check first: polling must not create the key
            asked = int(g.store.get(REQUEST_KEY)) if g.store.check([REQUEST_KEY]) else 0
        except Exception:  # noqa: BLE001 - a store going away at shutdown
            return
        if asked > g.requests_seen:
            g.requests_seen = asked
            self.dump(f"asked by a peer of group {g.name!r}")

    def _check_overdue(self) -> None:
        now = time.time_ns()
        late = [e for e in list(self._ring)
                if e.state != "completed" and e.error is None
                and e.time_created_ns + e.group.timeout_ns < now
                and e.record_id not in self._dumped_for]
        if late:
            first = late[0]
            self._dumped_for.update(e.record_id for e in late)
            self.dump_everywhere(first.group, f"{first.op} #{first.collective_seq_id} of group "
                                              f"{first.group.name!r} past its timeout")

    def stop(self) -> None:
        """Stop the watcher and wait (briefly) for it to end."""
        self._stop.set()
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=5)

    def reset(self) -> None:
        """Forget every entry and group and turn recording off (tests)."""
        self.stop()
        with self._lock:
            self.on = False
            self.capacity = 0
            self._ring = deque(maxlen=1)
            self._groups.clear()
            self._dumped_for.clear()


recorder = FlightRecorder()


def dump_flight_recorder(path: str | os.PathLike[str] | None = None,
                         reason: str = "on request") -> Path | None:
    """Write this rank's flight-recorder dump now (to ``TORCH_FR_DUMP_TEMP_FILE<rank>`` unless
    ``path`` is given) and return its path. Not collective; any thread. Records nothing unless
    recording is on (``TORCH_FR_BUFFER_SIZE`` or DETAIL): the dump then lists groups only."""
    return recorder.dump(reason, path)


_signal_installed = False


def _install_signal_handler() -> None:
    """Dump on ``PLUGDIST_FR_DUMP_SIGNAL`` (default SIGUSR1): once, from the main thread, and
    only when nobody else handles that signal."""
    global _signal_installed
    if _signal_installed or threading.current_thread() is not threading.main_thread():
        return
    _signal_installed = True
    name = os.environ.get(SIGNAL_ENV, "SIGUSR1").strip().upper()
    if name in ("", "0", "OFF", "NONE"):
        return
    signum = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
    if not isinstance(signum, signal.Signals):
        get_logger().warning("flight_recorder_bad_signal", setting=f"{SIGNAL_ENV}={name!r}",
                             hint="use a signal name such as SIGUSR1, or OFF")
        return
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(signum) in (signal.SIG_DFL, None):
            signal.signal(signum, _on_signal)


def _on_signal(signum: int, _frame: Any) -> None:
    recorder.dump(f"signal {signal.Signals(signum).name}")
