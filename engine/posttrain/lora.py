"""LoRA adapters on the tensor-parallel linears of a built stage, sharded like their base weight.

:func:`apply_lora` gives every column- and row-parallel linear whose layer-relative name is in
``targets`` (``attention.qkv``, ``attention.out``, ``mlp.fc1``, ``mlp.fc2``; short ``qkv``, ``out``,
``fc1``, ``fc2``, or ``all``; the output layer never; on a mixture-of-experts model the attention
linears only: expert MLPs get no adapters, so MLP targets are refused there) two parameters,
registered on the linear itself: ``lora_A`` (r, in) and ``lora_B`` (out, r), so the checkpoint keys are
``layers.<i>.attention.qkv.lora_A`` / ``.lora_B`` (global layer index: the same at every layout).
The linear then computes ``y = x W^T + b + scaling * dropout(x) A^T B^T`` with ``scaling = alpha /
rank`` (PEFT's default, not rsLoRA), through its ``LinearImpl`` seam (:class:`LoraLinearImpl`).
Every other parameter of the stage is frozen (``requires_grad = False``): DataParallel and the
optimizer only take trainable parameters, so gradients, optimizer state and (optionally) the
checkpoint hold the adapters alone.

Sharding (TP size t). Communication added: none in forward or backward without SP (the row term joins
the base's one reduction), one (s, b, r) all-gather per column linear under SP (a reduce-scatter in
backward), and once per step a TP all-reduce of the replicated adapters' gradients (r x in, out x r):

=============  ======================  ===============================  ===========================
base           W (local)               lora_A (local)                   lora_B (local)
=============  ======================  ===============================  ===========================
column         (out/t, in), rows       (r, in) replicated,              (out/t, r) split like W
                                       gradient a TP partial sum        (same rows, same stride)
row            (out, in/t), columns    (r, in/t) split like W           (out, r) replicated,
                                                                        gradient a TP partial sum
=============  ======================  ===============================  ===========================

B of a column linear has exactly W's rows: the grouped QKV layout (models/attention.py) and the
per-rank [gate_r | up_r] layout of fc1 (``partition_stride = 2``), so the Hugging Face key map that
splits W into q/k/v or gate/up splits B the same way (tools/lora_export.py).

Gradients: a column linear's ``x A^T`` is the same on every TP rank but its output gradient
``dY_r B_r`` is rank r's share, so A's gradient is a partial sum over TP; a row linear's ``x_r A_r^T``
is a partial sum added to the base's partial output BEFORE the one TP reduction, so B's gradient is
a partial sum. Both are marked ``sequence_parallel = True`` (parallel/tensor_parallel/sharding.py):
DataParallel all-reduces them over TP before the data-parallel reduction (one coalesced call per
bucket), after which every TP replica holds the same gradient. Under sequence parallelism a column
linear projects its (s/t, b, in) shard to (s/t, b, r) and all-gathers that (r columns, not the
input's h; reduce-scattered in backward): the adapter never saves the gathered input, and the base
keeps its own gather (and ``regather_sp_input`` choice).

Dropout on the adapter input follows parallel/random.py: a replicated input (column linear without
SP) draws from the default stream, equal on all TP ranks; a partitioned one (column under SP, row)
from the model-parallel stream (``stage.rng.fork()``).

Initialisation: A is Kaiming-uniform as PEFT's (bound ``1/sqrt(in)``, the FULL ``in``), drawn from a
generator seeded by ``(seed, global parameter name)``; a rank keeps its slice. B is zero. So every
TP/PP layout starts from the same full adapter, and the adapted model starts equal to the base.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel.mappings import copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp, reduce_scatter_to_sp
from parallel.tensor_parallel.layers import ColumnParallelLinear, DefaultLinearImpl, LinearImpl, RowParallelLinear
from parallel.tensor_parallel.sharding import mark_replicated, set_tensor_parallel_attributes, shard_tensor

TARGETS = ("attention.qkv", "attention.out", "mlp.fc1", "mlp.fc2")
SHORT_TARGETS = {"qkv": "attention.qkv", "out": "attention.out", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
NEVER_TARGETED = ("output_layer",)
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")
_LAYER_PREFIX = re.compile(r"^layers\.\d+\.")


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """The LoRA hyper-parameters of a run; ``targets`` are resolved layer-relative names."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_json(self, *, adapters_only: bool) -> dict:
        """The checkpoint-metadata record (``trainer_state.lora``) that export tools read back;
        ``adapters_only``: the checkpoint holds the adapters without the frozen base."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets),
                "scaling": self.scaling, "use_rslora": False, "adapters_only": bool(adapters_only)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "LoraSettings":
        missing = [k for k in ("rank", "alpha", "dropout", "targets") if k not in d]
        if missing:
            raise ValueError(f"LoRA metadata {dict(d)} lacks {missing}; was it written by save_trainer?")
        return check_lora(rank=d["rank"], alpha=d["alpha"], dropout=d["dropout"], targets=d["targets"])


def resolve_targets(targets: str | Iterable[str]) -> tuple[str, ...]:
    """Layer-relative linear names (in :data:`TARGETS` order) from full, short names or ``"all"``."""
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    targets = list(targets)
    if not targets:
        raise ValueError("posttrain.lora.targets is empty; name the linears to adapt (qkv, out, fc1, fc2, "
                         "attention.qkv, ...) or 'all'")
    chosen: set[str] = set()
    for t in targets:
        if not isinstance(t, str):
            raise ValueError(f"posttrain.lora.targets entry {t!r} must be a string")
        if t == "all":
            chosen.update(TARGETS)
        elif t in TARGETS:
            chosen.add(t)
        elif t in SHORT_TARGETS:
            chosen.add(SHORT_TARGETS[t])
        else:
            why = (" (the output layer is never adapted)" if any(t == n or t.endswith("." + n) for n in NEVER_TARGETED)
                   else "")
            raise ValueError(f"posttrain.lora.targets entry {t!r} matches no linear{why}; valid names: "
                             f"{', '.join(TARGETS)}, the short {', '.join(SHORT_TARGETS)}, or 'all'")
    return tuple(n for n in TARGETS if n in chosen)


def check_lora(*, rank: int, alpha: float, dropout: float = 0.0, targets: str | Iterable[str] = ("all",),
               fp8: str = "none", tp_overlap: str = "none", num_experts: int = 0) -> LoraSettings:
    """Validate LoRA settings (no process group needed) and return them resolved.

    Refused compositions: ``model.fp8 != "none"`` (the FP8 linear impls own the whole matmul; a LoRA
    term beside an FP8 GEMM is not implemented), ``parallel.tp_overlap = "ring"`` (the ring
    collective matmul decomposes the gather the SP adapter path relies on), and on a mixture-of-experts
    model (``num_experts > 0``, the model config's) any MLP target, ``all`` included: its MLPs are
    experts (``mlp.experts.<e>.fc1``, ``mlp.shared_expert.fc1``), which get no adapters, so ``fc1``/``fc2``
    would adapt only the dense layers, if any; only the attention targets are allowed there.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"posttrain.lora.rank={rank!r} must be an integer >= 1 (the adapters' inner dimension; "
                         "0 in the config disables LoRA and never reaches apply_lora)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"posttrain.lora.alpha={alpha!r} must be a finite number > 0 (scaling = alpha / rank)")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"posttrain.lora.dropout={dropout!r} must be a number in [0, 1)")
    if fp8 != "none":
        raise ValueError(f"posttrain.lora with model.fp8={fp8!r} is not supported: the adapters wrap the "
                         "high-precision TP linears only; set model.fp8='none' (or posttrain.lora.rank=0)")
    if tp_overlap != "none":
        raise ValueError(f"posttrain.lora with parallel.tp_overlap={tp_overlap!r} is not supported: the adapters "
                         "wrap the plain TP linears only; set parallel.tp_overlap='none' (or posttrain.lora.rank=0)")
    resolved = resolve_targets(targets)
    mlp = [t for t in resolved if t.startswith("mlp.")]
    if num_experts and mlp:
        given = targets if isinstance(targets, str) else list(targets)
        raise ValueError(f"posttrain.lora.targets={given!r} include {', '.join(mlp)}, but this is a mixture-of-experts "
                         f"model (num_experts={num_experts}): its MLPs are expert MLPs (mlp.experts.<e>.fc1/fc2, "
                         "mlp.shared_expert), and LoRA on expert MLPs is not supported; set "
                         "posttrain.lora.targets=['qkv', 'out'] to adapt the attention projections only")
    return LoraSettings(rank=rank, alpha=float(alpha), dropout=float(dropout), targets=resolved)


def adapter_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run seed and an adapter's global name (stable across processes)."""
    digest = hashlib.sha256(f"lora:{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def init_lora_a(rank: int, in_features: int, *, seed: int, name: str) -> torch.Tensor:
    """The FULL (rank, in_features) fp32 A of adapter ``name``: Kaiming-uniform with a = sqrt(5), as
    PEFT's ``reset_lora_parameters`` (bound = 1/sqrt(in_features)), from a name-seeded CPU generator."""
    gen = torch.Generator().manual_seed(adapter_seed(seed, name))
    bound = 1.0 / math.sqrt(in_features)
    return torch.empty(rank, in_features, dtype=torch.float32).uniform_(-bound, bound, generator=gen)


class LoraLinearImpl(LinearImpl):
    """The base matmul plus ``scaling * dropout(x) A^T B^T``, reading ``layer.lora_A``/``lora_B``.

    Column: input ``(s, b, in)`` or ``(s/tp, b, in)`` under SP; output ``(s, b, out/tp)``. Row: input
    ``(s, b, in/tp)``; the adapter term joins the base's partial sum before its one reduction.
    ``enabled = False`` (see :func:`adapters_disabled`) computes the base alone.
    """

    def __init__(self, layer: nn.Module, *, base: DefaultLinearImpl, scaling: float, dropout: float, rng):
        self.layer, self.base, self.scaling, self.dropout, self.rng = layer, base, scaling, dropout, rng
        self.enabled = True

    def _drop(self, x: torch.Tensor, *, partitioned: bool) -> torch.Tensor:
        if not self.layer.training or self.dropout == 0.0:
            return x
        fork = self.rng.fork() if partitioned and self.rng is not None else contextlib.nullcontext()
        with fork:
            return F.dropout(x, self.dropout, training=True)

    def column_forward(self, x, weight, bias, *, group, sequence_parallel, gather_output):
        if not self.enabled:
            return self.base.column_forward(x, weight, bias, group=group, sequence_parallel=sequence_parallel,
                                            gather_output=gather_output)
        a, b = self.layer.lora_A, self.layer.lora_B
        if sequence_parallel and group.size > 1:
            y = self.base.column_forward(x, weight, bias, group=group, sequence_parallel=True,
                                         gather_output=False)  # (s, b, out/tp)
            u = F.linear(self._drop(x, partitioned=True), a)  # (s/tp, b, r)
            # backward: reduce-scatter sums every rank's partial dL/du (dY_r B_r) into this chunk's
            u = gather_from_sp(u, group)  # (s, b, r)
        else:
            x = copy_to_tp(x, group)  # (s, b, in); backward sums base and adapter input-grad partials
            y = F.linear(x, weight, bias)  # (s, b, out/tp)
            u = F.linear(self._drop(x, partitioned=False), a)  # (s, b, r), identical on every TP rank
        y = y + self.scaling * F.linear(u, b)  # (s, b, out/tp)
        return gather_from_tp(y, group) if gather_output else y

    def row_forward(self, x, weight, bias, *, group, sequence_parallel):
        if not self.enabled:
            return self.base.row_forward(x, weight, bias, group=group, sequence_parallel=sequence_parallel)
        a, b = self.layer.lora_A, self.layer.lora_B
        u = F.linear(self._drop(x, partitioned=group.size > 1), a)  # (s, b, r), a partial sum over TP
        y = F.linear(x, weight) + self.scaling * F.linear(u, b)  # (s, b, out), a partial sum over TP
        y = reduce_scatter_to_sp(y, group) if sequence_parallel else reduce_from_tp(y, group)
        return y if bias is None else y + bias

    def __repr__(self) -> str:
        return f"LoraLinearImpl(scaling={self.scaling:g}, dropout={self.dropout:g}, enabled={self.enabled})"


def _chunks(stage_or_chunks: nn.Module) -> list[nn.Module]:
    if isinstance(stage_or_chunks, nn.ModuleList):
        return list(stage_or_chunks)
    if not isinstance(stage_or_chunks, nn.Module):
        raise ValueError(f"apply_lora takes a built stage or a ModuleList of stages, got "
                         f"{type(stage_or_chunks).__name__}")
    return [stage_or_chunks]


def _add_adapter(mod: nn.Module, name: str, *, settings: LoraSettings, seed: int, rng) -> None:
    tp = mod.tp_group
    w = mod.weight
    r = settings.rank
    a_full = init_lora_a(r, mod.in_features, seed=seed, name=f"{name}.lora_A")
    kw = dict(dtype=w.dtype, device=w.device)
    if isinstance(mod, ColumnParallelLinear):
        a = nn.Parameter(a_full.to(**kw))  # (r, in), replicated
        b = nn.Parameter(torch.zeros(w.shape[0], r, **kw))  # (out/tp, r), rows as W's
        mark_replicated(a, sequence_parallel=True)
        set_tensor_parallel_attributes(b, partition_dim=0, stride=getattr(w, "partition_stride", 1))
    else:
        a = nn.Parameter(shard_tensor(a_full, rank=tp.rank, size=tp.size, dim=1).to(**kw))  # (r, in/tp)
        b = nn.Parameter(torch.zeros(mod.out_features, r, **kw))  # (out, r), replicated
        set_tensor_parallel_attributes(a, partition_dim=1)
        mark_replicated(b, sequence_parallel=True)
    mod.lora_A, mod.lora_B = a, b
    mod.impl = LoraLinearImpl(mod, base=mod.impl, scaling=settings.scaling, dropout=settings.dropout, rng=rng)


def apply_lora(stage_or_chunks: nn.Module, *, rank: int, alpha: float, dropout: float = 0.0,
               targets: str | Sequence[str] = ("all",), seed: int = 1234) -> list[str]:
    """Add LoRA adapters to the targeted TP linears of a built stage (or of each stage of a
    ModuleList of model chunks), in place, and freeze every other parameter.

    Call it after the model is built and before DataParallel/the optimizer. ``seed`` draws A per
    global adapter name (the run's seed: every layout gets the same adapters). Returns the global
    names of the adapted linears (e.g. ``layers.3.attention.qkv``); a stage may hold none (a
    pipeline stage without layers), but the targets must name linears (ValueError otherwise); on a
    mixture-of-experts model (its ``config.num_experts``, the same on every stage) only attention
    targets (:func:`check_lora`). Records the settings on each stage (``stage.lora_settings``, read by
    :func:`lora_settings`).
    """
    num_experts = max((getattr(getattr(c, "config", None), "num_experts", 0) or 0 for c in _chunks(stage_or_chunks)),
                      default=0)
    settings = check_lora(rank=rank, alpha=alpha, dropout=dropout, targets=targets, num_experts=num_experts)
    plan = []  # everything is checked before any stage changes
    for chunk in _chunks(stage_or_chunks):
        if getattr(chunk, "lora_settings", None) is not None:
            raise ValueError("apply_lora was already called on this stage; build a fresh model to change the "
                             "LoRA settings")
        rng = getattr(chunk, "rng", None)
        if settings.dropout > 0 and rng is None:
            raise ValueError("posttrain.lora.dropout > 0 needs the stage's RNG tracker (stage.rng, set by "
                             "models.build_model); pass a model stage or set dropout=0")
        mods = [(name, mod) for name, mod in chunk.named_modules()
                if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) and name not in NEVER_TARGETED
                and _LAYER_PREFIX.sub("", name) in settings.targets]
        for name, mod in mods:
            if type(mod.impl) is not DefaultLinearImpl:
                raise ValueError(f"LoRA cannot adapt linear {name}: it runs {mod.impl!r}, and the adapters wrap the "
                                 "default TP linear only (model.fp8 and parallel.tp_overlap='ring' are refused with "
                                 "posttrain.lora; set them to 'none')")
        plan.append((chunk, rng, mods))
    adapted: list[str] = []
    for chunk, rng, mods in plan:
        for p in chunk.parameters():
            p.requires_grad_(False)
        for name, mod in mods:
            _add_adapter(mod, name, settings=settings, seed=seed, rng=rng)
            adapted.append(name)
        chunk.lora_settings = settings
    return adapted


def lora_settings(module: nn.Module) -> LoraSettings | None:
    """The settings :func:`apply_lora` recorded on ``module`` or any submodule (a chunk list), or None."""
    for m in module.modules():
        s = getattr(m, "lora_settings", None)
        if isinstance(s, LoraSettings):
            return s
    return None


def lora_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every adapter tensor of ``module`` (names as ``named_parameters``)."""
    return [(n, p) for n, p in module.named_parameters() if n.endswith(ADAPTER_SUFFIXES)]


def is_adapter_key(key: str) -> bool:
    """True for a checkpoint key (``model.layers.0.attention.qkv.lora_A``) or name of an adapter tensor."""
    return key.endswith(ADAPTER_SUFFIXES)


@contextlib.contextmanager
def adapters_disabled(module: nn.Module):
    """Run the block with every adapter of ``module`` off: the frozen base model (e.g. a DPO/GRPO
    reference without a second copy of the weights)."""
    impls = [m.impl for m in module.modules() if isinstance(getattr(m, "impl", None), LoraLinearImpl)]
    for impl in impls:
        impl.enabled = False
    try:
        yield
    finally:
        for impl in impls:
            impl.enabled = True


def settings_from_metadata(meta: Mapping[str, Any]) -> tuple[LoraSettings, bool] | None:
    """``(settings, adapters_only)`` recorded by save_trainer in a checkpoint's metadata, or None
    when the checkpoint was not written by a LoRA run."""
    record = (meta.get("trainer_state") or {}).get("lora")
    if record is None:
        return None
    return LoraSettings.from_json(record), bool(record.get("adapters_only", False))
