"""Tessel model families (GPT-2, Llama, Qwen2/3, Mistral), built from parallel layers.

Entry points: :func:`build_model` (one pipeline stage from a Hugging Face config.json dict),
:func:`load_hf_state_dict` / :func:`export_hf_state_dict` / :func:`export_hf_from_shards`
(Hugging Face weights in and out), :func:`gather_logits`, :func:`config_from_hf`.
"""
from models.config import RopeConfig, TransformerConfig
from models.hf_checkpoint import export_hf_from_shards, export_hf_state_dict, load_hf_state_dict
from models.hf_state import SafetensorsState
from models.registry import FAMILIES, config_from_hf
from models.transformer import TransformerStage, build_model, gather_logits

__all__ = ["build_model", "TransformerStage", "TransformerConfig", "RopeConfig", "config_from_hf", "FAMILIES",
           "load_hf_state_dict", "export_hf_state_dict", "export_hf_from_shards", "gather_logits",
           "SafetensorsState"]
