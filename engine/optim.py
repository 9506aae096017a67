"""AdamW over the data-parallel buffers: parameter groups, LR schedules, global clipping, non-finite steps.

Pieces:

* :func:`build_param_groups` - decay / no-decay groups from module types, names and attributes.
* :class:`LRSchedule` / :func:`lr_at` - linear warmup then cosine, linear, constant or WSD decay to
  ``min_lr``, as pure functions of the step.
* :func:`adamw_update` - the AdamW kernel seam: ``engine.ops.fused_adamw.fused_adamw_`` when that op
  exists and the tensors are on CUDA, else ``torch._fused_adamw_`` (torch's fused multi-tensor kernel),
  else a ``torch._foreach_*`` implementation. All take the same arguments.
* :func:`global_grad_norm` - the L2 norm of the whole model's gradient over TP, PP and DP.
* :class:`Optimizer` - one training step: finish the gradient reduction, norm, non-finite check,
  clip, scheduled AdamW update, parameter refresh. Built on
  :class:`parallel.data_parallel.DistributedOptimizer`.

Step counting: ``Optimizer.step_count`` counts *applied* updates; a step skipped for a non-finite
gradient advances neither Adam's bias correction nor the LR schedule.
"""
from __future__ import annotations

import fnmatch
import importlib
import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from engine import _native
from parallel import comm
from parallel.comm import Group
from parallel.data_parallel import DataParallel, DistributedOptimizer

log = logging.getLogger("tessel.optim")

DECAY_STYLES = ("cosine", "linear", "constant", "wsd")
NO_DECAY_GROUPS = ("norms", "biases", "embeddings")
NONFINITE_ACTIONS = ("skip", "stop")
ADAMW_IMPLS = ("auto", "fused_op", "torch_fused", "foreach")


# ---------------------------------------------------------------------------------------------------
# Learning-rate schedules
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """Learning rate as a function of the update index ``step`` (0 = the first update).

    * warmup (``step < warmup_steps``): ``lr * (step + 1) / warmup_steps`` (the last warmup step
      reaches ``lr``);
    * then, with ``p = (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps)`` clamped to
      [0, 1], ``min_lr + (lr - min_lr) * f(p)``: cosine ``f = (1 + cos(pi p)) / 2``, linear ``1 - p``,
      constant ``1``; so the last step (``total_steps - 1``) and beyond run at ``min_lr``;
    * wsd: ``lr`` until the last ``d = max(1, round(wsd_decay_fraction * total_steps))`` steps (but
      not before warmup ends), then linear to ``min_lr`` at the last step.
    """

    lr: float
    total_steps: int
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_style: str = "cosine"
    wsd_decay_fraction: float = 0.2

    def __post_init__(self):
        _check_schedule(lr=self.lr, total_steps=self.total_steps, min_lr=self.min_lr,
                        warmup_steps=self.warmup_steps, decay_style=self.decay_style,
                        wsd_decay_fraction=self.wsd_decay_fraction)

    def __call__(self, step: int) -> float:
        return lr_at(step, lr=self.lr, total_steps=self.total_steps, min_lr=self.min_lr,
                     warmup_steps=self.warmup_steps, decay_style=self.decay_style,
                     wsd_decay_fraction=self.wsd_decay_fraction)


def _check_schedule(*, lr, total_steps, min_lr, warmup_steps, decay_style, wsd_decay_fraction) -> None:
    if isinstance(lr, bool) or not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr={lr!r} must be a finite number > 0, e.g. 3e-4")
    if isinstance(min_lr, bool) or not (isinstance(min_lr, (int, float)) and 0 <= min_lr <= lr):
        raise ValueError(f"min_lr={min_lr!r} must be in [0, lr={lr}]; set min_lr <= lr")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps={total_steps!r} must be an integer >= 1 (the number of updates)")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps={warmup_steps!r} must be an integer in [0, total_steps={total_steps}]; "
                         "shorten the warmup or train longer")
    if decay_style not in DECAY_STYLES:
        raise ValueError(f"decay_style={decay_style!r} is not valid; choose one of: {', '.join(DECAY_STYLES)}")
    if not (isinstance(wsd_decay_fraction, (int, float)) and 0 < wsd_decay_fraction <= 1):
        raise ValueError(f"wsd_decay_fraction={wsd_decay_fraction!r} must be in (0, 1], e.g. 0.2 "
                         "(decay over the last 20% of the steps)")


def lr_at(step: int, *, lr: float, total_steps: int, min_lr: float = 0.0, warmup_steps: int = 0,
          decay_style: str = "cosine", wsd_decay_fraction: float = 0.2) -> float:
    """The learning rate of update ``step`` (see :class:`LRSchedule` for the formulas). Pure."""
    _check_schedule(lr=lr, total_steps=total_steps, min_lr=min_lr, warmup_steps=warmup_steps,
                    decay_style=decay_style, wsd_decay_fraction=wsd_decay_fraction)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an integer >= 0 (0 is the first update)")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay_style == "constant":
        return lr
    start = warmup_steps
    if decay_style == "wsd":
        decay_steps = max(1, int(wsd_decay_fraction * total_steps + 0.5))
        start = max(warmup_steps, total_steps - decay_steps)
        if step < start:
            return lr
    p = min(1.0, max(0.0, (step - start) / max(1, total_steps - 1 - start)))
    if decay_style == "cosine":
        f = 0.5 * (1.0 + math.cos(math.pi * p))
    else:  # linear, and the decay phase of wsd
        f = 1.0 - p
    return min_lr + (lr - min_lr) * f


# ---------------------------------------------------------------------------------------------------
# Parameter groups
# ---------------------------------------------------------------------------------------------------
def _is_norm(module: torch.nn.Module) -> bool:
    norm_types = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._NormBase,
                  getattr(torch.nn, "RMSNorm", torch.nn.LayerNorm))
    return isinstance(module, norm_types) or "Norm" in type(module).__name__


def _is_embedding(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Embedding) or "Embedding" in type(module).__name__


def build_param_groups(module: torch.nn.Module, *, weight_decay: float,
                       no_decay_on: Sequence[str] = NO_DECAY_GROUPS,
                       no_decay_patterns: Sequence[str] = ()) -> list[dict]:
    """Split the trainable parameters of ``module`` into a decay and a no-decay group.

    A parameter gets no weight decay if ``p.no_weight_decay`` is set (True; False forces decay, and
    the attribute wins over every rule), else if its owning module is a norm (``"norms"``: LayerNorm,
    RMSNorm, GroupNorm, BatchNorm or any class whose name contains "Norm"), an embedding
    (``"embeddings"``: nn.Embedding or a class name containing "Embedding", and the last pipeline
    stage's tied copy, marked ``shared_embedding``, so both tied copies step identically), its name ends in "bias"
    (``"biases"``), or its dotted name matches one of the fnmatch ``no_decay_patterns``.
    Returns ``[{"params", "names", "weight_decay"}, {"params", "names", "weight_decay": 0.0}]``
    (empty groups dropped); parameters shared between modules appear once.
    """
    for i, g in enumerate(no_decay_on):
        if g not in NO_DECAY_GROUPS:
            raise ValueError(f"no_decay_on[{i}]={g!r} is not a parameter group; choose from: "
                             f"{', '.join(NO_DECAY_GROUPS)}")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0 and math.isfinite(weight_decay)):
        raise ValueError(f"weight_decay={weight_decay!r} must be a finite number >= 0")
    decay: dict[int, tuple[str, torch.nn.Parameter]] = {}
    no_decay: dict[int, tuple[str, torch.nn.Parameter]] = {}
    seen: set[int] = set()
    for mod_name, mod in module.named_modules():
        for short, p in mod.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{short}" if mod_name else short
            forced = getattr(p, "no_weight_decay", None)
            if forced is not None:
                exempt = bool(forced)
            else:
                exempt = (("norms" in no_decay_on and _is_norm(mod))
                          or ("embeddings" in no_decay_on
                              and (_is_embedding(mod) or getattr(p, "shared_embedding", False)))
                          or ("biases" in no_decay_on and short.endswith("bias"))
                          or any(fnmatch.fnmatchcase(name, pat) for pat in no_decay_patterns))
            (no_decay if exempt else decay)[id(p)] = (name, p)
    groups = []
    for members, wd in ((decay, float(weight_decay)), (no_decay, 0.0)):
        if members:
            groups.append({"params": [p for _, p in members.values()], "names": [n for n, _ in members.values()],
                           "weight_decay": wd})
    return groups


# ---------------------------------------------------------------------------------------------------
# The AdamW kernel seam
# ---------------------------------------------------------------------------------------------------
def _adamw_foreach(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step):
    """Decoupled-weight-decay Adam (Loshchilov & Hutter) with bias correction, via foreach ops."""
    if weight_decay:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(bc2))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr / bc1)


def _adamw_torch_fused(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step):
    steps = [torch.tensor(float(step), device=params[0].device)] * len(params)
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


def resolve_adamw(impl: str = "auto", *, device: torch.device | str = "cpu") -> tuple[str, Callable]:
    """Pick the AdamW kernel: returns ``(name, fn)`` with ``fn(params, grads, exp_avgs, exp_avg_sqs, *,
    lr, beta1, beta2, eps, weight_decay, step)`` updating in place.

    ``"fused_op"`` is ``engine.ops.fused_adamw.fused_adamw_`` (CUDA; the switch-over point once that
    op lands), ``"torch_fused"`` torch's ``_fused_adamw_``, ``"foreach"`` the foreach version;
    ``"auto"`` takes the first available for ``device`` in that order.
    """
    if impl not in ADAMW_IMPLS:
        raise ValueError(f"adamw impl={impl!r} is not valid; choose one of: {', '.join(ADAMW_IMPLS)}")
    device = torch.device(device)
    if impl in ("auto", "fused_op"):
        try:
            op = importlib.import_module("engine.ops.fused_adamw").fused_adamw_
        except (ImportError, AttributeError) as e:
            if impl == "fused_op":
                raise ValueError(f"adamw impl='fused_op' needs engine.ops.fused_adamw ({e}); use 'auto'") from None
            op = None
        # On CPU torch's fused kernel is the faster one (measured); the engine's op wins on CUDA,
        # where it also writes the bf16 parameters in the same pass.
        if op is not None and (impl == "fused_op" or (device.type == "cuda" and _native.has_cuda("adamw"))):
            return "fused_op", op
    if impl in ("auto", "torch_fused") and hasattr(torch, "_fused_adamw_") and device.type in ("cpu", "cuda"):
        return "torch_fused", _adamw_torch_fused
    if impl == "torch_fused":
        raise ValueError(f"adamw impl='torch_fused' is not available for device {device}; use 'foreach'")
    return "foreach", _adamw_foreach


def adamw_update(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
                 impl: str = "auto") -> None:
    """One in-place AdamW update of lists of fp32 tensors (``step`` is 1-based); see :func:`resolve_adamw`."""
    if not params:
        return
    _, fn = resolve_adamw(impl, device=params[0].device)
    fn(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
       weight_decay=weight_decay, step=step)


# ---------------------------------------------------------------------------------------------------
# Global gradient norm and non-finite gradients
# ---------------------------------------------------------------------------------------------------
def counts_in_norm(param: torch.nn.Parameter, *, tp_group: Group | None) -> bool:
    """Whether this rank's copy of ``param`` contributes to the global norm (each element once).

    TP-sharded parameters (``tensor_parallel``) count on every TP rank (each holds a different
    slice); replicated ones only on TP rank 0. A replica of a parameter that lives on another
    pipeline stage too (``shared = True``: the last stage's copy of a tied embedding) never counts:
    the first stage's copy does. ``shared_embedding`` alone (set on BOTH tied copies, for the
    deferred reduction) does not exclude a parameter.
    """
    if getattr(param, "shared", False):
        return False
    if getattr(param, "tensor_parallel", False):
        return True
    return tp_group is None or tp_group.rank == 0


def global_grad_norm(entries: Iterable[tuple[torch.nn.Parameter, torch.Tensor]], *, tp_group: Group | None = None,
                     pp_group: Group | None = None, shard_group: Group | None = None,
                     device: torch.device | str = "cpu", ep_group: Group | None = None) -> torch.Tensor:
    """L2 norm of the whole model's gradient; the same fp32 scalar tensor on every rank.

    ``entries`` are (parameter, gradient) pairs of what this rank holds: full gradients, or with a
    sharded optimizer this rank's shard (then pass the dp group as ``shard_group``: the sums of
    squares are added over it). Sums of squares are added over ``tp_group`` and ``pp_group`` too.
    ``device`` holds the result when this rank has nothing to count (the collectives need it there).
    ``ep_group`` (expert parallelism): the ep ranks hold different experts (``p.expert``), so the expert
    gradients' sums of squares are added over it too; every other parameter is an ep replica.
    """
    def sum_sq(grads):
        if not grads:
            return torch.zeros(1, dtype=torch.float32, device=device)
        return torch.stack(torch._foreach_norm(grads)).float().square().sum().reshape(1)  # (1,)

    entries = [(p, g) for p, g in entries if g.numel() and counts_in_norm(p, tp_group=tp_group)]
    split = ep_group is not None and ep_group.size > 1
    sq = sum_sq([g for p, g in entries if not (split and getattr(p, "expert", False))])  # (1,)
    if split:
        expert_sq = sum_sq([g for p, g in entries if getattr(p, "expert", False)])  # (1,)
        comm.all_reduce(expert_sq, ep_group)
        sq = sq + expert_sq
    for g in (shard_group, tp_group, pp_group):
        if g is not None:
            comm.all_reduce(sq, g)
    return sq.sqrt().reshape(())


class NonFiniteGradError(RuntimeError):
    """The global gradient norm is inf/nan and ``nonfinite="stop"``."""


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def describe_nonfinite(pieces, *, norm: float, groups: Sequence[Group | None], step: int,
                       device: torch.device | str = "cpu", local: bool = False) -> str:
    """Find this rank's first parameter (in the order of ``pieces``) with a non-finite gradient and the
    lowest global rank that has one (a collective over ``groups``: every rank must call it, which they
    do since the norm is global). Returns the report."""
    first = next((pc.name for pc in pieces if not bool(torch.isfinite(pc.grad).all())), None)
    me = _global_rank()
    big = 2**30
    lowest = torch.tensor([float(me if first is not None else big)], device=device)
    for g in groups:
        if g is not None:
            comm.all_reduce(lowest, g, op="min")
    where = f"rank {me}: first non-finite gradient in parameter {first!r}" if first is not None else \
        f"rank {me}: local gradients finite"
    low = int(lowest.item())
    bad = f"lowest rank with a non-finite gradient: {low}" if low < big else "no rank found a non-finite element"
    how = ("Each replica's gradients are its own (DiLoCo's inner steps); the replicas agreed to skip together"
           if local else "The gradients were checked after the data-parallel reduction, so every replica of a bad "
           "bucket sees it")
    return f"non-finite gradient norm ({norm}) at update {step}; {where}; {bad}. {how}"


# ---------------------------------------------------------------------------------------------------
# The optimizer
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepResult:
    """What one :meth:`Optimizer.step` did: ``lr`` used, ``grad_norm`` before clipping, ``clip_coef``
    applied (1.0 when not clipped), ``applied`` False when skipped, ``message`` why."""

    lr: float
    grad_norm: float
    clip_coef: float
    applied: bool
    message: str | None = None


class Optimizer:
    """AdamW with fp32 masters over ``ddp``'s buffers (sharded when ``ddp.zero_stage >= 1``).

    ``schedule`` gives the LR per applied update; ``clip_grad`` (0 disables) clips the global norm
    over ``tp_group``/``pp_group``/dp; ``nonfinite`` "skip" (warn, no update) or "stop" (raise
    :class:`NonFiniteGradError`). Typical loop::

        opt.zero_grad()
        for i, mb in enumerate(microbatches):
            ctx = ddp.no_sync() if i < len(microbatches) - 1 else contextlib.nullcontext()
            with ctx:
                (loss_fn(ddp(mb)) / len(microbatches)).backward()
        result = opt.step()
    """

    def __init__(self, ddp: DataParallel, *, schedule: LRSchedule, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, clip_grad: float = 1.0,
                 nonfinite: str = "skip", no_decay_on: Sequence[str] = NO_DECAY_GROUPS,
                 no_decay_patterns: Sequence[str] = (), tp_group: Group | None = None,
                 pp_group: Group | None = None, impl: str = "auto", ep_group: Group | None = None):
        if not isinstance(ddp, DataParallel):
            raise ValueError(f"Optimizer needs a parallel.data_parallel.DataParallel (got {type(ddp).__name__}); "
                             "wrap the model first (dp_group=Group.trivial('dp') for one process)")
        if nonfinite not in NONFINITE_ACTIONS:
            raise ValueError(f"nonfinite={nonfinite!r} is not valid; choose 'skip' or 'stop'")
        if not (isinstance(clip_grad, (int, float)) and clip_grad >= 0 and math.isfinite(clip_grad)):
            raise ValueError(f"clip_grad={clip_grad!r} must be >= 0 (0 disables clipping)")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}]={b} must be in [0, 1); e.g. (0.9, 0.95)")
        if not eps > 0:
            raise ValueError(f"eps={eps} must be > 0, e.g. 1e-8")
        self.ddp = ddp
        self.schedule = schedule
        self.clip_grad = float(clip_grad)
        self.nonfinite = nonfinite
        self.tp_group, self.pp_group = tp_group, pp_group
        self.ep_group = ep_group  # expert parallelism: expert gradients differ over it (the grad norm sums them)
        with ddp.full_shapes():  # ZeRO-3: groups go by shape (matrices decay, vectors not)
            self.param_groups = build_param_groups(ddp.module, weight_decay=weight_decay, no_decay_on=no_decay_on,
                                                   no_decay_patterns=no_decay_patterns)
        self.device = ddp.flat_buffers[0].device
        self.impl, kernel = resolve_adamw(impl, device=self.device)
        self.dist = DistributedOptimizer(ddp, param_groups=self.param_groups, update_fn=kernel, betas=betas, eps=eps,
                                         update_writes_bf16=self.impl == "fused_op")
        self._order = {id(p): i for i, p in enumerate(ddp.module.parameters())}  # "first" = registration order

    @classmethod
    def from_config(cls, ddp: DataParallel, cfg, *, total_steps: int, tp_group: Group | None = None,
                    pp_group: Group | None = None, ep_group: Group | None = None) -> "Optimizer":
        """Build from an ``optim`` config section (fields of ``engine.config`` OptimConfig)."""
        schedule = LRSchedule(lr=cfg.lr, min_lr=cfg.min_lr, total_steps=total_steps, warmup_steps=cfg.warmup_steps,
                              decay_style=cfg.decay_style, wsd_decay_fraction=cfg.wsd_decay_fraction)
        return cls(ddp, schedule=schedule, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                   clip_grad=cfg.clip_grad, nonfinite=cfg.nonfinite, no_decay_on=tuple(cfg.no_decay_on),
                   tp_group=tp_group, pp_group=pp_group, ep_group=ep_group)

    @property
    def step_count(self) -> int:
        return self.dist.step_count

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()

    def grad_norm(self) -> torch.Tensor:
        """Global gradient norm of the reduced gradients (call after the reduction finished)."""
        # Sharded with experts: each dp rank's shard holds distinct expert pieces (its ep rank's experts, its
        # edp shard of them), so the sum over the dp group already counts each expert once; no ep sum.
        return global_grad_norm(((pc.param, pc.grad) for pc in self.dist.pieces), tp_group=self.tp_group,
                                pp_group=self.pp_group, shard_group=self.ddp.dp_group if self.ddp.sharded else None,
                                device=self.device, ep_group=None if self.ddp.sharded else self.ep_group)

    def step(self) -> StepResult:
        """Finish the gradient reduction, measure, check, clip and apply one scheduled AdamW update."""
        self.dist.prepare_grads()
        norm = float(self.grad_norm())
        lr = self.schedule(self.step_count)
        if self.ddp.local_grads and self.ddp.dp_group.size > 1:
            # DiLoCo's inner steps: each replica's norm is its own, so a non-finite gradient on one replica is
            # seen there only. The replicas agree first (one float64 MAX over dp), so that all of them skip,
            # report and keep the same step count (else one would wait alone in the report's collective).
            bad = torch.tensor([0.0 if math.isfinite(norm) else 1.0], dtype=torch.float64, device=self.device)
            comm.all_reduce(bad, self.ddp.dp_group, op="max")
            if bad.item() and math.isfinite(norm):
                norm = float("nan")  # another replica's gradient: this step is non-finite for the whole run
        if not math.isfinite(norm):
            # Every rank of the model's groups is here (the norm is global), so collectives are safe.
            pieces = sorted(self.dist.pieces, key=lambda pc: self._order[id(pc.param)])
            msg = describe_nonfinite(pieces, norm=norm, groups=(self.ddp.dp_group, self.tp_group, self.pp_group),
                                     step=self.step_count, device=self.device, local=self.ddp.local_grads)
            if self.nonfinite == "stop":
                raise NonFiniteGradError(msg + "; stopping (optim.nonfinite='stop'; 'skip' would skip the step)")
            log.warning("%s; skipping this step", msg)
            return StepResult(lr=lr, grad_norm=norm, clip_coef=1.0, applied=False, message=msg)
        coef = 1.0
        if self.clip_grad > 0:
            coef = min(1.0, self.clip_grad / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
            self.dist.scale_grads(coef)
        self.dist.step(lr=lr)
        return StepResult(lr=lr, grad_norm=norm, clip_coef=coef, applied=True)

    def state_bytes(self) -> int:
        """Optimizer-state bytes on this rank (fp32 masters when separate, exp_avg, exp_avg_sq)."""
        return self.dist.state_bytes()

    # -- state (the checkpoint composes it) ------------------------------------------------------------
    def state_dict(self) -> dict:
        """The optimizer's counters (JSON); its tensors are :meth:`state_shards`."""
        return {"steps": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.dist.step_count = int(state["steps"])

    def state_shards(self) -> list[dict]:
        """This rank's masters and moments as flat shards per buffer (see ``DistributedOptimizer.state_shards``)."""
        return self.dist.state_shards()

    def reset_masters_from_params(self) -> None:
        """Re-derive the fp32 masters from the parameters (after loading weights only)."""
        self.dist.load_masters_from_params()
