"""Training metrics: model FLOPs and MFU, device peak FLOP/s, memory, and the step logger.

Model FLOPs (docs/metrics.md) count the matmuls of one training step, forward plus backward
(backward = 2x forward), without activation recomputation — the "model FLOPs" of Korthikanti
et al. 2022, so MFU does not reward recomputation. Per token, per layer, forward:

* QKV projection ``2 h (h + 2 d_kv)`` where ``d_kv = n_kv * head_dim`` (GQA; MHA gives 6h^2),
* attention scores and weighted sum ``4 s h`` (full s x s, as SDPA/flash kernels compute for the
  causal case too, and as the paper counts),
* output projection ``2 h^2``,
* MLP ``2 * n_mat * h * f`` with ``n_mat`` = 3 for gated (SwiGLU) and 2 for plain MLPs,

plus the logit layer ``2 h V`` once per token. For GPT (f = 4h, MHA, plain MLP) the per-step total
is exactly Eq. 7 of the paper: ``72 B s l h^2 (1 + s/(6h) + V/(12 h l))``.

``causal=True`` counts the attention term as half (``2 s h``: the causal mask skips the upper
triangle), as Megatron-Core's current FLOP count does; the trainer logs both (``mfu`` and
``mfu_causal``, docs/metrics.md).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class FlopsSpec:
    """The shape facts the FLOP count needs (taken from a model config)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    gated_mlp: bool = True

    def __post_init__(self):
        for f in ("num_layers", "hidden_size", "ffn_hidden_size", "vocab_size", "num_attention_heads"):
            if getattr(self, f) < 1:
                raise ValueError(f"FlopsSpec.{f}={getattr(self, f)} must be >= 1")


def model_flops_per_step(spec: FlopsSpec, *, batch_size: int, seq_length: int, causal: bool = False) -> float:
    """Model FLOPs of one training step (forward + backward) over ``batch_size`` sequences; ``causal``:
    attention scores and weighted sum counted over the lower triangle only (half)."""
    h, s, f, V, L = spec.hidden_size, seq_length, spec.ffn_hidden_size, spec.vocab_size, spec.num_layers
    head_dim = spec.head_dim or h // spec.num_attention_heads
    n_kv = spec.num_key_value_heads or spec.num_attention_heads
    q_dim = spec.num_attention_heads * head_dim
    kv_dim = n_kv * head_dim
    per_token_layer = (2 * h * (q_dim + 2 * kv_dim)  # QKV
                       + (2 if causal else 4) * s * q_dim  # QK^T and attention-weighted V
                       + 2 * q_dim * h  # output projection
                       + 2 * (3 if spec.gated_mlp else 2) * h * f)  # MLP
    per_token = L * per_token_layer + 2 * h * V  # + logits
    return 3.0 * per_token * batch_size * s  # forward + backward (2x forward)


def korthikanti_eq7(*, batch_size: int, seq_length: int, num_layers: int, hidden_size: int,
                    vocab_size: int) -> float:
    """Eq. 7 of Korthikanti et al. 2022 (GPT, f = 4h, no recomputation): the reference for tests."""
    B, s, l, h, V = batch_size, seq_length, num_layers, hidden_size, vocab_size
    return 72.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * h * l))


# Dense bf16 peak per device (no sparsity), TFLOP/s, from vendor datasheets.
PEAK_TFLOPS_BF16 = {
    "H200": 989.0,
    "H100": 989.0,  # SXM; PCIe parts are lower: override with logging.peak_tflops
    "H800": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "GB200": 2500.0,  # before B200: a name is matched by the first key it contains ("NVIDIA GB200" holds "B200")
    "B200": 2250.0,
}


def measure_matmul_tflops(*, n: int = 1024, dtype: torch.dtype = torch.float32, device: str = "cpu",
                          repeats: int = 5) -> float:
    """Measured dense matmul rate (TFLOP/s): the best of ``repeats`` timed n x n x n products."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    torch.matmul(a, b)  # warm-up (allocations, kernel selection)
    best = float("inf")
    for _ in range(repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.matmul(a, b)
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best / 1e12


def peak_tflops(*, override: float | None = None, dtype: torch.dtype = torch.bfloat16) -> tuple[float, str]:
    """Peak FLOP/s per device (TFLOP/s) and where it came from (for the log line).

    Order: explicit override; the datasheet table for a known CUDA device; otherwise (CPU or an
    unknown GPU) a matmul measured now in the training dtype, which is stated in the source text.
    """
    if override is not None:
        if override <= 0:
            raise ValueError(f"logging.peak_tflops={override} must be > 0 (TFLOP/s per device)")
        return float(override), "configured (logging.peak_tflops)"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, val in PEAK_TFLOPS_BF16.items():
            if key in name.replace(" ", ""):
                return val, f"datasheet dense bf16 for {name}"
        t = measure_matmul_tflops(n=8192, dtype=torch.bfloat16, device="cuda")
        return t, f"measured bf16 8192^3 matmul on {name} (not in the datasheet table)"
    mm_dtype = torch.float32 if dtype not in (torch.float32, torch.bfloat16) else dtype
    n = cpu_matmul_size(mm_dtype)
    t = measure_matmul_tflops(n=n, dtype=mm_dtype)
    return t, f"measured {str(mm_dtype).replace('torch.', '')} {n}^3 matmul on CPU at start-up"


def cpu_matmul_size(dtype: torch.dtype, *, largest: int = 1024, budget_s: float = 0.1) -> int:
    """The matmul size for the CPU peak: ``largest`` (1024) unless one product of that size would take
    more than ``budget_s``, estimated from a 256^3 one; then the largest power of two from 256 that fits.
    A CPU without bf16 units (AMD EPYC without AVX512-BF16) runs a bf16 1024^3 product in 2.5 s, so the
    best of 5 would cost 15 s of every bf16 run's start-up; the rate at 256^3 is the same slow path."""
    a = torch.randn(256, 256, dtype=dtype)
    torch.matmul(a, a)  # warm-up
    t0 = time.perf_counter()
    torch.matmul(a, a)
    per_flop = (time.perf_counter() - t0) / 256 ** 3
    n = 256
    while n < largest and per_flop * (2 * n) ** 3 <= budget_s:
        n *= 2
    return n


def memory_bytes() -> int:
    """CUDA max allocated bytes on GPU; resident set size (RSS) of this process on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MetricsLogger:
    """One line per logging step to stdout (or a progress bar on a terminal), JSONL and TensorBoard.

    Only the rank that creates it with ``enabled=True`` (rank 0) writes anything.
    """

    def __init__(self, run_dir: str | None, *, enabled: bool, total_steps: int, jsonl: bool = True,
                 tensorboard: bool = True, progress_bar: str = "auto", stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self._jsonl = None
        self._tb = None
        self._bar = None
        if not enabled:
            return
        if progress_bar not in ("auto", "on", "off"):
            raise ValueError(f"logging.progress_bar={progress_bar!r}: use 'auto', 'on' or 'off'")
        if run_dir is not None:
            os.makedirs(run_dir, exist_ok=True)
            if jsonl:
                self._jsonl_path = os.path.join(run_dir, "metrics.jsonl")
                self._jsonl = open(self._jsonl_path, "a", buffering=1)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
        use_bar = progress_bar == "on" or (progress_bar == "auto" and self.stream.isatty())
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, file=self.stream, dynamic_ncols=True)

    def info(self, msg: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, file=self.stream, flush=True)

    def log(self, record: dict[str, Any], *, prefix: str = "train", echo: bool = True) -> None:
        """Write ``record`` (with ``"split": prefix``) to metrics.jsonl and TensorBoard and, with ``echo``,
        print its line (``echo=False``: the caller printed its own, e.g. the memory report)."""
        if not self.enabled:
            return
        step = int(record["step"])
        if self._jsonl is not None:  # strict JSON: a non-finite number (a diverged loss) is written as null
            text = json.dumps(json_safe({"split": prefix, **record}), sort_keys=True, allow_nan=False)
            self._jsonl.write(text + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(f"{prefix}/{k}", v, step)
        if not echo:
            return
        line = format_line(record, prefix=prefix)
        if self._bar is not None:
            if prefix == "train":
                self._bar.n = step
                self._bar.set_postfix_str(f"loss {record.get('loss', float('nan')):.4f}", refresh=False)
                self._bar.refresh()
            self._bar.write(line)
        else:
            print(line, file=self.stream, flush=True)

    def rewind(self, step: int) -> None:
        """Drop the metrics.jsonl records of steps after ``step`` (a resume runs them again), and a torn last
        line (a crash mid-write); the file is replaced atomically."""
        if self._jsonl is None:
            return
        self._jsonl.close()
        with open(self._jsonl_path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
        kept = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # empty, or torn by a crash
            later = isinstance(record, dict) and isinstance(record.get("step"), (int, float)) and record["step"] > step
            if not later:
                kept.append(line + "\n")
        tmp = f"{self._jsonl_path}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, self._jsonl_path)
        self._jsonl = open(self._jsonl_path, "a", buffering=1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (nan, inf) replaced by None, so that it is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def format_line(r: dict[str, Any], *, prefix: str = "train") -> str:
    if prefix != "train":
        parts = [f"{prefix} step {r['step']}"] + [f"{k} {v:.4f}" for k, v in r.items()
                                                  if k != "step" and isinstance(v, float)]
        return " | ".join(parts)
    return (f"step {r['step']:>5} | loss {r['loss']:.4f} | lr {r['lr']:.3e} | grad_norm {r['grad_norm']:.3f}"
            f" | tokens/s {r['tokens_per_s']:,.0f} | TFLOP/s/dev {r['tflops_per_device']:.3f}"
            f" | MFU {100 * r['mfu']:.2f}%" + (f" (causal {100 * r['mfu_causal']:.2f}%)" if "mfu_causal" in r else "")
            + (f" ({r['precision']})" if r.get("precision") else "")
            + (f" | outer {r['outer_phase']}" if r.get("outer_phase") else "")
            + f" | mem {r['mem_bytes'] / 2**20:,.0f} MiB")
