"""Deferred weight gradients: the split backward of zero-bubble pipeline schedules (docs/pipeline.md).

A pipeline stage's backward is split into ``B`` (input gradients: what the previous stage waits for)
and ``W`` (weight gradients: nobody waits). The TP linears (:class:`DefaultLinearImpl`) take part:

* a forward run inside :func:`deferrable` builds each linear's matmul as :func:`linear` (an autograd
  Function that may defer its weight-gradient GEMM) instead of ``F.linear``;
* a backward run inside ``with capture(queue):`` computes the input gradient as usual (the TP / SP
  collectives are in the mappings around the matmul, so they stay in ``B``) but, instead of the
  weight-gradient GEMM, pushes ``(weight, input, grad_output)`` onto ``queue`` — only what that GEMM
  needs;
* ``queue.run()`` (``W``) does the GEMMs, sums them per weight and hands each sum to autograd's
  gradient accumulation of that weight (:class:`_Accumulate`), so ``.grad`` accumulates and every
  ``register_post_accumulate_grad_hook`` (data parallelism's bucket hooks) fires as in a plain backward;
  the queue then drops its tensors.

Outside ``capture`` a deferrable linear computes its weight gradient at once (the result is the same).
The symmetric-memory linears (parallel/tensor_parallel/symm_mem.py) defer theirs too. Biases, norms,
embeddings and any other layer (FP8, ring overlap, LoRA, experts, the fused linear + cross-entropy head)
get their gradients in ``B``.

The two switches are thread-local context managers (like ``torch.no_grad``), entered by the pipeline
runtime around one forward or one backward: no state outlives them.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

_state = threading.local()


@contextlib.contextmanager
def deferrable():
    """Forwards run inside build linears whose weight-gradient GEMM a later :func:`capture` may defer."""
    prev = getattr(_state, "deferrable", False)
    _state.deferrable = True
    try:
        yield
    finally:
        _state.deferrable = prev


def is_deferrable() -> bool:
    return getattr(_state, "deferrable", False)


class WgradQueue:
    """The deferred weight-gradient GEMMs of one (stage, micro-batch): filled by ``B``, run by ``W``."""

    def __init__(self):
        self.items: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self.items)

    def run(self) -> None:
        """Compute every deferred GEMM, accumulate each weight's sum through autograd (post-accumulate
        hooks fire once per weight), then release the held inputs and output gradients."""
        sums: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        with torch.no_grad():
            for weight, x, grad_out in self.items:
                g = grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))  # (out, in)
                prev = sums.get(id(weight))
                sums[id(weight)] = (weight, g if prev is None else prev[1] + g)
        self.items.clear()
        if sums:
            outs = [_Accumulate.apply(w, g) for w, g in sums.values()]
            torch.autograd.backward(outs)


@contextlib.contextmanager
def capture(queue: WgradQueue):
    """Backwards run inside push deferrable linears' weight-gradient GEMMs onto ``queue``. It is also
    :func:`deferrable`: a forward recomputed inside this backward (activation checkpointing) builds the
    same autograd Functions as the first pass, and its linears defer too."""
    prev = getattr(_state, "queue", None)
    _state.queue = queue
    try:
        with deferrable():
            yield
    finally:
        _state.queue = prev


class _Accumulate(torch.autograd.Function):
    """A 0-d output whose backward hands ``grad`` to ``weight``'s gradient accumulation."""

    @staticmethod
    def forward(ctx, weight, grad):
        ctx.save_for_backward(grad)
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        (grad,) = ctx.saved_tensors
        return grad, None


class _DeferrableLinear(torch.autograd.Function):
    """``x @ w.T + b``; the weight gradient is deferred to the active :func:`capture` queue, if any."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.matmul(weight)
        if ctx.needs_input_grad[1] and not defer_weight_grad(weight, x, grad_out):
            grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b


def defer_weight_grad(weight: torch.nn.Parameter, x: torch.Tensor, grad_out: torch.Tensor) -> bool:
    """Inside a backward: queue ``grad_out^T x`` (``x`` the linear's whole input) for ``weight`` on
    the active :func:`capture` queue and return True; without one return False (the caller computes
    the weight gradient now)."""
    queue = getattr(_state, "queue", None)
    if queue is None:
        return False
    queue.items.append((weight, x.detach(), grad_out.detach()))  # the tensors only, not their graphs
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or under :func:`deferrable` (and a weight that needs a gradient) the deferrable one."""
    if is_deferrable() and weight.requires_grad and torch.is_grad_enabled():
        return _DeferrableLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)
