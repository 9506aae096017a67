"""Post-training datasets: chat records as packed SFT rows, preference records as (chosen, rejected) rows.

Both are map-style datasets for :class:`engine.data.loader.DataParallelLoader`: ``len`` is the number
of samples the run consumes (``train.steps * train.global_batch_size``), and sample ``i`` is row
``perm_e[i % n]`` of the ``n`` rows built from the records, ``e = i // n`` the epoch and ``perm_e`` a
permutation seeded by ``(seed, e)``: every epoch sees every row once, in a fresh order, the same at
every data-parallel size.

A sample is the pretraining loader's dict of ``(seq_length,)`` arrays (``tokens``, ``labels``,
``loss_mask``, ``position_ids``) plus ``units``, the number of loss units it carries (its loss tokens
for SFT; 1 pair for DPO), which the trainer sums over the global batch to normalise the loss.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from engine.data.packing import PackedSequence, pack_documents
from engine.posttrain.chat import (ChatTemplate, check_messages, preference_conversations,
                                   tokenize_conversation)


def _check_length(ids: np.ndarray, target: np.ndarray, *, seq_length: int, truncate: bool, where: str):
    if ids.size <= seq_length:
        return ids, target
    if not truncate:
        raise ValueError(f"{where}: the rendered conversation has {ids.size} tokens > train.seq_length={seq_length}; "
                         "raise train.seq_length, shorten the record, or set posttrain.truncate=true to cut it")
    ids, target = ids[:seq_length], target[:seq_length]
    if not target[1:].any():
        raise ValueError(f"{where}: cut to train.seq_length={seq_length} tokens, no assistant token is left to "
                         "train on; raise train.seq_length or drop the record")
    return ids, target


def _row_dict(row: PackedSequence) -> dict[str, np.ndarray]:
    return {"tokens": row.tokens, "labels": row.labels, "loss_mask": row.loss_mask,
            "position_ids": row.position_ids}


class _Epochs:
    """Sample ``i`` -> row index: every epoch a fresh seeded permutation of the ``n`` rows."""

    def __init__(self, n: int, *, num_samples: int, seed: int):
        self.n, self.num_samples, self.seed = n, num_samples, seed
        self._perm: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def row(self, i: int) -> int:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} is outside [0, {self.num_samples})")
        epoch, k = divmod(i, self.n)
        if epoch not in self._perm:
            self._perm = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)}
        return int(self._perm[epoch][k])


class ChatSFTDataset:
    """Chat records -> rows of ``seq_length`` tokens with the loss on assistant answers only.

    ``pack=True`` puts several conversations in a row (first fit; attention stays inside each
    conversation because its positions restart at 0), else one conversation per row, padded. Padding
    and prompt tokens have ``loss_mask`` 0.
    """

    def __init__(self, records: Sequence[dict], *, template: ChatTemplate, tokenizer, seq_length: int,
                 num_samples: int, seed: int, pack: bool = True, truncate: bool = False):
        docs, targets = [], []
        for rec in records:
            where = rec.get("_where", "record")
            if "messages" not in rec:
                raise ValueError(f"{where}: an SFT record needs 'messages' (a list of {{'role', 'content'}})")
            messages = check_messages(rec["messages"], where=where)
            ids, target = tokenize_conversation(template, tokenizer, messages, where=where)
            ids, target = _check_length(ids, target, seq_length=seq_length, truncate=truncate, where=where)
            docs.append(ids)
            targets.append(target)
        pad = tokenizer.eod_id
        if pack:
            self.rows = pack_documents(docs, seq_length=seq_length, target_masks=targets, pad_id=pad)
        else:
            self.rows = [pack_documents([d], seq_length=seq_length, target_masks=[t], pad_id=pad)[0]
                         for d, t in zip(docs, targets)]
        self.num_records = len(docs)
        self.loss_tokens = int(sum(r.loss_mask.sum() for r in self.rows))
        self._epochs = _Epochs(len(self.rows), num_samples=num_samples, seed=seed)

    def __len__(self) -> int:
        return len(self._epochs)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        row = self.rows[self._epochs.row(int(i))]
        return {**_row_dict(row), "units": np.asarray(row.loss_mask.sum(), dtype=np.float32)}


class PreferenceDataset:
    """Preference records -> per pair two padded rows, chosen then rejected, with the loss mask on
    each completion's tokens (the answer after the shared prompt). ``pair`` is the record's index,
    for the reference log-probabilities computed once before training."""

    def __init__(self, records: Sequence[dict], *, template: ChatTemplate, tokenizer, seq_length: int,
                 num_samples: int, seed: int, truncate: bool = False):
        self.pairs = []
        pad = tokenizer.eod_id
        for rec in records:
            where = rec.get("_where", "record")
            rows = []
            chosen, rejected, n_prompt = preference_conversations(rec)
            for messages in (chosen, rejected):
                # the loss mask on the completion only: a multi-turn prompt's assistant turns are context
                ids, target = tokenize_conversation(template, tokenizer, messages, where=where, first_target=n_prompt)
                ids, target = _check_length(ids, target, seq_length=seq_length, truncate=truncate, where=where)
                rows.append(pack_documents([ids], seq_length=seq_length, target_masks=[target], pad_id=pad)[0])
            self.pairs.append(tuple(rows))
        self.num_records = len(self.pairs)
        self.ref_logps: np.ndarray | None = None  # (pairs, 2), set by objectives.attach_reference_logps
        self._epochs = _Epochs(len(self.pairs), num_samples=num_samples, seed=seed)

    def __len__(self) -> int:
        return len(self._epochs)

    def pair_rows(self, pair: int) -> dict[str, np.ndarray]:
        """Pair ``pair``'s two rows as ``(2, seq_length)`` arrays (chosen first) and its index."""
        chosen, rejected = self.pairs[pair]
        out = {k: np.stack([a, b]) for (k, a), b in zip(_row_dict(chosen).items(), _row_dict(rejected).values())}
        out.update(pair=np.asarray(pair, dtype=np.int64), units=np.asarray(1.0, dtype=np.float32))
        if self.ref_logps is not None:
            out["ref_logp"] = self.ref_logps[pair]  # (2,) float64: the reference's (chosen, rejected)
        return out

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self.pair_rows(self._epochs.row(int(i)))


def collate_pairs(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Preference samples -> one micro-batch of ``2n`` rows: the n chosen rows, then the n rejected
    rows; ``pair`` (n,), ``units`` (n,) and ``ref_logp`` (n, 2) stay per pair."""
    out = {}
    for key in samples[0]:
        stacked = np.stack([s[key] for s in samples])  # (n, 2, s) or (n,)
        if stacked.ndim == 3:
            stacked = np.concatenate([stacked[:, 0], stacked[:, 1]])  # (2n, s): chosen rows, then rejected
        out[key] = torch.from_numpy(stacked)
    return out
