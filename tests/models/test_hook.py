"""models/hook.py: the run config's [model] section becomes one complete config.json dict.

* Every field Tessel resolved by default is written out, so transformers builds the same model from an
  export (Qwen3's head_dim defaults to 128 there; max_position_embeddings differs by family; GPT-2 ties
  embeddings by default) -- and the completed dict parses to the same TransformerConfig.
* A field the section leaves out is named by its TOML key, not config.json's.
* A sequence longer than the model's positions is refused, naming the key to set.
"""
import pytest
import transformers

from engine.config import load_config
from models.hook import ModelHook, hf_config_from_run
from models.registry import config_from_hf

BASE = ["model.vocab_size=100", "model.hidden_size=64", "model.num_layers=2", "model.ffn_hidden_size=96",
        "train.seq_length=32"]
FAMILY = {"llama": ["model.family=llama", "model.num_attention_heads=4", "model.num_key_value_heads=2"],
          "qwen3": ["model.family=qwen3", "model.num_attention_heads=4", "model.num_key_value_heads=2"],
          "gpt2": ["model.family=gpt2", "model.num_attention_heads=4", "model.rope_theta=none",
                   "model.num_key_value_heads=none"]}


def _cfg(family, *extra):
    return load_config("tiny_llama_cpu", BASE + FAMILY[family] + list(extra))


@pytest.mark.parametrize("family", sorted(FAMILY))
def test_exported_config_builds_the_same_model_in_transformers(family):
    unset = [] if family == "gpt2" else ["model.max_position_embeddings=none"]  # gpt2 requires n_positions
    hf = hf_config_from_run(_cfg(family, *unset).model, vocab_size=None)
    ours = config_from_hf(hf)
    theirs = transformers.AutoConfig.for_model(**hf)
    assert theirs.num_attention_heads == ours.num_heads
    assert getattr(theirs, "head_dim", ours.head_dim) == ours.head_dim  # Qwen3: 16, not transformers' 128
    positions = theirs.n_positions if family == "gpt2" else theirs.max_position_embeddings
    assert positions == ours.max_position_embeddings
    assert theirs.tie_word_embeddings == ours.tie_word_embeddings
    assert config_from_hf(dict(hf)) == ours


def test_missing_fields_are_named_by_their_toml_keys():
    with pytest.raises(ValueError, match=r"model.ffn_hidden_size is not set and the llama family needs it"):
        hf_config_from_run(_cfg("llama", "model.ffn_hidden_size=none").model, vocab_size=None)
    with pytest.raises(ValueError, match=r"model.max_position_embeddings is not set and the gpt2 family needs it"):
        hf_config_from_run(_cfg("gpt2", "model.max_position_embeddings=none").model, vocab_size=None)
    with pytest.raises(ValueError, match="model.vocab_size is not set and data.tokenizer is empty"):
        hf_config_from_run(_cfg("llama", "model.vocab_size=none").model, vocab_size=None)


def test_a_run_longer_than_the_model_is_refused():
    cfg = _cfg("llama", "model.max_position_embeddings=none", "train.seq_length=4096")
    with pytest.raises(ValueError, match=r"train.seq_length=4096 exceeds the family's default "
                                         r"max_position_embeddings .* = 2048; set model.max_position_embeddings"):
        ModelHook.from_run_config(cfg, tokenizer_vocab=None)
    hook = ModelHook.from_run_config(_cfg("llama", "model.max_position_embeddings=none"), tokenizer_vocab=None)
    assert hook.hf_config["max_position_embeddings"] == 2048  # recorded for the export


def test_model_keys_over_a_config_json_apply_or_are_refused(tmp_path):
    """Keys the [model] section sets over model.hf_config reach the built model or are refused: rope_theta over
    a config.json whose rope table holds its own (transformers 5's rope_parameters; that one won, silently);
    a model.family that contradicts the file's model_type; a gpt2 head_dim that is not hidden / heads (gpt2
    has no such field: it was dropped)."""
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}))
    run = ["train.seq_length=32", "train.eval_interval=0", f"model.hf_config={path}"]
    hook = ModelHook.from_run_config(load_config(None, run + ["model.rope_theta=500000"]), tokenizer_vocab=None)
    assert hook.config.rope.theta == 500000.0 and hook.hf_config["rope_parameters"]["rope_theta"] == 500000.0
    assert ModelHook.from_run_config(load_config(None, run), tokenizer_vocab=None).config.rope.theta == 10000.0
    with pytest.raises(ValueError, match=r"model.family='qwen2' but model.hf_config=.* is a 'llama' config.json"):
        ModelHook.from_run_config(load_config(None, run + ["model.family=qwen2"]), tokenizer_vocab=None)
    assert ModelHook.from_run_config(load_config(None, run + ["model.family=llama"]), tokenizer_vocab=None)
    with pytest.raises(ValueError, match=r"model.head_dim=32 is set but the gpt2 family's head dim is hidden_size"):
        hf_config_from_run(_cfg("gpt2", "model.head_dim=32").model, vocab_size=None)
    assert hf_config_from_run(_cfg("gpt2", "model.head_dim=16").model, vocab_size=None)["n_embd"] == 64
