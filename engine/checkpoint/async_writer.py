"""Writing one rank's shard file: host staging and a background thread around
:func:`engine.checkpoint.safetensors_io.write_safetensors` (the one safetensors writer: the bytes
stream from the tensors' memory in chunks while being hashed, the file is fsynced before it counts as
written, and ``file.write`` and ``hashlib`` release the GIL on large buffers, so the thread does not
hold it for long).

Test hooks (``TESSEL_CHECKPOINT_TEST_PAUSE``): ``"write:<bytes>:<marker path>"`` stops the writer
after ``<bytes>`` bytes of a shard (safetensors_io); ``"commit:<marker path>"`` pauses after the
commit rename, before the ``latest`` pointer is updated (save.py).
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

from engine.checkpoint.safetensors_io import WriteResult, write_safetensors


def _byte_view_np(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a uint8 numpy array (shares memory; any dtype, bf16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


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
    taken: list[torch.Tensor] = []  # buffers from ``pool``: given back if staging fails part way
    any_cuda = False
    try:
        for t in tensors:
            t = t.detach()
            if t.is_cuda or snapshot:
                pinned = t.is_cuda
                host = pool.take(t.shape, t.dtype, pinned=pinned) if pool is not None else (
                    torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned))
                if pool is not None:
                    taken.append(host)
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
    except BaseException:
        if taken:
            try:
                if any_cuda:
                    torch.cuda.synchronize()  # no copy into them may still be in flight when they are reused
                pool.give_back(taken)
            except Exception:  # noqa: BLE001 - a broken device: the buffers are dropped, the error below stands
                pass
        raise
    return out


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
