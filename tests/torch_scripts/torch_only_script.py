"""A plain torch.distributed script (no plugdist import) on a plugdist backend, started by a
bare ``mpiexec -n N`` with nothing set (run by tests/test_launcher_hosts.py): torch's env://
must find rank, world size and master from the launcher."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

backend, out = sys.argv[1], Path(sys.argv[2])
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
sparse = torch.sparse_coo_tensor(torch.tensor([[rank, world]]), torch.ones(2), (world + 1,))
dist.all_reduce(sparse)
dist.barrier()
(out / f"rank{rank}.json").write_text(json.dumps(
    {"rank": rank, "world": world, "sum": t.item(), "backend": dist.get_backend(),
     "sparse": sparse.to_dense().tolist(), "env_rank": os.environ["RANK"],
     "local_rank": os.environ.get("LOCAL_RANK")}))
dist.destroy_process_group()
