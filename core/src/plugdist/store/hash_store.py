"""``HashStore``: an in-process, thread-safe store (for tests and single-process groups)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Sequence

from ..errors import DistStoreError, DistTimeoutError
from .api import DEFAULT_STORE_TIMEOUT, Store, to_bytes, to_seconds

__all__ = ["HashStore"]


class HashStore(Store):
    """A dict behind a condition variable. Blocking calls wait on the condition, not a poll loop."""

    def __init__(self, timeout: timedelta = DEFAULT_STORE_TIMEOUT) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes | str) -> None:
        with self._cond:
            self._data[key] = to_bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self._cond:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            raw = self._data.get(key, b"0")
            try:
                value = int(raw) + int(amount)
            except ValueError:
                raise DistStoreError(f"add({key!r}) met a value that is not an integer "
                                     f"({raw[:32]!r}); the key was written by set()") from None
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        expected, desired = to_bytes(expected_value), to_bytes(desired_value)
        with self._cond:
            current = self._data.get(key)
            if (current is None and expected == b"") or current == expected:
                self._data[key] = desired
                self._cond.notify_all()
                return desired
            return expected if current is None else current

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        limit = to_seconds(timeout if timeout is not None else self.timeout)
        deadline = time.monotonic() + limit
        with self._cond:
            while True:
                missing = [k for k in keys if k not in self._data]
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DistTimeoutError(f"HashStore: timed out after {limit:.1f}s waiting for "
                                           f"keys {missing}")
                self._cond.wait(left)

    def check(self, keys: Sequence[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def num_keys(self) -> int:
        with self._cond:
            return len(self._data)

    def delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None
