"""SwiGLU activation on the fused gate/up projection output.

Layout promise: the input is ``(..., 2*I)`` and its last dim is ``[gate | up]`` - the first ``I``
columns are the gate projection, the last ``I`` the up projection, i.e.
``x = cat([x @ W_gate.T, x @ W_up.T], -1)``. Models fuse gate/up *per tensor-parallel rank* in
this layout (rank r's fused weight is ``cat([W_gate[r-th shard], W_up[r-th shard]], 0)``), so each
rank applies this op to its own ``(..., 2*I_local)`` slice with no communication.

    out = silu(gate) * up               shape (..., I), dtype of x

Computed in float32 (float64 for float64 inputs), rounded once. Backward, with s = sigmoid(gate):
``d_gate = dy * up * s * (1 + gate * (1 - s))``, ``d_up = dy * gate * s``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from engine.ops._triton import Kernel, check_float, check_triton_dtype, num_warps_for, use_triton

_OP = "swiglu"
_BLOCK_COLS = 1024  # columns of one half handled by one program


def swiglu_reference(x: Tensor) -> Tensor:
    """Plain-PyTorch SwiGLU; same promises as :func:`swiglu`."""
    acc = torch.promote_types(x.dtype, torch.float32)
    gate, up = x.to(acc).chunk(2, dim=-1)  # each (..., I)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


@Kernel
def _swiglu_fwd_kernel(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    tl.store(Y + row * stride_y + cols, (gate * sig * up).to(Y.dtype.element_ty), mask=mask)


@Kernel
def _swiglu_bwd_kernel(DY, X, DX, stride_dy, stride_x, stride_dx, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = dy * gate * sig
    tl.store(DX + row * stride_dx + cols, d_gate.to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + row * stride_dx + n_cols + cols, d_up.to(DX.dtype.element_ty), mask=mask)


def _rows(t: Tensor) -> Tensor:
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])  # (rows, cols)


def _grid(rows: int, half: int, block: int):
    return (rows, triton.cdiv(half, block))


@torch.library.custom_op("tessel::swiglu_fwd", mutates_args=())
def _swiglu_fwd(x: Tensor) -> Tensor:
    x2 = _rows(x)  # (rows, 2I)
    rows, half = x2.shape[0], x2.shape[1] // 2
    y = torch.empty(rows, half, dtype=x.dtype, device=x.device)  # (rows, I)
    block = min(_BLOCK_COLS, triton.next_power_of_2(half))
    if rows > 0 and half > 0:
        _swiglu_fwd_kernel.on(x.device)[_grid(rows, half, block)](
            x2, y, x2.stride(0), y.stride(0), half, BLOCK=block, num_warps=num_warps_for(block))
    return y.view(*x.shape[:-1], half)  # (..., I)


@_swiglu_fwd.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@torch.library.custom_op("tessel::swiglu_bwd", mutates_args=())
def _swiglu_bwd(dy: Tensor, x: Tensor) -> Tensor:
    x2, dy2 = _rows(x), _rows(dy)  # (rows, 2I), (rows, I)
    rows, half = dy2.shape
    dx = torch.empty_like(x2)  # (rows, 2I)
    block = min(_BLOCK_COLS, triton.next_power_of_2(half))
    if rows > 0 and half > 0:
        _swiglu_bwd_kernel.on(x.device)[_grid(rows, half, block)](
            dy2, x2, dx, dy2.stride(0), x2.stride(0), dx.stride(0), half,
            BLOCK=block, num_warps=num_warps_for(block))
    return dx.view(x.shape)


@_swiglu_bwd.register_fake
def _(dy, x):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return _swiglu_bwd(dy, x)


_swiglu_fwd.register_autograd(_backward, setup_context=_setup_context)


def swiglu(x: Tensor, *, backend: str = "auto") -> Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dim.

    ``x``: (..., 2*I), float dtype. Returns (..., I) in ``x.dtype``.
    """
    check_float(x, name="x", op=_OP)
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(
            f"{_OP}: x must have an even last dim laid out as [gate | up]; got shape "
            f"{tuple(x.shape)}. Concatenate the gate and up projections along the last dim.")
    if not use_triton(backend, x, op=_OP):
        return swiglu_reference(x)
    check_triton_dtype(x, name="x", op=_OP)
    return _swiglu_fwd(x)


class SwiGLU(nn.Module):
    """Parameter-free SwiGLU activation module over a fused [gate | up] input."""

    def __init__(self, *, backend: str = "auto"):
        super().__init__()
        self.backend = backend

    def forward(self, x: Tensor) -> Tensor:
        return swiglu(x, backend=self.backend)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}"
