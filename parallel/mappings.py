"""Autograd-aware collectives for tensor and sequence parallelism.

Names say what happens in forward and backward (DESIGN.md, "communication is visible"):

=========================  ==============================  ==============================
function                   forward                         backward
=========================  ==============================  ==============================
copy_to_tp                 identity                        all-reduce
reduce_from_tp             all-reduce                      identity
scatter_to_tp              split last dim, keep own chunk  all-gather last dim
gather_from_tp             all-gather last dim             split last dim
scatter_to_sp              split sequence dim              all-gather sequence dim
gather_from_sp             all-gather sequence dim         reduce-scatter sequence dim
reduce_scatter_to_sp       reduce-scatter sequence dim     all-gather sequence dim
=========================  ==============================  ==============================

Activations are sequence-first, ``(s, b, h)``, so the sequence dim is 0 and the SP gathers are
contiguous single calls. ``gather_from_sp(..., grad_is_partial=False)`` is the variant whose
backward only splits (use it when the consumer's gradient is already complete on every rank).
All traffic goes through :mod:`parallel.comm` and is recorded in the group's ledger.
"""
from __future__ import annotations

import torch

from parallel import comm
from parallel.comm import Group


def _split(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    if x.shape[dim] % group.size:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} across {group.axis}={group.size}; "
                         f"it must be divisible by {group.size}")
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        comm.all_reduce(g, ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        comm.all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather(g.contiguous(), ctx.group, dim=-1), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x.contiguous(), group, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.group, -1), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, 0)

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather(g.contiguous(), ctx.group, dim=0), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group = group
        ctx.grad_is_partial = grad_is_partial
        return comm.all_gather(x.contiguous(), group, dim=0)

    @staticmethod
    def backward(ctx, g):
        if ctx.grad_is_partial:
            return comm.reduce_scatter(g.contiguous(), ctx.group, dim=0), None, None
        return _split(g, ctx.group, 0), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.reduce_scatter(x.contiguous(), group, dim=0)

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather(g.contiguous(), ctx.group, dim=0), None


def _passthrough(group: Group) -> bool:
    return group.size == 1


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over ``group`` backward."""
    return x if _passthrough(group) else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward."""
    return x if _passthrough(group) else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's chunk of the last dim forward; all-gather the gradient backward."""
    return x if _passthrough(group) else _ScatterToTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along the last dim forward; keep this rank's chunk of the gradient backward."""
    return x if _passthrough(group) else _GatherFromTP.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(s, ...) -> (s/tp, ...) forward (this rank's chunk); all-gather backward."""
    return x if _passthrough(group) else _ScatterToSP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group: Group, *, grad_is_partial: bool = True) -> torch.Tensor:
    """(s/tp, ...) -> (s, ...) all-gather forward; reduce-scatter (or split) backward."""
    return x if _passthrough(group) else _GatherFromSP.apply(x, group, grad_is_partial)


def reduce_scatter_to_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(s, ...) partial sums -> (s/tp, ...) reduced, forward; all-gather backward."""
    return x if _passthrough(group) else _ReduceScatterToSP.apply(x, group)
