"""Mistral: Llama-shaped with sliding-window attention on every layer (``sliding_window``; null = full)."""
from __future__ import annotations

from typing import Any, Mapping

from models.config import TransformerConfig, hf_require
from models.llama import hf_aliases, hf_entries, hf_ignored, parse_llama_like

ARCHITECTURES = ("MistralForCausalLM",)


def parse_config(hf: Mapping[str, Any]) -> TransformerConfig:
    layers = hf_require(hf, "num_hidden_layers", family="mistral")
    # A config.json without the key gets Hugging Face's MistralConfig default (4096).
    window = hf.get("sliding_window", 4096)
    if hf.get("layer_types") is not None:
        raise ValueError("mistral config has layer_types (alternating attention); that is the Ministral "
                         "architecture, which Tessel does not implement: remove layer_types")
    return parse_llama_like(hf, family="mistral", architectures=ARCHITECTURES, qkv_bias=False, out_bias=False,
                            sliding_windows=(window,) * layers if window is not None else (),
                            max_position_default=131072)


__all__ = ["parse_config", "hf_entries", "hf_aliases", "hf_ignored", "ARCHITECTURES"]
