"""Weight initialisation that does not depend on the parallel layout.

Each weight is drawn IN FULL from a generator seeded by ``(seed, global parameter name)``; the
layers keep their TP slice. So a weight is the same whatever the TP size, pipeline split or
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
    """``init(name, output=False)`` -> an in-place init function for that parameter's full tensor."""

    def __init__(self, cfg: TransformerConfig, *, seed: int):
        self.cfg = cfg
        self.seed = seed

    def __call__(self, name: str, *, output: bool = False, valid_rows: int | None = None):
        std = self.cfg.initializer_range
        if output and self.cfg.scaled_output_init:
            std /= math.sqrt(2.0 * self.cfg.num_layers)
        seed = param_seed(self.seed, name)

        def init(full: torch.Tensor) -> None:
            gen = torch.Generator(device=full.device)
            gen.manual_seed(seed)
            with torch.no_grad():
                if valid_rows is None:
                    full.normal_(0.0, std, generator=gen)
                else:  # padded vocab rows stay zero, so TP sizes with different padding agree
                    full.zero_()
                    full[:valid_rows].normal_(0.0, std, generator=gen)

        return init
