"""Weight initialisation that does not depend on the parallel layout.

Each weight is drawn from a generator seeded by ``(seed, global parameter name)``, as the rows of
the FULL tensor in blocks; a layer keeps its TP slice of each block, so no rank holds a weight it
does not own. So a weight is the same whatever the TP size, pipeline split or
creation order -- TP=n shards equal the TP=1 weight chunked, and a pipeline's last stage can build
its copy of a tied embedding equal to the first stage's without communicating.
Distributions follow Hugging Face's ``_init_weights`` for the families: N(0, initializer_range)
for linears and embeddings, scaled by 1/sqrt(2 * num_layers) for output projections where the
family does so (GPT-2); biases 0, norm weights 1 (set by the modules).
"""
from __future__ import annotations

import hashlib
import math

import torch

from models.config import TransformerConfig


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run seed and a parameter's global name (stable across processes)."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Initializer:
    """``init(name, output=False)`` -> a :class:`NamedInit` for that parameter's full tensor."""

    def __init__(self, cfg: TransformerConfig, *, seed: int):
        self.cfg = cfg
        self.seed = seed

    def __call__(self, name: str, *, output: bool = False, valid_rows: int | None = None) -> "NamedInit":
        std = self.cfg.initializer_range
        if output and self.cfg.scaled_output_init:
            std /= math.sqrt(2.0 * self.cfg.num_layers)
        return NamedInit(seed=param_seed(self.seed, name), std=std, valid_rows=valid_rows)


BLOCK_ELEMENTS = 1 << 22  # about 16 MiB of fp32 per generated block


class NamedInit:
    """N(0, std) from a generator seeded by the parameter's name; rows at and above ``valid_rows``
    (vocabulary padding) are zero, so TP sizes with different padding agree.

    Two ways to run it, with the same values: ``init(full)`` fills a whole tensor; :meth:`blocks`
    yields the full tensor's rows block by block, so a rank can keep only its shard and never hold
    the whole weight (``parallel.tensor_parallel.layers`` does). Block boundaries depend only on the
    full shape, never on the layout; on CPU the blocks are bit-identical to one ``normal_`` over the
    full tensor (torch fills it in 16-element Box-Muller groups, and every block but the last holds a
    multiple of 16 elements).
    """

    def __init__(self, *, seed: int, std: float, valid_rows: int | None):
        self.seed, self.std, self.valid_rows = seed, std, valid_rows

    def _generator(self, device) -> torch.Generator:
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        return gen

    def __call__(self, full: torch.Tensor) -> None:
        gen = self._generator(full.device)
        with torch.no_grad():
            if self.valid_rows is None:
                full.normal_(0.0, self.std, generator=gen)
            else:
                full.zero_()
                full[:self.valid_rows].normal_(0.0, self.std, generator=gen)

    def blocks(self, shape: tuple[int, ...], *, device=None):
        """Yield ``(row_start, block)``: fp32 blocks of consecutive dim-0 rows covering ``shape``.

        Every block is a view of ONE buffer (the largest block), valid until the next is yielded:
        copy out what you keep. Reusing it keeps the allocator from growing its heap block by block.
        """
        rows = shape[0]
        row_numel = math.prod(shape[1:])
        valid = rows if self.valid_rows is None else self.valid_rows
        bounds = _block_bounds(valid, row_numel)
        gen = self._generator(device or "cpu")
        if bounds:
            buf = torch.empty(max(b - a for a, b in bounds) * row_numel, dtype=torch.float32, device=device)
            for a, b in bounds:
                block = buf[:(b - a) * row_numel].view(b - a, *shape[1:])  # (rows in block, ...)
                block.normal_(0.0, self.std, generator=gen)
                yield a, block
            del buf
        if valid < rows:  # vocabulary padding: zero rows, no draws
            yield valid, torch.zeros((rows - valid, *shape[1:]), dtype=torch.float32, device=device)


def _block_bounds(rows: int, row_numel: int) -> list[tuple[int, int]]:
    """Row ranges of at most ~BLOCK_ELEMENTS each; every range but the last holds a multiple of 16
    elements and the last at least 16 (or everything), so blockwise draws equal one full draw on CPU."""
    if rows == 0:
        return []
    step = 16 // math.gcd(row_numel, 16) if row_numel else 1  # rows per 16-aligned unit
    per = max(step, (BLOCK_ELEMENTS // max(row_numel, 1)) // step * step)
    bounds = [(a, min(a + per, rows)) for a in range(0, rows, per)]
    if len(bounds) > 1 and (bounds[-1][1] - bounds[-1][0]) * row_numel < 16:
        bounds[-2:] = [(bounds[-2][0], rows)]  # a tail under 16 elements joins the block before it
    return bounds
