"""DistributedDataParallel: data-parallel training over any plugdist backend.

Every rank holds a replica of the module. Construction checks that all ranks built the same
model and copies rank 0's parameters to the others, and its buffers when ``broadcast_buffers``
(the default), as each forward then does; each backward averages the gradients across ranks
through a :class:`~plugdist.parallel.reducer.Reducer` (the bucketed one by default, or any
found under the ``plugdist.reducers`` entry points), overlapping communication with the rest
of backward.
A ``torch.nn.SyncBatchNorm`` in the module is made to synchronise over plugdist (see
:func:`plugdist.nn.sync_batchnorm.adopt_torch_sync_batchnorms`).

Collective contract: every rank constructs the model, and runs forward/backward, in the same
order and the same number of times (use :meth:`DistributedDataParallel.join` for uneven
inputs). All waits are bounded by the process group's timeout.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from plugdist._backend.reduce_op import ReduceOp
from plugdist._group.process_group import ProcessGroup
from plugdist._log import get_logger
from plugdist._world.groups import resolve_group
from plugdist.errors import DistError
from plugdist.nn.sync_batchnorm import adopt_torch_sync_batchnorms
from plugdist.parallel.bucketing import DEFAULT_FIRST_BUCKET_BYTES
from plugdist.parallel.comm_hooks import CommHook, GradBucket
from plugdist.parallel.join import Join, Joinable, JoinHook
from plugdist.parallel.logging_data import DDPLogger
from plugdist.parallel.reducer import Reducer, ReducerOptions
from plugdist.parallel.sync import broadcast_coalesced, verify_model_across_ranks

__all__ = ["DistributedDataParallel"]

REDUCERS = "plugdist.reducers"
COMM_HOOKS = "plugdist.comm_hooks"


class DistributedDataParallel(nn.Module, Joinable):
    """Wrap ``module`` so that backward averages its gradients over ``process_group``.

    Arguments follow ``torch.nn.parallel.DistributedDataParallel``; ``process_group=None``
    means the default group of ``plugdist.init_process_group``; ``reducer`` names a
    ``plugdist.reducers`` entry point or is a :class:`Reducer` subclass.
    ``bucket_cap_mb`` also caps the small first bucket (1 MiB by default). Bucket views keep each
    parameter's own strides when it is dense, so ``.grad`` layouts match AccumulateGrad's.

    Construction is collective (two all-gathers and the broadcasts of parameters, and of
    buffers when ``broadcast_buffers``).
    """

    def __init__(self, module: nn.Module, device_ids: list[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool = True, process_group: ProcessGroup | None = None,
                 bucket_cap_mb: float = 25, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, reducer: str | type[Reducer] = "bucketed") -> None:
        nn.Module.__init__(self)
        Joinable.__init__(self)
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel wraps a torch.nn.Module, got "
                            f"{type(module).__name__}")
        for name, p in module.named_parameters():
            if isinstance(p, nn.parameter.UninitializedParameter):
                raise RuntimeError(
                    f"DistributedDataParallel cannot wrap a module with uninitialized (lazy) "
                    f"parameters ({name!r}); run one dummy forward pass first so that they get "
                    f"their shapes, then wrap the module")
        if not any(p.requires_grad for p in module.parameters()):
            raise RuntimeError("DistributedDataParallel is pointless for a module with no "
                               "parameter that requires a gradient: there is nothing to "
                               "synchronise. Use the module directly.")
        self.module = module
        self._setup_devices(device_ids, output_device)
        self.process_group = _resolve_group(process_group)
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.bucket_bytes_cap = int(bucket_cap_mb * 1024 * 1024)
        if self.bucket_bytes_cap <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self._divide_by_initial_world_size = True
        self._rank = self.process_group.rank()
        self._log = get_logger(rank=self._rank, group=self.process_group.group_name)
        adopted = adopt_torch_sync_batchnorms(
            module, self.process_group.where("DistributedDataParallel"))
        if adopted:
            self._log.info("ddp_sync_batchnorm_adopted", layers=adopted)
        if check_reduction:
            warnings.warn("DistributedDataParallel(check_reduction=...) is deprecated and has no "
                          "effect: the reducer always checks that reductions finish",
                          FutureWarning, stacklevel=2)
        if static_graph and find_unused_parameters:
            warnings.warn("static_graph=True finds unused parameters by itself (in the first "
                          "iteration); find_unused_parameters=True is not needed with it",
                          UserWarning, stacklevel=2)

        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        params, names, sparse = self._params_for_reducer()
        self._buffers_to_sync = [b for n, b in module.named_buffers()
                                 if n not in self.parameters_to_ignore]
        where = self.process_group.where("DistributedDataParallel")
        verify_model_across_ranks(self.process_group, params, names, where)
        self._sync_module_states(0)

        options = ReducerOptions(
            bucket_cap_bytes=self.bucket_bytes_cap,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
            param_names=dict(enumerate(names)), expect_sparse_gradients=tuple(sparse))
        self.logger = DDPLogger()
        reducer_cls = _resolve_reducer(reducer)
        self._reducer_setup = (reducer_cls, params, options)
        self._comm_hook: tuple[Any, CommHook] | None = None
        self.reducer: Reducer = reducer_cls(params, self.process_group, options, self.logger)
        self.logger.set_construction_data(
            self,
            world_size=self.process_group.size(), rank=self._rank,
            module_name=type(module).__name__,
            device_ids=",".join(str(d) for d in self.device_ids or []),
            output_device=-1 if self.output_device is None else self.output_device,
            backend_name=self.process_group.backend_name,
            reducer=reducer_cls.__name__,
            bucket_cap_bytes=self.bucket_bytes_cap,
            first_bucket_cap_bytes=min(DEFAULT_FIRST_BUCKET_BYTES, self.bucket_bytes_cap),
            find_unused_parameters=int(find_unused_parameters),
            gradient_as_bucket_view=int(gradient_as_bucket_view),
            static_graph=int(static_graph), broadcast_buffers=int(broadcast_buffers),
            is_multi_device_module=int(self.is_multi_device_module),
            num_parameter_tensors=len(params),
            total_parameter_size_bytes=sum(p.numel() * p.element_size() for p in params),
            parameter_dtypes=",".join(sorted({str(p.dtype).replace("torch.", "") for p in params})),
        )
        from plugdist._registry import registry  # late: keeps `import plugdist.parallel` cheap

        registry.plugins().hook.plugdist_ddp_constructed(module=self,
                                                         logging_data=self._get_ddp_logging_data())

    # -- construction helpers --------------------------------------------------------------------
    def _setup_devices(self, device_ids: list[Any] | None, output_device: Any) -> None:
        params = list(self.module.parameters())
        devices = {p.device for p in params}
        self.is_multi_device_module = len(devices) > 1
        types = {d.type for d in devices}
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("device_ids can only be None or contain a single element: one "
                             "process drives one device")
        if len(types) != 1:
            raise ValueError(f"DistributedDataParallel's module must have all its parameters on "
                             f"one device type, but they are on {sorted(str(d) for d in devices)}")
        self.device_type = types.pop()
        self.device = params[0].device
        if not device_ids or self.device_type == "cpu" or self.is_multi_device_module:
            if device_ids or output_device is not None:
                raise ValueError(
                    f"DistributedDataParallel's device_ids and output_device only apply to a "
                    f"module on a single accelerator; this one's parameters are on "
                    f"{sorted(str(d) for d in devices)}, yet device_ids={device_ids}, "
                    f"output_device={output_device}. Leave both as None")
            self.device_ids: list[int] | None = None
            self.output_device: int | None = None
        else:
            self.device_ids = [_device_index(device_ids[0])]
            self.output_device = _device_index(output_device if output_device is not None
                                               else device_ids[0])

    def _params_for_reducer(self) -> tuple[list[nn.Parameter], list[str], list[bool]]:
        """The parameters to synchronise, their names, and which get sparse gradients (the
        weight of an Embedding/EmbeddingBag built with sparse=True)."""
        params: list[nn.Parameter] = []
        names: list[str] = []
        sparse: list[bool] = []
        seen: set[int] = set()
        for module_name, m in self.module.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                fqn = f"{module_name}.{pname}" if module_name else pname
                if not p.requires_grad or fqn in self.parameters_to_ignore or id(p) in seen:
                    continue  # tied weights are reduced once, under their first name
                seen.add(id(p))
                params.append(p)
                names.append(fqn)
                sparse.append(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse)
        return params, names, sparse

    def _module_states(self) -> list[torch.Tensor]:
        """The parameters, and the buffers unless ``broadcast_buffers=False``, that DDP keeps
        equal across ranks (less those listed to ignore)."""
        named: list[tuple[str, torch.Tensor]] = [*self.module.named_parameters()]
        if self.broadcast_buffers:
            named.extend(self.module.named_buffers())
        return [t for n, t in _unique_named(named) if n not in self.parameters_to_ignore]

    def _sync_module_states(self, src: int) -> None:
        broadcast_coalesced(self.process_group, self._module_states(), src)

    # -- forward -----------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        grad_enabled = torch.is_grad_enabled()
        sync_grads = grad_enabled and self.require_backward_grad_sync
        join_enabled = self._join_config.enable
        if sync_grads:
            self.reducer.prepare_for_forward()
        # every iteration counts as one under join, synchronising or not (no_sync): the joined
        # ranks shadow each one, and learn from the all-reduce below whether it synchronises
        work = Join.notify_join_context(self)
        if work is not None:
            self.reducer.set_forward_pass_work(work, self._divide_by_initial_world_size)
        if grad_enabled and self.reducer.rebuild_buckets():
            self._log.info("ddp_buckets_rebuilt", bucket_sizes=self.reducer.bucket_sizes())
        if self._will_sync_buffers():
            src = self._find_common_rank(self._rank, True) if join_enabled else 0
            self._sync_buffers(src)
        if join_enabled:
            self._check_global_requires_backward_grad_sync(is_joined_rank=False)
        if self.device_ids:
            inputs, kwargs = _to_device((inputs, kwargs), torch.device(self.device_type,
                                                                       self.device_ids[0]))
        output = self.module(*inputs, **kwargs)
        if sync_grads:
            self.require_forward_param_sync = True
            if self.find_unused_parameters and not self.static_graph:
                self.reducer.prepare_for_backward(list(_find_tensors(output)))
            else:
                self.reducer.prepare_for_backward([])
            if self.reducer.wants_backward_start():
                output = _route_through_sink(output, self.reducer)
        else:
            self.require_forward_param_sync = False
        return output

    def _will_sync_buffers(self) -> bool:
        return (self.require_forward_param_sync and self.broadcast_buffers
                and len(self._buffers_to_sync) > 0)

    def _sync_buffers(self, src: int) -> None:
        broadcast_coalesced(self.process_group, self._buffers_to_sync, src)

    def _find_common_rank(self, rank: int, candidate: bool) -> int:
        """The largest group rank among candidates (collective: all-reduce MAX)."""
        t = torch.tensor([rank if candidate else -1], device=self.device)
        self.process_group.all_reduce(t, ReduceOp.MAX).wait()
        if t.item() < 0:
            raise DistError(f"{self.process_group.where('join')} no rank qualified as the "
                            f"source of the model state")
        return int(t.item())

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool) -> bool:
        """Join: tell joined ranks whether this iteration's backward synchronises."""
        flag = 0.0 if is_joined_rank or not self.require_backward_grad_sync else 1.0
        t = torch.full((1,), flag, device=self.device)
        work = self.process_group.all_reduce(t)
        if not is_joined_rank:
            return bool(flag)  # the training ranks never need the answer
        work.wait()
        return t.item() != 0

    # -- no_sync / join ----------------------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward passes accumulate gradients locally without communicating; the first
        synchronising backward after the block averages the accumulated sums."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs: wrap the training loop in it on every rank.

        Ranks that run out of inputs keep shadowing the others' collectives (zero gradients)
        until all are done; then every rank takes the parameters of a rank that joined last.
        ``divide_by_initial_world_size=False`` averages over the ranks still training instead
        of the full world size.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> ProcessGroup:
        return self.process_group

    # -- comm hooks --------------------------------------------------------------------------------
    def register_comm_hook(self, state: Any, hook: CommHook | str) -> None:
        """Reduce gradient buckets with ``hook(state, bucket) -> torch.futures.Future`` (see
        :mod:`plugdist.parallel.comm_hooks`); ``hook`` may name a ``plugdist.comm_hooks`` entry
        point (``"allreduce"``, ``"fp16_compress"``, ...). Once, before the first backward."""
        if isinstance(hook, str):
            from plugdist._registry import registry

            name, resolved = hook, registry.load(COMM_HOOKS, hook)
        else:
            name, resolved = getattr(hook, "__qualname__", repr(hook)), hook
        _check_comm_hook(resolved)
        self.reducer.register_comm_hook(state, resolved)
        self._comm_hook = (state, resolved)
        self.logger.data["comm_hook"] = name

    # -- introspection -----------------------------------------------------------------------------
    def _replace_process_group(self, group: ProcessGroup, resync: bool) -> None:
        """Go on over ``group`` (the world after a shrink or a grow): a fresh reducer on it,
        with the comm hook registered again. ``resync``: first repeat what the constructor
        does collectively (the model check across ranks and the broadcast of rank 0's
        parameters and buffers), for the joiners whose constructors run it meanwhile."""
        self.reducer.close()
        old, self.process_group = self.process_group, group
        if self._comm_hook is not None and self._comm_hook[0] is old:
            self._comm_hook = (group, self._comm_hook[1])  # a hook whose state was the group
        self._rank = group.rank()
        reducer_cls, params, options = self._reducer_setup
        if resync:
            _, names, _ = self._params_for_reducer()
            verify_model_across_ranks(group, params, names,
                                      group.where("DistributedDataParallel"))
            self._sync_module_states(0)
        self.reducer = reducer_cls(params, group, options, self.logger)
        if self._comm_hook is not None:
            self.reducer.register_comm_hook(*self._comm_hook)

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """Construction parameters, bucket layout and averaged runtime stats (times in ns)."""
        data = self.logger.snapshot()
        data["bucket_sizes"] = self.reducer.bucket_sizes()
        return data

    def bucket_indices(self) -> list[list[int]]:
        """The reducer's current buckets as lists of parameter indices, in reduction order."""
        return self.reducer.bucket_indices()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a DistributedDataParallel model cannot be pickled (it holds a process "
                        "group); pickle or save .module (or its state_dict) instead")


class _DDPJoinHook(JoinHook):
    """What a rank that ran out of inputs does for the DDP model while others still train."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        # Same collectives, same order, as DistributedDataParallel.forward + backward.
        ddp = self.ddp
        ddp.reducer.rebuild_buckets()
        if ddp._will_sync_buffers():
            ddp._sync_buffers(ddp._find_common_rank(ddp._rank, False))
        should_sync = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)
        ddp.require_forward_param_sync = should_sync
        if not should_sync:
            return
        ddp.reducer.shadow_backward()
        ddp.reducer.push_all_rebuilt_params()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        ddp._sync_module_states(ddp._find_common_rank(ddp._rank, is_last_joiner))


# -- helpers ---------------------------------------------------------------------------------------
def _resolve_group(process_group: ProcessGroup | None) -> ProcessGroup:
    pg = resolve_group(process_group, "DistributedDataParallel")
    if pg is None:
        raise ValueError("DistributedDataParallel: this process is not a member of process_group")
    return pg


def _resolve_reducer(reducer: str | type[Reducer]) -> type[Reducer]:
    if isinstance(reducer, str):
        from plugdist._registry import registry

        reducer = registry.load(REDUCERS, reducer)
    if not (isinstance(reducer, type) and issubclass(reducer, Reducer)):
        raise TypeError(f"reducer must name a {REDUCERS} entry point or be a "
                        f"plugdist.parallel.Reducer subclass, got {reducer!r}")
    return reducer


def _check_comm_hook(hook: Any) -> None:
    if not callable(hook):
        raise TypeError(f"a communication hook must be callable, got {type(hook).__name__}")
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):
        return
    params = list(sig.parameters.values())
    if len(params) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TypeError(f"communication hook {hook!r} must take (state, bucket); its signature "
                        f"is {sig}")
    bucket = sig.parameters.get("bucket")
    if bucket is not None and bucket.annotation not in (inspect.Parameter.empty, GradBucket,
                                                        "GradBucket"):
        raise ValueError("communication hook: the bucket parameter's annotation must be "
                         "plugdist.parallel.GradBucket")
    if sig.return_annotation not in (inspect.Signature.empty, torch.futures.Future,
                                     "torch.futures.Future", torch._C.Future):
        raise ValueError("communication hook: the return annotation must be "
                         "torch.futures.Future")


def _unique_named(items: Any) -> list[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    out = []
    for name, t in items:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _device_index(device: int | torch.device | str) -> int:
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.index is None:
        raise ValueError(f"device {device!r} has no index; pass e.g. 0 or 'cuda:0'")
    return d.index


def _find_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj`` (nested lists, tuples, dicts, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _find_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _find_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _find_tensors(getattr(obj, f.name))


class _BackwardStartSink(torch.autograd.Function):
    """Pass-through node on the forward's outputs: its backward runs first in the outermost
    backward and tells the reducer that backward started."""

    @staticmethod
    def forward(ctx: Any, reducer: Reducer, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.reducer = reducer
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.reducer.on_backward_start()
        return (None, *grads)


def _route_through_sink(output: Any, reducer: Reducer) -> Any:
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(output)
    slots = [i for i, leaf in enumerate(leaves)
             if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    if not slots:
        return output
    passed = _BackwardStartSink.apply(reducer, *(leaves[i] for i in slots))
    for i, t in zip(slots, passed, strict=True):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_device(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    return obj
