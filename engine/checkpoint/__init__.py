"""Distributed checkpoints: sharded save, exact and resharding resume, async save, atomic commits.

Tensors are described by the ShardedTensor protocol (:mod:`engine.checkpoint.sharded`), built from
modules and distributed-optimizer shards by :mod:`engine.checkpoint.layouts`, saved by
:func:`save_checkpoint` (safetensors per rank + JSON metadata, committed atomically) and loaded into
any layout by :func:`load_checkpoint`. See docs/checkpoint.md.
"""
from engine.checkpoint._dist import world_group
from engine.checkpoint.checkpointer import Checkpointer
from engine.checkpoint.format import (CheckpointError, CheckpointWarning, find_latest_checkpoint, from_json_state,
                                      list_checkpoints, read_metadata, resolve_checkpoint, to_json_state)
from engine.checkpoint.layouts import (FlatShard, ParamLayout, ParamSpec, ShardingContext, flat_buffer_sharded_tensors,
                                       module_layouts, module_sharded_tensors, param_layout)
from engine.checkpoint.load import LoadResult, load_checkpoint
from engine.checkpoint.save import SaveHandle, apply_retention, save_checkpoint
from engine.checkpoint.sharded import ShardedTensor

__all__ = ["Checkpointer", "CheckpointError", "CheckpointWarning", "FlatShard", "LoadResult", "ParamLayout", "ParamSpec", "SaveHandle",
           "ShardedTensor", "ShardingContext", "apply_retention", "find_latest_checkpoint", "flat_buffer_sharded_tensors",
           "from_json_state", "list_checkpoints", "load_checkpoint", "module_layouts", "module_sharded_tensors",
           "param_layout", "read_metadata", "resolve_checkpoint", "save_checkpoint", "to_json_state", "world_group"]
