"""Context parallelism: each cp rank holds a share of every sequence and attention spans the whole.

* :mod:`.sharding`: the load-balanced zigzag split (2*cp chunks; rank r holds r and 2cp-1-r) of a
  micro-batch's tokens, labels, loss mask, positions and document ids.
* :mod:`.masks`: causal, sliding-window and document masks per (query chunk, key chunk) block; which
  blocks are computed (and the work each rank does).
* :mod:`.ring`: ring attention (K/V rotate by p2p, overlapped with the block in hand; online softmax).
* :mod:`.ulysses`: all-to-all attention and the hybrid (all-to-all inside groups, ring across).

:class:`ContextParallel` is what a model's attention is given at construction (like ``tp_group``): the
groups and the communication kind; its :meth:`~ContextParallel.attention` is the one call. Nothing
else in the model changes: every other layer is per token. docs/context_parallel.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.comm import Group
from parallel.context_parallel.masks import BlockMasks, ContextParallelMasks, block_counts, visible_pairs
from parallel.context_parallel.ring import ring_attention
from parallel.context_parallel.sharding import (check_cp_sequence, contiguous_chunks, gather_sequence,
                                               shard_micro_batch, zigzag_chunks, zigzag_indices, zigzag_shard,
                                               zigzag_unshard)
from parallel.context_parallel.ulysses import check_a2a_heads, hybrid_attention, ulysses_attention

CP_COMM = ("ring", "a2a", "hybrid")  # parallel.cp_comm


@dataclass(frozen=True)
class ContextParallel:
    """The cp group of a model's attention and how it communicates.

    ``comm``: "ring" (over ``group``), "a2a" (over ``group``) or "hybrid" (all-to-all over ``a2a_group``,
    ring over ``ring_group``; both from :meth:`parallel.mesh.Mesh.build` with ``cp_a2a_size``)."""

    group: Group
    comm: str = "ring"
    a2a_group: Group | None = None
    ring_group: Group | None = None

    def __post_init__(self):
        if self.comm not in CP_COMM:
            raise ValueError(f"parallel.cp_comm={self.comm!r} is not one of {list(CP_COMM)}")
        if self.comm == "hybrid":
            if self.a2a_group is None or self.ring_group is None:
                raise ValueError("parallel.cp_comm='hybrid' needs the cp sub-groups: build the mesh with "
                                 "cp_a2a_size (parallel.cp_a2a_size) and pass (mesh.cp_a2a, mesh.cp_ring)")
            if self.a2a_group.size * self.ring_group.size != self.group.size:
                raise ValueError(f"hybrid cp groups: a2a size {self.a2a_group.size} x ring size "
                                 f"{self.ring_group.size} != cp = {self.group.size}")

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    def check_heads(self, *, heads_local: int, kv_heads_local: int) -> None:
        """At construction: the all-to-all kinds need the local heads divisible by their group."""
        if self.comm == "a2a":
            check_a2a_heads(heads=heads_local, kv_heads=kv_heads_local, size=self.size)
        elif self.comm == "hybrid":
            check_a2a_heads(heads=heads_local, kv_heads=kv_heads_local, size=self.a2a_group.size,
                            what=f"parallel.cp_comm='hybrid' (parallel.cp_a2a_size={self.a2a_group.size})")

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, masks: BlockMasks,
                  scale: float) -> torch.Tensor:
        """Softmax attention of this rank's zigzag shard over the full sequence.
        q (s_local, b, nh, hd); k, v (s_local, b, g, hd) -> (s_local, b, nh*hd)."""
        if self.comm == "ring":
            cp = self.size
            return ring_attention(q, k, v, group=self.group, chunks_of=lambda r: zigzag_chunks(r, cp), masks=masks,
                                  scale=scale)
        if self.comm == "a2a":
            return ulysses_attention(q, k, v, group=self.group, masks=masks, scale=scale)
        return hybrid_attention(q, k, v, a2a_group=self.a2a_group, ring_group=self.ring_group, masks=masks,
                                scale=scale)


__all__ = ["CP_COMM", "ContextParallel", "BlockMasks", "ContextParallelMasks", "block_counts", "visible_pairs",
           "ring_attention", "ulysses_attention", "hybrid_attention", "check_a2a_heads", "check_cp_sequence",
           "contiguous_chunks", "gather_sequence", "shard_micro_batch", "zigzag_chunks", "zigzag_indices",
           "zigzag_shard", "zigzag_unshard"]
