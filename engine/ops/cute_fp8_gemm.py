"""FP8 (e4m3) GEMM with per-tensor scales: a CuTe DSL kernel for Hopper (sm_90a), optional.

    d = bf16( (a.float() @ b.float().T) * scale_a * scale_b )

``a``: (M, K) float8_e4m3fn, ``b``: (N, K) float8_e4m3fn, both contiguous (K fastest; ``b`` is laid
out like a Linear weight (out_features, in_features)). ``scale_a``/``scale_b``: one-element float32
tensors on the same device, the *dequantisation* scales (amax / 448 style), read on the device. The
result is (M, N) bfloat16, accumulated in fp32. This is what FP8 recipes get from
``torch._scaled_mm(a, b.t(), scale_a, scale_b, out_dtype=torch.bfloat16)``.

Requirements (checked with ValueErrors on every backend, so code that runs on CPU also runs on the
kernel): K % 16 == 0 and K > 0 (the TMA descriptor needs 16-byte aligned rows), N % 8 == 0 (16-byte
aligned output rows). The kernel path also needs 16-byte aligned base addresses (fresh allocations
are; offset views may not be).

Backends: "cute" is the kernel in engine/ops/_cute_fp8_gemm_kernel.py (TMA loads into a multi-stage
shared-memory ring, wgmma m64nNk32 e4m3 from shared memory, fp32 accumulators; see its docstring).
It needs CUDA tensors on an sm_90 GPU and ``pip install nvidia-cutlass-dsl==4.8.1`` (an optional
extra; torch is not pulled). "reference" is plain PyTorch and runs anywhere. "auto" picks "cute"
when all of that is available, else "reference".

Status: the kernel compiles to PTX/cubin for sm_90a on a CPU-only machine (tests check the wgmma
and TMA instructions in it), but has NOT been run on a GPU yet: its numbers and its speed against
cuBLAS (torch._scaled_mm) are unverified. It is not warp-specialised, not persistent and stores its
epilogue from registers, so it is not expected to beat cuBLAS until measured and tuned. It
accumulates all of K in the wgmma accumulator (cuBLAS "fast accumulation"; Hopper FP8 tensor cores
accumulate with fewer bits than fp32), so long-K results are less exact than the fp32 reference.
"""
from __future__ import annotations

import functools
import shutil
import tempfile
from typing import Any

import torch
from torch import Tensor

_OP = "fp8_gemm"
_BACKENDS = ("auto", "cute", "reference")
INSTALL_HINT = "pip install nvidia-cutlass-dsl==4.8.1"


def fp8_gemm_reference(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor) -> Tensor:
    """Plain-PyTorch :func:`fp8_gemm` (fp32 products and sums, one rounding to bf16 at the end)."""
    # e4m3 values and their pairwise products are exact in fp32; only the K-sum rounds.
    acc = a.float() @ b.float().t()  # (M, N)
    return (acc * (scale_a.float() * scale_b.float())).to(torch.bfloat16)


def _check(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Tensor) or t.dim() != 2 or t.dtype != torch.float8_e4m3fn:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{_OP}: {name} must be a 2-D torch.float8_e4m3fn tensor, got {got}; "
                             f"quantise with (x * scale).to(torch.float8_e4m3fn).")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{_OP}: a is (M, K) = {tuple(a.shape)} and b must be (N, K) with the same K, got "
                         f"{tuple(b.shape)}; pass the weight as (out_features, in_features), not transposed.")
    n, k = b.shape
    if k == 0 or k % 16:
        raise ValueError(f"{_OP}: K = {k} must be a positive multiple of 16 (TMA needs 16-byte aligned "
                         f"rows of fp8); pad K with zeros.")
    if n % 8:
        raise ValueError(f"{_OP}: N = {n} must be a multiple of 8 (16-byte aligned bf16 output rows); "
                         f"pad N.")
    for name, t in (("a", a), ("b", b)):
        if not t.is_contiguous():
            raise ValueError(f"{_OP}: {name} must be contiguous (K fastest), got strides {t.stride()}; "
                             f"call .contiguous() (for b: keep the weight as (N, K), do not pass w.t()).")
        if t.device != a.device:
            raise ValueError(f"{_OP}: a is on {a.device} but {name} is on {t.device}; move both to one device.")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(s, Tensor) or s.dtype != torch.float32 or s.numel() != 1 or s.device != a.device:
            got = f"{s.dtype} with {s.numel()} elements on {s.device}" if isinstance(s, Tensor) else type(s).__name__
            raise ValueError(f"{_OP}: {name} must be a one-element float32 tensor on {a.device} (per-tensor "
                             f"dequantisation scale), got {got}.")


def _kernel_module() -> Any:
    """The one guarded import of nvidia-cutlass-dsl (cutlass/cute) in Tessel's FP8 GEMM."""
    try:
        from engine.ops import _cute_fp8_gemm_kernel
    except ImportError as exc:  # cutlass, cutlass.cute or cuda.bindings missing
        raise ImportError(f"{_OP}: the CuTe DSL kernel needs nvidia-cutlass-dsl: `{INSTALL_HINT}` "
                          f"(optional; backend='reference' works without it). Import failed with: {exc}") from exc
    return _cute_fp8_gemm_kernel


def cute_available() -> bool:
    """True when nvidia-cutlass-dsl imports (compiling works on CPU; running needs an sm_90 GPU)."""
    try:
        _kernel_module()
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def compile_fp8_gemm(*, tile_m: int = 128, tile_n: int = 128, tile_k: int = 128, stages: int = 4,
                     arch: str = "sm_90a") -> Any:
    """Compile the kernel for one tile configuration (cached); M, N and K stay runtime arguments.

    Needs no GPU: the returned object carries ``__ptx__`` (str) and ``__cubin__`` (bytes) for ``arch``.
    Calling it (see :func:`fp8_gemm`) needs a CUDA device of that architecture.
    """
    if arch != "sm_90a":
        raise ValueError(f"{_OP}: arch={arch!r}: the kernel uses wgmma and TMA, which exist only on sm_90a.")
    if tile_m not in (64, 128) or tile_k not in (64, 128) or tile_n % 16 or not 16 <= tile_n <= 256:
        raise ValueError(f"{_OP}: tile (tile_m={tile_m}, tile_n={tile_n}, tile_k={tile_k}) must have tile_m in "
                         f"(64, 128) (one warpgroup per 64 rows), tile_n a multiple of 16 in [16, 256] and "
                         f"tile_k in (64, 128).")
    smem = stages * (tile_m + tile_n) * tile_k
    if stages < 2 or smem > 200 * 1024:
        raise ValueError(f"{_OP}: stages={stages} with tile ({tile_m}, {tile_n}, {tile_k}) needs {smem} bytes of "
                         f"shared memory; use 2 <= stages with stages * (tile_m + tile_n) * tile_k <= 204800.")
    kmod = _kernel_module()
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    gmem = cute.AddressSpace.gmem
    # Placeholder arguments: only their types matter for compilation (address 0 is never touched).
    args = (make_ptr(kmod.AB_DTYPE, 0, gmem, assumed_align=16), make_ptr(kmod.AB_DTYPE, 0, gmem, assumed_align=16),
            make_ptr(kmod.OUT_DTYPE, 0, gmem, assumed_align=16), make_ptr(cutlass.Float32, 0, gmem, assumed_align=4),
            make_ptr(cutlass.Float32, 0, gmem, assumed_align=4), cutlass.Int32(128), cutlass.Int32(128),
            cutlass.Int32(128), cuda_driver.CUstream(0))
    gemm = kmod.Fp8GemmSm90(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, stages=stages)
    dump_dir = tempfile.mkdtemp(prefix="tessel_cute_")
    try:  # PTX and cubin are read into the compiled object, so the dump dir can go right away
        return cute.compile(gemm, *args, options=f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {dump_dir}")
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)


def _on_hopper(t: Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.get_device_capability(t.device) == (9, 0)


def _fp8_gemm_cute(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor) -> Tensor:
    if not _on_hopper(a):
        raise ValueError(f"{_OP}: backend='cute' needs CUDA tensors on an sm_90 (Hopper) GPU, got tensors on "
                         f"{a.device}; use backend='reference' (or 'auto').")
    for name, t in (("a", a), ("b", b)):
        if t.data_ptr() % 16:
            raise ValueError(f"{_OP}: {name}.data_ptr() is not 16-byte aligned (TMA needs it); call .clone().")
    compiled = compile_fp8_gemm()
    kmod = _kernel_module()
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    (m, k), n = a.shape, b.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m == 0 or n == 0:
        return out
    gmem = cute.AddressSpace.gmem
    with torch.cuda.device(a.device):
        stream = cuda_driver.CUstream(torch.cuda.current_stream(a.device).cuda_stream)
        compiled(make_ptr(kmod.AB_DTYPE, a.data_ptr(), gmem, assumed_align=16),
                 make_ptr(kmod.AB_DTYPE, b.data_ptr(), gmem, assumed_align=16),
                 make_ptr(kmod.OUT_DTYPE, out.data_ptr(), gmem, assumed_align=16),
                 make_ptr(cutlass.Float32, scale_a.data_ptr(), gmem, assumed_align=4),
                 make_ptr(cutlass.Float32, scale_b.data_ptr(), gmem, assumed_align=4),
                 m, n, k, stream)
    return out


def fp8_gemm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, *, backend: str = "auto") -> Tensor:
    """(M, K) e4m3 x (N, K) e4m3 -> (M, N) bf16, times scale_a * scale_b; see the module docstring.

    backend: "cute" (the CuTe DSL kernel; CUDA sm_90 + nvidia-cutlass-dsl), "reference", or "auto"
    ("cute" when the tensors are on an sm_90 GPU and the DSL imports, else "reference"). No autograd:
    FP8 recipes call this inside their own autograd.Function.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"{_OP}: backend={backend!r} is not one of {_BACKENDS}.")
    _check(a, b, scale_a, scale_b)
    if backend == "auto":
        backend = "cute" if _on_hopper(a) and cute_available() else "reference"
    if backend == "cute":
        return _fp8_gemm_cute(a, b, scale_a, scale_b)
    return fp8_gemm_reference(a, b, scale_a, scale_b)
