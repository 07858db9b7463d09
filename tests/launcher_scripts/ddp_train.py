"""A small deterministic DDP training for tests/test_launcher_elastic.py: ``ddp_train.py OUTDIR
TAG``. Every rank trains on its own seeded batches; rank 0 writes the final parameters to
OUTDIR/TAG.json, so runs of one world size started in different ways can be compared."""

import json
import sys
from pathlib import Path

import plugdist as dist
import torch
from plugdist.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.Generator().manual_seed(100 + rank)
for _ in range(5):
    x = torch.randn(4, 8, generator=data)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
if rank == 0:
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    Path(sys.argv[1], f"{sys.argv[2]}.json").write_text(json.dumps(
        {"world": world, "params": params}))
dist.destroy_process_group()
