"""``GroupLike``: what a group offers the code that works on its behalf.

The one protocol of a group for the modules that must not import the group class itself: the
composition of ops (:mod:`plugdist._group.composition`), sparse all_reduce, and a backend's own
Work classes (plugdist-gloo's). A backend (``BackendBase``) and a ``ProcessGroup`` satisfy it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

from plugdist._backend.abort import AbortSignal
from plugdist._backend.capabilities import Capabilities

__all__ = ["GroupLike"]


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
