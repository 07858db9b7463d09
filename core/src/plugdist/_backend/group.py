"""``GroupLike``: what a group offers the code that works on its behalf; ``GroupIdentity``: the
identity accessors a backend and a ``ProcessGroup`` share.

The one protocol of a group for the modules that must not import the group class itself: the
composition of ops (:mod:`plugdist._group.composition`), sparse all_reduce, and a backend's own
Work classes (plugdist-gloo's). A backend (``BackendBase``) and a ``ProcessGroup`` satisfy it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

from plugdist._backend.abort import AbortSignal
from plugdist._backend.capabilities import Capabilities

__all__ = ["GroupIdentity", "GroupLike"]


class GroupLike(Protocol):
    """A group's identity, context and capabilities; no ops (each user names the ops it calls
    in a protocol of its own that extends this one)."""

    @property
    def group_name(self) -> str: ...
    @property
    def backend_name(self) -> str: ...
    @property
    def device_types(self) -> tuple[str, ...]: ...
    @property
    def timeout(self) -> timedelta: ...
    @property
    def abort_signal(self) -> AbortSignal: ...
    def rank(self) -> int: ...
    def size(self) -> int: ...
    def capabilities(self) -> Capabilities: ...
    def where(self, op: str) -> str: ...


class GroupIdentity:
    """``rank()``, ``size()``, ``group_name`` and ``timeout``, read from the ``group_rank``,
    ``group_size`` and ``options`` (a ``GroupOptions``) that the class sets in ``__init__``."""

    group_rank: int
    group_size: int
    options: Any

    def rank(self) -> int:
        """This process's rank within the group."""
        return self.group_rank

    def size(self) -> int:
        """Number of processes in the group."""
        return self.group_size

    @property
    def group_name(self) -> str:
        return self.options.group_name  # type: ignore[no-any-return]

    @property
    def timeout(self) -> timedelta:
        return self.options.timeout  # type: ignore[no-any-return]
