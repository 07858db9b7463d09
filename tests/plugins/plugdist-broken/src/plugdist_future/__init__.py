"""A backend written for a plugin API this plugdist does not provide (3.0): the registry must
refuse it by name, naming both versions, and keep every other backend working."""

from __future__ import annotations

from plugdist.backend import BackendBase


class FutureProcessGroup(BackendBase):
    backend_name = "future"
    plugin_api = (3, 0)
