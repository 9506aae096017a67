"""Benchmark: native (engine._data_index) vs numpy index builders for GPT datasets.

Builds the document index, the sample index and the blending index on a synthetic corpus
(default 1M documents of 1..199 tokens, ~100M tokens; 3 datasets blended into 10M samples) with
both backends of engine.data.index_helpers, checks they agree, and reports the time of each, the
native/numpy ratio, and a ceiling measured on this machine: the time a plain ``np.copyto`` takes
to move the same output bytes between two already-touched buffers (and the copy bandwidth behind
it). Builders return fresh arrays, so they also pay the first-touch page faults a copy does not.

Every figure is the best of N runs, both as wall time and as the calling thread's CPU time
(user + system, page faults included). All the work runs single-threaded in the calling thread, so
on a shared machine the CPU time is the figure that other processes do not inflate; the ratios use
it, and the wall times are reported beside it with the load average.

    .venv/bin/python tools/bench_dataset_index.py --json docs/benchmarks/dataset_index.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np

# Runnable as `python tools/bench_dataset_index.py` from a checkout without an install.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import _native  # noqa: E402
from engine.data import index_helpers as ih  # noqa: E402


def _best_time(fn, repeats: int) -> tuple[dict, object]:
    """Best wall and thread-CPU seconds over ``repeats`` runs, and the last result."""
    wall, cpu, result = float("inf"), float("inf"), None
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.thread_time()
        result = fn()
        cpu = min(cpu, time.thread_time() - c0)
        wall = min(wall, time.perf_counter() - w0)
    return dict(wall_s=wall, cpu_s=cpu), result


def _copy_time(num_bytes: int, repeats: int) -> dict:
    """Best seconds for np.copyto of ``num_bytes`` between two already-touched buffers."""
    src = np.ones(max(num_bytes, 1), dtype=np.uint8)
    dst = np.zeros_like(src)
    return _best_time(lambda: np.copyto(dst, src), repeats)[0]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and np.array_equal(a, b)


def run(args) -> dict:
    load_start = os.getloadavg()[0]
    rng = np.random.default_rng(args.seed)
    sizes = rng.integers(1, 2 * args.mean_doc_len, size=args.num_docs).astype(np.int32)
    documents = np.arange(args.num_docs, dtype=np.int32)
    tokens_per_epoch = int(sizes.sum(dtype=np.int64))
    doc_index = ih.build_document_index(documents, args.num_epochs, seed=args.seed,
                                        backend="native")
    weights = [float(w) for w in args.blend_weights.split(",")]

    cases = {
        "document_index": (
            lambda b: ih.build_document_index(documents, args.num_epochs, seed=args.seed,
                                              backend=b),
            dict(docs=args.num_docs, epochs=args.num_epochs)),
        "sample_index": (
            lambda b: ih.build_sample_index(sizes, doc_index, seq_length=args.seq_length,
                                            tokens_per_epoch=tokens_per_epoch,
                                            num_epochs=args.num_epochs, backend=b),
            dict(tokens=tokens_per_epoch * args.num_epochs, seq_length=args.seq_length)),
        "blending_index": (
            lambda b: ih.build_blending_indices(weights, args.blend_size, backend=b),
            dict(datasets=len(weights), samples=args.blend_size)),
    }
    rows = []
    for name, (fn, params) in cases.items():
        t_native, out_native = _best_time(lambda: fn("native"), args.repeats)
        numpy_repeats = args.numpy_repeats if name == "blending_index" else args.repeats
        t_numpy, out_numpy = _best_time(lambda: fn("numpy"), numpy_repeats)
        if not _same(out_native, out_numpy):
            raise RuntimeError(f"{name}: native and numpy results differ")
        outputs = out_native if isinstance(out_native, tuple) else (out_native,)
        out_bytes = int(sum(o.nbytes for o in outputs))
        t_copy = _copy_time(out_bytes, args.repeats)
        rows.append(dict(index=name, params=params, native=t_native, numpy=t_numpy,
                         speedup_cpu=t_numpy["cpu_s"] / t_native["cpu_s"],
                         speedup_wall=t_numpy["wall_s"] / t_native["wall_s"],
                         output_bytes=out_bytes, copy_output=t_copy,
                         native_over_copy_cpu=t_native["cpu_s"] / t_copy["cpu_s"]))

    bandwidth_bytes = 256 * 2**20
    copy = _copy_time(bandwidth_bytes, args.repeats)
    return dict(
        date=datetime.date.today().isoformat(),
        machine=dict(cpu=_cpu_model(), cores=os.cpu_count(), platform=platform.platform(),
                     python=platform.python_version(), numpy=np.__version__),
        load_average_1min=dict(start=load_start, end=os.getloadavg()[0]),
        args=vars(args), copy_bandwidth_gb_s=dict(cpu=bandwidth_bytes / copy["cpu_s"] / 1e9,
                                                  wall=bandwidth_bytes / copy["wall_s"] / 1e9),
        results=rows)


def _print_table(report: dict) -> None:
    load = report["load_average_1min"]
    bw = report["copy_bandwidth_gb_s"]
    print(f"machine: {report['machine']['cpu']} ({report['machine']['cores']} cores), "
          f"numpy {report['machine']['numpy']}; load average {load['start']:.1f} -> "
          f"{load['end']:.1f}; np.copyto bandwidth {bw['cpu']:.1f} GB/s by CPU time "
          f"({bw['wall']:.1f} wall; 256 MiB, counted once)")
    print("times: best of N, CPU ms (wall ms); ratios on CPU time")
    header = (f"{'index':<16}{'native ms':>18}{'numpy ms':>20}{'numpy/native':>14}"
              f"{'out MiB':>9}{'copy ms':>9}{'native/copy':>13}")
    print(header)
    print("-" * len(header))
    for r in report["results"]:
        native = f"{r['native']['cpu_s'] * 1e3:.2f} ({r['native']['wall_s'] * 1e3:.2f})"
        numpy_ = f"{r['numpy']['cpu_s'] * 1e3:.1f} ({r['numpy']['wall_s'] * 1e3:.1f})"
        print(f"{r['index']:<16}{native:>18}{numpy_:>20}{r['speedup_cpu']:>13.1f}x"
              f"{r['output_bytes'] / 2**20:>9.2f}{r['copy_output']['cpu_s'] * 1e3:>9.2f}"
              f"{r['native_over_copy_cpu']:>12.1f}x")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-docs", type=int, default=1_000_000)
    parser.add_argument("--mean-doc-len", type=int, default=100,
                        help="document lengths are uniform in [1, 2 * mean)")
    parser.add_argument("--num-epochs", type=int, default=1)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--blend-size", type=int, default=10_000_000)
    parser.add_argument("--blend-weights", default="0.5,0.3,0.2")
    parser.add_argument("--repeats", type=int, default=5, help="best of N (native, copies)")
    parser.add_argument("--numpy-repeats", type=int, default=1,
                        help="best of N for the numpy blending loop (seconds per run)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if not _native.available("data_index"):
        raise SystemExit("engine._data_index is not built: run "
                         "`MAX_JOBS=2 .venv/bin/python setup.py build_ext --inplace`")
    report = run(args)
    _print_table(report)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
