"""Index builders for GPT-style datasets: document, sample, blending and shuffle indices.

Megatron-LM semantics (megatron/core/datasets/gpt_dataset.py and helpers.cpp), with two
backends that return identical arrays:

* ``"native"``: ``engine._data_index`` (csrc/data_index/), C++ loops run with the GIL released;
* ``"numpy"``: the reference in this file;
* ``"auto"``: native when it is built, numpy otherwise.

The GPT dataset builds its indices once per (dataset, split, seed) and caches them; the sizes
involved (millions of documents, billions of tokens) are why a native path exists at all.

Differences from Megatron-LM, all deliberate:

* The document index shuffles each epoch on its own (every epoch is a permutation of the
  documents); Megatron shuffles all epochs together (all but the last with
  ``separate_final_epoch``). Both draw from ``numpy.random.RandomState(seed)`` with the same
  Fisher-Yates walk, so the results coincide bit for bit when ``num_epochs == 1``, or
  ``num_epochs == 2`` with ``separate_final_epoch=True``.
* The number of samples kept with ``drop_last_partial=False`` is an exact integer ceiling
  (Megatron rounds through float32, inexact past 2**24 tokens).
* A kept partial last sample ends in the last non-empty document of the stream; Megatron
  writes the last position with offset ``size - 1``, which is ``-1`` when that document is empty.
* Inconsistent inputs (ids out of range, too few tokens) raise ``ValueError`` here; Megatron's
  C++ ``assert`` is compiled out and reads out of bounds.
* The blending rule compares each dataset's count with its target after the pick,
  ``w * (i + 1)``; Megatron uses ``w * max(i, 1)``, one step behind, which lets counts drift
  up to ~1.5 samples from their targets (the picks then differ from Megatron's in places).
* The shuffle index draws from its own stream (``numpy.random.default_rng((seed, tag))``);
  Megatron continues the document index's RandomState, which ties the two together.
"""
from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np

from engine import _native

_BACKENDS = ("auto", "native", "numpy")
_INT32_MAX = int(np.iinfo(np.int32).max)
_UINT32_MAX = int(np.iinfo(np.uint32).max)
# Keeps every token position (i * seq_length + 1, cumulative sums) far from int64 overflow.
_MAX_TOTAL_TOKENS = 2**62
# Tag mixed into the shuffle-index seed so that it never replays the document-index draws.
_SHUFFLE_STREAM_TAG = 0x5348_5546  # "SHUF"


# ----------------------------------------------------------------------------- validation


def _native_module(backend: str):
    """The native module for ``backend``, or None for the numpy reference."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "numpy":
        return None
    if backend == "native":
        return _native.load("data_index")  # ImportError naming the build command if missing
    return _native.load("data_index") if _native.available("data_index") else None


def _check_int(value, name: str, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and <= {maximum}"
        raise ValueError(f"{name} must be >= {minimum}{upper}, got {value}")
    return value


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def _as_int32(array, name: str) -> np.ndarray:
    """1-D C-contiguous int32 view of ``array``: no copy when it already is one."""
    array = np.asarray(array)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.dtype == np.int32:
        return np.ascontiguousarray(array)
    if array.size == 0 and array.dtype.kind == "f":
        return np.zeros(0, dtype=np.int32)  # np.array([]) is float64; nothing to convert
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.size and (int(array.max()) > _INT32_MAX or int(array.min()) < -_INT32_MAX - 1):
        raise ValueError(f"{name} values must fit in int32 (Megatron's index dtype)")
    return array.astype(np.int32)


# ----------------------------------------------------------------------------- document index


def build_document_index(
    documents: np.ndarray,
    num_epochs: int,
    *,
    seed: int,
    separate_final_epoch: bool = False,
    backend: str = "auto",
) -> np.ndarray:
    """Per-epoch shuffled document ids: int32 of shape (num_epochs * len(documents),).

    Block ``e`` (``out[e * n:(e + 1) * n]``) is a permutation of ``documents``. The blocks are
    shuffled in order by one ``numpy.random.RandomState(seed)`` (``RandomState.shuffle``, MT19937
    with numpy's masked-rejection bounded draws); the native backend reimplements that generator
    and walk and returns the same bits. Epoch ``e`` therefore does not depend on ``num_epochs``:
    building more epochs only appends.

    Megatron-LM shuffles the concatenation of all epochs at once, so its epochs are not
    permutations, and ``separate_final_epoch=True`` keeps the last epoch out of that mix so a
    partially used final epoch still draws every document at most once. Shuffling each epoch on
    its own gives that guarantee for every epoch, so ``separate_final_epoch`` is accepted (the
    GPT dataset passes Megatron's decision through unchanged) and does not change the result.
    The output equals Megatron's for ``num_epochs == 1``, and for ``num_epochs == 2`` with
    ``separate_final_epoch=True``.

    ``documents``: 1-D non-negative integer ids (at most 2**31 - 1 of them; repeats allowed).
    ``seed``: in [0, 2**32 - 1] (RandomState's range).
    """
    documents = _as_int32(documents, "documents")
    num_epochs = _check_int(num_epochs, "num_epochs", minimum=1)
    seed = _check_int(seed, "seed", minimum=0, maximum=_UINT32_MAX)
    _check_bool(separate_final_epoch, "separate_final_epoch")
    if documents.size and int(documents.min()) < 0:
        raise ValueError("documents must hold non-negative document ids")
    if num_epochs * documents.size >= 2**62:
        raise ValueError("num_epochs * len(documents) must be < 2**62, got "
                         f"num_epochs={num_epochs}, len(documents)={documents.size}")
    module = _native_module(backend)
    if module is not None:
        return module.build_document_index(documents, num_epochs, seed)
    return _document_index_numpy(documents, num_epochs, seed)


def _document_index_numpy(documents: np.ndarray, num_epochs: int, seed: int) -> np.ndarray:
    rng = np.random.RandomState(seed)
    out = np.empty((num_epochs, documents.size), dtype=np.int32)  # (epoch, document)
    for epoch in range(num_epochs):
        out[epoch] = documents
        rng.shuffle(out[epoch])
    return out.reshape(-1)  # (num_epochs * n,)


# ----------------------------------------------------------------------------- sample index


def _num_samples(total_tokens: int, seq_length: int, drop_last_partial: bool, extra: int) -> int:
    usable = total_tokens - extra
    if usable <= 0:
        return 0
    return usable // seq_length if drop_last_partial else -(-usable // seq_length)


def build_sample_index(
    sizes: np.ndarray,
    document_index: np.ndarray,
    *,
    seq_length: int,
    tokens_per_epoch: int,
    num_epochs: int,
    drop_last_partial: bool = True,
    add_extra_token: bool = True,
    backend: str = "auto",
) -> np.ndarray:
    """Where each sample starts: shape (num_samples + 1, 2), rows (position, offset).

    ``sizes[d]`` is the token count of document ``d``; ``document_index`` (from
    :func:`build_document_index`) orders the documents into one token stream, of which the first
    ``T = tokens_per_epoch * num_epochs`` tokens are cut into samples. Sample ``i`` starts at
    stream token ``i * seq_length``: row ``i`` is (position ``p`` in ``document_index``, token
    offset inside document ``document_index[p]``), and the sample runs to row ``i + 1`` plus one
    more token when ``add_extra_token`` (samples of ``seq_length + 1`` tokens overlapping by one,
    inputs and shifted labels). Row 0 is (0, 0). A row that falls on a document boundary names
    the document holding the previous sample's last token, as Megatron's walk does (with
    ``add_extra_token=False`` the offset may then equal that document's size).

    ``num_samples = (T - extra) // seq_length`` with ``drop_last_partial``, else the ceiling, which
    keeps one shorter final sample (``extra`` = int(add_extra_token); 0 when ``T <= extra``).
    dtype int32, int64 when ``document_index`` has 2**31 - 1 entries or more.

    Raises ValueError on a negative size, an id outside [0, len(sizes)), or ``T`` above the tokens
    ``document_index`` holds. Both backends return identical arrays.
    """
    sizes = _as_int32(sizes, "sizes")
    document_index = _as_int32(document_index, "document_index")
    seq_length = _check_int(seq_length, "seq_length", minimum=1, maximum=_INT32_MAX)
    tokens_per_epoch = _check_int(tokens_per_epoch, "tokens_per_epoch", minimum=0)
    num_epochs = _check_int(num_epochs, "num_epochs", minimum=1)
    drop_last_partial = _check_bool(drop_last_partial, "drop_last_partial")
    add_extra_token = _check_bool(add_extra_token, "add_extra_token")
    total_tokens = tokens_per_epoch * num_epochs
    if total_tokens >= _MAX_TOTAL_TOKENS:
        raise ValueError(f"tokens_per_epoch * num_epochs must be < 2**62, got {total_tokens}")
    module = _native_module(backend)
    if module is not None:
        return module.build_sample_index(sizes, document_index, seq_length, total_tokens,
                                         drop_last_partial, add_extra_token)
    return _sample_index_numpy(sizes, document_index, seq_length, total_tokens,
                               drop_last_partial, int(add_extra_token))


def _sample_index_numpy(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                        total_tokens: int, drop_last_partial: bool, extra: int) -> np.ndarray:
    if sizes.size and int(sizes.min()) < 0:
        bad = int(np.flatnonzero(sizes < 0)[0])
        raise ValueError(f"sizes[{bad}] = {int(sizes[bad])} is negative; document sizes must be "
                         ">= 0")
    if document_index.size:
        out_of_range = (document_index < 0) | (document_index >= sizes.size)
        if out_of_range.any():
            bad = int(np.flatnonzero(out_of_range)[0])
            raise ValueError(
                f"document_index[{bad}] = {int(document_index[bad])} is out of range for sizes of "
                f"length {sizes.size}; document_index must hold ids in [0, len(sizes))")
    doc_sizes = sizes[document_index].astype(np.int64)  # (positions,)
    cum_end = np.cumsum(doc_sizes)  # (positions,) tokens through each position, inclusive
    available = int(cum_end[-1]) if cum_end.size else 0
    if total_tokens > available:
        raise ValueError(
            f"tokens_per_epoch * num_epochs = {total_tokens} exceeds the {available} tokens that "
            "document_index holds; pass the token count of one epoch of documents")

    num_samples = _num_samples(total_tokens, seq_length, drop_last_partial, extra)
    dtype = np.int32 if document_index.size < _INT32_MAX else np.int64
    out = np.zeros((num_samples + 1, 2), dtype=dtype)  # row 0 stays (0, 0)
    if num_samples:
        # Sample i - 1 ends (exclusive, extra token included) at i * seq_length + extra; a kept
        # partial sample is cut at the end of the stream.
        ends = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length + extra
        np.minimum(ends, available, out=ends)
        # First position whose documents reach the end: the one holding the last token (empty
        # documents share the cumulative count of the one before and are skipped by 'left').
        positions = np.searchsorted(cum_end, ends, side="left")
        out[1:, 0] = positions
        out[1:, 1] = ends - extra - (cum_end[positions] - doc_sizes[positions])
    return out


# ----------------------------------------------------------------------------- blending index


def build_blending_indices(
    weights: Sequence[float], size: int, *, backend: str = "auto"
) -> tuple[np.ndarray, np.ndarray]:
    """Interleave ``len(weights)`` datasets: (dataset_index int16 (size,), dataset_sample_index
    int64 (size,)).

    Megatron-LM's greedy rule on the normalised weights ``w = weights / sum(weights)``: step
    ``i`` picks the first dataset ``k`` maximising ``w[k] * (i + 1) - count[k]`` (the one whose
    realised count lags its target most), writes ``(k, count[k])`` and increments ``count[k]``.
    Megatron's code targets ``w[k] * max(i, 1)``, one step behind; targeting the count after the
    pick keeps every prefix's counts within one sample of ``w * n`` (Megatron's drift up to ~1.5),
    so the realised fractions are within ``1 / size`` of the weights. Sample ``j`` of dataset
    ``k`` is used in order ``j = 0, 1, ...``. Weights must be finite and positive, at most 32767
    of them (int16 ids).
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError("weights must be a non-empty 1-D sequence of positive numbers")
    if w.size > np.iinfo(np.int16).max:
        raise ValueError(f"at most 32767 datasets can be blended (int16 ids), got {w.size}")
    if not np.all(np.isfinite(w)) or not np.all(w > 0):
        raise ValueError(f"weights must be finite and > 0, got {w.tolist()}; drop datasets "
                         "that should not be sampled")
    size = _check_int(size, "size", minimum=0)
    w = w / w.sum()
    module = _native_module(backend)
    if module is not None:
        return module.build_blending_indices(w, size)
    return _blending_indices_numpy(w, size)


def _blending_indices_numpy(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    # Each pick depends on every earlier one, so the rule does not vectorise; this loop is the
    # reference. Python floats are IEEE doubles: the same multiply and subtract as the C++.
    w = weights.tolist()
    counts = [0] * len(w)
    choices = [0] * size
    sample_ids = [0] * size
    datasets = range(1, len(w))
    for i in range(size):
        step = float(i + 1)
        best, best_error = 0, w[0] * step - counts[0]
        for k in datasets:
            error = w[k] * step - counts[k]
            if error > best_error:
                best, best_error = k, error
        choices[i] = best
        sample_ids[i] = counts[best]
        counts[best] += 1
    return np.array(choices, dtype=np.int16), np.array(sample_ids, dtype=np.int64)


# ----------------------------------------------------------------------------- shuffle index


def build_shuffle_index(num_samples: int, total_size: int, *, seed: int) -> np.ndarray:
    """A permutation of ``range(total_size)`` that keeps ``[0, num_samples)`` in front.

    Megatron's rule: ``[0, num_samples)`` and ``[num_samples, total_size)`` are shuffled
    separately and concatenated, so with a separated final epoch (``num_samples`` = samples
    before it) the final epoch's samples come last. dtype uint32, int64 when ``total_size >=
    2**32 - 1``. Deterministic given ``seed`` (in [0, 2**32 - 1]); drawn from
    ``numpy.random.default_rng((seed, tag))``, a stream independent of the document index's.
    """
    total_size = _check_int(total_size, "total_size", minimum=0)
    num_samples = _check_int(num_samples, "num_samples", minimum=0, maximum=total_size)
    seed = _check_int(seed, "seed", minimum=0, maximum=_UINT32_MAX)
    dtype = np.uint32 if total_size < _UINT32_MAX else np.int64
    rng = np.random.default_rng((seed, _SHUFFLE_STREAM_TAG))
    out = np.arange(total_size, dtype=dtype)
    rng.shuffle(out[:num_samples])
    rng.shuffle(out[num_samples:])
    return out
