"""Training a mixture-of-experts model with expert parallelism through the trainer (engine.assembly.build_run).

* Parity (fp32, dropless, aux loss on): a tiny Mixtral trained 3 steps on 4 gloo ranks at ep=2 (dp=4, so
  ep < dp and the expert gradients reduce over edp = 2 ranks) with the plain optimizer and with ZeRO-1
  (also with overlap_param_gather), 2 and 3 (each set sharded within its own group: dense over dp, experts
  over edp), ep=4 (allgather dispatcher), ep2 x tp2 (with SP; also at expert_tp=1: whole experts, each tp rank
  routing its own chunk, and so a Qwen2-MoE with its shared expert against its own one-process run), ep2 x pp2,
  cp2 (ep1: the aux loss's expert counts summed over cp; also cp2 x tp2 at expert_tp=1, summed over both) and
  dp2 x cp2 x ep2 under ZeRO-1 (edp = the 2 cp ranks); and on 8 ranks at dp4 x tp2 (SP; also at expert_tp=1 under ZeRO-2) and dp4 x pp2 (ZeRO-2) with ep=2;
  against one process on the same global batch: every step's loss and gradient norm within
  1e-5 (relative), and the last step's reduced gradients (``main_grad``, or the ZeRO shards, assembled from
  every rank's pieces by their checkpoint layouts) and the final parameters within 1e-5 (absolute; the
  values are O(1e-2)). The gradient norm counts each expert once (summed over ep, not dp; under ZeRO over
  dp, where each rank holds distinct expert shards).
* ZeRO bytes: the last step's ledger under ZeRO-1/2 at ep2 x dp4 is, exactly, a reduce-scatter of 4 bytes per
  padded gradient element and an all-gather of the parameters of the dense buffer over dp (4 ranks) and of
  the expert buffer over edp (2 ranks), the padded sizes from engine.memory.dp_buffer_numel. Under ZeRO-3
  (at ep2 x dp4, also with full recompute, and on 8 ranks at dp4 x tp2 x ep2 with expert_tp=1, also ZeRO-2)
  the reduce-scatters run once per micro-batch and the all-gathers, per set, are every bucket of every unit
  before each micro-batch's forward and every layer's again before its backward: (p-1) x shard bytes each,
  bytes and counts exact, the buckets derived from the parameter sizes (the experts' by hand, E/ep x 3hf).
  Every layout's parameter, gradient and optimizer-state bytes equal the memory plan's (engine/memory.py).
* bf16 (``model.dtype=bf16``) at ep2 x dp4 under ZeRO-2 and ZeRO-3 against the one-process bf16 run: losses
  within 1e-4, gradient norms 5e-4, the last step's gradients 4e-2 and the fp32 masters 5e-3 (relative; why,
  in the test); parameters bf16, masters, moments and gradient shards fp32 over 1/dp and 1/edp of the sets, the
  masters rounding to the parameters bitwise; the all-gathers 2 bytes per element.
* Checkpoints: the ep2 x tp2 run saves; the same 4 ranks load it at ep=4 under ZeRO-3 and at expert_tp=1, one
  process loads it at ep=1; the ep2 x tp2 expert_tp=1 run saves, the 4 ranks load it at expert_tp=2 and one
  process at ep=1; the ep2 x dp4 ZeRO-2 run saves; the 4 ranks load it at ep=4 under ZeRO-1 and one process at
  ep=1 with the plain optimizer; one process loads the ep2 x dp4 ZeRO-3 run's checkpoint: parameters and
  Adam moments bitwise equal to what was saved, so checkpoints reshard across ep, expert_tp and ZeRO stages.
  tools/evaluate.py scores the ep2 x tp2 checkpoint at --ep 2 --tp 2, also with whole experts (--set
  parallel.expert_tp=1, sequence parallel): loss and logits equal one process's (1e-5).
* Hugging Face oracle on 8 ranks: tiny Mixtral, Qwen2-MoE and Qwen3-MoE (tests/models/test_moe.py's) converted
  at ep2 x tp2 x pp2 and evaluated by tools/evaluate.py --ep 2 --tp 2 --pp 2 (Qwen2-MoE also converted and
  evaluated at expert_tp=1): logits equal transformers' (fp32, 1e-5).
* Aux-loss-free balancing (``parallel.moe_bias_update_rate=0.01``, on in every run): the routers' biases after
  3 steps bitwise equal one process's, saved and resharded with the checkpoint, read by tools/evaluate.py;
  tessel-to-hf refuses such a checkpoint (Hugging Face has no tensor for them).
* Metrics: each step's per-layer expert load (min, max, CV), aux loss and dropped share (metrics.jsonl's
  ``moe.*`` keys), reduced over pp and dp, equal one process's.
* Bad input, before any process group: experts not divisible by ep, ep on a dense model, ep not dividing
  dp (also where it divides dp x cp), ep with gradient compression, an unknown dispatcher, a negative bias
  rate, expert_tp=1 at tp2 without SP, expert_tp=3 at tp2, expert_tp on a dense model; top-k above the number
  of experts (when config.json is read).
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

ZERO = {k: ["optim.distributed=true", f"optim.zero_stage={k}"] for k in (1, 2, 3)}
# expert_tp=1: whole experts on both tp ranks, each routing its own sequence chunk
ETP1 = ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.expert_tp=1"]
LAYOUTS = {  # name: overrides (4 ranks)
    "ep2_dp4": ["parallel.ep=2"],
    "ep2_dp4_zero1": ["parallel.ep=2", *ZERO[1]],
    "ep2_dp4_zero2": ["parallel.ep=2", *ZERO[2]],
    "ep2_dp4_zero3": ["parallel.ep=2", *ZERO[3]],
    # full recompute: each layer's forward replayed in its backward, under the backward's ZeRO-3 gather
    "ep2_dp4_zero3_recompute": ["parallel.ep=2", *ZERO[3], "train.activation_checkpointing=full"],
    # the post-step gather waited for in forward pre-hooks: the experts' bare weight holders never run forward
    "ep2_dp4_zero1_overlap": ["parallel.ep=2", *ZERO[1], "optim.overlap_param_gather=true"],
    "ep4_allgather": ["parallel.ep=4", "parallel.moe_dispatcher=allgather"],
    "ep2xtp2": ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "ep2xpp2": ["parallel.ep=2", "parallel.pp=2"],
    # context parallelism: the aux loss's expert counts summed over cp; at ep2 the edp group is the 2 cp ranks
    "cp2": ["parallel.cp=2"],
    "ep2xcp2_zero1": ["parallel.ep=2", "parallel.cp=2", *ZERO[1]],
    "ep2xtp2_etp1": ETP1,
    # expert_tp=1 with context parallelism (ep1): the aux loss's counts summed over tp and cp
    "cp2xtp2_etp1": ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.expert_tp=1"],
}
LAYOUTS_8 = {  # dp (4) above ep (2), with tp2 or pp2
    "ep2xtp2_dp4": ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "ep2xpp2_dp4_zero2": ["parallel.ep=2", "parallel.pp=2", *ZERO[2]],
    # expert_tp=1 under ZeRO-2: the experts' gradients summed over tp, then reduce-scattered over edp (2 ranks)
    "ep2xtp2_dp4_etp1_zero2": [*ETP1, *ZERO[2]],
    # and under ZeRO-3: the whole experts gathered over edp per unit, the tp-sharded dense part over dp
    "ep2xtp2_dp4_etp1_zero3": [*ETP1, *ZERO[3]],
}
# bf16 parameters (fp32 masters, moments and reduced gradients) under ZeRO at ep2 x dp4 (4 ranks), against the
# one-process bf16 run.
BF16 = "model.dtype=bf16"
LAYOUTS_BF16 = {"bf16_ep2_dp4_zero2": ["parallel.ep=2", *ZERO[2], BF16],
                "bf16_ep2_dp4_zero3": ["parallel.ep=2", *ZERO[3], BF16]}
# A Qwen2-MoE (gated shared expert, sharded over tp also at expert_tp=1) trained at expert_tp=1 on 4 ranks.
HF_QWEN2 = {**{k: v for k, v in HF.items() if k != "num_local_experts"}, "model_type": "qwen2_moe", "num_experts": 4,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "norm_topk_prob": False}
LAYOUTS_QWEN2 = {"qwen2_ep2xtp2_etp1": ETP1}


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


def _build(extra=(), run_dir=None, hf=HF):
    from engine.assembly import build_run
    from models.hook import ModelHook

    cfg = _config(extra)
    model = ModelHook.from_hf(hf, dtype=torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32,
                              seed=cfg.train.seed, sequence_parallel=cfg.parallel.sequence_parallel,
                              moe_dispatcher=cfg.parallel.moe_dispatcher,
                              moe_bias_update_rate=cfg.parallel.moe_bias_update_rate, expert_tp=cfg.parallel.expert_tp,
                              recompute=cfg.train.activation_checkpointing)
    return build_run(cfg, model=model, train_data=_tokens(8 * (STEPS + 1)), run_dir=run_dir,
                     checkpoints=run_dir is not None)


def _pieces(run, what: str) -> list:
    """This rank's pieces (key, global shape, offset, tensor) of every parameter (``what="param"``), its
    reduced gradient (``"grad"``) or an Adam moment (``"exp_avg"``), placed by the checkpoint layouts
    (replicas included, so every piece is checked). Under ZeRO a rank holds only its shard of a gradient or
    moment: the elements it does not own are NaN, which :func:`_assemble` skips."""
    from engine.checkpoint.layouts import ShardingContext, module_layouts

    tr = run.trainer
    layouts = module_layouts(tr.chunks, ctx=ShardingContext.from_mesh(run.mesh), hook=tr.param_spec)
    params = dict(tr.chunks.named_parameters())
    owned: dict[int, torch.Tensor] = {}
    if what != "param":  # the optimizer's pieces: the reduced gradient (shard) and moments it updates
        for pc in tr.optimizer.dist.pieces:
            flat = owned.setdefault(id(pc.param), torch.full((pc.param.numel(),), float("nan")))
            flat[pc.lo:pc.hi] = getattr(pc, what)
    out = []
    for name, layout in layouts.items():
        p = params[name]
        if what == "param":
            t = p.detach()
        else:  # a parameter this rank owns no element of: all NaN
            t = owned.get(id(p), torch.full((p.numel(),), float("nan"))).view(p.shape)  # (local shape)
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
        t[idx] = torch.where(data.isnan(), t[idx], data)  # NaN: an element another rank's shard holds
    return full


def _train(extra=(), run_dir=None, hf=HF):
    from engine.memory import state_bytes

    run = _build(extra, run_dir=run_dir, hf=hf)
    tr, mesh = run.trainer, run.mesh
    stats = [tr.train_step(run.train_loader) for _ in range(STEPS - 1)]
    with mesh.ledger.capture() as cap:  # the last step's data-parallel bytes
        stats.append(tr.train_step(run.train_loader))
    dp_bytes = {(op, axis): (cap.total("sent_bytes", op=op, axis=g.axis), cap.count(op=op, axis=g.axis))
                for op in ("reduce_scatter", "all_gather") for axis, g in (("dp", mesh.dp_cp), ("edp", mesh.edp))}
    r = tr.memory.ranks[tr.pp_rank] if tr.memory is not None else None
    out = {"loss": [s.loss for s in stats], "norm": [s.grad_norm for s in stats], "extra": [s.extra for s in stats],
           "dp_bytes": dp_bytes, "state": (state_bytes(tr.chunks, tr.ddp, tr.optimizer),
                                           (r.params, r.grads, r.optimizer) if r is not None else None)}
    tr.ddp.finish_param_sync()  # overlap_param_gather: the last update's gather is still in flight
    with tr.ddp.gathered():  # ZeRO-3: the parameters' values (a collective); others: no-op
        out.update(grad=_pieces(run, "grad"), param=_pieces(run, "param"), bias=_biases(run))
        if run.cfg.model.dtype == "bf16":  # the fp32 masters, and the dtypes and groups of what ZeRO holds
            pieces = tr.optimizer.dist.pieces
            out.update(master=_pieces(run, "master"), param_dtypes={str(q.dtype) for q in tr.chunks.parameters()},
                       buffers=sorted((str(b.dtype), b.dp) for b in tr.ddp.flat_buffers),
                       state_dtypes={str(t.dtype) for pc in pieces for t in (pc.master, pc.grad, pc.exp_avg,
                                                                               pc.exp_avg_sq)},
                       owned=tr.optimizer.dist.owned_numel())
    if run_dir is not None:
        run.save()
        run.checkpointer.finalize()
        with tr.ddp.gathered():
            out["saved"] = {"param": _pieces(run, "param"), "exp_avg": _pieces(run, "exp_avg"), "bias": _biases(run)}
        out["latest"] = str(run.checkpointer.latest())
    return out


def _load(extra, path: str, hf=HF) -> dict:
    """Build at ``extra``, load the checkpoint ``path`` into it: its parameters, Adam moments and biases."""
    from engine.checkpoint.trainer_state import load_trainer

    run = _build(extra, hf=hf)
    load_trainer(run.trainer, path, group=run.mesh.world)
    with run.trainer.ddp.gathered():
        return {"param": _pieces(run, "param"), "exp_avg": _pieces(run, "exp_avg"), "bias": _biases(run)}


def _biases(run) -> dict[str, torch.Tensor]:
    """The routers' aux-loss-free balancing biases of this rank's stages, by global name."""
    return {name.split(".", 1)[1]: b.clone() for name, b in run.trainer.chunks.named_buffers()
            if name.endswith("expert_bias")}


def _parts(tmp: str):
    out = {}
    for name, extra in LAYOUTS.items():
        # Four runs save, each after its 3 steps: ep2 x tp2 (plain; also at expert_tp=1), ep2 x dp4 under ZeRO-2
        # and ZeRO-3.
        saves = name in ("ep2xtp2", "ep2xtp2_etp1", "ep2_dp4_zero2", "ep2_dp4_zero3")
        out[name] = _train(extra, run_dir=f"{tmp}/{name}" if saves else None)
        dist.barrier()
    for name, extra in LAYOUTS_BF16.items():
        out[name] = _train(extra)
        dist.barrier()
    for name, extra in LAYOUTS_QWEN2.items():
        out[name] = _train(extra, hf=HF_QWEN2)
    # Reshard on the same 4 ranks: the plain ep2 x tp2 checkpoint into ep4 under ZeRO-3 and into expert_tp=1,
    # the expert_tp=1 one into expert_tp=2, the ZeRO-2 ep2 one into ep4 under ZeRO-1.
    out["loaded_ep4"] = _load(["parallel.ep=4", *ZERO[3]], out["ep2xtp2"]["latest"])
    out["loaded_etp1"] = _load(ETP1, out["ep2xtp2"]["latest"])
    out["loaded_etp2"] = _load(LAYOUTS["ep2xtp2"], out["ep2xtp2_etp1"]["latest"])
    out["loaded_zero_ep4"] = _load(["parallel.ep=4", *ZERO[1]], out["ep2_dp4_zero2"]["latest"])
    dist.barrier()
    # tools/evaluate.py at ep2 x tp2 (dp = ep: both ep ranks score the same sequences) on that checkpoint, with
    # the experts sharded over tp and whole (expert_tp=1, sequence parallel: the 9-token sequence padded to 10).
    from tools.evaluate import run_evaluate

    out["eval"] = run_evaluate(["--ckpt", out["ep2xtp2"]["latest"], "--ep", "2", "--tp", "2", "--tokens",
                                f"{tmp}/ids.json", "--dump-logits", f"{tmp}/logits_ep2.safetensors"])["loss"]
    out["eval_etp1"] = run_evaluate(["--ckpt", out["ep2xtp2"]["latest"], "--ep", "2", "--tp", "2", "--set",
                                     "parallel.expert_tp=1", "--set", "parallel.sequence_parallel=true", "--tokens",
                                     f"{tmp}/ids.json", "--dump-logits", f"{tmp}/logits_etp1.safetensors"])["loss"]
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


@pytest.fixture(scope="module")
def reference():
    """The one-process run every layout is compared with."""
    ref = _train()
    assert all(math.isfinite(x) for x in ref["loss"] + ref["norm"])
    for extra in ref["extra"]:  # metrics.jsonl's MoE keys: both layers, dropless, a real imbalance
        assert sorted(extra) == sorted(f"moe.{i}.{k}" for i in (0, 1) for k in
                                       ("load_min", "load_max", "load_cv", "aux_loss", "dropped")) + ["moe.load_cv_max"]
        assert all(extra[f"moe.{i}.load_min"] <= 1.0 <= extra[f"moe.{i}.load_max"] for i in (0, 1))
        assert extra["moe.0.dropped"] == 0.0 and extra["moe.load_cv_max"] > 0
    return ref


def _check_parity(results: list, ref: dict, layouts: dict) -> dict:
    """Every rank's losses, norms, MoE metrics, biases and memory-plan state bytes; the assembled gradients
    and parameters against one process. Returns the worst differences per layout."""
    ref_grad, ref_param = _assemble(ref["grad"]), _assemble(ref["param"])
    report = {}
    for name in layouts:
        for rank, res in enumerate(results):
            r = res[name]
            for key in ("loss", "norm"):
                for a, b in zip(r[key], ref[key]):
                    assert abs(a - b) <= RTOL * abs(b), (name, rank, key, r[key], ref[key])
            for got, want in zip(r["extra"], ref["extra"]):  # the load summed over pp and dp = one process's
                assert got.keys() == want.keys() and all(abs(got[k] - want[k]) <= 1e-9 + 1e-6 * abs(want[k])
                                                         for k in want), (name, rank, got, want)
            held, planned = r["state"]  # parameters, gradients, optimizer state: allocated vs engine/memory.py
            assert held == planned, (name, rank, held, planned)
        pieces = lambda what: _assemble([p for res in results for p in res[name][what]])  # noqa: E731
        report[name] = (_close(pieces("grad"), ref_grad, f"{name} grad"),
                        _close(pieces("param"), ref_param, f"{name} param"))
        bias = {k: v for res in results for k, v in res[name]["bias"].items()}  # every replica holds the same
        assert bias.keys() == ref["bias"].keys() and all(torch.equal(bias[k], ref["bias"][k]) for k in bias), name
    print("\nmax |grad - ref|, max |param - ref| per layout:", report)
    return report


def _zero3_buckets(cfg, world: int, hf=HF) -> tuple[dict[str, int], list[tuple[str, str, int]]]:
    """Each set's group size (``"dp"``: dp x cp; ``"edp"``: dp x cp / ep) and the ZeRO-3 buckets of one rank as
    ``(set, unit, padded elements)`` (unit: a layer index, or ``"root"``), from the parameter sizes
    (engine.memory.stage_param_sizes: the model's parameter list, nothing built). DataParallel places a set's
    parameters in reverse registration order and starts a bucket where the unit changes (the tiny model is far
    below the 25 MB bucket size), so the root unit has two: the output layer with the final norm, and the
    embedding. Each bucket is padded to a multiple of its group size."""
    from engine.memory import stage_param_sizes
    from models.hook import ModelHook

    p = cfg.parallel
    assert p.pp == 1  # one stage: every unit on every rank
    model = ModelHook.from_hf(hf)
    sizes = stage_param_sizes(model, tp=p.tp, ep=p.ep, layer_range=(0, model.num_layers), pre_process=True,
                              post_process=True, expert_tp=p.expert_tp)
    dp = cfg.validate_world(world) * p.cp
    group = {"dp": dp, "edp": dp // p.ep}
    runs: list[list] = []  # [set, unit, elements] per bucket, in placement order
    per_layer_experts: dict[str, int] = {}
    for name, n, shared, expert in reversed(sizes):
        assert not shared  # untied: no embedding bucket of its own
        s, unit = "edp" if expert and p.ep > 1 else "dp", name.split(".")[1] if name.startswith("layers.") else "root"
        last = next((r for r in reversed(runs) if r[0] == s), None)
        if last is not None and last[1] == unit:
            last[2] += n
        else:
            runs.append([s, unit, n])
        if s == "edp":
            per_layer_experts[unit] = per_layer_experts.get(unit, 0) + n
    # The experts' part, by hand: E / ep experts of fc1 (2f x h) and fc2 (h x f) per layer, split over expert_tp.
    etp = p.tp if p.expert_tp in (None, p.tp) else 1
    h, f, e = hf["hidden_size"], hf["intermediate_size"], hf["num_local_experts"]
    assert per_layer_experts == {str(i): e // p.ep * 3 * h * f // etp for i in range(hf["num_hidden_layers"])}
    return group, [(s, u, -(-n // group[s]) * group[s]) for s, u, n in runs]


def _check_zero_bytes(results: list, extra: list, *, world: int = 4) -> None:
    """One step's data-parallel bytes (parallel/comm.py's cost table, per rank) at ep2: each set reduce-scattered
    (fp32 gradients: (p-1)/p x 4 bytes per padded element) and all-gathered (parameters: (p-1) x the shard's
    bytes) over its own group, the dense buffer over dp x cp, the expert one over edp; the padded sizes are the
    memory plan's. ZeRO-1/2 gather each set once, after the step. ZeRO-3 reduce-scatters once per micro-batch
    and gathers per unit: every unit before each micro-batch's forward, every layer again before its backward
    (the root unit - embedding, final norm, output layer - stays gathered from forward to backward); a full
    recompute replays the layer's forward inside its backward, under that same gather (no more bytes). Exact."""
    from engine.memory import dp_buffer_numel
    from models.hook import ModelHook

    cfg = _config(extra)
    zero, elem = cfg.optim.zero_stage, 2 if cfg.model.dtype == "bf16" else 4
    dense, expert, _, _ = dp_buffer_numel(cfg, ModelHook.from_hf(HF), world=world)
    dp = cfg.validate_world(world) * cfg.parallel.cp
    p = {"dp": dp, "edp": dp // cfg.parallel.ep}
    assert dense % p["dp"] == 0 and expert % p["edp"] == 0 and expert > 0 and p["edp"] > 1
    numel = {"dp": dense, "edp": expert}
    m = cfg.num_microbatches(cfg.validate_world(world)) if zero == 3 else 1
    want = {("reduce_scatter", s): (m * (p[s] - 1) / p[s] * 4 * numel[s], None) for s in p}
    if zero < 3:
        want.update({("all_gather", s): ((p[s] - 1) * elem * numel[s] // p[s], None) for s in p})
    else:
        group, buckets = _zero3_buckets(cfg, world)
        assert group == p and {s: sum(n for t, _, n in buckets if t == s) for s in p} == numel  # the plan's padding
        for s in p:
            passes = [(1 if u == "root" else 2, n) for t, u, n in buckets if t == s]  # forward (+ backward)
            want[("all_gather", s)] = (m * sum(k * (p[s] - 1) * (n // p[s]) * elem for k, n in passes),
                                       m * sum(k for k, _ in passes))  # bytes; one gather per bucket and pass
    for rank, res in enumerate(results):
        got = {k: (v[0], v[1] if want[k][1] is not None else None) for k, v in res["dp_bytes"].items()}
        assert got == want, (extra, rank, got, want)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """The one 4-rank launch (every 4-rank layout, fp32 and bf16, the checkpoints and evaluations): its directory
    and every rank's results."""
    tmp_path = tmp_path_factory.mktemp("moe4")
    (tmp_path / "ids.json").write_text(json.dumps([[int(x) for x in _tokens(1)[0]["tokens"]], list(range(9))]))
    return tmp_path, run_distributed(_parts, 4, str(tmp_path), timeout=400)


def test_expert_parallel_training_equals_one_process(reference, four_ranks):
    tmp_path, results = four_ranks
    ref = reference
    _check_parity(results, ref, LAYOUTS)
    _check_parity(results, _train(hf=HF_QWEN2), LAYOUTS_QWEN2)  # its own one-process reference
    for name in ("ep2_dp4_zero1", "ep2_dp4_zero2", "ep2_dp4_zero3", "ep2_dp4_zero3_recompute"):
        _check_zero_bytes([r[name] for r in results], LAYOUTS[name])
    assert all(v[0] == 0 for r in results for k, v in r["ep2_dp4"]["dp_bytes"].items())  # plain: all-reduces only

    # Resharding: what ep2 x tp2 (plain) saved is what ep4 (ZeRO-3) loaded, what expert_tp=1 loaded and what one
    # process (ep1) loads; what ep2 x tp2 at expert_tp=1 saved is what expert_tp=2 loaded and one process loads;
    # what ep2 x dp4 (ZeRO-2) saved is what ep4 (ZeRO-1) loaded and one process (ep1, plain) loads; what
    # ep2 x dp4 ZeRO-3 saved (parameter shards too) is what one process loads.
    from engine.checkpoint.trainer_state import load_trainer

    for src, dst in (("ep2xtp2", "loaded_ep4"), ("ep2xtp2", "loaded_etp1"), ("ep2xtp2_etp1", "loaded_etp2"),
                     ("ep2_dp4_zero2", "loaded_zero_ep4"), ("ep2_dp4_zero3", None)):
        saved = {w: _assemble([p for res in results for p in res[src]["saved"][w]]) for w in ("param", "exp_avg")}
        saved_bias = results[0][src]["saved"]["bias"]
        assert any(b.abs().sum() > 0 for b in saved_bias.values())  # the balancing moved them
        if dst is not None:
            loaded = {w: _assemble([p for res in results for p in res[dst][w]]) for w in ("param", "exp_avg")}
            for w in saved:
                _close(loaded[w], saved[w], f"{src} -> {dst} {w}", bitwise=True)
            assert all(torch.equal(r[dst]["bias"][k], saved_bias[k]) for r in results for k in saved_bias)
        if dst == "loaded_etp1":
            continue  # the one-process load of this checkpoint is the loaded_ep4 pair's
        one = _build()
        load_trainer(one.trainer, results[0][src]["latest"], group=None)
        for w in saved:
            _close(_assemble(_pieces(one, w)), saved[w], f"{src} -> ep1 {w}", bitwise=True)
        assert all(torch.equal(b, saved_bias[k]) for k, b in _biases(one).items())
    latest = results[0]["ep2xtp2"]["latest"]
    from tools.convert_checkpoint import tessel_to_hf

    with pytest.raises(ValueError, match="aux-loss-free balancing biases"):  # HF has no tensor for them
        tessel_to_hf(latest, tmp_path / "hf")

    # Evaluation at ep2 x tp2 equals one process's (loss and every logit, fp32).
    from safetensors.torch import load_file

    from tools.evaluate import run_evaluate

    loss = run_evaluate(["--ckpt", latest, "--tokens", str(tmp_path / "ids.json"),
                         "--dump-logits", str(tmp_path / "logits_ep1.safetensors")])["loss"]
    for key, dump in (("eval", "logits_ep2"), ("eval_etp1", "logits_etp1")):
        assert all(abs(r[key] - loss) <= RTOL * loss for r in results), (key, [r[key] for r in results], loss)
        a, b = load_file(tmp_path / "logits_ep1.safetensors"), load_file(tmp_path / f"{dump}.safetensors")
        assert sorted(a) == sorted(b) == ["logits.0", "logits.1"]
        assert all(a[k].shape == b[k].shape and torch.allclose(a[k], b[k], rtol=0, atol=ATOL) for k in a), dump


def _rel(got: dict, want: dict) -> float:
    """|got - want| / |want| over every element of every key (vocab padding rows dropped), in float64."""
    assert got.keys() == want.keys()
    num = den = 0.0
    for k, w in want.items():
        n = min(w.shape[0], got[k].shape[0])
        g, w = got[k][:n].double(), w[:n].double()
        assert not g.isnan().any() and not w.isnan().any(), (k, "a piece is missing")
        num, den = num + float(((g - w) ** 2).sum()), den + float((w ** 2).sum())
    return math.sqrt(num / den)


def test_bf16_expert_parallel_zero_equals_one_process_bf16(four_ranks):
    """bf16 parameters at ep2 x dp4 under ZeRO-2 and ZeRO-3 against the one-process bf16 run (plain optimizer).

    Tolerances (relative; bf16's unit roundoff u = 2^-8 = 3.9e-3): the two runs round differently only where the
    sums are grouped differently: an expert's bf16 weight gradient on its ep rank is one GEMM over the rows both
    ep ranks routed to it, rounded to bf16 once (one process rounds each micro-batch's share and sums them in
    fp32), and the fp32 reductions run in another order. After the first update some masters therefore round to
    the neighbouring bf16 value (one ulp), which moves the later steps a little. Measured over 3 steps: loss
    7.4e-6, gradient norm 5.2e-5, the last step's reduced gradients 4.1e-3 and the final fp32 masters 5.3e-4
    (whole model); bf16's own distance from fp32 on one process is larger (loss 1.7e-5, norm 1.2e-3). The bounds
    are about ten times the measured: loss 1e-4, norm 5e-4, gradients 4e-2, masters 5e-3, well below what one
    step changes (the loss by about 8e-3, the norm by 5e-3), so a wrong or missing update would show.

    Where ZeRO keeps things: every parameter bf16 (dense and expert buffers, sharded over dp (4) and edp (2)),
    the masters, moments and gradient shards fp32 over exactly 1/dp of the dense and 1/edp of the expert buffer
    (state bytes 12 per owned element, equal to the memory plan's), the masters covering every element and
    rounding to the parameters bitwise; the ZeRO all-gathers carry 2 bytes per element, the reduce-scatters 4
    (exact, as in fp32)."""
    from engine.memory import dp_buffer_numel
    from models.hook import ModelHook

    _, results = four_ranks
    ref = _train([BF16])
    ref_grad, ref_master = _assemble(ref["grad"]), _assemble(ref["master"])
    report = {}
    for name, extra in LAYOUTS_BF16.items():
        cfg = _config(extra)
        zero = cfg.optim.zero_stage
        dense, expert, _, _ = dp_buffer_numel(cfg, ModelHook.from_hf(HF), world=4)
        owned = dense // 4 + expert // 2
        for rank, res in enumerate(results):
            r = res[name]
            for key, tol in (("loss", 1e-4), ("norm", 5e-4)):
                assert all(abs(a - b) <= tol * abs(b) for a, b in zip(r[key], ref[key])), (name, rank, key, r[key],
                                                                                            ref[key])
            assert r["param_dtypes"] == {"torch.bfloat16"} and r["state_dtypes"] == {"torch.float32"}, (name, r)
            assert r["buffers"] == [("torch.bfloat16", 2), ("torch.bfloat16", 4)], (name, r["buffers"])
            assert r["owned"] == owned, (name, rank, r["owned"], dense, expert)
            held, planned = r["state"]
            assert held == planned == ((2 * owned if zero == 3 else 2 * (dense + expert)), 4 * owned, 12 * owned)
        _check_zero_bytes([res[name] for res in results], extra)
        pieces = lambda what: _assemble([p for res in results for p in res[name][what]])  # noqa: E731
        master, param, grad = pieces("master"), pieces("param"), pieces("grad")
        for k, m in master.items():  # no NaN: every element's master is on some rank; bf16(master) = parameter
            assert not m.isnan().any() and torch.equal(m.bfloat16().float(), param[k]), (name, k)
        report[name] = {"loss": max(abs(a - b) / b for a, b in zip(results[0][name]["loss"], ref["loss"])),
                        "norm": max(abs(a - b) / b for a, b in zip(results[0][name]["norm"], ref["norm"])),
                        "grad": _rel(grad, ref_grad), "master": _rel(master, ref_master)}
        assert report[name]["grad"] <= 4e-2 and report[name]["master"] <= 5e-3, (name, report[name])
    print("\nbf16 vs one process (relative):", report)


ORACLE_TOKENS = [[5, 17, 3, 60, 42, 8, 33, 2], [11, 12, 13, 14, 15]]  # two lengths: two pipeline batches


def _parts_8(tmp: str, checkpoints: dict[str, str]):
    out = {}
    for name, extra in LAYOUTS_8.items():
        out[name] = _train(extra)
        dist.barrier()
    from tools.evaluate import run_evaluate

    for family, ckpt in checkpoints.items():  # converted at ep2 x tp2 x pp2, evaluated at that layout
        etp1 = ["--set", "parallel.expert_tp=1", "--set", "parallel.sequence_parallel=true"] if "etp1" in family else []
        run_evaluate(["--ckpt", ckpt, "--ep", "2", "--tp", "2", "--pp", "2", *etp1, "--tokens", f"{tmp}/oracle.json",
                      "--dump-logits", f"{tmp}/{family}_ep2_tp2_pp2.safetensors"])
    return out


def test_dp_above_ep_with_tp_or_pp_and_hf_oracle_on_8_ranks(reference, tmp_path):
    """dp4 x tp2 (SP; also at expert_tp=1 under ZeRO-2) and dp4 x pp2 (ZeRO-2) at ep2 equal one process; the
    three MoE families converted at ep2 x tp2 x pp2 and evaluated on 8 ranks give transformers' logits (fp32,
    1e-5), Qwen2-MoE also converted and evaluated at expert_tp=1 (whole experts, SP)."""
    from safetensors.torch import load_file

    from tests.models.test_moe import MOE, _make
    from tools.convert_checkpoint import hf_to_tessel

    (tmp_path / "oracle.json").write_text(json.dumps(ORACLE_TOKENS))
    models, checkpoints = {}, {}
    for family in MOE:
        models[family], _, hf_dir = _make(family, tmp_path / f"{family}_hf")
        checkpoints[family] = str(hf_to_tessel(hf_dir, tmp_path / f"{family}_ckpt", tp=2, pp=2, ep=2))
        if family == "qwen2_moe":
            models["qwen2_moe_etp1"] = models[family]
            checkpoints["qwen2_moe_etp1"] = str(hf_to_tessel(hf_dir, tmp_path / f"{family}_etp1_ckpt", tp=2, pp=2,
                                                             ep=2, expert_tp=1))
    results = run_distributed(_parts_8, 8, str(tmp_path), checkpoints, timeout=400)
    _check_parity(results, reference, LAYOUTS_8)
    for name in ("ep2xtp2_dp4_etp1_zero2", "ep2xtp2_dp4_etp1_zero3"):
        _check_zero_bytes([r[name] for r in results], LAYOUTS_8[name], world=8)
    worst = {}
    for family, model in models.items():
        got = load_file(str(tmp_path / f"{family}_ep2_tp2_pp2.safetensors"))
        assert sorted(got) == ["logits.0", "logits.1"]
        with torch.no_grad():
            for i, ids in enumerate(ORACLE_TOKENS):
                want = model(torch.tensor([ids]), use_cache=False).logits[0]  # (s, vocab)
                assert got[f"logits.{i}"].shape == want.shape, (family, i)
                worst[family] = max(worst.get(family, 0.0), float((got[f"logits.{i}"] - want).abs().max()))
    assert all(w <= ATOL for w in worst.values()), worst
    print("\nmax |logits - transformers| at ep2 x tp2 x pp2:", worst)


@pytest.mark.parametrize("extra, hf, world, message", [
    (["parallel.ep=3"], HF, 3, "num_experts=4 is not divisible by parallel.ep=3"),
    (["parallel.ep=2"], {**HF, "model_type": "llama"}, 4, "has none"),
    (["parallel.ep=2", "parallel.dp=3"], HF, 3, "parallel.ep=2 does not divide dp = 3"),
    (["parallel.ep=2", "parallel.dp=1", "parallel.cp=2"], HF, 2, "parallel.ep=2 does not divide dp = 1"),
    (["parallel.moe_dispatcher=broadcast"], HF, 4, "parallel.moe_dispatcher='broadcast' is not valid"),
    (["parallel.ep=2", "optim.grad_compression=onebit"], HF, 4, "expert gradients must reduce over edp"),
    (["parallel.moe_bias_update_rate=-1"], HF, 4, "parallel.moe_bias_update_rate=-1.0 must be >= 0"),
    (["parallel.tp=2", "parallel.expert_tp=1"], HF, 4,
     "parallel.expert_tp=1 at parallel.tp=2 needs sequence parallelism; set parallel.sequence_parallel=true, or "
     "parallel.expert_tp=2"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.expert_tp=3"], HF, 4,
     "parallel.expert_tp=3 is not built at parallel.tp=2; set parallel.expert_tp to 1 or 2"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.expert_tp=1"], {**HF, "model_type": "llama"}, 4,
     "parallel.expert_tp=1 sets the experts' tensor parallelism, but the llama model has none"),
])
def test_bad_expert_parallel_config_is_refused_before_any_group(extra, hf, world, message):
    from engine.assembly import build_run
    from models.hook import ModelHook

    assert not dist.is_initialized()
    pattern = ".*".join(part.replace("*", r"\*").replace("(", r"\(") for part in message.split("; "))
    with pytest.raises(ValueError, match=pattern):
        cfg = _config(["train.global_batch_size=12", *extra])
        build_run(cfg, model=ModelHook.from_hf(hf, dtype=torch.float32), world=world, data=False, checkpoints=False)
    assert not dist.is_initialized()


def test_top_k_above_experts_is_refused():
    from models.hook import ModelHook

    with pytest.raises(ValueError, match="exceeds num_experts=4"):
        ModelHook.from_hf({**HF, "num_experts_per_tok": 5})


def _bias_and_replay(tmp: str):
    """One rank: (1) a checkpoint with the routers' balancing biases, loaded by a run without balancing, is
    refused (it would route without them, silently); (2) the non-finite step's replay adds no routing counts
    to the next step's metrics and bias update."""
    from engine.checkpoint.trainer_state import load_trainer
    from parallel.expert_parallel import MoELayer

    out = _train([], run_dir=f"{tmp}/biased")
    try:
        load_trainer(_build(["parallel.moe_bias_update_rate=0"]).trainer, out["latest"], group=None)
        refused = None
    except ValueError as e:
        refused = str(e)
    run = _build(["fault.nan_replay=true"])
    tr = run.trainer
    tr.train_step(run.train_loader)
    micro = [tr._to_device(next(run.train_loader)) for _ in range(tr.num_micro)]
    tr._localise_nonfinite(micro, finite=False)  # what train_step does after a non-finite step
    return refused, [m.step_load for m in tr.chunks.modules() if isinstance(m, MoELayer)]


def test_saved_biases_are_not_dropped_and_the_replay_does_not_count(tmp_path):
    refused, loads = run_distributed(_bias_and_replay, 1, str(tmp_path), timeout=300)[0]
    assert refused is not None and "parallel.moe_bias_update_rate > 0" in refused, refused
    assert loads and all(x is None for x in loads), loads


def _dense_stage_resume(tmp: str):
    """pp=2, a Qwen2-MoE whose layers 0-1 are dense (``mlp_only_layers``): stage 0 holds no router. A checkpoint
    with the routers' balancing biases (from stage 1) resumes on both stages; before 2026-11-28 stage 0 decided
    from its own chunks that the run had no biases and raised alone (the other stage went on to its first
    collective)."""
    from engine.checkpoint.trainer_state import load_trainer

    hf = {**HF_QWEN2, "num_hidden_layers": 4, "mlp_only_layers": [0, 1]}
    out = _train(["parallel.pp=2"], run_dir=f"{tmp}/dense_stage", hf=hf)
    run = _build(["parallel.pp=2"], hf=hf)
    try:
        load_trainer(run.trainer, out["latest"], group=run.mesh.world)
    except ValueError as e:
        return f"refused: {e}"
    return sorted(_biases(run))


def test_biases_resume_on_a_pipeline_stage_without_moe_layers(tmp_path):
    stage0, stage1 = run_distributed(_dense_stage_resume, 2, str(tmp_path), timeout=300)
    assert stage0 == [], stage0  # no router on stage 0, and no refusal
    assert stage1 == ["layers.2.mlp.router.expert_bias", "layers.3.mlp.router.expert_bias"], stage1
