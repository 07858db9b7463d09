"""Sparse COO tensors in collectives: ``all_reduce`` with ``ReduceOp.SUM``, as torch's gloo offers.

A backend that reduces sparse tensors itself overrides ``ProcessGroup.native_sparse_all_reduce``;
for every other backend the core composes the op from two dense ``all_gather_into_tensor`` calls
of the group's public API (so every backend, wrapper and plugin applies):

1. each rank coalesces its tensor and the ranks exchange a small header (non-zero count and
   shape), waited for on the calling thread: the next step's sizes depend on it, and issuing it
   from the caller keeps every rank's ops in one order;
2. indices and values, padded to the largest count, are gathered (issued at once, asynchronous);
   when both arrive every rank builds the sum of all ranks' tensors (coalesced, rank order) and
   writes it into the tensor with ``copy_`` (a sparse tensor's contents are replaced).

Other ops and other reductions refuse sparse tensors, as torch's gloo does: :func:`refusal`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from plugdist._backend.group import GroupLike
from plugdist._backend.reduce_op import ReduceOp
from plugdist._backend.work import Work, gather_works

__all__ = ["all_reduce", "check_all_reduce", "refusal", "MAX_DIMS"]

MAX_DIMS = 16  # the header holds a shape of up to this many dimensions


class Gathering(GroupLike, Protocol):
    """What the composed sparse all_reduce needs of a group (``ProcessGroup`` is one)."""

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor) -> Work: ...


def refusal(where: str, name: str, tensor: torch.Tensor) -> str:
    """The message for a ``tensor`` of a non-strided layout given to an op that cannot take it."""
    return (f"{where} {name} is a {tensor.layout} tensor, which this op does not take: sparse "
            f"COO tensors are reduced by all_reduce with ReduceOp.SUM only (as torch's gloo "
            f"does); pass {name}.to_dense()")


def check_all_reduce(where: str, tensor: torch.Tensor, op: ReduceOp) -> None:
    """Raise ValueError unless ``all_reduce`` can reduce the sparse ``tensor`` with ``op``."""
    if tensor.layout is not torch.sparse_coo:
        raise ValueError(refusal(where, "tensor", tensor))
    if op is not ReduceOp.SUM:
        raise ValueError(f"{where} all_reduce of a sparse tensor supports ReduceOp.SUM only, "
                         f"got ReduceOp.{op.name} (as torch's gloo); reduce tensor.to_dense() "
                         f"for other reductions")
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"{where} sparse tensor has {tensor.dim()} dimensions; at most "
                         f"{MAX_DIMS} are supported")


def all_reduce(pg: Gathering, tensor: torch.Tensor) -> Work:
    """Sum the sparse COO ``tensor`` over ``pg`` into ``tensor`` (see the module docstring).
    Blocks for the header exchange (bounded by the group's timeout); returns the Work of the
    data exchange, whose result is ``[tensor]``."""
    local = tensor.detach().coalesce()
    size = pg.size()
    header = torch.full((3 + MAX_DIMS,), -1, dtype=torch.int64, device=local.device)
    header[0], header[1], header[2] = local._nnz(), local.sparse_dim(), local.dim()
    header[3:3 + local.dim()] = torch.tensor(local.shape, dtype=torch.int64)
    headers = header.new_empty(size * header.numel())
    pg.all_gather_into_tensor(headers, header).wait()
    rows = headers.view(size, -1)
    if not bool((rows[:, 1:] == header[1:]).all()):
        bad = [r for r in range(size) if not bool((rows[r, 1:] == header[1:]).all())]
        raise ValueError(f"{pg.where('all_reduce')} sparse tensors differ in shape or sparse "
                         f"dimensions across ranks: this rank has {list(local.shape)} with "
                         f"sparse_dim {local.sparse_dim()}, ranks {bad} have others; every rank "
                         f"must pass a tensor of the same shape")
    counts = rows[:, 0].tolist()
    most = max(counts)
    indices = local._indices()
    values = local._values()
    padded_idx = indices.new_zeros((indices.shape[0], most))
    padded_idx[:, :indices.shape[1]] = indices
    padded_val = values.new_zeros((most, *values.shape[1:]))
    padded_val[:values.shape[0]] = values
    all_idx = padded_idx.new_empty((size, *padded_idx.shape))
    all_val = padded_val.new_empty((size, *padded_val.shape))
    work_idx = pg.all_gather_into_tensor(all_idx, padded_idx.contiguous())
    work_val = pg.all_gather_into_tensor(all_val, padded_val.contiguous())

    def finish(_v: Any) -> list[torch.Tensor]:
        idx = torch.cat([all_idx[r, :, :n] for r, n in enumerate(counts)], dim=1)
        val = torch.cat([all_val[r, :n] for r, n in enumerate(counts)], dim=0)
        total = torch.sparse_coo_tensor(idx, val, local.shape, dtype=local.dtype,
                                        device=local.device).coalesce()
        with torch.no_grad():
            tensor.copy_(total)
        return [tensor]

    both = gather_works([work_idx, work_val], None, op="all_reduce", rank=pg.rank(),
                        group=pg.group_name, backend=pg.backend_name, timeout=pg.timeout)
    return both.then(finish)
