"""tools/bench_attention.py end to end at a tiny size: every row timed against the same run's one-process
SDPA, and the bytes per rank are the ledger's formulas (ring: (cp-1)|KV| forward, (cp-1)|KV| + cp|dKV|
backward; a2a: (cp-1)/cp of q, k, v and the output, forward and backward)."""
from __future__ import annotations

import json

import pytest

from tools import bench_attention


def test_tiny_run(tmp_path):
    out, md = tmp_path / "a.json", tmp_path / "a.md"
    argv = ["--seqs", "64", "--cp", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--repeats", "1",
            "--json", str(out), "--md", str(md)]
    assert bench_attention.main(argv) == 0
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    for key in ("one_process_sdpa_s", "one_process_blocks_s", "one_process_blocks_explicit_s", "ring_s", "a2a_s",
                "ring_explicit_s"):
        assert row[key] > 0
    kv = 32 * 2 * 8 * 4  # this rank's K shard: s/cp tokens x kv heads x head dim, fp32
    q = 32 * 4 * 8 * 4
    assert row["ring_sent_bytes_per_rank"] == 2 * kv + (2 * kv + 2 * 2 * kv)
    assert row["ring_explicit_sent_bytes_per_rank"] == row["ring_sent_bytes_per_rank"]  # the kernel moves nothing
    assert row["a2a_sent_bytes_per_rank"] == 2 * 0.5 * (2 * q + 2 * kv)
    assert "bench_attention.py" in md.read_text() and res["machine"]["cpu_count"] >= 1


def test_profile_compares_sdpa_with_the_blocks(tmp_path):
    """--profile-cp: kernel tables for SDPA and the ring's flash blocks in one process (CPU here)."""
    out = tmp_path / "prof.json"
    assert bench_attention.main(["--profile-cp", "2", "--seqs", "256", "--repeats", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["sides"]) == {"sdpa", "cp2_blocks"} and res["seq"] == 256
    names = [k["name"] for k in res["sides"]["cp2_blocks"]["kernels"]]
    assert any("flash_attention" in n for n in names)


@pytest.mark.parametrize("argv, match", [
    (["--profile-cp", "0", "--seqs", "512"], "must be a cp degree >= 1"),
    (["--explicit-max-seq", "4096"], "read with --device cuda only"),
    (["--profile-top", "3"], "read with --profile-cp only"),
])
def test_flags_that_would_do_nothing_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        bench_attention.main(argv)
    assert match in capsys.readouterr().err
