"""tools/bench_train_step.py runs end to end at tiny sizes (CPU), with the fused-kernels comparison.

Speed is not asserted (benchmarks never time-assert); what is: all three sides compute the same
first-step loss (same weights, same batch), and the report holds the measurements it promises.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "bench_train_step.py")
TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--ffn", "64", "--vocab", "256",
        "--seq", "16", "--batch", "2", "--steps", "2", "--warmup", "1", "--threads", "1"]


def _run(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_compare_kernels_tiny(tmp_path):
    out = tmp_path / "bts.json"
    res = _run(*TINY, "--compare-kernels", "--fused-cross-entropy", "on", "--profile", "--json", str(out))
    assert res.returncode == 0, res.stderr
    report = json.loads(out.read_text())
    losses = report["first_step_loss"]
    assert set(losses) == {"tessel", "tessel_ref", "hf"}
    for side in ("tessel_ref", "hf"):
        assert losses[side] == pytest.approx(losses["tessel"], abs=1e-5), (side, losses)
    assert report["sides"]["tessel"]["fused_cross_entropy"] == "on"
    for side in report["sides"].values():
        assert side["wall_median_s"] > 0 and side["tokens_per_s_median"] > 0
        assert 0 < side["mfu_wall_median"] < 1
    assert report["model_flops_per_step"] > 0 and report["matmul_1024_fp32_flops_wall"] > 0
    for ratios in (report["ratio_tessel_over_hf"], report["ratio_tessel_over_tessel_ref"]):
        assert all(v > 0 for v in ratios.values())
    assert "tessel / tessel_ref throughput" in res.stdout
    profiles = report["profile"]  # --profile: each side's top ops by self time per step, largest first
    assert set(profiles) == {"tessel", "tessel_ref", "hf"}
    for rows in profiles.values():
        assert rows and {"op", "calls_per_step", "self_ms_per_step", "share"} <= set(rows[0])
        assert [r["self_ms_per_step"] for r in rows] == sorted((r["self_ms_per_step"] for r in rows), reverse=True)
        assert any(r["op"] == "aten::mm" and r["calls_per_step"] > 0 for r in rows) and sum(r["share"] for r in rows) <= 1 + 1e-9


def test_bad_arguments_name_the_fix():
    res = _run(*TINY, "--compare-kernels")
    assert res.returncode != 0 and "both sides would be the same" in res.stderr
    if not torch.cuda.is_available():
        res = _run("--device", "cuda")
        assert res.returncode != 0 and "use --device cpu" in res.stderr
