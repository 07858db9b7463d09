"""Makes every installed plugdist backend ``X`` a torch.distributed backend named ``plugdist_X``.

torch calls :func:`autoload` on ``import torch`` (entry point group ``torch.backends`` of the
``plugdist`` distribution). It only reads entry-point names and registers them with
``torch.distributed.Backend.register_backend``; no plugin is imported until someone builds a
group of it. It lives outside the ``plugdist`` package so that ``import torch`` does not pay for
``import plugdist`` (about 50 ms); the bridge itself is :mod:`plugdist.torch_bridge`.

``PLUGDIST_TORCH_BACKENDS=0`` switches the automatic registration off;
``plugdist.torch_bridge.register()`` registers explicitly.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import warnings
from collections.abc import Iterable
from typing import Any

__all__ = ["autoload", "register", "installed_backends", "PREFIX", "ENV_SWITCH"]

PREFIX = "plugdist_"
ENV_SWITCH = "PLUGDIST_TORCH_BACKENDS"
_BACKENDS_GROUP = "plugdist.backends"
# Until a group is built the plugin is not imported, so its device types are unknown: every
# name starts out as a CPU backend and gets the plugin's own ``device_types`` at its first group.
PROVISIONAL_DEVICES = ("cpu",)


def autoload() -> None:
    """The ``torch.backends`` entry point. Never raises: torch would turn an exception here into
    a failed ``import torch`` for every user of the environment. A failure becomes a
    RuntimeWarning and leaves ``plugdist_*`` backends unregistered."""
    try:
        if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
            return
        register()
    except Exception as err:  # noqa: BLE001 - see the docstring
        warnings.warn(f"plugdist: could not register plugdist backends with torch.distributed "
                      f"({type(err).__name__}: {err}); set {ENV_SWITCH}=0 to skip this step",
                      RuntimeWarning, stacklevel=2)


def installed_backends() -> list[str]:
    """Names in the ``plugdist.backends`` entry-point group (nothing is imported)."""
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=_BACKENDS_GROUP)})


def register(names: Iterable[str] | None = None) -> list[str]:
    """Register ``plugdist_<name>`` with torch.distributed for each name (default: every
    installed plugdist backend); returns the torch names. Idempotent: a name torch already
    knows is left as it is. Imports no plugin."""
    import torch.distributed as tdist

    if not tdist.is_available():
        return []
    done = []
    for name in installed_backends() if names is None else names:
        torch_name = PREFIX + name.lower()
        if torch_name.upper() not in tdist.Backend._plugins:
            tdist.Backend.register_backend(
                torch_name, functools.partial(_create, name.lower()), extended_api=True,
                devices=list(PROVISIONAL_DEVICES))
        done.append(torch_name)
    return done


# The bridge is named here, not imported: it imports this module (for ``register``), and this
# module must stay importable without plugdist. Loaded like any entry point, on first use.
BRIDGE_FACTORY = "plugdist.torch_bridge:create_group"


def _create(name: str, backend_options: Any, pg_options: Any) -> Any:
    """What torch calls to build a group of ``plugdist_<name>``: the first import of plugdist."""
    create_group = importlib.metadata.EntryPoint(
        name=name, value=BRIDGE_FACTORY, group="torch.backends").load()
    return create_group(name, backend_options, pg_options)
