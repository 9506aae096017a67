"""How the model's layers are split over the virtual pipeline stages: the one rule for training,
conversion and evaluation (so a checkpoint converted at pp=n holds exactly what a pp=n run builds)."""
from __future__ import annotations

from typing import Sequence


def split_layers(num_layers: int, num_stages: int, layout: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Global layer range ``(start, end)`` of each virtual stage (``num_stages = pp * vp``).

    ``layout`` (``parallel.pipeline_layout``) gives one layer count per virtual stage. Without it the
    layers split evenly and, when ``num_layers`` does not divide, the first ``num_layers % num_stages``
    stages take one layer more. Every stage needs at least one layer unless a layout says otherwise.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"the pipeline has {num_stages!r} virtual stages; pp * vp must be an integer >= 1")
    if layout:
        counts = [int(n) for n in layout]
        if len(counts) != num_stages:
            raise ValueError(f"parallel.pipeline_layout={counts} has {len(counts)} entries but the pipeline has "
                             f"pp*vp = {num_stages} virtual stages; give one layer count per stage")
        if sum(counts) != num_layers or min(counts) < 0:
            raise ValueError(f"parallel.pipeline_layout={counts} must be non-negative layer counts summing to "
                             f"num_layers={num_layers}")
    else:
        if num_stages > num_layers:
            raise ValueError(f"pp*vp = {num_stages} (virtual stages) exceeds num_layers={num_layers}: every stage "
                             "needs a layer; lower pp or vp, or give the layers per stage (parallel.pipeline_layout; "
                             "--pipeline-layout in the tools)")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out
