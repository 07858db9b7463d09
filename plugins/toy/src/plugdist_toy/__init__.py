"""plugdist-toy: the reference backend a backend author reads. It implements only ``send`` and
``recv``; plugdist composes every collective from those two (``plugdist info`` shows it).

Transport: the group's store (a TCPStore over loopback, or whatever store the job uses). A send
writes the tensor's bytes under a key numbered per (sender, receiver, tag); the matching receive
waits for that key, copies the bytes into its tensor and deletes the key. Numbering each
(peer, tag) stream on both sides is what matches the n-th send to the n-th receive, the rule
docs/backends.md states. Slow by design (two store round trips per message): it shows the
contract, not a fast path.

Threads: a send is one store ``set`` on the caller's thread; a receive runs on a thread of its
own (started through the core's ``BackendThreads``) that waits in short slices, so ``shutdown``
can stop it, fail what is still pending, and join every thread. A program that exits without
``destroy_process_group`` is not held up either: ``BackendThreads.running()`` also turns false
once the main thread has finished (the interpreter joins plain threads only after that, which is
why these are not a ThreadPoolExecutor's, joined before it).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from datetime import timedelta
from time import monotonic

import torch
from plugdist.backend import (
    POLL_SECONDS,
    BackendBase,
    BackendThreads,
    DistError,
    DistTimeoutError,
    GroupOptions,
    Store,
    Work,
    program_running,
)

__all__ = ["ToyProcessGroup"]

_POLL = timedelta(seconds=POLL_SECONDS)  # how often a waiting receive checks for shutdown


class ToyProcessGroup(BackendBase):
    """Point-to-point over the group's store; every collective composed by the core."""

    backend_name = "toy"                    # profiler events read plugdist:toy:<op>
    plugin_api = (2, 0)  # written for plugdist's plugin API 2.x
    device_types = ("cpu",)

    def __init__(self, store: Store, rank: int, size: int, options: GroupOptions) -> None:
        super().__init__(rank, size, options)
        self._store = store                 # private to this group: keys cannot collide
        self._lock = threading.Lock()
        self._sent: dict[tuple[int, int], int] = defaultdict(int)
        self._received: dict[tuple[int, int], int] = defaultdict(int)
        self._threads = BackendThreads("toy")  # the receive threads

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Pure Python over the store: usable wherever plugdist is."""
        return True, ""

    @staticmethod
    def _key(src: int, dst: int, tag: int, seq: int) -> str:
        return f"p2p/{src}/{dst}/{tag}/{seq}"

    def _next(self, counters: dict[tuple[int, int], int], peer: int, tag: int) -> int:
        """The number of the next message on the (peer, tag) stream, counted per direction."""
        with self._lock:
            seq = counters[(peer, tag)]
            counters[(peer, tag)] = seq + 1
        return seq

    def native_send(self, *, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        key = self._key(self.group_rank, dst, tag, self._next(self._sent, dst, tag))
        work = self.work("send")
        try:
            # bytes copied before returning: the caller may reuse the tensor at once
            self._store.set(key, tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
        except Exception as err:  # noqa: BLE001 - handed to the caller through the Work
            work.set_exception(err)
        else:
            work.set_result([tensor])
        return work

    def native_recv(self, *, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
        assert src is not None  # supports_any_source is False: the core refuses src=None first
        key = self._key(src, self.group_rank, tag, self._next(self._received, src, tag))
        work = self.work("recv", source_rank=src)
        self._threads.start(self._receive, f"recv-{key}", key, tensor, work)
        return work

    def _receive(self, key: str, tensor: torch.Tensor, work: Work) -> None:
        """On a thread of its own: wait for ``key``, copy it into ``tensor``, complete
        ``work``."""
        try:
            deadline = monotonic() + self.timeout.total_seconds()
            while True:
                if not program_running():
                    return  # the program is exiting: nobody can wait on the Work any more
                if self._threads.closed:
                    raise DistError(f"{self.where('recv')} the group was shut down")
                try:
                    self._store.wait([key], _POLL)
                    break
                except DistTimeoutError:
                    if monotonic() > deadline:
                        raise self.timeout_error("recv") from None
            data = self._store.get(key)
            self._store.delete_key(key)
            if data:
                flat = tensor.reshape(-1).view(torch.uint8)
                flat.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        except BaseException as err:  # noqa: BLE001 - every failure goes to the Work
            work.set_exception(err)
        else:
            work.set_result([tensor])

    def shutdown(self) -> None:
        """Stop the receive threads (each notices within one poll), failing every receive still
        pending, and join them: no thread of ours outlives the group."""
        self._threads.close()
        self._threads.join()
