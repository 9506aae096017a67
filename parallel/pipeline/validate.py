"""Validator for pipeline schedules (the action format is in :mod:`parallel.pipeline.actions`).

:func:`validate` accepts a schedule only if running it cannot go wrong:

1. structure: one action list per rank; every action's stage lives on the rank that runs it
   (``stage % pp``) and its ids are in range; every message names the right peer and a tensor that
   really crosses ranks;
2. coverage: every microbatch gets exactly one ``F`` and one ``B`` (only the ``F`` in a forward-only
   schedule) on every virtual stage, plus exactly one ``W`` in a split-backward schedule (and none
   elsewhere), and every
   tensor crossing ranks is sent exactly once and received exactly once;
3. execution: the schedule is run the way a runtime runs it (per rank, in order; before action
   ``i`` one batch of ``actions[i-1].sends + actions[i].recvs`` that must fully complete), with the
   strictest transport: a send completes only when its receiver has posted the matching receive
   (rendezvous), and messages between two ranks match first-in first-out. It checks that
   ``F{s}.{m}`` runs after ``F{s-1}.{m}`` (its input was received or computed locally), that
   ``B{s}.{m}`` runs after ``B{s+1}.{m}`` and ``F{s}.{m}``, that ``W{s}.{m}`` runs after
   ``B{s}.{m}`` (same rank), that a send is posted only after its
   tensor exists, that paired messages name the same tensor, and that no state is reached where
   every unfinished rank waits (deadlock).

The first violation raises :class:`ScheduleError` naming the rank, the action and the reason.
"""
from __future__ import annotations

from collections import Counter

from parallel.pipeline.actions import (ACTIVATION, BACKWARD, FORWARD, GRADIENT, PLACEMENTS, RECV, SEND,
                                       WEIGHT, P2P, Schedule, ScheduleError, p2p_plan)

__all__ = ["ScheduleError", "validate"]


def _tensor_name(kind: str, stage: int, mb: int) -> str:
    return f"{kind}{stage}.{mb}"


def _cross_rank_tensors(sched: Schedule) -> dict[tuple[str, int, int], tuple[int, int]]:
    """Every tensor that must travel between ranks -> (producer rank, consumer rank)."""
    out = {}
    last = sched.num_stages - 1
    for s in range(sched.num_stages):
        for mb in range(sched.microbatches):
            if s < last and sched.rank_of(s) != sched.rank_of(s + 1):
                out[(ACTIVATION, s, mb)] = (sched.rank_of(s), sched.rank_of(s + 1))
            if s > 0 and sched.rank_of(s) != sched.rank_of(s - 1) and not sched.forward_only:
                out[(GRADIENT, s, mb)] = (sched.rank_of(s), sched.rank_of(s - 1))
    return out


def _check_structure(sched: Schedule) -> None:
    if len(sched.ranks) != sched.pp:
        raise ScheduleError(None, None, f"has {len(sched.ranks)} rank action lists but pp={sched.pp}")
    if sched.placement not in PLACEMENTS or (sched.placement == "v" and sched.vp != 2):
        raise ScheduleError(None, None, f"placement {sched.placement!r} is not one of {PLACEMENTS} "
                            "('v' needs vp=2)")
    crossing = _cross_rank_tensors(sched)
    for rank, actions in enumerate(sched.ranks):
        for a in actions:
            if a.op not in (FORWARD, BACKWARD, WEIGHT):
                raise ScheduleError(rank, str(a), f"op must be 'F', 'B' or 'W', got {a.op!r}")
            if a.op == WEIGHT and not sched.split_backward:
                raise ScheduleError(rank, str(a), "a W action in a schedule without split backward "
                                    "(its B computes the weight gradients already)")
            if a.op == WEIGHT and a.sends:
                raise ScheduleError(rank, str(a), "a W action produces nothing another rank needs: "
                                    "it sends nothing")
            if a.op == BACKWARD and sched.forward_only:
                raise ScheduleError(rank, str(a), "a forward-only schedule has no backward actions")
            if not 0 <= a.stage < sched.num_stages or not 0 <= a.microbatch < sched.microbatches:
                raise ScheduleError(rank, str(a), f"stage must be in [0, {sched.num_stages}) and "
                                    f"microbatch in [0, {sched.microbatches})")
            if sched.rank_of(a.stage) != rank:
                raise ScheduleError(rank, str(a), f"stage {a.stage} lives on rank "
                                    f"{sched.rank_of(a.stage)} (stage % pp), not on rank {rank}")
            for p2p, op in [(p, RECV) for p in a.recvs] + [(p, SEND) for p in a.sends]:
                _check_message(sched, crossing, rank, str(a), p2p, op)


def _check_message(sched: Schedule, crossing: dict, rank: int, label: str, p2p: P2P, op: str) -> None:
    if not isinstance(p2p, P2P) or p2p.op != op:
        raise ScheduleError(rank, label, f"{'recvs' if op == RECV else 'sends'} must hold "
                            f"P2P(op={op!r}, ...) entries, got {p2p!r}")
    if p2p.tensor not in crossing:
        raise ScheduleError(rank, label, f"'{p2p}' names {_tensor_name(*p2p.tensor)}, which is "
                            "not a tensor crossing ranks in this schedule")
    producer, consumer = crossing[p2p.tensor]
    me, peer = (producer, consumer) if op == SEND else (consumer, producer)
    if rank != me or p2p.peer != peer:
        raise ScheduleError(rank, label, f"'{p2p}': {_tensor_name(*p2p.tensor)} goes from rank "
                            f"{producer} to rank {consumer}")


def _check_coverage(sched: Schedule) -> None:
    seen: dict[tuple[str, int, int], int] = {}
    for rank, actions in enumerate(sched.ranks):
        for i, a in enumerate(actions):
            if a.key in seen:
                raise ScheduleError(rank, str(a), f"duplicated: runs at positions {seen[a.key]} and "
                                    f"{i} (every microbatch needs exactly one F and one B per stage)")
            seen[a.key] = i
    ops = (FORWARD,) if sched.forward_only else (FORWARD, BACKWARD)
    ops += (WEIGHT,) if sched.split_backward else ()
    for s in range(sched.num_stages):
        for mb in range(sched.microbatches):
            for op in ops:
                if (op, s, mb) not in seen:
                    raise ScheduleError(sched.rank_of(s), f"{op}{s}.{mb}", "missing: no rank runs "
                                        "it (every microbatch needs one " + ", one ".join(ops)
                                        + " per stage)")
    sends = Counter(p.tensor for acts in sched.ranks for a in acts for p in a.sends)
    recvs = Counter(p.tensor for acts in sched.ranks for a in acts for p in a.recvs)
    for tensor, (producer, consumer) in sorted(_cross_rank_tensors(sched).items(),
                                               key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        name = _tensor_name(*tensor)
        for count, side, rank in ((sends, "sent", producer), (recvs, "received", consumer)):
            if count[tensor] != 1:
                what = "never" if count[tensor] == 0 else f"{count[tensor]} times"
                raise ScheduleError(rank, None, f"{name} is {side} {what} (it must be {side} "
                                    f"exactly once between rank {producer} and rank {consumer})")


class _Execution:
    """All ranks running their lists in order under a :func:`p2p_plan` (step 3 of :func:`validate`):
    at each boundary a rank posts the plan's messages, then blocks until the plan's waits are matched."""

    def __init__(self, sched: Schedule, *, early_recv: bool = False):
        self.sched = sched
        self.actions = sched.ranks
        self.plans = [p2p_plan(sched, r, early_recv=early_recv) for r in range(sched.pp)]
        self.boundary = [0] * sched.pp            # batch index reached on each rank
        self.pending = [None] * sched.pp          # posted, unmatched (seq, channel, P2P), all boundaries so far
        self.matched = [set() for _ in range(sched.pp)]  # P2Ps of each rank that completed
        self.done = [False] * sched.pp
        self.produced = [set() for _ in range(sched.pp)]   # (op, stage, mb) computed per rank
        self.received = [set() for _ in range(sched.pp)]   # tensors received per rank
        self.posted = {SEND: {}, RECV: {}}        # channel (src, dst) -> [(rank, action label, P2P)]

    def _post(self, rank: int) -> None:
        if self.pending[rank] is None:
            self.pending[rank] = []
        for p2p, label in self.plans[rank][self.boundary[rank]].post:
            self._post_one(rank, p2p, label)

    def _blocked(self, rank: int) -> list[P2P]:
        """The current boundary's waits that have not completed."""
        return [p for p in self.plans[rank][self.boundary[rank]].wait if p not in self.matched[rank]]

    def _post_one(self, rank: int, p2p: P2P, label: str) -> None:
        if p2p.op == SEND:
            needs = (FORWARD if p2p.kind == ACTIVATION else BACKWARD, p2p.stage, p2p.microbatch)
            if needs not in self.produced[rank]:
                raise ScheduleError(rank, label, f"'{p2p}' is posted after {label} but "
                                    f"{needs[0]}{needs[1]}.{needs[2]} has not run on this rank")
            channel = (rank, p2p.peer)
        else:   # each tensor is received once (checked by _check_coverage)
            channel = (p2p.peer, rank)
        mine = self.posted[p2p.op].setdefault(channel, [])
        self.pending[rank].append((len(mine), channel, p2p))
        mine.append((rank, label, p2p))

    def _match(self, rank: int) -> bool:
        """Complete every pending message of ``rank`` whose counterpart is posted; True if any."""
        progressed = False
        for seq, channel, p2p in list(self.pending[rank]):
            other = self.posted[RECV if p2p.op == SEND else SEND].get(channel, [])
            if seq >= len(other):
                continue
            peer_rank, peer_label, peer_p2p = other[seq]
            if peer_p2p.tensor != p2p.tensor:
                my_label = self.posted[p2p.op][channel][seq][1]
                raise ScheduleError(rank, my_label, f"message #{seq} from rank {channel[0]} to rank "
                                    f"{channel[1]} is '{p2p}' here but '{peer_p2p}' on rank "
                                    f"{peer_rank} (at {peer_label}): sends and receives between "
                                    "two ranks must come in the same order on both sides")
            self.pending[rank].remove((seq, channel, p2p))
            self.pending[peer_rank].remove((seq, channel, peer_p2p))
            self.matched[rank].add(p2p)
            self.matched[peer_rank].add(peer_p2p)
            self.received[channel[1]].add(p2p.tensor)
            progressed = True
        return progressed

    def _compute(self, rank: int) -> None:
        a = self.actions[rank][self.boundary[rank]]
        needs = []
        if a.op == FORWARD and a.stage > 0:
            needs.append((ACTIVATION, a.stage - 1, (FORWARD, a.stage - 1, a.microbatch)))
        if a.op == BACKWARD:
            needs.append((None, None, (FORWARD, a.stage, a.microbatch)))
            if a.stage < self.sched.num_stages - 1:
                needs.append((GRADIENT, a.stage + 1, (BACKWARD, a.stage + 1, a.microbatch)))
        if a.op == WEIGHT:
            needs.append((None, None, (BACKWARD, a.stage, a.microbatch)))
        for kind, src_stage, producer in needs:
            if kind is None or self.sched.rank_of(src_stage) == rank:
                if producer not in self.produced[rank]:
                    raise ScheduleError(rank, str(a), f"runs before {producer[0]}{producer[1]}."
                                        f"{producer[2]} (same rank), which it depends on")
            elif (kind, src_stage, a.microbatch) not in self.received[rank]:
                raise ScheduleError(rank, str(a), "runs before "
                                    f"{_tensor_name(kind, src_stage, a.microbatch)} from rank "
                                    f"{self.sched.rank_of(src_stage)} has arrived (it must be "
                                    "received on this action or an earlier one)")
        self.produced[rank].add(a.key)

    def _advance(self, rank: int) -> bool:
        """Post/match/compute on ``rank`` as far as possible; True if anything happened."""
        progressed = False
        if self.pending[rank] is None:
            self._post(rank)
            progressed = True
        progressed |= self._match(rank)
        while not self.done[rank] and not self._blocked(rank):
            if self.boundary[rank] < len(self.actions[rank]):
                self._compute(rank)
            self.boundary[rank] += 1
            progressed = True
            if self.boundary[rank] > len(self.actions[rank]):
                self.done[rank] = True
            else:
                self._post(rank)
                self._match(rank)
        return progressed

    def run(self) -> None:
        while not all(self.done):
            progressed = False
            for rank in range(self.sched.pp):
                if not self.done[rank]:
                    progressed |= self._advance(rank)
            if not progressed:
                self._deadlock()

    def _deadlock(self) -> None:
        waits = []
        for rank in range(self.sched.pp):
            if self.done[rank]:
                continue
            actions, b = self.actions[rank], self.boundary[rank]
            where = f"before {actions[b]}" if b < len(actions) else f"after {actions[b - 1]}"
            waits.append(f"rank {rank} {where} waits on "
                         + ", ".join(f"'{p}'" for p in self._blocked(rank)))
        first = next(r for r in range(self.sched.pp) if not self.done[r])
        actions, b = self.actions[first], self.boundary[first]
        label = str(actions[b]) if b < len(actions) else str(actions[b - 1])
        raise ScheduleError(first, label, "deadlock: every unfinished rank is blocked in its batch "
                            "(a send completes only once its receiver posts the receive): "
                            + "; ".join(waits))


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` describing the first violation; return None if ``schedule`` is
    sound (see the module docstring for the rules)."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"validate expects a Schedule, got {type(schedule).__name__}")
    _check_structure(schedule)
    _check_coverage(schedule)
    _Execution(schedule).run()
    _Execution(schedule, early_recv=True).run()  # the runtime's early-receive plan must hold as well
