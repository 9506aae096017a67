"""Pretrain a transformer over TP x PP x DP.

    torchrun --nproc-per-node N tools/pretrain.py --config configs/<preset>.toml [--set key=value ...] [--run-dir DIR]

The run directory holds config.json (the resolved config), metrics.jsonl, tensorboard/ and
checkpoints/; a run directory that already holds a complete checkpoint resumes from it.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from engine.config import add_config_args, config_from_args  # noqa: E402
from parallel.mesh import init_distributed  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument("--run-dir", default=None, help="run directory (default: train.run_dir)")
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except (ValueError, FileNotFoundError) as e:
        if os.environ.get("RANK", "0") == "0":  # every rank fails the same way: say it once
            print(f"pretrain.py: {e}", file=sys.stderr)
        return 2
    rank, world = init_distributed()
    try:
        train_from_config(cfg, args.run_dir, rank=rank, world=world)
        return 0
    except ValueError as e:
        print(f"pretrain.py (rank {rank}): {e}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def train_from_config(cfg, run_dir: str | None, *, rank: int, world: int):
    """Parse is done: build, resume, train. Returns the step stats."""
    from engine.assembly import build_run, check_data_paths
    from engine.data.tokenizer import load_tokenizer
    from models.hook import ModelHook

    cfg.validate_world(world)  # clear error before anything else if the layout does not fit
    check_data_paths(list(cfg.data.paths))
    tok = load_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None
    model = ModelHook.from_run_config(cfg, tokenizer_vocab=tok.vocab_size if tok else None)
    run = build_run(cfg, model=model, run_dir=run_dir or cfg.train.run_dir, world=world)
    run.resume()
    return run.train()


if __name__ == "__main__":
    sys.exit(main())
