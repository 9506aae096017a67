"""In-job restart under torchrun (issue 22): ranks killed with SIGKILL mid-run, ``--max-restarts N``.

torchrun restarts every worker; each resumes from the newest complete checkpoint (``Run.resume``), and the
process groups of the new attempt rendezvous under their own store prefix (``parallel.mesh.attempt_store``:
without it the restarted workers read the dead attempt's gloo addresses and fail in connectFullMesh). The
run completes with exit status 0 and its metrics.jsonl -- each step once, the re-run steps rewound -- holds
losses bitwise equal to an uninterrupted run's.

CI runs a 4-rank job (pp=2 x dp=2) with rank 2 SIGKILLed once under ``--max-restarts 1``, and one 2-rank job
(dp=2) killed 5 times during its saves (one job covers the crash while saving and ``checkpoint.peer_replica``: a
restart whose replicas are of the newest commit loads them from the peers' /dev/shm and opens no checkpoint file,
counted by an audit hook in every worker). Recovery times are measured by hand:
``python tests/tools/test_restart.py 4 2 2`` (docs/fault_tolerance.md).
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests.tools.test_pretrain_fault import make_corpus

    return make_corpus(tmp_path_factory.mktemp("corpus"))


def pretrain_args(corpus, run_dir, *extra):
    sets = [f"data.paths={corpus}", f"data.tokenizer={corpus}.tokenizer.json", "model.vocab_size=257",
            "model.hidden_size=32", "model.num_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
            "model.ffn_hidden_size=64", "model.max_position_embeddings=64", "train.seq_length=32",
            "train.global_batch_size=4", "train.micro_batch_size=1", "train.eval_interval=0", "train.log_interval=1",
            "optim.warmup_steps=0", "parallel.tp=1", "parallel.pp=1", "optim.distributed=false",
            "logging.tensorboard=false", "logging.progress_bar=off", "logging.peak_tflops=1.0",
            "logging.memory_report=false", "data.num_workers=0", f"data.cache_dir={os.path.dirname(corpus)}/cache",
            *extra]
    return ["--config", "tiny_llama_cpu", "--run-dir", str(run_dir), *sum((["--set", s] for s in sets), [])]


def torchrun_cmd(nproc, args, *, max_restarts=0):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", os.path.join(ROOT, "tools", "pretrain.py"), *args]


def train_losses(run_dir):
    """{step: loss} of metrics.jsonl (strict JSON; a step logged twice is an error)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m.get("split") == "train":
            assert m["step"] not in out, f"step {m['step']} logged twice"
            out[m["step"]] = m["loss"]
    return out


def logged_step(run_dir) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(x)["step"] for x in lines[:-1] if '"split": "train"' in x]  # the last line may be torn
    return max(steps, default=0)


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker with RANK=rank (Linux /proc)."""
    for task in os.listdir(f"/proc/{launcher_pid}/task"):
        try:
            children = open(f"/proc/{launcher_pid}/task/{task}/children").read().split()
        except OSError:
            continue
        for pid in map(int, children):
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return pid
    return None


def kill_rank_after(proc, run_dir, *, rank: int, after_step: int, timeout_s: float = 120) -> int:
    """SIGKILL torchrun's worker ``rank`` once metrics.jsonl shows ``after_step``; returns the step seen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before the kill"
        step = logged_step(run_dir)
        if step >= after_step:
            pid = worker_pid(proc.pid, rank)
            assert pid is not None, f"no worker with RANK={rank}"
            os.kill(pid, 9)
            return step
        time.sleep(0.02)
    raise AssertionError(f"step {after_step} not reached in {timeout_s} s")


def run_and_kill(corpus, run_dir, *, nproc, rank, after_step, extra=()):
    """One torchrun job with --max-restarts 1, rank ``rank`` SIGKILLed after ``after_step``: (returncode, stderr,
    the step logged when the kill was sent, seconds from the kill to the job's end)."""
    proc = subprocess.Popen(torchrun_cmd(nproc, pretrain_args(corpus, run_dir, *extra), max_restarts=1),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        seen = kill_rank_after(proc, run_dir, rank=rank, after_step=after_step)
        killed_at = time.monotonic()
        _, err = proc.communicate(timeout=240)
        return proc.returncode, err, seen, time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()


STEPS = 10


# No gradient clipping: the pipeline's grad norm sums its stages' squares in another order than one stage does, so
# with clipping a pp=2 run's updates would differ from a pp=1 run's in the last bit. Without it, pp=2 x dp=2 computes
# what dp=2 does, bit for bit (the same micro-batches in the same order; each dp sum has two terms), and both jobs
# below compare with one uninterrupted run.
UNCLIPPED = "optim.clip_grad=0"


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    """{step: loss} of an uninterrupted 2-rank run (dp=2; no checkpoints: saving must not change a loss)."""
    base = tmp_path_factory.mktemp("base")
    r = subprocess.run(torchrun_cmd(2, pretrain_args(corpus, base, f"train.steps={STEPS}", "checkpoint.interval=0",
                                                     UNCLIPPED)),
                       capture_output=True, text=True, env=ENV, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = train_losses(base)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def test_kill_9_one_of_4_ranks_under_max_restarts_1(corpus, uninterrupted, tmp_path):
    """pp=2 x dp=2 on 4 ranks, a checkpoint every 3 steps; rank 2 (a first-stage rank of the second replica) is
    SIGKILLed after step 4 under ``--max-restarts 1``: torchrun restarts the group, every rank resumes from step 3
    under a fresh store prefix, and the job ends with exit 0 and the uninterrupted dp=2 run's losses, bitwise, each
    step logged once. (Until 2026-11-28 this was tp=2 x dp=2 against a 4-rank uninterrupted run of its own, 15 s
    more; pp=2 x dp=2 equals dp=2 bitwise without clipping, so the shared run serves. TP's resume is exact in
    tests/engine/checkpoint/test_trainer_resume.py.)"""
    extra = (f"train.steps={STEPS}", "checkpoint.interval=3", "parallel.pp=2", UNCLIPPED)
    code, err, seen, _ = run_and_kill(corpus, tmp_path / "run", nproc=4, rank=2, after_step=4, extra=extra)
    assert code == 0, err[-3000:]
    assert "connectFullMesh" not in err
    assert seen < STEPS and train_losses(tmp_path / "run") == uninterrupted


# Installed in every torchrun worker through PYTHONPATH: records each file (not directory) the process opens under
# TESSEL_AUDIT_DIR until Run.resume's "tessel.resumed" audit event, then writes them to TESSEL_AUDIT_OUT.
AUDIT_HOOK = """
import json, os, sys
_dir, _out = os.environ.get("TESSEL_AUDIT_DIR"), os.environ.get("TESSEL_AUDIT_OUT")
if _dir and _out:
    _opened, _done = [], []
    def _hook(event, args):
        if _done:
            return
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            # files only: removing a crashed save's directory (rmtree) opens directories, no file
            if os.path.abspath(path).startswith(_dir + os.sep) and not os.path.isdir(path):
                _opened.append(os.path.relpath(path, _dir))
        elif event == "tessel.resumed":
            _done.append(1)
            rec = {"pid": os.getpid(), "rank": int(os.environ.get("RANK", "0")),
                   "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "source": args[0],
                   "files_opened": args[1], "opened": _opened}
            with open(os.path.join(_out, f"resume.{os.getpid()}.json"), "w") as f:
                json.dump(rec, f)
    sys.addaudithook(_hook)
"""


def test_kill_9_during_saves_5_times_each_restart_resumes_the_newest_complete(corpus, uninterrupted, tmp_path):
    """One torchrun job (2 ranks, --max-restarts 5, a synchronous save after every step); 5 times a random rank is
    SIGKILLed a random 0-30 ms after a save's temporary directory appeared (so mid-write or mid-commit; the save
    of the step after the attempt's resume or of the one after, at random), from the first complete checkpoint
    on. Each attempt resumes from the newest complete checkpoint at the time of
    the kill, no temporary directory is left, and the losses match the uninterrupted run's bitwise. The seed
    (``TESSEL_FAULT_SEED``, default 22) picks the ranks and delays and is named in every failure.

    With ``checkpoint.peer_replica = true``: a restart whose replicas are of the newest commit (a kill before
    the commit of the save in flight) loads from the peers' /dev/shm copies, and an audit hook in every worker
    sees no file of the checkpoint directory opened before the resume; a kill after the commit but before the
    replication finished leaves stale replicas, and that restart falls back to the disk (logged, files opened).
    The replicas are removed at the clean exit."""
    import random

    from engine.checkpoint.format import TMP_PREFIX, list_checkpoints

    seed = int(os.environ.get("TESSEL_FAULT_SEED", "22"))
    rng = random.Random(seed)
    run = tmp_path / "run"
    ckdir = run / "checkpoints"
    out = open(tmp_path / "stdout.txt", "w+")
    from engine.checkpoint.peer import SHM_ROOT, run_id

    hook_dir, audit = tmp_path / "hook", tmp_path / "audit"
    hook_dir.mkdir()
    audit.mkdir()
    (hook_dir / "sitecustomize.py").write_text(AUDIT_HOOK)
    env = dict(ENV, TESSEL_AUDIT_DIR=str(ckdir.resolve()), TESSEL_AUDIT_OUT=str(audit),
               PYTHONPATH=os.pathsep.join(filter(None, [str(hook_dir), ENV.get("PYTHONPATH")])))
    proc = subprocess.Popen(torchrun_cmd(2, pretrain_args(corpus, run, f"train.steps={STEPS}", "checkpoint.interval=1",
                                                          "checkpoint.peer_replica=true", UNCLIPPED),
                                         max_restarts=5), stdout=out, stderr=subprocess.PIPE, text=True, env=env)
    kills = []  # (rank, the tmp dir seen, delay, newest complete step after the kill)
    target = None
    try:
        deadline = time.monotonic() + 240
        while len(kills) < 5:
            assert proc.poll() is None, f"seed {seed}: the job ended after {len(kills)} kills: {kills}"
            assert time.monotonic() < deadline, f"seed {seed}: timed out after {len(kills)} kills"
            done = {s for s, _ in list_checkpoints(ckdir)} if ckdir.is_dir() else set()
            tmp = [p.name for p in ckdir.iterdir() if p.name.startswith(TMP_PREFIX)] if ckdir.is_dir() else []
            if not done:  # from the first complete checkpoint on: every attempt after a kill resumes
                time.sleep(0.001)
                continue
            if target is None:  # this attempt's victim: the save of the step after its resume, or the one after,
                # leaving a save for each kill still to come (a kill may land after its save committed)
                target = min(max(done) + 1 + rng.randrange(2), STEPS - (4 - len(kills)))
            # That save in flight (not a stale one the restarted rank 0 has yet to remove).
            tmp = [t for t in tmp if int(t[len(TMP_PREFIX):].split("_")[0]) >= target]
            if not tmp:
                time.sleep(0.001)
                continue
            rank, delay = rng.randrange(2), rng.uniform(0, 0.03)
            time.sleep(delay)
            pid = worker_pid(proc.pid, rank)
            if pid is None:
                continue
            os.kill(pid, 9)
            time.sleep(0.05)  # let the survivor fail; no commit can happen without the dead rank
            kills.append((rank, tmp[0][:len(TMP_PREFIX) + 8], round(delay, 4), max(
                (s for s, _ in list_checkpoints(ckdir)), default=None)))
            # Wait for the next attempt to resume before arming the next kill.
            while proc.poll() is None and out_resumes(out) < len(kills) and time.monotonic() < deadline:
                time.sleep(0.01)
            target = None
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"seed {seed}, kills {kills}: " + err[-3000:]
    assert "connectFullMesh" not in err, err[-3000:]  # every restarted attempt rendezvoused
    resumed = resumed_steps(out)
    # Each attempt after a kill resumed from the newest complete checkpoint at that kill (None: a fresh start).
    assert resumed == [k[3] for k in kills], (seed, kills, resumed)
    assert train_losses(run) == uninterrupted, (seed, kills)
    # Reported (pytest -s): which save each kill hit and whether that save still committed before the kill.
    complete = {s for s, _ in list_checkpoints(ckdir)}
    print(f"seed {seed}: kills (rank, save in flight, delay s, newest complete after the kill): {kills}; "
          f"final checkpoints {sorted(complete)}")
    assert not [p for p in ckdir.iterdir() if p.name.startswith(TMP_PREFIX)]
    # Peer replica: each resume as the audit hook saw it, per attempt (every worker of an attempt agrees).
    records = [json.loads(p.read_text()) for p in audit.iterdir()]
    by_attempt = {}
    for rec in records:
        by_attempt.setdefault(rec["attempt"], []).append(rec)
    assert sorted(by_attempt) == list(range(1, 6)) and all(len(v) == 2 for v in by_attempt.values()), records
    sources = {a: {r["source"] for r in v} for a, v in by_attempt.items()}
    assert all(len(s) == 1 for s in sources.values()), sources
    replica = [r for r in records if r["source"] == "peer replica"]
    disk = [r for r in records if r["source"] == "disk"]
    assert replica, f"seed {seed}: no restart used the peer replica: {records}"
    # The restart that used the replicas opened no checkpoint file: counted by load.py and by the hook.
    assert all(r["files_opened"] == 0 and r["opened"] == [] for r in replica), [
        (r["attempt"], r["rank"], r["files_opened"], r["opened"]) for r in replica]
    # The hook does see checkpoint files: a restart from disk opened them (the count can fail).
    assert all(r["files_opened"] > 0 and r["opened"] for r in disk), [
        (r["attempt"], r["rank"], r["files_opened"], r["opened"]) for r in disk]
    out.seek(0)
    lines = out.read().splitlines()
    fallbacks = [x for x in lines if x.startswith("tessel: peer replica not used")]
    assert len(fallbacks) == len(disk) // 2, (fallbacks, disk)
    print(f"peer replica: restarts from the replicas {sorted({r['attempt'] for r in replica})}, from disk "
          f"{sorted({r['attempt'] for r in disk})}: {fallbacks}", *[x for x in lines if x.startswith("tessel: loaded")],
          sep="\n")
    assert not (Path(SHM_ROOT) / run_id(ckdir)).exists()  # removed at the clean exit


def test_peer_replica_config_errors_are_clear_and_before_communication(corpus, tmp_path, capsys, monkeypatch):
    """``checkpoint.peer_replica`` without periodic saves, or with one rank, is refused at start-up (exit 2, one line
    naming the key and the fix) before any process group exists."""
    from engine.config import CheckpointConfig
    from tools.pretrain import main

    with pytest.raises(ValueError, match="checkpoint.interval > 0"):
        CheckpointConfig(peer_replica=True, interval=0)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for extra, message in ((["checkpoint.peer_replica=true"], "with a world of 1 rank"),
                           (["checkpoint.peer_replica=true", "checkpoint.interval=0"], "checkpoint.interval > 0")):
        run = tmp_path / f"run{len(extra)}"
        assert main(pretrain_args(corpus, run, "train.steps=1", *extra)) == 2
        err = capsys.readouterr().err
        assert message in err and "checkpoint.peer_replica=false" in err and len(err.strip().splitlines()) == 1, err
        assert not run.exists()  # nothing written, nothing started
        import torch.distributed as dist

        assert not dist.is_initialized()


def resumed_steps(out) -> list[int]:
    # Read through a file description of our own: ``out`` is the workers' stdout, and seeking it would move the
    # offset they write at (one shared description), so a line written meanwhile could land at the start.
    out.flush()
    with open(out.name) as f:
        text = f.read()
    return [int(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith("tessel: resumed from ")]


def out_resumes(out) -> int:
    return len(resumed_steps(out))


def test_each_torchrun_attempt_rendezvouses_under_its_own_prefix(monkeypatch):
    """The cause of ``connectFullMesh: connection refused`` after a restart, in one process: the agent's store
    outlives the attempt, so without a prefix attempt 1 reads attempt 0's keys. A multi-node job that may
    restart with the shared store is refused before any rendezvous."""
    import datetime

    import torch.distributed as dist

    from parallel.mesh import attempt_store

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=5))
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port),
           "WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "0", "GROUP_WORLD_SIZE": "1",
           "TORCHELASTIC_MAX_RESTARTS": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    timeout = datetime.timedelta(seconds=5)
    attempt_store(timeout).set("rank_0_address", "the dead process's port")
    assert server.check(["tessel/attempt_0/rank_0_address"])  # what torch's own env:// path would find again
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not attempt_store(timeout).check(["rank_0_address"])
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        attempt_store(timeout)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert attempt_store(timeout) is None  # the store dies with its attempt's rank 0: torch's path is right


def measure(nproc: int, tp: int, kill_rank: int, workdir: str, sets: tuple = ()) -> None:
    """By hand (docs/fault_tolerance.md): an uninterrupted run and one with ``kill_rank`` SIGKILLed after step 4
    under --max-restarts 1; prints the recovery time (the kill to the new attempt's resume line and to its first
    step) and whether the losses are bitwise equal."""
    import shutil
    import tempfile
    from pathlib import Path

    from tests.tools.test_pretrain_fault import make_corpus

    root = Path(tempfile.mkdtemp(dir=workdir))
    corpus = make_corpus(root)
    extra = (f"train.steps={STEPS}", "checkpoint.interval=3", f"parallel.tp={tp}", *sets)
    t = time.monotonic()
    r = subprocess.run(torchrun_cmd(nproc, pretrain_args(corpus, root / "base", *extra)), capture_output=True,
                       text=True, env=ENV)
    print(f"uninterrupted: exit {r.returncode} in {time.monotonic() - t:.1f} s")
    run = root / "run"
    out = open(root / "stdout.txt", "w+")
    t = time.monotonic()
    proc = subprocess.Popen(torchrun_cmd(nproc, pretrain_args(corpus, run, *extra), max_restarts=1), stdout=out,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    seen = kill_rank_after(proc, run, rank=kill_rank, after_step=4)
    killed = time.monotonic()
    resumed_at = first_step_at = None
    while proc.poll() is None:
        if resumed_at is None and resumed_steps(out):
            resumed_at = time.monotonic() - killed
        if resumed_at is not None and first_step_at is None and logged_step(run) > resumed_steps(out)[0]:
            first_step_at = time.monotonic() - killed
        time.sleep(0.01)
    err = proc.stderr.read()
    print(f"killed rank {kill_rank} of {nproc} (tp={tp}) after step {seen} ({killed - t:.1f} s into the job); "
          f"resumed from step {resumed_steps(out)} {resumed_at:.1f} s after the kill, next step logged "
          f"{first_step_at or float('nan'):.1f} s after it; job exit {proc.returncode} "
          f"{time.monotonic() - killed:.1f} s after the kill; "
          f"connectFullMesh in stderr: {'connectFullMesh' in err}")
    out.seek(0)
    print(*[x for x in out.read().splitlines() if x.startswith(("tessel: loaded step", "tessel: peer replica"))],
          sep="\n")
    if proc.returncode == 0:
        print("losses bitwise equal to the uninterrupted run's:", train_losses(run) == train_losses(root / "base"))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":  # python tests/tools/test_restart.py [nproc tp kill_rank [key=value ...]]: by hand
    sys.path.insert(0, ROOT)
    n, tp_, k = (int(x) for x in (sys.argv[1:4] if len(sys.argv) > 3 else (4, 2, 2)))
    measure(n, tp_, k, os.environ.get("TMPDIR", "/tmp"), tuple(sys.argv[4:]))
