"""Launched by tests/test_launcher.py: join the world from the launcher's variables, all_reduce."""

import json
import sys
from pathlib import Path

import plugdist as dist
import torch

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(
    {"rank": rank, "world": world, "sum": t.item(), "launched": dist.is_torchelastic_launched()}))
dist.destroy_process_group()
