"""GPT samples: contents equal a brute-force token stream, determinism, cache reuse, splits."""
import json
import os

import numpy as np
import pytest

from engine.data import index_helpers
from engine.data.gpt_dataset import GPTDataset, parse_split, split_document_ranges
from engine.data.indexed_dataset import IndexedDataset

from .conftest import write_random_dataset


def brute_force_samples(ds: GPTDataset):
    """Every sample straight from its definition: the doc-index token stream cut every seq_length."""
    stream = np.concatenate([ds.indexed[int(d)] for d in ds.document_index]).astype(np.int64)
    s = ds.seq_length
    unshuffled = [stream[i * s: i * s + s + 1] for i in range(ds.sample_index.shape[0] - 1)]
    return [unshuffled[int(j)] for j in ds.shuffle_index]


@pytest.mark.parametrize("num_samples,seq_length", [(None, 16), (50, 7), (700, 33)])
def test_samples_match_brute_force_stream(random_dataset, tmp_path, num_samples, seq_length):
    prefix, docs = random_dataset
    ds = GPTDataset(IndexedDataset(prefix), document_range=(10, 150), num_samples=num_samples,
                    seq_length=seq_length, seed=7, cache_dir=str(tmp_path / "cache"))
    tokens_per_epoch = sum(len(d) for d in docs[10:150])
    epochs = len(ds.document_index) // 140
    assert sorted(ds.document_index[:140].tolist()) == list(range(10, 150))  # a permutation per epoch
    assert len(ds) == (epochs * tokens_per_epoch - 1) // seq_length >= (num_samples or 1)
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
    expected = brute_force_samples(ds)
    for i in range(len(ds)):
        sample = ds[i]
        assert np.array_equal(ds.get_tokens(i), expected[i])
        assert np.array_equal(sample["tokens"], expected[i][:-1])
        assert np.array_equal(sample["labels"], expected[i][1:])
        assert sample["tokens"].dtype == np.int64 and sample["loss_mask"].dtype == np.float32
        assert np.array_equal(sample["position_ids"], np.arange(seq_length))


def test_same_seed_same_order_other_seed_differs(random_dataset, tmp_path):
    prefix, _ = random_dataset
    indexed = IndexedDataset(prefix)

    def order(seed, cache):
        ds = GPTDataset(indexed, document_range=(0, 200), num_samples=300, seq_length=16, seed=seed,
                        cache_dir=str(tmp_path / cache))
        return np.stack([ds.get_tokens(i) for i in range(len(ds))])

    a, b, c = order(3, "c1"), order(3, "c2"), order(4, "c3")
    assert np.array_equal(a, b)  # independent builds (separate caches) agree
    assert not np.array_equal(a, c)


def test_cache_reused_and_keyed_by_parameters(random_dataset, tmp_path, monkeypatch):
    prefix, _ = random_dataset
    indexed = IndexedDataset(prefix)
    cache = str(tmp_path / "cache")
    kwargs = dict(document_range=(0, 100), num_samples=80, seq_length=16, seed=1, cache_dir=cache)
    first = GPTDataset(indexed, **kwargs)
    assert not first.built_from_cache
    desc = json.load(open(first.cache_paths["description"]))
    assert desc["seq_length"] == 16 and desc["seed"] == 1 and desc["num_samples"] == 80
    mtimes = {p: os.path.getmtime(p) for p in first.cache_paths.values()}

    def boom(*args, **kw):
        raise AssertionError("index rebuilt although it is cached")

    monkeypatch.setattr(index_helpers, "build_sample_index", boom)
    monkeypatch.setattr(index_helpers, "build_document_index", boom)
    second = GPTDataset(indexed, **kwargs)
    assert second.built_from_cache
    assert {p: os.path.getmtime(p) for p in second.cache_paths.values()} == mtimes
    assert np.array_equal(second.sample_index, first.sample_index)
    assert all(np.array_equal(first.get_tokens(i), second.get_tokens(i)) for i in range(len(first)))
    # Any parameter change is a different cache entry, so it builds (and here hits the patched builder).
    for change in (dict(seed=2), dict(seq_length=8), dict(num_samples=81), dict(document_range=(0, 99))):
        with pytest.raises(AssertionError, match="rebuilt"):
            GPTDataset(indexed, **{**kwargs, **change})


def test_cache_key_includes_dataset_contents(tmp_path):
    prefix = str(tmp_path / "d")
    write_random_dataset(prefix, num_docs=30, seed=0)
    a = GPTDataset(IndexedDataset(prefix), document_range=(0, 30), num_samples=10, seq_length=8, seed=0,
                   cache_dir=str(tmp_path / "c"))
    write_random_dataset(prefix, num_docs=31, seed=1)  # same path, rewritten
    b = GPTDataset(IndexedDataset(prefix), document_range=(0, 30), num_samples=10, seq_length=8, seed=0,
                   cache_dir=str(tmp_path / "c"))
    assert not b.built_from_cache and a.cache_paths != b.cache_paths


def test_split_ranges():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98,2") == pytest.approx([0.98, 0.02, 0.0])
    assert split_document_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges("1", 10) == [(0, 10), (10, 10), (10, 10)]
    ranges = split_document_ranges("1,1,1", 10)
    assert ranges[0][0] == 0 and ranges[-1][1] == 10
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("split,match", [
    ("a,b", "expected up to 3 comma-separated numbers"),
    ("1,2,3,4", "give 1 to 3 weights"),
    ("0,0,0", "not all 0"),
    ("90,-5,15", ">= 0"),
])
def test_bad_split(split, match):
    with pytest.raises(ValueError, match=match):
        parse_split(split)


def test_empty_or_too_small_split_errors(random_dataset, tmp_path):
    prefix, _ = random_dataset
    indexed = IndexedDataset(prefix)
    test_range = split_document_ranges("100,0,0", indexed.num_documents)[2]
    with pytest.raises(ValueError, match="split 'test' .* has no documents"):
        GPTDataset(indexed, document_range=test_range, num_samples=5, seq_length=8, seed=0,
                   cache_dir=str(tmp_path), split_name="test")
    with pytest.raises(ValueError, match="fewer than one sample of seq_length"):
        GPTDataset(indexed, document_range=(0, 1), num_samples=5, seq_length=10_000, seed=0, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="outside the 200 documents"):
        GPTDataset(indexed, document_range=(0, 201), num_samples=5, seq_length=8, seed=0, cache_dir=str(tmp_path))


def test_eod_mask_loss(tmp_path):
    from engine.data.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "eod")
    with IndexedDatasetBuilder(prefix, vocab_size=10) as b:
        for _ in range(20):
            b.add_document([1, 2, 3, 9])  # 9 = EOD
    ds = GPTDataset(IndexedDataset(prefix), document_range=(0, 20), num_samples=None, seq_length=6, seed=0,
                    cache_dir=str(tmp_path / "c"), eod_id=9, eod_mask_loss=True)
    for i in range(len(ds)):
        s = ds[i]
        assert np.array_equal(s["loss_mask"] == 0, s["tokens"] == 9)
    with pytest.raises(ValueError, match="eod_mask_loss=True needs eod_id"):
        GPTDataset(IndexedDataset(prefix), document_range=(0, 20), num_samples=None, seq_length=6, seed=0,
                   cache_dir=str(tmp_path / "c"), eod_mask_loss=True)


def test_pickles_small_and_reopens_from_cache(random_dataset, tmp_path):
    import pickle

    prefix, _ = random_dataset
    ds = GPTDataset(IndexedDataset(prefix), document_range=(0, 200), num_samples=500, seq_length=16, seed=2,
                    cache_dir=str(tmp_path / "c"))
    blob = pickle.dumps(ds)
    assert len(blob) < 1000
    again = pickle.loads(blob)
    assert again.built_from_cache and len(again) == len(ds)
    assert all(np.array_equal(again.get_tokens(i), ds.get_tokens(i)) for i in range(0, len(ds), 37))


def test_partly_used_final_epoch_is_shuffled_last(random_dataset, tmp_path):
    prefix, docs = random_dataset
    tokens = sum(len(d) for d in docs)
    per_epoch = (tokens - 1) // 16
    want = 2 * per_epoch + per_epoch // 10  # the third epoch only 10% used: shuffled on its own, at the end
    ds = GPTDataset(IndexedDataset(prefix), document_range=(0, 200), num_samples=want, seq_length=16, seed=0,
                    cache_dir=str(tmp_path))
    assert len(ds.document_index) == 3 * 200
    sans_final = (2 * tokens - 1) // 16
    assert sorted(ds.shuffle_index[:sans_final].tolist()) == list(range(sans_final))
    # Mostly used final epoch (>= 80%): one shuffle over every sample.
    full = GPTDataset(IndexedDataset(prefix), document_range=(0, 200), num_samples=3 * per_epoch - 5,
                      seq_length=16, seed=0, cache_dir=str(tmp_path))
    assert int(np.max(full.shuffle_index[:sans_final])) >= sans_final
