"""``HashStore``: an in-process, thread-safe store (for tests and single-process groups)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from datetime import timedelta

from plugdist.errors import DistStoreError, DistTimeoutError, QueueEmptyError, store_timeout
from plugdist.store._util import check_amount, check_key, check_keys
from plugdist.store.api import DEFAULT_STORE_TIMEOUT, Store, to_bytes, to_seconds

__all__ = ["HashStore"]

# the longest a Condition.wait is asked to sleep at once: larger values overflow the lock's limit
_MAX_NAP = 86400.0


class HashStore(Store):
    """A dict behind a condition variable. Blocking calls wait on the condition (woken by every
    write), never a poll loop. Shared by threads of one process; not visible to other processes.
    ``clone()`` returns this same object: it is already safe to share between threads."""

    def __init__(self, timeout: timedelta = DEFAULT_STORE_TIMEOUT) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, deque[bytes]] = {}
        self._cond = threading.Condition()

    def __repr__(self) -> str:
        return f"HashStore(<{len(self._data)} keys>)"

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> HashStore:
        return self

    def set(self, key: str, value: bytes | str) -> None:
        v = to_bytes(value)
        with self._cond:
            self._data[check_key(key)] = v
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        with self._cond:
            self._wait_locked([check_key(key)], None, "get", what="value")
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

    def append(self, key: str, value: bytes | str) -> None:
        v = to_bytes(value)
        with self._cond:
            self._data[check_key(key)] = self._data.get(key, b"") + v
            self._cond.notify_all()

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
            self._wait_locked(ks, timeout, "wait")

    def _present(self, key: str, what: str) -> bool:
        """``what``: "value" (get), "queue" (queue_pop) or "any" (wait, check)."""
        if what == "value":
            return key in self._data
        if what == "queue":
            return bool(self._queues.get(key))
        return key in self._data or bool(self._queues.get(key))

    def _wait_locked(self, keys: list[str], timeout: timedelta | None, op: str,
                     what: str = "any") -> None:
        limit = to_seconds(timeout if timeout is not None else self.timeout)
        deadline = time.monotonic() + limit
        while True:
            missing = [k for k in keys if not self._present(k, what)]
            if not missing:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistTimeoutError(
                    f"HashStore: {store_timeout(op, limit, f'missing keys {missing}')}")
            self._cond.wait(min(left, _MAX_NAP))

    def check(self, keys: Sequence[str]) -> bool:
        ks = check_keys(keys)
        with self._cond:
            return all(self._present(k, "any") for k in ks)

    def num_keys(self) -> int:
        with self._cond:
            return len(self._data)

    def delete_key(self, key: str) -> bool:
        with self._cond:
            had_value = self._data.pop(check_key(key), None) is not None
            return bool(self._queues.pop(key, None)) or had_value

    def delete_prefix(self, prefix: str) -> int:
        with self._cond:
            doomed = {k for k in self._data if k.startswith(prefix)}
            doomed |= {k for k in self._queues if k.startswith(prefix)}
            for k in doomed:
                self._data.pop(k, None)
                self._queues.pop(k, None)
            return len(doomed)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        ks = check_keys(keys)
        with self._cond:
            self._wait_locked(ks, None, "multi_get", what="value")
            return [self._data[k] for k in ks]

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        ks = check_keys(keys)
        if len(ks) != len(values):
            raise ValueError(f"multi_set got {len(ks)} keys but {len(values)} values")
        vs = [to_bytes(v) for v in values]
        with self._cond:
            self._data.update(zip(ks, vs, strict=True))
            self._cond.notify_all()

    def queue_push(self, key: str, value: bytes | str) -> None:
        v = to_bytes(value)
        with self._cond:
            self._queues.setdefault(check_key(key), deque()).append(v)
            self._cond.notify_all()

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        check_key(key)
        with self._cond:
            if not block:
                q = self._queues.get(key)
                if not q:
                    raise QueueEmptyError(f"HashStore: queue_pop({key!r}, block=False): the "
                                          f"queue is empty")
            else:
                self._wait_locked([key], None, "queue_pop", what="queue")
                q = self._queues[key]
            value = q.popleft()
            if not q:
                del self._queues[key]
            return value

    def queue_len(self, key: str) -> int:
        with self._cond:
            return len(self._queues.get(check_key(key), ()))
