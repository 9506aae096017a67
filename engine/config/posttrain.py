"""The ``[posttrain]`` section (tools/posttrain.py) and its nested tables ``[posttrain.lora]`` and
``[posttrain.dpo]``: what to fine-tune on, with which objective, and which parameters train.

Pretraining (tools/pretrain.py) refuses a config whose ``posttrain.method`` is not "none", and
tools/posttrain.py refuses one where it is: a key either works or is rejected.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config._fields import Section
from engine.config.sections import check_choice, check_min, check_nonempty, check_positive

METHODS = ("none", "sft", "dpo")  # "grpo" arrives with its trainer (engine/posttrain/grpo.py holds the loss)
DPO_LOSSES = ("sigmoid", "ipo")


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
class PosttrainConfig(Section):
    """Post-training (tools/posttrain.py). ``method``: "sft" (chat records, loss on assistant tokens)
    or "dpo" (preference records); "none" for pretraining. ``data``/``valid_data``: JSONL files of
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

    def _validate(self) -> None:
        if self.method == "grpo":
            raise ValueError("posttrain.method='grpo' is not wired into tools/posttrain.py yet (the GRPO loss, "
                             "rewards and generation exist: engine/posttrain/); use sft or dpo")
        check_choice(self, "method", METHODS)
        for key in ("data", "valid_data", "chat_template"):
            check_nonempty(self, key)
        if self.method != "none" and not self.data:
            raise ValueError(f"posttrain.method={self.method!r} needs posttrain.data: a JSONL file of "
                             + ("chat records {'messages': [...]}" if self.method == "sft"
                                else "preference records {'prompt', 'chosen', 'rejected'}"))
        if self.method == "dpo" and self.pack:
            raise ValueError("posttrain.pack=true does not apply to dpo: each preference pair is two padded rows "
                             "(chosen, rejected); remove posttrain.pack")

    @property
    def packed(self) -> bool:
        return self.method == "sft" and self.pack is not False
