"""Per-step mixture-of-experts metrics for metrics.jsonl: expert load, aux loss and dropped tokens per layer.

Each :class:`parallel.expert_parallel.MoELayer` adds its training forwards into ``step_load`` (tokens per
expert, its aux loss, dropped and routed (token, choice) pairs, forwards). Once per step
:meth:`MoEMetrics.step` packs every local layer into one (layers, E + 4) fp64 table, sums it over pp (each
stage fills its own layers' rows) and over dp x cp (every replica's tokens; the ep ranks of a block route
different tokens), and reports per MoE layer ``i``:

* ``moe.{i}.load_min`` / ``load_max``: the fewest and most (token, choice) pairs an expert received over
  the global batch, as a multiple of the mean (1.0 = perfectly balanced);
* ``moe.{i}.load_cv``: coefficient of variation of the pairs per expert (std / mean);
* ``moe.{i}.aux_loss``: the layer's load-balancing loss, mean over its micro-batches and replicas;
* ``moe.{i}.dropped``: the share of pairs dropped by the capacity factor (0 when dropless);

and ``moe.load_cv_max`` (the worst layer). TP ranks route the same tokens, so nothing is summed over tp (at
``expert_tp`` = 1 each routes its own chunk, and the layer's ``step_load`` already holds the tp group's sums).
The same global counts drive aux-loss-free balancing: a router with ``bias_update_rate`` takes one
:meth:`TopKRouter.update_bias` step from them, identically on every replica.
A recomputed forward (activation checkpointing) counts twice, uniformly, so every ratio above is exact.
"""
from __future__ import annotations

import re

import torch

from parallel import comm
from parallel.comm import Group

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class MoEMetrics:
    """The MoE layers of ``chunks`` and the groups that complete their counts. Build with :meth:`maybe`."""

    def __init__(self, layers: dict[int, torch.nn.Module], *, num_layers: int, num_experts: int,
                 pp_group: Group, dp_group: Group, device):
        self.layers, self.num_layers, self.num_experts = layers, num_layers, num_experts
        self.pp_group, self.dp_group, self.device = pp_group, dp_group, device

    @classmethod
    def maybe(cls, chunks: torch.nn.Module, *, pp_group: Group, dp_group: Group, device) -> "MoEMetrics | None":
        """None when no stage of the model has an MoE layer (decided together over pp: one all-reduce of
        two integers, so every rank agrees)."""
        from parallel.expert_parallel.layer import MoELayer

        layers = {}
        for name, m in chunks.named_modules():
            if isinstance(m, MoELayer):
                found = _LAYER.search(m.layer_name + ".") or _LAYER.search(name + ".")
                assert found is not None, f"MoE layer {name!r} has no global layer index in its name"
                layers[int(found.group(1))] = m
        assert len({m.num_experts for m in layers.values()}) <= 1, "MoE layers with different expert counts"
        size = torch.tensor([max(layers, default=-1) + 1, max((m.num_experts for m in layers.values()), default=0)],
                            dtype=torch.int64, device=device)  # (2,)
        comm.all_reduce(size, pp_group, op="max")
        n, e = (int(v) for v in size.tolist())
        if n == 0:
            return None
        return cls(layers, num_layers=n, num_experts=e, pp_group=pp_group, dp_group=dp_group, device=device)

    def step(self, *, applied: bool = True) -> dict[str, float]:
        """Reduce and reset the layers' ``step_load``, step the routers' balancing biases (unless the optimizer
        skipped the step, ``applied=False``: the weights did not move, so neither do the biases); the metrics
        above (collective over pp and dp; call once per optimizer step)."""
        e = self.num_experts
        table = torch.zeros(self.num_layers, e + 4, dtype=torch.float64, device=self.device)  # (L, E + 4)
        for i, layer in self.layers.items():
            if layer.step_load is not None:
                table[i] = layer.step_load  # (E + 4,): every MoE layer of a model has E experts
            layer.step_load = None
        comm.all_reduce(table, self.pp_group)  # each stage fills its own layers' rows
        comm.all_reduce(table, self.dp_group)  # every replica's (and ep rank's) tokens
        out: dict[str, float] = {}
        worst = 0.0
        for i in range(self.num_layers):
            row = table[i]
            forwards = row[e + 3].item()
            if forwards == 0:
                continue  # a dense layer
            counts = row[:e]  # (E,)
            if applied and i in self.layers and self.layers[i].router.expert_bias is not None:
                self.layers[i].router.update_bias(counts)
            mean = counts.mean()
            cv = (counts.std(unbiased=False) / mean).item() if mean > 0 else 0.0
            out[f"moe.{i}.load_min"] = (counts.min() / mean).item() if mean > 0 else 0.0
            out[f"moe.{i}.load_max"] = (counts.max() / mean).item() if mean > 0 else 0.0
            out[f"moe.{i}.load_cv"] = cv
            out[f"moe.{i}.aux_loss"] = row[e].item() / forwards
            out[f"moe.{i}.dropped"] = row[e + 1].item() / max(row[e + 2].item(), 1.0)
            worst = max(worst, cv)
        out["moe.load_cv_max"] = worst
        return out


__all__ = ["MoEMetrics"]
