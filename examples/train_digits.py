"""Train a small MLP on scikit-learn's bundled digits with plugdist's DistributedDataParallel.

    plugdist-run --nproc-per-node 2 examples/train_digits.py
    python examples/train_digits.py                 # one process, for comparison

Every rank trains on its own shard of each epoch's shuffled training set (shards differ by at
most one sample, hence ``model.join()`` for the uneven last batches); gradients are averaged by
DDP over Gloo. Rank 0 shows a tqdm progress bar (in a terminal) and prints each epoch's loss
and test accuracy; at the end every rank's parameters are compared and the result printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import plugdist as dist
import torch
from plugdist.parallel import DistributedDataParallel as DDP
from plugdist.testing import free_port
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm


def load_data(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Standardised train/test split of the 1797 8x8 digit images (80/20, fixed seed)."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(x))
    train, test = perm[:n_train], perm[n_train:]
    mean, std = x[train].mean(0), x[train].std(0).clamp_min(1e-3)
    x = (x - mean) / std
    return x[train], y[train], x[test], y[test]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--backend", default="gloo")
    args = p.parse_args()

    if "RANK" not in os.environ:  # plain `python train_digits.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    x_train, y_train, x_test, y_test = load_data()
    torch.manual_seed(rank)  # different on purpose: DDP starts every rank from rank 0's weights
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                              nn.Linear(64, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    if rank == 0:
        print(f"digits: {len(x_train)} train / {len(x_test)} test samples, {world} rank(s), "
              f"backend {args.backend}, batch {args.batch_size} per rank")

    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        mine = order[rank::world]  # this rank's shard of the epoch
        batches = list(mine.split(args.batch_size))
        stats = torch.zeros(3)  # loss sum, samples, batches (this rank)
        model.train()
        # rank 0 only, and only in a terminal (disable=None): not in plugdist-run's piped output
        steps = tqdm(batches, desc=f"epoch {epoch:>2}/{args.epochs}", leave=False,
                     disable=None if rank == 0 else True)
        # the ranks may differ by one batch: join() lets the ones that finish first wait
        with model.join():
            for idx in steps:
                opt.zero_grad()
                loss = loss_fn(model(x_train[idx]), y_train[idx])
                loss.backward()
                opt.step()
                stats += torch.tensor([loss.item() * len(idx), len(idx), 1])
                steps.set_postfix(loss=f"{stats[0].item() / stats[1].item():.4f}")
        dist.all_reduce(stats)
        model.eval()
        with torch.no_grad():
            test_idx = torch.arange(rank, len(x_test), world)
            correct = (model(x_test[test_idx]).argmax(1) == y_test[test_idx]).sum()
        counts = torch.tensor([correct.item(), len(test_idx)], dtype=torch.float64)
        dist.all_reduce(counts)
        accuracy = 100.0 * counts[0].item() / counts[1].item()
        if rank == 0:
            print(f"epoch {epoch:>2}/{args.epochs}  train loss {stats[0] / stats[1]:.4f}  "
                  f"test accuracy {accuracy:5.1f}%")

    # every rank must hold the same parameters: compare each with rank 0's
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    diff = torch.tensor([(flat - reference).abs().max().item()])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    same = diff.item() == 0.0
    if rank == 0:
        print(f"trained in {time.perf_counter() - start:.1f}s; final test accuracy "
              f"{accuracy:.1f}%")
        print(f"parameters identical on all {world} ranks: {'yes' if same else 'NO'} "
              f"(max difference {diff.item():.3g})")
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
