"""What a backend does natively: the ops and reductions a :class:`Capabilities` names.

Its own module, below both ``process_group`` (which derives a group's capabilities from the
hooks it overrides) and ``composition`` (which plans every other op from them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plugdist._backend.reduce_op import ReduceOp

__all__ = ["Capabilities", "ALL_REDUCE_OPS"]

ALL_REDUCE_OPS = frozenset(ReduceOp) - {ReduceOp.AVG}  # AVG is SUM then a local divide


@dataclass(frozen=True)
class Capabilities:
    """Which ``(op, device_type)`` pairs a backend does natively, and which reductions."""

    native: frozenset[tuple[str, str]]
    reduce_ops: frozenset[ReduceOp] = field(default=ALL_REDUCE_OPS)
    any_source_recv: bool = False
    device_types: tuple[str, ...] = ("cpu",)
    refused_reduce_ops: frozenset[ReduceOp] = frozenset()  # raised as errors, never composed

    def is_native(self, op: str, device_type: str) -> bool:
        return (op, device_type) in self.native
