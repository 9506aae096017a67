"""Mesh: coordinates, group membership (pure and on real gloo groups), and bad degrees."""
import itertools

import pytest
import torch
import torch.distributed as dist

from parallel import comm
from parallel.mesh import AXES, Mesh, ParallelDims, coords_of, group_rank_lists, rank_of
from parallel.testing import run_distributed

SHAPES = [  # (dp, pp, cp, tp)
    (1, 1, 1, 1),
    (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2),
    (4, 1, 1, 1), (1, 1, 1, 4), (2, 2, 1, 1), (1, 2, 1, 2), (2, 1, 1, 2), (1, 1, 2, 2), (1, 4, 1, 1),
    (2, 2, 1, 2), (1, 2, 2, 2), (2, 1, 2, 2), (2, 2, 2, 1), (8, 1, 1, 1), (1, 2, 1, 4),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "dp%d-pp%d-cp%d-tp%d" % s)
@pytest.mark.parametrize("order", ["dp-pp-cp-tp", "tp-cp-pp-dp", "pp-dp-tp-cp"])
def test_groups_partition_the_world(shape, order):
    dims = ParallelDims(**dict(zip(("dp", "pp", "cp", "tp"), shape)))
    world = dims.world_size
    # coordinates are a bijection
    seen = {tuple(coords_of(r, dims, order)[a] for a in AXES) for r in range(world)}
    assert len(seen) == world
    for r in range(world):
        assert rank_of(coords_of(r, dims, order), dims, order) == r
    for name, size in (("tp", dims.tp), ("pp", dims.pp), ("dp", dims.dp), ("cp", dims.cp),
                       ("dp_cp", dims.dp * dims.cp), ("tp_cp", dims.tp * dims.cp)):
        groups = group_rank_lists(name, dims, order)
        assert sorted(itertools.chain(*groups)) == list(range(world)), name
        assert all(len(g) == size for g in groups), name
        for g in groups:  # members differ only along the group's axes, group rank = coordinate
            varying = {"dp_cp": ("dp", "cp"), "tp_cp": ("cp", "tp")}.get(name, (name,))
            fixed = [a for a in AXES if a not in varying]
            cs = [coords_of(r, dims, order) for r in g]
            assert all(c[a] == cs[0][a] for c in cs for a in fixed)
            if len(varying) == 1:
                assert [c[name] for c in cs] == list(range(size))
    emb = group_rank_lists("embedding", dims, order)
    assert len(emb) == world // dims.pp
    for g in emb:
        stages = sorted(coords_of(r, dims, order)["pp"] for r in g)
        assert stages == sorted({0, dims.pp - 1})


def test_default_order_puts_tp_innermost():
    dims = ParallelDims(dp=2, pp=2, tp=2)
    assert group_rank_lists("tp", dims) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_rank_lists("pp", dims) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_rank_lists("dp", dims) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_rank_lists("embedding", dims) == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_expert_groups_carve_ep_out_of_dp():
    dims = ParallelDims(dp=4, ep=2)
    assert group_rank_lists("ep", dims) == [[0, 1], [2, 3]]
    assert group_rank_lists("edp", dims) == [[0, 2], [1, 3]]


def _mesh_check(shape, order):
    dims = ParallelDims(**dict(zip(("dp", "pp", "cp", "tp"), shape)))
    mesh = Mesh.build(dims, order=order)
    out = {"coords": mesh.coords, "first": mesh.is_first_stage, "last": mesh.is_last_stage}
    for name in ("tp", "pp", "dp", "cp", "dp_cp", "tp_cp", "embedding"):
        g = mesh.group(name)
        # A real collective proves the process group holds exactly the listed ranks.
        t = torch.tensor([float(dist.get_rank())], dtype=torch.float64)
        comm.all_reduce(t, g)
        out[name] = (list(g.ranks), g.rank, int(t.item()))
    out["ledger_calls"] = mesh.ledger.count()
    return out


@pytest.mark.parametrize("world,shape,order", [
    (2, (1, 1, 1, 2), "dp-pp-cp-tp"),
    (4, (1, 2, 1, 2), "dp-pp-cp-tp"),
    (4, (2, 1, 2, 1), "tp-cp-pp-dp"),
    (8, (2, 2, 1, 2), "dp-pp-cp-tp"),
    (4, (1, 4, 1, 1), "dp-pp-cp-tp"),  # middle stages hold no embedding copy
])
def test_mesh_on_real_groups(world, shape, order):
    dims = ParallelDims(**dict(zip(("dp", "pp", "cp", "tp"), shape)))
    results = run_distributed(_mesh_check, world, shape, order, timeout=180)
    for rank, out in enumerate(results):
        assert out["coords"] == coords_of(rank, dims, order)
        assert out["first"] == (out["coords"]["pp"] == 0)
        assert out["last"] == (out["coords"]["pp"] == dims.pp - 1)
        for name in ("tp", "pp", "dp", "cp", "dp_cp", "tp_cp", "embedding"):
            ranks, grank, total = out[name]
            expected = next((g for g in group_rank_lists(name, dims, order) if rank in g), [rank])
            assert ranks == expected and grank == expected.index(rank)
            assert total == sum(expected)
        # size-1 groups never talk; every other group did one all-reduce
        n_real = sum(1 for name in ("tp", "pp", "dp", "cp", "dp_cp", "tp_cp", "embedding")
                     if len(out[name][0]) > 1)
        assert out["ledger_calls"] == n_real


def test_single_process_mesh_needs_no_distributed():
    mesh = Mesh.single()
    assert mesh.tp.size == 1 and mesh.dp.size == 1 and mesh.is_first_stage and mesh.is_last_stage
    assert Mesh.build(ParallelDims()).world_size == 1


@pytest.mark.parametrize("kwargs,msg", [
    ({"tp": 0}, r"parallel.tp=0: parallel degrees must be integers >= 1"),
    ({"dp": -2}, r"parallel.dp=-2"),
    ({"pp": 1.5}, r"parallel.pp=1.5"),
    ({"dp": 2, "ep": 4}, r"parallel.ep=4 must divide parallel.dp=2"),
])
def test_bad_degrees(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        ParallelDims(**kwargs)


def test_world_size_mismatch_and_inference():
    assert ParallelDims.for_world(8, tp=2, pp=2).dp == 2
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp\*pp\*cp = 2\*2\*1 = 4"):
        ParallelDims.for_world(6, tp=2, pp=2)
    with pytest.raises(ValueError, match=r"= 8 does not equal the world size 4; launch 8 processes"):
        ParallelDims.for_world(4, tp=2, pp=2, dp=2)
    with pytest.raises(ValueError, match="not initialised but the mesh needs 4 ranks"):
        Mesh.build(ParallelDims(tp=4))


def test_bad_order_and_group_name():
    with pytest.raises(ValueError, match="must be a permutation of dp-pp-cp-tp"):
        coords_of(0, ParallelDims(), "dp-tp")
    with pytest.raises(ValueError, match="no group 'xx'"):
        Mesh.single().group("xx")


def _destroy_check():
    import os

    from torch.distributed import distributed_c10d as c10d

    def threads():
        return len(os.listdir("/proc/self/task"))

    before = (len(c10d._world.pg_map), threads())
    dims = ParallelDims(dp=2, pp=1, cp=1, tp=2)
    counts = []
    for i in range(3):
        mesh = Mesh.build(dims)
        built = len(c10d._world.pg_map)
        # work still queued on a group when the run ends: destroy() lets it finish, every rank gets the sum
        t = torch.full((1000,), float(dist.get_rank() + i), dtype=torch.float64)
        work = dist.all_reduce(t, group=mesh.dp_cp.pg, async_op=True)
        mesh.destroy()
        work.wait()
        counts.append((built, len(c10d._world.pg_map), threads(), float(t[0])))
        try:
            mesh.tp
        except RuntimeError as e:
            closed = str(e)
        assert mesh.world.size == 4  # the launcher's default group stays
    return before, counts, closed


def test_destroy_frees_the_groups_a_build_made_and_lets_queued_work_finish():
    """Mesh.destroy (called by Run.close at the end of every run) leaves the process with the groups and
    threads it had before the build; a run built again in the same process starts from there."""
    out = run_distributed(_destroy_check, 4, timeout=120)
    for rank, (before, counts, closed) in enumerate(out):
        for i, (built, after, threads, total) in enumerate(counts):
            assert built > before[0] and after == before[0], (rank, before, counts)
            dp = [r for r in range(4) if r % 2 == rank % 2]  # dp_cp of tp2 x dp2: ranks of the same tp index
            assert total == sum(r + i for r in dp)
        assert len({c[2] for c in counts}) == 1, f"threads grow with every build: {counts}"
        assert "destroyed by Mesh.destroy()" in closed
