"""Synthetic TP-sharded modules and a distributed-optimizer-like flat buffer for checkpoint tests.

Global reference tensors come from a seed; each "rank" builds its shards from them exactly as the
parallel layers lay them out (attributes ``tensor_parallel``/``partition_dim``/``partition_stride``),
so a load in any layout can be checked against the global tensors bit for bit.
"""
from __future__ import annotations

import torch

from engine.checkpoint import FlatShard, ShardingContext, flat_buffer_sharded_tensors, module_layouts

H, F, V = 8, 12, 16  # hidden, ffn, vocab: divisible by tp in {1, 2, 4}


def global_tensors(seed: int) -> dict[str, torch.Tensor]:
    """The logical (one-device) tensors of the toy model."""
    g = torch.Generator().manual_seed(seed)
    return {
        "emb.weight": torch.randn(V, H, generator=g),              # vocab-parallel, dim 0
        "fc1.weight": torch.randn(2 * F, H, generator=g),          # fused [gate; up], dim 0, stride 2
        "fc2.weight": torch.randn(H, F, generator=g),              # row-parallel, dim 1
        "norm.weight": torch.randn(H, generator=g).bfloat16(),     # replicated over tp
    }


SHARDING = {"emb.weight": (0, 1), "fc1.weight": (0, 2), "fc2.weight": (1, 1), "norm.weight": None}


def shard(full: torch.Tensor, *, rank: int, size: int, dim: int, stride: int) -> torch.Tensor:
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


class ToyTP(torch.nn.Module):
    """Embedding + fused gate/up column-parallel + row-parallel + replicated norm (registration order)."""

    def __init__(self, *, tp_rank: int, tp: int, seed: int | None):
        super().__init__()
        ref = global_tensors(seed if seed is not None else 0)
        for name, full in ref.items():
            spec = SHARDING[name]
            local = full.clone() if spec is None else shard(full, rank=tp_rank, size=tp, dim=spec[0], stride=spec[1])
            if seed is None:
                local = torch.zeros_like(local)
            p = torch.nn.Parameter(local)
            p.tensor_parallel = spec is not None
            if spec is not None:
                p.partition_dim, p.partition_stride = spec
            holder = torch.nn.Module()
            holder.weight = p
            self.add_module(name.split(".")[0], holder)


def flat_placements(layouts, *, dp: int, bucket_elems: int):
    """Mimic the distributed optimizer's buffer: reverse order, buckets padded to a multiple of dp.

    Returns (placements [(layout, start, end)], buckets [(start, end)], total length).
    """
    placed = list(reversed(list(layouts.values())))
    placements, buckets = [], []
    start = cursor = 0
    for i, lay in enumerate(placed):
        n = 1
        for s in lay.local_shape:
            n *= s
        placements.append((lay, cursor, cursor + n))
        cursor += n
        if cursor - start >= bucket_elems or i == len(placed) - 1:
            end = start + -(-(cursor - start) // dp) * dp
            buckets.append((start, end))
            start = cursor = end
    return placements, buckets, start


def local_of(layout, full_by_key: dict[str, torch.Tensor]) -> torch.Tensor:
    """The local tensor a layout describes, assembled from global tensors (the expected value)."""
    out = torch.empty(layout.local_shape, dtype=next(iter(full_by_key.values())).dtype)
    for p in layout.parts:
        full = full_by_key[p.key]
        idx = tuple(slice(o, o + (p.local_end - p.local_start if d == p.dim else n))
                    for d, (o, n) in enumerate(zip(p.global_offset, layout.local_shape)))
        out.narrow(p.dim, p.local_start, p.local_end - p.local_start).copy_(full[idx])
    return out


def optimizer_globals(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """Reference fp32 optimizer state per logical param key: exp_avg and master."""
    ref = global_tensors(seed)
    return {"exp_avg": {k: (v.float() * 0.5 + 1.0) for k, v in ref.items()},
            "master": {k: v.float() * 3.0 for k, v in ref.items()}}


def optimizer_shards(model, *, ctx: ShardingContext, dp_rank: int, dp: int, seed: int | None, bucket_elems: int = 100):
    """(ShardedTensors of this rank's optimizer shards, {state: list of owned 1-D tensors}).

    With ``seed=None`` the state tensors are zeros (load targets); else filled from the reference.
    """
    layouts = module_layouts(model, ctx=ctx)
    placements, buckets, total = flat_placements(layouts, dp=dp, bucket_elems=bucket_elems)
    ref = optimizer_globals(seed if seed is not None else 0)
    flats = {}
    for state, fulls in ref.items():
        flat = torch.zeros(total)
        if seed is not None:
            for lay, s, e in placements:
                flat[s:e] = local_of(lay, fulls).reshape(-1)
        flats[state] = flat
    shards = []
    for bs, be in buckets:
        n = (be - bs) // dp
        s, e = bs + dp_rank * n, bs + (dp_rank + 1) * n
        shards.append(FlatShard(start=s, end=e, states={k: f[s:e].clone() for k, f in flats.items()}))
    expected = []
    for sh in shards:
        exp = {}
        for state, fulls in ref.items():
            full_flat = torch.zeros(total)
            for lay, s, e in placements:
                full_flat[s:e] = local_of(lay, fulls).reshape(-1)
            exp[state] = full_flat[sh.start:sh.end]
        expected.append(exp)
    return flat_buffer_sharded_tensors(placements, shards), shards, expected, placements
