"""TP=2 and TP=4, with and without sequence parallelism, equal the TP=1 model; communication and
activation memory per layer equal their formulas exactly.

One distributed run (4 gloo ranks; TP=2 as two TP groups, then TP=4) computes everything; the
tests below check its results against single-process references.
Tolerances (fp32): per-token loss within atol 1e-6, every parameter gradient (shards gathered)
within atol 1e-5; initial weights exactly equal (name-seeded init, sliced).
"""
from __future__ import annotations

import pytest
import torch

from models import build_model
from models.attention import AttentionMasks
from models import ops
from parallel.comm import Group
from parallel.tensor_parallel import DefaultLinearImpl, allreduce_sequence_parallel_grads, full_param
from parallel.testing import run_distributed
from tests.models.tiny import config

LOSS_ATOL, GRAD_ATOL = 1e-6, 1e-5
PARITY_FAMILIES = ("llama", "qwen3", "gpt2", "mistral")  # kv heads divisible by 4
B, S = 2, 8
SEED = 7


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (B, S), generator=g)
    labels = torch.randint(0, 100, (B, S), generator=g)
    labels[0, :2] = -100
    loss_mask = (torch.rand(B, S, generator=g) > 0.2).float()
    return ids, labels, loss_mask


def _train_step(name, tp_group, sp):
    """Per-token loss, and every full gradient and weight after backward + the SP grad all-reduce."""
    ids, labels, loss_mask = _batch()
    model = build_model(config(name), tp_group=tp_group, sequence_parallel=sp, seed=SEED)
    loss = model(ids, labels=labels, loss_mask=loss_mask)
    loss.sum().backward()
    allreduce_sequence_parallel_grads(model, tp_group)
    grads = {n: full_param(p, tp_group, grad=True) for n, p in model.named_parameters()}
    weights = {n: full_param(p, tp_group) for n, p in model.named_parameters()}
    return loss.detach(), grads, weights


# -- communication ---------------------------------------------------------------------------------

def _ledger(tp_group, *, sp, regather=True, full_model):
    """Ledger of one microbatch fwd+bwd of the Llama model: all layers alone, or the full model."""
    impl = DefaultLinearImpl(regather_sp_input=regather)
    ids, labels, _ = _batch()
    kw = dict(tp_group=tp_group, sequence_parallel=sp, seed=SEED, linear_impl=impl)
    with tp_group.ledger.capture() as led:
        if full_model:
            model = build_model(config("llama"), **kw)
            model(ids, labels=labels).sum().backward()
        else:
            model = build_model(config("llama"), pre_process=False, post_process=False, **kw)
            s_local = S // tp_group.size if sp else S
            x = torch.randn(s_local, B, 64, requires_grad=True)
            model(x).backward(torch.randn(s_local, B, 64))
    with tp_group.ledger.capture() as grads_led:
        allreduce_sequence_parallel_grads(model, tp_group)
    return ({k: (d["calls"], d["sent_bytes"]) for k, d in led.summary().items()},
            {k: (d["calls"], d["payload_bytes"]) for k, d in grads_led.summary().items()})


# -- activation memory -----------------------------------------------------------------------------

def saved_bytes_per_module(layer, x, *, rope, masks) -> dict[str, int]:
    """Bytes saved for backward by one layer's forward, attributed to the innermost module running
    when each tensor was saved; storages deduplicated (a view counts its whole storage once);
    parameters and the shared RoPE tables excluded."""
    exclude = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    exclude |= {t.untyped_storage().data_ptr() for t in (rope.cos, rope.sin, *rope.expanded(x.dtype))}
    stack, seen, out = ["layer"], set(), {}
    hooks = []

    def enter(name):
        def hook(module, args):
            stack.append(name)
        return hook

    def leave(module, args, output):
        stack.pop()

    for name, mod in layer.named_modules():
        if name:
            hooks.append(mod.register_forward_pre_hook(enter(name)))
            hooks.append(mod.register_forward_hook(leave))

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in exclude and ptr not in seen:
            seen.add(ptr)
            out[stack[-1]] = out.get(stack[-1], 0) + st.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x, rope=rope, masks=masks)
    finally:
        for h in hooks:
            h.remove()
    return out


def _memory(tp_group, *, sp):
    model = build_model(config("llama"), tp_group=tp_group, sequence_parallel=sp, pre_process=False,
                        post_process=False, layer_range=(0, 1), seed=SEED)
    s_local = S // tp_group.size if sp else S
    x = torch.randn(s_local, B, 64, requires_grad=True)
    pos = torch.arange(S)[None]
    rope = ops.RopeTables(pos, model.inv_freq)
    masks = AttentionMasks(seq_len=S, doc_ids=None, device=x.device)
    return saved_bytes_per_module(model.layers["0"], x, rope=rope, masks=masks)


def llama_saved_bytes(*, s, b, h, a, g, d, f, t, sp, elem=4) -> int:
    """Analytic bytes saved for backward per layer per rank by Tessel's Llama block without dropout
    (SDPA's flash path saving q, k, v, out and the log-sum-exp): the library's formula
    (engine.memory.layer_saved_bytes, docs/memory.md), which the start-up memory report uses."""
    from engine.memory import LayerShape, layer_saved_bytes

    shape = LayerShape(hidden_size=h, num_heads=a, num_kv_heads=g, head_dim=d, ffn_hidden_size=f)
    return layer_saved_bytes(shape, s=s, b=b, tp=t, sp=sp, elem=elem, attention="flash")


# -- the distributed run ---------------------------------------------------------------------------

def _worker():
    import torch.distributed as dist

    from parallel.mesh import Mesh, ParallelDims

    out = {}
    for tp_size in (2, 4):
        mesh = Mesh.build(ParallelDims.for_world(dist.get_world_size(), tp=tp_size))
        tp = mesh.tp
        keep = tp.rank == 0  # gathered results are identical across a TP group
        for name in PARITY_FAMILIES:
            for sp in (False, True):
                res = _train_step(name, tp, sp)
                if keep:
                    out["step", tp_size, name, sp] = res
        for sp, regather in ((False, True), (True, True), (True, False)):
            for full_model in (False, True):
                res = _ledger(tp, sp=sp, regather=regather, full_model=full_model)
                out["ledger", tp_size, sp, regather, full_model] = res
        for sp in (False, True):
            out["memory", tp_size, sp] = _memory(tp, sp=sp)
    return out


@pytest.fixture(scope="module")
def dist_results():
    return run_distributed(_worker, 4, timeout=240)


@pytest.fixture(scope="module")
def references():
    tp1 = Group.trivial("tp")
    return {name: _train_step(name, tp1, False) for name in PARITY_FAMILIES}


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("name", PARITY_FAMILIES)
def test_loss_and_gradients_equal_tp1(dist_results, references, name, tp_size, sp):
    ref_loss, ref_grads, ref_weights = references[name]
    ranks = [0, 2] if tp_size == 2 else [0]  # the first rank of every TP group
    for r in ranks:
        loss, grads, weights = dist_results[r]["step", tp_size, name, sp]
        torch.testing.assert_close(loss, ref_loss, atol=LOSS_ATOL, rtol=0)
        assert set(grads) == set(ref_grads)
        for n, g in grads.items():
            rows = ref_grads[n].shape[0]
            if g.shape != ref_grads[n].shape:  # vocab padded further at larger TP: padding stays inert
                assert g.shape[0] > rows and g.shape[1:] == ref_grads[n].shape[1:], n
                assert not g[rows:].any() and not weights[n][rows:].any(), n
            assert torch.equal(weights[n][:rows], ref_weights[n]), f"init differs: {n}"
            torch.testing.assert_close(g[:rows], ref_grads[n], atol=GRAD_ATOL, rtol=0, msg=n)


def _expected_ledger(p, *, sp, regather, full_model, L=2):
    """Per-rank bytes sent (ring cost) for one microbatch fwd+bwd of L Llama layers (+ ends)."""
    act = B * S * 64 * 4  # one (s, b, h) fp32 activation
    tok = B * S * 4  # one fp32 value per token
    ar = 2 * (p - 1) / p  # all-reduce cost factor
    ag = rs = (p - 1) / p  # all-gather / reduce-scatter of a full (s, b, h) tensor
    if not sp:
        # Per layer: attention-out and fc2-out all-reduces forward, qkv and fc1 input-grad all-reduces backward.
        calls, sent = 4 * L, 4 * L * ar * act
        if full_model:  # embedding forward, logits-layer input grad backward, CE (max; target logit + sum exp)
            calls, sent = calls + 4, sent + 2 * ar * act + ar * tok + ar * 2 * tok
        return {"all_reduce@tp": (calls, sent)}
    # Per layer: forward AG (qkv, fc1 inputs) + RS (attention out, fc2 out); backward AG (grads of
    # the RS outputs) + RS (input grads of qkv, fc1) [+ AG re-gathering qkv/fc1 inputs].
    n_ag, n_rs = (6 if regather else 4) * L, 4 * L
    out = {}
    if full_model:  # embedding RS fwd + AG bwd; logits layer AG fwd + RS bwd [+ AG]; CE all-reduces
        n_ag, n_rs = n_ag + (3 if regather else 2), n_rs + 2
        out["all_reduce@tp"] = (2, ar * 3 * tok)
    out["all_gather@tp"] = (n_ag, n_ag * ag * act)
    out["reduce_scatter@tp"] = (n_rs, n_rs * rs * act)
    return out


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("sp,regather", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("full_model", [False, True])
def test_ledger_equals_analytic_volume(dist_results, tp_size, sp, regather, full_model):
    for res in dist_results:
        step, grad_reduce = res["ledger", tp_size, sp, regather, full_model]
        assert step == _expected_ledger(tp_size, sp=sp, regather=regather, full_model=full_model)
        # SP: the norm weights' partial gradients (2 per layer + the final norm) in one all-reduce.
        n_norms = 2 * 2 + (1 if full_model else 0)
        assert grad_reduce == ({"all_reduce@tp": (1, n_norms * 64 * 4)} if sp else {})


@pytest.mark.parametrize("tp_size", [2, 4])
def test_activation_memory_per_layer(dist_results, tp_size):
    t = tp_size
    for res in dist_results:
        plain, sp = res["memory", t, False], res["memory", t, True]
        dims = dict(s=S, b=B, h=64, a=8, g=4, d=8, f=96, t=t)
        assert sum(plain.values()) == llama_saved_bytes(sp=False, **dims)
        assert sum(sp.values()) == llama_saved_bytes(sp=True, **dims)
        # Sequence parallelism shrinks the norms' saved tensors (residual input, normalised output,
        # rstd) and the column-linear inputs by exactly 1/tp; the TP regions are unchanged.
        for mod in ("input_norm", "post_attention_norm", "attention.qkv", "mlp.fc1"):
            assert sp[mod] * t == plain[mod], (mod, sp[mod], plain[mod])
        for mod in ("attention", "attention.out", "mlp", "mlp.fc2"):
            assert sp.get(mod, 0) == plain.get(mod, 0), mod


def test_activation_memory_tp1_matches_formula():
    tp1 = Group.trivial("tp")
    got = _memory(tp1, sp=False)
    assert sum(got.values()) == llama_saved_bytes(s=S, b=B, h=64, a=8, g=4, d=8, f=96, t=1, sp=False)
