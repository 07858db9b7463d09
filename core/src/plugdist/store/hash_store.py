"""``HashStore``: an in-process, thread-safe store (for tests and single-process groups)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta

from ..errors import DistStoreError, DistTimeoutError
from ._util import check_amount, check_key, check_keys
from .api import DEFAULT_STORE_TIMEOUT, Store, to_bytes, to_seconds

__all__ = ["HashStore"]


class HashStore(Store):
    """A dict behind a condition variable. Blocking calls wait on the condition (woken by every
    write), never a poll loop. Shared by threads of one process; not visible to other processes."""

    def __init__(self, timeout: timedelta = DEFAULT_STORE_TIMEOUT) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def __repr__(self) -> str:
        return f"HashStore(<{len(self._data)} keys>)"

    def set(self, key: str, value: bytes | str) -> None:
        v = to_bytes(value)
        with self._cond:
            self._data[check_key(key)] = v
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        with self._cond:
            self._wait_locked([check_key(key)], None)
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        check_amount(amount)
        with self._cond:
            raw = self._data.get(check_key(key), b"0")
            try:
                value = int(raw) + amount
            except ValueError:
                raise DistStoreError(f"HashStore: add({key!r}) met a value that is not an integer "
                                     f"({raw[:32]!r}): the key was written by set(); use a "
                                     f"separate key for counters") from None
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        expected, desired = to_bytes(expected_value), to_bytes(desired_value)
        with self._cond:
            current = self._data.get(check_key(key))
            if (current is None and expected == b"") or current == expected:
                self._data[key] = desired
                self._cond.notify_all()
                return desired
            return expected if current is None else current

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        ks = check_keys(keys)
        with self._cond:
            self._wait_locked(ks, timeout)

    def _wait_locked(self, keys: list[str], timeout: timedelta | None) -> None:
        limit = to_seconds(timeout if timeout is not None else self.timeout)
        deadline = time.monotonic() + limit
        while True:
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistTimeoutError(f"HashStore: timed out after {limit:.3g}s waiting for "
                                       f"keys {missing}")
            self._cond.wait(min(left, 86400.0))  # huge timeouts overflow the lock's limit

    def check(self, keys: Sequence[str]) -> bool:
        ks = check_keys(keys)
        with self._cond:
            return all(k in self._data for k in ks)

    def num_keys(self) -> int:
        with self._cond:
            return len(self._data)

    def delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(check_key(key), None) is not None

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        ks = check_keys(keys)
        with self._cond:
            self._wait_locked(ks, None)
            return [self._data[k] for k in ks]

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        ks = check_keys(keys)
        if len(ks) != len(values):
            raise ValueError(f"multi_set got {len(ks)} keys but {len(values)} values")
        vs = [to_bytes(v) for v in values]
        with self._cond:
            self._data.update(zip(ks, vs, strict=True))
            self._cond.notify_all()

