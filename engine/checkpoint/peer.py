"""Peer replicas of checkpoint shards in node-local RAM (``checkpoint.peer_replica``).

torchrun restarts *every* worker when one dies, so no process survives to hold a peer's shard in its
memory; what survives a worker restart is node-local RAM outside the processes, ``/dev/shm`` (tmpfs).

After each committed save, every rank ``r`` sends exactly what it wrote -- its ``rank_<r>.safetensors``
bytes (none when all its pieces are replicas written by another rank) and the checkpoint's
``metadata.json`` -- over the process group to its ring neighbour ``(r + 1) % world``, which writes them
to ``/dev/shm/tessel-<run id>/holder_<r+1>/step_<s>/`` (a temporary name renamed into place, the previous
step's copy then removed: one replica per holder, never more). ``<run id>`` is a hash of the checkpoint
root's absolute path, stable across torchrun's restarts.

On an in-job restart :meth:`PeerReplica.source` (collective) looks up what every rank holds and returns a
:class:`ReplicaSource` when the replicas are complete (every file of the checkpoint is held by some
rank), of the newest committed step (found by listing the checkpoint root and ``stat``: no file of it is
opened), of that very commit (the size and mtime of its ``metadata.json``, recorded at replication, are
unchanged), and of the current world size and layout; otherwise None with the reason, and the caller
loads from disk. ``load_checkpoint(ReplicaSource)`` plans its reads from the replica's metadata and calls
:meth:`ReplicaSource.fetch` (collective), which moves each needed file from the rank whose ``/dev/shm``
holds it to the ranks that need it (``batch_p2p`` over gloo) and checks every file's sha256 against the
metadata.

On one node every rank's ``/dev/shm`` is the same tmpfs, so the replica survives what a worker restart
kills (the processes), not the loss of the node. On several nodes rank ``r``'s copy lives on the node of
rank ``r + 1``: with a node's ranks consecutive (torchrun's order) that is the same node except for its
last rank, so a lost node loses most of its ranks' copies and the restart loads from disk (said in one
line). Multi-node runs are not tested here (one machine).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from engine.checkpoint import _dist
from engine.checkpoint.format import (METADATA_FILE, CheckpointWarning, TMP_PREFIX, parse_step, rank_filename, step_dirname,
                                      to_json_state)
from parallel import comm
from parallel.comm import Group

SHM_ROOT = "/dev/shm"
_HELD = "held.json"  # beside the files: the step, the source rank and the committed metadata.json's identity


def run_id(root: str | os.PathLike) -> str:
    """The replica directory's name for the checkpoint root ``root``: stable across restarts of one run."""
    return "tessel-" + hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:16]


def newest_committed(root: str | os.PathLike) -> tuple[int, Path] | None:
    """(step, dir) of the newest ``step_*`` directory holding ``metadata.json``, by listing and ``stat`` only.

    A save renames its temporary directory to ``step_<s>`` only after ``metadata.json`` is durable
    (engine/checkpoint/save.py), so such a directory is a commit; this never opens a file.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    found = [(s, p) for p in root.iterdir() if (s := parse_step(p.name)) is not None and (p / METADATA_FILE).is_file()]
    return max(found) if found else None


def _identity(meta_path: Path) -> list[int]:
    st = meta_path.stat()
    return [st.st_size, st.st_mtime_ns]


def _read_into(path: Path, out: torch.Tensor) -> None:
    """Read the file ``path`` into the uint8 tensor ``out`` of its size, with no intermediate copy."""
    view = memoryview(out.numpy()).cast("B")
    with open(path, "rb") as f:
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise OSError(f"{path} is shorter than {len(view)} bytes (it changed while being read)")
            done += n


def _file_uint8(path: Path) -> torch.Tensor:
    """The bytes of the file ``path`` as a uint8 tensor, read straight into it."""
    out = torch.empty(path.stat().st_size, dtype=torch.uint8)
    _read_into(path, out)
    return out


def _backend(pg) -> str:
    import torch.distributed as dist

    return dist.get_backend(pg)


def _host_group(group: Group) -> tuple[Group, object | None]:
    """``group``'s ranks over gloo, and the process group made for it (None: ``group`` is gloo already). The
    replica moves host bytes (a rank's file, read from disk and written to /dev/shm); NCCL carries CUDA
    tensors only ("No backend type associated with device type cpu"), so an NCCL run sends them over a
    gloo group of the same ranks, made here (collective: every rank builds its Checkpointer)."""
    if _backend(group.pg) == "gloo":
        return group, None
    import torch.distributed as dist

    pg = dist.new_group(ranks=list(group.ranks), backend="gloo")
    # its own communicator: the flight recorder numbers its calls apart from group's (parallel/flight.py)
    return Group(axis=group.axis, ranks=group.ranks, rank=group.rank, pg=pg, ledger=group.ledger,
                 flight_axis=f"{group.flight_axis}_host"), pg


class PeerReplica:
    """This rank's side of the ring: it replicates its shard to ``rank + 1`` and holds ``rank - 1``'s."""

    def __init__(self, root: str | os.PathLike, group: Group | None, *, shm_root: str | os.PathLike = SHM_ROOT):
        if group is None or group.size < 2:
            raise ValueError("checkpoint.peer_replica needs a world of 2 or more ranks (a peer holds each rank's "
                             "shard); launch with torchrun --nproc-per-node >= 2, or set checkpoint.peer_replica=false")
        self.root = Path(root)
        self.group, self._own_pg = _host_group(group)
        self.base = Path(shm_root) / run_id(root)
        self.dir = self.base / f"holder_{group.rank:05d}"
        self.src, self.dst = (group.rank - 1) % group.size, (group.rank + 1) % group.size
        self.last_bytes = 0  # bytes this rank received and wrote at the last replication

    # -- after a committed save -------------------------------------------------------------------
    def replicate(self, step_dir: Path, step: int) -> None:
        """Send this rank's file of the committed checkpoint ``step_dir`` (and its metadata) to ``dst``; receive
        ``src``'s and keep it under ``/dev/shm`` in place of the previous one (collective over the group)."""
        g = self.group
        meta_path = step_dir / METADATA_FILE
        meta_bytes = meta_path.read_bytes()
        files = json.loads(meta_bytes)["files"]
        mine = rank_filename(g.rank)
        n_data = (step_dir / mine).stat().st_size if mine in files else 0
        held = json.dumps({"step": step, "from": g.rank, "file": mine if mine in files else None,
                           "world": g.size, "metadata_identity": _identity(meta_path)}).encode()
        lengths = torch.tensor([len(held), len(meta_bytes), n_data], dtype=torch.int64)
        theirs = torch.zeros(3, dtype=torch.int64)
        comm.wait(comm.batch_p2p([comm.P2P("send", lengths, self.dst), comm.P2P("recv", theirs, self.src)], g), g)
        # One buffer, the shard read straight into it: this rank's file once plus the peer's incoming copy in host
        # memory (before 2026-11-28: the file's bytes, their concatenation, a bytearray of it and the incoming copy).
        payload = torch.empty(len(held) + len(meta_bytes) + n_data, dtype=torch.uint8)  # (held + metadata + file,)
        head = memoryview(payload.numpy()).cast("B")
        head[:len(held)] = held
        head[len(held):len(held) + len(meta_bytes)] = meta_bytes
        if n_data:
            _read_into(step_dir / mine, payload[len(held) + len(meta_bytes):])
        incoming = torch.zeros(int(theirs.sum()), dtype=torch.uint8)
        comm.wait(comm.batch_p2p([comm.P2P("send", payload, self.dst), comm.P2P("recv", incoming, self.src)], g), g)
        raw = memoryview(incoming.numpy())
        n_held, n_meta = int(theirs[0]), int(theirs[1])
        info = json.loads(bytes(raw[:n_held]))
        tmp = self.dir / f"{TMP_PREFIX}{step:08d}_{uuid.uuid4().hex[:8]}"
        final = self.dir / step_dirname(step)
        try:
            tmp.mkdir(parents=True)
            (tmp / METADATA_FILE).write_bytes(raw[n_held:n_held + n_meta])
            if info["file"] is not None:
                (tmp / info["file"]).write_bytes(raw[n_held + n_meta:])
            (tmp / _HELD).write_bytes(bytes(raw[:n_held]))  # last: a copy without it is incomplete
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        except OSError as e:  # /dev/shm full or absent: no replica (a restart then loads from disk), training goes on
            shutil.rmtree(tmp, ignore_errors=True)
            final = None
            warnings.warn(f"checkpoint.peer_replica: cannot hold rank {self.src}'s copy of step {step} in {self.dir} "
                          f"({e}); a restart will load the checkpoint from disk", CheckpointWarning, stacklevel=3)
        for p in self.dir.iterdir() if self.dir.is_dir() else ():  # replaced, never accumulated (torn copies too)
            if p != final:
                shutil.rmtree(p, ignore_errors=True)
        self.last_bytes = int(theirs[1] + theirs[2]) if final is not None else 0

    # -- on a restart -------------------------------------------------------------------------------
    def _held(self) -> dict | None:
        if not self.dir.is_dir():
            return None
        copies = [p for p in self.dir.iterdir() if parse_step(p.name) is not None and (p / _HELD).is_file()]
        if len(copies) != 1:
            return None
        info = json.loads((copies[0] / _HELD).read_text())
        info["dir"] = str(copies[0])
        info["metadata_sha256"] = hashlib.sha256((copies[0] / METADATA_FILE).read_bytes()).hexdigest()
        return info

    def source(self, *, layout: dict | None, log: Callable[[str], None]) -> "ReplicaSource | None":
        """The newest committed checkpoint as held by the peers, or None (``log`` says why: load from disk)."""
        g = self.group
        newest = None
        if g.rank == 0:
            found = newest_committed(self.root)
            newest = None if found is None else {"step": found[0], "dir": str(found[1]),
                                                 "identity": _identity(found[1] / METADATA_FILE)}
        held = _dist.all_gather_json(self._held(), g)
        newest = _dist.all_gather_json(newest, g)[0]
        reason = None
        if newest is None:
            return None  # a fresh start: nothing to load
        by_src = {h["from"]: (r, h) for r, h in enumerate(held) if h is not None}
        missing = [r for r, h in enumerate(held) if h is None]
        if missing:
            reason = f"rank(s) {missing} hold no replica in {self.base}"
        elif any(h["world"] != g.size for h in held):
            reason = f"the replicas were written by a world of {held[0]['world']} ranks, this one has {g.size}"
        elif sorted(by_src) != list(range(g.size)):
            reason = (f"the replicas held here come from ranks {sorted(by_src)}, not one from each of ranks "
                      f"0-{g.size - 1} (some rank holds another rank's copy twice or none)")
        elif any(h["step"] != newest["step"] for h in held):
            reason = (f"the replicas hold step(s) {sorted({h['step'] for h in held})}, the newest committed "
                      f"checkpoint is step {newest['step']} (stale)")
        elif any(h["metadata_identity"] != newest["identity"] for h in held) or len(
                {h["metadata_sha256"] for h in held}) != 1:
            reason = f"the replicas of step {newest['step']} are of another commit than {newest['dir']}"
        meta = None
        if reason is None:
            meta = json.loads((Path(held[g.rank]["dir"]) / METADATA_FILE).read_text())
            if layout is not None and to_json_state(layout) != meta.get("layout"):
                reason = f"the layout changed ({meta.get('layout')} -> {to_json_state(layout)})"
            else:
                holders = {f"rank_{src:05d}.safetensors": r for src, (r, _) in by_src.items()}
                lost = [f for f in meta["files"] if f not in holders]
                if lost:
                    reason = f"no rank holds {lost}"
        if reason is not None:
            log(f"tessel: peer replica not used ({reason}); loading the checkpoint from disk")
            return None
        holders = {h["file"]: r for r, h in enumerate(held) if h["file"] is not None}
        return ReplicaSource(path=Path(newest["dir"]), meta=meta, holders=holders,
                             local_dir=Path(held[g.rank]["dir"]), group=g, log=log)

    def remove(self) -> None:
        """Delete this rank's held copy, then (once every rank has: collective) the run's replica directory."""
        shutil.rmtree(self.dir, ignore_errors=True)
        _dist.all_true(True, self.group)  # every holder directory of this node is gone after this
        try:
            self.base.rmdir()
        except OSError:
            pass  # removed by another rank of this node already
        if self._own_pg is not None:  # the gloo side group of an NCCL run (collective: every rank removes)
            import torch.distributed as dist

            dist.destroy_process_group(self._own_pg)
            self._own_pg = None


@dataclass
class ReplicaSource:
    """A committed checkpoint as the peers hold it: pass it to ``load_checkpoint`` in place of a path."""

    path: Path                 # the checkpoint directory it is a copy of (never opened)
    meta: dict                 # its metadata.json, from this rank's held copy
    holders: dict[str, int]    # file name -> the group rank whose /dev/shm holds it
    local_dir: Path            # this rank's held copy
    group: Group
    log: Callable[[str], None]

    def fetch(self, needed: set[str]) -> dict[str, bytes] | None:
        """The files this rank needs, moved from their holders (collective), each sha256-checked; None on
        every rank when any check failed (``log`` says which: the caller loads from disk)."""
        g = self.group
        needs = _dist.all_gather_json(sorted(needed), g)
        files = self.meta["files"]
        out: dict[str, bytes] = {}
        ops, recv_bufs = [], {}
        for n, names in enumerate(needs):  # the same order on every rank: sends and receives pair up
            for f in names:
                h = self.holders[f]
                if h == n:
                    if n == g.rank:
                        out[f] = (self.local_dir / f).read_bytes()
                elif g.rank == h:
                    ops.append(comm.P2P("send", _file_uint8(self.local_dir / f), n))
                elif g.rank == n:
                    recv_bufs[f] = torch.zeros(files[f]["bytes"], dtype=torch.uint8)  # (file bytes,)
                    ops.append(comm.P2P("recv", recv_bufs[f], h))
        comm.wait(comm.batch_p2p(ops, g), g)
        out.update({f: bytes(t.numpy()) for f, t in recv_bufs.items()})
        bad = [f for f, b in out.items() if len(b) != files[f]["bytes"]
               or hashlib.sha256(b).hexdigest() != files[f]["sha256"]]
        problems = [p for r, fs in enumerate(_dist.all_gather_json(bad, g)) for p in (f"{f} on rank {r}" for f in fs)]
        if problems:
            self.log(f"tessel: peer replica not used (sha256 mismatch: {', '.join(problems)}); loading the "
                     "checkpoint from disk")
            return None
        return out
