"""The ShardedTensor protocol: a local tensor piece and where it sits in a logical global tensor.

Every tensor a rank saves or loads is described by

* ``key``: the logical name (the same on every rank and in every parallel layout);
* ``global_shape`` / dtype: the logical tensor as one device would hold it;
* ``global_offset`` + ``local_shape``: the rectangular slice this piece covers;
* optionally ``flat_range = (start, end)``: the piece holds only elements ``[start, end)`` of the
  row-major flattening of that rectangular slice (a distributed optimizer's share of a parameter);
* ``replica_id``: identical copies (data-parallel replicas, a TP-replicated norm on every TP rank)
  share their placement; only ``replica_id == 0`` is written, every copy is filled on load;
* ``allow_shape_mismatch``: the logical tensor is padded along dim 0 by an amount that depends on
  the layout (a vocab padded to a multiple of ``128 * tp``): on load, rows present in both are
  read, target rows beyond the saved ones are zeroed, saved rows beyond the target are skipped.

Internally a piece is a list of :class:`Box` es: axis-aligned boxes in global coordinates, each
contiguous in the piece's storage. A rectangular piece is one box; a flat range decomposes into at
most ``2 * ndim - 1`` boxes. Saving checks that the written boxes of each key tile the global
tensor exactly; loading intersects the boxes a rank needs with the saved ones, whatever the layouts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from engine.checkpoint.format import CheckpointError, dtype_name


@dataclass(frozen=True)
class Box:
    """A box in global coordinates, stored contiguously (row-major) from ``flat_start`` of its piece."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    flat_start: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape))


def intersect(a: Box, b: Box) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(lo, hi) corners of ``a & b`` in global coordinates, or None when they do not meet."""
    lo = tuple(max(x, y) for x, y in zip(a.offset, b.offset))
    hi = tuple(min(x, y) for x, y in zip(a.end, b.end))
    if any(l >= h for l, h in zip(lo, hi)):
        return None
    return lo, hi


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Decompose elements ``[start, end)`` of a row-major ``shape`` into boxes (local coordinates).

    Each box is a run of full trailing sub-blocks, so it is contiguous in the flat order;
    ``flat_start`` is relative to ``start``.
    """
    shape = tuple(shape)
    assert 0 <= start < end <= math.prod(shape), (shape, start, end)
    if not shape:
        return [Box((), (), 0)]
    inner = math.prod(shape[1:])
    out: list[Box] = []

    def sub(row: int, s: int, e: int) -> None:
        # Elements [s, e) of row `row` (relative to the row): recurse into the trailing dims.
        for b in flat_range_boxes(shape[1:], s, e):
            out.append(Box((row, *b.offset), (1, *b.shape), row * inner + s + b.flat_start - start))

    r0, r1 = start // inner, (end - 1) // inner  # first and last row touched
    if r0 == r1:
        sub(r0, start - r0 * inner, end - r0 * inner)
        return out
    full_lo = r0
    if start % inner:
        sub(r0, start % inner, inner)
        full_lo = r0 + 1
    full_hi = r1 + 1 if end % inner == 0 else r1  # exclusive
    if full_hi > full_lo:
        out.append(Box((full_lo, *([0] * (len(shape) - 1))), (full_hi - full_lo, *shape[1:]),
                       full_lo * inner - start))
    if end % inner:
        sub(r1, 0, end % inner)
    return out


def _int_tuple(value, *, name: str, key: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value)
    except TypeError:
        raise ValueError(f"ShardedTensor {key!r}: {name}={value!r} must be a sequence of ints") from None
    if any(v < 0 for v in out):
        raise ValueError(f"ShardedTensor {key!r}: {name}={out} has a negative entry")
    return out


@dataclass(frozen=True, kw_only=True, eq=False)
class ShardedTensor:
    """One local piece of a logical tensor (see the module docstring).

    Promises after construction: ``data.shape == local_shape`` for a rectangular piece, or ``data``
    is 1-D with ``end - start`` elements when ``flat_range`` is set; the slice lies inside
    ``global_shape``; the logical dtype is ``data.dtype``. ``data`` may be a view: saving reads it,
    loading writes into it.
    """

    key: str
    data: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...] | None = None
    local_shape: tuple[int, ...] | None = None
    flat_range: tuple[int, int] | None = None
    replica_id: int = 0
    allow_shape_mismatch: bool = False

    def __post_init__(self):
        key = self.key
        if not isinstance(key, str) or not key:
            raise ValueError(f"ShardedTensor key={key!r} must be a non-empty string")
        if not isinstance(self.data, torch.Tensor):
            raise ValueError(f"ShardedTensor {key!r}: data must be a torch.Tensor, got {type(self.data).__name__}")
        dtype_name(self.data.dtype)  # supported dtype
        gshape = _int_tuple(self.global_shape, name="global_shape", key=key)
        local = self.local_shape if self.local_shape is not None else (
            self.data.shape if self.flat_range is None else None)
        if local is None:
            raise ValueError(f"ShardedTensor {key!r}: a flat_range piece needs local_shape (the shape of the "
                             "rectangular slice the range indexes into)")
        local = _int_tuple(local, name="local_shape", key=key)
        offset = _int_tuple(self.global_offset if self.global_offset is not None else (0,) * len(gshape),
                            name="global_offset", key=key)
        if not (len(gshape) == len(offset) == len(local)):
            raise ValueError(f"ShardedTensor {key!r}: global_shape {gshape}, global_offset {offset} and "
                             f"local_shape {local} must have the same number of dims")
        for d, (g, o, n) in enumerate(zip(gshape, offset, local)):
            if o + n > g:
                raise ValueError(f"ShardedTensor {key!r}: dim {d} slice [{o}, {o + n}) lies outside the global "
                                 f"size {g}; check global_offset/local_shape")
        flat = None
        if self.flat_range is not None:
            flat = _int_tuple(self.flat_range, name="flat_range", key=key)
            if len(flat) != 2 or not 0 <= flat[0] < flat[1] <= math.prod(local):
                raise ValueError(f"ShardedTensor {key!r}: flat_range={flat} must be (start, end) with "
                                 f"0 <= start < end <= {math.prod(local)} (elements of local_shape {local})")
            if self.data.dim() != 1 or self.data.numel() != flat[1] - flat[0]:
                raise ValueError(f"ShardedTensor {key!r}: a flat_range piece needs 1-D data of "
                                 f"{flat[1] - flat[0]} elements, got shape {tuple(self.data.shape)}")
        elif tuple(self.data.shape) != local:
            raise ValueError(f"ShardedTensor {key!r}: data shape {tuple(self.data.shape)} differs from "
                             f"local_shape {local}")
        if math.prod(local) == 0:
            raise ValueError(f"ShardedTensor {key!r}: empty piece (local_shape {local}); leave it out instead")
        if isinstance(self.replica_id, bool) or not isinstance(self.replica_id, int) or self.replica_id < 0:
            raise ValueError(f"ShardedTensor {key!r}: replica_id={self.replica_id!r} must be an int >= 0")
        object.__setattr__(self, "global_shape", gshape)
        object.__setattr__(self, "global_offset", offset)
        object.__setattr__(self, "local_shape", local)
        object.__setattr__(self, "flat_range", flat)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def numel(self) -> int:
        return self.data.numel()

    def boxes(self) -> list[Box]:
        return piece_boxes(self.global_offset, self.local_shape, self.flat_range)

    def describe(self) -> dict:
        """JSON description of the placement (no data)."""
        return {"key": self.key, "shape": list(self.global_shape), "dtype": dtype_name(self.dtype),
                "offset": list(self.global_offset), "local_shape": list(self.local_shape),
                "flat_range": list(self.flat_range) if self.flat_range else None, "replica_id": self.replica_id}

    # -- constructors for the common cases ---------------------------------------------------------
    @classmethod
    def replicated(cls, key: str, data: torch.Tensor, *, replica_id: int = 0) -> "ShardedTensor":
        """The whole logical tensor (global == local), e.g. a norm weight; one copy per ``replica_id``."""
        return cls(key=key, data=data, global_shape=tuple(data.shape), replica_id=replica_id)

    @classmethod
    def chunked(cls, key: str, data: torch.Tensor, *, dim: int, rank: int, size: int,
                replica_id: int = 0) -> "ShardedTensor":
        """Block ``rank`` of ``size`` equal blocks along ``dim`` (a plain TP shard)."""
        if not 0 <= rank < size:
            raise ValueError(f"ShardedTensor {key!r}: rank={rank} must lie in 0..{size - 1}")
        dim = dim % data.dim()
        gshape = list(data.shape)
        gshape[dim] *= size
        offset = [0] * data.dim()
        offset[dim] = rank * data.shape[dim]
        return cls(key=key, data=data, global_shape=tuple(gshape), global_offset=tuple(offset),
                   replica_id=replica_id)


def piece_boxes(offset: Sequence[int], local_shape: Sequence[int], flat_range) -> list[Box]:
    """The boxes (global coordinates) of a piece described by offset/local_shape/flat_range."""
    offset, local_shape = tuple(offset), tuple(local_shape)
    if flat_range is None:
        return [Box(offset, local_shape, 0)]
    boxes = flat_range_boxes(local_shape, int(flat_range[0]), int(flat_range[1]))
    return [Box(tuple(o + b for o, b in zip(offset, bx.offset)), bx.shape, bx.flat_start) for bx in boxes]


def check_tiling(key: str, global_shape: Sequence[int], pieces: Iterable[tuple[str, list[Box]]]) -> None:
    """Raise CheckpointError unless the boxes of ``pieces`` (label, boxes) tile ``global_shape`` exactly.

    Checked as: every pair of boxes is disjoint (a sweep along dim 0) and their volumes sum to the
    global element count, which together mean every element is covered exactly once.
    """
    labelled = [(b, label) for label, boxes in pieces for b in boxes]
    total = math.prod(global_shape)
    covered = sum(b.numel for b, _ in labelled)
    labelled.sort(key=lambda x: x[0].offset)
    active: list[tuple[Box, str]] = []
    for b, label in labelled:
        if b.offset:
            active = [(a, la) for a, la in active if a.end[0] > b.offset[0]]
        for a, la in active:
            if intersect(a, b) is not None:
                raise CheckpointError(
                    f"tensor {key!r}: pieces overlap ({la} and {label} both cover offset "
                    f"{intersect(a, b)[0]}); every element must be written by exactly one piece: give the "
                    "other copies replica_id > 0")
        active.append((b, label))
    if covered != total:
        raise CheckpointError(
            f"tensor {key!r} of global shape {tuple(global_shape)}: the pieces with replica_id 0 cover "
            f"{covered} of {total} elements; a rank did not pass its shard, or no copy has replica_id 0")
