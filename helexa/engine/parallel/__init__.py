"""helexa.engine.parallel: the processes of tensor parallelism — one model over N ranks with torch.distributed
(NCCL on GPUs, gloo on CPU). The sharded layers themselves are the model's (`helexa.model.parallel`).

- `step`: each step's inputs packed into one tensor and broadcast from rank 0 (`StepChannel`).
- `group`: rank 0's side: process group set-up, worker spawn, the block-count agreement, fault detection, teardown.
- `worker`: the worker ranks' process (imported by the spawned processes only).
"""

from helexa.engine.parallel.group import TensorParallelFault, TensorParallelGroup, WorkerSpec, free_port, group_address
from helexa.engine.parallel.step import StepChannel, StepTensors

__all__ = [
    "StepChannel",
    "StepTensors",
    "TensorParallelFault",
    "TensorParallelGroup",
    "WorkerSpec",
    "free_port",
    "group_address",
]
