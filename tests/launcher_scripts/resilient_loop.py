"""A plain loop of all_reduces with resilient groups, for the launcher's resilience tests.

``VICTIM``: the rank that fails at step 3, by SIGKILL (``HOW=kill``) or by raising
(``HOW=raise``). The others catch the failure, shrink and go on to step 30; each writes
``OUT/survivor<rank>.json`` with its final world size and the last all_reduce's sum.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import plugdist as dist
import torch


def main() -> None:
    out, victim, how = sys.argv[1], int(os.environ["VICTIM"]), os.environ.get("HOW", "kill")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    step = 0
    total = 0.0
    while step < 30:
        if step == 3 and rank == victim:
            if how == "raise":
                raise ValueError(f"rank {rank} gives up at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            t = torch.ones(1)
            dist.all_reduce(t)
            total = float(t.item())
            step += 1
        except dist.DistRankFailureError:
            dist.shrink_group()
    with open(os.path.join(out, f"survivor{rank}.json"), "w") as f:
        json.dump({"size": dist.get_world_size(), "sum": total}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
