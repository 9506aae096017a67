"""Top-k routing of tokens to experts, and the router's auxiliary losses.

Scores are computed in fp32 from the router logits. Each family renormalises the top-k scores its way:

* Mixtral: softmax over all experts, top-k, then divided by their sum (= softmax over the top-k logits);
* Qwen2-MoE / Qwen3-MoE: softmax, top-k, divided by their sum only when ``norm_topk_prob``;
* ``score_func="sigmoid"``: sigmoid scores, top-k, optionally renormalised (DeepSeek-V3 style).

The load-balancing loss is Hugging Face's ``load_balancing_loss_func`` (Switch Transformer eq. 4-6):
``E * sum_e f_e * P_e`` with ``f_e`` the top-k assignments of expert ``e`` per token and ``P_e`` its mean
router probability. Hugging Face pools the counts and probabilities of ALL layers before the product;
:func:`load_balancing_loss` takes the per-layer :class:`RouterStats` and does the same, so one layer
gives the per-layer loss and a model's layers give transformers' ``aux_loss``. The z-loss (ST-MoE) is
``mean(logsumexp(logits)^2)``.

Dropless by default; :func:`drop_over_capacity` applies a capacity factor (token dropping by
probability or by position), before dispatch and after the aux-loss statistics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

SCORE_FUNCS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")


def check_routing(*, num_experts: int, top_k: int, ep: int = 1) -> None:
    """ValueError naming the fix unless ``1 <= top_k <= num_experts`` and ``ep`` divides ``num_experts``."""
    for name, v in (("num_experts", num_experts), ("top_k", top_k), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} (num_experts_per_tok) exceeds num_experts={num_experts}: a token cannot "
                         f"be routed to more experts than exist; set num_experts_per_tok <= {num_experts}")
    if num_experts % ep:
        fits = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(f"num_experts={num_experts} is not divisible by parallel.ep={ep}: every expert-parallel "
                         f"rank holds the same number of whole experts; choose ep in {fits}")


def check_expert_tp(expert_tp: int | None, *, tp: int, sequence_parallel: bool) -> int:
    """The expert TP size (``None``: ``tp``); ValueError naming the fix unless it is ``tp`` (experts sharded
    over the tp group like the dense MLP) or 1 (experts whole on every tp rank), and 1 at ``tp`` > 1 comes
    with sequence parallelism (each tp rank routes its own sequence chunk; docs/moe.md)."""
    if expert_tp is None:
        return tp
    if isinstance(expert_tp, bool) or not isinstance(expert_tp, int) or expert_tp < 1:
        raise ValueError(f"parallel.expert_tp={expert_tp!r} must be a positive integer: 1 (experts whole on every "
                         f"tp rank) or parallel.tp={tp} (experts sharded over tp, the default)")
    if expert_tp not in (1, tp):
        raise ValueError(f"parallel.expert_tp={expert_tp} is not built at parallel.tp={tp}: experts are either "
                         f"sharded over the whole tp group (expert_tp = tp = {tp}, the default) or whole on every "
                         f"tp rank (expert_tp = 1); set parallel.expert_tp to 1 or {tp}")
    if expert_tp == 1 and tp > 1 and not sequence_parallel:
        raise ValueError(f"parallel.expert_tp=1 at parallel.tp={tp} needs sequence parallelism: each tp rank routes "
                         f"its own sequence chunk to whole experts (without it every tp rank would compute every "
                         f"token's experts); set parallel.sequence_parallel=true, or parallel.expert_tp={tp} "
                         f"(experts sharded over tp)")
    return expert_tp


@dataclass
class Routing:
    """One layer's routing of ``T`` tokens: ``indices`` (T, k) int64 expert ids, ``weights`` (T, k) the
    combine weights (differentiable), ``probs`` (T, E) fp32 scores, ``logits`` (T, E)."""

    indices: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor


@dataclass
class RouterStats:
    """What the aux losses need from one layer: ``counts`` (E,) fp32 top-k assignments per expert (no
    gradient), ``prob_sum`` (E,) fp32 summed router probabilities (differentiable), ``tokens``."""

    counts: torch.Tensor
    prob_sum: torch.Tensor
    tokens: int


def load_balancing_loss(stats: Sequence[RouterStats], *, num_experts: int) -> torch.Tensor:
    """Hugging Face's aux loss over the given layers (pooled as transformers pools them)."""
    if not stats:
        raise ValueError("load_balancing_loss needs the stats of at least one MoE layer")
    counts = sum(s.counts for s in stats)  # (E,)
    prob_sum = sum(s.prob_sum for s in stats)  # (E,)
    rows = float(sum(s.tokens for s in stats))
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2 (fp32)."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class TopKRouter(nn.Module):
    """``weight`` (E, h), replicated on every rank. ``forward(x (T, h)) -> Routing``.

    Aux-loss-free balancing (DeepSeek-V3, :meth:`enable_bias_balancing`): a per-expert ``expert_bias``
    buffer (E,) fp32 is added to the scores for the top-k *selection* only (the combine weights stay the
    unbiased scores of the chosen experts); after every step :meth:`update_bias` moves it by ``rate`` toward
    balance, ``b_e += rate * sign(mean load - load_e)``, from the global batch's load (every replica gets
    the same counts, so the biases stay identical)."""

    def __init__(self, hidden_size: int, num_experts: int, *, top_k: int, score_func: str = "softmax",
                 norm_topk_prob: bool = True, dtype=None, device=None):
        super().__init__()
        check_routing(num_experts=num_experts, top_k=top_k)
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={score_func!r}: use one of {SCORE_FUNCS}")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.norm_topk_prob = score_func, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device))
        self.bias_update_rate = 0.0
        self.register_buffer("expert_bias", None)  # (E,) fp32 once enable_bias_balancing() is called

    def enable_bias_balancing(self, rate: float) -> None:
        """Aux-loss-free balancing with step size ``rate`` (> 0; DeepSeek-V3 uses 1e-3); the bias starts at 0."""
        if isinstance(rate, bool) or not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
            raise ValueError(f"bias update rate={rate!r} must be a finite number > 0 (e.g. 1e-3), or leave the "
                             "balancing off")
        self.bias_update_rate = float(rate)
        self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32,
                                                        device=self.weight.device))

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """One balancing step from ``counts`` (E,): the (token, choice) pairs each expert got in the step."""
        counts = counts.to(self.expert_bias.device, torch.float32)  # (E,)
        self.expert_bias.add_(torch.sign(counts.mean() - counts), alpha=self.bias_update_rate)

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, self.weight)  # (T, E)
        if self.score_func == "softmax":
            probs = torch.softmax(logits.float(), dim=-1)  # (T, E)
        else:
            probs = torch.sigmoid(logits.float())
        if self.expert_bias is not None:  # biased selection, unbiased weights
            indices = torch.topk(probs + self.expert_bias, self.top_k, dim=-1).indices  # (T, k)
            top = probs.gather(-1, indices)  # (T, k)
        else:
            top, indices = torch.topk(probs, self.top_k, dim=-1)  # (T, k)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return Routing(indices=indices, weights=top.to(x.dtype), probs=probs, logits=logits)

    def stats(self, routing: Routing) -> RouterStats:
        with torch.no_grad():
            counts = torch.bincount(routing.indices.reshape(-1), minlength=self.num_experts).float()  # (E,)
        return RouterStats(counts=counts, prob_sum=routing.probs.sum(dim=0), tokens=routing.probs.shape[0])

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, score={self.score_func}, "
                f"norm_topk_prob={self.norm_topk_prob}, bias_update_rate={self.bias_update_rate}")


def expert_capacity(num_tokens: int, *, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Choices one expert takes from ``num_tokens`` local tokens: ceil(factor * T * k / E) (Switch, Megatron)."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def drop_over_capacity(routing: Routing, *, num_experts: int, capacity_factor: float, policy: str = "probs"
                       ) -> tuple[Routing, int]:
    """``routing`` with the (token, choice) pairs beyond each expert's capacity dropped: their expert id
    becomes ``num_experts`` (no expert; the dispatchers skip it, the token keeps its other choices and the
    residual). Which pairs stay: per expert, the highest combine weights (``"probs"``) or the earliest
    (token, choice) positions (``"position"``); ties keep the earlier position. Decided on this rank's
    tokens, so it does not depend on ep. Returns the new routing and the number of dropped pairs."""
    if policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy={policy!r}: use one of {DROP_POLICIES}")
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None: dropless)")
    t, k = routing.indices.shape
    cap = expert_capacity(t, num_experts=num_experts, top_k=k, capacity_factor=capacity_factor)
    with torch.no_grad():
        flat = routing.indices.reshape(-1)  # (T*k,)
        if policy == "probs":
            prio = torch.argsort(-routing.weights.detach().reshape(-1).float(), stable=True)  # (T*k,) best first
        else:
            prio = torch.arange(t * k, device=flat.device)
        by_expert = prio[torch.argsort(flat[prio], stable=True)]  # grouped by expert, by priority inside
        counts = torch.bincount(flat, minlength=num_experts)  # (E,)
        starts = torch.cumsum(counts, 0) - counts  # (E,)
        rank_in_expert = torch.arange(t * k, device=flat.device) - starts[flat[by_expert]]
        keep = torch.empty_like(flat, dtype=torch.bool)
        keep[by_expert] = rank_in_expert < cap
        indices = torch.where(keep, flat, torch.full_like(flat, num_experts)).view(t, k)  # (T, k)
    dropped = int((~keep).sum())
    return Routing(indices=indices, weights=routing.weights, probs=routing.probs, logits=routing.logits), dropped


class AuxLossInjector(torch.autograd.Function):
    """Identity on the layer output forward; backward also seeds ``aux_loss`` with gradient ``scale``.

    The auxiliary losses then train the router without travelling down the pipeline to the loss:
    Megatron-Core's ``MoEAuxLossAutoScaler``. ``scale`` is the loss's weight in the step (1.0, or the
    trainer's micro-batch normalisation)."""

    @staticmethod
    def forward(ctx, out, aux_loss, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None
