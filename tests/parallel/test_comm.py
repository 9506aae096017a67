"""Ledger assertions for every collective at 2 and 4 ranks, checked against the ring cost model,
plus the values the collectives compute (so the ledger cannot drift from what actually moved)."""
import pytest
import torch
import torch.distributed as dist

from parallel import comm
from parallel.comm import Group, Ledger
from parallel.testing import run_distributed


def _world_group(ledger):
    p, r = dist.get_world_size(), dist.get_rank()
    return Group(axis="world", ranks=list(range(p)), rank=r, pg=dist.group.WORLD, ledger=ledger)


def _exercise_all():
    """Run each op once on fp32 tensors of known size; return values and the ledger records."""
    ledger = Ledger()
    g = _world_group(ledger)
    p, r = g.size, g.rank
    out = {}
    with ledger.capture() as cap:
        _run_each_op(g, p, r, out)
    out["records"] = [(rec.op, rec.axis, rec.group_size, rec.payload_bytes, rec.sent_bytes, rec.recv_bytes)
                      for rec in cap.records]
    # The running totals agree with the captured records.
    out["totals"] = (ledger.count(), ledger.total(), cap.total(), ledger.total("recv_bytes"), cap.total("recv_bytes"))
    return out


def _run_each_op(g, p, r, out):

    t = torch.full((12,), float(r + 1))
    comm.all_reduce(t, g)
    out["all_reduce"] = t.tolist()

    gathered = comm.all_gather(torch.full((3, 2), float(r)), g, dim=0)
    out["all_gather"] = gathered[:, 0].tolist()
    gathered1 = comm.all_gather(torch.full((2, 3), float(r)), g, dim=1)
    out["all_gather_dim1"] = gathered1[0].tolist()

    rs = comm.reduce_scatter(torch.arange(4 * p * 2, dtype=torch.float32).reshape(4 * p, 2), g, dim=0)
    out["reduce_scatter"] = rs.flatten().tolist()
    rs1 = comm.reduce_scatter(torch.arange(2 * 4 * p, dtype=torch.float32).reshape(2, 4 * p), g, dim=1)
    out["reduce_scatter_dim1"] = rs1.tolist()

    a2a = comm.all_to_all(torch.arange(2 * p, dtype=torch.float32) + 100 * r, g)
    out["all_to_all"] = a2a.tolist()

    b = torch.full((5,), float(r))
    comm.broadcast(b, g, src=1)
    out["broadcast"] = b.tolist()

    # ring of blocking send/recv: even ranks send first to avoid deadlock
    x = torch.full((7,), float(r))
    y = torch.empty(7)
    nxt, prv = (r + 1) % p, (r - 1) % p
    if r % 2 == 0:
        comm.send(x, g, dst=nxt)
        comm.recv(y, g, src=prv)
    else:
        comm.recv(y, g, src=prv)
        comm.send(x, g, dst=nxt)
    out["sendrecv"] = y.tolist()

    z = torch.empty(6, dtype=torch.float64)
    works = comm.batch_p2p([comm.P2P("send", torch.full((6,), float(r), dtype=torch.float64), nxt),
                            comm.P2P("recv", z, prv)], g)
    for w in works:
        w.wait()
    out["batch_p2p"] = z.tolist()


@pytest.mark.parametrize("p", [2, 4])
def test_ledger_and_values(p):
    results = run_distributed(_exercise_all, p)
    for r, out in enumerate(results):
        assert out["all_reduce"] == [float(sum(range(1, p + 1)))] * 12
        assert out["all_gather"] == [float(i) for i in range(p) for _ in range(3)]
        assert out["all_gather_dim1"] == [float(i) for i in range(p) for _ in range(3)]
        full = torch.arange(4 * p * 2, dtype=torch.float32).reshape(4 * p, 2) * p
        assert out["reduce_scatter"] == full[4 * r:4 * (r + 1)].flatten().tolist()
        full1 = torch.arange(2 * 4 * p, dtype=torch.float32).reshape(2, 4 * p) * p
        assert out["reduce_scatter_dim1"] == full1[:, 4 * r:4 * (r + 1)].tolist()
        assert out["all_to_all"] == [float(100 * s + 2 * r + k) for s in range(p) for k in range(2)]
        assert out["broadcast"] == [1.0] * 5
        assert out["sendrecv"] == [float((r - 1) % p)] * 7
        assert out["batch_p2p"] == [float((r - 1) % p)] * 6

        f32, f64 = 4, 8
        ring = (p - 1) / p
        bcast_pos = (r - 1) % p
        expected = [
            ("all_reduce", "world", p, 12 * f32, 2 * ring * 12 * f32, 2 * ring * 12 * f32),
            ("all_gather", "world", p, 6 * f32, (p - 1) * 6 * f32, (p - 1) * 6 * f32),
            ("all_gather", "world", p, 6 * f32, (p - 1) * 6 * f32, (p - 1) * 6 * f32),
            ("reduce_scatter", "world", p, 8 * p * f32, ring * 8 * p * f32, ring * 8 * p * f32),
            ("reduce_scatter", "world", p, 8 * p * f32, ring * 8 * p * f32, ring * 8 * p * f32),
            ("all_to_all", "world", p, 2 * p * f32, 2 * (p - 1) * f32, 2 * (p - 1) * f32),
            ("broadcast", "world", p, 5 * f32, 0.0 if bcast_pos == p - 1 else 5.0 * f32,
             0.0 if bcast_pos == 0 else 5.0 * f32),
        ]
        if r % 2 == 0:
            expected += [("send", "world", p, 7 * f32, 7 * f32, 0.0), ("recv", "world", p, 7 * f32, 0.0, 7 * f32)]
        else:
            expected += [("recv", "world", p, 7 * f32, 0.0, 7 * f32), ("send", "world", p, 7 * f32, 7 * f32, 0.0)]
        expected += [("send", "world", p, 6 * f64, 6 * f64, 0.0), ("recv", "world", p, 6 * f64, 0.0, 6 * f64)]
        assert out["records"] == expected, f"rank {r}"
        calls, sent, cap_sent, recv, cap_recv = out["totals"]
        assert calls == len(expected) and sent == cap_sent and recv == cap_recv


def test_trivial_group_is_identity_and_silent():
    ledger = Ledger()
    g = Group.trivial("tp", ledger=ledger)
    t = torch.arange(6.0)
    comm.all_reduce(t, g)
    assert torch.equal(comm.all_gather(t, g), t)
    assert torch.equal(comm.reduce_scatter(t, g), t)
    assert torch.equal(comm.all_to_all(t, g), t)
    comm.broadcast(t, g)
    assert ledger.count() == 0 and ledger.size() == 0
    with pytest.raises(ValueError, match="one rank, there is no peer"):
        comm.send(t, g, dst=0)


def test_ledger_queries_and_errors():
    ledger = Ledger()
    ledger.add(comm.CommRecord("all_reduce", "tp", 2, 100, 100.0, 100.0, "torch.float32"))
    ledger.add(comm.CommRecord("all_gather", "dp", 2, 10, 10.0, 10.0, "torch.float32"))
    assert ledger.total(axis="tp") == 100.0
    assert ledger.total("payload_bytes") == 110
    assert ledger.count(op="all_gather") == 1
    with ledger.capture() as cap:
        ledger.add(comm.CommRecord("send", "pp", 2, 4, 4.0, 0.0, "torch.float32"))
    assert [r.op for r in cap.records] == ["send"]
    assert ledger.summary()["all_reduce@tp"]["calls"] == 1
    assert ledger.by_axis() == {"tp": 100.0, "dp": 10.0, "pp": 4.0}
    assert cap.summary() == {"send@pp": {"calls": 1, "payload_bytes": 4, "sent_bytes": 4.0, "recv_bytes": 0.0}}
    with pytest.raises(ValueError, match="use 'sent_bytes'"):
        ledger.total("bytes")
    with pytest.raises(ValueError, match="reduce op 'mean' unknown"):
        comm._reduce_op("mean")


def _bad_calls():
    g = _world_group(Ledger())
    errors = []
    for call in (lambda: comm.reduce_scatter(torch.ones(3), g),
                 lambda: comm.all_to_all(torch.ones(3), g),
                 lambda: comm.broadcast(torch.ones(3), g, src=5),
                 lambda: comm.send(torch.ones(3), g, dst=g.rank)):
        try:
            call()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_bad_collective_arguments_are_clear_errors():
    errs = run_distributed(_bad_calls, 2)[0]
    assert "not divisible by the group size 2" in errs[0]
    assert "not divisible by 2" in errs[1]
    assert "src=5 not in 0..1" in errs[2]
    assert "must be another rank" in errs[3]


class _FakeEvent:
    """Stands in for torch.cuda.Event on the CPU: ``record`` stamps a shared clock that the test moves
    forward (as a stream reaches the event); ``elapsed_time`` is in milliseconds, as CUDA's."""

    def __init__(self, clock, done=True):
        self.clock, self.t, self.synced, self.done = clock, None, 0, done

    def record(self):
        self.t = self.clock[0]

    def query(self):
        return self.done

    def synchronize(self):
        self.synced += 1

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def test_cuda_clock_times_waits_with_event_pairs_read_on_settle():
    clock, events, fired = [0.0], [], [True]

    def event():
        events.append(_FakeEvent(clock, done=fired[0]))
        return events[-1]

    ledger = Ledger(clock="cuda", event_factory=event)
    g = Group(axis="tp", ranks=range(2), rank=0, pg=object(), ledger=ledger)

    class Work:  # the compute stream stands still 5 ms for this transfer
        def wait(self):
            clock[0] += 0.005

    comm.wait([Work(), Work()], g)  # one span for the list: 10 ms
    comm.wait(Work(), g)
    assert len(ledger._spans) == 2 and not ledger._blocked  # nothing read until asked
    assert ledger.blocked_s == {"tp": pytest.approx(0.015)}
    assert [e.synced for e in events] == [0, 1, 0, 1]  # each stop event is waited for (all fired by then)
    assert not ledger._spans
    ledger.blocked_s["tp"] = 0.0  # a copy: the ledger's own total is untouched
    assert ledger.blocked_s == {"tp": pytest.approx(0.015)}
    # Trivial groups and empty lists make no span; a disabled ledger makes no events.
    comm.wait(Work(), Group.trivial("tp", ledger=ledger))
    comm.wait([], g)
    ledger.enabled = False
    comm.wait(Work(), g)
    assert len(events) == 4 and ledger.blocked_s == {"tp": pytest.approx(0.015)}
    ledger.enabled = True
    # A caller that never reads blocked_s does not grow the pending list without bound: at the cap, the
    # spans whose stop event has fired are read on the spot, without waiting for the GPU.
    ledger.MAX_PENDING_SPANS = 3
    for _ in range(7):
        comm.wait(Work(), g)
    assert len(ledger._spans) == 1 and ledger._blocked["tp"] == pytest.approx(0.015 + 0.030)
    synced = sum(e.synced for e in events)
    fired[0] = False  # the GPU has not reached the next spans yet
    comm.wait(Work(), g)
    comm.wait(Work(), g)  # the cap: the one finished span is read, the two unfinished stay; nothing waits
    assert len(ledger._spans) == 2 and sum(e.synced for e in events) == synced
    assert ledger._blocked["tp"] == pytest.approx(0.015 + 0.035)
    ledger.reset()
    assert ledger.blocked_s == {} and not ledger._spans


def test_ledger_clock_is_checked():
    with pytest.raises(ValueError, match="clock='gpu' unknown; use one of"):
        Ledger(clock="gpu")


def _sync_collectives_make_one_span_each():
    ledger = Ledger(clock="cuda", event_factory=lambda: _FakeEvent([0.0]))
    g = _world_group(ledger)
    comm.all_reduce(torch.ones(4), g)
    comm.all_gather(torch.ones(2), g)
    work = comm.all_reduce(torch.ones(4), g, async_op=True)  # async: timed at its wait, not its call
    n_before_wait = len(ledger._spans)
    comm.wait(work, g)
    return n_before_wait, len(ledger._spans), sorted(ledger.blocked_s)


def test_sync_collectives_and_waits_make_one_span_each_on_the_cuda_clock():
    assert run_distributed(_sync_collectives_make_one_span_each, 2) == [(2, 3, ["world"])] * 2


def _sleep_cycles_per_ms() -> float:
    torch.cuda._sleep(5 * 10 ** 7)  # its first launch, and time for the SM clock to ramp up
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10 ** 7)
    stop.record()
    stop.synchronize()
    return 10 ** 7 / start.elapsed_time(stop)


@pytest.mark.gpu
def test_cuda_clock_measures_how_long_the_compute_stream_waits():
    """A "transfer" on a side stream (as NCCL's own stream) that the compute stream waits for: exposed is
    the part of it that no compute queued before the wait covers, while the host blocks for none of it.
    Each sleep is timed with its own events, so the expectation does not rest on the sleep's calibration."""
    import time
    per_ms = _sleep_cycles_per_ms()
    side, compute = torch.cuda.Stream(), torch.cuda.current_stream()

    def timed_sleep(ms, stream):
        with torch.cuda.stream(stream):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(int(per_ms * ms))
            b.record()
        return a, b

    ledger = Ledger(clock="cuda")
    g = Group(axis="tp", ranks=range(2), rank=0, pg=object(), ledger=ledger)
    results = {}
    for name, transfer_ms, compute_ms in (("exposed", 20, 0), ("hidden", 10, 30), ("partly", 30, 10)):
        torch.cuda.synchronize()
        ledger.reset()
        t_start, t_done = timed_sleep(transfer_ms, side)
        c_done = timed_sleep(compute_ms, compute)[1] if compute_ms else None  # compute queued before the wait

        class Work:  # what ProcessGroupNCCL's Work.wait does: the current stream waits, the host does not
            def wait(self):
                compute.wait_event(t_done)

        t0 = time.perf_counter()
        comm.wait(Work(), g)
        host_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        # what the compute stream should have stood still for: the transfer's part after the compute's end
        expect = (t_start.elapsed_time(t_done) if c_done is None else max(0.0, c_done.elapsed_time(t_done))) / 1e3
        results[name] = (ledger.blocked_s["tp"], expect, host_s)
    for name, (got, expect, host_s) in results.items():
        assert abs(got - expect) < 0.001 + 0.1 * expect, (name, results)
        assert host_s < 0.005, (name, results)  # the wall clock would have read ~0
    assert results["exposed"][1] > 0.010 and results["hidden"][1] == 0.0 and results["partly"][1] > 0.010, results
