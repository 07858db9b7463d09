"""A small etcd v3 client over etcd's JSON gateway (``/v3/...`` on every client port), on the
keep-alive HTTP/1.1 connections of :mod:`plugdist_etcd.http`.

One :class:`EtcdClient` talks to several endpoints of one cluster: it prefers the leader (learned
in the background, once per process and cluster: a write or a linearizable read sent to a
follower costs that follower a forwarding hop to the leader), sticks to the endpoint that
answered last and, when a request fails in a way that says "not this member now" (connection
refused or reset, etcd's Unavailable, a member without a leader), moves to the next, until the
request's deadline. Whether the failed attempt was applied is unknown then: callers make their
writes safe to repeat (see :mod:`plugdist_etcd.store`). Credentials (password, auth token) never
appear in a message, a repr or a log event.

Thread-safe: each connection serves one request at a time, and the rest is guarded by locks.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from plugdist.backend import get_logger
from plugdist.errors import DistNetworkError, DistStoreError

from .http import Endpoint, HTTPFailure, ssl_context

__all__ = ["EtcdClient", "EtcdError", "EtcdUnavailableError", "TLSConfig", "b64", "unb64",
           "prefix_end"]

# An attempt on one member waits this long for an answer (twice as long after _SHORT_TRIES timed
# out: a cluster that is merely slow still gets its time). Short, because a request a member
# forwarded to a leader that just died is never answered, while the same request sent again
# once a new leader is elected (1-2 s with etcd's defaults) is; repeating is safe (see
# plugdist_etcd.store). With one endpoint there is no other member to turn to, and a member
# answers a request it holds for a dead leader with an error of its own (after its request
# timeout, 7 s with etcd's defaults), so an attempt there waits _ONE_ENDPOINT_READ, doubling:
# a busy member is never sent the same request again and again (each one it gave up on adds to
# its queue, and etcd before 3.5.5 crashes on a read-only transaction whose client gave up while
# the member ran it: etcd issue 14110).
_ATTEMPT_READ = 0.25
_SHORT_TRIES = 8
_ONE_ENDPOINT_READ = 30.0
_BYTES_PER_S = 50e6  # a large value gets time to travel and be written on top of that
_CONNECT = 1.0
_CREATED_GAP = 2.0  # seconds between two acknowledgements of a new stream's watchers, at most
_RETRYABLE_CODES = {4, 14}  # DeadlineExceeded ("request timed out"), Unavailable (no leader, ...)
_AUTH_CODES = {16}          # Unauthenticated
_LEADER_RECHECK = 1.0       # seconds between two looks for the leader, while it is not known
# after a request timed out: how long to poll the members' status for a leader (etcd elects one
# in 1-2 s with its defaults), and how often
_FIND_LEADER = 3.0
_FIND_EVERY = 0.03


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"


class EtcdError(DistStoreError):
    """etcd refused a request (its gRPC code and message are kept)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class EtcdUnavailableError(DistStoreError, DistNetworkError):
    """No endpoint of the cluster answered before the request's deadline."""


@dataclass(frozen=True)
class TLSConfig:
    """TLS as etcd clients take it: a CA bundle, and a client certificate and key for etcd's
    ``--client-cert-auth``."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


class _LeaderHint:
    """Which of a cluster's endpoints leads, as last learned; one per process and endpoint
    list, shared by its clients. Learned on a daemon thread (two round trips), never on the
    caller's: until then, and while a failover makes it unknown, clients use any member."""

    def __init__(self) -> None:
        self.index: int | None = None
        self._asked = -_LEADER_RECHECK
        self._busy = False
        self._lock = threading.Lock()
        self._find_lock = threading.Lock()
        self._found_at = -1.0

    def forget(self, index: int) -> None:
        """The endpoint ``index`` failed a request: it may not lead any more."""
        if self.index == index:
            self.index = None

    def learn(self, client: EtcdClient) -> None:
        """Start looking for the leader, unless a look is under way or was made lately."""
        now = time.monotonic()
        with self._lock:
            if self._busy or now - self._asked < _LEADER_RECHECK:
                return
            self._busy, self._asked = True, now
        threading.Thread(target=self._look, args=(client,), name="etcd-leader",
                         daemon=True).start()

    def _look(self, client: EtcdClient) -> None:
        try:
            deadline = time.monotonic() + 2.0
            status = client.call("maintenance/status", {}, deadline, "status", route=False)
            leader = str(status.get("leader") or "0")
            if leader == "0":
                return  # an election is on: look again later
            members = client.call("cluster/member/list", {}, deadline, "member list",
                                  route=False).get("members", [])
            urls = {_netloc(u) for m in members if str(m.get("ID")) == leader
                    for u in m.get("clientURLs", [])}
            for i, endpoint in enumerate(client.endpoints):
                if _netloc(endpoint) in urls:
                    self.index = i
        except DistStoreError:
            pass  # e.g. not allowed to list members: any member will do
        finally:
            with self._lock:
                self._busy = False

    def find(self, client: EtcdClient, deadline: float) -> int | None:
        """After a request timed out (a member whose leader died holds it without an answer
        until a new leader is elected): poll every member's status, which each answers on its
        own, until one says it leads; its index, or None after ``_FIND_LEADER`` seconds or at
        ``deadline``. One poller per process: other callers wait for its answer."""
        if not self._find_lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
            return self.index
        try:
            if self.index is not None and time.monotonic() - self._found_at < 0.5:
                return self.index  # another caller just found it
            end = min(deadline, time.monotonic() + _FIND_LEADER)
            while time.monotonic() < end:
                for i in range(len(client.endpoints)):
                    data = client._status(i)
                    me = str(data.get("header", {}).get("member_id") or "")
                    if me and str(data.get("leader") or "") == me:
                        self.index, self._found_at = i, time.monotonic()
                        return i
                time.sleep(_FIND_EVERY)
            return None
        finally:
            self._find_lock.release()


def _netloc(url: str) -> str:
    return urlsplit(url).netloc.lower()


_HINTS: dict[tuple[str, ...], _LeaderHint] = {}
_HINTS_LOCK = threading.Lock()


@dataclass
class _Attempt:
    errors: list[str] = field(default_factory=list)


class EtcdClient:
    """Requests to the cluster at ``endpoints`` (``http://host:port`` or ``https://...``)."""

    def __init__(self, endpoints: list[str], *, user: str | None = None,
                 password: str | None = None, tls: TLSConfig | None = None,
                 pool_size: int = 8) -> None:
        if not endpoints:
            raise ValueError("an etcd client needs at least one endpoint")
        self.endpoints = list(endpoints)
        self._user = user
        self._password = password
        self._token: str | None = None
        self._lock = threading.Lock()
        self._current = 0
        with _HINTS_LOCK:
            self._leader = _HINTS.setdefault(tuple(self.endpoints), _LeaderHint())
        context = None
        if tls is not None:
            context = ssl_context(tls.ca_file, tls.cert_file, tls.key_file)
        self._http = [Endpoint(e, context, keep=pool_size) for e in self.endpoints]

    def __repr__(self) -> str:
        auth = f", user={self._user!r}" if self._user else ""
        return f"EtcdClient({','.join(self.endpoints)}{auth})"

    def describe(self) -> str:
        """The endpoints, for error messages (never credentials)."""
        return ",".join(self.endpoints)

    def close(self) -> None:
        for endpoint in self._http:
            endpoint.close()

    # -- unary requests ---------------------------------------------------------------------
    def call(self, path: str, body: dict[str, Any], deadline: float, what: str, *,
             auth: bool = True, route: bool = True) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>``, failing over between endpoints until ``deadline``
        (a ``time.monotonic()`` value). Raises :class:`EtcdError` for a refusal by etcd and
        :class:`EtcdUnavailableError` when no endpoint answered in time. ``route``: start at
        the leader when it is known (and have it looked for when not)."""
        if route and len(self.endpoints) > 1:
            leader = self._leader.index
            if leader is None:
                self._leader.learn(self)
            else:
                self._current = leader
        payload = json.dumps(body).encode()
        attempt = _Attempt()
        tried = timed_out = 0
        while True:
            index = self._current
            endpoint = self.endpoints[index]
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._unavailable(what, attempt)
            if len(self.endpoints) > 1:
                read = (_ATTEMPT_READ + len(payload) / _BYTES_PER_S) * 2 ** max(
                    timed_out - _SHORT_TRIES, 0)
            else:
                read = (_ONE_ENDPOINT_READ + len(payload) / _BYTES_PER_S) * 2 ** timed_out
            try:
                status, raw = self._http[index].post(f"/v3/{path}", payload,
                                                     self._headers(auth), min(_CONNECT, left),
                                                     min(read, left))
            except HTTPFailure as err:
                timed_out += err.timeout
                attempt.errors.append(f"{endpoint}: {err}")
                if err.timeout and route and len(self.endpoints) > 1:
                    found = self._leader.find(self, deadline)
                    if found is not None and found != index:
                        self._current = found
                        continue
            else:
                data = _json(raw)
                if status == 200:
                    self._current = index
                    return data
                code = int(data.get("code", 0))
                message = str(data.get("message") or data.get("error") or status)
                if code in _AUTH_CODES or "invalid auth token" in message:
                    if self._user and auth:
                        self._authenticate(deadline)
                        continue
                if code == 8:  # ResourceExhausted: larger than the server takes
                    message += ("; etcd takes requests up to its --max-request-bytes (1.5 MiB "
                                "by default): raise it on every member, or store less per key")
                if code not in _RETRYABLE_CODES and "leader" not in message:
                    raise EtcdError(f"etcd at {endpoint} refused {what}: {message} (code {code})",
                                    code)
                attempt.errors.append(f"{endpoint}: {message}")
            self._leader.forget(index)
            with self._lock:
                if self._current == index:
                    self._current = (index + 1) % len(self.endpoints)
            # endpoints never carry credentials (parse_etcd_url keeps them apart)
            get_logger(store="etcd").info("etcd_endpoint_failed", op=what, endpoint=endpoint,
                                          error=attempt.errors[-1][-200:])
            tried += 1
            if tried % len(self.endpoints) == 0:  # every member failed once: let etcd settle
                time.sleep(min(0.05 * (tried // len(self.endpoints)), 0.25,
                               max(deadline - time.monotonic(), 0)))

    def _status(self, index: int) -> dict[str, Any]:
        """Member ``index``'s own status (no consensus needed), or {} if it does not answer
        within 0.1 s."""
        try:
            status, raw = self._http[index].post("/v3/maintenance/status", b"{}",
                                                 self._headers(), 0.1, 0.1)
        except (HTTPFailure, DistStoreError):
            return {}
        return _json(raw) if status == 200 else {}

    def _unavailable(self, what: str, attempt: _Attempt) -> EtcdUnavailableError:
        last = "; ".join(attempt.errors[-len(self.endpoints):]) or "no attempt in time"
        return EtcdUnavailableError(
            f"etcd store: {what} failed: no etcd endpoint of {self.describe()} answered in time "
            f"(last errors: {last}); check that the etcd cluster is running and reachable, or "
            f"raise the store timeout")

    def _headers(self, auth: bool = True) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if not auth:
            return headers
        if self._user and self._token is None:
            self._authenticate(time.monotonic() + 10)
        if self._token:
            headers["Authorization"] = self._token
        return headers

    def _authenticate(self, deadline: float) -> None:
        self._token = None
        try:
            data = self.call("auth/authenticate", {"name": self._user, "password": self._password},
                             deadline, "authenticate", auth=False,
                             route=False)  # find() may be asking: never back into it
        except EtcdError as err:
            raise EtcdError(f"etcd refused the user {self._user!r} on {self.describe()}: "
                            f"{str(err).split(': ', 2)[-1]}", err.code) from None
        self._token = str(data.get("token", ""))

    # -- watches ------------------------------------------------------------------------------
    def watch(self, creates: list[dict[str, Any]], deadline: float) -> Iterator[dict[str, Any]]:
        """Open one watch stream with several watchers; yields each response's ``result``
        until the stream ends (a member went away: the caller re-checks and watches again) or
        ``deadline`` passes (returns quietly). Raises EtcdUnavailableError only when no
        endpoint accepts the stream.

        etcd's JSON gateway can drop the last create requests of a stream (it stops reading
        the request once it answers: 69 of 640 lost at 32 a stream here, 3 of 160 at 8); the
        first is always read. etcd acknowledges the creates it got one after the other, so
        when, after a first acknowledgement, ``_CREATED_GAP`` seconds pass with watchers still
        unacknowledged, the stream ends with a result ``{"canceled": True, "lost_creates":
        n}``: the caller looks again instead of waiting on a watcher that does not exist (the
        stream's other watchers end with it). A slow etcd delays the first acknowledgement,
        not the gap, so load alone does not end streams."""
        body = b"".join(json.dumps({"create_request": c}).encode() for c in creates)
        attempt = _Attempt()
        while True:
            index = self._current
            endpoint = self.endpoints[index]
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                lines = self._http[index].stream("/v3/watch", body, self._headers(),
                                                 min(_CONNECT, left), deadline, len(creates),
                                                 _CREATED_GAP)
            except HTTPFailure as err:
                if err.timeout:
                    return  # the deadline passed before the stream started
                attempt.errors.append(f"{endpoint}: {err}")
                with self._lock:
                    if self._current == index:
                        self._current = (index + 1) % len(self.endpoints)
                if len(attempt.errors) % len(self.endpoints) == 0:
                    time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
                if len(attempt.errors) >= 3 * len(self.endpoints) and \
                        time.monotonic() >= deadline:
                    raise self._unavailable("watch", attempt) from None
                continue
            break
        created = 0
        try:
            for line in lines:  # ends at the deadline, or when the member goes away
                if line.strip():
                    msg = _json(line)
                    if "error" in msg and "result" not in msg:
                        return  # e.g. a compacted revision: the caller re-checks
                    result = msg.get("result", {})
                    created += bool(result.get("created"))
                    yield result
        finally:
            lines.close()  # the caller stopped reading: close the stream's connection now
        if created < len(creates) and time.monotonic() < deadline:
            yield {"canceled": True, "lost_creates": len(creates) - created}


def _json(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw or b"{}")
    except ValueError:
        return {"error": raw[:200].decode(errors="replace"), "code": 14}
    return data if isinstance(data, dict) else {}
