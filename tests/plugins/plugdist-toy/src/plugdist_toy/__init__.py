"""A third-party-style backend that implements only ``send`` and ``recv``.

Messages travel through the group's store (a real TCPStore over loopback in the tests): a send
writes the tensor's bytes under a key numbered per (sender, receiver, tag), a receive waits for
that key server-side. Every collective comes from plugdist's composition. Slow by design; it
exists to prove that a backend with a small primitive set gets the whole API.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import torch
from plugdist import GroupOptions, ProcessGroup, Store, Work


class ToyProcessGroup(ProcessGroup):
    backend_name = "toy"
    device_types = ("cpu",)

    def __init__(self, store: Store, rank: int, size: int, options: GroupOptions) -> None:
        super().__init__(rank, size, options)
        self._store = store
        self._lock = threading.Lock()
        self._sent: dict[tuple[int, int], int] = defaultdict(int)
        self._received: dict[tuple[int, int], int] = defaultdict(int)
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="toy-recv")

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, ""

    def _key(self, src: int, dst: int, tag: int, seq: int) -> str:
        return f"p2p/{src}/{dst}/{tag}/{seq}"

    def native_send(self, *, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        with self._lock:
            seq = self._sent[(dst, tag)]
            self._sent[(dst, tag)] += 1
        payload = tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
        work = self.work("send")
        try:
            self._store.set(self._key(self._rank, dst, tag, seq), payload)
        except Exception as err:  # noqa: BLE001 - handed to the caller through the Work
            work.set_exception(err)
        else:
            work.set_result([tensor])
        return work

    def native_recv(self, *, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
        assert src is not None  # any-source is not declared, the core refuses it first
        with self._lock:
            seq = self._received[(src, tag)]
            self._received[(src, tag)] += 1
        key = self._key(src, self._rank, tag, seq)
        work = self.work("recv", source_rank=src)

        def receive() -> None:
            try:
                data = self._store.get(key)
                self._store.delete_key(key)
                if data:
                    flat = tensor.reshape(-1).view(torch.uint8)
                    flat.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            except BaseException as err:  # noqa: BLE001
                work.set_exception(err)
            else:
                work.set_result([tensor])

        self._pool.submit(receive)
        return work

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


