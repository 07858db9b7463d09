"""Whether a process gets resilient groups, and the settings of its liveness, from the
environment. Pure functions: no store, no threads, nothing blocks.

``PLUGDIST_RESILIENCE`` turns resilient groups on or off; ``PLUGDIST_HEARTBEAT_TIMEOUT`` is how
long a silent member is given before it counts as hung (default 10 s);
``PLUGDIST_HEARTBEAT_INTERVAL`` paces heartbeats (default a tenth of that, 0.05 s to 1 s).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["RESILIENCE_ENV", "INTERVAL_ENV", "HANG_TIMEOUT_ENV", "resilience_mode", "off_hint",
           "hang_timeout_setting", "interval_setting"]

RESILIENCE_ENV = "PLUGDIST_RESILIENCE"
INTERVAL_ENV = "PLUGDIST_HEARTBEAT_INTERVAL"
HANG_TIMEOUT_ENV = "PLUGDIST_HEARTBEAT_TIMEOUT"


def resilience_mode(env: Mapping[str, str] | None = None) -> str:
    """How ``PLUGDIST_RESILIENCE`` (read from ``env``, default this process's environment) sets
    resilient groups: ``"auto"`` (unset, the default: on where the world's store holds wills
    that expire, a TCPStore or etcd), ``"on"`` (``1``: on for any store, with heartbeats where
    its wills cannot expire) or ``"off"`` (``0``)."""
    value = (os.environ if env is None else env).get(RESILIENCE_ENV, "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("1", "true", "yes", "on"):
        return "on"
    if value in ("0", "false", "no", "off"):
        return "off"
    raise ValueError(f"{RESILIENCE_ENV}={value!r}: use 1 (on for every store), 0 (off) or leave "
                     f"it unset (on where the store's wills expire: TCPStore, etcd)")


def off_hint(what: str) -> str:
    """The error's text when ``what`` needs resilient groups and this process has none."""
    return (f"{what} needs resilient groups, which are off in this process: they are on by "
            f"default where the world's store holds wills that expire (TCPStore, etcd) unless "
            f"{RESILIENCE_ENV}=0; {RESILIENCE_ENV}=1 before init_process_group turns them on "
            f"for any store; and they need a world of more than one rank")


def hang_timeout_setting(given: float | None = None) -> float:
    """Seconds a member may stay silent before it counts as hung: ``given``, else
    ``PLUGDIST_HEARTBEAT_TIMEOUT``, else 10."""
    return given or _env_seconds(HANG_TIMEOUT_ENV, 10.0)


def interval_setting(hang_timeout: float, given: float | None = None) -> float:
    """Seconds between heartbeats: ``given``, else ``PLUGDIST_HEARTBEAT_INTERVAL``, else ten
    per ``hang_timeout`` (0.05 s to 1 s). Deaths wake the monitor at once (it waits on the
    death log): the interval paces only heartbeats and the monitor's periodic look."""
    return given or _env_seconds(INTERVAL_ENV, min(1.0, max(0.05, hang_timeout / 10)))


def _env_seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={text!r} must be positive")
    return value
