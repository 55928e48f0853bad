"""Partitioned passes over data on Ray Train workers: one engine, the passes as plug-ins.

* :mod:`.engine`: the plan (finished / to-compute partitions, prefetching), local
  accumulation, the per-interval reduce, checkpoint commit and resume, skip reports and the
  rows check, fault injection (:class:`PassRun`, :class:`PassKind`).
* :mod:`.kinds`: pass 1 (KFAC + Fisher diagonal), the EFB pass, the subnet Fisher pass.
* :mod:`.comm`: bucketed all-reduce, object broadcast, symmetric (upper-triangle) packing.
* :mod:`.checkpoint`: checkpoint artifacts (newest valid one, fallback, commit then prune).
* :mod:`.workers`: the job object, the ``TorchTrainer`` factory, worker set-up, partitions.
* :mod:`.progress`: the progress / ETA logger.
"""
from .checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from .comm import allreduce_sum, broadcast_object, buckets, pack_symmetric, packed_size, unpack_symmetric
from .engine import PassKind, PassResult, PassRun, dataset_name
from .progress import Progress, say
from .workers import (
    DTYPES,
    FaultInjection,
    Job,
    ModelRef,
    fingerprint,
    gpu_shortfall,
    index_partitions,
    decode_cpus_that_fit,
    fit_interruptibly,
    make_trainer,
    trainer_cpus,
    model_ref,
    partition_dataset,
    path_keys,
    put_sources,
    worker_setup,
)

__all__ = [
    "DTYPES", "FaultInjection", "Job", "ModelRef", "PassKind", "PassResult", "PassRun", "Progress",
    "allreduce_sum", "broadcast_object", "buckets", "dataset_name", "fingerprint", "gpu_shortfall",
    "index_partitions", "list_checkpoints", "load_checkpoint", "make_trainer", "fit_interruptibly", "trainer_cpus", "decode_cpus_that_fit",
    "model_ref", "pack_symmetric", "packed_size", "partition_dataset", "path_keys", "put_sources", "save_checkpoint",
    "say", "unpack_symmetric", "worker_setup",
]
