"""Random streams for tensor parallelism: which dropout masks agree across TP ranks and which differ.

Megatron's rule, kept here:

* The **default stream** (torch's own generator) is seeded identically on every TP rank of a
  pipeline stage. Dropout on activations that are *replicated* across TP ranks (the residual
  stream and embedding output without sequence parallelism) draws from it, so every TP rank drops
  the same elements and the replicas stay bit-identical -- a different mask per rank would make
  the "replicated" activations silently diverge.
* The **model-parallel stream** is seeded ``seed + offset + tp_rank``. Dropout on activations that
  are *partitioned* across TP ranks draws from it inside :meth:`RNGTracker.fork`: attention
  probabilities (each rank holds different heads), and, under sequence parallelism, the residual
  / embedding dropout (each rank holds a different sequence chunk). Using the default stream there
  would repeat the same mask on every shard, correlating what should be independent draws.

Megatron seeds the default stream with ``seed + 100 * pp_rank`` (stages differ, TP ranks agree)
and the model-parallel stream with ``default + 2718 + tp_rank``; :func:`seed_streams` does the
same. The trainer (engine/assembly.py) seeds the default stream so; each model chunk holds its own
tracker, seeded ``seed + 100 * (its first layer) + 2718 + tp_rank`` (models/transformer.py), so that the
virtual chunks of one rank differ too, and a whole model (first layer 0) keeps Megatron's seeds. Under context parallelism both streams add ``CP_SEED_STRIDE * cp_rank`` (:func:`cp_seed`): each cp
rank holds other tokens of the same sequences. Weight initialisation does not use these streams: each weight is drawn in full from a
generator seeded by its name (see models/), so it does not depend on TP, PP or creation order.

The tracker holds plain ``torch.ByteTensor`` generator states: :meth:`RNGTracker.get_states` /
:meth:`RNGTracker.set_states` round-trip them through checkpoints (and activation recomputation).
"""
from __future__ import annotations

import contextlib
from typing import Mapping

import torch

MODEL_PARALLEL_STREAM = "model-parallel"
TP_SEED_OFFSET = 2718
PP_SEED_STRIDE = 100
CP_SEED_STRIDE = 7919  # a prime: cp offsets stay clear of the tp (2718 + tp_rank) and pp (100 pp_rank) ones


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    if device.type == "cpu":
        return torch.get_rng_state()
    raise ValueError(f"RNG streams on device type {device.type!r} are not supported; use cpu or cuda")


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Named generator states for one device; :meth:`fork` runs a block on one of them.

    Inside ``with tracker.fork(name):`` torch's default generator of ``device`` *is* that stream
    (so ``F.dropout`` and SDPA's dropout draw from it); on exit the stream's advanced state is
    stored back and the default generator is restored exactly.
    """

    def __init__(self, *, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        _get_state(self.device)  # validates the device type
        self._states: dict[str, torch.Tensor] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._states)

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` (ValueError if it exists)."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists; streams are seeded once")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))
        self._states[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_STREAM):
        if name not in self._states:
            raise ValueError(f"no RNG stream {name!r}; known streams: {list(self._states)} (add it first)")
        outer = _get_state(self.device)
        _set_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(self.device, outer)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of every stream's state (uint8 tensors), for checkpoints."""
        return {k: v.clone() for k, v in self._states.items()}

    def checkpoint_contexts(self):
        """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: call it at
        the checkpoint's start. It snapshots every stream now (the first pass then runs unchanged) and
        returns ``(forward_ctx, recompute_ctx)``; the recompute runs from the snapshot, so dropout inside
        :meth:`fork` draws the same masks again, and on exit the streams get back the states the first
        pass left (the recompute does not advance them). torch's checkpoint replays the default
        generator itself (``preserve_rng_state``); these streams it does not know."""
        snapshot = dict(self._states)  # fork() replaces a stream's tensor, never mutates it: no clone needed

        @contextlib.contextmanager
        def replay():
            advanced = dict(self._states)
            self._states.update(snapshot)
            try:
                yield
            finally:
                self._states.update(advanced)

        return contextlib.nullcontext(), replay()

    def set_states(self, states: Mapping[str, torch.Tensor]) -> None:
        """Restore streams from :meth:`get_states` output; the set of names must match."""
        if set(states) != set(self._states):
            raise ValueError(f"RNG state names {sorted(states)} do not match this tracker's streams "
                             f"{sorted(self._states)}; was the checkpoint written with the same setup?")
        for k, v in states.items():
            if not isinstance(v, torch.Tensor) or v.dtype != torch.uint8:
                raise ValueError(f"RNG state {k!r} must be a uint8 tensor from get_states()")
            self._states[k] = v.clone()


def checkpoint(fn, *args, tracker: RNGTracker | None, **kwargs):
    """``fn(*args, **kwargs)`` under activation recompute: nothing ``fn`` saves for backward is kept
    (only what its arguments reference), and backward runs ``fn`` again first. torch's non-reentrant
    checkpoint, with the default generator replayed by torch and ``tracker``'s streams replayed by
    :meth:`RNGTracker.checkpoint_contexts`, so every dropout mask of the recompute equals the first
    pass's and the gradients are bitwise those of the plain run."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    context_fn = tracker.checkpoint_contexts if tracker is not None else None
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


def cp_seed(seed: int, cp_rank: int) -> int:
    """The seed of a context-parallel rank's streams: each cp rank holds other tokens of the same sequences,
    so its dropout masks must be drawn independently (as at cp = 1, where one rank draws for all of them);
    ``seed`` itself at cp rank 0, so runs without context parallelism are unchanged. (Megatron-LM leaves
    the cp rank out, which repeats one mask on every cp rank's tokens.)"""
    return int(seed) + CP_SEED_STRIDE * int(cp_rank)


def pp_seed(seed: int, index: int) -> int:
    """The seed of pipeline position ``index`` (a pp rank for the default stream, a model chunk's first layer
    for its tracker): ``seed + PP_SEED_STRIDE * index``, Megatron's stage offset."""
    return int(seed) + PP_SEED_STRIDE * int(index)


def model_parallel_seed(seed: int, *, tp_rank: int, offset: int = TP_SEED_OFFSET) -> int:
    """The model-parallel stream's seed: differs across TP ranks."""
    return int(seed) + offset + int(tp_rank)


def make_tracker(seed: int, *, tp_rank: int, device: torch.device | str = "cpu",
                 offset: int = TP_SEED_OFFSET) -> RNGTracker:
    """A tracker with the model-parallel stream seeded ``seed + offset + tp_rank`` (default stream untouched)."""
    tracker = RNGTracker(device=device)
    tracker.add(MODEL_PARALLEL_STREAM, model_parallel_seed(seed, tp_rank=tp_rank, offset=offset))
    return tracker


def seed_streams(seed: int, *, tp_rank: int, pp_rank: int = 0, device: torch.device | str = "cpu",
                 offset: int = TP_SEED_OFFSET) -> RNGTracker:
    """Megatron's start-up seeding: the default stream to ``seed + 100*pp_rank`` (equal across TP),
    and a tracker whose model-parallel stream is that plus ``offset + tp_rank``.

    This sets torch's global default generators (``torch.manual_seed``): call it once at start-up.
    """
    stage_seed = pp_seed(seed, pp_rank)
    torch.manual_seed(stage_seed)
    return make_tracker(stage_seed, tp_rank=tp_rank, device=device, offset=offset)


__all__ = ["RNGTracker", "checkpoint", "MODEL_PARALLEL_STREAM", "TP_SEED_OFFSET", "cp_seed", "pp_seed", "model_parallel_seed",
           "make_tracker",
           "seed_streams"]
