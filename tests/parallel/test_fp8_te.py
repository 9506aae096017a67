"""``model.fp8_backend = "te"`` (parallel/tensor_parallel/fp8_te.py).

Transformer Engine cannot be installed here, so most of these tests put tests/fake_te first on
``sys.path``: a stand-in with TE's module surface that computes in high precision (its README). They
check Tessel's side of the backend and nothing of TE's FP8 numerics:

* every column- and row-parallel linear but the output layer (and ``model.fp8_exclude``) runs through a
  TE ``Linear`` whose weight is the layer's own Parameter, inside an autocast region carrying the
  mapped recipe and the TP group as the amax reduction group; the state dict is the non-FP8 model's;
* at TP = 2, with and without sequence parallelism, the TE-backed two-layer MLP (with biases) gives the
  high-precision path's outputs and gradients (fp32, 1e-6 relative: only the bias add, after the GEMM
  instead of inside it, may round differently) and moves the same bytes, op for op, as the
  high-precision path that saves the gathered input (``regather_sp_input=False``: TE's GEMM saves its
  own input);
* through the assembly line and trainer, 2 steps and an evaluation equal the fp8 = "none" run's
  (1e-6), and the metrics name the precision;
* the refusals name their fix, before any process group.

The ``gpu`` test at the end needs a real TE and skips without it.
"""
from __future__ import annotations

import contextlib
import importlib
import math
import sys
from pathlib import Path

import pytest
import torch

from engine.data.synthetic import RandomTokens
from parallel.testing import run_distributed

FAKE = str(Path(__file__).resolve().parents[1] / "fake_te")
S, B, H, F = 16, 2, 64, 96  # (s, b, h); F: the MLP width (column out, row in)


def _drop_te_modules() -> dict:
    names = [k for k in sys.modules if k == "transformer_engine" or k.startswith("transformer_engine.")]
    return {k: sys.modules.pop(k) for k in names}


@contextlib.contextmanager
def fake_te():
    """tests/fake_te as ``transformer_engine`` while open; whatever was imported before is restored after."""
    saved = _drop_te_modules()
    sys.path.insert(0, FAKE)
    try:
        te = importlib.import_module("transformer_engine.pytorch")
        assert importlib.import_module("transformer_engine").FAKE
        te.CALLS.clear()
        te.OPENED.clear()
        yield te
    finally:
        sys.path.remove(FAKE)
        _drop_te_modules()
        sys.modules.update(saved)


# -- refusals ------------------------------------------------------------------------------------
def test_te_backend_refusals_name_the_fix():
    from parallel.tensor_parallel.fp8_te import check_te_backend

    ok = dict(recipe="tensorwise", tp_overlap="none", recompute="none", tokens=32)
    cases = [({"recipe": "rowwise"}, r"model.fp8 = 'rowwise' has no Transformer Engine recipe.*fp8_backend = 'tessel'"),
             ({"tp_overlap": "ring"}, r"parallel.tp_overlap = 'ring' with model.fp8_backend = 'te'.*set "
                                      r"parallel.tp_overlap = 'none'"),
             ({"recipe": "delayed", "recompute": "selective"}, r"delayed.*activation_checkpointing = 'selective'.*"
                                                               r"own checkpoint wrapper"),
             ({"tokens": 24}, r"\(= 24 rows per FP8 GEMM\) to be a multiple of 16"),
             ({"generates": True}, r"posttrain.method = 'grpo' with model.fp8_backend = 'te'.*fp8_backend = 'tessel'")]
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            check_te_backend(**{**ok, **change})
    with fake_te():  # the same order: the config's own refusals before the import
        check_te_backend(**ok)
        check_te_backend(**{**ok, "recipe": "delayed"})


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine installed")
def test_te_backend_without_te_names_the_install_and_the_alternative():
    from parallel.tensor_parallel.fp8_te import check_te_backend

    with pytest.raises(ValueError, match=r"needs Transformer Engine, which cannot be imported here .*pip install.*"
                                         r"or set model.fp8_backend = 'tessel'"):
        check_te_backend(recipe="tensorwise", tp_overlap="none", recompute="none", tokens=32)


def test_te_recipes_map_to_te_classes():
    from parallel.tensor_parallel.fp8_te import te_recipe

    with fake_te():
        from transformer_engine.common.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                                                      Format, MXFP8BlockScaling)

        assert te_recipe("tensorwise") == Float8CurrentScaling(fp8_format=Format.HYBRID)
        assert te_recipe("delayed", history_len=7, margin=1, reduce_amax=False) == DelayedScaling(
            fp8_format=Format.HYBRID, amax_history_len=7, margin=1, amax_compute_algo="max", reduce_amax=False)
        assert te_recipe("blockwise") == Float8BlockScaling(fp8_format=Format.HYBRID)
        assert te_recipe("mxfp8") == MXFP8BlockScaling(fp8_format=Format.HYBRID)
        with pytest.raises(ValueError, match="rowwise"):
            te_recipe("rowwise")
        import transformer_engine.common.recipe as r

        del r.Float8BlockScaling  # a TE older than 2.3
        with pytest.raises(ImportError, match=r"lacks.*block scaling in 2.3, MXFP8 in 2.0\); upgrade TE, or set "
                                              r"model.fp8_backend"):
            te_recipe("blockwise")


def test_mxfp8_is_refused_on_a_gpu_before_blackwell(monkeypatch):
    """TE runs MXFP8 on sm_100 and newer only: a visible Hopper is refused with both ways out."""
    from parallel.tensor_parallel.fp8_te import check_te_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cap in ((9, 0), (12, 0)):  # Hopper; consumer Blackwell, which TE's MXFP8 does not run on either
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, cap=cap: cap)
        with fake_te(), pytest.raises(ValueError, match=rf"\(sm_100/sm_103\) only, and this GPU is sm_{cap[0]}0; "
                                                        r"use model.fp8 = 'blockwise'.*model.fp8_backend = 'tessel'"):
            check_te_backend(recipe="mxfp8", tp_overlap="none", recompute="none", tokens=32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    with fake_te():
        check_te_backend(recipe="mxfp8", tp_overlap="none", recompute="none", tokens=32)  # accepted
        with pytest.raises(ValueError, match=r"\(= 48 rows per FP8 GEMM\) to be a multiple of 32"):
            check_te_backend(recipe="mxfp8", tp_overlap="none", recompute="none", tokens=48)


def test_mxfp8_on_te_needs_linears_in_multiples_of_32():
    """TE's MXFP8 quantiser blocks K and N by 32: fc2's TP-local K of 352 / 2 = 176 is refused before any
    process group (Tessel's own mxfp8 gives a ragged last block its own scale and takes it)."""
    from engine.config import load_config
    from models.hook import ModelHook

    sets = ["model.fp8=mxfp8", "parallel.tp=2", "parallel.pp=1"]
    ModelHook.from_run_config(load_config("tiny_llama_cpu", sets), tokenizer_vocab=None)  # tessel: fine
    with fake_te(), pytest.raises(ValueError, match=r"mlp.fc2 .*in_features \(K\)=176; .*multiple of 32"):
        ModelHook.from_run_config(load_config("tiny_llama_cpu", sets + ["model.fp8_backend=te"]), tokenizer_vocab=None)


def test_delayed_at_tp1_reduces_no_amax_and_warns_that_checkpoints_lack_te_histories():
    """With one TP rank TE must not reduce amaxes (its default group would be the whole world)."""
    from parallel.comm import Group
    from parallel.tensor_parallel.fp8_te import apply_te_fp8

    g = torch.Generator().manual_seed(3)
    w1, w2, b1, b2 = torch.randn(F, H, generator=g), torch.randn(H, F, generator=g), torch.zeros(F), torch.zeros(H)
    with fake_te():
        m = _mlp(Group.trivial("tp"), w1, w2, b1, b2, False, te=False)
        with pytest.warns(UserWarning, match="not in Tessel's checkpoints, so a resumed run starts them afresh"):
            assert apply_te_fp8(m, "delayed", history_len=4) == ["fc1", "fc2"]
        region = m["fc1"].impl.region
        assert region is m["fc2"].impl.region and not region.recipe.reduce_amax and region.recipe.amax_history_len == 4


# -- TP = 2 MLP against the high-precision path -------------------------------------------------------
def _mlp(tp, w1, w2, b1, b2, sp, *, te: bool):
    from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from parallel.tensor_parallel.layers import DefaultLinearImpl

    impl = DefaultLinearImpl(regather_sp_input=False)
    m = torch.nn.ModuleDict({
        "fc1": ColumnParallelLinear(H, F, tp_group=tp, sequence_parallel=sp, init_method=lambda t: t.copy_(w1),
                                    impl=impl),
        "fc2": RowParallelLinear(F, H, tp_group=tp, sequence_parallel=sp, init_method=lambda t: t.copy_(w2),
                                 impl=impl)})
    cols = slice(tp.rank * F // tp.size, (tp.rank + 1) * F // tp.size)
    with torch.no_grad():
        m["fc1"].bias.copy_(b1[cols])
        m["fc2"].bias.copy_(b2)
    if te:
        from parallel.tensor_parallel.fp8_te import apply_te_fp8

        assert apply_te_fp8(m, "tensorwise") == ["fc1", "fc2"]
    return m


def _step(m, x, dy):
    xi = x.clone().requires_grad_()
    y = m["fc2"](torch.relu(m["fc1"](xi)))
    (y * dy).sum().backward()
    return [y.detach(), xi.grad] + [p.grad for p in m.parameters()]


def _mlp_worker():
    import torch.distributed as dist

    from parallel.mesh import Mesh, ParallelDims

    mesh = Mesh.build(ParallelDims.for_world(dist.get_world_size(), tp=2))
    tp, r = mesh.tp, mesh.tp.rank
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    w1, w2 = torch.randn(F, H, generator=g) * 0.1, torch.randn(H, F, generator=g) * 0.1
    b1, b2 = torch.randn(F, generator=g), torch.randn(H, generator=g)
    out = {}
    with fake_te() as te:
        for sp in (False, True):
            chunk = slice(r * S // 2, (r + 1) * S // 2) if sp else slice(None)
            got, led = {}, {}
            for kind in ("plain", "te"):
                m = _mlp(tp, w1, w2, b1, b2, sp, te=kind == "te")
                te.CALLS.clear()
                with tp.ledger.capture() as cap:
                    got[kind] = _step(m, x[chunk], dy[chunk])
                led[kind] = sorted((c.op, c.axis, c.payload_bytes, c.dtype) for c in cap.records)
            out[sp] = {
                "rel": [math.inf if a is None or b is None else ((a - b).abs().max() / b.abs().max()).item()
                        for a, b in zip(got["te"], got["plain"])],
                "ledger_equal": led["te"] == led["plain"], "ledger": led["te"],
                "calls": [(type(rec).__name__, grp is tp.pg, shape) for _, rec, grp, shape in te.CALLS],
                "weights_shared": all(mod.impl.module.weight is mod.weight for mod in m.values()),
            }
        from parallel.tensor_parallel.fp8_te import apply_te_fp8

        m = _mlp(tp, w1, w2, b1, b2, False, te=False)
        apply_te_fp8(m, "delayed")
        out["delayed_reduces"] = m["fc1"].impl.region.recipe.reduce_amax
    return out


@pytest.fixture(scope="module")
def mlp_results():
    return run_distributed(_mlp_worker, 2, timeout=180)


@pytest.mark.parametrize("sp", [False, True])
def test_te_tp2_mlp_equals_the_high_precision_path_with_the_same_bytes(mlp_results, sp):
    for res in mlp_results:
        r = res[sp]
        assert max(r["rel"]) < 1e-6, r["rel"]
        assert r["ledger_equal"] and r["ledger"], r["ledger"]
        assert r["weights_shared"]
        # TE sees whole sequences: the column linear's input gathered (SP) or replicated, the row linear's
        # TP-local input; its output is reduce-scattered (SP) or all-reduced by Tessel after the GEMM
        assert r["calls"] == [("Float8CurrentScaling", True, (S, B, H)), ("Float8CurrentScaling", True, (S, B, F // 2))]
        assert res["delayed_reduces"]  # over the TP group (given to every region)


# -- the whole model through the assembly line ---------------------------------------------------------
SEQ, VOCAB = 16, 256
ARCH = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_key_value_heads=2",
        "model.ffn_hidden_size=96", f"model.vocab_size={VOCAB}", "model.max_position_embeddings=64"]


def _cfg(extra=()):
    from engine.config import load_config

    return load_config("tiny_llama_cpu", [
        *ARCH, "parallel.tp=1", "parallel.pp=1", "parallel.dp=-1", "train.steps=2", "train.global_batch_size=2",
        "train.micro_batch_size=1", f"train.seq_length={SEQ}", "optim.lr=0.01", "optim.warmup_steps=0",
        "logging.progress_bar=off", "logging.tensorboard=false", "logging.jsonl=false", "logging.peak_tflops=1.0",
        "train.eval_interval=0", *extra])


def _train(cfg):
    from engine.assembly import build_run
    from models.hook import ModelHook

    model = ModelHook.from_run_config(cfg, tokenizer_vocab=None)
    run = build_run(cfg, model=model, train_data=RandomTokens(6, vocab=VOCAB, seq=SEQ, seed=70), checkpoints=False)
    losses = [run.trainer.train_step(run.train_loader).loss for _ in range(2)]
    return run, losses + [run.trainer.evaluate(run.train_loader, 1)]


def test_te_backend_through_the_assembly_line_equals_the_plain_model():
    from parallel.tensor_parallel.fp8_te import TeLinearImpl

    plain, ref = _train(_cfg())
    with fake_te() as te:
        run, got = _train(_cfg(["model.fp8=tensorwise", "model.fp8_backend=te",
                                "model.fp8_exclude=['layers.1.mlp.fc2']"]))
        calls, opened = list(te.CALLS), list(te.OPENED)
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-6, (got, ref)
    stage = run.trainer.chunks[0]
    impls = {n: m.impl for n, m in stage.named_modules() if isinstance(getattr(m, "impl", None), TeLinearImpl)}
    assert sorted(impls) == sorted(f"layers.{i}.{rel}" for i in (0, 1)
                                   for rel in ("attention.qkv", "attention.out", "mlp.fc1", "mlp.fc2")
                                   if (i, rel) != (1, "mlp.fc2"))
    assert all(impl.module.weight is stage.get_submodule(n).weight for n, impl in impls.items())
    sd_plain, sd_te = plain.trainer.chunks[0].state_dict(), stage.state_dict()
    assert list(sd_te) == list(sd_plain)  # no TE keys: the TE modules are not submodules
    # 7 TE linears x (2 steps + 1 evaluation batch, 2 micro-batches each) forwards, each in its own region
    assert len(calls) == 7 * 6 and {type(rec).__name__ for _, rec, _, _ in calls} == {"Float8CurrentScaling"}
    # one region per forward of the stage (micro-batch), not per linear: TE's delayed scaling reduces and
    # rolls its amax histories at each region's exit
    assert len(opened) == 6 and all(rec is opened[0][0] and grp is None for rec, grp in opened)
    assert run.trainer.precision == "fp8-tensorwise-te/fp32"


def test_te_backend_under_activation_recompute_opens_a_region_per_recomputed_call():
    """Full recompute re-runs each layer inside the backward, outside the stage's region: each recomputed
    TE call opens its own (the fake refuses a call outside any region), and the run equals the plain one."""
    recompute = ["train.activation_checkpointing=full"]
    _, ref = _train(_cfg(recompute))
    with fake_te() as te:
        _, got = _train(_cfg(["model.fp8=tensorwise", "model.fp8_backend=te", *recompute]))
        calls, opened = len(te.CALLS), len(te.OPENED)
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-6, (got, ref)
    # 8 linears: 6 forwards (2 steps x 2 micro-batches, 2 evaluation) + 4 recomputed (training only)
    assert calls == 8 * 10 and opened == 6 + 8 * 4


# -- a real Transformer Engine (skips without it) ---------------------------------------------------------
@pytest.mark.gpu
def test_real_te_linear_trains_close_to_tessels_own_fp8():
    """With TE installed on a GPU: the TE-backed MLP's forward and gradients stay within FP8's error of the
    same MLP on Tessel's own tensorwise FP8 (bf16 inputs: 10% relative in norm covers e4m3/e5m2 rounding
    of both; the two quantise the same tensors with per-tensor current scales)."""
    pytest.importorskip("transformer_engine.pytorch")
    if not torch.cuda.is_available():
        pytest.skip("Transformer Engine needs a CUDA GPU")
    from parallel.comm import Group
    from parallel.tensor_parallel.fp8 import apply_fp8

    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    w1, w2 = torch.randn(F, H, generator=g) * 0.1, torch.randn(H, F, generator=g) * 0.1
    b1, b2 = torch.randn(F, generator=g), torch.randn(H, generator=g)
    one = Group.trivial("tp")
    res = {}
    for kind in ("te", "tessel"):
        m = _mlp(one, w1, w2, b1, b2, False, te=kind == "te").cuda()
        if kind == "tessel":
            apply_fp8(m, "tensorwise")
        res[kind] = _step(m, x.cuda(), dy.cuda())
    for a, b in zip(res["te"], res["tessel"]):
        assert ((a - b).norm() / b.norm()).item() < 0.1
