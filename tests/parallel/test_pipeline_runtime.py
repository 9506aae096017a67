"""Pipeline runtime: loss and gradients equal single-process gradient accumulation (fp64, 1e-12),
p2p ledger bytes equal b*s*h per microbatch per boundary each way (x v interleaved), measured peak
of live activations equals the simulator's, and shape errors surface before any p2p traffic."""
import pytest
import torch
import torch.distributed as dist

from parallel.comm import Group, Ledger
from parallel.pipeline import build_schedule, peak_inflight
from parallel.pipeline.runtime import check_stage_shapes, run_schedule
from parallel.testing import DistributedError, run_distributed

S, B, H = 4, 2, 6  # per-microbatch activation (s, b, h)
LAYERS_PER_STAGE = 2


def _make_layers(n_layers):
    g = torch.Generator().manual_seed(1234)
    return [torch.nn.Linear(H, H, dtype=torch.float64) for _ in range(n_layers)], g


def _full_model(num_stages):
    layers, g = _make_layers(num_stages * LAYERS_PER_STAGE)
    with torch.no_grad():
        for lyr in layers:
            lyr.weight.copy_(torch.randn(H, H, generator=g, dtype=torch.float64) / H ** 0.5)
            lyr.bias.copy_(torch.randn(H, generator=g, dtype=torch.float64) * 0.1)
    return layers


def _data(m):
    g = torch.Generator().manual_seed(99)
    xs = [torch.randn(S, B, H, generator=g, dtype=torch.float64) for _ in range(m)]
    ys = [torch.randn(S, B, H, generator=g, dtype=torch.float64) for _ in range(m)]
    return xs, ys


def _stage_fn(layers):
    def run(x):
        for lyr in layers:
            x = torch.tanh(lyr(x))
        return x
    return run


def _reference(num_stages, m):
    layers = _full_model(num_stages)
    xs, ys = _data(m)
    losses = []
    for x, y in zip(xs, ys):
        out = _stage_fn(layers)(x)
        loss = ((out - y) ** 2).mean()
        losses.append(loss.item())
        (loss / m).backward()
    return losses, [[lyr.weight.grad.clone(), lyr.bias.grad.clone()] for lyr in layers]


def _pipeline_rank(name, pp, vp, m, early=False):
    rank = dist.get_rank()
    group = Group(axis="pp", ranks=list(range(pp)), rank=rank, pg=dist.group.WORLD, ledger=Ledger())
    sched = build_schedule(name, pp=pp, vp=vp, microbatches=m)
    layers = _full_model(pp * vp)
    my_stages = [s for s in range(pp * vp) if s % pp == rank]  # chunk c = my_stages[c]
    chunks = [layers[s * LAYERS_PER_STAGE:(s + 1) * LAYERS_PER_STAGE] for s in my_stages]
    xs, ys = _data(m)
    last = pp * vp - 1

    def forward_step(chunk, x, mb):
        stage = my_stages[chunk]
        if stage == 0:
            x = xs[mb]
        out = _stage_fn(chunks[chunk])(x)
        if stage == last:
            return ((out - ys[mb]) ** 2).mean()
        return out

    res = run_schedule(sched, rank=rank, pp_group=group, forward_step=forward_step, act_shape=(S, B, H),
                       dtype=torch.float64, early_recv=early)
    grads = {s: [[lyr.weight.grad, lyr.bias.grad] for lyr in layers[s * LAYERS_PER_STAGE:(s + 1) * LAYERS_PER_STAGE]]
             for s in my_stages}
    sent = group.ledger.total("sent_bytes", op="send")
    recv = group.ledger.total("recv_bytes", op="recv")
    return res.losses, grads, res.peak_live, sent, recv


def _run_all(pp):
    out = {}
    for name, vp in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):
        for m in (pp, 2 * pp):
            for early in (False, True):
                out[(name, vp, m, early)] = _pipeline_rank(name, pp, vp, m, early)
    return out


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_parity_ledger_and_peak(pp):
    """Every schedule with blocking and with early receives (p2p_plan): both equal the reference, and
    the early-receive run equals the blocking one bit for bit, with the same bytes and peak."""
    results = run_distributed(_run_all, pp, pp, timeout=240)
    for (name, vp, m, early), _ in results[0].items():
        if early:
            for rank in range(pp):
                a, b = results[rank][(name, vp, m, True)], results[rank][(name, vp, m, False)]
                assert a[0] == b[0] and a[2:] == b[2:], (name, vp, m, rank)
                for s in a[1]:
                    for ga, gb in zip(a[1][s], b[1][s]):
                        assert all(torch.equal(x, y) for x, y in zip(ga, gb)), (name, vp, m, rank, s)
        ref_losses, ref_grads = _reference(pp * vp, m)
        sched = build_schedule(name, pp=pp, vp=vp, microbatches=m)
        predicted_peak = peak_inflight(sched)
        elems = S * B * H * 8  # fp64 bytes of one activation
        for rank in range(pp):
            losses, grads, peak, sent, recv = results[rank][(name, vp, m, early)]
            if rank == (pp * vp - 1) % pp:
                assert losses == pytest.approx(ref_losses, abs=1e-12)
            for s, gl in grads.items():
                for (gw, gb), (rw, rb) in zip(gl, ref_grads[s * LAYERS_PER_STAGE:(s + 1) * LAYERS_PER_STAGE]):
                    torch.testing.assert_close(gw, rw, rtol=0, atol=1e-12)
                    torch.testing.assert_close(gb, rb, rtol=0, atol=1e-12)
            assert peak == predicted_peak[rank], (name, vp, m, rank)
            # Each virtual stage boundary carries one activation forward and one gradient back per
            # microbatch: a rank sends (and receives) once per boundary it touches, per microbatch.
            boundaries_out = sum(1 for s in range(pp * vp) if s % pp == rank and s < pp * vp - 1)  # act sends
            boundaries_in = sum(1 for s in range(pp * vp) if s % pp == rank and s > 0)  # grad sends
            assert sent == (boundaries_out + boundaries_in) * m * elems
            assert recv == (boundaries_out + boundaries_in) * m * elems
        total_sent = sum(results[r][(name, vp, m, early)][3] for r in range(pp))
        assert total_sent == 2 * (pp * vp - 1) * m * elems  # b*s*h each way per boundary, x v stages


def _mismatched_shapes():
    rank = dist.get_rank()
    group = Group(axis="pp", ranks=[0, 1], rank=rank, pg=dist.group.WORLD, ledger=Ledger())
    try:
        check_stage_shapes(group, in_shape=None if rank == 0 else (4, 2, 8), out_shape=(4, 2, 6))
    except ValueError as e:
        return str(e), group.ledger.count(op="send")
    return None, 0


def test_stage_shape_mismatch_is_caught_before_p2p():
    for msg, sends in run_distributed(_mismatched_shapes, 2):
        assert "rank 0 sends (4, 2, 6) per microbatch but rank 1 expects (4, 2, 8)" in msg
        assert sends == 0


def test_schedule_group_mismatch():
    sched = build_schedule("1f1b", pp=2, vp=1, microbatches=2)
    with pytest.raises(ValueError, match="schedule is for pp=2 but the pipeline group has 1 ranks"):
        run_schedule(sched, rank=0, pp_group=Group.trivial("pp"), forward_step=None, act_shape=(1,),
                     dtype=torch.float32)
    with pytest.raises(ValueError, match="microbatches=1 is smaller than pp=2"):
        build_schedule("1f1b", pp=2, vp=1, microbatches=1)
    assert DistributedError  # harness exported
