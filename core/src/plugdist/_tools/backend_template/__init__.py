"""plugdist backend ``template``: point-to-point over TCP sockets; plugdist composes every
collective. Written by ``plugdist new-backend``: a working start to change into your transport.
(In plugdist itself this module is the source ``plugdist new-backend`` copies, names replaced.)
Every hook and rule it follows is in plugdist's docs/backends.md.

Each rank listens on a port it publishes in the group's store. The first send to a peer opens
one connection to it (a handshake names the sender); each accepted connection gets a reader
thread that parses frames ``(tag, nbytes, payload)`` and hands them to the matching receive. The
n-th message from a peer with a tag meets the n-th receive from that peer with that tag.

Rules kept here that any backend must keep: hooks return a Work at once and complete it from any
thread; a receive never waits inside the hook; ``shutdown`` closes every socket and joins every
thread it started (a thread left running at interpreter exit can kill the process). Multi-host:
set ``PLUGDIST_TEMPLATE_HOST`` to the address peers reach this host at (default: its hostname).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections import defaultdict, deque
from typing import ClassVar

import torch

from plugdist.backend import (
    POLL_SECONDS,
    BackendBase,
    BackendThreads,
    DistError,
    GroupOptions,
    Store,
    Work,
    recv_exact,
)

__all__ = ["TemplateProcessGroup"]

_FRAME = struct.Struct("!qq")  # tag, payload bytes
_HELLO = struct.Struct("!q")   # the connecting rank



class TemplateProcessGroup(BackendBase):
    """send/recv over one TCP connection per (sender, receiver) pair."""

    backend_name = "template"
    plugin_api: ClassVar[tuple[int, int]] = (2, 0)
    device_types = ("cpu",)

    def __init__(self, store: Store, rank: int, size: int, options: GroupOptions) -> None:
        super().__init__(rank, size, options)
        self._store = store
        self._lock = threading.Lock()
        self._threads = BackendThreads("template")
        # (src, tag) -> payloads that arrived before their receive / receives still waiting
        self._arrived: dict[tuple[int, int], deque[bytes]] = defaultdict(deque)
        self._waiting: dict[tuple[int, int], deque[tuple[torch.Tensor, Work]]] = defaultdict(deque)
        self._out: dict[int, socket.socket] = {}      # dst -> connection we send on
        self._out_locks = [threading.Lock() for _ in range(size)]
        self._in: list[socket.socket] = []
        self._listener = socket.create_server(("", 0))
        self._listener.settimeout(POLL_SECONDS)  # accept wakes up to notice shutdown
        host = os.environ.get("PLUGDIST_TEMPLATE_HOST") or socket.gethostname()
        store.set(f"addr/{rank}", f"{host}:{self._listener.getsockname()[1]}")
        self._threads.start(self._accept_loop, "accept")

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Pure Python over TCP: usable wherever plugdist is."""
        return True, ""

    # -- sending -----------------------------------------------------------------------------
    def _connection(self, dst: int) -> socket.socket:
        sock = self._out.get(dst)
        if sock is None:
            host, port = self._store.get(f"addr/{dst}").decode().rsplit(":", 1)
            sock = socket.create_connection((host, int(port)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(_HELLO.pack(self.group_rank))
            self._out[dst] = sock
        return sock

    def native_send(self, *, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        """One frame on our connection to ``dst``; done once the bytes are with the kernel."""
        work = self.work("send")
        payload = tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
        try:
            # the peer's reader thread always drains its socket, so this never waits on the
            # peer's program, only on the kernel's buffers
            with self._out_locks[dst]:
                self._connection(dst).sendall(_FRAME.pack(tag, len(payload)) + payload)
        except Exception as err:  # noqa: BLE001 - handed to the caller through the Work
            work.set_exception(DistError(f"{self.where('send')} to rank {dst} failed: {err}"))
        else:
            work.set_result([tensor])
        return work

    # -- receiving ---------------------------------------------------------------------------
    def native_recv(self, *, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
        """The next frame from ``src`` with ``tag``: taken at once if it arrived, else completed
        by the reader thread of ``src``'s connection when it does."""
        assert src is not None  # supports_any_source is False: the core refuses None first
        work = self.work("recv", source_rank=src)
        with self._lock:
            if self._threads.closed:
                work.set_exception(DistError(f"{self.where('recv')} the group was shut down"))
                return work
            arrived = self._arrived[(src, tag)]
            if not arrived:
                self._waiting[(src, tag)].append((tensor, work))
                return work
            payload = arrived.popleft()
        self._deliver(payload, tensor, work)
        return work

    def _deliver(self, payload: bytes, tensor: torch.Tensor, work: Work) -> None:
        flat = tensor.reshape(-1).view(torch.uint8)
        if len(payload) != flat.numel():
            work.set_exception(DistError(
                f"{self.where('recv')} message of {len(payload)} bytes for a tensor of "
                f"{flat.numel()}: the ranks disagree on shapes or dtypes"))
            return
        if payload:
            flat.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        work.set_result([tensor])

    def _accept_loop(self) -> None:
        while self._threads.running():
            try:
                sock, _addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed
            sock.settimeout(POLL_SECONDS)  # reads wake up to notice shutdown
            with self._lock:
                if self._threads.closed:
                    sock.close()
                    return
                self._in.append(sock)
            self._threads.start(self._read_loop, "reader", sock)

    def _read_loop(self, sock: socket.socket) -> None:
        try:
            hello = recv_exact(sock, _HELLO.size, self._threads.running)
            if hello is None:
                return
            (src,) = _HELLO.unpack(hello)
            while True:
                header = recv_exact(sock, _FRAME.size, self._threads.running)
                if header is None:
                    return
                tag, nbytes = _FRAME.unpack(header)
                payload = recv_exact(sock, nbytes, self._threads.running)
                if payload is None or not self._threads.running():
                    return  # closed, shut down, or the program is exiting: complete nothing
                with self._lock:
                    waiting = self._waiting[(src, tag)]
                    if not waiting:
                        self._arrived[(src, tag)].append(payload)
                        continue
                    tensor, work = waiting.popleft()
                self._deliver(payload, tensor, work)
        except OSError:
            return  # shut down under us

    # -- shutdown ----------------------------------------------------------------------------
    def _close(self) -> list[Work]:
        """Close every socket (readers and accept loop then return); the receives left."""
        with self._lock:
            self._threads.close()
            pending = [work for queue in self._waiting.values() for _t, work in queue]
            self._waiting.clear()
            socks = [*self._in, *self._out.values()]
        self._listener.close()
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        return pending

    def native_abort(self) -> None:
        """Close every socket at once, without joining (abort must not block); the core has
        failed the pending Works already."""
        self._close()

    def shutdown(self) -> None:
        """Close every socket, fail the receives still waiting, and join every thread we
        started (each notices within POLL_SECONDS): none outlives the group."""
        for work in self._close():
            work.set_exception(DistError(f"{self.where('recv')} the group was shut down"))
        self._threads.join()
