"""Llama 2 / 3 / 3.1 / 3.2 (RMSNorm, SwiGLU, RoPE incl. llama3 scaling, GQA, tied or untied).

Also the shared reader and Hugging Face key map of the Llama-shaped families (Qwen2, Qwen3,
Mistral differ only in a few flags: biases, q/k norm, sliding windows).

On disk (``save_pretrained``): ``model.embed_tokens.weight``, ``model.layers.{i}.input_layernorm.weight``,
``self_attn.{q,k,v,o}_proj.{weight,bias}``, ``self_attn.{q,k}_norm.weight`` (Qwen3),
``post_attention_layernorm.weight``, ``mlp.{gate,up,down}_proj.weight``, ``model.norm.weight``,
``lm_head.weight`` (absent when tied).
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from models.config import TransformerConfig, check_architectures, hf_reject, hf_require, parse_rope
from models.hf_layout import HFEntry

ARCHITECTURES = ("LlamaForCausalLM",)

# transformers' defaults (its configuration_<family>.py) for the fields a Llama-shaped config.json may leave
# out, so that Tessel builds from the file what transformers builds. head_dim None: hidden_size //
# num_attention_heads; num_key_value_heads None: num_attention_heads (multi-head attention).
HF_DEFAULTS = {
    "llama": dict(rope_theta=10000.0, rms_norm_eps=1e-6, head_dim=None, num_key_value_heads=None),
    "mistral": dict(rope_theta=10000.0, rms_norm_eps=1e-6, head_dim=None, num_key_value_heads=8),
    "mixtral": dict(rope_theta=1e6, rms_norm_eps=1e-5, head_dim=None, num_key_value_heads=8),
    "qwen2": dict(rope_theta=10000.0, rms_norm_eps=1e-6, head_dim=None, num_key_value_heads=32),
    "qwen3": dict(rope_theta=10000.0, rms_norm_eps=1e-6, head_dim=128, num_key_value_heads=32),
    "qwen2_moe": dict(rope_theta=10000.0, rms_norm_eps=1e-6, head_dim=None, num_key_value_heads=16),
    "qwen3_moe": dict(rope_theta=10000.0, rms_norm_eps=1e-6, head_dim=None, num_key_value_heads=4),
}


def parse_llama_like(hf: Mapping[str, Any], *, family: str, architectures: tuple[str, ...], qkv_bias: bool,
                     out_bias: bool, mlp_bias: bool = False, qk_norm: bool = False,
                     sliding_windows: tuple[int | None, ...] = (), max_position_default: int = 2048
                     ) -> TransformerConfig:
    check_architectures(hf, supported=architectures, family=family)
    hf_reject(hf, "hidden_act", allowed=("silu",), family=family,
              why="the gated MLP is implemented as SwiGLU only")
    defaults = HF_DEFAULTS[family]
    hidden = hf_require(hf, "hidden_size", family=family)
    heads = hf_require(hf, "num_attention_heads", family=family)
    # A key left out gets the family's default; one written as null means hidden / heads (and MHA), as
    # transformers' Llama reads it.
    head_dim = hf["head_dim"] if "head_dim" in hf else defaults["head_dim"]
    kv_heads = hf["num_key_value_heads"] if "num_key_value_heads" in hf else defaults["num_key_value_heads"]
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"{family}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                             "and config.json has no head_dim; set head_dim")
        head_dim = hidden // heads
    return TransformerConfig(
        model_type=family,
        vocab_size=hf_require(hf, "vocab_size", family=family),
        hidden_size=hidden,
        num_layers=hf_require(hf, "num_hidden_layers", family=family),
        num_heads=heads,
        num_kv_heads=kv_heads or heads,
        head_dim=head_dim,
        ffn_hidden_size=hf_require(hf, "intermediate_size", family=family),
        max_position_embeddings=hf.get("max_position_embeddings") or max_position_default,
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
        mlp="swiglu",
        position_embedding="rope",
        rope=parse_rope(hf, family=family, default_theta=defaults["rope_theta"]),
        qkv_bias=qkv_bias,
        out_bias=out_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_norm,
        sliding_windows=sliding_windows,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_dropout=float(hf.get("attention_dropout") or 0.0),
        initializer_range=float(hf.get("initializer_range", 0.02)),
    )


def parse_config(hf: Mapping[str, Any]) -> TransformerConfig:
    bias = bool(hf.get("attention_bias", False))  # Llama's attention_bias covers q, k, v and o
    return parse_llama_like(hf, family="llama", architectures=ARCHITECTURES, qkv_bias=bias, out_bias=bias,
                            mlp_bias=bool(hf.get("mlp_bias", False)))


def layer_types_windows(hf: Mapping[str, Any], *, family: str, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows of Qwen2/Qwen3 (``layer_types``, or use_sliding_window + max_window_layers)."""
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(num_layers)]
    if len(types) != num_layers:
        raise ValueError(f"{family} layer_types has {len(types)} entries for num_hidden_layers={num_layers}")
    for t in types:
        if t not in ("full_attention", "sliding_attention"):
            raise ValueError(f"{family} layer_types entry {t!r} is not supported; use 'full_attention' or "
                             "'sliding_attention'")
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def hf_entries(cfg: TransformerConfig, *, layers, pre_process: bool, post_process: bool) -> list[HFEntry]:
    """Tessel parameter <-> Hugging Face keys for the given global layer indices and ends."""
    out: list[HFEntry] = []
    if pre_process:
        out.append(HFEntry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"))
    for i in layers:
        hf, us = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        out.append(HFEntry(us + "input_norm.weight", (hf + "input_layernorm.weight",), "replicated"))
        out.append(HFEntry(us + "attention.qkv.weight", tuple(f"{attn}{p}_proj.weight" for p in "qkv"), "qkv"))
        if cfg.qkv_bias:
            out.append(HFEntry(us + "attention.qkv.bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"), "qkv"))
        if cfg.qk_norm:
            out.append(HFEntry(us + "attention.q_norm.weight", (attn + "q_norm.weight",), "replicated"))
            out.append(HFEntry(us + "attention.k_norm.weight", (attn + "k_norm.weight",), "replicated"))
        out.append(HFEntry(us + "attention.out.weight", (attn + "o_proj.weight",), "row"))
        if cfg.out_bias:
            out.append(HFEntry(us + "attention.out.bias", (attn + "o_proj.bias",), "replicated"))
        out.append(HFEntry(us + "post_attention_norm.weight", (hf + "post_attention_layernorm.weight",),
                           "replicated"))
        mlp = hf + "mlp."
        out.append(HFEntry(us + "mlp.fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), "gate_up"))
        out.append(HFEntry(us + "mlp.fc2.weight", (mlp + "down_proj.weight",), "row"))
        if cfg.mlp_bias:
            out.append(HFEntry(us + "mlp.fc1.bias", (mlp + "gate_proj.bias", mlp + "up_proj.bias"), "gate_up"))
            out.append(HFEntry(us + "mlp.fc2.bias", (mlp + "down_proj.bias",), "replicated"))
    if post_process:
        out.append(HFEntry("final_norm.weight", ("model.norm.weight",), "replicated"))
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        out.append(HFEntry("output_layer.weight", (head,), "vocab"))
    return out


_ROTARY_BUFFER = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def hf_aliases(key: str) -> tuple[str, ...]:
    """Other spellings of a canonical key found in files (none for the Llama-shaped families)."""
    return ()


def hf_ignored(key: str, cfg: TransformerConfig) -> bool:
    """Keys some files carry that hold nothing to load: old rotary buffers, a tied lm_head copy."""
    return bool(_ROTARY_BUFFER.match(key)) or (cfg.tie_word_embeddings and key == "lm_head.weight")
