"""Build ShardedTensors from a module's parameters and from a distributed optimizer's flat shards.

A :class:`ParamLayout` says how one local parameter maps onto logical tensors: one or more
:class:`ParamPart` s, each a block of the local tensor along one dim placed at a global offset.
It is derived from the tensor-parallel attributes the parallel layers set
(``tensor_parallel``, ``partition_dim``, ``partition_stride``; see
:mod:`parallel.tensor_parallel.sharding`) and from an optional per-parameter hook that renames,
skips, or splits a fused local parameter into several logical tensors (e.g. ``[gate_r; up_r]`` into
``gate`` and ``up``). The same layout then describes the parameter itself, any state of the same
shape (Adam moments, fp32 master weights) and any flat ``[start, end)`` share of it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from engine.checkpoint.sharded import ShardedTensor, flat_range_boxes


@dataclass(frozen=True, kw_only=True)
class ShardingContext:
    """Where this rank sits, as far as parameter placement is concerned.

    ``replica_rank`` numbers the ranks that hold identical model-parallel shards (position in the
    dp x cp block); only replica 0 writes. Build it with :meth:`from_mesh` in a trainer.
    ``expert_replica_rank`` numbers the copies of an expert parameter (``p.expert``): under expert
    parallelism the ep ranks of a dp block hold different experts, so the copies of one expert are the
    edp ranks (position ``edp * cp + cp``); None: the same as ``replica_rank`` (no expert parallelism).
    """

    tp_rank: int = 0
    tp_size: int = 1
    replica_rank: int = 0
    expert_replica_rank: int | None = None

    def __post_init__(self):
        if not (self.tp_size >= 1 and 0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"ShardingContext tp_rank={self.tp_rank} must lie in 0..tp_size-1 "
                             f"(tp_size={self.tp_size})")
        if self.replica_rank < 0:
            raise ValueError(f"ShardingContext replica_rank={self.replica_rank} must be >= 0")

    @classmethod
    def from_mesh(cls, mesh) -> "ShardingContext":
        c, d = mesh.coords, mesh.dims
        return cls(tp_rank=c["tp"], tp_size=d.tp, replica_rank=c["dp"] * d.cp + c["cp"],
                   expert_replica_rank=c.get("edp", c["dp"]) * d.cp + c["cp"])


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """What a hook returns for one parameter.

    ``key``: logical name (default: the module-relative name; use it to map a pipeline stage's
    local layer index to the global one). ``parts``: split the local tensor along its partition dim
    into blocks of the given local sizes, each a TP shard of its own logical tensor (the fused
    gate/up case); by default ``partition_stride`` blocks of one logical tensor. ``dim``: the local
    dim ``parts`` cut along (default: the partition dim, 0 for a replicated parameter). ``extra_replica``:
    > 0 marks this copy as a replica beyond dp/cp/tp (the last pipeline stage's tied lm head).
    ``allow_shape_mismatch``: dim 0 is padded by a layout-dependent amount (vocab padding); see
    :class:`engine.checkpoint.sharded.ShardedTensor`.
    """

    key: str
    parts: tuple[tuple[str, int], ...] | None = None
    dim: int | None = None
    extra_replica: int = 0
    allow_shape_mismatch: bool = False


@dataclass(frozen=True)
class ParamPart:
    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    dim: int            # local dim along which the part is a block
    local_start: int    # block [local_start, local_end) of the local tensor along `dim`
    local_end: int


@dataclass(frozen=True, kw_only=True)
class ParamLayout:
    """How a local tensor of ``local_shape`` maps onto logical tensors.

    ``replica_id`` is for the whole local tensor (model weights: dp/cp copies and TP replicas);
    ``tp_replica_id`` ignores dp/cp, for state that the optimizer already shards over dp.
    """

    name: str
    local_shape: tuple[int, ...]
    parts: tuple[ParamPart, ...]
    replica_id: int
    tp_replica_id: int
    allow_shape_mismatch: bool = False

    def sharded(self, tensor: torch.Tensor, *, prefix: str = "", replica_id: int | None = None) -> list[ShardedTensor]:
        """Pieces of ``tensor`` (shape ``local_shape``: the parameter or a same-shaped state); views of it."""
        if tuple(tensor.shape) != self.local_shape:
            raise ValueError(f"{self.name}: tensor of shape {tuple(tensor.shape)} does not match the parameter's "
                             f"local shape {self.local_shape}")
        rid = self.replica_id if replica_id is None else replica_id
        out = []
        for p in self.parts:
            view = tensor.narrow(p.dim, p.local_start, p.local_end - p.local_start) if tensor.dim() else tensor
            out.append(ShardedTensor(key=prefix + p.key, data=view, global_shape=p.global_shape,
                                     global_offset=p.global_offset, replica_id=rid,
                                     allow_shape_mismatch=self.allow_shape_mismatch))
        return out

    def sharded_flat(self, flat: torch.Tensor, *, start: int, end: int, prefix: str = "",
                     replica_id: int | None = None) -> list[ShardedTensor]:
        """Pieces for elements ``[start, end)`` of the flattened local tensor, held in 1-D ``flat``.

        Parts that are blocks along dim 0 are contiguous in the flat order, so each yields a
        ``flat_range`` piece; blocks along another dim yield rectangular pieces whose data are
        strided views of ``flat``.
        """
        if flat.dim() != 1 or flat.numel() != end - start:
            raise ValueError(f"{self.name}: flat shard of shape {tuple(flat.shape)} for range [{start}, {end}) "
                             f"must be 1-D with {end - start} elements")
        rid = self.tp_replica_id if replica_id is None else replica_id
        out: list[ShardedTensor] = []
        numel = math.prod(self.local_shape)
        if not 0 <= start < end <= numel:
            raise ValueError(f"{self.name}: flat range [{start}, {end}) outside the {numel} local elements")
        for p in self.parts:
            part_shape = list(self.local_shape)
            if part_shape:
                part_shape[p.dim] = p.local_end - p.local_start
            if len(self.parts) == 1 or p.dim == 0:
                inner = numel // self.local_shape[0] if len(self.parts) > 1 else 0
                ps, pe = (0, numel) if len(self.parts) == 1 else (p.local_start * inner, p.local_end * inner)
                s, e = max(ps, start), min(pe, end)
                if s < e:
                    out.append(ShardedTensor(key=prefix + p.key, data=flat[s - start:e - start],
                                             global_shape=p.global_shape, global_offset=p.global_offset,
                                             local_shape=tuple(part_shape), flat_range=(s - ps, e - ps),
                                             replica_id=rid, allow_shape_mismatch=self.allow_shape_mismatch))
                continue
            # A block along dim > 0 is strided in the flat order: walk the contiguous boxes of the
            # range and cut each with the block.
            for box in flat_range_boxes(self.local_shape, start, end):
                lo, hi = box.offset[p.dim], box.offset[p.dim] + box.shape[p.dim]
                s, e = max(lo, p.local_start), min(hi, p.local_end)
                if s >= e:
                    continue
                view = flat[box.flat_start:box.flat_start + box.numel].view(box.shape)  # (box dims)
                view = view.narrow(p.dim, s - lo, e - s)
                off = [go + bo for go, bo in zip(p.global_offset, box.offset)]
                off[p.dim] = p.global_offset[p.dim] + s - p.local_start
                out.append(ShardedTensor(key=prefix + p.key, data=view, global_shape=p.global_shape,
                                         global_offset=tuple(off), replica_id=rid,
                                         allow_shape_mismatch=self.allow_shape_mismatch))
        return out


def param_layout(name: str, param: torch.Tensor, *, ctx: ShardingContext, spec: ParamSpec | None = None) -> ParamLayout:
    """The layout of one local parameter from its TP attributes and an optional :class:`ParamSpec`."""
    spec = spec or ParamSpec(key=name)
    shape = tuple(param.shape)
    sharded = bool(getattr(param, "tensor_parallel", False)) and ctx.tp_size > 1
    tp_rank, tp = (ctx.tp_rank, ctx.tp_size) if sharded else (0, 1)
    dim = int(getattr(param, "partition_dim", 0)) if sharded else 0
    if shape:
        dim %= len(shape)
    stride = int(getattr(param, "partition_stride", 1)) if sharded else 1
    split_dim = dim if spec.dim is None or not shape else spec.dim % len(shape)
    if spec.parts is not None:
        blocks = [(k, int(n)) for k, n in spec.parts]
        if not shape or sum(n for _, n in blocks) != shape[split_dim]:
            raise ValueError(f"{name}: ParamSpec.parts sizes {[n for _, n in blocks]} must sum to the local size "
                             f"{shape[split_dim] if shape else None} of dim {split_dim}")
    elif stride > 1:
        if shape[dim] % stride:
            raise ValueError(f"{name}: partition_stride={stride} does not divide the local size {shape[dim]} "
                             f"of dim {dim}")
        blocks = [(spec.key, shape[dim] // stride)] * stride
    else:
        blocks = [(spec.key, shape[dim] if shape else 1)]
    parts, cursor = [], 0
    per_key_seen: dict[str, int] = {}
    n_same = {k: sum(1 for kk, _ in blocks if kk == k) for k, _ in blocks}
    for key, n in blocks:
        k_index = per_key_seen.get(key, 0)
        per_key_seen[key] = k_index + 1
        gshape, goff = list(shape), [0] * len(shape)
        if shape:
            gshape[split_dim] = n
            if sharded:  # this rank's block is block tp_rank of tp along the partition dim
                goff[dim] = tp_rank * gshape[dim]
                gshape[dim] *= tp
            # Blocks with the same key (partition_stride) are stacked along the split dim.
            block_global = gshape[split_dim]
            gshape[split_dim] = block_global * n_same[key]
            goff[split_dim] += k_index * block_global
        parts.append(ParamPart(key=key, global_shape=tuple(gshape), global_offset=tuple(goff), dim=split_dim,
                               local_start=cursor, local_end=cursor + n))
        cursor += n
    # Copies of this local tensor: dp/cp replicas (replica_rank), TP ranks of a replicated parameter,
    # and hook-declared extra copies. Mixed-radix index: 0 only for the one copy that writes.
    tp_copies, tp_replica = (1, 0) if sharded else (ctx.tp_size, ctx.tp_rank)
    tp_replica_id = spec.extra_replica * tp_copies + tp_replica
    replica_rank = ctx.replica_rank
    if getattr(param, "expert", False) and ctx.expert_replica_rank is not None:
        replica_rank = ctx.expert_replica_rank  # the ep ranks hold different experts: edp ranks are the copies
    replica_id = tp_replica_id + replica_rank * tp_copies * (spec.extra_replica + 1)
    return ParamLayout(name=name, local_shape=shape, parts=tuple(parts), replica_id=replica_id,
                       tp_replica_id=tp_replica_id, allow_shape_mismatch=spec.allow_shape_mismatch)


HookFn = Callable[[str, torch.Tensor], "ParamSpec | str | None"]


def module_layouts(module: torch.nn.Module, *, ctx: ShardingContext, hook: HookFn | None = None) -> dict[str, ParamLayout]:
    """Layouts of ``module``'s parameters, in registration order.

    ``hook(name, param)`` may return a :class:`ParamSpec`, a str (just the logical key), or None to
    skip the parameter; without a hook every parameter keeps its module-relative name.
    """
    out: dict[str, ParamLayout] = {}
    for name, p in module.named_parameters():
        spec: ParamSpec | None = ParamSpec(key=name)
        if hook is not None:
            got = hook(name, p)
            if got is None:
                continue
            spec = ParamSpec(key=got) if isinstance(got, str) else got
            if not isinstance(spec, ParamSpec):
                raise ValueError(f"checkpoint hook returned {type(got).__name__} for {name}; return a ParamSpec, "
                                 "a str key, or None to skip")
        out[name] = param_layout(name, p, ctx=ctx, spec=spec)
    return out


def module_sharded_tensors(module: torch.nn.Module, *, ctx: ShardingContext, hook: HookFn | None = None,
                           prefix: str = "model.") -> list[ShardedTensor]:
    """ShardedTensors viewing ``module``'s parameters (save reads them; load writes into them)."""
    layouts = module_layouts(module, ctx=ctx, hook=hook)
    params = dict(module.named_parameters())
    out: list[ShardedTensor] = []
    for name, layout in layouts.items():
        out.extend(layout.sharded(params[name].detach(), prefix=prefix))
    return out


@dataclass(frozen=True, kw_only=True)
class FlatShard:
    """A rank's share ``[start, end)`` of a flat buffer and its state tensors (1-D, ``end - start`` long each)."""

    start: int
    end: int
    states: dict[str, torch.Tensor] = field(default_factory=dict)


def flat_buffer_sharded_tensors(placements: Sequence[tuple[ParamLayout, int, int]], shards: Sequence[FlatShard], *,
                                prefix: str = "optimizer.", dp_replicated: bool = False) -> list[ShardedTensor]:
    """ShardedTensors for a data-parallel optimizer's state.

    ``placements``: each parameter's layout and its ``[start, end)`` in the flat buffer (padding
    between parameters is never saved). ``shards``: the ranges this rank owns (one per bucket) with
    a 1-D tensor per state name (``"exp_avg"``, ``"master"``...). Each saved key is
    ``f"{prefix}{state}.{logical key}"``; pieces carry ``flat_range`` into the parameter's local tensor.
    ``dp_replicated``: the state is NOT sharded over data parallelism (the plain optimizer: every dp
    rank holds all of it), so dp ranks other than the first hold replicas, like the weights.
    """
    out: list[ShardedTensor] = []
    for shard in shards:
        if shard.end < shard.start:
            raise ValueError(f"FlatShard [{shard.start}, {shard.end}) is reversed")
        for state, t in shard.states.items():
            if t.dim() != 1 or t.numel() != shard.end - shard.start:
                raise ValueError(f"FlatShard state {state!r} has shape {tuple(t.shape)}; expected 1-D of "
                                 f"{shard.end - shard.start} elements for range [{shard.start}, {shard.end})")
        for layout, ps, pe in placements:
            if pe - ps != math.prod(layout.local_shape):
                raise ValueError(f"{layout.name}: flat placement [{ps}, {pe}) holds {pe - ps} elements but the "
                                 f"parameter has {math.prod(layout.local_shape)}")
            s, e = max(ps, shard.start), min(pe, shard.end)
            if s >= e:
                continue
            for state, t in shard.states.items():
                out.extend(layout.sharded_flat(t[s - shard.start:e - shard.start], start=s - ps, end=e - ps,
                                               prefix=f"{prefix}{state}.",
                                               replica_id=layout.replica_id if dp_replicated else None))
    return out
