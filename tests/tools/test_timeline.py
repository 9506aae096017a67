"""tools/timeline.py on hand-made traces (no run): the measured makespan, the simulator's makespan of the
same schedule from the measured stage costs, a valid PNG of the picture's size, and a clear error
without traces. (The trace of a real profiled run is drawn in tests/engine/test_profiling.py.)"""
from __future__ import annotations

import json
import struct
import zlib

import pytest

from tools.timeline import timeline


def _trace(path, boxes, step=(0, 1000)):
    ev = [{"ph": "X", "name": "step5", "ts": step[0], "dur": step[1] - step[0]}]
    ev += [{"ph": "X", "name": f"chunk0.{k}{mb}", "ts": b, "dur": e - b} for b, e, k, mb in boxes]
    path.write_text(json.dumps({"traceEvents": ev}))


def test_measured_beside_simulated(tmp_path):
    (tmp_path / "profile").mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"parallel": {"tp": 1, "cp": 1, "pp": 2, "vp": 1,
                                                                   "schedule": "1f1b", "order": "dp-pp-cp-tp"}}))
    # 1F1B, 2 micro-batches, F = 100 us, B = 200 us on both stages; rank 1 waits for rank 0's sends
    _trace(tmp_path / "profile" / "trace_rank0.json", [(0, 100, "F", 0), (100, 200, "F", 1), (400, 600, "B", 0),
                                                       (700, 900, "B", 1)], step=(0, 900))
    _trace(tmp_path / "profile" / "trace_rank1.json", [(100, 200, "F", 0), (200, 400, "B", 0), (400, 500, "F", 1),
                                                       (500, 700, "B", 1)], step=(0, 700))
    res = timeline(str(tmp_path), out=str(tmp_path / "t.png"))
    assert res["step"] == 5 and res["microbatches"] == 2
    assert res["measured_makespan_s"] == pytest.approx(900e-6)
    assert res["simulated_makespan_s"] == pytest.approx(900e-6)  # F0 F1 | F0 B0 F1 B1 | B0 B1 with no latency
    data = (tmp_path / "t.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    idat = data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8]
    assert len(zlib.decompress(idat)) == h * (1 + 3 * w)


def test_no_traces_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"parallel": {"tp": 1, "pp": 1, "vp": 1}}))
    with pytest.raises(ValueError, match="logging.profile_steps"):
        timeline(str(tmp_path))
