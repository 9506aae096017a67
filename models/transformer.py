"""The decoder stack built from tensor-parallel layers, as one pipeline stage.

:func:`build_model` is the single entry point: a Hugging Face config.json dict plus Tessel options
(TP group, sequence parallelism, which layers and ends this stage holds, vocab padding, dtype,
device, seed) -> a :class:`TransformerStage`.

Activations are sequence-first ``(s, b, h)``; with sequence parallelism (SP) every tensor between
the TP regions (embedding output, residual stream, norms, stage boundaries) is ``(s/tp, b, h)``.

Context parallelism (``cp_group`` of size > 1, docs/context_parallel.md): the stage holds each
sequence's zigzag shard (``parallel.context_parallel.shard_micro_batch``): ``(b, s/cp)`` ids, or
``(s/cp, b, h)`` (``(s/cp/tp, b, h)`` with SP) hidden states; only core attention communicates.

Inference (engine/posttrain/generate.py): ``forward(..., kv_cache=stage.new_kv_cache(...))`` runs
with a KV cache (models/attention.py), inside ``stage.without_sequence_parallel()``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch
from torch import nn

from engine.ops.fused_linear_ce import fused_linear_cross_entropy
from models import ops
from models.attention import (AttentionMasks, KVCache, SelfAttention, document_ids_from_cu_seqlens,
                              document_ids_from_positions, positions_from_documents)
from models.config import TransformerConfig
from models.init import Initializer
from models.moe import build_moe_mlp
from models.rope import inv_freq
from parallel import comm
from parallel.comm import Group
from parallel.context_parallel import (CP_COMM, ContextParallel, ContextParallelMasks, check_cp_sequence,
                                       gather_sequence, zigzag_indices, zigzag_shard)
from parallel.mappings import copy_to_tp, gather_from_sp
from parallel.random import RNGTracker, checkpoint, cp_seed, make_tracker, pp_seed
from parallel.tensor_parallel import (ColumnParallelLinear, DefaultLinearImpl, LinearImpl, RowParallelLinear,
                                      TPReduce, VocabParallelEmbedding, check_ids, mark_replicated,
                                      vocab_parallel_cross_entropy)

# Activation recompute (docs/memory.md): "selective" recomputes core attention in backward, "full" the
# whole layer (keeping only its input).
RECOMPUTE = ("none", "selective", "full")


def _hidden_dropout(x, p: float, *, training: bool, partitioned: bool, rng: RNGTracker):
    """Dropout on the residual stream: the model-parallel stream when the tensor is sequence-sharded
    (SP), else the default stream, equal on all TP ranks so the replicas stay identical."""
    if not training or p == 0:
        return x
    with rng.fork() if partitioned else contextlib.nullcontext():
        return ops.dropout(x, p, training=True)


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the hidden dim; weights replicated across TP.

    Under SP each rank normalises its own sequence chunk, so the weight (and bias) gradients are
    partial sums over the TP group: marked ``sequence_parallel``."""

    def __init__(self, kind: str, size: int, *, eps: float, sequence_parallel: bool, dtype, device,
                 kernels: str = "auto"):
        super().__init__()
        self.kind, self.eps, self.kernels = kind, eps, kernels
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        mark_replicated(self.weight, sequence_parallel=sequence_parallel)
        if kind == "layernorm":
            self.bias = nn.Parameter(torch.zeros(size, dtype=dtype, device=device))
            mark_replicated(self.bias, sequence_parallel=sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: ``(norm(residual + x), residual + x)`` (fused on the
        Triton path: one pass over the residual stream instead of three)."""
        if self.kind == "rmsnorm":
            return ops.rms_norm(x, self.weight, self.eps, residual=residual, backend=self.kernels)
        if residual is None:
            return ops.layer_norm(x, self.weight, self.bias, self.eps)
        h = residual + x
        return ops.layer_norm(h, self.weight, self.bias, self.eps), h


class MLP(nn.Module):
    """fc1 (column-parallel; [gate_r | up_r] per rank for SwiGLU) -> activation -> fc2 (row-parallel)."""

    def __init__(self, cfg: TransformerConfig, *, layer_number: int, tp_group: Group, sequence_parallel: bool,
                 dtype, device, init, linear_impl, kernels: str = "auto"):
        super().__init__()
        prefix = f"layers.{layer_number}.mlp."
        self.kind = cfg.mlp
        self.kernels = kernels
        width = (2 if cfg.gated else 1) * cfg.ffn_hidden_size
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, width, tp_group=tp_group, bias=cfg.mlp_bias,
                                        sequence_parallel=sequence_parallel, dtype=dtype, device=device,
                                        partition_stride=2 if cfg.gated else 1,
                                        init_method=init(prefix + "fc1.weight"), impl=linear_impl)
        self.fc2 = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, tp_group=tp_group, bias=cfg.mlp_bias,
                                     sequence_parallel=sequence_parallel, dtype=dtype, device=device,
                                     init_method=init(prefix + "fc2.weight", output=True), impl=linear_impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # (s, b, width/tp)
        if self.kind == "swiglu":
            h = ops.swiglu(h, backend=self.kernels)
        else:
            h = ops.gelu(h, approximate="tanh" if self.kind == "gelu_tanh" else "none")
        return self.fc2(h)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). ``layer_number`` is global."""

    def __init__(self, cfg: TransformerConfig, *, layer_number: int, tp_group: Group, sequence_parallel: bool,
                 dtype, device, init, linear_impl, rng: RNGTracker, kernels: str = "auto",
                 cp: ContextParallel | None = None, ep_group: Group | None = None, moe_dispatcher: str = "alltoall",
                 expert_tp: int | None = None):
        super().__init__()
        self.layer_number = layer_number
        self.sequence_parallel = sequence_parallel
        self.hidden_dropout = cfg.hidden_dropout
        self.rng = rng
        kw = dict(sequence_parallel=sequence_parallel, dtype=dtype, device=device, kernels=kernels)
        self.input_norm = Norm(cfg.norm, cfg.hidden_size, eps=cfg.norm_eps, **kw)
        self.attention = SelfAttention(cfg, layer_number=layer_number, tp_group=tp_group, init=init,
                                       linear_impl=linear_impl, rng=rng, cp=cp, **kw)
        self.post_attention_norm = Norm(cfg.norm, cfg.hidden_size, eps=cfg.norm_eps, **kw)
        if cfg.is_moe_layer(layer_number):  # mixture of experts (models/moe.py): tokens routed over ep_group
            self.mlp = build_moe_mlp(cfg, layer_number=layer_number, tp_group=tp_group, init=init,
                                     ep_group=comm.as_group(ep_group, axis="ep"), dispatcher=moe_dispatcher,
                                     cp_group=None if cp is None else cp.group, expert_tp=expert_tp,
                                     sequence_parallel=sequence_parallel, dtype=dtype, device=device)
        else:
            self.mlp = MLP(cfg, layer_number=layer_number, tp_group=tp_group, init=init, linear_impl=linear_impl, **kw)
        self.recompute = False  # full recompute of this layer in backward; set by TransformerStage

    def forward(self, x: torch.Tensor, *, rope, masks: AttentionMasks, kv_cache: KVCache | None = None) -> torch.Tensor:
        if self.recompute and kv_cache is None and torch.is_grad_enabled():
            # Only x (and the shared rope tables / masks) stay referenced; backward reruns the layer.
            return checkpoint(self._forward, x, tracker=self.rng, rope=rope, masks=masks)
        return self._forward(x, rope=rope, masks=masks, kv_cache=kv_cache)

    def _forward(self, x: torch.Tensor, *, rope, masks, kv_cache: KVCache | None = None) -> torch.Tensor:
        drop = dict(training=self.training, partitioned=self.sequence_parallel, rng=self.rng)
        h = self.attention(self.input_norm(x), rope=rope, masks=masks, kv_cache=kv_cache)
        normed, x = self.post_attention_norm(_hidden_dropout(h, self.hidden_dropout, **drop), residual=x)
        h = self.mlp(normed)
        return x + _hidden_dropout(h, self.hidden_dropout, **drop)


class Embedding(nn.Module):
    """Vocab-parallel word embedding [+ learned positions, replicated]; (b, s) ids -> (s, b, h) or
    (s/tp, b, h) with SP."""

    def __init__(self, cfg: TransformerConfig, *, padded_vocab: int, tp_group: Group, sequence_parallel: bool,
                 dtype, device, init, rng: RNGTracker):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.dropout_p = cfg.embedding_dropout
        self.rng = rng
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab, cfg.hidden_size, tp_group=tp_group, sequence_parallel=sequence_parallel, dtype=dtype,
            device=device, init_method=init("embedding.word_embeddings.weight", valid_rows=cfg.vocab_size))
        if cfg.position_embedding == "learned":
            self.max_positions = cfg.max_position_embeddings
            full = torch.empty(cfg.max_position_embeddings, cfg.hidden_size, dtype=torch.float32, device=device)
            init("embedding.position_embeddings.weight")(full)
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                                    _weight=full.to(dtype or torch.get_default_dtype()))
            # Under SP each rank looks up only its chunk's positions: a partial gradient.
            mark_replicated(self.position_embeddings.weight, sequence_parallel=sequence_parallel)
        else:
            self.position_embeddings = None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids.t())  # (s, b, h) or (s/tp, b, h)
        if self.position_embeddings is not None:
            check_ids(position_ids, self.max_positions, what="position id (n_positions of the config)")
            pos = position_ids.t()  # (s, b) or (s, 1)
            if self.sequence_parallel and self.tp_group.size > 1:
                chunk = pos.shape[0] // self.tp_group.size
                pos = pos[self.tp_group.rank * chunk:(self.tp_group.rank + 1) * chunk]
            x = x + self.position_embeddings(pos)  # (s, b, h) or (s/tp, b, h)
        return _hidden_dropout(x, self.dropout_p, training=self.training, partitioned=self.sequence_parallel,
                               rng=self.rng)


class TransformerStage(nn.Module):
    """Layers ``[start, end)`` of a causal LM, with the embedding if ``pre_process`` and the final
    norm + vocab-parallel output layer (and loss) if ``post_process``. Build with :func:`build_model`.

    Attributes: ``config``, ``tp_group``, ``sequence_parallel``, ``layer_range``, ``pre_process``,
    ``post_process``, ``padded_vocab_size``, ``rng`` (the TP-aware RNG tracker; its states belong in
    checkpoints), ``layers`` (a ModuleDict keyed by the GLOBAL layer index), ``kernels`` and
    ``fused_cross_entropy``, ``recompute`` and ``recompute_num_layers`` (see :func:`build_model`).
    """

    def __init__(self, cfg: TransformerConfig, *, tp_group: Group, sequence_parallel: bool, pre_process: bool,
                 post_process: bool, layer_range: tuple[int, int], dtype, device, make_vocab_size_divisible_by: int,
                 seed: int, linear_impl: LinearImpl | None, kernels: str = "auto",
                 fused_cross_entropy: bool | None = None, recompute: str = "none",
                 recompute_num_layers: int | None = None, cp: ContextParallel | None = None,
                 ep_group: Group | None = None, moe_dispatcher: str = "alltoall", expert_tp: int | None = None):
        super().__init__()
        cfg.check_tensor_parallel(tp_group.size)
        ops.check_backend(kernels)
        check_recompute(recompute, recompute_num_layers)
        if fused_cross_entropy not in (None, True, False):
            raise ValueError(f"fused_cross_entropy={fused_cross_entropy!r} must be True, False or None "
                             "(None: fused on CUDA, unfused elsewhere)")
        self.config = cfg
        self.kernels = kernels
        self.fused_cross_entropy = fused_cross_entropy
        self.tp_group = tp_group
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.sequence_parallel = sequence_parallel and tp_group.size > 1
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_range = layer_range
        self.padded_vocab_size = cfg.padded_vocab_size(tp=tp_group.size,
                                                       make_vocab_size_divisible_by=make_vocab_size_divisible_by)
        self.linear_impl = linear_impl or DefaultLinearImpl()
        # the model-parallel dropout stream: per TP rank, per cp rank (other tokens of the same sequences), and
        # per pipeline chunk (``pp_seed`` of its first layer: 0 for a whole model; each chunk holds its own
        # tracker, and with one seed every stage and virtual chunk repeated the first one's masks)
        self.rng = make_tracker(pp_seed(cp_seed(seed, 0 if self.cp is None else self.cp.group.rank), layer_range[0]),
                                tp_rank=tp_group.rank, device=device or "cpu")
        init = Initializer(cfg, seed=seed)
        kw = dict(tp_group=tp_group, sequence_parallel=self.sequence_parallel, dtype=dtype, device=device)
        self.embedding = (Embedding(cfg, padded_vocab=self.padded_vocab_size, init=init, rng=self.rng, **kw)
                          if pre_process else None)
        self.layers = nn.ModuleDict({
            str(i): TransformerLayer(cfg, layer_number=i, init=init, linear_impl=self.linear_impl, rng=self.rng,
                                     kernels=kernels, cp=self.cp, ep_group=ep_group, moe_dispatcher=moe_dispatcher,
                                     expert_tp=expert_tp, **kw)
            for i in range(*layer_range)})
        self.recompute, self.recompute_num_layers = recompute, recompute_num_layers
        for k, layer in enumerate(self.layers.values()):  # k: the layer's index within this stage
            layer.recompute = recompute == "full" and (recompute_num_layers is None or k < recompute_num_layers)
            layer.attention.recompute_core_attention = recompute == "selective"
        self.layer_graphs = None  # models.cuda_graphs.LayerGraphs once enable_cuda_graphs() (model.cuda_graph)
        self.final_norm = self.output_layer = None
        if post_process:
            self.final_norm = Norm(cfg.norm, cfg.hidden_size, eps=cfg.norm_eps, kernels=kernels,
                                   sequence_parallel=self.sequence_parallel, dtype=dtype, device=device)
            if not (cfg.tie_word_embeddings and pre_process):
                # Tied on a last stage without the embedding: a separate copy, initialised like the
                # first stage's embedding (same name -> same draw); the runtime all-reduces its grad.
                name = "embedding.word_embeddings.weight" if cfg.tie_word_embeddings else "output_layer.weight"
                self.output_layer = ColumnParallelLinear(
                    cfg.hidden_size, self.padded_vocab_size, bias=False, gather_output=False,
                    init_method=init(name, valid_rows=cfg.vocab_size), impl=self.linear_impl, **kw)
                # The stage reads this weight directly (_output_weight), never calling the layer: data
                # parallelism must complete its parameter all-gather before the stage's forward.
                self.output_layer.weight.used_outside_forward = True
                if cfg.tie_word_embeddings:
                    self.output_layer.weight.shared_embedding = True
                    self.output_layer.weight.shared = True  # a replica: the norm counts the first stage's
        if cfg.tie_word_embeddings and pre_process and not post_process:
            # Split across stages: this copy's gradient is summed with the last stage's replica.
            self.embedding.word_embeddings.weight.shared_embedding = True
        if cfg.position_embedding == "rope":
            self.register_buffer("inv_freq", inv_freq(cfg.rope, head_dim=cfg.head_dim, device=device),
                                 persistent=False)
        else:
            self.inv_freq = None
        for p in self.parameters():
            if not hasattr(p, "tensor_parallel"):
                mark_replicated(p)

    # -- forward -------------------------------------------------------------------------------------
    def forward(self, input: torch.Tensor, *, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                logits_index: torch.Tensor | None = None, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input``: token ids (b, s) if ``pre_process``, else the previous stage's hidden state
        (s, b, h), or (s/tp, b, h) with SP. ``position_ids`` (b, s) or (1, s), default 0..s-1 (or
        restarting per document with ``cu_seqlens``); positions that restart mark packed documents.
        ``cu_seqlens``: cumulative document lengths over the flattened (b*s) tokens.

        Returns, with ``post_process``: the per-token loss (b, s) float32 if ``labels`` (b, s) are
        given (targets already aligned with the inputs; -100 ignored; multiplied by ``loss_mask``),
        else this rank's logits (b, s, padded_vocab/tp) (see :func:`gather_logits`). Without
        ``post_process``: the hidden state for the next stage, shaped like the input hidden state.

        Inference: ``kv_cache`` (:meth:`new_kv_cache`) with ``position_ids`` (b, s) (each token's
        position = its cache index; rows may differ) writes these tokens' keys and values and attends
        over the cached prefix; needs ``without_sequence_parallel()`` when the stage was built with SP.
        ``logits_index`` (b,) (with ``post_process``): return only the logits of token
        ``logits_index[i]`` of row i, (b, 1, padded_vocab/tp).

        Context parallelism: every per-token argument is this cp rank's zigzag shard (``s`` is then s/cp):
        ``position_ids`` the global positions of its tokens (default: those of the zigzag split);
        packed documents come from ``document_ids`` (b, s/cp) (shards of the full sequence's document
        index; one all-gather over cp per forward) or ``cu_seqlens`` (of the FULL sequences), never from
        restarting positions (a shard's positions jump between its two chunks).
        """
        x, b, s = self._stage_input(input)
        if self.cp is not None:
            return self._cp_forward(input, x, b, s, labels=labels, position_ids=position_ids, loss_mask=loss_mask,
                                    cu_seqlens=cu_seqlens, kv_cache=kv_cache, logits_index=logits_index,
                                    document_ids=document_ids)
        if document_ids is not None:
            raise ValueError("document_ids are for context-parallel stages; without cp pass position_ids that "
                             "restart per document, or cu_seqlens")
        if kv_cache is not None:
            return self._cached_forward(input, x, b, s, kv_cache=kv_cache, position_ids=position_ids,
                                        logits_index=logits_index)
        if logits_index is not None:
            raise ValueError("logits_index is for cached inference: pass kv_cache= too (or slice the logits)")
        tp = self.tp_group.size
        if self.sequence_parallel and s % tp:
            raise ValueError(f"sequence length {s} is not divisible by the tensor-parallel size {tp}, which "
                             "sequence parallelism requires; pad or pack sequences to a multiple of it")
        device = input.device
        doc_ids = None
        if cu_seqlens is not None:
            doc_ids = document_ids_from_cu_seqlens(cu_seqlens.to(device), batch=b, seq_len=s)
        if position_ids is None:
            position_ids = (positions_from_documents(doc_ids) if doc_ids is not None
                            else torch.arange(s, device=device).unsqueeze(0))
        else:
            if position_ids.dim() != 2 or position_ids.shape[1] != s or position_ids.shape[0] not in (1, b):
                raise ValueError(f"position_ids must be (b, s) = ({b}, {s}) or (1, {s}); got "
                                 f"{tuple(position_ids.shape)}")
            if doc_ids is None:
                doc_ids = document_ids_from_positions(position_ids)
        masks = AttentionMasks(seq_len=s, doc_ids=doc_ids, device=device)
        return self._run_layers(input, x, b, s, masks=masks, position_ids=position_ids, labels=labels,
                                loss_mask=loss_mask)

    def enable_cuda_graphs(self) -> None:
        """``model.cuda_graph = "layers"``: training forwards and backwards of the layers replayed as CUDA
        graphs (models/cuda_graphs.py; ValueError naming what keeps this stage from it)."""
        from models.cuda_graphs import LayerGraphs

        self.layer_graphs = LayerGraphs(self)

    def _cp_forward(self, input, x, b: int, s: int, *, labels, position_ids, loss_mask, cu_seqlens, kv_cache,
                    logits_index, document_ids):
        """The forward of a context-parallel stage on this cp rank's shard of ``s`` tokens (see :meth:`forward`)."""
        cp = self.cp.size
        if kv_cache is not None or logits_index is not None:
            raise ValueError("cached inference under context parallelism is not built; generate with parallel.cp=1")
        tp_sp = self.tp_group.size if self.sequence_parallel else 1
        check_cp_sequence(s * cp, cp=cp, tp=tp_sp, where="sequence length (the cp shards together)")
        device = input.device
        s_full = s * cp
        doc_ids = None  # (b or 1, s_full) in natural order
        if cu_seqlens is not None:
            doc_ids = document_ids_from_cu_seqlens(cu_seqlens.to(device), batch=b, seq_len=s_full)
            if position_ids is None:
                position_ids = zigzag_shard(positions_from_documents(doc_ids), cp=cp, rank=self.cp.rank, dim=1)
        elif document_ids is not None:
            if document_ids.dim() != 2 or document_ids.shape[1] != s or document_ids.shape[0] not in (1, b):
                raise ValueError(f"document_ids must be this cp rank's shard (b, s/cp) = ({b}, {s}) or (1, {s}); "
                                 f"got {tuple(document_ids.shape)}")
            doc_ids = gather_sequence(document_ids.to(device), self.cp.group)  # (b, s_full)
        if position_ids is None:
            position_ids = zigzag_indices(s_full, cp=cp, rank=self.cp.rank, device=device).unsqueeze(0)  # (1, s)
        elif position_ids.dim() != 2 or position_ids.shape[1] != s or position_ids.shape[0] not in (1, b):
            raise ValueError(f"position_ids must be this cp rank's shard (b, s/cp) = ({b}, {s}) or (1, {s}); got "
                             f"{tuple(position_ids.shape)}")
        masks = ContextParallelMasks(seq_len=s_full, num_chunks=2 * cp, doc_ids=doc_ids, device=device)
        return self._run_layers(input, x, b, s, masks=masks, position_ids=position_ids, labels=labels,
                                loss_mask=loss_mask)

    def _run_layers(self, input, x, b: int, s: int, *, masks, position_ids, labels, loss_mask):
        """Embedding (first stage), the layers, and on the last stage the loss or logits."""
        if self.pre_process:
            x = self.embedding(input, position_ids.expand(b, s))
        rope = self._rope(position_ids)
        if self.layer_graphs is not None and self.layer_graphs.active():
            x = self.layer_graphs.run(x, rope=rope, masks=masks)  # replayed CUDA graphs (model.cuda_graph)
        else:
            for layer in self.layers.values():
                x = layer(x, rope=rope, masks=masks)
        if not self.post_process:
            return x
        x = self.final_norm(x)
        if labels is None:
            return self._logits(x).transpose(0, 1)  # (s, b, V_local) -> (b, s, V_local)
        if labels.shape != (b, s):
            raise ValueError(f"labels must be (b, s) = ({b}, {s}); got {tuple(labels.shape)}")
        fuse = self.fused_cross_entropy if self.fused_cross_entropy is not None else x.is_cuda
        if fuse:
            loss = self._fused_loss(x, labels.t())  # (s, b)
        else:
            loss = vocab_parallel_cross_entropy(self._logits(x), labels.t(), tp_group=self.tp_group,
                                                vocab_size=self.config.vocab_size,
                                                hide_max=getattr(self.linear_impl, "overlap_comm", False))  # (s, b)
        loss = loss.t().contiguous()  # (b, s)
        if loss_mask is not None:
            if loss_mask.shape != (b, s):
                raise ValueError(f"loss_mask must be (b, s) = ({b}, {s}); got {tuple(loss_mask.shape)}")
            loss = loss * loss_mask.to(loss.dtype)
        return loss

    def _rope(self, position_ids: torch.Tensor) -> ops.RopeTables | None:
        if self.inv_freq is None:
            return None
        freq = self.inv_freq
        if freq.dtype != torch.float32:  # model.to(bf16) cast the buffer: recompute at full precision
            freq = inv_freq(self.config.rope, head_dim=self.config.head_dim, device=freq.device)
        return ops.RopeTables(position_ids, freq)

    def _cached_forward(self, input, x, b: int, s: int, *, kv_cache: KVCache, position_ids, logits_index):
        if self.sequence_parallel:
            raise ValueError("a forward with a KV cache cannot shard one-token steps over the sequence; run it "
                             "inside `with stage.without_sequence_parallel():` (same weights, same result)")
        if position_ids is None or position_ids.shape != (b, s):
            raise ValueError(f"a forward with a KV cache needs position_ids (b, s) = ({b}, {s}), each token's "
                             f"position (its cache index); got "
                             f"{None if position_ids is None else tuple(position_ids.shape)}")
        masks = kv_cache.begin(position_ids)
        if self.pre_process:
            x = self.embedding(input, position_ids)  # (s, b, h)
        rope = self._rope(position_ids)
        for layer in self.layers.values():
            x = layer(x, rope=rope, masks=masks, kv_cache=kv_cache)
        if not self.post_process:
            return x
        if logits_index is not None:
            if logits_index.shape != (b,):
                raise ValueError(f"logits_index must be (b,) = ({b},); got {tuple(logits_index.shape)}")
            x = x[logits_index, torch.arange(b, device=x.device)].unsqueeze(0)  # (1, b, h)
        return self._logits(self.final_norm(x)).transpose(0, 1)  # (s|1, b, V_local) -> (b, s|1, V_local)

    def new_kv_cache(self, *, batch: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        """An empty KV cache for this stage's layers on this TP rank: k and v
        (batch, max_len, num_kv_heads/tp, head_dim) per layer, in ``dtype`` (default: the weights')."""
        p = next(self.parameters())
        return KVCache(layers=[int(i) for i in self.layers], batch=batch, max_len=max_len,
                       groups_local=self.config.num_kv_heads // self.tp_group.size, head_dim=self.config.head_dim,
                       dtype=dtype or p.dtype, device=p.device)

    @contextlib.contextmanager
    def without_sequence_parallel(self):
        """Run this stage without sequence parallelism for the duration: every submodule with a
        ``sequence_parallel`` flag (linears, embedding, layers) gets False, and its own value back
        afterwards. Same weights, same mathematics: inputs are then (s, b, h) on every TP rank, which
        one-token decode steps need. Not for training steps (the parameters' gradient marks assume SP)."""
        saved = [(m, m.sequence_parallel) for m in self.modules()
                 if isinstance(getattr(m, "sequence_parallel", None), bool)]
        try:
            for m, _ in saved:
                m.sequence_parallel = False
            yield self
        finally:
            for m, flag in saved:
                m.sequence_parallel = flag

    def _stage_input(self, input: torch.Tensor):
        tp = self.tp_group.size
        if self.pre_process:
            if input.dim() != 2 or input.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"the first stage takes token ids (b, s) int64; got {tuple(input.shape)} "
                                 f"{input.dtype}")
            check_ids(input, self.config.vocab_size, what="token id")
            b, s = input.shape
            return None, b, s
        h = self.config.hidden_size
        if input.dim() != 3 or input.shape[2] != h or not input.is_floating_point():
            raise ValueError(f"a stage without pre_process takes the hidden state (s, b, {h}) "
                             f"({'(s/tp, b, h) with sequence parallelism' if self.sequence_parallel else ''}); "
                             f"got {tuple(input.shape)} {input.dtype}")
        s_local, b = input.shape[:2]
        return input, b, s_local * (tp if self.sequence_parallel else 1)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_impl.column_forward(x, self._output_weight(), None, group=self.tp_group,
                                               sequence_parallel=self.sequence_parallel, gather_output=False)

    def _output_weight(self) -> torch.Tensor:
        return (self.output_layer.weight if self.output_layer is not None
                else self.embedding.word_embeddings.weight)

    def _fused_loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Output layer + vocab-parallel cross-entropy in chunks (engine/ops/fused_linear_ce.py),
        never materialising the (s, b, V_local) logits. ``x`` (s, b, h) or (s/tp, b, h) with SP;
        ``target`` (s, b). Same loss as the unfused path; the output layer's ``linear_impl`` is
        bypassed (the fused op owns that matmul)."""
        group = self.tp_group
        # The input mapping of a column-parallel linear: identity forward, and in backward the sum of
        # every rank's partial input gradient (all-reduce, or reduce-scatter back to the SP shard).
        x = gather_from_sp(x, group) if self.sequence_parallel else copy_to_tp(x, group)  # (s, b, h)
        weight = self._output_weight()  # (V_local, h)
        v_local = weight.shape[0]
        start = group.rank * v_local
        valid = min(max(self.config.vocab_size - start, 0), v_local)  # padded rows take no part
        return fused_linear_cross_entropy(
            x, weight[:valid], target, vocab_start=start,
            tp_reduce=TPReduce(group) if group.size > 1 else None,
            backend=self.kernels)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(b, s, V_local) -> (b, s, vocab_size): all TP shards, padding sliced off (collective)."""
        return gather_logits(logits, self.tp_group, vocab_size=self.config.vocab_size)


def gather_logits(logits: torch.Tensor, tp_group: Group, *, vocab_size: int) -> torch.Tensor:
    """All-gather vocab-sharded logits (..., V_local) over ``tp_group``; keep the true ``vocab_size``."""
    full = comm.all_gather(logits.detach().contiguous(), tp_group, dim=-1)
    return full[..., :vocab_size]


def check_recompute(recompute: str, recompute_num_layers: int | None) -> None:
    """ValueError unless ``recompute`` is one of :data:`RECOMPUTE` and ``recompute_num_layers`` is None
    or an int >= 1 given with "full" only."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not valid; choose one of {list(RECOMPUTE)}")
    if recompute_num_layers is None:
        return
    if recompute != "full":
        raise ValueError(f"recompute_num_layers={recompute_num_layers} applies to full recompute only "
                         f"(recompute={recompute!r}); set recompute='full' or leave recompute_num_layers unset")
    if isinstance(recompute_num_layers, bool) or not isinstance(recompute_num_layers, int) or recompute_num_layers < 1:
        raise ValueError(f"recompute_num_layers={recompute_num_layers!r} must be an int >= 1 (the first N layers "
                         "of each stage are recomputed), or None for all")


def build_model(hf_config: Mapping[str, Any] | TransformerConfig, *, tp_group: Group, sequence_parallel: bool = False,
                pre_process: bool = True, post_process: bool = True, layer_range: tuple[int, int] | None = None,
                dtype: torch.dtype | None = None, device=None, make_vocab_size_divisible_by: int = 128,
                seed: int = 1234, linear_impl: LinearImpl | None = None, kernels: str = "auto",
                fused_cross_entropy: bool | None = None, recompute: str = "none",
                recompute_num_layers: int | None = None, cp_group: Group | None = None, cp_comm: str = "ring",
                cp_subgroups: tuple[Group, Group] | None = None, ep_group: Group | None = None,
                moe_dispatcher: str = "alltoall", expert_tp: int | None = None) -> TransformerStage:
    """One pipeline stage of the model described by ``hf_config`` (a config.json dict).

    ``layer_range`` = (start, end) of GLOBAL layer indices (default all). Weights are initialised
    from ``seed`` per parameter name (see models/init.py): identical for any TP/PP layout.
    ``linear_impl`` replaces the matmul+collective strategy of every TP linear (FP8, overlap).
    ``kernels``: "auto" (engine/ops' fused Triton kernels for RMSNorm, SwiGLU and RoPE on CUDA, the
    PyTorch references elsewhere), "triton" or "reference" (forced). ``fused_cross_entropy``: compute
    the loss with the chunked fused linear + cross-entropy (no logits tensor); None = on CUDA only.
    ``recompute`` (activation recompute in backward, docs/memory.md): "none"; "selective" (core
    attention of every layer); "full" (whole layers, keeping each one's input), of only the first
    ``recompute_num_layers`` layers of this stage when set. Off under ``torch.no_grad`` and with a KV
    cache; results are bitwise those of "none" (dropout masks replayed).
    ``cp_group`` (context parallelism, size > 1): the stage takes each sequence's zigzag shard and its core
    attention spans the sequence over this group by ``cp_comm`` ("ring", "a2a", or "hybrid" with
    ``cp_subgroups`` = (all-to-all group, ring group), e.g. ``(mesh.cp_a2a, mesh.cp_ring)``).
    ``ep_group`` (mixture-of-experts families): the experts of each MoE layer are split over it and tokens
    travel by ``moe_dispatcher`` ("alltoall" or "allgather"; docs/moe.md). ``expert_tp``: None (= tp, experts
    sharded over ``tp_group``) or 1 (whole experts, each TP rank routing its own sequence chunk; needs
    ``sequence_parallel`` at tp > 1).
    """
    from models.registry import config_from_hf

    cfg = config_from_hf(hf_config)
    tp_group = comm.as_group(tp_group, axis="tp")
    if layer_range is None:
        layer_range = (0, cfg.num_layers)
    start, end = layer_range
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= cfg.num_layers):
        raise ValueError(f"layer_range={layer_range!r} must be (start, end) with 0 <= start <= end <= "
                         f"num_layers={cfg.num_layers}")
    cp = None
    cp_group = comm.as_group(cp_group, axis="cp")
    if cp_group.size > 1:
        if cp_comm not in CP_COMM:
            raise ValueError(f"cp_comm={cp_comm!r} is not one of {list(CP_COMM)}")
        a2a, ring = cp_subgroups if cp_comm == "hybrid" and cp_subgroups is not None else (None, None)
        cp = ContextParallel(group=cp_group, comm=cp_comm, a2a_group=a2a, ring_group=ring)
    return TransformerStage(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel, pre_process=pre_process,
                            post_process=post_process, layer_range=(start, end), dtype=dtype, device=device,
                            make_vocab_size_divisible_by=make_vocab_size_divisible_by, seed=seed,
                            linear_impl=linear_impl, kernels=kernels, fused_cross_entropy=fused_cross_entropy,
                            recompute=recompute, recompute_num_layers=recompute_num_layers, cp=cp,
                            ep_group=ep_group, moe_dispatcher=moe_dispatcher, expert_tp=expert_tp)
