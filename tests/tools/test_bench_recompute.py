"""tools/bench_recompute.py end to end at a tiny size: every mode timed, ratios against none, peaks, the
formula's saved bytes ordered full < selective < none, first-step losses equal (the RNG replay)."""
from __future__ import annotations

import json

from tools import bench_recompute

TINY = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--vocab", "64",
        "--seq", "16", "--batch", "2", "--threads", "1", "--warmup", "1", "--repeats", "2"]


def test_tiny_run(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench_recompute.main(TINY + ["--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["mode"]: r for r in res["rows"]}
    assert list(rows) == ["none", "selective", "full", "full (recompute_num_layers=1)"]
    for r in rows.values():
        assert r["wall_s_median"] > 0 and r["cpu_s_median"] > 0 and r["peak_bytes"] > 0
        assert len(r["wall_s_all"]) == 2
    assert rows["none"]["wall_ratio_vs_none"] == 1.0
    saved = {k: r["predicted_saved_bytes"] for k, r in rows.items()}
    assert saved["full"] < saved["full (recompute_num_layers=1)"] < saved["none"]
    assert saved["full"] < saved["selective"] < saved["none"]
    assert saved["full"] == 4 * 2 * 16 * 2 * 32  # e * layers * s * b * h: each layer keeps its input
    assert len({r["first_loss"] for r in rows.values()}) == 1
    assert res["matmul_1024_tflops"] > 0
    assert "bitwise equal in every mode" in capsys.readouterr().out


def test_formula_matches_docs_memory_table():
    """docs/memory.md's measured Llama TP1 bytes per layer (s=16, b=2, h=64, a=8, g=4, f=96)."""
    args = bench_recompute.parse_args(["--hidden", "64", "--layers", "1", "--heads", "8", "--kv-heads", "4",
                                       "--ffn", "96", "--seq", "16", "--batch", "2"])
    assert bench_recompute.predicted_saved_bytes(args, "none", None) == 180_480
    assert bench_recompute.predicted_saved_bytes(args, "selective", None) == 135_424
    assert bench_recompute.predicted_saved_bytes(args, "full", None) == 8_192
