"""Shared helpers for the fused-op tests.

Triton on CPU: tests call the ops with ``backend="triton"`` on CPU tensors, which runs the Triton
*interpreter*. ``engine.ops._triton.Kernel`` picks the interpreter per launch from the tensors'
device, so these tests do not need ``TRITON_INTERPRET=1`` and do not depend on import order. This
conftest deliberately does NOT set ``TRITON_INTERPRET=1``: Triton reads it when ``triton`` is first
imported, so setting it would turn every Triton function in this pytest process (Triton's own
``tl.sum``/``tl.max`` included) into interpreter objects - which breaks the sm_90 compile-only check
of the kernels (test_triton_compile.py) and any other test that compiles Triton code. Running the
whole suite with ``TRITON_INTERPRET=1`` exported still works: the ops then interpret everything and
the compile-only check skips itself with that reason.
"""
from __future__ import annotations

import pytest
from triton.runtime.jit import JITFunction


@pytest.fixture(autouse=True)
def _interpreter_patch_is_scoped():
    """An interpreted launch reroutes JITFunction.__call__ only while it runs; check it is restored."""
    original = JITFunction.__call__
    yield
    assert JITFunction.__call__ is original, "an interpreted Triton launch leaked its JITFunction patch"
