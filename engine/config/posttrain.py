"""The ``[posttrain]`` section (tools/posttrain.py) and its nested tables ``[posttrain.lora]``,
``[posttrain.dpo]`` and ``[posttrain.grpo]``: what to fine-tune on, with which objective, and which parameters train.

Pretraining (tools/pretrain.py) refuses a config whose ``posttrain.method`` is not "none", and
tools/posttrain.py refuses one where it is: a key either works or is rejected.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config._fields import Section
from engine.config.sections import check_choice, check_min, check_nonempty, check_positive

from engine.posttrain.dpo import DPO_LOSS_TYPES as DPO_LOSSES
from engine.posttrain.grpo import ADVANTAGE_SCALES, LOSS_LEVELS, RATIO_LEVELS

METHODS = ("none", "sft", "dpo", "grpo")


@dataclass(kw_only=True, frozen=True)
class LoraConfig(Section):
    """LoRA adapters (engine/posttrain/lora.py). ``rank = 0``: no adapters, every parameter trains.
    ``targets``: Tessel module names (qkv, out, fc1, fc2, or "all"); the output layer never."""

    SECTION = "posttrain.lora"

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["all"])

    def _validate(self) -> None:
        check_min(self, "rank", 0, why="0 disables LoRA")
        check_positive(self, "alpha")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"posttrain.lora.dropout={self.dropout} must be in [0, 1)")
        if self.rank and not self.targets:
            raise ValueError("posttrain.lora.targets is empty; name the linears to adapt (qkv, out, fc1, fc2) "
                             "or 'all', or set posttrain.lora.rank=0")
        used = self.changed("alpha", "dropout", "targets") if self.rank == 0 else []
        if used:
            raise ValueError(f"posttrain.lora.{used[0]} is set but posttrain.lora.rank = 0 (no adapters: every parameter "
                             "trains); set posttrain.lora.rank (e.g. 8) to train adapters, or remove "
                             f"posttrain.lora.{used[0]}")


@dataclass(kw_only=True, frozen=True)
class DpoConfig(Section):
    """Direct preference optimisation (engine/posttrain/dpo.py): ``beta`` scales the log-ratio,
    ``label_smoothing`` is the conservative-DPO noise rate (sigmoid loss only), ``loss_type`` is
    "sigmoid" (DPO) or "ipo"."""

    SECTION = "posttrain.dpo"

    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: str = "sigmoid"

    def _validate(self) -> None:
        check_positive(self, "beta")
        check_choice(self, "loss_type", DPO_LOSSES)
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"posttrain.dpo.label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(f"posttrain.dpo.label_smoothing applies to the sigmoid loss only; set it to 0 "
                             f"with loss_type={self.loss_type!r}")


@dataclass(kw_only=True, frozen=True)
class GrpoConfig(Section):
    """Group relative policy optimisation (engine/posttrain/rollout.py, grpo.py). Each rollout samples
    ``group_size`` completions of up to ``max_new_tokens`` tokens per prompt (``temperature``, ``top_p``)
    with the current weights, scores them with the records' reward functions, normalises the rewards
    per group (``advantage_scale``: "std", or "none" for Dr. GRPO) and feeds ``steps_per_rollout``
    optimizer steps. Loss: the clipped surrogate (``clip_low``; ``clip_high`` > clip_low is DAPO's
    clip-higher, unset = clip_low) with token or sequence (GSPO) importance ratios (``ratio_level``),
    normalised per token (DAPO) or per sequence (``loss_level``), plus ``kl_beta`` times the k3 KL to
    the base weights. ``reward_modules``: Python modules whose ``register(registry)`` adds reward
    functions to the shipped ones (arithmetic, format)."""

    SECTION = "posttrain.grpo"

    group_size: int = 4
    steps_per_rollout: int = 1
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    clip_low: float = 0.2
    clip_high: float | None = None
    kl_beta: float = 0.0
    ratio_level: str = "token"
    loss_level: str = "token"
    advantage_scale: str = "std"
    reward_modules: list[str] = field(default_factory=list)

    def _validate(self) -> None:
        check_min(self, "group_size", 2, why="advantages compare samples of the same prompt")
        check_min(self, "steps_per_rollout", 1)
        check_min(self, "max_new_tokens", 1)
        check_positive(self, "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"posttrain.grpo.top_p={self.top_p} must be in (0, 1]")
        if not 0.0 < self.clip_low < 1.0:
            raise ValueError(f"posttrain.grpo.clip_low={self.clip_low} must be in (0, 1)")
        check_positive(self, "clip_high")
        check_min(self, "kl_beta", 0.0)
        check_choice(self, "ratio_level", RATIO_LEVELS)
        check_choice(self, "loss_level", LOSS_LEVELS)
        check_choice(self, "advantage_scale", ADVANTAGE_SCALES)


@dataclass(kw_only=True, frozen=True)
class PosttrainConfig(Section):
    """Post-training (tools/posttrain.py). ``method``: "sft" (chat records, loss on assistant tokens),
    "dpo" (preference records) or "grpo" (prompt records with a reward); "none" for pretraining. ``data``/``valid_data``: JSONL files of
    records (docs/posttrain.md). ``chat_template``: a Jinja file to use instead of the tokenizer's
    own (tokenizer_config.json ``chat_template`` or chat_template.jinja beside it). ``pack``: SFT
    packs several conversations per row (document-aware attention, positions restarting per
    conversation; the default), false pads one per row; DPO rows are never packed. ``truncate``: cut records longer than
    ``train.seq_length`` instead of refusing them."""

    SECTION = "posttrain"

    method: str = "none"
    data: str | None = None
    valid_data: str | None = None
    chat_template: str | None = None
    pack: bool | None = None
    truncate: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)

    def _validate(self) -> None:
        check_choice(self, "method", METHODS)
        for key in ("data", "valid_data", "chat_template"):
            check_nonempty(self, key)
        if self.method != "none" and not self.data:
            kind = {"sft": "chat records {'messages': [...]}",
                    "dpo": "preference records {'prompt', 'chosen', 'rejected'}",
                    "grpo": "prompt records {'messages': [...], 'reward': NAME, ...}"}[self.method]
            raise ValueError(f"posttrain.method={self.method!r} needs posttrain.data: a JSONL file of {kind}")
        if self.method in ("dpo", "grpo") and self.pack:
            raise ValueError(f"posttrain.pack=true does not apply to {self.method}: each sequence is a padded row "
                             "of its own; remove posttrain.pack")
        self._check_unused()

    def _check_unused(self) -> None:
        """A key another method reads is refused, not ignored."""
        if self.method == "none":
            used = [k for k in self.changed() if k != "method"]
            if used:
                raise ValueError(f"posttrain.{used[0]} is set but posttrain.method is 'none' (pretraining): set "
                                 "posttrain.method and run tools/posttrain.py, or remove the [posttrain] keys")
            return
        for table, method in (("dpo", "dpo"), ("grpo", "grpo")):
            if self.method != method and self.changed(table):
                raise ValueError(f"[posttrain.{table}] is set but posttrain.method={self.method!r}: it applies to "
                                 f"posttrain.method='{method}' only; remove it")
        if self.method == "grpo" and self.truncate:
            raise ValueError("posttrain.truncate does not apply to grpo (a prompt is never cut: it must leave room "
                             "for posttrain.grpo.max_new_tokens); remove it")

    @property
    def packed(self) -> bool:
        return self.method == "sft" and self.pack is not False


