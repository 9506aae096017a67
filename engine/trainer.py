"""The training loop: steps, evaluation, logging, and the save and stop policy.

The parts come from the assembly line (:func:`engine.assembly.build_run`): the mesh, this rank's model
chunks (one per virtual pipeline stage), data parallelism, the optimizer and the schedule. A stage
module follows the models/ contract: ``forward(input, *, labels=None, position_ids=None,
loss_mask=None)`` takes token ids (b, s) on the first stage or the hidden state (s, b, h)
(``(s/tp, b, h)`` with sequence parallelism) elsewhere, and returns the hidden state, or on the last
stage the per-token loss (b, s) already multiplied by ``loss_mask``.

One step: every pipeline rank loads the same ``m`` micro-batches of its dp slice, runs its action
list (:func:`parallel.pipeline.runtime.run_schedule`), sums the tied embedding gradients over the
embedding group, and the optimizer finishes the (bucketed, overlapped) data-parallel reduction,
clips by the global norm and steps.

The loss is normalised by the loss tokens of the GLOBAL batch (every micro-batch, pipeline and
data-parallel rank): micro-batch ``i`` with ``n_i`` loss tokens backpropagates its token mean times
``w_i = n_i * m * dp / N`` (the runtime divides by ``m``, data parallelism averages over ``dp``), so
the gradient is that of ``sum(token losses) / N``; the logged loss is that same number. With equal
counts every ``w_i`` is exactly 1.0.
"""
from __future__ import annotations

import contextlib
import math
import signal
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine import metrics as M
from engine.config import TesselConfig
from engine.optim import NonFiniteGradError, Optimizer
from parallel import comm
from parallel.context_parallel import shard_micro_batch
from parallel.data_parallel import DataParallel
from parallel.expert_parallel.metrics import MoEMetrics
from parallel.mesh import Mesh
from parallel.pipeline import Schedule
from parallel.pipeline.runtime import allreduce_tied_embedding_grads, check_stage_shapes, run_schedule
from parallel.tensor_parallel.fp8 import fp8_weight_casts, update_fp8, weight_casts_enabled


@dataclass
class StepStats:
    step: int
    loss: float
    lr: float
    grad_norm: float
    applied: bool
    seconds: float
    comm_bytes: dict[str, float] | None = None  # bytes this rank sent during the step, per mesh axis
    comm_exposed: dict[str, float] | None = None  # seconds blocked in communication (nothing computed under it), per axis
    outer: dict[str, float] | None = None  # DiLoCo: the outer step's norm and sync count on steps that synced
    extra: dict[str, float] | None = None  # the objective's step metrics (post-training: rewards, margins, ...)

    @property
    def comm_exposed_s(self) -> float:
        return sum((self.comm_exposed or {}).values())


class Trainer:
    """Runs the loop over parts built by :func:`engine.assembly.build_run`; owns the step counters."""

    def __init__(self, cfg: TesselConfig, *, mesh: Mesh, chunks: torch.nn.ModuleList, stages: list[int],
                 num_stages: int, ddp: DataParallel, optimizer: Optimizer, schedule: Schedule,
                 eval_schedule: Schedule,
                 act_shape: tuple[int, int, int], flops_per_step: float, logger: M.MetricsLogger,
                 peak: tuple[float, str], param_spec: Callable | None = None, plan_line: str | None = None,
                 objective=None, rows_per_sample: int = 1, memory=None,
                 flops_per_step_causal: float | None = None, run_dir: str | None = None):
        self.cfg = cfg
        self.mesh = mesh
        self.dp = mesh.dims.dp
        self.rank = mesh.rank
        self.pp_rank = mesh.coords["pp"]
        self.chunks = chunks
        self.my_stages = stages
        self.num_stages = num_stages
        self.ddp = ddp
        self.optimizer = optimizer
        self.schedule = schedule
        self.eval_schedule = eval_schedule  # forward only, same pp/vp/microbatches
        self.num_micro = schedule.microbatches
        self.act_shape = act_shape
        self.flops_per_step = flops_per_step
        # causal attention counted as half (Megatron-Core's count): the logged mfu_causal (docs/metrics.md)
        self.flops_per_step_causal = flops_per_step if flops_per_step_causal is None else flops_per_step_causal
        self.run_dir = run_dir  # logging.profile_steps writes its traces under it (engine/profiling.py)
        self.logger = logger
        self.peak_tflops, self.peak_source = peak
        self.param_spec = param_spec  # checkpoint keys of the chunks' parameters (from models/)
        self.plan_line = plan_line
        # The step's loss on the last stage (None: the mean token loss). Post-training objectives
        # (engine/posttrain/objectives.py) map the per-token losses of a micro-batch to the sum of their
        # loss over its ``units`` and accumulate their own metrics, reduced once per step.
        self.objective = objective
        self.rows_per_sample = rows_per_sample  # rows of the micro-batch per sample (a preference pair: 2)
        # engine.memory.MemoryPrediction: logged at start-up; this process's first step is measured beside it.
        self.memory = memory
        self._memory_measured = False
        self._stats: dict[str, torch.Tensor] = {}
        # Everything this rank feeds the model or hands to a collective lives on the model's device
        # (CUDA under NCCL); the data loaders produce CPU tensors.
        self.device = next(chunks.parameters()).device
        self.dtype = next(chunks.parameters()).dtype
        # Tied embedding copies whose gradients the embedding group sums (frozen ones, under LoRA, have none).
        self.tied = [q for q in chunks.parameters() if getattr(q, "shared_embedding", False) and q.requires_grad]
        # Mixture-of-experts layers inject their router losses' gradient themselves (not through the loss the
        # runtime divides by the micro-batch count): scale it so the step sees the micro-batches' mean.
        for mod in chunks.modules():
            if hasattr(mod, "aux_loss_scale"):
                mod.aux_loss_scale = 1.0 / self.num_micro
        # Per MoE layer: expert load, aux loss and dropped share in metrics.jsonl (None: no MoE layer anywhere).
        self.moe_metrics = MoEMetrics.maybe(chunks, pp_group=mesh.pp, dp_group=mesh.dp_cp, device=self.device)
        # A rank receives activations if any of its virtual stages is not stage 0 (with vp > 1,
        # pipeline rank 0 also runs stage pp, fed by the last rank).
        receives = any(s > 0 for s in stages)
        check_stage_shapes(mesh.pp, in_shape=act_shape if receives else None, out_shape=act_shape,
                           vp=cfg.parallel.vp, device=self.device)
        self.step = 0
        self.consumed_samples = 0
        self.skipped_streak = 0  # consecutive steps skipped for a non-finite gradient norm (optim.max_skipped_steps)
        self._stop_signal: int | None = None
        self.watchdog = None  # engine.watchdog.Watchdog (fault.hang_timeout_s): set and armed by engine.assembly.Run
        self._nonfinite_streak = False  # fault.nan_replay: the current run of non-finite steps was replayed
        self.nonfinite_report: dict | None = None  # the last replay's findings (engine/nan_locate.py)
        self.straggler = None  # fault.straggler_ratio: per-rank step and compute times, compared every log step
        self.outer = None  # parallel.data_parallel.outer.OuterOptimizer (outer.method != 'none'): set by engine.assembly
        self._local_units = None  # this replica's loss units when _loss_weights normalised locally (DiLoCo)
        self._outer_last: dict[str, float] = {}  # the latest sync's metrics, logged at every log step
        if cfg.fault.straggler_ratio is not None:
            from engine.straggler import StragglerMonitor

            self.straggler = StragglerMonitor(ratio=cfg.fault.straggler_ratio, group=mesh.world, pp_rank=self.pp_rank,
                                              device=self.device)
        fp8 = cfg.model.fp8
        backend = "-te" if cfg.model.fp8_backend == "te" else ""  # Transformer Engine's GEMMs (docs/fp8.md)
        self.precision = cfg.model.dtype if fp8 == "none" else f"fp8-{fp8}{backend}/{cfg.model.dtype}"
        # model.fp8_weight_cache: each FP8 weight cast once per step (and per evaluation), not per micro-batch
        zero = cfg.optim.zero_stage if cfg.optim.distributed else 0
        self.fp8_weight_cache = fp8 != "none" and weight_casts_enabled(cfg.model.fp8_weight_cache, zero_stage=zero,
                                                                       cuda_graph=cfg.model.cuda_graph)
        # model.cuda_graph: each stage's layers replayed as CUDA graphs in training (models/cuda_graphs.py)
        self.layer_graphs = []
        if cfg.model.cuda_graph != "none":
            for chunk in chunks:
                if not hasattr(chunk, "enable_cuda_graphs"):
                    raise ValueError(f"model.cuda_graph={cfg.model.cuda_graph!r}: this model's chunk "
                                     f"({type(chunk).__name__}) has no transformer layers to capture; set "
                                     "model.cuda_graph='none'")
                chunk.enable_cuda_graphs()
                self.layer_graphs.append(chunk.layer_graphs)

    # -- state (the checkpoint composes it) ------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples, "skipped_streak": self.skipped_streak}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.consumed_samples = int(state["consumed_samples"])
        # saves go on during a streak of skipped steps: a restart inside one keeps counting it
        self.skipped_streak = int(state.get("skipped_streak", 0))  # 0: written before the streak was kept

    def rng_state(self) -> dict:
        """This rank's random streams: torch's generators and each chunk's TP-aware tracker."""
        state = {"torch_cpu": torch.get_rng_state(),
                 "trackers": [m.rng.get_states() if hasattr(m, "rng") else {} for m in self.chunks]}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = torch.cuda.get_rng_state()
        return state

    def load_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["torch_cpu"])
        if "torch_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["torch_cuda"])
        for m, tracker_state in zip(self.chunks, state["trackers"]):
            if hasattr(m, "rng") and tracker_state:
                m.rng.set_states(tracker_state)

    def layout(self) -> dict:
        """The parallel layout that decides whether per-rank state (RNG) can be restored as is."""
        d = self.mesh.dims
        return {"dp": d.dp, "pp": d.pp, "tp": d.tp, "cp": d.cp, "ep": d.ep, "vp": self.cfg.parallel.vp,
                "order": "-".join(self.mesh.order), "zero": bool(self.ddp.sharded), "world_size": self.mesh.world_size}

    # -- one step --------------------------------------------------------------------------------------
    def _loss_weights(self, micro: list[dict[str, torch.Tensor]], *, local: bool = False) -> list[float]:
        """``w_i = n_i * m * dp / N`` per micro-batch (see the module docstring); one SUM all-reduce of
        one float64 over the data-parallel ranks (every pipeline rank of a dp slice loads the same data).
        The counts stay on the device until the weights are done: one host sync per step, not one per
        micro-batch.

        ``local`` (DiLoCo's inner steps: no dp reduction, each replica steps on its own gradient): each
        replica normalises by its own loss units ``n_r``, ``w_i = n_i * m / n_r``, as a run of its own would,
        so a replica with fewer loss tokens does not take a smaller step. No collective: the global count is
        needed only for the logged loss, which :meth:`_global_mean_loss` reduces after the step (a blocking
        dp all-reduce before the forward costs a round trip per inner step on a slow link)."""
        counts = torch.stack([self._units(mb) for mb in micro]).to(torch.float64)  # (m,)
        own = counts.sum().reshape(1)  # (1,)
        if local:
            both = torch.cat([torch.where(own > 0, counts * len(micro) / own, torch.zeros_like(counts)), own]).tolist()
            self._local_units = both[-1]
            return both[:-1]
        self._local_units = None
        total = own.clone()
        comm.all_reduce(total, self.mesh.dp_cp)
        dp = self.mesh.dp_cp.size
        weights = torch.where(total > 0, counts * float(len(micro) * dp) / total, torch.zeros_like(counts))
        return weights.tolist()

    @staticmethod
    def _units(batch: dict) -> torch.Tensor:
        """What a micro-batch's loss is normalised by: its ``units`` (post-training data: loss tokens, or
        preference pairs) or, for pretraining batches, its loss tokens."""
        return batch["units"].sum() if "units" in batch else batch["loss_mask"].sum()

    def _stage_step(self, micro: list[dict[str, torch.Tensor]], on_last: Callable[[torch.Tensor, dict, int], torch.Tensor]):
        """The runtime's ``forward_step``: each chunk's input routing, and on the last stage
        ``on_last(token_losses (b, s) masked, batch, index)`` turns the per-token losses into the scalar."""
        last = self.num_stages - 1

        def step(chunk: int, x, mb: int):
            stage, batch, module = self.my_stages[chunk], micro[mb], self.chunks[chunk]
            inp = batch["tokens"] if stage == 0 else x
            # Packed documents under context parallelism (shard_micro_batch): the shards' document ids.
            docs = {"document_ids": batch["document_ids"]} if "document_ids" in batch else {}
            if stage != last:
                return module(inp, position_ids=batch["position_ids"], **docs)
            loss = module(inp, labels=batch["labels"], position_ids=batch["position_ids"],
                          loss_mask=batch["loss_mask"], **docs)  # (b, s), masked
            return on_last(loss, batch, mb)
        return step

    def _forward_step(self, micro: list[dict[str, torch.Tensor]], weights: list[float] | None = None):
        def loss_of(loss: torch.Tensor, batch: dict, mb: int) -> torch.Tensor:
            if self.objective is None:
                total = loss.sum()
            else:
                total, stats = self.objective.loss(loss, batch)
                for k, v in stats.items():
                    self._stats[k] = self._stats.get(k, 0.0) + v.detach().to(torch.float64)
            units = self._units(batch)
            # a micro-batch without loss units has total 0: divide by 1 there, by the units anywhere else (a
            # weighted loss mask may sum below 1; clamp(min=1) divided it by 1 and scaled its loss down)
            mean = total / torch.where(units > 0, units, torch.ones_like(units))
            return mean if weights is None else mean * weights[mb]
        return self._stage_step(micro, loss_of)

    def _forward_only(self, micro: list[dict[str, torch.Tensor]], step):
        """The forward-only schedule over this rank's micro-batches, in eval mode, after the parameters'
        post-step all-gather has landed."""
        self.ddp.finish_param_sync()
        self.chunks.eval()
        try:
            with fp8_weight_casts(self.chunks, self.fp8_weight_cache):  # the weights are constant here
                return run_schedule(self.eval_schedule, rank=self.pp_rank, pp_group=self.mesh.pp, forward_step=step,
                                    act_shape=self.act_shape, dtype=self.dtype, device=self.device,
                                    early_recv=self.cfg.parallel.p2p_early_recv)
        finally:
            self.chunks.train()

    def _pipeline(self, micro, *, train: bool) -> list[float]:
        weights = self._loss_weights(micro, local=train and self.ddp.local_grads)
        grad_sync = None
        if train:
            # Each chunk's buckets reduce during its own last backward (overlapped, also with vp > 1);
            # earlier micro-batches only accumulate.
            grad_sync = self.ddp.enable_grad_sync
        self.ddp.is_last_microbatch = False
        self.ddp.reset_grad_sync()
        # No weight changes during the schedule (the optimizer steps after it): FP8 casts are reused across it.
        with fp8_weight_casts(self.chunks, self.fp8_weight_cache and train):
            res = run_schedule(self.schedule, rank=self.pp_rank, pp_group=self.mesh.pp,
                               forward_step=self._forward_step(micro, weights), act_shape=self.act_shape,
                               dtype=self.dtype, device=self.device, grad_sync=grad_sync,
                               early_recv=self.cfg.parallel.p2p_early_recv)
        self.ddp.is_last_microbatch = True
        self.ddp.reset_grad_sync()
        return res.losses

    def _global_mean_loss(self, losses: list[float]) -> float:
        """The global batch's token-weighted loss, known on every rank: the weighted micro-batch means
        summed over pp and dp, divided by the number of micro-batches in the global batch. Under local
        normalisation (:meth:`_loss_weights` ``local``) this rank's weighted sum times ``n_r / m`` is its
        token-loss sum: those sums and the replicas' units (counted once, on the stage holding the losses)
        are summed instead, and divided."""
        if self._local_units is not None:
            units = self._local_units if losses else 0.0
            t = torch.tensor([sum(losses) * units / max(len(losses), 1), units], dtype=torch.float64,
                             device=self.device)
        else:
            t = torch.tensor([sum(losses), float(len(losses))], dtype=torch.float64, device=self.device)
        comm.all_reduce(t, self.mesh.pp)  # only the last stage has losses
        comm.all_reduce(t, self.mesh.dp_cp)
        return float(t[0] / t[1]) if float(t[1]) > 0 else 0.0

    def _to_device(self, batch: dict) -> dict:
        """A loader's micro-batch (CPU tensors) on the model's device; under context parallelism, this cp
        rank's zigzag share of its sequences (tokens, labels, loss mask, positions, document ids)."""
        batch = shard_micro_batch(batch, self.mesh.cp)
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    def train_step(self, loader) -> StepStats:
        t0 = time.perf_counter()
        sent_before = self.mesh.ledger.by_axis()
        blocked_before = self.mesh.ledger.blocked_s  # a copy
        self.optimizer.zero_grad()
        if self.outer is not None:  # DiLoCo: this step's gradients all-reduced (warm-up) or kept local
            self.outer.begin_step(self.step + 1)
        micro = [self._to_device(next(loader)) for _ in range(self.num_micro)]
        losses = self._pipeline(micro, train=True)
        allreduce_tied_embedding_grads(self.tied, self.mesh.embedding)
        try:
            result = self.optimizer.step()
        except NonFiniteGradError:  # optim.nonfinite = "stop": say where it started, then stop
            self._localise_nonfinite(micro, finite=False)
            raise
        # delayed scaling: one amax all-reduce per axis; DiLoCo's inner steps keep each replica's own (no dp traffic)
        update_fp8(self.chunks, (self.mesh.tp,) if self.ddp.local_grads else (self.mesh.tp, self.mesh.dp_cp))
        outer = (self.outer.step(self.step + 1, final=self.step + 1 == self.cfg.train.steps)  # DiLoCo: sync when due
                 if self.outer is not None else None)
        if outer:
            self._outer_last = outer
        loss = self._global_mean_loss(losses)
        extra = self._objective_metrics()
        if self.moe_metrics is not None:  # one all-reduce over pp and one over dp of the layers' step load
            extra = {**(extra or {}), **self.moe_metrics.step(applied=result.applied)}
        self._localise_nonfinite(micro, finite=math.isfinite(loss) and math.isfinite(result.grad_norm))
        self.step += 1
        self.consumed_samples += self.cfg.train.global_batch_size
        sent = self.mesh.ledger.by_axis()
        comm_bytes = {axis: sent[axis] - sent_before.get(axis, 0.0) for axis in sent}
        return StepStats(step=self.step, loss=loss, lr=result.lr, grad_norm=result.grad_norm,
                         applied=result.applied, seconds=time.perf_counter() - t0, comm_bytes=comm_bytes,
                         comm_exposed={a: v - blocked_before.get(a, 0.0) for a, v in self.mesh.ledger.blocked_s.items()},
                         extra=extra, outer=outer or None)

    def _localise_nonfinite(self, micro, *, finite: bool) -> None:
        """``fault.nan_replay``: the first step of each run of non-finite steps (the loss or the gradient norm,
        both global: every rank agrees) is replayed with hooks that name the first non-finite layer, tensor
        and rank (engine/nan_locate.py)."""
        if finite or not self.cfg.fault.nan_replay:
            self._nonfinite_streak = False
            return
        if self._nonfinite_streak:
            return
        self._nonfinite_streak = True
        from engine.nan_locate import localise_nonfinite

        with contextlib.ExitStack() as eager:  # the replay's module hooks need the layers run eagerly
            for graphs in self.layer_graphs:
                eager.enter_context(graphs.suspended())
            self.nonfinite_report = localise_nonfinite(self, micro)

    def _measured_step(self, loader) -> StepStats:
        """This process's first step under :class:`engine.memory.PeakMemory` (the others run plainly); rank 0
        logs the measured peak (state bytes + the step's peak above them, the largest rank of each pipeline
        stage: one all-gather over the world) beside the prediction."""
        from engine.memory import PeakMemory, measured_report, state_bytes

        self._memory_measured = True
        with PeakMemory(self.device) as peak:
            st = self.train_step(loader)
        row = torch.tensor([float(self.pp_rank), *map(float, state_bytes(self.chunks, self.ddp, self.optimizer,
                                                                         self.outer)),
                            float(peak.peak)], dtype=torch.float64, device=self.device)
        rows = comm.all_gather(row, self.mesh.world).view(-1, row.numel()).tolist()
        line, record = measured_report(self.memory, rows, step=self.step)
        self.logger.info(line)
        self.logger.log(record, prefix="memory", echo=False)
        return st

    def _objective_metrics(self) -> dict[str, float] | None:
        """The objective's metrics of the step (or evaluation) just run: its sums from every last stage,
        reduced in one all-reduce over pp and one over dp, then turned into means by the objective."""
        if self.objective is None:
            return None
        names = self.objective.STATS
        t = torch.stack([torch.as_tensor(self._stats.get(k, 0.0), dtype=torch.float64, device=self.device)
                         for k in names])  # (len(STATS),)
        self._stats = {}
        comm.all_reduce(t, self.mesh.pp)
        comm.all_reduce(t, self.mesh.dp_cp)
        return self.objective.metrics(dict(zip(names, t.tolist())))

    @torch.no_grad()
    def evaluate(self, loader, iters: int, *, metrics: dict | None = None) -> float:
        """Mean over ``iters`` global batches of ``loader`` of each batch's token-weighted loss: the
        forward-only schedule, pipelined across micro-batches, through the same runtime as training."""
        losses = []
        for _ in range(iters):
            micro = [self._to_device(next(loader)) for _ in range(self.num_micro)]
            losses += self._forward_only(micro, self._forward_step(micro, self._loss_weights(micro))).losses
        loss = self._global_mean_loss(losses)
        extra = self._objective_metrics()
        if metrics is not None and extra:
            metrics.update(extra)
        return loss

    @torch.no_grad()
    def forward_token_losses(self, micro: list[dict[str, torch.Tensor]],
                             on_last: Callable[[torch.Tensor, dict, int], None]) -> None:
        """One forward-only pass over ``micro`` (this rank's micro-batches, as many as the schedule's)
        through the pipeline; on the last stage ``on_last(token_losses (b, s), batch, index)`` receives
        each micro-batch's per-token losses (masked by its ``loss_mask``). For quantities computed once
        from the model, e.g. DPO's reference log-probabilities (collective over pp)."""
        if len(micro) != self.num_micro:
            raise ValueError(f"forward_token_losses takes {self.num_micro} micro-batches (the schedule's), got {len(micro)}")
        micro = [self._to_device(mb) for mb in micro]

        def last(loss, batch, mb):
            on_last(loss, batch, mb)
            return loss.sum() * 0.0
        self._forward_only(micro, self._stage_step(micro, last))

    # -- the loop -------------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> dict:
        """SIGTERM/SIGINT set a flag the loop reads; returns the handlers they replace (restored when
        :meth:`train` returns: a handler left installed would keep this trainer, and its model, alive)."""
        def handler(signum, frame):
            self._stop_signal = signum
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.getsignal(sig)
            signal.signal(sig, handler)
        return previous

    def _stop_requested(self) -> bool:
        """All ranks agree (max over the world) so they stop after the same step."""
        flag = torch.tensor([1.0 if self._stop_signal is not None else 0.0], device=self.device)
        comm.all_reduce(flag, self.mesh.world, op="max")
        return bool(flag.item())

    def log_start(self) -> None:
        c, p = self.cfg, self.cfg.parallel
        cp = f" x cp {p.cp} ({p.cp_comm}, {c.train.seq_length // p.cp} tokens per rank)" if p.cp > 1 else ""
        extras = [f"ep {p.ep}" + (f", expert_tp {p.expert_tp_size}" if p.expert_tp_size != p.tp else "")
                  + f", {p.moe_dispatcher}"] if p.ep > 1 else []
        if p.tp_overlap != "none":
            extras.append(f"tp_overlap {p.tp_overlap}")
        if c.optim.grad_compression != "none":
            whole = 0
            if c.optim.grad_compression == "powersgd":  # r (m + n) >= m n: sent uncompressed; every stage's
                n = torch.tensor([len(self.ddp.grad_compressor.uncompressed_matrices())], device=self.device)
                comm.all_reduce(n, self.mesh.pp)  # (1,): every rank calls log_start
                whole = int(n.item())
            extras.append(f"grad_compression {c.optim.grad_compression}"
                          + (f" rank {c.optim.powersgd_rank}" if c.optim.grad_compression == "powersgd" else "")
                          + (f", {whole} matrices too small to compress sent whole (TP-local shapes, all pipeline "
                             "stages)" if whole else ""))
        self.logger.info(
            f"tessel: world {self.mesh.world_size} = dp {self.dp} x pp {p.pp} x tp {p.tp}{cp}"
            f" (vp {p.vp}, schedule {p.schedule}, sp {p.sequence_parallel and p.tp > 1}"
            f"{''.join('; ' + e for e in extras)}),"
            f" {self.num_micro} micro-batches of {c.train.micro_batch_size} x {c.train.seq_length} per rank per step")
        if self.plan_line:
            self.logger.info(self.plan_line)
        if self.outer is not None:
            self.logger.info(self.outer.describe())
        if self.memory is not None:
            self.logger.info(self.memory.line())
            self.logger.log(self.memory.record(), prefix="memory", echo=False)
        with self.ddp.full_shapes():  # ZeRO-3: the full parameters this rank's model holds (as shards)
            n_params = sum(q.numel() for q in self.chunks.parameters())
        self.logger.info(f"tessel: rank 0 holds {n_params:,} parameters; model FLOPs/step "
                         f"{self.flops_per_step:.3e}; peak {self.peak_tflops:.3f} TFLOP/s per device "
                         f"({self.peak_source}); precision {self.precision} (MFU is against that peak)")

    def _stragglers(self) -> dict:
        """The straggler metrics of the log interval just ended (``fault.straggler_ratio``; {} when off);
        rank 0 logs the line naming the slow ranks."""
        if self.straggler is None:
            return {}
        found = self.straggler.gather(step=self.step)
        line = found.pop("line")
        if line:
            self.logger.info(line)
        return found

    def _check_diverged(self, skipped: int) -> None:
        """RunStopped (on every rank: the norm is global) once more than ``optim.max_skipped_steps``
        consecutive steps were skipped. Nothing is saved: the newest checkpoint stays the one to resume."""
        limit = self.cfg.optim.max_skipped_steps
        if limit is None or skipped <= limit:
            return
        from engine.fault import RunStopped

        self.logger.close()
        raise RunStopped(f"stopped at step {self.step}: {skipped} consecutive steps ({self.step - skipped + 1}-"
                         f"{self.step}) had a non-finite gradient norm and were skipped, more than "
                         f"optim.max_skipped_steps={limit}: the run diverged; resume from a checkpoint before the "
                         "divergence with a lower optim.lr or more optim.warmup_steps, or raise optim.max_skipped_steps")

    def train(self, train_loader, valid_loader=None, *, on_step: Callable[["Trainer", StepStats], None] | None = None,
              save: Callable[["Trainer"], None] | None = None, keep_history: bool = True) -> list[StepStats]:
        """Run until ``train.steps`` (or ``train.max_tokens``) or a stop signal; returns the step stats.

        ``keep_history=False`` returns ``[]`` and keeps nothing per step: the stats of every step cost about
        0.5-0.9 KB of host memory each (2026-11-28, tracemalloc), a growth without bound over a long run.
        The torchrun jobs (tools/pretrain.py, tools/posttrain.py) train that way; ``on_step`` sees each step's
        stats either way."""
        previous = self._install_signal_handlers()
        try:
            return self._train(train_loader, valid_loader, on_step=on_step, save=save, keep_history=keep_history)
        finally:
            for sig, h in previous.items():
                signal.signal(sig, h)

    def _train(self, train_loader, valid_loader, *, on_step, save, keep_history) -> list[StepStats]:
        c = self.cfg.train
        self.log_start()
        history, ran = [], 0
        tokens_per_step = c.global_batch_size * self.rows_per_sample * c.seq_length
        max_steps = c.last_step(self.rows_per_sample)
        from engine.profiling import StepProfiler

        profiler = StepProfiler(self.cfg.logging.profile_steps, run_dir=self.run_dir or self.cfg.train.run_dir,
                                rank=self.rank, chunks=self.chunks, device=self.device)
        try:
            while self.step < max_steps:
                with profiler.step(self.step + 1):
                    # The memory report's profiler and a profile window's cannot run at once: a resumed run whose
                    # window covers its first step is measured at the first step after the window.
                    measure = (self.memory is not None and not self._memory_measured
                               and not profiler.covers(self.step + 1))
                    st = self._measured_step(train_loader) if measure else self.train_step(train_loader)
                ran += 1
                if keep_history:
                    history.append(st)
                if self.watchdog is not None:
                    self.watchdog.beat(self.step)
                if self.straggler is not None:
                    self.straggler.add(step_s=st.seconds, comm_blocked_s=st.comm_exposed_s)
                if self.step % c.log_interval == 0 or self.step == max_steps or self.step == 1:
                    tflops = self.flops_per_step / st.seconds / self.mesh.world_size / 1e12
                    slow = self._stragglers()  # every rank: one all-gather over the world
                    self.logger.log({"step": st.step, "loss": st.loss, "lr": st.lr, "grad_norm": st.grad_norm,
                                     "tokens_per_s": tokens_per_step / st.seconds, "tflops_per_device": tflops,
                                     "mfu": tflops / self.peak_tflops, "precision": self.precision,
                                     "mfu_causal": self.flops_per_step_causal / st.seconds / self.mesh.world_size / 1e12
                                     / self.peak_tflops,
                                     "mem_bytes": M.memory_bytes(),
                                     "step_time_s": st.seconds, "comm_exposed_s": st.comm_exposed_s,
                                     **{f"comm_exposed_s_{a}": v for a, v in sorted((st.comm_exposed or {}).items())},
                                     "skipped": 0 if st.applied else 1,
                                     "consumed_samples": self.consumed_samples, **(st.extra or {}), **self._outer_last,
                                     **({"outer_phase": self.outer.phase_name(self.step)} if self.outer else {}),
                                     **{f"comm_bytes_{axis}": b for axis, b in sorted((st.comm_bytes or {}).items())},
                                     **slow})
                if self.outer is not None and self.step == self.outer.start_step:
                    self.logger.info(f"tessel: steps 1-{self.step} ran as plain data parallelism (outer.start_step); "
                                     f"{self.outer.method} starts now from these weights")
                self.skipped_streak = 0 if st.applied else self.skipped_streak + 1
                self._check_diverged(self.skipped_streak)
                if on_step is not None:
                    on_step(self, st)
                if valid_loader is not None and c.eval_interval and self.step % c.eval_interval == 0:
                    extra: dict = {}
                    vl = self.evaluate(valid_loader, c.eval_iters, metrics=extra)
                    ppl = {"ppl": math.exp(min(vl, 50.0))} if self.objective is None else {}  # a token loss only
                    self.logger.log({"step": self.step, "loss": vl, **ppl, **extra}, prefix="valid")
                ck = self.cfg.checkpoint
                stop = self._stop_requested()
                if save is not None and ((ck.interval and self.step % ck.interval == 0) or stop
                                         or self.step == max_steps):
                    save(self)
                    if self.watchdog is not None:
                        self.watchdog.beat()  # a save's disk writes are progress too
                if stop:
                    name = signal.Signals(self._stop_signal).name if self._stop_signal else "a signal on another rank"
                    self.logger.info(f"tessel: stopping after step {self.step} on {name}"
                                     + (" (checkpoint saved)" if save is not None else ""))
                    break
        except BaseException:  # a diverged run, a failed save: the window stops, writing nothing
            profiler.abort()
            raise
        profiler.close()
        if self.memory is not None and not self._memory_measured and ran:
            self.logger.info("tessel: memory: not measured: every step this process ran was inside "
                             "logging.profile_steps (the report measures a step outside the window)")
        self.ddp.finish_param_sync()
        self.logger.close()
        return history

