"""Fused ops, one file per op. A leaf package: imports torch/triton and engine._native only.

Each op file holds a plain-PyTorch reference, Triton forward/backward kernels, torch.library custom
ops (so torch.compile sees them as opaque nodes with fake and autograd rules), a module, and the
dispatch (``backend="auto"|"triton"|"reference"``: Triton on CUDA tensors, the reference
elsewhere). See docs/ops.md.
"""
from engine.ops.fused_adamw import fused_adamw_, fused_adamw_reference_
from engine.ops.fused_linear_ce import (FusedLinearCrossEntropy, fused_linear_cross_entropy,
                                        linear_cross_entropy_reference)
from engine.ops.rmsnorm import RMSNorm, rms_norm, rms_norm_reference
from engine.ops.rope import (RotaryEmbedding, apply_rope, apply_rope_reference, rope_cos_sin,
                             rope_inv_freq)
from engine.ops.swiglu import SwiGLU, swiglu, swiglu_reference

__all__ = [
    "FusedLinearCrossEntropy", "RMSNorm", "RotaryEmbedding", "SwiGLU", "apply_rope",
    "apply_rope_reference", "fused_adamw_", "fused_adamw_reference_", "fused_linear_cross_entropy",
    "linear_cross_entropy_reference", "rms_norm", "rms_norm_reference", "rope_cos_sin",
    "rope_inv_freq", "swiglu", "swiglu_reference",
]
