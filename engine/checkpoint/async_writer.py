"""Writing one rank's shard file: host staging, a streaming safetensors writer, a background thread.

The writer produces a standard safetensors file (8-byte little-endian header length, JSON header
padded with spaces to 8 bytes, then the tensors back to back) that ``safetensors.safe_open`` reads.
It is written here rather than with ``safetensors.torch.save_file`` so the bytes stream from the
tensors' memory in chunks while being hashed (sha256 recorded in the metadata), the file is
fsynced before it counts as written, and the write can run in a thread that does not hold the
GIL for long (``file.write`` and ``hashlib`` release it on large buffers).

Test hook: ``TESSEL_CHECKPOINT_TEST_PAUSE="write:<bytes>:<marker path>"`` makes the writer stop
after ``<bytes>`` bytes of a shard, touch the marker and sleep, so a crash test can SIGKILL the
process at a known point mid-save; ``"commit:<marker path>"`` pauses after the commit rename,
before the ``latest`` pointer is updated.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.checkpoint.format import safetensors_code

PAUSE_ENV = "TESSEL_CHECKPOINT_TEST_PAUSE"
CHUNK_BYTES = 64 << 20


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


def _byte_view_np(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a uint8 numpy array (shares memory; any dtype, bf16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class StagingPool:
    """Host buffers reused from one async save to the next.

    Fresh host memory costs page faults on first touch (and pinning, on CUDA), often more than the
    copy itself; reusing the previous save's buffers leaves only the copy. A buffer is handed back
    only after its write has finished, so a pending write never sees it change.
    """

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, shape, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        free = self._free.get((tuple(shape), dtype, pinned))
        if free:
            return free.pop()
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=pinned)

    def give_back(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self._free.setdefault((tuple(t.shape), t.dtype, t.is_pinned()), []).append(t)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)


def stage_to_host(tensors: list[torch.Tensor], *, snapshot: bool, pool: StagingPool | None = None) -> list[torch.Tensor]:
    """Contiguous CPU tensors holding the bytes to write.

    ``snapshot=True`` (async save) copies everything, so training may modify the originals as soon
    as this returns: CUDA tensors go to pinned host memory (one synchronize at the end), CPU
    tensors are copied, into buffers from ``pool`` when given. ``snapshot=False`` (sync save)
    copies only what is on a device or strided.
    """
    out: list[torch.Tensor] = []
    any_cuda = False
    for t in tensors:
        t = t.detach()
        if t.is_cuda or snapshot:
            pinned = t.is_cuda
            host = pool.take(t.shape, t.dtype, pinned=pinned) if pool is not None else (
                torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned))
            if pinned or not t.is_contiguous() or t.numel() == 0:
                host.copy_(t, non_blocking=pinned)
            else:  # numpy's memcpy-based copy is several times faster than Tensor.copy_ on CPU
                np.copyto(_byte_view_np(host), _byte_view_np(t))
            any_cuda |= pinned
        else:
            host = t.contiguous()
        out.append(host)
    if any_cuda:
        torch.cuda.synchronize()
    return out


@dataclass(frozen=True)
class WriteResult:
    file: str
    sha256: str
    bytes: int


def write_safetensors(path: Path, entries: list[tuple[str, torch.Tensor]], *,
                      metadata: dict[str, str] | None = None) -> WriteResult:
    """Write ``entries`` (name, contiguous CPU tensor) as a safetensors file, fsynced; return its hash."""
    header: dict = {}
    offset = 0
    for name, t in entries:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": safetensors_code(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)  # tensors start 8-byte aligned
    prefix = len(hjson).to_bytes(8, "little") + hjson
    h = hashlib.sha256()
    written = 0
    # Hash on a second thread, in order, while this one writes: both release the GIL on large
    # buffers, so the save costs max(write, hash) instead of their sum.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessel-ckpt-sha256") as hasher, open(path, "wb") as f:
        f.write(prefix)
        h.update(prefix)
        written += len(prefix)
        for _, t in entries:
            view = _byte_view(t)
            for lo in range(0, len(view), CHUNK_BYTES):
                chunk = view[lo:lo + CHUNK_BYTES]
                pause_at = _pause_point()
                if pause_at is not None and written < pause_at <= written + len(chunk):
                    cut = pause_at - written  # write up to the pause point, make it durable, then stop
                    f.write(chunk[:cut])
                    f.flush()
                    os.fsync(f.fileno())
                    test_pause("write", written=pause_at)
                hasher.submit(h.update, chunk)
                f.write(chunk)
                written += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    # Leaving the executor's block waited for every queued update: the digest is complete.
    return WriteResult(file=path.name, sha256=h.hexdigest(), bytes=written)


def _pause_point() -> int | None:
    spec = os.environ.get(PAUSE_ENV, "")
    if spec.startswith("write:"):
        return int(spec.split(":", 2)[1])
    return None


class BackgroundWrite:
    """Runs ``write_safetensors`` in a daemon thread; :meth:`result` joins and re-raises its error."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.Tensor]], *, metadata: dict[str, str] | None):
        self._result: WriteResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(path, entries, metadata),
                                        name=f"tessel-ckpt-{path.name}", daemon=True)
        self._thread.start()

    def _run(self, path, entries, metadata) -> None:
        try:
            self._result = write_safetensors(path, entries, metadata=metadata)
        except BaseException as e:  # noqa: BLE001 - surfaced to the caller by result()
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> WriteResult:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
