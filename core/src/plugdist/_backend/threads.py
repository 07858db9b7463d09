"""The threads a backend starts, and how they stop: what every backend with threads of its own
must get right, written once.

A backend thread must end when its group shuts down (``shutdown`` joins it: a thread still
running at interpreter exit can crash the process) and also when the program ends without
``destroy_process_group``: the interpreter joins plain threads only after the main thread
finished, so a thread that waits for the group to close would hold the exit up forever. Threads
that block therefore wait in short slices and look at :meth:`BackendThreads.running` between
them.

    self._threads = BackendThreads("mine")
    self._threads.start(self._read_loop, "reader", sock)
    ...
    def _read_loop(self, sock):
        while (frame := recv_exact(sock, 16, self._threads.running)) is not None: ...
    def native_abort(self):
        self._threads.close()              # never blocks
    def shutdown(self):
        self._threads.close()
        self._threads.join()               # every thread but the calling one
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

__all__ = ["BackendThreads", "POLL_SECONDS", "program_running", "recv_exact"]

POLL_SECONDS = 0.2  # how long a blocked backend thread waits before it looks again


def program_running() -> bool:
    """False once the main thread finished: the program is exiting (perhaps without
    ``destroy_process_group``) and a backend's threads must end."""
    return threading.main_thread().is_alive()


class BackendThreads:
    """The threads one group started. Thread-safe; ``close`` never blocks."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._closed = threading.Event()

    def start(self, target: Callable[..., object], name: str, *args: object) -> threading.Thread:
        """Start ``target(*args)`` on a thread named ``<prefix>-<name>``, forgotten once it
        returns."""
        def run() -> None:
            try:
                target(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=f"{self._prefix}-{name}")
        with self._lock:
            self._threads.add(thread)
        thread.start()
        return thread

    def running(self) -> bool:
        """Whether the threads should keep going: not closed, and the program not exiting."""
        return not self._closed.is_set() and program_running()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed.is_set()

    def close(self) -> None:
        """Tell every thread to stop (each notices at its next look, within POLL_SECONDS when
        it waits in slices). Idempotent, any thread, never blocks."""
        self._closed.set()

    def join(self, timeout: float | None = None) -> None:
        """Wait for every thread but the calling one to end (each ``timeout`` at most)."""
        with self._lock:
            running = [t for t in self._threads if t is not threading.current_thread()]
        for thread in running:
            thread.join(timeout)


def recv_exact(sock: socket.socket, n: int, running: Callable[[], bool]) -> bytes | None:
    """``n`` bytes from ``sock`` (a socket with a timeout, e.g. POLL_SECONDS), or None once the
    peer closed it, it was closed under us, or ``running()`` turned false."""
    chunks, left = [], n
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except TimeoutError:
            if not running():
                return None
            continue
        except OSError:
            return None
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
