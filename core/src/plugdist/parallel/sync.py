"""Keeping model replicas consistent: check that every rank built the same model, and copy
parameters and buffers from one rank to the others in few, coalesced broadcasts.

Both functions are collective: every rank of the group calls them, in the same order.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from plugdist.errors import DistError

if TYPE_CHECKING:
    from plugdist._group.process_group import ProcessGroup

__all__ = ["verify_model_across_ranks", "broadcast_coalesced"]

_MAX_DIMS = 8
_WIDTH = 2 + _MAX_DIMS  # dtype code, ndim, sizes (the last slot folds any further dims)


@functools.cache
def _dtype_names() -> dict[int, str]:
    """dtype code (as in :func:`_fingerprint`) -> name; only error messages need it."""
    return {zlib.crc32(str(d).encode()): str(d).replace("torch.", "")
            for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _fingerprint(params: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    out = torch.full((rows, _WIDTH), -1, dtype=torch.int64)
    for i, p in enumerate(params):
        sizes = list(p.shape)
        if len(sizes) > _MAX_DIMS:
            tail = 1
            for s in sizes[_MAX_DIMS - 1:]:
                tail *= s
            sizes = sizes[:_MAX_DIMS - 1] + [tail]
        row = [zlib.crc32(str(p.dtype).encode()), p.dim(), *sizes]
        out[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
        out[i, len(row):] = 0
    return out


def _describe(row: list[int]) -> str:
    if row[0] == -1:
        return "no such parameter"
    ndim = row[1]
    dims = row[2:2 + min(ndim, _MAX_DIMS)]
    more = "..." if ndim > _MAX_DIMS else ""
    return f"{_dtype_names().get(row[0], f'dtype#{row[0]}')}{dims}{more}"


def verify_model_across_ranks(pg: ProcessGroup, params: Sequence[torch.Tensor],
                              names: Sequence[str], where: str) -> None:
    """Raise DistError on every rank unless all ranks hold parameters of the same shapes and
    dtypes in the same order. Two all-gathers; blocks up to the group's timeout."""
    size = pg.size()
    if size == 1:
        return
    # on the parameters' device when the backend handles it (nccl handles cuda only), else cpu
    device = params[0].device if params else torch.device("cpu")
    if device.type not in pg.capabilities().device_types:
        device = torch.device("cpu")
    count = torch.tensor([len(params)], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(size)]
    pg.all_gather(counts, count).wait()
    per_rank = [int(c.item()) for c in counts]
    rows = max(per_rank)
    mine = _fingerprint(params, rows).to(device)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    pg.all_gather(gathered, mine).wait()
    tables = [g.tolist() for g in gathered]
    for i in range(rows):
        entries = [t[i] for t in tables]
        if all(e == entries[0] for e in entries):
            continue
        differing = [r for r in range(size) if entries[r] != entries[0]]
        name = repr(names[i]) if i < len(names) else "(none on this rank)"
        detail = "; ".join(f"rank {r}: {_describe(e)}" for r, e in enumerate(entries))
        raise DistError(
            f"{where} DistributedDataParallel needs the same model on every rank, but parameter "
            f"{i} differs between rank 0 and rank(s) {differing} (name here: {name}). {detail}. "
            f"Parameter counts per rank: {per_rank}. Build the model identically on every rank "
            f"(same layers, order, shapes and dtypes) before wrapping it.")
    if len(set(per_rank)) > 1:
        raise DistError(f"{where} DistributedDataParallel needs the same model on every rank, "
                        f"but the parameter counts differ: {per_rank} (rank -> count)")


def broadcast_coalesced(pg: ProcessGroup, tensors: Sequence[torch.Tensor], src: int,
                        bucket_bytes: int = 250 * 1024 * 1024) -> None:
    """Copy ``tensors`` from group rank ``src`` into the same tensors on every other rank.

    Tensors are packed per (dtype, device) into flat buffers of at most ``bucket_bytes`` (a
    larger single tensor gets a buffer of its own); all broadcasts are issued before any is
    waited for. Blocks until done (bounded by the group's timeout).
    """
    if pg.size() == 1 or not tensors:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        chunks = groups.setdefault(key, [[]])
        nbytes = t.numel() * t.element_size()
        if chunks[-1] and sizes[key] + nbytes > bucket_bytes:
            chunks.append([])
            sizes[key] = 0
        chunks[-1].append(t)
        sizes[key] = sizes.get(key, 0) + nbytes
    pending = []
    is_src = pg.rank() == src
    with torch.no_grad():
        for (dtype, device), chunks in groups.items():
            for chunk in chunks:
                if is_src:
                    flat = torch.cat([t.reshape(-1) for t in chunk])
                else:
                    flat = torch.empty(sum(t.numel() for t in chunk), dtype=dtype, device=device)
                pending.append((pg.broadcast(flat, src), flat, chunk))
        for work, flat, chunk in pending:
            work.wait()
            if not is_src:
                offset = 0
                for t in chunk:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
