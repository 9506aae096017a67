"""tools/bench_decentralised.py's simulated link (no launch: a fake clock and a stand-in comm module).

The bench itself (4 ranks, every method) runs by hand; docs/decentralised.md has its command and numbers.
What is tested is the link model its figures rest on: the transfers in flight share the link's rate; a
synchronous collective returns once its bytes are through; an asynchronous one returns at once and its
handle's wait() blocks only for what the compute since its launch did not hide; records on another axis
cost nothing.
"""
from __future__ import annotations

import pytest
import torch

from parallel.comm import CommRecord, Ledger
from tools.bench_decentralised import Link, install_link


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


class _Work:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True
        return True


class _Comm:
    """Stands in for parallel.comm: each collective records its bytes in the ledger when issued."""

    def __init__(self, ledger):
        self.ledger = ledger

    def _issue(self, nbytes, axis, async_op):
        self.ledger.add(CommRecord(op="x", axis=axis, group_size=2, payload_bytes=int(nbytes), sent_bytes=nbytes,
                                   recv_bytes=nbytes, dtype="torch.float32"))
        return _Work() if async_op else None

    def all_reduce(self, nbytes, axis, *, async_op=False):
        return self._issue(nbytes, axis, async_op)

    def all_gather(self, nbytes, axis, *, async_op=False):
        work = self._issue(nbytes, axis, async_op)
        return (torch.zeros(1), work) if async_op else torch.zeros(1)

    reduce_scatter = all_gather

    def all_to_all(self, nbytes, axis, *, async_op=False):
        return self._issue(nbytes, axis, async_op)

    broadcast = all_to_all


def test_the_link_shares_its_rate_between_transfers_in_flight():
    clock = _Clock()
    link = Link(100.0, clock=clock, sleep=clock.sleep)
    big = link.send(200)  # alone: 2 s
    clock.now = 1.0  # 100 B through
    small = link.send(10)  # now two share: 50 B/s each
    assert link.done_at(small) == pytest.approx(1.2)  # not stuck behind the big one
    link.block_until_done(small)
    assert clock.now == pytest.approx(1.2)
    assert link.done_at(big) == pytest.approx(2.1)  # 100 - 10 B left at 1.2 s, alone again
    clock.now = 5.0
    link.block_until_done(big)  # already through: no wait
    assert clock.now == 5.0 and link.blocked_s == pytest.approx(0.2)
    with pytest.raises(ValueError, match="must be > 0"):
        Link(0.0)


def test_async_collectives_pay_only_what_the_compute_did_not_hide():
    clock = _Clock()
    ledger = Ledger()
    comm = _Comm(ledger)
    link = Link(100.0, clock=clock, sleep=clock.sleep)
    install_link(ledger, comm, axis="dp", link=link)

    comm.all_reduce(100, "dp")  # synchronous: through before it returns
    assert clock.now == 1.0
    work = comm.all_reduce(200, "dp", async_op=True)  # 2 s on the link, returns at once
    assert clock.now == 1.0
    clock.now += 0.5  # compute
    work.wait()
    assert clock.now == 3.0 and work.waited  # blocked 1.5 s: the 0.5 s of compute hid the rest
    _, w2 = comm.all_gather(100, "dp", async_op=True)  # (result, handle): the handle is wrapped
    clock.now += 5.0  # compute longer than the transfer: nothing left to wait for
    w2.wait()
    assert clock.now == 8.0
    comm.all_reduce(10_000, "tp")  # another axis: free
    assert clock.now == 8.0
    frag = comm.all_reduce(300, "dp", async_op=True)  # a fragment in flight (3 s alone) ...
    comm.all_reduce(10, "dp")  # ... and the next step's small synchronous all-reduce beside it: 0.2 s
    assert clock.now == pytest.approx(8.2)
    clock.now += 4.0  # the inner step's compute hides the rest of the fragment
    frag.wait()
    assert clock.now == pytest.approx(12.2)
    assert link.blocked_s == pytest.approx(1.0 + 1.5 + 0.2)
    assert ledger.by_axis() == {"dp": 710.0, "tp": 10_000.0}  # the records still reach the ledger
