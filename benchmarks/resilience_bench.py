"""Resilient groups: how fast a dead rank is named, the survivors shrink, and a joiner is
admitted; and what the liveness signal costs a loop of small all_reduces.

    python benchmarks/resilience_bench.py                     # world 4 and 8, gloo and toy
    python benchmarks/resilience_bench.py --worlds 4 --backends gloo --repeats 5
    python benchmarks/resilience_bench.py --parts overhead    # liveness cost only
    python benchmarks/resilience_bench.py --backends mpi      # MPI through ULFM (Open MPI 5)

Recovery (medians over ``--repeats``), from the victim's SIGKILL:
  (a) every survivor's DistRankFailureError  (goal: < 1 s)
  (b) from (a) to the shrunk group's first completed all_reduce  (goal: < 0.5 s)
  (c) a joiner's init_process_group(join=True), call to return  (goal: < 0.5 s)
The ``mpi`` rows run under Open MPI's ``mpiexec --with-ft ulfm`` (from .venv/ulfm, or
PLUGDIST_ULFM_PREFIX), with tests/_ulfm_workers.py; MPI refuses joiners, so (c) is "refused".
Overhead: per-op time of an 8-byte all_reduce loop with membership on and off, in one run,
on gloo (2 ranks) and MPI (mpiexec -n 2, the cheapest per op; goal: < 2 %).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE.parent / "tests" / "_resilience_workers.py"
ULFM_WORKER = HERE.parent / "tests" / "_ulfm_workers.py"


def _ulfm_prefix() -> Path:
    return Path(os.environ.get("PLUGDIST_ULFM_PREFIX") or Path(sys.prefix) / "ulfm")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def recovery_once_mpi(world: int) -> dict[str, float]:
    """One Open MPI world under ULFM: rank ``world // 2`` is SIGKILLed, the survivors shrink."""
    prefix = _ulfm_prefix()
    libmpi = sorted((prefix / "lib").glob("libmpi.so.*"))
    if not (prefix / "bin" / "mpiexec").exists() or not libmpi:
        raise RuntimeError(f"no Open MPI in {prefix}: make venv installs it")
    tmp = Path(tempfile.mkdtemp(prefix="resilience-bench-"))
    env = dict(os.environ, PATH=f"{prefix / 'bin'}{os.pathsep}{os.environ['PATH']}",
               MPI4PY_LIBMPI=str(libmpi[0]), VICTIMS=str(world // 2), RESULT_DIR=str(tmp),
               PLUGDIST_TORCH_WORLD="0", PLUGDIST_RESILIENCE="1")
    cmd = [str(prefix / "bin" / "mpiexec"), "--with-ft", "ulfm", "--oversubscribe",
           "--bind-to", "none", "-n", str(world), sys.executable, str(ULFM_WORKER),
           "kill_shrink"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=300, cwd=ULFM_WORKER.parent)
    alive = [json.loads(f.read_text()) for f in tmp.glob("*.json")]
    shutil.rmtree(tmp, ignore_errors=True)
    if len(alive) != world - 1 or any(r["bad"] for r in alive):
        raise RuntimeError(f"world {world} on mpi: the run did not complete: {alive}")
    return {"detect_s": max(r["detect_s"] for r in alive),
            "shrink_s": max(r["shrink_s"] for r in alive), "join_s": float("nan")}


def recovery_once(world: int, backend: str) -> dict[str, float]:
    """One world: rank ``world // 2`` is SIGKILLed, the survivors shrink, one process joins."""
    if backend == "mpi":
        return recovery_once_mpi(world)
    tmp = Path(tempfile.mkdtemp(prefix="resilience-bench-"))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(world), BACKEND=backend, VICTIMS=str(world // 2),
               GROW_TO=str(world), RESULT_DIR=str(tmp), PLUGDIST_TORCH_WORLD="0",
               PLUGDIST_RESILIENCE="1",
               PLUGDIST_STORE_TOKEN=os.urandom(16).hex())  # the joiner's credential
    procs = [subprocess.Popen([sys.executable, str(WORKER), "kill_shrink_grow"],
                              env=dict(env, RANK=str(r)), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for r in range(world)]
    time.sleep(1.5)
    join_env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE")}
    procs.append(subprocess.Popen([sys.executable, str(WORKER), "kill_shrink_grow"],
                                  env=dict(join_env, PLUGDIST_JOIN="1"),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for p in procs:
        try:
            p.wait(120)
        except subprocess.TimeoutExpired:
            p.kill()
    results = [json.loads(f.read_text()) for f in tmp.glob("*.json")]
    shutil.rmtree(tmp, ignore_errors=True)
    alive = [r for r in results if r["role"] == "survivor"]
    joiner = [r for r in results if r["role"] == "joiner"]
    if len(alive) != world - 1 or len(joiner) != 1 or any(r["bad"] for r in results):
        raise RuntimeError(f"world {world} on {backend}: the run did not complete: {results}")
    return {"detect_s": max(r["detect_s"] for r in alive),
            "shrink_s": max(r["shrink_s"] for r in alive),
            "join_s": joiner[0]["init_s"]}


def recovery(worlds: list[int], backends: list[str], repeats: int) -> None:
    print("\n# recovery from a SIGKILL (medians; worst survivor of each run)")
    print(f"{'backend':>8} {'world':>5} {'(a) error':>10} {'(b) shrink':>11} {'(c) join':>9}"
          f"  runs")
    for backend in backends:
        for world in worlds:
            runs = [recovery_once(world, backend) for _ in range(repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            join = "refused" if backend == "mpi" else f"{med['join_s'] * 1e3:.1f}ms"
            print(f"{backend:>8} {world:>5} {med['detect_s'] * 1e3:>8.1f}ms "
                  f"{med['shrink_s'] * 1e3:>9.1f}ms {join:>9}  {repeats}")


# -- the liveness signal's cost ------------------------------------------------------------------
def overhead_worker(iters: int, rounds: int) -> None:
    """Inside each rank: alternate rounds with membership on and off, one world per round."""
    from datetime import timedelta

    import plugdist as dist
    import torch

    backend = os.environ["BACKEND"]
    rank = None
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(rounds * 2):
        mode = "on" if i % 2 == 0 else "off"
        os.environ["PLUGDIST_RESILIENCE"] = "1" if mode == "on" else "0"
        if backend != "mpi":
            os.environ["MASTER_PORT"] = os.environ["PORTS"].split(",")[i]
        dist.init_process_group(backend, timeout=timedelta(seconds=60), torch_world=False)
        rank = dist.get_rank()
        t = torch.ones(2)
        for _ in range(200):
            dist.all_reduce(t)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        times[mode].append((time.perf_counter() - start) / iters)
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({k: statistics.median(v) for k, v in times.items()}), flush=True)


def overhead(backend: str, iters: int, rounds: int) -> dict[str, float]:
    script = [sys.executable, __file__, "--overhead-worker", str(iters), str(rounds)]
    # a port of its own per world, each free when picked (consecutive ports from one free
    # port collide with the listeners the earlier worlds' Gloo groups took)
    env = dict(os.environ, BACKEND=backend, MASTER_ADDR="127.0.0.1",
               PORTS=",".join(map(str, _free_ports(2 * rounds))),
               PLUGDIST_TORCH_WORLD="0")
    if backend == "mpi":
        mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).with_name("mpiexec"))
        out = subprocess.run([mpiexec, "-n", "2", *script], env=env, capture_output=True,
                             text=True, timeout=600)
        lines = out.stdout
    else:
        procs = [subprocess.Popen(script, env=dict(env, RANK=str(r), WORLD_SIZE="2"),
                                  stdout=subprocess.PIPE, text=True) for r in range(2)]
        lines = "".join(p.communicate(timeout=600)[0] for p in procs)
    found = [json.loads(x) for x in lines.splitlines() if x.startswith("{")]
    if not found:
        raise RuntimeError(f"overhead run on {backend} printed no result")
    return found[0]


def overheads(backends: list[str], iters: int, rounds: int) -> None:
    print("\n# liveness cost: 8-byte all_reduce loop, 2 ranks, membership on vs off "
          "(alternating rounds, medians)")
    print(f"{'backend':>8} {'off us/op':>10} {'on us/op':>9} {'cost':>7}")
    for backend in backends:
        r = overhead(backend, iters, rounds)
        print(f"{backend:>8} {r['off'] * 1e6:>10.2f} {r['on'] * 1e6:>9.2f} "
              f"{(r['on'] / r['off'] - 1) * 100:>+6.1f}%")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--overhead-worker":
        overhead_worker(int(sys.argv[2]), int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--backends", default="gloo,toy")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="recovery,overhead")
    ap.add_argument("--overhead-backends", default="gloo,mpi")
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    parts = args.parts.split(",")
    if "recovery" in parts:
        recovery([int(w) for w in args.worlds.split(",")], args.backends.split(","),
                 args.repeats)
    if "overhead" in parts:
        overheads(args.overhead_backends.split(","), args.iters, args.rounds)


if __name__ == "__main__":
    main()
