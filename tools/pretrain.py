"""Pretrain a transformer over TP x PP x DP.

    torchrun --nproc-per-node N tools/pretrain.py --config configs/<preset>.toml [--set key=value ...] [--run-dir DIR]

The run directory holds config.json (the resolved config), metrics.jsonl, tensorboard/ and
checkpoints/; a run directory that already holds a complete checkpoint resumes from it. A non-empty
directory that is not a Tessel run, and a resume that changes the model, data, global batch or sequence
length, are refused before anything starts (engine/fault.py). Exit status: 0 finished or stopped by
SIGTERM/SIGINT after saving; 2 bad input; 3 the run diverged; 4 the hang watchdog fired
(fault.hang_timeout_s; docs/fault_tolerance.md).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any, Callable

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

    def prepare():
        from engine.fault import check_peer_replica, check_run_dir

        cfg = config_from_args(args)
        check_peer_replica(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        model, plan, tok = plan_run(cfg, world=int(os.environ.get("WORLD_SIZE", "1")))
        # A foreign directory is never written into; a resume must not change what its checkpoint depends on.
        check_run_dir(cfg, args.run_dir or cfg.train.run_dir, model_config=model.hf_config)
        return cfg, model, plan, tok

    def run(prepared, world):
        cfg, model, plan, tok = prepared
        run_training(cfg, model, plan, args.run_dir, world=world, tokenizer=tok)
    return launch("pretrain.py", prepare, run, timeout_s=lambda prepared: prepared[0].fault.collective_timeout_s)


def launch(prog: str, prepare: Callable[[], Any], run: Callable[[Any, int], Any], *,
           timeout_s: Callable[[Any], float]) -> int:
    """A torchrun job's frame: ``prepare()`` (every check that needs no communication, before any process
    group exists: every rank fails the same way, so rank 0 alone says it), the process group (its collectives
    time out after ``timeout_s(prepared)`` seconds), ``run(prepared, world)``, and the process groups freed
    while the interpreter is alive. Exit status 2 on a ValueError; 3 (``EXIT_STOPPED``) when the run stopped
    itself on every rank (it diverged: ``RunStopped``, ``NonFiniteGradError``), said once by rank 0."""
    from engine.fault import EXIT_STOPPED, RunStopped
    from engine.optim import NonFiniteGradError

    try:
        prepared = prepare()
    except (ValueError, FileNotFoundError) as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: {e}", file=sys.stderr)
        return 2
    try:
        rank, world = init_distributed(timeout_s=timeout_s(prepared))
    except ValueError as e:  # a launch that cannot restart safely (parallel.mesh.attempt_store), before any rendezvous
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: {e}", file=sys.stderr)
        return 2
    try:
        run(prepared, world)
        return 0
    except ValueError as e:
        print(f"{prog} (rank {rank}): {e}", file=sys.stderr)
        return 2
    except (RunStopped, NonFiniteGradError) as e:  # raised on every rank at the same step: one line, from rank 0
        if rank == 0:
            print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_STOPPED
    finally:
        # Free the run (its mesh holds the process groups) while the interpreter is fully alive: a
        # gloo group first destroyed during interpreter finalisation can abort the process after a
        # finished run ("terminate called without an active exception"; seen in ~1 of 3 4-rank runs).
        gc.collect()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        gc.collect()


def plan_run(cfg, *, world: int):
    """The checks that need no communication (layout, data, tokenizer, model), then the memory plan;
    a run that cannot fit is refused here, before anything is allocated. Returns (model hook, plan, tokenizer)."""
    from engine.assembly import check_data_paths, memory_plan
    from engine.data.tokenizer import load_tokenizer
    from models.hook import ModelHook

    if cfg.posttrain.method != "none":
        raise ValueError(f"posttrain.method={cfg.posttrain.method!r} is post-training: run tools/posttrain.py "
                         "with this config, or remove the [posttrain] section to pretrain")
    cfg.validate_world(world)
    check_data_paths(list(cfg.data.paths))
    tok = load_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None
    model = ModelHook.from_run_config(cfg, tokenizer_vocab=tok.vocab_size if tok else None)
    plan = memory_plan(cfg, model, world=world)
    if not plan.fits:
        raise ValueError(plan.error())
    return model, plan, tok


def run_training(cfg, model, plan, run_dir: str | None, *, world: int, tokenizer=None):
    """Build, resume, train. Returns the step stats."""
    from engine.assembly import build_run

    run = build_run(cfg, model=model, run_dir=run_dir or cfg.train.run_dir, world=world, plan=plan,
                    tokenizer=tokenizer)
    run.resume()
    history = run.train()
    if run.checkpointer is not None:
        run.checkpointer.close()  # a clean exit: the peer replicas in /dev/shm go (checkpoint.peer_replica)
    return history


def train_from_config(cfg, run_dir: str | None, *, rank: int, world: int):
    """Plan, build, resume, train (in-process; tests and tools). Returns the step stats."""
    model, plan, tok = plan_run(cfg, world=world)
    return run_training(cfg, model, plan, run_dir, world=world, tokenizer=tok)


if __name__ == "__main__":
    sys.exit(main())
