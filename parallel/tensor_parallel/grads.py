"""Gradient fix-ups owed by tensor/sequence parallelism before data-parallel reduction."""
from __future__ import annotations

import torch
from torch import nn

from parallel import comm
from parallel.comm import Group


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters marked ``sequence_parallel = True`` (replicated, gradient a partial sum over TP)."""
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(module: nn.Module, tp_group: Group) -> int:
    """Sum, over ``tp_group``, the gradients of every ``sequence_parallel`` parameter of ``module``.

    Uses ``p.main_grad`` when present (a data-parallel gradient buffer), else ``p.grad``; parameters
    without a gradient are skipped. Gradients are coalesced per dtype/device into one all-reduce.
    Must be called on every rank of the TP group, after backward and before the DP reduction.
    Returns the number of gradients reduced.
    """
    grads = []
    for p in sequence_parallel_params(module):
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is not None:
            grads.append(g)
    if tp_group.size == 1 or not grads:
        return len(grads)
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for bucket in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        comm.all_reduce(flat, tp_group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(grads)
