"""Published large runs the planner must reproduce (``tools/plan.py --validate``; docs/planner.md).

Each row: the model, layout and batch as the source states them, the reported figure, where both are
from, and the software the run used (:class:`Setup`: what its code did, per the source or the code of the
time). The planner predicts the row's step time; the reported figure is compared in the source's own FLOP
definition (``flops``): "model" = Korthikanti et al. 2022 Eq. 7 / Megatron-LM's count (full s^2 attention,
no recompute: Tessel's ``mfu``), "eq3" = Narayanan et al. 2021 Eq. 3 (full recompute's extra forward
counted). A row passes within ``TOLERANCE``. What a source does not state (the micro-batch size, the
number of interleaved chunks, the recompute mode of the H100 runs) the planner chooses as it would for a
user: its fastest layout that fits, over exactly those knobs (the authors tuned theirs); the choice is
printed. Only figures found in the sources are listed (docs/planner.md cites each table).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from engine.metrics import model_flops_per_step
from engine.planner.hardware import gpu as gpu_by_name
from engine.planner.model import from_dims
from engine.planner.predict import Cluster, Layout, Training, predict
from models.hook import flops_spec

TOLERANCE = 0.15  # relative error of the predicted TFLOP/s per GPU
REQUIRED_SHARE = 0.80  # of the rows

NARAYANAN_T1 = ("Narayanan et al. 2021 (arXiv:2104.04473), Table 1; also the Megatron-LM README of April 2021, "
                "github.com/NVIDIA/Megatron-LM images/cases_april2021.png at 50a4b5fa02")
KORTHIKANTI_T5 = ("Korthikanti et al. 2022 (arXiv:2205.05198), Table 5 (MFU, 'present work'); Table 3 "
                  "(configurations); also the Megatron-LM README of May 2022 (2e90a342f5)")
KORTHIKANTI_T5_FULL = ("Korthikanti et al. 2022 (arXiv:2205.05198), Table 5 (iteration time, 'full recompute'); "
                       "Table 3 (configurations)")
KORTHIKANTI_DP8 = "Korthikanti et al. 2022 (arXiv:2205.05198), Sec. 6.3 (530B at 8-way data parallelism)"
MEGATRON_H100 = ("Megatron-LM README of July 2024, github.com/NVIDIA/Megatron-LM images/model_table.png at "
                 "937571cfd4 (text: vocabulary 131,072, sequence 4096, H100)")


@dataclass(frozen=True, kw_only=True)
class Setup:
    """The software of a group of runs. ``recompute``/``vp``/``mbs`` None: not stated, the planner picks."""

    name: str
    flops: str  # "model" or "eq3"
    recompute: str | None
    sequence_parallel: bool
    attention: str
    tp_overlap: str
    dp_overlap: bool
    grad_reduce_bytes: int
    p2p_scatter_gather: bool
    p2p_blocking: bool
    zero: int
    interleaved: bool | None  # rows without vp: True interleave where the layers allow, None not stated
    why: str


# Megatron-LM as Narayanan et al. 2021 ran it (the April 2021 release, 50a4b5fa02): full activation
# recompute ("equation (3) assumes activation recomputation"), no sequence parallelism, attention with the
# fused scale-mask-softmax kernel (scores materialised), the interleaved schedule with the scatter/gather
# p2p optimisation ("we use the interleaved pipeline schedule with the scatter/gather optimization
# enabled"), gradients all-reduced after the backward (training.py's allreduce_gradients() after the
# micro-batches) in the parameter dtype (--accumulate-allreduce-grads-in-fp32 off by default), no
# sharded optimizer.
MEGATRON_2021 = Setup(name="Megatron-LM 2021", flops="eq3", recompute="full", sequence_parallel=False,
                      attention="unfused", tp_overlap="none", dp_overlap=False, grad_reduce_bytes=2,
                      p2p_scatter_gather=True, p2p_blocking=True, zero=0, interleaved=True,
                      why="Narayanan et al. 2021 Sec. 5.1, Eq. 3; Megatron-LM 50a4b5fa02 arguments.py, training.py")
# Korthikanti et al. 2022: sequence parallelism + selective recompute ("present work"), the column-parallel
# backward's reduction under the weight-gradient GEMM ("we overlap all-reduce communication with the linear
# weight's gradient computation", Sec. 6.2), no overlap of the data-parallel all-reduce ("we do not use any
# overlapping of gradient all-reduces with back-propagation", Sec. 6.3), interleaving with 3 chunks for
# 175B and 530B (Sec. 6), bf16 gradients reduced in fp32 (Megatron-LM 2e90a342f5 arguments.py).
MEGATRON_2022 = Setup(name="Megatron-LM 2022", flops="model", recompute="selective", sequence_parallel=True,
                      attention="unfused", tp_overlap="async_backward", dp_overlap=False, grad_reduce_bytes=4,
                      p2p_scatter_gather=False, p2p_blocking=True, zero=0, interleaved=False,
                      why="Korthikanti et al. 2022 Sec. 5, 6, Table 3")
# The same paper's baseline: full recompute without sequence parallelism (Table 5 'full recompute').
MEGATRON_2022_FULL = Setup(name="Megatron-LM 2022, full recompute", flops="model", recompute="full",
                           sequence_parallel=False, attention="unfused", tp_overlap="async_backward",
                           dp_overlap=False, grad_reduce_bytes=4, p2p_scatter_gather=True, p2p_blocking=True, zero=0,
                           interleaved=False, why="Korthikanti et al. 2022 Sec. 6.3, Table 5")
# Megatron-Core of July 2024 (README): data-parallel reduction and parameter gather overlapped
# (--overlap-grad-reduce --overlap-param-gather: the distributed optimizer, ZeRO-1), tensor-parallel
# communication overlapped (--tp-comm-overlap, modelled as Tessel's ring), flash attention (Transformer
# Engine), bf16 (MFU against 989 TFLOP/s). Recompute, micro-batch and interleaving are not stated.
MCORE_2024 = Setup(name="Megatron-Core 2024", flops="model", recompute=None, sequence_parallel=True,
                   attention="flash", tp_overlap="ring", dp_overlap=True, grad_reduce_bytes=4,
                   p2p_scatter_gather=False, p2p_blocking=False, zero=1, interleaved=None,
                   why="Megatron-LM README 937571cfd4 ('Training Speed and Scalability')")


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    name: str
    gpu: str
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    seq_length: int
    global_batch_size: int
    tp: int
    pp: int
    dp: int
    setup: Setup
    mbs: int | None = None  # None: not stated
    vp: int | None = None
    tied_embeddings: bool = True
    reported_tflops: float | None = None  # per GPU, as printed
    reported_mfu: float | None = None
    reported_step_s: float | None = None
    source: str

    def __post_init__(self):
        if sum(x is not None for x in (self.reported_tflops, self.reported_mfu, self.reported_step_s)) != 1:
            raise ValueError(f"{self.name}: give exactly one reported figure")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def flops_per_step(self) -> float:
        """FLOPs of one step in the source's definition."""
        B, s, l, h, V = self.global_batch_size, self.seq_length, self.num_layers, self.hidden_size, self.vocab_size
        if self.setup.flops == "eq3":  # Narayanan et al. 2021 Eq. 3: 96 B s l h^2 (1 + s / 6h + V / 16 l h)
            return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        return model_flops_per_step(flops_spec(self.model().config), batch_size=B, seq_length=s)

    @property
    def reported_tflops_per_gpu(self) -> float:
        if self.reported_tflops is not None:
            return self.reported_tflops
        if self.reported_mfu is not None:
            return self.reported_mfu * gpu_by_name(self.gpu).bf16_tflops
        return self.flops_per_step() / self.reported_step_s / self.world / 1e12

    def model(self):
        return from_dims(family="gpt2", hidden_size=self.hidden_size, num_layers=self.num_layers,
                         num_heads=self.num_heads, vocab_size=self.vocab_size, max_positions=self.seq_length,
                         tie_word_embeddings=self.tied_embeddings)


def _narayanan(name, heads, h, layers, tp, pp, gpus, batch, tflops):
    return PublishedRun(name=name, gpu="a100-80gb", hidden_size=h, num_layers=layers, num_heads=heads,
                        vocab_size=51200, seq_length=2048, global_batch_size=batch, tp=tp, pp=pp,
                        dp=gpus // (tp * pp), setup=MEGATRON_2021, reported_tflops=tflops, source=NARAYANAN_T1)


def _korthikanti(name, heads, h, layers, pp, gpus, batch, mbs, vp, setup, source, **reported):
    return PublishedRun(name=name, gpu="a100-80gb", hidden_size=h, num_layers=layers, num_heads=heads,
                        vocab_size=51200, seq_length=2048, global_batch_size=batch, tp=8, pp=pp,
                        dp=gpus // (8 * pp), mbs=mbs, vp=vp, setup=setup, source=source, **reported)


def _h100(name, heads, h, layers, tp, pp, dp, gpus, batch, tflops):
    assert tp * pp * dp == gpus, name
    # GPT with f = 4h and separate input and output embeddings: the table's parameter counts (1.7B ... 462B)
    return PublishedRun(name=name, gpu="h100-sxm", hidden_size=h, num_layers=layers, num_heads=heads,
                        vocab_size=131072, seq_length=4096, global_batch_size=batch, tp=tp, pp=pp, dp=dp,
                        tied_embeddings=False, setup=MCORE_2024, reported_tflops=tflops, source=MEGATRON_H100)


# Korthikanti Table 5 gives MFU for the present work and iteration times for both columns; "interleaving
# schedule with three interleaving stages" for 175B and 530B (Sec. 6), not for 22B (pp 1) and 1T.
_K = [("GPT-22B", 64, 6144, 48, 1, 8, 4, 4, 1, 0.415, 1.42), ("GPT-175B", 96, 12288, 96, 8, 64, 64, 1, 3, 0.514, 18.13),
      ("GPT-530B", 128, 20480, 105, 35, 280, 280, 1, 3, 0.560, 49.05),
      ("GPT-1T", 160, 25600, 128, 64, 512, 512, 1, 1, 0.563, 94.42)]

PUBLISHED: tuple[PublishedRun, ...] = (
    # Narayanan et al. 2021, Table 1: heads, hidden, layers, tp, pp, GPUs, batch, achieved teraFLOP/s per GPU
    _narayanan("N21-1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _narayanan("N21-3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    _narayanan("N21-7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    _narayanan("N21-18B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _narayanan("N21-39B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _narayanan("N21-76B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _narayanan("N21-145B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _narayanan("N21-310B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _narayanan("N21-530B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _narayanan("N21-1T", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    # Korthikanti et al. 2022: Table 3 configurations, Table 5 present work (MFU) and full recompute (seconds)
    *(_korthikanti(f"K22-{n[4:]}", a, h, l, pp, g, b, m, v, MEGATRON_2022, KORTHIKANTI_T5, reported_mfu=mfu)
      for n, a, h, l, pp, g, b, m, v, mfu, _ in _K),
    *(_korthikanti(f"K22-{n[4:]}-full", a, h, l, pp, g, b, m, v, MEGATRON_2022_FULL, KORTHIKANTI_T5_FULL,
                   reported_step_s=t) for n, a, h, l, pp, g, b, m, v, _, t in _K),
    _korthikanti("K22-530B-dp8", 128, 20480, 105, 35, 2240, 2240, 1, 3, MEGATRON_2022, KORTHIKANTI_DP8,
                 reported_step_s=39.15),
    # Megatron-LM README (July 2024), H100: heads, hidden, layers, tp, pp, dp, GPUs, batch, per-GPU teraFLOP/s
    _h100("M24-1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8),
    _h100("M24-7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
    _h100("M24-16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1),
    _h100("M24-32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
    _h100("M24-70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
    _h100("M24-119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
    _h100("M24-177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
    _h100("M24-314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
    _h100("M24-462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
)


@dataclass(frozen=True)
class RowResult:
    run: PublishedRun
    predicted_tflops: float
    step_time_s: float
    memory_gib: float
    fits: bool
    choice: dict  # the knobs the source does not state, as the planner chose them

    @property
    def error(self) -> float:
        return (self.predicted_tflops - self.run.reported_tflops_per_gpu) / self.run.reported_tflops_per_gpu

    @property
    def ok(self) -> bool:
        return abs(self.error) <= TOLERANCE


def _options(run: PublishedRun):
    """(mbs, vp, recompute) candidates: the stated value, else every one the layout allows."""
    s = run.setup
    m_per_replica = run.global_batch_size // run.dp
    mbs = [run.mbs] if run.mbs else [b for b in (1, 2, 4) if m_per_replica % b == 0]
    # Megatron-LM interleaves any whole number of layers per virtual stage (--num-layers-per-virtual-pipeline-stage)
    legal = [v for v in range(2, run.num_layers // run.pp + 1) if run.pp > 1 and run.num_layers % (run.pp * v) == 0]
    if run.vp is not None:
        vps = [run.vp]
    elif s.interleaved is None:
        vps = [1, *legal]
    else:
        vps = (legal or [1]) if s.interleaved else [1]
    recompute = [s.recompute] if s.recompute else ["none", "selective", "full"]
    for b, v, r in itertools.product(mbs, vps, recompute):
        if v > 1 and (m_per_replica // b) % run.pp:
            continue  # interleaved 1F1B runs micro-batches in groups of pp
        yield b, v, r


def predict_row(run: PublishedRun) -> RowResult:
    """The planner's step time for the row (its fastest fitting choice of the knobs not stated)."""
    model = run.model()
    cluster = Cluster(gpu=gpu_by_name(run.gpu), nodes=max(1, run.world // 8), gpus_per_node=min(8, run.world))
    s = run.setup
    best = None
    for mbs, vp, recompute in _options(run):
        tr = Training(seq_length=run.seq_length, global_batch_size=run.global_batch_size, recompute=recompute,
                      zero=s.zero, attention=s.attention, tp_overlap=s.tp_overlap if run.tp > 1 else "none",
                      sequence_parallel=s.sequence_parallel, dp_overlap=s.dp_overlap,
                      grad_reduce_bytes=s.grad_reduce_bytes, p2p_scatter_gather=s.p2p_scatter_gather,
                      p2p_blocking=s.p2p_blocking,
                      # a distributed optimizer's parameter gather overlaps as its reduction does (Megatron-Core's
                      # --overlap-grad-reduce --overlap-param-gather)
                      overlap_param_gather=s.dp_overlap if s.zero in (1, 2) else None)
        try:
            p = predict(model, Layout(tp=run.tp, pp=run.pp, vp=vp, dp=run.dp, cp=1, mbs=mbs), tr, cluster)
        except ValueError:
            continue
        key = (not p.fits, p.step_time_s)
        if best is None or key < best[0]:
            best = key, p, dict(mbs=mbs, vp=vp, recompute=recompute)
    if best is None:
        raise ValueError(f"{run.name}: no layout of the row is legal in the planner")
    _, p, choice = best
    tflops = run.flops_per_step() / p.step_time_s / run.world / 1e12
    return RowResult(run=run, predicted_tflops=tflops, step_time_s=p.step_time_s,
                     memory_gib=p.memory_bytes / 2 ** 30, fits=p.fits, choice=choice)


def validate(rows=PUBLISHED) -> tuple[list[RowResult], bool]:
    """(each row's result, whether at least REQUIRED_SHARE of the rows are within TOLERANCE)."""
    results = [predict_row(r) for r in rows]
    return results, passed([r.ok for r in results])


def passed(oks) -> bool:
    oks = list(oks)
    return bool(oks) and sum(oks) >= REQUIRED_SHARE * len(oks)


def main_validate(*, json_path: str | None = None) -> int:
    """``tools/plan.py --validate``: one line per row, the share within tolerance; exit 0 if it passes."""
    import json
    import sys

    results, ok = validate()
    print(f"{'run':<14} {'GPUs':>5} {'tp':>3} {'pp':>3} {'dp':>4} {'mbs':>3} {'vp':>3} {'recompute':>9} "
          f"{'reported':>9} {'predicted':>9} {'error':>7}  setup")
    for r in results:
        c = r.choice
        print(f"{r.run.name:<14} {r.run.world:>5} {r.run.tp:>3} {r.run.pp:>3} {r.run.dp:>4} {c['mbs']:>3} "
              f"{c['vp']:>3} {c['recompute']:>9} {r.run.reported_tflops_per_gpu:>9.1f} {r.predicted_tflops:>9.1f} "
              f"{100 * r.error:>+6.1f}%  {r.run.setup.name}" + ("" if r.fits else " (no fit)"))
    within = sum(r.ok for r in results)
    print(f"{within} of {len(results)} rows within {100 * TOLERANCE:.0f}% (needed: {100 * REQUIRED_SHARE:.0f}%): "
          + ("PASS" if ok else "FAIL") + "; TFLOP/s per GPU in each source's FLOP count")
    if json_path:
        doc = {"tolerance": TOLERANCE, "passed": ok, "rows": [
            {"name": r.run.name, "gpu": r.run.gpu, "tp": r.run.tp, "pp": r.run.pp, "dp": r.run.dp, **r.choice,
             "setup": r.run.setup.name, "flops": r.run.setup.flops, "fits": r.fits,
             "reported_tflops_per_gpu": r.run.reported_tflops_per_gpu, "predicted_tflops_per_gpu": r.predicted_tflops,
             "predicted_step_time_s": r.step_time_s, "relative_error": r.error, "source": r.run.source}
            for r in results]}
        text = json.dumps(doc, indent=1)
        if json_path == "-":
            print(text, file=sys.stdout)
        else:
            with open(json_path, "w") as f:
                f.write(text + "\n")
    return 0 if ok else 1
