"""Optimizer state over the data-parallel buffers: fp32 master weights and Adam moments, sharded or not.

:class:`DistributedOptimizer` owns, for the range of each bucket that this rank updates (1/dp of the
bucket with ``zero_stage >= 1``, all of it with ``zero_stage=0``):

* fp32 master weights: a fresh fp32 buffer when the parameters are bf16/fp16; when they are fp32 the
  master *is* the parameter buffer's range (no copy: 4 bytes per element saved);
* ``exp_avg`` and ``exp_avg_sq`` (fp32), in one flat buffer each.

Optimizer-state bytes on a rank: ``(4 + 4 + 4) * S`` with mixed precision and ``(4 + 4) * S`` for
fp32 parameters, where ``S = sum(bucket.numel) / dp`` (sharded; ``S`` includes the padding that
makes buckets divisible by dp) or the whole padded buffer (``zero_stage=0``).

A step (:meth:`step`) runs the injected AdamW ``update_fn`` on the owned pieces, copies the
masters into the (lower-precision) parameter buffer and, when sharded, all-gathers the parameters
(:meth:`DataParallel.start_param_sync`, optionally overlapped with the next forward). The update
rule, learning-rate schedule, clipping and non-finite handling live in ``engine/optim.py``, which
builds this object: the parallel package stays free of policy.

Each owned range is cut at parameter boundaries into :class:`Piece` s so that per-parameter
attributes (weight decay group, name, ``tensor_parallel``, ``shared_embedding``) stay attached.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from parallel.data_parallel.buffers import GRAD_DTYPE, Bucket, ParamAndGradBuffer
from parallel.data_parallel.ddp import DataParallel

# update_fn(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step):
# the signature of engine/ops fused_adamw_ (without bf16_out); updates params/moments in place.
UpdateFn = Callable[..., None]


@dataclass(eq=False)
class Piece:
    """The part ``[lo, hi)`` (flattened) of parameter ``param`` that this rank updates.

    ``master``, ``grad``, ``exp_avg``, ``exp_avg_sq`` are fp32 views of length ``hi - lo``;
    ``model`` is the same range of the parameter itself (its dtype, a view into the param buffer).
    """

    name: str
    param: torch.nn.Parameter
    lo: int
    hi: int
    group: int
    model: torch.Tensor
    master: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class DistributedOptimizer:
    """AdamW state for the parameters of ``ddp``, sharded over its dp group when ``ddp.sharded``.

    ``param_groups``: a list of dicts ``{"params": [...], "weight_decay": float, "lr_mult": float
    (optional, default 1)}``; every trainable parameter of ``ddp`` must be in exactly one group.
    ``update_fn`` is the AdamW kernel (``engine.optim.adamw_update``). ``update_writes_bf16``: the
    kernel accepts ``bf16_out=`` and writes the updated bf16 parameters in the same pass (the engine's
    fused op), so bf16 buffers skip the separate master-to-parameter copy.
    """

    def __init__(self, ddp: DataParallel, *, param_groups: Sequence[dict], update_fn: UpdateFn,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, update_writes_bf16: bool = False):
        self.ddp = ddp
        self.update_fn = update_fn
        self.update_writes_bf16 = update_writes_bf16
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.groups = [{"weight_decay": float(g.get("weight_decay", 0.0)), "lr_mult": float(g.get("lr_mult", 1.0))}
                       for g in param_groups]
        group_of: dict[int, int] = {}
        for gi, g in enumerate(param_groups):
            for p in g["params"]:
                if id(p) in group_of:
                    raise ValueError(f"parameter {ddp.param_names.get(id(p), '?')!r} is in param groups "
                                     f"{group_of[id(p)]} and {gi}; put each parameter in exactly one group")
                group_of[id(p)] = gi
        missing = [ddp.param_names[k] for k in ddp.param_names if k not in group_of]
        if missing:
            raise ValueError(f"parameters {missing[:5]} (of {len(missing)}) are in no param group; every "
                             "trainable parameter of the wrapped module needs a group")
        unknown = [k for k in group_of if k not in ddp.param_names]
        if unknown:
            raise ValueError(f"{len(unknown)} parameter(s) in param_groups are not trainable parameters of the "
                             "wrapped module; build the groups from ddp.module.named_parameters()")
        self.pieces: list[Piece] = []
        # Per bucket: (buffer, bucket, master, exp_avg, exp_avg_sq, master_is_param_buffer)
        self.owned: list[tuple[ParamAndGradBuffer, Bucket, torch.Tensor, torch.Tensor, torch.Tensor, bool]] = []
        self._state_tensors: list[torch.Tensor] = []
        for buf in ddp.flat_buffers:
            self._build_buffer_state(buf, group_of)
        self.step_count = 0

    def _build_buffer_state(self, buf: ParamAndGradBuffer, group_of: dict[int, int]) -> None:
        ddp = self.ddp
        owned_total = sum(hi - lo for lo, hi in (ddp.owned_range(b) for b in buf.buckets))
        device = buf.device
        alias = buf.dtype == GRAD_DTYPE  # fp32 params: the parameter buffer is the master copy
        master_flat = None if alias else torch.empty(owned_total, dtype=torch.float32, device=device)
        exp_avg = torch.zeros(owned_total, dtype=torch.float32, device=device)
        exp_avg_sq = torch.zeros(owned_total, dtype=torch.float32, device=device)
        self._state_tensors += [t for t in (master_flat, exp_avg, exp_avg_sq) if t is not None]
        cursor = 0
        for b in buf.buckets:
            lo, hi = ddp.owned_range(b)
            n = hi - lo
            param_range = ddp.owned_params(buf, b)
            if alias:
                master = param_range
            else:
                master = master_flat[cursor:cursor + n]
                master.copy_(param_range)
            m, v = exp_avg[cursor:cursor + n], exp_avg_sq[cursor:cursor + n]
            self.owned.append((buf, b, master, m, v, alias))
            for p, (ps, pe) in zip(b.params, b.ranges):
                a, z = max(ps, lo), min(pe, hi)
                if a >= z:
                    continue
                self.pieces.append(Piece(
                    name=ddp.param_names[id(p)], param=p, lo=a - ps, hi=z - ps, group=group_of[id(p)],
                    model=param_range[a - lo:z - lo], master=master[a - lo:z - lo], grad=b.shard_grad[a - lo:z - lo],
                    exp_avg=m[a - lo:z - lo], exp_avg_sq=v[a - lo:z - lo]))
            cursor += n

    # -- the step ------------------------------------------------------------------------------------
    def prepare_grads(self) -> None:
        """Wait for pending parameter gathers and finish the gradient reduction (before norm/clip)."""
        self.ddp.finish_param_sync()
        self.ddp.finish_grad_sync()

    def scale_grads(self, coef: float) -> None:
        """Multiply the owned gradients by ``coef`` (gradient clipping)."""
        grads = [pc.grad for pc in self.pieces]
        if grads and coef != 1.0:
            torch._foreach_mul_(grads, coef)

    def step(self, *, lr: float) -> None:
        """One AdamW update of the owned pieces with base learning rate ``lr`` (times each group's
        ``lr_mult``), then refresh the parameters (cast + all-gather when sharded)."""
        self.step_count += 1
        beta1, beta2 = self.betas
        for gi, g in enumerate(self.groups):
            for dtype in {pc.param.dtype for pc in self.pieces}:
                sel = [pc for pc in self.pieces if pc.group == gi and pc.param.dtype == dtype]
                if not sel:
                    continue
                extra = {}
                if self.update_writes_bf16 and dtype == torch.bfloat16:
                    extra["bf16_out"] = [pc.model for pc in sel]
                self.update_fn([pc.master for pc in sel], [pc.grad for pc in sel], [pc.exp_avg for pc in sel],
                               [pc.exp_avg_sq for pc in sel], lr=lr * g["lr_mult"], beta1=beta1, beta2=beta2,
                               eps=self.eps, weight_decay=g["weight_decay"], step=self.step_count, **extra)
        self.refresh_params(copy=not self.update_writes_bf16)

    def refresh_params(self, *, copy: bool = True) -> None:
        """Copy the fp32 masters into the parameter buffers (cast) and start the all-gather when
        sharded (also the way to apply masters loaded from a checkpoint). ``copy=False`` skips the
        copy for bf16 buffers (the kernel already wrote them)."""
        with torch.no_grad():
            for buf, b, master, _, _, alias in self.owned:
                if not alias and (copy or buf.dtype != torch.bfloat16):
                    self.ddp.owned_params(buf, b).copy_(master)
        self.ddp.start_param_sync()

    def load_masters_from_params(self) -> None:
        """Re-read the fp32 masters from the parameters (after loading model weights into them)."""
        with torch.no_grad():
            for buf, b, master, _, _, alias in self.owned:
                if not alias:
                    master.copy_(self.ddp.owned_params(buf, b))

    # -- accounting ----------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: separate fp32 masters (if any) and both moments."""
        return sum(t.numel() * t.element_size() for t in self._state_tensors)

    def owned_numel(self) -> int:
        """Elements of the buffers this rank updates (incl. padding)."""
        return sum(m.numel() for _, _, _, m, _, _ in self.owned)

    def state_shards(self) -> list[dict]:
        """This rank's optimizer state for checkpointing, per parameter buffer (one per dtype).

        Each entry: ``{"dtype", "placements": [(name, start, end)], "shards": [(start, end, {"master",
        "exp_avg", "exp_avg_sq"})], "dp_replicated"}``; ``dp_replicated`` is True when the state is not
        sharded over data parallelism (ZeRO off: every dp rank holds all of it); offsets are in the flat buffer (padding between parameters is in
        no placement), each shard is the owned range of one bucket and its state tensors are 1-D views
        of ``end - start`` fp32 elements: saving reads them, loading copies into them (then call
        :meth:`refresh_params`). Matches ``engine.checkpoint.flat_buffer_sharded_tensors``' inputs.
        """
        out = []
        for buf in self.ddp.flat_buffers:
            placements = [(self.ddp.param_names[id(p)], b.start + s, b.start + e)
                          for b in buf.buckets for p, (s, e) in zip(b.params, b.ranges)]
            shards = []
            for obuf, b, master, m, v, _ in self.owned:
                if obuf is buf:
                    lo, hi = self.ddp.owned_range(b)
                    shards.append((b.start + lo, b.start + hi, {"master": master, "exp_avg": m, "exp_avg_sq": v}))
            out.append({"dtype": buf.dtype, "placements": placements, "shards": shards,
                        "dp_replicated": not self.ddp.sharded})
        return out
