"""Save at one layout, load at another: TP row/column/strided shards 2 -> 4 -> 1 ranks, flat
(distributed-optimizer) shards dp 2 -> 4, replicas, async save, exact per-rank state. Bitwise checks.

Three process launches in all (world 2, world 4, this process) to stay within the test budget.
"""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.checkpoint import (CheckpointError, ParamSpec, ShardedTensor, ShardingContext, load_checkpoint,
                               module_sharded_tensors, read_metadata, save_checkpoint, world_group)
from parallel.testing import run_distributed
from tests.engine.checkpoint.toy import F, ToyTP, global_tensors, optimizer_globals, optimizer_shards

SEED = 1


def _split_hook(name, param):
    # The model declares its fused local gate/up parameter as two logical tensors.
    if name == "fc1.weight":
        n = param.shape[0] // 2
        return ParamSpec(key=name, parts=(("fc1.gate", n), ("fc1.up", n)))
    return name


def _model_and_optimizer(*, tp_rank, tp, dp_rank, dp, seed, bucket_elems=100, hook=None):
    ctx = ShardingContext(tp_rank=tp_rank, tp_size=tp, replica_rank=dp_rank)
    model = ToyTP(tp_rank=tp_rank, tp=tp, seed=seed)
    opt_tensors, shards, expected, _ = optimizer_shards(model, ctx=ctx, dp_rank=dp_rank, dp=dp, seed=seed,
                                                        bucket_elems=bucket_elems)
    return model, module_sharded_tensors(model, ctx=ctx, hook=hook) + opt_tensors, shards, expected


def _check_loaded(model, shards, expected, *, tp_rank, tp, what):
    ref = ToyTP(tp_rank=tp_rank, tp=tp, seed=SEED)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), f"{what}: {name} differs after load"
    for sh, exp in zip(shards, expected):
        for state, t in sh.states.items():
            assert torch.equal(t, exp[state]), f"{what}: optimizer {state} [{sh.start}, {sh.end}) differs"


def _save_at_two(root: str):
    rank, group = dist.get_rank(), world_group()
    root = Path(root)
    # TP=2: row-, column- and strided (fused gate/up) shards, a replicated bf16 norm, optimizer state.
    model, tensors, _, _ = _model_and_optimizer(tp_rank=rank, tp=2, dp_rank=0, dp=1, seed=SEED)
    torch.manual_seed(100 + rank)
    save_checkpoint(root / "tp2", step=10, tensors=tensors, group=group, layout={"tp": 2, "dp": 1},
                    model_config={"hidden": 8}, trainer_state={"consumed_samples": 40},
                    rank_state={"rng": torch.get_rng_state()})
    # The same layout reloads exactly, per-rank RNG state included.
    model2, targets, _, _ = _model_and_optimizer(tp_rank=rank, tp=2, dp_rank=0, dp=1, seed=None)
    res = load_checkpoint(root / "tp2", tensors=targets, group=group, layout={"tp": 2, "dp": 1})
    assert torch.equal(res.rank_state["rng"], torch.get_rng_state())
    assert res.trainer_state == {"consumed_samples": 40} and res.step == 10
    assert load_checkpoint(root / "tp2", group=group, layout={"tp": 1, "dp": 2}).rank_state is None
    # Split hook: fused local gate/up saved as two logical tensors.
    _, split_tensors, _, _ = _model_and_optimizer(tp_rank=rank, tp=2, dp_rank=0, dp=1, seed=SEED, hook=_split_hook)
    save_checkpoint(root / "split", step=1, tensors=split_tensors, group=group)
    # DP=2 with flat optimizer shards; async: the live tensors change right after save() returns.
    model, tensors, _, _ = _model_and_optimizer(tp_rank=0, tp=1, dp_rank=rank, dp=2, seed=SEED)
    handle = save_checkpoint(root / "dp2", step=10, tensors=tensors, group=group, layout={"tp": 1, "dp": 2},
                             async_save=True)
    with torch.no_grad():
        for t in tensors:
            t.data.add_(1000.0)  # a training step overwriting params and optimizer state in place
    while not handle.finalize(blocking=False):
        pass
    assert handle.committed and (root / "dp2" / "step_00000010" / "metadata.json").is_file()
    # A layout error (both ranks claim to write the whole norm) fails on every rank, writes nothing.
    bad = [ShardedTensor.replicated("norm", torch.zeros(4))]
    try:
        save_checkpoint(root / "bad", step=1, tensors=bad, group=group)
    except CheckpointError as e:
        msg = str(e)
    else:
        msg = None
    dist.barrier()  # rank 0 removes the temporary directory after raising
    return msg, sorted(p.name for p in (root / "bad").iterdir())


def _load_at_four(root: str):
    rank, group = dist.get_rank(), world_group()
    root = Path(root)
    # TP=2 checkpoint -> TP=4.
    model, targets, shards, expected = _model_and_optimizer(tp_rank=rank, tp=4, dp_rank=0, dp=1, seed=None)
    res = load_checkpoint(root / "tp2", tensors=targets, group=group, layout={"tp": 4, "dp": 1})
    assert res.rank_state is None and res.trainer_state == {"consumed_samples": 40}
    _check_loaded(model, shards, _model_and_optimizer(tp_rank=rank, tp=4, dp_rank=0, dp=1, seed=SEED)[3],
                  tp_rank=rank, tp=4, what="tp2->tp4")
    # DP=2 flat shards -> TP=2 x DP=2 (rank = dp * 2 + tp), other bucket boundaries.
    dp_rank, tp_rank = divmod(rank, 2)
    model, targets, shards, expected = _model_and_optimizer(tp_rank=tp_rank, tp=2, dp_rank=dp_rank, dp=2, seed=None,
                                                            bucket_elems=37)
    load_checkpoint(root / "dp2", tensors=targets, group=group)
    ref = _model_and_optimizer(tp_rank=tp_rank, tp=2, dp_rank=dp_rank, dp=2, seed=SEED, bucket_elems=37)
    _check_loaded(model, shards, ref[3], tp_rank=tp_rank, tp=2, what="dp2->tp2xdp2")
    # ... and save from this layout (async), to be read back at one rank.
    handle = save_checkpoint(root / "tp2dp2", step=20, tensors=targets, group=group, async_save=True)
    handle.wait()
    # DP=2 -> DP=4 flat shards.
    model, targets, shards, _ = _model_and_optimizer(tp_rank=0, tp=1, dp_rank=rank, dp=4, seed=None, bucket_elems=50)
    load_checkpoint(root / "dp2", tensors=targets, group=group)
    ref = _model_and_optimizer(tp_rank=0, tp=1, dp_rank=rank, dp=4, seed=SEED, bucket_elems=50)
    _check_loaded(model, shards, ref[3], tp_rank=0, tp=1, what="dp2->dp4")
    return True


def _full_targets(keys_shapes):
    return {k: torch.zeros(shape, dtype=dt) for k, (shape, dt) in keys_shapes.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    bad_msgs = run_distributed(_save_at_two, 2, str(root), timeout=150)
    assert run_distributed(_load_at_four, 4, str(root), timeout=150) == [True] * 4
    return root, bad_msgs


def test_layout_error_fails_every_rank_and_leaves_nothing(saved):
    _, bad = saved
    for msg, left in bad:
        assert msg is not None and "tensor 'norm': pieces overlap" in msg and "replica_id" in msg
        assert left == []  # the temporary directory was removed, no step directory created


@pytest.mark.parametrize("name", ["tp2", "dp2", "tp2dp2"])
def test_every_layout_reads_back_as_the_global_tensors_at_one_rank(saved, name):
    root, _ = saved
    ref = global_tensors(SEED)
    opt = optimizer_globals(SEED)
    targets = {f"model.{k}": torch.zeros_like(v) for k, v in ref.items()}
    for state, fulls in opt.items():
        targets.update({f"optimizer.{state}.{k}": torch.zeros_like(v) for k, v in fulls.items()})
    load_checkpoint(root / name, tensors=[ShardedTensor.replicated(k, v) for k, v in targets.items()])
    for k, v in ref.items():
        assert torch.equal(targets[f"model.{k}"], v), k
    for state, fulls in opt.items():
        for k, v in fulls.items():
            assert torch.equal(targets[f"optimizer.{state}.{k}"], v), (state, k)


def test_metadata_describes_pieces_and_replicas(saved):
    root, _ = saved
    meta = read_metadata(root / "tp2" / "step_00000010")
    assert meta["world_size"] == 2 and meta["layout"] == {"tp": 2, "dp": 1}
    fc1 = meta["tensors"]["model.fc1.weight"]
    assert fc1["shape"] == [2 * F, 8] and fc1["dtype"] == "float32"
    # Strided (gate/up) shards: two row blocks per rank, at gate and up offsets.
    assert sorted(tuple(p["offset"]) for p in fc1["pieces"]) == [(0, 0), (6, 0), (12, 0), (18, 0)]
    norm = meta["tensors"]["model.norm.weight"]
    assert norm["dtype"] == "bfloat16" and [p["rank"] for p in norm["pieces"]] == [0]  # tp rank 1 is a replica
    dp2 = read_metadata(root / "dp2" / "step_00000010")
    flat = [p for p in dp2["tensors"]["optimizer.exp_avg.fc1.weight"]["pieces"]]
    assert all(p["flat_range"] is not None for p in flat) and {p["rank"] for p in flat} <= {0, 1}
    assert set(dp2["files"]) == {"rank_00000.safetensors", "rank_00001.safetensors"}


def test_split_hook_saves_fused_gate_up_as_two_logical_tensors(saved):
    root, _ = saved
    full = global_tensors(SEED)["fc1.weight"]
    gate, up = torch.zeros(F, 8), torch.zeros(F, 8)
    load_checkpoint(root / "split", tensors=[ShardedTensor.replicated("model.fc1.gate", gate),
                                             ShardedTensor.replicated("model.fc1.up", up)])
    assert torch.equal(gate, full[:F]) and torch.equal(up, full[F:])
    # And back into a fused TP=2 rank-1 local parameter [gate_1; up_1] through the same hook.
    model = ToyTP(tp_rank=1, tp=2, seed=None)
    load_checkpoint(root / "split", tensors=module_sharded_tensors(
        model, ctx=ShardingContext(tp_rank=1, tp_size=2), hook=_split_hook), strict=True)
    assert torch.equal(model.fc1.weight, ToyTP(tp_rank=1, tp=2, seed=SEED).fc1.weight)
