"""checkpoint.peer_replica on 2 gloo ranks (engine/checkpoint/peer.py): what the ring neighbour holds, byte for
byte; one copy per holder; a load from the replicas opens no checkpoint file and equals the saved tensors
bitwise; a stale replica falls back with a reason; the clean exit removes them. The torchrun restart with a
killed rank is tests/tools/test_restart.py."""
import torch

from parallel.testing import run_distributed
from tests.engine.checkpoint.toy import ToyTP


def _two_ranks(root, shm):
    from pathlib import Path

    from engine.checkpoint import Checkpointer, ShardingContext, load_checkpoint, module_sharded_tensors, world_group
    from engine.checkpoint.format import METADATA_FILE, rank_filename, step_dirname

    group = world_group()
    rank = group.rank
    model = ToyTP(tp_rank=rank, tp=2, seed=1)
    tensors = module_sharded_tensors(model, ctx=ShardingContext(tp_rank=rank, tp_size=2, replica_rank=0))
    ck = Checkpointer(root, group=group, keep_last=1, peer_replica=True, shm_root=shm)
    ck.save(step=1, tensors=tensors)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    ck.save(step=2, tensors=tensors)
    src = (rank - 1) % 2
    held = sorted(p.name for p in ck.peer.dir.iterdir())
    step_dir = Path(root) / step_dirname(2)
    same_file = (ck.peer.dir / step_dirname(2) / rank_filename(src)).read_bytes() == (
        step_dir / rank_filename(src)).read_bytes()
    same_meta = (ck.peer.dir / step_dirname(2) / METADATA_FILE).read_bytes() == (step_dir / METADATA_FILE).read_bytes()
    # What came over the wire and was written: the metadata plus the source rank's file, from their sizes on disk.
    analytic = (step_dir / METADATA_FILE).stat().st_size + (step_dir / rank_filename(src)).stat().st_size
    received = ck.peer.last_bytes

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    msgs = []
    result = load_checkpoint(ck.replica(log=msgs.append), tensors=tensors, group=group)
    ref = ToyTP(tp_rank=rank, tp=2, seed=1)
    equal = all(torch.equal(p, q + 1) for p, q in zip(model.parameters(), ref.parameters()))

    peer, ck.peer = ck.peer, None  # a save whose replication never happened (a kill after the commit)
    ck.save(step=3, tensors=tensors)
    ck.peer = peer
    stale = ck.replica(log=msgs.append)
    ck.close()
    return {"held": held, "same_file": same_file, "same_meta": same_meta, "analytic": analytic,
            "received": received, "opened": result.files_opened, "source": result.source, "equal": equal,
            "stale": stale, "msgs": msgs, "base_left": ck.peer.base.exists()}


def test_peer_replica_holds_exactly_the_neighbours_bytes_and_loads_without_opening_a_file(tmp_path):
    out = run_distributed(_two_ranks, 2, str(tmp_path / "ck"), str(tmp_path / "shm"), timeout=120)
    for r in out:
        assert r["held"] == ["step_00000002"]  # the step-1 copy was replaced, not kept
        assert r["same_file"] and r["same_meta"]
        assert r["received"] == r["analytic"]
        assert r["opened"] == 0 and r["source"] == "peer replica" and r["equal"]
        assert r["stale"] is None and len(r["msgs"]) == 1 and "stale" in r["msgs"][0], r["msgs"]
        assert not r["base_left"]


def _nccl_world(root, shm):
    """The world group as an NCCL run's (its backend reported as nccl, which carries CUDA tensors only): the
    replica goes over a gloo group of the same ranks, made at construction and destroyed at close."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from engine.checkpoint import Checkpointer, ShardingContext, load_checkpoint, module_sharded_tensors, world_group
    from engine.checkpoint import peer as peer_mod

    peer_mod._backend = lambda pg: "nccl" if pg is dist.group.WORLD else dist.get_backend(pg)
    group = world_group()
    model = ToyTP(tp_rank=group.rank, tp=2, seed=1)
    tensors = module_sharded_tensors(model, ctx=ShardingContext(tp_rank=group.rank, tp_size=2, replica_rank=0))
    ck = Checkpointer(root, group=group, keep_last=1, peer_replica=True, shm_root=shm)
    side = ck.peer.group.pg is not dist.group.WORLD and dist.get_backend(ck.peer.group.pg) == "gloo"
    ck.save(step=1, tensors=tensors)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    result = load_checkpoint(ck.replica(log=print), tensors=tensors, group=group)
    equal = all(torch.equal(p, q) for p, q in zip(model.parameters(), ToyTP(tp_rank=group.rank, tp=2, seed=1).parameters()))
    groups_open = len(c10d._world.pg_map)
    ck.close()
    return side, result.source, equal, groups_open, len(c10d._world.pg_map)


def test_peer_replica_of_an_nccl_run_goes_over_a_gloo_group():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = run_distributed(_nccl_world, 2, f"{d}/ck", f"{d}/shm", timeout=120)
    for side, source, equal, open_, closed in out:
        assert side and source == "peer replica" and equal, (side, source, equal)
        assert (open_, closed) == (2, 1)  # the side group, then only the world's
