"""DPO and IPO losses on sequence log-probabilities, as pure torch functions.

The pipeline's last stage computes, for each preference pair i, the log-probability of the chosen
and of the rejected completion under the policy and under the frozen reference (the initial
weights), each reduced over the completion's tokens by :func:`sequence_logps`. With

    z_i = (policy_chosen_i - policy_rejected_i) - (ref_chosen_i - ref_rejected_i)

the per-pair losses are

- ``loss_type="sigmoid"`` (DPO [Rafailov et al. 2023]; with label smoothing eps the conservative
  cDPO form [Mitchell 2023]): ``-(1 - eps) * logsigmoid(beta * z) - eps * logsigmoid(-beta * z)``.
  Sequence log-probabilities are normally *sums* over tokens (``sequence_logps(average=False)``).
- ``loss_type="ipo"`` (IPO [Azar et al. 2023]): ``(z - 1 / (2 * beta)) ** 2``. The IPO paper (and
  TRL) use *length-averaged* log-probabilities (``sequence_logps(average=True)``); this module does
  not average for you: it takes whatever sequence log-probabilities the caller passes, sums or means.

Implicit rewards (for logging, detached): ``chosen_rewards = beta * (policy_chosen - ref_chosen)``,
``rejected_rewards = beta * (policy_rejected - ref_rejected)``, ``margins = chosen - rejected``
(``= beta * z``); a pair is "correct" when its margin is > 0.

Normalisation: the losses are per pair, unreduced. A data-parallel trainer sums them
(:attr:`DPOOutput.loss_sum`) and divides by the global number of pairs (:attr:`DPOOutput.units`
summed over ranks and micro-batches).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES = ("sigmoid", "ipo")


@dataclasses.dataclass(kw_only=True)
class DPOOutput:
    """Per-pair results of :func:`dpo_loss`; every tensor is ``(n,)`` in the compute dtype.

    ``losses`` carries the gradient; the rewards and margins are detached (logging only).
    """

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    margins: torch.Tensor

    @property
    def loss_sum(self) -> torch.Tensor:
        """Scalar sum of the per-pair losses (with gradient); divide by the global pair count."""
        return self.losses.sum()

    @property
    def units(self) -> int:
        """Number of pairs in this batch: the normalisation unit of DPO."""
        return int(self.losses.shape[0])

    @property
    def correct(self) -> torch.Tensor:
        """``(n,)`` float, 1.0 where the chosen reward exceeds the rejected one (margin > 0)."""
        return (self.margins > 0).to(self.margins.dtype)

    @property
    def accuracy(self) -> torch.Tensor:
        """Scalar fraction of pairs with margin > 0 (ties count as wrong); 0 for an empty batch."""
        return dpo_accuracy(self.chosen_rewards, self.rejected_rewards)


def dpo_accuracy(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """Scalar fraction of pairs whose chosen reward is strictly larger than the rejected one.

    Both arguments are ``(n,)``; the result is a detached 0-dim tensor (0.0 when n == 0).
    """
    if chosen_rewards.shape != rejected_rewards.shape:
        raise ValueError(f"dpo_accuracy: chosen_rewards {tuple(chosen_rewards.shape)} and rejected_rewards "
                         f"{tuple(rejected_rewards.shape)} must have the same shape (n,)")
    wins = (chosen_rewards.detach() > rejected_rewards.detach()).float()
    if wins.numel() == 0:
        return wins.sum()
    return wins.mean()


def sequence_logps(token_logp: torch.Tensor, mask: torch.Tensor, *, average: bool) -> torch.Tensor:
    """Reduce per-token log-probabilities ``(n, t)`` over the tokens where ``mask`` is set.

    ``mask`` is ``(n, t)``, bool or numeric (nonzero = counts). Masked-out positions contribute
    exactly zero value and zero gradient, even if their ``token_logp`` is inf or nan (they are
    selected away with ``where``, never multiplied). ``average=False`` returns the sum (the DPO
    convention), ``average=True`` the mean over the counted tokens (the IPO convention); a row with
    no counted token gives 0. Returns ``(n,)`` in ``token_logp``'s dtype.
    """
    if token_logp.dim() != 2:
        raise ValueError(f"sequence_logps: token_logp must be (n, t), got shape {tuple(token_logp.shape)}")
    if mask.shape != token_logp.shape:
        raise ValueError(f"sequence_logps: mask {tuple(mask.shape)} must have token_logp's shape "
                         f"{tuple(token_logp.shape)}")
    keep = mask != 0  # (n, t) bool
    total = torch.where(keep, token_logp, torch.zeros((), dtype=token_logp.dtype, device=token_logp.device)).sum(-1)
    if not average:
        return total  # (n,)
    count = keep.sum(-1).clamp(min=1).to(token_logp.dtype)  # (n,)
    return total / count


def dpo_loss(policy_chosen_logp: torch.Tensor, policy_rejected_logp: torch.Tensor, ref_chosen_logp: torch.Tensor,
             ref_rejected_logp: torch.Tensor, *, beta: float, label_smoothing: float = 0.0,
             loss_type: str = "sigmoid") -> DPOOutput:
    """Per-pair DPO (``"sigmoid"``) or IPO (``"ipo"``) losses; see the module docstring for formulas.

    All four inputs are ``(n,)`` sequence log-probabilities (sums or means over each completion's
    tokens, as the caller chose). The reference log-probabilities are treated as constants
    (detached). Computation runs in at least float32 (bf16/fp16 inputs are upcast).

    ``beta > 0``; ``0 <= label_smoothing < 0.5`` (sigmoid only; IPO has no label smoothing).
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"dpo_loss: unknown loss_type {loss_type!r}; choose one of {DPO_LOSS_TYPES}")
    if not beta > 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}; typical values are 0.1 (DPO) or 0.01-0.5 (IPO)")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo_loss: label_smoothing must be in [0, 0.5), got {label_smoothing}; 0 is plain DPO")
    if loss_type == "ipo" and label_smoothing != 0.0:
        raise ValueError(f"dpo_loss: label_smoothing={label_smoothing} only applies to loss_type='sigmoid'; "
                         f"set it to 0 for IPO")
    named = {"policy_chosen_logp": policy_chosen_logp, "policy_rejected_logp": policy_rejected_logp,
             "ref_chosen_logp": ref_chosen_logp, "ref_rejected_logp": ref_rejected_logp}
    shapes = {k: tuple(v.shape) for k, v in named.items()}
    if len(set(shapes.values())) != 1 or policy_chosen_logp.dim() != 1:
        raise ValueError(f"dpo_loss: all four log-probabilities must be the same (n,) shape, got {shapes}; "
                         f"reduce per-token log-probs with sequence_logps first")

    dtype = torch.promote_types(policy_chosen_logp.dtype, torch.float32)
    pc = policy_chosen_logp.to(dtype)
    pr = policy_rejected_logp.to(dtype)
    rc = ref_chosen_logp.detach().to(dtype)
    rr = ref_rejected_logp.detach().to(dtype)

    z = (pc - pr) - (rc - rr)  # (n,) log-ratio difference
    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * z)
        if label_smoothing > 0.0:
            losses = losses - label_smoothing * F.logsigmoid(-beta * z)
    else:
        losses = (z - 1.0 / (2.0 * beta)) ** 2

    chosen_rewards = (beta * (pc - rc)).detach()
    rejected_rewards = (beta * (pr - rr)).detach()
    return DPOOutput(losses=losses, chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards,
                     margins=chosen_rewards - rejected_rewards)
