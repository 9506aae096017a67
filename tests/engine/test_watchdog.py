"""The hang watchdog and the flight recorder (``fault.hang_timeout_s``, ``fault.flight_records``; issue 22):

* the recorder numbers each axis's collectives (point-to-point apart), keeps the last N, and
  parallel/comm feeds it;
* a rank SIGSTOPped among 3 gloo ranks: both live ranks write ``hang/rank<R>.txt`` (stacks and flight
  records), name the collective and the stopped rank, SIGKILL it (a stopped sibling on their host) and
  exit with status 4 within the timeout plus a few seconds;
* the watchdog wired by the assembly line (``build_run``) fires on a step that hangs without a collective
  (the clock starts once the first step has finished).
"""
import datetime
import os
import re
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch

from engine.fault import EXIT_HUNG
from parallel import comm
from parallel.flight import FlightRecorder


class _Group:
    def __init__(self, axis, ranks=(0, 1), flight_axis=None):
        self.axis, self.ranks = axis, tuple(ranks)
        if flight_axis is not None:
            self.flight_axis = flight_axis


def test_flight_recorder_numbers_each_axis_and_keeps_the_last_n():
    rec = FlightRecorder(4)
    dp, pp = _Group("dp"), _Group("pp")
    a = rec.start("all_reduce", dp, 8)
    rec.finish(a)
    rec.start("send", pp, 16, peer=1)  # p2p: numbered apart, never compared across ranks
    b = rec.start("all_gather", pp, 4)
    c = rec.start("reduce_scatter", dp, 32, async_op=True)
    w = rec.start("wait", dp, 0)
    assert (a.seq, b.seq, c.seq, w.seq) == (1, 1, 2, None)
    assert rec.in_flight() is w  # the newest unfinished blocking record (async work is waited for by `wait`)
    rec.finish(w)
    rec.finish_async("dp")
    records, started, done, _ = rec.snapshot()
    assert len(records) == 4 and records[0].op == "send"  # capacity 4: the first record fell off
    assert started == {"dp": 2, "pp:p2p": 1, "pp": 1} and done == {"dp": 2}
    assert rec.in_flight() is b and "IN FLIGHT" in b.line(time.monotonic())
    with pytest.raises(ValueError, match="fault.flight_records"):
        FlightRecorder(0)


def test_a_second_communicator_over_an_axis_is_recorded_apart():
    """Streaming DiLoCo's fragment reductions run on a second dp communicator (the mesh's dp_outer, booked on
    the dp_cp axis): its calls are numbered apart, and a wait on dp_cp does not mark its async work done."""
    rec = FlightRecorder(8)
    dp, outer = _Group("dp_cp"), _Group("dp_cp", flight_axis="dp_outer")
    frag = rec.start("all_reduce", outer, 1024, async_op=True)
    loss = rec.start("all_reduce", dp, 16, async_op=True)
    w = rec.start("wait", dp, 0)
    rec.finish(w)
    rec.finish_async("dp_cp")
    _, started, done, _ = rec.snapshot()
    assert (frag.seq, loss.seq) == (1, 1) and started == {"dp_outer": 1, "dp_cp": 1} and done == {"dp_cp": 1}
    assert frag.end is None and frag.axis == "dp_outer" and loss.end is not None  # before: both done, #1 and #2


def test_comm_feeds_the_recorder_only_when_set():
    g = comm.Group.trivial("dp")
    assert g.ledger.recorder is None
    g.ledger.recorder = FlightRecorder(8)
    comm.all_reduce(torch.ones(2), g)  # a size-1 group never communicates: nothing recorded
    assert g.ledger.recorder.snapshot()[0] == []


def _loop_worker(rank, world, init_file, run_dir, timeout_s):
    import torch.distributed as dist

    from engine.watchdog import Watchdog
    from parallel.mesh import Mesh, ParallelDims

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    mesh = Mesh.build(ParallelDims(dp=world), timeout_s=60)
    mesh.ledger.recorder = FlightRecorder(16)
    wd = Watchdog(recorder=mesh.ledger.recorder, rank=rank, world_size=world, timeout_s=timeout_s,
                  run_dir=run_dir).start()
    step = 0
    while True:  # a "training loop": two collectives per step
        comm.all_reduce(torch.ones(4), mesh.dp)
        comm.all_gather(torch.ones(2), mesh.dp)
        step += 1
        wd.beat(step)
        if step == 5:
            Path(run_dir, f"ready{rank}").touch()
        time.sleep(0.02)


def test_a_stopped_rank_is_named_and_the_live_ranks_report_and_exit():
    import torch.multiprocessing as mp

    world, timeout_s = 3, 2.0
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as run_dir:
        init_file = os.path.join(run_dir, "rdzv")
        procs = [ctx.Process(target=_loop_worker, args=(r, world, init_file, run_dir, timeout_s), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            deadline = time.monotonic() + 60
            while not all(Path(run_dir, name).exists() for r in range(world)
                          for name in (f"ready{r}", f"hang/progress.rank{r}.json")):
                assert time.monotonic() < deadline and all(p.is_alive() for p in procs), "workers did not start"
                time.sleep(0.05)
            os.kill(procs[2].pid, signal.SIGSTOP)
            stopped = time.monotonic()
            for p in procs[:2]:
                p.join(timeout=timeout_s + 30)
            elapsed = time.monotonic() - stopped
            print(f"exited {elapsed:.1f} s after the SIGSTOP")
            assert [p.exitcode for p in procs[:2]] == [EXIT_HUNG, EXIT_HUNG], [p.exitcode for p in procs]
            assert elapsed < timeout_s + 6, elapsed  # detected after the timeout, plus a tick and the peers' reports
            hang = Path(run_dir, "hang")
            assert not (hang / "rank2.txt").exists()
            for r in (0, 1):
                text = (hang / f"rank{r}.txt").read_text()
                assert f"rank {r} of 3" in text and "Python stacks (all threads)" in text, text[:2000]
                # The main thread's stack, from faulthandler: in the loop, or (rarely: a peer's exit broke its
                # collective first) at interpreter exit, waiting for this report to finish.
                assert "_loop_worker" in text or "_exit_after_report" in text, text[-3000:]
                assert re.search(r"flight records \(last \d+ of at most 16", text) and "IN FLIGHT" in text, text[:2000]
                # The stuck collective and the stopped rank, named.
                stuck = next(x for x in text.splitlines() if x.startswith("stuck in "))
                assert " over dp (ranks [0, 1, 2])" in stuck, stuck
                peers = next(x for x in text.splitlines() if x.startswith("peers not responding: "))
                assert peers.startswith("peers not responding: rank 2 (no heartbeat for "), peers
                assert "rank 0 (" not in peers and "rank 1 (" not in peers, peers
                # (A live rank may be "behind": still in the previous collective, which rank 2 stopped mid-way.)
            assert (hang / "HANG").exists()
            # The stopped rank, a sibling on this host, was SIGKILLed by a live one (torchrun would wait 30 s).
            procs[2].join(timeout=5)
            assert procs[2].exitcode == -signal.SIGKILL
            assert any("SIGKILLed the stopped rank 2 (pid" in (hang / f"rank{r}.txt").read_text() for r in (0, 1))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()  # SIGKILL ends a stopped process too
                p.join(timeout=5)


def test_the_assembly_line_arms_the_watchdog_and_a_stuck_step_fires_it(tmp_path):
    from tests.engine.test_fault import _build, _cfg

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}  # Trainer.train installs its own
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, "fault.hang_timeout_s=1.0", "fault.flight_records=8", "train.steps=2", "checkpoint.interval=0",
               "logging.memory_report=false")
    run = _build(cfg, run_dir)
    wd = run.trainer.watchdog
    assert wd is not None and run.mesh.ledger.recorder.capacity == 8
    codes = []
    wd._exit = codes.append  # the test survives the exit

    def stuck_after_step_1(tr, st):  # the clock starts once step 1 has finished
        if st.step == 1:
            time.sleep(1.0 + 0.8)  # no step, no collective: the watchdog fires on its next tick
    try:
        run.train(on_step=stuck_after_step_1)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert codes == [EXIT_HUNG]
    text = (run_dir / "hang" / "rank0.txt").read_text()
    assert "a step exceeded fault.hang_timeout_s=1" in text and "in no collective" in text, text[:1500]
    assert "last step finished: 1" in text and "stuck_after_step_1" in text, text[:1500]  # the sleeping frame
    assert wd._thread is None  # stopped with the loop
    # Without the key nothing is armed or recorded.
    plain = _build(_cfg(tmp_path / "plain", "train.steps=1"), tmp_path / "plain")
    assert plain.trainer.watchdog is None and plain.mesh.ledger.recorder is None
