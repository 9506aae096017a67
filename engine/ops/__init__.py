"""Fused ops, one file per op. A leaf package: imports torch/triton and engine._native only.

Each op file holds a plain-PyTorch reference, Triton forward/backward kernels, torch.library custom
ops (so torch.compile sees them as opaque nodes with fake and autograd rules), a module, and the
dispatch (``backend="auto"|"triton"|"reference"``: Triton on CUDA tensors, the reference
elsewhere). See docs/ops.md. Import from the op's module, e.g.
``from engine.ops.rmsnorm import rms_norm``; nothing is re-exported here, so that importing one op
(or the Triton-free ``engine.ops.fused_adamw``) does not import the others, and so that no
function shadows its module's name (``engine.ops.swiglu`` is the module).

    engine.ops.rmsnorm          rms_norm, RMSNorm, rms_norm_reference
    engine.ops.swiglu           swiglu, SwiGLU, swiglu_reference
    engine.ops.rope             apply_rope, rope_cos_sin, rope_inv_freq, RotaryEmbedding
    engine.ops.fused_linear_ce  fused_linear_cross_entropy, FusedLinearCrossEntropy,
                                linear_cross_entropy_reference
    engine.ops.fused_adamw      fused_adamw_, fused_adamw_reference_
    engine.ops.fp8_cast_transpose  fp8_cast_transpose, fp8_cast_transpose_reference, fp8_cast_transpose_grid(_reference)
    engine.ops.fp8_linear       fp8_linear, DelayedScaling, scaled_gemm, scaled_gemm_reference (FP8 recipes
                                on torch._scaled_mm; docs/fp8.md)
    engine.ops.grouped_gemm     grouped_mm, grouped_mm_reference (MoE experts over torch._grouped_mm)
    engine.ops.cute_fp8_gemm    fp8_gemm, fp8_gemm_reference, compile_fp8_gemm  (CuTe DSL, optional
                                extra ``cute``; cutlass is imported only when the kernel is used)

The one constant defined here, ``BACKENDS``, is the ``backend=`` choice of the Triton ops, shared with
the models' ``kernels=`` option and the run config's ``model.kernels`` (importable without Triton).
"""

BACKENDS = ("auto", "triton", "reference")
