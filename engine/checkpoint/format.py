"""The on-disk format of a Tessel checkpoint: names, metadata, durability helpers, discovery.

A checkpoint root holds one directory per saved step plus a ``latest`` pointer::

    <root>/
      latest                          text: "step_00000010\\n" (updated last, atomically)
      step_00000010/
        metadata.json                 written last by rank 0; its presence marks a complete checkpoint
        rank_00000.safetensors        the pieces rank 0 owns (replica 0 only)
        rank_00001.safetensors
      .tmp_step_00000020_<uuid>/      a save in progress (or one that crashed): always ignored

``metadata.json`` (format ``tessel-checkpoint``, version 1) records every logical tensor's global
shape and dtype and, for each piece, the file, the tensor name inside the file, the global offset,
the local (rectangular) shape and the optional ``flat_range``; plus the sha256 and size of every
file, the model config, the parallel layout, the trainer state and each rank's JSON state.
Tensors are stored with safetensors, everything else as JSON: nothing is ever pickled.

All filesystem helpers here are durable: files are fsynced before a rename makes them visible,
and the directory holding a renamed entry is fsynced after it.
"""
from __future__ import annotations

import base64
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

FORMAT_NAME = "tessel-checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
LATEST_FILE = "latest"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_step_"
TRASH_PREFIX = ".trash_step_"
_STEP_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read as asked; the message names the file/tensor and the fix.
    ``on_every_rank``: raised with the same message on every rank (a collective check), so a launcher
    prints it once."""

    on_every_rank = False


class CheckpointWarning(UserWarning):
    """Something in a checkpoint root was skipped (an incomplete or leftover directory)."""


# -- names ------------------------------------------------------------------------------------------
def step_dirname(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def rank_filename(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def parse_step(name: str) -> int | None:
    """The step of a final checkpoint directory name, or None for anything else."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


# -- dtypes -----------------------------------------------------------------------------------------
# torch dtype <-> (metadata name, safetensors header code)
_DTYPES: dict[torch.dtype, tuple[str, str]] = {
    torch.float64: ("float64", "F64"), torch.float32: ("float32", "F32"), torch.float16: ("float16", "F16"),
    torch.bfloat16: ("bfloat16", "BF16"), torch.int64: ("int64", "I64"), torch.int32: ("int32", "I32"),
    torch.int16: ("int16", "I16"), torch.int8: ("int8", "I8"), torch.uint8: ("uint8", "U8"),
    torch.bool: ("bool", "BOOL"), torch.float8_e4m3fn: ("float8_e4m3fn", "F8_E4M3"),
    torch.float8_e5m2: ("float8_e5m2", "F8_E5M2"),
}
_BY_NAME = {name: dt for dt, (name, _) in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype][0]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be checkpointed; supported: {sorted(_BY_NAME)}") from None


def safetensors_code(dtype: torch.dtype) -> str:
    dtype_name(dtype)  # raises for unsupported dtypes
    return _DTYPES[dtype][1]


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata; known: {sorted(_BY_NAME)}") from None


# -- durability -------------------------------------------------------------------------------------
def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durable(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the caller fsyncs the directory)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_file_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: temp file + fsync + os.replace + directory fsync.

    A reader sees either the old or the new content, never a partial file, even across a crash.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    write_file_durable(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


# -- JSON state (trainer/rank state may hold tensors: RNG states) -------------------------------------
def to_json_state(obj: Any, *, where: str = "state") -> Any:
    """``obj`` as JSON-able data; tensors become ``{"__tensor__": dtype, "shape", "b64"}``.

    Accepts dicts with str keys, lists/tuples, str/int/float/bool/None and CPU or CUDA tensors
    (copied to CPU). Anything else is a ValueError naming where it was found, so no object can
    sneak into a checkpoint by pickling.
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor__": dtype_name(t.dtype), "shape": list(t.shape), "b64": base64.b64encode(raw).decode()}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is not a string; checkpoint state must be JSON "
                                 "(convert keys to str)")
            out[k] = to_json_state(v, where=f"{where}.{k}")
        return out
    if isinstance(obj, (list, tuple)):
        return [to_json_state(v, where=f"{where}[{i}]") for i, v in enumerate(obj)]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "shape", None) == ():  # numpy scalars
        return obj.item()
    raise ValueError(f"{where}: value of type {type(obj).__name__} is not JSON-able; checkpoint state holds "
                     "only dicts, lists, numbers, strings, bools, None and tensors (no pickled objects)")


def from_json_state(obj: Any) -> Any:
    """Inverse of :func:`to_json_state` (tuples come back as lists)."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            dtype = dtype_from_name(obj["__tensor__"])
            raw = bytearray(base64.b64decode(obj["b64"]))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(obj["shape"]).clone()
        return {k: from_json_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json_state(v) for v in obj]
    return obj


# -- metadata ---------------------------------------------------------------------------------------
def read_metadata(step_dir: str | os.PathLike) -> dict:
    """Load and sanity-check ``metadata.json`` of a checkpoint step directory.

    Raises CheckpointError for a missing directory, a directory that is not a (complete) Tessel
    checkpoint, or metadata of another format or a newer version.
    """
    step_dir = Path(step_dir)
    if not step_dir.exists():
        raise CheckpointError(f"checkpoint path {step_dir} does not exist")
    meta_path = step_dir / METADATA_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{step_dir} is not a complete Tessel checkpoint: {METADATA_FILE} is missing "
                              "(the save did not finish, or this is not a checkpoint directory)")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path} is not valid JSON ({e}); the checkpoint is corrupt") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{meta_path} is not Tessel checkpoint metadata (format="
                              f"{meta.get('format') if isinstance(meta, dict) else None!r}, expected "
                              f"{FORMAT_NAME!r}); convert foreign checkpoints with tools/convert_checkpoint.py")
    version = meta.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{meta_path} has format version {version!r}; this Tessel reads versions "
                              f"<= {FORMAT_VERSION}: upgrade Tessel")
    for field in ("step", "tensors", "files"):
        if field not in meta:
            raise CheckpointError(f"{meta_path} lacks the field {field!r}; the checkpoint is corrupt")
    return meta


def check_complete(step_dir: Path) -> str | None:
    """None when ``step_dir`` is a complete checkpoint, else the reason it is not (cheap: no hashing)."""
    try:
        meta = read_metadata(step_dir)
    except CheckpointError as e:
        return str(e)
    for name, info in meta["files"].items():
        p = step_dir / name
        if not p.is_file():
            return f"file {name} listed in {METADATA_FILE} is missing"
        if p.stat().st_size != info.get("bytes"):
            return f"file {name} has {p.stat().st_size} bytes, metadata says {info.get('bytes')}"
    return None


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, dir), oldest first. No warnings."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for entry in root.iterdir():
        step = parse_step(entry.name)
        if step is not None and entry.is_dir() and check_complete(entry) is None:
            out.append((step, entry))
    return sorted(out)


def find_latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest COMPLETE checkpoint under ``root`` (auto-resume), or None when there is none.

    Incomplete step directories and leftover temporary directories of crashed saves are skipped
    with a :class:`CheckpointWarning`. The ``latest`` pointer is advisory: the newest complete
    directory wins, and a stale pointer (a crash between the commit rename and the pointer update)
    is reported with a warning.
    """
    root = Path(root)
    if not root.exists():
        raise CheckpointError(f"checkpoint root {root} does not exist; check checkpoint.dir / checkpoint.load")
    if not root.is_dir():
        raise CheckpointError(f"checkpoint root {root} is not a directory")
    best: tuple[int, Path] | None = None
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(TMP_PREFIX):
            warnings.warn(f"ignoring {entry}: the temporary directory of a save that did not finish "
                          "(safe to delete once no save is running)", CheckpointWarning, stacklevel=2)
            continue
        step = parse_step(entry.name)
        if step is None or not entry.is_dir():
            continue
        reason = check_complete(entry)
        if reason is not None:
            warnings.warn(f"ignoring incomplete checkpoint {entry}: {reason}", CheckpointWarning, stacklevel=2)
            continue
        if best is None or step > best[0]:
            best = (step, entry)
    if best is None:
        return None
    pointer = root / LATEST_FILE
    if pointer.is_file() and pointer.read_text().strip() != best[1].name:
        warnings.warn(f"{pointer} names {pointer.read_text().strip()!r} but the newest complete checkpoint is "
                      f"{best[1].name!r} (a save was interrupted after its commit); resuming from the newest",
                      CheckpointWarning, stacklevel=2)
    return best[1]


def resolve_checkpoint(path: str | os.PathLike, *, what: str | None = None) -> Path:
    """A step directory for ``path``: the directory itself if it holds a checkpoint, else the newest
    complete checkpoint below it. CheckpointError when there is none; ``what`` (the option that named
    ``path``, e.g. "--ckpt") opens its message."""
    if what is not None:
        try:
            return resolve_checkpoint(path)
        except CheckpointError as e:
            raise CheckpointError(f"{what}: {e}") from None
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if (path / METADATA_FILE).exists() or parse_step(path.name) is not None:
        read_metadata(path)  # a clear error for a foreign or incomplete step directory
        return path
    found = find_latest_checkpoint(path)
    if found is None:
        hint = f"; a run directory keeps them in {path / 'checkpoints'}" if (path / "checkpoints").is_dir() else ""
        raise CheckpointError(f"{path} is not a Tessel checkpoint: it holds neither {METADATA_FILE} nor any "
                              f"complete {STEP_PREFIX}NNNNNNNN/ directory{hint}")
    return found
