"""Scale simulation of resilient-group liveness on an etcd store: thousands of members' leases,
wills and watchers on one etcd member, on this machine.

Each simulated member does what a rank's membership does on etcd, with plugdist-etcd's real
client, its key layout and the store's own will transactions:

* **rendezvous**: ``add`` 1 to a counter (the last one ``set``s the go key), then, as
  ``wait`` does, a look at the go key and a watcher on it from the revision of the look;
* **its will**: a lease of ``--ttl`` seconds, kept alive every quarter TTL, and the will's
  record and liveness key (``EtcdStore._put_will``); with ``--per-node K`` the lease is shared
  by K members, as a node's workers share their agent's under ``plugdist-run``;
* **the ring**: its successor among the wills and a sweep of its span
  (``_successor``, ``_orphans_between``), then a watcher on that span; a deletion there runs
  that will (``_execute_will``), as ``EtcdWill``'s watcher does;
* **the death log**: a watcher on its next entry; when it fires, the member reads the log
  (``read_log``: one transaction).

The steady state is measured once every member's watchers are in place (``watching_s``). A
process of ``--victims`` members (a node) is SIGKILLed; their leases lapse after the TTL,
their successors in the ring run their wills, and every survivor's watcher fires. The report
gives the times from the kill and from the first will's entry (the fan-out), and etcd's CPU.

What differs from real ranks (see docs/resilience.md): the members of one process share a
pool of 16 HTTP connections, and carry their watchers a few to a stream (etcd's JSON gateway
serves one stream per HTTP/1.1 connection, and one process here may hold at most 20,000 files:
16,384 members with three connections each would not fit); etcd still holds one watcher per
member per purpose, and every lease (but with ``--per-node``), renewal, transaction and read
is per member. (The rendezvous watchers that once never fired, one run in five: the gateway
had dropped their create requests; they are now reported and sent again.) The shrink's
agreement is not simulated here (scale_sim.py does it on a TCPStore: it is the same store
operations).

    .venv/bin/python benchmarks/etcd_scale_sim.py                  # N = 256, 512, 1,024
    .venv/bin/python benchmarks/etcd_scale_sim.py --members 4096 --per-node 8   # agent leases
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from plugdist.errors import DistError, DistTimeoutError
from plugdist.store._worldkeys import DEATHS
from plugdist_etcd import EtcdStore
from plugdist_etcd.client import EtcdClient, b64, prefix_end, unb64
from plugdist_etcd.testing import EtcdCluster
from scale_sim import _Child, _cpu_seconds, _pct, shut_down

PREFIX = "sim"
RDZV_COUNT = "plugdist/sim/rdzv/count"
RDZV_GO = "plugdist/sim/rdzv/go"
_STREAM_SPAN = 600.0  # a watch stream of the simulation stays open this long at most


def _open(args: argparse.Namespace) -> EtcdStore:
    return EtcdStore([args.endpoint], PREFIX, timedelta(seconds=args.timeout), ttl=0,
                     live_ttl=args.ttl)


# ---- etcd's process --------------------------------------------------------------------------

def role_server(args: argparse.Namespace, inp: Any, out: Any) -> None:
    cluster = EtcdCluster(1, extra_args=("--quota-backend-bytes", str(4 << 30))).start()
    proc = cluster.procs[0]
    assert proc is not None
    try:
        out.write(json.dumps({"endpoint": cluster.endpoints[0], "pid": proc.pid}) + "\n")
        out.flush()
        inp.readline()  # serve until the parent says stop (or dies: EOF)
    finally:
        cluster.stop()


# ---- a process of members --------------------------------------------------------------------

class _Members:
    """The members of one process: their leases, wills, ring watchers and death-log readers."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.uids = [str(u) for u in range(args.first, args.first + args.count)]
        self.store = _open(args)
        self.client = self.store._client
        self.pool = ThreadPoolExecutor(args.concurrency)
        self.lock = threading.Lock()
        self.met_at: dict[str, float] = {}
        self.ready_at: dict[str, float] = {}
        self.knew_at: dict[str, float] = {}
        self.errors: list[str] = []
        self.leases: dict[str, int] = {}
        self.wids: dict[str, bytes] = {}
        self.executed = 0
        self.renewals = 0
        self.lapsed = 0
        self.stop = threading.Event()
        self.ring_watching = threading.Event()     # every ring watcher created (the first time)
        self.deaths_watching = threading.Event()   # every death-log watcher created
        self.victims = set(args.victim_uids.split(",")) if args.victim_uids else set()

    def _each(self, fn: Any) -> None:
        """Run ``fn(uid)`` for every member on the pool; note errors."""
        for uid, err in zip(self.uids, self.pool.map(self._safe(fn), self.uids), strict=True):
            if err:
                self.errors.append(f"member {uid}: {err}")

    @staticmethod
    def _safe(fn: Any) -> Any:
        def run(uid: str) -> str | None:
            try:
                fn(uid)
                return None
            except Exception as e:  # noqa: BLE001 - reported to the parent
                return repr(e)[:300]
        return run

    # -- rendezvous and wills ------------------------------------------------------------------
    def rendezvous(self) -> None:
        def arrive(uid: str) -> None:
            if self.store.add(RDZV_COUNT, 1) == self.args.members:
                self.store.set(RDZV_GO, b"1")
        self._each(arrive)
        # as the store's wait does: look, then watch from the revision of the look
        missing, revision = self.store._missing([RDZV_GO], "value", time.monotonic() + 30,
                                                "rendezvous")
        if not missing:
            now = time.monotonic()
            self.met_at.update(dict.fromkeys(self.uids, now))
            return
        go = [{"key": b64(self.store._vkey(RDZV_GO)), "start_revision": str(revision + 1)}
              for _ in self.uids]
        self._stream(go, self._met, lambda: len(self.met_at) == len(self.uids))

    def _met(self, result: dict[str, Any], now: float) -> None:
        """A go watcher's event: one more member met (which one does not matter here)."""
        if result.get("events"):
            self.met_at[self.uids[len(self.met_at)]] = now

    def _grant(self) -> int:
        data = self.client.call("lease/grant", {"TTL": int(self.args.ttl)},
                                time.monotonic() + self.args.timeout, "lease grant")
        return int(data["ID"])

    def hold_wills(self) -> None:
        per_node = self.args.per_node
        node_lease: dict[str, int] = {}
        if per_node > 1:  # as plugdist-run's agent does: one lease for a node's members
            nodes = [self.uids[i:i + per_node] for i in range(0, len(self.uids), per_node)]
            for node, lease in zip(nodes, self.pool.map(lambda _: self._grant(), nodes),
                                   strict=True):
                node_lease.update(dict.fromkeys(node, lease))

        def hold(uid: str) -> None:
            lease = node_lease[uid] if per_node > 1 else self._grant()
            wid = os.urandom(8).hex().encode()
            self.store._put_will(wid, DEATHS, json.dumps({"uid": uid, "cause": "died"}).encode(),
                                 lease)
            with self.lock:
                self.leases[uid] = lease
                self.wids[uid] = wid
                self.ready_at[uid] = time.monotonic()
        self._each(hold)
        for i in range(self.args.renewers):
            threading.Thread(target=self._renew, args=(i,), daemon=True).start()

    def _renew(self, part: int) -> None:
        """Keep this part of the process's leases alive: each every quarter TTL, spread."""
        mine = list(dict.fromkeys(self.leases.values()))[part::self.args.renewers]
        period = self.args.ttl / 4
        while not self.stop.is_set() and mine:
            start = time.monotonic()
            for n, lease in enumerate(mine):
                due = start + period * n / len(mine)
                if self.stop.wait(max(0.0, due - time.monotonic())):
                    return
                try:
                    data = self.client.call("lease/keepalive", {"ID": str(lease)},
                                            time.monotonic() + period, "lease keepalive")
                    if int(data.get("result", {}).get("TTL", 0) or 0) <= 0:
                        self.lapsed += 1
                    self.renewals += 1
                except DistError:
                    self.lapsed += 1
            self.stop.wait(max(0.0, start + period - time.monotonic()))

    # -- the ring: each member runs the wills of the holders just before it --------------------
    def watch_ring(self) -> None:
        threading.Thread(target=self._noting(self._ring), daemon=True).start()

    def _noting(self, fn: Any) -> Any:
        """``fn`` for a thread of its own: an error ends it, noted for the parent."""
        def run() -> None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - reported to the parent
                with self.lock:
                    self.errors.append(f"{fn.__name__}: {e!r}"[:300])
        return run

    def _ring(self) -> None:
        live = self.store._p + b"l/"
        spans: dict[str, list[tuple[bytes, bytes | None]]] = {}
        revision: dict[str, int] = {}

        def look(uid: str) -> None:
            me = self.wids[uid]
            succ, rev = self.store._successor(me)
            if succ is not None:
                for wid in self.store._orphans_between(me, succ):
                    self._execute(wid)
            span: list[tuple[bytes, bytes | None]] = (
                [(b"", None)] if succ is None else
                [(me + b"\0", succ + b"\0")] if me < succ else
                [(me + b"\0", None), (b"", succ + b"\0")])
            with self.lock:
                spans[uid], revision[uid] = span, rev

        todo = list(self.uids)
        while not self.stop.is_set():
            for uid, err in zip(todo, self.pool.map(self._safe(look), todo), strict=True):
                if err:
                    self.errors.append(f"ring {uid}: {err}")
            creates = []
            for uid in self.uids:
                for low, high in spans[uid]:
                    creates.append({"key": b64(live + low),
                                    "range_end": b64(live + high if high is not None else
                                                     prefix_end(live)),
                                    "start_revision": str(revision[uid] + 1)})
            changed: set[str] = set()

            def take(result: dict[str, Any], now: float, changed: set[str] = changed) -> None:
                for event in result.get("events", []):
                    wid = unb64(event.get("kv", {}).get("key"))[len(live):]
                    if event.get("type") == "DELETE":
                        self._execute(wid)
                    # whose span it is, from the key (not trusting the watchers' numbering)
                    changed.update(uid for uid in self.uids if any(
                        low <= wid and (high is None or wid < high) for low, high in spans[uid]))

            self._stream(creates, take, lambda changed=changed: bool(changed) or
                         self.stop.is_set(), self.ring_watching)
            # the changed ones look again; the others watch again from where they started
            todo = sorted(changed)

    def _execute(self, wid: bytes) -> None:
        if self.store._execute_will(wid):
            with self.lock:
                self.executed += 1

    # -- the death log -------------------------------------------------------------------------
    def watch_deaths(self) -> None:
        threading.Thread(target=self._noting(self._deaths), daemon=True).start()

    def _deaths(self) -> None:
        seen = dict.fromkeys(self.uids, 0)
        dead: dict[str, set[str]] = {uid: set() for uid in self.uids}

        def read(uid: str) -> None:
            entries = self.store.read_log(DEATHS, seen[uid] + 1, timedelta(0))
            now = time.monotonic()
            seen[uid] += len(entries)
            dead[uid].update(json.loads(e)["uid"] for e in entries)
            if self.victims <= dead[uid]:
                with self.lock:
                    self.knew_at.setdefault(uid, now)

        revision = self._revision()
        while not self.stop.is_set():
            fired = threading.Event()
            creates = [{"key": b64(self.store._vkey(f"{DEATHS}/{seen[uid] + 1}")),
                        "start_revision": str(revision + 1)} for uid in self.uids]
            self._stream(creates, lambda result, now, fired=fired: fired.set()
                         if result.get("events") else None,
                         lambda fired=fired: fired.is_set() or self.stop.is_set(),
                         self.deaths_watching)
            # what the reads below miss was written after this revision: the next watch sees it
            revision = self._revision()
            for uid, err in zip(self.uids, self.pool.map(self._safe(self._quiet(read)),
                                                         self.uids), strict=True):
                if err:
                    self.errors.append(f"deaths {uid}: {err}")

    def _revision(self) -> int:
        """etcd's current revision (one request)."""
        data = self.client.call("kv/range", {"key": b64(b"\0"), "count_only": True},
                                time.monotonic() + self.args.timeout, "revision")
        return int(data.get("header", {}).get("revision", 0) or 0)

    @staticmethod
    def _quiet(fn: Any) -> Any:
        def run(uid: str) -> None:
            try:
                fn(uid)
            except DistTimeoutError:
                pass  # its next entry is not there yet
        return run

    def _stream(self, creates: list[dict[str, Any]], take: Any, done: Any,
                created: threading.Event | None = None) -> None:
        """Watch ``creates``: ``take(result, now)`` for each response but the watchers'
        creation, until ``done()``. etcd's JSON gateway may drop the last create requests of
        a stream (the client then ends it: ``lost_creates``); the chunk is watched again on a
        new stream, and the events it delivers again are skipped. Watchers go
        ``--per-stream`` to a stream, each
        read by a thread, on a client of their own that is closed at the end (which ends them).
        Which watcher a response is for is read from its events' keys where it matters.
        ``created`` is set once etcd has created every watcher of the call."""
        if not creates:
            if created is not None:
                created.set()
            return
        acks = [0]
        client = EtcdClient([f"http://{self.args.endpoint}"], pool_size=1)
        cond = threading.Condition()
        ended = [0]
        per = self.args.per_stream
        chunks = [creates[i:i + per] for i in range(0, len(creates), per)]

        def read(chunk: list[dict[str, Any]]) -> None:
            taken = 0   # event responses handed to take(), over the chunk's streams
            counted = 0  # this chunk's acknowledgements counted in acks
            try:
                while True:
                    acked = seen = lost = 0
                    for result in client.watch(chunk, time.monotonic() + _STREAM_SPAN):
                        if result.get("lost_creates"):
                            lost = result["lost_creates"]
                            break
                        if result.get("created"):
                            acked += 1
                            if acked > counted:
                                counted = acked
                                with cond:
                                    acks[0] += 1
                                    if created is not None and acks[0] == len(creates):
                                        created.set()
                            continue
                        seen += 1
                        if seen <= taken:
                            continue  # delivered again by the stream that replaced a lost one
                        taken = seen
                        with cond:
                            take(result, time.monotonic())
                            if done():
                                cond.notify_all()
                                return
                    if not lost:
                        return
                    # the stream, with the watchers it had, ended: watch the whole chunk again
            except DistError as e:
                with self.lock:
                    self.errors.append(f"watch: {e!r}"[:300])
            finally:
                with cond:
                    ended[0] += 1
                    cond.notify_all()

        for chunk in chunks:
            threading.Thread(target=read, args=(chunk,), daemon=True).start()
        with cond:
            if not cond.wait_for(lambda: done() or ended[0] == len(chunks), self.args.timeout):
                self.errors.append(f"a watch had no answer in {self.args.timeout}s")
        client.close()


def role_members(args: argparse.Namespace, inp: Any, out: Any) -> None:
    os.nice(args.member_nice)
    group = _Members(args)
    out.write(json.dumps({"started": len(group.uids)}) + "\n")
    out.flush()
    for line in inp:
        what = json.loads(line)["cmd"]
        reply: dict[str, Any]
        if what == "go":
            group.rendezvous()
            group.hold_wills()
            group.watch_ring()
            group.watch_deaths()
            watching = (group.ring_watching.wait(args.timeout)
                        and group.deaths_watching.wait(args.timeout))
            reply = {"met": list(group.met_at.values()), "ready": list(group.ready_at.values()),
                     "watching": time.monotonic() if watching else None,
                     "errors": group.errors[:5] + ([] if watching else [
                         f"watchers not all created in {args.timeout}s: ring "
                         f"{group.ring_watching.is_set()}, deaths "
                         f"{group.deaths_watching.is_set()}"])}
        elif what == "knew":
            deadline = time.monotonic() + args.timeout
            while len(group.knew_at) < len(group.uids) and time.monotonic() < deadline:
                time.sleep(0.05)
            reply = {"knew": list(group.knew_at.values()), "errors": group.errors[:5],
                     "executed": group.executed, "lapsed": group.lapsed}
        elif what == "stats":
            reply = {"renewals": group.renewals, "lapsed": group.lapsed}
        else:  # quit
            group.stop.set()
            out.write(json.dumps({"bye": True}) + "\n")
            out.flush()
            os._exit(0)
        out.write(json.dumps(reply) + "\n")
        out.flush()


# ---- the parent ------------------------------------------------------------------------------

def _args_for(args: argparse.Namespace, endpoint: str, first: int, count: int,
              victims: str) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "endpoint": endpoint, "first": first,
                                 "count": count, "victim_uids": victims})


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    """One world of ``args.members`` members on a fresh etcd: its figures."""
    n, victims = args.members, args.victims
    server = _Child(role_server, args)
    children: list[_Child] = []
    result: dict[str, Any] = {"members": n, "store": "etcd", "ttl_s": args.ttl,
                              "members_per_lease": args.per_node}
    try:
        hello = server.ask()
        endpoint, etcd_pid = hello["endpoint"], int(hello["pid"])
        live = n - victims
        per = -(-live // args.procs)
        spans = [(first, min(per, live - first)) for first in range(0, live, per)]
        victim_uids = ",".join(str(u) for u in range(live, n))
        for first, count in [*spans, (live, victims)]:
            children.append(_Child(role_members, _args_for(args, endpoint, first, count,
                                                           victim_uids)))
        for c in children:
            c.ask()
        cpu0, t_go = _cpu_seconds(etcd_pid), time.monotonic()
        for c in children:
            c.send({"cmd": "go"})
        readies = [c.ask() for c in children]
        met = [t for r in readies for t in r["met"]]
        ready = [t for r in readies for t in r["ready"]]
        errors = [e for r in readies for e in r["errors"]]
        result["rendezvous_s"] = round(max(met) - t_go, 2) if len(met) == n else None
        result["wills_held_s"] = round(max(ready) - t_go, 2) if len(ready) == n else None
        watching = [r["watching"] for r in readies]
        result["watching_s"] = (round(max(watching) - t_go, 2) if None not in watching
                                else None)
        result["rendezvous_done"] = len(met)
        result["setup_etcd_cpu_s"] = round(_cpu_seconds(etcd_pid) - cpu0, 2)
        if errors:
            result["errors"] = errors[:5]
        if len(ready) < n or None in watching:
            return result
        # steady state: renewals and idle watchers; a probe times etcd gets
        probe = _open(_args_for(args, endpoint, 0, 0, ""))
        probe.set("plugdist/sim/probe", b"x")
        time.sleep(min(2.0, args.steady))
        cpu0, t0 = _cpu_seconds(etcd_pid), time.monotonic()
        lat = []
        while time.monotonic() - t0 < args.steady:
            p0 = time.perf_counter()
            probe.get("plugdist/sim/probe")
            lat.append((time.perf_counter() - p0) * 1000)
            time.sleep(1.0 / args.probe_rate)
        cpu = (_cpu_seconds(etcd_pid) - cpu0) / (time.monotonic() - t0)
        stats = [c.ask({"cmd": "stats"}) for c in children]
        result["steady_etcd_cpu_pct"] = round(100 * cpu, 1)
        result["renewals_per_s"] = round(-(-n // args.per_node) / (args.ttl / 4))
        result["leases_lapsed"] = sum(s["lapsed"] for s in stats)
        result["probe_ms_p50"] = round(statistics.median(lat), 2)
        result["probe_ms_p99"] = round(_pct(lat, 0.99), 2)
        # a node dies
        node = children.pop()
        cpu0 = _cpu_seconds(etcd_pid)
        t_kill = time.monotonic()
        os.kill(node.pid, signal.SIGKILL)
        node.wait()
        probe.wait([f"{DEATHS}/1"], timedelta(seconds=args.ttl + args.timeout))
        t_first = time.monotonic()  # the first will ran (within a probe's round trip)
        replies = [c.ask({"cmd": "knew"}) for c in children]
        result["death_etcd_cpu_s"] = round(_cpu_seconds(etcd_pid) - cpu0, 2)
        knew = [t for r in replies for t in r["knew"]]
        errors += [e for r in replies for e in r["errors"]]
        result["first_will_ran_s"] = round(t_first - t_kill, 2)
        result["wills_run"] = sum(r["executed"] for r in replies)
        result["death_known_by"] = len(knew)
        if len(knew) == live:
            result["death_known_s_p50"] = round(_pct([t - t_kill for t in knew], 0.5), 2)
            result["death_known_s_p99"] = round(_pct([t - t_kill for t in knew], 0.99), 2)
            result["fan_out_s_p50"] = round(max(0.0, _pct(knew, 0.5) - t_first), 3)
            result["fan_out_s_p99"] = round(max(0.0, _pct(knew, 0.99) - t_first), 3)
        result["leases_lapsed"] += sum(r["lapsed"] for r in replies)
        if errors:
            result["errors"] = sorted(set(errors))[:5]
        probe.close()
        return result
    finally:
        shut_down(children, server)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--members", type=int, nargs="*", default=None,
                   help="world sizes (default 256 512 1024)")
    p.add_argument("--victims", type=int, default=8, help="members of the node that is killed")
    p.add_argument("--procs", type=int, default=0,
                   help="processes of members (default: one per 512 members, >= 2)")
    p.add_argument("--ttl", type=float, default=10.0,
                   help="seconds of each member's lease (the store URL's live_ttl)")
    p.add_argument("--per-node", type=int, default=1,
                   help="members that share one lease, as the workers of a node do under "
                        "plugdist-run (its agent renews it); 1: a lease per member")
    p.add_argument("--per-stream", type=int, default=8,
                   help="watchers carried by one watch stream (one HTTP connection)")
    p.add_argument("--renewers", type=int, default=4, help="renewal threads per process")
    p.add_argument("--steady", type=float, default=10.0, help="seconds of steady state measured")
    p.add_argument("--probe-rate", type=float, default=100.0, help="probe gets a second")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any phase may take")
    p.add_argument("--concurrency", type=int, default=16,
                   help="requests of one process's members in flight at once")
    p.add_argument("--member-nice", type=int, default=5,
                   help="niceness the member processes add to their own (etcd keeps its)")
    p.add_argument("--json", action="store_true", help="print one JSON line per world")
    args = p.parse_args()
    for n in args.members or [256, 512, 1024]:
        one = argparse.Namespace(**vars(args))
        one.members = n
        one.procs = args.procs or max(2, -(-n // 512))
        row = simulate(one)
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()),
              flush=True)


if __name__ == "__main__":
    main()
