"""``transformer_engine.pytorch``'s ``Linear`` and autocast as Tessel's TE backend uses them (tests/fake_te/README.md).

``Linear`` keeps TE's constructor (features divided by ``tp_size`` in the column/row modes, parameters
registered as ``weight``/``bias``, ``device="meta"`` deferring initialisation) and its forward's rules that
Tessel must respect: it runs only inside an autocast region, and every FP8 GEMM operand's dimensions are
multiples of 16. It computes ``F.linear`` in the input's precision. Every call appends
``(module id, recipe, amax reduction group, input shape)`` to :data:`CALLS`, every region entered
``(recipe, group)`` to :data:`OPENED`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CALLS: list[tuple] = []
OPENED: list[tuple] = []  # every autocast region entered: (recipe, amax reduction group)
_REGIONS: list[tuple] = []  # the open autocast regions: (recipe, amax reduction group)


class autocast:  # noqa: N801 -- TE's name
    def __init__(self, enabled: bool = True, calibrating: bool = False, recipe=None, amax_reduction_group=None,
                 _graph: bool = False):
        self.enabled, self.recipe, self.group = enabled, recipe, amax_reduction_group

    def __enter__(self):
        OPENED.append((self.recipe, self.group))
        _REGIONS.append((self.recipe, self.group) if self.enabled else None)
        return self

    def __exit__(self, *exc):
        _REGIONS.pop()


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None, fp8_group=None, _graph=False):
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1, get_rng_state_tracker=None,
                 rng_tracker_name=None, init_method=None, bias: bool = True, return_bias: bool = False,
                 params_dtype=None, parallel_mode=None, parameters_split=None, device="cuda", **overlap):
        super().__init__()
        if parallel_mode not in (None, "column", "row"):
            raise AssertionError(f"parallel_mode {parallel_mode} not supported")
        if parallel_mode == "column":
            out_features //= tp_size
        elif parallel_mode == "row":
            in_features //= tp_size
        self.in_features, self.out_features, self.parallel_mode = in_features, out_features, parallel_mode
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        if device != "meta":
            (init_method or (lambda w: nn.init.normal_(w, 0.0, 0.023)))(self.weight)
        self.name = None

    def forward(self, inp: torch.Tensor, is_first_microbatch=None) -> torch.Tensor:
        if not _REGIONS or _REGIONS[-1] is None:
            raise RuntimeError("fake TE: Linear called outside an FP8 autocast region")
        if inp.shape[-1] != self.in_features or tuple(self.weight.shape) != (self.out_features, self.in_features):
            raise RuntimeError(f"fake TE: input {tuple(inp.shape)} / weight {tuple(self.weight.shape)} do not match "
                               f"Linear({self.in_features}, {self.out_features})")
        rows = inp.numel() // inp.shape[-1]
        if rows % 16 or self.in_features % 16 or self.out_features % 16:
            raise AssertionError(f"fake TE: FP8 GEMM dims must be divisible by 16 (rows {rows}, in "
                                 f"{self.in_features}, out {self.out_features})")
        if self.weight.device.type == "meta":
            raise RuntimeError("fake TE: the weight is still on the meta device")
        recipe, group = _REGIONS[-1]
        CALLS.append((id(self), recipe, group, tuple(inp.shape)))
        return F.linear(inp, self.weight, self.bias)
