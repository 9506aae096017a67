"""Benchmark: communication hidden under compute. The same layout with parallel.tp_overlap = none and
ring, launched alternately (none, ring, none, ring, ...) through tools/pretrain.py under torchrun,
one thread per rank; from each run's metrics.jsonl (rank 0) the medians over the timed steps of:

    step_time_s          wall seconds per step
    comm_exposed_s_tp    seconds blocked in tensor-parallel communication (nothing computed under it)
    comm_exposed_s       the same over every axis
    comm_bytes_tp        bytes sent over tp (must be equal: the ring moves the plain path's bytes)

and the ratios ring / none. The losses of both modes are compared step by step (the ring changes
only the summation order: they agree to fp32 rounding).

    .venv/bin/python tools/bench_overlap.py --json docs/benchmarks/overlap.json
    python3 tools/bench_overlap.py --gemm-overhead --device cuda   (one GPU: the chunk GEMMs' overhead)

Layouts (default): tp2 on 2 ranks, tp4 on 4 ranks (4 kv heads), tp2 x pp2 on 4 ranks, all with
sequence parallelism, 8 x 512 tokens per step, on the CPU preset (configs/tiny_llama_cpu.toml; data from tools/prepare_corpus.py).
On a machine with fewer cores than ranks the ranks and gloo's transfer threads share cores, so a
smaller exposed time need not give a shorter step; docs/overlap.md says what the numbers mean.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {"tp2": dict(world=2, tp=2, pp=1), "tp4": dict(world=4, tp=4, pp=1, sets=["model.num_key_value_heads=4"]),
           "tp2xpp2": dict(world=4, tp=2, pp=2),
           "tp2xpp2-early": dict(world=4, tp=2, pp=2, sets=["parallel.p2p_early_recv=true"])}
# tp4: the preset's 2 kv heads do not split 4 ways; -early: pipeline receives posted one action ahead
KEYS = ("step_time_s", "comm_exposed_s", "comm_exposed_s_tp", "comm_exposed_s_pp", "comm_bytes_tp")


def run_once(layout: str, mode: str, args, run_dir: str) -> list[dict]:
    lay = LAYOUTS[layout]
    sets = [f"parallel.tp={lay['tp']}", f"parallel.pp={lay['pp']}", "parallel.dp=1", "parallel.sequence_parallel=true",
            f"parallel.tp_overlap={mode}", f"train.steps={args.steps}", "optim.warmup_steps=1", "train.log_interval=1",
            "train.eval_interval=0", "checkpoint.interval=0", "logging.progress_bar=off", "logging.tensorboard=false",
            f"train.global_batch_size={args.global_batch}", f"train.micro_batch_size={args.micro_batch}",
            f"train.seq_length={args.seq}", f"model.max_position_embeddings={max(256, args.seq)}",
            *lay.get("sets", []), *args.set]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(lay["world"]),
           os.path.join(ROOT, "tools", "pretrain.py"), "--config", args.config, "--run-dir", run_dir]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    path = os.path.join(run_dir, "metrics.jsonl")
    recs = []
    if os.path.exists(path):
        with open(path) as f:
            recs = [r for r in map(json.loads, f) if r.get("split") == "train"]
    if proc.returncode:
        raise SystemExit(f"bench_overlap: {layout} {mode} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return recs


def gemm_overhead(args) -> dict:
    """One device, no communication: the ring's GEMMs (tp chunk GEMMs of s/tp rows, written into
    slices) against the one GEMM of the plain path, at Llama-3 8B fc1 / fc2 shapes per TP degree."""
    import torch
    import torch.nn.functional as F

    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    tokens = args.tokens or (8192 if dev == "cuda" else 512)
    h, ffn = 4096, 14336
    reps = 20 if dev == "cuda" else 3

    def timed(fn):
        if dev == "cuda":
            from tools.bench_train_step import _time_cuda
            fn()
            return statistics.median(_time_cuda(fn, n=reps)[1])
        fn()
        times = []
        for _ in range(reps):
            import time
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    out = {"device": dev, "dtype": str(dtype), "tokens": tokens, "rows": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for tp in args.tp_degrees:
        n = tokens // tp
        for name, (o, k) in {"fc1 (column)": (2 * ffn // tp, h), "fc2 (row)": (h, ffn // tp)}.items():
            x = torch.randn(tokens, k, device=dev, dtype=dtype, generator=g)
            w = torch.randn(o, k, device=dev, dtype=dtype, generator=g)
            y = torch.empty(tokens, o, device=dev, dtype=dtype)

            def chunked():
                for c in range(tp):
                    y[c * n:(c + 1) * n].copy_(F.linear(x[c * n:(c + 1) * n], w))
            plain_s, ring_s = timed(lambda: F.linear(x, w)), timed(chunked)
            out["rows"].append({"tp": tp, "linear": name, "M": tokens, "N": o, "K": k, "plain_s": plain_s,
                                "ring_s": ring_s, "overhead": ring_s / plain_s})
            print(f"tp{tp} {name:>13}: {tokens} x {o} x {k}: one GEMM {plain_s * 1e3:.3f} ms, {tp} chunk GEMMs "
                  f"{ring_s * 1e3:.3f} ms ({ring_s / plain_s:.3f}x)", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["tp2", "tp4", "tp2xpp2", "tp2xpp2-early"])
    p.add_argument("--repeats", type=int, default=2, help="launches per mode, alternating (default 2)")
    p.add_argument("--steps", type=int, default=8, help="steps per launch; the first is not timed")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--config", default="tiny_llama_cpu")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    p.add_argument("--json", default=None)
    p.add_argument("--gemm-overhead", action="store_true",
                   help="only the one-device overhead of the ring's chunk GEMMs vs one GEMM (8B shapes; no launch)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="for --gemm-overhead")
    p.add_argument("--tokens", type=int, default=None, help="for --gemm-overhead (default 8192 CUDA, 512 CPU)")
    p.add_argument("--tp-degrees", type=int, nargs="+", default=[2, 4, 8], help="for --gemm-overhead")
    args = p.parse_args(argv)
    if args.gemm_overhead:
        res = gemm_overhead(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    if args.steps < 2 or args.repeats < 1:
        p.error("--steps must be >= 2 and --repeats >= 1")
    res = {"date": datetime.date.today().isoformat(), "machine": f"{os.cpu_count()} CPU cores, gloo, 1 thread per rank",
           "command": "python tools/bench_overlap.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "layouts": {}}
    for layout in args.layouts:
        samples = {m: {k: [] for k in KEYS} for m in ("none", "ring")}
        losses = {}
        with tempfile.TemporaryDirectory(prefix="tessel_overlap_") as tmp:
            for rep in range(args.repeats):
                for mode in ("none", "ring") if rep % 2 == 0 else ("ring", "none"):
                    recs = run_once(layout, mode, args, os.path.join(tmp, f"{mode}{rep}"))
                    losses.setdefault(mode, [r["loss"] for r in recs])
                    for r in recs[1:]:
                        for k in KEYS:
                            samples[mode][k].append(r.get(k, 0.0))
        out = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in samples.items()}
        base, ring = out["none"], out["ring"]
        out["ratio_ring_over_none"] = {k: (ring[k] / base[k] if base[k] else None) for k in KEYS}
        out["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(losses["ring"], losses["none"]))
        res["layouts"][layout] = out
        r = out["ratio_ring_over_none"]
        print(f"{layout}: step {base['step_time_s']:.3f} s -> {ring['step_time_s']:.3f} s ({r['step_time_s']:.2f}x); "
              f"exposed tp {base['comm_exposed_s_tp']:.3f} s -> {ring['comm_exposed_s_tp']:.3f} s "
              f"({r['comm_exposed_s_tp']:.2f}x); exposed all {base['comm_exposed_s']:.3f} -> "
              f"{ring['comm_exposed_s']:.3f} s; tp bytes equal: {base['comm_bytes_tp'] == ring['comm_bytes_tp']}; "
              f"losses agree to {out['loss_max_rel_diff']:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
