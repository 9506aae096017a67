"""Every collective and point-to-point transfer Tessel makes, with a per-rank byte ledger.

All communication goes through this module so that it is visible and countable. A :class:`Group`
wraps one torch process group together with the name of the mesh axis it spans (``"tp"``,
``"dp"``, ...) and the :class:`Ledger` of the process. Each call adds a :class:`CommRecord` to the
ledger's per-(op, axis) totals (and to any open :meth:`Ledger.capture`).

Cost model (per rank, bytes; ``p`` = group size, ``N`` = bytes of the tensor passed in):

=================  ===========================  =====================================
op                 sent                         received
=================  ===========================  =====================================
all_reduce         2 (p-1) N / p                2 (p-1) N / p        (ring: RS + AG)
all_gather         (p-1) N      (N = shard)     (p-1) N
reduce_scatter     (p-1) N / p  (N = full)      (p-1) N / p
all_to_all         N - own chunk                output bytes - own chunk
broadcast          N unless last in the ring    N unless the source
send / recv        N / 0                        0 / N
=================  ===========================  =====================================

These are the bandwidth terms of the ring algorithms (Patarasuk & Yuan; NCCL's "bus bandwidth").
Groups of size 1 never communicate and record nothing. ``payload_bytes`` is always ``N``.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist


CLOCKS = ("wall", "cuda")  # how a Ledger times blocked communication (Ledger.__init__)


@dataclass(frozen=True)
class CommRecord:
    op: str
    axis: str
    group_size: int
    payload_bytes: int
    sent_bytes: float
    recv_bytes: float
    dtype: str


class Records:
    """A list of :class:`CommRecord` with queries; what :meth:`Ledger.capture` yields."""

    def __init__(self, records: list[CommRecord] | None = None):
        self.records: list[CommRecord] = records if records is not None else []

    def select(self, *, op: str | None = None, axis: str | None = None) -> list[CommRecord]:
        return [r for r in self.records
                if (op is None or r.op == op) and (axis is None or r.axis == axis)]

    def total(self, what: str = "sent_bytes", *, op: str | None = None, axis: str | None = None) -> float:
        """Sum of ``what`` ("sent_bytes", "recv_bytes" or "payload_bytes") over matching records."""
        _check_what(what)
        return sum(getattr(r, what) for r in self.select(op=op, axis=axis))

    def count(self, *, op: str | None = None, axis: str | None = None) -> int:
        return len(self.select(op=op, axis=axis))

    def summary(self) -> dict[str, dict[str, float]]:
        """{"op@axis": {"calls", "payload_bytes", "sent_bytes", "recv_bytes"}}."""
        out: dict[str, dict[str, float]] = {}
        for r in self.records:
            _accumulate(out.setdefault(f"{r.op}@{r.axis}", _zero_totals()), r)
        return out


def _check_what(what: str) -> None:
    if what not in ("sent_bytes", "recv_bytes", "payload_bytes"):
        raise ValueError(f"what={what!r}: use 'sent_bytes', 'recv_bytes' or 'payload_bytes'")


def _zero_totals() -> dict[str, float]:
    return {"calls": 0, "payload_bytes": 0, "sent_bytes": 0.0, "recv_bytes": 0.0}


def _accumulate(d: dict[str, float], r: CommRecord) -> None:
    d["calls"] += 1
    d["payload_bytes"] += r.payload_bytes
    d["sent_bytes"] += r.sent_bytes
    d["recv_bytes"] += r.recv_bytes


class Ledger:
    """This rank's communication, in constant memory. Owned by the mesh; one per process.

    It keeps running totals per (op, axis) -- calls, payload, sent and received bytes -- however
    long the run, so a million steps cost no more host memory than one. Individual records are
    kept only inside a :meth:`capture` block (tests, and anything that needs the order of calls).
    """

    # How many CUDA event pairs may wait to be read before those already finished are read on the spot
    # (without waiting for the GPU), so that a caller that never reads ``blocked_s`` does not grow the list
    # without bound.
    MAX_PENDING_SPANS = 4096

    def __init__(self, *, enabled: bool = True, clock: str = "wall", event_factory=None):
        if clock not in CLOCKS:
            raise ValueError(f"Ledger clock={clock!r} unknown; use one of {CLOCKS} ('cuda' for NCCL groups, "
                             "whose collectives run on CUDA streams, 'wall' otherwise)")
        self.enabled = enabled
        self._totals: dict[tuple[str, str], dict[str, float]] = {}
        self._captures: list[Records] = []
        # Exposed communication: seconds in which the rank's compute waited for communication (nothing was
        # computed under it), per axis. The trainer logs its per-step delta as comm_exposed_s.
        #   clock "wall": the host thread's wall time inside each synchronous collective and each wait.
        #     Exact for a one-thread CPU rank (gloo), where the thread is the compute.
        #   clock "cuda": a CUDA event on the current (compute) stream before and after each synchronous
        #     collective and each wait. NCCL runs on its own stream and a wait makes the compute stream
        #     wait for it without blocking the host, so host time says nothing there. The time between
        #     the two events is how long the compute stream stood still for the communication: what was
        #     queued before it (the compute it overlapped) has already run when the first event fires.
        #     The pairs are read in :meth:`settle`, after the step's own synchronisation.
        self.clock = clock
        self._blocked: dict[str, float] = {}
        self._spans: list[tuple[str, object, object]] = []  # (axis, start event, stop event), not yet read
        self._event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        # The flight recorder (parallel/flight.py) of the hang watchdog, when one is armed: every call over
        # a group of more than one rank is started and finished in it. None: nothing is recorded.
        self.recorder = None

    def add_blocked(self, axis: str, seconds: float) -> None:
        if self.enabled:
            self._blocked[axis] = self._blocked.get(axis, 0.0) + seconds

    def span_start(self):
        """Mark the start of a blocked span: a host time (clock "wall") or a CUDA event recorded on the
        current stream (clock "cuda"). Pass the result to :meth:`span_stop`."""
        if self.clock == "wall":
            return time.perf_counter()
        if not self.enabled:
            return None
        start = self._event()
        start.record()
        return start

    def span_stop(self, axis: str, start) -> None:
        """End the blocked span begun by :meth:`span_start` and add it to ``axis``."""
        if self.clock == "wall":
            self.add_blocked(axis, time.perf_counter() - start)
            return
        if start is None:  # begun while the ledger was disabled
            return
        stop = self._event()
        stop.record()
        self._spans.append((axis, start, stop))
        if len(self._spans) >= self.MAX_PENDING_SPANS:
            self._read_finished()

    def _read_finished(self) -> None:
        """Read the oldest spans whose stop event has fired, without waiting for the GPU (this runs in the
        middle of a step, where a synchronisation would drain the queue the host has built up)."""
        done = 0
        for _, _, stop in self._spans:
            if not stop.query():
                break
            done += 1
        spans, self._spans = self._spans[:done], self._spans[done:]
        for axis, start, stop in spans:
            self.add_blocked(axis, start.elapsed_time(stop) / 1e3)  # elapsed_time is in milliseconds

    def settle(self) -> None:
        """Read the CUDA event pairs recorded so far into ``blocked_s`` (clock "cuda"), waiting for each stop
        event: after the step's loss has reached the host they have all fired, so this costs nothing. A
        no-op for clock "wall"."""
        spans, self._spans = self._spans, []
        for axis, start, stop in spans:
            stop.synchronize()
            self.add_blocked(axis, start.elapsed_time(stop) / 1e3)

    @property
    def blocked_s(self) -> dict[str, float]:
        """{axis: seconds blocked in communication} since the start (or reset), a copy; reading it settles
        the pending CUDA spans first."""
        self.settle()
        return dict(self._blocked)

    def exposed_seconds(self) -> float:
        """Total blocked seconds since the start (or reset), all axes."""
        return sum(self.blocked_s.values())

    def add(self, rec: CommRecord) -> None:
        if not self.enabled:
            return
        _accumulate(self._totals.setdefault((rec.op, rec.axis), _zero_totals()), rec)
        for view in self._captures:
            view.records.append(rec)

    def reset(self) -> None:
        """Zero the running totals (open captures keep their records)."""
        self._totals.clear()
        self._spans.clear()
        self._blocked.clear()

    def _matching(self, op: str | None, axis: str | None):
        return [d for (o, a), d in self._totals.items() if (op is None or o == op) and (axis is None or a == axis)]

    def total(self, what: str = "sent_bytes", *, op: str | None = None, axis: str | None = None) -> float:
        """Sum of ``what`` ("sent_bytes", "recv_bytes" or "payload_bytes") since the start (or reset)."""
        _check_what(what)
        return sum(d[what] for d in self._matching(op, axis))

    def count(self, *, op: str | None = None, axis: str | None = None) -> int:
        """Number of calls since the start (or reset)."""
        return int(sum(d["calls"] for d in self._matching(op, axis)))

    def by_axis(self, what: str = "sent_bytes") -> dict[str, float]:
        """{axis: total ``what``} since the start: the per-step ``comm_bytes_<axis>`` metrics are its deltas."""
        _check_what(what)
        out: dict[str, float] = {}
        for (_, axis), d in self._totals.items():
            out[axis] = out.get(axis, 0.0) + d[what]
        return out

    def size(self) -> int:
        """How many (op, axis) counters the ledger holds (bounded by ops x axes)."""
        return len(self._totals)

    @contextlib.contextmanager
    def capture(self):
        """Yield a :class:`Records` that receives, in order, every record made inside the block."""
        view = Records()
        self._captures.append(view)
        try:
            yield view
        finally:
            self._captures.remove(view)

    def summary(self) -> dict[str, dict[str, float]]:
        """{"op@axis": {"calls", "payload_bytes", "sent_bytes", "recv_bytes"}} for logging."""
        return {f"{o}@{a}": dict(d) for (o, a), d in self._totals.items()}


class Group:
    """A process group over one mesh axis (or a combination such as ``"dp_cp"``).

    ``ranks`` are the global ranks in group order; ``rank`` is this process's index in it.
    A group of size 1 needs no torch process group (``pg=None``) and never communicates, so
    single-process code runs without ``torch.distributed`` being initialised.
    """

    def __init__(self, *, axis: str, ranks: Sequence[int], rank: int, pg, ledger: Ledger,
                 flight_axis: str | None = None):
        if rank not in range(len(ranks)):
            raise ValueError(f"group {axis}: rank {rank} not in 0..{len(ranks) - 1}")
        if len(ranks) > 1 and pg is None:
            raise ValueError(f"group {axis} of size {len(ranks)} needs a torch process group")
        self.axis = axis  # the ledger books its bytes and blocked time under it
        self.flight_axis = flight_axis or axis  # the flight recorder numbers its calls under it (parallel/flight.py)
        self.ranks = tuple(int(r) for r in ranks)
        self.rank = rank
        self.size = len(self.ranks)
        self.pg = pg
        self.ledger = ledger

    @classmethod
    def trivial(cls, axis: str, *, ledger: Ledger | None = None, global_rank: int = 0) -> "Group":
        """A size-1 group: every collective is the identity."""
        return cls(axis=axis, ranks=(global_rank,), rank=0, pg=None, ledger=ledger or Ledger())

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def __repr__(self) -> str:
        return f"Group({self.axis}, rank {self.rank}/{self.size}, ranks={list(self.ranks)})"


def as_group(group, *, axis: str, ledger: Ledger | None = None) -> Group:
    """``group`` as a Tessel :class:`Group`: a Group is returned as is; a torch ``ProcessGroup`` (e.g.
    from ``dist.new_group``) is wrapped under ``axis`` with its own ledger (or ``ledger``); ``None``
    is a size-1 group. Anything else is a ValueError naming what was passed."""
    if isinstance(group, Group):
        return group
    if group is None:
        return Group.trivial(axis, ledger=ledger)
    if isinstance(group, dist.ProcessGroup):
        if not dist.is_initialized():
            raise ValueError(f"{axis}_group is a torch ProcessGroup but torch.distributed is not initialised")
        ranks = dist.get_process_group_ranks(group)
        return Group(axis=axis, ranks=ranks, rank=dist.get_rank(group), pg=group if len(ranks) > 1 else None,
                     ledger=ledger if ledger is not None else Ledger())
    raise ValueError(f"{axis}_group={group!r} ({type(group).__name__}) is neither a parallel.comm.Group nor a "
                     "torch ProcessGroup; pass mesh.<axis> from parallel.mesh.Mesh.build, or dist.new_group(...)")


# torch >= 2.13 renamed the flat-tensor collectives; the GPU image (torch 2.11) has only the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _record(group: Group, op: str, payload: int, sent: float, recv: float, dtype) -> None:
    group.ledger.add(CommRecord(op=op, axis=group.axis, group_size=group.size, payload_bytes=payload,
                                sent_bytes=float(sent), recv_bytes=float(recv), dtype=str(dtype)))


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT}


def _reduce_op(op: str):
    try:
        return _REDUCE_OPS[op]
    except KeyError:
        raise ValueError(f"reduce op {op!r} unknown; use one of {sorted(_REDUCE_OPS)}") from None


def _blocking(fn):
    """Time a collective's call as blocked communication when it is synchronous (``async_op`` false), and
    start and finish it in the ledger's flight recorder when one is set (an async call finishes at its
    :func:`wait`)."""
    op = fn.__name__

    @functools.wraps(fn)
    def timed(t, group, *args, **kwargs):
        if group.size == 1:
            return fn(t, group, *args, **kwargs)
        recorder = group.ledger.recorder
        async_op = bool(kwargs.get("async_op"))
        flight = None if recorder is None else recorder.start(
            op, group, _nbytes(t), async_op=async_op,
            peer=kwargs.get("dst", kwargs.get("src")) if op in ("send", "recv") else None)
        if async_op:
            return fn(t, group, *args, **kwargs)
        t0 = group.ledger.span_start()
        try:
            out = fn(t, group, *args, **kwargs)
        finally:
            group.ledger.span_stop(group.axis, t0)
        if flight is not None:
            recorder.finish(flight)
        return out
    return timed


def wait(works, group: Group) -> None:
    """Wait for async work handles (one or a list), timing the wait as blocked communication."""
    works = works if isinstance(works, (list, tuple)) else [works]
    recorder = group.ledger.recorder if works and group.size > 1 else None
    flight = None if recorder is None else recorder.start("wait", group, 0)
    timed = bool(works) and group.size > 1
    t0 = group.ledger.span_start() if timed else None
    for w in works:
        w.wait()
    if timed:
        group.ledger.span_stop(group.axis, t0)
    if flight is not None:
        recorder.finish(flight)
        recorder.finish_async(group.flight_axis)


@contextlib.contextmanager
def fused(op: str, t: torch.Tensor, group: Group):
    """A collective that a fused kernel runs itself, inside the ``with`` block (PyTorch's symmetric-memory
    collective matmuls: parallel/tensor_parallel/symm_mem.py). ``op``: "all_gather" (``t`` = this rank's
    shard) or "reduce_scatter" (``t`` = the full tensor reduced). The ledger gets the cost model's bytes
    for ``op`` (the fused kernels move exactly those: each rank reads or writes the p - 1 other chunks) and
    the flight recorder sees the call. No blocked time is added: the kernel's transfers and waits run
    inside it, on its own streams, where no wait of Tessel's is visible."""
    if op not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"fused collective {op!r} unknown; use 'all_gather' or 'reduce_scatter'")
    # ``t`` may be a meta tensor: only its size and dtype are read.
    if group.size == 1:
        yield
        return
    p, n = group.size, _nbytes(t)
    moved = (p - 1) * n if op == "all_gather" else (p - 1) * n / p
    recorder = group.ledger.recorder
    flight = None if recorder is None else recorder.start(op, group, n)
    yield
    _record(group, op, n, moved, moved, t.dtype)
    if flight is not None:
        recorder.finish(flight)


class _Done:
    """Completed work handle for size-1 groups, so callers can always ``.wait()``."""

    def wait(self):
        return True

    def is_completed(self):
        return True


@_blocking
def all_reduce(t: torch.Tensor, group: Group, *, op: str = "sum", async_op: bool = False):
    """In-place all-reduce of ``t`` over ``group``. Returns a work handle if ``async_op``."""
    if group.size == 1:
        return _Done() if async_op else None
    rop = _reduce_op(op)
    if op == "avg" and dist.get_backend(group.pg) == "gloo":
        # gloo has no AVG: sum then divide (same bytes on the wire).
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group.pg, async_op=async_op)
        if async_op:
            work.wait()
        t.div_(group.size)
        work = _Done() if async_op else None
    else:
        work = dist.all_reduce(t, op=rop, group=group.pg, async_op=async_op)
    n = _nbytes(t)
    p = group.size
    _record(group, "all_reduce", n, 2 * (p - 1) * n / p, 2 * (p - 1) * n / p, t.dtype)
    return work


def average_at(t: torch.Tensor, idx: torch.Tensor | slice, group: Group) -> None:
    """Replace ``t[idx]`` by its mean over ``group`` (a sum all-reduce, then a division: the same bits on every
    backend), e.g. elements of parameter copies that must stay equal after a compression that is not
    elementwise. ``idx``: an index tensor, or a ``slice`` of a 1-D ``t`` (reduced in place, no copy)."""
    if isinstance(idx, slice):
        vals = t[idx]  # a contiguous view
        all_reduce(vals, group)
        vals.div_(group.size)
        return
    vals = t[idx]
    all_reduce(vals, group)
    t[idx] = vals.div_(group.size)


@_blocking
def all_gather(t: torch.Tensor, group: Group, *, dim: int = 0, async_op: bool = False,
               out: torch.Tensor | None = None):
    """Concatenate every rank's ``t`` along ``dim`` (rank order). Returns the gathered tensor.

    With ``async_op`` returns ``(tensor, work)``; the tensor is valid after ``work.wait()``
    (only ``dim=0`` supports async). ``out`` (``dim=0`` only): a contiguous tensor of the gathered
    shape and ``t``'s dtype to write into (ZeRO-3 gathers into storage that parameters view).
    """
    if out is not None:
        want = (t.shape[0] * group.size, *t.shape[1:])
        if dim % max(t.dim(), 1) != 0 or tuple(out.shape) != want or out.dtype != t.dtype or not out.is_contiguous():
            raise ValueError(f"all_gather(out=...) needs dim=0 and a contiguous {t.dtype} tensor of shape {want}; "
                             f"got dim={dim}, {tuple(out.shape)} {out.dtype}")
    if group.size == 1:
        if out is not None:
            out.copy_(t)
            t = out
        return (t, _Done()) if async_op else t
    p = group.size
    t = t.contiguous()
    n = _nbytes(t)
    dim = dim % t.dim()
    out_shape = list(t.shape)
    out_shape[0] *= p
    if dim == 0:
        if out is None:
            out = torch.empty(out_shape, dtype=t.dtype, device=t.device)
        work = _all_gather_flat(out, t, group=group.pg, async_op=async_op)
        _record(group, "all_gather", n, (p - 1) * n, (p - 1) * n, t.dtype)
        return (out, work) if async_op else out
    if async_op:
        raise ValueError("all_gather(async_op=True) supports dim=0 only; gather dim 0 and move the dim after wait()")
    # Gather along dim 0 (contiguous, one call), then move rank chunks to `dim`.
    flat = torch.empty(out_shape, dtype=t.dtype, device=t.device)  # (p*d0, ...)
    _all_gather_flat(flat, t, group=group.pg)
    _record(group, "all_gather", n, (p - 1) * n, (p - 1) * n, t.dtype)
    return torch.cat(flat.chunk(p, dim=0), dim=dim)


@_blocking
def reduce_scatter(t: torch.Tensor, group: Group, *, dim: int = 0, op: str = "sum", async_op: bool = False):
    """Reduce ``t`` over ``group`` and return this rank's 1/p slice along ``dim``.

    ``t.shape[dim]`` must be divisible by the group size. With ``async_op`` returns ``(tensor, work)``
    (``dim=0`` only).
    """
    if group.size == 1:
        return (t, _Done()) if async_op else t
    p = group.size
    dim = dim % t.dim()
    if t.shape[dim] % p:
        raise ValueError(f"reduce_scatter over {group.axis}: dim {dim} of size {t.shape[dim]} "
                         f"is not divisible by the group size {p}")
    if dim != 0:
        if async_op:
            raise ValueError("reduce_scatter(async_op=True) supports dim=0 only")
        # Stack the p chunks along dim 0: (p*d0, ..., D/p, ...); rank r's result is then block r,
        # which already has the per-rank shape (d0, ..., D/p, ...).
        t = torch.cat(t.chunk(p, dim=dim), dim=0)
    t = t.contiguous()
    n = _nbytes(t)
    out_shape = list(t.shape)
    out_shape[0] //= p
    out = torch.empty(out_shape, dtype=t.dtype, device=t.device)
    work = _reduce_scatter_flat(out, t, op=_reduce_op(op), group=group.pg, async_op=async_op)
    _record(group, "reduce_scatter", n, (p - 1) * n / p, (p - 1) * n / p, t.dtype)
    return (out, work) if async_op else out


@_blocking
def all_to_all(t: torch.Tensor, group: Group, *, output_split_sizes: list[int] | None = None,
               input_split_sizes: list[int] | None = None, async_op: bool = False):
    """All-to-all along dim 0. Equal splits by default (dim 0 divisible by p). Returns the output."""
    if group.size == 1:
        return (t, _Done()) if async_op else t
    p = group.size
    t = t.contiguous()
    if input_split_sizes is None:
        if t.shape[0] % p:
            raise ValueError(f"all_to_all over {group.axis}: dim 0 of size {t.shape[0]} not divisible by {p}; "
                             "pass input_split_sizes/output_split_sizes")
        in_splits = [t.shape[0] // p] * p
    else:
        in_splits = list(input_split_sizes)
    out_splits = list(output_split_sizes) if output_split_sizes is not None else list(in_splits)
    if len(in_splits) != p or len(out_splits) != p:
        raise ValueError(f"all_to_all over {group.axis}: split sizes need {p} entries")
    out = torch.empty([sum(out_splits), *t.shape[1:]], dtype=t.dtype, device=t.device)
    work = dist.all_to_all_single(out, t, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group.pg, async_op=async_op)
    inner = t.element_size() * math.prod(t.shape[1:])  # bytes per dim-0 row
    me = group.rank
    sent = (sum(in_splits) - in_splits[me]) * inner
    recv = (sum(out_splits) - out_splits[me]) * inner
    _record(group, "all_to_all", _nbytes(t), sent, recv, t.dtype)
    return (out, work) if async_op else out


@_blocking
def broadcast(t: torch.Tensor, group: Group, *, src: int = 0, async_op: bool = False):
    """In-place broadcast from group rank ``src``."""
    if group.size == 1:
        return _Done() if async_op else None
    if src not in range(group.size):
        raise ValueError(f"broadcast over {group.axis}: src={src} not in 0..{group.size - 1}")
    work = dist.broadcast(t, src=group.global_rank(src), group=group.pg, async_op=async_op)
    n = _nbytes(t)
    p = group.size
    pos = (group.rank - src) % p  # position in the ring starting at src
    _record(group, "broadcast", n, n if pos != p - 1 else 0, n if pos != 0 else 0, t.dtype)
    return work


@_blocking
def send(t: torch.Tensor, group: Group, *, dst: int) -> None:
    """Blocking send to group rank ``dst``."""
    _check_peer(group, dst, "dst")
    dist.send(t.contiguous(), dst=group.global_rank(dst), group=group.pg)
    _record(group, "send", _nbytes(t), _nbytes(t), 0, t.dtype)


@_blocking
def recv(t: torch.Tensor, group: Group, *, src: int) -> torch.Tensor:
    """Blocking receive into ``t`` from group rank ``src``; returns ``t``."""
    _check_peer(group, src, "src")
    dist.recv(t, src=group.global_rank(src), group=group.pg)
    _record(group, "recv", _nbytes(t), 0, _nbytes(t), t.dtype)
    return t


@dataclass(frozen=True)
class P2P:
    """One point-to-point operation for :func:`batch_p2p`: ``kind`` is "send" or "recv"."""

    kind: str
    tensor: torch.Tensor
    peer: int  # group rank


def batch_p2p(ops: Iterable[P2P], group: Group) -> list:
    """Launch sends/receives together (``batch_isend_irecv``); returns the work handles to wait on."""
    ops = list(ops)
    if not ops:
        return []
    p2p = []
    for o in ops:
        _check_peer(group, o.peer, "peer")
        if o.kind == "send":
            p2p.append(dist.P2POp(dist.isend, o.tensor, group.global_rank(o.peer), group=group.pg))
            _record(group, "send", _nbytes(o.tensor), _nbytes(o.tensor), 0, o.tensor.dtype)
        elif o.kind == "recv":
            p2p.append(dist.P2POp(dist.irecv, o.tensor, group.global_rank(o.peer), group=group.pg))
            _record(group, "recv", _nbytes(o.tensor), 0, _nbytes(o.tensor), o.tensor.dtype)
        else:
            raise ValueError(f"P2P kind {o.kind!r}: use 'send' or 'recv'")
    recorder = group.ledger.recorder
    if recorder is not None:
        recorder.start("batch_p2p", group, sum(_nbytes(o.tensor) for o in ops), async_op=True,
                       peer=ops[0].peer if len({o.peer for o in ops}) == 1 else None)
    return dist.batch_isend_irecv(p2p)


def _check_peer(group: Group, peer: int, name: str) -> None:
    if group.size == 1:
        raise ValueError(f"point-to-point over {group.axis}: the group has one rank, there is no peer")
    if peer not in range(group.size) or peer == group.rank:
        raise ValueError(f"point-to-point over {group.axis}: {name}={peer} must be another rank in "
                         f"0..{group.size - 1} (this rank is {group.rank})")


def barrier(group: Group) -> None:
    if group.size > 1:
        recorder = group.ledger.recorder
        flight = None if recorder is None else recorder.start("barrier", group, 0)
        dist.barrier(group=group.pg)
        if flight is not None:
            recorder.finish(flight)
