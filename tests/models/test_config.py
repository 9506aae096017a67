"""Reading Hugging Face config.json dicts into TransformerConfig, and every rejected input."""
from __future__ import annotations

import pytest
import torch

from models import build_model, config_from_hf
from parallel.comm import Group, Ledger
from tests.models.tiny import config


def fake_group(size: int, rank: int = 0) -> Group:
    """A TP group of ``size`` for construction-time checks (never communicates)."""
    return Group(axis="tp", ranks=tuple(range(size)), rank=rank, pg=object(), ledger=Ledger())


def test_families_parse():
    g = config_from_hf(config("gpt2"))
    assert (g.norm, g.mlp, g.position_embedding, g.tie_word_embeddings, g.ffn_hidden_size) == \
        ("layernorm", "gelu_tanh", "learned", True, 256)
    assert g.qkv_bias and g.out_bias and g.mlp_bias and g.scaled_output_init and g.rope is None
    ll = config_from_hf(config("llama"))
    assert (ll.num_heads, ll.num_kv_heads, ll.head_dim, ll.mlp, ll.tie_word_embeddings) == (8, 4, 8, "swiglu", False)
    assert (ll.rope.scaling, ll.rope.theta, ll.rope.factor, ll.rope.original_max_position_embeddings) == \
        ("llama3", 500000.0, 8.0, 16)
    q2 = config_from_hf(config("qwen2"))
    assert q2.qkv_bias and not q2.out_bias and q2.tie_word_embeddings and q2.sliding_windows == ()
    q3 = config_from_hf(config("qwen3"))
    assert q3.qk_norm and q3.head_dim == 16 and q3.qkv_bias and q3.out_bias
    m = config_from_hf(config("mistral"))
    assert m.sliding_windows == (5, 5)
    full = config("mistral")
    full["sliding_window"] = None  # null in config.json: full attention
    assert config_from_hf(full).sliding_windows == ()
    assert config_from_hf(config("mistral", sliding_window=None)).sliding_windows == (4096, 4096)  # HF default


def test_old_style_rope_scaling_and_windows():
    old = config("llama", rope_parameters=None, rope_theta=500000.0,
                 rope_scaling={"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192})
    r = config_from_hf(old).rope
    assert (r.scaling, r.theta, r.factor, r.original_max_position_embeddings) == ("llama3", 500000.0, 32.0, 8192)
    lin = config_from_hf(config("llama", rope_parameters={"rope_type": "linear", "factor": 2.0})).rope
    assert (lin.scaling, lin.factor, lin.theta) == ("linear", 2.0, 10000.0)
    q = config_from_hf(config("qwen2", use_sliding_window=True, sliding_window=7, max_window_layers=1))
    assert q.sliding_windows == (None, 7)
    q = config_from_hf(config("qwen3", use_sliding_window=True, sliding_window=3,
                              layer_types=["sliding_attention", "full_attention"]))
    assert q.sliding_windows == (3, None)


BAD_CONFIGS = [
    (config("llama", model_type=None), "no 'model_type'"),
    (config("llama", model_type="falcon"), "model_type='falcon' is not supported"),
    (config("llama", architectures=["LlamaForSequenceClassification"]), "architecture 'LlamaForSequenceClassif"),
    (config("llama", hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (config("llama", rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn'"),
    (config("llama", rope_parameters={"rope_type": "dynamic", "factor": 4.0}), "rope_scaling type 'dynamic'"),
    (config("llama", partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (config("llama", rope_parameters={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}),
     "needs 'low_freq_factor'"),
    (config("llama", rope_parameters={"rope_type": "linear"}), "needs 'factor'"),
    (config("llama", rope_parameters={"full_attention": {"rope_type": "default"}}), "per-layer-type"),
    (config("llama", hidden_size=None), "lacks 'hidden_size'"),
    (config("llama", num_key_value_heads=3), "not a multiple of num_key_value_heads=3"),
    (config("gpt2", activation_function="swish"), "activation_function='swish'"),
    (config("gpt2", scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True"),
    (config("gpt2", add_cross_attention=True), "add_cross_attention=True"),
    (config("gpt2", n_embd=66), "n_embd=66 is not divisible by n_head=4"),
    (config("mistral", layer_types=["full_attention"] * 2), "Ministral"),
    (config("qwen2", layer_types=["chunked_attention", "full_attention"]), "layer_types entry 'chunked_attention'"),
    (config("qwen2", layer_types=["full_attention"]), "layer_types has 1 entries"),
    (config("qwen3", attention_dropout=1.0), "attention_dropout=1.0"),
]


@pytest.mark.parametrize("hf,match", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_unsupported_configs_raise(hf, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        config_from_hf(hf)


@pytest.mark.parametrize("name,changes,tp,match", [
    ("qwen2", {}, 4, "num_key_value_heads=2 is not divisible by tensor-parallel size 4"),
    ("llama", {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48}, 4,
     "num_attention_heads=6 is not divisible by tensor-parallel size 4"),
    ("llama", {"intermediate_size": 90}, 4, "intermediate_size=90 is not divisible by tensor-parallel size 4"),
    ("gpt2", {"n_inner": 90}, 4, "intermediate_size=90 is not divisible"),
])
def test_tensor_parallel_divisibility_errors(name, changes, tp, match):
    with pytest.raises(ValueError, match=match):
        build_model(config(name, **changes), tp_group=fake_group(tp))


def test_vocab_padding():
    cfg = config_from_hf(config("llama"))
    assert [cfg.padded_vocab_size(tp=t) for t in (1, 2, 4)] == [128, 256, 512]
    assert cfg.padded_vocab_size(tp=4, make_vocab_size_divisible_by=1) == 100
    assert cfg.padded_vocab_size(tp=3, make_vocab_size_divisible_by=1) == 102
    m = build_model(config("llama"), tp_group=fake_group(2, 1), make_vocab_size_divisible_by=8)
    assert m.padded_vocab_size == 112 and m.embedding.word_embeddings.weight.shape == (56, 64)
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by=0"):
        build_model(config("llama"), tp_group=fake_group(2), make_vocab_size_divisible_by=0)


@pytest.mark.parametrize("layer_range", [(1, 3), (2, 1), (-1, 1), (0.0, 1)])
def test_layer_range_errors(layer_range):
    with pytest.raises(ValueError, match="layer_range"):
        build_model(config("llama"), tp_group=Group.trivial("tp"), layer_range=layer_range)


def test_forward_input_errors():
    tp = Group.trivial("tp")
    m = build_model(config("gpt2"), tp_group=tp)
    ids = torch.randint(0, 100, (2, 8))
    cases = [
        (lambda: m(ids.float()), "token ids"),
        (lambda: m(ids, labels=ids[:, :4]), "labels must be"),
        (lambda: m(ids, labels=ids, loss_mask=torch.ones(2, 3)), "loss_mask must be"),
        (lambda: m(ids, position_ids=torch.arange(4)[None]), "position_ids must be"),
        (lambda: m(torch.randint(0, 100, (1, 65))), r"position id \(n_positions of the config\) 64"),
        (lambda: m(ids, cu_seqlens=torch.tensor([0, 5, 9])), "end at b\\*s=16"),
        (lambda: m(ids, cu_seqlens=torch.tensor([[0, 16]])), "1-D integer tensor"),
        (lambda: m(torch.full((2, 8), 100)), "token id 100 is outside"),
        (lambda: m(ids, labels=torch.full((2, 8), 100)), "target 100 is outside"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()
    mid = build_model(config("gpt2"), tp_group=tp, pre_process=False, post_process=False)
    with pytest.raises(ValueError, match="hidden state"):
        mid(torch.randn(8, 2, 32))
    with pytest.raises(ValueError, match="hidden state"):
        mid(ids)


def test_sequence_parallel_length_error():
    m = build_model(config("llama"), tp_group=fake_group(2), sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence length 7 is not divisible by the tensor-parallel size 2"):
        m(torch.randint(0, 100, (2, 7)))
