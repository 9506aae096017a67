"""Crash safety: a writer SIGKILLed mid-save leaves the previous checkpoint intact and auto-resume picks it.

The writer runs in a subprocess; the test hook ``TESSEL_CHECKPOINT_TEST_PAUSE`` stops it at a known
point (inside a shard file, or between the commit rename and the ``latest`` update) and touches a
marker file, so the kill lands deterministically.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from engine.checkpoint import (CheckpointWarning, ShardedTensor, find_latest_checkpoint, list_checkpoints,
                               load_checkpoint)
from engine.checkpoint.safetensors_io import PAUSE_ENV

REPO = Path(__file__).resolve().parents[3]

WRITER = textwrap.dedent("""
    import sys, torch
    from engine.checkpoint import ShardedTensor, save_checkpoint
    root, mode = sys.argv[1], sys.argv[2]
    small = torch.arange(1000, dtype=torch.float32)
    save_checkpoint(root, step=1, tensors=[ShardedTensor.replicated("w", small)], trainer_state={"step": 1})
    big = torch.ones(4 << 20)  # 16 MiB: the pause lands well inside the file
    # The hook only applies from here on (step 1 above was written without it).
    import os
    os.environ["TESSEL_CHECKPOINT_TEST_PAUSE"] = sys.argv[3]
    h = save_checkpoint(root, step=2, tensors=[ShardedTensor.replicated("w", small + 1),
                                               ShardedTensor.replicated("big", big)],
                        trainer_state={"step": 2}, async_save=(mode == "async"))
    h.wait()
    print("finished without pausing", flush=True)
""")


def _run_and_kill(root: Path, mode: str, pause: str, marker: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != PAUSE_ENV}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), mode, pause], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            if proc.poll() is not None:
                raise AssertionError(f"writer exited early: {proc.stdout.read().decode()}")
            if time.monotonic() > deadline:
                raise AssertionError("writer never reached the pause point")
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _load_w(path) -> torch.Tensor:
    w = torch.zeros(1000)
    load_checkpoint(path, tensors=[ShardedTensor.replicated("w", w)])
    return w


def test_kill_mid_write_keeps_previous_checkpoint(tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "paused"
    _run_and_kill(root, "async", f"write:{8 << 20}:{marker}", marker)
    tmp_dirs = [p for p in root.iterdir() if p.name.startswith(".tmp_step_00000002_")]
    assert len(tmp_dirs) == 1 and not (tmp_dirs[0] / "metadata.json").exists()
    partial = tmp_dirs[0] / "rank_00000.safetensors"
    # Really killed mid-file: the writer reserves the whole file up front (fallocate), so the bytes
    # before the pause point are the tensor's (1.0 = 00 00 80 3f) and the rest were never written.
    data = partial.read_bytes()
    assert data[(8 << 20) - 4:8 << 20] == b"\x00\x00\x80\x3f" and data[-16:] == bytes(16)
    assert not (root / "step_00000002").exists()
    assert (root / "latest").read_text() == "step_00000001\n"
    with pytest.warns(CheckpointWarning, match="temporary directory of a save that did not finish"):
        found = find_latest_checkpoint(root)
    assert found == root / "step_00000001"
    with pytest.warns(CheckpointWarning):
        assert torch.equal(_load_w(root), torch.arange(1000.0))  # auto-resume from the root, checksums verified


def test_kill_between_commit_and_latest_pointer(tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "paused"
    _run_and_kill(root, "sync", f"commit:{marker}", marker)
    # The rename is the commit: step 2 is complete even though `latest` still names step 1.
    assert [s for s, _ in list_checkpoints(root)] == [1, 2]
    assert (root / "latest").read_text() == "step_00000001\n"
    with pytest.warns(CheckpointWarning, match="names 'step_00000001' but the newest complete checkpoint is"):
        assert find_latest_checkpoint(root) == root / "step_00000002"
    with pytest.warns(CheckpointWarning):
        assert torch.equal(_load_w(root), torch.arange(1000.0) + 1)
