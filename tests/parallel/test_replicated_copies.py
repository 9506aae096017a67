"""Copies of a parameter that must stay equal inside one data-parallel replica -- a tied embedding's copies on
the first and last pipeline stage, parameters replicated over TP (norms) -- stay bitwise equal under every
reduction that replaces the plain all-reduce (docs/decentralised.md): Streaming DiLoCo's fragments (both tied
copies in fragment 0), DiLoCo's int8 and top-k pseudo-gradients (chunk scales and selections depend on
neighbours: the copies' averages are averaged once more), PowerSGD (the tied copies' Q seeded alike) and 1-bit
(TP-replicated elements averaged over tp). Plain DDP is the control. 4 gloo ranks (dp2 x pp2 or dp2 x tp2),
3 steps each."""
from __future__ import annotations

import pytest
import torch

from parallel.testing import run_distributed

SEQ, VOCAB = 16, 64
CASES = {
    "pp2 tied, ddp": (True, ["parallel.pp=2"]),
    "pp2 tied, streaming": (True, ["parallel.pp=2", "outer.method=streaming_diloco", "outer.inner_steps=2",
                                   "outer.fragments=2"]),
    "pp2 tied, diloco int8": (True, ["parallel.pp=2", "outer.method=diloco", "outer.inner_steps=1",
                                     "outer.compression=int8"]),
    "pp2 tied, powersgd": (True, ["parallel.pp=2", "optim.grad_compression=powersgd", "optim.powersgd_rank=2"]),
    "tp2, diloco topk": (False, ["parallel.tp=2", "outer.method=diloco", "outer.inner_steps=1",
                                 "outer.compression=topk", "outer.topk_fraction=0.1"]),
    "tp2, onebit": (False, ["parallel.tp=2", "optim.grad_compression=onebit"]),
}


def _worker() -> dict[str, list[float]]:
    import torch.distributed as dist

    from engine.assembly import build_run
    from engine.config import load_config
    from engine.data.synthetic import RandomTokens
    from models.hook import ModelHook

    out = {}
    for name, (tie, extra) in CASES.items():
        cfg = load_config("tiny_llama_cpu", [
            "parallel.tp=1", "parallel.pp=1", "parallel.dp=-1", "optim.distributed=false", "train.steps=3",
            "train.global_batch_size=4", "train.micro_batch_size=1", f"train.seq_length={SEQ}", "optim.lr=0.01",
            "optim.warmup_steps=0", "logging.progress_bar=off", "logging.tensorboard=false", "logging.jsonl=false",
            "logging.peak_tflops=1.0", "train.eval_interval=0", "logging.memory_report=false", *extra])
        hf = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 64,
              "tie_word_embeddings": tie}
        model = ModelHook.from_hf(hf, dtype=torch.float32, seed=cfg.train.seed)
        run = build_run(cfg, model=model, train_data=RandomTokens(20, vocab=VOCAB, seq=SEQ, seed=90), checkpoints=False)
        for _ in range(3):
            run.trainer.train_step(run.train_loader)
        params = {k: v.detach().clone() for k, v in run.trainer.chunks.named_parameters()}
        sharded = {k: bool(getattr(v, "tensor_parallel", False)) for k, v in run.trainer.chunks.named_parameters()}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (dict(run.mesh.coords), params))
        gaps = []
        for d in (0, 1):  # per replica: the largest difference between copies that must be equal
            if tie:
                first = next(m for c, m in every if c["dp"] == d and c["pp"] == 0)
                last = next(m for c, m in every if c["dp"] == d and c["pp"] == 1)
                gaps.append(float((first["0.embedding.word_embeddings.weight"] - last["0.output_layer.weight"])
                                  .abs().max()))
            else:
                r0 = next(m for c, m in every if c["dp"] == d and c["tp"] == 0)
                r1 = next(m for c, m in every if c["dp"] == d and c["tp"] == 1)
                gaps.append(max(float((r0[k] - r1[k]).abs().max()) for k in r0 if not sharded[k]))
        out[name] = gaps
    return out


@pytest.fixture(scope="module")
def gaps():
    return run_distributed(_worker, 4, timeout=300)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_copies_that_must_be_equal_stay_bitwise_equal(gaps, case):
    assert gaps[case] == [0.0, 0.0], gaps
