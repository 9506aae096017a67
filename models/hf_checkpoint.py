"""Hugging Face weights in and out of a (TP-sharded, pipeline-staged) Tessel model.

* :func:`load_hf_state_dict` fills this rank's shards from a mapping of on-disk Hugging Face names
  (a dict, or :class:`models.hf_state.SafetensorsState`, which reads only the slices asked for).
* :func:`export_hf_state_dict` gathers this stage's shards over TP (collective) and returns
  Hugging Face names; :func:`export_hf_from_shards` does the same offline from per-TP-rank state
  dicts (the converter streams files through it).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from models.config import TransformerConfig
from models.hf_layout import HFEntry, describe_problems, hf_shapes, read_shard, shape_of, to_hf
from models.registry import config_from_hf, family
from parallel.tensor_parallel import full_param, unshard_tensors


def _entries(cfg: TransformerConfig, *, layers, pre_process: bool, post_process: bool) -> list[HFEntry]:
    return family(cfg.model_type).hf_entries(cfg, layers=layers, pre_process=pre_process, post_process=post_process)


def _check_stage_args(model, *, tp_rank, tp_size, layer_range, pre_process, post_process) -> None:
    actual = {"tp_rank": model.tp_group.rank, "tp_size": model.tp_group.size, "layer_range": model.layer_range,
              "pre_process": model.pre_process, "post_process": model.post_process}
    given = {"tp_rank": tp_rank, "tp_size": tp_size, "layer_range": layer_range, "pre_process": pre_process,
             "post_process": post_process}
    for k, v in given.items():
        if v is not None and (tuple(v) if k == "layer_range" else v) != actual[k]:
            raise ValueError(f"load_hf_state_dict({k}={v!r}) disagrees with the model, which was built with "
                             f"{k}={actual[k]!r}; build the model for this rank or drop the argument")


def _resolver(src: Mapping[str, Any], fam, available: set[str]):
    def resolve(key: str) -> str | None:
        for k in (key, *fam.hf_aliases(key)):
            if k in available:
                return k
        return None
    return resolve


def load_hf_state_dict(model, hf_state: Mapping[str, Any], *, tp_rank: int | None = None, tp_size: int | None = None,
                       layer_range: tuple[int, int] | None = None, pre_process: bool | None = None,
                       post_process: bool | None = None) -> None:
    """Copy this rank's shards of the Hugging Face tensors in ``hf_state`` into ``model``.

    ``hf_state`` maps on-disk names to tensors; only the keys this stage needs are indexed, through
    ``hf_state.get_slice(key)`` when available (then only this rank's slice is read). The keyword
    arguments default to the model's own; when given they must agree with it. Raises ValueError
    listing missing keys, unexpected keys (not part of the model at all), and shape mismatches.
    """
    _check_stage_args(model, tp_rank=tp_rank, tp_size=tp_size, layer_range=layer_range, pre_process=pre_process,
                      post_process=post_process)
    cfg: TransformerConfig = model.config
    fam = family(cfg.model_type)
    rank, size = model.tp_group.rank, model.tp_group.size
    available = set(hf_state.keys())
    resolve = _resolver(hf_state, fam, available)
    params = dict(model.named_parameters())
    entries = {e.name: e for e in _entries(cfg, layers=range(*model.layer_range), pre_process=model.pre_process,
                                           post_process=model.post_process)}
    unmapped = sorted(set(params) - set(entries))
    assert not unmapped, f"parameters without a Hugging Face mapping: {unmapped}"

    # Unexpected: keys no stage of the full model would read.
    everything = _entries(cfg, layers=range(cfg.num_layers), pre_process=True, post_process=True)
    known = {k for e in everything for k in e.hf_keys}
    known |= {a for k in list(known) for a in fam.hf_aliases(k)}
    unexpected = sorted(k for k in available if k not in known and not fam.hf_ignored(k, cfg))
    missing, mismatched = [], []
    for name, p in params.items():
        e = entries[name]
        for key, want in zip(e.hf_keys, hf_shapes(e, _full_shape(p, size), cfg)):
            actual_key = resolve(key)
            if actual_key is None:
                missing.append(key)
            elif shape_of(hf_state, actual_key) != want:
                mismatched.append(f"{actual_key}: file {shape_of(hf_state, actual_key)}, model expects {want}")
    problems = describe_problems(("missing keys", missing), ("unexpected keys", unexpected),
                                 ("shape mismatches", mismatched))
    if problems:
        raise ValueError(f"cannot load the Hugging Face state into this {cfg.model_type} model: "
                         + "; ".join(problems) + ". Check that config.json belongs to these weights.")
    with torch.no_grad():
        for name, p in params.items():
            e = entries[name]
            whole = not getattr(p, "tensor_parallel", True)  # replicated (norms, expert_tp = 1's experts): all of it
            shard = read_shard(e, hf_state, resolve, ndim=p.dim(), rank=0 if whole else rank,
                               size=1 if whole else size, cfg=cfg, local_rows=p.shape[0])
            assert shard.shape == p.shape, (name, tuple(shard.shape), tuple(p.shape))
            p.copy_(shard)


def _full_shape(p: torch.Tensor, tp: int) -> tuple[int, ...]:
    shape = list(p.shape)
    if getattr(p, "tensor_parallel", False):
        shape[p.partition_dim] *= tp
    return tuple(shape)


def _skip_on_export(e: HFEntry, cfg: TransformerConfig) -> bool:
    # A tied output layer is a copy of the embedding, which the first stage exports.
    return e.name == "output_layer.weight" and cfg.tie_word_embeddings


def export_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (full, unpadded) of this stage's parameters, gathered over the model's TP
    group -- a collective: every TP rank must call it; every rank gets the full result."""
    cfg: TransformerConfig = model.config
    entries = {e.name: e for e in _entries(cfg, layers=range(*model.layer_range), pre_process=model.pre_process,
                                           post_process=model.post_process)}
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        e = entries[name]
        full = full_param(p, model.tp_group)
        if not _skip_on_export(e, cfg):
            out.update(to_hf(e, full, cfg))
    return out


def export_hf_from_shards(hf_config: Mapping[str, Any] | TransformerConfig, shards: Sequence[Mapping[str, torch.Tensor]],
                          *, layer_range: tuple[int, int] | None = None, pre_process: bool = True,
                          post_process: bool = True) -> dict[str, torch.Tensor]:
    """Offline export: ``shards[r]`` is TP rank r's Tessel state dict (parameter names as in the model)
    for one stage; returns the Hugging Face tensors. With one shard it converts a TP=1 state."""
    cfg = config_from_hf(hf_config)
    if not shards:
        raise ValueError("export_hf_from_shards needs at least one shard (one state dict per TP rank)")
    layer_range = layer_range or (0, cfg.num_layers)
    entries = _entries(cfg, layers=range(*layer_range), pre_process=pre_process, post_process=post_process)
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        if e.name == "output_layer.weight" and cfg.tie_word_embeddings and pre_process:
            continue  # no such parameter: the output layer uses the embedding
        missing = [r for r, sd in enumerate(shards) if e.name not in sd]
        if missing:
            raise ValueError(f"tensor {e.name!r} missing from the shard(s) of TP rank(s) {missing}")
        tensors = [sd[e.name] for sd in shards]
        part = e.partition(tensors[0].dim())
        full = tensors[0] if part is None else unshard_tensors(tensors, dim=part[0], stride=part[1])
        if not _skip_on_export(e, cfg):
            out.update(to_hf(e, full, cfg))
    return out
