"""Where a store's shared secret (its token) comes from, and when a store must have one.

A token reaches a process through its environment (``PLUGDIST_STORE_TOKEN``) or a file
(``PLUGDIST_STORE_TOKEN_FILE``, ``plugdist-run --rdzv-conf token_file=PATH``), never through a
command line, which every local user can read in ``/proc``. A store that listens beyond
loopback must have one unless it was turned off explicitly (``token=""``, or
``PLUGDIST_STORE_TOKEN`` set to the empty string); docs/stores.md shows how a scheduler (Slurm,
Kubernetes, mpiexec) hands one to every node.
"""

from __future__ import annotations

import ipaddress
import os
import stat
import warnings

from plugdist.errors import DistStoreError

__all__ = ["TOKEN_ENV", "TOKEN_FILE_ENV", "resolve_token", "read_token_file", "is_loopback",
           "tokenless_exposure"]

TOKEN_ENV = "PLUGDIST_STORE_TOKEN"
TOKEN_FILE_ENV = "PLUGDIST_STORE_TOKEN_FILE"
_warned_tokenless: set[str] = set()
# a token file's mode bits that let users other than its owner read or change it
_OTHERS = stat.S_IRGRP | stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH


def read_token_file(path: str) -> bytes:
    """The token in the file ``path`` (trailing whitespace and newlines dropped). Raises
    DistStoreError when it cannot be read, is empty, or other users may read or change it (as
    ssh refuses such a private key: the token would be theirs too)."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            token = f.read().rstrip()
    except OSError as e:
        raise DistStoreError(f"cannot read the store's token file {path!r} ({e.strerror or e}); "
                             f"{TOKEN_FILE_ENV} / token_file= must name a file this process can "
                             f"read") from e
    if mode & _OTHERS:
        raise DistStoreError(f"the store's token file {path!r} can be read or changed by other "
                             f"users (mode {stat.S_IMODE(mode):o}), so its token is not this "
                             f"job's secret; `chmod 600 {path}` (only its owner may read it), "
                             f"and make a new token if others may have read this one")
    if not token:
        raise DistStoreError(f"the store's token file {path!r} is empty; write a secret into it "
                             f"(e.g. `openssl rand -hex 32 > {path}; chmod 600 {path}`)")
    return token


def resolve_token(token: str | bytes | None = None) -> tuple[bytes | None, bool]:
    """``(token, chosen)``: the token to use (None: none) and whether one was chosen at all.
    An argument wins (``""`` turns tokens off: chosen, no token); else ``PLUGDIST_STORE_TOKEN``
    (set to ``""``: off); else the file ``PLUGDIST_STORE_TOKEN_FILE`` names; else nothing was
    chosen."""
    if token is None:
        env = os.environ
        if TOKEN_ENV in env:
            token = env[TOKEN_ENV]
        elif env.get(TOKEN_FILE_ENV):
            return read_token_file(env[TOKEN_FILE_ENV]), True
        else:
            return None, False
    if isinstance(token, str):
        token = token.encode()
    if not isinstance(token, bytes):
        raise TypeError(f"TCPStore token must be str or bytes, got {type(token).__name__}")
    return token or None, True


def is_loopback(host: str) -> bool:
    """Whether ``host`` is written as a loopback address (``127.x``, ``::1``, ``localhost``).
    A name that merely resolves to one (a Debian host's own name) is not: other hosts may reach
    it under another address."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def tokenless_exposure(where: str, chosen: bool, port: int) -> None:
    """A store about to listen on ``where`` (beyond loopback) without a token: refuse unless
    tokens were turned off explicitly (``chosen``), then say so once per port."""
    if not chosen:
        raise DistStoreError(
            f"TCPStore: the store on port {port} would listen on {where}, beyond loopback, "
            f"without a token: any process that reaches the port could use it. Give every "
            f"process of the job the same secret: {TOKEN_FILE_ENV}=PATH (a file only you can "
            f"read) or {TOKEN_ENV} in the environment (plugdist-run: --rdzv-conf "
            f"token_file=PATH; docs/stores.md shows Slurm, Kubernetes and mpiexec); or turn "
            f"tokens off explicitly with {TOKEN_ENV}= (empty) or token=\"\"")
    key = f"{where}:{port}"
    if key not in _warned_tokenless:
        _warned_tokenless.add(key)
        warnings.warn(f"TCPStore on port {port} listens on {where} without a token (turned off "
                      f"explicitly): any process that reaches the port can read and write its "
                      f"plain keys (a world's membership stays protected). Set "
                      f"{TOKEN_FILE_ENV} or {TOKEN_ENV} on every process to require one.",
                      UserWarning, stacklevel=3)
