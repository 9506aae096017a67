"""How one Tessel parameter corresponds to Hugging Face tensors, in both directions.

A family lists :class:`HFEntry` rows: Tessel name, Hugging Face key(s), and a layout:

============  =================================================================================
layout        Tessel tensor (full, TP=1) from the Hugging Face tensor(s)
============  =================================================================================
replicated    the same tensor
column        the same (out, in) / (out,) tensor; TP splits dim 0
row           the same (out, in) tensor; TP splits dim 1
vocab         (V, h) padded with zero rows to the padded vocab; TP splits dim 0
gate_up       [gate; up] from gate_proj and up_proj; TP rank r holds [gate_r; up_r] (stride 2)
qkv           grouped from q_proj, k_proj, v_proj: per kv group [q heads of the group, k, v];
              TP rank r holds whole groups, a contiguous block of rows
qkv_packed    as qkv, from one fused [q; k; v] tensor (GPT-2 c_attn)
============  =================================================================================

``conv1d`` marks GPT-2's Conv1D tensors, stored (in, out): transposed on the way in and out.
Reading goes through :func:`read` / :func:`shape_of`, which use ``src.get_slice(key)`` when the
source has it (a safetensors handle), so only this rank's rows or columns are read from disk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from models.config import TransformerConfig

LAYOUTS = ("replicated", "column", "row", "vocab", "gate_up", "qkv", "qkv_packed")


@dataclass(frozen=True)
class HFEntry:
    name: str
    hf_keys: tuple[str, ...]
    layout: str
    conv1d: bool = False

    def __post_init__(self):
        assert self.layout in LAYOUTS, self.layout
        assert len(self.hf_keys) == (3 if self.layout == "qkv" else 2 if self.layout == "gate_up" else 1)

    def partition(self, ndim: int) -> tuple[int, int] | None:
        """(dim, stride) along which the Tessel tensor is split over TP, or None if replicated."""
        if self.layout == "replicated":
            return None
        if self.layout == "row":
            assert ndim == 2
            return (1, 1)
        return (0, 2 if self.layout == "gate_up" else 1)


# -- lazy reads -----------------------------------------------------------------------------------

def shape_of(src: Mapping[str, Any], key: str) -> tuple[int, ...]:
    get_slice = getattr(src, "get_slice", None)
    if get_slice is not None:
        return tuple(get_slice(key).get_shape())
    return tuple(src[key].shape)


def read(src: Mapping[str, Any], key: str, *, dim: int | None = None, start: int = 0,
         stop: int | None = None) -> torch.Tensor:
    """``src[key]``, or only ``[start, stop)`` along ``dim`` (sliced lazily when ``src`` can)."""
    if dim is None:
        return src[key]
    get_slice = getattr(src, "get_slice", None)
    if get_slice is not None:
        index = tuple([slice(None)] * dim + [slice(start, stop)])
        return get_slice(key)[index]
    t = src[key]
    stop = t.shape[dim] if stop is None else stop
    return t.narrow(dim, start, stop - start)


# -- expected Hugging Face shapes -----------------------------------------------------------------

def _t(shape: tuple[int, ...], conv1d: bool) -> tuple[int, ...]:
    return tuple(reversed(shape)) if conv1d and len(shape) == 2 else tuple(shape)


def hf_shapes(entry: HFEntry, full_shape: tuple[int, ...], cfg: TransformerConfig) -> list[tuple[int, ...]]:
    """The shape each of ``entry.hf_keys`` must have, given the Tessel tensor's full shape."""
    rest = tuple(full_shape[1:])
    if entry.layout in ("replicated", "column", "row"):
        return [_t(full_shape, entry.conv1d)]
    if entry.layout == "vocab":
        return [(cfg.vocab_size, *rest)]
    if entry.layout == "gate_up":
        return [_t((full_shape[0] // 2, *rest), entry.conv1d)] * 2
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if entry.layout == "qkv":
        return [_t((q_rows, *rest), entry.conv1d), _t((kv_rows, *rest), entry.conv1d),
                _t((kv_rows, *rest), entry.conv1d)]
    return [_t((q_rows + 2 * kv_rows, *rest), entry.conv1d)]  # qkv_packed


# -- Hugging Face -> this rank's shard ------------------------------------------------------------

def _rows(src, key, start, stop, conv1d, ndim):
    """Rows [start, stop) of the logical (out, in) tensor, whatever the on-disk orientation."""
    if conv1d and ndim == 2:
        return read(src, key, dim=1, start=start, stop=stop).t()
    return read(src, key, dim=0, start=start, stop=stop)


def _interleave_groups(q, k, v, *, groups: int, q_per_group: int, head_dim: int) -> torch.Tensor:
    rest = tuple(q.shape[1:])
    q = q.reshape(groups, q_per_group, head_dim, *rest)  # (g, q_per_group, hd, ...)
    k = k.reshape(groups, 1, head_dim, *rest)  # (g, 1, hd, ...)
    v = v.reshape(groups, 1, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(groups * (q_per_group + 2) * head_dim, *rest)


def read_shard(entry: HFEntry, src, resolve, *, ndim: int, rank: int, size: int, cfg: TransformerConfig,
               local_rows: int) -> torch.Tensor:
    """This TP rank's shard of ``entry`` in Tessel layout. ``resolve`` maps a canonical key to the
    key present in ``src``; ``local_rows`` is the shard's dim-0 size (used for vocab padding)."""
    keys = [resolve(k) for k in entry.hf_keys]
    c = entry.conv1d
    if entry.layout == "replicated":
        return read(src, keys[0])
    if entry.layout == "row":
        if c:
            n = shape_of(src, keys[0])[0]
            return read(src, keys[0], dim=0, start=rank * n // size, stop=(rank + 1) * n // size).t()
        n = shape_of(src, keys[0])[1]
        return read(src, keys[0], dim=1, start=rank * n // size, stop=(rank + 1) * n // size)
    if entry.layout == "column":
        n = _t(shape_of(src, keys[0]), c)[0]
        return _rows(src, keys[0], rank * n // size, (rank + 1) * n // size, c, ndim)
    if entry.layout == "vocab":
        lo = rank * local_rows
        hi = min(lo + local_rows, cfg.vocab_size)
        part = _rows(src, keys[0], lo, hi, c, ndim) if hi > lo else None  # None: all padding
        out_shape = (local_rows, *_t(shape_of(src, keys[0]), c)[1:])
        out = torch.zeros(out_shape, dtype=read_dtype(src, keys[0]) if part is None else part.dtype)
        if part is not None:
            out[:hi - lo] = part
        return out
    if entry.layout == "gate_up":
        n = _t(shape_of(src, keys[0]), c)[0]
        a, b = rank * n // size, (rank + 1) * n // size
        return torch.cat([_rows(src, keys[0], a, b, c, ndim), _rows(src, keys[1], a, b, c, ndim)], dim=0)
    groups = cfg.num_kv_heads // size
    qpg, hd = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    g0 = rank * groups
    if entry.layout == "qkv":
        q = _rows(src, keys[0], g0 * qpg * hd, (g0 + groups) * qpg * hd, c, ndim)
        k = _rows(src, keys[1], g0 * hd, (g0 + groups) * hd, c, ndim)
        v = _rows(src, keys[2], g0 * hd, (g0 + groups) * hd, c, ndim)
    else:  # qkv_packed: rows [q (all heads); k; v] of one tensor
        q_rows, kv_rows = cfg.num_heads * hd, cfg.num_kv_heads * hd
        q = _rows(src, keys[0], g0 * qpg * hd, (g0 + groups) * qpg * hd, c, ndim)
        k = _rows(src, keys[0], q_rows + g0 * hd, q_rows + (g0 + groups) * hd, c, ndim)
        v = _rows(src, keys[0], q_rows + kv_rows + g0 * hd, q_rows + kv_rows + (g0 + groups) * hd, c, ndim)
    return _interleave_groups(q, k, v, groups=groups, q_per_group=qpg, head_dim=hd)


def read_dtype(src, key) -> torch.dtype:
    get_slice = getattr(src, "get_slice", None)
    if get_slice is not None:
        name = get_slice(key).get_dtype()
        return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}[name]
    return src[key].dtype


# -- full Tessel tensor -> Hugging Face -----------------------------------------------------------

def to_hf(entry: HFEntry, full: torch.Tensor, cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors for ``entry`` from the full (TP=1 layout) Tessel tensor."""
    def out(t):
        return (t.t() if entry.conv1d and t.dim() == 2 else t).contiguous()

    keys = entry.hf_keys
    if entry.layout in ("replicated", "column", "row"):
        return {keys[0]: out(full)}
    if entry.layout == "vocab":
        return {keys[0]: out(full[:cfg.vocab_size])}
    if entry.layout == "gate_up":
        gate, up = full.chunk(2, dim=0)
        return {keys[0]: out(gate), keys[1]: out(up)}
    groups, qpg, hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    rest = tuple(full.shape[1:])
    g = full.reshape(groups, qpg + 2, hd, *rest)  # (g, q_per_group + 2, hd, ...)
    q = g[:, :qpg].reshape(groups * qpg * hd, *rest)
    k = g[:, qpg].reshape(groups * hd, *rest)
    v = g[:, qpg + 1].reshape(groups * hd, *rest)
    if entry.layout == "qkv":
        return {keys[0]: out(q), keys[1]: out(k), keys[2]: out(v)}
    return {keys[0]: out(torch.cat([q, k, v], dim=0))}


def describe_problems(*groups: tuple[str, list]) -> list[str]:
    """``"label (n): [items]"`` for each non-empty ``(label, items)`` group: the one format every
    weight-matching error (missing / unexpected / mis-shaped tensors) uses."""
    return [f"{label} ({len(items)}): {items}" for label, items in groups if items]
