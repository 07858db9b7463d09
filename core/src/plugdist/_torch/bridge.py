"""plugdist's groups seen as torch.distributed process groups: the ``plugdist_*`` backends.

Every installed plugdist backend ``X`` is registered with torch.distributed as ``plugdist_X``
(on ``import torch``, through the ``torch.backends`` entry point: see
:mod:`_plugdist_torch_autoload`; or explicitly with :func:`register`). When torch builds a group
of it (``init_process_group``, ``new_group``, ``init_device_mesh``), :func:`create_group` builds a
plugdist group of the same ranks through plugdist's own group-building path (so plugins such as
the debug wrapper apply) and hands torch a :class:`BridgeGroup` over it.

The bridge translates and owns no communication: each op torch calls becomes one call of
plugdist's public :class:`~plugdist.ProcessGroup` API, and returns at once with a
:class:`BridgeWork` whose ``wait`` is plugdist's ``Work.wait`` (bounded by the group's timeout;
errors name rank, group, op and backend) and whose future completes when plugdist's Work does.

The other direction, :func:`share_world`: ``plugdist.init_process_group`` makes torch's default
group a BridgeGroup over plugdist's default group, so libraries that ask torch.distributed see
the world the script built (see docs/torch.md).

The shape torch expects: a Python subclass of torch's ``ProcessGroup`` (the ``Backend`` class
has no Python constructor in torch 2.x) that also answers ``getGroupName``/``setGroupName``, since
torch keeps a group's name on its backends and a Python group has none; without them FSDP2 and
functional collectives fail with "ProcessGroup name not set".
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import _plugdist_torch_autoload as autoload
import torch
import torch.distributed as tdist
from torch._C import _distributed_c10d as c10d

from plugdist._backend.reduce_op import ReduceOp
from plugdist._backend.work import Work, completed_work, gather_works
from plugdist._group.process_group import ProcessGroup
from plugdist._registry import BACKENDS, registry
from plugdist._torch.device_map import caller_device_map, other_devices
from plugdist._world.groups import build_group, retire_group
from plugdist._world.groups import device_map as parse_device_map
from plugdist.errors import where
from plugdist.store import PrefixStore, Store, TorchStoreAdapter
from plugdist.store._for_torch import PlugdistStoreForTorch

__all__ = ["register", "create_group", "BridgeGroup", "RoutingBridgeGroup", "BridgeWork",
           "share_world", "follow_world", "world_store", "release_world", "torch_name", "PREFIX",
           "ENV_SWITCH"]

PREFIX = autoload.PREFIX
ENV_SWITCH = autoload.ENV_SWITCH  # "0" keeps ``import torch`` from registering plugdist_* names

# torch's classes typed as Any: the bridge overrides their methods with torch's Python-side
# signatures (tensor lists, options objects), which its C++ stubs spell differently
_TorchProcessGroup: Any = c10d.ProcessGroup
_TorchWork: Any = c10d.Work
_RED: Any = c10d.ReduceOp.RedOpType
_REDUCE_OPS = {_RED.SUM: ReduceOp.SUM, _RED.AVG: ReduceOp.AVG, _RED.PRODUCT: ReduceOp.PRODUCT,
               _RED.MIN: ReduceOp.MIN, _RED.MAX: ReduceOp.MAX, _RED.BAND: ReduceOp.BAND,
               _RED.BOR: ReduceOp.BOR, _RED.BXOR: ReduceOp.BXOR}
# the same, indexed by torch's RedOpType (an int-like enum: indexing needs no hash of it, which
# costs a call into torch's binding); None for those the bridge has none of (PREMUL_SUM)
_REDUCTIONS: tuple[ReduceOp | None, ...] = tuple(
    _REDUCE_OPS.get(_RED(i)) for i in range(max(int(v) for v in _RED.__members__.values()) + 1))
_AllreduceOptions: Any = c10d.AllreduceOptions
_TORCH_SUM: Any = c10d.ReduceOp.SUM


def torch_name(backend: str) -> str:
    """The torch.distributed name of plugdist backend ``backend``: ``plugdist_<backend>``."""
    return PREFIX + backend.lower()


def register(names: Sequence[str] | None = None) -> list[str]:
    """Register ``plugdist_<name>`` with torch.distributed for each of ``names`` (default: every
    plugdist backend, installed or registered at runtime with ``plugdist.Backend``). Returns the
    torch names. Idempotent; imports no plugin. What ``import torch`` does unless
    ``PLUGDIST_TORCH_BACKENDS=0``."""
    return autoload.register(registry.names(BACKENDS) if names is None else names)


# -- groups torch builds ----------------------------------------------------------------------
class _Adopting(threading.local):
    """Per thread: the plugdist group that the torch group being built must wrap (share_world)."""

    group: ProcessGroup | None = None


_adopting = _Adopting()


def create_group(backend: str, backend_options: Any, pg_options: Any = None) -> BridgeGroup:
    """torch's factory for ``plugdist_<backend>`` (``extended_api``: ``backend_options`` is
    torch's ``_DistributedBackendOptions``). Builds plugdist's group of the same ranks on torch's
    store, blocking until every member built it (bounded by the group's timeout)."""
    factory = registry.load(BACKENDS, backend)  # a broken plugin is reported here, by name
    _learn_devices(backend, factory)
    adopted = _adopting.group
    if adopted is not None and not backend_options.global_ranks_in_group:
        _adopting.group = None
        return BridgeGroup(adopted, backend, owned=False, name=backend_options.group_id)
    size, rank = backend_options.group_size, backend_options.group_rank
    global_ranks = tuple(backend_options.global_ranks_in_group) or tuple(range(size))
    timeout = backend_options.timeout
    name = backend_options.group_id

    def plugdist_group(kind: str, store: Any, label: str, options: Any) -> ProcessGroup:
        return build_group(kind, TorchStoreAdapter(store, timeout), global_ranks, rank, label,
                           timeout, options, global_rank=global_ranks[rank])

    pg = plugdist_group(backend, backend_options.store, f"torch:{name}", pg_options)
    device_map = caller_device_map()
    if device_map is not None:  # "cpu:gloo,cuda:plugdist_nccl": torch left the rest to us
        def other(other_backend: str, device: str, store: Any) -> BridgeGroup:
            group = plugdist_group(other_backend, store, f"torch:{name}:{device}", None)
            return BridgeGroup(group, other_backend, owned=True, name=name)

        try:
            routes = other_devices(device_map, torch_name(backend), rank, size,
                                   list(global_ranks), other)
        except BaseException:
            pg.shutdown()
            raise
        if routes:
            return RoutingBridgeGroup(pg, backend, owned=True, name=name, routes=routes)
    return BridgeGroup(pg, backend, owned=True, name=name)


def _learn_devices(backend: str, factory: Any) -> None:
    """Replace the provisional device list of the torch name with the backend's own."""
    devices = list(getattr(factory, "device_types", autoload.PROVISIONAL_DEVICES))
    tdist.Backend.backend_capability[torch_name(backend)] = devices


class BridgeGroup(_TorchProcessGroup):
    """A plugdist group as torch.distributed sees it.

    Each op torch calls (with its list-of-tensors arguments and options objects; ranks are group
    ranks) is one call of the plugdist group's public API, issued at once; it returns a
    :class:`BridgeWork` and never blocks. Thread-safety and ordering are the plugdist group's:
    every member issues the same ops in the same order. ``owned`` groups (built by torch) are
    shut down with torch's; a shared one (plugdist's default group) is left to plugdist.

    ``routes`` (only in a :class:`RoutingBridgeGroup`): the group serving each device type that
    a device map gave to another backend.
    """

    def __init__(self, group: ProcessGroup, backend: str, *, owned: bool, name: str = "",
                 routes: dict[str, Any] | None = None) -> None:
        super().__init__(group.rank(), group.size())
        self.plugdist_group = group
        self.routes = routes or {}
        self._backend = torch_name(backend)
        self._owned = owned
        self._name = name
        self._desc = ""
        self._coalesced: list[Work] | None = None
        # what every synchronous op returns: torch only waits on it, and making a torch Work
        # per op costs more than a small op (its destructor releases the GIL)
        self._done = BridgeWork(_DONE, [])
        # torch's default groups over plugdist's world before this one (follow_world)
        self._predecessors: weakref.WeakSet[BridgeGroup] = weakref.WeakSet()

    # -- identity: what torch keeps on a group's backends, kept here -------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's C++ names, looked up by its binding
        return self._backend

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    @property
    def _device_types(self) -> list[torch.device]:
        own = [d for d in self.plugdist_group.capabilities().device_types if d not in self.routes]
        return [torch.device(d) for d in [*own, *self.routes]]

    def __repr__(self) -> str:
        return (f"<BridgeGroup {self._backend} torch group {self._name!r} over "
                f"{self.plugdist_group!r}>")

    def shutdown(self) -> None:
        """torch's destroy_process_group: shut the plugdist group down if torch built it, and
        every group that served other devices of its device map."""
        if self._owned:
            self._owned = False
            registry.plugins().hook.plugdist_group_destroyed(group=self.plugdist_group)
            self.plugdist_group.shutdown()
            retire_group(self.plugdist_group)
        routes, self.routes = self.routes, {}
        for route in {id(r): r for r in routes.values()}.values():
            route.shutdown()

    def abort(self) -> None:
        self.shutdown()

    # -- translation helpers -------------------------------------------------------------------
    def _reduction(self, opts: Any, op_name: str) -> ReduceOp:
        red = getattr(opts, "reduceOp", opts)
        red = getattr(red, "op", red)  # a torch ReduceOp object holds its RedOpType in .op
        found = _REDUCTIONS[red] if type(red) is _RED else None
        if found is None:
            raise ValueError(f"{self._where(op_name)} "
                             f"{red} is not supported through the plugdist bridge (PREMUL_SUM "
                             f"included): multiply the tensor by the factor yourself and use "
                             f"ReduceOp.SUM")
        return found

    def _where(self, op: str | None = None) -> str:
        pg = self.plugdist_group
        return where(rank=pg.rank(), group=pg.group_name, op=op, backend=self._backend)

    def _work(self, work: Work, outputs: list[torch.Tensor]) -> BridgeWork:
        if self._coalesced is not None:
            self._coalesced.append(work)
        return BridgeWork(work, outputs)

    def _synchronous(self, opts: Any) -> bool:
        """Whether torch called with ``async_op=False`` (torch >= 2.8 says so in ``asyncOp``) and
        waits on the returned work at once: then the op runs through plugdist's blocking path
        (``run_blocking``: no plugdist Work; on CUDA, queued on the caller's stream)."""
        return (opts is not None and getattr(opts, "asyncOp", True) is False
                and self._coalesced is None)

    def _blocking(self, op: str, *args: Any) -> BridgeWork:
        self.plugdist_group.run_blocking(op, *args)
        return self._done

    # -- collectives ---------------------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> BridgeWork:
        # torch.distributed.all_reduce(tensor): torch's options read once each, no helper calls
        # (each read of an options field is a call into torch's binding)
        if (type(opts) is _AllreduceOptions and opts.asyncOp is False and type(tensors) is list
                and len(tensors) == 1 and self._coalesced is None):
            # a sum, told by one comparison: reading the reduction's type costs 0.4 us more
            torch_red = opts.reduceOp
            red = ReduceOp.SUM if torch_red == _TORCH_SUM else _REDUCTIONS[torch_red.op]
            if red is not None:
                self.plugdist_group.run_blocking("all_reduce", tensors[0], red)
                return self._done
        tensors = _as_list(tensors)
        red = self._reduction(opts, "all_reduce") if opts is not None else ReduceOp.SUM
        if len(tensors) == 1:
            if self._synchronous(opts):
                return self._blocking("all_reduce", tensors[0], red)
            return self._work(self.plugdist_group.all_reduce(tensors[0], red), tensors)
        return self._gathered([self.plugdist_group.all_reduce(t, red) for t in tensors], tensors,
                              "all_reduce")

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> BridgeWork:
        red = self._reduction(opts, "all_reduce_coalesced") if opts is not None else ReduceOp.SUM
        from plugdist._world.collectives import all_reduce_coalesced

        work = all_reduce_coalesced(list(tensors), red, group=self.plugdist_group, async_op=True)
        assert work is not None  # a plugdist group (not a non-member handle) always gives one
        return self._work(work, list(tensors))

    def broadcast(self, tensors: Any, opts: Any = None) -> BridgeWork:
        tensors = _as_list(tensors)
        root = opts.rootRank if opts is not None else 0
        if self._synchronous(opts):
            return self._blocking("broadcast", tensors[0], root)
        return self._work(self.plugdist_group.broadcast(tensors[0], root), tensors)

    def reduce(self, tensors: Any, opts: Any = None) -> BridgeWork:
        tensors = _as_list(tensors)
        red = self._reduction(opts, "reduce") if opts is not None else ReduceOp.SUM
        root = opts.rootRank if opts is not None else 0
        if self._synchronous(opts):
            return self._blocking("reduce", tensors[0], root, red)
        return self._work(self.plugdist_group.reduce(tensors[0], root, red), tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: Any,
                  opts: Any = None) -> BridgeWork:
        inputs = _as_list(input_tensors)
        return self._work(self.plugdist_group.all_gather(output_tensors[0], inputs[0]),
                          list(output_tensors[0]))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_tensors: list[torch.Tensor], opts: Any = None) -> BridgeWork:
        pg = self.plugdist_group
        works = [pg.all_gather([outs[i] for outs in output_lists], t)
                 for i, t in enumerate(input_tensors)]
        return self._gathered(works, [t for outs in output_lists for t in outs],
                              "all_gather_coalesced")

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any = None) -> BridgeWork:
        if self._synchronous(opts):
            return self._blocking("all_gather_into_tensor", output, input)
        return self._work(self.plugdist_group.all_gather_into_tensor(output, input), [output])

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> BridgeWork:
        pg = self.plugdist_group
        works = [pg.all_gather_into_tensor(o, i) for o, i in zip(outputs, inputs, strict=True)]
        return self._gathered(works, list(outputs), "all_gather_into_tensor_coalesced")

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: Any,
               opts: Any = None) -> BridgeWork:
        inputs = _as_list(input_tensors)
        root = opts.rootRank if opts is not None else 0
        gather_list = list(output_tensors[0]) if output_tensors else None
        return self._work(self.plugdist_group.gather(inputs[0], gather_list, root),
                          gather_list or [])

    def scatter(self, output_tensors: Any, input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> BridgeWork:
        outputs = _as_list(output_tensors)
        root = opts.rootRank if opts is not None else 0
        scatter_list = list(input_tensors[0]) if input_tensors else None
        return self._work(self.plugdist_group.scatter(outputs[0], scatter_list, root), outputs)

    def reduce_scatter(self, output_tensors: Any, input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> BridgeWork:
        outputs = _as_list(output_tensors)
        red = self._reduction(opts, "reduce_scatter") if opts is not None else ReduceOp.SUM
        return self._work(self.plugdist_group.reduce_scatter(outputs[0], input_tensors[0], red),
                          outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> BridgeWork:
        red = self._reduction(opts, "reduce_scatter_tensor") if opts is not None else ReduceOp.SUM
        if self._synchronous(opts):
            return self._blocking("reduce_scatter_tensor", output, input, red)
        return self._work(self.plugdist_group.reduce_scatter_tensor(output, input, red), [output])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> BridgeWork:
        red = (self._reduction(opts, "reduce_scatter_tensor_coalesced") if opts is not None
               else ReduceOp.SUM)
        pg = self.plugdist_group
        works = [pg.reduce_scatter_tensor(o, i, red) for o, i in zip(outputs, inputs, strict=True)]
        return self._gathered(works, list(outputs), "reduce_scatter_tensor_coalesced")

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> BridgeWork:
        return self._work(self.plugdist_group.all_to_all(output_tensors, input_tensors),
                          list(output_tensors))

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Sequence[int], input_split_sizes: Sequence[int],
                      opts: Any = None) -> BridgeWork:
        out_splits, in_splits = list(output_split_sizes) or None, list(input_split_sizes) or None
        if self._synchronous(opts):
            return self._blocking("all_to_all_single", output, input, out_splits, in_splits)
        return self._work(self.plugdist_group.all_to_all_single(output, input, out_splits,
                                                                in_splits), [output])

    all_to_all_single = alltoall_base

    def barrier(self, opts: Any = None) -> BridgeWork:
        return self._work(self.plugdist_group.barrier(), [])

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        """plugdist's monitored barrier where plugdist's world knows the group (it names the
        ranks that did not arrive), else a barrier bounded by the timeout."""
        from plugdist._world.collectives import monitored_barrier
        from plugdist._world.state import world

        timeout = getattr(opts, "timeout", None)
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            timeout = None
        pg = self.plugdist_group
        if id(pg) in world.groups:
            monitored_barrier(pg, timeout=timeout, wait_all_ranks=wait_all_ranks)
        else:
            pg.barrier().wait(timeout)

    # -- point to point --------------------------------------------------------------------------
    def send(self, tensors: Any, dst: int, tag: int = 0) -> BridgeWork:
        tensors = _as_list(tensors)
        return self._work(self.plugdist_group.send(tensors[0], dst, tag), tensors)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> BridgeWork:
        tensors = _as_list(tensors)
        return self._work(self.plugdist_group.recv(tensors[0], src, tag), tensors)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> BridgeWork:
        tensors = _as_list(tensors)
        return self._work(self.plugdist_group.recv(tensors[0], None, tag), tensors)

    # -- coalescing (torch's _coalescing_manager) ----------------------------------------------
    def start_coalescing(self, device: Any = None) -> None:
        """Ops issued until ``end_coalescing`` run as usual; their works are gathered into one."""
        if self._coalesced is not None:
            raise RuntimeError(f"{self._where('start_coalescing')} coalescing is already "
                               f"started on this group")
        self._coalesced = []

    def end_coalescing(self, device: Any = None) -> BridgeWork:
        works, self._coalesced = self._coalesced or [], None
        return self._gathered(works, [], "coalesced")

    _start_coalescing = start_coalescing
    _end_coalescing = end_coalescing

    def _gathered(self, works: list[Work], outputs: list[torch.Tensor], op: str) -> BridgeWork:
        pg = self.plugdist_group
        work = gather_works(works, outputs, op=op, rank=pg.rank(), group=pg.group_name,
                            backend=pg.backend_name, timeout=pg.timeout)
        return self._work(work, outputs)


# every op torch may send with tensors of another device of a device map
_ROUTED_OPS = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather",
               "allgather_coalesced", "_allgather_base", "all_gather_single",
               "allgather_into_tensor_coalesced", "all_gather_single_coalesced", "gather",
               "scatter", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
               "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced", "alltoall",
               "alltoall_base", "all_to_all_single", "barrier", "send", "recv", "recv_anysource",
               "start_coalescing", "end_coalescing", "_start_coalescing", "_end_coalescing")


class RoutingBridgeGroup(BridgeGroup):
    """A BridgeGroup built from a device map naming other backends too (see
    :mod:`plugdist._torch.device_map`): an op whose tensors (or barrier/coalescing device) are on
    a device in ``routes`` is that group's call, unchanged; the rest is the BridgeGroup's. A
    class of its own so that groups without a device map keep the direct path."""


def _routed(name: str, own: Any) -> Any:
    def op(self: BridgeGroup, *args: Any, **kwargs: Any) -> Any:
        device = _device_type(args) or _device_type(tuple(kwargs.values()))
        route = self.routes.get(device) if device is not None else None
        if route is not None:  # torch's C++ group spells coalescing with a leading "_"
            method = getattr(route, name, None) or getattr(route, "_" + name)
            return method(*args, **kwargs)
        return own(self, *args, **kwargs)

    op.__name__, op.__qualname__ = name, f"RoutingBridgeGroup.{name}"
    op.__doc__ = own.__doc__
    return op


for _name in _ROUTED_OPS:
    setattr(RoutingBridgeGroup, _name, _routed(_name, getattr(BridgeGroup, _name)))


def _device_type(args: Any, depth: int = 3) -> str | None:
    """The device type of the first tensor in ``args`` (nested lists included), else of an
    options object's ``device`` (barrier) or a device argument (coalescing); None if none."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
        if isinstance(arg, torch.device):
            return arg.type
        if isinstance(arg, (list, tuple)) and depth > 0:
            found = _device_type(arg, depth - 1)
            if found is not None:
                return found
        device = getattr(arg, "device", None)
        if isinstance(device, torch.device):
            return device.type
    return None


def _as_list(tensors: Any) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else tensors


_DONE = completed_work()  # what a BridgeWork of an op run through run_blocking stands on
_FUTURE_LOCK = threading.Lock()  # one lock for all: a future is made once per Work at most
_DEFER_LOCK = threading.Lock()  # orders a future's completion and its backward's final check


def _in_backward() -> bool:
    """Whether this thread runs a backward pass that takes final callbacks (a torch without
    the query answers no: failures then reach torch as its own RuntimeError)."""
    graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
    return graph_task_id is not None and graph_task_id() != -1


def _after_backward(callback: Any) -> None:
    """Run ``callback`` at the end of this thread's backward pass, after torch's own final
    callbacks queued by then (DDP's reducer queues its finalizer once the last bucket is
    launched): queued now, it queues itself again, behind them."""
    queue = torch.autograd.Variable._execution_engine.queue_callback
    queue(lambda: queue(callback))


class BridgeWork(_TorchWork):
    """A plugdist Work as torch sees it.

    ``wait`` is plugdist's (bounded by the group's timeout, or ``timeout`` when positive;
    raises plugdist's error naming rank, group, op and backend). ``get_future`` is a
    ``torch.futures.Future`` completed with the op's output tensors when plugdist's Work
    completes, made on first request. Thread-safe as plugdist's Work is.

    A failed op never completes the future with the exception as its value (what Python's
    ``Future.set_exception`` does): torch's C++ readers of the future (DDP's reducer and its
    comm hooks) would read it as tensors and crash. The future is a ``then`` of plugdist's, so
    the error is the C++ future's own, which torch raises as a ``RuntimeError`` naming it.
    Inside a backward pass (DDP's gradient buckets, comm hooks) the op's own error is raised
    instead, as plugdist raises it (``DistRankFailureError`` with its ``ranks``, when a peer
    died): the future then completes with the output tensors, unreduced, and a final callback
    of that backward, run after DDP's own, raises the error, so that ``loss.backward()`` raises
    it and DDP's reducer finished its iteration (the model can take the next step once the
    world is shrunk). Should that callback find the op still running, the future keeps the
    error itself when the op fails.
    """

    def __init__(self, work: Work, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.plugdist_work = work
        self._outputs = outputs
        self._future: torch.futures.Future | None = None
        self._failure_deferred = False  # see the class docstring; guarded by _DEFER_LOCK

    def wait(self, timeout: timedelta | None = None) -> bool:
        if isinstance(timeout, timedelta) and timeout <= timedelta(0):
            timeout = None  # torch's "no timeout given": the group's applies
        return self.plugdist_work.wait(timeout)

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self.plugdist_work.is_completed()

    def is_success(self) -> bool:
        return self.plugdist_work.is_success()

    def exception(self) -> BaseException | None:
        return self.plugdist_work.exception()

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def _source_rank(self) -> int:
        return self.plugdist_work.source_rank()

    def source_rank(self) -> int:
        return self.plugdist_work.source_rank()

    def get_future(self) -> torch.futures.Future:
        fut = self._future
        if fut is not None:
            return fut
        with _FUTURE_LOCK:
            if self._future is None:
                self._future = self._make_future()
            return self._future

    def _make_future(self) -> torch.futures.Future:
        outputs = self._outputs
        if _in_backward():
            self._failure_deferred = True
            _after_backward(self._raise_deferred_failure)

        def outcome(fut: torch.futures.Future) -> list[torch.Tensor]:
            with _DEFER_LOCK:
                deferred = self._failure_deferred
            if not deferred:
                fut.value()  # raises the op's error, which torch's C++ keeps as the future's
            return outputs

        return self.plugdist_work.get_future().then(outcome)

    def _raise_deferred_failure(self) -> None:
        """The final callback of the backward pass that asked for the future: raise the op's
        error if it failed by now; from here on, a failure completes the future with it."""
        work = self.plugdist_work
        with _DEFER_LOCK:
            self._failure_deferred = False
            failed = work.is_completed() and not work.is_success()
        if failed:
            work.wait()  # raises the op's error


# -- plugdist's world as torch's ----------------------------------------------------------------
def share_world(group: ProcessGroup, backend: str, store: Store, rank: int, world_size: int,
                timeout: timedelta) -> Any:
    """Make torch's default group a BridgeGroup over ``group`` (plugdist's default group);
    returns it, or None when torch's default group already exists (then it is left alone).
    Not collective beyond torch's own ``init_process_group`` (which, with a store, waits for no
    one)."""
    if not tdist.is_available() or tdist.is_initialized():
        return None
    mapped = parse_device_map(backend)  # "cpu:gloo,cuda:nccl": torch's own map, plugdist_*
    autoload.register(list(dict.fromkeys(mapped.values())) if mapped else [backend])
    spec = (",".join(f"{device}:{torch_name(kind)}" for device, kind in mapped.items())
            if mapped else torch_name(backend))
    torch_store = PlugdistStoreForTorch(store, store.timeout)
    _adopting.group = group  # the first factory torch calls adopts the whole group
    try:
        tdist.init_process_group(spec, store=torch_store, rank=rank, world_size=world_size,
                                 timeout=timeout)
    finally:
        _adopting.group = None
    shared: Any = tdist.group.WORLD
    # torch holds the store in C++ only; its Python methods live as long as this object does
    shared.keepalive = torch_store
    return shared


def world_store(store: Store, epoch: int) -> Store:
    """The store of torch's groups over plugdist's world in ``epoch``: a part of plugdist's
    world store of its own per epoch, since torch names its groups from the first again when
    its default group is made anew (:func:`follow_world`)."""
    return PrefixStore("torch" if epoch == 0 else f"torch/e{epoch}", store)


def follow_world(shared: Any, group: ProcessGroup, backend: str, store: Store, rank: int,
                 world_size: int, timeout: timedelta) -> Any:
    """After ``shrink_group``/``grow_group``: make torch's default group a new BridgeGroup over
    ``group`` (the new world's default group, ``rank`` of ``world_size``) and return it, so that
    ``torch.distributed.get_rank()``/``get_world_size()``, ``group.WORLD`` and what is built on
    them afterwards (a new DDP, a DistributedSampler) see the new world. torch keeps a group's
    rank and size in C++, fixed when it is built: only a new group object can carry new ones.

    ``shared``, the default group until now, and every default group before it run over
    ``group`` from now on too, so that what holds one (a DDP or FSDP built before) can still
    issue ops; their ``rank()``/``size()`` keep their old values. torch's other groups are
    destroyed, as torch's own ``shrink_group`` does. ``store`` must be new to this world's torch
    groups (their names start again from torch's first). Returns None, leaving torch alone,
    when the script destroyed or replaced torch's default group itself. Not collective."""
    if not isinstance(shared, BridgeGroup):
        raise TypeError(f"follow_world: {shared!r} is not a group over a plugdist backend")
    predecessors = shared._predecessors
    predecessors.add(shared)
    for old in predecessors:
        old.plugdist_group = group
    if not tdist.is_initialized() or tdist.group.WORLD is not shared:
        return None
    tdist.destroy_process_group()
    new = share_world(group, backend, store, rank, world_size, timeout)
    if new is not None:
        new._predecessors = predecessors
    return new


def release_world(shared: Any) -> None:
    """Undo :func:`share_world`: destroy torch's groups if torch's default group is still
    ``shared`` (the user may have destroyed it already)."""
    if shared is not None and tdist.is_initialized() and tdist.group.WORLD is shared:
        tdist.destroy_process_group()
