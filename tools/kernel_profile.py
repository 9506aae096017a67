"""Where a callable spends its time, kernel by kernel: the shared helper of the benchmarks' ``--profile``
options (tools/bench_fp8.py, tools/bench_attention.py, tools/bench_train_step.py).

``kernel_table(fn, device=..., repeats=...)`` runs ``fn`` ``warmup`` times (2: kernel selection, allocator), then
``repeats`` times under torch.profiler, and sums each kernel's self time by name per call: CUDA kernel
time on a GPU (host gaps between kernels do not show), CPU op time on the CPU.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

if __name__ == "__main__":  # a library module: say which commands run it
    sys.exit("tools/kernel_profile.py is the library behind `tools/bench_fp8.py --profile MODEL:LINEAR` and "
             "`tools/bench_attention.py --profile-cp CP`; run one of those (--help)")


def kernel_table(fn: Callable[[], object], *, device: str, repeats: int, warmup: int = 2) -> dict:
    """``{"total_us": per-call sum, "kernels": [{"name", "us", "calls"}, ...] largest first}`` (``us`` and
    ``calls`` per call of ``fn``), after ``warmup`` unprofiled calls."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        for _ in range(repeats):
            fn()
        if cuda:
            torch.cuda.synchronize()
    per: dict[str, float] = {}
    calls: dict[str, float] = {}
    for e in prof.key_averages():
        t = e.self_device_time_total if cuda else e.self_cpu_time_total  # microseconds, all calls
        if t > 0 and (not cuda or e.device_type.name == "CUDA"):
            per[e.key] = per.get(e.key, 0.0) + t / repeats
            calls[e.key] = calls.get(e.key, 0.0) + e.count / repeats
    rows = sorted(per.items(), key=lambda kv: -kv[1])
    return {"total_us": sum(per.values()), "kernels": [{"name": k, "us": v, "calls": calls[k]} for k, v in rows]}


def print_kernel_table(title: str, table: dict, *, top: int) -> None:
    """``title``, the per-call total, then the ``top`` kernels with their share."""
    total = table["total_us"]
    print(f"{title}: {total:9.1f} us per call")
    for row in table["kernels"][:top]:
        print(f"    {row['us']:9.1f} us {100 * row['us'] / max(total, 1e-9):5.1f}%  {row['name'][:160]}")
