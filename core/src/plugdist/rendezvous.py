"""Rendezvous handlers: turn an ``init_method`` URL into ``(store, rank, world_size)``.

Registered through the core's own ``plugdist.rendezvous`` entry points (``env``, ``tcp``,
``file``), like any third-party scheme. A handler is called as
``handler(url, rank=..., world_size=..., timeout=...)`` where rank/world_size are -1 when the
caller did not give them; it blocks until the store is reachable (bounded by ``timeout``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

from .errors import DistError
from .store import FileStore, Store, TCPStore

__all__ = ["env_rendezvous_handler", "tcp_rendezvous_handler", "file_rendezvous_handler",
           "RendezvousError", "RendezvousHandler"]

RendezvousHandler = Callable[..., tuple[Store, int, int]]


class RendezvousError(DistError, ValueError):
    """The init_method or the environment does not say enough to find the other ranks."""


def _query_int(url: str, name: str, given: int) -> int:
    values = parse_qs(urlparse(url).query).get(name)
    if values:
        try:
            return int(values[0])
        except ValueError:
            raise RendezvousError(f"init_method {url!r}: {name}={values[0]!r} is not an integer") from None
    return given


def _check(rank: int, world_size: int, source: str) -> None:
    if world_size < 1:
        raise RendezvousError(f"{source}: world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise RendezvousError(f"{source}: rank {rank} is out of range for world_size {world_size} "
                              f"(valid ranks: 0..{world_size - 1})")


def _env_int(var: str, given: int, purpose: str) -> int:
    if given >= 0:
        return given
    value = os.environ.get(var)
    if value is None:
        raise RendezvousError(f"env:// rendezvous needs the environment variable {var} ({purpose}); "
                              f"set it, pass {var.lower()}= to init_process_group, or launch with "
                              f"plugdist-run, which sets it")
    try:
        return int(value)
    except ValueError:
        raise RendezvousError(f"environment variable {var}={value!r} is not an integer") from None


def _tcp_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> Store:
    return TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout,
                    wait_for_workers=False)


def env_rendezvous_handler(url: str, rank: int = -1, world_size: int = -1,
                           timeout: timedelta = timedelta(minutes=30)) -> tuple[Store, int, int]:
    """``env://``: MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE from the environment (rank and
    world_size may come from the caller or the URL query instead)."""
    rank = _env_int("RANK", _query_int(url, "rank", rank), "this process's rank")
    world_size = _env_int("WORLD_SIZE", _query_int(url, "world_size", world_size),
                          "the number of processes")
    _check(rank, world_size, "env://")
    host = os.environ.get("MASTER_ADDR")
    if not host:
        raise RendezvousError("env:// rendezvous needs the environment variable MASTER_ADDR (the "
                              "address of rank 0); set it or launch with plugdist-run")
    port_text = os.environ.get("MASTER_PORT")
    if not port_text:
        raise RendezvousError("env:// rendezvous needs the environment variable MASTER_PORT (a free "
                              "port on rank 0's host); set it or launch with plugdist-run")
    try:
        port = int(port_text)
    except ValueError:
        raise RendezvousError(f"environment variable MASTER_PORT={port_text!r} is not a port number") from None
    return _tcp_store(host, port, rank, world_size, timeout), rank, world_size


def tcp_rendezvous_handler(url: str, rank: int = -1, world_size: int = -1,
                           timeout: timedelta = timedelta(minutes=30)) -> tuple[Store, int, int]:
    """``tcp://host:port[?rank=R&world_size=N]``: rank 0 serves the store on host:port."""
    parsed = urlparse(url)
    if not parsed.hostname or parsed.port is None:
        raise RendezvousError(f"init_method {url!r} must look like tcp://HOST:PORT")
    rank = _query_int(url, "rank", rank)
    world_size = _query_int(url, "world_size", world_size)
    if rank < 0 or world_size < 0:
        raise RendezvousError(f"init_method {url!r}: tcp:// needs rank= and world_size= (as "
                              f"arguments of init_process_group or in the URL query)")
    _check(rank, world_size, url)
    return _tcp_store(parsed.hostname, parsed.port, rank, world_size, timeout), rank, world_size


def file_rendezvous_handler(url: str, rank: int = -1, world_size: int = -1,
                            timeout: timedelta = timedelta(minutes=30)) -> tuple[Store, int, int]:
    """``file:///path``: a FileStore on a file every rank can reach (shared file system)."""
    parsed = urlparse(url)
    path = parsed.path if not parsed.netloc else f"//{parsed.netloc}{parsed.path}"
    if not path:
        raise RendezvousError(f"init_method {url!r} must look like file:///absolute/path")
    rank = _query_int(url, "rank", rank)
    world_size = _query_int(url, "world_size", world_size)
    if rank < 0 or world_size < 0:
        raise RendezvousError(f"init_method {url!r}: file:// needs rank= and world_size=")
    _check(rank, world_size, url)
    store = FileStore(path, world_size)
    store.set_timeout(timeout)
    return store, rank, world_size
