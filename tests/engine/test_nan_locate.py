"""NaN localisation (``fault.nan_replay``; issue 22): a non-finite value injected into layer k's output on one
rank is localised, by replaying the step with hooks, to layer k and that rank, in the log and metrics.jsonl."""
from __future__ import annotations

import io
import json
import os

import torch

from parallel.testing import run_distributed


def _injected_run(run_dir: str, layer: str, bad_rank: int, bad_step: int, nonfinite: str):
    import torch.distributed as dist

    from engine.assembly import build_run
    from engine.optim import NonFiniteGradError
    from models.hook import ModelHook
    from tests.engine.test_fault import HF, _cfg, _Data

    hf = dict(HF, num_hidden_layers=3)
    cfg = _cfg(run_dir, "train.steps=3", "checkpoint.interval=0", "logging.memory_report=false",
               f"optim.nonfinite={nonfinite}")
    model = ModelHook.from_hf(hf, dtype=torch.float32, seed=cfg.train.seed, sequence_parallel=False)
    log = io.StringIO()
    run = build_run(cfg, model=model, train_data=_Data(6), run_dir=run_dir, log_stream=log, checkpoints=False)
    tr = run.trainer

    def inject(mod, inputs, output):  # a faulty layer on one rank, in one step (the replay sees it again)
        if tr.step == bad_step - 1:
            output = output.clone()
            output.view(-1)[5] = float("nan")
        return output
    if dist.get_rank() == bad_rank:
        tr.chunks[0].layers[layer].register_forward_hook(inject)
    try:
        history = run.train()
    except NonFiniteGradError:
        history = None
    return log.getvalue(), tr.nonfinite_report, None if history is None else [st.applied for st in history]


def test_a_nan_injected_into_layer_k_on_one_rank_is_localised_to_it(tmp_path):
    run_dir = str(tmp_path / "run")
    (log, report, applied), (_, report1, _) = run_distributed(_injected_run, 2, run_dir, "1", 1, 2, "skip", timeout=120)
    assert applied == [True, False, True]  # step 2 skipped, step 3 trains on
    assert report == report1 and report["step"] == 2 and list(report["ranks"]) == [1], report  # rank 0 stayed finite
    fw = report["ranks"][1]["forward"]
    assert fw == {"module": "stage 0 layers.1", "type": "TransformerLayer", "tensor": "output 0",
                  "inputs_finite": True}, fw
    assert "parameter" not in report["ranks"][1]  # the weights were finite: the layer produced it
    (line,) = [x for x in log.splitlines() if x.startswith("tessel: non-finite step")]
    assert line.startswith("tessel: non-finite step 2 replayed with hooks: rank 1: first non-finite forward "
                           "tensor: output 0 of stage 0 layers.1 (TransformerLayer), its inputs finite"), line
    records = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    (rec,) = [r for r in records if r["split"] == "nonfinite"]
    assert rec["step"] == 2 and rec["ranks"]["1"]["forward"]["module"] == "stage 0 layers.1"


def test_nonfinite_stop_is_localised_before_it_stops(tmp_path):
    run_dir = str(tmp_path / "run")
    log, report, applied = run_distributed(_injected_run, 1, run_dir, "2", 0, 1, "stop", timeout=120)[0]
    assert applied is None and report["step"] == 1 and list(report["ranks"]) == [0]
    assert report["ranks"][0]["forward"]["module"] == "stage 0 layers.2", report


def _poisoned_parameter_under_zero3(run_dir: str):
    """ZeRO-3: a NaN in one element of layers.1.mlp.fc2.weight (in the shard of the rank that stores it). The
    parameters are placeholders there, so the replay checks each rank's stored shards."""
    from engine.assembly import build_run
    from models.hook import ModelHook
    from tests.engine.test_fault import HF, _cfg, _Data

    cfg = _cfg(run_dir, "train.steps=2", "checkpoint.interval=0", "logging.memory_report=false",
               "optim.nonfinite=skip", "optim.distributed=true", "optim.zero_stage=3")
    model = ModelHook.from_hf(dict(HF, num_hidden_layers=2), dtype=torch.float32, seed=cfg.train.seed)
    run = build_run(cfg, model=model, train_data=_Data(6), run_dir=run_dir, log_stream=io.StringIO(), checkpoints=False)
    tr = run.trainer
    with torch.no_grad():
        for pc in tr.optimizer.dist.pieces:
            if pc.name.endswith("layers.1.mlp.fc2.weight"):
                pc.model[0] = float("nan")
                pc.master[0] = float("nan")
    tr.train_step(run.train_loader)
    return {r: f.get("parameter") for r, f in tr.nonfinite_report["ranks"].items()}


def test_a_nonfinite_parameter_is_named_under_zero3(tmp_path):
    found = run_distributed(_poisoned_parameter_under_zero3, 2, str(tmp_path), timeout=180)[0]
    assert "0.layers.1.mlp.fc2.weight" in found.values(), found


class _Pairs:
    """DPO pairs (chosen, rejected) of the test model's vocabulary: 2 rows per sample."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import numpy as np

        from tests.engine.test_fault import SEQ, VOCAB

        rows = np.stack([np.random.default_rng(7 + 2 * i + j).integers(0, VOCAB, SEQ + 1) for j in range(2)])
        return {"tokens": rows[:, :-1], "labels": rows[:, 1:], "position_ids": np.stack([np.arange(SEQ)] * 2),
                "loss_mask": np.ones((2, SEQ), dtype=np.float32), "pair": np.asarray(i),
                "units": np.asarray(1.0, dtype=np.float32), "ref_logp": np.zeros(2)}


def _dpo_metrics(run_dir, nan_replay: bool):
    from engine.assembly import build_run
    from engine.posttrain.datasets import collate_pairs
    from engine.posttrain.objectives import DPOObjective
    from models.hook import ModelHook
    from tests.engine.test_fault import HF, _cfg, nan_in_step

    cfg = _cfg(run_dir, "train.steps=3", "checkpoint.interval=0", "logging.memory_report=false",
               f"fault.nan_replay={str(nan_replay).lower()}")
    model = ModelHook.from_hf(HF, dtype=torch.float32, seed=cfg.train.seed, sequence_parallel=False)
    run = build_run(cfg, model=model, train_data=_Pairs(6), run_dir=str(run_dir), log_stream=io.StringIO(),
                    checkpoints=False, objective=DPOObjective(beta=0.1), rows_per_sample=2, collate_fn=collate_pairs)
    tr = run.trainer
    nan_in_step(tr, 2)
    history = run.train()
    tr.logger.close()
    return [(st.applied, st.extra) for st in history]


def test_the_replay_adds_nothing_to_the_next_steps_objective_metrics(tmp_path):
    """DPO's metrics are sums over the step's pairs (Trainer._stats): the replay of a non-finite step runs
    the objective again and must not leave its sums for the next step, which would then count 4 pairs
    and log the replay's NaN rewards. The step after the replay logs what it logs without the replay."""
    plain = _dpo_metrics(tmp_path / "plain", False)
    replayed = _dpo_metrics(tmp_path / "replay", True)
    assert [a for a, _ in replayed] == [True, False, True]
    assert replayed[2][1] == plain[2][1] and all(v == v for v in replayed[2][1].values())  # no NaN


def _powersgd_counts(run_dir: str, nan_replay: bool):
    from engine.assembly import build_run
    from models.hook import ModelHook
    from tests.engine.test_fault import HF, _Data, _cfg, nan_in_step

    cfg = _cfg(run_dir, "train.steps=3", "checkpoint.interval=0", "logging.memory_report=false",
               "optim.grad_compression=powersgd", "optim.powersgd_rank=2", "optim.powersgd_start_step=5",
               f"fault.nan_replay={str(nan_replay).lower()}")
    model = ModelHook.from_hf(HF, dtype=torch.float32, seed=cfg.train.seed, sequence_parallel=False)
    run = build_run(cfg, model=model, train_data=_Data(6), run_dir=run_dir, log_stream=io.StringIO(), checkpoints=False)
    tr = run.trainer
    nan_in_step(tr, 2)
    run.train()
    tr.logger.close()
    return sorted(set(tr.ddp.grad_compressor.steps.values()))


def test_the_replay_leaves_the_gradient_compressor_as_the_step_left_it(tmp_path):
    """PowerSGD counts its reductions for its warm-up (optim.powersgd_start_step): the replay of a
    non-finite step reduces once more, which moved the warm-up's end a step earlier than without the replay.
    Its state (the count, error feedback, Q) is restored after the replay: 3 steps count 3."""
    for replay in (False, True):
        counts = run_distributed(_powersgd_counts, 2, str(tmp_path / f"r{replay}"), replay, timeout=180)
        assert counts == [[3], [3]], (replay, counts)
