"""tools/bench_fp8.py end to end on the CPU: at the tiny layer every recipe's GEMM equals its plain
reference (rel 0 on the CPU); the train-step comparison runs (one recipe against none, to stay short)."""
from __future__ import annotations

import json

import pytest

from engine import _native
from tools import bench_fp8


def test_bench_fp8_gemms_check_every_recipe(tmp_path):
    out = tmp_path / "fp8.json"
    assert bench_fp8.main(["--models", "tiny", "--tokens", "32", "--ceiling-n", "64", "--repeats", "1",
                           "--skip", "step", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["linear"] for r in res["gemms"]["layers"]] == ["qkv", "out", "fc1", "fc2"]
    for row in res["gemms"]["layers"]:
        for recipe in bench_fp8.RECIPES:
            assert row[recipe]["vs_reference_rel"] == 0.0
            assert row[recipe]["fwd_gemm_tflops"] > 0
    host = res["host"]["sides"]  # the host section runs by default: ops per linear forward + backward
    assert host["hp"]["op_counts"] == {"add_": 2, "mm": 3}
    assert all(v["host_us"] > 0 for v in host.values())
    if _native.available("fp8"):  # the reference casts (extension not built) are plain PyTorch ops
        assert host["tensorwise"]["ops"] == 11 and host["tensorwise"]["op_counts"]["engine._fp8.cast_transpose_scaled"] == 3


def test_bench_fp8_train_step_ratio(tmp_path, capsys):
    out = tmp_path / "fp8.json"
    assert bench_fp8.main(["--skip", "gemms", "--recipes", "delayed", "--steps", "1", "--warmup", "1",
                           "--micro-batch", "4", "--weight-cache-ab", "--json", str(out)]) == 0
    step = json.loads(out.read_text())["step"]
    assert step["preset"] == "cpu-tiny" and step["none"]["speedup_vs_none"] == 1.0
    assert (step["batch"], step["micro_batch"]) == (8, 4)
    assert step["delayed"]["step_s"] > 0 and step["delayed/nocache"]["step_s"] > 0
    # launches per step: the FP8 linears add their amax maxima and casts' bookkeeping, not scale arithmetic
    assert step["none"]["ops_per_step"] < step["delayed"]["ops_per_step"] < 1.25 * step["none"]["ops_per_step"]
    printed = capsys.readouterr().out
    assert "model.fp8=delayed " in printed and "weight cache:" in printed


def test_bench_fp8_profile_lists_each_sides_kernels(tmp_path):
    """--profile: per side the summed kernel (CPU op) times; the FP8 side's list shows its FP8 GEMMs."""
    out = tmp_path / "prof.json"
    assert bench_fp8.main(["--profile", "tiny:fc1", "--tokens", "32", "--repeats", "1", "--recipes", "tensorwise",
                           "--json", str(out)]) == 0
    prof = json.loads(out.read_text())["profile"]
    assert set(prof["sides"]) == {"fp32", "tensorwise"} and (prof["N"], prof["K"]) == (704, 128)
    for side in prof["sides"].values():
        listed = sum(k["us"] for k in side["kernels"])  # the top kernels: at most the total (float sums)
        assert listed > 0 and side["total_us"] >= listed * (1 - 1e-9)
    assert any("_scaled_mm" in k["name"] for k in prof["sides"]["tensorwise"]["kernels"])


def test_bench_fp8_host_profile_lists_functions(tmp_path, capsys):
    """--host-profile: per side, where its host time goes (own time per call, largest first): the FP8
    side's list names its GEMM and its casts."""
    out = tmp_path / "host.json"
    assert bench_fp8.main(["--skip", "gemms", "--skip", "step", "--recipes", "tensorwise", "--host-profile", "6",
                           "--json", str(out)]) == 0
    sides = json.loads(out.read_text())["host"]["sides"]
    for side in sides.values():
        prof = side["profile"]
        assert 0 < len(prof) <= 6 and all(a["own_us"] >= b["own_us"] for a, b in zip(prof, prof[1:]))
    assert any("_scaled_mm" in r["where"] for r in sides["tensorwise"]["profile"])
    assert "us  x" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [(["--profile-top", "3"], "read with --profile or --profile-step only"),
                                         (["--profile-step"], "profiles the train step on CUDA"),
                                         (["--profile", "8b"], "give MODEL:LINEAR"),
                                         (["--skip", "step", "--weight-cache-ab"], "applies to the train step"),
                                         (["--micro-batch", "3"], "must divide the cpu-tiny preset's batch"),
                                         (["--host-shape", "16", "24", "16"], "must be positive multiples of 16"),
                                         (["--host-shape", "0", "16", "16"], "must be positive multiples of 16"),
                                         (["--tokens", "0"], "--tokens=0 must be a positive integer"),
                                         (["--skip", "gemms", "--skip", "host", "--skip", "step"], "nothing to run"),
                                         (["--skip", "host", "--host-shape", "32", "32", "32"], "which --skip host leaves out"),
                                         (["--skip", "host", "--host-profile", "5"], "which --skip host (or --profile) leaves out"),
                                         (["--host-profile", "-1"], "give the number of functions to list")])
def test_bench_fp8_profile_flags_are_checked(argv, match, capsys):
    with pytest.raises(SystemExit):
        bench_fp8.main(argv)
    assert match in capsys.readouterr().err


def test_kernel_diff_names_where_the_graphed_steps_kernels_differ(capsys):
    """--cuda-graph --profile-step (CUDA): per kernel, graphed minus eager device time per step, largest first,
    kernels seen on one side only included (checked here on made-up tables; the profile itself needs a GPU)."""
    from tools.bench_fp8 import _kernel_diff

    eager = [{"name": "gemm", "us": 100.0, "calls": 4}, {"name": "copy", "us": 5.0, "calls": 2},
             {"name": "norm", "us": 10.0, "calls": 2}]
    graphed = [{"name": "gemm", "us": 101.0, "calls": 4}, {"name": "copy", "us": 12.0, "calls": 6},
               {"name": "memset", "us": 3.0, "calls": 1}]
    rows = _kernel_diff(eager, graphed, "delayed/graph", "delayed", top=3)
    assert [(r["name"], r["diff_us"]) for r in rows] == [("norm", -10.0), ("copy", 7.0), ("memset", 3.0)]
    assert rows[1]["eager_calls"] == 2 and rows[1]["graphed_calls"] == 6
    out = capsys.readouterr().out
    assert "+1.0 us in all" in out and "copy" in out and "gemm" not in out  # gemm's +1 us is 4th: not listed
