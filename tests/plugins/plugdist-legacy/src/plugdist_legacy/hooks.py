"""A hook plugin that claims plugin API 2.0 but still implements plugin API 1's group wrapper
hook: refused on load, naming the hook that replaced it."""

from __future__ import annotations

from typing import Any

from plugdist.hookspecs import hookimpl

plugin_api = (2, 0)


@hookimpl
def plugdist_wrap_process_group(group: Any, store: Any, debug_level: Any) -> Any:
    return group
