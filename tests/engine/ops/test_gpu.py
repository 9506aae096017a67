"""The compiled kernels on a CUDA GPU vs the references (skipped without one; marked gpu)."""
import pytest
import torch

from engine import _native
from engine.ops.fused_adamw import fused_adamw_
from engine.ops.fused_linear_ce import fused_linear_cross_entropy, linear_cross_entropy_reference
from engine.ops.rmsnorm import rms_norm
from engine.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq
from engine.ops.swiglu import swiglu
from tests.engine.ops.helpers import assert_bf16_close

pytestmark = pytest.mark.gpu


def _grads(fn, inputs, grad_out):
    inputs = [t.detach().requires_grad_() for t in inputs]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(list(outs), list(grad_out))
    return [o.detach() for o in outs] + [t.grad for t in inputs]


def _check_bf16(fn_triton, fn_ref, inputs, grad_out):
    got = _grads(fn_triton, inputs, grad_out)
    low = _grads(fn_ref, inputs, grad_out)
    exact = _grads(fn_ref, [t.double() for t in inputs], [g.double() for g in grad_out])
    for i, (a, b, c) in enumerate(zip(got, low, exact)):
        assert_bf16_close(a, b, c, f"output/grad {i}")


def test_rmsnorm_cuda():
    x, r = torch.randn(2, 1000, 4096, device="cuda").bfloat16(), torch.randn(2, 1000, 4096, device="cuda").bfloat16()
    w = (1 + 0.1 * torch.randn(4096, device="cuda")).bfloat16()
    go = [torch.randn_like(x), torch.randn_like(x)]
    _check_bf16(lambda a, b, c: rms_norm(a, b, 1e-5, residual=c, backend="triton"),
                lambda a, b, c: rms_norm(a, b, 1e-5, residual=c, backend="reference"), [x, w, r], go)


def test_swiglu_cuda():
    x = torch.randn(1000, 2 * 14336, device="cuda").bfloat16()
    go = [torch.randn(1000, 14336, device="cuda").bfloat16()]
    _check_bf16(lambda a: swiglu(a, backend="triton"), lambda a: swiglu(a, backend="reference"), [x], go)


def test_rope_cuda_packed_positions():
    s, b = 512, 2
    q = torch.randn(s, b, 32, 128, device="cuda").bfloat16()
    k = torch.randn(s, b, 8, 128, device="cuda").bfloat16()
    pos = (torch.arange(s, device="cuda") % 97)[:, None].expand(s, b).contiguous()  # per-document resets
    cos, sin = rope_cos_sin(pos, rope_inv_freq(128, 500000.0).cuda())
    go = [torch.randn_like(q), torch.randn_like(k)]
    _check_bf16(lambda a, c: apply_rope(a, c, cos, sin, backend="triton"),
                lambda a, c: apply_rope(a, c, cos, sin, backend="reference"), [q, k], go)


def test_fused_linear_ce_cuda():
    h = torch.randn(1000, 1024, device="cuda").bfloat16()
    w = (torch.randn(32000, 1024, device="cuda") / 32).bfloat16()
    t = torch.randint(0, 32000, (1000,), device="cuda")
    t[::7] = -100
    g = torch.randn(1000, device="cuda")
    got = _grads(lambda a, b: fused_linear_cross_entropy(a, b, t, label_smoothing=0.1, chunk_size=256), [h, w], [g])
    low = _grads(lambda a, b: linear_cross_entropy_reference(a, b, t, label_smoothing=0.1), [h, w], [g])
    exact = _grads(lambda a, b: linear_cross_entropy_reference(a, b, t, label_smoothing=0.1),
                   [h.double(), w.double()], [g.double()])
    assert_bf16_close(got[0], low[0], exact[0].float(), "loss")
    assert_bf16_close(got[1], low[1], exact[1], "grad_hidden")
    assert_bf16_close(got[2], low[2], exact[2], "grad_weight")


@pytest.mark.skipif(not _native.has_cuda("adamw"), reason="engine._adamw was built without CUDA")
def test_fused_adamw_cuda_matches_cpu_bits_and_torch():
    gen = torch.Generator().manual_seed(0)
    shapes = [(4096, 1000), (37,), (16384 * 3 + 5,)] + [(64,)] * 40  # > one launch of tensors
    cpu = [torch.randn(s, generator=gen) for s in shapes]
    gpu = [p.cuda() for p in cpu]
    ref = [p.cuda().requires_grad_() for p in cpu]
    opt = torch.optim.AdamW(ref, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    state = {dev: ([torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps])
             for dev, ps in (("cpu", cpu), ("cuda", gpu))}
    out = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    for step in range(1, 4):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for r, g in zip(ref, grads):
            r.grad = g.cuda()
        opt.step()
        hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step)
        fused_adamw_(cpu, grads, *state["cpu"], **hyper, backend="native")
        fused_adamw_(gpu, [g.cuda() for g in grads], *state["cuda"], **hyper, backend="native", bf16_out=out)
    for c, g, r, o in zip(cpu, gpu, ref, out):
        # Same per-element code on both sides (IEEE intrinsics on the GPU); FTZ may differ on denormals.
        torch.testing.assert_close(g.cpu(), c, rtol=0, atol=1e-30)
        torch.testing.assert_close(g, r.detach(), rtol=1e-6, atol=3e-7)
        assert torch.equal(o, g.bfloat16())


# csrc/fp8 has two cast kernels with the same bytes: the wide one (rows and columns multiples of 8, aligned
# pointers: 16-byte loads, 8-byte stores, 64x64 tiles) and the narrow one (any shape). The checks run both:
# (4099, 1031) takes the narrow one; (1000, 1032) the wide one, with ragged 64x64 tiles both ways;
# (2048, 4096) the wide one with whole tiles; a (1000, 1032) view 3 elements into its storage the narrow one
# (its pointer is not 16-byte aligned).
CAST_SHAPES = ((4099, 1031), (1000, 1032), (2048, 4096))


def _misaligned_rows(rows: int, cols: int, dtype) -> torch.Tensor:
    """A contiguous (rows, cols) view starting 3 elements into its storage: never 16-byte aligned, so the
    narrow kernel runs even where the shape alone would take the wide one."""
    base = torch.randn(rows * cols + 3, device="cuda").mul_(100).to(dtype)
    return base[3:].view(rows, cols)


@pytest.mark.skipif(not _native.has_cuda("fp8"), reason="engine._fp8 was built without CUDA")
def test_fp8_cast_transpose_cuda_bit_for_bit():
    from engine.ops.fp8_cast_transpose import fp8_cast_transpose, fp8_cast_transpose_reference

    cases = [(d, f, shape) for d in (torch.float32, torch.bfloat16) for f in (torch.float8_e4m3fn, torch.float8_e5m2)
             for shape in CAST_SHAPES + ("misaligned",)]
    for dtype, fmt, shape in cases:
        if shape == "misaligned":
            x = _misaligned_rows(1000, 1032, dtype)
        else:
            x = (torch.randn(*shape, device="cuda") * 100).to(dtype)
        x[0, 0] = 1e9 if fmt == torch.float8_e5m2 else x[0, 0]  # past e5m2's 57344 too
        x[-1, -1] = float("inf") if shape == (1000, 1032) else x[-1, -1]  # the amax from the last (ragged) tile
        scale = torch.tensor([2.5], device="cuda")
        got = fp8_cast_transpose(x, scale, fmt=fmt, backend="native")
        want = fp8_cast_transpose_reference(x, scale, fmt=fmt)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), (dtype, fmt, shape)
        assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8)), (dtype, fmt, shape)
        assert torch.equal(got[2], want[2]), (dtype, fmt, shape)


@pytest.mark.skipif(not _native.has_cuda("fp8"), reason="engine._fp8 was built without CUDA")
def test_fp8_cast_transpose_scaled_cuda_bit_for_bit():
    """Per-tensor current scaling in one launch: the scale derived on the device from the amax
    (IEEE division and reciprocal; fp8 is built without fast math) and 1 / scale, against the CPU reference, for every
    kind of amax (0, inf, NaN, subnormal, negative: tests/engine/ops/test_fp8_cast_transpose.py)."""
    from engine.ops.fp8_cast_transpose import fp8_cast_transpose_scaled, fp8_cast_transpose_scaled_reference

    every_kind = (3.25, 1e-3, 0.0, float("inf"), float("nan"), 1e-40, 1e-38, -2.0, 3e38, 417.1)
    cases = [(d, f, shape) for d in (torch.float32, torch.bfloat16) for f in (torch.float8_e4m3fn, torch.float8_e5m2)
             for shape in CAST_SHAPES]  # the narrow kernel (every kind of amax), then the wide one (a few)
    for dtype, fmt, shape in cases:
        xd = (torch.randn(*shape, device="cuda") * 100).to(dtype)
        for a in (every_kind if shape == CAST_SHAPES[0] else (3.25, float("nan"), 417.1)):
            amax = torch.tensor([a], device="cuda")
            got = fp8_cast_transpose_scaled(xd, amax=amax, fmt=fmt, backend="native")
            want = fp8_cast_transpose_scaled_reference(xd.cpu(), amax=amax.cpu(), fmt=fmt)
            assert torch.equal(got[0].view(torch.uint8).cpu(), want[0].view(torch.uint8)), (dtype, fmt, shape, a)
            assert torch.equal(got[1].view(torch.uint8).cpu(), want[1].view(torch.uint8)), (dtype, fmt, shape, a)
            assert torch.equal(got[2].cpu(), want[2]) and torch.equal(got[3].cpu(), want[3]), (dtype, fmt, shape, a)
        # no amax wanted: the kernel skips its reduction and the launch its memset; the same bytes
        lean = fp8_cast_transpose_scaled(xd, amax=amax, fmt=fmt, want_amax=False, backend="native")
        assert lean[2] is None and all(torch.equal(lean[i].view(torch.uint8), got[i].view(torch.uint8)) for i in (0, 1))
        # folded into a running maximum (a delayed state's pending slot) by the kernel itself: no memset
        pending = torch.tensor([0.0, 1e9, 0.5], device="cuda")
        for i in (0, 1, 2):
            fp8_cast_transpose_scaled(xd, amax=amax, fmt=fmt, want_amax=False, amax_into=pending[i:i + 1],
                                      backend="native")
        assert torch.equal(pending.cpu(), torch.stack([got[2].cpu()[0], torch.tensor(1e9), got[2].cpu()[0]])), shape
        got = fp8_cast_transpose_scaled(xd[:0], amax=torch.tensor([2.0], device="cuda"), fmt=fmt, backend="native")
        assert got[3].item() == fp8_cast_transpose_scaled_reference(xd[:0].cpu(), amax=torch.tensor([2.0]), fmt=fmt)[3]
    from engine.ops.fp8_cast_transpose import fp8_scales_from_amax

    grid = torch.tensor([3.25, 1e-3, 0.0, float("inf"), float("nan"), 1e-40, 1e-38, -2.0, 3e38] * 50).reshape(30, 15)
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        for pow2 in (False, True):  # the MX recipe's power-of-two scales too
            got = fp8_scales_from_amax(grid.cuda(), fmt, pow2=pow2, backend="native")
            want = fp8_scales_from_amax(grid, fmt, pow2=pow2, backend="reference")
            assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]), (fmt, pow2)


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu())


def _same_amax(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    return bool(torch.isnan(a).all() and torch.isnan(b).all()) or torch.equal(a, b)


def check_scaled_cast_given_scale(device: str) -> None:
    """The delayed recipe's real call: ``scale=`` given (not derived from an amax), with the amax returned or
    folded into a running maximum; the casts that skip out_t (a sequence shard's, a gradient's whose weight
    needs none); a positive NaN and -inf in x (the NaN must win in the amax, returned or folded); and
    (1032, 1000), a wide shape whose last 64-row tile leaves its second 32-row pass out of range. Against
    the CPU reference, bit for bit. ``device``: "cuda" on a GPU; "cpu" dry-runs it on the CPU extension."""
    from engine.ops.fp8_cast_transpose import fp8_cast_transpose_scaled, fp8_cast_transpose_scaled_reference

    for dtype in (torch.float32, torch.bfloat16):
        for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
            for shape in ((1032, 1000), (4099, 1031), (1000, 1032)):
                x = (torch.randn(*shape, device=device) * 100).to(dtype)
                for special in (False, True):
                    if special:
                        x[5, 7], x[-1, 0] = float("nan"), float("-inf")
                    scale = torch.tensor([2.5], device=device)
                    case = (dtype, fmt, shape, special)
                    got = fp8_cast_transpose_scaled(x, scale=scale, fmt=fmt, backend="native")
                    want = fp8_cast_transpose_scaled_reference(x.cpu(), scale=scale.cpu(), fmt=fmt)
                    assert _bytes_equal(got[0], want[0]) and _bytes_equal(got[1], want[1]), case
                    assert _same_amax(got[2], want[2]) and torch.equal(got[3].cpu(), want[3]), case
                    assert torch.isnan(got[2].cpu()).all() == special, case
                    lean = fp8_cast_transpose_scaled(x, scale=scale, fmt=fmt, want_out_t=False, want_amax=False,
                                                     backend="native")
                    assert lean[1] is None and lean[2] is None and _bytes_equal(lean[0], got[0]), case
                    pending, ref = torch.tensor([0.5], device=device), torch.tensor([0.5])
                    fp8_cast_transpose_scaled(x, scale=scale, fmt=fmt, want_amax=False, amax_into=pending,
                                              backend="native")
                    fp8_cast_transpose_scaled_reference(x.cpu(), scale=scale.cpu(), fmt=fmt, want_amax=False,
                                                        amax_into=ref)
                    assert _same_amax(pending, ref), case


@pytest.mark.skipif(not _native.has_cuda("fp8"), reason="engine._fp8 was built without CUDA")
def test_fp8_cast_transpose_scaled_cuda_given_scale_nan_and_lean_outputs():
    check_scaled_cast_given_scale("cuda")


@pytest.mark.skipif(not _native.has_cuda("fp8"), reason="engine._fp8 was built without CUDA")
def test_fp8_cast_transpose_scaled_cuda_from_its_own_amax():
    """Neither scale nor amax (tensorwise, unsharded): the native op reduces x's amax on the GPU, then casts;
    the same bits as the CPU's, the amax returned is x's (NaN where x has one), and an empty x gives 0."""
    from engine.ops.fp8_cast_transpose import fp8_cast_transpose_scaled

    for dtype in (torch.float32, torch.bfloat16):
        for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
            for rows, cols in CAST_SHAPES[:2]:
                x = (torch.randn(rows, cols) * 30).to(dtype)
                want = fp8_cast_transpose_scaled(x, fmt=fmt, backend="native")
                got = fp8_cast_transpose_scaled(x.cuda(), fmt=fmt, backend="native")
                for g, w in zip(got, want):
                    assert torch.equal(g.cpu().view(torch.uint8) if g.dtype == fmt else g.cpu(),
                                       w.view(torch.uint8) if w.dtype == fmt else w), (dtype, fmt, rows)
    x = torch.randn(64, 32, device="cuda")
    x[1, 2] = float("nan")
    assert torch.isnan(fp8_cast_transpose_scaled(x, backend="native")[2]).all()
    assert fp8_cast_transpose_scaled(x[:0], backend="native")[2].item() == 0.0


@pytest.mark.skipif(not _native.has_cuda("fp8"), reason="engine._fp8 was built without CUDA")
def test_fp8_cast_transpose_grid_cuda_bit_for_bit():
    """The row-, column-, tile- and block-scaled casts (the row- and block-wise recipes' quantisation)."""
    from engine.ops.fp8_cast_transpose import fp8_cast_transpose_grid, fp8_cast_transpose_grid_reference

    cases = [(d, f, shape) for d in (torch.float32, torch.bfloat16) for f in (torch.float8_e4m3fn, torch.float8_e5m2)
             for shape in CAST_SHAPES[:2]]  # the narrow kernel, then the wide one
    for dtype, fmt, (rows, cols) in cases:
        x = (torch.randn(rows, cols, device="cuda") * 100).to(dtype)
        # per row, per column, 1 x 128 and 128 x 1 tiles, blocks; MX's 1 x 32 and 32 x 1; runs of 12 straddle
        # the wide kernel's 8-element runs (a scale change inside a run)
        for block in ((1, cols), (rows, 1), (1, 128), (128, 1), (128, 128), (1, 32), (32, 1), (1, 12)):
            grid = (-(-rows // block[0]), -(-cols // block[1]))
            scale = torch.rand(grid, device="cuda") * 4
            got = fp8_cast_transpose_grid(x, scale, block, fmt=fmt, backend="native")
            want = fp8_cast_transpose_grid_reference(x, scale, block, fmt=fmt)
            assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), (dtype, fmt, rows, block)
            assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8)), (dtype, fmt, rows, block)
            assert torch.equal(got[2], want[2])
            lean = fp8_cast_transpose_grid(x, scale, block, fmt=fmt, want_amax=False, backend="native")
            assert lean[2] is None and torch.equal(lean[0].view(torch.uint8), got[0].view(torch.uint8))
            # the transpose alone (the row-wise cast of x.T, the 128 x 1 tiles): out not written
            only_t = fp8_cast_transpose_grid(x, scale, block, fmt=fmt, want_out=False, want_amax=False, backend="native")
            assert only_t[0] is None and torch.equal(only_t[1].view(torch.uint8), got[1].view(torch.uint8))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"])
def test_fp8_linear_cuda_matches_the_cpu_path(recipe):
    """fp8_linear on CUDA (cuBLAS / CUTLASS _scaled_mm, torch's sm_90 blockwise kernel where it exists)
    against the same recipe on the CPU: the same fp8 operands (quantisation is elementwise and exact
    to reproduce), so the results differ only by accumulation order and, where CUDA returns bf16
    (row-wise, blockwise), one bf16 rounding: within 1e-2 relative of the output's max."""
    from engine.ops.fp8_linear import DelayedScaling, fp8_linear

    g = torch.Generator().manual_seed(0)
    m, k, n = 512, 768, 1024
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    dy = torch.randn(m, n, generator=g) * 1e-3
    outs = []
    for dev in ("cpu", "cuda"):
        # detach: x.to("cpu") is x itself, so without it the CPU pass would make x require grad and
        # the CUDA copy a non-leaf with no .grad
        xx, ww = x.detach().to(dev).requires_grad_(), w.detach().to(dev).requires_grad_()
        state = DelayedScaling(device=dev) if recipe == "delayed" else None
        # CPU side: the plain-PyTorch GEMMs of the same quantisation (bitwise the CPU _scaled_mm on
        # torch 2.13; torch 2.11's CPU FP8 GEMM took ~25 s here on the GPU machine)
        y = fp8_linear(xx, ww, recipe=recipe, state=state, reference=dev == "cpu")
        y.backward(dy.to(dev))
        outs.append([t.detach().cpu() for t in (y, xx.grad, ww.grad)])
    for name, a, b in zip(("y", "dx", "dw"), *outs):
        rel = ((a - b).abs().max() / b.abs().max()).item()
        assert rel < 1e-2, f"{recipe} {name}: CUDA vs CPU {rel:.2e}"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
def test_fp8_weight_casts_reused_on_cuda_are_bitwise(recipe):
    """model.fp8_weight_cache on CUDA: two micro-batches with the weight's casts made once give the same
    outputs and gradients, bit for bit, as two calls that cast the weight each time (docs/fp8.md)."""
    from engine.ops.fp8_linear import REQUANTISED, WeightCasts, fp8_linear

    g = torch.Generator().manual_seed(1)
    w = (torch.randn(1024, 768, generator=g) * 0.05).cuda()
    xs = [torch.randn(512, 768, generator=g).cuda().to(torch.bfloat16) for _ in range(2)]
    dys = [torch.randn(512, 1024, generator=g).cuda().to(torch.bfloat16) * 1e-3 for _ in range(2)]
    outs = []
    for casts in (None, WeightCasts()):
        ww = w.clone().requires_grad_()
        got = []
        for x, dy in zip(xs, dys):
            xx = x.clone().requires_grad_()
            y = fp8_linear(xx, ww, recipe=recipe, weight_casts=casts)
            y.backward(dy)
            got += [y.detach(), xx.grad]
        outs.append(got + [ww.grad])
        if casts is not None:
            assert casts.made == (2 if recipe in REQUANTISED else 1)  # row/MX: W and W^T quantised apart
    assert all(torch.equal(a, b) for a, b in zip(*outs))
