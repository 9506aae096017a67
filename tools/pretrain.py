"""Pretrain a transformer over TP x PP x DP.

    torchrun --nproc-per-node N tools/pretrain.py --config configs/<preset>.toml [--set key=value ...] [--run-dir DIR]

The run directory holds config.json (the resolved config), metrics.jsonl, tensorboard/ and
checkpoints/; a run directory that already holds a complete checkpoint resumes from it. A non-empty
directory that is not a Tessel run, and a resume that changes the model, data, global batch or sequence
length, are refused before anything starts (engine/fault.py). Exit status: 0 finished or stopped by
SIGTERM/SIGINT after saving, or nothing to train (the run directory's checkpoint is at train.steps);
2 bad input; 3 the run diverged; 4 the hang watchdog fired
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

from engine.config import add_config_args, load_config  # noqa: E402
from engine.fault import OnceArgumentParser  # noqa: E402
from parallel.mesh import init_distributed  # noqa: E402


def main(argv=None) -> int:
    parser = OnceArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument("--run-dir", default=None, help="run directory (default: train.run_dir)")
    args = parser.parse_args(argv)

    def prepare():
        from engine.fault import check_peer_replica, check_run_dir, check_unfinished

        cfg = load_config(args.config, args.config_overrides or [], defaults=lambda data: pretrain_defaults(
            data, config=args.config))
        check_peer_replica(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        model, plan, tok = plan_run(cfg, world=int(os.environ.get("WORLD_SIZE", "1")))
        # A foreign directory is never written into; a resume must not change what its checkpoint depends on.
        run_dir = args.run_dir or cfg.train.run_dir
        resumes = check_run_dir(cfg, run_dir, model_config=model.hf_config)
        check_unfinished(cfg, resumes, run_dir)
        if resumes is None and cfg.checkpoint.load:  # a fresh start from a model: it must be there
            check_load(cfg.checkpoint.load)
        return cfg, model, plan, tok

    def run(prepared, world):
        cfg, model, plan, tok = prepared
        run_training(cfg, model, plan, args.run_dir, world=world, tokenizer=tok, keep_history=False)
    return launch("pretrain.py", prepare, run, timeout_s=lambda prepared: prepared[0].fault.collective_timeout_s)


def pretrain_defaults(data: dict, *, config: str | None) -> None:
    """Before the config is validated: a post-training config, or none at all, is named as such (instead of
    the first missing field it lacks for pretraining)."""
    from engine.config.loader import available_presets

    check_not_posttrain((data.get("posttrain") or {}).get("method", "none"))
    if config is None and not data.get("model"):
        raise ValueError("no --config: give a preset or TOML file, e.g. --config tiny_llama_cpu (presets: "
                         f"{', '.join(available_presets())}), or the model's sizes with --set model.KEY=VALUE")


def check_not_posttrain(method: str) -> None:
    if method != "none":
        raise ValueError(f"posttrain.method={method!r} is post-training: run tools/posttrain.py with this config, "
                         "or remove the [posttrain] section to pretrain")


def check_load(load: str) -> None:
    """``checkpoint.load`` names a Tessel checkpoint (a step directory, or a directory of them)."""
    from engine.checkpoint import CheckpointError, resolve_checkpoint

    try:
        resolve_checkpoint(load)
    except CheckpointError as e:
        raise ValueError(f"checkpoint.load: {e}; give a step directory or the checkpoints/ directory of a run "
                         "(convert a Hugging Face model with tools/convert_checkpoint.py hf-to-tessel)") from None


def launch(prog: str, prepare: Callable[[], Any], run: Callable[[Any, int], Any], *,
           timeout_s: Callable[[Any], float]) -> int:
    """A torchrun job's frame: ``prepare()`` (every check that needs no communication, before any process
    group exists: every rank fails the same way, so rank 0 alone says it), the process group (its collectives
    time out after ``timeout_s(prepared)`` seconds), ``run(prepared, world)``, and the process groups freed
    while the interpreter is alive. Exit status 2 on a ValueError (one that every rank raises alike, marked
    ``on_every_rank``, is said once by rank 0); 0 when ``prepare`` finds nothing to train (``NothingToTrain``);
    3 (``EXIT_STOPPED``) when the run stopped itself on every rank (it diverged: ``RunStopped``,
    ``NonFiniteGradError``), said once by rank 0."""
    from engine.fault import EXIT_STOPPED, NothingToTrain, RunStopped, launcher_rank, say_once
    from engine.optim import NonFiniteGradError

    try:
        prepared = prepare()
    except NothingToTrain as e:  # a finished run relaunched: said once, before any start-up cost
        if launcher_rank() == 0:
            print(f"{prog}: {e}", file=sys.stderr)
        return 0
    except (ValueError, FileNotFoundError) as e:
        say_once(f"{prog}: {e}", launcher_rank())
        return 2
    try:
        rank, world = init_distributed(timeout_s=timeout_s(prepared))
    except ValueError as e:  # a launch that cannot restart safely (parallel.mesh.attempt_store), before any rendezvous
        say_once(f"{prog}: {e}", launcher_rank())
        return 2
    try:
        run(prepared, world)
        return 0
    except ValueError as e:
        if getattr(e, "on_every_rank", False):  # one line for an error every rank raised
            say_once(f"{prog}: {e}", rank)
        else:
            print(f"{prog} (rank {rank}): {e}", file=sys.stderr)
        return 2
    except (RunStopped, NonFiniteGradError) as e:  # raised on every rank at the same step: one line, from rank 0
        say_once(f"{prog}: {e}", rank)
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
    from engine.assembly import check_data_paths, check_microbatches, memory_plan, run_tokenizer
    from models.hook import ModelHook

    check_not_posttrain(cfg.posttrain.method)
    check_microbatches(cfg, cfg.validate_world(world))
    check_data_paths(list(cfg.data.paths))
    tok = run_tokenizer(cfg)
    model = ModelHook.from_run_config(cfg, tokenizer_vocab=tok.vocab_size if tok else None)
    plan = memory_plan(cfg, model, world=world)
    if not plan.fits:
        raise ValueError(plan.error())
    return model, plan, tok


def run_training(cfg, model, plan, run_dir: str | None, *, world: int, tokenizer=None, keep_history: bool = True):
    """Build, resume, train. Returns the step stats (``[]`` with ``keep_history=False``, as the job runs: no
    per-step record grows over a long run)."""
    from engine.assembly import build_run

    run = build_run(cfg, model=model, run_dir=run_dir or cfg.train.run_dir, world=world, plan=plan,
                    tokenizer=tokenizer)
    run.resume()
    history = run.train(keep_history=keep_history)
    run.close()  # a clean exit: the peer replicas in /dev/shm go (checkpoint.peer_replica), and the mesh's groups
    return history


def train_from_config(cfg, run_dir: str | None, *, rank: int, world: int):
    """Plan, build, resume, train (in-process; tests and tools). Returns the step stats."""
    model, plan, tok = plan_run(cfg, world=world)
    return run_training(cfg, model, plan, run_dir, world=world, tokenizer=tok)


if __name__ == "__main__":
    sys.exit(main())
