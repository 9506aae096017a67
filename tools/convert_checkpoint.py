"""Convert Hugging Face model directories to Tessel checkpoints at any TP x PP layout, and back.

    python tools/convert_checkpoint.py hf-to-tessel --hf HF_DIR --out CKPT_DIR --tp 2 --pp 2 [--ep 2] [--expert-tp 1]
        [--dtype keep]
    python tools/convert_checkpoint.py tessel-to-hf --ckpt CKPT_DIR --out HF_DIR [--dtype keep] [--max-shard-size 2GB]
    python tools/convert_checkpoint.py lora-to-peft --ckpt CKPT_DIR --out ADAPTER_DIR
    python tools/convert_checkpoint.py lora-to-peft --ckpt CKPT_DIR --out HF_DIR --merge [--base BASE_CKPT]

hf-to-tessel reads config.json and the safetensors files (one file, or shards + model.safetensors.index.json)
lazily and writes, in one process, the rank file of every (tp, pp) position of the layout, one tensor at a
time: peak memory stays near the largest tensor. The result is a complete Tessel checkpoint
(``CKPT_DIR/step_00000000/`` + ``latest``; the HF config in its metadata) that the trainer and
tools/evaluate.py load at any layout, plus ``CKPT_DIR/hf/`` with config.json, generation_config.json and
the tokenizer files. tessel-to-hf reads a checkpoint of any layout (the converter's or the trainer's) and
writes a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads. lora-to-peft exports a
LoRA run's adapters (tools/lora_export.py) as adapter_config.json + adapter_model.safetensors for
``peft.PeftModel.from_pretrained``, or with ``--merge`` the merged weights (W + alpha/r * B A) as a Hugging
Face directory (the base from ``--base``, the run's checkpoint.load, when CKPT holds the adapters only).
All write into a temporary directory next to ``--out`` and rename it into place only when everything
succeeded. See docs/convert.md and docs/posttrain.md.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import sys
import uuid
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from engine.checkpoint import CheckpointError, ShardedTensor, load_checkpoint, read_metadata, resolve_checkpoint  # noqa: E402
from engine.checkpoint.format import (FORMAT_NAME, FORMAT_VERSION, LATEST_FILE, METADATA_FILE, dtype_from_name,  # noqa: E402
                                      fsync_dir, rank_filename, replace_file_atomic, step_dirname,
                                      write_file_durable)
from engine.checkpoint.safetensors_io import SafetensorsWriter, verify_files  # noqa: E402
from engine.checkpoint.save import build_tensor_index  # noqa: E402
from models.convert import (DTYPE_CHOICES, HF_DTYPE_NAMES, MODEL_PREFIX, PreadSafetensors,  # noqa: E402
                            check_hf_tensors, hf_dtype, placements, stage_layer_ranges, stage_params,
                            tessel_full_shape)
from models.hf_layout import describe_problems, hf_shapes, read_shard, to_hf  # noqa: E402
from models.registry import config_from_hf, family  # noqa: E402

HF_SUBDIR = "hf"
# Files besides the weights that make a Hugging Face model directory usable (tokenizer, generation).
SIDE_FILE_RE = re.compile(r"^(config\.json|generation_config\.json|tokenizer.*|special_tokens_map\.json|"
                          r"added_tokens\.json|vocab\.(json|txt)|merges\.txt|spiece\.model|chat_template\.(json|jinja)|"
                          r".*\.jinja)$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


# -- shared helpers ---------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000 (decimal units as Hugging Face; KiB/MiB/GiB are binary)."""
    m = _SIZE_RE.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--max-shard-size={text!r} is not a size; write e.g. 2GB, 500MB or 1GiB")
    return max(1, int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()]))


def _out_dtype(name: str) -> torch.dtype | None:
    if name == "keep":
        return None
    if name not in DTYPE_CHOICES:
        raise ValueError(f"--dtype={name!r} is not one of keep, {', '.join(DTYPE_CHOICES)}")
    return DTYPE_CHOICES[name]


@contextlib.contextmanager
def staged_output(out: str | os.PathLike, *, force: bool, inputs: tuple[Path, ...] = ()):
    """Yield a fresh temporary directory beside ``out``; rename it to ``out`` when the block succeeds,
    delete it when the block raises (``out`` is then untouched)."""
    out = Path(out).absolute()
    for src in inputs:
        src = src.resolve()
        if out.resolve() == src or out.resolve() in src.parents:
            raise ValueError(f"--out {out} is (or contains) the input {src}; write to another directory")
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"--out {out} exists and is not a directory; choose another path")
        if any(out.iterdir()) and not force:
            raise ValueError(f"--out {out} exists and is not empty; pass --force to replace it, or choose another "
                             "directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():  # --force: swap, then drop the old directory
        trash = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, trash)
        os.rename(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, out)
    fsync_dir(out.parent)


def copy_side_files(src_dir: Path, dst_dir: Path, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy config/tokenizer/generation files of a Hugging Face directory; returns their names."""
    copied = []
    for p in sorted(src_dir.iterdir()):
        if p.is_file() and SIDE_FILE_RE.match(p.name) and p.name not in skip:
            dst_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, dst_dir / p.name)
            copied.append(p.name)
    return copied


@contextlib.contextmanager
def one_torch_thread():
    """Run the block with one intra-op thread. The converter's work is copies (cat, slicing, dtype casts)
    that are memory-bound; on the 2-core machines we measured, torch.cat with 2 OpenMP threads next to
    the hashing and writing threads ran ~70x slower than with 1 (0.03 s vs 0.4 ms for a 2 MB qkv)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ValueError(f"{path} does not exist; {what}")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


# -- Hugging Face -> Tessel -------------------------------------------------------------------------

def open_hf_dir(hf_dir: Path) -> tuple[dict, PreadSafetensors]:
    """(config.json dict, lazy tensor mapping) of a Hugging Face model directory."""
    if not hf_dir.is_dir():
        raise ValueError(f"--hf {hf_dir} is not a directory; give a Hugging Face model directory (config.json + "
                         "*.safetensors)")
    config = _read_json(hf_dir / "config.json", "a Hugging Face model directory holds config.json")
    if not any(hf_dir.glob("*.safetensors")):
        bins = sorted(p.name for p in hf_dir.glob("*.bin"))
        hint = (f" (it holds {bins}: re-save the model with save_pretrained(..., safe_serialization=True))"
                if bins else "")
        raise ValueError(f"{hf_dir} holds no .safetensors files{hint}")
    return config, PreadSafetensors(hf_dir)


def _resolver(src, fam):
    available = set(src.keys())

    def resolve(key: str) -> str:
        for k in (key, *fam.hf_aliases(key)):
            if k in available:
                return k
        raise AssertionError(f"{key} vanished after the check")  # check_hf_tensors ran first
    return resolve


def _write_rank(src, resolve, cfg, *, rank: int, tp_rank: int, tp: int, layer_range, pre_process: bool,
                post_process: bool, padded_vocab: int, out_dtype, step_dir: Path, ep_rank: int = 0,
                ep: int = 1, expert_tp: int | None = None) -> tuple[list[dict], dict | None]:
    """Write virtual rank ``rank``'s file; returns (piece descriptions, file record or None). With
    ``ep`` > 1 the rank holds ep rank ``ep_rank``'s experts (dp = ep: its other tensors are replicas
    unless ``ep_rank`` is 0); at ``expert_tp`` = 1 whole experts (tp rank 0 writes them)."""
    params = stage_params(cfg, tp_rank=tp_rank, tp_size=tp, layer_range=layer_range, pre_process=pre_process,
                          post_process=post_process, padded_vocab=padded_vocab, ep_rank=ep_rank, ep_size=ep,
                          expert_tp=expert_tp)
    fname = rank_filename(rank)
    jobs = []
    for p in params:
        dtype = out_dtype or hf_dtype(src, resolve(p.entry.hf_keys[0]))
        jobs.append((p, dtype))
    # Widest dtypes first, as the trainer's save does: every tensor starts naturally aligned.
    jobs.sort(key=lambda j: -torch.empty((), dtype=j[1]).element_size())
    descs, plan, names, used = [], [], [], set()
    for p, dtype in jobs:
        mine = []
        for st in placements(p, tp_rank=tp_rank, tp_size=tp, dtype=dtype, replica_rank=ep_rank):
            d = st.describe()
            d["file"] = d["name"] = None
            name = None
            if st.replica_id == 0:
                name, i = st.key, 1
                while name in used:  # several pieces of one key (fused gate/up): key, key#1, ...
                    name, i = f"{st.key}#{i}", i + 1
                used.add(name)
                d["file"], d["name"] = fname, name
                plan.append((name, dtype, st.local_shape))
            descs.append(d)
            mine.append(name)
        names.append(mine)
    if not plan:
        return descs, None
    writer = SafetensorsWriter(step_dir / fname, plan,
                                        metadata={"format": FORMAT_NAME, "step": "0", "rank": str(rank)})
    try:
        for (p, dtype), mine in zip(jobs, names):
            if not any(mine):
                continue
            whole = p.expert and p.partition is None  # expert_tp = 1: the whole expert on every tp rank
            local = read_shard(p.entry, src, resolve, ndim=len(p.local_shape), rank=0 if whole else tp_rank,
                               size=1 if whole else tp, cfg=cfg, local_rows=p.local_shape[0]).to(dtype)
            assert tuple(local.shape) == p.local_shape, (p.name, tuple(local.shape), p.local_shape)
            for st, name in zip(placements(p, tp_rank=tp_rank, tp_size=tp, dtype=dtype, data=local,
                                           replica_rank=ep_rank), mine):
                if name is not None:
                    writer.write(name, st.data)
            del local
        written = writer.close()
    except BaseException:
        writer.abort()
        raise
    return descs, {"rank": rank, "sha256": written.sha256, "bytes": written.bytes}


def hf_to_tessel(hf_dir: str | os.PathLike, out: str | os.PathLike, *, tp: int = 1, pp: int = 1, dtype: str = "keep",
                 pipeline_layout: list[int] | None = None, make_vocab_size_divisible_by: int = 128,
                 force: bool = False, ep: int = 1, expert_tp: int | None = None) -> Path:
    """Convert a Hugging Face directory into a Tessel checkpoint written at the TP x PP layout; returns ``out``.
    ``ep`` > 1 (mixture-of-experts families): the layout ep x tp x pp with dp = ep, each ep rank writing
    its own experts (the checkpoint loads at any other layout all the same: keys are global). ``expert_tp``
    = 1: the experts written whole, as ``parallel.expert_tp=1`` holds them (None: sharded over tp)."""
    hf_dir = Path(hf_dir)
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"--{name}={v!r} must be an integer >= 1")
    out_dtype = _out_dtype(dtype)
    config, src = open_hf_dir(hf_dir)
    cfg = config_from_hf(config)
    cfg.check_tensor_parallel(tp)
    if expert_tp not in (None, tp) and not cfg.num_experts:
        raise ValueError(f"--expert-tp={expert_tp} sets the experts' tensor parallelism, but the {cfg.model_type} "
                         "model has none; drop it")
    if ep > 1 or expert_tp is not None:  # before reading anything: experts divisible by ep, expert_tp 1 or tp
        stage_params(cfg, tp_rank=0, tp_size=tp, layer_range=(0, 0), pre_process=False, post_process=False,
                     padded_vocab=cfg.vocab_size, ep_rank=0, ep_size=ep, expert_tp=expert_tp)
    check_hf_tensors(cfg, src, where=str(hf_dir))
    ranges = stage_layer_ranges(cfg.num_layers, pp, pipeline_layout)
    padded = cfg.padded_vocab_size(tp=tp, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    resolve = _resolver(src, family(cfg.model_type))
    model_config = dict(config)
    if out_dtype is not None:
        _set_config_dtype(model_config, out_dtype)
    world = ep * tp * pp
    with one_torch_thread(), staged_output(out, force=force, inputs=(hf_dir,)) as tmp:
        step_dir = tmp / step_dirname(0)
        step_dir.mkdir()
        per_rank, files = [], {}
        for rank in range(world):
            # The mesh's default order dp-pp-cp-tp with cp = 1 and dp = ep (ep rank = dp rank).
            ep_rank, in_pipeline = divmod(rank, pp * tp)
            pp_rank, tp_rank = divmod(in_pipeline, tp)
            descs, rec = _write_rank(src, resolve, cfg, rank=rank, tp_rank=tp_rank, tp=tp, layer_range=ranges[pp_rank],
                                     pre_process=pp_rank == 0, post_process=pp_rank == pp - 1, padded_vocab=padded,
                                     out_dtype=out_dtype, step_dir=step_dir, ep_rank=ep_rank, ep=ep,
                                     expert_tp=expert_tp)
            per_rank.append(descs)
            if rec is not None:
                files[rank_filename(rank)] = rec
        meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": 0,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "world_size": world, "model_config": model_config,
                "layout": {"dp": ep, "pp": pp, "tp": tp, "cp": 1, "ep": ep, "vp": 1, "order": "dp-pp-cp-tp",
                           "zero": False, "world_size": world},
                "trainer_state": {"converted_from": {"format": "huggingface", "path": str(hf_dir.absolute()),
                                                     "dtype": dtype, "pipeline_layers": [list(r) for r in ranges]}},
                "rank_states": [None] * world, "tensors": build_tensor_index(per_rank), "files": files}
        write_file_durable(step_dir / METADATA_FILE, json.dumps(meta, indent=1).encode())
        fsync_dir(step_dir)
        replace_file_atomic(tmp / LATEST_FILE, (step_dir.name + "\n").encode())
        copy_side_files(hf_dir, tmp / HF_SUBDIR, skip=("config.json",))
        (tmp / HF_SUBDIR).mkdir(exist_ok=True)
        with open(tmp / HF_SUBDIR / "config.json", "w") as f:
            json.dump(model_config, f, indent=2, sort_keys=True)
    return Path(out)


def _set_config_dtype(config: dict, dtype: torch.dtype) -> None:
    config["dtype"] = HF_DTYPE_NAMES[dtype]  # transformers 5; older files say torch_dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = HF_DTYPE_NAMES[dtype]


# -- Tessel -> Hugging Face -------------------------------------------------------------------------

def _verify(step_dir: Path, meta: dict) -> None:
    errors = verify_files(step_dir, meta["files"], workers=max(1, min(4, os.cpu_count() or 1)))
    if errors:
        raise CheckpointError("; ".join(errors) + " (pass --no-verify to skip the check)")


def _export_entries(cfg, saved: dict, *, where: str, adapters: bool = False):
    """The Hugging Face entries to export, each with its checkpoint key and saved shape; ValueError
    listing missing / unexpected / mis-shaped model tensors. LoRA adapter tensors are refused (they
    need lora-to-peft) unless ``adapters`` (a merge reads them itself)."""
    lora = sorted(k for k in saved if k.startswith(MODEL_PREFIX) and k.endswith((".lora_A", ".lora_B")))
    if lora and not adapters:
        raise ValueError(f"{where} holds LoRA adapters ({len(lora)} tensors, e.g. {lora[0]}); export them with "
                         "lora-to-peft (a PEFT adapter), or lora-to-peft --merge (merged Hugging Face weights)")
    skip = set(lora)
    saved = {k: v for k, v in saved.items() if k not in skip}
    entries = family(cfg.model_type).hf_entries(cfg, layers=range(cfg.num_layers), pre_process=True,
                                                post_process=True)
    out, missing, mismatched = [], [], []
    for e in entries:
        if e.name == "output_layer.weight" and cfg.tie_word_embeddings:
            continue  # the embedding is the output layer
        key = MODEL_PREFIX + e.name
        if key not in saved:
            missing.append(key)
            continue
        shape = tuple(saved[key]["shape"])
        if e.layout == "vocab":  # any padding of the vocabulary rows
            ok = len(shape) == 2 and shape[0] >= cfg.vocab_size and shape[1] == cfg.hidden_size
            want = f"(>= {cfg.vocab_size}, {cfg.hidden_size})"
        else:
            ok = shape == tessel_full_shape(e, cfg, padded_vocab=0)
            want = str(tessel_full_shape(e, cfg, padded_vocab=0))
        if not ok:
            mismatched.append(f"{key}: checkpoint {shape}, config implies {want}")
        out.append((e, key, shape))
    expected = {MODEL_PREFIX + e.name for e, _, _ in out}
    unexpected = sorted(k for k in saved if k.startswith(MODEL_PREFIX) and k not in expected)
    problems = describe_problems(("missing tensors", missing), ("unexpected tensors", unexpected),
                                 ("shape mismatches", mismatched))
    if problems:
        raise ValueError(f"{where} does not match its model config ({cfg.model_type}, {cfg.num_layers} layers): "
                         + "; ".join(problems))
    return out


def _plan_shards(items, max_bytes: int) -> list[list]:
    """Greedy size-bounded groups of consecutive entries (an entry's tensors stay in one file)."""
    shards, cur, size = [], [], 0
    for it in items:
        if cur and size + it["bytes"] > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += it["bytes"]
    if cur:
        shards.append(cur)
    return shards


READ_BATCH_BYTES = 64 << 20  # tensors read per load_checkpoint call (one larger tensor goes alone)


def _read_batches(items, *, limit: int):
    batch, size = [], 0
    for it in items:
        nbytes = _numel(it["shape"]) * torch.empty((), dtype=it["src_dtype"]).element_size()
        if batch and size + nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(it)
        size += nbytes
    if batch:
        yield batch


def read_logical(step_dir: Path, meta: dict, wanted: list[tuple[str, tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """The full logical tensors ``wanted`` (key, saved shape, dtype) of a checkpoint, in one
    :func:`load_checkpoint` call. Each saved piece gets its own contiguous target (a view of the full
    tensor when its rows are contiguous there, else a buffer copied in afterwards), so every read is a
    single ``preadv`` of a contiguous run."""
    fulls, targets, fixups = [], [], []
    for key, shape, dtype in wanted:
        full = torch.empty(shape, dtype=dtype)
        fulls.append(full)
        pieces = meta["tensors"][key]["pieces"]
        if any(pc["flat_range"] is not None for pc in pieces):  # optimizer-style pieces: let the loader cut
            targets.append(ShardedTensor(key=key, data=full, global_shape=shape))
            continue
        for pc in pieces:
            off, local = tuple(pc["offset"]), tuple(pc["local_shape"])
            box = tuple(slice(o, o + n) for o, n in zip(off, local))
            view = full[box] if box else full
            data = view if view.is_contiguous() else torch.empty(local, dtype=dtype)
            if data is not view:
                fixups.append((view, data))
            targets.append(ShardedTensor(key=key, data=data, global_shape=shape, global_offset=off))
    load_checkpoint(step_dir, tensors=targets, verify=False)
    for view, data in fixups:
        view.copy_(data)
    return fulls


def _find_side_dir(step_dir: Path, explicit: str | None) -> Path | None:
    if explicit is not None:
        p = Path(explicit)
        if not p.is_dir():
            raise ValueError(f"--hf-files {p} is not a directory")
        usable = [f.name for f in p.iterdir() if f.is_file() and SIDE_FILE_RE.match(f.name) and f.name != "config.json"]
        if not usable:
            others = sorted(f.name for f in p.iterdir() if f.name.endswith(".json"))[:5]
            raise ValueError(f"--hf-files {p} holds no Hugging Face tokenizer or generation files (tokenizer.json, "
                             "tokenizer_config.json, special_tokens_map.json, generation_config.json, ...); "
                             + (f"it has {others}, which are not; " if others else "")
                             + "point it at a Hugging Face model directory, or leave it out")
        return p
    for p in (step_dir / HF_SUBDIR, step_dir.parent / HF_SUBDIR):
        if p.is_dir():
            return p
    return None


def tessel_to_hf(ckpt: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "keep", max_shard_size: str = "2GB",
                 hf_files: str | None = None, config_path: str | None = None, verify: bool = True,
                 force: bool = False, transform=None) -> Path:
    """Export a Tessel checkpoint (any layout) as a Hugging Face directory; returns ``out``.

    ``transform(key, full) -> full`` (the LoRA merge) may change each full TP=1-layout tensor before it
    is mapped to Hugging Face keys; with it, adapter tensors in the checkpoint are skipped."""
    out_dtype = _out_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    step_dir = resolve_checkpoint(ckpt, what="--ckpt")
    meta = read_metadata(step_dir)
    if config_path is not None:
        config = _read_json(Path(config_path), "--config must name a Hugging Face config.json")
    elif meta.get("model_config"):
        config = dict(meta["model_config"])
    else:
        raise ValueError(f"checkpoint {step_dir} stores no model_config; pass --config CONFIG.JSON (the Hugging "
                         "Face config of the model it holds)")
    cfg = config_from_hf(config)
    if verify:
        _verify(step_dir, meta)
    saved = meta["tensors"]
    biased = sorted(k for k in saved if k.startswith("moe.") and k.endswith("router.expert_bias"))
    if biased:  # the exported model would route without them: other experts, other logits
        raise ValueError(f"checkpoint {step_dir} routes with aux-loss-free balancing biases ({biased[0]}, ...; "
                         f"parallel.moe_bias_update_rate), which the {cfg.model_type} Hugging Face format has no "
                         "tensor for: the export would route differently. Evaluate it with tools/evaluate.py, or "
                         "train with parallel.moe_bias_update_rate=0 to export")
    items = []
    for e, key, shape in _export_entries(cfg, saved, where=str(step_dir), adapters=transform is not None):
        src_dtype = dtype_from_name(saved[key]["dtype"])
        dt = out_dtype or src_dtype
        hf = list(zip(e.hf_keys, hf_shapes(e, shape, cfg)))
        nbytes = sum(_numel(s) for _, s in hf) * torch.empty((), dtype=dt).element_size()
        items.append({"entry": e, "key": key, "shape": shape, "src_dtype": src_dtype, "dtype": dt, "hf": hf,
                      "bytes": nbytes})
    shards = _plan_shards(items, max_bytes)
    config.setdefault("architectures", [family(cfg.model_type).ARCHITECTURES[0]])
    first = items[0]["dtype"] if items else torch.float32
    _set_config_dtype(config, first)
    side = _find_side_dir(step_dir, hf_files)
    with one_torch_thread(), staged_output(out, force=force, inputs=(step_dir,)) as tmp:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            plan = [(k, it["dtype"], s) for it in shard for k, s in it["hf"]]
            writer = SafetensorsWriter(tmp / fname, plan, metadata={"format": "pt"}, digest=False)
            try:
                for batch in _read_batches(shard, limit=READ_BATCH_BYTES):
                    fulls = read_logical(step_dir, meta, [(it["key"], it["shape"], it["src_dtype"]) for it in batch])
                    for it, full in zip(batch, fulls):
                        tensors = to_hf(it["entry"], full if transform is None else transform(it["key"], full), cfg)
                        for k, _ in it["hf"]:
                            writer.write(k, tensors[k].to(it["dtype"]))
                            weight_map[k] = fname
                    del fulls, tensors
                writer.close()
            except BaseException:
                writer.abort()
                raise
            total += sum(it["bytes"] for it in shard)
        if len(shards) > 1:
            with open(tmp / "model.safetensors.index.json", "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f,
                          indent=2)
        if side is not None:
            copy_side_files(side, tmp, skip=("config.json",))
        else:
            print(f"convert_checkpoint.py: warning: no tokenizer files found beside {step_dir} (looked for "
                  f"{HF_SUBDIR}/); pass --hf-files DIR to copy them", file=sys.stderr)
        with open(tmp / "config.json", "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    return Path(out)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# -- CLI --------------------------------------------------------------------------------------------

def _layout_arg(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer counts, e.g. 8,8,7,7") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-tessel", help="Hugging Face directory -> Tessel checkpoint")
    a.add_argument("--hf", required=True, help="Hugging Face model directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="checkpoint directory to create")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the written layout")
    a.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the written layout")
    a.add_argument("--ep", type=int, default=1, help="expert-parallel size of the written layout (MoE families; "
                                                     "dp = ep, each ep rank writes its experts)")
    a.add_argument("--expert-tp", type=int, default=None, help="1: write each expert whole, as parallel.expert_tp=1 "
                                                                "holds them (default: sharded over --tp)")
    a.add_argument("--pipeline-layout", type=_layout_arg, default=None,
                   help="layers per pipeline stage, e.g. 8,8,7,7 (default: even, remainder first)")
    a.add_argument("--dtype", default="keep", help="keep | bf16 | fp16 | fp32 (default keep)")
    a.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="vocab padding multiple per TP rank (as model.make_vocab_size_divisible_by)")
    a.add_argument("--force", action="store_true", help="replace a non-empty --out")
    b = sub.add_parser("tessel-to-hf", help="Tessel checkpoint -> Hugging Face directory")
    b.add_argument("--ckpt", required=True, help="checkpoint root (newest complete step) or step directory")
    b.add_argument("--out", required=True, help="Hugging Face directory to create")
    b.add_argument("--dtype", default="keep", help="keep | bf16 | fp16 | fp32 (default keep)")
    b.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (default 2GB)")
    b.add_argument("--hf-files", default=None, help="directory with tokenizer / generation files to copy "
                                                     "(default: the checkpoint's hf/)")
    b.add_argument("--config", default=None, help="config.json to use instead of the checkpoint's model_config")
    b.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint files")
    b.add_argument("--force", action="store_true", help="replace a non-empty --out")
    c = sub.add_parser("lora-to-peft", help="LoRA checkpoint -> PEFT adapter directory (--merge: merged HF weights)")
    c.add_argument("--ckpt", required=True, help="checkpoint of a LoRA run (root or step directory; any layout)")
    c.add_argument("--out", required=True, help="adapter directory (or, with --merge, Hugging Face directory) to create")
    c.add_argument("--merge", action="store_true", help="write merged Hugging Face weights W + alpha/r * B A")
    c.add_argument("--base", default=None, help="with --merge: the base checkpoint (the run's checkpoint.load); "
                                                "default --ckpt when it holds the base weights too")
    c.add_argument("--base-model", default=None, help="base_model_name_or_path to record in adapter_config.json")
    c.add_argument("--dtype", default="keep", help="keep | bf16 | fp16 | fp32 (default keep)")
    c.add_argument("--max-shard-size", default="2GB", help="with --merge: largest safetensors file (default 2GB)")
    c.add_argument("--hf-files", default=None, help="with --merge: tokenizer / generation files to copy")
    c.add_argument("--config", default=None, help="config.json to use instead of the checkpoint's model_config")
    c.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint files")
    c.add_argument("--force", action="store_true", help="replace a non-empty --out")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "hf-to-tessel":
            out = hf_to_tessel(args.hf, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype,
                               pipeline_layout=args.pipeline_layout,
                               make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, force=args.force,
                               ep=args.ep, expert_tp=args.expert_tp)
            print(f"wrote Tessel checkpoint {out} (ep={args.ep}, tp={args.tp}, pp={args.pp}"
                  f"{'' if args.expert_tp is None else f', expert_tp={args.expert_tp}'}); Hugging Face files in "
                  f"{out / HF_SUBDIR}")
        elif args.command == "lora-to-peft":
            from tools.lora_export import lora_to_peft

            out = lora_to_peft(args.ckpt, args.out, merge=args.merge, base=args.base, base_model=args.base_model,
                               dtype=args.dtype, max_shard_size=args.max_shard_size, hf_files=args.hf_files,
                               config_path=args.config, verify=not args.no_verify, force=args.force)
            print(f"wrote {'merged Hugging Face model' if args.merge else 'PEFT adapter'} {out}")
        else:
            out = tessel_to_hf(args.ckpt, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                               hf_files=args.hf_files, config_path=args.config, verify=not args.no_verify,
                               force=args.force)
            print(f"wrote Hugging Face model {out}")
    except (ValueError, CheckpointError, OSError) as e:
        print(f"convert_checkpoint.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
