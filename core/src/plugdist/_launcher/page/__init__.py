"""``plugdist-run --page [HOST:]PORT``: a live page of the run, and the same data as JSON.

:class:`LivePage` ties the parts: :mod:`.watch` (what the page shows, gathered by one thread),
:mod:`.server` (HTTP, the token rule), :mod:`.assets` (the page). The agent makes one after its
rendezvous store is open, tells it each new round and the end; it costs the workers one status
write a second each (:mod:`plugdist._observability.page_reporter`), nothing per op.

Standard library only, like the rest of the launcher.
"""

from __future__ import annotations

from typing import Any

from plugdist._launcher.page.server import TOKEN_HEADER, PageServer
from plugdist._launcher.page.watch import Watch
from plugdist.errors import LaunchError

__all__ = ["LivePage", "parse_address", "TOKEN_HEADER"]


def parse_address(text: str) -> tuple[str, int]:
    """``PORT``, ``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); the host defaults to
    127.0.0.1, port 0 picks a free one. Raises ValueError."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--page {text!r}: expected PORT or HOST:PORT (0: a free port)")
    return (host.strip("[]") or "127.0.0.1"), int(port)


class LivePage:
    """The page of one run on this node. ``agent``: the agent (workers, host, config);
    ``store``: the rendezvous store; ``token``: the job's token as the user gave it
    (``PLUGDIST_STORE_TOKEN``, ``PLUGDIST_STORE_TOKEN_FILE`` or ``--rdzv-conf token_file``),
    required of every request beyond loopback. Not thread-safe: the agent's thread drives
    it."""

    def __init__(self, agent: Any, store: Any, address: str, token: bytes | None) -> None:
        from plugdist.store._tokens import is_loopback
        host, port = parse_address(address)
        if is_loopback(host):
            token = None
        else:
            if not token:
                raise LaunchError(
                    f"--page {address}: a page beyond loopback needs the job's store token, "
                    f"and none was given; give one (PLUGDIST_STORE_TOKEN_FILE=PATH in "
                    f"plugdist-run's environment, or --rdzv-conf token_file=PATH) or serve "
                    f"the page on 127.0.0.1 and reach it through an SSH tunnel")
        self.watch = Watch(agent, store)
        try:
            self.server = PageServer(self.watch, host, port, token)
        except OSError as exc:
            raise LaunchError(f"--page {address}: cannot listen there: {exc}") from exc
        self.needs_token = token is not None

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> None:
        self.watch.start()
        self.server.start()

    def new_round(self, assignment: Any) -> None:
        self.watch.new_round(assignment)

    def finish(self, exit_code: int, reason: str = "") -> None:
        """The run ended: show it; the page keeps serving this end state until :meth:`stop`."""
        self.watch.finish(exit_code, reason)

    def stop(self) -> None:
        self.server.stop()
