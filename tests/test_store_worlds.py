"""A TCPStore's worlds, client against server in one process: reserved keys refuse plain
writes; an identity is held once and its death is written by the server (its writes after that
raise DistExcludedError); members' writes are
checked; per-request limits answer with an error. (A stranger process against real worlds:
tests/test_security.py.)"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from plugdist.errors import DistExcludedError, DistStoreError, DistTimeoutError
from plugdist.store import PrefixStore, TCPStore, TCPStoreLimits
from plugdist.store._server.peers import ALLOW_TOKENLESS_JOIN_ENV
from plugdist.store._tcp_client import TCPStoreSession
from plugdist.store._worldkeys import is_reserved

HOST = "127.0.0.1"
DEATHS = "plugdist/live/deaths"
T = timedelta(seconds=20)


@pytest.fixture
def master() -> Iterator[TCPStore]:
    m = TCPStore(HOST, 0, is_master=True, timeout=T, token="",
                 limits=TCPStoreLimits(max_keys_per_request=100, max_value_bytes=1000))
    yield m
    m.close()


def client(m: TCPStore) -> TCPStore:
    return TCPStore(HOST, m.port, timeout=T, token="")


def test_reserved_names() -> None:
    for key in (b"plugdist/live/deaths", b"plugdist/live/deaths/3", b"plugdist/epoch/current",
                b"x/plugdist/join/count", b"plugdist/worker/round_0/plugdist/closed",
                b"plugdist/live"):
        assert is_reserved(key), key
    for key in (b"plugdist/group/0/rank_1", b"plugdist/lively", b"myplugdist/live/x",
                b"plugdist/closed/x", b"plugdist/rdzv/none/r0/joined", b"plugdist/fte/1",
                b"plugdist/leaving"):
        assert not is_reserved(key), key


@pytest.mark.timeout(60)
def test_plain_writes_to_reserved_keys_are_refused(master: TCPStore) -> None:
    """Every plain write is refused, under a prefix too; add(k, 0) reads; delete_prefix("")
    leaves the reserved keys; reads are open."""
    c = client(master)
    s = c.claim_member("", "0", 1, 10.0)
    under = PrefixStore("plugdist/worker/round_0", c)
    for store in (c, under):
        for write in (lambda st: st.set(DEATHS, "x"), lambda st: st.add(DEATHS, 1),
                      lambda st: st.compare_set("plugdist/epoch/current", "0", "5"),
                      lambda st: st.append("plugdist/closed", "x"),
                      lambda st: st.multi_set(["ok", "plugdist/join/count"], ["1", "2"]),
                      lambda st: st.delete_key("plugdist/epoch/current"),
                      lambda st: st.queue_push("plugdist/epoch/1/members", "x"),
                      lambda st: st.queue_pop("plugdist/epoch/1/members", block=False),
                      lambda st: st.hold_will(DEATHS, "x"),
                      lambda st: st.delete_prefix("plugdist/epoch/")):
            with pytest.raises(DistStoreError, match="belongs to a world's membership"):
                write(store)
    assert not c.check(["ok"])  # the multi_set was all or nothing
    assert c.add(DEATHS, 0) == 0 and not c.check([DEATHS])  # a read, creating nothing
    c.set("plain", "1")
    assert c.delete_prefix("") == 1  # only the plain key
    assert c.get("plugdist/epoch/current") == b"0"  # the world's keys stay, readable
    s.will.cancel()
    c.close()


@pytest.mark.timeout(60)
def test_an_identity_is_held_once_and_its_death_written_by_the_server(master: TCPStore) -> None:
    a, b = client(master), client(master)
    one = a.claim_member("", "1", 3, 10.0)
    with pytest.raises(DistStoreError, match=r"held by another live process, taken by a "
                                             r"connection from 127\.0\.0\.1:\d+ at "
                                             r"\d\d:\d\d:\d\d UTC, \d+s ago \(live\).*same RANK"):
        b.claim_member("", "1", 3, 10.0)
    with pytest.raises(DistStoreError, match=r"has 3 ranks: rank 1 taken by a connection from "
                                             r"127\.0\.0\.1:\d+ .*this process says its world "
                                             r"has 4"):
        b.claim_member("", "2", 4, 10.0)
    with pytest.raises(DistStoreError, match="out of range"):
        b.claim_member("", "3", 3, 10.0)
    two = b.claim_member("", "2", 3, 10.0)
    one.will._conn.close()  # rank 1's process dies: its connection drops
    assert master.read_log(DEATHS, 1, timedelta(seconds=10)) == [
        json.dumps({"uid": "1", "cause": "died"}).encode()]
    # a process cut off long enough for its will to run learns, at its next write, that it is
    # out of the world (the others went on without it)
    for write in (lambda: one.set("plugdist/epoch/0/next", json.dumps({"excluded": ["2"]})),
                  lambda: one.record(json.dumps({"uid": "2", "cause": "reported"}))):
        with pytest.raises(DistExcludedError, match="member '1' is no longer in this store's "
                                                    "world.*join=True"):
            write()
    two.will.cancel()  # a clean exit writes nothing
    with pytest.raises(DistTimeoutError):
        master.read_log(DEATHS, 2, timedelta(seconds=0.5))
    for uid in ("1", "2"):  # both left: no process can be them again
        with pytest.raises(DistStoreError, match=r"already left it \(taken by a connection from "
                                                 r"127\.0\.0\.1:\d+ .*it has left since"):
            a.claim_member("", uid, 3, 10.0)
    a.close()
    b.close()


@pytest.mark.timeout(60)
def test_members_writes_are_checked(master: TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forged credential, a joiner not yet admitted, a key members do not write, a members
    list naming an unknown identity, an epoch with no members record: refused. Declaring a
    member failed counts once; a joiner may say it leaves, not that another died."""
    monkeypatch.setenv(ALLOW_TOKENLESS_JOIN_ENV, "1")
    c = client(master)
    zero, one = c.claim_member("", "0", 2, 10.0), c.claim_member("", "1", 2, 10.0)
    forged = TCPStoreSession(c._request, zero.will, b"", "0", os.urandom(16))
    with pytest.raises(DistStoreError, match="holds no identity"):
        forged.set("plugdist/epoch/0/next", json.dumps({"excluded": ["1"]}))
    joiner = c.join_member("", 10.0)
    assert (joiner.uid, joiner.ticket) == ("j1", 1)
    assert json.loads(c.get(f"{DEATHS}/1")) == {"uid": "j1", "cause": "joining", "ticket": 1}
    with pytest.raises(DistStoreError, match="not a member yet"):
        joiner.set("plugdist/epoch/1/members", json.dumps(["j1"]))
    with pytest.raises(DistStoreError, match="not a key a member writes"):
        zero.set("plugdist/live/deaths/7", "{}")
    with pytest.raises(DistStoreError, match="'7' is not a member of this world"):
        zero.compare_set("plugdist/epoch/1/members", "", json.dumps(["0", "7"]))
    with pytest.raises(DistStoreError, match="malformed"):
        zero.set("plugdist/epoch/0/next", "{not json")
    with pytest.raises(DistStoreError, match="no members record"):
        zero.compare_set("plugdist/epoch/current", "0", "1")
    grown = json.dumps(["0", "1", "j1"])
    assert zero.compare_set("plugdist/epoch/1/members", "", grown) == grown.encode()
    assert zero.compare_set("plugdist/epoch/current", "0", "1") == b"1"
    joiner.set("plugdist/epoch/1/seen/j1", "1")  # admitted now: a member's write
    declared = json.dumps({"uid": "1", "cause": "reported", "how": "test"})
    assert zero.record(declared) is True
    assert joiner.record(declared) is False  # declared once
    with pytest.raises(DistStoreError, match="not one member j1 may append"):
        joiner.record(json.dumps({"uid": "0", "cause": "died"}))
    assert joiner.record(json.dumps({"uid": "j1", "cause": "left", "how": "test"})) is True
    for session in (zero, one, joiner):
        session.will.cancel()
    deadline = time.monotonic() + 10
    while not c.check(["plugdist/closed"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert c.get("plugdist/closed") == b"1"  # every member of epoch 1 left
    # a world built again on the same store (init_process_group after destroy) starts afresh
    again = c.claim_member("", "0", 2, 10.0)
    assert not c.check(["plugdist/closed", f"{DEATHS}/1", "plugdist/epoch/1/members"])
    assert c.get("plugdist/epoch/current") == b"0"
    again.will.cancel()
    c.close()


@pytest.mark.timeout(60)
def test_members_values_are_checked_and_the_death_log_is_the_servers(
        master: TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A member's credential does not let it write anything under its world's keys: a decision
    names only the epoch's members, a grow only joiners with a ticket not yet admitted, a seen
    mark only the writer's own (at most the log's length), a trim only up to what every member
    had read; no member deletes a death record, and the server deletes what a trim forgets.
    The leave count and the vote outcomes are members' writes, each checked too."""
    monkeypatch.setenv(ALLOW_TOKENLESS_JOIN_ENV, "1")  # the joiners below, on a tokenless store
    c = client(master)
    zero, one = c.claim_member("", "0", 2, 10.0), c.claim_member("", "1", 2, 10.0)
    refused = {
        "decision naming a stranger": lambda: zero.compare_set(
            "plugdist/epoch/0/next", "", json.dumps({"excluded": ["1", "5"]})),
        "decision excluding its writer": lambda: one.compare_set(
            "plugdist/epoch/0/next", "", json.dumps({"excluded": ["1"]})),
        "grow of an unknown joiner": lambda: zero.compare_set(
            "plugdist/epoch/0/grow/0", "", json.dumps({"joiners": [[4, "j4"]], "done": 4})),
        "members without their writer": lambda: zero.compare_set(
            "plugdist/epoch/1/members", "", json.dumps(["1"])),
        "another's seen mark": lambda: zero.set("plugdist/epoch/0/seen/1", "0"),
        "a seen mark past the log": lambda: zero.set("plugdist/epoch/0/seen/0", "1000000"),
        "a trim past what was read": lambda: zero.compare_set(
            "plugdist/live/trim", json.dumps({"epoch": -1, "log": 0, "tickets": 0, "done": 0}),
            json.dumps({"epoch": 1, "log": 1000000, "tickets": 0, "done": 0})),
        "a death record deleted": lambda: zero.delete_key(f"{DEATHS}/1"),
        "a death record overwritten": lambda: zero.set(f"{DEATHS}/1", "{}"),
        "the current epoch forgotten": lambda: zero.delete_prefix("plugdist/epoch/0/"),
        "an outcome by set": lambda: zero.set("plugdist/ft/0/step/0/0", "commit [0, 1]"),
        "an outcome that is neither": lambda: zero.compare_set(
            "plugdist/ft/0/step/0/0", "", "commit [0, -1]"),
        "a leave count by 5": lambda: zero.add("plugdist/epoch/0/leaving", 5),
        "left before every member leaves": lambda: zero.set("plugdist/epoch/0/left", "1"),
        "a decision nested past the parser's depth": lambda: zero.compare_set(
            "plugdist/epoch/0/next", "", "[" * 900),
        "an arrival as another": lambda: zero.append_log(
            "plugdist/epoch/0/shrink/0/arrived", "1"),
        "a death appended as a log": lambda: zero.append_log(DEATHS, '{"uid": "1"}'),
        "a log appended to a leave count": lambda: zero.append_log(
            "plugdist/epoch/0/leaving", "0"),
    }
    for what, write in refused.items():
        with pytest.raises(DistStoreError, match="member write refused"):
            write()
            pytest.fail(what)
    with pytest.raises(DistStoreError, match="malformed record"):
        zero.record("[" * 60_000)  # the serving thread lives on
    # a shrink's arrival, in one request: counted and written, each as its own write would be
    arrivals = "plugdist/epoch/0/shrink/0/arrived"
    assert (one.append_log(arrivals, "1"), zero.append_log(arrivals, "0")) == (1, 2)
    assert c.read_log(arrivals, 1, timedelta(seconds=5)) == [b"1", b"0"]
    assert c.add(arrivals, 0) == 2
    # an outcome is written once; the leave count stops at the epoch's size
    assert zero.compare_set("plugdist/ft/0/step/0/0", "", "commit [0.0, 1.0]") \
        == b"commit [0.0, 1.0]"
    assert one.compare_set("plugdist/ft/0/step/0/0", "", "abort") == b"commit [0.0, 1.0]"
    with pytest.raises(DistStoreError, match="decided once"):
        one.compare_set("plugdist/ft/0/step/0/0", "commit [0.0, 1.0]", "abort")
    assert one.delete_prefix("plugdist/ft/0/step/0/") == 1
    assert (zero.add("plugdist/epoch/0/leaving", 1), one.add("plugdist/epoch/0/leaving", 1)) \
        == (1, 2)
    with pytest.raises(DistStoreError, match="leaving already"):
        zero.add("plugdist/epoch/0/leaving", 1)
    one.set("plugdist/epoch/0/left", "1")

    # a joiner comes and goes; the members grow by another, shrink past it, and trim
    gone = c.join_member("", 10.0)
    gone.will.cancel()
    joiner = c.join_member("", 10.0)  # j2: the log holds j1 joining, j2 joining
    assert c.add(DEATHS, 0) == 2
    zero.set("plugdist/epoch/0/seen/0", "2")
    one.set("plugdist/epoch/0/seen/1", "2")
    grow = json.dumps({"joiners": [[2, "j2"]], "done": 2})
    assert zero.compare_set("plugdist/epoch/0/grow/0", "", grow) == grow.encode()
    with pytest.raises(DistStoreError, match="'5' is not a member of this world"):
        zero.compare_set("plugdist/epoch/1/members", "", json.dumps(["0", "1", "j2", "5"]))
    members = json.dumps(["0", "1", "j2"])
    assert zero.compare_set("plugdist/epoch/1/members", "", members) == members.encode()
    zero.compare_set("plugdist/join/done", "0", "2")
    zero.compare_set("plugdist/epoch/current", "0", "1")
    with pytest.raises(DistStoreError, match="admitted already"):
        zero.compare_set("plugdist/epoch/1/grow/0", "", json.dumps(
            {"joiners": [[2, "j2"]], "done": 2}))
    no_trim = json.dumps({"epoch": -1, "log": 0, "tickets": 0, "done": 0})
    with pytest.raises(DistStoreError, match="had not entered epoch 0"):  # j2 has no mark
        zero.compare_set("plugdist/live/trim", no_trim, json.dumps(
            {"epoch": 1, "log": 2, "tickets": 0, "done": 2}))
    waiting = c.join_member("", 10.0)  # j3, started reading the log at 2
    for uid, session in (("0", zero), ("1", one), ("j2", joiner)):
        session.set(f"plugdist/epoch/1/seen/{uid}", "3")
    assert zero.compare_set("plugdist/epoch/2/members", "", json.dumps(["0", "1", "j2"]))
    zero.compare_set("plugdist/epoch/current", "1", "2")
    with pytest.raises(DistStoreError, match="still needs the entries after 2"):
        zero.compare_set("plugdist/live/trim", no_trim, json.dumps(
            {"epoch": 2, "log": 3, "tickets": 0, "done": 2}))
    trimmed = json.dumps({"epoch": 2, "log": 2, "tickets": 0, "done": 2})
    assert zero.compare_set("plugdist/live/trim", no_trim, trimmed) == trimmed.encode()
    assert not any(c.check([f"{DEATHS}/{n}"]) for n in (1, 2))  # deleted by the server
    assert c.check([f"{DEATHS}/3"]) and c.add(DEATHS, 0) == 3
    again = json.dumps({"epoch": 2, "log": 2, "tickets": 2, "done": 2})
    with pytest.raises(DistStoreError, match="epoch 2: the last was at 2"):
        zero.compare_set("plugdist/live/trim", trimmed, again)
    for session in (zero, one, joiner, waiting):
        session.will.cancel()
    c.close()


@pytest.mark.timeout(60)
def test_joiners_that_came_and_went_do_not_stop_the_trims(
        master: TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Join-and-close, repeated past the store's per-request key limit (100 here, 131,072 by
    default) with no grow in between: the trim skips the tickets of joiners known gone, so the
    death log is still trimmed (it once had to check every such ticket in one request, was
    refused, and nothing was trimmed again)."""
    monkeypatch.setenv(ALLOW_TOKENLESS_JOIN_ENV, "1")  # the joiners below, on a tokenless store
    from plugdist._resilience.cleanup import trim

    c = client(master)
    zero, one = c.claim_member("", "0", 2, 10.0), c.claim_member("", "1", 2, 10.0)
    for _ in range(150):
        joiner = c.join_member("", 10.0)
        joiner.record(json.dumps({"uid": joiner.uid, "cause": "left", "how": "gave up"}))
        joiner.will.cancel()
    logged = c.add(DEATHS, 0)
    assert logged == 300
    zero.set("plugdist/epoch/0/seen/0", str(logged))
    one.set("plugdist/epoch/0/seen/1", str(logged))
    zero.compare_set("plugdist/epoch/1/members", "", json.dumps(["0", "1"]))
    zero.compare_set("plugdist/epoch/current", "0", "1")
    trim(c, zero, 1, ["0", "1"], 0, heartbeats=False)  # as before: all 150 tickets read at once
    assert json.loads(c.get("plugdist/live/trim"))["log"] == 0  # refused: nothing trimmed
    gone = {f"j{n}" for n in range(1, 151)}
    trim(c, zero, 1, ["0", "1"], 0, heartbeats=False, gone=gone)
    assert json.loads(c.get("plugdist/live/trim"))["log"] == logged
    assert not any(c.check([f"{DEATHS}/{n}"]) for n in range(1, logged + 1))
    for session in (zero, one):
        session.will.cancel()
    c.close()


@pytest.mark.timeout(60)
def test_request_limits_answer_with_an_error_and_keep_the_connection(master: TCPStore) -> None:
    c = client(master)
    with pytest.raises(DistStoreError, match="at most 100 keys per request"):
        c.check([f"k{i}" for i in range(101)])
    with pytest.raises(DistStoreError, match="at most 100 keys per request"):
        c.multi_get([f"k{i}" for i in range(101)])
    with pytest.raises(DistStoreError, match="exceeds this server's limit of 1000"):
        c.set("big", b"x" * 1001)
    # refused as soon as its first bytes tell, the rest dropped as it comes (never held)
    with pytest.raises(DistStoreError, match="exceeds this server's limit of 1000"):
        c.set("huge", b"x" * (4 << 20))
    with pytest.raises(DistStoreError, match="at most 100 keys per request"):
        c.check([f"key{i:06d}" for i in range(100_000)])
    c.set("fits", b"x" * 1000)
    assert c.multi_get(["fits"] * 100) == [b"x" * 1000] * 100
    assert len(master._server._conns) == 2  # type: ignore[union-attr]  # nobody was dropped
    c.close()


@pytest.mark.timeout(60)
def test_a_large_value_from_another_process_arrives_at_full_pace() -> None:
    """A 30 MiB value sent by another process: the server charges heavy work to the connection
    (it rests between), yet the frame arrives well within the pace rule, whole, more than once."""
    import subprocess
    import sys

    m = TCPStore(HOST, 0, is_master=True, timeout=T, token="")
    code = ("import sys, time; from datetime import timedelta; "
            "from plugdist.store import TCPStore; "
            f"c = TCPStore('{HOST}', {m.port}, timeout=timedelta(seconds=20), token=''); "
            "t = time.monotonic(); "
            "[c.set(f'big{i}', bytes([i]) * (30 << 20)) for i in range(3)]; "
            "print(time.monotonic() - t)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout) < 15, done.stdout  # three frames at 4 MiB/s would take 22 s
    for i in range(3):
        value = m.get(f"big{i}")
        assert len(value) == 30 << 20 and value[:1] == value[-1:] == bytes([i])
    m.close()


@pytest.mark.timeout(60)
def test_joining_takes_a_credential(master: TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a token a join is refused unless the store's host allows it, by name; with a
    token the handshake is the credential. An identity's ttl has a floor: a raw JOIN with ttl 0
    that never renews lapses (its death is written) instead of holding on forever."""
    from plugdist.store import _wire as w

    c = client(master)
    monkeypatch.delenv(ALLOW_TOKENLESS_JOIN_ENV, raising=False)
    with pytest.raises(DistStoreError, match=f"join refused: this store has no token.*"
                                             f"{ALLOW_TOKENLESS_JOIN_ENV}=1"):
        c.join_member("", 10.0)
    assert not c.check(["plugdist/join/count/1", f"{DEATHS}/1"])  # nothing written
    monkeypatch.setenv(ALLOW_TOKENLESS_JOIN_ENV, "1")
    conn = c._connect(join=False, timeout=10.0)  # a raw JOIN, ttl 0, and no renewal
    try:
        status, _ = conn.roundtrip(w.request(w.Op.JOIN, w.U32.pack(0) + w.F64.pack(0.0)), 10.0)
        assert status == w.Status.OK
        start = time.monotonic()
        died = master.read_log(DEATHS, 2, timedelta(seconds=10))  # parked until it is written
        assert json.loads(died[0]) == {"uid": "j1", "cause": "died"}
        assert time.monotonic() - start < 5  # the floor (1 s), not never
    finally:
        conn.close()
    c.close()
    m = TCPStore(HOST, 0, is_master=True, timeout=T, token="job-secret")
    monkeypatch.delenv(ALLOW_TOKENLESS_JOIN_ENV)
    try:
        joiner = TCPStore(HOST, m.port, timeout=T, token="job-secret").join_member("", 10.0)
        assert joiner.uid == "j1"
        joiner.will.cancel()
    finally:
        m.close()


_OTHER_USERS_LISTENER = """
import os, socket, sys, time
os.setgid(65534)
os.setuid(65534)  # another local user's program, holding a port on loopback
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs a second Unix user (runs as root)")
def test_a_tokenless_client_trusts_only_its_own_users_server() -> None:
    """A client without a token that reaches another user's listener (a rank that started
    before its master, on a port that user holds) refuses it instead of talking to it; and
    ``localhost`` is one address, the one the master binds (not the other family too)."""
    import socket
    import subprocess
    import sys

    from plugdist.store.tcp_store import _resolve

    other = subprocess.Popen([sys.executable, "-c", _OTHER_USERS_LISTENER],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None
        port = int(other.stdout.readline())
        with pytest.raises(DistStoreError, match=r"runs as another Unix user \(uid 65534\), "
                                                 r"not this job's store.*MASTER_PORT"):
            TCPStore(HOST, port, timeout=timedelta(seconds=5), token="")
    finally:
        other.kill()
        other.wait()
    assert _resolve("localhost", 29500) == [(socket.AF_INET, ("127.0.0.1", 29500))]


_STRANGER_FILLS = """
import json, os, struct, sys
from datetime import timedelta
from plugdist.errors import DistStoreError
from plugdist.store import TCPStore, _wire as wire
os.setgid(65534); os.setuid(65534)
held = []
store = TCPStore("127.0.0.1", int(sys.argv[1]), timeout=timedelta(seconds=20), token="")
big = b"x" * (512 << 10)
written = 0
try:
    for i in range(128):  # 64 MiB, twice the limit
        store.set(f"junk/{i}", big)
        written += 1
    print("all", written)
except DistStoreError as e:
    print(written, e)
refused = {}
for what, call in (("keys", lambda: store.check([f"k{i}" for i in range(2000)])),
                   ("request", lambda: store.set("big", b"x" * (2 << 20)))):
    try:
        call()
    except DistStoreError as e:
        refused[what] = str(e)
# 48 WAITs of 1,000 keys of 900 bytes (0.9 MiB each), sent back to back, each parked for
# 30 s: every one is answered, at once with an ERROR when refused, with a TIMEOUT after 30 s
# when it was parked (no reply is awaited for a fixed short time)
socks = []
for i in range(48):
    conn = TCPStore("127.0.0.1", int(sys.argv[1]), timeout=timedelta(seconds=20), token="")
    conn.check(["x"])
    held.append(conn)
    socks.append(conn._idle[-1].sock)
    keys = b"".join(struct.pack("!I", 900) + b"w" * 891 + b"%09d" % (i * 1000 + k)
                    for k in range(1000))
    socks[-1].sendall(wire.request(wire.Op.WAIT, struct.pack("!dI", 30.0, 1000) + keys))
parked = 0
for sock in socks:
    sock.settimeout(120)
    head = b""
    while len(head) < 5:
        head += sock.recv(5 - len(head))
    length, status = struct.unpack("!IB", head)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    if status == wire.Status.TIMEOUT:
        parked += 1
    else:
        refused["parked"] = body.decode()
refused["parked_count"] = parked
print(json.dumps(refused))
"""


@pytest.mark.timeout(180)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs a second Unix user (runs as root)")
def test_another_users_writes_cannot_fill_a_tokenless_store() -> None:
    """Another local user's process writing plain keys to a tokenless store is refused once
    its bytes pass ``max_stranger_bytes`` (it could otherwise fill the host's memory and take
    the store, and rank 0, down), with a message naming the limit; so is a request of it over
    1 MiB or 1,024 keys, and a wait that would park more than the same limit; the store's own
    user's processes write on past it, and the store serves on."""
    import subprocess
    import sys

    limits = TCPStoreLimits(max_stranger_bytes=32 << 20)
    m = TCPStore(HOST, 0, is_master=True, timeout=T, token="", limits=limits)
    try:
        done = subprocess.run([sys.executable, "-c", _STRANGER_FILLS, str(m.port)],
                              capture_output=True, text=True, timeout=150)
        assert done.returncode == 0, done.stderr[-2000:]
        first, last = done.stdout.strip().splitlines()[-2:]
        written, _, why = first.partition(" ")
        assert written.isdigit() and 56 <= int(written) < 64, done.stdout  # ~32 MiB, not more
        assert "TCPStoreLimits.max_stranger_bytes" in why and "runs as nobody" in why, why
        # its requests are small, and what they park is bounded by the same limit
        refused = json.loads(last)
        for what in ("keys", "request"):
            assert "send at most 1048576 bytes and 1024 keys per request" in refused[what], \
                refused[what]
        assert "parked requests of processes that are not the job's" in refused["parked"], \
            refused
        assert 25 <= refused["parked_count"] <= 36, refused  # 32 MiB of 0.96 MiB requests
        assert m.check([f"junk/{int(written) - 1}"]) and not m.check([f"junk/{written}"])
        own = client(m)
        for i in range(40):  # the job's own user: past the count, never refused
            own.set(f"own/{i}", b"y" * (1 << 20))
        assert own.get("own/39") == b"y" * (1 << 20)
        own.close()
    finally:
        m.close()
