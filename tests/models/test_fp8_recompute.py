"""FP8 linears (model.fp8) under activation recompute (train.activation_checkpointing) change nothing.

A recomputed layer runs its FP8 linears' forward a second time inside backward. That must give the
same quantised operands (so the same saved fp8 tensors and the same gradients) and must leave the
delayed recipe's state as one forward leaves it: a recomputed call folds the same amax into the step's
running maximum (idempotent), and nothing is pushed into the history before the optimizer step's
update. Shown here, bitwise, for every recipe:

* one process, Llama (2 layers, GQA), two optimizer steps of two micro-batches each, the delayed
  states updated between steps (so step 2 runs on history scales): none, selective and full give
  equal losses, every gradient and equal delayed states (pending amaxes, histories, scales);
* 2 gloo ranks at TP=2 with sequence parallelism (per-tensor recipes all-reduce their amaxes over TP),
  full recompute of every layer and of the first: losses, gradients and delayed states equal none's;
  the recompute adds to the ledger exactly the tp bytes of each recomputed layer's forward (measured
  per micro-batch in the plain run), its closing reduce-scatter included: torch's non-reentrant
  checkpoint stops once the last saved tensor is rebuilt, and with SP the per-tensor recipes' fc2
  reduce-scatters inside its FP8 op (whose backward gathers dy as fp8), before the op saves its tensors.

The same holds with each weight's FP8 casts made once per step and reused by the step's other
micro-batches and by the recompute (``fp8_weight_casts``, the trainer's ``model.fp8_weight_cache``):
bitwise equal, with exactly the analytic number of casts made, and at TP=2 exactly one weight-amax
all-reduce per linear and step fewer per extra micro-batch and recompute.
"""
from __future__ import annotations

import pytest
import torch

from engine.ops.fp8_linear import RECIPES, REQUANTISED, delayed_states
from models import build_model
from parallel.comm import Group
from parallel.testing import run_distributed
from tests.models.tiny import config

B, S, SEED, VOCAB = 2, 16, 11, 100


def _batches(m: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (B, S), generator=g), torch.randint(0, VOCAB, (B, S), generator=g))
            for _ in range(m)]


def _model(recipe: str, recompute: str, num_layers: int | None, *, tp: Group, sp: bool = False):
    from parallel.tensor_parallel.fp8 import apply_fp8

    torch.manual_seed(SEED)
    model = build_model(config("llama", attention_dropout=0.1), tp_group=tp, sequence_parallel=sp, seed=SEED,
                        recompute=recompute, recompute_num_layers=num_layers)
    converted = apply_fp8(model, recipe)
    assert len(converted) == 8, converted  # qkv, out, fc1, fc2 of both layers
    return model.train()


def _train(model, tp: Group, *, casts: bool = False, counts: list | None = None):
    """Two steps of two micro-batches; delayed states updated (amax MAX over tp) after each step.
    ``casts``: each step inside fp8_weight_casts; ``counts`` gets each step's (made, reused) totals."""
    from parallel.tensor_parallel.fp8 import fp8_weight_casts, update_fp8

    losses, grads = [], []
    data = _batches(4)
    for step in range(2):
        for p in model.parameters():
            p.grad = None
        with fp8_weight_casts(model, casts) as caches:
            for ids, labels in data[2 * step:2 * step + 2]:
                loss = model(ids, labels=labels).mean()
                loss.backward()
                losses.append(loss.detach())
        if counts is not None:
            counts.append((sum(c.made for c in caches), sum(c.reused for c in caches)))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        pending = {n: s.pending.clone() for n, s in delayed_states(model)}
        update_fp8(model, [tp])
    states = {n: (pending[n], s.amax_history.clone(), s.scale.clone(), s.steps.clone())
              for n, s in delayed_states(model)}
    return torch.stack(losses), grads, states


def _assert_same(got, ref, what):
    losses, grads, states = got
    ref_losses, ref_grads, ref_states = ref
    assert torch.equal(losses, ref_losses), what
    for step, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.keys() == r.keys()
        for name in g:
            assert torch.equal(g[name], r[name]), (what, step, name)
    assert states.keys() == ref_states.keys()
    for name in states:
        for a, b in zip(states[name], ref_states[name]):
            assert torch.equal(a, b), (what, name)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_recompute_is_bitwise_identical_single_process(recipe):
    tp = Group.trivial("tp")
    ref = _train(_model(recipe, "none", None, tp=tp), tp)
    if recipe == "delayed":
        assert len(ref[2]) == 8 and all(int(s[3]) == 2 for s in ref[2].values())  # two updates happened
        assert all(bool((s[0] > 0).all()) for s in ref[2].values())  # every role recorded an amax
    for recompute, n in (("selective", None), ("full", None)):
        _assert_same(_train(_model(recipe, recompute, n, tp=tp), tp), ref, (recipe, recompute, n))


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_weight_casts_reused_across_micro_batches_and_recompute(recipe):
    """Casts made once per step and linear, bitwise the same training. Per step and linear: 2 micro-batch
    forwards (4 with full recompute) need the forward cast; rowwise's and mxfp8's 2 backwards need the
    transposed one."""
    tp = Group.trivial("tp")
    ref = _train(_model(recipe, "none", None, tp=tp), tp)
    linears, kinds = 8, 2 if recipe in REQUANTISED else 1
    for recompute in ("none", "full"):
        counts = []
        _assert_same(_train(_model(recipe, recompute, None, tp=tp), tp, casts=True, counts=counts), ref,
                     (recipe, recompute, "casts"))
        forwards = 4 if recompute == "full" else 2
        uses = forwards + (2 if recipe in REQUANTISED else 0)
        assert counts == [(linears * kinds, linears * (uses - kinds))] * 2, (recipe, recompute, counts)


def test_fp8_weight_casts_scope():
    """The scope is the only place casts are kept: outside it nothing is cached, a closed cache caches
    nothing, a cache handed another linear's weight refuses, and a nested scope leaves the outer's."""
    from engine.ops.fp8_linear import WeightCasts, fp8_linear
    from parallel.tensor_parallel.fp8 import fp8_impls, fp8_weight_casts, weight_casts_enabled

    model = _model("tensorwise", "none", None, tp=Group.trivial("tp"))
    impls = fp8_impls(model)
    assert len(impls) == 8 and all(i.weight_casts is None for i in impls)
    with fp8_weight_casts(model) as outer:
        assert [i.weight_casts for i in impls] == outer
        with fp8_weight_casts(model) as inner:
            assert inner == []
        assert [i.weight_casts for i in impls] == outer
    assert all(i.weight_casts is None for i in impls) and not any(c.open for c in outer)
    with fp8_weight_casts(model, enabled=False) as none:
        assert none == [] and all(i.weight_casts is None for i in impls)
    w, x = torch.randn(32, 16), torch.randn(4, 16)
    c = WeightCasts()
    fp8_linear(x, w, weight_casts=c)
    fp8_linear(x, w, weight_casts=c)
    assert (c.made, c.reused) == (1, 1)
    with pytest.raises(RuntimeError, match="each linear needs its own WeightCasts"):
        fp8_linear(torch.randn(4, 32), torch.randn(16, 32), weight_casts=c)
    c.close()
    fp8_linear(x, w, weight_casts=c)
    assert (c.made, c.reused) == (2, 1)
    assert weight_casts_enabled(None, zero_stage=1) and not weight_casts_enabled(None, zero_stage=3)
    assert weight_casts_enabled(True, zero_stage=3) and not weight_casts_enabled(False, zero_stage=0)


def _tp_worker():
    import torch.distributed as dist

    from parallel.mesh import Mesh, ParallelDims

    mesh = Mesh.build(ParallelDims.for_world(dist.get_world_size(), tp=2))
    out = {}
    for recipe in ("tensorwise", "delayed"):
        for recompute, n in (("none", None), ("full", None), ("full", 1)):
            model = _model(recipe, recompute, n, tp=mesh.tp, sp=True)
            fwd_bytes, marks = [[] for _ in model.layers], {}
            if recompute == "none":  # each layer forward's tp bytes, per micro-batch: what a recompute replays
                for i, layer in enumerate(model.layers.values()):
                    layer.register_forward_pre_hook(
                        lambda m, a, i=i: marks.__setitem__(i, mesh.ledger.total(axis="tp")))
                    layer.register_forward_hook(
                        lambda m, a, o, i=i: fwd_bytes[i].append(mesh.ledger.total(axis="tp") - marks[i]))
            before = mesh.ledger.total(axis="tp")
            got = _train(model, mesh.tp)
            out[recipe, recompute, n] = got, mesh.ledger.total(axis="tp") - before, fwd_bytes
    for recompute in ("none", "full"):  # weight casts reused across micro-batches and the recompute
        for casts in (False, True):
            with mesh.tp.ledger.capture() as led:
                got = _train(_model("tensorwise", recompute, None, tp=mesh.tp, sp=True), mesh.tp, casts=casts)
            amax = [rec.payload_bytes for rec in led.records if rec.op == "all_reduce" and rec.payload_bytes <= 8]
            out["casts", recompute, casts] = got, (len(amax), sum(amax))
    return out


@pytest.fixture(scope="module")
def tp_results():
    return run_distributed(_tp_worker, 2, timeout=180)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_recompute_under_tensor_and_sequence_parallelism(tp_results, recipe):
    # torch's non-reentrant checkpoint stops the replay once the last tensor backward needs is rebuilt; the
    # layer's closing reduce-scatter (fc2's partial sums to the sequence shards) runs inside fc2's FP8 op
    # (sequence_scatter), before it saves its tensors: replayed too.
    for rank, out in enumerate(tp_results):
        ref, ref_bytes, fwd_bytes = out[recipe, "none", None]
        assert all(len(per_mb) == 4 for per_mb in fwd_bytes)  # 2 steps x 2 micro-batches
        for recompute, n in (("full", None), ("full", 1)):
            got, nbytes, _ = out[recipe, recompute, n]
            _assert_same(got, ref, (rank, recipe, recompute, n))
            replayed = sum(b for per_mb in fwd_bytes[:n] for b in per_mb)
            assert nbytes - ref_bytes == replayed, (rank, recipe, n, nbytes, ref_bytes, fwd_bytes)
    if recipe == "delayed":  # step 2 ran on history scales: no amax all-reduce in its forwards
        assert tp_results[0][recipe, "none", None][2][0][2] < tp_results[0][recipe, "none", None][2][0][0]


def test_fp8_weight_casts_reused_under_tensor_and_sequence_parallelism(tp_results):
    """TP=2 + SP, tensorwise: bitwise equal with the casts reused, and per step each of the 8 linears
    all-reduces its weight's amax (4 bytes) once instead of once per forward (2 micro-batches; 4 with
    recompute): the 4 row-parallel linears' own calls go; the column-parallel ones' rode in their
    input's (8 bytes, now 4)."""
    for rank, out in enumerate(tp_results):
        for recompute, forwards in (("none", 2), ("full", 4)):
            (ref, n_ref), (got, n_got) = out["casts", recompute, False], out["casts", recompute, True]
            _assert_same(got, ref, (rank, recompute, "casts"))
            steps = 2
            assert n_ref[0] - n_got[0] == steps * 4 * (forwards - 1), (rank, recompute, n_ref, n_got)
            assert n_ref[1] - n_got[1] == steps * 8 * 4 * (forwards - 1), (rank, recompute, n_ref, n_got)
