"""The real ranks' store latency while a stranger abuses the store (plugdist's TCPStore, no
token: a stranger can send anything a member can), against the same ranks on a quiet store, and
torch's TCPStore quiet in the same run.

The server is its own process pinned to CPU 1 (as the store thread of rank 0 would be); the
"ranks" are ``--ranks`` processes on CPU 0, each doing a set and a get of its own key every
``--gap`` ms (a real rank touches the store now and then, not in a loop); the stranger is one
process on CPU 0 too, at nice 19, standing in for a process on another host: its CPU comes
neither out of the server's core nor ahead of the ranks'. Each abuse runs ``--seconds`` right
after a quiet window as long (its first half second not counted), ``--repeats`` times; what is
reported is the median over the repeats of each window's median and p99, and of the ratio of
each abuse window to the quiet window just before it (so the load of a shared machine, which
drifts, cancels out). The abuses:

  quiet          nothing else
  check_flood    CHECKs of max_keys_per_request keys (131,072, or ``--max-keys``) that exist,
                 back to back
  mset_flood     MULTI_SETs of max_keys_per_request keys (its own, a byte each), back to back
  mget_flood     MULTI_GETs of max_keys_per_request keys that exist, back to back
  oversized      CHECKs of 4,000,000 empty keys (16 MiB): refused on their count
  pipeline       SETs pipelined 1,000 at a time, read back in bulk
  partial        8 connections each sending 40 MiB of a 48 MiB frame, then sitting (8 in all)
  trickle        50 connections sending a frame a byte every 0.2 s (re-opened when dropped)
  garbage        connect, send an HTTP request, close, in a loop
  idle           2,000 connections that finish the handshake and send nothing (re-opened)
  forge          plain writes to the death log and the epoch records, forged member writes and
                 claims of a held identity, in a loop (each refused)
  big_reply      MULTI_GETs naming one 8 MiB value 64 times (a 512 MiB reply: refused on its
                 size), back to back, while 16 connections each ask for it 7 times (56 MiB)
                 and never read (re-opened when dropped)
  guests         5,000 connections that each send one NUM_KEYS and are then held (re-opened
                 when dropped): guests, under the per-address bound

Prints, per abuse, the ranks' round trip (set + get) median and p99 in µs, their ratios to the
quiet window before, and what the stranger got done; then torch's TCPStore, quiet, for scale.

    .venv/bin/python benchmarks/store_abuse_bench.py
    .venv/bin/python benchmarks/store_abuse_bench.py --seconds 6 --phases quiet,check_flood
    .venv/bin/python benchmarks/store_abuse_bench.py --max-keys 16384 --no-torch  # a lower cap
    .venv/bin/python benchmarks/store_abuse_bench.py --phases quiet,guests --max-guests 4096
        # the guests over their per-address bound: every re-opened connection displaces one
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
PHASES = ("quiet", "check_flood", "mset_flood", "mget_flood", "oversized", "pipeline", "partial",
          "trickle", "garbage", "idle", "forge", "big_reply", "guests")


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
        from plugdist.store import TCPStore, TCPStoreLimits
        store = TCPStore(HOST, 0, None, True, t, token="",
                         limits=TCPStoreLimits(max_keys_per_request=a.max_keys,
                                               max_guests_per_address=a.max_guests))
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
    os.nice(19)
    from plugdist.errors import DistError
    from plugdist.store import TCPStore
    from plugdist.store import _wire as w
    port, phase = a.port, a.phase
    store = TCPStore(HOST, port, timeout=timedelta(seconds=120))
    done = 0
    filled = 0.0  # guests: when all 5,000 were first open (s after it began)
    held: list[socket.socket] = []
    if phase == "check_flood":
        frame = w.request(w.Op.CHECK, w.pack_blobs([b"hot"] * a.max_keys))
    elif phase == "mset_flood":
        keys = [f"stranger/{i}".encode() for i in range(a.max_keys)]
        frame = w.request(w.Op.MULTI_SET, w.pack_blobs([b for k in keys for b in (k, b"x")]))
    elif phase == "mget_flood":
        frame = w.request(w.Op.MULTI_GET, w.F64.pack(30.0) + w.pack_blobs([b"hot"] * a.max_keys))
    elif phase == "oversized":
        frame = w.request(w.Op.CHECK, w.U32.pack(4_000_000) + b"\0" * 16_000_000)
    elif phase == "pipeline":
        one = w.request(w.Op.SET, w.U32.pack(3) + b"abc" + w.U32.pack(1) + b"x")
        frame = one * 1000
    elif phase == "big_reply":
        store.set("stranger/big", os.urandom(8 << 20))
        frame = w.request(w.Op.MULTI_GET, w.F64.pack(30.0) + w.pack_blobs([b"stranger/big"] * 64))
        unread = w.request(w.Op.MULTI_GET,
                           w.F64.pack(30.0) + w.pack_blobs([b"stranger/big"] * 7))
    elif phase == "guests":
        import resource
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
        num_keys = w.request(w.Op.NUM_KEYS, b"")
    began = time.monotonic()
    deadline = began + a.seconds
    while time.monotonic() < deadline:
        try:
            if phase == "big_reply":  # the hogs never read: only re-opened when dropped
                while len(held) < 16:
                    s = _raw(port)
                    s.setblocking(False)
                    try:
                        for _ in range(4):  # the server stops reading it after the first
                            s.send(unread)
                    except BlockingIOError:
                        pass
                    s.setblocking(True)
                    held.append(s)
                try:
                    store._request(phase, frame, wait=30.0)
                except DistError:
                    done += 1
                for s in list(held):
                    try:
                        s.send(b"")
                    except OSError:
                        held.remove(s)
            elif phase == "guests":
                held[:] = [s for s in held if _alive(s)]
                while len(held) < 5000 and time.monotonic() < deadline:
                    s = _raw(port)
                    s.sendall(num_keys)
                    held.append(s)
                    done += 1
                if len(held) >= 5000 and not filled:
                    filled = time.monotonic() - began
                time.sleep(0.2)
            elif phase in ("check_flood", "mset_flood", "mget_flood", "oversized"):
                try:
                    store._request(phase, frame, wait=30.0)
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
                    done += 1
                    s = _raw(port)
                    if phase == "partial":  # a server that stops reading it makes it give up
                        s.settimeout(max(0.1, deadline - time.monotonic()))
                        s.sendall(w.HEADER.pack(48 << 20, w.Op.SET) + b"\0" * (40 << 20))
                    elif phase == "trickle":
                        s.sendall(w.HEADER.pack(1 << 20, w.Op.SET))
                    held.append(s)
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
    report: Any = f"{done} ({filled:.2g} s to open 5,000)" if filled else done
    print(json.dumps({"done": report, "began": began, "ended": time.monotonic()}), flush=True)


def spawn(role: str, *args: str) -> subprocess.Popen[str]:
    # the server's warnings about the stranger (rate-limited) are not the benchmark's output
    return subprocess.Popen([sys.executable, __file__, "--role", role, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.DEVNULL if role == "server" else None)


def _stats(samples: list[tuple[float, float]], lo: float, hi: float) -> dict[str, float]:
    lat = sorted(us for t, us in samples if lo <= t <= hi)
    if not lat:
        return {"n": 0}
    return {"n": len(lat), "p50": statistics.median(lat),
            "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))]}


def run(impl: str, phases: list[str], a: argparse.Namespace) -> dict[str, Any]:
    """Each abuse of ``phases`` ``--repeats`` times after a quiet window: per abuse, the
    medians over repeats of (quiet stats, abuse stats, abuse/quiet ratios, what was done)."""
    server = spawn("server", "--impl", impl, "--max-keys", str(a.max_keys),
                   "--max-guests", str(a.max_guests))
    port = json.loads(server.stdout.readline())["port"]  # type: ignore[union-attr]
    ranks = [spawn("rank", "--impl", impl, "--port", str(port), "--gap", str(a.gap))
             for _ in range(a.ranks)]
    for r in ranks:
        r.stdout.readline()  # type: ignore[union-attr]
    time.sleep(1.0)
    windows: list[tuple[str, float, float, float, float, str]] = []
    for _ in range(a.repeats):
        for phase in phases:
            quiet_from = time.monotonic() + 0.5
            time.sleep(a.seconds)
            quiet_to = time.monotonic()
            if phase == "quiet":
                windows.append((phase, quiet_from, quiet_to, quiet_from, quiet_to, ""))
                continue
            stranger = spawn("stranger", "--port", str(port), "--phase", phase,
                             "--seconds", str(a.seconds), "--max-keys", str(a.max_keys))
            got = json.loads(stranger.communicate(timeout=a.seconds + 120)[0].splitlines()[-1])
            windows.append((phase, quiet_from, quiet_to, got["began"] + 0.5, got["ended"],
                            str(got["done"])))
            time.sleep(1.0)  # what the stranger left is dropped before the next quiet window
    samples: list[tuple[float, float]] = []
    for r in ranks:
        out, _ = r.communicate("stop\n", timeout=60)
        samples += [tuple(x) for x in json.loads(out.splitlines()[-1])]  # type: ignore[misc]
    server.communicate("stop\n", timeout=30)
    result: dict[str, Any] = {}
    for phase in phases:
        rows = []
        for name, q0, q1, a0, a1, got in windows:
            if name != phase:
                continue
            quiet, under = _stats(samples, q0, q1), _stats(samples, a0, a1)
            if quiet["n"] and under["n"]:
                rows.append((under["p50"], under["p99"], under["p50"] / quiet["p50"],
                             under["p99"] / quiet["p99"], under["n"], got))
        if not rows:
            result[phase] = {"n": 0}
            continue
        med = [statistics.median(float(r[i]) for r in rows) for i in range(4)]
        result[phase] = {"p50": med[0], "p99": med[1], "r50": med[2], "r99": med[3],
                         "n": sum(r[4] for r in rows), "stranger": rows[-1][5]}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", default="main")
    p.add_argument("--impl", default="plugdist")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--phase", default="quiet")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--gap", type=float, default=5.0, help="ms between a rank's round trips")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--max-keys", type=int, default=131072,
                   help="the server's max_keys_per_request, and the size of the CHECK flood")
    p.add_argument("--max-guests", type=int, default=32768,
                   help="the server's max_guests_per_address (below 5,000 the guests abuse "
                        "is over the bound: each connection it re-opens displaces one)")
    a = p.parse_args()
    if a.role != "main":
        {"server": role_server, "rank": role_rank, "stranger": role_stranger}[a.role](a)
        return
    phases = [x for x in a.phases.split(",") if x]
    ours = run("plugdist", phases, a)
    torch = None if a.no_torch else run("torch", ["quiet"], a)["quiet"]
    print(f"{a.ranks} ranks, a set + get every {a.gap:g} ms each; {a.seconds:g} s windows, "
          f"{a.repeats} repeats; server on CPU 1, ranks and stranger (nice 19) on CPU 0; "
          f"max_keys_per_request {a.max_keys}, max_guests_per_address {a.max_guests}")
    print(f"{'phase':<12} {'p50 us':>9} {'p99 us':>9} {'p50/quiet':>10} {'p99/quiet':>10} "
          f"{'samples':>8}  stranger got done")
    rows = list(ours.items()) + ([("torch quiet", torch)] if torch else [])
    for phase, r in rows:
        if not r.get("n"):
            print(f"{phase:<12} (no samples)")
            continue
        print(f"{phase:<12} {r['p50']:9.0f} {r['p99']:9.0f} {r['r50']:10.2f} {r['r99']:10.2f} "
              f"{r['n']:8d}  {r['stranger']}")

if __name__ == "__main__":
    main()
