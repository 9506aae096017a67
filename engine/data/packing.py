"""Sequence packing for SFT: several documents per fixed-length row, kept apart.

A packed row of ``seq_length`` positions holds whole documents back to back, then padding. For
each document the labels are its own next tokens (the last position of a document has no label:
loss mask 0), ``position_ids`` restart at 0, and ``cu_seqlens`` (int32, ``[0, ..., seq_length]``)
marks where each document starts; padding is one extra segment at the end so ``cu_seqlens[-1]``
is always ``seq_length`` (what variable-length attention kernels expect). A per-token target mask
(e.g. 0 for prompt tokens) decides which labels count in the loss.

:func:`document_causal_mask` turns ``cu_seqlens`` or ``position_ids`` into the boolean attention
mask (True = may attend) that makes attention over a packed row equal to attention over each
document alone.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

PACKING_METHODS = ("sequential", "first_fit", "first_fit_decreasing")


@dataclasses.dataclass(kw_only=True)
class PackedSequence:
    """One packed row. Arrays are ``(seq_length,)`` except ``cu_seqlens`` ``(segments + 1,)``."""

    tokens: np.ndarray  # int64 inputs
    labels: np.ndarray  # int64 next token inside the same document; pad_id where there is none
    loss_mask: np.ndarray  # float32, 1 where the label is a target token
    position_ids: np.ndarray  # int64, 0 at each document start
    cu_seqlens: np.ndarray  # int32 segment starts + seq_length (padding is the last segment)
    document_ids: list[int]  # indices into the packed input, in row order

    @property
    def seq_length(self) -> int:
        return int(self.tokens.shape[0])


def sft_example(prompt_ids: Sequence[int], response_ids: Sequence[int], *, eod_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, target mask) of one SFT example: prompt, response, EOD; only response + EOD are targets."""
    tokens = np.asarray(list(prompt_ids) + list(response_ids) + [eod_id], dtype=np.int64)
    target = np.zeros(tokens.shape[0], dtype=bool)
    target[len(prompt_ids):] = True
    return tokens, target


class _FirstFitTree:
    """Max segment tree over bin free space: the first bin with room in O(log bins)."""

    def __init__(self, num_bins: int, capacity: int):
        self.size = 1
        while self.size < num_bins:
            self.size *= 2
        self.tree = np.full(2 * self.size, capacity, dtype=np.int64)

    def first_fit(self, need: int) -> int:
        if self.tree[1] < need:
            return -1
        node = 1
        while node < self.size:
            node = 2 * node if self.tree[2 * node] >= need else 2 * node + 1
        return node - self.size

    def take(self, leaf: int, amount: int) -> None:
        node = leaf + self.size
        self.tree[node] -= amount
        node //= 2
        while node:
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])
            node //= 2


def assign_bins(lengths: Sequence[int], *, capacity: int, method: str = "first_fit") -> list[list[int]]:
    """Group document indices into bins of total length <= capacity.

    ``sequential`` fills one bin at a time in input order; ``first_fit`` puts each document, in
    input order, into the first bin with room; ``first_fit_decreasing`` does that longest first.
    Bins are returned in creation order, documents in each bin in placement order.
    """
    if method not in PACKING_METHODS:
        raise ValueError(f"method={method!r}: use one of {PACKING_METHODS}")
    if capacity < 1:
        raise ValueError(f"capacity={capacity} must be >= 1")
    lengths = [int(n) for n in lengths]
    for i, n in enumerate(lengths):
        if not 1 <= n <= capacity:
            raise ValueError(f"document {i} has length {n}; packing needs 1 <= length <= seq_length={capacity}")
    bins: list[list[int]] = []
    if method == "sequential":
        used = capacity
        for i, n in enumerate(lengths):
            if used + n > capacity:
                bins.append([])
                used = 0
            bins[-1].append(i)
            used += n
        return bins
    order = range(len(lengths))
    if method == "first_fit_decreasing":
        order = sorted(order, key=lambda i: -lengths[i])  # stable: ties keep input order
    tree = _FirstFitTree(max(1, len(lengths)), capacity)
    for i in order:
        b = tree.first_fit(lengths[i])
        assert b >= 0, "a fresh bin always has room for a document <= capacity"
        if b == len(bins):
            bins.append([])
        tree.take(b, lengths[i])
        bins[b].append(i)
    return bins


def pack_documents(documents: Sequence[Sequence[int]], *, seq_length: int,
                   target_masks: Sequence[Sequence[bool]] | None = None, method: str = "first_fit",
                   pad_id: int = 0, truncate: bool = False) -> list[PackedSequence]:
    """Pack tokenized documents into rows of ``seq_length`` positions.

    ``target_masks[d][t]`` says whether token ``t`` of document ``d`` is a training target (default:
    every token but the first). Documents longer than ``seq_length`` raise, or with
    ``truncate=True`` keep their first ``seq_length`` tokens.
    """
    docs = [np.asarray(d, dtype=np.int64) for d in documents]
    if target_masks is None:
        targets = [np.ones(len(d), dtype=bool) for d in docs]
    else:
        if len(target_masks) != len(docs):
            raise ValueError(f"target_masks has {len(target_masks)} entries for {len(docs)} documents")
        targets = [np.asarray(m, dtype=bool) for m in target_masks]
        for i, (d, m) in enumerate(zip(docs, targets)):
            if m.shape != d.shape:
                raise ValueError(f"target_masks[{i}] has shape {m.shape}, document {i} has {d.shape}")
    for i, d in enumerate(docs):
        if d.ndim != 1 or d.size == 0:
            raise ValueError(f"document {i} must be a non-empty 1-D token list, got shape {d.shape}")
        if d.size > seq_length:
            if not truncate:
                raise ValueError(f"document {i} has {d.size} tokens > seq_length={seq_length}: "
                                 "pass truncate=True or a longer seq_length")
            docs[i], targets[i] = d[:seq_length], targets[i][:seq_length]
    bins = assign_bins([d.size for d in docs], capacity=seq_length, method=method)
    return [_pack_row([docs[i] for i in b], [targets[i] for i in b], b, seq_length, pad_id) for b in bins]


def _pack_row(docs, targets, ids, seq_length, pad_id) -> PackedSequence:
    tokens = np.full(seq_length, pad_id, dtype=np.int64)
    labels = np.full(seq_length, pad_id, dtype=np.int64)
    loss_mask = np.zeros(seq_length, dtype=np.float32)
    position_ids = np.zeros(seq_length, dtype=np.int64)
    starts = [0]
    for doc, target in zip(docs, targets):
        s, n = starts[-1], doc.size
        tokens[s:s + n] = doc
        labels[s:s + n - 1] = doc[1:]  # the last token of a document has no next token here
        loss_mask[s:s + n - 1] = target[1:]
        position_ids[s:s + n] = np.arange(n)
        starts.append(s + n)
    used = starts[-1]
    if used < seq_length:
        position_ids[used:] = np.arange(seq_length - used)
        starts.append(seq_length)
    return PackedSequence(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids,
                          cu_seqlens=np.asarray(starts, dtype=np.int32), document_ids=list(ids))


def collate_packed(rows: Sequence[PackedSequence]) -> dict[str, torch.Tensor]:
    """Batch packed rows: ``(b, s)`` tensors plus flat ``cu_seqlens`` over the ``b * s`` tokens.

    ``cu_seqlens`` (int32) is each row's offsets shifted by ``row * s`` (the THD layout of
    variable-length attention); ``max_seqlen`` is the longest segment.
    """
    if not rows:
        raise ValueError("rows is empty: collate at least one packed row")
    s = rows[0].seq_length
    if any(r.seq_length != s for r in rows):
        raise ValueError("packed rows of different seq_length cannot share a batch")
    cu = [np.zeros(1, dtype=np.int64)] + [r.cu_seqlens[1:].astype(np.int64) + k * s for k, r in enumerate(rows)]
    cu_flat = np.concatenate(cu)
    return {
        "tokens": torch.from_numpy(np.stack([r.tokens for r in rows])),
        "labels": torch.from_numpy(np.stack([r.labels for r in rows])),
        "loss_mask": torch.from_numpy(np.stack([r.loss_mask for r in rows])),
        "position_ids": torch.from_numpy(np.stack([r.position_ids for r in rows])),
        "cu_seqlens": torch.from_numpy(cu_flat.astype(np.int32)),
        "max_seqlen": torch.tensor(int(np.diff(cu_flat).max())),
    }


def _segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int | None) -> torch.Tensor:
    cu = cu_seqlens.to(torch.int64).reshape(-1)
    if cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens={cu.tolist()} must start at 0 and never decrease")
    total = int(cu[-1])
    if seq_len is not None and seq_len != total:
        raise ValueError(f"cu_seqlens ends at {total} but seq_len={seq_len}: they must cover the same tokens")
    positions = torch.arange(total, device=cu.device)
    # Token t belongs to the last segment whose start is <= t.
    return torch.searchsorted(cu[1:], positions, right=True)  # (s,)


def _segment_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    pos = position_ids.to(torch.int64)
    starts = torch.ones_like(pos, dtype=torch.bool)
    # A document starts wherever the position does not continue the previous one.
    starts[..., 1:] = pos[..., 1:] != pos[..., :-1] + 1
    return torch.cumsum(starts.to(torch.int64), dim=-1)  # (..., s)


def document_causal_mask(cu_seqlens=None, seq_len: int | None = None, *, position_ids=None) -> torch.Tensor:
    """Boolean attention mask over a packed row: True where query ``i`` may attend key ``j``.

    ``mask[i, j] = j <= i and tokens i, j lie in the same document``. Documents come from
    ``cu_seqlens`` (1-D, ``[0, ..., seq_len]``; result ``(s, s)``) or from ``position_ids``
    (``(s,)`` or ``(b, s)``; a document starts where the position does not continue the previous
    one; result ``(s, s)`` or ``(b, s, s)``). Give exactly one of the two.
    """
    if (cu_seqlens is None) == (position_ids is None):
        raise ValueError("give exactly one of cu_seqlens or position_ids")
    if cu_seqlens is not None:
        seg = _segment_ids_from_cu_seqlens(torch.as_tensor(cu_seqlens), seq_len)
    else:
        pos = torch.as_tensor(position_ids)
        if pos.dim() not in (1, 2):
            raise ValueError(f"position_ids must be (s,) or (b, s), got shape {tuple(pos.shape)}")
        if seq_len is not None and pos.shape[-1] != seq_len:
            raise ValueError(f"position_ids has {pos.shape[-1]} positions but seq_len={seq_len}")
        seg = _segment_ids_from_position_ids(pos)
    s = seg.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=seg.device).tril()  # (s, s)
    same_doc = seg.unsqueeze(-1) == seg.unsqueeze(-2)  # (..., s, s)
    return same_doc & causal


def masked_token_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over positions with ``loss_mask == 1`` (a reference for the trainer's loss).

    ``logits (..., s, v)``, ``labels (..., s)``, ``loss_mask (..., s)``; masked positions add nothing
    to the value or the gradient. Raises if no position is unmasked.
    """
    mask = loss_mask.to(logits.dtype)
    denom = mask.sum()
    if float(denom) == 0:
        raise ValueError("loss_mask has no unmasked position: nothing to train on in this batch")
    per_token = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")  # (N,)
    mask = mask.reshape(-1)
    # where(), not a product: a masked position's loss must not leak even when it is inf or nan.
    return torch.where(mask > 0, per_token * mask, torch.zeros_like(per_token)).sum() / denom
