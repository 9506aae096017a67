"""Flat parameter and gradient buffers, cut into buckets for the data-parallel reduction.

Layout (one :class:`ParamAndGradBuffer` per parameter dtype):

* Parameters are placed in **reverse registration order**: backward produces gradients roughly in
  reverse order of the forward, and registration order is the usual proxy for forward order (true
  for sequential stacks: embedding, layer 0, ..., layer L-1, head). A bucket therefore fills up
  early in backward and its reduction can start while the rest of backward runs.
* A bucket is closed as soon as it holds ``bucket_size`` elements or more; a parameter is never
  split across buckets, so one large parameter can make a bucket larger than ``bucket_size``.
* Each bucket's length is padded up to a multiple of ``dp * align`` so a reduce-scatter gives every
  rank an equal, ``align``-element aligned shard. Padding elements are zero and never updated.
* Every parameter's storage becomes a view into the flat buffer of its dtype (``p.data = view``:
  the parameter keeps its own autograd version counter, so writing other parameters' slices of the
  buffer never trips autograd's saved-tensor checks).
* Gradients accumulate in fp32 ``p.main_grad`` views into a flat fp32 buffer with the same layout,
  whatever the parameter dtype. With ``grads="lazy"`` (ZeRO-2) there is no persistent full buffer:
  each bucket allocates its fp32 gradients when its first gradient arrives and frees them once
  its reduce-scatter has completed (see :mod:`parallel.data_parallel.ddp`).
* ZeRO-3 (``shard_params=True``): ``param_data`` holds only this rank's ``1/dp`` of each bucket
  (bucket ``b``'s shard at ``[b.start/dp, b.end/dp)``). Each bucket keeps a full-size tensor
  ``bucket.full`` whose *storage* is allocated while the bucket is gathered and resized to zero
  bytes otherwise; every parameter's storage is a view into it. Views that autograd saved in
  forward (``weight.t()``...) share that storage, so re-gathering into it before backward makes
  them valid again without touching the graph (:mod:`parallel.data_parallel.zero3`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

MB = 1024 * 1024
GRAD_DTYPE = torch.float32


def bucket_size_elements(*, bucket_size: int | None, bucket_size_mb: float | None) -> int | None:
    """Resolve the bucket size in elements from exactly one of the two arguments (or neither).

    ``bucket_size_mb`` counts bytes of the fp32 gradient buffer (4 bytes per element). ``None`` for
    both means one bucket per buffer (no overlap possible).
    """
    if bucket_size is not None and bucket_size_mb is not None:
        raise ValueError(f"bucket_size={bucket_size} and bucket_size_mb={bucket_size_mb} are both set; "
                         "give one of them (elements or MB of fp32 gradients)")
    if bucket_size is not None:
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ValueError(f"bucket_size={bucket_size!r} must be a positive number of elements, "
                             "e.g. 40_000_000, or None for a single bucket")
        return bucket_size
    if bucket_size_mb is not None:
        if not (isinstance(bucket_size_mb, (int, float)) and math.isfinite(bucket_size_mb) and bucket_size_mb > 0):
            raise ValueError(f"bucket_size_mb={bucket_size_mb!r} must be a positive number of MB "
                             "(of fp32 gradients), e.g. 25, or None for a single bucket")
        return max(1, int(bucket_size_mb * MB) // GRAD_DTYPE.itemsize)
    return None


@dataclass(frozen=True)
class BucketPlan:
    """Where each bucket lies in the flat buffer: ``[start, end)``, padded to ``(end - start) % (dp*align) == 0``.

    ``members`` are indices into the ``numels`` list passed to :func:`plan_buckets`.
    """

    index: int
    start: int
    end: int
    members: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


def plan_buckets(numels: Sequence[int], *, bucket_size: int | None, dp: int, align: int = 1,
                 separate: Sequence[bool] | None = None,
                 groups: Sequence[int] | None = None) -> tuple[list[tuple[int, int]], list[BucketPlan], int]:
    """Lay out tensors (given in placement order) in buckets. Pure function.

    Returns ``(offsets, buckets, total)``: ``offsets[i] = (start, end)`` of tensor ``i`` in the flat
    buffer, the buckets in placement order, and the padded buffer length. ``separate[i]`` puts
    tensor ``i`` in a bucket of its own (used for gradients that must be reduced later, e.g. a tied
    embedding whose pipeline-stage copies are summed first). ``groups[i]`` (e.g. the model chunk of
    tensor ``i``): a bucket never holds tensors of two groups, so each group can be reduced on its own.
    """
    if dp < 1 or align < 1:
        raise ValueError(f"dp={dp} and align={align} must be >= 1")
    if bucket_size is not None and bucket_size <= 0:
        raise ValueError(f"bucket_size={bucket_size} must be a positive number of elements")
    quantum = dp * align
    offsets: list[tuple[int, int]] = []
    buckets: list[BucketPlan] = []
    start, cursor, members = 0, 0, []

    def close():
        nonlocal start, cursor, members
        end = start + -(-(cursor - start) // quantum) * quantum  # round up to the quantum
        buckets.append(BucketPlan(index=len(buckets), start=start, end=end, members=tuple(members)))
        start = cursor = end
        members = []

    for i, n in enumerate(numels):
        alone = bool(separate[i]) if separate is not None else False
        new_group = groups is not None and members and groups[members[-1]] != groups[i]
        if (alone or new_group) and members:
            close()
        offsets.append((cursor, cursor + n))
        cursor += n
        members.append(i)
        if alone or (bucket_size is not None and cursor - start >= bucket_size):
            close()
    if members:
        close()
    return offsets, buckets, start


@dataclass(eq=False)
class Bucket:
    """One bucket of one buffer and its communication state for the current step.

    ``start``/``end`` are offsets in the buffer; ``params`` and ``ranges`` (bucket-relative
    ``[start, end)`` of each parameter) are in placement order. ``grad`` is this bucket's fp32
    gradient region (``None`` while a lazy bucket is not allocated). ``shard_grad`` holds the reduced
    gradient of the rank's own shard after the reduction (the whole bucket when not sharded).
    """

    index: int
    start: int
    end: int
    params: list[torch.nn.Parameter]
    ranges: list[tuple[int, int]]
    deferred: bool = False
    group: int = 0  # the model chunk its parameters belong to
    grad: torch.Tensor | None = None
    shard_grad: torch.Tensor | None = None
    pending: set[int] = field(default_factory=set)
    state: str = "open"  # "open" -> "launched" -> "done" -> (reset) "open"
    work: object = None
    out: torch.Tensor | None = None
    gather_work: object = None
    gather_out: torch.Tensor | None = None
    # ZeRO-3: the gathered parameters (storage freed when not gathered: never in a repr)
    full: torch.Tensor | None = field(default=None, repr=False)
    unit: int = -1  # ZeRO-3: the gather unit (a layer, or a chunk's other parameters) it belongs to

    @property
    def numel(self) -> int:
        return self.end - self.start

    def reset_pending(self) -> None:
        self.pending = {id(p) for p in self.params}


class ParamAndGradBuffer:
    """Flat storage for the parameters of one dtype and their fp32 gradients.

    Promises: ``param_data`` (dtype of the parameters, length ``numel`` incl. padding) backs every
    parameter; with ``grads="full"`` ``grad_data`` (fp32, same length) backs every ``p.main_grad``.
    Parameters are given in registration order and placed in reverse (see the module docstring).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], *, dtype: torch.dtype, bucket_size: int | None,
                 dp: int, align: int, grads: str, separate: Sequence[bool] | None = None,
                 groups: Sequence[int] | None = None, shard_params: bool = False):
        if grads not in ("full", "lazy"):
            raise ValueError(f"grads={grads!r}: use 'full' (persistent fp32 buffer) or 'lazy' (per bucket)")
        if shard_params and grads != "lazy":
            raise ValueError("shard_params=True (ZeRO-3) keeps no full gradient buffer: use grads='lazy'")
        if not params:
            raise ValueError("ParamAndGradBuffer needs at least one parameter")
        placed = list(reversed(list(params)))  # placement order = expected gradient order
        sep = list(reversed(list(separate))) if separate is not None else None
        grp = list(reversed(list(groups))) if groups is not None else None
        offsets, plans, total = plan_buckets([p.numel() for p in placed], bucket_size=bucket_size, dp=dp,
                                             align=align, separate=sep, groups=grp)
        device = placed[0].device
        self.dtype = dtype
        self.numel = total
        self.numel_unpadded = sum(p.numel() for p in placed)
        self.lazy = grads == "lazy"
        self.device = device
        self.dp = dp
        self.shard_params = shard_params
        self.grad_data = None if self.lazy else torch.zeros(total, dtype=GRAD_DTYPE, device=device)
        # ZeRO-3: no flat buffer of the full parameters; each bucket gets a tensor of its own (its
        # storage is freed by shard_out() and re-allocated by each gather), param_data comes later.
        fulls = ([torch.zeros(plan.numel, dtype=dtype, device=device) for plan in plans] if shard_params
                 else None)
        self.param_data = None if shard_params else torch.zeros(total, dtype=dtype, device=device)
        bucket_of = {i: k for k, plan in enumerate(plans) for i in plan.members}
        self.offsets: dict[int, tuple[int, int]] = {}
        with torch.no_grad():
            for i, (p, (s, e)) in enumerate(zip(placed, offsets)):
                assert p.dtype == dtype and p.device == device, (p.dtype, p.device)
                if shard_params:
                    k = bucket_of[i]
                    view = fulls[k][s - plans[k].start:e - plans[k].start]
                else:
                    view = self.param_data[s:e]
                view.copy_(p.data.view(-1))
                p.data = view.view(p.shape)
                self.offsets[id(p)] = (s, e)
                if not self.lazy:
                    p.main_grad = self.grad_data[s:e].view(p.shape)
                else:
                    p.main_grad = None
        self.buckets: list[Bucket] = []
        for k, plan in enumerate(plans):
            members = [placed[i] for i in plan.members]
            b = Bucket(index=plan.index, start=plan.start, end=plan.end, params=members,
                       ranges=[(offsets[i][0] - plan.start, offsets[i][1] - plan.start) for i in plan.members],
                       deferred=bool(sep is not None and any(sep[i] for i in plan.members)),
                       group=grp[plan.members[0]] if grp is not None else 0,
                       full=fulls[k] if shard_params else None)
            if not self.lazy:
                b.grad = self.grad_data[plan.start:plan.end]
            b.reset_pending()
            self.buckets.append(b)

    def shard_out(self, dp_rank: int) -> None:
        """ZeRO-3: keep this rank's ``1/dp`` of every bucket in ``param_data`` and free the buckets'
        full parameters (call after the replicas agree, e.g. after the construction broadcast)."""
        assert self.shard_params and self.param_data is None
        self.param_data = torch.empty(self.numel // self.dp, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for b in self.buckets:
                n = b.numel // self.dp
                self.param_data[b.start // self.dp:b.end // self.dp].copy_(b.full[dp_rank * n:(dp_rank + 1) * n])
                free_storage(b.full)

    def param_region(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's slice of the parameter buffer (a view); ZeRO-3: its full (gathered) tensor."""
        return bucket.full if self.shard_params else self.param_data[bucket.start:bucket.end]

    def owned_params(self, bucket: Bucket, lo: int, hi: int) -> torch.Tensor:
        """This rank's owned range ``[lo, hi)`` (bucket-relative) of the parameters, as stored: a view
        of ``param_data`` (ZeRO-3: ``[lo, hi)`` is the rank's shard, kept in ``param_data`` itself)."""
        if self.shard_params:
            assert hi - lo == bucket.numel // self.dp, (lo, hi, bucket.numel)
            return self.param_data[bucket.start // self.dp:bucket.end // self.dp]
        return self.param_data[bucket.start + lo:bucket.start + hi]

    def allocate_bucket_grad(self, bucket: Bucket) -> None:
        """Lazy mode: give the bucket a zeroed fp32 gradient region and point ``main_grad`` into it."""
        assert self.lazy and bucket.grad is None
        bucket.grad = torch.zeros(bucket.numel, dtype=GRAD_DTYPE, device=self.param_data.device)
        for p, (s, e) in zip(bucket.params, bucket.ranges):
            p.main_grad = bucket.grad[s:e].view(p.shape)

    def release_bucket_grad(self, bucket: Bucket) -> None:
        """Lazy mode: drop the bucket's full fp32 gradients (its reduced shard lives elsewhere)."""
        assert self.lazy
        bucket.grad = None
        for p in bucket.params:
            p.main_grad = None


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s storage (its views stay valid objects of size zero bytes until re-allocated)."""
    if t.untyped_storage().nbytes():
        t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    """Give ``t`` (whose storage :func:`free_storage` released) its bytes back; contents undefined."""
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        assert t.storage_offset() == 0, "a ZeRO-3 bucket tensor owns its storage from offset 0"
        t.untyped_storage().resize_(nbytes)
