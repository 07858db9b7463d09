"""Rendezvous handlers: turn an ``init_method`` URL into ``(store, rank, world_size)``.

Registered through the core's own ``plugdist._world.rendezvous`` entry points (``env``, ``tcp``,
``file``), like any third-party scheme. A handler is called as
``handler(url, rank=..., world_size=..., timeout=...)`` where rank/world_size are -1 when the
caller did not give them; it blocks until the store is reachable (bounded by ``timeout``).
"""

from __future__ import annotations

import os
import zlib
from datetime import timedelta
from typing import Protocol
from urllib.parse import parse_qs, urlparse

from plugdist._open_store import open_store
from plugdist.errors import RendezvousError
from plugdist.store import PrefixStore, Store, TCPStore, TorchStoreAdapter

__all__ = ["env_rendezvous_handler", "tcp_rendezvous_handler", "file_rendezvous_handler",
           "store_rendezvous_handler", "RendezvousError", "RendezvousHandler",
           "slurm_first_host", "adopt_launcher_env", "join_store"]



class RendezvousHandler(Protocol):
    """What the ``plugdist.rendezvous`` entry points (and ``register_rendezvous_handler``) name:
    called once per rank by ``init_process_group(init_method=url)``. Blocks until the rank can
    reach the job's store, bounded by ``timeout``; returns ``(store, rank, world_size)``, rank
    and world size taken from the caller (-1: not given), the URL or the environment. Raises
    RendezvousError when none of them says enough."""

    def __call__(self, url: str, rank: int = -1, world_size: int = -1,
                 timeout: timedelta = ...) -> tuple[Store, int, int]: ...


def _query_int(url: str, name: str, given: int) -> int:
    values = parse_qs(urlparse(url).query).get(name)
    if values:
        try:
            return int(values[0])
        except ValueError:
            raise RendezvousError(f"init_method {url!r}: {name}={values[0]!r} is not an "
                                  f"integer") from None
    return given


def _check(rank: int, world_size: int, source: str) -> None:
    if world_size < 1:
        raise RendezvousError(f"{source}: world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise RendezvousError(f"{source}: rank {rank} is out of range for world_size {world_size} "
                              f"(valid ranks: 0..{world_size - 1})")


# Where other launchers put rank, world size and local rank: MPICH/Hydra, Open MPI, Slurm.
_SRUN = "srun (Slurm)"
_LAUNCHER_VARS = (
    ("mpiexec (MPICH/Hydra)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    (_SRUN, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


def _parse_int(var: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise RendezvousError(f"environment variable {var}={value!r} is not an integer") from None


def _from_other_launcher() -> tuple[str, int, int, int | None, int | None] | None:
    """(launcher, rank, world size, local rank, local size) from mpiexec/mpirun/srun's
    variables, or None when none of them started this process."""
    env = os.environ
    for name, rank_var, size_var, local_var, local_size_var in _LAUNCHER_VARS:
        if rank_var in env and size_var in env:
            local = env.get(local_var)
            local_size = env.get(local_size_var, "")
            return (name, _parse_int(rank_var, env[rank_var]), _parse_int(size_var, env[size_var]),
                    _parse_int(local_var, local) if local is not None else None,
                    int(local_size) if local_size.isdigit() else None)
    return None


def _env_int(var: str, given: int, purpose: str) -> int:
    if given >= 0:
        return given
    value = os.environ.get(var)
    if value is None:
        raise RendezvousError(f"env:// rendezvous needs the environment variable {var} "
                              f"({purpose}); set it, pass {var.lower()}= to init_process_group, "
                              f"or launch with plugdist-run, which sets it (mpiexec, mpirun and "
                              f"srun work too)")
    return _parse_int(var, value)


def _tcp_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> Store:
    return TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout,
                    wait_for_workers=False)


def _agent_store(world_size: int, timeout: timedelta) -> Store | None:
    """The store of the launcher that started this process, as a client, or None.

    plugdist-run announces its own in ``PLUGDIST_AGENT_STORE``: HOST:PORT of a plugdist
    TCPStore, or a store URL (``--rdzv-backend etcd``: ``etcd://...``) opened by
    :func:`~plugdist.open_store`; torchrun
    sets ``TORCHELASTIC_USE_AGENT_STORE=True`` and serves a torch TCPStore at MASTER_ADDR:
    MASTER_PORT, reached through torch's client. Keys go under a prefix per round (per restart
    under torchrun), so a restarted world never reads the previous attempt's keys.
    """
    env = os.environ
    if env.get("PLUGDIST_AGENT_STORE"):
        announced = env["PLUGDIST_AGENT_STORE"]
        if "://" in announced:
            store: Store = open_store(announced, timeout)
        else:
            host, _, port = announced.rpartition(":")
            store = TCPStore(host, int(port), None, is_master=False, timeout=timeout)
        round_ = env.get("PLUGDIST_RDZV_ROUND", "0")
        return _OwningPrefixStore(f"plugdist/worker/round_{round_}", store)
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("MASTER_ADDR") \
            and env.get("MASTER_PORT"):
        import torch.distributed as tdist  # torchrun's store speaks torch's protocol
        client = tdist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size,
                                False, timeout)
        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        return _OwningPrefixStore(f"plugdist/worker/attempt_{attempt}", TorchStoreAdapter(client))
    return None


class _OwningPrefixStore(PrefixStore):
    """A PrefixStore that owns its inner store: ``close`` closes it too."""

    def close(self) -> None:
        self.underlying_store.close()


def env_rendezvous_handler(url: str, rank: int = -1, world_size: int = -1,
                           timeout: timedelta = timedelta(minutes=30)) -> tuple[Store, int, int]:
    """``env://``: MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE from the environment (rank and
    world_size may come from the caller or the URL query instead).

    Without RANK/WORLD_SIZE, the variables of mpiexec (MPICH), mpirun (Open MPI) or srun
    (Slurm) give them, and LOCAL_RANK, LOCAL_WORLD_SIZE, RANK and WORLD_SIZE are then set in
    ``os.environ`` for the script to read. When every rank runs on this host, MASTER_ADDR
    defaults to 127.0.0.1 and MASTER_PORT to a port derived from the job; under srun across
    hosts, MASTER_ADDR defaults to the first node of the step (see docs/launcher.md). Under
    plugdist-run or torchrun, the launcher's store is used as a client.
    """
    rank = _query_int(url, "rank", rank)
    world_size = _query_int(url, "world_size", world_size)
    rank, world_size = adopt_launcher_env(rank, world_size)
    rank = _env_int("RANK", rank, "this process's rank")
    world_size = _env_int("WORLD_SIZE", world_size, "the number of processes")
    _check(rank, world_size, "env://")
    agent = _agent_store(world_size, timeout)
    if agent is not None:
        return agent, rank, world_size
    host = os.environ.get("MASTER_ADDR")
    if not host:
        raise RendezvousError("env:// rendezvous needs the environment variable MASTER_ADDR (the "
                              "address of rank 0); set it or launch with plugdist-run")
    port_text = os.environ.get("MASTER_PORT")
    if not port_text:
        raise RendezvousError("env:// rendezvous needs the environment variable MASTER_PORT (a "
                              "free port on rank 0's host); set it or launch with plugdist-run")
    try:
        port = int(port_text)
    except ValueError:
        raise RendezvousError(f"environment variable MASTER_PORT={port_text!r} is not a port "
                              f"number") from None
    return _tcp_store(host, port, rank, world_size, timeout), rank, world_size


def adopt_launcher_env(rank: int = -1, world_size: int = -1) -> tuple[int, int]:
    """Where mpiexec, mpirun or srun started this process and ``RANK``/``WORLD_SIZE`` are
    missing from the environment or agree with that launcher's (a library such as Accelerate
    copies ``PMI_RANK`` into ``RANK`` itself): set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE`` and (one host, or srun across hosts) ``MASTER_ADDR``/``MASTER_PORT``
    in ``os.environ`` from the launcher's variables, never replacing a value already set. A
    ``RANK`` or ``WORLD_SIZE`` that differs from the launcher's means the script numbers its
    own world: nothing is set then. Returns ``(rank, world_size)``: the given ones (-1: not
    given), else the launcher's. Also what torch's own ``env://`` runs first under plugdist
    (see :mod:`_plugdist_torch_autoload`)."""
    other = _from_other_launcher()
    if other is None:
        return rank, world_size
    launcher, o_rank, o_size, o_local, o_local_size = other
    if (os.environ.get("RANK", str(o_rank)).strip() != str(o_rank)
            or os.environ.get("WORLD_SIZE", str(o_size)).strip() != str(o_size)):
        return rank, world_size
    rank = o_rank if rank < 0 else rank
    world_size = o_size if world_size < 1 else world_size
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    if o_local is not None:
        os.environ.setdefault("LOCAL_RANK", str(o_local))
    if o_local_size is not None:
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(o_local_size))
    if o_local_size == world_size:   # one host: no need to name a master
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_job_port()))
    elif launcher == _SRUN and "MASTER_ADDR" not in os.environ:
        nodes = next((os.environ[v] for v in _SLURM_NODELISTS if os.environ.get(v)), "")
        if nodes:  # srun starts task 0 on the first node of the step
            os.environ["MASTER_ADDR"] = slurm_first_host(nodes)
            os.environ.setdefault("MASTER_PORT", str(_job_port()))
    return rank, world_size


_SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def slurm_first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist expression: ``"node[07-09,12],gpu1"`` gives
    ``"node07"``, ``"rack[2-3]-n[01-04]"`` gives ``"rack2-n01"`` (zero padding kept)."""
    first, depth = "", 0
    for ch in nodelist.strip():  # up to the first comma outside brackets
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        first += ch
    if depth != 0 or not first:
        raise RendezvousError(f"cannot read the Slurm node list {nodelist!r}; set MASTER_ADDR "
                              f"to the host of rank 0")
    out, rest = "", first
    while "[" in rest:
        head, _, tail = rest.partition("[")
        ranges, _, rest = tail.partition("]")
        out += head + ranges.split(",")[0].split("-")[0]
    return out + rest


# Derived ports lie below both usual ephemeral ranges (Linux's 32768-60999, IANA's 49152-65535):
# there any open connection's local port could hold the derived port and fail the bind (seen,
# one run in many). The span is fixed, not read from this host's ip_local_port_range, because
# under srun every host must derive the same port. torchrun's and torch's defaults are skipped.
_JOB_PORTS = (20000, 32768)
_TORCH_DEFAULT_PORTS = (29400, 29600)


def _job_port() -> int:
    """A port every rank of a one-host job derives alike: from Slurm's job and step ids, Open
    MPI's job id, or (MPICH's Hydra) the pid of the proxy that started this host's ranks. In
    20000-32767, never 29400-29599."""
    env = os.environ
    job = (env.get("SLURM_JOB_ID", "") + "." + env.get("SLURM_STEP_ID", "")
           if "SLURM_JOB_ID" in env else env.get("OMPI_MCA_ess_base_jobid")
           or env.get("PMIX_NAMESPACE") or f"ppid{os.getppid()}")
    skipped = _TORCH_DEFAULT_PORTS[1] - _TORCH_DEFAULT_PORTS[0]
    port = _JOB_PORTS[0] + zlib.crc32(job.encode()) % (_JOB_PORTS[1] - _JOB_PORTS[0] - skipped)
    return port + skipped if port >= _TORCH_DEFAULT_PORTS[0] else port


def store_rendezvous_handler(url: str, rank: int = -1, world_size: int = -1,
                             timeout: timedelta = timedelta(minutes=30)
                             ) -> tuple[Store, int, int]:
    """Any store URL (``tcp://``, ``file://``, ``etcd://``, a third party's scheme): rank and
    world size from the arguments, the URL query (``?rank=R&world_size=N``) or RANK and
    WORLD_SIZE in the environment; the store from :func:`~plugdist.open_store`."""
    rank = _query_int(url, "rank", rank)
    world_size = _query_int(url, "world_size", world_size)
    if rank < 0 and "RANK" in os.environ:
        rank = _parse_int("RANK", os.environ["RANK"])
    if world_size < 0 and "WORLD_SIZE" in os.environ:
        world_size = _parse_int("WORLD_SIZE", os.environ["WORLD_SIZE"])
    if rank < 0 or world_size < 0:
        scheme = urlparse(url).scheme
        raise RendezvousError(f"init_method {url!r}: {scheme}:// needs rank= and world_size= (as "
                              f"arguments of init_process_group, in the URL query, or RANK and "
                              f"WORLD_SIZE in the environment)")
    _check(rank, world_size, url)
    return open_store(url, timeout, rank=rank, world_size=world_size), rank, world_size


def tcp_rendezvous_handler(url: str, rank: int = -1, world_size: int = -1,
                           timeout: timedelta = timedelta(minutes=30)) -> tuple[Store, int, int]:
    """``tcp://host:port[?rank=R&world_size=N]``: rank 0 serves the store on host:port."""
    parsed = urlparse(url)
    if not parsed.hostname or parsed.port is None:
        raise RendezvousError(f"init_method {url!r} must look like tcp://HOST:PORT")
    return store_rendezvous_handler(url, rank, world_size, timeout)


def file_rendezvous_handler(url: str, rank: int = -1, world_size: int = -1,
                            timeout: timedelta = timedelta(minutes=30)) -> tuple[Store, int, int]:
    """``file:///path``: a FileStore on a file every rank can reach (shared file system)."""
    parsed = urlparse(url)
    if not (parsed.path or parsed.netloc):
        raise RendezvousError(f"init_method {url!r} must look like file:///absolute/path")
    return store_rendezvous_handler(url, rank, world_size, timeout)


def join_store(url: str | None, timeout: timedelta) -> Store:
    """The running world's store, for a process that joins it (``init_process_group(join=True)``):
    the launcher's store under plugdist-run, else a client of the store at ``tcp://HOST:PORT``
    or ``env://`` (MASTER_ADDR, MASTER_PORT; RANK and WORLD_SIZE are not needed: the members
    assign them), or any store URL (``file:///PATH``, ``etcd://...``). Blocks until the store
    is reachable."""
    url = url or "env://"
    parsed = urlparse(url)
    if parsed.scheme == "env":
        agent = _agent_store(-1, timeout)
        if agent is not None:
            return agent
        host, port_text = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port_text:
            raise RendezvousError("init_process_group(join=True) with env:// needs MASTER_ADDR "
                                  "and MASTER_PORT: the address of the running world's store")
        return TCPStore(host, int(port_text), None, is_master=False, timeout=timeout)
    # any store URL (tcp://HOST:PORT, file:///PATH, etcd://...): a client of it; rank -1 hosts
    # nothing
    return open_store(url, timeout)
