"""Microbenchmarks of the fused ops (engine/ops) at Llama-3 8B / 70B layer sizes (and 1B: Llama-3.2).

For every op and size it times forward, backward and forward+backward of:
  * ``tessel``  - the op's public function with backend="auto" (Triton on CUDA);
  * ``eager``   - the plain-PyTorch reference, the same one the tests compare against;
  * ``compile`` - torch.compile of that reference (inductor), compiled outside the timed region;
  * ``liger``   - Liger-Kernel's op, when ``liger_kernel`` is importable (GPU only).
Each row reports achieved GB/s of the op's minimum traffic (memory-bound ops) or model TFLOP/s
(linear + cross-entropy: 2*T*H*V forward, 4*T*H*V backward) per phase, the fraction of this
machine's ceiling measured in the same run (a device-to-device copy; a large matmul in the
run's ``--dtype``), the speed-up over ``eager``, and the peak extra memory of forward+backward,
gradients of the inputs included: on CUDA from the caching allocator's statistics, on CPU from the
profiler's record of every allocation and free of PyTorch's CPU allocator (``CPUMemoryPeak``).

CPU machines (no CUDA, or ``--cpu``) run a reduced mode: Llama-3 8B layer widths, 256 tokens, a
32768 vocab, linear + CE in 16 chunks (as 8192 tokens in chunks of 512 on the GPU), and only the
reference paths (``tessel`` only where its CPU path differs from ``eager``: the chunked linear +
cross-entropy). CPU times are the calling thread's CPU time with one torch thread (ceilings
measured the same way), so a busy shared machine does not distort them.

``--dtype`` (bf16 by default, the GPU case; or fp32) is the dtype of every op's inputs and of the
matmul ceiling. It exists for CPUs whose bf16 GEMM is far slower than their fp32 one (one
measured 0.00075 bf16 TFLOP/s on one thread); the ceiling line printed first shows which it is.

    python tools/bench_kernels.py [--cpu] [--models 8b 70b] [--ops rmsnorm swiglu rope linear_ce]
                                  [--tokens N] [--vocab N] [--ce-chunk N] [--dtype bf16|fp32]
                                  [--reps N] [--warmup N] [--no-compile] [--json PATH]
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.ops import fused_linear_ce, rmsnorm, rope, swiglu  # noqa: E402  (modules)

MODELS = {  # Llama-3 layer shapes (per device, no tensor parallelism); 1b is Llama-3.2 1B
    "1b": dict(hidden=2048, ffn=8192, heads=32, kv_heads=8, head_dim=64, vocab=128256),
    "8b": dict(hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256),
    "70b": dict(hidden=8192, ffn=28672, heads=64, kv_heads=8, head_dim=128, vocab=128256),
}
CPU_VOCAB = 32768
CPU_CE_CHUNKS = 16  # linear + CE chunks on CPU: the GPU default splits 8192 tokens into 16 of 512
OPS = ("rmsnorm", "swiglu", "rope", "linear_ce")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class QueueAhead:
    """``--timing queued``: keeps the GPU busy (``torch.cuda._sleep``) while the host issues a timed call,
    so the CUDA events around it measure the call's kernels back to back: device time, not the host's
    time to launch them. From an idle GPU a short op's events measure the host instead. The GPU
    machines here are virtual machines that took 45-100 us per launch (docs/fp8.md), against 0.1-0.5 ms
    for a whole fused op at these sizes. The sleep lasts twice the host's issue time of the previous call
    of the same op (:meth:`begin` starts an op), plus 0.5 ms, at most ``MAX_MS``: a first call that
    compiles (Triton, cuBLAS handles) does not lengthen every later sleep. It runs before the start
    event, outside the timed region. The sleep counts SM clock cycles, so the cycles per ms are measured
    again at each op's start (:meth:`begin`), on a GPU that has just been busy: an idle GPU's lower clock
    would make every later sleep shorter than asked."""

    MAX_MS = 50.0  # a call the host needs longer to issue is host-bound at any sleep

    def __init__(self, device: torch.device):
        self.cycles_per_ms = 0.0
        self.host_ms = 2.0  # the previous call's issue time; a guess until one is seen
        self.short = 0  # timed calls whose host issue took longer than the sleep queued ahead of them
        self.begin()

    def begin(self) -> None:
        """A new op: forget the previous op's issue time; measure the SM clock (cycles per ms) now."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(10 ** 6)  # first, its own launch outside the measurement
        start.record()
        torch.cuda._sleep(10 ** 7)
        end.record()
        end.synchronize()
        self.cycles_per_ms = 10 ** 7 / start.elapsed_time(end)
        self.host_ms = 2.0

    def ahead(self) -> float:
        """Queue the sleep; returns its length (ms)."""
        ms = min(2 * self.host_ms + 0.5, self.MAX_MS)
        torch.cuda._sleep(int(self.cycles_per_ms * ms))
        return ms

    def seen(self, host_ms: float, slept_ms: float, *, timed: bool) -> None:
        """A call took the host ``host_ms`` to issue behind a ``slept_ms`` sleep; ``timed``: a timed
        repetition (a warm-up's is only the next sleep's guide)."""
        self.host_ms = host_ms
        self.short += timed and host_ms > slept_ms


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int, reps: int,
            setup: Optional[Callable[[], object]] = None, queue: Optional[QueueAhead] = None) -> float:
    """Median time of ``fn(setup())`` in milliseconds, ``setup`` excluded. Without ``setup``,
    ``fn()`` is timed. GPU: CUDA events (the stream's time; with ``queue``, queued behind a sleep:
    the kernels' own time, see :class:`QueueAhead`). CPU: CPU time of the calling
    thread (``time.thread_time``) - the CPU mode runs torch with one intra-op thread, so this is all
    the work, and other processes on a shared machine do not inflate it as they do wall time."""
    def once(timed: bool = True):
        arg = setup() if setup is not None else None
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            slept = queue.ahead() if queue is not None else 0.0
            t0 = time.perf_counter()
            start.record()
            fn(arg) if setup is not None else fn()
            end.record()
            if queue is not None:
                queue.seen((time.perf_counter() - t0) * 1e3, slept, timed=timed)
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.thread_time()
        fn(arg) if setup is not None else fn()
        return (time.thread_time() - t0) * 1e3

    if queue is not None:
        queue.begin()
    for _ in range(warmup):
        once(timed=False)
    return statistics.median(once() for _ in range(reps))


def time_fwd_bwd(fwd: Callable[[], object], bwd: Callable[[object], object], device: torch.device, *,
                 warmup: int, reps: int, queue: Optional[QueueAhead] = None) -> tuple[float, float, float]:
    """Medians (ms) of the forward, the backward and their sum, all timed in the SAME repetitions, so
    ``total >= fwd`` and ``total >= bwd`` always hold (each repetition's sum dominates its parts, and
    medians keep that order). Timing as :func:`time_ms`."""
    def once(timed: bool = True) -> tuple[float, float]:
        _sync(device)
        if device.type == "cuda":
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            slept = queue.ahead() if queue is not None else 0.0
            t0 = time.perf_counter()
            events[0].record()
            outs = fwd()
            events[1].record()
            bwd(outs)
            events[2].record()
            if queue is not None:
                queue.seen((time.perf_counter() - t0) * 1e3, slept, timed=timed)
            events[2].synchronize()
            return events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2])
        t0 = time.thread_time()
        outs = fwd()
        t1 = time.thread_time()
        bwd(outs)
        t2 = time.thread_time()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    if queue is not None:
        queue.begin()
    for _ in range(warmup):
        once(timed=False)
    samples = [once() for _ in range(reps)]
    return (statistics.median(f for f, _ in samples), statistics.median(b for _, b in samples),
            statistics.median(f + b for f, b in samples))


def measure_ceilings(device: torch.device, *, reps: int, dtype: str = "bf16") -> dict:
    """Copy bandwidth (GB/s, read + write) and the matmul rate (TFLOP/s) in ``dtype`` (a DTYPES
    key: the dtype of the run's ops) of this device."""
    numel = (1 << 28) if device.type == "cuda" else (1 << 25)  # 1 GiB / 128 MiB of fp32
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), device, warmup=2, reps=reps)
    if device.type == "cuda":
        n = 8192
    else:  # 1024, smaller where a product would take over 0.1 s (bf16 on a CPU without bf16 units: 2.5 s)
        from engine.metrics import cpu_matmul_size

        n = cpu_matmul_size(DTYPES[dtype])
    a = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
    b = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
    mm_ms = time_ms(lambda: a @ b, device, warmup=2, reps=reps)
    return {"copy_GBps": 2 * numel * 4 / copy_ms / 1e6, "copy_bytes": 2 * numel * 4,
            f"matmul_{dtype}_TFLOPs": 2 * n ** 3 / mm_ms / 1e9, "matmul_n": n, "matmul_dtype": dtype}


# ----------------------------------------------------------------------------------------------
# Peak memory on CPU
# ----------------------------------------------------------------------------------------------
class CPUMemoryPeak:
    """Peak and net bytes allocated by PyTorch's CPU allocator inside a ``with`` block: ``peak_bytes``
    and ``end_bytes`` above what was live at ``__enter__`` (what ``torch.cuda.max_memory_allocated() -
    base`` is on a GPU). A thin adapter over :class:`engine.memory.PeakMemory`, which reads the allocator's
    own running total from the profiler's memory events (every thread of the process, frees on other
    threads included). It sees allocations inside custom ops, autograd and inductor-compiled code; not
    memory that libraries allocate themselves (BLAS / oneDNN scratch) or Python objects.
    """

    def __init__(self):
        if not torch.autograd.kineto_available():
            raise RuntimeError("CPUMemoryPeak needs the Kineto profiler, which this torch build lacks.")
        self.peak_bytes: Optional[int] = None
        self.end_bytes: Optional[int] = None
        self._mem = None

    def __enter__(self) -> "CPUMemoryPeak":
        from engine.memory import PeakMemory

        self._mem = PeakMemory("cpu").__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mem.__exit__(*exc)
        self.peak_bytes, self.end_bytes = self._mem.peak, self._mem.end
        self._mem = None


# ----------------------------------------------------------------------------------------------
# Cases: inputs, implementations, and the traffic / FLOP model of each op
# ----------------------------------------------------------------------------------------------
@dataclass
class Case:
    op: str  # the --ops name
    label: str  # what the table shows
    size: str
    inputs: list  # tensors that receive gradients
    grads: list  # upstream gradients, one per output
    impls: dict  # name -> callable(*inputs) -> output or tuple of outputs
    bytes_fwd: int = 0
    bytes_bwd: int = 0
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    extra: dict = field(default_factory=dict)


def _liger():
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return None
    return liger_kernel


def _rand(*shape, device, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def case_rmsnorm(m, tokens, device, gpu, *, dtype=torch.bfloat16, **_):
    h = m["hidden"]
    x, r = _rand(tokens, h, device=device, dtype=dtype), _rand(tokens, h, device=device, dtype=dtype)
    w = _rand(h, device=device, dtype=dtype, scale=0.1) + 1
    e = x.element_size()
    impls = {"eager": lambda x, r, w: rmsnorm.rms_norm_reference(x, w, 1e-5, residual=r)}
    if gpu:
        impls["tessel"] = lambda x, r, w: rmsnorm.rms_norm(x, w, 1e-5, residual=r)
        if rmsnorm.bwd_tile_rows(h) > 1:  # A/B: the backward a row at a time (its kernel before the tiles)
            impls["tessel_r1"] = lambda x, r, w: rmsnorm.rms_norm(x, w, 1e-5, residual=r, bwd_tile_rows=1)
        liger = _liger()
        if liger is not None:
            from liger_kernel.transformers import LigerRMSNorm

            liger_norm = LigerRMSNorm(h, eps=1e-5).to(device=device, dtype=w.dtype)

            def run_liger(x, r, w):  # w unused: the module's own weight takes the gradient
                hsum = x + r  # Liger has no fused residual add: add, then normalise
                return liger_norm(hsum), hsum
            impls["liger"] = run_liger
    return Case("rmsnorm", "rmsnorm+residual", "", [x, r, w], [torch.randn_like(x), torch.randn_like(x)],
                impls, bytes_fwd=4 * tokens * h * e, bytes_bwd=4 * tokens * h * e)


def case_swiglu(m, tokens, device, gpu, *, dtype=torch.bfloat16, **_):
    i = m["ffn"]
    x = _rand(tokens, 2 * i, device=device, dtype=dtype)
    e = x.element_size()
    impls = {"eager": swiglu.swiglu_reference}
    if gpu:
        impls["tessel"] = swiglu.swiglu
        if _liger() is not None:
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            impls["liger"] = lambda x: LigerSiLUMulFunction.apply(x[:, :i], x[:, i:])
    return Case("swiglu", "swiglu", "", [x], [_rand(tokens, i, device=device, dtype=dtype)], impls,
                bytes_fwd=3 * tokens * i * e, bytes_bwd=5 * tokens * i * e)


def case_rope(m, tokens, device, gpu, *, dtype=torch.bfloat16, **_):
    s, b = tokens, 1
    nh, nkv, hd = m["heads"], m["kv_heads"], m["head_dim"]
    q, k = _rand(s, b, nh, hd, device=device, dtype=dtype), _rand(s, b, nkv, hd, device=device, dtype=dtype)
    cos, sin = rope.rope_cos_sin(torch.arange(s, device=device), rope.rope_inv_freq(hd, 500000.0).to(device))
    e = q.element_size()
    impls = {"eager": lambda q, k: rope.apply_rope_reference(q, k, cos, sin)}
    if gpu:
        impls["tessel"] = lambda q, k: rope.apply_rope(q, k, cos, sin)
        if _liger() is not None:
            from liger_kernel.transformers.rope import liger_rotary_pos_emb

            hf_cos = torch.cat([cos, cos], -1)[None].to(q.dtype)  # (1, s, hd)
            hf_sin = torch.cat([sin, sin], -1)[None].to(q.dtype)
            # Liger wants (b, heads, s, hd); the layout change is part of what Tessel avoids.
            impls["liger"] = lambda q, k: liger_rotary_pos_emb(
                q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), hf_cos, hf_sin)
    traffic = 2 * s * b * (nh + nkv) * hd * e + 2 * s * (hd // 2) * 4
    return Case("rope", "rope(q+k)", "", [q, k], [torch.randn_like(q), torch.randn_like(k)], impls,
                bytes_fwd=traffic, bytes_bwd=traffic)


def case_linear_ce(m, tokens, device, gpu, *, vocab=None, ce_chunk=None, dtype=torch.bfloat16):
    """``vocab``: None = the model's (GPU) or CPU_VOCAB (CPU). ``ce_chunk``: tokens per chunk of
    the fused path; None = its own choice on GPU (~64M logits per chunk), tokens / CPU_CE_CHUNKS on CPU."""
    h = m["hidden"]
    v = vocab or (m["vocab"] if gpu else CPU_VOCAB)
    chunk = ce_chunk or (None if gpu else max(1, tokens // CPU_CE_CHUNKS))
    x = _rand(tokens, h, device=device, dtype=dtype)
    w = _rand(v, h, device=device, dtype=dtype, scale=h ** -0.5)
    t = torch.randint(0, v, (tokens,), device=device)
    impls = {"eager": lambda x, w: fused_linear_ce.linear_cross_entropy_reference(x, w, t),
             "tessel": lambda x, w: fused_linear_ce.fused_linear_cross_entropy(x, w, t, chunk_size=chunk)}
    if gpu and _liger() is not None:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="none")
        impls["liger"] = lambda x, w: loss_fn(w, x, t)
    flops = 2.0 * tokens * h * v
    return Case("linear_ce", "linear+ce", "", [x, w], [torch.randn(tokens, device=device)], impls,
                flops_fwd=flops, flops_bwd=2 * flops,
                extra={"vocab": v, "chunk_size": chunk or fused_linear_ce._auto_chunk(tokens, v)})


BUILDERS = {"rmsnorm": case_rmsnorm, "swiglu": case_swiglu, "rope": case_rope, "linear_ce": case_linear_ce}


# ----------------------------------------------------------------------------------------------
# Running one case
# ----------------------------------------------------------------------------------------------
def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def peak_extra_bytes(fwd_bwd: Callable[[], None], leaves: list, device: torch.device) -> int:
    """Peak bytes allocated above the state before one forward+backward (the inputs' gradients it
    creates included; they are cleared first so the old ones are not in the baseline)."""
    for t in leaves:
        t.grad = None
    gc.collect()
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fwd_bwd()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    with CPUMemoryPeak() as mem:
        fwd_bwd()
    return mem.peak_bytes


def run_impl(case: Case, fn, device, *, warmup, reps, queue: Optional[QueueAhead] = None) -> dict:
    leaves = [t.detach().requires_grad_() for t in case.inputs]

    def fwd():
        for t in leaves:
            t.grad = None
        return _as_tuple(fn(*leaves))

    def bwd(outs):
        torch.autograd.backward(list(outs), case.grads[: len(outs)])

    def fwd_bwd():
        bwd(fwd())

    fwd_ms, bwd_ms, total_ms = time_fwd_bwd(fwd, bwd, device, warmup=warmup, reps=reps, queue=queue)
    peak = peak_extra_bytes(fwd_bwd, leaves, device)
    return {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "total_ms": total_ms,
            "peak_extra_bytes": peak, "peak_extra_MiB": peak / 2 ** 20}


def add_rates(row: dict, case: Case, ceilings: dict) -> None:
    """Per phase: the achieved rate and its percentage of the ceiling named in ``row["ceiling"]``."""
    if case.flops_fwd:
        unit, ceiling, scale = "TFLOPs", f"matmul_{ceilings['matmul_dtype']}_TFLOPs", 1e9
        work = (case.flops_fwd, case.flops_bwd)
    else:
        unit, ceiling, scale, work = "GBps", "copy_GBps", 1e6, (case.bytes_fwd, case.bytes_bwd)
    row["ceiling"] = ceiling
    for phase, amount in zip(("fwd", "bwd", "total"), (*work, sum(work))):
        ms = row[f"{phase}_ms"]
        rate = amount / ms / scale if ms > 0 else None  # bytes/ms/1e6 = GB/s; flop/ms/1e9 = TFLOP/s
        row[f"{phase}_{unit}"] = rate
        row[f"{phase}_pct_ceiling"] = None if rate is None else 100 * rate / ceilings[ceiling]


def run_case(case: Case, device, ceilings, *, warmup, reps, use_compile,
             queue: Optional[QueueAhead] = None) -> list[dict]:
    impls = dict(case.impls)
    if use_compile:
        impls["compile"] = torch.compile(case.impls["eager"])
    grad_bytes = sum(t.numel() * t.element_size() for t in case.inputs)  # what every impl returns
    rows = []
    for name, fn in impls.items():
        row = {"op": case.op, "label": case.label, "size": case.size, "impl": name, **case.extra,
               "input_grad_bytes": grad_bytes}
        try:
            if name == "compile":  # compile (forward and backward graphs) outside the timed region
                t0 = time.perf_counter()
                run_impl(case, fn, device, warmup=0, reps=1)
                row["compile_s"] = time.perf_counter() - t0
            row.update(run_impl(case, fn, device, warmup=warmup, reps=reps, queue=queue))
            add_rates(row, case, ceilings)
        except Exception as err:  # noqa: BLE001 - a failing baseline is reported, not fatal
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        rows.append(row)
    eager = next((r for r in rows if r["impl"] == "eager" and "error" not in r), None)
    for r in rows:
        if eager is not None and "error" not in r:
            r["speedup_vs_eager"] = eager["total_ms"] / r["total_ms"]
            r["peak_vs_eager"] = r["peak_extra_bytes"] / eager["peak_extra_bytes"]
    return rows


def goals(rows: list[dict], gpu: bool) -> list[dict]:
    """The issue's targets, checked on this run's rows: fused linear + CE peak <= 10% of the unfused
    (eager) peak; on GPU, the Triton RMSNorm / SwiGLU / RoPE fwd+bwd at >= 90% of copy bandwidth."""
    out = []
    by_key = {(r["op"], r["size"], r["impl"]): r for r in rows if "error" not in r}
    for (op, size, impl), r in by_key.items():
        if op == "linear_ce" and impl == "tessel" and (op, size, "eager") in by_key:
            e = by_key[(op, size, "eager")]
            excl = ((r["peak_extra_bytes"] - r["input_grad_bytes"])
                    / max(e["peak_extra_bytes"] - e["input_grad_bytes"], 1))
            out.append({"goal": "linear+ce peak <= 10% of unfused", "size": size,
                        "value_pct": 100 * r["peak_vs_eager"], "excluding_input_grads_pct": 100 * excl,
                        "met": r["peak_vs_eager"] <= 0.10})
        if gpu and impl == "tessel" and op in ("rmsnorm", "swiglu", "rope"):
            out.append({"goal": f"{op} fwd+bwd >= 90% of copy bandwidth", "size": size,
                        "value_pct": r["total_pct_ceiling"], "met": (r["total_pct_ceiling"] or 0) >= 90})
    return out


def _rate(r: dict) -> str:
    if "total_TFLOPs" in r:
        return "n/a" if r["total_TFLOPs"] is None else f"{r['total_TFLOPs']:.3g} TFLOP/s"
    return "n/a" if r["total_GBps"] is None else f"{r['total_GBps']:.3g} GB/s"


def print_table(rows: list[dict]) -> None:
    head = (f"{'op':<17}{'size':<6}{'impl':<9}{'fwd ms':>11}{'bwd ms':>11}{'total ms':>11}"
            f"{'rate':>17}{'%ceil':>8}{'x eager':>9}{'peak MiB':>10}{'peak/eager':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['label']:<17}{r['size']:<6}{r['impl']:<9}  {r['error']}")
            continue
        pct = "n/a" if r["total_pct_ceiling"] is None else f"{r['total_pct_ceiling']:.1f}%"
        print(f"{r['label']:<17}{r['size']:<6}{r['impl']:<9}{r['fwd_ms']:>11.3f}{r['bwd_ms']:>11.3f}"
              f"{r['total_ms']:>11.3f}{_rate(r):>17}{pct:>8}"
              f"{r.get('speedup_vs_eager', float('nan')):>9.2f}{r['peak_extra_MiB']:>10.1f}"
              f"{100 * r.get('peak_vs_eager', float('nan')):>10.1f}%")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="reduced CPU mode even if CUDA is available")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None,
                   help="layer sizes (default: 8b 70b on GPU, 8b on CPU)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--tokens", type=_positive, default=None,
                   help="tokens per microbatch (default 8192 GPU, 256 CPU)")
    p.add_argument("--vocab", type=_positive, default=None,
                   help=f"linear + CE vocabulary (default: the model's on GPU, {CPU_VOCAB} on CPU)")
    p.add_argument("--ce-chunk", type=_positive, default=None,
                   help="tokens per chunk of the fused linear + CE (default: its own choice on GPU, "
                        f"tokens / {CPU_CE_CHUNKS} on CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="dtype of the ops' inputs and of the matmul ceiling (default bf16, the GPU "
                        "case; fp32 for CPUs whose bf16 matmul is slow: see the ceiling line)")
    p.add_argument("--reps", type=_positive, default=None, help="timed repetitions (default 20 GPU, 5 CPU)")
    p.add_argument("--warmup", type=_non_negative, default=None,
                   help="untimed repetitions before timing (default 3 GPU, 1 CPU)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--timing", choices=("queued", "idle"), default=None,
                   help="GPU only: 'queued' (default) times each call queued behind a GPU sleep, so the events "
                        "measure its kernels back to back (device time); 'idle' starts each call on an idle "
                        "GPU, so a short op's time includes the host's launches (what the first GPU sessions "
                        "measured)")
    p.add_argument("--json", type=str, default=None, help="write the results as JSON to this path")
    args = p.parse_args(argv)
    if args.timing is not None and (args.cpu or not torch.cuda.is_available()):
        p.error(f"--timing {args.timing} chooses how CUDA events time a GPU run; the CPU mode times thread CPU "
                "time. Leave --timing out on the CPU")
    args.timing = args.timing or "queued"
    if args.json is not None:  # fail now, not after minutes of benchmarking
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            p.error(f"--json {args.json}: folder {folder} does not exist; create it or pick another path")
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    tokens = args.tokens or (8192 if gpu else 256)
    reps = args.reps or (20 if gpu else 5)
    warmup = args.warmup if args.warmup is not None else (3 if gpu else 1)
    models = args.models or (["8b", "70b"] if gpu else ["8b"])
    if not gpu:
        torch.set_num_threads(1)  # thread CPU time then measures all of the op's work
    torch.manual_seed(0)
    # The ceilings are single large launches (host time negligible), timed from an idle GPU; then the
    # queue, its clock measured on the GPU they warmed
    ceilings = measure_ceilings(device, reps=reps, dtype=args.dtype)
    queue = QueueAhead(device) if gpu and args.timing == "queued" else None
    device_name = torch.cuda.get_device_name(device) if gpu else platform.processor() or "cpu"
    print(f"device: {device_name} ({'GPU' if gpu else 'CPU reduced mode'}), torch {torch.__version__}, "
          f"tokens {tokens}, dtype {args.dtype}")
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"ceilings: copy {ceilings['copy_GBps']:.1f} GB/s, {args.dtype} matmul "
          f"{ceilings[f'matmul_{args.dtype}_TFLOPs']:.3g} TFLOP/s (n={ceilings['matmul_n']})\n")
    rows = []
    for model in models:
        for op in args.ops:
            case = BUILDERS[op](MODELS[model], tokens, device, gpu, vocab=args.vocab, ce_chunk=args.ce_chunk,
                                dtype=DTYPES[args.dtype])
            case.size = model
            rows += run_case(case, device, ceilings, warmup=warmup, reps=reps, use_compile=not args.no_compile,
                             queue=queue)
            del case
    print_table(rows)
    if queue is not None:
        print("\ntiming: each call queued behind a GPU sleep (device time, launches hidden)"
              + (f"; {queue.short} timed calls took the host longer to issue than the sleep ahead of them, so "
                 "their times include launch gaps" if queue.short else ""))
    checks = goals(rows, gpu)
    if checks:
        print()
    for g in checks:
        extra = (f" ({g['excluding_input_grads_pct']:.1f}% excluding the input gradients)"
                 if "excluding_input_grads_pct" in g else "")
        value = "n/a" if g["value_pct"] is None else f"{g['value_pct']:.1f}%"
        print(f"goal {g['goal']} [{g['size']}]: {value}{extra} -> {'met' if g['met'] else 'NOT met'}")
    result = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", "tools/bench_kernels.py", *(argv if argv is not None else sys.argv[1:])]),
        "mode": "gpu" if gpu else "cpu-reduced", "device": device_name, "cpu_count": os.cpu_count(),
        "load_average_1_5_15": list(os.getloadavg()), "torch": torch.__version__, "tokens": tokens,
        "dtype": args.dtype, "reps": reps, "warmup": warmup,
        "timing": ("thread CPU time, 1 torch thread" if not gpu else
                   "CUDA events, each call queued behind a GPU sleep (device time)" if queue is not None else
                   "CUDA events from an idle GPU (host launch time included)"),
        "queue_short_calls": queue.short if queue is not None else None,
        "peak_memory": ("torch.cuda.max_memory_allocated - allocated before" if gpu else
                        "profiler CPU allocator events (CPUMemoryPeak)"),
        "ceilings": ceilings, "liger_available": _liger() is not None, "rows": rows, "goals": checks,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
