"""engine/ops/fp8_linear.py: every recipe's forward, input gradient and weight gradient against an fp64
reference within the bound docs/fp8.md derives; tensorwise bit for bit against the plain reference;
delayed scaling's history semantics; the errors for what no backend can run.

The bound, per element of a GEMM ``a @ b.T`` contracting C, with e = u|t| + d the quantisation error
of one element (u = 2**-4 for e4m3, 2**-3 for e5m2: half an ulp of 3 or 2 mantissa bits; d = half
the subnormal spacing times the dequantisation scale, 2**-10 * amax/448 for e4m3 and
2**-17 * amax/57344 for e5m2, taken with the TENSOR's amax, an upper bound for row and block amaxes):

    |err| <= sum_c (e_a |b| + |a| e_b + e_a e_b) + C * 2**-23 * sum_c (|a| + e_a)(|b| + e_b)
"""
from __future__ import annotations

import math

import pytest
import torch

from engine import _native
from tools.bench_fp8 import dispatched_ops

from engine.ops.fp8_linear import (E4M3, E5M2, FP8_MAX, RECIPES, DelayedScaling, amax_to_scale, fp8_linear,
                                   quantize_blocks, quantize_mx, quantize_tiles, update_delayed_states)

U = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
SUB = {E4M3: 2.0 ** -10, E5M2: 2.0 ** -17}
M, K, N = 48, 208, 80   # K, N multiples of 16, not of 128 (ragged tiles); M odd multiple of 16


def _err(t: torch.Tensor, fmt, pow2: bool = False) -> torch.Tensor:
    """Per element: relative rounding U, and the format's subnormal step in the tensor's units. With a
    power-of-two block scale (mxfp8) the scaled block max lies in (fp8_max / 2, fp8_max], so the step is
    up to twice what a scale of exactly fp8_max / amax gives."""
    return U[fmt] * t.abs() + (2 if pow2 else 1) * SUB[fmt] * t.abs().max() / FP8_MAX[fmt]


def _bound(a, fa, b, fb, pow2=False):
    """Elementwise bound for a @ b.T (a (R, C), b (S, C), fp64)."""
    ea, eb = _err(a, fa, pow2), _err(b, fb, pow2)
    c = a.shape[1]
    return (ea @ b.abs().t() + a.abs() @ eb.t() + ea @ eb.t()
            + c * 2.0 ** -23 * (a.abs() + ea) @ (b.abs() + eb).t())


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, K, dtype=torch.float64)
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * 0.05
    dy = torch.randn(M, N, generator=g, dtype=torch.float64) * 1e-3
    return x, w, dy


def _run(recipe, x, w, dy, *, state=None, reference=False, bias=None):
    xx = x.float().clone().requires_grad_()
    ww = w.float().clone().requires_grad_()
    y = fp8_linear(xx, ww, bias, recipe=recipe, state=state, reference=reference)
    y.backward(dy.float())
    return y.detach(), xx.grad, ww.grad


@pytest.mark.parametrize("recipe", RECIPES)
def test_errors_within_the_derived_bound(recipe):
    x, w, dy = _case()
    state = None
    if recipe == "delayed":  # one step to fill the history, so the scales match these tensors
        state = DelayedScaling()
        _run(recipe, x, w, dy, state=state)
        state.update()
        assert int(state.steps) == 1
    y, gx, gw = _run(recipe, x, w, dy, state=state)
    p2 = recipe == "mxfp8"
    checks = {"forward": (y, x @ w.t(), _bound(x, E4M3, w, E4M3, p2)),
              "input grad": (gx, dy @ w, _bound(dy, E5M2, w.t(), E4M3, p2)),
              "weight grad": (gw, dy.t() @ x, _bound(dy.t(), E5M2, x.t(), E4M3, p2))}
    for what, (got, ref, bound) in checks.items():
        err = (got.double() - ref).abs()
        assert bool((err <= bound).all()), f"{recipe} {what}: max err/bound {(err / bound).max():.3f}"
        # and the bound is not vacuous: errors reach a visible fraction of it
        assert (err / bound).max() > 0.05, f"{recipe} {what}: bound is loose ({(err / bound).max():.4f})"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
def test_equals_plain_reference_bitwise(recipe):
    x, w, dy = _case(1)
    bias = torch.randn(N)
    got = _run(recipe, x, w, dy, bias=bias)
    ref = _run(recipe, x, w, dy, bias=bias, reference=True)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposed_quantisation_equals_quantising_the_transpose(dtype):
    """The backward's row and tile scales of x.T, w.T and dy.T come from the untransposed tensor with
    only the fp8 bytes transposed: bit for bit what quantising a transposed copy gives."""
    from engine.ops.fp8_linear import quantize_rowwise
    g = torch.Generator().manual_seed(7)
    for rows, cols in ((48, 208), (37, 300)):  # ragged 128-tiles both ways
        t = (torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, cols)).to(dtype)
        for fmt in (E4M3, E5M2):
            for quantize in (quantize_rowwise, quantize_tiles, quantize_mx):
                a, b = quantize(t.t(), fmt), quantize(t, fmt, transposed=True)
                assert a.data.shape == b.data.shape == (cols, rows) and a.scale_inv.shape == b.scale_inv.shape
                assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
                assert torch.equal(a.scale_inv, b.scale_inv)


def test_blockwise_scale_layouts_for_the_sm90_kernel():
    """What torch's blockwise scaled_mm reads (its test_scaled_matmul_cuda layouts): tile scales (rows,
    K/128) with stride 1 along the rows; block scales' K/128 padded to a multiple of 4 and transposed."""
    from engine.ops.fp8_linear import blockwise_scale_layouts
    x = torch.randn(64, 640)  # K/128 = 5: padded to 8
    w = torch.randn(256, 640)
    sa, sb = blockwise_scale_layouts(quantize_tiles(x, E4M3), quantize_blocks(w, E4M3))
    assert sa.shape == (64, 5) and sa.stride() == (1, 64)
    assert torch.equal(sa, quantize_tiles(x, E4M3).scale_inv)
    assert sb.shape == (8, 2) and sb.stride() == (1, 8)
    assert torch.equal(sb[:5], quantize_blocks(w, E4M3).scale_inv.t()) and bool((sb[5:] == 0).all())
    sa2, sb2 = blockwise_scale_layouts(quantize_tiles(x, E4M3), quantize_tiles(w, E4M3))
    assert sb2.shape == (256, 5) and sb2.stride() == (1, 256)


def test_native_blockwise_tries_each_scale_layout_and_checks_it(monkeypatch):
    """The blockwise kernel is tried per pair of granularities in each scale layout until one is taken and
    computes what the per-slice loop does (checked once per pair); a pair that no layout serves is switched
    off with every layout's failure recorded. CPU stand-ins for torch's CUDA kernel."""
    import engine.ops.fp8_linear as f8

    monkeypatch.setattr(f8, "GEMM_PATHS", {})
    g = torch.Generator().manual_seed(0)
    a = quantize_tiles(torch.randn(32, 256, generator=g), E4M3)
    b = quantize_tiles(torch.randn(48, 256, generator=g), E4M3)
    want = f8._blockwise_loop(a, b)
    layouts = {"as laid out": torch.zeros(1), "scale_b transposed": torch.ones(1)}
    calls = []

    def takes_the_second(a_, b_, sa, sb):  # refuses the first layout, computes right with the second
        calls.append(float(sb.flatten()[0]))
        if sb.flatten()[0] == 0:
            raise RuntimeError("Invalid scaling configuration.")
        return want.bfloat16()

    key = "blockwise_native[1x128 x 1x128]"
    # one row of scales cannot tell a layout from its transpose: checked, but not kept
    out = f8._first_native_layout(a, b, key, torch.ones(1, 2), layouts, takes_the_second)
    assert torch.equal(out, want.bfloat16().float()) and key not in f8.GEMM_PATHS and calls == [0.0, 1.0]
    calls.clear()
    layouts = {"as laid out": torch.zeros(2, 2), "scale_b transposed": torch.ones(2, 2)}
    out = f8._first_native_layout(a, b, key, torch.ones(2, 2), layouts, takes_the_second)
    assert torch.equal(out, want.bfloat16().float()) and f8.GEMM_PATHS[key] == "scale_b transposed"
    assert calls == [0.0, 1.0]
    # later calls go straight to the layout found (the kernel sees only it) and are not checked again
    f8._first_native_layout(a, b, key, torch.ones(2, 2), {"scale_b transposed": torch.ones(2, 2)}, takes_the_second)
    assert calls == [0.0, 1.0, 1.0]

    def wrong(a_, b_, sa, sb):  # taken, but computes something else: never used
        return (2 * want).bfloat16()

    key2 = "blockwise_native[1x128 x 128x128]"
    assert f8._first_native_layout(a, b, key2, torch.ones(2, 2), layouts, wrong) is None
    assert f8.GEMM_PATHS[key2] == "off"
    err = f8.GEMM_PATHS["blockwise_native_error[1x128 x 128x128]"]
    assert err.count("differs from the per-slice loop") == 2 and "as laid out" in err and "transposed" in err


def test_rowwise_fallback_where_cpu_scaled_mm_lacks_row_scales(monkeypatch):
    """torch 2.11's CPU _scaled_mm takes per-tensor scales only: the dequantised fp32 matmul that
    replaces it there gives the row-wise _scaled_mm's results bit for bit (this torch has both)."""
    import engine.ops.fp8_linear as f8
    x, w, dy = _case(6)
    native = _run("rowwise", x, w, dy)
    assert f8.GEMM_PATHS["rowwise"] == "_scaled_mm"
    monkeypatch.setattr(f8, "_cpu_has_rowwise_scaled_mm", lambda: False)
    fallback = _run("rowwise", x, w, dy)
    assert f8.GEMM_PATHS["rowwise"].startswith("dequantised")
    for a, b in zip(native, fallback):
        assert torch.equal(a, b)


def test_tensorwise_matches_a_from_scratch_reference():
    """The tensorwise recipe as four lines of plain PyTorch: same quantisation, fp32 matmuls."""
    x, w, dy = _case(2)
    y, gx, gw = _run("tensorwise", x, w, dy)
    xf, wf, gf = x.float(), w.float(), dy.float()

    def q(t, fmt):
        s = FP8_MAX[fmt] / t.abs().max()
        return (t * s).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(fmt).float() * (1.0 / s)
    assert torch.equal(y, q(xf, E4M3) @ q(wf, E4M3).t())
    assert torch.equal(gx, q(gf, E5M2) @ q(wf, E4M3))
    assert torch.equal(gw, q(gf, E5M2).t() @ q(xf, E4M3))


def test_odd_token_count_is_padded_for_the_weight_gradient():
    x, w, dy = _case(3)
    x, dy = x[:37], dy[:37]
    for recipe in RECIPES:
        st = DelayedScaling() if recipe == "delayed" else None
        _, gx, gw = _run(recipe, x, w, dy, state=st)
        assert gx.shape == (37, K) and gw.shape == (N, K)
        err = (gw.double() - dy.t() @ x).abs()
        assert bool((err <= _bound(dy.t(), E5M2, x.t(), E4M3)).all())


def test_bf16_input_and_leading_dims():
    x, w, _ = _case(4)
    x3 = x.reshape(4, 12, K).to(torch.bfloat16).requires_grad_()
    ww = w.float().requires_grad_()
    y = fp8_linear(x3, ww, recipe="rowwise")
    assert y.shape == (4, 12, N) and y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x3.grad.dtype == torch.bfloat16 and ww.grad.dtype == torch.float32


def test_delayed_history_margin_and_first_step():
    st = DelayedScaling(history_len=3, margin=1)
    x, w, dy = _case(5)
    # before any update the call scales by its current amax (no saturation)
    y0, _, _ = _run("delayed", x, w, dy, state=st)
    y_tw, _, _ = _run("tensorwise", x, w, dy)
    assert torch.equal(y0, y_tw)
    assert torch.equal(st.pending, torch.stack([x.abs().max(), w.abs().max(), dy.abs().max()]).float())
    st.update()
    expect = torch.tensor([448.0, 448.0, 57344.0]) / st.amax_history[:, 0] / 2
    torch.testing.assert_close(st.scale, expect, rtol=1e-6, atol=0)
    assert torch.equal(st.pending, torch.zeros(3))
    # a 10x smaller step does not lower the scale while the big amax is in the 3-step window
    for _ in range(2):
        _run("delayed", x / 10, w, dy, state=st)
        st.update()
    assert st.scale[0] == expect[0]
    _run("delayed", x / 10, w, dy, state=st)
    st.update()  # the big amax has left the window
    torch.testing.assert_close(st.scale[0], 448.0 / (x.abs().max().float() / 10) / 2, rtol=1e-6, atol=0)
    # evaluation (no grad) records nothing
    with torch.no_grad():
        fp8_linear(x.float(), w.float(), recipe="delayed", state=st)
    assert torch.equal(st.pending, torch.zeros(3))


def test_update_many_states_with_one_reduction():
    states = [DelayedScaling(), DelayedScaling()]
    states[0].pending.copy_(torch.tensor([1.0, 2.0, 3.0]))
    states[1].pending.copy_(torch.tensor([4.0, 0.0, 6.0]))
    calls = []

    def reduce(t):
        calls.append(t.shape)
        return t * 2
    update_delayed_states(states, reduce)
    assert calls == [(6,)]
    assert states[1].amax_history[:, 0].tolist() == [8.0, 0.0, 12.0]
    assert states[1].scale[1] == 1.0  # no amax recorded: the scale is kept


def _te_update(history: list[list[float]], scale: list[float], amax: list[float], *, margin: int, algo: str):
    """One state's delayed-scaling step written out per role in plain Python floats (Transformer Engine's
    semantics): a role with a positive finite amax pushes it (newest first, the oldest drops) and takes
    fp8_max / ref / 2**margin (ref: the history's max, or its newest entry), clamped to the largest fp32;
    any other role keeps its history and scale."""
    fmax = (448.0, 448.0, 57344.0)
    for i, a in enumerate(amax):
        if not (a > 0 and math.isfinite(a)):
            continue
        history[i] = [a] + history[i][:-1]
        ref = max(history[i]) if algo == "max" else history[i][0]
        new = torch.tensor(fmax[i], dtype=torch.float32) / torch.tensor(ref, dtype=torch.float32)  # fp32 rounding
        scale[i] = min(new.item(), torch.finfo(torch.float32).max) / 2.0 ** margin


def test_batched_update_equals_te_semantics_per_state():
    """update_delayed_states computes every state's step in one batch (a fixed number of launches per
    optimizer step): the histories and scales equal the per-state step written out independently
    (_te_update), with histories of different lengths, margins and algos (grouped), skipped roles (0, NaN,
    inf) and a few steps; .update() of one state is the same batch of one."""
    gen = torch.Generator().manual_seed(3)
    configs = [dict(history_len=4), dict(history_len=4, margin=1), dict(history_len=2, algo="most_recent"),
               dict(history_len=4)]
    states = [DelayedScaling(**c) for c in configs]
    one = DelayedScaling(history_len=3, margin=2)
    ref = [([[0.0] * s.history_len for _ in range(3)], [1.0, 1.0, 1.0]) for s in states + [one]]
    for step in range(6):
        amax = torch.rand(len(states) + 1, 3, generator=gen) * 10 ** step
        amax[step % 4, step % 3] = (0.0, float("nan"), float("inf"))[step % 3]
        for s, a in zip(states + [one], amax):
            s.pending.copy_(a)
        update_delayed_states(states)
        one.update()
        for s, (hist, scale), a in zip(states + [one], ref, amax):
            _te_update(hist, scale, a.tolist(), margin=s.margin, algo=s.algo)
            assert s.amax_history.tolist() == hist and s.scale.tolist() == scale, (step, s.history_len)
            assert torch.equal(s.pending, torch.zeros(3)) and s.steps.item() == step + 1


@pytest.mark.skipif(not _native.available("fp8"), reason="engine._fp8 not built: the reference casts are plain PyTorch ops")
def test_per_tensor_linear_launches_no_scale_arithmetic():
    """Host cost: a tensorwise fp8_linear forward + backward issues 3 amax reductions, 3 native casts (each
    deriving its scale and 1 / scale itself), 3 FP8 GEMMs and the two gradient accumulations, nothing else.
    On a GPU each is a launch the host must issue: docs/fp8.md measured the 8B layer's FP8 calls at 1.6x
    their device time when the scale arithmetic was 45 more ops.
    Delayed scaling reads its scales from the state: no amax reductions; the casts of x and dy fold their
    amaxes into the state's pending maxima themselves, the weight's (which a cache may hand to several
    calls) is folded by 1 running maximum."""
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    dy = torch.randn(32, 48, dtype=torch.bfloat16)
    fp8_linear(x, w).backward(dy)  # warm (grads exist: accumulation)
    assert dispatched_ops(lambda: fp8_linear(x, w).backward(dy)) == {
        "linalg_vector_norm": 3, "engine._fp8.cast_transpose_scaled": 3, "_scaled_mm": 3, "add_": 2}
    st = DelayedScaling()
    fp8_linear(x, w, recipe="delayed", state=st).backward(dy)
    st.update()
    assert dispatched_ops(lambda: fp8_linear(x, w, recipe="delayed", state=st).backward(dy)) == {
        "engine._fp8.cast_transpose_scaled": 3, "maximum": 1, "_scaled_mm": 3, "add_": 2}


def test_casts_compute_an_amax_only_where_delayed_scaling_keeps_it(monkeypatch):
    """An amax the cast computes is kept only by a delayed state while recording: elsewhere the casts skip
    it (want_amax=False: no reduction in the kernel and, on a GPU, no memset launch). The delayed weight
    cast keeps its amax even in evaluation, since a cast cached there may serve a training call. The grid
    casts (row, tile, block, MX) derive their scales from their own amaxes and never want one."""
    import engine.ops.fp8_linear as fl

    seen = {"scaled": [], "grid": []}  # per cast: want_amax, or "into" where it folds into the state's pending
    for name, key in (("fp8_cast_transpose_scaled", "scaled"), ("fp8_cast_transpose_grid", "grid")):
        real = getattr(fl, name)
        monkeypatch.setattr(fl, name, lambda *a, _real=real, _key=key, **kw: (
            seen[_key].append("into" if kw.get("amax_into") is not None else kw["want_amax"]), _real(*a, **kw))[1])
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    dy = torch.randn(32, 48)
    fp8_linear(x, w).backward(dy)
    assert seen["scaled"] == [False, False, False]  # x, w, dy
    seen["scaled"].clear()
    st = DelayedScaling()
    fp8_linear(x, w, recipe="delayed", state=st).backward(dy)
    # x's and dy's casts fold their amaxes into the pending maxima themselves; the weight's comes back (a
    # cache may hand the cast to later calls, each recording it)
    assert seen["scaled"] == ["into", True, "into"]
    want = torch.stack([t.detach().abs().max() for t in (x, w, dy)])
    assert torch.equal(st.pending, want)
    seen["scaled"].clear()
    with torch.no_grad():
        fp8_linear(x, w, recipe="delayed", state=st)
    assert seen["scaled"] == [False, True]  # evaluation: x's amax is not recorded, the weight's is kept
    for recipe in ("rowwise", "blockwise", "mxfp8"):
        fp8_linear(x, w, recipe=recipe).backward(dy)
    assert seen["grid"] and not any(seen["grid"])


def test_weight_casts_shared_across_recipes_is_refused():
    """A WeightCasts filled by a tensorwise call holds no weight amax; a delayed call handed it is refused
    with the fix, instead of failing inside the state's record."""
    from engine.ops.fp8_linear import WeightCasts

    x, w = torch.randn(16, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    casts = WeightCasts()
    fp8_linear(x, w, weight_casts=casts)
    with pytest.raises(RuntimeError, match="needs its own WeightCasts"):
        fp8_linear(x, w, recipe="delayed", state=DelayedScaling(), weight_casts=casts)


def test_nonfinite_amax_is_not_pushed():
    st = DelayedScaling(history_len=3)
    for a in (10.0, 2.0, 3.0):
        st.pending.fill_(a)
        st.update()
    before_hist, before_scale = st.amax_history.clone(), st.scale.clone()
    st.pending.copy_(torch.tensor([float("inf"), float("nan"), 4.0]))
    st.update()
    assert torch.equal(st.amax_history[:2], before_hist[:2]) and torch.equal(st.scale[:2], before_scale[:2])
    assert st.amax_history[2].tolist() == [4.0, 3.0, 2.0]  # the finite role rolls (10 leaves the window)


def test_tiny_amax_gives_a_finite_scale():
    x = torch.zeros(16, 32)
    x[0, 0] = 1e-38
    w = torch.randn(16, 32)
    for recipe in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
        xx = x.clone().requires_grad_()
        y = fp8_linear(xx, w, recipe=recipe)
        y.backward(torch.full_like(y, 1e-37))
        assert torch.isfinite(y).all() and torch.isfinite(xx.grad).all(), recipe


def test_mx_blocks_have_power_of_two_scales_and_never_saturate():
    """mxfp8: 1 x 32 blocks along the columns (a ragged last block too), each scale a power of two, the
    smallest that keeps the block's max within the format: the scaled max lies in (fp8_max / 2, fp8_max]
    and nothing clips; an all-zero block scales by 1; an exact power-of-two ratio is not rounded up."""
    g = torch.Generator().manual_seed(5)
    t = torch.randn(6, 80, generator=g) * torch.logspace(-6, 6, 80)  # 3 blocks: 32, 32, 16 columns
    t[1, 32:64] = 0.0
    t[2, :32] = 0.0
    t[2, 5] = 448.0 * 2.0 ** -10  # ratio exactly 2**-10
    for fmt in (E4M3, E5M2):
        q = quantize_mx(t, fmt)
        assert q.granularity == "mx" and q.scale_inv.shape == (6, 3)
        mant, _ = torch.frexp(q.scale_inv)
        assert bool((mant == 0.5).all())  # powers of two
        assert q.scale_inv[1, 1] == 1.0 and q.scale_inv[2, 0] == 2.0 ** -10 * 448.0 / FP8_MAX[fmt]  # 2**-10, 2**-17
        vals = q.data.float()
        for b, (lo, hi) in enumerate(((0, 32), (32, 64), (64, 80))):
            blk = vals[:, lo:hi].abs().amax(1)
            nonzero = t[:, lo:hi].abs().amax(1) > 0
            assert bool((blk[nonzero] > FP8_MAX[fmt] / 2).all() and (blk <= FP8_MAX[fmt]).all()), (fmt, b)
        rel = ((q.dequantize() - t).abs() / t.abs().clamp(min=1e-30))[t.abs() > t.abs().max() * 1e-3]
        assert rel.max() <= (2.0 ** -4 if fmt == E4M3 else 2.0 ** -3)


def test_blockwise_tiles_and_blocks_have_their_own_scales():
    t = torch.zeros(130, 260)
    t[0, 0], t[129, 259], t[5, 200] = 3.0, 7.0, 0.5
    tiles, blocks = quantize_tiles(t, E4M3), quantize_blocks(t, E4M3)
    assert tiles.scale_inv.shape == (130, 3) and blocks.scale_inv.shape == (2, 3)
    assert tiles.scale_inv[5, 1] == amax_to_scale(torch.tensor(0.5), E4M3).reciprocal()
    assert blocks.scale_inv[1, 2] == 7.0 / 448.0
    for q in (tiles, blocks):  # each nonzero is its tile's amax: exact up to the scale's rounding
        torch.testing.assert_close(q.dequantize(), t, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad, match", [
    (dict(k=40), r"K and N multiples of 16.*in_features \(K\)=40"),
    (dict(n=24), r"out_features \(N\)=24"),
    (dict(recipe="mxfp4"), r"recipe='mxfp4' is not one of"),
    (dict(wdtype=torch.float16, recipe="blockwise"), r"weight dtype torch.float16 is not supported by the blockwise"),
    (dict(recipe="delayed"), r"needs state=DelayedScaling"),
    (dict(state=True), r"state is only used by recipe='delayed'"),
])
def test_bad_input_names_the_fix(bad, match):
    k, n = bad.get("k", 32), bad.get("n", 32)
    x = torch.randn(16, k)
    w = torch.randn(n, k, dtype=bad.get("wdtype", torch.float32))
    state = DelayedScaling() if bad.get("state") else None
    with pytest.raises(ValueError, match=match):
        fp8_linear(x, w, recipe=bad.get("recipe", "tensorwise"), state=state)


def _shards(size: int):
    """A SequenceShards over ``size`` simulated ranks that all hold the same rows (gather: repeat; reduce-scatter:
    the first block times size), enough to check fp8_linear's shapes and refusals in one process."""
    from engine.ops.fp8_linear import SequenceShards

    return SequenceShards(size=size, amax_max=lambda a: a.clone(), all_gather=lambda t: t.repeat(size, 1),
                          reduce_scatter=lambda t: t[: t.shape[0] // size] * size)


def test_sequence_shards_with_one_rank_equal_the_plain_linear():
    """size 1: the cast-then-gather input and the gather-then-cast output gradient are the plain path's, bitwise."""
    torch.manual_seed(0)
    x, w, dy = torch.randn(16, 2, 32), torch.randn(48, 32), torch.randn(16, 2, 48)
    outs = []
    for kw in ({}, {"sequence_gather": _shards(1)}, {"sequence_scatter": _shards(1)}):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xi, wi, **kw)
        y.backward(dy)
        outs.append((y.detach(), xi.grad, wi.grad))
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0]))


@pytest.mark.parametrize("kw, match", [
    (dict(recipe="rowwise", sequence_gather=2), "scales rows or tiles"),
    (dict(sequence_scatter=3), "sequence length divisible"),
    (dict(sequence_gather=2, sequence_scatter=2), "do not go together"),
    (dict(sequence_scatter=2, bias=True), "add the bias after the reduce-scatter"),
])
def test_sequence_shards_bad_input(kw, match):
    kw = {k: _shards(v) if k.startswith("sequence_") else v for k, v in kw.items()}
    bias = torch.zeros(32) if kw.pop("bias", False) else None
    with pytest.raises(ValueError, match=match):
        fp8_linear(torch.randn(16, 32), torch.randn(32, 32), bias, **kw)


def test_sequence_gather_takes_any_shard_length():
    """The gathered input is this rank's shard: any number of rows (here 5 per rank of 4: a sequence of 20),
    and the result has every rank's rows."""
    x = torch.randn(5, 2, 32)
    y = fp8_linear(x, torch.randn(16, 32), sequence_gather=_shards(4))
    assert y.shape == (20, 2, 16)


def test_delayed_slots_follow_their_buffers():
    """DelayedScaling.slot: a role's (1,) view of scale / pending, made once; writes in place (an update, a
    checkpoint load) show through it, and a buffer replaced (a move, load with assign, a deep copy) is
    sliced afresh, so a call never reads or folds into a stale tensor."""
    import copy

    st = DelayedScaling()
    v = st.slot("scale", "weight")
    assert st.slot("scale", "weight") is v
    st.scale.copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert v.item() == 2.0
    st.load_state_dict({**st.state_dict(), "scale": torch.tensor([4.0, 5.0, 6.0])})
    assert st.slot("scale", "weight").item() == 5.0
    st.load_state_dict({**st.state_dict(), "scale": torch.tensor([7.0, 8.0, 9.0])}, assign=True)
    assert st.slot("scale", "grad_output").item() == 9.0
    twin = copy.deepcopy(st)
    twin.slot("pending", "input").fill_(3.0)
    assert twin.pending[0].item() == 3.0 and st.pending[0].item() == 0.0
    st.double()
    assert st.slot("scale", "input").dtype == torch.float64 and st.slot("scale", "input").item() == 7.0
