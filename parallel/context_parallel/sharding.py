"""Load-balanced (zigzag) sharding of a sequence over the cp ranks.

A causal mask makes the late tokens of a sequence attend to more keys than the early ones, so a
contiguous split gives the last cp rank the most attention work. The zigzag split (Megatron-LM /
Transformer Engine's "load-balanced" context parallelism) cuts the sequence into ``2*cp`` equal chunks
and gives cp rank ``r`` chunks ``r`` and ``2*cp-1-r``: every rank then holds one early and one late
chunk and computes the same number of unmasked blocks (asserted in tests/parallel/test_context_parallel.py;
:func:`parallel.context_parallel.masks.block_counts`).

A rank's local sequence is its two chunks concatenated, ``[chunk r | chunk 2cp-1-r]``. Every per-token
tensor of a micro-batch (token ids, labels, loss mask, RoPE positions, document ids) is sharded the
same way by :func:`shard_micro_batch`, so positions, labels and masks follow their tokens.
"""
from __future__ import annotations

import torch

from parallel import comm
from parallel.comm import Group

# Per-token keys of a micro-batch, sharded along their sequence dim (1: they are (b, s) or (1, s)).
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "document_ids")


def check_cp_sequence(seq_len: int, *, cp: int, tp: int = 1, where: str = "sequence length") -> None:
    """ValueError unless ``seq_len`` splits into ``2*cp`` chunks and, under sequence parallelism
    (``tp`` > 1), each cp rank's ``seq_len/cp`` tokens split again over tp. Called before any communication."""
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(f"{where} {seq_len} is not divisible by 2*cp = {2 * cp}: context parallelism splits each "
                         f"sequence into 2*cp chunks to balance causal attention; pad or pack sequences to a "
                         f"multiple of {2 * cp} (train.seq_length), or change parallel.cp")
    if tp > 1 and (seq_len // cp) % tp:
        raise ValueError(f"{where} {seq_len} over cp={cp} leaves {seq_len // cp} tokens per rank, not divisible by "
                         f"tp={tp} (sequence parallelism shards them again); use a multiple of {2 * cp * tp}")


def zigzag_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunk indices (of ``2*cp``) cp rank ``rank`` holds, in local order."""
    if rank not in range(cp):
        raise ValueError(f"cp rank {rank} is not in 0..{cp - 1}")
    return rank, 2 * cp - 1 - rank


def zigzag_indices(seq_len: int, *, cp: int, rank: int, device=None) -> torch.Tensor:
    """(seq_len/cp,) int64: the global positions of cp rank ``rank``'s tokens, in local order."""
    check_cp_sequence(seq_len, cp=cp)
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in zigzag_chunks(rank, cp)])


def contiguous_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The naive split's chunks of cp rank ``rank`` (for the balance comparison only)."""
    return 2 * rank, 2 * rank + 1


def zigzag_shard(t: torch.Tensor, *, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag share of ``t`` along ``dim`` (length divisible by 2*cp): two chunks, concatenated."""
    if cp == 1:
        return t
    s = t.shape[dim]
    check_cp_sequence(s, cp=cp)
    chunks = t.chunk(2 * cp, dim=dim)  # 2cp x (..., s/2cp, ...)
    a, b = zigzag_chunks(rank, cp)
    return torch.cat([chunks[a], chunks[b]], dim=dim)  # (..., s/cp, ...)


def zigzag_unshard(gathered: torch.Tensor, *, cp: int, dim: int = 1) -> torch.Tensor:
    """The natural order of a sequence whose cp shards are concatenated in rank order along ``dim``
    (what an all-gather over the cp group gives): the inverse of :func:`zigzag_shard` on every rank."""
    if cp == 1:
        return gathered
    parts = gathered.chunk(2 * cp, dim=dim)  # rank r's chunks at 2r (chunk r) and 2r+1 (chunk 2cp-1-r)
    order = [None] * (2 * cp)
    for r in range(cp):
        a, b = zigzag_chunks(r, cp)
        order[a], order[b] = parts[2 * r], parts[2 * r + 1]
    return torch.cat(order, dim=dim)


def document_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """(b, s) document index where positions restart (any step other than +1), None if no row restarts.
    The rule of models.attention.document_ids_from_positions, applied to the FULL sequence before
    sharding: after the zigzag split a rank's positions jump between its two chunks."""
    step = torch.diff(position_ids, dim=-1)
    starts = torch.cat([torch.zeros_like(position_ids[:, :1], dtype=torch.bool), step != 1], dim=-1)
    if not bool(starts.any()):
        return None
    return starts.cumsum(-1)


def shard_micro_batch(batch: dict, group: Group) -> dict:
    """This cp rank's share of a micro-batch of full sequences (b, s): every key in
    :data:`SEQUENCE_KEYS` zigzag-sharded along the sequence; other keys pass through.

    ``position_ids`` are made explicit (0..s-1 when absent) so RoPE and learned positions see the
    global position of each local token. When the positions restart (packed documents) and no
    ``document_ids`` are given, they are derived here from the full positions (the model cannot
    tell a document boundary from the jump between a rank's two chunks). No communication.
    """
    cp = group.size
    if cp == 1:
        return batch
    if "units" in batch:
        raise ValueError("context parallelism shards per-token losses over cp ranks, but this micro-batch "
                         "carries per-sequence 'units' (a post-training objective); set parallel.cp=1 for it")
    tokens = batch["tokens"]
    if tokens.dim() != 2:
        raise ValueError(f"a micro-batch's tokens must be (b, s); got {tuple(tokens.shape)}")
    s = tokens.shape[1]
    check_cp_sequence(s, cp=cp, where="micro-batch sequence length")
    out = dict(batch)
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(s, device=tokens.device).unsqueeze(0)  # (1, s)
        out["position_ids"] = pos
    if batch.get("document_ids") is None:
        out.pop("document_ids", None)
        docs = document_ids_from_positions(pos)
        if docs is not None:
            out["document_ids"] = docs
    for key in SEQUENCE_KEYS:
        t = out.get(key)
        if t is None:
            continue
        if t.dim() != 2 or t.shape[1] != s:
            raise ValueError(f"micro-batch key {key!r} must be (b, {s}) or (1, {s}) like the tokens; "
                             f"got {tuple(t.shape)}")
        out[key] = zigzag_shard(t, cp=cp, rank=group.rank, dim=1)  # (b, s/cp)
    return out


def gather_sequence(local: torch.Tensor, group: Group) -> torch.Tensor:
    """(b, s/cp) local shards of an integer per-token tensor -> (b, s) in natural order, on every cp
    rank (one all-gather over ``group``; no autograd)."""
    if group.size == 1:
        return local
    gathered = comm.all_gather(local.contiguous(), group, dim=1)  # (b, s) in rank order
    return zigzag_unshard(gathered, cp=group.size, dim=1)
