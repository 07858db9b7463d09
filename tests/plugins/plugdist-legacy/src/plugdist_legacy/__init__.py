"""Backends written exactly as plugin API 1 asked: a subclass of ``plugdist.ProcessGroup`` that
overrides ``native_*`` hooks. Under plugin API 2 each must be refused with what to change
(never run, never an AttributeError from inside the core):

* ``LegacyProcessGroup`` declares ``plugin_api = (1, 0)``;
* ``UndeclaredProcessGroup`` declares nothing (which counts as 1.0);
* ``MislabelledProcessGroup`` claims ``(2, 0)`` but still subclasses ProcessGroup;
* ``make_group`` is a factory function (no declaration) that builds a LegacyProcessGroup.
"""

from __future__ import annotations

from typing import Any

from plugdist.backend import ProcessGroup, Work


class LegacyProcessGroup(ProcessGroup):
    backend_name = "legacy"
    plugin_api = (1, 0)

    def __init__(self, store: Any, rank: int, size: int, options: Any) -> None:
        super().__init__(rank, size, options)  # type: ignore[arg-type]
        self.store = store

    def native_send(self, *, tensor: Any, dst: int, tag: int) -> Work:
        self.store.set(f"{self.rank()}->{dst}/{tag}", tensor.numpy().tobytes())
        work = self.work("send")
        work.set_result([tensor])
        return work

    def native_recv(self, *, tensor: Any, src: int, tag: int) -> Work:
        raise NotImplementedError


class UndeclaredProcessGroup(LegacyProcessGroup):
    backend_name = "legacy_undeclared"
    plugin_api = None  # type: ignore[assignment]


class MislabelledProcessGroup(LegacyProcessGroup):
    backend_name = "legacy_mislabelled"
    plugin_api = (2, 0)


def make_group(store: Any, rank: int, size: int, options: Any) -> Any:
    return LegacyProcessGroup(store, rank, size, options)
