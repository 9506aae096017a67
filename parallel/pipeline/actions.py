"""The data types of pipeline schedules: for every pipeline rank, the ordered list of compute
actions and the point-to-point messages each one needs.

Vocabulary (docs/pipeline.md has the full contract):

* A model is cut into ``S = pp * vp`` *virtual stages* ``s = 0 .. S-1``. Placement is Megatron's
  interleaved one: stage ``s`` lives on rank ``s % pp`` as model chunk ``s // pp``. With ``vp == 1``
  stage and rank coincide.
* ``F{s}.{m}`` runs the forward of stage ``s`` on microbatch ``m``; ``B{s}.{m}`` its backward. In a
  *split-backward* schedule (``Schedule.split_backward``: the zero-bubble ones, Qi et al. 2023)
  ``B{s}.{m}`` computes only the input gradient (what stage ``s - 1`` waits for) and ``W{s}.{m}`` the
  weight gradients, later on the same rank; W sends nothing.
* Placement ``"loop"`` (the default, Megatron's) is the one above. Placement ``"v"`` (ZB-V,
  DualPipeV: ``vp == 2``) folds the pipeline into a V: stage ``s < pp`` lives on rank ``s`` as chunk
  0, stage ``s >= pp`` on rank ``2 pp - 1 - s`` as chunk 1, so rank 0 holds the first and the last
  stage and rank ``pp - 1`` the two middle ones.
* Tensors crossing ranks are named by the action that *produces* them: ``act{s}.{m}`` is the output of
  ``F{s}.{m}`` (consumed by ``F{s+1}.{m}``); ``grad{s}.{m}`` is the input gradient from ``B{s}.{m}``
  (consumed by ``B{s-1}.{m}``).
* Every :class:`Action` carries ``recvs`` (messages that must have arrived before it runs) and
  ``sends`` (messages it emits right after it runs). A runtime executes a rank's list in order and, at
  the boundary before action ``i``, posts ONE batch: ``actions[i-1].sends + actions[i].recvs``
  (``batch_isend_irecv``), waits for all of it, then computes action ``i``; after the last action it
  posts that action's sends alone. Once a batch holding ``send act{s}.{m}`` has completed, the
  runtime may free that activation's storage (its autograd graph is still needed by ``B{s}.{m}``).
* A recv usually delivers the tensor its own action consumes; it may instead deliver one that a later
  action of the same rank consumes (received early so that its sender is not left blocked): the
  runtime keeps received tensors by ``P2P.tensor`` until their consumer runs.
* Messages between an ordered pair of ranks match first-in first-out (NCCL has no tags): the k-th
  send from rank a to rank b is the k-th receive on rank b from rank a. ``validate`` checks that this
  pairing is consistent and that the blocking execution above cannot deadlock even when every send
  waits for its receiver (rendezvous).
"""
from __future__ import annotations

from dataclasses import dataclass

FORWARD = "F"
BACKWARD = "B"
WEIGHT = "W"
ACTIVATION = "act"
GRADIENT = "grad"
SEND = "send"
RECV = "recv"

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
PLACEMENTS = ("loop", "v")


class ScheduleError(ValueError):
    """A schedule violates a rule; ``rank`` and ``action`` locate the first violation."""

    def __init__(self, rank: int | None, action: str | None, reason: str):
        self.rank, self.action, self.reason = rank, action, reason
        where = "schedule" if rank is None else f"rank {rank}"
        if action is not None:
            where += f", action {action}"
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class P2P:
    """One point-to-point message as seen by one side.

    ``kind`` is ``"act"`` or ``"grad"``; ``stage``/``microbatch`` name the tensor by the action that
    produced it (``act3.1`` = output of ``F3.1``; ``grad4.1`` = input gradient from ``B4.1``).
    ``peer`` is the other rank: the destination of a send, the source of a recv.
    """

    op: str
    kind: str
    stage: int
    microbatch: int
    peer: int

    @property
    def tensor(self) -> tuple[str, int, int]:
        """Key identifying the tensor: ``(kind, producing stage, microbatch)``."""
        return (self.kind, self.stage, self.microbatch)

    @property
    def consumer_stage(self) -> int:
        """The virtual stage that consumes the tensor (``stage + 1`` for act, ``stage - 1`` for grad)."""
        return self.stage + 1 if self.kind == ACTIVATION else self.stage - 1

    def __str__(self) -> str:
        arrow = "->" if self.op == SEND else "<-"
        return f"{self.op} {self.kind}{self.stage}.{self.microbatch}{arrow}r{self.peer}"


@dataclass(frozen=True)
class Action:
    """``F``, ``B`` or ``W`` of virtual ``stage`` on ``microbatch``, with its messages.

    ``recvs`` complete (in the batch posted just before this action) before it runs; ``sends`` are
    posted just after it (batched with the next action's recvs). ``str()`` is the compact ``F3.1``;
    ``chunk`` (the model chunk, ``stage // pp``) is in :meth:`Schedule.chunk_of`.
    """

    op: str
    stage: int
    microbatch: int
    recvs: tuple[P2P, ...] = ()
    sends: tuple[P2P, ...] = ()

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.op, self.stage, self.microbatch)

    def __str__(self) -> str:
        return f"{self.op}{self.stage}.{self.microbatch}"

    def describe(self) -> str:
        """``str()`` with the messages: ``[recv act2.1<-r1] F3.1 [send act3.1->r0]``."""
        parts = []
        if self.recvs:
            parts.append("[" + ", ".join(str(p) for p in self.recvs) + "]")
        parts.append(str(self))
        if self.sends:
            parts.append("[" + ", ".join(str(p) for p in self.sends) + "]")
        return " ".join(parts)


@dataclass(frozen=True)
class Schedule:
    """A whole pipeline schedule: ``ranks[r]`` is the ordered action list of pipeline rank ``r``.

    Stage ``s`` lives on rank ``s % pp`` (model chunk ``s // pp``) with ``placement="loop"``, and
    as the module docstring says with ``placement="v"``; ``microbatch_group_size`` is the
    interleaved schedule's group size ``N`` (``None`` for the non-interleaved schedules).
    ``forward_only``: evaluation; every microbatch gets one ``F`` per stage and no ``B``, and only
    activations cross ranks. ``split_backward``: every ``B`` is followed, later on its rank, by one
    ``W`` of the same stage and microbatch (weight gradients).
    """

    name: str
    pp: int
    vp: int
    microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    microbatch_group_size: int | None = None
    forward_only: bool = False
    placement: str = "loop"
    split_backward: bool = False

    @property
    def num_stages(self) -> int:
        return self.pp * self.vp

    def rank_of(self, stage: int) -> int:
        return stage_rank(stage, pp=self.pp, placement=self.placement)

    def chunk_of(self, stage: int) -> int:
        return stage // self.pp

    def stages_of(self, rank: int) -> list[int]:
        """The virtual stages of ``rank`` in chunk order (``stages_of(r)[c]`` is chunk ``c``)."""
        return sorted((s for s in range(self.num_stages) if self.rank_of(s) == rank), key=self.chunk_of)

    def describe(self) -> str:
        """One line per rank listing its actions with their messages."""
        lines = [f"{self.name} pp={self.pp} vp={self.vp} microbatches={self.microbatches}"]
        for rank, actions in enumerate(self.ranks):
            lines.append(f"rank {rank}: " + " | ".join(a.describe() for a in actions))
        return "\n".join(lines)


def placement_of(schedule: str) -> str:
    """The stage placement a schedule name runs with: ``"v"`` for ``zbv`` and ``dualpipev`` (two chunks
    per rank folded into a V), ``"loop"`` (Megatron's ``stage % pp``) for the others."""
    return "v" if schedule in ("zbv", "dualpipev") else "loop"


def rank_stages(rank: int, *, pp: int, vp: int, placement: str = "loop") -> list[int]:
    """The virtual stages pipeline ``rank`` holds, in chunk order (``[rank, 2 pp - 1 - rank]`` under the
    V placement; ``rank, rank + pp, ...`` under the loop placement)."""
    if placement == "v":
        assert vp == 2, f"the V placement has two chunks per rank, not vp={vp}"
        return [rank, 2 * pp - 1 - rank]
    return [rank + c * pp for c in range(vp)]


def stage_rank(stage: int, *, pp: int, placement: str = "loop") -> int:
    """The pipeline rank holding virtual ``stage``: ``stage % pp`` ("loop"), or the V fold ("v")."""
    if placement == "loop":
        return stage % pp
    assert placement == "v", placement
    return stage if stage < pp else 2 * pp - 1 - stage


@dataclass(frozen=True)
class Boundary:
    """What one rank does with messages at the boundary before action ``i`` (``i == len(actions)``:
    after the last one): ``post`` these (one ``batch_isend_irecv``, each with the label of the action
    it belongs to), then ``wait`` for these (posted here or earlier) before computing action ``i``."""

    post: tuple[tuple[P2P, str], ...]
    wait: tuple[P2P, ...]


def p2p_plan(schedule: Schedule, rank: int, *, early_recv: bool = False) -> tuple[Boundary, ...]:
    """Where each message of ``rank`` is posted and where it is waited on: ``len(actions) + 1`` boundaries.

    Blocking (``early_recv=False``, the contract in the module docstring): before action ``i`` post
    ``actions[i-1].sends + actions[i].recvs`` and wait for all of them.

    Early receives (``early_recv=True``): before action ``i`` post ``actions[i-1].sends`` and the
    receives of action ``i + 1`` (at ``i = 0`` also action 0's), so each receive is in flight during
    the action before the one that needs it; wait only for action ``i``'s receives and for the sends
    posted at the previous boundary (a send completes in the background while one action runs).
    After the last action: post its sends and wait for every send still open. Messages between two
    ranks keep their order in each direction, so they pair exactly as in the blocking plan
    (:func:`parallel.pipeline.validate.validate` checks both plans).
    """
    actions = schedule.ranks[rank]
    n = len(actions)

    def sends(i):
        return tuple((p, str(actions[i])) for p in actions[i].sends) if 0 <= i < n else ()

    def recvs(i):
        return tuple((p, str(actions[i])) for p in actions[i].recvs) if 0 <= i < n else ()

    plan = []
    for b in range(n + 1):
        if not early_recv:
            post = sends(b - 1) + recvs(b)
            plan.append(Boundary(post=post, wait=tuple(p for p, _ in post)))
            continue
        post = sends(b - 1) + (recvs(0) if b == 0 else ()) + recvs(b + 1)
        wait = tuple(p for p, _ in recvs(b)) + tuple(p for p, _ in sends(b - 2))
        if b == n:
            wait += tuple(p for p, _ in sends(n - 1))
        plan.append(Boundary(post=post, wait=wait))
    return tuple(plan)
