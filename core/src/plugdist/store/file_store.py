"""``FileStore``: a store kept in one file that every process opens (shared filesystem or local).

The file is an append-only log of records, each ``!BII`` (kind, key length, value length), the key,
the value. A writer holds an exclusive ``fcntl.flock`` while it reads the records it has not seen
and appends its own, so read-modify-write ops (``add``, ``compare_set``, ``append``,
``queue_pop``) are atomic across processes; readers take a shared lock. Each store object caches
the log's state and reads only the tail it has not seen. Files have no change notification, so
``get``/``wait``/``queue_pop`` poll the file size with a short sleep (1 ms growing to 20 ms) until
the keys appear or the timeout passes.

Life cycle, by reference count: every store object appends a JOIN record when opened and a LEAVE
record when closed. The store whose LEAVE leaves no user open (as many LEAVEs as JOINs) deletes
the file, if ``world_size`` is fixed and at least ``world_size`` users have left; so the file
outlives every store that still uses it, in any process. With ``world_size=-1`` the file is left
in place (delete it yourself, or reuse it: old keys remain). A store that opens the path just as
the last user deletes it notices (the inode it locked is no longer the path's) and opens the new
file instead of writing into the deleted one.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

from plugdist.errors import DistStoreError, DistTimeoutError, QueueEmptyError, store_timeout
from plugdist.store._util import check_amount, check_key, check_keys
from plugdist.store.api import DEFAULT_STORE_TIMEOUT, Store, to_bytes, to_seconds

__all__ = ["FileStore"]

_REC = struct.Struct("!BII")
_SET, _JOIN, _LEAVE, _DELETE, _QPUSH, _QPOP = 1, 2, 3, 4, 5, 6
_POLL_MIN, _POLL_MAX = 0.001, 0.02
_T = TypeVar("_T")
# (current value or None) -> (value to write or None, result to return)
_Updater = Callable[[bytes | None], tuple[bytes | None, bytes]]
_Record = tuple[int, bytes, bytes]


def _poll(attempt: Callable[[], _T | None], limit: float,
          timeout_error: Callable[[], Exception]) -> _T:
    """Call ``attempt`` until it returns something other than None, napping 1 ms growing to
    20 ms between calls; after ``limit`` seconds raise ``timeout_error()``."""
    deadline = time.monotonic() + limit
    nap = _POLL_MIN
    while True:
        result = attempt()
        if result is not None:
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            raise timeout_error()
        time.sleep(min(nap, left))
        nap = min(nap * 2, _POLL_MAX)


class _Log:
    """The file and this process's view of it. Holds no reference to the store, so the store's
    finalizer can release it. Every method takes ``mutex``; callers must not hold it."""

    def __init__(self, path: str, world_size: int) -> None:
        self.path = path
        self.world_size = world_size
        self.mutex = threading.Lock()
        self.data: dict[str, bytes] = {}
        self.queues: dict[str, deque[bytes]] = {}
        self.joins = 0
        self.leaves = 0
        self.offset = 0
        self.released = False
        self.pid = os.getpid()
        self.fd = self._open_and_join()

    def _open_and_join(self) -> int:
        for _ in range(100):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise DistStoreError(f"FileStore: cannot open {self.path!r} ({e.strerror}); the "
                                     f"directory must exist and be writable by every "
                                     f"process") from e
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if _same_file(fd, self.path):
                    self.fd = fd
                    self._read_tail()
                    self._write([(_JOIN, b"", b"")])
                    return fd
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            # the last user deleted the file between our open and our lock: open the new one
            os.close(fd)
        raise DistStoreError(f"FileStore: {self.path!r} kept being deleted while opening it")

    # -- under flock ------------------------------------------------------------------------

    def _lock(self, exclusive: bool) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)

    def _unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _apply(self, kind: int, key: bytes, value: bytes) -> None:
        if kind == _SET:
            self.data[key.decode()] = value
        elif kind == _JOIN:
            self.joins += 1
        elif kind == _LEAVE:
            self.leaves += 1
        elif kind == _DELETE:
            k = key.decode()
            self.data.pop(k, None)
            self.queues.pop(k, None)
        elif kind == _QPUSH:
            self.queues.setdefault(key.decode(), deque()).append(value)
        elif kind == _QPOP:
            k = key.decode()
            q = self.queues.get(k)
            if q:
                q.popleft()
                if not q:
                    del self.queues[k]

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
            start = pos + _REC.size
            self._apply(kind, buf[start:start + kl], buf[start + kl:stop])
            pos = stop
        self.offset += pos

    def _write(self, records: list[_Record]) -> None:
        out = b"".join(_REC.pack(kind, len(k), len(v)) + k + v for kind, k, v in records)
        view = memoryview(out)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        # we read everything before appending under the exclusive lock: the log is now exactly
        # what we have applied plus our records
        self.offset += len(out)
        for kind, k, v in records:
            self._apply(kind, k, v)

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

    def append(self, records: list[_Record]) -> None:
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

    def delete(self, key: str) -> bool:
        """Atomically delete ``key``'s value and queue; True if either existed."""
        with self.mutex:
            self._check_open()
            self._lock(True)
            try:
                self._read_tail()
                if key not in self.data and key not in self.queues:
                    return False
                self._write([(_DELETE, key.encode(), b"")])
                return True
            finally:
                self._unlock()

    def pop(self, key: str) -> bytes | None:
        """Atomically remove and return the oldest value of queue ``key``; None if empty."""
        with self.mutex:
            self._check_open()
            if not self.queues.get(key) and os.fstat(self.fd).st_size <= self.offset:
                return None  # nothing new in the file and our view is empty: skip the lock
            self._lock(True)
            try:
                self._read_tail()
                q = self.queues.get(key)
                if not q:
                    return None
                value = q[0]
                self._write([(_QPOP, key.encode(), b"")])
                return value
            finally:
                self._unlock()

    def _check_open(self) -> None:
        if self.released:
            raise DistStoreError(f"FileStore({self.path!r}) is closed")

    def release(self) -> None:
        """Append LEAVE; the LEAVE that leaves no user open deletes the file (once at least
        ``world_size`` users left). Idempotent."""
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
                    if (self.world_size > 0 and self.leaves >= self.world_size
                            and self.leaves >= self.joins and _same_file(self.fd, self.path)):
                        os.unlink(self.path)
                finally:
                    self._unlock()
            except OSError:
                pass  # at interpreter exit the file system may be gone; nothing left to do
            finally:
                os.close(self.fd)


def _same_file(fd: int, path: str) -> bool:
    """True when ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


class FileStore(Store):
    """A store in the file ``file_name``, shared by every process that opens the same path.

    ``world_size`` is the number of store objects that will use the file (-1: unknown). The file
    is deleted when the last store using it closes (a reference count kept in the file itself,
    across processes), once at least ``world_size`` have closed. Thread-safe; cross-process
    atomic. ``num_keys`` counts the file's reference count as one key, as torch's does.
    ``clone()`` opens another user of the same file.
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

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> FileStore:
        return FileStore(self.path, self.world_size, self.timeout)

    def set(self, key: str, value: bytes | str) -> None:
        self._log.append([(_SET, check_key(key).encode(), to_bytes(value))])

    def get(self, key: str) -> bytes:
        self._wait([check_key(key)], None, "get", values_only=True)
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
                    f"({(current or b'')[:32]!r}): the key was written by set(); use a "
                    f"separate key for counters") from None
            out = str(total).encode()
            return out, out

        return int(self._log.update(key, bump))

    def append(self, key: str, value: bytes | str) -> None:
        check_key(key)
        tail = to_bytes(value)
        self._log.update(key, lambda current: ((current or b"") + tail, b""))

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
        self._wait(check_keys(keys), timeout, "wait")

    def _wait(self, keys: list[str], timeout: timedelta | None, op: str,
              values_only: bool = False) -> None:
        limit = to_seconds(timeout if timeout is not None else self.timeout)
        log = self._log
        missing: list[str] = []

        def all_there() -> bool | None:
            log.refresh()
            with log.mutex:
                missing[:] = [k for k in keys if k not in log.data
                              and (values_only or not log.queues.get(k))]
            return None if missing else True

        _poll(all_there, limit, lambda: DistTimeoutError(
            f"{self!r}: {store_timeout(op, limit, f'missing keys {missing}')}"))

    def check(self, keys: Sequence[str]) -> bool:
        keys = check_keys(keys)
        self._log.refresh()
        with self._log.mutex:
            return all(k in self._log.data or self._log.queues.get(k) for k in keys)

    def num_keys(self) -> int:
        self._log.refresh()
        with self._log.mutex:
            return len(self._log.data) + 1  # + the reference count, as torch counts it

    def delete_key(self, key: str) -> bool:
        return self._log.delete(check_key(key))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = check_keys(keys)
        self._wait(keys, None, "multi_get", values_only=True)
        with self._log.mutex:
            return [self._log.data[k] for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        keys = check_keys(keys)
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        pairs = zip(keys, values, strict=True)
        self._log.append([(_SET, k.encode(), to_bytes(v)) for k, v in pairs])

    def queue_push(self, key: str, value: bytes | str) -> None:
        self._log.append([(_QPUSH, check_key(key).encode(), to_bytes(value))])

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        check_key(key)
        log = self._log
        if not block:
            value = log.pop(key)
            if value is None:
                raise QueueEmptyError(f"{self!r}: queue_pop({key!r}, block=False): the queue is "
                                      f"empty")
            return value
        limit = to_seconds(self.timeout)
        return _poll(lambda: log.pop(key), limit, lambda: DistTimeoutError(
            f"{self!r}: {store_timeout('queue_pop', limit, f'queue {key!r} stayed empty')}"))

    def queue_len(self, key: str) -> int:
        check_key(key)
        self._log.refresh()
        with self._log.mutex:
            return len(self._log.queues.get(key, ()))

    def close(self) -> None:
        """Write this user's LEAVE record (the last user's deletes the file). Idempotent."""
        self._finalizer()
