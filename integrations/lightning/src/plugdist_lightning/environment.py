"""Lightning's view of a world that ``plugdist-run`` started and plugdist may shrink and grow."""

from __future__ import annotations

import os

import plugdist
from lightning.fabric.plugins.environments import ClusterEnvironment

__all__ = ["PlugdistEnvironment", "joining"]


def joining() -> bool:
    """Whether this process was started to join a running world (``plugdist-run
    --replace-failed`` sets ``PLUGDIST_JOIN=1`` for a replacement) and has not joined yet."""
    return os.environ.get("PLUGDIST_JOIN") == "1" and not plugdist.is_initialized()


class PlugdistEnvironment(ClusterEnvironment):
    """Rank and world size are plugdist's current ones once its world exists (they change when
    the world shrinks or grows), the launcher's (``RANK``, ``WORLD_SIZE``) before. A process
    waiting to join has no rank yet: -1, so that nothing treats it as rank zero. The launcher
    creates the processes; Lightning's own launcher, which ends every process when one child
    fails, is never used."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        return "RANK" in os.environ and "WORLD_SIZE" in os.environ

    def world_size(self) -> int:
        if plugdist.is_initialized():
            return plugdist.get_world_size()
        return int(os.environ.get("WORLD_SIZE", "1"))

    def set_world_size(self, size: int) -> None:
        """Ignored: plugdist's world decides."""

    def global_rank(self) -> int:
        if plugdist.is_initialized():
            return plugdist.get_rank()
        return -1 if joining() else int(os.environ.get("RANK", "0"))

    def set_global_rank(self, rank: int) -> None:
        """Ignored: plugdist's world decides."""

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
