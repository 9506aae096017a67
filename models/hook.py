"""What the engine's assembly line needs to know about a model, in one object built once per run.

The run config's ``[model]`` section (and the tokenizer's vocabulary) become ONE description, the
Hugging Face ``config.json`` dict (``hf_config``); everything else is derived from it once:
:class:`models.TransformerConfig` (``config``), the FLOP spec the metrics use (``flops``), the
stage builder (``build_stage``) and the checkpoint keys of its parameters (``param_spec``: tied and
vocab-padded tensors). The engine (engine/assembly.py) calls these and knows no model names.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from engine.checkpoint import ParamSpec
from engine.metrics import FlopsSpec
from models.config import TransformerConfig
from models.convert import model_param_spec
from models.moe import hf_moe_fields
from models.registry import config_from_hf
from models.transformer import TransformerStage, build_model
from parallel.tensor_parallel.fp8 import apply_fp8, check_exclude
from parallel.tensor_parallel.overlap import RingLinearImpl, check_tp_overlap
from parallel.tensor_parallel.symm_mem import SymmMemLinearImpl

_CHUNK_PREFIX = re.compile(r"^\d+\.")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# The run config's names -> config.json's, per family kind (GPT-2 names its fields differently).
_GPT2_NAMES = {"hidden_size": "n_embd", "num_layers": "n_layer", "num_attention_heads": "n_head",
               "ffn_hidden_size": "n_inner", "max_position_embeddings": "n_positions",
               "norm_eps": "layer_norm_epsilon", "tie_word_embeddings": "tie_word_embeddings"}
_HF_NAMES = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
             "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
             "head_dim": "head_dim", "ffn_hidden_size": "intermediate_size",
             "max_position_embeddings": "max_position_embeddings", "rope_theta": "rope_theta",
             "norm_eps": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings"}


class MissingModelKey(ValueError):
    """A [model] key the family needs is not set; ``key`` names it (model.<key>)."""

    def __init__(self, message: str, *, key: str):
        super().__init__(message)
        self.key = key


def hf_config_from_run(model_cfg, *, vocab_size: int | None, extra: dict | None = None) -> dict:
    """The Hugging Face config.json dict of the run config's ``[model]`` section: ``model.hf_config``
    (a file) if given, overridden by every explicit field; ``vocab_size`` (the tokenizer's) fills a
    vocabulary the section leaves unset. ``extra``: config.json fields the section has no key for (the
    planner's ``--num-experts``/``--top-k``), under the explicit fields."""
    m = model_cfg
    base: dict = {}
    if m.hf_config:
        if not os.path.exists(m.hf_config):
            raise ValueError(f"model.hf_config={m.hf_config!r} does not exist; give the path of a config.json")
        with open(m.hf_config) as f:
            base = json.load(f)
    base.update(extra or {})
    family = base.get("model_type", m.family)
    if m.hf_config and "model_type" in base and m.changed("family") and m.family != family:
        raise ValueError(f"model.family={m.family!r} but model.hf_config={m.hf_config!r} is a {family!r} config.json "
                         f"(its model_type); remove model.family, or point model.hf_config at a {m.family} config")
    if family == "gpt2":
        _check_gpt2_keys(m, base)
        names = _GPT2_NAMES
        for key in ("attn_pdrop", "resid_pdrop", "embd_pdrop"):
            base.setdefault(key, 0.0)
    else:
        names = _HF_NAMES
    out = dict(base)
    out["model_type"] = family
    for ours, theirs in names.items():
        v = getattr(m, ours, None)
        if v is not None:
            out[theirs] = v
    if family != "gpt2" and (m.hidden_size is not None or m.num_attention_heads is not None):
        _section_head_defaults(out)
    if m.rope_theta is not None:  # a config.json's nested rope table (transformers 5) wins over the top-level key
        for key in ("rope_parameters", "rope_scaling"):
            if isinstance(out.get(key), dict) and "rope_theta" in out[key]:
                out[key] = {**out[key], "rope_theta": m.rope_theta}
    if family == "gpt2" and m.head_dim is not None:  # GPT-2 has no head_dim field: its heads split the width
        width, heads = out.get("n_embd"), out.get("n_head")
        if not (width and heads and m.head_dim * heads == width):
            raise ValueError(f"model.head_dim={m.head_dim} is set but the gpt2 family's head dim is hidden_size / "
                             f"num_attention_heads ({width} / {heads}); remove model.head_dim")
    if m.vocab_size is not None:
        out["vocab_size"] = m.vocab_size
    out.setdefault("vocab_size", vocab_size)
    if out["vocab_size"] is None:
        raise ValueError("model.vocab_size is not set and data.tokenizer is empty; set one of them")
    try:
        cfg = config_from_hf(out)
    except ValueError as e:  # a field the [model] section left out: name the TOML key, not config.json's
        missing = [ours for ours, theirs in names.items() if f"'{theirs}'" in str(e) and theirs not in base]
        if missing:
            raise MissingModelKey(f"model.{missing[0]} is not set and the {family} family needs it; set "
                                  f"model.{missing[0]}" + ("" if m.hf_config else " (or model.hf_config, a config.json)"),
                                  key=missing[0]) from None
        lacks = re.search(r"config\.json lacks ('[^']+')", str(e))
        if lacks and not m.hf_config:  # a config.json field the [model] section has no key for
            raise ValueError(f"the {family} family needs config.json's {lacks.group(1)}, which the [model] section "
                             "has no key for (experts, routing); set model.hf_config to the model's config.json (the "
                             "[model] keys override it)") from None
        raise
    return _complete(out, cfg)


def _check_gpt2_keys(m, base: dict) -> None:
    """Refuse the [model] keys GPT-2 has no config.json field for (they would be dropped), also where the
    family comes from model.hf_config's model_type rather than model.family (ModelConfig checks that case)."""
    where = f"model.hf_config={m.hf_config!r} is a gpt2 config.json" if "model_type" in base else "model.family='gpt2'"
    if m.rope_theta is not None:
        raise ValueError(f"model.rope_theta is set but {where}: gpt2 uses learned position embeddings, not RoPE; "
                         "remove model.rope_theta")
    heads = m.num_attention_heads or base.get("n_head")
    if m.num_key_value_heads is not None and m.num_key_value_heads != heads:
        raise ValueError(f"model.num_key_value_heads={m.num_key_value_heads} is set but {where}: gpt2 has no "
                         f"grouped-query attention (every one of its {heads} heads has its own k/v); remove "
                         "model.num_key_value_heads")


def _section_head_defaults(out: dict) -> None:
    """The [model] section's meaning of an unset head_dim and num_key_value_heads (ModelConfig): hidden_size
    // num_attention_heads and multi-head attention, written into ``out`` where neither the section nor
    model.hf_config sets them. Called when the section sets the sizes: a config.json's own sizes keep
    transformers' defaults for the family instead (Qwen3's head_dim is 128, Mistral has 8 kv heads)."""
    hidden, heads = out.get("hidden_size"), out.get("num_attention_heads")
    if not hidden or not heads:
        return  # config_from_hf names the missing key
    if "head_dim" not in out:
        if hidden % heads:
            raise ValueError(f"model.hidden_size={hidden} is not divisible by model.num_attention_heads={heads}; "
                             "change one of them or set model.head_dim explicitly")
        out["head_dim"] = hidden // heads
    out.setdefault("num_key_value_heads", heads)


def _complete(hf: dict, cfg: TransformerConfig) -> dict:
    """``hf`` with every architecture field Tessel resolved by default written out, so that whoever
    reads it (transformers, after an export) builds the same model even where the defaults differ
    (GPT-2 ties embeddings, max_position_embeddings varies by family; the experts' sizes, a Qwen2-MoE
    shared expert and the sparse layers: models/moe.py:hf_moe_fields)."""
    if cfg.model_type == "gpt2":
        fill = {"n_inner": cfg.ffn_hidden_size, "n_positions": cfg.max_position_embeddings,
                "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings}
    else:
        fill = {"num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
                "tie_word_embeddings": cfg.tie_word_embeddings}
        if "rope_parameters" not in hf and "rope_scaling" not in hf and cfg.rope is not None:
            fill["rope_theta"] = cfg.rope.theta
        if cfg.num_experts:
            fill.update(hf_moe_fields(cfg))
    out = dict(hf)
    for key, value in fill.items():
        out.setdefault(key, value)
    assert config_from_hf(out) == cfg, "completing the config changed the model"
    return out


def flops_spec(c: TransformerConfig) -> FlopsSpec:
    """The FLOP-count shapes of a :class:`TransformerConfig`. With experts, the MLP width is the mean over
    layers of the ACTIVE width (top-k experts plus the shared expert; the dense width on dense layers), so
    the MLP FLOPs are exact; the router's 2*h*E per token is left out (docs/moe.md)."""
    ffn = c.ffn_hidden_size
    if c.num_experts:
        moe = c.moe_top_k * c.moe_ffn_hidden_size + c.shared_expert_ffn_hidden_size
        widths = [moe if c.is_moe_layer(i) else c.ffn_hidden_size for i in range(c.num_layers)]
        ffn = sum(widths) / c.num_layers if sum(widths) % c.num_layers else sum(widths) // c.num_layers
    return FlopsSpec(num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=ffn,
                     vocab_size=c.vocab_size, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                     head_dim=c.head_dim, gated_mlp=c.mlp == "swiglu")


def param_spec(name: str, param: torch.Tensor) -> ParamSpec:
    """Checkpoint key and placement of a parameter of the trainer's chunk list (``<chunk>.<name>``):
    the chunk index is dropped (layers carry GLOBAL indices, so keys do not depend on the layout)."""
    return model_param_spec(_CHUNK_PREFIX.sub("", name), param)


@dataclass(frozen=True)
class ModelHook:
    """One model for one run: build with :meth:`from_run_config` (or directly from a config.json dict)."""

    hf_config: dict
    config: TransformerConfig
    dtype: torch.dtype = torch.float32
    make_vocab_size_divisible_by: int = 128
    kernels: str = "auto"
    fused_cross_entropy: bool | None = None
    sequence_parallel: bool = False
    seed: int = 1234
    fp8: str = "none"
    fp8_exclude: tuple[str, ...] = ()
    fp8_amax_history: int = 16
    fp8_margin: int = 0
    fp8_backend: str = "tessel"  # model.fp8_backend: "tessel" (engine/ops) or "te" (parallel/tensor_parallel/fp8_te.py)
    tp_overlap: str = "none"
    cp_comm: str = "ring"  # parallel.cp_comm: how attention spans the cp group (docs/context_parallel.md)
    recompute: str = "none"  # activation recompute: none | selective | full (models/transformer.py)
    recompute_num_layers: int | None = None  # full only: the first N layers of each stage
    moe_dispatcher: str = "alltoall"  # parallel.moe_dispatcher: how MoE tokens reach their experts' ep ranks
    moe_bias_update_rate: float = 0.0  # parallel.moe_bias_update_rate: aux-loss-free balancing (0: off)
    expert_tp: int | None = None  # parallel.expert_tp: None (= tp, experts sharded over tp) or 1 (whole experts)

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any], **kw) -> "ModelHook":
        hf = dict(hf_config)
        return cls(hf_config=hf, config=config_from_hf(hf), **kw)

    @classmethod
    def from_run_config(cls, cfg, *, tokenizer_vocab: int | None) -> "ModelHook":
        """The model of a :class:`engine.config.TesselConfig` (vocabulary checked against the tokenizer's)."""
        hf = hf_config_from_run(cfg.model, vocab_size=tokenizer_vocab)
        if tokenizer_vocab is not None and tokenizer_vocab > hf["vocab_size"]:
            raise ValueError(f"the tokenizer has {tokenizer_vocab} tokens but model.vocab_size={hf['vocab_size']}; "
                             f"set model.vocab_size >= {tokenizer_vocab}")
        hook = cls.from_hf(hf, dtype=DTYPES[cfg.model.dtype],
                           make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
                           kernels=cfg.model.kernels, fused_cross_entropy=cfg.model.fused_cross_entropy,
                           sequence_parallel=cfg.parallel.sequence_parallel, seed=cfg.train.seed,
                           fp8=cfg.model.fp8, fp8_exclude=tuple(cfg.model.fp8_exclude),
                           fp8_amax_history=cfg.model.fp8_amax_history, fp8_margin=cfg.model.fp8_margin,
                           fp8_backend=cfg.model.fp8_backend, tp_overlap=cfg.parallel.tp_overlap,
                           cp_comm=cfg.parallel.cp_comm,
                           recompute=cfg.train.activation_checkpointing,
                           recompute_num_layers=cfg.train.recompute_num_layers,
                           moe_dispatcher=cfg.parallel.moe_dispatcher,
                           moe_bias_update_rate=cfg.parallel.moe_bias_update_rate,
                           expert_tp=cfg.parallel.expert_tp)
        if cfg.parallel.cp > 1 and hook.config.attention_dropout > 0:  # training; evaluation at cp > 1 runs
            from models.attention import cp_attention_dropout_error
            raise cp_attention_dropout_error(hook.config.attention_dropout)
        u = cfg.outer
        if (u.method == "streaming_diloco" and u.fragments > 1 and u.fragment_layout == "contiguous"
                and cfg.parallel.pp > 1 and hook.config.tie_word_embeddings):
            raise ValueError(f"outer.fragment_layout='contiguous' with tied embeddings at parallel.pp={cfg.parallel.pp}: "
                             "each stage cuts its own fragments, so the embedding's copies on the first and last stage "
                             "would sync at different steps and drift apart; use outer.fragment_layout='strided' "
                             "(both copies in fragment 0) or model.tie_word_embeddings=false")
        # The run's device (engine.assembly builds on CUDA when there is one): symm_mem needs it
        check_tp_overlap(cfg.parallel.tp_overlap, tp=cfg.parallel.tp, sequence_parallel=cfg.parallel.sequence_parallel,
                         device_type="cuda" if torch.cuda.is_available() else "cpu", fp8=cfg.model.fp8)
        if cfg.parallel.moe_bias_update_rate and not hook.config.num_experts:
            raise ValueError(f"parallel.moe_bias_update_rate={cfg.parallel.moe_bias_update_rate} balances experts, but "
                             f"the {hook.config.model_type} model has none; remove it")
        if cfg.parallel.changed("moe_dispatcher") and not hook.config.num_experts:
            raise ValueError(f"parallel.moe_dispatcher={cfg.parallel.moe_dispatcher!r} routes tokens to experts, but "
                             f"the {hook.config.model_type} model has none; remove it")
        if cfg.parallel.ep > 1 or cfg.parallel.expert_tp_size != cfg.parallel.tp:
            hook.check_expert_parallel(cfg.parallel.ep, expert_tp=cfg.parallel.expert_tp_size)
        n = cfg.train.recompute_num_layers
        if n is not None and n > hook.num_layers:
            raise ValueError(f"train.recompute_num_layers={n} exceeds the model's {hook.num_layers} layers; set at "
                             f"most {hook.num_layers} (it counts the first layers of each pipeline stage; a stage "
                             "with fewer recomputes all of its own)")
        if cfg.model.fp8 != "none":
            if cfg.model.fp8_backend == "te":
                from parallel.tensor_parallel.fp8_te import check_te_backend
                check_te_backend(recipe=cfg.model.fp8, tp_overlap=cfg.parallel.tp_overlap,
                                 recompute=cfg.train.activation_checkpointing,
                                 tokens=cfg.train.seq_length // cfg.parallel.cp * cfg.train.micro_batch_size,
                                 generates=cfg.posttrain.method == "grpo")
            hook.check_fp8(tp=cfg.parallel.tp)
        positions = hook.config.max_position_embeddings
        if cfg.train.seq_length > positions:
            where = ("model.max_position_embeddings" if cfg.model.max_position_embeddings is not None
                     else "the family's default max_position_embeddings (model.max_position_embeddings is unset)")
            raise ValueError(f"train.seq_length={cfg.train.seq_length} exceeds {where} = {positions}; set "
                             f"model.max_position_embeddings >= {cfg.train.seq_length} or shorten train.seq_length")
        return hook

    def check_expert_parallel(self, ep: int, *, expert_tp: int | None = None) -> None:
        """Before any process group: ``parallel.ep`` > 1 needs a mixture-of-experts model whose expert
        count it divides (top-k <= experts is checked when the config is read); so does an ``expert_tp``
        other than the model's tp (given only then; the config checked its value)."""
        from parallel.expert_parallel.router import check_routing

        c = self.config
        if ep > 1 and not c.num_experts:
            raise ValueError(f"parallel.ep={ep} splits experts over ranks, but the {c.model_type} model has none; "
                             "set parallel.ep=1, or train a mixture-of-experts family (mixtral, qwen2_moe, qwen3_moe)")
        if expert_tp is not None and not c.num_experts:
            raise ValueError(f"parallel.expert_tp={expert_tp} sets the experts' tensor parallelism, but the "
                             f"{c.model_type} model has none; remove it")
        if c.num_experts:
            check_routing(num_experts=c.num_experts, top_k=c.moe_top_k, ep=ep)

    def fp8_linears(self, *, tp: int) -> dict[str, tuple[int, int]]:
        """The TP-local (out, in) weight shape of each layer-relative linear model.fp8 may convert."""
        c = self.config
        width = (2 if c.gated else 1) * c.ffn_hidden_size
        qkv = c.num_kv_heads * (c.num_heads // c.num_kv_heads + 2) * c.head_dim
        return {"attention.qkv": (qkv // tp, c.hidden_size), "attention.out": (c.hidden_size, c.num_heads * c.head_dim // tp),
                "mlp.fc1": (width // tp, c.hidden_size), "mlp.fc2": (c.hidden_size, c.ffn_hidden_size // tp)}

    def check_fp8(self, *, tp: int) -> None:
        """Before any process group: the exclude list names linears, and every FP8 linear's TP-local
        K and N are multiples of 16 (32 for TE's MXFP8: its 1x32 blocks; the error names the linear and the fix)."""
        from engine.ops.fp8_linear import check_fp8_shapes
        from parallel.tensor_parallel.fp8_te import MX_TOKEN_MULTIPLE

        check_exclude(self.fp8_exclude, self.num_layers)
        te_mx = self.fp8 == "mxfp8" and self.fp8_backend == "te"
        for rel, (out, inp) in self.fp8_linears(tp=tp).items():
            if any(e in (rel, rel.split(".")[1]) for e in self.fp8_exclude):
                continue
            check_fp8_shapes(inp, out, where=f"model.fp8={self.fp8}: linear {rel} (TP-local weight {out} x {inp} "
                                             f"at tp={tp})",
                             **(dict(multiple=MX_TOKEN_MULTIPLE, why="Transformer Engine's MXFP8 blocks")
                                if te_mx else {}))

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def flops(self) -> FlopsSpec:
        return flops_spec(self.config)

    def build_stage(self, mesh, *, pre_process: bool, post_process: bool, layer_range: tuple[int, int],
                    device=None) -> TransformerStage:
        """The module of one virtual pipeline stage, on ``mesh.tp`` (and ``mesh.cp``: context parallelism)."""
        stage = build_model(self.config, tp_group=mesh.tp, sequence_parallel=self.sequence_parallel,
                            pre_process=pre_process, post_process=post_process, layer_range=layer_range,
                            dtype=self.dtype, device=device, seed=self.seed,
                            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
                            kernels=self.kernels, fused_cross_entropy=self.fused_cross_entropy,
                            linear_impl=(RingLinearImpl() if self.tp_overlap == "ring" else
                                         SymmMemLinearImpl() if self.tp_overlap == "symm_mem" else None),
                            recompute=self.recompute, recompute_num_layers=self.recompute_num_layers,
                            cp_group=getattr(mesh, "cp", None), cp_comm=self.cp_comm,
                            cp_subgroups=(mesh.cp_a2a, mesh.cp_ring) if self.cp_comm == "hybrid" else None,
                            ep_group=getattr(mesh, "ep", None), moe_dispatcher=self.moe_dispatcher,
                            expert_tp=self.expert_tp)
        if self.moe_bias_update_rate:  # aux-loss-free balancing (DeepSeek-V3): a bias per router, docs/moe.md
            from parallel.expert_parallel import MoELayer

            for m in stage.modules():
                if isinstance(m, MoELayer):
                    m.router.enable_bias_balancing(self.moe_bias_update_rate)
        if self.fp8 != "none":
            if self.fp8_backend == "te":
                from parallel.tensor_parallel.fp8_te import apply_te_fp8

                apply_te_fp8(stage, self.fp8, exclude=self.fp8_exclude, history_len=self.fp8_amax_history,
                             margin=self.fp8_margin)
            else:
                apply_fp8(stage, self.fp8, exclude=self.fp8_exclude, history_len=self.fp8_amax_history,
                          margin=self.fp8_margin)
        return stage

    @staticmethod
    def param_spec(name: str, param: torch.Tensor) -> ParamSpec:
        return param_spec(name, param)

    def stage_numel(self, *, tp: int, layer_range: tuple[int, int], pre_process: bool, post_process: bool,
                    expert_tp: int | None = None) -> int:
        """Parameters one TP rank of a stage holds, derived without building it (for the memory plan)."""
        return sum(n for _, n, _ in self.stage_param_sizes(tp=tp, layer_range=layer_range, pre_process=pre_process,
                                                           post_process=post_process, expert_tp=expert_tp))

    def stage_params(self, *, tp: int, layer_range: tuple[int, int], pre_process: bool, post_process: bool,
                     ep: int = 1, expert_tp: int | None = None):
        """:func:`models.convert.stage_params` of a stage on TP rank 0 (and ep rank 0: ``num_experts / ep``
        experts of each MoE layer; whole experts at ``expert_tp`` = 1), in the built stage's registration
        order, without building it."""
        from models.convert import stage_params

        padded = self.config.padded_vocab_size(tp=tp, make_vocab_size_divisible_by=self.make_vocab_size_divisible_by)
        return stage_params(self.config, tp_rank=0, tp_size=tp, layer_range=layer_range, pre_process=pre_process,
                            post_process=post_process, padded_vocab=padded, ep_rank=0, ep_size=ep,
                            expert_tp=expert_tp)

    def stage_param_sizes(self, *, tp: int, layer_range: tuple[int, int], pre_process: bool,
                          post_process: bool, expert_tp: int | None = None) -> list[tuple[str, int, bool]]:
        """``(name, elements on one TP rank, shared_embedding)`` of each parameter of a stage, in the built
        stage's registration order, without building it (engine/memory.py lays out the DP buffers)."""
        return [(p.name, math.prod(p.local_shape), p.shared_embedding)
                for p in self.stage_params(tp=tp, layer_range=layer_range, pre_process=pre_process,
                                           post_process=post_process, expert_tp=expert_tp)]
