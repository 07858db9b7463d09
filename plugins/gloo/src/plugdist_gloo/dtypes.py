"""Making every dtype travel through Gloo, which handles only some of them.

torch's Gloo moves and reduces float32/64, float16, bfloat16, int8, uint8, int32, int64 and
bool. Everything else is staged here:

* ops that only move data (broadcast, gathers, scatter, all-to-all, send/recv) see any other
  dtype as raw bytes: a zero-copy ``uint8`` view of the same memory, leading dims kept so
  all-to-all row splits still hold;
* reductions see complex tensors as pairs of reals (``view_as_real``, zero-copy; only SUM/AVG
  reach here), int16 and uint16 widened to int32, uint32/uint64 as the signed integer of the
  same width (two's-complement SUM/PRODUCT/bitwise wrap the same way; for MIN/MAX the sign bit
  is flipped first so the signed order equals the unsigned one), and other floats (float8)
  widened to float32. Staged copies are written back when the op completes. On bool, SUM and
  PRODUCT are asked of Gloo as OR and AND, which keeps every byte 0 or 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from plugdist.backend import ReduceOp

__all__ = ["NATIVE_DTYPES", "Staged", "effective_op", "flat_bytes", "movable", "rows",
           "stage_reduction"]

NATIVE_DTYPES: frozenset[torch.dtype] = frozenset({
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
})

_SIGNED_TWIN: dict[torch.dtype, torch.dtype] = {
    getattr(torch, u): s for u, s in
    (("uint16", torch.int16), ("uint32", torch.int32), ("uint64", torch.int64))
    if hasattr(torch, u)  # the wide unsigned dtypes arrived in torch 2.3
}

_SIGN_BIT = {torch.int16: -(1 << 15), torch.int32: -(1 << 31), torch.int64: -(1 << 63)}


_BOOL_OPS = {ReduceOp.SUM: ReduceOp.BOR, ReduceOp.PRODUCT: ReduceOp.BAND}


def effective_op(op: ReduceOp, dtype: torch.dtype) -> ReduceOp:
    """The reduction to ask Gloo for. On bool, SUM is OR and PRODUCT is AND: asked as such,
    because some Gloo paths (reduce_scatter) add the bytes and would leave non-0/1 bools."""
    return _BOOL_OPS.get(op, op) if dtype is torch.bool else op


def rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with at least one dimension (a 0-dim tensor becomes shape ``[1]``), same memory."""
    return t if t.dim() else t.reshape(1)


def movable(t: torch.Tensor) -> torch.Tensor:
    """A view of contiguous ``t`` that Gloo can move: ``t`` itself, or its bytes."""
    if t.dtype in NATIVE_DTYPES:
        return t
    return rows(t).view(torch.uint8)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t`` as a 1-D ``uint8`` view."""
    return t.reshape(-1).view(torch.uint8)


@dataclass
class Staged:
    """What Gloo reduces in place of a user tensor, and how to write the result back."""

    buf: torch.Tensor
    target: torch.Tensor | None = None
    restore: Callable[[torch.Tensor], torch.Tensor] | None = None

    def finish(self) -> None:
        """Copy the reduced ``buf`` back into the user's tensor (nothing to do for views)."""
        if self.target is not None and self.restore is not None:
            self.target.copy_(self.restore(self.buf))


def stage_reduction(t: torch.Tensor, op: ReduceOp) -> Staged:
    """Stage ``t`` for a Gloo reduction with ``op``. Raises ``TypeError`` for dtypes that cannot
    be reduced at all (the core already rejects meaningless pairs, e.g. MAX on complex)."""
    dtype = t.dtype
    if dtype in NATIVE_DTYPES:
        return Staged(t)
    if dtype.is_complex:
        return Staged(torch.view_as_real(t))
    if dtype is torch.int16:
        return Staged(t.to(torch.int32), t, lambda b: b.to(torch.int16))
    signed = _SIGNED_TWIN.get(dtype)
    if signed is not None:
        view = t.view(signed)
        flip = op in (ReduceOp.MIN, ReduceOp.MAX)
        sign = _SIGN_BIT[signed]
        buf = view ^ sign if flip else view
        widen = signed is torch.int16
        if widen:
            buf = buf.to(torch.int32)
        if not (flip or widen):
            return Staged(buf)

        def restore(b: torch.Tensor) -> torch.Tensor:
            if widen:
                b = b.to(torch.int16)  # modular narrowing: the wrapped uint16 sum
            return b ^ sign if flip else b

        return Staged(buf, view, restore)
    if dtype.is_floating_point:
        return Staged(t.to(torch.float32), t, lambda b: b.to(dtype))
    raise TypeError(f"dtype {dtype} cannot be reduced by the gloo backend")
