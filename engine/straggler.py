"""Straggler detection (``fault.straggler_ratio``): which rank slows the job down, named every log interval.

In synchronous training every rank's step takes as long as the slowest one's: the fast ranks wait in the
next collective. Step time alone cannot tell them apart; compute time can -- the step's wall time minus
the seconds this rank spent blocked in communication (the ledger's ``blocked_s``, parallel/comm.py). A
slow rank (a throttled GPU, a noisy neighbour, a slow data loader) computes longer and waits less.

:class:`StragglerMonitor` accumulates each rank's step and compute seconds between log steps; at a log
step every rank calls :meth:`StragglerMonitor.gather` (one all-gather of 2 float64 per rank over the world)
and gets back the per-rank means and the ranks whose mean compute time exceeds the median's by the ratio.
Pipeline stages differ in work (the first embeds, the last computes the loss), so a rank is compared with
the ranks of its own stage (the same ``pp`` coordinate); a stage of one rank (dp = tp = cp = ep = 1) has no
peer to be compared with and is never named.
"""
from __future__ import annotations

import statistics

import torch

from parallel import comm


def find_stragglers(compute_s: list[float], *, ratio: float, stage: list[int] | None = None) -> list[int]:
    """The ranks whose ``compute_s`` exceeds ``ratio`` times the median of their stage's ranks (``stage[r]``:
    rank r's pipeline stage; None: one stage). An even count's median is the mean of the two middle values;
    a stage of one rank is never named."""
    stage = stage or [0] * len(compute_s)
    medians = {s: statistics.median([t for t, s2 in zip(compute_s, stage) if s2 == s]) for s in set(stage)}
    alone = {s for s in medians if stage.count(s) < 2}
    return [r for r, t in enumerate(compute_s) if stage[r] not in alone and t > ratio * medians[stage[r]]]


class StragglerMonitor:
    """Per-rank step and compute times since the last :meth:`gather`. ``group``: the world group."""

    def __init__(self, *, ratio: float, group: comm.Group, pp_rank: int = 0, device=None):
        if not ratio > 1:
            raise ValueError(f"straggler ratio {ratio} must be > 1 (fault.straggler_ratio)")
        self.ratio = ratio
        self.group = group
        self.device = device
        self.pp_rank = pp_rank
        self._step_s = 0.0
        self._compute_s = 0.0
        self._steps = 0

    def add(self, *, step_s: float, comm_blocked_s: float) -> None:
        self._step_s += step_s
        self._compute_s += max(0.0, step_s - comm_blocked_s)
        self._steps += 1

    def gather(self, *, step: int) -> dict:
        """Collective over the world: ``{"stragglers": [ranks], "compute_s_median" (of the world), "compute_s_max",
        "step_s_max", "straggler_compute_s": [that rank's mean compute s, ...]}`` and the line to log
        (``"line"``, None when no rank is slow). Means over the steps since the last call."""
        n = max(self._steps, 1)
        row = torch.tensor([self._step_s / n, self._compute_s / n, float(self.pp_rank)], dtype=torch.float64,
                           device=self.device)
        self._step_s = self._compute_s = 0.0
        self._steps = 0
        table = comm.all_gather(row, self.group).view(-1, 3).tolist()  # (world, [step_s, compute_s, pp_rank])
        step_s = [r[0] for r in table]
        compute_s = [r[1] for r in table]
        stage = [int(r[2]) for r in table]
        slow = find_stragglers(compute_s, ratio=self.ratio, stage=stage)
        median = statistics.median(compute_s)
        out = {"stragglers": slow, "compute_s_median": median, "compute_s_max": max(compute_s),
               "step_s_max": max(step_s), "straggler_compute_s": [compute_s[r] for r in slow], "line": None}
        if slow:
            def stage_median(r):
                return statistics.median([t for t, s in zip(compute_s, stage) if s == stage[r]])
            who = ", ".join(f"rank {r} computes {compute_s[r]:.3f} s per step, "
                            f"{compute_s[r] / max(stage_median(r), 1e-12):.1f}x the median {stage_median(r):.3f} s "
                            "of its pipeline stage's ranks" for r in slow)
            out["line"] = (f"tessel: straggler at step {step}: {who} (fault.straggler_ratio={self.ratio:g}; compute = "
                           f"step time minus time blocked in communication, mean since the last log; slowest step "
                           f"{max(step_s):.3f} s)")
        return out
