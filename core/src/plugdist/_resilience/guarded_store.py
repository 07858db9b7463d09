"""A group's store that gives up on a dead member.

While a group is built its members exchange keys through a prefix of the world's store; a
member that died will never write its key. :class:`GuardedPrefixStore`'s blocking reads
(``get``, ``wait``, ``multi_get``) wait in slices of at most 0.2 s and, between slices, ask
the membership (``first_failure``, which does not block) whether one of the group's members is
known to have failed: ``DistRankFailureError`` then, so that a member dying mid-build fails the
build in about a second instead of at the timeout. A store that does not answer (a replicated
store electing a leader) is ridden out for up to ``_STORE_GRACE`` seconds. Thread-safe as the
underlying store is.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

from plugdist.errors import DistError, DistTimeoutError
from plugdist.store import PrefixStore, Store

__all__ = ["GuardedPrefixStore", "FailureWatch"]

_STORE_GRACE = 10.0  # seconds a guarded wait rides out a store that does not answer


class FailureWatch(Protocol):
    """What the guard asks of a membership."""

    def first_failure(self, uids: Sequence[str], /) -> DistError | None: ...


class GuardedPrefixStore(PrefixStore):
    """A PrefixStore whose blocking reads (``get``, ``wait``, ``multi_get``) give up with
    ``DistRankFailureError`` as soon as one of ``uids`` is known to have failed, instead of
    waiting out the timeout for a key a dead member will never write. Used while a group is
    built, so that a member dying mid-build fails the build in about a second."""

    def __init__(self, prefix: str, store: Store, membership: FailureWatch,
                 uids: Sequence[str]) -> None:
        super().__init__(prefix, store)
        self._membership = membership
        self._uids = tuple(uids)

    def _until_present(self, keys: list[str], timeout: timedelta | None) -> None:
        limit = (timeout if timeout is not None else self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        unavailable_since: float | None = None
        while True:
            left = deadline - time.monotonic()
            try:
                self.underlying_store.wait(keys, timedelta(seconds=max(0.0, min(0.2, left))))
                return
            except DistTimeoutError:
                unavailable_since = None
                if time.monotonic() >= deadline:
                    raise
            except DistError:
                # a replicated store (etcd) electing a leader answers no one for a moment; a
                # store that stays away is an error after _STORE_GRACE
                now = time.monotonic()
                unavailable_since = unavailable_since or now
                if now - unavailable_since > _STORE_GRACE or now >= deadline:
                    raise
                time.sleep(0.05)
            failure = self._membership.first_failure(self._uids)
            if failure is not None:
                raise failure

    def get(self, key: str) -> bytes:
        self._until_present(self._ks([key]), None)
        return super().get(key)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._until_present(self._ks(keys), timeout)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self._until_present(self._ks(keys), None)
        return super().multi_get(keys)
