"""etcd leases kept alive by this process: the job lease that every key of a store is put with,
so an etcd that outlives the job does not keep its keys.

A :class:`Lease` is one lease and the thread that renews it (every third of its TTL, or a
``period`` of the caller's). The wills of :mod:`plugdist_etcd.will` use one short lease each:
their liveness key goes when the process dies and stops renewing it.
"""

from __future__ import annotations

import threading
import time

from plugdist.errors import DistStoreError

from .client import EtcdClient

__all__ = ["Lease", "acquire_shared", "release_shared", "renewed_here"]


class Lease:
    """The lease ``lease_id`` (granted here when None) with a renewing thread. ``lost`` turns
    true when etcd says the lease is gone (it expired: no renewal reached etcd for a TTL).

    ``ttl`` is what etcd granted when granted here: etcd raises a TTL below its minimum (1.5
    election timeouts, rounded up: 2 s with its defaults) to that minimum. ``period``: seconds
    between renewals (default a third of the TTL). Granting blocks for one round trip (up to
    ``grant_timeout`` seconds)."""

    def __init__(self, client: EtcdClient, ttl: float, lease_id: int | None = None, *,
                 period: float | None = None, grant_timeout: float = 30) -> None:
        self.client = client
        self.ttl = max(int(ttl), 1)
        if lease_id is None:
            data = client.call("lease/grant", {"TTL": self.ttl},
                               time.monotonic() + grant_timeout, "lease grant")
            lease_id = int(data["ID"])
            self.ttl = int(data.get("TTL") or self.ttl)
        self.id = lease_id
        self.period = period if period is not None else self.ttl / 3
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Lease:
        if self._thread is None:
            self._thread = threading.Thread(target=self._renew, name=f"etcd-lease-{self.id:x}",
                                            daemon=True)
            self._thread.start()
        return self

    def _renew(self) -> None:
        period = self.period
        while not self._stop.wait(period):
            try:
                data = self.client.call("lease/keepalive", {"ID": str(self.id)},
                                        time.monotonic() + period, "lease keepalive")
            except DistStoreError:  # a refusal, or no member answered (EtcdUnavailableError)
                continue  # the cluster is down or electing for now; the next beat tries again
            if int(data.get("result", {}).get("TTL", 0) or 0) <= 0:
                self.lost = True
                return

    def stop(self) -> None:
        """Stop renewing (the lease then expires after its TTL)."""
        self._stop.set()

    def revoke(self) -> None:
        """Stop renewing and end the lease now: etcd deletes every key put with it."""
        self.stop()
        try:
            self.client.call("lease/revoke", {"ID": str(self.id)}, time.monotonic() + 5,
                             "lease revoke")
        except DistStoreError:
            pass  # unreachable: the lease expires by itself


_SHARED: dict[tuple[tuple[str, ...], int], tuple[Lease, int]] = {}
_SHARED_LOCK = threading.Lock()


def renewed_here(client: EtcdClient, lease_id: int) -> bool:
    """Whether this process already renews ``lease_id`` on ``client``'s cluster (and etcd has
    not said it is gone): then it exists, and a new handle needs no request to learn that."""
    with _SHARED_LOCK:
        lease, _ = _SHARED.get((tuple(client.endpoints), lease_id), (None, 0))
        return lease is not None and not lease.lost


def acquire_shared(client: EtcdClient, ttl: float, lease_id: int) -> Lease:
    """One renewing :class:`Lease` per (cluster, lease) in this process, however many store
    handles use it; pair with :func:`release_shared`."""
    key = (tuple(client.endpoints), lease_id)
    with _SHARED_LOCK:
        lease, users = _SHARED.get(key, (None, 0))
        if lease is None:
            lease = Lease(client, ttl, lease_id).start()
        _SHARED[key] = (lease, users + 1)
        return lease


def release_shared(lease: Lease) -> None:
    key = (tuple(lease.client.endpoints), lease.id)
    with _SHARED_LOCK:
        _, users = _SHARED.get(key, (lease, 1))
        if users <= 1:
            _SHARED.pop(key, None)
            lease.stop()
        else:
            _SHARED[key] = (lease, users - 1)
