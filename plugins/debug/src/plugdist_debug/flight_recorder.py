"""The flight recorder: per group, a ring buffer of the last collectives this rank issued.

Each :class:`Entry` carries the op, its sequence number (collectives) or point-to-point number,
the tensors' sizes and dtypes, its fingerprint, its state (``scheduled`` when the call arrived,
``started`` once the cross-rank check passed and the backend got it, ``completed`` or ``failed``)
and wall-clock timestamps. The wrapper dumps every group's buffer as one JSON file per rank on a
timeout or a mismatch; :func:`dump_flight_recorder` and a signal (``SIGUSR2`` by default) dump on
demand. ``plugdist debug analyze DIR`` reads the files of every rank.

Settings (read when used): ``PLUGDIST_FLIGHT_RECORDER_SIZE`` (entries per group, default 2000,
0 turns recording off), ``PLUGDIST_FLIGHT_RECORDER_DIR`` (default ``./flight_recorder``),
``PLUGDIST_FLIGHT_RECORDER_SIGNAL`` (a signal name, default ``SIGUSR2``; empty or ``OFF``: none).

Thread-safe: backends complete entries from their own threads; a dump copies under a lock.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from plugdist.backend import dump_on_signal, get_logger

from ._env import env_int

__all__ = ["Entry", "FlightRecorder", "FlightRecorders", "recorders", "dump_flight_recorder",
           "install_signal_handler", "DUMP_VERSION", "SIZE_ENV", "DIR_ENV", "SIGNAL_ENV"]

DUMP_VERSION = 1
SIZE_ENV = "PLUGDIST_FLIGHT_RECORDER_SIZE"
DIR_ENV = "PLUGDIST_FLIGHT_RECORDER_DIR"
SIGNAL_ENV = "PLUGDIST_FLIGHT_RECORDER_SIGNAL"
DEFAULT_SIZE = 2000
DEFAULT_DIR = "flight_recorder"

SCHEDULED, STARTED, COMPLETED, FAILED = "scheduled", "started", "completed", "failed"


def _capacity() -> int:
    return env_int(SIZE_ENV, DEFAULT_SIZE, 0, "a number of entries")


def dump_dir() -> Path:
    """Where dumps go: ``PLUGDIST_FLIGHT_RECORDER_DIR``, else ``./flight_recorder``."""
    return Path(os.environ.get(DIR_ENV) or DEFAULT_DIR)


@dataclass
class Entry:
    """One op as this rank saw it. Mutated only through the recorder's methods."""

    id: int
    op: str
    seq: int | None = None          # collectives: the group's sequence number
    p2p_seq: int | None = None      # point-to-point: this rank's count of sends/receives
    peer: int | None = None
    sizes: list[list[int | None] | None] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    fingerprint: dict[str, Any] | None = None
    state: str = SCHEDULED
    time_scheduled: float = 0.0
    time_started: float | None = None
    time_completed: float | None = None
    error: str | None = None


class FlightRecorder:
    """The ring buffer of one group on this rank (``capacity`` 0: records nothing)."""

    def __init__(self, *, group_name: str, group_rank: int, global_ranks: tuple[int, ...],
                 backend: str, timeout: timedelta, capacity: int | None = None) -> None:
        self.group_name = group_name
        self.group_rank = group_rank
        self.global_ranks = global_ranks
        self.backend = backend
        self.timeout = timeout
        self.capacity = _capacity() if capacity is None else capacity
        self._entries: deque[Entry] = deque(maxlen=self.capacity or 1)
        # re-entrant: the dump signal's handler runs on the main thread, maybe inside record()
        self._lock = threading.RLock()
        self._ids = 0
        self.collectives_issued = 0  # sequence numbers handed out, the ring's size aside

    @property
    def global_rank(self) -> int:
        return self.global_ranks[self.group_rank]

    def record(self, op: str, *, seq: int | None = None, p2p_seq: int | None = None,
               peer: int | None = None, fingerprint: dict[str, Any] | None = None) -> Entry:
        """A new ``scheduled`` entry (kept only when the capacity is not 0)."""
        sizes: list[list[int | None] | None] = []
        dtypes: list[str] = []
        for _role, shape, dtype, _device in (fingerprint or {}).get("tensors", ()):
            sizes.append(shape)
            dtypes.append(dtype)
        with self._lock:
            self._ids += 1
            entry = Entry(id=self._ids, op=op, seq=seq, p2p_seq=p2p_seq, peer=peer, sizes=sizes,
                          dtypes=dtypes, fingerprint=fingerprint, time_scheduled=time.time())
            if seq is not None:
                self.collectives_issued = max(self.collectives_issued, seq)
            if self.capacity:
                self._entries.append(entry)
        return entry

    def start(self, entry: Entry) -> None:
        with self._lock:
            entry.state, entry.time_started = STARTED, time.time()

    def complete(self, entry: Entry, error: BaseException | str | None = None) -> None:
        """Mark ``entry`` completed, or failed with ``error``. Any thread."""
        with self._lock:
            entry.time_completed = time.time()
            if error is None:
                entry.state = COMPLETED
            else:
                entry.state = FAILED
                entry.error = (error if isinstance(error, str)
                               else f"{type(error).__name__}: {error}")

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            entries = [asdict(e) for e in self._entries] if self.capacity else []
            issued = self.collectives_issued
        return {"backend": self.backend, "group_rank": self.group_rank,
                "size": len(self.global_ranks), "global_ranks": list(self.global_ranks),
                "timeout_s": self.timeout.total_seconds(), "capacity": self.capacity,
                "collectives_issued": issued, "entries": entries}


class FlightRecorders:
    """The one owner of this process's recorders, keyed by group name. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant, for the same reason as FlightRecorder's
        self._groups: dict[str, FlightRecorder] = {}

    def add(self, rec: FlightRecorder) -> None:
        with self._lock:
            self._groups[rec.group_name] = rec

    def remove(self, rec: FlightRecorder) -> None:
        with self._lock:
            if self._groups.get(rec.group_name) is rec:
                del self._groups[rec.group_name]

    def get(self, group_name: str) -> FlightRecorder | None:
        return self._groups.get(group_name)

    def dump(self, reason: str, directory: str | os.PathLike[str] | None = None) -> Path | None:
        """Write ``rank_<global rank>.json`` (every group's buffer) into ``directory`` (default
        :func:`dump_dir`), replacing an earlier dump of this rank. Returns the path, or None when
        this process has no recorder or the file could not be written (logged, never raised:
        a dump must not hide the error that caused it)."""
        with self._lock:
            recs = list(self._groups.values())
        if not recs:
            return None
        rank = recs[0].global_rank
        world_size = max(max(r.global_ranks) for r in recs) + 1
        try:
            import plugdist

            if plugdist.is_initialized():
                rank, world_size = plugdist.get_rank(), plugdist.get_world_size()
        except Exception:  # noqa: BLE001 - a dump must work in a half-torn-down process too
            pass
        doc = {"version": DUMP_VERSION, "rank": rank, "world_size": world_size,
               "pid": os.getpid(), "host": socket.gethostname(), "reason": reason,
               "dumped_at": time.time(),
               "groups": {r.group_name: r.snapshot() for r in recs}}
        folder = Path(directory) if directory is not None else dump_dir()
        path = folder / f"rank_{rank}.json"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            os.replace(tmp, path)
        except OSError as err:
            get_logger(rank=rank).warning("flight_recorder_dump_failed", path=str(path),
                                          error=str(err))
            return None
        get_logger(rank=rank).info("flight_recorder_dumped", path=str(path), reason=reason)
        return path


recorders = FlightRecorders()


def dump_flight_recorder(reason: str = "on demand",
                         directory: str | os.PathLike[str] | None = None) -> Path | None:
    """Dump this rank's flight recorder now; returns the file written (see
    :meth:`FlightRecorders.dump`). Not collective; any thread."""
    return recorders.dump(reason, directory)


def install_signal_handler() -> None:
    """Dump on ``PLUGDIST_FLIGHT_RECORDER_SIGNAL`` (default SIGUSR2), once per process, from
    the main thread, when nobody else handles that signal already."""
    dump_on_signal(SIGNAL_ENV, "SIGUSR2", recorders.dump)
