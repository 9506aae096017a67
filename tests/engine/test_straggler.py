"""Straggler detection (``fault.straggler_ratio``; issue 22): a rank slowed by an injected delay is named in
the log and in metrics.jsonl within two log intervals; the rule itself on given times."""
from __future__ import annotations

import io
import json
import os
import time

import torch

from engine.straggler import find_stragglers
from parallel.testing import run_distributed


def test_find_stragglers_against_the_median():
    assert find_stragglers([0.10, 0.11, 0.40, 0.10], ratio=1.5) == [2]  # median 0.105
    assert find_stragglers([0.10, 0.14, 0.12], ratio=1.5) == []
    assert find_stragglers([0.1, 0.5], ratio=1.5) == [1]  # two ranks: the median is their mean, 0.3
    assert find_stragglers([0.2, 0.2, 0.2], ratio=1.01) == []
    # Per pipeline stage: the last stage's loss head is not a straggler; a stage of one rank is never named.
    assert find_stragglers([0.1, 0.1, 0.3, 0.3], ratio=1.5, stage=[0, 0, 1, 1]) == []
    assert find_stragglers([0.1, 0.1, 0.3, 1.2], ratio=1.5, stage=[0, 0, 1, 1]) == [3]
    assert find_stragglers([0.1, 0.9], ratio=1.5, stage=[0, 1]) == []


def _slowed_run(run_dir: str, delay_s: float, from_step: int):
    import torch.distributed as dist

    from engine.assembly import build_run
    from models.hook import ModelHook
    from tests.engine.test_fault import HF, _cfg, _Data

    cfg = _cfg(run_dir, "fault.straggler_ratio=1.5", "train.steps=6", "train.log_interval=2", "checkpoint.interval=0",
               "logging.memory_report=false")
    model = ModelHook.from_hf(HF, dtype=torch.float32, seed=cfg.train.seed, sequence_parallel=False)
    log = io.StringIO()
    run = build_run(cfg, model=model, train_data=_Data(12), run_dir=run_dir, log_stream=log, checkpoints=False)
    tr = run.trainer
    if dist.get_rank() == 1:  # compute that is slow on one rank (inside the step, outside communication)
        tr.chunks[0].register_forward_hook(lambda *_: time.sleep(delay_s) if tr.step >= from_step - 1 else None)
    run.train()
    return log.getvalue()


def test_a_slowed_rank_is_named_within_two_log_intervals(tmp_path):
    run_dir = str(tmp_path / "run")
    log = run_distributed(_slowed_run, 2, run_dir, 0.25, 3, timeout=120)[0]
    records = {r["step"]: r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
               if r["split"] == "train"}
    assert sorted(records) == [1, 2, 4, 6]
    # The delay starts in step 3: the interval ending at step 4 is the first to see it, 6 the second.
    assert records[4]["stragglers"] == [1] and records[6]["stragglers"] == [1], records
    assert records[4]["straggler_compute_s"][0] > 0.25 and records[4]["compute_s_median"] > 0.1
    named = [x for x in log.splitlines() if x.startswith("tessel: straggler at step ")]
    assert named[0].startswith("tessel: straggler at step 4: rank 1 computes "), log
    assert "fault.straggler_ratio=1.5" in named[0] and "rank 0 " not in "".join(named), named
