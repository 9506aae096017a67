"""Rotary inverse frequencies for the supported scalings (default, linear, llama3)."""
from __future__ import annotations

import math

import torch

from models.config import RopeConfig


def inv_freq(rope: RopeConfig, *, head_dim: int, device=None) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies, as Hugging Face's ROPE_INIT_FUNCTIONS compute them."""
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    freq = 1.0 / (rope.theta ** exponent)
    if rope.scaling == "linear":
        return freq / rope.factor
    if rope.scaling == "llama3":
        old_ctx = rope.original_max_position_embeddings
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return freq
