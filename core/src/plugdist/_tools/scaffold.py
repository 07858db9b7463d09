"""``plugdist new-backend NAME``: write a backend package that installs and passes the
conformance suite as written.

The package: ``pyproject.toml`` (the ``plugdist.backends`` entry point, a ``testing`` extra),
``src/plugdist_NAME/__init__.py`` (a send/recv backend over TCP sockets, every collective
composed by the core), ``README.md`` and ``tests/test_conformance.py`` (runs the conformance
suite on it). Templates are plain strings here, filled with :class:`string.Template`.
"""

from __future__ import annotations

import re
from pathlib import Path
from string import Template

__all__ = ["scaffold", "package_files", "NAME_PATTERN"]

# a backend name: what users pass to init_process_group, and the module's suffix
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")

_PYPROJECT = """\
[build-system]
requires = ["setuptools>=70.1"]
build-backend = "setuptools.build_meta"

[project]
name = "${dist}"
version = "0.1.0"
description = "A plugdist backend: send/recv over TCP sockets, collectives composed by plugdist"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["plugdist"]

[project.optional-dependencies]
# what the conformance suite needs: pytest, pytest-timeout, numpy
testing = ["plugdist[testing]"]

# the line that makes init_process_group("${name}") find the backend
[project.entry-points."plugdist.backends"]
${name} = "${module}:${cls}"

[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
testpaths = ["tests"]
"""

_README = """\
# ${dist}

A plugdist backend named `${name}`: `native_send` and `native_recv` over TCP sockets; plugdist
composes every collective from them. Written by `plugdist new-backend ${name}`.

```
pip install -e ".[testing]"
plugdist info                  # backend ${name}: available, every collective composed
pytest                         # the conformance suite at world sizes 1, 2, 3
```

Use it with `init_process_group("${name}")`. To make it yours, change the transport in
`src/${module}/__init__.py` and override more `native_*` hooks as your transport does them
natively; plugdist's docs/backends.md gives every hook's contract. Set `${host_env}` to the
address peers reach a host at when ranks run on several hosts.
"""

_TEST = """\
\"\"\"The plugdist conformance suite against backend ${name}, in a pytest of its own.\"\"\"

import subprocess
import sys

import pytest

WORLD_SIZES = "1,2,3"


@pytest.mark.timeout(600)
def test_the_conformance_suite_passes() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--pyargs", "plugdist.testing.conformance",
                           "--plugdist-backend", "${name}", "--plugdist-world-sizes", WORLD_SIZES])
    assert proc.returncode == 0, "the conformance suite failed: see its report above"
"""

_MODULE = '''\
"""plugdist backend ``${name}``: point-to-point over TCP sockets; plugdist composes every
collective. Written by ``plugdist new-backend``: a working start to change into your transport.
Every hook and rule it follows is in plugdist's docs/backends.md.

Each rank listens on a port it publishes in the group's store. The first send to a peer opens
one connection to it (a handshake names the sender); each accepted connection gets a reader
thread that parses frames ``(tag, nbytes, payload)`` and hands them to the matching receive. The
n-th message from a peer with a tag meets the n-th receive from that peer with that tag.

Rules kept here that any backend must keep: hooks return a Work at once and complete it from any
thread; a receive never waits inside the hook; ``shutdown`` closes every socket and joins every
thread it started (a thread left running at interpreter exit can kill the process). Multi-host:
set ``${host_env}`` to the address peers reach this host at (default: its hostname).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections import defaultdict, deque
from collections.abc import Callable

import torch
from plugdist import DistError, Store
from plugdist.backend import BackendBase, GroupOptions, Work

__all__ = ["${cls}"]

_FRAME = struct.Struct("!qq")  # tag, payload bytes
_HELLO = struct.Struct("!q")   # the connecting rank


_POLL_S = 0.2  # how often a blocked thread checks whether it should stop


def _program_running() -> bool:
    """False once the main thread finished: the program is exiting, perhaps without
    destroy_process_group, and our threads must end or the interpreter waits on them."""
    return threading.main_thread().is_alive()


def _recv_exact(sock: socket.socket, n: int, running: Callable[[], bool]) -> bytes | None:
    """``n`` bytes from ``sock`` (a socket with a timeout), or None once it closed or
    ``running()`` turned false."""
    chunks, left = [], n
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except TimeoutError:
            if not running():
                return None
            continue
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class ${cls}(BackendBase):
    """send/recv over one TCP connection per (sender, receiver) pair."""

    backend_name = "${name}"
    plugin_api = (2, 0)  # written for plugdist's plugin API 2.x
    device_types = ("cpu",)

    def __init__(self, store: Store, rank: int, size: int, options: GroupOptions) -> None:
        super().__init__(rank, size, options)
        self._store = store
        self._lock = threading.Lock()
        self._closed = False
        # (src, tag) -> payloads that arrived before their receive / receives still waiting
        self._arrived: dict[tuple[int, int], deque[bytes]] = defaultdict(deque)
        self._waiting: dict[tuple[int, int], deque[tuple[torch.Tensor, Work]]] = defaultdict(deque)
        self._out: dict[int, socket.socket] = {}      # dst -> connection we send on
        self._out_locks = [threading.Lock() for _ in range(size)]
        self._in: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("", 0))
        self._listener.settimeout(_POLL_S)  # accept wakes up to notice shutdown
        host = os.environ.get("${host_env}") or socket.gethostname()
        store.set(f"addr/{rank}", f"{host}:{self._listener.getsockname()[1]}")
        self._start(self._accept_loop, "accept")

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Pure Python over TCP: usable wherever plugdist is."""
        return True, ""

    def _running(self) -> bool:
        """Whether our threads should keep going: not shut down, program not exiting."""
        return not self._closed and _program_running()

    def _start(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=f"${name}-{name}")
        self._threads.append(thread)
        thread.start()

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
            if self._closed:
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
        while self._running():
            try:
                sock, _addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed
            sock.settimeout(_POLL_S)  # reads wake up to notice shutdown
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._in.append(sock)
            self._start(self._read_loop, "reader", sock)

    def _read_loop(self, sock: socket.socket) -> None:
        try:
            hello = _recv_exact(sock, _HELLO.size, self._running)
            if hello is None:
                return
            (src,) = _HELLO.unpack(hello)
            while True:
                header = _recv_exact(sock, _FRAME.size, self._running)
                if header is None:
                    return
                tag, nbytes = _FRAME.unpack(header)
                payload = _recv_exact(sock, nbytes, self._running)
                if payload is None or not self._running():
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
            self._closed = True
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
        started (each notices within _POLL_S): none outlives the group."""
        for work in self._close():
            work.set_exception(DistError(f"{self.where('recv')} the group was shut down"))
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
'''


def _names(name: str) -> dict[str, str]:
    camel = "".join(part.capitalize() for part in name.split("_"))
    return {"name": name, "module": f"plugdist_{name}",
            "dist": f"plugdist-{name.replace('_', '-')}", "cls": f"{camel}ProcessGroup",
            "host_env": f"PLUGDIST_{name.upper()}_HOST"}


def package_files(name: str) -> dict[str, str]:
    """The package for backend ``name``: relative path -> text."""
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"backend name {name!r}: use lowercase letters, digits and underscores, "
                         f"starting with a letter (it becomes the module plugdist_<name>)")
    names = _names(name)
    return {path: Template(text).substitute(names) for path, text in (
        ("pyproject.toml", _PYPROJECT), ("README.md", _README),
        (f"src/{names['module']}/__init__.py", _MODULE),
        ("tests/test_conformance.py", _TEST))}


def scaffold(name: str, directory: Path) -> list[Path]:
    """Write backend ``name``'s package into ``directory`` (created; it must not exist or be
    empty) and return the files written."""
    files = package_files(name)
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} exists and is not empty; pass --dir with a new "
                              f"folder, or remove it")
    written = []
    for rel, text in files.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
