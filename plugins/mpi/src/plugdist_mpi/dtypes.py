"""Tensors as MPI buffers, and which MPI datatype and op reduce each torch dtype.

Buffers: a CPU tensor is handed to MPI as a byte view of its own storage (no copy); data-moving
ops send bytes (``MPI.BYTE``), so every dtype moves, and reductions describe the same bytes with
the MPI datatype of the tensor's dtype.

Reductions:

* integers, float32/64: MPI's predefined ops on the matching MPI datatype;
* complex64/128: ``MPI.C_FLOAT_COMPLEX``/``C_DOUBLE_COMPLEX`` (only SUM reaches a backend: the
  core rejects ordered ops on complex and turns AVG into SUM and a divide);
* bool: ``MPI.C_BOOL`` with the logical ops, which give torch's answer for 0/1 values (BAND ->
  LAND, BOR/SUM/MAX -> LOR, PRODUCT/MIN -> LAND, BXOR -> LXOR) and keep results 0/1;
* float16/bfloat16 (and float8, complex32): MPI has no such types. They travel as unsigned
  words of their size with a user-defined op per (dtype, reduction) that views both buffers as
  the torch dtype and reduces them with torch: float16/bfloat16 with torch's own kernels (each
  element computed in float32, rounded once to the dtype), the others through a float32 /
  complex64 temporary. Nothing is upcast in the user's tensor and no staging copy is made.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from plugdist import ReduceOp

__all__ = ["raw", "buffer_type", "address", "overlap", "spans_overlap", "reduce_spec",
           "cached_spec", "scattered", "staged", "displacements", "ReduceSpec", "STAGE_ALWAYS"]

# tests set this to exercise the staging path of list collectives (see :func:`scattered`)
STAGE_ALWAYS = False
_INT_MAX = 2**31 - 1

ReduceSpec = tuple[Any, Any]  # (MPI datatype, MPI op)

_TYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "FLOAT", torch.float64: "DOUBLE",
    torch.int8: "INT8_T", torch.int16: "INT16_T", torch.int32: "INT32_T", torch.int64: "INT64_T",
    torch.uint8: "UINT8_T", torch.bool: "C_BOOL",
    torch.complex64: "C_FLOAT_COMPLEX", torch.complex128: "C_DOUBLE_COMPLEX",
}
for _name in ("uint16", "uint32", "uint64"):  # torch >= 2.3 has them with limited kernels
    if hasattr(torch, _name):
        _TYPE_NAMES[getattr(torch, _name)] = _name.upper() + "_T"

# reduced by a torch kernel inside a user-defined MPI op: dtype -> dtype to compute in
_TORCH_REDUCED: dict[torch.dtype, torch.dtype] = {torch.float16: torch.float16,
                                                  torch.bfloat16: torch.bfloat16,
                                                  torch.complex32: torch.complex64}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _TORCH_REDUCED[getattr(torch, _name)] = torch.float32
_WORDS = {1: "UINT8_T", 2: "UINT16_T", 4: "UINT32_T", 8: "UINT64_T"}

_OP_NAMES = {ReduceOp.SUM: "SUM", ReduceOp.PRODUCT: "PROD", ReduceOp.MIN: "MIN",
             ReduceOp.MAX: "MAX", ReduceOp.BAND: "BAND", ReduceOp.BOR: "BOR",
             ReduceOp.BXOR: "BXOR"}
_BOOL_OP_NAMES = {ReduceOp.SUM: "LOR", ReduceOp.MAX: "LOR", ReduceOp.BOR: "LOR",
                  ReduceOp.PRODUCT: "LAND", ReduceOp.MIN: "LAND", ReduceOp.BAND: "LAND",
                  ReduceOp.BXOR: "LXOR"}

_specs: dict[tuple[ReduceOp, torch.dtype], ReduceSpec] = {}


def raw(MPI: Any, t: torch.Tensor) -> Any:
    """An MPI buffer over ``t``'s bytes (``t`` contiguous, on the CPU); no copy.

    The buffer does not keep ``t`` alive: whoever issues the op must hold ``t`` until it is done.
    (The core refuses lazily conjugated/negated tensors, whose bytes are not their values.)
    """
    return buffer_type(MPI).fromaddress(t.data_ptr(), t.nbytes)


def address(t: torch.Tensor) -> int:
    return int(t.data_ptr())


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of ``a`` and ``b`` (contiguous) share any address."""
    return spans_overlap(a.data_ptr(), a.nbytes, b.data_ptr(), b.nbytes)


def spans_overlap(pa: int, na: int, pb: int, nb: int) -> bool:
    """Whether ``na`` bytes from address ``pa`` and ``nb`` bytes from ``pb`` share any."""
    return na > 0 and nb > 0 and pa < pb + nb and pb < pa + na


def scattered(MPI: Any, tensors: list[torch.Tensor]) -> tuple[Any, list[int], list[int]] | None:
    """One MPI buffer spanning ``tensors`` wherever they live: (buffer, byte counts, byte
    displacements from the lowest address), so v-collectives read or write separate tensors in
    place. None when MPI cannot address the span (over 2 GiB without MPI-4 large counts): then
    the caller stages through :func:`staged`."""
    counts = [t.numel() * t.element_size() for t in tensors]
    live = [(address(t), n) for t, n in zip(tensors, counts, strict=True) if n]
    if not live:
        return bytearray(0), counts, [0] * len(tensors)
    base = min(p for p, _ in live)
    end = max(p + n for p, n in live)
    if STAGE_ALWAYS or (end - base > _INT_MAX and not _large_counts(MPI)):
        return None
    displs = [address(t) - base if n else 0 for t, n in zip(tensors, counts, strict=True)]
    return buffer_type(MPI).fromaddress(base, end - base), counts, displs


def displacements(counts: list[int]) -> list[int]:
    """Where each of ``counts`` consecutive pieces starts: the prefix sums before each."""
    return list(itertools.accumulate(counts, initial=0))[:-1]


def staged(tensors: list[torch.Tensor], fill: bool = False) -> tuple[torch.Tensor, list[int],
                                                                      list[int]]:
    """A packed uint8 copy of ``tensors`` (``fill``) or room for them: (flat, counts, displs)."""
    counts = [t.numel() * t.element_size() for t in tensors]
    displs = displacements(counts)
    if fill:
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors else \
            torch.empty(0, dtype=torch.uint8)
    else:
        flat = torch.empty(sum(counts), dtype=torch.uint8)
    return flat, counts, displs


def _large_counts(MPI: Any) -> bool:
    """Whether mpi4py can pass 64-bit counts and displacements (mpi4py 4 over an MPI-4 library)."""
    import mpi4py

    return int(mpi4py.__version__.split(".")[0]) >= 4 and MPI.Get_version() >= (4, 0)


def buffer_type(MPI: Any) -> Any:
    """mpi4py's buffer class: ``MPI.buffer`` (mpi4py 4) or ``MPI.memory`` (mpi4py 3)."""
    global _buffer
    if _buffer is None:
        _buffer = getattr(MPI, "buffer", None) or MPI.memory
    return _buffer


_buffer: Any = None


def cached_spec(op: ReduceOp, dtype: torch.dtype) -> ReduceSpec | None:
    """The spec :func:`reduce_spec` already made for (op, dtype), if any; no lock needed."""
    return _specs.get((op, dtype))


def reduce_spec(MPI: Any, op: ReduceOp, dtype: torch.dtype) -> ReduceSpec:
    """(MPI datatype, MPI op) that reduce ``dtype`` with ``op``; ValueError when MPI cannot.

    Call with the MPI lock held (creating a user-defined op is an MPI call).
    """
    spec = _specs.get((op, dtype))
    if spec is None:
        spec = _specs[(op, dtype)] = _reduce_spec(MPI, op, dtype)
    return spec


def _reduce_spec(MPI: Any, op: ReduceOp, dtype: torch.dtype) -> ReduceSpec:
    if dtype in _TORCH_REDUCED:
        if op not in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX):
            raise ValueError(f"ReduceOp.{op.name} is not defined for {dtype}")
        word = getattr(MPI, _WORDS[torch.empty(0, dtype=dtype).element_size()])
        return word, _torch_op(MPI, dtype, op)
    name = _TYPE_NAMES.get(dtype)
    if name is None or not hasattr(MPI, name):
        known = ", ".join(str(d).removeprefix("torch.") for d in (*_TYPE_NAMES, *_TORCH_REDUCED))
        raise ValueError(f"MPI cannot reduce {dtype} tensors (reducible: {known}); convert the "
                         f"tensor, or use an op that only moves data")
    names = _BOOL_OP_NAMES if dtype is torch.bool else _OP_NAMES
    if op not in names:
        raise ValueError(f"ReduceOp.{op.name} must be turned into supported ops by the core first")
    return getattr(MPI, name), getattr(MPI, names[op])


def _torch_op(MPI: Any, dtype: torch.dtype, op: ReduceOp) -> Any:
    """A user-defined MPI op; made once per (dtype, op), as ``reduce_spec`` caches its result."""
    return MPI.Op.Create(_torch_kernel(dtype, _TORCH_REDUCED[dtype], op), commute=True)


def _torch_kernel(dtype: torch.dtype, wide: torch.dtype, op: ReduceOp) -> Any:
    """``f(inbuf, inoutbuf, datatype)`` doing ``inout = inout (op) in`` on ``dtype`` elements,
    computed in ``wide``.

    Runs inside MPI (on whichever plugdist thread is progressing the op), so it must not call
    MPI; it only raises on a bug (mpi4py then aborts the op with an error).
    """
    kernels: dict[ReduceOp, Callable[..., torch.Tensor]] = {
        ReduceOp.SUM: torch.add, ReduceOp.PRODUCT: torch.mul, ReduceOp.MIN: torch.minimum,
        ReduceOp.MAX: torch.maximum}
    fn = kernels[op]

    def kernel(inbuf: Any, inoutbuf: Any, _datatype: Any) -> None:
        if len(inbuf) == 0:
            return
        a = torch.frombuffer(inbuf, dtype=dtype)
        b = torch.frombuffer(inoutbuf, dtype=dtype)
        if wide is dtype:
            fn(b, a, out=b)
        else:
            b.copy_(fn(b.to(wide), a.to(wide)))

    return kernel
