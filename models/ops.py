"""The element-wise ops of the models, one function each, with the kernel dispatch.

``backend`` (the ``kernels`` option of :func:`models.build_model`, ``model.kernels`` in the run config):

* ``"auto"``      - engine/ops' fused Triton kernels on CUDA tensors, the references below elsewhere;
* ``"triton"``    - always the Triton kernels (on CPU tensors they run in Triton's interpreter: slow,
                    for tests on tiny models);
* ``"reference"`` - always the plain-PyTorch references below.

The references follow Hugging Face's arithmetic order exactly, so fp32 logits match transformers to
rounding. The fused kernels compute the same fp32 statistics but round once at the end (RMSNorm
after the weight multiply, RoPE after the rotation), so bf16 results may differ from Hugging Face by
one ulp; fp32 results agree to rounding (tests/models/test_kernels_in_models.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops import BACKENDS
from engine.ops._triton import use_triton
from engine.ops.rmsnorm import rms_norm as fused_rms_norm
from engine.ops.rope import apply_rope as fused_apply_rope, rope_cos_sin
from engine.ops.swiglu import swiglu as fused_swiglu


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"kernels={backend!r} is not one of {BACKENDS}: 'auto' runs the fused Triton "
                         "kernels on CUDA and the PyTorch references elsewhere; 'triton' or 'reference' "
                         "forces one of them")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             backend: str = "auto"):
    """``weight * h / sqrt(mean(h^2) + eps)`` over the last dim, with ``h = x`` or, when ``residual``
    is given, ``h = x + residual`` (then returns ``(y, h)``: the new residual stream too).
    Statistics in fp32, output in x's dtype."""
    if use_triton(backend, x, op="rms_norm"):
        return fused_rms_norm(x, weight, eps, residual=residual, backend="triton")
    h = x if residual is None else residual + x
    dtype = h.dtype
    hf = h.to(torch.float32)
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * (hf * rstd).to(dtype)
    return y if residual is None else (y, h)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def swiglu(gate_up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dim: (..., 2f) -> (..., f)."""
    if use_triton(backend, gate_up, op="swiglu"):
        return fused_swiglu(gate_up, backend="triton")
    gate, up = gate_up.chunk(2, dim=-1)  # (..., f) each
    return F.silu(gate) * up


def gelu(x: torch.Tensor, *, approximate: str) -> torch.Tensor:
    """GeLU; ``approximate="tanh"`` is Hugging Face's gelu_new / gelu_pytorch_tanh."""
    return F.gelu(x, approximate=approximate)


class RopeTables:
    """The rotary angles of one forward pass, shared by every layer.

    ``cos``/``sin``: compact float32 ``(s, hd/2)`` (positions shared by the batch) or ``(s, b, hd/2)``,
    what the fused kernel reads. :meth:`expanded` gives Hugging Face's repeated tables
    ``(s, b|1, 1, hd)`` in the activation dtype for the reference, built once per dtype.
    """

    def __init__(self, position_ids: torch.Tensor, inv_freq: torch.Tensor):
        # position_ids (b, s) or (1, s) -> (s, b) or (s,)
        positions = position_ids[0] if position_ids.shape[0] == 1 else position_ids.t()
        self.cos, self.sin = rope_cos_sin(positions, inv_freq)  # (s[, b], hd/2) fp32 each
        self._expanded: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_tables(cls, cos: torch.Tensor, sin: torch.Tensor) -> "RopeTables":
        """Tables around given compact ``cos``/``sin`` (e.g. a CUDA graph's static inputs, models/cuda_graphs.py)."""
        tables = cls.__new__(cls)
        tables.cos, tables.sin, tables._expanded = cos, sin, {}
        return tables

    def expanded(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._expanded:
            def full(t):
                t = torch.cat([t, t], dim=-1)  # (s[, b], hd)
                t = t[:, None, None, :] if t.dim() == 2 else t[:, :, None, :]  # (s, b|1, 1, hd)
                return t.to(dtype)
            self._expanded[dtype] = full(self.cos), full(self.sin)
        return self._expanded[dtype]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # (..., hd/2) each
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, tables: RopeTables, *, backend: str = "auto"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q (s, b, nh, hd) and k (s, b, nkv, hd); one launch for both when fused."""
    if use_triton(backend, q, op="apply_rope"):
        return fused_apply_rope(q, k, tables.cos, tables.sin, backend="triton")
    cos, sin = tables.expanded(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def dropout(x: torch.Tensor, p: float, *, training: bool) -> torch.Tensor:
    return F.dropout(x, p=p, training=training) if training and p > 0 else x
