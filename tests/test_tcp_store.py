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
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from structlog.testing import capture_logs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store_workers import result, spawn, wait_ready  # noqa: E402
from plugdist._log import get_logger
from plugdist.errors import DistNetworkError, DistStoreError, DistTimeoutError
from plugdist.store import TCPStore, TCPStoreLimits
from plugdist.store import _wire as wire
from plugdist.testing import free_port, wait_for

HOST = "127.0.0.1"


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def eventually(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    return wait_for(cond, timeout)


def raw_client(port: int, version: int = wire.VERSION, token: bytes | None = None,
               flags: int = 0) -> socket.socket:
    """A socket that did the handshake by hand (so the test can then misbehave)."""
    s = socket.create_connection((HOST, port), timeout=10)
    magic, their_version, _, server_nonce = wire.GREETING.unpack(recv_exact(s,
                                                                            wire.GREETING.size))
    assert (magic, their_version) == (wire.MAGIC, wire.VERSION)
    client_nonce = os.urandom(wire.NONCE_SIZE)
    proof = wire.NO_PROOF
    if token is not None:
        flags |= wire.FLAG_PROOF
        proof = wire.client_proof(token, server_nonce, client_nonce, flags)
    s.sendall(wire.HELLO.pack(wire.MAGIC, version, flags, client_nonce, proof))
    if version == wire.VERSION:
        _, _, status, _ = wire.WELCOME.unpack(recv_exact(s, wire.WELCOME.size))
        assert status == wire.HELLO_OK
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



@pytest.fixture(autouse=True)
def _info_logs() -> Any:
    """The server logs clients that simply went away at info level: capture those too."""
    from plugdist._log import set_log_level

    set_log_level("INFO")
    yield
    set_log_level("WARNING")

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
    with pytest.raises(ValueError, match="^TCPStore world size cannot be 0"):
        TCPStore(HOST, master.port, world_size=0)
    with pytest.raises(ValueError, match="world_size"):
        TCPStore(HOST, master.port, world_size=-3)
    with pytest.raises(DistNetworkError, match="resolve host"):
        TCPStore("no-such-host.invalid", master.port, timeout=timedelta(seconds=1))
    # a name is resolved once (here through /etc/hosts), then used as an address
    c = TCPStore("localhost", master.port, timeout=timedelta(seconds=5))
    c.set("via_name", "ok")
    assert master.get("via_name") == b"ok"
    c.close()
    # a second master on a port in use fails clearly and at once, in the words torch uses
    with pytest.raises(DistNetworkError, match=f"^The server socket has failed to listen on any "
                                               f"local network address. port: {master.port}"):
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
    with pytest.raises(DistTimeoutError, match=r"Timed out after 1 seconds waiting for clients\. "
                                               r"1/2 clients joined\. Start the other ranks"):
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


@pytest.mark.timeout(60)
def test_requests_after_the_server_exited_fail_at_once() -> None:
    """Once the master's server is gone, every request fails at once, not only the first (on
    the pooled connection): a new connection that is refused is not retried for the store's
    timeout, as it is while a store is built and its server may not listen yet. (Retried, a
    rank outliving rank 0 lost a whole timeout per store call, e.g. in
    plugins/debug/tests/test_debug.py's rank-0-exits-at-once test with resilient groups on.)"""
    m = TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=30))
    client = TCPStore(HOST, m.port, timeout=timedelta(seconds=30))
    client.set("k", "v")
    m.close()
    assert eventually(lambda: port_is_free(m.port))
    start = time.monotonic()
    for _ in range(3):  # the pooled connection is lost, then each request connects anew
        with pytest.raises(DistNetworkError, match=f"{HOST}:{m.port}"):
            client.get("k")
    with pytest.raises(DistNetworkError, match="refused a new connection"):
        client.add("n", 1)
    assert time.monotonic() - start < 10.0  # 4 requests; before: 30 s each after the first
    client.close()


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
        assert eventually(lambda: b"never_set" in server._waiters.waiting)  # parked on the server
        bystander = spawn("get", spec=spec, key="later_set")
        wait_ready(bystander)
        assert eventually(lambda: b"later_set" in server._waiters.waiting)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        victim.stdout.close()  # type: ignore[union-attr]
        victim.stderr.close()  # type: ignore[union-attr]
        assert eventually(lambda: b"never_set" not in server._waiters.waiting)  # waiter forgotten
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
    assert eventually(lambda: b"after_garbage" in server._waiters.waiting)

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
        assert recv_exact(s, wire.WELCOME.size) == wire.WELCOME.pack(
            wire.MAGIC, wire.VERSION, wire.HELLO_BAD_VERSION, wire.NO_PROOF)
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
            conn.sendall(reply)
            time.sleep(0.5)
            conn.close()

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        return lsock, t

    lsock, t = fake_server(wire.GREETING.pack(wire.MAGIC, 7, 0, bytes(wire.NONCE_SIZE)))
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


@pytest.mark.timeout(30)
def test_multi_tenant_masters_share_one_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch: test_multitenancy, test_take_over_listen_socket, test_agent_store, and the
    libuvBackend checks of TCPStoreTest."""
    port = free_port()
    first = TCPStore(HOST, port, 1, True, multi_tenant=True, timeout=timedelta(seconds=10))
    second = TCPStore(HOST, port, 1, True, multi_tenant=True, timeout=timedelta(seconds=10),
                      use_libuv=False)
    assert first.port == second.port == port
    assert first._server is second._server  # one server, one thread
    assert first.libuvBackend is True and second.libuvBackend is False
    first.set("shared", "by both")
    assert second.get("shared") == b"by both"
    name = f"plugdist-tcpstore-{port}"
    first.close()  # the other tenant still uses the server
    assert any(t.name == name for t in threading.enumerate())
    assert second.add("n", 1) == 1
    with pytest.raises(ValueError, match="different token"):
        TCPStore(HOST, port, 1, True, multi_tenant=True, token="other")
    second.close()
    assert eventually(lambda: port_is_free(port))
    # without multi_tenant a second master on the port is refused, as in torch
    solo = TCPStore(HOST, port, 1, True, timeout=timedelta(seconds=10))
    with pytest.raises(DistNetworkError, match="^The server socket has failed to listen"):
        TCPStore(HOST, port, 1, True, multi_tenant=True)
    # torchelastic's agent store: with TORCHELASTIC_USE_AGENT_STORE and MASTER_PORT naming the
    # port, a master store on it joins the running server instead of binding it
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_PORT", str(port))
    agent_client = TCPStore(HOST, port, 1, True, timeout=timedelta(seconds=10))
    assert not agent_client.is_master and agent_client.port == port
    solo.set("k", "v")
    assert agent_client.get("k") == b"v"
    agent_client.close()
    solo.close()

    # take over a socket the caller bound (it keeps the port reserved until then)
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind((HOST, 0))
    taken_port = lsock.getsockname()[1]
    m = TCPStore(HOST, taken_port, 1, True, master_listen_fd=lsock.detach(),
                 timeout=timedelta(seconds=10))
    m.set("key", "value")
    assert m.get("key") == b"value" and m.port == taken_port
    m.close()


@pytest.mark.timeout(30)
def test_bind_host_serves_one_interface_only() -> None:
    m = TCPStore(HOST, 0, is_master=True, bind_host=HOST, timeout=timedelta(seconds=10))
    try:
        assert m._server is not None and m._server._lsock.getsockname()[0] == HOST
        m.set("k", "v")
        assert TCPStore(HOST, m.port, timeout=timedelta(seconds=5)).get("k") == b"v"
        # another local address of this machine (127.0.0.2 is loopback too on Linux) is refused
        with pytest.raises(DistNetworkError, match="could not connect"):
            TCPStore("127.0.0.2", m.port, timeout=timedelta(seconds=1))
    finally:
        m.close()


def recording_proxy(target_port: int) -> tuple[int, list[bytes], threading.Thread]:
    """A one-connection TCP proxy to ``target_port`` that records what the client sends."""
    lsock = socket.socket()
    lsock.bind((HOST, 0))
    lsock.listen(1)
    sent: list[bytes] = []

    def pump(src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    sent.append(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve() -> None:
        client, _ = lsock.accept()
        lsock.close()
        upstream = socket.create_connection((HOST, target_port))
        back = threading.Thread(target=pump, args=(upstream, client, False), daemon=True)
        back.start()
        pump(client, upstream, True)
        back.join(5)
        client.close()
        upstream.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return lsock.getsockname()[1], sent, t


@pytest.mark.timeout(120)
def test_token_authentication(monkeypatch: pytest.MonkeyPatch) -> None:
    """Right token works; wrong token, no token, a replayed handshake and garbage before the
    handshake are refused (logged on the server, 'authentication failed' on the client, never a
    timeout) while 50 authenticated clients in two other processes keep working and lose
    nothing."""
    get_logger()
    token = "s3cret-" + os.urandom(8).hex()
    monkeypatch.setenv("PLUGDIST_STORE_TOKEN", token)  # read by default
    master = TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=60))
    server = master._server
    assert server is not None and server.token == token.encode()
    port = master.port
    spec = {"kind": "tcp", "host": HOST, "port": port, "timeout": 60}
    # the workers take the token from the environment, as plugdist-run hands it to them
    workers = [spawn("busy_clients", env={"PLUGDIST_STORE_TOKEN": token}, spec=spec,
                     clients=25, stop_key="attacks_done") for _ in range(2)]
    try:
        for p in workers:
            wait_ready(p)
        # every client is at work (its second round begun) before the attacks
        master.wait([f"client/{p.pid}-{i}/1" for p in workers for i in range(25)],
                    timedelta(seconds=60))

        def refused(**kw: object) -> str:
            start = time.monotonic()
            with pytest.raises(DistNetworkError, match="authentication failed") as info:
                TCPStore(HOST, port, timeout=timedelta(seconds=30), **kw)  # type: ignore[arg-type]
            assert time.monotonic() - start < 10  # refused at once, not timed out
            assert not isinstance(info.value, DistTimeoutError)
            return str(info.value)

        with capture_logs() as logs:
            assert "refused this client's token" in refused(token="wrong")
            assert "requires a token and this client has none" in refused(token="")
            monkeypatch.delenv("PLUGDIST_STORE_TOKEN")
            assert "requires a token" in refused()  # no token anywhere
            monkeypatch.setenv("PLUGDIST_STORE_TOKEN", token)

            # a replayed handshake: record a real client's hello through a proxy, then send it
            # on a new connection; the server's fresh nonce makes the recorded proof worthless
            proxy_port, sent, proxy = recording_proxy(port)
            lsock_client = TCPStore(HOST, proxy_port, timeout=timedelta(seconds=10))
            lsock_client.set("via_proxy", "ok")
            lsock_client.close()
            proxy.join(10)
            hello = b"".join(sent)[:wire.HELLO.size]
            assert len(hello) == wire.HELLO.size and hello.startswith(wire.MAGIC)
            replay = socket.create_connection((HOST, port), timeout=10)
            greeting = recv_exact(replay, wire.GREETING.size)
            assert greeting[8:] != b"\0" * wire.NONCE_SIZE
            replay.sendall(hello)
            _, _, status, _ = wire.WELCOME.unpack(recv_exact(replay, wire.WELCOME.size))
            assert status == wire.HELLO_AUTH_FAILED
            assert closed_by_server(replay)
            replay.close()

            # garbage before the handshake, and a request frame sent without one
            for junk in (os.urandom(64), wire.request(wire.Op.GET, b"\0" * 16)):
                s = socket.create_connection((HOST, port), timeout=10)
                recv_exact(s, wire.GREETING.size)
                s.sendall(junk)
                assert closed_by_server(s)
                s.close()
            # a handshake proved with the wrong token, by hand
            s = socket.create_connection((HOST, port), timeout=10)
            _, _, _, nonce = wire.GREETING.unpack(recv_exact(s, wire.GREETING.size))
            cn = os.urandom(wire.NONCE_SIZE)
            s.sendall(wire.HELLO.pack(wire.MAGIC, wire.VERSION, wire.FLAG_PROOF, cn,
                                      wire.client_proof(b"guess", nonce, cn, wire.FLAG_PROOF)))
            assert wire.WELCOME.unpack(recv_exact(s, wire.WELCOME.size))[2] == \
                wire.HELLO_AUTH_FAILED
            s.close()

        reasons = [e["reason"] for e in logs if e["event"] == "tcp_store_auth_failed"]
        assert sum("wrong token" in r for r in reasons) == 3, reasons  # wrong, replay, by hand
        assert sum("no token" in r for r in reasons) == 2, reasons
        dropped = [e["reason"] for e in logs if e["event"] == "tcp_store_client_dropped"]
        assert sum("bad magic" in r for r in dropped) == 2, dropped
        assert master.get("via_proxy") == b"ok"
        master.set("attacks_done", "1")
        outs = [result(p, timeout=60) for p in workers]
    finally:
        for p in workers:
            if p.poll() is None:
                p.kill()
    assert [o["errors"] for o in outs] == [[], []]
    rounds = {name: n for o in outs for name, n in o["rounds"].items()}
    assert len(rounds) == 50 and all(n >= 2 for n in rounds.values())
    assert master.get("total") == str(sum(rounds.values())).encode()  # no add lost
    keys = [f"client/{name}/{i}" for name, n in rounds.items() for i in range(n)]
    values = master.multi_get(keys)
    assert values == [k.split("/", 1)[1].replace("/", ":").encode() for k in keys]
    assert server.alive
    master.close()


@pytest.mark.timeout(30)
def test_token_is_checked_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client with a token refuses a server that cannot prove it (started without one), and
    clones keep the token they were made with."""
    monkeypatch.delenv("PLUGDIST_STORE_TOKEN", raising=False)
    open_master = TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=10))
    with pytest.raises(DistNetworkError, match="authentication failed.*started without one"):
        TCPStore(HOST, open_master.port, token="mine", timeout=timedelta(seconds=10))
    plain = TCPStore(HOST, open_master.port, timeout=timedelta(seconds=10))  # as before
    plain.set("k", "v")
    open_master.close()
    plain.close()

    m = TCPStore(HOST, 0, is_master=True, token=b"\x00binary token\xff",
                 timeout=timedelta(seconds=10))
    c = m.clone()  # the token travels with the clone, not through the environment
    c.set("k", "v")
    assert m.get("k") == b"v"
    assert "token" in repr(m) and "binary" not in repr(m)
    c.close()
    m.close()


def limited_master(**limits: object) -> TCPStore:
    return TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=20), token="",
                    limits=TCPStoreLimits(**limits))  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_limits_on_frames_handshakes_and_stalls() -> None:
    """A frame over the configured limit, a handshake never finished, a connection that never
    sends a request (no token: nothing else proves it), a frame half sent then left to sit, and
    one trickled a byte at a time each drop that client (logged with the reason); others carry
    on."""
    get_logger()
    m = limited_master(max_frame_bytes=1024, handshake_timeout=timedelta(seconds=0.3),
                       frame_timeout=timedelta(seconds=0.3), min_frame_bytes_per_second=1000)
    port = m.port
    with capture_logs() as logs:
        # a trickle: 1000 bytes get 0.3 s + 1 s, whatever the pace of single bytes
        trickle = raw_client(port)
        trickle.sendall(wire.HEADER.pack(995, wire.Op.SET))
        start = time.monotonic()
        while time.monotonic() - start < 8:
            try:
                trickle.sendall(b"x")
            except OSError:
                break
            time.sleep(0.05)
        assert closed_by_server(trickle) and time.monotonic() - start < 4
        idle = raw_client(port)  # handshaken, never a request
        big = raw_client(port)
        big.sendall(wire.HEADER.pack(1025, wire.Op.SET))
        assert closed_by_server(big)
        silent = socket.create_connection((HOST, port), timeout=10)
        recv_exact(silent, wire.GREETING.size)  # ... and never says hello
        half_hello = socket.create_connection((HOST, port), timeout=10)
        recv_exact(half_hello, wire.GREETING.size)
        half_hello.sendall(wire.MAGIC + b"\0\2")  # a handshake's clock never resets
        half = raw_client(port)
        half.sendall(wire.request(wire.Op.SET, b"\0\0\0\x03abc\0\0\0\x05hello")[:9])
        start = time.monotonic()
        for s in (silent, half_hello, half, idle):
            assert closed_by_server(s)
        assert time.monotonic() - start < 8
        # the limit is the frame's body; a value that fits goes through
        m.set("fits", b"x" * 900)
        assert m.get("fits") == b"x" * 900
        with pytest.raises(DistNetworkError):
            m.set("too_big", b"x" * 2000)  # the server drops this connection
        assert m.get("fits") == b"x" * 900  # the store opens a new one
    reasons = [e["reason"] for e in logs if e["event"] == "tcp_store_client_dropped"]
    # the raw client's, and the set's twice: a connection closed without a reply may have
    # been closed before the request came, so the client tries once more on another
    assert sum("exceeds the limit of 1024" in r for r in reasons) == 3, reasons
    assert sum("no complete handshake" in r for r in reasons) == 2, reasons
    assert sum("frame arriving too slowly" in r for r in reasons) == 2, reasons
    # the idle raw client, and the master store's own first connection, which its set then
    # replaced without a word (a connection that never carried a request is looked at first)
    assert sum("no request within" in r for r in reasons) == 2, reasons
    for s in (big, silent, half_hello, half, idle, trickle):
        s.close()
    m.close()


@pytest.mark.timeout(60)
def test_connection_limit() -> None:
    """Connections that proved the token fill the server: a new one is refused, saying so.
    (Connections that did not, guests, are displaced instead: test_store_server.py.)"""
    get_logger()
    m = TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=20), token="limit",
                 limits=TCPStoreLimits(max_connections=4))  # the master's own is one
    with capture_logs() as logs:
        held = [raw_client(m.port, token=b"limit") for _ in range(3)]
        assert eventually(lambda: len(m._server._conns) == 4)  # type: ignore[union-attr]
        start = time.monotonic()
        with pytest.raises(DistNetworkError, match="connection limit"):
            TCPStore(HOST, m.port, timeout=timedelta(seconds=1), token="limit")
        assert time.monotonic() - start < 8
        m.set("still", "served")  # the connections inside the limit are untouched
        held[0].sendall(wire.request(wire.Op.NUM_KEYS, b""))
        assert wire.HEADER.unpack(recv_exact(held[0], 5)) == (8, wire.Status.OK)
        held.pop().close()
        c = TCPStore(HOST, m.port, timeout=timedelta(seconds=10), token="limit")  # a slot
        assert c.get("still") == b"served"
        c.close()
    lines = [e for e in logs if e["event"] == "tcp_store_connection_limit"]
    assert lines and lines[0]["limit"] == 4 and "max_connections" in lines[0]["hint"]
    assert len(lines) <= 3  # one line per second at most, not one per refused attempt
    for s in held:
        s.close()
    m.close()


@pytest.mark.timeout(60)
def test_one_client_cannot_grow_server_memory() -> None:
    """A slow reader's unread replies stop the server reading its requests (its buffers stay
    bounded); a client that keeps sending while its wait is parked is dropped; a flood of waits
    on keys that never come costs one index entry per parked connection."""
    get_logger()
    unread_limit = 256 * 1024
    m = limited_master(max_unread_reply_bytes=unread_limit, max_parked_inbound_bytes=4096)
    server = m._server
    assert server is not None
    value = os.urandom(128 * 1024)
    m.set("big", value)
    get_big = wire.HDR_F64_BLOB.pack(15, wire.Op.GET, 1.0, 3) + b"big"
    with capture_logs() as logs:
        slow = raw_client(m.port)
        n_requests = 400  # 400 x 128 KiB = 50 MiB of replies if the server kept them all
        sender = threading.Thread(target=lambda: slow.sendall(get_big * n_requests), daemon=True)
        sender.start()

        def slow_conn():  # type: ignore[no-untyped-def]
            return next((c for c in server._conns.values()
                         if c.peer.endswith(f":{slow.getsockname()[1]}")), None)

        assert eventually(lambda: (c := slow_conn()) is not None and c.paused)
        c = slow_conn()
        assert len(c.out) <= unread_limit + len(value) + 64
        assert len(c.inbuf) <= n_requests * len(get_big)
        m.set("other", "served while it sits")  # everyone else is served meanwhile
        assert m.get("other") == b"served while it sits"
        # now it reads: every reply arrives, whole and in order
        for _ in range(n_requests):
            length, status = wire.HEADER.unpack(recv_exact(slow, 5))
            assert (length, status) == (len(value), wire.Status.OK)
            assert recv_exact(slow, length) == value
        sender.join(10)

        # a flood of waits on keys that never come, each on many keys
        keys = [f"never/{i}".encode() for i in range(2000)]
        waiters = []
        for _ in range(20):
            s = raw_client(m.port)
            s.sendall(wire.request(wire.Op.WAIT, wire.F64.pack(60.0) + wire.pack_blobs(keys)))
            waiters.append(s)
        assert eventually(lambda: server._waiters.parked == 20)
        assert len(server._waiters.waiting) == 1 and len(server._waiters.waiting[keys[0]]) == 20
        m.set("never/0", "1")  # they all move on to the next missing key, still one entry
        assert eventually(lambda: list(server._waiters.waiting) == [keys[1]])
        # sending while parked is against the protocol; past the allowance the client goes
        waiters[0].sendall(b"\0" * 8192)
        assert closed_by_server(waiters[0])
        assert eventually(lambda: server._waiters.parked == 19)
        for s in waiters:
            s.close()
        assert eventually(lambda: server._waiters.parked == 0 and not server._waiters.waiting)
    reasons = [e["reason"] for e in logs if e["event"] == "tcp_store_client_dropped"]
    assert any("while its request was parked" in r for r in reasons), reasons
    slow.close()
    m.close()


# ---- fuzzing the wire protocol -----------------------------------------------------------------

FUZZ_EXAMPLES = int(os.environ.get("PLUGDIST_STORE_FUZZ_EXAMPLES", "120"))


def _fuzz_strategies():  # type: ignore[no-untyped-def]
    from hypothesis import strategies as st

    keys = st.sampled_from([f"k{i}".encode() for i in range(8)] + [b"", b"init/"])
    values = st.binary(max_size=64)
    timeouts = st.one_of(st.floats(0, 0.05), st.floats(allow_nan=True, allow_infinity=True))
    blob = keys.map(lambda k: wire.U32.pack(len(k)) + k)

    def blobs(items):  # type: ignore[no-untyped-def]
        return st.lists(items, max_size=6).map(lambda xs: wire.pack_blobs(xs))

    bodies = {
        wire.Op.SET: st.tuples(blob, values).map(lambda t: t[0] + wire.U32.pack(len(t[1])) + t[1]),
        wire.Op.GET: st.tuples(timeouts, keys).map(
            lambda t: wire.F64.pack(t[0]) + wire.U32.pack(len(t[1])) + t[1]),
        wire.Op.ADD: st.tuples(st.integers(-(2**63), 2**63 - 1), keys).map(
            lambda t: wire.I64.pack(t[0]) + wire.U32.pack(len(t[1])) + t[1]),
        wire.Op.COMPARE_SET: st.tuples(blob, values, values).map(
            lambda t: t[0] + wire.pack_blobs([t[1], t[2]])[4:]),
        wire.Op.WAIT: st.tuples(timeouts, blobs(keys)).map(lambda t: wire.F64.pack(t[0]) + t[1]),
        wire.Op.CHECK: blobs(keys),
        wire.Op.NUM_KEYS: st.just(b""),
        wire.Op.DELETE_KEY: blob,
        wire.Op.MULTI_GET: st.tuples(timeouts, blobs(keys)).map(
            lambda t: wire.F64.pack(t[0]) + t[1]),
        wire.Op.MULTI_SET: blobs(st.one_of(keys, values)),
        wire.Op.WAIT_WORKERS: st.tuples(timeouts, st.integers(-(2**63), 2**63 - 1)).map(
            lambda t: wire.F64.pack(t[0]) + wire.I64.pack(t[1])),
        wire.Op.APPEND: st.tuples(blob, values).map(
            lambda t: t[0] + wire.U32.pack(len(t[1])) + t[1]),
        wire.Op.QUEUE_PUSH: st.tuples(blob, values).map(
            lambda t: t[0] + wire.U32.pack(len(t[1])) + t[1]),
        wire.Op.QUEUE_POP: st.tuples(timeouts, st.integers(0, 255), keys).map(
            lambda t: wire.F64.pack(t[0]) + bytes([t[1]]) + wire.U32.pack(len(t[2])) + t[2]),
        wire.Op.QUEUE_LEN: blob,
    }
    valid = st.one_of(*[b.map(lambda body, op=op: wire.request(op, body))
                        for op, b in bodies.items()])

    def mutate(frame: bytes, data):  # type: ignore[no-untyped-def]
        kind = data.draw(st.sampled_from(["flip", "truncate", "length", "code", "splice"]))
        b = bytearray(frame)
        if kind == "flip":
            for _ in range(data.draw(st.integers(1, 4))):
                i = data.draw(st.integers(0, len(b) - 1))
                b[i] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "truncate":
            del b[data.draw(st.integers(0, len(b))):]
        elif kind == "length":
            b[:4] = wire.U32.pack(data.draw(st.integers(0, 2**32 - 1)))
        elif kind == "code":
            b[4] = data.draw(st.integers(0, 255))
        else:
            b += data.draw(st.binary(max_size=32))
        return bytes(b)

    @st.composite
    def frames(draw):  # type: ignore[no-untyped-def]
        how = draw(st.sampled_from(["valid", "valid", "mutated", "random"]))
        if how == "random":
            return draw(st.binary(min_size=1, max_size=128))
        frame = draw(valid)
        return frame if how == "valid" else mutate(frame, _Drawer(draw))

    return frames()


class _Drawer:
    """Adapts a composite's ``draw`` to the ``data.draw`` interface ``mutate`` uses."""

    def __init__(self, draw) -> None:  # type: ignore[no-untyped-def]
        self.draw = draw


@pytest.mark.timeout(600)
def test_fuzz_wire_protocol() -> None:
    """Random, valid and mutated frames from many clients (some before their handshake); then
    the server answers, no other client's data changed, no server thread died, and what the
    server holds for the fuzzing clients is gone. PLUGDIST_STORE_FUZZ_EXAMPLES sets how many
    rounds (4 clients each) run: the default keeps CI to a few seconds."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    get_logger()
    m = TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=30), token="fuzz")
    server = m._server
    assert server is not None
    port = m.port
    sentinels = {f"sentinel/{os.urandom(8).hex()}": os.urandom(32) for _ in range(20)}
    m.multi_set(list(sentinels), list(sentinels.values()))
    queue = f"sentinel/{os.urandom(8).hex()}"
    for i in range(5):
        m.queue_push(queue, f"item{i}")
    release = f"sentinel/{os.urandom(8).hex()}"
    watcher = TCPStore(HOST, port, timeout=timedelta(seconds=300), token="fuzz")
    parked: list[bytes] = []
    waiter = threading.Thread(target=lambda: parked.append(watcher.get(release)), daemon=True)
    waiter.start()
    assert eventually(lambda: server._waiters.parked == 1)
    # a mutated frame can be a valid DELETE_PREFIX (a GET with timeout 0.0 whose op code changed
    # reads as the prefix "", which deletes every plain key): a token holder may do that, so
    # the sentinels are then checked only for what is left of them
    prefix_deletes: list[bytes] = []
    delete_prefix = server._commands.handlers[wire.Op.DELETE_PREFIX]

    def recorded_delete_prefix(conn: Any, buf: bytes, pos: int, end: int) -> Any:
        prefix_deletes.append(bytes(buf[pos:end]))
        return delete_prefix(conn, buf, pos, end)

    server._commands.handlers[wire.Op.DELETE_PREFIX] = recorded_delete_prefix
    rounds: list[int] = []

    def connect(handshake: bool) -> socket.socket:
        if handshake:
            return raw_client(port, token=b"fuzz")
        s = socket.create_connection((HOST, port), timeout=10)
        recv_exact(s, wire.GREETING.size)
        return s

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(st.integers(0, 3), _fuzz_strategies()), min_size=1, max_size=24),
           st.booleans())
    def one_round(sends: list[tuple[int, bytes]], last_unauthenticated: bool) -> None:
        rounds.append(len(sends))
        socks = [connect(handshake=i < 3 or not last_unauthenticated) for i in range(4)]
        try:
            for i, frame in sends:
                try:
                    socks[i].sendall(frame)
                except OSError:
                    pass  # the server dropped this one already
        finally:
            for s in socks:
                s.close()

    with capture_logs() as logs:
        one_round()
        assert len(rounds) >= FUZZ_EXAMPLES
        print(f"fuzz: {len(rounds)} rounds, {sum(rounds)} frames")
        # everything the fuzzing clients left behind goes away once they are gone
        assert eventually(lambda: len(server._conns) == 2 and server._waiters.parked == 1, 30)
        assert not server._pending and list(server._waiters.waiting) == [release.encode()]
        assert all(len(c.inbuf) == 0 and len(c.out) == 0 for c in server._conns.values())
        assert len(server._waiters.deadlines) <= 2048
    bugs = [e for e in logs if e["event"] in ("tcp_store_internal_error",
                                               "tcp_store_server_crashed")]
    assert bugs == []
    # the fuzz reached both sides of the protocol: writes that landed and clients dropped
    assert any(e["event"] == "tcp_store_client_dropped" for e in logs)
    assert server.alive
    if not prefix_deletes:
        assert any(m.check([f"k{i}"]) for i in range(8))
        assert m.multi_get(list(sentinels)) == list(sentinels.values())
        assert [m.queue_pop(queue) for _ in range(5)] == [f"item{i}".encode() for i in range(5)]
    else:
        print(f"fuzz: {len(prefix_deletes)} DELETE_PREFIX frames served")
        assert all(m.get(k) == v for k, v in sentinels.items() if m.check([k]))
        left = m.queue_len(queue)
        assert left in (0, 5)
        assert [m.queue_pop(queue) for _ in range(left)] == [
            f"item{i}".encode() for i in range(left)]
    assert waiter.is_alive()
    m.set(release, "done")
    waiter.join(10)
    assert parked == [b"done"]
    fresh = TCPStore(HOST, port, timeout=timedelta(seconds=10), token="fuzz")
    assert fresh.add("after_fuzz", 1) == 1
    fresh.close()
    watcher.close()
    m.close()


@pytest.mark.timeout(60)
def test_requests_of_many_keys_are_read_in_slices_while_others_are_served(
        master: TCPStore) -> None:
    """MULTI_SET, CHECK, WAIT and MULTI_GET of 20,000 keys (read a slice a turn) answer as a
    whole (a MULTI_SET refused by its last pair writes nothing); a
    WAIT parked after its slices wakes when its last key comes; another client's requests are
    answered, in order, through a flood of such CHECKs (the latency: store_abuse_bench.py)."""
    keys = [f"k/{i}" for i in range(20_000)]
    c = TCPStore(HOST, master.port, timeout=timedelta(seconds=30))
    with pytest.raises(DistStoreError, match="belongs to a world's membership"):
        c.multi_set([*keys, "plugdist/live/deaths"], ["v"] * 20_001)  # refused in its last slice
    assert not c.check(keys[:1])  # all or nothing
    c.multi_set(keys, [str(i) for i in range(20_000)])
    assert c.check(keys) is True
    assert c.check([*keys, "k/missing"]) is False
    assert c.check(["k/missing", *keys]) is False
    values = c.multi_get(keys)
    assert values[0] == b"0" and values[-1] == b"19999" and len(values) == 20_000

    def late() -> None:
        time.sleep(0.3)
        master.set("k/late", "x")

    setter = threading.Thread(target=late)
    setter.start()
    c.wait([*keys, "k/late"], timedelta(seconds=20))  # parked after its slices, then woken
    setter.join()
    assert c.get("k/late") == b"x"

    stop = threading.Event()
    checks = [0]

    def flood() -> None:
        s = TCPStore(HOST, master.port, timeout=timedelta(seconds=30))
        while not stop.is_set():
            assert s.check(keys)
            checks[0] += 1
        s.close()

    flooder = threading.Thread(target=flood)
    flooder.start()
    assert eventually(lambda: checks[0] >= 1)
    for i in range(50):
        c.set(f"small/{i}", str(i))
        assert c.get(f"small/{i}") == str(i).encode()
    stop.set()
    flooder.join(30)
    assert not flooder.is_alive() and checks[0] >= 1
    c.close()


@pytest.mark.timeout(120)
def test_a_multi_set_of_many_keys_is_written_whole_when_its_client_leaves_at_once(
        master: TCPStore) -> None:
    """A MULTI_SET of 20,000 pairs (written a slice a turn) from a client that closes as soon as
    it sent it is still written whole; a MULTI_GET of those keys, parked on them, gets every
    value (packed a slice a turn); a key deleted under a MULTI_GET sends it back to waiting."""
    keys = [f"gone/{i}" for i in range(20_000)]
    reader = TCPStore(HOST, master.port, timeout=timedelta(seconds=60))
    got: list[list[bytes]] = []
    parked = threading.Thread(target=lambda: got.append(reader.multi_get(keys)))
    parked.start()
    s = raw_client(master.port)
    s.sendall(wire.request(wire.Op.MULTI_SET, wire.pack_blobs(
        [b for i, k in enumerate(keys) for b in (k.encode(), str(i).encode())])))
    s.close()
    parked.join(60)
    assert not parked.is_alive()
    assert got[0] == [str(i).encode() for i in range(20_000)]
    assert master.check(keys)

    with ThreadPoolExecutor(1) as pool:
        for _ in range(20):  # deletions racing a MULTI_GET being packed: it waits, then answers
            again = pool.submit(reader.multi_get, keys)
            master.delete_key(keys[-1])
            master.set(keys[-1], "last")
            values = again.result(60)
            assert values[:-1] == got[0][:-1] and values[-1] in (b"19999", b"last")
    reader.close()
