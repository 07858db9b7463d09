"""``etcd://`` URLs and the ``plugdist.stores`` factory.

Credentials and TLS files come from the URL or, as etcdctl takes them, from the environment:
``ETCDCTL_USER`` (``user`` or ``user:password``), ``ETCDCTL_PASSWORD``, ``ETCDCTL_CACERT``,
``ETCDCTL_CERT``, ``ETCDCTL_KEY``. Prefer the environment: a URL is passed to the workers in
their environment and may be printed by tools that are not plugdist's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from plugdist.store import DEFAULT_STORE_TIMEOUT

from .client import TLSConfig
from .store import DEFAULT_LIVE_TTL, EtcdStore

__all__ = ["EtcdURL", "parse_etcd_url", "etcd_store_factory"]


@dataclass(frozen=True)
class EtcdURL:
    endpoints: tuple[str, ...]
    prefix: str
    ttl: float
    live_ttl: float
    user: str | None
    password: str | None
    tls: TLSConfig | None

    def __repr__(self) -> str:  # never the password
        return (f"EtcdURL(endpoints={self.endpoints!r}, prefix={self.prefix!r}, "
                f"ttl={self.ttl}, live_ttl={self.live_ttl}, user={self.user!r}, "
                f"tls={self.tls is not None})")


def parse_etcd_url(url: str) -> EtcdURL:
    """Read an ``etcd://`` or ``etcds://`` URL (see the module docstring)."""
    parts = urlsplit(url)
    if parts.scheme not in ("etcd", "etcds"):
        raise ValueError(f"not an etcd store URL (etcd:// or etcds://): scheme {parts.scheme!r}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if not hosts:
        raise ValueError("an etcd store URL needs at least one endpoint: "
                         "etcd://HOST:PORT[,HOST:PORT...]/PREFIX")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    env = os.environ
    user, password = None, None
    if userinfo:
        user, _, pw = userinfo.partition(":")
        user, password = unquote(user), (unquote(pw) if pw else None)
    elif env.get("ETCDCTL_USER"):
        user, _, pw = env["ETCDCTL_USER"].partition(":")
        password = pw or None
    if user and password is None:
        password = env.get("ETCDCTL_PASSWORD")
    cacert = query.get("cacert", env.get("ETCDCTL_CACERT"))
    cert, key = query.get("cert", env.get("ETCDCTL_CERT")), query.get("key", env.get("ETCDCTL_KEY"))
    tls = None
    if parts.scheme == "etcds" or cacert or cert:
        tls = TLSConfig(ca_file=cacert, cert_file=cert, key_file=key)
    scheme = "https" if tls is not None else "http"
    endpoints = []
    for host in hosts.split(","):
        host = host.strip()
        if not host:
            continue
        if ":" not in host.rsplit("]", 1)[-1]:
            host += ":2379"
        endpoints.append(f"{scheme}://{host}")
    ttl = _seconds(query, "ttl", 60)
    live_ttl = _seconds(query, "live_ttl", DEFAULT_LIVE_TTL)
    if live_ttl <= 0:
        raise ValueError(f"etcd store URL: live_ttl={query['live_ttl']!r} must be positive")
    prefix = parts.path.strip("/") or "plugdist"
    return EtcdURL(tuple(endpoints), prefix, ttl, live_ttl, user or None, password, tls)


def _seconds(query: dict[str, str], name: str, default: float) -> float:
    try:
        return float(query.get(name, default))
    except ValueError:
        raise ValueError(f"etcd store URL: {name}={query[name]!r} is not a number of "
                         f"seconds") from None


def etcd_store_factory(url: str, *, timeout: timedelta = DEFAULT_STORE_TIMEOUT,
                       **_: Any) -> EtcdStore:
    """The ``plugdist.stores`` entry point of the ``etcd`` and ``etcds`` schemes."""
    u = parse_etcd_url(url)
    return EtcdStore(list(u.endpoints), u.prefix, timeout, ttl=u.ttl, live_ttl=u.live_ttl,
                     user=u.user,
                     password=u.password, tls=u.tls)
