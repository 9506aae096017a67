"""Pipeline schedules as data: every built schedule passes the validator over the grid; each
hand-broken schedule is rejected with its own message; simulated bubble, latency cost and in-flight
peaks equal their formulas exactly (docs/pipeline.md); the CLI agrees with the library."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from parallel.pipeline import (ACTIVATION, BACKWARD, FORWARD, GRADIENT, RECV, SEND, Action, P2P, ScheduleError,
                               build_schedule, gpipe, interleaved_1f1b, one_f_one_b, peak_inflight,
                               simulate, validate)
from parallel.pipeline.schedules import attach_messages, interleaved_table

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "pipeline_schedule.py"
GRID_P = (2, 3, 4, 8)
GRID_V = (1, 2, 3)


def _grid():
    """Every (name, p, v, m) of the grid: p in GRID_P, v in GRID_V, m in [p, 4p] where accepted."""
    for p in GRID_P:
        for m in range(p, 4 * p + 1):
            yield "gpipe", p, 1, m
            yield "1f1b", p, 1, m
            for v in GRID_V:
                if m % p == 0:   # Megatron's rule with the default group size N = p
                    yield "interleaved", p, v, m


def _analytic(p, v, m):
    return (p - 1) / (v * m)


# ----------------------------------------------------------------------------- validity


@pytest.mark.parametrize("p", GRID_P)
def test_validator_accepts_every_schedule_of_the_grid(p):
    count = 0
    for name, pp, v, m in _grid():
        if pp == p:
            validate(build_schedule(name, pp=pp, vp=v, microbatches=m))
            count += 1
    assert count == 2 * (3 * p + 1) + 4 * 3  # gpipe and 1f1b for 3p + 1 m; 4 multiples of p x 3 v
    # pp = 1 and non-default interleaved group sizes (Megatron's remainder rule) are valid too.
    validate(one_f_one_b(1, 3))
    validate(interleaved_1f1b(1, 3, 2))
    for m, n in ((9, 5), (7, 7), (11, 7)):
        validate(interleaved_1f1b(4, 2, m, group_size=n))


def test_action_format_and_messages():
    s = one_f_one_b(2, 3)
    rank1 = {str(a): a for a in s.ranks[1]}
    f = rank1["F1.2"]
    assert str(f) == "F1.2" and f.key == ("F", 1, 2)
    assert f.recvs == (P2P(RECV, ACTIVATION, 0, 2, 0),) and f.sends == ()
    assert str(f.recvs[0]) == "recv act0.2<-r0" and f.recvs[0].consumer_stage == 1
    b = rank1["B1.0"]
    assert b.sends == (P2P(SEND, GRADIENT, 1, 0, 0),) and str(b.sends[0]) == "send grad1.0->r0"
    assert b.describe() == "B1.0 [send grad1.0->r0]"
    assert [str(a) for a in s.ranks[0]] == ["F0.0", "F0.1", "B0.0", "F0.2", "B0.1", "B0.2"]
    assert [str(a) for a in s.ranks[1]] == ["F1.0", "B1.0", "F1.1", "B1.1", "F1.2", "B1.2"]
    with pytest.raises(AttributeError):
        f.stage = 3   # frozen
    # Interleaved placement: stage s on rank s % p as chunk s // p; Megatron's forward order.
    s = interleaved_1f1b(2, 2, 4)
    assert s.rank_of(3) == 1 and s.chunk_of(3) == 1 and s.num_stages == 4
    assert [str(a) for a in s.ranks[0][:6]] == ["F0.0", "F0.1", "F2.0", "F2.1", "F0.2", "B2.0"]
    assert interleaved_table(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1),
                                          (3, 0), (4, 0), (3, 1), (4, 1)]


def test_every_activation_is_sent_right_after_it_is_produced():
    """The runtime frees a sent activation once that batch completes: sends never lag."""
    for name, p, v, m in (("1f1b", 4, 1, 8), ("gpipe", 3, 1, 4), ("interleaved", 4, 3, 8)):
        s = build_schedule(name, pp=p, vp=v, microbatches=m)
        for actions in s.ranks:
            for a in actions:
                for msg in a.sends:
                    assert (msg.stage, msg.microbatch) == (a.stage, a.microbatch)


def test_custom_order_consuming_out_of_send_order_receives_in_send_order():
    """Rank 1 consumes microbatch 1 first, but rank 0 sends microbatch 0 first: both arrive before
    F1.1 (messages pair first-in first-out), and the schedule is valid."""
    order = [[("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)],
             [("F", 1, 1), ("F", 1, 0), ("B", 1, 1), ("B", 1, 0)]]
    s = attach_messages("custom", order, pp=2, vp=1, microbatches=2)
    validate(s)
    assert s.ranks[1][0].describe() == "[recv act0.0<-r0, recv act0.1<-r0] F1.1"
    assert s.ranks[1][1].recvs == ()


# ----------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize("call, match", [
    (lambda: gpipe(4, 3), r"microbatches=3 is smaller than pp=4.*>= 4"),
    (lambda: one_f_one_b(2, 1), r"microbatches=1 is smaller than pp=2"),
    (lambda: interleaved_1f1b(4, 2, 2), r"microbatches=2 is smaller than pp=4"),
    (lambda: one_f_one_b(0, 3), r"pp must be >= 1"),
    (lambda: gpipe(2.0, 4), r"pp must be an int"),
    (lambda: one_f_one_b(2, True), r"microbatches must be an int"),
    (lambda: interleaved_1f1b(2, 0, 4), r"vp must be >= 1"),
    (lambda: interleaved_1f1b(4, 2, 8, group_size=3), r"microbatch_group_size=3 must lie in \[pp=4"),
    (lambda: interleaved_1f1b(4, 2, 8, group_size=9), r"microbatch_group_size=9 must lie in"),
    (lambda: build_schedule("zb", pp=2, microbatches=4), r"unknown schedule 'zb'; choose one of"),
    (lambda: build_schedule("1f1b", pp=2, vp=2, microbatches=4), r"vp=2; use vp=1, or .*interleaved"),
    (lambda: build_schedule("gpipe", pp=2, vp=0, microbatches=4), r"vp must be >= 1"),
    (lambda: build_schedule("gpipe", pp=2, microbatches=4, microbatch_group_size=2),
     r"microbatch_group_size applies only to the 'interleaved'"),
])
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_interleaved_rejects_m_with_nearest_valid_values():
    with pytest.raises(ValueError, match=r"microbatches=6 is not accepted with pp=4.*nearest valid "
                                         r"microbatches: 4 or 8; or keep microbatches=6 with "
                                         r"microbatch_group_size=6"):
        interleaved_1f1b(4, 2, 6)
    with pytest.raises(ValueError, match=r"nearest valid microbatches: 6 or 9.*group_size=4"):
        build_schedule("interleaved", pp=3, vp=2, microbatches=7)
    # With a larger group the remainder rule accepts more m (9 = 5 + 4, remainder 4 >= pp).
    with pytest.raises(ValueError, match=r"microbatches=11 is not accepted with pp=4, "
                                         r"microbatch_group_size=5.*nearest valid microbatches: 10 or 14"):
        interleaved_1f1b(4, 2, 11, group_size=5)


def test_rejected_interleaved_m_would_only_add_bubble():
    """Why Megatron rejects m % N in (0, pp): the order is still valid but stalls on its own
    dependencies (docs/pipeline.md): p=4, v=2, m=6 gives bubble 0.5 instead of 0.25."""
    p, v, m, n = 4, 2, 6, 4
    table = interleaved_table(m, v, n)
    order = []
    for r in range(p):
        w = min(2 * (p - r - 1) + (v - 1) * n, v * m)
        fwd = [(FORWARD, c * p + r, mb) for mb, c in table]
        bwd = [("B", (v - 1 - c) * p + r, mb) for mb, c in table]
        ops = fwd[:w]
        for i in range(v * m - w):
            ops += [fwd[w + i], bwd[i]]
        order.append(ops + bwd[v * m - w:])
    s = attach_messages("interleaved", order, pp=p, vp=v, microbatches=m, microbatch_group_size=n)
    validate(s)
    assert simulate(s, fwd_cost=1, bwd_cost=1).bubble_ratio == 0.5      # (p-1)/(v m) = 0.25
    assert simulate(s, fwd_cost=1, bwd_cost=2).bubble_ratio == 19 / 36


# ----------------------------------------------------------------------------- broken schedules


def _edit(s, rank, fn):
    ranks = list(s.ranks)
    ranks[rank] = tuple(fn(list(ranks[rank])))
    return replace(s, ranks=tuple(ranks))


def _index(actions, label):
    return next(i for i, a in enumerate(actions) if str(a) == label)


def _without(actions, label):
    return [a for a in actions if str(a) != label]


def _swap(label_a, label_b):
    def fn(actions):
        i, j = _index(actions, label_a), _index(actions, label_b)
        actions[i], actions[j] = actions[j], actions[i]
        return actions
    return fn


def _move_recv(tensor_label, to_label):
    """Move the receive of ``tensor_label`` (e.g. "act0.1") onto action ``to_label``."""
    def fn(actions):
        src = next(i for i, a in enumerate(actions) for p in a.recvs
                   if f"{p.kind}{p.stage}.{p.microbatch}" == tensor_label)
        msg = next(p for p in actions[src].recvs if f"{p.kind}{p.stage}.{p.microbatch}" == tensor_label)
        actions[src] = replace(actions[src], recvs=tuple(p for p in actions[src].recvs if p != msg))
        dst = _index(actions, to_label)
        actions[dst] = replace(actions[dst], recvs=actions[dst].recvs + (msg,))
        return actions
    return fn


def _move_send(tensor_label, to_label):
    def fn(actions):
        src = next(i for i, a in enumerate(actions) for p in a.sends
                   if f"{p.kind}{p.stage}.{p.microbatch}" == tensor_label)
        msg = actions[src].sends[0]
        actions[src] = replace(actions[src], sends=())
        dst = _index(actions, to_label)
        actions[dst] = replace(actions[dst], sends=actions[dst].sends + (msg,))
        return actions
    return fn


BASE = one_f_one_b(2, 3)

BROKEN = {
    "missing B": (lambda: _edit(BASE, 1, lambda a: _without(a, "B1.2")),
                  1, "B1.2", r"missing: no rank runs it"),
    "duplicated F": (lambda: _edit(BASE, 0, lambda a: a + [Action("F", 0, 1)]),
                     0, "F0.1", r"duplicated: runs at positions 1 and 6"),
    "B before its F (same rank)": (lambda: _edit(BASE, 1, _swap("F1.0", "B1.0")),
                                   1, "B1.0", r"runs before F1.0 \(same rank\)"),
    "F before its input arrives": (lambda: _edit(BASE, 1, _move_recv("act0.1", "B1.1")),
                                   1, "F1.1", r"runs before act0.1 from rank 0 has arrived"),
    "B before the gradient arrives": (lambda: _edit(BASE, 0, _move_recv("grad1.1", "B0.2")),
                                      0, "B0.1", r"runs before grad1.1 from rank 1 has arrived"),
    "send/recv order mismatch": (lambda: _edit(BASE, 0, _swap("F0.0", "F0.1")),
                                 1, "F1.0", r"message #0 from rank 0 to rank 1 is 'recv act0.0<-r0' "
                                            r"here but 'send act0.1->r1' on rank 0 \(at F0.1\)"),
    "deadlock from an early receive": (lambda: _edit(BASE, 1, lambda a: _move_recv("act0.2", "F1.0")(
        _move_recv("act0.1", "F1.0")(a))), 0, "B0.0", r"deadlock: .*rank 0 before B0.0 waits on "
                                                        r"'recv grad1.0<-r1'; rank 1 before F1.0 "
                                                        r"waits on 'recv act0.2<-r0'"),
    "send before the tensor exists": (lambda: _edit(BASE, 0, _move_send("act0.1", "F0.0")),
                                      0, "F0.0", r"'send act0.1->r1' is posted after F0.0 but F0.1 "
                                                 r"has not run"),
    "message to the wrong peer": (lambda: _edit(BASE, 0, lambda a: [replace(
        x, sends=tuple(replace(p, peer=0) for p in x.sends)) for x in a]),
        0, "F0.0", r"'send act0.0->r0': act0.0 goes from rank 0 to rank 1"),
    "never received": (lambda: _edit(BASE, 1, lambda a: [replace(x, recvs=tuple(
        p for p in x.recvs if p.microbatch != 2 or p.kind != ACTIVATION)) for x in a]),
        1, None, r"act0.2 is received never"),
    "stage on the wrong rank": (lambda: _edit(BASE, 0, lambda a: a + [Action("F", 1, 0)]),
                                0, "F1.0", r"stage 1 lives on rank 1 \(stage % pp\), not on rank 0"),
    "interleaved chunk order cycle": (lambda: _edit(interleaved_1f1b(2, 2, 2), 0,
                                                    _swap("F0.0", "F2.0")),
                                      0, "F2.0", r"deadlock"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_validator_rejects_broken_schedule(case):
    make, rank, action, match = BROKEN[case]
    with pytest.raises(ScheduleError, match=match) as info:
        validate(make())
    assert isinstance(info.value, ValueError)
    assert (info.value.rank, info.value.action) == (rank, action)


def test_validator_rejects_wrong_rank_count():
    with pytest.raises(ScheduleError, match=r"has 1 rank action lists but pp=2"):
        validate(replace(BASE, ranks=BASE.ranks[:1]))


# ----------------------------------------------------------------------------- simulator


@pytest.mark.parametrize("fwd, bwd", [(1, 1), (1, 2)])
def test_bubble_equals_analytic_exactly(fwd, bwd):
    for name, p, v, m in _grid():
        if p == 8 and m % 8:   # p = 8: multiples of p keep the test fast; smaller p cover the rest
            continue
        sim = simulate(build_schedule(name, pp=p, vp=v, microbatches=m), fwd_cost=fwd, bwd_cost=bwd)
        assert sim.bubble_ratio == _analytic(p, v, m), (name, p, v, m)
        assert sim.makespan == v * m * (fwd + bwd) + (p - 1) * (fwd + bwd), (name, p, v, m)
        assert sim.compute == (v * m * (fwd + bwd),) * p
    # Larger interleaved groups (m % N == 0 or >= pp) keep the bubble exactly (p-1)/(v m).
    for p, v, m, n in ((4, 2, 9, 5), (4, 3, 7, 7), (3, 2, 8, 5), (2, 3, 7, 4)):
        sim = simulate(interleaved_1f1b(p, v, m, group_size=n), fwd_cost=fwd, bwd_cost=bwd)
        assert sim.bubble_ratio == _analytic(p, v, m)


def test_latency_adds_the_documented_number_of_hops():
    """Extra makespan / latency, docs/pipeline.md: GPipe 2(p-1); interleaved 2(vp-1) while
    L <= min(fwd, bwd); 1F1B 2(m + p - 3 - floor((m-2)/p))."""
    for latency, fwd, bwd in ((0.25, 1, 1), (1.0, 1, 2), (3.0, 1, 3)):
        for p in (2, 3, 4):
            for m in range(p, 3 * p + 1):
                for s, hops in ((gpipe(p, m), 2 * (p - 1)),
                                (one_f_one_b(p, m), 2 * (m + p - 3 - (m - 2) // p))):
                    base = simulate(s, fwd_cost=fwd, bwd_cost=bwd).makespan
                    late = simulate(s, fwd_cost=fwd, bwd_cost=bwd, p2p_latency=latency).makespan
                    assert late - base == pytest.approx(hops * latency, abs=1e-9), (s.name, p, m)
    for p, v, m in ((2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 2, 6)):
        s = interleaved_1f1b(p, v, m)
        for latency in (0.5, 1.0):
            extra = (simulate(s, fwd_cost=1, bwd_cost=2, p2p_latency=latency).makespan
                     - simulate(s, fwd_cost=1, bwd_cost=2).makespan)
            assert extra == pytest.approx(2 * (v * p - 1) * latency, abs=1e-9)
    # Beyond L = min(fwd, bwd) the interleaved order becomes latency-bound (more than 2(vp-1) L).
    s = interleaved_1f1b(2, 2, 4)
    extra = simulate(s, fwd_cost=1, bwd_cost=1, p2p_latency=2).makespan - 18
    assert extra > 2 * 3 * 2


def test_peak_inflight_formulas():
    for p in GRID_P:
        for m in (p, 2 * p + 1, 4 * p):
            assert simulate(one_f_one_b(p, m), fwd_cost=1, bwd_cost=2).peak_inflight == \
                tuple(p - r for r in range(p))
            assert peak_inflight(gpipe(p, m)) == (m,) * p
        for v in GRID_V:
            for m in (p, 2 * p, 4 * p):
                total = v * m
                # Megatron: num_warmup = (p - rank - 1) * 2 + (v - 1) * p, capped at the total;
                # the first steady step adds one more before any backward.
                expect = tuple(min(min((p - r - 1) * 2 + (v - 1) * p, total) + 1, total)
                               for r in range(p))
                assert peak_inflight(interleaved_1f1b(p, v, m)) == expect, (p, v, m)


def test_blocking_runtime_keeps_the_ideal_timeline():
    """Receives are placed where sender and receiver meet: with equal costs a runtime that waits
    for every batch (rendezvous sends) runs exactly the ideal timeline; 1F1B and GPipe also with
    bwd = 2 fwd, and 1F1B with latency. Interleaved with bwd = 2 fwd pays a documented extra."""
    for name, p, v, m in _grid():
        if m % p:
            continue
        s = build_schedule(name, pp=p, vp=v, microbatches=m)
        ideal = simulate(s, fwd_cost=1, bwd_cost=1)
        blocking = simulate(s, fwd_cost=1, bwd_cost=1, comm="blocking")
        assert blocking.makespan == ideal.makespan, (name, p, v, m)
        assert [[(e.start, e.end) for e in tl] for tl in blocking.timelines] == \
            [[(e.start, e.end) for e in tl] for tl in ideal.timelines]
        if name != "interleaved":
            assert simulate(s, fwd_cost=1, bwd_cost=2, comm="blocking").makespan == \
                simulate(s, fwd_cost=1, bwd_cost=2).makespan
    s = one_f_one_b(4, 8)
    assert simulate(s, fwd_cost=1, bwd_cost=2, p2p_latency=0.5, comm="blocking").makespan == \
        simulate(s, fwd_cost=1, bwd_cost=2, p2p_latency=0.5).makespan
    # The documented interleaved example (docs/pipeline.md): p=4, v=2, m=8, bwd = 2 fwd.
    assert simulate(interleaved_1f1b(4, 2, 8), fwd_cost=1, bwd_cost=2, comm="blocking").makespan == 63
    assert simulate(interleaved_1f1b(4, 2, 8), fwd_cost=1, bwd_cost=2).makespan == 57


def test_per_stage_costs():
    """GPipe with per-stage costs is a forward then a backward flow shop:
    makespan = sum(f) + (m-1) max(f) + sum(b) + (m-1) max(b). Bubble is taken on the busiest rank."""
    f, b, m = [1, 3, 2, 1], [2, 2, 5, 1], 6
    sim = simulate(gpipe(4, m), fwd_cost=f, bwd_cost=b)
    assert sim.makespan == sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b)
    assert sim.compute == tuple(m * (x + y) for x, y in zip(f, b))
    assert sim.bubble_ratio == (sim.makespan - m * 7) / (m * 7)
    assert sim.idle_ratio[0] == (sim.makespan - m * 3) / (m * 3)
    uniform = simulate(interleaved_1f1b(2, 2, 4), fwd_cost=[1] * 4, bwd_cost=[2] * 4)
    assert uniform == simulate(interleaved_1f1b(2, 2, 4), fwd_cost=1, bwd_cost=2)
    assert simulate(one_f_one_b(1, 5), fwd_cost=1, bwd_cost=2).makespan == 15


@pytest.mark.parametrize("kwargs, match", [
    (dict(fwd_cost=0, bwd_cost=1), r"fwd_cost entries must be finite numbers > 0"),
    (dict(fwd_cost=1, bwd_cost=float("nan")), r"bwd_cost entries must be finite"),
    (dict(fwd_cost=[1, 1, 1], bwd_cost=1), r"fwd_cost has 3 entries but the schedule has 2 virtual"),
    (dict(fwd_cost="1", bwd_cost=1), r"fwd_cost must be a number or a list of 2 numbers"),
    (dict(fwd_cost=1, bwd_cost=[1, "x"]), r"bwd_cost entries must be finite numbers > 0"),
    (dict(fwd_cost=1, bwd_cost=1, p2p_latency=-1), r"p2p_latency must be a finite number >= 0"),
    (dict(fwd_cost=1, bwd_cost=1, comm="eager"), r"comm must be 'async' or 'blocking'"),
])
def test_simulator_rejects_bad_costs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate(one_f_one_b(2, 2), **kwargs)


def test_simulator_validates_first():
    with pytest.raises(ScheduleError, match="missing"):
        simulate(BROKEN["missing B"][0](), fwd_cost=1, bwd_cost=1)


# ----------------------------------------------------------------------------- CLI


def _cli(*args):
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def test_cli_json_matches_library():
    out = _cli("--schedule", "interleaved", "--pp", "4", "--vp", "2", "--microbatches", "8",
               "--fwd-cost", "1", "--bwd-cost", "2", "--p2p-latency", "0.25", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    sim = simulate(interleaved_1f1b(4, 2, 8), fwd_cost=1, bwd_cost=2, p2p_latency=0.25)
    assert got == {"bubble_ratio": sim.bubble_ratio, "peak_inflight": list(sim.peak_inflight),
                   "makespan": sim.makespan}
    out = _cli("--schedule", "gpipe", "--pp", "2", "--microbatches", "4", "--fwd-cost", "1,2",
               "--bwd-cost", "2", "--comm", "blocking", "--json")
    assert json.loads(out.stdout)["makespan"] == \
        simulate(gpipe(2, 4), fwd_cost=[1, 2], bwd_cost=2, comm="blocking").makespan


def test_cli_ascii_timeline():
    out = _cli("--schedule", "1f1b", "--pp", "2", "--microbatches", "3", "--bwd-cost", "1")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("rank")]
    assert rows == ["rank  0 |F0.0 F0.1 .... B0.0 F0.2 B0.1 .... B0.2",
                    "rank  1 |.... F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 ...."]
    assert "bubble ratio 0.333333 (analytic (p-1)/(v*m) = 0.333333" in out.stdout
    out = _cli("--schedule", "gpipe", "--pp", "2", "--microbatches", "2", "--actions")
    assert "rank  0 |F0.0 F0.1 .... .... .... B0.0----- B0.1-----" in out.stdout
    assert "rank 1: [recv act0.0<-r0] F1.0 | [recv act0.1<-r0] F1.1 | B1.0 [send grad1.0->r0]" \
        in out.stdout


@pytest.mark.parametrize("args, match", [
    (["--schedule", "interleaved", "--pp", "4", "--vp", "2", "--microbatches", "6"],
     "nearest valid microbatches: 4 or 8"),
    (["--schedule", "1f1b", "--pp", "4", "--microbatches", "2"], "microbatches=2 is smaller than pp=4"),
    (["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--fwd-cost", "1,1,1"],
     "fwd_cost has 3 entries"),
    (["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--fwd-cost", "x"],
     "is not a number or a comma-separated list"),
    (["--schedule", "zb", "--pp", "2", "--microbatches", "2"], "invalid choice: 'zb'"),
])
def test_cli_errors_exit_nonzero_with_message(args, match):
    out = _cli(*args)
    assert out.returncode == 2
    assert match in out.stderr
    assert out.stdout == ""


def test_cli_png(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(TOOL.parent))
    try:
        import pipeline_schedule
    finally:
        sys.path.remove(str(TOOL.parent))
    png = tmp_path / "t.png"
    args = ["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--png", str(png)]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        assert pipeline_schedule.main(args) == 0 and png.stat().st_size > 0
        assert f"wrote {png}" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import fails as if not installed
    assert pipeline_schedule.main(args) == 2
    err = capsys.readouterr()
    assert "--png needs matplotlib, which is not installed" in err.err
    assert "rank" not in err.out   # fails before printing a timeline


@pytest.mark.parametrize("p,v", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 3)])
def test_forward_only_schedule_is_valid_and_has_no_backward(p, v):
    from parallel.pipeline import forward_only

    for m in (1, 2, p, 2 * p + 1):
        sched = forward_only(p, v, m)
        validate(sched)
        assert sched.forward_only and all(a.op == FORWARD for acts in sched.ranks for a in acts)
        assert sum(len(acts) for acts in sched.ranks) == p * v * m
        assert all(msg.kind == ACTIVATION for acts in sched.ranks for a in acts for msg in a.sends + a.recvs)
    bad = forward_only(p, v, 2)
    with_b = replace(bad, ranks=tuple(acts + (Action(BACKWARD, r, 0, (), ()),)
                                                  for r, acts in enumerate(bad.ranks)))
    with pytest.raises(ScheduleError, match="no backward actions"):
        validate(with_b)
    with pytest.raises(ValueError, match="use vp=1 when pp=1"):
        forward_only(1, 2, 2)


def test_early_receive_plan_says_where_each_wait_sits():
    """p2p_plan(early_recv=True): a receive is posted one boundary before the action that needs it and
    waited right before that action; a send is waited one boundary after it is posted; the same
    messages as the blocking plan, in the same order per direction. validate() runs both plans."""
    from parallel.pipeline import build_schedule
    from parallel.pipeline.actions import RECV, SEND, p2p_plan

    for name, vp, m in (("1f1b", 1, 4), ("gpipe", 1, 4), ("interleaved", 2, 4)):
        sched = build_schedule(name, pp=2, vp=vp, microbatches=m)
        for rank in range(2):
            actions = sched.ranks[rank]
            blocking = p2p_plan(sched, rank)
            early = p2p_plan(sched, rank, early_recv=True)
            assert len(early) == len(blocking) == len(actions) + 1
            for kind in (SEND, RECV):  # same messages, same order
                assert [p for b in blocking for p, _ in b.post if p.op == kind] == \
                       [p for b in early for p, _ in b.post if p.op == kind]
            posted_at = {p: i for i, b in enumerate(early) for p, _ in b.post}
            waited_at = {p: i for i, b in enumerate(early) for p in b.wait}
            assert posted_at.keys() == waited_at.keys()  # everything posted is waited once
            for i, a in enumerate(actions):
                for p in a.recvs:
                    assert waited_at[p] == i and posted_at[p] == max(i - 1, 0)
                for p in a.sends:
                    assert posted_at[p] == i + 1 and waited_at[p] == min(i + 2, len(actions))
