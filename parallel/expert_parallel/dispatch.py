"""Moving routed tokens to the ranks that hold their experts and back, over the ep group.

Experts are split in contiguous blocks: ep rank ``r`` holds experts ``[r*E_local, (r+1)*E_local)``.
Every dispatcher is ``dispatcher(tokens (T, h), routing, experts) -> (T, h)`` where ``experts(rows,
counts)`` runs this rank's experts over ``rows`` sorted by local expert (``counts[i]`` rows for local
expert ``i``) and returns one output row per input row. Dropless: every (token, choice) is computed.

* Permutation (:func:`permute` / :func:`unpermute`): the T*k (token, choice) pairs are sorted by
  expert with one stable argsort and gathered by index; the combine is one weighted ``index_add``.
  No Python loop over tokens.
* :class:`AllToAllDispatcher` (``build_model(moe_dispatcher="alltoall")``; no config key until the trainer runs ep > 1): the per-expert counts are
  exchanged first (one all-to-all of E int64), then the rows go straight to their expert's rank
  (all-to-all with those split sizes), are regrouped by local expert, computed, and sent back the
  same way. Bytes per layer forward: each rank sends exactly the rows routed to experts on other
  ranks (h * element size each), twice (dispatch, and the combine of the rows it received).
* :class:`AllGatherDispatcher` (``"allgather"``, for small ep): every rank gathers all ep ranks'
  tokens and routing, computes its experts' share of every token, and a reduce-scatter returns each
  rank its own tokens' sums. Needs the same T on every ep rank.

Gradients flow through autograd functions whose backward is the mirror collective.
"""
from __future__ import annotations

from typing import Callable

import torch

from parallel import comm
from parallel.comm import Group
from parallel.expert_parallel.router import Routing
# Row-wise (dim 0) all-gather forward / reduce-scatter backward and the reverse, over any group: the same
# autograd mappings sequence parallelism uses for its sequence dim.
from parallel.mappings import gather_from_sp, reduce_scatter_to_sp

ExpertFn = Callable[[torch.Tensor, list], torch.Tensor]
DISPATCHERS = ("alltoall", "allgather")


# -- autograd collectives over the ep group ------------------------------------------------------------

class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group, out_splits: list, in_splits: list):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return comm.all_to_all(x.contiguous(), group, output_split_sizes=out_splits, input_split_sizes=in_splits)

    @staticmethod
    def backward(ctx, g):
        back = comm.all_to_all(g.contiguous(), ctx.group, output_split_sizes=ctx.in_splits,
                               input_split_sizes=ctx.out_splits)
        return back, None, None, None


# -- permutation -----------------------------------------------------------------------------------

def permute(tokens: torch.Tensor, indices: torch.Tensor, *, num_experts: int):
    """Rows of the (token, choice) pairs in expert-contiguous order.

    Returns ``(rows (n, h), order (n,), counts (E,) int64)``: ``order`` indexes the flattened (T, k)
    choices (row ``j`` is choice ``order[j]``, token ``order[j] // k``). Pairs whose expert id is
    ``num_experts`` (dropped over capacity) sort last and are left out: n = T*k minus the dropped."""
    k = indices.shape[1]
    flat = indices.reshape(-1)  # (T*k,)
    order = torch.argsort(flat, stable=True)  # (T*k,) expert-contiguous, dropped pairs last
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]  # (E,)
    order = order[:int(counts.sum())]  # (n,)
    rows = tokens.index_select(0, order // k)  # (n, h)
    return rows, order, counts


def unpermute(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, *, num_tokens: int) -> torch.Tensor:
    """Weighted sum of each token's expert outputs: ``rows`` (n, h) in :func:`permute` order,
    ``weights`` (T, k) -> (T, h)."""
    k = weights.shape[1]
    w = weights.reshape(-1).index_select(0, order)  # (T*k,)
    out = rows.new_zeros(num_tokens, rows.shape[1])  # (T, h)
    return out.index_add(0, order // k, rows * w.unsqueeze(1).to(rows.dtype))


def local_dispatch(tokens: torch.Tensor, routing: Routing, experts: ExpertFn, *, num_experts: int) -> torch.Tensor:
    """ep = 1: permute, run every expert, unpermute."""
    rows, order, counts = permute(tokens, routing.indices, num_experts=num_experts)
    out = experts(rows, counts.tolist())
    return unpermute(out, order, routing.weights, num_tokens=tokens.shape[0])


class _Dispatcher:
    """What both dispatchers share: the ep group, ``num_experts / ep`` local experts, and at ep = 1 the
    local path (no communication). Subclasses implement ``_dispatch`` for ep > 1."""

    def __init__(self, *, num_experts: int, ep_group: Group):
        self.num_experts, self.group = num_experts, ep_group
        self.num_local = num_experts // ep_group.size

    def __call__(self, tokens: torch.Tensor, routing: Routing, experts: ExpertFn) -> torch.Tensor:
        if self.group.size == 1:
            return local_dispatch(tokens, routing, experts, num_experts=self.num_experts)
        return self._dispatch(tokens, routing, experts)

    def _dispatch(self, tokens: torch.Tensor, routing: Routing, experts: ExpertFn) -> torch.Tensor:
        raise NotImplementedError


class AllToAllDispatcher(_Dispatcher):
    """Tokens to their experts' ranks by all-to-all (split sizes exchanged first), and back."""

    def _dispatch(self, tokens: torch.Tensor, routing: Routing, experts: ExpertFn) -> torch.Tensor:
        ep, e_local = self.group.size, self.num_local
        rows, order, counts = permute(tokens, routing.indices, num_experts=self.num_experts)
        # recv_counts[src * E_local + i]: rows rank `src` sends to my local expert i.
        recv_counts = comm.all_to_all(counts, self.group)  # (ep * E_local,)
        in_splits = counts.view(ep, e_local).sum(1).tolist()  # rows to each rank
        out_splits = recv_counts.view(ep, e_local).sum(1).tolist()  # rows from each rank
        recv = _AllToAll.apply(rows, self.group, out_splits, in_splits)  # (N, h), by (src, local expert)
        # Regroup the received rows by local expert (stable: source order inside an expert).
        local_ids = torch.arange(e_local, device=tokens.device).repeat(ep)  # (ep * E_local,)
        expert_of_row = torch.repeat_interleave(local_ids, recv_counts)  # (N,)
        regroup = torch.argsort(expert_of_row, stable=True)  # (N,)
        y = experts(recv.index_select(0, regroup), recv_counts.view(ep, e_local).sum(0).tolist())  # (N, h)
        y = y.index_select(0, torch.argsort(regroup))  # back to (src, local expert) order
        back = _AllToAll.apply(y, self.group, in_splits, out_splits)  # (T*k, h) in permute order
        return unpermute(back, order, routing.weights, num_tokens=tokens.shape[0])


class AllGatherDispatcher(_Dispatcher):
    """Every ep rank sees every token: all-gather tokens and routing, compute the local experts' share,
    reduce-scatter the partial sums back to the tokens' ranks."""

    def _dispatch(self, tokens: torch.Tensor, routing: Routing, experts: ExpertFn) -> torch.Tensor:
        ep, e_local = self.group.size, self.num_local
        t, k = routing.indices.shape
        sizes = comm.all_gather(torch.tensor([t], device=tokens.device), self.group)  # (ep,)
        if (sizes != t).any():
            raise ValueError(f"the allgather MoE dispatcher needs the same token count on every ep rank; got "
                             f"{sizes.tolist()}: build the model with moe_dispatcher='alltoall' for ragged batches")
        all_tokens = gather_from_sp(tokens, self.group)  # (ep*T, h)
        all_weights = gather_from_sp(routing.weights, self.group)  # (ep*T, k)
        all_indices = comm.all_gather(routing.indices.contiguous(), self.group)  # (ep*T, k)
        first = self.group.rank * e_local
        flat = all_indices.reshape(-1)  # (ep*T*k,)
        mine = torch.nonzero((flat >= first) & (flat < first + e_local)).squeeze(1)  # choices for my experts
        local = flat.index_select(0, mine) - first
        order = mine.index_select(0, torch.argsort(local, stable=True))  # my choices, expert-contiguous
        counts = torch.bincount(local, minlength=e_local).tolist()
        y = experts(all_tokens.index_select(0, order // k), counts)  # (n, h)
        w = all_weights.reshape(-1).index_select(0, order)  # (n,)
        partial = y.new_zeros(ep * t, y.shape[1]).index_add(0, order // k, y * w.unsqueeze(1).to(y.dtype))
        return reduce_scatter_to_sp(partial, self.group)  # (T, h)


def make_dispatcher(kind: str, *, num_experts: int, ep_group: Group):
    if kind == "alltoall":
        return AllToAllDispatcher(num_experts=num_experts, ep_group=ep_group)
    if kind == "allgather":
        return AllGatherDispatcher(num_experts=num_experts, ep_group=ep_group)
    raise ValueError(f"moe_dispatcher={kind!r} is not one of {list(DISPATCHERS)}")
