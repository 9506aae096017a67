"""The pipeline side of a plan: the layout's schedule and its makespan, fast enough for hundreds of layouts.

A plan meets the same few ``(schedule, pp, vp, micro-batches)`` in hundreds of layouts (the steady-state
shortcut of predict.py simulates ``pp * (vp + 3)`` micro-batches whatever the batch), so:

* :func:`schedule` is parallel.pipeline.build_schedule remembered (building one places every message on
  the ideal timeline: up to seconds at pp 64), also handed to engine/memory.py's ``predict_memory``
  (``schedules=``);
* :func:`pipeline_time` runs parallel/pipeline/simulate.py's dataflow model ("async": an action starts
  when its rank is free and its inputs exist, an input from another rank ``latency`` after its producer
  ends) on a form of the schedule compiled once: the order in which ``dataflow_times`` settles the
  actions depends only on the action lists, not on the costs, so the walk, the dependency lookups and
  the rank of each producer are done once per schedule and each layout only adds and compares floats,
  the same operations in the same order (the times are equal to the last bit:
  tests/engine/test_planner.py compares them with ``dataflow_times`` on several schedules).
"""
from __future__ import annotations

import functools

from parallel.pipeline import build_schedule
from parallel.pipeline.actions import FORWARD, stage_rank
from parallel.pipeline.simulate import action_deps


@functools.lru_cache(maxsize=64)
def schedule(name: str, *, pp: int, vp: int = 1, microbatches: int, microbatch_group_size: int | None = None):
    """parallel.pipeline.build_schedule, remembered. A Schedule is frozen data: sharing it is safe."""
    return build_schedule(name, pp=pp, vp=vp, microbatches=microbatches, microbatch_group_size=microbatch_group_size)


@functools.lru_cache(maxsize=64)
def compiled(name: str, pp: int, vp: int, microbatches: int) -> tuple[tuple[tuple[int, int, tuple], ...], int]:
    """(the actions in the order dataflow_times settles them, each ``(rank, cost index, deps)`` with
    ``deps`` the ``(position in that order, from another rank)`` of its inputs; the number of stages).
    Cost index ``stage`` for a forward, ``num_stages + stage`` for a backward. The settling order is
    dataflow_times's own: ranks visited in turn, each run as far as its inputs exist."""
    sched = schedule(name, pp=pp, vp=vp, microbatches=microbatches)
    assert not sched.split_backward, "the planner simulates 1F1B and interleaved 1F1B"
    order = [[a.key for a in actions] for actions in sched.ranks]
    n = sched.num_stages
    placement = sched.placement
    settled: dict[tuple[str, int, int], int] = {}
    pos = [0] * pp
    seq = []
    remaining = sum(len(ops) for ops in order)
    while remaining:
        progressed = False
        for rank, ops in enumerate(order):
            while pos[rank] < len(ops):
                op, stage, mb = ops[pos[rank]]
                deps = action_deps(op, stage, mb, num_stages=n)  # no W: split backward is refused above
                if any(d not in settled for d in deps):
                    break
                seq.append((rank, stage if op == FORWARD else n + stage,
                            tuple((settled[d], stage_rank(d[1], pp=pp, placement=placement) != rank) for d in deps)))
                settled[(op, stage, mb)] = len(seq) - 1
                pos[rank] += 1
                remaining -= 1
                progressed = True
        assert progressed, f"{name} pp={pp} vp={vp}: the action orders deadlock"
    return tuple(seq), n


def pipeline_time(name: str, *, pp: int, vp: int, microbatches: int, fwd, bwd, p2p: float):
    """(makespan, busy seconds per rank) of the schedule ``name`` with per-stage forward and backward
    seconds ``fwd``, ``bwd`` and ``p2p`` seconds between ranks: simulate.py's ``dataflow_times`` (without
    its validation pass: ``build_schedule``'s schedules are validated by their own tests), evaluated on
    :func:`compiled`."""
    seq, n = compiled(name, pp, vp, microbatches)
    assert len(fwd) == len(bwd) == n, (len(fwd), len(bwd), n)
    cost = [*fwd, *bwd]
    latency = float(p2p)
    ends = []
    clock = [0.0] * pp
    busy = [0] * pp
    last = [None] * pp
    for rank, ci, deps in seq:
        start = clock[rank]
        for d, cross in deps:
            ready = ends[d] + (latency if cross else 0.0)
            if ready > start:
                start = ready
        end = start + cost[ci]
        ends.append(end)
        clock[rank] = last[rank] = end
        busy[rank] += end - start
    return max(e for e in last if e is not None), busy


def root_gathers(name: str, *, pp: int, vp: int, m: int, m_sim: int, pp_rank: int) -> float:
    """How many times ZeRO-3 all-gathers pipeline rank ``pp_rank``'s root unit (embedding on the first
    stage's chunk, final norm and output layer on the last's) in a step of ``m`` micro-batches.

    parallel/data_parallel/zero3.py gathers a chunk's root unit in a forward that finds it free and keeps it
    while any forward of the chunk awaits its backward (``holds``): so once each time the chunk's in-flight
    count goes 0 -> 1 walking the rank's actions. pp 1 and the last stage of 1F1B (each forward followed by
    its backward): m times; earlier stages (forwards ahead of their backwards the whole step): once.

    The plan walks ``m_sim`` micro-batches (predict.py's steady-state shortcut): past the warm-up the count
    grows by the same amount every pp micro-batches, so it is extrapolated from walks of ``m_sim`` and
    ``m_sim + pp`` (equal to the full walk; tests/engine/test_planner.py checks it)."""
    root_stage = 0 if pp_rank == 0 else pp * vp - 1  # the stage whose chunk holds the root parameters

    def count(microbatches: int) -> int:
        k = inflight = 0
        for a in schedule(name, pp=pp, vp=vp, microbatches=microbatches).ranks[pp_rank]:
            if a.stage != root_stage:
                continue
            if a.op == FORWARD:
                k += inflight == 0  # gathered again: the last backward freed it
                inflight += 1
            else:  # "B" (1F1B and interleaved 1F1B have no split backward)
                inflight -= 1
        return k

    if m_sim >= m or m_sim + pp >= m:
        return float(count(m))
    k1, k2 = count(m_sim), count(m_sim + pp)
    return k1 + (m - m_sim) * (k2 - k1) / pp
