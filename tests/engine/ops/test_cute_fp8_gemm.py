"""engine.ops.cute_fp8_gemm: reference vs fp64, argument errors, the sm_90a compile on CPU, the GPU run."""
from __future__ import annotations

import sys

import pytest
import torch

from engine.ops import cute_fp8_gemm as mod
from engine.ops.cute_fp8_gemm import INSTALL_HINT, compile_fp8_gemm, fp8_gemm, fp8_gemm_reference
from tests.engine.ops.helpers import assert_bf16_close

E4M3 = torch.float8_e4m3fn


def _operands(m, n, k, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (3 * torch.randn(m, k, generator=g)).to(E4M3)
    b = (3 * torch.randn(n, k, generator=g)).to(E4M3)
    scale_a, scale_b = torch.tensor([0.0371]), torch.tensor([1.9])
    return [t.to(device) for t in (a, b, scale_a, scale_b)]


def _fp64(a, b, scale_a, scale_b):
    return (a.double() @ b.double().t()) * (scale_a.double() * scale_b.double())  # (M, N)


@pytest.mark.parametrize("m,n,k", [(1, 8, 16), (37, 24, 272), (128, 256, 512)])
def test_reference_matches_fp64(m, n, k):
    a, b, sa, sb = _operands(m, n, k)
    out = fp8_gemm_reference(a, b, sa, sb)
    exact = _fp64(a, b, sa, sb)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # fp32 sums of exact fp8 products, then one bf16 rounding: within half a bf16 ulp (+ fp32 slack).
    assert ((out.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-30).all()
    assert (out == exact.to(torch.bfloat16)).float().mean() > 0.99  # and almost always bit-equal


def test_auto_on_cpu_is_reference_and_matches_scaled_mm():
    a, b, sa, sb = _operands(64, 48, 96)
    out = fp8_gemm(a, b, sa, sb)  # auto -> reference on CPU
    assert torch.equal(out, fp8_gemm_reference(a, b, sa, sb))
    # The FP8 recipe's call: mat2 column-major, i.e. the (N, K) weight transposed as a view.
    scaled = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    assert_bf16_close(out, scaled, _fp64(a, b, sa, sb), "fp8_gemm vs torch._scaled_mm")


def test_empty_m():
    a, b, sa, sb = _operands(0, 16, 32)
    assert fp8_gemm(a, b, sa, sb).shape == (0, 16)


@pytest.mark.parametrize("case,match", [
    ("a_bf16", "a must be a 2-D torch.float8_e4m3fn"),
    ("b_3d", "b must be a 2-D torch.float8_e4m3fn"),
    ("k_mismatch", "same K"),
    ("k_not_16", "multiple of 16"),
    ("n_not_8", "multiple of 8"),
    ("b_transposed", "must be contiguous"),
    ("scale_fp16", "scale_a must be a one-element float32"),
    ("scale_two", "scale_b must be a one-element float32"),
    ("backend", "backend='triton' is not one of"),
    ("cute_on_cpu", "needs CUDA tensors on an sm_90"),
])
def test_bad_inputs_raise(case, match):
    a, b, sa, sb = _operands(32, 32, 64)
    kwargs = {}
    if case == "a_bf16":
        a = a.to(torch.bfloat16)
    elif case == "b_3d":
        b = b.reshape(1, 32, 64)
    elif case == "k_mismatch":
        b = b[:, :48].contiguous()
    elif case == "k_not_16":
        a, b = a[:, :40].contiguous(), b[:, :40].contiguous()
    elif case == "n_not_8":
        b = b[:30].contiguous()
    elif case == "b_transposed":
        b = _operands(64, 8, 32)[0].t()  # (32, 64) view of a (64, 32) tensor: K not fastest
    elif case == "scale_fp16":
        sa = sa.half()
    elif case == "scale_two":
        sb = torch.ones(2)
    elif case == "backend":
        kwargs["backend"] = "triton"
    elif case == "cute_on_cpu":
        kwargs["backend"] = "cute"
    with pytest.raises(ValueError, match=match):
        fp8_gemm(a, b, sa, sb, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"arch": "sm_80"}, "only on sm_90a"),
    ({"tile_m": 96}, "tile_m in"),
    ({"tile_n": 264}, "tile_n a multiple of 16"),
    ({"tile_n": 256, "stages": 5}, "shared memory"),
])
def test_bad_compile_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compile_fp8_gemm(**kwargs)


def test_missing_dsl_message(monkeypatch):
    # Simulate an environment without nvidia-cutlass-dsl: the kernel module cannot be imported.
    import engine.ops
    monkeypatch.delattr(engine.ops, "_cute_fp8_gemm_kernel", raising=False)
    monkeypatch.setitem(sys.modules, "engine.ops._cute_fp8_gemm_kernel", None)
    assert not mod.cute_available()
    with pytest.raises(ImportError, match=INSTALL_HINT.replace(".", r"\.")):
        mod._kernel_module()


@pytest.mark.parametrize("tile_n", [128, 256])
def test_compiles_to_sm90a_wgmma_and_tma_on_cpu(monkeypatch, tile_n):
    pytest.importorskip("cutlass.cute", reason=f"nvidia-cutlass-dsl not installed ({INSTALL_HINT})")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    compiled = compile_fp8_gemm(tile_n=tile_n)
    ptx, cubin = compiled.__ptx__, compiled.__cubin__
    assert ".target sm_90a" in ptx
    assert ".reqntid 256, 1, 1" in ptx  # two warpgroups for the 128-row tile
    # Each warpgroup issues one m64 x tile_n x k32 e4m3 wgmma per 32 of the 128-wide k-tile.
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{tile_n}k32.f32.e4m3.e4m3") == 128 // 32
    assert "wgmma.fence.sync.aligned" in ptx and "wgmma.wait_group.sync.aligned" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes" in ptx  # TMA loads
    assert "mbarrier.try_wait.parity.shared" in ptx
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
    assert int.from_bytes(cubin[18:20], "little") == 190  # e_machine EM_CUDA
    assert compile_fp8_gemm(tile_n=tile_n) is compiled  # cached


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 8, 16), (1000, 1032, 272), (2048, 4096, 4096)])
def test_cute_kernel_on_hopper(m, n, k):
    pytest.importorskip("cutlass.cute", reason=f"nvidia-cutlass-dsl not installed ({INSTALL_HINT})")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kernel needs an sm_90 GPU")
    a, b, sa, sb = _operands(m, n, k, device="cuda")
    out = fp8_gemm(a, b, sa, sb, backend="cute")
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    exact = _fp64(a, b, sa, sb)
    # Bound: half a bf16 ulp of the result, plus 2**-12 of sum_k |a||b| * scale for the wgmma's
    # reduced-precision fp8 accumulation over all of K (no promotion to a separate fp32 sum).
    abs_sum = (a.double().abs() @ b.double().abs().t()) * (sa.double() * sb.double())  # (M, N)
    err = (out.double() - exact).abs()
    bound = exact.abs() * 2.0 ** -8 + abs_sum * 2.0 ** -12
    worst = (err - bound).max().item()
    assert worst <= 0, f"cute {m}x{n}x{k}: error exceeds its bound by {worst:.3e} (max err {err.max().item():.3e})"
    # Partial tiles (M, N not multiples of 128, K not of 128) are where a wrong predicate would show:
    # rows/columns the kernel failed to store would hold torch.empty garbage, not ~exact values.
    assert torch.isfinite(out.float()).all()
