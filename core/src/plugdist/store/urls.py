"""The core's own store factories: what the ``tcp``, ``file`` and ``hash`` entry points name.

Every store scheme, the core's included, is an entry point of the ``plugdist.stores`` group:
name = URL scheme, value = a factory called as
``factory(url, *, timeout, rank=-1, world_size=-1) -> Store``. ``rank`` and ``world_size`` are
the caller's place in the job when it has one (-1 when not): a store that one process must host
(``tcp``) hosts it on rank 0. The factory blocks until the store answers, bounded by
``timeout``, which is also the store's timeout. A third party publishes a store with one class
and one entry point; see docs/stores.md. ``plugdist.open_store(url)`` finds a scheme's
factory (:mod:`plugdist._open_store`).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

from plugdist.store.api import DEFAULT_STORE_TIMEOUT, Store
from plugdist.store.file_store import FileStore
from plugdist.store.hash_store import HashStore
from plugdist.store.tcp_store import TCPStore

__all__ = ["tcp_store_factory", "file_store_factory", "hash_store_factory"]


def _query(url: str) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}


def _int(url: str, name: str, given: int) -> int:
    text = _query(url).get(name)
    if text is None:
        return given
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"store URL {url!r}: {name}={text!r} is not an integer") from None


def tcp_store_factory(url: str, *, timeout: timedelta = DEFAULT_STORE_TIMEOUT, rank: int = -1,
                      world_size: int = -1, **_: Any) -> Store:
    """``tcp://HOST:PORT[?rank=R&world_size=N]``: a :class:`TCPStore`, hosted by rank 0."""
    parsed = urlparse(url)
    if not parsed.hostname or parsed.port is None:
        raise ValueError(f"store URL {url!r} must look like tcp://HOST:PORT")
    rank = _int(url, "rank", rank)
    world_size = _int(url, "world_size", world_size)
    return TCPStore(parsed.hostname, parsed.port, world_size if world_size > 0 else None,
                    is_master=(rank == 0), timeout=timeout, wait_for_workers=False)


def file_store_factory(url: str, *, timeout: timedelta = DEFAULT_STORE_TIMEOUT,
                       rank: int = -1, world_size: int = -1, **_: Any) -> Store:
    """``file:///PATH[?world_size=N]``: a :class:`FileStore` on a file every process reaches."""
    parsed = urlparse(url)
    path = parsed.path if not parsed.netloc else f"//{parsed.netloc}{parsed.path}"
    if not path:
        raise ValueError(f"store URL {url!r} must look like file:///absolute/path")
    world_size = _int(url, "world_size", world_size)
    return FileStore(path, world_size if world_size > 0 else -1, timeout=timeout)


_HASH_STORES: dict[str, HashStore] = {}
_HASH_LOCK = threading.Lock()


def hash_store_factory(url: str, *, timeout: timedelta = DEFAULT_STORE_TIMEOUT,
                       **_: Any) -> Store:
    """``hash://NAME``: the :class:`HashStore` of that name in this process (threads only)."""
    parsed = urlparse(url)
    name = parsed.netloc + parsed.path
    with _HASH_LOCK:
        store = _HASH_STORES.get(name)
        if store is None:
            store = _HASH_STORES[name] = HashStore(timeout=timeout)
    return store
