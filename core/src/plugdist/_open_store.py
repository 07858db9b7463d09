"""``open_store("SCHEME://...")``: a store by URL, through its scheme's ``plugdist.stores`` entry
point (the core's own schemes included: :mod:`plugdist.store.urls`). Above both the registry and
the stores, so that neither imports the other.
"""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlparse

from plugdist._registry import STORES, registry
from plugdist.errors import DistStoreError
from plugdist.store import DEFAULT_STORE_TIMEOUT, Store

__all__ = ["open_store", "store_schemes"]


def store_schemes() -> list[str]:
    """Every store URL scheme installed (entry points and runtime registrations)."""
    return registry.names(STORES)


def open_store(url: str, timeout: timedelta = DEFAULT_STORE_TIMEOUT, *, rank: int = -1,
               world_size: int = -1) -> Store:
    """Open the store that ``url`` names, through the ``plugdist.stores`` entry point of its
    scheme: ``tcp://HOST:PORT`` (a client; rank 0 hosts it), ``file:///PATH``, ``hash://NAME``
    (in this process), ``etcd://H:P[,H:P...]/PREFIX`` with plugdist-etcd, ... Blocks until the
    store answers, up to ``timeout``. An unknown or broken scheme raises
    :class:`~plugdist.errors.PluginNotFoundError` naming the installed ones and the reason."""
    scheme = urlparse(url).scheme
    if not scheme:
        raise ValueError(f"store URL {url!r} has no scheme; installed store schemes: "
                         f"{', '.join(s + '://' for s in store_schemes())}")
    factory = registry.load(STORES, scheme.lower())
    store = factory(url, timeout=timeout, rank=rank, world_size=world_size)
    if not isinstance(store, Store):
        raise DistStoreError(f"the store factory of scheme {scheme!r} returned "
                             f"{type(store).__name__}, not a plugdist Store; fix the plugin's "
                             f"plugdist.stores entry point")
    return store
