"""Hugging Face ``model_type`` -> the family module that reads its config and names its tensors.

A family module provides ``ARCHITECTURES``, ``parse_config(hf: dict) -> TransformerConfig``,
``hf_entries(cfg, *, layers, pre_process, post_process) -> list[HFEntry]``, ``hf_aliases(key)``
and ``hf_ignored(key, cfg)``. Adding a family = adding a module and a line here.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Mapping

from models import gpt2, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
from models.config import TransformerConfig

FAMILIES: dict[str, ModuleType] = {"gpt2": gpt2, "llama": llama, "qwen2": qwen2, "qwen3": qwen3, "mistral": mistral,
                                   "mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe}


def family(model_type: str) -> ModuleType:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"model_type={model_type!r} is not supported; Tessel builds {sorted(FAMILIES)}") from None


def config_from_hf(hf_config: Mapping[str, Any]) -> TransformerConfig:
    """The :class:`TransformerConfig` of a Hugging Face config.json dict (ValueError if unsupported)."""
    if isinstance(hf_config, TransformerConfig):
        return hf_config
    if not isinstance(hf_config, Mapping):
        raise ValueError(f"hf_config must be the config.json dict, got {type(hf_config).__name__}")
    if "model_type" not in hf_config:
        raise ValueError("config.json has no 'model_type'; pass the model's full config.json")
    return family(hf_config["model_type"]).parse_config(hf_config)
