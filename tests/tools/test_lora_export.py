"""LoRA export (tools/convert_checkpoint.py lora-to-peft, tools/lora_export.py) against peft + transformers.

A tiny random Hugging Face model (Llama: grouped qkv, gate/up; GPT-2: packed c_attn, Conv1D) is converted
to Tessel at TP=2 x PP=2, gets LoRA adapters on every linear with non-zero random B, and is saved as an
adapter-only checkpoint and as a full one, at that layout (4 gloo ranks). Then:

* tools/evaluate.py's logits of the adapted model (adapter-only checkpoint + --base at TP=2 x PP=2, and
  the full checkpoint resharded to TP=4) equal ``peft.PeftModel.from_pretrained`` of the exported
  adapter on the transformers model: fp32, atol 1e-5 (and differ from the base model's logits);
* the merged export (``--merge``, from --base or from the full checkpoint) loaded by transformers alone
  gives the same logits (atol 1e-5);
* clear errors: a checkpoint without LoRA, an adapter-only merge without --base, tessel-to-hf of a
  LoRA checkpoint, evaluate of an adapter-only checkpoint without --base.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.tools.test_convert import hf_logits, make_hf_dir

FAMILIES = ("llama", "gpt2")
TOKENS = [[5, 17, 3, 99, 42, 8, 60, 2], [11, 12, 13, 14, 15]]
ATOL = 1e-5  # fp32 Tessel TP x PP (fused adapters) vs peft's per-projection adapters (observed <= 1.3e-6)
RANK, ALPHA, DROPOUT = 4, 8.0, 0.05


def _adapt_and_save(hf_dir: str, base: str, lora: str, full: str) -> None:
    from engine.checkpoint import ShardingContext, load_checkpoint, module_sharded_tensors, save_checkpoint
    from engine.checkpoint.trainer_state import select_params
    from engine.posttrain.lora import apply_lora, lora_settings
    from models.convert import model_param_spec
    from parallel.mesh import Mesh, ParallelDims
    from tests.engine.posttrain.test_lora import fill_b
    from tools.evaluate import build_stage

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    mesh = Mesh.build(ParallelDims(dp=1, pp=2, tp=2))
    opts = {"pipeline_layout": None, "dtype": "fp32", "make_vocab_size_divisible_by": 128}
    _, stage = build_stage(config, mesh, opts, device="cpu")
    ctx = ShardingContext.from_mesh(mesh)
    load_checkpoint(base, tensors=module_sharded_tensors(stage, ctx=ctx, hook=model_param_spec), group=mesh.world)
    apply_lora(stage, rank=RANK, alpha=ALPHA, dropout=DROPOUT, targets="all", seed=5)
    fill_b(stage)
    settings = lora_settings(stage)
    layout = {"dp": 1, "pp": 2, "tp": 2}
    for path, params in ((lora, "trainable"), (full, "all")):
        tensors = module_sharded_tensors(stage, ctx=ctx, hook=select_params(model_param_spec, params))
        save_checkpoint(path, step=1, tensors=tensors, group=mesh.world, model_config=config, layout=layout,
                        trainer_state={"lora": settings.to_json(adapters_only=params == "trainable")})


def _worker(jobs):
    from tools.evaluate import run_evaluate

    out = []
    for job in jobs:
        _adapt_and_save(*job["save"])
        out.append([run_evaluate(argv) for argv in job["evaluate"]])
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from parallel.testing import run_distributed
    from tools.convert_checkpoint import hf_to_tessel

    root = tmp_path_factory.mktemp("lora_export")
    (root / "ids.json").write_text(json.dumps(TOKENS))
    jobs, paths = [], {}
    for i, fam in enumerate(FAMILIES):
        hf = make_hf_dir(root / f"{fam}_hf", fam, seed=20 + i)
        p = {"hf": hf, "base": hf_to_tessel(hf, root / f"{fam}_base", tp=2, pp=2), "lora": root / f"{fam}_lora",
             "full": root / f"{fam}_full", "dump": root / f"{fam}_logits.safetensors",
             "dump_tp4": root / f"{fam}_logits_tp4.safetensors"}
        paths[fam] = p
        ids = str(root / "ids.json")
        jobs.append({"save": (str(hf), str(p["base"]), str(p["lora"]), str(p["full"])), "evaluate": [
            ["--ckpt", str(p["lora"]), "--base", str(p["base"]), "--tp", "2", "--pp", "2", "--tokens", ids,
             "--dump-logits", str(p["dump"])],
            ["--ckpt", str(p["full"]), "--tp", "4", "--pp", "1", "--tokens", ids,
             "--dump-logits", str(p["dump_tp4"])]]})
    run_distributed(_worker, 4, jobs, timeout=240)
    return root, paths


def _dumped(path: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    got = load_file(str(path))
    return [got[f"logits.{i}"] for i in range(len(TOKENS))]


def _peft_logits(hf_dir: Path, adapter: Path) -> list[torch.Tensor]:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0] for ids in TOKENS]


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_adapter_and_merged_weights_match_tessel(exported, family, tmp_path):
    from safetensors.torch import load_file

    from tools.convert_checkpoint import main
    from tools.lora_export import lora_to_peft

    _, p = exported[0], exported[1][family]
    tessel = _dumped(p["dump"])
    for got, want in zip(_dumped(p["dump_tp4"]), tessel):  # the full checkpoint resharded to TP=4
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert main(["lora-to-peft", "--ckpt", str(p["lora"]), "--out", str(tmp_path / "adapter")]) == 0
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    want_targets = {"llama": ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
                              "self_attn.q_proj", "self_attn.v_proj"],
                    "gpt2": ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]}[family]
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"], cfg["target_modules"], cfg["fan_in_fan_out"]) == (
        RANK, ALPHA, DROPOUT, want_targets, family == "gpt2")
    weights = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(weights) == 2 * 2 * len(want_targets) and all(k.startswith("base_model.model.") for k in weights)
    base = hf_logits(p["hf"], TOKENS)
    for got, want, b in zip(_peft_logits(p["hf"], tmp_path / "adapter"), tessel, base):
        assert (want - b).abs().max() > 1e-3  # the adapters change the model
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # Merged: from the adapter-only checkpoint + its base, and from the full checkpoint alone.
    lora_to_peft(p["lora"], tmp_path / "merged", merge=True, base=p["base"])
    lora_to_peft(p["full"], tmp_path / "merged_full", merge=True)
    assert (tmp_path / "merged" / "tokenizer.json").is_file()  # the base checkpoint's hf/ files
    for d in ("merged", "merged_full"):
        for got, want in zip(hf_logits(tmp_path / d, TOKENS), tessel):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=d)


def test_errors(exported, tmp_path, capsys):
    from tools.convert_checkpoint import tessel_to_hf
    from tools.evaluate import main as evaluate_main
    from tools.lora_export import lora_to_peft

    p = exported[1]["llama"]
    with pytest.raises(ValueError, match=r"holds no LoRA adapters .*posttrain.lora.rank >= 1; export a full model "
                                         r"with tessel-to-hf"):
        lora_to_peft(p["base"], tmp_path / "a")
    with pytest.raises(ValueError, match=r"holds only the LoRA adapters .*pass --base BASE_CKPT"):
        lora_to_peft(p["lora"], tmp_path / "b", merge=True)
    with pytest.raises(ValueError, match=r"--base applies to --merge only"):
        lora_to_peft(p["lora"], tmp_path / "c", base=p["base"])
    with pytest.raises(ValueError, match=r"holds LoRA adapters \(16 tensors, .*\); export them with lora-to-peft"):
        tessel_to_hf(p["full"], tmp_path / "d")
    assert evaluate_main(["--ckpt", str(p["lora"]), "--tokens", str(exported[0] / "ids.json")]) == 2
    assert "holds only LoRA adapters; pass --base BASE_CKPT" in capsys.readouterr().err
    assert not any((tmp_path / n).exists() for n in "abcd")
