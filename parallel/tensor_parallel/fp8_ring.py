"""FP8 ring collective matmuls: ``parallel.tp_overlap = "ring"`` with ``model.fp8``.

The rings of parallel/tensor_parallel/overlap.py with every GEMM in FP8 through engine/ops/fp8_linear.py's
quantisers and ``scaled_gemm``, computing what the non-ring FP8 path (:class:`Fp8LinearImpl` without the
ring: ``fp8_linear`` with its FP8 all-gathers (per-tensor recipes) or a high-precision gather (row/block),
and the reduce-scatter) computes, moving the same bytes:

    column forward    per-tensor recipes: each rank casts its x shard with the scale of the WHOLE
                      gathered x and the gather ring moves the fp8 shards (the non-ring path's FP8
                      all-gather bytes); row/block recipes: the ring moves the high-precision shards and
                      each chunk is quantised as it arrives. Each chunk's rows of y are one FP8 GEMM.
                      Saved for backward: what the non-ring path saves of the gathered x (fp8 x^T for
                      the per-tensor recipes, x itself for row/block), assembled from the chunks, so the
                      backward regathers nothing (as the non-ring FP8 path).
    column backward   dy (s, b, out/tp) is quantised whole as in the non-ring path; dx's reduce-scatter is
                      a ring of per-chunk FP8 GEMMs, and the weight-gradient GEMM (all its operands are
                      local) runs under the ring's first round.
    row forward       x (s, b, in/tp) is quantised whole (its amax reduced over tp, as the non-ring
                      path does); the reduce-scatter ring sums per-chunk FP8 GEMMs.
    row backward      per-tensor recipes: each rank casts its dy rows with the scale of the whole
                      gathered dy and the gather ring moves fp8 chunks; row/block recipes: the ring moves
                      high-precision dy chunks, each quantised on arrival. Each chunk gives its rows of
                      dx; the weight gradient is one GEMM over the assembled dy, as in the non-ring path.

Scales. Row- and block-wise recipes scale rows and 1 x 128 tiles of the token dimension, which a
sequence chunk never splits: no communication, the same scales as the non-ring path. The per-tensor
recipes (``tensorwise``, and ``delayed`` before its first update) need the amax of a tensor that the
ring only ever holds in chunks -- the column input in forward and the row output-gradient in
backward -- so its shard's amax is all-reduced (MAX) over tp: 4 bytes, as the non-ring path's FP8
all-gathers do. In the column forward it rides in the weight's amax all-reduce (one stacked call of 8
bytes; 4 bytes, x's alone, where the weight's cast is reused from an earlier micro-batch); in the row
backward it is one call of 4 bytes. ``delayed`` after its first update scales from its history (nothing
reduced per call); each rank records its own rows' amax, which the step's update reduces (MAX over tp)
before it enters the history, as in the non-ring path.

Results: the same quantised values and the same scales as the non-ring FP8 path; the per-chunk GEMMs
give the rows of the whole GEMM, and sums over ranks are added in the ring's order (at tp 2, two
terms: the same float).
"""
from __future__ import annotations

import torch
from torch import Tensor

from engine.ops.fp8_linear import (E4M3, E5M2, PER_TENSOR, REQUANTISED, Quantized, Scaler, WeightCasts,
                                   act_quantizer, scaled_gemm, shard_cast,
                                   weight_grad_requantized, weight_quantizer, weight_tensorwise,
                                   wgrad_from_transposes)
from parallel import comm
from parallel.comm import Group
from parallel.tensor_parallel.overlap import ring_all_gather, ring_reduce_scatter



def _rows(t: Tensor, c: int, n: int) -> Tensor:
    return t[c * n:(c + 1) * n]  # rows of sequence chunk c in a (M, C) matrix (n = rows per chunk)


def _saved_row_block(ctx) -> tuple[Tensor, Quantized]:
    """The row / block / MX recipes' saved (x, W) as (x, fp8 W^T (K, N)): W re-quantised along N (rowwise:
    per row of its transpose; mxfp8: in 1 x 32 blocks), or its saved 128 x 128 blocks transposed (blockwise:
    no re-quantisation)."""
    if ctx.recipe in REQUANTISED:
        x, weight = ctx.saved_tensors
        return x, weight_quantizer(ctx.recipe)(weight, ctx.casts, transposed=True)
    x, w_data, w_inv = ctx.saved_tensors
    return x, Quantized(w_data, w_inv, "block").t()


def max_over(group: Group):
    """An amax reduction (all-reduce MAX over ``group``, through parallel/comm) for fp8_linear's scalers."""
    def reduce(amax: Tensor) -> Tensor:
        out = amax.clone()
        comm.all_reduce(out, group, op="max")
        return out
    return reduce


class _Fp8RingColumn(torch.autograd.Function):
    """(s/tp, b, in) -> (s, b, out/tp) = FP8(all_gather(x) @ W^T) + b, as a ring."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, recipe, scaler, group, casts):
        k = x_shard.shape[-1]
        n = x_shard.numel() // k  # rows of one chunk
        m = n * group.size
        out_dtype = x_shard.dtype
        ctx.recipe, ctx.scaler, ctx.group, ctx.n, ctx.casts = recipe, scaler, group, n, casts
        ctx.out_dtype, ctx.w_dtype, ctx.has_bias = out_dtype, weight.dtype, bias is not None
        y = x_shard.new_empty((m, weight.shape[0]))  # (M, out/tp)
        bias_c = None if bias is None else bias.to(out_dtype)
        if recipe in PER_TENSOR:
            # The shard cast with the whole gathered x's scale (its amax in the weight's all-reduce, or
            # alone where the weight's cast is reused), as the non-ring path's FP8 all-gather does.
            xq, s_w = shard_cast(x_shard.reshape(n, k), "input", scaler, max_over(group), weight=weight,
                                 casts=casts)  # (n, K) this rank's rows
            wq, wq_t = weight_tensorwise(weight, scaler, casts, scale=s_w)
            xq_t = torch.empty((k, m), dtype=E4M3, device=x_shard.device)  # fp8 x^T of the gathered x

            def consume(chunk, c):  # chunk: (n, K) fp8 bytes of rank c's shard
                q = Quantized(chunk.view(E4M3), xq.scale_inv, "tensor")
                out = scaled_gemm(q, wq, out_dtype)  # (n, out/tp)
                _rows(y, c, n).copy_(out if bias_c is None else out + bias_c)
                xq_t[:, c * n:(c + 1) * n].copy_(q.data.t())
            ring_all_gather(xq.data.view(torch.uint8), group, consume)
            ctx.save_for_backward(xq_t, xq.scale_inv, wq_t.data, wq_t.scale_inv)
        else:
            wq = weight_quantizer(recipe)(weight, casts)
            quantize = act_quantizer(recipe)
            x_full = x_shard.new_empty((m, k))  # the gathered x, saved as the non-ring path saves it

            def consume(chunk, c):
                rows = chunk.reshape(n, k)
                out = scaled_gemm(quantize(rows, E4M3), wq, out_dtype)  # (n, out/tp)
                _rows(y, c, n).copy_(out if bias_c is None else out + bias_c)
                _rows(x_full, c, n).copy_(rows)
            ring_all_gather(x_shard, group, consume)
            if recipe in REQUANTISED:
                ctx.save_for_backward(x_full, weight)
            else:
                ctx.save_for_backward(x_full, wq.data, wq.scale_inv)
        return y.view(x_shard.shape[0] * group.size, *x_shard.shape[1:-1], weight.shape[0])  # (s, b, out/tp)

    @staticmethod
    def backward(ctx, dy):
        recipe, group, n = ctx.recipe, ctx.group, ctx.n
        g = dy.reshape(-1, dy.shape[-1]).contiguous()  # (M, out/tp)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = grad_b = None
        shard_shape = (dy.shape[0] // group.size, *dy.shape[1:-1])
        wgrad = {}
        if recipe in PER_TENSOR:
            xt_data, xt_inv, wt_data, wt_inv = ctx.saved_tensors
            scaler = ctx.scaler
            # (M, N) and its (N, M) transpose for the weight gradient, from one pass over g
            gq, gq_t = scaler.cast("grad_output", g, transpose=need_w)
            wt = Quantized(wt_data, wt_inv, "tensor")  # (K, N)

            def partial(c):
                return scaled_gemm(Quantized(_rows(gq.data, c, n), gq.scale_inv, "tensor"), wt, ctx.out_dtype)

            def weight_grad():
                wgrad["w"] = wgrad_from_transposes(scaled_gemm, gq_t, Quantized(xt_data, xt_inv, "tensor"), ctx.w_dtype)
        else:
            x_full, wt = _saved_row_block(ctx)
            quantize = act_quantizer(recipe)

            def partial(c):  # a row, 1 x 128 tile or 1 x 32 block of dy lies within one chunk: the whole dy's scales
                return scaled_gemm(quantize(_rows(g, c, n), E5M2), wt, ctx.out_dtype)

            def weight_grad():
                wgrad["w"] = weight_grad_requantized(recipe, scaled_gemm, g, x_full, ctx.w_dtype)
        if need_x:
            k = (xt_data.shape[0] if recipe in PER_TENSOR else x_full.shape[1])
            grad_x = ring_reduce_scatter(group, lambda c: partial(c).view(*shard_shape, k),
                                         under_first=weight_grad if need_w else None)  # (s/tp, b, in)
        elif need_w:
            weight_grad()
        grad_w = wgrad.get("w")
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.float().sum(0).to(ctx.w_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


class _Fp8RingRow(torch.autograd.Function):
    """(s, b, in/tp) -> (s/tp, b, out) = reduce_scatter(FP8(x @ W^T)), as a ring."""

    @staticmethod
    def forward(ctx, x, weight, recipe, scaler, group, casts):
        k = x.shape[-1]
        x2d = x.reshape(-1, k)  # (M, in/tp)
        n = x2d.shape[0] // group.size
        out_dtype = x.dtype
        ctx.recipe, ctx.scaler, ctx.group, ctx.n, ctx.casts = recipe, scaler, group, n, casts
        ctx.out_dtype, ctx.w_dtype = out_dtype, weight.dtype
        if recipe in PER_TENSOR:
            # x and W are sharded along K: each amax all-reduced over tp, as the non-ring path does.
            xq, xq_t = scaler.cast("input", x2d, transpose=True)
            wq, wq_t = weight_tensorwise(weight, scaler, casts)
            ctx.save_for_backward(xq_t.data, xq_t.scale_inv, wq_t.data, wq_t.scale_inv)

            def partial(c):
                return scaled_gemm(Quantized(_rows(xq.data, c, n), xq.scale_inv, "tensor"), wq, out_dtype)
        else:
            xq = act_quantizer(recipe)(x2d, E4M3)  # row / tile / MX scales: local to each row
            wq = weight_quantizer(recipe)(weight, casts)
            if recipe in REQUANTISED:
                ctx.save_for_backward(x2d, weight)
            else:
                ctx.save_for_backward(x2d, wq.data, wq.scale_inv)

            def partial(c):
                return scaled_gemm(Quantized(_rows(xq.data, c, n), _rows(xq.scale_inv, c, n), xq.granularity), wq,
                                   out_dtype)
        shard_shape = (x.shape[0] // group.size, *x.shape[1:-1], weight.shape[0])
        return ring_reduce_scatter(group, lambda c: partial(c).view(shard_shape))  # (s/tp, b, out)

    @staticmethod
    def backward(ctx, dy_shard):
        recipe, group, n = ctx.recipe, ctx.group, ctx.n
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy_shard = dy_shard.contiguous()
        n_out = dy_shard.shape[-1]
        m = n * group.size
        grad_x = None
        if recipe in PER_TENSOR:
            xt_data, xt_inv, wt_data, wt_inv = ctx.saved_tensors
            scaler, k = ctx.scaler, wt_data.shape[0]
            wt = Quantized(wt_data, wt_inv, "tensor")  # (K, N)
            if need_x:
                grad_x = dy_shard.new_empty((m, k), dtype=ctx.out_dtype)
            # This rank's dy rows cast with the whole gathered dy's scale (its amax all-reduced (MAX) over
            # tp first: current scaling only; delayed scales from its history), then moved as fp8.
            g_local, _ = shard_cast(dy_shard.reshape(n, n_out), "grad_output", scaler, max_over(group))
            gq = torch.empty((m, n_out), dtype=g_local.data.dtype, device=dy_shard.device)  # the gathered dy, fp8

            def consume(chunk, c):  # chunk: (n, N) fp8 bytes of rank c's dy rows
                q = Quantized(chunk.view(gq.dtype), g_local.scale_inv, "tensor")
                _rows(gq, c, n).copy_(q.data)
                if need_x:
                    _rows(grad_x, c, n).copy_(scaled_gemm(q, wt, ctx.out_dtype))  # (n, in/tp)
        else:
            x2d, wt = _saved_row_block(ctx)
            k = x2d.shape[1]
            if need_x:
                grad_x = dy_shard.new_empty((m, k), dtype=ctx.out_dtype)
            quantize = act_quantizer(recipe)
            g_full = dy_shard.new_empty((m, n_out))  # the gathered dy, for the weight gradient

            def consume(chunk, c):
                rows = chunk.reshape(n, n_out)
                _rows(g_full, c, n).copy_(rows)
                if need_x:
                    _rows(grad_x, c, n).copy_(scaled_gemm(quantize(rows, E5M2), wt, ctx.out_dtype))  # (n, in/tp)
        ring_all_gather(g_local.data.view(torch.uint8) if recipe in PER_TENSOR else dy_shard, group, consume)
        grad_w = None
        if grad_x is not None:
            grad_x = grad_x.view(dy_shard.shape[0] * group.size, *dy_shard.shape[1:-1], k)  # (s, b, in/tp)
        if recipe in PER_TENSOR:
            if need_w:
                gq_t = Quantized(gq.t().contiguous(), g_local.scale_inv, "tensor")  # (N, M)
                grad_w = wgrad_from_transposes(scaled_gemm, gq_t, Quantized(xt_data, xt_inv, "tensor"), ctx.w_dtype)
        elif need_w:
            grad_w = weight_grad_requantized(recipe, scaled_gemm, g_full, x2d, ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None


def fp8_ring_column(x_shard: Tensor, weight: Tensor, bias, *, recipe: str, scaler: Scaler | None,
                    group: Group, weight_casts: WeightCasts | None = None) -> Tensor:
    """(s/tp, b, in) -> (s, b, out/tp): the FP8 column-parallel linear of a sequence-parallel layer as a ring."""
    return _Fp8RingColumn.apply(x_shard, weight, bias, recipe, scaler, group, weight_casts)


def fp8_ring_row(x: Tensor, weight: Tensor, *, recipe: str, scaler: Scaler | None, group: Group,
                 weight_casts: WeightCasts | None = None) -> Tensor:
    """(s, b, in/tp) -> (s/tp, b, out): the FP8 row-parallel linear of a sequence-parallel layer as a ring."""
    if x.shape[0] % group.size:
        raise ValueError(f"ring row-parallel linear: sequence length {x.shape[0]} is not divisible by "
                         f"tp={group.size}; pad or pack sequences to a multiple of it")
    return _Fp8RingRow.apply(x, weight, recipe, scaler, group, weight_casts)
