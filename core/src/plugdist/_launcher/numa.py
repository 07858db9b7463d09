"""``--numa-binding``: which CPUs each worker may run on, read from Linux's sysfs.

torchrun's modes, with torchrun's meaning where a worker has a GPU (its local rank's GPU's NUMA
node); a worker without a GPU gets a NUMA node by block (local ranks spread evenly over the
nodes, in order). Standard library only: the launcher never imports torch.

- ``node``: every allowed CPU of the worker's NUMA node.
- ``socket``: every allowed CPU of the NUMA nodes on the worker's node's socket.
- ``exclusive``: the node's physical cores split evenly among the workers on that node (lower
  local ranks get the spare cores); no two workers share a core.
- ``core-complex``: one group of cores sharing the last-level cache, a different one per worker
  on the node where there are enough.

"Allowed" is the launcher's own affinity: binding never widens what the launcher was given.
A machine with no NUMA information (no ``/sys/devices/system/node``) is one node holding
every allowed CPU, so ``node`` and ``socket`` bind to what the worker had anyway.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

__all__ = ["NUMA_MODES", "cpus_for_workers", "spawning_bound_to"]

NUMA_MODES = ("node", "socket", "exclusive", "core-complex")


def _ranges(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


class _Topology:
    """The parts of sysfs and procfs binding needs, under ``sysfs`` and ``procfs`` (``/sys``
    and ``/proc``; a copy in tests)."""

    def __init__(self, sysfs: str, procfs: str, allowed: set[int]) -> None:
        self.sysfs = sysfs
        self.procfs = procfs
        self.allowed = allowed
        node_dir = os.path.join(sysfs, "devices/system/node")
        nodes: dict[int, set[int]] = {}
        if os.path.isdir(node_dir):
            for name in os.listdir(node_dir):
                if name.startswith("node") and name[4:].isdigit():
                    cpus = _ranges(_read(os.path.join(node_dir, name, "cpulist"))) & allowed
                    if cpus:
                        nodes[int(name[4:])] = cpus
        self.nodes = dict(sorted(nodes.items())) or {0: set(allowed)}

    def _cpu_file(self, cpu: int, rel: str) -> str:
        return os.path.join(self.sysfs, f"devices/system/cpu/cpu{cpu}", rel)

    def socket_of(self, cpu: int) -> int:
        try:
            return int(_read(self._cpu_file(cpu, "topology/physical_package_id")))
        except (OSError, ValueError):
            return 0

    def core_of(self, cpu: int) -> int:
        """The physical core, named by its lowest hardware thread."""
        try:
            return min(_ranges(_read(self._cpu_file(cpu, "topology/thread_siblings_list"))))
        except (OSError, ValueError):
            return cpu

    def last_cache_of(self, cpu: int) -> int:
        """The last-level (data or unified) cache, named by the lowest CPU sharing it."""
        best_level, best = -1, {cpu}
        cache_dir = self._cpu_file(cpu, "cache")
        try:
            entries = os.listdir(cache_dir)
        except OSError:
            return cpu
        for entry in entries:
            if not (entry.startswith("index") and entry[5:].isdigit()):
                continue
            d = os.path.join(cache_dir, entry)
            try:
                if _read(os.path.join(d, "type")) not in ("Data", "Unified"):
                    continue
                level = int(_read(os.path.join(d, "level")))
                if level > best_level:
                    best_level, best = level, _ranges(_read(os.path.join(d, "shared_cpu_list")))
            except (OSError, ValueError):
                continue
        return min(best)

    def gpu_nodes(self) -> list[int]:
        """NUMA node of each NVIDIA GPU this process may use, in PCI order (nvidia-smi's;
        ``CUDA_VISIBLE_DEVICES`` indices select from it). Empty: no GPU found."""
        try:
            addrs = sorted(os.listdir(os.path.join(self.procfs, "driver/nvidia/gpus")))
        except OSError:
            return []
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            picked = [v.strip() for v in visible.split(",") if v.strip()]
            if not all(v.isdigit() for v in picked):
                return []      # UUIDs: cannot tell which is which without the driver
            addrs = [addrs[int(v)] for v in picked if int(v) < len(addrs)]
        out = []
        for addr in addrs:
            try:
                node = int(_read(os.path.join(self.sysfs, "bus/pci/devices", addr.lower(),
                                              "numa_node")))
            except (OSError, ValueError):
                node = 0
            out.append(node if node in self.nodes else next(iter(self.nodes)))
        return out


def _group(values: Iterable[int], key: dict[int, int]) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for v in values:
        out.setdefault(key[v], set()).add(v)
    return dict(sorted(out.items()))


def cpus_for_workers(mode: str, nproc: int, *, sysfs: str = "/sys", procfs: str = "/proc",
                     allowed: set[int] | None = None) -> list[set[int]]:
    """The CPU set of each local rank under ``mode``; ValueError for a bad mode or a node with
    fewer physical cores than workers (``exclusive``)."""
    if mode not in NUMA_MODES:
        raise ValueError(f"--numa-binding: {mode!r} is not one of {', '.join(NUMA_MODES)}")
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("binding workers to CPUs needs Linux (os.sched_setaffinity); drop "
                         "--numa-binding on this system")
    topo = _Topology(sysfs, procfs, set(os.sched_getaffinity(0)) if allowed is None else allowed)
    node_ids = list(topo.nodes)
    gpu_nodes = topo.gpu_nodes()
    node_of = [gpu_nodes[r] if r < len(gpu_nodes) else node_ids[r * len(node_ids) // nproc]
               for r in range(nproc)]
    out = []
    for rank, node in enumerate(node_of):
        cpus = topo.nodes[node]
        sharers = [r for r in range(nproc) if node_of[r] == node]
        mine = sharers.index(rank)
        if mode == "node":
            out.append(set(cpus))
        elif mode == "socket":
            sock = topo.socket_of(min(cpus))
            out.append({c for n in topo.nodes.values() if topo.socket_of(min(n)) == sock
                        for c in n})
        elif mode == "exclusive":
            cores = list(_group(cpus, {c: topo.core_of(c) for c in cpus}).values())
            if len(cores) < len(sharers):
                raise ValueError(f"--numa-binding exclusive: NUMA node {node} has "
                                 f"{len(cores)} physical cores for {len(sharers)} workers; "
                                 "use fewer workers per node, or --numa-binding node")
            each, spare = divmod(len(cores), len(sharers))
            start = mine * each + min(mine, spare)
            stop = start + each + (1 if mine < spare else 0)
            out.append({c for core in cores[start:stop] for c in core})
        else:  # core-complex
            groups = sorted(_group(cpus, {c: topo.last_cache_of(c) for c in cpus}).items(),
                            key=lambda kv: (-len(kv[1]), kv[0]))
            out.append(groups[mine % len(groups)][1])
    return out


@contextlib.contextmanager
def spawning_bound_to(cpus: set[int] | None) -> Iterator[None]:
    """Within the block, the calling thread (and so every process it starts) runs on ``cpus``;
    its own affinity comes back after. None: no change.

    A new process inherits the affinity of the thread that forked it, so the worker is bound
    from its first instruction, with no window in which it (or a thread or child it starts
    early) runs elsewhere. On Linux, ``sched_setaffinity(0)`` changes only the calling thread:
    the launcher's other threads keep theirs.
    """
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
