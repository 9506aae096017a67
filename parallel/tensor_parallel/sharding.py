"""How a full tensor maps onto tensor-parallel shards, and the parameter attributes that record it.

Every parameter of a TP model carries ``tensor_parallel`` (bool). A sharded parameter also carries

* ``partition_dim``: the dim split across the TP group (0 for column-parallel weights and the
  vocab-parallel embedding, 1 for row-parallel weights);
* ``partition_stride``: how many logical blocks the full tensor has along that dim, each of which
  is split separately. 1 is a plain split (rank ``r`` holds ``[r*n/tp, (r+1)*n/tp)``); 2 is the
  fused gate/up layout, where the full tensor is ``[gate; up]`` and rank ``r`` holds
  ``[gate_r; up_r]`` so its SwiGLU needs no communication.

Replicated parameters have ``tensor_parallel = False``; among them, those whose gradient is a
partial sum over the TP ranks (norm weights and row-parallel biases under sequence parallelism,
per-head q/k norms always) carry ``sequence_parallel = True`` (see
:func:`parallel.tensor_parallel.allreduce_sequence_parallel_grads`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from parallel import comm
from parallel.comm import Group


def divide(numerator: int, denominator: int, *, what: str, fix: str = "") -> int:
    """``numerator // denominator``, or a ValueError naming ``what`` when it does not divide."""
    if numerator % denominator:
        hint = f"; {fix}" if fix else ""
        raise ValueError(f"{what}={numerator} is not divisible by the tensor-parallel size {denominator}{hint}")
    return numerator // denominator


def shard_tensor(full: torch.Tensor, *, rank: int, size: int, dim: int, stride: int = 1) -> torch.Tensor:
    """This rank's shard of ``full``: each of the ``stride`` blocks along ``dim`` split ``size`` ways.

    Returns a new contiguous tensor (shape ``full`` with ``dim`` divided by ``size``).
    """
    n = full.shape[dim]
    if n % (size * stride):
        raise ValueError(f"dim {dim} of size {n} cannot be split into {stride} block(s) x {size} ranks")
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def unshard_tensors(shards: Sequence[torch.Tensor], *, dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: the full tensor from every rank's shard (rank order)."""
    per_rank = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([per_rank[r][k] for k in range(stride) for r in range(len(shards))], dim=dim)


def set_tensor_parallel_attributes(param: torch.Tensor, *, partition_dim: int, stride: int = 1) -> None:
    """Mark ``param`` as sharded along ``partition_dim`` (see the module docstring)."""
    param.tensor_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def mark_replicated(param: torch.Tensor, *, sequence_parallel: bool = False) -> None:
    """Mark ``param`` as replicated across TP; ``sequence_parallel`` if its gradient is a TP partial sum."""
    param.tensor_parallel = False
    param.sequence_parallel = bool(sequence_parallel)


def gather_full(t: torch.Tensor, group: Group, *, dim: int, stride: int = 1) -> torch.Tensor:
    """All-gather the shards of a sharded tensor over ``group`` and return the full tensor (collective)."""
    if group.size == 1:
        return t
    stacked = comm.all_gather(t.detach().contiguous(), group, dim=dim)  # shards in rank order along dim
    return unshard_tensors(stacked.chunk(group.size, dim=dim), dim=dim, stride=stride)


def full_param(p: torch.Tensor, group: Group, *, grad: bool = False) -> torch.Tensor:
    """The full (unsharded) value, or gradient with ``grad=True``, of a parameter (collective for shards)."""
    t = p.grad if grad else p.detach()
    if t is None:
        raise ValueError("full_param(grad=True) on a parameter without a gradient; run backward first")
    if not getattr(p, "tensor_parallel", False):
        return t
    return gather_full(t, group, dim=p.partition_dim, stride=getattr(p, "partition_stride", 1))
