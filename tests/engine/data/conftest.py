"""Shared fixtures: small indexed datasets written with the real builder."""
import numpy as np
import pytest

from engine.data.indexed_dataset import IndexedDatasetBuilder


def write_random_dataset(prefix, *, num_docs, seed, min_len=1, max_len=60, vocab_size=1000):
    """Documents of random length and random ids; returns the list of documents."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab_size, size=int(rng.integers(min_len, max_len + 1))) for _ in range(num_docs)]
    with IndexedDatasetBuilder(str(prefix), vocab_size=vocab_size) as builder:
        for d in docs:
            builder.add_document(d)
    return docs


@pytest.fixture
def random_dataset(tmp_path):
    prefix = tmp_path / "rand"
    docs = write_random_dataset(prefix, num_docs=200, seed=0)
    return str(prefix), docs
