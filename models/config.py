"""The model description Tessel builds from: one dataclass filled from a Hugging Face config.json.

Each family module (models/gpt2.py, llama.py, ...) reads its own config.json fields into a
:class:`TransformerConfig`; the builder never looks at the Hugging Face dict again. Fields that
would change the computation and are not implemented raise a ValueError naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

NORMS = ("layernorm", "rmsnorm")
MLPS = ("swiglu", "gelu_tanh", "gelu")
POSITIONS = ("rope", "learned")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding over the whole head dim, rotate-half convention (as Hugging Face Llama)."""

    theta: float = 10000.0
    scaling: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.scaling not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type {self.scaling!r} is not supported; Tessel implements {ROPE_TYPES} "
                             "(remove rope_scaling or convert the model)")
        if self.theta <= 0:
            raise ValueError(f"rope_theta={self.theta} must be positive")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor={self.factor} must be positive")
        if self.scaling == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(f"rope_scaling: llama3 needs high_freq_factor ({self.high_freq_factor}) > "
                             f"low_freq_factor ({self.low_freq_factor}) > 0")


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """A decoder-only causal LM. Sizes are global (before tensor-parallel sharding)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    max_position_embeddings: int
    norm: str = "rmsnorm"
    norm_eps: float = 1e-6
    mlp: str = "swiglu"
    position_embedding: str = "rope"
    rope: RopeConfig | None = field(default_factory=RopeConfig)
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # one entry per layer; () means no window anywhere
    tie_word_embeddings: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    embedding_dropout: float = 0.0
    initializer_range: float = 0.02
    scaled_output_init: bool = False  # output projections drawn with std / sqrt(2 * num_layers) (GPT-2)
    attention_scale: float | None = None  # None: 1 / sqrt(head_dim)
    # Mixture of experts (models/moe.py, docs/moe.md); num_experts = 0: a dense model.
    num_experts: int = 0
    moe_top_k: int = 0  # num_experts_per_tok
    moe_ffn_hidden_size: int = 0  # each expert's intermediate size
    shared_expert_ffn_hidden_size: int = 0  # Qwen2-MoE's gated shared expert; 0: none
    moe_layers: tuple[bool, ...] = ()  # per layer, True where the MLP is the MoE; () = every layer
    norm_topk_prob: bool = True  # renormalise the top-k softmax scores to sum to 1
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0  # ST-MoE z-loss; config.json's router_z_loss_coef where present

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "ffn_hidden_size", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}; fix the config")
        if self.norm not in NORMS:
            raise ValueError(f"norm={self.norm!r}: use one of {NORMS}")
        if self.mlp not in MLPS:
            raise ValueError(f"mlp={self.mlp!r}: use one of {MLPS}")
        if self.position_embedding not in POSITIONS:
            raise ValueError(f"position_embedding={self.position_embedding!r}: use one of {POSITIONS}")
        if (self.position_embedding == "rope") != (self.rope is not None):
            raise ValueError("rope must be set exactly when position_embedding='rope'")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers")
        for w in self.sliding_windows:
            if w is not None and (not isinstance(w, int) or w < 1):
                raise ValueError(f"sliding_window={w!r} must be a positive integer or null")
        for name in ("attention_dropout", "hidden_dropout", "embedding_dropout"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"{name}={v} must be in [0, 1)")

        if self.num_experts:
            from parallel.expert_parallel.router import check_routing
            check_routing(num_experts=self.num_experts, top_k=self.moe_top_k)
            if self.moe_ffn_hidden_size < 1 or self.mlp != "swiglu":
                raise ValueError("an MoE config needs moe_intermediate_size >= 1 and the SwiGLU MLP")
            if self.moe_layers and len(self.moe_layers) != self.num_layers:
                raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (global index) has the mixture-of-experts MLP."""
        return bool(self.num_experts) and (not self.moe_layers or self.moe_layers[layer])

    def sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def gated(self) -> bool:
        return self.mlp == "swiglu"

    def check_tensor_parallel(self, tp: int) -> None:
        """ValueError unless every sharded dimension splits evenly over ``tp`` ranks; the message names the
        TP sizes that split all of them."""
        sizes = (self.num_heads, self.num_kv_heads, self.ffn_hidden_size,
                 *((self.moe_ffn_hidden_size,) if self.num_experts else ()),
                 *((self.shared_expert_ffn_hidden_size,) if self.shared_expert_ffn_hidden_size else ()))
        fits = ", ".join(str(d) for d in range(1, min(sizes) + 1) if all(v % d == 0 for v in sizes))
        hint = (f"choose a TP size that divides num_attention_heads={self.num_heads}, num_key_value_heads="
                f"{self.num_kv_heads} and intermediate_size={self.ffn_hidden_size}: one of {fits}")
        if self.num_heads % tp:
            raise ValueError(f"num_attention_heads={self.num_heads} is not divisible by tensor-parallel size {tp}; "
                             + hint)
        if self.num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads={self.num_kv_heads} is not divisible by tensor-parallel size "
                             f"{tp}: each TP rank holds whole query groups with their k/v heads; " + hint)
        if self.ffn_hidden_size % tp:
            raise ValueError(f"intermediate_size={self.ffn_hidden_size} is not divisible by tensor-parallel size "
                             f"{tp}; " + hint)
        if any(v % tp for v in sizes[3:]):
            raise ValueError(f"moe_intermediate_size={self.moe_ffn_hidden_size} / shared_expert_intermediate_size="
                             f"{self.shared_expert_ffn_hidden_size} is not divisible by tensor-parallel size {tp}; "
                             "choose a TP size that divides both (experts are TP-sharded like the dense MLP)")

    def padded_vocab_size(self, *, tp: int, make_vocab_size_divisible_by: int = 128) -> int:
        """Vocab rounded up to a multiple of ``make_vocab_size_divisible_by * tp`` (Megatron's rule)."""
        if not isinstance(make_vocab_size_divisible_by, int) or make_vocab_size_divisible_by < 1:
            raise ValueError(f"make_vocab_size_divisible_by={make_vocab_size_divisible_by!r} must be a positive "
                             "integer (1 pads only to a multiple of the TP size)")
        multiple = make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


# -- helpers for the family parsers ------------------------------------------------------------------

def hf_require(hf: Mapping[str, Any], key: str, *, family: str) -> Any:
    if hf.get(key) is None:
        raise ValueError(f"{family} config.json lacks {key!r}; pass the model's full config.json")
    return hf[key]


def hf_reject(hf: Mapping[str, Any], key: str, *, allowed, family: str, why: str) -> None:
    """ValueError if ``hf[key]`` is present and not in ``allowed``."""
    if key in hf and hf[key] not in allowed:
        raise ValueError(f"{family} config field {key}={hf[key]!r} is not supported ({why}); "
                         f"supported values: {list(allowed)}")


def check_architectures(hf: Mapping[str, Any], *, supported: tuple[str, ...], family: str) -> None:
    for arch in hf.get("architectures") or ():
        if arch not in supported:
            raise ValueError(f"architecture {arch!r} is not supported for {family}; Tessel builds causal LMs "
                             f"({', '.join(supported)}): set \"architectures\" accordingly")


def parse_rope(hf: Mapping[str, Any], *, family: str, default_theta: float = 10000.0) -> RopeConfig:
    """Read rope_theta / rope_parameters (transformers 5) or rope_scaling (older files); ``default_theta``:
    transformers' for the family, where config.json has none (Mixtral's is 1e6)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"{family} rope_parameters/rope_scaling must be a JSON object, got {params!r}")
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"{family}: per-layer-type rope_parameters are not supported; use one rope setting")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"{family} rope_scaling type {kind!r} is not supported; Tessel implements {ROPE_TYPES}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{family} partial_rotary_factor={partial} is not supported (rotary over the full head "
                         "dim only); remove it or use 1.0")
    theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    kw: dict[str, Any] = {"theta": float(theta), "scaling": kind}
    if kind in ("linear", "llama3"):
        if params.get("factor") is None:
            raise ValueError(f"{family} rope_scaling of type {kind!r} needs 'factor'")
        kw["factor"] = float(params["factor"])
    if kind == "llama3":
        for k in ("low_freq_factor", "high_freq_factor"):
            if params.get(k) is None:
                raise ValueError(f"{family} rope_scaling of type 'llama3' needs {k!r}")
            kw[k] = float(params[k])
        # Hugging Face gives a top-level original_max_position_embeddings priority over the rope dict.
        orig = (hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                or hf.get("max_position_embeddings"))
        if orig is None:
            raise ValueError(f"{family} rope_scaling of type 'llama3' needs 'original_max_position_embeddings'")
        kw["original_max_position_embeddings"] = int(orig)
    return RopeConfig(**kw)
