"""The TCPStore server, by concept (see :mod:`plugdist.store._server.server`, which ties the
parts). Private: :mod:`plugdist.store.tcp_store` runs it; its face is the two names below."""

from plugdist.store._server.limits import TCPStoreLimits
from plugdist.store._server.server import StoreServer

__all__ = ["StoreServer", "TCPStoreLimits"]
