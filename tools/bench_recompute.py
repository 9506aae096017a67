"""Benchmark: training-step time and peak memory of activation recompute (docs/memory.md), one process.

The same Llama stage (``models.build_model``, TP=PP=DP=1, fp32, attention dropout on so the RNG
replay is exercised), the same random batch and the same initial weights are run with
``recompute`` = none, selective, full and full with ``recompute_num_layers=1`` — what
``train.activation_checkpointing`` / ``train.recompute_num_layers`` select. One step is
zero_grad (set_to_none) + forward with labels + mean loss + backward (no optimizer: recompute does
not touch it). After ``--warmup`` untimed steps per mode, ``--repeats`` rounds time one step of each
mode, the mode order alternating (reversed every other round) so that load drifts hit all modes
alike. Per mode: the median wall and CPU (process) time of a step, each as a ratio to ``none`` from
the same run, the peak bytes PyTorch's CPU allocator held during one extra (untimed) step,
measured with ``tools.bench_kernels.CPUMemoryPeak`` (Kineto's memory events; the window starts
after zero_grad, so the peak covers the step's activations, gradients and temporaries, not the
weights), and the activations the layers save for backward as predicted by docs/memory.md's
formula for the Llama block at TP=1 (math SDPA path with dropout, fp32).

The machine's ceiling from the same run: the dense fp32 1024^3 matmul rate with the same threads
(what ``engine.metrics`` measures on CPU at start-up), and the model FLOPs per step (6 x matmul
parameters x tokens + attention 12 x layers x s^2 x b x h; the recompute's extra forward is not counted)
over the ``none`` step time as a fraction of it.

    .venv/bin/python tools/bench_recompute.py --json docs/benchmarks/recompute.json
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

MODES = (("none", None), ("selective", None), ("full", None), ("full", 1))
FP32_BYTES = 4


def mode_name(recompute: str, num_layers: int | None) -> str:
    return recompute if num_layers is None else f"{recompute} (recompute_num_layers={num_layers})"


def llama_config(args) -> dict:
    """A Hugging Face Llama config.json dict with the benchmark's shapes, attention dropout on."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": args.hidden,
            "intermediate_size": args.ffn, "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
            "vocab_size": args.vocab, "max_position_embeddings": max(args.seq, 128), "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "attention_dropout": args.dropout,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def predicted_saved_bytes(args, recompute: str, num_layers: int | None) -> int:
    """Bytes all layers save for backward: docs/memory.md's Llama formula at TP=1, fp32, the math SDPA
    path when attention dropout is on (engine.memory.layer_saved_bytes, the start-up report's). Full
    with N layers: N recomputed layers, the rest as none."""
    from engine.memory import LayerShape, layer_saved_bytes

    shape = LayerShape(hidden_size=args.hidden, num_heads=args.heads, num_kv_heads=args.kv_heads,
                       head_dim=args.hidden // args.heads, ffn_hidden_size=args.ffn, attention_dropout=args.dropout)

    def per(mode: str) -> int:
        return layer_saved_bytes(shape, s=args.seq, b=args.batch, recompute=mode, elem=FP32_BYTES)
    if recompute != "full":
        return args.layers * per(recompute)
    k = args.layers if num_layers is None else min(num_layers, args.layers)
    return k * per("full") + (args.layers - k) * per("none")


def model_flops_per_step(args) -> float:
    """6 x (matmul parameters incl. the logit layer) x tokens + attention scores/context 12 x L x s^2 x b x h."""
    h, f, a, g, L = args.hidden, args.ffn, args.heads, args.kv_heads, args.layers
    d = h // a
    per_layer = h * (a + 2 * g) * d + a * d * h + h * 2 * f + f * h
    params = L * per_layer + h * args.vocab
    tokens = args.seq * args.batch
    return 6.0 * params * tokens + 12.0 * L * args.seq * args.seq * args.batch * h


def matmul_tflops(reps: int = 5, n: int = 1024) -> float:
    """Dense fp32 n^3 matmul rate (median of ``reps``), TFLOP/s."""
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(n, n, generator=g) for _ in range(2))
    torch.matmul(x, y)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(x, y)
        times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / statistics.median(times) / 1e12


def _step(model, ids, labels) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=labels).mean()
    loss.backward()
    return float(loss.detach())


def run(args) -> dict:
    from models import build_model
    from parallel.comm import Group
    from tools.bench_kernels import CPUMemoryPeak

    torch.set_num_threads(args.threads)
    hf = llama_config(args)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)

    models = {}
    for recompute, n in MODES:
        model = build_model(hf, tp_group=Group.trivial("tp"), seed=args.seed, recompute=recompute,
                            recompute_num_layers=n, dtype=torch.float32, kernels="reference")
        model.train()
        models[mode_name(recompute, n)] = model
    names = list(models)

    # first-step losses (same weights, same batch, same default-generator seed before each, each model's
    # tracker seeded alike at build): bitwise equal across modes
    first_loss = {}
    for name in names:
        torch.manual_seed(args.seed)
        first_loss[name] = _step(models[name], ids, labels)
    for _ in range(args.warmup - 1):
        for name in names:
            _step(models[name], ids, labels)

    wall = {k: [] for k in names}
    cpu = {k: [] for k in names}
    ceiling = [matmul_tflops()]
    for r in range(args.repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            gc.collect()
            w0, c0 = time.perf_counter(), time.process_time()
            _step(models[name], ids, labels)
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    ceiling.append(matmul_tflops())

    peak = {}
    for name in names:
        model = models[name]
        model.zero_grad(set_to_none=True)
        with CPUMemoryPeak() as mem:
            loss = model(ids, labels=labels).mean()
            loss.backward()
        peak[name] = mem.peak_bytes
        del loss

    flops = model_flops_per_step(args)
    tflops = statistics.median(ceiling)
    base_w, base_c = statistics.median(wall["none"]), statistics.median(cpu["none"])
    rows = []
    for (recompute, n), name in zip(MODES, names):
        mw, mc = statistics.median(wall[name]), statistics.median(cpu[name])
        rows.append({"mode": name, "recompute": recompute, "recompute_num_layers": n,
                     "wall_s_median": mw, "wall_s_min": min(wall[name]), "cpu_s_median": mc,
                     "wall_ratio_vs_none": mw / base_w, "cpu_ratio_vs_none": mc / base_c,
                     "peak_bytes": peak[name], "peak_ratio_vs_none": peak[name] / peak["none"],
                     "predicted_saved_bytes": predicted_saved_bytes(args, recompute, n),
                     "first_loss": first_loss[name], "wall_s_all": wall[name], "cpu_s_all": cpu[name]})
    return {
        "benchmark": "tools/bench_recompute.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch": torch.__version__, "threads": args.threads},
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "peak_memory_mechanism": "tools.bench_kernels.CPUMemoryPeak (torch.profiler profile_memory: "
                                 "peak of the CPU allocator's running sum over one fwd+bwd, window "
                                 "opened after zero_grad)",
        "matmul_1024_tflops": tflops,
        "model_flops_per_step": flops,
        "none_mfu_vs_matmul": flops / base_w / (tflops * 1e12),
        "rows": rows,
    }


def format_table(res: dict) -> str:
    lines = [f"{'mode':38s} {'wall s':>8s} {'x none':>7s} {'cpu s':>8s} {'x none':>7s} "
             f"{'peak MiB':>9s} {'x none':>7s} {'saved MiB (formula)':>20s}"]
    for r in res["rows"]:
        lines.append(f"{r['mode']:38s} {r['wall_s_median']:8.3f} {r['wall_ratio_vs_none']:7.2f} "
                     f"{r['cpu_s_median']:8.3f} {r['cpu_ratio_vs_none']:7.2f} {r['peak_bytes'] / 2**20:9.1f} "
                     f"{r['peak_ratio_vs_none']:7.2f} {r['predicted_saved_bytes'] / 2**20:20.1f}")
    lines.append(f"fp32 1024^3 matmul ceiling (same run, {res['args']['threads']} threads): "
                 f"{res['matmul_1024_tflops'] * 1e3:.1f} GFLOP/s; model FLOPs/step "
                 f"{res['model_flops_per_step'] / 1e9:.1f} G -> none at {100 * res['none_mfu_vs_matmul']:.1f}% of it")
    losses = {r["mode"]: r["first_loss"] for r in res["rows"]}
    same = len(set(losses.values())) == 1
    lines.append(f"first-step loss: {next(iter(losses.values())):.6f} "
                 f"({'bitwise equal in every mode' if same else 'DIFFERS: ' + str(losses)})")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1, help="attention dropout (exercises the RNG replay)")
    p.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per mode (the first checks the loss)")
    p.add_argument("--repeats", type=int, default=6, help="timed rounds (one step of each mode per round)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.warmup < 1 or args.repeats < 1:
        raise SystemExit("--warmup and --repeats must be >= 1")
    res = run(args)
    print(f"recompute step time, 1 process, Llama h={args.hidden} L={args.layers} a={args.heads} g={args.kv_heads} "
          f"f={args.ffn} V={args.vocab}, s={args.seq} b={args.batch}, fp32, attention dropout {args.dropout}, "
          f"{args.threads} threads, {args.repeats} rounds (medians; ratios vs none from this run)")
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
