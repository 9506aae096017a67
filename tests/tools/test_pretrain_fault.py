"""tools/pretrain.py under faults and bad launches (issue 22), each through the command line:

* a diverged run (every gradient non-finite after an lr of 1e30) stops after ``optim.max_skipped_steps``
  consecutive skipped steps with exit status 3 and one line, saves nothing, and its metrics.jsonl is
  strict JSON; ``optim.nonfinite = stop`` on 2 ranks says its one line once (no traceback per rank);
* SIGTERM saves and exits 0, and the relaunch resumes from that checkpoint, each step logged once;
* a relaunch with another model size is refused in one short line (no shape list, no strict=False);
* a non-empty directory that is not a Tessel run is refused and left as it was.

Single-process runs start tools/pretrain.py directly (no torchrun: the process group stays uninitialised).
"""
import json
import os
import signal
import subprocess
import sys

import pytest

from engine.checkpoint.format import list_checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from engine.data.preprocess import preprocess

    d = tmp_path_factory.mktemp("corpus")
    texts = [open(os.path.join(ROOT, "engine", name)).read() for name in ("trainer.py", "metrics.py", "fault.py")]
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts * 3))
    preprocess([str(d / "docs.jsonl")], str(d / "text_document"), tokenizer="byte", progress=False)
    return str(d / "text_document")


def _args(corpus, run_dir, *extra):
    sets = [f"data.paths={corpus}", f"data.tokenizer={corpus}.tokenizer.json", "model.vocab_size=257",
            "model.hidden_size=32", "model.num_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
            "model.ffn_hidden_size=64", "model.max_position_embeddings=64", "train.seq_length=32",
            "train.global_batch_size=2", "train.micro_batch_size=1", "train.eval_interval=0", "train.log_interval=1",
            "optim.warmup_steps=0", "parallel.tp=1", "parallel.pp=1", "optim.distributed=false",
            "logging.tensorboard=false", "logging.progress_bar=off", "logging.peak_tflops=1.0", "data.num_workers=0",
            f"data.cache_dir={os.path.dirname(corpus)}/cache", *extra]
    return ["--config", "tiny_llama_cpu", "--run-dir", str(run_dir), *sum((["--set", s] for s in sets), [])]


def _pretrain(args, nproc=None):
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc else []
    cmd = [sys.executable, *launcher, os.path.join(ROOT, "tools", "pretrain.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=180)


def _metrics(run_dir):
    def strict(name):
        raise ValueError(f"not strict JSON: {name}")
    return [json.loads(x, parse_constant=strict) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_diverged_run_exits_nonzero_with_one_line(corpus, tmp_path):
    run = tmp_path / "run"
    r = _pretrain(_args(corpus, run, "train.steps=20", "optim.lr=1e30", "optim.max_skipped_steps=2",
                        "checkpoint.interval=0"))
    assert r.returncode == 3, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines[-1] == ("pretrain.py: stopped at step 4: 3 consecutive steps (2-4) had a non-finite gradient norm "
                         "and were skipped, more than optim.max_skipped_steps=2: the run diverged; resume from a "
                         "checkpoint before the divergence with a lower optim.lr or more optim.warmup_steps, or raise "
                         "optim.max_skipped_steps"), r.stderr[-2000:]
    # Before it, one warning per skipped step (the optimizer's), and no traceback.
    assert sum(x.endswith("skipping this step") for x in lines) == 3 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert list_checkpoints(run / "checkpoints") == []  # a diverged state is not saved
    records = [m for m in _metrics(run) if m["split"] == "train"]  # strict JSON: the nan losses are null
    assert [m["step"] for m in records] == [1, 2, 3, 4] and records[-1]["loss"] is None


def test_nonfinite_stop_says_one_line_on_two_ranks(corpus, tmp_path):
    r = _pretrain(_args(corpus, tmp_path / "run", "train.steps=20", "optim.lr=1e30", "optim.nonfinite=stop",
                        "checkpoint.interval=0"), nproc=2)
    assert r.returncode != 0
    assert r.stderr.count("non-finite gradient norm (nan) at update 1") == 1, r.stderr[-3000:]
    assert "pretrain.py: non-finite gradient norm" in r.stderr
    # torchrun reports the failed worker with its own frame; no worker prints a traceback.
    assert os.path.join(ROOT, "engine") not in r.stderr and "NonFiniteGradError" not in r.stderr, r.stderr[-3000:]


def test_sigterm_saves_exits_0_and_the_relaunch_resumes(corpus, tmp_path):
    run = tmp_path / "run"
    args = _args(corpus, run, "train.steps=2000", "checkpoint.interval=0")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "pretrain.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        for line in proc.stdout:
            if line.startswith("step     3 "):
                proc.send_signal(signal.SIGTERM)
                break
        out = line + proc.stdout.read()
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = [x for x in out.splitlines() if x.startswith("tessel: stopping after step")]
    assert len(stopped) == 1 and stopped[0].endswith("on SIGTERM (checkpoint saved)"), out[-2000:]
    step = int(stopped[0].split()[4])
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [step]
    r = _pretrain(_args(corpus, run, f"train.steps={step + 2}", "checkpoint.interval=0"))  # steps: harmless
    assert r.returncode == 0 and f"at step {step}" in r.stdout, r.stderr[-2000:]
    assert [m["step"] for m in _metrics(run) if m["split"] == "train"] == list(range(1, step + 3))


def test_another_model_size_and_a_foreign_directory_are_refused(corpus, tmp_path):
    run = tmp_path / "run"
    assert _pretrain(_args(corpus, run, "train.steps=1", "checkpoint.interval=0")).returncode == 0
    saved = (run / "config.json").read_bytes()
    r = _pretrain(_args(corpus, run, "train.steps=2", "model.hidden_size=64", "model.num_layers=3"))
    assert r.returncode == 2 and r.stdout == "", r.stderr[-2000:]
    (line,) = r.stderr.splitlines()
    assert len(line) < 700 and "strict=False" not in line and "hidden_size (32 -> 64)" in line, line
    assert "num_hidden_layers (2 -> 3)" in line and "start a new run directory" in line, line
    assert (run / "config.json").read_bytes() == saved  # the refused launch wrote nothing
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    r = _pretrain(_args(corpus, foreign, "train.steps=1"))
    assert r.returncode == 2 and "is not a Tessel run" in r.stderr, r.stderr[-2000:]
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
