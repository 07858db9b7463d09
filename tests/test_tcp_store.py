"""TCPStore-specific tests: rendezvous of many concurrent clients, misbehaving clients (killed,
garbage, oversized, unknown commands, wrong version), connection errors, wait_for_workers,
shutdown. Real sockets on loopback; worker processes from ``_store_workers``."""

from __future__ import annotations

import gc
import os
import random
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from structlog.testing import capture_logs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store_workers import result, spawn, wait_ready  # noqa: E402
from plugdist.errors import DistNetworkError, DistStoreError, DistTimeoutError
from plugdist.log import get_logger
from plugdist.store import TCPStore
from plugdist.store import _wire as wire

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def eventually(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def raw_client(port: int, version: int = wire.VERSION) -> socket.socket:
    """A socket that did the handshake by hand (so the test can then misbehave)."""
    s = socket.create_connection((HOST, port), timeout=10)
    s.sendall(wire.PREAMBLE.pack(wire.MAGIC, version, 0))
    if version == wire.VERSION:
        assert recv_exact(s, wire.PREAMBLE.size) == wire.PREAMBLE.pack(wire.MAGIC, wire.VERSION,
                                                                      wire.HELLO_OK)
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def closed_by_server(s: socket.socket) -> bool:
    """True when the server hung up on ``s`` (EOF or reset) within the socket's timeout."""
    try:
        while True:
            if not s.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture
def master():
    m = TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=30))
    yield m
    m.close()


@pytest.mark.timeout(20)
def test_construction_errors_and_port_zero(master: TCPStore) -> None:
    assert master.port > 0 and master.is_master
    assert f"{HOST}:{master.port}" in repr(master)
    with pytest.raises(ValueError, match="port 0"):
        TCPStore(HOST, 0)
    with pytest.raises(ValueError, match="port"):
        TCPStore(HOST, 70000)
    with pytest.raises(ValueError, match="world_size"):
        TCPStore(HOST, master.port, world_size=0)
    with pytest.raises(DistNetworkError, match="resolve host"):
        TCPStore("no-such-host.invalid", master.port, timeout=timedelta(seconds=1))
    # a name is resolved once (here through /etc/hosts), then used as an address
    c = TCPStore("localhost", master.port, timeout=timedelta(seconds=5))
    c.set("via_name", "ok")
    assert master.get("via_name") == b"ok"
    c.close()
    # a second master on a port in use fails clearly and at once
    with pytest.raises(DistNetworkError, match=f"port {master.port}"):
        TCPStore(HOST, master.port, is_master=True, timeout=timedelta(seconds=1))


@pytest.mark.timeout(20)
def test_connect_to_dead_port_raises_network_error() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match=f"{HOST}:{port}"):
        TCPStore(HOST, port, timeout=timedelta(seconds=1))
    # it retried until the timeout, and gave up then (generous bound: a loaded machine)
    assert 1.0 <= time.monotonic() - start < 10.0


@pytest.mark.timeout(30)
def test_wait_for_workers() -> None:
    port = free_port()
    clients: list[TCPStore] = []
    errors: list[BaseException] = []

    def join() -> None:
        try:  # started before the master: connecting retries until it listens
            clients.append(TCPStore(HOST, port, world_size=3, timeout=timedelta(seconds=20)))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=join) for _ in range(2)]
    for t in threads:
        t.start()
    m = TCPStore(HOST, port, world_size=3, is_master=True, timeout=timedelta(seconds=20))
    for t in threads:
        t.join()
    assert errors == [] and len(clients) == 2
    clients[0].set("hello", "from a worker")
    assert clients[1].get("hello") == b"from a worker"
    for c in clients:
        c.close()
    m.close()

    # nobody comes: the master's constructor times out naming the count, and frees the port
    port = free_port()
    with pytest.raises(DistTimeoutError, match="1 of 2 workers"):
        TCPStore(HOST, port, world_size=2, is_master=True, timeout=timedelta(seconds=0.5))
    assert eventually(lambda: port_is_free(port))
    # wait_for_workers=False returns at once
    m = TCPStore(HOST, 0, world_size=5, is_master=True, timeout=timedelta(seconds=5),
                 wait_for_workers=False)
    m.set("k", "v")
    assert m.get("k") == b"v"
    m.close()


@pytest.mark.timeout(30)
def test_close_and_garbage_collection_free_the_port() -> None:
    m = TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=5))
    port = m.port
    client = TCPStore(HOST, port, timeout=timedelta(seconds=5))
    thread_name = f"plugdist-tcpstore-{port}"
    assert any(t.name == thread_name for t in threading.enumerate())
    m.close()
    m.close()  # idempotent
    assert eventually(lambda: not any(t.name == thread_name for t in threading.enumerate()))
    assert eventually(lambda: port_is_free(port))
    with pytest.raises(DistNetworkError, match=f"{HOST}:{port}"):
        client.get("anything")
    with pytest.raises(DistStoreError, match="closed"):
        m.set("k", "v")
    client.close()

    m = TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=5))
    port = m.port
    thread_name = f"plugdist-tcpstore-{port}"
    del m
    gc.collect()
    assert eventually(lambda: not any(t.name == thread_name for t in threading.enumerate()))
    assert eventually(lambda: port_is_free(port))


@pytest.mark.timeout(20)
def test_value_over_frame_limit_is_refused_client_side(master: TCPStore) -> None:
    with pytest.raises(DistStoreError, match="frame limit"):
        master.set("huge", b"\0" * (wire.MAX_FRAME + 1))
    master.set("small", "still works")
    assert master.get("small") == b"still works"


@pytest.mark.timeout(60)
def test_client_killed_while_blocked_in_get(master: TCPStore) -> None:
    get_logger()  # configure logging before capturing it
    server = master._server
    assert server is not None
    spec = {"kind": "tcp", "host": HOST, "port": master.port}
    with capture_logs() as logs:
        victim = spawn("get", spec=spec, key="never_set")
        wait_ready(victim)
        assert eventually(lambda: b"never_set" in server._waiting)  # parked on the server
        bystander = spawn("get", spec=spec, key="later_set")
        wait_ready(bystander)
        assert eventually(lambda: b"later_set" in server._waiting)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        victim.stdout.close()  # type: ignore[union-attr]
        victim.stderr.close()  # type: ignore[union-attr]
        assert eventually(lambda: b"never_set" not in server._waiting)  # waiter forgotten
        master.set("later_set", "still served")
        assert result(bystander)["value"] == "still served"
        master.set("never_set", "too late")  # answering nobody must not hurt either
        other = TCPStore(HOST, master.port, timeout=timedelta(seconds=5))
        assert other.get("never_set") == b"too late"
        other.close()
    dropped = [e for e in logs if e["event"] == "tcp_store_client_dropped"]
    assert any("middle of a request" in e["reason"] for e in dropped), logs


@pytest.mark.timeout(60)
def test_garbage_from_clients_is_dropped_and_others_keep_working(master: TCPStore) -> None:
    get_logger()
    port = master.port
    server = master._server
    assert server is not None
    good = TCPStore(HOST, port, timeout=timedelta(seconds=20))
    parked: list[bytes] = []
    waiter = threading.Thread(target=lambda: parked.append(good.get("after_garbage")))
    waiter.start()
    assert eventually(lambda: b"after_garbage" in server._waiting)

    def frame(op: int, body: bytes) -> bytes:
        return wire.HEADER.pack(len(body), op) + body

    rng = random.Random(1234)
    junk = rng.randbytes(4096)
    assert not junk.startswith(wire.MAGIC[:1])

    def random_bytes() -> socket.socket:
        s = socket.create_connection((HOST, port), timeout=10)
        s.sendall(junk)
        return s

    def bad_version() -> socket.socket:
        s = raw_client(port, version=99)
        # the server says which version it speaks before hanging up
        assert recv_exact(s, wire.PREAMBLE.size) == wire.PREAMBLE.pack(
            wire.MAGIC, wire.VERSION, wire.HELLO_BAD_VERSION)
        return s

    def oversized() -> socket.socket:
        s = raw_client(port)
        s.sendall(wire.HEADER.pack(wire.MAX_FRAME + 1, wire.Op.SET))
        return s

    def bad_length() -> socket.socket:
        s = raw_client(port)  # a GET whose key length runs past the frame
        s.sendall(frame(wire.Op.GET, struct.pack("!dI", 1.0, 1000) + b"short"))
        return s

    def unknown_command() -> socket.socket:
        s = raw_client(port)
        s.sendall(frame(200, b"whatever"))
        return s

    def random_after_handshake() -> socket.socket:
        s = raw_client(port)
        s.sendall(b"\xff\xff\xff\xff" + junk)
        return s

    cases: list[tuple[str, Callable[[], socket.socket], str]] = [
             ("random bytes", random_bytes, "bad magic"),
             ("bad version", bad_version, "protocol version 99"),
             ("oversized frame", oversized, "exceeds the limit"),
             ("bad length", bad_length, "malformed GET"),
             ("unknown command", unknown_command, "unknown command 200"),
             ("random after handshake", random_after_handshake, "exceeds the limit")]
    with capture_logs() as logs:
        for name, make, _ in cases:
            s = make()
            assert closed_by_server(s), f"server kept a client that sent {name}"
            s.close()
            # after each, a fresh client and the existing one still work
            fresh = TCPStore(HOST, port, timeout=timedelta(seconds=5))
            fresh.set(f"ok_{name}", name)
            assert master.get(f"ok_{name}") == name.encode()
            assert good.check([f"ok_{name}"])
            fresh.close()
        # a client that stops half-way through a frame and disconnects
        s = raw_client(port)
        s.sendall(frame(wire.Op.SET, b"\x00\x00\x00\x10only-part")[:12])
        s.close()
        assert eventually(lambda: any("middle of a request" in e.get("reason", "")
                                      for e in logs))
    assert waiter.is_alive()  # the parked get was not disturbed by any of it
    master.set("after_garbage", "released")
    waiter.join(10)
    assert parked == [b"released"]
    assert good.add("still_counting", 2) == 2
    reasons = [e["reason"] for e in logs if e["event"] == "tcp_store_client_dropped"]
    for name, _, why in cases:
        assert any(why in r for r in reasons), (name, reasons)
    good.close()


@pytest.mark.timeout(20)
def test_client_refuses_a_server_that_is_not_ours() -> None:
    def fake_server(reply: bytes) -> tuple[socket.socket, threading.Thread]:
        lsock = socket.socket()
        lsock.bind((HOST, 0))
        lsock.listen(1)

        def serve() -> None:
            conn, _ = lsock.accept()
            recv_exact(conn, wire.PREAMBLE.size)
            conn.sendall(reply)
            time.sleep(0.5)
            conn.close()

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        return lsock, t

    lsock, t = fake_server(wire.PREAMBLE.pack(wire.MAGIC, 7, wire.HELLO_BAD_VERSION))
    with pytest.raises(DistStoreError, match="protocol version 7"):
        TCPStore(HOST, lsock.getsockname()[1], timeout=timedelta(seconds=5))
    t.join()
    lsock.close()
    lsock, t = fake_server(b"HTTP/1.1")
    with pytest.raises(DistStoreError, match="not a plugdist TCPStore"):
        TCPStore(HOST, lsock.getsockname()[1], timeout=timedelta(seconds=5))
    t.join()
    lsock.close()


@pytest.mark.timeout(120)
def test_rendezvous_of_many_concurrent_clients(master: TCPStore) -> None:
    """4 processes x 256 threads, one client each. "done" is set only when the count reaches the
    total, and no client closes before "done": so at that moment all 1024 are connected at once,
    and up to 1023 of them are parked in wait on the server."""
    nproc, per_proc = 4, 256
    total = nproc * per_proc
    spec = {"kind": "tcp", "host": HOST, "port": master.port, "timeout": 90}
    procs = [spawn("rendezvous", spec=spec, clients=per_proc, total=total) for _ in range(nproc)]
    outs = [result(p, timeout=110) for p in procs]
    assert [o["errors"] for o in outs] == [[]] * nproc
    counts = sorted(c for o in outs for c in o["counts"])
    assert counts == list(range(1, total + 1))  # each add atomic, each client counted once
    assert master.get("count") == str(total).encode()
    assert master.get("done") == b"1"
