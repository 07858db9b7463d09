"""Launched by tests/test_launcher*.py (by plugdist-run, torchrun or mpiexec): join the world
from whatever the launcher set, all_reduce, write what was seen to OUTDIR/rank<R>.json."""

import json
import os
import sys
from pathlib import Path

import plugdist as dist
import torch
from plugdist._world.state import world as _world

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(
    {"rank": rank, "world": world, "sum": t.item(), "launched": dist.is_torchelastic_launched(),
     "local_rank": os.environ.get("LOCAL_RANK"), "env_rank": os.environ.get("RANK"),
     "store": repr(_world.store).split("(")[0] + ":" + type(getattr(
         _world.store, "underlying_store", _world.store)).__name__}))
dist.destroy_process_group()
