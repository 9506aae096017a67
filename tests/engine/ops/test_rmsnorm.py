"""RMSNorm: Triton kernels (interpreter on CPU) vs the PyTorch reference vs Hugging Face."""
import pytest
import torch

from engine.ops.rmsnorm import RMSNorm, rms_norm, rms_norm_reference
from tests.engine.ops.helpers import assert_bf16_close

EPS = 1e-6


def _run(x, w, r, backend, dy, dh):
    """Forward + backward; returns outputs and grads (x, weight, residual)."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    r = None if r is None else r.detach().requires_grad_()
    if r is None:
        y, h = rms_norm(x, w, EPS, backend=backend), None
        y.backward(dy)
    else:
        y, h = rms_norm(x, w, EPS, residual=r, backend=backend)
        torch.autograd.backward([y, h], [dy, dh])
    return y, h, x.grad, w.grad, (None if r is None else r.grad)


@pytest.mark.parametrize("shape", [(37, 127), (3, 5, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_matches_reference_fp32(shape, with_residual):
    torch.manual_seed(0)
    x, dy, dh = torch.randn(shape), torch.randn(shape), torch.randn(shape)
    w = torch.randn(shape[-1])
    r = torch.randn(shape) if with_residual else None
    got = _run(x, w, r, "triton", dy, dh)
    want = _run(x, w, r, "reference", dy, dh)
    for name, a, b in zip(("y", "h", "dx", "dw", "dres"), got, want):
        if b is None:
            assert a is None, name
            continue
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_triton_bf16_error_within_twice_torch_error():
    torch.manual_seed(1)
    shape = (37, 1000)
    x, r = torch.randn(shape), torch.randn(shape)
    dy, dh = torch.randn(shape), torch.randn(shape)
    w = 1 + 0.1 * torch.randn(shape[-1])
    bf = lambda t: t.bfloat16()  # noqa: E731
    got = _run(bf(x), bf(w), bf(r), "triton", bf(dy), bf(dh))
    low = _run(bf(x), bf(w), bf(r), "reference", bf(dy), bf(dh))
    exact = _run(*(bf(t).double() for t in (x, w, r)), "reference", *(bf(t).double() for t in (dy, dh)))
    for name, a, b, c in zip(("y", "h", "dx", "dw", "dres"), got, low, exact):
        assert_bf16_close(a, b, c, name)


def test_reference_matches_huggingface_llama_rmsnorm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(2)
    hf = LlamaRMSNorm(64, eps=EPS)
    with torch.no_grad():
        hf.weight.normal_()
    x = torch.randn(4, 3, 64)
    torch.testing.assert_close(rms_norm_reference(x, hf.weight, EPS), hf(x), rtol=1e-6, atol=1e-6)


def test_auto_dispatch_on_cpu_is_reference_and_module_works():
    torch.manual_seed(3)
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x, r = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    y, h = norm(x, r)
    want_y, want_h = rms_norm_reference(x, norm.weight, 1e-5, residual=r)
    assert torch.equal(y, want_y) and torch.equal(h, want_h)
    assert torch.equal(norm(x), rms_norm_reference(x, norm.weight, 1e-5))


def test_weight_grad_reduces_across_many_programs():
    # 37 rows over 4 programs (the CPU partial count): rows per program 10, 10, 10, 7.
    torch.manual_seed(4)
    x, w = torch.randn(37, 8), torch.randn(8, requires_grad=True)
    rms_norm(x, w, EPS, backend="triton").sum().backward()
    got = w.grad.clone()
    w.grad = None
    rms_norm_reference(x, w, EPS).sum().backward()
    torch.testing.assert_close(got, w.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile_rows", [1, 2, 4, 16])
def test_backward_row_tiles_match_the_reference(tile_rows):
    """The backward's (rows, hidden) tiles: each tile size gives the reference's dx, dw and dres, where the
    rows per program (37 over 4 programs: 10, 10, 10, 7) are not a multiple of the tile (masked rows
    must add nothing to dw), and one row at a time (1, the A/B baseline) too."""
    torch.manual_seed(7)
    x, r, dy, dh = (torch.randn(37, 40) for _ in range(4))
    w = torch.randn(40)
    xs, ws, rs = (t.detach().requires_grad_() for t in (x, w, r))
    y, h = rms_norm(xs, ws, EPS, residual=rs, backend="triton", bwd_tile_rows=tile_rows)
    torch.autograd.backward([y, h], [dy, dh])
    got = (y, h, xs.grad, ws.grad, rs.grad)
    want = _run(x, w, r, "reference", dy, dh)
    for name, a, b in zip(("y", "h", "dx", "dw", "dres"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_default_backward_tile_by_hidden_size():
    from engine.ops.rmsnorm import bwd_tile_rows

    assert [bwd_tile_rows(h) for h in (40, 1000, 2048, 4096, 5120, 8192, 16384)] == [16, 16, 8, 4, 2, 2, 1]


def test_non_contiguous_input():
    torch.manual_seed(5)
    x = torch.randn(16, 6).t()  # (6, 16) with stride (1, 6)
    w = torch.randn(16)
    torch.testing.assert_close(rms_norm(x, w, EPS, backend="triton"), rms_norm_reference(x, w, EPS))


def test_opcheck_and_compile():
    from engine.ops.rmsnorm import _rms_norm_fwd

    torch.manual_seed(6)
    x, w, r = torch.randn(5, 24, requires_grad=True), torch.randn(24, requires_grad=True), torch.randn(5, 24)
    torch.library.opcheck(_rms_norm_fwd, (x, w, r, EPS, 0))
    torch.library.opcheck(_rms_norm_fwd, (x, w, r, EPS, 4))

    def f(x, w, r):
        y, h = rms_norm(x, w, EPS, residual=r, backend="triton")
        return (y * h).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(x, w, r)
    got.backward()
    gx = x.grad.clone()
    x.grad = None
    f(x, w, r).backward()
    torch.testing.assert_close(got, f(x, w, r))
    torch.testing.assert_close(gx, x.grad)


@pytest.mark.parametrize("kwargs, match", [
    (dict(weight=torch.ones(7)), "weight must be 1-D of size"),
    (dict(weight=torch.ones(2, 8)), "weight must be 1-D of size"),
    (dict(residual=torch.ones(3, 7)), "residual must match x"),
    (dict(residual=torch.ones(3, 8, dtype=torch.float64)), "residual must match x"),
    (dict(x=torch.ones(3, 8, dtype=torch.int64)), "floating dtype"),
    (dict(eps=-1.0), "eps=-1.0 must be >= 0"),
    (dict(backend="cuda"), "backend='cuda' is not one of"),
    (dict(x=torch.ones(3, 8, dtype=torch.float64), backend="triton"), "does not support float64"),
    (dict(bwd_tile_rows=3), "bwd_tile_rows=3 must be 0"),
])
def test_bad_inputs_raise(kwargs, match):
    args = dict(x=torch.ones(3, 8), weight=torch.ones(8), eps=EPS, residual=None, backend="auto")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        rms_norm(args.pop("x"), args.pop("weight"), args.pop("eps"), **args)


def test_module_rejects_bad_size():
    with pytest.raises(ValueError, match="hidden_size=0 must be positive"):
        RMSNorm(0)
