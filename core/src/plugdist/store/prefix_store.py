"""``PrefixStore``: a namespace inside another store."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from plugdist.store._util import check_key, check_keys
from plugdist.store.api import Store, to_bytes

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Every key is stored as ``f"{prefix}/{key}"`` in ``store``. Blocking, threading and timeout
    behaviour are the inner store's (``timeout``/``set_timeout`` read and change the inner store's
    timeout). ``num_keys`` counts the whole inner store, as torch.distributed does. Values reach
    the inner store as ``bytes``. ``has_extended_api`` is the inner store's: over a store without
    native ``append``/``multi_get``/``multi_set`` the base class's fallbacks run on the inner
    store. ``close`` does not close the inner store: whoever created it owns it."""

    def __init__(self, prefix: str, store: Store) -> None:
        if store is None:
            raise ValueError("PrefixStore: store argument cannot be None; pass the Store to "
                             "wrap (a TCPStore, FileStore, HashStore or another PrefixStore)")
        if not isinstance(prefix, str):
            raise TypeError(f"PrefixStore prefix must be str, got {type(prefix).__name__}")
        if not isinstance(store, Store):
            raise TypeError(f"PrefixStore wraps a plugdist Store, got {type(store).__name__}")
        super().__init__(store.timeout)
        self.prefix = prefix
        self.underlying_store = store

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self.underlying_store!r})"

    @property
    def _underlying_non_prefix_store(self) -> Store:
        """The first store under any stack of PrefixStores."""
        store = self.underlying_store
        while isinstance(store, PrefixStore):
            store = store.underlying_store
        return store

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{check_key(key)}"

    def _ks(self, keys: Sequence[str]) -> list[str]:
        return [f"{self.prefix}/{k}" for k in check_keys(keys)]

    @property
    def timeout(self) -> timedelta:
        return self.underlying_store.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self.underlying_store.set_timeout(timeout)

    def has_extended_api(self) -> bool:
        return self.underlying_store.has_extended_api()

    def clone(self) -> PrefixStore:
        return PrefixStore(self.prefix, self.underlying_store.clone())

    def delete_prefix(self, prefix: str) -> int:
        return self.underlying_store.delete_prefix(f"{self.prefix}/{prefix}")

    def hold_will(self, key: str, value: bytes | str, ttl: float | None = None) -> Any:
        if ttl is None:  # a store written before ttl existed still takes two arguments
            return self.underlying_store.hold_will(self._k(key), value)
        return self.underlying_store.hold_will(self._k(key), value, ttl=ttl)

    def claim_member(self, root: str, uid: str, world_size: int, ttl: float) -> Any:
        return self.underlying_store.claim_member(self._k(root), uid, world_size, ttl)

    def join_member(self, root: str, ttl: float) -> Any:
        return self.underlying_store.join_member(self._k(root), ttl)

    def membership_exposure(self) -> str | None:
        return self.underlying_store.membership_exposure()

    def keep_node_wills(self, directory: str) -> Any:
        return self.underlying_store.keep_node_wills(directory)

    def read_log(self, key: str, start: int, timeout: timedelta | None = None) -> list[bytes]:
        return self.underlying_store.read_log(self._k(key), start, timeout)

    def set(self, key: str, value: bytes | str) -> None:
        self.underlying_store.set(self._k(key), to_bytes(value))

    def get(self, key: str) -> bytes:
        return self.underlying_store.get(self._k(key))

    def add(self, key: str, amount: int) -> int:
        return self.underlying_store.add(self._k(key), amount)

    def append(self, key: str, value: bytes | str) -> None:
        self.underlying_store.append(self._k(key), to_bytes(value))

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        return self.underlying_store.compare_set(self._k(key), to_bytes(expected_value),
                                                 to_bytes(desired_value))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self.underlying_store.wait(self._ks(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self.underlying_store.check(self._ks(keys))

    def num_keys(self) -> int:
        return self.underlying_store.num_keys()

    def delete_key(self, key: str) -> bool:
        return self.underlying_store.delete_key(self._k(key))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self.underlying_store.multi_get(self._ks(keys))

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        self.underlying_store.multi_set(self._ks(keys), [to_bytes(v) for v in values])

    def queue_push(self, key: str, value: bytes | str) -> None:
        self.underlying_store.queue_push(self._k(key), to_bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self.underlying_store.queue_pop(self._k(key), block)

    def queue_len(self, key: str) -> int:
        return self.underlying_store.queue_len(self._k(key))
