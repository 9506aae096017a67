"""Ring attention: K and V rotate around the cp ring while each rank attends its queries to the block in hand.

Forward, on each of the ``n`` ranks of ``group`` (Liu et al. 2023, "Ring Attention"; Brandon et al. 2023):
step t attends the local queries to the K/V block of ring rank ``me - t``, while the next block already
travels (one ``batch_p2p`` of the packed K and V: send to ``me + 1``, receive from ``me - 1``, waited on
after the compute). Partial outputs merge by the online-softmax rule: with ``lse`` the running
log-sum-exp of each query row, ``lse' = logaddexp(lse, lse_b)`` and
``out' = exp(lse - lse') out + exp(lse_b - lse') out_b``. Only blocks with something visible are
computed (:func:`parallel.context_parallel.masks.computed_blocks`); the ring still moves every block.

Backward rotates K and V again (nothing gathered is kept: memory stays 1/cp) and sends the dK/dV
accumulator of each block along with it, one rank behind: after ``n`` hops it is back at its owner.

Bytes per layer and rank (asserted from the ledger): forward ``(n-1) * (|K| + |V|)`` sent; backward
``(n-1) * (|K| + |V|) + n * (|dK| + |dV|)``, dK/dV in the compute dtype (float32 for bf16/fp16 inputs,
else the inputs' dtype). GQA sends only the kv heads.

Layouts: ``q (b, g, q_per_group, s_local, hd)``, ``k, v (b, g, s_local, hd)``; a rank's local sequence is
the chunks ``chunks_of(ring_rank)`` (each ``chunk_len`` tokens) concatenated in that order.

Block kernels. A block with no mask ("full") or with exactly the causal lower triangle (the diagonal block
of plain causal attention) runs as one fused flash-attention call that returns the block's output and
log-sum-exp without materialising the L x L scores: on the CPU ``aten::_scaled_dot_product_flash_attention_for_cpu``
(in the compute dtype), on CUDA ``aten::_scaled_dot_product_flash_attention`` (bf16/fp16 inputs, head dim a
multiple of 8 up to 256; the merge stays in fp32). Its backward takes the rows' FINAL output and
log-sum-exp (the standard ring trick: the block's probabilities are ``exp(s - lse_final)``), so the block
gradients are exact. Blocks with a document or sliding-window mask run the explicit kernel below (matmuls
and a masked softmax). ``fused=False`` forces the explicit kernel everywhere; :data:`BLOCK_PATHS` records
which ran per device. Under GQA a full block folds the query heads of a group into its rows (one kv head
serves them all); a causal block repeats the kv head over them (the triangle is per query head) and sums
dK/dV back.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from parallel import comm
from parallel.comm import Group, P2P
from parallel.context_parallel.masks import BlockMasks, computed_blocks


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float64, torch.float32) else torch.float32


# Which block kernel ran, per device type ("flash" or "explicit"): for benchmarks and tests.
BLOCK_PATHS: dict[str, str] = {}


def fused_dtype(q: torch.Tensor, fused: bool | None) -> torch.dtype | None:
    """The dtype the fused flash kernel runs in for these inputs, or None where it cannot run (then every
    block takes the explicit kernel). ``fused``: None = wherever possible, False = never, True = required."""
    hd = q.shape[-1]
    dt = None
    if fused is not False:
        if q.device.type == "cpu":
            dt = compute_dtype(q.dtype)
        elif (q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and hd % 8 == 0 and hd <= 256
              and torch.cuda.get_device_capability(q.device) >= (8, 0)):
            dt = q.dtype
    if fused and dt is None:
        raise ValueError(f"ring attention: fused=True, but no flash kernel runs {q.dtype} inputs with head dim {hd} "
                         f"on {q.device.type} (CUDA needs bf16/fp16, head dim a multiple of 8 up to 256, sm80+); "
                         "pass fused=None to fall back to the explicit kernel")
    BLOCK_PATHS[q.device.type] = "explicit" if dt is None else "flash"
    return dt


def _heads(t: torch.Tensor, qpg: int, *, fold: bool) -> torch.Tensor:
    """A q-shaped (b, g, qpg, L, hd) tensor as the flash kernel's (b, heads, rows, hd): folded,
    (b, g, qpg*L, hd); else (b, g*qpg, L, hd)."""
    b, g, _, L, hd = t.shape
    return t.reshape(b, g, qpg * L, hd) if fold else t.reshape(b, g * qpg, L, hd)


def _kv_heads(t: torch.Tensor, qpg: int, *, fold: bool) -> torch.Tensor:
    """k or v (b, g, L, hd) for the kernel: as is when folded, else repeated over the qpg query heads."""
    b, g, L, hd = t.shape
    return t if fold or qpg == 1 else t.unsqueeze(2).expand(b, g, qpg, L, hd).reshape(b, g * qpg, L, hd)


def _flash_block_forward(q, k, v, causal: bool, scale: float, dt: torch.dtype):
    """The fused kernel on one block: q (b, g, qpg, Lq, hd), k/v (b, g, Lk, hd). Returns the block's output
    (b, g, qpg, Lq, hd) and log-sum-exp (b, g, qpg, Lq), both in the compute dtype of ``q``."""
    qpg = q.shape[2]
    fold = not causal  # without a triangle the qpg heads of a group are just more rows of one head
    qh = _heads(q.to(dt), qpg, fold=fold)
    kh, vh = _kv_heads(k.to(dt), qpg, fold=fold), _kv_heads(v.to(dt), qpg, fold=fold)
    if q.is_cuda:
        res = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, causal, scale=scale)
    cdt = compute_dtype(q.dtype)
    return out.reshape(q.shape).to(cdt), lse.reshape(q.shape[:-1]).to(cdt)  # (b, g, qpg, Lq, hd), (b, g, qpg, Lq)


def _flash_block_backward(q, k, v, dout, out, lse, causal: bool, scale: float, dt: torch.dtype):
    """Gradients of one block from the rows' FINAL ``out`` (b, g, qpg, Lq, hd) and ``lse`` (b, g, qpg, Lq).
    Returns dq (b, g, qpg, Lq, hd), dk and dv (b, g, Lk, hd) in the compute dtype."""
    b, g, qpg, Lq, hd = q.shape
    Lk = k.shape[2]
    fold = not causal
    qh, doh, oh = (_heads(t.to(dt), qpg, fold=fold) for t in (q, dout, out))
    kh, vh = _kv_heads(k.to(dt), qpg, fold=fold), _kv_heads(v.to(dt), qpg, fold=fold)
    # The kernels index the log-sum-exp as a dense (b, heads, rows) array: a slice of the rows' buffer (rows
    # s_local apart) must be copied, whatever its view's strides say (CUDA's flash backward reads its pointer).
    lseh = (lse.float() if q.is_cuda else lse.to(dt)).reshape(qh.shape[:-1]).contiguous()
    if q.is_cuda:
        # Dense (not varlen) input: no cumulative-length tensors (None: undefined, as the forward returns them;
        # an empty tensor would select the varlen kernel), and no dropout, so the rng state is never read.
        seed, offset = (torch.zeros(shape, dtype=torch.uint64, device=q.device) for shape in ((2,), ()))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            doh, qh, kh, vh, oh, lseh, None, None, qh.shape[2], Lk, 0.0, causal, seed, offset, scale=scale)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            doh, qh, kh, vh, oh, lseh, 0.0, causal, scale=scale)
    cdt = compute_dtype(q.dtype)
    dq = dq.reshape(b, g, qpg, Lq, hd)
    if not fold and qpg > 1:
        dk, dv = (t.reshape(b, g, qpg, Lk, hd).sum(dim=2) for t in (dk, dv))  # the repeated kv heads' sum
    return dq.to(cdt), dk.reshape(b, g, Lk, hd).to(cdt), dv.reshape(b, g, Lk, hd).to(cdt)


def _block_forward(q, k, v, mask, scale):
    """One block: q (b, g, qpg, Lq, hd), k/v (b, g, Lk, hd), mask None or (b|1, Lq, Lk).
    Returns the block's normalised output (b, g, qpg, Lq, hd) and log-sum-exp (b, g, qpg, Lq)
    (-inf on rows that see nothing in this block)."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale  # (b, g, qpg, Lq, Lk)
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)  # (b, g, qpg, Lq, 1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)  # (b, g, qpg, Lq, 1)
    out = torch.matmul(p, v.unsqueeze(2)) / denom.clamp(min=torch.finfo(denom.dtype).tiny)
    return out, (m + torch.log(denom)).squeeze(-1)


def _merge(out, lse, out_b, lse_b) -> None:
    """In place: fold a block's (out_b, lse_b) into the running (out, lse) of the same query rows."""
    new = torch.logaddexp(lse, lse_b)  # (b, g, qpg, L)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    out.copy_(out * torch.exp(lse - safe).unsqueeze(-1) + out_b * torch.exp(lse_b - safe).unsqueeze(-1))
    lse.copy_(new)


def _block_backward(q, k, v, dout, lse, delta, mask, scale):
    """Gradients of one block given the FINAL log-sum-exp of the query rows and
    ``delta = rowsum(dout * out)`` (both (b, g, qpg, Lq)). Returns dq (b, g, qpg, Lq, hd), dk and dv
    (b, g, Lk, hd)."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale  # (b, g, qpg, Lq, Lk)
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    p = torch.exp(s - lse.unsqueeze(-1))  # the final attention probabilities of this block
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(dim=2)  # (b, g, Lk, hd)
    dp = torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2))  # (b, g, qpg, Lq, Lk)
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale  # (b, g, qpg, Lq, hd)
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(dim=2) * scale  # (b, g, Lk, hd)
    return dq, dk, dv


def _hop_plan(my_chunks: Sequence[int], src_chunks: Sequence[int], masks: BlockMasks, flash: bool
              ) -> list[tuple[int, int, int, int, str, torch.Tensor | None]]:
    """The kernel calls of one hop: ``(q0, q1, k0, k1, kind, mask)``, local chunk ranges [q0, q1) x [k0, k1).

    With the flash kernel, the unmasked ("full") blocks merge into as few rectangles as cover them
    exactly: all of them in one call when they form a rectangle (under the zigzag split every hop after
    the first is one: both local query chunks against one kv chunk, or one against both), else one call
    per query chunk and run of consecutive kv chunks. Fewer, larger kernel calls, and one merge of the
    running output per call instead of per block. Causal and masked blocks stay one call each."""
    blocks = [(qi, ki, mask, masks.kind(my_chunks[qi], src_chunks[ki]))
              for qi, ki, mask in computed_blocks(my_chunks, src_chunks, masks)]
    plan = []
    full = sorted((qi, ki) for qi, ki, _, kind in blocks if flash and kind == "full")
    if full:
        qs, ks = sorted({q for q, _ in full}), sorted({k for _, k in full})
        if (len(full) == len(qs) * len(ks) and qs == list(range(qs[0], qs[-1] + 1))
                and ks == list(range(ks[0], ks[-1] + 1))):
            plan.append((qs[0], qs[-1] + 1, ks[0], ks[-1] + 1, "full", None))
        else:
            for qi, ki in full:  # extend the previous run of this row, or start one
                if plan and plan[-1][0] == qi and plan[-1][3] == ki:
                    plan[-1] = (qi, qi + 1, plan[-1][2], ki + 1, "full", None)
                else:
                    plan.append((qi, qi + 1, ki, ki + 1, "full", None))
    plan += [(qi, qi + 1, ki, ki + 1, kind, mask) for qi, ki, mask, kind in blocks
             if not (flash and kind == "full")]
    return plan


def _rotate(buf: torch.Tensor, group: Group) -> tuple[torch.Tensor, list]:
    """Post the send of ``buf`` to the next ring rank and the receive of the previous rank's; returns
    (the receive buffer, the work handles). Nothing to do on a ring of one."""
    if group.size == 1:
        return buf, []
    nxt, prv = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    incoming = torch.empty_like(buf)
    works = comm.batch_p2p([P2P("send", buf, nxt), P2P("recv", incoming, prv)], group)
    return incoming, works


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: Group, chunks_of: Callable[[int], Sequence[int]], masks: BlockMasks,
                scale: float, fused: bool | None):
        n, me = group.size, group.rank
        L, cdt = masks.chunk_len, compute_dtype(q.dtype)
        fdt = fused_dtype(q, fused)
        qc = None  # the explicit kernel's inputs in the compute dtype, made on first use (flash blocks need none)
        my_chunks = chunks_of(me)
        # q's own layout (a view of the (s, b, nh, hd) input): the caller's (s, b, nh*hd) output is then a view too
        out = torch.zeros_like(q, dtype=cdt)  # (b, g, qpg, s_local, hd)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=cdt, device=q.device)  # (b, g, qpg, s_local)
        kv = torch.stack([k, v]).contiguous()  # (2, b, g, s_local, hd): one message per hop
        # each hop's kernel calls (hop t holds rank (me - t) % n's chunks), planned once for forward and backward
        plans = [_hop_plan(my_chunks, chunks_of((me - t) % n), masks, fdt is not None) for t in range(n)]
        for t in range(n):
            nxt, works = _rotate(kv, group) if t < n - 1 else (None, [])
            kvc = None  # this hop's K/V in the compute dtype, for the explicit kernel
            for q0, q1, k0, k1, kind, mask in plans[t]:
                rows, cols = slice(q0 * L, q1 * L), slice(k0 * L, k1 * L)
                if fdt is not None and kind != "masked":  # the fused kernel takes the inputs' own dtype on CUDA
                    o, l = _flash_block_forward(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                                kind == "causal", scale, fdt)
                else:
                    qc = q.to(cdt) if qc is None else qc
                    kvc = kv.to(cdt) if kvc is None else kvc
                    o, l = _block_forward(qc[..., rows, :], kvc[0][..., cols, :], kvc[1][..., cols, :], mask, scale)
                _merge(out[..., rows, :], lse[..., rows], o, l)
            if works:
                comm.wait(works, group)
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.masks, ctx.scale, ctx.fdt, ctx.plans = group, masks, scale, fdt, plans
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, masks, scale, fdt = ctx.group, ctx.masks, ctx.scale, ctx.fdt
        n = group.size
        L, cdt = masks.chunk_len, out.dtype
        explicit = None  # (q, dout, delta) in the compute dtype for the explicit kernel, made on first use
        dq = torch.zeros_like(q, dtype=cdt)
        kv = torch.stack([k, v]).contiguous()  # (2, b, g, s_local, hd)
        dkv_in, dkv_works = None, []
        for t in range(n):  # hop t: rank (me - t) % n's K/V chunks ("block src")
            nxt, works = _rotate(kv, group) if t < n - 1 else (None, [])
            kvc = None  # this hop's K/V in the compute dtype, for the explicit kernel
            dkv = torch.zeros(kv.shape, dtype=cdt, device=kv.device)  # this rank's share for block src
            for q0, q1, k0, k1, kind, mask in ctx.plans[t]:
                rows, cols = slice(q0 * L, q1 * L), slice(k0 * L, k1 * L)
                if fdt is not None and kind != "masked":
                    dqb, dkb, dvb = _flash_block_backward(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                                          dout[..., rows, :], out[..., rows, :], lse[..., rows],
                                                          kind == "causal", scale, fdt)
                else:
                    if explicit is None:
                        doutc = dout.to(cdt)
                        explicit = (q.to(cdt), doutc, (doutc * out).sum(dim=-1))  # delta (b, g, qpg, s_local)
                    qc, doutc, delta = explicit
                    kvc = kv.to(cdt) if kvc is None else kvc
                    dqb, dkb, dvb = _block_backward(qc[..., rows, :], kvc[0][..., cols, :], kvc[1][..., cols, :],
                                                    doutc[..., rows, :], lse[..., rows], delta[..., rows], mask, scale)
                dq[..., rows, :] += dqb
                dkv[0][..., cols, :] += dkb
                dkv[1][..., cols, :] += dvb
            if dkv_works:  # the accumulator of block src from the ranks before this one
                comm.wait(dkv_works, group)
                dkv += dkv_in
            if n > 1:
                dkv_in, dkv_works = _rotate(dkv, group)  # on to the next rank (after n hops: the owner)
            else:
                dkv_in = dkv
            if works:
                comm.wait(works, group)
                kv = nxt
        if dkv_works:
            comm.wait(dkv_works, group)
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Group,
                   chunks_of: Callable[[int], Sequence[int]], masks: BlockMasks, scale: float,
                   fused: bool | None = None) -> torch.Tensor:
    """Attention of the local queries over the whole sequence, K/V rotating over ``group``.

    ``q`` (s_local, b, nh, hd); ``k``, ``v`` (s_local, b, g, hd), ``nh`` a multiple of ``g`` (query head h
    uses kv head h // (nh/g)). ``chunks_of(ring_rank)``: the global chunk indices of that rank's local
    sequence, in order. Returns (s_local, b, nh*hd). Differentiable in q, k and v. ``fused``: the flash
    block kernel for the unmasked and causal blocks where it runs (None), never (False), or required (True: a
    ValueError where no flash kernel runs these inputs); masked blocks always take the explicit kernel."""
    s, b, nh, hd = q.shape
    g = k.shape[2]
    if s != len(chunks_of(group.rank)) * masks.chunk_len:
        raise ValueError(f"ring attention: {s} local tokens do not make the {len(chunks_of(group.rank))} chunks "
                         f"of {masks.chunk_len} this rank holds; shard the sequence with "
                         "parallel.context_parallel.shard_micro_batch")
    q5 = q.permute(1, 2, 0, 3).reshape(b, g, nh // g, s, hd)  # (b, g, qpg, s, hd)
    k4 = k.permute(1, 2, 0, 3)  # (b, g, s, hd)
    v4 = v.permute(1, 2, 0, 3)  # (b, g, s, hd)
    out = _RingAttention.apply(q5, k4, v4, group, chunks_of, masks, scale, fused)  # (b, g, qpg, s, hd)
    return out.reshape(b, nh, s, hd).permute(2, 0, 1, 3).reshape(s, b, nh * hd)  # (s, b, nh*hd)
