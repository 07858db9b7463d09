"""A plugdist Store seen through torch's ``Store`` interface, for torch's C++ callers: the
rendezvous of torch's Gloo inside the gloo plugin, and the store of torch's default group when
plugdist's world is shared with torch (:mod:`plugdist._torch.bridge`).

A Python subclass of ``torch.distributed.Store`` is called back from C++ (on whatever thread
runs the caller) with ``str`` keys, ``bytes`` values and ``timedelta`` timeouts; each call is
passed on to the plugdist store, whose errors come back to C++ as Python exceptions. Imports
torch.distributed, so :mod:`plugdist.store` does not import this module: import it by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as tdist

from plugdist.store.api import Store

__all__ = ["PlugdistStoreForTorch"]


def _as_bytes(value: bytes | bytearray | str | Sequence[int]) -> bytes:
    # pybind hands values over as bytes; older torch releases passed std::vector<uint8_t> as a
    # list of ints, which bytes() also accepts.
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class PlugdistStoreForTorch(tdist.Store):
    """Adapts a plugdist :class:`~plugdist.store.Store` to ``torch.distributed.Store``.

    Thread-safe as far as the wrapped store is. Blocking calls (``get``, ``wait``) block for at
    most the given timeout, else the bridge's ``timeout``, else the wrapped store's, and raise
    its ``DistTimeoutError``. The wrapped store's own timeout is never changed: it is usually
    shared with other groups.
    """

    def __init__(self, store: Store, timeout: timedelta | None = None) -> None:
        super().__init__()
        self.store = store
        self._timeout = timeout
        if timeout is not None:
            tdist.Store.set_timeout(self, timeout)

    def set_timeout(self, timeout: timedelta) -> None:
        tdist.Store.set_timeout(self, timeout)  # torch keeps its own copy on the C++ side
        self._timeout = timeout

    def set(self, key: str, value: bytes | str) -> None:
        self.store.set(key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        if self._timeout is not None:
            self.store.wait([key], self._timeout)
        return self.store.get(key)

    def add(self, key: str, value: int) -> int:
        return self.store.add(key, int(value))

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        return self.store.compare_set(key, _as_bytes(expected_value), _as_bytes(desired_value))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self.store.wait(list(keys), timeout if timeout is not None else self._timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self.store.check(list(keys))

    def num_keys(self) -> int:
        return self.store.num_keys()

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)

    # torch's C++ trampoline looks these two up by their C++ names
    getNumKeys = num_keys  # noqa: N815
    deleteKey = delete_key  # noqa: N815
