"""How the launchers of a run find each other, round by round, over one plugdist TCPStore.

One launcher serves the store (static: node 0 at ``--master-addr:--master-port``; c10d: the
first that can bind ``--rdzv-endpoint``; one node: a free port on 127.0.0.1); the others are
its clients. The same store is the workers' agent store (``PLUGDIST_AGENT_STORE``).

A *round* is one life of the world. Keys, under ``plugdist/rdzv/<run id>/r<N>/``:

``joined`` (counter: join order), ``node/<i>`` (joiner i's description), ``closed`` (who is in,
the restart count; set once, by whichever member closes the round), ``master`` (rank 0's
host:port for the workers), ``outcome`` (why the round ended: ``failed``, ``membership``; set
once), ``failure`` (the first failed worker), ``hb/<node rank>`` (heartbeat counters),
``done/<node rank>``, ``exited`` (counter).

A round closes when MAX nodes joined, or MIN joined and ``last_call_timeout`` passed with no
new joiner. A node that joins a closed round is moved to the next one, and the running world,
if smaller than MAX, ends its round to admit it. Node ranks: a stated ``--node-rank`` is kept;
the rest fill the free ranks in the order of (host, launcher pid), stable across rounds.

Threading: one :class:`StoreRendezvous` is used by the agent's thread, plus its own heartbeat
thread. Every store operation is bounded by ``read_timeout``; losing the store raises
:class:`StoreLost`.
"""

from __future__ import annotations

import errno
import json
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from plugdist._launcher.config import LaunchConfig
from plugdist.errors import (
    DistError,
    DistNetworkError,
    DistTimeoutError,
    RendezvousError,
    RendezvousInterrupted,
    StoreLost,
)

__all__ = ["Assignment", "RendezvousError", "RendezvousInterrupted", "StoreLost",
           "StoreRendezvous", "free_port"]

_TICK = 0.05   # seconds between looks at a round that is not closed yet


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` (every interface by default) a moment ago, for a server to
    bind soon after; never the same twice in one process. Taken from below the kernel's
    ephemeral range where it can: a port from that range may meanwhile become the local port
    of any outgoing connection (a store client's, a Gloo pair's), and the server's bind then
    fails with "Address already in use"."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    candidates = list(range(max(1024, low - 16384), low))
    random.SystemRandom().shuffle(candidates)
    for port in candidates[:200]:
        if port in _handed_out:
            continue
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(family) as s:  # everything below the range is taken: any free port
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    _handed_out.add(port)
    return port


@dataclass(frozen=True)
class Assignment:
    """This node's place in one round of the world."""

    round: int
    node_rank: int
    nnodes: int
    rank_offset: int            # global rank of this node's local rank 0
    local_world_size: int
    world_size: int
    restart_count: int
    master_addr: str
    master_port: int
    agent_store: str            # host:port of the launchers' store, or its URL, for the workers
    hosts: tuple[str, ...]      # host name of each node rank

    def host_of(self, node_rank: int) -> str:
        return self.hosts[node_rank] if 0 <= node_rank < len(self.hosts) else "?"


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def _can_bind(host: str, port: int) -> bool:
    """Whether ``host`` is an address of this machine and ``port`` is free on it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(sockaddr)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EADDRNOTAVAIL, errno.EADDRINUSE, errno.EACCES):
                    raise
    return False


def _outgoing_addr(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family[0], socket.SOCK_DGRAM) as s:
            s.connect(family[4])
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


class StoreRendezvous:
    """Rounds of a run over the launchers' store; see the module docstring."""

    def __init__(self, cfg: LaunchConfig,
                 interrupted: Callable[[], bool] = lambda: False) -> None:
        self.cfg = cfg
        self._interrupted = interrupted
        self.opts = cfg.rdzv
        self.id = os.urandom(16).hex()
        self.host = socket.gethostname()
        self.multi = cfg.max_nodes > 1
        self.hosting = False
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._seen: dict[int, tuple[int, float]] = {}
        self._last_joiner_check = 0.0
        self._left: set[int] = set()
        self.store_url = ""   # set when a store plugin serves the rendezvous
        self.store = self._open_store()
        from plugdist.store._worldkeys import rdzv_root  # the store is imported by now

        self.prefix = rdzv_root(cfg.run_id)
        if cfg.local_addr:
            self.addr = cfg.local_addr
        elif self.store_host in ("127.0.0.1", "localhost", "::1"):
            self.addr = "127.0.0.1" if self.store_host != "::1" else "::1"
        else:
            self.addr = _outgoing_addr(self.store_host, self.store_port)

    # -- the store ----------------------------------------------------------------------------
    def _open_store(self) -> Any:
        from plugdist.store import TCPStore  # deferred: plugdist.store costs ~0.1 s to import
        cfg = self.cfg
        timeout = self.opts.read_timeout
        if cfg.rdzv_backend not in ("static", "c10d"):
            return self._open_store_url()
        if cfg.rdzv_backend == "c10d":
            host, port = _split_endpoint(cfg.rdzv_endpoint)
            serve = port == 0 or _can_bind(host, port)
        else:
            host = cfg.master_addr or "127.0.0.1"
            port = cfg.master_port or 0
            serve = cfg.node_rank == 0
        self.store_host = host
        if serve:
            try:
                host = host if port else "127.0.0.1"
                # one node reached over loopback: nothing off this host needs the store
                local_only = cfg.max_nodes == 1 and host in ("127.0.0.1", "localhost")
                store = TCPStore(host, port, None, is_master=True, timeout=timeout,
                                 wait_for_workers=False,
                                 bind_host="127.0.0.1" if local_only else None)
            except DistError as exc:
                if cfg.rdzv_backend != "c10d":
                    # Another launcher serving it (one that also states node rank 0: the
                    # rendezvous names the conflict), or some other program (a busy port)?
                    try:
                        store = TCPStore(host, port, None, is_master=False,
                                         timeout=timedelta(seconds=2))
                    except DistError:
                        raise RendezvousError(
                            f"could not serve the rendezvous store on port {port}: {exc}; the "
                            f"port is in use: pick a free --master-port (or use --standalone)"
                        ) from exc
                    store.set_timeout(timeout)
                    self.store_port = port
                    return store
                # c10d: another launcher won the race to bind it; be its client
            else:
                self.hosting = True
                self.store_port = int(store.port)
                return store
        join = self.opts.join_timeout
        deadline = time.monotonic() + join.total_seconds()
        while True:   # short tries, so a signal to the launcher is not left waiting
            self._check_interrupted()
            left = deadline - time.monotonic()
            try:
                store = TCPStore(host, port, None, is_master=False,
                                 timeout=timedelta(seconds=max(min(left, 1.0), 0.01)))
                break
            except DistNetworkError as exc:
                if time.monotonic() < deadline:
                    continue
                raise RendezvousError(
                    f"could not reach the rendezvous store at {host}:{port} within "
                    f"{join.total_seconds():.0f}s ({exc}); is the launcher of node 0 (static) "
                    f"or of the endpoint's host (c10d) running, and is the address "
                    f"right?") from exc
            except DistError as exc:
                raise RendezvousError(f"{host}:{port} does not answer as a rendezvous store "
                                      f"({exc}); is another program using that port?") from exc
        store.set_timeout(timeout)
        self.store_port = port
        return store

    def _open_store_url(self) -> Any:
        """``--rdzv-backend SCHEME``: the store that the scheme's plugin opens at
        ``SCHEME://ENDPOINT/plugdist/RUN_ID``; no launcher hosts it."""
        from plugdist._open_store import open_store
        cfg = self.cfg
        self.store_url = f"{cfg.rdzv_backend}://{cfg.rdzv_endpoint}/plugdist/{cfg.run_id}"
        self.store_host, self.store_port = cfg.rdzv_endpoint, 0
        deadline = time.monotonic() + self.opts.join_timeout.total_seconds()
        while True:
            self._check_interrupted()
            left = deadline - time.monotonic()
            try:
                store = open_store(self.store_url, timedelta(seconds=max(min(left, 2.0), 0.01)))
                store.set_timeout(self.opts.read_timeout)
                return store
            except DistNetworkError as exc:
                if time.monotonic() >= deadline:
                    raise RendezvousError(
                        f"could not reach the {cfg.rdzv_backend} store at {cfg.rdzv_endpoint} "
                        f"within {self.opts.join_timeout.total_seconds():.0f}s ({exc})") from exc

    def _check_interrupted(self) -> None:
        if self._interrupted():
            raise RendezvousInterrupted("interrupted by a signal while waiting for the other "
                                        "nodes")

    @property
    def endpoint(self) -> str:
        if self.store_url:
            return self.store_host
        return f"{self.store_host}:{self.store_port}"

    def _k(self, rnd: int, key: str) -> str:
        return f"{self.prefix}r{rnd}/{key}"

    def _op(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except DistNetworkError as exc:
            raise StoreLost(f"lost the rendezvous store at {self.endpoint} ({exc}); the "
                            f"launcher serving it has exited or its host is unreachable") from exc

    def close(self, count: int = 0, rnd: int = -1) -> None:
        """Leave round ``rnd`` of ``count`` nodes (see :meth:`_leave`) and close the store."""
        self.stop_heartbeat()
        self._leave(count, rnd)
        self.store.close()

    def _leave(self, count: int, rnd: int) -> None:
        """Say this launcher is done with round ``rnd``. The host waits (bounded by
        ``close_timeout``) for all ``count`` to say so, so none loses the store while reading
        the round's last state. Once per round; never raises."""
        if rnd < 0 or count <= 1 or rnd in self._left:
            return
        self._left.add(rnd)
        try:
            n = self.store.add(self._k(rnd, "exited"), 1)
            if self.hosting and n < count:
                deadline = time.monotonic() + self.opts.close_timeout.total_seconds()
                while (self.store.add(self._k(rnd, "exited"), 0) < count
                       and time.monotonic() < deadline):
                    time.sleep(_TICK)
        except Exception:  # noqa: BLE001 - leaving; the store may already be gone
            pass

    # -- joining a round ----------------------------------------------------------------------
    def next_round(self, previous: Assignment | None) -> Assignment:
        """Join the next round and block until it closes with this node in it (bounded by
        ``join_timeout``). Raises RendezvousError on timeout or conflicting node ranks."""
        rnd = previous.round + 1 if previous is not None else self._first_open_round()
        deadline = time.monotonic() + self.opts.join_timeout.total_seconds()
        while True:
            got = self._join(rnd, deadline)
            if got is not None:
                return got
            rnd += 1   # the round closed without us: wait for the next one

    def _first_open_round(self) -> int:
        rnd = 0
        while self._op(self.store.check, [self._k(rnd, "closed")]):
            rnd += 1
        return rnd

    def _join(self, rnd: int, deadline: float) -> Assignment | None:
        cfg, store = self.cfg, self.store
        me = self._op(store.add, self._k(rnd, "joined"), 1) - 1
        desc = {"id": self.id, "host": self.host, "addr": self.addr, "pid": os.getpid(),
                "nproc": cfg.nproc_per_node, "node_rank": cfg.node_rank}
        self._op(store.set, self._k(rnd, f"node/{me}"), json.dumps(desc))
        closed_key = self._k(rnd, "closed")
        last_count, last_change = -1, time.monotonic()
        while not self._op(store.check, [closed_key]):
            self._check_interrupted()
            now = time.monotonic()
            joined = self._op(store.add, self._k(rnd, "joined"), 0)
            if joined != last_count:
                last_count, last_change = joined, now
            window = self.opts.last_call_timeout.total_seconds()
            if joined >= cfg.max_nodes or (joined >= cfg.min_nodes and now - last_change >= window):
                self._close(rnd, min(joined, cfg.max_nodes))
                break
            if now > deadline:
                raise RendezvousError(
                    f"rendezvous timed out after {self.opts.join_timeout.total_seconds():.0f}s "
                    f"(join_timeout): {joined} of at least {cfg.min_nodes} nodes joined round "
                    f"{rnd} at {self.endpoint} (run id {cfg.run_id!r}); start the other nodes "
                    f"with the same --rdzv-endpoint/--master-addr and --rdzv-id")
            try:
                self._op(store.wait, [closed_key], timedelta(seconds=_TICK))
            except DistTimeoutError:
                pass   # not closed yet: look again
        closed = json.loads(self._op(store.get, closed_key))
        count = int(closed["count"])
        if me >= count:
            return None
        return self._assign(rnd, me, count, int(closed["restart_count"]))

    def _close(self, rnd: int, count: int) -> None:
        restart_count = 0
        if rnd > 0 and self._op(self.store.check, [self._k(rnd - 1, "closed")]):
            prev = json.loads(self._op(self.store.get, self._k(rnd - 1, "closed")))
            restart_count = int(prev["restart_count"])
            if self.outcome(rnd - 1).startswith("failed"):
                restart_count += 1
        value = json.dumps({"count": count, "restart_count": restart_count})
        self._op(self.store.compare_set, self._k(rnd, "closed"), "", value)

    def _assign(self, rnd: int, me: int, count: int, restart_count: int) -> Assignment:
        store = self.store
        keys = [self._k(rnd, f"node/{i}") for i in range(count)]
        self._op(store.wait, keys, self.opts.read_timeout)
        nodes = [json.loads(v) for v in self._op(store.multi_get, keys)]
        try:
            ranks = _node_ranks(nodes, count)
        except RendezvousError:
            self._leave(count, rnd)   # every node reads the conflict before the host goes
            raise
        order = sorted(range(count), key=lambda i: ranks[i])
        node_rank = ranks[me]
        offset = sum(nodes[i]["nproc"] for i in order[:node_rank])
        world = sum(n["nproc"] for n in nodes)
        master_key = self._k(rnd, "master")
        if node_rank == 0:
            addr = nodes[me]["addr"]
            port = free_port("" if addr not in ("127.0.0.1", "::1") else addr)
            self._op(store.set, master_key, f"{addr}:{port}")
        self._op(store.wait, [master_key], self.opts.read_timeout)
        master_addr, master_port = _split_endpoint(self._op(store.get, master_key).decode())
        hosts = tuple(nodes[i]["host"] for i in order)
        agent_store = self.store_url or (
            self.endpoint if self.store_host not in ("", "0.0.0.0") else
            f"127.0.0.1:{self.store_port}")
        a = Assignment(round=rnd, node_rank=node_rank, nnodes=count, rank_offset=offset,
                       local_world_size=self.cfg.nproc_per_node, world_size=world,
                       restart_count=restart_count, master_addr=master_addr,
                       master_port=master_port, agent_store=agent_store, hosts=hosts)
        if self.multi:
            self._start_heartbeat(a)
        return a

    # -- while a round runs --------------------------------------------------------------------
    def _start_heartbeat(self, a: Assignment) -> None:
        self.stop_heartbeat()
        self._hb_stop = stop = threading.Event()
        self._seen = {}
        key = self._k(a.round, f"hb/{a.node_rank}")
        interval = self.opts.keep_alive_interval.total_seconds()

        def beat() -> None:
            while True:
                try:
                    self.store.add(key, 1)
                except Exception:  # noqa: BLE001 - the agent's own calls report a lost store
                    return
                if stop.wait(interval):
                    return
        self._hb_thread = threading.Thread(target=beat, name="plugdist-run-heartbeat",
                                           daemon=True)
        self._hb_thread.start()

    def stop_heartbeat(self) -> None:
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
            self._hb_thread = None

    def outcome(self, rnd: int) -> str:
        """Why round ``rnd`` ended ('' while it runs)."""
        key = self._k(rnd, "outcome")
        if not self._op(self.store.check, [key]):
            return ""
        return str(self._op(self.store.get, key).decode())

    def end_round(self, a: Assignment, outcome: str) -> str:
        """Set the round's outcome unless another node did first; returns the one that holds."""
        held = self._op(self.store.compare_set, self._k(a.round, "outcome"), "", outcome)
        return str(held.decode() if isinstance(held, bytes) else held)

    def publish_failure(self, a: Assignment, failure: dict[str, Any]) -> None:
        self._op(self.store.compare_set, self._k(a.round, "failure"), "", json.dumps(failure))

    def first_failure(self, a: Assignment) -> dict[str, Any] | None:
        key = self._k(a.round, "failure")
        if not self._op(self.store.check, [key]):
            return None
        return dict(json.loads(self._op(self.store.get, key)))

    def mark_done(self, a: Assignment) -> None:
        self._op(self.store.set, self._k(a.round, f"done/{a.node_rank}"), "1")

    def all_done(self, a: Assignment) -> bool:
        return bool(self._op(self.store.check,
                             [self._k(a.round, f"done/{n}") for n in range(a.nnodes)]))

    def check(self, a: Assignment) -> str:
        """Multi-node health of the running round: '' when nothing changed, else the reason to
        end it (a node lost, or nodes waiting to join a world smaller than MAX)."""
        if not self.multi:
            return ""
        now = time.monotonic()
        interval = self.opts.keep_alive_interval.total_seconds()
        if now - self._last_joiner_check < interval:
            return ""
        self._last_joiner_check = now
        done = [self._op(self.store.check, [self._k(a.round, f"done/{n}")])
                for n in range(a.nnodes)]
        # a world in which some node already finished admits no one: that would run it again
        if a.nnodes < self.cfg.max_nodes and not any(done):
            waiting = self._op(self.store.add, self._k(a.round + 1, "joined"), 0)
            if waiting:
                return f"membership: {waiting} node(s) waiting to join"
        others = [n for n in range(a.nnodes) if n != a.node_rank]
        if not others:
            return ""
        done = [done[n] for n in others]
        hb_keys = [self._k(a.round, f"hb/{n}") for n in others]
        counts = [self._op(self.store.add, k, 0) for k in hb_keys]
        limit = interval * self.opts.keep_alive_max_attempt
        for n, is_done, count in zip(others, done, counts, strict=True):
            last = self._seen.get(n)
            if last is None or last[0] != count:
                self._seen[n] = (count, now)
            elif not is_done and now - last[1] > limit:
                return (f"membership: lost node {n} ({a.host_of(n)}): no heartbeat for "
                        f"{now - last[1]:.1f}s")
        return ""


def _node_ranks(nodes: list[dict[str, Any]], count: int) -> list[int]:
    """Node rank of each joiner: stated ranks kept, the rest in (host, pid) order."""
    stated: dict[int, int] = {}
    for i, n in enumerate(nodes):
        r = n.get("node_rank")
        if r is None:
            continue
        if r >= count:
            raise RendezvousError(f"node on {n['host']} (pid {n['pid']}) states --node-rank {r}, "
                                  f"but only {count} nodes formed the world (ranks 0..{count - 1})")
        if r in stated:
            other = nodes[stated[r]]
            raise RendezvousError(f"two nodes state --node-rank {r}: {other['host']} (pid "
                                  f"{other['pid']}) and {n['host']} (pid {n['pid']}); give each "
                                  f"node its own --node-rank, or drop --node-rank and use "
                                  f"--rdzv-backend c10d, which assigns them")
        stated[r] = i
    free = iter(r for r in range(count) if r not in stated)
    ranks = [-1] * count
    for r, i in stated.items():
        ranks[i] = r
    for i in sorted((i for i in range(count) if ranks[i] < 0),
                    key=lambda i: (nodes[i]["host"], nodes[i]["pid"], nodes[i]["id"])):
        ranks[i] = next(free)
    return ranks
