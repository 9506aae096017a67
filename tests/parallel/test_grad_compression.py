"""PowerSGD and 1-bit gradient compression (parallel/data_parallel/compression.py).

* PowerSGD's dp bytes per step equal, exactly (ledger), the ring all-reduce of r * (m + n) fp32 elements per
  matrix plus the 1-D gradients uncompressed; 1-bit's equal the all-gather of n_pad / 8 bytes of signs and
  one fp32 scale per 1024 elements per bucket.
* PowerSGD is exact when the summed gradient has rank <= r: dp2 ranks holding multiples of one rank-1
  matrix decode the true sum (fp32, 1e-5 relative); 1-D gradients are summed exactly.
* PowerSGD's start_step: the first steps are the exact sum at DDP's bytes with no error feedback, then it
  compresses; the step counters survive state_dict/load_state.
* A matrix PowerSGD would not shrink (r (m + n) >= m n, e.g. a side below r) is summed exactly and
  uncompressed, beside compressed ones; a rank that compresses no matrix anywhere is refused before any
  communication, with the largest rank that would.
* Sign packing round-trips.
Resume of both is in tests/parallel/test_outer.py (test_resume_is_bitwise[powersgd|onebit]).
"""
from __future__ import annotations

import pytest
import torch

from tests.parallel.test_outer import _cfg, _train, dp2_results


def _two_ranks(axis: str, ledger=None):
    """The 2-rank launch's world as a Group on ``axis`` (a fresh ledger unless given)."""
    import torch.distributed as dist

    from parallel.comm import Group, Ledger

    return Group(axis=axis, ranks=range(2), rank=dist.get_rank(), pg=dist.group.WORLD,
                 ledger=ledger if ledger is not None else Ledger())


def _compressed():
    out = {}
    for name, extra in (("powersgd", ["optim.grad_compression=powersgd", "optim.powersgd_rank=2"]),
                        ("onebit", ["optim.grad_compression=onebit"])):
        run, losses, sent = _train(_cfg(steps=2, extra=extra), 2)
        ddp = run.trainer.ddp
        comp = ddp.grad_compressor
        shapes = [(tuple(p.shape)) for _, b in ddp.buckets() for p in b.params]
        numels = [b.numel for _, b in ddp.buckets()]
        out[name] = {"sent": sent, "shapes": shapes, "numels": numels, "losses": losses,
                     "counted": comp.bytes_per_step() if name == "powersgd" else comp.bytes_per_step(numels)}
    return out


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return dp2_results(tmp_path_factory)  # the 2-rank launch shared with tests/parallel/test_outer.py


def test_compressed_dp_bytes_are_exact(dp2):
    r = dp2[0]["compressed"]
    from parallel.data_parallel.compression import powersgd_compresses

    p, rank = 2, 2
    ps = r["powersgd"]
    mats = sum(rank * (s[0] + s[1]) for s in ps["shapes"] if len(s) == 2 and powersgd_compresses(rank, *s))
    raw = sum(torch.Size(s).numel() for s in ps["shapes"] if len(s) != 2 or not powersgd_compresses(rank, *s))
    assert mats > 0 and raw > 0
    expected = 2 * (p - 1) / p * 4 * (mats + raw)  # ring all-reduces of P (+ uncompressed) and Q, fp32
    assert ps["sent"] == [expected, expected], (ps["sent"], expected)
    assert ps["counted"] == {"matrices": mats, "uncompressed": raw}
    full = 2 * (p - 1) / p * 4 * sum(ps["numels"])
    assert expected < full / 5  # what it saves here against DDP's per-step volume
    ob = r["onebit"]
    pad = [-(-n // 1024) * 1024 for n in ob["numels"]]
    expected = sum((p - 1) * (n // 8 + 4 * n // 1024) for n in pad)  # all-gathers of packed signs + scales
    assert ob["sent"] == [expected, expected] and ob["counted"] == expected


def _exact_rank1():
    """Each rank's gradient of a 4 x 3 matrix is rank-1 and the SAME direction pattern across ranks up to
    scale, so the sum is rank-1 and PowerSGD at r=1 recovers it exactly; a 1-D gradient is summed exactly."""
    import torch.distributed as dist

    from parallel.data_parallel import DataParallel
    from parallel.data_parallel.compression import PowerSGD

    group = _two_ranks("dp")
    model = torch.nn.Linear(3, 4)
    comp = PowerSGD(rank=1, dp_group=group, seed=0)
    ddp = DataParallel(model, dp_group=group, grad_compressor=comp, grad_reduce="sum")
    u, v = torch.tensor([1.0, -2.0, 0.5, 3.0]), torch.tensor([0.25, 1.0, -1.0])
    scale = float(dist.get_rank() + 1)
    model.weight.grad = None
    loss = (model.weight * (scale * torch.outer(u, v))).sum() + (model.bias * scale).sum()
    loss.backward()
    ddp.finish_grad_sync()
    return {"w": model.weight.main_grad.clone(), "b": model.bias.main_grad.clone(),
            "want_w": 3.0 * torch.outer(u, v), "want_b": torch.full((4,), 3.0)}


def _warmup():
    """PowerSGD(start_step=2) on full-rank, rank-dependent gradients: steps 1-2 are the exact sum with the
    all-reduce's bytes and no error feedback; step 3 is compressed (rank 1: inexact, r (m + n) + bias bytes);
    the step counters survive state_dict/load_state, so a resumed compressor compresses at once."""
    import torch.distributed as dist

    from parallel.comm import Ledger
    from parallel.data_parallel import DataParallel
    from parallel.data_parallel.compression import PowerSGD

    ledger = Ledger()
    group = _two_ranks("dp", ledger)
    model = torch.nn.Linear(3, 4)
    comp = PowerSGD(rank=1, dp_group=group, seed=0, start_step=2)
    ddp = DataParallel(model, dp_group=group, grad_compressor=comp, grad_reduce="sum")
    gen = torch.Generator().manual_seed(7)
    out = []
    for step in range(3):
        gs = [torch.randn(4, 3, generator=gen) for _ in range(2)]  # (4, 3) full rank, one per dp rank
        bs = [torch.randn(4, generator=gen) for _ in range(2)]  # (4,)
        ddp.zero_grad_buffer()
        loss = (model.weight * gs[dist.get_rank()]).sum() + (model.bias * bs[dist.get_rank()]).sum()
        with ledger.capture() as cap:
            loss.backward()
            ddp.finish_grad_sync()
        sent = sum(r.sent_bytes for r in cap.records if r.axis == "dp")
        out.append({"w": model.weight.main_grad.clone(), "want_w": gs[0] + gs[1], "b": model.bias.main_grad.clone(),
                    "want_b": bs[0] + bs[1], "sent": sent, "err": float(comp.error["weight"].abs().max())})
    fresh = PowerSGD(rank=1, dp_group=group, seed=0, start_step=2)
    DataParallel(torch.nn.Linear(3, 4), dp_group=group, grad_compressor=fresh, grad_reduce="sum")
    fresh.load_state(comp.state_dict(), {k: v.clone() for k, v in comp.state_tensors().items()})
    return {"steps": out, "resumed_steps": fresh.steps, "steps_done": comp.steps}


def test_powersgd_start_step_runs_plain_all_reduce_first(dp2):
    p = 2
    for r in (out["warmup"] for out in dp2):
        plain, compressed = r["steps"][:2], r["steps"][2]
        for s in plain:  # warm-up: the exact sum, the full all-reduce's bytes, the error feedback untouched
            assert torch.allclose(s["w"], s["want_w"], rtol=1e-6, atol=1e-6) and torch.allclose(s["b"], s["want_b"])
            assert s["sent"] == 2 * (p - 1) / p * 4 * (12 + 4) and s["err"] == 0.0, s
        assert compressed["sent"] == 2 * (p - 1) / p * 4 * (1 * (4 + 3) + 4), compressed["sent"]
        assert not torch.allclose(compressed["w"], compressed["want_w"], atol=1e-3)  # rank 1 of a rank-3 sum
        assert torch.allclose(compressed["b"], compressed["want_b"]) and compressed["err"] > 0.0
        assert r["resumed_steps"] == r["steps_done"] and list(r["steps_done"].values()) == [3]


def _small_matrix_whole():
    """Rank 2 over a (16, 16) and a (2, 16) matrix: 2 (2 + 16) = 36 >= 32, so the small one is summed
    exactly (no error feedback, no Q) in the call that carries the P s; the large one is compressed."""
    import torch.distributed as dist

    from parallel.comm import Ledger
    from parallel.data_parallel import DataParallel
    from parallel.data_parallel.compression import PowerSGD

    ledger = Ledger()
    group = _two_ranks("dp", ledger)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(16, 2, bias=False))
    comp = PowerSGD(rank=2, dp_group=group, seed=0)
    ddp = DataParallel(model, dp_group=group, grad_compressor=comp, grad_reduce="sum")
    gen = torch.Generator().manual_seed(3)
    big = [torch.randn(16, 16, generator=gen) for _ in range(2)]  # full rank, one per dp rank
    small = [torch.randn(2, 16, generator=gen) for _ in range(2)]
    me = dist.get_rank()
    loss = (model[0].weight * big[me]).sum() + (model[1].weight * small[me]).sum()
    with ledger.capture() as cap:
        loss.backward()
        ddp.finish_grad_sync()
    return {"small": model[1].weight.main_grad.clone(), "want_small": small[0] + small[1],
            "big": model[0].weight.main_grad.clone(), "want_big": big[0] + big[1],
            "sent": sum(r.sent_bytes for r in cap.records if r.axis == "dp"), "error": sorted(comp.error),
            "counted": comp.bytes_per_step(), "whole": comp.uncompressed_matrices()}


def test_powersgd_sends_a_matrix_it_would_not_shrink_whole(dp2):
    p = 2
    for r in (out["small_whole"] for out in dp2):
        assert torch.equal(r["small"], r["want_small"])  # the exact sum: it went uncompressed
        assert not torch.allclose(r["big"], r["want_big"], atol=1e-3)  # rank 2 of a full-rank sum
        assert r["error"] == ["0.weight"] and r["whole"] == ["1.weight"]
        assert r["counted"] == {"matrices": 2 * (16 + 16), "uncompressed": 2 * 16}
        # P (16 x 2) with the small matrix (32) in one all-reduce, then Q (16 x 2); ring model, fp32
        assert r["sent"] == 2 * (p - 1) / p * 4 * (2 * 16 + 32 + 2 * 16), r["sent"]


def test_powersgd_is_exact_on_a_rank1_sum(dp2):
    for r in (out["exact_rank1"] for out in dp2):
        assert torch.allclose(r["w"], r["want_w"], rtol=1e-5, atol=1e-6), (r["w"], r["want_w"])
        assert torch.equal(r["b"], r["want_b"])


def test_sign_packing_round_trips():
    from parallel.data_parallel.compression import pack_signs, unpack_signs

    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 8
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))


def _rank_check():
    """Ranks holding different matrices (as pipeline stages do): rank 0 a 8 x 3 (compressed up to rank 2),
    rank 1 a 16 x 16 (up to rank 7). Rank 7 passes (rank 0's matrix then goes uncompressed); rank 8 makes
    both raise the same error, naming the largest rank that compresses a matrix anywhere (7), marked to be
    said once."""
    import torch.distributed as dist

    from parallel.data_parallel.compression import check_powersgd_rank

    world = _two_ranks("world")
    model = torch.nn.Linear(3, 8) if dist.get_rank() == 0 else torch.nn.Linear(16, 16)
    check_powersgd_rank([model], 7, world, device="cpu")  # compresses rank 1's matrix: nothing raised
    try:
        check_powersgd_rank([model], 8, world, device="cpu")
    except ValueError as e:
        return {"message": str(e), "once": getattr(e, "on_every_rank", False)}
    return {"message": None, "once": False}


def test_powersgd_rank_check_agrees_across_ranks(dp2):
    got = [r["rank_check"] for r in dp2]
    assert got[0] == got[1] and got[0]["once"], got
    assert "optim.powersgd_rank=8 exceeds" in got[0]["message"] and "set optim.powersgd_rank <= 7" in got[0]["message"]


def test_powersgd_rank_above_a_matrix_is_refused():
    from parallel.comm import Group
    from parallel.data_parallel import DataParallel
    from parallel.data_parallel.compression import PowerSGD

    group = Group.trivial("dp")
    with pytest.raises(ValueError, match=r"optim.powersgd_rank=3 compresses none .* set optim.powersgd_rank <= 2"):
        DataParallel(torch.nn.Linear(3, 8), dp_group=group, grad_compressor=PowerSGD(rank=3, dp_group=group))
    with pytest.raises(ValueError, match="no rank compresses them; use optim.grad_compression=onebit or none"):
        DataParallel(torch.nn.Linear(1, 4), dp_group=group, grad_compressor=PowerSGD(rank=1, dp_group=group))
    # checked=True (engine.assembly checked the whole layout): a stage with only small matrices sends them whole
    DataParallel(torch.nn.Linear(3, 8), dp_group=group, grad_compressor=PowerSGD(rank=3, dp_group=group, checked=True))
    with pytest.raises(ValueError, match="zero_stage=0"):
        DataParallel(torch.nn.Linear(3, 8), dp_group=group, zero_stage=1,
                     grad_compressor=PowerSGD(rank=1, dp_group=group))


@pytest.mark.parametrize("method", ["powersgd", "onebit"])
def test_a_nonfinite_step_leaves_the_error_feedback_as_it_was(method):
    """One non-finite gradient reaches the optimizer as non-finite (it skips the step), and the compressor's
    error feedback and warm start stay as they were, so the next steps reduce finite gradients again."""
    from parallel.comm import Group
    from parallel.data_parallel.compression import OneBit, PowerSGD
    from parallel.data_parallel.ddp import DataParallel

    torch.manual_seed(0)
    comp = PowerSGD(rank=2, dp_group=Group.trivial("dp")) if method == "powersgd" else OneBit(dp_group=Group.trivial("dp"))
    model = torch.nn.Linear(8, 8)
    ddp = DataParallel(model, dp_group=Group.trivial("dp"), grad_compressor=comp)
    finite = []
    for step in range(3):
        ddp.zero_grad_buffer()
        loss = model(torch.randn(4, 8)).square().sum()
        before = {k: v.clone() for k, v in comp.state_tensors().items()}
        (loss * float("nan") if step == 1 else loss).backward()
        ddp.finish_grad_sync()
        finite.append(bool(torch.isfinite(model.weight.main_grad).all()))
        if step == 1:
            assert all(torch.equal(before[k], v) for k, v in comp.state_tensors().items())
    assert finite == [True, False, True]


def test_powersgd_counters_reach_buckets_rank_0_does_not_hold():
    """The saved JSON state is rank 0's: on a pipeline stage with more buckets, a resume gives every bucket the
    saved count (each bucket reduces once per step), not 0 to the ones rank 0 lacks (they would redo the
    uncompressed warm-up)."""
    from parallel.comm import Group
    from parallel.data_parallel.compression import PowerSGD

    c = PowerSGD(rank=2, dp_group=Group.trivial("dp"), start_step=4)
    c._layout = {(0, 0): [], (0, 1): [], (0, 2): []}  # this stage's three buckets (attach sets them)
    c.load_state({"method": "powersgd", "steps": [[0, 0, 6], [0, 1, 6]]}, None)  # rank 0 had two
    assert c.steps == {(0, 0): 6, (0, 1): 6, (0, 2): 6}
