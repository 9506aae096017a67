"""Checkpoint benchmarks: save/load throughput against plain copies, and the async-save training stall.

    .venv/bin/python tools/bench_checkpoint.py [--gib 1.0] [--train-mib 256] [--dir /tmp] [--json out.json]

1. Save: ``save_checkpoint`` (sync, one rank: stage, stream + sha256, fsync, atomic commit) of
   ``--gib`` of fp32 tensors, in GB/s of tensor bytes. Baselines in the same run, same bytes:
   a bare ``write`` + ``fsync`` of one buffer (the disk/page-cache write ceiling) and
   ``shutil.copyfile`` + ``fsync`` of a same-size file; and ``hashlib.sha256`` alone (the hashing cost).
2. Load: ``load_checkpoint`` into preallocated tensors, with and without checksum verification,
   from the page cache ("hot") and after ``posix_fadvise(DONTNEED)`` evicted the files ("cold").
   Baselines: ``readinto`` of the same file into a numpy buffer (hot and cold) and ``np.copyto`` of
   the same bytes (memory bandwidth ceiling).
3. Stall: a training loop (MLP, SGD in place, ``--train-mib`` of parameters) saves once through a
   ``Checkpointer``; the time the save blocks the loop (the ``save`` call plus the per-step
   ``maybe_finalize`` that commits it), sync vs async, and how much slower the steps run while the
   async write proceeds in the background (both share the CPU cores). Steady state: the first save
   of a run, which allocates the host staging buffers, is reported separately.
Each figure is the median of ``--repeat`` runs. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.checkpoint import Checkpointer, ShardedTensor, load_checkpoint, save_checkpoint  # noqa: E402

GB = 1e9


def _evict(path: Path) -> None:
    """Drop a file's clean pages from the page cache (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _tensors(total_bytes: int, n: int = 16) -> dict[str, torch.Tensor]:
    per = total_bytes // n // 4
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per // 1024, 1024, generator=g) for i in range(n)}


def bench_save_load(work: Path, *, total_bytes: int, repeat: int) -> dict:
    tensors = _tensors(total_bytes)
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    pieces = [ShardedTensor.replicated(k, v) for k, v in tensors.items()]
    root = work / "ckpt"
    buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)

    def raw_write():
        with open(work / "raw.bin", "wb") as f:
            f.write(memoryview(buf))
            f.flush()
            os.fsync(f.fileno())

    def copy_file():
        shutil.copyfile(work / "raw.bin", work / "copy.bin")
        fd = os.open(work / "copy.bin", os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    step = iter(range(10 ** 6))

    def save():
        save_checkpoint(root, step=next(step), tensors=pieces, keep_last=1)

    out = {"bytes": nbytes}
    out["write_fsync_s"] = _median_time(raw_write, repeat)
    out["copyfile_fsync_s"] = _median_time(copy_file, repeat)
    out["sha256_s"] = _median_time(lambda: hashlib.sha256(memoryview(buf)).hexdigest(), repeat)
    out["save_sync_s"] = _median_time(save, repeat)
    step_dir = sorted(root.glob("step_*"))[-1]
    files = list(step_dir.glob("*.safetensors"))
    targets = {k: torch.empty_like(v) for k, v in tensors.items()}
    tpieces = [ShardedTensor.replicated(k, v) for k, v in targets.items()]
    dst = np.empty(nbytes + 4096, dtype=np.uint8)

    def read_raw(path):
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(dst))

    def cold(fn, paths):
        def run():
            for p in paths:
                _evict(p)
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return statistics.median(run() for _ in range(repeat))

    read_raw(work / "raw.bin")
    out["read_hot_s"] = _median_time(lambda: read_raw(work / "raw.bin"), repeat)
    out["read_cold_s"] = cold(lambda: read_raw(work / "raw.bin"), [work / "raw.bin"])
    load = lambda verify: load_checkpoint(step_dir, tensors=tpieces, verify=verify)  # noqa: E731
    load(False)
    out["load_hot_s"] = _median_time(lambda: load(False), repeat)
    out["load_hot_verify_s"] = _median_time(lambda: load(True), repeat)
    out["load_cold_s"] = cold(lambda: load(False), files)
    out["load_cold_verify_s"] = cold(lambda: load(True), files)
    assert all(torch.equal(targets[k], tensors[k]) for k in tensors)
    src = np.ones(nbytes, dtype=np.uint8)
    out["np_copyto_s"] = _median_time(lambda: np.copyto(dst[:nbytes], src), repeat)
    return out


def bench_stall(work: Path, *, train_bytes: int, repeat: int, steps: int = 12, save_at: int = 3) -> dict:
    width = 2048
    layers = max(1, train_bytes // (width * width * 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    x = torch.randn(64, width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def train_step():
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    counter = iter(range(10 ** 6))

    def run(mode: str | None, ckpt: Checkpointer | None) -> dict:
        step_times, blocked, save_call = [], 0.0, 0.0
        for i in range(steps):
            t0 = time.perf_counter()
            train_step()
            step_times.append(time.perf_counter() - t0)
            if i == save_at and ckpt is not None:
                pieces = [ShardedTensor.replicated(n, p.detach()) for n, p in model.named_parameters()]
                t0 = time.perf_counter()
                ckpt.save(step=next(counter), tensors=pieces)
                blocked = save_call = time.perf_counter() - t0
            elif ckpt is not None and i > save_at:
                t0 = time.perf_counter()
                ckpt.maybe_finalize()  # what a trainer calls every step
                blocked += time.perf_counter() - t0
        t0 = time.perf_counter()
        if ckpt is not None:
            ckpt.finalize()
        return {"blocked_s": blocked, "save_call_s": save_call, "tail_wait_s": time.perf_counter() - t0,
                "step_s": step_times}

    for _ in range(2):
        train_step()  # warm-up
    results = {}
    for mode in (None, "sync", "async"):
        ckpt = None if mode is None else Checkpointer(work / f"stall_{mode}", keep_last=1, async_save=mode == "async")
        # The first save allocates (and page-faults) the staging buffers; later ones reuse them.
        results[mode or "none"] = [run(mode, ckpt) for _ in range(repeat + 1)]
    base_step = statistics.median(s for r in results["none"] for s in r["step_s"][1:])
    after = [s for r in results["async"][1:] for s in r["step_s"][save_at + 1:save_at + 4]]
    return {"param_bytes": layers * width * width * 4, "layers": layers, "baseline_step_s": base_step,
            "sync_blocked_s": statistics.median(r["blocked_s"] for r in results["sync"][1:]),
            "async_blocked_s": statistics.median(r["blocked_s"] for r in results["async"][1:]),
            "async_first_blocked_s": results["async"][0]["blocked_s"],
            "async_save_call_s": statistics.median(r["save_call_s"] for r in results["async"][1:]),
            "async_tail_wait_s": statistics.median(r["tail_wait_s"] for r in results["async"][1:]),
            "async_step_during_write_s": statistics.median(after)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of tensors for save/load")
    ap.add_argument("--train-mib", type=float, default=256, help="MiB of parameters in the stall benchmark")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    work = Path(tempfile.mkdtemp(prefix="tessel_bench_ckpt_", dir=args.dir))
    load_before = os.getloadavg()
    try:
        sl = bench_save_load(work, total_bytes=int(args.gib * (1 << 30)), repeat=args.repeat)
        st = bench_stall(work, train_bytes=int(args.train_mib * (1 << 20)), repeat=args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    n = sl["bytes"]
    rows = [("save_checkpoint (sync, sha256, fsync, commit)", sl["save_sync_s"]),
            ("  baseline: write + fsync of the same bytes", sl["write_fsync_s"]),
            ("  baseline: shutil.copyfile + fsync, same size", sl["copyfile_fsync_s"]),
            ("  component: sha256 of the same bytes", sl["sha256_s"]),
            ("load_checkpoint, page cache hot", sl["load_hot_s"]),
            ("load_checkpoint, hot, verify sha256", sl["load_hot_verify_s"]),
            ("load_checkpoint, cold (evicted)", sl["load_cold_s"]),
            ("load_checkpoint, cold, verify sha256", sl["load_cold_verify_s"]),
            ("  baseline: readinto numpy, hot", sl["read_hot_s"]),
            ("  baseline: readinto numpy, cold", sl["read_cold_s"]),
            ("  ceiling: np.copyto of the same bytes", sl["np_copyto_s"])]
    print(f"save/load of {n / GB:.2f} GB ({n / (1 << 30):.2f} GiB) fp32 tensors, 16 tensors, one rank")
    print(f"{'operation':<50} {'seconds':>9} {'GB/s':>8}")
    for name, s in rows:
        print(f"{name:<50} {s:>9.3f} {n / s / GB:>8.2f}")
    print(f"\nasync-save stall, {st['param_bytes'] / (1 << 20):.0f} MiB of parameters ({st['layers']} x 2048^2 fp32), "
          f"baseline step {st['baseline_step_s'] * 1e3:.0f} ms")
    print(f"  sync save blocks the loop      {st['sync_blocked_s']:.3f} s")
    print(f"  async save blocks the loop     {st['async_blocked_s']:.3f} s "
          f"({st['sync_blocked_s'] / max(st['async_blocked_s'], 1e-9):.1f}x less; first save, allocating its "
          f"staging buffers: {st['async_first_blocked_s']:.3f} s)")
    print(f"    of which the save() call     {st['async_save_call_s']:.3f} s (snapshot copy to host); the rest is "
          "the commit in maybe_finalize")
    print(f"  steps while writing (async)    {st['async_step_during_write_s'] * 1e3:.0f} ms "
          f"(vs {st['baseline_step_s'] * 1e3:.0f} ms)")
    print(f"  wait at the end (async)        {st['async_tail_wait_s']:.3f} s")
    print(f"\nload average before {load_before[0]:.1f}, after {load_after[0]:.1f} on {os.cpu_count()} cores "
          "(other processes share the machine: figures are noisy)")
    if args.json:
        meta = {"date": datetime.date.today().isoformat(), "machine": platform.platform(),
                "cpu_count": os.cpu_count(), "torch": torch.__version__, "args": vars(args),
                "loadavg_before": load_before, "loadavg_after": load_after}
        Path(args.json).write_text(json.dumps({"meta": meta, "save_load": sl, "stall": st}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
