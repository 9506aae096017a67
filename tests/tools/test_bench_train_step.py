"""tools/bench_train_step.py runs end to end at tiny sizes (CPU), with the fused-kernels comparison.

Speed is not asserted (benchmarks never time-assert); what is: all three sides compute the same
first-step loss (same weights, same batch), and the report holds the measurements it promises.
"""
from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from tests.conftest import TorchState

TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--ffn", "64", "--vocab", "256",
        "--seq", "16", "--batch", "2", "--steps", "2", "--warmup", "1", "--threads", "1"]


def test_compare_kernels_tiny(tmp_path):
    """main() in this process (no interpreter start, torch and transformers already imported); its thread
    count and seed are put back after."""
    from tools.bench_train_step import main

    out = tmp_path / "bts.json"
    printed = io.StringIO()
    with TorchState(), contextlib.redirect_stdout(printed):
        assert main([*TINY, "--compare-kernels", "--fused-cross-entropy", "on", "--profile", "--json", str(out)]) == 0
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
    assert "tessel / tessel_ref throughput" in printed.getvalue()
    profiles = report["profile"]  # --profile: each side's top ops by self time per step, largest first
    assert set(profiles) == {"tessel", "tessel_ref", "hf"}
    for rows in profiles.values():
        assert rows and {"op", "calls_per_step", "self_ms_per_step", "share"} <= set(rows[0])
        assert [r["self_ms_per_step"] for r in rows] == sorted((r["self_ms_per_step"] for r in rows), reverse=True)
        assert any(r["op"] == "aten::mm" and r["calls_per_step"] > 0 for r in rows) and sum(r["share"] for r in rows) <= 1 + 1e-9


def test_bad_arguments_name_the_fix(capsys):
    from tools.bench_train_step import main

    with pytest.raises(SystemExit) as e:  # argparse's error: exit status 2, the message on stderr
        main([*TINY, "--compare-kernels"])
    assert e.value.code == 2 and "both sides would be the same" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            main(["--device", "cuda"])
        assert e.value.code == 2 and "use --device cpu" in capsys.readouterr().err
