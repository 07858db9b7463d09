"""Who may hold a world's identity: a connection's credential for CLAIM and JOIN.

With a token, a connection proved it knows the job's secret in its handshake: that is its
credential. Without one, the server asks the kernel which Unix user owns the peer's socket (one
``NETLINK_SOCK_DIAG`` query for the connection's exact addresses, ``/proc/net/tcp{,6}`` where
that is not answered) and takes a claim or join only from the user that runs the server (or
root, who can read any process's token anyway). Every local user can reach a loopback port, so
this is what keeps other users' processes out of a tokenless loopback world. A peer the kernel
does not know is on another host (a store whose tokens were turned off): nothing can be checked.

Joining a tokenless world takes one more step: ``PLUGDIST_ALLOW_TOKENLESS_JOIN=1`` in the
environment of the process that hosts the store. :func:`socket_owner` also serves a tokenless
client, which trusts only a server of its own user. A query is one round trip to the kernel
(tens of microseconds; thread-safe), made once per claim or join, and once per connection a
tokenless client opens to a server on this host.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import pwd
import socket
import struct
import threading
import time
from typing import Any

__all__ = ["ALLOW_TOKENLESS_JOIN_ENV", "Admission", "socket_owner"]

ALLOW_TOKENLESS_JOIN_ENV = "PLUGDIST_ALLOW_TOKENLESS_JOIN"

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_NLMSG = struct.Struct("=IHHII")         # length, type, flags, seq, pid
_DIAG_REQ = struct.Struct("=BBBBI")      # family, protocol, extensions, pad, states
_NO_COOKIE = struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF)  # interface, "any socket"
_UID_AT = _NLMSG.size + 4 + 48 + 12      # idiag_uid in the reply's inet_diag_msg
_UNKNOWN = -1
_NOT_YET = (0.001, 0.004, 0.016, 0.064)  # pauses before asking again for a local peer not found


def _unmapped(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class _Diag:
    """One netlink socket to the kernel's socket diagnostics, opened when first needed and
    shared by the process's threads (a server's, and its clients' connecting ones)."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._seq = 0
        self._lock = threading.Lock()
        self.broken = not hasattr(socket, "AF_NETLINK")
        self.answered = False  # a query found a socket: sock_diag works on this host

    def owner(self, peer: tuple[Any, int], local: tuple[Any, int]) -> int | None:
        """The uid owning the TCP socket at ``peer`` connected to ``local``; None: the kernel
        knows no such socket; -1: the kernel did not answer (no sock_diag here)."""
        if self.broken:
            return _UNKNOWN
        with self._lock:
            return self._ask(peer, local)

    def _ask(self, peer: tuple[Any, int], local: tuple[Any, int]) -> int | None:
        family = socket.AF_INET if peer[0].version == 4 else socket.AF_INET6
        body = (_DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
                + struct.pack("!HH", peer[1], local[1])
                + peer[0].packed.ljust(16, b"\0") + local[0].packed.ljust(16, b"\0")
                + _NO_COOKIE)
        self._seq += 1
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM,
                                           _NETLINK_SOCK_DIAG)
                self._sock.settimeout(1.0)
            self._sock.send(_NLMSG.pack(_NLMSG.size + len(body), _SOCK_DIAG_BY_FAMILY,
                                        _NLM_F_REQUEST, self._seq, 0) + body)
            while True:
                reply = self._sock.recv(8192)
                if _NLMSG.unpack_from(reply)[3] == self._seq:
                    break
        except TimeoutError:  # no answer in time: ask /proc this once, and a fresh socket next
            self.close()
            return _UNKNOWN
        except OSError:
            self.close()
            self.broken = True
            return _UNKNOWN
        kind = _NLMSG.unpack_from(reply)[1]
        if kind == _NLMSG_ERROR:
            # ENOENT is both "no such socket" and "no TCP diagnostics in this kernel"
            (code,) = struct.unpack_from("=i", reply, _NLMSG.size)
            return None if -code == errno.ENOENT else _UNKNOWN
        if len(reply) < _UID_AT + 4:
            return _UNKNOWN
        self.answered = True
        return int(struct.unpack_from("=I", reply, _UID_AT)[0])

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def forked(self) -> None:
        """In a child of fork(): a socket of its own (the kernel answers a netlink socket, and
        a socket shared with the parent hands one process's answers to the other, which
        discards them), and a lock no parent thread can be holding."""
        self._sock = None
        self._lock = threading.Lock()


def _proc_hex(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    """An address as ``/proc/net/tcp{,6}`` writes it (32-bit words in host order)."""
    words = len(ip.packed) // 4
    return "".join(f"{word:08X}" for word in struct.unpack(f"={words}I", ip.packed)) \
        + f":{port:04X}"


def _proc_owner(peer: tuple[Any, int], local: tuple[Any, int]) -> int | None:
    """Like :meth:`_Diag.owner`, from ``/proc/net/tcp{,6}`` (a scan of every socket)."""
    table = "/proc/net/tcp" if peer[0].version == 4 else "/proc/net/tcp6"
    want = (_proc_hex(*peer), _proc_hex(*local))
    try:
        with open(table) as f:
            next(f, None)
            for line in f:
                fields = line.split()
                if len(fields) > 7 and (fields[1], fields[2]) == want:
                    return int(fields[7])
    except OSError:
        return _UNKNOWN
    return None


_diag = _Diag()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_diag.forked)


def socket_owner(sock: socket.socket, listener: bool = False) -> int | None:
    """The uid of the Unix user whose process owns the other end of ``sock`` (a connected TCP
    socket), when that end is on this host; None when it is not (or is gone); -1 when this
    platform cannot tell. Blocks for one query to the kernel; with ``listener`` (the other end
    is a server's, which may not have accepted the connection yet) up to 85 ms more for a
    loopback peer not found at once. The server never waits so (its peer's socket exists
    until the peer closes it)."""
    try:
        peer_addr, peer_port = sock.getpeername()[:2]
        local_addr, local_port = sock.getsockname()[:2]
        peer = (_unmapped(peer_addr), peer_port)
        local = (_unmapped(local_addr), local_port)
        raw = (ipaddress.ip_address(peer_addr.split("%")[0]), peer_port)
    except (OSError, ValueError):
        return None
    if peer[0].version != local[0].version:
        return None
    uid = _diag.owner(peer, local)
    if uid is None and raw[0] != peer[0]:
        # a v4-mapped address: the other end is an IPv4 socket, or an IPv6 one that used it
        uid = _diag.owner(raw, (ipaddress.ip_address(local_addr.split("%")[0]), local_port))
    if uid is None and listener and _diag.answered and peer[0].is_loopback:
        # sock_diag works here, and the other end is on this host: it is not in the kernel's
        # tables yet (a connect completes before the listener's side exists when thousands
        # connect at once); it will be within milliseconds
        for pause in _NOT_YET:
            time.sleep(pause)
            uid = _diag.owner(peer, local)
            if uid is not None:
                break
    if uid is None or uid == _UNKNOWN:
        # not found may also mean this kernel has no TCP diagnostics: ask /proc (a scan of
        # every socket), and if it knows the socket and sock_diag never answered, ask it from
        # now on
        uid = _proc_owner(peer, local)
        if uid is not None and uid != _UNKNOWN and not _diag.answered:
            _diag.broken = True
    return uid


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


class Admission:
    """Whether a connection may claim or join a world on this server (see the module
    docstring). ``token``: whether the server has one (its connections proved it)."""

    def __init__(self, token: bool) -> None:
        self._token = token
        self._uid = os.geteuid()

    def refusal(self, conn: Any, op: str) -> str | None:
        """None when ``conn`` may ``op`` ("claim" or "join"), else why not (and the fix)."""
        if self._token:
            return None
        if op == "join" and os.environ.get(ALLOW_TOKENLESS_JOIN_ENV) != "1":
            return (f"this store has no token, so nothing proves that a joiner belongs to the "
                    f"job. Give every process of the job a token (PLUGDIST_STORE_TOKEN or "
                    f"PLUGDIST_STORE_TOKEN_FILE, the joiners' too; plugdist-run makes one per "
                    f"run), or set {ALLOW_TOKENLESS_JOIN_ENV}=1 in the environment of the "
                    f"process that hosts the store (rank 0, or the launcher) to let any process "
                    f"of its Unix user that reaches the port join")
        uid = socket_owner(conn.sock)
        if uid is None:
            peer = getattr(conn, "peer", "")
            host = peer.rpartition(":")[0].strip("[]")
            try:
                local = _unmapped(host).is_loopback
            except ValueError:
                local = True
            if not local:
                return None  # another host's process: tokens were turned off explicitly
            return (f"the kernel knows no process at {peer} (it closed?), so its Unix user "
                    f"cannot be checked; give the job a token (PLUGDIST_STORE_TOKEN)")
        if uid in (_UNKNOWN, self._uid, 0):
            return None
        return (f"the process connected from {conn.peer} runs as {_user(uid)}, but this store "
                f"belongs to {_user(self._uid)}: without a token only processes of the store's "
                f"own user may {op} (every local user can reach a loopback port). If that "
                f"process is the job's, give every process the same token "
                f"(PLUGDIST_STORE_TOKEN or PLUGDIST_STORE_TOKEN_FILE)")
