"""Qwen3-MoE: Qwen3 attention (q/k RMSNorm per head) with a sparse MoE MLP (no shared expert);
``decoder_sparse_step`` / ``mlp_only_layers`` keep some layers dense (models/moe.py, docs/moe.md)."""
from __future__ import annotations

from typing import Any, Mapping

from models.config import TransformerConfig, hf_require
from models.llama import hf_aliases, hf_ignored, parse_llama_like
from models.moe import moe_fields, moe_hf_entries, with_moe

ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def parse_config(hf: Mapping[str, Any]) -> TransformerConfig:
    layers = hf_require(hf, "num_hidden_layers", family="qwen3_moe")
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    bias = bool(hf.get("attention_bias", False))
    cfg = parse_llama_like(hf, family="qwen3_moe", architectures=ARCHITECTURES, qkv_bias=bias, out_bias=bias,
                           qk_norm=True, sliding_windows=(window,) * layers if window is not None else (),
                           max_position_default=32768)
    return with_moe(cfg, moe_fields(hf, family="qwen3_moe", num_experts_keys=("num_experts", "num_local_experts"),
                                    shared=False))


def hf_entries(cfg: TransformerConfig, *, layers, pre_process: bool, post_process: bool):
    return moe_hf_entries(cfg, layers=layers, pre_process=pre_process, post_process=post_process, block="mlp",
                          expert_keys=("gate_proj", "up_proj", "down_proj"))


__all__ = ["parse_config", "hf_entries", "hf_aliases", "hf_ignored", "ARCHITECTURES"]
