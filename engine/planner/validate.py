"""Published large runs the planner must reproduce (``tools/plan.py --validate``; docs/planner.md).

Each row: the model and layout as the source states them, the reported figure, and where it is from.
The planner predicts the row's model-FLOP throughput per GPU (the source's own FLOP definition: Eq. 7
of Korthikanti et al. 2022, full s^2 attention, no recompute FLOPs = Tessel's ``mfu``) and the row passes
within ``TOLERANCE``. Only figures found in the sources are listed; docs/planner.md says which tables
could not be found and are therefore not validated.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.planner.hardware import gpu as gpu_by_name
from engine.planner.model import from_dims
from engine.planner.predict import Cluster, Layout, Training, predict

TOLERANCE = 0.15  # relative error of the predicted TFLOP/s per GPU
REQUIRED_SHARE = 0.80  # of the rows

MEGATRON_README_2022 = ("Megatron-LM README (2022-2023 versions, 'Model FLOPs Utilization' table; the same figures "
                        "as Korthikanti et al. 2022, Table 5, 'present work' rows), https://github.com/NVIDIA/Megatron-LM")
KORTHIKANTI_T3 = "Korthikanti et al. 2022 (arXiv:2205.05198), Table 3 (model configurations)"


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    name: str
    gpu: str
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    seq_length: int
    global_batch_size: int
    tp: int
    pp: int
    dp: int
    mbs: int
    recompute: str
    reported_mfu: float
    attention: str = "unfused"  # Megatron-LM of 2022 materialised the scores (no flash attention)
    source: str
    config_source: str

    @property
    def reported_tflops(self) -> float:
        return self.reported_mfu * gpu_by_name(self.gpu).bf16_tflops

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


# GPT models (MHA, f = 4h, GELU, LayerNorm, learned positions, tied embeddings), sequence 2048, vocabulary
# 51,200, A100 80GB, sequence parallelism + selective recompute ("present work"), data-parallel size one,
# attention unfused (the paper's selective recompute is of exactly the materialised softmax and dropout).
PUBLISHED: tuple[PublishedRun, ...] = (
    PublishedRun(name="GPT-22B", gpu="a100-80gb", hidden_size=6144, num_layers=48, num_heads=64, vocab_size=51200,
                 seq_length=2048, global_batch_size=4, tp=8, pp=1, dp=1, mbs=1, recompute="selective",
                 reported_mfu=0.415, source=MEGATRON_README_2022, config_source=KORTHIKANTI_T3),
    PublishedRun(name="GPT-175B", gpu="a100-80gb", hidden_size=12288, num_layers=96, num_heads=96, vocab_size=51200,
                 seq_length=2048, global_batch_size=64, tp=8, pp=8, dp=1, mbs=1, recompute="selective",
                 reported_mfu=0.514, source=MEGATRON_README_2022, config_source=KORTHIKANTI_T3),
    PublishedRun(name="GPT-530B", gpu="a100-80gb", hidden_size=20480, num_layers=105, num_heads=128,
                 vocab_size=51200, seq_length=2048, global_batch_size=280, tp=8, pp=35, dp=1, mbs=1,
                 recompute="selective", reported_mfu=0.560, source=MEGATRON_README_2022, config_source=KORTHIKANTI_T3),
    PublishedRun(name="GPT-1T", gpu="a100-80gb", hidden_size=25600, num_layers=128, num_heads=160, vocab_size=51200,
                 seq_length=2048, global_batch_size=512, tp=8, pp=64, dp=1, mbs=1, recompute="selective",
                 reported_mfu=0.563, source=MEGATRON_README_2022, config_source=KORTHIKANTI_T3),
)


@dataclass(frozen=True)
class RowResult:
    run: PublishedRun
    predicted_tflops: float
    predicted_mfu: float
    memory_gib: float

    @property
    def error(self) -> float:
        return (self.predicted_tflops - self.run.reported_tflops) / self.run.reported_tflops

    @property
    def ok(self) -> bool:
        return abs(self.error) <= TOLERANCE


def predict_row(run: PublishedRun) -> RowResult:
    model = from_dims(family="gpt2", hidden_size=run.hidden_size, num_layers=run.num_layers, num_heads=run.num_heads,
                      vocab_size=run.vocab_size, max_positions=run.seq_length, tie_word_embeddings=True)
    g = gpu_by_name(run.gpu)
    cluster = Cluster(gpu=g, nodes=max(1, run.world // 8), gpus_per_node=min(8, run.world))
    tr = Training(seq_length=run.seq_length, global_batch_size=run.global_batch_size, recompute=run.recompute, zero=1,
                  attention=run.attention)
    p = predict(model, Layout(tp=run.tp, pp=run.pp, vp=1, dp=run.dp, cp=1, mbs=run.mbs), tr, cluster)
    return RowResult(run=run, predicted_tflops=p.tflops_per_gpu, predicted_mfu=p.mfu, memory_gib=p.memory_bytes / 2**30)


def validate(rows=PUBLISHED) -> tuple[list[RowResult], bool]:
    """(each row's result, whether at least REQUIRED_SHARE of the rows are within TOLERANCE)."""
    results = [predict_row(r) for r in rows]
    return results, passed([r.ok for r in results])


def passed(oks) -> bool:
    oks = list(oks)
    return bool(oks) and sum(oks) >= REQUIRED_SHARE * len(oks)


def main_validate(*, json_path: str | None = None) -> int:
    """``tools/plan.py --validate``: one line per row, the share within tolerance; exit 0 if it passes."""
    import json
    import sys

    results, ok = validate()
    print(f"{'run':<10} {'GPUs':>5} {'tp':>3} {'pp':>3} {'reported TFLOP/s':>17} {'predicted':>10} {'error':>7}  source")
    for r in results:
        print(f"{r.run.name:<10} {r.run.world:>5} {r.run.tp:>3} {r.run.pp:>3} {r.run.reported_tflops:>17.1f} "
              f"{r.predicted_tflops:>10.1f} {100 * r.error:>+6.1f}%  {r.run.source.split(',')[0]}")
    within = sum(r.ok for r in results)
    print(f"{within} of {len(results)} rows within {100 * TOLERANCE:.0f}% (needed: {100 * REQUIRED_SHARE:.0f}%): "
          + ("PASS" if ok else "FAIL"))
    if json_path:
        doc = {"tolerance": TOLERANCE, "passed": ok, "rows": [
            {"name": r.run.name, "gpu": r.run.gpu, "tp": r.run.tp, "pp": r.run.pp, "dp": r.run.dp,
             "reported_tflops_per_gpu": r.run.reported_tflops, "predicted_tflops_per_gpu": r.predicted_tflops,
             "relative_error": r.error, "source": r.run.source, "config_source": r.run.config_source}
            for r in results]}
        text = json.dumps(doc, indent=1)
        if json_path == "-":
            print(text, file=sys.stdout)
        else:
            with open(json_path, "w") as f:
                f.write(text + "\n")
    return 0 if ok else 1
