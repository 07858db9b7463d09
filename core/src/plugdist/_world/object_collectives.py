"""Collectives on picklable Python objects, built on the tensor collectives.

Objects are pickled into uint8 tensors; sizes travel first so every rank can allocate. The
tensors live on the CPU unless the group's backend handles only another device type (NCCL), then
on that device's current index. Unpickling runs arbitrary code: only use these with peers you
trust, as with torch.distributed.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from plugdist._group.process_group import ProcessGroup
from plugdist._world import collectives as c
from plugdist._world.groups import resolve_group
from plugdist._world.state import world

__all__ = ["broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
           "send_object_list", "recv_object_list"]


def _device(pg: ProcessGroup, device: Any = None) -> torch.device:
    if device is not None:
        return torch.device(device)
    types = pg.capabilities().device_types
    if "cpu" in types:
        return torch.device("cpu")
    if types[0] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(types[0])


def _to_tensor(obj: Any, device: torch.device) -> torch.Tensor:
    data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _from_tensor(t: torch.Tensor, size: int) -> Any:
    return pickle.loads(t[:size].cpu().numpy().tobytes())


def _items_to_tensor(items: list[Any], device: torch.device) -> torch.Tensor:
    """``items`` each pickled on its own, as torch does: the receiver's items share no
    object even where the sender's list holds one object twice."""
    return _to_tensor([pickle.dumps(item) for item in items], device)


def _items_from_tensor(t: torch.Tensor, size: int) -> list[Any]:
    return [pickle.loads(data) for data in _from_tensor(t, size)]


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Fill ``object_list``'s first slots (one per group rank; more are left alone, as by
    torch) with every rank's ``obj``. Blocking."""
    pg = resolve_group(group, "all_gather_object")
    if pg is None:
        return
    if len(object_list) < pg.size():
        raise ValueError(f"{pg.where('all_gather_object')} object_list needs {pg.size()} slots, "
                         f"has {len(object_list)}")
    dev = _device(pg)
    mine = _to_tensor(obj, dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(pg.size())]
    pg.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=dev)).wait()
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[: mine.numel()] = mine
    outs = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(pg.size())]
    pg.all_gather(outs, padded).wait()
    for i, (t, s) in enumerate(zip(outs, sizes, strict=True)):
        object_list[i] = _from_tensor(t, int(s.item()))


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: Any = None, group_dst: int | None = None) -> None:
    """On ``dst`` (global rank; or ``group_dst``, a group rank; default the group's first),
    fill ``object_gather_list``."""
    pg = resolve_group(group, "gather_object")
    if pg is None:
        return
    gathered: list[Any] = [None] * pg.size()
    if dst is None and group_dst is None:
        dst = world.info(pg).global_ranks[0]
    dst_group = c._group_rank(pg, dst, group_dst, "dst", "gather_object")
    if pg.rank() == dst_group and (object_gather_list is None or
                                   len(object_gather_list) != pg.size()):
        raise ValueError(f"{pg.where('gather_object')} object_gather_list needs {pg.size()} slots "
                         f"on the destination rank")
    all_gather_object(gathered, obj, group=pg)
    if pg.rank() == dst_group and object_gather_list is not None:
        object_gather_list[:] = gathered


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Any = None,
                          device: Any = None, group_src: int | None = None) -> None:
    """Replace ``object_list``'s items on every rank with those of ``src``. Blocking."""
    pg = resolve_group(group, "broadcast_object_list")
    if pg is None:
        return
    if src is None and group_src is None:
        src = world.info(pg).global_ranks[0]
    root = c._group_rank(pg, src, group_src, "src", "broadcast_object_list")
    dev = _device(pg, device)
    payload = _items_to_tensor(list(object_list), dev) if pg.rank() == root else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64,
                        device=dev)
    pg.broadcast(size, root).wait()
    buf = (payload if payload is not None
           else torch.empty(int(size.item()), dtype=torch.uint8, device=dev))
    pg.broadcast(buf, root).wait()
    if pg.rank() != root:
        received = _items_from_tensor(buf, int(size.item()))
        if len(received) != len(object_list):
            raise ValueError(f"{pg.where('broadcast_object_list')} object_list has "
                             f"{len(object_list)} slots here but {len(received)} on the source")
        object_list[:] = received


def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list:
                        list[Any] | None = None, src: int | None = None, group: Any = None,
                        group_src: int | None = None) -> None:
    """Each rank receives ``scatter_object_input_list[its group rank]`` from ``src`` into
    ``scatter_object_output_list[0]``. Blocking."""
    pg = resolve_group(group, "scatter_object_list")
    if pg is None:
        return
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError(f"{pg.where('scatter_object_list')} scatter_object_output_list must be a "
                         f"list with at least one slot")
    if src is None and group_src is None:
        src = world.info(pg).global_ranks[0]
    root = c._group_rank(pg, src, group_src, "src", "scatter_object_list")
    objs: list[Any] = [None]
    if pg.rank() == root:
        if scatter_object_input_list is None or len(scatter_object_input_list) != pg.size():
            raise ValueError(f"{pg.where('scatter_object_list')} scatter_object_input_list needs "
                             f"{pg.size()} items on the source rank")
        objs = [list(scatter_object_input_list)]
    broadcast_object_list(objs, group=pg, group_src=root)
    scatter_object_output_list[0] = objs[0][pg.rank()]


def send_object_list(object_list: list[Any], dst: int | None = None, group: Any = None,
                     device: Any = None, group_dst: int | None = None) -> None:
    """Send ``object_list`` to ``dst``; pairs with ``recv_object_list``. Blocking."""
    pg = resolve_group(group, "send_object_list")
    if pg is None:
        return
    peer = c._group_rank(pg, dst, group_dst, "dst", "send_object_list")
    dev = _device(pg, device)
    payload = _items_to_tensor(list(object_list), dev)
    pg.send(torch.tensor([payload.numel()], dtype=torch.int64, device=dev), peer).wait()
    pg.send(payload, peer).wait()


def recv_object_list(object_list: list[Any], src: int | None = None, group: Any = None,
                     device: Any = None, group_src: int | None = None) -> int:
    """Receive into ``object_list`` from ``src`` (None: whichever rank sends first); returns the
    sender's global rank. Blocking."""
    pg = resolve_group(group, "recv_object_list")
    if pg is None:
        return -1
    dev = _device(pg, device)
    peer = None if src is None and group_src is None else \
        c._group_rank(pg, src, group_src, "src", "recv_object_list")
    size = torch.zeros(1, dtype=torch.int64, device=dev)
    work = pg.recv(size, peer)
    work.wait()
    sender = work.source_rank() if peer is None else peer
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    pg.recv(buf, sender).wait()
    received = _items_from_tensor(buf, int(size.item()))
    object_list[: len(received)] = received
    return world.info(pg).global_ranks[sender]
