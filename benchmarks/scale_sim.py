"""Scale simulation of resilient-group liveness and agreement: thousands of members on one
TCPStore, on this machine.

Each simulated member is a thread that runs what a member process does against the store, with
plugdist's real client (``TCPStore``, its ``Will`` and renewal thread), the real wire code and
the real key layout of ``plugdist._resilience``:

* **rendezvous**: open a store client, ``add`` 1 to a counter, the last one ``set``s the go key,
  ``wait`` for it; then claim its identity (``claim_member(..., ttl=)``: one connection whose
  will the server writes itself, renewed by the process's renewal thread every quarter ttl);
* **liveness**: park one ``read_log`` on the death log, on the will's connection, as
  membership's monitor does, and note when it has learnt of every victim. By default the
  process's members park their reads through one epoll loop (``--monitor loop``: the same
  LOG_READ frames on each member's own will connection, each reply parsed as it arrives);
  ``--monitor threads`` runs ``Will.read_log`` on a thread per member instead, which adds the
  cost of handing one GIL between 512 woken threads, a cost a real world (one member per
  process) does not have;
* **shrink**: append its uid to the epoch's arrival log (membership's one checked LOG_APPEND
  frame; a process's members send theirs on its shared connections, one in flight on each,
  from one epoll loop); the coordinator (the first member)
  reads that log with parked waits until every survivor arrived, writes the decision with one
  compare-and-set and announces it in the death log, where every survivor's wait sees it; each
  write is a member's checked write (its credential, checked by the server), as membership's.

The store's server runs in a process of its own (its CPU is read from /proc). Members run in
``--procs`` processes of threads; one more process hosts a "node" of ``--victims`` members,
which is SIGKILLed for real (its connections drop, the server runs their wills together).
Members connect to 127.0.0.1..127.0.0.8 in turn (the server listens on every address), so
ephemeral ports do not run out. A probe client times ``get`` round trips throughout.

    .venv/bin/python benchmarks/scale_sim.py                       # N = 1k, 4k, 16k + torch
    .venv/bin/python benchmarks/scale_sim.py --members 256 --json  # one size, JSON out

What the simulation leaves out (see docs/resilience.md): each member's main store connection
stays open in a real world (here it is closed after the rendezvous: 16k members x 2 connections
would pass this machine's open-file limit of 20,000 for one server process); the arrivals of a
process's members go through a few shared connections of that process; a member's own O(N)
work (rebuilding rank tables, building the next group) is not done; network latency is
loopback's; and 16k members' client work shares 2 cores with the server (the member
processes run at a lower priority than the server's, standing in for the store host's own
core), so the wall times are upper bounds of what the store needs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import selectors
import signal
import socket
import statistics
import sys
import threading
import time
from datetime import timedelta
from typing import Any

# torch's client warns once per connection that it cannot name its socket (no DNS here); torch
# reads this as it loads, which importing plugdist does
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from plugdist.errors import DistNetworkError, DistTimeoutError
from plugdist.store import TCPStore, TCPStoreLimits
from plugdist.store import _wire as w
from plugdist.store._worldkeys import DEATHS, epoch_key

RDZV_COUNT = "plugdist/sim/rdzv/count"
RDZV_GO = "plugdist/sim/rdzv/go"
LOOPBACKS = [f"127.0.0.{i}" for i in range(1, 9)]
_STACK = 256 * 1024  # per member thread: they only wait on a socket


def _cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# ---- the store's process -------------------------------------------------------------------

_NO_DNS = "/tmp/plugdist-scale-sim-resolv.conf"


def _answer_names_at_once() -> str:
    """Give this (single-threaded, just forked) process a resolver that answers at once.

    torch's client asks DNS for the name of its own socket's address as it connects (for a log
    line: an IPv4-mapped address that /etc/hosts does not list). This machine's DNS server
    drops some queries under load, and each dropped one costs the resolver's 5 s timeout: the
    figure would measure the resolver, not the store. In a mount namespace of its own, the
    process reads a resolv.conf that names a local server that is not there, so each lookup
    fails at once. Needs root; returns what was done, for the report."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private, ms_bind = 0x20000, 0x4000, 0x40000, 0x1000
    with open(_NO_DNS, "w") as f:
        f.write("nameserver 127.0.0.1\n")
    if libc.unshare(clone_newns) != 0:
        return f"system resolver (unshare: {os.strerror(ctypes.get_errno())})"
    # keep the bind below out of the parent's namespace
    libc.mount(b"none", b"/", None, ms_rec | ms_private, None)
    if libc.mount(_NO_DNS.encode(), b"/etc/resolv.conf", None, ms_bind, None) != 0:
        return f"system resolver (mount: {os.strerror(ctypes.get_errno())})"
    return "no DNS server (lookups fail at once)"


def role_server(args: argparse.Namespace, inp: Any, out: Any) -> None:
    if args.impl == "torch":
        import torch.distributed as tdist

        _answer_names_at_once()

        store: Any = tdist.TCPStore("0.0.0.0", 0, None, True, timedelta(seconds=600),
                                    wait_for_workers=False, use_libuv=True)
    else:
        store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=600), token="",
                         bind_host="0.0.0.0", limits=TCPStoreLimits(max_connections=65536))
    out.write(json.dumps({"port": store.port}) + "\n")
    out.flush()
    inp.readline()  # serve until the parent says stop (or dies: EOF)


# ---- a process of members ------------------------------------------------------------------

class _Members:
    """The members of one process, their threads and what they noted."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.uids = [str(u) for u in range(args.first, args.first + args.count)]
        self.go = threading.Event()
        # members of a process connecting at once: a real process is one member on a core of
        # its own; thousands of threads racing for one GIL would starve the renewal thread
        self.gate = threading.Semaphore(args.concurrency)
        self.lock = threading.Condition()
        self.met_at: dict[str, float] = {}  # the rendezvous' wait returned
        self.ready_at: dict[str, float] = {}  # and the will is held
        self.knew_at: dict[str, float] = {}
        self.decided_at: dict[str, float] = {}
        self.errors: list[str] = []
        self.log_replies = 0  # death-log replies the members read (a will lapsing counts too)
        self.wills: dict[str, Any] = {}
        self.sessions: dict[str, Any] = {}  # each member's identity, for its checked writes
        self.stopping = False
        self.victims = set(args.victim_uids.split(",")) if args.victim_uids else set()
        # the process's few shared connections (a real member has its own main connection)
        self.shared: queue.Queue[TCPStore] = queue.Queue()
        self.watch = _LogWatch(self) if args.monitor == "loop" else None
        if self.watch is not None:
            self.watch.start()

    def store(self, uid: str) -> TCPStore:
        return TCPStore(LOOPBACKS[int(uid) % len(LOOPBACKS)], self.args.port, None, False,
                        timedelta(seconds=self.args.timeout), token="")

    def member(self, uid: str) -> None:
        try:
            self.go.wait()
            if self.args.impl == "torch":
                self._torch_rendezvous(uid)
                return
            with self.gate:
                store = self.store(uid)
                if store.add(RDZV_COUNT, 1) == self.args.members:
                    store.set(RDZV_GO, b"1")
            store.wait([RDZV_GO])
            met = time.monotonic()
            with self.gate:  # membership's start: the identity, on a connection of its own
                session = store.claim_member("", uid, self.args.members, self.args.ttl)
                will = session.will
            store.close()  # see the module docstring: the fd limit of one server process
            with self.lock:
                self.wills[uid] = will
                self.sessions[uid] = session
                self.met_at[uid] = met
                self.ready_at[uid] = time.monotonic()
                self.lock.notify_all()
            if self.watch is not None:
                self.watch.add(uid, will)
            else:
                self._monitor(uid, will)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            with self.lock:
                self.errors.append(f"member {uid}: {e!r}")
                self.lock.notify_all()

    def _torch_rendezvous(self, uid: str) -> None:
        import torch.distributed as tdist

        with self.gate:
            store = tdist.TCPStore(LOOPBACKS[int(uid) % len(LOOPBACKS)], self.args.port, None,
                                   False, timedelta(seconds=self.args.timeout),
                                   wait_for_workers=False, use_libuv=True)
            if store.add(RDZV_COUNT, 1) == self.args.members:
                store.set(RDZV_GO, b"1")
        store.wait([RDZV_GO])
        with self.lock:
            self.met_at[uid] = self.ready_at[uid] = time.monotonic()
            self.lock.notify_all()
        del store

    def _monitor(self, uid: str, will: Any) -> None:
        """Membership's monitor on a thread of its own: one parked read of the death log at a
        time."""
        seen = 0
        dead: set[str] = set()
        while True:
            try:
                entries = will.read_log(seen + 1, 30.0)
            except DistTimeoutError:
                continue
            except DistNetworkError:
                if self.stopping:
                    return
                raise
            seen += len(entries)
            self.log_replies += 1
            self.learn(uid, dead, [json.loads(raw) for raw in entries], time.monotonic())

    def learn(self, uid: str, dead: set[str], records: list[dict[str, Any]], now: float) -> None:
        """What member ``uid``'s monitor does with the death-log records it read at ``now``."""
        for record in records:
            if record["cause"] == "decided":
                with self.lock:
                    self.decided_at[uid] = now
                    self.lock.notify_all()
            else:
                dead.add(record["uid"])
                if self.victims <= dead and uid not in self.knew_at:
                    with self.lock:
                        self.knew_at[uid] = now
                        self.lock.notify_all()

    def wait_for(self, table: dict[str, float], deadline: float) -> None:
        with self.lock:
            while len(table) + len(self.errors) < len(self.uids):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.lock.wait(left)

    def shrink(self, epoch: int, survivors: int, coordinator: bool) -> float:
        """Every member of this process arrives (through a few shared connections); the
        coordinator then decides as membership's ``_await_decision`` does. Returns when this
        process's members had all arrived."""
        arrivals = epoch_key(epoch, "shrink/0/arrived")
        decided = epoch_key(epoch, "next")
        self._arrive_all(arrivals)
        arrived_at = time.monotonic()
        if not coordinator:
            return arrived_at
        store = self.shared.get()
        try:
            arrived: set[str] = set()
            next_entry = 1
            deadline = time.monotonic() + self.args.timeout
            while len(arrived) < survivors and time.monotonic() < deadline:
                try:
                    entries = store.read_log(arrivals, next_entry, timedelta(seconds=0.25))
                except DistTimeoutError:
                    continue
                next_entry += len(entries)
                arrived.update(e.decode() for e in entries)
            ours = json.dumps({"excluded": sorted(self.victims)})
            me = self.sessions[self.uids[0]].using(store)
            if me.compare_set(decided, b"", ours) == ours.encode():
                me.record(json.dumps({"uid": self.uids[0], "cause": "decided", "key": decided,
                                      **json.loads(ours)}))
        finally:
            self.shared.put(store)
        return arrived_at

    def _arrive_all(self, arrivals: str) -> None:
        """Every member of this process appends its arrival: membership's checked LOG_APPEND
        frame for each, sent on the process's shared connections with one request in flight
        on each, the replies read by one epoll loop (a thread per connection spent 2-5 s of
        the member processes' CPU at 16,384 members, on 2 cores the server shares)."""
        key = arrivals.encode()
        todo = collections.deque(
            w.request(w.Op.MEMBER, self.sessions[uid]._head + w.U8.pack(w.Op.LOG_APPEND)
                      + w.U32.pack(len(key)) + key + w.U32.pack(len(uid)) + uid.encode())
            for uid in self.uids)
        stores = [self.shared.get() for _ in range(self.shared.qsize())]
        sel = selectors.EpollSelector()
        buffers: dict[Any, bytearray] = {}
        try:
            for store in stores:
                self.sessions[self.uids[0]].using(store)  # its connection vouches as a member
                store.check([RDZV_GO])
                sock = store._idle[-1].sock
                buffers[sock] = bytearray()
                sel.register(sock, selectors.EVENT_READ)
            busy = 0
            for sock in buffers:
                if todo:
                    sock.sendall(todo.popleft())
                    busy += 1
            deadline = time.monotonic() + self.args.timeout
            while busy and time.monotonic() < deadline:
                for sel_key, _ in sel.select(1.0):
                    sock = sel_key.fileobj
                    data = sock.recv(65536)
                    if not data:
                        raise ConnectionError("the server closed a shared connection")
                    buf = buffers[sock]
                    buf += data
                    while len(buf) >= 5:
                        length, status = w.HEADER.unpack_from(buf)
                        if len(buf) < 5 + length:
                            break
                        if status != w.Status.OK:
                            raise RuntimeError(f"arrival refused: {bytes(buf[5:5 + length])!r}")
                        del buf[:5 + length]
                        if todo:
                            sock.sendall(todo.popleft())
                        else:
                            busy -= 1
        finally:
            sel.close()
            for store in stores:
                self.shared.put(store)


class _Watched:
    __slots__ = ("uid", "conn", "buf", "seen", "dead")

    def __init__(self, uid: str, conn: Any) -> None:
        self.uid, self.conn = uid, conn
        self.buf = bytearray()
        self.seen = 0
        self.dead: set[str] = set()


class _LogWatch(threading.Thread):
    """The parked death-log reads of every member of this process, on one epoll loop: each
    member's LOG_READ goes on its own will connection (beside the renewals), and each reply is
    parsed as it arrives and answered by the member's next LOG_READ."""

    def __init__(self, group: _Members) -> None:
        super().__init__(daemon=True)
        self.group = group
        self.sel = selectors.EpollSelector()
        self.added: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.wake_r, self.wake_w = socket.socketpair()
        self.sel.register(self.wake_r, selectors.EVENT_READ, None)
        self.quit = False
        self.key = DEATHS.encode()
        # the records of a reply body, parsed once for the process: its members all get the
        # same bodies, which real members (each on a host of its own) parse in parallel
        self.parsed: dict[bytes, list[dict[str, Any]]] = {}

    def add(self, uid: str, will: Any) -> None:
        self.added.put((uid, will))
        self.wake_w.send(b"x")

    def stop(self) -> None:
        self.quit = True
        self.wake_w.send(b"x")
        self.join(5.0)

    def _ask(self, st: _Watched) -> None:
        k = self.key
        st.conn.send_control(w.HDR_F64_I64_BLOB.pack(20 + len(k), w.Op.LOG_READ, 30.0,
                                                     st.seen + 1, len(k)) + k)

    def _adopt(self) -> None:
        while True:
            try:
                uid, will = self.added.get_nowait()
            except queue.Empty:
                return
            st = _Watched(uid, will._conn)
            self.sel.register(st.conn.sock, selectors.EVENT_READ, st)
            self._ask(st)

    def _read(self, st: _Watched) -> None:
        try:
            data = st.conn.sock.recv(65536, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            raise ConnectionError(f"member {st.uid}: the server closed its will's connection")
        st.buf += data
        now = time.monotonic()
        while len(st.buf) >= 5:
            length, status = w.HEADER.unpack_from(st.buf)
            if len(st.buf) < 5 + length:
                return
            body = bytes(st.buf[5:5 + length])
            del st.buf[:5 + length]
            if status == w.Status.OK:
                records = self.parsed.get(body)
                if records is None:
                    entries, _ = w.unpack_blobs(body, 0, len(body))
                    records = [json.loads(raw) for raw in entries]
                    if len(self.parsed) > 256:
                        self.parsed.clear()
                    self.parsed[body] = records
                st.seen += len(records)
                self.group.log_replies += 1
                self.group.learn(st.uid, st.dead, records, now)
            elif status != w.Status.TIMEOUT:
                raise RuntimeError(f"member {st.uid}: read_log: {body.decode(errors='replace')}")
            self._ask(st)

    def run(self) -> None:
        try:
            while not self.quit:
                for key, _ in self.sel.select(1.0):
                    if key.data is None:
                        self.wake_r.recv(4096)
                        self._adopt()
                    else:
                        self._read(key.data)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            if not self.quit:
                with self.group.lock:
                    self.group.errors.append(f"monitor loop: {e!r}")
                    self.group.lock.notify_all()


def role_members(args: argparse.Namespace, inp: Any, out: Any) -> None:
    # the store's host has a core of its own in a real world; here thousands of members share
    # two with it, so they yield to it (raising one's niceness needs no privilege)
    os.nice(args.member_nice)
    resolver = _answer_names_at_once() if args.impl == "torch" else "not used"
    threading.stack_size(_STACK)
    group = _Members(args)
    threads = [threading.Thread(target=group.member, args=(u,), daemon=True)
               for u in group.uids]
    for t in threads:
        t.start()
    out.write(json.dumps({"started": len(threads), "resolver": resolver}) + "\n")
    out.flush()
    for line in inp:
        cmd = json.loads(line)
        what = cmd["cmd"]
        if what == "go":
            group.go.set()
            group.wait_for(group.ready_at, time.monotonic() + args.timeout)
            if args.impl != "torch":
                for i in range(args.shared):
                    group.shared.put(group.store(str(args.first + i)))
            reply: dict[str, Any] = {"ready": list(group.ready_at.values()),
                                     "met": list(group.met_at.values()),
                                     "errors": group.errors[:5]}
        elif what == "knew":
            group.wait_for(group.knew_at, time.monotonic() + cmd["within"])
            reply = {"knew": list(group.knew_at.values()), "log_replies": group.log_replies,
                     "errors": group.errors[:5]}
        elif what == "shrink":
            arrived = None
            try:
                arrived = group.shrink(cmd["epoch"], cmd["survivors"], cmd["coordinator"])
            except Exception as e:  # noqa: BLE001 - reported to the parent
                group.errors.append(f"shrink: {e!r}")
            group.wait_for(group.decided_at, time.monotonic() + cmd["within"])
            reply = {"decided": list(group.decided_at.values()), "arrived": arrived,
                     "errors": group.errors[:5]}
        else:  # quit
            group.stopping = True
            if group.watch is not None:
                group.watch.stop()
            for will in list(group.wills.values()):
                will.cancel()
            out.write(json.dumps({"bye": True}) + "\n")
            out.flush()
            os._exit(0)
        out.write(json.dumps(reply) + "\n")
        out.flush()


# ---- the parent ----------------------------------------------------------------------------

class _Child:
    """A process forked from this one (torch and plugdist already imported: a fresh
    interpreter would spend seconds importing them) running ``role(args, inp, out)``, talked
    to with one JSON line each way."""

    def __init__(self, role: Any, args: argparse.Namespace) -> None:
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            os.close(down_w)
            os.close(up_r)
            code = 0
            try:
                role(args, os.fdopen(down_r), os.fdopen(up_w, "w"))
            except BaseException as e:  # noqa: BLE001 - the parent sees EOF and says so
                print(f"scale_sim child: {e!r}", file=sys.stderr)
                code = 1
            os._exit(code)
        os.close(down_r)
        os.close(up_w)
        self.pid = pid
        self._to = os.fdopen(down_w, "w")
        self._from = os.fdopen(up_r)
        self.code: int | None = None

    def ask(self, msg: dict[str, Any] | None = None) -> dict[str, Any]:
        if msg is not None:
            self.send(msg)
        line = self._from.readline()
        if not line:
            raise RuntimeError(f"a simulation process exited ({self.wait()})")
        return dict(json.loads(line))

    def send(self, msg: dict[str, Any]) -> None:
        self._to.write(json.dumps(msg) + "\n")
        self._to.flush()

    def alive(self) -> bool:
        if self.code is None and os.waitpid(self.pid, os.WNOHANG)[0]:
            self.code = -1
        return self.code is None

    def wait(self) -> int:
        if self.code is None:
            self.code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.code

    def stop(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.wait()


def _members_args(args: argparse.Namespace, impl: str, port: int, first: int, count: int,
                  victim_uids: str) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "impl": impl, "port": port, "first": first,
                                 "count": count, "victim_uids": victim_uids})


class _Probe(threading.Thread):
    """One client timing ``get`` round trips, ``rate`` a second, while ``on`` is set."""

    def __init__(self, port: int, rate: float) -> None:
        super().__init__(daemon=True)
        self.store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60), token="")
        self.store.set("plugdist/sim/probe", b"x")
        self.rate = rate
        self.samples: list[float] = []
        self.on = threading.Event()
        self.quit = threading.Event()

    def run(self) -> None:
        while not self.quit.is_set():
            if self.on.is_set():
                t0 = time.perf_counter()
                self.store.get("plugdist/sim/probe")
                self.samples.append((time.perf_counter() - t0) * 1000)
            time.sleep(1.0 / self.rate)

    def take(self) -> list[float]:
        out, self.samples = self.samples, []
        return out


def simulate(args: argparse.Namespace, impl: str = "plugdist") -> dict[str, Any]:
    """One world of ``args.members`` members: its figures."""
    n, victims = args.members, args.victims
    server = _Child(role_server, argparse.Namespace(impl=impl))
    children: list[_Child] = []
    # the machine's load as the run starts (the figures hold for an otherwise idle machine)
    result: dict[str, Any] = {"members": n, "impl": impl, "load_1m": os.getloadavg()[0]}
    try:
        port = int(server.ask()["port"])
        live = n - (0 if impl == "torch" else victims)
        per = -(-live // args.procs)
        spans = [(first, min(per, live - first)) for first in range(0, live, per)]
        victim_uids = ",".join(str(u) for u in range(live, n))
        for first, count in spans:
            children.append(_Child(role_members, _members_args(args, impl, port, first, count,
                                                               victim_uids)))
        if impl != "torch":
            children.append(_Child(role_members, _members_args(args, impl, port, live, victims,
                                                               victim_uids)))
        started = [c.ask() for c in children]  # threads started
        result["resolver"] = started[0]["resolver"]
        cpu0 = _cpu_seconds(server.pid)
        t_go = time.monotonic()
        for c in children:
            c.send({"cmd": "go"})
        readies = [c.ask() for c in children]
        ready = [t for r in readies for t in r["ready"]]
        errors = [e for r in readies for e in r["errors"]]
        met = [t for r in readies for t in r["met"]]
        result["rendezvous_s"] = round(max(met) - t_go, 2) if len(met) == n else None
        result["wills_held_s"] = round(max(ready) - t_go, 2) if len(ready) == n else None
        result["rendezvous_done"] = len(ready)
        result["rendezvous_server_cpu_s"] = round(_cpu_seconds(server.pid) - cpu0, 2)
        if errors:
            result["errors"] = errors[:5]
        if impl == "torch" or len(ready) < n:
            return result
        # steady state: renewals and parked waits only
        probe = _Probe(port, args.probe_rate)
        probe.start()
        time.sleep(min(2.0, args.steady))  # let the rendezvous' last replies drain
        probe.on.set()
        cpu0, t0 = _cpu_seconds(server.pid), time.monotonic()
        time.sleep(args.steady)
        cpu = (_cpu_seconds(server.pid) - cpu0) / (time.monotonic() - t0)
        lat = probe.take()
        result["steady_server_cpu_pct"] = round(100 * cpu, 1)
        result["probe_ms_p50"] = round(statistics.median(lat), 2)
        result["probe_ms_p99"] = round(_pct(lat, 0.99), 2)
        # a node dies: SIGKILL the process of its members
        node = children.pop()
        cpu0, members_cpu0 = _cpu_seconds(server.pid), sum(_cpu_seconds(c.pid) for c in children)
        t_kill = time.monotonic()
        os.kill(node.pid, signal.SIGKILL)
        node.wait()
        replies = [c.ask({"cmd": "knew", "within": args.timeout}) for c in children]
        # where the fan-out's time goes: the store's process, or the member processes that
        # stand in for 16k hosts on 2 cores
        result["death_server_cpu_s"] = round(_cpu_seconds(server.pid) - cpu0, 3)
        result["death_members_cpu_s"] = round(
            sum(_cpu_seconds(c.pid) for c in children) - members_cpu0, 3)
        knew = [t - t_kill for r in replies for t in r["knew"]]
        # one reply per member when the node's deaths reach each waiter together
        result["death_log_replies"] = sum(r["log_replies"] for r in replies)
        errors += [e for r in replies for e in r["errors"]]
        result["death_known_by"] = len(knew)
        if len(knew) == live:
            result["death_known_s_p50"] = round(_pct(knew, 0.5), 3)
            result["death_known_s_p99"] = round(_pct(knew, 0.99), 3)
            result["death_known_s_max"] = round(max(knew), 3)
        result["probe_ms_p99_during_death"] = round(_pct(probe.take() or [0.0], 0.99), 2)
        # the survivors agree a shrink
        cpu0, members_cpu0 = _cpu_seconds(server.pid), sum(_cpu_seconds(c.pid) for c in children)
        t_shrink = time.monotonic()
        for i, c in enumerate(children):
            c.send({"cmd": "shrink", "epoch": 0, "survivors": live, "coordinator": i == 0,
                    "within": args.timeout})
        replies = [c.ask() for c in children]
        result["shrink_server_cpu_s"] = round(_cpu_seconds(server.pid) - cpu0, 3)
        result["shrink_members_cpu_s"] = round(
            sum(_cpu_seconds(c.pid) for c in children) - members_cpu0, 3)
        arrived = [r["arrived"] for r in replies if r["arrived"] is not None]
        if len(arrived) == len(replies):  # every member's arrival written
            result["shrink_arrived_s"] = round(max(arrived) - t_shrink, 3)
        decided = [t - t_shrink for r in replies for t in r["decided"]]
        errors += [e for r in replies for e in r["errors"]]
        if errors:
            result["errors"] = sorted(set(errors))[:5]
        result["shrink_decided_by"] = len(decided)
        if len(decided) == live:
            result["shrink_s_p50"] = round(_pct(decided, 0.5), 3)
            result["shrink_s_max"] = round(max(decided), 3)
        probe.quit.set()
        return result
    finally:
        shut_down(children, server)


def shut_down(children: list[_Child], server: _Child) -> None:
    """End the member processes, then the store's (which stops what it serves on its way out)."""
    for c in children:
        if c.alive():
            try:
                c.send({"cmd": "quit"})
                c.ask()
            except (OSError, RuntimeError):
                pass
        c.stop()
    try:
        server.send({"cmd": "quit"})
        server.wait()
    except OSError:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--members", type=int, nargs="*", default=None,
                   help="world sizes (default 1024 4096 16384)")
    p.add_argument("--victims", type=int, default=8, help="members of the node that is killed")
    p.add_argument("--procs", type=int, default=0,
                   help="processes of member threads (default: one per 512 members, >= 2)")
    p.add_argument("--ttl", type=float, default=10.0, help="seconds of each will's ttl")
    p.add_argument("--steady", type=float, default=10.0, help="seconds of steady state measured")
    p.add_argument("--probe-rate", type=float, default=200.0, help="probe gets a second")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any phase may take")
    p.add_argument("--shared", type=int, default=4,
                   help="shared connections per member process for the arrivals")
    p.add_argument("--concurrency", type=int, default=16,
                   help="members of one process that connect at the same time")
    p.add_argument("--member-nice", type=int, default=5,
                   help="niceness the member processes add to their own (the server keeps its)")
    p.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the rendezvous on torch's TCPStore (libuv)")
    p.add_argument("--monitor", choices=["loop", "threads"], default="loop",
                   help="members' death-log reads: one epoll loop per process (default) or "
                        "Will.read_log on a thread per member")
    p.add_argument("--json", action="store_true", help="print one JSON line per world")
    args = p.parse_args()
    sizes = args.members or [1024, 4096, 16384]
    rows = []
    for n in sizes:
        one = argparse.Namespace(**vars(args))
        one.members = n
        one.procs = args.procs or max(2, -(-n // 512))
        row = simulate(one)
        if args.torch:
            torch_row = simulate(one, "torch")
            row["torch_rendezvous_s"] = torch_row.get("rendezvous_s")
            row["torch_rendezvous_done"] = torch_row.get("rendezvous_done")
            row["torch_resolver"] = torch_row.get("resolver")
            if "errors" in torch_row:
                row["torch_errors"] = torch_row["errors"][:2]
        rows.append(row)
        print(json.dumps(row) if args.json else _line(row), flush=True)


def _line(row: dict[str, Any]) -> str:
    keys = ["members", "rendezvous_s", "torch_rendezvous_s", "wills_held_s",
            "steady_server_cpu_pct", "probe_ms_p50", "probe_ms_p99", "death_known_s_p50",
            "death_known_s_p99", "shrink_s_max", "errors"]
    return "  ".join(f"{k}={row.get(k)}" for k in keys if k in row)


if __name__ == "__main__":
    main()
