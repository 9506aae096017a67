"""The mixture-of-experts MLP: router, dispatcher over the ep group, SwiGLU experts, optional shared expert.

Groups (given at construction):

* ``ep_group``: the experts are split over it (rank r holds a contiguous block of ``E / ep``); tokens
  travel by the dispatcher (docs/moe.md).
* ``cp_group`` (context parallelism; optional): this rank holds 1/cp
  of each sequence, so the load-balancing loss takes the experts' assignment shares summed over cp (one
  all-reduce of E counts per forward) and this rank's mean probabilities; the loss is then linear in the
  local probabilities and the cp ranks' mean (what data parallelism over dp x cp averages) is the loss of
  the whole sequences. Routing, dispatch and experts are token-local and need nothing more.
* ``tp_group``: every expert's FFN is sharded like the dense MLP (fc1 ``[gate_r; up_r]`` rows, fc2
  columns). The router runs on the full (replicated) tokens, so every TP rank routes identically;
  an expert's partial output is all-reduced over TP in expert order, before the routing weights
  apply, so everything after it (and the router's gradient) is replicated. With sequence
  parallelism the layer gathers the sequence first and keeps its own chunk of the output.

Parameters (relative names, global expert indices so checkpoint keys do not depend on ep):
``router.weight`` (E, h); ``experts.{e}.fc1.weight`` (2 f / tp, h), ``experts.{e}.fc2.weight``
(h, f / tp) for this rank's experts only, marked ``expert = True`` (their gradients reduce over edp,
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
from parallel.expert_parallel.router import (DROP_POLICIES, AuxLossInjector, TopKRouter, check_routing,
                                             drop_over_capacity, load_balancing_loss, z_loss)
from parallel.mappings import copy_to_tp, gather_from_sp, reduce_from_tp, scatter_to_sp
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
    """One expert's (or the shared expert's) TP shard: fc1 ``[gate_r; up_r]`` (2f/tp, h), fc2 (h, f/tp)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, tp_group: Group, name: str, init: InitFn,
                 dtype, device, expert: bool):
        super().__init__()
        tp, r = tp_group.size, tp_group.rank
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
        set_tensor_parallel_attributes(self.fc1.weight, partition_dim=0, stride=2)
        set_tensor_parallel_attributes(self.fc2.weight, partition_dim=1)
        for p in (self.fc1.weight, self.fc2.weight):
            p.expert = expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _swiglu_ffn(x, self.fc1.weight, self.fc2.weight)


class MoELayer(nn.Module):
    """``forward(x)``: ``x`` (s, b, h), or (s/tp, b, h) with sequence parallelism -> the same shape."""

    def __init__(self, *, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 tp_group: Group, ep_group: Group, dispatcher: str = "alltoall", sequence_parallel: bool = False,
                 score_func: str = "softmax", norm_topk_prob: bool = True, shared_expert_ffn_hidden_size: int = 0,
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, dtype=None, device=None,
                 init: InitFn | None = None, name_prefix: str = "", expert_gemm: str = "auto",
                 capacity_factor: float | None = None, drop_policy: str = "probs", cp_group: Group | None = None):
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
        mark_replicated(self.router.weight)
        kw = dict(tp_group=tp_group, init=init, dtype=dtype, device=device)
        self.experts = nn.ModuleDict({
            str(e): SwiGLUExpert(hidden_size, ffn_hidden_size, name=f"{name_prefix}experts.{e}.", expert=True, **kw)
            for e in range(self.first_expert, self.first_expert + self.num_local_experts)})
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_ffn_hidden_size:
            self.shared_expert = SwiGLUExpert(hidden_size, shared_expert_ffn_hidden_size, expert=False,
                                              name=name_prefix + "shared_expert.", **kw)
            full = torch.empty(1, hidden_size, device=device)
            init(name_prefix + "shared_expert_gate.weight")(full)
            self.shared_expert_gate = _Weight(full.to(dtype or torch.get_default_dtype()))
            mark_replicated(self.shared_expert_gate.weight)
        self.dispatcher = make_dispatcher(dispatcher, num_experts=num_experts, ep_group=ep_group)
        self.last_stats = self.last_aux_loss = self.last_z_loss = None
        self.last_dropped_fraction = 0.0
        self.layer_name = name_prefix.rstrip(".")  # "layers.{i}.mlp" (global index): the metrics' key
        self.step_load: torch.Tensor | None = None  # (E + 4,) fp64, see the module docstring

    def _run_experts(self, rows: torch.Tensor, counts: list) -> torch.Tensor:
        """This rank's experts over ``rows`` sorted by local expert; TP-reduced output rows (n, h).
        An expert with no rows still runs (on zero rows), so every expert parameter gets a gradient."""
        rows = copy_to_tp(rows, self.tp_group)
        if self.expert_gemm == "reference" or (self.expert_gemm == "auto" and not rows.is_cuda):
            outs, start = [], 0
            for expert, n in zip(self.experts.values(), counts):  # a loop over experts, not tokens
                outs.append(expert(rows[start:start + n]))  # (n_e, h)
                start += n
            out = torch.cat(outs, dim=0)  # (n, h)
        else:  # one grouped GEMM per projection (engine/ops/grouped_gemm.py) over stacked expert weights
            fc1 = torch.stack([e.fc1.weight for e in self.experts.values()])  # (E_local, 2f/tp, h)
            fc2 = torch.stack([e.fc2.weight for e in self.experts.values()])  # (E_local, h, f/tp)
            gate, up = grouped_mm(rows, fc1, counts, backend=self.expert_gemm).chunk(2, dim=-1)  # (n, f/tp) each
            out = grouped_mm(F.silu(gate) * up, fc2, counts, backend=self.expert_gemm)  # (n, h)
        return reduce_from_tp(out, self.tp_group)  # (n, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            # Routing needs every token on every TP rank; the gradient that comes back is replicated.
            x = gather_from_sp(x, self.tp_group, grad_is_partial=False)  # (s, b, h)
        s, b, h = x.shape
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
            shared = reduce_from_tp(self.shared_expert(copy_to_tp(tokens, self.tp_group)), self.tp_group)  # (T, h)
            out = out + torch.sigmoid(F.linear(tokens, self.shared_expert_gate.weight)) * shared
        self.last_aux_loss = self._aux_loss(self.last_stats)
        self.last_z_loss = z_loss(routing.logits)
        if self.training:  # the step's load (metrics); a recomputed forward adds again, ratios stay exact
            extra = torch.tensor([0.0, float(dropped), float(routing.indices.numel()), 1.0], dtype=torch.float64,
                                 device=x.device)
            extra[0] = self.last_aux_loss.detach().double()
            row = torch.cat([self.last_stats.counts.detach().double(), extra])  # (E + 4,)
            self.step_load = row if self.step_load is None else self.step_load + row
        if torch.is_grad_enabled() and (self.aux_loss_coef or self.z_loss_coef):
            loss = self.aux_loss_coef * self.last_aux_loss + self.z_loss_coef * self.last_z_loss
            out = AuxLossInjector.apply(out, loss, self.aux_loss_scale)
        out = out.view(s, b, h)  # (s, b, h)
        return scatter_to_sp(out, self.tp_group) if self.sequence_parallel else out

    def _aux_loss(self, stats) -> torch.Tensor:
        """The layer's load-balancing loss; under context parallelism with the assignment shares of the whole
        sequences (summed over cp, no gradient) and this rank's probabilities (equal token counts per cp rank,
        as the zigzag split gives)."""
        if self.cp_group is None or self.cp_group.size == 1:
            return load_balancing_loss([stats], num_experts=self.num_experts)
        counts = stats.counts.detach().clone()  # (E,)
        comm.all_reduce(counts, self.cp_group)
        rows = float(stats.tokens)
        return self.num_experts * torch.sum((counts / (rows * self.cp_group.size)) * (stats.prob_sum / rows))

    def extra_repr(self) -> str:
        last = self.first_expert + self.num_local_experts - 1
        return (f"experts={self.num_experts} (local {self.first_expert}..{last}), top_k={self.top_k}, "
                f"ep={self.ep_group.size}, tp={self.tp_group.size}")
