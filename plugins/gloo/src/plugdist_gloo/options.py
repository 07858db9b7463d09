"""``GlooOptions`` (the plugin's ``pg_options``) and the choice of Gloo transport devices."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from plugdist.errors import DistNetworkError

__all__ = ["GlooOptions", "make_devices", "IFNAME_ENV"]

IFNAME_ENV = "GLOO_SOCKET_IFNAME"


@dataclass(frozen=True)
class GlooOptions:
    """Options for a gloo group, passed as ``pg_options=`` (``GroupOptions.backend_options``).

    ``interfaces``: network interfaces to bind, one Gloo device each (ops go round-robin across
    them); every rank must name the same number. Empty: ``$GLOO_SOCKET_IFNAME`` (comma-separated),
    else ``hostname``, else torch's default device (the host's address if it can be bound,
    otherwise loopback). ``threads``: Gloo worker threads per group.
    """

    interfaces: tuple[str, ...] = ()
    hostname: str | None = None
    threads: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.interfaces, str):
            raise TypeError("GlooOptions.interfaces is a tuple of names, e.g. ('eth0',), "
                            "not a string")
        if not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"GlooOptions.threads must be a positive int, got {self.threads!r}")


def _interfaces(options: GlooOptions) -> list[str]:
    if options.interfaces:
        return list(options.interfaces)
    env = os.environ.get(IFNAME_ENV, "")
    return [name.strip() for name in env.split(",") if name.strip()]


def make_devices(options: GlooOptions, where: str) -> list[Any]:
    """Gloo transport devices for ``options`` (see :class:`GlooOptions`). Raises
    ``DistNetworkError`` naming the interface and the ones that exist when one cannot be used."""
    from torch.distributed import ProcessGroupGloo

    names = _interfaces(options)
    if names:
        devices = []
        for name in names:
            try:
                devices.append(ProcessGroupGloo.create_device(interface=name))
            except RuntimeError as exc:
                known = ", ".join(n for _, n in socket.if_nameindex())
                source = "GlooOptions.interfaces" if options.interfaces else f"${IFNAME_ENV}"
                raise DistNetworkError(
                    f"{where} cannot use network interface {name!r} (from {source}): {exc}; "
                    f"interfaces on this host: {known}") from exc
        return devices
    if options.hostname:
        try:
            return [ProcessGroupGloo.create_device(hostname=options.hostname)]
        except RuntimeError as exc:
            raise DistNetworkError(f"{where} cannot bind to hostname {options.hostname!r}: {exc}; "
                                   f"pass an address of this host, or set {IFNAME_ENV}") from exc
    return [ProcessGroupGloo.create_default_device()]
