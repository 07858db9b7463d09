"""plugdist-etcd: a plugdist Store on an etcd cluster (v3 API), so no process of a job hosts
the store and the job outlives any one etcd member.

``etcd://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...]/PREFIX[?ttl=S&live_ttl=S&cacert=F&...]`` (``etcds://``
for TLS) through ``plugdist.open_store``, ``init_process_group(init_method=...)`` and
``plugdist-run --rdzv-backend etcd``. See README.md.
"""

from .client import EtcdClient, EtcdError, EtcdUnavailableError, TLSConfig
from .lease import Lease
from .store import EtcdStore
from .url import etcd_store_factory, parse_etcd_url
from .will import EtcdWill

plugin_api = (2, 0)  # written for plugdist's plugin API 2.x (checked when the store loads)

__all__ = ["EtcdStore", "EtcdClient", "EtcdError", "EtcdUnavailableError", "TLSConfig", "Lease",
           "EtcdWill", "etcd_store_factory", "parse_etcd_url"]
