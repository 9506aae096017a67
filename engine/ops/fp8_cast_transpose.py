"""FP8 (e4m3 or e5m2) cast + transpose + amax in one pass (native: csrc/fp8 -> engine._fp8).

For FP8 training with per-tensor scaling: the forward GEMM wants ``x`` in e4m3 row-major, the
backward GEMMs want its transpose, and the next step's scale needs ``amax = max |x|``; the output
gradient likewise in e5m2, row-major for the input gradient and transposed for the weight
gradient. One read of ``x`` produces all three:

    out   = fp8(x * scale)          (rows, cols)
    out_t = fp8(x * scale).T        (cols, rows), contiguous
    amax  = max |x|                 (1,) float32, of the unscaled input; NaN if x has a NaN

``fp8`` is ``torch.float8_e4m3fn`` (``fmt``'s default) or ``torch.float8_e5m2`` conversion: round to
nearest even, saturating at the format's max (448 or 57344; inf included), NaN stays NaN.
``scale`` is a one-element float32 tensor on x's device, read on the device (no host sync;
delayed-scaling recipes keep it there).
"""
from __future__ import annotations

import torch
from torch import Tensor

from engine import _native

_OP = "fp8_cast_transpose"
_BACKENDS = ("auto", "native", "reference")


FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # the formats' largest finite values


def fp8_cast_transpose_reference(x: Tensor, scale: Tensor, *, fmt: torch.dtype = torch.float8_e4m3fn
                                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Plain-PyTorch version of :func:`fp8_cast_transpose` (same promises, bit for bit): the grid
    reference with one cell."""
    block = (max(x.shape[0], 1), max(x.shape[1], 1))
    return fp8_cast_transpose_grid_reference(x, scale.reshape(1, 1), block, fmt=fmt)


def scale_from_amax(amax: Tensor, fmt: torch.dtype) -> Tensor:
    """Current per-tensor scale(s) from amax(es), elementwise: ``min(fp8_max / amax, FLT_MAX)`` (the
    division rounded to nearest) where amax is positive and finite, else 1 (nothing to scale by; a
    tiny amax overflows the division, clamped so that 0 * scale stays 0). fp32, ``amax``'s shape.
    The native :func:`fp8_cast_transpose_scaled` computes the same on its device, bit for bit."""
    amax = amax.float()
    ok = (amax > 0) & (amax < float("inf"))  # NaN compares False
    scale = torch.where(ok, torch.full_like(amax, FP8_MAX[fmt]) / amax, 1.0)
    return scale.clamp(max=torch.finfo(torch.float32).max)


def pow2_scales(amax: Tensor, fmt: torch.dtype) -> tuple[Tensor, Tensor]:
    """The MX recipe's power-of-two (scale, scale_inv) of each amax (fp32, amax's shape): with ``r = amax /
    fp8_max`` (rounded to nearest), ``scale_inv = 2**e`` for ``e = ceil(log2(r))``, the smallest power of two
    with r / 2**e <= 1 (the block fits the format unclipped; an exact power of two is not rounded up), e
    clamped to [-126, 126] (fp32 normals both ways; E8M0 also has 2**-127; a positive amax whose r underflows
    to 0 takes e = -126); 1 where the amax is not positive and finite. Built from exponent bits: exact
    reciprocals. The native :func:`fp8_scales_from_amax` with ``pow2=True`` computes the same, bit for bit."""
    amax = amax.float()
    ratio = amax / FP8_MAX[fmt]
    ok = (amax > 0) & (amax < float("inf"))
    mant, exp = torch.frexp(torch.where(ratio > 0, ratio, 1.0))  # ratio = mant * 2**exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)  # an exact power of two needs no rounding up
    e = torch.where(ratio > 0, e, -126)  # a positive amax whose ratio underflows: the smallest scale_inv
    e = torch.where(ok, e, 0).clamp(-126, 126).to(torch.int32)
    bits = lambda k: ((k + 127) << 23).view(torch.float32)  # 2**k for a normal exponent k
    return bits(-e), bits(e)


def fp8_scales_from_amax(amax: Tensor, fmt: torch.dtype = torch.float8_e4m3fn, *, pow2: bool = False,
                         backend: str = "auto") -> tuple[Tensor, Tensor]:
    """(:func:`scale_from_amax` of ``amax``, its reciprocal), both of ``amax``'s shape, float32: the row-,
    tile- and block-wise recipes' grids of scales and dequantisation scales in one native call (one
    launch on a GPU) instead of a dozen elementwise PyTorch ops. ``pow2``: the MX recipe's power-of-two
    scales (:func:`pow2_scales`). Bit for bit the reference."""
    if backend not in _BACKENDS:
        raise ValueError(f"fp8_scales_from_amax: backend={backend!r} is not one of {_BACKENDS}.")
    if fmt not in FP8_MAX:
        raise ValueError(f"fp8_scales_from_amax: fmt={fmt} is not torch.float8_e4m3fn or torch.float8_e5m2.")
    if backend == "native" or (backend == "auto" and _native.available("fp8")):
        return _native.op("fp8", "scales_from_amax")(amax.float(), e5m2=fmt == torch.float8_e5m2, pow2=pow2)
    if pow2:
        return pow2_scales(amax, fmt)
    scale = scale_from_amax(amax, fmt)
    return scale, 1.0 / scale


def _check_common(op: str, x: Tensor, fmt: torch.dtype, backend: str) -> None:
    """The checks both entry points share: backend, format, and x a 2-D fp32/bf16 tensor."""
    if backend not in _BACKENDS:
        raise ValueError(f"{op}: backend={backend!r} is not one of {_BACKENDS}.")
    if fmt not in FP8_MAX:
        raise ValueError(f"{op}: fmt={fmt} is not torch.float8_e4m3fn or torch.float8_e5m2.")
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{op}: x must be a 2-D float32 or bfloat16 tensor, got {x.dtype} "
                         f"{tuple(x.shape)}; reshape to (-1, hidden) and cast.")


def fp8_cast_transpose(x: Tensor, scale: Tensor, *, fmt: torch.dtype = torch.float8_e4m3fn,
                       backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """``x``: (rows, cols) float32 or bfloat16, contiguous; ``fmt``: torch.float8_e4m3fn or
    torch.float8_e5m2. Returns (out, out_t, amax); see module doc.

    backend: "native" (engine._fp8: CUDA kernel or C++ loop by device), "reference", or "auto"
    (native when built, else reference).
    """
    _check_common(_OP, x, fmt, backend)
    if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device != x.device:
        raise ValueError(f"{_OP}: scale must be a one-element float32 tensor on {x.device}, got "
                         f"{scale.dtype} with {scale.numel()} elements on {scale.device}.")
    if backend == "native" or (backend == "auto" and _native.available("fp8")):
        return _native.op("fp8", "cast_transpose")(x.contiguous(), scale, e5m2=fmt == torch.float8_e5m2)
    return fp8_cast_transpose_reference(x, scale, fmt=fmt)


def fp8_cast_transpose_scaled_reference(x: Tensor, *, scale: Tensor | None = None, amax: Tensor | None = None,
                                        fmt: torch.dtype = torch.float8_e4m3fn, want_out_t: bool = True,
                                        want_amax: bool = True, amax_into: Tensor | None = None
                                        ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """Plain-PyTorch version of :func:`fp8_cast_transpose_scaled` (same promises, bit for bit)."""
    if scale is None and amax is None:  # current scaling from x's own amax
        amax = x.float().abs().amax().reshape(1) if x.numel() else x.new_zeros(1, dtype=torch.float32)
    s = scale_from_amax(amax, fmt) if scale is None else scale.float()
    q, q_t, x_amax = fp8_cast_transpose_reference(x, s.reshape(1), fmt=fmt)
    if amax_into is not None:
        torch.maximum(amax_into, x_amax.reshape(amax_into.shape), out=amax_into)
    return q, (q_t if want_out_t else None), (x_amax if want_amax else None), (1.0 / s).reshape(())


def fp8_cast_transpose_scaled(x: Tensor, *, scale: Tensor | None = None, amax: Tensor | None = None,
                              fmt: torch.dtype = torch.float8_e4m3fn, want_out_t: bool = True, want_amax: bool = True,
                              amax_into: Tensor | None = None, backend: str = "auto"
                              ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """:func:`fp8_cast_transpose` for per-tensor scaling, in one call: given ``scale``, or ``amax`` (the
    current amax of the tensor the scale is for, e.g. all-reduced over a TP group; the scale is then
    :func:`scale_from_amax` of it, computed on x's device with no host sync), or neither: current scaling
    from x's own amax, reduced by the native op before its cast (that launch issued from C++, not from
    Python; the amax returned is that reduction's). Returns (out, out_t or
    None (``want_out_t=False``), amax of x (1,) or None (``want_amax=False``: not computed, and on a GPU
    no memset launched for it), the 0-dim dequantisation scale ``1 / scale``): what an FP8 GEMM takes,
    with no scale arithmetic left to launch from Python. ``amax_into`` (with ``want_amax=False``): a
    one-element float32 running maximum on x's device (a delayed-scaling state's pending amax, so
    non-negative or NaN) that max |x| is folded into by the cast itself, with no op of its own."""
    _check_common(f"{_OP}_scaled", x, fmt, backend)
    if scale is not None and amax is not None:
        raise ValueError(f"{_OP}_scaled: give at most one of scale= and amax= (neither: x's own amax)")
    given = scale if amax is None else amax
    if given is not None and (given.dtype != torch.float32 or given.numel() != 1 or given.device != x.device):
        raise ValueError(f"{_OP}_scaled: {'scale' if amax is None else 'amax'} must be a one-element float32 "
                         f"tensor on {x.device}, got {given.dtype} with {given.numel()} elements on {given.device}.")
    if amax_into is not None:
        if want_amax:
            raise ValueError(f"{_OP}_scaled: amax_into folds max |x| into a running maximum and returns no amax; "
                             "pass want_amax=False with it")
        if (amax_into.dtype != torch.float32 or amax_into.numel() != 1 or amax_into.device != x.device
                or not amax_into.is_contiguous()):
            raise ValueError(f"{_OP}_scaled: amax_into must be a contiguous one-element float32 tensor on {x.device}, "
                             f"got {amax_into.dtype} with {amax_into.numel()} elements on {amax_into.device}.")
        if given is not None and amax_into.data_ptr() == given.data_ptr():
            raise ValueError(f"{_OP}_scaled: amax_into is the {'scale' if amax is None else 'amax'} tensor itself: "
                             "the cast would read it while folding into it; give a separate running maximum")
    if backend == "native" or (backend == "auto" and _native.available("fp8")):
        return _native.op("fp8", "cast_transpose_scaled")(x.contiguous(), given, from_amax=amax is not None,
                                                         e5m2=fmt == torch.float8_e5m2, want_out_t=want_out_t,
                                                         want_amax=want_amax, amax_into=amax_into)
    return fp8_cast_transpose_scaled_reference(x, scale=scale, amax=amax, fmt=fmt, want_out_t=want_out_t,
                                               want_amax=want_amax, amax_into=amax_into)


def fp8_cast_transpose_grid_reference(x: Tensor, scale: Tensor, block: tuple[int, int], *,
                                      fmt: torch.dtype = torch.float8_e4m3fn, want_out: bool = True,
                                      want_out_t: bool = True, want_amax: bool = True
                                      ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Plain-PyTorch version of :func:`fp8_cast_transpose_grid` (same promises, bit for bit)."""
    rows, cols = x.shape
    br, bc = block
    s = scale.float()  # (grid rows, grid cols), expanded only along a dimension with more than one scale
    if s.shape[0] > 1:
        s = s.repeat_interleave(br, dim=0)[:rows]
    if s.shape[1] > 1:
        s = s.repeat_interleave(bc, dim=1)[:, :cols]  # broadcasts against (rows, cols)
    m = FP8_MAX[fmt]
    xf = x.float()
    # The explicit clamp saturates on every device and format: torch's CPU e4m3 conversion saturates
    # by itself, its CUDA one (torch 2.11) turns overflow into NaN, e5m2 into inf. clamp keeps NaN.
    q = (xf * s).clamp(-m, m).to(fmt)  # (rows, cols)
    # NaN-propagating amax: torch.amax propagates NaN like the native bit-pattern maximum.
    amax = None
    if want_amax:
        amax = xf.abs().amax().reshape(1) if x.numel() else x.new_zeros(1, dtype=torch.float32)
    return (q if want_out else None), (q.t().contiguous() if want_out_t else None), amax


def fp8_cast_transpose_grid(x: Tensor, scale: Tensor, block: tuple[int, int], *,
                            fmt: torch.dtype = torch.float8_e4m3fn, want_out: bool = True, want_out_t: bool = True,
                            want_amax: bool = True, backend: str = "auto"
                            ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """:func:`fp8_cast_transpose` with a grid of scales, for the row-, tile- and block-wise recipes:
    element (r, c) of ``x`` (rows, cols) is multiplied by ``scale[r // block[0], c // block[1]]``, ``scale``
    a float32 (ceil(rows / block[0]), ceil(cols / block[1])) tensor on x's device. E.g. block (1, cols):
    a scale per row; (rows, 1): per column; (1, 128): 1 x 128 tiles; (128, 128): blocks. Returns (out or
    None, out_t or None, amax of x): ``want_out`` / ``want_out_t`` say which of the fp8 (rows, cols) and
    its (cols, rows) transpose to write (one pass over x either way); ``want_amax=False``: the amax is
    not computed (None)."""
    _check_common(f"{_OP}_grid", x, fmt, backend)
    br, bc = block
    if br < 1 or bc < 1:
        raise ValueError(f"{_OP}_grid: block={block} must be two sizes >= 1")
    grid = (-(-x.shape[0] // br), -(-x.shape[1] // bc))
    if scale.dtype != torch.float32 or tuple(scale.shape) != grid or scale.device != x.device:
        raise ValueError(f"{_OP}_grid: scale must be a float32 {grid} tensor on {x.device} (ceil(rows / "
                         f"{br}), ceil(cols / {bc})), got {scale.dtype} {tuple(scale.shape)} on {scale.device}.")
    if not (want_out or want_out_t):
        raise ValueError(f"{_OP}_grid: want_out and want_out_t are both False: nothing to compute")
    if backend == "native" or (backend == "auto" and _native.available("fp8")):
        return _native.op("fp8", "cast_transpose_grid")(x.contiguous(), scale.contiguous(), br, bc,
                                                       e5m2=fmt == torch.float8_e5m2, want_out=want_out,
                                                       want_out_t=want_out_t, want_amax=want_amax)
    return fp8_cast_transpose_grid_reference(x, scale, block, fmt=fmt, want_out=want_out, want_out_t=want_out_t,
                                             want_amax=want_amax)
