"""``PrefixStore``: a namespace inside another store."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from ._util import check_key, check_keys
from .api import Store

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Every key is stored as ``f"{prefix}/{key}"`` in ``store``. Blocking, threading and timeout
    behaviour are the inner store's (``timeout``/``set_timeout`` read and change the inner store's
    timeout). ``num_keys`` counts the whole inner store, as torch.distributed does. ``close`` does
    not close the inner store: whoever created it owns it."""

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"PrefixStore prefix must be str, got {type(prefix).__name__}")
        if not isinstance(store, Store):
            raise TypeError(f"PrefixStore wraps a plugdist Store, got {type(store).__name__}")
        super().__init__(store.timeout)
        self.prefix = prefix
        self.underlying_store = store

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self.underlying_store!r})"

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{check_key(key)}"

    def _ks(self, keys: Sequence[str]) -> list[str]:
        return [f"{self.prefix}/{k}" for k in check_keys(keys)]

    @property
    def timeout(self) -> timedelta:
        return self.underlying_store.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self.underlying_store.set_timeout(timeout)

    def set(self, key: str, value: bytes | str) -> None:
        self.underlying_store.set(self._k(key), value)

    def get(self, key: str) -> bytes:
        return self.underlying_store.get(self._k(key))

    def add(self, key: str, amount: int) -> int:
        return self.underlying_store.add(self._k(key), amount)

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        return self.underlying_store.compare_set(self._k(key), expected_value, desired_value)

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
        self.underlying_store.multi_set(self._ks(keys), values)
