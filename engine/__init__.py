"""Tessel engine: model-agnostic runtime (config, trainer, optimizer, checkpoint, data, metrics, ops)."""
from engine import _native

__version__ = "0.1.0"


def native_status() -> dict[str, str]:
    """Which native components are built, and whether each carries its CUDA part."""
    out = {}
    for name in _native.components():
        if not _native.available(name):
            out[name] = "missing"
        else:
            out[name] = "cpu+cuda" if _native.has_cuda(name) else "cpu"
    return out
