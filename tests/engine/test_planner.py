"""The layout planner (engine/planner, docs/planner.md).

* Memory: the planner's figure for the tiny preset IS engine/memory.py's prediction, rank by rank, at
  several layouts (and so the bytes tests/engine/test_memory_report.py asserts against the allocator);
  parameters, gradients and optimizer state also equal the tensors of a built one-process run.
* The steady-state shortcut (simulate pp * (vp + 3) micro-batches, extrapolate) equals the full walk
  and simulation.
* Bad pins raise before any enumeration with a message naming the fix; a model that fits nowhere gets
  the smallest cluster that fits.
* The published-row check: the rule (80% of rows within 15%) and one row end to end.
* Expert parallelism (test_moe_training.py's tiny Mixtral): the memory at ep2 is the start-up report's
  (predict_memory on the trainer's config, whose state test_memory_report.py asserts against the allocator);
  ep > 1 is enumerated only with --zero 0 (a note says why otherwise) and never with cp; the all-to-all
  time is 4 dispatches of (ep-1)/ep * top_k * tokens * hidden bytes per MoE layer over the ep group's link;
  expert weights, gradients and optimizer state shrink with ep; bad ep pins name the fix.
* MFU: the causal count is 11-12% below Eq. 7 for Llama-3-8B at sequence 8192 (docs/metrics.md).
"""
from __future__ import annotations

import pytest

from engine.planner import Cluster, Layout, Training, from_dims, from_preset, gpu, plan, predict, smallest_fit


@pytest.fixture(scope="module")
def tiny():
    return from_preset("tiny_llama_cpu")


def _cpu_cluster(world: int) -> Cluster:
    return Cluster(gpu=gpu("h100-sxm"), nodes=1, gpus_per_node=world, device="cpu")


LAYOUTS = [  # (tp, pp, vp, dp, zero, recompute)
    (1, 1, 1, 1, 1, "none"),
    (2, 1, 1, 1, 1, "selective"),
    (1, 2, 1, 1, 1, "none"),
    (1, 1, 1, 2, 1, "none"),
    (1, 1, 1, 2, 2, "full"),
    (2, 2, 1, 1, 1, "none"),
    (1, 2, 2, 2, 3, "none"),
]


@pytest.mark.parametrize("tp,pp,vp,dp,zero,recompute", LAYOUTS)
def test_memory_is_engine_memorys_prediction(tiny, tp, pp, vp, dp, zero, recompute):
    from engine.config import load_config
    from engine.memory import predict_memory
    from models.hook import ModelHook

    tr = Training(seq_length=128, global_batch_size=16, precision="fp32", recompute=recompute, zero=zero)
    p = predict(tiny, Layout(tp=tp, pp=pp, vp=vp, dp=dp, cp=1, mbs=2), tr, _cpu_cluster(tp * pp * dp))
    sets = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.vp={vp}", f"parallel.dp={dp}",
            f"parallel.schedule={'interleaved' if vp > 1 else '1f1b'}", f"optim.zero_stage={zero}",
            f"train.activation_checkpointing={recompute}"]
    cfg = load_config("tiny_llama_cpu", sets)
    engine = predict_memory(cfg, ModelHook.from_run_config(cfg, tokenizer_vocab=None), world=tp * pp * dp,
                            device="cpu")
    assert p.memory.ranks == engine.ranks  # every byte of every pipeline rank
    assert p.memory_bytes == engine.largest.total
    assert p.as_dict()["memory_gib_per_gpu"] == engine.largest.total / 2**30


def test_state_equals_the_built_runs_tensors(tiny):
    """One process: parameters, gradients and optimizer state of the plan = the allocated tensors."""
    from tests.engine.test_memory_report import _build, _cfg, _state

    cfg = _cfg("parallel.tp=1", "parallel.pp=1")
    run = _build(cfg, world=1)
    tr = Training(seq_length=128, global_batch_size=16, precision="fp32", recompute="none", zero=1)
    p = predict(tiny, Layout(tp=1, pp=1, vp=1, dp=1, cp=1, mbs=2), tr, _cpu_cluster(1))
    r = p.memory.ranks[0]
    assert (r.params, r.grads, r.optimizer) == _state(run)


def test_steady_state_shortcut_equals_the_full_schedule(tiny):
    tr = Training(seq_length=128, global_batch_size=64, precision="fp32", recompute="none", zero=1)
    for lay in (Layout(tp=1, pp=2, vp=2, dp=1, cp=1, mbs=1), Layout(tp=2, pp=2, vp=1, dp=1, cp=1, mbs=1)):
        cl = _cpu_cluster(lay.tp * lay.pp)
        fast, full = predict(tiny, lay, tr, cl), predict(tiny, lay, tr, cl, steady_state=False)
        assert fast.memory.ranks == full.memory.ranks
        assert fast.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)


def test_bad_pins_name_the_fix(tiny):
    tr = Training(seq_length=128, global_batch_size=16)
    with pytest.raises(ValueError, match=r"--tp 8 exceeds the model's 4 attention heads.*divisor of 4"):
        plan(tiny, Cluster(gpu=gpu("h100-sxm"), nodes=1), tr, {"tp": 8})
    with pytest.raises(ValueError, match=r"pins tp 2 \* pp 4 = 8 do not divide the world of 6 GPUs.*--nodes"):
        plan(tiny, Cluster(gpu=gpu("h100-sxm"), nodes=1, gpus_per_node=6), tr, {"tp": 2, "pp": 4})
    with pytest.raises(ValueError, match="stages for 4 layers"):
        plan(tiny, Cluster(gpu=gpu("h100-sxm"), nodes=1), tr, {"pp": 8})
    with pytest.raises(ValueError, match="--ep 2: .*the llama model has none; set parallel.ep=1"):
        plan(tiny, Cluster(gpu=gpu("h100-sxm"), nodes=1), tr, {"ep": 2})
    with pytest.raises(ValueError, match="fp8"):
        plan(tiny, Cluster(gpu=gpu("a100-80gb"), nodes=1), Training(seq_length=128, global_batch_size=16,
                                                                      precision="fp8"), {})


def test_ranked_fitting_first_then_fastest(tiny):
    preds, _ = plan(tiny, Cluster(gpu=gpu("h100-sxm"), nodes=1, gpus_per_node=4),
                    Training(seq_length=128, global_batch_size=16))
    assert {(p.layout.tp, p.layout.pp, p.layout.dp) for p in preds} >= {(1, 1, 4), (2, 2, 1), (1, 4, 1), (2, 1, 2)}
    times = [p.step_time_s for p in preds]
    assert all(p.fits for p in preds) and times == sorted(times)


def test_a_model_that_fits_nowhere_gets_the_cluster_it_needs():
    model = from_dims(family="llama", hidden_size=4096, num_layers=16, num_heads=32, num_kv_heads=8,
                      ffn_hidden_size=14336, vocab_size=32000)  # ~3.7B parameters: ~60 GB of state at ZeRO 0
    cluster = Cluster(gpu=gpu("a100-40gb"), nodes=1, gpus_per_node=1)
    tr = Training(seq_length=2048, global_batch_size=8, recompute="full", zero=0)
    preds, _ = plan(model, cluster, tr)
    assert preds and not any(p.fits for p in preds)
    nodes, least = smallest_fit(model, cluster, tr)
    assert least == min(p.memory_bytes for p in preds) > cluster.capacity_bytes
    assert nodes is not None and nodes >= 2
    bigger, _ = plan(model, Cluster(gpu=gpu("a100-40gb"), nodes=nodes, gpus_per_node=1), tr)
    assert bigger[0].fits


def test_published_rows_rule_and_one_row():
    from engine.planner.validate import PUBLISHED, TOLERANCE, passed, predict_row

    assert passed([True] * 4 + [False]) and not passed([True] * 3 + [False] * 2) and not passed([])
    row = next(r for r in PUBLISHED if r.name == "GPT-22B")
    assert row.reported_tflops == pytest.approx(0.415 * 312.0)
    res = predict_row(row)
    assert abs(res.error) <= TOLERANCE, f"predicted {res.predicted_tflops:.1f} vs {row.reported_tflops:.1f} TFLOP/s"


def test_causal_mfu_is_11_to_12_percent_lower_for_llama3_8b():
    from engine.metrics import FlopsSpec, model_flops_per_step

    spec = FlopsSpec(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, vocab_size=128256,
                     num_attention_heads=32, num_key_value_heads=8)
    full = model_flops_per_step(spec, batch_size=1, seq_length=8192)
    causal = model_flops_per_step(spec, batch_size=1, seq_length=8192, causal=True)
    assert 0.11 <= 1 - causal / full <= 0.12


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    import json

    from engine.planner import from_hf_config
    from tests.parallel.test_moe_training import HF

    path = tmp_path_factory.mktemp("moe") / "config.json"
    path.write_text(json.dumps(HF))
    return from_hf_config(str(path))


def test_ep2_memory_is_the_start_up_reports(tiny_moe):
    """The planner at ep2 (dp2, zero 0, fp32) = predict_memory on test_moe_training.py's run config, byte for
    byte; expert state is half of ep1's, the dense state unchanged."""
    import torch

    from engine.memory import predict_memory
    from models.hook import ModelHook
    from tests.parallel.test_moe_training import HF, _config

    tr = Training(seq_length=16, global_batch_size=8, precision="fp32", recompute="none", zero=0)
    lay = Layout(tp=1, pp=1, vp=1, dp=2, cp=1, mbs=1, ep=2)
    p = predict(tiny_moe, lay, tr, _cpu_cluster(2))
    cfg = _config(["parallel.ep=2"])
    engine = predict_memory(cfg, ModelHook.from_hf(HF, dtype=torch.float32), world=2, device="cpu")
    assert p.memory.ranks == engine.ranks
    one = predict(tiny_moe, Layout(tp=1, pp=1, vp=1, dp=2, cp=1, mbs=1, ep=1), tr, _cpu_cluster(2))
    c = tiny_moe.config
    expert_params = c.num_layers * c.num_experts * 3 * c.hidden_size * c.moe_ffn_hidden_size  # gate, up, down
    assert one.memory.largest.params - p.memory.largest.params == 4 * expert_params // 2  # fp32, half the experts


def test_ep_all_to_all_and_enumeration(tiny_moe):
    from engine.planner.predict import alltoall_time, moe_dispatch_bytes

    c = tiny_moe.config
    tr = Training(seq_length=16, global_batch_size=8, precision="bf16", recompute="none", zero=0)
    cluster = Cluster(gpu=gpu("h100-sxm"), nodes=2, gpus_per_node=2)
    # one MoE layer's dispatch: half of top_k * tokens * hidden rows leave the rank at ep2 (2 bytes each)
    assert moe_dispatch_bytes(c, tokens=32, ep=2, elem=2) == 0.5 * 2 * 32 * 32 * 2
    preds, notes = plan(tiny_moe, cluster, tr)
    eps = {(p.layout.dp, p.layout.ep) for p in preds}
    assert {(4, 1), (4, 2), (4, 4), (2, 2), (1, 1)} <= eps and all(p.layout.cp == 1 for p in preds if p.layout.ep > 1)
    by = {(p.layout.tp, p.layout.pp, p.layout.dp, p.layout.ep, p.layout.mbs): p for p in preds if p.layout.vp == 1}
    p = by[(1, 1, 4, 4, 1)]  # ep4 spans both nodes: the NIC's link; 2 micro-batches x 2 layers x 4 all-to-alls
    want = 2 * c.num_layers * 4 * alltoall_time(moe_dispatch_bytes(c, tokens=16, ep=4, elem=2), 4, cluster.link(4))
    assert p.breakdown["ep_comm"] == pytest.approx(want, rel=1e-12)
    assert "ep_comm" not in by[(1, 1, 4, 1, 1)].breakdown
    ep4, ep1 = by[(1, 1, 4, 4, 1)].memory.largest, by[(1, 1, 4, 1, 1)].memory.largest
    assert ep4.params < ep1.params and ep4.grads < ep1.grads and ep4.optimizer < ep1.optimizer
    zero1, notes = plan(tiny_moe, cluster, Training(seq_length=16, global_batch_size=8, zero=1))
    assert all(p.layout.ep == 1 for p in zero1) and any("plan with --zero 0" in n for n in notes)
    with pytest.raises(ValueError, match="--ep 2 with --zero 1.*plan with --zero 0"):
        plan(tiny_moe, cluster, Training(seq_length=16, global_batch_size=8, zero=1), {"ep": 2})
    with pytest.raises(ValueError, match="--ep 3: .*"):
        plan(tiny_moe, cluster, tr, {"ep": 3})


def test_cpu_collective_overhead_enters_every_tp_collective(tiny):
    """The calibrated per-call collective overhead (engine/planner/calibrate.py's TP micro-benchmark) adds
    exactly one term per collective call: at TP2 (dp 1, pp 1) 8 micro-batches x (4 layers x 8 + embedding 2
    + output 2) = 288 calls, all in tp_comm; one process (world 1) gets none."""
    from engine.planner.calibrate import cpu_device, predict_tiny
    from engine.planner.predict import collective_time

    cal = {"cores": 2, "matmul_1_thread": {"tflops": 0.1, "overhead_us": 1.0},
           "matmul_all_threads": {"tflops": 0.2, "overhead_us": 2.0}, "copy_gbps": 8.0,
           "attention_efficiency": 0.5, "gloo": {"alpha_us": 60.0, "gbps": 1.0}, "tp_collective": {"overhead_us": 0.0}}
    base = predict_tiny(cal, 2, 1, 1)
    cal["tp_collective"]["overhead_us"] = 1000.0
    assert cpu_device(cal, world=2).collective_overhead_us == 1000.0
    assert cpu_device(cal, world=1).collective_overhead_us == 0.0
    with_call = predict_tiny(cal, 2, 1, 1)
    assert with_call.breakdown["tp_comm"] - base.breakdown["tp_comm"] == pytest.approx(288 * 1e-3, rel=1e-9)
    assert with_call.step_time_s - base.step_time_s == pytest.approx(288 * 1e-3, rel=1e-9)
    assert predict_tiny(cal, 1, 1, 1).step_time_s == predict_tiny({**cal, "tp_collective": {"overhead_us": 0.0}},
                                                                  1, 1, 1).step_time_s
    link = (1e9, 60e-6, 1e-3)
    assert collective_time("all_gather", 4096, 2, link) == pytest.approx(1e-3 + 60e-6 + 4096 / 1e9)
    assert collective_time("all_gather", 4096, 1, link) == 0.0  # a group of one never calls


def test_compiled_pipeline_time_is_the_simulators_to_the_last_bit():
    """engine/planner/pipeline.py evaluates a schedule compiled once per (schedule, pp, vp, m): the makespan
    and busy times equal parallel/pipeline/simulate.py's dataflow_times exactly (==, not approx), with
    unequal stage costs and a p2p latency, on 1F1B and interleaved schedules."""
    import random

    from engine.planner.pipeline import pipeline_time, schedule
    from parallel.pipeline.simulate import dataflow_times

    rng = random.Random(0)
    for name, pp, vp, m in [("1f1b", 1, 1, 3), ("1f1b", 4, 1, 11), ("interleaved", 4, 2, 12), ("interleaved", 3, 5, 9)]:
        sched = schedule(name, pp=pp, vp=vp, microbatches=m)
        n = sched.num_stages
        fwd, bwd, lat = [rng.random() for _ in range(n)], [2 * rng.random() for _ in range(n)], 0.1 * rng.random()
        times = dataflow_times([[a.key for a in acts] for acts in sched.ranks], pp=pp, num_stages=n, fwd=tuple(fwd),
                               bwd=tuple(bwd), latency=lat, placement=sched.placement)
        makespan, busy = pipeline_time(name, pp=pp, vp=vp, microbatches=m, fwd=fwd, bwd=bwd, p2p=lat)
        assert makespan == max(ts[-1][1] for ts in times)
        assert busy == [sum(e - b for b, e in ts) for ts in times]


def test_run_config_is_what_parsing_gives(tiny):
    """PlanModel.run_config derives each layout's config from the base parsed once (dataclasses.replace,
    every section re-validated): parsing its dict gives the same config, and an illegal layout is still
    refused with the config's own message."""
    from engine.config.schema import TesselConfig

    for kw in (dict(tp=2, pp=2, vp=2, dp=1, cp=1), dict(tp=1, pp=1, vp=1, dp=2, cp=2), dict(tp=2, pp=1, vp=1, dp=2, cp=1)):
        cfg = tiny.run_config(**kw, mbs=2, gbs=16, seq=128, recompute="selective", zero=1, dtype="bf16")
        assert TesselConfig.from_dict(cfg.to_dict()) == cfg
        assert (cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.sequence_parallel) == (kw["tp"], kw["cp"], kw["tp"] > 1)
    with pytest.raises(ValueError, match="not divisible by 2\\*parallel.cp"):
        tiny.run_config(tp=1, pp=1, vp=1, dp=1, cp=3, mbs=1, gbs=4, seq=128, recompute="none", zero=1)


def test_zero_3_plans_a_preset_that_overlaps_the_parameter_gather():
    """A preset with optim.overlap_param_gather = true (qwen2_7b's) planned at --zero 3: the post-step gather
    does not exist there, so the layout's config turns it off instead of refusing every layout."""
    model = from_preset("tiny_llama_cpu", ["optim.distributed=true", "optim.overlap_param_gather=true"])
    preds, _ = plan(model, Cluster(gpu=gpu("h100-sxm"), nodes=1, gpus_per_node=2),
                    Training(seq_length=128, global_batch_size=16, zero=3), {"tp": 1, "pp": 1, "cp": 1, "mbs": 2})
    assert [p.layout.dp for p in preds] == [2]
