"""Mixture-of-experts families against Hugging Face transformers: Mixtral, Qwen2-MoE (gated shared expert,
a dense layer by mlp_only_layers) and Qwen3-MoE (decoder_sparse_step). Tiny models built from configs
here (no downloads), parameters perturbed, saved with ``save_pretrained`` (per-expert keys on disk).

Checked at TP=1 in fp32: logits within 1e-5 of transformers', the load-balancing aux loss equal to
transformers' ``aux_loss`` (output_router_logits=True) on the same batch, export bitwise equal to the files,
and the router's gradient from the aux loss equal to transformers'.
"""
from __future__ import annotations

import json

import pytest
import torch

from models import SafetensorsState, build_model, export_hf_state_dict, load_hf_state_dict
from models.moe import moe_aux_loss, moe_load
from models.registry import config_from_hf
from parallel.comm import Group

ATOL = 1e-5
SEQ = 10

_BASE = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 64, "max_position_embeddings": 64, "tie_word_embeddings": False}
MOE = {
    "mixtral": {**_BASE, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "intermediate_size": 24,
                "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02},
    "qwen2_moe": {**_BASE, "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
                  "intermediate_size": 40, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
                  "num_experts": 6, "num_experts_per_tok": 2, "norm_topk_prob": False, "mlp_only_layers": [1],
                  "router_aux_loss_coef": 0.01},
    "qwen3_moe": {**_BASE, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "head_dim": 8,
                  "intermediate_size": 40, "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 3,
                  "norm_topk_prob": True, "decoder_sparse_step": 2},
}


def _make(name: str, directory):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**MOE[name]), attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    with open(directory / "config.json") as f:
        return model, json.load(f), directory


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return {name: _make(name, tmp_path_factory.mktemp(name)) for name in MOE}


@pytest.mark.parametrize("name", list(MOE))
def test_logits_aux_loss_and_export_equal_transformers(cases, name):
    hf_model, cfg_json, directory = cases[name]
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(ids, use_cache=False, output_router_logits=True)
    model = build_model(cfg_json, tp_group=Group.trivial("tp"))
    load_hf_state_dict(model, SafetensorsState(directory))
    model.eval()
    with torch.no_grad():
        logits = model(ids)
    assert (logits[..., :64] - ref.logits).abs().max().item() < ATOL
    ours = moe_aux_loss(model)
    assert torch.allclose(ours, ref.aux_loss.float(), rtol=1e-6, atol=1e-7), (ours.item(), ref.aux_loss.item())
    exported = export_hf_state_dict(model)
    files = SafetensorsState(directory)
    assert set(exported) == set(files)
    assert all(torch.equal(exported[k], files[k]) for k in files)


def test_structure_follows_the_config():
    q2 = config_from_hf(MOE["qwen2_moe"])
    assert [q2.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert q2.shared_expert_ffn_hidden_size == 24 and not q2.norm_topk_prob
    q3 = config_from_hf(MOE["qwen3_moe"])
    assert [q3.is_moe_layer(i) for i in range(3)] == [False, True, False]  # decoder_sparse_step=2
    mx = config_from_hf(MOE["mixtral"])
    assert mx.norm_topk_prob and mx.moe_ffn_hidden_size == 24 and all(mx.is_moe_layer(i) for i in range(3))
    model = build_model(MOE["qwen2_moe"], tp_group=Group.trivial("tp"))
    names = [n for n, _ in model.named_parameters() if n.startswith("layers.0.mlp.")]
    assert names[:3] == ["layers.0.mlp.router.weight", "layers.0.mlp.experts.0.fc1.weight",
                         "layers.0.mlp.experts.0.fc2.weight"]
    assert "layers.1.mlp.fc1.weight" in dict(model.named_parameters())
    assert all(p.expert for n, p in model.named_parameters() if ".experts." in n)
    model(torch.randint(0, 64, (2, 8)))
    load = moe_load(model)
    assert sorted(load) == [0, 2]  # layer 1 is dense (mlp_only_layers)
    assert all(v["min"] <= v["max"] and v["cv"] >= 0 for v in load.values())


def test_aux_loss_gradient_equals_transformers(cases):
    """The router learns from the aux loss as in transformers: d(coef * aux)/d(router) equal."""
    hf_model, cfg_json, directory = cases["mixtral"]
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(2))
    hf_model.zero_grad()
    (0.02 * hf_model(ids, use_cache=False, output_router_logits=True).aux_loss).backward()
    # Coefficient 0: no per-layer aux gradient injected in backward, only the pooled loss differentiated.
    model = build_model({**cfg_json, "router_aux_loss_coef": 0.0}, tp_group=Group.trivial("tp"))
    load_hf_state_dict(model, SafetensorsState(directory))
    model(ids)
    (0.02 * moe_aux_loss(model)).backward()
    for i in range(3):
        ref = hf_model.model.layers[i].mlp.gate.weight.grad
        got = dict(model.named_parameters())[f"layers.{i}.mlp.router.weight"].grad
        assert torch.allclose(got, ref, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("change, match", [
    ({"num_experts_per_tok": 9}, "exceeds num_experts=8"),
    ({**MOE["mixtral"], "router_jitter_noise": 0.1},
     "router_jitter_noise is not supported"),
])
def test_bad_moe_config_is_refused(change, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**MOE["qwen3_moe"], **change})


@pytest.mark.parametrize("name", list(MOE))
def test_converter_round_trip_ep2_tp2_pp2_is_bitwise(cases, name, tmp_path):
    """hf-to-tessel at EP=2 x TP=2 x PP=2 (8 rank files, dp = ep) and back: per-expert Hugging Face keys,
    bitwise equal tensors; each expert is written by its own ep rank only, everything else by ep rank 0."""
    from engine.checkpoint.format import read_metadata
    from tools.convert_checkpoint import hf_to_tessel, tessel_to_hf

    _, _, directory = cases[name]
    hf_to_tessel(directory, tmp_path / "ckpt", tp=2, pp=2, ep=2)
    tessel_to_hf(tmp_path / "ckpt", tmp_path / "back")
    orig, back = SafetensorsState(directory), SafetensorsState(tmp_path / "back")
    assert sorted(orig) == sorted(back)
    assert all(torch.equal(orig[k], back[k]) for k in orig)
    meta = read_metadata(next((tmp_path / "ckpt").glob("step_*")))
    assert meta["layout"]["ep"] == 2 and meta["world_size"] == 8
    experts = config_from_hf(MOE[name]).num_experts
    for key, entry in meta["tensors"].items():
        ep_ranks = {pc["rank"] // 4 for pc in entry["pieces"]}  # rank = (ep_rank * pp + pp_rank) * tp + tp_rank
        if ".mlp.experts." in key:
            e = int(key.split(".mlp.experts.")[1].split(".")[0])
            assert ep_ranks == {e // (experts // 2)}, key
        else:
            assert ep_ranks == {0}, key


def test_converter_round_trip_at_expert_tp1_is_bitwise(cases, tmp_path):
    """hf-to-tessel --expert-tp 1 at EP=2 x TP=2 (Qwen2-MoE: shared expert, a dense layer) writes every routed
    expert whole, once (tp rank 0 of its ep rank), the shared expert sharded over tp; tessel-to-hf gives the
    files back bitwise."""
    from engine.checkpoint.format import read_metadata
    from tools.convert_checkpoint import hf_to_tessel, tessel_to_hf

    _, _, directory = cases["qwen2_moe"]
    hf_to_tessel(directory, tmp_path / "ckpt", tp=2, ep=2, expert_tp=1)
    tessel_to_hf(tmp_path / "ckpt", tmp_path / "back")
    orig, back = SafetensorsState(directory), SafetensorsState(tmp_path / "back")
    assert sorted(orig) == sorted(back) and all(torch.equal(orig[k], back[k]) for k in orig)
    tensors = read_metadata(next((tmp_path / "ckpt").glob("step_*")))["tensors"]
    for key, entry in tensors.items():
        written = [pc for pc in entry["pieces"] if pc.get("file")]
        if ".mlp.experts." in key:  # rank = ep_rank * tp + tp_rank
            assert len(written) == 1 and written[0]["rank"] % 2 == 0, key
            assert list(written[0]["local_shape"]) == list(entry["shape"]), key
        elif ".mlp.shared_expert." in key:
            assert {pc["rank"] for pc in written} == {0, 1}, key  # ep rank 0, both tp ranks


@pytest.mark.parametrize("name", list(MOE))
def test_derived_stage_params_match_built_stages(name):
    """The converter's and memory plan's derived parameters (models/convert.py) equal a built TP=2 x PP=2
    stage's: names in registration order, shapes and TP partitions; also at ep2 and at expert_tp=1 (whole
    experts)."""
    from models.convert import stage_layer_ranges, stage_params
    from parallel.comm import Ledger

    cfg = config_from_hf(MOE[name])
    padded = cfg.padded_vocab_size(tp=2, make_vocab_size_divisible_by=128)
    for pp_rank, lr in enumerate(stage_layer_ranges(cfg.num_layers, 2)):
        ends = dict(pre_process=pp_rank == 0, post_process=pp_rank == 1)
        tp = Group(axis="tp", ranks=range(2), rank=1, pg=object(), ledger=Ledger())  # building does not communicate
        real = list(build_model(MOE[name], tp_group=tp, layer_range=lr, **ends).named_parameters())
        derived = stage_params(cfg, tp_rank=1, tp_size=2, layer_range=lr, padded_vocab=padded, **ends)
        assert [p.name for p in derived] == [n for n, _ in real]
        ep = Group(axis="ep", ranks=range(2), rank=1, pg=object(), ledger=Ledger())  # ep rank 1: the upper experts
        real_ep = list(build_model(MOE[name], tp_group=tp, ep_group=ep, layer_range=lr, **ends).named_parameters())
        derived_ep = stage_params(cfg, tp_rank=1, tp_size=2, layer_range=lr, padded_vocab=padded, ep_rank=1,
                                  ep_size=2, **ends)
        assert [p.name for p in derived_ep] == [n for n, _ in real_ep]
        assert [p.expert for p in derived_ep] == [bool(getattr(q, "expert", False)) for _, q in real_ep]
        real_etp1 = list(build_model(MOE[name], tp_group=tp, ep_group=ep, layer_range=lr, sequence_parallel=True,
                                     expert_tp=1, **ends).named_parameters())
        derived_etp1 = stage_params(cfg, tp_rank=1, tp_size=2, layer_range=lr, padded_vocab=padded, ep_rank=1,
                                    ep_size=2, expert_tp=1, **ends)
        for derived_x, real_x in ((derived, real), (derived_etp1, real_etp1)):
            assert [p.name for p in derived_x] == [n for n, _ in real_x]
            for p, (_, q) in zip(derived_x, real_x):
                assert p.local_shape == tuple(q.shape), p.name
                assert p.partition == ((q.partition_dim, q.partition_stride) if q.tensor_parallel else None), p.name


def test_flops_count_the_active_experts():
    from engine.metrics import model_flops_per_step
    from models.hook import flops_spec

    cfg = config_from_hf(MOE["qwen2_moe"])  # layers 0, 2: 2 experts of 16 + shared 24; layer 1 dense 40
    spec = flops_spec(cfg)
    assert spec.ffn_hidden_size == (2 * (2 * 16 + 24) + 40) / 3
    dense = flops_spec(config_from_hf({**MOE["qwen2_moe"], "num_experts": 0}))
    mlp = lambda s: 3.0 * 2 * 3 * s.hidden_size * s.ffn_hidden_size * s.num_layers  # noqa: E731 per token
    assert model_flops_per_step(spec, batch_size=1, seq_length=1) - model_flops_per_step(
        dense, batch_size=1, seq_length=1) == pytest.approx(mlp(spec) - mlp(dense))
