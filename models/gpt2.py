"""GPT-2: learned positions, LayerNorm, GeLU (tanh approximation = Hugging Face ``gelu_new``), tied
embeddings, biases everywhere, multi-head attention (every head its own kv group).

On disk: ``transformer.wte.weight``, ``transformer.wpe.weight``, ``transformer.h.{i}.ln_1.*``,
``attn.c_attn.*`` (Conv1D: weight (in, 3h) = [q | k | v] columns), ``attn.c_proj.*``, ``ln_2.*``,
``mlp.c_fc.*``, ``mlp.c_proj.*``, ``transformer.ln_f.*``. Files written by transformers 5 carry the
``transformer.`` prefix; the original OpenAI-converted files do not (both are read; the prefixed
spelling is written) and may hold the old ``attn.bias`` / ``attn.masked_bias`` buffers (ignored).
Conv1D weights are transposed to (out, in) on load and back on export.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from models.config import TransformerConfig, check_architectures, hf_reject, hf_require
from models.hf_layout import HFEntry

ARCHITECTURES = ("GPT2LMHeadModel",)
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def parse_config(hf: Mapping[str, Any]) -> TransformerConfig:
    family = "gpt2"
    check_architectures(hf, supported=ARCHITECTURES, family=family)
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise ValueError(f"gpt2 config field activation_function={act!r} is not supported; use one of "
                         f"{sorted(_ACTIVATIONS)}")
    hf_reject(hf, "scale_attn_by_inverse_layer_idx", allowed=(False, None), family=family,
              why="per-layer attention scaling is not implemented")
    hf_reject(hf, "add_cross_attention", allowed=(False, None), family=family,
              why="Tessel builds decoder-only models")
    # reorder_and_upcast_attn only changes where eager fp16 attention upcasts; SDPA accumulates in fp32.
    hidden = hf_require(hf, "n_embd", family=family)
    heads = hf_require(hf, "n_head", family=family)
    if hidden % heads:
        raise ValueError(f"gpt2: n_embd={hidden} is not divisible by n_head={heads}")
    layers = hf_require(hf, "n_layer", family=family)
    return TransformerConfig(
        model_type=family,
        vocab_size=hf_require(hf, "vocab_size", family=family),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
        max_position_embeddings=hf_require(hf, "n_positions", family=family),
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        mlp=_ACTIVATIONS[act],
        position_embedding="learned",
        rope=None,
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_dropout=float(hf.get("attn_pdrop", 0.1)),
        hidden_dropout=float(hf.get("resid_pdrop", 0.1)),
        embedding_dropout=float(hf.get("embd_pdrop", 0.1)),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        scaled_output_init=True,
        attention_scale=None if hf.get("scale_attn_weights", True) else 1.0,
    )


def hf_entries(cfg: TransformerConfig, *, layers, pre_process: bool, post_process: bool) -> list[HFEntry]:
    out: list[HFEntry] = []
    if pre_process:
        out.append(HFEntry("embedding.word_embeddings.weight", ("transformer.wte.weight",), "vocab"))
        out.append(HFEntry("embedding.position_embeddings.weight", ("transformer.wpe.weight",), "replicated"))
    for i in layers:
        hf, us = f"transformer.h.{i}.", f"layers.{i}."
        for p in ("weight", "bias"):
            out.append(HFEntry(f"{us}input_norm.{p}", (f"{hf}ln_1.{p}",), "replicated"))
            out.append(HFEntry(f"{us}attention.qkv.{p}", (f"{hf}attn.c_attn.{p}",), "qkv_packed", conv1d=True))
            out.append(HFEntry(f"{us}post_attention_norm.{p}", (f"{hf}ln_2.{p}",), "replicated"))
            out.append(HFEntry(f"{us}mlp.fc1.{p}", (f"{hf}mlp.c_fc.{p}",), "column", conv1d=True))
        out.append(HFEntry(f"{us}attention.out.weight", (f"{hf}attn.c_proj.weight",), "row", conv1d=True))
        out.append(HFEntry(f"{us}attention.out.bias", (f"{hf}attn.c_proj.bias",), "replicated"))
        out.append(HFEntry(f"{us}mlp.fc2.weight", (f"{hf}mlp.c_proj.weight",), "row", conv1d=True))
        out.append(HFEntry(f"{us}mlp.fc2.bias", (f"{hf}mlp.c_proj.bias",), "replicated"))
    if post_process:
        for p in ("weight", "bias"):
            out.append(HFEntry(f"final_norm.{p}", (f"transformer.ln_f.{p}",), "replicated"))
        head = "transformer.wte.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        out.append(HFEntry("output_layer.weight", (head,), "vocab"))
    return out


_OLD_BUFFERS = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")


def hf_aliases(key: str) -> tuple[str, ...]:
    """The unprefixed spelling of the original OpenAI-converted files."""
    return (key[len("transformer."):],) if key.startswith("transformer.") else ()


def hf_ignored(key: str, cfg: TransformerConfig) -> bool:
    return bool(_OLD_BUFFERS.match(key)) or (cfg.tie_word_embeddings and key == "lm_head.weight")
