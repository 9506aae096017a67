"""Fault tolerance at start-up and at the end of a run: what protects a run directory and its data.

* :func:`check_run_dir` (tools/pretrain.py and tools/posttrain.py, before any process group exists): a
  non-empty directory that is not a Tessel run is refused (its files are never overwritten); a run
  directory holding a complete checkpoint is a resume, and a launch whose config changes what the checkpoint depends on
  (the model, the data, the global batch, the sequence length, the seed) is refused with one line
  naming the keys and the way out.
* :func:`remove_stale_saves`: the temporary directories of saves that never committed
  (``.tmp_step_*``) and the trash of an interrupted retention (``.trash_step_*``), removed by rank 0
  at start-up, before anything of this run writes there.
* :class:`RunStopped`: the run stopped itself for a reason every rank shares (it diverged); the
  launcher prints its one-line reason once and exits non-zero (``EXIT_STOPPED``).

docs/fault_tolerance.md says what each mechanism promises and what is not built.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

from engine.checkpoint.format import (LATEST_FILE, METADATA_FILE, TMP_PREFIX, TRASH_PREFIX, CheckpointError,
                                      check_complete, fsync_dir, list_checkpoints, read_metadata,
                                      replace_file_atomic, step_dirname)

EXIT_STOPPED = 3  # the exit status of a run that stopped itself (diverged, non-finite with nonfinite='stop')
EXIT_HUNG = 4  # the exit status of a rank whose hang watchdog fired (fault.hang_timeout_s; engine/watchdog.py)

# Keys of the run config a resume depends on: the sample order and the tensors in the checkpoint.
# The architecture itself is compared on its resolved form (model_config.json), so a model given by
# model.hf_config and one given by explicit fields compare alike.
RESUME_KEYS = ("model.dtype", "data.paths", "data.weights", "data.split", "train.global_batch_size",
               "train.seq_length", "train.seed")
# Post-training resumes depend on the base model (checkpoint.load: with LoRA the base is read from it again),
# the records and how they are packed or drawn (GRPO: group_size and steps_per_rollout set the prompts per
# rollout), and what the adapters compute (alpha / rank is the scaling), not on data.paths.
POSTTRAIN_RESUME_KEYS = ("model.dtype", "train.global_batch_size", "train.seq_length", "train.seed",
                         "checkpoint.load", "posttrain.method", "posttrain.data", "posttrain.pack",
                         "posttrain.truncate", "posttrain.chat_template", "posttrain.lora.rank",
                         "posttrain.lora.alpha", "posttrain.lora.dropout", "posttrain.lora.targets",
                         "posttrain.grpo.group_size", "posttrain.grpo.steps_per_rollout")
# Entries a Tessel run directory may hold besides config.json (for the message only).
RUN_FILES = ("config.json", "model_config.json", "metrics.jsonl", "tensorboard", "checkpoints")


class RunStopped(RuntimeError):
    """The run stopped itself for a reason every rank shares (e.g. ``optim.max_skipped_steps`` consecutive
    non-finite steps). Raised on every rank at the same step; the message is one line."""


SAY_ONCE_GRACE_S = 2.0  # how long a rank that leaves an error to rank 0 waits before it exits


def launcher_rank() -> int:
    """This process's rank as the launcher set it (``RANK``; 0 when unset or empty, as in a plain
    ``python`` run): who says an error once before any process group exists."""
    return int(os.environ.get("RANK") or 0)


def say_once(line: str, rank: int) -> None:
    """An error every rank raised alike, said once: rank 0 prints ``line`` to stderr; the others wait a moment
    before they exit with the error's status, since torchrun stops the other workers as soon as the first
    one fails, which could cut rank 0 off before its line is out."""
    if rank == 0:
        import sys

        print(line, file=sys.stderr)
    else:
        import time

        time.sleep(SAY_ONCE_GRACE_S)


class OnceArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` for the torchrun tools: every rank parses the same command line, so a
    usage error is said once (:func:`say_once`, by rank 0, ``RANK`` from the launcher's environment) and
    every rank exits with argparse's status 2."""

    def error(self, message: str):
        say_once(f"{self.format_usage().rstrip()}\n{self.prog}: error: {message}", launcher_rank())
        raise SystemExit(2)


class NothingToTrain(Exception):
    """The run directory's newest checkpoint is already at ``train.steps``: the launch has nothing to do
    (found before any process group; the launcher says so once and exits 0)."""


def check_unfinished(cfg, resumes: str | None, run_dir: str, *, rows_per_sample: int = 1) -> None:
    """Raise :class:`NothingToTrain` when ``resumes`` (what :func:`check_run_dir` returned) is at or past the
    run's last step (``train.steps``, or fewer where ``train.max_tokens`` ends it: the trainer's rule), instead
    of starting up only to stop at once. Like every start-up check it reads the checkpoint directory on each
    rank without communicating: the ranks must see the same directory (a shared file system). Not taken with
    ``checkpoint.peer_replica``: the full start-up's clean exit is what frees the peers' RAM replicas."""
    from engine.checkpoint.format import parse_step

    t = cfg.train
    last = t.last_step(rows_per_sample)
    step = parse_step(os.path.basename(resumes)) if resumes else None
    if step is not None and step >= last and not cfg.checkpoint.peer_replica:
        ends = f"train.steps={t.steps}" + (f" (train.max_tokens={t.max_tokens} ends it at step {last})"
                                            if last < t.steps else "")
        raise NothingToTrain(f"run directory {run_dir!r} is at step {step} (checkpoint {os.path.basename(resumes)}) "
                             f"and {ends}: nothing to train; raise train.steps (or train.max_tokens) to continue, "
                             "or give a new --run-dir")


def _is_tessel_config(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("model"), dict) and isinstance(data.get("train"), dict)


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _get(tree: dict | None, dotted: str) -> tuple[bool, Any]:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def config_changes(saved: dict, new: dict, *, keys=RESUME_KEYS) -> list[str]:
    """``key (old -> new)`` for each of ``keys`` whose value differs between two config dicts
    (``TesselConfig.to_dict()`` form). A key the saved config lacks (an older version) is not compared."""
    out = []
    for key in keys:
        had, old = _get(saved, key)
        has, value = _get(new, key)
        if had and has and old != value:
            out.append(f"{key} ({json.dumps(old)} -> {json.dumps(value)})")
    return out


def architecture_changes(saved: dict | None, new: dict) -> list[str]:
    """``model <key> (old -> new)`` for each architecture key (the resolved Hugging Face config.json
    dict) that differs."""
    if not isinstance(saved, dict):
        return []
    keys = sorted(set(saved) | set(new))
    return [f"model {k} ({json.dumps(saved.get(k))} -> {json.dumps(new.get(k))})"
            for k in keys if saved.get(k) != new.get(k)]


def check_run_dir(cfg, run_dir: str, *, model_config: dict | None = None, keys=RESUME_KEYS) -> str | None:
    """Refuse a launch into ``run_dir`` that would destroy or corrupt something (no communication).

    * ``run_dir`` exists, is not empty and holds no Tessel config.json: not a Tessel run, refused.
    * It holds a complete checkpoint (under ``checkpoint.dir`` or ``run_dir/checkpoints``): this launch
      resumes it, so the saved config (``run_dir/config.json``, else the checkpoint's own) and model
      (``run_dir/model_config.json``, else the checkpoint's) must agree with ``cfg`` and ``model_config``
      on the model and ``keys`` (:data:`RESUME_KEYS`; tools/posttrain.py: :data:`POSTTRAIN_RESUME_KEYS`);
      steps, the LR schedule, logging, the layout and the rest may change. Refused otherwise, in one line naming the keys and the way out.

    Returns the checkpoint that will be resumed (None: a fresh start). ValueError on refusal.
    """
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ValueError(f"run directory {run_dir!r} is a file; choose a directory (--run-dir or train.run_dir)")
    config_json = os.path.join(run_dir, "config.json")
    if os.path.isdir(run_dir):
        entries = sorted(os.listdir(run_dir))
        if entries and not _is_tessel_config(config_json):
            shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
            raise ValueError(f"run directory {run_dir!r} is not empty ({shown}) and is not a Tessel run (no Tessel "
                             "config.json): refusing to write into it; choose a new or empty directory with "
                             "--run-dir or --set train.run_dir=DIR")
    root = cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")
    if cfg.checkpoint.peer_replica and os.path.isfile(config_json) and os.path.isfile(
            os.path.join(run_dir, "model_config.json")):
        # A restart that may load the peers' replicas opens no file of the checkpoint directory: the newest
        # commit by listing and stat (the saved configs above are the run directory's, not the checkpoint's).
        from engine.checkpoint.peer import newest_committed

        found = newest_committed(root)
        complete = [] if found is None else [found]
    else:
        complete = list_checkpoints(root)
    if not complete:
        return None
    latest = complete[-1][1]
    saved_cfg = _read_json(config_json) if os.path.isfile(config_json) else None
    saved_model = _read_json(os.path.join(run_dir, "model_config.json"))
    if saved_cfg is None or saved_model is None:
        meta = _read_json(str(latest / METADATA_FILE)) or {}
        saved_cfg = saved_cfg or (meta.get("trainer_state") or {}).get("config")
        saved_model = saved_model or meta.get("model_config")
    changes = config_changes(saved_cfg or {}, cfg.to_dict(), keys=keys)
    if model_config is not None:
        changes = architecture_changes(saved_model, model_config) + changes
    if not changes:
        return str(latest)
    way_out = "start a new run directory (--run-dir NEW)"
    adapters_only = bool(_get(saved_cfg, "posttrain.lora.rank")[1])  # a LoRA run's checkpoint is no base
    if not any(c.startswith("model") for c in changes) and not adapters_only:
        way_out += f", with --set checkpoint.load={latest} to start from its weights (model only)"
    raise ValueError(f"run directory {run_dir!r} holds checkpoint {latest.name}, and this launch would resume it "
                     f"with changes that break the run: {', '.join(changes)}; {way_out}, or launch with the "
                     "saved values to resume")


def check_peer_replica(cfg, world: int) -> None:
    """``checkpoint.peer_replica`` needs a peer: refused with one rank, before any process group exists."""
    if cfg.checkpoint.peer_replica and world < 2:
        raise ValueError(f"checkpoint.peer_replica=true with a world of {world} rank: the replica of a rank's shard "
                         "is held by another rank; launch with torchrun --nproc-per-node >= 2, or set "
                         "checkpoint.peer_replica=false")


def remove_stale_saves(root: str | os.PathLike) -> list[Path]:
    """Delete the temporary directories of saves that never committed (``.tmp_step_*``) and the trash of an
    interrupted retention (``.trash_step_*``) under the checkpoint root; returns what was removed.

    A temporary directory that is a complete checkpoint (its ``metadata.json`` is written last, after every
    rank's shard) whose step has no directory is a commit cut between its two renames -- the replaced
    checkpoint of a re-saved step already moved to the trash, the new one not yet in place -- and is
    moved into place instead (with ``latest`` when it is the newest): deleting both would lose that step.

    Call on ONE rank (rank 0, which alone creates them) at start-up, before this run saves: no save of
    this run is in flight then, so every such directory belongs to a crashed process."""
    root = Path(root)
    if not root.is_dir():
        return []
    for p in sorted(root.iterdir()):
        step = _committed_tmp_step(p)
        if step is not None and not (root / step_dirname(step)).exists():
            os.rename(p, root / step_dirname(step))
            fsync_dir(root)
            newest = max(s for s, _ in list_checkpoints(root))
            if newest == step:
                replace_file_atomic(root / LATEST_FILE, (step_dirname(step) + "\n").encode())
    stale = sorted(p for p in root.iterdir() if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)))
    for p in stale:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return stale


def _committed_tmp_step(p: Path) -> int | None:
    """The step of a ``.tmp_step_*`` directory holding a complete checkpoint, else None."""
    if not (p.name.startswith(TMP_PREFIX) and p.is_dir() and not p.is_symlink() and check_complete(p) is None):
        return None  # check_complete: the metadata readable and every file it lists whole
    try:
        step = read_metadata(p)["step"]
    except (CheckpointError, KeyError):
        return None
    return step if isinstance(step, int) and p.name.startswith(f"{TMP_PREFIX}{step:08d}_") else None
