"""Benchmark: the start-up memory report's prediction against the measured peak, per layout (docs/memory.md).

For each layout of the tiny preset (configs/tiny_llama_cpu.toml: its model, batch and sequence; tokens
drawn at random, so the bundled corpus is not needed) the run is built through the assembly line on
gloo CPU ranks (parallel.testing.run_distributed), exactly as tools/pretrain.py builds it, and:

* predicted: ``engine.memory.predict_memory`` (what rank 0 logs at start-up): parameters, gradients,
  optimizer state, the activations saved by the micro-batches in flight at the peak, the transients;
* measured: the persistent tensors each rank holds (``engine.memory.state_bytes``) plus the peak of the
  first training step above them (``engine.memory.PeakMemory``: the CPU allocator's running total);
  a pipeline rank's figure is the largest of its tp/dp ranks'.

The activations and transients are measured together (the step's peak above the state); the table
sets that beside their predicted sum.

    .venv/bin/python tools/bench_memory.py --json docs/benchmarks/memory_report.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


from parallel.testing import run_distributed  # noqa: E402

LONG = ["train.seq_length=1024", "model.max_position_embeddings=1024", "optim.distributed=false"]
# name -> (ranks, --set overrides of the preset)
LAYOUTS = {
    "1 process": (1, ["parallel.tp=1", "parallel.pp=1"]),
    "1 process, full recompute": (1, ["parallel.tp=1", "parallel.pp=1", "train.activation_checkpointing=full"]),
    "tp2 + sp": (2, ["parallel.tp=2", "parallel.pp=1"]),
    "pp2 (1f1b)": (2, ["parallel.tp=1", "parallel.pp=2"]),
    "dp2, ZeRO-1": (2, ["parallel.tp=1", "parallel.pp=1", "optim.zero_stage=1"]),
    "tp2 + sp x pp2 (the preset)": (4, []),
    "dp4, ZeRO-1": (4, ["parallel.tp=1", "parallel.pp=1", "optim.zero_stage=1"]),
    "dp4, ZeRO-3": (4, ["parallel.tp=1", "parallel.pp=1", "optim.zero_stage=3"]),
    "dp2 x pp2, ZeRO-3": (4, ["parallel.tp=1", "parallel.pp=2", "optim.zero_stage=3"]),
    "cp2 ring, ZeRO-1": (2, ["parallel.tp=1", "parallel.pp=1", "parallel.cp=2"]),
    "cp2 x pp2 ring, s 1024, plain": (4, ["parallel.tp=1", "parallel.pp=2", "parallel.cp=2", *LONG]),
    "cp2 x pp2 a2a, s 1024, plain": (4, ["parallel.tp=1", "parallel.pp=2", "parallel.cp=2", "parallel.cp_comm=a2a",
                                         *LONG]),
}


def _rank_main(sets: list[str]) -> dict:
    import torch.distributed as dist

    from engine.assembly import build_run
    from engine.data.synthetic import RandomTokens
    from engine.config import load_config
    from engine.memory import PeakMemory, state_bytes
    from models.hook import ModelHook

    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = load_config("tiny_llama_cpu", ["logging.progress_bar=off", "logging.tensorboard=false",
                                         "logging.peak_tflops=1.0", "train.eval_interval=0", *sets])
    model = ModelHook.from_run_config(cfg, tokenizer_vocab=None)
    data = RandomTokens(4 * cfg.train.global_batch_size, seq=cfg.train.seq_length, vocab=cfg.model.vocab_size)
    run = build_run(cfg, model=model, train_data=data, checkpoints=False, world=world,
                    log_stream=open(os.devnull, "w"))
    tr = run.trainer
    state = state_bytes(tr.chunks, tr.ddp, tr.optimizer, tr.outer)
    with PeakMemory(tr.device) as peak:
        tr.train_step(run.train_loader)
    r = tr.memory.ranks[tr.pp_rank]
    return {"pp_rank": tr.pp_rank, "params": state[0], "grads": state[1], "optimizer": state[2], "step": peak.peak,
            "exact": peak.exact, "predicted": {"params": r.params, "grads": r.grads, "optimizer": r.optimizer,
                                               "activations": r.activations, "transient": r.transient,
                                               "inflight": r.inflight, "phase": r.phase, "total": r.total},
            "layout": tr.memory.layout}


def measure(name: str) -> list[dict]:
    """One row per pipeline rank of layout ``name``: predicted and measured components (bytes)."""
    ranks, sets = LAYOUTS[name]
    results = [_rank_main(sets)] if ranks == 1 else run_distributed(_rank_main, ranks, sets, timeout=600)
    rows = {}
    for res in results:
        total = res["params"] + res["grads"] + res["optimizer"] + res["step"]
        best = rows.get(res["pp_rank"])
        if best is None or total > best["measured_total"]:
            rows[res["pp_rank"]] = {"layout": name, "resolved": res["layout"], "pp_rank": res["pp_rank"],
                                    "measured": {k: res[k] for k in ("params", "grads", "optimizer", "step")},
                                    "measured_total": total, "predicted": res["predicted"], "exact": res["exact"]}
    out = [rows[k] for k in sorted(rows)]
    for row in out:
        row["relative_error"] = (row["predicted"]["total"] - row["measured_total"]) / row["measured_total"]
    return out


def table(rows: list[dict]) -> str:
    mb = 1e6
    head = ("| layout | pp rank | params (pred = meas) | grads | optimizer | activations + transients, predicted "
            "(in flight) | the step's peak, measured | total predicted | total measured | error |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        state = "" if (p["params"], p["grads"], p["optimizer"]) == (m["params"], m["grads"], m["optimizer"]) else " (!)"
        lines.append(f"| {r['layout']} | {r['pp_rank']} | {m['params'] / mb:.2f}{state} | {m['grads'] / mb:.2f} | "
                     f"{m['optimizer'] / mb:.2f} | {p['activations'] / mb:.2f} + {p['transient'] / mb:.2f} "
                     f"({p['inflight']}) | {m['step'] / mb:.2f} | {p['total'] / mb:.2f} | "
                     f"{r['measured_total'] / mb:.2f} | {100 * r['relative_error']:+.2f}% |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS), metavar="LAYOUT")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    rows = [row for name in a.layouts for row in measure(name)]
    print("MB (1e6 bytes) per rank; measured = persistent tensors + the first step's allocator peak above them")
    print(table(rows))
    out = {"rows": rows, "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
           "date": datetime.date.today().isoformat(),
           "command": "tools/bench_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
