"""Benchmark: one-process training-step throughput (CPU, or one GPU) of Tessel vs Hugging Face transformers.

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

``--device cuda`` (docs/benchmarks/gpu.md) runs the same sides on a GPU, default ``--dtype bf16``
(Tessel: bf16 parameters, fp32 gradients and master weights; HF: fp32 parameters under
``torch.autocast(bf16)``, fused torch AdamW), usually with ``--preset gpu-1b``. There the sides
run one after another (each is built, warmed up, timed and freed before the next, so that a 1B
model's three copies need not fit at once and ``torch.cuda.max_memory_allocated`` is each side's
own peak); steps are timed with CUDA events. Ceilings, measured first in the same run: an 8192^3
matmul in the run's dtype, and the step's GEMMs at the model's shapes. MFU = model FLOPs per step /
step time / that matmul rate, and also / the datasheet peak (``engine.metrics.peak_tflops``).

``--cuda-graph`` (CUDA only) adds the side ``tessel_graph``: the ``tessel`` side with each layer's training
forward and backward replayed as CUDA graphs (``model.cuda_graph = "layers"``, docs/cuda_graphs.md).

``--compare-kernels`` adds the side ``tessel_ref`` — the same Trainer with ``kernels="reference",
fused_cross_entropy=False`` — so the fused kernels' step speed-up and (on CUDA) peak-memory saving
are measured in one run. On CPU, ``kernels="auto"`` is the reference, so compare there with
``--kernels triton --fused-cross-entropy on`` (Triton interpreter: slow, tiny sizes only).

    python3 tools/bench_train_step.py --device cuda --preset gpu-1b --compare-kernels --json OUT.json
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
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


PRESETS = {  # model and batch shapes; explicit flags override a preset's values
    "cpu-tiny": dict(hidden=128, layers=4, heads=4, kv_heads=2, ffn=352, vocab=4096, seq=128, batch=8),
    # ~1.28B parameters (0.53B of them in the untied embedding and logit layer), Llama-3 vocabulary,
    # 8192 tokens per step. Run one side at a time, as --device cuda does, the largest (HF: fp32
    # weights + fp32 grads + AdamW state = 16 B/param, bf16 logits and their fp32 copy) peaks at an
    # estimated ~55 GB: well inside an 80 GB H100.
    "gpu-1b": dict(hidden=2048, layers=16, heads=16, kv_heads=8, ffn=5632, vocab=128256, seq=2048, batch=4),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FUSED_CE = {"auto": None, "on": True, "off": False}
REFERENCE = ("reference", "off")  # (kernels, fused cross-entropy) of the tessel_ref side


def _side_kernels(name: str, args) -> tuple[str, str]:
    return REFERENCE if name == "tessel_ref" else (args.kernels, args.fused_cross_entropy)


def _tessel_trainer(args, *, kernels: str = "auto", fused_ce: str = "auto", fp8: str = "none",
                    micro_batch: int | None = None, extra: tuple[str, ...] = ()):
    """A Trainer for TP=PP=DP=1 from the CPU preset with the benchmark's shapes (as tools/pretrain.py);
    ``fp8``: model.fp8 (tools/bench_fp8.py); ``micro_batch``: train.micro_batch_size (default: the whole
    batch, one micro-batch); ``extra``: more config overrides."""
    from engine.assembly import build_run
    from engine.config import load_config
    from models.hook import ModelHook, hf_config_from_run

    fce = FUSED_CE[fused_ce]
    overrides = [
        "parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "parallel.sequence_parallel=false",
        f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
        f"model.num_attention_heads={args.heads}",
        f"model.num_key_value_heads={args.kv_heads}", f"model.ffn_hidden_size={args.ffn}",
        f"model.vocab_size={args.vocab}", f"model.max_position_embeddings={max(256, args.seq)}",
        f"model.dtype={args.dtype}", f"model.kernels={kernels}",
        f"model.fused_cross_entropy={'none' if fce is None else str(fce).lower()}",
        f"train.seq_length={args.seq}", f"train.global_batch_size={args.batch}",
        f"train.micro_batch_size={micro_batch or args.batch}", "train.steps=100000", "train.eval_interval=0",
        "optim.warmup_steps=0", "optim.distributed=false", "checkpoint.interval=0",
        "logging.tensorboard=false", "logging.jsonl=false", "logging.progress_bar=off", f"model.fp8={fp8}", *extra,
    ]
    cfg = load_config("tiny_llama_cpu", overrides)
    cfg.validate_world(1)
    hf = hf_config_from_run(cfg.model, vocab_size=args.vocab)
    device, dtype = args.device, DTYPES[args.dtype]  # the HF side runs on the same device
    model = ModelHook.from_hf(hf, dtype=dtype, sequence_parallel=False, seed=cfg.train.seed,
                              make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
                              kernels=kernels, fused_cross_entropy=fce, fp8=fp8)
    if fp8 != "none":
        model.check_fp8(tp=1)
    trainer = build_run(cfg, model=model, world=1, data=False, checkpoints=False, log_stream=io.StringIO(),
                        device=device).trainer
    return trainer, hf, cfg


def _hf_model(hf: dict, state: dict, *, device: str, lr: float, weight_decay: float, betas, eps: float):
    """LlamaForCausalLM (fp32 weights) with Tessel's initial weights ``state``, and torch's AdamW
    over it (its default foreach implementation on CPU, the fused one on CUDA)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    conf = LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    conf._attn_implementation = "sdpa"
    with torch.device(device):  # initialised where it runs: a 1B model's CPU init would take long
        model = LlamaForCausalLM(conf).to(torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise RuntimeError(f"HF weight transfer failed: missing {missing}, unexpected {unexpected}")
    model.train()
    fused = {"fused": True} if device == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **fused)
    return model, opt


def _amp(args):
    """The HF side's precision context: autocast to bf16 over fp32 weights for --dtype bf16."""
    if args.dtype == "fp32":
        return contextlib.nullcontext
    return lambda: torch.autocast(args.device, dtype=torch.bfloat16)


def _hf_step(model, opt, batch, amp=contextlib.nullcontext) -> float:
    opt.zero_grad(set_to_none=True)
    with amp():
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


def _hf_phases(model, opt, batch, amp=contextlib.nullcontext) -> dict:
    state = {}

    def zero():
        opt.zero_grad(set_to_none=True)

    def forward():
        with amp():
            logits = model(input_ids=batch["tokens"]).logits  # (b, s, V)
            state["loss"] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                            batch["labels"].reshape(-1))

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


MATMUL_N = {"cpu": 1024, "cuda": 8192}


def _matmul_fn(n: int = MATMUL_N["cpu"], *, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """One dense n^3 matmul (what ``engine.metrics.measure_matmul_tflops`` times at start-up)."""
    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=g, device=device, dtype=dtype) for _ in range(2))
    return lambda: torch.matmul(a, b)


def _gemms_fn(args, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The step's GEMMs alone: y = x W^T, dx = dy W, dW = dy^T x for every linear, back to back.

    On CPU each linear gets its own operands; on CUDA the layers share one set per distinct shape
    (a 1B model's per-layer operands would take GBs; the GPU kernels do not depend on the data)."""
    tokens = args.batch * args.seq
    g = torch.Generator(device=device).manual_seed(0)
    made: dict = {}

    def operands(k: int, n: int):
        if device == "cuda" and (k, n) in made:
            return made[(k, n)]
        made[(k, n)] = tuple(torch.randn(shape, generator=g, device=device, dtype=dtype)
                             for shape in ((tokens, k), (n, k), (tokens, n)))
        return made[(k, n)]
    mats = [operands(k, n) for k, n in _linear_shapes(args)]

    def run():
        for x, w, dy in mats:
            torch.matmul(x, w.t())
            torch.matmul(dy, w)
            torch.matmul(dy.t(), x)
    return run


def _gemm_flops(args) -> float:
    tokens = args.batch * args.seq
    return sum(3 * 2.0 * tokens * k * n for k, n in _linear_shapes(args))


def _profile(step, *, steps: int, top: int, device: str = "cpu") -> list[dict]:
    """torch.profiler's top operators by self time (tools/kernel_profile.py): CPU op time on CPU, kernel
    time on CUDA (the kernels alone: an op's self device time would count its kernels twice)."""
    from tools.kernel_profile import kernel_table

    table = kernel_table(step, device=device, repeats=steps, warmup=0)
    total = table["total_us"] or 1.0
    return [{"op": k["name"], "calls_per_step": k["calls"], "self_ms_per_step": k["us"] / 1e3, "share": k["us"] / total}
            for k in table["kernels"][:top]]


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="training precision (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-tiny",
                   help="model and batch shapes; the flags below override single values")
    for name in ("hidden", "layers", "heads", "kv-heads", "ffn", "vocab", "seq", "batch"):
        p.add_argument(f"--{name}", type=int, default=None, help="default: the preset's")
    p.add_argument("--kernels", choices=("auto", "triton", "reference"), default="auto",
                   help="the tessel side's model.kernels (auto: Triton on CUDA, reference on CPU)")
    p.add_argument("--fused-cross-entropy", choices=sorted(FUSED_CE), default="auto",
                   help="the tessel side's model.fused_cross_entropy (auto: on for CUDA, off for CPU)")
    p.add_argument("--compare-kernels", action="store_true",
                   help="add the side tessel_ref (kernels=reference, fused_cross_entropy=off)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="add the side tessel_graph: model.cuda_graph=layers (CUDA only)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side first (>= 1)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--profile", action="store_true", help="add a torch.profiler breakdown of each side's step")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq", "batch", "steps", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads={args.threads} must be >= 1")
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False here (no GPU, or a CPU build of "
                f"torch {torch.__version__}); use --device cpu")
    if args.cuda_graph and args.device != "cuda":
        p.error("--cuda-graph adds the side tessel_graph (the layers replayed as CUDA graphs): give --device cuda")
    if args.compare_kernels and _resolved_kernels(args.kernels, args.fused_cross_entropy, args.device) == \
            _resolved_kernels(*REFERENCE, args.device):
        p.error(f"--compare-kernels: --kernels {args.kernels} --fused-cross-entropy {args.fused_cross_entropy} "
                f"on {args.device} is the reference path itself, so both sides would be the same; on CPU "
                "compare with --kernels triton --fused-cross-entropy on (Triton interpreter: tiny sizes)")
    return args


def _resolved_kernels(kernels: str, fused_ce: str, device: str) -> tuple[str, bool]:
    """What build_model runs for these settings: (triton|reference, fused CE on/off)."""
    cuda = device == "cuda"
    k = ("triton" if cuda else "reference") if kernels == "auto" else kernels
    f = FUSED_CE[fused_ce]
    return k, cuda if f is None else f


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


def _time_cuda(fn, *, n: int) -> tuple[list[float], list[float]]:
    """Wall seconds (host, synchronised) and GPU seconds (CUDA events) of ``n`` calls of ``fn``."""
    wall, gpu = [], []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        end.synchronize()
        wall.append(time.perf_counter() - t0)
        gpu.append(start.elapsed_time(end) / 1e3)
    return wall, gpu


def _time_phases_cuda(phases: dict, *, steps: int) -> dict:
    """Median GPU seconds (CUDA events) of each phase of one side over ``steps`` unrolled steps."""
    times = {ph: [] for ph in phases}
    for _ in range(steps):
        for ph, fn in phases.items():
            times[ph].append(_time_cuda(fn, n=1)[1][0])
    return {ph: statistics.median(v) for ph, v in times.items()}


def _machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} cores"


def _batch(args, device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "position_ids": torch.arange(args.seq).unsqueeze(0), "loss_mask": torch.ones(args.batch, args.seq)}
    return {k: v.to(device) for k, v in batch.items()}


def _make_side(name: str, args, shared: dict, batch: dict) -> dict:
    """One side: its step, its unrolled phases and FLOPs. A Tessel side leaves its config, its HF
    config and its initial weights (HF names, on the CPU) in ``shared`` for the HF side."""

    class Loader:  # the same batch forever: the step, not data loading, is measured
        def __next__(self):
            return batch

    if name.startswith("tessel"):
        kernels, fused_ce = _side_kernels(name, args)
        trainer, hf, cfg = _tessel_trainer(args, kernels=kernels, fused_ce=fused_ce,
                                           extra=("model.cuda_graph=layers",) if name == "tessel_graph" else ())
        if "state" not in shared:
            from models import export_hf_state_dict

            state = {k: v.detach().to("cpu", copy=True) for k, v in export_hf_state_dict(trainer.chunks[0]).items()}
            shared.update(hf=hf, cfg=cfg, state=state, flops=trainer.flops_per_step)
        loader = Loader()
        k, f = _resolved_kernels(kernels, fused_ce, args.device)
        return {"step": lambda: trainer.train_step(loader).loss, "phases": _tessel_phases(trainer, batch),
                "flops": trainer.flops_per_step, "kernels": kernels, "fused_cross_entropy": fused_ce,
                "runs": f"{k} kernels, {'fused' if f else 'unfused'} linear+CE"
                        + (", layers as CUDA graphs" if name == "tessel_graph" else "")}
    if "state" not in shared:
        raise RuntimeError("the hf side takes its weights from a tessel side, and none was built")
    o = shared["cfg"].optim
    model, opt = _hf_model(shared["hf"], shared["state"], device=args.device, lr=o.lr,
                           weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps)
    amp = _amp(args)
    return {"step": lambda: _hf_step(model, opt, batch, amp), "phases": _hf_phases(model, opt, batch, amp),
            "flops": shared["flops"]}


def _side_names(args) -> list[str]:
    return (["tessel"] + (["tessel_graph"] if args.cuda_graph else []) + (["tessel_ref"] if args.compare_kernels else [])
            + ["hf"])


def measure(args) -> dict:
    """Build the sides, check they agree on the first step, time them and the ceilings."""
    return _measure_cuda(args) if args.device == "cuda" else _measure_cpu(args)


def _measure_cpu(args) -> dict:
    dtype = DTYPES[args.dtype]
    shared: dict = {}
    batch = _batch(args)
    sides = {name: _make_side(name, args, shared, batch) for name in _side_names(args)}
    steps = {name: side["step"] for name, side in sides.items()}
    first = {name: fn() for name, fn in steps.items()}  # same weights, same batch: the same loss
    for _ in range(args.warmup - 1):
        for fn in steps.values():
            fn()
    # The ceilings run inside the same rotation, so a load spike on a shared machine hits them too.
    n = MATMUL_N["cpu"]
    ceilings = {"matmul": _matmul_fn(n, dtype=dtype), "gemms": _gemms_fn(args, dtype=dtype)}
    for fn in ceilings.values():
        fn()
    wall, cpu = _time_steps({**steps, **ceilings}, n=args.steps)
    med = {k: statistics.median(v) for k, v in wall.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    mm_flops = 2.0 * n ** 3
    mm_wall, mm_cpu = mm_flops / med["matmul"], mm_flops / cmed["matmul"]
    gemm_wall, gemm_cpu = med["gemms"], cmed["gemms"]
    phases = _time_phases({name: side["phases"] for name, side in sides.items()}, steps=max(3, args.steps // 2))
    flops = shared["flops"]
    tokens_per_step = args.batch * args.seq
    mm = f"matmul_{n}_{args.dtype}"
    res = {"date": datetime.date.today().isoformat(), "machine": _machine(), "torch": torch.__version__,
           "device": "cpu", "dtype": args.dtype, "matmul_key": mm,
           "threads": torch.get_num_threads(), "load_average_1m": os.getloadavg()[0], "args": vars(args),
           "first_step_loss": first, "model_flops_per_step": flops, f"{mm}_flops_wall": mm_wall,
           f"{mm}_flops_cpu": mm_cpu,
           f"{mm}_flops_best_wall": mm_flops / min(wall["matmul"]), "step_gemms_wall_s": gemm_wall,
           "step_gemms_cpu_s": gemm_cpu,
           "step_gemm_flops": _gemm_flops(args), "sides": {}, "phases_cpu_median_s": phases}
    for name in steps:
        w, lo, c = med[name], min(wall[name]), cmed[name]
        res["sides"][name] = {"wall_median_s": w, "wall_min_s": lo, "cpu_median_s": c,
                              "tokens_per_s_median": tokens_per_step / w, "tokens_per_s_best": tokens_per_step / lo,
                              "mfu_wall_median": flops / w / mm_wall, "mfu_cpu_median": flops / c / mm_cpu,
                              "gemm_share_cpu": gemm_cpu / c}
        if "kernels" in sides[name]:
            res["sides"][name].update({k: sides[name][k] for k in ("kernels", "fused_cross_entropy", "runs")})

    def ratio(fast: str, slow: str) -> dict:
        f, s = res["sides"][fast], res["sides"][slow]
        return {"wall_median": s["wall_median_s"] / f["wall_median_s"], "wall_min": s["wall_min_s"] / f["wall_min_s"],
                "cpu_median": s["cpu_median_s"] / f["cpu_median_s"]}
    res["ratio_tessel_over_hf"] = ratio("tessel", "hf")
    if args.compare_kernels:
        res["ratio_tessel_over_tessel_ref"] = ratio("tessel", "tessel_ref")
    if args.profile:
        res["profile"] = {name: _profile(fn, steps=5, top=15) for name, fn in steps.items()}
    return res


def _gpu_machine() -> str:
    props = torch.cuda.get_device_properties(0)
    return (f"{torch.cuda.get_device_name(0)} ({props.total_memory / 2 ** 30:.0f} GiB, {props.multi_processor_count} "
            f"SMs), CUDA {torch.version.cuda}; host {_machine()}")


def _measure_cuda(args) -> dict:
    """The GPU run: ceilings first, then each side alone (built, warmed up, timed, freed)."""
    import triton

    from engine.metrics import peak_tflops

    dtype, dev = DTYPES[args.dtype], args.device  # "cuda" (a CPU dry run of this path passes "cpu")
    n = MATMUL_N["cuda"]
    mm = _matmul_fn(n, device=dev, dtype=dtype)
    for _ in range(3):
        mm()
    _, mm_gpu = _time_cuda(mm, n=max(10, args.steps))
    gemms = _gemms_fn(args, device=dev, dtype=dtype)
    gemms()
    _, gemm_gpu = _time_cuda(gemms, n=max(3, args.steps // 2))
    del mm, gemms
    gc.collect()
    torch.cuda.empty_cache()
    mm_rate = 2.0 * n ** 3 / statistics.median(mm_gpu)  # FLOP/s
    gemm_s = statistics.median(gemm_gpu)
    if dtype == torch.bfloat16:
        nominal, nominal_source = peak_tflops(dtype=dtype)
    else:  # engine.metrics has bf16 datasheet figures only
        nominal, nominal_source = None, "no fp32 datasheet figure in engine.metrics.PEAK_TFLOPS_BF16"
    res = {"date": datetime.date.today().isoformat(), "machine": _gpu_machine(), "torch": torch.__version__,
           "triton": triton.__version__, "device": "cuda", "dtype": args.dtype, "args": vars(args),
           "timing": "CUDA events around each step (the steps synchronise on their loss anyway)",
           "peak_memory": "torch.cuda.max_memory_allocated over the timed steps minus what was allocated before "
                          "the side was built (sides run one at a time); resident: allocated between steps",
           f"matmul_{n}_{args.dtype}_flops": mm_rate,
           f"matmul_{n}_{args.dtype}_flops_best": 2.0 * n ** 3 / min(mm_gpu),
           "matmul_key": f"matmul_{n}_{args.dtype}", "nominal_peak_tflops": nominal,
           "nominal_peak_source": nominal_source, "step_gemms_s": gemm_s, "step_gemm_flops": _gemm_flops(args),
           "first_step_loss": {}, "sides": {}}
    tokens_per_step = args.batch * args.seq
    shared: dict = {}
    batch = _batch(args, dev)
    for name in _side_names(args):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        side = None
        try:
            side = _make_side(name, args, shared, batch)
            res["first_step_loss"][name] = side["step"]()
            for _ in range(args.warmup - 1):
                side["step"]()
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated() - base
            peak_first = torch.cuda.max_memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
            wall, gpu = _time_cuda(side["step"], n=args.steps)
            peak = torch.cuda.max_memory_allocated() - base
            phases = _time_phases_cuda(side["phases"], steps=max(3, args.steps // 2))
            prof = _profile(side["step"], steps=3, top=15, device=dev) if args.profile else None
        except torch.cuda.OutOfMemoryError as e:
            res["sides"][name] = {"error": str(e).splitlines()[0] or "CUDA out of memory"}
            print(f"{name}: {res['sides'][name]['error']}", file=sys.stderr)
            continue
        finally:
            flops = (side or {}).get("flops")
            kernels = {k: side[k] for k in ("kernels", "fused_cross_entropy", "runs") if side and k in side}
            side = None  # frees the model, its optimizer state and activations before the next side
        g, lo, w = statistics.median(gpu), min(gpu), statistics.median(wall)
        s = {"gpu_median_s": g, "gpu_min_s": lo, "wall_median_s": w,
             "tokens_per_s_median": tokens_per_step / g, "tokens_per_s_best": tokens_per_step / lo,
             "model_tflops_per_s": flops / g / 1e12, "mfu_vs_matmul": flops / g / mm_rate,
             "mfu_vs_nominal": None if nominal is None else flops / g / (nominal * 1e12),
             "gemm_share": gemm_s / g, "peak_bytes": peak, "peak_build_and_warmup_bytes": peak_first,
             "resident_bytes": resident,
             "phases_gpu_median_s": phases, **kernels}
        if prof is not None:
            s["profile"] = prof
        res["sides"][name] = s
    res["model_flops_per_step"] = shared.get("flops")
    ok = {k for k, v in res["sides"].items() if "error" not in v}

    def ratio(fast: str, slow: str) -> dict | None:
        if not {fast, slow} <= ok:
            return None
        f, s = res["sides"][fast], res["sides"][slow]
        return {"gpu_median": s["gpu_median_s"] / f["gpu_median_s"], "gpu_min": s["gpu_min_s"] / f["gpu_min_s"],
                "peak_memory": f["peak_bytes"] / s["peak_bytes"],
                "peak_memory_saved_bytes": s["peak_bytes"] - f["peak_bytes"]}
    res["ratio_tessel_over_hf"] = ratio("tessel", "hf")
    if args.compare_kernels:
        res["ratio_tessel_over_tessel_ref"] = ratio("tessel", "tessel_ref")
    if args.cuda_graph:
        res["ratio_tessel_graph_over_hf"] = ratio("tessel_graph", "hf")
        res["ratio_tessel_graph_over_tessel"] = ratio("tessel_graph", "tessel")
    return res


def main(argv=None) -> int:
    args = _parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.json:  # fail now, not after the run
        folder = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(folder, exist_ok=True)
    res = measure(args)
    (_print_cuda if args.device == "cuda" else _print)(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _shape_line(res: dict) -> str:
    a = res["args"]
    return (f"training step, Llama h={a['hidden']} L={a['layers']} heads={a['heads']}/{a['kv_heads']} ffn={a['ffn']} "
            f"V={a['vocab']}, batch {a['batch']} x seq {a['seq']}, {res['dtype']}")


def _print_ratios(res: dict) -> None:
    labels = {"wall_median": "wall median", "wall_min": "wall min", "cpu_median": "cpu median",
              "gpu_median": "GPU median", "gpu_min": "GPU min"}
    for key, label in (("ratio_tessel_over_hf", "tessel / hf"),
                       ("ratio_tessel_over_tessel_ref", "tessel / tessel_ref"),
                       ("ratio_tessel_graph_over_hf", "tessel_graph / hf"),
                       ("ratio_tessel_graph_over_tessel", "tessel_graph / tessel")):
        r = res.get(key)
        if r is None:
            continue
        parts = [f"{r[k]:.3f}x ({v})" for k, v in labels.items() if k in r]
        if "peak_memory" in r:
            saved = r["peak_memory_saved_bytes"] / 2 ** 30
            parts.append(f"peak memory {r['peak_memory']:.3f}x ({saved:.2f} GiB saved)")
        print(f"{label} throughput: " + ", ".join(parts))


def _print(res: dict) -> None:
    print(f"{res['machine']}, torch {res['torch']}, {res['date']}")
    print(f"{_shape_line(res)}, {res['threads']} thread(s), load avg {res['load_average_1m']:.1f}")
    print("first-step loss: " + "  ".join(f"{k} {v:.6f}" for k, v in res["first_step_loss"].items()))
    print(f"{'side':10} {'wall med ms':>12} {'wall min ms':>12} {'cpu med ms':>11} {'tokens/s med':>13} "
          f"{'MFU wall':>9} {'MFU cpu':>8} {'GEMM share':>11}")
    for name, s in res["sides"].items():
        print(f"{name:10} {s['wall_median_s'] * 1e3:12.2f} {s['wall_min_s'] * 1e3:12.2f} "
              f"{s['cpu_median_s'] * 1e3:11.2f} "
              f"{s['tokens_per_s_median']:13,.0f} {100 * s['mfu_wall_median']:8.2f}% {100 * s['mfu_cpu_median']:7.2f}% "
              f"{100 * s['gemm_share_cpu']:10.1f}%")
    _print_ratios(res)
    mm, n = res["matmul_key"], res["matmul_key"].split("_")[1]
    print(f"ceilings: {res['dtype']} {n}^3 matmul {res[f'{mm}_flops_wall'] / 1e9:.1f} GFLOP/s wall, "
          f"{res[f'{mm}_flops_cpu'] / 1e9:.1f} GFLOP/s per CPU-second; the step's GEMMs alone "
          f"{res['step_gemms_wall_s'] * 1e3:.2f} ms wall / {res['step_gemms_cpu_s'] * 1e3:.2f} ms CPU "
          f"({res['step_gemm_flops'] / res['step_gemms_cpu_s'] / 1e9:.1f} GFLOP/s per CPU-second); "
          f"model FLOPs/step {res['model_flops_per_step']:.3e}")
    ph = res["phases_cpu_median_s"]
    print("phases (unrolled step, CPU ms, median): " + "; ".join(
        f"{p} " + " / ".join(f"{side} {ph[side][p] * 1e3:.2f}" for side in ph) for p in ph["tessel"]))
    _print_profiles(res, "CPU")


def _print_profiles(res: dict, what: str) -> None:
    for name, rows in (res.get("profile") or {}).items():
        print(f"profile {name}: top ops by self {what} time per step")
        for row in rows:
            print(f"  {row['op'][:48]:48} {row['calls_per_step']:7.1f} calls {row['self_ms_per_step']:8.2f} ms "
                  f"{100 * row['share']:5.1f}%")


def _print_cuda(res: dict) -> None:
    print(f"{res['machine']}, torch {res['torch']}, triton {res['triton']}, {res['date']}")
    print(_shape_line(res))
    print("first-step loss: " + "  ".join(f"{k} {v:.6f}" for k, v in res["first_step_loss"].items()))
    print(f"{'side':10} {'GPU med ms':>11} {'GPU min ms':>11} {'tokens/s med':>13} {'TFLOP/s':>8} "
          f"{'MFU mm':>7} {'MFU nom':>8} {'GEMM share':>11} {'peak GiB':>9} {'resid GiB':>10}  kernels")
    for name, s in res["sides"].items():
        if "error" in s:
            print(f"{name:10} {s['error']}")
            continue
        nom = "n/a" if s["mfu_vs_nominal"] is None else f"{100 * s['mfu_vs_nominal']:.2f}%"
        kern = s.get("runs", "torch (HF, autocast)" if res["dtype"] == "bf16" else "torch (HF)")
        print(f"{name:10} {s['gpu_median_s'] * 1e3:11.2f} {s['gpu_min_s'] * 1e3:11.2f} "
              f"{s['tokens_per_s_median']:13,.0f} {s['model_tflops_per_s']:8.1f} {100 * s['mfu_vs_matmul']:6.2f}% "
              f"{nom:>8} {100 * s['gemm_share']:10.1f}% {s['peak_bytes'] / 2 ** 30:9.2f} "
              f"{s['resident_bytes'] / 2 ** 30:10.2f}  {kern}")
    _print_ratios(res)
    mm = res["matmul_key"]
    nom = ("n/a" if res["nominal_peak_tflops"] is None else f"{res['nominal_peak_tflops']:.0f} TFLOP/s")
    print(f"ceilings: {res['dtype']} {mm.split('_')[1]}^3 matmul {res[f'{mm}_flops'] / 1e12:.1f} TFLOP/s (median; "
          f"best {res[f'{mm}_flops_best'] / 1e12:.1f}); nominal {nom} ({res['nominal_peak_source']}); the step's "
          f"GEMMs alone {res['step_gemms_s'] * 1e3:.2f} ms ({res['step_gemm_flops'] / res['step_gemms_s'] / 1e12:.1f} "
          f"TFLOP/s); model FLOPs/step "
          + ("n/a" if res["model_flops_per_step"] is None else f"{res['model_flops_per_step']:.3e}"))
    for name, s in res["sides"].items():
        if "phases_gpu_median_s" in s:
            print(f"phases {name} (unrolled step, GPU ms, median): " + "; ".join(
                f"{p} {v * 1e3:.2f}" for p, v in s["phases_gpu_median_s"].items()))
    _print_profiles({"profile": {k: v["profile"] for k, v in res["sides"].items() if "profile" in v}}, "GPU")


if __name__ == "__main__":
    sys.exit(main())
