"""Megatron-LM compatible indexed dataset (the ``MMIDIDX`` .bin/.idx pair).

A dataset named by a *prefix* is two files:

``PREFIX.bin``
    The token ids of every sequence, back to back, in one numpy dtype (little-endian), no header.

``PREFIX.idx`` (all integers little-endian)::

    offset  size         field
    0       9            magic  b"MMIDIDX\\x00\\x00"
    9       8   uint64   version, always 1
    17      1   uint8    dtype code of the .bin (see DTYPE_CODES)
    18      8   uint64   sequence count  N
    26      8   uint64   document count  D  (= number of documents + 1)
    34      4*N int32    sizes: tokens per sequence
    34+4N   8*N int64    pointers: byte offset of each sequence in the .bin
    34+12N  8*D int64    document indices: 0, then the sequence index that ends each document

A document is a run of sequences ``[document_indices[j], document_indices[j + 1])``; the
preprocessing tool writes one sequence per document. Megatron-LM's multimodal variant appends
one int8 mode per sequence after the document indices; the reader accepts and ignores it.

The reader memory-maps both files and returns zero-copy, read-only numpy views. Every inconsistency
between the header, the arrays and the file lengths raises :class:`IndexedDatasetError` naming the
file and what is wrong, before any token is read.
"""
from __future__ import annotations

import os
import struct

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = 34  # 9 magic + 8 version + 1 dtype code + 8 sequence count + 8 document count

# Megatron-LM's numeric dtype codes (the byte at offset 17 of the .idx).
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dt: code for code, dt in DTYPE_CODES.items()}
_TOKEN_DTYPES = {np.dtype(t) for t in (np.uint8, np.int8, np.int16, np.uint16, np.int32, np.int64)}


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair that cannot be read: the message names the file and the problem."""


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(data_file_path(prefix)) and os.path.isfile(index_file_path(prefix))


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """uint16 when every id fits with Megatron's margin (vocab < 65500), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def _check_dtype_fits(dtype: np.dtype, vocab_size: int | None) -> None:
    if vocab_size is None:
        return
    if vocab_size <= 0:
        raise ValueError(f"vocab_size={vocab_size} must be positive")
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise ValueError(
            f"dtype={dtype.name} cannot hold token ids up to {vocab_size - 1} (vocab_size={vocab_size}): "
            f"pass dtype=None to choose {optimal_dtype(vocab_size).name} from the vocab size, or a wider dtype"
        )


class IndexedDatasetBuilder:
    """Streams sequences into ``PREFIX.bin`` and writes ``PREFIX.idx`` on :meth:`finalize`.

    Tokens go to ``PREFIX.bin.tmp`` / ``PREFIX.idx.tmp`` and are renamed into place only by
    ``finalize()``, so a crash never leaves a .bin/.idx pair that looks complete. Use as a context
    manager: leaving the ``with`` block normally finalizes; leaving it by an exception discards.

    Args:
        prefix: output path without the .bin/.idx suffix.
        dtype: numpy integer dtype of the .bin; ``None`` picks :func:`optimal_dtype(vocab_size)`.
        vocab_size: when given, every added token must lie in ``[0, vocab_size)`` and ``dtype`` must
            hold ``vocab_size - 1``.
    """

    def __init__(self, prefix: str, *, dtype=None, vocab_size: int | None = None):
        self.prefix = prefix
        self.dtype = optimal_dtype(vocab_size) if dtype is None else np.dtype(dtype)
        if self.dtype not in _TOKEN_DTYPES:
            raise ValueError(
                f"dtype={self.dtype.name} is not an integer token dtype: use one of "
                f"{sorted(d.name for d in _TOKEN_DTYPES)}"
            )
        _check_dtype_fits(self.dtype, vocab_size)
        self.vocab_size = vocab_size
        parent = os.path.dirname(os.path.abspath(prefix))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"output directory {parent} does not exist: create it first")
        self._bin_tmp = data_file_path(prefix) + ".tmp"
        self._idx_tmp = index_file_path(prefix) + ".tmp"
        self._bin = open(self._bin_tmp, "wb")
        self._sizes: list[int] = []
        self._document_indices: list[int] = [0]
        self._closed = False

    # -- adding data ---------------------------------------------------------------------------
    def add_item(self, tokens) -> None:
        """Append one sequence (1-D integer array-like) to the current document."""
        assert not self._closed, "builder already finalized or discarded"
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            limit = self.vocab_size - 1 if self.vocab_size is not None else int(np.iinfo(self.dtype).max)
            if lo < max(0, int(np.iinfo(self.dtype).min)) or hi > limit:
                raise ValueError(
                    f"token ids in [{lo}, {hi}] do not fit the dataset (dtype {self.dtype.name}, "
                    f"vocab_size {self.vocab_size}): check the tokenizer's vocab size"
                )
        if arr.size > np.iinfo(np.int32).max:
            raise ValueError(f"a sequence of {arr.size} tokens exceeds the int32 size field")
        self._bin.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes(order="C"))
        self._sizes.append(int(arr.size))

    def end_document(self) -> None:
        """Close the current document (the sequences added since the last call)."""
        self._document_indices.append(len(self._sizes))

    def add_document(self, tokens) -> None:
        """Append one document made of one sequence."""
        self.add_item(tokens)
        self.end_document()

    def add_index(self, prefix: str) -> None:
        """Append every sequence and document of an existing dataset (merging shards)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {prefix} (dtype {other.dtype.name}) into a {self.dtype.name} dataset")
        offset = len(self._sizes)
        self._sizes.extend(int(s) for s in other.sizes)
        self._document_indices.extend(int(d) + offset for d in other.document_indices[1:])
        with open(data_file_path(prefix), "rb") as src:
            while chunk := src.read(1 << 24):
                self._bin.write(chunk)

    # -- finishing -----------------------------------------------------------------------------
    def finalize(self) -> None:
        """Write the .idx and move both files into place. A trailing open document is closed."""
        assert not self._closed, "builder already finalized or discarded"
        if self._document_indices[-1] != len(self._sizes):
            self.end_document()
        self._bin.close()
        write_index(self._idx_tmp, sizes=self._sizes, document_indices=self._document_indices, dtype=self.dtype)
        os.replace(self._bin_tmp, data_file_path(self.prefix))
        os.replace(self._idx_tmp, index_file_path(self.prefix))
        self._closed = True

    def discard(self) -> None:
        """Drop everything written so far (no .bin/.idx is produced)."""
        if self._closed:
            return
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)
        self._closed = True

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.discard()

    @property
    def num_sequences(self) -> int:
        return len(self._sizes)


def write_index(path: str, *, sizes, document_indices, dtype) -> None:
    """Write an .idx file for sequences of ``sizes`` tokens stored contiguously in ``dtype``."""
    dtype = np.dtype(dtype)
    sizes_arr = np.asarray(sizes, dtype=np.int32)
    docs = np.asarray(document_indices, dtype=np.int64)
    pointers = np.zeros(len(sizes_arr), dtype=np.int64)
    if len(sizes_arr) > 1:
        # Byte offset of each sequence: exclusive prefix sum of sizes * itemsize.
        np.cumsum(sizes_arr[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(INDEX_MAGIC)
        f.write(struct.pack("<Q", INDEX_VERSION))
        f.write(struct.pack("<B", _CODE_OF_DTYPE[dtype]))
        f.write(struct.pack("<Q", len(sizes_arr)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(sizes_arr.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(docs.astype("<i8").tobytes())


def _missing(path: str, prefix: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"indexed dataset file {path} not found (dataset prefix {prefix!r}). Build the .bin/.idx pair with "
        f"`python tools/preprocess_data.py --input <files> --output-prefix {prefix}`"
    )


class IndexedDataset:
    """Read-only, memory-mapped view of a ``PREFIX.bin`` / ``PREFIX.idx`` pair.

    ``len(ds)`` is the number of sequences; ``ds[i]`` is sequence ``i`` as a read-only numpy array
    of the file's dtype that points into the mapped .bin (no copy); ``ds.get(i, offset, length)``
    a sub-range of it. ``sizes`` (int32, N), ``pointers`` (int64, N) and ``document_indices``
    (int64, documents + 1) are views into the mapped .idx.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.idx_path = index_file_path(prefix)
        self.bin_path = data_file_path(prefix)
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise _missing(path, prefix)
        self._read_index()
        self._map_data()

    def _read_index(self) -> None:
        path = self.idx_path
        file_size = os.path.getsize(path)
        if file_size < HEADER_BYTES:
            raise IndexedDatasetError(
                f"{path}: truncated index, {file_size} bytes is shorter than the {HEADER_BYTES}-byte header"
            )
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
        magic = header[:9]
        if magic != INDEX_MAGIC:
            raise IndexedDatasetError(
                f"{path}: wrong magic {magic!r}, expected {INDEX_MAGIC!r}: not a Megatron MMIDIDX index file"
            )
        (version,) = struct.unpack("<Q", header[9:17])
        if version != INDEX_VERSION:
            raise IndexedDatasetError(f"{path}: unsupported index version {version}, expected {INDEX_VERSION}")
        code = header[17]
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(
                f"{path}: unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}"
            )
        self.dtype = DTYPE_CODES[code]
        n, d = struct.unpack("<QQ", header[18:34])
        expected = HEADER_BYTES + 12 * n + 8 * d
        if file_size not in (expected, expected + n):  # + n: Megatron's optional int8 modes
            raise IndexedDatasetError(
                f"{path}: size {file_size} bytes does not match its header ({n} sequences, {d} document "
                f"indices need {expected} bytes): the file is truncated or corrupt"
            )
        if d < 1:
            raise IndexedDatasetError(f"{path}: document count is 0; it must be at least 1 (the leading 0)")
        self._idx_map = np.memmap(path, mode="r", dtype=np.uint8)
        buf = self._idx_map
        self.sizes = np.frombuffer(buf, dtype="<i4", count=n, offset=HEADER_BYTES)
        self.pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=HEADER_BYTES + 4 * n)
        self.document_indices = np.frombuffer(buf, dtype="<i8", count=d, offset=HEADER_BYTES + 12 * n)
        self._validate_arrays()

    def _validate_arrays(self) -> None:
        path, n = self.idx_path, len(self.sizes)
        if n and int(self.sizes.min()) < 0:
            raise IndexedDatasetError(f"{path}: negative sequence size at {int(np.argmin(self.sizes))}")
        docs = self.document_indices
        if docs[0] != 0 or docs[-1] != n or (len(docs) > 1 and np.any(np.diff(docs) < 0)):
            raise IndexedDatasetError(
                f"{path}: document indices must rise from 0 to the sequence count {n}; "
                f"got first={int(docs[0])}, last={int(docs[-1])}"
            )
        if n:
            itemsize = self.dtype.itemsize
            ends = self.pointers.astype(np.int64) + self.sizes.astype(np.int64) * itemsize
            if self.pointers[0] != 0 or np.any(self.pointers[1:] != ends[:-1]):
                bad = 0 if self.pointers[0] != 0 else int(np.argmax(self.pointers[1:] != ends[:-1])) + 1
                raise IndexedDatasetError(
                    f"{path}: sequence pointers do not match the sizes (first mismatch at sequence {bad})"
                )
            self._data_bytes = int(ends[-1])
        else:
            self._data_bytes = 0

    def _map_data(self) -> None:
        bin_size = os.path.getsize(self.bin_path)
        if bin_size != self._data_bytes:
            raise IndexedDatasetError(
                f"{self.bin_path}: size {bin_size} bytes, but {self.idx_path} describes {self._data_bytes} bytes "
                f"({int(self.sizes.sum(dtype=np.int64))} tokens of {self.dtype.name}): the .bin is truncated, "
                "corrupt, or from another dataset"
            )
        # np.memmap cannot map an empty file; an empty dataset has no tokens to view anyway.
        self._bin_map = np.memmap(self.bin_path, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)

    # Pickled by prefix (reopened and revalidated on load), never by value: a spawned DataLoader
    # worker maps the files itself instead of receiving a copy of every token.
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    # -- access --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def _check_index(self, idx: int) -> int:
        n = len(self.sizes)
        if not -n <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {self.prefix} with {n} sequences")
        return idx + n if idx < 0 else idx

    def __getitem__(self, idx: int) -> np.ndarray:
        if not isinstance(idx, (int, np.integer)):
            raise TypeError(f"index with an int sequence number, got {type(idx).__name__}")
        return self.get(int(idx))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        idx = self._check_index(int(idx))
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"offset={offset}, length={length} outside sequence {idx} of {size} tokens in {self.prefix}"
            )
        start = int(self.pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_map, dtype=self.dtype, count=length, offset=start) if length else \
            np.zeros(0, dtype=self.dtype)

    def document(self, doc: int) -> list[np.ndarray]:
        """The sequences of document ``doc``."""
        if not 0 <= doc < self.num_documents:
            raise IndexError(f"document {doc} out of range for {self.prefix} with {self.num_documents} documents")
        lo, hi = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        return [self.get(i) for i in range(lo, hi)]

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, sequences={len(self)}, documents={self.num_documents}, "
                f"dtype={self.dtype.name})")
