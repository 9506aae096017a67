"""One layout's prediction: memory per GPU, step time (with its breakdown), TFLOP/s and MFU.

Memory is engine/memory.py's :func:`predict_memory` on the layout's own run config (the start-up report
and the tests that assert it against the allocator use the same call). Step time (docs/planner.md):

* every GEMM by a roofline at the GPU's large-GEMM efficiency, counted in whole waves of output tiles
  over the SMs (:func:`gemm_time`: what makes a GEMM of few rows, or a tile count just past a wave,
  slower than its FLOPs), plus a fixed per-GEMM overhead;
* core attention (causal, flash) at ``attention_efficiency`` of the dense peak, backward 2.5x forward;
* memory-bound work (norms, residual adds, RoPE, the activation function, cross-entropy, the optimizer)
  at HBM bandwidth (the activations' at ``activation_gbps`` where the device has one: a CPU's caches);
* each collective by an alpha-beta model over the link its group spans (NVLink inside a node,
  the NIC across nodes), plus the device's per-call ``collective_overhead_us`` (0 on the GPUs; on CPU
  measured by ``--calibrate``: gloo's host/sync cost per call, docs/planner.md), with the bytes of
  parallel/comm.py's cost table (the ledger the tests assert):
  ``all_reduce`` ``2(p-1)/p N``, ``all_gather`` ``(p-1) N_shard``, ``reduce_scatter`` ``(p-1)/p N``;
  TP collectives (the ledger's count per layer, :func:`tp_layer_comm`) exposed, or with
  ``--tp-overlap ring`` each one tp - 1 steps under the linear's GEMM chunks; context-parallel K/V
  rotation hides under attention up to its length; data-parallel reduction hides under the last
  micro-batch's backward, the parameter all-gather under the first forward, the rest is exposed;
* expert parallelism (docs/planner.md): expert weights, gradients and optimizer state at 1/ep (the
  memory is predict_memory's), each MoE layer's four token all-to-alls (dispatch and combine, forward and
  backward: :func:`moe_dispatch_bytes` each) exposed over the link the ep group spans, expert gradients
  reduced (ZeRO: sharded) over edp = dp x cp / ep; GEMMs at the active parameters' FLOPs (:func:`mlp_gemm_time`);
* host work (CPU devices): every framework op of a micro-batch (:class:`engine.planner.model.HostOps`,
  counted on the model's code) costs the device's ``host_op_us`` (measured by ``--calibrate``; 0 on the
  GPUs, whose launches run ahead of their kernels);
* pipeline: the per-stage forward/backward times and the p2p latency go into parallel/pipeline/simulate.py's
  dataflow model of the layout's own schedule (engine/planner/pipeline.py); its makespan includes the bubble;
* tied embeddings at pp > 1: the embedding / output-layer gradient all-reduce between the first and the
  last stage after the pipeline, exposed.

:class:`Training`'s last fields describe published runs' software (Megatron-LM 2021-2024: no sequence
parallelism, blocking pipeline exchanges, an unoverlapped fp16 gradient all-reduce, ...) for
engine/planner/validate.py; Tessel's runs use their defaults.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from engine.memory import MemoryPrediction, dp_buffer_numel, predict_memory
from engine.metrics import model_flops_per_step
from engine.planner.hardware import GPU
from engine.planner.pipeline import pipeline_time, root_gathers, schedule
from models.hook import flops_spec
from parallel.pipeline.split import split_layers

GIB = 2 ** 30


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` devices of one type; ``memory_fraction``: the share of HBM a plan may
    fill (the rest: CUDA context, NCCL buffers, allocator fragmentation); ``device``: "cuda" or "cpu"
    (engine/memory.py's device: NCCL or gloo buffers, fused cross-entropy on CUDA)."""

    gpu: GPU
    nodes: int = 1
    gpus_per_node: int = 8
    memory_fraction: float = 0.92
    device: str = "cuda"

    def __post_init__(self):
        for k in ("nodes", "gpus_per_node"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')}={getattr(self, k)} must be >= 1")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"--memory-fraction={self.memory_fraction} must be in (0, 1]")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def capacity_bytes(self) -> float:
        return self.gpu.hbm_gb * 1e9 * self.memory_fraction

    def link(self, span: int) -> tuple[float, float, float]:
        """(bytes/s, alpha seconds, per-call seconds) of a group spanning ``span`` consecutive ranks (mesh
        order dp-pp-cp-tp: tp innermost), NVLink if it stays inside a node. The per-call term is the device's
        ``collective_overhead_us`` (0 for the GPUs; measured for the CPU device by --calibrate)."""
        g = self.gpu
        call = g.collective_overhead_us * 1e-6
        if span <= self.gpus_per_node:
            return g.intra_gbps * 1e9 * g.link_efficiency, g.intra_alpha_us * 1e-6, call
        return g.inter_gbps * 1e9 * g.link_efficiency, g.inter_alpha_us * 1e-6, call


@dataclass(frozen=True, kw_only=True)
class Training:
    seq_length: int
    global_batch_size: int
    precision: str = "bf16"
    recompute: str = "selective"
    zero: int = 1
    attention: str = "flash"  # or "unfused": scores materialised, softmax and dropout memory-bound (pre-2022 Megatron)
    # tp_overlap: "none" (Tessel's plain path: every TP collective exposed), "ring" (parallel.tp_overlap = ring:
    # each sequence-parallel collective a ring of tp - 1 p2p steps under the linear's GEMM chunks), or
    # "symm_mem" (parallel.tp_overlap = symm_mem: the same chunked decomposition, run by PyTorch's fused
    # symmetric-memory ops; modelled as the ring), or
    # "async_backward" (Megatron-LM since 2022: the column-parallel backward's input-gradient reduction runs
    # under the weight-gradient GEMM and its input regather under the input-gradient GEMM; validation rows only)
    tp_overlap: str = "none"
    # optim.overlap_param_gather (ZeRO 1/2: the post-step parameter all-gather waited for by the next forward, under
    # its first layers, instead of right after the update); None: the model's base config's (Tessel's default: off)
    overlap_param_gather: bool | None = None
    # The rest describe published runs' software (engine/planner/validate.py); Tessel's own runs are the defaults.
    sequence_parallel: bool = True  # with tp > 1 (Tessel always; Megatron-LM before 2022 never)
    dp_overlap: bool = True  # gradient reduction under the last backward (Megatron-LM before 2023: after it)
    grad_reduce_bytes: int = 4  # bytes per gradient element on the wire (Tessel: fp32 buffers)
    p2p_scatter_gather: bool = False  # without SP: each TP rank sends 1/tp of the activation, all-gathered over NVLink
    p2p_blocking: bool = False  # Megatron-LM before 2023: every pipeline exchange waited for (torch.cuda.synchronize)

    def __post_init__(self):
        if self.attention not in ("flash", "unfused"):
            raise ValueError(f"attention={self.attention!r}: use 'flash' or 'unfused'")
        if self.tp_overlap not in ("none", "ring", "symm_mem", "async_backward"):
            raise ValueError(f"--tp-overlap {self.tp_overlap!r}: use none, ring or symm_mem")
        if self.tp_overlap in ("ring", "symm_mem") and not self.sequence_parallel:
            raise ValueError(f"--tp-overlap {self.tp_overlap} decomposes the sequence-parallel collectives: it needs "
                             "sequence parallelism")
        if self.tp_overlap == "symm_mem" and self.precision == "fp8":
            raise ValueError("--tp-overlap symm_mem with FP8: the FP8 linears have no symmetric-memory form "
                             "(parallel.tp_overlap = 'symm_mem' is refused with model.fp8); use --tp-overlap ring")
        if self.grad_reduce_bytes not in (2, 4):
            raise ValueError(f"grad_reduce_bytes={self.grad_reduce_bytes}: use 2 or 4")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"--recompute {self.recompute!r}: use none, selective or full")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"--zero {self.zero}: use 0, 1, 2 or 3")
        if self.precision not in ("bf16", "fp8", "fp32"):
            raise ValueError(f"--precision {self.precision!r}: use bf16 or fp8")


@dataclass(frozen=True, kw_only=True)
class Layout:
    tp: int
    pp: int
    vp: int
    dp: int
    cp: int
    mbs: int
    ep: int = 1

    def label(self) -> str:
        return (f"tp{self.tp} pp{self.pp}" + (f" vp{self.vp}" if self.vp > 1 else "") + f" dp{self.dp}"
                + (f" cp{self.cp}" if self.cp > 1 else "") + (f" ep{self.ep}" if self.ep > 1 else "")
                + f" mbs{self.mbs}")


@dataclass
class Prediction:
    layout: Layout
    memory: MemoryPrediction
    step_time_s: float
    tflops_per_gpu: float
    mfu: float
    mfu_causal: float
    fits: bool
    breakdown: dict = field(default_factory=dict)  # seconds per step on the busiest pipeline rank

    @property
    def memory_bytes(self) -> int:
        return self.memory.largest.total

    def as_dict(self) -> dict:
        r = self.memory.largest
        lay = self.layout
        return {"tp": lay.tp, "pp": lay.pp, "vp": lay.vp, "dp": lay.dp, "cp": lay.cp, "ep": lay.ep, "mbs": lay.mbs,
                "memory_gib_per_gpu": self.memory_bytes / GIB, "step_time_s": self.step_time_s,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu, "mfu_causal": self.mfu_causal,
                "fits": self.fits,
                "memory_gib": {"params": r.params / GIB, "grads": r.grads / GIB, "optimizer": r.optimizer / GIB,
                               "activations": r.activations / GIB, "transient": r.transient / GIB,
                               "inflight_microbatches": r.inflight},
                "time_s": dict(self.breakdown)}


# -- the cost pieces ---------------------------------------------------------------------------------

def gemm_time(m: int, n: int, k: int, *, gpu: GPU, peak_tflops: float) -> float:
    """Seconds of one (m x k) @ (k x n) GEMM: the roofline at the GPU's large-GEMM efficiency, in whole
    waves of output tiles, plus a fixed per-GEMM overhead (launch). On a GPU with ``sms`` the output is
    cut into ``gemm_tile`` tiles (either orientation, whichever needs fewer waves), each SM computes one
    at a time at its share of the rate, and a wave costs as much whether it is full or not (the edge
    tiles' padding and the last wave's idle SMs): at 2048 rows an A100's QKV GEMM of a 145B model
    (4608 x 12288 per rank) takes 3 waves of 108 SMs for 2.67 waves of work. Many waves: the roofline."""
    rate = gpu.gemm_efficiency * peak_tflops * 1e12
    if not gpu.sms:
        return 2.0 * m * n * k / rate + gpu.gemm_overhead_us * 1e-6
    a, b = gpu.gemm_tile
    waves = min(math.ceil(math.ceil(m / a) * math.ceil(n / b) / gpu.sms),
                math.ceil(math.ceil(m / b) * math.ceil(n / a) / gpu.sms))
    return waves * gpu.sms * 2.0 * a * b * k / rate + gpu.gemm_overhead_us * 1e-6


def _split_link(link) -> tuple[float, float, float]:
    """(bytes/s, alpha s, per-call s) from :meth:`Cluster.link`'s tuple (a bare (bytes/s, alpha) pair: no
    per-call term)."""
    return (link[0], link[1], link[2] if len(link) > 2 else 0.0)


def collective_time(op: str, nbytes: float, p: int, link: tuple[float, ...]) -> float:
    """Alpha-beta seconds of one ring collective over ``p`` ranks, plus the link's per-call term (host and
    synchronisation cost of one call, measured on CPU by --calibrate; 0 on the GPUs); ``nbytes`` is
    parallel/comm.py's ``N`` (the tensor passed in: the shard for all_gather, the full tensor otherwise)."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    bw, alpha, call = _split_link(link)
    if op == "all_reduce":
        return call + 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / bw
    if op == "all_gather":
        return call + (p - 1) * alpha + (p - 1) * nbytes / bw
    if op == "reduce_scatter":
        return call + (p - 1) * alpha + (p - 1) / p * nbytes / bw
    if op == "send":
        return call + alpha + nbytes / bw
    raise ValueError(f"unknown collective {op!r}")


def alltoall_time(nbytes: float, p: int, link: tuple[float, float]) -> float:
    """Alpha-beta seconds of one all-to-all over ``p`` ranks that sends ``nbytes`` to the other ranks
    (parallel/comm.py's ledger: the input less the own chunk): ``p - 1`` messages, the bytes at link rate."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    bw, alpha, call = _split_link(link)
    return call + (p - 1) * alpha + nbytes / bw


def moe_dispatch_bytes(config, *, tokens: int, ep: int, elem: int) -> float:
    """Bytes one rank sends in ONE token all-to-all of an MoE layer (the dispatch; the combine and the two
    backward all-to-alls move as many): each of ``tokens`` tokens goes to ``top_k`` experts, a share
    ``(ep - 1) / ep`` of them on other ranks under balanced routing, one ``hidden_size`` row each, in the
    activation dtype (tests/parallel/test_expert_parallel.py's ledger asserts the remote rows exactly).
    Under sequence parallelism the layer gathers the sequence first, so ``tokens`` is the TP group's.
    The int64 per-expert counts (``8 (E - E / ep)`` bytes) are negligible and left out."""
    return (ep - 1) / ep * config.moe_top_k * tokens * config.hidden_size * elem


def mlp_gemm_time(config, *, t: int, tp: int, ep: int, gpu: GPU, peak_tflops: float) -> float:
    """Forward seconds of a layer's MLP GEMMs on one rank, averaged over the layers. Dense: fc1 and fc2
    over ``t`` tokens. MoE layers: each of the ``E / ep`` local experts runs fc1 and fc2 on its share of the
    ``ep * t * top_k`` routed rows of the ep group, ``t * top_k * ep / E`` under balanced routing (the
    active FLOPs of models.hook.flops_spec: ``t * top_k`` rows per rank whatever ep), smaller GEMMs as E
    grows; plus the shared expert and the router. Expert FFNs are TP-sharded like the dense MLP."""
    c = config
    g = 2 if c.gated else 1

    def ffn(rows, width):
        return (gemm_time(rows, g * width // tp, c.hidden_size, gpu=gpu, peak_tflops=peak_tflops)
                + gemm_time(rows, c.hidden_size, width // tp, gpu=gpu, peak_tflops=peak_tflops))
    dense = ffn(t, c.ffn_hidden_size)
    if not c.num_experts:
        return dense
    rows = max(1, round(t * c.moe_top_k * ep / c.num_experts))
    moe = c.num_experts // ep * ffn(rows, c.moe_ffn_hidden_size)
    moe += gemm_time(t, c.num_experts, c.hidden_size, gpu=gpu, peak_tflops=peak_tflops)  # the router
    if c.shared_expert_ffn_hidden_size:
        moe += ffn(t, c.shared_expert_ffn_hidden_size)
    n_moe = sum(map(c.is_moe_layer, range(c.num_layers)))
    return (n_moe * moe + (c.num_layers - n_moe) * dense) / c.num_layers


def tp_layer_comm(config, *, t: int, tp: int, sp: bool, elem: int, tr: Training, cluster: Cluster, peak: float,
                  attn_shapes) -> tuple[float, float, float]:
    """(exposed forward seconds, exposed backward seconds, extra forward GEMM seconds) of one layer's TP
    collectives on one rank and micro-batch. The collectives are the ledger's
    (tests/parallel/test_tensor_parallel.py::test_layer_ledger, per column + row pair): with sequence
    parallelism, forward an all-gather (column input) and a reduce-scatter (row output), backward a
    reduce-scatter (column input gradient), an all-gather (the column input regathered for its weight
    gradient) and an all-gather (row output gradient); without, one all-reduce each way. A layer has two
    pairs (attention: QKV + out; MLP: fc1 + fc2).

    ``tr.tp_overlap == "ring"`` (parallel/tensor_parallel/overlap.py), or ``"symm_mem"`` (the same decomposition
    through PyTorch's fused ops, its chunks copied over NVLink: modelled the same): each of those collectives is a ring of
    tp - 1 p2p steps of one (t / tp, h) chunk; step i's transfer runs while the linear's GEMM on chunk i
    runs, and the next step waits for both, so a ring costs tp - 1 times max(transfer, chunk GEMM) plus the
    last chunk's GEMM: exposed ``(tp - 1) max(0, transfer - chunk GEMM)``; the GEMM, cut into tp chunks of
    t / tp rows, pays the per-GEMM overhead tp times (the returned extra). Backward: the column linear's
    regather ring under its weight-gradient chunks, its reduce-scatter ring under its input-gradient chunks;
    the row linear's gather ring under both. MoE layers' expert MLPs are not decomposed (their sequence
    gather is plain in parallel/expert_parallel/layer.py): counted as plain collectives.
    ``"async_backward"`` (Megatron-LM's column-parallel backward): the input-gradient reduction under the
    weight-gradient GEMM, the regather under the input-gradient GEMM; the rest exposed.
    ``tr.precision == "fp8"`` (Tessel's per-tensor FP8 linears, docs/fp8.md): with sequence parallelism the
    column input and the row output gradient are gathered as fp8 (1 byte per element), and the column
    backward regathers nothing (the forward saved fp8 x^T): forward and backward each 2 fp8 all-gathers and
    2 reduce-scatters. FP8 keeps a ring a ring but replaces the asynchronous column backward (apply_fp8), so
    with sequence parallelism "async_backward" costs what "none" does (without it, the all-reduce model above
    is kept as it was, async overlap included)."""
    if tp <= 1:
        return 0.0, 0.0, 0.0
    c, gpu = config, cluster.gpu
    link = cluster.link(tp)
    act_bytes = elem * t * c.hidden_size  # the TP group's (s, b, h) activation of one micro-batch
    frac = moe_layer_fraction(c)  # the share of layers whose MLP is the MoE layer (0: a dense model)
    ar = collective_time("all_reduce", act_bytes, tp, link)
    # An MoE layer's MLP (parallel/expert_parallel/layer.py, expert_tp = tp) is no column + row pair: the experts'
    # partial output rows are all-reduced (reduce_from_tp) forward and their input rows' gradients (copy_to_tp)
    # backward, top_k x t rows of h each (ep-independent under balanced routing); a shared expert all-reduces
    # its (t, h) output forward and its input gradient backward. With SP the layer all-gathers the sequence
    # forward, and scatter_to_sp's backward all-gathers the output gradient; no reduce-scatter either way.
    # Plain collectives in the activation dtype (no ring, no FP8): the same each way.
    moe_ar = 0.0
    if frac:
        moe_ar = collective_time("all_reduce", c.moe_top_k * act_bytes, tp, link)  # (top_k t, h) rows
        if c.shared_expert_ffn_hidden_size:
            moe_ar += ar  # the shared expert's (t, h)
    col = [gemm_time(t, nn, k, gpu=gpu, peak_tflops=peak) for nn, k in column_shapes(c, tp, attn_shapes)]

    def layer(attn: tuple[float, float], dense_mlp: tuple[float, float], moe: float) -> tuple[float, float]:
        """(forward, backward) of a layer: the attention pair, and the MLP weighted over dense and MoE layers."""
        return (attn[0] + (1 - frac) * dense_mlp[0] + frac * moe, attn[1] + (1 - frac) * dense_mlp[1] + frac * moe)

    if not sp:  # each column + row pair: one all-reduce each way (row output forward, column input backward)
        if tr.tp_overlap != "async_backward":
            return (*layer((ar, ar), (ar, ar), moe_ar), 0.0)
        # Megatron's asynchronous column backward: the input-gradient all-reduce under the weight-gradient GEMM
        return (*layer((ar, max(0.0, ar - col[0])), (ar, max(0.0, ar - col[1])), moe_ar), 0.0)
    ag = collective_time("all_gather", act_bytes / tp, tp, link)
    rs = collective_time("reduce_scatter", act_bytes, tp, link)
    fp8 = tr.precision == "fp8"
    ag8 = collective_time("all_gather", t * c.hidden_size / tp, tp, link)  # fp8: 1 byte per element
    moe = ag + moe_ar  # an MoE layer's MLP with SP, each way: the sequence gather + the rows' all-reduce
    if fp8 and tr.tp_overlap != "ring":  # each FP8 column + row pair (attention's; a dense MLP's): ag8 + rs each way
        pair = (ag8 + rs, ag8 + rs)
        return (*layer(pair, pair, moe), 0.0)
    if tr.tp_overlap == "none":  # a pair: forward AG + RS, backward RS + AG + AG (test_layer_ledger)
        pair = (ag + rs, 2 * ag + rs)
        return (*layer(pair, pair, moe), 0.0)
    if tr.tp_overlap == "async_backward":
        pairs = [(ag + rs, ag + max(0.0, ag - g) + max(0.0, rs - g)) for g in col]  # attention's, the MLP's
        return (*layer(pairs[0], pairs[1], moe), 0.0)
    step = collective_time("send", act_bytes / tp, 2, link)  # one ring step: a chunk to r + 1, one from r - 1
    step8 = collective_time("send", t * c.hidden_size / tp, 2, link)  # an fp8 chunk
    rows = max(1, t // tp)
    pairs = [(column_shapes(c, tp, attn_shapes)[0], attn_shapes[1]),  # (column (n, k), row (n, k)) per pair
             (column_shapes(c, tp, attn_shapes)[1], (c.hidden_size, c.ffn_hidden_size // tp))]
    rings = []  # (forward, backward, extra GEMM) of the attention pair, then of a dense MLP's
    for cs, row in pairs:
        g_col = gemm_time(rows, *cs, gpu=gpu, peak_tflops=peak)
        g_row = gemm_time(rows, *row, gpu=gpu, peak_tflops=peak)
        if fp8:  # fp8 gathers; the column backward's reduce-scatter ring only; the row's weight gradient after
            fwd = (tp - 1) * (max(0.0, step8 - g_col) + max(0.0, step - g_row))
            bwd = (tp - 1) * (max(0.0, step - g_col) + max(0.0, step8 - g_row))
        else:
            fwd = (tp - 1) * (max(0.0, step - g_col) + max(0.0, step - g_row))
            bwd = (tp - 1) * (2 * max(0.0, step - g_col) + max(0.0, step - 2 * g_row))
        extra = tp * (g_col + g_row) - gemm_time(t, *cs, gpu=gpu, peak_tflops=peak) - gemm_time(
            t, *row, gpu=gpu, peak_tflops=peak)
        rings.append((fwd, bwd, extra))
    (a_f, a_b, a_x), (d_f, d_b, d_x) = rings
    return (*layer((a_f, a_b), (d_f, d_b), moe), a_x + (1 - frac) * d_x)


def moe_layer_fraction(config) -> float:
    """The share of a model's layers whose MLP is the MoE layer (0 for a dense model; Qwen2-MoE-style models
    may mix dense layers in: ``config.moe_layers``)."""
    if not config.num_experts:
        return 0.0
    return sum(map(config.is_moe_layer, range(config.num_layers))) / config.num_layers


def column_shapes(config, tp: int, attn_shapes) -> list[tuple[int, int]]:
    """(n, k) of the layer's column-parallel GEMMs: QKV, and the MLP's fc1 (gate and up fused)."""
    c = config
    return [attn_shapes[0], ((2 if c.gated else 1) * c.ffn_hidden_size // tp, c.hidden_size)]


@dataclass
class _Costs:
    """Seconds per micro-batch of one virtual stage, by kind; forward and backward."""

    fwd: dict = field(default_factory=dict)
    bwd: dict = field(default_factory=dict)

    def add(self, kind: str, fwd: float, bwd: float) -> None:
        self.fwd[kind] = self.fwd.get(kind, 0.0) + fwd
        self.bwd[kind] = self.bwd.get(kind, 0.0) + bwd

    def scaled(self, n: int) -> "_Costs":
        return _Costs({k: v * n for k, v in self.fwd.items()}, {k: v * n for k, v in self.bwd.items()})

    def merged(self, other: "_Costs") -> "_Costs":
        out = _Costs(dict(self.fwd), dict(self.bwd))
        for k, v in other.fwd.items():
            out.fwd[k] = out.fwd.get(k, 0.0) + v
        for k, v in other.bwd.items():
            out.bwd[k] = out.bwd.get(k, 0.0) + v
        return out


def layer_costs(config, lay: Layout, tr: Training, cluster: Cluster) -> _Costs:
    """One transformer layer, one micro-batch, one rank."""
    gpu, c = cluster.gpu, config
    peak = gpu.peak_tflops(tr.precision)
    peak16 = gpu.peak_tflops("bf16") if tr.precision == "fp8" else peak
    tp, cp = lay.tp, lay.cp
    sp = tp > 1 and tr.sequence_parallel
    r = tp if sp else 1
    elem = 4 if tr.precision == "fp32" else 2
    s = tr.seq_length
    t = lay.mbs * s // cp  # tokens on this rank
    h, n, kvd = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    f = flops_spec(c).ffn_hidden_size  # the active MLP width (MoE: top-k experts + shared)
    out = _Costs()
    gemm = sum(gemm_time(t, nn, k, gpu=gpu, peak_tflops=peak) for nn, k in (((n + 2 * kvd) // tp, h), (h, n // tp)))
    gemm += mlp_gemm_time(c, t=t, tp=tp, ep=lay.ep, gpu=gpu, peak_tflops=peak)
    out.add("gemm", gemm, 2 * gemm)  # backward: input and weight gradients, the same shapes
    if tr.attention == "flash":
        attn_flops = 4 * lay.mbs * (s // cp) * s * (n // tp) * 0.5  # causal: on average half the keys
        attn = attn_flops / (gpu.attention_efficiency * peak16 * 1e12)
        out.add("attention", attn, 2.5 * attn)
    else:  # two batched GEMMs over the full s x s scores, then per score element: write, softmax read and
        # write, dropout read, write and its mask, read by the second GEMM (13 bytes in bf16); backward twice
        scores = lay.mbs * (s // cp) * s * (c.num_heads // tp)
        bmm = 4 * scores * c.head_dim / (gpu.gemm_efficiency * peak16 * 1e12)
        soft = scores * (6 * elem + 1) / (gpu.act_gbps * 1e9)
        attn = bmm + soft
        out.add("attention", attn, 2 * attn)
    act = (3 if c.gated else 2) * f
    mem = elem * t * (10 * h / r + (2 * (n + kvd) + act) / tp) / (gpu.act_gbps * 1e9)
    out.add("memory_bound", mem, 2 * mem)
    shapes = ((n + 2 * kvd) // tp, h), (h, n // tp)
    tpc, tpc_bwd, ring_gemm = tp_layer_comm(c, t=t, tp=tp, sp=sp, elem=elem, tr=tr, cluster=cluster, peak=peak,
                                            attn_shapes=shapes)
    out.add("tp_comm", tpc, tpc_bwd)
    if ring_gemm:  # the ring's GEMMs in tp chunks of t / tp rows: each chunk pays the per-GEMM overhead
        out.add("gemm", ring_gemm, 2 * ring_gemm)
    ep_fwd = 0.0  # the forward's token all-to-alls (seconds), which full recompute runs again
    if lay.ep > 1 and c.num_experts:  # the token all-to-all of each MoE layer (layers averaged)
        a2a = moe_dispatch_bytes(c, tokens=t, ep=lay.ep, elem=elem)
        moe = moe_layer_fraction(c)
        ep_fwd = moe * 2 * alltoall_time(a2a, lay.ep, cluster.link(lay.ep * lay.tp * lay.cp * lay.pp))
        out.add("ep_comm", ep_fwd, ep_fwd)  # forward: dispatch and combine; backward: their gradients
    ring_fwd = 0.0  # the forward ring's exposed seconds, which every recompute mode runs again (attention is in both)
    if cp > 1:  # ring attention: K and V chunks pass cp - 1 times; backward: K/V again cp - 1 times, and
        # their gradients cp times (back to the owner) in float32 for bf16 / fp16 (parallel/context_parallel/ring.py)
        kv_bytes = 2 * elem * t * kvd // tp
        link = cluster.link(tp * cp)
        ring = (cp - 1) * collective_time("send", kv_bytes, 2, link)
        ring_bwd = ring + cp * collective_time("send", 2 * max(elem, 4) * t * kvd // tp, 2, link)
        ring_fwd = max(0.0, ring - attn)
        out.add("cp_comm_exposed", ring_fwd, max(0.0, ring_bwd - 2.5 * attn))
    # Recompute re-runs a forward inside the backward, its communication included (the ledgers: with cp 2 the
    # backward's ring sends grow by the forward's under selective and full; with ep 2 full recompute's backward
    # runs the forward's dispatch and combine again, 12 all-to-alls where none runs 6).
    if tr.recompute == "selective":  # core attention again: with cp > 1 its K/V ring too
        out.add("recompute", 0.0, attn + ring_fwd)
    elif tr.recompute == "full":  # the layer's forward again: TP collectives, the ring, the all-to-alls
        out.add("recompute", 0.0, gemm + ring_gemm + attn + mem + tpc + ring_fwd + ep_fwd)
    return out


def stage_costs(model, lay: Layout, tr: Training, cluster: Cluster) -> list[_Costs]:
    """Per virtual stage (pp * vp of them): its layers, plus the embedding on the first and the output
    layer and loss on the last."""
    c = model.config
    gpu = cluster.gpu
    peak = gpu.peak_tflops(tr.precision)
    elem = 4 if tr.precision == "fp32" else 2
    t = lay.mbs * tr.seq_length // lay.cp
    h = c.hidden_size
    stages = lay.pp * lay.vp
    ranges = split_layers(c.num_layers, stages)
    one = layer_costs(c, lay, tr, cluster)
    vocab_local = c.padded_vocab_size(tp=lay.tp, make_vocab_size_divisible_by=model.hook.make_vocab_size_divisible_by
                                      ) // lay.tp
    link = cluster.link(lay.tp)
    act_bytes = elem * t * h
    host = gpu.host_op_us * 1e-6
    ops = model.host_ops if host else None
    if ops is not None and ops.recompute != tr.recompute:
        raise ValueError(f"the model's host op counts were taken with recompute {ops.recompute!r}, the plan is for "
                         f"{tr.recompute!r}: count them again (engine/planner/calibrate.py count_host_ops)")
    out = []
    for st, (a, b) in enumerate(ranges):
        costs = one.scaled(b - a)
        if ops is not None:  # the host's cost of every framework op (CPU: synchronous with the compute)
            first, last = st == 0, st == stages - 1
            n_fwd = (b - a) * ops.layer_fwd + first * ops.first_fwd + last * ops.last_fwd
            n_bwd = (b - a) * ops.layer_bwd + first * ops.first_bwd + last * ops.last_bwd
            costs.add("host_ops", n_fwd * host, n_bwd * host)
        if st == 0:
            extra = _Costs()
            extra.add("memory_bound", 2 * act_bytes / (gpu.act_gbps * 1e9), 2 * act_bytes / (gpu.act_gbps * 1e9))
            comm = collective_time("reduce_scatter" if lay.tp > 1 else "all_reduce", act_bytes, lay.tp, link)
            extra.add("tp_comm", comm, collective_time("all_gather", act_bytes / lay.tp, lay.tp, link))
            costs = costs.merged(extra)
        if st == stages - 1:
            extra = _Costs()
            logits = gemm_time(t, vocab_local, h, gpu=gpu, peak_tflops=peak)
            extra.add("gemm", logits, 2 * logits)
            ce = t * vocab_local * (elem + 12) / (gpu.act_gbps * 1e9)  # logits, fp32 softmax, its gradient
            extra.add("memory_bound", ce, ce)
            comm = collective_time("all_gather", act_bytes / lay.tp, lay.tp, link)
            extra.add("tp_comm", comm, collective_time("reduce_scatter", act_bytes, lay.tp, link))
            costs = costs.merged(extra)
        out.append(costs)
    return out


def pipeline_p2p_time(config, lay: Layout, tr: Training, cluster: Cluster, *, elem: int) -> float:
    """Seconds of one stage-to-stage activation transfer over the link the pp group spans: with sequence
    parallelism each TP rank sends its (s/tp, b, h) shard; without, the whole activation, unless
    ``tr.p2p_scatter_gather`` (Narayanan et al. 2021, Sec. 4.1): each TP rank sends 1/tp of it over its own
    NIC and the receiver all-gathers it over NVLink."""
    if lay.pp == 1:
        return 0.0
    full = elem * lay.mbs * tr.seq_length // lay.cp * config.hidden_size
    link = cluster.link(lay.tp * lay.cp * lay.pp)
    if lay.tp > 1 and tr.sequence_parallel:
        return collective_time("send", full // lay.tp, 2, link)
    if lay.tp > 1 and tr.p2p_scatter_gather:
        return (collective_time("send", full // lay.tp, 2, link)
                + collective_time("all_gather", full // lay.tp, lay.tp, cluster.link(lay.tp)))
    return collective_time("send", full, 2, link)


def rank_numel(model, lay: Layout, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) parameters pipeline rank ``pp_rank`` holds, TP-local, at ``lay.ep`` (1/ep of each MoE
    layer's experts; unpadded: the padding of a DataParallel buffer is at most dp elements per bucket)."""
    from engine.memory import stage_param_sizes
    from parallel.pipeline.actions import rank_stages

    ranges = split_layers(model.config.num_layers, lay.pp * lay.vp)
    placement = schedule("interleaved" if lay.vp > 1 else "1f1b", pp=lay.pp, vp=lay.vp,
                         microbatches=lay.pp).placement
    sizes = [(n, expert) for st in rank_stages(pp_rank, pp=lay.pp, vp=lay.vp, placement=placement)
             for _, n, _, expert in stage_param_sizes(model.hook, tp=lay.tp, ep=lay.ep, layer_range=ranges[st],
                                                      pre_process=st == 0, post_process=st == lay.pp * lay.vp - 1)]
    return sum(n for n, e in sizes if not e), sum(n for n, e in sizes if e)


def predict(model, lay: Layout, tr: Training, cluster: Cluster, *, steady_state: bool = True) -> Prediction:
    """The prediction of one layout (ValueError: the layout is illegal; the message says why).
    ``steady_state=False`` walks and simulates every micro-batch (slow; the tests compare the two)."""
    if lay.ep > 1:  # the trainer's rule, with the planner's fix (before the run config's own refusal)
        model.hook.check_expert_parallel(lay.ep)
    world = lay.tp * lay.pp * lay.cp * lay.dp
    dtype = "fp32" if tr.precision == "fp32" else "bf16"
    cfg = model.run_config(tp=lay.tp, pp=lay.pp, vp=lay.vp, dp=lay.dp, cp=lay.cp, mbs=lay.mbs,
                           gbs=tr.global_batch_size, seq=tr.seq_length, recompute=tr.recompute, zero=tr.zero,
                           dtype=dtype, fp8=tr.precision == "fp8", ep=lay.ep, sequence_parallel=tr.sequence_parallel,
                           tp_overlap=tr.tp_overlap if tr.tp_overlap in ("ring", "symm_mem") and lay.tp > 1 else "none",
                           overlap_param_gather=tr.overlap_param_gather)
    model.config.check_tensor_parallel(lay.tp)
    m = cfg.num_microbatches(lay.dp)
    # Past the warm-up, each further micro-batch repeats the steady state: the peak memory and the in-flight
    # count are reached within m_sim = pp * (vp + 3) micro-batches (above every rank's warm-up, 1F1B's and
    # interleaved 1F1B's), and each micro-batch beyond adds one forward and backward of the busiest rank's
    # stages. Simulating m_sim keeps plans of thousands of micro-batches fast; tests/engine/test_planner.py
    # checks both against the full schedule.
    m_sim = min(m, lay.pp * (lay.vp + 3)) if steady_state else m
    if m_sim != m:  # the same validated config with fewer micro-batches (re-parsing it costs more than all else)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=m_sim * lay.dp * lay.mbs))
    memory = predict_memory(cfg, model.hook, world=world, device=cluster.device, schedules=schedule)
    costs = stage_costs(model, lay, tr, cluster)
    elem = 4 if dtype == "fp32" else 2
    p2p = pipeline_p2p_time(model.config, lay, tr, cluster, elem=elem)
    if tr.p2p_blocking and lay.pp > 1:  # each action waits for its output's transfer (and the receiver with it)
        for st, cs in enumerate(costs):
            cs.add("pp_p2p_blocking", p2p if st < len(costs) - 1 else 0.0, p2p if st > 0 else 0.0)
        p2p = 0.0
    fwd = [sum(cs.fwd.values()) for cs in costs]
    bwd = [sum(cs.bwd.values()) for cs in costs]
    makespan, busy = pipeline_time(cfg.parallel.schedule, pp=lay.pp, vp=lay.vp, microbatches=m_sim, fwd=fwd,
                                   bwd=bwd, p2p=p2p)
    per_mb = [b / m_sim for b in busy]
    makespan += (m - m_sim) * max(per_mb)
    busy = [b * m for b in per_mb]
    # the busiest pipeline rank: its stages' work over all micro-batches, by kind
    rank_of = [st % lay.pp for st in range(lay.pp * lay.vp)]
    busiest = max(range(lay.pp), key=lambda r: busy[r])
    kinds: dict = {}
    for st, cs in enumerate(costs):
        if rank_of[st] != busiest:
            continue
        for d in (cs.fwd, cs.bwd):
            for k, v in d.items():
                kinds[k] = kinds.get(k, 0.0) + v * m
    # data parallel: bytes of the rank's gradient buffer (engine/memory.py's padded layout)
    big = memory.ranks[busiest]
    dpr = lay.dp * lay.cp  # DataParallel's group (mesh.dp_cp): gradients reduce, and ZeRO shards, over dp x cp
    total = big.grads // 4 if tr.zero < 2 or dpr == 1 else big.grads * dpr // 4
    # The groups' links (mesh order dp-pp-cp-tp, tp innermost): with dp > 1 the dp x cp group spans the world;
    # at dp 1 it is the cp group, tp x cp consecutive ranks (NVLink when those fit in a node). The experts'
    # edp group (dp indices spaced by ep, x cp) likewise is the cp group when dp / ep = 1.
    link = cluster.link(world if lay.dp > 1 else lay.tp * lay.cp)
    elink = cluster.link(world if lay.dp // lay.ep > 1 else lay.tp * lay.cp)
    rank_fwd = sum(fwd[st] for st in range(len(fwd)) if rank_of[st] == busiest)
    rank_bwd = sum(bwd[st] for st in range(len(bwd)) if rank_of[st] == busiest)
    dp_hidden = dp_exposed = 0.0
    gb = tr.grad_reduce_bytes
    # with ep > 1 DataParallel keeps the experts in a buffer of their own, reduced (and, with ZeRO, sharded and
    # gathered) over edp = dp x cp / ep, the dense one over dp x cp (docs/moe.md, engine/memory.py)
    dense, experts = (total, 0) if lay.ep == 1 else rank_numel(model, lay, busiest)
    edp = dpr // lay.ep
    if dpr > 1:
        if tr.zero == 0:
            grad = (collective_time("all_reduce", gb * dense, dpr, link)
                    + collective_time("all_reduce", gb * experts, edp, elink))
            gather, gather_room = 0.0, 0.0
        elif tr.zero < 3:
            grad = (collective_time("reduce_scatter", gb * dense, dpr, link)
                    + collective_time("reduce_scatter", gb * experts, edp, elink))
            gather = (collective_time("all_gather", elem * dense // dpr, dpr, link)
                      + collective_time("all_gather", elem * experts // edp, edp, elink))
            # optim.overlap_param_gather: each bucket's gather waited for by the first forward that needs it
            # (under that forward's earlier layers); without it, right after the update (Tessel's default)
            gather_room = rank_fwd if cfg.optim.overlap_param_gather else 0.0
        else:  # ZeRO 3 (parallel/data_parallel/zero3.py): each micro-batch's gradients reduce-scattered after its
            # backward; every layer unit gathered in every forward and again in its backward (2 m times a step),
            # the root unit (embedding, final norm, output layer) once per forward that finds it free: it stays
            # gathered while any forward of its chunk awaits its backward, k times a step (root_gathers)
            grad = m * (collective_time("reduce_scatter", gb * dense, dpr, link)
                        + collective_time("reduce_scatter", gb * experts, edp, elink))
            root = dp_buffer_numel(cfg, model.hook, world=world, pp_rank=busiest)[3]  # the root unit's elements
            layers = max(0, dense - root)  # the layer units' dense elements (padded buffer less the root)
            k = root_gathers(cfg.parallel.schedule, pp=lay.pp, vp=lay.vp, m=m, m_sim=m_sim, pp_rank=busiest)
            gather = (2 * m * (collective_time("all_gather", elem * layers // dpr, dpr, link)
                               + collective_time("all_gather", elem * experts // edp, edp, elink))
                      + k * collective_time("all_gather", elem * root // dpr, dpr, link))
            gather_room = m * (rank_fwd + rank_bwd)  # under all the compute
            rank_bwd *= m
        if not tr.dp_overlap:  # reduced after the last backward, gathered after the update
            rank_bwd = gather_room = 0.0
        dp_hidden = min(grad, rank_bwd) + min(gather, gather_room)
        dp_exposed = max(0.0, grad - rank_bwd) + max(0.0, gather - gather_room)
    owned = dense // dpr + experts // edp if tr.zero >= 1 else dense + experts
    # AdamW reads the fp32 gradient, master and moments and writes them back with the low-precision
    # parameter (28 + elem bytes per owned element), the gradient norm reads the gradients once more (4), and
    # the next step starts from a zeroed fp32 gradient buffer (4 bytes per element held)
    grads_held = big.grads // 4
    optimizer = (owned * (28 + elem + 4) + 4 * grads_held) / (cluster.gpu.hbm_gbps * 1e9)
    # tied embeddings at pp > 1: the trainer all-reduces the first stage's embedding and the last stage's output
    # layer gradients, (V / tp, h) each, over the 2-rank embedding group (same dp, cp, tp coordinates: the two
    # ends of the pp span) after the pipeline and before the optimizer, every step: exposed
    # (parallel/pipeline/runtime.py allreduce_tied_embedding_grads; fp32 main_grad in Tessel: the ledger's
    # 2 x 4 V h bytes at the tiny preset's pp 2)
    tied = 0.0
    if model.config.tie_word_embeddings and lay.pp > 1:
        vocab_local = model.config.padded_vocab_size(
            tp=lay.tp, make_vocab_size_divisible_by=model.hook.make_vocab_size_divisible_by) // lay.tp
        tied = collective_time("all_reduce", gb * vocab_local * model.config.hidden_size, 2,
                               cluster.link(lay.tp * lay.cp * lay.pp))
    step = makespan + dp_exposed + optimizer + tied
    kinds.update(pp_bubble_and_p2p=makespan - busy[busiest], dp_comm_exposed=dp_exposed,
                 dp_comm_overlapped=dp_hidden, optimizer=optimizer)
    if tied:
        kinds["tied_embedding_comm"] = tied
    spec = flops_spec(model.config)
    gbs, s = tr.global_batch_size, tr.seq_length
    flops = model_flops_per_step(spec, batch_size=gbs, seq_length=s)
    causal = model_flops_per_step(spec, batch_size=gbs, seq_length=s, causal=True)
    peak = cluster.gpu.peak_tflops(tr.precision) * 1e12
    tflops = flops / step / world
    fits = memory.largest.total <= cluster.capacity_bytes
    return Prediction(layout=lay, memory=memory, step_time_s=step, tflops_per_gpu=tflops / 1e12, mfu=tflops / peak,
                      mfu_causal=causal / step / world / peak, fits=fits, breakdown=kinds)
