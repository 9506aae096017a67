"""Pipeline schedules as pure functions: ``gpipe``, ``one_f_one_b``, ``interleaved_1f1b`` and the
``build_schedule`` dispatcher. Each returns a :class:`Schedule` (types in
:mod:`parallel.pipeline.actions`): per rank, the ordered compute actions with the receives each needs
before it and the sends it makes after it. Adding a schedule = writing its per-rank compute order and
passing it to :func:`attach_messages`.
"""
from __future__ import annotations

import bisect
import math

from parallel.pipeline.actions import (ACTIVATION, BACKWARD, FORWARD, GRADIENT, RECV,
                                       SCHEDULE_NAMES, SEND, WEIGHT, Action, P2P, Schedule, rank_stages,
                                       stage_rank)
from parallel.pipeline.simulate import dataflow_times

# Costs of the ideal timeline used to place receives. Equal costs make a blocking runtime match the
# ideal exactly when forward and backward take equal time; docs/pipeline.md measures the rest.
PLACEMENT_FWD = 1.0
PLACEMENT_BWD = 1.0


# ----------------------------------------------------------------------------- argument checks


def _check_int(name: str, value, *, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__}); {fix}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}; {fix}")


def _check_pp_m(p: int, m: int) -> None:
    _check_int("pp", p, minimum=1, fix="use at least one pipeline rank")
    _check_int("microbatches", m, minimum=1, fix="use at least one microbatch")
    if m < p:
        raise ValueError(
            f"microbatches={m} is smaller than pp={p}: a pipeline needs at least one microbatch per "
            f"rank to fill; use microbatches >= {p} (e.g. {p} or {2 * p})")


def _valid_interleaved_m(m: int, p: int, n: int) -> bool:
    """Megatron-LM's rule for the interleaved schedule with microbatch group size ``n``."""
    return p <= n <= m and (m % n == 0 or m % n >= p)


def check_interleaved_args(p: int, v: int, m: int, group_size: int | None = None) -> int:
    """Validate ``(pp, vp, microbatches, group size)`` for :func:`interleaved_1f1b`; return the size.

    Rule (Megatron-LM ``forward_backward_pipelining_with_interleaving``): microbatches are taken in
    groups of ``N`` consecutive ids (``microbatch_group_size_per_vp_stage``, default ``pp``); each
    group runs through all ``vp`` model chunks before the next group starts. It needs
    ``pp <= N <= m``, and the last, shorter group (``m % N`` microbatches) must be empty or hold at
    least ``pp`` microbatches, otherwise the pipeline stalls on its own dependencies. With the
    default ``N = pp`` this is the classic "m must be a multiple of pp".
    """
    _check_pp_m(p, m)
    _check_int("vp", v, minimum=1, fix="use vp >= 1 model chunks per rank")
    n = p if group_size is None else group_size
    _check_int("microbatch_group_size", n, minimum=1, fix=f"use a value in [pp={p}, microbatches={m}]")
    if not p <= n <= m:
        raise ValueError(
            f"microbatch_group_size={n} must lie in [pp={p}, microbatches={m}]; "
            f"leave it unset for the default pp={p}")
    if _valid_interleaved_m(m, p, n):
        return n
    below = next((k for k in range(m - 1, n - 1, -1) if _valid_interleaved_m(k, p, n)), None)
    above = next(k for k in range(m + 1, m + n + 1) if _valid_interleaved_m(k, p, n))
    nearest = f"{below} or {above}" if below is not None else f"{above}"
    other_n = next(k for k in range(p, m + 1) if _valid_interleaved_m(m, p, k))
    raise ValueError(
        f"interleaved schedule: microbatches={m} is not accepted with pp={p}, "
        f"microbatch_group_size={n} (Megatron-LM rule: m % N == 0 or m % N >= pp, with "
        f"pp <= N <= m; the default N = pp means m must be a multiple of pp); nearest valid "
        f"microbatches: {nearest}; or keep microbatches={m} with microbatch_group_size={other_n}")


# ----------------------------------------------------------------------------- building actions


def attach_messages(name: str, order: list[list[tuple[str, int, int]]], *, pp: int, vp: int,
                    microbatches: int, microbatch_group_size: int | None = None,
                    forward_only: bool = False, placement: str = "loop",
                    split_backward: bool = False) -> Schedule:
    """Turn per-rank compute orders ``(op, stage, microbatch)`` into a :class:`Schedule` with messages.

    Every tensor crossing ranks (``act{s}`` from ``F{s}``, ``grad{s}`` from ``B{s}``; none when
    ``pp == 1``) is sent right after the action producing it, so the runtime can free an activation
    as soon as that batch completes. Where its receive goes is read off the ideal timeline
    (communication never blocks; forward and backward both cost 1): boundary ``i`` of a rank is open
    from the end of its action ``i - 1`` to the start of action ``i``, and the receive goes to the
    LATEST receiver boundary, no later than the consumer, that is open at some moment while the
    sender's boundary after the producer is. Both ranks are then waiting in their batches at the
    same moment, so a runtime that blocks on every batch runs exactly the ideal timeline at equal
    costs (and never deadlocks); latest keeps early-received tensors alive as briefly as possible.
    For 1F1B and GPipe this is the boundary right before the consumer (as in Megatron-LM); in
    interleaved schedules a tensor may arrive a few actions early and is kept until its consumer runs.
    ``W`` actions (``split_backward``) send nothing; ``placement`` says which rank holds each stage.
    """
    num_stages = pp * vp

    def rank_of(stage):
        return stage_rank(stage, pp=pp, placement=placement)

    position = {}                               # (op, stage, mb) -> index in its rank's list
    sends = []
    for rank, ops in enumerate(order):
        rank_sends = []
        for i, (op, stage, mb) in enumerate(ops):
            assert rank_of(stage) == rank, (op, stage, rank)
            position[(op, stage, mb)] = i
            dst = stage + 1 if op == FORWARD else stage - 1
            if op != WEIGHT and 0 <= dst < num_stages and rank_of(dst) != rank:
                kind = ACTIVATION if op == FORWARD else GRADIENT
                rank_sends.append((P2P(SEND, kind, stage, mb, rank_of(dst)),))
            else:
                rank_sends.append(())
        sends.append(rank_sends)
    times = dataflow_times(order, pp=pp, num_stages=num_stages, fwd=(PLACEMENT_FWD,) * num_stages,
                           bwd=(PLACEMENT_BWD,) * num_stages, wgt=(PLACEMENT_BWD,) * num_stages,
                           placement=placement)
    # Boundary i of a rank (the batch before its action i) is open from the end of action i - 1 to
    # the start of action i in the ideal timeline.
    opens = [[0.0] + [end for _, end in ts[:-1]] for ts in times]
    closes = [[start for start, _ in ts] for ts in times]
    recvs = [[[] for _ in ops] for ops in order]
    for src in range(pp):
        channels: dict[int, list] = {}  # dst -> the messages src -> dst in send order, with their producer's index
        for i, per_action in enumerate(sends[src]):
            for p in per_action:
                channels.setdefault(p.peer, []).append((i, p))
        for dst in sorted(channels):  # receivers in rank order, as a scan of every dst would append them
            channel = channels[dst]
            slots = []
            for i, p in channel:
                consumer = position[(FORWARD if p.kind == ACTIVATION else BACKWARD,
                                     p.consumer_stage, p.microbatch)]
                sent_at = times[src][i][1]
                sender_closes = closes[src][i + 1] if i + 1 < len(order[src]) else math.inf
                # Latest receiver boundary, not after the consumer, open while the sender's batch
                # is: receiving later would keep the tensor less long but stall the sender.
                last_open = bisect.bisect_right(opens[dst], sender_closes) - 1
                slot = min(last_open, consumer)
                # With equal placement costs every time is an integer, so the receiver's first
                # boundary closing at or after ``sent_at`` opened by then: an overlap always exists.
                assert closes[dst][slot] >= sent_at, (src, dst, i, slot)
                slots.append(slot)
            # Messages pair first-in first-out, so receives must keep the send order. They do: the
            # sender's boundary after message k closes before message k+1 is produced, hence before
            # k+1's consumer starts, so k's slot is at most k+1's consumer and k+1's latest open one.
            assert all(x <= y for x, y in zip(slots, slots[1:])), (src, dst, slots)
            for (_, p), slot in zip(channel, slots):
                recvs[dst][slot].append(P2P(RECV, p.kind, p.stage, p.microbatch, src))
    ranks = tuple(
        tuple(Action(op, stage, mb, tuple(recvs[r][i]), sends[r][i])
              for i, (op, stage, mb) in enumerate(ops))
        for r, ops in enumerate(order))
    return Schedule(name, pp, vp, microbatches, ranks, microbatch_group_size, forward_only, placement,
                    split_backward)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs all ``m`` forwards, then all ``m`` backwards (microbatch order).

    Peak in-flight microbatches per rank: ``m``. Bubble with equal stage costs: ``(p - 1) / m``.
    """
    _check_pp_m(p, m)
    order = [[(FORWARD, r, i) for i in range(m)] + [(BACKWARD, r, i) for i in range(m)]
             for r in range(p)]
    return attach_messages("gpipe", order, pp=p, vp=1, microbatches=m)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): rank ``r`` runs ``p - r - 1`` warmup forwards, then alternates one
    forward and one backward, then drains the remaining backwards. Any ``m >= p``.

    Peak in-flight microbatches on rank ``r``: ``p - r``. Bubble with equal costs: ``(p - 1) / m``.
    """
    _check_pp_m(p, m)
    order = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        ops = [(FORWARD, r, i) for i in range(warmup)]
        for i in range(m - warmup):
            ops += [(FORWARD, r, warmup + i), (BACKWARD, r, i)]
        ops += [(BACKWARD, r, i) for i in range(m - warmup, m)]
        order.append(ops)
    return attach_messages("1f1b", order, pp=p, vp=1, microbatches=m)


def interleaved_table(m: int, v: int, group_size: int) -> list[tuple[int, int]]:
    """``(microbatch, chunk)`` of every forward slot, in the order a rank runs them.

    Microbatches go in groups of ``group_size`` consecutive ids (the last group may be shorter);
    within a group all chunks run in chunk order, each over the whole group. Backward slot ``k``
    uses the same microbatch with the chunk order reversed (``v - 1 - chunk``).
    """
    table = []
    for start in range(0, m, group_size):
        group = range(start, min(start + group_size, m))
        table += [(mb, chunk) for chunk in range(v) for mb in group]
    return table


def interleaved_warmup(p: int, v: int, m: int, rank: int, group_size: int | None = None) -> int:
    """Megatron-LM's warmup forward count on ``rank``: ``2 (p - rank - 1) + (v - 1) N``, capped at
    the ``v * m`` forward slots."""
    n = p if group_size is None else group_size
    return min(2 * (p - rank - 1) + (v - 1) * n, v * m)


def interleaved_1f1b(p: int, v: int, m: int, *, group_size: int | None = None) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, as in Megatron-LM): each rank holds ``v`` model
    chunks (virtual stages ``chunk * p + rank``).

    Rank ``r`` runs ``W_r = min(2 (p - r - 1) + (v - 1) N, v m)`` warmup forwards in the order of
    :func:`interleaved_table`, then alternates forward slot ``W_r + i`` with backward slot ``i``,
    then drains. ``N = group_size`` (default ``p``); see :func:`check_interleaved_args` for which
    ``m`` are accepted. Peak in-flight (chunk, microbatch) pairs on rank ``r``: ``min(W_r + 1, v m)``.
    Bubble with equal costs and ``m % p == 0``: ``(p - 1) / (v m)``.
    """
    n = check_interleaved_args(p, v, m, group_size)
    table = interleaved_table(m, v, n)
    total = v * m
    order = []
    for r in range(p):
        warmup = interleaved_warmup(p, v, m, r, n)

        def fwd(k):
            mb, chunk = table[k]
            return (FORWARD, chunk * p + r, mb)

        def bwd(k):
            mb, chunk = table[k]
            return (BACKWARD, (v - 1 - chunk) * p + r, mb)

        ops = [fwd(k) for k in range(warmup)]
        for i in range(total - warmup):
            ops += [fwd(warmup + i), bwd(i)]
        ops += [bwd(k) for k in range(total - warmup, total)]
        order.append(ops)
    return attach_messages("interleaved", order, pp=p, vp=v, microbatches=m,
                           microbatch_group_size=n)


def forward_only(p: int, v: int, m: int, *, placement: str = "loop") -> Schedule:
    """Forward passes only (evaluation), pipelined across microbatches: every rank runs its forwards
    in the interleaved forward order (groups of ``p`` microbatches through its ``v`` chunks; plain
    microbatch order for ``v == 1``). Any ``m >= 1``; nothing is held for a backward.

    ``placement="v"`` (the stages of ``zbv`` and ``dualpipev``, ``v == 2``): rank ``r`` runs chunk 0
    (stage ``r``) then chunk 1 (stage ``2 p - 1 - r``) over each group of ``p`` microbatches, the same
    table; the validator proves it (tests/parallel/test_zero_bubble_trainer.py)."""
    if placement not in ("loop", "v"):
        raise ValueError(f"placement={placement!r} must be 'loop' or 'v'")
    _check_int("pp", p, minimum=1, fix="use at least one pipeline rank")
    _check_int("vp", v, minimum=1, fix="use vp >= 1 model chunks per rank")
    _check_int("microbatches", m, minimum=1, fix="use at least one microbatch")
    if p == 1 and v > 1:
        raise ValueError(f"vp={v} model chunks on a single pipeline rank: consecutive stages would live on the "
                         "same rank; use vp=1 when pp=1")
    if placement == "v" and v != 2:
        raise ValueError(f"the V placement has two chunks per rank; got vp={v}")
    table = interleaved_table(m, v, p)
    order = [[(FORWARD, rank_stages(r, pp=p, vp=v, placement=placement)[chunk], mb) for mb, chunk in table]
             for r in range(p)]
    return attach_messages("forward", order, pp=p, vp=v, microbatches=m, forward_only=True, placement=placement)


def build_schedule(name: str, *, pp: int, vp: int = 1, microbatches: int,
                   microbatch_group_size: int | None = None) -> Schedule:
    """Dispatch by name: ``"gpipe"``, ``"1f1b"``, ``"zb-h1"`` (all need ``vp == 1``),
    ``"interleaved"``, or ``"zbv"`` and ``"dualpipev"`` (both need ``vp == 2``: two chunks in a V)."""
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    if name in ("zb-h1", "zbv", "dualpipev"):
        from parallel.pipeline.zero_bubble import build_zero_bubble
        if microbatch_group_size is not None:
            raise ValueError(
                f"microbatch_group_size applies only to the 'interleaved' schedule (got "
                f"{microbatch_group_size} for {name!r}); leave it unset")
        return build_zero_bubble(name, pp=pp, vp=vp, microbatches=microbatches)
    if name != "interleaved":
        _check_pp_m(pp, microbatches)
        _check_int("vp", vp, minimum=1, fix="use vp=1 for this schedule")
        if vp != 1:
            raise ValueError(
                f"schedule {name!r} has one model chunk per rank but vp={vp}; use vp=1, or "
                f"schedule 'interleaved' for vp > 1")
        if microbatch_group_size is not None:
            raise ValueError(
                f"microbatch_group_size applies only to the 'interleaved' schedule (got "
                f"{microbatch_group_size} for {name!r}); leave it unset")
        return gpipe(pp, microbatches) if name == "gpipe" else one_f_one_b(pp, microbatches)
    return interleaved_1f1b(pp, vp, microbatches, group_size=microbatch_group_size)
