"""FP8 (e4m3) cast + transpose + amax in one pass (native: csrc/fp8 -> engine._fp8).

For FP8 training with per-tensor scaling: the forward GEMM wants ``x`` in e4m3 row-major, the
backward GEMMs want its transpose, and the next step's scale needs ``amax = max |x|``. One read of
``x`` produces all three:

    out   = e4m3(x * scale)         (rows, cols)
    out_t = e4m3(x * scale).T       (cols, rows), contiguous
    amax  = max |x|                 (1,) float32, of the unscaled input; NaN if x has a NaN

``e4m3`` is ``torch.float8_e4m3fn`` conversion: round to nearest even, saturating at +-448 (inf
included), NaN stays NaN. ``scale`` is a one-element float32 tensor on x's device, read on the
device (no host sync; delayed-scaling recipes keep it there).
"""
from __future__ import annotations

import torch
from torch import Tensor

from engine import _native

_OP = "fp8_cast_transpose"
_BACKENDS = ("auto", "native", "reference")


def fp8_cast_transpose_reference(x: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Plain-PyTorch version of :func:`fp8_cast_transpose` (same promises, bit for bit)."""
    # The explicit clamp saturates on every device: torch's CPU conversion saturates by itself, its
    # CUDA conversion (torch 2.11) turns overflow into NaN. clamp keeps NaN as NaN.
    scaled = (x.float() * scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)  # (rows, cols)
    # NaN-propagating amax: torch.amax propagates NaN like the native bit-pattern maximum.
    amax = x.float().abs().amax().reshape(1) if x.numel() else x.new_zeros(1, dtype=torch.float32)
    return scaled, scaled.t().contiguous(), amax  # out_t: (cols, rows)


def fp8_cast_transpose(x: Tensor, scale: Tensor, *, backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """``x``: (rows, cols) float32 or bfloat16, contiguous. Returns (out, out_t, amax); see module doc.

    backend: "native" (engine._fp8: CUDA kernel or C++ loop by device), "reference", or "auto"
    (native when built, else reference).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"{_OP}: backend={backend!r} is not one of {_BACKENDS}.")
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{_OP}: x must be a 2-D float32 or bfloat16 tensor, got {x.dtype} "
                         f"{tuple(x.shape)}; reshape to (-1, hidden) and cast.")
    if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device != x.device:
        raise ValueError(f"{_OP}: scale must be a one-element float32 tensor on {x.device}, got "
                         f"{scale.dtype} with {scale.numel()} elements on {scale.device}.")
    if backend == "native" or (backend == "auto" and _native.available("fp8")):
        return _native.load("fp8").cast_transpose(x.contiguous(), scale)
    return fp8_cast_transpose_reference(x, scale)
