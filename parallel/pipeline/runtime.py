"""Execute one pipeline rank's action list on real stages (the one small runtime of DESIGN.md).

The rank walks its actions in order. At the boundary before action ``i`` it posts ONE batch of
point-to-point messages — ``actions[i-1].sends + actions[i].recvs`` — through
:func:`parallel.comm.batch_p2p` (``batch_isend_irecv``), waits for it, then computes action ``i``
(see :mod:`parallel.pipeline.actions` for the contract that makes this deadlock-free).

Memory: a forward keeps ``(input, output)`` of ``(stage, microbatch)`` until its backward. As soon
as the batch that sends an activation downstream has completed, the output's storage is released
(``output.data`` replaced by a 1-element tensor; its autograd node, which does not need it, stays)
so a sent activation never stays alive in full — the backward then runs the engine directly with
the received gradient (Megatron's "deallocate output tensor" trick). ``peak_live`` counts the
``(stage, microbatch)`` entries held at once, which the simulator's ``peak_inflight`` predicts.

The loss of each microbatch is divided by the number of microbatches before its backward, so the
accumulated gradients equal those of the mean loss over the global batch.

Split backward (``schedule.split_backward``: ZB-H1, ZB-V, DualPipeV): forwards run under
:func:`parallel.tensor_parallel.wgrad.deferrable`; ``B`` runs the backward under
:func:`~parallel.tensor_parallel.wgrad.capture`, so the TP linears queue their weight-gradient GEMMs
(with only their input and output gradient) instead of running them, and the autograd graph is freed;
``W`` runs that (stage, micro-batch)'s queue, which accumulates the gradients and fires the parameters'
post-accumulate hooks, and drops it. A pair counts in ``peak_live`` from its ``F`` to its ``W``.
``grad_sync(chunk, still_to_come=...)`` is then called before the chunk's last ``W``, with the parameters
that ``W`` will still give gradients (the ids of its queued weights): every other parameter of the chunk had
its last gradient in a ``B``, so its buckets can reduce as soon as this ``W``'s weights arrive, under the
rest of the schedule. With the V placement two consecutive
stages can share a rank: the activation and its gradient are handed over in memory.

A forward-only schedule (:func:`parallel.pipeline.schedules.forward_only`, evaluation) runs through the
same loop: nothing is kept for a backward, an output lives until the batch that sends it completes,
and the losses are recorded as they are.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from parallel import comm
from parallel.comm import Group
from parallel.pipeline.actions import ACTIVATION, BACKWARD, FORWARD, GRADIENT, P2P, SEND, WEIGHT, Schedule, p2p_plan
from parallel.tensor_parallel import wgrad

# forward_step(chunk, x, microbatch) -> Tensor. ``x`` is None on virtual stage 0 (the step reads its
# own inputs); on the last virtual stage the step returns the microbatch's scalar mean loss.
ForwardStep = Callable[[int, "torch.Tensor | None", int], torch.Tensor]


@dataclass
class PipelineResult:
    losses: list[float] = field(default_factory=list)  # per microbatch, last-stage ranks only (undivided)
    peak_live: int = 0  # most (stage, microbatch) activations held at once on this rank
    executed: list[tuple[str, int, int]] = field(default_factory=list)  # (op, stage, mb) in the order computed


def _run_backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is None:  # scalar loss
        torch.autograd.backward(output)
        return
    # Direct engine call: `output` may have had its storage released, so its shape no longer
    # matches `grad`; the autograd node only needs the gradient.
    torch.autograd.graph.Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
        (output,), (grad,), False, False, (), True, True)


def check_stage_shapes(pp_group: Group, *, in_shape: tuple[int, ...] | None, out_shape: tuple[int, ...],
                       vp: int = 1, device: torch.device | str = "cpu") -> None:
    """Check, before any pipeline traffic, that every stage boundary agrees on the tensor shape.

    ``in_shape`` is None on pipeline rank 0 for its first chunk; shapes are per microbatch. Every
    rank gathers every rank's shapes (a symmetric collective, so a mismatch raises on all ranks
    instead of leaving a receiver hanging). ``device``: where the group's backend takes tensors
    (the model's device: CUDA under NCCL).
    """
    if pp_group.size == 1:
        return
    def enc(s):
        return list(s) + [0] * (8 - len(s)) if s is not None else [-1] * 8
    mine = torch.tensor([enc(in_shape), enc(out_shape)], dtype=torch.int64, device=device)
    allsh = comm.all_gather(mine.unsqueeze(0), pp_group, dim=0)  # (pp, 2, 8)
    def dec(row):
        return None if row[0] < 0 else tuple(int(x) for x in row if x > 0)
    outs = [dec(allsh[r, 1].tolist()) for r in range(pp_group.size)]
    ins = [dec(allsh[r, 0].tolist()) for r in range(pp_group.size)]
    for r in range(pp_group.size - 1):
        if outs[r] != ins[r + 1]:
            raise ValueError(f"pipeline stage shapes do not match: rank {r} sends {outs[r]} per microbatch but "
                             f"rank {r + 1} expects {ins[r + 1]}; build every stage from the same model config, "
                             "micro batch size and sequence length")
    if vp > 1 and ins[0] != outs[-1]:
        raise ValueError(f"interleaved pipeline: the last rank sends {outs[-1]} to rank 0's next chunk, "
                         f"which expects {ins[0]}")


def run_schedule(schedule: Schedule, *, rank: int, pp_group: Group, forward_step: ForwardStep,
                 act_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
                 grad_sync: Callable[[int], None] | None = None, early_recv: bool = False) -> PipelineResult:
    """Run ``schedule.ranks[rank]`` with real tensors; gradients accumulate in the chunks' params
    (a forward-only schedule: call it under ``torch.no_grad()``; nothing is kept for a backward).

    ``act_shape`` is the per-microbatch shape of every activation crossing a stage boundary.
    ``grad_sync(chunk)`` (optional) is called right before the LAST backward of each model chunk
    (its last ``W`` with split backward), so data-parallel reduction of that chunk can be enabled for
    it (Megatron's "last microbatch" rule); it receives the chunk index. ``early_recv``: run the early-receive plan of
    :func:`parallel.pipeline.actions.p2p_plan` (receives in flight one action ahead, sends completing
    in the background) instead of the blocking one; the same messages in the same order.
    """
    if pp_group.size != schedule.pp:
        raise ValueError(f"the schedule is for pp={schedule.pp} but the pipeline group has {pp_group.size} ranks")
    actions = schedule.ranks[rank]
    last_stage = schedule.num_stages - 1
    m_total = schedule.microbatches
    held: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}  # (stage, mb) -> (in, out)
    received: dict[tuple[str, int, int], torch.Tensor] = {}
    input_grads: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> grad to send upstream
    local: dict[tuple[str, int, int], torch.Tensor] = {}  # handed to a neighbour stage on this rank (V)
    pending_w: dict[tuple[int, int], wgrad.WgradQueue] = {}  # (stage, mb) -> deferred weight gradients
    split = schedule.split_backward
    last_op = WEIGHT if split else BACKWARD  # the action that finishes a chunk's gradients
    remaining_b = {}
    for a in actions:
        if a.op == last_op:
            c = schedule.chunk_of(a.stage)
            remaining_b[c] = remaining_b.get(c, 0) + 1
    result = PipelineResult()
    forward_only = schedule.forward_only
    rank_of = schedule.rank_of

    plan = p2p_plan(schedule, rank, early_recv=early_recv)
    works: dict[P2P, object] = {}  # posted, not yet waited: P2P -> work handle
    sent_outputs: dict[P2P, torch.Tensor] = {}

    def boundary(b: int) -> None:
        """Post the plan's messages at boundary ``b``, then wait for the plan's waits."""
        ops, posted = [], []
        for p, _ in plan[b].post:
            if p.op == SEND:
                if p.kind == ACTIVATION:
                    t = held[(p.stage, p.microbatch)][1]
                    sent_outputs[p] = t
                else:
                    t = input_grads.pop((p.stage, p.microbatch))
                ops.append(comm.P2P("send", t, p.peer))
            else:
                buf = torch.empty(act_shape, dtype=dtype, device=device)
                received[p.tensor] = buf
                ops.append(comm.P2P("recv", buf, p.peer))
            posted.append(p)
        works.update(zip(posted, comm.batch_p2p(ops, pp_group)))
        comm.wait([works.pop(p) for p in plan[b].wait], pp_group)
        for p in plan[b].wait:
            if p.op == SEND and p.kind == ACTIVATION:
                t = sent_outputs.pop(p)
                if forward_only:  # sent downstream: nothing else needs it
                    held.pop((p.stage, p.microbatch), None)
                else:  # sent downstream: only the autograd node is still needed
                    t.data = torch.empty((1,), dtype=t.dtype, device=t.device)

    for i, a in enumerate(actions):
        boundary(i)
        result.executed.append(a.key)
        chunk = schedule.chunk_of(a.stage)
        key = (a.stage, a.microbatch)
        if a.op == FORWARD:
            x = None
            if a.stage > 0:
                src = local if rank_of(a.stage - 1) == rank else received
                x = src.pop((ACTIVATION, a.stage - 1, a.microbatch))
                if not forward_only:
                    x.requires_grad_()
            with wgrad.deferrable() if split else contextlib.nullcontext():
                out = forward_step(chunk, x, a.microbatch)
            if a.stage < last_stage and rank_of(a.stage + 1) == rank:
                local[(ACTIVATION, a.stage, a.microbatch)] = out.detach()
            if a.stage == last_stage:
                result.losses.append(float(out.detach()))
                out = out / m_total
            elif tuple(out.shape) != tuple(act_shape):
                raise ValueError(f"stage {a.stage} produced {tuple(out.shape)} but the pipeline sends "
                                 f"{tuple(act_shape)} per microbatch")
            if not forward_only:
                held[key] = (x, out)
            elif a.sends:  # kept until the batch that sends it completes
                held[key] = (None, out)
            result.peak_live = max(result.peak_live, len(held) + len(pending_w))
            continue
        if a.op == last_op:
            remaining_b[chunk] -= 1
            if remaining_b[chunk] == 0 and grad_sync is not None:
                if a.op == WEIGHT:  # the chunk's other gradients (norms, biases, embeddings...) came in its Bs
                    grad_sync(chunk, still_to_come={id(w) for w, _, _ in pending_w[key].items})
                else:
                    grad_sync(chunk)
        if a.op == WEIGHT:
            pending_w.pop(key).run()
            continue
        x, out = held.pop(key)
        grad = None
        if a.stage < last_stage:
            src = local if rank_of(a.stage + 1) == rank else received
            grad = src.pop((GRADIENT, a.stage + 1, a.microbatch))
        if split:
            pending_w[key] = wgrad.WgradQueue()
            with wgrad.capture(pending_w[key]):
                _run_backward(out, grad)
        else:
            _run_backward(out, grad)
        if a.stage > 0:
            assert x is not None and x.grad is not None, f"no input gradient for stage {a.stage}"
            if rank_of(a.stage - 1) == rank:
                local[(GRADIENT, a.stage, a.microbatch)] = x.grad
            else:
                input_grads[key] = x.grad
        del x, out
    boundary(len(actions))
    assert not works, "pipeline finished with messages not waited on"
    assert not held and not input_grads and not local and not pending_w, "pipeline finished with live activations"
    return result


def allreduce_tied_embedding_grads(params: list[torch.nn.Parameter], embedding_group: Group) -> None:
    """Sum the gradients of the tied input embedding (first stage) and lm-head (last stage) copies.

    ``params`` are this rank's copies: none on middle stages; one on the first and on the last rank
    of the loop placement, summed over ``embedding_group``; both on pp rank 0 under the V placement
    (zbv, dualpipev: the first and the last stage share that rank), summed in place with no collective
    (the mesh's embedding group is then this rank alone). Both copies then step identically and stay
    equal. Gradients are read from ``main_grad`` when data parallelism keeps one.
    """
    grads = []
    for p in params:
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        if g is None:
            g = torch.zeros_like(p)
            p.grad = g
        grads.append(g)
    if len(grads) > 1:  # both copies on this rank (V placement): the in-rank sum
        total = torch.stack(grads).sum(dim=0)  # (vocab_local, h): the two copies' gradients added
        for g in grads:
            g.copy_(total)
        grads = grads[:1]
        assert embedding_group.size == 1, "both tied copies on one rank, but an embedding group spans ranks"
    if embedding_group.size == 1:
        return
    for g in grads:
        comm.all_reduce(g, embedding_group)
