"""CPU time the core spends per op, without the network: an in-process one-rank group whose
backend does nothing, timed with ``time.process_time`` (best of rounds), so that other load on
the machine barely moves it. Routes: the lean blocking route (``run_blocking``, what a
synchronous ``all_reduce`` takes) and the general route (``all_reduce().wait()``, a Work), each
with nobody watching and with the flight recorder on.

It runs against this checkout's plugdist or an older one's (the layout before plugin API 2, when
a backend subclassed ProcessGroup), so a before/after pair is one command in each venv:

    .venv/bin/python benchmarks/frontend_cpu_bench.py
    ../old/.venv/bin/python benchmarks/frontend_cpu_bench.py
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from observability_bench import set_recording
from plugdist import GroupOptions, ProcessGroup, ReduceOp

try:  # plugin API 2: a backend apart from the ProcessGroup
    from plugdist._backend.work import completed_work
    from plugdist._observability.flight_recorder import recorder
    from plugdist.backend import BackendBase
    split = True
except ImportError:  # plugin API 1: the backend is the ProcessGroup
    from plugdist.flight_recorder import recorder  # type: ignore[no-redef]
    from plugdist.work import completed_work  # type: ignore[no-redef]
    BackendBase = ProcessGroup  # type: ignore[assignment,misc]
    split = False


class Nothing(BackendBase):  # type: ignore[misc,valid-type]
    """Completes every all_reduce at once."""

    backend_name = "nothing"

    def native_all_reduce(self, *, tensor: torch.Tensor, op: ReduceOp) -> Any:
        return completed_work([tensor])

    def native_all_reduce_blocking(self, *, tensor: torch.Tensor, op: ReduceOp) -> None:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=4000, help="ops per round")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    backend = Nothing(0, 2, GroupOptions(group_name="local", global_ranks=(0, 1)))
    pg: Any = ProcessGroup(backend) if split else backend
    recorder.add_group(pg, None, (0, 1), 0)
    tensor, red, n = torch.ones(2), ReduceOp.SUM, args.ops

    def lean() -> None:
        for _ in range(n):
            pg.run_blocking("all_reduce", tensor, red)

    def work() -> None:
        for _ in range(n):
            pg.all_reduce(tensor, red).wait()

    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, fn in (("lean", lean), ("work", work)):
            for recording in (False, True):
                set_recording(recorder, recording)
                t0 = time.process_time()
                fn()
                per_op = (time.process_time() - t0) / n * 1e6
                set_recording(recorder, False)
                key = name + (" + recorder" if recording else "")
                best[key] = min(best.get(key, float("inf")), per_op)
    print(f"plugdist {'plugin API 2 (backend apart)' if split else 'plugin API 1'}: "
          + ", ".join(f"{k} {v:.2f}" for k, v in best.items()) + " µs/op (CPU, best of "
          f"{args.rounds})")


if __name__ == "__main__":
    main()
