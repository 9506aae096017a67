"""``logging.profile_steps = [start, end]``: a torch.profiler trace of those steps on every rank (docs/planner.md).

Written to ``<run_dir>/profile/``:

* ``trace_rank<r>.json``: the Chrome trace of steps ``start..end`` (inclusive; 1-based like the logged
  steps), CPU activity (and CUDA kernels on GPU). Beyond torch's own op ranges and c10d's collective
  ranges (``gloo:all_reduce``, ``nccl:all_gather``...), named ``record_function`` ranges (NVTX ranges too
  on CUDA) for every model chunk's forward and backward of every micro-batch (``chunk<c>.F<mb>``,
  ``chunk<c>.B<mb>``: the pipeline as it ran), every transformer layer's forward and backward
  (``layer<i>.forward``, ``layer<i>.backward``) and its attention and MLP (``layer<i>.attention``,
  ``layer<i>.mlp``), and each profiled step (``step<n>``).
* ``memory_rank<r>.json``: on CPU the allocator's statistics from the profiler's allocation events
  (peak and end above the window's start: engine/memory.py's ``cpu_allocation_peak``; the largest
  allocations by op); on CUDA ``torch.cuda.memory_stats()`` and the allocator's history
  (``torch.cuda.memory._snapshot()``, as JSON: trace entries with sizes and stack frames).

The ranges come from module hooks installed for the window only and removed after it (the model's code
does not change); tools/timeline.py merges the ranks' traces into one picture beside the simulator's.
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings

import torch

from engine.memory import quiet_stderr


def _layers(chunk) -> list:
    return [m for m in chunk.modules() if getattr(m, "layer_number", None) is not None and hasattr(m, "attention")]


def _chunk_ranges(chunks) -> list:
    """(module, forward name, backward name, counter key) of every chunk, layer, attention and MLP."""
    out = []
    for c, chunk in enumerate(chunks):
        out.append((chunk, f"chunk{c}.F", f"chunk{c}.B", ("chunk", c)))
        for mod in _layers(chunk):
            n = mod.layer_number
            out.append((mod, f"layer{n}.forward", f"layer{n}.backward", None))
            out.append((mod.attention, f"layer{n}.attention", None, None))
            if hasattr(mod, "mlp"):
                out.append((mod.mlp, f"layer{n}.mlp", None, None))
    return out


class _Ranges:
    """Forward and backward hooks that open and close named ranges (record_function; NVTX on CUDA)."""

    def __init__(self, chunks, *, cuda: bool):
        self.cuda = cuda
        self.handles = []
        self.counts: dict = {}
        self.open: dict = {}
        for mod, fwd, bwd, counter in _chunk_ranges(chunks):
            self.handles.append(mod.register_forward_pre_hook(self._enter(mod, fwd, counter, "F")))
            self.handles.append(mod.register_forward_hook(self._exit(mod, "F")))
            if bwd is not None:
                self.handles.append(mod.register_full_backward_pre_hook(self._enter(mod, bwd, counter, "B")))
                if counter is None:
                    self.handles.append(mod.register_full_backward_hook(self._exit(mod, "B")))
        for chunk in chunks:
            # A chunk's backward ends when the gradient of its input is made; the first stage's input is token
            # ids (no gradient: the hook would never fire), so there its first layer's input stands in
            # (registered after that layer's own hooks: the ranges nest).
            layers = _layers(chunk)
            end = layers[0] if getattr(chunk, "pre_process", False) and layers else chunk
            self.handles.append(end.register_full_backward_hook(self._exit(chunk, "B")))

    def _enter(self, mod, name, counter, kind):
        def hook(*_):
            if counter is not None:  # the k-th forward (backward) of a chunk in a step is micro-batch k
                key = (counter, kind)
                k = self.counts.get(key, 0)
                self.counts[key] = k + 1
                label = f"{name}{k}"
            else:
                label = name
            if self.cuda:
                torch.cuda.nvtx.range_push(label)
            rf = torch.autograd.profiler.record_function(label)
            rf.__enter__()
            self.open.setdefault((id(mod), kind), []).append(rf)
        return hook

    def _exit(self, mod, kind):
        def hook(*_):
            stack = self.open.get((id(mod), kind))
            if stack:
                stack.pop().__exit__(None, None, None)
                if self.cuda:
                    torch.cuda.nvtx.range_pop()
        return hook

    def new_step(self) -> None:
        self.counts.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class StepProfiler:
    """``with profiler.step(n): <run step n>``: profiles steps ``start..end`` and writes the files above.
    A no-op when ``steps`` is None."""

    def __init__(self, steps, *, run_dir: str | None, rank: int, chunks, device):
        self.steps = tuple(steps) if steps else None
        self.dir = os.path.join(run_dir or ".", "profile")
        self.rank = rank
        self.chunks = chunks
        self.device = torch.device(device)
        self._prof = None
        self._ranges = None
        self._last = None  # the last step run inside the window

    def _begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.memory._record_memory_history(max_entries=100000)
        self._ranges = _Ranges(self.chunks, cuda=cuda)
        # The first stage's embedding sees token ids (no gradient), so torch warns that its range's backward
        # hook fires on the output gradients instead, once per rank: expected here, and noise in the log. This
        # one filter entry is removed when the window ends (other filters added meanwhile stay).
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                                "respect to module outputs", category=UserWarning)
        self._filter = warnings.filters[0]
        self._prof = profile(activities=acts, profile_memory=True, record_shapes=False, with_stack=False)
        with self._quiet():  # Kineto's "profiler_start" line on every rank
            self._prof.__enter__()

    def _quiet(self):
        """stderr silenced around the profiler's start and stop on the CPU (Kineto's lines); on CUDA left
        alone: CUPTI reports there why a trace has no kernels."""
        return quiet_stderr() if self.device.type == "cpu" else contextlib.nullcontext()

    def _drop_filter(self) -> None:
        try:
            warnings.filters.remove(self._filter)
        except ValueError:
            pass
        mutated = getattr(warnings, "_filters_mutated", None)  # the module's cache of filter lookups
        if mutated is not None:
            mutated()

    def _stop(self) -> None:
        """Stop the profiler (quietly), then remove the ranges' hooks and this window's warning filter."""
        try:
            with self._quiet():  # and its "profiler_stop"
                self._prof.__exit__(None, None, None)
        finally:
            self._ranges.remove()
            self._drop_filter()

    def _abort(self) -> None:
        """Training raised inside the window: stop the profiler, drop the hooks and the filter, write nothing."""
        try:
            self._stop()
        finally:
            if self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)
            self._prof = self._ranges = None

    def covers(self, n: int) -> bool:
        """Whether step ``n`` runs inside the window."""
        return self.steps is not None and self.steps[0] <= n <= self.steps[1]

    def _finish(self) -> None:
        from engine.memory import cpu_allocation_peak

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._stop()
        os.makedirs(self.dir, exist_ok=True)
        self._prof.export_chrome_trace(os.path.join(self.dir, f"trace_rank{self.rank}.json"))
        # the steps profiled: the window, cut at the run's last step where training ended inside it
        mem: dict = {"rank": self.rank, "steps": [self.steps[0], self._last], "device": self.device.type}
        if self.device.type == "cuda":
            mem["memory_stats"] = torch.cuda.memory_stats(self.device)
            mem["history"] = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        else:
            peak, end = cpu_allocation_peak(self._prof, totals=False)
            top = sorted(self._prof.key_averages(), key=lambda e: e.self_cpu_memory_usage, reverse=True)[:20]
            mem.update(peak_bytes_above_start=peak, end_bytes_above_start=end,
                       top_ops_by_self_cpu_memory=[{"op": e.key, "self_cpu_memory_bytes": e.self_cpu_memory_usage,
                                                    "calls": e.count} for e in top])
        with open(os.path.join(self.dir, f"memory_rank{self.rank}.json"), "w") as f:
            json.dump(mem, f, default=str)
        self._prof = self._ranges = None

    def close(self) -> None:
        """Write what was profiled when training ended before ``end`` (steps beyond the run)."""
        if self._prof is not None:
            self._finish()

    def abort(self) -> None:
        """Training raised between steps of the window (a diverged run, a failed save): stop without writing."""
        if self._prof is not None:
            self._abort()

    @contextlib.contextmanager
    def step(self, n: int):
        if not self.covers(n):
            yield
            return
        if n == self.steps[0]:
            self._begin()
        self._last = n
        self._ranges.new_step()
        try:
            with torch.autograd.profiler.record_function(f"step{n}"):
                yield
        except BaseException:
            self._abort()
            raise
        if n == self.steps[1]:
            self._finish()
