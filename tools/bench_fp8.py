"""Benchmark: FP8 linears (engine/ops/fp8_linear.py) against bf16, and the training step with model.fp8.

1. **GEMMs** at the linears of Llama-3 8B and 70B layers (qkv, attention out, fc1, fc2; TP=1),
   ``--tokens`` rows: for each recipe the forward FP8 GEMM alone (operands quantised beforehand)
   and the whole ``fp8_linear`` forward + backward (quantisation included), against ``F.linear``
   in bf16 (fp32 on the CPU) on the same shapes in the same run, and against the machine's measured
   ceilings (a dense bf16/fp32 matmul and a dense tensorwise ``_scaled_mm``, ``--ceiling-n``^3). Each FP8 result is also
   checked against the plain-PyTorch reference of its recipe (max relative difference printed).
2. **Host time per linear** (``--host-shape``, default 16 x 16 x 16, where the device work is
   negligible): the time to issue one forward + backward (no synchronisation per call), and the
   aten ops it dispatches that compute, for bf16 (fp32 on the CPU) ``F.linear`` and each recipe
   (``--host-profile TOP``: and where it goes, function by function, under cProfile). A
   GPU runs ahead of the host only while the host issues work faster than the GPU drains it; the
   first GPU session measured the 8B layer's FP8 calls at 1.6x their kernel time (docs/fp8.md).
3. **Training step** of ``--preset`` (gpu-1b on CUDA, cpu-tiny on CPU; tools/bench_train_step.py's
   Trainer at TP=PP=DP=1): model.fp8 = none vs each recipe, timed round-robin in the same run; the
   ratio is the FP8 step speed-up (goal on an H100: 1.3x or more at gpu-1b), beside the computing aten ops
   one step dispatches (each a kernel launch on a GPU, issued from Python). ``--micro-batch`` splits
   the batch into micro-batches; ``--weight-cache-ab`` adds, per recipe, a side with
   ``model.fp8_weight_cache=false`` (each weight cast per micro-batch instead of once per step);
   ``--profile-step`` (CUDA) lists each side's kernels over 2 more steps and the share of its step the GPU
   was busy (the rest it waited for the host to issue work).

    python3 tools/bench_fp8.py --device cuda --json OUT/bench_fp8.json         (a lent GPU)
    .venv/bin/python tools/bench_fp8.py --threads 1 --models 8b --tokens 128 --repeats 2 --steps 3
        (CPU: correctness and CPU figures, docs/benchmarks/fp8.md; with --models tiny a check in seconds)

On the CPU, FP8 ``_scaled_mm`` dequantises into an fp32 matmul: the CPU ratios say nothing about a
GPU and are printed only to show the benchmark runs. Results: docs/benchmarks/fp8.md.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.ops.fp8_linear import (E4M3, PER_TENSOR, RECIPES, DelayedScaling, fp8_linear, quantize_blocks,  # noqa: E402
                                   quantize_mx, quantize_rowwise, quantize_tensorwise, quantize_tiles, scaled_gemm,
                                   scaled_gemm_reference, amax_to_scale)

# (hidden, ffn, heads, kv_heads, head_dim) of the two Llama-3 sizes
MODELS = {"8b": (4096, 14336, 32, 8, 128), "70b": (8192, 28672, 64, 8, 128),
          "tiny": (128, 352, 4, 2, 32)}  # tiny: the CPU preset's layer (tests)


def layer_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(out_features N, in_features K) of each linear of one layer, TP=1, SwiGLU fc1 fused."""
    h, f, heads, kv, hd = MODELS[name]
    return {"qkv": ((heads + 2 * kv) * hd, h), "out": (h, heads * hd), "fc1": (2 * f, h), "fc2": (h, f)}


def _timer(device: str):
    """``run(fn, n)`` -> median seconds of ``n`` calls after one untimed call (the first call of a shape pays
    for lazy initialisation: kernels, allocator, oneDNN primitives) (CUDA events on a GPU, wall clock on
    the CPU)."""
    from tools.bench_train_step import _time_cuda

    if device == "cuda":
        def run_cuda(fn, n):
            fn()
            return statistics.median(_time_cuda(fn, n=n)[1])
        return run_cuda

    def run(fn, n):
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return run


def _quantised(recipe: str, x, w):
    if recipe in PER_TENSOR:
        sx = amax_to_scale(x.float().abs().amax().reshape(1), E4M3)
        sw = amax_to_scale(w.float().abs().amax().reshape(1), E4M3)
        return quantize_tensorwise(x, E4M3, sx)[0], quantize_tensorwise(w, E4M3, sw)[0]
    if recipe == "rowwise":
        return quantize_rowwise(x, E4M3), quantize_rowwise(w, E4M3)
    if recipe == "mxfp8":
        return quantize_mx(x, E4M3), quantize_mx(w, E4M3)
    return quantize_tiles(x, E4M3), quantize_blocks(w, E4M3)


_NOT_LAUNCHES = {"empty", "empty_like", "empty_strided", "new_empty", "_local_scalar_dense", "lift_fresh", "detach"}


def dispatched_ops(fn) -> dict[str, int]:
    """What ``fn()`` issues that runs on the device: the aten ops it dispatches except views, allocations and
    CPU scalar reads, and (named ``engine._fp8.<fn>``) the calls of the native FP8 extension, which the
    dispatcher does not see. On a GPU each aten op here is a kernel launch, and a native cast is two (the
    amax's memset and the kernel)."""
    import collections
    from torch.utils._python_dispatch import TorchDispatchMode

    from engine import _native

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not (func.is_view or name in _NOT_LAUNCHES):
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    native = _native.load("fp8") if _native.available("fp8") else None
    wrapped = {}
    counter = Count()
    if native is not None:  # count the extension's calls: wrap its functions for the duration
        for fname in ("cast_transpose", "cast_transpose_scaled", "cast_transpose_grid", "scales_from_amax"):
            f = getattr(native, fname, None)
            if f is not None:
                wrapped[fname] = f
                setattr(native, fname, (lambda f, key: lambda *a, **k: (counter.ops.update([key]), f(*a, **k))[1])(
                    f, f"engine._fp8.{fname}"))
    try:
        with counter:
            fn()
    finally:
        for fname, f in wrapped.items():
            setattr(native, fname, f)
    return dict(sorted(counter.ops.items()))


def bench_host(args) -> dict:
    """Host microseconds to issue one forward + backward per side at a shape whose device work is
    negligible (median of 5 batches of 50 calls; on CUDA the GPU is synchronised after each batch only),
    and the computing ops each call dispatches."""
    dev = args.device
    m, n, k = args.host_shape
    hp = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=hp, generator=g).requires_grad_()
    w = (torch.randn(n, k, device=dev, generator=g) * 0.02).requires_grad_()
    wb = w.detach().to(hp).requires_grad_()
    dy = torch.randn(m, n, device=dev, dtype=hp, generator=g)
    sides = {"hp": lambda: F.linear(x, wb).backward(dy)}
    for recipe in args.recipes:
        state = DelayedScaling(device=dev) if recipe == "delayed" else None
        sides[recipe] = (lambda r, st: lambda: fp8_linear(x, w, recipe=r, state=st).backward(dy))(recipe, state)
        sides[recipe]()
        if state is not None:
            state.update()  # scales from the history from here on, as in training after the first step
    out = {"shape": [m, n, k], "baseline_dtype": str(hp).replace("torch.", ""), "sides": {}}
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    for name, fn in sides.items():
        for _ in range(5):
            fn()
        sync()
        batches = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            batches.append((time.perf_counter() - t0) / 50)
            sync()
        ops = dispatched_ops(fn)
        out["sides"][name] = {"host_us": statistics.median(batches) * 1e6, "ops": sum(ops.values()), "op_counts": ops}
        if args.host_profile:
            out["sides"][name]["profile"] = _host_profile(fn, sync, args.host_profile)
    return out


def _host_profile(fn, sync, top: int, calls: int = 200) -> list[dict]:
    """``--host-profile``: where the host time of ``calls`` calls of ``fn`` goes, by Python function and
    builtin (cProfile, the functions' own time, not their callees'), per call; the ``top`` largest."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    sync()
    rows = []
    for (file, line, func), (_, ncalls, own, _, _) in pstats.Stats(prof).stats.items():
        where = func if file == "~" else f"{os.path.relpath(file) if file.startswith(os.getcwd()) else os.path.basename(file)}:{line}({func})"
        rows.append({"where": where, "own_us": own / calls * 1e6, "calls": ncalls / calls})
    return sorted(rows, key=lambda r: -r["own_us"])[:top]


def bench_gemms(args, run) -> dict:
    dev, n_rep = args.device, args.repeats
    hp = torch.bfloat16 if dev == "cuda" else torch.float32  # CPU bf16 matmuls can be pathologically slow
    g = torch.Generator(device=dev).manual_seed(0)
    out = {"ceilings": {}, "layers": [], "baseline_dtype": str(hp).replace("torch.", "")}
    n = args.ceiling_n
    a = torch.randn(n, n, device=dev, dtype=hp, generator=g)
    b = torch.randn(n, n, device=dev, dtype=hp, generator=g)
    t = run(lambda: a @ b, n_rep)
    out["ceilings"]["hp_matmul_tflops"] = 2 * n ** 3 / t / 1e12
    a8, b8 = a.to(E4M3), b.to(E4M3)
    one = torch.ones((), device=dev)
    t = run(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16), n_rep)
    out["ceilings"]["fp8_scaled_mm_tflops"] = 2 * n ** 3 / t / 1e12
    del a, b, a8, b8
    m = args.tokens
    for model in args.models:
        for lin, (nf, kf) in layer_shapes(model).items():
            x = torch.randn(m, kf, device=dev, dtype=hp, generator=g)
            w = (torch.randn(nf, kf, device=dev, dtype=torch.float32, generator=g) * 0.02)
            dy = torch.randn(m, nf, device=dev, dtype=hp, generator=g) * 1e-3
            flops = 2 * m * nf * kf
            wb = w.to(hp)
            row = {"model": model, "linear": lin, "M": m, "N": nf, "K": kf}
            row["hp_fwd_tflops"] = flops / run(lambda: F.linear(x, wb), n_rep) / 1e12
            xr, wr = x.clone().requires_grad_(), wb.clone().requires_grad_()

            def hp_step():
                F.linear(xr, wr).backward(dy)
            row["hp_step_tflops"] = 3 * flops / run(hp_step, n_rep) / 1e12
            for recipe in args.recipes:
                qa, qb = _quantised(recipe, x, w)
                got = scaled_gemm(qa, qb, torch.float32)
                ref = scaled_gemm_reference(qa, qb, torch.float32)
                rel = ((got - ref).abs().max() / ref.abs().max()).item()
                t_gemm = run(lambda: scaled_gemm(qa, qb, torch.bfloat16), n_rep)
                xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
                state = DelayedScaling(device=dev) if recipe == "delayed" else None

                def fp8_step():
                    fp8_linear(xf, wf, recipe=recipe, state=state).backward(dy)
                t_step = run(fp8_step, n_rep)
                row[recipe] = {"fwd_gemm_tflops": flops / t_gemm / 1e12, "step_tflops": 3 * flops / t_step / 1e12,
                               "vs_reference_rel": rel}
            out["layers"].append(row)
            del x, w, dy, xr, wr
    return out


def profile_layer(args) -> dict:
    """Where one linear's forward + backward spends its device time: tools/kernel_profile.py over
    ``--repeats`` calls at the ``--profile`` layer (e.g. 8b:qkv), bf16 ``F.linear`` and each recipe, every
    kernel's self time summed by name (CUDA time on a GPU, CPU time on the CPU), largest first."""
    from tools.kernel_profile import kernel_table, print_kernel_table

    dev = args.device
    model, lin = args.profile.split(":")
    nf, kf = layer_shapes(model)[lin]
    m, hp = args.tokens, (torch.bfloat16 if dev == "cuda" else torch.float32)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, kf, device=dev, dtype=hp, generator=g).requires_grad_()
    w = (torch.randn(nf, kf, device=dev, dtype=torch.float32, generator=g) * 0.02).requires_grad_()
    wb = w.detach().to(hp).requires_grad_()
    dy = torch.randn(m, nf, device=dev, dtype=hp, generator=g) * 1e-3
    sides = {"bf16" if dev == "cuda" else "fp32": lambda: F.linear(x, wb).backward(dy)}
    for recipe in args.recipes:
        state = DelayedScaling(device=dev) if recipe == "delayed" else None
        sides[recipe] = (lambda r, st: lambda: fp8_linear(x, w, recipe=r, state=st).backward(dy))(recipe, state)
    out = {"layer": args.profile, "M": m, "N": nf, "K": kf, "sides": {}}
    for name, fn in sides.items():
        table = kernel_table(fn, device=dev, repeats=args.repeats)
        out["sides"][name] = {"total_us": table["total_us"], "kernels": table["kernels"][:args.profile_top]}
        print_kernel_table(f"{name}, forward + backward ({args.profile}, {m} x {nf} x {kf}), "
                           f"{'device' if dev == 'cuda' else 'CPU'} time", table, top=args.profile_top)
        x.grad = w.grad = wb.grad = None
    return out


def bench_step(args) -> dict:
    from tools.bench_train_step import PRESETS, _batch, _tessel_trainer

    preset = dict(PRESETS[args.preset])
    ns = SimpleNamespace(**preset, device=args.device, dtype=args.dtype)
    batch = _batch(ns, args.device)

    mb = args.micro_batch or preset["batch"]
    micro = [{k: v if k == "position_ids" else v[i:i + mb] for k, v in batch.items()}  # (mb, seq) rows each
             for i in range(0, preset["batch"], mb)]

    sides = {}
    names = ["none", *args.recipes] + ([f"{r}/nocache" for r in args.recipes] if args.weight_cache_ab else [])
    names += [f"{r}/graph" for r in ("none", *args.recipes)] if args.cuda_graph else []  # model.cuda_graph=layers
    variant_cfg = {"": (), "nocache": ("model.fp8_weight_cache=false",), "graph": ("model.cuda_graph=layers",)}
    ops = {}  # computing aten ops dispatched per train step (each a kernel launch on a GPU)
    for name in names:
        fp8, _, variant = name.partition("/")
        base = 0
        if args.device == "cuda":  # what earlier sides left (none, since DataParallel's hooks hold it weakly)
            gc.collect()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
        trainer, _, _ = _tessel_trainer(ns, fp8=fp8, micro_batch=args.micro_batch,
                                        extra=variant_cfg[variant])
        loader = itertools.cycle(micro)  # the batch's micro-batches, in turn (one per trainer micro-batch)
        for _ in range(args.warmup):
            trainer.train_step(loader)
        ops[name] = sum(dispatched_ops(lambda: trainer.train_step(loader)).values())  # one more step, counted
        sides[name] = (trainer, loader)
        if args.device == "cuda":  # one side on the GPU at a time (a 1B model's copies)
            sides[name] = _time_side(args, trainer, loader, base)
            # printed at once: a session's time box may stop the run before the table at the end
            print(f"  (measured) model.fp8={name}: {sides[name]['step_s'] * 1e3:.1f} ms, "
                  f"peak {sides[name]['peak_mem_gib']:.1f} GiB", flush=True)
            if args.profile_step:
                sides[name].update(_profile_side(args, trainer, loader, name, sides[name]["step_s"]))
                eager = sides.get(fp8) if variant == "graph" else None
                if eager is not None and "_all_kernels" in eager:  # where the graphed kernels' time differs
                    sides[name]["kernel_diff_vs_eager"] = _kernel_diff(eager["_all_kernels"],
                                                                       sides[name]["_all_kernels"], name, fp8)
            del trainer
    if args.device == "cuda":
        times = sides
    else:  # round-robin on the CPU, alternating the order
        wall = {k: [] for k in sides}
        order = list(sides)
        for i in range(args.steps):
            for k in (order if i % 2 == 0 else order[::-1]):
                t0 = time.perf_counter()
                sides[k][0].train_step(sides[k][1])
                wall[k].append(time.perf_counter() - t0)
        times = {k: {"step_s": statistics.median(v)} for k, v in wall.items()}
    base = times["none"]["step_s"]
    for v in times.values():
        v.pop("_all_kernels", None)  # every kernel of a profiled side: for the diff above, not the JSON
    for k, v in times.items():
        v["speedup_vs_none"] = base / v["step_s"]
        v["ops_per_step"] = ops[k]
    return {"preset": args.preset, "dtype": args.dtype, "micro_batch": mb, "batch": preset["batch"], "sides": names,
            **times}


def _time_side(args, trainer, loader, base: int) -> dict:
    """Median step time of one side, and its peak memory over the timed steps above ``base`` (what was
    allocated before the side was built)."""
    from tools.bench_train_step import _time_cuda

    torch.cuda.reset_peak_memory_stats()
    losses = []
    _, times = _time_cuda(lambda: losses.append(trainer.train_step(loader).loss), n=args.steps)
    # reserved as well as allocated: memory held by CUDA graphs' private pools (model.cuda_graph) is allocated
    # only while capturing, so a replayed step's allocated peak leaves out the activations the graphs hold
    return {"step_s": statistics.median(times), "last_loss": losses[-1], "losses": losses,
            "peak_mem_gib": (torch.cuda.max_memory_allocated() - base) / 2 ** 30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2 ** 30}


def _profile_side(args, trainer, loader, name: str, step_s: float) -> dict:
    """``--profile-step``: the kernels of 2 more steps of one side (tools/kernel_profile.py). Their summed
    device time per step against the side's median step time says how long the GPU sat idle, waiting for
    the host to issue work (the host gaps do not show in a kernel's time)."""
    from tools.kernel_profile import kernel_table, print_kernel_table

    table = kernel_table(lambda: trainer.train_step(loader), device="cuda", repeats=2, warmup=0)
    busy = table["total_us"] / 1e6
    print_kernel_table(f"  model.fp8={name}: kernels per step ({busy / step_s:.1%} of the {step_s * 1e3:.1f} ms "
                       f"step busy)", table, top=args.profile_top)
    return {"device_busy_s": busy, "kernels": table["kernels"][:args.profile_top], "_all_kernels": table["kernels"]}


def _kernel_diff(eager: list[dict], graphed: list[dict], name: str, base: str, top: int = 12) -> list[dict]:
    """Per kernel name, the graphed side's device time per step minus the eager side's (same recipe), the
    largest differences first: which kernels make the graphed step's kernels sum differ from the eager one's
    (by 4-6% on the H200, 2026-11-28: unexplained so far). Printed, and the ``top`` rows returned."""
    e = {k["name"]: k for k in eager}
    g = {k["name"]: k for k in graphed}
    rows = [{"name": n, "eager_us": e.get(n, {}).get("us", 0.0), "graphed_us": g.get(n, {}).get("us", 0.0),
             "eager_calls": e.get(n, {}).get("calls", 0.0), "graphed_calls": g.get(n, {}).get("calls", 0.0)}
            for n in dict.fromkeys([*e, *g])]
    for r in rows:
        r["diff_us"] = r["graphed_us"] - r["eager_us"]
    rows.sort(key=lambda r: -abs(r["diff_us"]))
    total = sum(r["diff_us"] for r in rows)
    print(f"  model.fp8={name} against {base}: kernels per step {total:+.1f} us in all; the largest differences:")
    for r in rows[:top]:
        print(f"    {r['diff_us']:+9.1f} us  ({r['eager_us']:8.1f} -> {r['graphed_us']:8.1f} us, calls "
              f"{r['eager_calls']:.0f} -> {r['graphed_calls']:.0f})  {r['name'][:140]}")
    return rows[:top]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--recipes", nargs="+", choices=RECIPES, default=None,
                   help="default: every recipe on the CPU; on CUDA all but mxfp8, whose GEMM is an fp32 matmul "
                        "there (emulated; name it to time it)")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["8b", "70b"])
    p.add_argument("--tokens", type=int, default=None, help="GEMM rows M (default 8192 on CUDA, 128 on CPU)")
    p.add_argument("--ceiling-n", type=int, default=None, help="ceiling matmul size (default 8192 CUDA, 1024 CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per GEMM (median; default 20 / 3)")
    p.add_argument("--preset", default=None, help="train-step preset (default gpu-1b on CUDA, cpu-tiny on CPU)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="model.dtype (default bf16 / fp32)")
    p.add_argument("--steps", type=int, default=None, help="timed train steps per side (default 10 / 3)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="train-step micro-batch size (default: the preset's whole batch, one micro-batch)")
    p.add_argument("--weight-cache-ab", action="store_true",
                   help="also time each recipe with model.fp8_weight_cache=false (same run)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time none and each recipe with model.cuda_graph=layers (CUDA only; same run)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--skip", choices=("gemms", "host", "step"), action="append", default=[])
    p.add_argument("--host-shape", type=int, nargs=3, default=[16, 16, 16], metavar=("M", "N", "K"),
                   help="the linear the host time is measured at (multiples of 16)")
    p.add_argument("--host-profile", type=int, default=0, metavar="TOP",
                   help="with the host section: each side's host time by function (cProfile, own time per call), "
                        "the TOP largest")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--profile", default=None, metavar="MODEL:LINEAR",
                   help="only profile one linear's forward + backward per recipe, kernel by kernel (e.g. 8b:qkv)")
    p.add_argument("--profile-top", type=int, default=None,
                   help="kernels listed per side with --profile or --profile-step (default 15)")
    p.add_argument("--profile-step", action="store_true",
                   help="CUDA: after each side's timed steps, its kernels over 2 more steps, and the share of the "
                        "step the GPU was busy")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no GPU visible to torch")
    for flag, val in (("--tokens", args.tokens), ("--ceiling-n", args.ceiling_n), ("--repeats", args.repeats),
                      ("--steps", args.steps)):
        if val is not None and val < 1:
            p.error(f"{flag}={val} must be a positive integer (or leave it out for the default)")
    if {"gemms", "host", "step"} <= set(args.skip) and not args.profile:
        p.error("--skip gemms --skip host --skip step leaves nothing to run")
    if "host" in args.skip and args.host_shape != [16, 16, 16]:
        p.error("--host-shape applies to the host section, which --skip host leaves out")
    if args.host_profile and ("host" in args.skip or args.profile):
        p.error("--host-profile profiles the host section, which --skip host (or --profile) leaves out")
    if args.host_profile < 0:
        p.error(f"--host-profile={args.host_profile}: give the number of functions to list (e.g. 12)")
    args.recipes = args.recipes or [r for r in RECIPES if not (cuda and r == "mxfp8")]
    args.tokens = args.tokens if args.tokens is not None else (8192 if cuda else 128)
    args.ceiling_n = args.ceiling_n if args.ceiling_n is not None else (8192 if cuda else 1024)
    args.repeats = args.repeats if args.repeats is not None else (20 if cuda else 3)
    args.preset = args.preset or ("gpu-1b" if cuda else "cpu-tiny")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.steps = args.steps if args.steps is not None else (10 if cuda else 3)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tokens % 16:
        p.error(f"--tokens={args.tokens} must be a multiple of 16 (FP8 GEMM alignment)")
    if any(v < 16 or v % 16 for v in args.host_shape):
        p.error(f"--host-shape={args.host_shape} must be positive multiples of 16 (FP8 GEMM alignment), e.g. 16 16 16")
    if "step" in args.skip or args.profile:
        for flag, val in (("--micro-batch", args.micro_batch), ("--weight-cache-ab", args.weight_cache_ab),
                          ("--cuda-graph", args.cuda_graph)):
            if val:
                p.error(f"{flag} applies to the train step, which --skip step / --profile leave out")
    if args.cuda_graph and not cuda:
        p.error("--cuda-graph times the step with CUDA graphs: give --device cuda")
    if args.micro_batch is not None:
        from tools.bench_train_step import PRESETS
        batch = PRESETS[args.preset]["batch"]
        if args.micro_batch < 1 or batch % args.micro_batch:
            p.error(f"--micro-batch={args.micro_batch} must divide the {args.preset} preset's batch of {batch}")
    res = {"date": datetime.date.today().isoformat(), "device": args.device, "torch": torch.__version__,
           "machine": torch.cuda.get_device_name(0) if cuda else f"CPU, {torch.get_num_threads()} threads",
           "command": "python3 tools/bench_fp8.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    run = _timer(args.device)
    if args.profile_step and (args.device != "cuda" or "step" in args.skip or args.profile):
        p.error("--profile-step profiles the train step on CUDA: give --device cuda, without --skip step or --profile")
    if args.profile is None and not args.profile_step and args.profile_top is not None:
        p.error("--profile-top is read with --profile or --profile-step only")
    args.profile_top = args.profile_top if args.profile_top is not None else 15
    if args.profile:
        model, _, lin = args.profile.partition(":")
        if model not in MODELS or lin not in ("qkv", "out", "fc1", "fc2"):
            p.error(f"--profile={args.profile!r}: give MODEL:LINEAR, MODEL one of {sorted(MODELS)}, LINEAR one of "
                    "qkv out fc1 fc2 (e.g. 8b:qkv)")
        res["profile"] = profile_layer(args)
        args.skip = ["gemms", "host", "step"]
    if "gemms" not in args.skip:
        res["gemms"] = bench_gemms(args, run)
        from engine.ops.fp8_linear import GEMM_PATHS
        res["gemms"]["paths"] = dict(GEMM_PATHS)  # blockwise: torch's native kernel or the per-slice loop
        print("blockwise GEMM paths: " + ("; ".join(f"{k}: {v}" for k, v in GEMM_PATHS.items() if k.startswith("blockwise"))
                                           or "not run"))
        c = res["gemms"]["ceilings"]
        hpn = res["gemms"]["baseline_dtype"]
        print(f"ceilings ({args.ceiling_n}^3): {hpn} matmul {c['hp_matmul_tflops']:.3f} TFLOP/s, "
              f"fp8 _scaled_mm {c['fp8_scaled_mm_tflops']:.3f} TFLOP/s")
        print(f"{'layer':>12} {'M x N x K':>20} {hpn + ' fwd':>9} {hpn + ' f+b':>9} | " +
              " | ".join(f"{r:>10} fwd {'f+b':>6} {'rel':>7}" for r in args.recipes) + "   (TFLOP/s)")
        for row in res["gemms"]["layers"]:
            cells = " | ".join(f"{row[r]['fwd_gemm_tflops']:>14.3f} {row[r]['step_tflops']:>6.3f} "
                               f"{row[r]['vs_reference_rel']:>7.1e}" for r in args.recipes)
            print(f"{row['model'] + ' ' + row['linear']:>12} {row['M']:>6} x {row['N']:>5} x {row['K']:>5} "
                  f"{row['hp_fwd_tflops']:>9.3f} {row['hp_step_tflops']:>9.3f} | {cells}")
    if "host" not in args.skip:
        res["host"] = h = bench_host(args)
        base = h["sides"]["hp"]
        print(f"host time to issue one linear forward + backward ({' x '.join(map(str, h['shape']))}), median of 5 x 50 "
              f"calls, and the computing ops dispatched:")
        for name, v in h["sides"].items():
            label = f"{h['baseline_dtype']} F.linear" if name == "hp" else name
            print(f"  {label:<18} {v['host_us']:8.1f} us  ({v['host_us'] / base['host_us']:.2f}x)  {v['ops']:3d} ops: "
                  + ", ".join(f"{k} {c}" for k, c in v["op_counts"].items()))
            for r in v.get("profile", []):  # --host-profile: own time per call (under cProfile, which adds its own)
                print(f"      {r['own_us']:8.1f} us  x{r['calls']:<5.3g} {r['where']}")
    if "step" not in args.skip:
        res["step"] = bench_step(args)
        s = res["step"]
        print(f"train step, preset {s['preset']} ({s['dtype']}), batch {s['batch']} in micro-batches of "
              f"{s['micro_batch']}, median of {args.steps}:")
        for k in s["sides"]:
            v = s[k]
            extra = (f", peak {v['peak_mem_gib']:.1f} GiB (reserved {v['peak_reserved_gib']:.1f}), loss "
                     f"{v['last_loss']:.4f}" if "peak_mem_gib" in v else "")
            if "device_busy_s" in v and "device_busy_s" in s["none"]:  # --profile-step: kernels alone
                extra += (f", kernels {v['device_busy_s'] * 1e3:.1f} ms "
                          f"({s['none']['device_busy_s'] / v['device_busy_s']:.3f}x none's)")
            if k.endswith("/nocache"):  # the same recipe with its weight casts reused, over this side
                extra += f"   (weight cache: {v['step_s'] / s[k.split('/')[0]]['step_s']:.3f}x)"
            if k.endswith("/graph"):  # the same side eager, over this one; and over none's graphed step
                extra += (f"   (graphs: {s[k.split('/')[0]]['step_s'] / v['step_s']:.3f}x eager; "
                          f"{s['none/graph']['step_s'] / v['step_s']:.3f}x none/graph)")
            print(f"  model.fp8={k:<18} {v['step_s'] * 1e3:9.1f} ms   speed-up vs none {v['speedup_vs_none']:.3f}x, "
                  f"{v['ops_per_step']} ops{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
