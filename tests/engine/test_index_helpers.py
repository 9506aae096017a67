"""Dataset index helpers: native == numpy exactly, Megatron-LM parity, properties, bad inputs."""
import numpy as np
import pytest

from engine import _native
from engine.data import index_helpers as ih

NATIVE = _native.available("data_index")
needs_native = pytest.mark.skipif(not NATIVE, reason="engine._data_index is not built")
BACKENDS = ["numpy"] + (["native"] if NATIVE else [])


# ----------------------------------------------------------------------------- oracles
# Written from Megatron-LM's documented behaviour, independently of the code under test.


def megatron_document_index(documents, num_epochs, seed, separate_final_epoch):
    """Megatron's rule: one RandomState; all epochs shuffled together, the last one apart."""
    rng = np.random.RandomState(seed)

    def shuffled(epochs):
        block = np.tile(np.asarray(documents, dtype=np.int32), epochs)
        rng.shuffle(block)
        return block

    if not separate_final_epoch or num_epochs == 1:
        return shuffled(num_epochs)
    return np.concatenate([shuffled(num_epochs - 1), shuffled(1)])


def megatron_sample_walk(sizes, document_index, seq_length, total_tokens, drop_last, extra):
    """Megatron's helpers.cpp walk, step by step (exact integer sample count)."""
    usable = total_tokens - extra
    num = max(0, usable // seq_length if drop_last else -(-usable // seq_length))
    rows = [(0, 0)]
    position, offset = 0, 0
    while len(rows) <= num:
        remaining = seq_length + extra
        while remaining != 0:
            length = int(sizes[document_index[position]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - extra
                remaining = 0
            else:
                if position == len(document_index) - 1:
                    assert len(rows) == num
                    offset = int(sizes[document_index[position]]) - extra
                    break
                position += 1
                offset = 0
        rows.append((position, offset))
    return np.array(rows, dtype=np.int64)


def read_samples(sizes, document_index, sample_index, extra):
    """Token ids of every sample, read the way a GPT dataset reads them; token t of document d
    is d * 10**6 + t."""
    samples = []
    for i in range(len(sample_index) - 1):
        (p0, o0), (p1, o1) = sample_index[i], sample_index[i + 1]
        parts = []
        for p in range(p0, p1 + 1):
            doc = int(document_index[p])
            start = o0 if p == p0 else 0
            stop = o1 + extra if p == p1 else int(sizes[doc])
            parts.append(doc * 10**6 + np.arange(start, stop))
        samples.append(np.concatenate(parts))
    return samples


def token_stream(sizes, document_index):
    return np.concatenate([d * 10**6 + np.arange(sizes[d]) for d in document_index] + [[]])


def random_corpus(seed, num_docs, *, max_size=60, empty_fraction=0.1):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, max_size, size=num_docs).astype(np.int32)
    sizes[rng.random(num_docs) < empty_fraction] = 0
    return sizes


# ----------------------------------------------------------------------------- document index


@needs_native
@pytest.mark.parametrize("seed", [0, 1, 1234, 2**32 - 1])
@pytest.mark.parametrize("num_epochs", [1, 2, 5])
def test_document_index_native_equals_numpy(seed, num_epochs):
    documents = np.random.default_rng(seed % 97).permutation(3001).astype(np.int32)[:2500]
    for separate in (False, True):
        kw = dict(seed=seed, separate_final_epoch=separate)
        native = ih.build_document_index(documents, num_epochs, backend="native", **kw)
        ref = ih.build_document_index(documents, num_epochs, backend="numpy", **kw)
        assert native.dtype == ref.dtype == np.int32
        np.testing.assert_array_equal(native, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_document_index_epochs_are_permutations(backend):
    documents = np.array([7, 3, 3, 11, 0, 5, 9], dtype=np.int64)  # repeats are allowed
    out = ih.build_document_index(documents, 4, seed=3, backend=backend)
    assert out.shape == (28,) and out.dtype == np.int32
    epochs = out.reshape(4, 7)  # (epoch, document)
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.sort(documents))
    assert len({tuple(e) for e in epochs}) > 1  # epochs are shuffled independently
    # Deterministic, prefix-stable in num_epochs, and the seed matters.
    np.testing.assert_array_equal(out, ih.build_document_index(documents, 4, seed=3,
                                                               backend=backend))
    np.testing.assert_array_equal(out[:14], ih.build_document_index(documents, 2, seed=3,
                                                                    backend=backend))
    assert not np.array_equal(out, ih.build_document_index(documents, 4, seed=4, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_document_index_matches_megatron_where_documented(backend):
    documents = np.arange(10, 510, dtype=np.int32)
    for num_epochs, separate in [(1, False), (1, True), (2, True)]:
        out = ih.build_document_index(documents, num_epochs, seed=42,
                                      separate_final_epoch=separate, backend=backend)
        np.testing.assert_array_equal(
            out, megatron_document_index(documents, num_epochs, 42, separate))
    # separate_final_epoch cannot change a per-epoch shuffle; the final epoch is a permutation.
    a = ih.build_document_index(documents, 3, seed=42, separate_final_epoch=True, backend=backend)
    b = ih.build_document_index(documents, 3, seed=42, separate_final_epoch=False, backend=backend)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.sort(a[-500:]), documents)


@needs_native
def test_document_index_large_native_equals_numpy():
    # Many generator blocks and every power-of-two stretch of the bounded draws up to 2**17.
    documents = np.arange(100_003, dtype=np.int32)
    native = ih.build_document_index(documents, 2, seed=2024, backend="native")
    np.testing.assert_array_equal(native, ih.build_document_index(documents, 2, seed=2024,
                                                                  backend="numpy"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_document_index_edge_sizes(backend):
    assert ih.build_document_index(np.zeros(0, np.int32), 3, seed=0, backend=backend).shape == (0,)
    np.testing.assert_array_equal(ih.build_document_index([4], 3, seed=0, backend=backend),
                                  [4, 4, 4])


# ----------------------------------------------------------------------------- sample index


def sample_cases():
    """(name, sizes, document_index, seq_length, tokens_per_epoch, num_epochs)."""
    cases = []
    for seed in range(4):
        sizes = random_corpus(seed, 120)
        doc_index = ih.build_document_index(np.arange(120), 2, seed=seed, backend="numpy")
        for seq_length in (5, 16, 37, 500):
            cases.append((f"random{seed}-s{seq_length}", sizes, doc_index, seq_length,
                          int(sizes.sum()), 2))
    tiny = random_corpus(7, 30, max_size=9, empty_fraction=0.3)
    cases.append(("seq-length-1", tiny, np.arange(30), 1, int(tiny.sum()), 1))
    long_doc = np.array([3, 1000, 0, 5], dtype=np.int32)  # one document spans many samples
    cases.append(("long-doc", long_doc, np.array([0, 1, 2, 3]), 16, 1008, 1))
    cases.append(("single-doc", np.array([100], np.int32), np.array([0, 0, 0]), 9, 100, 3))
    empty = np.array([0, 4, 0, 0, 6, 0, 0], dtype=np.int32)  # leading/trailing empty docs
    cases.append(("empty-docs", empty, np.arange(7), 3, 10, 1))
    cases.append(("all-empty", np.zeros(4, np.int32), np.arange(4), 5, 0, 1))
    cases.append(("no-docs", np.zeros(0, np.int32), np.zeros(0, np.int32), 5, 0, 2))
    cases.append(("short-stream", np.array([2], np.int32), np.array([0]), 8, 2, 1))
    cases.append(("fewer-tokens-than-stream", random_corpus(9, 50), np.arange(50), 10, 300, 1))
    cases.append(("exact-boundaries", np.array([4, 4, 4, 4], np.int32), np.arange(4), 4, 16, 1))
    return cases


CASES = sample_cases()
FLAGS = [(drop, extra) for drop in (True, False) for extra in (True, False)]


@needs_native
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sample_index_native_equals_numpy(case):
    _, sizes, doc_index, seq_length, tokens_per_epoch, num_epochs = case
    for drop, extra in FLAGS:
        kw = dict(seq_length=seq_length, tokens_per_epoch=tokens_per_epoch,
                  num_epochs=num_epochs, drop_last_partial=drop, add_extra_token=extra)
        native = ih.build_sample_index(sizes, doc_index, backend="native", **kw)
        ref = ih.build_sample_index(sizes, doc_index, backend="numpy", **kw)
        assert native.dtype == ref.dtype == np.int32
        np.testing.assert_array_equal(native, ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sample_index_properties_and_megatron_walk(case, backend):
    _, sizes, doc_index, seq_length, tokens_per_epoch, num_epochs = case
    total = tokens_per_epoch * num_epochs
    stream = token_stream(sizes, doc_index)
    for drop, extra_flag in FLAGS:
        extra = int(extra_flag)
        out = ih.build_sample_index(sizes, doc_index, seq_length=seq_length,
                                    tokens_per_epoch=tokens_per_epoch, num_epochs=num_epochs,
                                    drop_last_partial=drop, add_extra_token=extra_flag,
                                    backend=backend)
        num = out.shape[0] - 1
        assert out.shape == (num + 1, 2) and tuple(out[0]) == (0, 0)
        full = max(0, (total - extra) // seq_length)
        assert num == (full if drop or full * seq_length + extra >= total else full + 1)
        samples = read_samples(sizes, doc_index, out, extra)
        for i, sample in enumerate(samples):
            # Concatenated samples walk the token stream in order, overlapping by `extra`.
            np.testing.assert_array_equal(
                sample, stream[i * seq_length:i * seq_length + seq_length + extra])
            if i < num - 1 or drop or len(stream) >= (i + 1) * seq_length + extra:
                assert len(sample) == seq_length + extra
        if num and not drop and total - extra > full * seq_length and len(stream) == total:
            assert 0 < len(samples[-1]) - extra < seq_length  # the kept partial sample
        # Megatron's walk gives the same rows, except that a kept partial sample may end at a
        # trailing empty document (offset -extra, no token there); ours names the last
        # non-empty one. No other row of either points at an empty document.
        walk = megatron_sample_walk(sizes, doc_index, seq_length, total, drop, extra)
        if num and sizes[doc_index[walk[-1, 0]]] == 0:
            assert not drop and walk[-1, 1] == -extra
            walk = walk[:-1]
            out = out[:-1]
        np.testing.assert_array_equal(out, walk)


# ----------------------------------------------------------------------------- blending


@needs_native
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_blending_native_equals_numpy(seed):
    rng = np.random.default_rng(seed)
    for num_datasets in (1, 2, 3, 7, 12):  # the native code specialises up to 8 datasets
        weights = rng.random(num_datasets) + 0.01
        size = int(rng.integers(0, 20000))
        native = ih.build_blending_indices(weights, size, backend="native")
        ref = ih.build_blending_indices(weights, size, backend="numpy")
        for a, b in zip(native, ref):
            assert a.dtype == b.dtype and a.shape == (size,)
            np.testing.assert_array_equal(a, b)
    # Exact ties (equal weights) break towards the lower dataset id in both.
    ties = [ih.build_blending_indices([1, 1, 1, 1], 9, backend=b)[0] for b in BACKENDS]
    for t in ties:
        np.testing.assert_array_equal(t, [0, 1, 2, 3, 0, 1, 2, 3, 0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1, 1], [0.9, 0.05, 0.05], [3, 1, 1e-3]])
def test_blending_fractions_track_weights(backend, weights):
    size = 5000
    dataset_index, sample_index = ih.build_blending_indices(weights, size, backend=backend)
    assert dataset_index.dtype == np.int16 and sample_index.dtype == np.int64
    target = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    counts = np.bincount(dataset_index, minlength=len(weights))
    assert np.all(np.abs(counts / size - target) <= 1.0 / size)
    for k in range(len(weights)):  # each dataset is read in order 0, 1, 2, ...
        np.testing.assert_array_equal(sample_index[dataset_index == k], np.arange(counts[k]))
    # Every prefix stays within one sample of its target too, not just the whole index.
    prefix = np.cumsum(np.eye(len(weights), dtype=np.int64)[dataset_index], axis=0)  # (n, k)
    steps = np.arange(1, size + 1)[:, None]  # (n, 1)
    assert np.all(np.abs(prefix - target * steps) < 1.0)
    assert ih.build_blending_indices(weights, 0, backend=backend)[0].shape == (0,)


# ----------------------------------------------------------------------------- shuffle index


def test_shuffle_index():
    out = ih.build_shuffle_index(70, 100, seed=5)
    assert out.dtype == np.uint32 and out.shape == (100,)
    np.testing.assert_array_equal(np.sort(out[:70]), np.arange(70))
    np.testing.assert_array_equal(np.sort(out[70:]), np.arange(70, 100))
    assert not np.array_equal(out[:70], np.arange(70))
    np.testing.assert_array_equal(out, ih.build_shuffle_index(70, 100, seed=5))
    assert not np.array_equal(out, ih.build_shuffle_index(70, 100, seed=6))
    np.testing.assert_array_equal(np.sort(ih.build_shuffle_index(100, 100, seed=1)),
                                  np.arange(100))
    assert ih.build_shuffle_index(0, 0, seed=1).shape == (0,)


# ----------------------------------------------------------------------------- bad inputs


def _sample_kw(**over):
    kw = dict(seq_length=4, tokens_per_epoch=10, num_epochs=1)
    kw.update(over)
    return kw


SIZES = np.array([4, 6], dtype=np.int32)
DOCS = np.array([1, 0], dtype=np.int32)

BAD_CALLS = [
    ("doc-epochs", "num_epochs", lambda b: ih.build_document_index([0, 1], 0, seed=0, backend=b)),
    ("doc-seed", "seed", lambda b: ih.build_document_index([0, 1], 1, seed=-1, backend=b)),
    ("doc-seed-big", "seed", lambda b: ih.build_document_index([0], 1, seed=2**32, backend=b)),
    ("doc-negative", "non-negative",
     lambda b: ih.build_document_index([0, -1], 1, seed=0, backend=b)),
    ("doc-2d", "1-D", lambda b: ih.build_document_index(np.zeros((2, 2), int), 1, seed=0,
                                                        backend=b)),
    ("doc-float", "integers", lambda b: ih.build_document_index([0.5], 1, seed=0, backend=b)),
    ("doc-separate", "bool", lambda b: ih.build_document_index([0], 1, seed=0,
                                                               separate_final_epoch="yes",
                                                               backend=b)),
    ("sample-neg-size", r"sizes\[1\] = -6 is negative",
     lambda b: ih.build_sample_index([4, -6], DOCS, backend=b, **_sample_kw())),
    ("sample-seq", "seq_length",
     lambda b: ih.build_sample_index(SIZES, DOCS, backend=b, **_sample_kw(seq_length=0))),
    ("sample-epochs", "num_epochs",
     lambda b: ih.build_sample_index(SIZES, DOCS, backend=b, **_sample_kw(num_epochs=0))),
    ("sample-tokens-neg", "tokens_per_epoch",
     lambda b: ih.build_sample_index(SIZES, DOCS, backend=b, **_sample_kw(tokens_per_epoch=-1))),
    ("sample-too-many-tokens", "exceeds the 10 tokens",
     lambda b: ih.build_sample_index(SIZES, DOCS, backend=b, **_sample_kw(tokens_per_epoch=11))),
    ("sample-doc-range", r"document_index\[2\] = 2 is out of range",
     lambda b: ih.build_sample_index(SIZES, [0, 1, 2], backend=b, **_sample_kw())),
    ("sample-doc-negative", r"document_index\[0\] = -1 is out of range",
     lambda b: ih.build_sample_index(SIZES, [-1, 1], backend=b, **_sample_kw())),
    # An id past the last sample is still rejected (both backends check the whole index).
    ("sample-doc-range-tail", r"document_index\[2\] = 9 is out of range",
     lambda b: ih.build_sample_index(SIZES, [0, 1, 9], backend=b,
                                     **_sample_kw(tokens_per_epoch=4))),
    ("sample-size-int32", "int32",
     lambda b: ih.build_sample_index(np.array([2**31], np.int64), [0], backend=b, **_sample_kw())),
    ("sample-flag", "bool",
     lambda b: ih.build_sample_index(SIZES, DOCS, backend=b, **_sample_kw(), add_extra_token=1)),
    ("blend-empty", "non-empty", lambda b: ih.build_blending_indices([], 10, backend=b)),
    ("blend-zero", "> 0", lambda b: ih.build_blending_indices([0.5, 0.0], 10, backend=b)),
    ("blend-negative", "> 0", lambda b: ih.build_blending_indices([0.5, -1], 10, backend=b)),
    ("blend-nan", "finite", lambda b: ih.build_blending_indices([0.5, np.nan], 10, backend=b)),
    ("blend-size", "size", lambda b: ih.build_blending_indices([1.0], -1, backend=b)),
    ("blend-too-many", "32767", lambda b: ih.build_blending_indices(np.ones(40000), 1, backend=b)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("call", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_inputs_raise_value_error(call, backend):
    _, match, fn = call
    with pytest.raises(ValueError, match=match):
        fn(backend)


@pytest.mark.parametrize("fn", [
    lambda: ih.build_document_index([0], 1, seed=0, backend="cuda"),
    lambda: ih.build_sample_index(SIZES, DOCS, backend="fast", **_sample_kw()),
    lambda: ih.build_blending_indices([1.0], 3, backend="Native"),
])
def test_unknown_backend(fn):
    with pytest.raises(ValueError, match="backend must be one of"):
        fn()


@pytest.mark.parametrize("bad", [
    dict(num_samples=-1, total_size=5, seed=0, match="num_samples"),
    dict(num_samples=6, total_size=5, seed=0, match="num_samples"),
    dict(num_samples=0, total_size=-1, seed=0, match="total_size"),
    dict(num_samples=1, total_size=5, seed=-3, match="seed"),
])
def test_shuffle_index_bad_inputs(bad):
    match = bad.pop("match")
    with pytest.raises(ValueError, match=match):
        ih.build_shuffle_index(bad["num_samples"], bad["total_size"], seed=bad["seed"])


@needs_native
def test_native_module_contract():
    mod = _native.load("data_index")
    assert mod.WITH_CUDA is False
    # The bindings take exact dtypes (no silent copies); the wrapper converts.
    with pytest.raises(TypeError):
        mod.build_document_index(np.arange(3, dtype=np.int64), 1, 0)
    # Called directly, the native code still refuses inconsistent inputs instead of reading out
    # of bounds.
    with pytest.raises(ValueError, match="out of range"):
        mod.build_sample_index(SIZES, np.array([0, 5], np.int32), 4, 10, True, True)
    with pytest.raises(ValueError, match="tokens_per_epoch"):
        mod.build_sample_index(SIZES, DOCS, 4, 99, True, True)
    cases = [(0, 3, True, 1), (10, 3, True, 1), (10, 3, False, 1), (10, 3, False, 0),
             (1, 5, False, 1), (2**40 + 7, 4096, False, 1)]
    for total, seq, drop, extra in cases:
        usable = total - extra
        expected = 0 if usable <= 0 else (usable // seq if drop else -(-usable // seq))
        assert mod.num_samples(total, seq, drop, extra) == expected


def test_auto_backend_is_native_when_built():
    expected = "native" if NATIVE else "numpy"
    assert (ih._native_module("auto") is not None) == (expected == "native")
    sizes, docs = np.array([5, 0, 7], np.int32), np.array([2, 1, 0, 2], np.int32)
    auto = ih.build_sample_index(sizes, docs, seq_length=3, tokens_per_epoch=19, num_epochs=1)
    np.testing.assert_array_equal(auto, ih.build_sample_index(
        sizes, docs, seq_length=3, tokens_per_epoch=19, num_epochs=1, backend="numpy"))
