"""One etcd lease per node: ``plugdist-run``'s agent keeps the wills of its node's workers.

Without a keeper every will holder renews a lease of its own (:mod:`plugdist_etcd.will`): at
16,384 ranks with a 10 s TTL that is 6,554 renewals a second, more than etcd's share of a core
can serve. With one (:meth:`EtcdStore.keep_node_wills`, which the agent opens on its rendezvous
store), the agent holds one lease for the node and hands its id to the workers
(``PLUGDIST_ETCD_NODE_LEASE``); a worker's will puts its liveness key with that lease and renews
it locally instead, by touching a file of its own in the keeper's directory
(``PLUGDIST_ETCD_NODE_DIR``) every quarter of the will's TTL, from a thread, as it would renew a
lease (each touch sets a new mtime; the keeper times how long a file's mtime stays the same on
its own monotonic clock). The keeper looks at those files every ``_CHECK`` seconds and deletes
the liveness key of a worker whose process is gone (at once: no TTL to wait out) or whose file
has not been touched for the will's TTL (it is stopped, or a thread holds its GIL); the ring of
holders then executes the will as it does when a lease expires. When the whole node goes (the
agent with its workers), the node's lease expires and takes every liveness key put with it.

A file is ``<will id>.will``: JSON ``{"pid", "ttl", "key"}`` (``key``: the liveness key, base64),
written before the key is put, removed after the will is withdrawn.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from plugdist.backend import get_logger
from plugdist.errors import DistError

from .client import EtcdClient, b64, unb64
from .lease import Lease

__all__ = ["NodeKeeper", "LocalRenewal", "node_lease_from_env", "NODE_LEASE_VAR",
           "NODE_DIR_VAR"]

NODE_LEASE_VAR = "PLUGDIST_ETCD_NODE_LEASE"   # "<lease id>:<ttl seconds>"
NODE_DIR_VAR = "PLUGDIST_ETCD_NODE_DIR"
_CHECK = 0.2      # seconds between the keeper's looks at its workers' files
_SUFFIX = ".will"


class NodeKeeper:
    """The node's lease and the thread that watches its workers' wills (see the module doc).

    ``env``: the variables that give a worker's wills to this keeper. ``close()`` stops the
    thread, revokes the lease (the wills still held with it run: their holders ended with the
    agent's run) and closes ``client``, which the keeper owns. Threading: two daemon threads
    (the lease's renewal and the look at the files); ``close()`` from any thread, idempotent."""

    def __init__(self, client: EtcdClient, directory: str, ttl: float,
                 grant_timeout: float = 30) -> None:
        self._client = client
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.lease = Lease(client, ttl, period=max(ttl / 4, 0.1),
                           grant_timeout=grant_timeout).start()
        self.env = {NODE_LEASE_VAR: f"{self.lease.id}:{self.lease.ttl}",
                    NODE_DIR_VAR: directory}
        self.released = 0
        # path -> its will (pid, ttl, liveness key: written once), its mtime, and when that
        # mtime was first seen here (monotonic). Staleness is timed here, not from the mtime
        # itself, so a step of the wall clock releases nobody.
        self._seen: dict[str, tuple[tuple[int, float, bytes], float, float]] = {}
        self._stop = threading.Event()
        self._log = get_logger(store="etcd")
        self._thread = threading.Thread(target=self._keep, name=f"etcd-node-{self.lease.id:x}",
                                        daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"NodeKeeper({self.directory!r}, lease {self.lease.id:x} ttl={self.lease.ttl}s)"

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self.lease.revoke()
        self._client.close()

    def _keep(self) -> None:
        while not self._stop.wait(_CHECK):
            try:
                names = [n for n in os.listdir(self.directory) if n.endswith(_SUFFIX)]
            except OSError:
                continue
            paths = {os.path.join(self.directory, name) for name in names}
            for path in paths:
                self._look_at(path)
            for gone in self._seen.keys() - paths:
                del self._seen[gone]

    def _look_at(self, path: str) -> None:
        now = time.monotonic()
        try:
            mtime = os.stat(path).st_mtime
            if path in self._seen:
                will, last, since = self._seen[path]
            else:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
                will = (int(data["pid"]), float(data["ttl"]), unb64(data["key"]))
                last, since = None, now
        except (OSError, ValueError, KeyError, TypeError):
            return  # withdrawn just now, being replaced, or not a will's file: nothing to keep
        if mtime != last:
            since = now
        self._seen[path] = (will, mtime, since)
        pid, ttl, live = will
        if not _alive(pid):
            why = "its process is gone"
        elif now - since > ttl:
            why = f"it renewed nothing for {ttl:g}s (stopped, or its GIL held)"
        else:
            return
        try:
            self._client.call("kv/deleterange", {"key": b64(live)}, time.monotonic() + 5,
                              "release a worker's will")
        except DistError as err:
            self._log.warning("node_will_not_released", pid=pid, error=str(err)[-200:])
            return  # etcd out of reach: the next look tries again
        try:
            os.unlink(path)
        except OSError:
            pass
        self.released += 1
        self._log.info("node_will_released", pid=pid, why=why,
                       will=live.rsplit(b"/", 1)[-1].decode(errors="replace"))


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running (or stopped) process, not a zombie (Linux's /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] != b"Z"


def node_lease_from_env(client: EtcdClient, deadline: float) -> tuple[int, int, str] | None:
    """The keeper offered to this process (lease id, its TTL, directory), or None: no keeper,
    or its lease is not on ``client``'s cluster (a worker whose store is another etcd). One
    round trip when a keeper is named."""
    spec, directory = os.environ.get(NODE_LEASE_VAR), os.environ.get(NODE_DIR_VAR)
    if not spec or not directory or not os.path.isdir(directory):
        return None
    try:
        lease_id, ttl = (int(part) for part in spec.split(":", 1))
        data: dict[str, Any] = client.call("lease/timetolive", {"ID": str(lease_id)}, deadline,
                                           "look up the node's lease")
    except (ValueError, DistError):
        return None
    if int(data.get("TTL", -1) or -1) <= 0:
        return None  # not granted on this cluster, or already gone
    return lease_id, ttl, directory


class LocalRenewal:
    """A will's renewal to its node's keeper: the duck type of :class:`Lease` that
    :class:`~plugdist_etcd.will.EtcdWill` uses (``id``: the node's lease, ``ttl``: the longer of
    the will's and the node's). ``write(key)`` hands the keeper the liveness key before it is
    put; a thread then touches the file every ``period`` seconds."""

    def __init__(self, node: tuple[int, int, str], wid: bytes, ttl: float) -> None:
        lease_id, node_ttl, directory = node
        self.id = lease_id
        self.will_ttl = max(ttl, 1.0)
        self.ttl = max(int(self.will_ttl + 0.999), node_ttl)
        self.period = max(self.will_ttl / 4, 0.1)
        self.path = os.path.join(directory, wid.decode() + _SUFFIX)
        self._stop = threading.Event()

    def write(self, live_key: bytes) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), "ttl": self.will_ttl, "key": b64(live_key)}, f)
        os.replace(tmp, self.path)

    def start(self) -> LocalRenewal:
        threading.Thread(target=self._renew, name=f"etcd-node-will-{self.id:x}",
                         daemon=True).start()
        return self

    def _renew(self) -> None:
        beat = 0
        while not self._stop.wait(self.period):
            # the mtime carries a count, not the time: each renewal changes it, whatever the
            # file system's time granularity (2 s steps, so FAT's too) or the clock does
            beat += 2
            try:
                os.utime(self.path, (beat, beat))
            except OSError:
                return  # the keeper released it (this process was taken for stalled)

    def stop(self) -> None:
        """Stop renewing: the keeper releases the will after its TTL."""
        self._stop.set()

    def revoke(self) -> None:
        """Stop renewing and hand nothing more to the keeper (the will was withdrawn)."""
        self.stop()
        try:
            os.unlink(self.path)
        except OSError:
            pass
