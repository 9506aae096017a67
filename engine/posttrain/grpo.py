"""GRPO-family policy losses on per-token log-probabilities, as pure torch functions.

A rollout batch holds P prompts x G sampled completions, laid out group by group (the G samples of
prompt p are rows ``p*G .. p*G+G-1``). :func:`group_advantages` turns their scalar rewards into
advantages; :func:`grpo_loss` is what the pipeline's last stage evaluates on the completion tokens.

Advantages (GRPO [Shao et al. 2024]): per group, ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with
the *unbiased* std (``torch.std``'s default, as TRL), or ``A_i = r_i - mean(r)`` with
``scale="none"`` (Dr. GRPO [Liu et al. 2025]). A group whose rewards are all equal gets exactly 0.

Per-token loss, on the tokens where ``mask`` is set (the generated completion):

    ratio  r = exp(logp - old_logp)                          ratio_level="token"   (GRPO, DAPO)
           r = exp(mean_t(logp - old_logp)) for every token  ratio_level="sequence" (GSPO [Zheng et al. 2025])
    l_tok  = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A) + kl_beta * k3
    k3     = exp(ref_logp - logp) - (ref_logp - logp) - 1    (Schulman's k3 KL estimator, >= 0)

``clip_high=None`` means ``clip_high = clip_low`` (symmetric PPO clip); DAPO's clip-higher sets it
larger (e.g. 0.28 with clip_low 0.2). ``old_logp`` is the sampling policy's log-probability
(equal to ``logp`` on the first update of a rollout batch, so r == 1 there).

Normalisation (the caller's loss is ``loss_sum / units``, with ``units`` summed over the *global*
batch, all ranks and micro-batches):

- ``loss_level="token"``: ``loss_sum`` sums ``l_tok`` over every masked token; ``units`` counts
  masked tokens (DAPO's token-level loss: long completions weigh by their length).
- ``loss_level="sequence"``: each sequence's token mean of ``l_tok`` is summed; ``units`` counts the
  sequences with at least one masked token (the original GRPO loss: every completion weighs the same).

``units`` depends only on the mask, so :func:`loss_units` gives it before the forward pass.
Masked-out positions contribute exactly zero value and zero gradient, even where their log-probs
are inf or nan: they are selected away with ``torch.where`` before any arithmetic.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch

ADVANTAGE_SCALES = ("std", "none")
RATIO_LEVELS = ("token", "sequence")
LOSS_LEVELS = ("token", "sequence")


def group_advantages(rewards: Union[torch.Tensor, Sequence[float]], *, group_size: int, scale: str = "std",
                     eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages of ``rewards`` ``(P*G,)``, laid out group by group.

    ``scale="std"``: ``(r - group mean) / (group std + eps)`` with the unbiased std (Bessel's
    correction, ``torch.std``'s default, as in TRL); ``scale="none"``: ``r - group mean``.
    A group whose rewards are all equal gets advantage exactly 0 (no rounding residue, no NaN).
    Returns ``(P*G,)`` in at least float32, detached from any graph.
    """
    r = torch.as_tensor(rewards).detach()
    r = r.to(torch.promote_types(r.dtype, torch.float32))
    if r.dim() != 1:
        raise ValueError(f"group_advantages: rewards must be 1-D (P*G,), got shape {tuple(r.shape)}")
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"group_advantages: unknown scale {scale!r}; choose one of {ADVANTAGE_SCALES}")
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_advantages: group_size must be an int >= 2 (G samples per prompt), got "
                         f"{group_size!r}; a single sample always has advantage 0")
    if r.shape[0] % group_size != 0:
        raise ValueError(f"group_advantages: group_size={group_size} does not divide the {r.shape[0]} rewards; "
                         f"pass P*G rewards, G per prompt, group by group")
    if not eps >= 0:
        raise ValueError(f"group_advantages: eps must be >= 0, got {eps}")
    bad = (~torch.isfinite(r)).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"group_advantages: {bad.numel()} non-finite reward(s), first at index {int(bad[0])} "
                         f"({float(r[bad[0]])}); reward functions must return finite floats")

    grouped = r.view(-1, group_size)  # (P, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # (P, G)
    if scale == "std":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    # All-equal groups: r - mean can round to a tiny nonzero value (e.g. three rewards of 0.1).
    equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # (P, 1)
    return torch.where(equal, torch.zeros((), dtype=r.dtype), centred).reshape(-1)  # (P*G,)


@dataclasses.dataclass(kw_only=True)
class GRPOOutput:
    """Result of :func:`grpo_loss`.

    ``loss_sum``: 0-dim, with gradient; the caller's loss is ``loss_sum / (global units)``.
    ``units``: 0-dim int64, the normalisation units in this batch (masked tokens or sequences).
    ``token_losses``: ``(n, t)``, ``l_tok`` per token, exactly 0 at masked-out positions.
    Statistics (0-dim, detached, means over this batch's ``tokens`` masked tokens; weight them by
    ``tokens`` to combine ranks): ``clip_fraction`` (tokens whose clipped branch is active, so they
    get no surrogate gradient), ``ratio_mean``, ``kl_mean`` (k3; None without ``ref_logp``).
    """

    loss_sum: torch.Tensor
    units: torch.Tensor
    token_losses: torch.Tensor
    tokens: torch.Tensor
    clip_fraction: torch.Tensor
    ratio_mean: torch.Tensor
    kl_mean: Optional[torch.Tensor]


def loss_units(mask: torch.Tensor, *, loss_level: str) -> torch.Tensor:
    """0-dim int64: the normalisation units of ``mask`` ``(n, t)`` for ``loss_level`` (see module doc)."""
    if loss_level not in LOSS_LEVELS:
        raise ValueError(f"loss_units: unknown loss_level {loss_level!r}; choose one of {LOSS_LEVELS}")
    keep = mask != 0  # (n, t)
    if loss_level == "token":
        return keep.sum()
    return keep.any(dim=-1).sum()


def _check(logp, old_logp, advantages, mask, ref_logp, kl_beta, clip_low, clip_high, ratio_level, loss_level):
    if logp.dim() != 2 or not logp.is_floating_point():
        raise ValueError(f"grpo_loss: logp must be a floating (n, t) tensor, got {logp.dtype} "
                         f"{tuple(logp.shape)}")
    for name, x in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp)):
        if x is not None and x.shape != logp.shape:
            raise ValueError(f"grpo_loss: {name} {tuple(x.shape)} must have logp's shape {tuple(logp.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"grpo_loss: advantages {tuple(advantages.shape)} must be (n,) = ({logp.shape[0]},), "
                         f"one per sequence (see group_advantages)")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"grpo_loss: unknown ratio_level {ratio_level!r}; choose one of {RATIO_LEVELS}")
    if loss_level not in LOSS_LEVELS:
        raise ValueError(f"grpo_loss: unknown loss_level {loss_level!r}; choose one of {LOSS_LEVELS}")
    if not 0.0 < clip_low < 1.0:
        raise ValueError(f"grpo_loss: clip_low must be in (0, 1) so that 1 - clip_low > 0, got {clip_low}; "
                         f"PPO/GRPO use 0.2 (GSPO uses ~3e-4 with ratio_level='sequence')")
    if not clip_high > 0.0:
        raise ValueError(f"grpo_loss: clip_high must be > 0 (or None for clip_high = clip_low), got {clip_high}; "
                         f"DAPO's clip-higher uses 0.28")
    if not kl_beta >= 0.0:
        raise ValueError(f"grpo_loss: kl_beta must be >= 0, got {kl_beta}")
    if kl_beta > 0.0 and ref_logp is None:
        raise ValueError(f"grpo_loss: kl_beta={kl_beta} needs ref_logp (the reference model's per-token "
                         f"log-probs); pass it or set kl_beta=0")


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              ref_logp: Optional[torch.Tensor] = None, kl_beta: float = 0.0, clip_low: float = 0.2,
              clip_high: Optional[float] = None, ratio_level: str = "token",
              loss_level: str = "token") -> GRPOOutput:
    """Clipped-surrogate GRPO loss (+ k3 KL) summed over ``loss_level`` units; formulas in the module doc.

    ``logp``, ``old_logp``, ``ref_logp``: ``(n, t)`` per-token log-probabilities of the sampled
    tokens under the current, sampling and reference policies; only ``logp`` gets gradient (the
    other two and ``advantages`` ``(n,)`` are detached). ``mask``: ``(n, t)``, bool or numeric
    (nonzero = a completion token that counts). Computation runs in at least float32.
    """
    clip_high = clip_low if clip_high is None else clip_high
    _check(logp, old_logp, advantages, mask, ref_logp, kl_beta, clip_low, clip_high, ratio_level, loss_level)
    dtype = torch.promote_types(logp.dtype, torch.float32)
    keep = mask != 0  # (n, t) bool
    zero = torch.zeros((), dtype=dtype, device=logp.device)

    def masked(x: torch.Tensor) -> torch.Tensor:  # (n, t): x where kept, exactly 0 (and no gradient) elsewhere
        return torch.where(keep, x.to(dtype), zero)

    lp = masked(logp)
    old = masked(old_logp.detach())
    adv = advantages.detach().to(dtype)[:, None]  # (n, 1)
    count = keep.sum(-1)  # (n,) completion tokens per sequence

    log_ratio = lp - old  # (n, t), 0 off the mask
    if ratio_level == "sequence":
        seq_log_ratio = log_ratio.sum(-1) / count.clamp(min=1).to(dtype)  # (n,)
        log_ratio = seq_log_ratio[:, None].expand_as(lp)  # (n, t): the same ratio on every token
    ratio = torch.exp(log_ratio)  # (n, t)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)  # (n, t)

    kl = None
    if ref_logp is not None:
        d = masked(ref_logp.detach()) - lp  # (n, t)
        kl = torch.exp(d) - d - 1.0  # k3, 0 off the mask
        if kl_beta > 0.0:
            per_token = per_token + kl_beta * kl
    per_token = torch.where(keep, per_token, zero)  # (n, t)

    if loss_level == "token":
        loss_sum = per_token.sum()
    else:
        loss_sum = (per_token.sum(-1) / count.clamp(min=1).to(dtype)).sum()

    with torch.no_grad():
        tokens = keep.sum()
        denom = tokens.clamp(min=1).to(dtype)
        r = ratio.detach()
        clip_active = keep & (((r < 1.0 - clip_low) & (adv < 0)) | ((r > 1.0 + clip_high) & (adv > 0)))
        clip_fraction = clip_active.sum().to(dtype) / denom
        ratio_mean = torch.where(keep, r, zero).sum() / denom
        kl_mean = None if kl is None else torch.where(keep, kl.detach(), zero).sum() / denom
    return GRPOOutput(loss_sum=loss_sum, units=loss_units(keep, loss_level=loss_level), token_losses=per_token,
                      tokens=tokens, clip_fraction=clip_fraction, ratio_mean=ratio_mean, kl_mean=kl_mean)
