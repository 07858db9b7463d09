"""``GlooWork``: a Work completed on demand from torch's own Gloo work handle.

Why not complete every op from a callback on Gloo's future: a Python callback makes Gloo's C++
thread take the GIL for each op, which doubled the latency of small collectives (~200 us on top
of Gloo's ~200 us for an 8-byte all_reduce between two pinned processes). So the common path,
``wait()``, blocks in torch's C++ ``wait`` (the GIL released) and finishes the op on the
waiting thread. Only when someone asks for the future (``get_future``, ``then``: composed ops, DDP,
comm hooks) is a callback attached, once; from then on the op completes from Gloo's thread.
Send and receive are armed at once: their torch works have no future, only a blocking wait that
one thread may call (a waiter thread, see ``waiters.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from plugdist.work import Work

__all__ = ["GlooWork"]


class GlooWork(Work):
    """Thread-safe. Built before the op is issued, then given torch's work with ``attach``:
    what runs between issuing and blocking in ``wait`` delays Gloo's own threads, which share
    the CPU. ``finish(native)`` runs the op's completion (write staged tensors back, read the
    source rank) and returns the Work's value; ``translate(exc)`` turns Gloo's errors into
    ``DistError``; ``arm(native, callback)`` arranges for ``callback(error_or_None)`` to run once
    Gloo is done, on some other thread."""

    def __init__(self, finish: Callable[[Any], Any],
                 translate: Callable[[BaseException], BaseException],
                 arm: Callable[[Any, Callable[[BaseException | None], None]], None],
                 **context: Any) -> None:
        super().__init__(**context)
        self._native: Any = None
        self._finish = finish
        self._translate = translate
        self._arm_with = arm
        self._lock = threading.Lock()
        self._claimed = False
        self._armed = False
        self._finished = False  # set by whichever thread completed the future, after it did
        self._error: BaseException | None = None

    def attach(self, native: Any, *, arm: bool = False) -> GlooWork:
        """Hand over torch's work for the issued op; returns self. ``arm`` starts completion
        at once, for works whose completion only a waiter observes (Gloo's send/recv: their
        ``is_completed`` stays False until someone waits)."""
        self._native = native
        if arm:
            self._arm()
        return self

    def _complete(self, error: BaseException | None) -> None:
        """Complete the future once (the first caller wins; others return at once)."""
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
        if error is None:
            try:
                value = self._finish(self._native)
            except Exception as exc:  # noqa: BLE001 - handed to whoever waits on the Work
                error = exc
        if error is not None:
            self._error = self._translate(error)
            self.set_exception(self._error)
        else:
            self.set_result(value)
        self._native = None  # the torch work holds the tensors; let them go
        self._finished = True

    def _poll(self) -> bool:
        """Complete from torch's work if it finished; True when this Work is complete."""
        native = self._native
        if native is not None and not self._armed and not self._future.done() \
                and native.is_completed():
            try:
                native.wait()  # returns at once; raises the op's error
            except Exception as exc:  # noqa: BLE001
                self._complete(exc)
            else:
                self._complete(None)
        return self._future.done()

    def _arm(self) -> None:
        with self._lock:
            if self._armed or self._claimed:
                return
            self._armed = True
            native = self._native  # read before a completer could claim and clear it
        self._arm_with(native, self._complete)

    # -- the Work contract ----------------------------------------------------------------------
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        native = self._native
        # once armed, the callback (or the waiter thread) completes the Work: a second native
        # wait on a send/recv would consume the completion Gloo signals only once
        if native is not None and not self._armed and not self._future.done():
            seconds = self._seconds(timeout)
            try:
                native.wait() if seconds is None else native.wait(timedelta(seconds=seconds))
            except Exception as exc:  # noqa: BLE001
                if not native.is_completed():
                    raise self.timeout_error(seconds) from exc
                self._complete(exc)
            else:
                self._complete(None)
        if self._finished:  # the common case, without the base class's future round trips
            if self._error is not None:
                raise self._error
            return True
        return super().wait(timeout)

    def is_completed(self) -> bool:
        return self._poll()

    def is_success(self) -> bool:
        return self._poll() and self.exception() is None

    def exception(self) -> BaseException | None:
        self._poll()
        return super().exception()

    def get_future(self) -> torch.futures.Future:
        self._arm()
        return super().get_future()

    def then(self, fn: Callable[[Any], Any], *, op: str | None = None) -> Work:
        self._arm()
        return super().then(fn, op=op)
