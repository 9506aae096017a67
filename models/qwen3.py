"""Qwen3: Llama-shaped with RMSNorm on each query and key head (before RoPE); optional biases/windows."""
from __future__ import annotations

from typing import Any, Mapping

from models.config import TransformerConfig, hf_require
from models.llama import hf_aliases, hf_entries, hf_ignored, layer_types_windows, parse_llama_like

ARCHITECTURES = ("Qwen3ForCausalLM",)


def parse_config(hf: Mapping[str, Any]) -> TransformerConfig:
    layers = hf_require(hf, "num_hidden_layers", family="qwen3")
    bias = bool(hf.get("attention_bias", False))
    return parse_llama_like(hf, family="qwen3", architectures=ARCHITECTURES, qkv_bias=bias, out_bias=bias,
                            qk_norm=True, sliding_windows=layer_types_windows(hf, family="qwen3", num_layers=layers),
                            max_position_default=32768)


__all__ = ["parse_config", "hf_entries", "hf_aliases", "hf_ignored", "ARCHITECTURES"]
