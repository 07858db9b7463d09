"""A pluggy plugin whose ``@hookimpl`` is misspelt (``plugdist_group_creatd``): the registry must
leave it out, name the nearest hook (``plugdist_group_created``), and keep every other plugin."""

from __future__ import annotations

from typing import Any

from plugdist.hookspecs import hookimpl

plugin_api = (2, 0)  # written for plugin API 2.x: refused for its misspelt hook, not its version


@hookimpl
def plugdist_group_creatd(group: Any, global_ranks: tuple[int, ...], backend: str) -> None:
    raise AssertionError("a hook with no spec is never called")
