"""Communication hooks: how a bucket of gradients is reduced across ranks.

A hook is ``hook(state, bucket: GradBucket) -> torch.futures.Future``. The reducer calls it once
per bucket per iteration, on the thread running backward, as soon as every gradient of the
bucket is ready; the future's value is the reduced flat tensor (same numel and dtype as
``bucket.buffer()``; a one-element list of it is accepted too), which the reducer writes back
into the parameters' ``.grad``. Buckets handed to a hook are **not** pre-divided by the world
size: averaging is the hook's job. A parameter with a sparse gradient has a bucket of its own
whose ``buffer()`` is that gradient (a sparse COO tensor); the hook's future holds the reduced
sparse tensor, which becomes the parameter's ``.grad``.

Built-in hooks (also found by name through the ``plugdist.comm_hooks`` entry points) take as
``state`` the ProcessGroup to reduce over, or None for the DDP model's own group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from plugdist._group.process_group import ProcessGroup

__all__ = ["GradBucket", "CommHook", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]


class GradBucket:
    """One bucket of flattened gradients, as a comm hook sees it.

    ``buffer()`` is the flat tensor holding every gradient of the bucket (parameters in bucket
    order, back to back); ``gradients()`` are views of it shaped like the parameters. Not
    thread-safe; valid for the duration of one hook call and the future it returns.
    """

    def __init__(self, index: int, num_buckets: int, buffer: torch.Tensor,
                 parameters: list[torch.Tensor], offsets: list[int],
                 process_group: ProcessGroup) -> None:
        self._index = index
        self._num_buckets = num_buckets
        self._buffer = buffer
        self._parameters = parameters
        self._offsets = offsets
        self._process_group = process_group

    def index(self) -> int:
        """Position of this bucket in the reduction order (0 is reduced first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradient tensor of this bucket."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the flat tensor (same numel) that ``buffer()`` and ``gradients()`` return."""
        if buffer.numel() != self._buffer.numel():
            raise ValueError(f"GradBucket {self._index}: set_buffer needs {self._buffer.numel()} "
                             f"elements, got {buffer.numel()}")
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        """Views of ``buffer()``, one per parameter, shaped like the parameter (a sparse
        gradient's bucket: ``[buffer()]``, the gradient itself)."""
        if self._buffer.layout is not torch.strided:
            return [self._buffer]
        return [self._buffer[o:o + p.numel()].view(p.shape)
                for o, p in zip(self._offsets, self._parameters, strict=True)]

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients this bucket holds, in bucket order."""
        return list(self._parameters)

    def is_last(self) -> bool:
        """True for the bucket reduced last in an iteration."""
        return self._index == self._num_buckets - 1

    def __repr__(self) -> str:
        return (f"<GradBucket {self._index}/{self._num_buckets} {self._buffer.dtype} "
                f"numel={self._buffer.numel()} params={len(self._parameters)}>")


def _group(state: Any, bucket: GradBucket) -> ProcessGroup:
    return bucket._process_group if state is None else state


def _first_tensor(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, (list, tuple)) else value


def allreduce_hook(state: ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket over the group: divide by its size, then all-reduce (sum)."""
    pg = _group(state, bucket)
    buf = bucket.buffer()
    buf.div_(pg.size())
    return pg.all_reduce(buf).get_future().then(lambda fut: _first_tensor(fut.value()))


def _compressed_allreduce(state: ProcessGroup | None, bucket: GradBucket,
                          dtype: torch.dtype) -> torch.futures.Future:
    pg = _group(state, bucket)
    # Dividing in the narrow dtype before the sum keeps the sum from overflowing.
    compressed = bucket.buffer().to(dtype).div_(pg.size())

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        out = bucket.buffer()
        out.copy_(_first_tensor(fut.value()))
        return out

    return pg.all_reduce(compressed).get_future().then(decompress)


def fp16_compress_hook(state: ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket in float16 (cast, divide by the group size, all-reduce, cast back into
    the bucket): half the bytes on the wire for float32 gradients."""
    return _compressed_allreduce(state, bucket, torch.float16)


def bf16_compress_hook(state: ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket in bfloat16 (cast, divide by the group size, all-reduce, cast back
    into the bucket): float32's range at half the bytes."""
    return _compressed_allreduce(state, bucket, torch.bfloat16)
