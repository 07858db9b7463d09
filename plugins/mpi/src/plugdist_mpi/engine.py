"""The progress engine: how plugdist_mpi keeps MPI asynchronous and its calls serialized.

Threading model (one engine per process, shared by every MPI group of the process):

* Every op is started as a **non-blocking** MPI call (``Iallreduce``, ``Isend``, ...) on the
  thread that issues it, under the process-wide **MPI lock** (synchronous ops at
  ``MPI_THREAD_MULTIPLE`` excepted, see below). Issue order on a group is therefore exactly the
  order in which the caller issued its ops, which is what MPI needs to match collectives across
  ranks; and issuing never blocks the caller.
* Pending requests are tested (``MPI_Test``, also under the MPI lock) by:

  - a thread **waiting** on one of their Works (:meth:`MPIWork.wait`, also for Works chained
    with ``then``): it first tests its op's request in one burst with no bookkeeping (most
    small ops are done by then), then drives MPI itself, testing in bursts and yielding the CPU
    between them, until the op is done or its timeout passes. A blocking op thus costs no thread
    hand-off;
  - otherwise one daemon **progress thread**, which completes the Works of ops nobody waits on
    (async ops, future callbacks). It tests continuously (yielding the CPU and the GIL between
    rounds) for ``PLUGDIST_MPI_SPIN_US`` microseconds after the last issue or completion, then
    naps up to 1 ms between rounds (while an op is awaited through a future: 50 us, and each
    round tests in a burst, as a waiting thread does). It stands aside while some thread is
    driving and for the first 200 us of a fresh op (its issuer usually waits on it at once,
    unless it asked for the op's future), and sleeps on a condition variable (no CPU) when
    nothing is pending.

  A blocking op of the synchronous frontend skips the Work altogether: the calling thread
  starts the request and tests it itself (:meth:`Engine.run_here`); only if the group's timeout
  passes is the request handed to the progress thread.

  Because the lock keeps any two MPI calls of plugdist from overlapping, ``MPI_THREAD_SERIALIZED``
  suffices; at ``MPI_THREAD_MULTIPLE`` (mpi4py's default) the user's own mpi4py calls may run
  concurrently with plugdist's, and so do the calls of :meth:`Engine.run_here`, which then skips
  the lock (it touches no engine state, and MPI orders concurrent calls itself; taking the lock
  costs half a microsecond a call, a tenth of a small op).

An :class:`MPIWork` keeps its outcome itself: a ``torch.futures.Future`` is made only when
someone asks for one (``get_future``, ``then``), completed at once if the op already finished.
Making a future and completing the op each cost about a microsecond, a fifth of a small op.
Whoever waits on a future drives no MPI (torch's ``Future.wait`` blocks in C++), so making one
first tests the op in one burst on the asking thread (a small op is often done by then) and
otherwise marks it *awaited*: the progress thread is woken and tests it without the grace left
to an issuer (:meth:`Engine.hurry`). Before, such a wait took a millisecond (the progress
thread's doze); now a thread hand-off each way, tens of microseconds.

Work callbacks (``Work.then``, future callbacks) run on whichever thread completed the op: the
progress thread or a waiting one. They may issue ops, but must not block on one that only the
progress thread could complete while holding up that very thread.

A blocking MPI call (creating a communicator, the rendezvous broadcast) runs through
:meth:`Engine.call` on the caller's thread, under the lock; pending requests keep progressing
inside MPI meanwhile.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
from plugdist.backend import Work

from ._mpi import load

__all__ = ["Engine", "MPIWork", "engine", "SPIN_ENV"]

SPIN_ENV = "PLUGDIST_MPI_SPIN_US"
_MAX_NAP = 1e-3  # longest nap between polls: bounds the latency polling adds to slow ops
_AWAITED_NAP = 5e-5  # the same while an op is awaited through a future (its waiter drives none)
_GRACE = 2e-4    # how long a fresh op is left to a thread that may wait on it (and drive)
_LOOK = 1e-3     # how often a dozing progress thread looks for ops nobody drives
_DOZE = 0.01     # seconds without activity before it sleeps until woken (ops notify it)
_BURST = 32      # tests in a row by a waiting thread before it yields the CPU
_TRIES = range(_BURST)

T = TypeVar("T")


@dataclass(eq=False, slots=True)
class _Pending:
    request: Any
    work: Work
    owner: object
    result: Any                         # what the Work is completed with
    finish: Callable[[Any], None] | None  # runs with the status first, on the completing thread
    translate: Callable[[str, BaseException], BaseException]  # (op, MPI's error) -> the Work's
    op: str
    keep: Any = None                    # staging buffers MPI works on, alive until it ends
    cancellable: bool = False           # a receive: MPI_Cancel may withdraw it
    status: Any = None                  # an MPI Status, for ops whose ``finish`` reads it
    dropped: bool = False               # its Work was already failed: complete, then discard
    awaited: bool = False               # a future was made for it: not left to its issuer
    finished: bool = False              # MPI said done; being (or been) settled

    def fail(self, exc: BaseException) -> BaseException:
        return self.translate(self.op, exc)


Finished = list[tuple[_Pending, Any, "BaseException | None"]]


_RUNNING, _OK, _FAILED = 0, 1, 2
_OUTCOME_LOCK = threading.Lock()  # orders an outcome against a future made at the same time


class MPIWork(Work):
    """A :class:`~plugdist._backend.work.Work` whose ``wait`` drives MPI on the waiting thread.

    Same contract as Work: ``wait(timeout)`` blocks until the op finished (True) or raises its
    error, or ``DistTimeoutError`` once ``timeout`` (default: the group's) has passed. The
    outcome is kept on the Work itself; the ``torch.futures.Future`` is made only when someone
    asks for it (``get_future``, ``then``), and completed with the outcome from then on.
    """

    _pending: _Pending | None = None
    _state = _RUNNING
    _value: Any = None
    _error: BaseException | None = None
    _callbacks: list[Callable[[BaseException | None], None]] | None = None  # on_completion's

    def set_result(self, value: Any) -> None:
        with _OUTCOME_LOCK:
            if self._state:
                raise RuntimeError(f"{self.where()} was already completed")
            self._value = value
            self._state = _OK
            fut = self.lazy_future
            callbacks, self._callbacks = self._callbacks, None
        if callbacks:
            self.call_back(callbacks, None)
        if fut is not None:  # runs the future's callbacks (``then``) on this thread
            fut.set_result(value)

    def set_exception(self, exc: BaseException) -> None:
        err = self.with_context(exc)
        with _OUTCOME_LOCK:
            if self._state:
                raise RuntimeError(f"{self.where()} was already completed")
            self._error = err
            self._state = _FAILED
            fut = self.lazy_future
            callbacks, self._callbacks = self._callbacks, None
        if callbacks:
            self.call_back(callbacks, err)
        if fut is not None:
            fut.set_exception(err)

    def on_completion(self, callback: Callable[[BaseException | None], None]) -> None:
        """Work.on_completion without a future: kept until the outcome is set."""
        with _OUTCOME_LOCK:
            if not self._state:
                if self._callbacks is None:
                    self._callbacks = [callback]
                else:
                    self._callbacks.append(callback)
                return
        callback(self._error)

    def make_future(self) -> torch.futures.Future:
        p = self._pending
        if p is not None and not self._state:
            engine.finish(self, p)  # one burst here first: a small op is often done by now
        running = False
        with _OUTCOME_LOCK:
            fut = self.lazy_future
            if fut is None:
                fut = self.lazy_future = _new_future()
                # an outcome set before the future existed is handed over; a later one goes to
                # the future through set_result/set_exception
                if self._state == _OK:
                    fut.set_result(self._value)
                elif self._state == _FAILED:
                    fut.set_exception(self._error)
                else:
                    running = True
        if running and p is not None:
            # whoever waits on the future drives nothing: the progress thread must complete it
            engine.hurry(p)
        return fut

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        if not self._state:
            p = self._pending
            if p is None:  # not an op of the engine's (never the case for plugdist_mpi's ops)
                return super().wait(timeout)
            if not engine.finish(self, p):
                seconds = self.timeout_seconds(timeout)
                deadline = None if seconds is None else time.perf_counter() + seconds
                if not engine.drive(self, p, deadline):
                    raise self.timeout_error(seconds)
        fut = self.lazy_future
        if fut is not None and not fut.done():
            # the completing thread publishes the state first, then completes the future
            # outside the lock: the waiter returns once the future is done too (microseconds)
            settled_by = time.perf_counter() + 5.0
            while not fut.done() and time.perf_counter() < settled_by:
                time.sleep(0)
        if self._state == _FAILED:
            raise self._error  # type: ignore[misc]  # set with _FAILED
        return True

    def is_completed(self) -> bool:
        return self._state != _RUNNING

    def is_success(self) -> bool:
        return self._state == _OK

    def exception(self) -> BaseException | None:
        return self._error if self._state == _FAILED else None

    def result(self) -> Any:
        self.wait()
        return self._value

    def successor(self, op: str | None) -> Work:
        """A chained Work (``then``: AVG's divide, a DDP comm hook) drives this op's request
        too, so it does not wait for the progress thread."""
        nxt = MPIWork(**self.context(op))
        nxt._pending = self._pending
        return nxt


def _new_future() -> torch.futures.Future:
    return torch.futures.Future()


class Engine:
    """Issues non-blocking MPI calls and completes their Works.

    Thread-safe. Groups call :meth:`attach` when built and :meth:`detach` when shut down; the
    progress thread runs while at least one group is attached.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()  # the MPI lock: see the module docstring
        self._changed = threading.Condition(self.lock)
        self._pending: list[_Pending] = []
        self._abandoned: list[_Pending] = []
        self._users = 0
        self._drivers = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._exit_hook = False
        self._mpi: Any = None
        self._spin = max(float(os.environ.get(SPIN_ENV, "2000")), 0.0) * 1e-6
        self._last_event = 0.0
        self._last_issue = 0.0
        self._idle = False      # the progress thread sleeps with nothing pending
        self._multiple = False  # MPI runs at THREAD_MULTIPLE: run_here needs no lock

    # -- lifecycle -------------------------------------------------------------------------------
    def attach(self) -> None:
        """Register a group; starts the progress thread if needed."""
        MPI = load()
        with self.lock:
            self._users += 1
            if not self._exit_hook:
                # registered after mpi4py.MPI was imported, so it runs before mpi4py finalizes
                # MPI at exit: no MPI call may race with MPI_Finalize
                atexit.register(self.stop)
                self._exit_hook = True
            if self._thread is None or not self._thread.is_alive():
                self._mpi = MPI
                self._multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="plugdist-mpi-progress",
                                                daemon=True)
                self._thread.start()

    def detach(self, owner: object, reason: str) -> None:
        """Unregister a group: its pending ops fail, saying ``reason`` (receives are cancelled);
        the last group out stops the progress thread (MPI stays initialized: mpi4py finalizes
        it at exit)."""
        with self.lock:
            mine = [p for p in self._pending if p.owner is owner and not p.dropped]
            for p in mine:
                p.dropped = True
                if p.cancellable:
                    try:
                        p.request.Cancel()  # completed (and discarded) by the next test
                    except Exception:  # noqa: BLE001 - already done or failed: nothing to undo
                        pass
            # a collective cannot be cancelled; with its group gone it may never finish, so
            # stop testing it rather than keep the progress thread busy forever, but keep its
            # staging buffers alive: MPI may still write into them
            self._abandoned += [p for p in self._pending if p.dropped and not p.cancellable]
            self._pending = [p for p in self._pending if not (p.dropped and not p.cancellable)]
            self._users = max(self._users - 1, 0)
            last = self._users == 0
        for p in mine:
            _settle(p.work, exc=p.fail(RuntimeError(reason)))
        if last:
            self.stop()

    def stop(self) -> None:
        """Stop the progress thread and fail whatever is still pending. Idempotent."""
        with self.lock:
            self._stopping = True
            self._changed.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10.0)
        with self.lock:
            left, self._pending = self._pending, []
        for p in left:
            if not p.dropped:
                _settle(p.work, exc=p.fail(RuntimeError(
                    "the MPI progress engine stopped (every group was shut down, or the process "
                    "is exiting) before this op completed")))

    # -- issuing and waiting ---------------------------------------------------------------------
    def issue(self, owner: object, work: Work, start: Callable[..., Any], args: tuple[Any, ...],
              result: Any, finish: Callable[[Any], None] | None,
              translate: Callable[[str, BaseException], BaseException], keep: Any = None,
              cancellable: bool = False) -> Work:
        """Start a non-blocking MPI call (``start(*args)`` returns its request) and, when it
        finishes, complete ``work`` with ``result`` after ``finish(status)``; or, if MPI reports
        an error, fail it with ``translate(work.op, exc)``. ``keep`` stays alive until then.
        ``start`` runs now, on this thread, under the MPI lock; its exceptions propagate.
        ``cancellable`` requests (receives) are cancelled if their owner detaches first."""
        status = None if finish is None else self._mpi.Status()
        with self.lock:
            if self._thread is None:
                raise RuntimeError("the MPI progress engine is not running (the group was shut "
                                   "down)")
            p = _Pending(start(*args), work, owner, result, finish, translate, work.op, keep,
                         cancellable, status)
            self._track(p)
        if isinstance(work, MPIWork):
            work._pending = p
        return work

    def _track(self, p: _Pending) -> None:
        """Add ``p`` to the pending ones and wake the progress thread (lock held)."""
        self._pending.append(p)
        self._last_event = self._last_issue = time.perf_counter()
        if self._idle:
            self._changed.notify()

    def run_here(self, start: Callable[..., Any], args: tuple[Any, ...],
                 timeout: timedelta | None) -> Any:
        """Start a non-blocking MPI call (``start(*args)`` returns its request) and test it on
        this thread until it finishes: no Work, no progress thread involved (the blocking
        path). Returns None when done, or the still-active request once ``timeout`` has passed
        (hand it to :meth:`adopt`). MPI's errors propagate; MPI calls run under the MPI lock
        unless MPI runs at THREAD_MULTIPLE."""
        if self._multiple:
            test = start(*args).Test
            for _ in _TRIES:  # _burst, inlined: most small ops end here
                if test():
                    return None
            lock = None
        else:
            lock = self.lock
            with lock:
                test = start(*args).Test
                if _burst(test):
                    return None
        # the clock is read only for ops that outlive one burst: most small ones do not
        deadline = None if timeout is None else time.perf_counter() + timeout.total_seconds()
        while True:
            os.sched_yield()  # let the peer process run
            if lock is None:
                if _burst(test):
                    return None
            else:
                with lock:
                    if _burst(test):
                        return None
            if deadline is not None and time.perf_counter() > deadline:
                return test.__self__  # the request

    def adopt(self, owner: object, work: Work, request: Any, finish: Callable[[Any], None] | None,
              translate: Callable[[str, BaseException], BaseException], keep: Any) -> None:
        """Let the progress thread complete (or, at ``detach``, drop) a request that
        :meth:`run_here` gave up waiting for: ``work`` is completed (with None, after
        ``finish(status)``) or failed (``translate(work.op, exc)``) when it ends; ``keep`` (the
        op's buffers) stays alive until then."""
        status = None if finish is None else self._mpi.Status()
        with self.lock:
            self._track(_Pending(request, work, owner, None, finish, translate, work.op, keep,
                                 status=status))

    def hurry(self, p: _Pending) -> None:
        """A future was made for ``p``'s still-running op. Waiting on a future drives no MPI,
        so the progress thread tests ``p`` from now on without leaving it to its issuer first
        (see :meth:`_stand_aside`), and is woken if it dozes."""
        with self.lock:
            if not p.finished:
                p.awaited = True
                self._last_event = time.perf_counter()
                self._changed.notify()

    def call(self, fn: Callable[[], T]) -> T:
        """Run a blocking MPI call on this thread under the MPI lock, and return its result."""
        with self.lock:
            return fn()

    def finish(self, work: Work, p: _Pending) -> bool:
        """Test ``p``'s request on this thread, one burst, and complete its Work if MPI says it
        is done: the cheap first look of a waiter, with no bookkeeping (a fresh op is left to
        its issuer for a while anyway, see :meth:`_stand_aside`). True when ``work`` (``p``'s
        Work or one chained to it) is completed."""
        with self.lock:
            outcome = None if p.finished else self._test_burst(p)
        if outcome is not None:
            self._complete(*outcome)
        return work.is_completed()

    def drive(self, work: Work, p: _Pending, deadline: float | None) -> bool:
        """Test ``p``'s request on this thread until ``work`` (its Work, or one chained to it) is
        completed (True) or ``deadline`` (a ``time.perf_counter()`` value) passes (False). MPI
        progresses every pending op inside any test, so testing this one request is enough.
        While a thread drives, the progress thread keeps out of its way."""
        with self.lock:
            self._drivers += 1
        try:
            while not work.is_completed():
                if deadline is not None and time.perf_counter() > deadline:
                    return False
                with self.lock:
                    # completed by another thread (p.finished): its Work is being settled
                    outcome = None if p.finished else self._test_burst(p)
                if outcome is not None:
                    self._complete(*outcome)
                else:
                    # let the peer process, or the thread settling this Work, run
                    os.sched_yield()
            return True
        finally:
            with self.lock:
                self._drivers -= 1
                self._last_event = time.perf_counter()

    def _test_burst(self, p: _Pending) -> tuple[_Pending, Any, BaseException | None] | None:
        """Test ``p`` up to _BURST times in a row (lock held); once done, take it off the
        pending list and return its outcome. A burst, because MPI progresses only inside its
        calls, and a multi-step collective advances one step per test on each side."""
        for _ in _TRIES:
            outcome = self._test_one(p)
            if outcome is not None:
                self._pending.remove(p)
                return outcome
        return None

    # -- the progress thread -----------------------------------------------------------------------
    def _run(self) -> None:
        nap = 0.0
        while True:
            with self.lock:
                self._stand_aside()
                if self._stopping:
                    return
                awaited = any(p.awaited for p in self._pending)
                # an awaited op gets a burst, as a waiter's drive gives it: a collective
                # advances one step per test, and between naps each test costs a nap. At most
                # a burst of tests in all, so that the lock is not held long from issuers
                rounds = max(_BURST // len(self._pending), 1) if awaited else 1
                for _ in range(rounds):
                    finished = self._test_pending()
                    if finished:
                        break
                quiet_for = time.perf_counter() - self._last_event
                longest = _AWAITED_NAP if awaited else _MAX_NAP
            # Works are completed outside the lock: their callbacks may issue new ops
            for item in finished:
                self._complete(*item)
            if finished:
                nap = 0.0
                with self.lock:
                    self._last_event = time.perf_counter()
            elif quiet_for < self._spin:
                os.sched_yield()  # hand the CPU (and the GIL) to other threads, then poll again
            else:
                nap = min(longest, nap * 2 if nap else 2e-5)
                time.sleep(nap)

    def _stand_aside(self) -> None:
        """Sleep (lock held, released while waiting) while the progress thread has nothing to do:
        no pending request, a thread driving MPI itself, or ops so fresh that their issuer is
        probably about to wait on them (then it drives, and polling here would only compete with
        it for the GIL), unless one of them is awaited through a future."""
        while not self._stopping:
            now = time.perf_counter()
            if not self._pending:
                if now - self._last_event > _DOZE:
                    self._idle = True   # deep sleep: the next issue wakes it
                    self._changed.wait()
                    self._idle = False
                else:
                    # doze, and look again: being woken per op would cost a GIL hand-off each
                    self._changed.wait(timeout=_LOOK)
                continue
            if self._drivers:
                self._changed.wait(timeout=_LOOK)
                continue
            young = _GRACE - (now - self._last_issue)
            if young > 0 and not any(p.awaited for p in self._pending):
                self._changed.wait(timeout=young)
                continue
            return

    def _test_pending(self) -> Finished:
        """Test every pending request (lock held); remove and return the finished ones with
        their errors."""
        finished: Finished = []
        for p in self._pending:
            outcome = self._test_one(p)
            if outcome is not None:
                finished.append(outcome)
        if finished:
            self._pending = [p for p in self._pending if not p.finished]
        return finished

    @staticmethod
    def _test_one(p: _Pending) -> tuple[_Pending, Any, BaseException | None] | None:
        """Test one request (lock held): None while it runs, else (p, status, error)."""
        try:
            if not p.request.Test(p.status):
                return None
            outcome: tuple[_Pending, Any, BaseException | None] = (p, p.status, None)
        except Exception as exc:  # noqa: BLE001 - an MPI error ends this op only
            outcome = (p, None, exc)
        p.finished = True
        return outcome

    @staticmethod
    def _complete(p: _Pending, status: Any, exc: BaseException | None) -> None:
        if p.dropped:
            return
        if exc is not None:
            _settle(p.work, exc=p.fail(exc))
            return
        if p.finish is not None:
            try:
                p.finish(status)
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the Work
                _settle(p.work, exc=p.fail(err))
                return
        _settle(p.work, result=p.result)


def _burst(test: Callable[[], bool]) -> bool:
    """Call ``test`` (a request's Test) up to _BURST times in a row; True once it is done."""
    for _ in _TRIES:
        if test():
            return True
    return False


def _settle(work: Work, result: Any = None, exc: BaseException | None = None) -> None:
    """Complete ``work`` unless it already is (a shut-down group fails Works early)."""
    if work.is_completed():
        return
    try:
        if exc is not None:
            work.set_exception(exc)
        else:
            work.set_result(result)
    except RuntimeError:  # lost a race with another completer: the first answer stands
        pass


engine = Engine()
