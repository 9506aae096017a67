"""Loader for the native extensions built from csrc/ by setup.py.

Every ``csrc/<name>/`` directory becomes the module ``engine._<name>``. ``load(name)`` imports
it and, if it is missing, raises an error that says how to build it instead of an opaque
ImportError. This is the only place that imports compiled Tessel code.
"""
from __future__ import annotations

import importlib
import os
import sys

_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")


def components() -> list[str]:
    """Names of the native components present in the source tree (csrc/<name>/)."""
    if not os.path.isdir(_CSRC):
        return []
    return sorted(d for d in os.listdir(_CSRC) if os.path.isdir(os.path.join(_CSRC, d))
                  and any(f.endswith(".cpp") for f in os.listdir(os.path.join(_CSRC, d))))


def load(name: str):
    """Import ``engine._<name>``; raise ImportError naming the fix if it was not built. Hot paths (an
    FP8 cast per linear call) call this per call: an imported module is returned from sys.modules
    directly, without importlib's machinery."""
    mod = sys.modules.get(f"engine._{name}")
    if mod is not None:
        return mod
    import torch  # noqa: F401  (the extensions link against libtorch: load it first)

    try:
        return importlib.import_module(f"engine._{name}")
    except ImportError as err:
        raise ImportError(
            f"Tessel native extension 'engine._{name}' is not built ({err}). "
            "Build it with `bash tools/install.sh` (or `pip install --no-build-isolation -e .` "
            "after installing torch==2.13.0)."
        ) from err


def op(name: str, fn: str):
    """``engine._<name>.<fn>``; an extension built from older sources (pulled, not rebuilt) lacks new
    functions: that raises ImportError naming the rebuild, not an AttributeError deep in a training step."""
    f = getattr(load(name), fn, None)
    if f is None:
        raise ImportError(f"Tessel native extension 'engine._{name}' was built from older sources: it has no "
                          f"{fn!r}. Rebuild it with `bash tools/install.sh` (or `python setup.py build_ext --inplace`).")
    return f


def available(name: str) -> bool:
    try:
        load(name)
        return True
    except ImportError:
        return False


def has_cuda(name: str) -> bool:
    """True when engine._<name> was compiled with its CUDA sources (TESSEL_WITH_CUDA)."""
    try:
        mod = load(name)
    except ImportError:
        return False
    return bool(getattr(mod, "WITH_CUDA", False))
