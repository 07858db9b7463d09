"""The DDP test world with ranks thrown out of step, as the gloo plugin's old sliced-wait bug
did (docs/resilience.md): run by ``benchmarks/ddp_world_stress.py --desync``.

On one rank, the K-th Gloo op that completed successfully is reported as Gloo's timeout
("Operation timed out!"), which the plugin then raised as ``DistTimeoutError`` while the other
ranks went on: the next collectives are mismatched in Gloo. Module level, so ``run_world`` can
import it by name in each rank.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def run_suite_out_of_step(rank: int, world_size: int, op: int, on_rank: int,
                          names: list[str] | None = None) -> dict[str, Any]:
    """``tests/_ddp_workers.run_suite`` with the ``op``-th successful wait of rank ``on_rank``
    failed; returns how many waits succeeded and which checks failed on this rank."""
    import plugdist_gloo.process_group as gloo_group
    import plugdist_gloo.work as gloo_work

    real = gloo_work.wait_native
    waits = 0

    def wait_native(native: Any, limit: Any, signal: Any = None) -> tuple[bool, Any]:
        nonlocal waits
        finished, error = real(native, limit, signal)
        if finished and error is None:
            waits += 1
            if rank == on_rank and waits == op:
                print(f"rank {rank}: successful op {op} reported as timed out", flush=True)
                return True, RuntimeError("Operation timed out!")
        return finished, error

    gloo_work.wait_native = wait_native
    gloo_group.wait_native = wait_native  # type: ignore[attr-defined]
    import _ddp_workers

    results = _ddp_workers.run_suite(rank, world_size, names)
    return {"waits": waits, "failed": [name for name, error in results.items() if error]}
