"""Saving a sharded checkpoint: every rank writes its own file, rank 0 commits atomically.

Protocol (all ranks call :func:`save_checkpoint` with their own ShardedTensors, then ``finalize``):

1. Rank 0 creates ``<root>/.tmp_step_<step>_<uuid>/``; every rank's piece descriptions are
   all-gathered (one collective) and checked on every rank: one global shape and dtype per key,
   and the ``replica_id == 0`` pieces of each key tile it exactly. So a bad layout fails on every
   rank, before anything is written.
2. The bytes are staged on the host (async: a snapshot copy; sync: the tensors themselves) and
   each rank writes ``rank_<r>.safetensors`` into the temporary directory and fsyncs it - inline
   (sync) or in a background thread (async) while training continues.
3. ``finalize()`` (collective) gathers every rank's write result (file, sha256, size). Only when all
   ranks succeeded does rank 0 write ``metadata.json``, fsync it and the directory, rename the
   directory to ``step_<step>``, fsync the root, and then replace the ``latest`` pointer. Keep-last-k
   retention runs after that and only ever removes older complete checkpoints, never a milestone
   (a step that is a multiple of ``keep_every``).

A crash at any point leaves either the previous checkpoints untouched plus an ignored temporary
directory, or the new complete checkpoint. A failed save raises on every rank and deletes nothing.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import threading
import uuid
import warnings
from pathlib import Path
from typing import Sequence

from engine.checkpoint import _dist
from engine.checkpoint.async_writer import BackgroundWrite, StagingPool, stage_to_host
from engine.checkpoint.safetensors_io import WriteResult, test_pause, write_safetensors
from engine.checkpoint.format import (FORMAT_NAME, FORMAT_VERSION, LATEST_FILE, METADATA_FILE, TMP_PREFIX,
                                      TRASH_PREFIX, CheckpointError, CheckpointWarning, fsync_dir, list_checkpoints,
                                      rank_filename, replace_file_atomic, step_dirname, to_json_state,
                                      write_file_durable)
from engine.checkpoint.sharded import ShardedTensor, check_tiling, piece_boxes
from parallel.comm import Group


def _check_json(value, name: str):
    if value is None:
        return None
    state = to_json_state(value, where=name)
    try:
        json.dumps(state, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} is not JSON-able ({e}); pass plain dicts/lists/numbers/strings") from None
    return state


def build_tensor_index(per_rank_pieces: Sequence[list[dict]]) -> dict[str, dict]:
    """The ``tensors`` section of the metadata from every rank's piece descriptions (rank order).

    Checks that each key has one global shape and dtype on every rank and that the written pieces
    (``replica_id == 0``) tile it exactly; raises CheckpointError naming the key and ranks otherwise.
    """
    index: dict[str, dict] = {}
    first_seen: dict[str, int] = {}
    for rank, pieces in enumerate(per_rank_pieces):
        for p in pieces:
            key = p["key"]
            entry = index.get(key)
            if entry is None:
                entry = index[key] = {"shape": p["shape"], "dtype": p["dtype"], "pieces": []}
                first_seen[key] = rank
            elif entry["shape"] != p["shape"] or entry["dtype"] != p["dtype"]:
                raise CheckpointError(
                    f"tensor {key!r}: rank {first_seen[key]} describes global shape {tuple(entry['shape'])} "
                    f"{entry['dtype']} but rank {rank} describes {tuple(p['shape'])} {p['dtype']}; every rank "
                    "must agree on the logical tensor")
            if p["replica_id"] == 0:
                entry["pieces"].append({"rank": rank, "file": p["file"], "name": p["name"], "offset": p["offset"],
                                        "local_shape": p["local_shape"], "flat_range": p["flat_range"]})
    for key, entry in index.items():
        check_tiling(key, entry["shape"],
                     [(f"rank {pc['rank']} piece at offset {tuple(pc['offset'])}",
                       piece_boxes(pc["offset"], pc["local_shape"], pc["flat_range"])) for pc in entry["pieces"]])
    return index


def _describe_local(tensors: Sequence[ShardedTensor], rank: int) -> tuple[list[dict], list[tuple[str, ShardedTensor]]]:
    """Descriptions of this rank's pieces and the (file tensor name, piece) pairs it writes."""
    descs, writes, used = [], [], set()
    fname = rank_filename(rank)
    for t in tensors:
        if not isinstance(t, ShardedTensor):
            raise ValueError(f"save_checkpoint tensors must be ShardedTensor, got {type(t).__name__}; build them "
                             "with engine.checkpoint.module_sharded_tensors / ShardedTensor(...)")
        d = t.describe()
        d["file"] = d["name"] = None
        if t.replica_id == 0:
            name, i = t.key, 1
            while name in used:  # two pieces of one key on one rank
                name, i = f"{t.key}#{i}", i + 1
            used.add(name)
            d["file"], d["name"] = fname, name
            writes.append((name, t))
        descs.append(d)
    return descs, writes


class SaveHandle:
    """A save in flight. ``finalize()`` (collective) commits it; ``done()`` is local and never blocks."""

    def __init__(self, *, root: Path, step: int, group: Group | None, tmp_dir: Path, meta: dict,
                 keep_last: int | None, writer: BackgroundWrite | None, result: WriteResult | None,
                 error: BaseException | None, staged: list | None = None, pool: StagingPool | None = None,
                 keep_every: int | None = None):
        self.root, self.step, self.group = root, step, group
        self.path = root / step_dirname(step)
        self._tmp_dir, self._meta, self._keep_last, self._keep_every = tmp_dir, meta, keep_last, keep_every
        self._writer, self._result, self._error = writer, result, error
        self._staged, self._pool = staged, pool
        self._async = writer is not None
        self._state = "pending"  # -> "committed" | "failed"

    def done(self) -> bool:
        """True when this rank's file is written (or failed); the commit may still be pending."""
        return self._writer is None or self._writer.done()

    @property
    def committed(self) -> bool:
        return self._state == "committed"

    def wait(self) -> Path:
        """Block until the checkpoint is committed on every rank; returns its directory (collective)."""
        self.finalize(blocking=True)
        return self.path

    def finalize(self, *, blocking: bool = True) -> bool:
        """Commit once every rank's file is written (collective: call on all ranks at the same point).

        With ``blocking=False`` returns False at once unless every rank has finished writing (one
        tiny all-reduce), so a trainer can call it every step. Raises CheckpointError on every rank
        when any rank failed to write or rank 0 failed to commit; nothing is deleted then.
        """
        if self._state == "committed":
            return True
        if self._state == "failed":
            raise CheckpointError(f"the save of step {self.step} to {self.root} already failed")
        if not blocking and not _dist.all_true(self.done(), self.group):
            return False
        local = {"ok": True, "result": None}
        try:
            if self._writer is not None:
                self._result = self._writer.result()
            elif self._error is not None:
                raise self._error
            if self._result is not None:
                local["result"] = vars(self._result)
        except BaseException as e:  # noqa: BLE001 - every rank must learn about it
            local = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        self._writer = None
        if self._pool is not None and self._staged:
            self._pool.give_back(self._staged)  # the write is over: the next save may reuse them
        self._staged = None
        results = _dist.all_gather_json(local, self.group)
        failed = [f"rank {r}: {x['error']}" for r, x in enumerate(results) if not x["ok"]]
        if failed:
            self._state = "failed"
            raise CheckpointError(f"saving step {self.step} failed ({'; '.join(failed)}); the previous checkpoints "
                                  f"are untouched and {self._tmp_dir} was left for inspection")
        status = {"ok": True}
        if _dist.group_rank(self.group) == 0:
            try:
                self._commit(results)
            except Exception as e:  # noqa: BLE001
                status = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        status = _dist.all_gather_json(status, self.group)[0]
        if not status["ok"]:
            self._state = "failed"
            raise CheckpointError(f"committing step {self.step} to {self.root} failed on rank 0: {status['error']}")
        self._state = "committed"
        return True

    def _commit(self, results: list[dict]) -> None:
        meta = dict(self._meta)
        meta["files"] = {x["result"]["file"]: {"rank": r, "sha256": x["result"]["sha256"], "bytes": x["result"]["bytes"]}
                         for r, x in enumerate(results) if x["result"] is not None}
        write_file_durable(self._tmp_dir / METADATA_FILE, json.dumps(meta, indent=1).encode())
        fsync_dir(self._tmp_dir)
        trash = None
        if self.path.exists():  # re-saving a step (after a rollback): the new one replaces it
            trash = self.root / f"{TRASH_PREFIX}{self.step:08d}_{uuid.uuid4().hex[:8]}"
            os.rename(self.path, trash)
            warnings.warn(f"replacing the existing checkpoint {self.path}", CheckpointWarning, stacklevel=3)
        os.rename(self._tmp_dir, self.path)
        fsync_dir(self.root)
        test_pause("commit")
        replace_file_atomic(self.root / LATEST_FILE, (self.path.name + "\n").encode())
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        if self._keep_last is not None:
            apply_retention(self.root, keep_last=self._keep_last, protect=self.path,
                            background=self._async, keep_every=self._keep_every)


def apply_retention(root: Path, *, keep_last: int, protect: Path, background: bool = False,
                    keep_every: int | None = None) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last`` (by step); never ``protect``, and never a
    milestone: a checkpoint whose step is a multiple of ``keep_every`` (kept beside the newest ``keep_last``,
    which count every checkpoint, milestones included).

    Incomplete directories and temporary ones are never touched. Each victim is first renamed to a
    trash name (atomic), so a crash mid-delete cannot leave a half-deleted "complete" checkpoint;
    trash left by an earlier interrupted deletion is removed too. ``background=True`` (async
    saves) unlinks the trash in a daemon thread, off the training loop.
    """
    complete = list_checkpoints(root)
    victims = [p for step, p in complete[:max(0, len(complete) - keep_last)]
               if p.resolve() != protect.resolve() and not (keep_every and step % keep_every == 0)]
    trash = [p for p in root.iterdir() if p.name.startswith(TRASH_PREFIX)]
    for p in victims:
        t = root / f"{TRASH_PREFIX}{p.name}_{uuid.uuid4().hex[:8]}"
        try:
            os.rename(p, t)
            trash.append(t)
        except OSError as e:
            warnings.warn(f"retention could not delete {p}: {e}", CheckpointWarning, stacklevel=2)

    def delete() -> None:
        for t in trash:
            shutil.rmtree(t, ignore_errors=True)

    if background and trash:
        threading.Thread(target=delete, name="tessel-ckpt-retention", daemon=True).start()
    else:
        delete()
    return victims


def check_keep_every(keep_every, keep_last) -> None:
    """ValueError unless ``keep_every`` is None or an int >= 1 used beside ``keep_last``."""
    if keep_every is None:
        return
    if isinstance(keep_every, bool) or not isinstance(keep_every, int) or keep_every < 1:
        raise ValueError(f"keep_every={keep_every!r} must be an int >= 1 (the milestone interval in steps), or None")
    if keep_last is None:
        raise ValueError(f"keep_every={keep_every} without keep_last: every checkpoint is kept already; set "
                         "keep_last to bound the recent ones, or leave keep_every unset")


def save_checkpoint(root: str | os.PathLike, *, step: int, tensors: Sequence[ShardedTensor], group: Group | None = None,
                    model_config: dict | None = None, layout: dict | None = None, trainer_state: dict | None = None,
                    rank_state: dict | None = None, keep_last: int | None = None,
                    async_save: bool = False, staging: StagingPool | None = None,
                    side_files: dict[str, bytes] | None = None, keep_every: int | None = None) -> SaveHandle:
    """Save ``tensors`` (this rank's ShardedTensors) as checkpoint ``<root>/step_<step>`` (collective).

    ``group`` spans every rank taking part (``None``: a single process). ``model_config``,
    ``layout`` (the parallel degrees) and ``trainer_state`` (step, consumed samples, LR schedule...)
    are JSON taken from rank 0; ``rank_state`` is this rank's own JSON (its RNG states; tensors
    allowed). Sync: returns a committed handle. Async: returns once the bytes are snapshotted on the
    host and the write has started; call ``handle.finalize()`` / ``wait()`` on every rank to commit.
    ``staging`` reuses host buffers across async saves (see :class:`Checkpointer`). ``side_files``
    (relative path -> bytes, taken from rank 0) are data files written byte for byte into the step directory,
    e.g. ``hf/tokenizer.json`` or a binary ``hf/tokenizer.model`` (the run's tokenizer, which ``tessel-to-hf``
    copies into its export).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r} must be an int >= 1, or None to keep every checkpoint")
    check_keep_every(keep_every, keep_last)
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint root {root} exists and is not a directory; choose another checkpoint.dir")
    rank = _dist.group_rank(group)
    local_error: BaseException | None = None
    shared = rank_json = None
    descs, writes = [], []
    try:  # a bad argument on one rank must fail every rank, not leave the others in a collective
        shared = {"model_config": _check_json(model_config, "model_config"), "layout": _check_json(layout, "layout"),
                  "trainer_state": _check_json(trainer_state, "trainer_state")}
        rank_json = _check_json(rank_state, "rank_state")
        for name, data in (side_files or {}).items():
            parts = Path(name).parts
            if (Path(name).is_absolute() or not parts or ".." in parts or parts[0] == METADATA_FILE
                    or parts[0].startswith(("rank_", "."))):
                raise ValueError(f"side file name {name!r} must be a relative path inside the step directory, "
                                 "not metadata.json or a rank file")
            if not isinstance(data, bytes):
                raise ValueError(f"side file {name!r} is a {type(data).__name__}: give its bytes (files are written "
                                 "byte for byte; encode text with .encode())")
        descs, writes = _describe_local(tensors, rank)
    except Exception as e:  # noqa: BLE001 - said by every rank after the gather below
        local_error = e
    tmp_name = None
    if rank == 0 and local_error is None:
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp_name = f"{TMP_PREFIX}{step:08d}_{uuid.uuid4().hex}"
            (root / tmp_name).mkdir()
        except OSError as e:
            local_error = CheckpointError(f"cannot create a directory in {root}: {e}")
    gathered = _dist.all_gather_json({"pieces": descs, "rank_state": rank_json, "tmp": tmp_name,
                                      "error": None if local_error is None else str(local_error),
                                      "shared": shared if rank == 0 else None}, group)
    tmp_dir = root / gathered[0]["tmp"] if gathered[0]["tmp"] else None
    try:
        failed = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if g["error"]]
        if local_error is not None:
            raise local_error
        if failed:
            raise CheckpointError(f"save of step {step} aborted before writing: {'; '.join(failed)}")
        index = build_tensor_index([g["pieces"] for g in gathered])
    except Exception:
        if rank == 0 and tmp_dir is not None:
            os.rmdir(tmp_dir)  # still empty: nothing was written yet
        raise
    meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": step,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "world_size": len(gathered), **gathered[0]["shared"],
            "rank_states": [g["rank_state"] for g in gathered], "tensors": index}
    # From here on the ranks have met in a collective: a failure on one rank (staging out of host memory, a
    # full disk) is kept as ``error`` and said by every rank in finalize()'s collective, never raised alone
    # (which left the others waiting in that collective until its timeout, before 2026-11-28).
    entries, hosts = [], []
    writer = result = error = None
    if writes:
        # Widest dtypes first: with the 8-byte aligned header every tensor starts naturally aligned.
        writes.sort(key=lambda nt: -nt[1].data.element_size())
        try:
            hosts = stage_to_host([t.data for _, t in writes], snapshot=async_save, pool=staging)
            entries = list(zip([n for n, _ in writes], hosts))
        except Exception as e:  # noqa: BLE001 - every rank must learn about it (finalize)
            error = e
    path = tmp_dir / rank_filename(rank)
    file_meta = {"format": FORMAT_NAME, "step": str(step), "rank": str(rank)}
    if rank == 0 and side_files and error is None:  # data files, durable before the commit like the shards
        try:
            for name, data in side_files.items():
                (tmp_dir / name).parent.mkdir(parents=True, exist_ok=True)
                write_file_durable(tmp_dir / name, data)
        except Exception as e:  # noqa: BLE001
            error = e
    if entries and error is None:
        try:
            if async_save:
                writer = BackgroundWrite(path, entries, metadata=file_meta)
            else:
                result = write_safetensors(path, entries, metadata=file_meta)
        except Exception as e:  # noqa: BLE001
            error = e
    handle = SaveHandle(root=root, step=step, group=group, tmp_dir=tmp_dir, meta=meta, keep_last=keep_last,
                        keep_every=keep_every, writer=writer, result=result, error=error,
                        staged=[h for h, (_, t) in zip(hosts, writes) if h.data_ptr() != t.data.data_ptr()]
                        if entries else None, pool=staging)
    if not async_save:
        handle.finalize()
    return handle
