"""Single-process behaviour: format, flat-range geometry, async snapshot, atomic commit, retention, layouts."""
import itertools
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from engine.checkpoint import (CheckpointError, CheckpointWarning, FlatShard, ParamSpec, ShardedTensor, ShardingContext,
                               find_latest_checkpoint, flat_buffer_sharded_tensors, from_json_state, list_checkpoints,
                               load_checkpoint, param_layout, read_metadata, save_checkpoint, to_json_state)
from engine.checkpoint import load as load_mod
from engine.checkpoint import save as save_mod
from engine.checkpoint.sharded import check_tiling, flat_range_boxes, piece_boxes


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 4)])
def test_flat_range_boxes_cover_exactly_the_range(shape):
    n = math.prod(shape)
    idx = torch.arange(n).view(shape)
    for s, e in itertools.combinations(range(n + 1), 2):
        boxes = flat_range_boxes(shape, s, e)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        got = torch.full((e - s,), -1)
        for b in boxes:
            got[b.flat_start:b.flat_start + b.numel] = idx[tuple(slice(o, o + k) for o, k in zip(b.offset, b.shape))].reshape(-1)
        assert torch.equal(got, torch.arange(s, e)), (shape, s, e)


def test_tiling_detects_overlap_and_gap():
    full = [("a", piece_boxes((0, 0), (2, 4), None)), ("b", piece_boxes((2, 0), (2, 4), (0, 8)))]
    check_tiling("t", (4, 4), full)
    with pytest.raises(CheckpointError, match="pieces overlap"):
        check_tiling("t", (4, 4), full + [("c", piece_boxes((1, 0), (3, 4), (3, 4)))])
    with pytest.raises(CheckpointError, match="cover 14 of 16"):
        check_tiling("t", (4, 4), [full[0], ("b", piece_boxes((2, 0), (2, 4), (1, 7)))])


def test_round_trip_of_flat_pieces_in_3d_and_scalars(tmp_path):
    full = torch.randn(4, 3, 5, dtype=torch.float64)
    lower = full[:2].reshape(-1)  # flat pieces over the (2, 3, 5) lower half, a rectangle above it
    pieces = [ShardedTensor(key="x", data=lower[a:b].clone(), global_shape=(4, 3, 5), local_shape=(2, 3, 5),
                            flat_range=(a, b)) for a, b in [(0, 7), (7, 8), (8, 19), (19, 30)]]
    pieces.append(ShardedTensor(key="x", data=full[2:].clone(), global_shape=(4, 3, 5), global_offset=(2, 0, 0)))
    pieces.append(ShardedTensor(key="step", data=torch.tensor(17, dtype=torch.int64), global_shape=()))
    save_checkpoint(tmp_path, step=0, tensors=pieces)
    # Read back through a different cut: a flat range that crosses the saved pieces, and a column.
    got_flat = torch.zeros(40, dtype=torch.float64)
    got_col = torch.zeros(4, 3, 1, dtype=torch.float64)
    step = torch.zeros((), dtype=torch.int64)
    load_checkpoint(tmp_path, tensors=[
        ShardedTensor(key="x", data=got_flat, global_shape=(4, 3, 5), global_offset=(1, 0, 0), local_shape=(3, 3, 5),
                      flat_range=(3, 43)),
        ShardedTensor(key="x", data=got_col, global_shape=(4, 3, 5), global_offset=(0, 0, 4)),
        ShardedTensor(key="step", data=step, global_shape=())])
    assert torch.equal(got_flat, full[1:].reshape(-1)[3:43])
    assert torch.equal(got_col, full[:, :, 4:])
    assert step.item() == 17


def test_shard_files_are_plain_safetensors(tmp_path):
    w = torch.randn(3, 4).bfloat16()
    save_checkpoint(tmp_path, step=1, tensors=[ShardedTensor.replicated("w", w),
                                               ShardedTensor.replicated("i", torch.arange(3, dtype=torch.int32))])
    loaded = load_file(str(tmp_path / "step_00000001" / "rank_00000.safetensors"))
    assert torch.equal(loaded["w"], w) and torch.equal(loaded["i"], torch.arange(3, dtype=torch.int32))
    meta = read_metadata(tmp_path / "step_00000001")
    assert (tmp_path / "latest").read_text() == "step_00000001\n"
    info = meta["files"]["rank_00000.safetensors"]
    assert len(info["sha256"]) == 64 and info["bytes"] == (tmp_path / "step_00000001" / "rank_00000.safetensors").stat().st_size
    assert not any(p.name.endswith((".pt", ".pkl", ".bin")) for p in (tmp_path / "step_00000001").iterdir())


def test_reads_only_the_files_and_slices_a_rank_needs(tmp_path):
    # Four pieces in a single file (one rank) still yield one read per intersecting piece, each
    # limited to the intersection; pieces that do not meet the target are never touched.
    full = torch.arange(64.0).view(8, 8)
    pieces = [ShardedTensor.chunked("w", full[2 * r:2 * r + 2].clone(), dim=0, rank=r, size=4) for r in range(4)]
    save_checkpoint(tmp_path, step=1, tensors=pieces)
    meta = read_metadata(tmp_path / "step_00000001")
    target = ShardedTensor(key="w", data=torch.zeros(3, 2), global_shape=(8, 8), global_offset=(3, 5))
    reads = load_mod._plan_reads(meta, [target], [])
    assert [(r.name, r.lo, r.hi) for r in reads] == [("w#1", (3, 5), (4, 7)), ("w#2", (4, 5), (6, 7))]
    load_checkpoint(tmp_path, tensors=[target])
    assert torch.equal(target.data, full[3:6, 5:7])


def test_async_save_snapshots_before_returning(tmp_path):
    w = torch.randn(256, 256)
    ref = w.clone()
    handle = save_checkpoint(tmp_path, step=5, tensors=[ShardedTensor.replicated("w", w)], async_save=True,
                             trainer_state={"step": 5})
    w.add_(1.0)  # training continues and modifies the parameter in place
    assert handle.wait() == tmp_path / "step_00000005" and handle.committed and handle.done()
    out = torch.zeros(256, 256)
    res = load_checkpoint(tmp_path, tensors=[ShardedTensor.replicated("w", out)])
    assert torch.equal(out, ref) and res.trainer_state == {"step": 5}


def test_commit_happens_only_in_finalize(tmp_path, monkeypatch):
    # Block the background writer so the save is observably in flight.
    import threading
    gate = threading.Event()
    real = save_mod.BackgroundWrite._run

    def slow_run(self, *args):
        gate.wait(30)
        real(self, *args)

    monkeypatch.setattr(save_mod.BackgroundWrite, "_run", slow_run)
    handle = save_checkpoint(tmp_path, step=2, tensors=[ShardedTensor.replicated("w", torch.zeros(4))], async_save=True)
    assert not handle.done() and not handle.finalize(blocking=False)
    assert [p.name.startswith(".tmp_step_00000002_") for p in tmp_path.iterdir()] == [True]
    gate.set()
    assert handle.finalize(blocking=True) and (tmp_path / "step_00000002" / "metadata.json").is_file()
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_keep_last_retention_never_touches_incomplete_or_new(tmp_path):
    t = [ShardedTensor.replicated("w", torch.zeros(4))]
    (tmp_path / "step_00000000").mkdir()  # incomplete: no metadata
    (tmp_path / ".tmp_step_00000099_abc").mkdir()  # a crashed save
    (tmp_path / ".trash_step_00000000_abc").mkdir()  # an interrupted deletion: removed by the next pass
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step=step, tensors=t, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    assert (tmp_path / "step_00000000").is_dir() and (tmp_path / ".tmp_step_00000099_abc").is_dir()
    # A rollback save of an older step is never deleted by its own retention pass.
    save_checkpoint(tmp_path, step=2, tensors=t, keep_last=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4]
    assert (tmp_path / "latest").read_text() == "step_00000002\n"
    assert not any(p.name.startswith(".trash") for p in tmp_path.iterdir())
    # Async saves delete in a background thread, off the training loop.
    import time
    for step in (5, 6):
        save_checkpoint(tmp_path, step=step, tensors=t, keep_last=1, async_save=True).wait()
    deadline = time.monotonic() + 10
    while any(p.name.startswith(".trash") for p in tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [6]
    assert not any(p.name.startswith(".trash") for p in tmp_path.iterdir())


def test_resaving_a_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, step=1, tensors=[ShardedTensor.replicated("w", torch.zeros(4))])
    with pytest.warns(CheckpointWarning, match="replacing the existing checkpoint"):
        save_checkpoint(tmp_path, step=1, tensors=[ShardedTensor.replicated("w", torch.ones(4))])
    out = torch.zeros(4)
    load_checkpoint(tmp_path, tensors=[ShardedTensor.replicated("w", out)])
    assert torch.equal(out, torch.ones(4))


def test_failed_write_deletes_nothing(tmp_path, monkeypatch):
    t = [ShardedTensor.replicated("w", torch.zeros(4))]
    save_checkpoint(tmp_path, step=1, tensors=t, keep_last=1)

    def disk_full(path, entries, *, metadata):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(save_mod, "write_safetensors", disk_full)
    with pytest.raises(CheckpointError, match="saving step 2 failed .*No space left on device.*previous checkpoints"):
        save_checkpoint(tmp_path, step=2, tensors=t, keep_last=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert (tmp_path / "latest").read_text() == "step_00000001\n"
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".tmp_step_00000002_")]) == 1
    with pytest.warns(CheckpointWarning):
        assert find_latest_checkpoint(tmp_path) == tmp_path / "step_00000001"


def test_a_staging_failure_gives_the_pools_buffers_back():
    from engine.checkpoint.async_writer import StagingPool, stage_to_host

    class Broken:
        def detach(self):
            raise RuntimeError("cannot read this tensor")

    pool = StagingPool()
    with pytest.raises(RuntimeError, match="cannot read"):
        stage_to_host([torch.ones(4), Broken()], snapshot=True, pool=pool)
    assert pool.nbytes == 16  # the first tensor's buffer is back in the pool for the next save


def _staging_fails_on_rank1(root: str):
    """Two ranks save step 1, then step 2 with rank 1's host staging failing (out of host memory, say), after
    the ranks have met in the save's first collective."""
    import torch.distributed as dist

    from engine.checkpoint._dist import world_group

    group = world_group()
    me = dist.get_rank()
    t = [ShardedTensor.chunked("w", torch.full((4,), float(me)), dim=0, rank=me, size=2)]  # each rank writes
    save_checkpoint(root, step=1, tensors=t, group=group, keep_last=1)
    if me == 1:
        def no_memory(tensors, *, snapshot, pool=None):
            raise RuntimeError("cannot allocate 12 bytes of pinned host memory")
        save_mod.stage_to_host = no_memory
    try:
        save_checkpoint(root, step=2, tensors=t, group=group, keep_last=1)
    except CheckpointError as e:
        return str(e)
    return None


def test_a_staging_failure_on_one_rank_fails_every_rank_and_deletes_nothing(tmp_path):
    from parallel.testing import run_distributed

    got = run_distributed(_staging_fails_on_rank1, 2, str(tmp_path), timeout=60)
    assert got[0] == got[1] and got[0] is not None, got  # the same error on both ranks, none waits alone
    assert "saving step 2 failed (rank 1: RuntimeError: cannot allocate 12 bytes" in got[0], got[0]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]  # the previous checkpoint is untouched
    assert (tmp_path / "latest").read_text() == "step_00000001\n"


def test_json_state_round_trip():
    state = {"rng": torch.get_rng_state(), "bf": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
             "lr": {"last_epoch": 3, "base": [1e-3, None], "warm": True}, "empty": torch.zeros(0, 2)}
    back = from_json_state(json.loads(json.dumps(to_json_state(state))))
    assert torch.equal(back["rng"], state["rng"]) and torch.equal(back["bf"], state["bf"])
    assert back["lr"] == state["lr"] and back["empty"].shape == (0, 2)


def _param(shape, *, dim=None, stride=1):
    p = torch.nn.Parameter(torch.zeros(shape))
    p.tensor_parallel = dim is not None
    if dim is not None:
        p.partition_dim, p.partition_stride = dim, stride
    return p


def test_param_layout_offsets_and_replica_ids():
    ctx = ShardingContext(tp_rank=1, tp_size=2, replica_rank=0)
    lay = param_layout("fc1", _param((6, 4), dim=0, stride=2), ctx=ctx)  # [gate_1; up_1], 3 rows each
    assert [(p.global_shape, p.global_offset) for p in lay.parts] == [((12, 4), (3, 0)), ((12, 4), (9, 0))]
    assert lay.replica_id == 0
    row = param_layout("fc2", _param((4, 3), dim=1), ctx=ctx)
    assert row.parts[0].global_shape == (4, 6) and row.parts[0].global_offset == (0, 3)
    cross = param_layout("o", _param((6, 3), dim=1), ctx=ctx, spec=ParamSpec(key="o", parts=(("q", 2), ("k", 4)), dim=0))
    assert [(p.key, p.global_shape, p.global_offset) for p in cross.parts] == [("q", (2, 6), (0, 3)), ("k", (4, 6), (0, 3))]
    norm = param_layout("norm", _param((4,)), ctx=ctx)
    assert norm.replica_id == 1 and norm.tp_replica_id == 1  # tp rank 1 holds a copy
    dp1 = ShardingContext(tp_rank=0, tp_size=2, replica_rank=1)
    assert param_layout("norm", _param((4,)), ctx=dp1).replica_id > 0
    assert param_layout("norm", _param((4,)), ctx=dp1).tp_replica_id == 0  # its optimizer shard is written
    assert param_layout("fc1", _param((6, 4), dim=0), ctx=dp1).replica_id > 0
    tied = param_layout("head", _param((6, 4), dim=0), ctx=ShardingContext(), spec=ParamSpec(key="emb", extra_replica=1))
    assert tied.replica_id > 0 and tied.parts[0].key == "emb"
    with pytest.raises(ValueError, match="parts sizes \\[2, 2\\] must sum to the local size 6"):
        param_layout("fc1", _param((6, 4), dim=0), ctx=ctx, spec=ParamSpec(key="x", parts=(("a", 2), ("b", 2))))


def test_flat_shards_of_a_column_split_param_cover_it():
    # A part split along dim 1 makes strided flat pieces: they still reassemble exactly.
    ctx = ShardingContext()
    lay = param_layout("w", _param((3, 4)), ctx=ctx, spec=ParamSpec(key="w", parts=(("a", 1), ("b", 3)), dim=1))
    assert [(p.global_shape, p.global_offset, p.dim) for p in lay.parts] == [((3, 1), (0, 0), 1), ((3, 3), (0, 0), 1)]
    flat = torch.arange(12.0)
    pieces = flat_buffer_sharded_tensors([(lay, 0, 12)], [FlatShard(start=0, end=5, states={"s": flat[:5]}),
                                                          FlatShard(start=5, end=12, states={"s": flat[5:]})])
    full = flat.view(3, 4)
    for p in pieces:
        exp = full[:, :1] if p.key == "optimizer.s.a" else full[:, 1:]
        assert p.flat_range is None
        assert torch.equal(p.data, exp[tuple(slice(o, o + n) for o, n in zip(p.global_offset, p.local_shape))])
    check_tiling("a", (3, 1), [(str(i), p.boxes()) for i, p in enumerate(pieces) if p.key.endswith(".a")])
    check_tiling("b", (3, 3), [(str(i), p.boxes()) for i, p in enumerate(pieces) if p.key.endswith(".b")])
    with pytest.raises(ValueError, match="expected 1-D of 5 elements"):
        flat_buffer_sharded_tensors([(lay, 0, 12)], [FlatShard(start=0, end=5, states={"s": flat[:4]})])


def test_contiguous_regions_bypass_safetensors_slicing(tmp_path, monkeypatch):
    full = torch.arange(64.0).view(8, 8)
    save_checkpoint(tmp_path, step=1, tensors=[
        ShardedTensor.chunked("w", full[2 * r:2 * r + 2].clone(), dim=0, rank=r, size=4) for r in range(4)])
    opened = []
    real = load_mod.safe_open
    monkeypatch.setattr(load_mod, "safe_open", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    rows = ShardedTensor(key="w", data=torch.zeros(3, 8), global_shape=(8, 8), global_offset=(1, 0))
    flat = ShardedTensor(key="w", data=torch.zeros(13), global_shape=(8, 8), global_offset=(4, 0), local_shape=(4, 8),
                         flat_range=(5, 18))
    load_checkpoint(tmp_path, tensors=[rows, flat])
    assert opened == []  # whole rows and flat runs: one preadv each, straight into the target
    assert torch.equal(rows.data, full[1:4]) and torch.equal(flat.data, full[4:].reshape(-1)[5:18])
    cols = ShardedTensor(key="w", data=torch.zeros(8, 3), global_shape=(8, 8), global_offset=(0, 2))
    load_checkpoint(tmp_path, tensors=[cols])
    assert len(opened) == 1 and torch.equal(cols.data, full[:, 2:5])  # strided: get_slice


def test_checkpointer_auto_resume_one_save_in_flight_and_buffer_reuse(tmp_path):
    from engine.checkpoint import Checkpointer
    ckpt = Checkpointer(tmp_path / "run", keep_last=2, async_save=True)
    w = torch.zeros(64, 64)
    target = torch.empty(64, 64)
    assert ckpt.load(tensors=[ShardedTensor.replicated("w", target)]) is None  # fresh run
    h1 = ckpt.save(step=1, tensors=[ShardedTensor.replicated("w", w)], trainer_state={"step": 1})
    w.add_(1)
    h2 = ckpt.save(step=2, tensors=[ShardedTensor.replicated("w", w)], trainer_state={"step": 2})
    assert h1.committed and ckpt.pending is h2  # the second save committed the first before starting
    w.add_(1)
    while not ckpt.maybe_finalize():
        pass
    assert ckpt.pending is None and h2.committed
    assert ckpt._pool.nbytes == 64 * 64 * 4  # one staging buffer, reused by every save
    ckpt.save(step=3, tensors=[ShardedTensor.replicated("w", w)])
    assert ckpt.finalize() == tmp_path / "run" / "step_00000003"
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [2, 3]
    res = Checkpointer(tmp_path / "run").load(tensors=[ShardedTensor.replicated("w", target)])
    assert res.step == 3 and torch.equal(target, torch.full((64, 64), 2.0))
    with pytest.raises(ValueError, match="keep_last=0"):
        Checkpointer(tmp_path, keep_last=0)


def test_vocab_padding_may_differ_with_allow_shape_mismatch(tmp_path):
    # Saved at a layout padding 10 rows to 12; loaded at layouts padding to 16 (rows zeroed) and to 8
    # (a shorter table: saved rows beyond it skipped) - as a flat optimizer shard, too.
    full = torch.randn(12, 4)
    full[10:] = 0
    save_checkpoint(tmp_path, step=1, tensors=[ShardedTensor(key="emb", data=full[:6].clone(), global_shape=(12, 4)),
                                               ShardedTensor(key="emb", data=full[6:].clone(), global_shape=(12, 4),
                                                             global_offset=(6, 0))])
    big = ShardedTensor(key="emb", data=torch.full((8, 4), 7.0), global_shape=(16, 4), global_offset=(8, 0),
                        allow_shape_mismatch=True)
    flat = ShardedTensor(key="emb", data=torch.full((20,), 7.0), global_shape=(16, 4), global_offset=(8, 0),
                         local_shape=(8, 4), flat_range=(2, 22), allow_shape_mismatch=True)
    small = ShardedTensor(key="emb", data=torch.zeros(8, 4), global_shape=(8, 4), allow_shape_mismatch=True)
    load_checkpoint(tmp_path, tensors=[big, flat, small])
    padded = torch.cat([full, torch.zeros(4, 4)])
    assert torch.equal(big.data, padded[8:]) and torch.equal(flat.data, padded[8:].reshape(-1)[2:22])
    assert torch.equal(small.data, full[:8])
    with pytest.raises(CheckpointError, match=r"expects \(16, 8\) \(only dim 0, the padding, may differ\)"):
        load_checkpoint(tmp_path, tensors=[ShardedTensor(key="emb", data=torch.zeros(16, 8), global_shape=(16, 8),
                                                         allow_shape_mismatch=True)])
    with pytest.raises(CheckpointError, match=r"global shape \(12, 4\), the model expects \(16, 4\) \(the checkpoint"):
        load_checkpoint(tmp_path, tensors=[ShardedTensor(key="emb", data=torch.zeros(16, 4), global_shape=(16, 4))])
