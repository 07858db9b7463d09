"""``GlooWork``: a Work completed on demand from torch's own Gloo work handle.

Why not complete every op from a callback on Gloo's future: a Python callback makes Gloo's C++
thread take the GIL for each op, which doubled the latency of small collectives (~200 us on top
of Gloo's ~200 us for an 8-byte all_reduce between two pinned processes). So the common path,
``wait()``, blocks in torch's C++ ``wait`` (the GIL released) and finishes the op on the
waiting thread, without creating a future at all. Only when someone asks for the future
(``get_future``, ``then``: composed ops, DDP, comm hooks) is a callback attached, once; from then
on the op completes from Gloo's thread. Send and receive are armed at once: their torch works
have no future, only a blocking wait that one thread may call (a waiter thread, see
``waiters.py``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
from plugdist.backend import AbortSignal, GroupLike, Work, wait_sliced
from plugdist.errors import DistError

from .dtypes import Staged

__all__ = ["GlooWork", "IssuingGroup", "wait_native"]

_NO_SOURCE = -1


class IssuingGroup(GroupLike, Protocol):
    """What a GlooWork needs of the group that issued its op; ``GlooProcessGroup`` is one (it
    imports this module, so this module names only the protocol)."""

    def _translate(self, op: str, exc: BaseException) -> DistError:
        """The op's error as a DistError naming rank, group, op and backend."""
        ...

    def _arm(self, native_work: Any, complete: Callable[[BaseException | None], None]) -> None:
        """Call ``complete(error_or_None)`` on another thread once ``native_work`` is done."""
        ...


class GlooWork(Work):
    """Handle on one Gloo op. Thread-safe.

    Built before the op is issued and handed torch's work with ``attach``: what runs between
    issuing and blocking in ``wait`` delays Gloo's own threads, which share the CPU. On
    completion it writes ``staged`` tensors back, reads the sender of an any-source receive,
    and is done with ``result``; Gloo's errors become ``DistError`` through the group.
    """

    def __init__(self, pg: IssuingGroup, op: str, result: Any,
                 staged: Sequence[Staged] = (), any_source: bool = False) -> None:
        super().__init__(op=op, rank=pg.rank(), group=pg.group_name, backend=pg.backend_name,
                         timeout=pg.timeout, abort=pg.abort_signal)
        self._pg = pg
        self._native: Any = None
        self._value = result
        self._staged = staged
        self._any_source = any_source
        self._source = _NO_SOURCE
        self._lock = threading.Lock()
        self._claimed = False   # a thread is completing (or completed) the Work
        self._armed = False     # completion was handed to a callback or a waiter thread
        self._finished = False  # the outcome (_value or _error) is final
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[BaseException | None], None]] = []  # on_completion's

    def attach(self, native: Any, *, arm: bool = False) -> GlooWork:
        """Hand over torch's work for the issued op; returns self. ``arm`` starts completion
        at once, for works whose completion only a waiter observes (Gloo's send/recv: their
        ``is_completed`` stays False until someone waits)."""
        self._native = native
        if arm:
            self._arm()
        return self

    # -- completion ----------------------------------------------------------------------------
    def _complete(self, error: BaseException | None) -> None:
        """Settle the outcome once (the first caller wins; others return at once)."""
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
        native = self._native
        if error is None:
            try:
                for s in self._staged:
                    s.finish()
                if self._any_source:
                    self._source = int(native._source_rank())
            except Exception as exc:  # noqa: BLE001 - handed to whoever waits on the Work
                error = exc
        translated: BaseException | None = None
        if error is not None:
            translated = self._pg._translate(self.op, error)
            if self.abort is not None:
                translated = self.abort.explain(translated, self.where())
                if self.abort.closing and not self.abort.fired:
                    # failed by the shutdown's cut of the group's connections, not by a peer
                    shut = DistError(f"{self.where()} the group was shut down while this op "
                                     f"was in flight")
                    shut.__cause__ = translated
                    translated = shut
        with self._lock:
            if translated is not None:
                self._error = translated
            self._finished = True
            self._native = None  # the torch work holds the tensors; let them go
            fut = self.lazy_future
            callbacks, self._callbacks = self._callbacks, []
        if callbacks:
            self.call_back(callbacks, self._error)
        if fut is not None:  # someone holds the future: complete it (its callbacks run here)
            if self._error is not None:
                fut.set_exception(self._error)
            else:
                fut.set_result(self._value)

    def make_future(self) -> torch.futures.Future:
        with self._lock:
            fresh = self.lazy_future is None
            if fresh:
                fut: torch.futures.Future = torch.futures.Future()
                if self._finished:  # no callbacks on a new future: safe under the lock
                    if self._error is not None:
                        fut.set_exception(self._error)
                    else:
                        fut.set_result(self._value)
                self.lazy_future = fut
            held = self.lazy_future
        assert held is not None  # set just above, under the lock
        if fresh and self.abort is not None:
            self.abort.watch_future(self)
        return held

    def abort_future(self) -> None:
        """The group was aborted before Gloo finished the op: fail it now (Gloo's own outcome,
        when it comes, is dropped)."""
        abort = self.abort
        if abort is None:
            return
        with self._lock:
            if self._claimed:
                return
            self._claimed = True
            self._error = abort.error(self.where())
            self._finished = True
            fut = self.lazy_future
            callbacks, self._callbacks = self._callbacks, []
        if callbacks:
            self.call_back(callbacks, self._error)
        if fut is not None:
            fut.set_exception(self._error)

    def on_completion(self, callback: Callable[[BaseException | None], None]) -> None:
        """Work.on_completion without a future: kept until the outcome is final."""
        with self._lock:
            if not self._finished:
                self._callbacks.append(callback)
                return
        callback(self._error)

    def _poll(self) -> bool:
        """Complete from torch's work if it finished; True when the outcome is final."""
        native = self._native
        if native is not None and not self._armed and native.is_completed():
            try:
                native.wait()  # returns at once; raises the op's error
            except Exception as exc:  # noqa: BLE001
                self._complete(exc)
            else:
                self._complete(None)
        return self._finished

    def _arm(self) -> None:
        with self._lock:
            if self._armed or self._claimed:
                return
            self._armed = True
            native = self._native  # read before a completer could claim and clear it
        self._pg._arm(native, self._complete)

    # -- the Work contract ----------------------------------------------------------------------
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        native = self._native
        # once armed, the callback (or the waiter thread) completes the Work: a second native
        # wait on a send/recv would consume the completion Gloo signals only once
        if native is not None and not self._armed:
            limit = self.timeout if timeout is None else timeout
            if limit is not None and not isinstance(limit, timedelta):
                limit = timedelta(seconds=limit)
            finished, error = wait_native(native, limit, self.abort)
            if not finished:
                if self.abort is not None and self.abort.fired:
                    raise self.abort.error(self.where())
                raise self.timeout_error(self.timeout_seconds(timeout)) from error
            self._complete(error)
        if not self._finished:  # armed, or completed by another thread this very moment
            super().wait(timeout)
        if self._error is not None:
            if self.abort is not None:
                raise self.abort.explain(self._error, self.where())
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._poll()

    def is_success(self) -> bool:
        return self._poll() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error if self._poll() else None

    def result(self) -> Any:
        self.wait()
        return self._value

    def source_rank(self) -> int:
        return self._source

    def get_future(self) -> torch.futures.Future:
        self._arm()
        return self.future


def wait_native(native: Any, limit: timedelta | None,
                signal: AbortSignal | None = None) -> tuple[bool, BaseException | None]:
    """torch's ``native.wait``, bounded by ``limit`` (None: no bound), the GIL released:
    ``(False, error)`` when the op had not finished by then (or ``signal`` fired), else
    ``(True, its error or None)``. With a monitored ``signal`` it waits in slices (Gloo's timed
    wait leaves the op running), so an abort releases it at once."""
    if signal is not None and signal.monitored:
        failure: list[BaseException] = []

        def once(seconds: float | None) -> bool:
            try:
                native.wait() if seconds is None else native.wait(_bounded(seconds))
            except Exception:  # noqa: BLE001 - a timed-out slice, or the op's error
                if not native.is_completed():
                    return False
                error = _outcome(native)
                if error is not None:
                    failure.append(error)
            return True

        seconds = None if limit is None else limit.total_seconds()
        if wait_sliced(once, seconds, signal):
            return True, (failure[0] if failure else None)
        return False, None
    try:
        native.wait() if limit is None else native.wait(_bounded(limit.total_seconds()))
    except Exception as exc:  # noqa: BLE001 - the caller says what it means
        if not native.is_completed():
            return False, exc
        return True, _outcome(native)
    return True, None


def _bounded(seconds: float) -> timedelta:
    """A timeout for torch's ``Work.wait``, which counts whole milliseconds and takes 0 for no
    limit at all: under a millisecond is rounded up to one (the last slice of a sliced wait
    is often that short, and waited forever)."""
    return timedelta(milliseconds=max(1, math.ceil(seconds * 1000)))


def _outcome(native: Any) -> BaseException | None:
    """The error of ``native``, a completed torch work (None: it succeeded), from a second
    ``wait`` (which returns, or raises the op's error, at once). Not the error a timed ``wait``
    raised: torch's "Operation timed out!" comes from the deadline passing, and the op may have
    completed, successfully, between that and the look at ``is_completed``. Taken as the op's
    outcome, that timeout failed an op that succeeded on one rank only, so the ranks fell out of
    step: the next collectives were mismatched in Gloo (a hang until Gloo's timeout, or an
    abort on Gloo's size check). With resilient groups on, every wait is sliced into
    ``SLICE``-second timed waits, so a loaded machine hits this race (docs/resilience.md)."""
    try:
        native.wait()
    except Exception as exc:  # noqa: BLE001 - the op's own error, handed to the caller
        return exc
    return None
