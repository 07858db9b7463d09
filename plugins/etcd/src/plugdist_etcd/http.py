"""A lean HTTP/1.1 client for etcd's JSON gateway: keep-alive connections to one endpoint, one
``POST`` with a JSON body at a time per connection.

Why not urllib3: on the 2-core development machine a urllib3 request costs about 280 us of
Python CPU (header objects, the email-based response parser, pool bookkeeping), a third of a
whole etcd write there; this costs about 35 us, and every store op is one or a few such
requests. Watches (:meth:`Endpoint.stream`) get a connection each, read as the lines arrive.

Thread-safe: a connection is used by one request at a time (taken from the idle list and put
back after a complete response).
"""

from __future__ import annotations

import io
import socket
import ssl
import threading
import time
from collections.abc import Generator
from urllib.parse import urlsplit

__all__ = ["HTTPFailure", "Endpoint", "ssl_context"]

_MAX_HEADER_LINES = 100


class HTTPFailure(Exception):
    """A request got no complete response (connection refused, reset or closed, a timeout, a
    malformed reply); whether the server acted on it is unknown. ``timeout``: it was the read
    timeout."""

    def __init__(self, message: str, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


def ssl_context(ca_file: str | None, cert_file: str | None,
                key_file: str | None) -> ssl.SSLContext:
    """TLS as the store takes it: the server verified against ``ca_file`` when given (not at
    all without one, as etcdctl's ``--insecure-skip-tls-verify``), and a client certificate."""
    context = ssl.create_default_context(cafile=ca_file)
    if not ca_file:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    return context


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = sock.makefile("rb")

    def close(self) -> None:
        try:
            self.reader.close()
            self.sock.close()
        except OSError:
            pass


class Endpoint:
    """Keep-alive connections to one endpoint (``http://host:port`` or ``https://...``), at
    most ``keep`` of them idle."""

    def __init__(self, url: str, context: ssl.SSLContext | None = None, keep: int = 8) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 2379)
        self._context = context if parts.scheme == "https" else None
        self._keep = keep
        self._idle: list[_Connection] = []
        self._streams: set[_Connection] = set()  # open by stream(): close() ends them
        self._lock = threading.Lock()
        self._host_header = f"Host: {parts.netloc}\r\n".encode()

    def _connect(self, timeout: float) -> _Connection:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except OSError as err:
            raise HTTPFailure(f"cannot connect: {err}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._context is not None:
            try:
                sock = self._context.wrap_socket(sock, server_hostname=self.host)
            except (OSError, ssl.SSLError) as err:
                sock.close()
                raise HTTPFailure(f"TLS handshake failed: {err}") from None
        return _Connection(sock)

    def _request(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        return b"".join((b"POST ", path.encode(), b" HTTP/1.1\r\n", self._host_header,
                         *(f"{k}: {v}\r\n".encode() for k, v in headers.items()),
                         b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body))

    def post(self, path: str, body: bytes, headers: dict[str, str], connect_timeout: float,
             read_timeout: float) -> tuple[int, bytes]:
        """POST ``body`` to ``path``; returns the status and the body. Raises
        :class:`HTTPFailure` when no complete response came back. Blocks up to about
        ``connect_timeout`` + ``read_timeout`` (the read timeout bounds each wait for data)."""
        request = self._request(path, body, headers)
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is not None:
            try:
                return self._exchange(conn, request, read_timeout)
            except HTTPFailure as err:
                if err.timeout:
                    raise
                # an idle connection the server had closed: once more on a new one (etcd's
                # writes are guarded against applying twice, see plugdist_etcd.store)
        return self._exchange(self._connect(connect_timeout), request, read_timeout)

    def stream(self, path: str, body: bytes, headers: dict[str, str], connect_timeout: float,
               deadline: float, expect: int = 0,
               expect_gap: float = 0.0) -> Generator[bytes, None, None]:
        """POST ``body`` to ``path`` on a connection of its own and return the response body's
        lines, read as they arrive, until the server ends it, the connection breaks or
        ``deadline`` (a ``time.monotonic()`` value) passes: the iterator then ends quietly and
        the connection is closed; also when, after a first line, ``expect_gap`` seconds pass
        without one while fewer than ``expect`` lines came. Raises :class:`HTTPFailure` here,
        before any line, when the response does not start (connection refused, no answer by
        ``deadline``)."""
        conn = self._connect(connect_timeout)
        try:
            conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            conn.sock.sendall(self._request(path, body, headers))
            _, length, chunked, _ = _read_head(conn.reader)
        except (OSError, ValueError) as err:
            conn.close()
            raise HTTPFailure(f"{type(err).__name__}: {err}",
                              timeout=isinstance(err, TimeoutError)) from None
        with self._lock:
            self._streams.add(conn)
        return self._lines(conn, length, chunked, deadline, expect, expect_gap)

    def _lines(self, conn: _Connection, length: int, chunked: bool, deadline: float,
               expect: int, expect_gap: float) -> Generator[bytes, None, None]:
        reader = conn.reader
        buf = b""
        gap_ends = deadline   # until the first line, only the deadline
        try:
            while True:
                left = min(deadline, gap_ends) - time.monotonic()
                if left <= 0:
                    return
                conn.sock.settimeout(left)
                if chunked:
                    size = int(reader.readline(1026).split(b";", 1)[0], 16)
                    if size == 0:
                        return
                    data = _exactly(reader, size)
                    reader.readline(3)
                else:
                    data = reader.read1(65536 if length < 0 else min(length, 65536))
                    if not data:
                        return
                    if length >= 0:
                        length -= len(data)
                buf += data
                while b"\n" in buf:
                    line, _, buf = buf.partition(b"\n")
                    expect -= 1
                    gap_ends = time.monotonic() + expect_gap if expect > 0 else deadline
                    yield line
                if length == 0 and not chunked:
                    return
        except (OSError, ValueError):
            return  # the deadline passed (a timeout), the member went away, or close()
        finally:
            with self._lock:
                self._streams.discard(conn)
            conn.close()

    def _exchange(self, conn: _Connection, request: bytes, timeout: float) -> tuple[int, bytes]:
        try:
            conn.sock.settimeout(timeout)
            conn.sock.sendall(request)
            status, data, reuse = _read_response(conn.reader)
        except TimeoutError:
            conn.close()
            raise HTTPFailure(f"no answer within {timeout:.3g}s", timeout=True) from None
        except (OSError, ValueError) as err:
            conn.close()
            raise HTTPFailure(f"{type(err).__name__}: {err}") from None
        if reuse:
            with self._lock:
                if len(self._idle) < self._keep:
                    self._idle.append(conn)
                    return status, data
        conn.close()
        return status, data

    def close(self) -> None:
        """Close the idle connections and end the open streams: a thread reading one sees it
        end at once."""
        with self._lock:
            idle, self._idle = self._idle, []
            streams = list(self._streams)
        for conn in idle:
            conn.close()
        for conn in streams:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader; it closes the socket
            except OSError:
                pass


def _read_response(reader: io.BufferedReader) -> tuple[int, bytes, bool]:
    """(status, body, whether the connection may be reused) of one response."""
    status, length, chunked, reuse = _read_head(reader)
    readline = reader.readline
    if chunked:
        parts = []
        while True:
            size = int(readline(1026).split(b";", 1)[0], 16)
            if size == 0:
                while readline(65537) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                break
            parts.append(_exactly(reader, size))
            readline(3)
        return status, b"".join(parts), reuse
    if length >= 0:
        return status, _exactly(reader, length), reuse
    return status, reader.read(), False  # to the end of the connection


def _read_head(reader: io.BufferedReader) -> tuple[int, int, bool, bool]:
    """A response's status line and headers: (status, Content-Length or -1, whether chunked,
    whether the connection may be reused)."""
    readline = reader.readline
    line = readline(65537)
    if not line:
        raise ValueError("the server closed the connection")
    version, _, rest = line.partition(b" ")
    status = int(rest[:3])
    length = -1
    chunked = False
    reuse = version == b"HTTP/1.1"
    for _ in range(_MAX_HEADER_LINES):
        line = readline(65537)
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"connection":
            reuse = reuse and b"close" not in value.lower()
    else:
        raise ValueError("too many header lines")
    return status, length, chunked, reuse


def _exactly(reader: io.BufferedReader, n: int) -> bytes:
    data = reader.read(n)
    if len(data) != n:
        raise ValueError("the server closed the connection mid-response")
    return data
