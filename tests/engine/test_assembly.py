"""The assembly line (engine/assembly.py) end to end, on a tiny Llama built through models.hook.

* Loss normalised by the GLOBAL batch's loss tokens: two micro-batches with 3 and 29 loss tokens
  (1 process, and 2 data-parallel ranks) give the loss of one process on the full batch, and so does
  the next step (so the gradients agree too). fp32, tolerance 2e-6 absolute.
* Uneven layer counts train: 3 layers on pp=2 equal 1 process (fp32, 2e-6); so does the forward-only
  evaluation schedule after them (every run ends with ``Trainer.evaluate``).
* Interleaved pp=2 x vp=2 x dp=2: each chunk's gradient buckets reduce during the backward (ledger
  order), and losses and evaluation equal 1 process.
* Nothing grows per step: 800 steps at tp=2 keep the ledger at a constant number of counters, and the
  resident memory grows by at most 192 KiB from step 300 to 800 (under 400 bytes a step; measured 0-4 KiB,
  after 0.5 MiB of allocator growth up to step 300) with ``keep_history=False``, as the torchrun jobs train.
  Until 2026-11-28 the trainer kept every step's stats (about 0.9 KB a step here, 450 KiB over these
  500 steps), and the test's bound then was 1% of the resident memory (2.3 MB) from step 100 to 1,000.
  The per-step ``comm_bytes_tp`` equals the bytes a capture of the same step records, and reaches
  metrics.jsonl.
* ``tp_group=`` takes a torch ProcessGroup; vocab-parallel cross-entropy keeps fp64 in fp64.
* ``model.fp8_weight_cache``: the trainer casts each FP8 weight once per step (2 micro-batches) and once
  per evaluation, and the losses equal those of the run that casts per micro-batch, bitwise.

One 2-rank launch runs every distributed part.
"""
from __future__ import annotations

import gc
import json
import os
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

from parallel.testing import run_distributed

SEQ, VOCAB = 32, 64
HF = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 64,
      "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
LOSS_TOKENS = (3, 29)  # per sample, alternating
ATOL = 2e-6
LONG_STEPS = 800


class _Masked:
    """Sample i: a deterministic sequence whose loss mask keeps the LAST LOSS_TOKENS[i % 2] positions."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = np.random.default_rng(50 + i).integers(0, VOCAB, SEQ + 1)
        mask = np.zeros(SEQ, dtype=np.float32)
        mask[SEQ - LOSS_TOKENS[i % 2]:] = 1.0
        return {"tokens": ids[:-1], "labels": ids[1:], "position_ids": np.arange(SEQ), "loss_mask": mask}


def _cfg(*, mbs: int, steps: int = 2, gbs: int = 2, extra=()):
    from engine.config import load_config

    return load_config("tiny_llama_cpu", [
        "parallel.tp=1", "parallel.pp=1", "parallel.dp=-1", f"train.steps={steps}",
        f"train.global_batch_size={gbs}", f"train.micro_batch_size={mbs}", f"train.seq_length={SEQ}",
        "optim.lr=0.01", "optim.warmup_steps=0", "logging.progress_bar=off", "logging.tensorboard=false",
        "logging.jsonl=false", "logging.peak_tflops=1.0", "train.eval_interval=0", *extra])


def _run(cfg, hf=HF, *, n=8, run_dir=None):
    from engine.assembly import build_run
    from models.hook import ModelHook

    model = ModelHook.from_hf(hf, dtype=torch.float32, seed=cfg.train.seed,
                              sequence_parallel=cfg.parallel.sequence_parallel)
    return build_run(cfg, model=model, train_data=_Masked(n), checkpoints=False, run_dir=run_dir)


def _losses(cfg, hf=HF):
    """The step losses, then the forward-only evaluation of the next global batch."""
    run = _run(cfg, hf, n=(cfg.train.steps + 1) * cfg.train.global_batch_size)
    losses = [run.trainer.train_step(run.train_loader).loss for _ in range(cfg.train.steps)]
    return losses + [run.trainer.evaluate(run.train_loader, 1)]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _long_run_tp2(run_dir: str, steps: int):
    hf = {**HF, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
          "intermediate_size": 32}
    # tp without sequence parallelism: 9 tp collectives a step instead of 19 (the ledger's bound does not
    # depend on which collectives; the 1,000 steps took 44 s with sequence parallelism on the 2-core CI
    # machine, 34 s without)
    cfg = _cfg(mbs=1, gbs=1, steps=steps, extra=["parallel.tp=2", "parallel.sequence_parallel=false",
                                                   "train.seq_length=8", "train.log_interval=100",
                                                   "logging.jsonl=true"])

    run = _run(cfg, hf, n=steps + 2, run_dir=run_dir)
    tr, ledger = run.trainer, run.mesh.ledger
    seen = {}

    def on_step(trainer, st):
        if trainer.step == 5:
            seen["comm_bytes"] = st.comm_bytes
        if trainer.step in (300, steps):
            gc.collect()
            seen[trainer.step] = (ledger.size(), _rss())
    with ledger.capture() as cap:  # one step, recorded call by call
        tr.train_step(run.train_loader)
    seen["captured_tp"] = cap.total(axis="tp")
    seen["first_comm_bytes"] = tr.train_step(run.train_loader).comm_bytes
    tr.train(run.train_loader, on_step=on_step, keep_history=False)
    return seen


def _distributed_parts(tmp: str):
    out = {"dp2": _losses(_cfg(mbs=1))}
    out["pp2_uneven"] = _losses(_cfg(mbs=1, extra=["parallel.pp=2"]), {**HF, "num_hidden_layers": 3})
    # tp_group= as a torch ProcessGroup: the same shards and outputs as a Tessel Group.
    from parallel.mesh import Mesh, ParallelDims
    from parallel.tensor_parallel import ColumnParallelLinear

    mesh = Mesh.build(ParallelDims(tp=2))
    init = lambda w: torch.nn.init.normal_(w, generator=torch.Generator().manual_seed(7))  # noqa: E731
    a = ColumnParallelLinear(8, 6, tp_group=mesh.tp, init_method=init)
    b = ColumnParallelLinear(8, 6, tp_group=dist.new_group([0, 1]), init_method=init)
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(1))
    out["process_group_equal"] = torch.equal(a.weight, b.weight) and torch.equal(a(x), b(x))
    out["long"] = _long_run_tp2(os.path.join(tmp, f"long{dist.get_rank()}"), LONG_STEPS)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("assembly")
    single = {"full": _losses(_cfg(mbs=2)), "micro": _losses(_cfg(mbs=1)),
              "layers3": _losses(_cfg(mbs=1), {**HF, "num_hidden_layers": 3})}
    return single, run_distributed(_distributed_parts, 2, str(tmp), timeout=400), tmp


def test_loss_is_weighted_by_loss_tokens_over_the_global_batch(results):
    single, dist_out, _ = results
    full = single["full"]  # one micro-batch holding both samples: token-weighted by construction
    # A mean of per-micro-batch means would give (l1/3 + l2/29)/2 instead: far from this.
    assert max(abs(a - b) for a, b in zip(single["micro"], full)) < ATOL, (single["micro"], full)
    for rank_out in dist_out:
        assert max(abs(a - b) for a, b in zip(rank_out["dp2"], full)) < ATOL, (rank_out["dp2"], full)


def test_uneven_layers_train_on_a_pipeline(results):
    single, dist_out, _ = results
    for rank_out in dist_out:
        assert max(abs(a - b) for a, b in zip(rank_out["pp2_uneven"], single["layers3"])) < ATOL


def test_tp_group_takes_a_torch_process_group(results):
    assert all(r["process_group_equal"] for r in results[1])


def test_ledger_is_bounded_and_comm_bytes_are_logged(results):
    _, dist_out, tmp = results
    for rank, r in enumerate(dist_out):
        long = r["long"]
        (size300, rss300), (size_end, rss_end) = long[300], long[LONG_STEPS]
        assert size300 == size_end <= 8, (size300, size_end)
        assert rss_end - rss300 <= 192 * 1024, \
            f"rank {rank}: RSS grew {rss300} -> {rss_end} bytes from step 300 to {LONG_STEPS}"
        assert r["long"]["first_comm_bytes"]["tp"] == long["captured_tp"] > 0
        assert long["comm_bytes"]["tp"] == long["first_comm_bytes"]["tp"]  # every step moves the same bytes
    lines = [json.loads(x) for x in open(os.path.join(tmp, "long0", "metrics.jsonl"))]
    logged = [x for x in lines if "comm_bytes_tp" in x]
    assert logged and all(x["comm_bytes_tp"] == dist_out[0]["long"]["captured_tp"] for x in logged)
    # Exposed communication: the total is the sum of the axes', and the tp axis (which communicates
    # every step) spent some time blocked, less than the whole step.
    for x in logged:
        axes = {k: v for k, v in x.items() if k.startswith("comm_exposed_s_")}
        assert "comm_exposed_s_tp" in axes and x["comm_exposed_s"] == pytest.approx(sum(axes.values()))
        assert 0 < x["comm_exposed_s_tp"] <= x["comm_exposed_s"] < x["step_time_s"]


def test_vocab_parallel_cross_entropy_keeps_fp64():
    from parallel.comm import Group
    from parallel.tensor_parallel import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, 50, dtype=torch.float64, generator=g) * 4
    target = torch.randint(0, 50, (5, 7), generator=g)
    ours = vocab_parallel_cross_entropy(logits, target, tp_group=Group.trivial("tp"))
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), target.reshape(-1), reduction="none")
    assert ours.dtype == torch.float64
    assert (ours.reshape(-1) - ref).abs().max().item() < 1e-13


def _interleaved_dp2(steps: int):
    cfg = _cfg(mbs=1, gbs=4, steps=steps, extra=["parallel.pp=2", "parallel.vp=2", "parallel.schedule=interleaved"])
    run = _run(cfg, {**HF, "num_hidden_layers": 4}, n=4 * (steps + 1))
    tr = run.trainer
    losses, orders = [], []
    for _ in range(steps):
        with run.mesh.ledger.capture() as cap:
            losses.append(tr.train_step(run.train_loader).loss)
        kinds = ["dp" if r.axis == "dp_cp" and r.op in ("all_reduce", "reduce_scatter") and r.dtype == "torch.float32"
                 else "pp" if r.axis == "pp" and r.op in ("send", "recv") else "-" for r in cap.records]
        orders.append(kinds)
    losses.append(tr.evaluate(run.train_loader, 1))  # the forward-only schedule, interleaved
    return {"losses": losses, "orders": orders, "dp": run.mesh.dims.dp}


def test_interleaved_pipeline_overlaps_dp_reduction_and_matches_one_process():
    # pp=2 x vp=2 x dp=2 (4 ranks): each chunk's buckets reduce during the backward, i.e. before the
    # rank's last pipeline transfer of the step; the losses equal one process's (fp32, 1e-5 absolute).
    steps = 3
    ref = _losses(_cfg(mbs=1, gbs=4, steps=steps), {**HF, "num_hidden_layers": 4})
    out = run_distributed(_interleaved_dp2, 4, steps, timeout=300)
    for rank, r in enumerate(out):
        assert r["dp"] == 2
        assert max(abs(a - b) for a, b in zip(r["losses"], ref)) < 1e-5, (rank, r["losses"], ref)
        for kinds in r["orders"]:
            last_pp = max(i for i, k in enumerate(kinds) if k == "pp")
            assert "dp" in kinds[:last_pp], f"rank {rank}: no data-parallel reduction before the last p2p: {kinds}"


def test_fp8_weight_casts_once_per_step_in_the_trainer(monkeypatch):
    from engine.assembly import build_run
    from engine.ops.fp8_linear import WeightCasts
    from models.hook import ModelHook

    made = []
    put = WeightCasts.put
    monkeypatch.setattr(WeightCasts, "put", lambda self, kind, w, cast: made.append(kind) or put(self, kind, w, cast))
    got = {}
    for cache in (None, "false"):
        made.clear()
        cfg = _cfg(mbs=1, gbs=2, extra=["model.fp8=tensorwise"] + ([f"model.fp8_weight_cache={cache}"] if cache else []))
        model = ModelHook.from_hf(HF, dtype=torch.float32, seed=cfg.train.seed, fp8="tensorwise")
        run = build_run(cfg, model=model, train_data=_Masked(6), checkpoints=False)
        losses = [run.trainer.train_step(run.train_loader).loss for _ in range(2)]
        got[cache] = (losses + [run.trainer.evaluate(run.train_loader, 1)], len(made))
    linears = 2 * 4  # 2 layers: qkv, out, fc1, fc2
    assert got[None][0] == got["false"][0]
    assert got[None][1] == linears * 3 and got["false"][1] == 0  # 2 steps and 1 evaluation; none without the cache


def test_a_hook_built_without_the_configs_fp8_is_refused():
    """build_run takes the model hook as given: model.fp8 in the config of a hook built without it would
    train in high precision and say nothing. Refused before any group is built, with the fix named."""
    from engine.assembly import build_run
    from models.hook import ModelHook

    cfg = _cfg(mbs=1, gbs=2, extra=["model.fp8=delayed", "model.fp8_amax_history=4"])
    for hook, needle in [({}, "model.fp8='delayed' (the hook's: 'none')"),
                         ({"fp8": "delayed"}, "model.fp8_amax_history=4 (the hook's: 16)")]:
        model = ModelHook.from_hf(HF, dtype=torch.float32, seed=cfg.train.seed, **hook)
        with pytest.raises(ValueError, match=re.escape(needle) + ".*ModelHook.from_run_config"):
            build_run(cfg, model=model, train_data=_Masked(6), checkpoints=False)


class _Weighted(_Masked):
    """_Masked's samples with the loss mask's kept positions weighted ``w`` (a weighted mask)."""

    def __init__(self, n: int, w: float):
        super().__init__(n)
        self.w = w

    def __getitem__(self, i):
        s = super().__getitem__(i)
        return {**s, "loss_mask": s["loss_mask"] * np.float32(self.w)}


def test_a_weighted_loss_mask_summing_below_one_is_normalised_by_its_sum():
    """The loss is sum(loss x mask) / sum(mask): scaling the mask changes nothing. With weights of 1/32 the
    3-token sample's mask sums to 3/32; before 2026-11-28 the step divided it by 1 instead, so its loss and
    gradients came out 3/32 as large."""
    from engine.assembly import build_run
    from models.hook import ModelHook

    out = []
    for w in (1.0, 1.0 / 32):
        cfg = _cfg(mbs=1, gbs=1, steps=1, extra=["logging.memory_report=false"])
        model = ModelHook.from_hf(HF, dtype=torch.float32, seed=cfg.train.seed)
        run = build_run(cfg, model=model, train_data=_Weighted(4, w), checkpoints=False)
        st = run.trainer.train_step(run.train_loader)  # sample 0: LOSS_TOKENS[0] = 3 kept positions
        out.append((st.loss, st.grad_norm))
    assert out[1] == pytest.approx(out[0], rel=1e-5), out
