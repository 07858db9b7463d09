"""``Waiters``: threads that wait on torch Work objects that have no future.

torch's Gloo gives send/recv Works no ``get_future()``; the only way to learn that one finished
is a blocking ``wait()``. Each pending wait gets a thread of its own (a shared FIFO thread could
deadlock: a later receive may be what lets an earlier one finish), but threads are reused while
work keeps coming and exit after a short idle time, so a quiet group holds none.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

__all__ = ["Waiters"]

_IDLE_SECONDS = 2.0


class Waiters:
    """An unbounded pool: ``submit(fn)`` runs ``fn`` on a thread that is not busy, starting one
    if every thread is busy. Thread-safe. ``close`` stops idle threads and joins them."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._unfinished = 0
        self._closed = False

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` soon on a pool thread. ``fn`` must not raise (its errors are lost)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: closed")
            self._unfinished += 1
            if self._unfinished > len(self._threads):
                t = threading.Thread(target=self._loop, name=f"{self._name}-wait", daemon=True)
                self._threads.add(t)
                t.start()
            self._jobs.put(fn)

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            try:
                fn = self._jobs.get(timeout=_IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if self._unfinished < len(self._threads):
                        self._threads.discard(me)
                        return
                continue
            if fn is None:
                with self._lock:
                    self._threads.discard(me)
                return
            try:
                fn()
            finally:
                with self._lock:
                    self._unfinished -= 1

    def busy(self) -> bool:
        """Whether a job is queued or running (a send or receive still in flight)."""
        with self._lock:
            return self._unfinished > 0

    def close(self, timeout: float = 5.0) -> None:
        """Refuse new jobs, let running ones finish (up to ``timeout`` s in all), join threads."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
