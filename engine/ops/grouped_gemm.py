"""Grouped GEMM: the expert matmuls of a mixture-of-experts layer in one call.

Rows of ``x`` (n, k) come in contiguous groups, ``counts[g]`` rows for group g (an expert), in order;
``w`` (G, out, k) holds one weight per group, in ``nn.Linear`` orientation:

    y[rows of g] = x[rows of g] @ w[g]^T          shape (n, out), dtype of x

A group may have zero rows (its weight then gets a zero gradient). Backends:

* ``reference``: a loop over groups of ``F.linear`` (the CPU path, and the oracle of the test);
* ``torch``: ``torch._grouped_mm`` with cumulative row offsets (CUDA, sm90+, bf16; it also runs on CPU
  in torch builds that ship it). It needs 16-byte aligned row strides (k and out multiples of 8 in
  bf16, of 4 in fp32), else a ValueError names the sizes;
* ``auto``: ``torch`` on CUDA tensors in bf16 when aligned and ``torch._grouped_mm`` exists, else
  ``reference``.

No Triton kernel of our own: ``torch._grouped_mm`` is the CUTLASS grouped GEMM torch ships.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

GROUPED_BACKENDS = ("auto", "torch", "reference")


def grouped_mm_reference(x: Tensor, w: Tensor, counts: Sequence[int]) -> Tensor:
    """Loop over the groups; same promises as :func:`grouped_mm`."""
    outs, start = [], 0
    for g, n in enumerate(counts):
        outs.append(F.linear(x[start:start + n], w[g]))  # (n_g, out)
        start += n
    return torch.cat(outs, dim=0) if outs else x.new_zeros(0, w.shape[1])


def has_torch_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


def _aligned(x: Tensor, w: Tensor) -> bool:
    size = x.element_size()
    return (x.shape[1] * size) % 16 == 0 and (w.shape[1] * size) % 16 == 0


def grouped_mm(x: Tensor, w: Tensor, counts: Sequence[int], *, backend: str = "auto") -> Tensor:
    """``x`` (n, k) rows grouped by ``counts`` (G entries, summing to n), ``w`` (G, out, k) -> (n, out)."""
    if backend not in GROUPED_BACKENDS:
        raise ValueError(f"grouped_mm backend={backend!r}: use one of {GROUPED_BACKENDS}")
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1] or len(counts) != w.shape[0]:
        raise ValueError(f"grouped_mm needs x (n, k), w (G, out, k) and G counts; got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}, {len(counts)} counts")
    if sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_mm: counts sum to {sum(counts)} but x has {x.shape[0]} rows")
    if backend == "auto":
        backend = ("torch" if x.is_cuda and x.dtype == torch.bfloat16 and has_torch_grouped_mm() and _aligned(x, w)
                   else "reference")
    if backend == "reference":
        return grouped_mm_reference(x, w, counts)
    if not has_torch_grouped_mm():
        raise ValueError("grouped_mm backend='torch' needs torch._grouped_mm (torch >= 2.8); use backend='reference'")
    if not _aligned(x, w):
        raise ValueError(f"grouped_mm backend='torch' needs 16-byte aligned rows: k={x.shape[1]} and out={w.shape[1]} "
                         f"times {x.element_size()} bytes; pad the sizes or use backend='reference'")
    offs = torch.tensor(counts, dtype=torch.int64, device=x.device).cumsum(0).to(torch.int32)  # (G,) row ends
    return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)  # (n, out)
