"""NaN localisation: when a step's loss or gradient norm is non-finite, replay it with hooks and name where
the first non-finite value appeared -- the layer, the tensor and the rank.

The replay runs the same micro-batches through the same pipeline runtime, forward and backward, with the
parameters the failed step used (a skipped step changed nothing; with ``optim.nonfinite = "stop"`` the
replay runs before the error is raised). Every rank replays: the decision is global (the loss and the
gradient norm are reduced over every rank), so the replay's collectives match. On each rank:

* parameters: the first one that is already non-finite (a diverged weight), if any;
* forward: a hook on every module; the first module (in execution order, so the innermost) whose output
  holds a non-finite value, and whether its inputs were finite (then it produced it);
* backward: a hook on each of those outputs' gradients; the first module whose output gradient is
  non-finite (in backward order: nearest the loss first).

The findings of every rank are gathered (one small all-gather) and rank 0 logs one line and a
``"split": "nonfinite"`` record in metrics.jsonl. The gradients of the replay are discarded.
"""
from __future__ import annotations

import copy

import torch

from engine.checkpoint._dist import all_gather_json


def _tensors(x) -> list[torch.Tensor]:
    if torch.is_tensor(x):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _finite(t: torch.Tensor) -> bool:
    return not t.is_floating_point() or bool(torch.isfinite(t).all())


class _Probe:
    """Forward and backward hooks on every module of ``chunks``; the first non-finite finding of each."""

    def __init__(self, chunks: torch.nn.ModuleList, stages: list[int]):
        self.forward: dict | None = None
        self.backward: dict | None = None
        self.handles = []
        for name, mod in chunks.named_modules():
            if not name:
                continue
            chunk, _, local = name.partition(".")
            where = f"stage {stages[int(chunk)]} {local or '(the whole stage)'}"
            self.handles.append(mod.register_forward_hook(self._forward_hook(where)))

    def _forward_hook(self, where: str):
        def hook(mod, inputs, output):
            outs = _tensors(output)
            if self.forward is None:
                bad = [i for i, t in enumerate(outs) if not _finite(t)]
                if bad:
                    self.forward = {"module": where, "type": type(mod).__name__, "tensor": f"output {bad[0]}",
                                    "inputs_finite": all(_finite(t) for t in _tensors(inputs))}
            for i, t in enumerate(outs):
                if t.requires_grad and t.is_floating_point():
                    t.register_hook(self._backward_hook(where, type(mod).__name__, i))
        return hook

    def _backward_hook(self, where: str, kind: str, index: int):
        def hook(grad):
            if self.backward is None and not _finite(grad):
                self.backward = {"module": where, "type": kind, "tensor": f"gradient of output {index}"}
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def localise_nonfinite(trainer, micro: list[dict]) -> dict:
    """Replay this step's ``micro`` batches on ``trainer`` with hooks (collective: every rank calls it); rank 0
    logs the report. Returns ``{"step", "ranks": {rank: findings}, "line"}`` (the same on every rank)."""
    if getattr(trainer.ddp, "zero_stage", 0) == 3:  # the parameters are placeholders: check this rank's shards
        bad_param = next((pc.name for pc in trainer.optimizer.dist.pieces if not _finite(pc.model.detach())), None)
    else:
        bad_param = next((n for n, q in trainer.chunks.named_parameters() if not _finite(q.detach())), None)
    probe = _Probe(trainer.chunks, trainer.my_stages)
    trainer.optimizer.zero_grad()
    # MoE layers add every training forward's routing counts into step_load (the next step's metrics and
    # bias update): the replay's must not count
    loads = [(m, m.step_load) for m in trainer.chunks.modules() if hasattr(m, "step_load")]
    # likewise the objective's sums (DPO / GRPO metrics, Trainer._stats): the step reported its own already
    stats = dict(trainer._stats)
    # and a gradient compressor's state (PowerSGD / 1-bit: error feedback, warm-start Q, the warm-up's step
    # count, which each reduction advances): the replay's reduction must leave it as the step left it
    comp = getattr(trainer.ddp, "grad_compressor", None)
    comp_state = (copy.deepcopy(comp.state_dict()), {k: t.clone() for k, t in comp.state_tensors().items()}
                  ) if comp is not None else None
    try:
        trainer._pipeline(micro, train=True)
        trainer.ddp.finish_grad_sync()
    finally:
        probe.remove()
        trainer.optimizer.zero_grad()
        for m, load in loads:
            m.step_load = load
        trainer._stats = stats
        if comp is not None:
            comp.load_state(*comp_state)
    mine = {k: v for k, v in (("parameter", bad_param), ("forward", probe.forward), ("backward", probe.backward))
            if v is not None}
    found = {r: f for r, f in enumerate(all_gather_json(mine, trainer.mesh.world)) if f}
    step = trainer.step + 1  # the step that failed (the counter moves after it)
    parts = []
    for r, f in found.items():
        what = []
        if "parameter" in f:
            what.append(f"parameter {f['parameter']} is already non-finite")
        if "forward" in f:
            fw = f["forward"]
            what.append(f"first non-finite forward tensor: {fw['tensor']} of {fw['module']} ({fw['type']})"
                        + (", its inputs finite" if fw["inputs_finite"] else ", its inputs already non-finite"))
        if "backward" in f:
            bw = f["backward"]
            what.append(f"first non-finite backward tensor: {bw['tensor']} of {bw['module']} ({bw['type']})")
        parts.append(f"rank {r}: " + "; ".join(what))
    line = (f"tessel: non-finite step {step} replayed with hooks: " + (" | ".join(parts) if parts else
            "every rank was finite in the replay (not reproducible: a transient fault or non-determinism)"))
    trainer.logger.info(line)
    record = {"step": step, "ranks": {str(r): f for r, f in found.items()}}
    trainer.logger.log(record, prefix="nonfinite", echo=False)
    return {"step": step, "ranks": found, "line": line}
