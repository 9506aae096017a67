"""Hugging Face transformers as the oracle: same weights, same logits.

Each family's tiny model is built by transformers from a config in tests/models/tiny.py (no
downloads), its parameters perturbed (so norms and biases are not trivially 1/0), saved with
``save_pretrained``; Tessel reads the saved config.json and safetensors file (lazily, through
SafetensorsState) at TP=1 and TP=2 (with and without sequence parallelism).
Tolerance: fp32 logits within atol 1e-5 of transformers' (observed at TP=1: <= 4.2e-7).
"""
from __future__ import annotations

import json

import pytest
import torch

from models import SafetensorsState, build_model, export_hf_state_dict, gather_logits, load_hf_state_dict
from parallel.comm import Group
from parallel.testing import run_distributed
from tests.models.tiny import FAMILIES, config

ATOL = 1e-5
SEQ = 12  # longer than Mistral's window of 5


def _make_case(name: str, directory) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf_cfg = AutoConfig.for_model(**config(name))
    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, SEQ), generator=g)
    pos = torch.cat([torch.arange(7), torch.arange(SEQ - 7)])[None].expand(2, SEQ)  # two packed documents
    with torch.no_grad():
        # use_cache=False: with a cache, transformers skips its packed-sequence mask.
        logits = model(ids, use_cache=False).logits
        packed = model(ids, position_ids=pos, use_cache=False).logits
    with open(directory / "config.json") as f:
        cfg_json = json.load(f)
    return {"config": cfg_json, "dir": str(directory), "ids": ids, "logits": logits, "pos": pos, "packed": packed}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return {name: _make_case(name, tmp_path_factory.mktemp(name)) for name in FAMILIES}


def _file_tensors(directory: str) -> dict:
    src = SafetensorsState(directory)
    return {k: src[k] for k in src}


def _check(case: dict, model, tp_group) -> dict:
    """Max logit errors against transformers and whether export reproduces the files (collective)."""
    load_hf_state_dict(model, SafetensorsState(case["dir"]))
    model.eval()
    with torch.no_grad():
        logits = gather_logits(model(case["ids"]), tp_group, vocab_size=100)
        packed = gather_logits(model(case["ids"], position_ids=case["pos"]), tp_group, vocab_size=100)
    exported = export_hf_state_dict(model)
    files = _file_tensors(case["dir"])
    return {"logits": (logits - case["logits"]).abs().max().item(),
            "packed": (packed - case["packed"]).abs().max().item(),
            "export": set(exported) == set(files) and all(torch.equal(exported[k], files[k]) for k in files)}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tp1_logits_equal_transformers(cases, name):
    case = cases[name]
    res = _check(case, build_model(case["config"], tp_group=Group.trivial("tp")), Group.trivial("tp"))
    assert res["logits"] < ATOL, res
    assert res["packed"] < ATOL, res
    assert res["export"]


def _tp2_worker(cases):
    from parallel.mesh import Mesh, ParallelDims

    mesh = Mesh.build(ParallelDims(tp=2))
    out = {}
    for name, case in cases.items():
        for sp in (False, True):
            model = build_model(case["config"], tp_group=mesh.tp, sequence_parallel=sp)
            out[name, sp] = _check(case, model, mesh.tp)
    return out


def test_tp2_logits_equal_transformers(cases):
    results = run_distributed(_tp2_worker, 2, cases, timeout=180)
    for rank_result in results:
        for key, res in rank_result.items():
            assert res["logits"] < ATOL and res["packed"] < ATOL, (key, res)
            assert res["export"], key
