"""The flight recorder: this rank's last N collectives, kept in memory for the hang watchdog.

:mod:`parallel.comm` feeds it (when the mesh's :class:`parallel.comm.Ledger` has one: ``ledger.recorder``),
one :class:`Flight` per call over a group of more than one rank: the op, the mesh axis, the bytes passed
in, a sequence number, when it started and whether it finished. engine/watchdog.py reads it from its own
thread when nothing has progressed for ``fault.hang_timeout_s`` and writes it to ``RUN_DIR/hang/``.

Sequence numbers count the collectives of each axis on this rank from 1. Every rank of a group calls
its collectives in the same order, so collective #N of axis ``dp`` is the same call on each of them: a
peer whose latest started ``dp`` collective is below N has not entered it. Point-to-point transfers
(``send``, ``recv``, ``batch_p2p``) differ between the ranks of a pipeline, so they are numbered apart
(axis ``pp:p2p``) and never compared. ``wait`` (the wait for async work) is recorded under its axis
without a number of its own: it finishes the collectives issued before it.

Cost: one lock, one small object and a deque append per collective; nothing when no recorder is set.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass


@dataclass
class Flight:
    seq: int | None  # per axis (p2p: per "axis:p2p"); None for a wait
    op: str
    axis: str
    nbytes: int
    ranks: tuple[int, ...]  # the group's global ranks
    start: float  # time.monotonic()
    start_wall: float  # time.time()
    end: float | None = None  # time.monotonic() when it returned (None: still in it)
    async_op: bool = False  # issued without waiting: it finishes at a later `wait`
    peer: int | None = None  # point-to-point: the group rank of the peer

    def state(self, now: float) -> str:
        if self.end is not None:
            return f"done in {self.end - self.start:.4f} s"
        if self.async_op:
            return "issued (async)"
        return f"IN FLIGHT for {now - self.start:.1f} s"

    def line(self, now: float) -> str:
        seq = "" if self.seq is None else f" #{self.seq}"
        peer = "" if self.peer is None else f" peer {self.peer}"
        return (f"{self.op}{seq} over {self.axis} (ranks {list(self.ranks)}){peer}, {self.nbytes} bytes, "
                f"started {now - self.start:.2f} s ago: {self.state(now)}")


P2P_OPS = ("send", "recv", "batch_p2p")


class FlightRecorder:
    """A ring of the last ``capacity`` :class:`Flight` records, with per-axis counters of collectives
    started and finished. Written by the training thread, read by the watchdog's (under one lock)."""

    def __init__(self, capacity: int = 64):
        if capacity < 1:
            raise ValueError(f"flight recorder capacity={capacity} must be >= 1 (fault.flight_records)")
        self.capacity = capacity
        self._ring: collections.deque[Flight] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.started: dict[str, int] = {}  # axis -> the last collective number started
        self.done: dict[str, int] = {}  # axis -> the last collective number finished
        self.last_progress = time.monotonic()  # the last time a call finished (the comm heartbeat)

    def start(self, op: str, group, nbytes: int, *, async_op: bool = False, peer: int | None = None) -> Flight:
        axis = getattr(group, "flight_axis", group.axis)  # a second communicator over an axis counts apart
        key = f"{axis}:p2p" if op in P2P_OPS else axis
        with self._lock:
            seq = None
            if op != "wait":
                seq = self.started.get(key, 0) + 1
                self.started[key] = seq
            f = Flight(seq=seq, op=op, axis=axis, nbytes=int(nbytes), ranks=group.ranks,
                       start=time.monotonic(), start_wall=time.time(), async_op=async_op, peer=peer)
            self._ring.append(f)
        return f

    def finish(self, f: Flight) -> None:
        """``f`` returned (a blocking call), or its async work was waited on."""
        now = time.monotonic()
        with self._lock:
            f.end = now
            if f.seq is not None:
                key = f"{f.axis}:p2p" if f.op in P2P_OPS else f.axis
                self.done[key] = max(self.done.get(key, 0), f.seq)
            self.last_progress = now

    def finish_async(self, axis: str) -> None:
        """A ``wait`` over ``axis`` returned: every async call issued before it on that axis is done."""
        now = time.monotonic()
        with self._lock:
            for f in self._ring:
                if f.async_op and f.end is None and f.axis == axis:
                    f.end = now
                    if f.seq is not None and f.op not in P2P_OPS:
                        self.done[axis] = max(self.done.get(axis, 0), f.seq)
            self.last_progress = now

    def snapshot(self) -> tuple[list[Flight], dict[str, int], dict[str, int], float]:
        """(records oldest first, started, done, last_progress), copied under the lock."""
        with self._lock:
            return list(self._ring), dict(self.started), dict(self.done), self.last_progress

    def in_flight(self) -> Flight | None:
        """The newest record that has not finished and is not async work still to be waited on."""
        with self._lock:
            for f in reversed(self._ring):
                if f.end is None and not f.async_op:
                    return f
        return None
