"""Data-parallel batch sampling with a resumable position.

Global batch ``b`` is dataset samples ``[b * G, (b + 1) * G)`` (G = global_batch_size), whatever
the data-parallel size. Rank ``r`` of ``dp_size`` takes the contiguous slice
``[b * G + r * L, b * G + (r + 1) * L)`` (L = G / dp_size) and reads it as ``L / micro_batch_size``
micro batches in order. So the same seed gives the same global batches, in the same order, at
every dp size; the split across ranks is the only difference.

The position is ``consumed_samples``: samples consumed by all ranks together, advanced by
``micro_batch_size * dp_size`` per micro batch. ``state_dict()`` is ``{"consumed_samples": n}``
(JSON-able) and ``load_state_dict`` resumes at exactly the next micro batch.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch


class GlobalBatchSampler:
    """Yields this rank's micro batches (lists of dataset indices) from ``consumed_samples`` on.

    Only whole global batches are produced: ``total_samples // global_batch_size`` of them.
    """

    def __init__(self, total_samples: int, *, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, consumed_samples: int = 0):
        if micro_batch_size < 1 or dp_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} and dp_size={dp_size} must be >= 1")
        if global_batch_size < 1 or global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(
                f"global_batch_size={global_batch_size} must be a positive multiple of micro_batch_size * dp_size "
                f"= {micro_batch_size * dp_size}: change one of them"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.total_samples = int(total_samples)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.num_global_batches = self.total_samples // global_batch_size
        if self.num_global_batches < 1:
            raise ValueError(
                f"the dataset has {self.total_samples} samples, fewer than one global batch of "
                f"{global_batch_size}: build it with more num_samples or lower global_batch_size"
            )
        self.check_consumed(consumed_samples)
        self.consumed_samples = int(consumed_samples)

    @property
    def samples_per_micro_step(self) -> int:
        """Samples consumed by all ranks together per micro batch."""
        return self.micro_batch_size * self.dp_size

    @property
    def micro_batches_per_global_batch(self) -> int:
        return self.global_batch_size // self.samples_per_micro_step

    def check_consumed(self, consumed_samples) -> None:
        if not isinstance(consumed_samples, (int, np.integer)) or consumed_samples < 0:
            raise ValueError(f"consumed_samples={consumed_samples!r} must be an int >= 0")
        if consumed_samples % self.samples_per_micro_step:
            raise ValueError(
                f"consumed_samples={consumed_samples} is not a multiple of micro_batch_size * dp_size = "
                f"{self.samples_per_micro_step}: it was saved with another batch layout; resume at a global "
                "batch boundary (a multiple of global_batch_size)"
            )
        if consumed_samples > self.num_global_batches * self.global_batch_size:
            raise ValueError(
                f"consumed_samples={consumed_samples} is past the end of the data "
                f"({self.num_global_batches * self.global_batch_size} usable samples)"
            )

    def micro_batch_at(self, consumed_samples: int) -> list[int]:
        """This rank's micro batch that starts at global position ``consumed_samples``."""
        batch, within = divmod(consumed_samples, self.global_batch_size)
        micro = within // self.samples_per_micro_step
        local = self.global_batch_size // self.dp_size
        start = batch * self.global_batch_size + self.dp_rank * local + micro * self.micro_batch_size
        return list(range(start, start + self.micro_batch_size))

    def __iter__(self) -> Iterator[list[int]]:
        end = self.num_global_batches * self.global_batch_size
        for consumed in range(self.consumed_samples, end, self.samples_per_micro_step):
            yield self.micro_batch_at(consumed)

    def __len__(self) -> int:
        end = self.num_global_batches * self.global_batch_size
        return (end - self.consumed_samples) // self.samples_per_micro_step


def collate_samples(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack per-sample dicts of equal-shape numpy arrays into ``(micro_batch, ...)`` tensors."""
    return {key: torch.from_numpy(np.stack([s[key] for s in samples])) for key in samples[0]}


class DataParallelLoader:
    """Iterates this rank's micro batches (dicts of tensors) and remembers where it is.

    ``num_workers > 0`` reads ahead in worker processes (torch DataLoader); the saved position still
    counts only the micro batches handed out, so a restore never skips read-ahead batches.
    """

    def __init__(self, dataset, *, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 num_workers: int = 0, consumed_samples: int = 0, collate_fn=collate_samples):
        self.dataset = dataset
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.sampler = GlobalBatchSampler(
            len(dataset), global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
            dp_rank=dp_rank, dp_size=dp_size, consumed_samples=consumed_samples)
        self._iterator = None

    @property
    def consumed_samples(self) -> int:
        return self.sampler.consumed_samples

    def state_dict(self) -> dict:
        return {"consumed_samples": int(self.sampler.consumed_samples)}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "consumed_samples" not in state:
            raise ValueError(f"data loader state {state!r} must be a dict with 'consumed_samples'")
        self.sampler.check_consumed(state["consumed_samples"])
        self.sampler.consumed_samples = int(state["consumed_samples"])
        self._iterator = None  # restart reading from the restored position

    def _start(self):
        # A fresh sampler snapshot: the live one's position only moves when a batch is handed out.
        snapshot = GlobalBatchSampler(
            self.sampler.total_samples, global_batch_size=self.sampler.global_batch_size,
            micro_batch_size=self.sampler.micro_batch_size, dp_rank=self.sampler.dp_rank,
            dp_size=self.sampler.dp_size, consumed_samples=self.sampler.consumed_samples)
        if self.num_workers == 0:
            return (self.collate_fn([self.dataset[i] for i in idx]) for idx in snapshot)
        # Its own generator for the workers' base seed: a DataLoader iterator otherwise draws that seed from
        # torch's global CPU generator, the stream dropout draws from, and a resumed run (which starts a new
        # iterator right after restoring the RNG state) would shift every later dropout mask.
        return iter(torch.utils.data.DataLoader(self.dataset, batch_sampler=snapshot, num_workers=self.num_workers,
                                                collate_fn=self.collate_fn, persistent_workers=False,
                                                generator=torch.Generator().manual_seed(0)))

    def __iter__(self) -> "DataParallelLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._iterator is None:
            self._iterator = self._start()
        batch = next(self._iterator)
        self.sampler.consumed_samples += self.sampler.samples_per_micro_step
        return batch

    def __len__(self) -> int:
        """Micro batches left for this rank."""
        return len(self.sampler)
