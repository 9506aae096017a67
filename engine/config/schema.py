"""The root config ``TesselConfig``: sections, cross-section checks, world-size resolution, JSON.

A ``TesselConfig`` is valid on construction: every section validates itself, then the root checks
what spans sections (tp divides the heads, warmup fits in the steps, the sequence splits over cp
and tp, ...). Checks that need the world size live in ``validate_world``; checks that need an
architecture only known after models/ reads ``model.hf_config`` can be rerun
with ``check_architecture``.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from engine.config._fields import coerce, unknown_key_error
from engine.config.outer import OuterConfig
from engine.config.posttrain import PosttrainConfig
from engine.config.sections import (CheckpointConfig, DataConfig, FaultConfig, LoggingConfig, ModelConfig,
                                    OptimConfig, ParallelConfig, TrainConfig)
from parallel.data_parallel.outer import apply_steps

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "fault": FaultConfig,
    "posttrain": PosttrainConfig,
    "outer": OuterConfig,
}
# Provenance fields of the root: written to JSON, not settable from TOML or --set.
METADATA = ("source", "overrides")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(kw_only=True, frozen=True)
class TesselConfig:
    """Everything one training run needs, validated. ``source`` is the TOML file it was loaded
    from and ``overrides`` the ``--set`` strings applied on top (both recorded in the JSON).

    Frozen, like its sections: the config a run uses is the one validated and written to JSON.
    Derive variants with ``dataclasses.replace`` or ``with_world_size`` (both validate again).
    """

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    posttrain: PosttrainConfig = field(default_factory=PosttrainConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    source: str | None = None
    overrides: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"TesselConfig.{name} must be a {cls.__name__}, got "
                                 f"{type(getattr(self, name)).__name__}; build nested dicts with "
                                 "TesselConfig.from_dict")
        object.__setattr__(self, "source", coerce(self.source, str | None, name="source"))
        object.__setattr__(self, "overrides", coerce(self.overrides, list[str], name="overrides"))
        m = self.model
        self.check_architecture(num_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                                num_key_value_heads=m.num_key_value_heads,
                                ffn_hidden_size=m.ffn_hidden_size,
                                max_position_embeddings=m.max_position_embeddings)
        self._check_schedule()
        self._check_sequence_split()
        self._check_overlap()
        self._check_zero3()
        self._check_expert_parallel()
        self._check_batch()
        self._check_outer()
        self._check_cuda_graph()

    # ----------------------------------------------------------------------------------------
    # cross-section checks

    def check_architecture(self, *, num_layers: int | None, num_attention_heads: int | None,
                           num_key_value_heads: int | None, ffn_hidden_size: int | None,
                           max_position_embeddings: int | None) -> None:
        """Check that the parallel layout fits these sizes; ``None`` skips that check.

        Run on construction with the explicit ``model`` fields; models/ calls it again with the
        sizes it resolved from ``model.hf_config``.
        """
        tp, pp, vp = self.parallel.tp, self.parallel.pp, self.parallel.vp
        sizes = {"num_attention_heads": num_attention_heads,
                 "num_key_value_heads": num_key_value_heads or num_attention_heads,  # the default: MHA
                 "ffn_hidden_size": ffn_hidden_size}
        for key, value in sizes.items():
            if value is not None and value % tp:
                known = {k: v for k, v in sizes.items() if v is not None}
                fits = [d for d in range(1, min(known.values()) + 1) if all(v % d == 0 for v in known.values())]
                raise ValueError(f"model.{key}={value} is not divisible by parallel.tp={tp} "
                                 "(tensor parallelism splits it evenly); choose parallel.tp "
                                 "among the common divisors of the model's "
                                 + ", ".join(f"{k}={v}" for k, v in known.items())
                                 + f": one of {', '.join(map(str, fits))}")
        par = self.parallel
        a2a = par.cp_head_scatter
        for key, value in (("num_attention_heads", num_attention_heads), ("num_key_value_heads", num_key_value_heads)):
            if value is not None and a2a > 1 and (value // tp) % a2a:
                raise ValueError(f"model.{key}={value} over parallel.tp={tp} leaves {value // tp} heads per rank, not "
                                 f"divisible by {a2a}: parallel.cp_comm={par.cp_comm!r} scatters heads over "
                                 f"{a2a} cp ranks; use parallel.cp_comm='ring' (or a smaller cp_a2a_size, hybrid)")
        layout = self.parallel.pipeline_layout
        if num_layers is not None and layout is not None and sum(layout) != num_layers:
            raise ValueError(f"parallel.pipeline_layout={layout} places {sum(layout)} layers but "
                             f"model.num_layers={num_layers}; make the counts sum to {num_layers}")
        if num_layers is not None and layout is None and num_layers < pp * vp:
            # Uneven counts are fine (the first stages take one layer more: parallel.pipeline.split).
            raise ValueError(f"model.num_layers={num_layers} is fewer than parallel.pp*vp = {pp}*{vp} = "
                             f"{pp * vp} stages: every stage needs a layer; lower pp or vp, or give "
                             "parallel.pipeline_layout explicitly")
        seq = self.train.seq_length
        if max_position_embeddings is not None and seq > max_position_embeddings:
            raise ValueError(f"train.seq_length={seq} exceeds "
                             f"model.max_position_embeddings={max_position_embeddings}; lower "
                             "train.seq_length or raise model.max_position_embeddings")

    def _check_schedule(self) -> None:
        steps, optim = self.train.steps, self.optim
        ps = self.logging.profile_steps
        if ps is not None and ps[0] > steps:  # (a window that runs past the end is written at the end)
            raise ValueError(f"logging.profile_steps={list(ps)} starts after train.steps={steps}: no step would be "
                             f"profiled; start the window at step {steps} or before, or raise train.steps")
        if optim.warmup_steps > steps:
            raise ValueError(f"optim.warmup_steps={optim.warmup_steps} exceeds "
                             f"train.steps={steps}; set optim.warmup_steps <= {steps}")
        if optim.decay_style == "wsd":
            decay = max(1, int(optim.wsd_decay_fraction * steps + 0.5))  # as engine/optim.py's lr_at counts it
            if optim.warmup_steps > steps - decay:
                raise ValueError(f"optim.warmup_steps={optim.warmup_steps} runs into the WSD "
                                 f"decay phase (the last {decay} of train.steps={steps}); set "
                                 f"optim.warmup_steps <= {steps - decay} or lower "
                                 "optim.wsd_decay_fraction")
        if self.train.eval_interval > 0 and self.data.split_fractions()[1] == 0:
            raise ValueError(f"train.eval_interval={self.train.eval_interval} but "
                             f"data.split={self.data.split!r} has no validation part; give it one "
                             "(e.g. '969,30,1') or set train.eval_interval=0")

    def _check_sequence_split(self) -> None:
        seq, cp, tp = self.train.seq_length, self.parallel.cp, self.parallel.tp
        if cp > 1 and self.posttrain.method != "none":
            raise ValueError(f"parallel.cp={cp} with posttrain.method={self.posttrain.method!r}: context parallelism "
                             "for post-training objectives (per-sequence units) is not built; set parallel.cp=1")
        if cp > 1 and seq % (2 * cp):
            raise ValueError(f"train.seq_length={seq} is not divisible by 2*parallel.cp = "
                             f"{2 * cp} (context parallelism splits each sequence into 2*cp "
                             f"chunks to balance causal attention); choose a multiple of {2 * cp}")
        if self.parallel.sequence_parallel_active and (seq // cp) % tp:
            need = math.lcm(2 * cp, cp * tp) if cp > 1 else tp  # both splits at once: cp's chunks and tp's shards
            raise ValueError(f"train.seq_length/parallel.cp = {seq // cp} tokens per rank is not "
                             f"divisible by parallel.tp={tp} (sequence parallelism shards them "
                             f"over tp); choose train.seq_length a multiple of {need} or set "
                             "parallel.sequence_parallel=false")

    def _check_overlap(self) -> None:
        from parallel.tensor_parallel.overlap import check_tp_overlap

        par = self.parallel
        check_tp_overlap(par.tp_overlap, tp=par.tp, sequence_parallel=par.sequence_parallel, device_type="any",
                         fp8=self.model.fp8)

    def _check_expert_parallel(self) -> None:
        p, o = self.parallel, self.optim
        if p.ep > 1 and o.grad_compression != "none":
            raise ValueError(f"parallel.ep={p.ep} with optim.grad_compression={o.grad_compression!r}: the compressed "
                             "reduction runs over dp, but expert gradients must reduce over edp; set "
                             "optim.grad_compression='none' or parallel.ep=1")
        outer = getattr(self, "outer", None)
        if p.ep > 1 and outer is not None and outer.method != "none":
            raise ValueError(f"parallel.ep={p.ep} with outer.method={outer.method!r}: DiLoCo's outer step averages "
                             "every parameter over dp, but the ep ranks hold different experts; set "
                             "outer.method='none' or parallel.ep=1")
        if p.ep > 1 and self.posttrain.lora.rank:
            raise ValueError(f"parallel.ep={p.ep} with posttrain.lora.rank > 0: LoRA adapters on experts are not "
                             "built; set parallel.ep=1")

    def _check_zero3(self) -> None:
        o, post = self.optim, self.posttrain
        if not (o.distributed and o.zero_stage == 3):
            return
        if self.parallel.schedule in ("zb-h1", "zbv", "dualpipev"):
            raise ValueError(f"parallel.schedule='{self.parallel.schedule}' defers weight gradients to W actions, "
                             "after ZeRO-3 has "
                             "released the layer's gathered parameters and reduce-scattered its micro-batch; "
                             "split backward does not compose with ZeRO-3: use optim.zero_stage 1 or 2, or "
                             "parallel.schedule='1f1b'")
        if post.method == "grpo" and post.grpo.kl_beta > 0 and not post.lora.rank:
            raise ValueError("posttrain.method='grpo' with posttrain.grpo.kl_beta > 0 keeps a full copy of the base "
                             "weights to copy in and out of the parameters, which ZeRO-3 shards; use "
                             "posttrain.lora.rank > 0 (the base is the reference), kl_beta=0, or optim.zero_stage "
                             "1 or 2")
        if post.method == "grpo":
            raise ValueError("posttrain.method='grpo' with ZeRO-3: generation gathers every layer over dp at each "
                             "decode step, and the dp replicas stop generating at different steps, so their gathers "
                             "would not pair up (a hang); use optim.zero_stage 1 or 2")

    def _check_cuda_graph(self) -> None:
        """``model.cuda_graph = "layers"`` (models/cuda_graphs.py): a layer's graphs replay static buffers and
        no Python, so nothing in a layer may communicate, hook or change shape per call."""
        if self.model.cuda_graph == "none":
            return
        par, o, t = self.parallel, self.optim, self.train
        what = "model.cuda_graph='layers'"
        sizes = {k: getattr(par, k) for k in ("tp", "cp", "ep", "pp", "vp") if getattr(par, k) != 1}
        if sizes:
            raise ValueError(f"{what} with {', '.join(f'parallel.{k}={v}' for k, v in sizes.items())}: the layers' "
                             "tp/cp/ep collectives (and their ledger entries) would run only when captured, and a "
                             "pipeline runs a layer's next forward before its backward, over the graph's static "
                             "buffers; graphs are built for dp only: set those to 1 or model.cuda_graph='none'")
        if par.schedule != "1f1b":
            raise ValueError(f"{what} with parallel.schedule={par.schedule!r}: a layer's graphs replay into the same "
                             "buffers every micro-batch, so each micro-batch's backward must run before the next "
                             f"forward, as '1f1b' does at pp=1 ({par.schedule!r} runs the forwards first and would "
                             "back-propagate through the last micro-batch's activations); set parallel.schedule='1f1b'")
        if t.activation_checkpointing != "none":
            raise ValueError(f"{what} with train.activation_checkpointing={t.activation_checkpointing!r}: recompute "
                             "reruns the layer's forward inside backward, outside its graphs; set "
                             "train.activation_checkpointing='none' or model.cuda_graph='none'")
        if o.distributed and (o.zero_stage == 3 or o.overlap_param_gather):
            why = "optim.zero_stage=3" if o.zero_stage == 3 else "optim.overlap_param_gather=true"
            raise ValueError(f"{what} with {why}: the parameters' all-gathers are waited for in module hooks "
                             "before each layer's forward, which a replayed graph skips; use optim.zero_stage 1 "
                             "or 2 with optim.overlap_param_gather=false, or model.cuda_graph='none'")
        if self.logging.profile_steps:
            raise ValueError(f"{what} with logging.profile_steps: the profiler's layer ranges come from module "
                             "hooks, which a replayed graph skips; profile with model.cuda_graph='none' (or time "
                             "the graphed step's kernels with tools/bench_fp8.py --device cuda --cuda-graph "
                             "--profile-step)")
        if self.posttrain.lora.rank and self.posttrain.lora.dropout > 0:
            raise ValueError(f"{what} with posttrain.lora.dropout={self.posttrain.lora.dropout}: the adapters' "
                             "dropout forks the tensor-parallel RNG tracker, whose generator state is saved and "
                             "restored on the host, which a replayed graph skips; set posttrain.lora.dropout=0 or "
                             "model.cuda_graph='none'")

    def _check_outer(self) -> None:
        """DiLoCo and gradient compression replace the per-step dp reduction (docs/decentralised.md)."""
        o, method, par = self.optim, self.outer.method, self.parallel
        what = (f"outer.method={method!r}" if method != "none" else
                f"optim.grad_compression={o.grad_compression!r}" if o.grad_compression != "none" else None)
        if what is None:
            return
        if method != "none" and o.grad_compression != "none":
            raise ValueError(f"{what} with optim.grad_compression={o.grad_compression!r}: DiLoCo's inner steps have "
                             "no dp gradient reduction to compress; compress the pseudo-gradient with "
                             "outer.compression instead, and set optim.grad_compression='none'")
        if o.distributed:
            raise ValueError(f"{what} with ZeRO (optim.distributed=true): the sharded optimizer is built on the "
                             "per-step dp reduction it replaces; set optim.distributed=false")
        if par.cp > 1 or par.ep > 1:
            raise ValueError(f"{what} with parallel.cp={par.cp}, parallel.ep={par.ep}: context- and expert-parallel "
                             "gradients still need their per-step reduction, which is not separated from the dp one "
                             "yet; set parallel.cp=1 and parallel.ep=1")
        if self.posttrain.method != "none":
            raise ValueError(f"{what} is for pretraining; set it to 'none' for posttrain.method="
                             f"{self.posttrain.method!r}")
        u, layers = self.outer, self.model.num_layers
        if u.start_step >= self.train.steps:
            raise ValueError(f"outer.start_step={u.start_step} is not below train.steps={self.train.steps}: every step "
                             f"would be plain data parallelism and {method!r} would never start; lower "
                             "outer.start_step or set outer.method='none'")
        m, t = u.momentum_start_step, self.train
        end = t.last_step()  # earlier than train.steps where train.max_tokens stops the run (DiLoCo: pretraining)
        ends = f"train.steps={t.steps}" + (f" (train.max_tokens stops it after step {end})" if end < t.steps else "")
        span = apply_steps(method, inner_steps=u.inner_steps, fragments=u.fragments, start_step=u.start_step,
                           steps=t.steps, end=end, overlap=u.overlap_steps) if m else None
        if m and span is None:
            raise ValueError(f"outer.momentum_start_step={m}, but no sync is applied in {ends} "
                             f"(outer.inner_steps={u.inner_steps} after outer.start_step={u.start_step}), so it changes "
                             "nothing; remove it")
        if m and span is not None and m >= span[1]:
            raise ValueError(f"outer.momentum_start_step={m} is not below the run's last sync (applied at step "
                             f"{span[1]} of {ends}): every sync would take the plain "
                             "average and outer.lr / outer.momentum would never apply; lower it, or set "
                             "outer.lr=1, outer.momentum=0 and outer.nesterov=false for plain averaging")
        if m and span is not None and m < span[0]:
            raise ValueError(f"outer.momentum_start_step={m} is before the first sync (applied at step {span[0]}), so "
                             f"it changes nothing; set it to {span[0]} or more (the last step whose sync takes the "
                             "plain average), or remove it")
        if u.fragment_layout == "strided" and u.fragments > 1 and layers is not None and u.fragments > layers:
            raise ValueError(f"outer.fragments={u.fragments} with outer.fragment_layout='strided' exceeds "
                             f"model.num_layers={layers}: block l goes to fragment l % fragments, so fragments "
                             f"{layers}.. would be empty; set outer.fragments <= {layers}")

    def _check_batch(self) -> None:
        train = self.train
        rows = 2 if self.posttrain.method == "dpo" else 1  # a DPO sample is two rows (chosen, rejected): the trainer's count
        per_step = train.global_batch_size * rows * train.seq_length
        if train.max_tokens is not None and train.max_tokens < per_step:
            what = "train.global_batch_size*2*seq_length (a DPO pair is 2 rows)" if rows == 2 else \
                "train.global_batch_size*seq_length"
            raise ValueError(f"train.max_tokens={train.max_tokens} is less than one step "
                             f"({what} = {per_step} tokens); raise it or remove train.max_tokens")
        if self.parallel.dp != -1:
            self._check_dp(self.parallel.dp)

    def _check_dp(self, dp: int) -> None:
        gbs, mbs, cp, ep = (self.train.global_batch_size, self.train.micro_batch_size,
                            self.parallel.cp, self.parallel.ep)
        if gbs % (dp * mbs):
            raise ValueError(f"train.global_batch_size={gbs} is not divisible by dp * "
                             f"train.micro_batch_size = {dp}*{mbs} = {dp * mbs}; choose a "
                             f"multiple of {dp * mbs}, or change train.micro_batch_size")
        if dp % ep:
            raise ValueError(f"parallel.ep={ep} does not divide dp = {dp} (expert parallelism is carved out of "
                             f"the data-parallel ranks, at each of the cp={cp} context-parallel indices); choose "
                             f"ep among {_divisors(dp)}")

    # ----------------------------------------------------------------------------------------
    # world size

    def validate_world(self, world_size: int) -> int:
        """Check the degrees against ``world_size`` processes; return the data-parallel size
        (inferring it when ``parallel.dp == -1``). Raises ValueError naming the product."""
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be a positive integer")
        p = self.parallel
        mp = p.model_parallel_size
        if p.dp == -1:
            if world_size % mp:
                raise ValueError(f"world size {world_size} is not divisible by parallel.tp*pp*cp "
                                 f"= {p.tp}*{p.pp}*{p.cp} = {mp}; launch a multiple of {mp} "
                                 "processes or change the degrees")
            dp = world_size // mp
        else:
            dp = p.dp
            if mp * dp != world_size:
                raise ValueError(f"parallel.tp*pp*cp*dp = {p.tp}*{p.pp}*{p.cp}*{dp} = {mp * dp} "
                                 f"does not equal the world size {world_size}; set parallel.dp=-1 "
                                 f"to infer it, or launch {mp * dp} processes")
        self._check_dp(dp)
        if self.optim.grad_compression != "none" and dp * p.cp == 1:
            raise ValueError(f"optim.grad_compression={self.optim.grad_compression!r} compresses the data-parallel "
                             "gradient reduction, but this launch has one data-parallel rank (dp x cp = 1): nothing "
                             "is sent, and the compression would only perturb the gradients; launch more ranks "
                             "(dp > 1), or remove optim.grad_compression")
        return dp

    def with_world_size(self, world_size: int) -> TesselConfig:
        """A copy with ``parallel.dp`` resolved for ``world_size`` (see ``validate_world``)."""
        data = self.to_dict()
        data["parallel"]["dp"] = self.validate_world(world_size)
        return TesselConfig.from_dict(data)

    def num_microbatches(self, dp: int) -> int:
        """Micro-batches per step on each data-parallel rank."""
        self._check_dp(dp)
        return self.train.global_batch_size // (dp * self.train.micro_batch_size)

    def checkpoint_dir(self) -> str:
        """``checkpoint.dir``, or ``<train.run_dir>/checkpoints`` when it is unset."""
        return self.checkpoint.dir or os.path.join(self.train.run_dir, "checkpoints")

    # ----------------------------------------------------------------------------------------
    # plain data and JSON

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict: one table per section plus ``source`` and ``overrides``."""
        out: dict[str, Any] = {name: getattr(self, name).to_dict() for name in SECTIONS}
        out["source"] = self.source
        out["overrides"] = list(self.overrides)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TesselConfig:
        """Inverse of ``to_dict``; missing sections take their defaults, unknown keys are errors."""
        if not isinstance(data, dict):
            raise ValueError(f"a config must be a table of sections, got {type(data).__name__}")
        valid = [*SECTIONS, *METADATA]
        for key in data:
            if key not in valid:
                raise unknown_key_error(key, valid=valid, where="the top level of the config",
                                        what="section")
        sections = {name: sec.from_dict(data.get(name, {})) for name, sec in SECTIONS.items()}
        meta = {k: data[k] for k in METADATA if k in data and data[k] is not None}
        return cls(**sections, **meta)

    def to_json(self, path: str) -> None:
        """Write the resolved config as sorted, indented JSON (atomically: tmp file + rename)."""
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, sort_keys=True, indent=2)
            f.write("\n")
        os.replace(tmp, path)

    @classmethod
    def from_json(cls, path: str) -> TesselConfig:
        """Read a config written by ``to_json``."""
        if not os.path.isfile(path):
            raise ValueError(f"config JSON {path!r} does not exist (resolved to "
                             f"{os.path.abspath(path)}); pass the config.json of a run or "
                             "checkpoint")
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(f"config JSON {path!r} is not valid JSON: {err}") from None
        return cls.from_dict(data)
