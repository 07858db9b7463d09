"""Wills on etcd (``EtcdStore.hold_will``): liveness through one etcd lease per holder.

A will is two keys under the job's prefix ``P``: its record ``P w/<id>`` (what to append to
which log; the job's lease) and its liveness key ``P l/<id>``, put with a lease of the holder's
own that a thread renews every quarter of its TTL. When the holder dies, or stops running (a
SIGSTOP, a thread that holds the GIL), for a TTL, etcd revokes the lease and deletes the
liveness key. Under ``plugdist-run`` the holder's lease is its node's instead, kept by the agent
(:mod:`plugdist_etcd.node`): the holder renews to the agent, which deletes the liveness key.

The holders form a ring, ordered by will id: each watches the liveness keys after its own up
to its successor's, and executes the will of a holder that goes there
(:meth:`EtcdStore._execute_will`: one guarded transaction, so it runs once even if two
holders try). A death therefore wakes one watcher, not every holder, and a holder's cost
does not grow with the world. When its watched span changes (its successor died, a new
holder came between), or every ``_WATCH_SPAN`` seconds, a holder looks up its successor again
(:meth:`EtcdStore._successor`: ascending ranges only, which etcd serves without reading the
ring) and sweeps its span for wills whose holders died unwatched (two neighbours dying
together, a holder that died before its predecessor started watching). If a holder's
predecessor is stopped too, its will runs when the predecessor's own lease ends: within two
TTLs.

Nobody runs the will of the last holder standing: there is no one left to read its log.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Protocol

from plugdist.backend import get_logger
from plugdist.errors import DistError

from .client import EtcdClient, b64, prefix_end, unb64
from .lease import Lease
from .node import LocalRenewal, node_lease_from_env

__all__ = ["EtcdWill"]


class _WillStore(Protocol):
    """What a will needs of ``EtcdStore`` (named here so this module need not import it: the
    store module builds on this one)."""

    _client: EtcdClient
    _p: bytes
    live_ttl: float

    @property
    def timeout(self) -> timedelta: ...
    def clone(self) -> _WillStore: ...
    def close(self) -> None: ...
    def _will_keys(self, wid: bytes) -> tuple[bytes, bytes]: ...
    def _put_will(self, wid: bytes, key: str, value: bytes, lease: int) -> None: ...
    def _withdraw_will(self, wid: bytes) -> None: ...
    def _successor(self, wid: bytes) -> tuple[bytes | None, int]: ...
    def _orphans_between(self, low: bytes, high: bytes) -> list[bytes]: ...
    def _execute_will(self, wid: bytes) -> bool: ...
    def read_log(self, key: str, start: int, timeout: timedelta | None = None) -> list[bytes]: ...

_WATCH_SPAN = 30.0   # seconds one watch stays open before the watcher looks and watches again
_EXPIRY_CHECK = 0.5  # etcd looks for expired leases this often


class EtcdWill:
    """A will held with an etcd store (see :meth:`EtcdStore.hold_will`).

    ``liveness_timeout``: at most this many seconds pass between the holder's last renewal
    (its death, or the start of a stall) and the lease's expiry; the will then runs within a
    round trip or two. Because a stalled holder stops renewing too, this covers hangs of the
    whole process as well as deaths (``plugdist._resilience`` then writes no heartbeats).
    ``cancel()`` withdraws it (a clean exit); idempotent, blocks for up to two round trips.
    """

    def __init__(self, store: _WillStore, key: str, value: bytes,
                 ttl: float | None = None) -> None:
        # a handle of its own: the will outlives whatever the caller does with its store
        self._store = store.clone()
        self.key = key
        self.id = os.urandom(8).hex().encode()
        client = self._store._client
        deadline = min(10.0, store.timeout.total_seconds())
        try:
            live_ttl = store.live_ttl if ttl is None else min(ttl, store.live_ttl)
            node = node_lease_from_env(client, time.monotonic() + deadline)
            self._lease: Lease | LocalRenewal
            if node is not None:  # plugdist-run's agent keeps it (see plugdist_etcd.node)
                self._lease = LocalRenewal(node, self.id, live_ttl)
                self._lease.write(self._store._will_keys(self.id)[1])
            else:
                self._lease = Lease(client, live_ttl, period=max(live_ttl / 4, 0.1),
                                    grant_timeout=deadline)
            self._store._put_will(self.id, key, value, self._lease.id)
        except BaseException:
            if isinstance(getattr(self, "_lease", None), LocalRenewal):
                self._lease.revoke()
            self._store.close()
            raise
        self.liveness_timeout = float(self._lease.ttl) + _EXPIRY_CHECK
        self.death_timeout = self.liveness_timeout  # a death, too, is seen when the lease ends
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._log = get_logger(store="etcd")
        self._lease.start()
        self._watcher = threading.Thread(target=self._watch, name=f"etcd-will-{self.id.decode()}",
                                         daemon=True)
        self._watcher.start()

    def __repr__(self) -> str:
        return (f"EtcdWill({self.key!r}, lease ttl={self._lease.ttl}s, "
                f"{'cancelled' if self._stop.is_set() else 'held'})")

    def cancel(self) -> None:
        """Withdraw the will (its record and liveness key go in one transaction), then end the
        lease. If etcd cannot be reached the will stays, and runs when the lease expires."""
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
        try:
            self._store._withdraw_will(self.id)
        except DistError as err:
            self._log.warning("will_not_withdrawn", key=self.key, error=str(err)[-200:])
            self._lease.stop()  # etcd is out of reach: do not wait for it a second time
        else:
            self._lease.revoke()
        # the watcher ends with its current watch (daemon: it never keeps the process alive)
        self._store.close()

    def read_log(self, start: int, wait: float) -> list[bytes]:
        """The entries of the will's log ``key`` from ``start`` (see ``Store.read_log``),
        waiting up to ``wait`` seconds for the first (DistTimeoutError after that). Meant for
        one reader thread, parked here: ``cancel()`` ends its wait at once (a DistStoreError:
        the will's handle is closed)."""
        return self._store.read_log(self.key, start, timedelta(seconds=wait))

    # -- the watcher: runs the wills of the holders before this one in the ring --------------
    def _watch(self) -> None:
        store = self._store
        live = store._p + b"l/"
        me = self.id
        while not self._stop.is_set():
            try:
                succ, revision = store._successor(me)
                spans: list[tuple[bytes, bytes | None]]
                if succ is not None:  # the span (me, succ], around the end of the ring
                    for wid in store._orphans_between(me, succ):
                        self._run(wid)
                    spans = ([(me + b"\0", succ + b"\0")] if me < succ else
                             [(me + b"\0", None), (b"", succ + b"\0")])
                else:  # alone: wait for a holder to come
                    spans = [(b"", None)]
                creates = [{"key": b64(live + low),
                            "range_end": b64(live + high if high is not None else
                                             prefix_end(live)),
                            "start_revision": str(revision + 1)} for low, high in spans]
                for result in store._client.watch(creates, time.monotonic() + _WATCH_SPAN):
                    if self._stop.is_set():
                        return
                    events = result.get("events", [])
                    for event in events:
                        if event.get("type") == "DELETE":
                            self._run(unb64(event.get("kv", {}).get("key"))[len(live):])
                    if events or result.get("canceled"):
                        break  # the span changed: look again
            except DistError as err:
                if self._stop.is_set():
                    return
                self._log.info("will_watch_failed", error=str(err)[-200:])
                self._stop.wait(0.2)

    def _run(self, wid: bytes) -> None:
        if self._stop.is_set():
            return
        if self._store._execute_will(wid):
            self._log.info("will_executed", will=wid.decode(errors="replace"))
