"""A backend class whose all_reduce hook is misspelt (``native_allreduce``): refused when the
class is created, so the registry reports the backend as failed to load, naming the fix."""

from __future__ import annotations

from typing import Any

from plugdist.backend import BackendBase


class MisspeltProcessGroup(BackendBase):
    backend_name = "misspelt"

    def native_allreduce(self, *, tensor: Any, op: Any) -> Any:
        raise AssertionError("never called: the class is refused")
