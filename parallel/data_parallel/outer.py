"""DiLoCo and Streaming DiLoCo: an outer optimizer over data-parallel replicas that train locally.

With DiLoCo (Douillard et al., 2023) every data-parallel replica (itself any TP x PP group) runs
``inner_steps`` (H) AdamW steps on its own gradients (``DataParallel(local_grads=True)``: no dp
traffic per step, inner optimizer state local). Then the pseudo-gradient ``delta = anchor - theta``
(the replica's progress since the last synchronisation, fp32) is averaged over the dp group and an
outer SGD step with (Nesterov) momentum moves the shared weights:

    m      <- momentum * m + mean(delta)
    update <- mean(delta) + momentum * m   (nesterov)   or   m
    global <- anchor - lr * update ;  anchor <- global
    theta  <- (1 - mix) * theta + mix * global          (mix = 1: every replica continues from global)

Streaming DiLoCo (Douillard et al., 2025) cuts the parameters into ``fragments`` groups synchronised at
staggered steps: fragment ``f`` sends its pseudo-gradient after step ``t`` when
``t % H == ((f + 1) * H // F) % H``; its reduction overlaps the next ``overlap_steps`` inner steps (tau,
``outer.overlap_steps``, 1 to H; default 1) and is applied (outer step + ``mix``) after the last of them, or
after the run's final step if that comes first. With ``F = 1`` and ``method="diloco"`` the reduction is
waited for and applied at once. ``layout``: ``"strided"`` (the paper's pattern) puts transformer block ``l``
(global index) in fragment ``l % F``, the parameters before a chunk's first block (embeddings) with that block and those
after its last block (final norm, output layer) with that one; ``"contiguous"`` cuts the flat vector
into ``F`` ranges of whole parameters of about equal size.

``start_step = N`` (``outer.start_step``): steps 1..N are plain data parallelism (the gradient all-reduce
every step: :meth:`DataParallel.set_local_grads` off, so every replica holds the same weights and Adam
moments), and the outer loop starts from step N's weights (the anchor is taken after step N; the H-step
cycle counts from there), as the DiLoCo paper's replicas start from a data-parallel pretrained model.
``momentum_start_step = M`` (``outer.momentum_start_step``): the syncs applied at steps <= M take the plain
average (``global <- mean(theta)``: outer lr 1, the momentum buffer left at zero), later ones the outer
step above; the DDP bytes of a warm-up are not spent.

The averaged pseudo-gradient travels compressed (``compression``): ``none`` (fp32 all-reduce), ``bf16``
and ``int8`` (a reduce-scatter as an all-to-all of the compressed vector, fp32 sums locally, the reduced
shard re-compressed and all-gathered; int8 with one fp32 absmax scale per ``chunk`` elements: exactly
``(1 + 4 / chunk) / 4`` of the fp32 bytes, ``1/2`` for bf16, on the padded length), or ``topk`` (each
rank all-gathers the ``topk_fraction`` largest entries of its pseudo-gradient plus error feedback, as
fp32 values and int32 indices; what was not sent is kept and added next time).

Everything operates on the fp32 masters of :class:`parallel.data_parallel.DistributedOptimizer`
(``zero_stage=0``: every rank owns whole buckets), as one flat vector in bucket order, so the bytes of
a full synchronisation equal the DDP all-reduce of one step (same buckets, padding included).
All collectives go over ``dp_group`` through :mod:`parallel.comm` (counted by the ledger).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from parallel import comm
from parallel.comm import Group

OUTER_METHODS = ("none", "diloco", "streaming_diloco")
OUTER_COMPRESSIONS = ("none", "bf16", "int8", "topk")
FRAGMENT_LAYOUTS = ("strided", "contiguous")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a parameter of transformer block <n> (global index)
DEFAULT_INT8_CHUNK = 1024


def topk_index_dtype(n: int) -> torch.dtype:
    """The dtype top-k sends its indices into a fragment of ``n`` elements in: int32 (4 bytes) while every
    index fits, int64 beyond 2^31 - 1 elements (a fragment of a model that large on one rank)."""
    return torch.int32 if n <= torch.iinfo(torch.int32).max + 1 else torch.int64


def fragment_phase(fragment: int, inner_steps: int, fragments: int) -> int:
    """The residue (mod H) of the steps counted from ``start_step`` after which ``fragment`` sends its
    pseudo-gradient: fragment f at ``(f + 1) H // F`` (H=10, F=4: steps 2, 5, 7, 10 of each cycle)."""
    return ((fragment + 1) * inner_steps // fragments) % inner_steps


def sync_due(method: str, step: int, *, final: bool, overlap: int = 1) -> int:
    """The step after which a sync sent after ``step`` is applied: at once (DiLoCo, or the run's ``final``
    step), else ``overlap`` inner steps later (Streaming DiLoCo's overlap, ``outer.overlap_steps``; the run's
    final step applies every sync still in flight)."""
    return step + (overlap if method == "streaming_diloco" and not final else 0)


def apply_steps(method: str, *, inner_steps: int, fragments: int, start_step: int, steps: int,
                end: int | None = None, overlap: int = 1) -> tuple[int, int] | None:
    """The first and last step (1-based) at which a sync is applied in a run of ``train.steps = steps`` that
    stops after step ``end`` (default ``steps``; earlier on ``train.max_tokens``), by
    :meth:`OuterOptimizer.step`'s schedule (:func:`fragment_phase`, :func:`sync_due`); None: none is. A
    Streaming fragment due after ``end < steps`` is still in flight when the run stops."""
    H, end = inner_steps, steps if end is None else min(end, steps)
    phases = {fragment_phase(f, H, fragments) for f in range(fragments)}
    # the first cycle and the last H + overlap steps are enough: every cycle of H steps sends at least once, and a
    # sync applied by ``end`` was sent at most ``overlap`` steps before it (a window of H + 1 missed the last
    # applied one for overlap >= 3 when ``end < steps``, until 2026-11-28: a brute force over small H, F, tau found it)
    ts = sorted({*range(start_step + 1, min(start_step + H + 1, end) + 1),
                 *range(max(start_step + 1, end - H - overlap), end + 1)})
    dues = [min(sync_due(method, t, final=t == steps, overlap=overlap), steps)  # the final step applies the rest
            for t in ts if (t - start_step) % H in phases]
    dues = sorted(d for d in dues if d <= end)
    return (dues[0], dues[-1]) if dues else None


def overlap_at_h_message(tau: int, inner_steps: int) -> str:
    """Why Streaming DiLoCo refuses ``overlap_steps == inner_steps`` with ``mix = 1``, and the fix."""
    return (f"outer.overlap_steps={tau} equals outer.inner_steps={inner_steps} with outer.mix=1: each reduction "
            "would be applied at the step its fragment sends again, replacing the fragment's weights by the anchor "
            "just before they are read, so every later pseudo-gradient would be 0 and the fragment would stop "
            "training; lower outer.overlap_steps below outer.inner_steps or set outer.mix below 1 (e.g. 0.5)")


def _pad_to(n: int, q: int) -> int:
    return -(-n // q) * q


@dataclass
class _Pending:
    """A fragment's reduction in flight, applied after step ``due`` (or the run's final step, if earlier)."""

    fragment: int
    due: int
    finish: object  # () -> averaged pseudo-gradient (fp32, the fragment's length)
    result: torch.Tensor | None = None


class OuterOptimizer:
    """DiLoCo / Streaming DiLoCo over the masters of ``dist_opt`` (a DistributedOptimizer with zero_stage 0
    and no gradient compressor; this object switches its DataParallel's local gradients). Call
    :meth:`begin_step` before and :meth:`step` after every inner step.

    ``counts(param) -> bool``: whether this rank's copy of a parameter counts in the (global) outer-step
    norm (engine.optim.counts_in_norm); ``norm_groups``: the groups its sum of squares is added over (tp, pp).
    """

    def __init__(self, dist_opt, *, dp_group: Group, method: str = "diloco", inner_steps: int = 10,
                 lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True, fragments: int = 1, mix: float = 1.0,
                 compression: str = "none", topk_fraction: float = 0.01, chunk: int = DEFAULT_INT8_CHUNK,
                 layout: str = "strided", start_step: int = 0, momentum_start_step: int = 0, overlap_steps: int = 1,
                 counts=None,
                 norm_groups: tuple[Group | None, ...] = (), tp_group: Group | None = None,
                 embedding_group: Group | None = None):
        if method not in ("diloco", "streaming_diloco"):
            raise ValueError(f"outer.method={method!r}: the outer optimizer runs 'diloco' or 'streaming_diloco'")
        if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1:
            raise ValueError(f"outer.inner_steps={inner_steps!r} must be an integer >= 1 (H, inner steps per sync)")
        if method == "diloco" and fragments != 1:
            raise ValueError(f"outer.fragments={fragments} needs outer.method='streaming_diloco'")
        if not 1 <= fragments <= inner_steps:
            raise ValueError(f"outer.fragments={fragments} must be in [1, outer.inner_steps={inner_steps}] (each "
                             "fragment syncs at its own step of the H-step cycle)")
        if compression not in OUTER_COMPRESSIONS:
            raise ValueError(f"outer.compression={compression!r}; choose one of {', '.join(OUTER_COMPRESSIONS)}")
        if layout not in FRAGMENT_LAYOUTS:
            raise ValueError(f"outer.fragment_layout={layout!r}; choose one of {', '.join(FRAGMENT_LAYOUTS)}")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"outer.start_step={start_step!r} must be an integer >= 0 (plain data-parallel steps "
                             "before the outer loop starts; 0 starts it at once)")
        if isinstance(momentum_start_step, bool) or not isinstance(momentum_start_step, int) or momentum_start_step < 0:
            raise ValueError(f"outer.momentum_start_step={momentum_start_step!r} must be an integer >= 0 (the last "
                             "step whose syncs take the plain average; 0: outer lr and momentum from the start)")
        tau = overlap_steps
        if isinstance(tau, bool) or not isinstance(tau, int) or not 1 <= tau <= inner_steps:
            raise ValueError(f"outer.overlap_steps={overlap_steps!r} must be an integer in [1, outer.inner_steps="
                             f"{inner_steps}]: a fragment's reduction is applied before the fragment sends again; "
                             "lower outer.overlap_steps or raise outer.inner_steps")
        if method == "diloco" and overlap_steps != 1:
            raise ValueError(f"outer.overlap_steps={overlap_steps} is read by outer.method='streaming_diloco' (DiLoCo "
                             "applies each sync at once); use streaming_diloco (outer.fragments=1 overlaps one whole "
                             "sync)")
        if method == "streaming_diloco" and overlap_steps == inner_steps and mix == 1.0:
            raise ValueError(overlap_at_h_message(overlap_steps, inner_steps))
        ddp = dist_opt.ddp
        if ddp.sharded or ddp.grad_compressor is not None:
            raise ValueError("the outer optimizer needs DataParallel(zero_stage=0) without a grad_compressor: "
                             "DiLoCo's replicas step on their own gradients; set optim.distributed=false")
        ddp.set_local_grads(start_step == 0)
        self.dist = dist_opt
        self.group = dp_group
        self.method, self.H, self.lr, self.momentum, self.nesterov = method, inner_steps, lr, momentum, nesterov
        self.start_step, self.momentum_start_step = start_step, momentum_start_step
        self.overlap = overlap_steps  # Streaming DiLoCo: inner steps a fragment's reduction overlaps (tau)
        self.F, self.mix, self.compression, self.topk_fraction, self.chunk = (fragments, mix, compression,
                                                                             topk_fraction, chunk)
        self.layout = layout if self.F > 1 else "contiguous"  # one fragment: the order does not matter
        self.masters = [master for _, _, master, _, _, _ in dist_opt.owned]  # fp32 views, whole buckets
        self.numel = sum(m.numel() for m in self.masters)
        device = self.masters[0].device
        # Pieces of the masters, each (master index, start, end, parameter), covering every element: a
        # bucket's padding goes with the parameter before it (the first piece starts at the bucket's start).
        pieces, mask_parts, rep_parts, tied_parts, n_tied = [], [], [], [], 0
        for i, (_, b, master, _, _, _) in enumerate(dist_opt.owned):
            keep = torch.zeros(master.numel(), dtype=torch.bool, device=device)
            # copies that must stay equal: parameters replicated over TP, and a tied embedding's copies
            # (0: neither; 1: replicated over TP; 2: a tied copy, numbered by its order on this rank)
            rep = torch.zeros(master.numel(), dtype=torch.bool, device=device)
            tied = torch.zeros(master.numel(), dtype=torch.int8, device=device)
            spans = sorted(zip(b.ranges, b.params), key=lambda x: x[0][0])
            for k, ((s, e), p) in enumerate(spans):
                end = spans[k + 1][0][0] if k + 1 < len(spans) else master.numel()
                pieces.append((i, 0 if k == 0 else s, end, p))
                if counts is None or counts(p):
                    keep[s:e] = True
                if getattr(p, "shared_embedding", False):
                    n_tied += 1
                    tied[s:e] = n_tied
                elif not getattr(p, "tensor_parallel", False):
                    rep[s:e] = True
            mask_parts.append(keep)
            rep_parts.append(rep)
            tied_parts.append(tied)
        # The outer vector: the masters' pieces in fragment order, so that every fragment is one range of it
        # (for "contiguous" that is the masters' own order).
        if self.layout == "strided":
            frag = self._strided_fragments(dist_opt.ddp, [p for *_, p in pieces])
            order = sorted(range(len(pieces)), key=lambda k: (frag[k], k))
        else:
            frag, order = None, list(range(len(pieces)))
        self._segments, ends, cursor = [], [], 0  # (outer offset, master index, start, end)
        for k in order:
            i, s, e, _ = pieces[k]
            self._segments.append((cursor, i, s, e))
            cursor += e - s
            ends.append(cursor)
        assert cursor == self.numel, (cursor, self.numel)  # every master element in exactly one piece
        # the elements NOT counted in the outer-step norm: (numel,) bool, 1 byte per element (a fp32 mask was 4)
        self._norm_skip = torch.cat([mask_parts[i][s:e] for _, i, s, e in self._segments]).logical_not_()
        # int8 and top-k compress each element depending on its neighbours (a chunk's scale, the top-k
        # selection), so copies that must stay equal would drift apart: after each sync their averaged
        # pseudo-gradients are averaged once more over the copies (_equalise). Elementwise compressions
        # (none, bf16) give equal copies equal results already. Which elements those are is found once here
        # from two masks that are then dropped (they were kept for the run until 2026-11-28: 2 bytes per element).
        rep_mask = torch.cat([rep_parts[i][s:e] for _, i, s, e in self._segments])  # (numel,) bool
        tied_ids = torch.cat([tied_parts[i][s:e] for _, i, s, e in self._segments])  # (numel,) 0 / 1 / 2
        del mask_parts, rep_parts, tied_parts
        self.tp_group = tp_group if tp_group is not None and tp_group.size > 1 else None
        self.embedding_group = embedding_group if embedding_group is not None and embedding_group.size > 1 else None
        self.norm_groups = tuple(g for g in norm_groups if g is not None)
        if frag is None:
            self._check_cut(len(ends), device)
            self.bounds = self._cut(ends)
        else:  # fragment f: the pieces assigned to it, consecutive in the outer order (possibly none)
            sizes = [0] * self.F
            for k in order:
                sizes[frag[k]] += pieces[k][2] - pieces[k][1]
            edges = [sum(sizes[:f]) for f in range(self.F + 1)]
            self.bounds = [(edges[f], edges[f + 1]) for f in range(self.F)]
        self.anchor = self._read(0, self.numel)  # (numel,) fp32, a tensor of its own
        self.mom = torch.zeros_like(self.anchor) if momentum > 0 else None
        self.error = torch.zeros_like(self.anchor) if compression == "topk" else None
        self.pending: list[_Pending] = []
        self.syncs = 0  # fragment synchronisations applied
        # per fragment, the positions _equalise averages (fixed with the layout: found once, not per sync)
        self._equal_idx = [self._equal_positions(rep_mask[lo:hi], tied_ids[lo:hi]) for lo, hi in self.bounds] \
            if self.compression in ("int8", "topk") else None

    # -- layout ----------------------------------------------------------------------------------------
    def _strided_fragments(self, ddp, params: list) -> list[int]:
        """The fragment of each of ``params`` under the strided layout: block ``l`` -> ``l % F``; a parameter
        outside the blocks goes with the first block of its model chunk when registered before it
        (embeddings), else with the chunk's last block (final norm, output layer); a chunk without blocks
        goes to fragment 0. A tied embedding's copies (``shared_embedding``: the first stage's embedding and
        the last stage's output layer) both go to fragment 0, so they sync at the same step."""
        layer_of, before = {}, {}
        for name, p in ddp.module.named_parameters():
            chunk = name.split(".", 1)[0] if isinstance(ddp.module, torch.nn.ModuleList) else ""
            hit = _LAYER.search(name)
            if hit:
                layer_of[id(p)] = int(hit.group(1))
                first, last = before.get(chunk, (None, None))
                before[chunk] = (first if first is not None else int(hit.group(1)), int(hit.group(1)))
            else:
                layer_of[id(p)] = (chunk, chunk in before)  # (chunk, registered after a block?)
        out = []
        for p in params:
            where = layer_of[id(p)]
            if getattr(p, "shared_embedding", False):  # both tied copies with the embedding's block 0: one sync
                where = 0
            elif isinstance(where, tuple):
                first, last = before.get(where[0], (0, 0))
                where = last if where[1] else first
            out.append(where % self.F)
        return out

    def _check_cut(self, pieces: int, device) -> None:
        """The contiguous cut needs at least ``F`` parameters on every rank. Pipeline stages (and TP shards)
        hold different parameters, so the smallest count is agreed first (one MIN all-reduce of one integer
        over tp, then pp: the whole model-parallel grid; dp and cp replicas hold the same pieces) and every
        rank raises the same error, said once by the launcher, instead of one stage raising while the others
        wait for it in their first collective."""
        fewest = torch.tensor([pieces], dtype=torch.int64, device=device)  # the run's device (NCCL: no CPU)
        for g in self.norm_groups:
            comm.all_reduce(fewest, g, op="min")
        fewest = int(fewest.item())
        if self.F > fewest:
            err = ValueError(f"outer.fragments={self.F} exceeds the {fewest} parameters of the model chunks of a "
                             f"pipeline stage (outer.fragment_layout='contiguous' cuts each stage's parameters "
                             f"into F ranges of whole parameters); lower outer.fragments to {fewest} or less, or "
                             "use outer.fragment_layout='strided'")
            err.on_every_rank = True
            raise err

    def _cut(self, ends: list[int]) -> list[tuple[int, int]]:
        """``F`` contiguous ranges of about ``numel / F`` elements each, cut at parameter ends (at least ``F``
        of them: :meth:`_check_cut`)."""
        cuts, start = [], 0
        for f in range(1, self.F):
            target = self.numel * f / self.F
            left = [e for e in ends if e > start and len(ends) - ends.index(e) - 1 >= self.F - f]
            best = min(left, key=lambda e: abs(e - target))
            cuts.append(best)
            start = best
        edges = [0, *cuts, self.numel]
        return [(edges[i], edges[i + 1]) for i in range(self.F)]

    def _spans(self, lo: int, hi: int):
        """``(masters' slice, start, stop)`` for each piece of the outer vector's elements ``[lo, hi)``, in order;
        ``start``/``stop`` relative to ``lo``."""
        for o, i, s, e in self._segments:
            a, z = max(lo, o), min(hi, o + e - s)
            if a < z:
                yield self.masters[i][s + a - o:s + z - o], a - lo, z - lo

    def _read(self, lo: int, hi: int, *, unit: int = 1) -> torch.Tensor:
        """The masters' elements ``[lo, hi)`` of the outer vector, as a new fp32 tensor padded with zeros to a
        multiple of ``unit`` (the compressed reduction's: see :meth:`_unit`; it encodes the tensor in place, so a
        sync needs no padded copy of the pseudo-gradient): ``(pad(hi - lo, unit),)``, the weights in its head."""
        n = hi - lo
        out = self.masters[0].new_empty(_pad_to(n, unit))
        out[n:].zero_()
        copied = 0
        for src, a, z in self._spans(lo, hi):
            out[a:z].copy_(src)
            copied += z - a
        assert copied == n, f"the outer vector's segments cover {copied} of [{lo}, {hi}): none may stay unread"
        return out

    def _unit(self) -> int:
        """What a sync pads its pseudo-gradient to: bf16 the dp size, int8 dp size x chunk (each rank reduces one
        equal share), else nothing."""
        p = self.group.size
        return {"bf16": p, "int8": p * self.chunk}.get(self.compression, 1) if p > 1 else 1

    def _write(self, lo: int, hi: int, values: torch.Tensor) -> None:
        for dst, a, z in self._spans(lo, hi):
            dst.copy_(values[a:z])

    def phase(self, fragment: int) -> int:
        """The residue (mod H) of the steps counted from ``start_step`` after which ``fragment`` sends its
        pseudo-gradient (:func:`fragment_phase`)."""
        return fragment_phase(fragment, self.H, self.F)

    def phase_name(self, step: int) -> str:
        """What inner step ``step`` (1-based) runs as: ``"ddp_warmup"`` (plain data parallelism, step <=
        ``start_step``) or the method (local steps)."""
        return "ddp_warmup" if step <= self.start_step else self.method

    def describe(self) -> str:
        """One line for the start of the log: the method, its schedule and the warm-up."""
        frags = (f", {self.F} fragments ({self.layout}), mix {self.mix}, each reduction overlapping {self.overlap} "
                 f"inner step{'s' if self.overlap > 1 else ''}" if self.method == "streaming_diloco" else "")
        line = (f"tessel: outer {self.method}, H={self.H}{frags}, outer lr {self.lr}, momentum {self.momentum}"
                f"{' (nesterov)' if self.nesterov and self.momentum else ''}, compression {self.compression}")
        if self.start_step:
            line += (f"; steps 1-{self.start_step} plain data parallelism (outer.start_step={self.start_step}), "
                     f"the outer loop from step {self.start_step}'s weights")
        if self.momentum_start_step:
            line += (f"; syncs up to step {self.momentum_start_step} take the plain average "
                     f"(outer.momentum_start_step={self.momentum_start_step})")
        return line

    # -- compressed averaging ----------------------------------------------------------------------------
    def _start_average(self, buf: torch.Tensor, lo: int, hi: int):
        """Launch the dp average of the pseudo-gradient of the fragment ``[lo, hi)``, ``buf[:hi - lo]`` (``buf``:
        :meth:`_read`'s, padded to :meth:`_unit` with zeros; bf16 and int8 encode it in place); returns
        ``finish() -> mean``."""
        p, g, n = self.group.size, self.group, hi - lo
        delta = buf[:n]
        if n == 0:  # a fragment with no parameters on this rank (strided layout under pp): nothing to send
            return lambda: delta
        if p == 1:
            if self.error is not None:  # top-k still drops what it does not send, even alone
                return self._topk_local(delta, lo, hi)
            return lambda: delta
        if self.compression == "none":
            work = comm.all_reduce(delta, g, async_op=True)
            return lambda: (comm.wait(work, g), delta.div_(p))[1]
        if self.compression in ("bf16", "int8"):
            # buf: (n_pad,), n_pad divisible by p (bf16) or p x chunk (int8); encoded in place, then dropped: a
            # sync holds the pseudo-gradient once, plus the payload (until 2026-11-29 a padded copy of it, the
            # encoding's fp32 temporaries and the decoded shards' concatenation too: 16 bytes per element
            # with int8 at dp 2-4, now 6-7; the same operations, the same bits)
            n_pad = buf.numel()
            payload = self._encode(buf)  # tensors, each dim 0 divisible by p
            del buf, delta
            started = [comm.all_to_all(t, g, async_op=True) for t in payload]
            del payload

            def finish():
                comm.wait([w for _, w in started], g)
                pieces = [out.view(p, -1) for out, _ in started]  # each (p, n_pad / p) from every rank
                started.clear()
                shard = None
                for r in range(p):  # rank order from 0, as sum() over the decoded pieces did (0 + -0.0 = 0.0)
                    d = self._decode([pc[r] for pc in pieces])  # fp32 (n_pad / p,), new
                    shard = d.add_(0.0) if shard is None else shard.add_(d)
                    del d
                del pieces
                gathered = [comm.all_gather(t, g) for t in self._encode(shard)]  # each (p * n_pad / p,)
                del shard
                full = torch.empty(n_pad, dtype=torch.float32, device=gathered[0].device)
                for r, dst in enumerate(full.view(p, -1)):  # rank r's shard decoded into its place
                    self._decode_into(dst, [t.view(p, -1)[r] for t in gathered])
                return full[:n].div_(p)
            return finish
        return self._topk(delta, lo, hi)

    def _encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The payload of ``x`` (fp32, dim 0 divisible by the chunk for int8), which int8 overwrites: the
        scaling, rounding and clamping run in place (the values of the out-of-place expression, bit for bit)."""
        if self.compression == "bf16":
            return [x.to(torch.bfloat16)]
        chunks = x.view(-1, self.chunk)  # (n / chunk, chunk)
        # max |x| per chunk, as max(max x, -min x): no fp32 copy of |x|; (n / chunk,)
        scale = torch.maximum(chunks.amax(dim=1), chunks.amin(dim=1).neg_()).clamp_(min=1e-30).div_(127.0)
        q = chunks.div_(scale.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8).view(-1)  # (n,)
        return [q, scale]

    def _decode(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if self.compression == "bf16":
            return parts[0].to(torch.float32)
        q, scale = parts
        return (q.view(-1, self.chunk).to(torch.float32) * scale.unsqueeze(1)).view(-1)  # (n,)

    def _decode_into(self, out: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """:meth:`_decode` written into ``out`` (fp32, the parts' length): the same values, no new tensor."""
        if self.compression == "bf16":
            out.copy_(parts[0])
            return
        q, scale = parts
        out.view(-1, self.chunk).copy_(q.view(-1, self.chunk)).mul_(scale.unsqueeze(1))  # (n / chunk, chunk)

    def _topk_select(self, delta: torch.Tensor, lo: int, hi: int):
        err = self.error[lo:hi]
        err.add_(delta)  # pseudo-gradient + error feedback
        k = max(1, math.ceil(self.topk_fraction * err.numel()))
        idx = torch.topk(err.abs(), k, sorted=False).indices  # (k,)
        idx = idx.sort().values  # a deterministic order for the sum
        vals = err[idx].clone()  # (k,)
        err[idx] = 0.0  # sent: nothing left to feed back
        return vals, idx

    def _topk_local(self, delta, lo, hi):
        vals, idx = self._topk_select(delta, lo, hi)
        out = torch.zeros_like(delta)
        out[idx] = vals
        return lambda: out

    def _topk(self, delta: torch.Tensor, lo: int, hi: int):
        p, g = self.group.size, self.group
        vals, idx = self._topk_select(delta, lo, hi)
        gv, wv = comm.all_gather(vals, g, async_op=True)  # (p * k,)
        gi, wi = comm.all_gather(idx.to(topk_index_dtype(hi - lo)), g, async_op=True)  # (p * k,)

        def finish():
            comm.wait([wv, wi], g)
            out = torch.zeros_like(delta)
            for r in range(p):  # rank order: every replica adds in the same order
                k = vals.numel()
                out.index_add_(0, gi[r * k:(r + 1) * k].long(), gv[r * k:(r + 1) * k])
            return out.div_(p)
        return finish

    # -- the step --------------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Before inner step ``step`` (1-based): its dp gradients are all-reduced (the warm-up, ``step <=
        start_step``) or kept local. Derived from the step alone, so a resume needs no extra state."""
        self.dist.ddp.set_local_grads(step > self.start_step)

    @torch.no_grad()
    def step(self, step: int, *, final: bool = False) -> dict[str, float]:
        """After inner step ``step`` (1-based, counted by the trainer, applied or not): apply the fragments
        that are due, launch the ones whose turn it is. ``final`` (the run's last step, ``train.steps``):
        a Streaming fragment launched now is applied now, not one step later, so the run's final weights
        (and checkpoint) include it. Returns metrics: ``outer_step_norm`` (global L2 of
        the change of the shared weights, over the fragments applied now) and ``outer_syncs``; {} when idle.
        During the warm-up (``step <= start_step``) nothing; after step ``start_step`` the anchor is taken
        from the (synchronized) weights."""
        if step <= self.start_step:
            if step == self.start_step:
                self._restart()
            return {}
        applied_sq = None
        for pend in [pd for pd in self.pending if pd.due <= step or final]:  # the final step applies all
            sq = self._apply(pend)
            applied_sq = sq if applied_sq is None else applied_sq + sq
            self.pending.remove(pend)
        pend = None  # the applied result (a fragment-sized buffer) is freed before the launches below read weights
        for f in range(self.F):
            if (step - self.start_step) % self.H != self.phase(f):
                continue
            lo, hi = self.bounds[f]
            buf = self._read(lo, hi, unit=self._unit())  # (pad(hi - lo),) fp32, new: the pseudo-gradient over it
            torch.sub(self.anchor[lo:hi], buf[:hi - lo], out=buf[:hi - lo])
            pend = _Pending(fragment=f, due=sync_due(self.method, step, final=final, overlap=self.overlap),
                            finish=self._start_average(buf, lo, hi))
            del buf  # held by the reduction only (a compressed one encodes it in place and keeps its own buffers)
            if pend.due <= step:
                sq = self._apply(pend)
                applied_sq = sq if applied_sq is None else applied_sq + sq
            else:
                self.pending.append(pend)
        if applied_sq is None:
            return {}
        self.dist.refresh_params()  # masters -> parameters (bf16 casts)
        for g in self.norm_groups:
            comm.all_reduce(applied_sq, g)
        return {"outer_step_norm": float(applied_sq.sqrt()), "outer_syncs": float(self.syncs)}

    def _equal_positions(self, rep_mask: torch.Tensor, tied_ids: torch.Tensor):
        """``(rep, a, b)`` of one fragment, from its slices of the TP-replicated mask and the tied-copy ids: the
        TP-replicated positions (an index tensor; None without tp or none there; the same positions on every TP
        rank), and the first and second tied copy's (each one parameter, so one ``slice``, not an index tensor
        of 8 bytes per element of the embedding; None where this rank holds none)."""
        def span(mask):
            idx = mask.nonzero().squeeze(1)
            if not idx.numel():
                return None
            lo, hi = int(idx[0]), int(idx[-1]) + 1
            assert hi - lo == idx.numel(), "a tied copy's elements are one range of the outer vector"
            return slice(lo, hi)
        rep = rep_mask.nonzero().squeeze(1) if self.tp_group is not None else None
        return (rep if rep is not None and rep.numel() else None, span(tied_ids == 1), span(tied_ids == 2))

    def _equalise(self, avg: torch.Tensor, fragment: int) -> None:
        """Average, in place, the elements of ``avg`` (fragment ``fragment``'s) that belong to copies which
        must stay equal, over the copies: TP-replicated parameters over tp; a tied embedding's two copies on
        this rank (V placement), then over the embedding group (first and last pipeline stage). Only after a
        compression that is not elementwise (int8, top-k); every rank of each group calls it at the same
        sync (a tied embedding's copies are in the same fragment, fragment 0)."""
        if self._equal_idx is None:
            return
        rep, a, b = self._equal_idx[fragment]
        if rep is not None:
            comm.average_at(avg, rep, self.tp_group)
        if a is not None and b is not None:  # both copies on this rank
            avg[a] = avg[b] = (avg[a] + avg[b]) / 2
        elif self.embedding_group is not None and a is not None:
            comm.average_at(avg, a, self.embedding_group)

    def _apply(self, pend: _Pending) -> torch.Tensor:
        lo, hi = self.bounds[pend.fragment]
        # (hi - lo,) fp32, a tensor of its own (no reduction keeps it): the update is computed in it, in place,
        # so a sync holds one fragment-sized buffer beyond the state, two with mix < 1 (until 2026-11-28 up to six
        # at once: the average, the update, the change, the weights read back, the squares and their masked copy;
        # the same operations, the same bits)
        avg = pend.result if pend.result is not None else pend.finish()
        self._equalise(avg, pend.fragment)
        lr = self.lr
        if pend.due <= self.momentum_start_step:  # the plain average (outer lr 1, momentum untouched: zero)
            lr = 1.0
        elif self.mom is not None:
            m = self.mom[lo:hi]
            m.mul_(self.momentum).add_(avg)
            if self.nesterov:
                avg.add_(m, alpha=self.momentum)
            else:
                avg.copy_(m)
        change = avg.mul_(lr)  # global - anchor = -change
        self.anchor[lo:hi].sub_(change)
        if self.mix != 1.0:
            theta = self._read(lo, hi)
            theta.mul_(1.0 - self.mix).add_(self.anchor[lo:hi], alpha=self.mix)
            self._write(lo, hi, theta)
        else:
            self._write(lo, hi, self.anchor[lo:hi])
        self.syncs += 1
        # the counted elements' squares, in place (zeroed where not counted: the same values as a multiply by
        # a 0/1 mask wherever the change is finite)
        return change.square_().masked_fill_(self._norm_skip[lo:hi], 0.0).sum().reshape(1)  # (1,)

    def state_bytes(self) -> int:
        """Bytes of the state this object keeps for the run, beyond the inner optimizer's (what
        engine.memory.method_state_bytes predicts; the memory report adds it to the optimizer figure): the anchor,
        the momentum (``momentum > 0``), the top-k error feedback, the norm mask and, with int8 or top-k, the
        TP-replicated positions. Reductions in flight are not counted (each a fragment-sized result held
        between steps: one at a time with ``overlap_steps`` 1, up to every fragment's with more)."""
        out = [self.anchor, self.mom, self.error, self._norm_skip]
        for rep, _, _ in self._equal_idx or ():
            out.append(rep)
        return sum(t.numel() * t.element_size() for t in out if t is not None)

    # -- state (checkpoints) -----------------------------------------------------------------------------
    def settle(self) -> None:
        """Wait for reductions in flight and keep their results (before a checkpoint): the values and the
        step they are applied at do not change, so a resume continues bitwise."""
        for pend in self.pending:
            if pend.result is None:
                pend.result = pend.finish()

    def state_dict(self) -> dict:
        self.settle()
        return {"syncs": self.syncs, "pending": [{"fragment": p.fragment, "due": p.due} for p in self.pending],
                "fragments": self.F, "layout": self.layout, "start_step": self.start_step,
                "momentum_start_step": self.momentum_start_step, "overlap_steps": self.overlap,
                "inner_steps": self.H}

    def _restart(self) -> None:
        """Start the outer loop from the current weights: anchor = masters, no momentum, error or reduction."""
        self.anchor.copy_(self._read(0, self.numel))
        for t in (self.mom, self.error):
            if t is not None:
                t.zero_()
        self.pending, self.syncs = [], 0

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's tensors (fixed shapes, so a load can allocate them before reading): the anchor,
        momentum, error feedback, the results in flight (``pending``, at their fragments' ranges) and, as
        replicas differ between synchronisations, the replica's own inner state: fp32 masters and Adam
        moments. Call :meth:`state_dict` first (it settles the reductions in flight)."""
        out = {"anchor": self.anchor}
        if self.mom is not None:
            out["momentum"] = self.mom
        if self.error is not None:
            out["error"] = self.error
        if self.method == "streaming_diloco":
            pending = torch.zeros_like(self.anchor)
            for pend in self.pending:
                lo, hi = self.bounds[pend.fragment]
                pending[lo:hi] = pend.result
            out["pending"] = pending
        out["local.master"] = self._read(0, self.numel)
        out["local.exp_avg"] = torch.cat([m for _, _, _, m, _, _ in self.dist.owned])
        out["local.exp_avg_sq"] = torch.cat([v for _, _, _, _, v, _ in self.dist.owned])
        return out

    def load_state(self, state: dict | None, tensors: dict[str, torch.Tensor] | None) -> None:
        """Restore from :meth:`state_dict` / :meth:`state_tensors` (fresh copies); ``None`` (a checkpoint
        written without the outer optimizer): start the outer loop from the loaded weights."""
        if state is None or tensors is None:
            self._restart()
            return
        saved = (int(state.get("fragments", self.F)), state.get("layout", "contiguous"))  # older: contiguous
        if saved != (self.F, self.layout):
            raise ValueError(f"the checkpoint's outer state is laid out as outer.fragments={saved[0]}, "
                             f"outer.fragment_layout={saved[1]!r}, this run as outer.fragments={self.F}, "
                             f"outer.fragment_layout={self.layout!r}: its "
                             "anchor, momentum and reductions in flight are per fragment; resume with the saved "
                             "values")
        # (key, the value a checkpoint written before the key was saved has (None: not checked), this run's, why)
        for key, older, mine, why in (
                ("start_step", 0, self.start_step, "the anchor and the sync steps count from there"),
                ("momentum_start_step", 0, self.momentum_start_step, "the momentum buffer was kept under it"),
                ("inner_steps", None, self.H, "the reductions in flight and the fragments' turns follow its cycle"),
                ("overlap_steps", 1, self.overlap, "the reductions in flight are due at its schedule")):
            saved_value = state.get(key, older)
            if saved_value is not None and int(saved_value) != mine:
                raise ValueError(f"the checkpoint's outer state was saved with outer.{key}={int(saved_value)}, this "
                                 f"run has outer.{key}={mine}: {why}; resume with the saved value")
        self.syncs = int(state["syncs"])
        self.anchor.copy_(tensors["anchor"])
        if self.mom is not None:
            self.mom.copy_(tensors["momentum"])
        if self.error is not None:
            self.error.copy_(tensors["error"])
        self.pending = []
        for p in state["pending"]:
            lo, hi = self.bounds[int(p["fragment"])]
            self.pending.append(_Pending(fragment=int(p["fragment"]), due=int(p["due"]), finish=None,
                                         result=tensors["pending"][lo:hi].clone()))
        self._write(0, self.numel, tensors["local.master"])
        cursor = 0
        for _, _, _, m, v, _ in self.dist.owned:
            m.copy_(tensors["local.exp_avg"][cursor:cursor + m.numel()])
            v.copy_(tensors["local.exp_avg_sq"][cursor:cursor + v.numel()])
            cursor += m.numel()
        self.dist.refresh_params()
