"""Collective matmuls for sequence-parallel linears: communication hidden under the GEMMs.

``parallel.tp_overlap = "ring"`` replaces the sequence-parallel all-gather / reduce-scatter around
each TP linear by rounds of p2p transfers between ring neighbours, each round's transfers in flight
while the round's GEMMs run (Wang et al. 2023, "Overlap communication with dependent computation via
decomposition"; TransformerEngine's userbuffers ring exchange). The ring is bidirectional: a chunk
travels clockwise (r -> r+1) and one counter-clockwise (r -> r-1) per round, so the p - 1 other
chunks arrive in p // 2 rounds (one at tp 2, two at tp 4) with the one-way ring's bytes:

    column-parallel forward   y = all_gather(x) @ W^T        (s/tp, b, in) -> (s, b, out/tp)
        round k: multiply the chunks that arrived in round k-1 (this rank's own first) while they
        travel on and the next ones arrive.
    row-parallel forward      y = reduce_scatter(x @ W^T)    (s, b, in/tp) -> (s/tp, b, out)
        round k: compute this rank's terms of the chunks the next round sends (of its own chunk in
        the last) while the running sums travel; add them on arrival; rank r ends with chunk r's sum.
    column backward           the weight gradient's regather of the saved input shard (as Megatron
        regathers) and the input gradient's reduce-scatter of dy[c] @ W run as ONE fused ring: one
        batch of transfers and one wait per round, with a dW and a dx GEMM under it.
    row backward              a gather ring of dy: dx[c] = dy_c W and dW += dy_c^T x[c] as dy_c arrives.

Bytes: p - 1 transfers of one (s/tp, b, h) chunk each way per ring: exactly the ring all-gather's and
reduce-scatter's (p - 1)/p of the full tensor, recorded in the ledger as send/recv on the tp axis.
Results: every output element is the same products; the forward column output is bit for bit the
plain path's; sums over chunks (weight gradients, reduce-scatter) are added in another order:
fp32 summation tolerance. At tp 2 a reduce-scatter adds two terms, in either order the same float:
there the row output and the input gradients are bit for bit too; the weight gradients (accumulated
over chunks in fp32) are not.

Overlap needs the transfers to progress while the GEMM runs: on gloo they run on gloo's own
threads; on CUDA, NCCL p2p runs on its internal stream, so the GEMM on the compute stream overlaps
it. ``symm_mem`` runs the same decomposition through PyTorch's symmetric-memory ops
(parallel/tensor_parallel/symm_mem.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel import comm
from parallel.comm import Group
from parallel.mappings import copy_to_tp, gather_from_tp, reduce_from_tp
from parallel.tensor_parallel.layers import LinearImpl

TP_OVERLAP = ("none", "ring", "symm_mem")


def ring_rounds(p: int) -> tuple[int, int]:
    """``(cw, ccw)``: how many chunks reach a rank clockwise (from r-1) and counter-clockwise (from r+1).

    A bidirectional ring moves the other p - 1 chunks in ``cw = p // 2`` rounds: each round one chunk
    travels each way (the last round of an even p only clockwise), so every rank still sends p - 1
    chunks in all (the ring's bytes), but waits ``p // 2`` times instead of ``p - 1``: at p = 2 it is the
    one-way ring (one round), at p = 4 two rounds instead of three.
    """
    return p // 2, (p - 1) // 2


class _BidirectionalRing:
    """Round k of a ring running both ways: ``cw`` travels to rank r+1, ``ccw`` (while k < ccw_rounds) to
    r-1; the arriving tensors land in ``cw_in`` / ``ccw_in``. Subclasses set ``group``, ``ccw_rounds``,
    ``cw`` and ``ccw``, and say what a round computes and does with what arrived."""

    def sends(self, k: int) -> list:
        p, r = self.group.size, self.group.rank
        self.cw_in = torch.empty_like(self.cw)
        ops = [comm.P2P("send", self.cw, (r + 1) % p), comm.P2P("recv", self.cw_in, (r - 1) % p)]
        if k < self.ccw_rounds:
            self.ccw_in = torch.empty_like(self.ccw)
            ops += [comm.P2P("send", self.ccw, (r - 1) % p), comm.P2P("recv", self.ccw_in, (r + 1) % p)]
        return ops


class _GatherRing(_BidirectionalRing):
    """Every rank's sequence chunk, delivered to ``consume(chunk, c)`` (``shard`` is this rank's, c its
    group rank): round k receives chunk r-1-k from r-1 and (while k < ccw) chunk r+1+k from r+1, and
    forwards what it received the round before. Each chunk is consumed while the next round is in
    flight; consumption order: own, r-1, r+1, r-2, r+2, ... (own, then r-1 at p = 2)."""

    def __init__(self, shard: torch.Tensor, group: Group, consume):
        self.group, self.consume = group, consume
        self.rounds, self.ccw_rounds = ring_rounds(group.size)
        shard = shard.contiguous()
        self.cw = self.ccw = shard  # what each direction forwards next
        self.fresh = [(shard, group.rank)]  # received, not consumed yet

    def compute(self, k: int | None = None) -> None:
        for chunk, c in self.fresh:
            self.consume(chunk, c)
        self.fresh = []

    def arrived(self, k: int) -> None:
        p, r = self.group.size, self.group.rank
        self.cw = self.cw_in
        self.fresh.append((self.cw, (r - 1 - k) % p))
        if k < self.ccw_rounds:
            self.ccw = self.ccw_in
            self.fresh.append((self.ccw, (r + 1 + k) % p))

    def finish(self) -> None:
        self.compute()  # the last round's chunks: nothing left to hide under


class _ReduceScatterRing(_BidirectionalRing):
    """The sum over ranks of ``partial(c)`` (this rank's term of sequence chunk c) for c = this rank.
    Chunk c's terms travel to rank c from c-cw .. c-1 clockwise and from c+1 .. c+ccw counter-
    clockwise, each rank adding its own term before forwarding; the GEMM of the next term runs while
    the running sums are in flight. Rank r ends with (clockwise sum + own term) + counter-clockwise
    sum; at p = 2, ``incoming + own``, the one-way ring's order."""

    def __init__(self, group: Group, partial):
        p, r = group.size, group.rank
        self.group, self.partial = group, partial
        self.rounds, self.ccw_rounds = ring_rounds(p)
        self.cw = partial((r + self.rounds) % p)  # the farthest chunk each way: nothing in flight yet
        self.ccw = partial((r - self.ccw_rounds) % p) if self.ccw_rounds else None

    def compute(self, k: int) -> None:
        p, r = self.group.size, self.group.rank
        self.cw_part = self.partial((r + self.rounds - 1 - k) % p)  # the next clockwise chunk; own at the end
        if k + 1 < self.ccw_rounds:
            self.ccw_part = self.partial((r - self.ccw_rounds + 1 + k) % p)

    def arrived(self, k: int) -> None:
        self.cw = self.cw_in + self.cw_part  # running sum, then this rank's term
        if k < self.ccw_rounds:
            self.ccw = self.ccw_in + self.ccw_part if k + 1 < self.ccw_rounds else self.ccw_in

    def finish(self) -> torch.Tensor:
        return self.cw if self.ccw is None else self.cw + self.ccw


def run_rings(group: Group, *rings, under_first=None) -> None:
    """Run rings of the same group in lockstep: each round's transfers of every ring go out in ONE
    batch, every ring's compute runs under them, then one wait. Fusing two rings (a column-parallel
    backward's regather of x and reduce-scatter of dx) halves the waits and puts two GEMMs under each.
    ``under_first``: work with no transfer of its own, run under the first round's (a weight gradient
    whose operands are all local)."""
    for k in range(rings[0].rounds):
        works = comm.batch_p2p([op for ring in rings for op in ring.sends(k)], group)
        for ring in rings:
            ring.compute(k)  # under the transfer
        if k == 0 and under_first is not None:
            under_first()
        comm.wait(works, group)
        for ring in rings:
            ring.arrived(k)


def ring_all_gather(shard: torch.Tensor, group: Group, consume) -> None:
    """Call ``consume(chunk, c)`` for every rank's sequence chunk c (``shard`` is this rank's), each
    while the next round is in flight. p - 1 transfers of ``shard``'s size, in p // 2 rounds."""
    ring = _GatherRing(shard, group, consume)
    run_rings(group, ring)
    ring.finish()


def ring_reduce_scatter(group: Group, partial, *, under_first=None) -> torch.Tensor:
    """The sum over ranks of ``partial(c)`` for c = this rank: ``partial(c)`` is this rank's
    contribution to sequence chunk c, computed while the previous running sums travel."""
    ring = _ReduceScatterRing(group, partial)
    run_rings(group, ring, under_first=under_first)
    return ring.finish()


def _chunk(t: torch.Tensor, c: int, n: int) -> torch.Tensor:
    return t[c * n:(c + 1) * n]  # (n, ...) rows of sequence chunk c


class _RingColumn(torch.autograd.Function):
    """(s/tp, b, in) -> (s, b, out/tp) = all_gather(x) @ W^T + b, as a ring."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x_shard, weight)
        n = x_shard.shape[0]
        y = x_shard.new_empty((n * group.size, *x_shard.shape[1:-1], weight.shape[0]))  # (s, b, out/tp)

        def consume(chunk, c):
            _chunk(y, c, n).copy_(F.linear(chunk, weight, bias))
        ring_all_gather(x_shard, group, consume)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_shard, weight = ctx.saved_tensors
        group, n = ctx.group, x_shard.shape[0]
        dy = dy.contiguous()  # (s, b, out/tp)
        grad_x = grad_w = grad_b = None
        rings = []
        if ctx.needs_input_grad[1]:
            acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)

            def consume(chunk, c):
                g = _chunk(dy, c, n)
                acc.add_((g.reshape(-1, g.shape[-1]).t() @ chunk.reshape(-1, chunk.shape[-1])).float())
            rings.append(_GatherRing(x_shard, group, consume))  # regather the input shard for dW
        if ctx.needs_input_grad[0]:
            rings.append(_ReduceScatterRing(group, lambda c: _chunk(dy, c, n) @ weight))  # dx: (s/tp, b, in)
        if rings:
            # Both rings in lockstep: one batch of transfers and one wait per round, the dW and dx
            # GEMMs of the round under it (the summation orders are each ring's own).
            run_rings(group, *rings)
        for ring in rings:
            if isinstance(ring, _GatherRing):
                ring.finish()
                grad_w = acc.to(weight.dtype)
            else:
                grad_x = ring.finish()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy.reshape(-1, dy.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b, None


class _RingRow(torch.autograd.Function):
    """(s, b, in/tp) -> (s/tp, b, out) = reduce_scatter(x @ W^T), as a ring."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        n = x.shape[0] // group.size
        return ring_reduce_scatter(group, lambda c: F.linear(_chunk(x, c, n), weight))  # (s/tp, b, out)

    @staticmethod
    def backward(ctx, dy_shard):
        x, weight = ctx.saved_tensors
        group, n = ctx.group, x.shape[0] // ctx.group.size
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] \
            else None

        def consume(g, c):  # g: (s/tp, b, out), chunk c of the gathered output gradient
            if grad_x is not None:
                _chunk(grad_x, c, n).copy_(g @ weight)
            if acc is not None:
                xc = _chunk(x, c, n)
                acc.add_((g.reshape(-1, g.shape[-1]).t() @ xc.reshape(-1, xc.shape[-1])).float())
        ring_all_gather(dy_shard.contiguous(), group, consume)
        return grad_x, (acc.to(weight.dtype) if acc is not None else None), None


class CollectiveMatmulImpl(LinearImpl):
    """A ``LinearImpl`` that decomposes the sequence-parallel all-gather and reduce-scatter around the GEMMs
    (``_column``, ``_row``; ``kind`` names it in errors). Without sequence parallelism (or at tp = 1) a layer
    runs the plain path: there is no sequence collective to decompose."""

    overlap_comm = True
    kind = ""

    def _column(self, x, weight, bias, group):  # (s/tp, b, in) -> (s, b, out/tp)
        raise NotImplementedError

    def _row(self, x, weight, group):  # (s, b, in/tp) -> (s/tp, b, out)
        raise NotImplementedError

    def column_forward(self, x, weight, bias, *, group, sequence_parallel, gather_output):
        if sequence_parallel and group.size > 1:
            y = self._column(x, weight, bias, group)
        else:
            y = F.linear(copy_to_tp(x, group), weight, bias)
        return gather_from_tp(y, group) if gather_output else y

    def row_forward(self, x, weight, bias, *, group, sequence_parallel):
        if sequence_parallel and group.size > 1:
            if x.shape[0] % group.size:
                raise ValueError(f"{self.kind} row-parallel linear: sequence length {x.shape[0]} is not divisible by "
                                 f"tp={group.size}; pad or pack sequences to a multiple of it")
            y = self._row(x, weight, group)
        else:
            y = reduce_from_tp(F.linear(x, weight), group)
        return y if bias is None else y + bias


class RingLinearImpl(CollectiveMatmulImpl):
    """``parallel.tp_overlap = "ring"``: sequence-parallel TP linears as ring collective matmuls."""

    kind = "ring"

    def _column(self, x, weight, bias, group):
        return _RingColumn.apply(x, weight, bias, group)

    def _row(self, x, weight, group):
        return _RingRow.apply(x, weight, group)

    def __repr__(self) -> str:
        return "RingLinearImpl()"


def check_tp_overlap(mode: str, *, tp: int, sequence_parallel: bool, device_type: str, fp8: str = "none") -> None:
    """Start-up check of ``parallel.tp_overlap`` (before any process group). ``device_type``: "cpu" or
    "cuda" where the run's device is known, "any" in the config's own check (which cannot know it)."""
    if mode not in TP_OVERLAP:
        raise ValueError(f"parallel.tp_overlap={mode!r} is not one of {TP_OVERLAP}")
    if mode == "none":
        return
    if tp < 2 or not sequence_parallel:
        raise ValueError(f"parallel.tp_overlap={mode!r} decomposes the sequence-parallel all-gather and "
                         f"reduce-scatter, so it needs parallel.tp >= 2 and parallel.sequence_parallel = true "
                         f"(got tp={tp}, sequence_parallel={str(sequence_parallel).lower()}); set them or "
                         "parallel.tp_overlap = 'none'")
    if mode == "symm_mem":
        if fp8 != "none":
            raise ValueError(f"model.fp8={fp8!r} with parallel.tp_overlap='symm_mem': the FP8 linears have no "
                             "symmetric-memory collective matmul (PyTorch's scaled variants are not wired); use "
                             "parallel.tp_overlap = 'ring', which FP8 runs as an FP8 ring")
        if device_type == "cpu":
            raise ValueError("parallel.tp_overlap='symm_mem' needs CUDA GPUs with peer access (NVLink): there is no "
                             "symmetric memory on the CPU (gloo); use parallel.tp_overlap = 'ring'")
        if device_type == "cuda":
            from parallel.tensor_parallel.symm_mem import check_platform
            try:
                check_platform(tp)
            except RuntimeError as e:
                raise ValueError(str(e)) from None
