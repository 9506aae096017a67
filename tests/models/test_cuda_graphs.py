"""``model.cuda_graph = "layers"`` (models/cuda_graphs.py).

* **On a GPU** (`pytest -m gpu`, tools/gpu_session.sh): one process, the tiny Llama in fp32, 3 steps of 2
  micro-batches and an evaluation, with the layers replayed from CUDA graphs, against the same run eager,
  for ``model.fp8`` none, tensorwise and delayed: the losses and every trained parameter within 1e-5
  (the same kernels on the same inputs; the bound allows a GEMM algorithm that differs under capture).
  The graphs are captured once (one signature); delayed scaling's first step runs eagerly.
* **Everywhere:** each combination the graphs cannot run is refused, with the fix, by the config schema
  (tp/cp/ep/pp, a schedule other than 1F1B, recompute, ZeRO-3 and the overlapped parameter gather, the
  profiler's hooks, LoRA dropout, TE, the FP8 recipes not run under graphs, the FP8 weight cache) and by
  the stage (dropout, recompute, MoE, a model not on CUDA).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.data.synthetic import RandomTokens
from parallel.testing import run_distributed

SEQ, VOCAB = 32, 64
HF = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": VOCAB, "max_position_embeddings": 64,
      "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
ATOL = 1e-5


def _cfg(extra=()):
    from engine.config import load_config
    return load_config("tiny_llama_cpu", [
        "parallel.tp=1", "parallel.pp=1", "parallel.dp=-1", "train.steps=3", "train.global_batch_size=4",
        "train.micro_batch_size=2", f"train.seq_length={SEQ}", "optim.lr=0.01", "optim.warmup_steps=0",
        "optim.distributed=false", "logging.progress_bar=off", "logging.tensorboard=false", "logging.jsonl=false",
        "logging.peak_tflops=1.0", "train.eval_interval=0", "model.dtype=fp32", *extra])


# Qwen2 whose second layer attends over a sliding window of 16 of the 32 tokens: that layer's graphs take a mask
WINDOW_HF = dict(HF, sliding_window=16, use_sliding_window=True, max_window_layers=1, model_type="qwen2",
                 attention_bias=True)


def _run(extra, hf=HF):
    from engine.assembly import build_run
    from models.hook import ModelHook

    cfg = _cfg(extra)
    model = ModelHook.from_hf(hf, dtype=torch.float32, seed=cfg.train.seed, sequence_parallel=False,
                              fp8=cfg.model.fp8)
    run = build_run(cfg, model=model, train_data=RandomTokens(64, vocab=VOCAB, seq=SEQ, seed=100), checkpoints=False)
    trainer = run.trainer
    assert next(trainer.chunks.parameters()).is_cuda
    losses = [trainer.train_step(run.train_loader).loss for _ in range(3)]
    losses.append(trainer.evaluate(run.train_loader, 1))
    params = torch.cat([p.detach().float().reshape(-1) for p in trainer.chunks.parameters()]).cpu().numpy()
    graphs = [(len(g.sets), g.replays, g.eager_calls) for g in trainer.layer_graphs]
    return losses, params, graphs


@pytest.mark.gpu
@pytest.mark.parametrize("fp8, family", [("none", "llama"), ("tensorwise", "llama"), ("delayed", "llama"),
                                         ("delayed", "qwen2_window")])
def test_layers_replayed_from_cuda_graphs_train_as_eager(fp8, family):
    """(The qwen2_window case, a layer with a mask, was added after the 2026-11-28 GPU session: not run yet.)"""
    hf, extra = (HF, ()) if family == "llama" else (WINDOW_HF, ("model.family=qwen2",))
    eager = run_distributed(_run, 1, (f"model.fp8={fp8}", *extra), hf)[0]
    graphed = run_distributed(_run, 1, (f"model.fp8={fp8}", "model.cuda_graph=layers", *extra), hf)[0]
    print(f"fp8={fp8}: losses eager {eager[0]} graphed {graphed[0]}; max |param diff| "
          f"{np.abs(eager[1] - graphed[1]).max():.3e}; graphs (sets, replays, eager calls) {graphed[2]}")
    np.testing.assert_allclose(graphed[0], eager[0], atol=ATOL, rtol=0)
    np.testing.assert_allclose(graphed[1], eager[1], atol=ATOL, rtol=0)
    first_eager = 2 if fp8 == "delayed" else 0  # step 1's two micro-batches: delayed scaling not yet updated
    assert graphed[2] == [(1, 6 - first_eager, first_eager)] and eager[2] == []


@pytest.mark.parametrize("overrides, match", [
    (("parallel.tp=2",), r"parallel.tp=2.*graphs are built for dp only"),
    (("parallel.pp=2",), r"parallel.pp=2"),
    (("train.activation_checkpointing=selective",), r"activation_checkpointing='selective'"),
    (("optim.distributed=true", "optim.zero_stage=3"), r"optim.zero_stage=3.*module hooks"),
    (("optim.distributed=true", "optim.overlap_param_gather=true"), r"overlap_param_gather=true"),
    (("logging.profile_steps=[2, 3]",), r"logging.profile_steps"),
    (("model.fp8=tensorwise", "model.fp8_backend=te"), r"fp8_backend='te' is not built"),
    (("model.fp8=tensorwise", "model.fp8_weight_cache=true"), r"read stale"),
    (("model.cuda_graph=all",), r"model.cuda_graph='all' is not valid"),
    (("parallel.schedule=gpipe",), r"parallel.schedule='gpipe'.*set parallel.schedule='1f1b'"),
    (("posttrain.method=sft", "data.paths=[]", "posttrain.data=[\"x.jsonl\"]", "posttrain.lora.rank=4",
      "posttrain.lora.dropout=0.1"), r"posttrain.lora.dropout=0.1.*host"),
    (("model.fp8=rowwise",), r"model.fp8='rowwise' has not run under CUDA graphs"),
])
def test_what_the_graphs_cannot_run_is_refused_with_the_fix(overrides, match):
    from engine.config import load_config

    base = ["train.steps=20", "train.global_batch_size=8", "train.micro_batch_size=1", "parallel.dp=-1",
            "parallel.tp=1", "parallel.pp=1",
            "model.cuda_graph=layers"]
    with pytest.raises(ValueError, match=match):
        cfg = load_config("tiny_llama_cpu", [*base, *overrides])
        cfg.validate_world(4)


def _stage(**changes):
    from models import build_model
    from parallel.comm import Group
    from parallel.comm import Ledger
    from tests.models.tiny import config

    return build_model(config("llama", **changes.pop("hf", {})), seed=0,
                       tp_group=Group(axis="tp", ranks=range(1), rank=0, pg=None, ledger=Ledger()), **changes)


@pytest.mark.parametrize("changes, match", [
    (dict(hf=dict(attention_dropout=0.1)), r"layer 0 has dropout .*attention 0.1"),
    (dict(recompute="full"), r"recomputes activations"),
    (dict(), r"needs the model on a CUDA device"),
])
def test_a_stage_the_graphs_cannot_run_is_refused(changes, match):
    stage = _stage(**changes)
    if torch.cuda.is_available() and not changes:
        pytest.skip("the device refusal is for a model off CUDA")
    with pytest.raises(ValueError, match=match):
        stage.enable_cuda_graphs()
    assert stage.layer_graphs is None


def _fake_capture(calls, samples, num_warmup_iters):
    """CPU stand-in for ``torch.cuda.make_graphed_callables``: the same warm-up passes (forward, then
    backward with uninitialised output gradients, whose amaxes delayed scaling records) and the callables
    returned as they are, so the wrappers' arguments, the signatures and the pending amaxes' restore are
    what is checked."""
    for call, args in zip(calls, samples):
        for _ in range(num_warmup_iters + 1):  # the warm-up iterations and the capture pass
            out = call(*args)
            inputs = [a for a in (*args, *call.parameters()) if a.requires_grad]
            torch.autograd.grad(out, inputs, grad_outputs=torch.full_like(out, 1e4))
    return calls


def _cpu_runs():
    """For fp8 none and delayed: the eager run, then (capture replaced by :func:`_fake_capture`) the graphed one."""
    import models.cuda_graphs as cg

    out = {}
    for fp8 in ("none", "delayed"):
        extra = (f"model.fp8={fp8}", "model.family=qwen2")
        eager = _run_cpu(extra)
        cg._on_cuda, cg.torch.cuda.make_graphed_callables = (lambda device: True), _fake_capture  # this process only
        out[fp8] = (eager, _run_cpu((*extra, "model.cuda_graph=layers")))
    return out


def _run_cpu(extra):
    from engine.assembly import build_run
    from models.hook import ModelHook

    cfg = _cfg(extra)
    model = ModelHook.from_hf(WINDOW_HF, dtype=torch.float32, seed=cfg.train.seed, sequence_parallel=False,
                              fp8=cfg.model.fp8)
    run = build_run(cfg, model=model, train_data=RandomTokens(64, vocab=VOCAB, seq=SEQ, seed=100), checkpoints=False)
    trainer = run.trainer
    losses = [trainer.train_step(run.train_loader).loss for _ in range(3)]
    losses.append(trainer.evaluate(run.train_loader, 1))
    graphs = [(len(g.sets), g.replays, g.eager_calls) for g in trainer.layer_graphs]
    return losses, graphs


def test_the_graphed_layers_arguments_and_restored_amaxes_on_cpu():
    """The capture replaced by eager calls with the same warm-up passes (CPU): the wrappers' tensors (rope
    tables; a sliding-window layer's mask beside a full-attention one) give the layers' own results, and
    the warm-up passes' amaxes (output gradients of 1e4) do not reach delayed scaling: bitwise equal, for
    model.fp8 none and delayed (one launch)."""
    for fp8, (eager, faked) in run_distributed(_cpu_runs, 1)[0].items():
        assert faked[0] == eager[0], fp8
        first_eager = 2 if fp8 == "delayed" else 0
        assert faked[1] == [(1, 6 - first_eager, first_eager)] and eager[1] == [], fp8


def test_the_memory_report_names_the_graph_pools_as_not_modeled():
    from engine.config import load_config
    from engine.memory import predict_memory
    from models.hook import ModelHook

    def notes(graphs: str):
        cfg = load_config("tiny_llama_cpu", ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "train.steps=20",
                                             f"model.cuda_graph={graphs}"])
        return predict_memory(cfg, ModelHook.from_run_config(cfg, tokenizer_vocab=None), world=1,
                              device="cuda").notes
    assert any("CUDA graph pools" in n for n in notes("layers"))
    assert not any("CUDA graph" in n for n in notes("none"))
