"""Grouped GEMM (engine/ops/grouped_gemm.py): torch._grouped_mm against the loop reference, forward and
backward, with an empty group; argument checks. On CPU where this torch ships the CPU kernel; the CUDA
bf16 path is exercised on a GPU (tolerance of bf16 accumulation order)."""
from __future__ import annotations

import pytest
import torch

from engine.ops.grouped_gemm import grouped_mm, grouped_mm_reference, has_torch_grouped_mm

COUNTS = [3, 0, 6, 4]


def _case(device, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 16, generator=g).to(device, dtype).requires_grad_()
    w = torch.randn(4, 24, 16, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(13, 24, generator=g).to(device, dtype)
    return x, w, dy


def _grads(fn, x, w, dy):
    y = fn(x, w, COUNTS)
    (y * dy).sum().backward()
    out = (y.detach(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    return out


@pytest.mark.skipif(not has_torch_grouped_mm(), reason="torch._grouped_mm missing")
def test_torch_grouped_mm_equals_the_loop_on_cpu():
    x, w, dy = _case("cpu", torch.float32)
    try:
        got = _grads(lambda *a: grouped_mm(*a, backend="torch"), x, w, dy)
    except (RuntimeError, NotImplementedError) as e:  # a torch build without the CPU kernel
        pytest.skip(f"torch._grouped_mm has no CPU kernel here: {e}")
    want = _grads(grouped_mm_reference, x, w, dy)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(want[2][1], torch.zeros(24, 16))  # the empty group's weight gets a zero gradient


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not has_torch_grouped_mm(), reason="needs CUDA")
def test_auto_uses_grouped_mm_on_cuda_bf16():
    x, w, dy = _case("cuda", torch.bfloat16)
    got = _grads(lambda *a: grouped_mm(*a, backend="auto"), x, w, dy)
    want = _grads(grouped_mm_reference, x, w, dy)
    for a, b in zip(got, want):
        assert torch.allclose(a.float(), b.float(), atol=0.1, rtol=0.02)


def test_bad_arguments_are_refused():
    x, w = torch.randn(5, 16), torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match="counts sum to 4"):
        grouped_mm(x, w, [1, 3])
    with pytest.raises(ValueError, match="backend='fast'"):
        grouped_mm(x, w, [2, 3], backend="fast")
    if has_torch_grouped_mm():
        with pytest.raises(ValueError, match="16-byte aligned"):
            grouped_mm(torch.randn(5, 6), torch.randn(2, 8, 6), [2, 3], backend="torch")
