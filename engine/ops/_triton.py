"""Shared plumbing for the fused ops: backend choice, input checks, and dual-mode Triton kernels.

Backends (the ``backend=`` argument of every op):
  * ``"auto"``      - the Triton kernels for CUDA tensors, the plain-PyTorch reference otherwise.
  * ``"triton"``    - always the Triton kernels. On CPU tensors they run in the Triton *interpreter*
                      (numpy, one program at a time): correct but slow, meant for tests on small shapes.
  * ``"reference"`` - always the plain-PyTorch reference (autograd by PyTorch).

Why a dual kernel instead of relying on ``TRITON_INTERPRET=1`` alone: ``triton.jit`` reads that
variable once, when the decorated module is imported. In a pytest process whose other tests import
``engine.ops`` first (models do), the variable would arrive too late and ``backend="triton"`` on a
CPU tensor would crash. :class:`Kernel` keeps both the compiled kernel (CUDA tensors) and an
interpreted twin (CPU tensors) and picks by the device of the launch, so the result never depends on
import order. With ``TRITON_INTERPRET=1`` set at import, ``triton.jit`` itself returns the interpreter
and CUDA tensors are interpreted too (Triton's documented behaviour).
"""
from __future__ import annotations

import torch
import triton

from triton.runtime.jit import JITFunction

try:  # The interpreter is how TRITON_INTERPRET=1 is implemented (triton >= 3.0).
    from triton.runtime.interpreter import InterpretedFunction, _patch_lang
except ImportError:  # pragma: no cover - only on a Triton without the interpreter
    InterpretedFunction = _patch_lang = None

from engine.ops import BACKENDS


class Kernel:
    """A Triton kernel launchable on CUDA tensors (compiled) and CPU tensors (interpreted).

    Use as a decorator in place of ``@triton.jit``; launch with ``kernel.on(device)[grid](...)``.
    """

    def __init__(self, fn):
        self.fn = fn
        self.compiled = triton.jit(fn)
        self.interpreted = InterpretedFunction(fn) if InterpretedFunction is not None else None
        self.__name__ = fn.__name__

    def on(self, device: torch.device):
        if device.type == "cuda":
            return self.compiled
        if self.interpreted is None:  # pragma: no cover
            raise RuntimeError(
                f"Triton kernel {self.__name__} cannot run on {device}: this Triton has no "
                "interpreter. Use backend='reference' for CPU tensors.")
        return _InterpretedLaunch(self.interpreted)


class _InterpretedLaunch:
    """``kernel[grid](...)`` in the interpreter, also when Triton was imported without
    TRITON_INTERPRET=1. Then Triton's own library functions (tl.sum, tl.max, ...) are compiled-mode
    ``JITFunction`` objects, which refuse to be called from Python; for the duration of the launch
    (and only then) such calls are routed to an interpreted twin of the same function, which is
    what TRITON_INTERPRET=1 would have built at import time."""

    def __init__(self, interpreted):
        self.interpreted = interpreted

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            original = JITFunction.__call__
            JITFunction.__call__ = _call_interpreted_twin
            try:
                return self.interpreted[grid](*args, **kwargs)
            finally:
                JITFunction.__call__ = original
        return launch


def _call_interpreted_twin(jit_fn, *args, **kwargs):
    # What InterpretedFunction.__call__ does for a device-function call, except that the patches
    # it applies to triton.language(.core) are undone on return. (Triton's own call path leaves them
    # in place, which is harmless when everything is interpreted but would break every later
    # *compiled* kernel in this process.)
    twin = jit_fn.__dict__.get("_tessel_interpreted")
    if twin is None:
        twin = InterpretedFunction(jit_fn.fn)
        jit_fn.__dict__["_tessel_interpreted"] = twin
    scope = _patch_lang(twin.fn)
    try:
        return twin.rewrite()(*args, **kwargs)
    finally:
        scope.restore()


def check_backend(backend: str, *, op: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(
            f"{op}: backend={backend!r} is not one of {BACKENDS}; pass 'auto' (Triton on CUDA, "
            "reference elsewhere), 'triton' or 'reference'.")


def use_triton(backend: str, x: torch.Tensor, *, op: str) -> bool:
    """Resolve ``backend`` for input ``x``: True means launch the Triton kernels."""
    check_backend(backend, op=op)
    if backend == "auto":
        return x.device.type == "cuda"
    if backend == "triton" and x.device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"{op}: backend='triton' needs CUDA (compiled) or CPU (interpreter) tensors, got "
            f"{x.device}; use backend='reference'.")
    return backend == "triton"


def check_float(t: torch.Tensor, *, name: str, op: str) -> None:
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(
            f"{op}: {name} has dtype {t.dtype}; expected a floating dtype (float32, bfloat16, "
            "float16 or float64). Cast it with .float() or .bfloat16().")


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{op}: inputs are on different devices {devices}; move them to one device.")


def check_triton_dtype(t: torch.Tensor, *, name: str, op: str) -> None:
    # Triton has no fp64 arithmetic on most paths; the reference covers fp64.
    if t.dtype == torch.float64:
        raise ValueError(
            f"{op}: backend='triton' does not support float64 {name}; use backend='reference' "
            "for fp64 (e.g. numerical checks) or cast to float32/bfloat16.")


def num_warps_for(block: int) -> int:
    """Warps for a program that holds ``block`` elements per row: enough threads, few registers."""
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    if block >= 512:
        return 4
    return 2


def num_programs_for(rows: int, device: torch.device) -> int:
    """Programs for row-reduction kernels (one partial sum each): a few per SM on GPU, few on CPU."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(rows, 4 * sms))
    # The interpreter runs programs one after another: fewer programs means less Python overhead,
    # but keep more than one so multi-program reduction is exercised by the CPU tests.
    return max(1, min(rows, 4))
