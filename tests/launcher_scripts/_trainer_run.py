"""What lightning_train.py and hf_train_faults.py share: the data, the parameter hash, the
options, each rank's record file and the planned SIGKILL."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import IO

import torch
from torch import nn

_records = Path(".")  # OUT/records: set by parse_args


def make_data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return x, torch.tanh(x @ w / 8 ** 0.5) + 0.05 * torch.randn(n, 1, generator=g)


def params_sha1(module: nn.Module) -> str:
    """Of the state dict in key order (how benchmarks/trainer_faults.py hashes a checkpoint)."""
    digest = hashlib.sha1()
    for _, t in sorted(module.state_dict().items()):
        digest.update(t.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def parse_args(description: str | None, max_epochs: int, plain: str) -> argparse.Namespace:
    """The runs' options (``plain``: what ``--plain`` runs instead); makes ``OUT/records``."""
    global _records
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--max-epochs", type=int, default=max_epochs)
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=4, help="samples per rank per batch")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.08)
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.add_argument("--kill", default="",
                    help="RANK:STEP:WHERE (WHERE: backward, start or outside)")
    ap.add_argument("--full-streak", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--plain", action="store_true", help=f"{plain} instead (for comparison)")
    args = ap.parse_args()
    _records = Path(args.out) / "records"
    _records.mkdir(parents=True, exist_ok=True)
    return args


def record_file() -> IO[str]:
    """This process's record file (``OUT/records/<pid>.jsonl``), for appending."""
    return (_records / f"{os.getpid()}.jsonl").open("a")


def die() -> None:
    """Record the kill, then SIGKILL this process."""
    with record_file() as f:
        f.write(json.dumps({"killed": int(os.environ["RANK"]), "time": time.time()}) + "\n")
    os.kill(os.getpid(), signal.SIGKILL)
