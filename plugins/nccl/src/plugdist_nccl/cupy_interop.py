"""Using cupy arrays with plugdist ops: a zero-copy torch view over the same device memory."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["from_cupy"]


def from_cupy(array: Any) -> torch.Tensor:
    """A torch tensor sharing ``array``'s memory (DLPack; no copy), to pass to any op.

    The result aliases the cupy array: an op writing the tensor writes the array. Ops run on
    plugdist's stream ordered after torch's *current* stream, so work queued on a cupy stream
    must be ordered before the op by the caller (e.g. ``cupy_stream.synchronize()``).
    """
    if not hasattr(array, "__dlpack__"):
        raise TypeError(f"from_cupy expects a cupy array (with __dlpack__), got "
                        f"{type(array).__name__}")
    return torch.from_dlpack(array)
