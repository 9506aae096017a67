"""Save and restore a :class:`engine.trainer.Trainer`: model shards, distributed-optimizer shards, trainer
state, data position and RNG streams, in any TP/PP/DP layout.

What is saved (keys are layout-independent):

* ``model.<name>``: every parameter of ``trainer.chunks`` under its logical name (the chunk index of
  the module list is dropped: model layers carry GLOBAL layer indices, so a layer keeps its key
  whichever stage holds it). The last stage's copy of a tied embedding (``output_layer.weight``
  with ``shared_embedding``) is a replica of ``embedding.word_embeddings.weight``; vocab-padded
  tensors may change their padding between layouts. Under ZeRO-3 each rank writes the flat pieces of
  its parameter shards (like the optimizer state), which load into any layout and ZeRO stage.
* ``optimizer.{master,exp_avg,exp_avg_sq}.<name>``: the distributed optimizer's flat shards
  (``DistributedOptimizer.state_shards``), as flat ranges of each parameter's local tensor.
* trainer state (JSON), composed from each component's ``state_dict()``: the trainer's step and
  consumed samples, the optimizer's update count, the data loader's position; per rank the
  trainer's ``rng_state()`` (torch's CPU/CUDA generators and every chunk's RNG tracker streams).
  Parameter keys come from the model's ``param_spec`` (models/hook.py), never from names here.
  The plain (non-ZeRO) optimizer's state is a replica on every dp rank, saved once.
* ``fp8.<layer>.{amax_history,scale,steps}``: FP8 delayed-scaling state (model.fp8 = "delayed"),
  keyed by the linear's global name, so it follows its layer into any layout.
* per rank, keyed by global rank and restored into the same layout only (:func:`_local_components`):
  ``outer.rank<R>.*`` (DiLoCo's anchor, momentum, error feedback, reductions in flight and the replica's
  own masters and moments), ``fp8_replica.rank<R>.*`` (with DiLoCo and delayed scaling: the replica's own
  amax histories, which differ between syncs) and ``grad_compression.rank<R>.*`` (PowerSGD / 1-bit error
  feedback), with their JSON under ``trainer_state.<component>``.

``params`` selects the model parameters saved or loaded: ``"all"``, ``"trainable"`` (requires_grad:
with LoRA the adapters alone, an adapter-only checkpoint; the optimizer only ever holds trainable
parameters) or ``"frozen"`` (the rest: the base weights a LoRA run takes from ``checkpoint.load``).
A LoRA run (engine/posttrain/lora.py) records its settings as ``trainer_state.lora`` (rank, alpha,
dropout, targets, scaling, ``adapters_only``), which tools/lora_export.py and tools/evaluate.py read and a
full resume must match (:func:`same_lora`: another alpha or dropout would load and silently change the run).

RNG states are restored only into the same layout (world size and degrees); after a resharding
the streams keep their fresh seeding (they cannot be mapped between different rank sets).
"""
from __future__ import annotations

import json
import os
import re
from typing import Callable

import torch

from engine.checkpoint.checkpointer import Checkpointer
from engine.checkpoint.layouts import FlatShard, ShardingContext, flat_buffer_sharded_tensors, module_layouts
from engine.checkpoint.load import LoadResult, load_checkpoint
from engine.checkpoint.save import SaveHandle
from engine.checkpoint.sharded import ShardedTensor
from engine.ops.fp8_linear import delayed_states
from engine.posttrain.lora import lora_settings
from parallel.comm import Group
from parallel.tensor_parallel.fp8 import ReplicaFp8State

PARAM_SELECTIONS = ("all", "trainable", "frozen")


def _hook(trainer, hook: Callable | None) -> Callable:
    hook = hook or trainer.param_spec
    if hook is None:
        raise ValueError("the trainer has no param_spec (the model's checkpoint keys); build it with "
                         "engine.assembly.build_run, or pass hook=")
    return hook


def select_params(hook: Callable, params: str) -> Callable:
    """``hook`` (name, param) -> ParamSpec, returning None (skip) for parameters outside ``params``
    (one of :data:`PARAM_SELECTIONS`)."""
    if params not in PARAM_SELECTIONS:
        raise ValueError(f"params={params!r} must be one of {PARAM_SELECTIONS} ('trainable': with LoRA, the "
                         "adapters only; 'frozen': the base weights)")
    if params == "all":
        return hook

    def selected(name, p):
        return hook(name, p) if p.requires_grad == (params == "trainable") else None
    return selected


def trainer_tensors(trainer, *, hook: Callable | None = None, optimizer: bool = True,
                    params: str = "all") -> list[ShardedTensor]:
    """ShardedTensors viewing the trainer's parameters (those ``params`` selects) and (with
    ``optimizer``) its optimizer state."""
    ctx = ShardingContext.from_mesh(trainer.mesh)
    with trainer.ddp.full_shapes():  # ZeRO-3: layouts need the full shapes, not the data
        layouts = module_layouts(trainer.chunks, ctx=ctx, hook=select_params(_hook(trainer, hook), params))
    if not layouts:
        raise ValueError(f"params={params!r} selects none of this rank's parameters (every one is "
                         f"{'frozen' if params == 'trainable' else 'trainable'}): without LoRA adapters use "
                         "params='all'")
    by_name = dict(trainer.chunks.named_parameters())
    out: list[ShardedTensor] = []
    zero3 = _zero3_param_shards(trainer.ddp, layouts)
    for name, layout in layouts.items():
        if name in zero3:
            out.extend(zero3[name])
        else:
            out.extend(layout.sharded(by_name[name].detach(), prefix="model."))
    # FP8 delayed-scaling state (amax histories, scales, update counts): identical on every TP and
    # DP replica (reduced each step), keyed by the layer's global name; replica 0 writes. (DiLoCo's
    # replicas differ between synchronisations: each rank's own also goes in its per-rank state.)
    replica = ctx.replica_rank * ctx.tp_size + ctx.tp_rank
    for name, state in delayed_states(trainer.chunks):
        name = re.sub(r"^\d+\.", "", name)
        for buf, t in state.state_dict().items():
            out.append(ShardedTensor.replicated(f"fp8.{name}.{buf}", t, replica_id=replica))
    # Aux-loss-free balancing biases of MoE routers (docs/moe.md): identical on every replica, keyed by the
    # router's global name (optional on load: a checkpoint without them starts the biases at zero).
    for name, t in trainer.chunks.named_buffers():
        if name.endswith("router.expert_bias"):
            out.append(ShardedTensor.replicated("moe." + re.sub(r"^\d+\.", "", name), t, replica_id=replica))
    if optimizer:
        for buf in trainer.optimizer.state_shards():
            placements = [(layouts[n], s, e) for n, s, e in buf["placements"] if n in layouts]
            shards = [FlatShard(start=s, end=e, states=states) for s, e, states in buf["shards"]]
            out.extend(flat_buffer_sharded_tensors(placements, shards, prefix="optimizer.",
                                                   dp_replicated=buf["dp_replicated"]))
    return out


def _zero3_param_shards(ddp, layouts: dict) -> dict[str, list[ShardedTensor]]:
    """ZeRO-3: the parameters live as this rank's flat shard of each bucket; each parameter's piece of
    it becomes ``model.<key>`` pieces with flat ranges (like the optimizer's state), so a checkpoint
    holds the same logical tensors as any other layout and reshards to any of them. Empty otherwise."""
    if getattr(ddp, "zero_stage", 0) != 3:
        return {}
    out: dict[str, list[ShardedTensor]] = {}
    for buf, b in ddp.buckets():
        lo, hi = ddp.owned_range(b)
        shard = ddp.owned_params(buf, b)
        for p, (ps, pe) in zip(b.params, b.ranges):
            name = ddp.param_names[id(p)]
            if name not in layouts:
                continue
            pieces = out.setdefault(name, [])
            a, z = max(ps, lo), min(pe, hi)
            if a < z:  # tp_replica_id: dp ranks hold disjoint pieces, TP replicas write once
                pieces.extend(layouts[name].sharded_flat(shard[a - lo:z - lo], start=a - ps, end=z - ps,
                                                         prefix="model."))
    return out


LOST = {  # what a resume that starts a per-rank component afresh would silently lose
    "outer": "a fresh start of the outer loop would silently drop the replicas' own weights",
    "fp8_replica": "fresh amax histories would silently replace the replicas' own FP8 scaling state",
    "grad_compression": "a fresh start would silently drop the compressor's error feedback",
}


def _local_components(trainer) -> list[tuple[str, object]]:
    """Per-rank state beside the layout-independent keys (docs/decentralised.md): DiLoCo's outer optimizer
    (anchor, momentum, error feedback, and the replica's own masters and moments, which differ between
    synchronisations) and a gradient compressor's error feedback. Keyed by global rank: it resumes into
    the same layout only."""
    out = []
    if getattr(trainer, "outer", None) is not None:
        out.append(("outer", trainer.outer))
        m = getattr(getattr(trainer, "cfg", None), "model", None)  # from the config, the same on every rank: the
        # JSON state is rank 0's, whose stage may hold no FP8 linear (model.fp8_exclude, parallel.pipeline_layout)
        if m is not None and m.fp8 == "delayed" and m.fp8_backend == "tessel":
            out.append(("fp8_replica", ReplicaFp8State(trainer.chunks)))  # each replica's own amax histories
    if getattr(trainer.ddp, "grad_compressor", None) is not None:
        out.append(("grad_compression", trainer.ddp.grad_compressor))
    return out


def _local_tensors(trainer, name: str, tensors: dict, *, fresh: bool) -> dict[str, ShardedTensor]:
    rank = trainer.mesh.rank
    return {k: ShardedTensor.replicated(f"{name}.rank{rank}.{k}", t.detach().clone() if fresh else t.detach(),
                                        replica_id=0) for k, t in tensors.items()}


def save_trainer(checkpointer: Checkpointer, trainer, *, loader=None, model_config: dict | None = None,
                 hook: Callable | None = None, side_files: dict[str, bytes] | None = None,
                 params: str = "all", valid_loader=None) -> SaveHandle:
    """Save ``trainer`` at its current step through ``checkpointer`` (collective over its group).

    Waits for an in-flight parameter all-gather first (with ZeRO the parameters are only complete
    once it lands). ``loader`` and ``valid_loader`` (their ``state_dict()``: each evaluation reads new
    validation batches) and ``model_config`` (the HF config dict) go in the metadata; ``side_files`` (e.g. the run's tokenizer as ``hf/tokenizer.json``) go in the step directory.
    ``params="trainable"`` writes only the trainable parameters (a LoRA run's adapters) besides the
    optimizer state; resume it with ``load_trainer(..., params="trainable")`` after loading the base.
    """
    trainer.ddp.finish_param_sync()
    state = {**trainer.state_dict(), "optimizer": trainer.optimizer.state_dict(),
             "loader": loader.state_dict() if loader is not None else None,
             "valid_loader": valid_loader.state_dict() if valid_loader is not None else None,
             "config": trainer.cfg.to_dict() if hasattr(trainer.cfg, "to_dict") else None}
    lora = lora_settings(trainer.chunks)
    if lora is not None:
        state["lora"] = lora.to_json(adapters_only=params == "trainable")
    tensors = trainer_tensors(trainer, hook=hook, params=params)
    for name, comp in _local_components(trainer):
        state[name] = comp.state_dict()  # first: the outer optimizer settles reductions in flight
        # not cloned: the save stages (copies to the host) or writes them before it returns, as the model's and
        # the optimizer's tensors; a device clone cost up to 44 bytes per parameter of transient memory
        tensors.extend(_local_tensors(trainer, name, comp.state_tensors(), fresh=False).values())
    return checkpointer.save(step=trainer.step, tensors=tensors, model_config=model_config,
                             layout=trainer.layout(), trainer_state=state, rank_state=trainer.rng_state(),
                             side_files=side_files)


def model_vocab(model: torch.nn.Module) -> int | None:
    """The vocabulary size of a model (chunk or stage; None where no module says)."""
    for m in model.modules():
        if hasattr(m, "padded_vocab_size") and hasattr(getattr(m, "config", None), "vocab_size"):
            return int(m.config.vocab_size)
    return None


def same_vocab(vocab: int | None, path) -> Callable[[dict], list[str]]:
    """``load_checkpoint``'s ``check_meta``: the checkpoint's vocabulary (its model_config.vocab_size) is
    ``vocab``. The padded embedding / output rows may differ between layouts (vocab padding); the
    vocabulary may not: a larger saved one would be cut, a smaller one zero-filled, and the load would
    look normal."""
    def check(meta: dict) -> list[str]:
        saved = (meta.get("model_config") or {}).get("vocab_size")
        if vocab is None or saved is None or int(saved) == vocab:
            return []
        return [f"checkpoint {path} was saved from a model with a vocabulary of {saved} tokens (its "
                f"model_config.vocab_size), this model has {vocab}: its embedding and output rows would be cut "
                "or zero-filled; load a checkpoint of this vocabulary (or convert the model to it first)"]
    return check


def same_lora(settings, path) -> Callable[[dict], list[str]]:
    """``load_checkpoint``'s ``check_meta`` for a full resume: the checkpoint's ``trainer_state.lora`` (rank,
    alpha, dropout, targets) is ``settings`` (this run's, None without adapters). The tensors would load
    whatever alpha or dropout says, and the run would go on with another scaling."""
    def check(meta: dict) -> list[str]:
        saved = (meta.get("trainer_state") or {}).get("lora")
        if saved is None and settings is None:
            return []
        if saved is None or settings is None:
            return [f"checkpoint {path} was saved {'by a LoRA run' if saved else 'without LoRA adapters'} and this "
                    f"run has {'none' if saved else 'adapters'}: resume it with the saved posttrain.lora settings, "
                    "or start a new run directory"]
        now = settings.to_json(adapters_only=False)
        changes = [f"{k} ({json.dumps(saved.get(k))} -> {json.dumps(now[k])})"
                   for k in ("rank", "alpha", "dropout", "targets") if saved.get(k) != now[k]]
        if not changes:
            return []
        return [f"checkpoint {path} was saved with other LoRA settings than this run's: {', '.join(changes)}; "
                "resume with the saved posttrain.lora values, or start a new run directory"]
    return check


def load_trainer(trainer, path: str | os.PathLike, *, group: Group | None, loader=None, model_only: bool = False,
                 strict: bool = True, verify: bool = True, hook: Callable | None = None,
                 params: str = "all", valid_loader=None) -> LoadResult:
    """Restore ``trainer`` from a checkpoint written in any layout (collective over ``group``).

    Full resume: parameters, optimizer shards, step counters, the loaders' positions (``valid_loader``'s
    where the checkpoint has it: written before, it starts from the first validation batch again) and
    (same layout only) the RNG streams. ``model_only=True`` (fine-tuning): only the parameters are read, the
    optimizer's fp32 masters are re-derived from them and the counters stay at zero. ``params``
    restricts the parameters read: a LoRA run loads its base with ``model_only=True,
    params="frozen"`` (from ``checkpoint.load``), then resumes an adapter-only checkpoint with
    ``params="trainable"``.
    """
    if group is not None and group.size == 1:
        group = None  # one process: no collectives
    tensors = trainer_tensors(trainer, hook=hook, optimizer=not model_only, params=params)
    local = {} if model_only else {name: _local_tensors(trainer, name, comp.state_tensors(), fresh=True)
                                   for name, comp in _local_components(trainer)}
    tensors = tensors + [st for d in local.values() for st in d.values()]
    # A checkpoint written without FP8 delayed scaling (or by another recipe) starts fresh histories.
    # Model-only loads start a fine-tune: a checkpoint of another precision (an fp32 conversion into a
    # bf16 run) is cast, as loading a Hugging Face model in another dtype would.
    checks = [same_vocab(model_vocab(trainer.chunks), path)]
    if not model_only:  # a base for LoRA adapters may come from any run; a resume continues this run's adapters
        checks.append(same_lora(lora_settings(trainer.chunks), path))
    result = load_checkpoint(path, tensors=tensors, group=group, layout=trainer.layout(), strict=strict,
                             verify=verify, optional=("fp8.", "moe.", *(f"{n}.rank" for n in local)),
                             allow_dtype_cast=model_only, check_meta=lambda meta: [p for c in checks for p in c(meta)],
                             unexpected="model." if params == "all" else None)
    saved_biases = sorted(k for k in (result.metadata.get("tensors") or {})
                          if k.startswith("moe.") and k.endswith("router.expert_bias"))
    # From the run's config, the same on every rank: a pipeline stage of only dense layers holds no router, and
    # deciding from its own chunks made it alone raise (the other stages went on to their first collective)
    if saved_biases and not trainer.cfg.parallel.moe_bias_update_rate > 0:
        raise ValueError(f"checkpoint {result.path} holds the routers' balancing biases ({saved_biases[0]}, ...: "
                         "aux-loss-free balancing), but this run has none (parallel.moe_bias_update_rate = 0) and "
                         "would route without them; set parallel.moe_bias_update_rate > 0 (the saved run's, e.g. "
                         "1e-3) to load them and keep balancing")
    if model_only:
        trainer.optimizer.reset_masters_from_params()
        for _, comp in _local_components(trainer):  # DiLoCo's anchor: the loaded weights, not the initial ones
            comp.load_state(None, None)
        return result
    state = dict(result.trainer_state or {})
    if "optimizer_steps" in state:  # written before the optimizer kept its own state
        state.setdefault("optimizer", {"steps": state["optimizer_steps"]})
    for field in ("step", "consumed_samples", "optimizer"):
        if field not in state:
            raise ValueError(f"checkpoint {result.path} has no trainer_state.{field}: it was not written by "
                             "save_trainer; load it with model_only=True to take just the weights")
    trainer.load_state_dict(state)
    trainer.optimizer.load_state_dict(state["optimizer"])
    if loader is not None:
        loader.load_state_dict(state.get("loader") or {"consumed_samples": trainer.consumed_samples})
    if valid_loader is not None and state.get("valid_loader") is not None:
        valid_loader.load_state_dict(state["valid_loader"])
    if result.rank_state is not None:
        trainer.load_rng_state(result.rank_state)
    for name, comp in _local_components(trainer):
        saved = state.get(name)
        if saved is not None and result.rank_state is None:
            raise ValueError(f"checkpoint {result.path} holds per-rank {name} state (DiLoCo / gradient compression) "
                             "written in another parallel layout; resume it with the layout it was saved in")
        lacking = sorted(k for k, st in local[name].items() if st.key in result.missing)
        if saved is not None and lacking:  # e.g. outer.momentum 0 -> 0.9, outer.compression none -> topk
            raise ValueError(f"checkpoint {result.path} holds {name} state without {', '.join(lacking)}, which this "
                             f"run keeps: its {name} settings (outer.method, outer.momentum, outer.compression, "
                             "optim.grad_compression, model.fp8, model.fp8_exclude) differ from the saved run's; resume with the saved settings "
                             f"({LOST[name]})")
        found = saved is not None
        comp.load_state(saved if found else None, {k: st.data for k, st in local[name].items()} if found else None)
    return result
