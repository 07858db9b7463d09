"""``ReduceOp``: the reductions every backend is asked for, as in torch.distributed."""

from __future__ import annotations

import enum
import warnings

import torch

__all__ = ["ReduceOp", "reduce_op", "check_reduce_op"]


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"

    # members are singletons compared by identity: hash them the same way, in C (Enum's own
    # __hash__ is Python code, and every op looks its ReduceOp up in a set or two)
    __hash__ = object.__hash__


class _DeprecatedReduceOp:
    """``reduce_op``, ReduceOp's old name, kept for old scripts: reading a member gives
    ReduceOp's and warns (FutureWarning) where it is read, as ``torch.distributed.reduce_op``
    does, so code run under both sees the same warning."""

    def __getattr__(self, name: str) -> ReduceOp:
        if name not in ReduceOp.__members__:  # incl. protocol lookups (copy, pickle, inspect)
            raise AttributeError(f"plugdist.reduce_op has no member {name!r}")
        warnings.warn("`plugdist.reduce_op` is deprecated, please use `plugdist.ReduceOp` "
                      "instead", FutureWarning, stacklevel=2)
        return getattr(ReduceOp, name)

    def __repr__(self) -> str:
        return "plugdist.reduce_op (deprecated: use plugdist.ReduceOp)"


reduce_op = _DeprecatedReduceOp()

_BITWISE = {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}
_ORDERED = {ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT}


def check_reduce_op(op: ReduceOp, dtype: torch.dtype, *, context: str = "") -> None:
    """Raise ``ValueError`` when ``op`` has no meaning for ``dtype``.

    Bitwise ops have none on floats, MIN/MAX none on complex numbers.
    """
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{context} expected a plugdist.ReduceOp, got {op!r}".strip())
    if op in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{context} ReduceOp.{op.name} is bitwise and needs an integer or bool "
                         f"tensor, got {dtype}; use SUM/MIN/MAX for floating types".strip())
    if op in _ORDERED and dtype.is_complex:
        raise ValueError(f"{context} ReduceOp.{op.name} is not defined for complex tensors "
                         f"({dtype}); only SUM and AVG are".strip())
    if op is ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{context} ReduceOp.AVG needs a floating or complex tensor, got {dtype}; "
                         f"reduce with SUM and divide yourself".strip())


@torch.no_grad()
def apply_local(op: ReduceOp, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Reduce ``tensors`` elementwise in this process (used by composed ops and backends),
    outside autograd (tensors that require grad included), as collectives are."""
    out = tensors[0].clone()
    for t in tensors[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            out.add_(t)
        elif op is ReduceOp.PRODUCT:
            out.mul_(t)
        elif op is ReduceOp.MIN:
            torch.minimum(out, t, out=out)
        elif op is ReduceOp.MAX:
            torch.maximum(out, t, out=out)
        elif op is ReduceOp.BAND:
            out.bitwise_and_(t)
        elif op is ReduceOp.BOR:
            out.bitwise_or_(t)
        elif op is ReduceOp.BXOR:
            out.bitwise_xor_(t)
    if op is ReduceOp.AVG:
        out.div_(len(tensors))
    return out
