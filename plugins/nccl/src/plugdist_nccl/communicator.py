"""Building a group's NCCL communicator through the group's plugdist store.

Collective over the group's members, blocking: every member announces itself and waits for the
others (bounded by the group timeout, naming the absent ranks), group rank 0 creates NCCL's
unique id and publishes it, and every member then joins ``ncclCommInitRank`` on its device.
Waiting for every member first keeps ``ncclCommInitRank`` (which has no timeout) from hanging on
a rank that never came.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from plugdist.errors import DistBackendError, DistTimeoutError
from plugdist.store import Store

from ._nccl import load

__all__ = ["create_communicator"]

_UID_KEY = "nccl/unique_id"


def _encode(uid: tuple[int, ...]) -> bytes:
    return bytes(b & 0xFF for b in uid)


def _decode(raw: bytes) -> tuple[int, ...]:
    return tuple(b - 256 if b > 127 else b for b in raw)  # NCCL's id is C chars, signed


def create_communicator(store: Store, rank: int, size: int, device: torch.device,
                        timeout: timedelta, here: str) -> Any:
    """A ``cupy.cuda.nccl.NcclCommunicator`` for this rank on ``device``. Raises
    DistTimeoutError (a member never arrived) or DistBackendError (NCCL failed)."""
    nccl = load()
    if rank == 0:
        with torch.cuda.device(device):
            store.set(_UID_KEY, _encode(nccl.get_unique_id()))
    store.set(f"nccl/arrived/{rank}", b"1")
    keys = [f"nccl/arrived/{r}" for r in range(size)]
    try:
        store.wait(keys, timeout)
    except DistTimeoutError as err:
        missing = [r for r in range(size) if not store.check([keys[r]])]
        raise DistTimeoutError(
            f"{here} building the NCCL communicator: group ranks {missing} did not reach their "
            f"first op within {timeout.total_seconds():.0f}s; the communicator is built at the "
            f"group's first op, which every member must call (or pass NCCLOptions(device_id=...) "
            f"to build it when the group is created)") from err
    uid = _decode(store.get(_UID_KEY))
    try:
        with torch.cuda.device(device):
            return nccl.NcclCommunicator(size, uid, rank)
    except Exception as exc:
        raise DistBackendError(f"{here} ncclCommInitRank on {device} failed: "
                               f"{type(exc).__name__}: {exc}") from exc
