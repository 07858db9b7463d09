"""The TCPStore server never dies of a request: a world's root must end in ``/`` (or be empty),
a bug in a handler or a deferred action answers ERROR and is logged while the loop serves on,
and a sequence fuzzer drives many connections through claims, joins, members' writes, records,
plain writes and closes at every point. Real server, real sockets on loopback. (Single frames
fuzzed: ``test_tcp_store.py::test_fuzz_wire_protocol``; strangers against real worlds:
``test_security.py``.)"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from plugdist._log import get_logger
from plugdist.errors import DistStoreError
from plugdist.store import TCPStore
from plugdist.store import _wire as wire
from structlog.testing import capture_logs

HOST = "127.0.0.1"
T = timedelta(seconds=20)


def eventually(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture
def master() -> Iterator[TCPStore]:
    get_logger()  # configure logging before a test captures it
    m = TCPStore(HOST, 0, is_master=True, timeout=T, token="")
    yield m
    m.close()


def client(m: TCPStore) -> TCPStore:
    return TCPStore(HOST, m.port, timeout=T, token="")


@pytest.mark.timeout(60)
def test_a_world_root_is_empty_or_ends_in_a_slash(master: TCPStore) -> None:
    """Under a root without a trailing ``/`` the world's keys would not be reserved: a claim, a
    join, a member's write and a record there are refused, naming the rule."""
    c = client(master)
    with pytest.raises(DistStoreError, match="must be empty or end in '/'"):
        c.claim_member("x", "0", 2, 10.0)
    with pytest.raises(DistStoreError, match="must be empty or end in '/'"):
        c.join_member("x", 10.0)
    member = c.claim_member("x/", "0", 1, 10.0)  # with the slash: a world like any other
    with pytest.raises(DistStoreError, match="reserved|membership"):
        c.set("x/plugdist/epoch/current", "nope")
    c.set("xplugdist/epoch/current", "nope")  # a plain key, of no world
    from plugdist.store._tcp_client import TCPStoreSession
    bad = TCPStoreSession(c._request, None, b"x", "0", os.urandom(16))  # type: ignore[arg-type]
    with pytest.raises(DistStoreError, match="must be empty or end in '/'"):
        bad.set("plugdist/epoch/current", "1")
    with pytest.raises(DistStoreError, match="must be empty or end in '/'"):
        bad.record(json.dumps({"uid": "0", "cause": "left"}))
    member.will.cancel()
    c.close()


@pytest.mark.timeout(60)
def test_a_bug_in_a_handler_answers_error_and_the_server_serves_on(master: TCPStore) -> None:
    """A handler that raises what no malformed request raises (a server bug): that request is
    answered ERROR, the bug logged once with its traceback, the connection and every other
    one served on."""
    server = master._server
    assert server is not None
    c = client(master)
    c.set("k", "v")

    def broken(conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        raise RuntimeError("a bug")

    real = server._commands.handlers[wire.Op.NUM_KEYS]
    server._commands.handlers[wire.Op.NUM_KEYS] = broken
    try:
        with capture_logs() as logs:
            with pytest.raises(DistStoreError, match="inside the store's server"):
                c.num_keys()
            assert c.get("k") == b"v"  # the same connection, served on
    finally:
        server._commands.handlers[wire.Op.NUM_KEYS] = real
    bugs = [e for e in logs if e["event"] == "tcp_store_internal_error"]
    assert len(bugs) == 1 and "RuntimeError: a bug" in bugs[0]["traceback"], bugs
    assert server.alive and master.get("k") == b"v"
    c.close()


@pytest.mark.timeout(60)
def test_a_release_that_meets_an_unreadable_epoch_is_skipped_not_raised(
        master: TCPStore) -> None:
    """A world's release parses its current epoch; a value that does not parse (which no
    client can write any more: the root rule and the members' checked writes) is logged and
    read as the first epoch: the member's death is still written and the server serves on."""
    server = master._server
    assert server is not None
    c = client(master)
    member = c.claim_member("w/", "0", 2, 10.0)
    server._keys.data[b"w/plugdist/epoch/current"] = b"not a number"
    with capture_logs() as logs:
        member.will._conn.close()  # dropped: the server releases the identity
        assert eventually(lambda: master.check(["w/plugdist/live/deaths/1"]))
    assert json.loads(master.get("w/plugdist/live/deaths/1")) == {"uid": "0", "cause": "died"}
    assert any(e["event"] == "tcp_store_world_unreadable" for e in logs), logs
    assert not [e for e in logs if e["event"] == "tcp_store_internal_error"]
    assert server.alive and c.add("after", 1) == 1
    c.close()


def test_a_token_file_other_users_can_read_is_refused(tmp_path: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """As ssh refuses a private key others can read: the error names the fix."""
    from plugdist.store._tokens import read_token_file

    path = tmp_path / "job.token"
    path.write_text("s3cret\n")
    for mode in (0o644, 0o640, 0o620, 0o604):
        path.chmod(mode)
        with pytest.raises(DistStoreError, match=f"chmod 600 {path}"):
            read_token_file(str(path))
    path.chmod(0o600)
    assert read_token_file(str(path)) == b"s3cret"
    path.chmod(0o400)
    assert read_token_file(str(path)) == b"s3cret"
    path.chmod(0o644)
    monkeypatch.delenv("PLUGDIST_STORE_TOKEN", raising=False)
    monkeypatch.setenv("PLUGDIST_STORE_TOKEN_FILE", str(path))  # the way a job gives it
    with pytest.raises(DistStoreError, match="chmod 600"):
        TCPStore(HOST, 0, is_master=True, timeout=T)


def raw_client(port: int) -> socket.socket:
    """A tokenless connection that did the handshake by hand (and then misbehaves)."""
    s = socket.create_connection((HOST, port), timeout=10)
    got = b""
    while len(got) < wire.GREETING.size:
        got += s.recv(wire.GREETING.size - len(got))
    s.sendall(wire.HELLO.pack(wire.MAGIC, wire.VERSION, 0, os.urandom(wire.NONCE_SIZE),
                              wire.NO_PROOF))
    got = b""
    while len(got) < wire.WELCOME.size:
        got += s.recv(wire.WELCOME.size - len(got))
    return s


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.timeout(120)
def test_a_reply_over_the_limit_is_refused_and_unread_replies_cost_no_copy(
        master: TCPStore) -> None:
    """A MULTI_GET naming one 8 MiB value 64 times (a 512 MiB reply) is refused naming the
    limit, before anything is packed; 7 times (56 MiB) is answered. Eight clients that send
    such requests and never read hold no copy of their replies (they refer to the stored
    value): the server's memory does not grow by their size, and another client is served."""
    server = master._server
    assert server is not None
    c = client(master)
    big = os.urandom(8 << 20)
    c.set("big", big)
    with pytest.raises(DistStoreError, match=r"max_reply_bytes"):
        c.multi_get(["big"] * 64)
    assert c.multi_get(["big"] * 7) == [big] * 7
    frame = wire.request(wire.Op.MULTI_GET, wire.F64.pack(10.0) + wire.pack_blobs([b"big"] * 7))
    before = rss()
    hogs = [raw_client(master.port) for _ in range(8)]
    for s in hogs:
        s.setblocking(False)
        for _ in range(50):  # pipelined; never read: the server stops reading it soon
            try:
                s.send(frame)
            except BlockingIOError:
                break
    assert eventually(lambda: sum(1 for x in server._conns.values() if x.paused) == 8)
    unread = sum(len(x.out) for x in server._conns.values())
    assert unread >= 8 * (7 << 23) // 2  # each holds a reply of 56 MiB, less what was sent
    grown = rss() - before
    assert grown < 100 << 20, f"the server's memory grew by {grown >> 20} MiB"
    for i in range(20):
        c.set(f"small/{i}", str(i))
        assert c.get(f"small/{i}") == str(i).encode()
    for s in hogs:
        s.close()
    assert eventually(lambda: len(server._conns) == 2)
    c.close()


def bound_to(host: str, port: int) -> socket.socket:
    """A guest from the loopback address ``host`` that sent one request (proven, no token)."""
    s = socket.create_connection((HOST, port), timeout=10, source_address=(host, 0))
    got = b""
    while len(got) < wire.GREETING.size:
        got += s.recv(wire.GREETING.size - len(got))
    s.sendall(wire.HELLO.pack(wire.MAGIC, wire.VERSION, 0, os.urandom(wire.NONCE_SIZE),
                              wire.NO_PROOF) + wire.request(wire.Op.NUM_KEYS, b""))
    got = b""
    while len(got) < wire.WELCOME.size + 13:
        chunk = s.recv(64)
        if not chunk:
            break
        got += chunk
    return s


def hung_up(s: socket.socket) -> bool:
    s.settimeout(0.001)
    try:
        return s.recv(64) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


@pytest.mark.timeout(90)
def test_guests_are_bounded_and_members_connections_never_are() -> None:
    """Without a token, a connection is a member's once it holds an identity or its client
    vouched with the identity's credential; the others are guests: at most
    ``max_guests_per_address`` from one address (a new one displaces the oldest), displaced
    rather than a new connection refused when the server is full, and dropped when idle. The
    member's connections are never touched, and a guest client whose pooled connection was
    dropped while idle simply opens another."""
    from plugdist.store import TCPStoreLimits
    get_logger()
    limits = TCPStoreLimits(max_connections=12, max_guests_per_address=3,
                            guest_idle_timeout=timedelta(seconds=2))
    m = TCPStore(HOST, 0, is_master=True, timeout=T, token="", limits=limits)
    server = m._server
    assert server is not None
    member = client(m)
    session = member.claim_member("", "0", 1, 30.0)
    member.set("mine", "1")  # its pooled connection vouches first
    assert sum(c.trusted for c in server._conns.values()) == 2
    with capture_logs() as logs:
        strangers = [bound_to("127.0.0.2", m.port) for _ in range(6)]
        assert eventually(lambda: sum(hung_up(s) for s in strangers[:3]) == 3)
        assert not any(hung_up(s) for s in strangers[3:])  # the newest three stay
        # the server fills with guests from other addresses; a member's new client still gets in
        more = [bound_to(f"127.0.0.{3 + i // 3}", m.port) for i in range(9)]
        assert len(server._conns) <= 12
        other = client(m)
        other_session = other.claim_member("w/", "0", 1, 30.0)
        assert other.get("mine") == b"1" and member.get("mine") == b"1"
        displaced = [e for e in logs if "displaced by a newer connection" in
                     e.get("reason", "")]
        assert displaced, logs
        # idle guests go; members' connections and the master's client (which reconnects) stay
        assert eventually(lambda: all(hung_up(s) for s in strangers[3:] + more), 30)
        assert sum(c.trusted for c in server._conns.values()) == 4
        assert m.add("counter", 1) == 1  # its pooled guest connection was dropped: a new one
    assert session.will._conn is not None and member.get("mine") == b"1"
    for s in strangers + more:
        s.close()
    session.will.cancel()
    other_session.will.cancel()
    member.close()
    other.close()
    m.close()
