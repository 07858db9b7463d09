"""Reading the plugin's integer settings from the environment."""

from __future__ import annotations

import os


def env_int(name: str, default: int, minimum: int, what: str) -> int:
    """``name`` as an integer (at least ``minimum``), ``default`` when unset or empty; a value
    that is not an integer raises ValueError saying it is not ``what``."""
    raw = os.environ.get(name, "")
    try:
        return max(minimum, int(raw)) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {what}") from None
