"""Tensor and sequence parallelism: sharded linears and embedding, vocab-parallel loss, grad fix-ups.

See docs/tensor_parallel.md for the layouts, the parameter attributes and the communication volumes.
"""
from parallel.tensor_parallel.cross_entropy import TPReduce, vocab_parallel_cross_entropy
from parallel.tensor_parallel.grads import allreduce_sequence_parallel_grads, sequence_parallel_params
from parallel.tensor_parallel.layers import (ColumnParallelLinear, DefaultLinearImpl, LinearImpl, RowParallelLinear,
                                             VocabParallelEmbedding, check_ids, default_init)
from parallel.tensor_parallel.sharding import (divide, full_param, gather_full, mark_replicated,
                                               set_tensor_parallel_attributes, shard_tensor, unshard_tensors)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "TPReduce",
           "LinearImpl", "DefaultLinearImpl", "allreduce_sequence_parallel_grads", "sequence_parallel_params",
           "divide", "shard_tensor", "unshard_tensors", "gather_full", "full_param", "set_tensor_parallel_attributes",
           "mark_replicated", "check_ids", "default_init"]
