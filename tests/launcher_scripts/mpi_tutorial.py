"""Run under ``mpiexec -n N`` by tests/test_launcher_elastic.py: the "Writing Distributed
Applications" tutorial's MPI call, ``init_process_group('mpi', rank=0, world_size=0)``, whose
rank and world size must come from MPI (as in torch), whatever MASTER_ADDR says."""

import json
import sys
import warnings
from pathlib import Path

import plugdist as dist
import torch

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dist.init_process_group("mpi", rank=0, world_size=0)
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(
    {"rank": rank, "world": world, "sum": t.item(),
     "warned": any("ignores rank=0" in str(w.message) for w in caught)}))
dist.destroy_process_group()
