"""A rank of a 2-rank gloo job whose store is etcd: ``python _etcd_job.py URL RANK``. Until the
parent sets ``stop`` (each rank sees it at the same step: an all_reduce of the flag), every step
makes a new group, all-reduces on it, and uses the store. Prints READY, then RESULT <json>."""

import json
import sys
from datetime import timedelta

import plugdist as dist
import torch

url, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
store = dist.open_store(url, timedelta(seconds=60))
print("READY", flush=True)
steps, bad = 0, 0
while True:
    group = dist.new_group([0, 1])
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=group)
    bad += int(t.tolist() != [3.0] * 4)
    store.add("steps", 1)
    store.set(f"r{rank}/{steps}", str(steps))
    steps += 1
    flag = torch.tensor([1.0 if store.check(["stop"]) else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        break
dist.barrier()
print("RESULT " + json.dumps({"steps": steps, "bad": bad}), flush=True)
dist.destroy_process_group()
