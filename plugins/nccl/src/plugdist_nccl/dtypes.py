"""How torch tensors are handed to NCCL: datatype codes, buffer views and reduction codes.

Ops that only move data send any dtype NCCL lacks as raw bytes. Reductions need NCCL to know the
type: bool travels as uint8 (SUM asked as MAX and PRODUCT as MIN, so every byte stays 0/1) and
complex as pairs of reals (SUM and AVG only; the core refuses the others). No staging copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from plugdist.backend import ReduceOp

__all__ = ["Buffer", "data_buffer", "reduction_buffer", "check_reducible", "nccl_op",
           "DATA_CODES", "REDUCE_CODES", "reduce_code"]

# NCCL's ABI values (nccl.h), stable since 2.0; the bfloat16 and avg codes need NCCL >= 2.10
_INT8, _UINT8, _INT32, _UINT32, _INT64, _UINT64 = 0, 1, 2, 3, 4, 5
_FLOAT16, _FLOAT32, _FLOAT64, _BFLOAT16 = 6, 7, 8, 9
_SUM, _PROD, _MAX, _MIN, _AVG = 0, 1, 2, 3, 4

_CODES: dict[torch.dtype, int] = {
    torch.int8: _INT8, torch.uint8: _UINT8, torch.int32: _INT32, torch.int64: _INT64,
    torch.float16: _FLOAT16, torch.float32: _FLOAT32, torch.float64: _FLOAT64,
    torch.bfloat16: _BFLOAT16, torch.bool: _UINT8,
}
for _name, _code in (("uint32", _UINT32), ("uint64", _UINT64)):
    if hasattr(torch, _name):
        _CODES[getattr(torch, _name)] = _code
_COMPLEX_PARTS = {torch.complex64: _FLOAT32, torch.complex128: _FLOAT64}
_OPS = {ReduceOp.SUM: _SUM, ReduceOp.PRODUCT: _PROD, ReduceOp.MAX: _MAX, ReduceOp.MIN: _MIN,
        ReduceOp.AVG: _AVG}
_BOOL_OPS = {ReduceOp.SUM: _MAX, ReduceOp.PRODUCT: _MIN, ReduceOp.MAX: _MAX, ReduceOp.MIN: _MIN}

# the hot path's lookups: dtype -> (NCCL datatype, NCCL elements per tensor element)
REDUCE_CODES: dict[torch.dtype, tuple[int, int]] = {
    **{dt: (code, 1) for dt, code in _CODES.items()},
    **{dt: (code, 2) for dt, code in _COMPLEX_PARTS.items()},
}
DATA_CODES: dict[torch.dtype, tuple[int, int]] = {
    **{dt: (code, 1) for dt, code in _CODES.items()},
    # what NCCL lacks travels as raw bytes
    **{dt: (_UINT8, torch.empty(0, dtype=dt).element_size())
       for dt in (torch.complex64, torch.complex128, torch.int16, torch.float8_e4m3fn,
                  torch.float8_e5m2) if dt not in _CODES},
}


@dataclass(frozen=True)
class Buffer:
    """A contiguous tensor as NCCL sees it: device pointer, element count, datatype code."""

    ptr: int
    count: int
    dtype: int


def data_buffer(t: torch.Tensor) -> Buffer:
    """``t`` for ops that only move data: its own type when NCCL has it, raw bytes otherwise."""
    code = _CODES.get(t.dtype)
    if code is None:
        return Buffer(t.data_ptr(), t.numel() * t.element_size(), _UINT8)
    return Buffer(t.data_ptr(), t.numel(), code)


def check_reducible(dtype: torch.dtype) -> None:
    """Raise TypeError when NCCL cannot reduce ``dtype`` tensors."""
    if dtype in _COMPLEX_PARTS:
        return
    code = _CODES.get(dtype)
    if code is None:
        raise TypeError(f"NCCL cannot reduce {dtype} tensors; convert it (e.g. .float() or "
                        f".int()) first")


def reduction_buffer(t: torch.Tensor) -> Buffer:
    """``t`` for a reduction; raises TypeError for a dtype NCCL cannot reduce."""
    check_reducible(t.dtype)
    if t.dtype in _COMPLEX_PARTS:
        return Buffer(t.data_ptr(), t.numel() * 2, _COMPLEX_PARTS[t.dtype])
    return Buffer(t.data_ptr(), t.numel(), _CODES[t.dtype])


def reduce_code(op: ReduceOp, dtype: torch.dtype) -> int:
    """:func:`nccl_op` for the hot path (the core checked ``op`` suits ``dtype``)."""
    return _BOOL_OPS[op] if dtype is torch.bool else _OPS[op]


def nccl_op(op: ReduceOp, dtype: torch.dtype) -> int:
    """NCCL's reduction code for ``op`` on ``dtype`` (the caller checked NCCL has it)."""
    if dtype is torch.bool:
        return _BOOL_OPS[op]
    return _OPS[op]
