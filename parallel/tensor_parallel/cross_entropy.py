"""Cross-entropy over vocab-sharded logits, without ever gathering the full vocabulary.

Each TP rank holds logits for vocab entries ``[r*V_local, (r+1)*V_local)``. Forward all-reduces
the per-token max (MAX), then one SUM all-reduce of the stacked (target logit, sum of exp[, sum of
logits for label smoothing]) -- the target logit contributed by its owner, zero elsewhere.
Backward is written by hand from the saved softmax shard: ``(softmax - (1-eps) onehot - eps/C) * g``.

``hide_max=True`` (the ring overlap, parallel.tp_overlap = "ring") issues the MAX all-reduce
asynchronously and runs the exp pass, the forward's largest compute, under it: the shard is shifted
by its own per-token max m_r instead of the global M, and the sums are rescaled by exp(m_r - M) once
M arrives (exp(x - M) = exp(x - m_r) exp(m_r - M)). Same calls and bytes; the result differs from the
default by fp32 rounding only (one extra product per token).
"""
from __future__ import annotations

import torch

from parallel import comm
from parallel.comm import Group
from parallel.tensor_parallel.layers import check_ids


def _hidden_max_stats(x: torch.Tensor, group: Group, *, owned, local_t, n_valid_local: int, smoothing: bool):
    """The statistics of the default path (target logit - M, sum of exp(x - M)[, sum of (x - M)]) with the
    MAX all-reduce in flight under the exp pass. ``x`` (..., V_local) becomes exp(x - m_r) in place.
    Returns (stats list, rescale (...) = exp(m_r - M), 0 for a shard of padding only)."""
    local_max = x.max(dim=-1).values  # (...)
    global_max = local_max.clone()
    work = comm.all_reduce(global_max, group, op="max", async_op=True)
    finite = torch.isfinite(local_max)  # -inf: this shard is all padding (its entries get exp = 0)
    shift = torch.where(finite, local_max, torch.zeros_like(local_max))
    x.sub_(shift.unsqueeze(-1))
    picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
    smooth = x[..., :n_valid_local].sum(-1) if smoothing else None
    x.exp_()  # under the MAX all-reduce
    sum_exp = x.sum(-1)
    comm.wait(work, group)
    delta = shift - global_max  # <= 0 where finite
    rescale = torch.where(finite, torch.exp(delta), torch.zeros_like(delta))
    stats = [torch.where(owned, picked + delta, torch.zeros_like(picked)), sum_exp * rescale]
    if smoothing:
        stats.append(smooth + n_valid_local * delta)
    return stats, rescale


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing, vocab_size, hide_max):
        v_local = logits.shape[-1]
        start = group.rank * v_local
        # fp64 stays fp64; half precisions and fp32 compute in fp32.
        compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
        x = logits.to(compute, copy=True)  # (..., V_local), becomes exp() then softmax in place
        n_valid_local = min(max(vocab_size - start, 0), v_local)  # columns below the true vocab size
        if n_valid_local < v_local:
            x[..., n_valid_local:] = float("-inf")  # padding never wins and gets zero gradient

        ignored = target == ignore_index
        local_t = target - start
        owned = (local_t >= 0) & (local_t < v_local) & ~ignored
        local_t = local_t.masked_fill(~owned, 0)
        rescale = None
        if hide_max and group.size > 1:
            stats, rescale = _hidden_max_stats(x, group, owned=owned, local_t=local_t,
                                               n_valid_local=n_valid_local, smoothing=label_smoothing > 0)
        else:
            global_max = x.max(dim=-1).values  # (...)
            comm.all_reduce(global_max, group, op="max")
            x.sub_(global_max.unsqueeze(-1))
            picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
            stats = [torch.where(owned, picked, torch.zeros_like(picked))]
            if label_smoothing > 0:
                stats.append(x[..., :n_valid_local].sum(-1))
            x.exp_()
            stats.insert(1, x.sum(-1))
        stats = torch.stack(stats)  # (2 or 3, ...): one all-reduce for all of them
        comm.all_reduce(stats, group)
        target_logit, sum_exp = stats[0], stats[1]
        log_z = torch.log(sum_exp)
        loss = log_z - target_logit
        if label_smoothing > 0:
            # -(1/C) sum_c log p_c = log Z - mean_c logit_c, over the C true classes only.
            smooth = log_z - stats[2] / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        loss = loss.masked_fill(ignored, 0.0)

        if rescale is None:
            x.div_(sum_exp.unsqueeze(-1))  # softmax shard
        else:
            x.mul_((rescale / sum_exp).unsqueeze(-1))  # exp(x - m_r) exp(m_r - M) / Z
        ctx.save_for_backward(x, local_t, owned, ignored)
        ctx.label_smoothing = label_smoothing
        ctx.n_valid_local = n_valid_local
        ctx.vocab_size = vocab_size
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, owned, ignored = ctx.saved_tensors
        grad = softmax  # reused in place: this Function's graph cannot be run backward twice
        eps = ctx.label_smoothing
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(1.0 - eps) * owned.to(grad.dtype).unsqueeze(-1))
        if eps > 0:
            grad[..., :ctx.n_valid_local] -= eps / ctx.vocab_size
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, *, tp_group: Group,
                                 ignore_index: int = -100, label_smoothing: float = 0.0,
                                 vocab_size: int | None = None, hide_max: bool = False) -> torch.Tensor:
    """Per-token cross-entropy, unreduced, shape ``target.shape``: float64 for float64 logits, else float32.

    ``logits_shard``: ``(..., V/tp)``, this rank's vocab shard (any float dtype; computed in fp32,
    or in fp64 for fp64 logits). ``tp_group``: a :class:`parallel.comm.Group` or a torch ProcessGroup.
    ``target``: ``(...)`` int64 global vocab ids, or ``ignore_index`` (loss and gradient 0 there).
    ``vocab_size``: the true vocabulary when the logits are padded (entries at or above it are
    excluded from the softmax and the smoothing average); default the full ``V``.
    Matches ``torch.nn.functional.cross_entropy(reduction="none")`` including label smoothing.
    Communicates over ``tp_group`` only: one MAX all-reduce of ``target.numel()`` values (fp32, or
    fp64) and one SUM all-reduce of 2x (3x with label smoothing) that many, stacked.
    ``hide_max``: the MAX all-reduce runs asynchronously under the exp pass (module docstring); same
    calls and bytes, fp32 rounding differences only.
    """
    tp_group = comm.as_group(tp_group, axis="tp")
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(f"logits shape {tuple(logits_shard.shape)} and target shape {tuple(target.shape)} "
                         "disagree: logits must be target.shape + (vocab_local,)")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    padded = logits_shard.shape[-1] * tp_group.size
    vocab_size = padded if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {padded}] (logits cover {padded} entries)")
    check_ids(target, vocab_size, what="target", ignore_index=ignore_index)
    return _VocabParallelCrossEntropy.apply(logits_shard, target, tp_group, ignore_index, float(label_smoothing),
                                            vocab_size, bool(hide_max))


class TPReduce:
    """The in-place TP-group collectives that engine/ops' fused linear + cross-entropy needs (its
    ``tp_reduce`` argument), through parallel/comm so the ledger records them. The fused op calls
    each once per forward: a MAX all-reduce of the per-token max (T fp32) and a SUM all-reduce of
    the packed per-token statistics (3T + 1 fp32)."""

    def __init__(self, group: Group):
        self.group = group

    def all_reduce_max(self, t: torch.Tensor) -> None:
        comm.all_reduce(t, self.group, op="max")

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        comm.all_reduce(t, self.group)
