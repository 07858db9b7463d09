"""Hugging Face Trainer and a plain Accelerate loop over torch's gloo, ``plugdist_gloo`` and
``plugdist_mpi``, one after the other in one world started by a bare ``mpiexec -n 2`` (run by
tests/test_huggingface.py). Each run trains a tiny randomly initialised GPT-2 on random tokens
(nothing is downloaded) and saves this rank's final parameters as ``<out>/<run>-rank<R>.pt``.

The recipes are the ones docs/torch.md gives:
- gloo (the reference): nothing initialized; Accelerate initializes torch's gloo itself, after
  copying mpiexec's ``PMI_RANK`` into ``RANK``, and plugdist's env:// fallback must then supply
  ``MASTER_ADDR`` (this is the case it used to miss);
- plugdist_gloo: ``torch.distributed.init_process_group("plugdist_gloo")`` first;
- plugdist_mpi: ``plugdist.init_process_group("mpi")`` first (torch's default group is then
  ``plugdist_mpi``).
Accelerate and Trainer then find torch's default group initialized and train over it.

argv: OUT_DIR PORT_GLOO PORT_PLUGDIST_GLOO
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

STEPS = 4
BATCH = 2
SEQ = 8


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def random_tokens(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def save(out: Path, run: str, model: torch.nn.Module) -> None:
    model = getattr(model, "module", model)   # unwrap DDP
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"state": state, "world": tdist.get_world_size(),
                "backend": str(tdist.get_backend())},
               out / f"{run}-rank{tdist.get_rank()}.pt")


def accelerate_loop(out: Path, run: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    world = accelerator.num_processes
    loader = torch.utils.data.DataLoader(random_tokens(STEPS * BATCH * world), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    save(out, f"{run}-accelerate", model)


def trainer_run(out: Path, run: str) -> None:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out / f"trainer-{run}"), use_cpu=True, per_device_train_batch_size=BATCH,
        max_steps=STEPS, learning_rate=1e-2, seed=0, report_to="none", save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=tiny_gpt2(), args=args,
                      train_dataset=random_tokens(STEPS * BATCH * tdist.get_world_size()))
    if trainer.args.world_size != tdist.get_world_size():
        raise RuntimeError(f"Trainer sees world {trainer.args.world_size}, torch "
                           f"{tdist.get_world_size()}: it is not training distributed")
    trainer.train()
    save(out, f"{run}-trainer", trainer.model)


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def main() -> None:
    out, port_gloo, port_plugdist_gloo = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    if "MASTER_ADDR" in os.environ or "RANK" in os.environ:
        raise RuntimeError("started with MASTER_ADDR or RANK set: the gloo run would not test "
                           "the env:// fallback")

    # gloo: Accelerate sets RANK, WORLD_SIZE, LOCAL_RANK from mpiexec's PMI_* (MASTER_PORT too,
    # to 29500 unless set: set here, so parallel test runs do not meet on one port)
    os.environ["MASTER_PORT"] = port_gloo
    accelerate_loop(out, "gloo")
    if tdist.get_backend() != "gloo" or os.environ.get("MASTER_ADDR") != "127.0.0.1":
        raise RuntimeError(f"expected torch's gloo with MASTER_ADDR from plugdist's fallback, got "
                           f"{tdist.get_backend()} and {os.environ.get('MASTER_ADDR')!r}")
    trainer_run(out, "gloo")
    reset_accelerate()
    tdist.destroy_process_group()

    os.environ["MASTER_PORT"] = port_plugdist_gloo
    tdist.init_process_group("plugdist_gloo")
    accelerate_loop(out, "plugdist_gloo")
    trainer_run(out, "plugdist_gloo")
    reset_accelerate()
    tdist.destroy_process_group()

    import plugdist

    plugdist.init_process_group("mpi")   # MPI is its own rendezvous: no MASTER_* needed
    if tdist.get_backend() != "plugdist_mpi":
        raise RuntimeError(f"torch's default group is {tdist.get_backend()}, not plugdist_mpi")
    accelerate_loop(out, "plugdist_mpi")
    trainer_run(out, "plugdist_mpi")
    reset_accelerate()
    plugdist.destroy_process_group()


if __name__ == "__main__":
    main()
