"""``parallel.tp_overlap = "symm_mem"``: sequence-parallel TP linears as PyTorch's symmetric-memory
collective matmuls (``torch.distributed._symmetric_memory``, "async TP").

The same decomposition as the ring (parallel/tensor_parallel/overlap.py), but run by PyTorch's fused
ops over symmetric memory: every rank maps its peers' buffers (NVLink), copies a peer's chunk on a side
stream with the copy engines while the compute stream multiplies the chunk before it, and no NCCL
kernel takes SMs from the GEMMs.

    column forward    y = all_gather(x) @ W^T       fused_all_gather_matmul(x, [W^T])     (s/tp, b, in) -> (s, b, out/tp)
    column backward   dx = reduce_scatter(dy @ W)    fused_matmul_reduce_scatter(dy, W)    (s, b, out/tp) -> (s/tp, b, in)
                      dW = dy^T all_gather(x)        x regathered by an async all-gather issued before dx's
                                                     fused op, so it travels under that op's GEMMs
    row forward       y = reduce_scatter(x @ W^T)    fused_matmul_reduce_scatter(x, W^T)   (s, b, in/tp) -> (s/tp, b, out)
    row backward      dx = all_gather(dy) @ W        fused_all_gather_matmul(dy, [W], return_A): the
                      dW = all_gather(dy)^T x        gathered dy comes back for dW

Split backward (zero-bubble schedules): both weight-gradient GEMMs go to the W action's queue, as the
plain path's do (parallel/tensor_parallel/wgrad.py); the collectives stay in B.

Bytes: the fused ops read or write the p - 1 other chunks, exactly the ring collectives' bytes; the
ledger records them as the all_gather / reduce_scatter they replace (``comm.fused``), so the tp bytes
per step equal the plain path's. Results: the same products; the reduce-scatter sums the p partials in
the op's own order (fp32 summation tolerance; bit for bit at tp 2, two terms).

Where it runs: CUDA GPUs with peer access (NVLink), an NCCL process group, and a torch with the
``torch.ops.symm_mem`` ops. It is refused on the CPU and with FP8 (the scaled variants of the ops are
not wired), before any process group. ``comm_exposed_s`` does not see inside the fused ops: their
transfers and waits run on the ops' own streams (docs/overlap.md).

The ops are a seam (:class:`FusedOps`): :func:`cuda_ops` are PyTorch's; :func:`reference_ops` are
PyTorch's own unfused definitions of the same ops (a functional all-gather or reduce-scatter, then the
matmul), which run on any backend and let the CPU tests check this module's autograd, shapes and
bytes over gloo. The fused CUDA kernels themselves need several GPUs: they have not run here.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from parallel import comm
from parallel.comm import Group
from parallel.tensor_parallel.overlap import CollectiveMatmulImpl
from parallel.tensor_parallel.wgrad import defer_weight_grad


@dataclass(frozen=True)
class FusedOps:
    """The two collective matmuls, with the signatures of ``torch.ops.symm_mem``:
    ``all_gather_matmul(A_shard, Bs, gather_dim, group_name, *, return_A) -> (A or None, [A @ B ...])`` and
    ``matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name) -> reduce_scatter(A @ B)``."""

    all_gather_matmul: Callable
    matmul_reduce_scatter: Callable
    name: str


def _symm_mem_module():
    try:
        import torch.distributed._symmetric_memory as symm_mem  # registers torch.ops.symm_mem
    except ImportError as e:
        raise RuntimeError(f"parallel.tp_overlap='symm_mem' needs torch.distributed._symmetric_memory, which this "
                           f"torch ({torch.__version__}) lacks ({e}); use parallel.tp_overlap = 'ring'") from None
    return symm_mem


def cuda_ops() -> FusedOps:
    """PyTorch's fused symmetric-memory ops (CUDA)."""
    _symm_mem_module()
    ops = torch.ops.symm_mem
    for name in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
        if not hasattr(ops, name):
            raise RuntimeError(f"parallel.tp_overlap='symm_mem': this torch ({torch.__version__}) has no "
                               f"torch.ops.symm_mem.{name}; use parallel.tp_overlap = 'ring'")
    return FusedOps(ops.fused_all_gather_matmul, ops.fused_matmul_reduce_scatter, "torch.ops.symm_mem")


def reference_ops() -> FusedOps:
    """PyTorch's unfused definitions of the same two ops (what its ``symm_mem`` test mode runs): functional
    collectives over the group, then the matmul. Any backend, gloo included."""
    symm_mem = _symm_mem_module()
    return FusedOps(symm_mem._fused_all_gather_matmul_fallback, symm_mem._fused_matmul_reduce_scatter_fallback,
                    "reference")


def _group_name(group: Group) -> str:
    """The process group's name, which the symm_mem ops take; symmetric memory enabled for it."""
    name = group.pg.group_name
    symm_mem = _symm_mem_module()
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed up to torch 2.10; later deprecated
    if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(name)
    return name


def check_platform(tp: int, *, device_count: int | None = None, local_world: int | None = None,
                   peer=None) -> None:
    """Start-up check on CUDA, before any process group: the ops exist, and the tp group can map its peers'
    memory (the group within one node, every pair of its GPUs with peer access). The mesh puts tp innermost
    (``dp-pp-cp-tp``), so a node's first ``tp`` local ranks form a group; checked on GPUs 0..tp-1."""
    cuda_ops()
    local = local_world if local_world is not None else int(os.environ.get("LOCAL_WORLD_SIZE", tp))
    count = device_count if device_count is not None else torch.cuda.device_count()
    if tp > local or tp > count:
        raise RuntimeError(f"parallel.tp_overlap='symm_mem' maps the tp group's memory over NVLink, so the group "
                           f"must sit within one node: tp={tp}, but this node runs {local} ranks on {count} GPUs; "
                           "use parallel.tp_overlap = 'ring' (NCCL, any topology) or a tp within one node")
    peer = peer or torch.cuda.can_device_access_peer
    for a in range(tp):
        for b in range(tp):
            if a != b and not peer(a, b):
                raise RuntimeError(f"parallel.tp_overlap='symm_mem': GPU {a} cannot access GPU {b}'s memory (no "
                                   "peer access, e.g. no NVLink or P2P disabled); use parallel.tp_overlap = 'ring'")


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])  # (s, b, k) -> (s*b, k)


class _SymmColumn(torch.autograd.Function):
    """(s/tp, b, in) -> (s, b, out/tp) = all_gather(x) @ W^T (+ bias), fused."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group, ops, name):
        ctx.group, ctx.ops, ctx.name, ctx.has_bias = group, ops, name, bias is not None
        x_shard = x_shard.contiguous()
        ctx.save_for_backward(x_shard, weight)
        with comm.fused("all_gather", x_shard, group):
            _, (y,) = ops.all_gather_matmul(x_shard, [weight.t()], 0, name, return_A=False)
        return y if bias is None else y + bias  # (s, b, out/tp)

    @staticmethod
    def backward(ctx, dy):
        x_shard, weight = ctx.saved_tensors
        group, ops, name = ctx.group, ctx.ops, ctx.name
        dy = dy.contiguous()  # (s, b, out/tp)
        grad_x = grad_w = grad_b = None
        gather = None
        if ctx.needs_input_grad[1]:  # regather x (as Megatron does), travelling under dx's fused op
            gather = comm.all_gather(x_shard, group, dim=0, async_op=True)  # ((s, b, in), work)
        if ctx.needs_input_grad[0]:
            # (s, b, in): what is reduced, for the ledger's bytes only (meta: no memory)
            full = torch.empty((*dy.shape[:-1], weight.shape[1]), dtype=dy.dtype, device="meta")
            with comm.fused("reduce_scatter", full, group):
                grad_x = ops.matmul_reduce_scatter(dy, weight, "sum", 0, name)  # (s/tp, b, in)
        if gather is not None:
            x_full, work = gather
            comm.wait(work, group)
            if not defer_weight_grad(weight, x_full, dy):  # a zero-bubble W action may take the GEMM
                grad_w = _rows(dy).t().matmul(_rows(x_full))  # (out/tp, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = _rows(dy).sum(0)
        return grad_x, grad_w, grad_b, None, None, None


class _SymmRow(torch.autograd.Function):
    """(s, b, in/tp) -> (s/tp, b, out) = reduce_scatter(x @ W^T), fused."""

    @staticmethod
    def forward(ctx, x, weight, group, ops, name):
        ctx.group, ctx.ops, ctx.name = group, ops, name
        x = x.contiguous()
        ctx.save_for_backward(x, weight)
        full = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device="meta")  # (s, b, out), bytes only
        with comm.fused("reduce_scatter", full, group):
            return ops.matmul_reduce_scatter(x, weight.t(), "sum", 0, name)  # (s/tp, b, out)

    @staticmethod
    def backward(ctx, dy_shard):
        x, weight = ctx.saved_tensors
        group, ops, name = ctx.group, ctx.ops, ctx.name
        dy_shard = dy_shard.contiguous()  # (s/tp, b, out)
        with comm.fused("all_gather", dy_shard, group):
            dy, (grad_x,) = ops.all_gather_matmul(dy_shard, [weight], 0, name, return_A=True)
        # dy: (s, b, out) gathered; grad_x: (s, b, in/tp)
        grad_w = None
        if ctx.needs_input_grad[1] and not defer_weight_grad(weight, x, dy):  # or queued for a W action
            grad_w = _rows(dy).t().matmul(_rows(x))  # (out, in/tp)
        return (grad_x if ctx.needs_input_grad[0] else None), grad_w, None, None, None


class SymmMemLinearImpl(CollectiveMatmulImpl):
    """``parallel.tp_overlap = "symm_mem"``: sequence-parallel TP linears as symmetric-memory collective
    matmuls. Without sequence parallelism (or at tp = 1) a layer runs the plain path. ``ops``: the ops to
    run; by default chosen at the first call from the input's device: :func:`cuda_ops` on CUDA, else
    :func:`reference_ops` (a run config refuses symm_mem on the CPU before any of this; a model built
    directly, as the tests build one, runs PyTorch's reference definitions there)."""

    kind = "symm_mem"

    def __init__(self, ops: FusedOps | None = None):
        self._ops = ops
        self._names: dict[int, str] = {}  # id(process group) -> its name, symmetric memory enabled once

    def ops_for(self, x: torch.Tensor) -> FusedOps:
        if self._ops is None:
            self._ops = cuda_ops() if x.is_cuda else reference_ops()
        return self._ops

    def _name(self, group: Group) -> str:
        key = id(group.pg)
        if key not in self._names:
            self._names[key] = _group_name(group)
        return self._names[key]

    def _column(self, x, weight, bias, group):
        return _SymmColumn.apply(x, weight, bias, group, self.ops_for(x), self._name(group))

    def _row(self, x, weight, group):
        return _SymmRow.apply(x, weight, group, self.ops_for(x), self._name(group))

    def __repr__(self) -> str:
        return f"SymmMemLinearImpl({'by device' if self._ops is None else self._ops.name})"
