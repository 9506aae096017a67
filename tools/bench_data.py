"""Data pipeline benchmarks: preprocessing throughput, sample-index builds native vs numpy, reads.

    .venv/bin/python tools/bench_data.py [--corpus data/stdlib_corpus] [--repeats 5] [--json out.json]

1. Preprocessing (the engine of tools/preprocess_data.py) of the stdlib corpus's raw.jsonl with the
   corpus tokenizer, 1 and 2 workers. Baseline in the same run: a bare in-process ``encode`` loop
   over the same texts (one core, no JSON, no IPC, no writing): the one-core ceiling, and twice it
   the two-core ceiling. Each figure is given by wall time and by CPU time (this process plus its
   worker processes, user + system), which other jobs on a shared machine do not inflate.
2. Index builders (engine.data.index_helpers) at GPT-dataset scale: document index, sample index
   and blending index, native C++ against the numpy reference on the same inputs (outputs checked
   identical), by the calling thread's CPU time.
3. Reading GPT samples from the memory-mapped dataset, against this machine's copy bandwidth.
Every figure is the best of --repeats runs. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)  # terminated and waited-for children only
    return r.ru_utime + r.ru_stime


def _best(fn, repeats: int, *, clock=time.thread_time) -> dict:
    """Best wall and CPU seconds (``clock``; children added for process-wide clocks) over ``repeats``."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        w0, c0, k0 = time.perf_counter(), clock(), _children_cpu()
        fn()
        c1 = clock() - c0 + (_children_cpu() - k0 if clock is time.process_time else 0.0)
        wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, c1)
    return {"wall_s": wall, "cpu_s": cpu}


def bench_preprocess(corpus_dir: str, repeats: int) -> dict:
    from engine.data.preprocess import preprocess
    from engine.data.tokenizer import load_tokenizer

    raw = os.path.join(corpus_dir, "raw.jsonl")
    tok_path = os.path.join(corpus_dir, "text_document.tokenizer.json")
    texts = [json.loads(line)["text"] for line in open(raw, encoding="utf-8")]
    tok = load_tokenizer(tok_path)
    n = sum(len(tok.encode(x)) + 1 for x in texts)
    out = {"documents": len(texts), "tokens": n, "text_mb": sum(len(x.encode()) for x in texts) / 1e6}
    out["bare_encode_loop"] = _best(lambda: [tok.encode(x) for x in texts], repeats)
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (1, 2):
            prefix = os.path.join(tmp, f"w{workers}")
            # process_time covers this process's threads; the pool's workers are added as children.
            out[f"preprocess_{workers}w"] = _best(
                lambda: preprocess([raw], prefix, tokenizer=tok_path, workers=workers, progress=False),
                repeats, clock=time.process_time)
    for key in ("bare_encode_loop", "preprocess_1w", "preprocess_2w"):
        out[key]["tokens_per_s_wall"] = n / out[key]["wall_s"]
        out[key]["tokens_per_cpu_s"] = n / out[key]["cpu_s"]
    return out


def bench_index_builders(num_docs: int, mean_doc_len: int, seq_length: int, blend_size: int, repeats: int) -> dict:
    from engine import _native
    from engine.data import index_helpers as ih

    if not _native.available("data_index"):
        return {"skipped": "engine._data_index not built (bash tools/install.sh)"}
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 2 * mean_doc_len, size=num_docs).astype(np.int32)
    documents = np.arange(num_docs, dtype=np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    out = {"num_docs": num_docs, "tokens": tokens, "seq_length": seq_length, "blend_size": blend_size}
    results = {}
    for backend in ("numpy", "native"):
        doc = ih.build_document_index(documents, 1, seed=1, backend=backend)
        results[backend] = (
            doc,
            ih.build_sample_index(sizes, doc, seq_length=seq_length, tokens_per_epoch=tokens, num_epochs=1,
                                  backend=backend),
            ih.build_blending_indices([0.5, 0.3, 0.2], blend_size, backend=backend),
        )
        out[f"document_index_{backend}"] = _best(
            lambda: ih.build_document_index(documents, 1, seed=1, backend=backend), repeats)
        out[f"sample_index_{backend}"] = _best(
            lambda: ih.build_sample_index(sizes, doc, seq_length=seq_length, tokens_per_epoch=tokens, num_epochs=1,
                                          backend=backend), repeats)
        out[f"blending_{backend}"] = _best(
            lambda: ih.build_blending_indices([0.5, 0.3, 0.2], blend_size, backend=backend),
            1 if backend == "numpy" else repeats)
    a, b = results["numpy"], results["native"]
    out["identical"] = bool(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
                            and all(np.array_equal(x, y) for x, y in zip(a[2], b[2])))
    out["num_samples"] = int(a[1].shape[0] - 1)
    return out


def bench_reads(corpus_dir: str, seq_length: int, count: int, repeats: int) -> dict:
    from engine.data.gpt_dataset import GPTDataset
    from engine.data.indexed_dataset import IndexedDataset

    indexed = IndexedDataset(os.path.join(corpus_dir, "text_document"))
    with tempfile.TemporaryDirectory() as tmp:
        ds = GPTDataset(indexed, document_range=(0, indexed.num_documents), num_samples=count, seq_length=seq_length,
                        seed=0, cache_dir=tmp)
        n = min(count, len(ds))
        t = _best(lambda: [ds[i] for i in range(n)], repeats)
    src = np.ones(256 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    copy = _best(lambda: np.copyto(dst, src), repeats)
    return {"samples": n, "seq_length": seq_length, "samples_per_cpu_s": n / t["cpu_s"],
            "token_bytes_per_cpu_s": n * (seq_length + 1) * indexed.dtype.itemsize / t["cpu_s"],
            "copy_bytes_per_cpu_s": src.nbytes / copy["cpu_s"], "read": t, "copy": copy}


def _print(results: dict) -> None:
    m, pre, ib, rd = results["machine"], results["preprocess"], results["index_builders"], results["reads"]
    print(f"{m['cpu']} x{m['cpus']}, load average {m['load_average_at_start']:.1f} -> {m['load_average_at_end']:.1f};"
          " best of --repeats runs")
    print(f"preprocess: {pre['text_mb']:.2f} MB, {pre['tokens']:,} tokens, {pre['documents']} documents")
    bare = pre["bare_encode_loop"]["tokens_per_cpu_s"]
    for key, label in (("bare_encode_loop", "bare encode loop (baseline)"), ("preprocess_1w", "preprocess 1 worker"),
                       ("preprocess_2w", "preprocess 2 workers")):
        r = pre[key]
        print(f"  {label:28s} wall {r['tokens_per_s_wall']:>10,.0f} tok/s   per CPU-s {r['tokens_per_cpu_s']:>10,.0f}"
              f" ({r['tokens_per_cpu_s'] / bare:.2f}x bare)")
    if "skipped" in ib:
        print(f"index builders: skipped ({ib['skipped']})")
    else:
        print(f"index builders: {ib['num_docs']:,} docs, {ib['tokens']:,} tokens, seq {ib['seq_length']} -> "
              f"{ib['num_samples']:,} samples; blend {ib['blend_size']:,}; identical: {ib['identical']}")
        for name in ("document_index", "sample_index", "blending"):
            a, b = ib[f"{name}_numpy"]["cpu_s"], ib[f"{name}_native"]["cpu_s"]
            print(f"  {name:15s} numpy {a * 1e3:9.1f} ms  native {b * 1e3:8.1f} ms  (CPU)  {a / b:6.1f}x")
    print(f"reads: {rd['samples_per_cpu_s']:,.0f} samples/CPU-s of {rd['seq_length'] + 1} tokens = "
          f"{rd['token_bytes_per_cpu_s'] / 1e6:,.0f} MB/s; copy ceiling {rd['copy_bytes_per_cpu_s'] / 1e9:.1f} GB/s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=os.path.join(REPO, "data", "stdlib_corpus"))
    p.add_argument("--num-docs", type=int, default=1_000_000)
    p.add_argument("--mean-doc-len", type=int, default=1000)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--blend-size", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.corpus, "raw.jsonl")):
        print(f"no corpus at {args.corpus}: run `.venv/bin/python tools/prepare_corpus.py` first", file=sys.stderr)
        return 2
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    results = {"date": datetime.date.today().isoformat(), "command": " ".join(["tools/bench_data.py"] + sys.argv[1:]),
               "machine": {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(),
                           "numpy": np.__version__, "load_average_at_start": os.getloadavg()[0]}}
    results["preprocess"] = bench_preprocess(args.corpus, args.repeats)
    results["index_builders"] = bench_index_builders(args.num_docs, args.mean_doc_len, args.seq_length,
                                                     args.blend_size, args.repeats)
    results["reads"] = bench_reads(args.corpus, 1024, 2000, args.repeats)
    results["machine"]["load_average_at_end"] = os.getloadavg()[0]
    _print(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
