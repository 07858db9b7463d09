"""``MPIProcessGroup``: every plugdist op as one non-blocking MPI call on the group's communicator.

Each group owns a communicator made with ``MPI_Comm_create_group`` from the members' global
ranks (the world group too, so user traffic on ``MPI.COMM_WORLD`` never mixes with plugdist's).
Ops are issued and progressed by :mod:`plugdist_mpi.engine`; tensors are handed to MPI in place
(:mod:`plugdist_mpi.dtypes`). The only staging copies: the input of ``reduce_scatter`` when its
list is not already one contiguous run, and an input that overlaps its own output.

Where the MPI has ULFM switched on (Open MPI 5 under ``mpiexec --with-ft ulfm``,
:mod:`plugdist_mpi._ulfm`), a dead peer makes ops fail with ``DistRankFailureError`` naming it
(MPI's ``MPI_ERR_PROC_FAILED``/``MPI_ERR_REVOKED``, reported to membership too), and
``native_shrink`` builds the survivors' group with ``MPI_Comm_revoke`` + ``MPI_Comm_shrink``.
Everywhere else ``rebuild_refusal`` says why the group's members are fixed.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, ClassVar, NoReturn

import torch
from plugdist import ReduceOp
from plugdist.backend import BackendBase, GroupOptions, Work, get_logger, report_failed_ranks
from plugdist.errors import (
    DistBackendError,
    DistError,
    DistRankFailureError,
    DistTimeoutError,
    timed_out,
    where,
)
from plugdist.store import Store, TCPStore

from . import _ulfm, dtypes
from ._mpi import availability, load
from .engine import MPIWork, engine

__all__ = ["MPIProcessGroup", "STORE_HOST_ENV"]

STORE_HOST_ENV = "PLUGDIST_MPI_STORE_HOST"
_CREATE_TAG_SPAN = 32768  # MPI guarantees tags 0..32767 on every communicator
_LEAN_ARGS_KEPT = 64  # lean ops' MPI arguments kept per group (by address, size, dtype, op)


class _Base:
    """The communicator whose ranks are plugdist's world ranks: ``MPI_COMM_WORLD`` until a
    shrink makes it the survivors' (never used for traffic, never revoked). Groups are made
    from it, and checked against it."""

    comm: Any = None
    ulfm_ready = False  # COMM_WORLD returns errors (set once, when ULFM is found on)


_base = _Base()


def _world_comm(MPI: Any) -> Any:
    return MPI.COMM_WORLD if _base.comm is None else _base.comm


def _setup_ulfm(MPI: Any) -> None:
    """Decide, once MPI is loaded, whether groups can be rebuilt (``rebuild_refusal``); with
    ULFM on, make MPI_COMM_WORLD return errors so that a dead peer never aborts the job."""
    refusal = _ulfm.refusal(MPI)
    MPIProcessGroup.rebuild_refusal = refusal
    if not refusal and not _base.ulfm_ready:
        engine.call(lambda: MPI.COMM_WORLD.Set_errhandler(MPI.ERRORS_RETURN))
        _base.ulfm_ready = True


class _Here(threading.local):
    """Per thread: whether the next ``_issue`` runs its op on this thread (native_blocking)."""

    active = False


class MPIProcessGroup(BackendBase):
    """A group of processes started by ``mpiexec``, talking through MPI (mpi4py).

    Construction is collective over the group's members only (non-members never call it) and
    blocks until every member arrived, bounded by ``options.timeout`` (``DistTimeoutError`` names
    the missing ranks). The group rank and size the core passes must agree with MPI's view of
    this process, else ``DistBackendError``. Every op returning a Work is asynchronous and never
    blocks the caller; ``native_blocking`` (the synchronous frontend's path) runs one on the
    caller's thread instead. Ops of a group start on the MPI communicator in the order they were
    issued.
    Thread-safe: ops may be issued from several threads (MPI calls are serialized by one lock).
    """

    backend_name: ClassVar[str] = "mpi"
    plugin_api = (2, 0)  # written for plugdist's plugin API 2.x
    # replaced when the first group is built, from the MPI actually loaded (_setup_ulfm)
    rebuild_refusal: ClassVar[str] = (
        "an MPI group's members are fixed by mpiexec: MPICH's mpiexec ends every rank when one "
        f"dies. Use gloo for resilient training, or Open MPI 5 started with `{_ulfm.LAUNCH}`")
    grow_refusal: ClassVar[str] = (
        "an MPI world cannot take in a process started on its own (init_process_group(join="
        "True)): that would need MPI_Comm_connect/accept between two MPI jobs, or "
        "MPI_Comm_spawn by the members, neither of which plugdist-mpi does; after "
        "shrink_group an MPI world only gets smaller. Use gloo where processes must join")
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    # AVG is left to the core (SUM, then a local divide)
    native_reduce_ops: ClassVar[frozenset[ReduceOp]] = frozenset(ReduceOp) - {ReduceOp.AVG}
    supports_any_source: ClassVar[bool] = True
    launcher: ClassVar[str] = "mpiexec"  # plugdist.testing.run_world starts worlds with mpiexec

    def __init__(self, store: Store, rank: int, size: int,
                 options: GroupOptions | None = None) -> None:
        super().__init__(rank, size, options)
        here = where(rank=rank, group=self.group_name, backend=self.backend_name)
        ok, reason = availability()
        if not ok:
            raise DistBackendError(f"{here} MPI is not usable: {reason}")
        MPI = self._prepare()
        members = tuple(self.options.global_ranks) or tuple(range(size))
        _check_identity(MPI, here, rank, size, members, _is_world(options, size))
        _arrive(store, here, rank, size, self.timeout, members)
        self._adopt(lambda: _create_comm(MPI, members, self.group_name), members)

    @classmethod
    def _over(cls, base: Any, rank: int, size: int, options: GroupOptions) -> MPIProcessGroup:
        """A group over all of ``base`` (a communicator every member holds), on a duplicate of
        it; collective over ``base``."""
        group = cls.__new__(cls)
        BackendBase.__init__(group, rank, size, options)
        MPI = group._prepare()
        group._adopt(lambda: _dup(MPI, base), tuple(options.global_ranks))
        return group

    def _prepare(self) -> Any:
        """What every group sets up before it has a communicator; returns mpi4py's MPI."""
        MPI = load()
        self._MPI = MPI
        self._comm: Any = None
        self._fromaddress = dtypes.buffer_type(MPI).fromaddress
        self._lean_args: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # see _remember
        self._here = _Here()
        self._log = get_logger(rank=self.group_rank, group=self.group_name)
        _setup_ulfm(MPI)
        self._failure_classes = _ulfm.failure_classes(MPI) if not self.rebuild_refusal else \
            frozenset()
        return MPI

    def _adopt(self, make: Callable[[], Any], members: Sequence[int]) -> None:
        """Take the communicator ``make()`` creates (an MPI call, run under the MPI lock) as
        this group's."""
        MPI = self._MPI
        engine.attach()
        try:
            self._comm = engine.call(make)
        except BaseException:
            engine.detach(self, "group creation failed")
            raise
        # MPI attaches TAG_UB to MPI_COMM_WORLD; a communicator made by a shrink lacks it
        tag_ub = engine.call(lambda: self._comm.Get_attr(MPI.TAG_UB)
                             or MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))
        self._tag_ub = int(tag_ub)
        self._log.debug("mpi group created", size=self.group_size, global_ranks=list(members))

    # -- plugin metadata ------------------------------------------------------------------------
    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Whether mpi4py imports and MPI initializes here (this initializes MPI), and why not."""
        return availability()

    @classmethod
    def rendezvous(cls, timeout: timedelta) -> tuple[Store, int, int]:
        """Rank and world size from ``MPI.COMM_WORLD`` (once a shrink under ULFM replaced it:
        the survivors' world), and a TCPStore served by rank 0.

        A ``WORLD_SIZE`` in the environment (from another launcher) that disagrees with MPI's
        is an error: N processes that are each a world of one would train apart, silently.

        Collective over that world, blocking: rank 0 starts the store, with a fresh token, and
        broadcasts its address and token over MPI (``PLUGDIST_MPI_STORE_HOST`` overrides the host
        name it announces; the token never reaches an environment or a command line); the others
        connect (127.0.0.1 when they run on rank 0's host), bounded by ``timeout``.
        """
        ok, reason = availability()
        if not ok:
            raise DistBackendError(f"[backend 'mpi', op rendezvous] MPI is not usable: {reason}")
        MPI = load()
        comm = _world_comm(MPI)  # the survivors', after a shrink
        rank, size = comm.Get_rank(), comm.Get_size()
        here = where(rank=rank, backend="mpi", op="rendezvous")
        launched = os.environ.get("WORLD_SIZE", "")
        if launched.isdigit() and int(launched) != size:
            # e.g. plugdist-run or torchrun started N separate MPI singletons: each would run
            # a training of its own, silently
            raise DistBackendError(
                f"{here} MPI sees {size} process(es) in COMM_WORLD, but WORLD_SIZE={launched}: "
                f"the processes were not started by one mpiexec. Start them with "
                f"`mpiexec -n {launched} python script.py` (not plugdist-run or torchrun), or "
                f"use another backend (gloo) under this launcher")
        store: TCPStore | None = None
        announce: tuple[str, ...]
        if rank == 0:
            try:
                token = secrets.token_hex(32)  # only this job's ranks learn it, through MPI
                store = TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout,
                                 wait_for_workers=False, token=token, bind_host="0.0.0.0")
                host = os.environ.get(STORE_HOST_ENV) or socket.gethostname()
                announce = ("ok", host, str(store.port), token)
            except Exception as exc:  # noqa: BLE001 - told to every rank, so none waits forever
                announce = ("error", f"{type(exc).__name__}: {exc}")
        else:
            announce = ()
        # the others must hear about a failure too, or they would wait in bcast forever
        announce = engine.call(lambda: comm.bcast(announce, root=0))
        if announce[0] != "ok":
            raise DistBackendError(f"{here} rank 0 could not start the TCPStore: {announce[1]}")
        if store is None:
            host, port = announce[1], int(announce[2])
            if host == socket.gethostname() and not os.environ.get(STORE_HOST_ENV):
                host = "127.0.0.1"
            store = TCPStore(host, port, size, is_master=False, timeout=timeout,
                             token=announce[3])
        return store, rank, size

    def shutdown(self) -> None:
        """Fail this group's pending ops and free its communicator. Idempotent; never finalizes
        MPI (mpi4py does at exit)."""
        comm, self._comm = getattr(self, "_comm", None), None
        if comm is None:
            return
        engine.detach(self, "the group was shut down before this op completed")
        try:
            engine.call(comm.Free)
        except Exception as exc:  # noqa: BLE001 - best effort, the group is going anyway
            self._log.debug("freeing the communicator failed", error=str(exc))
        self._log.debug("mpi group shut down")

    @property
    def comm(self) -> Any:
        """This group's ``mpi4py.MPI.Comm`` (for advanced users; MPI calls on it must not race
        with plugdist's unless MPI runs at THREAD_MULTIPLE)."""
        return self._comm

    # -- plumbing -------------------------------------------------------------------------------
    def _issue(self, op: str, start: Callable[[Any], Any], result: Any,
               finish: Callable[[Any], None] | None = None, keep: tuple[Any, ...] = (),
               source_rank: Callable[[], int] | int = -1, cancellable: bool = False) -> Work:
        """Start ``start(comm)`` (a non-blocking MPI call) and return a Work completed with
        ``result`` (after ``finish(status)``) when MPI says it is done. ``keep`` holds staging
        tensors alive until then (MPI buffers do not own their memory)."""
        comm = self._comm
        if comm is None:
            raise DistBackendError(f"{self.where(op)} this group was shut down; create a new one")
        here = self._here
        if here.active:  # native_blocking asked for this op: run it on this thread, no Work
            here.active = False
            self._run_here(op, start, (comm,), finish, keep)
            return None  # type: ignore[return-value]
        work = self._mpi_work(op, source_rank)
        try:
            return engine.issue(self, work, start, (comm,), result, finish, self._translate,
                                keep, cancellable)
        except (DistError, ValueError, TypeError):
            raise
        except Exception as exc:
            raise self._translate(op, exc) from exc

    def _mpi_work(self, op: str, source_rank: Callable[[], int] | int = -1) -> MPIWork:
        """A pending MPIWork carrying this group's context (``BackendBase.work``'s, as MPIWork)."""
        return MPIWork(op=op, rank=self.group_rank, group=self.group_name,
                       backend=self.backend_name, timeout=self.timeout, source_rank=source_rank)

    def _remember(self, key: tuple[Any, ...], args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Keep the MPI arguments of a lean op for ``key``; a bounded cache (a buffer view
        names memory only: one kept past its tensor's life is never used for another tensor
        unless that one has the same address, size and dtype, and so the same view)."""
        cache = self._lean_args
        if len(cache) >= _LEAN_ARGS_KEPT:
            cache.clear()
        cache[key] = args
        return args

    def _run_here(self, op: str, start: Callable[..., Any], args: tuple[Any, ...],
                  finish: Callable[[Any], None] | None = None, keep: Any = None) -> None:
        """Run ``start(*args)`` (a non-blocking MPI call) to completion on this thread, then
        ``finish``. Raises the op's error, or DistTimeoutError after the group's timeout."""
        timeout = self.options.timeout
        try:
            late = engine.run_here(start, args, timeout)
        except Exception as exc:
            raise self._translate(op, exc) from exc
        if late is not None:
            self._give_up(op, late, finish, keep)
        if finish is not None:
            finish(None)  # only recv's finish reads the status, and recv never runs here

    def _give_up(self, op: str, request: Any, finish: Any, keep: Any) -> NoReturn:
        """An op run on the caller's thread outlived the timeout: the progress thread finishes
        it if the peers come (``keep`` and the buffers stay alive until then); the caller gets
        DistTimeoutError."""
        engine.adopt(self, self._mpi_work(op), request, finish, self._translate, keep)
        raise self.timeout_error(op)

    def _translate(self, op: str, exc: BaseException) -> BaseException:
        """A DistBackendError naming rank, group, op and the MPI error (class and text)."""
        if isinstance(exc, DistError):
            return exc
        MPI = self._MPI
        if isinstance(exc, MPI.Exception):
            cls = exc.Get_error_class()
            text = exc.Get_error_string().strip().splitlines()[0]
            if cls in self._failure_classes:
                return self._rank_failure(op, text, exc)
            hint = ""
            if cls == MPI.ERR_TRUNCATE:
                hint = ("; the message was larger than the receiving tensor: make it as large "
                        "as the sender's")
            err: BaseException = DistBackendError(
                f"{self.where(op)} failed: MPI error class {cls} ({text}){hint}")
        else:
            err = DistBackendError(f"{self.where(op)} failed: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err

    def _rank_failure(self, op: str, text: str, exc: BaseException) -> DistRankFailureError:
        """The error for an op that MPI (ULFM) failed because a member died: names the failed
        global ranks, MPI's own knowledge first (reported to membership, so that both agree),
        else membership's (another member saw the failure and revoked the communicator; the
        store usually names the dead rank within milliseconds). The communicator is revoked,
        so no member stays blocked in it."""
        failed: list[int] = []
        comm = self._comm
        if comm is not None:
            try:
                failed = engine.call(lambda: _ulfm.failed_in(comm))
                engine.call(lambda: comm.Is_revoked() or comm.Revoke())
            except Exception as query:  # noqa: BLE001 - the error below is what matters
                self._log.debug("ulfm query failed", error=str(query))
        members = self.options.global_ranks or tuple(range(self.group_size))
        ranks = tuple(members[r] for r in failed if r < len(members))
        if ranks:
            report_failed_ranks(ranks, f"MPI reported it: {text}")
        signal = self.abort_signal
        if signal.monitored and (signal.fired or signal.wait(1.0)):
            err = signal.error(self.where(op))
        else:
            who = (f"ranks {list(ranks)} failed" if ranks else
                   "a member failed (another member revoked the communicator)")
            err = DistRankFailureError(
                f"{self.where(op)} failed: {who} (MPI: {text}); call plugdist.shrink_group() on "
                f"every survivor to continue without the failed ranks", ranks)
        err.__cause__ = exc
        return err

    def native_abort(self) -> None:
        """With ULFM: revoke the communicator, so that every op in flight on it, here and on
        the other members, fails at once instead of waiting for the dead peer."""
        comm = self._comm
        if comm is None or not self._failure_classes:
            return
        try:
            engine.call(lambda: comm.Is_revoked() or comm.Revoke())
        except Exception as err:  # noqa: BLE001 - aborting is best effort
            self._log.debug("revoking the communicator failed", error=str(err))

    def native_shrink(self, keep: Sequence[int], options: GroupOptions) -> Any:
        """The survivors' group, through ULFM: the communicator is revoked, then
        ``MPI_Comm_shrink`` (MPI's own agreement on who is alive) gives the survivors, ordered
        as ``keep`` by a split. When ``keep`` leaves out ranks that are alive
        (``ranks_to_exclude``), the group is created from the current MPI world over ``keep``
        instead. The result becomes the MPI world that later groups are made from."""
        if self.rebuild_refusal:  # the core refuses before calling this; kept for direct calls
            raise DistBackendError(f"{self.where('shrink_group')} {self.rebuild_refusal}")
        comm, MPI = self._comm, self._MPI
        if comm is None:
            raise DistBackendError(f"{self.where('shrink_group')} this group was shut down")
        keep = list(keep)
        gone = set(range(self.group_size)) - set(keep)
        here = where(rank=self.group_rank, group=options.group_name, backend=self.backend_name,
                     op="shrink_group")
        engine.call(lambda: comm.Is_revoked() or comm.Revoke())
        members = self.options.global_ranks or tuple(range(self.group_size))
        key = keep.index(self.group_rank)
        if gone <= self._known_failed(gone):
            try:
                base = engine.call(lambda: _shrink_in_order(MPI, comm, key, len(keep)))
            except _SurvivorsDiffer as differ:
                raise self._survivors_differ(here, differ.size, keep) from None
            except MPI.Exception as exc:  # another member died meanwhile: the core agrees again
                raise self._translate("shrink_group", exc) from exc
        else:
            world_ranks = [members[r] for r in keep]
            try:
                base = engine.call(lambda: _create_from(MPI, _world_comm(MPI), world_ranks,
                                                        options.group_name))
            except MPI.Exception as exc:
                raise DistBackendError(
                    f"{here} MPI could not make the group of ranks {world_ranks}: "
                    f"{exc.Get_error_string().strip()}. With MPI, ranks_to_exclude may name live "
                    f"ranks only while no rank has failed; after a failure call shrink_group() "
                    f"without it") from exc
        try:
            group = MPIProcessGroup._over(base, key, len(keep), options)
        except MPI.Exception as exc:
            raise self._translate("shrink_group", exc) from exc
        old, _base.comm = _base.comm, base
        if old is not None:
            try:
                engine.call(old.Free)
            except Exception:  # noqa: BLE001 - a world that held the dead: freeing is tidying
                pass
        return group

    def _known_failed(self, ranks: set[int], wait: float = 1.0) -> set[int]:
        """The group ranks known to have failed, by membership or MPI, waiting up to ``wait``
        seconds for ``ranks`` to be among them (the survivors' agreement may name a death that
        this process hears of a few milliseconds later)."""
        import plugdist

        comm = self._comm
        deadline = time.monotonic() + wait
        while True:
            known = set(plugdist.get_failed_ranks())  # the default group's ranks
            if comm is not None:
                known |= set(engine.call(lambda: _ulfm.failed_in(comm)))
            if ranks <= known or time.monotonic() > deadline:
                return known
            time.sleep(0.01)

    def _survivors_differ(self, here: str, mpi_size: int, keep: list[int]) -> DistError:
        """MPI's shrink found ``mpi_size`` survivors where the store agreed on ``keep``.
        Fewer: a member of ``keep`` died after the agreement; once membership knows it (MPI's
        view is reported to it; the store's will tells it too), the core agrees again."""
        if mpi_size < len(keep):
            comm = self._comm
            if comm is not None:
                mpi_failed = engine.call(lambda: _ulfm.failed_in(comm))
                report_failed_ranks([r for r in mpi_failed if r in keep],
                                    "MPI found it dead while the survivors shrank the group")
            deadline = time.monotonic() + 1.0
            dead = sorted(self._known_failed(set(), wait=0) & set(keep))
            while not dead and time.monotonic() < deadline:
                time.sleep(0.01)
                dead = sorted(self._known_failed(set(), wait=0) & set(keep))
            return DistRankFailureError(
                f"{here} MPI found {mpi_size} survivors where {len(keep)} were agreed on: ranks "
                f"{dead or '(not yet named)'} failed meanwhile", tuple(dead))
        return DistBackendError(
            f"{here} MPI counts {mpi_size} live processes but the survivors agreed on "
            f"{len(keep)}: a rank declared failed for not answering (a hung process) is alive "
            f"to MPI, and MPI cannot leave out a live process that does not take part; end "
            f"that process")

    def _reduce_spec(self, op_name: str, op: ReduceOp, dtype: torch.dtype) -> dtypes.ReduceSpec:
        spec = dtypes.cached_spec(op, dtype)
        if spec is not None:
            return spec
        try:
            return engine.call(lambda: dtypes.reduce_spec(self._MPI, op, dtype))
        except ValueError as exc:
            raise ValueError(f"{self.where(op_name)} {exc}") from None

    def _check_tag(self, op: str, tag: int) -> None:
        if not isinstance(tag, int) or not 0 <= tag <= self._tag_ub:
            raise ValueError(f"{self.where(op)} tag={tag!r} is outside MPI's tag range "
                             f"0..{self._tag_ub} on this communicator")

    def _bytes(self, t: torch.Tensor) -> list[Any]:
        """``[buffer, MPI.BYTE]``: ``t``'s bytes, for ops that only move data."""
        return [dtypes.raw(self._MPI, t), self._MPI.BYTE]

    def _typed(self, t: torch.Tensor, datatype: Any) -> list[Any]:
        """``[buffer, count, datatype]``: ``t``'s elements, for reductions."""
        return [dtypes.raw(self._MPI, t), t.numel(), datatype]

    def _receive_into(self, tensors: list[torch.Tensor]) -> tuple[list[Any], Any, tuple[Any, ...]]:
        """A v-collective receive spec writing straight into ``tensors``, or (when MPI cannot
        address them all) into a staging buffer copied out by the returned ``finish``."""
        MPI = self._MPI
        spread = dtypes.scattered(MPI, tensors)
        if spread is not None:
            buf, counts, displs = spread
            return [buf, (counts, displs), MPI.BYTE], None, ()
        flat, counts, displs = dtypes.staged(tensors)

        def finish(_status: Any) -> None:
            for t, d, c in zip(tensors, displs, counts, strict=True):
                t.reshape(-1).view(torch.uint8).copy_(flat[d:d + c])

        return [dtypes.raw(MPI, flat), (counts, displs), MPI.BYTE], finish, (flat,)

    def _send_from(self, tensors: list[torch.Tensor]) -> tuple[list[Any], tuple[Any, ...]]:
        """A v-collective send spec reading ``tensors`` in place, or a packed copy of them."""
        MPI = self._MPI
        spread = dtypes.scattered(MPI, tensors)
        if spread is not None:
            buf, counts, displs = spread
            return [buf, (counts, displs), MPI.BYTE], (tensors,)
        flat, counts, displs = dtypes.staged(tensors, fill=True)
        return [dtypes.raw(MPI, flat), (counts, displs), MPI.BYTE], (flat, tensors)

    def _own_contribution(self, tensor: torch.Tensor, slot_address: int | None,
                          outputs: list[torch.Tensor], staged: bool) -> tuple[Any, Any]:
        """The send side of a gather-like op, and what to keep alive: ``MPI.IN_PLACE`` when
        ``tensor`` already is this rank's slot of the output (the slot starts at
        ``slot_address``), a copy when it overlaps the output any other way, else ``tensor``
        itself."""
        if not staged and slot_address is not None and tensor.numel() and \
                slot_address == tensor.data_ptr():
            return self._MPI.IN_PLACE, None
        if not staged and any(dtypes.overlap(tensor, o) for o in outputs):
            tensor = tensor.clone()
        return self._bytes(tensor), tensor

    # -- native hooks ---------------------------------------------------------------------------
    def native_broadcast(self, *, tensor: torch.Tensor, src: int) -> Work:
        buf = self._bytes(tensor)
        return self._issue("broadcast", lambda c: c.Ibcast(buf, root=src), [tensor])

    def native_all_reduce(self, *, tensor: torch.Tensor, op: ReduceOp) -> Work:
        # the MPI arguments of the lean route's, kept per (address, bytes, dtype, op)
        key = (tensor.data_ptr(), tensor.nbytes, tensor.dtype, op)
        args = self._lean_args.get(key)
        if args is None:
            dt, mop = self._reduce_spec("all_reduce", op, tensor.dtype)
            buf = [self._fromaddress(key[0], key[1]), tensor.numel(), dt]
            args = self._remember(key, (self._MPI.IN_PLACE, buf, mop))
        return self._issue("all_reduce", lambda c: c.Iallreduce(*args), [tensor])

    def native_blocking(self, op: str, kwargs: dict[str, Any]) -> Any:
        """Every op is one non-blocking MPI call (issued by ``_issue``): run it on this thread."""
        here = self._here
        here.active = True
        try:
            # every native op issues through _issue, which runs it here and returns None
            return getattr(self, "native_" + op)(**kwargs)
        finally:
            here.active = False

    # -- lean blocking hooks: the same MPI calls as the native ops, spelled out (every
    # microsecond here is overhead over raw mpi4py); NotImplemented leaves the cases that need an
    # MPI reduction spec made or a staging copy to native_blocking
    def native_all_reduce_blocking(self, *, tensor: torch.Tensor, op: ReduceOp) -> Any:
        comm = self._comm
        if comm is None:
            return NotImplemented
        # Iallreduce's arguments depend only on the memory and the reduction: made once per
        # (address, bytes, dtype, op), as a loop that reduces the same tensor asks again
        key = (tensor.data_ptr(), tensor.nbytes, tensor.dtype, op)
        args = self._lean_args.get(key)
        if args is None:
            spec = dtypes.cached_spec(op, tensor.dtype)
            if spec is None:
                return NotImplemented
            buf = [self._fromaddress(key[0], key[1]), tensor.numel(), spec[0]]
            args = self._remember(key, (self._MPI.IN_PLACE, buf, spec[1]))
        try:  # _run_here, spelled out: one Python call less on the op benchmarks time
            late = engine.run_here(comm.Iallreduce, args, self.options.timeout)
        except Exception as exc:
            raise self._translate("all_reduce", exc) from exc
        if late is not None:
            self._give_up("all_reduce", late, None, tensor)
        return None

    def native_broadcast_blocking(self, *, tensor: torch.Tensor, src: int) -> Any:
        comm = self._comm
        if comm is None:
            return NotImplemented
        buf = [self._fromaddress(tensor.data_ptr(), tensor.nbytes), self._MPI.BYTE]
        return self._run_here("broadcast", comm.Ibcast, (buf, src), keep=tensor)

    def native_reduce_blocking(self, *, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Any:
        spec = dtypes.cached_spec(op, tensor.dtype)
        comm = self._comm
        if spec is None or comm is None:
            return NotImplemented
        buf = [self._fromaddress(tensor.data_ptr(), tensor.nbytes), tensor.numel(), spec[0]]
        sides = (self._MPI.IN_PLACE, buf) if self.group_rank == dst else (buf, None)
        return self._run_here("reduce", comm.Ireduce, (*sides, spec[1], dst), keep=tensor)

    def native_all_gather_into_tensor_blocking(self, *, output: torch.Tensor,
                                               tensor: torch.Tensor) -> Any:
        comm = self._comm
        if comm is None:
            return NotImplemented
        byte = self._MPI.BYTE
        nbytes, at = tensor.nbytes, tensor.data_ptr()
        out_at = output.data_ptr()
        if nbytes and at == out_at + self.group_rank * nbytes:
            send: Any = self._MPI.IN_PLACE  # the input already is this rank's slot
        elif dtypes.spans_overlap(at, nbytes, out_at, nbytes * self.group_size):
            return NotImplemented  # overlaps the output elsewhere: native_blocking copies it
        else:
            send = [self._fromaddress(at, nbytes), byte]
        recv = [self._fromaddress(out_at, nbytes * self.group_size), byte]
        return self._run_here("all_gather_into_tensor", comm.Iallgather, (send, recv),
                              keep=(tensor, output))

    def native_reduce_scatter_tensor_blocking(self, *, output: torch.Tensor, input: torch.Tensor,
                                              op: ReduceOp) -> Any:
        spec = dtypes.cached_spec(op, output.dtype)
        comm = self._comm
        if spec is None or comm is None or dtypes.overlap(input, output):
            return NotImplemented
        n = output.numel()
        send = [self._fromaddress(input.data_ptr(), input.nbytes), n * self.group_size, spec[0]]
        recv = [self._fromaddress(output.data_ptr(), output.nbytes), n, spec[0]]
        return self._run_here("reduce_scatter_tensor", comm.Ireduce_scatter,
                              (send, recv, [n] * self.group_size, spec[1]), keep=(input, output))

    def native_all_to_all_single_blocking(self, *, output: torch.Tensor,
                                          input: torch.Tensor) -> Any:
        comm = self._comm
        nbytes, at, out_at = input.nbytes, input.data_ptr(), output.data_ptr()
        if comm is None or dtypes.spans_overlap(at, nbytes, out_at, nbytes):
            return NotImplemented  # aliased: native_blocking sends from a copy
        byte = self._MPI.BYTE
        send = [self._fromaddress(at, nbytes), byte]  # mpi4py cuts both into size blocks
        recv = [self._fromaddress(out_at, nbytes), byte]
        return self._run_here("all_to_all_single", comm.Ialltoall, (send, recv),
                              keep=(input, output))

    def native_reduce(self, *, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Work:
        dt, mop = self._reduce_spec("reduce", op, tensor.dtype)
        buf = self._typed(tensor, dt)
        if self.group_rank == dst:
            start = lambda c: c.Ireduce(self._MPI.IN_PLACE, buf, mop, root=dst)  # noqa: E731
        else:
            start = lambda c: c.Ireduce(buf, None, mop, root=dst)  # noqa: E731
        return self._issue("reduce", start, [tensor])

    def native_all_gather(self, *, output_tensors: list[torch.Tensor],
                          tensor: torch.Tensor) -> Work:
        recv, finish, keep = self._receive_into(output_tensors)
        send, mine = self._own_contribution(tensor, output_tensors[self.group_rank].data_ptr(),
                                            output_tensors, staged=finish is not None)
        return self._issue("all_gather", lambda c: c.Iallgatherv(send, recv), output_tensors,
                           finish, keep=(keep, mine))

    def native_all_gather_into_tensor(self, *, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        slot = output.data_ptr() + self.group_rank * tensor.nbytes
        send, mine = self._own_contribution(tensor, slot, [output], staged=False)
        recv = self._bytes(output)
        return self._issue("all_gather_into_tensor", lambda c: c.Iallgather(send, recv),
                           [output], keep=(mine,))

    def native_gather(self, *, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None,
                      dst: int) -> Work:
        if self.group_rank != dst:
            send = self._bytes(tensor)
            return self._issue("gather", lambda c: c.Igatherv(send, None, root=dst), [])
        if gather_list is None:  # the core checked it on dst; keeps type checkers informed
            raise ValueError(f"{self.where('gather')} gather_list is required on dst")
        recv, finish, keep = self._receive_into(gather_list)
        send, mine = self._own_contribution(tensor, gather_list[self.group_rank].data_ptr(),
                                            gather_list, staged=finish is not None)
        return self._issue("gather", lambda c: c.Igatherv(send, recv, root=dst), gather_list,
                           finish, keep=(keep, mine))

    def native_scatter(self, *, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None,
                       src: int) -> Work:
        MPI = self._MPI
        if self.group_rank != src:
            recv = self._bytes(tensor)
            return self._issue("scatter", lambda c: c.Iscatterv(None, recv, root=src), [tensor])
        if scatter_list is None:
            raise ValueError(f"{self.where('scatter')} scatter_list is required on src")
        items = list(scatter_list)
        own: Any = self._bytes(tensor)
        if tensor.numel() and items[self.group_rank].data_ptr() == tensor.data_ptr():
            own = MPI.IN_PLACE  # this rank's piece already sits in its output
        for i, t in enumerate(items):
            if i != self.group_rank and dtypes.overlap(t, tensor):
                items[i] = t.clone()  # MPI may not read and write the same bytes
        send, keep = self._send_from(items)
        return self._issue("scatter", lambda c: c.Iscatterv(send, own, root=src), [tensor],
                           keep=(keep,))

    def native_reduce_scatter(self, *, output: torch.Tensor, input_list: list[torch.Tensor],
                              op: ReduceOp) -> Work:
        first = input_list[0]
        step = first.numel() * first.element_size()
        if first.numel() and all(t.data_ptr() == first.data_ptr() + i * step
                                 for i, t in enumerate(input_list)):
            # already one run of memory (e.g. chunks of one tensor): reduce it where it lies
            flat = first.reshape(-1).as_strided((first.numel() * self.group_size,), (1,))
        else:
            flat = torch.cat([t.reshape(-1) for t in input_list])
        return self._reduce_scatter("reduce_scatter", output, flat, op)

    def native_reduce_scatter_tensor(self, *, output: torch.Tensor, input: torch.Tensor,
                                     op: ReduceOp) -> Work:
        return self._reduce_scatter("reduce_scatter_tensor", output, input, op)

    def _reduce_scatter(self, name: str, output: torch.Tensor, flat: torch.Tensor,
                        op: ReduceOp) -> Work:
        """``MPI_Ireduce_scatter`` with equal counts rather than ``Ireduce_scatter_block``: the
        same result, but MPICH's algorithms for the latter allocate a message-sized temporary per
        call, which made 256-512 KiB blocks 7x slower than the blocking call (see README)."""
        dt, mop = self._reduce_spec(name, op, output.dtype)
        if dtypes.overlap(flat, output):
            flat = flat.clone()
        n = output.numel()
        send = [dtypes.raw(self._MPI, flat), n * self.group_size, dt]
        recv = self._typed(output, dt)
        counts = [n] * self.group_size
        return self._issue(name, lambda c: c.Ireduce_scatter(send, recv, counts, mop), [output],
                           keep=(flat,))

    def native_all_to_all(self, *, output_tensors: list[torch.Tensor],
                          input_tensors: list[torch.Tensor]) -> Work:
        ins = [t.clone() if any(dtypes.overlap(t, o) for o in output_tensors) else t
               for t in input_tensors]
        send, keep_in = self._send_from(ins)
        recv, finish, keep_out = self._receive_into(output_tensors)
        return self._issue("all_to_all", lambda c: c.Ialltoallv(send, recv), output_tensors,
                           finish, keep=(keep_in, keep_out))

    def native_all_to_all_single(self, *, output: torch.Tensor, input: torch.Tensor,
                                 output_split_sizes: list[int],
                                 input_split_sizes: list[int]) -> Work:
        MPI = self._MPI
        op = "all_to_all_single"
        in_row = _row_bytes(input, sum(input_split_sizes))
        out_row = _row_bytes(output, sum(output_split_sizes))
        if in_row and out_row and in_row != out_row:
            raise ValueError(f"{self.where(op)} input rows hold {in_row} bytes but output rows "
                             f"{out_row}; both tensors need the same shape after dim 0")
        if dtypes.overlap(input, output):
            input = input.clone()
        if input_split_sizes == output_split_sizes and len(set(input_split_sizes)) == 1:
            # even splits: plain alltoall, which MPICH runs 30-45% faster than alltoallv
            blocks_in = [dtypes.raw(MPI, input), MPI.BYTE]  # mpi4py splits it in size blocks
            blocks_out = [dtypes.raw(MPI, output), MPI.BYTE]
            return self._issue(op, lambda c: c.Ialltoall(blocks_in, blocks_out), [output],
                               keep=(input,))
        send = [dtypes.raw(MPI, input), _counts(input_split_sizes, in_row), MPI.BYTE]
        recv = [dtypes.raw(MPI, output), _counts(output_split_sizes, out_row), MPI.BYTE]
        return self._issue(op, lambda c: c.Ialltoallv(send, recv), [output], keep=(input,))

    def native_barrier(self) -> Work:
        return self._issue("barrier", lambda c: c.Ibarrier(), [])

    def native_send(self, *, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        self._check_tag("send", tag)
        buf = self._bytes(tensor)
        return self._issue("send", lambda c: c.Isend(buf, dst, tag), [tensor], source_rank=dst)

    def native_recv(self, *, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
        MPI = self._MPI
        self._check_tag("recv", tag)
        buf = self._bytes(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        sender: list[int] = [] if src is None else [src]

        def finish(status: Any) -> None:
            peer = status.Get_source()
            got = status.Get_count(MPI.BYTE)
            if got != nbytes:
                raise DistBackendError(
                    f"{self.where('recv')} received {got} bytes from rank {peer} but the tensor "
                    f"holds {nbytes} ({tensor.dtype}{list(tensor.shape)}); send and receive "
                    f"tensors of the same size")
            if src is None:
                sender.append(peer)

        source = MPI.ANY_SOURCE if src is None else src
        return self._issue("recv", lambda c: c.Irecv(buf, source, tag), [tensor], finish,
                           source_rank=lambda: sender[0] if sender else -1, cancellable=True)


def _is_world(options: GroupOptions | None, size: int) -> bool:
    """Whether this group is meant to be the whole world: the core is building its default
    group, or the caller named no members (object API)."""
    if options is None or not options.global_ranks:
        return True
    return options.is_world and tuple(options.global_ranks) == tuple(range(size))


def _row_bytes(t: torch.Tensor, rows: int) -> int:
    nbytes = t.numel() * t.element_size()
    return nbytes // rows if rows else 0


def _counts(splits: list[int], row: int) -> tuple[list[int], list[int]]:
    counts = [s * row for s in splits]
    return counts, dtypes.displacements(counts)


def _check_identity(MPI: Any, here: str, rank: int, size: int, members: tuple[int, ...],
                    is_world: bool) -> None:
    """Raise unless the core's view (group rank/size, members' global ranks) matches MPI's."""
    world = _world_comm(MPI)
    wrank, wsize = world.Get_rank(), world.Get_size()
    name = "MPI.COMM_WORLD" if _base.comm is None else "the survivors' MPI world"
    fix = ("launch every rank with mpiexec -n N, and do not pass rank=/world_size= (or RANK/"
           "WORLD_SIZE) that disagree with MPI's")
    if len(members) != size or len(set(members)) != size:
        raise DistBackendError(f"{here} global_ranks {list(members)} do not describe a group of "
                               f"size {size}")
    if is_world and (rank, size) != (wrank, wsize):
        raise DistBackendError(f"{here} MPI rank/size is {wrank}/{wsize} ({name}) but the "
                               f"given rank/world_size is {rank}/{size}; {fix}")
    bad = [r for r in members if not 0 <= r < wsize]
    if bad:
        raise DistBackendError(f"{here} global ranks {bad} do not exist: {name} has "
                               f"{wsize} processes; {fix}")
    if not 0 <= rank < size or members[rank] != wrank:
        mine = members[rank] if 0 <= rank < size else "none"
        raise DistBackendError(
            f"{here} MPI rank/size is {wrank}/{wsize} ({name}) but the given group "
            f"rank/size is {rank}/{size} with global ranks {list(members)}, which makes this "
            f"process global rank {mine}; {fix}")


def _arrive(store: Store, here: str, rank: int, size: int, timeout: timedelta,
            members: tuple[int, ...]) -> None:
    """Wait (bounded) until every member is about to create the communicator: a missing member
    then gives DistTimeoutError instead of a hang inside MPI."""
    if size == 1:
        return
    store.set(f"mpi/arrived/{rank}", b"1")
    try:
        store.wait([f"mpi/arrived/{r}" for r in range(size)], timeout)
    except DistTimeoutError as err:
        missing = [members[r] for r in range(size) if not store.check([f"mpi/arrived/{r}"])]
        waited = timed_out(here, timeout.total_seconds(), "every member to create the group")
        raise DistTimeoutError(f"{waited}: global ranks {missing} never did; are they running, "
                               f"and creating the same groups in the same order?") from err


def _create_comm(MPI: Any, members: Sequence[int], name: str) -> Any:
    """A communicator over ``members`` (global ranks, in group-rank order), made by the members
    only (MPI_Comm_create_group), with errors returned rather than aborting."""
    return _create_from(MPI, _world_comm(MPI), members, name)


def _create_from(MPI: Any, world: Any, members: Sequence[int], name: str) -> Any:
    """``_create_comm`` over the ranks of ``world``."""
    group = world.Get_group()
    try:
        sub = group.Incl(list(members))
    finally:
        group.Free()
    try:
        # a tag per group name keeps concurrent creations of overlapping groups apart
        comm = world.Create_group(sub, tag=zlib.crc32(name.encode()) % _CREATE_TAG_SPAN)
    finally:
        sub.Free()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    return comm


class _SurvivorsDiffer(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


def _shrink_in_order(MPI: Any, comm: Any, key: int, expected: int) -> Any:
    """``MPI_Comm_shrink`` of ``comm`` (revoked), re-ranked so this process gets rank ``key``.
    Raises _SurvivorsDiffer when MPI's survivors are not ``expected`` many."""
    shrunk = comm.Shrink()
    try:
        if shrunk.Get_size() != expected:
            raise _SurvivorsDiffer(shrunk.Get_size())
        ordered = shrunk.Split(0, key)
    finally:
        shrunk.Free()
    ordered.Set_errhandler(MPI.ERRORS_RETURN)
    return ordered


def _dup(MPI: Any, comm: Any) -> Any:
    dup = comm.Dup()
    dup.Set_errhandler(MPI.ERRORS_RETURN)
    return dup
