"""Training a mixture-of-experts model with expert parallelism through the trainer (engine.assembly.build_run).

* Parity (fp32, dropless, aux loss on): a tiny Mixtral trained 3 steps at ep=2 (dp=4, so ep < dp and the
  expert gradients reduce over edp = 2 ranks), ep=4 (allgather dispatcher), ep2 x tp2 (with SP) and
  ep2 x pp2, all on 4 gloo ranks, against one process on the same global batch: every step's loss and
  gradient norm within 1e-5 (relative), and the last step's reduced gradients (``main_grad``, assembled from
  every rank's shards by their checkpoint layouts) and the final parameters within 1e-5 (absolute;
  the values are O(1e-2)). The gradient norm counts each expert once (summed over ep, not dp).
* Checkpoints: the ep2 x tp2 run saves; the same 4 ranks load it at ep=4 (tp1) and one process loads it at
  ep=1: parameters and Adam moments bitwise equal to what was saved, so checkpoints reshard across ep.
  tools/evaluate.py scores that checkpoint at --ep 2 --tp 2: loss and logits equal one process's (1e-5).
* Aux-loss-free balancing (``parallel.moe_bias_update_rate=0.01``, on in every run): the routers' biases after
  3 steps bitwise equal one process's, saved and resharded with the checkpoint, read by tools/evaluate.py;
  tessel-to-hf refuses such a checkpoint (Hugging Face has no tensor for them).
* Metrics: each step's per-layer expert load (min, max, CV), aux loss and dropped share (metrics.jsonl's
  ``moe.*`` keys), reduced over pp and dp, equal one process's.
* Bad input, before any process group: experts not divisible by ep, ep on a dense model, ep not dividing
  dp, ep with ZeRO, ep with cp, ep with gradient compression, an unknown dispatcher, a negative bias rate;
  top-k above the number of experts (when config.json is read).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from engine.data.synthetic import RandomTokens
from parallel.testing import run_distributed

SEQ, VOCAB, STEPS = 16, 64, 3
HF = {"model_type": "mixtral", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
      "vocab_size": VOCAB, "max_position_embeddings": 64, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
      "tie_word_embeddings": False, "router_aux_loss_coef": 0.02}
RTOL = ATOL = 1e-5

LAYOUTS = {  # name: overrides (4 ranks)
    "ep2_dp4": ["parallel.ep=2"],
    "ep4_allgather": ["parallel.ep=4", "parallel.moe_dispatcher=allgather"],
    "ep2xtp2": ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "ep2xpp2": ["parallel.ep=2", "parallel.pp=2"],
}


def _tokens(n: int) -> RandomTokens:
    return RandomTokens(n, vocab=VOCAB, seq=SEQ, seed=90)


def _config(extra=()):
    from engine.config import load_config

    return load_config("tiny_llama_cpu", [
        "parallel.tp=1", "parallel.pp=1", "parallel.dp=-1", "parallel.sequence_parallel=false",
        f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=1", f"train.seq_length={SEQ}",
        "optim.lr=0.001", "optim.warmup_steps=0", "optim.distributed=false", "logging.progress_bar=off",
        "logging.tensorboard=false",
        "logging.jsonl=false", "logging.peak_tflops=1.0", "train.eval_interval=0",
        "parallel.moe_bias_update_rate=0.01", *extra])


def _build(extra=(), run_dir=None):
    from engine.assembly import build_run
    from models.hook import ModelHook

    cfg = _config(extra)
    model = ModelHook.from_hf(HF, dtype=torch.float32, seed=cfg.train.seed,
                              sequence_parallel=cfg.parallel.sequence_parallel,
                              moe_dispatcher=cfg.parallel.moe_dispatcher,
                              moe_bias_update_rate=cfg.parallel.moe_bias_update_rate)
    return build_run(cfg, model=model, train_data=_tokens(8 * (STEPS + 1)), run_dir=run_dir,
                     checkpoints=run_dir is not None)


def _pieces(run, what: str) -> list:
    """This rank's pieces (key, global shape, offset, tensor) of every parameter (``what="param"``), its
    reduced gradient (``"grad"``) or an Adam moment (``"exp_avg"``), placed by the checkpoint layouts
    (replicas included, so every piece is checked)."""
    from engine.checkpoint.layouts import ShardingContext, module_layouts

    tr = run.trainer
    layouts = module_layouts(tr.chunks, ctx=ShardingContext.from_mesh(run.mesh), hook=tr.param_spec)
    params = dict(tr.chunks.named_parameters())
    moments = {}
    if what == "exp_avg":
        moments = {id(pc.param): (pc.lo, pc.hi, pc.exp_avg) for pc in tr.optimizer.dist.pieces}
    out = []
    for name, layout in layouts.items():
        p = params[name]
        if what == "param":
            t = p.detach()
        elif what == "grad":
            t = p.main_grad
        else:  # zero_stage 0: each rank holds its parameters' whole moment
            lo, hi, m = moments[id(p)]
            assert (lo, hi) == (0, p.numel()), name
            t = m.view(p.shape)  # (local shape)
        for st in layout.sharded(t.detach().clone()):
            out.append((st.key, tuple(st.global_shape), tuple(st.global_offset), st.data.clone()))
    return out


def _assemble(pieces: list) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for key, shape, off, data in pieces:
        t = full.setdefault(key, torch.full(shape, float("nan")))
        if t.shape != shape:  # vocab padding differs by tp: keep the larger
            assert len(shape) == t.dim()
            if shape[0] > t.shape[0]:
                t = full[key] = torch.cat([t, torch.full((shape[0] - t.shape[0], *shape[1:]), float("nan"))])
        idx = tuple(slice(o, o + n) for o, n in zip(off, data.shape))
        t[idx] = data
    return full


def _train(extra=()):
    run = _build(extra)
    stats = [run.trainer.train_step(run.train_loader) for _ in range(STEPS)]
    return {"loss": [s.loss for s in stats], "norm": [s.grad_norm for s in stats], "extra": [s.extra for s in stats],
            "grad": _pieces(run, "grad"), "param": _pieces(run, "param"), "bias": _biases(run)}


def _biases(run) -> dict[str, torch.Tensor]:
    """The routers' aux-loss-free balancing biases of this rank's stages, by global name."""
    return {name.split(".", 1)[1]: b.clone() for name, b in run.trainer.chunks.named_buffers()
            if name.endswith("expert_bias")}


def _parts(tmp: str):
    out = {}
    for name, extra in LAYOUTS.items():
        out[name] = _train(extra)
        dist.barrier()
    # Checkpoints: save at ep2 x tp2, load at ep4 (tp1) on the same 4 ranks.
    from engine.checkpoint.trainer_state import load_trainer

    run = _build(LAYOUTS["ep2xtp2"], run_dir=tmp)
    for _ in range(2):
        run.trainer.train_step(run.train_loader)
    run.save()
    run.checkpointer.finalize()
    out["saved"] = {"param": _pieces(run, "param"), "exp_avg": _pieces(run, "exp_avg"), "bias": _biases(run)}
    dist.barrier()
    run4 = _build(["parallel.ep=4"])
    load_trainer(run4.trainer, run.checkpointer.latest(), group=run4.mesh.world)
    out["loaded_ep4"] = {"param": _pieces(run4, "param"), "exp_avg": _pieces(run4, "exp_avg"), "bias": _biases(run4)}
    out["latest"] = str(run.checkpointer.latest())
    dist.barrier()
    # tools/evaluate.py at ep2 x tp2 (dp = ep: both ep ranks score the same sequences) on that checkpoint.
    from tools.evaluate import run_evaluate

    out["eval"] = run_evaluate(["--ckpt", out["latest"], "--ep", "2", "--tp", "2", "--tokens", f"{tmp}/ids.json",
                                "--dump-logits", f"{tmp}/logits_ep2.safetensors"])["loss"]
    return out


def _close(a: dict, b: dict, what: str, *, bitwise: bool = False) -> float:
    assert set(a) == set(b), (what, set(a) ^ set(b))
    worst = 0.0
    for k in a:
        x, y = a[k], b[k]
        n = min(x.shape[0], y.shape[0])  # vocab padding
        x, y = x[:n], y[:n]
        assert not x.isnan().any() and not y.isnan().any(), (what, k, "a piece is missing")
        if bitwise:
            assert torch.equal(x, y), (what, k)
        else:
            worst = max(worst, (x - y).abs().max().item())
            assert torch.allclose(x, y, rtol=0, atol=ATOL), (what, k, (x - y).abs().max().item())
    return worst


def test_expert_parallel_training_equals_one_process(tmp_path):
    (tmp_path / "ids.json").write_text(json.dumps([[int(x) for x in _tokens(1)[0]["tokens"]], list(range(9))]))
    ref = _train()
    ref_grad, ref_param = _assemble(ref["grad"]), _assemble(ref["param"])
    assert all(math.isfinite(x) for x in ref["loss"] + ref["norm"])
    for extra in ref["extra"]:  # metrics.jsonl's MoE keys: both layers, dropless, a real imbalance
        assert sorted(extra) == sorted(f"moe.{i}.{k}" for i in (0, 1) for k in
                                       ("load_min", "load_max", "load_cv", "aux_loss", "dropped")) + ["moe.load_cv_max"]
        assert all(extra[f"moe.{i}.load_min"] <= 1.0 <= extra[f"moe.{i}.load_max"] for i in (0, 1))
        assert extra["moe.0.dropped"] == 0.0 and extra["moe.load_cv_max"] > 0
    results = run_distributed(_parts, 4, str(tmp_path), timeout=400)
    report = {}
    for name in LAYOUTS:
        for rank, res in enumerate(results):
            r = res[name]
            for key in ("loss", "norm"):
                for a, b in zip(r[key], ref[key]):
                    assert abs(a - b) <= RTOL * abs(b), (name, rank, key, r[key], ref[key])
            for got, want in zip(r["extra"], ref["extra"]):  # the load summed over pp and dp = one process's
                assert got.keys() == want.keys() and all(abs(got[k] - want[k]) <= 1e-9 + 1e-6 * abs(want[k])
                                                         for k in want), (name, rank, got, want)
        pieces = lambda what: _assemble([p for res in results for p in res[name][what]])  # noqa: E731
        report[name] = (_close(pieces("grad"), ref_grad, f"{name} grad"),
                        _close(pieces("param"), ref_param, f"{name} param"))
        bias = {k: v for res in results for k, v in res[name]["bias"].items()}  # every replica holds the same
        assert bias.keys() == ref["bias"].keys() and all(torch.equal(bias[k], ref["bias"][k]) for k in bias), name
    print("\nmax |grad - ref|, max |param - ref| per layout:", report)

    # Resharding: what ep2 x tp2 saved is what ep4 loaded, and what one process (ep1) loads.
    saved = {w: _assemble([p for res in results for p in res["saved"][w]]) for w in ("param", "exp_avg")}
    loaded = {w: _assemble([p for res in results for p in res["loaded_ep4"][w]]) for w in ("param", "exp_avg")}
    for w in saved:
        _close(loaded[w], saved[w], f"ep4 load {w}", bitwise=True)
    saved_bias = results[0]["saved"]["bias"]
    assert any(b.abs().sum() > 0 for b in saved_bias.values())  # the balancing moved them
    assert all(torch.equal(r["loaded_ep4"]["bias"][k], saved_bias[k]) for r in results for k in saved_bias)
    from engine.checkpoint.trainer_state import load_trainer

    one = _build()
    load_trainer(one.trainer, results[0]["latest"], group=None)
    for w in saved:
        _close(_assemble(_pieces(one, w)), saved[w], f"ep1 load {w}", bitwise=True)
    assert all(torch.equal(b, saved_bias[k]) for k, b in _biases(one).items())
    from tools.convert_checkpoint import tessel_to_hf

    with pytest.raises(ValueError, match="aux-loss-free balancing biases"):  # HF has no tensor for them
        tessel_to_hf(results[0]["latest"], tmp_path / "hf")

    # Evaluation at ep2 x tp2 equals one process's (loss and every logit, fp32).
    from safetensors.torch import load_file

    from tools.evaluate import run_evaluate

    loss = run_evaluate(["--ckpt", results[0]["latest"], "--tokens", str(tmp_path / "ids.json"),
                         "--dump-logits", str(tmp_path / "logits_ep1.safetensors")])["loss"]
    assert all(abs(r["eval"] - loss) <= RTOL * loss for r in results), ([r["eval"] for r in results], loss)
    a, b = load_file(tmp_path / "logits_ep1.safetensors"), load_file(tmp_path / "logits_ep2.safetensors")
    assert sorted(a) == sorted(b) == ["logits.0", "logits.1"]
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=ATOL) for k in a)


@pytest.mark.parametrize("extra, hf, world, message", [
    (["parallel.ep=3"], HF, 3, "num_experts=4 is not divisible by parallel.ep=3"),
    (["parallel.ep=2"], {**HF, "model_type": "llama"}, 4, "has none"),
    (["parallel.ep=2", "parallel.dp=3"], HF, 3, "parallel.ep=2 does not divide dp*cp"),
    (["parallel.ep=2", "optim.distributed=true"], HF, 4, "ZeRO sharding of the expert"),
    (["parallel.ep=2", "parallel.cp=2"], HF, 4, "context parallelism is not built"),
    (["parallel.moe_dispatcher=broadcast"], HF, 4, "parallel.moe_dispatcher='broadcast' is not valid"),
    (["parallel.ep=2", "optim.grad_compression=onebit"], HF, 4, "expert gradients must reduce over edp"),
    (["parallel.moe_bias_update_rate=-1"], HF, 4, "parallel.moe_bias_update_rate=-1.0 must be >= 0"),
])
def test_bad_expert_parallel_config_is_refused_before_any_group(extra, hf, world, message):
    from engine.assembly import build_run
    from models.hook import ModelHook

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(")):
        cfg = _config(["train.global_batch_size=12", *extra])
        build_run(cfg, model=ModelHook.from_hf(hf, dtype=torch.float32), world=world, data=False, checkpoints=False)
    assert not dist.is_initialized()


def test_top_k_above_experts_is_refused():
    from models.hook import ModelHook

    with pytest.raises(ValueError, match="exceeds num_experts=4"):
        ModelHook.from_hf({**HF, "num_experts_per_tok": 5})
