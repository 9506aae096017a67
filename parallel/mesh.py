"""The process mesh: parallel degrees, each rank's coordinates, and the process group of every axis.

One :class:`Mesh` is built at start-up from :class:`ParallelDims` and passed explicitly to
everything that communicates. Global ranks are laid out by ``order`` (outermost axis first;
the default ``"dp-pp-cp-tp"`` puts tp innermost, so a TP group is consecutive ranks — one node's
NVLink domain on a GPU cluster).

Groups provided (all :class:`parallel.comm.Group`, sharing the mesh's :class:`Ledger`):

* ``tp``, ``pp``, ``dp``, ``cp``: ranks that differ only along that axis.
* ``dp_cp``: ranks that differ along dp and cp — the gradient-reduction group once CP lands.
* ``tp_cp``: ranks that differ along tp and cp (sequence is sharded over both).
* ``cp_a2a`` and ``cp_ring``: the hybrid context-parallel sub-groups (``cp_a2a_size`` of :meth:`Mesh.build`):
  each cp group cut into blocks of ``cp_a2a_size`` consecutive cp ranks (``cp_a2a``: all-to-all inside a
  block), and ``cp_ring`` linking the ranks with the same position in every block (the ring across).
  Without ``cp_a2a_size``, ``cp_a2a`` is this rank alone and ``cp_ring`` is the cp group.
* ``embedding``: first and last pipeline stage of this rank's pipeline (tied embedding /
  lm-head gradients are all-reduced over it); just this rank when pp == 1, on middle stages
  (which hold neither copy), and under the V placement (both copies on pp rank 0).
* ``dp_outer``: the ``dp_cp`` ranks on a communicator of their own when :meth:`Mesh.build` is asked for
  one (``separate_outer=True``: Streaming DiLoCo's outer reductions, parallel/data_parallel/outer.py), else
  ``dp_cp`` itself. On NCCL one communicator runs its collectives in order, so a fragment's all-reduce in
  flight would hold back every dp collective of the inner steps it should overlap. Its traffic is booked
  on the ``dp_cp`` axis; the flight recorder numbers its calls apart, as ``dp_outer``.
* ``ep`` and ``edp``: expert parallelism carves ``ep`` out of dp: the dp ranks are split into
  blocks of ``ep`` consecutive dp indices (``ep`` group, at one cp index), and ``edp`` links the ranks
  that hold the same experts: the same position in every block, at every cp index (expert-data-parallel
  gradient reduction and ZeRO sharding; group rank ``edp_index * cp + cp_index``, dp x cp / ep ranks).
"""
from __future__ import annotations

import datetime
import itertools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.comm import Group, Ledger

AXES = ("dp", "pp", "cp", "tp")
DEFAULT_ORDER = "dp-pp-cp-tp"


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Parallel degrees. ``ep`` divides ``dp`` (experts are sharded inside the data-parallel ranks)."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in ("dp", "pp", "cp", "tp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"parallel.{name}={v!r}: parallel degrees must be integers >= 1")
        if self.dp % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide parallel.dp={self.dp} "
                             "(expert parallelism shards experts across data-parallel ranks)")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                  dp: int = -1) -> "ParallelDims":
        """Degrees for ``world_size`` ranks, inferring dp when ``dp == -1``; clear error on mismatch."""
        for name, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"parallel.{name}={v!r}: parallel degrees must be integers >= 1")
        model = tp * pp * cp
        if dp == -1:
            if world_size % model:
                raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {model}; "
                                 f"launch a multiple of {model} processes or change the degrees")
            dp = world_size // model
        dims = cls(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep)
        if dims.world_size != world_size:
            raise ValueError(f"dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {dims.world_size} does not equal the world "
                             f"size {world_size}; launch {dims.world_size} processes (torchrun --nproc-per-node) "
                             "or change the degrees (set parallel.dp=-1 to infer dp)")
        return dims


def _parse_order(order: str) -> tuple[str, ...]:
    axes = tuple(a.strip() for a in order.split("-"))
    if sorted(axes) != sorted(AXES):
        raise ValueError(f"parallel.order={order!r} must be a permutation of {'-'.join(AXES)} "
                         f"(outermost first), e.g. {DEFAULT_ORDER!r}")
    return axes


class Mesh:
    """Coordinates and groups of this rank. Build with :meth:`build` (collective) or :meth:`single`."""

    def __init__(self, dims: ParallelDims, *, rank: int, order: str = DEFAULT_ORDER,
                 groups: dict[str, Group], ledger: Ledger, made: tuple = ()):
        self.dims = dims
        self.rank = rank
        self.order = _parse_order(order)
        self.ledger = ledger
        self._groups = groups
        self._made = list(made)  # the process groups build() made, in creation order (destroy())
        self.closed = False
        self.coords = coords_of(rank, dims, order)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def single(cls) -> "Mesh":
        """The 1-rank mesh: every group trivial; torch.distributed need not be initialised."""
        dims = ParallelDims()
        ledger = Ledger()
        groups = {name: Group.trivial(name, ledger=ledger) for name in _GROUP_AXES}
        groups["world"] = Group.trivial("world", ledger=ledger)
        groups["dp_outer"] = groups["dp_cp"]
        return cls(dims, rank=0, groups=groups, ledger=ledger)

    @classmethod
    def build(cls, dims: ParallelDims, *, order: str = DEFAULT_ORDER, cp_a2a_size: int | None = None,
              timeout_s: float | None = None, placement: str = "loop", separate_outer: bool = False) -> "Mesh":
        """Create every group (a collective call: all ranks must call it with the same arguments).
        ``cp_a2a_size``: the all-to-all block of hybrid context parallelism (divides ``dims.cp``).
        ``timeout_s``: how long a collective of the new groups waits for a missing peer before it raises
        (``fault.collective_timeout_s``; None: torch's default, 30 min for gloo; the world group keeps
        the timeout of :func:`init_distributed`). ``placement``: the pipeline's stage placement ("loop", or
        "v" for zbv/dualpipev), which decides the ``embedding`` group. ``separate_outer``: give ``dp_outer``
        its own process groups (the same ranks as ``dp_cp``)."""
        check_cp_a2a_size(cp_a2a_size, dims.cp)
        if not dist.is_initialized():
            if dims.world_size == 1:
                return cls.single()
            raise ValueError(f"torch.distributed is not initialised but the mesh needs {dims.world_size} ranks; "
                             "launch with torchrun or call parallel.mesh.init_distributed() first")
        world, rank = dist.get_world_size(), dist.get_rank()
        if dims.world_size != world:
            raise ValueError(f"dp*pp*cp*tp = {dims.dp}*{dims.pp}*{dims.cp}*{dims.tp} = {dims.world_size} does not "
                             f"equal the world size {world}; launch {dims.world_size} processes or change the degrees")
        _parse_order(order)
        # NCCL's collectives run on CUDA streams and do not block the host: time them with CUDA events.
        ledger = Ledger(clock="cuda" if dist.get_backend() == "nccl" else "wall")
        groups: dict[str, Group] = {}
        made: dict[tuple[int, ...], object] = {}  # identical rank lists share one process group
        for name in _GROUP_AXES:
            for ranks in group_rank_lists(name, dims, order, cp_a2a_size=cp_a2a_size, placement=placement):
                # new_group is collective over the whole world: every rank creates every group,
                # in the same order.
                key = tuple(ranks)
                if len(ranks) > 1 and key not in made:
                    made[key] = dist.new_group(ranks, timeout=None if timeout_s is None
                                               else datetime.timedelta(seconds=timeout_s))
                pg = made.get(key)
                if rank in ranks:
                    groups[name] = Group(axis=name, ranks=ranks, rank=ranks.index(rank), pg=pg, ledger=ledger)
            if name not in groups:  # e.g. a middle pipeline stage is in no embedding group
                groups[name] = Group.trivial(name, ledger=ledger, global_rank=rank)
        groups["dp_outer"] = groups["dp_cp"]
        outer_made = []
        if separate_outer:  # a second communicator over each dp_cp group (not shared with dp_cp's)
            for ranks in group_rank_lists("dp_cp", dims, order):
                if len(ranks) < 2:
                    continue
                pg = dist.new_group(ranks, timeout=None if timeout_s is None else datetime.timedelta(seconds=timeout_s))
                outer_made.append(pg)
                if rank in ranks:
                    groups["dp_outer"] = Group(axis="dp_cp", ranks=ranks, rank=ranks.index(rank), pg=pg, ledger=ledger,
                                               flight_axis="dp_outer")
        # Every rank (checkpoints, stop agreement): the default process group, no new one.
        groups["world"] = Group(axis="world", ranks=range(world), rank=rank,
                                pg=dist.group.WORLD if world > 1 else None, ledger=ledger)
        # this rank's own groups, in creation order (new_group hands a non-member NON_GROUP_MEMBER)
        made_here = tuple(pg for pg in [*made.values(), *outer_made]
                          if pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER)
        return cls(dims, rank=rank, order=order, groups=groups, ledger=ledger, made=made_here)

    def destroy(self) -> None:
        """Destroy the process groups :meth:`build` made (collective: every rank calls it, after its last
        collective on them). The default (world) group stays: the launcher owns it. Each group first runs
        a barrier, which on gloo and NCCL completes only after the work queued before it, so nothing in
        flight is cut off; the groups are taken in the order they were made, the same on every rank, so
        the barriers cannot wait on each other. Without this each build leaks its groups (gloo keeps
        threads and sockets per group): a process that trains several runs, as a test or a sweep does,
        slowed down by about half after a hundred builds."""
        for pg in self._made:  # this rank's groups (those it is a member of), in creation order
            dist.barrier(group=pg)
            dist.destroy_process_group(pg)
        self._made = []
        self.closed = True

    # -- access ----------------------------------------------------------------------------------
    def group(self, name: str) -> Group:
        self._check_open(name)
        try:
            return self._groups[name]
        except KeyError:
            raise ValueError(f"no group {name!r}; the mesh has {sorted(self._groups)}") from None

    def __getattr__(self, name: str) -> Group:
        groups = self.__dict__.get("_groups")
        if groups is not None and name in groups:
            self._check_open(name)
            return groups[name]
        raise AttributeError(name)

    def _check_open(self, name: str) -> None:
        g = self._groups.get(name)
        if self.__dict__.get("closed") and g is not None and g.pg is not None and name != "world":
            raise RuntimeError(f"mesh group {name!r} was destroyed by Mesh.destroy() (the run was closed); "
                               "build a new mesh (Mesh.build) for another run")

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.dims.pp - 1

    def __repr__(self) -> str:
        c = ", ".join(f"{a}={self.coords[a]}/{getattr(self.dims, a)}" for a in self.order)
        return f"Mesh(rank {self.rank}: {c})"


_GROUP_AXES = ("tp", "pp", "dp", "cp", "dp_cp", "tp_cp", "embedding", "ep", "edp", "cp_a2a", "cp_ring")


def check_cp_a2a_size(cp_a2a_size: int | None, cp: int) -> None:
    if cp_a2a_size is None:
        return
    if isinstance(cp_a2a_size, bool) or not isinstance(cp_a2a_size, int) or cp_a2a_size < 1 or cp % cp_a2a_size:
        raise ValueError(f"parallel.cp_a2a_size={cp_a2a_size!r} must be a divisor of parallel.cp={cp} (hybrid "
                         "context parallelism runs all-to-all inside blocks of that many cp ranks and a ring "
                         "across them)")


def _strides(dims: ParallelDims, order: str) -> dict[str, int]:
    axes = _parse_order(order)
    strides, s = {}, 1
    for a in reversed(axes):
        strides[a] = s
        s *= getattr(dims, a)
    return strides


def coords_of(rank: int, dims: ParallelDims, order: str = DEFAULT_ORDER) -> dict[str, int]:
    """Mesh coordinates of a global rank (plus derived ``ep``/``edp`` indices)."""
    if rank not in range(dims.world_size):
        raise ValueError(f"rank {rank} outside the world of {dims.world_size}")
    st = _strides(dims, order)
    c = {a: (rank // st[a]) % getattr(dims, a) for a in AXES}
    c["ep"] = c["dp"] % dims.ep
    c["edp"] = c["dp"] // dims.ep
    return c


def rank_of(coords: dict[str, int], dims: ParallelDims, order: str = DEFAULT_ORDER) -> int:
    st = _strides(dims, order)
    return sum(coords[a] * st[a] for a in AXES)


def group_rank_lists(name: str, dims: ParallelDims, order: str = DEFAULT_ORDER, *,
                     cp_a2a_size: int | None = None, placement: str = "loop") -> list[list[int]]:
    """Every group of kind ``name`` as a list of global ranks (each list in group-rank order).
    ``placement`` ("loop" or "v") places the pipeline stages: under the V placement (zbv, dualpipev) the
    first and the last stage both live on pp rank 0, so the ``embedding`` group is that rank alone (the
    tied copies are summed in-rank, parallel.pipeline.runtime.allreduce_tied_embedding_grads)."""
    if placement not in ("loop", "v"):
        raise ValueError(f"placement={placement!r} must be 'loop' or 'v'")
    if name in ("cp_a2a", "cp_ring"):
        a = cp_a2a_size or 1
        check_cp_a2a_size(a, dims.cp)
        out = []
        for cp_ranks in group_rank_lists("cp", dims, order):
            blocks = [cp_ranks[i:i + a] for i in range(0, dims.cp, a)]  # cp rank = block * a + position
            out += blocks if name == "cp_a2a" else [list(col) for col in zip(*blocks)]
        return out
    if name in AXES:
        varying = (name,)
    elif name == "dp_cp":
        varying = ("dp", "cp")
    elif name == "tp_cp":
        varying = ("cp", "tp")
    elif name in ("embedding", "ep", "edp"):
        varying = ()
    else:
        raise ValueError(f"unknown group kind {name!r}; known: {_GROUP_AXES}")
    fixed = [a for a in AXES if a not in varying]
    out: list[list[int]] = []
    if name == "embedding":
        for combo in itertools.product(*(range(getattr(dims, a)) for a in ("dp", "cp", "tp"))):
            c = dict(zip(("dp", "cp", "tp"), combo))
            stages = sorted({0, dims.pp - 1}) if placement == "loop" else [0]
            out.append([rank_of({**c, "pp": s}, dims, order) for s in stages])
        return out
    if name in ("ep", "edp"):
        n_blocks = dims.dp // dims.ep
        if name == "ep":
            for combo in itertools.product(*(range(getattr(dims, a)) for a in ("pp", "cp", "tp"))):
                c = dict(zip(("pp", "cp", "tp"), combo))
                for blk in range(n_blocks):
                    out.append([rank_of({**c, "dp": blk * dims.ep + i}, dims, order) for i in range(dims.ep)])
            return out
        # The cp ranks hold the same experts too (they route other tokens of the same sequences).
        for combo in itertools.product(*(range(getattr(dims, a)) for a in ("pp", "tp"))):
            c = dict(zip(("pp", "tp"), combo))
            for i in range(dims.ep):
                out.append([rank_of({**c, "dp": blk * dims.ep + i, "cp": k}, dims, order)
                            for blk in range(n_blocks) for k in range(dims.cp)])
        return out
    for combo in itertools.product(*(range(getattr(dims, a)) for a in fixed)):
        c = dict(zip(fixed, combo))
        ranks = []
        # Outer varying axis first, so group rank = dp_index * cp + cp_index for dp_cp.
        for vcombo in itertools.product(*(range(getattr(dims, a)) for a in varying)):
            ranks.append(rank_of({**c, **dict(zip(varying, vcombo))}, dims, order))
        out.append(ranks)
    return out


def init_distributed(*, backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...).

    Picks nccl when CUDA is available and gloo otherwise, and binds each rank to its local GPU.
    Returns (rank, world_size). A single process without torchrun's variables stays uninitialised.
    Under torchrun each restart attempt rendezvouses under its own store prefix (:func:`attempt_store`).
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = attempt_store(timeout)
    if store is None:  # no agent store (plain env://, or torchrun told not to share it): torch's own path
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    return dist.get_rank(), dist.get_world_size()


def attempt_store(timeout: datetime.timedelta):
    """The key-value store of this torchrun attempt: the agent's TCPStore seen through ``tessel/attempt_<n>/``.

    Why (issue 22): torchrun (torch >= 2.4) hosts one TCPStore in its agent and keeps it, on the same
    MASTER_PORT, across restarts (``TORCHELASTIC_USE_AGENT_STORE=True``); torch's ``env://`` path connects the
    workers of every attempt to it without a prefix ("we create a new TCPStore for every retry", a stale comment
    in torch/distributed/rendezvous.py). The new workers then find the previous attempt's keys -- gloo's
    per-rank addresses of the default group, the sub-groups' keys -- and a rank that reads a dead peer's
    address before the new peer overwrote it fails in ``connectFullMesh: connection refused`` (4 ranks: every
    restart, 4 of 4 tries). A prefix per attempt makes every attempt's keys new. ``TORCHELASTIC_RESTART_COUNT``
    numbers the attempts on one node only: on several nodes an agent whose workers are restarted because
    another node failed does not count it, so there the prefix could differ between nodes; a multi-node job
    that may restart must launch with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (each attempt's rank 0 then
    hosts a new store on a new port: no stale keys; tools/pretrain.sbatch sets it) and is refused otherwise.

    Returns None when torchrun's agent store is not in use (torch's own ``env://`` path is right then).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if nodes > 1 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise ValueError(f"torchrun --max-restarts on {nodes} nodes with the agent's shared store: a restart would "
                         "reuse the previous attempt's rendezvous keys; export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                         "before torchrun (as tools/pretrain.sbatch does), or launch with --max-restarts 0")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"tessel/attempt_{attempt}", store)  # keys: tessel/attempt_<n>/<key>


def num_groups(name: str, dims: ParallelDims) -> int:
    """How many groups of kind ``name`` exist (for tests and sanity checks)."""
    return len(group_rank_lists(name, dims))


__all__ = ["AXES", "DEFAULT_ORDER", "ParallelDims", "Mesh", "attempt_store", "coords_of", "rank_of",
           "group_rank_lists", "init_distributed", "num_groups"]
