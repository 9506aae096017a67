"""What composes with what, as data: one row per combination of layout, optimizer mode, dtype, tied
embeddings and model family. tests/composition/test_matrix.py runs every row through tools/pretrain.py's
own path (train, stop at ``train.max_tokens`` and resume, resume into the row's second layout, export
to Hugging Face); ``python -m tests.composition.matrix`` prints the table docs/composition.md holds.

A capability lands with its rows (recompute, ZeRO-3, FP8, TP overlap, post-training, context and expert
parallelism, zero-bubble schedules, DiLoCo and gradient compression add theirs); a combination it does not support is refused at config time, and
gets a row in REFUSED with the message it must give.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

OPTIMIZERS = {  # optimizer mode -> config overrides
    "plain": ["optim.distributed=false"],
    "zero1": ["optim.distributed=true", "optim.zero_stage=1"],
    "zero2": ["optim.distributed=true", "optim.zero_stage=2"],
    "overlap_param_gather": ["optim.distributed=true", "optim.zero_stage=1", "optim.overlap_param_gather=true"],
    "zero3": ["optim.distributed=true", "optim.zero_stage=3"],
}
FAMILIES = ("llama", "gpt2", "qwen3")
RECOMPUTE_CYCLE = ("none", "selective", "full")  # full_rows: the FP8 rows take these in turn


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vp: int = 1
    dp: int = 1
    sp: bool = False
    schedule: str = "1f1b"
    tp_overlap: str = "none"  # parallel.tp_overlap (ring: collective matmuls, docs/overlap.md)
    early_recv: bool = False  # parallel.p2p_early_recv (pipeline receives posted one action ahead)
    cp: int = 1  # parallel.cp (context parallelism, docs/context_parallel.md)
    cp_comm: str = "ring"  # parallel.cp_comm
    ep: int = 1  # parallel.ep (expert parallelism, docs/moe.md): carved out of dp, so not in the world size

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def overrides(self) -> list[str]:
        return [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.vp={self.vp}",
                f"parallel.dp={self.dp}", f"parallel.sequence_parallel={str(self.sp).lower()}",
                f"parallel.schedule={self.schedule}", f"parallel.tp_overlap={self.tp_overlap}",
                f"parallel.p2p_early_recv={str(self.early_recv).lower()}", f"parallel.cp={self.cp}",
                f"parallel.cp_comm={self.cp_comm}", f"parallel.ep={self.ep}"]

    def __str__(self) -> str:
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("vp", self.vp), ("dp", self.dp),
                                        ("cp", self.cp), ("ep", self.ep)) if v > 1]
        return "x".join(parts or ["1 process"]) + (" sp" if self.sp else "") + (
            f" {self.schedule}" if self.pp > 1 else "") + (f" {self.tp_overlap}" if self.tp_overlap != "none" else "") + (
            " early-recv" if self.early_recv else "") + (f" {self.cp_comm}" if self.cp > 1 else "")


@dataclass(frozen=True)
class Row:
    layout: Layout
    optimizer: str = "plain"
    dtype: str = "fp32"
    tied: bool = False
    family: str = "llama"
    reshard: Layout | None = None  # the second layout a checkpoint of this row resumes into
    reshard_optimizer: str | None = None  # default: the row's own
    fp8: str = "none"  # model.fp8 recipe
    method: str = "pretrain"  # or a posttrain.method (sft, dpo, grpo) from a converted base
    lora: bool = False  # posttrain.lora.rank > 0: adapter-only checkpoints, exported merged
    recompute: str = "none"  # train.activation_checkpointing (docs/memory.md)
    extra: tuple[str, ...] = ()  # further overrides (outer.*, optim.grad_compression, ...), in every run of the row

    @property
    def name(self) -> str:
        return (f"{self.family}-{self.dtype}-{'tied' if self.tied else 'untied'}-{self.optimizer}-"
                + str(self.layout).replace(" ", "-") + ("" if self.fp8 == "none" else f"-fp8{self.fp8}")
                + ("" if self.method == "pretrain" else f"-{self.method}") + ("-lora" if self.lora else "")
                + ("" if self.recompute == "none" else f"-recompute{self.recompute}")
                + "".join("-" + k.rsplit(".", 1)[-1] + "=" + v  # e.g. -method=diloco-inner_steps=4
                          for k, _, v in (o.partition("=") for o in self.extra)))


def L(**kw) -> Layout:  # noqa: N802 - short constructor for the table below
    return Layout(**kw)


# The default rows: every optimizer mode at dp > 1, every schedule, tied and untied, fp32 and bf16,
# three families; each resumes into a different layout of the same world size.
DEFAULT_ROWS: tuple[Row, ...] = (
    Row(L(dp=4), "plain", reshard=L(tp=2, pp=2), reshard_optimizer="zero1"),
    Row(L(dp=2, tp=2, sp=True), "plain", reshard=L(dp=4)),
    Row(L(dp=2, pp=2), "plain", tied=True, reshard=L(tp=2, pp=2, sp=True)),
    Row(L(dp=2, pp=2, schedule="gpipe"), "plain", family="gpt2", tied=True, reshard=L(pp=4, schedule="gpipe")),
    Row(L(dp=4), "zero1", family="gpt2", tied=True, reshard=L(dp=2, tp=2), reshard_optimizer="plain"),
    Row(L(dp=4), "zero2", family="qwen3", reshard=L(tp=4)),
    Row(L(dp=2, tp=2, sp=True), "overlap_param_gather", reshard=L(dp=4), reshard_optimizer="plain"),
    # Found by the full matrix: the last stage's tied output copy missed its post-step all-gather.
    Row(L(dp=2, pp=2), "overlap_param_gather", tied=True, family="gpt2", reshard=L(dp=4)),
    Row(L(dp=2, pp=2, vp=2, schedule="interleaved"), "zero1", reshard=L(dp=2, pp=2)),
    Row(L(tp=2, pp=2, sp=True), "plain", dtype="bf16", tied=True, reshard=L(dp=4), reshard_optimizer="zero1"),
    Row(L(tp=4), "plain", family="qwen3", reshard=L(tp=2, pp=2)),
    Row(L(pp=4, schedule="gpipe"), "plain", family="gpt2", reshard=L(dp=4), reshard_optimizer="zero2"),
    Row(L(dp=4), "zero1", dtype="bf16", tied=True, reshard=L(tp=2, dp=2, sp=True)),
    Row(L(dp=2), "zero2", dtype="bf16", family="qwen3", reshard=L(tp=2)),
    Row(L(), "plain", family="qwen3", tied=True, reshard=None),
    # FP8 (docs/fp8.md): the delayed recipe's amax histories travel in checkpoints and reshard; under full
    # recompute the replayed FP8 forward leaves them as one forward does.
    Row(L(dp=2, tp=2, sp=True), "zero1", fp8="delayed", recompute="full", reshard=L(tp=2, pp=2, sp=True)),
    Row(L(tp=2, pp=2), "plain", dtype="bf16", fp8="tensorwise", reshard=L(dp=4), reshard_optimizer="zero2"),
    # Ring collective matmuls (docs/overlap.md), resumed into the plain path.
    Row(L(tp=2, pp=2, sp=True, tp_overlap="ring", early_recv=True), "plain", tied=True, reshard=L(tp=2, dp=2, sp=True)),
    Row(L(pp=2, vp=2, dp=2, schedule="interleaved", early_recv=True), "zero1", reshard=L(pp=2, dp=2)),
    # Post-training (docs/posttrain.md) from a converted base: LoRA adapters reshard; DPO's reference
    # log-probabilities are recomputed from the base on resume; GRPO regenerates the rollout (same seeds at
    # the same dp size).
    Row(L(tp=2, pp=2, sp=True), "plain", method="sft", lora=True, reshard=L(dp=4), reshard_optimizer="zero1"),
    Row(L(dp=2, pp=2), "zero1", method="dpo", tied=True, reshard=L(dp=2, tp=2, sp=True)),
    Row(L(dp=2, tp=2, sp=True), "zero2", method="grpo", reshard=L(dp=2, pp=2), reshard_optimizer="plain"),
    # Activation recompute (docs/memory.md): a training-time switch, nothing of it in checkpoints.
    Row(L(tp=2, pp=2, sp=True), "plain", family="gpt2", recompute="selective", reshard=L(dp=4),
        reshard_optimizer="zero1"),
    Row(L(pp=2, vp=2, dp=2, schedule="interleaved"), "zero1", recompute="full", reshard=L(dp=2, tp=2, sp=True)),
    # Zero-bubble ZB-H1 (docs/pipeline.md): split backward (B then deferred W), resumed into plain 1F1B.
    Row(L(dp=2, pp=2, schedule="zb-h1"), "zero1", family="gpt2", tied=True, reshard=L(dp=2, pp=2)),
    # ZeRO-3 (docs/data_parallel.md): parameter shards saved as flat pieces, resharded into other stages.
    Row(L(dp=4), "zero3", dtype="bf16", reshard=L(dp=2, tp=2, sp=True), reshard_optimizer="zero1"),
    Row(L(dp=2, pp=2), "zero3", family="gpt2", tied=True, recompute="full", reshard=L(dp=4)),
    Row(L(dp=2, tp=2, sp=True), "zero3", family="qwen3", reshard=L(tp=2, pp=2, sp=True), reshard_optimizer="plain"),
    # Context parallelism (docs/context_parallel.md): cp shards no weight, so a cp2 x pp2 checkpoint
    # resumes into all-to-all attention at cp4.
    Row(L(cp=2, pp=2), "zero1", reshard=L(cp=4, cp_comm="a2a")),
    Row(L(cp=2, pp=2, vp=2, schedule="interleaved"), "zero2", family="qwen3", reshard=L(cp=2, pp=2)),
    # V-placed zero-bubble (docs/pipeline.md): a zbv checkpoint (keys by global layer) resumes into 1F1B.
    Row(L(pp=2, vp=2, dp=2, schedule="zbv"), "zero1", tied=True, reshard=L(pp=2, dp=2)),
    # DiLoCo and PowerSGD (docs/decentralised.md): per-rank state (outer.rank<R>.*, grad_compression.rank<R>.*)
    # resumes into the same layout only. DiLoCo stops mid-cycle (step 2 of H = 4) and ends on a sync step, so
    # the export sees the shared weights, not replica 0's local ones; with FP8 delayed scaling, whose amax
    # histories each replica keeps between syncs (fp8_replica.rank<R>.*).
    Row(L(dp=2, tp=2, sp=True), "plain", fp8="delayed", reshard=None,
        extra=("outer.method=diloco", "outer.inner_steps=4")),
    Row(L(dp=2), "plain", family="qwen3", reshard=None, extra=("optim.grad_compression=powersgd",)),
    # Expert parallelism (docs/moe.md) with ZeRO and context parallelism: expert state sharded over edp (the 2 cp
    # ranks holding the same experts), the rest over dp x cp (4); expert keys are global, so the checkpoint
    # resumes into tp2 at ep1 with the plain optimizer, there with parallel.expert_tp=1 (whole experts on both tp
    # ranks; at tp1 the key changes nothing).
    Row(L(dp=2, cp=2, ep=2), "zero2", family="mixtral", reshard=L(dp=2, tp=2, sp=True), reshard_optimizer="plain",
        extra=("parallel.expert_tp=1",)),
    # FP8 ring collective matmuls (docs/fp8.md): the delayed recipe's state resumes into the non-ring FP8 path.
    Row(L(tp=2, pp=2, sp=True, tp_overlap="ring"), "plain", fp8="delayed", reshard=L(dp=2, tp=2, sp=True)),
    # Streaming DiLoCo (docs/decentralised.md) at dp2 x pp2 with tied embeddings (both copies in fragment 0), 3
    # fragments (H = 3), each reduction overlapping 2 inner steps: the step-2 checkpoint holds two fragments in
    # flight (sent after steps 1 and 2); the final step 4 applies the one due after it and sends the last at once,
    # so with mix 1 the export sees the shared weights.
    Row(L(dp=2, pp=2), "plain", tied=True, reshard=None,
        extra=("outer.method=streaming_diloco", "outer.inner_steps=3", "outer.fragments=3", "outer.overlap_steps=2")),
)
METHODS = ("pretrain", "sft", "dpo", "grpo")
FP8_RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")

# Combinations refused at config time: (overrides, the message fragment the refusal must carry).
REFUSED: tuple[tuple[tuple[str, ...], str], ...] = (
    (("parallel.cp=4", "parallel.cp_comm=hybrid"), "needs parallel.cp_a2a_size"),
    (("parallel.cp=2", "parallel.cp_comm=a2a"), "scatters heads over 2 cp ranks"),
    (("train.activation_checkpointing=selective", "train.recompute_num_layers=1"), "applies to full recompute only"),
    (("optim.distributed=false", "optim.overlap_param_gather=true"), "overlap_param_gather"),
    (("optim.distributed=true", "optim.zero_stage=3", "optim.overlap_param_gather=true"), "prefetches the next one"),
    (("optim.distributed=true", "optim.zero_stage=3", "posttrain.method=grpo", "posttrain.grpo.kl_beta=0.1",
      "data.paths=[]", "posttrain.data=[\"x.jsonl\"]"), "ZeRO-3 shards"),
    # ... and without the reference copy: dp replicas stop generating at different steps (a hang under ZeRO-3)
    (("optim.distributed=true", "optim.zero_stage=3", "posttrain.method=grpo", "data.paths=[]",
      "posttrain.data=[\"x.jsonl\"]"), "their gathers would not pair up"),
    (("model.fp8=rowwise", "model.fp8_backend=te"), "has no Transformer Engine recipe"),
    (("model.fp8=tensorwise", "model.fp8_backend=te", "parallel.tp_overlap=ring"), "TE's own overlap is not wired"),
    (("model.fp8=tensorwise", "model.fp8_exclude=[\"mlp.fc3\"]"), "match no linear"),
    (("model.fp8=tensorwise", "model.ffn_hidden_size=344"), r"multiples of 16.*model.fp8_exclude"),
    (("model.fp8_margin=1",), "model.fp8 = 'none'"),
    (("model.fp8_weight_cache=false",), "model.fp8 = 'none'"),
    (("model.fp8=tensorwise", "model.fp8_backend=te", "model.fp8_weight_cache=true"), "keeps its own weight casts"),
    (("parallel.tp_overlap=symm_mem",), "symm_mem' needs CUDA GPUs"),  # on the CPU; on CUDA it runs
    (("parallel.tp_overlap=symm_mem", "parallel.sequence_parallel=false"), "sequence_parallel = true"),
    (("parallel.tp_overlap=ring", "parallel.sequence_parallel=false"), "sequence_parallel = true"),
    # Split backward (docs/pipeline.md) does not compose with ZeRO-3, V placement included.
    (("parallel.pp=2", "parallel.vp=2", "parallel.schedule=zbv", "optim.distributed=true", "optim.zero_stage=3"),
     "does not compose with ZeRO-3"),
    # DiLoCo and compressed gradients replace the per-step dp reduction that ZeRO shards (docs/decentralised.md).
    (("outer.method=diloco", "outer.inner_steps=4", "optim.distributed=true"), "outer.method='diloco' with ZeRO"),
    (("optim.grad_compression=powersgd", "optim.distributed=true"), "replaces the bucketed all-reduce"),
    # CUDA graphs of the layers (docs/cuda_graphs.md): data parallelism only, no recompute (a GPU feature: its
    # parity is tests/models/test_cuda_graphs.py's GPU test, not a row here)
    (("model.cuda_graph=layers",), "graphs are built for dp only"),  # the preset's tp2 x pp2
    (("model.cuda_graph=layers", "parallel.tp=1", "parallel.pp=1", "train.activation_checkpointing=full"),
     "recompute reruns the layer's forward"),
)


def full_rows() -> list[Row]:
    """The cross product behind ``pytest -m composition_full`` (world size 4 or less)."""
    layouts = [L(dp=4), L(dp=2, tp=2, sp=True), L(dp=2, pp=2), L(tp=2, pp=2, sp=True), L(pp=2, vp=2, dp=2,
               schedule="interleaved"), L(dp=2, pp=2, schedule="gpipe"), L(tp=4), L(pp=4)]
    rows = []
    for layout, opt, dtype, tied, family in itertools.product(layouts, OPTIMIZERS, ("fp32", "bf16"), (False, True),
                                                              FAMILIES):
        if layout.dp == 1 and opt != "plain":
            continue  # the distributed optimizer needs data parallelism to shard over
        if family == "qwen3" and tied:
            continue  # kept small: qwen3 tied is a default row
        rows.append(Row(layout, opt, dtype, tied, family, reshard=L(dp=4) if layout != L(dp=4) else L(tp=2, pp=2)))
    # Ring collective matmuls: every sequence-parallel layout, each optimizer mode it has, fp32/bf16.
    for layout, opt, dtype in itertools.product([L(dp=2, tp=2, sp=True, tp_overlap="ring"),
                                                 L(tp=2, pp=2, sp=True, tp_overlap="ring"),
                                                 L(tp=4, sp=True, tp_overlap="ring")], OPTIMIZERS, ("fp32", "bf16")):
        if layout.dp == 1 and opt != "plain":
            continue
        rows.append(Row(layout, opt, dtype, False, "llama", reshard=L(dp=4)))
    # FP8: every recipe on every layout with TP <= 2 (the test model's attention output is 32 wide: 8 per
    # rank at TP=4, below the 16 an FP8 GEMM needs), one optimizer mode each, fp32 and bf16, recompute
    # none / selective / full in turn.
    for layout, recipe, dtype in itertools.product([lay for lay in layouts if lay.tp <= 2], FP8_RECIPES,
                                                   ("fp32", "bf16")):
        opt = "plain" if layout.dp == 1 else ("zero1", "zero2", "overlap_param_gather", "plain", "zero1")[
            FP8_RECIPES.index(recipe)]
        rows.append(Row(layout, opt, dtype, False, "llama", reshard=L(dp=4) if layout != L(dp=4) else L(tp=2, pp=2),
                        fp8=recipe,
                        recompute=RECOMPUTE_CYCLE[(layouts.index(layout) + FP8_RECIPES.index(recipe)) % 3]))
    # FP8 with the ring collective matmuls: every recipe on both ring layouts with TP = 2, fp32 and bf16.
    for layout, recipe, dtype in itertools.product([L(dp=2, tp=2, sp=True, tp_overlap="ring"),
                                                    L(tp=2, pp=2, sp=True, tp_overlap="ring")], FP8_RECIPES,
                                                   ("fp32", "bf16")):
        opt = "plain" if layout.dp == 1 else ("zero1", "zero2", "overlap_param_gather", "plain", "zero1")[
            FP8_RECIPES.index(recipe)]
        rows.append(Row(layout, opt, dtype, False, "llama", reshard=L(dp=4), fp8=recipe))
    # Post-training from a converted base: every layout, each method (SFT also with LoRA), fp32, one
    # optimizer mode each. GRPO resumes into a layout of the same dp size (its rollout seeds are per dp rank).
    same_dp = {1: [L(tp=2, pp=2, sp=True), L(tp=4), L(pp=4)], 2: [L(dp=2, tp=2, sp=True), L(dp=2, pp=2)], 4: [L(dp=4)]}
    for k, layout in enumerate(layouts):
        for j, (method, lora) in enumerate((("sft", False), ("sft", True), ("dpo", False), ("grpo", False))):
            opt = "plain" if layout.dp == 1 else list(OPTIMIZERS)[(k + j) % len(OPTIMIZERS)]
            if method == "grpo" and opt == "zero3":
                opt = "zero2"  # GRPO's full-weight reference copy is refused with ZeRO-3 (REFUSED below)
            if method == "grpo":
                other = [lay for lay in same_dp[layout.dp] if lay != layout] or [layout]
                reshard, reshard_opt = other[0], ("plain" if opt != "plain" or layout.dp == 1 else "zero1")
            else:
                reshard, reshard_opt = (L(dp=4) if layout != L(dp=4) else L(tp=2, pp=2)), None
            rows.append(Row(layout, opt, "fp32", k % 2 == 1, "llama", reshard=reshard, reshard_optimizer=reshard_opt,
                            method=method, lora=lora))
    return rows


def table(results: dict[str, str] | None = None, rows=DEFAULT_ROWS) -> str:
    """A Markdown table of ``rows`` (with each row's result when given)."""
    head = ("| # | method | family | dtype | fp8 | recompute | embeddings | optimizer | layout | resumes into "
            "| result |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for i, r in enumerate(rows, 1):
        into = "—" if r.reshard is None else f"{r.reshard} ({r.reshard_optimizer or r.optimizer})"
        res = (results or {}).get(r.name, "")
        method = r.method + (" + LoRA" if r.lora else "")
        opt = r.optimizer + "".join(f", `{o}`" for o in r.extra)  # the row's further overrides
        lines.append(f"| {i} | {method} | {r.family} | {r.dtype} | {r.fp8} | {r.recompute} | "
                     f"{'tied' if r.tied else 'untied'} | {opt} | {r.layout} | {into} | {res} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m tests.composition.matrix [results.json] [--full]
    import argparse
    import json

    ap = argparse.ArgumentParser(description="Print the composition matrix as docs/composition.md's table.")
    ap.add_argument("results", nargs="?", help="a results JSON written by the matrix test "
                    "(TESSEL_COMPOSITION_RESULTS=PATH pytest tests/composition/test_matrix.py)")
    ap.add_argument("--full", action="store_true", help="the full cross product's rows, not the default rows")
    a = ap.parse_args()
    results = None
    if a.results:
        with open(a.results) as f:
            results = json.load(f)
    print(table(results, full_rows() if a.full else DEFAULT_ROWS))
