"""A training script that calls only plugdist.init_process_group, then uses torch utilities
that ask torch.distributed (run by tests/test_torch_bridge.py under plugdist-run)."""

import json
import sys
from pathlib import Path

import plugdist
import torch
import torch.distributed
from torch.utils.data.distributed import DistributedSampler

plugdist.init_process_group("gloo")
sampler = DistributedSampler(list(range(10)), shuffle=False)  # no num_replicas=/rank=
t = torch.tensor([float(torch.distributed.get_rank() + 1)])
torch.distributed.all_reduce(t)
out = {"rank": torch.distributed.get_rank(), "world": torch.distributed.get_world_size(),
       "indices": list(sampler), "sum": t.item(), "backend": torch.distributed.get_backend()}
plugdist.destroy_process_group()
out["torch_after_destroy"] = torch.distributed.is_initialized()
Path(sys.argv[1], f"rank{out['rank']}.json").write_text(json.dumps(out))
