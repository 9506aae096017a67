"""The model a plan is for: a Tessel preset, a Hugging Face config.json, or explicit dimensions.

Whatever the source, the planner holds the same two objects the trainer builds at start-up: the run
config's plain data (``base``: the sections of a :class:`engine.config.TesselConfig`, re-validated per
layout) and a :class:`models.hook.ModelHook` (the architecture; parameter sizes per stage without
building anything). engine/memory.py's :func:`predict_memory` takes exactly these, so the planner's
memory is the start-up report's, byte for byte.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field

from engine.config import load_config
from engine.config.schema import TesselConfig
from engine.config.sections import TrainConfig
from models.hook import ModelHook, hf_config_from_run


@dataclass(frozen=True)
class PlanHook(ModelHook):
    """A :class:`ModelHook` whose per-stage parameter lists are remembered: a plan asks for the same
    stages (tp, layer range, first/last) hundreds of times across layouts (engine/memory.py's buffer
    layout per pipeline rank, the state bound of every candidate), and deriving one walks every
    parameter of every layer. The lists are the hook's own, shared read-only."""

    _memo: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def stage_params(self, *, tp: int, layer_range: tuple[int, int], pre_process: bool, post_process: bool,
                     ep: int = 1, expert_tp: int | None = None):
        key = ("params", tp, tuple(layer_range), pre_process, post_process, ep, expert_tp)
        if key not in self._memo:
            self._memo[key] = tuple(super().stage_params(tp=tp, layer_range=layer_range, pre_process=pre_process,
                                                         post_process=post_process, ep=ep, expert_tp=expert_tp))
        return list(self._memo[key])

    def stage_param_sizes(self, *, tp: int, layer_range: tuple[int, int], pre_process: bool,
                          post_process: bool, expert_tp: int | None = None) -> list[tuple[str, int, bool]]:
        key = ("sizes", tp, tuple(layer_range), pre_process, post_process, expert_tp)
        if key not in self._memo:
            self._memo[key] = tuple(super().stage_param_sizes(tp=tp, layer_range=layer_range,
                                                              pre_process=pre_process, post_process=post_process,
                                                              expert_tp=expert_tp))
        return list(self._memo[key])


@dataclass(frozen=True, kw_only=True)
class HostOps:
    """Framework ops (aten dispatches) of one micro-batch at tp = 1, counted on the model's own code
    (engine/planner/calibrate.py's :func:`count_host_ops`): one layer's forward and backward, the first
    stage's extra (embedding, RoPE tables) and the last stage's (final norm, output layer, loss).
    ``recompute``: the activation recompute mode they were counted under (full recompute replays a layer's
    forward ops in its backward). Each op costs the device's ``host_op_us``."""

    layer_fwd: int
    layer_bwd: int
    first_fwd: int
    first_bwd: int
    last_fwd: int
    last_bwd: int
    recompute: str


@dataclass(frozen=True)
class PlanModel:
    """``base``: a TesselConfig as a dict (model section complete); ``hook``: the model (a :class:`PlanHook`);
    ``name`` for output; ``host_ops``: its framework ops per micro-batch where counted (the calibrated CPU
    device charges each one; None: not counted, no host term)."""

    base: dict
    hook: ModelHook
    name: str
    host_ops: HostOps | None = None

    @property
    def config(self):
        return self.hook.config

    def run_config(self, *, tp: int, pp: int, vp: int, dp: int, cp: int, mbs: int, gbs: int, seq: int,
                   recompute: str, zero: int, dtype: str | None = None, fp8: bool = False, ep: int = 1,
                   sequence_parallel: bool = True, tp_overlap: str = "none",
                   overlap_param_gather: bool | None = None) -> TesselConfig:
        """The validated run config of one layout (ValueError: the layout is illegal, and why). ``ep`` > 1:
        expert parallelism inside dp (the config refuses it with ZeRO, cp or a dense model); sequence
        parallelism whenever tp > 1 unless ``sequence_parallel`` is false; ``tp_overlap``: parallel.tp_overlap;
        ``overlap_param_gather``: optim.overlap_param_gather at ZeRO 1 and 2 (None: the base config's)."""
        base = self.base_config
        par = {"tp": tp, "pp": pp, "vp": vp, "dp": dp, "cp": cp, "ep": ep,
               "sequence_parallel": sequence_parallel and tp > 1, "tp_overlap": tp_overlap,
               "schedule": "interleaved" if vp > 1 else "1f1b", "pipeline_layout": None, "p2p_early_recv": False}
        par.update(cp_comm="ring", cp_a2a_size=base.parallel.field_default("cp_a2a_size"))  # (cp = 1 refuses others)
        train = {"micro_batch_size": mbs, "global_batch_size": gbs, "seq_length": seq,
                 "activation_checkpointing": recompute, "recompute_num_layers": None}
        optim = {"distributed": zero > 0, "zero_stage": max(zero, 1)}
        if zero in (0, 3):  # the post-step parameter gather exists at ZeRO 1 and 2 only
            optim["overlap_param_gather"] = False
        elif overlap_param_gather is not None:
            optim["overlap_param_gather"] = overlap_param_gather
        model = {"fp8": "tensorwise" if fp8 else "none"}
        if dtype is not None:
            model["dtype"] = dtype
        positions = base.model.max_position_embeddings
        if positions is not None and positions < seq:
            model["max_position_embeddings"] = seq
        # each section re-validated by its own __post_init__, then the config's cross-section checks: the
        # config TesselConfig.from_dict would give (tests/engine/test_planner.py round-trips it), without
        # re-parsing every section's typed fields per layout
        return dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, **par),
                                   train=dataclasses.replace(base.train, **train),
                                   optim=dataclasses.replace(base.optim, **optim),
                                   model=dataclasses.replace(base.model, **model))

    @functools.cached_property
    def base_config(self) -> TesselConfig:
        """``base`` parsed once (without its source and overrides)."""
        data = copy.deepcopy(self.base)
        for key in ("source", "overrides"):
            data.pop(key, None)
        return TesselConfig.from_dict(data)


def _hook(cfg: TesselConfig) -> ModelHook:
    hf = hf_config_from_run(cfg.model, vocab_size=None)
    return PlanHook.from_hf(hf, make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
                            fused_cross_entropy=cfg.model.fused_cross_entropy)


# Keys :meth:`PlanModel.run_config` replaces in every layout (the plan's choice, or a fixed value): a ``--set``
# of one would be dropped without a word, so :func:`from_preset` refuses it, naming what sets it instead.
# A value starting with "--" is tools/plan.py's pin flag for the key.
PLANNED_KEYS = {
    "parallel.tp": "--tp", "parallel.pp": "--pp", "parallel.vp": "--vp", "parallel.dp": "--dp",
    "parallel.cp": "--cp", "parallel.ep": "--ep", "train.micro_batch_size": "--mbs",
    "parallel.schedule": "the planner chooses it (1f1b, interleaved at --vp > 1)",
    "parallel.pipeline_layout": "the planner splits the layers evenly over the stages",
    "parallel.cp_comm": "the planner models cp_comm = 'ring'",
    "parallel.cp_a2a_size": "the planner models cp_comm = 'ring', which reads no cp_a2a_size",
    "parallel.sequence_parallel": "the planner uses sequence parallelism at every tp > 1",
    "parallel.p2p_early_recv": "the planner models it off",
    "train.recompute_num_layers": "the planner applies the --recompute mode to every layer",
    "model.dtype": "the planner plans bf16 (--precision bf16|fp8)",
}


def check_overrides(overrides) -> None:
    """ValueError for a ``--set`` of a key the planner replaces in every layout (:data:`PLANNED_KEYS`)."""
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            continue  # load_config says what is malformed
        key, value = (x.strip() for x in item.split("=", 1))
        fix = PLANNED_KEYS.get(key)
        if key == "model.dtype" and value.strip("'\"") == "bf16":
            continue  # what the planner plans anyway
        if fix is not None:
            fix = f"pin it with {fix} {value} instead" if fix.startswith("--") else f"drop it: {fix}"
            raise ValueError(f"--set {item}: the planner sets {key} itself in every layout, so the override would "
                             f"be ignored; {fix}")


def from_preset(path: str, overrides=()) -> PlanModel:
    """A Tessel preset name (configs/) or TOML file, with ``--set`` style overrides (none of
    :data:`PLANNED_KEYS`: ValueError naming the pin or saying the planner chooses it)."""
    check_overrides(overrides)
    cfg = load_config(path, list(overrides))
    if cfg.model.vocab_size is None and not cfg.model.hf_config:
        raise ValueError(f"--config {path}: model.vocab_size is unset (the tokenizer's would be used); "
                         "add --set model.vocab_size=N")
    return PlanModel(base=cfg.to_dict(), hook=_hook(cfg), name=os.path.basename(path).removesuffix(".toml"))


def from_hf_config(path: str) -> PlanModel:
    """A Hugging Face config.json (its model_type names the family)."""
    if not os.path.isfile(path):
        raise ValueError(f"--hf-config {path!r} does not exist; give the path of a config.json")
    with open(path) as f:
        hf = json.load(f)
    family = hf.get("model_type", "llama")
    data = {"model": {"family": family, "hf_config": os.path.abspath(path)}}
    positions = hf.get("max_position_embeddings", hf.get("n_positions"))
    if isinstance(positions, int) and positions > 0:  # the base's sequence (the plan's replaces it) must fit
        data["train"] = {"seq_length": min(positions, TrainConfig.field_default("seq_length"))}
    cfg = TesselConfig.from_dict(data)
    return PlanModel(base=cfg.to_dict(), hook=_hook(cfg), name=os.path.basename(os.path.dirname(os.path.abspath(path)))
                     or "hf")


def from_dims(*, family: str, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int | None = None,
              ffn_hidden_size: int | None = None, vocab_size: int = 32000, num_experts: int = 0,
              top_k: int = 0, tie_word_embeddings: bool | None = None, max_positions: int = 8192) -> PlanModel:
    """Explicit dimensions (``num_experts`` > 0: a Mixtral-style MoE with ``top_k`` experts per token).
    ``max_positions``: GPT-2's learned position table has this many rows (a parameter; RoPE families have
    none, and :meth:`PlanModel.run_config` raises it to the sequence length where needed)."""
    if num_experts and family != "mixtral":
        raise ValueError(f"--num-experts {num_experts} needs --family mixtral (the MoE family); got {family!r}")
    if family == "mixtral" and not (num_experts and top_k):
        raise ValueError("--family mixtral needs --num-experts and --top-k")
    model = {"family": family, "hidden_size": hidden_size, "num_layers": num_layers,
             "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
             "ffn_hidden_size": ffn_hidden_size, "vocab_size": vocab_size, "tie_word_embeddings": tie_word_embeddings}
    model["max_position_embeddings"] = max_positions
    model = {k: v for k, v in model.items() if v is not None}
    if family == "gpt2":
        model.pop("num_key_value_heads", None)
    # train.seq_length: the base's (each plan's replaces it) within the position table, whatever its size
    cfg = TesselConfig.from_dict({"model": model, "train": {"seq_length": max_positions}})
    hf = hf_config_from_run(cfg.model, vocab_size=None, extra=dict(num_local_experts=num_experts,
                                                                  num_experts_per_tok=top_k) if num_experts else None)
    hook = PlanHook.from_hf(hf, make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by)
    return PlanModel(base=cfg.to_dict(), hook=hook, name=f"{family}-h{hidden_size}-l{num_layers}")
