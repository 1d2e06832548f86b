"""Tensor parallelism: one model over N ranks (processes) with torch.distributed; NCCL on GPUs, gloo on CPU.

Module map:

- `sharding`: which slice of each weight a rank keeps (`ShardPlan`) and which sizes can be split.
- `comm`: the collectives the sharded model calls (row-parallel linear, vocab-parallel embedding,
  logits gathered to rank 0).
- `step`: each step's inputs packed into one tensor and broadcast from rank 0.
- `group`: rank 0's side: process group set-up, worker spawn, the block-count agreement, teardown.
- `worker`: the worker ranks' process (imported by the spawned processes only).
"""

from helexa.parallel.comm import RowParallelLinear, TensorParallel, VocabParallelEmbedding
from helexa.parallel.group import TensorParallelFault, TensorParallelGroup, WorkerSpec, free_port, group_address
from helexa.parallel.sharding import ShardPlan, check_tensor_parallel
from helexa.parallel.step import StepChannel, StepTensors

__all__ = [
    "RowParallelLinear",
    "ShardPlan",
    "StepChannel",
    "StepTensors",
    "TensorParallel",
    "TensorParallelFault",
    "TensorParallelGroup",
    "VocabParallelEmbedding",
    "WorkerSpec",
    "check_tensor_parallel",
    "free_port",
    "group_address",
]
