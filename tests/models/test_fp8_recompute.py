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
  per micro-batch in the plain run) less the layer's closing reduce-scatter, which torch's
  non-reentrant checkpoint does not replay (it stops once the last saved tensor is rebuilt).
"""
from __future__ import annotations

import pytest
import torch

from engine.ops.fp8_linear import RECIPES, delayed_states
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


def _train(model, tp: Group):
    """Two steps of two micro-batches; delayed states updated (amax MAX over tp) after each step."""
    from parallel.tensor_parallel.fp8 import update_fp8

    losses, grads = [], []
    data = _batches(4)
    for step in range(2):
        for p in model.parameters():
            p.grad = None
        for ids, labels in data[2 * step:2 * step + 2]:
            loss = model(ids, labels=labels).mean()
            loss.backward()
            losses.append(loss.detach())
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
    return out


@pytest.fixture(scope="module")
def tp_results():
    return run_distributed(_tp_worker, 2, timeout=180)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_recompute_under_tensor_and_sequence_parallelism(tp_results, recipe):
    tp, h = 2, 64
    # torch's non-reentrant checkpoint stops the replay once the last tensor backward needs is rebuilt: the
    # layer's closing reduce-scatter (fc2's partial sums to the sequence shards) is not replayed.
    closing_rs = (tp - 1) * S * B * h * 4 // tp
    for rank, out in enumerate(tp_results):
        ref, ref_bytes, fwd_bytes = out[recipe, "none", None]
        assert all(len(per_mb) == 4 for per_mb in fwd_bytes)  # 2 steps x 2 micro-batches
        for recompute, n in (("full", None), ("full", 1)):
            got, nbytes, _ = out[recipe, recompute, n]
            _assert_same(got, ref, (rank, recipe, recompute, n))
            replayed = sum(b - closing_rs for per_mb in fwd_bytes[:n] for b in per_mb)
            assert nbytes - ref_bytes == replayed, (rank, recipe, n, nbytes, ref_bytes, fwd_bytes)
    if recipe == "delayed":  # step 2 ran on history scales: no amax all-reduce in its forwards
        assert tp_results[0][recipe, "none", None][2][0][2] < tp_results[0][recipe, "none", None][2][0][0]
