"""Timeline simulator for pipeline schedules: makespan, bubble and in-flight microbatches.

Two models (docs/pipeline.md):

* ``comm="async"`` (default, :func:`dataflow_times`): each rank runs its actions in list order, one
  at a time; an action starts when its rank is free and its inputs exist (``F{s}.{m}`` needs
  ``F{s-1}.{m}``; ``B{s}.{m}`` needs ``F{s}.{m}`` and ``B{s+1}.{m}``). An input made on another rank
  arrives ``p2p_latency`` after its producer ends; one made on the same rank at once. In a
  split-backward schedule ``W{s}.{m}`` needs ``B{s}.{m}`` (same rank) and costs ``wgrad_cost``. Communication
  never occupies a rank nor blocks it: the ideal that the analytic bubble formulas assume.
* ``comm="blocking"`` (:func:`blocking_times`): the runtime's semantics with the strictest
  transport. Before each action the rank posts its batch of sends and receives and waits until every
  message in it has completed; a message completes ``p2p_latency`` after both sides have posted it.
  This shows what a blocking runtime loses when sender and receiver do not meet in time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from parallel.pipeline.actions import (BACKWARD, FORWARD, RECV, SEND, WEIGHT, Action, Schedule,
                                       ScheduleError, stage_rank)
from parallel.pipeline.validate import validate


@dataclass(frozen=True)
class TimelineEntry:
    start: float
    end: float
    action: Action

    def __str__(self) -> str:
        return f"{self.action}@[{self.start:g},{self.end:g})"


@dataclass(frozen=True)
class Simulation:
    """Result of :func:`simulate`.

    ``timelines[r]`` lists rank ``r``'s actions with start/end times, in execution order.
    ``compute[r]`` is rank ``r``'s busy time. ``bubble_ratio`` is ``(makespan - C) / C`` with
    ``C = max(compute)`` (the busiest rank's idle time over its compute; with equal stage costs every
    rank has the same ``C`` and this is Narayanan et al.'s bubble). ``idle_ratio[r]`` is the same
    ratio for each rank with its own compute. ``peak_inflight[r]`` is the most (stage, microbatch)
    pairs rank ``r`` holds at once: forward done, backward not yet done (one per model chunk, as
    Megatron-LM counts); in a split-backward schedule "done" means its ``W`` has run, since W keeps
    what the weight gradients need. ``peak_activations[r]``: the same count up to ``B`` (the whole
    activation set of a pair is alive from its F to its B; equal to ``peak_inflight`` without W).
    """

    timelines: tuple[tuple[TimelineEntry, ...], ...]
    makespan: float
    compute: tuple[float, ...]
    bubble_ratio: float
    idle_ratio: tuple[float, ...]
    peak_inflight: tuple[int, ...]
    peak_activations: tuple[int, ...] = ()

    def as_dict(self) -> dict:
        """JSON-ready summary (what ``tools/pipeline_schedule.py --json`` prints)."""
        return {"bubble_ratio": self.bubble_ratio, "peak_inflight": list(self.peak_inflight),
                "makespan": self.makespan}


def _per_stage(name: str, cost, num_stages: int) -> tuple[float, ...]:
    """A scalar or a per-virtual-stage sequence -> one positive finite cost per stage."""
    if isinstance(cost, (int, float)) and not isinstance(cost, bool):
        costs = (float(cost),) * num_stages
    elif isinstance(cost, Sequence) and not isinstance(cost, str):
        if len(cost) != num_stages:
            raise ValueError(f"{name} has {len(cost)} entries but the schedule has {num_stages} "
                             f"virtual stages (pp * vp); give one cost per stage or a scalar")
        costs = tuple(float(c) if isinstance(c, (int, float)) and not isinstance(c, bool)
                      else math.nan for c in cost)
    else:
        raise ValueError(f"{name} must be a number or a list of {num_stages} numbers, got {cost!r}")
    for c in costs:
        if not (math.isfinite(c) and c > 0):
            raise ValueError(f"{name} entries must be finite numbers > 0, got {cost!r}")
    return costs


def peak_inflight(schedule: Schedule, *, until: str | None = None) -> tuple[int, ...]:
    """Most (stage, microbatch) pairs with forward done and backward pending, per rank.

    A pair is released by its last backward action: ``W`` in a split-backward schedule, else ``B``;
    ``until="B"`` counts up to ``B`` in every schedule (:attr:`Simulation.peak_activations`).
    Depends only on each rank's action order, not on timing.
    """
    release = until or (WEIGHT if schedule.split_backward else BACKWARD)
    peaks = []
    for actions in schedule.ranks:
        live = peak = 0
        for a in actions:
            live += 1 if a.op == FORWARD else -1 if a.op == release else 0
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def action_deps(op: str, stage: int, mb: int, *, num_stages: int) -> list[tuple[str, int, int]]:
    """The actions whose outputs ``(op, stage, mb)`` consumes: a forward the previous stage's forward; a
    backward its own forward and the next stage's backward; a weight-gradient action its backward."""
    deps = [(FORWARD, stage - 1, mb)] if op == FORWARD and stage > 0 else []
    if op == BACKWARD:
        deps.append((FORWARD, stage, mb))
        if stage < num_stages - 1:
            deps.append((BACKWARD, stage + 1, mb))
    elif op == WEIGHT:
        deps.append((BACKWARD, stage, mb))
    return deps


def dataflow_times(order: Sequence[Sequence[tuple[str, int, int]]], *, pp: int, num_stages: int,
                   fwd: Sequence[float], bwd: Sequence[float], latency: float = 0.0,
                   wgt: Sequence[float] | None = None, placement: str = "loop"
                   ) -> list[list[tuple[float, float]]]:
    """Start/end of every action when communication never blocks (the "async" model).

    ``order[r]`` is rank ``r``'s ``(op, stage, microbatch)`` sequence; ``fwd``/``bwd`` give one cost
    per virtual stage (``wgt`` the ``W`` costs of a split-backward order; ``placement`` which rank
    holds each stage). Each action starts when its rank is free and its inputs exist (an input from
    another rank ``latency`` after its producer ends). Raises ``ScheduleError`` if the orders
    deadlock on their own dependencies.
    """
    cost = {FORWARD: fwd, BACKWARD: bwd, WEIGHT: wgt}
    end: dict[tuple[str, int, int], float] = {}
    pos = [0] * pp
    clock = [0.0] * pp
    times: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    remaining = sum(len(ops) for ops in order)
    while remaining:
        progressed = False
        for rank, ops in enumerate(order):
            # Run this rank as far as its inputs allow.
            while pos[rank] < len(ops):
                op, stage, mb = ops[pos[rank]]
                deps = action_deps(op, stage, mb, num_stages=num_stages)
                if any(d not in end for d in deps):
                    break
                start = max([clock[rank]] + [
                    end[d] + (latency if stage_rank(d[1], pp=pp, placement=placement) != rank else 0.0)
                    for d in deps])
                clock[rank] = end[(op, stage, mb)] = start + cost[op][stage]
                times[rank].append((start, clock[rank]))
                pos[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            rank = next(r for r in range(pp) if pos[r] < len(order[r]))
            op, stage, mb = order[rank][pos[rank]]
            raise ScheduleError(rank, f"{op}{stage}.{mb}", "its inputs are never produced: the "
                                "action orders deadlock on their data dependencies")
    return times


def blocking_times(schedule: Schedule, *, fwd: Sequence[float], bwd: Sequence[float],
                   latency: float = 0.0, wgt: Sequence[float] | None = None
                   ) -> tuple[list[list[tuple[float, float]]], list[float]]:
    """Start/end of every action under the runtime's batch semantics (the "blocking" model).

    A rank reaching the boundary before action ``i`` posts ``actions[i-1].sends + actions[i].recvs``;
    each message completes ``latency`` after both its send and its receive are posted; the batch
    completes when all its messages have (at once if empty); then action ``i`` runs. Returns the
    per-rank (start, end) lists and each rank's finishing time (its last batch included).
    """
    cost = {FORWARD: fwd, BACKWARD: bwd, WEIGHT: wgt}
    pp = schedule.pp
    posted: dict[tuple[str, int, int, int], float] = {}   # (op, src, dst, seq) -> post time
    counts: dict[tuple[str, int, int], int] = {}
    batch: list[list[tuple[str, int, int, int]] | None] = [None] * pp
    boundary = [0] * pp
    clock = [0.0] * pp
    finish: list[float | None] = [None] * pp
    times: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    while any(f is None for f in finish):
        progressed = False
        for rank, actions in enumerate(schedule.ranks):
            if finish[rank] is not None:
                continue
            b = boundary[rank]
            if batch[rank] is None:
                ops = (list(actions[b - 1].sends) if b > 0 else []) + \
                    (list(actions[b].recvs) if b < len(actions) else [])
                batch[rank] = []
                for p in ops:
                    src, dst = (rank, p.peer) if p.op == SEND else (p.peer, rank)
                    seq = counts.get((p.op, src, dst), 0)
                    counts[(p.op, src, dst)] = seq + 1
                    posted[(p.op, src, dst, seq)] = clock[rank]
                    batch[rank].append((RECV if p.op == SEND else SEND, src, dst, seq))
                progressed = True
            if any(key not in posted for key in batch[rank]):
                continue
            ready = max([clock[rank]] + [posted[key] + latency for key in batch[rank]])
            batch[rank] = None
            boundary[rank] += 1
            progressed = True
            if b == len(actions):
                finish[rank] = ready
                continue
            a = actions[b]
            clock[rank] = ready + cost[a.op][a.stage]
            times[rank].append((ready, clock[rank]))
        assert progressed, "validated schedule made no progress"
    return times, finish


def simulate(schedule: Schedule, *, fwd_cost, bwd_cost, wgrad_cost=None, p2p_latency: float = 0.0,
             comm: str = "async") -> Simulation:
    """Simulate ``schedule`` (validated first; a broken one raises ``ScheduleError``).

    ``fwd_cost``/``bwd_cost``: time of one forward/backward of one virtual stage on one microbatch,
    a scalar or a list with one entry per virtual stage. ``p2p_latency``: time for a message to
    reach another rank (>= 0). ``comm="async"`` (default): communication never blocks a rank, the
    ideal of the analytic formulas (:func:`dataflow_times`); ``comm="blocking"``: the runtime's
    batch-and-wait semantics with rendezvous sends (:func:`blocking_times`).

    ``wgrad_cost`` (scalar or per stage): the weight-gradient part of the backward. A split-backward
    schedule needs it (``B`` costs ``bwd_cost``, ``W`` costs ``wgrad_cost``); for the others it is
    optional and their ``B`` (input and weight gradients together) costs ``bwd_cost + wgrad_cost``,
    so every schedule can be compared at the same ``F``, ``B``, ``W`` costs.
    """
    validate(schedule)
    num_stages = schedule.num_stages
    fwd = _per_stage("fwd_cost", fwd_cost, num_stages)
    bwd = _per_stage("bwd_cost", bwd_cost, num_stages)
    wgt = None
    if wgrad_cost is not None:
        wgt = _per_stage("wgrad_cost", wgrad_cost, num_stages)
        if not schedule.split_backward:
            bwd, wgt = tuple(b + w for b, w in zip(bwd, wgt)), None
    elif schedule.split_backward:
        raise ValueError(f"schedule {schedule.name!r} splits the backward into B (input gradients) and W "
                         "(weight gradients): give wgrad_cost, the time of one W (e.g. equal to bwd_cost)")
    if isinstance(p2p_latency, bool) or not isinstance(p2p_latency, (int, float)) \
            or not (math.isfinite(p2p_latency) and p2p_latency >= 0):
        raise ValueError(f"p2p_latency must be a finite number >= 0, got {p2p_latency!r}")
    if comm == "async":
        order = [[a.key for a in actions] for actions in schedule.ranks]
        times = dataflow_times(order, pp=schedule.pp, num_stages=num_stages, fwd=fwd, bwd=bwd, wgt=wgt,
                               latency=float(p2p_latency), placement=schedule.placement)
        finish = [ts[-1][1] if ts else 0.0 for ts in times]
    elif comm == "blocking":
        times, finish = blocking_times(schedule, fwd=fwd, bwd=bwd, wgt=wgt, latency=float(p2p_latency))
    else:
        raise ValueError(f"comm must be 'async' or 'blocking', got {comm!r}")

    timelines = tuple(tuple(TimelineEntry(start, end, a) for (start, end), a in zip(ts, actions))
                      for ts, actions in zip(times, schedule.ranks))
    makespan = max(finish)
    compute = tuple(sum(e.end - e.start for e in tl) for tl in timelines)
    busiest = max(compute)
    return Simulation(
        timelines=timelines,
        makespan=makespan,
        compute=compute,
        bubble_ratio=(makespan - busiest) / busiest,
        idle_ratio=tuple((makespan - c) / c for c in compute),
        peak_inflight=peak_inflight(schedule),
        peak_activations=peak_inflight(schedule, until=BACKWARD),
    )
