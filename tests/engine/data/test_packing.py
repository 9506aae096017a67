"""SFT packing: rows hold whole documents, attention never crosses a document, masked tokens add no loss."""
import numpy as np
import pytest
import torch

from engine.data.packing import (
    assign_bins,
    collate_packed,
    document_causal_mask,
    masked_token_loss,
    pack_documents,
    sft_example,
)


def random_docs(n, seed, max_len=20, vocab=50):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=int(rng.integers(1, max_len + 1))) for _ in range(n)]


def brute_force_mask(cu_seqlens, s):
    doc_of = {}
    for d in range(len(cu_seqlens) - 1):
        for t in range(cu_seqlens[d], cu_seqlens[d + 1]):
            doc_of[t] = d
    return torch.tensor([[j <= i and doc_of[i] == doc_of[j] for j in range(s)] for i in range(s)])


@pytest.mark.parametrize("method", ["sequential", "first_fit", "first_fit_decreasing"])
def test_rows_hold_whole_documents(method):
    docs = random_docs(60, seed=1)
    rows = pack_documents(docs, seq_length=32, method=method, pad_id=0)
    placed = sorted(i for r in rows for i in r.document_ids)
    assert placed == list(range(60))  # every document exactly once
    for r in rows:
        cu = r.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == 32 and r.cu_seqlens.dtype == np.int32
        for k, d in enumerate(r.document_ids):
            s, e = cu[k], cu[k + 1]
            assert np.array_equal(r.tokens[s:e], docs[d])
            assert np.array_equal(r.position_ids[s:e], np.arange(e - s))
            assert np.array_equal(r.labels[s:e - 1], docs[d][1:])  # labels never cross into the next doc
            assert r.loss_mask[e - 1] == 0
        used = cu[len(r.document_ids)]
        assert np.all(r.loss_mask[used:] == 0)
    if method != "sequential":
        # First fit never leaves two rows at most half full: the later one's documents would have fit earlier.
        fills = sorted(r.cu_seqlens[len(r.document_ids)] for r in rows)
        assert not (len(fills) > 1 and fills[1] <= 16)


def test_first_fit_matches_naive_scan():
    lengths = [int(x) for x in np.random.default_rng(3).integers(1, 30, size=300)]
    bins, free = [], []
    for i, n in enumerate(lengths):  # the O(n * bins) definition
        for b, f in enumerate(free):
            if f >= n:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(30 - n)
    assert assign_bins(lengths, capacity=30, method="first_fit") == bins
    assert assign_bins([5, 5, 5], capacity=10, method="sequential") == [[0, 1], [2]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_document_mask_equals_brute_force(seed):
    rows = pack_documents(random_docs(30, seed=seed, max_len=9), seq_length=24)
    for r in rows[:4]:
        want = brute_force_mask(r.cu_seqlens.tolist(), 24)
        assert torch.equal(document_causal_mask(torch.from_numpy(r.cu_seqlens)), want)
        assert torch.equal(document_causal_mask(r.cu_seqlens, 24), want)
        assert torch.equal(document_causal_mask(position_ids=torch.from_numpy(r.position_ids)), want)
    pos = torch.from_numpy(np.stack([r.position_ids for r in rows[:3]]))
    batched = document_causal_mask(position_ids=pos)
    assert batched.shape == (3, 24, 24)
    assert torch.equal(batched[1], brute_force_mask(rows[1].cu_seqlens.tolist(), 24))


def test_sdpa_outputs_of_one_document_ignore_the_others():
    torch.manual_seed(0)
    docs = [np.arange(1, 8), np.arange(10, 15), np.arange(20, 29)]  # one row of 7 + 5 + 9 = 21, padded to 24
    (row,) = pack_documents(docs, seq_length=24, method="sequential")
    emb = torch.nn.Embedding(64, 16)
    proj = torch.nn.Linear(16, 3 * 16)
    mask = document_causal_mask(torch.from_numpy(row.cu_seqlens))

    def attend(tokens):
        x = emb(tokens)  # (s, h)
        q, k, v = proj(x).view(24, 3, 2, 8).permute(1, 2, 0, 3)  # each (nh, s, hd)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (nh, s, hd)

    tokens = torch.from_numpy(row.tokens)
    base = attend(tokens)
    changed = tokens.clone()
    changed[0:7] = torch.randint(30, 64, (7,))  # rewrite document A entirely
    out = attend(changed)
    assert not torch.allclose(out[:, 0:7], base[:, 0:7])
    assert torch.equal(out[:, 7:21], base[:, 7:21])  # documents B and C: bit-identical
    # Each document alone through plain causal attention gives the same outputs as the packed row.
    x = emb(tokens[7:12])
    q, k, v = proj(x).view(5, 3, 2, 8).permute(1, 2, 0, 3)
    alone = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(alone, base[:, 7:12], rtol=1e-6, atol=1e-6)


def test_prompt_tokens_masked_and_contribute_no_gradient():
    ex = [sft_example([5, 6, 7], [8, 9], eod_id=1), sft_example([11], [12, 13, 14], eod_id=1)]
    (row,) = pack_documents([t for t, _ in ex], target_masks=[m for _, m in ex], seq_length=12, method="sequential")
    # Position j is trained iff token j+1 of its document is a target (response or EOD).
    # doc 1 = [5 6 7 | 8 9 EOD] at 0..5, doc 2 = [11 | 12 13 14 EOD] at 6..10, padding at 11.
    assert row.loss_mask.tolist() == [0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0]
    assert row.labels[:5].tolist() == [6, 7, 8, 9, 1]
    logits = torch.randn(12, 20, dtype=torch.float64, requires_grad=True)
    labels = torch.from_numpy(row.labels)
    mask = torch.from_numpy(row.loss_mask)
    loss = masked_token_loss(logits, labels, mask)
    loss.backward()
    masked = mask == 0
    assert torch.all(logits.grad[masked] == 0)
    assert torch.all(logits.grad[~masked].abs().sum(-1) > 0)
    # Changing labels or logits at masked positions changes nothing.
    other_labels = labels.clone()
    other_labels[masked] = 19
    other_logits = logits.detach().clone()
    other_logits[masked] = 1e4
    assert masked_token_loss(other_logits, other_labels, mask) == loss.detach()
    with pytest.raises(ValueError, match="no unmasked position"):
        masked_token_loss(logits, labels, torch.zeros(12))


def test_collate_packed_flat_cu_seqlens():
    rows = pack_documents(random_docs(10, seed=4, max_len=8), seq_length=16)
    batch = collate_packed(rows[:2])
    assert batch["tokens"].shape == (2, 16)
    cu = batch["cu_seqlens"].tolist()
    assert cu == rows[0].cu_seqlens.tolist() + (rows[1].cu_seqlens[1:] + 16).tolist()
    flat_pos = batch["position_ids"].reshape(-1)
    assert torch.equal(document_causal_mask(batch["cu_seqlens"]), document_causal_mask(position_ids=flat_pos))


def test_packing_errors():
    with pytest.raises(ValueError, match="document 1 has 40 tokens > seq_length=32"):
        pack_documents([[1, 2], list(range(40))], seq_length=32)
    (row,) = pack_documents([list(range(40))], seq_length=32, truncate=True)
    assert row.tokens.tolist() == list(range(32))
    with pytest.raises(ValueError, match="method='best'"):
        pack_documents([[1]], seq_length=4, method="best")
    with pytest.raises(ValueError, match="non-empty 1-D"):
        pack_documents([[]], seq_length=4)
    with pytest.raises(ValueError, match=r"target_masks\[0\] has shape"):
        pack_documents([[1, 2]], seq_length=4, target_masks=[[True]])
    with pytest.raises(ValueError, match="exactly one of cu_seqlens or position_ids"):
        document_causal_mask()
    with pytest.raises(ValueError, match="must start at 0"):
        document_causal_mask(torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="cu_seqlens ends at 4 but seq_len=5"):
        document_causal_mask(torch.tensor([0, 4]), 5)
