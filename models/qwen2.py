"""Qwen2 / Qwen2.5: Llama-shaped with biases on q, k, v (not o); optional per-layer sliding windows."""
from __future__ import annotations

from typing import Any, Mapping

from models.config import TransformerConfig, hf_require
from models.llama import hf_aliases, hf_entries, hf_ignored, layer_types_windows, parse_llama_like

ARCHITECTURES = ("Qwen2ForCausalLM",)


def parse_config(hf: Mapping[str, Any]) -> TransformerConfig:
    layers = hf_require(hf, "num_hidden_layers", family="qwen2")
    return parse_llama_like(hf, family="qwen2", architectures=ARCHITECTURES, qkv_bias=True, out_bias=False,
                            sliding_windows=layer_types_windows(hf, family="qwen2", num_layers=layers),
                            max_position_default=32768)


__all__ = ["parse_config", "hf_entries", "hf_aliases", "hf_ignored", "ARCHITECTURES"]
