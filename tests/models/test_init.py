"""Sharded initialisation: a TP rank streams the full weight in row blocks and keeps only its shard.

* Every parameter of every TP=4 rank (TP=2 for qwen2) equals the TP=1 weight sharded (``shard_tensor``), bit for bit,
  for every family, with blocks forced small (many blocks, the under-16-element tail merged) and at the
  default block size: layouts agree, and the values are those of one full draw.
* On CPU the blocks are bit-identical to one ``normal_`` over the full tensor, for shapes whose row
  counts and widths exercise every boundary rule.
* A rank never allocates the full weight: the largest tensor the build allocates is its shard or a
  block, not the full (vocab x hidden) embedding (counted through the CPU allocator's profile events).
"""
from __future__ import annotations

import pytest
import torch

import models.init as init_mod
from models import build_model
from models.init import NamedInit, _block_bounds
from parallel.comm import Group, Ledger
from parallel.tensor_parallel.sharding import shard_tensor
from tests.models import tiny


def _tp_group(rank: int, size: int) -> Group:
    # Building a stage needs the group's rank and size only; it never communicates.
    return Group(axis="tp", ranks=range(size), rank=rank, pg=object() if size > 1 else None, ledger=Ledger())


def _stage(hf, rank, size):
    return build_model(hf, tp_group=_tp_group(rank, size), dtype=torch.float32, device="cpu", seed=5)


@pytest.mark.parametrize("block_elements", [40, 1 << 22])
@pytest.mark.parametrize("family", sorted(tiny.FAMILIES))
def test_tp_shards_equal_the_full_weight_sharded(family, block_elements, monkeypatch):
    monkeypatch.setattr(init_mod, "BLOCK_ELEMENTS", block_elements)
    hf = tiny.config(family, vocab_size=100)  # padded to 128 per TP=1, 512 at TP=4: zero rows differ
    full = dict(_stage(hf, 0, 1).named_parameters())
    tp = 2 if family == "qwen2" else 4  # qwen2's tiny config has 2 kv heads
    for rank in range(tp):
        for name, p in _stage(hf, rank, tp).named_parameters():
            ref = full[name]
            if getattr(p, "tensor_parallel", False):
                n = p.shape[p.partition_dim] * tp
                if ref.shape[p.partition_dim] != n:  # vocab padding grows with TP: pad the reference with zeros
                    pad = torch.zeros((n - ref.shape[0], *ref.shape[1:]))
                    ref = torch.cat([ref.detach(), pad])
                ref = shard_tensor(ref.detach(), rank=rank, size=tp, dim=p.partition_dim, stride=p.partition_stride)
            assert torch.equal(p.detach(), ref), (family, rank, name)


@pytest.mark.parametrize("rows, cols", [(7, 3), (64, 32), (37, 40), (50, 16), (3, 5), (1, 17), (130, 1)])
def test_blocks_equal_one_full_draw_on_cpu(rows, cols, monkeypatch):
    monkeypatch.setattr(init_mod, "BLOCK_ELEMENTS", 24)
    init = NamedInit(seed=11, std=0.5, valid_rows=None)
    full = torch.empty(rows, cols)
    init(full)
    streamed = torch.cat([b.clone() for _, b in init.blocks((rows, cols))])  # blocks share one buffer
    assert torch.equal(streamed, full)
    bounds = _block_bounds(rows, cols)
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all((b - a) * cols % 16 == 0 for a, b in bounds[:-1])
    assert len(bounds) == 1 or (bounds[-1][1] - bounds[-1][0]) * cols >= 16


def test_a_rank_never_allocates_the_full_embedding(monkeypatch):
    monkeypatch.setattr(init_mod, "BLOCK_ELEMENTS", 1024)
    hf = tiny.config("llama", vocab_size=4096, hidden_size=64)  # embedding 4096 x 64 fp32 = 1 MiB
    full_bytes = 4096 * 64 * 4
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        _stage(hf, 1, 4)
    sizes = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert sizes and max(sizes) <= full_bytes / 4, max(sizes)  # the shard is 1/4 of it, a block smaller
