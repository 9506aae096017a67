"""Benchmark: mixture-of-experts expert compute and dispatch (docs/moe.md), on the CPU or a GPU.

Part 1, one process: the SwiGLU experts over ``--tokens`` x ``--top-k`` routed rows (balanced routing,
``--experts`` experts of FFN ``--ffn``), forward + backward, computed three ways in the same run:

* ``loop``: a loop over experts, one pair of matmuls each (``MoELayer(expert_gemm="reference")``);
* ``grouped``: one grouped GEMM per projection (``engine.ops.grouped_gemm``, ``torch._grouped_mm``),
  where this torch runs it on this device;
* ``dense``: the same FLOPs as ONE expert over all the rows (the dense-equivalent ceiling of the loop).

Each is the median of ``--repeats`` timed runs after a warm-up, with its ratio to ``loop``. The machine's
ceiling from the same run: the dense fp32 1024^3 matmul rate.

Part 2, ``--ep`` ranks spawned (gloo on CPU): the whole MoE layer (router, dispatch, experts, combine),
forward + backward, with the ``alltoall`` and ``allgather`` dispatchers at each ep size, each rank on its
own ``--tokens`` tokens; the median step time of rank 0, its ratio to the ep = 1 layer on the same tokens
timed in the same child, and the all-to-all bytes rank 0 sent per step (ledger).

    .venv/bin/python tools/bench_moe.py --json runs/bench_moe.json
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--ep", default="2,4", help="comma-separated ep sizes for part 2; empty skips it")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _median_time(fn, *, warmup: int, repeats: int) -> tuple[float, list[float]]:
    """Median seconds of ``fn``; on CUDA each call is synchronised (the GPU's work, not the launch)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def _layer(args, *, tp, ep, dispatcher="alltoall", gemm="reference"):
    from parallel.expert_parallel import MoELayer, default_init

    return MoELayer(hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_experts=args.experts, top_k=args.top_k,
                    tp_group=tp, ep_group=ep, dispatcher=dispatcher, expert_gemm=gemm, init=default_init(0.02))


def expert_compute(args, device) -> list[dict]:
    from engine.ops.grouped_gemm import grouped_mm
    from parallel.comm import Group

    layer = _layer(args, tp=Group.trivial("tp"), ep=Group.trivial("ep"))
    rows_n = args.tokens * args.top_k
    counts = [rows_n // args.experts + (e < rows_n % args.experts) for e in range(args.experts)]
    dtype = DTYPES[args.dtype]
    rows = torch.randn(rows_n, args.hidden, device=device, dtype=dtype)
    dy = torch.randn(rows_n, args.hidden, device=device, dtype=dtype)
    layer.to(device=device, dtype=dtype)
    experts = list(layer.experts.values())

    def loop():
        layer.expert_gemm = "reference"
        (layer._run_experts(rows, counts) * dy).sum().backward()

    def grouped():
        fc1 = torch.stack([e.fc1.weight for e in experts])  # (E, 2f, h)
        fc2 = torch.stack([e.fc2.weight for e in experts])  # (E, h, f)
        gate, up = grouped_mm(rows, fc1, counts, backend="torch").chunk(2, dim=-1)
        (grouped_mm(torch.nn.functional.silu(gate) * up, fc2, counts, backend="torch") * dy).sum().backward()

    def dense():
        (experts[0](rows) * dy).sum().backward()

    out = []
    flops = 3 * 2 * 3 * rows_n * args.hidden * args.ffn  # fwd + bwd of three h x f matmuls per row
    for name, fn in (("loop", loop), ("grouped", grouped), ("dense", dense)):
        try:
            med, all_ = _median_time(fn, warmup=args.warmup, repeats=args.repeats)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            out.append({"impl": name, "error": str(e).splitlines()[0]})
            continue
        out.append({"impl": name, "s_median": med, "s_all": all_, "tflops": flops / med / 1e12})
    base = out[0]["s_median"]
    for r in out:
        if "s_median" in r:
            r["ratio_vs_loop"] = r["s_median"] / base
    return out


def _dispatch_child(args_dict: dict, ep: int) -> dict:
    """One spawned rank: the MoE layer at ep and at ep = 1 (same tokens), both dispatchers."""
    import torch.distributed as dist

    from parallel.comm import Group
    from parallel.mesh import Mesh, ParallelDims

    args = argparse.Namespace(**args_dict)
    torch.set_num_threads(args.threads)
    mesh = Mesh.build(ParallelDims(dp=ep, ep=ep))
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.tokens, 1, args.hidden, generator=g)
    res = {}
    layers = {"ep1": _layer(args, tp=Group.trivial("tp"), ep=Group.trivial("ep"))}
    for d in ("alltoall", "allgather"):
        layers[d] = _layer(args, tp=Group.trivial("tp"), ep=mesh.ep, dispatcher=d)
    for name, layer in layers.items():
        def step():
            layer(x.requires_grad_()).sum().backward()
        mesh.ledger.reset()
        med, all_ = _median_time(step, warmup=args.warmup, repeats=args.repeats)
        sent = mesh.ledger.total("sent_bytes", op="all_to_all", axis="ep") / (args.warmup + args.repeats)
        res[name] = {"s_median": med, "s_all": all_, "a2a_sent_bytes_per_step": sent}
    return res


def dispatch(args) -> list[dict]:
    from parallel.testing import run_distributed

    rows = []
    for ep in [int(v) for v in args.ep.split(",") if v.strip()]:
        r0 = run_distributed(_dispatch_child, ep, vars(args), ep, timeout=600)[0]
        for d in ("alltoall", "allgather"):
            rows.append({"ep": ep, "dispatcher": d, **r0[d], "ep1_s_median": r0["ep1"]["s_median"],
                         "ratio_vs_ep1": r0[d]["s_median"] / r0["ep1"]["s_median"]})
    return rows


def matmul_tflops(device, dtype=torch.float32, n: int = 1024) -> float:
    """The machine's dense matmul rate in ``dtype`` at n^3 (the ceiling the expert GEMMs are read against)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    med, _ = _median_time(lambda: a @ b, warmup=2, repeats=5)
    return 2 * n ** 3 / med / 1e12


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    n = 8192 if device == "cuda" else 1024
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.platform(), "device": device, "torch": torch.__version__, "args": vars(args),
              "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
              "matmul_ceiling_n": n, "matmul_ceiling_tflops": matmul_tflops(device, DTYPES[args.dtype], n),
              "experts": expert_compute(args, device), "dispatch": dispatch(args)}
    print(f"expert compute, {args.tokens} tokens x top-{args.top_k}, {args.experts} experts, h={args.hidden}, "
          f"f={args.ffn}, {args.dtype}, fwd+bwd ({device}; {n}^3 {args.dtype} matmul "
          f"{result['matmul_ceiling_tflops']:.3f} TFLOP/s):")
    for r in result["experts"]:
        line = (f"{r['s_median'] * 1e3:9.2f} ms  x{r['ratio_vs_loop']:.2f} vs loop  {r['tflops']:.3f} TFLOP/s"
                if "s_median" in r else f"unavailable: {r['error']}")
        print(f"  {r['impl']:8s} {line}")
    if result["dispatch"]:
        print("MoE layer step (rank 0, fwd+bwd):")
    for r in result["dispatch"]:
        print(f"  ep={r['ep']} {r['dispatcher']:9s} {r['s_median'] * 1e3:9.2f} ms  x{r['ratio_vs_ep1']:.2f} vs ep=1  "
              f"all-to-all sent {r['a2a_sent_bytes_per_step']:.0f} B/step")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
