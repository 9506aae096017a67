"""Safetensors files in and out, for checkpoints and Hugging Face conversion alike: one place.

* :func:`read_safetensors_header` and :func:`pread_exact`: the validated header and exact reads;
* :class:`SafetensorsWriter`: a file whose tensors (name, dtype, shape) are planned up front and
  written one at a time -- space reserved with ``fallocate``, sha256 computed on a second thread while
  this one writes, fsynced on close; :func:`write_safetensors` writes a list of tensors with it;
* :func:`sha256_file` and :func:`verify_files`: the one checksum verifier (load, inspect, convert).

Layout: 8-byte little-endian header length, compact JSON header padded with spaces to 8 bytes (tensors
start 8-byte aligned), then the tensors in plan order.

Test hook: ``TESSEL_CHECKPOINT_TEST_PAUSE="write:<bytes>:<marker path>"`` makes a writer stop after
``<bytes>`` bytes (made durable), touch the marker and block, so a crash test can kill it mid-write.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from engine.checkpoint.format import CheckpointError, safetensors_code

PAUSE_ENV = "TESSEL_CHECKPOINT_TEST_PAUSE"
CHUNK_BYTES = 64 << 20  # one write (and one hash update) at most
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header

def test_pause(stage: str, *, written: int = 0) -> None:
    """Block forever at ``stage`` when the test hook asks for it (see the module docstring)."""
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    parts = spec.split(":", 2)
    if parts[0] != stage:
        return
    if stage == "write" and written < int(parts[1]):
        return
    Path(parts[-1]).touch()
    while True:  # the test kills this process
        time.sleep(3600)


def _pause_point() -> int | None:
    spec = os.environ.get(PAUSE_ENV, "")
    if spec.startswith("write:"):
        return int(spec.split(":", 2)[1])
    return None


# -- reading -----------------------------------------------------------------------------------------

def read_safetensors_header(fd: int, path: str | os.PathLike) -> tuple[int, dict]:
    """(byte offset of the data section, header dict) of the safetensors file open as ``fd``.

    Validates what later reads rely on, so a corrupt or foreign file fails here with ``error`` naming
    it (:class:`CheckpointError`), not deep inside a read: the 8-byte length is within the file, the
    header is a JSON object, and every tensor entry has ``dtype``, ``shape`` and ``data_offsets``
    ``[begin, end]``. (Data cut short is reported by the read that reaches it.)
    """
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path} is not a safetensors file ({why}): the file is corrupt or "
                     "truncated; write it again, or point at the right file")

    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        raise bad("shorter than the 8-byte header length")
    n = int.from_bytes(head, "little")
    if not 2 <= n <= min(size - 8, _MAX_HEADER_BYTES):
        raise bad(f"header length {n} does not fit a {size}-byte file")
    raw = os.pread(fd, n, 8)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad("the header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(entry, dict) or "dtype" not in entry or not isinstance(entry.get("shape"), list)
                or not (isinstance(offsets, list) and len(offsets) == 2
                        and all(isinstance(o, int) for o in offsets)
                        and 0 <= offsets[0] <= offsets[1])):
            raise bad(f"entry {key!r} lacks a dtype, a shape or data_offsets [begin, end]")
    return 8 + n, header


def pread_exact(fd: int, buf: memoryview, offset: int, *, what: str) -> None:
    """Fill ``buf`` from ``fd`` starting at byte ``offset`` (``os.preadv``, resumed after short
    reads). Raises :class:`CheckpointError` ``"{what}: the file ends early (truncated?)"``."""
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            raise CheckpointError(f"{what}: the file ends early (truncated?)")
        done += got


# -- writing -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WriteResult:
    file: str
    sha256: str
    bytes: int


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _preallocate(fd: int, size: int) -> None:
    """Reserve the file's blocks up front (Linux ``fallocate``; nothing where unsupported). On ext4 under
    concurrent writeback, plain appends now and then ran 3-4x slower than into a preallocated file.
    ``posix_fallocate`` is not used: where the filesystem lacks support it writes zeros, doubling the I/O."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.fallocate(ctypes.c_int(fd), ctypes.c_int(0), ctypes.c_longlong(0), ctypes.c_longlong(size))
    except (OSError, AttributeError):
        pass


class SafetensorsWriter:
    """Writes a safetensors file whose tensors are planned up front (name, dtype, shape) and produced one
    at a time, so only one tensor needs to be in memory. Hashes (sha256, unless ``digest=False``) on a
    second thread while writing, at most one chunk behind; fsyncs on :meth:`close`."""

    def __init__(self, path: str | os.PathLike, plan: Sequence[tuple[str, torch.dtype, Sequence[int]]], *,
                 metadata: dict[str, str] | None = None, digest: bool = True):
        self.path = Path(path)
        self._digest = digest
        header: dict = {}
        offset = 0
        self._expect: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for name, dtype, shape in plan:
            if name in header:
                raise ValueError(f"{self.path.name}: tensor {name!r} planned twice")
            n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": safetensors_code(dtype), "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._expect.append((name, dtype, tuple(shape)))
            offset += n
        if metadata:
            header["__metadata__"] = metadata
        hjson = json.dumps(header, separators=(",", ":")).encode()
        hjson += b" " * (-len(hjson) % 8)  # tensors start 8-byte aligned
        prefix = len(hjson).to_bytes(8, "little") + hjson
        self._total = len(prefix) + offset
        self._file = open(self.path, "wb")
        _preallocate(self._file.fileno(), self._total)
        self._hash = hashlib.sha256()
        # Both sides release the GIL on large buffers: the file costs max(write, hash), not their sum.
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessel-sha256")
        self._pending = None
        self._next = 0
        self._written = 0
        self._pause_at = _pause_point()
        self._emit(memoryview(prefix))

    def _emit(self, view: memoryview) -> None:
        for lo in range(0, len(view), CHUNK_BYTES):
            chunk = view[lo:lo + CHUNK_BYTES]
            if self._pause_at is not None and self._written < self._pause_at <= self._written + len(chunk):
                cut = self._pause_at - self._written  # write up to the pause point, durably, then stop
                self._file.write(chunk[:cut])
                self._file.flush()
                os.fsync(self._file.fileno())
                test_pause("write", written=self._pause_at)
            if self._pending is not None:  # at most one chunk waits for the hasher
                self._pending.result()
            if self._digest:
                self._pending = self._hasher.submit(self._hash.update, chunk)
            self._file.write(chunk)
            self._written += len(chunk)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``, which must be the next planned tensor (same dtype and shape)."""
        if self._next >= len(self._expect):
            raise ValueError(f"{self.path.name}: {name!r} written after the last planned tensor")
        want = self._expect[self._next]
        got = (name, tensor.dtype, tuple(tensor.shape))
        if got != want:
            raise ValueError(f"{self.path.name}: expected tensor {want} next, got {got}")
        self._next += 1
        t = tensor.detach().to("cpu").contiguous()
        if t.numel():
            self._emit(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # the view keeps t alive

    def close(self) -> WriteResult:
        """Finish the file: every planned tensor written, hashed, fsynced."""
        if self._next != len(self._expect):
            missing = [n for n, _, _ in self._expect[self._next:]]
            self.abort()
            raise ValueError(f"{self.path.name}: {len(missing)} planned tensor(s) never written: {missing[:5]}")
        self._hasher.shutdown(wait=True)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        size = self.path.stat().st_size
        assert size == self._total, (size, self._total)
        return WriteResult(file=self.path.name, sha256=self._hash.hexdigest() if self._digest else "", bytes=size)

    def abort(self) -> None:
        self._hasher.shutdown(wait=True)
        if not self._file.closed:
            self._file.close()


def write_safetensors(path: str | os.PathLike, entries: Sequence[tuple[str, torch.Tensor]], *,
                      metadata: dict[str, str] | None = None) -> WriteResult:
    """Write ``entries`` (name, tensor) as a safetensors file, fsynced; return its sha256 and size."""
    writer = SafetensorsWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in entries], metadata=metadata)
    try:
        for name, t in entries:
            writer.write(name, t)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


# -- checksums ---------------------------------------------------------------------------------------

def sha256_file(path: str | os.PathLike, *, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def verify_files(folder: Path, files: dict[str, dict], names: Sequence[str] | None = None, *,
                 check_size: bool = True, workers: int | None = None) -> list[str]:
    """Problems with the files ``names`` (default all) of ``files`` (``{name: {"sha256", "bytes"}}``, as
    in a checkpoint's metadata) under ``folder``: missing, wrong size, checksum mismatch. Empty when all
    match. Files hash in parallel (hashlib releases the GIL)."""
    names = sorted(files) if names is None else sorted(names)

    def check(name: str) -> str | None:
        info = files.get(name)
        p = Path(folder) / name
        if info is None:
            return f"{p} is not listed in the metadata"
        if not p.is_file():
            return f"{p} is missing"
        if check_size and "bytes" in info and p.stat().st_size != info["bytes"]:
            return f"{p}: {p.stat().st_size} bytes, the metadata says {info['bytes']} (the file is truncated or corrupt)"
        if sha256_file(p) != info["sha256"]:
            return f"checksum mismatch in {p}: the file is corrupt (sha256 differs from the metadata)"
        return None

    if not names:
        return []
    with ThreadPoolExecutor(max_workers=workers or max(1, min(len(names), os.cpu_count() or 1))) as pool:
        return [e for e in pool.map(check, names) if e]
