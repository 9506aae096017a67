"""``model.cuda_graph = "layers"``: each transformer layer's forward and backward replayed as CUDA graphs.

A gpu-1b step issues ~800 aten ops in bf16 and ~1100 with FP8 linears; on the H100/H200 machines measured
(docs/fp8.md, "Measured on an H200") the host takes about as long to issue them as the GPU takes to run
them, so the FP8 step, whose kernels are 1.14x faster, is no faster end to end. Captured as graphs, a
layer's forward is one launch and its backward another.

How it runs (``torch.cuda.make_graphed_callables``, one set of graphs per distinct input signature):
* The stage's layers are captured together, in order, on the first training forward whose signature
  (the hidden state's shape, dtype and requires_grad; the rope tables' and each layer's mask's shapes)
  has no graphs yet; later forwards with that signature replay them. The embedding, the final norm, the
  loss and the optimizer stay eager, and so does everything outside training (``stage.eval()`` or
  ``torch.no_grad()``: evaluation, generation, reference log-probabilities).
* Each graphed layer is an autograd node: parameter gradients reach ``AccumulateGrad`` (and data
  parallelism's gradient hooks) eagerly, as without graphs.
* A graph replays its inputs' and outputs' static buffers: one micro-batch's forward and backward
  must finish before the next forward of the same layer, as the 1F1B schedule at ``parallel.pp = 1``
  runs them (the config schema refuses pp > 1 and every other schedule: docs/cuda_graphs.md).
* Delayed FP8 scaling picks its path (current scaling until its first update) on the host: layers
  run eagerly until every delayed state under them has been updated once, then are captured. The
  warm-up and capture passes record amaxes of their sample gradients: the pending amaxes are restored
  after the capture, so the step's scales see only the replayed passes.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from engine.ops.fp8_linear import DelayedScaling
from models.ops import RopeTables

# Distinct input signatures captured per stage before a run is refused (each set holds a micro-batch's
# activations in its own memory pool).
MAX_SIGNATURES = 4


class _Mask:
    """The one mask a graphed layer was given (its window's), in the ``AttentionMasks.get`` interface."""

    def __init__(self, mask: torch.Tensor | None):
        self.mask = mask

    def get(self, window):
        return self.mask


class _LayerCall(nn.Module):
    """``layer`` with positional tensor arguments only (what ``make_graphed_callables`` takes):
    ``(x, [cos, sin], [mask])``."""

    def __init__(self, layer: nn.Module, *, rope: bool, mask: bool):
        super().__init__()
        self.layer = layer
        self.rope, self.mask = rope, mask

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        rope = RopeTables.from_tables(rest[0], rest[1]) if self.rope else None
        mask = rest[-1] if self.mask else None
        return self.layer(x, rope=rope, masks=_Mask(mask))


def _on_cuda(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def check_graphable(stage: nn.Module) -> None:
    """ValueError naming what keeps ``stage``'s layers from being captured (the config schema checks the
    run-level conditions; these are the model's)."""
    if getattr(stage, "cp", None) is not None:
        raise ValueError("model.cuda_graph='layers' with context parallelism is not built (the ring's "
                         "collectives run inside each layer); set parallel.cp=1 or model.cuda_graph='none'")
    for layer in stage.layers.values():
        n = layer.layer_number
        if layer.hidden_dropout > 0 or layer.attention.dropout_p > 0:
            raise ValueError(f"model.cuda_graph='layers': layer {n} has dropout (hidden {layer.hidden_dropout}, "
                             f"attention {layer.attention.dropout_p}), which forks the tensor-parallel RNG tracker: "
                             "it saves and restores the generator state on the host, which a replayed graph skips; "
                             "set the model's dropout to 0 or model.cuda_graph='none'")
        if layer.recompute or layer.attention.recompute_core_attention:
            raise ValueError(f"model.cuda_graph='layers': layer {n} recomputes activations in backward; set "
                             "train.activation_checkpointing='none' or model.cuda_graph='none'")
        if any(hasattr(m, "step_load") for m in layer.modules()):
            raise ValueError(f"model.cuda_graph='layers': layer {n} is a mixture-of-experts layer, whose routed "
                             "token counts (and so its shapes) change every micro-batch; set "
                             "model.cuda_graph='none'")
    device = next(stage.parameters()).device
    if not _on_cuda(device):
        raise ValueError(f"model.cuda_graph='layers' needs the model on a CUDA device (CUDA graphs); this run's "
                         f"model is on {device}: set model.cuda_graph='none'")


class LayerGraphs:
    """The CUDA graphs of one :class:`models.transformer.TransformerStage`'s layers (module docstring)."""

    def __init__(self, stage: nn.Module, *, warmup: int = 3):
        check_graphable(stage)
        self.stage = stage
        self.layers = list(stage.layers.values())
        self.warmup = warmup
        self.sets: dict[tuple, list[nn.Module]] = {}
        self.delayed = [m for layer in self.layers for m in layer.modules() if isinstance(m, DelayedScaling)]
        self.eager_calls = 0  # training forwards run eagerly here (delayed scaling not yet started)
        self.replays = 0  # training forwards replayed from graphs
        self._suspended = False
        self._started = not self.delayed

    def active(self) -> bool:
        """Whether this forward runs through the graphs: training, with gradients, not suspended."""
        return self.stage.training and torch.is_grad_enabled() and not self._suspended

    @contextlib.contextmanager
    def suspended(self):
        """Run the layers eagerly inside (e.g. a replay with module hooks: engine/nan_locate.py)."""
        before, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = before

    def run(self, x: torch.Tensor, *, rope: RopeTables | None, masks) -> torch.Tensor:
        """The layers over ``x`` (s, b, h): replayed, captured first if this signature is new."""
        if not self._started:  # delayed scaling still on current scales: eager
            self._started = all(s.started for s in self.delayed)  # (once updated, a state stays started)
        if not self._started:
            self.eager_calls += 1
            for layer in self.layers:
                x = layer(x, rope=rope, masks=masks)
            return x
        layer_masks = [masks.get(layer.attention.window) for layer in self.layers]  # each (b|1, 1, s, s) or None
        tables = () if rope is None else (rope.cos, rope.sin)
        key = (tuple(x.shape), x.dtype, x.requires_grad, tuple(tuple(t.shape) for t in tables),
               tuple(None if m is None else (tuple(m.shape), m.dtype) for m in layer_masks))
        calls = self.sets.get(key)
        if calls is None:
            calls = self.sets[key] = self._capture(key, x, tables, layer_masks)
        self.replays += 1
        for call, mask in zip(calls, layer_masks):
            x = call(x, *tables, *(() if mask is None else (mask,)))
        return x

    def _capture(self, key: tuple, x: torch.Tensor, tables: tuple, layer_masks: list) -> list[nn.Module]:
        if len(self.sets) >= MAX_SIGNATURES:
            raise RuntimeError(
                f"model.cuda_graph='layers': this stage's layers were already captured for {len(self.sets)} input "
                f"signatures (shapes, masks), the most kept; this micro-batch's is another: {key}. Give every "
                "micro-batch the same shape (train.seq_length, train.micro_batch_size) or set model.cuda_graph='none'")
        calls = [_LayerCall(layer, rope=bool(tables), mask=m is not None) for layer, m in zip(self.layers, layer_masks)]
        samples = []
        for i, m in enumerate(layer_masks):
            h = x.detach().clone().requires_grad_(x.requires_grad if i == 0 else True)  # (s, b, h), a real value
            samples.append((h, *tables, *(() if m is None else (m,))))
        pending = [(s, s.pending.clone()) for s in self.delayed]  # warm-up and capture record sample amaxes
        try:
            graphed = torch.cuda.make_graphed_callables(tuple(calls), tuple(samples), num_warmup_iters=self.warmup)
        except Exception as e:  # e.g. an op that syncs with the host while capturing
            raise RuntimeError(f"model.cuda_graph='layers': capturing the layers failed ({type(e).__name__}: {e}); "
                               "an op in them cannot run inside a CUDA graph. Set model.cuda_graph='none'") from e
        finally:
            for s, saved in pending:
                s.pending.copy_(saved)
        return list(graphed)
