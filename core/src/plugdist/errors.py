"""The one error tree of plugdist.

    RuntimeError
    └── DistError                  anything plugdist raises on purpose
        ├── DistBackendError       a backend failed an op (its own message kept)
        │   └── DistRankFailureError  a member of the group died or hung (``.ranks`` names it)
        │       └── DistExcludedError  this process itself was declared failed and left out
        ├── DistStoreError         a key-value store refused or failed a request
        │   ├── DistTimeoutError   (also a DistError) a wait ran past its timeout
        │   └── QueueEmptyError    a non-blocking queue_pop found the queue empty
        ├── DistNetworkError       a connection could not be made or was lost
        ├── NotInitializedError    (also a ValueError) a call that needs the default group
        │                          came before init_process_group
        ├── RendezvousError        (also a ValueError) the processes could not find each other:
        │   │                      the init_method or environment says too little, or
        │   │                      plugdist-run's nodes could not form a round
        │   ├── RendezvousInterrupted  plugdist-run got a signal while waiting for the nodes
        │   └── StoreLost          plugdist-run's rendezvous store went away
        ├── LaunchError            plugdist-run could not start a worker
        ├── PluginNotFoundError    (also a ValueError) no plugin of that name (or it failed to
        │   │                      load: the reason is in the message)
        │   ├── PluginAPIError     a plugin written for another plugin API
        │   └── PluginHookError    (also a HookContractError) an installed plugin that breaks
        │                          the hook contract
        ├── BelowMinWorldSizeError  fault-tolerant training lost more ranks than it may
        ├── WorldClosedError       a process asked to join a world whose members had all left
        ├── WorldError             a test world's ranks failed or hung (plugdist.testing;
        │                          ``.results`` holds each rank's report)
        └── HookContractError      (also a TypeError) a backend class or plugin breaks the
                                   hook contract: refused when the class is created

Messages name what the user needs to act: rank, group, op, backend, and the fix. A timeout
starts with torch's words for the same event (:func:`timed_out`, :func:`store_timeout`), which
torch's tests and users' scripts match (``" (Timed out|closed|timeout) "``).
``DistTimeoutError`` is also raised by collectives (a peer that never answered), hence
it is a ``DistError`` first and a ``DistStoreError`` second: ``except DistStoreError``
around a store call still catches store timeouts.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DistError",
    "DistBackendError",
    "DistRankFailureError",
    "DistExcludedError",
    "DistStoreError",
    "DistNetworkError",
    "DistTimeoutError",
    "QueueEmptyError",
    "NotInitializedError",
    "RendezvousError",
    "RendezvousInterrupted",
    "StoreLost",
    "LaunchError",
    "PluginNotFoundError",
    "PluginAPIError",
    "BelowMinWorldSizeError",
    "WorldClosedError",
    "WorldError",
    "HookContractError",
    "PluginHookError",
    "where",
    "op_timeout",
    "timed_out",
    "store_timeout",
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


class DistExcludedError(DistRankFailureError):
    """This process is no longer a member of the world: the others declared it failed while it
    was alive (stopped, stalled, cut off by the network) or shrank it away, and went on. It can
    come back only as a new process (``init_process_group(..., join=True)``). A worker under
    ``plugdist-run`` that exits with :attr:`exit_code` (75, EX_TEMPFAIL) is treated as a lost
    rank: replaced with ``--replace-failed``, not a failure of the run."""

    exit_code = 75


class DistStoreError(DistError):
    """A key-value store refused or failed a request."""


class DistNetworkError(DistError):
    """A connection could not be made, or was lost."""


class DistTimeoutError(DistStoreError):
    """A wait (store key, collective, barrier) ran past its timeout."""


class QueueEmptyError(DistStoreError):
    """``queue_pop(key, block=False)`` found the queue empty."""


class NotInitializedError(DistError, ValueError):
    """An API call that needs a default group came before ``init_process_group``."""


class RendezvousError(DistError, ValueError):
    """The processes could not find each other: the init_method or the environment does not
    say enough (``env://`` without MASTER_ADDR, ...), or plugdist-run's nodes could not form a
    round (timeout, conflicting node ranks, a busy port)."""


class RendezvousInterrupted(RendezvousError):
    """plugdist-run got a signal while waiting for the other nodes."""


class StoreLost(RendezvousError):
    """plugdist-run's rendezvous store stopped answering (its host left or died)."""


class LaunchError(DistError):
    """plugdist-run could not start a worker."""


class PluginNotFoundError(DistError, ValueError):
    """No plugin of that name in that group (or it failed to load: the reason is in the message)."""


class PluginAPIError(PluginNotFoundError):
    """A plugin written for a plugin API this core does not provide (see ``PLUGIN_API``)."""


class BelowMinWorldSizeError(DistError):
    """The world lost so many ranks that it fell below ``min_world_size``."""


class WorldClosedError(DistError):
    """A process asked to join a world whose members had all left."""


class WorldError(DistError):
    """One or more ranks of a test world (:func:`plugdist.testing.run_world`) failed or hung;
    ``results`` holds every rank's ``RankResult``."""

    def __init__(self, message: str, results: list[Any]) -> None:
        super().__init__(message)
        self.results = results

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.results))
class HookContractError(DistError, TypeError):
    """A backend class, or a pluggy plugin, breaks the hook contract: a name that looks like a
    hook but is none (a misspelling), or a hook whose parameters differ from its spec. A backend
    class is refused when it is created; a plugin is left out by the registry, which reports it
    (``plugdist info``) and raises this when it is asked for. The message names the class or
    plugin, the hook, the nearest valid name and the change to make."""


class PluginHookError(PluginNotFoundError, HookContractError):
    """An installed plugin that breaks the hook contract: a backend class refused at its
    creation, a pluggy plugin implementing a hook with no spec (see
    ``plugdist._backend.hook_checks``)."""


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


def timed_out(here: str, seconds: float | None,
              waiting_for: str = "the operation to complete") -> str:
    """``<here> Timed out waiting <N>ms for <waiting_for>``: torch's (gloo's) words for an op,
    a barrier or a group's creation that did not finish in time, after ``here`` (a
    :func:`where`). Every such plugdist message starts so; the cause and fix follow."""
    return f"{here} Timed out waiting {round((seconds or 0) * 1000)}ms for {waiting_for}"


def store_timeout(op: str, seconds: float, detail: str) -> str:
    """``<op> timeout after <s>s; <detail>``: torch's TCPStore words for a store request
    (``wait``, ``get``, ...) whose keys did not appear in time."""
    return f"{op} timeout after {seconds:.3g}s; {detail}"


def op_timeout(here: str, seconds: float | None) -> DistTimeoutError:
    """The error for an op that did not complete within ``seconds``; ``here`` is its
    :func:`where`."""
    return DistTimeoutError(
        f"{timed_out(here, seconds)}: a peer may have died, be stuck, or be running a different "
        f"op; check every rank's logs (the debug plugin's TORCH_DISTRIBUTED_DEBUG=DETAIL names "
        f"the ranks that never arrived)")
