"""Attention masks of a context-parallel forward, per block of (query chunk, key chunk).

The sequence of ``s`` tokens is cut into ``num_chunks`` (= 2*cp) chunks of ``L = s/num_chunks`` tokens;
a rank holds some of them (:mod:`parallel.context_parallel.sharding`). A query at global position i
sees a key at position j iff ``j <= i`` (causal), ``i - window < j`` (sliding window, as Hugging Face)
and both belong to the same document (packed sequences, ``doc_ids``). :meth:`BlockMasks.block` says
for one chunk pair whether anything is visible (fully masked blocks are skipped: not computed, and
not counted by :func:`block_counts`) and, if only part is, the boolean mask.

:func:`block_counts` is the one place the work of a layout is counted: the ring runs exactly the
blocks it lists (:func:`computed_blocks`), and the balance test asserts with it.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch


class BlockMasks:
    """Masks of one forward over the full sequence, for one sliding window (None: none).

    ``doc_ids``: (b or 1, s) document index per token in natural order, or None (one document per row).
    :meth:`block` returns ``(visible, mask)``: ``visible`` False when the block is fully masked;
    ``mask`` None when every pair of the block is visible, else bool ``(b or 1, L, L)``, True = attend.
    :meth:`kind` names the block's shape for the fused kernels: "full" (no mask), "causal" (the diagonal
    block of plain causal attention: the mask is exactly the lower triangle) or "masked" (anything else).
    """

    def __init__(self, *, seq_len: int, num_chunks: int, doc_ids: torch.Tensor | None, window: int | None,
                 device=None):
        if seq_len % num_chunks:
            raise ValueError(f"sequence length {seq_len} is not divisible by the {num_chunks} chunks of context "
                             "parallelism; pad or pack sequences to a multiple of it")
        if window is not None and window >= seq_len:
            window = None  # the window covers the whole sequence
        self.seq_len, self.num_chunks, self.window = seq_len, num_chunks, window
        self.chunk_len = seq_len // num_chunks
        self.doc_ids = doc_ids
        self.device = device if doc_ids is None else doc_ids.device
        self._cache: dict[tuple[int, int], tuple[bool, torch.Tensor | None, str]] = {}

    def block(self, q_chunk: int, k_chunk: int) -> tuple[bool, torch.Tensor | None]:
        return self._entry(q_chunk, k_chunk)[:2]

    def kind(self, q_chunk: int, k_chunk: int) -> str:
        """"full", "causal" or "masked" (see the class docstring); only for visible blocks."""
        return self._entry(q_chunk, k_chunk)[2]

    def _entry(self, qc: int, kc: int) -> tuple[bool, torch.Tensor | None, str]:
        key = (qc, kc)
        if key not in self._cache:
            visible, mask = self._build(qc, kc)
            window_cuts = self.window is not None and (qc * self.chunk_len + self.chunk_len - 1) - kc * self.chunk_len \
                >= self.window
            plain_diagonal = qc == kc and not window_cuts and (
                self.doc_ids is None or bool((self.doc_ids[:, qc * self.chunk_len:(qc + 1) * self.chunk_len]
                                              == self.doc_ids[:, qc * self.chunk_len:qc * self.chunk_len + 1]).all()))
            kind = "full" if mask is None else "causal" if plain_diagonal else "masked"
            self._cache[key] = (visible, mask, kind)
        return self._cache[key]

    def _build(self, qc: int, kc: int) -> tuple[bool, torch.Tensor | None]:
        L, w = self.chunk_len, self.window
        if kc > qc:
            return False, None  # every key after every query
        if w is not None and qc * L - (kc * L + L - 1) >= w:
            return False, None  # the nearest pair is already outside the window
        partial = kc == qc or (w is not None and (qc * L + L - 1) - kc * L >= w)
        mask = None
        if partial:
            i = torch.arange(qc * L, (qc + 1) * L, device=self.device).unsqueeze(1)  # (L, 1) query positions
            j = torch.arange(kc * L, (kc + 1) * L, device=self.device).unsqueeze(0)  # (1, L) key positions
            mask = j <= i
            if w is not None:
                mask = mask & (j > i - w)
            mask = mask.unsqueeze(0)  # (1, L, L)
        if self.doc_ids is not None:
            same = (self.doc_ids[:, qc * L:(qc + 1) * L].unsqueeze(2)
                    == self.doc_ids[:, kc * L:(kc + 1) * L].unsqueeze(1))  # (b, L, L)
            mask = same if mask is None else mask & same
            if not bool(mask.any()):
                return False, None
            if bool(mask.all()):
                mask = None
        return True, mask

    def full_mask(self) -> torch.Tensor | None:
        """The mask over the whole sequence in natural order: None for plain causal attention (SDPA's
        ``is_causal``), else bool ``(b or 1, 1, s, s)`` -- the rule of models.attention.AttentionMasks."""
        if self.window is None and self.doc_ids is None:
            return None
        i = torch.arange(self.seq_len, device=self.device)
        mask = i.unsqueeze(0) <= i.unsqueeze(1)  # (s_q, s_k) causal
        if self.window is not None:
            mask = mask & (i.unsqueeze(0) > i.unsqueeze(1) - self.window)
        mask = mask.unsqueeze(0)  # (1, s, s)
        if self.doc_ids is not None:
            mask = mask & (self.doc_ids.unsqueeze(2) == self.doc_ids.unsqueeze(1))  # (b, s, s)
        return mask.unsqueeze(1)  # (b or 1, 1, s, s)


class ContextParallelMasks:
    """What a context-parallel stage hands its attention layers: :meth:`get` gives the
    :class:`BlockMasks` of one sliding window, built once per forward (the interface of
    models.attention.AttentionMasks)."""

    def __init__(self, *, seq_len: int, num_chunks: int, doc_ids: torch.Tensor | None, device):
        self.seq_len, self.num_chunks, self.doc_ids, self.device = seq_len, num_chunks, doc_ids, device
        self._cache: dict[int | None, BlockMasks] = {}

    def get(self, window: int | None) -> BlockMasks:
        if window is not None and window >= self.seq_len:
            window = None
        if window not in self._cache:
            self._cache[window] = BlockMasks(seq_len=self.seq_len, num_chunks=self.num_chunks,
                                             doc_ids=self.doc_ids, window=window, device=self.device)
        return self._cache[window]


def computed_blocks(q_chunks: Sequence[int], k_chunks: Sequence[int], masks: BlockMasks
                    ) -> Iterable[tuple[int, int, torch.Tensor | None]]:
    """``(local q chunk index, local k chunk index, mask)`` of every block with something visible."""
    for qi, qc in enumerate(q_chunks):
        for ki, kc in enumerate(k_chunks):
            visible, mask = masks.block(qc, kc)
            if visible:
                yield qi, ki, mask


def block_counts(rank_chunks: Sequence[Sequence[int]], masks: BlockMasks) -> list[int]:
    """Blocks each rank computes when it holds the queries of ``rank_chunks[r]`` and sees every key chunk:
    its attention FLOPs are ``count * 4 * L * L * head_dim * heads`` (two matmuls of a dense block)."""
    every = list(range(masks.num_chunks))
    return [sum(1 for _ in computed_blocks(chunks, every, masks)) for chunks in rank_chunks]


def visible_pairs(rank_chunks: Sequence[Sequence[int]], masks: BlockMasks) -> list[int]:
    """Query-key pairs each rank attends to (the exact unmasked work, summed over the batch rows)."""
    every = list(range(masks.num_chunks))
    L = masks.chunk_len
    rows = 1 if masks.doc_ids is None else masks.doc_ids.shape[0]
    return [sum(rows * L * L if m is None else int(m.expand(rows, L, L).sum())
                for _, _, m in computed_blocks(chunks, every, masks)) for chunks in rank_chunks]
