"""Context parallelism (parallel/context_parallel): parity, bytes, balance and refusals.

* Attention parity: ring, all-to-all and hybrid (a2a blocks of 2, ring across) at cp = 2 and 4, with
  causal, document (packed rows, different per row) and sliding-window masks and GQA (8 query heads,
  4 kv heads): outputs and the gradients of q, k and v equal one process's full attention in fp64
  within 1e-10 (the reference is plain softmax attention written here, not the code under test).
* Ledger, per layer and rank (fp64 tensors; K and V are this rank's (s/cp, b, g, hd) shards):
  ring forward sends (cp-1) x (|K| + |V|); backward (cp-1) x (|K| + |V|) + cp x (|dK| + |dV|);
  all-to-all forward and backward each (cp-1)/cp x (|q| + |k| + |v| + |out|); hybrid = its all-to-all
  over cp_a2a plus a ring of the all-to-all'd K/V over cp_ring. All exact.
* Memory: a cp=2 rank's training forward of a 2-layer stage keeps exactly half the activation bytes of one
  process on the whole sequence (distinct storages saved for backward, weights excluded).
* Balance: under zigzag every rank computes the same number of blocks (and of visible query-key
  pairs); the contiguous split's max/mean is (4cp-1)/(2cp+1) (1.40 at cp=2, 1.67 at cp=4, 1.82 at cp=8).
* Bad input: sequence lengths, heads for all-to-all, config keys: ValueErrors naming the fix, raised
  before any communication.
* End to end through the trainer (engine.assembly.build_run): cp2 x pp2, cp2 x pp2 x vp2 (interleaved, 4
  layers, against a 4-layer single process) and cp2 x tp2 + SP train the
  same losses as one process (fp32, 10 steps, packed documents in half the samples, unequal loss masks;
  within 5e-6 absolute), evaluation included.

Two spawned 4-rank groups run every distributed check.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from parallel.comm import Group, Ledger
from parallel.context_parallel import (BlockMasks, ContextParallel, block_counts, check_cp_sequence,
                                       contiguous_chunks, shard_micro_batch, visible_pairs, zigzag_chunks,
                                       zigzag_indices, zigzag_shard, zigzag_unshard)
from parallel.testing import run_distributed

PARITY = 1e-10
S, B, NH, G, HD = 32, 2, 8, 4, 8  # sequence, batch, query heads, kv heads (GQA), head dim
WINDOW = 6


def _fake_group(size: int, rank: int = 0, axis: str = "cp") -> Group:
    """A group for checks that must fail before communicating (its pg is never used)."""
    return Group(axis=axis, ranks=tuple(range(size)), rank=rank, pg=object(), ledger=Ledger())


def _positions() -> torch.Tensor:
    """(B, S): row 0 packs documents of 5, 11, 9 and 7 tokens; row 1 documents of 16 and 16."""
    rows = []
    for lengths in ((5, 11, 9, 7), (16, 16)):
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    return torch.stack(rows)


def _doc_ids() -> torch.Tensor:
    from parallel.context_parallel.sharding import document_ids_from_positions

    return document_ids_from_positions(_positions())


def _reference(q, k, v, *, docs, window):
    """Plain softmax attention over the full sequence: q (s, b, nh, hd), k/v (s, b, g, hd) -> (s, b, nh*hd)."""
    s = q.shape[0]
    i = torch.arange(s)
    allowed = (i[None, :] <= i[:, None])  # (s_q, s_k)
    if window is not None:
        allowed = allowed & (i[None, :] > i[:, None] - window)
    allowed = allowed[None].expand(q.shape[1], s, s)  # (b, s, s)
    if docs is not None:
        allowed = allowed & (docs[:, :, None] == docs[:, None, :])
    rep = q.shape[2] // k.shape[2]
    kk = k.repeat_interleave(rep, dim=2)  # (s, b, nh, hd)
    vv = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("ibhd,jbhd->bhij", q, kk) * HD ** -0.5  # (b, nh, s, s)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.einsum("bhij,jbhd->ibhd", scores.softmax(-1), vv)  # (s, b, nh, hd)
    return out.reshape(s, q.shape[1], -1)


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, NH, HD, generator=g, dtype=torch.float64)
    k = torch.randn(S, B, G, HD, generator=g, dtype=torch.float64)
    v = torch.randn(S, B, G, HD, generator=g, dtype=torch.float64)
    go = torch.randn(S, B, NH * HD, generator=g, dtype=torch.float64)
    return q, k, v, go


def _parity(cp: ContextParallel, *, masks_kind: str, seed: int) -> dict:
    """Max abs differences of the output and q/k/v gradients against the reference, on this rank."""
    q, k, v, go = _case(seed)
    docs = _doc_ids() if "doc" in masks_kind else None
    window = WINDOW if "window" in masks_kind else None
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*ref_in, docs=docs, window=window)
    ref_grads = torch.autograd.grad(ref, ref_in, go)
    shard = lambda t: zigzag_shard(t, cp=cp.size, rank=cp.rank, dim=0)  # noqa: E731 - (s/cp, ...)
    local = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    masks = BlockMasks(seq_len=S, num_chunks=2 * cp.size, doc_ids=docs, window=window)
    out = cp.attention(*local, masks=masks, scale=HD ** -0.5)
    grads = torch.autograd.grad(out, local, shard(go))
    return {"out": (out - shard(ref)).abs().max().item(),
            **{n: (a - shard(b)).abs().max().item() for n, a, b in zip("qkv", grads, ref_grads)}}


def _ledger(cp: ContextParallel) -> dict:
    """Bytes this rank sent in one forward and one backward of one layer, per (op, axis)."""
    q, k, v, go = _case(3)
    shard = lambda t: zigzag_shard(t, cp=cp.size, rank=cp.rank, dim=0)  # noqa: E731
    local = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    masks = BlockMasks(seq_len=S, num_chunks=2 * cp.size, doc_ids=None, window=None)
    ledger = cp.group.ledger
    with ledger.capture() as fwd:
        out = cp.attention(*local, masks=masks, scale=HD ** -0.5)
    with ledger.capture() as bwd:
        out.backward(shard(go))
    return {"fwd": fwd.summary(), "bwd": bwd.summary(), "q_bytes": local[0].numel() * 8,
            "kv_bytes": local[1].numel() * 8}


def _saved_bytes(stage, ids) -> int:
    """Bytes of the distinct storages a training forward keeps for backward, weights excluded."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(ids, labels=ids).sum()
    return sum(seen.values())


def _saved_activations(cp_group) -> tuple[int, int]:
    """(one process on the full sequence, this cp rank on its shard): a 2-layer stage's saved activations."""
    from models import build_model

    ids = torch.randint(0, VOCAB, (2, 4 * SEQ), generator=torch.Generator().manual_seed(0))
    hf = {**HF, "max_position_embeddings": 4 * SEQ}
    full = build_model(hf, tp_group=Group.trivial("tp"), kernels="reference")
    mine = build_model(hf, tp_group=Group.trivial("tp"), cp_group=cp_group, kernels="reference")
    return _saved_bytes(full, ids), _saved_bytes(mine, zigzag_shard(ids, cp=cp_group.size, rank=cp_group.rank, dim=1))


def _attention_parts():
    from parallel.mesh import Mesh, ParallelDims

    out = {}
    mesh4 = Mesh.build(ParallelDims(cp=4), cp_a2a_size=2)
    mesh2 = Mesh.build(ParallelDims(dp=2, cp=2))  # two cp=2 groups side by side
    kinds = {4: {"ring": ContextParallel(group=mesh4.cp),
                 "a2a": ContextParallel(group=mesh4.cp, comm="a2a"),
                 "hybrid": ContextParallel(group=mesh4.cp, comm="hybrid", a2a_group=mesh4.cp_a2a,
                                           ring_group=mesh4.cp_ring)},
             2: {"ring": ContextParallel(group=mesh2.cp), "a2a": ContextParallel(group=mesh2.cp, comm="a2a")}}
    for size, by_comm in kinds.items():
        for comm_kind, cp in by_comm.items():
            for i, masks_kind in enumerate(("causal", "doc", "window", "doc+window")):
                out[(size, comm_kind, masks_kind)] = _parity(cp, masks_kind=masks_kind, seed=10 * size + i)
    out["ledger"] = {name: _ledger(cp) for name, cp in kinds[4].items()}
    out["saved"] = _saved_activations(mesh2.cp)
    # a2a with 2 kv heads over cp=4: refused before any communication (every rank raises alike).
    q, k, v, _ = _case(0)
    try:
        kinds[4]["a2a"].attention(q[:8], k[:8, :, :2], v[:8, :, :2],
                                  masks=BlockMasks(seq_len=S, num_chunks=8, doc_ids=None, window=None), scale=1.0)
        out["a2a_heads_error"] = None
    except ValueError as e:
        out["a2a_heads_error"] = str(e)
    return out


@pytest.fixture(scope="module")
def attention_results():
    return run_distributed(_attention_parts, 4, timeout=300)


@pytest.mark.parametrize("cp_size,comm_kind", [(2, "ring"), (2, "a2a"), (4, "ring"), (4, "a2a"), (4, "hybrid")])
def test_attention_parity_fp64(attention_results, cp_size, comm_kind):
    for rank, res in enumerate(attention_results):
        for masks_kind in ("causal", "doc", "window", "doc+window"):
            diffs = res[(cp_size, comm_kind, masks_kind)]
            assert max(diffs.values()) < PARITY, (rank, masks_kind, diffs)


def test_ring_ledger_bytes_per_layer(attention_results):
    cp = 4
    for res in attention_results:
        led = res["ledger"]["ring"]
        kv = 2 * led["kv_bytes"]  # |K| + |V| of this rank's shard
        assert led["fwd"]["send@cp"]["sent_bytes"] == (cp - 1) * kv
        assert led["fwd"]["recv@cp"]["recv_bytes"] == (cp - 1) * kv
        # Backward: the same K/V rotation, plus dK/dV (fp64 here) travelling cp hops back to their owner.
        assert led["bwd"]["send@cp"]["sent_bytes"] == (cp - 1) * kv + cp * kv
        assert set(led["fwd"]) == {"send@cp", "recv@cp"} and set(led["bwd"]) == {"send@cp", "recv@cp"}


def test_a2a_and_hybrid_ledger_bytes_per_layer(attention_results):
    cp = 4
    for res in attention_results:
        led = res["ledger"]["a2a"]
        q, kv = led["q_bytes"], led["kv_bytes"]
        moved = (cp - 1) / cp * (q + 2 * kv) + (cp - 1) / cp * q  # q, k, v in; the output back
        for phase in ("fwd", "bwd"):
            assert set(led[phase]) == {"all_to_all@cp"}
            assert led[phase]["all_to_all@cp"]["sent_bytes"] == moved
            assert led[phase]["all_to_all@cp"]["calls"] == 2
        hyb = res["ledger"]["hybrid"]
        a, r = 2, 2  # all-to-all inside pairs, a ring of 2 across
        assert hyb["fwd"]["all_to_all@cp_a2a"]["sent_bytes"] == (a - 1) / a * (2 * q + 2 * kv)
        assert hyb["fwd"]["send@cp_ring"]["sent_bytes"] == (r - 1) * 2 * kv  # a2a'd K/V: a x tokens, 1/a heads
        assert hyb["bwd"]["send@cp_ring"]["sent_bytes"] == (r - 1) * 2 * kv + r * 2 * kv
        assert hyb["bwd"]["all_to_all@cp_a2a"]["sent_bytes"] == (a - 1) / a * (2 * q + 2 * kv)


def test_activation_bytes_per_rank_scale_as_one_over_cp(attention_results):
    # Everything a layer keeps is per token (q, k, v, the ring's output and log-sum-exp, norms, MLP), so
    # a cp rank keeps exactly 1/cp of one process's activations (rope tables and masks included).
    for res in attention_results:
        full, mine = res["saved"]
        assert mine * 2 == full, (full, mine)


def test_a2a_heads_not_divisible_is_refused_before_communicating(attention_results):
    for res in attention_results:
        msg = res["a2a_heads_error"]
        assert msg is not None and "divisible by 4" in msg and "cp_comm='ring'" in msg


# -- single process ----------------------------------------------------------------------------------

@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_causal_attention(cp, capsys):
    masks = BlockMasks(seq_len=16 * cp, num_chunks=2 * cp, doc_ids=None, window=None)
    zig = [zigzag_chunks(r, cp) for r in range(cp)]
    naive = [contiguous_chunks(r, cp) for r in range(cp)]
    assert block_counts(zig, masks) == [2 * cp + 1] * cp  # 2 diagonal + (2cp-1) full blocks each
    assert len(set(visible_pairs(zig, masks))) == 1
    counts = block_counts(naive, masks)
    assert counts == [4 * r + 3 for r in range(cp)]
    imbalance = max(counts) / (sum(counts) / cp)
    assert imbalance == pytest.approx((4 * cp - 1) / (2 * cp + 1))
    pairs = visible_pairs(naive, masks)
    with capsys.disabled():
        print(f"\ncp={cp}: blocks per rank zigzag {block_counts(zig, masks)}, contiguous {counts} "
              f"(max/mean {imbalance:.2f}); visible pairs contiguous max/mean {max(pairs) / (sum(pairs) / cp):.2f}")


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_hop_plan_merges_full_blocks_into_rectangles(cp):
    """Under zigzag every hop after the first is ONE flash call over its full blocks (both local query
    chunks against one kv chunk, or one against both); the first is the two diagonals and one full block;
    a rank holding every chunk gets one call per query chunk's run. The calls cover exactly the blocks
    that are computed, each once; without the flash kernel every block stays its own call."""
    from parallel.context_parallel.masks import computed_blocks
    from parallel.context_parallel.ring import _hop_plan

    masks = BlockMasks(seq_len=16 * cp, num_chunks=2 * cp, doc_ids=None, window=None)

    def cells(plan):
        return sorted((q, k) for q0, q1, k0, k1, *_ in plan for q in range(q0, q1) for k in range(k0, k1))

    every = list(range(2 * cp))
    for mine, srcs in [*[(zigzag_chunks(r, cp), [zigzag_chunks(s, cp) for s in range(cp)]) for r in range(cp)],
                       (every, [every])]:
        for src in srcs:
            want = sorted((qi, ki) for qi, ki, _ in computed_blocks(mine, src, masks))
            plan = _hop_plan(mine, src, masks, True)
            assert cells(plan) == want
            assert _hop_plan(mine, src, masks, False) == [(q, q + 1, k, k + 1, masks.kind(mine[q], src[k]), m)
                                                           for q, k, m in computed_blocks(mine, src, masks)]
            kinds = sorted(kind for *_, kind, _ in plan)
            if mine is every:
                assert kinds == ["causal"] * (2 * cp) + ["full"] * (2 * cp - 1)  # one run per row below the first
            elif src == mine:
                assert kinds == ["causal", "causal", "full"]
            else:
                assert kinds == ["full"]  # two blocks, one call


def _one_process_ring(masks_kind: str, dtype: torch.dtype, fused):
    """Ring attention over a trivial group holding every chunk (each block kind occurs), and its q/k/v grads."""
    from parallel.context_parallel import ring_attention

    q, k, v, go = (t.to(dtype) for t in _case(11))
    docs = _doc_ids() if "doc" in masks_kind else None
    window = WINDOW if "window" in masks_kind else None
    masks = BlockMasks(seq_len=S, num_chunks=4, doc_ids=docs, window=window)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*inputs, group=Group.trivial("cp"), chunks_of=lambda r: [0, 1, 2, 3], masks=masks,
                         scale=HD ** -0.5, fused=fused)
    return (out.detach(), *torch.autograd.grad(out, inputs, go)), (q, k, v, go, docs, window)


@pytest.mark.parametrize("masks_kind", ["causal", "causal+doc", "causal+window"])
def test_flash_block_kernel_equals_the_explicit_one(masks_kind):
    """The fused (flash) block kernel -- full and causal-diagonal blocks, GQA 8 over 4 heads -- against the
    explicit kernel and against plain attention: fp64 within 1e-10; fp32 within 2e-6 of fp64's reference."""
    from parallel.context_parallel.ring import BLOCK_PATHS

    kinds = BlockMasks(seq_len=S, num_chunks=4, doc_ids=_doc_ids() if "doc" in masks_kind else None,
                       window=WINDOW if "window" in masks_kind else None)
    seen = {kinds.kind(qc, kc) for qc in range(4) for kc in range(4) if kinds.block(qc, kc)[0]}
    # plain causal: off-diagonal blocks full, diagonal ones causal; the documents cut every block but two
    # diagonal ones (rows 8-15 and 16-23 lie in one document in both batch rows); the window cuts each
    # diagonal block (window 6 < chunk 8) and the nearest off-diagonal ones.
    assert seen == {"causal": {"full", "causal"}, "causal+doc": {"causal", "masked"},
                    "causal+window": {"masked"}}[masks_kind], seen
    explicit, _ = _one_process_ring(masks_kind, torch.float64, False)
    assert BLOCK_PATHS["cpu"] == "explicit"
    fused, (q, k, v, go, docs, window) = _one_process_ring(masks_kind, torch.float64, True)
    assert BLOCK_PATHS["cpu"] == "flash"
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*ref_in, docs=docs, window=window)
    ref = (ref.detach(), *torch.autograd.grad(ref, ref_in, go))
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), fused, explicit, ref):
        assert (a - b).abs().max().item() < PARITY, name
        assert (a - r).abs().max().item() < PARITY, name
    fp32, _ = _one_process_ring(masks_kind, torch.float32, None)
    for name, a, r in zip(("out", "dq", "dk", "dv"), fp32, ref):
        assert (a.double() - r).abs().max().item() < 2e-6, name


def test_flash_block_kernel_required_where_none_runs():
    from parallel.context_parallel.ring import fused_dtype

    with pytest.raises(ValueError, match="no flash kernel runs.*fused=None"):
        fused_dtype(torch.empty(2, 2, 8, device="meta"), True)
    assert fused_dtype(torch.empty(2, 2, 8, device="meta"), None) is None  # falls back to the explicit kernel
    assert fused_dtype(torch.empty(2, 2, 8, dtype=torch.bfloat16), None) == torch.float32  # CPU: compute dtype


@pytest.mark.gpu
def test_flash_block_kernel_on_cuda_bf16():
    """CUDA: bf16 ring blocks through aten's flash kernels (fp32 merge) vs the explicit fp32 kernel."""
    from parallel.context_parallel import ring_attention
    from parallel.context_parallel.ring import BLOCK_PATHS

    g = torch.Generator().manual_seed(5)
    s, b, nh, kvh, hd = 1024, 2, 8, 2, 64
    q, k, v = (torch.randn(s, b, h, hd, generator=g).cuda().bfloat16() for h in (nh, kvh, kvh))
    go = torch.randn(s, b, nh * hd, generator=g).cuda().bfloat16()
    masks = BlockMasks(seq_len=s, num_chunks=4, doc_ids=None, window=None, device="cuda")
    res = {}
    for fused in (True, False):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*inputs, group=Group.trivial("cp"), chunks_of=lambda r: [0, 1, 2, 3], masks=masks,
                             scale=hd ** -0.5, fused=fused)
        res[fused] = (out.float(), *(t.float() for t in torch.autograd.grad(out, inputs, go)))
        assert BLOCK_PATHS["cuda"] == ("flash" if fused else "explicit")
    for name, a, r in zip(("out", "dq", "dk", "dv"), res[True], res[False]):
        rel = ((a - r).norm() / r.norm()).item()
        assert rel < 2e-2, (name, rel)  # bf16 operands: 1e-3..1e-2 expected


def test_zigzag_shard_roundtrip_and_positions():
    x = torch.arange(2 * 24).reshape(2, 24)
    shards = [zigzag_shard(x, cp=3, rank=r, dim=1) for r in range(3)]
    assert torch.equal(shards[1][0], torch.tensor([4, 5, 6, 7, 16, 17, 18, 19]))
    assert torch.equal(zigzag_unshard(torch.cat(shards, dim=1), cp=3, dim=1), x)
    assert torch.equal(zigzag_indices(24, cp=3, rank=1), shards[1][0])


def test_shard_micro_batch_follows_tokens_and_derives_documents():
    pos = _positions()
    batch = {"tokens": torch.arange(B * S).reshape(B, S), "labels": torch.arange(B * S).reshape(B, S) + 1,
             "loss_mask": torch.ones(B, S), "position_ids": pos}
    out = shard_micro_batch(batch, _fake_group(2, rank=1))
    for key in ("tokens", "labels", "position_ids"):
        assert torch.equal(out[key], zigzag_shard(batch[key], cp=2, rank=1, dim=1))
    assert torch.equal(out["document_ids"], zigzag_shard(_doc_ids(), cp=2, rank=1, dim=1))
    plain = shard_micro_batch({k: v for k, v in batch.items() if k != "position_ids"}, _fake_group(2, rank=1))
    assert torch.equal(plain["position_ids"][0], zigzag_indices(S, cp=2, rank=1)) and "document_ids" not in plain


def test_bad_sequence_lengths_name_the_fix():
    with pytest.raises(ValueError, match=r"not divisible by 2\*cp = 8.*multiple of 8"):
        shard_micro_batch({"tokens": torch.zeros(1, 20, dtype=torch.long)}, _fake_group(4))
    with pytest.raises(ValueError, match="18 tokens per rank, not divisible by tp=4.*multiple of 16"):
        check_cp_sequence(36, cp=2, tp=4)
    check_cp_sequence(36, cp=2, tp=2)
    with pytest.raises(ValueError, match="per-sequence 'units'"):
        shard_micro_batch({"tokens": torch.zeros(1, 8, dtype=torch.long), "units": torch.ones(1)}, _fake_group(2))


def test_config_keys_and_refusals():
    from engine.config import load_config

    def cfg(*overrides):
        return load_config("tiny_llama_cpu", ["parallel.tp=1", "parallel.pp=1", "parallel.sequence_parallel=false",
                                              *overrides])

    assert cfg("parallel.cp=2").parallel.cp_comm == "ring"
    assert cfg("parallel.cp=4", "parallel.cp_comm=hybrid", "parallel.cp_a2a_size=2").parallel.cp_a2a_size == 2
    with pytest.raises(ValueError, match="cp_a2a_size"):
        cfg("parallel.cp=4", "parallel.cp_comm=hybrid")
    with pytest.raises(ValueError, match="read by parallel.cp_comm='hybrid' only"):
        cfg("parallel.cp=4", "parallel.cp_a2a_size=2")
    with pytest.raises(ValueError, match="cp_comm"):
        cfg("parallel.cp=2", "parallel.cp_comm=star")
    with pytest.raises(ValueError, match="num_key_value_heads=2 .* not divisible by 4"):  # 2 kv heads, a2a over 4
        cfg("parallel.cp=4", "parallel.cp_comm=a2a")
    with pytest.raises(ValueError, match=r"train.seq_length=100 is not divisible by 2\*parallel.cp"):
        cfg("parallel.cp=4", "train.seq_length=100")


def test_model_refuses_a2a_heads_at_construction():
    from models import build_model

    hf = {**HF, "num_attention_heads": 4, "num_key_value_heads": 2}
    with pytest.raises(ValueError, match="divisible by 4"):
        build_model(hf, tp_group=Group.trivial("tp"), cp_group=_fake_group(4), cp_comm="a2a")


# -- end to end through the trainer ------------------------------------------------------------------

SEQ, VOCAB = 32, 64
HF = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 64,
      "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
E2E_ATOL = 5e-6
STEPS = 10


class _Packed:
    """Sample i: random ids; odd samples pack documents of 7, 13 and 12 tokens (positions restart); the
    loss mask drops the first (i % 5) positions."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = np.random.default_rng(70 + i).integers(0, VOCAB, SEQ + 1)
        pos = (np.concatenate([np.arange(7), np.arange(13), np.arange(12)]) if i % 2 else np.arange(SEQ))
        mask = np.ones(SEQ, dtype=np.float32)
        mask[:i % 5] = 0.0
        return {"tokens": ids[:-1], "labels": ids[1:], "position_ids": pos, "loss_mask": mask}


def _e2e_losses(extra=(), hf=None):
    from engine.assembly import build_run
    from engine.config import load_config
    from models.hook import ModelHook

    cfg = load_config("tiny_llama_cpu", [
        "parallel.tp=1", "parallel.pp=1", "parallel.dp=-1", "parallel.sequence_parallel=false",
        f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=2", f"train.seq_length={SEQ}",
        "optim.lr=0.01", "optim.warmup_steps=0", "logging.progress_bar=off", "logging.tensorboard=false",
        "logging.jsonl=false", "logging.peak_tflops=1.0", "train.eval_interval=0", *extra])
    model = ModelHook.from_hf(hf or HF, dtype=torch.float32, seed=cfg.train.seed,
                              sequence_parallel=cfg.parallel.sequence_parallel, cp_comm=cfg.parallel.cp_comm)
    run = build_run(cfg, model=model, train_data=_Packed(4 * (STEPS + 1)), checkpoints=False)
    stats = [run.trainer.train_step(run.train_loader) for _ in range(STEPS)]
    cp_bytes = sum((st.comm_bytes or {}).get("cp", 0.0) for st in stats)
    assert run.mesh.dims.cp == 1 or cp_bytes > 0, "context parallelism moved no bytes over cp"
    return [st.loss for st in stats] + [run.trainer.evaluate(run.train_loader, 1)]


def _e2e_parts():
    out = {"cp2xpp2": _e2e_losses(["parallel.cp=2", "parallel.pp=2"])}
    dist.barrier()
    out["cp2xtp2sp"] = _e2e_losses(["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"])
    dist.barrier()
    # The interleaved schedule: 4 layers over pp2 x vp2 (one layer per virtual stage), m = 2 micro-batches.
    out["cp2xpp2xvp2"] = _e2e_losses(["parallel.cp=2", "parallel.pp=2", "parallel.vp=2",
                                      "parallel.schedule=interleaved"], hf=HF4)
    return out


HF4 = {**HF, "num_hidden_layers": 4}


def test_training_losses_equal_one_process():
    ref = {2: _e2e_losses(), 4: _e2e_losses(hf=HF4)}
    assert all(math.isfinite(x) for r in ref.values() for x in r)
    results = run_distributed(_e2e_parts, 4, timeout=400)
    for rank, res in enumerate(results):
        for name, losses in res.items():
            r = ref[4 if name == "cp2xpp2xvp2" else 2]
            assert max(abs(a - b) for a, b in zip(losses, r)) < E2E_ATOL, (rank, name, losses, r)
    print("\none process", ref, "\n", {k: max(abs(a - b) for a, b in zip(v, ref[4 if k == "cp2xpp2xvp2" else 2]))
                                        for k, v in results[0].items()})


GPT2_DROPOUT = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4, "vocab_size": VOCAB, "n_positions": 64,
                "attn_pdrop": 0.0, "resid_pdrop": 0.5, "embd_pdrop": 0.5}


def _step_dropout_masks(overrides: list[str], hf: dict) -> list[torch.Tensor]:
    """The dropout masks (``True`` where dropped) of one training step through the assembly line (its seeding)."""
    import models.ops as ops
    from engine.assembly import build_run
    from engine.config import load_config
    from models.hook import ModelHook

    masks, plain = [], ops.dropout

    def recording(x, p, *, training):
        y = plain(x, p, training=training)
        masks.append(y == 0)
        return y
    ops.dropout = recording
    try:
        cfg = load_config("tiny_llama_cpu", overrides)
        model = ModelHook.from_hf(hf, dtype=torch.float32, seed=cfg.train.seed)
        run = build_run(cfg, model=model, train_data=_Packed(8), checkpoints=False)
        run.trainer.train_step(run.train_loader)
    finally:
        ops.dropout = plain
    return masks


def _dropout_masks_per_cp_rank():
    """At cp2: the hidden and embedding dropout masks of one training forward, which must differ between the
    cp ranks (each holds other tokens of the same sequences)."""
    return _step_dropout_masks([
        "parallel.tp=1", "parallel.pp=1", "parallel.dp=-1", "parallel.cp=2", "parallel.sequence_parallel=false",
        "train.steps=1", "optim.warmup_steps=0", "train.global_batch_size=2", "train.micro_batch_size=2",
        f"train.seq_length={SEQ}",
        "logging.progress_bar=off", "logging.tensorboard=false", "logging.jsonl=false", "logging.peak_tflops=1.0",
        "train.eval_interval=0"], GPT2_DROPOUT)


def test_dropout_masks_differ_between_cp_ranks():
    r0, r1 = run_distributed(_dropout_masks_per_cp_rank, 2, timeout=180)
    assert len(r0) == len(r1) >= 2 and all(m.any() for m in r0)
    assert not any(torch.equal(a, b) for a, b in zip(r0, r1))  # before 2026-11-28 every mask was equal


def test_attention_dropout_under_cp_is_refused_in_training_only():
    from unittest import mock

    from engine.config import load_config
    from models import build_model
    from models.hook import ModelHook

    hf = {**GPT2_DROPOUT, "attn_pdrop": 0.1}
    cfg = load_config("tiny_llama_cpu", ["parallel.cp=2", "parallel.tp=1", "parallel.sequence_parallel=false"])
    with mock.patch("models.hook.hf_config_from_run", return_value=hf), \
            pytest.raises(ValueError, match="attention dropout 0.1 under context parallelism"):
        ModelHook.from_run_config(cfg, tokenizer_vocab=None)  # the run's plan, before any process group
    stage = build_model(hf, tp_group=Group.trivial("tp"), cp_group=_fake_group(2), kernels="reference")
    assert stage.layers  # built: tools/evaluate.py --cp runs such a model forward, without dropout



def _dropout_masks_per_pp_stage():
    """At pp2 (one GPT-2 layer per stage): the dropout masks of one training step of two micro-batches (stage 0:
    embedding and layer 0's; stage 1: layer 1's), and the first state of each chunk's model-parallel stream
    at pp2 x vp2."""
    from engine.assembly import build_run
    from engine.config import load_config
    from models.hook import ModelHook
    from parallel.random import MODEL_PARALLEL_STREAM

    common = ["parallel.tp=1", "parallel.pp=2", "parallel.dp=-1", "parallel.sequence_parallel=false",
              "train.steps=1", "optim.warmup_steps=0", "train.global_batch_size=2", "train.micro_batch_size=1",
              f"train.seq_length={SEQ}", "logging.progress_bar=off", "logging.tensorboard=false",
              "logging.jsonl=false", "logging.peak_tflops=1.0", "logging.memory_report=false", "train.eval_interval=0"]
    masks = _step_dropout_masks(common, {**GPT2_DROPOUT, "n_layer": 2})
    cfg = load_config("tiny_llama_cpu", common + ["parallel.vp=2", "parallel.schedule=interleaved"])
    run = build_run(cfg, model=ModelHook.from_hf({**GPT2_DROPOUT, "n_layer": 4}, dtype=torch.float32,
                                                 seed=cfg.train.seed), train_data=_Packed(8), checkpoints=False)
    streams = [c.rng.get_states()[MODEL_PARALLEL_STREAM] for c in run.trainer.chunks]
    run.close()
    return masks, streams


def test_dropout_masks_differ_between_pipeline_stages_and_chunks():
    (m0, s0), (m1, s1) = run_distributed(_dropout_masks_per_pp_stage, 2, timeout=180)
    assert len(m0) == 6 and len(m1) == 4 and all(m.any() for m in m0 + m1)  # two micro-batches
    # before 2026-11-28 every stage seeded the same streams: stage 1's masks were stage 0's first ones
    assert not any(torch.equal(a, b) for a in m0 for b in m1 if a.shape == b.shape)
    chunks = s0 + s1  # pp2 x vp2: four chunks, each its own model-parallel stream
    assert len(chunks) == 4 and all(not torch.equal(a, b) for i, a in enumerate(chunks) for b in chunks[i + 1:])
