"""Save and restore a :class:`engine.trainer.Trainer`: model shards, distributed-optimizer shards, trainer
state, data position and RNG streams, in any TP/PP/DP layout.

What is saved (keys are layout-independent):

* ``model.<name>``: every parameter of ``trainer.chunks`` under its logical name (the chunk index of
  the module list is dropped: model layers carry GLOBAL layer indices, so a layer keeps its key
  whichever stage holds it). The last stage's copy of a tied embedding (``output_layer.weight``
  with ``shared_embedding``) is a replica of ``embedding.word_embeddings.weight``; vocab-padded
  tensors may change their padding between layouts.
* ``optimizer.{master,exp_avg,exp_avg_sq}.<name>``: the distributed optimizer's flat shards
  (``DistributedOptimizer.state_shards``), as flat ranges of each parameter's local tensor.
* trainer state (JSON): step, consumed samples, the optimizer's update count, the data loader
  state; per rank: torch's CPU/CUDA generator states and every stage's RNG tracker streams.

RNG states are restored only into the same layout (world size and degrees); after a resharding
the streams keep their fresh seeding (they cannot be mapped between different rank sets).
"""
from __future__ import annotations

import os
import re
from typing import Callable

import torch

from engine.checkpoint.checkpointer import Checkpointer
from engine.checkpoint.layouts import (FlatShard, ParamSpec, ShardingContext, flat_buffer_sharded_tensors,
                                       module_layouts)
from engine.checkpoint.load import LoadResult, load_checkpoint
from engine.checkpoint.save import SaveHandle
from engine.checkpoint.sharded import ShardedTensor
from parallel.comm import Group

_CHUNK_PREFIX = re.compile(r"^\d+\.")
TIED_EMBEDDING = "embedding.word_embeddings.weight"
VOCAB_PADDED = ("word_embeddings.weight", "output_layer.weight")


def default_param_spec(name: str, param: torch.Tensor) -> ParamSpec:
    """Logical key and placement of a parameter of ``trainer.chunks`` (models/ naming conventions)."""
    key = _CHUNK_PREFIX.sub("", name)
    padded = key.endswith(VOCAB_PADDED)
    if key == "output_layer.weight" and getattr(param, "shared_embedding", False):
        # The last stage's copy of the tied embedding: identical after every step (its gradient is
        # summed with the first stage's), so it is loaded from, never written as, the embedding.
        return ParamSpec(key=TIED_EMBEDDING, extra_replica=1, allow_shape_mismatch=True)
    return ParamSpec(key=key, allow_shape_mismatch=padded)


def layout_of(trainer) -> dict:
    """The parallel layout that decides whether per-rank state can be restored as is."""
    p = trainer.cfg.parallel
    d = trainer.mesh.dims
    return {"dp": d.dp, "pp": d.pp, "tp": d.tp, "cp": d.cp, "ep": d.ep, "vp": p.vp, "order": "-".join(trainer.mesh.order),
            "zero": bool(trainer.ddp.sharded), "world_size": trainer.mesh.world_size}


def trainer_tensors(trainer, *, hook: Callable = default_param_spec, optimizer: bool = True) -> list[ShardedTensor]:
    """ShardedTensors viewing the trainer's parameters and (with ``optimizer``) its optimizer shards."""
    ctx = ShardingContext.from_mesh(trainer.mesh)
    layouts = module_layouts(trainer.chunks, ctx=ctx, hook=hook)
    params = dict(trainer.chunks.named_parameters())
    out: list[ShardedTensor] = []
    for name, layout in layouts.items():
        out.extend(layout.sharded(params[name].detach(), prefix="model."))
    if optimizer:
        for buf in trainer.optimizer.dist.state_shards():
            placements = [(layouts[n], s, e) for n, s, e in buf["placements"] if n in layouts]
            shards = [FlatShard(start=s, end=e, states=states) for s, e, states in buf["shards"]]
            out.extend(flat_buffer_sharded_tensors(placements, shards, prefix="optimizer."))
    return out


def _rng_state(trainer) -> dict:
    state = {"torch_cpu": torch.get_rng_state(),
             "trackers": [m.rng.get_states() if hasattr(m, "rng") else {} for m in trainer.chunks]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(trainer, state: dict) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])
    for m, tracker_state in zip(trainer.chunks, state["trackers"]):
        if hasattr(m, "rng") and tracker_state:
            m.rng.set_states(tracker_state)


def save_trainer(checkpointer: Checkpointer, trainer, *, loader=None, model_config: dict | None = None,
                 hook: Callable = default_param_spec) -> SaveHandle:
    """Save ``trainer`` at its current step through ``checkpointer`` (collective over its group).

    Waits for an in-flight parameter all-gather first (with ZeRO the parameters are only complete
    once it lands). ``loader`` (``state_dict()``) and ``model_config`` (the HF config dict) go in
    the metadata.
    """
    trainer.ddp.finish_param_sync()
    state = {"step": trainer.step, "consumed_samples": trainer.consumed_samples,
             "optimizer_steps": trainer.optimizer.step_count,
             "loader": loader.state_dict() if loader is not None else None,
             "config": trainer.cfg.to_dict() if hasattr(trainer.cfg, "to_dict") else None}
    return checkpointer.save(step=trainer.step, tensors=trainer_tensors(trainer, hook=hook), model_config=model_config,
                             layout=layout_of(trainer), trainer_state=state, rank_state=_rng_state(trainer))


def load_trainer(trainer, path: str | os.PathLike, *, group: Group | None, loader=None, model_only: bool = False,
                 strict: bool = True, verify: bool = True, hook: Callable = default_param_spec) -> LoadResult:
    """Restore ``trainer`` from a checkpoint written in any layout (collective over ``group``).

    Full resume: parameters, optimizer shards, step counters, the loader position and (same layout
    only) the RNG streams. ``model_only=True`` (fine-tuning): only the parameters are read, the
    optimizer's fp32 masters are re-derived from them and the counters stay at zero.
    """
    tensors = trainer_tensors(trainer, hook=hook, optimizer=not model_only)
    result = load_checkpoint(path, tensors=tensors, group=group, layout=layout_of(trainer), strict=strict,
                             verify=verify)
    if model_only:
        trainer.optimizer.dist.load_masters_from_params()
        return result
    state = result.trainer_state or {}
    for field in ("step", "consumed_samples", "optimizer_steps"):
        if field not in state:
            raise ValueError(f"checkpoint {result.path} has no trainer_state.{field}: it was not written by "
                             "save_trainer; load it with model_only=True to take just the weights")
    trainer.step = int(state["step"])
    trainer.consumed_samples = int(state["consumed_samples"])
    trainer.optimizer.dist.step_count = int(state["optimizer_steps"])
    if loader is not None:
        loader.load_state_dict(state.get("loader") or {"consumed_samples": trainer.consumed_samples})
    if result.rank_state is not None:
        _set_rng_state(trainer, result.rank_state)
    return result
