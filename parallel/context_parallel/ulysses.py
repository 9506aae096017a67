"""All-to-all (Ulysses) context parallelism, and the hybrid of all-to-all inside groups and a ring across.

Ulysses (Jacobs et al. 2023, DeepSpeed-Ulysses): one all-to-all over the group trades the sequence shard
for a head shard -- each rank gets the WHOLE sequence of the group for ``1/p`` of the heads -- then the
rank attends with an ordinary kernel, and a second all-to-all returns the output to the sequence shard.
q, k and v travel in one all-to-all (heads packed per destination), so the bytes per layer and rank are
exactly ``(p-1)/p * (|q| + |k| + |v|)`` for the inputs and ``(p-1)/p * |out|`` for the output, forward and
backward alike (the all-to-all is its own adjoint). It needs the local heads (after TP), q and kv
alike, divisible by ``p``.

Hybrid: the all-to-all runs inside groups of ``a`` cp ranks (``mesh.cp_a2a``); each rank then holds
the ``2a`` chunks of its group for ``1/a`` of the heads, and ring attention runs across the groups
(``mesh.cp_ring``) over those chunks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel import comm
from parallel.comm import Group
from parallel.context_parallel.masks import BlockMasks
from parallel.context_parallel.sharding import zigzag_chunks


class _AllToAll(torch.autograd.Function):
    """All-to-all along dim 0 (equal splits) forward; the same all-to-all of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return comm.all_to_all(x, group)

    @staticmethod
    def backward(ctx, g):
        return comm.all_to_all(g.contiguous(), ctx.group), None


def check_a2a_heads(*, heads: int, kv_heads: int, size: int, what: str = "parallel.cp_comm='a2a'") -> None:
    """ValueError unless the local heads (after TP) split over ``size`` ranks; before any communication."""
    if size > 1 and (heads % size or kv_heads % size):
        raise ValueError(f"{what} scatters attention heads over {size} ranks, but this rank has {heads} query "
                         f"and {kv_heads} kv heads (after tensor parallelism); the all-to-all needs both "
                         f"divisible by {size}: use parallel.cp_comm='ring', a smaller parallel.cp_a2a_size "
                         "(hybrid), or a smaller parallel.tp")


def heads_to_sequence(q, k, v, group: Group):
    """q (s_local, b, nh, hd), k/v (s_local, b, g, hd) -> the group's sequence (p*s_local, in rank order)
    for this rank's ``1/p`` of the heads: q (p*s_local, b, nh/p, hd), k/v (p*s_local, b, g/p, hd)."""
    p = group.size
    s, b, nh, hd = q.shape
    g = k.shape[2]
    parts = [t.reshape(s, b, p, t.shape[2] // p, hd) for t in (q, k, v)]  # (s, b, p, heads/p, hd) each
    x = torch.cat(parts, dim=3).permute(2, 0, 1, 3, 4).contiguous()  # (p, s, b, (nh+2g)/p, hd): per destination
    y = _AllToAll.apply(x, group)  # (p, s, b, (nh+2g)/p, hd): y[j] = rank j's tokens, my heads
    y = y.reshape(p * s, b, (nh + 2 * g) // p, hd)  # (p*s, b, (nh+2g)/p, hd)
    return y.split([nh // p, g // p, g // p], dim=2)


def sequence_to_heads(out: torch.Tensor, group: Group, *, head_dim: int) -> torch.Tensor:
    """(p*s_local, b, nh/p * hd) -> this rank's tokens for all heads, (s_local, b, nh*hd)."""
    p = group.size
    ps, b, width = out.shape
    s, h_local = ps // p, width // head_dim
    y = _AllToAll.apply(out.reshape(p, s, b, h_local, head_dim).contiguous(), group)  # (p, s, b, nh/p, hd)
    return y.permute(1, 2, 0, 3, 4).reshape(s, b, p * h_local * head_dim)  # (s, b, nh*hd): heads of rank j at j


def _natural_order(cp: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices taking the rank-ordered (zigzag) gathered sequence of a full cp group to natural chunk order,
    and back; in units of chunks."""
    held = [c for r in range(cp) for c in zigzag_chunks(r, cp)]  # chunk at each gathered slot
    to_natural = torch.tensor([held.index(c) for c in range(2 * cp)], device=device)
    return to_natural, torch.tensor(held, device=device)


def _reorder_chunks(x: torch.Tensor, order: torch.Tensor, num_chunks: int) -> torch.Tensor:
    s = x.shape[0]
    x = x.reshape(num_chunks, s // num_chunks, *x.shape[1:])  # (chunks, L, ...)
    return x.index_select(0, order).reshape(s, *x.shape[2:])  # (s, ...)


def ulysses_attention(q, k, v, *, group: Group, masks: BlockMasks, scale: float) -> torch.Tensor:
    """All-to-all attention over the whole cp ``group``: q (s_local, b, nh, hd), k/v (s_local, b, g, hd)
    -> (s_local, b, nh*hd). The attention itself is SDPA over the full sequence in natural order."""
    p, hd = group.size, q.shape[3]
    check_a2a_heads(heads=q.shape[2], kv_heads=k.shape[2], size=p)
    qf, kf, vf = heads_to_sequence(q, k, v, group)  # (s, b, heads/p, hd), zigzag order
    to_natural, back = _natural_order(p, q.device)
    qf, kf, vf = (_reorder_chunks(t, to_natural, masks.num_chunks) for t in (qf, kf, vf))
    qt, kt, vt = (t.permute(1, 2, 0, 3) for t in (qf, kf, vf))  # (b, heads/p, s, hd)
    mask = masks.full_mask()
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=mask is None, scale=scale,
                                       enable_gqa=kt.shape[1] != qt.shape[1])  # (b, nh/p, s, hd)
    s_full, b = o.shape[2], o.shape[0]
    o = o.permute(2, 0, 1, 3).reshape(s_full, b, -1)  # (s, b, nh/p*hd)
    return sequence_to_heads(_reorder_chunks(o, back, masks.num_chunks), group, head_dim=hd)


def hybrid_chunks(a2a_size: int, cp: int):
    """``chunks_of(ring_rank)`` of the hybrid: the chunks of the a2a group ``ring_rank`` (cp ranks
    ``ring_rank*a .. ring_rank*a + a-1``), in the order the all-to-all concatenates them."""
    def chunks_of(ring_rank: int) -> list[int]:
        return [c for i in range(a2a_size) for c in zigzag_chunks(ring_rank * a2a_size + i, cp)]
    return chunks_of


def hybrid_attention(q, k, v, *, a2a_group: Group, ring_group: Group, masks: BlockMasks,
                     scale: float) -> torch.Tensor:
    """All-to-all inside ``a2a_group``, ring attention across ``ring_group`` (see the module docstring)."""
    from parallel.context_parallel.ring import ring_attention

    a, hd = a2a_group.size, q.shape[3]
    check_a2a_heads(heads=q.shape[2], kv_heads=k.shape[2], size=a,
                    what=f"parallel.cp_comm='hybrid' (parallel.cp_a2a_size={a})")
    qf, kf, vf = heads_to_sequence(q, k, v, a2a_group)  # (a*s_local, b, heads/a, hd)
    out = ring_attention(qf, kf, vf, group=ring_group, chunks_of=hybrid_chunks(a, a * ring_group.size),
                         masks=masks, scale=scale)  # (a*s_local, b, nh/a*hd)
    return sequence_to_heads(out, a2a_group, head_dim=hd)
