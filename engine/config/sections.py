"""The per-component config sections: model, parallel, train, optim, data, checkpoint, logging, fault.

Each section is a frozen ``@dataclass(kw_only=True)`` validated in ``__post_init__`` on its own; checks
that need two sections (tp divides the heads, warmup fits in the steps, ...) live in the root
``TesselConfig`` (engine/config/schema.py). All errors are ``ValueError``s naming the dotted field
and the fix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.config._fields import Section
from engine.ops import BACKENDS
from engine.ops.fp8_linear import RECIPES as FP8_RECIPES
from engine.optim import DECAY_STYLES, NO_DECAY_GROUPS, NONFINITE_ACTIONS as NONFINITE
from parallel.context_parallel import CP_COMM
from parallel.expert_parallel.dispatch import DISPATCHERS as MOE_DISPATCHERS
from parallel.expert_parallel.router import check_expert_tp
from parallel.mesh import AXES as MESH_AXES
from parallel.pipeline.actions import SCHEDULE_NAMES as SCHEDULES
from parallel.tensor_parallel.overlap import TP_OVERLAP

# Choice lists come from their owners (the imports above). models/ sits above the engine, so the
# families are listed here; tests/engine/test_config.py checks them against models.FAMILIES.
FAMILIES = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe")
# Families with learned absolute positions and plain multi-head attention (no RoPE, no GQA).
LEARNED_POSITION_FAMILIES = ("gpt2",)
DTYPES = ("bf16", "fp32")
KERNELS = BACKENDS  # model.kernels: engine/ops' backend choice
RECOMPUTE = ("none", "selective", "full")  # train.activation_checkpointing (docs/memory.md)
PROGRESS_BAR = ("auto", "on", "off")
FP8 = ("none",) + FP8_RECIPES  # model.fp8
FP8_BACKENDS = ("tessel", "te")
CUDA_GRAPHS = ("none", "layers")  # model.cuda_graph


def _finite(value: float) -> bool:
    # math.isfinite would overflow on huge Python ints, which are finite anyway.
    return not isinstance(value, float) or math.isfinite(value)


def check_min(section: Section, key: str, minimum: float, *, why: str = "") -> None:
    """Raise unless ``section.key`` is None or a finite number >= ``minimum``."""
    value = getattr(section, key)
    if value is None:
        return
    if not (value >= minimum and _finite(value)):
        reason = f" ({why})" if why else ""
        raise ValueError(f"{section.SECTION}.{key}={value} must be >= {minimum}{reason}; set "
                         f"{section.SECTION}.{key} to a value >= {minimum}")


def check_positive(section: Section, key: str) -> None:
    """Raise unless ``section.key`` is None or a finite number > 0."""
    value = getattr(section, key)
    if value is not None and not (value > 0 and _finite(value)):
        raise ValueError(f"{section.SECTION}.{key}={value} must be > 0; set a positive value")


def check_choice(section: Section, key: str, choices: tuple[str, ...]) -> None:
    value = getattr(section, key)
    if value not in choices:
        raise ValueError(f"{section.SECTION}.{key}={value!r} is not valid; choose one of: "
                         f"{', '.join(choices)}")


def check_nonempty(section: Section, key: str) -> None:
    value = getattr(section, key)
    if value is not None and not value.strip():
        raise ValueError(f"{section.SECTION}.{key} is an empty string; give a value or remove the "
                         "key")


@dataclass(kw_only=True, frozen=True)
class ModelConfig(Section):
    """The architecture, as plain data (the engine never imports models/).

    The architecture comes from ``hf_config`` (path to a Hugging Face config.json), overridden by
    the explicit fields below; a field left ``None`` is taken from hf_config (or the family's
    default, e.g. ``num_key_value_heads = num_attention_heads``). Without hf_config, hidden_size,
    num_layers and num_attention_heads are required. (Size presets are whole TOML files: configs/.)
    ``vocab_size=None`` with no other source means "the tokenizer's vocabulary size".
    ``head_dim=None`` means ``hidden_size // num_attention_heads``.
    ``kernels``: "auto" runs engine/ops' fused Triton kernels (RMSNorm, SwiGLU, RoPE) on CUDA and the
    PyTorch references elsewhere; "triton" or "reference" forces one. ``fused_cross_entropy``: the
    loss by the chunked linear + cross-entropy (no logits tensor); unset = on CUDA only.
    ``fp8``: "none", or the FP8 recipe of every column- and row-parallel linear (docs/fp8.md):
    "tensorwise", "delayed" (amax history of ``fp8_amax_history`` steps, scale divided by
    2**``fp8_margin``; TE's default margin 0 saturates activations of small, fast-changing models: use
    1 there, docs/fp8.md), "rowwise", "blockwise" or "mxfp8" (1 x 32 power-of-two blocks; emulated by an
    fp32 matmul on the tessel backend, TE's MXFP8 on Blackwell). ``fp8_exclude`` lists linears kept in high
    precision ("mlp.fc2", "layers.0.attention.qkv", ...). ``fp8_backend``: "tessel" (engine/ops on
    torch._scaled_mm) or "te" (Transformer Engine's GEMMs inside Tessel's TP linears; never run with a real
    TE here, docs/fp8.md).
    ``fp8_weight_cache``: cast each weight to FP8 once per step and reuse the casts across the step's
    micro-batches and recompute (TE's is_first_microbatch); unset = on, except under ZeRO-3, where it
    would hold every layer's FP8 weight for the whole step. Costs up to 2 bytes per FP8 weight element
    during the step (docs/fp8.md).
    ``cuda_graph``: "none", or "layers": each transformer layer's training forward and backward captured
    once as CUDA graphs and replayed (one launch each instead of dozens: the host's share of the step;
    docs/cuda_graphs.md). CUDA only; every micro-batch the same shape; tp, cp, ep and pp 1.
    """

    SECTION = "model"

    family: str = "llama"
    hf_config: str | None = None
    hidden_size: int | None = None
    num_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    ffn_hidden_size: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    rope_theta: float | None = None
    tie_word_embeddings: bool | None = None
    norm_eps: float | None = None
    make_vocab_size_divisible_by: int = 128
    dtype: str = "bf16"
    kernels: str = "auto"
    fused_cross_entropy: bool | None = None
    fp8: str = "none"
    fp8_exclude: list[str] = field(default_factory=list)
    fp8_backend: str = "tessel"
    fp8_amax_history: int = 16
    fp8_margin: int = 0
    fp8_weight_cache: bool | None = None
    cuda_graph: str = "none"

    def _validate(self) -> None:
        check_choice(self, "family", FAMILIES)
        self._validate_fp8()
        check_choice(self, "cuda_graph", CUDA_GRAPHS)
        if self.cuda_graph != "none" and self.fp8 != "none" and self.fp8_backend == "te":
            raise ValueError("model.cuda_graph='layers' with model.fp8_backend='te' is not built (Transformer "
                             "Engine's modules keep host-side FP8 state per call); set model.fp8_backend='tessel' "
                             "or model.cuda_graph='none'")
        if self.cuda_graph != "none" and self.fp8 not in ("none", "tensorwise", "delayed"):
            raise ValueError(f"model.cuda_graph='layers' with model.fp8={self.fp8!r} has not run under CUDA graphs "
                             "(its GEMM paths are chosen by checks that read results on the host, once per process); "
                             "use model.fp8 'tensorwise' or 'delayed' with the graphs, or model.cuda_graph='none'")
        if self.cuda_graph != "none" and self.fp8_weight_cache:
            raise ValueError("model.fp8_weight_cache=true with model.cuda_graph='layers': a graph replays the weight "
                             "casts it captured, so a cast kept across micro-batches is not reused but read stale; "
                             "remove model.fp8_weight_cache (off under graphs) or set model.cuda_graph='none'")
        check_choice(self, "dtype", DTYPES)
        check_choice(self, "kernels", KERNELS)
        check_nonempty(self, "hf_config")
        for key in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "ffn_hidden_size", "vocab_size", "max_position_embeddings",
                    "make_vocab_size_divisible_by"):
            check_min(self, key, 1)
        check_positive(self, "rope_theta")
        check_positive(self, "norm_eps")
        if self.hf_config is None:
            missing = [k for k in ("hidden_size", "num_layers", "num_attention_heads")
                       if getattr(self, k) is None]
            if missing:
                raise ValueError(
                    "model has no architecture: set model.hf_config (a Hugging Face config.json) "
                    "or the explicit sizes (missing: "
                    + ", ".join(f"model.{k}" for k in missing) + ")")
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv_heads is not None and heads % kv_heads:
            raise ValueError(f"model.num_attention_heads={heads} is not divisible by "
                             f"model.num_key_value_heads={kv_heads}; grouped-query attention "
                             "needs each kv head to serve the same number of query heads")
        if self.head_dim is None and heads is not None and self.hidden_size is not None \
                and self.hidden_size % heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by "
                             f"model.num_attention_heads={heads}; change one of them or set "
                             "model.head_dim explicitly")
        if self.family in LEARNED_POSITION_FAMILIES:
            if self.rope_theta is not None:
                raise ValueError(f"model.rope_theta is set but family '{self.family}' uses "
                                 "learned position embeddings, not RoPE; remove model.rope_theta")
            if kv_heads is not None and heads is not None and kv_heads != heads:
                raise ValueError(f"model.num_key_value_heads={kv_heads} differs from "
                                 f"model.num_attention_heads={heads} but family '{self.family}' "
                                 "has no grouped-query attention; remove "
                                 "model.num_key_value_heads")

    def _validate_fp8(self) -> None:
        check_choice(self, "fp8", FP8)
        check_choice(self, "fp8_backend", FP8_BACKENDS)
        check_min(self, "fp8_amax_history", 1)
        check_min(self, "fp8_margin", 0)
        if self.fp8_margin > 16:
            raise ValueError(f"model.fp8_margin={self.fp8_margin} divides the scales by 2**{self.fp8_margin}, which "
                             "pushes every value into the format's subnormals; use 0-2 (16 at most)")
        if self.fp8 == "none":
            used = self.changed("fp8_exclude", "fp8_backend", "fp8_amax_history", "fp8_margin", "fp8_weight_cache")
            if used:
                raise ValueError(f"model.{used[0]} is set but model.fp8 = 'none' (no FP8); set model.fp8 to one of "
                                 f"{FP8[1:]} or remove model.{used[0]}")
        elif self.fp8 != "delayed":
            used = self.changed("fp8_amax_history", "fp8_margin")
            if used:
                raise ValueError(f"model.{used[0]} only applies to model.fp8 = 'delayed', not '{self.fp8}'; remove it")
        if self.fp8_backend == "te" and self.fp8_weight_cache is not None:
            raise ValueError("model.fp8_weight_cache applies to model.fp8_backend = 'tessel' (Transformer Engine "
                             "keeps its own weight casts); remove it")
        for i, name in enumerate(self.fp8_exclude):
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"model.fp8_exclude[{i}]={name!r} must be a linear's name, e.g. 'mlp.fc2'")
        if self.fp8 != "none" and self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"model.fp8 needs model.dtype bf16 or fp32, not {self.dtype}")

    def padded_vocab_size(self, vocab_size: int, *, tp: int) -> int:
        """``vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by * tp``.

        Every TP rank then holds an equal, aligned slice of the embedding and output layer.
        """
        if vocab_size < 1 or tp < 1:
            raise ValueError("padded_vocab_size needs vocab_size >= 1 and tp >= 1, got "
                             f"vocab_size={vocab_size}, tp={tp}")
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-vocab_size // multiple) * multiple


@dataclass(kw_only=True, frozen=True)
class ParallelConfig(Section):
    """Parallel degrees and layout.

    ``dp=-1`` infers the data-parallel size from the world size (see
    ``TesselConfig.validate_world``). ``ep`` (expert parallel) is carved out of the dp ranks,
    so it is not a factor of the world size. ``order`` lists the mesh axes outermost first: in
    the default "dp-pp-cp-tp", tp is innermost (consecutive ranks form a TP group).
    ``pipeline_layout`` gives the number of transformer layers of each of the ``pp * vp``
    (virtual) stages, in stage order; ``None`` splits the layers evenly.
    ``sequence_parallel`` at ``tp=1`` is accepted and has no effect (there is nothing to shard),
    so one preset can scale from tp=1 upwards; ``sequence_parallel_active`` says whether it acts.
    ``vp > 1`` and ``schedule="interleaved"`` go together. ``schedule="zb-h1"`` splits each backward
    into input and weight gradients (docs/pipeline.md, zero-bubble schedules; not with ZeRO-3);
    "zbv" and "dualpipev" split it too, with two chunks per rank in a V (``vp=2``). ``tp_overlap``: "none", or "ring" to run
    the sequence-parallel linears as ring collective matmuls, communication under the GEMMs
    (docs/overlap.md; needs tp >= 2 and sequence_parallel); "symm_mem" the same through PyTorch's
    symmetric-memory collective matmuls (CUDA GPUs with NVLink only; not with model.fp8).
    ``p2p_early_recv``: post each pipeline receive one action ahead and let sends complete in the
    background (``parallel.pipeline.actions.p2p_plan``; the same messages, the same results).
    ``cp`` (context parallelism, docs/context_parallel.md): each sequence is split over cp ranks (zigzag);
    ``cp_comm`` says how attention spans them: "ring" (K/V rotate by p2p), "a2a" (all-to-all over heads;
    the heads after tp must divide by cp) or "hybrid" (all-to-all inside blocks of ``cp_a2a_size`` cp
    ranks, ring across the blocks; ``cp_a2a_size`` is read by "hybrid" only).
    ``ep`` (docs/moe.md): each MoE layer's experts are split over ``ep`` consecutive dp ranks (at each cp
    index; ep divides dp); expert gradients reduce over the dp x cp ranks holding the same experts.
    ``moe_dispatcher``: "alltoall" (tokens travel to their experts' ranks) or "allgather" (every rank gathers
    the ep group's tokens; small ep).
    ``moe_bias_update_rate`` > 0: aux-loss-free load balancing (DeepSeek-V3), a per-expert router bias for
    the top-k selection moved by that step toward balance after every step (0: off).
    ``expert_tp``: None (= ``tp``: every expert sharded over the tp group like the dense MLP) or 1 (experts
    whole on every tp rank, each tp rank routing its own sequence chunk; needs ``sequence_parallel`` at
    tp > 1); ``expert_tp_size`` is the resolved value.
    """

    SECTION = "parallel"

    tp: int = 1
    pp: int = 1
    vp: int = 1
    dp: int = -1
    cp: int = 1
    cp_comm: str = "ring"
    cp_a2a_size: int | None = None
    ep: int = 1
    moe_dispatcher: str = "alltoall"
    moe_bias_update_rate: float = 0.0
    expert_tp: int | None = None
    sequence_parallel: bool = False
    order: str = "dp-pp-cp-tp"
    pipeline_layout: list[int] | None = None
    schedule: str = "1f1b"
    tp_overlap: str = "none"
    p2p_early_recv: bool = False

    def _validate(self) -> None:
        check_choice(self, "tp_overlap", TP_OVERLAP)
        if self.p2p_early_recv and self.pp == 1:
            raise ValueError("parallel.p2p_early_recv posts pipeline receives ahead, but parallel.pp = 1 has no "
                             "pipeline; remove it or set parallel.pp >= 2")
        for key in ("tp", "pp", "vp", "cp", "ep"):
            check_min(self, key, 1, why="a parallel degree")
        check_choice(self, "cp_comm", CP_COMM)
        check_min(self, "cp_a2a_size", 1, why="the cp ranks of one all-to-all block")
        if self.cp_comm == "hybrid":
            a = self.cp_a2a_size
            if a is None or self.cp % a:
                got = "" if a is None else f" (got {a}, which does not divide it)"
                raise ValueError(f"parallel.cp_comm='hybrid' needs parallel.cp_a2a_size, a divisor of parallel.cp="
                                 f"{self.cp}{got} (all-to-all inside blocks of that many cp ranks, ring across them); "
                                 f"set it to one of {[d for d in range(1, self.cp + 1) if self.cp % d == 0]}")
        elif self.cp_comm != "ring" and self.cp == 1:
            raise ValueError(f"parallel.cp_comm={self.cp_comm!r} chooses how attention spans the context-parallel "
                             "ranks, but parallel.cp=1; remove it or set parallel.cp >= 2")
        elif self.cp_a2a_size is not None:
            raise ValueError(f"parallel.cp_a2a_size={self.cp_a2a_size} is read by parallel.cp_comm='hybrid' only "
                             f"(cp_comm is {self.cp_comm!r}); remove it or set parallel.cp_comm='hybrid'")
        check_choice(self, "moe_dispatcher", MOE_DISPATCHERS)
        check_min(self, "moe_bias_update_rate", 0, why="0 turns aux-loss-free balancing off; DeepSeek-V3 uses 1e-3")
        check_expert_tp(self.expert_tp, tp=self.tp, sequence_parallel=self.sequence_parallel_active)
        if self.dp != -1 and self.dp < 1:
            raise ValueError(f"parallel.dp={self.dp} is not valid; set parallel.dp=-1 to infer it "
                             "from the world size, or a degree >= 1")
        check_choice(self, "schedule", SCHEDULES)
        if self.vp > 1 and self.pp == 1:
            raise ValueError(f"parallel.vp={self.vp} needs parallel.pp > 1 (virtual stages are "
                             "interleaved across pipeline ranks); set parallel.vp=1 or "
                             "parallel.pp >= 2")
        if self.schedule == "zb-h1" and self.pp < 2:
            raise ValueError(f"parallel.schedule='zb-h1' fills the pipeline's bubble with deferred weight gradients, "
                             f"but parallel.pp={self.pp} has no pipeline and no bubble; set parallel.schedule='1f1b', "
                             "or parallel.pp >= 2")
        if self.schedule in ("zbv", "dualpipev"):
            # Two chunks per rank folded into a V (stages r and 2 pp - 1 - r): docs/pipeline.md.
            if self.pp < 2 or self.vp != 2:
                raise ValueError(f"parallel.schedule='{self.schedule}' places two model chunks per pipeline rank "
                                 f"in a V and needs parallel.vp=2 and parallel.pp >= 2 (got vp={self.vp}, "
                                 f"pp={self.pp}); set parallel.vp=2 and parallel.pp >= 2, or use "
                                 "parallel.schedule='zb-h1' (one chunk per rank)")
        elif self.vp > 1 and self.schedule != "interleaved":
            raise ValueError(f"parallel.vp={self.vp} needs parallel.schedule='interleaved' (got "
                             f"'{self.schedule}'); set parallel.schedule=interleaved (or, at vp=2, zbv or "
                             "dualpipev: two chunks per rank in a V), or parallel.vp=1")
        if self.schedule == "interleaved" and self.vp == 1:
            raise ValueError("parallel.schedule='interleaved' needs parallel.vp > 1 virtual "
                             "stages per rank; set parallel.vp (e.g. 2) or parallel.schedule=1f1b")
        axes = self.order.split("-")
        if sorted(axes) != sorted(MESH_AXES):
            raise ValueError(f"parallel.order={self.order!r} must name each of "
                             f"{', '.join(MESH_AXES)} exactly once, '-'-separated, outermost "
                             "first; e.g. 'dp-pp-cp-tp' (tp innermost)")
        if self.pipeline_layout is not None:
            layout, stages = self.pipeline_layout, self.pp * self.vp
            if len(layout) != stages:
                raise ValueError(f"parallel.pipeline_layout has {len(layout)} entries but "
                                 f"parallel.pp*vp = {self.pp}*{self.vp} = {stages} stages; give "
                                 "one layer count per (virtual) stage")
            if any(n < 0 for n in layout) or sum(layout) < 1:
                raise ValueError(f"parallel.pipeline_layout={layout} must hold layer counts >= 0 "
                                 "with a positive total")

    @property
    def model_parallel_size(self) -> int:
        """tp * pp * cp: the ranks one model replica spans."""
        return self.tp * self.pp * self.cp

    @property
    def cp_head_scatter(self) -> int:
        """The cp ranks one attention all-to-all scatters heads over: cp (a2a), cp_a2a_size (hybrid), else 1."""
        if self.cp == 1:
            return 1
        return {"a2a": self.cp, "hybrid": self.cp_a2a_size or 1}.get(self.cp_comm, 1)

    @property
    def sequence_parallel_active(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    @property
    def expert_tp_size(self) -> int:
        """The experts' tensor-parallel size: ``expert_tp``, or ``tp`` when unset (docs/moe.md)."""
        return self.tp if self.expert_tp is None else self.expert_tp

    @property
    def axes_outermost_first(self) -> list[str]:
        return self.order.split("-")


@dataclass(kw_only=True, frozen=True)
class TrainConfig(Section):
    """The training loop. ``global_batch_size`` and ``micro_batch_size`` count sequences of
    ``seq_length`` tokens. Training stops after ``steps`` optimizer steps or, if set, once
    ``max_tokens`` tokens were consumed, whichever comes first. ``eval_interval=0`` disables
    evaluation. ``activation_checkpointing`` (activation recompute, docs/memory.md): "none";
    "selective" recomputes core attention in backward; "full" recomputes whole layers, keeping only
    each layer's input, and with ``recompute_num_layers`` = N only the first N layers of each pipeline
    stage (None: all). ``run_dir`` holds logs, the resolved config and, by default, checkpoints.
    """

    SECTION = "train"

    steps: int = 1000
    max_tokens: int | None = None
    seed: int = 1234
    global_batch_size: int = 32
    micro_batch_size: int = 1
    seq_length: int = 1024
    eval_interval: int = 1000
    eval_iters: int = 10
    log_interval: int = 10
    activation_checkpointing: str = "none"
    recompute_num_layers: int | None = None
    run_dir: str = "runs/tessel"

    def last_step(self, rows_per_sample: int = 1) -> int:
        """The run's last step: ``steps``, or the first step whose tokens reach ``max_tokens`` when that is
        earlier (``rows_per_sample``: rows a sample trains on, 2 for a DPO pair)."""
        if not self.max_tokens:
            return self.steps
        return min(self.steps, math.ceil(self.max_tokens / (self.global_batch_size * rows_per_sample * self.seq_length)))

    def _validate(self) -> None:
        for key in ("steps", "max_tokens", "global_batch_size", "micro_batch_size", "seq_length",
                    "log_interval"):
            check_min(self, key, 1)
        check_min(self, "eval_interval", 0, why="0 disables evaluation")
        check_min(self, "eval_iters", 0)
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"train.seed={self.seed} is out of range; choose 0 <= seed < 2**32")
        if self.global_batch_size % self.micro_batch_size:
            mbs = self.micro_batch_size
            raise ValueError(f"train.global_batch_size={self.global_batch_size} is not divisible "
                             f"by train.micro_batch_size={mbs}; choose a multiple of {mbs}")
        if self.eval_interval > 0 and self.eval_iters == 0:
            raise ValueError(f"train.eval_iters=0 with train.eval_interval={self.eval_interval}; "
                             "set train.eval_iters >= 1, or train.eval_interval=0 to disable eval")
        check_choice(self, "activation_checkpointing", RECOMPUTE)
        check_min(self, "recompute_num_layers", 1, why="None recomputes every layer of a stage")
        if self.recompute_num_layers is not None and self.activation_checkpointing != "full":
            raise ValueError(f"train.recompute_num_layers={self.recompute_num_layers} applies to full recompute "
                             f"only, but train.activation_checkpointing={self.activation_checkpointing!r}; set "
                             "train.activation_checkpointing='full' or leave train.recompute_num_layers unset")
        check_nonempty(self, "run_dir")


@dataclass(kw_only=True, frozen=True)
class OptimConfig(Section):
    """AdamW and the learning-rate schedule.

    ``lr`` is the peak after ``warmup_steps`` of linear warmup; the decay (``decay_style``) ends at
    ``min_lr`` on the last step. ``wsd`` (warmup-stable-decay) holds ``lr`` and decays during the
    last ``wsd_decay_fraction`` of the steps. ``clip_grad=0`` disables clipping.
    ``distributed`` shards the optimizer state over data-parallel ranks: ``zero_stage`` 1 keeps
    the full fp32 gradient buffer, 2 keeps only each rank's gradient shard between micro-batches'
    reductions, 3 shards the parameters too and gathers them layer by layer (see
    docs/data_parallel.md and docs/memory.md); ``overlap_param_gather`` needs it (stages 1 and 2).
    ``overlap_grad_reduce`` launches each bucket's reduction from backward hooks on the last
    micro-batch. ``no_decay_on`` lists parameter groups exempt from weight
    decay (norms, biases, embeddings). ``nonfinite``: on an inf/nan gradient norm, ``skip`` the
    step or ``stop`` training. ``max_skipped_steps``: with ``skip``, the most consecutive skipped steps
    a run survives; one more stops it with a non-zero exit (a diverged run; None: never).
    """

    SECTION = "optim"

    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 0
    decay_style: str = "cosine"
    wsd_decay_fraction: float = 0.2
    clip_grad: float = 1.0
    distributed: bool = False
    zero_stage: int = 1
    bucket_size_mb: float = 25.0
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    no_decay_on: list[str] = field(default_factory=lambda: ["norms", "biases", "embeddings"])
    nonfinite: str = "skip"
    max_skipped_steps: int | None = 10
    # Compressed data-parallel gradients (parallel/data_parallel/compression.py, docs/decentralised.md).
    grad_compression: str = "none"
    powersgd_rank: int = 4
    powersgd_start_step: int = 0  # plain all-reduce steps before PowerSGD starts (torch's start_powerSGD_iter)

    def _validate(self) -> None:
        check_positive(self, "lr")
        check_min(self, "min_lr", 0.0)
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr} is larger than optim.lr={self.lr}; set "
                             f"optim.min_lr <= {self.lr}")
        check_min(self, "weight_decay", 0.0)
        for key in ("beta1", "beta2"):
            value = getattr(self, key)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"optim.{key}={value} must be in [0, 1); e.g. 0.9 or 0.95")
        check_positive(self, "eps")
        check_min(self, "warmup_steps", 0)
        check_choice(self, "decay_style", DECAY_STYLES)
        if not 0.0 < self.wsd_decay_fraction <= 1.0:
            raise ValueError(f"optim.wsd_decay_fraction={self.wsd_decay_fraction} must be in (0, "
                             "1]; e.g. 0.2 decays over the last 20% of the steps")
        if self.decay_style != "wsd" and self.changed("wsd_decay_fraction"):
            raise ValueError(f"optim.wsd_decay_fraction={self.wsd_decay_fraction} is set but optim.decay_style="
                             f"{self.decay_style!r}: it is the decay phase of decay_style='wsd' only; set "
                             "optim.decay_style=wsd or remove optim.wsd_decay_fraction")
        check_min(self, "clip_grad", 0.0, why="0 disables clipping")
        check_positive(self, "bucket_size_mb")
        if self.zero_stage not in (1, 2, 3):
            raise ValueError(f"optim.zero_stage={self.zero_stage!r} must be 1 (sharded optimizer state), 2 (also "
                             "sharded gradients) or 3 (also sharded parameters); it applies when "
                             "optim.distributed=true")
        if self.zero_stage == 3 and self.overlap_param_gather:
            raise ValueError("optim.overlap_param_gather=true is for zero_stage 1 and 2 (the post-step parameter "
                             "gather); zero_stage=3 gathers each layer before use and prefetches the next one "
                             "itself: set optim.overlap_param_gather=false")
        if self.zero_stage != 1 and not self.distributed:  # a ZeRO stage with nothing sharded would be ignored
            raise ValueError(f"optim.zero_stage={self.zero_stage} applies only to the sharded optimizer; set "
                             "optim.distributed=true to use it, or leave optim.zero_stage unset")
        if self.overlap_param_gather and not self.distributed:
            raise ValueError("optim.overlap_param_gather=true needs the sharded optimizer; set "
                             "optim.distributed=true or optim.overlap_param_gather=false")
        for i, group in enumerate(self.no_decay_on):
            if group not in NO_DECAY_GROUPS:
                raise ValueError(f"optim.no_decay_on[{i}]={group!r} is not a parameter group; "
                                 f"choose from: {', '.join(NO_DECAY_GROUPS)}")
        if len(set(self.no_decay_on)) != len(self.no_decay_on):
            raise ValueError(f"optim.no_decay_on={self.no_decay_on} repeats a group; list each "
                             "once")
        check_choice(self, "nonfinite", NONFINITE)
        check_min(self, "max_skipped_steps", 0, why="0 stops at the first skipped step; leave it unset (none) "
                  "to never stop")
        check_choice(self, "grad_compression", ("none", "powersgd", "onebit"))
        if self.grad_compression != "none" and self.distributed:
            raise ValueError(f"optim.grad_compression={self.grad_compression!r} replaces the bucketed all-reduce that "
                             "ZeRO (optim.distributed=true) shards; set optim.distributed=false or "
                             "optim.grad_compression='none'")
        if isinstance(self.powersgd_rank, bool) or self.powersgd_rank < 1:
            raise ValueError(f"optim.powersgd_rank={self.powersgd_rank} must be an integer >= 1 (e.g. 4)")
        if self.grad_compression != "powersgd" and self.powersgd_rank != 4:
            raise ValueError(f"optim.powersgd_rank is read only with optim.grad_compression='powersgd' (it is "
                             f"{self.grad_compression!r}); remove it or set optim.grad_compression='powersgd'")
        if isinstance(self.powersgd_start_step, bool) or self.powersgd_start_step < 0:
            raise ValueError(f"optim.powersgd_start_step={self.powersgd_start_step} must be an integer >= 0 (the "
                             "steps reduced uncompressed before PowerSGD starts; 0 compresses from the first step)")
        if self.grad_compression != "powersgd" and self.powersgd_start_step != 0:
            raise ValueError(f"optim.powersgd_start_step is read only with optim.grad_compression='powersgd' (it is "
                             f"{self.grad_compression!r}); remove it or set optim.grad_compression='powersgd'")
        if self.nonfinite == "stop" and self.max_skipped_steps != 10:
            raise ValueError(f"optim.max_skipped_steps={self.max_skipped_steps} applies to optim.nonfinite='skip', "
                             "but optim.nonfinite='stop' stops at the first non-finite step; remove "
                             "optim.max_skipped_steps or set optim.nonfinite='skip'")


@dataclass(kw_only=True, frozen=True)
class DataConfig(Section):
    """Pretraining data. ``paths`` are indexed-dataset prefixes (``<prefix>.bin``/``.idx``);
    ``weights`` (one per path, any positive scale) blend them, ``None`` weighs them by size.
    ``split`` is "train,valid,test" proportions of each dataset, e.g. "969,30,1".
    ``tokenizer`` is a tokenizer.json path or name; ``cache_dir=None`` caches the sample indices
    next to the data. ``num_workers=0`` loads in the training process.
    """

    SECTION = "data"

    paths: list[str] = field(default_factory=list)
    weights: list[float] | None = None
    split: str = "969,30,1"
    tokenizer: str | None = None
    cache_dir: str | None = None
    num_workers: int = 2

    def _validate(self) -> None:
        for i, path in enumerate(self.paths):
            if not path.strip():
                raise ValueError(f"data.paths[{i}] is an empty string; give a dataset prefix")
        if self.weights is not None:
            if len(self.weights) != len(self.paths):
                raise ValueError(f"data.weights has {len(self.weights)} entries but data.paths "
                                 f"has {len(self.paths)}; give one weight per path")
            finite = all(w >= 0 and math.isfinite(w) for w in self.weights)
            if not finite or sum(self.weights) <= 0:
                raise ValueError(f"data.weights={self.weights} must be >= 0 with a positive sum")
        self.split_fractions()
        check_nonempty(self, "tokenizer")
        check_nonempty(self, "cache_dir")
        check_min(self, "num_workers", 0)

    def split_fractions(self) -> tuple[float, float, float]:
        """(train, valid, test) fractions of ``split``, summing to 1."""
        parts = self.split.split(",")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != 3 or any(not (v >= 0 and math.isfinite(v)) for v in values) \
                or sum(values) <= 0:
            raise ValueError(f"data.split={self.split!r} must be three comma-separated "
                             "proportions >= 0 with a positive sum (train,valid,test), e.g. "
                             "'969,30,1'")
        total = sum(values)
        return values[0] / total, values[1] / total, values[2] / total


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig(Section):
    """Checkpointing. ``interval=0`` disables periodic saves. ``dir=None`` means
    ``<train.run_dir>/checkpoints``. ``keep_last=None`` keeps every checkpoint. ``keep_every``: milestones,
    the checkpoints whose step is a multiple of it, are never deleted by keep_last's retention (a multiple of
    ``interval``; needs ``keep_last``). ``load`` is a checkpoint directory to resume or initialise from.
    ``peer_replica``: after each committed save every rank's shard is also held in the node-local RAM
    (``/dev/shm``) of its ring neighbour, and an in-job restart loads it from there without opening a file of
    the checkpoint directory (needs ``interval`` and 2+ ranks; docs/fault_tolerance.md).
    """

    SECTION = "checkpoint"

    interval: int = 1000
    dir: str | None = None
    keep_last: int | None = None
    keep_every: int | None = None
    async_save: bool = False
    load: str | None = None
    peer_replica: bool = False

    def _validate(self) -> None:
        check_min(self, "interval", 0, why="0 disables periodic checkpoints")
        check_min(self, "keep_last", 1, why="leave it unset to keep every checkpoint")
        check_min(self, "keep_every", 1, why="the milestone interval in steps; leave it unset for none")
        if self.keep_every is not None:
            if self.keep_last is None:
                raise ValueError(f"checkpoint.keep_every={self.keep_every} without checkpoint.keep_last keeps "
                                 "nothing more (every checkpoint is kept already); set checkpoint.keep_last, or "
                                 "leave checkpoint.keep_every unset")
            if not self.interval or self.keep_every % self.interval:
                raise ValueError(f"checkpoint.keep_every={self.keep_every} is not a multiple of checkpoint.interval="
                                 f"{self.interval}: no periodic save would land on a milestone; set keep_every to "
                                 "a multiple of checkpoint.interval")
        check_nonempty(self, "dir")
        check_nonempty(self, "load")
        if self.peer_replica and not self.interval:
            raise ValueError("checkpoint.peer_replica=true with checkpoint.interval=0: replicas are made after each "
                             "periodic save, and there are none; set checkpoint.interval > 0, or "
                             "checkpoint.peer_replica=false")


@dataclass(kw_only=True, frozen=True)
class LoggingConfig(Section):
    """Metrics sinks. ``peak_tflops`` overrides the device's dense bf16 peak used for MFU.
    ``memory_report``: rank 0 logs the predicted bytes per rank at start-up and, after the first step
    (measured with the allocator; on CPU under the profiler, which slows that step), the measured peak
    beside it (docs/memory.md); false skips both. ``profile_steps = [start, end]``: a torch.profiler trace
    of steps start..end (inclusive) per rank in ``<run_dir>/profile/`` with per-layer, per-chunk and
    collective ranges and allocator statistics (engine/profiling.py, docs/planner.md)."""

    SECTION = "logging"

    tensorboard: bool = True
    jsonl: bool = True
    progress_bar: str = "auto"
    peak_tflops: float | None = None
    memory_report: bool = True
    profile_steps: list[int] | None = None

    def _validate(self) -> None:
        check_choice(self, "progress_bar", PROGRESS_BAR)
        check_positive(self, "peak_tflops")
        ps = self.profile_steps
        if ps is not None:
            if (not isinstance(ps, (list, tuple)) or len(ps) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in ps)):
                raise ValueError(f"logging.profile_steps={ps!r} must be two step numbers [start, end], e.g. [3, 4]")
            if not 1 <= ps[0] <= ps[1]:
                raise ValueError(f"logging.profile_steps={list(ps)} needs 1 <= start <= end (steps count from 1); "
                                 "e.g. [3, 4]")
            if ps[0] == 1 and self.memory_report:
                raise ValueError("logging.profile_steps starts at step 1, which the memory report measures under its "
                                 "own profiler; start at step 2 or later, or set logging.memory_report=false")


@dataclass(kw_only=True, frozen=True)
class FaultConfig(Section):
    """Fault tolerance (docs/fault_tolerance.md). ``collective_timeout_s``: how long a collective waits for a
    missing or stopped peer before it raises on the ranks still alive (every process group of the run),
    so a hung job fails and can be restarted instead of waiting forever.

    ``hang_timeout_s`` (None: off): a watchdog thread per rank; when no step and no collective finished for
    that long, every live rank writes its stacks and its last ``flight_records`` collectives to
    ``RUN_DIR/hang/rank<R>.txt``, names the collective and the ranks that did not progress, and exits with
    status 4 (engine/watchdog.py). ``straggler_ratio`` (None: off): every log interval, a rank whose compute
    time (the step less its blocked communication) exceeds its pipeline stage's median by this factor is
    named in the log and in metrics.jsonl (engine/straggler.py).
    ``nan_replay``: the first step of each run of non-finite steps (loss or gradient norm) is replayed with
    hooks; the log names the first layer, tensor and rank that went non-finite (engine/nan_locate.py).
    """

    SECTION = "fault"

    collective_timeout_s: float = 600.0
    hang_timeout_s: float | None = None
    flight_records: int = 64
    straggler_ratio: float | None = None
    nan_replay: bool = True

    def _validate(self) -> None:
        check_positive(self, "collective_timeout_s")
        check_positive(self, "hang_timeout_s")
        check_min(self, "flight_records", 1, why="the hang report lists that many of the last collectives")
        if self.hang_timeout_s is None and self.changed("flight_records"):
            raise ValueError(f"fault.flight_records={self.flight_records} is set but fault.hang_timeout_s is not: the "
                             "flight recorder feeds the hang watchdog's report and runs only with it; set "
                             "fault.hang_timeout_s (e.g. 300) or remove fault.flight_records")
        if self.hang_timeout_s is not None and self.hang_timeout_s >= self.collective_timeout_s:
            raise ValueError(f"fault.hang_timeout_s={self.hang_timeout_s:g} must be below fault.collective_timeout_s="
                             f"{self.collective_timeout_s:g}: a stuck collective would raise before the watchdog "
                             "reports it; lower fault.hang_timeout_s or raise fault.collective_timeout_s")
        if self.straggler_ratio is not None and not (self.straggler_ratio > 1 and _finite(self.straggler_ratio)):
            raise ValueError(f"fault.straggler_ratio={self.straggler_ratio} must be > 1 (a rank this many times "
                             "slower than the median is named); e.g. 1.5, or leave it unset (none) to turn it off")
