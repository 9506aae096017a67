"""The pipeline as it ran beside the simulator's picture of the same schedule: one PNG from a profiled run.

    torchrun --nproc-per-node 4 tools/pretrain.py --config tiny_llama_cpu --set logging.profile_steps=[3,3]
    python tools/timeline.py runs/tiny_llama_cpu [--out timeline.png] [--step 3]

Reads ``RUN_DIR/profile/trace_rank<r>.json`` (engine/profiling.py) and ``RUN_DIR/config.json``. Picture:
the upper band is the measured step, one row per pipeline rank (the ranks at tp = cp = dp = 0), each
chunk forward (``chunk<c>.F<mb>``) a blue box and backward a green one, shaded by micro-batch; the lower
band is parallel/pipeline/simulate.py's timeline of the same schedule with each stage's forward and
backward cost set to the mean measured duration of that stage, on the same time axis (a red line marks
the end of each band's step). The gap between the two is what the schedule model does not see: p2p
waits, stragglers, the optimizer. Prints the measured and simulated makespans. PNG written with numpy +
zlib (no plotting dependency).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import struct
import sys
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from parallel.pipeline import build_schedule, simulate  # noqa: E402

RANGE = re.compile(r"^chunk(\d+)\.([FB])(\d+)$")
STEP = re.compile(r"^step(\d+)$")
WIDTH, ROW, GAP, MARGIN = 1400, 28, 6, 10


def write_png(path: str, rgb: np.ndarray) -> None:
    """An 8-bit RGB PNG of ``rgb`` (h, w, 3) uint8."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))  # filter type 0 per scanline

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def load_run(run_dir: str) -> tuple[dict, dict[int, list]]:
    """(the run's parallel section, {rank: [trace events]})."""
    with open(os.path.join(run_dir, "config.json")) as f:
        par = json.load(f)["parallel"]
    traces = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "profile", "trace_rank*.json"))):
        rank = int(re.search(r"trace_rank(\d+)\.json$", path).group(1))
        with open(path) as f:
            traces[rank] = json.load(f)["traceEvents"]
    if not traces:
        raise ValueError(f"no {run_dir}/profile/trace_rank*.json: run with logging.profile_steps=[start, end]")
    return par, traces


def pipeline_ranks(par: dict, ranks) -> dict[int, int]:
    """{pp rank: global rank} of the ranks at tp = cp = dp = 0 (mesh order dp-pp-cp-tp)."""
    if par.get("order", "dp-pp-cp-tp") != "dp-pp-cp-tp":
        raise ValueError(f"parallel.order={par['order']!r}: tools/timeline.py reads the default dp-pp-cp-tp only")
    inner = par["tp"] * par.get("cp", 1)
    return {p: p * inner for p in range(par["pp"]) if p * inner in ranks}


def measured(events, *, step: int | None) -> tuple[list, float, float, int]:
    """(boxes (start_us, end_us, 'F'|'B', chunk, mb) of one profiled step, its start, end, the step)."""
    steps = sorted((int(STEP.match(e["name"]).group(1)), e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and STEP.match(e.get("name", "")))
    if not steps:
        raise ValueError("the trace has no step<n> ranges (engine/profiling.py writes them)")
    chosen = [s for s in steps if step is None or s[0] == step]
    if not chosen:
        raise ValueError(f"--step {step} was not profiled; profiled steps: {[s[0] for s in steps]}")
    n, t0, t1 = chosen[0]
    boxes = []
    for e in events:
        m = RANGE.match(e.get("name", ""))
        if m and e.get("ph") == "X" and t0 <= e["ts"] <= t1:
            boxes.append((e["ts"], e["ts"] + e["dur"], m.group(2), int(m.group(1)), int(m.group(3))))
    return boxes, t0, t1, n


def _colour(kind: str, mb: int, m: int) -> np.ndarray:
    shade = 0.55 + 0.45 * (1 - mb / max(m - 1, 1))
    base = np.array([60, 110, 220]) if kind == "F" else np.array([50, 170, 90])
    return (base * shade + 255 * (1 - shade) * 0.3).clip(0, 255).astype(np.uint8)


def render(measured_rows, simulated_rows, *, span: float, microbatches: int, marks) -> np.ndarray:
    """Rows of boxes (start, end, kind, mb) in seconds from 0 -> an RGB picture, measured band above."""
    n = len(measured_rows)
    height = 2 * MARGIN + 2 * n * (ROW + GAP) + 3 * GAP
    img = np.full((height, WIDTH, 3), 255, np.uint8)
    scale = (WIDTH - 2 * MARGIN) / span

    def x(t):
        return MARGIN + int(round(t * scale))

    for band, rows in enumerate((measured_rows, simulated_rows)):
        top = MARGIN + band * (n * (ROW + GAP) + 3 * GAP)
        for r, boxes in enumerate(rows):
            y0 = top + r * (ROW + GAP)
            img[y0:y0 + ROW, MARGIN:WIDTH - MARGIN] = 235
            for b, e, kind, mb in boxes:
                x0, x1 = x(b), max(x(b) + 1, x(e))
                img[y0 + 2:y0 + ROW - 2, x0:x1] = _colour(kind, mb, microbatches)
                img[y0 + 2:y0 + ROW - 2, x0] = 255  # a thin gap between adjacent boxes
        xm = min(WIDTH - MARGIN - 1, x(marks[band]))
        img[top:top + n * (ROW + GAP) - GAP, xm] = (220, 30, 30)
    sep = MARGIN + n * (ROW + GAP) + GAP
    img[sep:sep + 2, :] = 120
    return img


def timeline(run_dir: str, *, out: str | None = None, step: int | None = None) -> dict:
    par, traces = load_run(run_dir)
    who = pipeline_ranks(par, traces)
    pp, vp = par["pp"], par["vp"]
    if len(who) != pp:
        missing = sorted(set(range(pp)) - set(who))
        raise ValueError(f"traces of pipeline ranks {missing} are missing in {run_dir}/profile")
    rows, starts, ends, durs = [], [], [], {}
    for p in range(pp):
        boxes, t0, t1, n = measured(traces[who[p]], step=step)
        step = n
        rows.append(boxes)
        starts.append(t0)
        ends.append(t1)
        for b, e, kind, c, mb in boxes:
            durs.setdefault((kind, c * pp + p), []).append(e - b)
    origin = min(starts)
    m = 1 + max(mb for boxes in rows for *_, mb in boxes)
    meas = [[((b - origin) / 1e6, (e - origin) / 1e6, kind, mb) for b, e, kind, c, mb in boxes] for boxes in rows]
    stages = pp * vp
    mean = {k: sum(v) / len(v) / 1e6 for k, v in durs.items()}
    fwd = [mean.get(("F", s), 1e-6) for s in range(stages)]
    bwd = [mean.get(("B", s), 1e-6) for s in range(stages)]
    sched = build_schedule(par["schedule"], pp=pp, vp=vp, microbatches=m)
    sim = simulate(sched, fwd_cost=fwd, bwd_cost=bwd)
    simr = [[(e.start, e.end, e.action.op, e.action.microbatch) for e in tl] for tl in sim.timelines]
    made = (max(ends) - origin) / 1e6
    span = max(made, sim.makespan) * 1.02
    img = render(meas, simr, span=span, microbatches=m, marks=(made, sim.makespan))
    out = out or os.path.join(run_dir, "profile", "timeline.png")
    write_png(out, img)
    return {"png": out, "step": step, "microbatches": m, "measured_makespan_s": made,
            "simulated_makespan_s": sim.makespan, "simulated_bubble_ratio": sim.bubble_ratio}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--out", help="PNG path (default RUN_DIR/profile/timeline.png)")
    ap.add_argument("--step", type=int, help="the profiled step to draw (default: the first)")
    a = ap.parse_args(argv)
    try:
        res = timeline(a.run_dir, out=a.out, step=a.step)
    except (ValueError, OSError, KeyError) as e:
        print(f"timeline.py: error: {e}", file=sys.stderr)
        return 2
    print(f"step {res['step']}: measured {res['measured_makespan_s']:.4f} s, simulated "
          f"{res['simulated_makespan_s']:.4f} s (bubble {100 * res['simulated_bubble_ratio']:.1f}%), {res['microbatches']} micro-batches -> {res['png']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
