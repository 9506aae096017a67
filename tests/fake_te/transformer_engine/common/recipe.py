"""The recipe classes of ``transformer_engine.common.recipe`` that Tessel maps to: TE's names, fields and
defaults (v2.20.0.dev0), no behaviour."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Format(Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"  # e4m3 forward, e5m2 backward


@dataclass
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    def __post_init__(self):
        assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."


@dataclass
class Float8CurrentScaling:
    fp8_format: Format = Format.HYBRID

    def __post_init__(self):
        assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."


@dataclass
class Float8BlockScaling:
    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self):
        assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."


@dataclass
class MXFP8BlockScaling:
    fp8_format: Format = Format.E4M3

    def __post_init__(self):
        assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."
