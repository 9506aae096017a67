"""Build, validate and simulate a pipeline schedule; print its timeline.

    python tools/pipeline_schedule.py --schedule interleaved --pp 4 --vp 2 --microbatches 8
    python tools/pipeline_schedule.py --schedule 1f1b --pp 4 --microbatches 8 --json
    python tools/pipeline_schedule.py --schedule gpipe --pp 2 --microbatches 4 --png gpipe.png
    python tools/pipeline_schedule.py --schedule zbv --pp 4 --vp 2 --microbatches 8 --bwd-cost 1 --wgrad-cost 1

Default output: an ASCII timeline (one row per pipeline rank, one column per time unit; ``F3.1`` =
forward of virtual stage 3 on microbatch 1, ``B`` = backward, ``W`` = weight gradients of a
split-backward schedule, ``.`` = idle), then makespan, bubble
ratio beside its analytic value and peak in-flight microbatches per rank. ``--json`` prints
``{"bubble_ratio", "peak_inflight", "makespan"}`` only. ``--actions`` lists every rank's actions with
their sends and receives. Bad arguments exit with status 2 and a message saying what to change.
See docs/pipeline.md for the model behind the numbers.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.pipeline import (BACKWARD, SCHEDULE_NAMES, Schedule, Simulation,  # noqa: E402
                               build_schedule, simulate)
from parallel.pipeline.actions import WEIGHT  # noqa: E402
from parallel.pipeline.zero_bubble import analytic_bubble as _analytic  # noqa: E402

MAX_COLUMNS = 4000


def _costs(text: str) -> float | list[float]:
    """``"1.5"`` -> 1.5; ``"1,1,2,1"`` -> one cost per virtual stage."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number or a comma-separated list of numbers (one per virtual stage)")
    return values[0] if len(values) == 1 else values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", required=True, choices=SCHEDULE_NAMES)
    ap.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    ap.add_argument("--vp", type=int, default=None,
                    help="model chunks per rank (interleaved; zbv and dualpipev use 2); default 1, or 2 for "
                         "zbv and dualpipev")
    ap.add_argument("--microbatches", type=int, required=True)
    ap.add_argument("--group-size", type=int, default=None,
                    help="interleaved: microbatches per group (Megatron's "
                         "microbatch_group_size_per_vp_stage; default pp)")
    ap.add_argument("--fwd-cost", type=_costs, default=1.0,
                    help="forward time per virtual stage and microbatch, or one per stage "
                         "(comma-separated); default 1")
    ap.add_argument("--bwd-cost", type=_costs, default=2.0,
                    help="backward time, as --fwd-cost; default 2. With --wgrad-cost it is the input-gradient "
                         "part only (B of zb-h1, zbv, dualpipev)")
    ap.add_argument("--wgrad-cost", type=_costs, default=None,
                    help="weight-gradient time (W), as --fwd-cost; needed by zb-h1, zbv and dualpipev "
                         "(default there: equal to --bwd-cost); for the other schedules it is added to B")
    ap.add_argument("--p2p-latency", type=float, default=0.0, help="time for a message to arrive")
    ap.add_argument("--comm", choices=("async", "blocking"), default="async",
                    help="async: communication never blocks (the analytic ideal); blocking: the "
                         "runtime's wait-for-the-whole-batch semantics")
    ap.add_argument("--json", action="store_true", help="print only the JSON summary")
    ap.add_argument("--actions", action="store_true", help="also list each rank's actions and messages")
    ap.add_argument("--png", metavar="FILE", help="also draw the timeline with matplotlib")
    return ap.parse_args(argv)


def analytic_bubble(schedule: Schedule, fwd=1.0, bwd=2.0, wgrad=None) -> tuple[str, float] | None:
    """``(formula, value)`` of the schedule's bubble at equal stage costs and no latency, or None
    (:func:`parallel.pipeline.zero_bubble.analytic_bubble`; per-stage cost lists: None)."""
    if any(isinstance(c, list) for c in (fwd, bwd, wgrad)):
        return None
    w = 0.0 if wgrad is None else wgrad
    return _analytic(schedule.name, pp=schedule.pp, vp=schedule.vp, microbatches=schedule.microbatches,
                     fwd=fwd, bwd=bwd, wgrad=w)


def _time_unit(sim: Simulation, latency: float) -> Fraction:
    """Largest time step dividing every action's duration and the latency (one ASCII column)."""
    values = {Fraction(e.end - e.start).limit_denominator(1000) for tl in sim.timelines for e in tl}
    if latency:
        values.add(Fraction(latency).limit_denominator(1000))
    unit = Fraction(0)
    for v in values:
        unit = Fraction(math.gcd(unit.numerator * v.denominator, v.numerator * unit.denominator),
                        unit.denominator * v.denominator)
    return unit


def render_ascii(schedule: Schedule, sim: Simulation, *, latency: float = 0.0) -> str:
    """One row per rank, one column per time unit; an action spanning k units spans k columns."""
    unit = _time_unit(sim, latency)
    columns = round(Fraction(sim.makespan).limit_denominator(1000) / unit)
    if columns > MAX_COLUMNS:
        raise ValueError(f"the timeline is {columns} columns wide (time unit {unit}); use --json or "
                         "--png, or costs with a larger common unit")
    width = max(len(str(e.action)) for tl in sim.timelines for e in tl)
    cell = width + 1

    def col(t: float) -> int:
        return round(Fraction(t).limit_denominator(1000) / unit)

    header = [" "] * (columns * cell)
    for c in range(0, columns, max(1, math.ceil(6 / cell))):
        label = f"{float(c * unit):g}"
        header[c * cell:c * cell + len(label)] = label
    lines = [f"{'time':>7} |" + "".join(header).rstrip()]
    for rank, tl in enumerate(sim.timelines):
        row = list(("." * width + " ") * columns)
        for e in tl:
            start, end = col(e.start), col(e.end)
            fill = {BACKWARD: "-", WEIGHT: "~"}.get(e.action.op, "=")
            text = str(e.action).ljust((end - start) * cell - 1, fill)
            row[start * cell:start * cell + len(text)] = text
        lines.append(f"rank {rank:>2} |" + "".join(row).rstrip())
    lines.append(f"(one column = {float(unit):g} time unit{'s' if unit != 1 else ''}; '=' / '-' "
                 + ("/ '~' continue a forward / backward / weight gradient"
                    if schedule.split_backward else "continue a forward / backward") + ", '.' is idle)")
    return "\n".join(lines)


def summary(schedule: Schedule, sim: Simulation, *, fwd=1.0, bwd=2.0, wgrad=None) -> str:
    analytic = analytic_bubble(schedule, fwd, bwd, wgrad)
    exact = (f"analytic {analytic[0]} = {analytic[1]:.6g}, for equal stage costs and no latency"
             if analytic else "no analytic value claimed for these costs")
    lines = [
        f"schedule {schedule.name}: pp={schedule.pp} vp={schedule.vp} "
        f"microbatches={schedule.microbatches}"
        + (f" group_size={schedule.microbatch_group_size}"
           if schedule.microbatch_group_size is not None else ""),
        f"makespan {sim.makespan:g}; compute per rank {', '.join(f'{c:g}' for c in sim.compute)}",
        f"bubble ratio {sim.bubble_ratio:.6g} ({exact})",
        f"peak in-flight (stage, microbatch) per rank: {list(sim.peak_inflight)}",
    ]
    if schedule.split_backward:
        lines.append(f"  (held until W; up to B, the full activation set: {list(sim.peak_activations)})")
    return "\n".join(lines)


def _pyplot():
    """matplotlib.pyplot (headless), or a ValueError saying how to get it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--png needs matplotlib, which is not installed in this environment "
                         "(pip install matplotlib); the ASCII timeline and --json work without it")
    return plt


def draw_png(schedule: Schedule, sim: Simulation, path: str) -> None:
    """Gantt chart of the timeline: one row per rank, forwards and backwards in two colour ramps
    (darker = later model chunk)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, sim.makespan * 0.35), 0.6 * schedule.pp + 1.2))
    for rank, tl in enumerate(sim.timelines):
        for e in tl:
            chunk = schedule.chunk_of(e.action.stage)
            shade = 0.35 + 0.5 * chunk / max(1, schedule.vp - 1)
            ramp = {BACKWARD: plt.cm.Oranges, WEIGHT: plt.cm.Greens}.get(e.action.op, plt.cm.Blues)
            color = ramp(shade)
            ax.broken_barh([(e.start, e.end - e.start)], (rank - 0.4, 0.8), facecolors=color,
                           edgecolors="black", linewidth=0.5)
            ax.text((e.start + e.end) / 2, rank, str(e.action), ha="center", va="center",
                    fontsize=7)
    ax.set_yticks(range(schedule.pp), [f"rank {r}" for r in range(schedule.pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, sim.makespan)
    ax.set_xlabel("time")
    ax.set_title(f"{schedule.name} pp={schedule.pp} vp={schedule.vp} m={schedule.microbatches}: "
                 f"bubble {sim.bubble_ratio:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.png:
            _pyplot()   # fail before printing anything
        vp = args.vp if args.vp is not None else (2 if args.schedule in ("zbv", "dualpipev") else 1)
        schedule = build_schedule(args.schedule, pp=args.pp, vp=vp,
                                  microbatches=args.microbatches,
                                  microbatch_group_size=args.group_size)
        wgrad = args.wgrad_cost
        if wgrad is None and schedule.split_backward:
            wgrad = args.bwd_cost
        sim = simulate(schedule, fwd_cost=args.fwd_cost, bwd_cost=args.bwd_cost, wgrad_cost=wgrad,
                       p2p_latency=args.p2p_latency, comm=args.comm)
        if args.json:
            print(json.dumps(sim.as_dict()))
        else:
            print(render_ascii(schedule, sim, latency=args.p2p_latency))
            print(summary(schedule, sim, fwd=args.fwd_cost, bwd=args.bwd_cost, wgrad=wgrad))
            if args.actions:
                print(schedule.describe())
        if args.png:
            draw_png(schedule, sim, args.png)
            if not args.json:
                print(f"wrote {args.png}")
    except ValueError as e:   # user errors (ScheduleError is one): message and status 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
