"""Data-parallel loading: same global batches at every dp size, contiguous slices, exact resume."""
import json

import numpy as np
import pytest
import torch

from engine.data.gpt_dataset import GPTDataset
from engine.data.indexed_dataset import IndexedDataset
from engine.data.loader import DataParallelLoader, GlobalBatchSampler


@pytest.fixture
def gpt(random_dataset, tmp_path):
    prefix, _ = random_dataset
    return GPTDataset(IndexedDataset(prefix), document_range=(0, 200), num_samples=400, seq_length=12, seed=5,
                      cache_dir=str(tmp_path / "cache"))


def global_batches(dataset, *, dp_size, gbs=8, mbs=2, steps=6):
    """Per step: the concatenation, in rank order, of every rank's micro batches."""
    loaders = [DataParallelLoader(dataset, global_batch_size=gbs, micro_batch_size=mbs, dp_rank=r, dp_size=dp_size)
               for r in range(dp_size)]
    micro_per_step = gbs // (mbs * dp_size)
    out = []
    for _ in range(steps):
        per_rank = [torch.cat([next(ld)["tokens"] for _ in range(micro_per_step)]) for ld in loaders]
        out.append(torch.cat(per_rank))  # (gbs, s)
    return out


def test_same_global_batches_across_dp_sizes_and_runs(random_dataset, tmp_path):
    prefix, _ = random_dataset

    def build(cache):
        return GPTDataset(IndexedDataset(prefix), document_range=(0, 200), num_samples=400, seq_length=12, seed=5,
                          cache_dir=str(tmp_path / cache))

    reference = global_batches(build("run1"), dp_size=1)
    expected = [torch.from_numpy(np.stack([build("run1")[i]["tokens"] for i in range(b * 8, b * 8 + 8)]))
                for b in range(6)]
    for got, want in zip(reference, expected):
        assert torch.equal(got, want)  # global batch b is dataset samples [8b, 8b + 8)
    for dp in (2, 4):
        other = global_batches(build(f"run_dp{dp}"), dp_size=dp)  # a fresh build: another run
        for a, b in zip(reference, other):
            assert torch.equal(a, b)


def test_rank_slices_are_contiguous():
    s = GlobalBatchSampler(64, global_batch_size=16, micro_batch_size=2, dp_rank=1, dp_size=4)
    batches = list(s)
    assert batches[:2] == [[4, 5], [6, 7]]  # global batch 0: rank 1 owns [4, 8)
    assert batches[2:4] == [[20, 21], [22, 23]]  # global batch 1: [16 + 4, 16 + 8)
    assert len(batches) == len(s) == 4 * 2
    assert s.micro_batches_per_global_batch == 2


def test_batch_contents_and_types(gpt):
    loader = DataParallelLoader(gpt, global_batch_size=4, micro_batch_size=2, dp_rank=1, dp_size=2)
    batch = next(loader)
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert batch["tokens"].shape == (2, 12) and batch["tokens"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["tokens"][0], torch.from_numpy(gpt[2]["tokens"]))
    assert torch.equal(batch["labels"][1], torch.from_numpy(gpt[3]["labels"]))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_exactly(gpt, num_workers):
    kw = dict(global_batch_size=8, micro_batch_size=2, dp_rank=1, dp_size=2, num_workers=num_workers)
    full = DataParallelLoader(gpt, **kw)
    straight = [next(full)["tokens"] for _ in range(10)]
    first = DataParallelLoader(gpt, **kw)
    for _ in range(5):  # stop mid global batch (2 micro batches per rank per global batch)
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # JSON-able
    assert state == {"consumed_samples": 5 * 2 * 2}
    resumed = DataParallelLoader(gpt, **kw)
    resumed.load_state_dict(state)
    for want in straight[5:]:
        assert torch.equal(next(resumed)["tokens"], want)
    # load_state_dict on a loader that has already read ahead restarts at the saved point.
    first.load_state_dict({"consumed_samples": 8})
    assert torch.equal(next(first)["tokens"], straight[2])


@pytest.mark.parametrize("num_workers", [0, 1])
def test_reading_leaves_the_global_rng_alone(gpt, num_workers):
    """Starting to read (also with worker processes) draws nothing from torch's global generator, which
    dropout uses: a resumed run starts a new iterator right after restoring the RNG state, so a draw there
    would shift every later dropout mask against the uninterrupted run."""
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    loader = DataParallelLoader(gpt, global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=2,
                                num_workers=num_workers)
    next(loader)
    assert torch.equal(torch.rand(3), want)


def test_exhaustion_and_errors(gpt):
    loader = DataParallelLoader(gpt, global_batch_size=100, micro_batch_size=50, dp_rank=0, dp_size=2)
    n = len(loader)
    assert n == len(gpt) // 100
    assert len(list(loader)) == n
    with pytest.raises(ValueError, match="multiple of micro_batch_size \\* dp_size = 8"):
        GlobalBatchSampler(100, global_batch_size=12, micro_batch_size=2, dp_rank=0, dp_size=4)
    with pytest.raises(ValueError, match="dp_rank=4 must be in"):
        GlobalBatchSampler(100, global_batch_size=8, micro_batch_size=2, dp_rank=4, dp_size=4)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatchSampler(7, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=4)
    with pytest.raises(ValueError, match="not a multiple of micro_batch_size"):
        loader.load_state_dict({"consumed_samples": 30})
    with pytest.raises(ValueError, match="past the end"):
        loader.load_state_dict({"consumed_samples": 100 * (n + 1)})
    with pytest.raises(ValueError, match="must be a dict with 'consumed_samples'"):
        loader.load_state_dict({"step": 3})
