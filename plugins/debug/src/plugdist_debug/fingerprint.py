"""Collective fingerprints: what every rank of a group must agree on before a collective runs.

A :class:`Fingerprint` holds the sequence number, the op, the reduce op, the root (src/dst, as a
group rank) and, for each tensor whose shape must match across ranks, its role, shape, dtype and
device type. All-to-all ops legitimately differ in shape from rank to rank; for them the
fingerprint carries how many elements this rank sends to and expects from each peer, and
:func:`differences` checks those pairwise instead.

Fingerprints travel as compact JSON (readable in the store and in flight-recorder dumps).
Pure data and functions: no I/O, thread-safe.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TensorSpec", "Fingerprint", "spec_of", "differences", "describe", "rank_list"]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor argument. ``shape`` entries of None are not compared (rows of all_to_all)."""

    role: str
    shape: tuple[int | None, ...] | None
    dtype: str
    device: str

    def to_json(self) -> list[Any]:
        return [self.role, None if self.shape is None else list(self.shape), self.dtype,
                self.device]

    @classmethod
    def from_json(cls, raw: Sequence[Any]) -> TensorSpec:
        role, shape, dtype, device = raw
        return cls(role, None if shape is None else tuple(shape), dtype, device)

    def shape_text(self) -> str:
        if self.shape is None:
            return "?"
        return "[" + ", ".join("*" if d is None else str(d) for d in self.shape) + "]"

    def __str__(self) -> str:
        return f"{self.role}={self.dtype}{self.shape_text()}@{self.device}"


def spec_of(role: str, tensor: Any, *, rows_vary: bool = False) -> TensorSpec:
    """The spec of ``tensor``; a non-tensor (a caller's mistake, reported later by the group's
    own validation) gets its type name, so fingerprinting never raises."""
    if not isinstance(tensor, torch.Tensor):
        return TensorSpec(role, None, type(tensor).__name__, "?")
    shape: tuple[int | None, ...] = tuple(tensor.shape)
    if rows_vary and shape:
        shape = (None, *shape[1:])
    return TensorSpec(role, shape, str(tensor.dtype).removeprefix("torch."), tensor.device.type)


@dataclass(frozen=True)
class Fingerprint:
    """What one rank is about to run, as compared across the group."""

    seq: int
    op: str
    reduce_op: str | None = None
    root: int | None = None
    tensors: tuple[TensorSpec, ...] = ()
    # element counts per peer, for all_to_all ops only (None: unknown, let validation report)
    sends: tuple[int, ...] | None = field(default=None)
    recvs: tuple[int, ...] | None = field(default=None)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seq": self.seq, "op": self.op}
        if self.reduce_op is not None:
            out["reduce_op"] = self.reduce_op
        if self.root is not None:
            out["root"] = self.root
        out["tensors"] = [t.to_json() for t in self.tensors]
        if self.sends is not None:
            out["sends"] = list(self.sends)
        if self.recvs is not None:
            out["recvs"] = list(self.recvs)
        return out

    def encode(self, doc: dict[str, Any] | None = None) -> bytes:
        """The wire form; ``doc``: :meth:`to_json`'s result when the caller already has it."""
        return json.dumps(self.to_json() if doc is None else doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Fingerprint:
        sends, recvs = raw.get("sends"), raw.get("recvs")
        return cls(seq=int(raw["seq"]), op=str(raw["op"]), reduce_op=raw.get("reduce_op"),
                   root=raw.get("root"),
                   tensors=tuple(TensorSpec.from_json(t) for t in raw.get("tensors", ())),
                   sends=None if sends is None else tuple(sends),
                   recvs=None if recvs is None else tuple(recvs))

    @classmethod
    def decode(cls, data: bytes) -> Fingerprint:
        return cls.from_json(json.loads(data))

    def __str__(self) -> str:
        parts = [f"#{self.seq} {self.op}"]
        if self.reduce_op is not None:
            parts.append(f"reduce_op={self.reduce_op}")
        if self.root is not None:
            parts.append(f"root={self.root}")
        parts.append("tensors=[" + ", ".join(str(t) for t in self.tensors) + "]")
        if self.sends is not None:
            parts.append(f"sends={list(self.sends)} recvs={list(self.recvs or ())}")
        return " ".join(parts)


def rank_list(ranks: Iterable[int]) -> str:
    """``rank 1`` or ``ranks 0,2``."""
    rs = sorted(ranks)
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(str(r) for r in rs)


def _value_text(value: Any) -> str:
    return "none" if value is None else str(value)


def _field_difference(name: str, values: Sequence[Any], ranks: Sequence[int]) -> str | None:
    """``name: A on ranks 0,2 vs B on rank 1``, or None when every rank agrees."""
    groups: dict[str, list[int]] = {}
    for rank, value in zip(ranks, values, strict=True):
        groups.setdefault(_value_text(value), []).append(rank)
    if len(groups) <= 1:
        return None
    return f"{name}: " + " vs ".join(f"{v} on {rank_list(rs)}" for v, rs in groups.items())


def differences(fps: Sequence[Fingerprint], ranks: Sequence[int] | None = None) -> list[str]:
    """Every field on which ``fps`` (one per rank, in ``ranks`` order, default 0..n-1) disagree,
    one line each; empty when they all match."""
    ranks = list(range(len(fps))) if ranks is None else list(ranks)
    out: list[str] = []

    def field_diff(name: str, values: Sequence[Any]) -> None:
        line = _field_difference(name, values, ranks)
        if line is not None:
            out.append(line)

    field_diff("seq", [f.seq for f in fps])
    field_diff("op", [f.op for f in fps])
    field_diff("reduce_op", [f.reduce_op for f in fps])
    field_diff("root", [f.root for f in fps])
    field_diff("tensor count", [len(f.tensors) for f in fps])
    for i in range(min(len(f.tensors) for f in fps)):
        specs = [f.tensors[i] for f in fps]
        roles = {s.role for s in specs}
        label = specs[0].role if len(roles) == 1 else f"tensor #{i}"
        field_diff(f"{label} shape", [s.shape_text() for s in specs])
        field_diff(f"{label} dtype", [s.dtype for s in specs])
        field_diff(f"{label} device", [s.device for s in specs])
    out.extend(_split_differences(fps, ranks))
    return out


def _split_differences(fps: Sequence[Fingerprint], ranks: Sequence[int]) -> list[str]:
    """All-to-all: what rank i sends to rank j must be what rank j expects from rank i."""
    n = len(fps)
    table = [(f.sends, f.recvs) for f in fps
             if f.sends is not None and f.recvs is not None and len(f.sends) == len(f.recvs) == n]
    if len(table) != n:
        return []
    out = []
    for i in range(n):
        for j in range(n):
            sent, expected = table[i][0][j], table[j][1][i]
            if sent != expected:
                out.append(f"split sizes: rank {ranks[i]} sends {sent} elements to rank "
                           f"{ranks[j]}, but rank {ranks[j]} expects {expected} from rank "
                           f"{ranks[i]}")
    return out


def describe(fps: Sequence[Fingerprint], labels: Sequence[str]) -> list[str]:
    """One line per rank: ``rank 1: #3 all_reduce reduce_op=SUM tensors=[...]``."""
    return [f"{label}: {fp}" for label, fp in zip(labels, fps, strict=True)]
