"""The one owner of this process's distributed state: the default group, every group it is a
member of, the store, and the counters that keep group names in step across ranks.

Nothing else in plugdist keeps module-level state about groups. Thread-safe.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from plugdist.errors import DistError, NotInitializedError

if TYPE_CHECKING:
    from plugdist._group.process_group import ProcessGroup
    from plugdist.store import Store

__all__ = ["World", "GroupInfo", "world", "NotInitializedError"]


@dataclass
class GroupInfo:
    """What the world records about one group this process belongs to."""

    name: str
    backend: str
    global_ranks: tuple[int, ...]
    store: Store
    timeout: timedelta
    barrier_seq: int = 0
    _index: dict[int, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._index = {g: i for i, g in enumerate(self.global_ranks)}

    def group_rank(self, global_rank: int) -> int | None:
        return self._index.get(global_rank)


class World:
    """Default group, member groups and the shared store of this process."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.default: ProcessGroup | None = None
            self.store: Store | None = None
            self.rank: int = -1
            self.size: int = -1
            self.backend: str | None = None
            self.groups: dict[int, tuple[ProcessGroup, GroupInfo]] = {}
            self.group_count = 0
            # member ranks -> local-sync groups of them made so far (local_group_name)
            self.local_group_counts: dict[tuple[int, ...], int] = {}
            self.owned_store = False
            # torch's default group while it runs over ours (plugdist._torch.bridge.share_world)
            self.torch_default: Any = None
            # liveness and the agreed epoch (plugdist._resilience); None when resilience is off
            self.membership: Any = None
            self.epoch = 0
            self.group_options: Any = None  # the default group's pg_options, for rebuilds
            # a joiner: the epoch it was admitted at, and whether it has the training state
            self.joined_epoch: int | None = None
            self.state_received = False

    @property
    def initialized(self) -> bool:
        return self.default is not None

    def require(self, what: str) -> ProcessGroup:
        if self.default is None:
            raise NotInitializedError(
                f"{what} needs the default process group: call plugdist.init_process_group() first")
        return self.default

    def next_group_name(self) -> str:
        """Names are handed out in call order, which is the same on every rank."""
        with self._lock:
            self.group_count += 1
            return str(self.group_count)

    def local_group_name(self, ranks: tuple[int, ...]) -> str:
        """The name of a group made by its members alone (``use_local_synchronization``):
        derived from its ranks and how many such groups of those ranks this process made
        before, the same on every member; the call-order counter is left alone, as the other
        ranks do not see the call."""
        with self._lock:
            made = self.local_group_counts.get(ranks, 0)
            self.local_group_counts[ranks] = made + 1
        digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
        return f"local-{digest}-{made}"

    def add(self, pg: ProcessGroup, info: GroupInfo) -> None:
        with self._lock:
            self.groups[id(pg)] = (pg, info)

    def remove(self, pg: ProcessGroup) -> None:
        with self._lock:
            self.groups.pop(id(pg), None)

    def info(self, pg: ProcessGroup) -> GroupInfo:
        entry = self.groups.get(id(pg))
        if entry is None:
            raise DistError(f"{pg!r} is not a group of this process's world (destroyed, or made "
                            f"outside init_process_group/new_group)")
        return entry[1]

    def members(self) -> list[Any]:
        return [pg for pg, _ in self.groups.values()]


world = World()
