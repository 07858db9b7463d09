"""Cutting an aborted group's Gloo connections from outside Gloo (Linux).

An aborted group's ops with a dead peer would otherwise stay in flight until Gloo's own timeout,
or until a survivor's process ends. If one is still in flight when this process exits, a Gloo
thread finishing it needs the interpreter after it is gone (torch hands the op's completion to
Python callbacks) and the process dies with SIGABRT. Gloo's own ``abort`` is no help: it can
raise ``gloo::IoException`` from a Gloo thread.

So the group's TCP connections are shut down (``shutdown(2)``, not closed: Gloo still owns the
descriptors). Gloo sees them drop, as when a peer dies, and fails every op still in flight at
once, while the interpreter is alive. The group's sockets are found by address: the ones
accepted on this rank's Gloo listening address, and the ones connected to a peer's.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator

__all__ = ["shut_down_connections", "socket_inodes"]

_ESTABLISHED = "01"


def _ipv4(hex_addr: str) -> str:
    return socket.inet_ntop(socket.AF_INET, int(hex_addr, 16).to_bytes(4, "little"))


def _ipv6(hex_addr: str) -> str:
    # four 32-bit words, each in host (little-endian) order
    raw = b"".join(int(hex_addr[i:i + 8], 16).to_bytes(4, "little") for i in range(0, 32, 8))
    return socket.inet_ntop(socket.AF_INET6, raw)


def _connections() -> Iterator[tuple[int, tuple[str, int], tuple[str, int]]]:
    """``(inode, local, remote)`` of every established TCP connection on this host."""
    for table, parse in (("/proc/net/tcp", _ipv4), ("/proc/net/tcp6", _ipv6)):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _ESTABLISHED:
                continue
            (lhost, lport), (rhost, rport) = (f.split(":") for f in fields[1:3])
            yield (int(fields[9]), (parse(lhost), int(lport, 16)),
                   (parse(rhost), int(rport, 16)))


def _socket_fds() -> dict[int, int]:
    """This process's socket descriptors by inode."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(name)
    return found


def socket_inodes() -> set[int]:
    """The inodes of this process's sockets now (empty where ``/proc`` is absent)."""
    return set(_socket_fds())


def shut_down_connections(ours: Callable[[tuple[str, int], tuple[str, int]], bool],
                          among: set[int] | None = None) -> int:
    """Shut down (both directions) this process's TCP connections for which
    ``ours(local, remote)`` holds and, given ``among``, whose socket inode is in it; returns
    how many. Non-blocking; a connection that went away meanwhile is skipped. Does nothing
    where ``/proc`` is absent."""
    fds = _socket_fds()
    done = 0
    for inode, local, remote in _connections():
        fd = fds.get(inode)
        if fd is None or not ours(local, remote) or (among is not None and inode not in among):
            continue
        if _shut_down_if(fd, inode):
            done += 1
    return done


def _shut_down_if(fd: int, inode: int) -> bool:
    """Shut down the socket behind descriptor ``fd`` if it is still socket ``inode``.

    The descriptors were listed before: since then Gloo may have closed ``fd`` (a connection
    that failed, or one this loop shut down a moment ago) and a socket of the group being
    built meanwhile on another thread may have got its number. So the socket is pinned by a
    duplicate descriptor and checked by inode before it is shut down; the duplicate is closed
    after, and Gloo's own descriptor is never touched."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False  # closed meanwhile
    sock: socket.socket | None = None
    try:
        if os.fstat(dup).st_ino != inode:
            return False  # the number was reused: another socket now
        sock = socket.socket(fileno=dup)
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        if sock is not None:
            sock.close()  # closes the duplicate only
        else:
            os.close(dup)
