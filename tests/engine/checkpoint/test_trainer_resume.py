"""Resume the real Trainer (tiny Llama, tied embeddings, vocab padding) from a checkpoint.

* Exact resume: 20 steps straight (saving asynchronously at step 10 while training goes on) vs
  a new process group that resumes from step 10 and runs 10 more: losses and parameters bitwise
  equal, at TP=2 x PP=2 (sequence parallel) and at DP=2 with the distributed (ZeRO) optimizer
  and attention dropout (so the RNG streams must be restored too).
* Resharding: the TP=2 x PP=2 step-10 checkpoint resumed at TP=4 x PP=1, DP=4 (ZeRO) and
  TP=1 x PP=4: the next step's loss equals the straight run's step 11 to fp32 tolerance.
* Model-only load (fine-tuning) into yet another layout: weights equal, optimizer counters at 0.

Four process launches (4, 2, 4, 2 ranks).
"""
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from engine.checkpoint import Checkpointer
from engine.checkpoint.trainer_state import load_trainer, save_trainer
from engine.config.loader import load_config
from parallel.testing import run_distributed

HF = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
      "num_key_value_heads": 4, "intermediate_size": 64, "vocab_size": 200, "max_position_embeddings": 64,
      "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
SEQ, GBS, STEPS, SAVE_AT = 16, 4, 20, 10


class _Tokens:
    """A deterministic in-memory dataset: sample i depends only on i; counting sequences (learnable)."""

    def __len__(self):
        return STEPS * GBS

    def __getitem__(self, i):
        start = np.random.default_rng(1000 + i).integers(0, HF["vocab_size"])
        ids = (start + np.arange(SEQ + 1)) % HF["vocab_size"]
        return {"tokens": ids[:-1], "labels": ids[1:], "position_ids": np.arange(SEQ),
                "loss_mask": np.ones(SEQ, dtype=np.float32)}


def _trainer(*, tp, pp, distributed, dropout=0.0):
    from engine.assembly import build_run
    from models.hook import ModelHook

    cfg = load_config("tiny_llama_cpu", [
        f"parallel.tp={tp}", f"parallel.pp={pp}", "parallel.dp=-1", "parallel.sequence_parallel=true",
        f"train.steps={STEPS}", f"train.global_batch_size={GBS}", "train.micro_batch_size=1",
        f"train.seq_length={SEQ}", "optim.lr=0.01", "optim.min_lr=0.001", "optim.warmup_steps=2",
        # Weight decay 0: engine/optim.py decays the last stage's tied output-layer copy but not the
        # first stage's embedding, so with decay the two "tied" copies drift apart (reported).
        "optim.weight_decay=0.0",
        f"optim.distributed={str(distributed).lower()}", "logging.progress_bar=off",
        "logging.tensorboard=false", "logging.jsonl=false", "model.hidden_size=32", "model.num_layers=4",
        "model.num_attention_heads=4", "model.num_key_value_heads=4", "model.ffn_hidden_size=64",
        "model.vocab_size=200", "model.tie_word_embeddings=true"])

    run = build_run(cfg, model=ModelHook.from_hf({**HF, "attention_dropout": dropout}, dtype=torch.float32,
                                                 sequence_parallel=True, seed=cfg.train.seed),
                    train_data=_Tokens(), checkpoints=False)
    return run.trainer, run.train_loader


def _params(trainer):
    trainer.ddp.finish_param_sync()
    return {n: p.detach().clone() for n, p in trainer.chunks.named_parameters()}


def _straight(root, tp, pp, distributed, dropout=0.0):
    trainer, loader = _trainer(tp=tp, pp=pp, distributed=distributed, dropout=dropout)
    ckpt = Checkpointer(root, group=trainer.mesh.world, async_save=True)
    losses = []
    for _ in range(STEPS):
        losses.append(trainer.train_step(loader).loss)
        ckpt.maybe_finalize()  # commits the async save once every rank wrote its file
        if trainer.step == SAVE_AT:
            save_trainer(ckpt, trainer, loader=loader, model_config=HF)
    ckpt.finalize()
    return losses, _params(trainer)


def _resume(root, tp, pp, distributed, dropout=0.0):
    trainer, loader = _trainer(tp=tp, pp=pp, distributed=distributed, dropout=dropout)
    res = load_trainer(trainer, root, group=trainer.mesh.world, loader=loader)
    assert res.step == SAVE_AT and trainer.step == SAVE_AT and res.rank_state is not None
    assert loader.consumed_samples == SAVE_AT * GBS and trainer.optimizer.step_count == SAVE_AT
    loaded = _params(trainer)
    losses = [trainer.train_step(loader).loss for _ in range(STEPS - SAVE_AT)]
    return losses, _params(trainer), loaded


def _resume_and_reshard(root):
    out = {"exact": _resume(root, 2, 2, True)}
    for name, (tp, pp, distributed) in {"tp4": (4, 1, False), "dp4": (1, 1, True), "pp4": (1, 4, False)}.items():
        trainer, loader = _trainer(tp=tp, pp=pp, distributed=distributed)
        res = load_trainer(trainer, root, group=trainer.mesh.world, loader=loader)
        assert res.rank_state is None  # another layout: RNG streams keep their fresh seeding
        out[name] = trainer.train_step(loader).loss
    # Model-only (fine-tuning) load at TP=2 x DP=2: weights only, counters untouched.
    trainer, _ = _trainer(tp=2, pp=1, distributed=True)
    load_trainer(trainer, root, group=trainer.mesh.world, model_only=True)
    assert trainer.step == 0 and trainer.optimizer.step_count == 0
    out["model_only_params"] = {n: p.detach().clone() for n, p in trainer.chunks.named_parameters()}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2pp2")
    straight = run_distributed(_straight, 4, str(root), 2, 2, True, timeout=170)
    resumed = run_distributed(_resume_and_reshard, 4, str(root), timeout=170)
    return straight, resumed


def test_exact_resume_tp2_pp2(tp2pp2):
    straight, resumed = tp2pp2
    for rank, ((losses, params), out) in enumerate(zip(straight, resumed)):
        r_losses, r_params, _ = out["exact"]
        assert r_losses == losses[SAVE_AT:], f"rank {rank}: losses differ after resume"
        assert params.keys() == r_params.keys()
        for n in params:
            assert torch.equal(params[n], r_params[n]), f"rank {rank}: {n} differs after resume"
    assert losses[-1] < losses[0]  # it trained


@pytest.mark.parametrize("layout", ["tp4", "dp4", "pp4"])
def test_resharded_resume_next_loss(tp2pp2, layout):
    straight, resumed = tp2pp2
    expected = straight[0][0][SAVE_AT]  # step 11 of the straight TP=2 x PP=2 run
    for out in resumed:
        assert out[layout] == pytest.approx(expected, rel=1e-5, abs=1e-6), layout


def test_model_only_load_into_another_layout(tp2pp2):
    # TP=2 x DP=2 (rank = dp * 2 + tp) against the step-10 weights the TP=2 x PP=2 resume loaded
    # (rank = pp * 2 + tp): layers carry global names, so equal names must hold equal shards.
    _, resumed = tp2pp2
    compared = set()
    for src in range(4):
        loaded = resumed[src]["exact"][2]
        for dst in (src % 2, 2 + src % 2):  # both dp replicas of the same tp rank
            mine = resumed[dst]["model_only_params"]
            for n, t in loaded.items():
                if n in mine:
                    assert torch.equal(mine[n], t), (src, dst, n)
                    compared.add(n)
    assert {"0.embedding.word_embeddings.weight", "0.layers.0.mlp.fc1.weight", "0.layers.3.attention.qkv.weight",
            "0.final_norm.weight"} <= compared


def test_exact_resume_dp2_distributed_optimizer_with_dropout(tmp_path):
    # Attention dropout draws from the RNG tracker: bitwise equality needs the RNG states restored.
    straight = run_distributed(_straight, 2, str(tmp_path), 1, 1, True, 0.1, timeout=120)
    resumed = run_distributed(_resume, 2, str(tmp_path), 1, 1, True, 0.1, timeout=120)
    for rank, ((losses, params), (r_losses, r_params, _)) in enumerate(zip(straight, resumed)):
        assert r_losses == losses[SAVE_AT:], f"rank {rank}"
        for n in params:
            assert torch.equal(params[n], r_params[n]), f"rank {rank}: {n}"
    meta_dir = sorted(Path(tmp_path).glob("step_*"))[-1]
    assert meta_dir.name == "step_00000010"


def _resume_other_optimizer(root, tp, pp, distributed):
    """Resume a checkpoint written by the OTHER optimizer mode: the next step's loss."""
    trainer, loader = _trainer(tp=tp, pp=pp, distributed=distributed)
    res = load_trainer(trainer, root, group=trainer.mesh.world, loader=loader)
    assert res.step == SAVE_AT and trainer.optimizer.step_count == SAVE_AT
    return trainer.train_step(loader).loss


@pytest.mark.parametrize("distributed", [False, True])
def test_dp2_resume_exact_and_across_optimizer_modes(tmp_path, distributed):
    # The plain optimizer's masters and moments are dp replicas (saved once, by dp rank 0); they resume
    # bitwise and load into the distributed optimizer's flat shards, and the other way round.
    straight = run_distributed(_straight, 2, str(tmp_path), 1, 1, distributed, timeout=120)
    resumed = run_distributed(_resume, 2, str(tmp_path), 1, 1, distributed, timeout=120)
    for rank, ((losses, params), (r_losses, r_params, _)) in enumerate(zip(straight, resumed)):
        assert r_losses == losses[SAVE_AT:], f"rank {rank}"
        for n in params:
            assert torch.equal(params[n], r_params[n]), f"rank {rank}: {n}"
    other = run_distributed(_resume_other_optimizer, 2, str(tmp_path), 1, 1, not distributed, timeout=120)
    for loss in other:
        assert loss == pytest.approx(straight[0][0][SAVE_AT], rel=1e-6, abs=1e-7)


def _model_trainer(*, layers=4, vocab=200, tied=False):
    from engine.assembly import build_run
    from models.hook import ModelHook

    hf = {**HF, "num_hidden_layers": layers, "vocab_size": vocab, "tie_word_embeddings": tied}
    cfg = load_config("tiny_llama_cpu", [
        "parallel.tp=1", "parallel.pp=1", "parallel.dp=-1", f"train.steps={STEPS}", f"train.global_batch_size={GBS}",
        "train.micro_batch_size=1", f"train.seq_length={SEQ}", "logging.progress_bar=off", "logging.tensorboard=false",
        "logging.jsonl=false", "model.hidden_size=32", f"model.num_layers={layers}", "model.num_attention_heads=4",
        "model.num_key_value_heads=4", "model.ffn_hidden_size=64", f"model.vocab_size={vocab}",
        f"model.tie_word_embeddings={str(tied).lower()}"])
    run = build_run(cfg, model=ModelHook.from_hf(hf, dtype=torch.float32, sequence_parallel=False, seed=cfg.train.seed),
                    train_data=_Tokens(), checkpoints=False)
    return run.trainer, hf


def _load_into_another_model(root):
    """Save a 4-layer, untied, 200-token model; load it into models that differ: each is refused before any
    tensor is written (the target's weights stay as they were)."""
    from engine.checkpoint.format import CheckpointError

    t, hf = _model_trainer()
    ck = Checkpointer(root, group=t.mesh.world, async_save=False)
    save_trainer(ck, t, model_config=hf)
    ck.finalize()
    out = {}
    for name, kw in (("vocab", dict(vocab=100)), ("layers", dict(layers=2)), ("tied", dict(tied=True))):
        for model_only in (True, False):
            other, _ = _model_trainer(**kw)
            before = _params(other)
            try:
                load_trainer(other, root, group=other.mesh.world, model_only=model_only)
                out[name, model_only] = "loaded"
            except CheckpointError as e:
                out[name, model_only] = str(e)
            after = _params(other)
            assert all(torch.equal(before[n], after[n]) for n in before), (name, model_only)
    same, _ = _model_trainer()
    load_trainer(same, root, group=same.mesh.world)  # the model it was saved from still loads
    return out


def test_a_checkpoint_of_another_model_is_refused_not_cut_to_fit(tmp_path):
    """Before: a checkpoint with another vocabulary loaded as if only the layout's padding differed (rows cut
    or zero-filled), and a strict load ignored saved tensors the model has no place for (a deeper model's
    layers, an untied output layer loaded into a tied model, whose head then is the embedding). Now each
    is refused, naming the cause, on a full resume and on a model-only load."""
    out = run_distributed(_load_into_another_model, 1, str(tmp_path / "ck"), timeout=180)[0]
    for model_only in (True, False):
        assert "vocabulary of 200 tokens" in out["vocab", model_only] and "this model has 100" in out["vocab", model_only]
        assert "holds 12 model.* tensor(s) this model has no place for" in out["layers", model_only]
        assert "'model.output_layer.weight'" in out["tied", model_only]
