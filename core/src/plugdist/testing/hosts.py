"""Two hosts on one Linux machine: network namespaces joined by a veth pair.

Each namespace has an interface ``pdnet`` with a private address (``10.231.N.1`` and
``10.231.N.2``) that exists only inside it, and its own loopback; processes in either see the
same files and the same process ids as the machine's. Creating them needs root (CAP_SYS_ADMIN)
and iproute2's ``ip`` and ``tc``. :meth:`Hosts.partition` cuts the network between them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


class Hosts:
    """Two network namespaces ``ns[0]``, ``ns[1]`` with addresses ``addr[0]``, ``addr[1]`` on an
    interface named ``pdnet`` in each. Names and addresses derive from this process's pid, so
    two processes' hosts do not collide. Not thread-safe; :meth:`remove` is idempotent."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = (f"pd15a{tag}", f"pd15b{tag}")
        subnet = 1 + os.getpid() % 250
        self.addr = (f"10.231.{subnet}.1", f"10.231.{subnet}.2")
        self._veth = (f"pdva{tag}", f"pdvb{tag}")

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here (not Linux, no ``ip``, not root), or None."""
        if not sys.platform.startswith("linux") or shutil.which("ip") is None:
            return "needs Linux network namespaces and the `ip` tool (iproute2)"
        if os.geteuid() != 0:
            return "creating network namespaces needs root (CAP_SYS_ADMIN)"
        return None

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)

    def create(self) -> None:
        """Make both namespaces and the link; raises ``CalledProcessError`` (with ``ip``'s
        message in ``stderr``) where that fails: call :meth:`remove` then."""
        for ns in self.ns:
            self._ip("netns", "add", ns)
        self._ip("link", "add", self._veth[0], "type", "veth", "peer", "name", self._veth[1])
        for ns, veth, addr in zip(self.ns, self._veth, self.addr, strict=True):
            self._ip("link", "set", veth, "netns", ns)
            self._ip("-n", ns, "link", "set", veth, "name", "pdnet")
            self._ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "pdnet")
            self._ip("-n", ns, "link", "set", "pdnet", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")

    def remove(self) -> None:
        for ns in self.ns:   # deleting a namespace deletes its veth end, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)

    def argv(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``host``'s namespace (the same pid: ``ip netns exec``
        execs it)."""
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def popen(self, host: int, argv: list[str],
              env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """``argv`` on host ``host`` with Gloo pointed at ``pdnet``; text pipes for stdout and
        stderr."""
        full_env = {**os.environ, "GLOO_SOCKET_IFNAME": "pdnet", **(env or {})}
        return subprocess.Popen(self.argv(host, argv), env=full_env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def partition(self, cut: bool) -> None:
        """Cut (``True``) or heal the network between the hosts: a queue that holds no packet
        on each end drops everything sent either way, as a partition does (connections stay
        open; nothing tells either side). Healing an uncut network does nothing."""
        for ns in self.ns:
            if cut:
                subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", "pdnet", "root",
                                "pfifo", "limit", "0"],
                               check=True, capture_output=True, text=True, timeout=10)
            else:
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", "pdnet", "root"],
                               capture_output=True, timeout=10)
