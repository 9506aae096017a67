"""Compressed gradient reduction for plain data parallelism: PowerSGD and 1-bit sign compression.

A compressor replaces :class:`parallel.data_parallel.DataParallel`'s bucketed all-reduce
(``DataParallel(grad_compressor=...)``, ZeRO off): when a bucket's gradients are final, the DDP hook
calls :meth:`GradCompressor.reduce` on the bucket's fp32 gradient, which leaves there the (approximate)
SUM over the dp group; DataParallel then divides by the group size as usual. Each call communicates
synchronously over ``dp_group`` through :mod:`parallel.comm`, so the ledger counts every byte on that
axis. Both keep per-rank error-feedback buffers (the part of the gradient the compression dropped is
added to the next step's gradient), which a checkpoint saves (:meth:`state_tensors`).

* :class:`PowerSGD` (Vogels, Karimireddy & Jaggi, 2019): each 2-D gradient ``M`` (m, n), plus its error
  feedback, is approximated by ``P Q^T`` of rank ``r``: ``P = sum_ranks(M Q)`` (m, r), orthonormalised,
  then ``Q = sum_ranks(M^T P)`` (n, r); ``Q`` is kept for the next step (warm start: one power
  iteration per step). Per matrix and step that is ``r * (m + n)`` fp32 elements all-reduced;
  1-D gradients (norms, biases), and every matrix whose factors would not be smaller than the matrix
  (``r * (m + n) >= m * n``, :func:`powersgd_compresses`: the break-even point; torch's ``powerSGD_hook``
  asks for a 2x saving by default, ``min_compression_rate=2``), are
  all-reduced uncompressed in the same call as the ``P`` s (exact, no error feedback).
  ``start_step`` (``optim.powersgd_start_step``, torch's ``start_powerSGD_iter``): the first
  ``start_step`` reductions of each bucket are a plain all-reduce (error feedback and ``Q`` untouched).
* :class:`OneBit` (1-bit SGD, Seide et al. 2014; EF-signSGD, Karimireddy et al. 2019): the bucket plus
  its error feedback is cut into chunks of ``chunk`` elements; each chunk sends its signs (1 bit each,
  packed 8 per byte) and one fp32 scale (the chunk's mean absolute value). Every rank all-gathers every
  rank's bits and scales and sums them locally, so all replicas decode the same gradient.
"""
from __future__ import annotations

import zlib

import torch

from parallel import comm
from parallel.comm import Group

GRAD_COMPRESSIONS = ("none", "powersgd", "onebit")
DEFAULT_ONEBIT_CHUNK = 1024
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


class GradCompressor:
    """The interface DataParallel calls: :meth:`attach` once (layout, validation: before any
    communication), :meth:`reduce` per bucket and step. State for checkpoints: :meth:`state_tensors`."""

    name = "base"

    def attach(self, ddp) -> None:
        raise NotImplementedError

    def reduce(self, key: tuple[int, int], grad: torch.Tensor, bucket) -> None:
        raise NotImplementedError

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Per-rank state (error feedback, warm-start factors) by name, fixed shapes."""
        raise NotImplementedError

    def state_bytes(self) -> int:
        """Bytes this compressor keeps for the run (what engine.memory.predict_memory predicts as its
        ``method_state_bytes``): :meth:`state_tensors` plus any fixed layout tensors."""
        return sum(t.numel() * t.element_size() for t in self.state_tensors().values())

    def state_dict(self) -> dict:
        return {"method": self.name}

    def load_state(self, state: dict | None, tensors: dict[str, torch.Tensor] | None) -> None:
        """Copy saved :meth:`state_tensors` back; ``None`` (saved without compression): keep the fresh state."""
        if tensors is None:
            return
        for k, t in self.state_tensors().items():
            t.copy_(tensors[k])


def powersgd_compresses(rank: int, m: int, n: int) -> bool:
    """Whether PowerSGD of ``rank`` compresses an ``(m, n)`` matrix: only where the factors it sends,
    ``rank * (m + n)`` elements, are fewer than the matrix's ``m * n`` (never where ``rank > min(m, n)``)."""
    return rank * (m + n) < m * n


def powersgd_max_rank(m: int, n: int) -> int:
    """The largest rank that still compresses an ``(m, n)`` matrix (0: none does)."""
    return max(0, -(-(m * n) // (m + n)) - 1)  # ceil(m n / (m + n)) - 1


class PowerSGD(GradCompressor):
    """Rank-``rank`` PowerSGD with error feedback and warm start over ``dp_group`` (see the module docstring).

    ``seed`` draws the initial ``Q`` of every matrix from its own generator (the same on every dp rank,
    and independent of the training RNG streams)."""

    name = "powersgd"

    def __init__(self, *, rank: int, dp_group: Group, seed: int = 0, start_step: int = 0, checked: bool = False):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"optim.powersgd_rank={rank!r} must be an integer >= 1 (e.g. 4)")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"optim.powersgd_start_step={start_step!r} must be an integer >= 0 (0: compress "
                             "from the first step)")
        self.rank = rank
        self.group = dp_group
        self.seed = seed
        self.start_step = start_step  # reductions (steps) per bucket run as a plain all-reduce first
        # the whole layout's matrices were checked (check_powersgd_rank): a pipeline stage whose own matrices
        # are all too small to compress is then no error (they go uncompressed)
        self.checked = checked
        self.steps: dict[tuple[int, int], int] = {}  # bucket key -> reductions done (warm-up bookkeeping)
        self.error: dict[str, torch.Tensor] = {}  # name -> (m, n) or (k,) error feedback (matrices only)
        self.q: dict[str, torch.Tensor] = {}  # name -> (n, r) warm-start factor
        self._layout: dict[tuple[int, int], list[tuple[str, int, int, tuple[int, ...]]]] = {}

    def attach(self, ddp) -> None:
        for bi, buf in enumerate(ddp.flat_buffers):
            for b in buf.buckets:
                entries = []
                for p, (s, e) in zip(b.params, b.ranges):
                    name = ddp.param_names[id(p)]
                    shape = tuple(p.shape)
                    if len(shape) == 2 and powersgd_compresses(self.rank, *shape):
                        m, n = shape
                        # seeded by the parameter's name (the same on every dp rank); the two copies of a tied
                        # embedding (first and last pipeline stage, different names) by one shared key, so
                        # they start from the same Q and stay equal
                        key = "shared_embedding" if getattr(p, "shared_embedding", False) else name
                        g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(key.encode()))
                        self.q[name] = torch.randn(n, self.rank, generator=g).to(buf.device)  # (n, r)
                        self.error[name] = torch.zeros(m, n, dtype=torch.float32, device=buf.device)
                    entries.append((name, s, e, shape))
                self._layout[(bi, b.index)] = entries
        if not self.q and not self.checked:  # standalone use (engine.assembly checks the layout first)
            mats = [tuple(p.shape) for buf in ddp.flat_buffers for b in buf.buckets for p in b.params if p.dim() == 2]
            if mats:
                best = max(powersgd_max_rank(m, n) for m, n in mats)
                raise ValueError(f"optim.powersgd_rank={self.rank} compresses none of these matrices (a rank-r "
                                 "factor pair is smaller than an (m, n) matrix only where r (m + n) < m n): every "
                                 "gradient would go uncompressed; "
                                 + (f"set optim.powersgd_rank <= {best}" if best else
                                    "no rank compresses them; use optim.grad_compression=onebit or none"))

    def reduce(self, key, grad, bucket) -> None:
        done = self.steps.get(key, 0)
        self.steps[key] = done + 1
        if done < self.start_step:  # warm-up (torch's start_powerSGD_iter): exact sum, error and Q untouched
            comm.all_reduce(grad, self.group)
            return
        entries = self._layout[key]
        mats = [(name, grad[s:e].view(shape)) for name, s, e, shape in entries if name in self.q]
        # 1-D gradients and the matrices PowerSGD would not shrink (powersgd_compresses): summed exactly
        vecs = [grad[s:e] for name, s, e, shape in entries if name not in self.q]
        with torch.no_grad():
            # M = gradient + error feedback (m, n), new tensors: the error is replaced only once the step is
            # known finite everywhere, so one non-finite gradient does not poison it for the rest of the run.
            ms = [self.error[name] + g for name, g in mats]
            ps = [m @ self.q[name] for (name, _), m in zip(mats, ms)]  # each (m, r)
            flat = torch.cat([p.reshape(-1) for p in ps] + [v.reshape(-1) for v in vecs]) if (ps or vecs) else None
            if flat is None:
                return
            comm.all_reduce(flat, self.group)  # sum of P over dp, plus the 1-D gradients uncompressed
            # A non-finite gradient on any rank makes the sums non-finite on every rank: the same verdict
            # everywhere, kept on the device (no host sync).
            ok = torch.isfinite(flat).all()
            sizes = [p.numel() for p in ps] + [v.numel() for v in vecs]
            parts = list(flat.split(sizes))
            for v, part in zip(vecs, parts[len(ps):]):
                v.copy_(part)
            if not ps:
                return
            p_hats = []
            for p, part in zip(ps, parts[:len(ps)]):
                safe = torch.where(ok, part.view(p.shape), 0.0)  # QR of a non-finite matrix may fail
                p_hat, _ = torch.linalg.qr(safe)  # (m, r) orthonormal columns
                p_hats.append(p_hat)
            qs = [m.t() @ p_hat for m, p_hat in zip(ms, p_hats)]  # each (n, r); discarded below if not ok
            qflat = torch.cat([q.reshape(-1) for q in qs])
            comm.all_reduce(qflat, self.group)  # sum of Q over dp
            p_size = self.group.size
            for (name, g), m, p_hat, q, part in zip(mats, ms, p_hats, qs, qflat.split([q.numel() for q in qs])):
                q_sum = part.view(q.shape)  # (n, r)
                approx_sum = p_hat @ q_sum.t()  # (m, n): the rank-r estimate of the SUM of M over dp
                g.copy_(torch.where(ok, approx_sum, float("nan")))  # non-finite: the optimizer sees it and skips
                # error feedback: what this rank's share lost; kept as it was on a non-finite step
                self.error[name] = torch.where(ok, m.sub_(approx_sum, alpha=1.0 / p_size), self.error[name])
                self.q[name] = torch.where(ok, q_sum, self.q[name])  # warm start for the next step

    def bytes_per_step(self) -> dict[str, int]:
        """Elements all-reduced per step: ``{"matrices": sum of r * (m + n) over the compressed matrices,
        "uncompressed": the sizes of the 1-D gradients and of the matrices sent whole}``."""
        ents = [e for es in self._layout.values() for e in es]
        mat = sum(self.rank * (shape[0] + shape[1]) for name, _, _, shape in ents if name in self.q)
        raw = sum(e - s for name, s, e, _ in ents if name not in self.q)
        return {"matrices": mat, "uncompressed": raw}

    def uncompressed_matrices(self) -> list[str]:
        """The names of the matrices sent whole (``r * (m + n) >= m * n``), for the start-up log."""
        return [name for es in self._layout.values() for name, _, _, shape in es
                if len(shape) == 2 and name not in self.q]

    def state_dict(self) -> dict:
        return {"method": self.name, "steps": [[k[0], k[1], n] for k, n in sorted(self.steps.items())]}

    def load_state(self, state: dict | None, tensors: dict[str, torch.Tensor] | None) -> None:
        super().load_state(state, tensors)
        if state is not None:  # older checkpoints carry no counters: the warm-up counts from the resume
            saved = {(int(a), int(b)): int(n) for a, b, n in state.get("steps", [])}
            # The JSON state is rank 0's: another pipeline stage may hold buckets rank 0 has not. Every bucket
            # reduces once per step, so the saved counters agree, and that count is every bucket's here
            # (before 2026-11-28 such a stage's extra buckets restarted the warm-up after a resume).
            counts = set(saved.values())
            if len(counts) == 1 and self._layout:
                n = counts.pop()
                self.steps = {k: n for k in self._layout}
            else:
                self.steps = saved

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name in self.q:
            out[f"error.{name}"] = self.error[name]
            out[f"q.{name}"] = self.q[name]
        return out


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """``x`` (n,), n % 8 == 0 -> (n/8,) uint8: bit i of byte j is ``x[8 j + i] >= 0``."""
    bits = (x >= 0).to(torch.uint8).view(-1, 8)  # (n/8, 8)
    return (bits * _BITS.to(x.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: (k,) uint8 -> (8 k,) float32 of +1/-1."""
    bits = (packed.unsqueeze(-1) & _BITS.to(packed.device)) != 0  # (k, 8)
    return bits.view(-1).to(torch.float32) * 2.0 - 1.0


class OneBit(GradCompressor):
    """1-bit sign compression with error feedback and per-chunk scales over ``dp_group`` (module docstring)."""

    name = "onebit"

    def __init__(self, *, dp_group: Group, chunk: int = DEFAULT_ONEBIT_CHUNK):
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 8 or chunk % 8:
            raise ValueError(f"onebit chunk={chunk!r} must be a multiple of 8 (signs are packed 8 per byte)")
        self.group = dp_group
        self.chunk = chunk
        self.error: dict[str, torch.Tensor] = {}  # "b<buffer>.<bucket>" -> (padded bucket numel,) fp32

    def padded(self, n: int) -> int:
        return -(-n // self.chunk) * self.chunk

    def attach(self, ddp) -> None:
        self.mask: dict[str, torch.Tensor] = {}  # key -> (n_pad,) bool: True on parameter elements, not padding
        # key -> positions of parameters replicated over TP: a chunk's scale mixes them with TP-sharded
        # neighbours, so each TP rank would decode them differently; their decoded sums are averaged over tp
        self.replicated: dict[str, torch.Tensor] = {}
        tp = getattr(ddp, "tp_group", None)
        self.tp_group = tp if tp is not None and tp.size > 1 else None
        for bi, buf in enumerate(ddp.flat_buffers):
            for b in buf.buckets:
                key = f"b{bi}.{b.index}"
                self.error[key] = torch.zeros(self.padded(b.numel), dtype=torch.float32, device=buf.device)
                mask = torch.zeros(self.padded(b.numel), dtype=torch.bool, device=buf.device)  # 1 byte per element
                rep = torch.zeros(b.numel, dtype=torch.bool, device=buf.device)
                for (s, e), p in zip(b.ranges, b.params):
                    mask[s:e] = True
                    rep[s:e] = not getattr(p, "tensor_parallel", False)
                self.mask[key] = mask
                if self.tp_group is not None and bool(rep.any()):
                    self.replicated[key] = rep.nonzero().squeeze(1)

    def reduce(self, key, grad, bucket) -> None:
        with torch.no_grad():
            n = grad.numel()
            k = f"b{key[0]}.{key[1]}"
            x = self.error[k].clone()  # (n_pad,); the error is replaced only once the step is known finite
            x[:n].add_(grad)  # gradient + error feedback
            chunks = x.view(-1, self.chunk)  # (n_pad / chunk, chunk)
            scales = chunks.abs().mean(dim=1)  # (n_pad / chunk,)
            bits = pack_signs(x)  # (n_pad / 8,)
            # padding (the bucket's and the chunks') decodes to 0: its sign bit (+) carries nothing
            mask = self.mask[k]
            # (where, not a multiply by a 0/1 mask: the same values where the scales are finite)
            decoded = torch.where(mask, (unpack_signs(bits).view(-1, self.chunk) * scales.unsqueeze(1)).view(-1),
                                  0.0)  # (n_pad,)
            all_bits = comm.all_gather(bits, self.group)  # (p * n_pad / 8,)
            all_scales = comm.all_gather(scales, self.group)  # (p * n_pad / chunk,)
            # a non-finite gradient on any rank makes its scales non-finite: the same verdict on every rank
            ok = torch.isfinite(all_scales).all()
            self.error[k] = torch.where(ok, x.sub_(decoded), self.error[k])  # what the sign and scale dropped
            p = self.group.size
            signs = unpack_signs(all_bits).view(p, -1, self.chunk)  # (p, n_pad / chunk, chunk)
            total = torch.where(mask, (signs * all_scales.view(p, -1, 1)).sum(dim=0).view(-1), 0.0)  # (n_pad,)
            idx = self.replicated.get(k)
            if idx is not None:  # the same bucket layout on every TP rank: all of them call it
                comm.average_at(total, idx, self.tp_group)
            grad.copy_(torch.where(ok, total[:n], float("nan")))  # non-finite: the optimizer skips

    def bytes_per_step(self, numels: list[int]) -> int:
        """Bytes this rank sends per step for buckets of ``numels`` under the ring all-gather model."""
        p = self.group.size
        return sum((p - 1) * (self.padded(n) // 8 + 4 * self.padded(n) // self.chunk) for n in numels)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"error.{k}": v for k, v in self.error.items()}

    def state_bytes(self) -> int:
        """The error feedback (4 bytes per padded element), the masks (1) and the TP-replicated positions (8
        per such element, tp > 1)."""
        return super().state_bytes() + sum(t.numel() * t.element_size()
                                           for t in (*self.mask.values(), *self.replicated.values()))


def check_powersgd_rank(modules, rank: int, world: Group, *, device) -> None:
    """Before the buckets are built: ``rank`` must compress at least one trainable matrix somewhere (a
    matrix it would not shrink, ``r (m + n) >= m n``, goes uncompressed: :func:`powersgd_compresses`).
    Pipeline stages and TP shards hold different matrices, so the largest rank that still compresses one
    is agreed with one MAX all-reduce over ``world`` (one int): every rank raises the same error, said once
    by the launcher (``on_every_rank``)."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    local = max((powersgd_max_rank(*p.shape) for p in params if p.dim() == 2), default=0)
    best = torch.tensor([local], dtype=torch.int64, device=device)  # the run's device: NCCL takes no CPU tensor
    comm.all_reduce(best, world, op="max")
    best = int(best.item())
    if rank > best:
        err = ValueError(f"optim.powersgd_rank={rank} exceeds the size of every trainable matrix of this model at "
                         f"this layout: a rank-r factor pair is smaller than an (m, n) matrix only where "
                         f"r (m + n) < m n, so no gradient would be compressed; set optim.powersgd_rank <= {best}"
                         if best else
                         f"optim.powersgd_rank={rank}: this model has no trainable matrix PowerSGD could compress at "
                         "this layout; use optim.grad_compression=onebit or none")
        err.on_every_rank = True
        raise err


def build_grad_compressor(method: str, *, dp_group: Group, rank: int = 4, seed: int = 0,
                          start_step: int = 0, checked: bool = False) -> GradCompressor | None:
    """``optim.grad_compression``: None for "none", else the compressor for ``dp_group`` (``checked``:
    :func:`check_powersgd_rank` has passed for the whole layout)."""
    if method == "none":
        return None
    if method == "powersgd":
        return PowerSGD(rank=rank, dp_group=dp_group, seed=seed, start_step=start_step, checked=checked)
    if method == "onebit":
        return OneBit(dp_group=dp_group)
    raise ValueError(f"optim.grad_compression={method!r} is not valid; choose one of {', '.join(GRAD_COMPRESSIONS)}")


def ring_all_reduce_bytes(numel: int, p: int, itemsize: int = 4) -> float:
    """Bytes one rank sends in a ring all-reduce of ``numel`` elements over ``p`` ranks (comm's model)."""
    return 0.0 if p == 1 else 2 * (p - 1) * numel * itemsize / p


__all__ = ["GRAD_COMPRESSIONS", "GradCompressor", "PowerSGD", "OneBit", "build_grad_compressor", "pack_signs",
           "check_powersgd_rank", "powersgd_compresses", "powersgd_max_rank",
           "unpack_signs", "ring_all_reduce_bytes"]
