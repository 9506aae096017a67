"""The mixture-of-experts MLP: router, dispatcher over the ep group, SwiGLU experts, optional shared expert.

Groups (given at construction):

* ``ep_group``: the experts are split over it (rank r holds a contiguous block of ``E / ep``); tokens
  travel by the dispatcher (docs/moe.md).
* ``cp_group`` (context parallelism; optional): this rank holds 1/cp
  of each sequence, so the load-balancing loss takes the experts' assignment shares summed over cp (one
  all-reduce of E counts per forward) and this rank's mean probabilities; the loss is then linear in the
  local probabilities and the cp ranks' mean (what data parallelism over dp x cp averages) is the loss of
  the whole sequences. Routing, dispatch and experts are token-local and need nothing more.
* ``tp_group``, with ``expert_tp`` = tp (the default): every expert's FFN is sharded like the dense MLP
  (fc1 ``[gate_r; up_r]`` rows, fc2 columns). The router runs on the full (replicated) tokens, so every TP
  rank routes identically; an expert's partial output is all-reduced over TP in expert order, before the
  routing weights apply, so everything after it (and the router's gradient) is replicated. With sequence
  parallelism the layer gathers the sequence first and keeps its own chunk of the output.
* ``expert_tp`` = 1 at tp > 1 (needs sequence parallelism): the experts are whole on every TP rank
  (replicated over tp). Each TP rank routes its own sequence chunk (s/tp, b, h), dispatches it over its ep
  group and runs whole experts: no gather, no TP all-reduce. The router, the experts and the shared
  expert's gate then see different tokens on each TP rank, so they are marked ``sequence_parallel`` (their
  gradients are partial sums over TP, summed before the data-parallel reduction, as for SP norm weights).
  The shared expert stays sharded over TP like the dense MLP (gathers the sequence, reduce-scatters its
  output), as in Megatron-Core. One all-reduce over TP of 2E + 3 floats per forward gives the aux loss and
  the metrics the whole sequence's expert counts.

Parameters (relative names, global expert indices so checkpoint keys do not depend on ep):
``router.weight`` (E, h); ``experts.{e}.fc1.weight`` (2 f / expert_tp, h), ``experts.{e}.fc2.weight``
(h, f / expert_tp) for this rank's experts only, marked ``expert = True`` (their gradients reduce over edp,
not dp); ``shared_expert.fc1/fc2.weight`` and ``shared_expert_gate.weight`` (1, h) with a shared
expert (Qwen2-MoE: ``out += sigmoid(x g^T) * shared(x)``).

Expert compute (``expert_gemm``): "reference" loops over the local experts; "torch" stacks their weights and
runs one grouped GEMM per projection (``torch._grouped_mm``); "auto" = the grouped GEMM on CUDA (bf16,
aligned; engine/ops/grouped_gemm.py), the loop elsewhere.

Dropless by default; ``capacity_factor`` keeps at most ceil(factor * T * k / E) choices per expert from
this rank's T tokens, by ``drop_policy`` ("probs": the highest weights; "position": the earliest).

After each forward, ``last_stats`` holds the layer's :class:`RouterStats`, ``last_aux_loss`` and
``last_z_loss`` (fp32 scalars), ``last_dropped_fraction`` the share of choices dropped. Training forwards
also add into ``step_load`` (fp64, (E + 4,): tokens per expert, the aux loss, dropped and routed choices,
forwards),
which :class:`parallel.expert_parallel.metrics.MoEMetrics` reduces and resets once per step. In training,
``aux_loss_coef * aux + z_loss_coef * z`` receives gradient ``aux_loss_scale`` through
:class:`AuxLossInjector`.
"""
from __future__ import annotations

import hashlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.ops.grouped_gemm import GROUPED_BACKENDS, grouped_mm
from parallel import comm
from parallel.comm import Group
from parallel.expert_parallel.dispatch import DISPATCHERS, make_dispatcher
from parallel.expert_parallel.router import (DROP_POLICIES, AuxLossInjector, RouterStats, TopKRouter,
                                             check_expert_tp, check_routing, drop_over_capacity, load_balancing_loss,
                                             z_loss)
from parallel.mappings import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp, scatter_to_sp
from parallel.tensor_parallel import mark_replicated, set_tensor_parallel_attributes, shard_tensor

InitFn = Callable[[str], Callable[[torch.Tensor], None]]


def default_init(std: float = 0.02, *, seed: int = 0) -> InitFn:
    """N(0, std) drawn from a generator seeded by (seed, name): the same full tensor on every rank."""
    def init(name: str):
        def fill(full: torch.Tensor) -> None:
            s = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1
            full.normal_(0.0, std, generator=torch.Generator(device=full.device).manual_seed(s))
        return fill
    return init


class _Weight(nn.Module):
    """A bare ``weight`` holder, so parameters are named ``<module>.weight`` as in the dense MLP."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)


def _swiglu_ffn(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, fc1).chunk(2, dim=-1)  # (n, f_local) each
    return F.linear(F.silu(gate) * up, fc2)  # (n, h), partial over TP


class SwiGLUExpert(nn.Module):
    """One expert's (or the shared expert's) TP shard: fc1 ``[gate_r; up_r]`` (2f/tp, h), fc2 (h, f/tp).
    ``replicated``: whole (2f, h) and (h, f) on every rank of ``tp_group``, each rank computing its own tokens,
    so the gradients are partial sums over TP (``sequence_parallel``; ``expert_tp`` = 1)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, tp_group: Group, name: str, init: InitFn,
                 dtype, device, expert: bool, replicated: bool = False):
        super().__init__()
        tp, r = (1, 0) if replicated else (tp_group.size, tp_group.rank)
        if ffn_hidden_size % tp:
            raise ValueError(f"{name}: FFN size {ffn_hidden_size} is not divisible by tensor-parallel size {tp}; "
                             "choose a TP size that divides moe_intermediate_size")
        dtype = dtype or torch.get_default_dtype()
        full1 = torch.empty(2 * ffn_hidden_size, hidden_size, device=device)
        init(name + "fc1.weight")(full1)
        full2 = torch.empty(hidden_size, ffn_hidden_size, device=device)
        init(name + "fc2.weight")(full2)
        self.fc1 = _Weight(shard_tensor(full1, rank=r, size=tp, dim=0, stride=2).to(dtype))
        self.fc2 = _Weight(shard_tensor(full2, rank=r, size=tp, dim=1).to(dtype))
        for p in (self.fc1.weight, self.fc2.weight):
            if replicated:
                mark_replicated(p, sequence_parallel=True)
            p.expert = expert
        if not replicated:
            set_tensor_parallel_attributes(self.fc1.weight, partition_dim=0, stride=2)
            set_tensor_parallel_attributes(self.fc2.weight, partition_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _swiglu_ffn(x, self.fc1.weight, self.fc2.weight)


class MoELayer(nn.Module):
    """``forward(x)``: ``x`` (s, b, h), or (s/tp, b, h) with sequence parallelism -> the same shape.
    ``expert_tp``: None or tp (experts sharded over ``tp_group``), or 1 (whole experts, each TP rank routing
    its own sequence chunk; needs ``sequence_parallel`` at tp > 1)."""

    def __init__(self, *, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 tp_group: Group, ep_group: Group, dispatcher: str = "alltoall", sequence_parallel: bool = False,
                 score_func: str = "softmax", norm_topk_prob: bool = True, shared_expert_ffn_hidden_size: int = 0,
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, dtype=None, device=None,
                 init: InitFn | None = None, name_prefix: str = "", expert_gemm: str = "auto",
                 capacity_factor: float | None = None, drop_policy: str = "probs", cp_group: Group | None = None,
                 expert_tp: int | None = None):
        super().__init__()
        if expert_gemm not in GROUPED_BACKENDS:
            raise ValueError(f"expert_gemm={expert_gemm!r}: use one of {GROUPED_BACKENDS}")
        self.expert_gemm = expert_gemm
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy={drop_policy!r}: use one of {DROP_POLICIES}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0, or None for dropless routing")
        check_routing(num_experts=num_experts, top_k=top_k, ep=ep_group.size)
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"moe_dispatcher={dispatcher!r} is not one of {list(DISPATCHERS)}")
        for name, v in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef)):
            if v < 0:
                raise ValueError(f"{name}={v} must be >= 0")
        init = init or default_init()
        self.tp_group, self.ep_group, self.cp_group = tp_group, ep_group, cp_group
        self.sequence_parallel = sequence_parallel and tp_group.size > 1
        self.expert_tp = check_expert_tp(expert_tp, tp=tp_group.size, sequence_parallel=self.sequence_parallel)
        # expert_tp = 1 at tp > 1: every TP rank routes its own sequence chunk to whole experts.
        self.local_routing = self.expert_tp == 1 and tp_group.size > 1
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local_experts = num_experts // ep_group.size
        self.first_expert = ep_group.rank * self.num_local_experts
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.aux_loss_scale = 1.0
        self.router = TopKRouter(hidden_size, num_experts, top_k=top_k, score_func=score_func,
                                 norm_topk_prob=norm_topk_prob, dtype=dtype, device=device)
        with torch.no_grad():
            full = torch.empty(num_experts, hidden_size, device=device)
            init(name_prefix + "router.weight")(full)
            self.router.weight.copy_(full)
        mark_replicated(self.router.weight, sequence_parallel=self.local_routing)
        kw = dict(tp_group=tp_group, init=init, dtype=dtype, device=device)
        self.experts = nn.ModuleDict({
            str(e): SwiGLUExpert(hidden_size, ffn_hidden_size, name=f"{name_prefix}experts.{e}.", expert=True,
                                 replicated=self.local_routing, **kw)
            for e in range(self.first_expert, self.first_expert + self.num_local_experts)})
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_ffn_hidden_size:
            self.shared_expert = SwiGLUExpert(hidden_size, shared_expert_ffn_hidden_size, expert=False,
                                              name=name_prefix + "shared_expert.", **kw)
            full = torch.empty(1, hidden_size, device=device)
            init(name_prefix + "shared_expert_gate.weight")(full)
            self.shared_expert_gate = _Weight(full.to(dtype or torch.get_default_dtype()))
            mark_replicated(self.shared_expert_gate.weight, sequence_parallel=self.local_routing)
        self.dispatcher = make_dispatcher(dispatcher, num_experts=num_experts, ep_group=ep_group)
        self.last_stats = self.last_aux_loss = self.last_z_loss = None
        self.last_dropped_fraction = 0.0
        self.layer_name = name_prefix.rstrip(".")  # "layers.{i}.mlp" (global index): the metrics' key
        self.step_load: torch.Tensor | None = None  # (E + 4,) fp64, see the module docstring

    def _run_experts(self, rows: torch.Tensor, counts: list) -> torch.Tensor:
        """This rank's experts over ``rows`` sorted by local expert; TP-reduced output rows (n, h) (whole
        experts at ``expert_tp`` = 1: nothing to reduce). An expert with no rows still runs (on zero rows), so
        every expert parameter gets a gradient."""
        if not self.local_routing:
            rows = copy_to_tp(rows, self.tp_group)
        if self.expert_gemm == "reference" or (self.expert_gemm == "auto" and not rows.is_cuda):
            outs, start = [], 0
            for expert, n in zip(self.experts.values(), counts):  # a loop over experts, not tokens
                outs.append(expert(rows[start:start + n]))  # (n_e, h)
                start += n
            out = torch.cat(outs, dim=0)  # (n, h)
        else:  # one grouped GEMM per projection (engine/ops/grouped_gemm.py) over stacked expert weights
            fc1 = torch.stack([e.fc1.weight for e in self.experts.values()])  # (E_local, 2f/etp, h)
            fc2 = torch.stack([e.fc2.weight for e in self.experts.values()])  # (E_local, h, f/etp)
            gate, up = grouped_mm(rows, fc1, counts, backend=self.expert_gemm).chunk(2, dim=-1)  # (n, f/etp) each
            out = grouped_mm(F.silu(gate) * up, fc2, counts, backend=self.expert_gemm)  # (n, h)
        return out if self.local_routing else reduce_from_tp(out, self.tp_group)  # (n, h)

    def _shared_output(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The shared expert's output rows (T, h) for this rank's ``tokens`` (T, h); sharded over TP like the
        dense MLP. Routing locally (``x`` the SP chunk (s/tp, b, h)), it gathers the sequence for itself and
        reduce-scatters its output back to the chunk."""
        if not self.local_routing:
            return reduce_from_tp(self.shared_expert(copy_to_tp(tokens, self.tp_group)), self.tp_group)  # (T, h)
        full = gather_from_sp(x, self.tp_group)  # (s, b, h); backward reduce-scatters the partial input grads
        y = reduce_scatter_to_sp(self.shared_expert(full), self.tp_group)  # (s/tp, b, h)
        return y.reshape(tokens.shape)  # (T, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gathered = self.sequence_parallel and not self.local_routing
        if gathered:
            # Routing needs every token on every TP rank; the gradient that comes back is replicated.
            x = gather_from_sp(x, self.tp_group, grad_is_partial=False)  # (s, b, h)
        s, b, h = x.shape  # (s, b, h), or this rank's chunk (s/tp, b, h) routing locally
        tokens = x.reshape(s * b, h)  # (T, h)
        routing = self.router(tokens)
        self.last_stats = self.router.stats(routing)  # before dropping: the aux loss sees the router's choice
        dropped = 0
        if self.capacity_factor is not None:
            routing, dropped = drop_over_capacity(routing, num_experts=self.num_experts,
                                                  capacity_factor=self.capacity_factor, policy=self.drop_policy)
            self.last_dropped_fraction = dropped / routing.indices.numel()
        out = self.dispatcher(tokens, routing, self._run_experts)  # (T, h)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(F.linear(tokens, self.shared_expert_gate.weight)) * self._shared_output(x, tokens)
        counts, extra = self._router_losses(self.last_stats, routing, dropped)
        if self.training:  # the step's load (metrics); a recomputed forward adds again, ratios stay exact
            row = torch.cat([counts.double(), extra.double()])  # (E + 4,)
            self.step_load = row if self.step_load is None else self.step_load + row
        if torch.is_grad_enabled() and (self.aux_loss_coef or self.z_loss_coef):
            loss = self.aux_loss_coef * self.last_aux_loss + self.z_loss_coef * self.last_z_loss
            out = AuxLossInjector.apply(out, loss, self.aux_loss_scale)
        out = out.view(s, b, h)  # (s, b, h), or (s/tp, b, h) routing locally
        return scatter_to_sp(out, self.tp_group) if gathered else out

    def _router_losses(self, stats: RouterStats, routing, dropped: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Set ``last_aux_loss`` and ``last_z_loss``; return the load row's parts (no gradient): the expert
        counts (E,) and ``[aux, dropped, routed, 1]`` (4,), over the tokens the TP group routes.

        Routing locally (``expert_tp`` = 1), each TP rank holds 1/tp of the tokens: one all-reduce over TP of
        the counts, the probability sums (no gradient), the z share, dropped and routed pairs. Each loss's
        value is then the whole sequence's and its gradient this rank's share of it: the aux loss with the
        whole sequence's counts is linear in the probabilities (this rank's sum over all the TP group's
        tokens), the z-loss's share is its local mean / tp. The router's gradients, summed over TP like every
        ``sequence_parallel`` parameter's, are then the whole sequence's."""
        e = self.num_experts
        z = z_loss(routing.logits)
        counts = stats.counts.detach()  # (E,)
        extra = torch.tensor([0.0, float(dropped), float(routing.indices.numel()), 1.0], dtype=torch.float32,
                             device=counts.device)  # (4,)
        if not self.local_routing:
            self.last_aux_loss, self.last_z_loss = self._aux_loss(stats), z
            extra[0] = self.last_aux_loss.detach()
            return counts, extra
        tp = self.tp_group.size
        z_share = z / tp
        packed = torch.cat([counts, stats.prob_sum.detach().float(), z_share.detach().float().reshape(1),
                            extra[1:3]])  # (2E + 3,)
        comm.all_reduce(packed, self.tp_group)
        counts, prob_sum = packed[:e], packed[e:2 * e]  # (E,) each, over the TP group's tokens
        rows = float(stats.tokens * tp)
        shares = self._assignment_shares(counts, rows)  # (E,)
        aux_share = e * torch.sum(shares * (stats.prob_sum / rows))
        whole = e * torch.sum(shares * (prob_sum / rows))
        self.last_aux_loss = aux_share + (whole - aux_share.detach())  # value: whole; gradient: this rank's share
        self.last_z_loss = z_share + (packed[2 * e] - z_share.detach())
        extra[0], extra[1:3] = whole, packed[2 * e + 1:]
        return counts, extra

    def _assignment_shares(self, counts: torch.Tensor, rows: float) -> torch.Tensor:
        """``f_e`` (E,): expert e's top-k assignments per token, from ``counts`` (E,) over ``rows`` tokens;
        under context parallelism summed over cp (the whole sequences; equal tokens per cp rank)."""
        if self.cp_group is None or self.cp_group.size == 1:
            return counts / rows
        counts = counts.detach().clone()  # (E,)
        comm.all_reduce(counts, self.cp_group)
        return counts / (rows * self.cp_group.size)

    def _aux_loss(self, stats: RouterStats) -> torch.Tensor:
        """The layer's load-balancing loss; under context parallelism with the assignment shares of the whole
        sequences (summed over cp, no gradient) and this rank's probabilities (equal token counts per cp rank,
        as the zigzag split gives)."""
        if self.cp_group is None or self.cp_group.size == 1:
            return load_balancing_loss([stats], num_experts=self.num_experts)
        rows = float(stats.tokens)
        return self.num_experts * torch.sum(self._assignment_shares(stats.counts, rows) * (stats.prob_sum / rows))

    def extra_repr(self) -> str:
        last = self.first_expert + self.num_local_experts - 1
        return (f"experts={self.num_experts} (local {self.first_expert}..{last}), top_k={self.top_k}, "
                f"ep={self.ep_group.size}, tp={self.tp_group.size}, expert_tp={self.expert_tp}")
