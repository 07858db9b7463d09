"""A group's NCCL communicator: built through the group's plugdist store, used behind a lock.

Building is collective over the group's members and blocking: every member announces itself,
group rank 0 waits for all of them, creates NCCL's unique id and publishes it, and every member
then joins ``ncclCommInitRank`` on its device. Waiting for every member first keeps
``ncclCommInitRank`` (which has no timeout) from hanging on a rank that never came. Each attempt
has its own keys, so a retry after a failed build never reads an id from an earlier one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from plugdist.errors import DistBackendError, DistTimeoutError
from plugdist.store import Store

from ._nccl import load

__all__ = ["Communicator", "CommunicatorClosed", "create_communicator", "exchange_unique_id",
           "UNIQUE_ID_BYTES"]

UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)
_ABANDONED = b"abandoned"


def exchange_unique_id(store: Store, rank: int, size: int, timeout: timedelta, attempt: int,
                       make_id: Callable[[], bytes], here: str) -> bytes:
    """Attempt number ``attempt`` to agree on a unique id; returns it on every member.

    Blocking, bounded by ``timeout``. The id is published only once every member has announced
    itself. A member that gives up marks the attempt abandoned with one ``compare_set`` on the
    id's key, so the outcome is the same everywhere: every member gets the id (and will join
    ``ncclCommInitRank``), or every member raises DistTimeoutError naming the absent ranks.
    """
    prefix = f"nccl/attempt{attempt}"
    id_key = f"{prefix}/unique_id"
    arrived = [f"{prefix}/arrived/{r}" for r in range(size)]
    store.set(arrived[rank], b"1")
    try:
        if rank == 0:
            store.wait(arrived, timeout)
            # a member that already gave up needs no id (each one starts an NCCL bootstrap root)
            published = store.get(id_key) if store.check([id_key]) else \
                store.compare_set(id_key, b"", make_id())
        else:
            store.wait([id_key], timeout)
            published = store.get(id_key)
    except DistTimeoutError:
        published = store.compare_set(id_key, b"", _ABANDONED)
    except BaseException:
        store.compare_set(id_key, b"", _ABANDONED)  # the others need not wait for the timeout
        raise
    if published != _ABANDONED:
        return published
    missing = [r for r in range(size) if not store.check([arrived[r]])]
    absent = f"group ranks {missing} did not reach" if missing else \
        "group rank 0 could not create the NCCL unique id at"
    raise DistTimeoutError(
        f"{here} building the NCCL communicator (attempt {attempt}): {absent} their first op "
        f"within {timeout.total_seconds():.0f}s; the communicator is built at the group's first "
        f"op, which every member must call (or pass NCCLOptions(device_id=...) to build it when "
        f"the group is created)")


def create_communicator(store: Store, rank: int, size: int, device: torch.device,
                        timeout: timedelta, attempt: int, here: str) -> Communicator:
    """This rank's communicator on ``device`` (see :func:`exchange_unique_id`). Raises
    DistTimeoutError (a member never arrived) or DistBackendError (NCCL failed)."""
    nccl = load()

    def make_id() -> bytes:
        with torch.cuda.device(device):
            return bytes(nccl.get_unique_id())  # bytes since cupy 14

    uid = exchange_unique_id(store, rank, size, timeout, attempt, make_id, here)
    if len(uid) != UNIQUE_ID_BYTES:
        raise DistBackendError(f"{here} the NCCL unique id in the store has {len(uid)} bytes, "
                               f"not {UNIQUE_ID_BYTES}; do all ranks run the same plugdist-nccl?")
    try:
        with torch.cuda.device(device):
            raw = nccl.NcclCommunicator(size, uid, rank)
    except Exception as exc:
        raise DistBackendError(f"{here} ncclCommInitRank on {device} failed: "
                               f"{type(exc).__name__}: {exc}") from exc
    return Communicator(raw)


class CommunicatorClosed(DistBackendError):
    """The communicator was aborted or destroyed; no NCCL call may use it any more."""


class Communicator:
    """A ``cupy.cuda.nccl.NcclCommunicator`` that is only ever used under its lock. Thread-safe.

    cupy releases the GIL inside every NCCL call, and its ``abort()``/``destroy()`` free the
    communicator and then zero its handle: unguarded, an abort on one thread frees the
    communicator under a call on another, and any call after it reaches NCCL with a NULL handle
    (``NCCL_ERROR_INVALID_ARGUMENT``, which the watchdog would report as an asynchronous error).
    So calls, the watchdog's error check, abort and destroy all take the lock, and once the
    communicator is aborted or destroyed every call is refused.
    """

    def __init__(self, raw: Any, *, abort_grace: timedelta = timedelta(seconds=1)) -> None:
        self._raw: Any = raw
        self._lock = threading.Lock()
        self._closed_by = ""
        self._abort_grace = abort_grace.total_seconds()

    @property
    def closed(self) -> bool:
        return self._raw is None

    @property
    def lock(self) -> threading.Lock:
        """The lock of the hot path, which reads :attr:`raw` under it instead of :meth:`use`."""
        return self._lock

    @property
    def raw(self) -> Any:
        """The raw communicator, None once aborted or destroyed; read it under :attr:`lock`."""
        return self._raw

    def closed_error(self) -> CommunicatorClosed:
        return CommunicatorClosed(f"the NCCL communicator was {self._closed_by}")

    @contextmanager
    def use(self) -> Iterator[Any]:
        """The raw communicator, with the lock held for the block's NCCL calls. Raises
        CommunicatorClosed after an abort or destroy."""
        with self._lock:
            raw = self._raw
            if raw is None:
                raise self.closed_error()
            yield raw

    def check_async_error(self) -> BaseException | None:
        """NCCL's asynchronous error, or None. Never blocks: while another thread is inside an
        NCCL call (or after an abort or destroy) it reports nothing, and the caller asks again."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._raw is None:
                return None
            try:
                self._raw.check_async_error()
            except Exception as exc:  # noqa: BLE001 - NCCL's error is the answer
                return exc
            return None
        finally:
            self._lock.release()

    def abort(self) -> None:
        """``ncclCommAbort``; idempotent, any thread. It waits ``abort_grace`` for a call in
        progress; a call still holding the lock after that is stuck inside NCCL (e.g.
        ``ncclGroupEnd`` waiting for a peer), and only the abort can end it, so it goes ahead."""
        locked = self._lock.acquire(timeout=self._abort_grace)
        try:
            raw, self._raw = self._raw, None
            if raw is None:
                return
            self._closed_by = "aborted"
            raw.abort()
        finally:
            if locked:
                self._lock.release()

    def destroy(self) -> None:
        """``ncclCommDestroy`` (waits for the communicator's queued work); idempotent."""
        with self._lock:
            raw, self._raw = self._raw, None
            if raw is None:
                return
            self._closed_by = "destroyed"
            raw.destroy()
