"""Hugging Face Trainer training that survives a SIGKILLed rank, on plugdist's resilient groups.

    import plugdist
    from plugdist_transformers import ResilientTrainer
    plugdist.init_process_group("gloo")          # before TrainingArguments
    trainer = ResilientTrainer(model=model, args=TrainingArguments(..., use_cpu=True), ...)

and start the script with ``plugdist-run --nproc-per-node 4 [--replace-failed] train.py``.
"""

from .trainer import ResilientTrainer, WorldChangeHook

__all__ = ["ResilientTrainer", "WorldChangeHook"]
