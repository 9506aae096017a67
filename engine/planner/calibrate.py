"""``tools/plan.py --calibrate``: this machine's rates, and the tiny preset predicted beside measured.

Measured here (docs/planner.md), each on one thread (as torchrun's ranks run) and on all threads (as one
process runs), fp32: the GEMM rate of the preset's own micro-batch GEMMs, run as a step runs them
(:func:`matmul_rate`; the planner's GEMM model ``2mnk / rate + overhead``); the bandwidth of an elementwise
op at the size of a micro-batch's activations (:func:`activation_gbps`: on this CPU they stay in cache);
causal SDPA's rate at the preset's shape over that GEMM rate (the attention efficiency); and once: the DRAM
bandwidth (a large clone: the optimizer's state streams at it); gloo's all-reduce by size on 2 ranks,
fitted to ``alpha + bytes / bandwidth`` with parallel/comm.py's bytes; the per-call overhead of a TP
layer's collectives beyond that alpha-beta figure (:func:`tp_collective_overhead`); the host's cost per
framework op (:func:`host_op_us`: a narrow copy of the preset, whose arithmetic is negligible, timed over
its aten op count). From these a CPU device for the planner (:func:`cpu_device`): ranks share the cores
(``world`` ranks on ``cores`` cores each get ``min(1, cores / world)`` of a core) and the DRAM bandwidth,
with ``world > 1`` every collective call costs the measured overhead, and every framework op of a
micro-batch (:func:`count_host_ops`, counted on the model's code) the host cost.

Then the tiny preset (configs/tiny_llama_cpu.toml) at 1 process, TP2, PP2, DP2 (ZeRO-1) and TP2 x PP2:
predicted step time and peak memory (engine/memory.py, as the run's start-up report), then ``repeats``
runs of tools/pretrain.py under ``torchrun --standalone``, whose metrics.jsonl gives the step time
(median of the steps after the second: the first runs under the allocator profiler) and the measured
peak (the memory report's ``measured`` record).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from engine.planner.hardware import GPU
from engine.planner.model import HostOps, PlanModel, from_preset
from engine.planner.predict import Cluster, Layout, Training, predict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUTS = (  # name, tp, pp, dp
    ("1 process", 1, 1, 1), ("TP2", 2, 1, 1), ("PP2", 1, 2, 1), ("DP2 ZeRO-1", 1, 1, 2), ("TP2 x PP2", 2, 2, 1))
STEPS = 6


def _time(fn, repeats: int = 9) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@contextlib.contextmanager
def _threads(n: int):
    """torch's intra-op threads set to ``n`` inside the block."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def gemm_shapes(model: PlanModel, *, recompute: str, mbs: int, seq: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of every matrix multiply (aten mm / addmm) of one micro-batch's forward and backward of the
    model at tp = 1, recorded under a dispatch mode: the GEMMs whose rate :func:`matmul_rate` measures."""
    from torch.utils._python_dispatch import TorchDispatchMode

    _, forward, backward = _micro_batch(_preset_hf(model, layers=model.config.num_layers, narrow=False),
                                        recompute=recompute, mbs=mbs, seq=seq)
    shapes = []
    mm = {torch.ops.aten.mm.default: (0, 1), torch.ops.aten.addmm.default: (1, 2)}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in mm:
                a, b = (args[i] for i in mm[func])
                shapes.append((a.shape[0], b.shape[1], a.shape[1]))  # (m x k) @ (k x n)
            return func(*args, **(kwargs or {}))

    with Record():
        backward(forward())
    return shapes


def matmul_rate(shapes: list[tuple[int, int, int]], *, threads: int, repeats: int = 9) -> dict:
    """The planner's GEMM model ``2mnk / rate + overhead`` on ``threads`` threads: the overhead from a 32^3
    fp32 matmul (almost all overhead), the rate from one pass over ``shapes`` (a micro-batch's GEMMs, each
    on operands of its own, so that, as in a step, no GEMM finds the previous one's in cache), best of
    ``repeats``. Measured this way and not on large square matrices: in a step this CPU's GEMMs run at
    80-85% of an isolated GEMM's rate on one thread and ~60-75% on two (docs/planner.md)."""
    a, b = torch.randn(32, 32), torch.randn(32, 32)
    ops = [(torch.randn(m, k), torch.randn(k, n)) for m, n, k in shapes]
    flops = sum(2.0 * m * n * k for m, n, k in shapes)

    def one_pass():
        for x, y in ops:
            torch.matmul(x, y)

    with _threads(threads):
        t32 = _time(lambda: torch.matmul(a, b))
        t = _time(one_pass, repeats)
    # the 32^3 matmul's arithmetic at the pass's rate is under a microsecond: its time is the overhead
    overhead = max(0.0, t32 - 2.0 * 32 ** 3 * t / flops)
    if len(shapes) * overhead >= 0.5 * t:  # a noisy 32^3 sample: keep the pass's own rate, no overhead term
        overhead = 0.0
    rate = flops / (t - len(shapes) * overhead)
    return {"tflops": rate / 1e12, "overhead_us": overhead * 1e6}


def copy_gbps(nbytes: int = 1 << 27) -> float:
    """DRAM bandwidth (a clone far larger than the caches: read + write): what the optimizer step's state
    streams at."""
    x = torch.empty(nbytes // 4)
    return 2 * nbytes / _time(lambda: x.clone()) / 1e9


def activation_gbps(nbytes: int, *, threads: int) -> float:
    """The memory-bound activation ops' bandwidth on ``threads`` threads: an elementwise add (two reads, one
    write) of fp32 tensors of ``nbytes``, the size of a micro-batch's activations. On this CPU they fit in
    the cache: ~75-85 GB/s per thread against ~5-7 GB/s from DRAM (docs/planner.md)."""
    x, y, z = (torch.randn(nbytes // 4) for _ in range(3))
    with _threads(threads):
        return 3 * nbytes / _time(lambda: torch.add(x, y, out=z), 31) / 1e9


def attention_efficiency(rate_tflops: float, *, threads: int, b: int = 2, heads: int = 4, s: int = 128,
                         d: int = 32) -> float:
    """Causal SDPA's achieved rate (half the s x s work) on ``threads`` threads over the GEMM rate
    ``rate_tflops`` measured on as many."""
    q, k, v = (torch.randn(b, heads, s, d) for _ in range(3))
    with _threads(threads):
        t = _time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    return min(1.0, 4 * b * heads * s * s * d * 0.5 / t / (rate_tflops * 1e12))


def _gloo_allreduce(sizes):
    import torch.distributed as dist

    out = []
    for n in sizes:
        x = torch.ones(n // 4)
        times = []
        for _ in range(7):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        out.append((n, statistics.median(times[2:])))
    return out


def gloo_alpha_beta(sizes=(4, 4096, 65536, 1 << 20, 1 << 22)) -> tuple[float, float]:
    """(alpha us, GB/s) of gloo on 2 ranks: all-reduce time vs parallel/comm.py's sent bytes 2(p-1)/p N = N,
    through the smallest size (latency) and the largest (bandwidth)."""
    from parallel.testing import run_distributed

    samples = run_distributed(_gloo_allreduce, 2, list(sizes), timeout=300)[0]
    (n0, t0), (n1, t1) = samples[0], samples[-1]
    gbps = (n1 - n0) / max(t1 - t0, 1e-12) / 1e9
    # an all-reduce over 2 ranks takes a ring's 2(p-1) = 2 steps: alpha is half the smallest one's time
    return max(0.0, t0 - n0 / (gbps * 1e9)) / 2 * 1e6, gbps


def _tp_block(t: int, h: int, f: int, iters: int, blocks: int):
    """One rank of a sequence-parallel MLP block on 2 ranks (the tiny preset's shapes), forward and backward
    in autograd through parallel/mappings.py: all-gather of the (t/2, h) shard, two matmuls, reduce-scatter of
    the (t, h) partial sums; backward the reverse (4 collectives per iteration). Beside it the same graph
    with each collective replaced by a local op of the same shape (repeat / sum of the two halves). Both
    ranks run both variants at the same time, so they share the cores the same way. (seconds per iteration
    with collectives, without; the median of ``blocks`` blocks: the steady state a training step sees)."""
    import torch.distributed as dist

    from parallel import mappings
    from parallel.comm import as_group

    group = as_group(dist.group.WORLD, axis="tp")
    torch.manual_seed(dist.get_rank())
    x = torch.randn(t // 2, h, requires_grad=True)  # (t/2, h): this rank's sequence shard
    w1 = torch.randn(h, f // 2, requires_grad=True)  # column-parallel: (h, f/2)
    w2 = torch.randn(f // 2, h, requires_grad=True)  # row-parallel: (f/2, h)

    def with_comm():
        full = mappings.gather_from_sp(x, group)  # (t/2, h) -> (t, h)
        y = mappings.reduce_scatter_to_sp(full @ w1 @ w2, group)  # (t, h) partial sums -> (t/2, h)
        y.sum().backward()

    def local():
        full = x.repeat(2, 1)  # (t/2, h) -> (t, h), as the all-gather's output
        y = (full @ w1 @ w2).view(2, t // 2, h).sum(0)  # (t, h) -> (2, t/2, h) -> (t/2, h)
        y.sum().backward()

    out = []
    for fn in (with_comm, local):
        fn()
        per_block = []
        for _ in range(blocks):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            per_block.append((time.perf_counter() - t0) / iters)
        out.append(statistics.median(per_block))
    return out


def tp_collective_overhead(alpha_us: float, gbps: float, *, t: int = 256, h: int = 128, f: int = 352,
                           iters: int = 40, blocks: int = 7) -> dict:
    """Per-collective host/sync overhead of TP's sequence-parallel collectives on 2 ranks of one thread
    each, beyond the alpha-beta figure: (block with collectives - the same block without) / 4 collectives,
    less the alpha-beta time of those 4 (2 all-gathers of the (t/2, h) fp32 shard, 2 reduce-scatters of
    the (t, h) tensor: each ``alpha + shard bytes / bandwidth`` on 2 ranks). The slower rank's figures
    count (a collective ends when both have arrived). Defaults: the tiny preset's mbs 2 x seq 128 tokens,
    hidden 128, ffn 352."""
    from parallel.testing import run_distributed

    per_rank = run_distributed(_tp_block, 2, t, h, f, iters, blocks, timeout=300)
    comm_s = max(r[0] for r in per_rank)
    local_s = max(r[1] for r in per_rank)
    shard = 4 * (t // 2) * h
    alpha_beta_s = 4 * (alpha_us * 1e-6 + shard / (gbps * 1e9))
    overhead = max(0.0, (comm_s - local_s - alpha_beta_s) / 4)
    return {"overhead_us": overhead * 1e6, "block_with_comm_ms": comm_s * 1e3, "block_local_ms": local_s * 1e3,
            "alpha_beta_4_collectives_ms": alpha_beta_s * 1e3}


def _preset_hf(model: PlanModel, *, layers: int, narrow: bool) -> dict:
    """The model's Hugging Face config with ``layers`` layers; ``narrow``: 4 per head (hidden = 4 x heads),
    FFN 32, vocab 128, so the arithmetic is negligible beside the ops' host cost. The op sequence does not
    depend on the widths (the same aten calls at any size: tests/engine/test_planner.py)."""
    from models.hook import hf_config_from_run

    hf = hf_config_from_run(model.base_config.model, vocab_size=None)
    hf["num_hidden_layers"] = layers
    if narrow:
        heads = hf["num_attention_heads"]
        hf.update(hidden_size=4 * heads, intermediate_size=32, vocab_size=128, head_dim=4)
    return hf


def _micro_batch(hf: dict, *, recompute: str, mbs: int, seq: int):
    """(stage, forward(), backward(loss)) of one micro-batch of the model ``hf`` at tp = 1, fp32."""
    from models import build_model
    from parallel.comm import Group

    stage = build_model(hf, tp_group=Group.trivial("tp"), recompute=recompute, dtype=torch.float32)
    stage.train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf["vocab_size"], (mbs, seq), generator=g)  # (b, s)
    labels = torch.randint(0, hf["vocab_size"], (mbs, seq), generator=g)  # (b, s)
    return stage, lambda: stage(ids, labels=labels).mean(), lambda loss: loss.backward()


PHASES = ("first_fwd", "layers_fwd", "last_fwd", "last_bwd", "layers_bwd", "first_bwd")


def count_phases(hf: dict, *, recompute: str, mbs: int, seq: int) -> dict[str, int]:
    """aten ops of one micro-batch by phase: forward before the first layer ("first_fwd": embedding, RoPE
    tables), in the layers, after them ("last_fwd": final norm, output layer, loss); backward until the
    gradient reaches the last layer's output ("last_bwd"), in the layers (with full recompute, their
    replayed forwards), after the gradient leaves the first layer's input ("first_bwd"). Module hooks
    switch the forward's phases, tensor hooks the backward's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    stage, forward, backward = _micro_batch(hf, recompute=recompute, mbs=mbs, seq=seq)
    layers = list(stage.layers.values())
    state = {"phase": "first_fwd"}
    counts = dict.fromkeys(PHASES, 0)

    def switch(phase):
        def hook(*_):
            state["phase"] = phase
        return hook

    def first_in(module, args):
        if state["phase"] == "first_fwd":  # not a recomputed forward in backward
            state["phase"] = "layers_fwd"
            args[0].register_hook(switch("first_bwd"))

    def last_out(module, args, out):
        if state["phase"] == "layers_fwd":
            state["phase"] = "last_fwd"
            out.register_hook(switch("layers_bwd"))

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[state["phase"]] += 1
            return func(*args, **(kwargs or {}))

    handles = [layers[0].register_forward_pre_hook(first_in), layers[-1].register_forward_hook(last_out)]
    try:
        with Count():
            loss = forward()
            state["phase"] = "last_bwd"
            backward(loss)
    finally:
        for h in handles:
            h.remove()
    return counts


def count_host_ops(model: PlanModel, *, recompute: str, mbs: int, seq: int) -> HostOps:
    """The model's :class:`HostOps`, counted on its code (narrow copies: the counts do not depend on the
    widths) with 1, 2 and 3 layers: a layer's ops are the difference (the same from 2 to 3, checked); what
    the first layer does beyond it (it starts the residual stream) goes with the first stage's."""
    one, two, three = (count_phases(_preset_hf(model, layers=n, narrow=True), recompute=recompute, mbs=mbs,
                                    seq=seq) for n in (1, 2, 3))
    layer = {p: two[p] - one[p] for p in ("layers_fwd", "layers_bwd")}
    if layer != {p: three[p] - two[p] for p in layer}:
        raise RuntimeError(f"a layer's op count differs from one layer to the next ({one}, {two}, {three} with 1, 2, "
                           "3 layers): the per-layer host model does not hold for this model")
    return HostOps(layer_fwd=layer["layers_fwd"], layer_bwd=layer["layers_bwd"],
                   first_fwd=one["first_fwd"] + one["layers_fwd"] - layer["layers_fwd"],
                   first_bwd=one["first_bwd"] + one["layers_bwd"] - layer["layers_bwd"],
                   last_fwd=one["last_fwd"], last_bwd=one["last_bwd"], recompute=recompute)


def host_op_us(model: PlanModel, *, threads: tuple[int, ...], recompute: str = "none", mbs: int = 2,
               seq: int = 128, repeats: int = 15) -> list[float]:
    """Microseconds per framework op on the host, on each of ``threads`` thread counts: the best time of one
    micro-batch's forward and backward of a narrow copy of ``model`` (4 layers, 4 per head, FFN 32, vocab
    128: the arithmetic is negligible) over its aten op count (counted once)."""
    hf = _preset_hf(model, layers=4, narrow=True)
    ops = sum(count_phases(hf, recompute=recompute, mbs=mbs, seq=seq).values())
    _, forward, backward = _micro_batch(hf, recompute=recompute, mbs=mbs, seq=seq)
    out = []
    for n in threads:
        with _threads(n):
            out.append(_time(lambda: backward(forward()), repeats) / ops * 1e6)
    return out


def measure(cores: int | None = None) -> dict:
    """This machine's figures for the tiny preset (one thread: a torchrun rank; all threads: one process)."""
    cores = cores or os.cpu_count() or 1
    tiny = from_preset("tiny_llama_cpu")
    tr = tiny.base["train"]
    mbs, seq = tr["micro_batch_size"], tr["seq_length"]
    shapes = gemm_shapes(tiny, recompute=tr["activation_checkpointing"], mbs=mbs, seq=seq)
    c = tiny.config
    act_bytes = 4 * mbs * seq * (2 if c.gated else 1) * c.ffn_hidden_size  # fp32: the MLP's widest activation
    out = {"cores": cores, "activation_gbps": {}, "attention_efficiency": {}}
    for key, n in (("1_thread", 1), ("all_threads", cores)):
        out[f"matmul_{key}"] = mm = matmul_rate(shapes, threads=n)
        out["activation_gbps"][key] = activation_gbps(act_bytes, threads=n)
        out["attention_efficiency"][key] = attention_efficiency(mm["tflops"], threads=n, b=mbs, heads=c.num_heads,
                                                                s=seq, d=c.head_dim)
    out["copy_gbps"] = copy_gbps()
    alpha, gbps = gloo_alpha_beta()
    out["gloo"] = {"alpha_us": alpha, "gbps": gbps}
    out["tp_collective"] = tp_collective_overhead(alpha, gbps)
    out["host_op"] = dict(zip(("us_1_thread", "us_all_threads"), host_op_us(tiny, threads=(1, cores))))
    return out


def cpu_device(cal: dict, *, world: int) -> GPU:
    """The planner's device for ``world`` ranks of one machine, from :func:`measure`'s figures: one process
    runs on every thread; ``world`` ranks on one thread each share the cores (each gets
    ``min(1, cores / world)`` of a core: its GEMM rate, its cache's bandwidth and its host time) and the
    DRAM bandwidth (``copy_gbps / world``: the optimizer's state)."""
    cores = cal["cores"]
    host = cal.get("host_op", {})  # a calibration without the host term: none
    key = "all_threads" if world == 1 else "1_thread"
    share = 1.0 if world == 1 else min(1.0, cores / world)
    mm = cal[f"matmul_{key}"]
    return GPU(name=f"cpu x{world}", bf16_tflops=mm["tflops"] * share, fp8_tflops=None,
               tf32_tflops=mm["tflops"] * share, hbm_gbps=cal["copy_gbps"] / world, hbm_gb=1e9,
               activation_gbps=cal["activation_gbps"][key] * share,
               intra_gbps=cal["gloo"]["gbps"], inter_gbps=cal["gloo"]["gbps"], intra_alpha_us=cal["gloo"]["alpha_us"],
               inter_alpha_us=cal["gloo"]["alpha_us"], gemm_efficiency=1.0, gemm_overhead_us=mm["overhead_us"] / share,
               attention_efficiency=cal["attention_efficiency"][key], link_efficiency=1.0,
               collective_overhead_us=cal["tp_collective"]["overhead_us"] if world > 1 else 0.0,
               host_op_us=host.get(f"us_{key}", 0.0) / share,
               sources=("measured",))


def predict_tiny(cal: dict, tp: int, pp: int, dp: int, *, host_ops: HostOps | None = None):
    """The tiny preset at tp x pp x dp on the calibrated CPU device; ``host_ops``: its op counts
    (:func:`count_host_ops`; counted here when the calibration has a host op cost and none are given)."""
    model = from_preset("tiny_llama_cpu")
    tr = model.base["train"]
    if host_ops is None and cal.get("host_op"):
        host_ops = count_host_ops(model, recompute=tr["activation_checkpointing"], mbs=tr["micro_batch_size"],
                                  seq=tr["seq_length"])
    model = dataclasses.replace(model, host_ops=host_ops)
    world = tp * pp * dp
    training = Training(seq_length=tr["seq_length"], global_batch_size=tr["global_batch_size"], precision="fp32",
                        recompute=tr["activation_checkpointing"], zero=1)
    cluster = Cluster(gpu=cpu_device(cal, world=world), nodes=1, gpus_per_node=world, device="cpu")
    return predict(model, Layout(tp=tp, pp=pp, vp=1, dp=dp, cp=1, mbs=tr["micro_batch_size"]), training, cluster)


def run_tiny(tp: int, pp: int, dp: int, *, run_dir: str) -> dict:
    """One measured run: (median step seconds after step 2, measured peak bytes, predicted by the run)."""
    world = tp * pp * dp
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           os.path.join(ROOT, "tools", "pretrain.py"), "--config", "tiny_llama_cpu", "--run-dir", run_dir,
           "--set", f"parallel.tp={tp}", "--set", f"parallel.pp={pp}", "--set", "parallel.dp=-1",
           "--set", f"train.steps={STEPS}", "--set", "train.log_interval=1", "--set", "train.eval_interval=0",
           "--set", "logging.tensorboard=false", "--set", "logging.progress_bar=off",
           "--set", "checkpoint.interval=0", "--set", "optim.warmup_steps=0"]
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    steps, peak = [], None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("event") == "measured":
                peak = r["measured_peak_bytes"]
            elif r.get("split") == "train" and "step_time_s" in r and r["step"] > 2:
                steps.append(r["step_time_s"])
    return {"step_s": statistics.median(steps), "peak_bytes": peak}


def median_calibration(cals: list[dict]) -> dict:
    """Figure by figure, the median of several :func:`measure` results (nested dicts of numbers): a machine
    figure taken once carries that moment's noise into every prediction; taken at the start, the middle
    and the end of the measured runs, the median is the machine the runs saw."""
    out = {}
    for key, first in cals[0].items():
        values = [c[key] for c in cals]
        out[key] = median_calibration(values) if isinstance(first, dict) else statistics.median(values)
    return out


def main_calibrate(*, repeats: int = 3, json_path: str | None = None) -> int:
    """Measure the machine at the start, after the middle layout and at the end; run every layout
    ``repeats`` times; predict each layout on the figure-wise median of the three calibrations."""
    cals = [measure()]
    print(f"calibration 1: {json.dumps(cals[0])}", flush=True)
    tiny = from_preset("tiny_llama_cpu")
    tr = tiny.base["train"]
    ops = count_host_ops(tiny, recompute=tr["activation_checkpointing"], mbs=tr["micro_batch_size"],
                         seq=tr["seq_length"])
    measured = []
    for i, (name, tp, pp, dp) in enumerate(LAYOUTS):
        runs = []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory(prefix="tessel_cal_") as d:
                runs.append(run_tiny(tp, pp, dp, run_dir=os.path.join(d, "run")))
        measured.append(runs)
        steps = ", ".join(f"{r['step_s']:.4f}" for r in runs)
        print(f"{name:<12} measured {steps} s", flush=True)
        if i == len(LAYOUTS) // 2 or i == len(LAYOUTS) - 1:
            cals.append(measure())
            print(f"calibration {len(cals)}: {json.dumps(cals[-1])}", flush=True)
    cal = median_calibration(cals)
    cal["host_op"]["counts"] = dataclasses.asdict(ops)
    print(f"calibration (median of {len(cals)}): {json.dumps(cal)}")
    rows = []
    for (name, tp, pp, dp), runs in zip(LAYOUTS, measured):
        pred = predict_tiny(cal, tp, pp, dp, host_ops=ops)
        times = [r["step_s"] for r in runs]
        peaks = [r["peak_bytes"] for r in runs]
        row = {"layout": name, "predicted_step_s": pred.step_time_s, "measured_step_s": times,
               "predicted_peak_bytes": pred.memory_bytes, "measured_peak_bytes": peaks,
               "step_error": pred.step_time_s / statistics.median(times) - 1,
               "memory_error": pred.memory_bytes / statistics.median(peaks) - 1}
        rows.append(row)
        print(f"{name:<12} step predicted {pred.step_time_s:.4f} s, measured {', '.join(f'{t:.4f}' for t in times)} s "
              f"({100 * row['step_error']:+.1f}% vs median) | peak predicted {pred.memory_bytes / 1e6:.2f} MB, "
              f"measured {', '.join(f'{p / 1e6:.2f}' for p in peaks)} MB ({100 * row['memory_error']:+.1f}%)",
              flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"calibrations": cals, "calibration": cal, "rows": rows}, f, indent=1)
    return 0
