"""The models on engine/ops' fused kernels equal the models on the plain-PyTorch references.

* ``kernels="triton"`` (RMSNorm with the fused residual add, SwiGLU, RoPE for q and k in one launch;
  run by Triton's interpreter on CPU) vs ``kernels="reference"``: per-token loss and every gradient,
  fp32, atol 1e-5 (the kernels round once at the end instead of after every op).
* ``fused_cross_entropy=True`` (chunked linear + cross-entropy, no logits tensor) vs the unfused
  output layer + vocab-parallel cross-entropy: at TP=1 in one process, and at TP=2 (with and without
  sequence parallelism) and TP=4 on 4 gloo ranks against the TP=1 unfused model; loss atol 1e-6,
  gradients atol 1e-5 (fp32). Both the real vocab split (divisible_by=8: every rank holds real
  entries) and shards made only of padding (divisible_by=128) are covered.
* Communication of the fused loss, exactly: one MAX all-reduce of T fp32 and one SUM all-reduce of
  3T + 1 fp32 (T tokens), against the unfused loss's MAX of T and SUM of 2T; nothing else changes.
"""
from __future__ import annotations

import pytest
import torch

from models import build_model
from parallel.comm import Group
from parallel.tensor_parallel import allreduce_sequence_parallel_grads, full_param
from parallel.testing import run_distributed
from tests.models.tiny import config

LOSS_ATOL, GRAD_ATOL = 1e-6, 1e-5
B, S = 2, 8
SEED = 11


def _batch(vocab=100):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = torch.randint(0, vocab, (B, S), generator=g)
    labels[1, :3] = -100
    loss_mask = (torch.rand(B, S, generator=g) > 0.2).float()
    return ids, labels, loss_mask


def _step(name, tp_group, *, sp=False, divisible_by=128, position_ids=None, **opts):
    ids, labels, loss_mask = _batch()
    model = build_model(config(name), tp_group=tp_group, sequence_parallel=sp, seed=SEED,
                        make_vocab_size_divisible_by=divisible_by, **opts)
    loss = model(ids, labels=labels, loss_mask=loss_mask, position_ids=position_ids)
    loss.sum().backward()
    allreduce_sequence_parallel_grads(model, tp_group)
    vocab = model.config.vocab_size
    grads = {}
    for n, p in model.named_parameters():
        g = full_param(p, tp_group, grad=True)
        if g.shape[0] > vocab and ("embedding" in n or "output_layer" in n):
            assert not g[vocab:].any(), f"{n}: vocab padding received a gradient"
            g = g[:vocab]  # padding depends on the layout; compare the real rows
        grads[n] = g
    return loss.detach(), grads


def _assert_same(got, ref, *, grad_atol=GRAD_ATOL):
    loss, grads = got
    ref_loss, ref_grads = ref
    torch.testing.assert_close(loss, ref_loss, atol=LOSS_ATOL, rtol=0)
    assert set(grads) == set(ref_grads)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], atol=grad_atol, rtol=0, msg=n)


# -- one process -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "qwen3"])  # qwen3: the q/k head norms too
def test_triton_kernels_equal_reference(name):
    tp1 = Group.trivial("tp")
    ref = _step(name, tp1, kernels="reference", fused_cross_entropy=False)
    got = _step(name, tp1, kernels="triton", fused_cross_entropy=False)
    _assert_same(got, ref)


def test_triton_rope_with_per_sample_positions():
    """Packed rows: positions restart per document and differ across the batch ((s, b, hd/2) tables)."""
    tp1 = Group.trivial("tp")
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
    ref = _step("llama", tp1, kernels="reference", position_ids=pos)
    got = _step("llama", tp1, kernels="triton", position_ids=pos)
    _assert_same(got, ref)


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # untied and tied output layer
@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_fused_cross_entropy_equals_unfused_tp1(name, kernels):
    tp1 = Group.trivial("tp")
    ref = _step(name, tp1, kernels="reference", fused_cross_entropy=False)
    got = _step(name, tp1, kernels=kernels, fused_cross_entropy=True)
    _assert_same(got, ref)


def test_auto_uses_the_references_on_cpu():
    """kernels="auto" on CPU tensors is the reference path, bit for bit (and no fused loss)."""
    tp1 = Group.trivial("tp")
    ref = _step("llama", tp1, kernels="reference", fused_cross_entropy=False)
    got = _step("llama", tp1)
    torch.testing.assert_close(got[0], ref[0], atol=0, rtol=0)
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], atol=0, rtol=0, msg=n)


def test_bad_kernel_options():
    tp1 = Group.trivial("tp")
    with pytest.raises(ValueError, match="kernels='cuda' is not one of"):
        build_model(config("llama"), tp_group=tp1, kernels="cuda")
    with pytest.raises(ValueError, match="fused_cross_entropy='yes' must be True, False or None"):
        build_model(config("llama"), tp_group=tp1, fused_cross_entropy="yes")


# -- several processes -----------------------------------------------------------------------------

def _loss_ledger(tp_group, *, fused):
    ids, labels, _ = _batch()
    model = build_model(config("llama"), tp_group=tp_group, seed=SEED, fused_cross_entropy=fused,
                        make_vocab_size_divisible_by=8)
    with tp_group.ledger.capture() as led:
        model(ids, labels=labels).sum().backward()
    return {k: (d["calls"], d["sent_bytes"]) for k, d in led.summary().items()}


def _worker():
    import torch.distributed as dist

    from parallel.mesh import Mesh, ParallelDims

    out = {}
    for tp_size in (2, 4):
        mesh = Mesh.build(ParallelDims.for_world(dist.get_world_size(), tp=tp_size))
        tp = mesh.tp
        for sp in ((False, True) if tp_size == 2 else (False,)):
            for divisible_by in (8, 128):
                res = _step("llama", tp, sp=sp, divisible_by=divisible_by, fused_cross_entropy=True)
                if tp.rank == 0:
                    out["step", tp_size, sp, divisible_by] = res
        out["ledger", tp_size] = (_loss_ledger(tp, fused=True), _loss_ledger(tp, fused=False))
    return out


@pytest.fixture(scope="module")
def dist_results():
    return run_distributed(_worker, 4, timeout=240)


@pytest.mark.parametrize("tp_size,sp", [(2, False), (2, True), (4, False)])
@pytest.mark.parametrize("divisible_by", [8, 128])
def test_fused_cross_entropy_tp_equals_tp1_unfused(dist_results, tp_size, sp, divisible_by):
    ref = _step("llama", Group.trivial("tp"), fused_cross_entropy=False)
    for r in ([0, 2] if tp_size == 2 else [0]):
        _assert_same(dist_results[r]["step", tp_size, sp, divisible_by], ref)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_fused_cross_entropy_communication(dist_results, tp_size):
    tokens = B * S
    ring = 2 * (tp_size - 1) / tp_size  # all-reduce: bytes sent per rank per payload byte
    for res in dist_results:
        fused, unfused = res["ledger", tp_size]
        calls_f, sent_f = fused["all_reduce@tp"]
        calls_u, sent_u = unfused["all_reduce@tp"]
        assert calls_f == calls_u  # MAX + SUM in both
        # fused SUM payload: [S, z_t, Z] per token + the shard's vocab count; unfused: [z_t, S] per token
        assert sent_f - sent_u == pytest.approx(ring * ((3 * tokens + 1) - 2 * tokens) * 4)
        assert set(fused) == set(unfused)
        for key in fused:
            if key != "all_reduce@tp":
                assert fused[key] == unfused[key], key


# -- on a GPU (compiled kernels) -------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_cuda_auto_kernels_equal_reference_fp32(name):
    """kernels="auto" on CUDA = compiled Triton kernels + the fused loss; fp32 as the CPU tests."""
    tp1 = Group.trivial("tp")
    ids, labels, loss_mask = (t.cuda() for t in _batch())
    out = {}
    for kernels, fused in (("reference", False), ("auto", None)):
        model = build_model(config(name), tp_group=tp1, seed=SEED, device="cuda", kernels=kernels,
                            fused_cross_entropy=fused)
        loss = model(ids, labels=labels, loss_mask=loss_mask)
        loss.sum().backward()
        out[kernels] = loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}
    _assert_same(out["auto"], out["reference"])


@pytest.mark.gpu
def test_cuda_auto_kernels_bf16_error_within_twice_reference_error():
    """bf16 model: the fused path's loss error against an fp64 CPU model is at most twice the bf16
    reference path's error, plus one bf16 ulp of the loss."""
    cfg = config("llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=1000)
    tp1 = Group.trivial("tp")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 1000, (4, 64), generator=g)
    labels = torch.randint(0, 1000, (4, 64), generator=g)
    exact = build_model(cfg, tp_group=tp1, seed=SEED, dtype=torch.float64)(ids, labels=labels)
    errs = {}
    for kernels, fused in (("reference", False), ("auto", None)):
        model = build_model(cfg, tp_group=tp1, seed=SEED, device="cuda", dtype=torch.bfloat16,
                            kernels=kernels, fused_cross_entropy=fused)
        loss = model(ids.cuda(), labels=labels.cuda()).double().cpu()
        errs[kernels] = (loss - exact.detach()).abs().max().item()
    ulp = 2.0 ** -7 * exact.abs().max().item()
    assert errs["auto"] <= 2 * errs["reference"] + ulp, errs
