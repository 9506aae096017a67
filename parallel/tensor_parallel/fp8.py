"""FP8 tensor-parallel linears: a :class:`LinearImpl` per layer over engine.ops.fp8_linear.

:func:`apply_fp8` gives every column- and row-parallel linear of a built stage (except the output
layer and the names in ``exclude``) its own :class:`Fp8LinearImpl`; with the ``delayed`` recipe the
layer also gets a :class:`~engine.ops.fp8_linear.DelayedScaling` submodule named ``fp8_scaling``
(its buffers are the checkpointed state). Embedding, norms and the output layer stay in high
precision.

Per-tensor scales under TP (recipes ``tensorwise`` and ``delayed``): a tensor sharded over the TP
group reduces its amax over the group (one 4-byte all-reduce MAX, visible in the ledger), so its
scale equals the unsharded tensor's:

    column-parallel   weight (out/tp, in) and grad_output (.., out/tp) are sharded: 1 reduce in
                      forward, 1 in backward. The input is replicated (no reduction), or with SP
                      sequence-sharded: then its shard is cast with the whole input's scale (its
                      amax rides in the weight's reduce: one call of 8 bytes; 4 where the weight's
                      cast is reused) and the fp8 bytes are all-gathered, half the bytes of bf16
                      (engine.ops.fp8_linear.SequenceShards).
    row-parallel      input (.., in/tp) and weight (out, in/tp) are sharded: 2 reduces in forward;
                      grad_output is replicated, or with SP sequence-sharded (the output is
                      reduce-scattered): then its shard is cast with the whole gradient's scale (1
                      reduce in backward) and the fp8 bytes are all-gathered.

``delayed`` reduces nothing per call: each call records its local amax, and the trainer's
:func:`update_fp8` all-reduces (MAX) all of a stage's amaxes at once, once per step, over TP and
DP, so every replica keeps identical histories (Transformer Engine's amax reduction group); on DiLoCo's
inner steps over TP only, each replica keeping its own (:class:`ReplicaFp8State`).

Weight casts reused across micro-batches: inside :func:`fp8_weight_casts` (the trainer opens it
around one step's forward and backward, and around evaluation) each layer's impl holds a
:class:`~engine.ops.fp8_linear.WeightCasts`, so a weight is cast -- and, tensorwise, its amax
all-reduced -- once per step instead of once per micro-batch (and per recompute). Every TP rank
runs the same calls in the same order, so all of them reuse at the same calls and the amax
all-reduces stay matched.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Sequence

import torch
from torch import nn

from engine.ops.fp8_linear import PER_TENSOR, RECIPES, DelayedScaling, Scaler, SequenceShards, WeightCasts, \
    check_fp8_shapes, delayed_states, fp8_linear, update_delayed_states
from parallel import comm
from parallel.comm import Group
from parallel.mappings import copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp, reduce_scatter_to_sp
from parallel.tensor_parallel.fp8_ring import fp8_ring_column, fp8_ring_row, max_over
from parallel.tensor_parallel.layers import ColumnParallelLinear, LinearImpl, RowParallelLinear
from parallel.tensor_parallel.overlap import RingLinearImpl

ALWAYS_EXCLUDED = ("output_layer",)


class Fp8LinearImpl(LinearImpl):
    """One layer's FP8 strategy: ``recipe`` and, for ``delayed``, that layer's scaling ``state``.
    ``ring``: sequence-parallel layers run as FP8 ring collective matmuls (parallel.tp_overlap = "ring";
    parallel/tensor_parallel/fp8_ring.py), computing what the non-ring path computes. ``weight_casts``:
    set inside :func:`fp8_weight_casts` only."""

    def __init__(self, recipe: str, *, state: DelayedScaling | None = None, ring: bool = False):
        if recipe not in RECIPES:
            raise ValueError(f"FP8 recipe {recipe!r} is not one of {RECIPES}")
        self.recipe, self.state, self.ring = recipe, state, ring
        self.overlap_comm = ring
        self.weight_casts: WeightCasts | None = None

    def _scaler(self, group: Group, sharded: Sequence[str]) -> Scaler | None:
        """The per-tensor recipes' scales of one ring call (the ring reduces what it holds in chunks itself)."""
        if self.recipe not in PER_TENSOR:
            return None
        return Scaler(self.recipe, self.state, self._reduce(group, sharded))

    def _reduce(self, group: Group, sharded: Sequence[str]) -> dict:
        if self.recipe != "tensorwise" and not (self.recipe == "delayed" and not self.state.started):
            return {}  # row/block scales are local; delayed reduces once per step (update_fp8)
        if group.size == 1:
            return {}
        r = max_over(group)
        return {role: r for role in sharded}

    def column_forward(self, x, weight, bias, *, group, sequence_parallel, gather_output):
        if self.ring and sequence_parallel and group.size > 1:
            y = fp8_ring_column(x, weight, bias, recipe=self.recipe, group=group, weight_casts=self.weight_casts,
                                scaler=self._scaler(group, ("weight", "grad_output")))  # (s, b, out/tp)
            return gather_from_tp(y, group) if gather_output else y
        gather = self._fp8_sequence(group, sequence_parallel)  # x stays (s/tp, b, in): cast, gathered as fp8
        if gather is None:
            x = gather_from_sp(x, group) if sequence_parallel else copy_to_tp(x, group)  # (s, b, in)
        y = fp8_linear(x, weight, bias, recipe=self.recipe, state=self.state, weight_casts=self.weight_casts,
                       amax_reduce=self._reduce(group, ("weight", "grad_output")),
                       sequence_gather=gather)  # (s, b, out/tp)
        return gather_from_tp(y, group) if gather_output else y

    def row_forward(self, x, weight, bias, *, group, sequence_parallel):
        if self.ring and sequence_parallel and group.size > 1:
            y = fp8_ring_row(x, weight, recipe=self.recipe, group=group, weight_casts=self.weight_casts,
                             scaler=self._scaler(group, ("input", "weight")))  # (s/tp, b, out)
            return y if bias is None else y + bias
        scatter = self._fp8_sequence(group, sequence_parallel)  # reduce-scattered inside; dy gathered as fp8
        y = fp8_linear(x, weight, None, recipe=self.recipe, state=self.state, weight_casts=self.weight_casts,
                       amax_reduce=self._reduce(group, ("input", "weight")),
                       sequence_scatter=scatter)  # (s/tp, b, out) with scatter, else (s, b, out) partial
        if scatter is None:
            y = reduce_scatter_to_sp(y, group) if sequence_parallel else reduce_from_tp(y, group)
        return y if bias is None else y + bias

    def _fp8_sequence(self, group: Group, sequence_parallel: bool) -> SequenceShards | None:
        """The sequence-parallel collectives fp8_linear runs itself (FP8 all-gathers), for the per-tensor
        recipes under SP; None where the layer runs the plain high-precision mappings."""
        if sequence_parallel and group.size > 1 and self.recipe in PER_TENSOR:
            return sequence_shards(group)
        return None

    def __repr__(self) -> str:
        return f"Fp8LinearImpl({self.recipe!r}{', ring=True' if self.ring else ''})"


def sequence_shards(group: Group) -> SequenceShards:
    """fp8_linear's sequence-parallel collectives over ``group`` (through parallel/comm): the FP8 all-gathers
    (in the ledger, 1 byte per element), the amax reductions and the reduce-scatters."""
    return SequenceShards(size=group.size, amax_max=max_over(group),
                          all_gather=lambda t: comm.all_gather(t, group, dim=0),  # (M/tp, K) -> (M, K)
                          reduce_scatter=lambda t: comm.reduce_scatter(t.contiguous(), group, dim=0))  # (M, K) -> (M/tp, K)


def _excluded(name: str, exclude: Iterable[str]) -> bool:
    return any(name == e or name.endswith("." + e) for e in exclude)


def fp8_linear_names(num_layers: int) -> list[str]:
    """Names ``model.fp8_exclude`` may use: per layer (``layers.<i>.mlp.fc1``) or for all layers (``mlp.fc1``)."""
    rel = ("attention.qkv", "attention.out", "mlp.fc1", "mlp.fc2")
    return [*rel, "qkv", "out", "fc1", "fc2", *(f"layers.{i}.{r}" for i in range(num_layers) for r in rel)]


def check_exclude(exclude: Sequence[str], num_layers: int) -> None:
    names = fp8_linear_names(num_layers)
    unknown = [e for e in exclude if e not in names and e not in ALWAYS_EXCLUDED]
    if unknown:
        raise ValueError(f"model.fp8_exclude names {unknown}, which match no linear; use a layer-relative name "
                         f"({', '.join(names[:4])}, or the short {', '.join(names[4:8])}) or one layer's "
                         f"(layers.<i>.mlp.fc1, i < {num_layers}). Embedding, norms and the output layer are "
                         "always high precision")


def apply_fp8(stage: nn.Module, recipe: str, *, exclude: Sequence[str] = (), history_len: int = 16,
              margin: int = 0) -> list[str]:
    """Switch ``stage``'s TP linears to FP8 in place; returns the names of the linears now in FP8.

    Shapes are checked here, before any data flows: every FP8 linear's TP-local K and N must be
    multiples of 16.
    """
    if recipe not in RECIPES:
        raise ValueError(f"model.fp8={recipe!r} is not one of {('none',) + RECIPES}")
    converted = []
    for name, mod in list(stage.named_modules()):
        if not isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if _excluded(name, (*ALWAYS_EXCLUDED, *exclude)):
            continue
        out_local, in_local = mod.weight.shape
        check_fp8_shapes(in_local, out_local, where=f"model.fp8={recipe}: linear {name} (TP-local weight "
                                                    f"{out_local} x {in_local})")
        state = None
        if recipe == "delayed":
            state = DelayedScaling(history_len=history_len, margin=margin, device=mod.weight.device)
            mod.fp8_scaling = state
        # A ring layer (parallel.tp_overlap = "ring") stays a ring, with FP8 GEMMs.
        mod.impl = Fp8LinearImpl(recipe, state=state, ring=isinstance(mod.impl, RingLinearImpl))
        converted.append(name)
    return converted


def update_fp8(module: nn.Module, groups: Sequence[Group]) -> None:
    """Once per optimizer step: all-reduce (MAX) every delayed-scaling amax of ``module`` over
    ``groups`` (TP and DP; TP only on DiLoCo's inner steps, whose replicas keep their own histories, see
    :class:`ReplicaFp8State`) in one stacked tensor per group, then update histories and scales."""
    states = [s for _, s in delayed_states(module)]
    if not states:
        return

    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        for g in groups:
            comm.all_reduce(t, g, op="max")
        return t
    update_delayed_states(states, reduce)


class ReplicaFp8State:
    """Delayed-scaling state kept per data-parallel replica: on DiLoCo's inner steps each replica reduces
    its amaxes over TP only (a dp all-reduce per inner step is the traffic DiLoCo removes), so the replicas'
    histories and scales differ between synchronisations, as their AdamW moments do. A checkpoint's
    ``fp8.*`` keys hold one replica's (replica 0 writes them); this component of the per-rank state
    (engine/checkpoint/trainer_state.py) keeps every rank's own, so a resume is exact. Keys: the layer's
    name within this rank's chunks and the buffer, e.g. ``0.layers.1.mlp.fc1.impl.state.amax_history``."""

    def __init__(self, module: nn.Module):
        self.states = delayed_states(module)

    def state_dict(self) -> dict:
        return {"layers": len(self.states)}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{buf}": t for name, state in self.states for buf, t in state.state_dict().items()}

    def load_state(self, state: dict | None, tensors: dict[str, torch.Tensor] | None) -> None:
        """``None`` (a checkpoint without per-replica FP8 state): keep the replicated ``fp8.*`` values."""
        if state is None or tensors is None:
            return
        mine = self.state_tensors()
        for key, t in mine.items():
            t.copy_(tensors[key])


def fp8_impls(module: nn.Module) -> list[Fp8LinearImpl]:
    """The :class:`Fp8LinearImpl` of every FP8 linear of ``module``, in module order."""
    return [m.impl for m in module.modules() if isinstance(getattr(m, "impl", None), Fp8LinearImpl)]


@contextlib.contextmanager
def fp8_weight_casts(module: nn.Module, enabled: bool = True) -> Iterator[list[WeightCasts]]:
    """While open, every FP8 linear of ``module`` casts its weight once and reuses the casts; the caller
    promises that no weight changes inside (the trainer: one step's micro-batches, forward, recompute and
    backward; evaluation). On exit the casts are dropped. Yields the caches (empty when disabled or when
    no linear is in FP8); a scope already open on a linear is left to its owner (nesting is harmless)."""
    if not enabled:
        yield []
        return
    mine = [impl for impl in fp8_impls(module) if impl.weight_casts is None]
    caches = [WeightCasts() for _ in mine]
    for impl, cache in zip(mine, caches):
        impl.weight_casts = cache
    try:
        yield caches
    finally:
        for impl, cache in zip(mine, caches):
            cache.close()
            impl.weight_casts = None


def weight_casts_enabled(setting: bool | None, *, zero_stage: int, cuda_graph: str = "none") -> bool:
    """``model.fp8_weight_cache``: unset means on, except under ZeRO-3, where holding every layer's FP8
    weight for the whole step would undo the sharding of the parameters, and under ``model.cuda_graph``,
    whose graphs replay the casts they captured (the config refuses it set true there)."""
    if cuda_graph != "none":
        return False
    return setting if setting is not None else zero_stage != 3
