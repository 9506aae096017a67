"""tools/bench_moe.py end to end at a tiny size: every expert implementation timed with its ratio to the
loop, and the MoE layer at ep=2 with both dispatchers against ep=1 (all-to-all bytes only for alltoall)."""
from __future__ import annotations

import json

from tools import bench_moe

TINY = ["--tokens", "32", "--hidden", "16", "--ffn", "32", "--experts", "4", "--ep", "2", "--warmup", "1",
        "--repeats", "1"]


def test_tiny_run(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert bench_moe.main(TINY + ["--json", str(out)]) == 0
    res = json.loads(out.read_text())
    impls = {r["impl"]: r for r in res["experts"]}
    assert list(impls) == ["loop", "grouped", "dense"]
    assert impls["loop"]["ratio_vs_loop"] == 1.0 and impls["dense"]["s_median"] > 0
    rows = {r["dispatcher"]: r for r in res["dispatch"]}
    assert set(rows) == {"alltoall", "allgather"} and all(r["ep"] == 2 for r in rows.values())
    assert rows["alltoall"]["a2a_sent_bytes_per_step"] > 0 == rows["allgather"]["a2a_sent_bytes_per_step"]
    assert res["matmul_ceiling_tflops"] > 0 and res["matmul_ceiling_n"] == 1024 and res["args"]["dtype"] == "fp32"
    assert "vs ep=1" in capsys.readouterr().out
