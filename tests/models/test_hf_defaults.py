"""A config.json means what transformers makes of it: every field it leaves out gets transformers' default for
the family (rope_theta, rms_norm_eps, head_dim, num_key_value_heads, the MoE sizes), and whatever Tessel
resolves is written out for the export. Tiny models built from configs here (no downloads), transformers as
the oracle.

* A run whose model.hf_config leaves out the MoE fields exports a model transformers loads whole (no
  missing or random weights) and runs to the same logits.
* A minimal config.json per family resolves to transformers' sizes, rope theta and norm eps.
* A Qwen3 config.json without head_dim (transformers: 128) converts; a [model] section without
  model.head_dim keeps hidden_size / num_attention_heads.
* A stray .safetensors file beside model.safetensors (Mistral's consolidated.safetensors) is not read.
* [model] keys GPT-2 has no field for are refused over a GPT-2 config.json, as for an explicit family.
"""
from __future__ import annotations

import json

import pytest
import torch

from engine.config.sections import ModelConfig
from models import SafetensorsState, build_model, config_from_hf, load_hf_state_dict
from models.hook import hf_config_from_run
from parallel.comm import Group
from tests.models import tiny

SEQ = 10
IDS = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _random_hf_model(hf: dict, *, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf),
                                                          attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _tessel_logits(model, vocab: int) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(IDS)[..., :vocab]


def _theirs(hf: dict):
    """(theta, eps, head_dim, kv heads, expert FFN, shared FFN, experts, top-k, MoE layers) as transformers
    builds them from ``hf``."""
    import transformers

    c = transformers.AutoConfig.for_model(**hf)
    moe = c.model_type in ("mixtral", "qwen2_moe", "qwen3_moe")
    experts = (getattr(c, "num_local_experts", None) or c.num_experts) if moe else 0
    if c.model_type in ("qwen2_moe", "qwen3_moe"):  # their decoder layer's rule
        layers = tuple(i not in c.mlp_only_layers and (i + 1) % c.decoder_sparse_step == 0
                       for i in range(c.num_hidden_layers))
        ffn = c.moe_intermediate_size
    else:
        layers, ffn = (True,) * c.num_hidden_layers if moe else (), c.intermediate_size if moe else 0
    return (c.rope_parameters["rope_theta"], c.rms_norm_eps,
            getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads, c.num_key_value_heads, ffn,
            getattr(c, "shared_expert_intermediate_size", 0), experts, c.num_experts_per_tok if moe else 0,
            layers)


def _ours(cfg):
    return (cfg.rope.theta, cfg.norm_eps, cfg.head_dim, cfg.num_kv_heads, cfg.moe_ffn_hidden_size,
            cfg.shared_expert_ffn_hidden_size, cfg.num_experts, cfg.moe_top_k,
            tuple(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) if cfg.num_experts else ())


# -- a run's MoE fields reach the export -----------------------------------------------------------

MOE_MINIMAL = {  # the MoE keys the [model] section has no field for, and nothing else
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2},
}


@pytest.mark.parametrize("family", sorted(MOE_MINIMAL))
def test_moe_run_without_moe_sizes_exports_the_model_it_trained(family, tmp_path):
    import transformers

    from engine.checkpoint import ShardingContext, module_sharded_tensors, save_checkpoint
    from models.convert import model_param_spec
    from tools.convert_checkpoint import tessel_to_hf

    (tmp_path / "in.json").write_text(json.dumps(MOE_MINIMAL[family]))
    m = ModelConfig(family=family, hf_config=str(tmp_path / "in.json"), hidden_size=32, num_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=48, vocab_size=64,
                    max_position_embeddings=64)
    out = hf_config_from_run(m, vocab_size=64)
    cfg = config_from_hf(out)
    assert _theirs(out) == _ours(cfg)

    model = build_model(out, tp_group=Group.trivial("tp"))
    ours = _tessel_logits(model, 64)
    save_checkpoint(tmp_path / "ck", step=0, group=None, model_config=out,
                    tensors=module_sharded_tensors(model, ctx=ShardingContext(), hook=model_param_spec))
    tessel_to_hf(tmp_path / "ck", tmp_path / "hf", force=True)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa",
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        theirs = hf.eval()(IDS).logits
    assert (ours - theirs).abs().max().item() < 1e-5


def test_mixtral_refuses_qwen_moe_fields_transformers_ignores():
    base = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "num_local_experts": 4,
            "num_experts_per_tok": 2}
    with pytest.raises(ValueError, match="mixtral config field moe_intermediate_size=16"):
        config_from_hf({**base, "moe_intermediate_size": 16})
    with pytest.raises(ValueError, match="mixtral config field mlp_only_layers"):
        config_from_hf({**base, "mlp_only_layers": [0]})
    assert config_from_hf({**base, "moe_intermediate_size": 48}).moe_ffn_hidden_size == 48


# -- a minimal config.json gets transformers' defaults ---------------------------------------------

_REQUIRED = {"hidden_size": 512, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 64,
             "vocab_size": 100}
MINIMAL = {
    "mistral": {}, "qwen2": {}, "qwen3": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2},
}


@pytest.mark.parametrize("family", sorted(MINIMAL))
def test_minimal_config_json_resolves_as_transformers_does(family):
    hf = {"model_type": family, **_REQUIRED, **MINIMAL[family]}
    cfg = config_from_hf(hf)
    assert _ours(cfg) == _theirs(hf)
    import transformers

    assert cfg.max_position_embeddings == transformers.AutoConfig.for_model(**hf).max_position_embeddings


# -- Qwen3 head_dim ---------------------------------------------------------------------------------

QWEN3_NO_HEAD_DIM = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 32,
                     "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64}


def test_qwen3_config_json_without_head_dim_converts_with_transformers_default(tmp_path):
    from engine.checkpoint import ShardingContext, load_checkpoint, module_sharded_tensors
    from models.convert import model_param_spec
    from tools.convert_checkpoint import hf_to_tessel

    hf_model = _random_hf_model(QWEN3_NO_HEAD_DIM)
    assert hf_model.config.head_dim == 128  # transformers' default, not 32 / 4
    hf_model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(QWEN3_NO_HEAD_DIM))  # as hand-written: no head_dim
    hf_to_tessel(tmp_path / "hf", tmp_path / "ck", tp=2, force=True)
    model = build_model(QWEN3_NO_HEAD_DIM, tp_group=Group.trivial("tp"), seed=7)
    load_checkpoint(tmp_path / "ck", tensors=module_sharded_tensors(model, ctx=ShardingContext(),
                                                                    hook=model_param_spec))
    with torch.no_grad():
        theirs = hf_model(IDS).logits
    assert (_tessel_logits(model, 64) - theirs).abs().max().item() < 1e-5

    # A run pointing model.hf_config at that file builds the same model; a [model] section alone keeps
    # hidden_size / num_attention_heads and says so in the config.json it writes.
    from_file = hf_config_from_run(ModelConfig(hf_config=str(tmp_path / "hf" / "config.json")), vocab_size=None)
    assert config_from_hf(from_file).head_dim == 128
    section = ModelConfig(family="qwen3", hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48,
                          vocab_size=64)
    out = hf_config_from_run(section, vocab_size=None)
    assert out["head_dim"] == 8 and out["num_key_value_heads"] == 4 and config_from_hf(out).head_dim == 8


# -- which safetensors files a directory means --------------------------------------------------------

def test_stray_safetensors_file_beside_model_safetensors_is_not_read(tmp_path):
    from safetensors.torch import save_file

    from models.convert import PreadSafetensors
    from tools.convert_checkpoint import hf_to_tessel

    hf = tiny.config("mistral")
    d = tmp_path / "hf"
    _random_hf_model(hf).save_pretrained(d)
    # Mistral's own format beside the transformers one, as on the Hub: transformers reads model.safetensors only
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4), "tok_embeddings.weight": torch.zeros(4, 4)},
              str(d / "consolidated.safetensors"))
    hf_to_tessel(d, tmp_path / "ck", force=True)
    for state in (SafetensorsState(d), PreadSafetensors(d)):
        assert "tok_embeddings.weight" not in state and "model.embed_tokens.weight" in state
    model = build_model(hf, tp_group=Group.trivial("tp"))
    load_hf_state_dict(model, SafetensorsState(d))


# -- GPT-2 --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [("rope_theta", 5e5), ("num_key_value_heads", 2)])
def test_gpt2_config_json_refuses_keys_gpt2_has_no_field_for(key, value, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny.config("gpt2")))
    with pytest.raises(ValueError, match=rf"model.{key}(=\S+)? is set but .*gpt2.*remove model.{key}"):
        hf_config_from_run(ModelConfig(hf_config=str(path), **{key: value}), vocab_size=None)
    assert hf_config_from_run(ModelConfig(hf_config=str(path), num_key_value_heads=4), vocab_size=None)
