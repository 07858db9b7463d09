"""The page's HTTP server: the standard library's, in daemon threads, read-only.

Routes: ``/`` the page (one HTML file, its script inline: no framework, nothing fetched from
elsewhere), ``/api/state`` the snapshot as JSON, ``/api/ops`` the ranks' last answers about
their recent ops, ``/api/ops?ask=1`` a new request for them. Only GET and HEAD.

Access: on a loopback address anyone on this host may read it, as anyone here may read the
processes' command lines. Beyond loopback every request must carry the job's store token, in the
header ``X-Plugdist-Token`` or the query ``?token=`` (the page itself moves a query token into
its requests' header and out of the address bar); compared in constant time. No request is
logged, so a token in a query never reaches a log.
"""

from __future__ import annotations

import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from plugdist._launcher.page.assets import page_html
from plugdist._launcher.page.watch import Watch

__all__ = ["PageServer", "TOKEN_HEADER"]

TOKEN_HEADER = "X-Plugdist-Token"


class PageServer:
    """Serves ``watch`` on ``host:port`` (0: a free port) until :meth:`stop`. ``token``: required
    of every request when not None."""

    def __init__(self, watch: Watch, host: str, port: int, token: bytes | None) -> None:
        handler = type("Handler", (_Handler,), {"watch": watch, "token": token})
        family_host = host.strip("[]")
        server_class = _V6Server if ":" in family_host else ThreadingHTTPServer
        self.httpd = server_class((family_host, port), handler)
        self.httpd.daemon_threads = True
        self.host = family_host
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever,
                                        kwargs={"poll_interval": 0.2},
                                        name="plugdist-run-page", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _V6Server(ThreadingHTTPServer):
    import socket as _socket
    address_family = _socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    watch: Watch
    token: bytes | None
    server_version = "plugdist-run"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass   # a query may hold the token: nothing about a request is logged

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
        self._serve(head=True)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._serve(head=False)

    def _allowed(self, query: dict[str, list[str]]) -> bool:
        if self.token is None:
            return True
        given = self.headers.get(TOKEN_HEADER) or (query.get("token") or [""])[0]
        return hmac.compare_digest(given.encode(), self.token)

    def _serve(self, head: bool) -> None:
        parts = urlsplit(self.path)
        query = parse_qs(parts.query)
        if not self._allowed(query):
            self._reply(403, "text/plain", b"plugdist-run page: this page listens beyond "
                        b"loopback and needs the job's store token, in the X-Plugdist-Token "
                        b"header or ?token=\n", head)
            return
        try:
            if parts.path in ("/", "/index.html"):
                self._reply(200, "text/html; charset=utf-8", page_html(), head)
            elif parts.path == "/api/state":
                self._json(self.watch.snapshot, head)
            elif parts.path == "/api/ops":
                asked = self.watch.ask_ops() if query.get("ask") == ["1"] else None
                answer = self.watch.ops()
                if asked is not None:
                    answer["request"] = asked
                self._json(answer, head)
            else:
                self._reply(404, "text/plain", b"not found\n", head)
        except Exception as err:  # noqa: BLE001 - the store went away as the run ended
            self._reply(503, "text/plain", f"the run's store does not answer: {err}\n".encode(),
                        head)

    def _json(self, data: Any, head: bool) -> None:
        self._reply(200, "application/json", json.dumps(data).encode(), head)

    def _reply(self, code: int, kind: str, body: bytes, head: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if not head:
            self.wfile.write(body)
