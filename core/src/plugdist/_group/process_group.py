"""``ProcessGroup``: what users hold. The backend under it is a separate object.

A ProcessGroup validates, dispatches, composes and observes; the transport is one
:class:`~plugdist._backend.base.BackendBase` **per device type** (``init_process_group(
"cpu:gloo,cuda:nccl")`` builds one group over two backends, as torch registers one backend per
device on its ProcessGroup). Each op goes to the backend of its tensors' device type.

* **Public ops** (``all_reduce``, ``broadcast``, ... ``send``, ``recv``): what the frontend, DDP
  and users of the explicit object API call. They validate arguments (clear errors naming rank,
  group, op and backend, raised before anything is sent), then run the op natively if the
  backend can, or compose it from the backend's native ops (:mod:`plugdist._group.composition`,
  which runs against the backend). Every public op returns a
  :class:`~plugdist._backend.work.Work`.
* **The blocking path** (``run_blocking(op, ...)``): what the synchronous frontend calls. It
  validates exactly as the public op does, then runs the backend's ``native_<op>_blocking``
  (the hot ops on plain tensors of its ``lean_device_types``, checks and the backend cached
  per signature) or ``native_blocking``, which finish the op on the calling thread with no Work
  at all (a Work costs tens of microseconds, the whole budget of a small message). Without those
  hooks, for composed ops, and for a backend that intercepts public ops (a wrapper's
  ``wrap_op``), it waits on the public op's Work.
* **Observation**: every op passes :func:`plugdist._observability.observe.active` once; a
  synchronous op of one tensor is recorded by ``run_blocking`` itself, the flight recorder's
  short route (:func:`plugdist._observability.observe.blocking` says why).

Contract for every op: all members of the group call it, in the same order, with matching
arguments. Public ops never block on the network unless the backend is synchronous; the returned
Work's ``wait`` does, bounded by the group's timeout.

:func:`plugdist._world.groups.build_group` builds every group: the backends through their
factories (entry points), each wrapped by the plugins' wrappers, then the ProcessGroup over them.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.autograd import profiler as _torch_profiler

from plugdist._backend.api_version import MIGRATION, PLUGIN_API
from plugdist._backend.base import (
    BACKEND_HELPERS,
    BACKEND_HOOKS,
    DEFAULT_TIMEOUT,
    LEAN_OPS,
    OPS,
    BackendBase,
    GroupOptions,
)
from plugdist._backend.capabilities import Capabilities
from plugdist._backend.group import GroupIdentity
from plugdist._backend.reduce_op import ReduceOp, check_reduce_op
from plugdist._backend.work import Work, completed_work
from plugdist._group import composition, sparse
from plugdist._observability import observe
from plugdist._observability.flight_recorder import COMPLETED as _COMPLETED
from plugdist._observability.flight_recorder import ONE as _ONE
from plugdist._observability.flight_recorder import recorder as _recorder
from plugdist._observability.observe import SHORT_OPS as _SHORT_OPS
from plugdist.errors import DistTimeoutError

__all__ = ["ProcessGroup", "GroupOptions", "Capabilities", "OPS", "DEFAULT_TIMEOUT",
           "BACKEND_HOOKS", "BACKEND_HELPERS"]

# ops that may run through ``native_blocking``: not send/recv, whose Works carry results (the
# sender of an any-source receive) and whose callers may pair them with ops issued later
_BLOCKING_OPS = frozenset(OPS) - {"send", "recv"}


class _Waiting(threading.local):
    """Per thread: the (group, op) whose caller is about to wait on it (see run_blocking)."""

    call: tuple[Any, str] | None = None


_waiting = _Waiting()
_now_ns = time.monotonic_ns  # the flight recorder's clock
# what a dispatch run by native_blocking returns: only run_blocking (which just waits) and a
# public op's own ``then`` (AVG's divide, run at once) ever see it
_DONE = completed_work()


# (op, reduction, dtype, device type): what the lean route's checks depend on
_LeanKey = tuple[str, ReduceOp | None, torch.dtype, str]


def _device_type(t: torch.Tensor) -> str:
    return "cpu" if t.is_cpu else t.device.type  # is_cpu skips building a torch.device


def _first_device(args: Mapping[str, Any]) -> str | None:
    """The device type of the first tensor among a public op's arguments (lists included)."""
    for v in args.values():
        if isinstance(v, torch.Tensor):
            return _device_type(v)
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            return _device_type(v[0])
    return None


class ProcessGroup(GroupIdentity):
    """A group of processes and the collectives among them, over one backend per device type.
    See the module docstring."""

    # the flight recorder's record of this group, set by its add_group (absent on a group built
    # by hand until the recorder first sees it)
    _flight_group: Any
    # torch's description of the group (new_group(group_desc=)); "default_pg" for the world
    group_desc: str = "undefined"

    def __init__(self, backends: BackendBase | Mapping[str, BackendBase], *legacy: Any) -> None:
        """The group over ``backends``: one backend (it serves every type in its
        ``device_types``), or a mapping of device type to backend. Every backend must be this
        process's member of the same group (same rank, size and options)."""
        if legacy or isinstance(backends, int):
            # a plugin API 1 backend's super().__init__(rank, size, options)
            raise TypeError(f"{type(self).__name__} calls ProcessGroup.__init__(rank, size, "
                            f"options), a backend's constructor under plugin API 1; plugdist "
                            f"now provides plugin API {PLUGIN_API[0]}.{PLUGIN_API[1]}, where "
                            f"ProcessGroup is the group users hold. To port it: {MIGRATION}")
        if isinstance(backends, BackendBase):
            by_device = {d: backends for d in backends.device_types}
            distinct: list[BackendBase] = [backends]
        else:
            by_device = dict(backends)
            distinct = list({id(b): b for b in by_device.values()}.values())
        if not distinct:
            raise ValueError("a ProcessGroup needs at least one backend")
        for b in distinct:
            if not isinstance(b, BackendBase):
                raise TypeError(f"a ProcessGroup runs over backends (plugdist.backend."
                                f"BackendBase), got {type(b).__name__}")
        first = distinct[0]
        self._backend = first
        self._backends = by_device
        self._distinct = tuple(distinct)
        # the one backend of a single-backend group (the hot paths skip the device lookup)
        self._single: BackendBase | None = first if len(distinct) == 1 else None
        self.group_rank = first.group_rank
        self.group_size = first.group_size
        self.options = first.options
        self.abort_signal = first.abort_signal
        if len(distinct) == 1:
            self.backend_name = first.backend_name
        else:
            self.backend_name = ",".join(f"{d}:{b.backend_name}" for d, b in by_device.items())
        self.device_types: tuple[str, ...] = tuple(by_device)
        self._caps: Capabilities | None = None
        # (op, reduction, dtype, device type) -> the backend whose lean hook takes that op on a
        # plain tensor, or None (_native_lean)
        self._lean_checked: dict[_LeanKey, BackendBase | None] = {}
        # (op, device type) -> the backend's bound native hook, or None (composed)
        self._natives: dict[tuple[str, str], Callable[..., Any] | None] = {}
        cls = type(self)
        # a wrapper sees every public op (and observes it itself): no route stands in for one
        self._intercepted_ops = any(b.implements("wrap_op") for b in distinct)
        # the ops run_blocking records on the flight recorder's short route (not a wrapper's)
        self._short_ops = frozenset() if self._intercepted_ops else _SHORT_OPS
        if self._intercepted_ops:
            self._lean: dict[str, Callable[..., bool]] = {}
            self._blocking_ops: frozenset[str] = frozenset()
            for op in OPS:
                if getattr(cls, op) is getattr(ProcessGroup, op):
                    setattr(self, op, functools.partial(self._intercepted, op,
                                                        getattr(self, op)))
            return
        # the blocking path may stand in for a public op only where that op is the core's own
        own = [op for op in _BLOCKING_OPS if getattr(cls, op) is getattr(ProcessGroup, op)]
        generic = any(b.implements("native_blocking") for b in distinct)
        self._blocking_ops = frozenset(own) if generic else frozenset()
        self._lean = {op: _LEAN[op] for op in LEAN_OPS if op in own and any(
            b.implements(f"native_{op}_blocking") for b in distinct)}

    @property
    def backend(self) -> str:
        return self.backend_name

    def name(self) -> str:
        """The backend's name, as torch's ``ProcessGroup.name()`` (``group_name`` names the
        group)."""
        return self.backend_name

    @property
    def backends(self) -> dict[str, BackendBase]:
        """Device type -> the backend that runs this group's ops on it."""
        return dict(self._backends)

    def backend_for(self, device: str | torch.device) -> BackendBase:
        """The backend that runs this group's ops on tensors of ``device`` (a type or device)."""
        kind = device if isinstance(device, str) else device.type
        try:
            return self._backends[kind.split(":")[0]]
        except KeyError:
            raise ValueError(f"{self.where('backend_for')} no backend for {kind} tensors (this "
                             f"group has {', '.join(self._backends)})") from None

    @property
    def supports_any_source(self) -> bool:
        return self._backend.supports_any_source

    @property
    def rebuild_refusal(self) -> str:
        """Why this group cannot be rebuilt with other members (its backends'), or ""."""
        return next((b.rebuild_refusal for b in self._distinct if b.rebuild_refusal), "")

    @property
    def grow_refusal(self) -> str:
        """Why this group cannot admit new processes (its backends'), or ""."""
        return next((b.grow_refusal for b in self._distinct if b.grow_refusal), "")

    def capabilities(self) -> Capabilities:
        """What this group does natively: its backend's, or every backend's for its devices."""
        caps = self._caps
        if caps is None:
            if self._single is not None:
                caps = self._single.capabilities()
            else:
                parts = [(d, b.capabilities()) for d, b in self._backends.items()]
                caps = Capabilities(
                    native=frozenset((op, dev) for d, c in parts for op, dev in c.native
                                     if dev == d),
                    reduce_ops=frozenset().union(*(c.reduce_ops for _d, c in parts)),
                    any_source_recv=self._backend.capabilities().any_source_recv,
                    device_types=self.device_types,
                    refused_reduce_ops=frozenset().union(
                        *(c.refused_reduce_ops for _d, c in parts)))
            self._caps = caps
        return caps

    def where(self, op: str) -> str:
        """``[rank R, group G, backend B, op O]``: the prefix of every error about ``op``."""
        return self._backend.where(op) if self._single is not None else \
            f"[rank {self.group_rank}, group {self.group_name!r}, backend " \
            f"{self.backend_name!r}, op {op}]"

    def timeout_error(self, op: str, seconds: float | None = None) -> DistTimeoutError:
        """The error for ``op`` not completing within ``seconds`` (default: the group's
        timeout), worded as ``Work.wait``'s."""
        return self._backend.timeout_error(op, seconds)

    def work(self, op: str, **kwargs: Any) -> Work:
        """A fresh pending Work carrying this group's context (see ``BackendBase.work``)."""
        return self._backend.work(op, **kwargs)

    def shutdown(self) -> None:
        """Shut every backend of the group down (see ``BackendBase.shutdown``). The ops it
        fails fail as they are: a shutdown is no member's failure to wait for membership to
        confirm (``AbortSignal.close``)."""
        for b in self._distinct:
            b.abort_signal.close()
        for b in self._distinct:
            b.shutdown()

    def abort(self, reason: str = "the group was aborted", ranks: tuple[int, ...] = ()) -> None:
        """Fail every op in flight on this rank, and every later one, with
        ``DistRankFailureError`` (``reason``; ``ranks``: the failed global ranks). Non-blocking,
        idempotent, any thread; then each backend's ``native_abort``. The group cannot be used
        again: shut it down, and continue on a group of the survivors (``shrink_group``)."""
        for b in self._distinct:
            b.abort_signal.fire(reason, ranks)
        for b in self._distinct:
            b.native_abort()

    def native_shrink(self, keep: Sequence[int], options: GroupOptions) -> Any:
        """The backend's own shrink of this group (``BackendBase.native_shrink``): a new
        backend for the survivors, or NotImplemented (always, for a group of several
        backends: the core rebuilds it)."""
        if self._single is None:
            return NotImplemented
        return self._single.native_shrink(keep, options)

    def __repr__(self) -> str:
        inner = ", ".join(repr(b) for b in self._distinct)
        return (f"<{type(self).__name__} backend={self.backend_name!r} group={self.group_name!r} "
                f"rank={self.group_rank}/{self.group_size} over {inner}>")

    # -- wrappers: a backend's wrap_op sees every public op -----------------------------------
    def _intercepted(self, op: str, public: Callable[..., Work], *args: Any,
                     **kwargs: Any) -> Work:
        bound = _signature(op).bind(*args, **kwargs)
        bound.apply_defaults()
        named = dict(bound.arguments)
        device = _first_device(named)
        backend = self._backend if device is None else self._backends.get(device, self._backend)
        return backend.wrap_op(op, named, lambda: public(*args, **kwargs))

    # -- public ops: validate, then run natively or composed --------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Work:
        self._check_tensor("broadcast", tensor)
        self._check_rank("broadcast", src, "src")
        return self._run("broadcast", tensor, tensor=tensor, src=src)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work:
        if getattr(tensor, "is_sparse", False):
            return self._sparse_all_reduce(tensor, op)
        self._check_tensor("all_reduce", tensor)
        self._check_reduce("all_reduce", op, tensor)
        return self._run_reduction("all_reduce", tensor, tensor, tensor=tensor, op=op)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: ReduceOp = ReduceOp.SUM) -> Work:
        self._check_tensor("reduce", tensor)
        self._check_rank("reduce", dst, "dst")
        self._check_reduce("reduce", op, tensor)
        out = tensor if self.group_rank == dst else None
        return self._run_reduction("reduce", tensor, out, tensor=tensor, dst=dst, op=op)

    def all_gather(self, output_tensors: Sequence[torch.Tensor], tensor: torch.Tensor) -> Work:
        self._check_tensor("all_gather", tensor)
        self._check_list("all_gather", "output_tensors", output_tensors, tensor)
        return self._run("all_gather", tensor, output_tensors=list(output_tensors), tensor=tensor)

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        self._check_tensor("all_gather_into_tensor", tensor)
        self._check_tensor("all_gather_into_tensor", output, "output")
        self._check_flat("all_gather_into_tensor", output, tensor,
                         output.numel() == tensor.numel() * self.group_size,
                         lambda: f"output must hold world_size x input = {self.group_size} x "
                                 f"{tensor.numel()} elements")
        return self._run("all_gather_into_tensor", tensor, output=output, tensor=tensor)

    def gather(self, tensor: torch.Tensor, gather_list: Sequence[torch.Tensor] | None = None,
               dst: int = 0) -> Work:
        self._check_tensor("gather", tensor)
        self._check_rank("gather", dst, "dst")
        if self.group_rank == dst:
            self._check_list("gather", "gather_list", gather_list, tensor)
        elif gather_list:
            raise ValueError(f"{self.where('gather')} gather_list must be None or empty on ranks "
                             f"other than dst={dst}")
        gl = list(gather_list) if self.group_rank == dst and gather_list is not None else None
        return self._run("gather", tensor, tensor=tensor, gather_list=gl, dst=dst)

    def scatter(self, tensor: torch.Tensor, scatter_list: Sequence[torch.Tensor] | None = None,
                src: int = 0) -> Work:
        self._check_tensor("scatter", tensor)
        self._check_rank("scatter", src, "src")
        if self.group_rank == src:
            self._check_list("scatter", "scatter_list", scatter_list, tensor)
        elif scatter_list:
            raise ValueError(f"{self.where('scatter')} scatter_list must be None or empty on "
                             f"ranks other than src={src}")
        sl = list(scatter_list) if self.group_rank == src and scatter_list is not None else None
        return self._run("scatter", tensor, tensor=tensor, scatter_list=sl, src=src)

    def reduce_scatter(self, output: torch.Tensor, input_list: Sequence[torch.Tensor],
                       op: ReduceOp = ReduceOp.SUM) -> Work:
        """Reduce ``input_list[r]`` of every rank into rank ``r``'s ``output``. Entries may
        differ in size, as in torch: ``input_list[r]`` must match rank ``r``'s ``output``; an
        uneven list is composed from an all_reduce of the concatenated inputs."""
        self._check_tensor("reduce_scatter", output, "output")
        self._check_uneven_list("reduce_scatter", "input_list", input_list, output)
        self._check_reduce("reduce_scatter", op, output)
        return self._run_reduction("reduce_scatter", output, output, output=output,
                                   input_list=list(input_list), op=op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor,
                              op: ReduceOp = ReduceOp.SUM) -> Work:
        self._check_tensor("reduce_scatter_tensor", output, "output")
        self._check_tensor("reduce_scatter_tensor", input, "input")
        self._check_flat("reduce_scatter_tensor", input, output,
                         input.numel() == output.numel() * self.group_size,
                         lambda: f"input must hold world_size x output = {self.group_size} x "
                                 f"{output.numel()} elements")
        self._check_reduce("reduce_scatter_tensor", op, output)
        return self._run_reduction("reduce_scatter_tensor", output, output, output=output,
                                   input=input, op=op)

    def all_to_all(self, output_tensors: Sequence[torch.Tensor],
                   input_tensors: Sequence[torch.Tensor]) -> Work:
        for name, lst in (("output_tensors", output_tensors), ("input_tensors", input_tensors)):
            if len(lst) != self.group_size:
                raise ValueError(f"{self.where('all_to_all')} {name} has {len(lst)} tensors; "
                                 f"it needs one per rank ({self.group_size})")
            for t in lst:
                self._check_tensor("all_to_all", t, name)
        if any(t.dtype != input_tensors[0].dtype for t in [*output_tensors, *input_tensors]):
            raise ValueError(f"{self.where('all_to_all')} all tensors must share one dtype")
        return self._run("all_to_all", input_tensors[0], output_tensors=list(output_tensors),
                         input_tensors=list(input_tensors))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None) -> Work:
        op = "all_to_all_single"
        self._check_tensor(op, output, "output")
        self._check_tensor(op, input, "input")
        if output.dtype != input.dtype:
            raise ValueError(f"{self.where(op)} output dtype {output.dtype} != "
                             f"input dtype {input.dtype}")
        out_splits = self._splits(op, "output", output, output_split_sizes)
        in_splits = self._splits(op, "input", input, input_split_sizes)
        return self._run(op, input, output=output, input=input, output_split_sizes=out_splits,
                         input_split_sizes=in_splits)

    def run_blocking(self, op: str, *args: Any) -> None:
        """``getattr(self, op)(*args).wait()``, without the Work where the backend can.

        Blocks until the op finished on this rank (bounded by the group's timeout) and raises
        what the op and its ``wait`` would. Tried in order: the op's lean route (checks cached
        for plain CPU tensors, then the backend's ``native_<op>_blocking``); the public op,
        validating and planning as always, with a native op handed to the backend's
        ``native_blocking`` on this thread; the public op's Work."""
        if self.abort_signal.reason is not None:
            raise self.abort_signal.error(self.where(op))
        lean = self._lean.get(op)
        rec = _recorder
        if rec.fast and op in self._short_ops and not _torch_profiler._is_profiler_enabled:
            # the flight recorder's short route, written here (see observe.blocking): the
            # entry of FlightRecorder.record, untimed, without the thread's id. First: the
            # recorder is on by default
            try:
                t = args[0]
                shape, dtype = t.shape, t.dtype
                g = self._flight_group
            except (IndexError, AttributeError):  # not a tensor (its checks say so), or a
                observe.blocking(self, op, args, lean)  # group built by hand: the long way
                return
            g.collectives = seq = g.collectives + 1
            rid = next(rec.ids)
            rec.ring[rid % rec.capacity] = entry = [rid, g, op, seq, g.p2p, None, _ONE, shape,
                                                    dtype, _now_ns(), None, True, None]
            try:
                if lean is None or not lean(self, *args):
                    observe.issue_rest(self, op, args, rid)
            except BaseException as err:
                rec.failed(rid, err)
                raise
            entry[-1] = _COMPLETED  # its own entry: a slot reused meanwhile is not marked
        elif not (_torch_profiler._is_profiler_enabled or rec.on):  # observe.active(), inlined
            if lean is None or not lean(self, *args):
                self._run_blocking_rest(op, args)
        elif self._intercepted_ops:
            getattr(self, op)(*args).wait()  # a wrapper's public op, observed there
        else:
            observe.blocking(self, op, args, lean)

    def _run_blocking_rest(self, op: str, args: tuple[Any, ...]) -> None:
        """run_blocking past the lean route."""
        if op not in self._blocking_ops:
            getattr(self, op)(*args).wait()
            return
        outer = _waiting.call
        _waiting.call = (self, op)  # taken by this group's _dispatch of this op, if it comes
        try:
            work = getattr(self, op)(*args)
        finally:
            _waiting.call = outer
        work.wait()

    def _native_lean(self, op: str, tensor: Any, red: ReduceOp | None = None,
                     name: str = "tensor") -> BackendBase | None:
        """The backend whose lean route takes ``op`` (with reduction ``red``) on ``tensor``: a
        plain contiguous tensor of a device type in that backend's ``lean_device_types`` on
        which the op is native and whose ``native_<op>_blocking`` it implements; else None.
        Raises what the public op's checks of ``tensor`` and ``red`` would. For such tensors
        those checks, and the backend, depend only on (op, red, dtype, device type): cached."""
        if (type(tensor) is not torch.Tensor or not tensor.is_contiguous() or tensor.is_conj()
                or tensor.is_neg()):
            return None  # the public op checks (and refuses) the rest
        device = "cpu" if tensor.is_cpu else tensor.device.type
        key = (op, red, tensor.dtype, device)
        try:
            return self._lean_checked[key]
        except KeyError:
            pass
        backend = self._backends.get(device)
        found = None
        if backend is not None and device in backend.lean_device_types:
            self._check_tensor(op, tensor, name)
            if red is not None:
                self._check_reduce(op, red, tensor)
            caps = backend.capabilities()
            if (caps.is_native(op, device) and (red is None or red in caps.reduce_ops)
                    and backend.implements(f"native_{op}_blocking")):
                found = backend
        self._lean_checked[key] = found
        return found

    def _sparse_all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        """all_reduce of a sparse COO tensor: the backend's own, else composed (see
        :mod:`plugdist._group.sparse`; blocks for a small header exchange)."""
        sparse.check_all_reduce(self.where("all_reduce"), tensor, op)
        self._check_device("all_reduce", tensor, "tensor")
        backend = self._single or self._backends[_device_type(tensor)]
        work = backend.native_sparse_all_reduce(tensor=tensor)
        return sparse.all_reduce(self, tensor) if work is NotImplemented else work

    def barrier(self) -> Work:
        device = self.device_types[0] if self.device_types else "cpu"
        return self._dispatch("barrier", device, {})

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        self._check_tensor("send", tensor)
        self._check_peer("send", dst, "dst")
        return self._run("send", tensor, tensor=tensor, dst=dst, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        """Receive into ``tensor`` from ``src`` (group rank), or from any rank when ``src`` is None:
        then ``work.source_rank()`` names the sender."""
        self._check_tensor("recv", tensor)
        if src is None:
            if not (self._single or self._backends[_device_type(tensor)]
                    ).capabilities().any_source_recv:
                raise RuntimeError(f"{self.where('recv')} this backend cannot receive from any "
                                   f"source; pass src=")
        else:
            self._check_peer("recv", src, "src")
        return self._run("recv", tensor, tensor=tensor, src=src, tag=tag)

    # -- dispatch ----------------------------------------------------------------------------
    def _run(self, op: str, sample: torch.Tensor, **kwargs: Any) -> Work:
        return self._dispatch(op, _device_type(sample), kwargs)

    def _dispatch(self, op: str, device: str, kwargs: dict[str, Any],
                  gathering: bool = False) -> Work:
        """Issue a validated op: the one path of every public op, observed here (profiler
        event, flight-recorder entry: :mod:`plugdist._observability.observe`) when someone
        watches. An aborted group refuses it (plugdist._backend.abort)."""
        if self.abort_signal.reason is not None:
            raise self.abort_signal.error(self.where(op))
        if (_recorder.fast and op in self._short_ops
                and not _torch_profiler._is_profiler_enabled):  # the default: first
            return observe.run_one(self, op, device, kwargs, gathering)
        if observe.active():
            return observe.run(
                self, op, kwargs,
                lambda: self._dispatch_unobserved(op, device, kwargs, gathering), started=True)
        return self._dispatch_unobserved(op, device, kwargs, gathering)

    def _dispatch_unobserved(self, op: str, device: str, kwargs: dict[str, Any],
                             gathering: bool) -> Work:
        backend = self._single or self._backends[device]
        if gathering:
            return composition.reduce_by_gathering(backend, backend.capabilities(), op, device,
                                                   kwargs)
        if op == "reduce_scatter" and composition.is_uneven(kwargs):
            return composition.reduce_scatter_uneven(backend, backend.capabilities(), device,
                                                     kwargs)
        call = _waiting.call
        if call is not None and call[0] is self and call[1] == op:
            _waiting.call = None  # for this dispatch only, not the ops a composition issues
            if (backend.capabilities().is_native(op, device)
                    and backend.native_blocking(op, kwargs) is not NotImplemented):
                return _DONE
        try:
            native = self._natives[op, device]
        except KeyError:  # fixed for the group's life, as its backends and their capabilities
            native = self._natives[op, device] = composition.native_hook(backend, op, device)
        return composition.run_planned(backend, native, op, device, kwargs)

    def _run_reduction(self, op_name: str, sample: torch.Tensor, out: torch.Tensor | None,
                       **kwargs: Any) -> Work:
        """Reductions: AVG becomes SUM then a local divide when the backend lacks AVG; any other
        reduction the backend lacks is composed from all_gather plus a local reduce."""
        device = _device_type(sample)
        caps = (self._single or self._backends[device]).capabilities()
        red = kwargs["op"]
        if red in caps.reduce_ops:
            return self._dispatch(op_name, device, kwargs)
        if red is ReduceOp.AVG and ReduceOp.SUM in caps.reduce_ops:
            kwargs["op"] = ReduceOp.SUM
            work = self._dispatch(op_name, device, kwargs)
            size = self.group_size

            def divide(result: Any) -> Any:
                if out is not None:
                    out.detach().div_(size)  # in place, outside autograd (see compose)
                return result

            return work.then(divide)
        return self._dispatch(op_name, device, kwargs, gathering=True)

    # -- validation --------------------------------------------------------------------------
    def _check_tensor(self, op: str, tensor: Any, name: str = "tensor") -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{self.where(op)} {name} must be a torch.Tensor, "
                            f"got {type(tensor).__name__}")
        if tensor.layout is not torch.strided:
            raise ValueError(sparse.refusal(self.where(op), name, tensor))
        if not tensor.is_contiguous():
            raise ValueError(f"{self.where(op)} {name} is not contiguous "
                             f"(shape {list(tensor.shape)}, "
                             f"stride {list(tensor.stride())}); pass tensor.contiguous()")
        self._check_device(op, tensor, name)
        if tensor.is_conj() or tensor.is_neg():
            raise ValueError(f"{self.where(op)} {name} is a lazily conjugated/negated view, whose "
                             f"memory does not hold its values; pass "
                             f"{name}.resolve_conj().resolve_neg() (a copy)")

    def _check_device(self, op: str, tensor: torch.Tensor, name: str) -> None:
        if _device_type(tensor) not in self._backends:
            raise ValueError(f"{self.where(op)} {name} is on {tensor.device}, but backend "
                             f"{self.backend_name!r} handles "
                             f"{', '.join(self.device_types)} tensors; "
                             f"move it, or use a backend for {tensor.device.type}")

    def _check_rank(self, op: str, rank: int, name: str) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.group_size:
            raise ValueError(f"{self.where(op)} {name}={rank!r} is not a rank of this group "
                             f"(valid: 0..{self.group_size - 1})")

    def _check_peer(self, op: str, rank: int, name: str) -> None:
        self._check_rank(op, rank, name)
        if rank == self.group_rank:
            raise ValueError(f"{self.where(op)} {name}={rank} is this process's own rank; "
                             f"point-to-point needs another rank")

    def _check_reduce(self, op: str, red: ReduceOp, tensor: torch.Tensor) -> None:
        if red is not ReduceOp.SUM:  # SUM suits every dtype; the others depend on it
            try:
                check_reduce_op(red, tensor.dtype)
            except (TypeError, ValueError) as err:  # context formatted only on error: hot path
                raise type(err)(f"{self.where(op)} {err}") from None
        if red in (self._single or self._backends[_device_type(tensor)]
                   ).capabilities().refused_reduce_ops:
            raise ValueError(f"{self.where(op)} ReduceOp.{red.name} is not supported by backend "
                             f"{self.backend_name!r}; use another reduction or another backend")

    def _check_one_per_rank(self, op: str, name: str,
                            tensors: Sequence[torch.Tensor] | None) -> Sequence[torch.Tensor]:
        if tensors is None or len(tensors) != self.group_size:
            n = "None" if tensors is None else len(tensors)
            raise ValueError(f"{self.where(op)} {name} has {n} tensors; it needs one per rank "
                             f"({self.group_size})")
        return tensors

    def _check_list(self, op: str, name: str, tensors: Sequence[torch.Tensor] | None,
                    like: torch.Tensor) -> None:
        tensors = self._check_one_per_rank(op, name, tensors)
        for i, t in enumerate(tensors):
            self._check_tensor(op, t, f"{name}[{i}]")
            if t.shape != like.shape or t.dtype != like.dtype:
                raise ValueError(f"{self.where(op)} {name}[{i}] is {t.dtype}{list(t.shape)} "
                                 f"but must match {like.dtype}{list(like.shape)}")

    def _check_uneven_list(self, op: str, name: str, tensors: Sequence[torch.Tensor] | None,
                           mine: torch.Tensor) -> None:
        """``tensors`` holds one tensor of ``mine``'s dtype per rank, and this rank's entry
        holds as many elements as ``mine``; the others' sizes are their ranks' to match."""
        tensors = self._check_one_per_rank(op, name, tensors)
        for i, t in enumerate(tensors):
            self._check_tensor(op, t, f"{name}[{i}]")
            if t.dtype != mine.dtype:
                raise ValueError(f"{self.where(op)} {name}[{i}] is {t.dtype} but must be "
                                 f"{mine.dtype}")
        own = tensors[self.group_rank]
        if own.numel() != mine.numel():
            raise ValueError(f"{self.where(op)} {name}[{self.group_rank}] (this rank's share) "
                             f"has {own.numel()} elements but output has {mine.numel()}")

    def _check_flat(self, op: str, a: torch.Tensor, b: torch.Tensor, ok: bool,
                    why: Callable[[], str]) -> None:
        if a.dtype != b.dtype:
            raise ValueError(f"{self.where(op)} dtypes differ: {a.dtype} vs {b.dtype}")
        if not ok:
            raise ValueError(f"{self.where(op)} {why()}")  # formatted on failure only

    def _splits(self, op: str, name: str, tensor: torch.Tensor,
                splits: Sequence[int] | None) -> list[int]:
        rows = tensor.shape[0] if tensor.dim() else 1
        if splits is None or len(splits) == 0:
            if rows % self.group_size:
                raise ValueError(f"{self.where(op)} {name} has {rows} rows, not divisible by the "
                                 f"group size {self.group_size}; pass {name}_split_sizes")
            return [rows // self.group_size] * self.group_size
        splits = [int(s) for s in splits]
        if len(splits) != self.group_size or sum(splits) != rows or min(splits) < 0:
            raise ValueError(f"{self.where(op)} {name}_split_sizes={splits} must have "
                             f"{self.group_size} non-negative entries summing to "
                             f"{name}.shape[0]={rows}")
        return splits


# -- the lean routes of run_blocking ---------------------------------------------------------
# Each takes the public op's arguments and returns True once the backend's native_<op>_blocking
# did the op, or False (nothing done) for anything off its narrow case: a tensor that is not a
# plain contiguous one of the backend's lean_device_types, a rank or shape the public op would
# have to check, an op that is not native. run_blocking then takes the general route, which
# validates (and refuses) in full.


def _same_kind(t: Any, like: torch.Tensor) -> bool:
    """``t`` is a plain contiguous tensor of ``like``'s dtype on ``like``'s device (see
    _native_lean)."""
    return (type(t) is torch.Tensor and t.is_cpu == like.is_cpu and t.is_contiguous()
            and t.dtype == like.dtype and t.get_device() == like.get_device()
            and not t.is_conj() and not t.is_neg())


def _lean_all_reduce(pg: ProcessGroup, tensor: Any, op: Any = ReduceOp.SUM) -> bool:
    b = pg._native_lean("all_reduce", tensor, op)
    return (b is not None
            and b.native_all_reduce_blocking(tensor=tensor, op=op) is not NotImplemented)


def _lean_broadcast(pg: ProcessGroup, tensor: Any, src: Any = 0) -> bool:
    if type(src) is not int or not 0 <= src < pg.group_size:
        return False
    b = pg._native_lean("broadcast", tensor)
    return (b is not None
            and b.native_broadcast_blocking(tensor=tensor, src=src) is not NotImplemented)


def _lean_reduce(pg: ProcessGroup, tensor: Any, dst: Any = 0, op: Any = ReduceOp.SUM) -> bool:
    if type(dst) is not int or not 0 <= dst < pg.group_size:
        return False
    b = pg._native_lean("reduce", tensor, op)
    return (b is not None
            and b.native_reduce_blocking(tensor=tensor, dst=dst, op=op) is not NotImplemented)


def _lean_all_gather_into_tensor(pg: ProcessGroup, output: Any, tensor: Any) -> bool:
    b = pg._native_lean("all_gather_into_tensor", tensor)
    return (b is not None and _same_kind(output, tensor)
            and output.numel() == tensor.numel() * pg.group_size
            and b.native_all_gather_into_tensor_blocking(output=output, tensor=tensor)
            is not NotImplemented)


def _lean_reduce_scatter_tensor(pg: ProcessGroup, output: Any, input: Any,
                                op: Any = ReduceOp.SUM) -> bool:
    b = pg._native_lean("reduce_scatter_tensor", output, op, "output")
    return (b is not None
            and _same_kind(input, output) and input.numel() == output.numel() * pg.group_size
            and b.native_reduce_scatter_tensor_blocking(output=output, input=input, op=op)
            is not NotImplemented)


def _lean_all_to_all_single(pg: ProcessGroup, output: Any, input: Any,
                            output_split_sizes: Any = None, input_split_sizes: Any = None) -> bool:
    """Only even splits (none given) of two tensors of one shape."""
    if output_split_sizes or input_split_sizes:
        return False
    b = pg._native_lean("all_to_all_single", input)
    if b is None:
        return False
    shape = input.shape
    return (_same_kind(output, input) and len(shape) > 0 and output.shape == shape
            and shape[0] % pg.group_size == 0
            and b.native_all_to_all_single_blocking(output=output, input=input)
            is not NotImplemented)


_LEAN: dict[str, Callable[..., bool]] = {
    "all_reduce": _lean_all_reduce, "broadcast": _lean_broadcast, "reduce": _lean_reduce,
    "all_gather_into_tensor": _lean_all_gather_into_tensor,
    "reduce_scatter_tensor": _lean_reduce_scatter_tensor,
    "all_to_all_single": _lean_all_to_all_single,
}


@functools.cache
def _signature(op: str) -> inspect.Signature:
    """The public op's parameters (without ``self``), for binding a call by name."""
    sig = inspect.signature(getattr(ProcessGroup, op))
    return sig.replace(parameters=list(sig.parameters.values())[1:])
