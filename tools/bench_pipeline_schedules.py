"""CPU step time of pipeline schedules at one pp size (gloo, one thread per rank), same-run ratios.

    python tools/bench_pipeline_schedules.py --pp 4 --microbatches 8 [--hidden 512 --tokens 512 --layers 8]
        [--steps 5] [--json FILE]

Every schedule runs the same model (``--layers`` column-parallel linears + tanh on a size-1 TP group,
so split backward defers their weight-gradient GEMMs) over the same micro-batches: 1f1b and zb-h1 with
``layers / pp`` layers per stage, interleaved (vp=2) and zbv with ``layers / (2 pp)`` per chunk. It
prints each schedule's median step time over ``--steps`` timed steps (after one warm-up step; the
schedules take turns step by step, so a load change on a shared machine hits all of them), its
ratio to 1F1B measured in the same run, and the simulator's prediction at F = B = W (the step time if
compute were the only cost). On a machine with fewer cores than ``pp`` the ranks share cores, so an
idle rank's bubble lends its core to another and the measured ratios understate the schedules'
differences: say the core count beside any number quoted (docs/pipeline.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2))


def _worker(args: dict) -> dict:
    import torch
    import torch.distributed as dist

    from parallel.comm import Group, Ledger
    from parallel.pipeline import build_schedule
    from parallel.pipeline.runtime import run_schedule
    from parallel.tensor_parallel import ColumnParallelLinear

    torch.set_num_threads(1)
    pp, rank = dist.get_world_size(), dist.get_rank()
    h, tokens, m, layers = args["hidden"], args["tokens"], args["microbatches"], args["layers"]
    group = Group(axis="pp", ranks=list(range(pp)), rank=rank, pg=dist.group.WORLD, ledger=Ledger())
    torch.manual_seed(0)
    xs = [torch.randn(tokens, 1, h) for _ in range(m)]
    setups = {}
    for name, vp in SCHEDULES:
        sched = build_schedule(name, pp=pp, vp=vp, microbatches=m)
        stages = sched.stages_of(rank)
        per = layers // (pp * vp)
        chunks = [[ColumnParallelLinear(h, h, tp_group=Group.trivial("tp")) for _ in range(per)] for _ in stages]
        setups[name] = (sched, stages, chunks)
    last_of = {name: pp * vp - 1 for name, vp in SCHEDULES}

    def forward_step_of(name):
        _, stages, chunks = setups[name]

        def forward_step(chunk, x, mb):
            x = xs[mb] if stages[chunk] == 0 else x
            for lyr in chunks[chunk]:
                x = torch.tanh(lyr(x))
            return x.pow(2).mean() if stages[chunk] == last_of[name] else x
        return forward_step

    # Round-robin over the schedules, step by step: load changes on a shared machine hit all of them.
    times = {name: [] for name, _ in SCHEDULES}
    for step in range(args["steps"] + 1):
        for name, _ in SCHEDULES:
            dist.barrier()
            t0 = time.perf_counter()
            run_schedule(setups[name][0], rank=rank, pp_group=group, forward_step=forward_step_of(name),
                         act_shape=(tokens, 1, h), dtype=torch.float32)
            dist.barrier()
            if step:   # step 0 warms up
                times[name].append(time.perf_counter() - t0)
    out = {name: statistics.median(t) for name, t in times.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    if a.layers % (2 * a.pp):
        print(f"error: --layers={a.layers} must be a multiple of 2 * pp = {2 * a.pp} (two chunks per rank)",
              file=sys.stderr)
        return 2
    from parallel.pipeline import build_schedule, simulate
    from parallel.testing import run_distributed

    res = run_distributed(_worker, a.pp, vars(a), timeout=1800)
    step = {name: max(r[name] for r in res) for name, _ in SCHEDULES}   # the slowest rank ends the step
    print(f"pp={a.pp} microbatches={a.microbatches} hidden={a.hidden} tokens={a.tokens} layers={a.layers} "
          f"steps={a.steps} cores={os.cpu_count()}")
    print(f"{'schedule':<12} {'step s':>9} {'vs 1f1b':>8} {'simulated vs 1f1b (F=B=W)':>26}")
    ideal = {}
    for name, vp in SCHEDULES:
        sched = build_schedule(name, pp=a.pp, vp=vp, microbatches=a.microbatches)
        unit = 1.0 / vp   # a chunk holds 1/vp of a stage's layers
        kw = dict(fwd_cost=unit, bwd_cost=unit, wgrad_cost=unit)
        ideal[name] = simulate(sched, **kw).makespan
    rows = []
    for name, _ in SCHEDULES:
        rows.append({"schedule": name, "step_s": step[name], "ratio_vs_1f1b": step[name] / step["1f1b"],
                     "simulated_ratio": ideal[name] / ideal["1f1b"]})
        r = rows[-1]
        print(f"{name:<12} {r['step_s']:>9.4f} {r['ratio_vs_1f1b']:>8.3f} {r['simulated_ratio']:>26.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "cores": os.cpu_count(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
