"""Comm hooks for torch's own ``DistributedDataParallel`` over a ``plugdist_X`` group."""

# no ``from __future__ import annotations``: torch's DDP checks the hook's annotations as objects
from typing import Any

import torch
import torch.distributed as tdist

__all__ = ["resilient_allreduce_hook"]


def resilient_allreduce_hook(process_group: Any,
                             bucket: tdist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch DDP comm hook: average the bucket over the group's *current* size.

    torch keeps a group's size in C++, fixed when the group was built, and its DDP divides the
    gradients by it; after ``plugdist.shrink_group``/``grow_group`` that is the old size. This
    hook divides by the size of the plugdist group the torch group runs over now. Register it
    with ``ddp.register_comm_hook(group, resilient_allreduce_hook)`` (``group``: the torch group
    DDP uses, or None for the default). Non-blocking: returns the all_reduce's future."""
    group: Any = process_group if process_group is not None else tdist.group.WORLD
    inner = getattr(group, "plugdist_group", None)
    size = inner.size() if inner is not None else group.size()
    tensor = bucket.buffer()
    tensor.div_(size)
    work = tdist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
