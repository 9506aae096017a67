"""Memory per rank: the formulas that predict it and the allocator that measures it (docs/memory.md).

Predicted (no communication, nothing allocated; the same functions serve the start-up report and the
tests that assert them against what torch allocates):

* :func:`layer_saved_bytes`: what one transformer layer's forward keeps for backward on one TP rank,
  for ``none`` / ``selective`` / ``full`` recompute, with and without sequence parallelism;
* :func:`stage_memory`: one micro-batch of one pipeline stage (its layers, the embedding, the final
  norm and the loss): the bytes kept until its backward, and the transients of its forward and backward;
* :func:`predict_memory`: every pipeline rank of a run: parameters, gradients and optimizer state
  from the data-parallel buffer layout and ZeRO stage, the pipeline's in-flight micro-batches by
  walking the schedule's action lists (its placement: loop, or the V of zbv/dualpipev; split backward's
  weight-gradient queues held from ``B`` to ``W``, :func:`wgrad_queue_bytes`), context parallelism's
  per-shard activations and attention buffers (:func:`cp_attention_transients`), and the transients of
  the step (gradient reduction over dp x cp, parameter all-gather, optimizer); with expert parallelism
  (ep > 1) 1/ep of each MoE layer's experts in a buffer of their own (:func:`stage_param_sizes`), and an
  MoE layer's activations (its top-k experts' rows, the routed rows, the router: ``LayerShape.moe_extra``).

Measured: :class:`PeakMemory` (a block's peak above its entry, from the allocator) and
:func:`state_bytes` (the run's persistent tensors). On CUDA :class:`PeakMemory` reads the caching
allocator's statistics (``max_memory_allocated`` after ``reset_peak_memory_stats``). On CPU torch keeps
no such statistics, but its CPU allocator reports every allocation and free to the profiler when
``profile_memory=True``, each with the allocator's running total of live bytes; the peak is the largest
total seen. Either way ``peak`` counts bytes *above* what was live at entry and ``end`` the bytes still
allocated at exit.

Why the running total and not the sum of the events: the profiler records an event only on threads it
profiles, and gloo's worker threads often drop the last reference to a collective's tensors (the input
of a reduce-scatter, a temporary all-reduced buffer): those frees never appear as events, and a sum of
events grows by every such tensor (measured: megabytes per step at tp=2 with sequence parallelism).
The allocator's total is right whichever thread frees, provided it keeps its size table on every
thread: c10's ``FLAGS_caffe2_report_cpu_memory_usage`` (exported by libc10; no Python setter exists,
so it is set through ctypes for the duration of the block). Where the flag cannot be found the sum of
the events is used and ``PeakMemory.exact`` is False. The CPU path runs the block under
``torch.profiler`` (CPU activity only): slower than a plain run, so measure one step, not a loop. Not
re-entrant.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import glob
import os
from dataclasses import dataclass
from math import prod

import torch

from parallel.data_parallel.buffers import bucket_size_elements, plan_buckets
from parallel.pipeline import build_schedule
from parallel.pipeline.actions import FORWARD, placement_of, rank_stages
from parallel.pipeline.split import split_layers

MB = 1e6


# -- the formulas -----------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class LayerShape:
    """The facts of a transformer block the formulas need (any object with models.TransformerConfig's
    fields gives them: :meth:`of`)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    gated: bool = True  # SwiGLU (fc1 holds gate and up) or a plain GELU MLP
    norm: str = "rmsnorm"  # or "layernorm"
    rope: bool = True
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    num_experts: int = 0  # > 0: the MLP is an MoE layer (parallel/expert_parallel/layer.py)
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_ffn_hidden_size: int = 0

    @classmethod
    def of(cls, config) -> "LayerShape":
        return cls(hidden_size=config.hidden_size, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                   head_dim=config.head_dim, ffn_hidden_size=config.ffn_hidden_size, gated=config.mlp == "swiglu",
                   norm=config.norm, rope=config.position_embedding == "rope",
                   attention_dropout=config.attention_dropout, hidden_dropout=config.hidden_dropout,
                   num_experts=getattr(config, "num_experts", 0) or 0, moe_top_k=getattr(config, "moe_top_k", 0) or 0,
                   moe_ffn_hidden_size=getattr(config, "moe_ffn_hidden_size", 0) or 0,
                   shared_expert_ffn_hidden_size=getattr(config, "shared_expert_ffn_hidden_size", 0) or 0)

    @property
    def active_ffn(self) -> int:
        """The MLP width one token's activations span: dense ``ffn_hidden_size``; MoE: its top-k experts'
        plus the shared expert's (each routed row runs one expert's fc1 and fc2)."""
        if not self.num_experts:
            return self.ffn_hidden_size
        return self.moe_top_k * self.moe_ffn_hidden_size + self.shared_expert_ffn_hidden_size

    def moe_extra(self, sb: int, *, tp: int, sp: bool, expert_tp: int | None = None) -> int:
        """Elements an MoE layer keeps beyond its experts' MLP activations (0 for a dense MLP): the
        router's logits and probabilities (``E`` per token), the routed rows before and after the dispatch
        all-to-all, the expert outputs that come back (``top_k`` rows of ``h`` per token each; full on every
        TP rank: the layer routes the whole sequence) and, under sequence parallelism, the gathered input.
        ``expert_tp`` = 1 at tp > 1 (with sp): each TP rank routes its own 1/tp of the tokens; only a shared
        expert gathers the sequence."""
        if not self.num_experts:
            return 0
        h = self.hidden_size
        routed = 2 * sb * self.num_experts + 3 * sb * self.moe_top_k * h
        if expert_tp == 1 and tp > 1:
            return routed // tp + (sb * h * (tp - 1) // tp if self.shared_expert_ffn_hidden_size else 0)
        return routed + (sb * h * (tp - 1) // tp if sp else 0)

    def attention_path(self, device: str) -> str:
        """SDPA's path: "math" (CPU with attention dropout: it materialises the probabilities) or
        "flash" (keeps q, k, v, the output and the log-sum-exp: CPU without dropout, CUDA's kernels)."""
        return "math" if self.attention_dropout > 0 and device == "cpu" else "flash"


def layer_saved_bytes(shape: LayerShape, *, s: int, b: int, tp: int = 1, sp: bool = False, recompute: str = "none",
                      elem: int = 4, attention: str | None = None, expert_tp: int | None = None) -> int:
    """Bytes one layer's training forward keeps for backward on one TP rank (docs/memory.md's table):
    ``s`` the sequence (the full one; sequence parallelism divides the replicated terms by ``tp``),
    ``b`` the micro-batch, ``elem`` bytes per activation element; ``attention`` "math" or "flash"
    (default: :meth:`LayerShape.attention_path` on CPU); ``expert_tp`` of an MoE layer (None: ``tp``).
    Weights and the stage's rope tables excluded."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r} must be 'none', 'selective' or 'full'")
    attention = attention or shape.attention_path("cpu")
    if attention not in ("math", "flash"):
        raise ValueError(f"attention={attention!r} must be 'math' or 'flash'")
    r = tp if sp else 1
    h, a, d, f = shape.hidden_size, shape.num_heads, shape.head_dim, shape.active_ffn
    sb = s * b
    if recompute == "full":
        return elem * sb * h // r  # the layer input
    n, kv = a * d, shape.num_kv_heads * d
    # Replicated (sequence shards under SP): per RMSNorm its input, x * rsqrt and its output (the next
    # linear's input) and rsqrt; per LayerNorm its input and output, mean and rstd; residual dropout masks.
    if shape.norm == "rmsnorm":
        replicated = 6 * sb * h + 2 * sb
    else:
        replicated = 4 * sb * h + 4 * sb
    if shape.hidden_dropout > 0:
        replicated += 2 * sb * h
    qkv = sb * (n + 2 * kv)  # the fused qkv output: v (and without RoPE q and k) are views of it
    rope_qk = sb * (n + kv) if shape.rope else 0  # q and k after RoPE
    context = sb * n  # core attention's output, the out projection's input
    mlp = (4 if shape.gated else 2) * sb * f  # fc1 output [gate|up], silu(gate), their product / GELU in and out
    lse = 0
    if recompute == "selective":  # the checkpoint keeps its arguments q, k, v
        attn = rope_qk + qkv + context
    elif attention == "math":  # q and k copies, v (a copy when GQA expands it), probabilities, mask, dropped
        attn = 2 * sb * n + (sb * n if kv < n else qkv) + context + 3 * a * s * s * b
    else:
        attn = rope_qk + qkv + context
        lse = 4 * a * sb // tp  # fp32 log-sum-exp, whatever the activation dtype
    return elem * (replicated // r + (attn + mlp) // tp + shape.moe_extra(sb, tp=tp, sp=sp, expert_tp=expert_tp)) + lse


@dataclass(frozen=True)
class StageMemory:
    """One micro-batch of one pipeline stage on one rank: ``saved`` is kept from its forward until its
    backward; ``forward`` and ``backward`` are the transients on top (``saved`` counted) at the peak of
    each. Split backward (zb-h1, zbv, dualpipev): ``wgrad`` is what the weight-gradient queue keeps from
    ``B`` to ``W`` (each deferred linear's input and output gradient), ``wgrad_step`` the transient of
    ``W`` (the weight gradients it computes, all alive until they are accumulated)."""

    saved: int
    forward: int
    backward: int
    wgrad: int = 0
    wgrad_step: int = 0


def cp_attention_transients(shape: LayerShape, *, s: int, b: int, tp: int = 1, cp: int = 1, comm: str = "ring",
                            a2a_size: int | None = None, elem: int = 4, blocks: str = "flash") -> tuple[int, int]:
    """``(forward, backward)`` bytes one context-parallel attention holds on top of the saved activations, on
    one rank (``s`` its local tokens, ``s_full / cp``), from parallel/context_parallel (docs/memory.md):

    * ring: the packed K/V block in hand and the one arriving (forward and backward), the dK/dV accumulator
      in hand and the one arriving (backward), a q-sized copy and output (forward; dq in backward), and the
      block kernel's own buffers. ``blocks="explicit"`` (a sliding window cuts blocks, or no flash kernel
      runs the dtype): one block's score-sized temporaries, ``(b, heads, L, L)`` with ``L = s_full / (2 cp)``
      the chunk: 3 in forward (scores, shifted scores, probabilities), 5 in backward (with dP, dP - delta,
      dS). ``blocks="flash"``: no score-sized buffer; the block's rows copied into the kernel's layout, its
      output and the merge's temporaries (one more q-sized term in forward, two in backward), its k/v slices
      made contiguous (half a kv term in forward; with the dK/dV slices, two more in backward); a hop's
      full blocks may run as one call over both local query chunks (ring._hop_plan: on the ranks whose
      hop pairs both query chunks with one kv chunk), so the call's q rows and output in forward, and its
      q, dout, out copies, dq and the kernel's own row buffers in backward, span all the local rows: one
      more q-sized term in forward and 3.5 in backward on those ranks (the formula is the worst rank's;
      measured on the allocator, below);
    * a2a: q, k and v packed for the all-to-all, received, and put back in natural order (3 copies);
    * hybrid: the all-to-all's received q, k, v, then the ring over the ``cp / a2a_size`` groups with
      ``1 / a2a_size`` of the heads.
    Score temporaries and the dK/dV accumulators are in the compute dtype (fp32 for bf16). Counts read off
    the code and checked against the allocator (explicit: one shape; flash: four, docs/memory.md)."""
    if blocks not in ("flash", "explicit"):
        raise ValueError(f"blocks={blocks!r} must be 'flash' or 'explicit'")
    if cp <= 1:
        return 0, 0
    cdt = max(elem, 4)
    heads, kv = shape.num_heads // tp, shape.num_kv_heads // tp
    d = shape.head_dim
    qkv = s * b * (heads + 2 * kv) * d * elem  # the local q, k and v

    def ring(tokens, h, g, chunk):
        kvu, qu, blk = tokens * b * g * d, tokens * b * h * d, b * h * chunk * chunk
        if blocks == "flash":
            return (4 * kvu * elem + kvu * cdt // 2 + 4 * qu * cdt, 10 * kvu * cdt + 15 * qu * cdt // 2)
        return (3 * blk * cdt + 4 * kvu * elem + 2 * qu * cdt,
                5 * blk * cdt + 8 * kvu * cdt + 2 * qu * cdt)
    chunk = s // 2  # s_full / (2 cp)
    if comm == "a2a":
        return 3 * qkv, 3 * qkv
    if comm == "hybrid":
        a = a2a_size or 1
        f, bw = ring(s * a, heads // a, kv // a, chunk)
        return qkv + f, qkv + bw
    return ring(s, heads, kv, chunk)


def wgrad_queue_bytes(shape: LayerShape, *, s: int, b: int, layers: int, tp: int = 1, sp: bool = False,
                      post_process: bool = False, vocab_local: int = 0, elem: int = 4,
                      fused_ce: bool = False) -> tuple[int, int]:
    """``(queued, w_step)`` bytes of one micro-batch of a stage under split backward
    (parallel/tensor_parallel/wgrad.py): ``queued`` is what ``B`` leaves for ``W`` — per deferred linear
    its input (``qkv`` and ``fc1``: the norm's output, all-gathered again in ``B`` under SP; ``out``: the
    context; ``fc2``: the gated product) and its output gradient (column linears: their ``1/tp`` slice;
    ``out`` and ``fc2``: the full ``(s, b, h)``, all-gathered under SP) — and on the last stage the output
    layer's (the final norm's output and the logits' gradient; not deferred with fused linear + CE).
    ``w_step``: ``W`` computes every deferred weight gradient of the stage before accumulating them."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    n, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    width = (2 if shape.gated else 1) * f
    sb = s * b
    per_layer = (sb * h + sb * (n + 2 * kv) // tp  # qkv: input, output gradient
                 + sb * n // tp + sb * h  # out
                 + sb * h + sb * width // tp  # fc1
                 + sb * f // tp + sb * h)  # fc2
    weights = layers * (h * (n + 2 * kv) + n * h + h * width + f * h) // tp
    queued = layers * per_layer
    if post_process and not fused_ce:
        queued += sb * h + sb * vocab_local
        weights += vocab_local * h
    return elem * queued, elem * weights


def stage_memory(shape: LayerShape, *, s: int, b: int, layers: int, tp: int = 1, sp: bool = False,
                 recompute: str = "none", recompute_layers: int | None = None, pre_process: bool = False,
                 post_process: bool = False, vocab_local: int = 0, elem: int = 4, fused_ce: bool = False,
                 attention: str | None = None, cp: int = 1, cp_comm: str = "ring",
                 cp_a2a_size: int | None = None, cp_blocks: str = "flash", expert_tp: int | None = None) -> StageMemory:
    """:class:`StageMemory` of a stage with ``layers`` layers (the first ``recompute_layers`` of them
    fully recomputed when ``recompute='full'``; None: all). Beyond the layers: the rope tables (Hugging
    Face's expanded cos and sin, shared by the layers), the embedding's masked ids, the final norm and
    the loss (unfused: the fp32 softmax kept, the logits alive beside it while it is made; fused: one
    logits chunk). Transients: a non-last stage's output until it is sent, the received gradient, the
    gradient of the first MLP linear's output in a layer's backward, the output layer's weight gradient."""
    h, d = shape.hidden_size, shape.head_dim
    sb = s * b
    r = tp if sp else 1
    saved = 0
    if layers:
        kw = dict(s=s, b=b, tp=tp, sp=sp, elem=elem, attention=attention, expert_tp=expert_tp)
        if recompute == "full":
            recomputed = layers if recompute_layers is None else min(layers, recompute_layers)
            saved += recomputed * layer_saved_bytes(shape, recompute="full", **kw)
            saved += (layers - recomputed) * layer_saved_bytes(shape, recompute="none", **kw)
        else:
            saved += layers * layer_saved_bytes(shape, recompute=recompute, **kw)
        if shape.rope:
            saved += 2 * sb * d * elem
    if pre_process:
        saved += 8 * sb + (sb if tp > 1 else 0)  # the masked ids (int64), the out-of-shard mask (bool)
    forward = 0 if post_process else elem * sb * h // r  # the output until its send completes
    width = (2 if shape.gated else 1) * shape.active_ffn
    backward = (elem * sb * width // tp if layers else 0) + (0 if post_process else elem * sb * h // r)
    if post_process:
        norm = 3 * sb * h + sb if shape.norm == "rmsnorm" else 2 * sb * h + 2 * sb  # with the output layer's input
        saved += elem * norm // r
        if fused_ce:
            chunk = min(sb, 1 << max(0, ((1 << 26) // max(vocab_local, 1)).bit_length() - 1))
            saved += (elem * sb * h if sp else 0) + 4 * 4 * sb  # the gathered input, per-token statistics
            forward = 4 * chunk * vocab_local
            backward = max(backward, 4 * chunk * vocab_local + 4 * sb * h + elem * vocab_local * h)
        else:
            saved += 4 * sb * vocab_local + 10 * sb  # fp32 softmax, target ids (int64), two masks (bool)
            forward = elem * sb * vocab_local  # the logits, alive while their fp32 copy is made
            backward = max(backward, elem * (vocab_local * h + sb * h))  # output weight and input gradients
    if layers and cp > 1:  # context-parallel attention's buffers (``s`` is the local share): while the
        # attention runs, its layer's MLP activations are not held (forward: not made yet; backward: freed)
        att_f, att_b = cp_attention_transients(shape, s=s, b=b, tp=tp, cp=cp, comm=cp_comm, a2a_size=cp_a2a_size,
                                               elem=elem, blocks=cp_blocks)
        mlp = elem * ((4 if shape.gated else 2) * sb * shape.active_ffn // tp)
        forward, backward = max(forward, att_f - mlp), max(backward, att_b - mlp)
    queued, w_step = wgrad_queue_bytes(shape, s=s, b=b, layers=layers, tp=tp, sp=sp, post_process=post_process,
                                       vocab_local=vocab_local, elem=elem, fused_ce=fused_ce)
    return StageMemory(saved=saved, forward=forward, backward=backward, wgrad=queued, wgrad_step=w_step)


def pipeline_peak(actions, stages: dict[int, StageMemory], *, after_first_backward: int = 0,
                  split_backward: bool = False) -> tuple[int, int, int]:
    """Walk one rank's action list: ``(peak bytes above the step's start, saved activation bytes at
    that moment, micro-batches in flight then)``. ``after_first_backward``: bytes that appear with the
    rank's first backward and stay (ZeRO-2's gradient buckets). ``split_backward``: a ``B`` frees its
    micro-batch's activations but leaves its weight-gradient queue (``StageMemory.wgrad``), held until its
    ``W``; a micro-batch counts in flight (and its queue as saved bytes) from ``F`` to ``W``, as the
    simulator's ``peak_inflight`` counts it."""
    live = extra = peak = at_saved = at_count = 0
    count = 0
    for a in actions:
        m = stages[a.stage]
        if a.op == "W":
            top = live + extra + m.wgrad_step
            saved_now, count_now = live, count
            live, count = live - m.wgrad, count - 1
        elif a.op == FORWARD:
            top = live + extra + m.saved + m.forward
            saved_now, count_now = live + m.saved, count + 1
            live, count = live + m.saved, count + 1
        elif split_backward:
            extra = after_first_backward
            top = live + extra + max(m.backward, m.wgrad - m.saved)  # the queue grows as the activations go
            saved_now, count_now = live, count
            live = live - m.saved + m.wgrad
        else:
            extra = after_first_backward
            top = live + extra + m.backward
            saved_now, count_now = live, count
            live, count = live - m.saved, count - 1
        if top > peak:
            peak, at_saved, at_count = top, saved_now, count_now
    return peak, at_saved, at_count


# -- one run's prediction ---------------------------------------------------------------------------

@dataclass(frozen=True)
class RankMemory:
    """Predicted bytes on the ranks of one pipeline coordinate (tp and dp ranks alike) at the step's peak."""

    pp_rank: int
    params: int
    grads: int
    optimizer: int
    activations: int  # saved for backward, by the micro-batches in flight at the peak
    transient: int  # the rest: logits, gradients of activations, communication and update buffers
    inflight: int  # micro-batches whose activations are held at the peak
    phase: str  # where the peak falls: "pipeline" (forward/backward) or "step" (reduction, update, gather)

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.activations + self.transient


@dataclass(frozen=True)
class MemoryPrediction:
    """:func:`predict_memory`'s answer: one :class:`RankMemory` per pipeline rank."""

    ranks: tuple[RankMemory, ...]
    layout: str
    notes: tuple[str, ...] = ()  # parts of this run the formulas do not model

    @property
    def largest(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    def line(self) -> str:
        r = self.largest
        per = ", ".join(f"{x.pp_rank}: {x.total / MB:.2f}" for x in self.ranks) if len(self.ranks) > 1 else ""
        return (f"tessel: memory: predicted per rank ({self.layout}; the largest, pp rank {r.pp_rank}): parameters "
                f"{r.params / MB:.2f} MB, gradients {r.grads / MB:.2f} MB, optimizer state {r.optimizer / MB:.2f} MB, "
                f"activations {r.activations / MB:.2f} MB ({r.inflight} micro-batch{'es' if r.inflight != 1 else ''} "
                f"in flight), transients {r.transient / MB:.2f} MB = {r.total / MB:.2f} MB at the {r.phase} peak"
                + (f"; per pp rank (MB) {per}" if per else "") + (f" (not modeled: {'; '.join(self.notes)})"
                                                                  if self.notes else ""))

    def record(self) -> dict:
        """The start-up record for metrics.jsonl (bytes of the largest rank; totals per pp rank)."""
        r = self.largest
        return {"step": 0, "event": "predicted", "layout": self.layout, "pp_rank": r.pp_rank,
                "params_bytes": r.params, "grads_bytes": r.grads, "optimizer_bytes": r.optimizer,
                "activations_bytes": r.activations, "transient_bytes": r.transient, "total_bytes": r.total,
                "inflight_microbatches": r.inflight, "peak_phase": r.phase,
                "total_bytes_per_pp_rank": [x.total for x in self.ranks], "not_modeled": list(self.notes)}


def _padded_numel(sizes, *, dp: int, bucket: int | None, zero: int) -> tuple[int, int, int]:
    """(padded buffer elements, the largest layer's elements, the other parameters' elements) of one
    rank's chunks: DataParallel's layout (parallel/data_parallel/buffers.py: reverse registration
    order, a bucket per chunk or more, each padded to a multiple of dp; a tied embedding alone; under
    ZeRO-3 no bucket spans two layers)."""
    placed = list(reversed(sizes))  # (chunk, name, numel, shared)
    units = [(c, name.split(".")[1] if name.startswith("layers.") else "root") for c, name, _, _ in placed]
    keys = {u: i for i, u in enumerate(dict.fromkeys(units))}
    groups = [keys[u] for u in units] if zero == 3 else [c for c, *_ in placed]
    _, _, total = plan_buckets([n for _, _, n, _ in placed], bucket_size=bucket, dp=dp,
                               separate=[shared for *_, shared in placed], groups=groups)
    per_unit: dict = {}
    for u, (_, _, n, _) in zip(units, placed):
        per_unit[u] = per_unit.get(u, 0) + n
    layer = max((n for (_, name), n in per_unit.items() if name != "root"), default=0)
    root = sum(n for (_, name), n in per_unit.items() if name == "root")
    return total, layer, root


def stage_param_sizes(model, *, tp: int, ep: int = 1, layer_range: tuple[int, int], pre_process: bool,
                      post_process: bool, expert_tp: int | None = None) -> list[tuple[str, int, bool, bool]]:
    """``(name, elements on one TP rank, shared_embedding, expert)`` of each parameter of a stage, in the
    built stage's registration order, without building it. With expert parallelism (``ep`` > 1) only one
    ep rank's experts, ``num_experts / ep`` of each MoE layer's (every ep rank holds as many); the dense
    parts (attention, norms, routers, shared experts, embeddings) are replicated (models/convert.py).
    ``expert_tp`` = 1 (None: ``tp``): the experts whole on every TP rank (``parallel.expert_tp``)."""
    etp = {} if expert_tp in (None, tp) else {"expert_tp": expert_tp}  # models without experts need not know it
    if ep == 1:
        return [(name, n, shared, False) for name, n, shared in model.stage_param_sizes(
            tp=tp, layer_range=layer_range, pre_process=pre_process, post_process=post_process, **etp)]
    params = model.stage_params(tp=tp, ep=ep, layer_range=layer_range, pre_process=pre_process,
                                post_process=post_process, **etp)
    return [(q.name, prod(q.local_shape), q.shared_embedding, q.expert) for q in params]


def _buffer_numel(sizes, *, dp: int, bucket: int | None, zero: int, ep: int) -> tuple[int, int, int, int]:
    """``(dense elements, expert elements, the largest layer's elements, the other parameters' elements)``
    of one rank's ``(chunk, name, numel, shared, expert)`` entries, the buffers padded as DataParallel pads
    them. With ``ep`` > 1 the expert parameters have a buffer of their own, reduced (and under ZeRO sharded)
    over edp = dp / ep ranks, so it is padded to a multiple of edp; the expert elements are 0 at ep = 1."""
    dense = [(c, name, n, shared) for c, name, n, shared, expert in sizes if not (expert and ep > 1)]
    experts = [(c, name, n, shared) for c, name, n, shared, expert in sizes if expert and ep > 1]
    total, layer, root = _padded_numel(dense, dp=dp, bucket=bucket, zero=zero)
    more = 0
    if experts:  # a MoE layer's unit gathers its ep rank's experts with its dense part (ZeRO-3)
        more, _, _ = _padded_numel(experts, dp=dp // ep, bucket=bucket, zero=zero)
        _, layer, _ = _padded_numel(dense + experts, dp=1, bucket=bucket, zero=zero)
    return total, more, layer, root


def dp_buffer_numel(cfg, model, *, world: int, pp_rank: int = 0) -> tuple[int, int, int, int]:
    """``(dense, expert, largest layer, other)`` elements of the data-parallel buffers of pipeline rank
    ``pp_rank``'s ranks, padded as DataParallel pads them (:func:`_buffer_numel`). The dense set is reduced
    (under ZeRO sharded) over dp x cp, the expert set (0 at ep = 1) over edp = dp x cp / ep, so a ZeRO step
    reduce-scatters 4 bytes and all-gathers one parameter's bytes per element of each set over its group."""
    p, o = cfg.parallel, cfg.optim
    dp, ep = cfg.validate_world(world), getattr(p, "ep", 1)
    num_stages = p.pp * p.vp
    ranges = split_layers(model.num_layers, num_stages, p.pipeline_layout)
    mine = rank_stages(pp_rank, pp=p.pp, vp=p.vp, placement=placement_of(p.schedule))  # no schedule needed
    sizes = [(c, *entry) for c, st in enumerate(mine)
             for entry in stage_param_sizes(model, tp=p.tp, ep=ep, layer_range=ranges[st], pre_process=st == 0,
                                            post_process=st == num_stages - 1, expert_tp=getattr(p, "expert_tp", None))]
    bucket = bucket_size_elements(bucket_size=None, bucket_size_mb=o.bucket_size_mb)
    return _buffer_numel(sizes, dp=dp * getattr(p, "cp", 1), bucket=bucket,
                         zero=o.zero_stage if o.distributed else 0, ep=ep)


def method_state_bytes(cfg, model, *, world: int, pp_rank: int = 0) -> int:
    """Bytes of the data-parallel method's own state on each rank of pipeline rank ``pp_rank``
    (docs/decentralised.md), as the built run holds it (``OuterOptimizer.state_bytes``,
    ``GradCompressor.state_bytes``), over the N padded elements of the rank's data-parallel buffers:

    * ``outer.method`` diloco / streaming_diloco: the anchor (4 N), the momentum (4 N, ``outer.momentum > 0``),
      the top-k error feedback (4 N), the norm mask (N) and, with int8 or top-k at tp > 1, the positions of
      the TP-replicated parameters (8 bytes each);
    * ``optim.grad_compression = powersgd``: per matrix it compresses (m, n), its error feedback (4 m n) and
      warm-start factor (4 n r);
    * ``onebit``: per bucket its error feedback (4 bytes per element, padded to the chunk) and mask (1), and
      at tp > 1 the TP-replicated positions (8 each).

    The inner optimizer's masters and moments are not included (``RankMemory.optimizer`` holds both)."""
    from parallel.data_parallel.compression import DEFAULT_ONEBIT_CHUNK, powersgd_compresses

    p, o, u = cfg.parallel, cfg.optim, cfg.outer
    if u.method == "none" and o.grad_compression == "none":
        return 0
    dp = cfg.validate_world(world) * getattr(p, "cp", 1)
    num_stages = p.pp * p.vp
    ranges = split_layers(model.num_layers, num_stages, p.pipeline_layout)
    mine = rank_stages(pp_rank, pp=p.pp, vp=p.vp, placement=placement_of(p.schedule))
    expert_tp = getattr(p, "expert_tp", None)
    etp = {} if expert_tp in (None, p.tp) else {"expert_tp": expert_tp}  # as stage_param_sizes: whole experts at 1
    params = [(c, q) for c, st in enumerate(mine)  # (chunk, models.convert.StageParam), registration order
              for q in model.stage_params(tp=p.tp, layer_range=ranges[st], pre_process=st == 0,
                                          post_process=st == num_stages - 1, **etp)]
    if o.grad_compression == "powersgd":
        r = o.powersgd_rank
        return sum(4 * m * n + 4 * n * r for _, q in params if len(q.local_shape) == 2
                   for m, n in [q.local_shape] if powersgd_compresses(r, m, n))
    placed = list(reversed(params))  # DataParallel's placement order (parallel/data_parallel/buffers.py)
    bucket = bucket_size_elements(bucket_size=None, bucket_size_mb=o.bucket_size_mb)
    _, buckets, total = plan_buckets([prod(q.local_shape) for _, q in placed], bucket_size=bucket, dp=dp,
                                     separate=[q.shared_embedding for _, q in placed], groups=[c for c, _ in placed])
    # elements of the TP-replicated parameters (a tied embedding is split over tp, so never one of them), whose
    # positions the methods keep as int64 indices at tp > 1
    rep_numel = [prod(q.local_shape) if q.partition is None and p.tp > 1 else 0 for _, q in placed]
    if o.grad_compression == "onebit":
        return sum(5 * (-(-(b.end - b.start) // DEFAULT_ONEBIT_CHUNK) * DEFAULT_ONEBIT_CHUNK)
                   + 8 * sum(rep_numel[i] for i in b.members) for b in buckets)
    out = total * (4 + 1) + (4 * total if u.momentum > 0 else 0) + (4 * total if u.compression == "topk" else 0)
    return out + (8 * sum(rep_numel) if u.compression in ("int8", "topk") else 0)


def predict_memory(cfg, model, *, world: int, device: str = "cpu", rows_per_sample: int = 1,
                   schedules=build_schedule) -> MemoryPrediction:
    """Bytes per rank of the run ``cfg`` of ``model`` (a models.hook.ModelHook: ``config``,
    ``stage_param_sizes``, ``make_vocab_size_divisible_by``, ``fused_cross_entropy``; ``stage_params`` too
    with ``outer.method`` or ``optim.grad_compression``: :func:`method_state_bytes`) over ``world``
    ranks on ``device`` ("cpu": gloo, SDPA's CPU paths; "cuda": NCCL, fused cross-entropy by default).
    ``schedules``: builds the layout's pipeline schedule, with parallel.pipeline.build_schedule's
    arguments (the planner passes a remembering one: it meets the same schedules in many layouts)."""
    from engine.optim import resolve_adamw

    p, t, o = cfg.parallel, cfg.train, cfg.optim
    dp = cfg.validate_world(world)
    cp = getattr(p, "cp", 1)
    ep = getattr(p, "ep", 1)
    dpr = dp * cp  # DataParallel's group (mesh.dp_cp): gradients reduce, and ZeRO shards, over dp x cp
    zero = o.zero_stage if o.distributed else 0
    elem = 2 if cfg.model.dtype == "bf16" else 4
    num_stages = p.pp * p.vp
    ranges = split_layers(model.num_layers, num_stages, p.pipeline_layout)
    m = cfg.num_microbatches(dp)
    schedule = schedules(p.schedule, pp=p.pp, vp=p.vp, microbatches=m)
    shape = LayerShape.of(model.config)
    sp = p.sequence_parallel and p.tp > 1
    s, b = t.seq_length // cp, t.micro_batch_size * rows_per_sample
    vocab_local = model.config.padded_vocab_size(
        tp=p.tp, make_vocab_size_divisible_by=model.make_vocab_size_divisible_by) // p.tp
    fused = model.fused_cross_entropy if model.fused_cross_entropy is not None else device == "cuda"
    adam = resolve_adamw("auto", device=device)[0]
    notes = []
    if cfg.model.fp8 != "none":
        from parallel.tensor_parallel.fp8 import weight_casts_enabled
        te = cfg.model.fp8_backend == "te"  # Transformer Engine keeps its own casts and workspaces
        held = not te and weight_casts_enabled(cfg.model.fp8_weight_cache, zero_stage=zero,
                                                   cuda_graph=cfg.model.cuda_graph)
        what = "FP8 scales and casts"
        if te:  # not modeled: TE's layout of what it saves has not been measured here (docs/fp8.md)
            what = "Transformer Engine's FP8 casts and workspaces" + (
                " (with sequence parallelism TE saves the gathered inputs of qkv and fc1 in FP8, up to 4 bytes per "
                "token and hidden unit per layer, on top of the plan)" if cfg.parallel.sequence_parallel and p.tp > 1
                else "")
        notes.append(what + (" (model.fp8_weight_cache: each FP8 weight's casts held for the step, "
                             "up to 2 bytes per element, 2.25 for mxfp8)" if held else ""))
    if cfg.outer.method != "none":  # its state is modeled (method_state_bytes), a sync's buffers are not
        notes.append("a sync's buffers (measured per element it sends: 4 bytes, about 8 with top-k, 6-7 with int8, "
                     "8-11 with bf16; docs/decentralised.md) and the outer reductions in flight (a fragment's "
                     "pseudo-gradient each, 4 bytes per element, about 2 with int8; up to every fragment's with "
                     "outer.overlap_steps > 1)")
    if cfg.optim.grad_compression != "none":
        notes.append(f"{cfg.optim.grad_compression}'s buffers while it reduces a bucket")
    if cfg.model.cuda_graph != "none":  # models/cuda_graphs.py; the measured (allocated) peak leaves them out too
        notes.append("the layers' CUDA graph pools (model.cuda_graph: per input signature, a micro-batch's "
                     "activations, the layers' gradient buffers and their inputs' static copies)")
    # The ring's block kernel (parallel/context_parallel/ring.py): flash unless a sliding window cuts blocks or
    # no flash kernel runs the dtype (CUDA: bf16/fp16, head dim a multiple of 8 up to 256). Documents packed
    # in a sequence also cut blocks: data, not config, so not modeled (named below when cp > 1).
    flash_ok = device != "cuda" or (elem == 2 and shape.head_dim % 8 == 0 and shape.head_dim <= 256)
    cp_blocks = "flash" if flash_ok and not any(getattr(model.config, "sliding_windows", ()) or ()) else "explicit"
    if cp > 1 and cp_blocks == "flash":
        notes.append("the explicit kernel's block buffers where packed documents cut a ring block")
    if getattr(model.config, "qk_norm", False) or getattr(model.config, "sliding_windows", ()):
        notes.append("q/k norms and sliding-window masks")
    if ep > 1 and getattr(p, "moe_dispatcher", "alltoall") == "allgather":
        notes.append("the allgather dispatcher's gathered tokens (ep times the routed rows)")
    if shape.num_experts and not all(map(model.config.is_moe_layer, range(model.num_layers))):
        notes.append("dense layers of an MoE model (counted with the MoE layers' activations)")
    ranks = []
    for r in range(p.pp):
        mine = rank_stages(r, pp=p.pp, vp=p.vp, placement=schedule.placement)  # chunk order
        dense, expert, layer, root = dp_buffer_numel(cfg, model, world=world, pp_rank=r)
        total = dense + expert
        shard = dense // dpr + expert * ep // dpr  # ZeRO: the dense set over dp x cp, the experts over edp
        params = total * elem if zero < 3 else shard * elem
        grads = total * 4 if zero < 2 else shard * 4
        owned = shard if zero >= 1 else total
        # + DiLoCo's outer state or the compressed reduction's buffers (0 without either)
        optimizer = owned * (8 + (4 if elem != 4 else 0)) + method_state_bytes(cfg, model, world=world, pp_rank=r)
        per_stage = {}
        for st in mine:
            sm = stage_memory(shape, s=s, b=b, layers=ranges[st][1] - ranges[st][0], tp=p.tp, sp=sp,
                              recompute=t.activation_checkpointing, recompute_layers=t.recompute_num_layers,
                              pre_process=st == 0, post_process=st == num_stages - 1, vocab_local=vocab_local,
                              elem=elem, fused_ce=fused, attention=shape.attention_path(device), cp=cp,
                              cp_comm=p.cp_comm, cp_a2a_size=p.cp_a2a_size, cp_blocks=cp_blocks,
                              expert_tp=getattr(p, "expert_tp", None))
            if zero == 3 and dpr > 1:  # one layer's fp32 gradient bucket (and, on gloo, its reduce-scatter copy)
                sm = StageMemory(sm.saved, sm.forward, sm.backward + layer * 4 * (2 if device == "cpu" else 1)
                                 + layer // dpr * 4, sm.wgrad, sm.wgrad_step)
            per_stage[st] = sm
        buckets = total * 4 if zero == 2 and m > 1 else 0  # lazy fp32 buckets live from the first backward on
        pipe, saved, inflight = pipeline_peak(schedule.ranks[r], per_stage, after_first_backward=buckets,
                                              split_backward=schedule.split_backward)
        if zero == 3 and dpr > 1:  # the chunks' other parameters stay gathered; a layer and its prefetch
            pipe += (root + 2 * layer) * elem
        step = owned * 4 if adam == "foreach" else 0  # foreach AdamW's denominator
        if dpr > 1 and zero in (1, 2):
            reduce = shard * 4 + (total * 4 if device == "cpu" else 0)  # gloo reduce-scatters a copy
            # ... then gathers the parameters (on gloo into a copy too: measured at dp x cp = 2, where the
            # halved activations leave the step as the peak)
            step = max(step, reduce + (total * 4 if zero == 2 else 0), total * elem * (2 if device == "cpu" else 1))
        phase = "pipeline" if pipe >= step else "step"
        ranks.append(RankMemory(pp_rank=r, params=params, grads=grads, optimizer=optimizer,
                                activations=saved if pipe >= step else 0,
                                transient=(pipe - saved) if pipe >= step else step,
                                inflight=inflight if pipe >= step else 0, phase=phase))
    layout = (f"dp {dp} x pp {p.pp} x tp {p.tp}" + (" sp" if sp else "") + (f" x cp {cp}" if cp > 1 else "")
              + (f" (ep {ep})" if ep > 1 else "") + (f" vp {p.vp}" if p.vp > 1 else "")
              + f", zero {zero}, {t.activation_checkpointing} recompute")
    return MemoryPrediction(ranks=tuple(ranks), layout=layout, notes=tuple(notes))


# -- measured --------------------------------------------------------------------------------------

def state_bytes(chunks, ddp, optimizer, outer=None) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes this rank holds, from the tensors themselves: the
    data-parallel parameter buffers (ZeRO-3: the shards) plus frozen parameters outside them, the
    persistent fp32 gradient buffers or shards, the optimizer's masters and moments, plus the outer
    optimizer's state (``outer``: DiLoCo's OuterOptimizer, or None) or the gradient compressor's."""
    params = sum(buf.param_data.numel() * buf.param_data.element_size() for buf in ddp.flat_buffers)
    seen = set()
    for q in chunks.parameters():
        if not q.requires_grad and q.untyped_storage().data_ptr() not in seen:
            seen.add(q.untyped_storage().data_ptr())
            params += q.untyped_storage().nbytes()
    method = (outer.state_bytes() if outer is not None else 0) + (
        ddp.grad_compressor.state_bytes() if getattr(ddp, "grad_compressor", None) is not None else 0)
    return params, ddp.grad_buffer_bytes(), optimizer.state_bytes() + method


def measured_report(prediction: MemoryPrediction, rows: list[list[float]], *, step: int) -> tuple[str, dict]:
    """The log line and the metrics.jsonl record of the measured peak: ``rows`` holds one
    ``[pp_rank, params, grads, optimizer, step_peak]`` per world rank (bytes; step_peak above the
    step's start). A pipeline rank's measured peak is the largest of its ranks'."""
    by_pp: dict[int, float] = {}
    for pp_rank, params, grads, opt, peak in rows:
        by_pp[int(pp_rank)] = max(by_pp.get(int(pp_rank), 0.0), params + grads + opt + peak)
    measured = [int(by_pp[r.pp_rank]) for r in prediction.ranks]
    predicted = [r.total for r in prediction.ranks]
    worst = max(range(len(measured)), key=lambda i: measured[i])
    err = [(pr - me) / me if me else 0.0 for pr, me in zip(predicted, measured)]
    per = "; ".join(f"pp rank {r.pp_rank}: {me / MB:.2f} vs {pr / MB:.2f} MB ({100 * e:+.1f}%)"
                    for r, me, pr, e in zip(prediction.ranks, measured, predicted, err))
    line = (f"tessel: memory: measured peak of step {step} {measured[worst] / MB:.2f} MB (pp rank {worst}: state "
            f"+ the step's peak above it) vs predicted {predicted[worst] / MB:.2f} MB ({100 * err[worst]:+.1f}%)"
            + (f"; {per}" if len(measured) > 1 else ""))
    record = {"step": step, "event": "measured", "measured_peak_bytes": measured[worst],
              "predicted_peak_bytes": predicted[worst], "relative_error": err[worst],
              "measured_bytes_per_pp_rank": measured, "predicted_bytes_per_pp_rank": predicted,
              "measured_state_bytes": int(max(sum(row[1:4]) for row in rows)),
              "measured_step_bytes": int(max(row[4] for row in rows))}
    return line, record


def _c10_flag(name: str = "FLAGS_caffe2_report_cpu_memory_usage", ctype=ctypes.c_bool):
    """A c10 flag (by default ``FLAGS_caffe2_report_cpu_memory_usage``) as a ctypes value, or None if not
    exported."""
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for path in glob.glob(os.path.join(libdir, "libc10.*")):
        try:
            return ctype.in_dll(ctypes.CDLL(path), name)
        except (OSError, ValueError):
            continue
    return None


_C10_ERROR = 2  # c10's log severity of ERROR (WARNING is 1): FLAGS_caffe2_log_level at or above it drops warnings


@contextlib.contextmanager
def quiet_stderr():
    """Silence file descriptor 2 for the block: Kineto prints a line to it at every profiler start and stop
    (on every rank, at every run's first step), which is noise in a training log."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak`` / ``m.end`` (bytes, see the module docstring)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak: int | None = None
        self.end: int | None = None
        self.exact = True  # False: CPU without the allocator's cross-thread total (see the module docstring)
        self._prof = None
        self._flag = None
        self._log_level = None  # c10's FLAGS_caffe2_log_level while a CPU window is open
        self._flag_was = False
        self._gc_was = False
        self._start = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        if self.device.type != "cpu":
            raise ValueError(f"PeakMemory measures cpu or cuda devices, not {self.device.type!r}")
        # torch.autograd.profiler's profile, not torch.profiler's: the latter's start asks hasattr(torch,
        # "_inductor"), which imports the compiler (2.4 s of CPU per process on the 2-core CI machine, in every
        # rank of every run with the memory report); this one records the same allocation events
        from torch.autograd.profiler import profile
        self._flag = _c10_flag()
        self.exact = self._flag is not None
        # With the report flag set, every free of a block allocated before the window makes c10 log "Memory
        # block of unknown size was allocated before the profiling started" (once per rank and run): the
        # measurement's own noise, so c10's warnings are dropped for the window (errors still print).
        self._log_level = _c10_flag("FLAGS_caffe2_log_level", ctypes.c_int) if self.exact else None
        if self._log_level is not None:
            self._log_level_was = self._log_level.value
            self._log_level.value = max(self._log_level_was, _C10_ERROR)
        self._gc_was = gc.isenabled()
        entered = False
        try:
            if self._flag is not None:
                self._flag_was = bool(self._flag.value)
                self._flag.value = True
            self._prof = profile(use_cpu=True, use_kineto=True, profile_memory=True, record_shapes=False,
                                 with_stack=False)
            # no garbage collection inside the window (it would free memory allocated before it); disabling the
            # collector for the window does that without a full collection up front (0.3 s and more in a big
            # process). A tensor held only by a reference cycle made in the window then lives to its end: the
            # measured peak is at most that much above the run's
            gc.disable()
            with quiet_stderr():
                self._prof.__enter__()
            entered = True
            torch.empty(1)  # an event whose total is the baseline (allocated and freed at once)
        except BaseException:
            if entered:
                with quiet_stderr():
                    self._prof.__exit__(None, None, None)
            self._restore()
            raise
        return self

    def _restore(self) -> None:
        """The garbage collector, c10's memory-report flag and its log level as they were before the window."""
        if self._gc_was:
            gc.enable()
        if self._flag is not None:
            self._flag.value = self._flag_was
        if self._log_level is not None:
            self._log_level.value = self._log_level_was

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._start
            self.end = torch.cuda.memory_allocated(self.device) - self._start
            return
        try:
            torch.empty(1)  # an event after the last free on another thread: the total at exit
            with quiet_stderr():
                self._prof.__exit__(*exc)
        finally:
            self._restore()
        if exc[0] is not None:
            return
        self.peak, self.end = cpu_allocation_peak(self._prof, totals=self.exact)

    def __repr__(self) -> str:
        return f"PeakMemory(device={self.device}, peak={self.peak}, end={self.end})"


def _allocations(prof):
    """(time, signed bytes, allocator total) of every CPU allocation event of a finished profile (a
    ``torch.profiler.profile`` or the ``torch.autograd.profiler.profile`` it wraps)."""
    alloc = torch._C._profiler._EventType.Allocation
    stack = list(getattr(prof, "profiler", prof).kineto_results.experimental_event_tree())
    out = []
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == alloc:
            f = e.extra_fields
            if f.device.type == "cpu":
                out.append((e.start_time_ns, f.alloc_size, f.total_allocated))
    return sorted(out)


def cpu_allocation_peak(prof, *, totals: bool = True) -> tuple[int, int]:
    """``(peak, end)`` in bytes above the first event of a finished CPU profile: the largest and the
    last allocator total (``totals``), else the running sum of the events."""
    events = _allocations(prof)
    if not events:
        return 0, 0
    if totals:
        _, first_bytes, first_total = events[0]
        base = first_total - first_bytes
        inside = events[:-2] if len(events) > 2 else events  # PeakMemory's exit probe is the last two
        return max(t for _, _, t in inside) - base, events[-1][2] - base
    live = peak = 0
    for _, nbytes, _ in events:
        live += nbytes
        peak = max(peak, live)
    return peak, live
