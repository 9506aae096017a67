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
