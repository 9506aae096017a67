"""Random token samples in the shape the trainer's loaders produce, for benchmarks and tests that need
a model's real batch shapes but no corpus."""
from __future__ import annotations

import numpy as np


class RandomTokens:
    """``n`` samples of ``seq`` uniform token ids below ``vocab``; sample ``i`` is drawn from seed
    ``seed + i``, so every rank and every run sees the same sample ``i``. Each sample is a dict of
    ``tokens`` and ``labels`` (the ids shifted by one), ``position_ids`` and an all-ones ``loss_mask``."""

    def __init__(self, n: int, *, vocab: int, seq: int, seed: int = 0):
        for name, v in (("n", n), ("vocab", vocab), ("seq", seq)):
            if v < 1:
                raise ValueError(f"RandomTokens {name}={v} must be >= 1")
        self.n, self.vocab, self.seq, self.seed = n, vocab, seq, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} of {self.n}")
        ids = np.random.default_rng(self.seed + i).integers(0, self.vocab, self.seq + 1)
        return {"tokens": ids[:-1], "labels": ids[1:], "position_ids": np.arange(self.seq),
                "loss_mask": np.ones(self.seq, dtype=np.float32)}
