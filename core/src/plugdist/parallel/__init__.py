"""Data parallelism: DistributedDataParallel, its Reducer, comm hooks and uneven-input joins.

``plugdist.parallel.DistributedDataParallel`` is a drop-in for
``torch.nn.parallel.DistributedDataParallel`` that runs over any plugdist backend.
"""

from plugdist.parallel.bucketing import DEFAULT_FIRST_BUCKET_BYTES, compute_bucket_assignment
from plugdist.parallel.comm_hooks import (
    CommHook,
    GradBucket,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from plugdist.parallel.ddp import DistributedDataParallel
from plugdist.parallel.elastic_sampler import ElasticSampler
from plugdist.parallel.fault_tolerant import (
    BelowMinWorldSizeError,
    ResilientTraining,
    is_rank_failure,
)
from plugdist.parallel.join import Join, Joinable, JoinHook
from plugdist.parallel.logging_data import DDPLogger
from plugdist.parallel.reducer import BucketedReducer, Reducer, ReducerOptions
from plugdist.parallel.torch_hooks import resilient_allreduce_hook
from plugdist.parallel.trainer_steps import TrainerSteps, exit_if_excluded

__all__ = [
    "DistributedDataParallel", "Reducer", "ReducerOptions", "BucketedReducer", "GradBucket",
    "CommHook", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "Join", "Joinable",
    "JoinHook", "DDPLogger", "compute_bucket_assignment", "DEFAULT_FIRST_BUCKET_BYTES",
    "resilient_allreduce_hook", "ResilientTraining", "ElasticSampler", "BelowMinWorldSizeError",
    "is_rank_failure", "TrainerSteps", "exit_if_excluded",
]
