"""Tiny Hugging Face config.json dicts, one per family, shared by the model tests.

GQA where the family has it (8 query heads over 4 kv heads, so TP=4 still holds whole groups;
Qwen2 keeps 4 over 2 to cover a TP=2-only layout), dropouts off (parity needs deterministic runs).
"""
from __future__ import annotations

import copy

GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4,
        "vocab_size": 100, "n_positions": 64, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0,
        "tie_word_embeddings": True}
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 100,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}
QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
         "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
         "vocab_size": 100, "attention_bias": True, "tie_word_embeddings": False}
MISTRAL = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
           "vocab_size": 100, "sliding_window": 5, "tie_word_embeddings": False}

FAMILIES = {"gpt2": GPT2, "llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "mistral": MISTRAL}


def config(name: str, **changes) -> dict:
    """A fresh copy of a family's tiny config with ``changes`` applied (None deletes a key)."""
    cfg = copy.deepcopy(FAMILIES[name])
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg
