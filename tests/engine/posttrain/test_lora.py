"""engine/posttrain/lora.py: LoRA adapters on the TP linears, sharded like their base.

* TP=2 (with and without sequence parallelism) equals TP=1: per-token losses (atol 1e-6) and every
  adapter gradient, shards gathered (atol 1e-5), fp32, after making B non-zero (Llama: GQA qkv and
  the stride-2 gate/up fc1; GPT-2: MHA qkv with biases, plain fc1). The replicated A of column
  linears and B of row linears have bit-identical gradients on both TP ranks once reduced, and
  their initial values equal the TP=1 adapters sliced. The frozen base gets no gradient.
* Adapter dropout on column linears without SP draws the same mask on every TP rank (the default
  stream): TP=2 losses equal TP=1 with the same seed.
* The real Trainer (build_run, tp=2 with SP): only adapters train, the base is bitwise unchanged
  after optimizer steps; an adapter-only checkpoint holds the adapters and their optimizer state
  only, records the LoRA settings, and resumes into tp=1 x dp=2 from base + adapters: parameters
  bitwise equal, next loss equal (fp32, rtol 1e-5).
* Bad input: targets matching nothing, rank < 1, alpha, dropout, FP8 / ring overlap, twice applied.

One 2-rank launch runs every distributed part.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from parallel.testing import run_distributed
from tests.models.tiny import config

LOSS_ATOL, GRAD_ATOL = 1e-6, 1e-5
B, S, SEED, RANK, ALPHA = 2, 8, 7, 4, 8.0
FAMILIES = ("llama", "gpt2")


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (B, S), generator=g)
    labels = torch.randint(0, 100, (B, S), generator=g)
    return ids, labels


def fill_b(stage, *, seed: int = 3) -> None:
    """Give every lora_B a non-zero value drawn in full per name, this rank keeping its shard."""
    from parallel.tensor_parallel import shard_tensor

    for name, p in stage.named_parameters():
        if not name.endswith("lora_B"):
            continue
        tp = next(m for n, m in stage.named_modules() if n == name.rsplit(".", 1)[0]).tp_group
        full_rows = p.shape[0] * (tp.size if p.tensor_parallel else 1)
        g = torch.Generator().manual_seed(seed + sum(map(ord, name)))
        full = torch.randn(full_rows, p.shape[1], generator=g) * 0.1
        if p.tensor_parallel:
            full = shard_tensor(full, rank=tp.rank, size=tp.size, dim=0, stride=p.partition_stride)
        with torch.no_grad():
            p.copy_(full)


def _adapter_step(family, tp_group, sp, *, targets="all", dropout=0.0):
    from engine.posttrain.lora import apply_lora
    from models import build_model
    from parallel.tensor_parallel import allreduce_sequence_parallel_grads, full_param

    ids, labels = _batch()
    stage = build_model(config(family), tp_group=tp_group, sequence_parallel=sp, seed=SEED)
    names = apply_lora(stage, rank=RANK, alpha=ALPHA, dropout=dropout, targets=targets, seed=SEED)
    a_init = {n: full_param(p, tp_group) for n, p in stage.named_parameters() if n.endswith("lora_A")}
    fill_b(stage)
    torch.manual_seed(11)  # the default stream: adapter dropout of replicated inputs
    def tp_sent():
        return tp_group.ledger.total("sent_bytes", axis="tp")
    t0 = tp_sent()
    loss = stage(ids, labels=labels)
    t1 = tp_sent()
    loss.sum().backward()
    lora_bytes = (t1 - t0, tp_sent() - t1)  # (forward, backward)
    assert all(p.grad is None for n, p in stage.named_parameters() if "lora_" not in n)
    base = build_model(config(family), tp_group=tp_group, sequence_parallel=sp, seed=SEED)
    t0 = tp_sent()
    base_loss = base(ids, labels=labels)
    t1 = tp_sent()
    base_loss.sum().backward()
    base_bytes = (t1 - t0, tp_sent() - t1)
    allreduce_sequence_parallel_grads(stage, tp_group)
    grads = {n: full_param(p, tp_group, grad=True) for n, p in stage.named_parameters() if p.requires_grad}
    local = {n: p.grad.clone() for n, p in stage.named_parameters() if p.requires_grad and not p.tensor_parallel}
    return {"names": names, "loss": loss.detach(), "grads": grads, "a_init": a_init, "replicated": local,
            "tp_bytes": (lora_bytes, base_bytes)}


# -- the trainer: adapter-only checkpoints ------------------------------------------------------------

HF = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 64,
      "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
SEQ, GBS = 16, 4


class _Tokens:
    def __len__(self):
        return 8 * GBS

    def __getitem__(self, i):
        ids = np.random.default_rng(100 + i).integers(0, HF["vocab_size"], SEQ + 1)
        return {"tokens": ids[:-1], "labels": ids[1:], "position_ids": np.arange(SEQ),
                "loss_mask": np.ones(SEQ, dtype=np.float32)}


class LoraHook:
    """A model hook whose stages get adapters right after they are built (before DataParallel)."""

    def __init__(self, hook, **lora):
        self._hook, self._lora = hook, lora

    def __getattr__(self, name):
        return getattr(self._hook, name)

    def build_stage(self, mesh, **kw):
        from engine.posttrain.lora import apply_lora

        stage = self._hook.build_stage(mesh, **kw)
        apply_lora(stage, seed=self._hook.seed, **self._lora)
        return stage


def _run(*, tp, sp):
    from engine.assembly import build_run
    from engine.config.loader import load_config
    from models.hook import ModelHook

    cfg = load_config("tiny_llama_cpu", [
        f"parallel.tp={tp}", "parallel.pp=1", "parallel.dp=-1", f"parallel.sequence_parallel={str(sp).lower()}",
        "train.steps=8", f"train.global_batch_size={GBS}", "train.micro_batch_size=1", f"train.seq_length={SEQ}",
        "optim.lr=0.01", "optim.warmup_steps=0", "optim.weight_decay=0.01", "logging.progress_bar=off",
        "logging.tensorboard=false", "logging.jsonl=false", "train.eval_interval=0", "model.hidden_size=32",
        "model.num_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
        "model.ffn_hidden_size=64", "model.vocab_size=64"])
    hook = ModelHook.from_hf(HF, dtype=torch.float32, sequence_parallel=sp, seed=cfg.train.seed)
    run = build_run(cfg, model=LoraHook(hook, rank=RANK, alpha=ALPHA, targets=["qkv", "fc2", "mlp.fc1"]),
                    train_data=_Tokens(), checkpoints=False)
    return run.trainer, run.train_loader


def _full_params(trainer):
    from parallel.tensor_parallel import full_param

    trainer.ddp.finish_param_sync()
    return {n.split(".", 1)[1]: full_param(p, trainer.mesh.tp).clone() for n, p in trainer.chunks.named_parameters()}


def _trainer_part(root: str):
    from engine.checkpoint import Checkpointer
    from engine.checkpoint.trainer_state import load_trainer, save_trainer

    root = Path(root)
    trainer, loader = _run(tp=2, sp=True)
    trainable = sorted(trainer.ddp.param_names.values())
    base_ckpt = Checkpointer(root / "base", group=trainer.mesh.world)
    save_trainer(base_ckpt, trainer, loader=loader, model_config=HF, params="frozen")
    before = _full_params(trainer)
    losses = [trainer.train_step(loader).loss for _ in range(2)]
    after = _full_params(trainer)
    run_ckpt = Checkpointer(root / "run", group=trainer.mesh.world)
    save_trainer(run_ckpt, trainer, loader=loader, model_config=HF, params="trainable")
    next_loss = trainer.train_step(loader).loss
    # Resume at another layout: the base from its checkpoint, then adapters, optimizer and counters.
    trainer2, loader2 = _run(tp=1, sp=False)
    load_trainer(trainer2, root / "base", group=trainer2.mesh.world, model_only=True, params="frozen")
    load_trainer(trainer2, root / "run", group=trainer2.mesh.world, loader=loader2, params="trainable")
    resumed = _full_params(trainer2)
    return {"trainable": trainable, "before": before, "after": after, "losses": losses, "next": next_loss,
            "resumed": resumed, "resumed_next": trainer2.train_step(loader2).loss, "step": trainer2.step}


def _worker(root: str):
    import torch.distributed as dist

    from parallel.mesh import Mesh, ParallelDims

    tp = Mesh.build(ParallelDims.for_world(dist.get_world_size(), tp=2)).tp
    out = {}
    for family in FAMILIES:
        for sp in (False, True):
            out["step", family, sp] = _adapter_step(family, tp, sp)
    out["dropout"] = _adapter_step("llama", tp, False, targets=["qkv", "fc1"], dropout=0.3)["loss"]
    out["trainer"] = _trainer_part(root)
    return out


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return root, run_distributed(_worker, 2, str(root), timeout=240)


@pytest.fixture(scope="module")
def dist_results(distributed):
    return distributed[1]


@pytest.fixture(scope="module")
def references():
    from parallel.comm import Group

    tp1 = Group.trivial("tp")
    out = {f: _adapter_step(f, tp1, False) for f in FAMILIES}
    out["dropout"] = _adapter_step("llama", tp1, False, targets=["qkv", "fc1"], dropout=0.3)["loss"]
    return out


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_equals_tp1(dist_results, references, family, sp):
    ref = references[family]
    res = [dist_results[r]["step", family, sp] for r in (0, 1)]
    assert res[0]["names"] == ref["names"] and len(ref["names"]) == 8  # 4 linears x 2 layers
    for r in res:
        torch.testing.assert_close(r["loss"], ref["loss"], atol=LOSS_ATOL, rtol=0)
        assert sorted(r["grads"]) == sorted(ref["grads"]) == sorted(
            f"layers.{i}.{m}.lora_{ab}" for i in range(2) for m in ("attention.qkv", "attention.out", "mlp.fc1",
                                                                     "mlp.fc2") for ab in "AB")
        for n, g in r["grads"].items():
            assert g.abs().sum() > 0, n
            torch.testing.assert_close(g, ref["grads"][n], atol=GRAD_ATOL, rtol=0, msg=n)
        for n, a in r["a_init"].items():
            assert torch.equal(a, ref["a_init"][n]), f"initial {n} differs from the TP=1 adapter"
    # Replicated adapters (column A, row B): the same gradient on both TP ranks, bit for bit.
    assert sorted(res[0]["replicated"]) == sorted(res[1]["replicated"])
    for n, g in res[0]["replicated"].items():
        assert torch.equal(g, res[1]["replicated"][n]), n


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sp", [False, True])
def test_adapters_add_no_tp_communication(dist_results, family, sp):
    """Forward: a row adapter's term joins the base's partial sum before its one reduction (no bytes); a
    column adapter without SP reads the replicated input (no bytes), with SP it all-gathers its (s/tp, b, r)
    down-projection: (tp-1)/tp * s*b*r*4 bytes sent per column target, exactly. Backward: fewer bytes than
    full fine-tuning (a frozen base has no weight gradient, so no re-gather of SP inputs, and no input
    gradient below the first layer)."""
    tp, layers, column_targets = 2, config(family)["num_hidden_layers" if family == "llama" else "n_layer"], 2
    extra = layers * column_targets * (tp - 1) / tp * S * B * RANK * 4 if sp else 0  # qkv, fc1 per layer
    for rank in range(2):
        (lora_fwd, lora_bwd), (base_fwd, base_bwd) = dist_results[rank]["step", family, sp]["tp_bytes"]
        assert lora_fwd == base_fwd + extra and base_fwd > 0
        assert 0 < lora_bwd < base_bwd


def test_column_dropout_mask_is_the_same_on_every_tp_rank(dist_results, references):
    for r in (0, 1):
        torch.testing.assert_close(dist_results[r]["dropout"], references["dropout"], atol=LOSS_ATOL, rtol=0)
    assert not torch.allclose(references["dropout"], references["llama"]["loss"])  # dropout did act


def test_trainer_trains_only_adapters_and_resumes_adapter_only_checkpoints(dist_results):
    t = dist_results[0]["trainer"]
    assert len(t["trainable"]) == 12 and all(n.endswith(("lora_A", "lora_B")) for n in t["trainable"])
    assert not any(".attention.out." in n for n in t["trainable"])  # not targeted
    for n, before in t["before"].items():
        if "lora_" in n:  # step 1 moves B (A's gradient is 0 while B = 0), step 2 both
            assert not torch.equal(before, t["after"][n]), f"adapter {n} did not train"
        else:
            assert torch.equal(before, t["after"][n]), f"frozen {n} changed"
    for n, p in t["after"].items():
        rows = min(p.shape[0], t["resumed"][n].shape[0])  # vocab padding differs between tp=2 and tp=1
        assert torch.equal(p[:rows], t["resumed"][n][:rows]), f"{n} differs after resuming at tp=1 x dp=2"
    assert t["step"] == 3
    assert t["resumed_next"] == pytest.approx(t["next"], rel=1e-5)


def test_adapter_only_checkpoint_contents(distributed):
    from engine.checkpoint import read_metadata, resolve_checkpoint

    root = distributed[0]
    meta = read_metadata(resolve_checkpoint(root / "run"))
    model = sorted(k for k in meta["tensors"] if k.startswith("model."))
    assert model and all(k.endswith((".lora_A", ".lora_B")) for k in model)
    others = {k.split(".")[0] for k in meta["tensors"] if not k.startswith("model.")}
    assert others == {"optimizer"}
    lora = meta["trainer_state"]["lora"]
    assert lora == {"rank": RANK, "alpha": ALPHA, "dropout": 0.0, "targets": ["attention.qkv", "mlp.fc1", "mlp.fc2"],
                    "scaling": ALPHA / RANK, "use_rslora": False, "adapters_only": True}
    base = read_metadata(resolve_checkpoint(root / "base"))
    assert not any("lora_" in k for k in base["tensors"])
    assert "optimizer" not in {k.split(".")[0] for k in base["tensors"]}


# -- bad input ---------------------------------------------------------------------------------------

def _tiny_stage(**kw):
    from models import build_model
    from parallel.comm import Group

    return build_model(config("llama"), tp_group=Group.trivial("tp"), seed=SEED, **kw)


@pytest.mark.parametrize("kwargs, match", [
    (dict(targets=["attn"]), r"'attn' matches no linear; valid names: attention.qkv, attention.out, mlp.fc1, "
                             r"mlp.fc2, the short qkv, out, fc1, fc2, or 'all'"),
    (dict(targets=["output_layer"]), r"the output layer is never adapted"),
    (dict(targets=[]), r"targets is empty"),
    (dict(rank=0), r"rank=0 must be an integer >= 1"),
    (dict(rank=2.5), r"rank=2.5 must be an integer >= 1"),
    (dict(alpha=0.0), r"alpha=0.0 must be a finite number > 0"),
    (dict(dropout=1.0), r"dropout=1.0 must be a number in \[0, 1\)"),
])
def test_bad_settings_are_refused_before_anything_changes(kwargs, match):
    from engine.posttrain.lora import apply_lora

    stage = _tiny_stage()
    args = dict(rank=RANK, alpha=ALPHA, targets="all") | kwargs
    with pytest.raises(ValueError, match=match):
        apply_lora(stage, **args)
    assert all(p.requires_grad for p in stage.parameters())  # nothing frozen by a refused call


def test_refused_compositions_and_reapplication():
    from engine.posttrain.lora import apply_lora, check_lora
    from parallel.tensor_parallel.fp8 import apply_fp8

    with pytest.raises(ValueError, match=r"model.fp8='tensorwise' is not supported.*set model.fp8='none'"):
        check_lora(rank=4, alpha=8.0, fp8="tensorwise")
    with pytest.raises(ValueError, match=r"parallel.tp_overlap='ring' is not supported"):
        check_lora(rank=4, alpha=8.0, tp_overlap="ring")
    assert check_lora(rank=4, alpha=8.0, targets="qkv,fc2").targets == ("attention.qkv", "mlp.fc2")
    stage = _tiny_stage()
    apply_fp8(stage, "tensorwise")
    with pytest.raises(ValueError, match=r"LoRA cannot adapt linear layers.0.attention.qkv: it runs Fp8LinearImpl"):
        apply_lora(stage, rank=4, alpha=8.0)
    assert all(p.requires_grad for p in stage.parameters()) and not hasattr(stage.layers["0"].mlp.fc1, "lora_A")
    stage = _tiny_stage()
    assert apply_lora(stage, rank=4, alpha=8.0, targets=["out"]) == ["layers.0.attention.out", "layers.1.attention.out"]
    with pytest.raises(ValueError, match="already called"):
        apply_lora(stage, rank=4, alpha=8.0)


def test_adapters_disabled_gives_the_base_model():
    from engine.posttrain.lora import adapters_disabled, apply_lora

    ids, labels = _batch()
    stage = _tiny_stage()
    base = stage(ids, labels=labels).detach()
    apply_lora(stage, rank=RANK, alpha=ALPHA)
    assert torch.equal(stage(ids, labels=labels).detach(), base)  # B = 0: the adapted model starts at the base
    fill_b(stage)
    assert not torch.allclose(stage(ids, labels=labels), base)
    with adapters_disabled(stage):
        assert torch.equal(stage(ids, labels=labels), base)
