"""FP8 e4m3 / e5m2 cast + transpose + amax: engine._fp8 (C++ path) bit for bit against torch."""
import pytest
import torch

from engine import _native
from engine.ops.fp8_cast_transpose import (fp8_cast_transpose, fp8_cast_transpose_grid,
                                           fp8_cast_transpose_grid_reference, fp8_cast_transpose_reference)

needs_native = pytest.mark.skipif(not _native.available("fp8"),
                                  reason="engine._fp8 not built (run setup.py build_ext --inplace)")
BACKENDS = [pytest.param("native", marks=needs_native), "reference"]


def _bits(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 129), (1, 5), (130, 64)])
def test_matches_torch_cast_bit_for_bit(backend, dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 30).to(dtype)
    x.view(-1)[::17] = 1e-3  # subnormals of e4m3 after scaling
    scale = torch.tensor([3.7])  # pushes the tails past 448: saturation
    out, out_t, amax = fp8_cast_transpose(x, scale, backend=backend)
    want = (x.float() * scale).to(torch.float8_e4m3fn)
    assert out.dtype == out_t.dtype == torch.float8_e4m3fn
    assert out_t.shape == (shape[1], shape[0]) and out_t.is_contiguous()
    assert torch.equal(_bits(out), _bits(want))
    assert torch.equal(_bits(out_t), _bits(want.t().contiguous()))
    assert amax.dtype == torch.float32 and amax.item() == x.float().abs().max().item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_e5m2_matches_torch_cast_bit_for_bit(backend, dtype):
    """The output-gradient format: torch's e5m2 conversion after a clamp to +-57344 (torch alone
    would overflow to inf), subnormals included."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 129, generator=gen) * 3e4).to(dtype)
    x.view(-1)[::13] = 1e-6  # e5m2 subnormals after scaling
    x[0, :3] = torch.tensor([float("inf"), -float("inf"), 1e9])
    scale = torch.tensor([1.5])
    out, out_t, amax = fp8_cast_transpose(x, scale, fmt=torch.float8_e5m2, backend=backend)
    want = (x.float() * scale).clamp(-57344.0, 57344.0).to(torch.float8_e5m2)
    assert out.dtype == out_t.dtype == torch.float8_e5m2
    assert torch.equal(_bits(out), _bits(want)) and torch.equal(_bits(out_t), _bits(want.t().contiguous()))
    assert out.float()[0, :3].tolist() == [57344.0, -57344.0, 57344.0]
    assert amax.item() == float("inf")


def test_bad_format_raises():
    with pytest.raises(ValueError, match="fmt=torch.float16 is not torch.float8_e4m3fn or torch.float8_e5m2"):
        fp8_cast_transpose(torch.ones(2, 2), torch.ones(1), fmt=torch.float16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_saturation_and_nan(backend):
    x = torch.tensor([[1000.0, -float("inf"), 0.5], [float("nan"), 448.0, -1e-9]])
    out, out_t, amax = fp8_cast_transpose(x, torch.tensor([1.0]), backend=backend)
    ref_out, ref_t, _ = fp8_cast_transpose_reference(x, torch.tensor([1.0]))
    assert torch.equal(_bits(out), _bits(ref_out)) and torch.equal(_bits(out_t), _bits(ref_t))
    assert out.float()[0, 0].item() == 448.0 and out.float()[0, 1].item() == -448.0
    assert torch.isnan(amax).all()  # a NaN input must not hide behind a finite amax


@needs_native
def test_native_module_reports_cuda_flag():
    assert isinstance(_native.load("fp8").WITH_CUDA, bool)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("x, scale, match", [
    (torch.ones(2, 3, 4), torch.ones(1), "must be a 2-D"),
    (torch.ones(2, 3, dtype=torch.float16), torch.ones(1), "must be a 2-D float32 or bfloat16"),
    (torch.ones(2, 3), torch.ones(2), "one-element float32"),
    (torch.ones(2, 3), torch.ones(1, dtype=torch.float64), "one-element float32"),
])
def test_bad_inputs_raise(backend, x, scale, match):
    with pytest.raises(ValueError, match=match):
        fp8_cast_transpose(x, scale, backend=backend)


def test_bad_backend_raises():
    with pytest.raises(ValueError, match="backend='te' is not one of"):
        fp8_cast_transpose(torch.ones(2, 2), torch.ones(1), backend="te")


@needs_native
def test_native_binding_checks_directly():
    mod = _native.load("fp8")
    with pytest.raises(ValueError, match="must be contiguous"):
        mod.cast_transpose(torch.ones(4, 3).t(), torch.ones(1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_grid_scales_bit_for_bit(backend, dtype, fmt):
    """Per-row, per-column, 1 x 128, 128 x 1 and 128 x 128 scale grids on ragged shapes: each element
    times its cell's scale, clamped and converted as torch does; either output alone or both."""
    gen = torch.Generator().manual_seed(2)
    rows, cols = 200, 300  # ragged against 128 both ways
    x = (torch.randn(rows, cols, generator=gen) * torch.logspace(-4, 4, cols)).to(dtype)
    x[3, 5], x[7, 9] = float("nan"), float("inf")
    for block in ((1, cols), (rows, 1), (1, 128), (128, 1), (128, 128)):
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        scale = torch.rand(grid, generator=gen) * 8
        full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        m = 448.0 if fmt == torch.float8_e4m3fn else 57344.0
        want = (x.float() * full).clamp(-m, m).to(fmt)
        for w_out, w_t in ((True, True), (True, False), (False, True)):
            out, out_t, amax = fp8_cast_transpose_grid(x, scale, block, fmt=fmt, want_out=w_out, want_out_t=w_t,
                                                       backend=backend)
            assert (out is None) == (not w_out) and (out_t is None) == (not w_t)
            if w_out:
                assert out.dtype == fmt and torch.equal(_bits(out), _bits(want)), block
            if w_t:
                assert out_t.is_contiguous() and torch.equal(_bits(out_t), _bits(want.t().contiguous())), block
            assert torch.isnan(amax).all()  # x holds a NaN


@pytest.mark.parametrize("backend", BACKENDS)
def test_grid_matches_the_one_scale_kernel(backend):
    x = torch.randn(37, 129) * 100
    scale = torch.tensor([3.7])
    one = fp8_cast_transpose(x, scale, backend=backend)
    grid = fp8_cast_transpose_grid(x, scale.reshape(1, 1), (37, 129), backend=backend)
    for a, b in zip(one[:2], grid[:2]):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(one[2], grid[2])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale, block, kw, match", [
    (torch.ones(4, 2), (1, 6), {}, r"scale must be a float32 \(4, 1\) tensor"),
    (torch.ones(3, 1), (1, 6), {}, r"scale must be a float32 \(4, 1\)"),
    (torch.ones(4, 1, dtype=torch.float64), (1, 6), {}, "scale must be a float32"),
    (torch.ones(1, 1), (0, 6), {}, "block=.* must be two sizes >= 1"),
    (torch.ones(1, 1), (4, 6), {"want_out": False, "want_out_t": False}, "nothing to compute"),
])
def test_grid_bad_inputs_raise(backend, scale, block, kw, match):
    with pytest.raises(ValueError, match=match):
        fp8_cast_transpose_grid(torch.ones(4, 6), scale, block, backend=backend, **kw)


def test_grid_reference_is_what_fp8_linear_quantises_with():
    """The reference backend (CPU without the extension) and the native one agree on a layer's scales."""
    x = torch.randn(48, 256)
    scale = torch.rand(48, 2) + 0.5
    a = fp8_cast_transpose_grid_reference(x, scale, (1, 128))
    b = fp8_cast_transpose_grid(x, scale, (1, 128))
    assert torch.equal(_bits(a[0]), _bits(b[0])) and torch.equal(_bits(a[1]), _bits(b[1]))
