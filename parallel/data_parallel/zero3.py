"""ZeRO-3: parameters sharded over the data-parallel group, gathered one unit at a time.

A **unit** is what is gathered and freed together: each repeated block of a model chunk (the
children of the first ``ModuleList``/``ModuleDict`` found under the chunk: the transformer layers)
is a unit, and the chunk's remaining parameters (embedding, final norm, output layer) form its
**root unit**. :class:`DataParallel` lays its buckets out so that no bucket spans two units; a
unit owns one or more buckets.

The life of a layer unit in one micro-batch:

* **forward**: a forward pre-hook on the layer waits for its gather (or gathers it now) and
  launches the asynchronous gather of the next layer (prefetch, overlapped with this layer's
  compute); a forward hook frees the gathered storage again and hooks the layer's output.
* **backward**: when the output's gradient is ready (the layer's backward is about to run) the
  output hook gathers the layer again (or waits for the prefetch) and prefetches the layer before
  it. Views autograd saved in forward share the bucket's storage, so they are valid again. A
  layer that recomputes its forward in backward (full activation recompute) runs it under these
  gathered parameters. When every parameter of the unit has received its gradient, the unit's
  buckets are reduce-scattered (by :class:`DataParallel`) and the gathered storage is freed.

The root unit is gathered by a pre-hook on the chunk and stays gathered while any forward of the
chunk awaits its backward (``holds``): the output layer and the tied embedding are read outside
their own modules' forward, and pipelines run several micro-batches' forwards before their
backwards. A forward without gradients (evaluation) frees everything it gathered at its end.

Outside a gather a parameter's ``.data`` is an empty placeholder (0 elements): code that reads a
sharded parameter where it is not gathered fails with a shape error instead of reading freed memory.
:meth:`Gatherer.full_shapes` shows the full shapes without data (for code that only inspects
them: optimizer groups, checkpoint layouts), :meth:`Gatherer.gathered` gathers everything (a
collective) for reading values.

Collectives are issued from hooks in graph order, identical on every data-parallel rank (they
run the same schedule on the same model), so the gathers and reduce-scatters match across ranks.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from parallel import comm
from parallel.data_parallel.buffers import Bucket, ParamAndGradBuffer, alloc_storage, free_storage


def find_units(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The repeated blocks of ``root``: the children of the first ModuleList/ModuleDict on each path
    from ``root`` (named by their path). Model-agnostic: for a TransformerStage, its layers."""
    units: list[tuple[str, torch.nn.Module]] = []

    def visit(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                units.extend((f"{path}.{n}", m) for n, m in child.named_children())
            else:
                visit(path + ".", child)
    visit("", root)
    return units


@dataclass(eq=False)
class Unit:
    """Parameters gathered and freed together (a layer, or a chunk's root parameters)."""

    index: int
    name: str
    chunk: int
    root: bool
    module: torch.nn.Module = field(repr=False)
    params: list[torch.nn.Parameter] = field(repr=False)
    buckets: list[tuple[ParamAndGradBuffer, Bucket]] = field(default_factory=list, repr=False)
    gathered: bool = False
    works: list = field(default_factory=list)  # gathers in flight: (work, group)
    holds: int = 0  # root: forwards with gradients whose backward has not completed
    pending: set[int] = field(default_factory=set)  # parameters without a gradient in this backward


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []


class Gatherer:
    """The units of a ZeRO-3 :class:`DataParallel` and the hooks that gather and free them.

    ``units`` in forward order per chunk (root first); ``unit_of[id(param)]``. ``group_of(buffer)``: the
    group a buffer's buckets are sharded over (dp; edp for expert buffers). Counters for tests and
    the memory report: ``gathered_bytes`` now and ``gathered_bytes_peak``.
    """

    def __init__(self, units: list[Unit], *, group_of: Callable[[ParamAndGradBuffer], comm.Group]):
        self.units = units
        self.group_of = group_of
        self.unit_of = {id(p): u for u in units for p in u.params}
        self.gathered_bytes = 0
        self.gathered_bytes_peak = 0
        self._handles = []
        # Each parameter's full-shaped view into its bucket's gathered storage, and an empty placeholder
        # per (dtype, device) that it points to while freed.
        self._views: dict[int, list[tuple[torch.nn.Parameter, torch.Tensor]]] = {}
        self._empty: dict[tuple, torch.Tensor] = {}
        for u in units:
            views = self._views.setdefault(u.index, [])
            for _, b in u.buckets:
                alloc_storage(b.full)  # views are bounds-checked when made: made once, with bytes behind them
                for p, (s, e) in zip(b.params, b.ranges):
                    views.append((p, b.full[s:e].view(p.shape)))
                free_storage(b.full)
            self._point(u, gathered=False)
        by_chunk: dict[int, list[Unit]] = {}
        for u in units:
            by_chunk.setdefault(u.chunk, []).append(u)
        self._layers = {c: [u for u in us if not u.root] for c, us in by_chunk.items()}
        for u in units:
            if u.root:
                self._handles.append(u.module.register_forward_pre_hook(self._root_pre(u)))
                self._handles.append(u.module.register_forward_hook(self._root_post(u)))
            else:
                self._handles.append(u.module.register_forward_pre_hook(self._layer_pre(u)))
                self._handles.append(u.module.register_forward_hook(self._layer_post(u)))

    # -- gather / free ------------------------------------------------------------------------------
    def _point(self, unit: Unit, *, gathered: bool) -> None:
        """Point the unit's parameters at their gathered views, or at an empty placeholder."""
        for p, view in self._views[unit.index]:
            if gathered:
                p.data = view
            else:
                key = (p.dtype, p.device)
                if key not in self._empty:
                    self._empty[key] = torch.empty(0, dtype=p.dtype, device=p.device)
                p.data = self._empty[key]

    def gather(self, unit: Unit) -> None:
        """Launch the asynchronous all-gather of ``unit`` (no-op when gathered or in flight)."""
        if unit.gathered or unit.works:
            return
        for buf, b in unit.buckets:
            group = self.group_of(buf)
            alloc_storage(b.full)
            self.gathered_bytes += b.full.numel() * b.full.element_size()
            shard = buf.param_data[b.start // group.size:b.end // group.size]
            _, work = comm.all_gather(shard, group, async_op=True, out=b.full)
            unit.works.append((work, group))
        self.gathered_bytes_peak = max(self.gathered_bytes_peak, self.gathered_bytes)

    def ensure(self, unit: Unit) -> None:
        """``unit``'s full parameters are in place on return."""
        self.gather(unit)
        if unit.works:
            self._wait(unit)
        if not unit.gathered:
            self._point(unit, gathered=True)
        unit.gathered = True

    def _wait(self, unit: Unit) -> None:
        for work, group in unit.works:
            comm.wait(work, group)
        unit.works = []

    def free(self, unit: Unit) -> None:
        if unit.works:  # a prefetch nobody used: let it land before releasing its storage
            self._wait(unit)
        if not unit.gathered:
            return
        for _, b in unit.buckets:
            self.gathered_bytes -= b.full.numel() * b.full.element_size()
            free_storage(b.full)
        self._point(unit, gathered=False)
        unit.gathered = False

    def release_all(self) -> None:
        """Free every unit and forget in-flight forwards (end of a step)."""
        for u in self.units:
            self.free(u)
            u.holds = 0
            u.pending.clear()

    @contextlib.contextmanager
    def full_shapes(self):
        """Inside: every parameter has its full shape, but no data where it is not gathered (read
        shapes and attributes only; no communication)."""
        freed = [u for u in self.units if not u.gathered]
        for u in freed:
            for p, view in self._views[u.index]:
                p.data = view
        try:
            yield
        finally:
            for u in freed:
                if not u.gathered:
                    self._point(u, gathered=False)

    @contextlib.contextmanager
    def gathered(self):
        """Inside: every parameter gathered and readable (a collective over the dp (and edp) groups: every rank
        enters it). Values written inside are lost: the shards are the parameters."""
        before = [u for u in self.units if u.gathered]
        for u in self.units:
            self.gather(u)
        for u in self.units:
            self.ensure(u)
        try:
            yield
        finally:
            for u in self.units:
                if u not in before:
                    self.free(u)

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        layers = self._layers[unit.chunk]
        i = layers.index(unit) + step if not unit.root else (0 if step > 0 else -1)
        return layers[i] if 0 <= i < len(layers) else None

    # -- hooks ----------------------------------------------------------------------------------------
    def _root_pre(self, unit: Unit):
        def hook(module, args):
            self.ensure(unit)
            nxt = self._neighbour(unit, +1)
            if nxt is not None:
                self.gather(nxt)
        return hook

    def _root_post(self, unit: Unit):
        def hook(module, args, output):
            if any(t.requires_grad for t in _tensors(output)) and torch.is_grad_enabled():
                unit.holds += 1
            elif unit.holds == 0 and not _in_backward():
                self.free(unit)
            return output
        return hook

    def _layer_pre(self, unit: Unit):
        def hook(module, args):
            self.ensure(unit)
            nxt = self._neighbour(unit, +1)
            if nxt is not None and not _in_backward():
                self.gather(nxt)
        return hook

    def _layer_post(self, unit: Unit):
        def hook(module, args, output):
            if _in_backward():  # a recompute inside backward: the unit stays until its gradients are done
                return output
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._before_backward(unit))
            self.free(unit)
            return output
        return hook

    def _before_backward(self, unit: Unit):
        def hook(grad):
            self.ensure(unit)
            prev = self._neighbour(unit, -1)
            if prev is not None:
                self.gather(prev)
            return grad
        return hook

    def grad_arrived(self, p: torch.nn.Parameter) -> Unit | None:
        """Note ``p``'s gradient for this backward; returns its unit when that completed the unit
        (the caller then reduces the unit's buckets and calls :meth:`backward_done`)."""
        unit = self.unit_of[id(p)]
        if not unit.pending:
            unit.pending = {id(q) for q in unit.params}
        unit.pending.discard(id(p))
        return None if unit.pending else unit

    def backward_done(self, unit: Unit) -> None:
        if unit.root:
            unit.holds = max(0, unit.holds - 1)
            if unit.holds:
                return
        self.free(unit)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
