"""Key-value stores: the interface, the four implementations shipped with the core, and
``open_store(url)`` for any store installed through the ``plugdist.stores`` entry points."""

from plugdist.store._server import TCPStoreLimits

from ..errors import QueueEmptyError
from .api import DEFAULT_STORE_TIMEOUT, Store
from .file_store import FileStore
from .hash_store import HashStore
from .prefix_store import PrefixStore
from .tcp_store import TOKEN_ENV, TCPStore
from .torch_store import TorchStoreAdapter
from .urls import open_store, store_schemes

__all__ = ["Store", "TCPStore", "FileStore", "HashStore", "PrefixStore", "DEFAULT_STORE_TIMEOUT",
           "TCPStoreLimits", "QueueEmptyError", "TOKEN_ENV", "TorchStoreAdapter", "open_store",
           "store_schemes"]
