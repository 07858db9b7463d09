"""The flight recorder: the last ops of every group of this process, dumped in torch's format.

On by default in every world: one preallocated ring per process (as torch's), filled by
:mod:`plugdist._observability.observe` with one entry per op of every group and backend, and
written as torch's flight-recorder dump (a pickled dict: ``version`` "2.10", ``pg_config``,
``pg_status``, ``entries``) to ``TORCH_FR_DUMP_TEMP_FILE<global rank>``, so torch's analyzer
reads it::

    python -m torch.distributed.flight_recorder.fr_trace DIR    # or: torchfrtrace DIR

Recording a small synchronous op costs about half a microsecond, an async one (followed to its
end through ``Work.on_completion``) a few (measured in docs/observability.md): an entry is one
list of what the op already holds (its group, name, sequence numbers, its tensors' ``shape`` and
``dtype`` objects, never the tensors themselves: the ring keeps no tensor alive) and a monotonic
clock read. A synchronous op of one tensor (the short route, which ``ProcessGroup.run_blocking``
writes) marks its completion without a clock read and leaves its thread to be found at dump time
(the thread blocked in that group's ``run_blocking``). Names, sizes, dtype strings, states and
stacks are made at dump time. Memory: ``capacity`` small lists (about 2000 x 0.3 KB).

Switches (read when a group is built): ``TORCH_FR_BUFFER_SIZE`` (entries kept; default 2000;
0 turns recording off). ``TORCH_FR_DUMP_TEMP_FILE`` (default ``/tmp/nccl_trace_rank_``,
torch's) is the dump path prefix. ``PLUGDIST_FR_STACK_DEPTH`` (default 0) is how many caller
frames each entry keeps; an entry without frames that is still in flight at a dump gets its
thread's stack at that moment (where a hung op waits), at no cost per op.
``TORCH_NCCL_ENABLE_TIMING=1`` (torch's switch for its ops' durations) gives every entry its
completion time, hence a ``duration_ms``; by default, as in torch, a completed synchronous op
records that it completed, not when.

Dumps happen on request (:func:`dump_flight_recorder`), on a signal, and when an op fails with a
``DistError`` or stays in flight past its group's timeout: then every rank dumps, through
:mod:`plugdist._observability.fr_watch` (a watcher thread that waits on the store).

Profiling names are ``<prefix>:<op>``: the prefix is the backend's name where torch's analyzer
knows it (``gloo``, ``nccl``, ...) and ``gloo`` otherwise (mpi, toy, third parties), since the
analyzer refuses any other prefix and treats ``gloo`` with no backend-specific rule; the real
backend is in the group's ``desc`` (``plugdist:<backend>``) and each entry's ``backend``.
"""

from __future__ import annotations

import itertools
import math
import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plugdist._log import get_logger
from plugdist._observability import fr_watch
from plugdist.errors import DistError

if TYPE_CHECKING:
    from plugdist.store.api import Store


__all__ = ["FlightRecorder", "recorder", "dump_flight_recorder", "dump_path", "VERSION",
           "BUFFER_ENV", "DUMP_FILE_ENV", "DEFAULT_CAPACITY", "ONE", "PAIR", "LISTS", "NONE",
           "Flat"]

VERSION = "2.10"  # the dump format torch 2.13 writes and its analyzer reads
BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
DUMP_FILE_ENV = "TORCH_FR_DUMP_TEMP_FILE"
DEPTH_ENV = "PLUGDIST_FR_STACK_DEPTH"
TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"
DEFAULT_CAPACITY = 2000
DEFAULT_DUMP_FILE = "/tmp/nccl_trace_rank_"
LIVE_DEPTH = 16  # frames of an op still in flight, read from its thread when dumping
_OWN_FILES = frozenset({__file__, __file__.replace("flight_recorder.py", "observe.py")})

# how an entry holds its op's tensors (``a``, ``b``): ONE: one tensor's shape and dtype (in- and
# output, or only one of them: see _IO_OF_ONE); PAIR: (shape, dtype) of the input and the output;
# LISTS: tuples of (shape or Flat, dtype), inputs and outputs; NONE: no tensors
ONE, PAIR, LISTS, NONE = range(4)
COMPLETED = True  # an entry's _DONE: completed, at a time not taken
_IO_OF_ONE = {"send": (True, False), "recv": (False, True)}  # (is input, is output)

# prefixes torch's analyzer accepts (fr_trace's Op); any other backend is recorded as gloo
_KNOWN_PREFIXES = frozenset({"nccl", "ncclx", "xccl", "gloo", "rccl", "rcclx", "mccl", "hccl"})
_FALLBACK_PREFIX = "gloo"
# plugdist's op names that torch's analyzer spells otherwise
_TORCH_OPS = {"all_gather_into_tensor": "_all_gather_base",
              "reduce_scatter_tensor": "_reduce_scatter_base"}

# an entry (a list, written once and then only at _DONE, and at _THREAD when an op of the short
# route fails): [record id, group, op, collective seq, p2p seq, peer, kind, a, b, created ns,
# thread id (None: the blocking short route's, see _blocked_in), started at creation, completed
# ns, or COMPLETED (done, untimed: the short routes'), or None]. Written by record, and by the
# short routes: ProcessGroup.run_blocking (blocking) and observe.run_one (async)
_ID, _GROUP, _OP, _COLL, _P2P, _PEER, _KIND, _A, _B, _CREATED, _THREAD, _STARTED, _DONE = range(13)


class Flat(tuple):  # type: ignore[type-arg]
    """The shapes of a tensor list, recorded as one flat size at dump time (as torch records the
    lists it flattens)."""


def dump_path(rank: int) -> Path:
    """Where this rank's dump goes: ``TORCH_FR_DUMP_TEMP_FILE`` + rank."""
    return Path(f"{os.environ.get(DUMP_FILE_ENV) or DEFAULT_DUMP_FILE}{rank}")


def _capacity() -> int:
    raw = os.environ.get(BUFFER_ENV, "").strip()
    if not raw:
        return DEFAULT_CAPACITY
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(f"{BUFFER_ENV}={raw!r} is not a number of entries (0 turns the "
                         f"flight recorder off)") from None


class Group:
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


class FlightRecorder:
    """The process's recorder (one: :data:`recorder`). ``on`` is read on every op.

    Threading: :meth:`record` and :meth:`completed` take no lock (each writes one slot of a
    list, which is atomic under the GIL; a completion is written into the op's own entry, found
    by its record id, so a slot reused meanwhile is never marked by an older op); :meth:`snapshot`
    copies under the lock."""

    def __init__(self) -> None:
        self.on = False
        self.fast = False  # on, no caller frames, untimed: run_blocking's short route
        self.capacity = 0
        self.ring: list[list[Any] | None] = []
        self.ids = itertools.count()
        self._errors: dict[int, str] = {}  # record id -> error, for failed ops
        self._starts: dict[int, int] = {}  # record id -> started ns, for late starts
        self._frames: dict[int, list[tuple[Any, int]]] = {}  # with PLUGDIST_FR_STACK_DEPTH
        self._lock = threading.RLock()  # re-entrant: a signal's dump may interrupt a dump
        self._groups: dict[str, Group] = {}
        self.global_rank: int | None = None
        self.depth = 0
        self.timed = False  # TIMING_ENV: every entry gets its completion time
        self.watch = fr_watch.Watcher(self)
        self._dumped_for: set[int] = set()  # record ids of overdue entries already dumped for

    # -- groups ----------------------------------------------------------------------------------
    def add_group(self, pg: Any, store: Store | None, global_ranks: tuple[int, ...],
                  global_rank: int) -> None:
        """Record ``pg`` (called when it is built); recording is on unless the buffer size is
        0. A group with a store is watched for dump requests (the first such group's store)."""
        capacity = _capacity()
        depth = os.environ.get(DEPTH_ENV, "").strip()
        timed = os.environ.get(TIMING_ENV, "").strip() not in ("", "0")
        g = Group(pg.group_name, pg.backend_name, pg.rank(), global_ranks,
                  pg.timeout.total_seconds(), store)
        with self._lock:
            if depth.isdigit():
                self.depth = int(depth)
            if capacity and capacity != self.capacity:
                self._resize(capacity)
            self.on = self.on or capacity > 0
            self.timed = timed
            self.fast = self.on and not self.depth and not timed
            self.global_rank = global_rank
            self._groups[g.name] = g
        pg._flight_group = g
        if self.on:
            self.watch.start()

    def switch(self, on: bool) -> None:
        """Turn recording on or off for every group now (benchmarks that compare the two; the
        setting is otherwise read when a group is built). On takes a ring: a group built
        with recording on."""
        with self._lock:
            self.on = on and self.capacity > 0
            self.fast = self.on and not self.depth and not self.timed

    def remove_group(self, pg: Any) -> None:
        """Forget ``pg`` (destroyed); the watcher stops with the last group it could watch,
        and moves to the next one when its group goes (a resilient world's new epoch)."""
        with self._lock:
            was = self.watched()
            self._groups.pop(pg.group_name, None)
            watched = self.watched()
        if watched is None:
            self.watch.stop()
        elif watched is not was:
            self.watch.wake()

    def watched(self) -> Group | None:
        """The group whose store carries dump requests: the oldest one with a store."""
        with self._lock:
            return next((g for g in self._groups.values() if g.store is not None), None)

    def group_of(self, pg: Any) -> Group:
        """``pg``'s record (its ``_flight_group``, set by :meth:`add_group`); a group built by
        hand, or a wrapper that observes ops itself, is found by name or recorded now."""
        try:
            return pg._flight_group  # type: ignore[no-any-return]
        except AttributeError:
            pass
        with self._lock:
            g = self._groups.get(pg.group_name)
            if g is None:
                ranks = tuple(pg.options.global_ranks) or tuple(range(pg.size()))
                g = self._groups[pg.group_name] = Group(
                    pg.group_name, pg.backend_name, pg.rank(), ranks,
                    pg.timeout.total_seconds(), None)
        pg._flight_group = g
        return g

    def _resize(self, capacity: int) -> None:
        """A new ring of ``capacity`` slots keeping the newest entries (under the lock)."""
        kept = sorted((e for e in self.ring if e is not None), key=lambda e: e[_ID])[-capacity:]
        self.ring = [None] * capacity
        for e in kept:
            self.ring[e[_ID] % capacity] = e
        self.capacity = capacity

    # -- entries ---------------------------------------------------------------------------------
    def record(self, pg: Any, op: str, p2p: bool, kind: int, a: Any, b: Any, peer: int | None,
               started: bool) -> int:
        """A new entry for ``op`` on ``pg`` (its tensors as ``kind``, ``a``, ``b``: see ONE,
        PAIR, LISTS, NONE); returns its record id. ``started``: handed to the backend now."""
        try:
            g = pg._flight_group
        except AttributeError:
            g = self.group_of(pg)
        if p2p:
            g.p2p += 1
        else:
            g.collectives += 1
        rid = next(self.ids)
        self.ring[rid % self.capacity] = [rid, g, op, g.collectives, g.p2p, peer, kind, a, b,
                                          time.monotonic_ns(), threading.get_ident(), started,
                                          None]
        if self.depth:
            self.keep_frames(rid)
        return rid

    def keep_frames(self, rid: int) -> None:
        """Keep ``depth`` frames of the caller of the op ``rid`` (PLUGDIST_FR_STACK_DEPTH)."""
        self._keep(self._frames, rid, _stack(sys._getframe(1), self.depth))

    def started(self, rid: int) -> None:
        """Mark the entry ``rid`` (recorded with ``started=False``) handed to the backend."""
        if rid not in self._starts:
            self._keep(self._starts, rid, time.monotonic_ns())

    def completed(self, rid: int) -> None:
        """Mark the entry ``rid`` completed."""
        try:
            entry = self.ring[rid % self.capacity]
        except (ZeroDivisionError, IndexError):  # the ring was reset or resized meanwhile
            return
        if entry is not None and entry[_ID] == rid:
            entry[_DONE] = time.monotonic_ns()

    def finished(self, rid: int, error: BaseException | None) -> None:
        """:meth:`completed`, or :meth:`failed` with ``error`` when there is one."""
        if error is None:
            self.completed(rid)
        else:
            self.failed(rid, error)

    def failed(self, rid: int, error: BaseException) -> None:
        """Record ``error`` for the entry ``rid``; on a DistError, every rank dumps. Keeps the
        stack of the thread that issued the op, as it is now (in the op, or waiting on it): a
        later dump (another rank's request) would otherwise read where it has moved on to."""
        self._keep(self._errors, rid, f"{type(error).__name__}: {error}")
        entry = self.ring[rid % self.capacity] if self.capacity else None
        if entry is None or entry[_ID] != rid:
            return
        here = threading.get_ident()
        if entry[_THREAD] is None:  # the short route's: failed on the thread that issued it
            entry[_THREAD] = here
        if rid not in self._frames:
            # the issuer's stack now: a Work's failure is noted on the thread that completes
            # it, while the issuer still waits on this op (it moves on before a later dump)
            f = sys._getframe(1) if entry[_THREAD] == here else \
                sys._current_frames().get(entry[_THREAD])
            if f is not None:
                self._keep(self._frames, rid, _stack(f, LIVE_DEPTH))
        if not isinstance(error, DistError):
            return
        g, op, seq = entry[_GROUP], entry[_OP], entry[_COLL]
        self.dump_everywhere(f"{op} #{seq} of group {g.name!r} failed on rank "
                             f"{self.global_rank}: {type(error).__name__}", f"{g.name}/{seq}")

    def _keep(self, table: dict[int, Any], rid: int, value: Any) -> None:
        """``table[rid] = value``, forgetting ids that left the ring."""
        table[rid] = value
        if len(table) > 2 * max(self.capacity, 1):
            oldest = rid - self.capacity
            for old in [k for k in table if k <= oldest]:
                table.pop(old, None)

    # -- dumps -----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The dump: torch's flight-recorder dict."""
        with self._lock:
            ring = [list(e) for e in self.ring if e is not None] if self.on else []
            errors, starts = dict(self._errors), dict(self._starts)
            frames = dict(self._frames)
            groups = list(self._groups.values())
        ring.sort(key=lambda e: e[_ID])
        known = {g.uid for g in groups}  # and the destroyed groups whose entries remain
        groups += list({e[_GROUP].uid: e[_GROUP] for e in ring
                        if e[_GROUP].uid not in known}.values())
        live = sys._current_frames()
        epoch = time.time_ns() - time.monotonic_ns()  # entries read the monotonic clock
        entries = [_to_dict(e, e[_DONE], starts.get(e[_ID]), errors.get(e[_ID]),
                            frames.get(e[_ID]), live, epoch) for e in ring]
        status: dict[str, dict[str, int]] = {}
        for g in groups:
            mine = [d for d in entries if d["pg_id"] == g.uid and not d["is_p2p"]]
            all_done = g.collectives if g.collectives else -1
            status[g.name] = {
                "last_enqueued_collective": g.collectives,
                "last_started_collective": max(
                    (d["collective_seq_id"] for d in mine if d["state"] != "scheduled"),
                    default=all_done),
                "last_completed_collective": max(
                    (d["collective_seq_id"] for d in mine if d["state"] == "completed"),
                    default=all_done)}
        return {
            "version": VERSION, "comm_lib_version": "",
            "pg_config": {g.name: {"name": g.name, "desc": g.desc, "backend": g.backend,
                                   "ranks": str(list(g.global_ranks))} for g in groups},
            "pg_status": status,
            "entries": entries,
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
            # a name of this thread's own: the watcher and an op's thread may dump at once
            tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
        except Exception as err:  # noqa: BLE001 - see the docstring
            log.warning("flight_recorder_dump_failed", path=str(target), error=str(err))
            return None
        log.info("flight_recorder_dumped", path=str(target), reason=reason)
        return target

    def dump_everywhere(self, reason: str, incident: str | None = None) -> None:
        """Dump here, then ask every rank of the watched group to dump (once per
        ``incident``, whichever rank asks first)."""
        self.dump(reason)
        self.watch.ask_everyone(reason, incident)

    def overdue(self) -> float | None:
        """Dump everywhere for ops in flight past their group's timeout (each once); returns
        the seconds until the next in-flight op's deadline, or None when none is in flight."""
        with self._lock:
            ring = [e for e in self.ring if e is not None and e[_DONE] is None] if self.on \
                else []
            errors = set(self._errors)
        now = time.monotonic_ns()
        late: list[list[Any]] = []
        soonest: float | None = None
        for e in sorted(ring, key=lambda e: e[_ID]):
            if e[_ID] in errors or e[_ID] in self._dumped_for:
                continue
            left = (e[_CREATED] + e[_GROUP].timeout_ns - now) / 1e9
            if left < 0:
                late.append(e)
            elif soonest is None or left < soonest:
                soonest = left
        if late:
            self._dumped_for.update(e[_ID] for e in late)
            first = late[0]
            self.dump_everywhere(f"{first[_OP]} #{first[_COLL]} of group {first[_GROUP].name!r} "
                                 f"past its timeout on rank {self.global_rank}",
                                 f"{first[_GROUP].name}/{first[_COLL]}")
        return soonest

    def shortest_timeout(self) -> float:
        """The shortest timeout of the recorded groups, in seconds (1800 when none)."""
        with self._lock:
            return min((g.timeout_ns / 1e9 for g in self._groups.values()), default=1800.0)

    def reset(self) -> None:
        """Forget every entry and group and turn recording off (tests)."""
        self.watch.stop()
        with self._lock:
            self.on = self.fast = False
            self.capacity = 0
            self.ring = []
            self._groups.clear()
            self._errors.clear()
            self._starts.clear()
            self._frames.clear()
            self._dumped_for.clear()


def _stack(f: Any, depth: int) -> list[tuple[Any, int]]:
    """Up to ``depth`` frames from ``f`` outwards, skipping the recorder's own."""
    frames: list[tuple[Any, int]] = []
    while f is not None and len(frames) < depth:
        if f.f_code.co_filename not in _OWN_FILES:
            frames.append((f.f_code, f.f_lineno))
        f = f.f_back
    return frames


def _sizes(kind: int, op: str, a: Any, b: Any) -> tuple[list[Any], list[Any], list[Any],
                                                        list[Any]]:
    """(input sizes, input dtypes, output sizes, output dtypes) of an entry's tensors."""
    if kind == ONE:
        if a is None:
            return [], [], [], []
        is_in, is_out = _IO_OF_ONE.get(op, (True, True))
        one = ([_size(a)], [_dtype_name(b)])
        return (*(one if is_in else ([], [])), *(one if is_out else ([], [])))
    if kind == PAIR:
        return [_size(a[0])], [_dtype_name(a[1])], [_size(b[0])], [_dtype_name(b[1])]
    if kind == LISTS:
        return ([_size(s) for s, _ in a], [_dtype_name(d) for _, d in a],
                [_size(s) for s, _ in b], [_dtype_name(d) for _, d in b])
    return [], [], [], []


def _size(shape: Any) -> list[int]:
    if isinstance(shape, Flat):
        return [sum(math.prod(s) for s in shape)]
    return list(shape)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _blocked_in(g: Group, live: dict[int, Any]) -> int | None:
    """The thread blocked in ``run_blocking`` of the group recorded as ``g`` (the thread of an
    in-flight entry of the short route, which keeps none), or None."""
    for thread, f in live.items():
        while f is not None:
            if f.f_code.co_name == "run_blocking" and \
                    getattr(f.f_locals.get("self"), "_flight_group", None) is g:
                return thread
            f = f.f_back
    return None


def _to_dict(e: list[Any], done: int | None, late_start: int | None, error: str | None,
             frames: list[tuple[Any, int]] | None, live: dict[int, Any],
             epoch: int) -> dict[str, Any]:
    """One entry in torch's terms; ``live`` (thread id -> current frame) gives an op still in
    flight its thread's stack, when it kept none of its own; ``epoch`` turns the monotonic
    clock's times into the system clock's (torch's)."""
    g, op = e[_GROUP], e[_OP]
    started = e[_CREATED] if e[_STARTED] else late_start
    created = e[_CREATED] + epoch
    if started is not None:
        started += epoch
    state = "completed" if done is not None else "started" if started is not None \
        else "scheduled"
    if done is COMPLETED:
        done = None
    elif done is not None:
        done += epoch
    thread = e[_THREAD]
    if thread is None and state != "completed":
        thread = _blocked_in(g, live)
    if not frames:
        frames = []
        if state != "completed" and thread in live:
            frames = _stack(live[thread], LIVE_DEPTH)
    in_sizes, in_dtypes, out_sizes, out_dtypes = _sizes(e[_KIND], op, e[_A], e[_B])
    name = _TORCH_OPS.get(op, op)
    if op == "send":
        name = f"send {g.rank}->{e[_PEER]}"
    elif op == "recv":
        name = f"recv {g.rank}<-{-1 if e[_PEER] is None else e[_PEER]}"
    return {
        "record_id": e[_ID], "pg_id": g.uid, "process_group": (g.name, g.desc),
        "collective_seq_id": e[_COLL], "p2p_seq_id": e[_P2P],
        "op_id": e[_ID], "profiling_name": f"{g.prefix}:{name}",
        "time_created_ns": created,
        "input_sizes": in_sizes, "input_dtypes": in_dtypes,
        "output_sizes": out_sizes, "output_dtypes": out_dtypes,
        "state": state, "time_discovered_started_ns": started,
        "time_discovered_completed_ns": done, "retired": state == "completed",
        "timeout_ms": g.timeout_ns // 1_000_000, "is_p2p": op in ("send", "recv"),
        "duration_ms": None if done is None or started is None else (done - started) / 1e6,
        "frames": [{"name": code.co_name, "filename": code.co_filename, "line": line}
                   for code, line in frames],
        "thread_id": "" if thread is None else str(thread), "thread_name": "",
        "backend": g.backend,
        "error": error,
    }


recorder = FlightRecorder()


def dump_flight_recorder(path: str | os.PathLike[str] | None = None,
                         reason: str = "on request") -> Path | None:
    """Write this rank's flight-recorder dump now (to ``TORCH_FR_DUMP_TEMP_FILE<rank>`` unless
    ``path`` is given) and return its path. Not collective; any thread. With recording off
    (``TORCH_FR_BUFFER_SIZE=0``) the dump lists groups only."""
    return recorder.dump(reason, path)
