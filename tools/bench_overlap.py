"""Benchmark: communication hidden under compute. The same layout with parallel.tp_overlap = none and
ring (``--modes``: symm_mem too, on GPUs), launched alternately (none, ring, ring, none, ...) through
tools/pretrain.py under torchrun, one thread per rank on the CPU (gloo), one GPU per rank where torch
sees GPUs (NCCL: exposed time from CUDA events, docs/overlap.md); from each run's metrics.jsonl (rank 0)
the medians over the timed steps of:

    step_time_s          wall seconds per step
    comm_exposed_s_tp    seconds blocked in tensor-parallel communication (nothing computed under it)
    comm_exposed_s       the same over every axis
    comm_bytes_tp        bytes sent over tp (must be equal: the ring moves the plain path's bytes)

and the ratios mode / none. The losses of each mode are compared with none's step by step (the overlap
changes only the summation order: they agree to fp32 rounding).

    .venv/bin/python tools/bench_overlap.py --json docs/benchmarks/overlap.json
    .venv/bin/python tools/bench_overlap.py --no-breakdown --layouts tp2 tp4   (without the breakdown launches)
    .venv/bin/python tools/bench_overlap.py --loss   (the loss's MAX all-reduce in line vs hidden, tp2 and tp4)
    python3 tools/bench_overlap.py --gemm-overhead --device cuda   (one GPU: the chunk GEMMs' overhead)
    python3 tools/bench_overlap.py --modes none ring symm_mem --layouts tp2 tp4 --config llama3_8b \
        --set model.num_layers=8 --set data.paths=PREFIX --set data.tokenizer=TOKENIZER.json \
        --seq 4096 --global-batch 8 --micro-batch 1    (4+ NVLink GPUs; not yet run anywhere)

The breakdown (on by default) adds one launch per mode with a flight recorder (parallel/flight.py) on
every rank: each rank's tensor-parallel blocked time per kind of call (ring waits, the loss's hidden-MAX
wait, each synchronous collective), split into "peer late" (the last rank of the group entered the call,
or posted the round's transfers, after this rank began to wait: a slower or descheduled peer) and the
rest (time after every rank had arrived: transfer and progress), averaged over the ranks and the timed
steps. Its launches are separate from the timed ones, so its totals need not equal theirs.

Layouts (default): tp2 on 2 ranks, tp4 on 4 ranks (4 kv heads), tp2 x pp2 on 4 ranks (and the same with
pipeline receives posted early), all with sequence parallelism, 8 x 512 tokens per step, on the CPU
preset (configs/tiny_llama_cpu.toml; data from tools/prepare_corpus.py).
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
if ROOT not in sys.path:  # `python3 tools/bench_overlap.py` from anywhere: tools.* and engine.* import
    sys.path.insert(0, ROOT)
LAYOUTS = {"tp2": dict(world=2, tp=2, pp=1), "tp4": dict(world=4, tp=4, pp=1), "tp2xpp2": dict(world=4, tp=2, pp=2),
           "tp2xpp2-early": dict(world=4, tp=2, pp=2, sets=["parallel.p2p_early_recv=true"])}
# -early: pipeline receives posted one action ahead
KEYS = ("step_time_s", "comm_exposed_s", "comm_exposed_s_tp", "comm_exposed_s_pp", "comm_bytes_tp")


def run_once(layout: str, mode: str, args, run_dir: str, *, flights: bool = False) -> list[dict]:
    lay = LAYOUTS[layout]
    sets = [f"parallel.tp={lay['tp']}", f"parallel.pp={lay['pp']}", "parallel.dp=1", "parallel.sequence_parallel=true",
            f"parallel.tp_overlap={mode}", f"train.steps={args.steps}", "optim.warmup_steps=1", "train.log_interval=1",
            "train.eval_interval=0", "checkpoint.interval=0", "logging.progress_bar=off", "logging.tensorboard=false",
            f"train.global_batch_size={args.global_batch}", f"train.micro_batch_size={args.micro_batch}",
            f"train.seq_length={args.seq}", f"model.max_position_embeddings={max(256, args.seq)}",
            *lay.get("sets", []), *kv_heads_for(args, lay["tp"]), *args.set]
    script = [os.path.join(ROOT, "tools", "pretrain.py")]
    if flights:  # this file as the torchrun script: pretrain's path, with a flight recorder (--_worker)
        script = [os.path.abspath(__file__), "--_worker", os.path.join(run_dir, "flights")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(lay["world"]), *script,
           "--config", args.config, "--run-dir", run_dir]
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
    if flights:
        return [json.load(open(os.path.join(run_dir, f"flights.{r}.json"))) for r in range(lay["world"])]
    return recs


def kv_heads_for(args, tp: int) -> list[str]:
    """``model.num_key_value_heads`` raised to ``tp`` where the config's kv heads do not split over tp (the
    CPU preset's 2 at tp4) and its query heads do; nothing otherwise. The override is printed once."""
    from engine.config import load_config

    m = load_config(args.config, list(args.set)).model
    kv, heads = m.num_key_value_heads or m.num_attention_heads, m.num_attention_heads
    if kv % tp == 0 or heads % tp:
        return []
    key = (args.config, tp)
    if key not in _SAID:
        _SAID.add(key)
        print(f"bench_overlap: {args.config} has {kv} kv heads, which do not split over tp={tp}: run with "
              f"model.num_key_value_heads={tp}", flush=True)
    return [f"model.num_key_value_heads={tp}"]


_SAID: set = set()


def worker(out_prefix: str, argv: list[str]) -> int:
    """Under torchrun: tools/pretrain.py's build-resume-train with a flight recorder on the mesh's ledger
    (every call and wait, with its monotonic start and end); each rank writes its tp flights after the
    first step, and the step boundaries, to ``<out_prefix>.<rank>.json``."""
    import time

    from engine.config import add_config_args, config_from_args
    from tools import pretrain

    p = argparse.ArgumentParser()
    add_config_args(p)
    p.add_argument("--run-dir", required=True)
    args = p.parse_args(argv)

    def prepare():
        cfg = config_from_args(args)
        return (cfg, *pretrain.plan_run(cfg, world=int(os.environ.get("WORLD_SIZE", "1"))))

    def run(prepared, world):
        from engine.assembly import build_run
        from parallel.flight import FlightRecorder

        cfg, model, plan, tok = prepared
        r = build_run(cfg, model=model, run_dir=args.run_dir, world=world, plan=plan, tokenizer=tok)
        rec = r.mesh.ledger.recorder = FlightRecorder(capacity=1_000_000)
        ends = []
        r.resume()
        r.train(on_step=lambda tr, st: ends.append(time.monotonic()))
        keep = [f for f in rec.snapshot()[0] if f.axis == "tp" and f.start >= ends[0]]
        with open(f"{out_prefix}.{r.mesh.rank}.json", "w") as f:
            json.dump({"steps": len(ends) - 1, "flights": [(x.op, list(x.ranks), x.seq, x.start, x.end, x.async_op)
                                                            for x in keep]}, f)
    return pretrain.launch("bench_overlap", prepare, run, timeout_s=lambda prepared: 600.0)


def loss_times(iters: int) -> dict:
    """On every rank of the initialised default process group: the vocab-parallel loss forward on (512, 2)
    tokens of a 4096 vocabulary sharded over the world, hide_max off and on alternately (``iters`` each, the
    first 4 not timed). Returns the medians of the forward's wall time and of its blocked time (the
    ledger's), {"false"|"true": {"forward_s", "blocked_s"}}."""
    import time

    import torch
    import torch.distributed as dist

    from parallel.comm import Group, Ledger
    from parallel.tensor_parallel import vocab_parallel_cross_entropy

    torch.set_num_threads(1)
    p, r = dist.get_world_size(), dist.get_rank()
    ledger = Ledger()
    tp = Group(axis="tp", ranks=list(range(p)), rank=r, pg=dist.group.WORLD, ledger=ledger)
    g = torch.Generator().manual_seed(0)
    v_local = 4096 // p
    logits = torch.randn(512, 2, v_local * p, generator=g)[..., r * v_local:(r + 1) * v_local].contiguous()
    target = torch.randint(0, v_local * p, (512, 2), generator=g)
    wall, blocked = {False: [], True: []}, {False: [], True: []}
    for i in range(iters):
        for hide in (False, True) if i % 2 == 0 else (True, False):
            dist.barrier()
            b0, t0 = ledger.exposed_seconds(), time.perf_counter()
            vocab_parallel_cross_entropy(logits, target, tp_group=tp, hide_max=hide)
            wall[hide].append(time.perf_counter() - t0)
            blocked[hide].append(ledger.exposed_seconds() - b0)
    return {str(h).lower(): {"forward_s": statistics.median(wall[h][4:]),
                             "blocked_s": statistics.median(blocked[h][4:])} for h in (False, True)}


def loss_worker(out: str, iters: int) -> int:
    """Under torchrun: :func:`loss_times`; rank 0 writes it to ``out``."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    res = loss_times(iters)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()
    return 0


def loss_bench(world_sizes=(2, 4), *, iters: int = 44) -> dict:
    """The loss's MAX all-reduce in line vs hidden under the exp pass, at each world size (one launch each)."""
    res = {}
    with tempfile.TemporaryDirectory(prefix="tessel_overlap_") as tmp:
        for w in world_sizes:
            out = os.path.join(tmp, f"loss{w}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(w),
                   os.path.abspath(__file__), "--_loss_worker", out, str(iters)]
            proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                                  text=True)
            if proc.returncode:
                raise SystemExit(f"bench_overlap: loss bench at tp{w} failed:\n{proc.stderr[-3000:]}")
            res[f"tp{w}"] = d = json.load(open(out))
            print(f"loss tp{w}: hide_max off: forward {d['false']['forward_s'] * 1e3:.2f} ms, blocked "
                  f"{d['false']['blocked_s'] * 1e3:.2f} ms; on: forward {d['true']['forward_s'] * 1e3:.2f} ms, "
                  f"blocked {d['true']['blocked_s'] * 1e3:.2f} ms", flush=True)
    return res


def breakdown(ranks: list[dict]) -> dict:
    """{kind: seconds per step} of tp blocked time, averaged over ranks, each kind split into "late"
    (waiting for the last rank of the group to arrive) and "rest". A wait's kind is the async call it
    finishes (a ring round's transfers: "ring"); the i-th wait (or collective #seq) of every rank of a
    tp group is the same call, since they run the same program."""
    calls = []  # per rank: [(kind, match key, entry, arrival, end)]
    for d in ranks:
        mine, last_async, n_wait = [], None, 0
        for op, group, seq, start, end, is_async in d["flights"]:
            if is_async:
                last_async = (op, start)
                continue
            if end is None:
                continue
            if op == "wait":
                kind = "ring waits" if last_async and last_async[0] == "batch_p2p" else f"{last_async[0]} (async) wait"
                # arrival: when this rank posted what it waits for (a ring round: its transfers)
                mine.append((kind, (tuple(group), "wait", n_wait), start, last_async[1], end))
                n_wait += 1
            else:
                mine.append((op, (tuple(group), op, seq), start, start, end))
        calls.append(mine)
    arrive: dict = {}
    for mine in calls:
        for kind, key, start, arrival, end in mine:
            arrive[key] = max(arrive.get(key, 0.0), arrival)
    out: dict = {}
    steps = max(1, ranks[0]["steps"])
    for mine in calls:
        for kind, key, start, arrival, end in mine:
            blocked = end - start
            late = min(max(0.0, arrive[key] - start), blocked)
            d = out.setdefault(kind, {"s": 0.0, "late_s": 0.0, "calls": 0})
            d["s"] += blocked / steps / len(calls)
            d["late_s"] += late / steps / len(calls)
            d["calls"] += 1 / steps / len(calls)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["s"]))


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


def _launch_machine() -> tuple[str, int]:
    """What the launches will run on, as tools/pretrain.py chooses it: ``(description, GPUs)``, GPUs 0 on
    the CPU (gloo, one thread per rank)."""
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"{n} x {torch.cuda.get_device_name(0)}, NCCL, one GPU per rank", n
    return f"{os.cpu_count()} CPU cores, gloo, 1 thread per rank", 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--_worker"]:
        return worker(argv[1], argv[2:])
    if argv[:1] == ["--_loss_worker"]:
        return loss_worker(argv[1], int(argv[2]))
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
    p.add_argument("--modes", nargs="+", choices=("none", "ring", "symm_mem"), default=["none", "ring"],
                   help="parallel.tp_overlap values to launch, alternating; 'none' (the baseline of the ratios) must "
                        "be one. symm_mem needs GPUs (default: none ring)")
    p.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=None,
                   help="one more launch per mode with a flight recorder: exposed tp time per kind of call, from "
                        "host timestamps (default on with gloo; off with GPUs, where the host does not wait for "
                        "NCCL and the split would say nothing)")
    p.add_argument("--gemm-overhead", action="store_true",
                   help="only the one-device overhead of the ring's chunk GEMMs vs one GEMM (8B shapes; no launch)")
    p.add_argument("--loss", action="store_true",
                   help="only the vocab-parallel loss, its MAX all-reduce in line vs hidden (tp2, tp4; no training)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="for --gemm-overhead")
    p.add_argument("--tokens", type=int, default=None, help="for --gemm-overhead (default 8192 CUDA, 512 CPU)")
    p.add_argument("--tp-degrees", type=int, nargs="+", default=[2, 4, 8], help="for --gemm-overhead")
    args = p.parse_args(argv)
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            p.error("--device cuda: no GPU visible to torch (run it on a GPU machine, or leave --device out)")
    if args.gemm_overhead:
        res = gemm_overhead(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    if args.loss:
        res = loss_bench()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    if args.steps < 2 or args.repeats < 1:
        p.error("--steps must be >= 2 and --repeats >= 1")
    if "none" not in args.modes or len(set(args.modes)) < 2 or len(set(args.modes)) != len(args.modes):
        p.error(f"--modes {' '.join(args.modes)}: give 'none' (the baseline) and at least one other mode, each once")
    machine, gpus = _launch_machine()
    most = max(LAYOUTS[lay]["world"] for lay in args.layouts)
    if gpus and gpus < most:
        p.error(f"--layouts {' '.join(args.layouts)} need {most} ranks, one GPU each, and {gpus} GPU(s) are visible; "
                "choose smaller layouts (--layouts tp2) or run it where there are enough GPUs")
    if "symm_mem" in args.modes and not gpus:
        p.error("--modes symm_mem needs CUDA GPUs with NVLink (symmetric memory); on the CPU compare none and ring")
    if args.breakdown is None:
        args.breakdown = not gpus
    res = {"date": datetime.date.today().isoformat(), "machine": machine,
           "load_average_at_start": list(os.getloadavg()),  # the machine may be shared: say how busy it was
           "command": "python tools/bench_overlap.py " + " ".join(argv),
           "layouts": {}}
    modes = list(args.modes)
    for layout in args.layouts:
        samples = {m: {k: [] for k in KEYS} for m in modes}
        losses = {}
        with tempfile.TemporaryDirectory(prefix="tessel_overlap_") as tmp:
            for rep in range(args.repeats):
                for mode in modes if rep % 2 == 0 else modes[::-1]:  # alternate the order between repeats
                    recs = run_once(layout, mode, args, os.path.join(tmp, f"{mode}{rep}"))
                    losses.setdefault(mode, [r["loss"] for r in recs])
                    for r in recs[1:]:
                        for k in KEYS:
                            samples[mode][k].append(r.get(k, 0.0))
        out = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in samples.items()}
        base = out["none"]
        for m in (m for m in modes if m != "none"):
            o = out[m]
            r = out[f"ratio_{m}_over_none"] = {k: (o[k] / base[k] if base[k] else None) for k in KEYS}
            out.setdefault("loss_max_rel_diff", {})[m] = max(abs(a - b) / abs(b) for a, b in zip(losses[m], losses["none"]))
            print(f"{layout} {m}: step {base['step_time_s']:.3f} s -> {o['step_time_s']:.3f} s ({r['step_time_s']:.2f}x); "
                  f"exposed tp {base['comm_exposed_s_tp']:.3f} s -> {o['comm_exposed_s_tp']:.3f} s "
                  f"({r['comm_exposed_s_tp']:.2f}x); exposed all {base['comm_exposed_s']:.3f} -> "
                  f"{o['comm_exposed_s']:.3f} s; tp bytes equal: {base['comm_bytes_tp'] == o['comm_bytes_tp']}; "
                  f"losses agree to {out['loss_max_rel_diff'][m]:.1e}", flush=True)
        if args.breakdown:
            with tempfile.TemporaryDirectory(prefix="tessel_overlap_") as tmp:
                out["breakdown_tp"] = {m: breakdown(run_once(layout, m, args, os.path.join(tmp, m), flights=True))
                                       for m in modes}
            for m, kinds in out["breakdown_tp"].items():
                print(f"{layout} {m}: exposed tp per step by kind: " + "; ".join(
                    f"{k} {v['s']:.3f} s (peer late {v['late_s']:.3f}, {v['calls']:.0f} calls)"
                    for k, v in kinds.items()), flush=True)
        res["layouts"][layout] = out
    res["load_average_at_end"] = list(os.getloadavg())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
