"""Tensor- and sequence-parallel linear and embedding layers (Megatron-style, explicit groups).

Shapes are sequence-first: activations are ``(s, b, h)``, and with sequence parallelism (SP) the
activations between TP regions are ``(s/tp, b, h)``.

Each linear hands "collective + matmul + collective" to a strategy object, ``self.impl``
(:class:`LinearImpl`). :class:`DefaultLinearImpl` is plain PyTorch over :mod:`parallel.mappings`;
an FP8 GEMM backend or a comm/compute-overlap backend subclasses :class:`LinearImpl` and is passed
as ``impl=`` (or to the model builder), without touching the models. A strategy with per-layer
state is set on each built layer instead (``layer.impl = ...``): parallel/tensor_parallel/fp8.py's
``apply_fp8`` gives every linear its own FP8 impl and scaling state, by layer name.

Weights are initialised as Megatron does with CPU initialisation: the FULL weight is filled by
``init_method`` (a function filling a tensor in place, normally driven by a seeded generator) and
this rank keeps its slice, so TP=n weights equal the TP=1 weights chunked.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from parallel import comm
from parallel.comm import Group
from parallel.mappings import (copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp, reduce_scatter_to_sp,
                               scatter_to_tp)
from parallel.tensor_parallel.sharding import divide, mark_replicated, set_tensor_parallel_attributes, shard_tensor
from parallel.tensor_parallel.wgrad import defer_weight_grad, linear

InitMethod = Callable[[torch.Tensor], object]


def default_init(full: torch.Tensor) -> None:
    """N(0, 0.02) from torch's default generator (the same on every TP rank, see parallel.random)."""
    nn.init.normal_(full, mean=0.0, std=0.02)


class LinearImpl:
    """How a TP linear turns its input into its output: the seam for FP8 and overlap backends.

    ``column_forward``: ``x`` is ``(s, b, in)`` replicated, or ``(s/tp, b, in)`` with SP;
    ``weight`` is ``(out/tp, in)``. Returns ``(s, b, out/tp)``, or ``(s, b, out)`` with
    ``gather_output``. ``row_forward``: ``x`` is ``(s, b, in/tp)``; ``weight`` is ``(out, in/tp)``;
    returns the reduced ``(s, b, out)``, or ``(s/tp, b, out)`` reduce-scattered with SP; the
    (replicated) bias is added once, after the reduction.

    ``overlap_comm``: True for a strategy that hides TP communication under compute (the ring); the
    model then hides its other TP collectives where it can too (the vocab-parallel loss's MAX).
    """

    overlap_comm = False

    def column_forward(self, x, weight, bias, *, group: Group, sequence_parallel: bool,
                       gather_output: bool) -> torch.Tensor:
        raise NotImplementedError

    def row_forward(self, x, weight, bias, *, group: Group, sequence_parallel: bool) -> torch.Tensor:
        raise NotImplementedError


class _GatherLinear(torch.autograd.Function):
    """All-gather along the sequence, then ``x @ w.T + b``; saves only the SP shard of ``x``.

    Backward gathers the input again for the weight gradient (Korthikanti et al. 2022, 4.2.2) and
    reduce-scatters the input gradient: activation memory of the gathered input stays 1/tp.
    """

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        ctx.group = group
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x_shard, weight)
        x_full = comm.all_gather(x_shard.contiguous(), group, dim=0)  # (s, b, in)
        return F.linear(x_full, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x_shard, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x_full = grad_out.matmul(weight)  # (s, b, in), partial over TP ranks
            grad_x = comm.reduce_scatter(grad_x_full, ctx.group, dim=0)
        if ctx.needs_input_grad[1]:
            # Split backward (zero-bubble schedules): the all-gather stays here in B, the GEMM waits for W.
            x_full = comm.all_gather(x_shard.contiguous(), ctx.group, dim=0)
            if not defer_weight_grad(weight, x_full, grad_out):
                grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(x_full.reshape(-1, x_full.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b, None


class DefaultLinearImpl(LinearImpl):
    """Plain PyTorch matmuls around the autograd collectives of :mod:`parallel.mappings`.

    ``regather_sp_input`` (default True, Megatron's behaviour): under SP a column-parallel linear
    saves its ``(s/tp, b, in)`` input shard and all-gathers it again in backward (one extra
    all-gather per column linear). False saves the gathered ``(s, b, in)`` input instead: no extra
    traffic, tp times more memory for that tensor.
    """

    def __init__(self, *, regather_sp_input: bool = True):
        self.regather_sp_input = regather_sp_input

    def column_forward(self, x, weight, bias, *, group, sequence_parallel, gather_output):
        if sequence_parallel and self.regather_sp_input and group.size > 1:
            y = _GatherLinear.apply(x, weight, bias, group)
        else:
            x = gather_from_sp(x, group) if sequence_parallel else copy_to_tp(x, group)
            y = linear(x, weight, bias)  # F.linear, or deferrable under a split-backward schedule (wgrad.py)
        return gather_from_tp(y, group) if gather_output else y

    def row_forward(self, x, weight, bias, *, group, sequence_parallel):
        y = linear(x, weight)
        y = reduce_scatter_to_sp(y, group) if sequence_parallel else reduce_from_tp(y, group)
        return y if bias is None else y + bias

    def __repr__(self) -> str:
        return f"DefaultLinearImpl(regather_sp_input={self.regather_sp_input})"


def _check_dims(in_features: int, out_features: int) -> None:
    for name, v in (("in_features", in_features), ("out_features", out_features)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")


def _sharded_weight(shape_full, *, dim, stride, group, init_method, dtype, device) -> nn.Parameter:
    """This rank's shard of the weight ``init_method`` draws in full, as a Parameter of ``dtype``.

    An ``init_method`` with ``blocks(shape, device=)`` (models' named initialisers) streams the full
    tensor's rows and only this rank's part of each block is kept: the full weight never exists.
    Otherwise (any plain ``init(full)`` callable) the full fp32 tensor is filled and sliced.
    """
    dtype = dtype or torch.get_default_dtype()
    blocks = getattr(init_method, "blocks", None)
    if blocks is None or group.size == 1:
        full = torch.empty(shape_full, dtype=torch.float32, device=device)
        init_method(full)
        shard = shard_tensor(full, rank=group.rank, size=group.size, dim=dim, stride=stride)
        return nn.Parameter(shard.to(dtype))
    n = shape_full[dim]
    if n % (group.size * stride):
        raise ValueError(f"dim {dim} of size {n} cannot be split into {stride} block(s) x {group.size} ranks")
    local_shape = list(shape_full)
    local_shape[dim] //= group.size
    shard = torch.empty(local_shape, dtype=dtype, device=device)
    block_len = n // stride  # each logical block along `dim` is split over the ranks
    part = block_len // group.size
    # Full-tensor index ranges along `dim` this rank holds, and where they go in the shard.
    mine = [(j * block_len + group.rank * part, j * part) for j in range(stride)]
    with torch.no_grad():
        for row0, block in blocks(tuple(shape_full), device=device):
            row1 = row0 + block.shape[0]
            if dim == 0:
                for start, at in mine:
                    a, b = max(start, row0), min(start + part, row1)
                    if a < b:
                        shard[at + a - start:at + b - start].copy_(block[a - row0:b - row0])
            else:
                for start, at in mine:  # (rows, cols): keep this rank's columns of every row
                    shard[row0:row1].narrow(dim, at, part).copy_(block.narrow(dim, start, part))
    return nn.Parameter(shard)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` (out, in) split by rows: rank r holds rows [r*out/tp, (r+1)*out/tp).

    Input ``(s, b, in)`` (replicated) or, with ``sequence_parallel``, ``(s/tp, b, in)`` (all-gathered
    along the sequence). Output ``(s, b, out/tp)``, or ``(s, b, out)`` with ``gather_output``.
    ``partition_stride=k`` splits each of k logical row blocks separately (fused gate/up: k=2).
    """

    def __init__(self, in_features: int, out_features: int, *, tp_group: Group, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, dtype=None, device=None,
                 partition_stride: int = 1, init_method: InitMethod | None = None, impl: LinearImpl | None = None):
        super().__init__()
        tp_group = comm.as_group(tp_group, axis="tp")
        _check_dims(in_features, out_features)
        divide(out_features, tp_group.size * partition_stride, what="ColumnParallelLinear out_features",
               fix=f"choose a tensor-parallel size dividing {out_features // max(partition_stride, 1)}")
        self.in_features, self.out_features = in_features, out_features
        self.out_features_local = out_features // tp_group.size
        self.tp_group = tp_group
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.impl = impl or DefaultLinearImpl()
        self.weight = _sharded_weight((out_features, in_features), dim=0, stride=partition_stride, group=tp_group,
                                      init_method=init_method or default_init, dtype=dtype, device=device)
        set_tensor_parallel_attributes(self.weight, partition_dim=0, stride=partition_stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features_local, dtype=dtype, device=device))
            set_tensor_parallel_attributes(self.bias, partition_dim=0, stride=partition_stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl.column_forward(x, self.weight, self.bias, group=self.tp_group,
                                        sequence_parallel=self.sequence_parallel, gather_output=self.gather_output)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.out_features_local}), "
                f"bias={self.bias is not None}, sp={self.sequence_parallel}, impl={self.impl!r}")


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` (out, in) split by columns: rank r holds [r*in/tp, (r+1)*in/tp).

    Input ``(s, b, in/tp)`` (``input_is_parallel``) or ``(s, b, in)`` (split here). Output
    ``(s, b, out)`` all-reduced, or ``(s/tp, b, out)`` reduce-scattered with ``sequence_parallel``.
    The bias is replicated and added after the reduction; under SP its gradient is a partial sum
    over the sequence shards (``bias.sequence_parallel = True``).
    """

    def __init__(self, in_features: int, out_features: int, *, tp_group: Group, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, dtype=None, device=None,
                 init_method: InitMethod | None = None, impl: LinearImpl | None = None):
        super().__init__()
        tp_group = comm.as_group(tp_group, axis="tp")
        _check_dims(in_features, out_features)
        divide(in_features, tp_group.size, what="RowParallelLinear in_features",
               fix=f"choose a tensor-parallel size dividing {in_features}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear(sequence_parallel=True) needs input_is_parallel=True "
                             "(the input of a sequence-parallel row linear comes from a TP region)")
        self.in_features, self.out_features = in_features, out_features
        self.in_features_local = in_features // tp_group.size
        self.tp_group = tp_group
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.impl = impl or DefaultLinearImpl()
        self.weight = _sharded_weight((out_features, in_features), dim=1, stride=1, group=tp_group,
                                      init_method=init_method or default_init, dtype=dtype, device=device)
        set_tensor_parallel_attributes(self.weight, partition_dim=1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
            mark_replicated(self.bias, sequence_parallel=sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp_group)
        return self.impl.row_forward(x, self.weight, self.bias, group=self.tp_group,
                                     sequence_parallel=self.sequence_parallel)

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.in_features_local}), out={self.out_features}, "
                f"bias={self.bias is not None}, sp={self.sequence_parallel}, impl={self.impl!r}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows: rank r holds rows [r*V/tp, (r+1)*V/tp).

    Input: integer ids of any shape ``(...)``; output ``(..., h)`` summed over the TP group
    (all-reduce). With ``sequence_parallel`` the ids must be sequence-first ``(s, b)`` and the
    output is reduce-scattered to ``(s/tp, b, h)``. ``num_embeddings`` must be divisible by the TP
    size: pad the vocabulary (the models do, see ``make_vocab_size_divisible_by``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: Group, sequence_parallel: bool = False,
                 dtype=None, device=None, init_method: InitMethod | None = None):
        super().__init__()
        tp_group = comm.as_group(tp_group, axis="tp")
        _check_dims(num_embeddings, embedding_dim)
        divide(num_embeddings, tp_group.size, what="VocabParallelEmbedding num_embeddings",
               fix="pad the vocabulary to a multiple of the TP size (make_vocab_size_divisible_by)")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_local = num_embeddings // tp_group.size
        self.vocab_start = tp_group.rank * self.num_embeddings_local
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.weight = _sharded_weight((num_embeddings, embedding_dim), dim=0, stride=1, group=tp_group,
                                      init_method=init_method or default_init, dtype=dtype, device=device)
        set_tensor_parallel_attributes(self.weight, partition_dim=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.num_embeddings, what="token id")
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (..., h)
        if self.tp_group.size > 1:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.tp_group)
        return reduce_from_tp(out, self.tp_group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (local {self.num_embeddings_local} from {self.vocab_start}), "
                f"{self.embedding_dim}, sp={self.sequence_parallel}")


def check_ids(ids: torch.Tensor, limit: int, *, what: str, ignore_index: int | None = None) -> None:
    """ValueError if an id is outside [0, limit) (and not ``ignore_index``).

    On CPU this is checked eagerly. On an accelerator it is an asynchronous device assert, so the
    training step never waits for the host (the error then surfaces as a device-side assert).
    """
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{what}s must be int64 or int32, got {ids.dtype}")
    bad = (ids < 0) | (ids >= limit)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if ids.device.type == "cpu":
        if bool(bad.any()):
            first = ids[bad][0].item()
            raise ValueError(f"{what} {first} is outside [0, {limit}); check the tokenizer/vocabulary size "
                             "matches the model config")
    else:
        torch._assert_async(~bad.any(), f"{what} outside [0, {limit})")
