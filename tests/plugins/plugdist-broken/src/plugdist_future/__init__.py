"""A backend written for a plugin API this plugdist does not provide (2.0): the registry must
refuse it by name, naming both versions, and keep every other backend working."""

from __future__ import annotations

from typing import ClassVar

from plugdist import ProcessGroup


class FutureProcessGroup(ProcessGroup):
    backend_name = "future"
    plugin_api: ClassVar[tuple[int, int]] = (2, 0)
