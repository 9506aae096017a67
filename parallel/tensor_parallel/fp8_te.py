"""``model.fp8_backend = "te"``: Transformer Engine's FP8 GEMMs inside Tessel's TP linears.

**Status: written against Transformer Engine's API but never run with a real TE.** TE cannot be
installed where Tessel is built and tested (its wheels need a CUDA torch and cuDNN; the core wheel
is larger than a lent GPU accepts). The API used here was read from TE's source (2.x: ``Linear``,
``autocast`` / the older ``fp8_autocast``, ``common.recipe``; checked against v2.20.0.dev0). The CPU
tests run this file against ``tests/fake_te`` -- a stand-in with TE's module surface that computes
in high precision -- so they prove Tessel's side (which layers, shared weights, communication,
recipes and groups handed to TE) and nothing about TE's numerics. The ``gpu`` tests that need a
real TE skip without it. docs/fp8.md says the same.

Design. Each FP8 linear's :class:`TeLinearImpl` holds a ``transformer_engine.pytorch.Linear`` built
with ``parallel_mode=None`` and no bias: TE casts and runs the TP-local GEMM (forward, input and
weight gradients), nothing else. Its ``weight`` *is* the Tessel layer's Parameter (the same object,
no copy), so checkpoints, converters, the DP buffers and ZeRO, which swap ``param.data``, see one
tensor. Tessel keeps the TP/SP communication (parallel.mappings: visible, in the ledger) and adds
the bias after the reduction, exactly as the high-precision path does; the TE module is not a
registered submodule, so the state dict is the non-FP8 model's.

Each forward of the stage (one micro-batch) runs inside one TE autocast region (:class:`TeRegion`,
forward hooks on the stage, as Megatron wraps its blocks) with the mapped recipe and the TP group as
the amax reduction group (Megatron's ``tp_only_amax_red``); a linear called outside it (activation
recompute, inside the backward) opens a region of its own. No module runs twice in a region (TE's
rule for ``reduce_amax``):

    tensorwise  -> Float8CurrentScaling(HYBRID)   e4m3 activations/weights, e5m2 gradients; scales of
                   the tensors as TE holds them: a sequence-parallel input is all-gathered before
                   the cast (so its scale is the whole input's, as TE's own SP gather with amax
                   reduction gives), a TP-sharded weight is scaled per shard (as in TE's own
                   column/row modes). Gathers move bf16, not FP8 (Tessel's backend moves FP8).
    delayed     -> DelayedScaling(HYBRID, amax_history_len=model.fp8_amax_history,
                   margin=model.fp8_margin, amax_compute_algo="max", reduce_amax=tp > 1): TE
                   reduces the amaxes over TP and rolls every history once per micro-batch forward
                   (the region's exit) and once per micro-batch backward, so the history counts
                   micro-batch passes, not optimizer steps (TE's semantics; Tessel's own backend
                   updates once per step). At tp = 1 nothing is reduced (TE's default group would be
                   the whole world, across pipeline stages).
    blockwise   -> Float8BlockScaling(HYBRID): 1x128 activation/gradient and 128x128 weight tiles
                   (TE's defaults; power-of-2 scales unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1).
    mxfp8       -> MXFP8BlockScaling(HYBRID): 1x32 blocks with E8M0 (power-of-2) scales along each GEMM's
                   contraction; TE runs it on data-centre Blackwell (sm_100/sm_103) only, so a visible other GPU
                   is refused, and its quantiser needs the rows and the TP-local K and N multiples of 32.
    rowwise     -> refused: TE has no per-row recipe.

TE versions: ``Float8CurrentScaling`` needs TE >= 2.2, ``Float8BlockScaling`` >= 2.3 (refused with
that message otherwise); TE itself refuses block scaling without CUDA >= 12.9 on sm90 or newer.
``MXFP8BlockScaling`` came in TE 2.0. Refused with the TE backend, each before any process group: ``parallel.tp_overlap = "ring"``
(TE's linears run Tessel's plain collectives; TE's own userbuffers overlap is not wired),
``delayed`` with activation recompute (TE keeps delayed scales consistent between a forward and its
recompute only under its own ``te.distributed.checkpoint``), GRPO (its rollouts run the layers on
any number of rows), and token counts per micro-batch that are not multiples of 16 (TE's FP8 GEMM
shape rule; Tessel's own backend pads instead).
TE's delayed-scaling histories live in TE's modules and are not in Tessel's checkpoints: a resumed
run starts them afresh (Tessel's own ``delayed`` checkpoints them and resumes bitwise).
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch
from torch import nn

from parallel.comm import Group
from parallel.mappings import copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp, reduce_scatter_to_sp
from parallel.tensor_parallel.layers import ColumnParallelLinear, LinearImpl, RowParallelLinear

INSTALL_HINT = ("pip install --no-build-isolation 'transformer_engine[pytorch]' on a CUDA machine, or set "
                "model.fp8_backend = 'tessel' (Tessel's own FP8 linears, no TE needed)")

# Tessel recipe -> the Transformer Engine recipe class it maps to (transformer_engine.common.recipe).
TE_RECIPES = {"tensorwise": "Float8CurrentScaling", "delayed": "DelayedScaling", "blockwise": "Float8BlockScaling",
              "mxfp8": "MXFP8BlockScaling"}
TOKEN_MULTIPLE = 16  # TE's FP8 GEMMs need both dimensions of each operand divisible by 16
MX_TOKEN_MULTIPLE = 32  # and its MXFP8 quantiser by 32 (1x32 blocks along either dimension)


def import_te():
    """``transformer_engine.pytorch``, or an ImportError naming the fix (the one guarded import)."""
    try:
        import transformer_engine.pytorch as te  # noqa: F401
    except Exception as e:  # ImportError, or TE's own errors when CUDA/cuDNN are missing
        raise ImportError(f"model.fp8_backend = 'te' needs Transformer Engine, which cannot be imported here "
                          f"({type(e).__name__}: {e}); {INSTALL_HINT}") from None
    return te


def check_te_recipe(recipe: str) -> None:
    """``model.fp8 = recipe`` has a Transformer Engine recipe (also what tools/plan.py refuses to plan)."""
    if recipe not in TE_RECIPES:
        raise ValueError(f"model.fp8 = {recipe!r} has no Transformer Engine recipe (TE maps "
                         f"{', '.join(TE_RECIPES)}); choose one of those, or model.fp8_backend = 'tessel'")


def check_te_backend(*, recipe: str, tp_overlap: str, recompute: str, tokens: int, generates: bool = False) -> None:
    """Check ``model.fp8_backend = 'te'`` before any process group: every refusal names the fix.
    ``tokens``: one micro-batch's rows per FP8 GEMM after the SP gather (sequence / cp x micro-batch size);
    ``generates``: the run also generates with the trained layers (GRPO's rollouts)."""
    check_te_recipe(recipe)
    if tp_overlap != "none":
        raise ValueError(f"parallel.tp_overlap = {tp_overlap!r} with model.fp8_backend = 'te': TE's linears run "
                         "Tessel's plain TP collectives (TE's own overlap is not wired); set parallel.tp_overlap = "
                         "'none', or model.fp8_backend = 'tessel' (FP8 ring collective matmuls)")
    if recipe == "delayed" and recompute != "none":
        raise ValueError(f"model.fp8 = 'delayed' with model.fp8_backend = 'te' and train.activation_checkpointing = "
                         f"{recompute!r}: TE keeps delayed scales consistent between a forward and its recompute "
                         "only under its own checkpoint wrapper, which Tessel's recompute is not; use "
                         "model.fp8 = 'tensorwise' or 'blockwise', activation_checkpointing = 'none', or "
                         "model.fp8_backend = 'tessel'")
    if generates:
        raise ValueError("posttrain.method = 'grpo' with model.fp8_backend = 'te': the rollouts run the trained layers "
                         "on any number of rows (prompts, one-token decode steps), which TE's FP8 GEMMs refuse "
                         f"unless a multiple of {TOKEN_MULTIPLE}; use model.fp8_backend = 'tessel' (it pads)")
    if recipe == "mxfp8" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 10:
        major, minor = torch.cuda.get_device_capability()
        raise ValueError(f"model.fp8 = 'mxfp8' with model.fp8_backend = 'te': TE runs MXFP8 on data-centre Blackwell "
                         f"(sm_100/sm_103) only, and this GPU is sm_{major}{minor}; use model.fp8 = 'blockwise' (TE's "
                         "block scaling), or model.fp8_backend = 'tessel' (MXFP8 emulated: an fp32 matmul)")
    if recipe == "mxfp8" and tokens % MX_TOKEN_MULTIPLE:
        raise ValueError(f"model.fp8 = 'mxfp8' with model.fp8_backend = 'te' needs train.seq_length / parallel.cp x "
                         f"train.micro_batch_size (= {tokens} rows per FP8 GEMM) to be a multiple of "
                         f"{MX_TOKEN_MULTIPLE} (TE's MXFP8 blocks run along the rows too); change one of them, or "
                         "use model.fp8_backend = 'tessel' (it pads)")
    if tokens % TOKEN_MULTIPLE:
        raise ValueError(f"model.fp8_backend = 'te' needs train.seq_length / parallel.cp x train.micro_batch_size "
                         f"(= {tokens} rows per FP8 GEMM) to be a multiple of {TOKEN_MULTIPLE} (TE's FP8 GEMM shape "
                         "rule); change one of them, or use model.fp8_backend = 'tessel' (it pads)")
    try:  # a config error like the others: the launcher says it once, before any process group
        import_te()
        te_recipe(recipe)  # this TE has the recipe's class
    except ImportError as e:
        raise ValueError(str(e)) from None


def te_recipe(recipe: str, *, history_len: int = 16, margin: int = 0, reduce_amax: bool = True):
    """The ``transformer_engine.common.recipe`` object of a Tessel recipe name. ``reduce_amax``
    (delayed): False where the TP group has one rank -- TE would otherwise reduce over the whole world."""
    from transformer_engine.common import recipe as r

    if not hasattr(r, TE_RECIPES.get(recipe, "DelayedScaling")):
        raise ImportError(f"model.fp8 = {recipe!r} with model.fp8_backend = 'te' needs transformer_engine."
                          f"common.recipe.{TE_RECIPES[recipe]}, which this Transformer Engine lacks (current "
                          "scaling came in TE 2.2, block scaling in 2.3, MXFP8 in 2.0); upgrade TE, or set "
                          "model.fp8_backend = 'tessel'")
    if recipe == "tensorwise":
        return r.Float8CurrentScaling(fp8_format=r.Format.HYBRID)
    if recipe == "delayed":
        return r.DelayedScaling(fp8_format=r.Format.HYBRID, amax_history_len=history_len, margin=margin,
                                amax_compute_algo="max", reduce_amax=reduce_amax)
    if recipe == "blockwise":
        return r.Float8BlockScaling(fp8_format=r.Format.HYBRID)
    if recipe == "mxfp8":
        return r.MXFP8BlockScaling(fp8_format=r.Format.HYBRID)
    raise ValueError(f"model.fp8 = {recipe!r} has no Transformer Engine recipe ({', '.join(TE_RECIPES)})")


def _autocast(te, recipe, group: Group):
    """TE's FP8 region: ``autocast(recipe=, amax_reduction_group=)`` (TE >= 2.9), else the older
    ``fp8_autocast(fp8_recipe=, fp8_group=)``."""
    pg = group.pg if group.size > 1 else None
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe, amax_reduction_group=pg)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=pg)


class TeRegion:
    """One stage's TE autocast region, open for the length of each forward of the stage (one per
    micro-batch, as Megatron wraps its blocks): TE's delayed scaling then reduces its amaxes over the TP
    group and rolls its histories once per micro-batch forward (at the region's exit) and once per
    micro-batch backward (in the backward of the region's first linear), not once per linear. A linear
    called while it is closed -- activation recompute re-runs layers inside the backward -- opens a region
    of its own around its call."""

    def __init__(self, te, recipe, group: Group):
        self.te, self.recipe, self.group = te, recipe, group
        self._ctx = None

    @property
    def open(self) -> bool:
        return self._ctx is not None

    def enter(self, module, args) -> None:  # forward pre-hook
        if self._ctx is None:
            ctx = _autocast(self.te, self.recipe, self.group)
            ctx.__enter__()
            self._ctx = ctx

    def exit(self, module, args, output) -> None:  # forward hook, also called when the forward raises
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.__exit__(None, None, None)


class TeLinearImpl(LinearImpl):
    """One layer's TE-backed FP8 GEMM around Tessel's TP collectives (the module docstring)."""

    def __init__(self, module: nn.Module, recipe_name: str, region: TeRegion):
        self.module, self.recipe_name, self.region = module, recipe_name, region

    def _gemm(self, x, weight):
        if self.module.weight is not weight:
            raise RuntimeError("TeLinearImpl: the weight passed is not the Transformer Engine module's (it shares "
                               "the layer's Parameter); was the layer's weight replaced after apply_te_fp8?")
        if self.region.open:
            return self.module(x)
        with _autocast(self.region.te, self.region.recipe, self.region.group):
            return self.module(x)

    def column_forward(self, x, weight, bias, *, group, sequence_parallel, gather_output):
        x = gather_from_sp(x, group) if sequence_parallel else copy_to_tp(x, group)  # (s, b, in)
        y = self._gemm(x, weight)  # (s, b, out/tp)
        if bias is not None:
            y = y + bias
        return gather_from_tp(y, group) if gather_output else y

    def row_forward(self, x, weight, bias, *, group, sequence_parallel):
        y = self._gemm(x, weight)  # (s, b, out) partial sums over TP
        y = reduce_scatter_to_sp(y, group) if sequence_parallel else reduce_from_tp(y, group)  # (s/tp | s, b, out)
        return y if bias is None else y + bias

    def __repr__(self) -> str:
        return f"TeLinearImpl({self.recipe_name!r} -> {type(self.region.recipe).__name__})"


def apply_te_fp8(stage: nn.Module, recipe: str, *, exclude: Sequence[str] = (), history_len: int = 16,
                 margin: int = 0) -> list[str]:
    """Switch ``stage``'s TP linears (all but the output layer and ``exclude``) to TE-backed FP8 in place,
    and open a :class:`TeRegion` around each forward of ``stage``; returns the linears' names. Shapes were
    checked by the model hook (K, N multiples of 16)."""
    from parallel.tensor_parallel.fp8 import ALWAYS_EXCLUDED, _excluded

    te = import_te()
    layers = [(name, mod) for name, mod in stage.named_modules()
              if isinstance(mod, (ColumnParallelLinear, RowParallelLinear))
              and not _excluded(name, (*ALWAYS_EXCLUDED, *exclude))]
    if not layers:
        return []
    group = layers[0][1].tp_group
    if any(mod.tp_group is not group for _, mod in layers):
        raise ValueError("apply_te_fp8: the stage's linears span more than one TP group; one TE amax reduction "
                         "group per stage is assumed")
    region = TeRegion(te, te_recipe(recipe, history_len=history_len, margin=margin, reduce_amax=group.size > 1),
                      group)
    for name, mod in layers:
        out_local, in_local = mod.weight.shape
        # Built on the meta device (no second weight), then given the layer's own Parameter.
        linear = te.Linear(in_local, out_local, bias=False, params_dtype=mod.weight.dtype, device="meta",
                           parallel_mode=None)
        linear.weight = mod.weight
        mod.impl = TeLinearImpl(linear, recipe, region)
    stage.register_forward_pre_hook(region.enter)
    stage.register_forward_hook(region.exit, always_call=True)
    if recipe == "delayed":
        warnings.warn("model.fp8 = 'delayed' with model.fp8_backend = 'te': TE's amax histories are not in Tessel's "
                      "checkpoints, so a resumed run starts them afresh (docs/fp8.md)", stacklevel=2)
    return [name for name, _ in layers]
