"""Offline conversion helpers: Hugging Face safetensors <-> Tessel checkpoints, without a process group.

A converter runs in ONE process and plays every (tp, pp) rank of a layout in turn. It never builds a
model: a stage's parameters (names, shapes, tensor-parallel attributes) are derived here from the
family's Hugging Face key map (:mod:`models.hf_layout`), and their checkpoint placement comes from
the same :func:`engine.checkpoint.param_layout` the trainer uses, through :func:`model_param_spec`.
``tests/tools/test_convert.py`` checks both against real :func:`models.build_model` stages.

Checkpoint content (a model-only Tessel checkpoint, see docs/convert.md): every parameter under
``model.<name>``, with ``<name>`` the stage module's parameter name (layers carry GLOBAL indices, so
keys do not depend on the pipeline layout); the fused tensors are stored in the TP=1 Tessel layout
(``qkv`` grouped per kv group, ``fc1`` as ``[gate; up]``); embedding and untied output layer keep the
vocab padding of the layout they were written at (``allow_shape_mismatch`` lets any other layout
load them); a pipeline's last-stage copy of a tied embedding is a replica, never written.
"""
from __future__ import annotations

import os
from collections.abc import Mapping as _MappingABC
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from engine.checkpoint import ParamSpec, ShardingContext, param_layout
from engine.checkpoint.safetensors_io import pread_exact, read_safetensors_header
from models.config import TransformerConfig
from models.hf_layout import HFEntry, describe_problems, hf_shapes, shape_of
from models.hf_state import safetensors_files
from models.moe import moe_full_shape
from models.registry import family
from parallel.pipeline.split import split_layers

MODEL_PREFIX = "model."
TIED_EMBEDDING = "embedding.word_embeddings.weight"
VOCAB_PADDED = ("word_embeddings.weight", "output_layer.weight")

# safetensors dtype codes of the float dtypes a model file may hold
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
DTYPE_CHOICES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                  torch.float64: "float64"}


def model_param_spec(name: str, param: torch.Tensor) -> ParamSpec:
    """Checkpoint placement of a stage parameter: logical key ``name`` (the ``model.`` prefix is added
    by the caller), vocab-padded tensors may change padding between layouts, and a last stage's copy
    of a tied embedding is an extra replica of ``embedding.word_embeddings.weight`` (never written).

    The same rule as the trainer's checkpoint hook; a stage in a module list passes the name
    without the list index.
    """
    if name == "output_layer.weight" and getattr(param, "shared_embedding", False):
        return ParamSpec(key=TIED_EMBEDDING, extra_replica=1, allow_shape_mismatch=True)
    return ParamSpec(key=name, allow_shape_mismatch=name.endswith(VOCAB_PADDED))


def stage_layer_ranges(num_layers: int, pp: int, layout: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Global layer range of each pipeline stage: :func:`parallel.pipeline.split.split_layers`, the
    trainer's rule (``layout`` if given, else an even split with the remainder on the first stages)."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp={pp!r} must be an integer >= 1")
    return split_layers(num_layers, pp, layout)


def tessel_full_shape(entry: HFEntry, cfg: TransformerConfig, *, padded_vocab: int) -> tuple[int, ...]:
    """Shape of the Tessel parameter ``entry.name`` in the TP=1 layout (vocab padded to ``padded_vocab``)."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.ffn_hidden_size
    bias = entry.name.endswith(".bias")
    moe = moe_full_shape(entry.name, cfg)  # router, experts, shared expert (models/moe.py)
    if moe is not None:
        return moe
    if entry.layout == "vocab":
        return (padded_vocab, h)
    if entry.layout in ("qkv", "qkv_packed"):
        rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
        return (rows,) if bias else (rows, h)
    if entry.layout == "gate_up":
        return (2 * f,) if bias else (2 * f, h)
    if entry.layout == "column":  # GPT-2's ungated fc1
        return (f,) if bias else (f, h)
    if entry.layout == "row":
        return (h, cfg.num_heads * d) if ".attention." in entry.name else (h, f)
    if entry.name.endswith(("q_norm.weight", "k_norm.weight")):
        return (d,)
    if entry.name.endswith("position_embeddings.weight"):
        return (cfg.max_position_embeddings, h)
    return (h,)  # norms and replicated output biases


@dataclass(frozen=True)
class StageParam:
    """One parameter of a virtual rank's stage: its Hugging Face entry, full and local shapes, and the
    tensor-parallel attributes the parallel layers would set."""

    name: str
    entry: HFEntry
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    partition: tuple[int, int] | None  # (dim, stride) when split over TP
    shared_embedding: bool
    expert: bool = False  # a routed expert's weight (split over ep, replicated over edp)

    def stand_in(self, dtype: torch.dtype, data: torch.Tensor | None = None) -> torch.Tensor:
        """``data`` (or an empty meta tensor of the local shape) carrying the TP attributes."""
        t = torch.empty(self.local_shape, dtype=dtype, device="meta") if data is None else data
        t.tensor_parallel = self.partition is not None
        if self.partition is not None:
            t.partition_dim, t.partition_stride = self.partition
        if self.shared_embedding:
            t.shared_embedding = True
        if self.expert:
            t.expert = True
        return t


def stage_params(cfg: TransformerConfig, *, tp_rank: int, tp_size: int, layer_range: tuple[int, int],
                 pre_process: bool, post_process: bool, padded_vocab: int, ep_rank: int = 0,
                 ep_size: int = 1, expert_tp: int | None = None) -> list[StageParam]:
    """The parameters a :func:`models.build_model` stage would hold, without building it. With expert
    parallelism (``ep_size`` > 1) only ep rank ``ep_rank``'s experts ``[r E/ep, (r+1) E/ep)``, as
    :class:`parallel.expert_parallel.MoELayer` holds them. ``expert_tp`` = 1 (None: ``tp_size``): the routed
    experts whole and replicated over TP (the shared expert stays sharded)."""
    cfg.check_tensor_parallel(tp_size)
    assert 0 <= tp_rank < tp_size and 0 <= ep_rank < ep_size
    if expert_tp not in (None, 1, tp_size):
        raise ValueError(f"expert_tp={expert_tp} is not built at tp={tp_size}: use 1 (whole experts) or {tp_size}")
    whole_experts = expert_tp == 1
    if ep_size > 1:
        from parallel.expert_parallel.router import check_routing

        if not cfg.num_experts:
            raise ValueError(f"ep={ep_size} splits experts over ranks, but the {cfg.model_type} model has none; "
                             "use ep=1")
        check_routing(num_experts=cfg.num_experts, top_k=cfg.moe_top_k, ep=ep_size)
    experts_per_rank = cfg.num_experts // ep_size if cfg.num_experts else 1
    entries = family(cfg.model_type).hf_entries(cfg, layers=range(*layer_range), pre_process=pre_process,
                                                post_process=post_process)
    tied = cfg.tie_word_embeddings
    out = []
    for e in entries:
        if e.name == "output_layer.weight" and tied and pre_process:
            continue  # one stage holds both ends: the output layer uses the embedding itself
        expert = ".mlp.experts." in e.name
        if expert and int(e.name.split(".mlp.experts.")[1].split(".")[0]) // experts_per_rank != ep_rank:
            continue  # another ep rank's expert
        full = tessel_full_shape(e, cfg, padded_vocab=padded_vocab)
        part = None if expert and whole_experts else e.partition(len(full))
        local_shape = list(full)
        if part is not None:
            local_shape[part[0]] //= tp_size
        shared = tied and (e.name == "output_layer.weight" or (e.name == TIED_EMBEDDING and not post_process))
        out.append(StageParam(name=e.name, entry=e, full_shape=tuple(full), local_shape=tuple(local_shape),
                              partition=part, shared_embedding=shared, expert=expert))
    return out


def placements(param: StageParam, *, tp_rank: int, tp_size: int, dtype: torch.dtype, data: torch.Tensor | None = None,
               replica_rank: int = 0):
    """The ShardedTensors (key ``model.<name>``) of ``param`` on TP rank ``tp_rank``: views of ``data``
    (the local shard) or meta placeholders. Placement by :func:`engine.checkpoint.param_layout`.
    ``replica_rank``: the dp position of a layout written with expert parallelism (dp = ep): the
    ranks past the first hold replicas of everything but their own experts."""
    t = param.stand_in(dtype, data)
    ctx = ShardingContext(tp_rank=tp_rank, tp_size=tp_size, replica_rank=replica_rank, expert_replica_rank=0)
    layout = param_layout(param.name, t, ctx=ctx, spec=model_param_spec(param.name, t))
    return layout.sharded(t, prefix=MODEL_PREFIX)


# -- checking a Hugging Face state before converting it ---------------------------------------------

def check_hf_tensors(cfg: TransformerConfig, src: Mapping[str, Any], *, where: str) -> None:
    """ValueError listing every missing key, unexpected key and shape mismatch of ``src`` (on-disk names)
    against the full model of ``cfg``; also rejects non-float tensors."""
    fam = family(cfg.model_type)
    available = set(src.keys())
    entries = fam.hf_entries(cfg, layers=range(cfg.num_layers), pre_process=True, post_process=True)
    known: set[str] = set()
    missing, mismatched, bad_dtype = [], [], []
    for e in entries:
        if e.name == "output_layer.weight" and cfg.tie_word_embeddings:
            continue
        full = tessel_full_shape(e, cfg, padded_vocab=cfg.vocab_size)
        for key, want in zip(e.hf_keys, hf_shapes(e, full, cfg)):
            spellings = (key, *fam.hf_aliases(key))
            known.update(spellings)
            actual = next((k for k in spellings if k in available), None)
            if actual is None:
                missing.append(key)
                continue
            got = shape_of(src, actual)
            if got != tuple(want):
                mismatched.append(f"{actual}: file {got}, config.json implies {tuple(want)}")
            get_slice = getattr(src, "get_slice", None)
            code = get_slice(actual).get_dtype() if get_slice is not None else None
            if code is not None and code not in ST_DTYPES:
                bad_dtype.append(f"{actual}: {code}")
    unexpected = sorted(k for k in available if k not in known and not fam.hf_ignored(k, cfg))
    problems = describe_problems(("missing tensors", missing), ("unexpected tensors", unexpected),
                                 ("shape mismatches", mismatched), ("non-float tensors", bad_dtype))
    if problems:
        raise ValueError(f"{where} does not match its config.json ({cfg.model_type}, {cfg.num_layers} layers, "
                         f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}): " + "; ".join(problems)
                         + ". Check that config.json belongs to these weights.")


def hf_dtype(src, key: str) -> torch.dtype:
    """Dtype of tensor ``key`` as stored on disk."""
    get_slice = getattr(src, "get_slice", None)
    if get_slice is not None:
        return ST_DTYPES[get_slice(key).get_dtype()]
    return src[key].dtype


# -- reading safetensors files with pread ------------------------------------------------------------

class PreadSafetensors(_MappingABC):
    """A lazy mapping over Hugging Face safetensors files (one file or a sharded directory) that reads
    with ``os.preadv`` into fresh tensors instead of memory-mapping.

    Same interface as :class:`models.SafetensorsState` (``get_slice(key)`` with ``get_shape()``,
    ``get_dtype()`` and ``[...]`` indexing), so :func:`models.hf_layout.read_shard` uses it. Why: on
    the VMs we measured, faulting in a file mapping page by page reads ~10x slower than one ``preadv``
    of the same bytes from the page cache. A slice along dim 0 is one read; along a later dim, one
    read per leading index (a TP rank's columns of a row-parallel weight).
    """

    def __init__(self, path: str | os.PathLike):
        files = safetensors_files(path)  # the files transformers reads (an index's, or model.safetensors)
        self._fds: list[int] = []
        self._where: dict[str, tuple[int, str, tuple[int, ...], int]] = {}  # key -> (fd, code, shape, byte offset)
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            self._fds.append(fd)
            base, header = read_safetensors_header(fd, f)
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                if key in self._where:
                    raise ValueError(f"tensor {key!r} appears in more than one file under {path}")
                self._where[key] = (fd, info["dtype"], tuple(info["shape"]), base + info["data_offsets"][0])

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def get_slice(self, key: str) -> "_PreadSlice":
        try:
            return _PreadSlice(*self._where[key], key=key)
        except KeyError:
            raise KeyError(key) from None

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.get_slice(key)[...]

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key) -> bool:
        return key in self._where


SMALL_RUN_BYTES = 16 << 10


class _PreadSlice:
    def __init__(self, fd: int, code: str, shape: tuple[int, ...], offset: int, *, key: str):
        self.fd, self.code, self.shape, self.offset, self.key = fd, code, shape, offset, key

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.code

    def __getitem__(self, index) -> torch.Tensor:
        """``[...]`` or a tuple of full slices with at most one ``slice(start, stop)``."""
        if self.code not in ST_DTYPES:
            raise ValueError(f"tensor {self.key!r} has dtype {self.code}; only float tensors are read")
        dtype = ST_DTYPES[self.code]
        index = () if index is Ellipsis else index if isinstance(index, tuple) else (index,)
        dim, start, stop = 0, 0, self.shape[0] if self.shape else 1
        for d, sl in enumerate(index):
            if not isinstance(sl, slice) or sl.step not in (None, 1):
                raise ValueError(f"unsupported index {index!r}")
            lo, hi, _ = sl.indices(self.shape[d])
            if (lo, hi) != (0, self.shape[d]):
                dim, start, stop = d, lo, hi
        shape = list(self.shape)
        if shape:
            shape[dim] = stop - start
        es = torch.empty((), dtype=dtype).element_size()
        inner = _numel(self.shape[dim + 1:]) * es  # bytes of one index along `dim`
        outer = _numel(self.shape[:dim])
        if outer > 1 and (stop - start) * inner < SMALL_RUN_BYTES:
            # Many short runs (a TP rank's columns): one read of the whole tensor and a copy beat a
            # syscall per row, at the price of reading the other ranks' columns too.
            return _PreadSlice(self.fd, self.code, self.shape, self.offset, key=self.key)[...].narrow(
                dim, start, stop - start).contiguous()
        out = torch.empty(shape, dtype=dtype)
        flat = out.reshape(outer, -1).view(torch.uint8) if out.numel() else out  # (outer, run bytes)
        for o in range(outer if out.numel() else 0):
            pos = self.offset + (o * (self.shape[dim] if self.shape else 1) + start) * inner
            pread_exact(self.fd, memoryview(flat[o].numpy()), pos, what=f"tensor {self.key!r}")
        return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
