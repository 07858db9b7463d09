"""Makes every installed plugdist backend ``X`` a torch.distributed backend named ``plugdist_X``.

torch calls :func:`autoload` on ``import torch`` (entry point group ``torch.backends`` of the
``plugdist`` distribution). It only reads entry-point names and registers them with
``torch.distributed.Backend.register_backend``; no plugin is imported until someone builds a
group of it. It lives outside the ``plugdist`` package so that ``import torch`` does not pay for
``import plugdist`` (about 50 ms); the bridge itself is :mod:`plugdist._torch.bridge`.

It also lets torch's own ``env://`` rendezvous (what ``init_process_group`` runs before it
builds any group) find the world under mpiexec, mpirun and srun, as plugdist's ``env://`` does:
:func:`install_env_fallback`.

``PLUGDIST_TORCH_BACKENDS=0`` switches both off; ``plugdist._torch.bridge.register()`` registers
explicitly.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import warnings
from collections.abc import Iterable
from typing import Any

__all__ = ["autoload", "register", "installed_backends", "install_env_fallback", "PREFIX",
           "ENV_SWITCH"]

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
        install_env_fallback()
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


# what mpiexec (MPICH/Hydra), mpirun (Open MPI) and srun set for every rank they start
_LAUNCHER_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


# what torch's env:// reads; torchrun and plugdist-run set all four
_TORCH_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def install_env_fallback() -> None:
    """Wrap torch's ``env://`` rendezvous handler: where a launcher set its rank variable and
    one of ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` is missing, plugdist's
    :func:`plugdist._world.rendezvous.adopt_launcher_env` first fills in the missing ones (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` and, on one host or under srun, ``MASTER_ADDR``/
    ``MASTER_PORT``) unless a ``RANK``/``WORLD_SIZE`` already set differs from the launcher's;
    torch's handler then runs as always. This covers libraries that copy the launcher's rank
    into ``RANK`` themselves but not its master (Accelerate under a bare mpiexec). Anything else
    goes straight to torch's handler, unchanged. Idempotent; imports nothing beyond
    torch.distributed until a fallback is needed."""
    import torch.distributed as tdist

    if not tdist.is_available():
        return
    # the module, not the function that torch.distributed exports under the same name
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    torch_env = rdzv._rendezvous_handlers.get("env")
    if torch_env is None or getattr(torch_env, "plugdist_fallback", False):
        return

    def env_handler(url: str, *args: Any, **kwargs: Any) -> Any:
        if (any(v not in os.environ for v in _TORCH_ENV_VARS)
                and any(v in os.environ for v in _LAUNCHER_RANK_VARS)):
            from urllib.parse import parse_qs, urlparse

            from plugdist._world.rendezvous import adopt_launcher_env

            # torch puts init_process_group's rank= and world_size= in the URL's query
            query = parse_qs(urlparse(url).query)
            given = [query.get(k, ["-1"])[0] for k in ("rank", "world_size")]
            adopt_launcher_env(*(int(v) if v.lstrip("-").isdigit() else -1 for v in given))
        return torch_env(url, *args, **kwargs)

    env_handler.plugdist_fallback = True  # type: ignore[attr-defined]
    env_handler.__wrapped__ = torch_env  # type: ignore[attr-defined]
    rdzv._rendezvous_handlers["env"] = env_handler


# The bridge is named here, not imported: it imports this module (for ``register``), and this
# module must stay importable without plugdist. Loaded like any entry point, on first use.
BRIDGE_FACTORY = "plugdist._torch.bridge:create_group"


def _create(name: str, backend_options: Any, pg_options: Any) -> Any:
    """What torch calls to build a group of ``plugdist_<name>``: the first import of plugdist."""
    create_group = importlib.metadata.EntryPoint(
        name=name, value=BRIDGE_FACTORY, group="torch.backends").load()
    return create_group(name, backend_options, pg_options)
