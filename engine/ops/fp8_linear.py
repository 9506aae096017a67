"""FP8 linear: ``y = x @ w.T + b`` with all three GEMMs in FP8 (reference, GEMMs, autograd).

    forward        y  = x  @ w.T      x: e4m3 (M, K)   w: e4m3 (N, K)
    input grad     dx = dy @ w        dy: e5m2 (M, N)  w.T: e4m3 (K, N)
    weight grad    dw = dy.T @ x      dy.T: e5m2 (N, M) x.T: e4m3 (K, M)

Every GEMM here is ``a @ b.T`` with ``a`` (rows, C) and ``b`` (cols, C) quantised along the
contraction C, accumulated in fp32 and multiplied by the dequantisation scales (``scale_inv``,
amax / fp8_max). A tensor is quantised as ``q = fp8(clamp(t * scale, -max, max))`` with
``scale = fp8_max / amax`` (1 where amax is 0 or not finite); e4m3 max = 448, e5m2 max = 57344.

Recipes (where the amax comes from, and its granularity):

* ``tensorwise``: current per-tensor scaling: one amax per tensor, taken from the tensor itself.
  GEMMs: ``torch._scaled_mm`` with scalar scales. The fp8 transposes the backward needs come from
  the same pass as the cast (engine.ops.fp8_cast_transpose: csrc/fp8's fused cast-transpose-amax
  when built, on CPU and CUDA), so the forward saves fp8 ``x.T`` (1 byte per element), not ``x``.
* ``delayed``: per-tensor scales from an amax history (Transformer Engine's DelayedScaling):
  ``scale = fp8_max / max(history) / 2**margin``, carried in a :class:`DelayedScaling` state.
  Calls record their amax (a running max within a step); :meth:`DelayedScaling.update` (once per
  optimizer step; the trainer calls it, all-reducing the amaxes first) pushes it into the history
  and recomputes the scales. One deviation from TE: before the first update the history is empty
  and the call scales by its current amax (TE starts from scale 1, which flushes small gradients
  to zero in e5m2).
* ``rowwise``: one scale per row of each GEMM operand (per token for x and dy, per output channel
  for w in the forward; the backward re-quantises x, w and dy along their other axis from the
  saved high-precision tensors). ``torch._scaled_mm`` with (rows, 1) x (1, cols) scales (on CUDA
  its row-wise kernel returns bf16 only; the result is cast to the output dtype).
* ``blockwise`` (DeepSeek-V3): activations and gradients in 1 x 128 tiles along the contraction,
  weights in 128 x 128 blocks (transposing a block-quantised weight needs no re-quantisation).
  ``torch._scaled_mm`` has no CPU kernel for this layout, so the GEMM runs as one FP8 GEMM per
  128-wide slice of the contraction (``_scaled_mm`` with unit scales, fp32 out) whose fp32 partial
  is scaled by the outer product of the slice's row and column scales and added in fp32: exactly
  DeepSeek-V3's "promote to fp32 every 128 elements of K". Not a dequantising fallback: every
  product is an FP8 x FP8 GEMM. On CUDA torch's sm_90 blockwise kernel is tried first
  (``torch.nn.functional.scaled_mm`` with BlockWise1x128 / BlockWise128x128 recipes where torch has
  it, else ``torch._scaled_mm``; 1x128 x 1x128 for the weight gradient), its first result in a
  process checked against the loop; the loop is the fallback (K/128 GEMM launches: slow, correct).
* ``mxfp8`` (OCP Microscaling, as Transformer Engine's MXFP8BlockScaling with the HYBRID format): every
  operand in 1 x 32 blocks along its contraction, each block's scale a power of two (E8M0), the
  smallest that keeps the block within the format (``2**ceil(log2(amax / fp8_max))``: no saturation).
  The backward re-quantises x, w and dy along their other axis from the saved high-precision tensors,
  as row-wise does. GEMM: no MX kernel is wired (torch's needs Blackwell), so the fp8 values times their
  scales are multiplied as an fp32 matmul. With power-of-two scales this is the MX GEMM's arithmetic
  (every dequantised value exact in fp32, products too above fp32's normal range, sums in fp32), at an
  fp32 matmul's speed: a numerics recipe here, for speed on Blackwell use the TE backend (docs/fp8.md).
  (Rounding the scale up lets a block within ~1.9x of fp32's largest value dequantise to inf, as TE's.)

Shape rules (checked on every backend, so what runs on CPU runs on a GPU): K and N must be
multiples of 16 (cuBLAS FP8 needs 16-byte aligned rows; the backward contracts over N); M (the
tokens, the weight gradient's contraction) is zero-padded to a multiple of 16 where needed (zeros
add nothing). Inputs and weights are fp32 or bf16; the output has the input's dtype, the weight
gradient the weight's.

Weight casts across calls (``weight_casts``, a :class:`WeightCasts`): while the caller guarantees that
a weight does not change -- the trainer, for one step's forward, recompute and backward over all its
micro-batches, and for evaluation -- its FP8 casts are made once and reused by every later call: per
tensor (x) the cast, its transpose and its amax (with the amax's TP all-reduce), per row the two
orientations, per block the one cast. Transformer Engine's ``is_first_microbatch``, owned by the caller
that knows when weights change rather than guessed from a tensor's version counter (which optimizer
kernels and collectives writing through raw pointers do not bump). Bitwise the same results.

FP8 all-gathers under sequence parallelism (a :class:`SequenceShards`; per-tensor recipes): a
column-parallel linear's input arrives as this rank's sequence rows (``sequence_gather``), and a
row-parallel linear's output gradient too (``sequence_scatter``: the forward reduce-scatters the
output, so the backward gathers dy); the GEMMs need every rank's rows. Instead of gathering in high
precision and casting the whole, the shard is cast with the scale of the whole tensor (its amax
all-reduced (MAX) over the group; the input's in the weight's call) and the fp8 bytes are gathered:
1 byte per element on the wire instead of 2 (bf16) or 4 (fp32). The gathered values are bit for bit
the cast of the gathered tensor (the cast is elementwise and the scale the same). The input
gradient of a gathered input is reduce-scattered, as the gather's backward.

Tensor parallelism: a tensor sharded over a process group has per-tensor scales equal to those of
the unsharded tensor when its amax is all-reduced (MAX) over that group: ``amax_reduce`` maps an
operand ("input", "weight", "grad_output") to a function doing that (parallel/tensor_parallel/fp8.py
supplies them). Only per-tensor recipes need it; row and block scales are local by construction.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch
from torch import Tensor

from engine.ops.fp8_cast_transpose import (FP8_MAX, fp8_cast_transpose_grid, fp8_cast_transpose_scaled,  # noqa: F401
                                           fp8_scales_from_amax, scale_from_amax)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")
PER_TENSOR = ("tensorwise", "delayed")  # one scale per tensor
BLOCK = 128   # blockwise tile edge
MX_BLOCK = 32  # mxfp8 block length along the contraction
REQUANTISED = ("rowwise", "mxfp8")  # weight saved in high precision, re-quantised transposed for the backward
ALIGN = 16    # FP8 GEMM row alignment (elements of 1 byte)
ROLES = ("input", "weight", "grad_output")
_FORMAT = {"input": E4M3, "weight": E4M3, "grad_output": E5M2}
_OP = "fp8_linear"
GEMM_PATHS: dict[str, str] = {}  # which blockwise GEMM ran last ("native" or the loop): bench and GPU test report it

AmaxReduce = Callable[[Tensor], Tensor]


# -- quantisation ----------------------------------------------------------------------------------
def amax_to_scale(amax: Tensor, fmt: torch.dtype, *, margin: int = 0) -> Tensor:
    """``fp8_max / amax / 2**margin`` in fp32; 1 where amax is 0, inf or NaN (nothing to scale by).
    ``fp8_max / amax`` is clamped to the largest fp32 (a tiny amax would overflow it to inf, and 0 * inf
    is NaN): engine.ops.fp8_cast_transpose.scale_from_amax, which the native cast computes itself."""
    scale = scale_from_amax(amax, fmt)
    return scale / (2.0 ** margin) if margin else scale


def _grid_cast(t: Tensor, scale: Tensor, block: tuple[int, int], fmt: torch.dtype, *, out: bool = True,
               out_t: bool = False) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """One pass over ``t`` (rows, cols): fp8(t * scale[r // block[0], c // block[1]]) clamped to the format's
    range, and/or its transpose (engine.ops.fp8_cast_transpose_grid: csrc/fp8 when built). The scales came
    from their own amaxes, so the cast computes none."""
    if not t.numel():  # (0, cols) or (rows, 0): empty outputs
        rows, cols = t.shape
        return (t.new_empty((rows, cols), dtype=fmt) if out else None,
                t.new_empty((cols, rows), dtype=fmt) if out_t else None)
    q, q_t, _ = fp8_cast_transpose_grid(t.contiguous(), scale.float().contiguous(),
                                        (max(block[0], 1), max(block[1], 1)), fmt=fmt, want_out=out,
                                        want_out_t=out_t, want_amax=False)
    return q, q_t


def _padded_to(t: Tensor, rows: int, cols: int) -> Tensor:
    """``t`` zero-padded to (rows, cols) in its own dtype (a view when nothing is missing): for block amaxes."""
    extra_r, extra_c = rows - t.shape[0], cols - t.shape[1]
    return torch.nn.functional.pad(t, (0, extra_c, 0, extra_r)) if extra_r or extra_c else t


@dataclass
class Quantized:
    """An fp8 matrix and its dequantisation scales.

    ``granularity``: "tensor" (scale_inv: 0-d), "row" (rows, 1), "tile" (rows, ceil(cols/128): 1 x 128
    tiles along the columns), "block" (ceil(rows/128), ceil(cols/128): 128 x 128 blocks) or "mx" (rows,
    ceil(cols/32): 1 x 32 blocks along the columns, powers of two).
    """

    data: Tensor
    scale_inv: Tensor
    granularity: str

    def t(self) -> "Quantized":
        """The transpose, without re-quantising (tensor and block granularity only)."""
        if self.granularity not in ("tensor", "block"):
            raise ValueError(f"a {self.granularity}-quantised matrix must be re-quantised to transpose it")
        inv = self.scale_inv if self.granularity == "tensor" else self.scale_inv.t().contiguous()
        return Quantized(self.data.t().contiguous(), inv, self.granularity)

    def dequantize(self) -> Tensor:
        """fp32 values ``data * scale_inv`` (the reference's view of the operand)."""
        d = self.data.float()  # (rows, cols)
        if self.granularity in ("tensor", "row"):
            return d * self.scale_inv
        rows, cols = d.shape
        if self.granularity in ("tile", "mx"):
            edge = BLOCK if self.granularity == "tile" else MX_BLOCK
            s = self.scale_inv.repeat_interleave(edge, dim=1)[:, :cols]  # (rows, cols)
        else:
            s = self.scale_inv.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:rows, :cols]
        return d * s


def quantize_tensorwise(t: Tensor, fmt: torch.dtype, scale: Optional[Tensor] = None, *,
                        amax: Optional[Tensor] = None, transpose: bool = False, want_amax: bool = True,
                        amax_into: Optional[Tensor] = None) -> tuple[Quantized, Optional[Quantized], Optional[Tensor]]:
    """``t`` (rows, cols) with one scale, given as ``scale`` or as the ``amax`` it derives from
    (:func:`amax_to_scale`, margin 0), or neither: t's own amax (current scaling, reduced by the native
    cast itself): (q, q.T or None, amax of t, or None with ``want_amax=False``:
    only delayed scaling keeps it, and skipping it saves the cast's reduction and, on a GPU, a memset
    launch; ``amax_into``: a delayed state's pending slot the cast folds the amax into itself). One call
    of the fused
    cast-transpose-amax (engine.ops.fp8_cast_transpose_scaled, e4m3 or e5m2; bitwise equal to its
    reference), which also derives the scale from an amax and returns 1 / scale, so a cast launches
    no scale arithmetic of its own (host time per linear: docs/fp8.md)."""
    if scale is not None:
        scale = scale.reshape(1).float()
    q, q_t, t_amax, inv = fp8_cast_transpose_scaled(t, scale=scale, amax=amax, fmt=fmt, want_out_t=transpose,
                                                    want_amax=want_amax, amax_into=amax_into)
    return Quantized(q, inv, "tensor"), (Quantized(q_t, inv, "tensor") if transpose else None), t_amax


def _absmax(t: Tensor, dim) -> Tensor:
    """fp32 max |t| over ``dim`` (kept), in one reduction (no fp32 or |t| copy); NaN propagates."""
    return torch.linalg.vector_norm(t, float("inf"), dim=dim, keepdim=True, dtype=torch.float32)


def quantize_rowwise(t: Tensor, fmt: torch.dtype, *, transposed: bool = False) -> Quantized:
    """One scale per row of ``t`` (rows, cols); with ``transposed``, of ``t.T``: the scales come from
    t's columns and the cast writes the transpose directly (t itself is never copied transposed)."""
    t = t.contiguous()
    rows, cols = t.shape
    if transposed:
        scale, inv = fp8_scales_from_amax(_absmax(t, 0), fmt)  # (1, cols): one per row of t.T
        _, q_t = _grid_cast(t, scale, (rows, 1), fmt, out=False, out_t=True)  # (cols, rows)
        return Quantized(q_t, inv.reshape(-1, 1), "row")  # (cols, 1), unit strides
    scale, inv = fp8_scales_from_amax(_absmax(t, 1), fmt)  # (rows, 1)
    q, _ = _grid_cast(t, scale, (1, cols), fmt)
    return Quantized(q, inv, "row")


def _quantize_runs(t: Tensor, fmt: torch.dtype, *, edge: int, pow2: bool, granularity: str,
                   transposed: bool) -> Quantized:
    """1 x ``edge`` runs along the columns of ``t`` (rows, cols), each with its own scale (a ragged last run
    too; power-of-two scales with ``pow2``). With ``transposed``, the runs of ``t.T``: ``edge`` x 1 along t's
    rows, the cast writing the transpose. scale_inv: (rows of the result, ceil(contraction / edge))."""
    t = t.contiguous()
    rows, cols = t.shape
    if transposed:
        nb = -(-rows // edge)
        runs = _padded_to(t, nb * edge, cols).view(nb, edge, cols)
        scale, inv = fp8_scales_from_amax(_absmax(runs, 1).squeeze(1), fmt, pow2=pow2)  # (nb, cols)
        _, q_t = _grid_cast(t, scale, (edge, 1), fmt, out=False, out_t=True)  # (cols, rows)
        inv = torch.empty(cols, nb, device=t.device).copy_(inv.t())  # (cols, nb), unit strides
        return Quantized(q_t, inv, granularity)
    nb = -(-cols // edge)
    runs = _padded_to(t, rows, nb * edge).view(rows, nb, edge)
    scale, inv = fp8_scales_from_amax(_absmax(runs, 2).squeeze(2), fmt, pow2=pow2)  # (rows, nb)
    q, _ = _grid_cast(t, scale, (1, edge), fmt)
    return Quantized(q, inv, granularity)


def quantize_tiles(t: Tensor, fmt: torch.dtype, *, transposed: bool = False) -> Quantized:
    """1 x 128 tiles along the columns of ``t`` (rows, cols); a ragged last tile has its own scale.
    With ``transposed``, the tiles of ``t.T``: 128 x 1 along t's rows, the cast writing the transpose."""
    return _quantize_runs(t, fmt, edge=BLOCK, pow2=False, granularity="tile", transposed=transposed)


def quantize_blocks(t: Tensor, fmt: torch.dtype) -> Quantized:
    """128 x 128 blocks of ``t`` (rows, cols)."""
    t = t.contiguous()
    rows, cols = t.shape
    rb, cb = -(-rows // BLOCK), -(-cols // BLOCK)
    tiles = _padded_to(t, rb * BLOCK, cb * BLOCK).view(rb, BLOCK, cb, BLOCK)  # (rb, 128, cb, 128)
    scale, inv = fp8_scales_from_amax(_absmax(tiles, (1, 3)).reshape(rb, cb), fmt)  # (rb, cb)
    q, _ = _grid_cast(t, scale, (BLOCK, BLOCK), fmt)
    return Quantized(q, inv, "block")


def quantize_mx(t: Tensor, fmt: torch.dtype, *, transposed: bool = False) -> Quantized:
    """1 x 32 blocks along the columns of ``t`` (rows, cols) with power-of-two scales (mxfp8, engine.ops.
    fp8_cast_transpose.pow2_scales; a ragged last block has its own). With ``transposed``, the blocks of
    ``t.T``: 32 x 1 along t's rows, the cast writing the transpose."""
    return _quantize_runs(t, fmt, edge=MX_BLOCK, pow2=True, granularity="mx", transposed=transposed)


# -- GEMMs ----------------------------------------------------------------------------------------
def _slice_scales(q: Quantized, k: int, n: int) -> Tensor:
    """Per-row dequantisation scales (n,) of contraction slice ``k`` of a tile/block operand."""
    if q.granularity == "tile":
        return q.scale_inv[:, k]
    return q.scale_inv[:, k].repeat_interleave(BLOCK)[:n]


def blockwise_scale_layouts(a: Quantized, b: Quantized) -> tuple[Tensor, Tensor]:
    """The dequantisation scales of ``a`` (M, K) in 1 x 128 tiles and ``b`` (N, K) in 1 x 128 tiles or
    128 x 128 blocks laid out as torch's sm_90 blockwise ``scaled_mm`` reads them: a tile operand's
    (rows, K/128) outer-dim-major (stride 1 along the rows); a block operand's (N/128, K/128) with the
    K/128 blocks zero-padded to a multiple of 4, seen transposed as (L4, N/128)."""
    def tiles(q: Quantized) -> Tensor:
        return q.scale_inv.t().contiguous().t()  # (rows, K/128), stride (1, rows)
    if b.granularity == "tile":
        return tiles(a), tiles(b)
    kb = b.scale_inv.shape[1]
    padded = torch.nn.functional.pad(b.scale_inv, (0, -kb % 4))  # (N/128, L4)
    return tiles(a), padded.t()  # (L4, N/128) view


def _native_blockwise(a: Quantized, b: Quantized) -> Optional[Tensor]:
    """torch's sm_90 blockwise kernel (1x128 x 128x128 for the forward and the input gradient, 1x128 x
    1x128 for the weight gradient), fp32 out, or None where this torch/GPU has none. Each pair is tried
    on its own, in the scale layouts :func:`blockwise_scale_layouts` gives, and, for a 1x128 right-hand
    operand, with those scales transposed as well (torch's own tests hand ``scale_b`` over transposed).
    A pair's first result in a process is checked against the per-slice loop; a layout the kernel
    refuses or computes differently is not used again. GEMM_PATHS records per pair the layout in use, or
    "off" and why (``blockwise_native_error[<pair>]``)."""
    if a.data.device.type != "cuda" or a.granularity != "tile" or b.granularity not in ("tile", "block"):
        return None
    if a.data.shape[1] % BLOCK or (b.granularity == "block" and b.data.shape[0] % BLOCK):
        return None
    pair = "1x128 x " + ("1x128" if b.granularity == "tile" else "128x128")
    key = f"blockwise_native[{pair}]"
    if GEMM_PATHS.get(key) == "off":
        return None
    sa, sb = blockwise_scale_layouts(a, b)
    layouts = {"as laid out": sb}
    if b.granularity == "tile":
        layouts["scale_b transposed"] = sb.t()
    if GEMM_PATHS.get(key) in layouts:  # found earlier in this process
        layouts = {GEMM_PATHS[key]: layouts[GEMM_PATHS[key]]}
    return _first_native_layout(a, b, key, sa, layouts, _blockwise_kernel)


def _blockwise_kernel(a: Quantized, b: Quantized, sa: Tensor, sb: Tensor) -> Tensor:
    """torch's blockwise ``scaled_mm`` (bf16 out): the recipes named where torch has ``F.scaled_mm``, else the
    older entry point that infers them from the scales' shapes. Raises what the kernel raises."""
    F = torch.nn.functional
    first = None
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):  # torch >= 2.10
        recipe_b = F.ScalingType.BlockWise1x128 if b.granularity == "tile" else F.ScalingType.BlockWise128x128
        try:
            return F.scaled_mm(a.data, b.data.t(), sa, F.ScalingType.BlockWise1x128, sb, recipe_b,
                               output_dtype=torch.bfloat16)
        except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:
            first = e
    try:
        return torch._scaled_mm(a.data, b.data.t(), sa, sb, out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        if first is not None:
            raise RuntimeError(f"F.scaled_mm: {type(first).__name__}: {str(first).splitlines()[0][:200]}; "
                               f"torch._scaled_mm: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from e
        raise


def _first_native_layout(a: Quantized, b: Quantized, key: str, sa: Tensor, layouts: dict[str, Tensor],
                         kernel: Callable[[Quantized, Quantized, Tensor, Tensor], Tensor]) -> Optional[Tensor]:
    """The first of ``layouts`` (name -> scale_b) that ``kernel`` takes and computes as the per-slice loop
    does (checked once per ``key``, the pair of granularities, per process): its fp32 result, the layout
    recorded in GEMM_PATHS[key]; or None, with the pair switched off and each layout's failure recorded."""
    errors = []
    for name, scale_b in layouts.items():
        try:
            out = kernel(a, b, sa, scale_b).float()
        except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:
            errors.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:400]}")
            continue
        if GEMM_PATHS.get(key) != name:  # this pair's first result in this layout: the scale convention
            ref = _blockwise_loop(a, b)
            rel = ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
            if not rel < 2e-2:  # bf16 output rounding is 4e-3
                errors.append(f"{name}: the result differs from the per-slice loop by {rel:.2e}")
                continue
            # Kept for later calls only where the check could tell the layouts apart: with one row or one
            # column of scales a transposed reading of them computes the same.
            if min(sa.shape) > 1 and min(scale_b.shape) > 1:
                GEMM_PATHS[key] = name
        GEMM_PATHS["blockwise"] = "native"
        return out
    GEMM_PATHS[key] = "off"
    GEMM_PATHS[key.replace("blockwise_native", "blockwise_native_error")] = "; ".join(errors)
    return None


def _blockwise_loop(a: Quantized, b: Quantized) -> Tensor:
    """One FP8 GEMM per 128-wide slice of the contraction (unit scales, fp32 out), each partial scaled by
    its slice's row and column scales and summed in fp32: (M, N) fp32."""
    (m, c), n = a.data.shape, b.data.shape[0]
    one = torch.ones((), dtype=torch.float32, device=a.data.device)
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    for k, start in enumerate(range(0, c, BLOCK)):
        end = min(start + BLOCK, c)
        part = torch._scaled_mm(a.data[:, start:end].contiguous(), b.data[:, start:end].contiguous().t(),
                                one, one, out_dtype=torch.float32)  # (m, n) fp32, exact products
        acc += part * _slice_scales(a, k, m).unsqueeze(1) * _slice_scales(b, k, n).unsqueeze(0)
    return acc


@functools.lru_cache(maxsize=None)
def _cpu_has_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes (rows, 1) x (1, cols) scales (2.13 does; 2.11's
    oneDNN path asserts per-tensor scales). Probed once on a 16 x 16 product."""
    a = torch.ones(16, 16).to(E4M3)
    s = torch.ones(16, 1)
    try:
        torch._scaled_mm(a, a.t(), s, s.t().contiguous(), out_dtype=torch.float32)
        return True
    except RuntimeError:
        return False


def scaled_gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> Tensor:
    """``dequant(a) @ dequant(b).T`` for ``a`` (M, C) and ``b`` (N, C) quantised along C; (M, N)."""
    if a.granularity == "tensor" and b.granularity == "tensor":
        return torch._scaled_mm(a.data, b.data.t(), a.scale_inv, b.scale_inv, out_dtype=out_dtype)
    if a.granularity == "row" and b.granularity == "row":
        cuda = a.data.device.type == "cuda"
        if not cuda and not _cpu_has_rowwise_scaled_mm():
            # Dequantising fallback: fp32 products of the fp8 values times their scales, what the CPU
            # _scaled_mm computes where it has row-wise scales (torch 2.13); torch 2.11's has none.
            GEMM_PATHS["rowwise"] = "dequantised fp32 matmul (this torch's CPU _scaled_mm has per-tensor scales only)"
            return (a.dequantize() @ b.dequantize().t()).to(out_dtype)  # (M, N)
        GEMM_PATHS["rowwise"] = "_scaled_mm"
        dt = torch.bfloat16 if cuda else out_dtype
        y = torch._scaled_mm(a.data, b.data.t(), a.scale_inv, b.scale_inv.t().contiguous(), out_dtype=dt)
        return y.to(out_dtype)
    if a.granularity == "mx" and b.granularity == "mx":
        # No MX kernel wired (torch's needs Blackwell): the MX GEMM's arithmetic as an fp32 matmul of the
        # dequantised operands (power-of-two scales: every value exact in fp32, products above 2**-126).
        GEMM_PATHS["mxfp8"] = "dequantised fp32 matmul (no MX GEMM wired)"
        return (a.dequantize() @ b.dequantize().t()).to(out_dtype)  # (M, N)
    if a.granularity in ("tile", "block") and b.granularity in ("tile", "block"):
        native = _native_blockwise(a, b)
        if native is not None:
            return native.to(out_dtype)
        GEMM_PATHS["blockwise"] = "per-128-slice loop"
        return _blockwise_loop(a, b).to(out_dtype)
    raise ValueError(f"no FP8 GEMM for {a.granularity} x {b.granularity} operands")


def scaled_gemm_reference(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> Tensor:
    """Plain PyTorch :func:`scaled_gemm`. Tensor and row layouts: the dequantised operands' fp32
    matmul (what ``_scaled_mm`` computes on the CPU, bit for bit; CUDA's epilogue scales the fp32
    accumulator instead, which differs by rounding). Tile and block layouts: the per-128-slice sum."""
    if a.granularity in ("tensor", "row", "mx"):
        return (a.dequantize() @ b.dequantize().t()).to(out_dtype)  # (M, N)
    (m, c), n = a.data.shape, b.data.shape[0]
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    for k, start in enumerate(range(0, c, BLOCK)):
        part = a.data[:, start:start + BLOCK].float() @ b.data[:, start:start + BLOCK].float().t()
        acc += part * _slice_scales(a, k, m).unsqueeze(1) * _slice_scales(b, k, n).unsqueeze(0)
    return acc.to(out_dtype)


# -- delayed scaling state -------------------------------------------------------------------------
class DelayedScaling(torch.nn.Module):
    """Amax history and scales of one linear's three operands (Transformer Engine's DelayedScaling).

    Buffers (saved in checkpoints): ``amax_history`` (3, history_len) fp32, newest first, rows in
    :data:`ROLES` order; ``scale`` (3,) fp32, the scales the next calls use; ``steps`` (1,) int64 on
    the CPU, the number of updates (0: the history is empty and calls scale by their current amax).
    ``algo``: "max" (the history's maximum, TE's default) or "most_recent".
    """

    def __init__(self, *, history_len: int = 16, margin: int = 0, algo: str = "max", device=None):
        super().__init__()
        if not (isinstance(history_len, int) and history_len >= 1):
            raise ValueError(f"DelayedScaling history_len={history_len!r} must be an integer >= 1")
        if not (isinstance(margin, int) and margin >= 0):
            raise ValueError(f"DelayedScaling margin={margin!r} must be an integer >= 0")
        if algo not in ("max", "most_recent"):
            raise ValueError(f"DelayedScaling algo={algo!r} must be 'max' or 'most_recent'")
        self.history_len, self.margin, self.algo = history_len, margin, algo
        self.register_buffer("amax_history", torch.zeros(3, history_len, device=device))
        self.register_buffer("scale", torch.ones(3, device=device))
        self.register_buffer("steps", torch.zeros(1, dtype=torch.int64))  # stays on the CPU: read on the host
        self.register_buffer("pending", torch.zeros(3, device=device), persistent=False)
        self._slots: dict[str, tuple[Tensor, dict[str, Tensor]]] = {}

    def slot(self, buffer: str, role: str) -> Tensor:
        """``role``'s (1,) view of the ``buffer`` ("scale" or "pending"), made once per buffer tensor (a
        call's host time: slicing is a Python op; the buffers are updated in place, so the views stay
        current, and a buffer replaced by a move is sliced afresh)."""
        t = getattr(self, buffer)
        hit = self._slots.get(buffer)
        if hit is None or hit[0] is not t or hit[1][ROLES[0]].data_ptr() != t.data_ptr():  # (a deep copy)
            hit = self._slots[buffer] = (t, {r: t[i:i + 1] for i, r in enumerate(ROLES)})
        return hit[1][role]

    def _apply(self, fn, recurse=True):  # keep ``steps`` on the CPU when the module moves
        steps = self.steps
        out = super()._apply(fn, recurse)
        self.steps = steps
        return out

    @property
    def started(self) -> bool:
        return bool(self.steps.item() > 0)

    def record(self, role: str, amax: Tensor) -> None:
        """Fold a call's (local) amax into this step's pending maximum (no host sync)."""
        pending = self.slot("pending", role)
        if amax.dtype != torch.float32 or amax.device != pending.device:
            amax = amax.float().to(pending.device)
        torch.maximum(pending, amax.reshape(1), out=pending)

    def update(self, reduce: Optional[AmaxReduce] = None) -> None:
        """Push this step's amaxes (``reduce``d first, e.g. MAX over TP and DP) into the history and
        recompute the scales. A role with no usable amax this step (none recorded, or non-finite: a
        skipped step) keeps its history and its scale untouched. :func:`update_delayed_states` of one."""
        update_delayed_states([self], reduce)


def _delayed_step(history: Tensor, scale: Tensor, amax: Tensor, *, margin: int, algo: str) -> tuple[Tensor, Tensor]:
    """:meth:`DelayedScaling.update` of ``g`` states at once: ``history`` (g, 3, L), ``scale`` (g, 3) and this
    step's reduced ``amax`` (g, 3) -> the new history and scales (elementwise per state: the same bits as
    one state at a time)."""
    ok = (amax > 0) & (amax < float("inf"))  # (g, 3): roles that take this step (not 0, inf or NaN)
    rolled = torch.roll(history, 1, dims=2)
    rolled[:, :, 0] = torch.where(ok, amax, rolled[:, :, 0])
    history = torch.where(ok.unsqueeze(2), rolled, history)  # (g, 3, L), newest first
    ref = history.amax(dim=2) if algo == "max" else history[:, :, 0]  # (g, 3)
    new = torch.cat([amax_to_scale(ref[:, :2], E4M3, margin=margin),   # input, weight: e4m3
                     amax_to_scale(ref[:, 2:], E5M2, margin=margin)], dim=1)  # grad_output: e5m2
    return history, torch.where(ok & (ref > 0), new, scale)


def delayed_states(module: torch.nn.Module) -> list[tuple[str, DelayedScaling]]:
    """The :class:`DelayedScaling` submodules of ``module``, with their names, in a fixed order."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, DelayedScaling)]


def update_delayed_states(states: list[DelayedScaling], reduce: Optional[AmaxReduce] = None) -> None:
    """:meth:`DelayedScaling.update` of many states with ONE reduction (their pending amaxes stacked into
    a (3n,) tensor) and one batched computation per (history length, margin, algo, device): a fixed
    number of kernel launches per optimizer step, not a few dozen per linear."""
    if not states:
        return
    stacked = torch.cat([s.pending for s in states])  # (3n,)
    if reduce is not None:
        stacked = reduce(stacked)
    stacked = stacked.view(len(states), 3)  # (n, 3): a row per state
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(states):
        groups.setdefault((s.history_len, s.margin, s.algo, s.amax_history.device), []).append(i)
    for (_, margin, algo, _), idx in groups.items():
        members = [states[i] for i in idx]
        amax = stacked if len(idx) == len(states) else stacked[torch.tensor(idx, device=stacked.device)]  # (g, 3)
        history, scale = _delayed_step(torch.stack([s.amax_history for s in members]),  # (g, 3, L)
                                       torch.stack([s.scale for s in members]), amax,  # (g, 3)
                                       margin=margin, algo=algo)
        torch._foreach_copy_([s.amax_history for s in members], list(history.unbind(0)))
        torch._foreach_copy_([s.scale for s in members], list(scale.unbind(0)))
    torch._foreach_zero_([s.pending for s in states])
    for s in states:
        s.steps += 1  # (1,) int64 on the CPU


# -- weight casts reused across calls ------------------------------------------------------------
class WeightCasts:
    """One linear's weight casts, reused by every call until :meth:`close` (see the module docstring).

    ``made`` and ``reused`` count the casts computed and the calls that took one from here. A closed
    cache (its scope ended) caches nothing: a late call computes its cast as without a cache."""

    KINDS = ("tensor", "row", "row_t", "block", "mx", "mx_t")

    def __init__(self):
        self._casts: dict[str, object] = {}
        self._weight: Optional[tuple] = None  # (shape, dtype, device) of the weight the casts are of
        self.made = self.reused = 0
        self.open = True

    def has(self, kind: str) -> bool:
        return self.open and kind in self._casts

    def get(self, kind: str, weight: Tensor) -> Optional[object]:
        """The cached ``kind`` cast of ``weight``, or None."""
        if not self.open or kind not in self._casts:
            return None
        if self._weight != (weight.shape, weight.dtype, weight.device):
            raise RuntimeError(f"{_OP}: a WeightCasts holds casts of a {self._weight[0]} weight and was handed a "
                               f"{tuple(weight.shape)} one; each linear needs its own WeightCasts")
        self.reused += 1
        return self._casts[kind]

    def put(self, kind: str, weight: Tensor, cast):
        if kind not in self.KINDS:
            raise ValueError(f"WeightCasts kind {kind!r} is not one of {self.KINDS}")
        self.made += 1
        if self.open:
            self._weight = (weight.shape, weight.dtype, weight.device)
            self._casts[kind] = cast
        return cast

    def close(self) -> None:
        """The weight may change from here on: drop the casts (their memory) and cache nothing more."""
        self._casts.clear()
        self.open = False


def _cast(casts: Optional[WeightCasts], kind: str, weight: Tensor, make: Callable[[], object]):
    hit = casts.get(kind, weight) if casts is not None else None
    if hit is not None:
        return hit
    cast = make()
    return casts.put(kind, weight, cast) if casts is not None else cast


def weight_tensorwise(weight: Tensor, scaler: "Scaler", casts: Optional[WeightCasts],
                      scale: Optional[dict[str, Tensor]] = None) -> tuple[Quantized, Quantized]:
    """The per-tensor e4m3 weight and its transpose (N, K), (K, N); its amax recorded for delayed
    scaling. ``scale``: the weight's :meth:`Scaler.scale` if the caller already has it (a stacked
    reduction)."""
    # want_amax: a delayed state's cast keeps its amax even outside recording (a cast cached in
    # evaluation may be reused by a training call)
    wq, wq_t, amax = _cast(casts, "tensor", weight, lambda: quantize_tensorwise(
        weight, E4M3, **(scaler.scale("weight", weight) if scale is None else scale), transpose=True,
        want_amax=scaler.state is not None))
    if amax is None and scaler.keeps_amax:
        raise RuntimeError(f"{_OP}: this linear's WeightCasts holds a weight cast made without an amax (a recipe "
                           "with no delayed state) and a delayed-scaling call needs one; each linear, with its one "
                           "recipe, needs its own WeightCasts")
    scaler.record("weight", amax)
    return wq, wq_t


def weight_rowwise(weight: Tensor, casts: Optional[WeightCasts], *, transposed: bool = False) -> Quantized:
    """The weight per output channel (N, K), or, ``transposed``, per row of its transpose (K, N)."""
    return _cast(casts, "row_t" if transposed else "row", weight,
                 lambda: quantize_rowwise(weight, E4M3, transposed=transposed))


def weight_blocks(weight: Tensor, casts: Optional[WeightCasts], *, transposed: bool = False) -> Quantized:
    """The weight in 128 x 128 blocks (N, K) (its transpose: ``.t()`` of these, no re-quantisation)."""
    if transposed:
        raise ValueError("weight_blocks: a block-quantised weight is transposed with .t(), not re-quantised")
    return _cast(casts, "block", weight, lambda: quantize_blocks(weight, E4M3))


def weight_mx(weight: Tensor, casts: Optional[WeightCasts], *, transposed: bool = False) -> Quantized:
    """The weight in 1 x 32 power-of-two blocks along K (N, K), or, ``transposed``, along N (K, N)."""
    return _cast(casts, "mx_t" if transposed else "mx", weight,
                 lambda: quantize_mx(weight, E4M3, transposed=transposed))


def act_quantizer(recipe: str) -> Callable[..., Quantized]:
    """How a row / block / MX recipe quantises an activation or gradient (fn(t, fmt, transposed=False))."""
    return {"rowwise": quantize_rowwise, "blockwise": quantize_tiles, "mxfp8": quantize_mx}[recipe]


def weight_quantizer(recipe: str) -> Callable[..., Quantized]:
    """How a row / block / MX recipe casts its weight (fn(weight, casts, transposed=False), cached)."""
    return {"rowwise": weight_rowwise, "blockwise": weight_blocks, "mxfp8": weight_mx}[recipe]


@dataclass
class SequenceShards:
    """The sequence-parallel collectives :func:`fp8_linear` runs itself (see the module docstring); the
    tensor-parallel layer supplies them (parallel/tensor_parallel/fp8.py). ``size``: ranks in the group;
    ``amax_max``: all-reduce (MAX) a stacked (n,) amax tensor; ``all_gather``: every rank's rows of a 2-D
    uint8 tensor, concatenated in rank order; ``reduce_scatter``: the sum over ranks of a 2-D tensor,
    this rank's rows."""

    size: int
    amax_max: AmaxReduce
    all_gather: Callable[[Tensor], Tensor]
    reduce_scatter: Callable[[Tensor], Tensor]


def shard_cast(t: Tensor, role: str, scaler: "Scaler", amax_max: AmaxReduce, *, weight: Optional[Tensor] = None,
               casts: Optional[WeightCasts] = None) -> tuple[Quantized, Optional[dict[str, Tensor]]]:
    """This rank's rows ``t`` of a sequence-sharded operand (``role`` "input": e4m3, "grad_output": e5m2)
    cast with the scale of every rank's rows: the current amax all-reduced with ``amax_max``, in ONE call
    with ``weight``'s (when given and its cast is not reused); this rank's amax recorded as
    :meth:`Scaler.cast` records it. Returns (fp8 rows, the weight's scale or None)."""
    items = [(role, t)]
    if weight is not None and not (casts is not None and casts.has("tensor")):
        items.append(("weight", weight))
    scales = scaler.scales(items, amax_max)
    q, _ = scaler.cast(role, t, scale=scales[0])
    return q, (scales[1] if len(scales) > 1 else None)


def gather_rows(q: Quantized, all_gather: Callable[[Tensor], Tensor]) -> Quantized:
    """Every rank's fp8 rows of a per-tensor-scaled operand (its bytes gathered as uint8)."""
    return Quantized(all_gather(q.data.view(torch.uint8)).view(q.data.dtype), q.scale_inv, "tensor")


# -- the op --------------------------------------------------------------------------------------
def check_fp8_shapes(in_features: int, out_features: int, *, where: str = _OP, multiple: int = ALIGN,
                     why: str = "16-byte aligned fp8 rows") -> None:
    """K and N multiples of ``multiple`` (16; the forward contracts K, the input gradient N)."""
    bad = [f"{name}={v}" for name, v in (("in_features (K)", in_features), ("out_features (N)", out_features))
           if v % multiple]
    if bad:
        raise ValueError(f"{where}: FP8 GEMMs need K and N multiples of {multiple} ({why}), got "
                         + ", ".join(bad) + "; pad the layer (e.g. ffn_hidden_size or the TP-local size) to a multiple "
                         f"of {multiple}, or leave this linear in high precision (model.fp8_exclude)")


def _check(x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: str, state) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"{_OP}: recipe={recipe!r} is not one of {RECIPES}")
    for name, t in (("input", x), ("weight", weight)):
        if t.dtype not in (torch.float32, torch.bfloat16):
            fix = ("keep fp32 master weights and a bf16 or fp32 model (model.dtype)" if name == "weight"
                   else "cast the input to bf16 or fp32")
            raise ValueError(f"{_OP}: {name} dtype {t.dtype} is not supported by the {recipe} recipe (FP8 GEMM "
                             f"outputs are fp32 or bf16); {fix}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{_OP}: input (..., {x.shape[-1]}) does not match weight {tuple(weight.shape)} "
                         "(out_features, in_features)")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"{_OP}: bias shape {tuple(bias.shape)} must be ({weight.shape[0]},)")
    check_fp8_shapes(weight.shape[1], weight.shape[0])
    if recipe == "delayed" and not isinstance(state, DelayedScaling):
        raise ValueError(f"{_OP}: recipe='delayed' needs state=DelayedScaling(...) (the amax history); "
                         f"got {type(state).__name__}")
    if recipe != "delayed" and state is not None:
        raise ValueError(f"{_OP}: state is only used by recipe='delayed', not {recipe!r}; pass state=None")


def pad_rows(t: Tensor) -> Tensor:
    """Zero rows up to a multiple of ALIGN (the weight gradient contracts over the rows)."""
    extra = -t.shape[0] % ALIGN
    return torch.nn.functional.pad(t, (0, 0, 0, extra)) if extra else t


def weight_grad_requantized(recipe: str, gemm, g: Tensor, x: Tensor, w_dtype: torch.dtype) -> Tensor:
    """``dw = g.T @ x`` (g (M, N), x (M, K)) for the row, block and MX recipes, which quantise g and x again
    along the tokens M (zero-padded to ALIGN): per row of the transposes, in 1 x 128 tiles, or in 1 x 32
    power-of-two blocks."""
    quantize = act_quantizer(recipe)
    gt = quantize(pad_rows(g), E5M2, transposed=True)  # (N, M')
    xt = quantize(pad_rows(x), E4M3, transposed=True)  # (K, M')
    return gemm(gt, xt, w_dtype)  # in the weight's dtype from the GEMM itself: no fp32 (N, K) copy


def _amax(t: Tensor) -> Tensor:
    """(1,) fp32 max |t| (0 for an empty tensor; NaN if t has one): a call's current amax."""
    return _absmax(t, None).reshape(1) if t.numel() else t.new_zeros(1, dtype=torch.float32)


class Scaler:
    """Per-tensor scales of one call: current (tensorwise, or delayed before its first update) or
    from the delayed state; amaxes of sharded operands reduced with ``amax_reduce``."""

    def __init__(self, recipe: str, state: Optional[DelayedScaling], amax_reduce: Mapping[str, AmaxReduce]):
        self.state, self.reduce = state, amax_reduce
        self.current = recipe == "tensorwise" or not state.started
        self.recording = torch.is_grad_enabled()  # evaluation (no grad) leaves the history alone

    def scale(self, role: str, t: Tensor) -> dict[str, Tensor]:
        """Where ``t``'s scale comes from, as :func:`quantize_tensorwise`'s keyword: ``{"scale": s}``
        (from the delayed state), ``{"amax": a}`` (current, reduced over its group; the cast derives
        the scale) or ``{}`` (current, t unsharded: the cast reduces t's amax itself, with no Python op)."""
        if not self.current:
            return {"scale": self.state.slot("scale", role)}
        if role not in self.reduce:
            return {}
        return {"amax": self.reduce[role](_amax(t))}

    def scales(self, items: list[tuple[str, Tensor]], reduce: AmaxReduce) -> list[dict[str, Tensor]]:
        """:meth:`scale` of several operands, their current amaxes reduced by ONE call of ``reduce`` on
        the stacked (n,) tensor (a collective matmul reduces a shard's amax beside the weight's)."""
        if not self.current:
            return [self.scale(role, t) for role, t in items]
        amax = torch.cat([_amax(t) for _, t in items])  # (n,)
        amax = reduce(amax)
        return [{"amax": amax[i:i + 1]} for i in range(len(items))]

    @property
    def keeps_amax(self) -> bool:
        """Whether :meth:`record` keeps an amax (a delayed state, while recording); where it does not, the
        casts do not compute one."""
        return self.state is not None and self.recording

    def record(self, role: str, amax: Optional[Tensor]) -> None:
        if self.keeps_amax:
            self.state.record(role, amax)

    def cast(self, role: str, t: Tensor, *, transpose: bool = False,
             scale: Optional[dict[str, Tensor]] = None) -> tuple[Quantized, Optional[Quantized]]:
        """``t`` (rows, cols) cast per tensor in ``role``'s format with :meth:`scale` (or ``scale``, one of
        :meth:`scales`' entries), and (q.T or None); its amax recorded (and computed) only where
        :attr:`keeps_amax`: folded by the cast itself into the state's pending maximum (no op of its own)
        where the state lives on t's device."""
        scale = self.scale(role, t) if scale is None else scale
        if self.keeps_amax and self.state.pending.device == t.device:
            q, q_t, _ = quantize_tensorwise(t, _FORMAT[role], **scale, transpose=transpose, want_amax=False,
                                            amax_into=self.state.slot("pending", role))
            return q, q_t
        q, q_t, amax = quantize_tensorwise(t, _FORMAT[role], **scale, transpose=transpose, want_amax=self.keeps_amax)
        self.record(role, amax)
        return q, q_t


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe, scaler, gemm, casts, gather, scatter):
        # x: (M, K) 2-D (with gather: this rank's (M/size, K) rows); weight: (N, K)
        out_dtype = x.dtype
        ctx.recipe, ctx.gemm, ctx.out_dtype, ctx.w_dtype = recipe, gemm, out_dtype, weight.dtype
        ctx.has_bias, ctx.casts, ctx.gather, ctx.scatter = bias is not None, casts, gather, scatter
        if recipe in PER_TENSOR:
            ctx.scaler = scaler
            if gather is not None:  # cast the rows, gather the fp8 bytes; x^T for the backward from them
                xq, s_w = shard_cast(x, "input", scaler, gather.amax_max, weight=weight, casts=casts)
                xq = gather_rows(xq, gather.all_gather)  # (M, K)
                xq_t = xq.t()  # (K, M)
            else:
                xq, xq_t = scaler.cast("input", x, transpose=True)
                s_w = None
            wq, wq_t = weight_tensorwise(weight, scaler, casts, scale=s_w)
            y = gemm(xq, wq, out_dtype)
            ctx.save_for_backward(xq_t.data, xq_t.scale_inv, wq_t.data, wq_t.scale_inv)
        elif recipe in REQUANTISED:
            y = gemm(act_quantizer(recipe)(x, E4M3), weight_quantizer(recipe)(weight, casts), out_dtype)
            ctx.save_for_backward(x, weight)
        else:  # blockwise
            wq = weight_blocks(weight, casts)
            y = gemm(quantize_tiles(x, E4M3), wq, out_dtype)
            ctx.save_for_backward(x, wq.data, wq.scale_inv)
        if bias is not None:
            y = y + bias.to(out_dtype)
        if scatter is not None:  # sum over ranks, this rank's rows (M/size, N)
            y = scatter.reduce_scatter(y)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        g = grad_out.contiguous()  # (M, N) (with scatter: this rank's (M/size, N) rows)
        gemm, recipe = ctx.gemm, ctx.recipe
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = grad_b = None
        if recipe in PER_TENSOR:
            xt_data, xt_inv, wt_data, wt_inv = ctx.saved_tensors
            scaler = ctx.scaler
            if ctx.scatter is not None:  # cast the rows, gather the fp8 bytes; dy^T from them
                gq, _ = shard_cast(g, "grad_output", scaler, ctx.scatter.amax_max)
                gq = gather_rows(gq, ctx.scatter.all_gather)  # (M, N)
                gq_t = gq.t() if need_w else None  # (N, M)
            else:  # (M, N) and, for the weight gradient, its (N, M) transpose, from one pass over g
                gq, gq_t = scaler.cast("grad_output", g, transpose=need_w)
            if need_x:
                grad_x = gemm(gq, Quantized(wt_data, wt_inv, "tensor"), ctx.out_dtype)  # (M, K)
                if ctx.gather is not None:  # the gather's backward: sum over ranks, this rank's rows
                    grad_x = ctx.gather.reduce_scatter(grad_x)  # (M/size, K)
            if need_w:
                grad_w = wgrad_from_transposes(gemm, gq_t, Quantized(xt_data, xt_inv, "tensor"), ctx.w_dtype)
        elif recipe in REQUANTISED:
            x, weight = ctx.saved_tensors
            if need_x:
                grad_x = gemm(act_quantizer(recipe)(g, E5M2),
                              weight_quantizer(recipe)(weight, ctx.casts, transposed=True), ctx.out_dtype)
            if need_w:
                grad_w = weight_grad_requantized(recipe, gemm, g, x, ctx.w_dtype)
        else:
            x, w_data, w_inv = ctx.saved_tensors
            if need_x:
                wq_t = Quantized(w_data, w_inv, "block").t()  # (K, N)
                grad_x = gemm(quantize_tiles(g, E5M2), wq_t, ctx.out_dtype)
            if need_w:
                grad_w = weight_grad_requantized(recipe, gemm, g, x, ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.float().sum(0).to(ctx.w_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def wgrad_from_transposes(gemm, gq_t: Quantized, xq_t: Quantized, w_dtype: torch.dtype) -> Tensor:
    """``dw = dy.T @ x`` from per-tensor fp8 transposes (N, M) and (K, M); M padded to ALIGN."""
    extra = -gq_t.data.shape[1] % ALIGN
    if extra:
        pad = lambda q: Quantized(torch.nn.functional.pad(q.data.view(torch.uint8), (0, extra)).view(q.data.dtype),
                                  q.scale_inv, q.granularity)
        gq_t, xq_t = pad(gq_t), pad(xq_t)
    return gemm(gq_t, xq_t, w_dtype)  # the weight's dtype from the GEMM's epilogue (no fp32 copy)


def fp8_linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, recipe: str = "tensorwise",
               state: Optional[DelayedScaling] = None, amax_reduce: Optional[Mapping[str, AmaxReduce]] = None,
               reference: bool = False, weight_casts: Optional[WeightCasts] = None,
               sequence_gather: Optional[SequenceShards] = None,
               sequence_scatter: Optional[SequenceShards] = None) -> Tensor:
    """``input @ weight.T + bias`` with FP8 GEMMs forward and backward (see the module docstring).

    ``input``: (..., K); ``weight``: (N, K); returns (..., N) in ``input``'s dtype. ``state``: the
    :class:`DelayedScaling` of this linear (recipe "delayed" only). ``amax_reduce``: per operand
    ("input", "weight", "grad_output"), a function all-reducing a (1,) amax over the group that
    shards it (per-tensor recipes). ``reference=True`` runs every GEMM as the plain-PyTorch
    :func:`scaled_gemm_reference` (same quantisation; for tests). ``weight_casts``: this linear's
    :class:`WeightCasts` while its weight is constant (the casts are made once and reused).
    ``sequence_gather``: ``input`` is this rank's (s/size, ..., K) sequence rows; it is cast to fp8 and
    gathered (per-tensor recipes), and the result has every rank's rows: (s, ..., N).
    ``sequence_scatter``: the result is reduce-scattered over the sequence, (s/size, ..., N), and the
    backward gathers the output gradient as fp8 (per-tensor recipes; no bias: add it after).
    """
    _check(input, weight, bias, recipe, state)
    for name, sp in (("sequence_gather", sequence_gather), ("sequence_scatter", sequence_scatter)):
        if sp is not None and recipe not in PER_TENSOR:
            raise ValueError(f"{_OP}: {name} casts before gathering with one scale per tensor; recipe {recipe!r} "
                             "scales rows or tiles and keeps its operands in high precision for its backward: run "
                             f"the sequence-parallel collective outside and call without {name}")
    if sequence_gather is not None and sequence_scatter is not None:
        raise ValueError(f"{_OP}: sequence_gather (a column-parallel input) and sequence_scatter (a row-parallel "
                         "output) do not go together in one linear")
    if sequence_scatter is not None and input.shape[0] % sequence_scatter.size:
        raise ValueError(f"{_OP}: sequence_scatter over {sequence_scatter.size} ranks needs a sequence length "
                         f"divisible by it, got {input.shape[0]}")
    if sequence_scatter is not None and bias is not None:
        raise ValueError(f"{_OP}: sequence_scatter with a bias: add the bias after the reduce-scatter")
    lead = input.shape[:-1]
    if sequence_gather is not None:
        lead = (input.shape[0] * sequence_gather.size, *lead[1:])  # every rank's sequence rows
    if sequence_scatter is not None:
        lead = (input.shape[0] // sequence_scatter.size, *lead[1:])  # this rank's sequence rows
    x2d = input.reshape(-1, input.shape[-1])  # (M, K)
    gemm = scaled_gemm_reference if reference else scaled_gemm
    # Per-tensor scales: built here, where grad mode is still the caller's (evaluation records no amax).
    scaler = Scaler(recipe, state, dict(amax_reduce or {})) if recipe in PER_TENSOR else None
    y = _Fp8Linear.apply(x2d, weight, bias, recipe, scaler, gemm, weight_casts, sequence_gather, sequence_scatter)
    return y.reshape(*lead, weight.shape[0])  # (..., N)
