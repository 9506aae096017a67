"""The training loop over TP x PP x DP: mesh, pipeline stages, data parallelism, data, metrics.

The engine is model-agnostic: the caller (tools/pretrain.py) passes ``build_stage``, which builds
the module of one virtual pipeline stage, and a :class:`engine.metrics.FlopsSpec`. A stage module
follows the models/ contract: ``forward(input, *, labels=None, position_ids=None, loss_mask=None)``
takes token ids (b, s) on the first stage or the hidden state (s, b, h) (``(s/tp, b, h)`` with
sequence parallelism) elsewhere, and returns the hidden state, or on the last stage the per-token
loss (b, s) already multiplied by ``loss_mask``.

One step: every pipeline rank loads the same ``m`` micro-batches of its dp slice, runs its action
list (:func:`parallel.pipeline.runtime.run_schedule`), sums the tied embedding gradients over the
embedding group, and the optimizer finishes the (bucketed, overlapped) data-parallel reduction,
clips by the global norm and steps. The logged loss is the mean over the global batch.
"""
from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine import metrics as M
from engine.config import TesselConfig
from engine.optim import Optimizer
from parallel import comm
from parallel.data_parallel import DataParallel
from parallel.mesh import Mesh, ParallelDims
from parallel.pipeline import build_schedule
from parallel.pipeline.runtime import allreduce_tied_embedding_grads, check_stage_shapes, run_schedule

BuildStage = Callable[..., torch.nn.Module]  # (mesh, *, pre_process, post_process, layer_range) -> module


def split_layers(num_layers: int, num_stages: int, layout: list[int] | None = None) -> list[tuple[int, int]]:
    """Global layer range (start, end) of each virtual stage: uniform, or an explicit layout."""
    if layout:
        if len(layout) != num_stages:
            raise ValueError(f"parallel.pipeline_layout has {len(layout)} entries but the pipeline has "
                             f"pp*vp = {num_stages} virtual stages; give one layer count per stage")
        if sum(layout) != num_layers or min(layout) < 0:
            raise ValueError(f"parallel.pipeline_layout={layout} must be non-negative and sum to "
                             f"num_layers={num_layers}")
        counts = list(layout)
    else:
        if num_layers % num_stages:
            raise ValueError(f"num_layers={num_layers} does not divide across pp*vp = {num_stages} virtual stages; "
                             f"set parallel.pipeline_layout (e.g. fewer layers on the first and last stage) or "
                             f"change pp/vp")
        counts = [num_layers // num_stages] * num_stages
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


@dataclass
class StepStats:
    step: int
    loss: float
    lr: float
    grad_norm: float
    applied: bool
    seconds: float


class Trainer:
    """Builds everything from ``cfg`` for this rank and runs the loop (``train()``)."""

    def __init__(self, cfg: TesselConfig, *, build_stage: BuildStage, flops: M.FlopsSpec, num_layers: int,
                 hidden_size: int, run_dir: str | None, train_data=None, valid_data=None,
                 log_stream=None, extra_state: dict[str, Any] | None = None):
        if cfg.parallel.cp != 1:
            raise ValueError(f"parallel.cp={cfg.parallel.cp}: context parallelism is not implemented yet; use cp=1")
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.cfg = cfg
        self.dp = cfg.validate_world(world)
        p = cfg.parallel
        self.mesh = Mesh.build(ParallelDims(dp=self.dp, pp=p.pp, cp=p.cp, tp=p.tp, ep=p.ep), order=p.order)
        self.rank = self.mesh.rank
        self.pp_rank = self.mesh.coords["pp"]
        self.num_stages = p.pp * p.vp
        self.stage_ranges = split_layers(num_layers, self.num_stages, p.pipeline_layout)
        self.my_stages = [s for s in range(self.num_stages) if s % p.pp == self.pp_rank]
        torch.manual_seed(cfg.train.seed)
        self.chunks = torch.nn.ModuleList([
            build_stage(self.mesh, pre_process=s == 0, post_process=s == self.num_stages - 1, layer_range=self.stage_ranges[s])
            for s in self.my_stages])
        # Everything this rank feeds the model or hands to a collective lives on the model's device
        # (CUDA under NCCL); the data loaders produce CPU tensors.
        self.device = next(self.chunks.parameters()).device
        o = cfg.optim
        self.ddp = DataParallel(self.chunks, dp_group=self.mesh.dp_cp, tp_group=self.mesh.tp,
                                zero_stage=o.zero_stage if o.distributed else 0, bucket_size_mb=o.bucket_size_mb,
                                overlap_grad_reduce=o.overlap_grad_reduce,
                                overlap_param_gather=o.overlap_param_gather and o.distributed)
        self.optimizer = Optimizer.from_config(self.ddp, o, total_steps=cfg.train.steps, tp_group=self.mesh.tp,
                                               pp_group=self.mesh.pp)
        self.tied = [q for q in self.chunks.parameters() if getattr(q, "shared_embedding", False)]
        t = cfg.train
        self.num_micro = cfg.num_microbatches(self.dp)
        self.schedule = build_schedule(p.schedule, pp=p.pp, vp=p.vp, microbatches=self.num_micro)
        sp = p.sequence_parallel and p.tp > 1
        self.act_shape = (t.seq_length // p.tp if sp else t.seq_length, t.micro_batch_size, hidden_size)
        # A rank receives activations if any of its virtual stages is not stage 0 (with vp > 1,
        # pipeline rank 0 also runs stage pp, fed by the last rank).
        receives = any(s > 0 for s in self.my_stages)
        check_stage_shapes(self.mesh.pp, in_shape=self.act_shape if receives else None,
                           out_shape=self.act_shape, vp=p.vp, device=self.device)
        self.train_data, self.valid_data = train_data, valid_data
        self.step = 0
        self.consumed_samples = 0
        self.flops_per_step = M.model_flops_per_step(flops, batch_size=t.global_batch_size, seq_length=t.seq_length)
        self.run_dir = run_dir
        self.extra_state = extra_state or {}
        self.logger = M.MetricsLogger(run_dir, enabled=self.rank == 0, total_steps=t.steps,
                                      jsonl=cfg.logging.jsonl, tensorboard=cfg.logging.tensorboard,
                                      progress_bar=cfg.logging.progress_bar, stream=log_stream)
        dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
        self.peak_tflops, self.peak_source = M.peak_tflops(override=cfg.logging.peak_tflops, dtype=dtype)
        self._stop_signal: int | None = None

    # -- one step --------------------------------------------------------------------------------------
    def _forward_step(self, micro: list[dict[str, torch.Tensor]]):
        last = self.num_stages - 1

        def step(chunk: int, x, mb: int):
            stage = self.my_stages[chunk]
            batch = micro[mb]
            module = self.chunks[chunk]
            inp = batch["tokens"] if stage == 0 else x
            if stage != last:
                return module(inp, position_ids=batch["position_ids"])
            loss = module(inp, labels=batch["labels"], position_ids=batch["position_ids"],
                          loss_mask=batch["loss_mask"])  # (b, s), masked
            return loss.sum() / batch["loss_mask"].sum().clamp(min=1)
        return step

    def _pipeline(self, micro, *, train: bool) -> list[float]:
        grad_sync = None
        if train and self.cfg.parallel.vp == 1:
            # Reduce buckets during the last backward (overlap); earlier micro-batches only accumulate.
            def grad_sync(chunk: int) -> None:
                self.ddp.is_last_microbatch = True
        self.ddp.is_last_microbatch = False
        res = run_schedule(self.schedule, rank=self.pp_rank, pp_group=self.mesh.pp,
                           forward_step=self._forward_step(micro), act_shape=self.act_shape,
                           dtype=next(self.chunks.parameters()).dtype, device=self.device,
                           grad_sync=grad_sync)
        self.ddp.is_last_microbatch = True
        return res.losses

    def _global_mean_loss(self, losses: list[float]) -> float:
        """Mean micro-batch loss over the global batch, known on every rank (sum over pp and dp)."""
        t = torch.tensor([sum(losses), float(len(losses))], dtype=torch.float64, device=self.device)
        comm.all_reduce(t, self.mesh.pp)  # only the last stage has losses
        comm.all_reduce(t, self.mesh.dp_cp)
        return float(t[0] / t[1])

    def _to_device(self, batch: dict) -> dict:
        """A loader's micro-batch (CPU tensors) on the model's device."""
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    def train_step(self, loader) -> StepStats:
        t0 = time.perf_counter()
        self.optimizer.zero_grad()
        micro = [self._to_device(next(loader)) for _ in range(self.num_micro)]
        losses = self._pipeline(micro, train=True)
        allreduce_tied_embedding_grads(self.tied, self.mesh.embedding)
        result = self.optimizer.step()
        loss = self._global_mean_loss(losses)
        self.step += 1
        self.consumed_samples += self.cfg.train.global_batch_size
        return StepStats(step=self.step, loss=loss, lr=result.lr, grad_norm=result.grad_norm,
                         applied=result.applied, seconds=time.perf_counter() - t0)

    @torch.no_grad()
    def evaluate(self, loader, iters: int) -> float:
        """Mean loss over ``iters`` global batches of ``loader`` (forward only, stage by stage)."""
        self.ddp.finish_param_sync()
        self.chunks.eval()
        losses = []
        try:
            for _ in range(iters):
                micro = [self._to_device(next(loader)) for _ in range(self.num_micro)]
                losses += self._forward_only(micro)
        finally:
            self.chunks.train()
        return self._global_mean_loss(losses)

    def _forward_only(self, micro) -> list[float]:
        pp, last = self.cfg.parallel.pp, self.num_stages - 1
        dtype = next(self.chunks.parameters()).dtype
        step = self._forward_step(micro)
        losses = []
        for mb in range(len(micro)):
            x = None
            for s in range(self.num_stages):  # a chain: each owner receives, computes, sends
                owner = s % pp
                if owner != self.pp_rank:
                    continue
                if s > 0 and (s - 1) % pp != self.pp_rank:
                    x = comm.recv(torch.empty(self.act_shape, dtype=dtype, device=self.device), self.mesh.pp,
                                  src=(s - 1) % pp)
                out = step(self.my_stages.index(s), x, mb)
                if s == last:
                    losses.append(float(out))
                elif (s + 1) % pp != self.pp_rank:
                    comm.send(out, self.mesh.pp, dst=(s + 1) % pp)
                else:
                    x = out
        return losses

    # -- the loop -------------------------------------------------------------------------------------
    def _install_signal_handlers(self):
        def handler(signum, frame):
            self._stop_signal = signum
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)

    def _stop_requested(self) -> bool:
        """All ranks agree (max over the world) so they stop after the same step."""
        flag = torch.tensor([1.0 if self._stop_signal is not None else 0.0], device=self.device)
        for g in (self.mesh.tp, self.mesh.pp, self.mesh.dp_cp):  # together they span the world
            comm.all_reduce(flag, g, op="max")
        return bool(flag.item())

    def log_start(self) -> None:
        c = self.cfg
        self.logger.info(
            f"tessel: world {self.mesh.world_size} = dp {self.dp} x pp {c.parallel.pp} x tp {c.parallel.tp}"
            f" (vp {c.parallel.vp}, schedule {c.parallel.schedule}, sp {c.parallel.sequence_parallel}),"
            f" {self.num_micro} micro-batches of {c.train.micro_batch_size} x {c.train.seq_length} per rank per step")
        n_params = sum(q.numel() for q in self.chunks.parameters())
        self.logger.info(f"tessel: rank 0 holds {n_params:,} parameters; model FLOPs/step "
                         f"{self.flops_per_step:.3e}; peak {self.peak_tflops:.3f} TFLOP/s per device "
                         f"({self.peak_source})")

    def train(self, train_loader, valid_loader=None, *, on_step: Callable[["Trainer", StepStats], None] | None = None,
              save: Callable[["Trainer"], None] | None = None) -> list[StepStats]:
        """Run until ``train.steps`` (or ``train.max_tokens``) or a stop signal; returns the step stats."""
        c = self.cfg.train
        self._install_signal_handlers()
        self.log_start()
        history = []
        tokens_per_step = c.global_batch_size * c.seq_length
        max_steps = c.steps
        if c.max_tokens:
            max_steps = min(max_steps, math.ceil(c.max_tokens / tokens_per_step))
        while self.step < max_steps:
            st = self.train_step(train_loader)
            history.append(st)
            if self.step % c.log_interval == 0 or self.step == max_steps or self.step == 1:
                tflops = self.flops_per_step / st.seconds / self.mesh.world_size / 1e12
                self.logger.log({"step": st.step, "loss": st.loss, "lr": st.lr, "grad_norm": st.grad_norm,
                                 "tokens_per_s": tokens_per_step / st.seconds, "tflops_per_device": tflops,
                                 "mfu": tflops / self.peak_tflops, "mem_bytes": M.memory_bytes(),
                                 "step_time_s": st.seconds, "skipped": 0 if st.applied else 1,
                                 "consumed_samples": self.consumed_samples})
            if on_step is not None:
                on_step(self, st)
            if valid_loader is not None and c.eval_interval and self.step % c.eval_interval == 0:
                vl = self.evaluate(valid_loader, c.eval_iters)
                self.logger.log({"step": self.step, "loss": vl, "ppl": math.exp(min(vl, 50.0))}, prefix="valid")
            ck = self.cfg.checkpoint
            stop = self._stop_requested()
            if save is not None and ((ck.interval and self.step % ck.interval == 0) or stop
                                     or self.step == max_steps):
                save(self)
            if stop:
                name = signal.Signals(self._stop_signal).name if self._stop_signal else "a signal on another rank"
                self.logger.info(f"tessel: stopping after step {self.step} on {name}"
                                 + (" (checkpoint saved)" if save is not None else ""))
                break
        self.ddp.finish_param_sync()
        self.logger.close()
        return history


def barrier_all() -> None:
    if dist.is_initialized():
        dist.barrier()


def env_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
