"""Blending datasets by weight, and the train/valid/test builder the trainer calls.

``BlendedDataset`` interleaves its datasets with Megatron-LM's greedy rule
(engine.data.index_helpers.build_blending_indices): sample ``i`` comes from the dataset whose
realised count lags its weight the most, so after any ``n`` samples every dataset's count is
within one of ``weight * n``. The indices are cached like the GPT indices.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Sequence

import numpy as np

from engine.data.gpt_dataset import SPLIT_NAMES, GPTDataset, _atomic_save, split_document_ranges
from engine.data.indexed_dataset import IndexedDataset

# Each blended component is built with this many more samples than its weight asks for, so the
# greedy interleave never runs a component dry (Megatron-LM uses the same 0.5% margin).
BLEND_MARGIN = 1.005


def normalize_weights(weights: Sequence[float], *, count: int) -> np.ndarray:
    """Weights as float64 summing to 1; raises ValueError for a wrong count or a bad value."""
    w = np.asarray([float(x) for x in weights], dtype=np.float64)
    if w.shape != (count,):
        raise ValueError(f"weights={list(weights)} must give one weight per dataset ({count} datasets)")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights={list(weights)} must be finite, >= 0 and not all 0")
    return w / w.sum()


class BlendedDataset:
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``.

    ``ds[i]`` is ``datasets[dataset_index[i]][dataset_sample_index[i]]``; ``dataset_index`` is int16,
    ``dataset_sample_index`` int64, both ``(size,)``.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], *, size: int, cache_dir: str | None = None,
                 name: str = "blend"):
        if not datasets:
            raise ValueError("datasets is empty: blend at least one dataset")
        if size < 1:
            raise ValueError(f"size={size} must be >= 1")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights, count=len(self.datasets))
        self.size = size
        self.built_from_cache = False
        self.dataset_index, self.dataset_sample_index = self._load_or_build(cache_dir, name)
        for k, ds in enumerate(self.datasets):
            picked = self.dataset_sample_index[self.dataset_index == k]
            if picked.size and int(picked.max()) >= len(ds):
                raise ValueError(
                    f"dataset {k} of the blend has {len(ds)} samples but weight {self.weights[k]:.4f} of {size} "
                    f"needs {int(picked.max()) + 1}: build it with more num_samples"
                )

    def _load_or_build(self, cache_dir: str | None, name: str):
        desc = {"class": "BlendedDataset", "weights": self.weights.tolist(), "size": self.size,
                "datasets": [getattr(d, "cache_paths", {}).get("description", repr(d)) for d in self.datasets]}
        stem = None
        if cache_dir is not None:
            digest = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:24]
            stem = os.path.join(cache_dir, f"blend_{name}_{digest}")
            paths = (f"{stem}-dataset_index.npy", f"{stem}-dataset_sample_index.npy")
            if all(os.path.isfile(p) for p in paths):
                self.built_from_cache = True
                return tuple(np.load(p, mmap_mode="r") for p in paths)
        from engine.data import index_helpers

        dataset_index, dataset_sample_index = index_helpers.build_blending_indices(self.weights, self.size)
        if stem is not None:
            os.makedirs(cache_dir, exist_ok=True)
            # sample index first: the dataset index file is the completeness marker checked above.
            _atomic_save(paths[1], np.asarray(dataset_sample_index))
            _atomic_save(paths[0], np.asarray(dataset_index))
        return dataset_index, dataset_sample_index

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float]]:
    """Megatron's ``--data-path``: ``[PREFIX]`` or ``[W1, PREFIX1, W2, PREFIX2, ...]`` -> (prefixes, weights)."""
    items = list(data_path)
    if len(items) == 1:
        return items, [1.0]
    if not items or len(items) % 2:
        raise ValueError(f"data_path={items}: give one prefix, or weight/prefix pairs like ['0.7', 'a', '0.3', 'b']")
    prefixes, weights = [], []
    for w, p in zip(items[0::2], items[1::2]):
        try:
            weights.append(float(w))
        except ValueError:
            raise ValueError(f"data_path={items}: {w!r} is not a weight; pairs are weight then prefix") from None
        prefixes.append(p)
    return prefixes, weights


def build_gpt_datasets(prefixes: Sequence[str], *, weights: Sequence[float] | None = None, split: str = "969,30,1",
                       num_samples: Sequence[int], seq_length: int, seed: int, cache_dir: str | None = None,
                       eod_id: int | None = None, eod_mask_loss: bool = False) -> list:
    """Train, valid and test datasets (``None`` where 0 samples are requested).

    Every prefix is split by documents with ``split``; with several prefixes each split is a
    :class:`BlendedDataset` of exactly ``num_samples[k]`` samples, else a :class:`GPTDataset`
    holding at least ``num_samples[k]``.
    """
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise ValueError(f"num_samples={list(num_samples)} must be three counts >= 0 (train, valid, test)")
    if not prefixes:
        raise ValueError("prefixes is empty: give at least one dataset prefix")
    w = normalize_weights(weights if weights is not None else [1.0] * len(prefixes), count=len(prefixes))
    indexed = [IndexedDataset(p) for p in prefixes]
    ranges = [split_document_ranges(split, ds.num_documents) for ds in indexed]
    out = []
    for k, name in enumerate(SPLIT_NAMES):
        n = int(num_samples[k])
        if n == 0:
            out.append(None)
            continue
        parts = []
        for ds, rng, wk in zip(indexed, ranges, w):
            if wk == 0:
                continue
            want = n if len(prefixes) == 1 else math.ceil(wk * n * BLEND_MARGIN)
            parts.append(GPTDataset(ds, document_range=rng[k], num_samples=want, seq_length=seq_length,
                                    seed=seed, cache_dir=cache_dir, split_name=name, eod_id=eod_id,
                                    eod_mask_loss=eod_mask_loss))
        if len(prefixes) == 1:
            out.append(parts[0])
        else:
            kept = [wk for wk in w if wk > 0]
            out.append(BlendedDataset(parts, kept, size=n, cache_dir=cache_dir or parts[0].cache_dir, name=name))
    return out
