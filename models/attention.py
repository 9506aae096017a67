"""Causal self-attention with the fused grouped QKV projection, over SDPA.

Layout of the fused QKV projection (one :class:`ColumnParallelLinear`): for each kv group g,
``[q heads of g (q_per_group * head_dim rows), k_g (head_dim rows), v_g (head_dim rows)]``. TP rank r
holds whole groups ``[r*G/tp, (r+1)*G/tp)`` -- a contiguous block of rows -- so it computes its query
heads with their own k and v and never communicates inside attention. GPT-2 (MHA) is the case
q_per_group = 1.

Masks: causal; plus a sliding window (key j visible from query i iff ``i - window < j <= i``, as
Hugging Face); plus a per-document mask for packed sequences (tokens attend within their document
only), from ``cu_seqlens`` or from ``position_ids`` that restart.

Context parallelism: given a :class:`parallel.context_parallel.ContextParallel` at construction (``cp=``,
like ``tp_group``), the layer holds the zigzag shard of each sequence and its core attention runs over
the whole sequence through it (ring, all-to-all or hybrid); the masks are then the stage's
:class:`parallel.context_parallel.ContextParallelMasks`. Everything else in the layer is per token.

Inference: a :class:`KVCache` keeps each layer's k and v ``(b, max_len, groups_local, hd)`` on this TP
rank, indexed by position; a forward with a cache writes its tokens' k/v at their positions and attends
over the cached prefix (:class:`CacheMasks`). Training never passes a cache.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from models import ops
from models.config import TransformerConfig
from parallel.comm import Group
from parallel.context_parallel import ContextParallel, ContextParallelMasks
from parallel.random import RNGTracker, checkpoint
from parallel.tensor_parallel import ColumnParallelLinear, LinearImpl, RowParallelLinear, mark_replicated


def document_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """(b, s) document index per token where ``position_ids`` restart (any step other than +1);
    None when no row restarts (one document per row)."""
    step = torch.diff(position_ids, dim=-1)
    starts = torch.cat([torch.zeros_like(position_ids[:, :1], dtype=torch.bool), step != 1], dim=-1)
    if not bool(starts.any()):
        return None
    return starts.cumsum(-1)


def document_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, *, batch: int, seq_len: int) -> torch.Tensor:
    """(b, s) document index per token from cumulative document lengths over the flattened (b*s) tokens."""
    total = batch * seq_len
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("cu_seqlens must be a 1-D integer tensor [0, len_0, len_0+len_1, ..., b*s]")
    cu = cu_seqlens.to(torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at b*s={total}; "
                         f"got {cu.tolist()}")
    idx = torch.arange(total, device=cu.device)
    return (torch.searchsorted(cu[1:], idx, right=True)).reshape(batch, seq_len)


def positions_from_documents(doc_ids: torch.Tensor) -> torch.Tensor:
    """(b, s) position of each token inside its document (restarting at 0)."""
    b, s = doc_ids.shape
    idx = torch.arange(s, device=doc_ids.device).expand(b, s)
    new_doc = torch.ones_like(doc_ids, dtype=torch.bool)
    new_doc[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(new_doc, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - start


class AttentionMasks:
    """The masks of one forward pass: built lazily, once per distinct sliding window.

    :meth:`get` returns None when plain causal attention applies (SDPA's ``is_causal`` path), else
    a bool ``(b or 1, 1, s, s)`` mask, True where a query may attend to a key.
    """

    def __init__(self, *, seq_len: int, doc_ids: torch.Tensor | None, device):
        self.seq_len = seq_len
        self.doc_ids = doc_ids
        self.device = device
        self._cache: dict[int | None, torch.Tensor | None] = {}

    def get(self, window: int | None) -> torch.Tensor | None:
        if window is not None and window >= self.seq_len:
            window = None  # the window covers the whole sequence
        if window not in self._cache:
            self._cache[window] = self._build(window)
        return self._cache[window]

    def _build(self, window: int | None) -> torch.Tensor | None:
        if window is None and self.doc_ids is None:
            return None
        i = torch.arange(self.seq_len, device=self.device)
        mask = i.unsqueeze(0) <= i.unsqueeze(1)  # (s_q, s_k) causal
        if window is not None:
            mask &= i.unsqueeze(0) > i.unsqueeze(1) - window
        mask = mask.unsqueeze(0)  # (1, s, s)
        if self.doc_ids is not None:
            mask = mask & (self.doc_ids.unsqueeze(2) == self.doc_ids.unsqueeze(1))  # (b, s, s)
        return mask.unsqueeze(1)  # (b or 1, 1, s, s)


class CacheMasks:
    """The masks of one cached forward: query at position p (its cache index) sees the keys at
    positions ``p - window < j <= p``. :meth:`get` gives a bool ``(b, 1, s, L)`` mask over the first
    ``L`` cache entries (``L`` = the largest position + 1); never None (SDPA's causal path assumes
    s == L). Every query sees at least itself, so no row is fully masked (no NaN from padding)."""

    def __init__(self, position_ids: torch.Tensor, *, length: int):
        self.position_ids = position_ids
        self.length = length
        self._cache: dict[int | None, torch.Tensor] = {}

    def get(self, window: int | None) -> torch.Tensor:
        if window is not None and window >= self.length:
            window = None  # the window covers every cached key
        if window not in self._cache:
            j = torch.arange(self.length, device=self.position_ids.device)  # (L,)
            p = self.position_ids.unsqueeze(-1)  # (b, s, 1)
            mask = j <= p  # (b, s, L)
            if window is not None:
                mask &= j > p - window
            self._cache[window] = mask.unsqueeze(1)  # (b, 1, s, L)
        return self._cache[window]


class KVCache:
    """Keys and values of the layers of one stage on one TP rank, for incremental decoding.

    ``k[layer]``, ``v[layer]``: ``(b, max_len, groups_local, hd)``, the entry at index ``j`` of row ``i``
    belonging to the token at position ``j`` of sequence ``i`` (rotary already applied). A forward
    calls :meth:`begin` with its tokens' ``position_ids`` (b, s) (these are the write indices, so rows
    of different lengths each write at their own positions), then each layer calls :meth:`append`.
    Entries past a row's current position may hold stale values (right padding, earlier steps); the
    masks never show them, and the next token at that position overwrites them.
    """

    def __init__(self, *, layers, batch: int, max_len: int, groups_local: int, head_dim: int, dtype, device):
        if batch < 1 or max_len < 1:
            raise ValueError(f"KVCache(batch={batch}, max_len={max_len}): both must be >= 1")
        self.batch, self.max_len = batch, max_len
        shape = (batch, max_len, groups_local, head_dim)
        self.k = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.v = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self._rows = torch.arange(batch, device=device).unsqueeze(1)  # (b, 1)
        self._positions: torch.Tensor | None = None
        self._length = 0

    def begin(self, position_ids: torch.Tensor) -> CacheMasks:
        """Start a forward whose tokens sit at ``position_ids`` (b, s); returns its masks."""
        if position_ids.dim() != 2 or position_ids.shape[0] != self.batch:
            raise ValueError(f"a cached forward needs position_ids (b, s) with b = {self.batch} (the cache's "
                             f"batch); got {tuple(position_ids.shape)}")
        lo, hi = int(position_ids.min()), int(position_ids.max())
        if lo < 0 or hi >= self.max_len:
            raise ValueError(f"positions [{lo}, {hi}] do not fit the KV cache of max_len={self.max_len}; "
                             "build the cache for the prompt length plus the new tokens")
        self._positions = position_ids
        self._length = hi + 1
        return CacheMasks(position_ids, length=self._length)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (s, b, g, hd) of this forward's tokens; return the layer's cached
        ``(L, b, g, hd)`` k and v (views), L = the largest position of this forward + 1."""
        assert self._positions is not None, "KVCache.begin(position_ids) must start each cached forward"
        ck, cv = self.k[layer], self.v[layer]
        ck[self._rows, self._positions] = k.transpose(0, 1).to(ck.dtype)  # (b, s, g, hd) at their positions
        cv[self._rows, self._positions] = v.transpose(0, 1).to(cv.dtype)
        return ck[:, :self._length].transpose(0, 1), cv[:, :self._length].transpose(0, 1)  # (L, b, g, hd)


def cp_attention_dropout_error(p: float) -> ValueError:
    """Attention dropout under context parallelism (refused for training: the run's plan, and the layer's
    forward)."""
    return ValueError(f"attention dropout {p} under context parallelism is not built (the blocks of a row live on "
                      "different ranks); set the model's attention dropout to 0 (attention_dropout, or GPT-2's "
                      "attn_pdrop, in its config.json) or parallel.cp=1")


def core_attention(q, k, v, *, mask: torch.Tensor | None, scale: float, dropout_p: float,
                   rng: RNGTracker | None) -> torch.Tensor:
    """Softmax attention. q (s, b, nh, hd); k, v (s, b, ng, hd) with nh a multiple of ng (query
    head h uses kv head h // (nh/ng)). Returns (s, b, nh*hd). Dropout on the probabilities draws from
    the model-parallel stream (heads differ across TP ranks)."""
    s, b, nh, hd = q.shape
    qt = q.permute(1, 2, 0, 3)  # (b, nh, s, hd)
    kt = k.permute(1, 2, 0, 3)  # (b, ng, s, hd)
    vt = v.permute(1, 2, 0, 3)  # (b, ng, s, hd)
    ctx = rng.fork() if dropout_p > 0 and rng is not None else contextlib.nullcontext()
    with ctx:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, dropout_p=dropout_p,
                                             is_causal=mask is None, scale=scale,
                                             enable_gqa=kt.shape[1] != nh)  # (b, nh, s, hd)
    return out.permute(2, 0, 1, 3).reshape(s, b, nh * hd)  # (s, b, nh*hd)


class HeadNorm(nn.Module):
    """RMSNorm over each head's dim (Qwen3 q/k norm). Replicated across TP; each rank's gradient
    covers only its own heads, so the weight is marked ``sequence_parallel`` (TP partial sum)."""

    def __init__(self, head_dim: int, *, eps: float, dtype, device, kernels: str = "auto"):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(head_dim, dtype=dtype, device=device))
        mark_replicated(self.weight, sequence_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, backend=self.kernels)


class SelfAttention(nn.Module):
    """Fused grouped QKV (column-parallel) -> [q/k norm] -> [RoPE] -> SDPA -> output (row-parallel).

    Input ``(s, b, h)`` or ``(s/tp, b, h)`` with SP; output the same shape.
    """

    def __init__(self, cfg: TransformerConfig, *, layer_number: int, tp_group: Group, sequence_parallel: bool,
                 dtype, device, init, linear_impl: LinearImpl | None, rng: RNGTracker | None,
                 kernels: str = "auto", cp: ContextParallel | None = None):
        super().__init__()
        tp = tp_group.size
        self.kernels = kernels
        cfg.check_tensor_parallel(tp)
        self.head_dim = cfg.head_dim
        self.q_per_group = cfg.num_heads // cfg.num_kv_heads
        self.groups_local = cfg.num_kv_heads // tp
        self.heads_local = self.groups_local * self.q_per_group
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else cfg.head_dim ** -0.5
        self.layer_number = layer_number
        self.window = cfg.sliding_window(layer_number)
        self.dropout_p = cfg.attention_dropout
        self.rng = rng
        self.cp = cp if cp is not None and cp.size > 1 else None
        if self.cp is not None:  # attention dropout under cp: refused in training (forward; the run's plan earlier)
            self.cp.check_heads(heads_local=self.heads_local, kv_heads_local=self.groups_local)
        # Selective recompute (Korthikanti et al. 2022): core attention (scores, softmax, dropout,
        # context) runs again in backward; only q, k, v are kept. Set by TransformerStage.
        self.recompute_core_attention = False
        prefix = f"layers.{layer_number}.attention."
        qkv_out = cfg.num_kv_heads * (self.q_per_group + 2) * cfg.head_dim
        self.qkv = ColumnParallelLinear(cfg.hidden_size, qkv_out, tp_group=tp_group, bias=cfg.qkv_bias,
                                        sequence_parallel=sequence_parallel, dtype=dtype, device=device,
                                        init_method=init(prefix + "qkv.weight"), impl=linear_impl)
        if cfg.qk_norm:
            self.q_norm = HeadNorm(cfg.head_dim, eps=cfg.norm_eps, dtype=dtype, device=device, kernels=kernels)
            self.k_norm = HeadNorm(cfg.head_dim, eps=cfg.norm_eps, dtype=dtype, device=device, kernels=kernels)
        else:
            self.q_norm = self.k_norm = None
        self.out = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, tp_group=tp_group,
                                     bias=cfg.out_bias, sequence_parallel=sequence_parallel, dtype=dtype,
                                     device=device, init_method=init(prefix + "out.weight", output=True),
                                     impl=linear_impl)

    def forward(self, x: torch.Tensor, *, rope: ops.RopeTables | None, masks: AttentionMasks | CacheMasks,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """``kv_cache`` (inference): append this forward's k/v and attend over the cached prefix;
        ``masks`` are then the cache's (:meth:`KVCache.begin`)."""
        qkv = self.qkv(x)  # (s, b, groups_local * (q_per_group + 2) * hd)
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.groups_local, self.q_per_group + 2, self.head_dim)  # (s, b, g, qpg+2, hd)
        q = qkv[:, :, :, :self.q_per_group].reshape(s, b, self.heads_local, self.head_dim)  # (s, b, nh, hd)
        k = qkv[:, :, :, self.q_per_group]  # (s, b, g, hd)
        v = qkv[:, :, :, self.q_per_group + 1]  # (s, b, g, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = ops.apply_rope(q, k, rope, backend=self.kernels)
        if kv_cache is not None:
            k, v = kv_cache.append(self.layer_number, k, v)  # (L, b, g, hd) each: the prefix and these tokens
        if self.cp is not None:
            if kv_cache is not None or not isinstance(masks, ContextParallelMasks):
                raise ValueError("a context-parallel attention layer takes the stage's ContextParallelMasks and no "
                                 "KV cache (generation runs at parallel.cp=1)")
            if self.training and self.dropout_p > 0:  # evaluation (no dropout) runs
                raise cp_attention_dropout_error(self.dropout_p)
            kw = dict(masks=masks.get(self.window), scale=self.scale)
            if self.recompute_core_attention and torch.is_grad_enabled():  # the ring runs again in backward
                return self.out(checkpoint(self.cp.attention, q, k, v, tracker=self.rng, **kw))
            return self.out(self.cp.attention(q, k, v, **kw))  # (s_local, b, nh*hd) -> (s_local[/tp], b, h)
        kw = dict(mask=masks.get(self.window), scale=self.scale,
                  dropout_p=self.dropout_p if self.training else 0.0, rng=self.rng)
        if self.recompute_core_attention and kv_cache is None and torch.is_grad_enabled():
            ctx = checkpoint(core_attention, q, k, v, tracker=self.rng, **kw)  # (s, b, nh*hd)
        else:
            ctx = core_attention(q, k, v, **kw)  # (s, b, nh*hd)
        return self.out(ctx)
