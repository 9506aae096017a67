"""Blending: realised fractions track the weights within 1/N; the train/valid/test builder."""
import numpy as np
import pytest

from engine.data.blending import BlendedDataset, build_gpt_datasets, parse_data_path
from engine.data.gpt_dataset import GPTDataset

from .conftest import write_random_dataset


class Tagged:
    """A dataset whose sample j of dataset k is (k, j): makes the blend's picks visible."""

    def __init__(self, k, n):
        self.k, self.n = k, n

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        assert 0 <= j < self.n
        return (self.k, j)


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.7, 0.2, 0.1], [3, 1, 1, 5], [0.01, 0.99], [1 / 3] * 3])
def test_fractions_within_one_over_n(weights, tmp_path):
    size = 2000
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    blend = BlendedDataset([Tagged(k, size) for k in range(len(w))], weights, size=size,
                           cache_dir=str(tmp_path))
    picks = np.asarray([blend[i] for i in range(size)])  # (size, 2)
    counts = np.zeros(len(w))
    for n in range(1, size + 1):
        k, j = picks[n - 1]
        assert j == counts[k]  # each dataset's samples are used in order 0, 1, 2, ...
        counts[k] += 1
        if n in (1, 7, 10, 99, 500, size) or n % 97 == 0:
            assert np.all(np.abs(counts / n - w) <= 1.0 / n + 1e-12), (n, counts)


def test_blend_cache_reused(tmp_path):
    ds = [Tagged(0, 100), Tagged(1, 100)]
    a = BlendedDataset(ds, [1, 3], size=100, cache_dir=str(tmp_path))
    b = BlendedDataset(ds, [1, 3], size=100, cache_dir=str(tmp_path))
    assert not a.built_from_cache and b.built_from_cache
    assert np.array_equal(a.dataset_index, b.dataset_index)
    c = BlendedDataset(ds, [1, 2], size=100, cache_dir=str(tmp_path))
    assert not c.built_from_cache


def test_blend_errors(tmp_path):
    with pytest.raises(ValueError, match="one weight per dataset"):
        BlendedDataset([Tagged(0, 10)], [0.5, 0.5], size=5)
    with pytest.raises(ValueError, match="finite, >= 0"):
        BlendedDataset([Tagged(0, 10), Tagged(1, 10)], [1, -1], size=5)
    with pytest.raises(ValueError, match="dataset 1 of the blend has 3 samples .* needs"):
        BlendedDataset([Tagged(0, 100), Tagged(1, 3)], [0.5, 0.5], size=100)
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        parse_data_path(["0.5", "a", "0.5"])
    with pytest.raises(ValueError, match="'a' is not a weight"):
        parse_data_path(["a", "0.5"])
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_data_path(["only"]) == (["only"], [1.0])


def test_build_gpt_datasets_single_and_blended(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_random_dataset(a, num_docs=300, seed=1)
    write_random_dataset(b, num_docs=100, seed=2)
    train, valid, test = build_gpt_datasets([a], split="90,10,0", num_samples=(50, 10, 0), seq_length=16, seed=3,
                                            cache_dir=str(tmp_path / "c"))
    assert isinstance(train, GPTDataset) and test is None
    assert train.document_range == (0, 270) and valid.document_range == (270, 300)
    assert len(train) >= 50 and len(valid) >= 10

    train, valid, _ = build_gpt_datasets([a, b], weights=[0.25, 0.75], split="90,10,0", num_samples=(400, 20, 0),
                                         seq_length=16, seed=3, cache_dir=str(tmp_path / "c"))
    assert isinstance(train, BlendedDataset) and len(train) == 400
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert counts.tolist() == [100, 300]
    k, j = int(train.dataset_index[5]), int(train.dataset_sample_index[5])
    assert np.array_equal(train[5]["tokens"], train.datasets[k][j]["tokens"])
    with pytest.raises(ValueError, match="split 'test' .* has no documents"):
        build_gpt_datasets([a], split="90,10,0", num_samples=(1, 1, 1), seq_length=16, seed=3,
                           cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="three counts"):
        build_gpt_datasets([a], num_samples=(1, 1), seq_length=16, seed=3)
