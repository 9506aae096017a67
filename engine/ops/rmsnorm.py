"""RMSNorm with an optional fused residual add.

    h = x + residual                      (if residual is given; h is rounded to x.dtype, the dtype
                                           of the residual stream, exactly as an unfused add would)
    y = h * rsqrt(mean(h**2, -1) + eps) * weight

Statistics and the product are computed in float32 (float64 for float64 inputs) and rounded to
``x.dtype`` once. Backward: ``dh = rstd * (g - n * mean(g * n))`` with ``g = dy * weight`` and
``n = h * rstd``; the weight gradient ``sum_rows(dy * n)`` is reduced in two stages (each Triton
program sums its block of rows into one fp32 partial row, then the partials are summed), so no
atomics and a deterministic result. The backward program takes its rows a tile of several at a
time (``bwd_tile_rows``), the forward one row per program.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from engine.ops._triton import (Kernel, check_float, check_same_device, check_triton_dtype,
                                num_programs_for, num_warps_for, use_triton)

_OP = "rms_norm"
_MAX_HIDDEN = 65536  # one row is held in registers; wider rows would spill


# ----------------------------------------------------------------------------------------------
# Reference (plain PyTorch; autograd by PyTorch)
# ----------------------------------------------------------------------------------------------
def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, *, residual: Optional[Tensor] = None):
    """Plain-PyTorch RMSNorm; same promises as :func:`rms_norm`."""
    acc = torch.promote_types(x.dtype, torch.float32)
    h = x if residual is None else (x.to(acc) + residual.to(acc)).to(x.dtype)
    hf = h.to(acc)
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@Kernel
def _rms_norm_fwd_kernel(X, R, W, Y, H, RSTD, stride_x, stride_r, stride_y, stride_h, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the residual-stream dtype first: the norm then sees exactly the h that
        # the next layer will add to, as in the unfused computation.
        h_low = (h + r).to(H.dtype.element_ty)
        tl.store(H + row * stride_h + cols, h_low, mask=mask)
        h = h_low.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (h * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@Kernel
def _rms_norm_bwd_kernel(DY, H, W, RSTD, DRES, DX, DW_PARTIAL, stride_dy, stride_h, stride_dres,
                         stride_dx, n_rows, n_cols, rows_per_program,
                         HAS_DRES: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    # Each program: rows_per_program rows, ROWS of them per iteration as one (ROWS, BLOCK) tile (more
    # loads in flight than a row at a time: the row loop waits on each row's load, reduction and store).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    cmask = cols < n_cols
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK,), dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_count = tl.minimum(row_start + rows_per_program, n_rows) - row_start
    for i in range(0, row_count, ROWS):
        r = tl.arange(0, ROWS)
        rmask = (i + r) < row_count
        rows64 = row_start + i + r  # (ROWS,)
        mask = rmask[:, None] & cmask[None, :]  # (ROWS, BLOCK)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = tl.load(H + rows64[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows64, mask=rmask, other=0.0)  # (ROWS,)
        n = h * rstd[:, None]
        g = dy * w[None, :]
        dx = rstd[:, None] * (g - n * (tl.sum(g * n, axis=1) / n_cols)[:, None])
        if HAS_DRES:
            dx += tl.load(DRES + rows64[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(dy * n, axis=0)  # masked rows add 0
    tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=cmask)


def bwd_tile_rows(n_cols: int) -> int:
    """Rows per backward iteration by default: a (rows, hidden) tile of 16384 elements, 32 per thread at 16
    warps (hidden 4096: 4 rows; 8192: 2; 1024: 16), 1 from 16384 columns up. Chosen without a GPU
    measurement: tools/bench_kernels.py times it against 1 row (``tessel_r1``) in the same run."""
    return max(1, min(16, 16384 // triton.next_power_of_2(max(n_cols, 1))))


def _rows(t: Tensor) -> Tensor:
    """View ``t`` as (rows, hidden) with unit stride along hidden, copying only if needed."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])  # (rows, hidden)


def _fwd_launch(x: Tensor, weight: Tensor, residual: Optional[Tensor], eps: float):
    x2 = _rows(x)  # (rows, hidden)
    r2 = _rows(residual) if residual is not None else x2  # (rows, hidden)
    rows, n_cols = x2.shape
    y = torch.empty_like(x2)
    h = torch.empty_like(x2) if residual is not None else x2.new_empty(0)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n_cols)
    if rows > 0:
        _rms_norm_fwd_kernel.on(x.device)[(rows,)](
            x2, r2, weight, y, h if residual is not None else y, rstd,
            x2.stride(0), r2.stride(0), y.stride(0), y.stride(0), n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps_for(block))
    return y.view(x.shape), h.view(x.shape) if residual is not None else h, rstd


def _bwd_launch(dy: Tensor, h: Tensor, weight: Tensor, rstd: Tensor, dres: Optional[Tensor], tile_rows: int = 0):
    dy2, h2 = _rows(dy), _rows(h)  # (rows, hidden)
    dres2 = _rows(dres) if dres is not None else dy2  # (rows, hidden)
    rows, n_cols = h2.shape
    dx = torch.empty(h2.shape, dtype=h.dtype, device=h.device)
    programs = num_programs_for(rows, h.device)
    dw_partial = torch.zeros(programs, n_cols, dtype=torch.float32, device=h.device)
    block = triton.next_power_of_2(n_cols)
    tile = tile_rows or bwd_tile_rows(n_cols)
    if rows > 0:
        _rms_norm_bwd_kernel.on(h.device)[(programs,)](
            dy2, h2, weight, rstd, dres2, dx, dw_partial, dy2.stride(0), h2.stride(0),
            dres2.stride(0), dx.stride(0), rows, n_cols, triton.cdiv(rows, programs),
            HAS_DRES=dres is not None, BLOCK=block, ROWS=tile, num_warps=num_warps_for(block * tile))
    dw = dw_partial.sum(0).to(weight.dtype)  # second stage of the weight-grad reduction
    return dx.view(h.shape), dw


# ----------------------------------------------------------------------------------------------
# torch.library registration: opaque to torch.compile, with fake (meta) and autograd rules
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("tessel::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(x: Tensor, weight: Tensor, residual: Optional[Tensor], eps: float, bwd_tile_rows: int
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (y, h, rstd); h is empty when residual is None (then h is x itself)."""
    return _fwd_launch(x, weight, residual, eps)


@_rms_norm_fwd.register_fake
def _(x, weight, residual, eps, bwd_tile_rows):
    h = torch.empty_like(x) if residual is not None else x.new_empty(0)
    return torch.empty_like(x), h, x.new_empty(x.numel() // max(x.shape[-1], 1), dtype=torch.float32)


@torch.library.custom_op("tessel::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(dy: Tensor, h: Tensor, weight: Tensor, rstd: Tensor, dres: Optional[Tensor], tile_rows: int
                  ) -> tuple[Tensor, Tensor]:
    """Returns (dh, dweight); dh already includes dres (the gradient of the new residual)."""
    return _bwd_launch(dy, h, weight, rstd, dres, tile_rows)


@_rms_norm_bwd.register_fake
def _(dy, h, weight, rstd, dres, tile_rows):
    return torch.empty_like(h), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, residual, eps, tile_rows = inputs
    _, h, rstd = output
    ctx.has_residual, ctx.tile_rows = residual is not None, tile_rows
    ctx.save_for_backward(h if residual is not None else x, weight, rstd)


def _backward(ctx, dy, dh_out, drstd):
    h, weight, rstd = ctx.saved_tensors
    dres = dh_out if ctx.has_residual else None
    dx, dw = _rms_norm_bwd(dy, h, weight, rstd, dres, ctx.tile_rows)
    return dx, dw, (dx if ctx.has_residual else None), None, None


_rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def _check(x: Tensor, weight: Tensor, eps: float, residual: Optional[Tensor]) -> None:
    check_float(x, name="x", op=_OP)
    check_float(weight, name="weight", op=_OP)
    if weight.dim() != 1 or x.dim() == 0 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{_OP}: weight must be 1-D of size x.shape[-1]; got weight {tuple(weight.shape)} for "
            f"x {tuple(x.shape)}. Pass the norm weight of this hidden size.")
    if not eps >= 0.0:
        raise ValueError(f"{_OP}: eps={eps} must be >= 0 (typically 1e-5 or 1e-6).")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"{_OP}: residual must match x in shape and dtype; got residual "
                f"{tuple(residual.shape)} {residual.dtype} for x {tuple(x.shape)} {x.dtype}.")
    check_same_device(_OP, x=x, weight=weight, residual=residual)


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, residual: Optional[Tensor] = None,
             backend: str = "auto", bwd_tile_rows: int = 0):
    """RMSNorm over the last dim of ``x`` (any leading shape, e.g. (s, b, h)).

    Returns ``y`` (shape and dtype of ``x``), or ``(y, new_residual)`` when ``residual`` is given,
    where ``new_residual = x + residual`` (dtype of ``x``) and ``y = rmsnorm(new_residual)``.
    ``weight``: (h,), any float dtype; its gradient comes back in its dtype. ``bwd_tile_rows`` (Triton):
    rows per iteration of the backward kernel, a power of two up to 16; 0 chooses by the hidden size
    (:func:`bwd_tile_rows`); 1 is the row-at-a-time loop (for A/B timing).
    """
    _check(x, weight, eps, residual)
    if bwd_tile_rows not in (0, 1, 2, 4, 8, 16):
        raise ValueError(f"{_OP}: bwd_tile_rows={bwd_tile_rows!r} must be 0 (by hidden size) or a power of two "
                         "up to 16 (rows per backward iteration).")
    if not use_triton(backend, x, op=_OP):
        return rms_norm_reference(x, weight, eps, residual=residual)
    check_triton_dtype(x, name="x", op=_OP)
    check_triton_dtype(weight, name="weight", op=_OP)
    if x.shape[-1] > _MAX_HIDDEN:
        raise ValueError(f"{_OP}: hidden size {x.shape[-1]} > {_MAX_HIDDEN} is not supported by the "
                         "Triton kernel (one row per program); use backend='reference'.")
    y, h, _ = _rms_norm_fwd(x, weight.contiguous(), residual, float(eps), int(bwd_tile_rows))
    return y if residual is None else (y, h)


class RMSNorm(nn.Module):
    """RMSNorm module; ``forward(x, residual=None)`` has the promises of :func:`rms_norm`."""

    def __init__(self, hidden_size: int, *, eps: float = 1e-6, backend: str = "auto",
                 device=None, dtype=None):
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"RMSNorm: hidden_size={hidden_size} must be positive.")
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        return rms_norm(x, self.weight, self.eps, residual=residual, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, backend={self.backend!r}"
