"""Key-value stores: the interface and the four implementations shipped with the core
(``plugdist.open_store(url)`` opens any store installed through the ``plugdist.stores`` entry
points)."""

from plugdist.errors import QueueEmptyError
from plugdist.store._server import TCPStoreLimits
from plugdist.store.api import DEFAULT_STORE_TIMEOUT, MemberSession, Store, Will
from plugdist.store.file_store import FileStore
from plugdist.store.hash_store import HashStore
from plugdist.store.prefix_store import PrefixStore
from plugdist.store.tcp_store import TOKEN_ENV, TCPStore
from plugdist.store.torch_store import TorchStoreAdapter

__all__ = ["Store", "TCPStore", "FileStore", "HashStore", "PrefixStore", "DEFAULT_STORE_TIMEOUT",
           "TCPStoreLimits", "QueueEmptyError", "TOKEN_ENV", "TorchStoreAdapter", "Will",
           "MemberSession"]
