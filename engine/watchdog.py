"""The hang watchdog (``fault.hang_timeout_s``): a thread per rank that ends a job which stopped progressing.

Progress is a heartbeat: the trainer beats after every step (:meth:`Watchdog.beat`) and every collective
that finishes beats too (the flight recorder's ``last_progress``, parallel/flight.py). The clock starts
when the first step has finished (it compiles, initialises lazily and measures memory: it may take far
longer than any later step; before it only ``fault.collective_timeout_s`` applies). When neither beat has
happened for ``hang_timeout_s`` -- a step or a collective that takes longer than that -- the rank

1. writes ``RUN_DIR/hang/rank<R>.txt``: the reason, the collective it is stuck in, the peers of that
   collective that made no progress, its last ``fault.flight_records`` collectives and the Python stacks
   of all its threads (``faulthandler``);
2. creates ``RUN_DIR/hang/HANG``, which makes every other live rank write its own file at its next tick
   (whatever it is doing: a rank blocked in the same collective would otherwise be torn down by the
   first one's exit before its own timeout), and waits (a few ticks) for them;
3. SIGKILLs the peers on its host that are stopped (state ``T``) children of its own launcher: they can
   never report, and torchrun would wait 30 s for them to answer its SIGTERM before doing the same;
4. prints one line naming the stuck collective and the ranks that did not progress, and leaves with
   ``os._exit(EXIT_HUNG)``, so torchrun or Slurm sees a failed job and can restart it.

Peers are named from side files: every tick each rank writes ``RUN_DIR/hang/progress.rank<R>.json`` (its
pid, host, step, the time, and its per-axis counts of collectives started and finished). A peer whose
count for the stuck collective's axis is below the stuck one's number has not entered it; a peer whose
file stopped changing (``stale_s``) is stopped, dead or wedged. Without a run directory the report goes
to stderr and peers are not named.

The thread needs the GIL: a rank wedged in C code that holds it is not caught (gloo and NCCL waits
release it). docs/fault_tolerance.md says what was tested and measured.
"""
from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from engine.fault import EXIT_HUNG
from parallel.flight import Flight, FlightRecorder

MARKER = "HANG"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Watchdog:
    """One rank's watchdog. ``recorder``: the mesh ledger's flight recorder; ``rank``/``world_size``: global;
    ``run_dir``: where ``hang/`` goes (None: stderr only). ``interval_s``: how often the thread looks and
    writes its progress file (default ``timeout/10``, within 0.2-10 s). ``exit``: what ends the process (tests
    replace ``os._exit``)."""

    def __init__(self, *, recorder: FlightRecorder, rank: int, world_size: int, timeout_s: float,
                 run_dir: str | None, interval_s: float | None = None, exit=os._exit):
        if not timeout_s > 0:
            raise ValueError(f"hang timeout {timeout_s} must be > 0 (fault.hang_timeout_s)")
        self.recorder = recorder
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        # A tick: look, and write the progress file (one small file per rank per tick on the shared run
        # directory: at most 5 per second, at least one per 10 s).
        self.interval_s = interval_s if interval_s is not None else min(10.0, max(0.2, self.timeout_s / 10))
        self.stale_s = max(2.0, 4 * self.interval_s)  # a peer's progress file older than this: not alive
        self.dir = Path(run_dir, "hang") if run_dir else None
        self._exit = exit
        self._last_beat = time.monotonic()
        self.step: int | None = None  # the last step finished; None: the clock has not started
        self._started_wall = time.time()
        self._stop = threading.Event()
        self._reported = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: str | None = None  # the report's line, once it fired

    # -- the training thread's side -------------------------------------------------------------------
    def beat(self, step: int | None = None) -> None:
        self._last_beat = time.monotonic()
        if step is not None:
            self.step = step

    def start(self) -> "Watchdog":
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
        self._started_wall = time.time()
        self.beat()
        self._write_progress()  # peers can tell this rank apart from one that never started
        self._thread = threading.Thread(target=self._run, name=f"tessel-watchdog-rank{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        atexit.unregister(self._exit_after_report)  # registered when it fired (a test's exit did not exit)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- the watchdog thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write_progress()
                reason = self.check()
                if reason is None:
                    reason = self._peer_marker()
                if reason is not None and not self._stop.is_set():
                    self._fire(reason)
                    return
            except Exception as e:  # noqa: BLE001 - the watchdog must never kill a healthy run itself
                print(f"tessel: watchdog on rank {self.rank}: {type(e).__name__}: {e}", file=sys.stderr)

    def idle_s(self) -> float:
        """Seconds since the last heartbeat (a step or a finished collective)."""
        return time.monotonic() - max(self._last_beat, self.recorder.last_progress)

    def check(self) -> str | None:
        """The reason to fire, or None: nothing progressed for ``timeout_s``."""
        idle = self.idle_s()
        if self.step is None or idle < self.timeout_s:
            return None
        stuck = self.recorder.in_flight()
        what = "a collective" if stuck is not None else "a step"
        return (f"{what} exceeded fault.hang_timeout_s={self.timeout_s:g}: nothing progressed on rank "
                f"{self.rank} for {idle:.1f} s")

    def _peer_marker(self) -> str | None:
        if self.dir is None:
            return None
        marker = self.dir / MARKER
        try:
            if marker.stat().st_mtime < self._started_wall - 1.0:
                return None  # left by an earlier attempt of the job
            return f"another rank found a hang ({marker.read_text().strip()})"
        except OSError:
            return None

    def _write_progress(self) -> None:
        if self.dir is None:
            return
        _, started, done, last = self.recorder.snapshot()
        now = time.monotonic()
        state = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
                 "idle_s": round(now - max(self._last_beat, last), 3), "step": self.step,
                 "started": started, "done": done}
        _atomic_write(self.dir / f"progress.rank{self.rank}.json", json.dumps(state))

    def peers(self, stuck: Flight | None) -> tuple[list[str], list[str]]:
        """The ranks of the stuck collective's group (else of the world), each with why: (not responding:
        no fresh progress file; behind: alive, but they have not entered the stuck collective -- still in an
        earlier one, which the ranks not responding may block too)."""
        if self.dir is None:
            return [], []
        ranks = stuck.ranks if stuck is not None else tuple(range(self.world_size))
        key = None
        if stuck is not None:
            key = f"{stuck.axis}:p2p" if stuck.op in ("send", "recv", "batch_p2p") else stuck.axis
        mine = self.recorder.snapshot()[1].get(key, 0) if key else 0
        out, behind = [], []
        for r in ranks:
            if r == self.rank:
                continue
            why = []
            try:
                st = json.loads((self.dir / f"progress.rank{r}.json").read_text())
            except (OSError, ValueError):
                out.append(f"rank {r} (no progress file: it never started its watchdog, or died)")
                continue
            age = time.time() - st["time"]
            theirs = st["started"].get(key, 0) if key else 0
            compared = key is not None and not key.endswith(":p2p")  # collectives run in one order on every rank
            if st["time"] < self._started_wall - 1.0:
                why.append("its progress file is from an earlier attempt")
            elif age > self.stale_s:
                why.append(f"no heartbeat for {age:.1f} s: stopped, dead or wedged (pid {st['pid']} on {st['host']})"
                           + (f"; its last report had started {key} collective #{theirs}" if compared else ""))
            elif compared and theirs < mine:
                behind.append(f"rank {r} (has not entered {key} collective #{mine}: its last started is #{theirs})")
            if why:
                out.append(f"rank {r} ({'; '.join(why)})")
        return out, behind

    def report(self, reason: str) -> tuple[str, str]:
        """(the hang report's text without the stacks, the one-line summary)."""
        records, started, done, _ = self.recorder.snapshot()
        now = time.monotonic()
        stuck = self.recorder.in_flight()
        peers, behind = self.peers(stuck)
        where = (f"stuck in {stuck.op}{'' if stuck.seq is None else ' #' + str(stuck.seq)} over {stuck.axis} "
                 f"(ranks {list(stuck.ranks)}) for {now - stuck.start:.1f} s" if stuck is not None
                 else "in no collective")
        who = ("; not responding: " + ", ".join(peers) if peers else "") + ("; behind: " + ", ".join(behind)
                                                                             if behind else "")
        line = f"tessel: hang on rank {self.rank} at step {self.step}: {reason}; {where}{who}"
        lines = [f"tessel hang report: rank {self.rank} of {self.world_size}, pid {os.getpid()} on "
                 f"{socket.gethostname()}, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
                 f"reason: {reason}", f"last step finished: {self.step}", where,
                 "peers not responding: " + ("; ".join(peers) if peers else "none seen"),
                 "peers behind (alive, not in this collective yet): " + ("; ".join(behind) if behind else "none"),
                 f"collectives started per axis: {started}", f"collectives finished per axis: {done}",
                 f"flight records (last {len(records)} of at most {self.recorder.capacity}, oldest first):"]
        lines += [f"  {f.line(now)}" for f in records]
        return "\n".join(lines) + "\n\nPython stacks (all threads):\n", line

    def _exit_after_report(self) -> None:
        """At interpreter exit (the training thread ended: typically a collective failed because a peer that
        already reported exited first): finish the report, then leave with the watchdog's status."""
        self._reported.wait(timeout=30)
        self._exit(EXIT_HUNG)

    def _fire(self, reason: str) -> None:
        atexit.register(self._exit_after_report)
        text, line = self.report(reason)
        path = None
        if self.dir is not None:
            path = self.dir / f"rank{self.rank}.txt"
            tmp = path.with_name(f".{path.name}.tmp")  # renamed when complete: peers wait for the name
            with open(tmp, "w") as f:
                f.write(text)
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            os.replace(tmp, path)
            marker = self.dir / MARKER
            if not marker.exists() or marker.stat().st_mtime < self._started_wall - 1.0:
                _atomic_write(marker, f"rank {self.rank}: {reason}")
            self._wait_for_peers()
            killed = self._end_stopped_siblings()
            if killed:
                line += f"; SIGKILLed the stopped {', '.join(killed)} so that the launcher ends the job now"
                with open(path, "a") as f:
                    f.write(f"\nafter this report: SIGKILLed the stopped {', '.join(killed)} (same host and launcher)\n")
        else:
            sys.stderr.write(text)
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self.fired = line + (f"; stacks and flight records in {path}" if path else "") + f"; exiting ({EXIT_HUNG})"
        print(self.fired, file=sys.stderr, flush=True)
        sys.stdout.flush()
        self._reported.set()
        self._exit(EXIT_HUNG)

    def _end_stopped_siblings(self) -> list[str]:
        """SIGKILL the peers that are stopped (Linux state ``T``, e.g. SIGSTOP) children of this rank's own
        parent on this host -- workers of the same launcher that can never report. The launcher would kill
        them anyway once this rank exits, but torchrun first waits 30 s for a stopped worker to answer its
        SIGTERM. Anything else (another host, another parent, a running or dead process) is left alone."""
        host, parent, out = socket.gethostname(), os.getppid(), []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            try:
                st = json.loads((self.dir / f"progress.rank{r}.json").read_text())
                if st["host"] != host or st["time"] < self._started_wall - 1.0:
                    continue
                with open(f"/proc/{int(st['pid'])}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
                if fields[0] in ("T", "t") and int(fields[1]) == parent:
                    os.kill(int(st["pid"]), signal.SIGKILL)
                    out.append(f"rank {r} (pid {st['pid']})")
            except (OSError, ValueError, KeyError, IndexError):
                continue
        return out

    def _wait_for_peers(self) -> None:
        """Until every peer whose progress file is fresh has written its report (a few ticks at most)."""
        deadline = time.monotonic() + 3 * self.interval_s + 2.0
        while time.monotonic() < deadline:
            waiting = []
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                try:
                    st = json.loads((self.dir / f"progress.rank{r}.json").read_text())
                except (OSError, ValueError):
                    continue
                alive = time.time() - st["time"] <= self.stale_s and st["time"] >= self._started_wall - 1.0
                report = self.dir / f"rank{r}.txt"
                if alive and not (report.exists() and report.stat().st_mtime >= self._started_wall):
                    waiting.append(r)
            if not waiting:
                return
            time.sleep(min(0.1, self.interval_s))
