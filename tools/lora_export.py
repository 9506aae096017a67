"""Export a LoRA run's checkpoint: a PEFT adapter, or merged Hugging Face weights.

``tools/convert_checkpoint.py lora-to-peft`` calls :func:`lora_to_peft`. The checkpoint (any TP x PP
layout, adapter-only or full) stores each adapter under ``model.layers.<i>.<linear>.lora_A`` (r, in) and
``.lora_B`` (out, r) in the TP=1 layout of the base weight, and the run's settings (rank, alpha, dropout,
targets) as ``trainer_state.lora`` (engine/posttrain/lora.py). The family's Hugging Face key map
(models/hf_layout.py) that splits a fused base weight splits B the same way, by rows:

    qkv (grouped per kv group)   B -> q_proj, k_proj, v_proj B's; the three share A (copied)
    gate_up ([gate; up])         B -> gate_proj, up_proj B's; both share A
    qkv_packed (GPT-2 c_attn)    one adapter, B in [q; k; v] row order
    column / row                 one adapter, unchanged

So PEFT, which adds ``scaling * B_k A x`` to each projection k, computes exactly Tessel's fused
``scaling * B A x`` split by rows. PEFT keys: ``base_model.model.<module>.lora_{A,B}.weight``;
``target_modules`` are the layer-relative module names (``self_attn.q_proj``); GPT-2's Conv1D modules
get ``fan_in_fan_out = true`` (the adapter tensors keep nn.Linear's orientation).

``merge=True`` writes ``W + scaling * B A`` (fp32 arithmetic, stored in the base's dtype) for every
adapted weight and every other weight unchanged, through tessel-to-hf's writer: a directory
transformers loads without peft. The base weights come from ``base`` (the run's ``checkpoint.load``),
or from the checkpoint itself when it holds them (saved with ``params="all"``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # a library module: say which command runs it (before imports that need the repo)
    sys.exit("tools/lora_export.py is the library behind `tools/convert_checkpoint.py lora-to-peft`; run that "
             "(python tools/convert_checkpoint.py lora-to-peft --help, docs/posttrain.md)")

from engine.checkpoint import read_metadata, resolve_checkpoint
from engine.checkpoint.format import dtype_from_name
from engine.checkpoint.safetensors_io import SafetensorsWriter
from engine.posttrain.lora import is_adapter_key, settings_from_metadata
from models.convert import MODEL_PREFIX, tessel_full_shape
from models.hf_layout import describe_problems, to_hf
from models.registry import config_from_hf, family
from tools.convert_checkpoint import _out_dtype, _read_json, _verify, read_logical, staged_output, tessel_to_hf

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_LAYER_PATH = re.compile(r"^.*?\.\d+\.")  # "model.layers.3." / "transformer.h.3."


def _model_config(step_dir: Path, meta: dict, config_path: str | None) -> dict:
    if config_path is not None:
        return _read_json(Path(config_path), "--config must name a Hugging Face config.json")
    if meta.get("model_config"):
        return dict(meta["model_config"])
    raise ValueError(f"checkpoint {step_dir} stores no model_config; pass --config CONFIG.JSON (the Hugging Face "
                     "config of the model it holds)")


def adapter_plan(cfg, meta: dict, *, where: str) -> list[dict]:
    """One item per adapted linear: its base weight's Hugging Face entry, checkpoint keys and shapes.
    ValueError naming every adapter without a partner, without a base linear, or mis-shaped."""
    saved = meta["tensors"]
    keys = sorted(k for k in saved if k.startswith(MODEL_PREFIX) and is_adapter_key(k))
    entries = {e.name: e for e in family(cfg.model_type).hf_entries(cfg, layers=range(cfg.num_layers),
                                                                     pre_process=True, post_process=True)}
    modules = sorted({k[len(MODEL_PREFIX):].rsplit(".", 1)[0] for k in keys})
    plan, unpaired, unknown, mismatched = [], [], [], []
    for mod in modules:
        a_key, b_key = f"{MODEL_PREFIX}{mod}.lora_A", f"{MODEL_PREFIX}{mod}.lora_B"
        if a_key not in saved or b_key not in saved:
            unpaired.append(mod)
            continue
        entry = entries.get(f"{mod}.weight")
        if entry is None or entry.layout not in ("column", "row", "qkv", "qkv_packed", "gate_up"):
            unknown.append(mod)
            continue
        out_f, in_f = tessel_full_shape(entry, cfg, padded_vocab=0)
        a_shape, b_shape = tuple(saved[a_key]["shape"]), tuple(saved[b_key]["shape"])
        if len(a_shape) != 2 or a_shape[1] != in_f or b_shape != (out_f, a_shape[0]):
            mismatched.append(f"{mod}: lora_A {a_shape}, lora_B {b_shape}; the base weight ({out_f}, {in_f}) implies "
                              f"(r, {in_f}) and ({out_f}, r)")
            continue
        plan.append({"module": mod, "entry": entry, "a": (a_key, a_shape, dtype_from_name(saved[a_key]["dtype"])),
                     "b": (b_key, b_shape, dtype_from_name(saved[b_key]["dtype"]))})
    problems = describe_problems(("adapters without their A or B", unpaired),
                                 ("adapters on no exportable linear", unknown), ("shape mismatches", mismatched))
    if problems:
        raise ValueError(f"{where}: the LoRA adapters do not match the model config ({cfg.model_type}, "
                         f"{cfg.num_layers} layers): " + "; ".join(problems))
    return plan


def _check_lora_checkpoint(step_dir: Path, meta: dict):
    found = settings_from_metadata(meta)
    has_tensors = any(is_adapter_key(k) for k in meta["tensors"])
    if found is None and not has_tensors:
        raise ValueError(f"checkpoint {step_dir} holds no LoRA adapters (no model.*.lora_A / lora_B tensors, no "
                         "trainer_state.lora): lora-to-peft exports checkpoints of runs with posttrain.lora.rank >= 1; "
                         "export a full model with tessel-to-hf")
    if found is None:
        raise ValueError(f"checkpoint {step_dir} has LoRA adapter tensors but no trainer_state.lora record (rank, "
                         "alpha): it was not written by save_trainer of a LoRA run, so the scaling is unknown")
    if not has_tensors:
        raise ValueError(f"checkpoint {step_dir} records LoRA settings but holds no adapter tensors (saved with "
                         "params='frozen'?); export the checkpoint the run saved its adapters in")
    return found


def read_adapters(step_dir: Path, meta: dict, plan: list[dict]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Full (A, B) per adapted module name, gathered from every TP/PP shard."""
    wanted = [it[ab] for it in plan for ab in ("a", "b")]
    fulls = read_logical(step_dir, meta, wanted)
    return {it["module"]: (fulls[2 * i], fulls[2 * i + 1]) for i, it in enumerate(plan)}


def peft_tensors(cfg, plan: list[dict], adapters: dict) -> tuple[dict[str, torch.Tensor], list[str], bool]:
    """(PEFT state dict, target_modules, fan_in_fan_out) of the adapters."""
    tensors, targets, conv1d = {}, set(), False
    for it in plan:
        a, b = adapters[it["module"]]
        entry = dataclasses.replace(it["entry"], conv1d=False)  # adapters keep nn.Linear's (out, in)
        conv1d |= it["entry"].conv1d
        for hf_key, b_part in to_hf(entry, b, cfg).items():
            module = hf_key.removesuffix(".weight")
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.clone()
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b_part.contiguous()
            targets.add(_LAYER_PATH.sub("", module))
    return tensors, sorted(targets), conv1d


def adapter_config(settings, *, targets: list[str], fan_in_fan_out: bool, base_model: str | None) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": settings.rank,
            "lora_alpha": settings.alpha, "lora_dropout": settings.dropout, "target_modules": targets,
            "fan_in_fan_out": fan_in_fan_out, "bias": "none", "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}


def lora_to_peft(ckpt: str | os.PathLike, out: str | os.PathLike, *, merge: bool = False,
                 base: str | os.PathLike | None = None, base_model: str | None = None, dtype: str = "keep",
                 max_shard_size: str = "2GB", hf_files: str | None = None, config_path: str | None = None,
                 verify: bool = True, force: bool = False) -> Path:
    """Export the LoRA checkpoint ``ckpt`` as a PEFT adapter directory, or (``merge``) as merged Hugging
    Face weights; returns ``out``."""
    out_dtype = _out_dtype(dtype)
    step_dir = resolve_checkpoint(ckpt, what="--ckpt")
    meta = read_metadata(step_dir)
    settings, adapters_only = _check_lora_checkpoint(step_dir, meta)
    config = _model_config(step_dir, meta, config_path)
    cfg = config_from_hf(config)
    plan = adapter_plan(cfg, meta, where=str(step_dir))
    if verify:
        _verify(step_dir, meta)
    adapters = read_adapters(step_dir, meta, plan)
    if merge:
        return _merge(step_dir, adapters, settings, cfg, out, base=base, adapters_only=adapters_only, dtype=dtype,
                      max_shard_size=max_shard_size, hf_files=hf_files, config_path=config_path, verify=verify,
                      force=force)
    if base is not None:
        raise ValueError("--base applies to --merge only (an adapter loads onto the base model in peft)")
    tensors, targets, conv1d = peft_tensors(cfg, plan, adapters)
    if out_dtype is not None:
        tensors = {k: t.to(out_dtype) for k, t in tensors.items()}
    with staged_output(out, force=force, inputs=(step_dir,)) as tmp:
        writer = SafetensorsWriter(tmp / ADAPTER_WEIGHTS, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()],
                                   metadata={"format": "pt"}, digest=False)
        try:
            for k, t in tensors.items():
                writer.write(k, t)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        with open(tmp / ADAPTER_CONFIG, "w") as f:
            json.dump(adapter_config(settings, targets=targets, fan_in_fan_out=conv1d, base_model=base_model), f,
                      indent=2, sort_keys=True)
    return Path(out)


def _merge(step_dir: Path, adapters: dict, settings, cfg, out, *, base, adapters_only: bool, **kw) -> Path:
    if base is None:
        if adapters_only:
            raise ValueError(f"checkpoint {step_dir} holds only the LoRA adapters (saved with params='trainable'); "
                             "pass --base BASE_CKPT, the checkpoint the run loaded its base weights from "
                             "(checkpoint.load)")
        base_dir = step_dir
    else:
        base_dir = resolve_checkpoint(base, what="--base")
        base_config = read_metadata(base_dir).get("model_config")
        if kw["config_path"] is None and base_config and config_from_hf(base_config) != cfg:
            raise ValueError(f"--base {base_dir} holds a different model than {step_dir} (their model_config differ); "
                             "pass the base checkpoint the LoRA run started from")
    deltas = {f"{MODEL_PREFIX}{mod}.weight": (a, b) for mod, (a, b) in adapters.items()}
    merged: set[str] = set()

    def add_delta(key: str, full: torch.Tensor) -> torch.Tensor:
        if key not in deltas:
            return full
        a, b = deltas[key]
        merged.add(key)
        delta = settings.scaling * (b.double() @ a.double())  # (out, r) @ (r, in): rows in W's fused layout
        return (full.double() + delta).to(full.dtype)

    result = tessel_to_hf(base_dir, out, transform=add_delta, **kw)
    assert merged == set(deltas), sorted(set(deltas) - merged)
    return result
