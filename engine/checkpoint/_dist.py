"""The few collectives a checkpoint needs, over a :class:`parallel.comm.Group` (``None`` = one process).

Metadata travels as UTF-8 JSON in uint8 tensors through :mod:`parallel.comm`, so it appears in the
mesh's byte ledger and nothing is pickled.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

from parallel import comm
from parallel.comm import Group


def world_group(*, ledger=None) -> Group | None:
    """A Group over every rank of the default process group (None when not distributed).

    Checkpoints span the whole world: every rank writes a file and rank 0 commits.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    world = dist.get_world_size()
    return Group(axis="world", ranks=range(world), rank=dist.get_rank(), pg=dist.group.WORLD,
                 ledger=ledger if ledger is not None else comm.Ledger())


def group_rank(group: Group | None) -> int:
    return 0 if group is None else group.rank


def group_size(group: Group | None) -> int:
    return 1 if group is None else group.size


def _device(group: Group) -> torch.device:
    if torch.cuda.is_available() and dist.get_backend(group.pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_json(obj, group: Group | None) -> list:
    """Every rank's JSON-able ``obj``, indexed by group rank (a collective over ``group``)."""
    if group is None or group.size == 1:
        return [json.loads(json.dumps(obj))]
    dev = _device(group)
    raw = json.dumps(obj, separators=(",", ":")).encode()
    lengths = comm.all_gather(torch.tensor([len(raw)], dtype=torch.int64, device=dev), group).tolist()
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    if raw:
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    gathered = comm.all_gather(buf.to(dev), group).view(group.size, max(lengths)).cpu()  # (ranks, max_len)
    return [json.loads(bytes(gathered[r, :n].numpy()).decode()) for r, n in enumerate(lengths)]


def all_true(flag: bool, group: Group | None) -> bool:
    """True when ``flag`` is true on every rank (a collective)."""
    if group is None or group.size == 1:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_device(group))
    comm.all_reduce(t, group, op="min")
    return bool(t.item())
