"""``BackendBase``: what a backend author subclasses.

A backend is the transport under a :class:`~plugdist.ProcessGroup`: the ``native_*`` hooks it
does natively, the class attributes that describe it, and the helpers the base class gives it
(``work``, ``where``, ``timeout_error``, its rank, size and options, the abort signal). The
ProcessGroup that users hold validates every op, then runs it on the backend of the op's device
type: natively through these hooks, or composed from the ones the backend has
(:mod:`plugdist._group.composition`). docs/backends.md gives every hook's contract;
:data:`BACKEND_HOOKS` names them all (a test keeps the two in step).

The registry calls a backend's factory (its entry point: usually the class) as ``factory(store,
rank, size, options)``; a subclass's ``__init__`` takes those four and calls
``super().__init__(rank, size, options)``.

Not named ``Backend``: ``plugdist.Backend`` is torch.distributed's string class of backend
names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch

from plugdist._backend.abort import AbortSignal
from plugdist._backend.capabilities import ALL_REDUCE_OPS, Capabilities
from plugdist._backend.group import GroupIdentity
from plugdist._backend.hook_checks import check_backend_class
from plugdist._backend.reduce_op import ReduceOp
from plugdist._backend.work import Work
from plugdist._log import lifecycle
from plugdist.errors import DistTimeoutError, op_timeout, where

__all__ = ["BackendBase", "GroupOptions", "OPS", "LEAN_OPS",
           "DEFAULT_TIMEOUT", "BACKEND_HOOKS", "BACKEND_HELPERS", "BACKEND_ATTRIBUTES",
           "BACKEND_METHODS"]

DEFAULT_TIMEOUT = timedelta(minutes=30)

# The version of the backend plugin API: what docs/backends.md describes (the hooks, their
# arguments, what they return). The minor number grows when hooks are added (a plugin written
# for 1.0 keeps working under 1.3); the major number changes when a hook changes or goes away.
# 2.0: a backend subclasses plugdist.backend.BackendBase (no longer ProcessGroup, which is what
# users hold), and wrappers wrap a backend (plugdist_wrap_backend, not plugdist_wrap_process_group)
OPS: tuple[str, ...] = (
    "send", "recv", "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
    "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "barrier",
)

# ops with a lean blocking route of their own (``native_<op>_blocking``): the list-free ops that
# training loops and benchmarks call synchronously most
LEAN_OPS: tuple[str, ...] = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor",
                             "reduce_scatter_tensor", "all_to_all_single")

# The class attributes a backend may set (each with a default on BackendBase): what a wrapper
# (BackendWrapper) takes over from the backend it wraps, by this list.
BACKEND_ATTRIBUTES: tuple[str, ...] = (
    "backend_name", "device_types", "lean_device_types", "native_reduce_ops",
    "supports_any_source", "refused_reduce_ops", "rebuild_refusal", "grow_refusal",
    "plugin_api", "default_for", "launcher",
)
# The instance methods a backend may override: what a wrapper forwards, by this list.
BACKEND_METHODS: tuple[str, ...] = (
    "capabilities", "shutdown", "native_abort", "native_shrink", "wrap_op", "native_blocking",
    "native_sparse_all_reduce",
    *(f"native_{op}" for op in OPS),
    *(f"native_{op}_blocking" for op in LEAN_OPS),
)
# Everything a backend class may define, each documented in docs/backends.md (a test keeps the
# two in step, and checks every method here has a docstring): attributes, construction and the
# class methods, then the instance methods.
BACKEND_HOOKS: tuple[str, ...] = (
    *BACKEND_ATTRIBUTES, "is_available", "rendezvous", "__init__", "static_capabilities",
    *BACKEND_METHODS,
)
# what the base class gives a backend to call (documented there too)
BACKEND_HELPERS: tuple[str, ...] = ("work", "timeout_error", "where", "rank", "size",
                                    "group_rank", "group_size", "options", "abort_signal")


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


_derived: dict[type, Capabilities] = {}


def _derived_capabilities(cls: type[BackendBase]) -> Capabilities:
    caps = _derived.get(cls)
    if caps is None:
        native = frozenset(
            (op, dev) for op in OPS for dev in cls.device_types
            if getattr(cls, "native_" + op) is not getattr(BackendBase, "native_" + op))
        caps = _derived[cls] = Capabilities(
            native=native, reduce_ops=frozenset(cls.native_reduce_ops),
            any_source_recv=cls.supports_any_source, device_types=tuple(cls.device_types),
            refused_reduce_ops=frozenset(cls.refused_reduce_ops))
    return caps


class BackendBase(GroupIdentity):
    """The base class of every backend. See the module docstring and docs/backends.md."""

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
    # the plugin API the backend was written for; None here: a subclass that declares none is
    # taken as written for plugin API 2.0, the first with this class (the registry checks it)
    plugin_api: ClassVar[tuple[int, int] | None] = None
    # device types for which init_process_group() without a backend picks this one
    default_for: ClassVar[tuple[str, ...]] = ()
    # "mpiexec" when ranks must be started by mpiexec; "subprocess": plain processes
    launcher: ClassVar[str] = "subprocess"
    _caps: Capabilities | None = None  # this backend's capabilities, fixed at first use

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # misspelt hooks, hooks of the wrong parameters: refused here, once per class
        check_backend_class(cls, BackendBase, BACKEND_HOOKS)

    def __init__(self, rank: int, size: int, options: GroupOptions | None = None) -> None:
        """The base class's part of a backend: its rank, size and options. A backend's own
        ``__init__`` takes ``(store, rank, size, options)`` (what its factory is called with)
        and calls this first."""
        self.group_rank = rank
        self.group_size = size
        self.options = options or GroupOptions(global_ranks=tuple(range(size)))
        self.abort_signal = AbortSignal()

    # -- class methods ---------------------------------------------------------------------------
    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """``(True, "")``, or ``(False, reason)`` when the library or hardware this backend needs
        is missing here. Must not raise or be slow."""
        return True, ""

    @classmethod
    def rendezvous(cls, timeout: timedelta) -> tuple[Any, int, int] | None:
        """For backends that know the world themselves (MPI under mpiexec): ``(store, rank,
        world_size)``, used by init_process_group when no init_method is given. None (the
        default): the backend does not; the core's rendezvous (env://) runs."""
        return None

    @classmethod
    def static_capabilities(cls) -> Capabilities:
        """Native ``(op, device)`` pairs, derived from the ``native_*`` hooks this class overrides.
        Override (returning a cached object) for finer control; ``plugdist info`` shows it."""
        return _derived_capabilities(cls)

    def implements(self, hook: str) -> bool:
        """Whether this backend overrides ``hook`` (a name of :data:`BACKEND_METHODS`): the core
        calls the optional hooks only where it does. A wrapper answers for what it wraps."""
        return getattr(type(self), hook) is not getattr(BackendBase, hook)

    def capabilities(self) -> Capabilities:
        """What this backend does natively; asked on every op (default: ``static_capabilities()``,
        cached). Wrappers return the wrapped backend's."""
        caps = self._caps
        if caps is None:
            caps = self._caps = self.static_capabilities()
        return caps

    # -- helpers ---------------------------------------------------------------------------------
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

    # -- threads, abort, shrink ------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release sockets, threads and communicators; called once per group by
        destroy_process_group (make it idempotent anyway). Stop and *join* every thread the
        backend started, and close its sockets, before returning: a thread still running when
        the interpreter exits (daemon or not) can crash the process at exit. Fail (do not
        abandon) Works still pending. Must not wait on peers: they may be gone already."""

    def native_abort(self) -> None:
        """Optional: release what the backend has in flight (the core already fired the abort
        signal, which releases every thread waiting on a Work of this group and refuses new
        ops). Must not block."""

    def native_shrink(self, keep: Sequence[int], options: GroupOptions) -> Any:
        """Optional: this group's survivors as a new backend, natively (NCCL's ncclCommShrink,
        MPI's ULFM). ``keep``: the group ranks that stay, in order; every one of them calls it.
        Return NotImplemented to have the core build a fresh backend for the survivors through
        the backend's constructor on a fresh store prefix (the default, which every backend
        gets); raise a DistError when the backend cannot survive a member's failure at all."""
        return NotImplemented

    # -- wrappers --------------------------------------------------------------------------------
    def wrap_op(self, op: str, args: dict[str, Any], run: Callable[[], Work]) -> Work:
        """Optional, for wrappers (the debug plugin's): called once per public op of the group,
        before the group validates it, with the public op's arguments by name (group ranks)
        and ``run``, which validates and issues it (natively or composed) and returns its
        Work. Return that Work (or raise). A backend that overrides this sees every public op
        and is never given the blocking routes. Default: ``run()``."""
        return run()

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
        alive). Never asked for send or recv, nor of a backend that intercepts public ops
        (``wrap_op``)."""
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
        ``rank``; every entry has ``output``'s shape (the core composes lists whose entries
        differ in size). Complete the Work with ``[output]``."""
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
