"""Multi-tensor fused AdamW over lists of fp32 tensors (native: csrc/adamw -> engine._adamw).

Math and operation order are those of ``torch.optim.AdamW(foreach=False)`` (decoupled weight
decay, bias correction), step counted from 1:

    p  = p * (1 - lr * weight_decay)
    m  = lerp(m, g, 1 - beta1)
    v  = v * beta2 + (1 - beta2) * g * g
    p  = p - lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

The native kernel updates every tensor of the lists in a few launches (CUDA) or one parallel loop
(CPU) and can write a bf16 copy of each updated parameter (``bf16_out``) in the same pass - the
model weights of bf16 training with fp32 master weights.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from engine import _native

_OP = "fused_adamw_"
_BACKENDS = ("auto", "native", "reference")


def fused_adamw_reference_(params: Sequence[Tensor], grads: Sequence[Tensor],
                           exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor], *, lr: float,
                           beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                           bf16_out: Optional[Sequence[Tensor]] = None) -> None:
    """Plain-PyTorch version of :func:`fused_adamw_` (same in-place promises), one tensor at a time."""
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    step_size = lr / bias_correction1
    with torch.no_grad():
        for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
            if weight_decay != 0:
                p.mul_(1 - lr * weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(m, denom, value=-step_size)
            if bf16_out is not None:
                bf16_out[i].copy_(p)


def _check_hyper(lr, beta1, beta2, eps, weight_decay, step) -> None:
    if not lr >= 0.0:
        raise ValueError(f"{_OP}: lr={lr} must be >= 0.")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{_OP}: {name}={beta} must be in [0, 1) (typically 0.9 / 0.95).")
    if not eps > 0.0:
        raise ValueError(f"{_OP}: eps={eps} must be > 0 (typically 1e-8).")
    if not weight_decay >= 0.0:
        raise ValueError(f"{_OP}: weight_decay={weight_decay} must be >= 0.")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{_OP}: step={step!r} must be an int >= 1 (the step being taken, from 1).")


def fused_adamw_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                 exp_avg_sqs: Sequence[Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, step: int, bf16_out: Optional[Sequence[Tensor]] = None,
                 backend: str = "auto") -> None:
    """One AdamW step, in place, over lists of tensors (params[i] pairs with grads[i], ...).

    params/grads/exp_avgs/exp_avg_sqs: float32, contiguous, one device, matching shapes.
    bf16_out: optional bfloat16 tensors of the params' shapes that receive the updated params.
    backend: "native" (engine._adamw; CUDA kernel or C++ loop by device), "reference" (PyTorch),
    or "auto" (native when built - see ``engine.native_status()`` - else reference).
    Bad inputs raise ValueError naming the list, the index and the fix; nothing is written then.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"{_OP}: backend={backend!r} is not one of {_BACKENDS}.")
    _check_hyper(lr, beta1, beta2, eps, weight_decay, step)
    lists = dict(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    if bf16_out is not None:
        lists["bf16_out"] = bf16_out
    for name, seq in lists.items():
        if not isinstance(seq, (list, tuple)) or not all(isinstance(t, Tensor) for t in seq):
            raise ValueError(f"{_OP}: {name} must be a list of tensors, got {type(seq).__name__}.")
    native = backend == "native" or (backend == "auto" and _native.available("adamw"))
    if native:
        _native.load("adamw").fused_adamw_(
            list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
            None if bf16_out is None else list(bf16_out), float(lr), float(beta1), float(beta2),
            float(eps), float(weight_decay), int(step))
        return
    _check_reference_inputs(lists)
    fused_adamw_reference_(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2,
                           eps=eps, weight_decay=weight_decay, step=step, bf16_out=bf16_out)


def _check_reference_inputs(lists: dict) -> None:
    """The native checks, for the reference path (so both backends reject the same inputs)."""
    params = lists["params"]
    for name, seq in lists.items():
        if len(seq) != len(params):
            raise ValueError(f"{_OP}: {name} has {len(seq)} tensors but params has {len(params)}; "
                             "pass one per parameter, in the same order.")
        want = torch.bfloat16 if name == "bf16_out" else torch.float32
        for i, (t, p) in enumerate(zip(seq, params)):
            if t.dtype != want:
                raise ValueError(f"{_OP}: {name}[{i}] is {t.dtype}; expected {want}.")
            if t.device != params[0].device:
                raise ValueError(f"{_OP}: {name}[{i}] is on {t.device} but params[0] is on "
                                 f"{params[0].device}; keep all optimizer tensors on one device.")
            if t.shape != p.shape:
                raise ValueError(f"{_OP}: {name}[{i}] has shape {tuple(t.shape)} but params[{i}] has "
                                 f"{tuple(p.shape)}; they must match.")
