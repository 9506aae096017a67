"""The ``[outer]`` section: DiLoCo / Streaming DiLoCo outer optimisation over the data-parallel replicas
(parallel/data_parallel/outer.py, docs/decentralised.md). ``method = "none"`` (the default) is plain data
parallelism and every other key of the section must keep its default: a key either works or is refused.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config._fields import Section
from engine.config.sections import check_choice, check_min, check_positive
from parallel.data_parallel.outer import FRAGMENT_LAYOUTS, OUTER_COMPRESSIONS, OUTER_METHODS, overlap_at_h_message


@dataclass(kw_only=True, frozen=True)
class OuterConfig(Section):
    """``method``: none | diloco | streaming_diloco. Every replica runs ``inner_steps`` (H) local AdamW
    steps (no dp traffic), then the averaged pseudo-gradient takes an outer SGD step of ``lr`` with
    ``momentum`` (Nesterov when ``nesterov``). Streaming DiLoCo syncs ``fragments`` parameter groups at
    staggered steps, each reduction overlapping the next ``overlap_steps`` inner steps (tau, 1 to H, below H
    with ``mix = 1``; the run's final step, ``train.steps``, applies what is still in flight: an earlier stop on
    ``train.max_tokens`` keeps it in flight in the checkpoint), mixing the arriving weights in with
    weight ``mix`` (1: replace the local ones); ``fragment_layout``: ``strided`` (block l in fragment l % F,
    the paper's pattern) or ``contiguous`` (F ranges of whole parameters of about equal size).
    ``compression`` of the pseudo-gradient: none | bf16 | int8 | topk (``topk_fraction`` of the entries,
    with error feedback). ``start_step`` = N: steps 1..N are plain data parallelism (the gradient all-reduce
    every step, as ``optim.powersgd_start_step`` for PowerSGD), the outer loop starts from step N's weights.
    ``momentum_start_step`` = M: the syncs applied at steps <= M take the replicas' plain average (outer lr 1,
    no momentum); from step M + 1 on, ``lr`` and ``momentum`` (from a zero momentum buffer). From scratch
    the outer momentum overshoots while the loss falls fast (docs/decentralised.md, Quality); 0: from the start."""

    SECTION = "outer"

    method: str = "none"
    inner_steps: int = 10
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 1
    mix: float = 1.0
    fragment_layout: str = "strided"
    compression: str = "none"
    topk_fraction: float = 0.01
    start_step: int = 0
    momentum_start_step: int = 0
    overlap_steps: int = 1

    def _validate(self) -> None:
        check_choice(self, "method", OUTER_METHODS)
        check_choice(self, "compression", OUTER_COMPRESSIONS)
        check_choice(self, "fragment_layout", FRAGMENT_LAYOUTS)
        if self.method == "none":
            changed = [k for k in self.changed() if k != "method"]
            if changed:
                raise ValueError(f"outer.{changed[0]} is set but outer.method='none' (plain data parallelism) does "
                                 "not read it; set outer.method='diloco' or 'streaming_diloco', or remove "
                                 + ", ".join(f"outer.{k}" for k in changed))
            return
        if isinstance(self.inner_steps, bool) or self.inner_steps < 1:
            raise ValueError(f"outer.inner_steps={self.inner_steps} must be >= 1 (H, the inner steps between "
                             "synchronisations; 1 syncs every step)")
        if isinstance(self.start_step, bool) or not isinstance(self.start_step, int) or self.start_step < 0:
            raise ValueError(f"outer.start_step={self.start_step} must be an integer >= 0: the plain data-parallel "
                             "steps before the outer loop starts (0 starts it at once)")
        m = self.momentum_start_step
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"outer.momentum_start_step={m} must be an integer >= 0: the last step whose syncs take "
                             "the plain average before outer.lr and outer.momentum apply (0: from the start)")
        if m and m <= self.start_step:
            raise ValueError(f"outer.momentum_start_step={m} is not after outer.start_step={self.start_step}: no sync "
                             "happens before the outer loop starts, so it changes nothing; set it above "
                             "outer.start_step or to 0")
        if m and self.lr == 1.0 and self.momentum == 0.0:
            raise ValueError(f"outer.momentum_start_step={m} with outer.lr=1 and outer.momentum=0: every sync already "
                             "takes the plain average, so it changes nothing; remove it or set outer.momentum "
                             "(DiLoCo: 0.9) or outer.lr")
        check_positive(self, "lr")
        check_min(self, "momentum", 0.0)
        if self.momentum >= 1.0:
            raise ValueError(f"outer.momentum={self.momentum} must be in [0, 1); DiLoCo uses 0.9")
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("outer.nesterov=true needs outer.momentum > 0; set outer.nesterov=false for plain "
                             "outer SGD")
        if self.fragments < 1:
            raise ValueError(f"outer.fragments={self.fragments} must be >= 1")
        if self.method == "diloco" and self.fragments != 1:
            raise ValueError(f"outer.fragments={self.fragments} splits the sync of outer.method='streaming_diloco'; "
                             "set outer.method='streaming_diloco' or outer.fragments=1")
        if self.fragments > self.inner_steps:
            raise ValueError(f"outer.fragments={self.fragments} exceeds outer.inner_steps={self.inner_steps}: each "
                             "fragment syncs at its own step of the H-step cycle; raise inner_steps or lower fragments")
        if self.changed("fragment_layout") and self.fragments == 1:
            raise ValueError(f"outer.fragment_layout={self.fragment_layout!r} is read only with several fragments "
                             "(outer.method='streaming_diloco', outer.fragments > 1); remove it or raise "
                             "outer.fragments")
        tau = self.overlap_steps
        if self.method == "diloco" and tau != 1:
            raise ValueError(f"outer.overlap_steps={tau} is read by outer.method='streaming_diloco' (DiLoCo applies "
                             "each sync at once); set outer.method='streaming_diloco' (outer.fragments=1 overlaps one "
                             "whole sync) or remove outer.overlap_steps")
        if isinstance(tau, bool) or not isinstance(tau, int) or not 1 <= tau <= self.inner_steps:
            raise ValueError(f"outer.overlap_steps={tau} must be an integer in [1, outer.inner_steps="
                             f"{self.inner_steps}]: the inner steps a fragment's reduction overlaps before it is "
                             "applied, which must happen before the fragment sends again; lower outer.overlap_steps "
                             "or raise outer.inner_steps")
        if self.method == "streaming_diloco" and tau == self.inner_steps and self.mix == 1.0:
            raise ValueError(overlap_at_h_message(tau, self.inner_steps))
        if not 0.0 < self.mix <= 1.0:
            raise ValueError(f"outer.mix={self.mix} must be in (0, 1]: the weight of the arriving outer weights "
                             "(1 replaces the local ones; Streaming DiLoCo uses 0.5)")
        if not 0.0 < self.topk_fraction <= 1.0:
            raise ValueError(f"outer.topk_fraction={self.topk_fraction} must be in (0, 1], e.g. 0.01")
        if self.compression != "topk" and self.topk_fraction != 0.01:
            raise ValueError(f"outer.topk_fraction is read only with outer.compression='topk' (it is "
                             f"{self.compression!r}); remove outer.topk_fraction or set outer.compression='topk'")
