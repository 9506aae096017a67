"""FP8 e4m3 / e5m2 cast + transpose + amax: engine._fp8 (C++ path) bit for bit against torch."""
import pytest
import torch

from engine import _native
from engine.ops.fp8_cast_transpose import (FP8_MAX, fp8_cast_transpose, fp8_cast_transpose_grid,
                                           fp8_cast_transpose_grid_reference, fp8_cast_transpose_reference,
                                           fp8_cast_transpose_scaled, fp8_cast_transpose_scaled_reference,
                                           fp8_scales_from_amax, pow2_scales, scale_from_amax)

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
        for w_out, w_t, w_amax in ((True, True, True), (True, False, True), (False, True, True),
                                   (True, True, False)):
            out, out_t, amax = fp8_cast_transpose_grid(x, scale, block, fmt=fmt, want_out=w_out, want_out_t=w_t,
                                                       want_amax=w_amax, backend=backend)
            assert (out is None) == (not w_out) and (out_t is None) == (not w_t)
            if w_out:
                assert out.dtype == fmt and torch.equal(_bits(out), _bits(want)), block
            if w_t:
                assert out_t.is_contiguous() and torch.equal(_bits(out_t), _bits(want.t().contiguous())), block
            if w_amax:
                assert torch.isnan(amax).all()  # x holds a NaN
            else:
                assert amax is None  # not computed: the same bytes without the reduction


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


# The amaxes a per-tensor cast may be handed: ordinary, 0 (an all-zero tensor), inf / NaN (a broken
# step), a subnormal (its fp8_max / amax overflows: clamped to the largest fp32), negative (never an
# amax: scale 1 like the others that are not positive and finite).
EDGE_AMAXES = [3.25, 1e-3, 0.0, float("inf"), float("nan"), 1e-40, 1e-38, -2.0, 3e38]


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_scale_from_amax_rules(fmt):
    a = torch.tensor(EDGE_AMAXES)
    s = scale_from_amax(a, fmt)
    m = FP8_MAX[fmt]
    assert s[0] == torch.tensor(m) / torch.tensor(3.25)  # a rounded division, not reciprocal * max
    assert s[2:6].tolist() == [1.0, 1.0, 1.0, torch.finfo(torch.float32).max]
    assert s[7] == 1.0 and torch.isfinite(s).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_cast_from_amax_bit_for_bit(backend, fmt, dtype):
    """One call from an amax (current scaling): the cast with scale_from_amax(amax) and 1 / scale, the
    same bits on the native path as in plain PyTorch, for every kind of amax."""
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(37, 129, generator=gen) * 7).to(dtype)
    for a in EDGE_AMAXES:
        amax = torch.tensor([a])
        out, out_t, x_amax, inv = fp8_cast_transpose_scaled(x, amax=amax, fmt=fmt, backend=backend)
        s = scale_from_amax(amax, fmt)
        want, want_t, want_amax = fp8_cast_transpose_reference(x, s, fmt=fmt)
        assert torch.equal(_bits(out), _bits(want)) and torch.equal(_bits(out_t), _bits(want_t)), a
        assert torch.equal(x_amax, want_amax)
        assert inv.shape == () and inv.dtype == torch.float32
        assert torch.equal(inv, (1.0 / s).reshape(())), a
    # a given scale: used as it is; no transpose wanted: none written
    scale = torch.tensor([0.37])
    out, out_t, _, inv = fp8_cast_transpose_scaled(x, scale=scale, fmt=fmt, want_out_t=False, backend=backend)
    assert out_t is None and torch.equal(_bits(out), _bits(fp8_cast_transpose_reference(x, scale, fmt=fmt)[0]))
    assert torch.equal(inv, (1.0 / scale).reshape(()))
    # no amax wanted (only delayed scaling keeps one): None, the same bytes and 1 / scale
    got = fp8_cast_transpose_scaled(x, amax=torch.tensor([3.0]), fmt=fmt, want_amax=False, backend=backend)
    full = fp8_cast_transpose_scaled(x, amax=torch.tensor([3.0]), fmt=fmt, backend=backend)
    assert got[2] is None and torch.equal(got[3], full[3])
    assert torch.equal(_bits(got[0]), _bits(full[0])) and torch.equal(_bits(got[1]), _bits(full[1]))
    assert fp8_cast_transpose_scaled(x[:0], amax=torch.tensor([2.0]), fmt=fmt, want_amax=False,
                                     backend=backend)[2] is None
    empty = fp8_cast_transpose_scaled(x[:0], amax=torch.tensor([2.0]), fmt=fmt, backend=backend)
    assert empty[0].shape == (0, 129) and empty[1].shape == (129, 0) and empty[2].item() == 0.0
    assert empty[3] == 1.0 / scale_from_amax(torch.tensor(2.0), fmt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scaled_cast_folds_its_amax_into_a_running_maximum(backend):
    """amax_into: the cast folds max |x| into a delayed state's pending slot itself (as bit patterns: NaN
    wins), leaving a larger value alone; the same bytes as without it."""
    x = torch.randn(37, 129) * 3
    pending = torch.tensor([0.0, 1e9, 0.0])
    full = fp8_cast_transpose_scaled(x, amax=torch.tensor([4.0]), backend=backend)
    for i, want in ((0, full[2]), (1, torch.tensor([1e9]))):
        got = fp8_cast_transpose_scaled(x, amax=torch.tensor([4.0]), want_amax=False, amax_into=pending[i:i + 1],
                                        backend=backend)
        assert got[2] is None and torch.equal(_bits(got[0]), _bits(full[0])) and torch.equal(_bits(got[1]), _bits(full[1]))
        assert torch.equal(pending[i:i + 1], want)
    x[5, 7] = float("nan")
    fp8_cast_transpose_scaled(x, scale=torch.tensor([1.0]), want_amax=False, amax_into=pending[1:2], backend=backend)
    assert torch.isnan(pending[1]) and pending[2] == 0.0  # NaN wins; the neighbouring slot is untouched
    with pytest.raises(ValueError, match="pass want_amax=False with it|give it with want_amax=False"):
        fp8_cast_transpose_scaled(x, amax=torch.tensor([4.0]), amax_into=pending[:1], backend=backend)
    same = torch.tensor([4.0])
    with pytest.raises(ValueError, match="itself"):
        fp8_cast_transpose_scaled(x, amax=same, want_amax=False, amax_into=same, backend=backend)
    with pytest.raises(ValueError, match="contiguous one-element float32"):
        fp8_cast_transpose_scaled(x, amax=same, want_amax=False, amax_into=pending[:2], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_cast_from_its_own_amax_bit_for_bit(backend, fmt, dtype):
    """Neither scale nor amax: current scaling from x's own amax, reduced by the op itself (the native
    op issues the reduction from C++). The same bits as the call given that amax, the amax returned is
    x's; a NaN in x gives a NaN amax and scale 1; an empty x amax 0; amax_into folds it in; and with
    want_amax=False nothing is returned for it."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 129, generator=gen) * 7).to(dtype)
    own = fp8_cast_transpose_scaled(x, fmt=fmt, backend=backend)
    x_amax = x.float().abs().amax().reshape(1)
    given = fp8_cast_transpose_scaled(x, amax=x_amax, fmt=fmt, backend=backend)
    for a, b in zip(own[:2], given[:2]):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(own[2], x_amax) and torch.equal(own[3], given[3])
    lean = fp8_cast_transpose_scaled(x, fmt=fmt, want_out_t=False, want_amax=False, backend=backend)
    assert lean[1] is None and lean[2] is None and torch.equal(_bits(lean[0]), _bits(own[0]))
    pending = torch.tensor([0.5])
    fp8_cast_transpose_scaled(x, fmt=fmt, want_amax=False, amax_into=pending, backend=backend)
    assert torch.equal(pending, x_amax)
    y = x.clone()
    y[3, 4] = float("nan")
    nan = fp8_cast_transpose_scaled(y, fmt=fmt, backend=backend)
    assert torch.isnan(nan[2]).all() and nan[3] == 1.0
    empty = fp8_cast_transpose_scaled(x[:0], fmt=fmt, backend=backend)
    assert empty[0].shape == (0, 129) and empty[2].item() == 0.0 and empty[3] == 1.0


@pytest.mark.parametrize("kw, match", [
    (dict(scale=torch.ones(1), amax=torch.ones(1)), "at most one of scale= and amax="),
    (dict(amax=torch.ones(2)), "amax must be a one-element float32 tensor"),
    (dict(scale=torch.ones(1, dtype=torch.float64)), "scale must be a one-element float32 tensor"),
])
def test_scaled_cast_bad_inputs(kw, match):
    with pytest.raises(ValueError, match=match):
        fp8_cast_transpose_scaled(torch.ones(4, 4), **kw)


def test_scaled_reference_matches_native_reference_helper():
    x = torch.randn(5, 16)
    got = fp8_cast_transpose_scaled_reference(x, amax=torch.tensor([2.0]), want_out_t=False)
    assert got[1] is None and got[3].shape == ()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_grid_of_scales_from_amaxes_bit_for_bit(backend, fmt):
    """The row/tile/block recipes' scales and 1 / scale in one call, any shape (a non-contiguous view too)."""
    a = torch.tensor(EDGE_AMAXES * 2).reshape(2, 9).t()  # (9, 2), not contiguous
    scale, inv = fp8_scales_from_amax(a, fmt, backend=backend)
    assert scale.shape == inv.shape == (9, 2)
    assert torch.equal(scale, scale_from_amax(a, fmt)) and torch.equal(inv, 1.0 / scale_from_amax(a, fmt))
    empty = fp8_scales_from_amax(torch.zeros(0, 3), fmt, backend=backend)
    assert empty[0].shape == (0, 3)
    with pytest.raises(ValueError, match="backend='x'"):
        fp8_scales_from_amax(a, fmt, backend="x")


def test_an_extension_built_from_older_sources_names_the_rebuild(monkeypatch):
    """A checkout pulled without rebuilding: engine._fp8 imports but lacks a new function. The op says to
    rebuild (ImportError), instead of an AttributeError inside a training step."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "engine._fp8", types.ModuleType("engine._fp8"))  # no functions at all
    with pytest.raises(ImportError, match=r"built from older sources: it has no 'cast_transpose_scaled'.*tools/install.sh"):
        fp8_cast_transpose_scaled(torch.ones(16, 16), amax=torch.ones(1), backend="native")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_power_of_two_scales_bit_for_bit(backend, fmt):
    """The MX recipe's scales: powers of two, exact reciprocals, the native call equal to the reference for
    every kind of amax, including ratios that are exact powers of two (not rounded up) and ones whose
    exponent is clamped."""
    m = FP8_MAX[fmt]
    a = torch.tensor(EDGE_AMAXES + [m * 2.0 ** -10, m * 2.0 ** -10 * 1.0000001, m, m * 1.5, 1e-45, m * 2.0 ** 100])
    scale, inv = fp8_scales_from_amax(a, fmt, pow2=True, backend=backend)
    want = pow2_scales(a, fmt)
    assert torch.equal(scale, want[0]) and torch.equal(inv, want[1])
    mant, _ = torch.frexp(torch.cat([scale, inv]))
    assert bool((mant == 0.5).all()) and torch.equal(scale * inv, torch.ones_like(scale))
    assert inv[9] == 2.0 ** -10 and inv[10] == 2.0 ** -9 and inv[11] == 1.0 and inv[12] == 2.0  # rounded up only past 2**k
    assert inv[2:5].tolist() == [1.0, 1.0, 1.0] and inv[7] == 1.0  # 0, inf, NaN, negative
    # clamped; 1e-45 / fp8_max underflows to 0, yet the block is not empty: the smallest scale_inv
    assert inv[14] == 2.0 ** 100 and inv[13] == 2.0 ** -126 and inv[5] == 2.0 ** -126
