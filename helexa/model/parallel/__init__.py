"""helexa.model.parallel: the model's side of tensor parallelism — which slice of each weight a rank keeps and
the collectives the sharded layers call. The processes that run the ranks are the engine's (`helexa.engine.parallel`).

- `sharding`: `ShardPlan` (a rank's heads, MLP rows and vocabulary rows; the checkpoint slices it reads) and
  `check_tensor_parallel` (which sizes a model can be split into).
- `comm`: `TensorParallel` (a rank's plan and group), `RowParallelLinear`, `VocabParallelEmbedding`, the logits gather.
"""

from helexa.model.parallel.comm import RowParallelLinear, TensorParallel, VocabParallelEmbedding
from helexa.model.parallel.sharding import ShardPlan, check_tensor_parallel

__all__ = ["RowParallelLinear", "ShardPlan", "TensorParallel", "VocabParallelEmbedding", "check_tensor_parallel"]
