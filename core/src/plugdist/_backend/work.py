"""``Work``: the handle every op returns.

A Work is backed by a ``torch.futures.Future`` that a backend completes (from any thread) with
the op's output tensors, or with an exception. ``wait`` never blocks forever: with no timeout it
uses the group's timeout, and raises ``DistTimeoutError`` naming rank, group and op.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from plugdist._backend.abort import AbortSignal, wait_sliced
from plugdist._log import lifecycle
from plugdist.errors import (
    DistBackendError,
    DistError,
    DistRankFailureError,
    DistTimeoutError,
    op_timeout,
    where,
)

__all__ = ["Work", "completed_work", "failed_work"]

_LAZY_LOCK = threading.Lock()  # for creating a Work's future or event: one lock for all


class Work:
    """Handle on an issued op.

    Thread-safe. ``wait`` blocks the calling thread until the op finished or ``timeout``
    (default: the group's timeout) passed; it re-raises the op's error as a ``DistError`` whose
    message names rank, group and op.

    A backend that finishes ops its own way subclasses Work (plugdist-mpi drives MPI in
    ``wait``; plugdist-gloo blocks in Gloo's C++ wait). What such a subclass may use and
    override: ``lazy_future`` (the future once made, else None; read and set it under the
    subclass's own lock), ``make_future()`` (create it, handing over an outcome set before it
    existed), ``future`` (the future, made on first use), ``abort_future()`` (called when the
    group is aborted), ``successor(op)`` (the pending Work ``then`` returns), ``context(op)``
    (this Work's context, for such a successor), ``where()`` (the error prefix),
    ``with_context(exc)`` (an error naming this op), ``timeout_seconds(timeout)``, and
    ``set_source_rank(rank)`` (the sender of a receive, once known), and ``on_completion``
    (with :meth:`call_back`: a Work that keeps its outcome itself calls its observers without
    making a future).
    """

    def __init__(self, future: torch.futures.Future | None = None, *, op: str = "", rank: int = -1,
                 group: str = "", backend: str = "", timeout: timedelta | None = None,
                 source_rank: int | Callable[[], int] = -1,
                 abort: AbortSignal | None = None) -> None:
        self.lazy_future = future  # made on first use: see ``future``
        self._done: threading.Event | None = None  # made by the first wait that must block
        self.op, self.rank, self.group, self.backend = op, rank, group, backend
        self.timeout = timeout
        self._source_rank = source_rank
        # the issuing group's abort signal (plugdist._backend.abort): fired, it releases ``wait``
        self.abort = abort

    @property
    def future(self) -> torch.futures.Future:
        """The future behind this Work, created on first use (a Work completed and waited on
        by one thread, the common case for blocking ops, may never need one)."""
        fut = self.lazy_future
        return fut if fut is not None else self.make_future()

    def make_future(self) -> torch.futures.Future:
        """Create the future (once, thread-safe). Subclasses that complete a Work without it
        override this to hand the outcome over to the new future."""
        with _LAZY_LOCK:
            if self.lazy_future is None:
                self.lazy_future = torch.futures.Future()
                fresh = True
            else:
                fresh = False
        if fresh and self.abort is not None:
            self.abort.watch_future(self)
        return self.lazy_future

    def abort_future(self) -> None:
        """The group was aborted: fail the future if the op has not finished (see
        AbortSignal.watch_future)."""
        fut = self.lazy_future
        if fut is not None and not fut.done() and self.abort is not None:
            try:
                fut.set_exception(self.abort.error(self.where()))
            except RuntimeError:
                pass  # completed by the backend meanwhile

    # -- completion, for backends ------------------------------------------------------------
    def set_result(self, value: Any) -> None:
        """Mark the op done with ``value`` (usually the output tensors). Call once, any thread;
        ignored if the group's abort failed the op first."""
        try:
            self.future.set_result(value)
        except RuntimeError:
            if self.abort is None or not self.abort.fired:
                raise

    def set_exception(self, exc: BaseException) -> None:
        """Mark the op failed. Call once, from any thread. A transport error on a group whose
        member has failed becomes that failure (``DistRankFailureError``)."""
        err = self.with_context(exc)
        if self.abort is not None:
            err = self.abort.explain(err, self.where())
        # a member's failure is warned about once, by membership (rank_failure); the ops it
        # fails are its consequences
        lifecycle("op_failed", group=self.group, group_rank=self.rank, backend=self.backend,
                  level="info" if isinstance(err, DistRankFailureError) else "warning",
                  op=self.op, error=str(err))
        try:
            self.future.set_exception(err)
        except RuntimeError:
            if self.abort is None or not self.abort.fired:
                raise

    # -- the user-facing contract ------------------------------------------------------------
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until done; True on success. Raises the op's error, DistTimeoutError, or
        DistRankFailureError as soon as the group is aborted for a failed member."""
        if not self.future.done():
            seconds = self.timeout_seconds(timeout)
            if not wait_sliced(self._done_event().wait, seconds, self.abort):
                if self.abort is not None and self.abort.fired and not self.future.done():
                    raise self.abort.error(self.where())
                if not self.future.done():
                    raise self.timeout_error(seconds)
        exc = self.exception()
        if exc is not None:
            if self.abort is not None:
                raise self.abort.explain(exc, self.where())
            raise exc
        return True

    def _done_event(self) -> threading.Event:
        """An Event set when the future completes (a future's own wait cannot time out)."""
        fut = self.future  # outside the lock: creating it takes the lock too
        with _LAZY_LOCK:
            if self._done is None:
                done = self._done = threading.Event()
                fut.add_done_callback(lambda _f: done.set())
            return self._done

    def timeout_error(self, seconds: float | None) -> DistTimeoutError:
        """The error ``wait`` raises when the op is not done after ``seconds``."""
        lifecycle("op_timeout", group=self.group, group_rank=self.rank, backend=self.backend,
                  level="warning", op=self.op, timeout_s=seconds)
        return op_timeout(self.where(), seconds)

    def timeout_seconds(self, timeout: timedelta | float | None) -> float | None:
        """``timeout`` (or the group's, when None) in seconds; None means no limit."""
        limit = timeout if timeout is not None else self.timeout
        return limit.total_seconds() if isinstance(limit, timedelta) else limit

    def is_completed(self) -> bool:
        return self.future.done()

    def is_success(self) -> bool:
        return self.future.done() and self.exception() is None

    def exception(self) -> BaseException | None:
        if not self.future.done():
            return None
        try:
            self.future.value()
        except BaseException as exc:  # noqa: BLE001 - the op's own error, handed back
            return self.with_context(exc)
        return None

    def get_future(self) -> torch.futures.Future:
        return self.future

    def on_completion(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(error)`` once the op finished (``error``: None on success, else what
        :meth:`exception` returns): on the thread that completes it, or at once on this thread
        if it already has. The core's observers (flight recorder, profiler) use it. Here it
        goes through the future; a Work that keeps its outcome itself overrides it (keep the
        callbacks, then :meth:`call_back` them when settling) so that observing an op makes no
        future, which costs microseconds."""
        self.get_future().add_done_callback(lambda _fut: self.call_back([callback],
                                                                         self.exception()))

    def call_back(self, callbacks: list[Callable[[BaseException | None], None]],
                  error: BaseException | None) -> None:
        """Run the ``on_completion`` callbacks kept for an op that finished with ``error``;
        one that raises is logged and does not stop the others (nor the completing thread)."""
        for callback in callbacks:
            try:
                callback(error)
            except Exception as exc:  # noqa: BLE001 - an observer must not break completion
                lifecycle("completion_callback_failed", group=self.group, group_rank=self.rank,
                          backend=self.backend, level="warning", op=self.op, error=repr(exc))

    def synchronize(self) -> None:
        """torch's (deprecated) ``Work.synchronize``: order the caller's current device stream
        after the op. A no-op here, as torch's on the CPU: this Work completes from the host,
        with nothing left on a stream; a backend whose Works finish on device streams overrides
        it (plugdist-nccl's)."""

    def result(self) -> Any:
        """The op's output tensors, after a successful ``wait``."""
        self.wait()
        return self.future.value()

    def set_source_rank(self, rank: int | Callable[[], int]) -> None:
        """For backends: the sender of this receive (a group rank, or a callable giving it once
        known)."""
        self._source_rank = rank

    def source_rank(self) -> int:
        """For a receive from any source: the group rank the message came from."""
        if callable(self._source_rank):
            return self._source_rank()
        return self._source_rank

    def then(self, fn: Callable[[Any], Any], *, op: str | None = None) -> Work:
        """A new Work completed with ``fn(result)`` once this one succeeds (errors pass through).
        ``fn`` runs on whichever thread completes this Work."""
        nxt = self.successor(op)

        def chain(fut: torch.futures.Future) -> None:
            try:
                value = fn(fut.value())
            except BaseException as exc:  # noqa: BLE001 - handed on to whoever waits
                nxt.set_exception(exc)
            else:
                nxt.set_result(value)

        self.get_future().add_done_callback(chain)
        return nxt

    def successor(self, op: str | None) -> Work:
        """The pending Work that ``then`` completes; backends return their own Work type."""
        return Work(**self.context(op))

    def context(self, op: str | None = None) -> dict[str, Any]:
        """This Work's context (``op`` replaced if given), for a Work that follows from it."""
        return dict(op=op or self.op, rank=self.rank, group=self.group, backend=self.backend,
                    timeout=self.timeout, source_rank=self.source_rank, abort=self.abort)

    # -- helpers -----------------------------------------------------------------------------
    def where(self) -> str:
        return where(rank=self.rank if self.rank >= 0 else None, group=self.group or None,
                     op=self.op or None, backend=self.backend or None)

    def with_context(self, exc: BaseException) -> BaseException:
        """``exc`` naming this op's rank, group, op and backend: a DistError keeps its class (a
        store timeout inside a composed op stays a DistTimeoutError), anything else becomes a
        DistBackendError; the original is the ``__cause__``."""
        here = self.where()
        if isinstance(exc, DistError):
            if here in str(exc):
                return exc
            try:
                err: BaseException = type(exc)(f"{here} failed: {exc}")
            except TypeError:  # a DistError subclass with a constructor of its own
                return exc
            err.__dict__.update(exc.__dict__)  # e.g. DistRankFailureError.ranks
        else:
            err = DistBackendError(f"{here} failed: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"<Work {self.where()} {state}>"


class _CompletedWork(Work):
    """Done at birth: answers without a future, and makes one only when asked."""

    def __init__(self, value: Any, **context: Any) -> None:
        super().__init__(**context)
        self._value = value

    def make_future(self) -> torch.futures.Future:
        with _LAZY_LOCK:
            if self.lazy_future is None:
                fut: torch.futures.Future = torch.futures.Future()
                fut.set_result(self._value)
                self.lazy_future = fut
            return self.lazy_future

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> Any:
        return self._value

    def on_completion(self, callback: Callable[[BaseException | None], None]) -> None:
        """At once, on this thread (this Work is done)."""
        self.call_back([callback], None)

    def then(self, fn: Callable[[Any], Any], *, op: str | None = None) -> Work:
        """``fn`` runs now, on this thread (this Work is done)."""
        context = self.context(op)
        try:
            value = fn(self._value)
        except BaseException as exc:  # noqa: BLE001 - handed on to whoever waits
            return failed_work(exc, **context)
        return completed_work(value, **context)


def completed_work(value: Any = None, **context: Any) -> Work:
    """A Work that is already done with ``value``."""
    return _CompletedWork(value, **context)


def failed_work(exc: BaseException, **context: Any) -> Work:
    """A Work that already failed with ``exc``."""
    work = Work(**context)
    work.set_exception(exc)
    return work


def gather_works(works: list[Work], value: Any, **context: Any) -> Work:
    """A Work done (with ``value``) when every one of ``works`` is; fails with the first error."""
    if not works:
        return completed_work(value, **context)
    done = Work(**context)
    left = [len(works)]
    lock = threading.Lock()
    failed: list[BaseException] = []

    def one_done(fut: torch.futures.Future) -> None:
        try:
            fut.value()
        except BaseException as exc:  # noqa: BLE001
            failed.append(exc)
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            if failed:
                done.set_exception(failed[0])
            else:
                done.set_result(value)

    for w in works:
        w.get_future().add_done_callback(one_done)
    return done
