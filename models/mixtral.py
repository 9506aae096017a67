"""Mixtral: Mistral-shaped attention with a sparse MoE MLP in every layer (``block_sparse_moe``): softmax
router, top-k renormalised (models/moe.py, docs/moe.md)."""
from __future__ import annotations

from typing import Any, Mapping

from models.config import TransformerConfig, hf_require
from models.llama import hf_aliases, hf_ignored, parse_llama_like
from models.moe import moe_fields, moe_hf_entries, with_moe

ARCHITECTURES = ("MixtralForCausalLM",)


def parse_config(hf: Mapping[str, Any]) -> TransformerConfig:
    layers = hf_require(hf, "num_hidden_layers", family="mixtral")
    window = hf.get("sliding_window")
    cfg = parse_llama_like(hf, family="mixtral", architectures=ARCHITECTURES, qkv_bias=False, out_bias=False,
                           sliding_windows=(window,) * layers if window is not None else (),
                           max_position_default=4096 * 32)
    return with_moe(cfg, moe_fields(hf, family="mixtral", num_experts_keys=("num_local_experts", "num_experts"), shared=False,
                                    norm_topk_prob=True))


def hf_entries(cfg: TransformerConfig, *, layers, pre_process: bool, post_process: bool):
    return moe_hf_entries(cfg, layers=layers, pre_process=pre_process, post_process=post_process,
                          block="block_sparse_moe", expert_keys=("w1", "w3", "w2"))


__all__ = ["parse_config", "hf_entries", "hf_aliases", "hf_ignored", "ARCHITECTURES"]
