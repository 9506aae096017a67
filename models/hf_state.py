"""A read-only, lazy mapping over Hugging Face safetensors files (one file or a sharded directory).

``SafetensorsState(path)`` maps tensor names to tensors like a dict, and also offers
``get_slice(name)`` (safetensors' lazy slice), which :func:`models.load_hf_state_dict` uses so a TP
rank reads only its rows or columns. ``reads`` records every name touched (tests use it to check
that a pipeline stage reads only its own tensors).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Iterator

import torch


def safetensors_files(path: str | os.PathLike) -> list[str]:
    """The weight files of ``path`` (a file, or a model directory) as transformers picks them: the files
    ``model.safetensors.index.json`` lists; else ``model.safetensors`` alone (a stray file beside it, such as
    Mistral's ``consolidated.safetensors``, is not read); else every ``*.safetensors``. ValueError if none."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return [path]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        names = ["model.safetensors"]
    else:
        names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not names:
        raise ValueError(f"no .safetensors files under {path!r}")
    return [os.path.join(path, f) for f in names]


class SafetensorsState(Mapping):
    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        path = os.fspath(path)
        files = safetensors_files(path)
        self._handles = []
        self._where: dict[str, object] = {}
        for f in files:
            h = safe_open(f, framework="pt")
            self._handles.append(h)
            for k in h.keys():
                if k in self._where:
                    raise ValueError(f"tensor {k!r} appears in more than one file under {path!r}")
                self._where[k] = h
        self.reads: set[str] = set()

    def _handle(self, key: str):
        try:
            return self._where[key]
        except KeyError:
            raise KeyError(key) from None

    def __getitem__(self, key: str) -> torch.Tensor:
        h = self._handle(key)
        self.reads.add(key)
        return h.get_tensor(key)

    def get_slice(self, key: str):
        h = self._handle(key)
        self.reads.add(key)
        return h.get_slice(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key) -> bool:
        return key in self._where
