"""Peak host memory of building ONE rank's pipeline stage of a preset, against the bytes that rank holds.

    .venv/bin/python tools/bench_build_memory.py --config llama3_70b --tp 8 --pp 8 [--rank-tp 0 --rank-pp 0]

Builds the stage in this process on CPU with a stand-in tensor-parallel group of size ``--tp`` (building
communicates nothing), through the same model hook as tools/pretrain.py, and prints the rank's shard
bytes (parameters and buffers), the process's peak RSS, and the goal ``peak <= 1.2 x shard + 300 MB``.
The ceiling is the shard itself: a rank cannot hold less than its parameters.
Writes JSON with ``--json PATH``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama3_70b", help="preset name or TOML path")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--vp", type=int, default=1)
    ap.add_argument("--rank-tp", type=int, default=0, help="tensor-parallel rank to build")
    ap.add_argument("--rank-pp", type=int, default=0, help="pipeline rank to build (its first virtual stage)")
    ap.add_argument("--json", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    for name in ("tp", "pp", "vp"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if not 0 <= args.rank_tp < args.tp or not 0 <= args.rank_pp < args.pp:
        ap.error("--rank-tp must be in [0, tp) and --rank-pp in [0, pp)")

    import torch

    from engine.config import load_config
    from models.hook import ModelHook
    from parallel.comm import Group, Ledger
    from parallel.mesh import Mesh
    from parallel.pipeline.split import split_layers

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cfg = load_config(args.config, [f"parallel.tp={args.tp}", f"parallel.pp={args.pp}", f"parallel.vp={args.vp}",
                                    "parallel.schedule=" + ("interleaved" if args.vp > 1 else "1f1b")])
    model = ModelHook.from_run_config(cfg, tokenizer_vocab=None)
    mesh = Mesh.single()
    # A stand-in TP group: the layers read its size and rank; building never communicates.
    mesh._groups["tp"] = Group(axis="tp", ranks=range(args.tp), rank=args.rank_tp, pg=object(), ledger=Ledger())
    stages = args.pp * args.vp
    ranges = split_layers(model.num_layers, stages, cfg.parallel.pipeline_layout)
    stage = args.rank_pp
    rss_before = _rss()
    t0 = time.perf_counter()
    module = model.build_stage(mesh, pre_process=stage == 0, post_process=stage == stages - 1,
                               layer_range=ranges[stage], device="cpu")
    seconds = time.perf_counter() - t0
    shard = sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    goal = 1.2 * shard + 300e6
    out = {"config": args.config, "tp": args.tp, "pp": args.pp, "vp": args.vp, "rank_tp": args.rank_tp,
           "rank_pp": args.rank_pp, "layers": list(ranges[stage]), "dtype": str(model.dtype),
           "shard_bytes": shard, "rss_before_build": rss_before, "peak_rss": peak, "goal_bytes": goal,
           "goal_met": peak <= goal, "build_seconds": round(seconds, 1), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d")}
    print(f"{args.config} stage {stage} (layers {ranges[stage][0]}-{ranges[stage][1] - 1}) at tp rank "
          f"{args.rank_tp}/{args.tp}: shard {shard / 1e9:.3f} GB ({model.dtype}); peak RSS {peak / 1e9:.3f} GB "
          f"(before building {rss_before / 1e9:.3f} GB); built in {seconds:.1f} s")
    print(f"goal: peak <= 1.2 x shard + 300 MB = {goal / 1e9:.3f} GB: {'met' if out['goal_met'] else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
