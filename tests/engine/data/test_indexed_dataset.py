"""The MMIDIDX format: writer and reader against an independent struct/numpy layout, and every error."""
import os
import struct

import numpy as np
import pytest

from engine.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    optimal_dtype,
)

MAGIC = b"MMIDIDX\x00\x00"


def write_by_hand(prefix, sequences, doc_bounds, *, dtype, code):
    """The documented layout, written with struct/numpy only (independent of the writer)."""
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(np.asarray(s, dtype=dtype).tobytes())
    sizes = [len(s) for s in sequences]
    pointers, offset = [], 0
    for n in sizes:
        pointers.append(offset)
        offset += n * np.dtype(dtype).itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(MAGIC + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<QQ", len(sizes), len(doc_bounds)))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(sizes)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_bounds)}q", *doc_bounds))


def parse_by_hand(idx_path):
    with open(idx_path, "rb") as f:
        raw = f.read()
    assert raw[:9] == MAGIC
    (version,) = struct.unpack_from("<Q", raw, 9)
    code = raw[17]
    n, d = struct.unpack_from("<QQ", raw, 18)
    sizes = struct.unpack_from(f"<{n}i", raw, 34)
    pointers = struct.unpack_from(f"<{n}q", raw, 34 + 4 * n)
    docs = struct.unpack_from(f"<{d}q", raw, 34 + 12 * n)
    assert len(raw) == 34 + 12 * n + 8 * d
    return version, code, list(sizes), list(pointers), list(docs)


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.uint8, 1), (np.int64, 5)])
def test_reader_reads_hand_written_index(tmp_path, dtype, code):
    seqs = [[1, 2, 3], [], [7], [200, 100, 5, 9, 9]]
    prefix = str(tmp_path / "hand")
    # Two documents: sequences [0, 2) and [2, 4) (documents may hold several sequences).
    write_by_hand(prefix, seqs, [0, 2, 4], dtype=dtype, code=code)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == 4 and ds.num_documents == 2
    assert ds.sizes.tolist() == [3, 0, 1, 5]
    assert ds.document_indices.tolist() == [0, 2, 4]
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s
    assert ds.get(3, 1, 3).tolist() == [100, 5, 9]
    assert [x.tolist() for x in ds.document(1)] == [[7], [200, 100, 5, 9, 9]]
    assert ds[-1].tolist() == seqs[-1]


def test_writer_output_parsed_by_hand(tmp_path):
    prefix = str(tmp_path / "w")
    with IndexedDatasetBuilder(prefix, vocab_size=50_000) as b:
        b.add_document([5, 6, 7])
        b.add_item([1])
        b.add_item([2, 3])
        b.end_document()
        b.add_document([49_999])
    version, code, sizes, pointers, docs = parse_by_hand(prefix + ".idx")
    assert (version, code) == (1, 8)  # uint16 for a vocab under 65500
    assert sizes == [3, 1, 2, 1]
    assert pointers == [0, 6, 8, 12]
    assert docs == [0, 1, 3, 4]
    raw = np.fromfile(prefix + ".bin", dtype="<u2")
    assert raw.tolist() == [5, 6, 7, 1, 2, 3, 49_999]


def test_round_trip_and_zero_copy(random_dataset):
    prefix, docs = random_dataset
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs) == ds.num_documents
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        assert np.array_equal(ds[i], d)
    view = ds[5]
    assert not view.flags.writeable
    assert np.shares_memory(view, ds._bin_map)  # a view into the mapping, not a copy
    assert np.shares_memory(ds.sizes, ds._idx_map)


def test_optimal_dtype_and_too_small_dtype(tmp_path):
    assert optimal_dtype(4096) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32
    assert IndexedDatasetBuilder(str(tmp_path / "a"), vocab_size=100_000).dtype == np.int32
    with pytest.raises(ValueError, match="dtype=uint16 cannot hold token ids up to 99999"):
        IndexedDatasetBuilder(str(tmp_path / "b"), dtype=np.uint16, vocab_size=100_000)
    with pytest.raises(ValueError, match="not an integer token dtype"):
        IndexedDatasetBuilder(str(tmp_path / "c"), dtype=np.float32)


def test_out_of_vocab_token_rejected_and_nothing_written(tmp_path):
    prefix = str(tmp_path / "oov")
    with pytest.raises(ValueError, match=r"token ids in \[0, 300\] do not fit"):
        with IndexedDatasetBuilder(prefix, vocab_size=257) as b:
            b.add_document([1, 2])
            b.add_document([0, 300])
    assert os.listdir(tmp_path) == []  # discarded: no partial .bin/.idx or temp files


def test_missing_files_name_path_and_fix(tmp_path):
    prefix = str(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match=r"nothing\.idx not found.*tools/preprocess_data\.py"):
        IndexedDataset(prefix)
    write_by_hand(prefix, [[1]], [0, 1], dtype=np.uint16, code=8)
    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=r"nothing\.bin not found"):
        IndexedDataset(prefix)


def _corrupt(prefix, offset, data):
    with open(prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good")
    write_by_hand(prefix, [[1, 2, 3], [4, 5]], [0, 1, 2], dtype=np.uint16, code=8)
    return prefix


def test_wrong_magic(good):
    _corrupt(good, 0, b"NOTANIDX\x00")
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: wrong magic"):
        IndexedDataset(good)


def test_wrong_version(good):
    _corrupt(good, 9, struct.pack("<Q", 2))
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: unsupported index version 2"):
        IndexedDataset(good)


def test_unknown_dtype_code(good):
    _corrupt(good, 17, bytes([9]))
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: unknown dtype code 9"):
        IndexedDataset(good)


def test_truncated_index(good):
    with open(good + ".idx", "r+b") as f:
        f.truncate(os.path.getsize(good + ".idx") - 8)
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: size .* does not match its header"):
        IndexedDataset(good)
    with open(good + ".idx", "r+b") as f:
        f.truncate(20)
    with pytest.raises(IndexedDatasetError, match="shorter than the 34-byte header"):
        IndexedDataset(good)


def test_sequence_count_not_matching_file_length(good):
    _corrupt(good, 18, struct.pack("<Q", 3))
    with pytest.raises(IndexedDatasetError, match="does not match its header"):
        IndexedDataset(good)


def test_truncated_bin(good):
    with open(good + ".bin", "r+b") as f:
        f.truncate(6)
    with pytest.raises(IndexedDatasetError, match=r"good\.bin: size 6 bytes, but .*describes 10 bytes"):
        IndexedDataset(good)


def test_pointers_not_matching_sizes(good):
    _corrupt(good, 34 + 8 + 8, struct.pack("<q", 4))  # second pointer should be 6
    with pytest.raises(IndexedDatasetError, match="pointers do not match the sizes .*sequence 1"):
        IndexedDataset(good)


def test_bad_document_indices(good):
    _corrupt(good, 34 + 24 + 16, struct.pack("<q", 5))  # last document index past the sequence count
    with pytest.raises(IndexedDatasetError, match="document indices must rise from 0"):
        IndexedDataset(good)


def test_get_bounds(good):
    ds = IndexedDataset(good)
    with pytest.raises(IndexError, match="out of range"):
        ds[2]
    with pytest.raises(IndexError, match="outside sequence 0"):
        ds.get(0, 2, 2)


def test_merge_shards(tmp_path):
    a, b, out = (str(tmp_path / n) for n in ("a", "b", "ab"))
    write_by_hand(a, [[1, 2], [3]], [0, 2], dtype=np.uint16, code=8)
    write_by_hand(b, [[4], [5, 6]], [0, 1, 2], dtype=np.uint16, code=8)
    with IndexedDatasetBuilder(out, dtype=np.uint16) as builder:
        builder.add_index(a)
        builder.add_index(b)
    ds = IndexedDataset(out)
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [4], [5, 6]]
    assert ds.document_indices.tolist() == [0, 2, 3, 4]


def test_pickles_by_prefix_not_by_value(random_dataset):
    import pickle

    prefix, docs = random_dataset
    ds = IndexedDataset(prefix)
    blob = pickle.dumps(ds)
    assert len(blob) < 200  # the prefix, not the tokens
    again = pickle.loads(blob)
    assert len(again) == len(docs) and np.array_equal(again[7], docs[7])
