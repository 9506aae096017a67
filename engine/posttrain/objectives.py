"""Post-training objectives: what the pipeline's last stage makes of a micro-batch's token losses.

The trainer loop is pretraining's (engine/trainer.py); only the step's loss changes. An objective has

* ``loss(token_loss, batch) -> (total, stats)``: ``token_loss`` is the stage's per-token loss ``(b, s)``
  (``-log p(label)``, already multiplied by ``loss_mask``); ``total`` is the loss summed over the
  micro-batch's ``units`` (the trainer divides by the global batch's units, summed over micro-batches
  and data-parallel ranks); ``stats`` are sums the trainer adds up over the step;
* ``STATS``: the names of those sums (every rank reduces the same vector, one all-reduce over pp and
  one over dp per step);
* ``metrics(sums) -> dict``: the step's logged values.

SFT needs none: its samples carry ``units`` = their loss tokens, which is the pretraining loss.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.posttrain.dpo import dpo_loss, sequence_logps
from engine.posttrain.datasets import PreferenceDataset, collate_pairs
from parallel import comm


class DPOObjective:
    """DPO / IPO on preference micro-batches (:func:`engine.posttrain.datasets.collate_pairs`: ``n``
    chosen rows then ``n`` rejected rows, ``ref_logp`` (n, 2) the reference's sequence log-probs)."""

    STATS = ("pairs", "loss", "chosen_rewards", "rejected_rewards", "margins", "correct")

    def __init__(self, *, beta: float, label_smoothing: float = 0.0, loss_type: str = "sigmoid"):
        self.beta, self.label_smoothing, self.loss_type = beta, label_smoothing, loss_type
        self.average = loss_type == "ipo"  # IPO's length-averaged log-probabilities

    def sequence_logps(self, token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """(2n,) sequence log-probabilities of the rows (sum, or mean for IPO, over the completion)."""
        return sequence_logps(-token_loss, loss_mask, average=self.average)

    def loss(self, token_loss: torch.Tensor, batch: dict) -> tuple[torch.Tensor, dict]:
        if "ref_logp" not in batch:
            raise ValueError("a DPO micro-batch has no 'ref_logp': compute the reference log-probabilities "
                             "first (engine.posttrain.objectives.attach_reference_logps)")
        logp = self.sequence_logps(token_loss, batch["loss_mask"])  # (2n,)
        n = logp.shape[0] // 2
        ref = batch["ref_logp"].to(logp.dtype)  # (n, 2): chosen, rejected
        out = dpo_loss(logp[:n], logp[n:], ref[:, 0], ref[:, 1], beta=self.beta,
                       label_smoothing=self.label_smoothing, loss_type=self.loss_type)
        stats = {"pairs": torch.tensor(float(n)), "loss": out.losses.detach().sum(),
                 "chosen_rewards": out.chosen_rewards.sum(), "rejected_rewards": out.rejected_rewards.sum(),
                 "margins": out.margins.sum(), "correct": out.correct.sum()}
        return out.loss_sum, stats

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["pairs"], 1.0)
        return {"rewards_chosen": sums["chosen_rewards"] / n, "rewards_rejected": sums["rejected_rewards"] / n,
                "rewards_margin": sums["margins"] / n, "rewards_accuracy": sums["correct"] / n}


def attach_reference_logps(trainer, dataset: PreferenceDataset, objective: DPOObjective, *,
                           micro_batch_size: int) -> np.ndarray:
    """The frozen reference's (chosen, rejected) sequence log-probabilities of every pair, computed once
    with the current (initial) weights and stored on ``dataset`` (``dataset.ref_logps``, (pairs, 2)
    float64), so every sample carries its own ``ref_logp``. Each data-parallel rank scores a share of
    the pairs through the forward-only pipeline; one SUM all-reduce over pp and one over dp gather them.
    Collective over the world."""
    mesh = trainer.mesh
    n = dataset.num_records
    dp, dp_rank, m = mesh.dp_cp.size, mesh.dp_cp.rank, trainer.num_micro
    per_rank = m * micro_batch_size
    out = torch.zeros(n, 2, dtype=torch.float64, device=trainer.device)
    for start in range(0, n, dp * per_rank):
        mine = [start + dp_rank * per_rank + j for j in range(per_rank)]
        real = [i < n for i in mine]
        rows = [dataset.pair_rows(i if i < n else 0) for i in mine]  # pad the last round with pair 0
        micro = [collate_pairs(rows[k * micro_batch_size:(k + 1) * micro_batch_size]) for k in range(m)]

        def on_last(token_loss, batch, mb, mine=mine, real=real):
            logp = objective.sequence_logps(token_loss, batch["loss_mask"]).to(torch.float64)  # (2n_mb,)
            half = logp.shape[0] // 2
            for j in range(half):
                k = mb * micro_batch_size + j
                if real[k]:
                    out[mine[k], 0], out[mine[k], 1] = logp[j], logp[half + j]
        trainer.forward_token_losses(micro, on_last)
    comm.all_reduce(out, mesh.pp)  # only the last stage holds values
    comm.all_reduce(out, mesh.dp_cp)  # each pair was scored by one dp rank
    dataset.ref_logps = out.cpu().numpy()
    return dataset.ref_logps
