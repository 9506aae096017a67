"""Fault tolerance in the engine (issue 22), each a wrong case reproduced and now right:

* a crash after a checkpoint: the relaunch removes the temporary directories of saves that never
  committed (before it saves anything), resumes, cuts metrics.jsonl back to the resumed step (no step is
  logged twice) and re-runs the lost steps with bitwise the same losses;
* metrics.jsonl is strict JSON: a non-finite number is written as null;
* a resume that changes the model, the data, the global batch or the sequence length is refused in one
  line naming the keys and the way out; steps, the LR schedule and logging may change; a non-empty
  directory that is not a Tessel run is refused;
* the collective timeout (``fault.collective_timeout_s``) reaches every group of the mesh: a collective
  whose peer never comes raises after it, instead of hanging for 30 minutes;
* the TP hint names sizes that divide the heads, the kv heads and the ffn size together.
"""
from __future__ import annotations

import json
import math
import os
import signal
import time

import numpy as np
import pytest
import torch

from parallel.testing import run_distributed

SEQ, VOCAB = 16, 64
HF = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 64,
      "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


class _Data:
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = np.random.default_rng(7 + i).integers(0, VOCAB, SEQ + 1)
        return {"tokens": ids[:-1], "labels": ids[1:], "position_ids": np.arange(SEQ),
                "loss_mask": np.ones(SEQ, dtype=np.float32)}


def _cfg(run_dir, *extra):
    from engine.config import load_config

    return load_config("tiny_llama_cpu", [
        "parallel.tp=1", "parallel.pp=1", "optim.distributed=false", "train.steps=5", "train.global_batch_size=2",
        "train.micro_batch_size=1", f"train.seq_length={SEQ}", "train.eval_interval=0", "train.log_interval=1",
        "optim.warmup_steps=0", "checkpoint.interval=2", "checkpoint.keep_last=none", "logging.tensorboard=false",
        "logging.progress_bar=off", "logging.peak_tflops=1.0", f"train.run_dir={run_dir}", "data.num_workers=0",
        *extra])


def _build(cfg, run_dir):
    from engine.assembly import build_run
    from models.hook import ModelHook

    model = ModelHook.from_hf(HF, dtype=torch.float32, seed=cfg.train.seed, sequence_parallel=False)
    return build_run(cfg, model=model, train_data=_Data(cfg.train.steps * cfg.train.global_batch_size),
                     run_dir=str(run_dir), log_stream=open(os.devnull, "w"))


@pytest.fixture
def keep_signal_handlers():
    """Trainer.train installs SIGTERM/SIGINT handlers; give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


class _Crash(Exception):
    pass


def _steps(run_dir):
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r["split"] == "train"]


def test_a_crash_after_a_checkpoint_resumes_cleanly(tmp_path, keep_signal_handlers):
    run_dir = tmp_path / "run"
    first = _build(_cfg(run_dir), run_dir)
    losses = {}

    def crash_at_3(tr, st):
        losses[st.step] = st.loss
        if st.step == 3:  # after the step-2 checkpoint and the step-3 log line
            raise _Crash
    with pytest.raises(_Crash):
        first.train(on_step=crash_at_3)
    first.trainer.logger.close()
    assert _steps(run_dir) == [1, 2, 3]
    ckpts = run_dir / "checkpoints"
    # What crashed saves leave behind: a temporary directory with a partial shard, a retention's trash.
    for name in (".tmp_step_00000004_0123abcd", ".trash_step_00000001_deadbeef"):
        (ckpts / name).mkdir()
        (ckpts / name / "rank_00000.safetensors").write_bytes(b"\0" * 4096)
    second = _build(_cfg(run_dir), run_dir)
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]  # at start-up, before saving
    assert second.resume().endswith("step_00000002") and second.trainer.step == 2
    assert _steps(run_dir) == [1, 2]  # cut back to the resumed step
    again = {}
    second.train(on_step=lambda tr, st: again.__setitem__(st.step, st.loss))
    assert _steps(run_dir) == [1, 2, 3, 4, 5]  # each step once
    assert again[3] == losses[3]  # the lost step re-runs bitwise


def test_nonfinite_numbers_are_written_as_null(tmp_path):
    from engine.metrics import MetricsLogger

    log = MetricsLogger(str(tmp_path), enabled=True, total_steps=2, tensorboard=False, progress_bar="off",
                        stream=open(os.devnull, "w"))
    record = {"step": 1, "loss": float("nan"), "lr": 1e-3, "grad_norm": float("inf"), "tokens_per_s": 1.0,
              "tflops_per_device": 1.0, "mfu": 0.5, "mem_bytes": 0, "extra": [float("-inf"), 1.0]}
    log.log(record)
    log.log({"step": 1, "loss": float("nan")}, prefix="valid")
    log.close()

    def strict(name):
        raise ValueError(f"not strict JSON: {name}")
    lines = [json.loads(x, parse_constant=strict) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["loss"] is None and lines[0]["grad_norm"] is None and lines[0]["extra"] == [None, 1.0]
    assert lines[0]["lr"] == 1e-3 and lines[1] == {"split": "valid", "step": 1, "loss": None}
    assert math.isnan(record["loss"])  # the caller's record is left as it was


def test_metrics_rewind_drops_later_steps_and_a_torn_line(tmp_path):
    from engine.metrics import MetricsLogger

    lines = [{"split": "train", "step": s} for s in (1, 2, 3)] + [{"split": "valid", "step": 2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"split": "tr')
    log = MetricsLogger(str(tmp_path), enabled=True, total_steps=4, tensorboard=False, progress_bar="off",
                        stream=open(os.devnull, "w"))
    log.rewind(2)
    log.log({"step": 3, "loss": 1.0}, prefix="valid")
    log.close()
    got = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["split"], r["step"]) for r in got] == [("train", 1), ("train", 2), ("valid", 2), ("valid", 3)]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run directory with a complete checkpoint (no training loop: one save at step 0)."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    run = _build(_cfg(run_dir, "data.paths=/data/a", "data.tokenizer=none"), run_dir)
    run.save()
    run.trainer.logger.close()
    return run_dir, run.model.hf_config


def test_a_resume_that_breaks_the_run_is_refused_in_one_line(saved_run):
    from engine.fault import check_run_dir

    run_dir, hf = saved_run
    base = ["data.paths=/data/a", "data.tokenizer=none"]
    # Harmless: steps, the LR schedule, logging, the layout's optimizer mode, the micro-batch size.
    fine = _cfg(run_dir, *base, "train.steps=50", "optim.lr=1e-3", "optim.decay_style=linear", "train.log_interval=7",
                "checkpoint.interval=5", "optim.distributed=true", "train.micro_batch_size=2")
    assert check_run_dir(fine, str(run_dir), model_config=hf).endswith("step_00000000")
    with pytest.raises(ValueError) as err:
        check_run_dir(_cfg(run_dir, "data.paths=/data/b", "data.tokenizer=none", "train.seq_length=8",
                           "train.global_batch_size=4"), str(run_dir), model_config={**hf, "hidden_size": 64})
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < 800 and "strict=False" not in msg
    for key in ("model hidden_size (32 -> 64)", 'data.paths (["/data/a"] -> ["/data/b"])', "train.seq_length (16 -> 8)",
                "train.global_batch_size (2 -> 4)", "start a new run directory"):
        assert key in msg, msg
    assert "checkpoint.load" not in msg  # the weights do not fit another model
    with pytest.raises(ValueError, match=r"train.seed \(1234 -> 5\); start a new run directory \(--run-dir NEW\), "
                                         r"with --set checkpoint.load=.*step_00000000 to start from its weights"):
        check_run_dir(_cfg(run_dir, *base, "train.seed=5"), str(run_dir), model_config=hf)


def test_a_foreign_directory_is_refused(tmp_path):
    from engine.fault import check_run_dir

    cfg = _cfg(tmp_path / "x")
    assert check_run_dir(cfg, str(tmp_path / "new")) is None  # a fresh directory: a fresh start
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text('{"name": "not tessel"}')
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"is not empty \(config.json, notes.txt\) and is not a Tessel run"):
        check_run_dir(cfg, str(tmp_path / "mine"))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        check_run_dir(cfg, str(tmp_path / "file"))


def _timeout_part(timeout_s: float):
    import torch.distributed as dist

    from parallel import comm
    from parallel.mesh import Mesh, ParallelDims

    mesh = Mesh.build(ParallelDims(dp=2), timeout_s=timeout_s)
    if dist.get_rank() == 1:
        time.sleep(timeout_s + 2)  # a stopped peer: never enters the collective
        return None
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1), mesh.dp)
    except RuntimeError as e:
        return time.monotonic() - start, str(e)[:200]
    return "no timeout"


def test_collective_timeout_reaches_the_mesh_groups():
    elapsed, msg = run_distributed(_timeout_part, 2, 1.0, timeout=60)[0]
    assert 0.9 < elapsed < 2.9 and "Timed out" in msg, (elapsed, msg)  # new groups' default: 30 minutes


def test_tp_hint_divides_heads_kv_heads_and_ffn():
    from engine.config import load_config
    from models.hook import ModelHook

    with pytest.raises(ValueError, match=r"model.num_attention_heads=4 is not divisible by parallel.tp=8 .* "
                                         r"num_key_value_heads=2, ffn_hidden_size=352: one of 1, 2$"):
        load_config("tiny_llama_cpu", ["parallel.tp=8"])
    with pytest.raises(ValueError, match=r"num_key_value_heads=4 is not divisible by parallel.tp=3 .*: "
                                         r"one of 1, 2, 4$"):
        load_config("tiny_llama_cpu", ["parallel.tp=3", "model.num_attention_heads=12", "model.num_key_value_heads=4",
                                       "model.hidden_size=96", "model.ffn_hidden_size=48"])
    # An architecture from model.hf_config is checked by models/ with the same hint.
    cfg = load_config("tiny_llama_cpu", ["parallel.tp=1"])
    hook = ModelHook.from_run_config(cfg, tokenizer_vocab=None)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor-parallel size 8; .*: "
                                         "one of 1, 2$"):
        hook.config.check_tensor_parallel(8)


def test_fault_and_max_skipped_steps_config():
    from engine.config import load_config

    cfg = load_config("tiny_llama_cpu", ["fault.collective_timeout_s=30", "optim.max_skipped_steps=none"])
    assert cfg.fault.collective_timeout_s == 30.0 and cfg.optim.max_skipped_steps is None
    for sets, fragment in ((["fault.collective_timeout_s=0"], "fault.collective_timeout_s=0.0 must be > 0"),
                           (["fault.hang_timeout_s=700"], "fault.hang_timeout_s=700 must be below "
                                                           "fault.collective_timeout_s=600"),
                           (["fault.flight_records=0"], "fault.flight_records=0 must be >= 1"),
                           (["fault.straggler_ratio=0.5"], "fault.straggler_ratio=0.5 must be > 1"),
                           (["fault.hang_timeout=10"], "unknown key 'hang_timeout' in section [fault]"),
                           (["optim.max_skipped_steps=-1"], "optim.max_skipped_steps=-1 must be >= 0"),
                           (["optim.nonfinite=stop", "optim.max_skipped_steps=3"],
                            "applies to optim.nonfinite='skip'")):
        with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("(", r"\(")):
            load_config("tiny_llama_cpu", sets)


def test_keep_every_keeps_milestones_beside_keep_last(tmp_path):
    """Retention with ``keep_last=2, keep_every=4`` over saves at steps 2, 4, ..., 14: the two newest plus the
    multiples of 4 stay; the key is validated before anything is saved."""
    from engine.checkpoint import Checkpointer, ShardedTensor, list_checkpoints
    from engine.config.sections import CheckpointConfig

    ck = Checkpointer(tmp_path / "ck", keep_last=2, keep_every=4)
    for step in range(2, 16, 2):
        ck.save(step=step, tensors=[ShardedTensor.replicated("w", torch.full((3,), float(step)))])
    assert [s for s, _ in list_checkpoints(tmp_path / "ck")] == [4, 8, 12, 14]
    with pytest.raises(ValueError, match="keep_every=3 without keep_last"):
        Checkpointer(tmp_path / "x", keep_every=3)
    assert CheckpointConfig(interval=10, keep_last=2, keep_every=100).keep_every == 100
    with pytest.raises(ValueError, match=r"checkpoint.keep_every=25 is not a multiple of checkpoint.interval=10"):
        CheckpointConfig(interval=10, keep_last=2, keep_every=25)
    with pytest.raises(ValueError, match=r"checkpoint.keep_every=100 without checkpoint.keep_last"):
        CheckpointConfig(interval=10, keep_every=100)


@pytest.mark.parametrize("tool", ["pretrain", "posttrain", "evaluate", "generate"])
def test_a_usage_error_is_said_once_under_torchrun(tool, monkeypatch, capsys):
    """Every rank parses the same command line: rank 0 prints argparse's usage and error, the others
    print nothing, and all exit 2 (the torchrun tools' parsers are OnceArgumentParser)."""
    import importlib

    import engine.fault as fault

    monkeypatch.setattr(fault, "SAY_ONCE_GRACE_S", 0.0)
    parser = importlib.import_module(f"tools.{tool}").build_parser() if tool in ("evaluate", "generate") else None
    for rank, says in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as info:
            if parser is not None:
                parser.parse_args(["--no-such-flag"])
            else:
                importlib.import_module(f"tools.{tool}").main(["--no-such-flag"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert ("error: " in err and "usage:" in err) == says, (rank, err)
        if not says:
            assert err == ""


@pytest.mark.parametrize("stop", [["optim.nonfinite=stop"], ["optim.nonfinite=skip", "optim.max_skipped_steps=0"]])
def test_a_divergence_keeps_the_async_save_started_before_it(tmp_path, keep_signal_handlers, stop):
    """An asynchronous save of step 2, then a NaN in step 3: whether the run stops at once
    (optim.nonfinite="stop") or at the skip limit, the save, made before the divergence, commits, and is
    what a relaunch resumes from (a .tmp_ directory left behind would be removed at start-up)."""
    from engine.checkpoint.format import list_checkpoints
    from engine.fault import RunStopped
    from engine.optim import NonFiniteGradError

    run_dir = tmp_path / "run"
    run = _build(_cfg(run_dir, "checkpoint.async_save=true", "fault.nan_replay=false", *stop), run_dir)
    tr = run.trainer
    nan_in_step(tr, 3)
    with pytest.raises((NonFiniteGradError, RunStopped)):
        run.train()
    tr.logger.close()
    ckpts = run_dir / "checkpoints"
    assert [s for s, _ in list_checkpoints(str(ckpts))] == [2]
    assert not [p.name for p in ckpts.iterdir() if p.name.startswith(".tmp_")]


def nan_in_step(tr, step: int) -> None:
    """A NaN in layer 1's output in ``step`` of ``tr`` (a replay of that step sees it again)."""
    def inject(mod, inputs, output):
        if tr.step == step - 1:
            output = output.clone()
            output.view(-1)[5] = float("nan")
        return output
    tr.chunks[0].layers["1"].register_forward_hook(inject)


def _crash_at_3_and_resume(build, run_dir):
    """A run built by ``build(run_dir)`` crashes after step 3's log line (its last save: step 2); a
    relaunch of it, resumed."""
    first = build(run_dir)

    def crash_at_3(tr, st):
        if st.step == 3:
            raise _Crash
    with pytest.raises(_Crash):
        first.train(on_step=crash_at_3)
    first.trainer.logger.close()
    second = build(run_dir)
    second.resume()
    return second


class _Valid(_Data):
    def __getitem__(self, i):
        ids = np.random.default_rng(1000 + i).integers(0, VOCAB, SEQ + 1)
        return {"tokens": ids[:-1], "labels": ids[1:], "position_ids": np.arange(SEQ),
                "loss_mask": np.ones(SEQ, dtype=np.float32)}


def test_a_resume_continues_the_validation_batches(tmp_path, keep_signal_handlers):
    """Each evaluation reads the next validation batches: after a crash at step 3 and a resume from step 2,
    step 4's evaluation reads the batches the uninterrupted run's step 4 read (the position is saved),
    not the first ones again, so the logged validation losses are the same."""
    from engine.assembly import build_run
    from models.hook import ModelHook

    def build(run_dir):
        cfg = _cfg(run_dir, "train.eval_interval=2", "train.eval_iters=1", "logging.memory_report=false")
        model = ModelHook.from_hf(HF, dtype=torch.float32, seed=cfg.train.seed, sequence_parallel=False)
        return build_run(cfg, model=model, train_data=_Data(10), valid_data=_Valid(6), run_dir=str(run_dir),
                         log_stream=open(os.devnull, "w"))

    def valid(run_dir):
        return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                if r["split"] == "valid"}

    full = build(tmp_path / "full")
    full.train()
    full.trainer.logger.close()
    second = _crash_at_3_and_resume(build, tmp_path / "run")
    assert second.valid_loader.consumed_samples == 2  # step 2's evaluation: one global batch of 2
    second.train()
    second.trainer.logger.close()
    assert valid(tmp_path / "run") == valid(tmp_path / "full") and sorted(valid(tmp_path / "full")) == [2, 4]


def test_a_restart_inside_a_streak_of_skipped_steps_keeps_counting(tmp_path, keep_signal_handlers):
    """optim.max_skipped_steps counts consecutive skipped steps across a restart: checkpoints are still
    written during the streak, and one resumed from inside it must stop where the uninterrupted run stops
    (steps 2-4 skipped with a limit of 2: step 4), not count the streak from 0 again."""
    from engine.fault import RunStopped

    def build(run_dir):
        cfg = _cfg(run_dir, "optim.lr=1e30", "optim.max_skipped_steps=2", "checkpoint.interval=1", "train.steps=9",
                   "logging.memory_report=false", "fault.nan_replay=false")
        from engine.assembly import build_run
        from models.hook import ModelHook

        model = ModelHook.from_hf(HF, dtype=torch.float32, seed=cfg.train.seed, sequence_parallel=False)
        return build_run(cfg, model=model, train_data=_Data(18), run_dir=str(run_dir), log_stream=open(os.devnull, "w"))

    full = build(tmp_path / "full")
    with pytest.raises(RunStopped, match="stopped at step 4: 3 consecutive steps \\(2-4\\)"):
        full.train()
    second = _crash_at_3_and_resume(build, tmp_path / "run")
    assert second.trainer.step == 2 and second.trainer.skipped_streak == 1  # step 2's save: step 2 skipped
    with pytest.raises(RunStopped, match="stopped at step 4: 3 consecutive steps \\(2-4\\)"):
        second.train()


def test_a_commit_cut_between_its_renames_is_rolled_forward(tmp_path):
    """Re-saving step N moves the old step_N to the trash, then the new temporary directory into place: a
    kill between the two renames left no step_N, and start-up deleted both. A temporary directory holding a
    complete checkpoint (metadata.json is written last) whose step has no directory is moved into place
    (and ``latest`` with it when it is the newest); an incomplete one is still removed."""
    from engine.checkpoint import Checkpointer
    from engine.checkpoint.format import list_checkpoints
    from engine.checkpoint.sharded import ShardedTensor
    from engine.fault import remove_stale_saves

    root = tmp_path / "ck"
    ck = Checkpointer(str(root), async_save=False)
    for step in (1, 2):
        ck.save(step=step, tensors=[ShardedTensor.replicated("w", torch.full((4,), float(step)))])
    ck.finalize()
    # the cut commit of a re-save of step 2: the old one in the trash, the new one still temporary
    os.rename(root / "step_00000002", root / ".trash_step_00000002_0badc0de")
    os.rename(root / "step_00000001", root / ".tmp_step_00000002_feedface")  # complete, metadata says step 1
    assert [s for s, _ in list_checkpoints(root)] == []
    # a complete save of step 1's content under step 2's temporary name is not step 2's: only a directory
    # whose metadata names its own step is rolled forward
    remove_stale_saves(root)
    assert sorted(p.name for p in root.iterdir()) == ["latest"]
    ck = Checkpointer(str(root), async_save=False)
    ck.save(step=3, tensors=[ShardedTensor.replicated("w", torch.full((4,), 3.0))])
    ck.finalize()
    os.rename(root / "step_00000003", root / ".tmp_step_00000003_feedface")
    (root / ".tmp_step_00000004_0123abcd").mkdir()  # a save cut before its metadata: removed
    (root / "latest").write_text("step_00000001\n")
    remove_stale_saves(root)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000003"]
    assert (root / "latest").read_text() == "step_00000003\n"
