"""tools/inspect_checkpoint.py: the report, --verify, and its exit codes."""
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from engine.checkpoint import ShardedTensor, save_checkpoint

REPO = Path(__file__).resolve().parents[3]
TOOL = REPO / "tools" / "inspect_checkpoint.py"
_spec = importlib.util.spec_from_file_location("inspect_checkpoint", TOOL)
inspect_checkpoint = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(inspect_checkpoint)


def test_report_verify_and_corruption(tmp_path, capsys):
    def _run(*args):
        code = inspect_checkpoint.main([str(a) for a in args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    w = torch.randn(64, 32)
    pieces = [ShardedTensor(key="model.w", data=w[:40].reshape(-1)[:100].clone(), global_shape=(64, 32),
                            local_shape=(40, 32), flat_range=(0, 100)),
              ShardedTensor(key="model.w", data=w[:40].reshape(-1)[100:].clone(), global_shape=(64, 32),
                            local_shape=(40, 32), flat_range=(100, 1280)),
              ShardedTensor(key="model.w", data=w[40:].clone(), global_shape=(64, 32), global_offset=(40, 0)),
              ShardedTensor.replicated("model.norm", torch.ones(32, dtype=torch.bfloat16))]
    save_checkpoint(tmp_path, step=7, tensors=pieces, layout={"tp": 1, "dp": 1}, model_config={"hidden": 32},
                    trainer_state={"consumed_samples": 56}, rank_state={"rng": torch.get_rng_state()})
    out = _run(tmp_path, "--verify")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "step 7" in text and '"tp": 1' in text and '"hidden": 32' in text
    assert "model.w" in text and "(64, 32)" in text and "3 pieces (2 flat)" in text and "8.0 KiB" in text
    assert "model.norm" in text and "bfloat16" in text
    assert '"consumed_samples": 56' in text and "rank_states: 1 of 1" in text and "['rng']" in text
    assert "verify: all 1 files match" in text
    f = tmp_path / "step_00000007" / "rank_00000.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 1
    f.write_bytes(bytes(raw))
    bad = _run(tmp_path / "step_00000007", "--verify")
    assert bad.returncode == 1 and "VERIFY FAILED checksum mismatch in" in bad.stdout
    assert "rank_00000.safetensors" in bad.stdout
    assert _run(tmp_path / "step_00000007").returncode == 0  # without --verify nothing is hashed
    missing = _run(tmp_path / "nope")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    # The command line itself (exit status of the process).
    cli = subprocess.run([sys.executable, str(TOOL), str(tmp_path), "--verify"], capture_output=True, text=True)
    assert cli.returncode == 1 and "checksum mismatch" in cli.stdout
