"""Zero-bubble pipeline schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"; DeepSeek's
DualPipeV): the backward is split into ``B`` (input gradients, which the previous stage waits for)
and ``W`` (weight gradients, which nobody waits for), and the ``W`` actions fill the bubbles.

* :func:`zb_h1`: one chunk per rank, the 1F1B order of ``F`` and ``B``; rank ``r`` keeps up to ``r``
  ``W`` pending. Bubble ``(p - 1)(F + B - W)`` instead of 1F1B's ``(p - 1)(F + B + W)``, and
  ``p`` micro-batches held at most on every rank (1F1B's peak, on its rank 0).
* :func:`zbv`: two chunks per rank in a V (``placement="v"``); at most ``2 p`` chunk micro-batches
  held per rank (``p`` whole-stage activation sets, 1F1B's peak); bubble ``(p - 1) F`` at equal
  costs (a few (p, m) miss it by some units; docs/pipeline.md lists them).
* :func:`dualpipev`: DualPipeV's eight phases (DeepSeek-AI, DualPipe repository), V placement.

Each returns a :class:`~parallel.pipeline.actions.Schedule` with ``split_backward=True``; the
formulas and when they are exact are in docs/pipeline.md ("Zero-bubble schedules").
"""
from __future__ import annotations

from parallel.pipeline.actions import BACKWARD, FORWARD, WEIGHT, Schedule, stage_rank
from parallel.pipeline.schedules import _check_int, _check_pp_m, attach_messages
from parallel.pipeline.simulate import dataflow_times

Op = tuple[str, int, int]


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1: rank ``r`` runs 1F1B's ``F``/``B`` order (``p - r - 1`` warmup forwards, then one
    forward and one input-gradient backward, then the remaining backwards) and runs the ``W`` of the
    oldest pending micro-batch as soon as more than ``r`` are pending; the rest drain at the end.

    Rank ``r`` thus holds ``p - r`` activation sets up to their ``B`` (1F1B's count) and at most
    ``p`` micro-batches up to their ``W``. Any ``m >= p``.
    """
    _check_pp_m(p, m)
    order = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        ops: list[Op] = [(FORWARD, r, i) for i in range(warmup)]
        pending: list[int] = []

        def backward(i):
            ops.append((BACKWARD, r, i))
            pending.append(i)
            while len(pending) > r:   # rank r defers at most r weight gradients
                ops.append((WEIGHT, r, pending.pop(0)))

        for i in range(m - warmup):
            ops.append((FORWARD, r, warmup + i))
            backward(i)
        for i in range(m - warmup, m):
            backward(i)
        ops += [(WEIGHT, r, i) for i in pending]
        order.append(ops)
    return attach_messages("zb-h1", order, pp=p, vp=1, microbatches=m, split_backward=True)


def zbv(p: int, m: int) -> Schedule:
    """ZB-V: two chunks per rank in a V (stage ``s < p`` on rank ``s``, stage ``s >= p`` on rank
    ``2 p - 1 - s``), built by list scheduling at unit costs (``F = B = W = 1`` per chunk): whenever
    a rank is free it runs what it can start earliest, ties broken by a priority rule, and starts a
    new ``F`` only while it holds fewer than ``2 p`` chunk micro-batches (forward done, ``W`` not
    yet): ``p`` whole-stage activation sets, 1F1B's peak. Two rules are tried and the shorter
    result kept (the first on a tie): ``B`` > ``F`` > ``W``, and ``F`` of chunk 1 > ``B`` > ``F`` of
    chunk 0 > ``W`` (lowest micro-batch first, then the later stage). Any ``m >= p``.
    """
    _check_pp_m(p, m)
    best = None
    for rule in ("backward_first", "chunk1_forward_first"):
        order = _list_schedule(p, m, limit=2 * p, rule=rule)
        span = max(_unit_ends(order, p))
        if best is None or span < best[0]:
            best = (span, order)
    return attach_messages("zbv", best[1], pp=p, vp=2, microbatches=m, placement="v", split_backward=True)


def _unit_ends(order: list[list[Op]], p: int) -> list[float]:
    """Each rank's finishing time for a V-placed split order at F = B = W = 1."""
    ones = (1.0,) * (2 * p)
    times = dataflow_times(order, pp=p, num_stages=2 * p, fwd=ones, bwd=ones, wgt=ones, placement="v")
    return [ts[-1][1] for ts in times]


def _list_schedule(p: int, m: int, *, limit: int, rule: str) -> list[list[Op]]:
    """Greedy list scheduling of a V-placed, split-backward pipeline at unit costs (see :func:`zbv`)."""
    stages = 2 * p
    rank_of = [stage_rank(s, pp=p, placement="v") for s in range(stages)]
    mine = [[s for s in range(stages) if rank_of[s] == r] for r in range(p)]
    end: dict[Op, int] = {}
    clock = [0] * p
    held = [0] * p
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    next_mb = {FORWARD: [0] * stages, BACKWARD: [0] * stages}
    order: list[list[Op]] = [[] for _ in range(p)]
    if rule == "backward_first":
        def priority(op, s):
            return {BACKWARD: 0, FORWARD: 1, WEIGHT: 2}[op]
    else:
        def priority(op, s):
            return 0 if op == FORWARD and s >= p else {BACKWARD: 1, FORWARD: 2, WEIGHT: 3}[op]

    def candidates(r):
        for s in mine[r]:
            mb = next_mb[BACKWARD][s]
            deps = [(FORWARD, s, mb)] + ([(BACKWARD, s + 1, mb)] if s < stages - 1 else [])
            if mb < m and all(d in end for d in deps):
                yield max([clock[r]] + [end[d] for d in deps]), (BACKWARD, s, mb)
            mb = next_mb[FORWARD][s]
            deps = [(FORWARD, s - 1, mb)] if s > 0 else []
            if mb < m and held[r] < limit and all(d in end for d in deps):
                yield max([clock[r]] + [end[d] for d in deps]), (FORWARD, s, mb)
        if pending_w[r]:
            s, mb = pending_w[r][0]
            yield clock[r], (WEIGHT, s, mb)

    for _ in range(3 * stages * m):
        best = None
        for r in range(p):
            for start, (op, s, mb) in candidates(r):
                key = (start, r, priority(op, s), mb, -s)
                if best is None or key < best[0]:
                    best = (key, r, (op, s, mb))
        assert best is not None, "list scheduling stalled"
        (start, *_), r, (op, s, mb) = best
        clock[r] = end[(op, s, mb)] = start + 1
        order[r].append((op, s, mb))
        if op == FORWARD:
            next_mb[FORWARD][s] += 1
            held[r] += 1
        elif op == BACKWARD:
            next_mb[BACKWARD][s] += 1
            pending_w[r].append((s, mb))
        else:
            pending_w[r].pop(0)
            held[r] -= 1
    return order


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-AI's "cut-in-half" DualPipe): V placement, and on rank ``r`` eight phases
    (``F0``/``B0`` = chunk 0, ``F1``/``B1`` = chunk 1, micro-batches in order per chunk; a ``B``
    followed at once by its ``W`` is a full backward, otherwise its ``W`` waits in a FIFO):

    1. ``2 (p - r - 1)`` x ``F0``;  2. ``r + 1`` x (``F0``, ``F1``);
    3. ``p - r - 1`` x (``B1``, ``W`` oldest, ``F1``);
    4. ``m - 2 p + r + 1`` x (``F0``, ``B1 W``, ``F1``, ``B0 W``) -- the pairs DualPipe overlaps;
    5. ``p - r - 1`` x (``B1 W``, ``F1``, ``B0 W``);
    6. ``r + 1`` x (``B1``, ``B0``), deferring ``W`` from the middle pair on (chunk 1 first on odd ranks);
    7. ``p - r - 1`` x (``W`` oldest, ``B0`` deferred);  8. the remaining ``W``.

    Needs ``m >= 2 p`` (as DualPipeV does). The simulator runs an ``F``/``B`` pair one after the
    other: DualPipe's overlap of one's compute with the other's communication is not modelled.
    """
    _check_pp_m(p, m)
    if m < 2 * p:
        raise ValueError(f"dualpipev needs microbatches >= 2 * pp = {2 * p} (its steady phase runs "
                         f"m - 2 pp + rank + 1 times), got {m}; use microbatches >= {2 * p}")
    order = []
    for r in range(p):
        stage = (r, 2 * p - 1 - r)   # chunk 0, chunk 1
        nxt = {(FORWARD, 0): 0, (FORWARD, 1): 0, (BACKWARD, 0): 0, (BACKWARD, 1): 0}
        ops: list[Op] = []
        fifo: list[tuple[int, int]] = []

        def f(c):
            ops.append((FORWARD, stage[c], nxt[(FORWARD, c)]))
            nxt[(FORWARD, c)] += 1

        def b(c, defer=False):
            mb = nxt[(BACKWARD, c)]
            nxt[(BACKWARD, c)] += 1
            ops.append((BACKWARD, stage[c], mb))
            if defer:
                fifo.append((stage[c], mb))
            else:
                ops.append((WEIGHT, stage[c], mb))

        def w():
            s, mb = fifo.pop(0)
            ops.append((WEIGHT, s, mb))

        for _ in range(2 * (p - r - 1)):
            f(0)
        for _ in range(r + 1):
            f(0)
            f(1)
        for _ in range(p - r - 1):
            b(1, defer=True)
            w()
            f(1)
        for _ in range(m - 2 * p + r + 1):
            f(0)
            b(1)
            f(1)
            b(0)
        for _ in range(p - r - 1):
            b(1)
            f(1)
            b(0)
        defer = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                defer = True
            b(1, defer)
            if i == (r + 1) // 2 and r % 2 == 0:
                defer = True
            b(0, defer)
        for _ in range(p - r - 1):
            w()
            b(0, defer=True)
        while fifo:
            w()
        order.append(ops)
    return attach_messages("dualpipev", order, pp=p, vp=2, microbatches=m, placement="v",
                           split_backward=True)


def build_zero_bubble(name: str, *, pp: int, vp: int, microbatches: int) -> Schedule:
    """``zb-h1`` (``vp == 1``), ``zbv`` or ``dualpipev`` (``vp == 2``), with argument checks."""
    _check_int("vp", vp, minimum=1, fix="use vp=1 for zb-h1 and vp=2 for zbv and dualpipev")
    want = 1 if name == "zb-h1" else 2
    if vp != want:
        raise ValueError(f"schedule {name!r} needs vp={want} ({'one chunk' if want == 1 else 'two chunks in a V'} "
                         f"per rank) but vp={vp}; set vp={want}")
    build = {"zb-h1": zb_h1, "zbv": zbv, "dualpipev": dualpipev}[name]
    return build(pp, microbatches)


def analytic_bubble(name: str, *, pp: int, vp: int, microbatches: int, fwd: float, bwd: float,
                    wgrad: float) -> tuple[str, float] | None:
    """The analytic bubble ratio ``(formula, value)`` of a schedule at equal per-stage costs ``fwd``,
    ``bwd`` (input gradients) and ``wgrad`` (weight gradients; an unsplit ``B`` costs ``bwd + wgrad``),
    no latency, or None where no exact formula is claimed (docs/pipeline.md lists where each holds).

    Idle time over compute of the busiest rank: 1F1B/GPipe ``(p-1)(F+B+W) / (m (F+B+W))``;
    interleaved ``(p-1)/(v m)``; ZB-H1 ``(p-1)(F+B-W) / (m (F+B+W))`` (needs ``W <= min(F, B)``);
    ZB-V and DualPipeV ``(p-1) F / (2 m (F+B+W))`` with chunk costs (needs ``F = B = W``).
    """
    p, v, m = pp, vp, microbatches
    f, b, w = fwd, bwd, wgrad
    if name in ("gpipe", "1f1b", "interleaved"):
        return "(p-1)/(v*m)", (p - 1) / (v * m)
    if name == "zb-h1" and w <= min(f, b):
        return "(p-1)(F+B-W)/(m(F+B+W))", (p - 1) * (f + b - w) / (m * (f + b + w))
    if name in ("zbv", "dualpipev") and f == b == w:
        return "(p-1)F/(2m(F+B+W))", (p - 1) * f / (2 * m * (f + b + w))
    return None
