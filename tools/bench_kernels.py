"""Microbenchmarks of the fused ops (engine/ops) at Llama-3 8B / 70B layer sizes.

For every op and size it times forward, backward and forward+backward of:
  * ``tessel``  - the op's public function with backend="auto" (Triton on CUDA);
  * ``eager``   - the plain-PyTorch reference, the same one the tests compare against;
  * ``compile`` - torch.compile of that reference (inductor), compiled outside the timed region;
  * ``liger``   - Liger-Kernel's op, when ``liger_kernel`` is importable (GPU only).
Each row reports achieved GB/s of the op's minimum traffic (memory-bound ops) or model TFLOP/s
(linear + cross-entropy: 2*T*H*V forward, 4*T*H*V backward), the fraction of this machine's
ceiling measured in the same run (a device-to-device copy; a large bf16 matmul), the speed-up over
``eager``, and the peak extra memory of forward+backward (CUDA only).

CPU machines (no CUDA, or ``--cpu``) run a reduced mode: Llama-3 8B layer widths, 256 tokens, a
32768 vocab, and only the reference paths (``tessel`` only where its CPU path differs from
``eager``: the chunked linear + cross-entropy). CPU times are the calling thread's CPU time with one
torch thread (ceilings measured the same way), so a busy shared machine does not distort them.

    python tools/bench_kernels.py [--cpu] [--models 8b 70b] [--ops rmsnorm swiglu rope linear_ce]
                                  [--tokens N] [--reps N] [--json PATH]
"""
from __future__ import annotations

import argparse
import datetime
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

MODELS = {  # Llama-3 layer shapes (per device, no tensor parallelism)
    "8b": dict(hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256),
    "70b": dict(hidden=8192, ffn=28672, heads=64, kv_heads=8, head_dim=128, vocab=128256),
}
CPU_VOCAB = 32768
OPS = ("rmsnorm", "swiglu", "rope", "linear_ce")


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int, reps: int,
            setup: Optional[Callable[[], object]] = None) -> float:
    """Median time of ``fn(setup())`` in milliseconds, ``setup`` excluded. Without ``setup``,
    ``fn()`` is timed. GPU: CUDA events (wall time of the stream). CPU: CPU time of the calling
    thread (``time.thread_time``) - the CPU mode runs torch with one intra-op thread, so this is all
    the work, and other processes on a shared machine do not inflate it as they do wall time."""
    def once():
        arg = setup() if setup is not None else None
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(arg) if setup is not None else fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.thread_time()
        fn(arg) if setup is not None else fn()
        return (time.thread_time() - t0) * 1e3

    for _ in range(warmup):
        once()
    return statistics.median(once() for _ in range(reps))


def measure_ceilings(device: torch.device, *, reps: int) -> dict:
    """Copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s) of this device."""
    numel = (1 << 28) if device.type == "cuda" else (1 << 25)  # 1 GiB / 128 MiB of fp32
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), device, warmup=2, reps=reps)
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_ms = time_ms(lambda: a @ b, device, warmup=2, reps=reps)
    return {"copy_GBps": 2 * numel * 4 / copy_ms / 1e6, "copy_bytes": 2 * numel * 4,
            "matmul_bf16_TFLOPs": 2 * n ** 3 / mm_ms / 1e9, "matmul_n": n}


# ----------------------------------------------------------------------------------------------
# Cases: inputs, implementations, and the traffic / FLOP model of each op
# ----------------------------------------------------------------------------------------------
@dataclass
class Case:
    op: str
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


def case_rmsnorm(m, tokens, device, gpu):
    h = m["hidden"]
    x, r = _rand(tokens, h, device=device), _rand(tokens, h, device=device)
    w = _rand(h, device=device, scale=0.1) + 1
    e = x.element_size()
    impls = {"eager": lambda x, r, w: rmsnorm.rms_norm_reference(x, w, 1e-5, residual=r)}
    if gpu:
        impls["tessel"] = lambda x, r, w: rmsnorm.rms_norm(x, w, 1e-5, residual=r)
        liger = _liger()
        if liger is not None:
            from liger_kernel.transformers import LigerRMSNorm

            liger_norm = LigerRMSNorm(h, eps=1e-5).to(device=device, dtype=w.dtype)

            def run_liger(x, r, w):  # w unused: the module's own weight takes the gradient
                hsum = x + r  # Liger has no fused residual add: add, then normalise
                return liger_norm(hsum), hsum
            impls["liger"] = run_liger
    return Case("rmsnorm+residual", "", [x, r, w], [torch.randn_like(x), torch.randn_like(x)], impls,
                bytes_fwd=4 * tokens * h * e, bytes_bwd=4 * tokens * h * e)


def case_swiglu(m, tokens, device, gpu):
    i = m["ffn"]
    x = _rand(tokens, 2 * i, device=device)
    e = x.element_size()
    impls = {"eager": swiglu.swiglu_reference}
    if gpu:
        impls["tessel"] = swiglu.swiglu
        if _liger() is not None:
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            impls["liger"] = lambda x: LigerSiLUMulFunction.apply(x[:, :i], x[:, i:])
    return Case("swiglu", "", [x], [_rand(tokens, i, device=device)], impls,
                bytes_fwd=3 * tokens * i * e, bytes_bwd=5 * tokens * i * e)


def case_rope(m, tokens, device, gpu):
    s, b = tokens, 1
    nh, nkv, hd = m["heads"], m["kv_heads"], m["head_dim"]
    q, k = _rand(s, b, nh, hd, device=device), _rand(s, b, nkv, hd, device=device)
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
    return Case("rope(q+k)", "", [q, k], [torch.randn_like(q), torch.randn_like(k)], impls,
                bytes_fwd=traffic, bytes_bwd=traffic)


def case_linear_ce(m, tokens, device, gpu):
    h, v = m["hidden"], (m["vocab"] if gpu else CPU_VOCAB)
    x = _rand(tokens, h, device=device)
    w = _rand(v, h, device=device, scale=h ** -0.5)
    t = torch.randint(0, v, (tokens,), device=device)
    impls = {"eager": lambda x, w: fused_linear_ce.linear_cross_entropy_reference(x, w, t),
             "tessel": lambda x, w: fused_linear_ce.fused_linear_cross_entropy(x, w, t)}
    if gpu and _liger() is not None:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="none")
        impls["liger"] = lambda x, w: loss_fn(w, x, t)
    flops = 2.0 * tokens * h * v
    return Case("linear+ce", "", [x, w], [torch.randn(tokens, device=device)], impls,
                flops_fwd=flops, flops_bwd=2 * flops, extra={"vocab": v})


BUILDERS = {"rmsnorm": case_rmsnorm, "swiglu": case_swiglu, "rope": case_rope, "linear_ce": case_linear_ce}


# ----------------------------------------------------------------------------------------------
# Running one case
# ----------------------------------------------------------------------------------------------
def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def run_impl(case: Case, fn, device, *, warmup, reps) -> dict:
    leaves = [t.detach().requires_grad_() for t in case.inputs]

    def fwd():
        for t in leaves:
            t.grad = None
        return _as_tuple(fn(*leaves))

    def bwd(outs):
        torch.autograd.backward(list(outs), case.grads[: len(outs)])

    def fwd_bwd():
        bwd(fwd())

    fwd_ms = time_ms(fwd, device, warmup=warmup, reps=reps)
    bwd_ms = time_ms(bwd, device, warmup=warmup, reps=reps, setup=fwd)
    total_ms = time_ms(fwd_bwd, device, warmup=warmup, reps=reps)
    peak_mib = None
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fwd_bwd()
        _sync(device)
        peak_mib = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
    return {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "total_ms": total_ms,
            "peak_extra_MiB": peak_mib}


def add_rates(row: dict, case: Case, ceilings: dict) -> None:
    if case.flops_fwd:
        for phase, flops in (("fwd", case.flops_fwd), ("bwd", case.flops_bwd),
                             ("total", case.flops_fwd + case.flops_bwd)):
            row[f"{phase}_TFLOPs"] = flops / row[f"{phase}_ms"] / 1e9 if row[f"{phase}_ms"] > 0 else None
        row["total_pct_ceiling"] = 100 * (row["total_TFLOPs"] or 0) / ceilings["matmul_bf16_TFLOPs"]
    else:
        for phase, nbytes in (("fwd", case.bytes_fwd), ("bwd", case.bytes_bwd),
                              ("total", case.bytes_fwd + case.bytes_bwd)):
            row[f"{phase}_GBps"] = nbytes / row[f"{phase}_ms"] / 1e6 if row[f"{phase}_ms"] > 0 else None
        row["total_pct_ceiling"] = 100 * (row["total_GBps"] or 0) / ceilings["copy_GBps"]


def run_case(case: Case, device, ceilings, *, warmup, reps, use_compile) -> list[dict]:
    impls = dict(case.impls)
    if use_compile:
        impls["compile"] = torch.compile(case.impls["eager"])
    rows = []
    for name, fn in impls.items():
        row = {"op": case.op, "size": case.size, "impl": name, **case.extra}
        try:
            if name == "compile":  # compile (forward and backward graphs) outside the timed region
                t0 = time.perf_counter()
                run_impl(case, fn, device, warmup=0, reps=1)
                row["compile_s"] = time.perf_counter() - t0
            row.update(run_impl(case, fn, device, warmup=warmup, reps=reps))
            add_rates(row, case, ceilings)
        except Exception as err:  # noqa: BLE001 - a failing baseline is reported, not fatal
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        rows.append(row)
    eager = next((r for r in rows if r["impl"] == "eager" and "error" not in r), None)
    for r in rows:
        if eager is not None and "error" not in r:
            r["speedup_vs_eager"] = eager["total_ms"] / r["total_ms"]
    return rows


def _rate(r: dict) -> str:
    if "total_TFLOPs" in r:
        return f"{r['total_TFLOPs']:.3g} TFLOP/s"
    return f"{r['total_GBps']:.3g} GB/s"


def print_table(rows: list[dict]) -> None:
    head = (f"{'op':<17}{'size':<6}{'impl':<9}{'fwd ms':>11}{'bwd ms':>11}{'total ms':>11}"
            f"{'rate':>17}{'%ceil':>8}{'x eager':>9}{'peak MiB':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['op']:<17}{r['size']:<6}{r['impl']:<9}  {r['error']}")
            continue
        peak = "n/a" if r["peak_extra_MiB"] is None else f"{r['peak_extra_MiB']:.0f}"
        print(f"{r['op']:<17}{r['size']:<6}{r['impl']:<9}{r['fwd_ms']:>11.3f}{r['bwd_ms']:>11.3f}"
              f"{r['total_ms']:>11.3f}{_rate(r):>17}{r['total_pct_ceiling']:>7.1f}%"
              f"{r.get('speedup_vs_eager', float('nan')):>9.2f}{peak:>10}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="reduced CPU mode even if CUDA is available")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None,
                   help="layer sizes (default: 8b 70b on GPU, 8b on CPU)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--tokens", type=int, default=None, help="tokens per microbatch (default 8192 GPU, 256 CPU)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 20 GPU, 5 CPU)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--json", type=str, default=None, help="write the results as JSON to this path")
    args = p.parse_args(argv)
    if args.tokens is not None and args.tokens <= 0:
        p.error(f"--tokens={args.tokens} must be positive")
    if args.reps is not None and args.reps <= 0:
        p.error(f"--reps={args.reps} must be positive")
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    tokens = args.tokens or (8192 if gpu else 256)
    reps = args.reps or (20 if gpu else 5)
    warmup = 3 if gpu else 1
    models = args.models or (["8b", "70b"] if gpu else ["8b"])
    if not gpu:
        torch.set_num_threads(1)  # thread CPU time then measures all of the op's work
    torch.manual_seed(0)
    ceilings = measure_ceilings(device, reps=reps)
    print(f"device: {torch.cuda.get_device_name(device) if gpu else platform.processor() or 'cpu'}"
          f" ({'GPU' if gpu else 'CPU reduced mode'}), torch {torch.__version__}, tokens {tokens}")
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"ceilings: copy {ceilings['copy_GBps']:.1f} GB/s, bf16 matmul "
          f"{ceilings['matmul_bf16_TFLOPs']:.3g} TFLOP/s (n={ceilings['matmul_n']})\n")
    rows = []
    for model in models:
        for op in args.ops:
            case = BUILDERS[op](MODELS[model], tokens, device, gpu)
            case.size = model
            rows += run_case(case, device, ceilings, warmup=warmup, reps=reps, use_compile=not args.no_compile)
            del case
    print_table(rows)
    result = {
        "date": datetime.date.today().isoformat(), "command": " ".join(["python", "tools/bench_kernels.py"] + (argv if argv is not None else sys.argv[1:])),
        "mode": "gpu" if gpu else "cpu-reduced", "device": torch.cuda.get_device_name(device) if gpu else platform.processor() or "cpu",
        "cpu_count": os.cpu_count(), "load_average_1_5_15": list(os.getloadavg()), "torch": torch.__version__, "tokens": tokens, "reps": reps,
        "ceilings": ceilings, "liger_available": _liger() is not None, "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
