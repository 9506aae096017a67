"""The trainer-facing checkpoint object: periodic (async) saves, auto-resume, one save in flight.

A trainer builds one :class:`Checkpointer` per run and calls, on every rank at the same points::

    ckpt = Checkpointer(cfg.dir, group=mesh.world, keep_last=3, async_save=True)
    result = ckpt.load(tensors=...)           # auto-resume: newest complete checkpoint, or None
    for step in ...:
        train_step()
        ckpt.maybe_finalize()                 # commits a finished async save (tiny all-reduce)
        if step % interval == 0:
            ckpt.save(step=step, tensors=..., trainer_state=..., rank_state=...)
    ckpt.finalize()                           # before exit
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from engine.checkpoint import _dist
from engine.checkpoint.async_writer import StagingPool
from engine.checkpoint.format import find_latest_checkpoint
from engine.checkpoint.load import LoadResult, load_checkpoint
from engine.checkpoint.peer import PeerReplica, ReplicaSource
from engine.checkpoint.save import SaveHandle, check_keep_every, save_checkpoint
from engine.checkpoint.sharded import ShardedTensor
from parallel.comm import Group


class Checkpointer:
    """Saves under ``root`` with retention and (optionally) async writes; resumes from the newest.

    Retention: the newest ``keep_last`` complete checkpoints, plus every milestone (a step that is a
    multiple of ``keep_every``), which is never deleted.

    Promises: at most one save is in flight (a new ``save`` first commits the previous one); the
    host staging buffers of an async save are reused by the next one; every method is a collective
    over ``group`` except :attr:`pending`.

    ``peer_replica=True`` (2+ ranks): after each save commits, every rank's file is also held in the
    node-local RAM of its ring neighbour (:mod:`engine.checkpoint.peer`); :meth:`replica` offers it to
    ``load_checkpoint`` on a restart; :meth:`close` removes it at a clean exit.
    """

    def __init__(self, root: str | os.PathLike, *, group: Group | None = None, keep_last: int | None = None,
                 async_save: bool = False, keep_every: int | None = None, peer_replica: bool = False,
                 shm_root: str | os.PathLike | None = None):
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last={keep_last!r} must be an int >= 1, or None to keep every checkpoint")
        check_keep_every(keep_every, keep_last)
        self.keep_every = keep_every
        self.root = Path(root)
        self.group = group if group is not None and group.size > 1 else None  # one process: no collectives
        self.keep_last = keep_last
        self.async_save = bool(async_save)
        self._pool = StagingPool()
        self._pending: SaveHandle | None = None
        self.peer = None
        if peer_replica:
            self.peer = PeerReplica(self.root, self.group, **({"shm_root": shm_root} if shm_root else {}))

    @property
    def pending(self) -> SaveHandle | None:
        return self._pending

    def save(self, *, step: int, tensors: Sequence[ShardedTensor], model_config: dict | None = None,
             layout: dict | None = None, trainer_state: dict | None = None,
             rank_state: dict | None = None, side_files: dict[str, bytes] | None = None) -> SaveHandle:
        """Start (async) or complete (sync) the save of ``step``; see :func:`save_checkpoint`."""
        self.finalize()
        handle = save_checkpoint(self.root, step=step, tensors=tensors, group=self.group, model_config=model_config,
                                 layout=layout, trainer_state=trainer_state, rank_state=rank_state,
                                 keep_last=self.keep_last, async_save=self.async_save, staging=self._pool,
                                 side_files=side_files, keep_every=self.keep_every)
        self._pending = None if handle.committed else handle
        if handle.committed:
            self._replicate(handle)
        return handle

    def _replicate(self, handle: SaveHandle) -> None:
        """Every rank's file of the just committed save to its ring neighbour's /dev/shm (collective)."""
        if self.peer is not None:
            self.peer.replicate(handle.path, handle.step)

    def maybe_finalize(self) -> bool:
        """Commit the pending save if every rank has finished writing; never waits. True when none is pending."""
        if self._pending is None:
            return True
        if self._pending.finalize(blocking=False):
            handle, self._pending = self._pending, None
            self._replicate(handle)
            return True
        return False

    def finalize(self) -> Path | None:
        """Block until the pending save (if any) is committed; returns its directory."""
        if self._pending is None:
            return None
        handle, self._pending = self._pending, None
        path = handle.wait()
        self._replicate(handle)
        return path

    def replica(self, *, layout: dict | None = None, log=print) -> ReplicaSource | None:
        """The newest committed checkpoint as the peers hold it in RAM, to pass to ``load_checkpoint`` in place
        of a path (collective); None without ``peer_replica``, on a fresh start, or when a replica is missing,
        stale, or of another world size or layout (``log`` says why; load from disk then)."""
        if self.peer is None:
            return None
        return self.peer.source(layout=layout, log=log)

    def close(self) -> None:
        """A clean exit: commit the pending save, then remove this rank's peer replica (collective)."""
        self.finalize()
        if self.peer is not None:
            self.peer.remove()

    def latest(self) -> Path | None:
        """The newest complete checkpoint under ``root`` as rank 0 sees it (collective), or None."""
        found = None
        if _dist.group_rank(self.group) == 0 and self.root.exists():
            found = find_latest_checkpoint(self.root)
        answer = _dist.all_gather_json(None if found is None else str(found), self.group)[0]
        return None if answer is None else Path(answer)

    def load(self, *, tensors: Sequence[ShardedTensor], path: str | os.PathLike | None = None,
             layout: dict | None = None, strict: bool = True, verify: bool = True) -> LoadResult | None:
        """Auto-resume: load the newest complete checkpoint under ``root`` (or ``path``) into ``tensors``.

        Returns None when ``path`` is not given and ``root`` holds no complete checkpoint yet (a
        fresh run); an explicit ``path`` that is not a checkpoint raises CheckpointError.
        """
        if path is None:
            path = self.latest()
            if path is None:
                return None
        return load_checkpoint(path, tensors=tensors, group=self.group, layout=layout, strict=strict, verify=verify)
