"""``ProcessGroup``: what a backend implements, and what every caller uses.

Two layers in one class (the template-method pattern):

* **Public ops** (``all_reduce``, ``broadcast``, ... ``send``, ``recv``): what the frontend, DDP,
  the debug wrapper and users of the explicit object API call. They validate arguments (clear
  errors naming rank, group, op and backend, raised before anything is sent), then run the op
  natively if the backend can, or compose it from the backend's native ops
  (:mod:`plugdist._group.composition`). Every public op returns a
  :class:`~plugdist._backend.work.Work`.
* **The blocking path** (``run_blocking(op, ...)``): what the synchronous frontend calls. It
  validates exactly as the public op does, then runs the backend's ``native_<op>_blocking``
  (the hot ops on plain tensors of its ``lean_device_types``, checks cached) or
  ``native_blocking``, which finish the op on the calling thread with no Work at all (a Work
  costs tens of microseconds, the whole budget of a small message). Without those hooks, for
  composed ops, and for any op whose public method a class overrides (a wrapper), it waits on
  the public op's Work.
* **Native hooks** (``native_all_reduce``, ...): what a backend overrides. Each receives already
  validated arguments in *group* ranks and returns a Work, or ``NotImplemented`` for arguments it
  cannot handle (e.g. uneven all_to_all lists), in which case the core composes the op. A backend
  overrides only what it does
  natively; ``capabilities()`` is derived from which hooks it overrides (override it for finer
  control, e.g. an op native on CUDA only).

Contract for every op: all members of the group call it, in the same order, with matching
arguments. Public ops never block on the network unless the backend is synchronous; the returned
Work's ``wait`` does, bounded by the group's timeout.

The registry calls a backend's factory (its entry point) as ``factory(store, rank, size,
options)``: ``store`` is private to this group, ``rank``/``size`` are the group rank and size,
``options`` a :class:`GroupOptions`. A subclass's ``__init__`` takes those four and calls
``super().__init__(rank, size, options)``. :data:`BACKEND_HOOKS` names everything a backend may
define; docs/backends.md gives each one's contract (a test checks that both stay complete).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
from torch.autograd import profiler as _torch_profiler

from plugdist._backend.abort import AbortSignal
from plugdist._backend.capabilities import ALL_REDUCE_OPS, Capabilities
from plugdist._backend.hook_checks import check_backend_class
from plugdist._backend.reduce_op import ReduceOp, check_reduce_op
from plugdist._backend.work import Work, completed_work
from plugdist._group import composition, sparse
from plugdist._log import lifecycle
from plugdist._observability import observe
from plugdist._observability.flight_recorder import recorder as _recorder
from plugdist.errors import DistTimeoutError, op_timeout, where

__all__ = ["ProcessGroup", "GroupOptions", "Capabilities", "OPS", "DEFAULT_TIMEOUT",
           "BACKEND_HOOKS"]

DEFAULT_TIMEOUT = timedelta(minutes=30)

OPS: tuple[str, ...] = (
    "send", "recv", "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
    "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "barrier",
)


# ops that may run through ``native_blocking``: not send/recv, whose Works carry results (the
# sender of an any-source receive) and whose callers may pair them with ops issued later
_BLOCKING_OPS = frozenset(OPS) - {"send", "recv"}

# ops with a lean blocking route of their own (``native_<op>_blocking``, see _LEAN below): the
# list-free ops that training loops and benchmarks call synchronously most
_LEAN_OPS = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor",
             "reduce_scatter_tensor", "all_to_all_single")

# Everything a backend class may define, each documented in docs/backends.md (a test keeps the
# two in step, and checks every method here has a docstring). Class attributes first, then the
# optional members the base class lacks (the core asks with getattr), then methods.
BACKEND_HOOKS: tuple[str, ...] = (
    "backend_name", "device_types", "lean_device_types", "native_reduce_ops",
    "supports_any_source",
    "refused_reduce_ops", "rebuild_refusal", "grow_refusal",
    "plugin_api", "default_for", "launcher", "is_available", "rendezvous",
    "__init__", "static_capabilities", "capabilities", "shutdown", "native_abort",
    "native_shrink", "native_blocking", "native_sparse_all_reduce",
    *(f"native_{op}" for op in OPS),
    *(f"native_{op}_blocking" for op in _LEAN_OPS),
)
# what the base class gives a backend to call (documented there too)
BACKEND_HELPERS: tuple[str, ...] = ("work", "timeout_error", "where", "rank", "size",
                                    "group_rank", "group_size", "options", "abort_signal")


class _Waiting(threading.local):
    """Per thread: the (group, op) whose caller is about to wait on it (see run_blocking)."""

    call: tuple[Any, str] | None = None


_waiting = _Waiting()
# what a dispatch run by native_blocking returns: only run_blocking (which just waits) and a
# public op's own ``then`` (AVG's divide, run at once) ever see it
_DONE = completed_work()


@dataclass(frozen=True)
class GroupOptions:
    """What the core tells a backend about the group it is building."""

    group_name: str = "0"
    timeout: timedelta = DEFAULT_TIMEOUT
    global_ranks: tuple[int, ...] = ()
    backend_options: Any = None  # the user's ``pg_options``, passed through untouched
    # the group is the whole world: the default group that init_process_group builds (a backend
    # that knows the world itself, as MPI does, checks the core's ranks against its own)
    is_world: bool = False


_derived: dict[type[ProcessGroup], Capabilities] = {}


def _derived_capabilities(cls: type[ProcessGroup]) -> Capabilities:
    caps = _derived.get(cls)
    if caps is None:
        native = frozenset(
            (op, dev) for op in OPS for dev in cls.device_types
            if getattr(cls, "native_" + op) is not getattr(ProcessGroup, "native_" + op))
        caps = _derived[cls] = Capabilities(
            native=native, reduce_ops=frozenset(cls.native_reduce_ops),
            any_source_recv=cls.supports_any_source, device_types=tuple(cls.device_types),
            refused_reduce_ops=frozenset(cls.refused_reduce_ops))
    return caps


def _device_type(t: torch.Tensor) -> str:
    return "cpu" if t.is_cpu else t.device.type  # is_cpu skips building a torch.device


class ProcessGroup:
    """A group of processes and the collectives among them. See the module docstring."""

    backend_name: ClassVar[str] = "unknown"
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    # the device types whose tensors the lean blocking hooks (native_<op>_blocking) accept
    lean_device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    native_reduce_ops: ClassVar[frozenset[ReduceOp]] = ALL_REDUCE_OPS
    supports_any_source: ClassVar[bool] = False
    refused_reduce_ops: ClassVar[frozenset[ReduceOp]] = frozenset()
    # non-empty: why this backend's groups cannot be rebuilt with other members (shrink_group
    # and grow_group refuse with it); empty: the core's default rebuild works
    rebuild_refusal: ClassVar[str] = ""
    # non-empty: why this backend cannot admit new processes (grow_group and join=True refuse
    # with it) even where it can shrink
    grow_refusal: ClassVar[str] = ""
    _caps: Capabilities | None = None  # this group's capabilities, fixed at first use
    # set per class by __init_subclass__: which ops run_blocking may hand to native_blocking,
    # and the lean route (see _LEAN) of each op that has one here
    _blocking_ops: ClassVar[frozenset[str]] = frozenset()
    _lean: ClassVar[dict[str, Callable[..., bool]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # misspelt hooks, hooks of the wrong parameters: refused here, once per class
        check_backend_class(cls, ProcessGroup, BACKEND_HOOKS)
        # the blocking path may stand in for a public op only where that op is the core's own
        generic = cls.native_blocking is not ProcessGroup.native_blocking
        own = [op for op in _BLOCKING_OPS if getattr(cls, op) is getattr(ProcessGroup, op)]
        cls._blocking_ops = frozenset(own) if generic else frozenset()
        cls._lean = {op: _LEAN[op] for op in _LEAN_OPS if op in own and getattr(
            cls, f"native_{op}_blocking") is not getattr(ProcessGroup, f"native_{op}_blocking")}

    def __init__(self, rank: int, size: int, options: GroupOptions | None = None) -> None:
        """The base class's part of a group: its rank, size and options. A backend's own
        ``__init__`` takes ``(store, rank, size, options)`` (what its factory is called with)
        and calls this first."""
        self.group_rank = rank
        self.group_size = size
        self.options = options or GroupOptions(global_ranks=tuple(range(size)))
        # (op, reduction, dtype, device type) -> whether the lean route takes that op on a plain
        # tensor (_native_lean)
        self._lean_checked: dict[tuple[str, ReduceOp | None, torch.dtype, str], bool] = {}
        self.abort_signal = AbortSignal()

    # -- identity ----------------------------------------------------------------------------
    def rank(self) -> int:
        """This process's rank within the group."""
        return self.group_rank

    def size(self) -> int:
        """Number of processes in the group."""
        return self.group_size

    @property
    def group_name(self) -> str:
        return self.options.group_name

    @property
    def timeout(self) -> timedelta:
        return self.options.timeout

    @property
    def backend(self) -> str:
        return self.backend_name

    @classmethod
    def static_capabilities(cls) -> Capabilities:
        """Native ``(op, device)`` pairs, derived from the ``native_*`` hooks this class overrides.
        Override (returning a cached object) for finer control; ``plugdist info`` shows it."""
        return _derived_capabilities(cls)

    def capabilities(self) -> Capabilities:
        """What this group does natively; called on every op. Wrappers return the inner group's."""
        caps = self._caps
        if caps is None:
            caps = self._caps = self.static_capabilities()
        return caps

    def shutdown(self) -> None:
        """Release sockets, threads and communicators; called once per group by
        destroy_process_group (make it idempotent anyway). Stop and *join* every thread the
        backend started, and close its sockets, before returning: a thread still running when
        the interpreter exits (daemon or not) can crash the process at exit. Fail (do not
        abandon) Works still pending. Must not wait on peers: they may be gone already."""

    def abort(self, reason: str = "the group was aborted", ranks: tuple[int, ...] = ()) -> None:
        """Fail every op in flight on this rank, and every later one, with
        ``DistRankFailureError`` (``reason``; ``ranks``: the failed global ranks). Non-blocking,
        idempotent, any thread; then the backend's ``native_abort``. The group cannot be used
        again: shut it down, and continue on a group of the survivors (``shrink_group``)."""
        self.abort_signal.fire(reason, ranks)
        self.native_abort()

    def native_abort(self) -> None:
        """Optional: release what the backend has in flight (the core already releases every
        thread waiting on a Work of this group, and refuses new ops). Must not block."""

    def native_shrink(self, keep: Sequence[int], options: GroupOptions) -> Any:
        """Optional: this group's survivors as a new group, natively (NCCL's ncclCommShrink,
        MPI's ULFM). ``keep``: the group ranks that stay, in order; every one of them calls it.
        Return NotImplemented to have the core build a fresh group of the survivors through the
        backend's constructor on a fresh store prefix (the default, which every backend gets);
        raise a DistError when the backend cannot survive a member's failure at all."""
        return NotImplemented

    def work(self, op: str, **kwargs: Any) -> Work:
        """A fresh pending Work carrying this group's context (rank, group, backend, timeout,
        abort signal) for a ``native_*`` hook to return and complete later with
        ``set_result``/``set_exception`` from any thread. ``kwargs``: ``source_rank=`` for
        receives."""
        return Work(op=op, rank=self.group_rank, group=self.group_name, backend=self.backend_name,
                    timeout=self.timeout, abort=self.abort_signal, **kwargs)

    def where(self, op: str) -> str:
        """``[rank R, group G, backend B, op O]``: the prefix of every error about ``op``."""
        return where(rank=self.group_rank, group=self.group_name, op=op, backend=self.backend_name)

    def timeout_error(self, op: str, seconds: float | None = None) -> DistTimeoutError:
        """The error for ``op`` not completing within ``seconds`` (default: the group's timeout),
        worded as ``Work.wait``'s."""
        if seconds is None:
            seconds = self.timeout.total_seconds()
        lifecycle("op_timeout", group=self.group_name, group_rank=self.group_rank,
                  backend=self.backend_name, level="warning", op=op, timeout_s=seconds)
        return op_timeout(self.where(op), seconds)

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} backend={self.backend_name!r} group={self.group_name!r} "
                f"rank={self.group_rank}/{self.group_size}>")

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
        self._check_tensor("reduce_scatter", output, "output")
        self._check_list("reduce_scatter", "input_list", input_list, output)
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
        if not (_torch_profiler._is_profiler_enabled or _recorder.on):  # observe.active(), inlined
            if lean is None or not lean(self, *args):
                self._run_blocking_rest(op, args)
        elif lean is None and op not in self._blocking_ops:
            getattr(self, op)(*args).wait()  # a wrapper's public op, observed there
        else:
            observe.blocking(self, op, args, lean, self._run_blocking_rest)

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
                     name: str = "tensor") -> bool:
        """Whether the lean route takes ``op`` (with reduction ``red``) on ``tensor``: a plain
        contiguous tensor of a device type in ``lean_device_types`` on which the op is native;
        raises what the public op's checks of ``tensor`` and ``red`` would. For such tensors
        those checks depend only on (op, red, dtype, device type): cached."""
        if (type(tensor) is not torch.Tensor or not tensor.is_contiguous() or tensor.is_conj()
                or tensor.is_neg()):
            return False  # the public op checks (and refuses) the rest
        device = "cpu" if tensor.is_cpu else tensor.device.type
        key = (op, red, tensor.dtype, device)
        native = self._lean_checked.get(key)
        if native is None:
            if device in self.lean_device_types:
                self._check_tensor(op, tensor, name)
                if red is not None:
                    self._check_reduce(op, red, tensor)
                caps = self.capabilities()
                native = caps.is_native(op, device) and (red is None or red in caps.reduce_ops)
            else:
                native = False
            self._lean_checked[key] = native
        return native

    def _sparse_all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        """all_reduce of a sparse COO tensor: the backend's own, else composed (see
        :mod:`plugdist._group.sparse`; blocks for a small header exchange)."""
        sparse.check_all_reduce(self.where("all_reduce"), tensor, op)
        self._check_device("all_reduce", tensor, "tensor")
        work = self.native_sparse_all_reduce(tensor=tensor)
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
            if not self.capabilities().any_source_recv:
                raise RuntimeError(f"{self.where('recv')} this backend cannot receive from any "
                                   f"source; pass src=")
        else:
            self._check_peer("recv", src, "src")
        return self._run("recv", tensor, tensor=tensor, src=src, tag=tag)

    # -- native hooks: a backend overrides those it does natively ---------------------------
    # Every native_<op> hook below takes keyword arguments only, already validated, ranks as
    # *group* ranks. It returns a Work (``self.work(op)``) that the backend completes later,
    # from any thread, with ``work.set_result([output tensors])`` or ``work.set_exception(err)``;
    # or ``NotImplemented`` (never a Work) to have the core compose this one call. It must not
    # block on the network: a blocking transport hands the op to a thread of its own.
    # Ops are matched across ranks by issue order: the n-th collective issued on a group is
    # the n-th on every rank, and the n-th send from A to B with tag T is the n-th receive on B
    # from A with tag T. Two issued ops may be in flight at once (a composition issues several
    # before waiting on any), so a backend must not serialise an op behind one issued later.
    def native_blocking(self, op: str, kwargs: dict[str, Any]) -> Any:
        """Optional. ``native_<op>(**kwargs)`` run to completion on the calling thread, with no
        Work: return None when done, or NotImplemented to have the core wait on a Work instead.
        Must raise the op's error as a DistError, and ``timeout_error(op)`` once the group's
        timeout has passed (the op may then still finish in the background, so keep its buffers
        alive). Never asked for send or recv."""
        return NotImplemented

    # The lean hooks for the ops called synchronously most: the op on plain contiguous tensors
    # (no lazy conj/neg bit) of a device type in ``lean_device_types`` (CPU by default), checked
    # as the public op checks them (ranks are group ranks), run to completion on the calling
    # thread — for a stream-ordered device (CUDA), to the point a Work's ``wait()`` would reach:
    # queued so that the caller's current stream sees the result. Same contract as
    # native_blocking; NotImplemented leaves the call to native_blocking, then to a Work. Only
    # hooks a backend overrides are ever called.
    def native_all_reduce_blocking(self, *, tensor: torch.Tensor, op: ReduceOp) -> Any:
        """Optional lean route of a synchronous all_reduce on a plain tensor (see
        ``native_blocking``): reduce ``tensor`` in place; None when done, or NotImplemented."""
        return NotImplemented

    def native_broadcast_blocking(self, *, tensor: torch.Tensor, src: int) -> Any:
        """Optional lean route of a synchronous broadcast from group rank ``src`` (see
        ``native_blocking``): None when done, or NotImplemented."""
        return NotImplemented

    def native_reduce_blocking(self, *, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Any:
        """Optional lean route of a synchronous reduce into ``tensor`` on group rank ``dst``
        (see ``native_blocking``): None when done, or NotImplemented."""
        return NotImplemented

    def native_all_gather_into_tensor_blocking(self, *, output: torch.Tensor,
                                               tensor: torch.Tensor) -> Any:
        """Optional lean route of a synchronous all_gather_into_tensor (``output`` holds size x
        ``tensor`` elements; see ``native_blocking``): None when done, or NotImplemented."""
        return NotImplemented

    def native_reduce_scatter_tensor_blocking(self, *, output: torch.Tensor, input: torch.Tensor,
                                              op: ReduceOp) -> Any:
        """Optional lean route of a synchronous reduce_scatter_tensor (``input`` holds size x
        ``output`` elements; see ``native_blocking``): None when done, or NotImplemented."""
        return NotImplemented

    def native_all_to_all_single_blocking(self, *, output: torch.Tensor,
                                          input: torch.Tensor) -> Any:
        """Optional lean route of a synchronous all_to_all_single with even splits only: the
        rows of both tensors (of one shape) shared out alike (see ``native_blocking``). None
        when done, or NotImplemented."""
        return NotImplemented

    def native_sparse_all_reduce(self, *, tensor: torch.Tensor) -> Any:
        """Optional: sum the sparse COO ``tensor`` over the group into ``tensor`` (its contents
        replaced, as ``copy_`` does) and return a Work; NotImplemented (the default) has the core
        compose it from dense all_gathers. Checked already: ReduceOp.SUM, device."""
        return NotImplemented

    def native_broadcast(self, *, tensor: torch.Tensor, src: int) -> Work:
        """Copy ``tensor`` of group rank ``src`` into ``tensor`` on every rank. Complete the
        Work with ``[tensor]``."""
        raise NotImplementedError

    def native_all_reduce(self, *, tensor: torch.Tensor, op: ReduceOp) -> Work:
        """Reduce ``tensor`` over the group with ``op`` (one of ``native_reduce_ops``), result
        in ``tensor`` on every rank. Complete the Work with ``[tensor]``."""
        raise NotImplementedError

    def native_reduce(self, *, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Work:
        """Reduce ``tensor`` over the group with ``op`` into ``tensor`` on group rank ``dst``
        (other ranks' tensors may be used as scratch). Complete the Work with ``[tensor]``."""
        raise NotImplementedError

    def native_all_gather(self, *, output_tensors: list[torch.Tensor],
                          tensor: torch.Tensor) -> Work:
        """Copy every rank's ``tensor`` into ``output_tensors[rank]`` (one per rank, each of
        ``tensor``'s shape and dtype) on every rank. Complete the Work with
        ``output_tensors``."""
        raise NotImplementedError

    def native_all_gather_into_tensor(self, *, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        """Every rank's ``tensor``, concatenated in rank order, into the flat ``output`` (size x
        ``tensor.numel()`` elements). Complete the Work with ``[output]``."""
        raise NotImplementedError

    def native_gather(self, *, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None,
                      dst: int) -> Work:
        """Every rank's ``tensor`` into ``gather_list[rank]`` on group rank ``dst``
        (``gather_list`` is None elsewhere). Complete the Work with ``gather_list`` on ``dst``,
        ``[]`` elsewhere."""
        raise NotImplementedError

    def native_scatter(self, *, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None,
                       src: int) -> Work:
        """``scatter_list[rank]`` of group rank ``src`` into ``tensor`` on every rank
        (``scatter_list`` is None elsewhere). Complete the Work with ``[tensor]``."""
        raise NotImplementedError

    def native_reduce_scatter(self, *, output: torch.Tensor, input_list: list[torch.Tensor],
                              op: ReduceOp) -> Work:
        """Reduce ``input_list[rank]`` over the group with ``op`` into ``output`` on each
        ``rank``. Complete the Work with ``[output]``."""
        raise NotImplementedError

    def native_reduce_scatter_tensor(self, *, output: torch.Tensor, input: torch.Tensor,
                                     op: ReduceOp) -> Work:
        """As ``native_reduce_scatter``, with the flat ``input`` (size x ``output.numel()``
        elements, rank ``r``'s share at ``r * output.numel()``). Complete the Work with
        ``[output]``."""
        raise NotImplementedError

    def native_all_to_all(self, *, output_tensors: list[torch.Tensor],
                          input_tensors: list[torch.Tensor]) -> Work:
        """Send ``input_tensors[r]`` to rank ``r`` and receive rank ``r``'s into
        ``output_tensors[r]`` (sizes may differ per rank: return NotImplemented for what the
        transport cannot do). Complete the Work with ``output_tensors``."""
        raise NotImplementedError

    def native_all_to_all_single(self, *, output: torch.Tensor, input: torch.Tensor,
                                 output_split_sizes: list[int],
                                 input_split_sizes: list[int]) -> Work:
        """all_to_all over the rows of two tensors: ``input_split_sizes[r]`` rows go to rank
        ``r``, ``output_split_sizes[r]`` rows come from it (both lists always given, one entry
        per rank). Complete the Work with ``[output]``."""
        raise NotImplementedError

    def native_barrier(self) -> Work:
        """Complete the Work (with ``[]``) only once every rank of the group has called it."""
        raise NotImplementedError

    def native_send(self, *, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        """Send ``tensor``'s bytes to group rank ``dst`` (never this rank) under ``tag``. The
        caller may reuse ``tensor`` once the Work completed, so copy it (or keep it unchanged)
        until then; the Work may complete before ``dst`` received it. Complete with
        ``[tensor]``. Matching: the n-th send to ``dst`` with ``tag`` meets ``dst``'s n-th
        receive from this rank with that tag."""
        raise NotImplementedError

    def native_recv(self, *, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
        """Receive the matching send (see ``native_send``) from group rank ``src`` into
        ``tensor`` (same number of bytes). ``src`` is None only if the class sets
        ``supports_any_source``: then take the first message from any rank with ``tag``.
        Create the Work as ``self.work("recv", source_rank=src)`` (for any-source, pass a
        callable returning the sender once known) and complete it with ``[tensor]``."""
        raise NotImplementedError

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
        if observe.active():
            return observe.run(
                self, op, kwargs,
                lambda: self._dispatch_unobserved(op, device, kwargs, gathering), started=True)
        return self._dispatch_unobserved(op, device, kwargs, gathering)

    def _dispatch_unobserved(self, op: str, device: str, kwargs: dict[str, Any],
                             gathering: bool) -> Work:
        if gathering:
            return composition.reduce_by_gathering(self, self.capabilities(), op, device, kwargs)
        call = _waiting.call
        if call is not None and call[0] is self and call[1] == op:
            _waiting.call = None  # for this dispatch only, not the ops a composition issues
            if (self.capabilities().is_native(op, device)
                    and self.native_blocking(op, kwargs) is not NotImplemented):
                return _DONE
        return composition.run_op(self, op, device, kwargs)

    def _run_reduction(self, op_name: str, sample: torch.Tensor, out: torch.Tensor | None,
                       **kwargs: Any) -> Work:
        """Reductions: AVG becomes SUM then a local divide when the backend lacks AVG; any other
        reduction the backend lacks is composed from all_gather plus a local reduce."""
        caps = self.capabilities()
        device = _device_type(sample)
        red = kwargs["op"]
        if red in caps.reduce_ops:
            return self._dispatch(op_name, device, kwargs)
        if red is ReduceOp.AVG and ReduceOp.SUM in caps.reduce_ops:
            kwargs["op"] = ReduceOp.SUM
            work = self._dispatch(op_name, device, kwargs)
            size = self.group_size

            def divide(result: Any) -> Any:
                if out is not None:
                    out.div_(size)
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
        if _device_type(tensor) not in self.capabilities().device_types:
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
        if red in self.capabilities().refused_reduce_ops:
            raise ValueError(f"{self.where(op)} ReduceOp.{red.name} is not supported by backend "
                             f"{self.backend_name!r}; use another reduction or another backend")

    def _check_list(self, op: str, name: str, tensors: Sequence[torch.Tensor] | None,
                    like: torch.Tensor) -> None:
        if tensors is None or len(tensors) != self.group_size:
            n = "None" if tensors is None else len(tensors)
            raise ValueError(f"{self.where(op)} {name} has {n} tensors; it needs one per rank "
                             f"({self.group_size})")
        for i, t in enumerate(tensors):
            self._check_tensor(op, t, f"{name}[{i}]")
            if t.shape != like.shape or t.dtype != like.dtype:
                raise ValueError(f"{self.where(op)} {name}[{i}] is {t.dtype}{list(t.shape)} "
                                 f"but must match {like.dtype}{list(like.shape)}")

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
    return (pg._native_lean("all_reduce", tensor, op)
            and pg.native_all_reduce_blocking(tensor=tensor, op=op) is not NotImplemented)


def _lean_broadcast(pg: ProcessGroup, tensor: Any, src: Any = 0) -> bool:
    return (type(src) is int and 0 <= src < pg.group_size and pg._native_lean("broadcast", tensor)
            and pg.native_broadcast_blocking(tensor=tensor, src=src) is not NotImplemented)


def _lean_reduce(pg: ProcessGroup, tensor: Any, dst: Any = 0, op: Any = ReduceOp.SUM) -> bool:
    return (type(dst) is int and 0 <= dst < pg.group_size and pg._native_lean("reduce", tensor, op)
            and pg.native_reduce_blocking(tensor=tensor, dst=dst, op=op) is not NotImplemented)


def _lean_all_gather_into_tensor(pg: ProcessGroup, output: Any, tensor: Any) -> bool:
    return (pg._native_lean("all_gather_into_tensor", tensor) and _same_kind(output, tensor)
            and output.numel() == tensor.numel() * pg.group_size
            and pg.native_all_gather_into_tensor_blocking(output=output, tensor=tensor)
            is not NotImplemented)


def _lean_reduce_scatter_tensor(pg: ProcessGroup, output: Any, input: Any,
                                op: Any = ReduceOp.SUM) -> bool:
    return (pg._native_lean("reduce_scatter_tensor", output, op, "output")
            and _same_kind(input, output) and input.numel() == output.numel() * pg.group_size
            and pg.native_reduce_scatter_tensor_blocking(output=output, input=input, op=op)
            is not NotImplemented)


def _lean_all_to_all_single(pg: ProcessGroup, output: Any, input: Any,
                            output_split_sizes: Any = None, input_split_sizes: Any = None) -> bool:
    """Only even splits (none given) of two tensors of one shape."""
    if output_split_sizes or input_split_sizes or not pg._native_lean("all_to_all_single", input):
        return False
    shape = input.shape
    return (_same_kind(output, input) and len(shape) > 0 and output.shape == shape
            and shape[0] % pg.group_size == 0
            and pg.native_all_to_all_single_blocking(output=output, input=input)
            is not NotImplemented)


_LEAN: dict[str, Callable[..., bool]] = {
    "all_reduce": _lean_all_reduce, "broadcast": _lean_broadcast, "reduce": _lean_reduce,
    "all_gather_into_tensor": _lean_all_gather_into_tensor,
    "reduce_scatter_tensor": _lean_reduce_scatter_tensor,
    "all_to_all_single": _lean_all_to_all_single,
}
