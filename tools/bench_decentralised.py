"""Training over a weak data-parallel link: tokens/s of DDP, DiLoCo and Streaming DiLoCo (and the per-step
compressors) with an injected per-byte delay on every data-parallel collective.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 tools/bench_decentralised.py \
        [--bandwidth-mbps 20] [--steps 20] [--warmup 2] [--json out.json]

Every rank builds the CPU preset (configs/tiny_llama_cpu.toml) at tp=1, pp=1 (dp = the world) through the
main job's assembly line, once per method, on synthetic tokens. The link: each collective the ledger
records on the dp axis sleeps ``sent_bytes / bandwidth`` on the calling rank when it is issued (a
bandwidth cap of ``--bandwidth-mbps`` MB/s per rank, no latency term). The model charges an async
collective at its launch, so Streaming DiLoCo's overlap of a fragment with the next inner step is NOT
credited here: its figure shows the cost of its bytes only (the same total as DiLoCo's, spread over the
cycle). Prints one row per method: tokens/s, dp bytes per step (ledger) and the ratio to DDP in the same
run; ``--json`` writes the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

METHODS = {
    "ddp": [],
    "diloco_h10": ["outer.method=diloco", "outer.inner_steps=10"],
    "diloco_h10_int8": ["outer.method=diloco", "outer.inner_steps=10", "outer.compression=int8"],
    "streaming_h10_f4": ["outer.method=streaming_diloco", "outer.inner_steps=10", "outer.fragments=4",
                         "outer.mix=0.5"],
    "powersgd_r4": ["optim.grad_compression=powersgd", "optim.powersgd_rank=4"],
    "onebit": ["optim.grad_compression=onebit"],
}


class _Synthetic:
    def __init__(self, n: int, *, seq: int, vocab: int):
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = np.random.default_rng(i).integers(0, self.vocab, self.seq + 1)
        return {"tokens": ids[:-1], "labels": ids[1:], "position_ids": np.arange(self.seq),
                "loss_mask": np.ones(self.seq, dtype=np.float32)}


def _throttle(ledger, *, axis: str, bytes_per_s: float) -> None:
    """Wrap ``ledger.add``: a record on ``axis`` sleeps its sent bytes over the link first."""
    add = ledger.add

    def slow_add(rec):
        if rec.axis == axis and rec.sent_bytes > 0:
            time.sleep(rec.sent_bytes / bytes_per_s)
        add(rec)
    ledger.add = slow_add


def bench(method: str, *, steps: int, warmup: int, bandwidth: float, seq: int):
    from engine.assembly import build_run
    from engine.config import load_config
    from models.hook import ModelHook

    n = torch.distributed.get_world_size()
    cfg = load_config("tiny_llama_cpu", [
        "parallel.tp=1", "parallel.pp=1", "parallel.dp=-1", "optim.distributed=false", f"train.steps={steps + warmup}",
        "optim.warmup_steps=0",  # the lr schedule does not change the timing; the preset's 15 would need 15 steps
        f"train.seq_length={seq}", "train.eval_interval=0", "logging.progress_bar=off", "logging.tensorboard=false",
        "logging.jsonl=false", "logging.memory_report=false", *METHODS[method]])
    model = ModelHook.from_run_config(cfg, tokenizer_vocab=None)
    gbs = cfg.train.global_batch_size
    run = build_run(cfg, model=model, train_data=_Synthetic(gbs * (steps + warmup + 1), seq=seq,
                                                            vocab=cfg.model.vocab_size),
                    checkpoints=False, log_stream=open(os.devnull, "w"))
    axis = run.trainer.ddp.dp_group.axis
    _throttle(run.mesh.ledger, axis=axis, bytes_per_s=bandwidth)
    for _ in range(warmup):
        run.trainer.train_step(run.train_loader)
    torch.distributed.barrier()
    sent0 = run.mesh.ledger.by_axis().get(axis, 0.0)
    t0 = time.perf_counter()
    losses = [run.trainer.train_step(run.train_loader).loss for _ in range(steps)]
    torch.distributed.barrier()
    seconds = time.perf_counter() - t0
    sent = run.mesh.ledger.by_axis().get(axis, 0.0) - sent0
    return {"method": method, "dp": n, "tokens_per_s": gbs * seq * steps / seconds, "seconds": seconds,
            "dp_bytes_per_step": sent / steps, "last_loss": losses[-1]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bandwidth-mbps", type=float, default=20.0, help="dp link bandwidth per rank, MB/s (1e6 B)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per method (use a multiple of 10: H=10)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        p.error(f"unknown method(s) {bad}; choose from {', '.join(METHODS)}")
    if args.bandwidth_mbps <= 0 or args.steps < 1:
        p.error("--bandwidth-mbps must be > 0 and --steps >= 1")
    from parallel.mesh import init_distributed

    rank, world = init_distributed()
    if world < 2:
        p.error("run under torchrun with >= 2 processes (the dp group is the world), e.g. --nproc-per-node 4")
    rows = [bench(m, steps=args.steps, warmup=args.warmup, bandwidth=args.bandwidth_mbps * 1e6, seq=args.seq_length)
            for m in methods]
    if rank == 0:
        base = next((r for r in rows if r["method"] == "ddp"), rows[0])
        print(f"dp={world} over gloo, dp link {args.bandwidth_mbps:g} MB/s per rank (injected), {args.steps} steps "
              f"of the tiny_llama_cpu preset at tp=1 pp=1, seq {args.seq_length}")
        print(f"{'method':<20}{'tokens/s':>12}{'x ' + base['method']:>12}{'dp MB/step':>14}{'x bytes':>10}")
        for r in rows:
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["bytes_ratio"] = r["dp_bytes_per_step"] / base["dp_bytes_per_step"] if base["dp_bytes_per_step"] else None
            print(f"{r['method']:<20}{r['tokens_per_s']:>12,.0f}{r['speedup']:>12.2f}"
                  f"{r['dp_bytes_per_step'] / 1e6:>14.3f}{(r['bytes_ratio'] or 0):>10.4f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bandwidth_mbps": args.bandwidth_mbps, "steps": args.steps, "world": world, "rows": rows},
                          f, indent=2)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
