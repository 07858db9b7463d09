"""When every rank dumps: dump requests through the store, a watcher that waits on them, ops in
flight past their timeout, and the dump signal.

**Requests.** A rank that sees an op fail with a ``DistError``, or stay in flight past its
group's timeout, dumps and asks every rank of the watched group (the oldest recorded group with
a store: the world) to dump: once per incident (the group and the op's sequence number; the
first rank to claim it with ``compare_set`` asks, the others only dump), with two writes
whatever the world's size: ``add`` on a counter (the request's number n), then one
``multi_set`` of ``flight_recorder/ask/<global rank>/<n>`` for every rank.

**The watcher** (one daemon thread per process, ``plugdist-flight-recorder``) waits on the
store for this rank's next key, ``flight_recorder/ask/<me>/<n+1>``: a parked request on a
TCPStore (or torch's), woken by the write that asks, so an idle world costs the store one
parked request per rank and nothing per second. The wait lasts until the soonest deadline of an
op in flight, else the shortest group timeout: when it ends, ops past their deadline are dumped
for (above). It waits on a clone of the store (its own connection: torch's TCPStore serves one
request of a handle at a time). A FileStore's wait polls its file every few milliseconds, and a
store that cannot be cloned would be held up, so there the watcher looks once every
``_FILE_LOOK_S`` seconds instead. To stop (the last group destroyed, the
process exiting), the watcher's own key is written: it wakes and ends.

**The signal.** ``PLUGDIST_FR_DUMP_SIGNAL`` (default ``SIGUSR1``; ``OFF``: none) dumps this
rank; its handler is installed from the main thread with the first recorded group, unless the
signal already has a handler.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from datetime import timedelta
from typing import Any

from plugdist._log import get_logger
from plugdist._observability.dump_signal import dump_on_signal
from plugdist.errors import DistTimeoutError

__all__ = ["Watcher", "ask_key", "SIGNAL_ENV", "COUNTER_KEY"]

SIGNAL_ENV = "PLUGDIST_FR_DUMP_SIGNAL"
COUNTER_KEY = "flight_recorder/asked"
INCIDENT_KEY = "flight_recorder/incident"
_STOP = b"stop"  # what a watcher's own key holds when it is woken to end
_FILE_LOOK_S = 5.0  # a FileStore's watcher looks this often (its wait would poll every 20 ms)
_MAX_WAIT_S = 3600.0
_MIN_WAIT_S = 0.05
_RETRY_S = 10.0  # after the store failed (it may be gone): wait this long before the next try
_CHUNK = 4096  # keys per multi_set


def ask_key(rank: int, n: int) -> str:
    """The key whose write asks global rank ``rank`` to dump, for request ``n``."""
    return f"flight_recorder/ask/{rank}/{n}"


def _polls(store: Any) -> bool:
    """Whether ``store``'s wait polls its medium (a FileStore, plugdist's or torch's)."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    store = getattr(store, "torch_store", store)
    return type(store).__name__ == "FileStore"


def _handle(store: Any) -> Any:
    """The watcher's own handle on ``store`` (a clone: a long wait must not hold up the other
    requests of this process, as it would on a store of one connection, torch's TCPStore), or
    None where the store cannot be cloned."""
    try:
        return store.clone()
    except (NotImplementedError, AttributeError):
        return None


def _close(handle: Any, store: Any) -> None:
    """Close the watcher's own handle (a clone's innermost store; never ``store`` itself)."""
    while handle is not store and hasattr(handle, "underlying_store"):
        handle, store = handle.underlying_store, getattr(store, "underlying_store", None)
    if handle is not store:
        with contextlib.suppress(Exception):
            handle.close()


class Watcher:
    """The recorder's watcher thread and dump requests. ``recorder`` gives ``dump(reason)``,
    ``watched()``, ``overdue()``, ``shortest_timeout()`` and ``global_rank``."""

    def __init__(self, recorder: Any) -> None:
        self._rec = recorder
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._parked: tuple[Any, str] | None = None  # (store, key) the thread waits on
        self._own: set[int] = set()  # request numbers this rank wrote (already dumped)
        self._exit_registered = False

    def start(self) -> None:
        """Start the thread if it does not run (and install the dump signal's handler)."""
        dump_on_signal(SIGNAL_ENV, "SIGUSR1", self._rec.dump)
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(self._stop,),
                                            name="plugdist-flight-recorder", daemon=True)
            self._thread.start()
            if not self._exit_registered:
                self._exit_registered = True
                atexit.register(self.stop)

    def stop(self) -> None:
        """Stop the thread: wake its wait (its own key) and join it, briefly. Idempotent."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
            parked = self._parked
        if thread is None or thread is threading.current_thread():
            return
        if parked is not None:
            store, key = parked
            with contextlib.suppress(Exception):
                store.compare_set(key, "", _STOP)
        thread.join(timeout=5)
        if parked is not None:
            with contextlib.suppress(Exception):
                store.delete_key(key)

    def wake(self) -> None:
        """End the thread's current wait (its own key): it looks again at which group to
        watch."""
        with self._lock:
            parked = self._parked
        if parked is not None:
            with contextlib.suppress(Exception):
                parked[0].compare_set(parked[1], "", _STOP)

    # -- requests ----------------------------------------------------------------------------
    def ask_everyone(self, reason: str, incident: str | None) -> None:
        """Ask every rank of the watched group to dump (this one dumped already); once per
        ``incident``. Store failures are logged, never raised."""
        g = self._rec.watched()
        if g is None:
            return
        me = self._rec.global_rank
        store = g.store
        try:
            if incident is not None:
                claim = f"{INCIDENT_KEY}/{incident}"
                with contextlib.suppress(NotImplementedError):
                    if store.compare_set(claim, "", str(me)) != str(me).encode():
                        return  # another rank asked for this one
            n = int(store.add(COUNTER_KEY, 1))
            self._own.add(n)
            keys = [ask_key(r, n) for r in g.global_ranks]
            value = reason.encode()[:512]
            for i in range(0, len(keys), _CHUNK):
                part = keys[i:i + _CHUNK]
                store.multi_set(part, [value] * len(part))
        except Exception as err:  # noqa: BLE001 - the store may be what failed
            get_logger(rank=me, group=g.name).warning("flight_recorder_dump_request_failed",
                                                      error=str(err))

    # -- the thread --------------------------------------------------------------------------
    def _run(self, stop: threading.Event) -> None:
        rec = self._rec
        me = rec.global_rank
        log = get_logger(rank=me)
        target: Any = None
        handle: Any = None  # the watcher's own handle on the target's store (None: poll)
        seen = 0
        failing = False
        try:
            while not stop.is_set():
                g = rec.watched()
                if g is None:
                    return
                store = g.store
                try:
                    if g is not target:
                        if handle is not None:
                            _close(handle, target.store)
                        target, handle = g, None if _polls(store) else _handle(store)
                        seen = int(store.add(COUNTER_KEY, 0))
                    soonest = rec.overdue()
                    wait = min(soonest if soonest is not None else rec.shortest_timeout(),
                               _MAX_WAIT_S)
                    key = ask_key(me, seen + 1)
                    if not self._wait(stop, store, handle, key, max(wait, _MIN_WAIT_S)):
                        continue
                    if stop.is_set():
                        return
                    value = store.get(key)
                    first, seen = seen + 1, max(seen + 1, int(store.add(COUNTER_KEY, 0)))
                    failing = False
                    if value == _STOP or all(n in self._own for n in range(first, seen + 1)):
                        continue  # woken to end, or by requests of this rank (dumped then)
                    rec.dump(f"asked by a peer: {value[:200].decode(errors='replace')}")
                except Exception as err:  # noqa: BLE001 - the watcher outlives a store's failure
                    if stop.is_set():
                        return
                    if not failing:
                        failing = True
                        log.warning("flight_recorder_watch_failed", error=str(err),
                                    retry_s=_RETRY_S)
                    target = None
                    stop.wait(_RETRY_S)
        finally:
            if handle is not None and target is not None:
                _close(handle, target.store)

    def _wait(self, stop: threading.Event, store: Any, handle: Any, key: str,
              seconds: float) -> bool:
        """Wait up to ``seconds`` for ``key``, parked on ``handle`` (or, without one, looking
        every ``_FILE_LOOK_S``); whether it exists. ``stop`` wakes it through ``store``."""
        if handle is None:
            stop.wait(min(seconds, _FILE_LOOK_S))
            return bool(store.check([key]))
        with self._lock:
            if stop.is_set():
                return False
            self._parked = (store, key)
        try:
            handle.wait([key], timedelta(seconds=seconds))
        except DistTimeoutError:
            return False
        finally:
            with self._lock:
                self._parked = None
        return True
