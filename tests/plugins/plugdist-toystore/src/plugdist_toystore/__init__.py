"""A third party's store, as small as one can be: one file per key in a directory shared by the
processes (``dirstore:///PATH``), a lock file for the atomic ops, ``get``/``wait`` poll. It
overrides the core operations only; the Store base class supplies the rest."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from plugdist.errors import DistStoreError, DistTimeoutError
from plugdist.store import Store
from plugdist.store.api import to_bytes, to_seconds

plugin_api = (2, 0)  # written for plugdist's plugin API 2.x (checked when the store loads)


class DirStore(Store):
    def __init__(self, path: str, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__(timeout)
        self.path = path
        os.makedirs(path, exist_ok=True)

    @classmethod
    def from_url(cls, url: str, *, timeout: timedelta, **_: Any) -> DirStore:
        return cls(urlparse(url).path, timeout)

    def _file(self, key: str) -> str:
        return os.path.join(self.path, key.encode().hex())

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(os.path.join(self.path, ".lock"), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _read(self, key: str) -> bytes | None:
        try:
            with open(self._file(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _write(self, key: str, value: bytes) -> None:
        tmp = self._file(key) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(value)
        os.replace(tmp, self._file(key))

    def set(self, key: str, value: bytes | str) -> None:
        with self._locked():
            self._write(key, to_bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self._read(key)
        if value is None:
            raise DistStoreError(f"dirstore: {key!r} was deleted while read")
        return value

    def add(self, key: str, amount: int) -> int:
        with self._locked():
            n = int(self._read(key) or b"0") + amount
            self._write(key, str(n).encode())
            return n

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        expected, desired = to_bytes(expected_value), to_bytes(desired_value)
        with self._locked():
            current = self._read(key)
            if (current is None and expected == b"") or current == expected:
                self._write(key, desired)
                return desired
            return expected if current is None else current

    def check(self, keys: Sequence[str]) -> bool:
        return all(os.path.exists(self._file(k)) for k in keys)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        limit = to_seconds(timeout if timeout is not None else self.timeout)
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() >= deadline:
                missing = [k for k in keys if not os.path.exists(self._file(k))]
                raise DistTimeoutError(f"dirstore: wait timeout after {limit}s; missing {missing}")
            time.sleep(0.01)

    def num_keys(self) -> int:
        return sum(1 for n in os.listdir(self.path) if not n.startswith("."))

    def delete_key(self, key: str) -> bool:
        with self._locked():
            try:
                os.remove(self._file(key))
                return True
            except FileNotFoundError:
                return False
