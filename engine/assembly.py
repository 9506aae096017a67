"""The assembly line: one function that builds every part of one rank's run, in order, each once.

    config  ->  Mesh (every group, the world included)  ->  model chunks (the model hook from models/)
      ->  DataParallel  ->  Optimizer  ->  Schedule (data)  ->  loaders  ->  Checkpointer  ->  metrics
      ->  Trainer (the loop only)

:func:`build_run` returns a :class:`Run` holding the parts; tools/pretrain.py is parse, build, resume,
train. The engine knows no model: ``model`` is any object with ``num_layers``, ``hidden_size``,
``flops`` (a :class:`engine.metrics.FlopsSpec`), ``hf_config`` (the config.json dict recorded next to
checkpoints), ``build_stage(mesh, *, pre_process, post_process, layer_range, device)`` and
``param_spec(name, param)`` (checkpoint keys); models.hook.ModelHook is the one Tessel ships.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine import metrics as M
from engine.config import TesselConfig
from engine.optim import Optimizer
from engine.trainer import StepStats, Trainer
from parallel.data_parallel import DataParallel
from parallel.mesh import Mesh, ParallelDims
from parallel.pipeline import build_schedule, forward_only
from parallel.pipeline.actions import placement_of, rank_stages
from parallel.pipeline.split import split_layers
from parallel.random import cp_seed, pp_seed


def check_data_paths(paths: list[str]) -> None:
    """Every data prefix has its .bin and .idx (checked before any process group exists)."""
    if not paths:
        raise ValueError("data.paths is empty: give the prefix of a preprocessed dataset "
                         "(--set data.paths=PREFIX; make one with tools/preprocess_data.py)")
    for p in paths:
        missing = [p + ext for ext in (".bin", ".idx") if not os.path.exists(p + ext)]
        if missing:
            hint = ("run `.venv/bin/python tools/prepare_corpus.py` to build the bundled corpus" if "stdlib_corpus" in p
                    else f"make it with tools/preprocess_data.py --input DOCS.jsonl --output-prefix {p}")
            raise ValueError(f"data path {p!r} is missing {', '.join(missing)}; {hint}")


def check_microbatches(cfg: TesselConfig, dp: int) -> int:
    """The micro-batches per step of each of ``dp`` ranks, checked against the pipeline schedule in the
    config's own terms (before any process group exists): at least one per stage, for the interleaved
    schedule a multiple of pp (Megatron-LM's rule with the default group size), and whatever else the
    schedule needs (its builder's check, e.g. dualpipev's 2 pp)."""
    from parallel.pipeline.schedules import _valid_interleaved_m

    p, t = cfg.parallel, cfg.train
    m = cfg.num_microbatches(dp)
    per_step = f"train.global_batch_size={t.global_batch_size} gives each of the dp={dp} ranks {m} micro-batch(es) " \
               f"of train.micro_batch_size={t.micro_batch_size}"
    if m < p.pp:
        raise ValueError(f"{per_step}, fewer than parallel.pp={p.pp}: a pipeline needs at least one per stage; raise "
                         f"train.global_batch_size to >= {p.pp * dp * t.micro_batch_size}")
    if p.schedule == "interleaved" and not _valid_interleaved_m(m, p.pp, p.pp):
        sizes = [k * dp * t.micro_batch_size for k in (m - m % p.pp, m - m % p.pp + p.pp) if k >= p.pp]
        raise ValueError(f"{per_step}; the interleaved schedule runs a multiple of parallel.pp={p.pp} micro-batches "
                         f"per step (Megatron-LM's rule); set train.global_batch_size to "
                         f"{' or '.join(map(str, sizes))}")
    try:  # every other rule of the schedule (dualpipev: m >= 2 pp, ...)
        build_schedule(p.schedule, pp=p.pp, vp=p.vp, microbatches=m)
    except ValueError as e:
        raise ValueError(f"{per_step}: {e}; change train.global_batch_size (or train.micro_batch_size)") from None
    return m


def run_tokenizer(cfg: TesselConfig):
    """The run's tokenizer (before any process group): ``data.tokenizer``, else the one
    tools/preprocess_data.py saved beside the first data prefix (``PREFIX.tokenizer.json``), else None.
    Every prefix that is read (weight > 0) and has a tokenizer of its own must have the run's vocabulary
    (the same file, or the same token -> id map): its ids were made by that tokenizer. Refused otherwise,
    naming the tokenizers and the fix."""
    from engine.data.tokenizer import load_tokenizer

    weights = list(cfg.data.weights) if cfg.data.weights else [1.0] * len(cfg.data.paths)
    beside = {p: p + ".tokenizer.json" for p, w in zip(cfg.data.paths, weights)
              if w > 0 and os.path.isfile(p + ".tokenizer.json")}
    spec = cfg.data.tokenizer or next(iter(beside.values()), None)
    if spec is None:
        return None
    tok = load_tokenizer(spec)
    for prefix, own in beside.items():
        if _same_vocabulary(own, spec, tok):
            continue
        if cfg.data.tokenizer:
            raise ValueError(f"data path {prefix!r} was tokenized with {own}, whose vocabulary differs from "
                             f"data.tokenizer={spec}: its token ids would be read with the wrong vocabulary; set "
                             f"data.tokenizer={own}, or preprocess the data with the run's tokenizer "
                             "(tools/preprocess_data.py --tokenizer FILE)")
        first = next(iter(beside))
        raise ValueError(f"data paths {first!r} and {prefix!r} were tokenized with different vocabularies ({spec} "
                         f"and {own}); preprocess them with one tokenizer (tools/preprocess_data.py --tokenizer "
                         "FILE), and set data.tokenizer to it")
    return tok


def _same_vocabulary(path: str, spec: str, tok) -> bool:
    """``path`` (a tokenizer file) has the vocabulary of ``tok`` (loaded from ``spec``): the same bytes, or the
    same token -> id map (a byte tokenizer: the same kind and size)."""
    from engine.data.tokenizer import load_tokenizer

    if os.path.isfile(spec) and Path(path).read_bytes() == Path(spec).read_bytes():
        return True
    try:
        other = load_tokenizer(path)
    except (ValueError, OSError):  # e.g. no resolvable end-of-document token: cannot tell, so not refused
        return True
    if getattr(tok, "backend", None) is None or getattr(other, "backend", None) is None:
        return (tok.kind, tok.vocab_size) == (other.kind, other.vocab_size)
    return tok.backend.get_vocab(with_added_tokens=True) == other.backend.get_vocab(with_added_tokens=True)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank bytes of parameters, fp32 gradients and optimizer state, against the memory a rank has."""

    world: int
    numel: int  # parameters on the rank that holds the most
    bytes_per_param: float
    available: int | None  # bytes per rank (None: unknown)
    source: str
    fits_instead: tuple[str, ...] = ()
    frozen: bool = False  # LoRA: the base holds weights only
    zero_stage: int = 1  # the stage the fitting layouts of ``fits_instead`` were sized with
    expert_dp: int = 0  # > 0: ZeRO shards the experts' share over this many ranks (edp), so bytes_per_param is a mean
    method: str = ""  # the data-parallel method's state counted in bytes_per_param ("" for none)

    @property
    def need(self) -> float:
        return self.numel * self.bytes_per_param

    @property
    def fits(self) -> bool:
        return self.available is None or self.need <= self.available

    def line(self) -> str:
        have = "unknown" if self.available is None else f"{self.available / 1e9:.2f} GB ({self.source})"
        what = ("frozen weights under LoRA adapters" if self.frozen else "parameters, fp32 gradients and optimizer state"
                + (f" with {self.method}" if self.method else ""))
        each = (f"{self.bytes_per_param:.3g} bytes each on average: the experts' share sharded over edp = "
                f"{self.expert_dp}" if self.expert_dp else f"{self.bytes_per_param:g} bytes each")
        return (f"tessel: plan: the largest rank holds {self.numel:,} parameters: {self.need / 1e9:.2f} GB of "
                f"{what} ({each}); a rank has {have}")

    def error(self) -> str:
        how = (f"optim.distributed=true, zero_stage={self.zero_stage}" if self.zero_stage else
               "optim.distributed=false: DiLoCo and gradient compression run without ZeRO")
        alt = (f"Layouts of the same ranks that would fit ({how}): "
               + "; ".join(self.fits_instead)
               if self.fits_instead else f"No layout of {self.world} ranks fits: launch more ranks or train a smaller model")
        return (f"the run does not fit in memory: {self.line().removeprefix('tessel: plan: ')}; refusing before "
                f"allocating anything. {alt}")


def _bytes_per_param(dtype: str, *, zero_stage: int, dp: int, frozen: bool = False) -> float:
    """Persistent bytes per parameter: ``zero_stage`` 0 (plain) to 3 shards the optimizer state, then
    the fp32 gradients, then the parameters over ``dp`` (docs/data_parallel.md's table)."""
    param = 2 if dtype == "bf16" else 4
    if frozen:  # a LoRA run's base: weights only (the adapters' share is below the plan's resolution)
        return param
    state = (4 if dtype == "bf16" else 0) + 8  # fp32 masters (fp32 params are their own) + Adam moments
    grad = 4
    return (param / (dp if zero_stage >= 3 else 1) + grad / (dp if zero_stage >= 2 else 1)
            + state / (dp if zero_stage >= 1 else 1))


def _rank_numels(model, *, tp: int, pp: int, vp: int, layout, placement: str = "loop",
                 ep: int = 1, expert_tp: int | None = None) -> list[tuple[int, int]]:
    """Per pipeline rank: (parameters, of which experts held apart at ``ep`` > 1; 0 at ep = 1). Each MoE layer's
    experts count 1/ep (whole at ``expert_tp`` = 1, 1/tp of each otherwise)."""
    from engine.memory import stage_param_sizes

    stages = pp * vp
    ranges = split_layers(model.num_layers, stages, layout)
    out = []
    for r in range(pp):
        sizes = [(n, expert) for s in rank_stages(r, pp=pp, vp=vp, placement=placement)
                 for _, n, _, expert in stage_param_sizes(model, tp=tp, ep=ep, layer_range=ranges[s],
                                                          pre_process=s == 0, post_process=s == stages - 1,
                                                          expert_tp=expert_tp)]
        out.append((sum(n for n, _ in sizes), sum(n for n, expert in sizes if expert and ep > 1)))
    return out


def _method_bytes_per_param(cfg: TesselConfig) -> int:
    """Bytes per parameter the data-parallel method keeps beyond AdamW's (docs/decentralised.md; exactly, with
    the buffers' padding and the TP-replicated positions: engine.memory.method_state_bytes): DiLoCo the anchor
    (4) and the outer-norm mask (1), + 4 with outer momentum, + 4 with top-k; 1-bit its error feedback and mask
    (5); PowerSGD its error feedback (4 for the matrices it compresses, nearly all parameters; its warm-start
    factors are below the plan's resolution)."""
    u, o = cfg.outer, cfg.optim
    if u.method != "none":
        return 5 + (4 if u.momentum > 0 else 0) + (4 if u.compression == "topk" else 0)
    return {"onebit": 5, "powersgd": 4}.get(o.grad_compression, 0)


def _largest_need(model, *, dtype: str, zero_stage: int, dp: int, ep: int, frozen: bool, extra: float = 0.0,
                  **layout) -> tuple[int, float]:
    """(parameters, bytes per parameter) of the rank needing the most bytes: under ZeRO the experts (ep > 1)
    shard over edp = dp / ep, the rest over dp (``dp``: the ranks ZeRO shards over, dp x cp), so a rank's bytes
    per parameter is their weighted mean. ``extra``: bytes per parameter more (:func:`_method_bytes_per_param`)."""
    dense = _bytes_per_param(dtype, zero_stage=zero_stage, dp=dp, frozen=frozen) + extra
    expert = _bytes_per_param(dtype, zero_stage=zero_stage, dp=dp // ep, frozen=frozen) + extra
    best = (0.0, 0, dense)
    for n, e in _rank_numels(model, ep=ep, **layout):
        need = (n - e) * dense + e * expert
        best = max(best, (need, n, need / n if e else dense))  # without experts apart: exactly dense
    return best[1], best[2]


def _available_bytes(world: int) -> tuple[int | None, str]:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))
        return free, "free memory of this GPU"
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        avail = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None, "unknown"
    return avail // max(1, local), f"MemAvailable {avail / 1e9:.1f} GB / {local} local ranks"


def memory_plan(cfg: TesselConfig, model, *, world: int, available: int | None = None) -> MemoryPlan:
    """What the run's largest rank needs and has; no communication, nothing allocated (the model hook
    derives parameter counts without building). ``available`` overrides the measured bytes per rank."""
    p, o = cfg.parallel, cfg.optim
    dp = cfg.validate_world(world) * p.cp  # DataParallel's group is dp x cp: ZeRO shards over it, experts over /ep
    frozen = bool(cfg.posttrain.lora.rank)
    extra = 0 if frozen else _method_bytes_per_param(cfg)  # DiLoCo's outer state, a compressor's buffers
    method = "" if not extra else ("DiLoCo's outer state" if cfg.outer.method != "none"
                                   else f"{o.grad_compression}'s error feedback")
    numel, bpp = _largest_need(model, dtype=cfg.model.dtype, zero_stage=o.zero_stage if o.distributed else 0, dp=dp,
                               ep=p.ep, frozen=frozen, extra=extra, tp=p.tp, pp=p.pp, vp=p.vp,
                               layout=p.pipeline_layout, placement=placement_of(p.schedule), expert_tp=p.expert_tp)
    source = "given"
    if available is None:
        available, source = _available_bytes(world)
    plan = MemoryPlan(world=world, numel=numel, source=source, available=available, frozen=frozen, method=method,
                      bytes_per_param=bpp, expert_dp=dp // p.ep if p.ep > 1 and o.distributed else 0)
    if plan.fits or available is None:
        return plan
    fits = []
    zero = 0 if extra else max(1, o.zero_stage)  # DiLoCo and gradient compression are refused with ZeRO
    for tp in (d for d in range(1, world + 1) if world % d == 0):
        for pp in (d for d in range(1, world // tp + 1) if (world // tp) % d == 0):
            dp_alt = world // (tp * pp)
            ep = p.ep if dp_alt % p.ep == 0 else 1  # keep the run's ep where it divides the layout's dp
            try:
                model.config.check_tensor_parallel(tp)
                n, alt_bpp = _largest_need(model, dtype=cfg.model.dtype, zero_stage=zero, dp=dp_alt,
                                           ep=ep, frozen=frozen, extra=extra, tp=tp, pp=pp, vp=1, layout=None,
                                           expert_tp=1 if p.expert_tp == 1 else None)
            except ValueError:
                continue
            need = n * alt_bpp
            if need <= available:
                fits.append((need, f"tp={tp} pp={pp} dp={dp_alt}{f' ep={ep}' if p.ep > 1 else ''} "
                                   f"({need / 1e9:.2f} GB)"))
    return MemoryPlan(world=world, numel=numel, bytes_per_param=plan.bytes_per_param, available=available,
                      zero_stage=zero, expert_dp=plan.expert_dp, method=method,
                      source=source, fits_instead=tuple(text for _, text in sorted(fits)[:4]), frozen=frozen)


@dataclass
class Run:
    """The parts of one rank's run, built by :func:`build_run`."""

    cfg: TesselConfig
    mesh: Mesh
    model: Any  # the model hook
    trainer: Trainer
    train_loader: Any = None
    valid_loader: Any = None
    checkpointer: Any = None
    run_dir: str | None = None
    side_files: dict = field(default_factory=dict)  # path -> bytes, written into every checkpoint (hf/)

    # -- the policy pretrain.py needs, in one place ---------------------------------------------------
    @property
    def lora(self) -> bool:
        """Adapters train, the base is frozen: checkpoints hold the adapters (and their optimizer state)
        only, and the base always comes from ``checkpoint.load``."""
        return bool(self.cfg.posttrain.lora.rank)

    def load_base(self) -> None:
        """The weights of ``checkpoint.load``, model only (with LoRA: the frozen base; the adapters keep
        their initialisation); the optimizer's masters are re-derived from them."""
        from engine.checkpoint.trainer_state import load_trainer

        load_trainer(self.trainer, self.cfg.checkpoint.load, group=self.mesh.world, model_only=True,
                     params="frozen" if self.lora else "all")

    def resume(self) -> str | None:
        """Resume from the checkpoint directory's latest complete checkpoint, else initialise the weights
        from ``checkpoint.load`` (model only); returns what was loaded (None: a fresh start). With LoRA the
        base always comes from ``checkpoint.load`` and a checkpoint of the run restores the adapters."""
        from engine.checkpoint.trainer_state import load_trainer

        # checkpoint.peer_replica: the newest commit as the peers hold it in RAM (None: from disk, said why)
        replica = (self.checkpointer.replica(layout=self.trainer.layout(), log=self.trainer.logger.info)
                   if self.checkpointer is not None else None)
        latest = replica or (self.checkpointer.latest() if self.checkpointer is not None else None)
        if self.lora and self.cfg.checkpoint.load:
            self.load_base()
        if latest is not None:
            import time

            t0 = time.perf_counter()
            result = load_trainer(self.trainer, latest, group=self.mesh.world, loader=self.train_loader,
                                  valid_loader=self.valid_loader, params="trainable" if self.lora else "all")
            self.trainer.logger.rewind(self.trainer.step)  # the steps after the checkpoint run again
            if self.checkpointer.peer is not None:  # what the restart read: the files it opened, every rank
                from engine.checkpoint._dist import all_gather_json

                opened = all_gather_json(result.files_opened, self.checkpointer.group)
                self.trainer.logger.info(f"tessel: loaded step {result.step} from the {result.source} in "
                                         f"{time.perf_counter() - t0:.3f} s; checkpoint files opened per rank: {opened}")
                import sys

                sys.audit("tessel.resumed", result.source, result.files_opened)  # for an audit hook (the tests)
            self.trainer.logger.info(f"tessel: resumed from {result.path} at step {self.trainer.step}")
            return str(result.path)
        self.trainer.logger.rewind(0)  # a fresh start in a run directory whose run never saved
        if self.cfg.checkpoint.load:
            if not self.lora:
                self.load_base()
            self.trainer.logger.info(f"tessel: initialised the weights from {self.cfg.checkpoint.load} (model only"
                                     + (", frozen base under LoRA adapters)" if self.lora else ")"))
            return self.cfg.checkpoint.load
        return None

    def save(self, trainer: Trainer | None = None):
        """Save the run at its current step (collective over the world)."""
        from engine.checkpoint.trainer_state import save_trainer

        return save_trainer(self.checkpointer, self.trainer, loader=self.train_loader, valid_loader=self.valid_loader,
                            model_config=self.model.hf_config, side_files=self.side_files,
                            params="trainable" if self.lora else "all")

    def close(self) -> None:
        """A clean end (collective, after :meth:`train` returned on every rank): commit a pending save and
        remove the peer replicas (``checkpoint.peer_replica``), then destroy the mesh's process groups
        (:meth:`parallel.mesh.Mesh.destroy`), so a process that runs again builds fresh ones without
        keeping the old ones' threads and sockets. The run cannot train or save after this."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.mesh.destroy()

    def train(self, *, on_step=None, keep_history: bool = True) -> list[StepStats]:
        """The loop, saving every ``checkpoint.interval`` steps, at the end and on SIGTERM/SIGINT;
        ``on_step(trainer, stats)`` runs after each step (collective calls allowed: every rank runs it).
        ``keep_history=False``: return ``[]``, keeping no per-step stats (:meth:`Trainer.train`)."""
        ck = self.checkpointer

        def after_step(tr, st):
            if ck is not None:
                ck.maybe_finalize()  # commit a finished async save at the first step boundary after its writes land
            if on_step is not None:
                on_step(tr, st)
        from engine.fault import RunStopped
        from engine.optim import NonFiniteGradError

        watchdog = self.trainer.watchdog or contextlib.nullcontext()  # fault.hang_timeout_s: armed for the loop
        try:
            with watchdog:
                history = self.trainer.train(self.train_loader, self.valid_loader,
                                             save=self.save if ck is not None else None, on_step=after_step,
                                             keep_history=keep_history)
        except (RunStopped, NonFiniteGradError):
            # Every rank stops at the same step (the skip limit, or optim.nonfinite="stop" on the all-reduced
            # norm): a save started before the divergence holds healthy weights and still commits.
            if ck is not None:
                ck.finalize()
            raise
        if ck is not None:
            ck.finalize()  # an async save must be committed before exit
        return history


def build_mesh(cfg: TesselConfig, *, world: int | None = None) -> Mesh:
    """The mesh of ``cfg.parallel`` over ``world`` ranks (default: the initialised world); ``dp`` is
    resolved here and nowhere else (``TesselConfig.validate_world``)."""
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
    p = cfg.parallel
    dp = cfg.validate_world(world)
    return Mesh.build(ParallelDims(dp=dp, pp=p.pp, cp=p.cp, tp=p.tp, ep=p.ep), order=p.order,
                      cp_a2a_size=p.cp_a2a_size if p.cp_comm == "hybrid" else None,
                      timeout_s=cfg.fault.collective_timeout_s, placement=placement_of(p.schedule),
                      separate_outer=cfg.outer.method == "streaming_diloco")


def build_loaders(cfg: TesselConfig, mesh: Mesh, *, train_data=None, valid_data=None, collate_fn=None):
    """Data-parallel loaders over ``cfg.data`` (or the given datasets): each dp rank its slice;
    ``collate_fn`` turns a micro-batch's samples into tensors (default: stack them)."""
    from engine.data.blending import build_gpt_datasets
    from engine.data.loader import DataParallelLoader

    t = cfg.train
    if train_data is None:
        n_eval = (t.steps // t.eval_interval + 1) * t.eval_iters * t.global_batch_size if t.eval_interval else 0
        cache = cfg.data.cache_dir or os.path.join(os.path.dirname(cfg.data.paths[0]) or ".", "index_cache")
        train_data, valid_data, _ = build_gpt_datasets(
            list(cfg.data.paths), weights=list(cfg.data.weights) if cfg.data.weights else None,
            split=cfg.data.split, num_samples=[t.steps * t.global_batch_size, n_eval, 0],
            seq_length=t.seq_length, seed=t.seed, cache_dir=cache)
    kw = dict(global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
              dp_rank=mesh.coords["dp"], dp_size=mesh.dims.dp)
    if collate_fn is not None:
        kw["collate_fn"] = collate_fn
    train_loader = DataParallelLoader(train_data, num_workers=cfg.data.num_workers, **kw)
    valid_loader = DataParallelLoader(valid_data, **kw) if valid_data is not None else None
    return train_loader, valid_loader


def build_run(cfg: TesselConfig, *, model, run_dir: str | None = None, world: int | None = None,
              train_data=None, valid_data=None, data: bool = True, checkpoints: bool = True,
              log_stream=None, device: str | None = None, plan: MemoryPlan | None = None,
              tokenizer=None, objective=None, rows_per_sample: int = 1, collate_fn=None,
              side_files: dict[str, bytes] | None = None) -> Run:
    """Build every part of this rank's run from ``cfg`` and the model hook ``model`` (see the module
    docstring). ``train_data``/``valid_data``: datasets to use instead of ``cfg.data``; ``data=False``
    builds no loaders; ``checkpoints=False`` (or no ``run_dir`` and no ``checkpoint.dir``) no checkpointer;
    ``device``: where the model lives (default CUDA when available, else CPU); ``plan``: the memory plan
    (:func:`memory_plan`) whose line the start-up log shows; ``tokenizer``: the run's tokenizer, saved with
    every checkpoint as Hugging Face files (``hf/``), so ``tessel-to-hf`` exports it; ``side_files``:
    those files' bytes given directly instead (post-training keeps the base model's, chat template
    included). Post-training (tools/posttrain.py) passes its ``objective`` (the step's loss,
    engine/posttrain/objectives.py), ``rows_per_sample`` (a preference pair is 2 rows of the micro-batch)
    and the datasets' ``collate_fn``. Collective: every rank calls it with the same arguments."""
    p = cfg.parallel
    if p.ep > 1 or p.expert_tp_size != p.tp:  # experts divisible by ep, top-k: before any group (models/hook.py)
        model.check_expert_parallel(p.ep, **({} if p.expert_tp_size == p.tp else {"expert_tp": p.expert_tp_size}))
    if (getattr(model, "expert_tp", None) or p.tp) != p.expert_tp_size:  # the memory plan reads the config's
        raise ValueError(f"the model hook holds expert_tp={model.expert_tp} but parallel.expert_tp={p.expert_tp}; "
                         "build the hook from the run config (ModelHook.from_run_config) or give it the same value")
    m = cfg.model  # the hook builds the stages: a config key it does not hold would be silently ignored
    held = {"fp8": (getattr(model, "fp8", "none"), m.fp8),
            "fp8_backend": (getattr(model, "fp8_backend", "tessel"), m.fp8_backend)}
    if m.fp8 != "none":
        held.update(fp8_exclude=(tuple(getattr(model, "fp8_exclude", ())), tuple(m.fp8_exclude)),
                    fp8_amax_history=(getattr(model, "fp8_amax_history", 16), m.fp8_amax_history),
                    fp8_margin=(getattr(model, "fp8_margin", 0), m.fp8_margin))
    differ = [f"model.{k}={want!r} (the hook's: {have!r})" for k, (have, want) in held.items() if have != want]
    if differ:
        raise ValueError(f"the model hook was built with other FP8 settings than the run config's: {', '.join(differ)}; "
                         "build the hook from the run config (ModelHook.from_run_config) or give it the same values")
    mesh = build_mesh(cfg, world=world)
    p, t, o = cfg.parallel, cfg.train, cfg.optim

    # Model chunks: this rank's virtual stages s = pp_rank, pp_rank + pp, ... (loop placement), or
    # pp_rank and 2 pp - 1 - pp_rank (the V of zbv and dualpipev), in chunk order.
    num_stages = p.pp * p.vp
    ranges = split_layers(model.num_layers, num_stages, p.pipeline_layout)
    stages = rank_stages(mesh.coords["pp"], pp=p.pp, vp=p.vp, placement=placement_of(p.schedule))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # dropout's default stream: cp ranks hold other tokens, pipeline stages other layers (Megatron's 100 x pp_rank;
    # one seed on every stage made stage 1's first masks repeat stage 0's)
    torch.manual_seed(pp_seed(cp_seed(t.seed, mesh.coords["cp"]), mesh.coords["pp"]))
    chunks = torch.nn.ModuleList([
        model.build_stage(mesh, pre_process=s == 0, post_process=s == num_stages - 1, layer_range=ranges[s],
                          device=device)
        for s in stages])
    lora = cfg.posttrain.lora
    if lora.rank:  # adapters on the built chunks, base frozen: DataParallel and the optimizer see adapters only
        from engine.posttrain.lora import apply_lora

        apply_lora(chunks, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets, seed=t.seed)

    from parallel.data_parallel.compression import build_grad_compressor, check_powersgd_rank  # docs/decentralised.md

    if o.grad_compression == "powersgd":
        check_powersgd_rank(chunks, o.powersgd_rank, mesh.world, device=device)
    ddp = DataParallel(chunks, dp_group=mesh.dp_cp, tp_group=mesh.tp,
                       zero_stage=o.zero_stage if o.distributed else 0, bucket_size_mb=o.bucket_size_mb,
                       overlap_grad_reduce=o.overlap_grad_reduce,
                       overlap_param_gather=o.overlap_param_gather and o.distributed, chunks=True,
                       expert_group=mesh.edp if p.ep > 1 else None,  # expert gradients reduce over edp
                       local_grads=cfg.outer.method != "none",  # DiLoCo (after outer.start_step): no dp traffic
                       grad_compressor=build_grad_compressor(o.grad_compression, dp_group=mesh.dp_cp,
                                                             rank=o.powersgd_rank, seed=t.seed,
                                                             start_step=o.powersgd_start_step, checked=True))
    optimizer = Optimizer.from_config(ddp, o, total_steps=t.steps, tp_group=mesh.tp, pp_group=mesh.pp,
                                      ep_group=mesh.ep if p.ep > 1 else None)
    m = check_microbatches(cfg, mesh.dims.dp)
    schedule = build_schedule(p.schedule, pp=p.pp, vp=p.vp, microbatches=m)
    eval_schedule = forward_only(p.pp, p.vp, m, placement=schedule.placement)

    train_loader = valid_loader = None
    if data:
        train_loader, valid_loader = build_loaders(cfg, mesh, train_data=train_data, valid_data=valid_data,
                                                   collate_fn=collate_fn)

    checkpointer = None
    ck = cfg.checkpoint
    if checkpoints and (run_dir or ck.dir):
        from engine.checkpoint import Checkpointer

        checkpointer = Checkpointer(ck.dir or os.path.join(run_dir, "checkpoints"), group=mesh.world,
                                    keep_last=ck.keep_last, keep_every=ck.keep_every, async_save=ck.async_save,
                                    peer_replica=ck.peer_replica)
        if mesh.rank == 0:  # saves that never committed (a crash): rank 0 alone creates them, none is in flight
            from engine.fault import remove_stale_saves

            remove_stale_saves(checkpointer.root)

    if run_dir and mesh.rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        cfg.to_json(os.path.join(run_dir, "config.json"))
        with open(os.path.join(run_dir, "model_config.json"), "w") as f:
            json.dump(model.hf_config, f, indent=2, sort_keys=True)
    logger = M.MetricsLogger(run_dir, enabled=mesh.rank == 0, total_steps=t.steps, jsonl=cfg.logging.jsonl,
                             tensorboard=cfg.logging.tensorboard, progress_bar=cfg.logging.progress_bar,
                             stream=log_stream)
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    sp = p.sequence_parallel and p.tp > 1
    memory = None  # the start-up memory report (every rank: the first step's measurement is collective)
    if cfg.logging.memory_report and not lora.rank and hasattr(model, "stage_param_sizes"):  # LoRA: not modeled
        from engine.memory import predict_memory

        memory = predict_memory(cfg, model, world=mesh.world_size, device=torch.device(device).type,
                                rows_per_sample=rows_per_sample)
    trainer = Trainer(cfg, mesh=mesh, chunks=chunks, stages=stages, num_stages=num_stages, ddp=ddp,
                      optimizer=optimizer, schedule=schedule, eval_schedule=eval_schedule,
                      act_shape=(t.seq_length // p.cp // (p.tp if sp else 1), t.micro_batch_size * rows_per_sample,
                                 model.hidden_size),
                      flops_per_step=M.model_flops_per_step(model.flops, batch_size=t.global_batch_size * rows_per_sample,
                                                            seq_length=t.seq_length),
                      flops_per_step_causal=M.model_flops_per_step(
                          model.flops, batch_size=t.global_batch_size * rows_per_sample, seq_length=t.seq_length,
                          causal=True), run_dir=run_dir,
                      logger=logger, peak=M.peak_tflops(override=cfg.logging.peak_tflops, dtype=dtype),
                      param_spec=model.param_spec, plan_line=plan.line() if plan is not None else None,
                      objective=objective, rows_per_sample=rows_per_sample, memory=memory)
    if cfg.outer.method != "none":  # DiLoCo / Streaming DiLoCo over the dp replicas (docs/decentralised.md)
        from engine.optim import counts_in_norm
        from parallel.data_parallel.outer import OuterOptimizer

        u = cfg.outer
        trainer.outer = OuterOptimizer(optimizer.dist, dp_group=mesh.dp_outer, method=u.method, inner_steps=u.inner_steps,
                                       lr=u.lr, momentum=u.momentum, nesterov=u.nesterov, fragments=u.fragments,
                                       mix=u.mix, compression=u.compression, topk_fraction=u.topk_fraction,
                                       layout=u.fragment_layout, start_step=u.start_step,
                                       momentum_start_step=u.momentum_start_step, overlap_steps=u.overlap_steps,
                                       counts=lambda q: counts_in_norm(q, tp_group=mesh.tp),
                                       norm_groups=(mesh.tp, mesh.pp), tp_group=mesh.tp,
                                       embedding_group=mesh.embedding)
    if cfg.fault.hang_timeout_s is not None:  # the flight recorder (fed by parallel/comm) and the hang watchdog
        from engine.watchdog import Watchdog
        from parallel.flight import FlightRecorder

        mesh.ledger.recorder = FlightRecorder(cfg.fault.flight_records)
        trainer.watchdog = Watchdog(recorder=mesh.ledger.recorder, rank=mesh.rank, world_size=mesh.world_size,
                                    timeout_s=cfg.fault.hang_timeout_s, run_dir=run_dir)
    side = dict(side_files or {})
    if tokenizer is not None and not side:
        side = {f"hf/{name}": text.encode() for name, text in
                tokenizer.hf_files(model_max_length=model.config.max_position_embeddings).items()}
    if side:  # the architecture beside the tokenizer, as conversions write it: a checkpoint is a complete base
        side["hf/config.json"] = (json.dumps(model.hf_config, indent=2, sort_keys=True) + "\n").encode()
    return Run(cfg=cfg, mesh=mesh, model=model, trainer=trainer, train_loader=train_loader,
               valid_loader=valid_loader, checkpointer=checkpointer, run_dir=run_dir, side_files=side)

