"""The one error tree of plugdist.

    RuntimeError
    └── DistError                  anything plugdist raises on purpose
        ├── DistBackendError       a backend failed an op (its own message kept)
        │   └── DistRankFailureError  a member of the group died or hung (``.ranks`` names it)
        ├── DistStoreError         a key-value store refused or failed a request
        │   ├── DistTimeoutError   (also a DistError) a wait ran past its timeout
        │   └── QueueEmptyError    a non-blocking queue_pop found the queue empty
        └── DistNetworkError       a connection could not be made or was lost

Messages name what the user needs to act: rank, group, op, backend, and the fix.
``DistTimeoutError`` is also raised by collectives (a peer that never answered), hence
it is a ``DistError`` first and a ``DistStoreError`` second: ``except DistStoreError``
around a store call still catches store timeouts.
"""

from __future__ import annotations

__all__ = [
    "DistError",
    "DistBackendError",
    "DistRankFailureError",
    "DistStoreError",
    "DistNetworkError",
    "DistTimeoutError",
    "QueueEmptyError",
    "where",
    "op_timeout",
]


class DistError(RuntimeError):
    """Base of every error plugdist raises on purpose."""


class DistBackendError(DistError):
    """A backend failed an operation; the backend's own message is kept."""


class DistRankFailureError(DistBackendError):
    """An op could not complete because members of its group failed (died, or stopped sending
    heartbeats). ``ranks`` holds the failed global ranks known when it was raised; the
    survivors continue with :func:`plugdist.shrink_group`."""

    def __init__(self, message: str, ranks: tuple[int, ...] | list[int] = ()) -> None:
        super().__init__(message)
        self.ranks: tuple[int, ...] = tuple(sorted(ranks))

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.ranks))


class DistStoreError(DistError):
    """A key-value store refused or failed a request."""


class DistNetworkError(DistError):
    """A connection could not be made, or was lost."""


class DistTimeoutError(DistStoreError):
    """A wait (store key, collective, barrier) ran past its timeout."""


class QueueEmptyError(DistStoreError):
    """``queue_pop(key, block=False)`` found the queue empty."""


def where(*, rank: int | None = None, group: str | None = None, op: str | None = None,
          backend: str | None = None) -> str:
    """Format the 'where' part of an error message: ``[rank 1, group 'world', op all_reduce]``."""
    parts = []
    if rank is not None:
        parts.append(f"rank {rank}")
    if group is not None:
        parts.append(f"group {group!r}")
    if backend is not None:
        parts.append(f"backend {backend!r}")
    if op is not None:
        parts.append(f"op {op}")
    return "[" + ", ".join(parts) + "]" if parts else ""


def op_timeout(here: str, seconds: float | None) -> DistTimeoutError:
    """The error for an op that did not complete within ``seconds``; ``here`` is its
    :func:`where`."""
    return DistTimeoutError(
        f"{here} did not complete within {seconds or 0:.1f}s: a peer may have died, be stuck, "
        f"or be running a different op; check every rank's logs (the debug plugin's "
        f"TORCH_DISTRIBUTED_DEBUG=DETAIL names the ranks that never arrived)")
