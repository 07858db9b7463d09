"""Collectives captured in CUDA graphs, still covered by the group timeout when replayed.

A captured op runs at every replay of its graph, long after the call that captured it, so no
Work or event can follow it (querying an event recorded in a capture is an error). Instead each
captured op gets a slot: the graph bumps the slot's counter on the GPU before the op and copies
it to pinned host memory twice, once before the op ("begun") and once after ("ended"). The
watchdog reads the two rows with plain CPU loads: a slot whose begun value stays ahead of its
ended value for longer than the timeout is a replay stuck in that op. Progress of later replays
moves the begun value on, so a host running ahead of the GPU never looks stuck. Each replay pays
one tiny kernel and two 8-byte copies per captured op.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from .cuda import runtime

__all__ = ["ReplayWatch", "LateReplay", "SLOTS"]

SLOTS = 4096  # captured ops watched per group; later captures run unwatched (with a warning)
_DEVICE_TO_HOST = 2  # cudaMemcpyDeviceToHost
_WORD = 8


class LateReplay(NamedTuple):
    op: str
    replay: int  # how many replays of this op had begun (1 = the first)


class ReplayWatch:
    """The slots of one group. ``claim``/``before``/``after`` run on the capturing thread, with
    the capture's stream current for torch; ``late`` runs on the watchdog thread."""

    def __init__(self, device: torch.device, slots: int = SLOTS) -> None:
        # made eagerly (with the communicator): neither may be allocated during a capture
        self._counters = torch.zeros(slots, dtype=torch.int64, device=device)
        self._host = torch.zeros((2, slots), dtype=torch.int64, device="cpu", pin_memory=True)
        self._slots = slots
        self._ops: list[str] = []
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[int, float]] = {}  # slot -> (begun value, first seen)
        self._reported: set[int] = set()

    def __len__(self) -> int:
        return len(self._ops)

    def claim(self, op: str) -> int | None:
        """A slot for a newly captured ``op``, or None when every slot is taken."""
        with self._lock:
            if len(self._ops) >= self._slots:
                return None
            self._ops.append(op)
            return len(self._ops) - 1

    def before(self, slot: int, stream: int) -> None:
        """Queue, on ``stream`` (torch's current stream), the counter bump and the begun copy."""
        self._counters[slot:slot + 1].add_(1)
        self._copy(slot, 0, stream)

    def after(self, slot: int, stream: int) -> None:
        """Queue, on ``stream``, the ended copy."""
        self._copy(slot, 1, stream)

    def _copy(self, slot: int, row: int, stream: int) -> None:
        dst = self._host.data_ptr() + (row * self._slots + slot) * _WORD
        src = self._counters.data_ptr() + slot * _WORD
        runtime().memcpyAsync(dst, src, _WORD, _DEVICE_TO_HOST, stream)

    def late(self, now: float, limit: float) -> list[LateReplay]:
        """Captured ops whose current replay began more than ``limit`` seconds ago (as first
        seen by this poll) and has not ended; each reported once."""
        n = len(self._ops)
        if not n:
            return []
        return self._judge(self._host[0, :n].tolist(), self._host[1, :n].tolist(), now, limit)

    def _judge(self, begun: list[int], ended: list[int], now: float,
               limit: float) -> list[LateReplay]:
        found = []
        for slot, (b, e) in enumerate(zip(begun, ended, strict=True)):
            if b == e:
                self._pending.pop(slot, None)
                continue
            seen = self._pending.get(slot)
            if seen is None or seen[0] != b:
                self._pending[slot] = (b, now)
            elif now - seen[1] > limit and slot not in self._reported:
                self._reported.add(slot)
                found.append(LateReplay(self._ops[slot], b))
        return found
