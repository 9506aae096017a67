"""Benchmark: data-parallel step time with the gradient reduction overlapped with backward, vs not.

Runs ``--dp`` ranks (gloo, CPU, spawned by parallel.testing.run_distributed). Every rank builds one
MLP (``--layers`` x Linear(h, h) + GELU) and wraps identical copies of it in DataParallel with
``overlap_grad_reduce`` on and off (for ZeRO stage 0 and 1); the configurations are timed
round-robin in the same processes, so machine noise hits them alike. Also measured, as the ceiling
of what overlap can achieve on this machine:

* compute: forward + backward with no communication (inside ``no_sync``);
* comm: the bucketed reduction of the same gradient buffer alone (no compute);
* ideal overlapped step = max(compute, comm); fully serial step = compute + comm.

Timed region per step: zero_grad, forward, backward, ``finish_grad_sync`` (the optimizer update is
identical in both modes and is left out). Reported: min and median over ``--steps`` steps of the
slowest rank's time (min is the least disturbed by other load on a shared machine).

    .venv/bin/python tools/bench_dp_overlap.py --out docs/benchmarks/dp_overlap.json
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parallel.data_parallel import DataParallel  # noqa: E402
from parallel.testing import run_distributed  # noqa: E402


def _model(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def _barrier_max(t: float) -> float:
    """The slowest rank's time (a step is as slow as its slowest replica)."""
    x = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x)


def _time_grad_step(ddp, x, *, no_comm: bool = False) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    ddp.zero_grad_buffer()
    if no_comm:
        with ddp.no_sync():
            ddp(x).square().mean().backward()
    else:
        ddp(x).square().mean().backward()
        ddp.finish_grad_sync()
    return _barrier_max(time.perf_counter() - t0)


def _time_comm_only(ddp) -> float:
    """Launch every bucket's reduction back to back and wait: the communication alone."""
    ddp.zero_grad_buffer()  # re-arm every bucket
    dist.barrier()
    t0 = time.perf_counter()
    ddp.finish_grad_sync()  # all buckets are "open": launches them in order, then waits
    t = _barrier_max(time.perf_counter() - t0)
    ddp.zero_grad_buffer()
    return t


def _rank_main(args: dict) -> dict:
    from parallel.mesh import Mesh, ParallelDims
    mesh = Mesh.build(ParallelDims(dp=args["dp"]))
    base = _model(args["hidden"], args["layers"])
    g = torch.Generator().manual_seed(mesh.dp.rank)
    x = torch.randn(args["batch"], args["hidden"], generator=g)
    configs = {}
    for zero in (0, 1):
        for overlap in (True, False):
            configs[f"zero{zero}_overlap_{'on' if overlap else 'off'}"] = DataParallel(
                copy.deepcopy(base), dp_group=mesh.dp, zero_stage=zero, overlap_grad_reduce=overlap,
                bucket_size_mb=args["bucket_mb"])
    compute_ddp = configs["zero0_overlap_off"]
    times = {name: [] for name in configs}
    times["compute_only"], times["comm_only_zero0"], times["comm_only_zero1"] = [], [], []
    for it in range(args["warmup"] + args["steps"]):
        record = it >= args["warmup"]
        for name, ddp in configs.items():
            t = _time_grad_step(ddp, x)
            if record:
                times[name].append(t)
        t = _time_grad_step(compute_ddp, x, no_comm=True)
        if record:
            times["compute_only"].append(t)
        for zero in (0, 1):
            t = _time_comm_only(configs[f"zero{zero}_overlap_off"])
            if record:
                times[f"comm_only_zero{zero}"].append(t)
    buf = compute_ddp.flat_buffers[0]
    return {"median_s": {k: statistics.median(v) for k, v in times.items()},
            "min_s": {k: min(v) for k, v in times.items()},
            "buckets": len(buf.buckets), "grad_buffer_bytes": buf.numel * 4,
            "memory": _memory(mesh, base, x, args)}


def _memory(mesh, base, x, args) -> list[dict]:
    """Bytes per rank after one bf16 mixed-precision step, per ZeRO stage, measured from the tensors."""
    from engine.optim import LRSchedule, Optimizer
    rows = []
    for zero in (0, 1, 2):
        model = copy.deepcopy(base).bfloat16()
        ddp = DataParallel(model, dp_group=mesh.dp, zero_stage=zero, bucket_size_mb=args["bucket_mb"],
                           max_inflight_buckets=1 if zero == 2 else None)
        opt = Optimizer(ddp, schedule=LRSchedule(lr=1e-3, total_steps=1))
        opt.zero_grad()
        ddp(x.bfloat16()).float().square().mean().backward()
        opt.step()
        buf = ddp.flat_buffers[0]
        rows.append(dict(zero_stage=zero, psi=buf.numel_unpadded, padded=buf.numel, dp=mesh.dp.size,
                         param_bytes=buf.param_data.numel() * buf.param_data.element_size(),
                         grad_bytes=ddp.grad_buffer_bytes(), grad_transient_peak_bytes=ddp.lazy_grad_bytes_peak,
                         optimizer_state_bytes=opt.state_bytes()))
        del opt, ddp, model
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    if a.dp < 2:
        raise SystemExit("--dp must be >= 2 (there is nothing to reduce on one rank)")
    args = dict(dp=a.dp, hidden=a.hidden, layers=a.layers, batch=a.batch, bucket_mb=a.bucket_mb, steps=a.steps,
                warmup=a.warmup)
    res = run_distributed(_rank_main, a.dp, args, timeout=1800, threads_per_rank=a.threads)[0]
    rows = []
    for stat in ("min", "median"):  # min: least disturbed by other load; median: typical
        t = res[f"{stat}_s"]
        for zero in (0, 1):
            on, off = t[f"zero{zero}_overlap_on"], t[f"zero{zero}_overlap_off"]
            compute, comm_t = t["compute_only"], t[f"comm_only_zero{zero}"]
            rows.append(dict(stat=stat, zero_stage=zero, overlap_on_ms=on * 1e3, overlap_off_ms=off * 1e3,
                             speedup=off / on, compute_only_ms=compute * 1e3, comm_only_ms=comm_t * 1e3,
                             ideal_overlapped_ms=max(compute, comm_t) * 1e3, serial_ms=(compute + comm_t) * 1e3,
                             ideal_speedup=(compute + comm_t) / max(compute, comm_t)))
    print(f"dp={a.dp}  MLP {a.layers} x Linear({a.hidden},{a.hidden})  batch/rank={a.batch}  "
          f"buckets={res['buckets']} ({a.bucket_mb} MB)  grad buffer {res['grad_buffer_bytes'] / 2**20:.1f} MiB  "
          f"threads/rank={a.threads}  cores={os.cpu_count()}  load average {os.getloadavg()[0]:.1f}")
    print(f"{'stat':>6} {'zero':>4} {'overlap on':>11} {'overlap off':>12} {'speedup':>8} | {'compute':>8} "
          f"{'comm':>8} {'ideal':>8} {'serial':>8} {'ideal speedup':>14}   (ms over steps, slowest rank)")
    for r in rows:
        print(f"{r['stat']:>6} {r['zero_stage']:>4} {r['overlap_on_ms']:>11.1f} {r['overlap_off_ms']:>12.1f} {r['speedup']:>8.2f} | "
              f"{r['compute_only_ms']:>8.1f} {r['comm_only_ms']:>8.1f} {r['ideal_overlapped_ms']:>8.1f} "
              f"{r['serial_ms']:>8.1f} {r['ideal_speedup']:>14.2f}")
    print("\nbytes per rank after one bf16 step (fp32 main grads, fp32 masters + Adam moments), measured:")
    print(f"{'zero':>4} {'params':>10} {'grads':>10} {'grad peak*':>10} {'opt state':>10} {'B/param':>8}"
          "   (*transient fp32 buckets, ZeRO-2 only; one micro-batch, 1 bucket in flight)")
    for m in res["memory"]:
        total = m["param_bytes"] + m["grad_bytes"] + m["grad_transient_peak_bytes"] + m["optimizer_state_bytes"]
        m["bytes_per_param"] = total / m["psi"]
        print(f"{m['zero_stage']:>4} {m['param_bytes'] / 2**20:>8.1f}Mi {m['grad_bytes'] / 2**20:>8.1f}Mi "
              f"{m['grad_transient_peak_bytes'] / 2**20:>8.1f}Mi {m['optimizer_state_bytes'] / 2**20:>8.1f}Mi "
              f"{m['bytes_per_param']:>8.2f}")
    out = dict(benchmark="bench_dp_overlap", date=datetime.date.today().isoformat(),
               machine=dict(platform=platform.platform(), cores=os.cpu_count(), torch=torch.__version__,
                            backend="gloo", loadavg_after=os.getloadavg()),
               command="python tools/bench_dp_overlap.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               args=args, threads_per_rank=a.threads, buckets=res["buckets"],
               grad_buffer_bytes=res["grad_buffer_bytes"], rows=rows, memory=res["memory"])
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
