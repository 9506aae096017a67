"""What the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) share: reading the MoE fields of
config.json, the per-expert Hugging Face key map, the MoE MLP of a layer, and the model's aux loss.

Tessel names (global expert indices, so keys do not depend on expert parallelism):
``layers.{i}.mlp.router.weight`` (E, h), ``layers.{i}.mlp.experts.{e}.fc1.weight`` ([gate; up], 2f x h),
``layers.{i}.mlp.experts.{e}.fc2.weight`` (h x f), and with a shared expert
``layers.{i}.mlp.shared_expert.fc1/fc2.weight`` and ``layers.{i}.mlp.shared_expert_gate.weight`` (1, h).
On disk (``save_pretrained``) every expert keeps its own keys: Mixtral
``model.layers.{i}.block_sparse_moe.{gate, experts.{e}.w1 (gate) / w3 (up) / w2 (down)}.weight``; Qwen
``model.layers.{i}.mlp.{gate, experts.{e}.{gate,up,down}_proj, shared_expert.*, shared_expert_gate}.weight``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from models.config import TransformerConfig, hf_reject, hf_require
from models.hf_layout import HFEntry
from models.llama import hf_entries as llama_entries


# transformers' defaults (configuration_qwen{2,3}_moe.py) for the expert sizes a Qwen config.json may leave
# out; Mixtral's experts are intermediate_size wide.
_EXPERT_FFN_DEFAULT = {"qwen2_moe": 1408, "qwen3_moe": 768}
_SHARED_FFN_DEFAULT = {"qwen2_moe": 5632}


def _or_default(hf: Mapping[str, Any], key: str, default):
    return hf[key] if hf.get(key) is not None else default


def moe_fields(hf: Mapping[str, Any], *, family: str, num_experts_keys: tuple[str, ...], shared: bool,
               norm_topk_prob: bool | None = None) -> dict:
    """The MoE fields of :class:`TransformerConfig` from config.json, a field left out taking transformers'
    default for the family. ``norm_topk_prob`` None: read it (Qwen, default False); Mixtral always
    renormalises. ``decoder_sparse_step`` / ``mlp_only_layers`` (Qwen) choose the MoE layers as transformers
    does. ``num_experts_keys``: the spellings of the expert count, first found wins (transformers 5 writes
    Qwen3-MoE's ``num_experts`` as ``num_local_experts``). ``shared``: Qwen2-MoE's shared expert,
    ``shared_expert_intermediate_size`` wide (0: none)."""
    layers = hf_require(hf, "num_hidden_layers", family=family)
    key = next((k for k in num_experts_keys if hf.get(k) is not None), num_experts_keys[0])
    experts = hf_require(hf, key, family=family)
    if family == "mixtral":
        if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
            raise ValueError("mixtral router_jitter_noise is not supported (training-time noise on the MoE input); "
                             "set it to 0.0")
        # transformers' Mixtral ignores the Qwen keys: every layer sparse, experts intermediate_size wide
        ffn = hf_require(hf, "intermediate_size", family=family)
        why = "transformers' Mixtral ignores it: every layer is sparse, each expert intermediate_size wide"
        hf_reject(hf, "moe_intermediate_size", allowed=(None, ffn), family=family, why=why)
        hf_reject(hf, "mlp_only_layers", allowed=(None, []), family=family, why=why)
        hf_reject(hf, "decoder_sparse_step", allowed=(None, 1), family=family, why=why)
    else:
        ffn = _or_default(hf, "moe_intermediate_size", _EXPERT_FFN_DEFAULT[family])
    step = hf.get("decoder_sparse_step", 1) or 1
    dense = set(hf.get("mlp_only_layers") or ())
    moe_layers = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))
    out = dict(num_experts=experts, moe_top_k=hf_require(hf, "num_experts_per_tok", family=family),
               moe_ffn_hidden_size=ffn, moe_layers=() if all(moe_layers) else moe_layers,
               norm_topk_prob=bool(hf.get("norm_topk_prob", False)) if norm_topk_prob is None else norm_topk_prob,
               router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
               router_z_loss_coef=float(hf.get("router_z_loss_coef") or 0.0))
    if shared:
        out["shared_expert_ffn_hidden_size"] = int(_or_default(hf, "shared_expert_intermediate_size",
                                                               _SHARED_FFN_DEFAULT[family]))
    return out


def hf_moe_fields(cfg: TransformerConfig) -> dict:
    """The config.json fields of ``cfg``'s experts, every one written out (models/hook.py's export: so that
    transformers, whose defaults differ, builds the same experts and the same sparse layers)."""
    out = {"num_experts_per_tok": cfg.moe_top_k, "router_aux_loss_coef": cfg.router_aux_loss_coef}
    if cfg.model_type == "mixtral":  # its experts are intermediate_size wide (always written)
        return {**out, "num_local_experts": cfg.num_experts}
    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    out.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_ffn_hidden_size,
               norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=dense)
    if cfg.model_type == "qwen2_moe":  # 0: no shared expert (transformers then builds one of width 0)
        out["shared_expert_intermediate_size"] = cfg.shared_expert_ffn_hidden_size
    return out


def with_moe(cfg: TransformerConfig, fields: dict) -> TransformerConfig:
    return dataclasses.replace(cfg, **fields)


def moe_hf_entries(cfg: TransformerConfig, *, layers, pre_process: bool, post_process: bool, block: str,
                   expert_keys: tuple[str, str, str]) -> list[HFEntry]:
    """The Llama-shaped key map with each MoE layer's dense MLP replaced by its router and experts.
    ``block``: the MoE module's on-disk name (``mlp`` or ``block_sparse_moe``); ``expert_keys``: the
    (gate, up, down) projection names of one expert."""
    out: list[HFEntry] = []
    g, u, d = expert_keys
    for e in llama_entries(cfg, layers=layers, pre_process=pre_process, post_process=post_process):
        if not e.name.startswith("layers.") or ".mlp." not in e.name:
            out.append(e)
            continue
        i = int(e.name.split(".")[1])
        if not cfg.is_moe_layer(i):
            out.append(e)
            continue
        if not e.name.endswith("mlp.fc1.weight"):
            continue  # fc2 (and biases, which MoE families do not have): replaced below
        us, hf = f"layers.{i}.mlp.", f"model.layers.{i}.{block}."
        out.append(HFEntry(us + "router.weight", (hf + "gate.weight",), "replicated"))
        for x in range(cfg.num_experts):
            ex = f"{hf}experts.{x}."
            out.append(HFEntry(f"{us}experts.{x}.fc1.weight", (f"{ex}{g}.weight", f"{ex}{u}.weight"), "gate_up"))
            out.append(HFEntry(f"{us}experts.{x}.fc2.weight", (f"{ex}{d}.weight",), "row"))
        if cfg.shared_expert_ffn_hidden_size:
            sh = hf + "shared_expert."
            out.append(HFEntry(us + "shared_expert.fc1.weight", (sh + "gate_proj.weight", sh + "up_proj.weight"),
                               "gate_up"))
            out.append(HFEntry(us + "shared_expert.fc2.weight", (sh + "down_proj.weight",), "row"))
            out.append(HFEntry(us + "shared_expert_gate.weight", (hf + "shared_expert_gate.weight",), "replicated"))
    return out


def moe_full_shape(name: str, cfg: TransformerConfig) -> tuple[int, ...] | None:
    """The TP=1 shape of an MoE parameter ``name``, or None if it is not one (models/convert.py)."""
    h = cfg.hidden_size
    if ".mlp." not in name:
        return None
    if name.endswith("mlp.router.weight"):
        return (cfg.num_experts, h)
    if name.endswith("mlp.shared_expert_gate.weight"):
        return (1, h)
    if ".mlp.experts." in name:
        f = cfg.moe_ffn_hidden_size
    elif ".mlp.shared_expert." in name:
        f = cfg.shared_expert_ffn_hidden_size
    else:
        return None
    return (2 * f, h) if name.endswith("fc1.weight") else (h, f)


def build_moe_mlp(cfg: TransformerConfig, *, layer_number: int, tp_group, ep_group, dispatcher: str,
                  sequence_parallel: bool, dtype, device, init, cp_group=None, expert_tp: int | None = None):
    """The MoE MLP of layer ``layer_number``, initialised per global parameter name like every other weight.
    ``cp_group``: the context-parallel group the aux loss's expert counts are summed over (None: cp = 1).
    ``expert_tp``: None (= tp: experts sharded over ``tp_group``) or 1 (whole experts, docs/moe.md)."""
    from parallel.expert_parallel import MoELayer

    return MoELayer(hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.moe_ffn_hidden_size,
                    num_experts=cfg.num_experts, top_k=cfg.moe_top_k, tp_group=tp_group, ep_group=ep_group,
                    dispatcher=dispatcher, sequence_parallel=sequence_parallel, norm_topk_prob=cfg.norm_topk_prob,
                    shared_expert_ffn_hidden_size=cfg.shared_expert_ffn_hidden_size,
                    aux_loss_coef=cfg.router_aux_loss_coef, z_loss_coef=cfg.router_z_loss_coef, dtype=dtype,
                    device=device, init=init, name_prefix=f"layers.{layer_number}.mlp.", cp_group=cp_group,
                    expert_tp=expert_tp)


def moe_aux_loss(stage) -> torch.Tensor | None:
    """Hugging Face's ``aux_loss`` (load balancing, pooled over layers) of the last forward of ``stage``'s
    MoE layers (on this rank's tokens); None for a stage without MoE layers."""
    from parallel.expert_parallel import MoELayer, load_balancing_loss

    layers = [m for m in stage.modules() if isinstance(m, MoELayer)]
    if not layers:
        return None
    return load_balancing_loss([m.last_stats for m in layers], num_experts=layers[0].num_experts)


def moe_load(stage) -> dict[int, dict[str, float]]:
    """Per MoE layer of ``stage`` (global index), the last forward's expert load on this rank: tokens per
    expert (top-k assignments) ``min``, ``max`` and coefficient of variation ``cv``, and the layer's ``aux``
    and ``z`` losses; for metrics (not yet logged by the trainer)."""
    from parallel.expert_parallel import MoELayer

    out = {}
    for i, layer in getattr(stage, "layers", {}).items():
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, MoELayer) and mlp.last_stats is not None:
            c = mlp.last_stats.counts
            out[int(i)] = {"min": c.min().item(), "max": c.max().item(),
                           "cv": (c.std(unbiased=False) / c.mean()).item() if c.mean() > 0 else 0.0,
                           "aux": mlp.last_aux_loss.item(), "z": mlp.last_z_loss.item()}
    return out
