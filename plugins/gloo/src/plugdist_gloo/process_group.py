"""``GlooProcessGroup``: plugdist's ProcessGroup over torch's built-in Gloo.

Each native hook issues the matching op on a private ``torch.distributed.ProcessGroupGloo`` and
returns a plugdist Work completed (on a Gloo worker thread) from torch's future. Rendezvous goes
through the plugdist store handed to the constructor; torch.distributed's global state (default
group, group registry) is never touched, so both can run side by side in one process.
"""

from __future__ import annotations

import ctypes
import re
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from plugdist.backend import (
    BackendBase,
    GroupOptions,
    PlugdistStoreForTorch,
    ReduceOp,
    Work,
    get_logger,
)
from plugdist.errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistTimeoutError,
    timed_out,
    where,
)
from plugdist.store import Store

from .connections import shut_down_connections, socket_inodes
from .dtypes import Staged, effective_op, flat_bytes, movable, rows, stage_reduction
from .options import GlooOptions, make_devices
from .waiters import Waiters
from .work import GlooWork, wait_native

__all__ = ["GlooProcessGroup"]

_TIMEOUT_HINTS = ("timed out", "timeout")
_PEER_LOST_HINTS = ("connection closed", "connection reset", "broken pipe", "connection refused",
                    "read error", "write error", "socket closed", "end of file")
_ADDRESS = re.compile(r"\[([0-9A-Fa-f:.]+)\]:(\d+)")


def _c10d() -> Any:
    # the op option classes live only in the C extension (torch.distributed re-exports a few)
    from torch._C import _distributed_c10d
    return _distributed_c10d


def _reduce_op_map() -> dict[ReduceOp, Any]:
    red = _c10d().ReduceOp
    return {ReduceOp.SUM: red.SUM, ReduceOp.PRODUCT: red.PRODUCT, ReduceOp.MIN: red.MIN,
            ReduceOp.MAX: red.MAX, ReduceOp.BAND: red.BAND, ReduceOp.BOR: red.BOR,
            ReduceOp.BXOR: red.BXOR}


def _peer_addresses(store: Store, size: int, devices: int) -> dict[int, list[bytes]]:
    """Each rank's serialized Gloo listening addresses, as its rendezvous left them in the store
    (keys ``"<device>/<rank>"``), used only to name the rank behind an address in an error.
    Best effort: an empty map when the layout is not the expected one."""
    keys = [f"{d}/{r}" for r in range(size) for d in range(devices)]
    try:
        if not store.check(keys):
            return {}
        blobs = store.multi_get(keys)
    except Exception:  # noqa: BLE001 - only error messages lose detail
        return {}
    peers: dict[int, list[bytes]] = {}
    for key, blob in zip(keys, blobs, strict=True):
        peers.setdefault(int(key.split("/")[1]), []).append(bytes(blob))
    return peers


def _listens_at(blobs: list[bytes], host: str, port: int) -> bool:
    """Whether ``host:port`` is one of the serialized Gloo listening addresses in ``blobs``."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        ip = socket.inet_pton(family, host)
    except OSError:
        return False
    # a serialized sockaddr_in holds the port right before the address; sockaddr_in6 does not
    needle = port.to_bytes(2, "big") + ip if family == socket.AF_INET else ip
    port_bytes = port.to_bytes(2, "big")
    return any(needle in b and port_bytes in b for b in blobs)


def _rank_of_peer(message: str, peers: dict[int, list[bytes]]) -> int | None:
    """The rank whose Gloo listening address appears in ``message`` ("... peer
    [127.0.0.1]:4242 ..."), when exactly one rank matches. (A peer that connected to us shows
    its ephemeral port instead, and stays unnamed.)"""
    m = _ADDRESS.search(message)
    if m is None or not peers:
        return None
    host, port = m.group(1), int(m.group(2))
    found = {r for r, blobs in peers.items() if _listens_at(blobs, host, port)}
    return found.pop() if len(found) == 1 else None


# seconds a clean shutdown lets Gloo release the group before it cuts the group's connections:
# Gloo's destructor waits for the ops in flight, and an op a peer never joins (one the caller
# stopped waiting for, a receive nobody sends to) ends only at Gloo's timeout; then how long it
# waits for the release once the connections are cut
_CLEAN_RELEASE_S = 1.0
_CUT_RELEASE_S = 5.0


def _release(held: list[Any], released: threading.Event) -> None:
    """On a thread of its own: shut Gloo's group ``held[0]`` down and drop it (its destructor
    joins Gloo's threads, the GIL released), then the store bridge ``held[1]`` Gloo used."""
    pg = held.pop(0)
    for name in ("shutdown", "abort"):
        fn = getattr(pg, name, None)
        if fn is not None:
            try:
                fn()
                break
            except Exception:  # noqa: BLE001 - best effort, the group is going anyway
                continue
    del pg  # the destructor runs here, unless a caller still holds a Work of the group
    held.clear()  # the bridge, after the group
    released.set()


# seconds from an abort to the release of the aborted group: by then Gloo has failed every op of
# the group whose connections were cut, and the ops' callbacks have run
_RELEASE_AFTER = 3.0


class _Abandoned:
    __slots__ = ("pg", "bridge", "due")

    def __init__(self, pg: Any, bridge: Any, due: float) -> None:
        self.pg, self.bridge, self.due = pg, bridge, due


# aborted Gloo groups waiting for their release (see GlooProcessGroup._let_go); the list holds
# one reference nobody owns, so those still here when the process ends are never destroyed,
# not even by interpreter shutdown
_ABANDONED: list[_Abandoned] = []
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_ABANDONED))
_release_lock = threading.Condition()
_releaser: list[threading.Thread] = []


def _abandon(pg: Any, bridge: Any) -> None:
    """Keep an aborted group (and the store Gloo uses) for ``_RELEASE_AFTER`` seconds, then let
    it go on the releaser thread. Non-blocking."""
    with _release_lock:
        _ABANDONED.append(_Abandoned(pg, bridge, time.monotonic() + _RELEASE_AFTER))
        if not _releaser:
            thread = threading.Thread(target=_release_loop, name="plugdist-gloo-release",
                                      daemon=True)
            _releaser.append(thread)
            thread.start()
        _release_lock.notify()


def _release_loop() -> None:
    """Destroy aborted groups once due and referenced from ``_ABANDONED`` alone (a Work that a
    caller kept holds its group: that one waits). The destructor joins Gloo's threads (torch
    lets go of the GIL for it), so a survivor does not keep three idle threads per failure."""
    while True:
        with _release_lock:
            now = time.monotonic()
            # two references: the entry's, and getrefcount's argument
            due = [a for a in _ABANDONED if a.due <= now and sys.getrefcount(a.pg) == 2]
            for a in due:
                _ABANDONED.remove(a)
            later = [a.due for a in _ABANDONED]
        for a in due:
            a.pg = None       # the destructor runs here, on this thread
            a.bridge = None   # after the group: Gloo may use the store until it is released
        del due
        with _release_lock:
            if not _ABANDONED:
                _release_lock.wait()
            else:
                _release_lock.wait(max(0.5, min(later, default=now) - time.monotonic()))


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _absent_ranks(store: Store, size: int) -> list[int]:
    """Ranks that never published their Gloo address (best effort; [] if the store fails)."""
    try:
        return [r for r in range(size) if not store.check([f"0/{r}"])]
    except Exception:  # noqa: BLE001
        return []


class GlooProcessGroup(BackendBase):
    """A group of CPU processes talking through Gloo (TCP).

    Construction is collective and blocking: every rank of the group must construct it with the
    same store (one private to this group: Gloo's rendezvous keys are not namespaced) within
    ``options.timeout``, else ``DistTimeoutError``. Ops are asynchronous; each is bounded by
    ``options.timeout`` inside Gloo as well as in ``Work.wait``. Thread-safe to issue ops from
    several threads, but all ranks must issue them in the same order.
    """

    backend_name: ClassVar[str] = "gloo"
    plugin_api = (2, 0)  # written for plugdist's plugin API 2.x
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    default_for: ClassVar[tuple[str, ...]] = ("cpu",)  # init_process_group() with no backend
    native_reduce_ops: ClassVar[frozenset[ReduceOp]] = frozenset(
        {ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR,
         ReduceOp.BXOR})
    supports_any_source: ClassVar[bool] = True

    def __init__(self, store: Store, rank: int, size: int,
                 options: GroupOptions | None = None) -> None:
        super().__init__(rank, size, options)
        here = where(rank=rank, group=self.group_name, backend=self.backend_name)
        ok, reason = self.is_available()
        if not ok:
            raise DistBackendError(f"{here} {reason}")
        gloo_opts = self.options.backend_options
        if gloo_opts is None:
            gloo_opts = GlooOptions()
        elif not isinstance(gloo_opts, GlooOptions):
            raise TypeError(f"{here} pg_options must be a plugdist_gloo.GlooOptions, got "
                            f"{type(gloo_opts).__name__}")
        self.gloo_options: GlooOptions = gloo_opts
        self._log = get_logger(rank=rank, group=self.group_name)
        self._red = _reduce_op_map()
        tdist = _c10d()
        native_opts = tdist.ProcessGroupGloo._Options()
        native_opts._devices = make_devices(gloo_opts, here)
        native_opts._threads = gloo_opts.threads
        native_opts._timeout = self.timeout
        self._pg: Any = None
        self._c10d = tdist
        self._opts_cache: dict[tuple[Any, ...], Any] = {}
        self._peers: dict[int, list[bytes]] = {}
        self._sockets: set[int] | None = None  # this group's socket inodes (set once built)
        self._cut = False  # its connections were shut down (_cut_connections)
        self._waiters = Waiters(f"plugdist-gloo-{self.group_name}-r{rank}")
        # the Works of async ops, while someone holds them: shutdown fails those in flight
        self._issued: weakref.WeakSet[GlooWork] = weakref.WeakSet()
        # held for the group's life: C++ keeps only the base object, and a collected Python
        # subclass leaves its methods "not implemented"
        self._bridge: PlugdistStoreForTorch | None = PlugdistStoreForTorch(store, self.timeout)
        before = socket_inodes()
        try:
            self._pg = tdist.ProcessGroupGloo(self._bridge, rank, size, native_opts)
        except Exception as exc:
            self._bridge = None
            err = self._translate("rendezvous", exc)
            if isinstance(err, DistTimeoutError):
                missing = _absent_ranks(store, size)
                absent = f"; ranks that never arrived: {missing}" if missing else ""
                err = DistTimeoutError(
                    f"{here} rendezvous: not all {size} ranks connected within "
                    f"{self.timeout.total_seconds():.1f}s{absent} ({exc}); start every rank with "
                    f"the same store and world size, and give each group a fresh store prefix")
            raise err from exc
        self._peers = _peer_addresses(store, size, len(native_opts._devices))
        # the sockets Gloo opened for this group (it connects the full mesh on construction):
        # an abort cuts these only. Matched by address alone, a later group's connections
        # could be cut too: an abort runs on the monitor thread while the survivors already
        # build the next group, which may get the ports the dead rank's group had
        self._sockets = (socket_inodes() - before) or None
        self._log.debug("gloo group created", size=size, devices=len(native_opts._devices))

    # -- plugin metadata ------------------------------------------------------------------------
    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Whether this torch build has Gloo, and why not."""
        try:
            import torch.distributed as tdist
        except ImportError as exc:  # pragma: no cover - torch built without distributed
            return False, f"torch.distributed cannot be imported: {exc}"
        if not tdist.is_available():
            return False, "this torch build has no torch.distributed"
        if not tdist.is_gloo_available():
            return False, "this torch build has no Gloo; install a torch wheel built with Gloo"
        return True, "torch.distributed.ProcessGroupGloo"

    def shutdown(self) -> None:
        """Close Gloo's connections and join its threads. Idempotent; ops still pending fail
        (their Works say the group was shut down): with ops in flight the group's connections
        are cut first, since Gloo would wait for them until its timeout. Blocks while Gloo
        releases the group, about a second more at most if it waits for an op nobody holds.
        On an aborted group it does not block: see _let_go."""
        if getattr(self, "_pg", None) is None:
            return
        if self.abort_signal.fired:
            self._let_go()
            return
        held = [self._pg, self._bridge]  # the bridge last: Gloo may use the store until then
        self._pg = self._bridge = None
        if self._waiters.busy() or not all(w.is_completed() for w in list(self._issued)):
            self._cut_connections()  # ops in flight: only a cut ends them before Gloo's timeout
        released = threading.Event()
        thread = threading.Thread(target=_release, args=(held, released),
                                  name="plugdist-gloo-shutdown", daemon=True)
        del held
        thread.start()
        if not released.wait(_CLEAN_RELEASE_S):
            self._cut_connections()  # an op in flight holds Gloo's release up
            released.wait(_CUT_RELEASE_S)
        if released.is_set():
            thread.join()
        else:
            self._log.warning("gloo group not released yet; left to finish in the background",
                              group=self.group_name)
        self._waiters.close()
        self._log.debug("gloo group shut down")

    def _let_go(self) -> None:
        """Release an aborted group without waiting. Its connections are cut first, so nothing
        of it stays in flight into this process's exit (see connections.py). Gloo's shutdown
        and destructor would still join its threads, which may sit in an op's error path for a
        while, so the group is handed to the releaser thread (``_abandon``), which destroys it
        some seconds later, when Gloo has failed all it had in flight."""
        pg, self._pg = self._pg, None
        self._cut_connections()
        self._waiters.close(timeout=0.0)
        _abandon(pg, self._bridge)
        self._bridge = None
        self._log.debug("aborted gloo group left to the process")

    def native_abort(self) -> None:
        """Fail Gloo's ops in flight at once (their waiters are already released by the core):
        without this they would end only at Gloo's timeout. Non-blocking."""
        if getattr(self, "_pg", None) is not None:
            self._cut_connections()

    def _cut_connections(self) -> None:
        """End what the group still has in flight now, while this process is whole (see
        connections.py): shut down its connections, the ones accepted on this rank's listening
        address and the ones made to a peer's. Once per group: abort and shutdown both ask."""
        if self._cut:
            return
        self._cut = True
        mine = self._peers.get(self.group_rank, [])
        others = [b for r, blobs in self._peers.items() if r != self.group_rank for b in blobs]

        def ours(local: tuple[str, int], remote: tuple[str, int]) -> bool:
            return _listens_at(mine, *local) or _listens_at(others, *remote)

        cut = shut_down_connections(ours, self._sockets)
        self._log.debug("aborted gloo group's connections shut down", connections=cut)

    # -- plumbing -------------------------------------------------------------------------------
    def _native(self, op: str) -> Any:
        if self._pg is None:
            raise DistBackendError(f"{self.where(op)} this group was shut down; create a new one")
        return self._pg

    def _opts(self, kind: str, **fields: Any) -> Any:
        """torch's options object for an op, cached: Gloo copies what it needs at issue time."""
        key = (kind, *fields.items())
        opts = self._opts_cache.get(key)
        if opts is None:
            opts = getattr(self._c10d, kind)()
            opts.timeout = self.timeout
            for name, value in fields.items():
                setattr(opts, name, value)
            self._opts_cache[key] = opts
        return opts

    def _issue(self, op: str, call: Callable[[Any], Any], result: Any,
               staged: Sequence[Staged] = (), any_source: bool = False) -> Work:
        """Run ``call(native_pg)``; the returned Work is done with ``result`` (after writing back
        ``staged`` tensors) once torch's work is. See ``work.py`` for how it completes."""
        pg = self._native(op)
        work = GlooWork(self, op, result, staged, any_source)
        self._issued.add(work)
        try:
            return work.attach(call(pg), arm=op in ("send", "recv"))
        except Exception as exc:
            raise self._translate(op, exc) from exc

    def _arm(self, native_work: Any, complete: Callable[[BaseException | None], None]) -> None:
        """Call ``complete(error_or_None)`` on another thread once ``native_work`` is done."""
        def on_future(fut: torch.futures.Future) -> None:
            try:
                fut.value()
            except Exception as exc:  # noqa: BLE001 - handed to whoever waits
                complete(exc)
            else:
                complete(None)

        def blocking_wait() -> None:
            try:
                native_work.wait()
            except Exception as exc:  # noqa: BLE001
                complete(exc)
            else:
                complete(None)

        try:
            future = native_work.get_future()
        except RuntimeError:  # Gloo's send/recv works have no future: wait on a pool thread
            self._waiters.submit(blocking_wait)
        else:
            future.add_done_callback(on_future)

    def _translate(self, op: str, exc: BaseException) -> DistError:
        """A DistError carrying rank, group, op and backend for an error raised by Gloo."""
        if isinstance(exc, DistError):
            return exc
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        low = msg.lower()
        here = self.where(op)
        seconds = self.timeout.total_seconds()
        err: DistError
        if any(h in low for h in _TIMEOUT_HINTS):
            err = DistTimeoutError(
                f"{timed_out(here, seconds, 'a peer')} (gloo: {msg}); a rank may have died, be "
                f"stuck, or be running a different op")
        elif any(h in low for h in _PEER_LOST_HINTS):
            peer = _rank_of_peer(msg, self._peers)
            if peer is None and self.group_size == 2:
                peer = 1 - self.group_rank
            who = "a peer" if peer is None else f"rank {peer}"
            err = DistNetworkError(
                f"{here} lost its connection to {who} (gloo: {msg}); that rank probably died "
                f"or shut its group down early: check its logs")
        else:
            err = DistBackendError(f"{here} failed (gloo: {type(exc).__name__}: {msg})")
        err.__cause__ = exc
        return err

    # -- native hooks ---------------------------------------------------------------------------
    def native_broadcast(self, *, tensor: torch.Tensor, src: int) -> Work:
        opts = self._opts("BroadcastOptions", rootRank=src, rootTensor=0)
        return self._issue("broadcast", lambda pg: pg.broadcast([movable(tensor)], opts), [tensor])

    def native_all_reduce(self, *, tensor: torch.Tensor, op: ReduceOp) -> Work:
        s = self._stage("all_reduce", tensor, op)
        opts = self._opts("AllreduceOptions", reduceOp=self._gloo_op(op, tensor))
        return self._issue("all_reduce", lambda pg: pg.allreduce([s.buf], opts), [tensor], [s])

    def native_sparse_all_reduce(self, *, tensor: torch.Tensor) -> Work:
        # torch's gloo sums sparse COO tensors itself (and replaces the tensor's contents)
        opts = self._opts("AllreduceOptions", reduceOp=self._red[ReduceOp.SUM])
        return self._issue("all_reduce", lambda pg: pg.allreduce([tensor], opts), [tensor])

    # -- lean blocking hooks: the native ops above, waited on in torch's C++ wait (the GIL
    # released) with no GlooWork: the synchronous frontend's path for the hot ops
    def _block(self, op: str, call: Callable[[Any], Any], staged: Sequence[Staged] = ()) -> None:
        """Run ``call(native_pg)`` and wait for it on this thread, bounded by the group's
        timeout (then DistTimeoutError; the op may still finish: torch's work holds its
        tensors); then write back ``staged`` tensors."""
        pg = self._native(op)
        try:
            native = call(pg)
        except Exception as exc:
            raise self._translate(op, exc) from exc
        signal = self.abort_signal
        finished, error = wait_native(native, self.timeout, signal)
        if not finished:
            signal.check(lambda: self.where(op))
            raise self.timeout_error(op) from error
        if error is not None:
            if signal.monitored:
                raise signal.explain(self._translate(op, error), self.where(op)) from error
            raise self._translate(op, error) from error
        for s in staged:
            s.finish()

    def native_all_reduce_blocking(self, *, tensor: torch.Tensor, op: ReduceOp) -> None:
        s = self._stage("all_reduce", tensor, op)
        opts = self._opts("AllreduceOptions", reduceOp=self._gloo_op(op, tensor))
        self._block("all_reduce", lambda pg: pg.allreduce([s.buf], opts), [s])

    def native_broadcast_blocking(self, *, tensor: torch.Tensor, src: int) -> None:
        opts = self._opts("BroadcastOptions", rootRank=src, rootTensor=0)
        self._block("broadcast", lambda pg: pg.broadcast([movable(tensor)], opts))

    def native_reduce_blocking(self, *, tensor: torch.Tensor, dst: int, op: ReduceOp) -> None:
        s = self._stage("reduce", tensor, op)
        opts = self._opts("ReduceOptions", reduceOp=self._gloo_op(op, tensor), rootRank=dst,
                          rootTensor=0)
        self._block("reduce", lambda pg: pg.reduce([s.buf], opts),
                    [s] if self.group_rank == dst else [])

    def native_all_gather_into_tensor_blocking(self, *, output: torch.Tensor,
                                               tensor: torch.Tensor) -> None:
        out, inp = movable(output).reshape(-1), movable(tensor).reshape(-1)
        opts = self._opts("AllgatherOptions")
        self._block("all_gather_into_tensor", lambda pg: pg._allgather_base(out, inp, opts))

    def native_reduce_scatter_tensor_blocking(self, *, output: torch.Tensor,
                                              input: torch.Tensor, op: ReduceOp) -> None:
        s = self._stage("reduce_scatter_tensor", output, op)
        inp = self._stage("reduce_scatter_tensor", input, op).buf.reshape(-1)
        opts = self._opts("ReduceScatterOptions", reduceOp=self._gloo_op(op, output))
        self._block("reduce_scatter_tensor",
                    lambda pg: pg._reduce_scatter_base(s.buf.reshape(-1), inp, opts), [s])

    def native_all_to_all_single_blocking(self, *, output: torch.Tensor,
                                          input: torch.Tensor) -> None:
        out, inp = movable(rows(output)), movable(rows(input))
        opts = self._opts("AllToAllOptions")
        self._block("all_to_all_single", lambda pg: pg.alltoall_base(out, inp, [], [], opts))

    def native_reduce(self, *, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Work:
        s = self._stage("reduce", tensor, op)
        opts = self._opts("ReduceOptions", reduceOp=self._gloo_op(op, tensor), rootRank=dst,
                          rootTensor=0)
        # staged copies are written back on dst only: elsewhere the input stays as it was
        back = [s] if self.group_rank == dst else []
        return self._issue("reduce", lambda pg: pg.reduce([s.buf], opts), [tensor], back)

    def native_all_gather(self, *, output_tensors: list[torch.Tensor],
                          tensor: torch.Tensor) -> Work:
        outs = [movable(t) for t in output_tensors]
        opts = self._opts("AllgatherOptions")
        return self._issue("all_gather", lambda pg: pg.allgather([outs], [movable(tensor)], opts),
                           output_tensors)

    def native_all_gather_into_tensor(self, *, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        out, inp = movable(output), movable(tensor)
        opts = self._opts("AllgatherOptions")
        return self._issue("all_gather_into_tensor",
                           lambda pg: pg._allgather_base(out.reshape(-1), inp.reshape(-1), opts),
                           [output])

    def native_gather(self, *, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None,
                      dst: int) -> Work:
        outs = [[movable(t) for t in gather_list]] if self.group_rank == dst and gather_list else []
        opts = self._opts("GatherOptions", rootRank=dst)
        return self._issue("gather", lambda pg: pg.gather(outs, [movable(tensor)], opts),
                           gather_list if self.group_rank == dst and gather_list else [])

    def native_scatter(self, *, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None,
                       src: int) -> Work:
        mine = self.group_rank == src and scatter_list
        ins = [[movable(t) for t in scatter_list]] if mine and scatter_list else []
        opts = self._opts("ScatterOptions", rootRank=src)
        return self._issue("scatter", lambda pg: pg.scatter([movable(tensor)], ins, opts), [tensor])

    def native_reduce_scatter(self, *, output: torch.Tensor, input_list: list[torch.Tensor],
                              op: ReduceOp) -> Work:
        s = self._stage("reduce_scatter", output, op)
        ins = [self._stage("reduce_scatter", t, op).buf for t in input_list]
        opts = self._opts("ReduceScatterOptions", reduceOp=self._gloo_op(op, output))
        return self._issue("reduce_scatter", lambda pg: pg.reduce_scatter([s.buf], [ins], opts),
                           [output], [s])

    def native_reduce_scatter_tensor(self, *, output: torch.Tensor, input: torch.Tensor,
                                     op: ReduceOp) -> Work:
        s = self._stage("reduce_scatter_tensor", output, op)
        inp = self._stage("reduce_scatter_tensor", input, op).buf
        opts = self._opts("ReduceScatterOptions", reduceOp=self._gloo_op(op, output))
        return self._issue(
            "reduce_scatter_tensor",
            lambda pg: pg._reduce_scatter_base(s.buf.reshape(-1), inp.reshape(-1), opts),
            [output], [s])

    def native_all_to_all(self, *, output_tensors: list[torch.Tensor],
                          input_tensors: list[torch.Tensor]) -> Work:
        opts = self._opts("AllToAllOptions")
        shape = input_tensors[0].shape
        if all(t.shape == shape for t in (*output_tensors, *input_tensors)):
            outs = [movable(t) for t in output_tensors]
            ins = [movable(t) for t in input_tensors]
            return self._issue("all_to_all", lambda pg: pg.alltoall(outs, ins, opts),
                               output_tensors)
        # Gloo's list form wants one size throughout; uneven sizes go as bytes through
        # alltoall_base (one packed copy in, one copy out per tensor)
        packed_in = torch.cat([flat_bytes(t) for t in input_tensors])
        out_sizes = [t.numel() * t.element_size() for t in output_tensors]
        packed_out = torch.empty(sum(out_sizes), dtype=torch.uint8)
        staged = [Staged(chunk, flat_bytes(t), _same)
                  for chunk, t in zip(packed_out.split(out_sizes), output_tensors, strict=True)]
        in_sizes = [t.numel() * t.element_size() for t in input_tensors]
        return self._issue("all_to_all",
                           lambda pg: pg.alltoall_base(packed_out, packed_in, out_sizes,
                                                       in_sizes, opts),
                           output_tensors, staged)

    def native_all_to_all_single(self, *, output: torch.Tensor, input: torch.Tensor,
                                 output_split_sizes: list[int],
                                 input_split_sizes: list[int]) -> Work:
        out, inp = movable(rows(output)), movable(rows(input))
        opts = self._opts("AllToAllOptions")
        return self._issue("all_to_all_single",
                           lambda pg: pg.alltoall_base(out, inp, list(output_split_sizes),
                                                       list(input_split_sizes), opts),
                           [output])

    def native_barrier(self) -> Work:
        opts = self._opts("BarrierOptions")
        return self._issue("barrier", lambda pg: pg.barrier(opts), [])

    def native_send(self, *, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        return self._issue("send", lambda pg: pg.send([movable(tensor)], dst, tag), [tensor])

    def native_recv(self, *, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
        buf = movable(tensor)
        if src is None:
            return self._issue("recv", lambda pg: pg.recv_anysource([buf], tag), [tensor],
                               any_source=True)
        return self._issue("recv", lambda pg: pg.recv([buf], src, tag), [tensor])

    def _gloo_op(self, op: ReduceOp, tensor: torch.Tensor) -> Any:
        return self._red[effective_op(op, tensor.dtype)]

    def _stage(self, op: str, tensor: torch.Tensor, red: ReduceOp) -> Staged:
        try:
            return stage_reduction(tensor, red)
        except TypeError as exc:
            raise TypeError(f"{self.where(op)} {exc}; convert the tensor (e.g. .float()) first") \
                from None
