"""Rotary position embedding (RoPE) for q and k in one launch, sequence-first layout.

Convention: Hugging Face's ``rotate_half`` (non-interleaved). With ``x = [x1 | x2]`` split in halves
of the head dim and angle ``t = position * inv_freq`` (one angle per pair, ``hd/2`` of them):

    out = [x1 * cos(t) - x2 * sin(t) | x2 * cos(t) + x1 * sin(t)]

``cos``/``sin`` are passed compact, ``(s, hd/2)`` or ``(s, b, hd/2)`` (HF repeats them to hd).
The backward is the same rotation by ``-t``, so one kernel serves both directions. Rotation is
computed in float32 (float64 for float64 inputs) and rounded once.

Positions: ``(s,)`` shared by the batch, or ``(s, b)`` per sample - e.g. packed sequences whose
positions restart at 0 at every document boundary.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from engine.ops._triton import (Kernel, check_float, check_same_device, check_triton_dtype,
                                num_warps_for, use_triton)

_OP = "apply_rope"
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


# ----------------------------------------------------------------------------------------------
# Frequencies and angles
# ----------------------------------------------------------------------------------------------
def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict] = None) -> Tensor:
    """Inverse frequencies, float32 of shape (head_dim // 2,).

    ``scaling=None``: standard RoPE, ``1 / theta ** (2i / head_dim)``. ``scaling`` as in a Llama-3.1
    ``rope_scaling`` config entry: {factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings} (an optional ``rope_type``/``type`` key must be "llama3"):
    wavelengths longer than ``original/low_freq_factor`` are divided by ``factor``, shorter than
    ``original/high_freq_factor`` are kept, and those between are interpolated smoothly - the same
    numbers as Hugging Face's llama3 rope initialisation.
    """
    if head_dim <= 0 or head_dim % 2 != 0:
        raise ValueError(f"rope_inv_freq: head_dim={head_dim} must be a positive even number.")
    if not theta > 0:
        raise ValueError(f"rope_inv_freq: theta={theta} must be positive (e.g. 10000 or 500000).")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "llama3"))
    if kind == "default":
        return inv_freq
    missing = [key for key in _LLAMA3_KEYS if key not in scaling]
    if kind != "llama3" or missing:
        raise ValueError(
            f"rope_inv_freq: scaling={scaling} is not supported: only llama3 scaling with keys "
            f"{_LLAMA3_KEYS} (missing {missing}) or None. Pass the model's rope_scaling dict.")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    if not (factor > 0 and high > low > 0 and original > 0):
        raise ValueError(f"rope_inv_freq: scaling={scaling} needs factor > 0, "
                         "high_freq_factor > low_freq_factor > 0, original_max_position_embeddings > 0.")
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin of ``positions * inv_freq``, float32, shape ``positions.shape + (hd/2,)``.

    ``positions``: integer tensor (s,) or (s, b). ``inv_freq``: (hd/2,) from :func:`rope_inv_freq`.
    """
    if positions.dtype.is_floating_point or positions.dtype == torch.bool or positions.dim() not in (1, 2):
        raise ValueError(
            f"rope_cos_sin: positions must be an integer tensor of shape (s,) or (s, b); got "
            f"{positions.dtype} {tuple(positions.shape)}.")
    if inv_freq.dim() != 1:
        raise ValueError(f"rope_cos_sin: inv_freq must be 1-D (hd/2,), got {tuple(inv_freq.shape)}.")
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device, torch.float32)
    return angles.cos(), angles.sin()  # (s[, b], hd/2) each


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
def _broadcast_angles(t: Tensor, acc: torch.dtype) -> Tensor:
    t = torch.cat([t, t], dim=-1).to(acc)  # (s[, b], hd): the HF repeated form
    return t[:, None, None, :] if t.dim() == 2 else t[:, :, None, :]  # (s, 1|b, 1, hd)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # (..., hd/2) each
    return torch.cat([-x2, x1], dim=-1)


def apply_rope_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Plain-PyTorch RoPE; same promises as :func:`apply_rope`."""
    acc = torch.promote_types(q.dtype, torch.float32)
    c, s = _broadcast_angles(cos, acc), _broadcast_angles(sin, acc)
    q_out = q.to(acc) * c + _rotate_half(q.to(acc)) * s
    k_out = k.to(acc) * c + _rotate_half(k.to(acc)) * s
    return q_out.to(q.dtype), k_out.to(k.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernel: one program per token (s, b) rotates all q heads and all k heads
# ----------------------------------------------------------------------------------------------
@Kernel
def _rope_kernel(Q, K, COS, SIN, QO, KO, batch, n_q_heads, n_k_heads, half,
                 sq_s, sq_b, sq_h, sk_s, sk_b, sk_h, sc_s, sc_b, so_q, so_k,
                 INVERSE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    s_idx = token // batch
    b_idx = token % batch
    d = tl.arange(0, BLOCK_D)
    d_mask = d < half
    cos = tl.load(COS + s_idx * sc_s + b_idx * sc_b + d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + s_idx * sc_s + b_idx * sc_b + d, mask=d_mask, other=0.0).to(tl.float32)
    if INVERSE:  # backward: rotate by -t
        sin = -sin
    cos = cos[None, :]
    sin = sin[None, :]

    hq = tl.arange(0, BLOCK_HQ)
    q_mask = (hq[:, None] < n_q_heads) & d_mask[None, :]
    q_ptr = Q + s_idx * sq_s + b_idx * sq_b + hq[:, None] * sq_h + d[None, :]
    q1 = tl.load(q_ptr, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + half, mask=q_mask, other=0.0).to(tl.float32)
    qo_ptr = QO + token * so_q + hq[:, None] * (2 * half) + d[None, :]
    tl.store(qo_ptr, (q1 * cos - q2 * sin).to(QO.dtype.element_ty), mask=q_mask)
    tl.store(qo_ptr + half, (q2 * cos + q1 * sin).to(QO.dtype.element_ty), mask=q_mask)

    hk = tl.arange(0, BLOCK_HK)
    k_mask = (hk[:, None] < n_k_heads) & d_mask[None, :]
    k_ptr = K + s_idx * sk_s + b_idx * sk_b + hk[:, None] * sk_h + d[None, :]
    k1 = tl.load(k_ptr, mask=k_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + half, mask=k_mask, other=0.0).to(tl.float32)
    ko_ptr = KO + token * so_k + hk[:, None] * (2 * half) + d[None, :]
    tl.store(ko_ptr, (k1 * cos - k2 * sin).to(KO.dtype.element_ty), mask=k_mask)
    tl.store(ko_ptr + half, (k2 * cos + k1 * sin).to(KO.dtype.element_ty), mask=k_mask)


def _last_dim_unit(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> tuple[Tensor, Tensor]:
    q, k = _last_dim_unit(q), _last_dim_unit(k)
    cos, sin = _last_dim_unit(cos), _last_dim_unit(sin)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    seq, batch, n_q, hd = q.shape
    n_k = k.shape[2]
    half = hd // 2
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (s, b, nh, hd)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # (s, b, nkv, hd)
    sc_b = cos.stride(1) if cos.dim() == 3 else 0  # (s, hd/2) cos is shared by the batch
    block_hq, block_hk = triton.next_power_of_2(n_q), triton.next_power_of_2(n_k)
    block_d = triton.next_power_of_2(half)
    if seq * batch > 0:
        _rope_kernel.on(q.device)[(seq * batch,)](
            q, k, cos, sin, q_out, k_out, batch, n_q, n_k, half,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            cos.stride(0), sc_b, n_q * hd, n_k * hd,
            INVERSE=inverse, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d,
            num_warps=num_warps_for(block_hq * block_d))
    return q_out, k_out


@torch.library.custom_op("tessel::rope", mutates_args=())
def _rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> tuple[Tensor, Tensor]:
    return _launch(q, k, cos, sin, inverse)


@_rope.register_fake
def _(q, k, cos, sin, inverse):
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(k, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    _, _, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse = inverse


def _backward(ctx, dq_out, dk_out):
    cos, sin = ctx.saved_tensors
    dq, dk = _rope(dq_out, dk_out, cos, sin, not ctx.inverse)
    return dq, dk, None, None, None


_rope.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def _check(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(t, name=name, op=_OP)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"{_OP}: q and k must be (s, b, heads, head_dim); got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}. Activations are sequence-first.")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[3] % 2 != 0:
        raise ValueError(f"{_OP}: q {tuple(q.shape)} and k {tuple(k.shape)} must share (s, b) and an "
                         "even head_dim.")
    seq, batch, _, hd = q.shape
    ok = {(seq, hd // 2), (seq, batch, hd // 2)}
    if cos.shape != sin.shape or tuple(cos.shape) not in ok:
        raise ValueError(f"{_OP}: cos/sin must both be (s, hd/2) or (s, b, hd/2) = {sorted(ok)}; got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}. Build them with rope_cos_sin().")
    check_same_device(_OP, q=q, k=k, cos=cos, sin=sin)


def apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, backend: str = "auto"
               ) -> tuple[Tensor, Tensor]:
    """Rotate ``q`` (s, b, nh, hd) and ``k`` (s, b, nkv, hd) by the angles in ``cos``/``sin``.

    ``cos``/``sin``: (s, hd/2) or (s, b, hd/2), from :func:`rope_cos_sin`. Returns new contiguous
    tensors ``(q_rot, k_rot)`` of the input shapes and dtypes; q and k may be strided views (e.g.
    slices of a fused qkv projection) as long as head_dim is unit-stride. Differentiable in q and
    k (not in cos/sin on the Triton path).
    """
    _check(q, k, cos, sin)
    if not use_triton(backend, q, op=_OP):
        return apply_rope_reference(q, k, cos, sin)
    for name, t in (("q", q), ("k", k), ("cos", cos)):
        check_triton_dtype(t, name=name, op=_OP)
    return _rope(q, k, cos, sin, False)


class RotaryEmbedding(nn.Module):
    """Holds ``inv_freq`` for one attention layer; ``forward(q, k, positions)`` rotates q and k.

    ``positions``: (s,) or (s, b) integer tensor. Same promises as :func:`apply_rope`.
    """

    def __init__(self, head_dim: int, *, theta: float, scaling: Optional[dict] = None,
                 backend: str = "auto", device=None):
        super().__init__()
        self.backend = backend
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling).to(device),
                             persistent=False)

    def forward(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        return apply_rope(q, k, cos, sin, backend=self.backend)
