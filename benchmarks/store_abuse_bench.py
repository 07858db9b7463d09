"""The real ranks' store latency while a stranger abuses the store (plugdist's TCPStore, no
token: a stranger can send anything a member can), against the same ranks on a quiet store, and
torch's TCPStore quiet in the same run.

The server is its own process pinned to CPU 1 (as the store thread of rank 0 would be); the
"ranks" are ``--ranks`` processes on CPU 0, each doing a set and a get of its own key every
``--gap`` ms (a real rank touches the store now and then, not in a loop); the stranger is one
process on CPU 0 too, so that its own CPU does not come out of the server's. Phases of
``--seconds`` each, the first half second of each not counted:

  quiet          nothing else
  check_flood    CHECKs of max_keys_per_request (131,072) keys that exist, back to back
  oversized      CHECKs of 4,000,000 empty keys (16 MiB): refused on their count
  pipeline       SETs pipelined 1,000 at a time, read back in bulk
  partial        8 connections each sending 40 MiB of a 48 MiB frame, then sitting
  trickle        50 connections sending a frame a byte every 0.2 s (re-opened when dropped)
  garbage        connect, send an HTTP request, close, in a loop
  idle           2,000 connections that finish the handshake and send nothing (re-opened)
  forge          plain writes to the death log and the epoch records, forged member writes and
                 claims of a held identity, in a loop (each refused)

Prints, per phase, the ranks' round trip (set + get) median and p99 in µs, their ratio to the
quiet phase, and what the stranger got done.

    .venv/bin/python benchmarks/store_abuse_bench.py
    .venv/bin/python benchmarks/store_abuse_bench.py --seconds 6 --phases quiet,check_flood
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

HOST = "127.0.0.1"
PHASES = ("quiet", "check_flood", "oversized", "pipeline", "partial", "trickle", "garbage",
          "idle", "forge")


def pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu % (os.cpu_count() or 1)})


def role_server(a: argparse.Namespace) -> None:
    pin(1)
    t = timedelta(seconds=120)
    if a.impl == "torch":
        import torch.distributed as tdist
        store: Any = tdist.TCPStore(HOST, 0, None, True, t, wait_for_workers=False)
    else:
        from plugdist.store import TCPStore
        store = TCPStore(HOST, 0, None, True, t, token="")
        # a live world's membership on it, for the forgeries to aim at
        store.claim_member("", "0", 2, 30.0)
        store.claim_member("", "1", 2, 30.0)
    store.set("hot", "1")
    print(json.dumps({"port": store.port}), flush=True)
    sys.stdin.readline()


def role_rank(a: argparse.Namespace) -> None:
    pin(0)
    t = timedelta(seconds=120)
    if a.impl == "torch":
        import torch.distributed as tdist
        store: Any = tdist.TCPStore(HOST, a.port, None, False, t)
    else:
        from plugdist.store import TCPStore
        store = TCPStore(HOST, a.port, timeout=t)
    key = f"rank/{os.getpid()}"
    out: list[tuple[float, float]] = []
    print("ready", flush=True)
    import select
    while not select.select([sys.stdin], [], [], 0)[0]:
        t0 = time.monotonic()
        store.set(key, "x")
        store.get(key)
        t1 = time.monotonic()
        out.append((t0, (t1 - t0) * 1e6))
        time.sleep(a.gap / 1e3)
    print(json.dumps(out), flush=True)


def _raw(port: int) -> socket.socket:
    from plugdist.store import _wire as w
    s = socket.create_connection((HOST, port), timeout=30)
    got = b""
    while len(got) < w.GREETING.size:
        got += s.recv(w.GREETING.size - len(got))
    s.sendall(w.HELLO.pack(w.MAGIC, w.VERSION, 0, os.urandom(w.NONCE_SIZE), w.NO_PROOF))
    welcome = b""
    while len(welcome) < w.WELCOME.size:
        chunk = s.recv(w.WELCOME.size - len(welcome))
        if not chunk:
            raise ConnectionError("closed")
        welcome += chunk
    return s


def _alive(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(65536) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        s.setblocking(True)


def role_stranger(a: argparse.Namespace) -> None:
    pin(0)
    from plugdist.errors import DistError
    from plugdist.store import TCPStore
    from plugdist.store import _wire as w
    port, phase = a.port, a.phase
    store = TCPStore(HOST, port, timeout=timedelta(seconds=120))
    done = 0
    deadline = time.monotonic() + a.seconds
    held: list[socket.socket] = []
    if phase == "check_flood":
        frame = w.request(w.Op.CHECK, w.pack_blobs([b"hot"] * 131072))
    elif phase == "oversized":
        frame = w.request(w.Op.CHECK, w.U32.pack(4_000_000) + b"\0" * 16_000_000)
    elif phase == "pipeline":
        one = w.request(w.Op.SET, w.U32.pack(3) + b"abc" + w.U32.pack(1) + b"x")
        frame = one * 1000
    while time.monotonic() < deadline:
        try:
            if phase in ("check_flood", "oversized"):
                try:
                    store._request("check", frame)
                except DistError:
                    pass
                done += 1
            elif phase == "pipeline":
                s = held[0] if held else _raw(port)
                held[:] = [s]
                s.sendall(frame)
                want, got = 1000 * 5, 0
                while got < want:
                    got += len(s.recv(want - got))
                done += 1000
            elif phase in ("partial", "trickle", "idle"):
                count = {"partial": 8, "trickle": 50, "idle": 2000}[phase]
                if phase != "partial" or not done:
                    held[:] = [s for s in held if _alive(s)]
                while len(held) < count and time.monotonic() < deadline and (
                        phase != "partial" or done < count):
                    s = _raw(port)
                    if phase == "partial":
                        s.sendall(w.HEADER.pack(48 << 20, w.Op.SET) + b"\0" * (40 << 20))
                    elif phase == "trickle":
                        s.sendall(w.HEADER.pack(1 << 20, w.Op.SET))
                    held.append(s)
                    done += 1
                if phase == "trickle":
                    for s in held:
                        try:
                            s.sendall(b"x")
                        except OSError:
                            pass
                time.sleep(0.2)
            elif phase == "garbage":
                with socket.create_connection((HOST, port), timeout=30) as s:
                    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
                done += 1
            elif phase == "forge":
                for attempt in (
                        lambda: store.add("plugdist/live/deaths", 1),
                        lambda: store.set("plugdist/epoch/1/members", "[]"),
                        lambda: store.claim_member("", "1", 2, 10.0)):
                    try:
                        attempt()
                    except DistError:
                        done += 1
            else:
                time.sleep(0.05)
        except OSError:
            held.clear()
    print(json.dumps({"done": done}), flush=True)


def spawn(role: str, *args: str) -> subprocess.Popen[str]:
    # the server's warnings about the stranger (rate-limited) are not the benchmark's output
    return subprocess.Popen([sys.executable, __file__, "--role", role, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.DEVNULL if role == "server" else None)


def run(impl: str, phases: list[str], a: argparse.Namespace) -> dict[str, Any]:
    server = spawn("server", "--impl", impl)
    port = json.loads(server.stdout.readline())["port"]  # type: ignore[union-attr]
    ranks = [spawn("rank", "--impl", impl, "--port", str(port), "--gap", str(a.gap))
             for _ in range(a.ranks)]
    for r in ranks:
        r.stdout.readline()  # type: ignore[union-attr]
    windows: dict[str, tuple[float, float, str]] = {}
    for phase in phases:
        start = time.monotonic()
        got = ""
        if phase != "quiet":
            stranger = spawn("stranger", "--port", str(port), "--phase", phase,
                             "--seconds", str(a.seconds))
            got = json.loads(stranger.communicate(timeout=a.seconds + 120)[0].splitlines()[-1])
            got = str(got["done"])
        else:
            time.sleep(a.seconds)
        windows[phase] = (start + 0.5, time.monotonic(), got)
        time.sleep(1.0)  # let what the stranger left be dropped
    samples: list[tuple[float, float]] = []
    for r in ranks:
        out, _ = r.communicate("stop\n", timeout=60)
        samples += [tuple(x) for x in json.loads(out.splitlines()[-1])]  # type: ignore[misc]
    server.communicate("stop\n", timeout=30)
    result = {}
    for phase, (lo, hi, got) in windows.items():
        lat = sorted(us for t, us in samples if lo <= t <= hi)
        if not lat:
            result[phase] = {"n": 0, "stranger": got}
            continue
        result[phase] = {"n": len(lat), "p50": statistics.median(lat),
                         "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))], "stranger": got}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", default="main")
    p.add_argument("--impl", default="plugdist")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--phase", default="quiet")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--gap", type=float, default=5.0, help="ms between a rank's round trips")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--no-torch", action="store_true")
    a = p.parse_args()
    if a.role != "main":
        {"server": role_server, "rank": role_rank, "stranger": role_stranger}[a.role](a)
        return
    phases = [x for x in a.phases.split(",") if x]
    ours = run("plugdist", phases, a)
    torch = None if a.no_torch else run("torch", ["quiet"], a)["quiet"]
    quiet = ours.get("quiet")
    print(f"{a.ranks} ranks, a set + get every {a.gap:g} ms each; {a.seconds:g} s a phase; "
          f"server on CPU 1, ranks and stranger on CPU 0")
    print(f"{'phase':<12} {'p50 us':>9} {'p99 us':>9} {'p50/quiet':>10} {'p99/quiet':>10} "
          f"{'samples':>8}  stranger got done")
    rows = list(ours.items()) + ([("torch quiet", torch)] if torch else [])
    for phase, r in rows:
        if not r.get("n"):
            print(f"{phase:<12} (no samples)")
            continue
        r50 = r["p50"] / quiet["p50"] if quiet and quiet.get("n") else float("nan")
        r99 = r["p99"] / quiet["p99"] if quiet and quiet.get("n") else float("nan")
        print(f"{phase:<12} {r['p50']:9.0f} {r['p99']:9.0f} {r50:10.2f} {r99:10.2f} "
              f"{r['n']:8d}  {r['stranger']}")


if __name__ == "__main__":
    main()
