"""FP8 tensor-parallel linears (parallel/tensor_parallel/fp8.py) on 2 gloo ranks against the same FP8
recipe at TP=1.

Per-tensor recipes (tensorwise, delayed): the column-parallel output and weight gradient equal TP=1's
bit for bit (the sharded weight's and gradient's amaxes are all-reduced, so the scales are the
unsharded tensors'); the input gradient and the row-parallel results differ only by the fp32
summation order of the TP all-reduce (within 1e-6 relative). Row and block recipes scale local rows
and tiles, which TP changes: there TP=2 must be as accurate as TP=1, its error in norm against the
exact fp64 result at most 1.25x TP=1's + 0.02. (Through the ReLU of this two-layer MLP the gradients
carry two e5m2 roundings and the mask flips: about 17-19% error in norm at TP=1 for every recipe.)
The amax all-reduces show in the ledger: 4 bytes each, one per sharded operand and call; with SP the
column input's rides in the weight's (8 bytes). With SP the per-tensor recipes all-gather the column
input and the row output gradient as fp8 (1 byte per element: a quarter of this fp32 test's gathers,
half of bf16's) and are still bit for bit TP=1's.
"""
from __future__ import annotations

import pytest
import torch

from engine.ops.fp8_linear import RECIPES, REQUANTISED
from parallel.testing import run_distributed

S, B, H, F = 16, 2, 64, 96   # (s, b, h); F: the ffn width (col out, row in)


def _data():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(S, B, H, generator=g), torch.randn(F, H, generator=g) * 0.05,
            torch.randn(H, F, generator=g) * 0.05, torch.randn(S, B, H, generator=g) * 1e-2)


def _pair(tp, recipe, w1, w2, sp):
    from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from parallel.tensor_parallel.fp8 import apply_fp8

    m = torch.nn.ModuleDict({
        "fc1": ColumnParallelLinear(H, F, tp_group=tp, bias=False, sequence_parallel=sp,
                                    init_method=lambda t: t.copy_(w1)),
        "fc2": RowParallelLinear(F, H, tp_group=tp, bias=False, sequence_parallel=sp,
                                 init_method=lambda t: t.copy_(w2))})
    assert apply_fp8(m, recipe) == ["fc1", "fc2"]
    return m


def _steps(m, tp, x, dy, recipe):
    """Two forward/backward steps (delayed: an update between them); returns step 2's tensors."""
    from parallel.tensor_parallel.fp8 import update_fp8

    for step in range(2):
        xi = x.clone().requires_grad_()
        for p in m.parameters():
            p.grad = None
        h = m["fc1"](xi)
        y = m["fc2"](torch.relu(h))
        (y * dy).sum().backward()
        update_fp8(m, [tp])
    return h.detach(), y.detach(), xi.grad, m["fc1"].weight.grad, m["fc2"].weight.grad


def _exact(x, w1, w2, dy):
    """The same two steps' step-2 tensors in fp64 without FP8: h, y, dx, dw1, dw2."""
    xi, a, b = x.double().requires_grad_(), w1.double().requires_grad_(), w2.double().requires_grad_()
    h = xi @ a.t()
    y = torch.relu(h) @ b.t()
    (y * dy.double()).sum().backward()
    return h.detach(), y.detach(), xi.grad, a.grad, b.grad


def _worker():
    import torch.distributed as dist

    from parallel.comm import Group
    from parallel.mesh import Mesh, ParallelDims

    mesh = Mesh.build(ParallelDims.for_world(dist.get_world_size(), tp=2))
    tp, r = mesh.tp, mesh.tp.rank
    x, w1, w2, dy = _data()
    out = {}
    for recipe in RECIPES:
        for sp in (False, True):
            one = Group.trivial("tp")
            ref = _steps(_pair(one, recipe, w1, w2, False), one, x, dy, recipe)
            chunk = slice(r * S // 2, (r + 1) * S // 2) if sp else slice(None)
            m = _pair(tp, recipe, w1, w2, sp)
            with tp.ledger.capture() as led:
                got = _steps(m, tp, x[chunk], dy[chunk], recipe)
            h, y, gx, g1, g2 = got
            hr, yr, gxr, g1r, g2r = ref

            cols = slice(r * F // 2, (r + 1) * F // 2)
            eh, ey, egx, eg1, eg2 = _exact(x, w1, w2, dy)
            exact = [eh[..., cols], eg1[cols], ey[chunk], egx[chunk], eg2[:, cols]]
            pairs = {"col_out": (h, hr[..., cols]), "col_wgrad": (g1, g1r[cols]), "row_out": (y, yr[chunk]),
                     "input_grad": (gx, gxr[chunk]), "row_wgrad": (g2, g2r[:, cols])}
            out[(recipe, sp)] = {
                "col_out_equal": torch.equal(h, hr[..., cols]),
                "col_wgrad_equal": torch.equal(g1, g1r[cols]),
                "rel": {k: ((a - b).abs().max() / b.abs().max()).item() for k, (a, b) in pairs.items()},
                # error in norm against the exact fp64 result: TP=2 vs TP=1
                "vs_exact": {k: (((a.double() - e).norm() / e.norm()).item(), ((b.double() - e).norm() / e.norm()).item())
                             for (k, (a, b)), e in zip(pairs.items(), exact)},
                "amax_reduces": [(rec.op, rec.payload_bytes) for rec in led.records
                                 if rec.op == "all_reduce" and rec.payload_bytes < 100],
                "gathers": [(rec.payload_bytes, rec.dtype) for rec in led.records if rec.op == "all_gather"],
                "delayed_steps": [int(s.steps) for s in (getattr(m["fc1"], "fp8_scaling", None),) if s is not None],
            }
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=240)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("sp", [False, True])
def test_tp2_equals_tp1(results, recipe, sp):
    for res in results:
        r = res[(recipe, sp)]
        if recipe in ("tensorwise", "delayed"):
            assert r["col_out_equal"] and r["col_wgrad_equal"], r["rel"]
            for k in ("input_grad", "row_out", "row_wgrad"):
                assert r["rel"][k] < 1e-6, (k, r["rel"])
        else:
            for k, (err_tp2, err_tp1) in r["vs_exact"].items():
                assert err_tp2 <= 1.25 * err_tp1 + 0.02, (k, r["vs_exact"])


@pytest.mark.parametrize("sp", [False, True])
def test_amax_all_reduces_in_the_ledger(results, sp):
    for res in results:
        # tensorwise, per step: fc1 reduces its weight (fwd) and grad_output (bwd) amaxes, fc2 its
        # input and weight (fwd): 4 all-reduces of one fp32 (4 bytes), 2 steps. With SP the
        # sequence-sharded operands are cast before their fp8 gathers, with the whole tensor's scale:
        # fc1's input rides in the weight's reduce (8 bytes), fc2's output gradient takes one (4 bytes).
        step = [("all_reduce", 8)] + [("all_reduce", 4)] * 4 if sp else [("all_reduce", 4)] * 4
        assert res[("tensorwise", sp)]["amax_reduces"] == step * 2
        # delayed: step 1 scales like tensorwise (empty history); each step's update is ONE stacked
        # reduce of 2 linears x 3 operands x 4 bytes; step 2 reduces nothing per call.
        assert res[("delayed", sp)]["amax_reduces"] == step + [("all_reduce", 24)] * 2
        assert res[("delayed", sp)]["delayed_steps"] == [2]
        for local in ("rowwise", "blockwise", "mxfp8"):  # row, tile and block scales are local: nothing reduced
            assert res[(local, sp)]["amax_reduces"] == [], local


def test_sequence_parallel_input_gathered_in_fp8(results):
    """SP: per step, fc1's input (forward) and fc2's output gradient (backward), S/2 x B x H per rank, are
    all-gathered. Per-tensor recipes gather both as fp8 bytes: a quarter of the fp32 gathers; row and
    block recipes keep their operands in high precision for the backward and gather them so."""
    shard = S // 2 * B * H
    for res in results:
        for recipe in RECIPES:
            want = (shard, "torch.uint8") if recipe in ("tensorwise", "delayed") else (shard * 4, "torch.float32")
            assert res[(recipe, True)]["gathers"] == [want] * 4, (recipe, res[(recipe, True)]["gathers"])


# -- FP8 ring collective matmuls (parallel.tp_overlap = "ring" with model.fp8) ----------------------
# Against the non-ring FP8 path at TP=2 and TP=4 with sequence parallelism, two steps (delayed: an
# update between them). F = 128 so that TP=4's local widths stay multiples of 16.
RF = 128


def _ring_pair(tp, recipe, w1, w2, ring):
    from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from parallel.tensor_parallel.fp8 import apply_fp8
    from parallel.tensor_parallel.overlap import RingLinearImpl

    impl = RingLinearImpl() if ring else None
    m = torch.nn.ModuleDict({
        "fc1": ColumnParallelLinear(H, RF, tp_group=tp, bias=True, sequence_parallel=True, impl=impl,
                                    init_method=lambda t: t.copy_(w1)),
        "fc2": RowParallelLinear(RF, H, tp_group=tp, bias=False, sequence_parallel=True, impl=impl,
                                 init_method=lambda t: t.copy_(w2))})
    with torch.no_grad():
        m["fc1"].bias.copy_(torch.linspace(-0.1, 0.1, RF).chunk(tp.size)[tp.rank])
    apply_fp8(m, recipe)
    assert m["fc1"].impl.ring == ring and m["fc2"].impl.ring == ring
    return m


def _ring_worker():
    import torch.distributed as dist

    from parallel.mesh import Mesh, ParallelDims

    g = torch.Generator().manual_seed(11)
    x, dy = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g) * 1e-2
    w1, w2 = torch.randn(RF, H, generator=g) * 0.05, torch.randn(H, RF, generator=g) * 0.05
    out = {}
    for tp_size in (2, 4):
        mesh = Mesh.build(ParallelDims.for_world(dist.get_world_size(), tp=tp_size))
        tp, r = mesh.tp, mesh.tp.rank
        chunk = slice(r * S // tp_size, (r + 1) * S // tp_size)
        for recipe in RECIPES:
            got, leds, states = {}, {}, {}
            for ring in (False, True):
                m = _ring_pair(tp, recipe, w1, w2, ring)
                with tp.ledger.capture() as led:
                    h, y, gx, g1, g2 = _steps(m, tp, x[chunk], dy[chunk], recipe)
                got[ring] = {"h": h, "y": y, "dx": gx, "dw1": g1, "db1": m["fc1"].bias.grad, "dw2": g2}
                leds[ring] = led
                states[ring] = {k: v.clone() for k, v in m.state_dict().items() if "fp8_scaling" in k}
            plain, ring = got[False], got[True]

            def sent(led, amax):  # tp bytes sent: the amax all-reduces (< 100 bytes) or everything else
                return sum(rec.sent_bytes for rec in led.records if (rec.payload_bytes < 100) == amax)
            out[(tp_size, recipe)] = {
                "equal": sorted(k for k in plain if torch.equal(plain[k], ring[k])),
                "rel": {k: ((ring[k] - plain[k]).abs().max() / plain[k].abs().max()).item() for k in plain},
                "bytes": (sent(leds[False], False), sent(leds[True], False)),
                "ops": [sorted({rec.op for rec in led.records if rec.payload_bytes >= 100})
                        for led in (leds[False], leds[True])],
                "amax_bytes": (sent(leds[False], True), sent(leds[True], True)),
                "amax_calls": [sum(rec.op == "all_reduce" for rec in led.records) for led in (leds[False], leds[True])],
                "state_equal": sorted(states[True]) == sorted(states[False]) and all(
                    torch.equal(states[True][k], states[False][k]) for k in states[False]),
                "state_keys": len(states[False]),
            }
            if tp_size == 2:  # the ring with each weight cast once per step: 2 micro-batches per step
                runs = {}
                for casts in (False, True):
                    with tp.ledger.capture() as led:
                        runs[casts] = _steps_casts(_ring_pair(tp, recipe, w1, w2, True), tp, x[chunk], dy[chunk],
                                                   casts)
                    runs[casts] += ([(rec.op, rec.payload_bytes) for rec in led.records if rec.payload_bytes < 100],)
                out[("casts", recipe)] = {
                    "equal": all(torch.equal(a, b) for a, b in zip(runs[False][0], runs[True][0])),
                    "amax": (runs[False][2], runs[True][2]), "made": runs[True][1]}
    return out


def _steps_casts(m, tp, x, dy, casts):
    """Two steps of two micro-batches (the second: x and dy reversed along the sequence) inside
    fp8_weight_casts or not (delayed: an update between the steps); returns every output and gradient,
    and the casts made."""
    from parallel.tensor_parallel.fp8 import fp8_weight_casts, update_fp8

    tensors, made = [], 0
    for step in range(2):
        for p in m.parameters():
            p.grad = None
        with fp8_weight_casts(m, casts) as caches:
            for xs, dys in ((x, dy), (x.flip(0), dy.flip(0))):
                xi = xs.clone().requires_grad_()
                y = m["fc2"](torch.relu(m["fc1"](xi)))
                (y * dys).sum().backward()
                tensors += [y.detach(), xi.grad]
        made += sum(c.made for c in caches)
        tensors += [p.grad.clone() for p in m.parameters()]
        update_fp8(m, [tp])
    return tensors, made


@pytest.fixture(scope="module")
def ring_results():
    return run_distributed(_ring_worker, 4, timeout=300)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_ring_equals_fp8_plain(ring_results, tp, recipe):
    """The column output and both weight gradients are bit for bit the non-ring FP8 path's (the same
    quantised values and scales; per-chunk GEMMs give the whole GEMM's rows; the weight gradients are
    one GEMM over the assembled operands). The reduce-scatter sums (row output, input gradient) are too
    at TP=2 (two terms) and within 1e-6 relative at TP=4 (another order)."""
    for res in ring_results:
        r = res[(tp, recipe)]
        if tp == 2:
            assert r["equal"] == ["db1", "dw1", "dw2", "dx", "h", "y"], r["rel"]
        else:
            assert {"db1", "dw1", "dw2", "h"} <= set(r["equal"]), r["rel"]
            assert max(r["rel"].values()) < 1e-6, r["rel"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_ring_bytes_and_delayed_state(ring_results, tp, recipe):
    """Bytes equal the non-ring FP8 path's exactly, the amax all-reduces included: the rings move the
    all-gathers' (fp8 for the per-tensor recipes, both paths casting the shard before they gather it)
    and the reduce-scatters' bytes, and both paths reduce the same amaxes in the same calls. The
    delayed recipe's state is identical."""
    for res in ring_results:
        r = res[(tp, recipe)]
        assert r["bytes"][1] == r["bytes"][0] > 0
        assert r["ops"] == [["all_gather", "reduce_scatter"], ["recv", "send"]]  # the ring ran, as p2p
        assert r["amax_bytes"][1] == r["amax_bytes"][0]
        assert r["amax_calls"][1] == r["amax_calls"][0]
        assert r["state_equal"] and r["state_keys"] == (6 if recipe == "delayed" else 0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_ring_with_weight_casts_reused(ring_results, recipe):
    """TP=2 ring, two micro-batches per step, each weight cast once per step (fp8_weight_casts): bitwise
    the same outputs and gradients. Per-tensor current scaling saves, per step, the second micro-batch's
    weight amaxes: the column ring's stacked all-reduce carries x's amax alone (4 bytes, not 8) and the
    row ring's weight all-reduce is not made."""
    for res in ring_results:
        r = res[("casts", recipe)]
        assert r["equal"]
        assert r["made"] == 2 * (4 if recipe in REQUANTISED else 2)  # per step, fc1's and fc2's (row/MX: and W^T's)
        plain, reused = r["amax"]
        if recipe == "tensorwise":
            assert len(plain) - len(reused) == 2  # one row weight call per step
            assert sum(b for _, b in plain) - sum(b for _, b in reused) == 2 * 8
        elif recipe == "delayed":  # step 1 scales currently (empty history), step 2 from the history
            assert len(plain) - len(reused) == 1 and sum(b for _, b in plain) - sum(b for _, b in reused) == 8
        else:
            assert plain == reused == []
