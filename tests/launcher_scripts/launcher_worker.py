"""A worker for tests/test_launcher.py: ``launcher_worker.py OUTDIR MODE [extra args...]``.

Imports only the standard library so that starting it costs little. Every mode writes what it
saw to files in OUTDIR (the test's tmp_path, which also makes the command line unique, so the
test can tell these processes from unrelated ones in /proc). Modes:

env         write the launcher's variables and argv to rank<R>.json; ``exit=R:CODE`` in the
            extra args makes rank R exit with CODE once every other rank has written its file
fail        rank 0 starts a grandchild that ignores SIGTERM, rank 2 ignores SIGTERM itself,
            rank 1 raises ValueError once the others are up; the rest sleep
sigkill     rank 1 kills itself with SIGKILL once rank 0 is up; rank 0 sleeps
segv        rank 1 reads address 0 (a real SIGSEGV, in ``crash_in_native_code``) once rank 0 is
            up; rank 0 sleeps
hang        every rank starts a grandchild that ignores SIGTERM, records SIGTERM when it
            arrives, and otherwise sleeps
rendezvous  ranks meet over a socket at MASTER_ADDR:MASTER_PORT (rank 0 listens) and each
            writes the set of ranks it heard of, plus its variables, to rank<R>.json
restart     writes rank<R>.attempt<N>.json; rank 1 raises (through plugdist's ``record``, so
            the error file is written) on attempt 0, once the others wrote theirs
usr1        records SIGUSR1 in rank<R>.usr1 and exits 0 on it; otherwise sleeps
elastic     writes w<WORLD_SIZE>.rank<R>.json; in a world of WORLD_SIZE == extra[0], or in the
            first round (waiting for more nodes to join), it sleeps until stopped; else exits 0
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "PLUGDIST_RUN_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PLUGDIST_LAUNCHED", "PLUGDIST_AGENT_STORE",
        "PLUGDIST_RDZV_ROUND", "PLUGDIST_STORE_TOKEN", "OMP_NUM_THREADS")
GRANDCHILD = ("import signal, sys, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "pathlib.Path(sys.argv[1]).write_text('ready'); time.sleep(300)")


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_for(paths: list[Path], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"never appeared: {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.02)


def crash_in_native_code() -> None:
    import ctypes

    ctypes.string_at(0)


def start_grandchild(out: Path, rank: int) -> None:
    ready = out / f"gc{rank}.ready"
    proc = subprocess.Popen([sys.executable, "-c", GRANDCHILD, str(ready)])
    wait_for([ready])  # its SIGTERM handler is in place from here on
    write_atomic(out / f"gc{rank}.pid", str(proc.pid))


def restart_mode(out: Path, rank: int, world: int, info: dict) -> None:
    # plugdist_run registers a bare ``plugdist`` package, so this costs no torch import
    import plugdist_run
    plugdist_run._bare_plugdist()
    from plugdist._launcher import record  # plugdist.record, without importing torch

    @record
    def body() -> None:
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        write_atomic(out / f"rank{rank}.attempt{attempt}.json", json.dumps(info))
        if rank == 1 and attempt == "0":
            wait_for([out / f"rank{r}.attempt0.json" for r in range(world)])
            raise ValueError(f"rank {rank} fails on attempt {attempt}")
    body()


def listening_addresses(port: int) -> list[str]:
    """The IPv4 addresses a socket listens on at ``port`` on this host (from /proc/net/tcp)."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr_hex, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:   # 0A: LISTEN
            found.append(".".join(str(int(addr_hex[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def main() -> None:
    out, mode, extra = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    info = {"env": {k: os.environ.get(k) for k in VARS}, "argv": sys.argv[1:], "pid": os.getpid()}
    # one write: the workers share the launcher's stdout, and print() writes the text and the
    # newline separately, so two ranks' lines could interleave
    sys.stdout.write(f"worker rank {rank} mode {mode} up\n")
    sys.stdout.flush()

    if mode == "env":
        port = int(os.environ["PLUGDIST_AGENT_STORE"].rpartition(":")[2])
        info["agent_store_listens_on"] = listening_addresses(port)
        write_atomic(out / f"rank{rank}.json", json.dumps(info))
        for item in extra:
            if item.startswith("exit="):
                bad, code = (int(x) for x in item[len("exit="):].split(":"))
                if rank == bad:
                    wait_for([out / f"rank{r}.json" for r in range(world)])
                    sys.exit(code)
        return

    if mode == "fail":
        if rank == 0:
            start_grandchild(out, rank)
        if rank == 2:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        write_atomic(out / f"rank{rank}.pid", str(os.getpid()))
        if rank == 1:
            wait_for([out / "rank0.pid", out / "rank2.pid", out / "gc0.pid"])
            print("rank 1 about to fail", file=sys.stderr, flush=True)
            raise ValueError(f"boom from rank {rank}")
        time.sleep(300)
        return

    if mode == "sigkill":
        write_atomic(out / f"rank{rank}.pid", str(os.getpid()))
        if rank == 1:
            wait_for([out / "rank0.pid"])
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(300)
        return

    if mode == "segv":
        write_atomic(out / f"rank{rank}.pid", str(os.getpid()))
        if rank == 1:
            wait_for([out / "rank0.pid"])
            crash_in_native_code()
        time.sleep(300)
        return

    if mode == "hang":
        def on_term(signum: int, frame: object) -> None:
            write_atomic(out / f"rank{rank}.sigterm", "got SIGTERM")
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        start_grandchild(out, rank)
        write_atomic(out / f"rank{rank}.pid", str(os.getpid()))
        time.sleep(300)
        return

    if mode == "rendezvous":
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if rank == 0:
            heard = {0}
            with socket.create_server((addr, port)) as server:
                server.settimeout(60)
                conns = []
                for _ in range(world - 1):
                    conn, _ = server.accept()
                    conns.append(conn)
                    heard.add(int(conn.makefile().readline()))
                for conn in conns:
                    conn.sendall((json.dumps(sorted(heard)) + "\n").encode())
                    conn.close()
            ranks = sorted(heard)
        else:
            deadline = time.monotonic() + 60
            while True:
                try:
                    conn = socket.create_connection((addr, port), timeout=60)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            with conn:
                conn.sendall(f"{rank}\n".encode())
                ranks = json.loads(conn.makefile().readline())
        info["ranks"] = ranks
        write_atomic(out / f"rank{rank}.json", json.dumps(info))
        return

    if mode == "restart":
        restart_mode(out, rank, world, info)
        return

    if mode == "usr1":
        def on_usr1(signum: int, frame: object) -> None:
            write_atomic(out / f"rank{rank}.usr1", "got SIGUSR1")
            sys.exit(0)
        signal.signal(signal.SIGUSR1, on_usr1)
        write_atomic(out / f"rank{rank}.pid", str(os.getpid()))
        time.sleep(300)
        return

    if mode == "elastic":
        write_atomic(out / f"w{world}.rank{rank}.json", json.dumps(info))
        if world == int(extra[0]) or os.environ["PLUGDIST_RDZV_ROUND"] == "0":
            time.sleep(300)
        return

    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
