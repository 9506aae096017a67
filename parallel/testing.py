"""Run a function on N ranks in spawned processes: the harness every distributed test uses.

``run_distributed(fn, world_size, *args, **kwargs)`` spawns ``world_size`` processes, initialises
``torch.distributed`` in each (gloo by default, ``file://`` rendezvous in a fresh temporary file),
calls ``fn(*args, **kwargs)`` and returns the per-rank results as a list indexed by rank.

* A child's exception is re-raised in the parent as :class:`DistributedError`, carrying the
  failing rank and its full traceback text; the other ranks are killed at once.
* After ``timeout`` seconds everything still alive is killed and :class:`DistributedTimeout`
  names the ranks that had not finished, so no test can hang CI.
* ``fn`` must be picklable by reference (a module-level function) and so must its arguments
  and return value.
* Ranks are forked from multiprocessing's forkserver, which imports torch, numpy and Tessel's packages
  once (on the first call, then reused by every later call of this process): a rank starts in a tenth
  of a second instead of spending about two CPU seconds re-importing torch, which dominated the suite's
  time on 2 cores. The server's environment is the one of its first use, so each rank takes the
  caller's current ``os.environ`` (and, like spawn, its working directory and ``sys.path``).
"""
from __future__ import annotations

import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


class DistributedError(RuntimeError):
    """A rank raised. ``rank`` and ``remote_traceback`` describe the first failure seen."""

    def __init__(self, rank: int, remote_traceback: str):
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")


class DistributedTimeout(TimeoutError):
    def __init__(self, timeout: float, pending: list[int]):
        self.pending = pending
        super().__init__(f"distributed run exceeded {timeout:.0f} s; ranks {pending} had not finished "
                         "and were killed")


# What the forkserver imports before forking any rank (an ImportError there is ignored: the rank imports it).
PRELOAD = ("torch", "torch.distributed", "numpy", "engine", "parallel", "models", "engine.assembly")


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (first call of this process)
    return ctx


def _child(rank: int, world_size: int, init_file: str, backend: str, threads: int, env: dict[str, str], fn, args,
           kwargs, results):
    import datetime

    os.environ.clear()
    os.environ.update(env)  # the caller's environment now, not the forkserver's at its start

    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(threads)
        dist.init_process_group(backend=backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=300))
    except BaseException:  # noqa: BLE001 - the rendezvous failed before ``fn`` ran: the parent may relaunch
        results.put((rank, "init_err", traceback.format_exc()))
        return
    try:
        out = fn(*args, **kwargs)
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        # Report before tearing the group down: peers notice the teardown and fail too, and the
        # parent should see the root cause first.
        results.put((rank, "err", traceback.format_exc()))
        return
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Plain pickle (bytes) rather than torch's shared-memory reductions: this process exits right
    # away, and a tensor shared by file descriptor would vanish before the parent reads it.
    results.put((rank, "ok", pickle.dumps(out)))


# Errors that are usually a consequence of another rank failing, not a root cause.
_SECONDARY = ("Connection closed by peer", "remote worker", "Connection reset by peer", "DistBackendError",
              "Broken pipe")


def _pick_root_cause(errors: list[tuple[int, str]]) -> tuple[int, str]:
    for rank, tb in errors:
        if not any(marker in tb for marker in _SECONDARY):
            return rank, tb
    return errors[0]


class _RendezvousFailed(Exception):
    """A rank's ``init_process_group`` failed: no rank has run the test function yet."""

    def __init__(self, rank: int, tb: str):
        super().__init__(rank, tb)
        self.rank, self.tb = rank, tb


RENDEZVOUS_ATTEMPTS = 2


def run_distributed(fn: Callable[..., Any], world_size: int, *args, timeout: float = 120.0,
                    backend: str = "gloo", threads_per_rank: int = 1, **kwargs) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the results by rank.

    gloo's rendezvous on localhost now and then fails with "connectFullMesh failed ... Connection closed
    by peer" before any rank has run ``fn`` (seen once in ~1,500 tests on the 2-core CI machine): then all
    ranks are stopped and the launch is repeated once with a fresh rendezvous file (said on stderr). A
    second failure, and every failure inside ``fn``, raises :class:`DistributedError` as before."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        try:
            return _launch(fn, world_size, args, kwargs, timeout=timeout, backend=backend,
                           threads_per_rank=threads_per_rank)
        except _RendezvousFailed as e:
            if attempt == RENDEZVOUS_ATTEMPTS:
                raise DistributedError(e.rank, f"process group initialisation failed {attempt} times (before "
                                               f"the test function ran); the last:\n{e.tb}") from None
            first_line = next((ln for ln in reversed(e.tb.strip().splitlines()) if ln.strip()), "")
            print(f"run_distributed: rank {e.rank}'s process group initialisation failed ({first_line.strip()}); "
                  "relaunching all ranks once", file=sys.stderr, flush=True)


def _launch(fn, world_size: int, args, kwargs, *, timeout: float, backend: str, threads_per_rank: int) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="tessel_rdzv_")
    os.close(fd)
    os.unlink(init_file)  # the file store creates it; a stale file would confuse the rendezvous
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_child, args=(rank, world_size, init_file, backend, threads_per_rank,
                                                 dict(os.environ), fn, args, kwargs, results), daemon=True)
            p.start()
            procs.append(p)
        done: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(done) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistributedTimeout(timeout, sorted(set(range(world_size)) - set(done)))
            try:
                rank, status, payload = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in done]
                if dead:
                    # A rank died without reporting (segfault, os._exit, SIGKILL): drain once more.
                    try:
                        rank, status, payload = results.get(timeout=1.0)
                    except queue.Empty:
                        r = dead[0]
                        raise DistributedError(r, f"process exited with code {procs[r].exitcode} "
                                                  "without reporting a result") from None
                else:
                    continue
            if status == "init_err":
                raise _RendezvousFailed(rank, payload)
            if status == "err":
                errors = [(rank, payload)]
                grace = time.monotonic() + 2.0  # collect near-simultaneous failures, report the root one
                while time.monotonic() < grace:
                    try:
                        r2, s2, p2 = results.get(timeout=0.2)
                    except queue.Empty:
                        continue
                    if s2 == "err":
                        errors.append((r2, p2))
                raise DistributedError(*_pick_root_cause(errors))
            done[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return [done[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
        if os.path.exists(init_file):
            os.unlink(init_file)
