"""The ``Store`` interface: a key-value store shared by every rank of a job.

Keys are ``str``; values are ``bytes`` (``str`` values are accepted and UTF-8 encoded). Every
method is thread-safe. Methods that wait (``get``, ``wait``) block the calling thread until the
keys exist or the timeout passes, then raise :class:`~plugdist.errors.DistTimeoutError` naming
the missing keys. ``add`` on a key written by ``set`` with a non-integer value raises
``DistStoreError``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from datetime import timedelta

__all__ = ["Store", "DEFAULT_STORE_TIMEOUT", "to_bytes", "to_seconds"]

DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)


def to_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    """Store values are bytes; ``str`` is UTF-8 encoded."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store values must be bytes or str, got {type(value).__name__}")


def to_seconds(timeout: timedelta | float | int) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class Store(abc.ABC):
    """Abstract key-value store. See the module docstring for the shared contract."""

    def __init__(self, timeout: timedelta = DEFAULT_STORE_TIMEOUT) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        """Default timeout of ``get`` and ``wait``."""
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        """Change the default timeout of ``get`` and ``wait``."""
        self._timeout = timeout

    @abc.abstractmethod
    def set(self, key: str, value: bytes | str) -> None:
        """Write ``value`` under ``key``, replacing any value; wakes waiters on ``key``."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The value of ``key``; blocks until it exists, up to the store's timeout."""

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer under ``key`` (created at 0); returns the sum."""

    @abc.abstractmethod
    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        """Atomically set ``key`` to ``desired_value`` if its value equals ``expected_value``
        (or if the key is missing and ``expected_value`` is empty); returns the value now held.
        A missing key with a non-empty ``expected_value`` is left missing and ``expected_value``
        is returned."""

    @abc.abstractmethod
    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Block until every key in ``keys`` exists, or raise DistTimeoutError naming the missing."""

    @abc.abstractmethod
    def check(self, keys: Sequence[str]) -> bool:
        """True when every key in ``keys`` exists right now. Does not block."""

    @abc.abstractmethod
    def num_keys(self) -> int:
        """Number of keys stored."""

    @abc.abstractmethod
    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``; blocks like ``get`` until all exist."""
        return [self.get(k) for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        """Set each key to the matching value."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        for k, v in zip(keys, values):
            self.set(k, v)

    def close(self) -> None:
        """Release connections and files. Idempotent."""
