"""Qwen2-MoE (Qwen1.5-MoE): Qwen2 attention (q/k/v biases) with a sparse MoE MLP plus a shared expert
gated by ``sigmoid(x g^T)``; ``decoder_sparse_step`` / ``mlp_only_layers`` keep some layers dense
(models/moe.py, docs/moe.md)."""
from __future__ import annotations

from typing import Any, Mapping

from models.config import TransformerConfig, hf_require
from models.llama import hf_aliases, hf_ignored, parse_llama_like
from models.moe import moe_fields, moe_hf_entries, with_moe

ARCHITECTURES = ("Qwen2MoeForCausalLM",)


def _windows(hf: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
    """transformers' Qwen2-MoE rule: with use_sliding_window, odd-numbered layers (1st, 3rd, ...) below
    max_window_layers slide; or an explicit layer_types list."""
    window = hf.get("sliding_window", 4096)
    types = hf.get("layer_types")
    if types is None:
        use = bool(hf.get("use_sliding_window", False))
        first = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if use and (i + 1) % 2 and i < first else "full_attention" for i in range(layers)]
    if len(types) != layers or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ValueError(f"qwen2_moe layer_types must list 'full_attention' or 'sliding_attention' for each of "
                         f"the {layers} layers; got {types!r}")
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def parse_config(hf: Mapping[str, Any]) -> TransformerConfig:
    layers = hf_require(hf, "num_hidden_layers", family="qwen2_moe")
    cfg = parse_llama_like(hf, family="qwen2_moe", architectures=ARCHITECTURES,
                           qkv_bias=bool(hf.get("qkv_bias", True)), out_bias=False,
                           sliding_windows=_windows(hf, layers), max_position_default=32768)
    return with_moe(cfg, moe_fields(hf, family="qwen2_moe", num_experts_keys=("num_experts", "num_local_experts"),
                                    shared=True))


def hf_entries(cfg: TransformerConfig, *, layers, pre_process: bool, post_process: bool):
    return moe_hf_entries(cfg, layers=layers, pre_process=pre_process, post_process=post_process, block="mlp",
                          expert_keys=("gate_proj", "up_proj", "down_proj"))


__all__ = ["parse_config", "hf_entries", "hf_aliases", "hf_ignored", "ARCHITECTURES"]
