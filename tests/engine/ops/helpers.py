"""Numerical helpers for the fused-op tests."""
from __future__ import annotations

import torch


def bf16_error_bound(ref_lowp: torch.Tensor, ref_fp64: torch.Tensor) -> float:
    """The bound for a bf16 kernel: 2x PyTorch's own bf16 error + half a bf16 ulp at the top.

    ``ref_lowp``: the PyTorch reference run in bf16; ``ref_fp64``: the same math in float64.
    The factor 2 covers a different (equally valid) rounding order and the interpreter's bf16
    downcast, which truncates (error < 1 ulp) instead of rounding to nearest (<= 1/2 ulp). The
    additive term, ``2**-8 * max|ref|`` (half an ulp of the largest value), covers the case where
    the few largest elements happen to round almost exactly in the reference but not here.
    """
    ref_err = (ref_lowp.double() - ref_fp64).abs().max().item()
    scale = ref_fp64.abs().max().item()
    return 2.0 * ref_err + scale * 2.0 ** -8 + 1e-12


def assert_bf16_close(out: torch.Tensor, ref_lowp: torch.Tensor, ref_fp64: torch.Tensor, what: str):
    assert out.dtype == ref_lowp.dtype, f"{what}: dtype {out.dtype} != {ref_lowp.dtype}"
    err = (out.double() - ref_fp64).abs().max().item()
    bound = bf16_error_bound(ref_lowp, ref_fp64)
    assert err <= bound, f"{what}: max error {err:.3e} vs fp64 exceeds bound {bound:.3e}"
