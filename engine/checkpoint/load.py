"""Loading a sharded checkpoint into any layout, reading only the slices each rank needs.

Every rank passes the ShardedTensors it wants filled (its parameters and, for a full resume, its
optimizer shards). For each target box the loader finds the saved boxes of the same key that
intersect it and reads just the intersection with ``safetensors.safe_open(...).get_slice`` (the
rows it spans, for a flat-range piece), so foreign shards are never loaded whole. The same code
serves an exact resume (each rank reads its own file), a resharding resume (TP/PP/DP changed), and a
model-only load for fine-tuning (pass only the model's tensors; optimizer entries are ignored).

Checks before anything is read, raised on every rank: the path (missing, foreign, incomplete),
tensors the checkpoint lacks (listed), global shape and dtype mismatches (named, saved vs
expected). With ``verify=True`` the sha256 of every file that is read is checked first; each file
is hashed by one rank only (the lowest rank that needs it).

A peer replica (``checkpoint.peer_replica``, :mod:`engine.checkpoint.peer`) is loaded through the same plan:
``path`` is then a :class:`~engine.checkpoint.peer.ReplicaSource`, whose metadata and files come from the
ranks' node-local copies over the process group, and no file of the checkpoint directory is opened
(``LoadResult.files_opened`` counts the checkpoint files this rank opened: 0 then).
"""
from __future__ import annotations

import math
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open

from engine.checkpoint import _dist
from engine.checkpoint.format import (CheckpointError, dtype_name, from_json_state, list_checkpoints, parse_step,
                                      read_metadata, resolve_checkpoint, safetensors_code, to_json_state)
from engine.checkpoint.safetensors_io import pread_exact, read_safetensors_header, verify_files
from engine.checkpoint.sharded import Box, ShardedTensor, intersect, piece_boxes
from parallel.comm import Group


@dataclass
class LoadResult:
    """What a load restored besides the tensors.

    ``rank_state`` is this rank's saved JSON state (RNG states...) when the checkpoint was written
    by the same number of ranks in the same ``layout``, else None (the caller re-seeds).
    ``missing`` lists target keys absent from the checkpoint (only with ``strict=False``, or ``optional`` ones).
    """

    path: Path
    step: int
    trainer_state: dict | None
    model_config: dict | None
    layout: dict | None
    rank_state: dict | None
    missing: list[str] = field(default_factory=list)
    metadata: dict = field(default_factory=dict, repr=False)
    files_opened: int = 0  # checkpoint files this rank opened (metadata, hashed and read shards); 0 from a replica
    source: str = "disk"   # "disk" or "peer replica"


@dataclass(frozen=True)
class _Read:
    file: str
    name: str
    src_offset: tuple[int, ...]      # saved piece: global offset of its rectangle
    src_shape: tuple[int, ...]       # ... and its local shape
    src_box: Box | None              # saved flat piece: the box the intersection lies in (None: rectangular)
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    target: ShardedTensor
    dst_box: Box


def _resolve_everywhere(path, group: Group | None) -> Path:
    """Rank 0 resolves ``path`` (auto-resume included, warnings once); every rank gets its answer."""
    answer = {"path": None, "error": None}
    if _dist.group_rank(group) == 0:
        try:
            answer["path"] = str(resolve_checkpoint(path))
        except CheckpointError as e:
            answer["error"] = str(e)
    answer = _dist.all_gather_json(answer, group)[0]
    if answer["error"]:
        raise CheckpointError(answer["error"])
    return Path(answer["path"])


def _check_targets(meta: dict, tensors: Sequence[ShardedTensor], *, strict: bool,
                   allow_dtype_cast: bool, path: Path, optional: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """(missing keys, problems) of the targets against the metadata."""
    saved = meta["tensors"]
    missing, problems = [], []
    for t in tensors:
        if not isinstance(t, ShardedTensor):
            problems.append(f"load targets must be ShardedTensor, got {type(t).__name__}")
            continue
        entry = saved.get(t.key)
        if entry is None:
            if t.key not in missing:
                missing.append(t.key)
            continue
        saved_shape = tuple(entry["shape"])
        padded_only = (t.allow_shape_mismatch and len(saved_shape) == len(t.global_shape) > 0
                       and saved_shape[1:] == t.global_shape[1:])
        if saved_shape != t.global_shape and not padded_only:
            hint = " (only dim 0, the padding, may differ)" if t.allow_shape_mismatch else ""
            problems.append(f"tensor {t.key!r}: checkpoint has global shape {saved_shape}, the model "
                            f"expects {t.global_shape}{hint}")
        elif entry["dtype"] != dtype_name(t.dtype) and not allow_dtype_cast:
            problems.append(f"tensor {t.key!r}: checkpoint has dtype {entry['dtype']}, the model expects "
                            f"{dtype_name(t.dtype)} (pass allow_dtype_cast=True to convert)")
    if problems:  # the cause first, a few examples, never the whole model (a long list drowns the cause)
        n = len(problems)
        problems = [f"checkpoint {path} was saved from a different model configuration: {n} tensor(s) do not match "
                    f"this model, e.g. " + "; ".join(problems[:3]) + (f"; and {n - 3} more" if n > 3 else "")
                    + f" (the checkpoint's model_config: {json.dumps(meta.get('model_config'), sort_keys=True)[:1000]})"]
    required = [k for k in missing if not k.startswith(tuple(optional))]
    if required and strict:
        shown = ", ".join(repr(k) for k in required[:20]) + (f" and {len(required) - 20} more" if len(required) > 20
                                                             else "")
        problems.insert(0, f"checkpoint {path} lacks {len(required)} tensor(s) the model expects: {shown} (it holds "
                           f"{len(saved)} tensors; pass strict=False to load a model-only subset)")
    return missing, problems


def _plan_reads(meta: dict, tensors: Sequence[ShardedTensor], missing: list[str]) -> list[_Read]:
    saved_boxes: dict[str, list[tuple[Box, dict]]] = {}
    reads: list[_Read] = []
    for t in tensors:
        if t.key in missing:
            continue
        if t.key not in saved_boxes:
            entry = meta["tensors"][t.key]
            saved_boxes[t.key] = [(b, pc) for pc in entry["pieces"]
                                  for b in piece_boxes(pc["offset"], pc["local_shape"], pc["flat_range"])]
        saved_shape = tuple(meta["tensors"][t.key]["shape"])
        for dst in t.boxes():
            covered = 0
            expected = dst.numel
            if saved_shape != t.global_shape:  # padded dim 0 (allow_shape_mismatch): zero the rows the save lacks
                rows = saved_shape[0]
                expected = max(0, min(dst.end[0], rows) - dst.offset[0]) * (dst.numel // dst.shape[0])
                if dst.end[0] > rows:
                    lo = (max(dst.offset[0], rows), *dst.offset[1:])
                    reads.append(_Read(file="", name="", src_offset=(), src_shape=(), src_box=None, lo=lo,
                                       hi=dst.end, target=t, dst_box=dst))
            for src, pc in saved_boxes[t.key]:
                hit = intersect(src, dst)
                if hit is None:
                    continue
                lo, hi = hit
                covered += math.prod(h - l for l, h in zip(lo, hi))
                reads.append(_Read(file=pc["file"], name=pc["name"], src_offset=tuple(pc["offset"]),
                                   src_shape=tuple(pc["local_shape"]), src_box=src if pc["flat_range"] is not None else None, lo=lo, hi=hi,
                                   target=t, dst_box=dst))
            if covered != expected:
                raise CheckpointError(f"tensor {t.key!r}: the checkpoint's pieces cover {covered} of the {expected} "
                                      f"elements at offset {dst.offset}; the metadata is corrupt")
    return reads


def _verify_files(step_dir: Path, meta: dict, needed: set[str], group: Group | None) -> int:
    """sha256 of every needed file, each hashed by the lowest rank needing it; raises on every rank.
    Returns the number of files this rank hashed (opened)."""
    all_needed = _dist.all_gather_json(sorted(needed), group)
    rank = _dist.group_rank(group)
    mine = [f for f in sorted(needed) if min(r for r, n in enumerate(all_needed) if f in n) == rank]
    errors = verify_files(step_dir, meta["files"], mine)
    errors = [e for errs in _dist.all_gather_json(errors, group) for e in errs]
    if errors:
        current = parse_step(step_dir.name)
        earlier = [p for step, p in list_checkpoints(step_dir.parent) if current is not None and step < current]
        way_out = (f"move {step_dir} aside (keep it to inspect) to fall back to {earlier[-1].name}, the newest "
                   f"complete checkpoint before it, or load {earlier[-1]} directly" if earlier else
                   f"there is no complete checkpoint before {step_dir.name} in {step_dir.parent}")
        err = CheckpointError(f"{'; '.join(errors)}. Checkpoint {step_dir.name} is damaged: {way_out}")
        err.on_every_rank = True
        raise err
    return len(mine)


def _box_index(lo, hi, origin) -> tuple[slice, ...]:
    return tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, origin))


def _read_source(f, r: _Read):
    sl = f.get_slice(r.name)
    if r.src_box is None:
        if not r.lo:
            return f.get_tensor(r.name)
        return sl[_box_index(r.lo, r.hi, r.src_offset)]
    # Flat piece: read the rows of the contiguous box that the intersection spans, then cut.
    box = r.src_box
    if not box.shape:
        return sl[box.flat_start:box.flat_start + 1].reshape(())
    inner = math.prod(box.shape[1:])
    row_lo, row_hi = r.lo[0] - box.offset[0], r.hi[0] - box.offset[0]
    rows = sl[box.flat_start + row_lo * inner:box.flat_start + row_hi * inner]
    rows = rows.reshape(row_hi - row_lo, *box.shape[1:])  # (rows, trailing box dims)
    return rows[(slice(None), *_box_index(r.lo[1:], r.hi[1:], box.offset[1:]))]


def _target_view(r: _Read):
    t = r.target
    if t.flat_range is None:
        return t.data[_box_index(r.lo, r.hi, t.global_offset)] if r.lo else t.data
    box = r.dst_box
    view = t.data[box.flat_start:box.flat_start + box.numel].view(box.shape)  # (box dims)
    return view[_box_index(r.lo, r.hi, box.offset)] if r.lo else view


def _contiguous_start(shape: Sequence[int], lo: Sequence[int], hi: Sequence[int]) -> int | None:
    """Row-major element offset of box [lo, hi) inside ``shape`` when the box is one contiguous run, else None.

    Contiguous means: extent 1 in the leading dims, anything in one dim, full in every trailing dim.
    """
    k = next((d for d in range(len(shape)) if hi[d] - lo[d] > 1), len(shape))
    if any(lo[d] != 0 or hi[d] != shape[d] for d in range(k + 1, len(shape))):
        return None
    start, stride = 0, 1
    for d in reversed(range(len(shape))):
        start += lo[d] * stride
        stride *= shape[d]
    return start


def _source_run(r: _Read) -> int | None:
    """Element offset, within the stored tensor, of the read's region when it is one contiguous run."""
    if r.src_box is None:
        return _contiguous_start(r.src_shape, [l - o for l, o in zip(r.lo, r.src_offset)],
                                 [h - o for h, o in zip(r.hi, r.src_offset)])
    box = r.src_box
    inside = _contiguous_start(box.shape, [l - o for l, o in zip(r.lo, box.offset)],
                               [h - o for h, o in zip(r.hi, box.offset)])
    return None if inside is None else box.flat_start + inside


def _pread_into(fd: int, view: torch.Tensor, offset: int, path: Path) -> None:
    pread_exact(fd, memoryview(view.reshape(-1).view(torch.uint8).numpy()), offset, what=f"cannot read {path}")


class _MemoryFile:
    """A safetensors file held in memory (a peer replica), read with the same slicing as ``safe_open``."""

    def __init__(self, data):
        from safetensors.torch import load as load_bytes

        self._tensors = load_bytes(bytes(data))

    def get_slice(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]


def _execute(step_dir: Path, reads: list[_Read], memory: dict | None = None) -> int:
    """Fill every target region; returns the number of files opened. A region that is one contiguous run in
    the file and in a contiguous CPU target of the same dtype is read straight into the target (one
    ``preadv``, no copy); anything else goes through ``safe_open(...).get_slice``. ``memory`` (file name ->
    bytes, a peer replica): every region is cut from those bytes and no file is opened."""
    by_file: dict[str, list[_Read]] = {}
    for r in reads:
        if not r.file:  # padding rows the checkpoint does not have
            _target_view(r).zero_()
            continue
        by_file.setdefault(r.file, []).append(r)
    if memory is not None:
        for fname, rs in sorted(by_file.items()):
            f = _MemoryFile(memory[fname])
            for r in rs:
                _target_view(r).copy_(_read_source(f, r))
        return 0
    opened = 0
    for fname, rs in sorted(by_file.items()):
        p = step_dir / fname
        try:
            fd = os.open(p, os.O_RDONLY)
            opened += 1
            try:
                base, header = read_safetensors_header(fd, p)
                slow = []
                for r in rs:
                    view, run = _target_view(r), _source_run(r)
                    info = header.get(r.name)
                    if (run is not None and info is not None and view.device.type == "cpu" and view.is_contiguous()
                            and info["dtype"] == safetensors_code(view.dtype)):
                        _pread_into(fd, view, base + info["data_offsets"][0] + run * view.element_size(), p)
                    else:
                        slow.append((r, view))
            finally:
                os.close(fd)
            if slow:
                opened += 1
                with safe_open(str(p), framework="pt", device="cpu") as f:
                    for r, view in slow:
                        view.copy_(_read_source(f, r))
        except (OSError, RuntimeError, ValueError) as e:  # safetensors raises SafetensorError(ValueError/RuntimeError)
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"cannot read {p}: {e}") from e
    return opened


def _unclaimed(meta: dict, tensors: Sequence[ShardedTensor], prefix: str, group: Group | None) -> list[str]:
    """The saved keys starting with ``prefix`` that no rank of ``group`` loads (collective: one bitmap per
    rank over the saved keys, in the metadata's order, which every rank reads alike)."""
    saved = sorted(k for k in meta.get("tensors", {}) if k.startswith(prefix))
    mine = {t.key for t in tensors if isinstance(t, ShardedTensor)}
    bits = sum(1 << i for i, k in enumerate(saved) if k in mine)
    claimed = 0
    for b in _dist.all_gather_json(format(bits, "x"), group):  # a hex bitmap: a few hundred bytes per rank
        claimed |= int(b, 16)
    return [k for i, k in enumerate(saved) if not claimed >> i & 1]


def load_checkpoint(path: str | os.PathLike, *, tensors: Sequence[ShardedTensor] = (), group: Group | None = None,
                    layout: dict | None = None, strict: bool = True, verify: bool = True,
                    allow_dtype_cast: bool = False, optional: Sequence[str] = (),
                    unexpected: str | None = None, check_meta=None) -> LoadResult:
    """Fill ``tensors`` (this rank's ShardedTensors, written in place) from a checkpoint (collective).

    ``path`` is a step directory or a checkpoint root (then the newest complete checkpoint is used:
    auto-resume). ``layout`` is the current parallel layout; the saved per-rank state is returned
    only when it equals the saved one. Keys starting with a prefix in ``optional`` may be absent even
    when ``strict`` (they keep their current values and are listed in ``LoadResult.missing``).
    ``unexpected`` (with ``strict``): a key prefix (e.g. "model.") under which every saved tensor must be
    loaded by some rank of ``group``; one nobody loads (a deeper model's layers, an untied head into a tied
    model) is a problem, not silently dropped. ``check_meta(metadata) -> [problems]``: the caller's own
    checks of the metadata, before anything is read. Raises CheckpointError on every rank for the
    problems listed in the module docstring, before any tensor is written.
    """
    from engine.checkpoint.peer import ReplicaSource

    replica = path if isinstance(path, ReplicaSource) else None
    step_dir = replica.path if replica is not None else _resolve_everywhere(path, group)
    problems: list[str] = []
    missing: list[str] = []
    reads: list[_Read] = []
    meta: dict = {}
    opened = 0
    try:
        if replica is not None:
            meta = replica.meta
        else:
            opened += 1
            meta = read_metadata(step_dir)
        missing, problems = _check_targets(meta, tensors, strict=strict, allow_dtype_cast=allow_dtype_cast,
                                           path=step_dir, optional=optional)
        if check_meta is not None:
            problems += check_meta(meta)
        if not problems:
            reads = _plan_reads(meta, tensors, missing)
    except CheckpointError as e:
        problems = [str(e)]
    if unexpected is not None and strict:  # collective: every rank runs it (an unreadable metadata: no keys)
        extra = _unclaimed(meta, tensors, unexpected, group)
        if extra:
            problems.append(f"checkpoint {step_dir} holds {len(extra)} {unexpected}* tensor(s) this model has no place "
                            f"for, e.g. {', '.join(repr(k) for k in extra[:3])}: it was saved from a different model "
                            "(more layers, an untied output layer, ...); load it into the model it was saved from, "
                            "or pass strict=False to take the tensors this model has")
    everyone = _dist.all_gather_json(problems, group)
    if any(everyone):
        rank = _dist.group_rank(group)
        mine = everyone[rank]
        others = [f"rank {r}: {'; '.join(p)}" for r, p in enumerate(everyone) if p and r != rank]
        raise CheckpointError("; ".join(mine) if mine else "load aborted: " + " | ".join(others))
    memory = None
    if replica is not None:  # the needed files from the peers' copies, sha256-checked against the metadata
        memory = replica.fetch({r.file for r in reads if r.file})
        if memory is None:  # every rank agrees (fetch says why, once): the disk checkpoint it stands for
            return load_checkpoint(step_dir, tensors=tensors, group=group, layout=layout, strict=strict,
                                   verify=verify, allow_dtype_cast=allow_dtype_cast, optional=optional,
                                   unexpected=unexpected, check_meta=check_meta)
    elif verify:
        opened += _verify_files(step_dir, meta, {r.file for r in reads if r.file}, group)
    error = None
    try:
        opened += _execute(step_dir, reads, memory)
    except CheckpointError as e:
        error = str(e)
    errors = [e for e in _dist.all_gather_json(error, group) if e]
    if errors:
        raise CheckpointError("; ".join(errors))
    rank = _dist.group_rank(group)
    same_layout = meta.get("world_size") == _dist.group_size(group) and (layout is None or to_json_state(layout) == meta.get("layout"))
    rank_states = meta.get("rank_states") or []
    rank_state = from_json_state(rank_states[rank]) if same_layout and rank < len(rank_states) else None
    return LoadResult(path=step_dir, step=meta["step"], trainer_state=from_json_state(meta.get("trainer_state")),
                      model_config=meta.get("model_config"), layout=meta.get("layout"), rank_state=rank_state,
                      missing=missing, metadata=meta, files_opened=opened,
                      source="disk" if replica is None else "peer replica")
