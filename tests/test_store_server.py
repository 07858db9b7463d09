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
from plugdist.store import TCPStore, TCPStoreLimits
from plugdist.store import _wire as wire
from plugdist.testing import wait_for
from structlog.testing import capture_logs

HOST = "127.0.0.1"
T = timedelta(seconds=20)


def eventually(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    return wait_for(cond, timeout)


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


_STRANGER_WRITES_SMALL = """
import encodings.idna, os, socket, sys  # idna: loaded while the interpreter's files are readable
from plugdist.store import _wire as wire
os.setgid(65534); os.setuid(65534)
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=20)
def exact(n):
    got = b""
    while len(got) < n:
        got += s.recv(n - len(got))
    return got
exact(wire.GREETING.size)
s.sendall(wire.HELLO.pack(wire.MAGIC, wire.VERSION, 0, os.urandom(wire.NONCE_SIZE),
                          wire.NO_PROOF))
exact(wire.WELCOME.size)
def frames(n):
    if sys.argv[2] == "queue_push":  # an empty key and value
        return wire.request(wire.Op.QUEUE_PUSH, wire.pack_blobs([b"", b""])) * n
    return b"".join(wire.request(wire.Op.MULTI_SET, wire.pack_blobs([b"%08x" % i, b""]))
                    for i in range(written, written + n))
written = 0
while written < 20000:  # 20,000 tiny writes, or until refused
    s.sendall(frames(500))
    refusal = None
    for _ in range(500):
        length, status = wire.HEADER.unpack(exact(5))
        body = exact(length)
        if status != wire.Status.OK:
            refusal = refusal or body.decode()
        elif refusal is None:
            written += 1
    if refusal:
        print(written, refusal)
        sys.exit()
print(written, "never refused")
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs a second Unix user (runs as root)")
@pytest.mark.parametrize("op", ["queue_push", "multi_set"])
def test_a_strangers_tiny_writes_count_what_their_entries_cost(op: str) -> None:
    """Another local user's empty queue pushes, or keys of 8 bytes with empty values, cost the
    server ~90 bytes each beyond their own: the strangers' quota counts that, so they are
    refused before the entries they made take more memory than ``max_stranger_bytes`` (empty
    pushes, counted as 0 bytes, were never refused; tiny keys took 11 times the limit)."""
    import subprocess
    import sys

    limit = 64 << 10
    m = TCPStore(HOST, 0, is_master=True, timeout=T, token="",
                 limits=TCPStoreLimits(max_stranger_bytes=limit))
    try:
        done = subprocess.run([sys.executable, "-c", _STRANGER_WRITES_SMALL, str(m.port), op],
                              capture_output=True, text=True, timeout=50)
        assert done.returncode == 0, done.stderr[-2000:]
        written, _, why = done.stdout.strip().partition(" ")
        assert "TCPStoreLimits.max_stranger_bytes" in why, done.stdout
        each = 90 if op == "multi_set" else 8  # measured: a key in a dict; a deque slot
        assert limit // 256 < int(written) and int(written) * each <= limit, done.stdout
    finally:
        m.close()


@pytest.mark.timeout(60)
def test_pipelined_requests_are_not_copied_again_at_every_turn(master: TCPStore) -> None:
    """A client that sends 100,000 small requests at once is served a turn of requests at a
    time; what waits for the next turns stays where it is: a turn copies at most the
    ``TURN_REQUESTS`` frames it may serve, not the rest of the input again (quadratic: thousands
    of times the input, and a copy of it per connection at every turn)."""
    from plugdist.store._server.turns import TURN_REQUESTS

    server = master._server
    assert server is not None
    commands = server._commands
    handle = commands.handle
    last: list[bytes] = [b""]  # the buffer requests were last run from (held: a new one is new)
    copied = 0

    def counting(conn: Any, op: int, buf: bytes, pos: int, end: int) -> Any:
        nonlocal copied
        if buf is not last[0]:
            copied += len(buf)
            last[0] = buf
        return handle(conn, op, buf, pos, end)

    commands.handle = counting  # type: ignore[method-assign]
    n = 100_000
    frame = wire.request(wire.Op.NUM_KEYS, b"")
    s = raw_client(master.port)
    try:
        s.sendall(frame * n)
        got = 0
        while got < 13 * n:  # each reply: a header and an i64
            chunk = s.recv(1 << 20)
            assert chunk
            got += len(chunk)
    finally:
        s.close()
        commands.handle = handle  # type: ignore[method-assign]
    sent = len(frame) * n  # each turn serves one frame at least, and reads 256 KiB at most
    assert copied <= (TURN_REQUESTS + 1) * sent, f"{copied} bytes run from for {sent} sent"


@pytest.mark.timeout(60)
def test_a_log_read_is_answered_in_bounded_replies_and_read_log_reads_on(
        master: TCPStore) -> None:
    """One LOG_READ of a log of millions of tiny entries held the server's only thread for
    seconds: a reply carries at most 1,024 entries (``LOG_READ_ENTRIES``), and ``read_log``
    reads on after a full reply, so its callers still get every entry to the first gap."""
    c = client(master)
    n = 2 * 1024 + 100
    c.multi_set([f"L/{i}" for i in range(1, n + 1)], [b""] * n)
    s = raw_client(master.port)
    try:
        s.sendall(wire.request(wire.Op.LOG_READ, wire.F64.pack(5.0) + wire.I64.pack(1)
                               + wire.pack_blobs([b"L"])[4:]))
        head = b""
        while len(head) < 5:
            head += s.recv(5 - len(head))
        length, status = wire.HEADER.unpack(head)
        body = b""
        while len(body) < length:
            body += s.recv(length - len(body))
    finally:
        s.close()
    assert status == wire.Status.OK
    assert wire.U32.unpack_from(body)[0] == 1024
    assert c.read_log("L", 1, T) == [b""] * n
    assert c.read_log("L", n - 1023, T) == [b""] * 1024  # a full last reply: nothing behind it
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


@pytest.mark.timeout(90)
def test_a_busy_guest_outlives_the_idle_timeout_and_an_idle_one_does_not() -> None:
    """The idle deadline runs from a guest's last request, not from when it connected: a guest
    that sends a request every 0.4 s stays past several ``guest_idle_timeout`` of 1.5 s, one
    connected with it that sends nothing more is dropped."""
    from plugdist.store import TCPStoreLimits
    limits = TCPStoreLimits(guest_idle_timeout=timedelta(seconds=1.5))
    m = TCPStore(HOST, 0, is_master=True, timeout=T, token="", limits=limits)
    busy, idle = bound_to("127.0.0.2", m.port), bound_to("127.0.0.2", m.port)
    num_keys = wire.request(wire.Op.NUM_KEYS, b"")
    began = time.monotonic()
    while time.monotonic() - began < 5.0:
        busy.sendall(num_keys)
        assert len(busy.recv(64)) > 0, "a busy guest was dropped"
        time.sleep(0.4)
    assert eventually(lambda: hung_up(idle), 30)
    busy.sendall(num_keys)
    assert len(busy.recv(64)) > 0
    busy.close()
    idle.close()
    m.close()


# ---- the sequence fuzzer ---------------------------------------------------------------------

SEQUENCE_EXAMPLES = int(os.environ.get("PLUGDIST_STORE_SEQUENCE_EXAMPLES", "15"))
_CONNS = 3
# the pools are weighted towards what reaches a world's state (a root's world keys, ranks in
# range, values that do not parse): the attacks found so far took three steps of them
_ROOTS = [b"r/", b"r/", b"r", b"r", b"", b"r/a"]  # without '/': refused; "": the store's top
_UIDS = [b"0", b"1", b"0", b"1", b"2", b"01", b"x", b"j1", b"\xd9\xa1"]
_SIZES = [1, 2, 2, 3, 0]
_VALUES = [b"nope", b"", b"1e3", b"[", b"0", b"1", b" 1", b"[\"0\"]", b"[\"0\", \"9\"]", b"{}",
           b"{\"members\": [\"0\"]}", b"{\"excluded\": [\"7\"]}", b"9" * 5000, b"\xff"]
_KEYS = [b"plugdist/epoch/current", b"plugdist/epoch/current", b"plugdist/live/deaths",
         b"plugdist/epoch/1/members",
         b"plugdist/epoch/0/next", b"plugdist/epoch/0/seen/0", b"plugdist/live/trim",
         b"plugdist/live/hb/0", b"plugdist/join/done", b"plugdist/join/count",
         b"plugdist/join/1/admitted", b"plugdist/live/deaths", b"plugdist/closed",
         b"plugdist/epoch/", b"plain", b"plugdist/epoch/1/grow/0"]
_CAUSES = ["left", "decided", "excluded", "reported", "hung", "died", "joining", "x"]


def _blob(b: bytes) -> bytes:
    return wire.U32.pack(len(b)) + b


def _actions():  # type: ignore[no-untyped-def]
    """One step: (connection, what it sends, and how the server is expected to answer)."""
    from hypothesis import strategies as st

    roots, uids, values, keys = (st.sampled_from(x) for x in (_ROOTS, _UIDS, _VALUES, _KEYS))
    ttls = st.sampled_from([0.0, 0.05, 30.0])
    who = st.integers(0, 31)  # a credential: one the fuzz was granted, or a forged one
    return st.one_of(
        st.tuples(st.just("claim"), roots, uids, st.sampled_from(_SIZES), ttls),
        st.tuples(st.just("join"), roots, ttls),
        st.tuples(st.just("member"), who, st.sampled_from(["set", "add", "cas", "delete",
                                                           "delete_prefix"]), keys, values),
        st.tuples(st.just("record"), who, st.sampled_from(_CAUSES), uids,
                  st.sampled_from(["json", "malformed", "list"])),
        st.tuples(st.just("vouch"), who),
        st.tuples(st.just("plain"), st.sampled_from(["set", "set", "add", "append", "cas",
                                                     "delete", "will", "get0"]),
                  roots, keys, values),
        st.tuples(st.just("park"), roots, keys),
        st.tuples(st.just("renew"), st.booleans()),
        st.tuples(st.just("close"), st.sampled_from(["now", "mid_frame"])),
    )


class _Fuzzer:
    """Raw connections driven through one sequence against one server; what the server
    granted is remembered, so the checks after the round know what to expect."""

    def __init__(self, port: int, server: Any) -> None:
        self.port, self.server = port, server
        self.socks: list[socket.socket | None] = [None] * _CONNS
        self.parked = [False] * _CONNS
        self.held: dict[int, tuple[bytes, bytes, bytes]] = {}  # conn -> its identity
        self.granted: list[tuple[bytes, bytes, bytes]] = []  # (root, uid, credential)
        self.granted_in: dict[bytes, set[str]] = {}  # root -> uids granted since (re)made
        self.withdrawn: dict[bytes, set[str]] = {}  # root -> uids whose will was withdrawn

    def sock(self, i: int) -> socket.socket:
        s = self.socks[i]
        if s is None:
            s = self.socks[i] = raw_client(self.port)
            s.settimeout(10)
        return s

    def close(self, i: int, mid_frame: bool = False) -> None:
        s = self.socks[i]
        if s is None:
            return
        if mid_frame:
            try:
                s.sendall(wire.HEADER.pack(64, wire.Op.SET) + b"\0\0\0\x08half")
            except OSError:
                pass
        s.close()
        self.socks[i], self.parked[i] = None, False
        self.held.pop(i, None)

    def ask(self, i: int, op: wire.Op, body: bytes) -> tuple[int, bytes] | None:
        """Send one request, read its reply (None: the server closed the connection)."""
        s = self.sock(i)
        try:
            s.sendall(wire.request(op, body))
            head = b""
            while len(head) < 5:
                chunk = s.recv(5 - len(head))
                if not chunk:
                    raise ConnectionError
                head += chunk
            n, status = wire.HEADER.unpack(head)
            data = b""
            while len(data) < n:
                chunk = s.recv(n - len(data))
                if not chunk:
                    raise ConnectionError
                data += chunk
        except (OSError, ConnectionError):
            self.close(i)
            return None
        return status, data

    def credential(self, who: int) -> tuple[bytes, bytes, bytes]:
        if who < len(self.granted) and who % 4:
            return self.granted[who]
        return (_ROOTS[who % len(_ROOTS)], _UIDS[who % len(_UIDS)], os.urandom(16))

    def step(self, i: int, action: tuple[Any, ...]) -> None:
        kind = action[0]
        if self.parked[i] and kind not in ("renew", "close"):
            kind, action = "close", ("close", "now")
        if kind == "claim":
            _, root, uid, size, ttl = action
            worlds = self.server._worlds._worlds
            before = worlds.get(root)
            got = self.ask(i, wire.Op.CLAIM, _blob(root) + _blob(uid) + wire.I64.pack(size)
                           + wire.F64.pack(ttl))
            if got and got[0] == wire.Status.OK:
                assert root.endswith(b"/") or root == b"", root
                if before is not None and worlds.get(root) is not before:
                    self.granted_in.pop(root, None)  # the claim made a closed world afresh
                    self.withdrawn.pop(root, None)
                self.identity(i, root, uid, got[1][4:])
        elif kind == "join":
            _, root, ttl = action
            got = self.ask(i, wire.Op.JOIN, _blob(root) + wire.F64.pack(ttl))
            if got and got[0] == wire.Status.OK:
                assert root.endswith(b"/") or root == b"", root
                ticket, _ = struct_qq.unpack_from(got[1])
                self.identity(i, root, f"j{ticket}".encode(), got[1][20:])
        elif kind == "member":
            _, who, op, key, value = action
            root, uid, secret = self.credential(who)
            head = _blob(root) + _blob(uid) + _blob(secret)
            if key.startswith(b"plugdist/live/deaths"):
                key = b"plugdist/live/deaths/x"  # a death record: not a member's to delete
            body = {"set": lambda: bytes([wire.Op.SET]) + _blob(key) + _blob(value),
                    "add": lambda: bytes([wire.Op.ADD]) + wire.I64.pack(1) + _blob(key),
                    "cas": lambda: bytes([wire.Op.COMPARE_SET]) + _blob(key) + _blob(b"")
                    + _blob(value),
                    "delete": lambda: bytes([wire.Op.DELETE_KEY]) + _blob(key),
                    "delete_prefix": lambda: bytes([wire.Op.DELETE_PREFIX]) + _blob(key)}[op]()
            self.ask(i, wire.Op.MEMBER, head + body)
        elif kind == "record":
            _, who, cause, target, form = action
            root, uid, secret = self.credential(who)
            record = {"json": json.dumps({"uid": target.decode(errors="replace"),
                                          "cause": cause}).encode(),
                      "malformed": b"{\"uid\": ", "list": b"[1, 2]"}[form]
            self.ask(i, wire.Op.RECORD, _blob(root) + _blob(uid) + _blob(secret)
                     + _blob(record))
        elif kind == "vouch":
            root, uid, secret = self.credential(action[1])
            self.ask(i, wire.Op.VOUCH, _blob(root) + _blob(uid) + _blob(secret))
        elif kind == "plain":
            _, op, root, key, value = action
            key = root + key
            if op == "set":
                self.ask(i, wire.Op.SET, _blob(key) + _blob(value))
            elif op == "add":
                self.ask(i, wire.Op.ADD, wire.I64.pack(1) + _blob(key))
            elif op == "append":
                self.ask(i, wire.Op.APPEND, _blob(key) + _blob(value))
            elif op == "cas":
                self.ask(i, wire.Op.COMPARE_SET, _blob(key) + _blob(value) + _blob(b"1"))
            elif op == "delete":
                self.ask(i, wire.Op.DELETE_KEY, _blob(key))
            elif op == "will":
                got = self.ask(i, wire.Op.WILL, _blob(key) + _blob(value) + wire.F64.pack(0.05))
                if got and got[0] == wire.Status.OK:
                    assert not is_reserved(key), key
            else:
                self.ask(i, wire.Op.GET, wire.F64.pack(0.0) + _blob(key))
        elif kind == "park":
            _, root, key = action
            try:
                self.sock(i).sendall(wire.request(wire.Op.GET, wire.F64.pack(30.0)
                                                  + _blob(root + key + b"/never")))
                self.parked[i] = True
            except OSError:
                self.close(i)
        elif kind == "renew":
            op = wire.Op.RENEW if action[1] else wire.Op.WILL_DROP
            try:
                self.sock(i).sendall(wire.request(op, b""))
            except OSError:
                self.close(i)
            if op == wire.Op.WILL_DROP and i in self.held:
                root, uid, _ = self.held[i]
                self.withdrawn.setdefault(root, set()).add(uid.decode())
        else:
            self.close(i, mid_frame=action[1] == "mid_frame")

    def identity(self, i: int, root: bytes, uid: bytes, blob: bytes) -> None:
        (n,) = wire.U32.unpack_from(blob)
        secret = blob[4:4 + n]
        self.held[i] = (root, uid, secret)
        self.granted.append((root, uid, secret))
        self.granted_in.setdefault(root, set()).add(uid.decode())


struct_qq = __import__("struct").Struct("!qq")


def is_reserved(key: bytes) -> bool:
    from plugdist.store._worldkeys import is_reserved as reserved
    return reserved(key)


def check_world(data: dict[bytes, bytes], root: bytes, granted: set[str],
                withdrawn: set[str]) -> None:
    """A world's view after every connection of the round closed: its death log is dense;
    each identity the server granted died once (unless its holder withdrew its will) and
    nothing else died; its numbers parse."""
    deaths = root + b"plugdist/live/deaths"
    n = int(data.get(deaths, b"0"))
    entries = [data.get(deaths + b"/" + str(k).encode()) for k in range(1, n + 1)]
    assert all(e is not None for e in entries), (root, n, entries)
    died = [json.loads(e)["uid"] for e in entries if e and json.loads(e).get("cause") == "died"]
    assert len(died) == len(set(died)), (root, died)
    assert set(died) <= granted, (root, died, granted)
    assert granted - set(died) <= withdrawn, (root, died, granted, withdrawn)
    for key in (b"plugdist/epoch/current", b"plugdist/join/count", b"plugdist/join/done"):
        value = data.get(root + key)
        assert value is None or int(value) >= 0, (root, key, value)


@pytest.mark.timeout(600)
def test_sequences_of_claims_joins_writes_and_closes_never_break_the_server() -> None:
    """Many connections driven through sequences (claims, joins, members' writes, records,
    vouches, plain writes on reserved and plain keys under roots with and without '/', parked
    requests, renewals, closes at every point, values that do not parse) against a real server:
    it serves on (its thread lives, no internal error logged), a bystander's keys and parked
    wait are intact, and every world's view is consistent (see ``check_world``).
    PLUGDIST_STORE_SEQUENCE_EXAMPLES sets how many sequences run (the default keeps CI to a
    few seconds)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    get_logger()
    rounds: list[int] = []

    @settings(max_examples=SEQUENCE_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(st.integers(0, _CONNS - 1), _actions()), min_size=20,
                    max_size=60))
    def one_round(steps: list[tuple[int, tuple[Any, ...]]]) -> None:
        rounds.append(len(steps))
        m = TCPStore(HOST, 0, is_master=True, timeout=T, token="")
        server = m._server
        assert server is not None
        bystander = client(m)
        bystander.multi_set(["bystander/a", "bystander/b"], ["1", "2"])
        watcher = raw_client(m.port)
        watcher.sendall(wire.request(wire.Op.GET, wire.F64.pack(60.0)
                                     + _blob(b"bystander/release")))
        assert eventually(lambda: server._waiters.parked == 1)
        fuzz = _Fuzzer(m.port, server)
        try:
            with capture_logs() as logs:
                for i, action in steps:
                    fuzz.step(i, action)
                for i in range(_CONNS):
                    fuzz.close(i)
                # the fuzz's connections are gone and their identities' wills have run
                assert eventually(lambda: len(server._conns) == 3
                                  and server._waiters.parked == 1
                                  and not server._keys.dying), server._conns
                m.set("bystander/release", "go")
                watcher.settimeout(10)
                assert watcher.recv(64)[5:] == b"go"
            bugs = [e for e in logs if e["event"] in ("tcp_store_internal_error",
                                                      "tcp_store_server_crashed")]
            assert bugs == [], bugs
            assert server.alive
            assert bystander.multi_get(["bystander/a", "bystander/b"]) == [b"1", b"2"]
            data = dict(server._keys.data)
            for root in {r for r in _ROOTS if r.endswith(b"/") or r == b""}:
                check_world(data, root, fuzz.granted_in.get(root, set()),
                            fuzz.withdrawn.get(root, set()))
        finally:
            watcher.close()
            bystander.close()
            m.close()

    one_round()
    print(f"sequences: {len(rounds)}, steps: {sum(rounds)}")
    assert len(rounds) >= SEQUENCE_EXAMPLES
