"""SyncBatchNorm: batch normalization whose batch statistics span a process group.

In training mode each forward gathers every rank's per-channel (mean, sum of squared deviations,
count) with one ``all_gather_into_tensor`` and combines them, so ranks may hold batches of
different sizes, an empty one included; each backward all-reduces the two per-channel sums the
input gradient needs. Both go through plugdist's public collectives on the module's group, so
they run on every backend (composed from send/recv where a backend has nothing better), on CPU
and CUDA tensors alike (the statistics are staged through a device the backend handles when it
does not handle the input's). Weight and bias gradients stay per-rank sums, for DDP to reduce.

Collective contract: every rank of the group runs each training-mode forward and its backward,
in the same order (a rank whose batch is empty too). Waits are bounded by the group's timeout.
Eval mode, ``world size 1`` and a process without an initialized world communicate nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's spelling
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm, _LazyNormBase

from plugdist._backend.reduce_op import ReduceOp
from plugdist._group.process_group import ProcessGroup
from plugdist._world import collectives
from plugdist._world.groups import GroupMember, is_initialized, resolve_group
from plugdist.errors import DistError, where

__all__ = ["SyncBatchNorm", "AdoptedTorchSyncBatchNorm", "adopt_torch_sync_batchnorms"]

_OP = "SyncBatchNorm"


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.SyncBatchNorm`` over a plugdist group, on any backend and on CPU or CUDA.

    Arguments as torch's; ``process_group`` is a plugdist group from ``plugdist.new_group``
    (None: the default group at the time of each forward). Input is ``(N, C, *)``. A process
    that is not a member of ``process_group`` normalizes over its own batch.

    Not a subclass of ``torch.nn.SyncBatchNorm``, on purpose: torch's DDP refuses any instance
    of that class on CPU, and this one is meant to run under torch's DDP over a plugdist backend
    too. Its state dict is the same as torch's, so checkpoints load either way.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: ProcessGroup | None = None, device: Any = None,
                 dtype: Any = None, *, bias: bool = True) -> None:
        # only pass bias= when it matters: older torch (2.3) has no such argument
        extra = {} if bias else {"bias": False}
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype, **extra)
        _check_group_argument(process_group)
        self.process_group = process_group

    def __deepcopy__(self, memo: dict[int, Any]) -> SyncBatchNorm:
        # a group is a handle on live communicators (or the non-member marker, compared by
        # identity): a copy of the layer shares it, as copies of a model share the world
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        if self.process_group is not None:
            memo[id(self.process_group)] = self.process_group
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"{self._where()} expected input of shape (N, C, *) with at least 2 dimensions, "
                f"got a {input.dim()}-D tensor of shape {tuple(input.shape)}; add the batch "
                f"dimension (input.unsqueeze(0) for a single sample of {self.num_features} "
                f"channels)")

    def _check_input(self, input: torch.Tensor) -> None:
        self._check_input_dim(input)
        if input.size(1) != self.num_features:
            raise ValueError(
                f"{self._where()} expected {self.num_features} channels in dimension 1 of the "
                f"input, got shape {tuple(input.shape)}; build the layer with "
                f"num_features={input.size(1)}, or move the channels to dimension 1 "
                f"(e.g. input.movedim(-1, 1) for channels-last data)")
        if not input.is_floating_point():
            raise TypeError(f"{self._where()} expected a floating-point input, got {input.dtype}; "
                            f"convert it first, e.g. input.float()")

    def _where(self) -> str:
        pg = self._member_group()
        return pg.where(_OP) if pg is not None else where(op=_OP)

    def _member_group(self) -> ProcessGroup | None:
        """The group this module synchronises over; None when there is none to use (no world,
        or this process is not a member)."""
        if self.process_group is None and not is_initialized():
            return None
        return resolve_group(self.process_group, _OP)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked.item())
        use_batch_stats = self.training or (self.running_mean is None
                                            and self.running_var is None)
        # the buffers are updated only while training with tracking on; read when evaluating
        update = not self.training or self.track_running_stats
        running_mean = self.running_mean if update else None
        running_var = self.running_var if update else None

        pg = self._member_group() if self.training else None
        if pg is None or pg.size() == 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                use_batch_stats, factor, self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                            running_var, self.eps, factor, pg)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module,
                               process_group: ProcessGroup | None = None) -> nn.Module:
        """Replace every ``BatchNorm*d`` (any ``_BatchNorm``) inside ``module`` by this class.

        The new layers share the old ones' parameters and buffers (the same tensors) and
        training flag; each synchronises over ``process_group`` (None: the default group).
        Returns ``module`` itself, or the new layer when ``module`` is a batch norm. Local: no
        communication.
        """
        _check_group_argument(process_group)
        converted = module
        if isinstance(module, _BatchNorm):
            if isinstance(module, _LazyNormBase) and module.has_uninitialized_params():
                raise ValueError(
                    f"convert_sync_batchnorm: {type(module).__name__} has not inferred its "
                    f"number of features yet; run one forward pass first, then convert")
            converted = cls._like(module, process_group)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted

    @classmethod
    def _like(cls, bn: _BatchNorm, process_group: ProcessGroup | None) -> SyncBatchNorm:
        sample = next((t for t in (bn.weight, bn.running_mean) if t is not None), None)
        factory: dict[str, Any] = ({} if sample is None else
                                   {"device": sample.device, "dtype": sample.dtype})
        has_bias = bn.bias is not None or not bn.affine  # bias= matters only when affine
        new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                  process_group, bias=has_bias, **factory)
        if bn.affine:
            new.weight = bn.weight
            new.bias = bn.bias
        new.running_mean = bn.running_mean
        new.running_var = bn.running_var
        new.num_batches_tracked = bn.num_batches_tracked
        new.train(bn.training)
        if hasattr(bn, "qconfig"):
            new.qconfig = bn.qconfig
        return new


class AdoptedTorchSyncBatchNorm(SyncBatchNorm, nn.SyncBatchNorm):
    """A ``torch.nn.SyncBatchNorm`` that plugdist's DDP made synchronise over plugdist: the same
    object, still an instance of torch's class, with this package's forward."""


def adopt_torch_sync_batchnorms(module: nn.Module, context: str) -> list[str]:
    """Make every ``torch.nn.SyncBatchNorm`` inside ``module`` synchronise over plugdist, in place.

    Each such layer keeps its identity, parameters, buffers and hooks; only its class changes,
    to a subclass of both torch's and plugdist's SyncBatchNorm. Returns the names of the layers
    changed. Raises ``TypeError`` (naming the layer and the fix) for a subclass of torch's class,
    whose own behaviour this would drop, or a ``process_group`` that is not a plugdist group.
    Local: no communication. ``context`` prefixes error messages.
    """
    found = [(name, layer) for name, layer in module.named_modules()
             if isinstance(layer, nn.SyncBatchNorm) and not isinstance(layer, SyncBatchNorm)]
    fix = ("convert the model before wrapping it: "
           "model = plugdist.nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group)")
    for name, layer in found:  # all checked before any is changed
        if type(layer) is not nn.SyncBatchNorm:
            raise TypeError(
                f"{context} layer {name!r} is a {type(layer).__qualname__}, a subclass of "
                f"torch.nn.SyncBatchNorm, which synchronises over torch.distributed, not "
                f"plugdist; {fix}, or derive it from plugdist.nn.SyncBatchNorm")
        if not _is_group_argument(layer.process_group):
            raise TypeError(
                f"{context} layer {name!r} is a torch.nn.SyncBatchNorm whose process_group is a "
                f"{type(layer.process_group).__qualname__}, not a plugdist group; {fix}, with "
                f"process_group from plugdist.new_group (or None for the default group)")
    for _, layer in found:
        layer.__class__ = AdoptedTorchSyncBatchNorm
    return [name for name, _ in found]


def _is_group_argument(group: Any) -> bool:
    return group is None or group is GroupMember.NON_GROUP_MEMBER or isinstance(group,
                                                                                ProcessGroup)


def _check_group_argument(group: Any) -> None:
    if not _is_group_argument(group):
        raise TypeError(f"{where(op=_OP)} process_group must be a plugdist group (from "
                        f"plugdist.new_group or plugdist.group.WORLD) or None for the default "
                        f"group, got {type(group).__qualname__}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reduced-precision inputs are normalized in float32, as torch's batch norm does."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _stats_dtype(device: torch.device) -> torch.dtype:
    # float64 keeps large counts exact and the combination of the ranks' moments accurate; a
    # few numbers per channel, so the cost is nil (MPS alone has no float64)
    return torch.float32 if device.type == "mps" else torch.float64


@contextmanager
def _explained(pg: ProcessGroup, phase: str) -> Iterator[None]:
    """Say which layer's collective failed, and the likely cause, keeping the error's type."""
    try:
        yield
    except DistError as err:
        message = (f"{pg.where(_OP)} the {phase} pass's collective failed: {err}. Every rank of "
                   f"the group must run each training-mode forward and backward of every "
                   f"SyncBatchNorm layer, in the same order (a rank with an empty batch too)")
        try:
            explained = type(err)(message)
        except TypeError:  # an error class with another signature: keep it as it is
            raise err from None
        raise explained from err


def _comm_device(pg: ProcessGroup, device: torch.device) -> torch.device:
    """Where the statistics travel: the input's device when the group's backend handles it,
    else one it does (a few numbers per channel, so staging them costs little): CUDA inputs
    then work over a CPU-only backend such as Gloo or MPI, and CPU inputs over NCCL."""
    types = pg.capabilities().device_types
    if device.type in types:
        return device
    if "cpu" in types:
        return torch.device("cpu")
    accelerator = getattr(torch, types[0], None)
    if accelerator is not None and hasattr(accelerator, "current_device"):
        return torch.device(types[0], accelerator.current_device())
    return torch.device(types[0])


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over a group (see the module docstring for the contract)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, momentum: float,
                pg: ProcessGroup) -> torch.Tensor:
        channels = input.size(1)
        dims = [0, *range(2, input.dim())]
        shape = [1, channels] + [1] * (input.dim() - 2)
        x = input.to(_compute_dtype(input.dtype))
        stats_dtype = _stats_dtype(input.device)

        # this rank's moments: [mean (C) | sum of squared deviations (C) | count (1)]
        count = input.numel() // channels
        local = torch.zeros(2 * channels + 1, dtype=stats_dtype, device=input.device)
        local_mean, centered = None, None
        if count > 0:
            # two passes (mean, then squared deviations from it): accurate, and on CPU some
            # hundred times faster than torch.var_mean over several dimensions
            local_mean = x.sum(dims) / count
            centered = x - local_mean.view(shape)
            local[:channels] = local_mean
            local[channels:2 * channels] = (centered * centered).sum(dims)
            local[2 * channels] = count
        comm = _comm_device(pg, input.device)
        gathered = torch.empty(pg.size() * local.numel(), dtype=stats_dtype, device=comm)
        with _explained(pg, "forward"):
            collectives.all_gather_into_tensor(gathered, local.to(comm), group=pg)
        gathered = gathered.view(pg.size(), -1).to(input.device)
        means, sq_devs, counts = gathered[:, :channels], gathered[:, channels:-1], gathered[:, -1:]

        total = float(counts.sum())
        if total <= 1:
            raise ValueError(
                f"{pg.where(_OP)} expected more than 1 value per channel across the group when "
                f"training, got {int(total)} (input shape here {tuple(input.shape)}); use larger "
                f"batches, or call model.eval() to normalize with the running statistics")
        # Chan et al.'s pairwise combination: ranks with no values add nothing
        global_mean = (counts * means).sum(0) / total
        global_sq_dev = sq_devs.sum(0) + (counts * (means - global_mean) ** 2).sum(0)
        invstd = torch.rsqrt(global_sq_dev / total + eps)

        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype),
                                                     alpha=momentum)
            if running_var is not None:
                unbiased = global_sq_dev / (total - 1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype),
                                                    alpha=momentum)

        mean_c, invstd_c = global_mean.to(x.dtype), invstd.to(x.dtype)
        scale = invstd_c if weight is None else invstd_c * weight.to(x.dtype)
        shift = torch.zeros_like(scale) if bias is None else bias.to(x.dtype)
        # y = (x - mean) * scale + bias, in one pass over the centered input, written in place
        # (a large tensor fewer to allocate); broadcasting keeps the input's memory format
        if centered is None or local_mean is None:  # an empty batch
            output = torch.addcmul((shift - mean_c * scale).view(shape), x, scale.view(shape))
        else:
            shift = shift + (local_mean - mean_c) * scale
            output = torch.addcmul(shift.view(shape), centered, scale.view(shape), out=centered)
        output = output.to(input.dtype)

        ctx.save_for_backward(input, weight, mean_c, invstd_c)
        ctx.pg, ctx.total = pg, total
        ctx.bias_dtype = None if bias is None else bias.dtype
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        pg: ProcessGroup = ctx.pg
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        channels = input.size(1)
        dims = [0, *range(2, input.dim())]
        shape = [1, channels] + [1] * (input.dim() - 2)
        x = input.to(mean.dtype)
        dy = grad_output.to(mean.dtype)

        # this rank's sums (empty on a rank whose batch is empty: zeros, which still take
        # part in the all-reduce the others wait for)
        sum_dy = dy.sum(dims)
        grad_bias = sum_dy.to(ctx.bias_dtype) if need_bias else None
        if not (need_input or need_weight):
            return None, None, grad_bias, None, None, None, None, None
        centered = x - mean.view(shape)
        sum_dy_xmu = (dy * centered).sum(dims)
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if need_weight else None

        grad_input = None
        if need_input:
            sums = torch.cat([sum_dy, sum_dy_xmu]).to(_comm_device(pg, input.device))
            with _explained(pg, "backward"):
                collectives.all_reduce(sums, ReduceOp.SUM, group=pg)
            sums = sums.to(input.device)
            mean_dy = sums[:channels] / ctx.total
            mean_dy_xmu = sums[channels:] / ctx.total
            # dx = a * (dy - mean_dy) + b * (x - mean), per channel, in two passes written
            # over the centered input (no further large allocation)
            a = invstd if weight is None else invstd * weight.to(mean.dtype)
            b = -a * invstd * invstd * mean_dy_xmu
            grad_input = torch.addcmul((-a * mean_dy).view(shape), centered, b.view(shape),
                                       out=centered)
            grad_input.addcmul_(dy, a.view(shape))
            grad_input = grad_input.to(input.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
