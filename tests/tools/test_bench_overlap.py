"""tools/bench_overlap.py: the one-device GEMM-overhead mode end to end (tiny shapes), and its arguments.
(The launch mode runs torchrun twice per layout and repeat: minutes; its numbers are in docs/overlap.md.)"""
from __future__ import annotations

import json

from tools import bench_overlap


def test_gemm_overhead_mode(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert bench_overlap.main(["--gemm-overhead", "--tokens", "16", "--tp-degrees", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["tp"], r["linear"]) for r in res["rows"]] == [(2, "fc1 (column)"), (2, "fc2 (row)")]
    assert all(r["overhead"] > 0 and r["M"] == 16 for r in res["rows"])
    assert "2 chunk GEMMs" in capsys.readouterr().out


def test_breakdown_splits_blocked_time_into_peer_late_and_rest():
    """Two tp ranks, one timed step: a ring round (rank 1 posts its transfers 0.5 s after rank 0 began
    waiting), a synchronous all-reduce (rank 1 enters 0.4 s late) and the loss's asynchronous MAX."""
    g = [0, 1]
    r0 = {"steps": 1, "flights": [("batch_p2p", g, 1, 0.0, 2.0, True), ("wait", g, None, 1.0, 2.0, False),
                                  ("all_reduce", g, 1, 3.0, 3.5, False), ("all_reduce", g, 2, 4.0, 4.2, True),
                                  ("wait", g, None, 4.5, 4.6, False)]}
    r1 = {"steps": 1, "flights": [("batch_p2p", g, 1, 1.5, 2.0, True), ("wait", g, None, 1.6, 2.0, False),
                                  ("all_reduce", g, 1, 3.4, 3.5, False), ("all_reduce", g, 2, 4.0, 4.2, True),
                                  ("wait", g, None, 4.5, 4.5, False)]}
    out = bench_overlap.breakdown([r0, r1])
    assert list(out) == ["ring waits", "all_reduce", "all_reduce (async) wait"]  # largest first
    approx = lambda d: {k: round(v, 9) for k, v in d.items()}  # noqa: E731
    assert approx(out["ring waits"]) == {"s": 0.7, "late_s": 0.25, "calls": 1.0}  # (1.0 + 0.4) / 2, (0.5 + 0) / 2
    assert approx(out["all_reduce"]) == {"s": 0.3, "late_s": 0.2, "calls": 1.0}
    assert approx(out["all_reduce (async) wait"]) == {"s": 0.05, "late_s": 0.0, "calls": 1.0}


def test_loss_times_both_ways_of_running_the_max():
    """--loss's measurement on 2 gloo ranks (the CLI runs the same function under torchrun at tp2 and tp4)."""
    from parallel.testing import run_distributed

    for res in run_distributed(bench_overlap.loss_times, 2, 6, timeout=120):
        assert set(res) == {"false", "true"}
        for d in res.values():
            assert 0 <= d["blocked_s"] <= d["forward_s"]


def test_modes_and_machine_are_checked_before_any_launch(monkeypatch, capsys):
    import pytest

    for argv, message in ((["--modes", "ring"], "give 'none' (the baseline)"),
                          (["--modes", "none", "none"], "each once"),
                          (["--modes", "none", "symm_mem"], "symm_mem needs CUDA GPUs")):
        with pytest.raises(SystemExit):
            bench_overlap.main(argv)
        assert message in capsys.readouterr().err
    monkeypatch.setattr(bench_overlap, "_launch_machine", lambda: ("2 x H100, NCCL", 2))
    with pytest.raises(SystemExit):
        bench_overlap.main(["--layouts", "tp2", "tp4"])
    assert "need 4 ranks, one GPU each, and 2 GPU(s) are visible" in capsys.readouterr().err


def test_kv_heads_are_raised_only_where_they_do_not_split(capsys):
    import argparse

    tiny = argparse.Namespace(config="tiny_llama_cpu", set=[])  # 4 heads, 2 kv heads
    assert bench_overlap.kv_heads_for(tiny, 2) == []
    assert bench_overlap.kv_heads_for(tiny, 4) == ["model.num_key_value_heads=4"]
    assert "do not split over tp=4" in capsys.readouterr().out
    assert bench_overlap.kv_heads_for(argparse.Namespace(config="llama3_8b", set=[]), 8) == []  # 8 kv heads
