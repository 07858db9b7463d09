"""The Reducer: the gradient-synchronisation engine under DistributedDataParallel.

:class:`Reducer` is what DDP needs from such an engine; :class:`BucketedReducer` (entry point
``plugdist.reducers: bucketed``) is the default one:

* parameters are grouped into buckets (one dtype and device each; a small first bucket, then
  ``bucket_cap_bytes``), in reverse registration order at first and, after the first
  iteration, once more in the order their gradients actually became ready (rank 0's order,
  broadcast, so every rank agrees); a parameter with a sparse gradient (an embedding built with
  ``sparse=True``) is a bucket of its own, whose gradient is divided and reduced with the
  sparse all_reduce and becomes the parameter's ``.grad``;
* a post-accumulate-grad hook on each parameter marks it ready and copies a large gradient into
  the bucket (divided by the world size on the way; small ones are copied together when their
  bucket is launched); once a bucket is full its all-reduce is launched asynchronously while
  backward goes on;
* a callback queued on the autograd engine at the end of backward waits for every bucket and
  writes the averaged gradients back into ``.grad`` (or leaves ``.grad`` as a view of the bucket
  with ``gradient_as_bucket_view``).

Threading: the hooks and the end-of-backward callback run on autograd's threads; every entry
point takes the reducer's lock. Every wait is bounded by the process group's timeout.
"""

from __future__ import annotations

import abc
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from plugdist._backend.work import Work
from plugdist._debug_level import DebugLevel, get_debug_level
from plugdist._log import get_logger
from plugdist.errors import DistError, DistTimeoutError, timed_out
from plugdist.parallel.bucketing import DEFAULT_FIRST_BUCKET_BYTES, compute_bucket_assignment
from plugdist.parallel.comm_hooks import CommHook, GradBucket
from plugdist.parallel.logging_data import DDPLogger

if TYPE_CHECKING:
    from plugdist._group.process_group import ProcessGroup

__all__ = ["Reducer", "ReducerOptions", "BucketedReducer"]


@dataclass(frozen=True)
class ReducerOptions:
    """How DDP asks a reducer to behave (the DDP constructor arguments that concern it)."""

    bucket_cap_bytes: int = 25 * 1024 * 1024
    first_bucket_cap_bytes: int = DEFAULT_FIRST_BUCKET_BYTES
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    param_names: Mapping[int, str] = field(default_factory=dict)  # index -> name, for messages
    # per parameter: its gradient is a sparse COO tensor (reduced in a bucket of its own)
    expect_sparse_gradients: tuple[bool, ...] = ()


class Reducer(abc.ABC):
    """What DistributedDataParallel needs from a gradient-synchronisation engine.

    Constructed once per DDP model as ``Reducer(parameters, process_group, options, logger)``
    after parameters were synchronised. Every method that runs collectives must be called by
    every rank of the group, in the same order; which ones do is stated per method.
    """

    def __init__(self, parameters: Sequence[torch.nn.Parameter], process_group: ProcessGroup,
                 options: ReducerOptions, logger: DDPLogger) -> None:
        self.parameters = list(parameters)
        self.process_group = process_group
        self.options = options
        self.logger = logger

    @abc.abstractmethod
    def prepare_for_forward(self) -> None:
        """A forward pass whose backward will synchronise gradients starts. Local."""

    @abc.abstractmethod
    def rebuild_buckets(self) -> bool:
        """Before a forward in grad mode: raise if the previous backward never finished its
        reduction (naming the parameters that got no gradient); then, once in a run, regroup
        the buckets. Returns True when it regrouped, which is collective (same iteration on
        every rank)."""

    @abc.abstractmethod
    def prepare_for_backward(self, outputs: Sequence[torch.Tensor]) -> None:
        """The next backward must synchronise. ``outputs`` are the forward's output tensors when
        unused parameters must be searched for, else empty. Local."""

    @abc.abstractmethod
    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` instead of the built-in average.
        Once, before the first backward."""

    @abc.abstractmethod
    def shadow_backward(self) -> None:
        """For a rank that ran out of inputs (join): issue, with zero gradients, every collective
        a synchronising backward issues on the other ranks, and wait for them. Collective."""

    @abc.abstractmethod
    def push_all_rebuilt_params(self) -> None:
        """For a joined rank that never ran a backward: record a bucket order so that it regroups
        its buckets in step with the other ranks. Local."""

    def set_forward_pass_work(self, work: Work, use_static_world_size: bool) -> None:  # noqa: B027 - no-op default
        """Join support: ``work`` all-reduces the number of ranks still training this iteration;
        unless ``use_static_world_size``, gradients are averaged over that number."""

    def wants_backward_start(self) -> bool:
        """Whether the coming backward should call :meth:`on_backward_start` (DDP then routes
        the forward's outputs through a pass-through autograd node). Local."""
        return False

    def on_backward_start(self) -> None:  # noqa: B027 - no-op default
        """Called by autograd when the backward reaches the forward's outputs, before any
        parameter gradient: the place to queue end-of-backward callbacks on the outermost
        backward. Local."""

    def bucket_indices(self) -> list[list[int]]:
        """Parameter indices of each bucket, in reduction order."""
        return []

    def bucket_sizes(self) -> list[int]:
        """Bytes of each bucket, in reduction order."""
        return []

    def close(self) -> None:  # noqa: B027 - no-op default
        """Remove hooks; the reducer does nothing afterwards. Idempotent."""


# Gradients of at least this many elements are copied into their bucket (and divided on the
# way) by their own hook, while still hot in cache; smaller ones are copied together when the
# bucket is launched, with two foreach calls instead of a dispatch each.
_FUSED_COPY_NUMEL = 32768


class _Bucket:
    __slots__ = ("index", "indices", "params", "offsets", "buffer", "views", "pending", "work",
                 "future", "deferred", "sparse", "reduced")

    def __init__(self, index: int, indices: list[int], params: Sequence[torch.Tensor],
                 offsets: list[int], buffer: torch.Tensor, views: list[torch.Tensor],
                 fused: list[bool], sparse: bool = False) -> None:
        self.index = index
        self.indices = indices
        self.params = list(params)
        self.offsets = offsets
        self.buffer = buffer
        self.views = views
        self.pending = len(indices)
        self.work: Work | None = None
        self.future: torch.futures.Future | None = None
        self.deferred = [] if sparse else [
            (p, v) for p, v, f in zip(params, views, fused, strict=True) if not f]
        # a sparse bucket has no flat buffer (``buffer`` is empty): it reduces its one
        # parameter's gradient, ``reduced``, itself
        self.sparse = sparse
        self.reduced: torch.Tensor | None = None


def _view_like(buffer: torch.Tensor, param: torch.Tensor, offset: int) -> torch.Tensor:
    # Match the parameter's layout where it is dense, as AccumulateGrad does for its grads,
    # so copies in and out of the bucket stay sequential.
    if not param.is_contiguous() and _dense(param):
        return buffer.as_strided(param.size(), param.stride(), offset)
    return buffer.narrow(0, offset, param.numel()).view(param.size())


def _dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill its memory exactly, in some order of dimensions."""
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d))):
        if t.size(d) == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return t.numel() > 0


def _aliases(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape


class BucketedReducer(Reducer):
    """The default reducer: bucketed, overlapped with backward. See the module docstring."""

    def __init__(self, parameters: Sequence[torch.nn.Parameter], process_group: ProcessGroup,
                 options: ReducerOptions, logger: DDPLogger) -> None:
        super().__init__(parameters, process_group, options, logger)
        n = len(self.parameters)
        self._lock = threading.RLock()
        self._rank = process_group.rank()
        self._world_size = process_group.size()
        self._timeout = process_group.timeout.total_seconds()
        # the reducer's own bookkeeping collectives (which parameters were used, the bucket
        # order) run where the gradients live: a CUDA-only backend refuses CPU tensors
        self._device = self.parameters[0].device if self.parameters else torch.device("cpu")
        self._find_unused = options.find_unused_parameters
        self._static = options.static_graph
        self._as_view = options.gradient_as_bucket_view
        cap = max(1, int(options.bucket_cap_bytes))
        self._size_limits = [min(max(1, int(options.first_bucket_cap_bytes)), cap), cap]
        self._log = get_logger(rank=self._rank, group=process_group.group_name)

        self._comm_hook: CommHook | None = None
        self._comm_hook_state: Any = None
        self._iterations = 0              # backward passes prepared so far
        self._expect_hooks = False
        self._require_finalize = False
        self._ready = bytearray(n)        # marked ready in this iteration
        self._next_bucket = 0
        self._div_factor: int | None = None
        self._forward_work: tuple[Work, bool] | None = None
        self._finalize_queued = False

        # unused-parameter accounting
        self._unused: list[int] = []
        self._marked_unused = False
        self._local_used = bytearray(n)
        self._local_used_work: Work | None = None
        self._local_used_tensor: torch.Tensor | None = None
        self._global_used: list[int] | None = None  # static graph: fixed after iteration 1
        self._hook_counts = [0] * n                   # static graph: hooks per param, iteration 1
        self._hook_counts_left = [0] * n

        # bucket regrouping
        self._has_rebuilt = False
        self._rebuilt_order: list[int] = []

        self._buckets: list[_Bucket] = []
        self._locators: list[tuple[_Bucket, torch.Tensor]] = []
        self._sparse = [bool(s) for s in options.expect_sparse_gradients] + [False] * (
            n - len(options.expect_sparse_gradients))
        self._fused = [p.numel() >= _FUSED_COPY_NUMEL and not sparse
                       for p, sparse in zip(self.parameters, self._sparse, strict=True)]
        self._init_buckets(compute_bucket_assignment(
            self.parameters, list(range(n - 1, -1, -1)), self._size_limits, self._sparse))

        self._handles: list[Any] = []
        self_ref = weakref.ref(self)
        for index, param in enumerate(self.parameters):
            self._handles.append(param.register_post_accumulate_grad_hook(
                _make_hook(self_ref, index)))

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        self._expect_hooks = False

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- buckets -----------------------------------------------------------------------------------
    def _init_buckets(self, assignment: list[list[int]]) -> None:
        buckets: list[_Bucket] = []
        locators: list[tuple[_Bucket, torch.Tensor] | None] = [None] * len(self.parameters)
        for bucket_index, indices in enumerate(assignment):
            params = [self.parameters[i] for i in indices]
            first = params[0]
            for p in params:
                if p.dtype != first.dtype or p.device != first.device:
                    raise DistError(f"{self._where()} bucket {bucket_index} mixes "
                                    f"{first.dtype}/{first.device} and {p.dtype}/{p.device}; "
                                    f"a bucket holds one dtype on one device")
            sparse = self._sparse[indices[0]]
            if sparse and len(indices) > 1:
                raise DistError(f"{self._where()} bucket {bucket_index} puts a parameter with a "
                                f"sparse gradient among others; it needs a bucket of its own")
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += 0 if sparse else p.numel()
            buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
            views = [buffer if sparse else _view_like(buffer, p, o)
                     for p, o in zip(params, offsets, strict=True)]
            bucket = _Bucket(bucket_index, list(indices), params, offsets, buffer, views,
                             [self._fused[i] for i in indices], sparse)
            for i, view in zip(indices, views, strict=True):
                locators[i] = (bucket, view)
                p = self.parameters[i]
                if (self._as_view and not sparse and p.grad is not None
                        and not _aliases(p.grad, view)):
                    # Regrouping after grads exist: keep them, now living in the new bucket.
                    view.copy_(p.grad)
                    p.grad = view
            buckets.append(bucket)
        missing = [i for i, loc in enumerate(locators) if loc is None]
        if missing:
            raise DistError(f"{self._where()} bucket assignment leaves parameters {missing} out")
        self._buckets = buckets
        self._locators = locators  # type: ignore[assignment]

    def bucket_indices(self) -> list[list[int]]:
        return [list(b.indices) for b in self._buckets]

    def bucket_buffers(self) -> list[torch.Tensor]:
        """The flat gradient buffer of each bucket, in reduction order (with
        ``gradient_as_bucket_view`` the parameters' ``.grad`` are views of these)."""
        return [b.buffer for b in self._buckets]

    def bucket_sizes(self) -> list[int]:
        """Bytes of each bucket, in reduction order."""
        return [b.buffer.numel() * b.buffer.element_size() for b in self._buckets]

    @property
    def has_rebuilt_buckets(self) -> bool:
        return self._has_rebuilt

    # -- per-iteration entry points (DDP side) -----------------------------------------------------
    def prepare_for_forward(self) -> None:
        self.logger.forward_start()

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor]) -> None:
        with self._lock:
            self.logger.forward_end()
            self.logger.backward_start()
            self._iterations += 1
            self._expect_hooks = True
            self._require_finalize = False
            self._finalize_queued = False
            self._next_bucket = 0
            for b in self._buckets:
                b.pending = len(b.indices)
                b.work = b.future = None
            self._ready = bytearray(len(self.parameters))
            self._marked_unused = False
            if self._static and self._iterations > 1:
                self._hook_counts_left = list(self._hook_counts)
            if self._dynamic_find_unused():
                # _local_used is not reset here: it still holds the no_sync backwards' uses
                # (it is cleared when a synchronised backward finishes)
                self._unused = self._search_unused(outputs)

    def set_forward_pass_work(self, work: Work, use_static_world_size: bool) -> None:
        with self._lock:
            self._forward_work = (work, use_static_world_size)

    def wants_backward_start(self) -> bool:
        return self._static_first_iteration() and self._expect_hooks

    def on_backward_start(self) -> None:
        # Queued from the outermost backward, so that it also runs after any reentrant
        # backward (activation checkpointing) nested inside it.
        with self._lock:
            if self._static_first_iteration() and self._expect_hooks and not self._finalize_queued:
                self._finalize_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(
                    self._delayed_reduce_callback)

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        with self._lock:
            if self._comm_hook is not None:
                raise RuntimeError(f"{self._where()} register_comm_hook can only be called once "
                                   f"per DDP model (a {self._hook_name()} hook is registered)")
            if self._iterations:
                raise RuntimeError(f"{self._where()} register a comm hook before the first "
                                   f"backward pass")
            self._comm_hook, self._comm_hook_state = hook, state

    def _hook_name(self) -> str:
        return getattr(self._comm_hook, "__qualname__", repr(self._comm_hook))

    # -- unused parameters -------------------------------------------------------------------------
    def _dynamic_find_unused(self) -> bool:
        return self._find_unused and not self._static

    def _static_first_iteration(self) -> bool:
        return self._static and self._iterations == 1

    def _tracks_used(self) -> bool:
        """Whether this iteration records which parameters got gradients (and all-reduces it)."""
        return self._dynamic_find_unused() or self._static_first_iteration()

    def _should_rebuild(self) -> bool:
        return not self._has_rebuilt and (self._static or not self._find_unused)

    def _search_unused(self, outputs: Sequence[torch.Tensor]) -> list[int]:
        """Indices of parameters whose AccumulateGrad node the outputs' graph does not reach."""
        index_of = {id(p): i for i, p in enumerate(self.parameters)}
        used: set[int] = set()
        seen: set[Any] = set()
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        seen.update(stack)
        for t in outputs:
            if t.grad_fn is None and t.requires_grad and id(t) in index_of:
                used.add(index_of[id(t)])  # a parameter returned as is
        while stack:
            node = stack.pop()
            variable = getattr(node, "variable", None)
            if variable is not None:
                i = index_of.get(id(variable))
                if i is not None:
                    used.add(i)
            for nxt, _ in node.next_functions:
                if nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        unused = [i for i in range(len(self.parameters)) if i not in used]
        if not unused:
            warnings.warn("find_unused_parameters=True was passed to DistributedDataParallel, but "
                          "this forward pass used every parameter; the graph walk it costs every "
                          "iteration is wasted unless other iterations leave parameters unused. "
                          "If none ever do, drop the flag.", RuntimeWarning, stacklevel=4)
        elif get_debug_level() is DebugLevel.DETAIL:
            self._log.info("ddp_unused_parameters", names=[self._name(i) for i in unused])
        return unused

    # -- autograd side -----------------------------------------------------------------------------
    def _on_grad_ready(self, index: int) -> None:
        """Runs in autograd after ``.grad`` of parameter ``index`` was accumulated."""
        with self._lock:
            # Marked even outside a synchronising backward: a parameter used in any no_sync
            # backward since the last reduction counts as used, so its accumulated gradient
            # is averaged, not left local.
            if self._tracks_used() and self.parameters[index].grad is not None:
                self._local_used[index] = 1
            if not self._expect_hooks:
                return  # no_sync, or a backward DDP's forward did not prepare
            static_first = self._static_first_iteration()
            if static_first:
                # The graph is learned in the first iteration; everything is reduced at its end
                # (normally queued by on_backward_start; here if the outputs bypassed DDP).
                self._hook_counts[index] += 1
                if not self._finalize_queued:
                    self.on_backward_start()
                return
            if not self._marked_unused:
                self._marked_unused = True
                for u in self._unused:
                    self._mark_ready(u)
            if self._static:
                left = self._hook_counts_left[index]
                if left <= 0:
                    raise RuntimeError(
                        f"{self._where()} parameter {self._describe(index)} got a gradient in this "
                        f"iteration but none in the first one: the training graph changed, which "
                        f"static_graph=True does not allow; drop static_graph")
                self._hook_counts_left[index] = left - 1
                if left > 1:
                    return
            if self._should_rebuild():
                self._rebuilt_order.append(index)
            self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        if self._ready[index]:
            self._raise_marked_twice(index)
        self._ready[index] = 1
        self._require_finalize = True
        if self._fused[index]:
            self._copy_grad_in(index)
        bucket = self._locators[index][0]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()
        if self._next_bucket == len(self._buckets) and not self._finalize_queued:
            self._finalize_queued = True
            self._launch_local_used_reduction()
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_callback)

    @staticmethod
    def _copy_source(param: torch.Tensor, view: torch.Tensor) -> torch.Tensor | None:
        """What to copy into ``view`` for ``param``'s gradient: None if it has none (``view`` is
        zeroed instead), ``view`` itself if the gradient already is that view, else the gradient
        (detached, with a warning, if it requires grad: create_graph=True)."""
        grad = param.grad
        if grad is None:
            view.zero_()
            return None
        if grad.layout is not torch.strided:
            raise RuntimeError(f"a parameter of shape {list(param.shape)} got a {grad.layout} "
                               f"gradient where DistributedDataParallel expected a dense one; "
                               f"only the weights of Embedding/EmbeddingBag(sparse=True) may "
                               f"have sparse gradients")
        if _aliases(grad, view):
            return view
        if grad.requires_grad:
            _warn_create_graph()
            grad = grad.detach()
        return grad

    def _copy_grad_in(self, index: int) -> None:
        """Copy one (large) gradient into its bucket view, averaging on the way."""
        param = self.parameters[index]
        view = self._locators[index][1]
        divide = self._comm_hook is None and self._divisor() != 1
        grad = self._copy_source(param, view)
        if grad is view:
            if divide:
                view.div_(self._div_factor)  # type: ignore[arg-type]
        elif grad is not None:
            if divide:
                # multiplying by the reciprocal is cheaper than dividing, and exact for the
                # power-of-two world sizes that are the common case
                torch.mul(grad, 1.0 / self._div_factor, out=view)  # type: ignore[operator]
            else:
                view.copy_(grad)
            if self._as_view:
                param.grad = view

    def _copy_deferred_in(self, bucket: _Bucket) -> None:
        """Copy the bucket's small gradients in, all at once, just before it is reduced."""
        if not bucket.deferred:
            return
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        in_place: list[torch.Tensor] = []
        for param, view in bucket.deferred:
            grad = self._copy_source(param, view)
            if grad is view:
                in_place.append(view)
            elif grad is not None:
                dst.append(view)
                src.append(grad)
                if self._as_view:
                    param.grad = view
        if dst:
            torch._foreach_copy_(dst, src)
        if self._comm_hook is None and self._divisor() != 1 and (dst or in_place):
            torch._foreach_div_(dst + in_place, self._div_factor)  # type: ignore[arg-type]

    def _divisor(self) -> int:
        if self._div_factor is None:
            factor = self._world_size
            if self._forward_work is not None:
                work, static = self._forward_work
                self._forward_work = None
                if not static:
                    result = work.result()
                    if isinstance(result, (list, tuple)):
                        result = result[0]
                    factor = int(result.item())
            self._div_factor = max(1, factor)
        return self._div_factor

    def _launch_ready_buckets(self) -> None:
        # Buckets are reduced strictly in order so that every rank issues the same sequence.
        buckets = self._buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            bucket = buckets[self._next_bucket]
            self._copy_deferred_in(bucket)
            self.logger.comm_start()
            self._launch(bucket, self._sparse_grad(bucket) if bucket.sparse else bucket.buffer)
            self._next_bucket += 1

    def _sparse_grad(self, bucket: _Bucket, zero: bool = False) -> torch.Tensor:
        """What a sparse bucket reduces: its parameter's gradient divided by the world size
        (without a comm hook), an empty one if it has none (or ``zero``, for join)."""
        index = bucket.indices[0]
        param = self.parameters[index]
        grad = None if zero else param.grad
        if grad is None:
            return torch.sparse_coo_tensor(
                torch.empty((1, 0), dtype=torch.int64, device=param.device),
                param.new_empty((0, *param.shape[1:])), param.shape)
        if grad.layout is not torch.sparse_coo:
            raise RuntimeError(f"{self._where()} {self._describe(index)} got a {grad.layout} "
                               f"gradient; DistributedDataParallel expected a sparse one, as its "
                               f"module was built with sparse=True")
        grad = grad.detach()
        if self._comm_hook is None and self._divisor() != 1:
            grad = grad / self._div_factor  # type: ignore[operator]
        return grad

    def _launch(self, bucket: _Bucket, buffer: torch.Tensor) -> None:
        if bucket.sparse:
            bucket.reduced = buffer
        if self._comm_hook is None:
            bucket.work = self.process_group.all_reduce(buffer)
            return
        grad_bucket = GradBucket(bucket.index, len(self._buckets), buffer, bucket.params,
                                 bucket.offsets, self.process_group)
        fut = self._comm_hook(self._comm_hook_state, grad_bucket)
        if not isinstance(fut, torch._C.Future):  # torch.futures.Future and what .then() makes
            raise TypeError(f"{self._where()} comm hook {self._hook_name()} returned "
                            f"{type(fut).__name__}; it must return a torch.futures.Future whose "
                            f"value is the reduced bucket tensor")
        bucket.future = fut

    def _launch_local_used_reduction(self) -> None:
        if not self._tracks_used():
            return
        used = torch.frombuffer(self._local_used, dtype=torch.uint8)
        # int32: a sum over ranks outgrows uint8
        self._local_used_tensor = used.to(device=self._device, dtype=torch.int32)
        self._local_used_work = self.process_group.all_reduce(self._local_used_tensor)

    def _delayed_reduce_callback(self) -> None:
        """Static graph, first iteration: reduce everything once backward is over."""
        with self._lock:
            self.logger.backward_compute_end()
            self._unused = [i for i, c in enumerate(self._hook_counts) if c == 0]
            if self._unused and get_debug_level() >= DebugLevel.INFO:
                self._log.info("ddp_static_graph_unused",
                               names=[self._name(i) for i in self._unused],
                               note="expected to stay unused for the rest of training")
            for index in range(len(self.parameters)):
                self._ready[index] = 1
                if self._fused[index]:
                    self._copy_grad_in(index)
            self._require_finalize = True
            for bucket in self._buckets:
                bucket.pending = 0
            self._launch_ready_buckets()
            # same collective order as every other iteration (and as a joined rank's shadow)
            self._launch_local_used_reduction()
            self._finalize_backward()

    def _finalize_callback(self) -> None:
        with self._lock:
            self.logger.backward_compute_end()
            if self._static and self._iterations > 1 and self._should_rebuild():
                self._rebuilt_order.extend(self._unused)
            self._finalize_backward()

    def _finalize_backward(self) -> None:
        self._expect_hooks = False
        self._require_finalize = False
        used = self._wait_global_used()
        for bucket in self._buckets:
            result = self._wait_bucket(bucket)
            if bucket.sparse:
                index = bucket.indices[0]
                if used is None or used[index]:
                    self.parameters[index].grad = result
                bucket.reduced = None
                continue
            if result is not bucket.buffer:
                if result.numel() != bucket.buffer.numel():
                    raise RuntimeError(
                        f"{self._where()} comm hook {self._hook_name()} returned a tensor of "
                        f"{result.numel()} elements for bucket {bucket.index}, which has "
                        f"{bucket.buffer.numel()}; return the reduced bucket buffer")
                bucket.buffer.copy_(result.reshape(-1))
            dst: list[torch.Tensor] = []
            src: list[torch.Tensor] = []
            for index, view in zip(bucket.indices, bucket.views, strict=True):
                if used is not None and not used[index]:
                    continue  # unused on every rank: leave .grad alone
                param = self.parameters[index]
                grad = param.grad
                if self._as_view:
                    if grad is None:
                        param.grad = view
                    elif not _aliases(grad, view):
                        raise RuntimeError(
                            f"{self._where()} the gradient of {self._describe(index)} is not the "
                            f"bucket view that gradient_as_bucket_view=True makes it; was .grad "
                            f"replaced during backward, or a second reducer hooked the same "
                            f"parameter?")
                elif grad is None:
                    param.grad = view.clone()
                else:
                    dst.append(grad)
                    src.append(view)
            if dst:
                torch._foreach_copy_(dst, src)
        self._div_factor = None
        if self._dynamic_find_unused():
            self._local_used = bytearray(len(self.parameters))
        self.logger.data["unused_parameter_size"] = sum(
            self.parameters[i].numel() * self.parameters[i].element_size() for i in self._unused)
        self.logger.comm_end()

    def _wait_global_used(self) -> list[int] | bytearray | None:
        if self._local_used_work is not None:
            self._local_used_work.wait()
            self._global_used = self._local_used_tensor.tolist()  # type: ignore[union-attr]
            self._local_used_work = self._local_used_tensor = None
            return self._global_used
        if self._static:
            return self._global_used
        return None

    def _wait_bucket(self, bucket: _Bucket) -> torch.Tensor:
        if bucket.work is not None:
            bucket.work.wait()
            return bucket.reduced if bucket.reduced is not None else bucket.buffer
        fut = bucket.future
        if fut is None:
            raise DistError(f"{self._where()} bucket {bucket.index} was never reduced")
        value = _wait_future(fut, self._timeout, f"{self._where()} comm hook "
                                                 f"{self._hook_name()} for bucket {bucket.index}")
        if isinstance(value, (list, tuple)):
            value = value[0] if len(value) == 1 else None
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{self._where()} comm hook {self._hook_name()}'s future holds "
                            f"{type(value).__name__}; it must hold the reduced bucket tensor")
        return value

    # -- between iterations ------------------------------------------------------------------------
    def rebuild_buckets(self) -> bool:
        with self._lock:
            self._ensure_prior_reduction_finished()
            if not self._should_rebuild() or not self._rebuilt_order:
                return False
            order = self._rebuilt_order
            if sorted(order) != list(range(len(self.parameters))):
                raise DistError(f"{self._where()} the recorded gradient order covers "
                                f"{len(set(order))} of {len(self.parameters)} parameters; cannot "
                                f"regroup buckets")
            assignment = compute_bucket_assignment(self.parameters, order, self._size_limits,
                                                   self._sparse)
            assignment = self._agree_on_assignment(assignment)
            self._has_rebuilt = True
            self._rebuilt_order = []
            self._init_buckets(assignment)
            self.logger.data["has_rebuilt_buckets"] = 1
            self.logger.data["rebuilt_bucket_sizes"] = self.bucket_sizes()
            self.logger.data["rebuilt_per_bucket_size_limits"] = list(self._size_limits)
            if get_debug_level() >= DebugLevel.INFO:
                self._log.info("ddp_buckets_rebuilt", buckets=len(assignment),
                               size_limits=self._size_limits)
            return True

    def _agree_on_assignment(self, assignment: list[list[int]]) -> list[list[int]]:
        """Rank 0's bucket assignment, on every rank (one broadcast)."""
        n = len(self.parameters)
        if self._world_size == 1:
            return assignment
        flat = torch.empty(2 * n, dtype=torch.int64, device=self._device)
        if self._rank == 0:
            order = [i for members in assignment for i in members]
            ids = [b for b, members in enumerate(assignment) for _ in members]
            flat.copy_(torch.tensor(order + ids, dtype=torch.int64, device=self._device))
        self.process_group.broadcast(flat, 0).wait()
        values = flat.tolist()
        result: list[list[int]] = []
        for index, bucket_id in zip(values[:n], values[n:], strict=True):
            if bucket_id == len(result):
                result.append([])
            result[bucket_id].append(index)
        return result

    def push_all_rebuilt_params(self) -> None:
        with self._lock:
            # the training ranks record their order in their first synchronising iteration
            # (the second with static_graph, whose first one only learns the graph)
            recorded_now = self._iterations >= (2 if self._static else 1)
            if self._should_rebuild() and not self._rebuilt_order and recorded_now:
                self._rebuilt_order = list(range(len(self.parameters) - 1, -1, -1))

    def _ensure_prior_reduction_finished(self) -> None:
        if not self._require_finalize:
            return
        unmarked = [i for i in range(len(self.parameters)) if not self._ready[i]]
        if self._static:
            what = ("the training graph changed in this iteration (a parameter that got a "
                    "gradient in the first iteration got none now), which static_graph=True "
                    "does not allow. ")
        elif not self._find_unused:
            what = ("your module has parameters that were not used in producing the loss. "
                    "Pass find_unused_parameters=True to DistributedDataParallel to have "
                    "unused parameters detected, and make sure every output of forward "
                    "takes part in computing the loss. ")
        else:
            what = ("with find_unused_parameters=True this usually means that not every output "
                    "of forward took part in computing the loss; make sure it does (or detach "
                    "outputs you do not use). ")
        msg = (f"{self._where()} expected the previous iteration's gradient reduction to have "
               f"finished before a new forward pass: {what}")
        if get_debug_level() >= DebugLevel.INFO:
            names = ", ".join(self._name(i) for i in unmarked)
            msg += f"\nParameters that did not receive a gradient on rank {self._rank}: {names}"
        msg += (f"\nParameter indices that did not receive a gradient on rank {self._rank}: "
                f"{unmarked}")
        if get_debug_level() is DebugLevel.OFF:
            msg += ("\nSet TORCH_DISTRIBUTED_DEBUG=INFO (or DETAIL) to see the names of these "
                    "parameters in this error.")
        raise RuntimeError(msg)

    # -- join --------------------------------------------------------------------------------------
    def shadow_backward(self) -> None:
        with self._lock:
            # counted like a real iteration, so that the static-graph and regrouping decisions
            # below happen in the same iteration as on the ranks still training
            self._iterations += 1
            for bucket in self._buckets:
                bucket.work = bucket.future = None
                self._launch(bucket, self._sparse_grad(bucket, zero=True) if bucket.sparse
                             else torch.zeros_like(bucket.buffer))
            used_work = None
            if self._tracks_used():
                used_work = self.process_group.all_reduce(
                    torch.zeros(len(self.parameters), dtype=torch.int32, device=self._device))
            for bucket in self._buckets:
                self._wait_bucket(bucket)
                bucket.work = bucket.future = bucket.reduced = None
            if used_work is not None:
                used_work.wait()

    # -- messages ----------------------------------------------------------------------------------
    def _where(self) -> str:
        return self.process_group.where("DistributedDataParallel")

    def _name(self, index: int) -> str:
        return self.options.param_names.get(index, f"parameters[{index}]")

    def _describe(self, index: int) -> str:
        name = self.options.param_names.get(index)
        return f"{name!r} (index {index})" if name else f"index {index}"

    def _raise_marked_twice(self, index: int) -> None:
        msg = (f"{self._where()} parameter {self._describe(index)} got its gradient twice in one "
               f"backward pass. Common causes: (1) the parameter is used outside forward, or by "
               f"several forward/backward passes running at the same time; (2) the same part of "
               f"the model is re-run by several reentrant backward passes (e.g. several "
               f"checkpoint() calls over the same layers). If the graph does not change between "
               f"iterations, static_graph=True supports these cases.")
        if self._marked_unused and index in self._unused:
            msg += (" Here the forward pass's outputs did not reach this parameter, so it was "
                    "treated as unused, yet a gradient arrived later (e.g. from a reentrant "
                    "backward): if every parameter takes part, pass find_unused_parameters=False.")
        raise RuntimeError(msg)


def _make_hook(reducer_ref: weakref.ReferenceType[BucketedReducer],
               index: int) -> Callable[[torch.Tensor], None]:
    def hook(_param: torch.Tensor) -> None:
        reducer = reducer_ref()
        if reducer is not None:
            reducer._on_grad_ready(index)
    return hook


def _wait_future(fut: torch.futures.Future, timeout: float, what: str) -> Any:
    """``fut.value()``, waiting at most ``timeout`` seconds (torch futures have no timed wait)."""
    if not fut.done():
        done = threading.Event()
        fut.then(lambda _f: done.set())  # .then exists on every torch future type
        if not done.wait(timeout):
            raise DistTimeoutError(f"{timed_out(what, timeout)}: a peer may have died or be "
                                   f"running a different collective")
    return fut.value()


_warned_create_graph = False


def _warn_create_graph() -> None:
    global _warned_create_graph
    if not _warned_create_graph:
        _warned_create_graph = True
        warnings.warn("DistributedDataParallel with create_graph=True: gradients are averaged "
                      "across ranks, but higher-order gradients are not synchronised and do not "
                      "flow through the all-reduce", RuntimeWarning, stacklevel=3)
