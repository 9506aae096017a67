"""Benchmark: one-process CPU training-step throughput of Tessel vs Hugging Face transformers.

Both sides train the same tiny Llama (the CPU preset's shapes by default: hidden 128, 4 layers,
4 heads over 2 kv heads, ffn 352, vocab 4096) on the same batch (8 x 128 tokens), fp32, in the same
process, with the same weights (Tessel's initial weights are exported into the HF model, and the
first step's losses are printed side by side to show both compute the same function):

* ``tessel``: :class:`engine.trainer.Trainer` at TP=PP=DP=1 built exactly as tools/pretrain.py
  builds it (``build_model`` stage, DataParallel flat buffers, the engine Optimizer: global-norm
  clipping + AdamW with the LR schedule); the timed region is ``Trainer.train_step`` — zero_grad,
  forward + backward through the pipeline runtime, tied-embedding/norm/clip bookkeeping, update.
* ``hf``: ``LlamaForCausalLM`` (SDPA attention) + ``torch.optim.AdamW`` (its default foreach
  implementation), cross-entropy of the logits over the same labels, ``clip_grad_norm_(1.0)``.

The two sides and two ceilings are timed round-robin (alternating which side goes first) after
warm-up steps; medians (and the min) of ``--steps`` rounds are reported by wall clock and by this
process's CPU time, which other processes on a shared machine inflate far less than wall time.
The ceilings, timed in the same rotation so load spikes hit them alike:

* the dense fp32 matmul rate (1024^3, same threads: what ``engine.metrics.peak_tflops`` measures
  on CPU at start-up);
* the GEMMs of one training step at the model's own shapes (forward, input-grad and weight-grad
  of every linear and the logit layer) run back to back: the matmul-only time of a step, a tighter
  bound for a model this small than the 1024^3 rate.

MFU of each = model FLOPs per step (``engine.metrics.model_flops_per_step``, docs/metrics.md) /
step time / the 1024^3 matmul rate, by wall clock and by CPU time. Then each side's step is run
unrolled (zero_grad / forward / backward / clip+update) to time the phases on their own (CPU
medians), and ``--profile`` adds torch.profiler's top operators of each side's step.

    .venv/bin/python tools/bench_train_step.py --threads 1 --json docs/benchmarks/train_step.json
"""
from __future__ import annotations

import argparse
import datetime
import io
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
import torch.nn.functional as F  # noqa: E402


def _tessel_trainer(args):
    """A Trainer for TP=PP=DP=1 from the CPU preset with the benchmark's shapes (as tools/pretrain.py)."""
    from engine.config import load_config
    from engine.trainer import Trainer
    from models import build_model, config_from_hf
    from tools.pretrain import flops_spec, hf_config_dict

    overrides = [
        "parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "parallel.sequence_parallel=false",
        f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
        f"model.num_attention_heads={args.heads}",
        f"model.num_key_value_heads={args.kv_heads}", f"model.ffn_hidden_size={args.ffn}",
        f"model.vocab_size={args.vocab}", f"model.max_position_embeddings={max(256, args.seq)}",
        "model.dtype=fp32", f"train.seq_length={args.seq}", f"train.global_batch_size={args.batch}",
        f"train.micro_batch_size={args.batch}", "train.steps=100000", "train.eval_interval=0",
        "optim.warmup_steps=0", "optim.distributed=false", "checkpoint.interval=0",
        "logging.tensorboard=false", "logging.jsonl=false", "logging.progress_bar=off",
    ]
    cfg = load_config("tiny_llama_cpu", overrides)
    cfg.validate_world(1)
    hf = hf_config_dict(cfg.model, vocab_size=args.vocab)
    device = "cpu"  # the HF side runs on CPU too

    def build_stage(mesh, *, pre_process, post_process, layer_range):
        return build_model(hf, tp_group=mesh.tp, sequence_parallel=False, pre_process=pre_process,
                           post_process=post_process, layer_range=layer_range, dtype=torch.float32,
                           device=device, seed=cfg.train.seed,
                           make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by)

    mcfg = config_from_hf(hf)
    trainer = Trainer(cfg, build_stage=build_stage, flops=flops_spec(mcfg), num_layers=mcfg.num_layers,
                      hidden_size=mcfg.hidden_size, run_dir=None, log_stream=io.StringIO())
    return trainer, hf, cfg


def _hf_model(hf: dict, tessel_stage, *, lr: float, weight_decay: float, betas, eps: float):
    """LlamaForCausalLM with Tessel's initial weights, and torch's AdamW over it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from models import export_hf_state_dict

    conf = LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    conf._attn_implementation = "sdpa"
    model = LlamaForCausalLM(conf).to(torch.float32)
    state = export_hf_state_dict(tessel_stage)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise RuntimeError(f"HF weight transfer failed: missing {missing}, unexpected {unexpected}")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return model, opt


def _hf_step(model, opt, batch) -> float:
    opt.zero_grad(set_to_none=True)
    logits = model(input_ids=batch["tokens"]).logits  # (b, s, V)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["labels"].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def _tessel_phases(trainer, batch) -> dict:
    """The Trainer's step unrolled (1 micro-batch, PP=1) so each phase can be timed on its own."""
    state = {}

    def zero():
        trainer.optimizer.zero_grad()

    def forward():
        state["loss"] = trainer._forward_step([batch])(0, None, 0)

    def backward():
        state.pop("loss").backward()

    def update():
        trainer.optimizer.step()

    return {"zero_grad": zero, "forward": forward, "backward": backward, "clip+update": update}


def _hf_phases(model, opt, batch) -> dict:
    state = {}

    def zero():
        opt.zero_grad(set_to_none=True)

    def forward():
        logits = model(input_ids=batch["tokens"]).logits  # (b, s, V)
        state["loss"] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))

    def backward():
        state.pop("loss").backward()

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return {"zero_grad": zero, "forward": forward, "backward": backward, "clip+update": update}


def _time_phases(phases: dict, *, steps: int) -> dict:
    """Median CPU seconds of each phase over ``steps`` unrolled steps (interleaved sides)."""
    cpu = {side: {ph: [] for ph in p} for side, p in phases.items()}
    for i in range(steps):
        for side in (list(phases) if i % 2 == 0 else list(phases)[::-1]):
            for ph, fn in phases[side].items():
                c0 = time.process_time()
                fn()
                cpu[side][ph].append(time.process_time() - c0)
    return {side: {ph: statistics.median(v) for ph, v in d.items()} for side, d in cpu.items()}


def _linear_shapes(args) -> list[tuple[int, int]]:
    """(in, out) of every matmul weight of the model: per layer QKV, out, fc1 (gate|up), fc2; logits."""
    hd = args.hidden // args.heads
    qkv = (args.heads + 2 * args.kv_heads) * hd
    per_layer = [(args.hidden, qkv), (args.heads * hd, args.hidden), (args.hidden, 2 * args.ffn),
                 (args.ffn, args.hidden)]
    return per_layer * args.layers + [(args.hidden, args.vocab)]


MATMUL_N = 1024


def _matmul_fn(n: int = MATMUL_N):
    """One dense fp32 n^3 matmul (what ``engine.metrics.measure_matmul_tflops`` times at start-up)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    return lambda: torch.matmul(a, b)


def _gemms_fn(args):
    """The step's GEMMs alone: y = x W^T, dx = dy W, dW = dy^T x for every linear, back to back."""
    tokens = args.batch * args.seq
    g = torch.Generator().manual_seed(0)
    mats = [(torch.randn(tokens, k, generator=g), torch.randn(n, k, generator=g), torch.randn(tokens, n, generator=g))
            for k, n in _linear_shapes(args)]

    def run():
        for x, w, dy in mats:
            torch.matmul(x, w.t())
            torch.matmul(dy, w)
            torch.matmul(dy.t(), x)
    return run


def _gemm_flops(args) -> float:
    tokens = args.batch * args.seq
    return sum(3 * 2.0 * tokens * k * n for k, n in _linear_shapes(args))


def _profile(step, *, steps: int, top: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    rows = []
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]:
        rows.append({"op": e.key, "calls_per_step": e.count / steps,
                     "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps, "share": e.self_cpu_time_total / total})
    return rows


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=352)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side first (>= 1)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--profile", action="store_true", help="add a torch.profiler breakdown of each side's step")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    for name in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq", "batch", "steps", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads={args.threads} must be >= 1")
    return args


def _time_steps(steps: dict, *, n: int) -> tuple[dict, dict]:
    """Wall and CPU seconds of ``n`` steps per side, round-robin, alternating which side goes first."""
    wall = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    order = list(steps)
    for i in range(n):
        for name in (order if i % 2 == 0 else order[::-1]):
            c0, t0 = time.process_time(), time.perf_counter()
            steps[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def _machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} cores"


def measure(args) -> dict:
    """Build both sides, check they agree on the first step, time them and the ceilings."""
    trainer, hf, cfg = _tessel_trainer(args)
    o = cfg.optim
    hf_model, hf_opt = _hf_model(hf, trainer.chunks[0], lr=o.lr, weight_decay=o.weight_decay,
                                 betas=(o.beta1, o.beta2), eps=o.eps)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "position_ids": torch.arange(args.seq).unsqueeze(0), "loss_mask": torch.ones(args.batch, args.seq)}

    class Loader:  # the same batch forever: the step, not data loading, is measured
        def __next__(self):
            return batch

    loader = Loader()
    steps = {"tessel": lambda: trainer.train_step(loader).loss, "hf": lambda: _hf_step(hf_model, hf_opt, batch)}
    first = {name: fn() for name, fn in steps.items()}  # same weights, same batch: the same loss
    for _ in range(args.warmup - 1):
        for fn in steps.values():
            fn()
    # The ceilings run inside the same rotation, so a load spike on a shared machine hits them too.
    ceilings = {"matmul": _matmul_fn(), "gemms": _gemms_fn(args)}
    for fn in ceilings.values():
        fn()
    wall, cpu = _time_steps({**steps, **ceilings}, n=args.steps)
    med = {k: statistics.median(v) for k, v in wall.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    mm_flops = 2.0 * MATMUL_N ** 3
    mm_wall, mm_cpu = mm_flops / med["matmul"], mm_flops / cmed["matmul"]
    gemm_wall, gemm_cpu = med["gemms"], cmed["gemms"]
    phases = _time_phases({"tessel": _tessel_phases(trainer, batch), "hf": _hf_phases(hf_model, hf_opt, batch)},
                          steps=max(3, args.steps // 2))
    flops = trainer.flops_per_step
    tokens_per_step = args.batch * args.seq
    res = {"date": datetime.date.today().isoformat(), "machine": _machine(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "load_average_1m": os.getloadavg()[0], "args": vars(args),
           "first_step_loss": first, "model_flops_per_step": flops, "matmul_1024_fp32_flops_wall": mm_wall,
           "matmul_1024_fp32_flops_cpu": mm_cpu,
           "matmul_1024_fp32_flops_best_wall": mm_flops / min(wall["matmul"]), "step_gemms_wall_s": gemm_wall,
           "step_gemms_cpu_s": gemm_cpu,
           "step_gemm_flops": _gemm_flops(args), "sides": {}, "phases_cpu_median_s": phases}
    for name in steps:
        w, lo, c = med[name], min(wall[name]), cmed[name]
        res["sides"][name] = {"wall_median_s": w, "wall_min_s": lo, "cpu_median_s": c,
                              "tokens_per_s_median": tokens_per_step / w, "tokens_per_s_best": tokens_per_step / lo,
                              "mfu_wall_median": flops / w / mm_wall, "mfu_cpu_median": flops / c / mm_cpu,
                              "gemm_share_cpu": gemm_cpu / c}
    t, h = res["sides"]["tessel"], res["sides"]["hf"]
    res["ratio_tessel_over_hf"] = {"wall_median": h["wall_median_s"] / t["wall_median_s"],
                                   "wall_min": h["wall_min_s"] / t["wall_min_s"],
                                   "cpu_median": h["cpu_median_s"] / t["cpu_median_s"]}
    if args.profile:
        res["profile"] = {name: _profile(fn, steps=5, top=15) for name, fn in steps.items()}
    return res


def main(argv=None) -> int:
    args = _parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    res = measure(args)
    _print(res)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _print(res: dict) -> None:
    a = res["args"]
    print(f"{res['machine']}, torch {res['torch']}, {res['date']}")
    print(f"training step, Llama h={a['hidden']} L={a['layers']} heads={a['heads']}/{a['kv_heads']} ffn={a['ffn']} "
          f"V={a['vocab']}, batch {a['batch']} x seq {a['seq']}, fp32, {res['threads']} thread(s), "
          f"load avg {res['load_average_1m']:.1f}")
    print(f"first-step loss: tessel {res['first_step_loss']['tessel']:.6f}  hf {res['first_step_loss']['hf']:.6f}")
    print(f"{'side':8} {'wall med ms':>12} {'wall min ms':>12} {'cpu med ms':>11} {'tokens/s med':>13} "
          f"{'MFU wall':>9} {'MFU cpu':>8} {'GEMM share':>11}")
    for name, s in res["sides"].items():
        print(f"{name:8} {s['wall_median_s'] * 1e3:12.2f} {s['wall_min_s'] * 1e3:12.2f} "
              f"{s['cpu_median_s'] * 1e3:11.2f} "
              f"{s['tokens_per_s_median']:13,.0f} {100 * s['mfu_wall_median']:8.2f}% {100 * s['mfu_cpu_median']:7.2f}% "
              f"{100 * s['gemm_share_cpu']:10.1f}%")
    r = res["ratio_tessel_over_hf"]
    print(f"tessel / hf throughput: {r['wall_median']:.3f}x (wall median), {r['wall_min']:.3f}x (wall min), "
          f"{r['cpu_median']:.3f}x (cpu median)")
    print(f"ceilings: fp32 1024^3 matmul {res['matmul_1024_fp32_flops_wall'] / 1e9:.1f} GFLOP/s wall, "
          f"{res['matmul_1024_fp32_flops_cpu'] / 1e9:.1f} GFLOP/s per CPU-second; the step's GEMMs alone "
          f"{res['step_gemms_wall_s'] * 1e3:.2f} ms wall / {res['step_gemms_cpu_s'] * 1e3:.2f} ms CPU "
          f"({res['step_gemm_flops'] / res['step_gemms_cpu_s'] / 1e9:.1f} GFLOP/s per CPU-second); "
          f"model FLOPs/step {res['model_flops_per_step']:.3e}")
    ph = res["phases_cpu_median_s"]
    print("phases (unrolled step, CPU ms, median): " + "; ".join(
        f"{p} tessel {ph['tessel'][p] * 1e3:.2f} / hf {ph['hf'][p] * 1e3:.2f}" for p in ph["tessel"]))
    for name, rows in (res.get("profile") or {}).items():
        print(f"profile {name}: top ops by self CPU time per step")
        for row in rows:
            print(f"  {row['op'][:48]:48} {row['calls_per_step']:7.1f} calls {row['self_ms_per_step']:8.2f} ms "
                  f"{100 * row['share']:5.1f}%")


if __name__ == "__main__":
    sys.exit(main())
