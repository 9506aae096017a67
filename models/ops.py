"""The element-wise ops of the models, one function each.

On CUDA tensors RMSNorm and SwiGLU run engine/ops' fused Triton kernels (same fp32 statistics;
RMSNorm rounds once after the weight multiply, so bf16 results may differ from Hugging Face by one
ulp). Everywhere else, and for the ops not yet switched (RoPE keeps this layout's cos/sin tables),
the plain-PyTorch references below run; they follow Hugging Face's arithmetic order exactly so fp32
logits match transformers to rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim; statistics in fp32, output in x's dtype."""
    if x.is_cuda:
        from engine.ops.rmsnorm import rms_norm as fused_rms_norm

        return fused_rms_norm(x, weight, eps)
    dtype = x.dtype
    xf = x.to(torch.float32)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * rstd).to(dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dim: (..., 2f) -> (..., f)."""
    if gate_up.is_cuda:
        from engine.ops.swiglu import swiglu as fused_swiglu

        return fused_swiglu(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu(x: torch.Tensor, *, approximate: str) -> torch.Tensor:
    """GeLU; ``approximate="tanh"`` is Hugging Face's gelu_new / gelu_pytorch_tanh."""
    return F.gelu(x, approximate=approximate)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, *, dtype: torch.dtype):
    """cos and sin, (s, b, 1, head_dim), for ``position_ids`` (b, s); computed in fp32, cast to dtype."""
    freqs = position_ids.t().to(torch.float32).unsqueeze(-1) * inv_freq.to(torch.float32)  # (s, b, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)  # (s, b, 1, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: ``x * cos + rotate_half(x) * sin``; x (s, b, heads, hd), cos/sin (s, b, 1, hd)."""
    return x * cos + _rotate_half(x) * sin


def dropout(x: torch.Tensor, p: float, *, training: bool) -> torch.Tensor:
    return F.dropout(x, p=p, training=training) if training and p > 0 else x
