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
import time

import pytest

from engine.checkpoint.format import list_checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def make_corpus(d) -> str:
    """A byte-tokenized dataset of three engine sources under directory ``d``; returns its prefix."""
    from engine.data.preprocess import preprocess

    texts = [open(os.path.join(ROOT, "engine", name)).read() for name in ("trainer.py", "metrics.py", "fault.py")]
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts * 3))
    preprocess([str(d / "docs.jsonl")], str(d / "text_document"), tokenizer="byte", progress=False)
    return str(d / "text_document")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


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


def _main_in_process(args, capsys):
    """tools/pretrain.py's main() in this process (a refusal in its prepare(), before any process group, is the
    same there as under a launcher and costs no interpreter start): (exit status, stdout, stderr)."""
    from tools.pretrain import main

    capsys.readouterr()
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_another_model_size_and_a_foreign_directory_are_refused(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert _pretrain(_args(corpus, run, "train.steps=1", "checkpoint.interval=0")).returncode == 0
    saved = (run / "config.json").read_bytes()
    code, out, err = _main_in_process(_args(corpus, run, "train.steps=2", "model.hidden_size=64", "model.num_layers=3"),
                                      capsys)
    assert code == 2 and out == "", err[-2000:]
    (line,) = err.splitlines()
    assert len(line) < 700 and "strict=False" not in line and "hidden_size (32 -> 64)" in line, line
    assert "num_hidden_layers (2 -> 3)" in line and "start a new run directory" in line, line
    assert (run / "config.json").read_bytes() == saved  # the refused launch wrote nothing
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    code, _, err = _main_in_process(_args(corpus, foreign, "train.steps=1"), capsys)
    assert code == 2 and "is not a Tessel run" in err, err[-2000:]
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_sbatch_saves_through_sigterm_and_requeues_at_the_time_limit(tmp_path):
    """tools/pretrain.sbatch with stub ``srun``/``scancel``/``scontrol`` (no Slurm here): SIGUSR1
    (``--signal=B:USR1@300``) makes it SIGTERM the step's tasks (``scancel --signal=TERM``) -- pretrain.py's
    save-and-exit-0 path, tested above -- wait for the step, then ``scontrol requeue`` its job and exit 0; a
    preemption (SIGTERM to the script and, from Slurm, to the tasks) waits for the step without requeueing
    (Slurm's ``--requeue`` does). The step gets torchrun with --max-restarts and a fresh store per attempt."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "log"
    (bindir / "srun").write_text(f"""#!/bin/bash
echo "srun $* TORCH_DISABLE_SHARE_RDZV_TCP_STORE=$TORCH_DISABLE_SHARE_RDZV_TCP_STORE" >> {log}
trap 'echo "step got TERM" >> {log}; sleep 0.2; echo "step saved" >> {log}; exit 1' TERM
echo $$ > {tmp_path}/started
while :; do sleep 0.05; done
""")
    (bindir / "scontrol").write_text(f"""#!/bin/bash
if [ "$1" = show ]; then echo node0; else echo "scontrol $*" >> {log}; fi
""")
    (bindir / "scancel").write_text(f"""#!/bin/bash
echo "scancel $*" >> {log}
kill -TERM $(cat {tmp_path}/started)
""")
    for f in bindir.iterdir():
        f.chmod(0o755)
    env = dict(ENV, PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node0", SLURM_JOB_ID="77",
               SLURM_JOB_NAME="t", SLURM_NNODES="1", SLURM_SUBMIT_DIR=str(tmp_path))

    def launch_and_signal(sig):
        (tmp_path / "started").unlink(missing_ok=True)
        log.write_text("")
        proc = subprocess.Popen(["bash", os.path.join(ROOT, "tools", "pretrain.sbatch"), "cfg.toml"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for _ in range(400):
                if (tmp_path / "started").exists() and (tmp_path / "started").read_text().strip():
                    break
                time.sleep(0.01)
            proc.send_signal(sig)
            if sig == signal.SIGTERM:  # a preemption: Slurm signals the step's tasks too
                os.kill(int((tmp_path / "started").read_text()), signal.SIGTERM)
            out, _ = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
        return proc.returncode, out, log.read_text().splitlines()

    rc, out, lines = launch_and_signal(signal.SIGUSR1)
    assert rc == 0, out
    assert "--max-restarts 3" in lines[0] and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in lines[0], lines
    assert "--run-dir runs/t-77" in lines[0], lines
    assert lines[1:] == ["scancel --signal=TERM 77", "step got TERM", "step saved", "scontrol requeue 77"], (lines, out)
    rc, out, lines = launch_and_signal(signal.SIGTERM)
    assert rc == 0 and lines[1:] == ["step got TERM", "step saved"], (lines, out)


def test_posttrain_refuses_a_foreign_directory_and_a_resume_that_breaks_the_run(tmp_path, capsys):
    """tools/posttrain.py runs pretrain.py's run-directory checks, with its own resume keys (the records, the
    method, packing, LoRA; not data.paths), before anything is built. In-process; the run directory's
    checkpoint is the converted base copied in (a run's would do the same)."""
    import shutil

    from engine.checkpoint.format import step_dirname
    from engine.config import load_config
    from engine.fault import POSTTRAIN_RESUME_KEYS, check_run_dir
    from tests.tools.test_posttrain import chat_records, make_hf_dir, overrides, write_chat_tokenizer, write_jsonl
    from tools.convert_checkpoint import hf_to_tessel
    from tools.posttrain import base_defaults, main

    hf = make_hf_dir(tmp_path / "hf", "llama", seed=7)
    write_chat_tokenizer(hf)
    ckpt = hf_to_tessel(hf, tmp_path / "ckpt", tp=1, pp=1)
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "sft.jsonl", chat_records(8, 1))
    write_jsonl(data / "other.jsonl", chat_records(8, 3))

    def sets(run_dir, *extra):
        return overrides(ckpt, data, run_dir, "sft", ("train.steps=1", "train.eval_interval=0", *extra))

    def argv(run_dir, *extra):
        return sum((["--set", s] for s in sets(run_dir, *extra)), []) + ["--run-dir", str(run_dir)]

    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert main(argv(foreign)) == 2
    assert "is not a Tessel run" in capsys.readouterr().err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]

    run = tmp_path / "run"
    shutil.copytree(ckpt, run / "checkpoints")
    ((step, _),) = list_checkpoints(run / "checkpoints")
    load_config(None, sets(run), defaults=base_defaults).to_json(str(run / "config.json"))
    same = load_config(None, sets(run, "train.steps=5", "optim.lr=3e-4"), defaults=base_defaults)
    assert check_run_dir(same, str(run), keys=POSTTRAIN_RESUME_KEYS).endswith(step_dirname(step))  # may resume
    assert main(argv(run, f"posttrain.data={data / 'other.jsonl'}", "posttrain.pack=false")) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "posttrain.data" in line and "other.jsonl" in line and "posttrain.pack (null -> false)" in line, line
    assert "start a new run directory" in line, line
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.json"]  # nothing was written
