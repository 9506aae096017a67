"""Data pipeline benchmarks: preprocessing throughput, index builders native vs numpy, sample reads.

    .venv/bin/python tools/bench_data.py [--corpus data/stdlib_corpus] [--json out.json]

1. Preprocessing (tools/preprocess_data.py's engine) of the stdlib corpus's raw.jsonl with the
   corpus tokenizer, 1 and 2 workers, in tokens/s. Baseline in the same run: a bare in-process
   ``encode`` loop over the same texts (one core, no I/O, no writing); ceiling: the tokenizers
   library's own multi-threaded ``encode_batch`` on every core.
2. Index builders (engine.data.index_helpers): document, sample and blending index, native C++
   against the numpy reference, same inputs, outputs checked identical.
3. Reading GPT samples from the memory-mapped dataset (samples/s, token bytes/s) against this
   machine's memory copy bandwidth (numpy copy of 256 MiB).
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_preprocess(corpus_dir: str, repeats: int) -> dict:
    from engine.data.preprocess import preprocess
    from engine.data.tokenizer import load_tokenizer

    raw = os.path.join(corpus_dir, "raw.jsonl")
    tok_path = os.path.join(corpus_dir, "text_document.tokenizer.json")
    texts = [json.loads(line)["text"] for line in open(raw, encoding="utf-8")]
    tok = load_tokenizer(tok_path)
    n_tokens = sum(len(tok.encode(x)) + 1 for x in texts)
    out = {"documents": len(texts), "tokens": n_tokens, "text_mb": sum(len(x.encode()) for x in texts) / 1e6,
           "repeats": repeats}
    out["bare_encode_loop_tokens_per_s"] = n_tokens / _best(lambda: [tok.encode(x) for x in texts], repeats)
    os.environ.pop("TOKENIZERS_PARALLELISM", None)
    out["encode_batch_all_cores_tokens_per_s"] = n_tokens / _best(
        lambda: tok.backend.encode_batch(texts, add_special_tokens=False), repeats)
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (1, 2):
            best = float("inf")
            for _ in range(repeats):  # best of N: the machine is shared, the minimum is the least disturbed
                stats = preprocess([raw], os.path.join(tmp, f"w{workers}"), tokenizer=tok_path, workers=workers,
                                   progress=False)
                assert stats.tokens == n_tokens, (stats.tokens, n_tokens)
                best = min(best, stats.seconds)
            out[f"preprocess_{workers}w_tokens_per_s"] = n_tokens / best
            out[f"preprocess_{workers}w_seconds"] = best
    return out


def bench_index_builders(num_docs: int, seq_length: int, blend_size: int, repeats: int) -> dict:
    from engine import _native
    from engine.data import index_helpers as ih

    if not _native.available("data_index"):
        return {"skipped": "engine._data_index not built (bash tools/install.sh)"}
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 2000, size=num_docs).astype(np.int32)
    documents = np.arange(num_docs, dtype=np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    out = {"num_docs": num_docs, "tokens": tokens, "seq_length": seq_length, "blend_size": blend_size}
    results = {}
    for backend in ("numpy", "native"):
        doc = ih.build_document_index(documents, 1, seed=1, backend=backend)
        sample = ih.build_sample_index(sizes, doc, seq_length=seq_length, tokens_per_epoch=tokens, num_epochs=1,
                                       backend=backend)
        blend = ih.build_blending_indices([0.5, 0.3, 0.2], blend_size, backend=backend)
        results[backend] = (doc, sample, blend)
        out[f"document_index_{backend}_s"] = _best(
            lambda: ih.build_document_index(documents, 1, seed=1, backend=backend), repeats)
        out[f"sample_index_{backend}_s"] = _best(
            lambda: ih.build_sample_index(sizes, doc, seq_length=seq_length, tokens_per_epoch=tokens, num_epochs=1,
                                          backend=backend), repeats)
        out[f"blending_{backend}_s"] = _best(
            lambda: ih.build_blending_indices([0.5, 0.3, 0.2], blend_size, backend=backend), 1)
    a, b = results["numpy"], results["native"]
    out["identical"] = bool(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
                            and all(np.array_equal(x, y) for x, y in zip(a[2], b[2])))
    out["num_samples"] = int(a[1].shape[0] - 1)
    return out


def bench_reads(corpus_dir: str, seq_length: int, count: int) -> dict:
    from engine.data.gpt_dataset import GPTDataset
    from engine.data.indexed_dataset import IndexedDataset

    indexed = IndexedDataset(os.path.join(corpus_dir, "text_document"))
    with tempfile.TemporaryDirectory() as tmp:
        ds = GPTDataset(indexed, document_range=(0, indexed.num_documents), num_samples=count, seq_length=seq_length,
                        seed=0, cache_dir=tmp)
        n = min(count, len(ds))
        seconds = _best(lambda: [ds[i] for i in range(n)], 2)
    src = np.ones(256 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    copy_s = _best(lambda: np.copyto(dst, src), 3)
    return {"samples": n, "seq_length": seq_length, "samples_per_s": n / seconds,
            "token_bytes_per_s": n * (seq_length + 1) * indexed.dtype.itemsize / seconds,
            "memcpy_bytes_per_s": src.nbytes / copy_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=os.path.join(REPO, "data", "stdlib_corpus"))
    p.add_argument("--num-docs", type=int, default=1_000_000)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--blend-size", type=int, default=200_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.corpus, "raw.jsonl")):
        print(f"no corpus at {args.corpus}: run `.venv/bin/python tools/prepare_corpus.py` first", file=sys.stderr)
        return 2
    results = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_start": os.getloadavg()[0]},
        "preprocess": bench_preprocess(args.corpus, args.repeats),
        "index_builders": bench_index_builders(args.num_docs, args.seq_length, args.blend_size, args.repeats),
        "reads": bench_reads(args.corpus, 1024, 2000),
    }
    results["machine"]["load_average_at_end"] = os.getloadavg()[0]
    pre, ib, rd = results["preprocess"], results["index_builders"], results["reads"]
    m = results["machine"]
    print(f"{m['cpus']} CPUs, 1-min load average {m['load_average_at_start']:.1f} -> {m['load_average_at_end']:.1f} "
          "(figures are best of --repeats runs)")
    print(f"preprocess {pre['text_mb']:.2f} MB, {pre['tokens']:,} tokens, {pre['documents']} docs")
    print(f"  {'bare encode loop (1 core, baseline)':40s} {pre['bare_encode_loop_tokens_per_s']:>14,.0f} tok/s")
    print(f"  {'tokenizers encode_batch (all cores)':40s} {pre['encode_batch_all_cores_tokens_per_s']:>14,.0f} tok/s")
    for w in (1, 2):
        v = pre[f"preprocess_{w}w_tokens_per_s"]
        print(f"  {f'preprocess_data, {w} worker(s)':40s} {v:>14,.0f} tok/s  "
              f"({v / pre['bare_encode_loop_tokens_per_s']:.2f}x bare)")
    if "skipped" in ib:
        print(f"index builders: skipped ({ib['skipped']})")
    else:
        print(f"index builders: {ib['num_docs']:,} docs, {ib['tokens']:,} tokens, seq {ib['seq_length']} "
              f"-> {ib['num_samples']:,} samples; identical outputs: {ib['identical']}")
        for name in ("document_index", "sample_index", "blending"):
            a, b = ib[f"{name}_numpy_s"], ib[f"{name}_native_s"]
            print(f"  {name:16s} numpy {a * 1e3:9.1f} ms  native {b * 1e3:9.1f} ms  speedup {a / b:6.1f}x")
    print(f"reads: {rd['samples_per_s']:,.0f} samples/s of {rd['seq_length'] + 1} tokens = "
          f"{rd['token_bytes_per_s'] / 1e6:,.0f} MB/s (memcpy ceiling {rd['memcpy_bytes_per_s'] / 1e9:.1f} GB/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
