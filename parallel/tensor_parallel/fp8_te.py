"""``model.fp8_backend = "te"``: Transformer Engine, behind one guarded import.

Status: only the import guard and the recipe mapping exist. Transformer Engine cannot be installed
on Tessel's build machines (its wheels need a CUDA torch and cuDNN; the core wheel is larger than a
lent GPU accepts), so TE-backed parallel linears have never been built or run here, and this
backend is rejected with a message saying so rather than shipped untested. docs/fp8.md says what
it would map to. Tessel's own FP8 (``fp8_backend = "tessel"``) needs no TE.
"""
from __future__ import annotations

INSTALL_HINT = ("pip install --no-build-isolation 'transformer_engine[pytorch]' on a CUDA machine, or set "
                "model.fp8_backend = 'tessel' (Tessel's own FP8 linears, no TE needed)")

# Tessel recipe -> the Transformer Engine recipe class it maps to (transformer_engine.common.recipe).
TE_RECIPES = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling",
              "blockwise": "Float8BlockScaling", "mxfp8": "MXFP8BlockScaling"}


def import_te():
    """``transformer_engine.pytorch``, or an ImportError naming the fix (the one guarded import)."""
    try:
        import transformer_engine.pytorch as te  # noqa: F401
    except Exception as e:  # ImportError, or TE's own errors when CUDA/cuDNN are missing
        raise ImportError(f"model.fp8_backend = 'te' needs Transformer Engine, which cannot be imported here "
                          f"({type(e).__name__}: {e}); {INSTALL_HINT}") from None
    return te


def te_backend(recipe: str) -> None:
    """Check ``model.fp8_backend = 'te'`` before any process group: raises with the fix."""
    if recipe not in TE_RECIPES:
        raise ValueError(f"model.fp8 = {recipe!r} has no Transformer Engine recipe (TE maps "
                         f"{', '.join(k for k in TE_RECIPES if k != 'mxfp8')}); use model.fp8_backend = 'tessel'")
    import_te()
    raise ValueError("model.fp8_backend = 'te': Transformer Engine imports, but this Tessel build has no TE-backed "
                     "parallel linears (never built: TE cannot be installed where Tessel is tested; see "
                     "docs/fp8.md); set model.fp8_backend = 'tessel'")
