"""logging.profile_steps (engine/profiling.py): a pipeline-parallel run on 2 gloo ranks writes, per rank, a
Chrome trace that loads as JSON and holds that rank's own per-layer forward/backward ranges, every chunk's
forward and backward of every micro-batch, the profiled steps and gloo's collectives; and the allocator
statistics. tools/timeline.py draws the run. (pp 2 is the smallest world with ranks holding different layers.)"""
from __future__ import annotations

import json
import os

import pytest

from parallel.testing import run_distributed


def _worker(run_dir):
    from tests.engine.test_memory_report import _build, _cfg

    cfg = _cfg("parallel.tp=1", "parallel.pp=2", "train.steps=2", "train.global_batch_size=4",
               "logging.memory_report=false", "logging.profile_steps=[2, 2]")
    run = _build(cfg, world=2, run_dir=run_dir)
    run.trainer.train(run.train_loader)
    return run.trainer.pp_rank


def test_traces_hold_each_ranks_layer_ranges(tmp_path):
    run_dir = str(tmp_path / "run")
    assert run_distributed(_worker, 2, run_dir, timeout=240) == [0, 1]
    names = {}
    for rank in (0, 1):
        with open(os.path.join(run_dir, "profile", f"trace_rank{rank}.json")) as f:
            events = json.load(f)["traceEvents"]
        names[rank] = {e["name"] for e in events if e.get("ph") == "X"}
        with open(os.path.join(run_dir, "profile", f"memory_rank{rank}.json")) as f:
            mem = json.load(f)
        assert mem["steps"] == [2, 2] and mem["peak_bytes_above_start"] > 0 and mem["top_ops_by_self_cpu_memory"]
    mine = {0: (0, 1), 1: (2, 3)}  # 4 layers over 2 stages
    for rank, layers in mine.items():
        n = names[rank]
        for i in layers:
            assert {f"layer{i}.forward", f"layer{i}.backward", f"layer{i}.attention", f"layer{i}.mlp"} <= n
        for i in mine[1 - rank]:
            assert f"layer{i}.forward" not in n  # the other stage's layers are not here
        assert {"step2", "chunk0.F0", "chunk0.F1", "chunk0.B0", "chunk0.B1"} <= n
        assert "chunk0.F2" not in n  # 2 micro-batches a step, counted per step
        assert any(x.startswith("gloo:") for x in n)  # c10d's collective ranges

    from tools.timeline import main

    png = str(tmp_path / "timeline.png")
    assert main([run_dir, "--out", png]) == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.gpu
def test_profile_steps_on_cuda_record_kernels_ranges_and_allocator_history(tmp_path):
    """On CUDA (tools/gpu_session.sh's test step), one process profiling step 2 of 2: the trace holds the
    per-layer ranges beside the CUDA kernels, and the memory file torch.cuda.memory_stats() and the
    allocator's history (torch.cuda.memory._snapshot(): segments and per-device trace entries)."""
    from tests.engine.test_memory_report import _build, _cfg

    cfg = _cfg("parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "parallel.sequence_parallel=false",
               "train.steps=2", "train.global_batch_size=4", "logging.memory_report=false",
               "logging.profile_steps=[2, 2]")
    run_dir = str(tmp_path / "run")
    run = _build(cfg, world=1, run_dir=run_dir, device="cuda")
    run.trainer.train(run.train_loader)
    with open(os.path.join(run_dir, "profile", "trace_rank0.json")) as f:
        events = json.load(f)["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"step2", "chunk0.F0", "chunk0.F1", "chunk0.B0", "chunk0.B1"} <= names
    assert all({f"layer{i}.forward", f"layer{i}.backward", f"layer{i}.mlp"} <= names for i in range(4))
    assert any(e.get("cat") == "kernel" for e in events)  # the GPU's own kernels, not only the host's ops
    with open(os.path.join(run_dir, "profile", "memory_rank0.json")) as f:
        mem = json.load(f)
    assert mem["steps"] == [2, 2] and mem["memory_stats"]["allocated_bytes.all.peak"] > 0
    assert mem["history"]["segments"] and any(trace for trace in mem["history"]["device_traces"])


def test_a_resumed_run_whose_window_covers_its_first_step_measures_memory_after_it(tmp_path):
    """The memory report measures a process's first step under its own profiler; a resumed run whose profile
    window covers that step would run two profilers at once (it crashed). The measurement moves to the first
    step after the window; the window's trace is written."""
    import signal

    from tests.engine.test_memory_report import _build, _cfg

    cfg = _cfg("parallel.tp=1", "parallel.pp=1", "train.steps=3", "logging.memory_report=true",
               "logging.profile_steps=[2, 2]")
    run = _build(cfg, world=1, run_dir=str(tmp_path))
    run.trainer.step = 1  # what a resume from step 1's checkpoint leaves
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    run.trainer.train(run.train_loader)
    assert run.trainer.step == 3 and run.trainer._memory_measured  # step 3, after the window
    assert os.path.exists(tmp_path / "profile" / "trace_rank0.json")
    with open(tmp_path / "profile" / "memory_rank0.json") as f:
        assert json.load(f)["steps"] == [2, 2]
    # train() gives the signal handlers back (its own would keep the trainer and its model alive)
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_profiled_step_that_raises_stops_the_profiler_and_keeps_other_filters():
    """An exception inside the window stops the profiler and removes its hooks and its one warning filter;
    a filter added by code in the window (or an import) stays after a normal end."""
    import tempfile
    import warnings

    import torch

    from engine.profiling import StepProfiler

    chunks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(4, 4))])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):  # first use imports sympy,
        pass  # which adds its own filter: before the snapshot, so the test holds when run alone too
    before = list(warnings.filters)
    p = StepProfiler((1, 2), run_dir=tempfile.mkdtemp(), rank=0, chunks=chunks, device="cpu")
    with pytest.raises(RuntimeError, match="boom"):
        with p.step(1):
            chunks[0](torch.randn(2, 4)).sum().backward()
            raise RuntimeError("boom")
    assert warnings.filters == before and not torch.autograd.profiler._is_profiler_enabled
    assert not chunks[0]._forward_pre_hooks  # the window's range hooks are gone
    # raised between two steps of the window (a diverged run, a failed save): the trainer's abort() stops it
    p = StepProfiler((1, 2), run_dir=tempfile.mkdtemp(), rank=0, chunks=chunks, device="cpu")
    with p.step(1):
        chunks[0](torch.randn(2, 4)).sum().backward()
    assert torch.autograd.profiler._is_profiler_enabled
    p.abort()
    assert warnings.filters == before and not torch.autograd.profiler._is_profiler_enabled
    assert not chunks[0]._forward_pre_hooks and not os.path.exists(p.dir)  # nothing written
    p = StepProfiler((1, 1), run_dir=tempfile.mkdtemp(), rank=0, chunks=chunks, device="cpu")
    with p.step(1):
        chunks[0](torch.randn(2, 4)).sum().backward()
        warnings.filterwarnings("error", category=DeprecationWarning, module="some_library")
    assert warnings.filters[0][3] is not None and warnings.filters[0][0] == "error"  # still there
    warnings.filters.remove(warnings.filters[0])


def test_a_window_past_the_last_step_records_the_steps_profiled_and_says_memory_was_not_measured(tmp_path):
    """A window [2, 5] in a 2-step resumed run: the files name steps [2, 2] (what was profiled), and the log
    says why the memory report measured nothing (no step of this process ran outside the window)."""
    import io

    from tests.engine.test_memory_report import _cfg
    from engine.assembly import build_run
    from models.hook import ModelHook
    from tests.engine.test_memory_report import _Tokens

    cfg = _cfg("parallel.tp=1", "parallel.pp=1", "train.steps=2", "logging.memory_report=true",
               "logging.profile_steps=[2, 5]")
    log = io.StringIO()
    run = build_run(cfg, model=ModelHook.from_run_config(cfg, tokenizer_vocab=None), train_data=_Tokens(32),
                    checkpoints=False, world=1, run_dir=str(tmp_path), log_stream=log)
    run.trainer.step = 1
    run.trainer.train(run.train_loader)
    with open(tmp_path / "profile" / "memory_rank0.json") as f:
        assert json.load(f)["steps"] == [2, 2]
    assert "memory: not measured: every step this process ran was inside logging.profile_steps" in log.getvalue()
