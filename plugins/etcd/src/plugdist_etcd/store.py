"""``EtcdStore``: plugdist's Store on an etcd cluster (v3 API), so no process of the job hosts it.

Layout under the job's prefix ``P`` (``/<prefix>/``): ``P k/<key>`` values; ``P a/<n>:<key>/<id>``
pending increments of a counter; ``P q/<n>:<key>/<id>`` queue items (``n`` = the key's length in
bytes, so one key's entries are never a prefix of another's); ``P m/<handle>/<slot>`` each
handle's last-write markers; ``P w/<id>`` and ``P l/<id>`` the wills (see
:mod:`plugdist_etcd.will`). Every key is put with the job's lease (see ``_job_lease``), but a
will's liveness key, which has its holder's own short lease.

Round trips: set, get, check, num_keys, delete_key, compare_set, multi_get/multi_set, queue_push,
queue_len: one each. ``add`` uncontended: one transaction guarded by the revision of the counter
this handle saw last. ``add`` under contention (several processes adding to one counter at
once, a rendezvous): a compare-and-swap loop would cost O(n^2) transactions, so a failed guard
switches to an unguarded transaction that puts the increment as its own key and reads the
counter and every pending increment in the same transaction: the sum is the value at that
revision, one round trip whatever the contention. Pending increments are folded into the
counter (one guarded transaction) once there are many. ``get`` sums them too.
``wait``/``get`` of a missing key: one watch from the revision of the check, never a poll.

Exactly once: a request that failed in transit may or may not have been applied, and the client
repeats it on another member. Every non-idempotent write (``add``, ``append``, ``queue_pop``) is
guarded (the key's revision, or the revision of this op's marker) so a repeat never applies
twice, and also writes a marker (request id, and the result where it is known) that a failed
guard reads back in the same round trip: if the marker holds this request's id, the first try
was applied.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from plugdist.backend import get_logger, is_loopback, to_bytes, to_seconds
from plugdist.errors import DistStoreError, DistTimeoutError, QueueEmptyError
from plugdist.store import DEFAULT_STORE_TIMEOUT, Store

from .client import EtcdClient, EtcdError, TLSConfig, b64, prefix_end, unb64
from .lease import Lease, acquire_shared, release_shared, renewed_here
from .node import NodeKeeper
from .will import EtcdWill

__all__ = ["EtcdStore"]

_WATCHERS_PER_STREAM = 16  # what etcd's JSON gateway creates reliably from one request
_LOG_BATCH = 16    # entries of a numbered log read in one transaction
_TXN_OPS = 64      # etcd refuses a transaction of more than 128 operations (its default)
_SEEN_MAX = 4096   # revisions remembered for add/append guards
_FOLD_AT = 16      # an add that sees a multiple of this many pending increments folds them
_ONES = b"1/"      # under a counter's increments: those of 1 (an add counts them, not reads them)
_OTHERS = b"x/"    # under a counter's increments: any other amount
# seconds: a will's liveness lease. etcd grants no less than 1.5 election timeouts rounded up
# (2 s with its defaults: heartbeat 100 ms, election 1000 ms) and revokes expired leases every
# 0.5 s, so with the defaults a dead holder's will runs 2-2.5 s after its last renewal
DEFAULT_LIVE_TTL = 2.0


def _put(key: bytes, value: bytes, lease: int) -> dict[str, Any]:
    req: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}


def _range(key: bytes, end: bytes | None = None, **kw: Any) -> dict[str, Any]:
    req: dict[str, Any] = {"key": b64(key), **kw}
    if end is not None:
        req["range_end"] = b64(end)
    return {"request_range": req}


def _delete(key: bytes, end: bytes | None = None) -> dict[str, Any]:
    req: dict[str, Any] = {"key": b64(key)}
    if end is not None:
        req["range_end"] = b64(end)
    return {"request_delete_range": req}


def _kvs(response: dict[str, Any]) -> list[dict[str, Any]]:
    return list(response.get("response_range", {}).get("kvs", []))


def _count(response: dict[str, Any]) -> int:
    return int(response.get("response_range", {}).get("count", 0) or 0)


def _sum(deltas: list[dict[str, Any]]) -> int:
    return sum(int(unb64(x.get("value"))) for x in deltas)


def _revision(data: dict[str, Any]) -> int:
    return int(data.get("header", {}).get("revision", 0) or 0)


class EtcdStore(Store):
    """A :class:`~plugdist.store.Store` on the etcd cluster at ``endpoints`` (``host:port``
    strings, or URLs ``http://...``/``https://...``), keys under ``prefix``.

    Every method is thread-safe and bounded by the store's timeout: if no endpoint answers in
    time it raises :class:`~plugdist_etcd.client.EtcdUnavailableError` (a ``DistStoreError``)
    naming the endpoints. ``ttl`` > 0 (seconds) puts every key with the job's etcd lease, which
    each process renews while it has a handle open: the keys go ``ttl`` seconds after the last
    process of the job; ``ttl=0`` keeps them until :meth:`delete_all`. ``user``/``password``:
    etcd's authentication; ``tls``: CA and client certificate (with ``https`` endpoints).
    ``live_ttl``: seconds of the lease behind each will (:meth:`hold_will`): a holder that
    stops renewing it for that long (it died, or stopped running) has its will executed.
    """

    def __init__(self, endpoints: str | Sequence[str], prefix: str = "plugdist",
                 timeout: timedelta = DEFAULT_STORE_TIMEOUT, *, ttl: float = 60,
                 live_ttl: float = DEFAULT_LIVE_TTL,
                 user: str | None = None, password: str | None = None,
                 tls: TLSConfig | None = None, _lease: Lease | None = None) -> None:
        super().__init__(timeout)
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e]
        scheme = "https" if tls is not None else "http"
        self.endpoints = [e if "://" in e else f"{scheme}://{e}" for e in endpoints]
        self.prefix = prefix.strip("/")
        self.ttl = ttl
        if live_ttl <= 0:
            raise ValueError(f"etcd store: live_ttl={live_ttl!r} must be a positive number of "
                             f"seconds")
        self.live_ttl = live_ttl
        self._config = dict(user=user, password=password, tls=tls)
        self._client = EtcdClient(self.endpoints, user=user, password=password, tls=tls,
                                  pool_size=16)
        self._p = f"/{self.prefix}/".encode() if self.prefix else b"/"
        self._handle = os.urandom(6).hex()
        self._ids = itertools.count()
        self._slots: list[list[int]] = []   # free [slot, revision of its marker]
        self._slot_count = 0
        self._lock = threading.Lock()
        # counter key -> (value, revision) last seen, or None: it had pending increments
        self._seen: OrderedDict[bytes, tuple[bytes, int] | None] = OrderedDict()
        self._closed = False
        self._lease: Lease | None = None
        if _lease is not None:
            self._lease = acquire_shared(_lease.client, _lease.ttl, _lease.id)
        elif ttl > 0:
            self._lease = self._job_lease()

    def __repr__(self) -> str:
        return f"EtcdStore({','.join(self.endpoints)}, prefix={self.prefix!r})"

    # -- keys ----------------------------------------------------------------------------------
    def _vkey(self, key: str) -> bytes:
        if not isinstance(key, str):
            raise TypeError(f"store keys must be str, got {type(key).__name__}")
        return self._p + b"k/" + key.encode()

    def _qkey(self, key: str) -> bytes:
        raw = self._vkey(key)[len(self._p) + 2:]
        return self._p + b"q/" + str(len(raw)).encode() + b":" + raw + b"/"

    def _dkey(self, key: str) -> bytes:
        raw = self._vkey(key)[len(self._p) + 2:]
        return self._p + b"a/" + str(len(raw)).encode() + b":" + raw + b"/"

    def _marker(self, slot: int) -> bytes:
        return self._p + b"m/" + self._handle.encode() + b"/" + str(slot).encode()

    def _keys(self, keys: Sequence[str]) -> list[str]:
        if isinstance(keys, (str, bytes)):
            raise TypeError(f"keys must be a list of str, not a single string; "
                            f"did you mean [{keys!r}]?")
        for k in keys:
            self._vkey(k)
        return list(keys)

    @property
    def _lease_id(self) -> int:
        return self._lease.id if self._lease is not None else 0

    # -- plumbing ------------------------------------------------------------------------------
    def _deadline(self) -> float:
        return time.monotonic() + to_seconds(self.timeout)

    def _call(self, path: str, body: dict[str, Any], what: str,
              deadline: float | None = None) -> dict[str, Any]:
        if self._closed:
            raise DistStoreError(f"etcd store on {self._client.describe()}: {what} on a closed "
                                 f"store; open a new one (or clone() before closing)")
        try:
            return self._client.call(path, body, deadline or self._deadline(), what)
        except EtcdError as err:
            if err.code == 5 and "lease" in str(err):
                raise DistStoreError(
                    f"etcd store on {self._client.describe()}: {what}: the job's etcd lease "
                    f"expired (no process renewed it for {self.ttl}s), and its keys are gone; "
                    f"restart the job, or use a longer ttl= in the store URL") from err
            raise

    def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: list[dict[str, Any]], what: str,
             deadline: float | None = None) -> dict[str, Any]:
        return self._call("kv/txn", {"compare": compare, "success": success,
                                     "failure": failure}, what, deadline)

    def _job_lease(self) -> Lease:
        """The job's lease, one per prefix: its id is derived from the prefix, so every process
        asks etcd for the same one in one request (the first creates it, the others are told it
        exists), with no record to agree on and no lease granted in vain; none at all when
        this process renews it already (another handle on the same prefix)."""
        lease_id = int.from_bytes(hashlib.blake2b(self._p, digest_size=8).digest(), "big")
        lease_id = (lease_id & ((1 << 62) - 1)) | 1   # positive int64, never 0 (etcd's "pick")
        if renewed_here(self._client, lease_id):
            return acquire_shared(self._client, self.ttl, lease_id)
        try:
            self._call("lease/grant", {"TTL": max(int(self.ttl), 1), "ID": str(lease_id)},
                       "open")
        except EtcdError as err:
            if "already exists" not in str(err):
                raise
        return acquire_shared(self._client, self.ttl, lease_id)

    # -- the core operations -------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        v = to_bytes(value)
        d = self._dkey(key)
        self._txn([], [_put(self._vkey(key), v, self._lease_id), _delete(d, prefix_end(d))], [],
                  f"set({key!r})")

    def get(self, key: str) -> bytes:
        return self.multi_get([key], op="get")[0]

    def _logical(self, value: list[dict[str, Any]], deltas: list[dict[str, Any]]) -> bytes:
        """A key's value: what ``set`` wrote, plus any pending increments."""
        raw = unb64(value[0].get("value")) if value else b""
        if not deltas:
            return raw
        try:
            base = int(raw or b"0")
        except ValueError:
            return raw  # increments left by an add that failed on this value; it removes them
        return str(base + sum(int(unb64(d.get("value"))) for d in deltas)).encode()

    def add(self, key: str, amount: int) -> int:
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise TypeError(f"add amount must be an int, got {type(amount).__name__}")
        if not -(2**63) <= amount < 2**63:  # as the core's stores (a signed 64-bit counter)
            raise TypeError(f"add amount must be a 64-bit signed int, from {-(2**63)} to "
                            f"{2**63 - 1}, got {amount}")

        def plus(current: bytes | None) -> bytes:
            try:
                return str(int(current or b"0") + amount).encode()
            except ValueError:
                raise DistStoreError(
                    f"etcd store: add({key!r}) met a value that is not an integer "
                    f"({(current or b'')[:32]!r}): the key was written by set(); use a "
                    f"separate key for counters") from None

        what = f"add({key!r})"
        vkey = self._vkey(key)
        with self._lock:
            seen = self._seen.get(vkey)
        if seen is not None:  # this handle knows the counter's revision: try the guarded write
            done = self._modify(key, plus, what, seen, fold=False)
            if isinstance(done, bytes):
                return int(done)
            plus(done[0])  # raises if the value is not an integer
        return self._add_increment(key, amount, plus, what)

    def _add_increment(self, key: str, amount: int, plus: Callable[[bytes | None], bytes],
                       what: str) -> int:
        """``add`` as its own increment key, summed with the counter in the same transaction.

        Increments of 1 (a rendezvous' arrivals) live under their own prefix, so the sum reads
        only their count: N concurrent adds then cost O(N) bytes in all, where reading every
        pending increment cost O(N) each."""
        vkey, d = self._vkey(key), self._dkey(key)
        ones, others = d + _ONES, d + _OTHERS
        slot = self._take_slot()
        marker = self._marker(slot[0])
        rid = f"{self._handle}.{next(self._ids)}".encode()
        inc = (ones if amount == 1 else others) + \
            f"{self._handle}/{slot[0]}/{next(self._ids)}".encode()
        deadline = self._deadline()
        try:
            while True:
                guard = {"key": b64(marker), "target": "MOD", "mod_revision": str(slot[1])}
                create = {"compare": [{"key": b64(vkey), "target": "CREATE",
                                       "create_revision": "0"}],
                          "success": [_put(vkey, b"0", self._lease_id)], "failure": []}
                counted = [_range(vkey), _range(ones, prefix_end(ones), count_only=True),
                           _range(others, prefix_end(others))]
                data = self._txn([guard], [_put(inc, str(amount).encode(), self._lease_id),
                                           {"request_txn": create},
                                           _put(marker, rid, self._lease_id), *counted],
                                 [_range(vkey), _range(d, prefix_end(d)), _range(marker)],
                                 what, deadline)
                responses = data.get("responses", [])
                if data.get("succeeded"):
                    slot[1] = _revision(data)
                    value, deltas = _kvs(responses[3]), _kvs(responses[5])
                    pending = _count(responses[4]) + len(deltas)
                    summed = _count(responses[4]) + _sum(deltas)
                else:
                    value, deltas = _kvs(responses[0]), _kvs(responses[1])
                    mark = _kvs(responses[2])
                    slot[1] = int(mark[0]["mod_revision"]) if mark else 0
                    if not (mark and unb64(mark[0].get("value")) == rid):
                        continue  # the marker moved for another reason: guard again
                    # our first try went through: the sum up to our increment's revision
                    ours = [x for x in deltas if unb64(x.get("key")) == inc]
                    mine = int(ours[0]["mod_revision"]) if ours else 1 << 62
                    deltas = [x for x in deltas if int(x["mod_revision"]) <= mine]
                    pending, summed = len(deltas), _sum(deltas)
                raw = unb64(value[0].get("value")) if value else b""
                try:
                    plus(raw)
                except DistStoreError:
                    self._txn([], [_delete(inc)], [], what, deadline)  # undo, then say why
                    raise
                self._remember(vkey, None, 0)
                if pending % _FOLD_AT == 0:  # about one adder in _FOLD_AT folds
                    folded = self._fold(vkey, value, self._oldest_increments(d, what, deadline),
                                        what, deadline, finished=inc)
                    if folded and folded[2] == pending:  # the counter is plain again
                        self._remember(vkey, folded[0], folded[1])
                return int(raw or b"0") + summed
        finally:
            self._give_slot(slot)

    def _oldest_increments(self, d: bytes, what: str, deadline: float) -> list[dict[str, Any]]:
        """Up to ``_TXN_OPS`` pending increments under ``d``, oldest first. A plain range, not
        a read-only transaction, which etcd before 3.5.5 may crash on if this client gives up
        (README: "Which etcd server")."""
        data = self._call("kv/range", {"key": b64(d), "range_end": b64(prefix_end(d)),
                                       "sort_order": "ASCEND", "sort_target": "MOD",
                                       "limit": _TXN_OPS}, what, deadline)
        return list(data.get("kvs", []))

    def _fold(self, vkey: bytes, value: list[dict[str, Any]], deltas: list[dict[str, Any]],
              what: str, deadline: float, force: bool = False,
              finished: bytes = b"") -> tuple[bytes, int, int] | None:
        """Add the oldest pending increments into the counter and delete them, in one
        transaction guarded by the counter's revision as read (losing that race is fine).

        Only increments whose add has finished are folded (its handle's marker moved on, or is
        gone), and only the oldest run of them: an add whose reply was lost then finds its own
        increment and every older one still countable, so its repeat returns the exact value.
        ``finished``: the caller's own increment, whose reply it holds. ``force`` folds them
        all (compare_set and append on a counter, which are rare).
        Returns (the counter's new value, its revision, how many were folded), or None."""
        if not value:
            return None
        deltas = sorted(deltas, key=lambda x: int(x["mod_revision"]))[:_TXN_OPS]
        if not force:
            owners = {self._owner(x) for x in deltas}
            ops = [_range(m) for m in owners]
            data = self._txn([], ops, [], what, deadline)
            moved = {}
            for m, r in zip(owners, data.get("responses", []), strict=True):
                found = _kvs(r)
                moved[m] = int(found[0]["mod_revision"]) if found else 1 << 62
            done = 0
            for x in deltas:
                if moved[self._owner(x)] <= int(x["mod_revision"]) and \
                        unb64(x.get("key")) != finished:
                    break
                done += 1
            deltas = deltas[:done]
        if not deltas:
            return None
        try:
            total = int(unb64(value[0].get("value")) or b"0") + sum(
                int(unb64(x.get("value"))) for x in deltas)
        except ValueError:
            return None
        data = self._txn([{"key": b64(vkey), "target": "MOD",
                           "mod_revision": value[0]["mod_revision"]}],
                         [_put(vkey, str(total).encode(), self._lease_id),
                          *({"request_delete_range": {"key": x["key"]}} for x in deltas)],
                         [], what, deadline)
        if not data.get("succeeded"):
            return None
        return str(total).encode(), _revision(data), len(deltas)

    def _owner(self, delta: dict[str, Any]) -> bytes:
        """The marker of the op that put increment ``delta`` (``<d><handle>/<slot>/<n>``)."""
        handle, slot, _ = unb64(delta.get("key")).rsplit(b"/", 3)[-3:]
        return self._p + b"m/" + handle + b"/" + slot

    def append(self, key: str, value: bytes | str) -> None:
        tail = to_bytes(value)
        with self._lock:
            seen = self._seen.get(self._vkey(key))
        self._modify(key, lambda current: (current or b"") + tail, f"append({key!r})", seen,
                     fold=True)

    def _modify(self, key: str, fn: Callable[[bytes | None], bytes], what: str,
                seen: tuple[bytes, int] | None, fold: bool) -> bytes | tuple[bytes, bool]:
        """Read-modify-write of ``key`` as one transaction guarded by the revision seen (None:
        absent) and by "no pending increments". Returns the new value. When the guard fails:
        with ``fold``, folds pending increments and tries again with what it read; without,
        returns the value read and True (``add`` then takes its contention-free path)."""
        vkey, d = self._vkey(key), self._dkey(key)
        slot = self._take_slot()
        marker = self._marker(slot[0])
        rid = f"{self._handle}.{next(self._ids)}".encode() + b"\n"
        deadline = self._deadline()
        no_deltas = {"key": b64(d), "range_end": b64(prefix_end(d)), "target": "CREATE",
                     "create_revision": "0"}
        try:
            while True:
                if seen is None:
                    guard = {"key": b64(vkey), "target": "CREATE", "create_revision": "0"}
                else:
                    guard = {"key": b64(vkey), "target": "MOD", "mod_revision": str(seen[1])}
                new = fn(seen[0] if seen is not None else None)
                data = self._txn([guard, no_deltas],
                                 [_put(vkey, new, self._lease_id),
                                  _put(marker, rid + new, self._lease_id)],
                                 [_range(vkey), _range(d, prefix_end(d)), _range(marker)],
                                 what, deadline)
                if data.get("succeeded"):
                    slot[1] = _revision(data)
                    self._remember(vkey, new, slot[1])
                    return new
                responses = data.get("responses", [])
                mark = _kvs(responses[2])
                slot[1] = int(mark[0]["mod_revision"]) if mark else 0
                if mark and unb64(mark[0].get("value")).startswith(rid):
                    return unb64(mark[0].get("value"))[len(rid):]  # our first try went through
                current, deltas = _kvs(responses[0]), _kvs(responses[1])
                if not fold:  # add: another writer came in between; see _add_increment
                    return (unb64(current[0].get("value")) if current else b""), True
                if deltas:
                    self._fold(vkey, current, deltas, what, deadline, force=True)
                    seen = None  # read again, whoever folded
                    continue
                seen = (unb64(current[0].get("value")), int(current[0]["mod_revision"])) \
                    if current else None
        finally:
            self._give_slot(slot)

    def _take_slot(self) -> list[int]:
        """A marker slot for one op: [slot number, revision of its marker (0: none yet)]."""
        with self._lock:
            if self._slots:
                return self._slots.pop()
            self._slot_count += 1
            return [self._slot_count - 1, 0]

    def _give_slot(self, slot: list[int]) -> None:
        with self._lock:
            self._slots.append(slot)

    def _remember(self, vkey: bytes, value: bytes | None, revision: int) -> None:
        with self._lock:
            self._seen[vkey] = None if value is None else (value, revision)
            self._seen.move_to_end(vkey)
            if len(self._seen) > _SEEN_MAX:
                self._seen.popitem(last=False)

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        expected, desired = to_bytes(expected_value), to_bytes(desired_value)
        vkey, d = self._vkey(key), self._dkey(key)
        what = f"compare_set({key!r})"
        put = _put(vkey, desired, self._lease_id)
        no_deltas = {"key": b64(d), "range_end": b64(prefix_end(d)), "target": "CREATE",
                     "create_revision": "0"}
        reads = [_range(vkey), _range(d, prefix_end(d))]
        deadline = self._deadline()
        while True:
            if expected == b"":  # a missing key counts as empty: absent, or present and empty
                inner = {"compare": [{"key": b64(vkey), "target": "VALUE", "value": ""},
                                     no_deltas], "success": [put], "failure": reads}
                data = self._txn([{"key": b64(vkey), "target": "CREATE",
                                   "create_revision": "0"}, no_deltas],
                                 [put], [{"request_txn": inner}], what, deadline)
                if data.get("succeeded"):
                    return desired
                data = data["responses"][0]["response_txn"]
            else:
                data = self._txn([{"key": b64(vkey), "target": "VALUE",
                                   "value": b64(expected)}, no_deltas], [put], reads, what,
                                 deadline)
            if data.get("succeeded"):
                return desired
            value, deltas = _kvs(data["responses"][0]), _kvs(data["responses"][1])
            current = self._logical(value, deltas)
            if deltas and current == expected and self._fold(vkey, value, deltas, what,
                                                             deadline, force=True) is not None:
                continue  # it matched once its increments were counted: try again
            return current if value else expected

    def _request_deadline(self, deadline: float) -> float:
        # a check inside a wait gets at least a moment, even when the wait's time is up
        return max(deadline, time.monotonic() + min(1.0, to_seconds(self.timeout)))

    def _missing(self, keys: list[str], what: str, deadline: float,
                 op: str) -> tuple[list[str], int]:
        """The keys not present now ("value", "queue" or "any"), and the revision seen."""
        missing: list[str] = []
        revision = 0
        for i in range(0, len(keys), _TXN_OPS // 2):
            chunk = keys[i:i + _TXN_OPS // 2]
            ops = []
            for k in chunk:
                if what in ("value", "any"):
                    ops.append(_range(self._vkey(k), count_only=True))
                if what in ("queue", "any"):
                    q = self._qkey(k)
                    ops.append(_range(q, prefix_end(q), count_only=True))
            data = self._txn([], ops, [], op, self._request_deadline(deadline))
            counts = [_count(r) for r in data.get("responses", [])]
            per = 2 if what == "any" else 1
            missing += [k for j, k in enumerate(chunk) if sum(counts[j * per:(j + 1) * per]) == 0]
            rev = _revision(data)
            revision = rev if not revision else min(revision, rev)
        return missing, revision

    def _watch_for(self, keys: list[str], what: str, revision: int, deadline: float, op: str,
                   limit: float) -> list[dict[str, Any]]:
        """Block until an event on ``keys`` after ``revision`` and return the events (the caller
        looks again, or takes what they carry), or ``[]`` when the watch ended without one; raise
        DistTimeoutError at ``deadline``."""
        if time.monotonic() >= deadline:
            raise DistTimeoutError(f"etcd store: {op} timeout after {limit:.3g}s; missing keys "
                                   f"{keys} (under prefix {self.prefix!r} on "
                                   f"{self._client.describe()})")
        creates: list[dict[str, Any]] = []
        for k in keys:
            if what in ("value", "any"):
                creates.append({"key": b64(self._vkey(k)), "start_revision": str(revision + 1)})
            if what in ("queue", "any"):
                q = self._qkey(k)
                creates.append({"key": b64(q), "range_end": b64(prefix_end(q)),
                                "start_revision": str(revision + 1)})
        # etcd's JSON gateway may drop the tail of a stream's create requests (the client then
        # ends the stream: "canceled"); the caller waits for every key, so being woken by the
        # first few missing ones is enough
        for result in self._client.watch(creates[:_WATCHERS_PER_STREAM], deadline):
            events: list[dict[str, Any]] = result.get("events") or []
            if events or result.get("canceled"):
                return events
        return []

    def _await(self, keys: list[str], timeout: timedelta | None, op: str, what: str) -> None:
        limit = to_seconds(timeout if timeout is not None else self.timeout)
        deadline = time.monotonic() + limit
        while True:
            missing, revision = self._missing(keys, what, deadline, op)
            if not missing:
                return
            self._watch_for(missing, what, revision, deadline, op, limit)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        ks = self._keys(keys)
        if ks:
            self._await(ks, timeout, "wait", "any")

    def read_log(self, key: str, start: int, timeout: timedelta | None = None) -> list[bytes]:
        """The numbered log's entries from ``start`` up to the first missing one (see
        ``Store.read_log``): one transaction reads up to ``_LOG_BATCH`` of them. When the first
        is missing, one watch waits for it, up to ``timeout`` (DistTimeoutError), and the entry
        its event carries is returned alone, with no second read (when a death wakes thousands
        of members, that read was each member's second request); the next call reads on."""
        limit = to_seconds(timeout if timeout is not None else self.timeout)
        deadline = time.monotonic() + limit
        first = f"{key}/{start}"
        wanted = b64(self._vkey(first))
        entries: list[bytes] = []
        while True:
            n = start + len(entries)
            data = self._txn([], [_range(self._vkey(f"{key}/{i}"))
                                  for i in range(n, n + _LOG_BATCH)], [],
                             f"read_log({key!r})", self._request_deadline(deadline))
            for response in data.get("responses", []):
                kvs = _kvs(response)
                if not kvs:
                    break
                entries.append(unb64(kvs[0].get("value")))
            else:
                continue  # the whole batch was there: read on
            if entries:
                return entries
            for event in self._watch_for([first], "value", _revision(data), deadline,
                                         "read_log", limit):
                kv = event.get("kv") or {}
                if event.get("type", "PUT") == "PUT" and kv.get("key") == wanted:
                    return [unb64(kv.get("value"))]

    def check(self, keys: Sequence[str]) -> bool:
        ks = self._keys(keys)
        if not ks:
            return True
        return not self._missing(ks, "any", self._deadline(), "check")[0]

    def num_keys(self) -> int:
        start = self._p + b"k/"
        data = self._call("kv/range", {"key": b64(start), "range_end": b64(prefix_end(start)),
                                       "count_only": True}, "num_keys")
        return int(data.get("count", 0) or 0)

    def delete_key(self, key: str) -> bool:
        vkey, q = self._vkey(key), self._qkey(key)
        with self._lock:
            self._seen.pop(vkey, None)
        d = self._dkey(key)
        data = self._txn([], [_delete(vkey), _delete(q, prefix_end(q)),
                              _delete(d, prefix_end(d))], [], f"delete_key({key!r})")
        return any(int(r.get("response_delete_range", {}).get("deleted", 0) or 0)
                   for r in data.get("responses", []))

    # -- the extended operations ---------------------------------------------------------------
    def has_extended_api(self) -> bool:
        return True

    def multi_get(self, keys: Sequence[str], op: str = "multi_get") -> list[bytes]:
        ks = self._keys(keys)
        limit = to_seconds(self.timeout)
        deadline = time.monotonic() + limit
        while True:
            values: dict[str, bytes] = {}
            revision = 0
            for i in range(0, len(ks), _TXN_OPS // 2):
                chunk = ks[i:i + _TXN_OPS // 2]
                reads = []
                for k in chunk:
                    d = self._dkey(k)
                    reads += [_range(self._vkey(k)), _range(d, prefix_end(d))]
                data = self._txn([], reads, [], op if op == "multi_get" else f"{op}({ks[0]!r})",
                                 self._request_deadline(deadline))
                responses = data.get("responses", [])
                for j, k in enumerate(chunk):
                    value, deltas = _kvs(responses[2 * j]), _kvs(responses[2 * j + 1])
                    if value:
                        values[k] = self._logical(value, deltas)
                rev = _revision(data)
                revision = rev if not revision else min(revision, rev)
            missing = [k for k in ks if k not in values]
            if not missing:
                return [values[k] for k in ks]
            self._watch_for(missing, "value", revision, deadline, op, limit)

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        ks = self._keys(keys)
        if len(ks) != len(values):
            raise ValueError(f"multi_set got {len(ks)} keys but {len(values)} values")
        vs = [to_bytes(v) for v in values]
        step = _TXN_OPS // 2
        for i in range(0, len(ks), step):
            ops = []
            for k, v in zip(ks[i:i + step], vs[i:i + step], strict=True):
                d = self._dkey(k)
                ops += [_put(self._vkey(k), v, self._lease_id), _delete(d, prefix_end(d))]
            self._txn([], ops, [], "multi_set")

    def queue_push(self, key: str, value: bytes | str) -> None:
        item = self._qkey(key) + os.urandom(8).hex().encode()
        self._call("kv/put", _put(item, to_bytes(value), self._lease_id)["request_put"],
                   f"queue_push({key!r})")

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        q = self._qkey(key)
        what = f"queue_pop({key!r})"
        limit = to_seconds(self.timeout)
        deadline = time.monotonic() + limit
        slot = self._take_slot()
        marker = self._marker(slot[0])
        try:
            while True:
                data = self._call("kv/range", {"key": b64(q), "range_end": b64(prefix_end(q)),
                                               "sort_order": "ASCEND", "sort_target": "CREATE",
                                               "limit": 1}, what,
                                  self._request_deadline(deadline))
                found = data.get("kvs", [])
                if not found:
                    if not block:
                        raise QueueEmptyError(f"etcd store: queue_pop({key!r}, block=False): "
                                              f"the queue is empty")
                    self._watch_for([key], "queue", _revision(data), deadline, "queue_pop",
                                    limit)
                    continue
                item = found[0]
                value = unb64(item.get("value"))
                rid = f"{self._handle}.{next(self._ids)}".encode() + b"\n"
                got = self._txn([{"key": item["key"], "target": "MOD",
                                  "mod_revision": item["mod_revision"]}],
                                [{"request_delete_range": {"key": item["key"]}},
                                 _put(marker, rid + value, self._lease_id)],
                                [_range(marker)], what, self._request_deadline(deadline))
                if got.get("succeeded"):
                    slot[1] = _revision(got)
                    return value
                mark = _kvs(got["responses"][0]) if got.get("responses") else []
                slot[1] = int(mark[0]["mod_revision"]) if mark else 0
                if mark and unb64(mark[0].get("value")).startswith(rid):
                    return value  # our first try took it
        finally:
            self._give_slot(slot)

    def queue_len(self, key: str) -> int:
        q = self._qkey(key)
        data = self._call("kv/range", {"key": b64(q), "range_end": b64(prefix_end(q)),
                                       "count_only": True}, f"queue_len({key!r})")
        return int(data.get("count", 0) or 0)

    def clone(self) -> EtcdStore:
        return EtcdStore(self.endpoints, self.prefix, self.timeout, ttl=self.ttl,
                         live_ttl=self.live_ttl, _lease=self._lease,
                         **self._config)  # type: ignore[arg-type]

    # -- liveness ------------------------------------------------------------------------------
    def membership_exposure(self) -> str | None:
        """Why a world's membership here is open to whoever reaches etcd: it holds them as plain
        keys, so an etcd reached beyond loopback with neither a user nor a client certificate
        lets any such process forge them. None with authentication, or on loopback."""
        tls = self._config["tls"]
        if self._config["user"] or (tls is not None and getattr(tls, "cert_file", None)):
            return None
        remote = [e for e in self.endpoints if not is_loopback(urlsplit(e).hostname or "")]
        if not remote:
            return None
        return (f"the etcd store at {','.join(remote)} is used without authentication (no user, "
                f"no client certificate) and keeps the world's membership as plain keys, which "
                f"any process that reaches etcd could forge; authenticate (etcd://USER@..., "
                f"ETCDCTL_USER, or cert=/key= with --client-cert-auth)")

    def hold_will(self, key: str, value: bytes | str, ttl: float | None = None) -> EtcdWill:
        """Leave a will (see :meth:`plugdist.store.Store.hold_will`) backed by an etcd lease of
        ``live_ttl`` seconds (or ``ttl``, when shorter) that a thread of this process renews:
        once the process dies (or stops running) for that long, etcd deletes the will's
        liveness key, and the other processes holding wills on this prefix see it and execute
        the will, exactly once between them. The returned will's ``liveness_timeout`` says how
        soon; a death is seen no sooner than that (``death_timeout``). Blocks for a few round
        trips; starts two daemon threads (renewal and watch)."""
        self._vkey(key)
        return EtcdWill(self, key, to_bytes(value), ttl)

    def keep_node_wills(self, directory: str) -> NodeKeeper:
        """Keep the wills of the processes this one starts on its host (see
        :meth:`plugdist.store.Store.keep_node_wills`) with one etcd lease of ``live_ttl``
        seconds for them all, renewed here, instead of a lease per process: give each process
        the returned keeper's ``env``. Their wills then renew to the keeper through files in
        ``directory``; a process that dies has its will executed at once, one that stops
        running after its will's TTL, as before; every will still held runs when the keeper
        closes or this process dies. Blocks for one round trip; starts two daemon threads."""
        client = EtcdClient(self.endpoints, **self._config)  # type: ignore[arg-type]
        try:
            return NodeKeeper(client, directory, self.live_ttl,
                              grant_timeout=min(30.0, to_seconds(self.timeout)))
        except BaseException:
            client.close()
            raise

    def _will_keys(self, wid: bytes) -> tuple[bytes, bytes]:
        """The record and the liveness key of will ``wid``."""
        return self._p + b"w/" + wid, self._p + b"l/" + wid

    def _put_will(self, wid: bytes, key: str, value: bytes, lease: int) -> None:
        record, live = self._will_keys(wid)
        body = json.dumps({"key": key, "value": b64(value)}).encode()
        self._txn([], [_put(record, body, self._lease_id), _put(live, body, lease)], [],
                  f"hold_will({key!r})")

    def _withdraw_will(self, wid: bytes) -> None:
        record, live = self._will_keys(wid)
        self._txn([], [_delete(record), _delete(live)], [], "cancel will",
                  time.monotonic() + min(5.0, to_seconds(self.timeout)))

    def _successor(self, wid: bytes) -> tuple[bytes | None, int]:
        """The live will just after ``wid`` in the ring of liveness keys (ordered by id, the
        first one after the last), None when ``wid`` is alone; and the revision this was read
        at. One round trip in a large ring, two in a small one.

        Only ascending ranges with a limit: etcd sorts any other order in full (a descending
        lookup read every key below ``wid``: 10 ms at 16,384 holders here, against 0.3 ms).
        An ascending range still counts the keys it spans, so the first try spans a window
        above ``wid`` of 1/4096 of the ids (about four holders at 16,384), and only a miss
        spans the whole ring."""
        live = self._p + b"l/"
        after = live + wid + b"\0"
        try:
            window = int(wid, 16) + (1 << 52)
        except ValueError:
            window = 1 << 64  # not a will id of this module: no window
        if len(wid) == 16 and window < 1 << 64:
            data = self._txn([], [_range(after, live + b"%016x" % window, keys_only=True,
                                         limit=1)], [], "will ring")
            found = _kvs(data.get("responses", [{}])[0])
            if found:
                return unb64(found[0].get("key"))[len(live):], _revision(data)
        data = self._txn([], [_range(after, prefix_end(live), keys_only=True, limit=1),
                              _range(live, prefix_end(live), keys_only=True, limit=1)], [],
                         "will ring")
        above, first = (_kvs(r) for r in data.get("responses", [{}, {}]))
        found = above or first
        succ = unb64(found[0].get("key"))[len(live):] if found else None
        return (None if succ == wid else succ), _revision(data)

    def _orphans_between(self, low: bytes, high: bytes) -> list[bytes]:
        """The wills with ids strictly between ``low`` and ``high`` (around the end of the
        ring when ``low`` >= ``high``) whose liveness key is gone: their holders died and the
        will has not run yet. One round trip."""
        rec, live = self._p + b"w/", self._p + b"l/"
        spans = ([(low + b"\0", high)] if low < high else
                 [(low + b"\0", None), (b"", high)])
        ops = []
        for start, end in spans:
            for area in (rec, live):
                ops.append(_range(area + start, area + end if end is not None else
                                  prefix_end(area), keys_only=True))
        data = self._txn([], ops, [], "will sweep")
        responses = data.get("responses", [])
        wills: list[bytes] = []
        held: set[bytes] = set()
        for i in range(0, len(responses), 2):
            wills += [unb64(kv.get("key"))[len(rec):] for kv in _kvs(responses[i])]
            held |= {unb64(kv.get("key"))[len(live):] for kv in _kvs(responses[i + 1])}
        return [w for w in wills if w not in held]

    def _execute_will(self, wid: bytes) -> bool:
        """Run will ``wid`` if its liveness key is gone and nobody ran it yet: append its value
        to its numbered log (the counter ``key`` becomes n, the value goes to ``key/n``) and
        delete its record, in one transaction guarded by the record, the absence of the
        liveness key and the counter's revision, so however many processes try at once (and
        however often a lost reply makes one repeat), it runs once. True if this call ran it."""
        record, live = self._will_keys(wid)
        what = "execute will"
        deadline = self._deadline()
        while True:
            data = self._txn([], [_range(record), _range(live, count_only=True)], [], what,
                             deadline)
            responses = data.get("responses", [])
            found = _kvs(responses[0])
            if not found or _count(responses[1]):
                return False  # ran (or withdrawn) already, or its holder is alive
            will = json.loads(unb64(found[0].get("value")))
            key, entry = str(will["key"]), unb64(will["value"])
            vkey, d = self._vkey(key), self._dkey(key)
            data = self._txn([], [_range(vkey), _range(d, prefix_end(d))], [], what, deadline)
            responses = data.get("responses", [])
            value, deltas = _kvs(responses[0]), _kvs(responses[1])
            if deltas:  # the counter was add()ed to under contention: make it plain first
                self._fold(vkey, value, deltas, what, deadline, force=True)
                continue
            try:
                n = int(unb64(value[0].get("value")) or b"0") + 1 if value else 1
            except ValueError:  # a counter some process overwrote with set(): as TCPStore does
                get_logger(store="etcd").warning("will_not_run", key=key,
                                                 reason="the log's counter is not an integer")
                self._txn([], [_delete(record)], [], what, deadline)
                return False
            counter = ({"key": b64(vkey), "target": "MOD",
                        "mod_revision": value[0]["mod_revision"]} if value else
                       {"key": b64(vkey), "target": "CREATE", "create_revision": "0"})
            guard = [{"key": b64(record), "target": "MOD",
                      "mod_revision": found[0]["mod_revision"]},
                     {"key": b64(live), "target": "CREATE", "create_revision": "0"}, counter,
                     {"key": b64(d), "range_end": b64(prefix_end(d)), "target": "CREATE",
                      "create_revision": "0"}]
            done = self._txn(guard, [_put(vkey, str(n).encode(), self._lease_id),
                                     _put(self._vkey(f"{key}/{n}"), entry, self._lease_id),
                                     _delete(record)], [], what, deadline)
            if done.get("succeeded"):
                with self._lock:
                    self._seen.pop(vkey, None)
                return True

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key whose name starts with ``prefix``: values, their counter deltas and
        queues (whose etcd keys carry the name's length first, so they are found by a keys-only
        read of their area). Returns how many names went, a name that is both a value and a
        queue once. Not atomic: meant for keys nobody uses any more (finished epochs, old
        steps)."""
        what = f"delete_prefix({prefix!r})"
        start = self._vkey(prefix)
        raw = start[len(self._p) + 2:]
        with self._lock:
            for vkey in [k for k in self._seen if k.startswith(start)]:
                del self._seen[vkey]
        values = self._call("kv/range", {"key": b64(start), "range_end": b64(prefix_end(start)),
                                         "keys_only": True}, what)
        gone = {unb64(kv.get("key"))[len(self._p) + 2:] for kv in values.get("kvs", [])}
        ranges = [start]
        for area in (b"q/", b"a/"):
            base = self._p + area
            found = self._call("kv/range", {"key": b64(base), "range_end": b64(prefix_end(base)),
                                            "keys_only": True}, what)
            names = set()
            for kv in found.get("kvs", []):
                length, _, tail = unb64(kv.get("key"))[len(base):].partition(b":")
                name = tail[:int(length)] if length.isdigit() else b""
                if name.startswith(raw):
                    names.add(name)
            ranges += [base + str(len(n)).encode() + b":" + n + b"/" for n in names]
            if area == b"q/":
                gone |= names
        for first in ranges:
            self._call("kv/deleterange", {"key": b64(first), "range_end": b64(prefix_end(first))},
                       what)
        return len(gone)

    def delete_all(self) -> int:
        """Delete every key of the job's prefix (the end of a job); returns how many."""
        data = self._call("kv/deleterange", {"key": b64(self._p),
                                             "range_end": b64(prefix_end(self._p))},
                          "delete_all")
        with self._lock:
            self._seen.clear()
        return int(data.get("deleted", 0) or 0)

    def close(self) -> None:
        if self._closed:
            return
        if self._slot_count:
            mine = self._p + b"m/" + self._handle.encode() + b"/"
            try:
                self._call("kv/deleterange", {"key": b64(mine),
                                              "range_end": b64(prefix_end(mine))},
                           "close", time.monotonic() + 2)
            except DistStoreError:
                pass  # the lease removes them
        self._closed = True
        if self._lease is not None:
            release_shared(self._lease)
            self._lease = None
        self._client.close()
