"""Data parallelism with bucketed gradient reduction overlapped with backward.

:class:`DataParallel` wraps a module whose replicas (one per rank of ``dp_group``) see different
micro-batches. It

* moves every trainable parameter into a flat buffer per dtype and gives it an fp32
  ``p.main_grad`` (see :mod:`parallel.data_parallel.buffers`);
* hooks each parameter's gradient accumulation (``register_post_accumulate_grad_hook``): the
  hook adds ``p.grad`` into ``p.main_grad`` and frees ``p.grad``;
* on the last micro-batch only (outside :meth:`no_sync`), launches an asynchronous reduction of a
  bucket as soon as all of its gradients are final, while backward continues; micro-batches inside
  :meth:`no_sync` only accumulate, with no communication;
* :meth:`finish_grad_sync` launches what is left and waits for everything before the optimizer.

Model chunks (interleaved pipelines): with ``chunks=True`` the module is a ``ModuleList`` of the
rank's virtual stages; no bucket spans two chunks, and :meth:`enable_grad_sync` (``chunk``) turns on
the reduction of one chunk's buckets for its last backward while the other chunks still accumulate,
so every chunk's reduction overlaps the backward of the others.

Reduction (``zero_stage``):

* ``0``: all-reduce of each bucket; every rank holds the full reduced gradient.
* ``1``: reduce-scatter of each bucket into the rank's own shard (``1/dp`` of each bucket, a
  contiguous range); the full fp32 gradient buffer stays allocated (needed to accumulate over
  micro-batches without communication) but only the shard is valid afterwards.
* ``2``: as 1, but no persistent full fp32 buffer: a bucket's fp32 gradients exist from its first
  gradient until its reduce-scatter completes, and only the shard (``4 * numel / dp`` bytes) is
  kept. With ``max_inflight_buckets=k`` backward waits for older reductions so that at most ``k``
  buckets are in flight; together with the buckets being filled that bounds the transient fp32
  gradient memory. With gradient accumulation (several micro-batches) every bucket is allocated
  from the first micro-batch on, so the peak is the full buffer again: skipping communication
  during accumulation and never materialising the full fp32 gradient exclude each other.
* ``3``: as 2, and the parameters too are sharded: each rank keeps ``1/dp`` of every bucket and
  gathers a layer's parameters before its forward and again before its backward, prefetching the
  next layer's (:mod:`parallel.data_parallel.zero3`). Every micro-batch's gradients are
  reduce-scattered as soon as a bucket is complete and added into the fp32 shard (``no_sync`` and
  ``enable_grad_sync`` do not apply: the full gradient never persists). Buckets never span two
  units (layers, or a chunk's other parameters).

Average vs sum: with ``grad_reduce="mean"`` (default) the reduced gradient is divided by the
size of ``dp_group``, so if each micro-batch loss is a mean over its samples and the caller scales
it by ``1/num_microbatches``, the result equals the gradient of the mean loss over the global batch
on one process. ``"sum"`` skips the division (for losses normalised by a global token count).

Ordering contract: collectives on a group must be issued in the same order on every rank, so all
ranks must run the same graph (the same parameters receive gradients, in the same order).

Parameters with ``p.sequence_parallel = True`` (replicated over TP, gradients partial under sequence
parallelism) have their bucket's gradients all-reduced over ``tp_group`` just before the bucket's
data-parallel reduction (one coalesced all-reduce per bucket). Parameters with
``p.shared_embedding = True`` or ``p.defer_grad_reduce = True`` get buckets of their own that are
reduced only in :meth:`finish_grad_sync`, so the caller can first sum tied copies across
pipeline stages into ``p.main_grad`` (doing that inside backward hooks could deadlock the pipeline).

Expert parallelism (``expert_group``): parameters with ``p.expert = True`` live in buffers of their own
whose buckets are reduced over ``expert_group`` (the edp ranks that hold the same experts) instead of
``dp_group``, with the same ``1 / dp_group.size`` average: each expert's gradient already sums the
tokens the whole ep group routed to it, so summing over edp and dividing by dp gives the global mean
(docs/moe.md). Under ZeRO each set is sharded within its own group: an expert buffer's buckets are padded
to a multiple of the edp size, reduce-scattered over edp into ``1/edp`` shards (the optimizer state of
those shards), and its parameters all-gathered (ZeRO-3: gathered per unit) over edp; the dense buffers
over dp as before. Every dp rank then holds a distinct piece of the expert set (its ep rank's experts,
its edp shard of them), so a sum over the dp group counts every expert element once.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

from parallel import comm
from parallel.comm import Group
from parallel.data_parallel.buffers import GRAD_DTYPE, Bucket, ParamAndGradBuffer, bucket_size_elements
from parallel.data_parallel.zero3 import Gatherer, Unit, find_units

DEFAULT_BUCKET_MB = 25.0


def num_microbatches(global_batch_size: int, micro_batch_size: int, dp: int) -> int:
    """Micro-batches each data-parallel rank runs per step: ``global / (micro * dp)``, exactly."""
    for name, v in (("global_batch_size", global_batch_size), ("micro_batch_size", micro_batch_size), ("dp", dp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an integer >= 1")
    per_step = micro_batch_size * dp
    if global_batch_size % per_step:
        lo = max(per_step, global_batch_size // per_step * per_step)
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by micro_batch_size * dp = "
                         f"{micro_batch_size} * {dp} = {per_step}; use a multiple of {per_step} "
                         f"(e.g. {lo} or {lo + per_step}) or change micro_batch_size/dp")
    return global_batch_size // per_step


def _weak_grad_hook(ddp_ref, key: int):
    """The hook a parameter holds: calls ``DataParallel._grad_hooks[key]`` while the DataParallel lives."""
    def hook(p: torch.nn.Parameter) -> None:
        ddp = ddp_ref()
        if ddp is not None:
            ddp._grad_hooks[key](p)
    return hook


class DataParallel(torch.nn.Module):
    """Wrap ``module`` for data-parallel training over ``dp_group`` (any :class:`Group`: dp, dp_cp, ...).

    Arguments (keyword-only): ``zero_stage`` 0/1/2 (see the module docstring); ``bucket_size``
    (elements) or ``bucket_size_mb`` (MB of fp32 gradients; default 25); ``overlap_grad_reduce``
    (launch reductions from backward hooks; off: all at :meth:`finish_grad_sync`);
    ``overlap_param_gather`` (sharded stages: the post-step parameter all-gather is waited for bucket
    by bucket in forward pre-hooks of the modules that own the parameters); ``grad_reduce``
    "mean"/"sum"; ``tp_group`` for sequence-parallel gradients; ``align`` (shard alignment in
    elements); ``max_inflight_buckets``; ``broadcast_params`` (copy dp rank 0's parameters to all
    replicas at construction).

    ``local_grads=True`` (DiLoCo, :mod:`parallel.data_parallel.outer`): gradients are never reduced over
    ``dp_group`` (each replica steps on its own gradient; the sequence-parallel TP reduction still runs);
    :meth:`set_local_grads` switches it between steps.
    ``grad_compressor`` (:mod:`parallel.data_parallel.compression`): replaces each bucket's all-reduce by
    the compressor's (synchronous) compressed reduction. Both need ``zero_stage=0``.
    """

    def __init__(self, module: torch.nn.Module, *, dp_group: Group, tp_group: Group | None = None,
                 zero_stage: int = 0, bucket_size: int | None = None, bucket_size_mb: float | None = None,
                 overlap_grad_reduce: bool = True, overlap_param_gather: bool = False, grad_reduce: str = "mean",
                 align: int = 1, max_inflight_buckets: int | None = None, broadcast_params: bool = True,
                 chunks: bool = False, expert_group: Group | None = None, local_grads: bool = False,
                 grad_compressor=None):
        super().__init__()
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={zero_stage!r} must be 0 (all-reduce), 1 (sharded optimizer state), "
                             "2 (and sharded gradients) or 3 (and sharded parameters)")
        if grad_reduce not in ("mean", "sum"):
            raise ValueError(f"grad_reduce={grad_reduce!r} must be 'mean' (divide by dp) or 'sum'")
        if overlap_param_gather and zero_stage == 0:
            raise ValueError("overlap_param_gather=True needs a sharded optimizer (zero_stage 1 or 2): with "
                             "zero_stage=0 there is no parameter all-gather to overlap")
        if overlap_param_gather and zero_stage == 3:
            raise ValueError("overlap_param_gather=True is for zero_stage 1 and 2 (the post-step gather); "
                             "zero_stage=3 gathers each layer before use and prefetches the next by itself: "
                             "drop overlap_param_gather")
        if isinstance(align, bool) or not isinstance(align, int) or align < 1:
            raise ValueError(f"align={align!r} must be an integer >= 1 (elements per shard alignment)")
        if max_inflight_buckets is not None and (not isinstance(max_inflight_buckets, int) or max_inflight_buckets < 1):
            raise ValueError(f"max_inflight_buckets={max_inflight_buckets!r} must be None (unbounded) or >= 1")
        if (local_grads or grad_compressor is not None) and zero_stage != 0:
            raise ValueError(f"zero_stage={zero_stage} shards the optimizer over dp, but local_grads (DiLoCo) and "
                             "grad_compressor replace the data-parallel reduction it is built on; use zero_stage=0 "
                             "(optim.distributed=false)")
        if local_grads and grad_compressor is not None:
            raise ValueError("local_grads=True reduces nothing over dp, so a grad_compressor has nothing to compress; "
                             "pass one or the other")
        self.local_grads = local_grads
        self.grad_compressor = grad_compressor
        self.grad_reduce = grad_reduce
        if bucket_size is None and bucket_size_mb is None:
            bucket_size_mb = DEFAULT_BUCKET_MB
        size = bucket_size_elements(bucket_size=bucket_size, bucket_size_mb=bucket_size_mb)
        self.module = module
        self.dp_group = dp_group
        self.tp_group = tp_group
        self.zero_stage = zero_stage
        self.sharded = zero_stage >= 1
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.grad_scale = 1.0 / dp_group.size if grad_reduce == "mean" and not local_grads else 1.0
        self.max_inflight_buckets = max_inflight_buckets
        self.bucket_size = size
        self.is_last_microbatch = True
        self._synced_chunks: set[int] = set()  # chunks whose last backward runs (enable_grad_sync)
        if chunks and not isinstance(module, torch.nn.ModuleList):
            raise ValueError("DataParallel(chunks=True) needs a torch.nn.ModuleList of model chunks")
        self.param_names: dict[int, str] = {}
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        chunk_of: dict[int, int] = {}
        self.expert_group = expert_group
        for name, p in module.named_parameters():
            if p.requires_grad:
                self.param_names[id(p)] = name
                # With an expert group, expert parameters get buffers of their own (reduced over it).
                is_expert = expert_group is not None and bool(getattr(p, "expert", False))
                by_dtype.setdefault((p.dtype, is_expert), []).append(p)
                chunk_of[id(p)] = int(name.split(".", 1)[0]) if chunks else 0
        if not by_dtype:
            raise ValueError("DataParallel: the module has no trainable parameters (requires_grad=True)")
        # ZeRO-3: buckets never span two gather units, so the bucket "group" is the unit.
        units = self._build_units(module, chunks=chunks) if zero_stage == 3 else []
        unit_of = {id(p): u.index for u in units for p in u.params}
        self.flat_buffers: list[ParamAndGradBuffer] = []
        self._group_of_buf: dict[int, Group] = {}  # id(buffer) -> its reduction group (expert buffers: edp)
        for (dtype, is_expert), plist in by_dtype.items():
            group = expert_group if is_expert else dp_group  # each set is reduced (and sharded) over its own group
            self.flat_buffers.append(ParamAndGradBuffer(
                plist, dtype=dtype, bucket_size=size, dp=group.size, align=align,
                grads="lazy" if zero_stage >= 2 else "full",
                separate=[bool(getattr(p, "shared_embedding", False) or getattr(p, "defer_grad_reduce", False))
                          for p in plist],
                groups=([unit_of[id(p)] for p in plist] if units else
                        [chunk_of[id(p)] for p in plist] if chunks else None),
                shard_params=zero_stage == 3))
            self._group_of_buf[id(self.flat_buffers[-1])] = group
        self._group_of_bucket = {id(b): self._group_of_buf[id(buf)] for buf in self.flat_buffers for b in buf.buckets}
        if grad_compressor is not None:  # sizes its state and validates (e.g. PowerSGD's rank) before any traffic
            grad_compressor.attach(self)
        if broadcast_params:
            for buf in self.flat_buffers:  # one call per buffer (ZeRO-3: per bucket), at construction only
                group = self.reduce_group(buf)
                if group.size == 1:
                    continue
                for t in ([b.full for b in buf.buckets] if buf.shard_params else [buf.param_data]):
                    comm.broadcast(t, group, src=0)
        self._where: dict[int, tuple[ParamAndGradBuffer, Bucket]] = {}
        for buf in self.flat_buffers:
            for b in buf.buckets:
                for p in b.params:
                    self._where[id(p)] = (buf, b)
        self.gatherer: Gatherer | None = None
        self._zero3_handles = []
        if zero_stage == 3:
            for buf in self.flat_buffers:
                for b in buf.buckets:
                    b.unit = unit_of[id(b.params[0])]
                    units[b.unit].buckets.append((buf, b))
                buf.shard_out(self.reduce_group(buf).rank)
            self.gatherer = Gatherer([u for u in units if u.params], group_of=self.reduce_group)
            # A micro-batch's reductions overlap the rest of its backward; the next forward waits for
            # them, so their fp32 buckets are freed before it allocates activations.
            for root in (list(module) if chunks else [module]):
                self._zero3_handles.append(root.register_forward_pre_hook(lambda m, a: self._drain(), prepend=True))
        self._setup_shards()
        self._inflight: list[tuple[ParamAndGradBuffer, Bucket]] = []
        self.lazy_grad_bytes = 0  # fp32 bucket gradients currently allocated (zero_stage 2)
        self.lazy_grad_bytes_peak = 0
        # The hooks live here; each parameter holds a thin one that reaches them through a weak reference. A
        # tensor hook is held by C++ (the parameter's gradient accumulator), where Python's garbage collector
        # cannot see it: a hook holding this object (and so its buckets and parameters) made a cycle that was
        # never collected, and every DataParallel built in a process kept its model alive to the end.
        params = [p for buf in self.flat_buffers for b in buf.buckets for p in b.params]
        self._grad_hooks = {id(p): self._make_grad_hook(p) for p in params}
        me = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(_weak_grad_hook(me, id(p))) for p in params]
        if overlap_param_gather:
            self._register_gather_prehooks()

    # -- layout ------------------------------------------------------------------------------------
    def _build_units(self, module: torch.nn.Module, *, chunks: bool) -> list[Unit]:
        """ZeRO-3 gather units: per chunk its root (the parameters outside any layer) then its layers."""
        roots = list(module) if chunks else [module]
        units: list[Unit] = []
        for c, root in enumerate(roots):
            layers = find_units(root)
            in_layer = {id(p) for _, m in layers for p in m.parameters()}
            trainable = [p for p in root.parameters() if p.requires_grad]
            units.append(Unit(index=len(units), name=f"{c}.<root>" if chunks else "<root>", chunk=c, root=True,
                              module=root, params=[p for p in trainable if id(p) not in in_layer]))
            for name, m in layers:
                ps = [p for p in m.parameters() if p.requires_grad]
                odd = [n for n, p in m.named_parameters() if getattr(p, "used_outside_forward", False)]
                if odd:
                    raise ValueError(f"zero_stage=3: parameter(s) {odd} of {name!r} are read outside the layer's "
                                     "forward, so the layer's gather would not cover them; keep such parameters "
                                     "outside the repeated layers or use zero_stage 1/2")
                units.append(Unit(index=len(units), name=f"{c}.{name}" if chunks else name, chunk=c, root=False,
                                  module=m, params=ps))
        return units

    def _setup_shards(self) -> None:
        self.shard_grad_data: list[torch.Tensor | None] = []
        for buf in self.flat_buffers:
            dp = buf.dp  # the size of the group this buffer is sharded over (expert buffers: edp)
            data = None
            if self.zero_stage >= 2:
                data = torch.zeros(buf.numel // dp, dtype=GRAD_DTYPE, device=buf.device)
            self.shard_grad_data.append(data)
            for b in buf.buckets:
                lo, hi = self.owned_range(b)
                if self.zero_stage == 0:
                    b.shard_grad = b.grad
                elif self.zero_stage == 1:
                    b.shard_grad = b.grad[lo:hi]
                else:
                    b.shard_grad = data[b.start // dp:b.end // dp]

    def reduce_group(self, buf: ParamAndGradBuffer) -> Group:
        """The group ``buf``'s gradients are reduced (and, sharded, its state sharded) over:
        ``expert_group`` for expert buffers, else dp."""
        return self._group_of_buf[id(buf)]

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        """This rank's ``[lo, hi)`` of the bucket (bucket-relative): when sharded, its 1/p of it over the
        bucket's group (dp; edp for an expert bucket), else all of it."""
        if not self.sharded:
            return 0, bucket.numel
        group = self._group_of_bucket[id(bucket)]
        n = bucket.numel // group.size
        return group.rank * n, (group.rank + 1) * n

    def buckets(self) -> Iterator[tuple[ParamAndGradBuffer, Bucket]]:
        for buf in self.flat_buffers:
            for b in buf.buckets:
                yield buf, b

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- gradient accumulation and reduction --------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches run inside only accumulate into ``main_grad``; no communication."""
        prev = self.is_last_microbatch
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = prev

    def enable_grad_sync(self, chunk: int, still_to_come: set[int] | None = None) -> None:
        """Reduce ``chunk``'s buckets as their gradients become final (call before the chunk's last
        backward; :meth:`reset_grad_sync` at the start of the next step). ``still_to_come`` (split backward,
        called before the chunk's last ``W``): the ids of the parameters that still get a gradient; the
        chunk's others had their last one already (in a ``B``), so they leave their buckets' pending sets
        now, and a bucket left with none pending is reduced at once (under the rest of the schedule)."""
        self._synced_chunks.add(chunk)
        if still_to_come is None or self.zero_stage == 3:
            return
        for buf, bucket in self.buckets():
            if bucket.group != chunk or bucket.state != "open":
                continue
            bucket.pending &= still_to_come
            if not bucket.pending and self.overlap_grad_reduce and not bucket.deferred and bucket.grad is not None:
                self._launch(buf, bucket)

    def reset_grad_sync(self) -> None:
        self._synced_chunks.clear()

    def set_local_grads(self, local: bool) -> None:
        """Turn the dp gradient reduction off (``True``: each replica keeps its own gradient, DiLoCo's inner
        steps) or on (``False``: the plain all-reduce and mean, e.g. the data-parallel warm-up before DiLoCo's
        outer loop starts, ``outer.start_step``). Call between steps, with no reduction in flight."""
        if local and (self.sharded or self.grad_compressor is not None):
            raise ValueError("local gradients need zero_stage=0 and no grad_compressor (DiLoCo replaces the "
                             "reduction they are built on)")
        if self._inflight:
            raise RuntimeError("set_local_grads() while gradient reductions are in flight; switch between steps")
        self.local_grads = bool(local)
        self.grad_scale = 1.0 / self.dp_group.size if self.grad_reduce == "mean" and not local else 1.0

    def _make_grad_hook(self, param: torch.nn.Parameter):  # held in self._grad_hooks (see __init__)
        buf, bucket = self._where[id(param)]

        if self.zero_stage == 3:
            return self._make_zero3_grad_hook(buf, bucket)

        def hook(p: torch.nn.Parameter) -> None:
            if p.grad is None:
                return
            if bucket.state != "open":
                raise RuntimeError(
                    f"parameter {self.param_names[id(p)]!r} received a gradient after its bucket was reduced "
                    f"(bucket state {bucket.state!r}); call zero_grad_buffer() (optimizer.zero_grad()) before the "
                    "next step's backward, and run every micro-batch but the last inside no_sync()")
            with torch.no_grad():
                if bucket.grad is None:
                    self._allocate(buf, bucket)
                p.main_grad.add_(p.grad)
                p.grad = None
            if self.is_last_microbatch or bucket.group in self._synced_chunks:
                bucket.pending.discard(id(p))
                if not bucket.pending and self.overlap_grad_reduce and not bucket.deferred:
                    self._launch(buf, bucket)
        return hook

    def _make_zero3_grad_hook(self, buf: ParamAndGradBuffer, bucket: Bucket):
        """ZeRO-3: every micro-batch's complete bucket is reduce-scattered (and added into the shard);
        a unit whose parameters all have their gradient is freed."""
        def hook(p: torch.nn.Parameter) -> None:
            if p.grad is None:
                return
            with torch.no_grad():
                if bucket.state == "launched":  # the previous micro-batch's reduction of this bucket
                    self._finalize(buf, bucket)
                if bucket.state == "done":
                    bucket.state = "open"
                if bucket.grad is None:
                    self._allocate(buf, bucket)
                p.main_grad.add_(p.grad)
                p.grad = None
            bucket.pending.discard(id(p))
            if not bucket.pending:
                bucket.reset_pending()
                if not bucket.deferred:
                    self._launch(buf, bucket)
                    if not self.overlap_grad_reduce:
                        self._finalize(buf, bucket)
            unit = self.gatherer.grad_arrived(p)
            if unit is not None:
                self.gatherer.backward_done(unit)
        return hook

    def _allocate(self, buf: ParamAndGradBuffer, bucket: Bucket) -> None:
        buf.allocate_bucket_grad(bucket)
        self.lazy_grad_bytes += bucket.grad.numel() * bucket.grad.element_size()
        self.lazy_grad_bytes_peak = max(self.lazy_grad_bytes_peak, self.lazy_grad_bytes)

    def _launch(self, buf: ParamAndGradBuffer, bucket: Bucket) -> None:
        assert bucket.state == "open", bucket.state
        if bucket.grad is None:  # lazy bucket that received no gradient: still take part, with zeros
            self._allocate(buf, bucket)
        sp = [p for p in bucket.params if getattr(p, "sequence_parallel", False)]
        if sp and self.tp_group is not None and self.tp_group.size > 1:
            # Partial sums over TP must be complete before the replicas are averaged; one coalesced call.
            flat = torch.cat([p.main_grad.view(-1) for p in sp])
            comm.all_reduce(flat, self.tp_group)
            with torch.no_grad():
                for p, chunk in zip(sp, flat.split([p.numel() for p in sp])):
                    p.main_grad.copy_(chunk.view(p.shape))
        if self.local_grads:  # DiLoCo: the replica keeps its own gradient (no dp traffic)
            bucket.work = None
        elif self.grad_compressor is not None:  # compressed, synchronous; leaves the SUM over dp in bucket.grad
            self.grad_compressor.reduce((self.flat_buffers.index(buf), bucket.index), bucket.grad, bucket)
            bucket.work = None
        elif self.sharded:
            bucket.out, bucket.work = comm.reduce_scatter(bucket.grad, self.reduce_group(buf), async_op=True)
        else:
            bucket.work = comm.all_reduce(bucket.grad, self.reduce_group(buf), op="sum", async_op=True)
        bucket.state = "launched"
        self._inflight.append((buf, bucket))
        if self.zero_stage >= 2:
            # Free finished buckets early (memory), and bound the number in flight if asked.
            for item in [x for x in self._inflight[:-1] if x[1].work.is_completed()]:
                self._finalize(*item)
        if self.max_inflight_buckets is not None:
            while len(self._inflight) > self.max_inflight_buckets:
                self._finalize(*self._inflight[0])

    def _finalize(self, buf: ParamAndGradBuffer, bucket: Bucket) -> None:
        if bucket.work is not None:  # None: reduced synchronously (compressor) or not at all (local_grads)
            comm.wait(bucket.work, self.reduce_group(buf))
        with torch.no_grad():
            if self.zero_stage == 3:  # one reduction per micro-batch: accumulate into the shard
                bucket.shard_grad.add_(bucket.out, alpha=self.grad_scale)
            else:
                if self.sharded and bucket.out is not None and bucket.out.data_ptr() != bucket.shard_grad.data_ptr():
                    bucket.shard_grad.copy_(bucket.out)
                if self.grad_scale != 1.0:
                    bucket.shard_grad.mul_(self.grad_scale)
        bucket.work, bucket.out = None, None
        bucket.state = "done"
        self._inflight.remove((buf, bucket))
        if self.zero_stage >= 2:
            self.lazy_grad_bytes -= bucket.grad.numel() * bucket.grad.element_size()
            buf.release_bucket_grad(bucket)

    def _drain(self) -> None:
        """Finish every reduction in flight (ZeRO-3, before a forward)."""
        while self._inflight:
            self._finalize(*self._inflight[0])

    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet (overlap off, deferred, unused parameters), wait for all.

        Afterwards each bucket's ``shard_grad`` holds the reduced (averaged) gradient of this rank's
        range; with ``zero_stage=0`` that is every ``p.main_grad``. Idempotent until
        :meth:`zero_grad_buffer`.
        """
        for buf, b in self.buckets():
            if b.state == "open":
                self._launch(buf, b)
        while self._inflight:
            self._finalize(*self._inflight[0])
        if self.gatherer is not None:  # units whose backward left a parameter without gradient
            self.gatherer.release_all()

    def zero_grad_buffer(self) -> None:
        """Zero all gradients and re-arm the buckets for the next step."""
        if self._inflight:
            raise RuntimeError("zero_grad_buffer() while gradient reductions are in flight; "
                               "call finish_grad_sync() (the optimizer step does) first")
        for i, buf in enumerate(self.flat_buffers):
            if buf.grad_data is not None:
                buf.grad_data.zero_()
            if self.shard_grad_data[i] is not None:
                self.shard_grad_data[i].zero_()
            for b in buf.buckets:
                if buf.lazy and b.grad is not None:
                    self.lazy_grad_bytes -= b.grad.numel() * b.grad.element_size()
                    buf.release_bucket_grad(b)
                b.state = "open"
                b.reset_pending()
        for p in self.module.parameters():
            p.grad = None
        if self.gatherer is not None:
            self.gatherer.release_all()

    # -- parameter all-gather after a sharded optimizer step ---------------------------------------
    def start_param_sync(self) -> None:
        """All-gather every bucket's updated shard (async), in forward order (last bucket first).

        Without ``overlap_param_gather`` this waits at once; with it, each bucket is waited for by
        the forward pre-hook of the first module that uses one of its parameters (or by
        :meth:`finish_param_sync`). No-op when not sharded.
        """
        if not self.sharded or self.zero_stage == 3:  # ZeRO-3 gathers layer by layer in forward
            return
        for buf in self.flat_buffers:
            for b in reversed(buf.buckets):
                if b.gather_work is not None:
                    raise RuntimeError("start_param_sync() while a previous parameter all-gather is pending; "
                                       "call finish_param_sync() first")
                lo, hi = self.owned_range(b)
                shard = buf.param_data[b.start + lo:b.start + hi]
                b.gather_out, b.gather_work = comm.all_gather(shard, self.reduce_group(buf), async_op=True)
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def _wait_gather(self, buf: ParamAndGradBuffer, b: Bucket) -> None:
        comm.wait(b.gather_work, self.reduce_group(buf))
        region = buf.param_region(b)
        if b.gather_out.data_ptr() != region.data_ptr():
            with torch.no_grad():
                region.copy_(b.gather_out)
        b.gather_work, b.gather_out = None, None

    def finish_param_sync(self) -> None:
        """Wait for every pending parameter all-gather (before eval, checkpointing, or the next step)."""
        for buf, b in self.buckets():
            if b.gather_work is not None:
                self._wait_gather(buf, b)

    def _register_gather_prehooks(self) -> None:
        # A parameter marked ``used_outside_forward`` (e.g. an output layer whose weight the model reads
        # directly, never calling the layer) is waited for at the start of its chunk's forward instead:
        # its own module's hook would never fire and the step would run on the previous weights.
        roots = list(self.module) if isinstance(self.module, torch.nn.ModuleList) else [self.module]
        for root in roots:
            early = []
            for p in root.parameters():
                if getattr(p, "used_outside_forward", False) and id(p) in self._where:
                    early.append(self._where[id(p)])
            if early:
                self._handles.append(root.register_forward_pre_hook(self._make_gather_prehook(early)))
        # A module without a forward of its own (a bare weight holder, e.g. an expert's ``fc1``) never fires a
        # hook: its parameters are waited for by the nearest ancestor that has one and is not an element of a
        # ModuleList/ModuleDict (such elements may be skipped: an MoE layer's grouped GEMM reads its experts'
        # weights without calling them), at the latest by the chunk's root.
        parent: dict[int, torch.nn.Module] = {}
        for root in roots:
            for m in root.modules():
                for child in m.children():
                    parent.setdefault(id(child), m)
        is_root = {id(r) for r in roots}

        def reader(m: torch.nn.Module) -> torch.nn.Module:
            if type(m).forward is not torch.nn.Module.forward or id(m) in is_root:
                return m
            while id(m) not in is_root:
                m = parent[id(m)]
                if id(m) in is_root or (type(m).forward is not torch.nn.Module.forward and not isinstance(
                        parent.get(id(m)), (torch.nn.ModuleList, torch.nn.ModuleDict))):
                    break
            return m

        owned_by: dict[int, tuple[torch.nn.Module, list]] = {}
        for module in self.module.modules():
            for p in module.parameters(recurse=False):
                if id(p) in self._where:
                    m = reader(module)
                    owned = owned_by.setdefault(id(m), (m, []))[1]
                    if self._where[id(p)] not in owned:
                        owned.append(self._where[id(p)])
        for m, owned in owned_by.values():
            self._handles.append(m.register_forward_pre_hook(self._make_gather_prehook(owned)))

    def _make_gather_prehook(self, owned: list[tuple[ParamAndGradBuffer, Bucket]]):
        def prehook(module, args):
            for buf, b in owned:
                if b.gather_work is not None:
                    self._wait_gather(buf, b)
        return prehook

    # -- introspection -------------------------------------------------------------------------------
    def grad_buffer_bytes(self) -> int:
        """Bytes of persistent fp32 gradient storage on this rank (full buffers or shards)."""
        full = sum(buf.grad_data.numel() * GRAD_DTYPE.itemsize for buf in self.flat_buffers
                   if buf.grad_data is not None)
        shard = sum(t.numel() * t.element_size() for t in self.shard_grad_data if t is not None)
        return full + shard

    def full_shapes(self):
        """Context: ZeRO-3 parameters show their full shapes (no data where not gathered) for code that
        inspects shapes only; a no-op context for other stages."""
        return self.gatherer.full_shapes() if self.gatherer is not None else contextlib.nullcontext()

    def gathered(self):
        """Context: ZeRO-3 parameters gathered and readable (collective over the dp group; writes are
        lost, the shards are the parameters); a no-op context for other stages."""
        return self.gatherer.gathered() if self.gatherer is not None else contextlib.nullcontext()

    def owned_params(self, buf: ParamAndGradBuffer, bucket: Bucket) -> torch.Tensor:
        """The parameters of this rank's owned range of ``bucket`` (a view of the stored parameters:
        ZeRO-3's shard, else the range of the full buffer); the optimizer writes its update there."""
        lo, hi = self.owned_range(bucket)
        return buf.owned_params(bucket, lo, hi)

    def param_bytes(self) -> int:
        """Bytes of persistent parameter storage of the trainable parameters on this rank (ZeRO-3: shards)."""
        return sum(buf.param_data.numel() * buf.param_data.element_size() for buf in self.flat_buffers)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.gatherer is not None:
            self.gatherer.remove_hooks()
        for h in self._zero3_handles:
            h.remove()
        self._zero3_handles.clear()
