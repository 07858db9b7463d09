"""``FileStore``: a store kept in one file that every process opens (shared filesystem or local).

The file is an append-only log of records, each ``!BII`` (kind, key length, value length), the key,
the value. A writer holds an exclusive ``fcntl.flock`` while it reads the records it has not seen
and appends its own, so read-modify-write ops (``add``, ``compare_set``) are atomic across
processes; readers take a shared lock. Each store object caches the log's state and reads only the
tail it has not seen. Files have no change notification, so ``get``/``wait`` poll the file size
with a short sleep (1 ms growing to 20 ms) until the keys appear or the timeout passes.

Every store object appends a JOIN record when opened and a LEAVE record when closed; with a fixed
``world_size`` the store that writes the ``world_size``-th LEAVE deletes the file. With
``world_size=-1`` the file is left in place (delete it yourself, or reuse it: old keys remain).
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta

from ..errors import DistStoreError, DistTimeoutError
from ._util import check_amount, check_key, check_keys
from .api import DEFAULT_STORE_TIMEOUT, Store, to_bytes, to_seconds

__all__ = ["FileStore"]

_REC = struct.Struct("!BII")
_SET, _JOIN, _LEAVE = 1, 2, 3
_POLL_MIN, _POLL_MAX = 0.001, 0.02
# (current value or None) -> (value to write or None, result to return)
_Updater = Callable[[bytes | None], tuple[bytes | None, bytes]]


class _Log:
    """The file and this process's view of it. Holds no reference to the store, so the store's
    finalizer can release it. Every method takes ``mutex``; callers must not hold it."""

    def __init__(self, path: str, world_size: int) -> None:
        self.path = path
        self.world_size = world_size
        self.mutex = threading.Lock()
        self.data: dict[str, bytes] = {}
        self.joins = 0
        self.leaves = 0
        self.offset = 0
        self.released = False
        self.pid = os.getpid()
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise DistStoreError(f"FileStore: cannot open {path!r} ({e.strerror}); the directory "
                                 f"must exist and be writable by every process") from e
        self.append([(_JOIN, b"", b"")])

    # -- under flock ------------------------------------------------------------------------

    def _lock(self, exclusive: bool) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)

    def _unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _read_tail(self) -> None:
        size = os.fstat(self.fd).st_size
        if size <= self.offset:
            return
        buf = os.pread(self.fd, size - self.offset, self.offset)
        pos, end = 0, len(buf)
        while end - pos >= _REC.size:
            kind, kl, vl = _REC.unpack_from(buf, pos)
            stop = pos + _REC.size + kl + vl
            if stop > end:
                break  # a writer died mid-record; nothing after it can be trusted either
            if kind == _SET:
                key = buf[pos + _REC.size:pos + _REC.size + kl].decode()
                self.data[key] = buf[pos + _REC.size + kl:stop]
            elif kind == _JOIN:
                self.joins += 1
            elif kind == _LEAVE:
                self.leaves += 1
            pos = stop
        self.offset += pos

    def _write(self, records: list[tuple[int, bytes, bytes]]) -> None:
        out = b"".join(_REC.pack(kind, len(k), len(v)) + k + v for kind, k, v in records)
        view = memoryview(out)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        # we read everything before appending under the exclusive lock: the log is now exactly
        # what we have applied plus our records
        self.offset += len(out)
        for kind, k, v in records:
            if kind == _SET:
                self.data[k.decode()] = v
            elif kind == _JOIN:
                self.joins += 1
            elif kind == _LEAVE:
                self.leaves += 1

    # -- public -----------------------------------------------------------------------------

    def refresh(self) -> None:
        """Apply records other processes appended since the last look."""
        with self.mutex:
            self._check_open()
            if os.fstat(self.fd).st_size <= self.offset:
                return
            self._lock(False)
            try:
                self._read_tail()
            finally:
                self._unlock()

    def append(self, records: list[tuple[int, bytes, bytes]]) -> None:
        with self.mutex:
            self._check_open()
            self._lock(True)
            try:
                self._read_tail()
                self._write(records)
            finally:
                self._unlock()

    def update(self, key: str, fn: _Updater) -> bytes:
        """Atomically: read ``key``'s current value (None if missing), ``fn`` returns
        (value to write or None, result); write it; return the result."""
        with self.mutex:
            self._check_open()
            self._lock(True)
            try:
                self._read_tail()
                new, result = fn(self.data.get(key))
                if new is not None:
                    self._write([(_SET, key.encode(), new)])
                return result
            finally:
                self._unlock()

    def _check_open(self) -> None:
        if self.released:
            raise DistStoreError(f"FileStore({self.path!r}) is closed")

    def release(self) -> None:
        """Append LEAVE; the ``world_size``-th LEAVE deletes the file. Idempotent."""
        if os.getpid() != self.pid:
            return  # a forked child inherited this store: leaving is the parent's business
        with self.mutex:
            if self.released:
                return
            self.released = True
            try:
                self._lock(True)
                try:
                    self._read_tail()
                    self._write([(_LEAVE, b"", b"")])
                    if self.world_size > 0 and self.leaves == self.world_size:
                        try:
                            os.unlink(self.path)
                        except FileNotFoundError:
                            pass
                finally:
                    self._unlock()
            except OSError:
                pass  # at interpreter exit the file system may be gone; nothing left to do
            finally:
                os.close(self.fd)


class FileStore(Store):
    """A store in the file ``file_name``, shared by every process that opens the same path.

    ``world_size`` is the number of store objects that will use the file (-1: unknown); the last
    of them to close deletes it. Thread-safe; cross-process atomic. ``delete_key`` is not
    supported (as in torch.distributed) and raises DistStoreError.
    """

    def __init__(self, file_name: str, world_size: int = -1,
                 timeout: timedelta = DEFAULT_STORE_TIMEOUT) -> None:
        super().__init__(timeout)
        if not isinstance(world_size, int) or (world_size < 1 and world_size != -1):
            raise ValueError(f"FileStore world_size must be >= 1, or -1 for an unknown number of "
                             f"users; got {world_size!r}")
        self.path = os.fspath(file_name)
        self.world_size = world_size
        self._log = _Log(self.path, world_size)
        self._finalizer = weakref.finalize(self, self._log.release)

    def __repr__(self) -> str:
        return f"FileStore({self.path!r})"

    def set(self, key: str, value: bytes | str) -> None:
        self._log.append([(_SET, check_key(key).encode(), to_bytes(value))])

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self._log.mutex:
            return self._log.data[key]

    def add(self, key: str, amount: int) -> int:
        check_key(key)
        check_amount(amount)

        def bump(current: bytes | None) -> tuple[bytes, bytes]:
            try:
                total = (0 if current is None else int(current)) + amount
            except ValueError:
                raise DistStoreError(
                    f"{self!r}: add({key!r}) met a value that is not an integer "
                    f"({current[:32]!r}): the key was written by set(); use a separate key for "
                    f"counters") from None
            out = str(total).encode()
            return out, out

        return int(self._log.update(key, bump))

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        check_key(key)
        expected, desired = to_bytes(expected_value), to_bytes(desired_value)

        def swap(current: bytes | None) -> tuple[bytes | None, bytes]:
            if current is None:
                return (desired, desired) if expected == b"" else (None, expected)
            if current == expected:
                return desired, desired
            return None, current

        return self._log.update(key, swap)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        keys = check_keys(keys)
        limit = to_seconds(timeout if timeout is not None else self.timeout)
        deadline = time.monotonic() + limit
        nap = _POLL_MIN
        log = self._log
        while True:
            log.refresh()
            with log.mutex:
                missing = [k for k in keys if k not in log.data]
            if not missing:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistTimeoutError(f"{self!r}: timed out after {limit:.3g}s waiting for keys "
                                       f"{missing}")
            time.sleep(min(nap, left))
            nap = min(nap * 2, _POLL_MAX)

    def check(self, keys: Sequence[str]) -> bool:
        keys = check_keys(keys)
        self._log.refresh()
        with self._log.mutex:
            return all(k in self._log.data for k in keys)

    def num_keys(self) -> int:
        self._log.refresh()
        with self._log.mutex:
            return len(self._log.data)

    def delete_key(self, key: str) -> bool:
        raise DistStoreError(f"{self!r}: delete_key is not supported by FileStore (its file is an "
                             f"append-only log); use TCPStore or HashStore to delete keys")

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = check_keys(keys)
        self.wait(keys)
        with self._log.mutex:
            return [self._log.data[k] for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        keys = check_keys(keys)
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        pairs = zip(keys, values, strict=True)
        self._log.append([(_SET, k.encode(), to_bytes(v)) for k, v in pairs])

    def close(self) -> None:
        """Write this user's LEAVE record (the ``world_size``-th deletes the file). Idempotent."""
        self._finalizer()

