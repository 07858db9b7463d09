"""What a rank tells ``plugdist-run --page``: its status once a second, and its recent ops when
the page asks for them.

Started by ``init_process_group`` when the launcher sets ``PLUGDIST_PAGE=1``; nothing of it runs
otherwise. One daemon thread per process, off the ops' path: an op does no more than it does
without the page. Each second the thread writes the rank's status (rank, member id, host, pid,
the last committed step and its time, the first step of each recent epoch, from
:func:`note_step`) to ``page_status_key(uid)`` in the
world's store, and reads the page's request counter (``PAGE_DUMP``); when it went up, it writes
the flight recorder's last entries to ``page_ops_key(uid)``. A store that stops answering (the
run is ending) ends the thread quietly.

:func:`note_step` is the one call on a training loop's path: it stores a tuple, no I/O.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from plugdist._observability.flight_recorder import recorder
from plugdist.store._worldkeys import PAGE_DUMP, page_ops_key, page_status_key

__all__ = ["note_step", "start", "stop", "recent_ops", "RECENT_OPS"]

RECENT_OPS = 16  # the flight-recorder entries a rank hands the page on request
_INTERVAL = 1.0

# (committed step, its seconds, wall time of the commit, the epoch): replaced whole, read whole
_progress: tuple[int, float, float, int] | None = None
# epoch -> (seconds of its first committed step, of the step committed before it): a world
# change shows as a long first step; the page reads the pause from it
_epoch_starts: dict[int, tuple[float, float]] = {}


def note_step(step: int, seconds: float, epoch: int = 0) -> None:
    """Record that step ``step`` was committed after ``seconds``, in ``epoch``. Called by the
    training loop's thread; no I/O."""
    global _progress
    before = _progress
    if before is not None and before[3] != epoch:
        _epoch_starts[epoch] = (seconds, before[1])
        for old in sorted(_epoch_starts)[:-8]:
            del _epoch_starts[old]
    _progress = (step, seconds, time.time(), epoch)


def recent_ops(limit: int = RECENT_OPS) -> dict[str, Any]:
    """This rank's last ``limit`` ops from the flight recorder, oldest first, reduced to what
    the page shows; ``recording`` False when the recorder is off (``TORCH_FR_BUFFER_SIZE``)."""
    snap = recorder.snapshot()
    ops = []
    for e in snap["entries"][-limit:]:
        ops.append({
            "op": e["profiling_name"].partition(":")[2], "group": e["process_group"][0],
            "seq": e["collective_seq_id"] or e["p2p_seq_id"], "state": e["state"],
            "started": (e["time_discovered_started_ns"] or e["time_created_ns"]) / 1e9,
            "duration_ms": e["duration_ms"], "error": e["error"],
            "sizes": e["input_sizes"][:2]})
    return {"recording": recorder.on, "ops": ops}


class _Reporter:
    def __init__(self, store: Any, who: Callable[[], dict[str, Any]]) -> None:
        self.store = store
        self.who = who
        self.stopped = threading.Event()
        self.answered = 0
        self.thread = threading.Thread(target=self._run, name="plugdist-page-reporter",
                                       daemon=True)

    def _run(self) -> None:
        host, pid = socket.gethostname(), os.getpid()
        while not self.stopped.is_set():
            try:
                self._report(host, pid)
            except Exception:  # noqa: BLE001 - the store is gone or closing: the run ends
                return
            self.stopped.wait(_INTERVAL)

    def _report(self, host: str, pid: int) -> None:
        me = self.who()
        progress = _progress
        status = dict(me, host=host, pid=pid, time=time.time())
        if progress is not None:
            status.update(step=progress[0], step_time=progress[1], step_at=progress[2],
                          epoch_starts={str(e): v for e, v in list(_epoch_starts.items())})
        uid = str(me["uid"])
        self.store.set(page_status_key(uid), json.dumps(status))
        asked = int(self.store.add(PAGE_DUMP, 0))
        if asked > self.answered:
            self.answered = asked
            self.store.set(page_ops_key(uid),
                           json.dumps(dict(recent_ops(), request=asked, rank=me["rank"])))


_reporter: _Reporter | None = None


def start(store: Any, who: Callable[[], dict[str, Any]]) -> None:
    """Start reporting to the page through ``store`` (the world's); ``who()`` gives this
    process's ``uid``, ``rank``, ``world_size`` and ``epoch`` now. Replaces a running
    reporter."""
    global _reporter
    stop()
    _reporter = _Reporter(store, who)
    _reporter.thread.start()


def stop() -> None:
    """Stop the reporter, if any; returns at once (the thread ends within a second)."""
    global _reporter
    if _reporter is not None:
        _reporter.stopped.set()
        _reporter = None
