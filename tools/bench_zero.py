"""Benchmark: ZeRO-1 vs ZeRO-2 vs ZeRO-3 training steps at dp=4 on CPU (gloo), same run.

The tiny preset's model (configs/tiny_llama_cpu.toml: Llama, hidden 128, 4 layers, vocab 4096, fp32)
at dp=4, one micro-batch of 2 x 128 tokens per rank, random token batches. For each ZeRO stage one
run is built (the same seed: the same initial weights and batches); after one warm-up step per stage,
``--repeats`` rounds time one training step of every stage, the order reversed every other round so
load drifts hit all alike (every rank runs the same order: the collectives match). Per stage:

* the median wall time of a step and its ratio to ZeRO-1 from the same run;
* the bytes each rank sent on the data-parallel axis during a step (the ledger) and the same divided
  by the gloo all-gather bandwidth measured in the same run: the time that communication needs at
  least on this machine (the ceiling for a step that only communicates);
* memory per rank: the persistent parameter, gradient and optimizer bytes, plus the step's peak above
  them from the CPU allocator (``engine.memory.PeakMemory``, one extra untimed step).

    .venv/bin/python tools/bench_zero.py --json docs/benchmarks/zero.json
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

STAGES = (1, 2, 3)


def _build(stage: int, args):
    from engine.assembly import build_run
    from engine.config import load_config
    from engine.data.synthetic import RandomTokens
    from models.hook import ModelHook

    cfg = load_config("tiny_llama_cpu", [
        "parallel.tp=1", "parallel.pp=1", "parallel.dp=-1", f"train.steps={args.repeats + 3}",
        f"train.global_batch_size={2 * args.world}", "train.micro_batch_size=2", f"train.seq_length={args.seq}",
        "optim.warmup_steps=0", "optim.distributed=true", f"optim.zero_stage={stage}", "logging.progress_bar=off",
        "logging.tensorboard=false", "logging.jsonl=false", "logging.peak_tflops=1.0", "train.eval_interval=0"])
    model = ModelHook.from_run_config(cfg, tokenizer_vocab=None)
    n = (args.repeats + 3) * cfg.train.global_batch_size
    return build_run(cfg, model=model, train_data=RandomTokens(n, vocab=cfg.model.vocab_size, seq=args.seq),
                     checkpoints=False)


def _allgather_bandwidth(group, nbytes: int = 8 << 20, reps: int = 5) -> float:
    """Bytes per second one rank sends in a gloo all-gather of ``nbytes`` per rank (median)."""
    from parallel import comm

    x = torch.ones(nbytes // 4)
    comm.all_gather(x, group)
    times = []
    for _ in range(reps):
        comm.barrier(group)
        t0 = time.perf_counter()
        comm.all_gather(x, group)
        times.append(time.perf_counter() - t0)
    return (group.size - 1) * nbytes / statistics.median(times)


def _rank(args) -> dict:
    from engine.memory import PeakMemory

    torch.set_num_threads(1)
    runs = {s: _build(s, args) for s in STAGES}
    for run in runs.values():
        run.trainer.train_step(run.train_loader)  # warm-up: lazy state, allocator
    dp = runs[1].trainer.ddp.dp_group
    bw = [_allgather_bandwidth(dp)]
    times = {s: [] for s in STAGES}
    sent = {}
    for r in range(args.repeats):
        for s in (STAGES if r % 2 == 0 else tuple(reversed(STAGES))):
            run = runs[s]
            ledger = run.mesh.ledger
            before = ledger.by_axis().get(dp.axis, 0.0)
            t0 = time.perf_counter()
            run.trainer.train_step(run.train_loader)
            times[s].append(time.perf_counter() - t0)
            sent[s] = ledger.by_axis().get(dp.axis, 0.0) - before
    bw.append(_allgather_bandwidth(dp))
    out = {"allgather_bytes_per_s": statistics.median(bw), "stages": {}}
    for s in STAGES:
        run = runs[s]
        ddp, opt = run.trainer.ddp, run.trainer.optimizer
        with PeakMemory("cpu") as m:
            run.trainer.train_step(run.train_loader)
        persistent = ddp.param_bytes() + ddp.grad_buffer_bytes() + opt.state_bytes()
        out["stages"][s] = {"step_s": statistics.median(times[s]), "dp_sent_bytes": sent[s],
                            "param_bytes": ddp.param_bytes(), "grad_bytes": ddp.grad_buffer_bytes(),
                            "optimizer_bytes": opt.state_bytes(), "step_peak_bytes": m.peak,
                            "peak_bytes": persistent + m.peak}
    return out


def run(args) -> dict:
    from parallel.testing import run_distributed

    ranks = run_distributed(_rank, args.world, args, timeout=600)
    rows = []
    for s in STAGES:
        per = [r["stages"][s] for r in ranks]
        step = statistics.median(p["step_s"] for p in per)
        bw = statistics.median(r["allgather_bytes_per_s"] for r in ranks)
        rows.append({"zero_stage": s, "step_s": step, "vs_zero1": step / statistics.median(
            r["stages"][1]["step_s"] for r in ranks), "dp_sent_mib": per[0]["dp_sent_bytes"] / 2**20,
            "comm_floor_s": per[0]["dp_sent_bytes"] / bw, "param_mib": per[0]["param_bytes"] / 2**20,
            "grad_mib": per[0]["grad_bytes"] / 2**20, "optimizer_mib": per[0]["optimizer_bytes"] / 2**20,
            "peak_mib": max(p["peak_bytes"] for p in per) / 2**20})
    return {"date": datetime.date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores", "torch": torch.__version__, "args": {k: v for k, v in vars(args).items()
                                                                             if k != "json"},
            "allgather_mib_per_s": statistics.median(r["allgather_bytes_per_s"] for r in ranks) / 2**20,
            "rows": rows}


def format_table(res: dict) -> str:
    lines = [f"gloo all-gather, same run: {res['allgather_mib_per_s']:.0f} MiB/s sent per rank",
             "| zero_stage | step s (median) | x ZeRO-1 | dp MiB sent/rank/step | comm floor s | params MiB | "
             "grads MiB | optimizer MiB | peak MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['zero_stage']} | {r['step_s']:.3f} | {r['vs_zero1']:.2f} | {r['dp_sent_mib']:.2f} | "
                     f"{r['comm_floor_s']:.3f} | {r['param_mib']:.2f} | {r['grad_mib']:.2f} | "
                     f"{r['optimizer_mib']:.2f} | {r['peak_mib']:.1f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4, help="data-parallel ranks (gloo processes)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--repeats", type=int, default=8, help="timed rounds (one step of every stage each)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    for k in ("world", "seq", "repeats"):
        if getattr(args, k) < 1:
            p.error(f"--{k} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
