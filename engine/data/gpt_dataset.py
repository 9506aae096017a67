"""GPT pretraining samples over an indexed dataset (Megatron-LM semantics), with cached indices.

A sample is ``seq_length + 1`` consecutive tokens of the shuffled token stream: ``tokens[:-1]``
are the inputs and ``tokens[1:]`` the labels; consecutive samples share one boundary token, so
sample ``i`` starts at stream token ``i * seq_length``. The stream is the split's documents, every
epoch in its own seeded order (engine.data.index_helpers.build_document_index); the sample index
locates each sample's start as (document-index position, token offset) and the shuffle index
permutes the samples. All three depend only on (dataset, split, seq_length, seed, num_samples), so
one seed gives one global sample order on every run and for every data-parallel size.

The three index arrays are saved as .npy files in a cache directory under a name that hashes
their parameters (and the dataset file sizes); a later build with the same parameters memory-maps
them instead of rebuilding.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from engine.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path

SPLIT_NAMES = ("train", "valid", "test")
# Megatron-LM: when the last epoch would contribute under 80% of an epoch's samples, that epoch is
# shuffled separately so its samples stay at the end rather than diluting the full epochs.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
_CACHE_FORMAT = 1


def parse_split(split: str | list[float]) -> list[float]:
    """``"969,30,1"`` -> normalised [train, valid, test] weights (missing trailing entries are 0)."""
    if isinstance(split, str):
        parts = [p.strip() for p in split.replace("/", ",").split(",")]
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"split={split!r}: expected up to 3 comma-separated numbers, e.g. '969,30,1'") from None
    else:
        values = [float(v) for v in split]
    if not 1 <= len(values) <= 3:
        raise ValueError(f"split={split!r}: give 1 to 3 weights (train, valid, test), e.g. '969,30,1'")
    if any(not np.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"split={split!r}: weights must be finite, >= 0 and not all 0, e.g. '969,30,1'")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_document_ranges(split: str | list[float], num_documents: int) -> list[tuple[int, int]]:
    """[begin, end) document ranges of train/valid/test: contiguous, covering all documents."""
    weights = parse_split(split)
    bounds = [0]
    for cum in np.cumsum(weights)[:-1]:
        bounds.append(max(bounds[-1], min(num_documents, int(round(cum * num_documents)))))
    bounds.append(num_documents)
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def _index_helpers():
    # Imported when first needed: the native builders load torch and the extension.
    from engine.data import index_helpers

    return index_helpers


def _atomic_save(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.{os.getpid()}.tmp.npy"
    np.save(tmp, array)
    os.replace(tmp, path)


class GPTDataset:
    """Fixed-length next-token samples from a range of documents of one indexed dataset.

    Args:
        indexed: the tokens.
        document_range: ``[begin, end)`` documents of ``indexed`` used (a split).
        num_samples: samples wanted; the epochs built hold at least this many (``len(self)`` may
            exceed it). ``None``: one epoch.
        seq_length: model sequence length (each sample reads ``seq_length + 1`` tokens).
        seed: shuffling seed, in [0, 2**32 - 1].
        cache_dir: where the index arrays are cached; default ``<dataset dir>/cache``.
        split_name: recorded in the cache description.
        eod_id: with ``eod_mask_loss``, positions whose *input* is EOD get loss mask 0 (the token
            after a document end is not predictable from it; Megatron-LM's rule).

    ``ds[i]`` is a dict of numpy arrays, each ``(seq_length,)``: ``tokens`` and ``labels`` (int64),
    ``loss_mask`` (float32), ``position_ids`` (int64).
    """

    def __init__(self, indexed: IndexedDataset, *, document_range: tuple[int, int], num_samples: int | None,
                 seq_length: int, seed: int, cache_dir: str | None = None, split_name: str = "train",
                 eod_id: int | None = None, eod_mask_loss: bool = False):
        begin, end = document_range
        if not 0 <= begin <= end <= indexed.num_documents:
            raise ValueError(f"document_range={document_range} outside the {indexed.num_documents} documents "
                             f"of {indexed.prefix}")
        if begin == end:
            skip = " or set train.eval_interval=0 to train without validation" if split_name == "valid" else ""
            err = ValueError(f"split {split_name!r} of {indexed.prefix} has no documents (the corpus has "
                             f"{indexed.num_documents}): give it a larger weight in data.split or use a larger "
                             f"corpus{skip}")
            err.on_every_rank = True  # every rank builds the same splits: a launcher says it once
            raise err
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length} must be >= 1")
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be >= 1 (or None for one epoch)")
        if not 0 <= seed <= 2**32 - 1:
            raise ValueError(f"seed={seed} must be in [0, 2**32 - 1]")
        if eod_mask_loss and eod_id is None:
            raise ValueError("eod_mask_loss=True needs eod_id (the tokenizer's end-of-document id)")
        self.indexed = indexed
        self.document_range = (begin, end)
        self.seq_length = seq_length
        self.seed = seed
        self.split_name = split_name
        self.eod_id = eod_id
        self.eod_mask_loss = eod_mask_loss
        self.add_extra_token = True
        lo, hi = int(indexed.document_indices[begin]), int(indexed.document_indices[end])
        # Sequence ids of the split: Megatron indexes sequences (one per document when preprocessed here).
        self.sequences = np.arange(lo, hi, dtype=np.int32)
        self.cache_dir = cache_dir or os.path.join(os.path.dirname(os.path.abspath(indexed.prefix)), "cache")
        self.built_from_cache = False
        self._num_samples_requested = num_samples
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build(num_samples)

    # -- index construction --------------------------------------------------------------------
    def _description(self, num_samples: int | None) -> dict:
        return {
            "class": "GPTDataset", "format": _CACHE_FORMAT,
            "path": os.path.realpath(self.indexed.prefix),
            "idx_bytes": os.path.getsize(index_file_path(self.indexed.prefix)),
            "bin_bytes": os.path.getsize(data_file_path(self.indexed.prefix)),
            "split": self.split_name, "document_range": list(self.document_range),
            "num_samples": num_samples, "seq_length": self.seq_length, "seed": self.seed,
            "add_extra_token": self.add_extra_token,
        }

    def _load_or_build(self, num_samples: int | None):
        desc = self._description(num_samples)
        digest = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:24]
        stem = os.path.join(self.cache_dir, f"gpt_{self.split_name}_{digest}")
        paths = {k: f"{stem}-{k}_index.npy" for k in ("document", "sample", "shuffle")}
        desc_path = f"{stem}-description.json"
        self.cache_paths = {**paths, "description": desc_path}
        # The description is written last, so its presence means the three arrays are complete.
        if os.path.isfile(desc_path) and all(os.path.isfile(p) for p in paths.values()):
            arrays = tuple(np.load(paths[k], mmap_mode="r") for k in ("document", "sample", "shuffle"))
            self.built_from_cache = True
            return arrays
        arrays = self._build(num_samples)
        os.makedirs(self.cache_dir, exist_ok=True)
        for key, arr in zip(("document", "sample", "shuffle"), arrays):
            _atomic_save(paths[key], arr)
        tmp = f"{desc_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(desc, f, indent=1, sort_keys=True)
        os.replace(tmp, desc_path)
        return arrays

    def _build(self, num_samples: int | None):
        helpers = _index_helpers()
        sizes = np.asarray(self.indexed.sizes, dtype=np.int32)
        tokens_per_epoch = int(sizes[self.sequences].sum(dtype=np.int64))
        extra = int(self.add_extra_token)
        per_epoch = (tokens_per_epoch - extra) // self.seq_length
        if per_epoch < 1:
            raise ValueError(
                f"split {self.split_name!r} of {self.indexed.prefix} holds {tokens_per_epoch} tokens, fewer than "
                f"one sample of seq_length + 1 = {self.seq_length + 1}: use more data, a shorter seq_length, or a "
                "larger split weight"
            )
        target = per_epoch if num_samples is None else num_samples
        # Fewest epochs whose stream holds target samples: num_epochs * T - extra >= target * seq_length.
        num_epochs = max(1, -(-(target * self.seq_length + extra) // tokens_per_epoch))
        assert (num_epochs * tokens_per_epoch - extra) // self.seq_length >= target
        assert num_epochs == 1 or ((num_epochs - 1) * tokens_per_epoch - extra) // self.seq_length < target
        separate_final_epoch = False
        sans_final = 0
        if num_epochs > 1:
            sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // self.seq_length
            separate_final_epoch = (target - sans_final) < SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch
        document_index = helpers.build_document_index(
            self.sequences, num_epochs, seed=self.seed, separate_final_epoch=separate_final_epoch)
        sample_index = helpers.build_sample_index(
            sizes, document_index, seq_length=self.seq_length, tokens_per_epoch=tokens_per_epoch,
            num_epochs=num_epochs, drop_last_partial=True, add_extra_token=self.add_extra_token)
        total = sample_index.shape[0] - 1
        assert total >= target, (total, target)
        # A separate final epoch keeps its samples after the full epochs' samples when shuffled.
        # (build_shuffle_index draws from its own stream, so reusing the seed correlates nothing.)
        shuffle_index = helpers.build_shuffle_index(sans_final if separate_final_epoch else total, total,
                                                    seed=self.seed)
        return document_index, sample_index, shuffle_index

    # Pickled as its constructor arguments: unpickling (a spawned DataLoader worker) re-maps the
    # dataset and the cached index files instead of receiving copies of them.
    def __getstate__(self) -> dict:
        return {"indexed": self.indexed, "document_range": self.document_range,
                "num_samples": self._num_samples_requested, "seq_length": self.seq_length, "seed": self.seed,
                "cache_dir": self.cache_dir, "split_name": self.split_name, "eod_id": self.eod_id,
                "eod_mask_loss": self.eod_mask_loss}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    # -- access --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def get_tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``idx`` (int64)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for a dataset of {len(self)} samples")
        j = int(self.shuffle_index[idx])
        (p0, o0), (p1, o1) = self.sample_index[j], self.sample_index[j + 1]
        p0, o0, p1, o1 = int(p0), int(o0), int(p1), int(o1)
        extra = int(self.add_extra_token)
        doc = self.document_index
        if p0 == p1:
            parts = [self.indexed.get(int(doc[p0]), o0, o1 - o0 + extra)]
        else:
            first = int(doc[p0])
            parts = [self.indexed.get(first, o0, int(self.indexed.sizes[first]) - o0)]
            parts += [self.indexed.get(int(doc[p])) for p in range(p0 + 1, p1)]
            parts.append(self.indexed.get(int(doc[p1]), 0, o1 + extra))
        out = np.concatenate(parts).astype(np.int64)
        assert out.shape == (self.seq_length + extra,), (out.shape, idx)
        return out

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        tokens = self.get_tokens(int(idx))
        labels = tokens[1:]
        loss_mask = np.ones(self.seq_length, dtype=np.float32)
        if self.eod_mask_loss:
            loss_mask[tokens[:-1] == self.eod_id] = 0.0
        return {"tokens": tokens[:-1], "labels": labels, "loss_mask": loss_mask,
                "position_ids": np.arange(self.seq_length, dtype=np.int64)}
