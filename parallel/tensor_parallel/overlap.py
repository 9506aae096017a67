"""Collective matmuls for sequence-parallel linears: communication hidden under the GEMMs.

``parallel.tp_overlap = "ring"`` replaces the sequence-parallel all-gather / reduce-scatter around
each TP linear by tp steps over a ring of p2p transfers (rank r sends to r+1, receives from r-1),
each step's transfer in flight while the step's GEMM runs (Wang et al. 2023, "Overlap communication
with dependent computation via decomposition"; TransformerEngine's userbuffers ring exchange):

    column-parallel forward   y = all_gather(x) @ W^T        (s/tp, b, in) -> (s, b, out/tp)
        step i: multiply the sequence chunk held now, (r - i) mod tp, while it travels on to r+1
        and chunk (r - i - 1) arrives.
    row-parallel forward      y = reduce_scatter(x @ W^T)    (s, b, in/tp) -> (s/tp, b, out)
        step i: compute this rank's partial for chunk (r - 1 - i) mod tp while the running sum of
        the previous chunk travels; add the arriving running sum; after tp steps rank r holds the
        full sum of chunk r.
    backward                  the same two rings: the column input gradient is a reduce-scatter
        ring of dy[c] @ W, its weight gradient a gather ring of the saved input shard (regathered,
        as Megatron does); the row input and weight gradients consume a gather ring of dy.

Bytes: tp - 1 steps of one (s/tp, b, h) chunk each way: exactly the ring all-gather's and
reduce-scatter's (p - 1)/p of the full tensor, recorded in the ledger as send/recv on the tp axis.
Results: every output element is the same products; the forward column output is bit for bit the
plain path's; sums over chunks (weight gradients, reduce-scatter) are added in another order:
fp32 summation tolerance.

Overlap needs the transfers to progress while the GEMM runs: on gloo they run on gloo's own
threads; on CUDA, NCCL p2p runs on its internal stream, so the GEMM on the compute stream overlaps
it. ``symm_mem`` (PyTorch symmetric memory) is not implemented: it is refused at start-up.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel import comm
from parallel.comm import Group
from parallel.mappings import copy_to_tp, gather_from_tp, reduce_from_tp
from parallel.tensor_parallel.layers import LinearImpl

TP_OVERLAP = ("none", "ring", "symm_mem")


def _pass(group: Group, send: torch.Tensor, recv: torch.Tensor) -> list:
    """Post: ``send`` to the next rank, ``recv`` from the previous one (async)."""
    p, r = group.size, group.rank
    return comm.batch_p2p([comm.P2P("send", send, (r + 1) % p), comm.P2P("recv", recv, (r - 1) % p)], group)


def ring_all_gather(shard: torch.Tensor, group: Group, consume) -> None:
    """Call ``consume(chunk, c)`` for every rank's sequence chunk c (``shard`` is this rank's), each
    while the next chunk is in flight. tp - 1 transfers of ``shard``'s size."""
    p, r = group.size, group.rank
    cur = shard.contiguous()
    for i in range(p):
        works, nxt = [], None
        if i < p - 1:
            nxt = torch.empty_like(cur)
            works = _pass(group, cur, nxt)
        consume(cur, (r - i) % p)  # computed while the transfer runs
        comm.wait(works, group)
        cur = nxt if nxt is not None else cur


def ring_reduce_scatter(group: Group, partial) -> torch.Tensor:
    """The sum over ranks of ``partial(c)`` for c = this rank: ``partial(c)`` is this rank's
    contribution to sequence chunk c, computed while the previous running sum travels."""
    p, r = group.size, group.rank
    acc, works, incoming = None, [], None
    for i in range(p):
        part = partial((r - 1 - i) % p)  # this rank's term of the chunk whose sum passes through now
        if i > 0:
            comm.wait(works, group)
            part = incoming + part  # running sum of ranks r-i .. r-1, then this rank's term
        if i < p - 1:
            incoming = torch.empty_like(part)
            works = _pass(group, part, incoming)
        acc = part
    return acc


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
        if ctx.needs_input_grad[1]:
            acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)

            def consume(chunk, c):
                g = _chunk(dy, c, n)
                acc.add_((g.reshape(-1, g.shape[-1]).t() @ chunk.reshape(-1, chunk.shape[-1])).float())
            ring_all_gather(x_shard, group, consume)  # regather the input shard for the weight gradient
            grad_w = acc.to(weight.dtype)
        if ctx.needs_input_grad[0]:
            grad_x = ring_reduce_scatter(group, lambda c: _chunk(dy, c, n) @ weight)  # (s/tp, b, in)
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


class RingLinearImpl(LinearImpl):
    """``parallel.tp_overlap = "ring"``: sequence-parallel TP linears as ring collective matmuls.
    Without sequence parallelism (or at tp = 1) a layer runs the plain path: there is no sequence
    collective to decompose."""

    def column_forward(self, x, weight, bias, *, group, sequence_parallel, gather_output):
        if sequence_parallel and group.size > 1:
            y = _RingColumn.apply(x, weight, bias, group)
        else:
            y = F.linear(copy_to_tp(x, group), weight, bias)
        return gather_from_tp(y, group) if gather_output else y

    def row_forward(self, x, weight, bias, *, group, sequence_parallel):
        if sequence_parallel and group.size > 1:
            if x.shape[0] % group.size:
                raise ValueError(f"ring row-parallel linear: sequence length {x.shape[0]} is not divisible by "
                                 f"tp={group.size}; pad or pack sequences to a multiple of it")
            y = _RingRow.apply(x, weight, group)
        else:
            y = reduce_from_tp(F.linear(x, weight), group)
        return y if bias is None else y + bias

    def __repr__(self) -> str:
        return "RingLinearImpl()"


def check_tp_overlap(mode: str, *, tp: int, sequence_parallel: bool, device_type: str) -> None:
    """Start-up check of ``parallel.tp_overlap`` (before any process group)."""
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
        where = "on the CPU (gloo has no symmetric memory)" if device_type == "cpu" else "in this build"
        raise ValueError(f"parallel.tp_overlap='symm_mem' is not available {where}: Tessel has no symmetric-memory "
                         "collective matmul yet (it needs several NVLink-connected GPUs to build and test); use "
                         "parallel.tp_overlap = 'ring'")
