"""Assigning parameters to gradient buckets.

A bucket is a run of parameters, taken in a given order, whose gradients share one flat buffer
and one all-reduce. Every bucket holds a single dtype and device; the first bucket of each
(dtype, device) closes once it reaches the first size limit, later ones at the last limit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["compute_bucket_assignment", "DEFAULT_FIRST_BUCKET_BYTES"]

DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024


def compute_bucket_assignment(tensors: Sequence[torch.Tensor], order: Sequence[int],
                              size_limits: Sequence[int],
                              sparse: Sequence[bool] = ()) -> list[list[int]]:
    """Group the indices in ``order`` into buckets of ``tensors[i]``; pure and deterministic.

    Bucket ``k`` of a (dtype, device) closes as soon as its byte size reaches
    ``size_limits[min(k, len(size_limits) - 1)]`` (so a single large tensor gets a bucket of its
    own). An index whose ``sparse`` entry is true (its gradient is sparse) gets a bucket of its
    own and counts toward no limit. Buckets come back sorted by the position, in ``order``, of
    their first member, which approximates the order in which they fill up during backward.
    """
    if not size_limits:
        raise ValueError("compute_bucket_assignment needs at least one size limit")
    position = {index: pos for pos, index in enumerate(order)}
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    closed_count: dict[tuple[torch.dtype, torch.device], int] = {}
    done: list[list[int]] = []
    for index in order:
        if index < len(sparse) and sparse[index]:
            done.append([index])
            continue
        t = tensors[index]
        key = (t.dtype, t.device)
        members, size = open_buckets.get(key, ([], 0))
        members.append(index)
        size += t.numel() * t.element_size()
        k = closed_count.get(key, 0)
        if size >= size_limits[min(k, len(size_limits) - 1)]:
            done.append(members)
            closed_count[key] = k + 1
            open_buckets.pop(key, None)
        else:
            open_buckets[key] = (members, size)
    done.extend(members for members, _ in open_buckets.values())
    done.sort(key=lambda members: position[members[0]])
    return done
