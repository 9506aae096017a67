"""DiLoCo and Streaming DiLoCo (parallel/data_parallel/outer.py) through the main job's assembly line.

* Sanity: DiLoCo with H=1, outer lr 1 and no momentum equals plain data parallelism at dp2 and at
  dp2 x tp2 (losses of 2 steps and the final weights, fp32, 2e-6 absolute). The inner step must be linear
  in the gradient for the average of the replicas' updates to be the update of the averaged gradient;
  Adam's normalisation is not, so the runs use AdamW with beta1 = 0, eps = 1e5 (>> sqrt(v)), lr = 1e4, i.e. SGD
  with lr 0.1 up to a relative O(|g| / eps) ~ 1e-6 of the update, under the tolerance.
* Bytes (ledger, dp axis, gradient/pseudo-gradient traffic: the float64 loss bookkeeping excluded): over
  2H steps DiLoCo sends exactly 2 x DDP's per-step volume x the compression ratio: 1 (none), 1/2 (bf16),
  (n_pad / n) (1 + 4 / 1024) / 4 (int8 with fp32 scales per 1024, padded to dp x 1024), and top-k the
  all-gather of k fp32 values + k int32 indices; Streaming DiLoCo's fragments add up to the same volume.
  With a data-parallel warm-up (outer.start_step = 2, int8): the first 2 steps are DDP's, bytes and losses and
  weights bitwise, the replicas agree after each of them, and the 2H steps after send DDP / H x int8's ratio.
* Fragments (strided layout): after each step the replicas agree exactly on the parameters of the fragment
  just applied (its blocks, with the embedding or the final norm and output layer), and on no other.
* FP8 delayed scaling: DiLoCo's inner steps send nothing over dp (amaxes reduced over tp only, the replicas'
  histories differ), and the per-rank histories resume bitwise.
* Resume is bitwise for DiLoCo (top-k, mid-cycle; with FP8 delayed scaling), Streaming DiLoCo (int8, strided, with a reduction in
  flight at the save), DiLoCo saved inside its data-parallel warm-up, Streaming DiLoCo saved right after it,
  and both per-step compressors (tests/parallel/test_grad_compression.py shares the runs).
* Bad inputs are refused with the fix named.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from engine.data.synthetic import RandomTokens
from parallel.testing import run_distributed

SEQ, VOCAB = 16, 64
HF = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 64,
      "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
ATOL = 2e-6
LINEAR_ADAM = ["optim.beta1=0.0", "optim.eps=1e5", "optim.lr=1e4", "optim.min_lr=0.0", "optim.clip_grad=0.0",
               "optim.weight_decay=0.0"]


def _tokens(n: int) -> RandomTokens:
    return RandomTokens(n, vocab=VOCAB, seq=SEQ, seed=90)


def _cfg(*, steps: int = 3, extra=()):
    from engine.config import load_config

    return load_config("tiny_llama_cpu", [
        "parallel.tp=1", "parallel.pp=1", "parallel.dp=-1", "optim.distributed=false", f"train.steps={steps}",
        "train.global_batch_size=4", "train.micro_batch_size=1", f"train.seq_length={SEQ}", "optim.lr=0.01",
        "optim.warmup_steps=0", "logging.progress_bar=off", "logging.tensorboard=false", "logging.jsonl=false",
        "logging.peak_tflops=1.0", "train.eval_interval=0", "logging.memory_report=false", *extra])


def _run(cfg, *, run_dir=None, checkpoints=False):
    from engine.assembly import build_run
    from models.hook import ModelHook

    model = ModelHook.from_hf(HF, dtype=torch.float32, seed=cfg.train.seed,
                              sequence_parallel=cfg.parallel.sequence_parallel, fp8=cfg.model.fp8,
                              fp8_exclude=tuple(cfg.model.fp8_exclude))
    return build_run(cfg, model=model, train_data=_tokens(4 * (cfg.train.steps + 2)), checkpoints=checkpoints,
                     run_dir=run_dir)


def _params(run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.trainer.chunks.named_parameters()}


def _grad_bytes(cap) -> float:
    """dp bytes of gradient traffic in a capture: the dp axis without the float64 loss bookkeeping."""
    return sum(r.sent_bytes for r in cap.records if r.axis == "dp_cp" and r.dtype != "torch.float64")


def _train(cfg, steps: int):
    run = _run(cfg)
    run.initial = _params(run)
    losses, sent = [], []
    for _ in range(steps):
        with run.mesh.ledger.capture() as cap:
            losses.append(run.trainer.train_step(run.train_loader).loss)
        sent.append(_grad_bytes(cap))
    return run, losses, sent


# -- sanity: H=1, lr 1, no momentum == DDP ------------------------------------------------------------
STEPS = 2
def _sanity(tp: int):
    par = [f"parallel.tp={tp}"] + (["parallel.sequence_parallel=true"] if tp > 1 else [])
    ddp, ddp_losses, _ = _train(_cfg(steps=STEPS, extra=LINEAR_ADAM + par), STEPS)
    out_cfg = _cfg(steps=STEPS, extra=LINEAR_ADAM + par + ["outer.method=diloco", "outer.inner_steps=1", "outer.lr=1.0",
                                             "outer.momentum=0.0", "outer.nesterov=false"])
    outer, outer_losses, _ = _train(out_cfg, STEPS)
    a, b = _params(ddp), _params(outer)
    return {"losses": (ddp_losses, outer_losses), "max_param_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
            "moved": max(float((a[k] - p).abs().max()) for k, p in ddp.initial.items())}


def _too_many_contiguous_fragments() -> str:
    """dp2 x pp2, contiguous cut, F = 8: pipeline stage 0 holds 7 parameters (the embedding and block 0's
    six), stage 1 holds 8 (block 1's, the final norm and the output layer). Every rank must raise the same
    error; before 2026-11-28 stage 0 raised alone and stage 1 went on to wait for it."""
    try:
        _run(_cfg(extra=["parallel.pp=2", "outer.method=streaming_diloco", "outer.inner_steps=8",
                         "outer.fragments=8", "outer.fragment_layout=contiguous"]))
    except ValueError as err:
        return f"{getattr(err, 'on_every_rank', False)}: {err}"
    return "built"


def _powersgd_start_line() -> str:
    """PowerSGD rank 16 at dp2 x pp2: each stage's block has one 32 x 32 matrix (the attention output) that
    rank 16 would not shrink (16 x 64 >= 32 x 32), so 2 go whole; the start-up line (rank 0, pipeline
    stage 0) counts both stages'."""
    import io

    stream = io.StringIO()
    run = _run(_cfg(extra=["parallel.pp=2", "optim.grad_compression=powersgd", "optim.powersgd_rank=16"]))
    run.trainer.logger.stream = stream
    run.trainer.log_start()
    return stream.getvalue()


def _all_4(tmp: str):
    """The 4-rank parts in one launch: the dp2 x tp2 sanity check, the strided fragments at dp2 x pp2 and the
    contiguous cut's refusal there, PowerSGD's start-up line and an FP8 DiLoCo resume at dp2 x pp2."""
    return {"sanity": _sanity(2), "fragments": _fragments(pp=2), "too_many": _too_many_contiguous_fragments(),
            "powersgd_line": _powersgd_start_line(),
            "resume": _resume(tmp, ["fp8_stage0_excluded"], cases=PP2_RESUME_CASES)}


# DiLoCo with FP8 delayed scaling at dp2 x pp2 where pipeline stage 0 (global rank 0, whose JSON state the
# checkpoint keeps) has no FP8 linear: the other stage's replicas must still get their own histories back
PP2_RESUME_CASES = {"fp8_stage0_excluded": [
    "parallel.pp=2", "outer.method=diloco", "outer.inner_steps=3", "model.fp8=delayed",
    "model.fp8_exclude=['layers.0.attention.qkv','layers.0.attention.out','layers.0.mlp.fc1','layers.0.mlp.fc2']"]}


def test_fp8_replica_state_resumes_when_rank_0_holds_no_fp8_linear(four):
    for rank, r in enumerate(x["resume"]["fp8_stage0_excluded"] for x in four):
        ref, got = r["losses"]
        assert ref == got, (rank, ref, got)
        assert r["equal"], rank


def test_powersgd_start_line_counts_every_stages_whole_matrices(four):
    line = four[0]["powersgd_line"]
    # before: "1 matrices ... on rank 0" (stage 0's only)
    assert "grad_compression powersgd rank 16, 2 matrices too small to compress sent whole" in line, line


def test_too_many_contiguous_fragments_for_one_stage_are_refused_on_every_rank(four):
    msgs = [r["too_many"] for r in four]
    assert len(set(msgs)) == 1, msgs
    assert msgs[0].startswith("True: outer.fragments=8 exceeds the 7 parameters"), msgs[0]
    assert "outer.fragment_layout='strided'" in msgs[0]


_LAUNCHED4: list = []


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    if not _LAUNCHED4:
        _LAUNCHED4.append(run_distributed(_all_4, 4, str(tmp_path_factory.mktemp("outer_four")), timeout=300))
    return _LAUNCHED4[0]


@pytest.mark.parametrize("world", [2, 4], ids=["dp2", "dp2xtp2"])
def test_diloco_h1_equals_data_parallel(request, world):
    outs = [r["sanity"] for r in request.getfixturevalue("dp2" if world == 2 else "four")]
    for rank, r in enumerate(outs):
        ddp, outer = r["losses"]
        assert max(abs(x - y) for x, y in zip(ddp, outer)) < ATOL, (rank, ddp, outer)
        assert r["max_param_diff"] < ATOL, (rank, r["max_param_diff"])
        assert r["moved"] > 1e-3  # the weights did train (the comparison is not of two idle models)


# -- bytes -------------------------------------------------------------------------------------------
H = 2


WARM = 2  # outer.start_step of the warm-up case


def _warmup_run(ddp, ddp_losses):
    """DiLoCo (int8) after WARM plain data-parallel steps, 2H steps more: per step the dp gradient bytes, the
    logged phase, whether the replicas agree bitwise; the warm-up's losses and weights against DDP's."""
    import torch.distributed as dist

    run = _run(_cfg(steps=WARM + 2 * H, extra=["outer.method=diloco", f"outer.inner_steps={H}",
                                                "outer.compression=int8", f"outer.start_step={WARM}"]))
    sent, agreed, phases, losses = [], [], [], []
    for step in range(1, WARM + 2 * H + 1):
        with run.mesh.ledger.capture() as cap:
            losses.append(run.trainer.train_step(run.train_loader).loss)
        sent.append(_grad_bytes(cap))
        phases.append(run.trainer.outer.phase_name(step))
        mine = _params(run)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        agreed.append(all(torch.equal(mine[k], o[k]) for o in every for k in mine))
        if step == WARM:
            ref = _params(ddp)
            same_as_ddp = all(torch.equal(mine[k], ref[k]) for k in ref)
            state = run.trainer.outer.state_tensors()  # the outer loop starts here: anchor = these weights
            anchored = torch.equal(state["anchor"], state["local.master"])
    return {"sent": sent, "agreed": agreed, "phases": phases, "same_as_ddp": same_as_ddp, "anchored": anchored,
            "losses_as_ddp": losses[:WARM] == ddp_losses[:WARM]}


def _bytes():
    ddp, ddp_losses, ddp_sent = _train(_cfg(steps=WARM + 2 * H), WARM)  # the warm-up run's LR schedule
    numel = sum(b.numel for _, b in ddp.trainer.ddp.buckets())
    out = {"ddp_step": ddp_sent[-1], "numel": numel, "warmup": _warmup_run(ddp, ddp_losses)}
    for name, extra in (("none", []), ("bf16", ["outer.compression=bf16"]), ("int8", ["outer.compression=int8"]),
                        ("topk", ["outer.compression=topk", "outer.topk_fraction=0.05"]),
                        ("streaming", ["outer.method=streaming_diloco", "outer.fragments=2",
                                       "outer.fragment_layout=contiguous"])):
        method = [] if name == "streaming" else ["outer.method=diloco"]
        run, losses, sent = _train(_cfg(steps=2 * H, extra=method + [f"outer.inner_steps={H}"] + extra), 2 * H)
        out[name] = {"sent": sent, "finite": all(math.isfinite(x) for x in losses)}
    return out


def test_dp_bytes_per_inner_step_are_ddp_over_h_times_compression(dp2):
    r = dp2[0]["bytes"]
    p, n, ddp = 2, r["numel"], r["ddp_step"]
    assert ddp == 2 * (p - 1) / p * 4 * n  # DDP: one fp32 ring all-reduce of every bucket per step
    chunk = 1024
    n_pad = -(-n // (p * chunk)) * (p * chunk)
    k = math.ceil(0.05 * n)
    ratio = {"none": 1.0, "bf16": 0.5, "int8": (n_pad / n) * (1 + 4 / chunk) / 4, "topk": (p - 1) * 8 * k / ddp}
    for name, rat in ratio.items():
        sent = r[name]["sent"]
        assert r[name]["finite"]
        assert sent[0] == 0 and sent[2] == 0, (name, sent)  # inner steps: no dp gradient traffic at all
        assert sum(sent) / (2 * H) == pytest.approx(ddp / H * rat, rel=1e-12), (name, sent, ddp, rat)
    # Streaming: two fragments at staggered steps (phases 1 and 0 of H=2) adding up to one full sync per H.
    s = r["streaming"]["sent"]
    assert all(x > 0 for x in s) and sum(s) / (2 * H) == pytest.approx(ddp / H, rel=1e-12), s


def test_topk_indices_widen_past_int32():
    """top-k's indices go as int32 (the bytes above) while every index of the fragment fits, as int64 past
    2^31 elements, where int32 would wrap."""
    from parallel.data_parallel.outer import topk_index_dtype

    assert topk_index_dtype(2 ** 31) == torch.int32  # the largest index, 2^31 - 1, fits
    assert topk_index_dtype(2 ** 31 + 1) == torch.int64


def test_warmup_steps_are_data_parallel_then_diloco(dp2):
    for rank, r in enumerate(x["bytes"] for x in dp2):
        w, n, ddp = r["warmup"], r["numel"], r["ddp_step"]
        n_pad = -(-n // (2 * 1024)) * (2 * 1024)
        int8 = (n_pad / n) * (1 + 4 / 1024) / 4
        assert w["sent"][:WARM] == [ddp] * WARM, (rank, w["sent"])  # DDP's all-reduce, exactly
        assert w["sent"][WARM] == 0 and w["sent"][WARM + 2] == 0, (rank, w["sent"])  # then local inner steps
        assert sum(w["sent"][WARM:]) / (2 * H) == pytest.approx(ddp / H * int8, rel=1e-12), (rank, w["sent"])
        assert w["losses_as_ddp"] and w["same_as_ddp"], rank  # the warm-up *is* DDP, bitwise
        assert w["anchored"], rank  # the outer loop's anchor is step WARM's weights (not the initial ones)
        # replicas identical through the warm-up, apart after a local step, together again after each sync
        assert w["agreed"] == [True, True, False, True, False, True], (rank, w["agreed"])
        assert w["phases"] == ["ddp_warmup"] * WARM + ["diloco"] * (2 * H), (rank, w["phases"])


# -- fragment layout ---------------------------------------------------------------------------------
FRAGMENT_NAMES = {0: ("0.embedding.", "0.layers.0."), 1: ("0.layers.1.", "0.final_norm.", "0.output_layer.")}


def _fragments(pp: int = 1):
    """Streaming DiLoCo, strided layout (the default), F = 2, H = 2 (fragment 0 sends after odd steps, fragment 1
    after even ones, each applied one step later, except at the run's last step, train.steps = 3), at dp2
    (x pp2: each pp rank holds one block, so one of its two fragments is empty): after each step, the names
    of this rank's parameters on which it and its dp peer agree (bitwise), and the refusal to load outer
    state laid out otherwise."""
    import torch.distributed as dist

    run = _run(_cfg(steps=3, extra=["outer.method=streaming_diloco", "outer.inner_steps=2", "outer.fragments=2",
                                    f"parallel.pp={pp}"]))
    peer = next(r for r in run.mesh.dp_cp.ranks if r != run.mesh.rank)
    agreed, norms = [], []
    for _ in range(3):
        st = run.trainer.train_step(run.train_loader)
        norms.append(st.outer is not None and "outer_step_norm" in st.outer)
        mine = _params(run)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        agreed.append(sorted(k for k in mine if torch.equal(mine[k], every[peer][k])))
    outer = run.trainer.outer
    state = outer.state_dict()
    refused = []
    for changed in ({"layout": "contiguous"}, {"start_step": 5}, {"momentum_start_step": 1}, {"overlap_steps": 2},
                    {"inner_steps": 3}):
        try:
            outer.load_state({**state, **changed}, outer.state_tensors())
            refused.append("")
        except ValueError as err:
            refused.append(str(err))
    own = outer.group.pg is not run.mesh.dp_cp.pg and outer.group.ranks == run.mesh.dp_cp.ranks
    return {"agreed": agreed, "names": sorted(mine), "refused": refused, "pp_rank": run.mesh.coords["pp"],
            "norms": norms, "pending": state["pending"], "own_communicator": own,
            "gradients_on_dp_cp": run.trainer.ddp.dp_group is run.mesh.dp_cp}


@pytest.mark.parametrize("layout", ["dp2", "dp2xpp2"])
def test_strided_fragments_sync_whole_blocks(request, layout):
    for rank, r in enumerate(x["fragments"] for x in request.getfixturevalue("dp2" if layout == "dp2" else "four")):
        frag = {f: sorted(k for k in r["names"] if k.startswith(pre)) for f, pre in FRAGMENT_NAMES.items()}
        assert sorted(frag[0] + frag[1]) == r["names"]  # every parameter of this rank in exactly one fragment
        if layout == "dp2xpp2":  # pp rank 0: embedding + block 0 only (fragment 1 empty); pp rank 1 the reverse
            assert (frag[1] if r["pp_rank"] == 0 else frag[0]) == [], (rank, r["names"])
        # step 1: fragment 0 in flight, nothing applied; step 2: fragment 0 applied (its replicas agree), fragment 1
        # in flight; step 3, the run's last: fragment 1 applied, and fragment 0, trained locally again, sent and
        # applied at once (the final weights are synced; nothing is left in flight)
        assert r["agreed"] == [[], frag[0], r["names"]], (rank, r["agreed"])
        assert r["pending"] == [], (rank, r["pending"])
        assert r["norms"] == [False, True, True], (rank, r["norms"])  # every pp rank logs (and reduces) each sync
        assert "outer.fragment_layout='strided'" in r["refused"][0] and "resume with the saved" in r["refused"][0]
        for i, (key, saved, mine) in enumerate((("start_step", 5, 0), ("momentum_start_step", 1, 0),
                                                ("overlap_steps", 2, 1), ("inner_steps", 3, 2)), start=1):
            want = f"saved with outer.{key}={saved}, this run has outer.{key}={mine}: "
            assert want in r["refused"][i] and "resume with the saved value" in r["refused"][i], r["refused"][i]
        # the fragments' reductions on a communicator of their own (the same ranks), so on NCCL the inner steps'
        # dp collectives do not queue behind a fragment in flight
        assert r["own_communicator"] and r["gradients_on_dp_cp"], (rank, r)


def _overlap():
    """Streaming DiLoCo with each reduction overlapping tau = 2 inner steps (outer.overlap_steps=2), F = 2, H = 4,
    plain averaging (outer lr 1, no momentum, mix 1), train.steps = 5: fragment 0 sends after step 2 and is
    applied after step 4; fragment 1 sends after step 4, due after step 6, and the run's final step (5) applies
    it. After each step: the names on which the replicas agree (bitwise), the reductions in flight, and after
    step 4 how far fragment 0's weights are from the mean of the replicas' step-2 weights (what it sent)."""
    import torch.distributed as dist

    run = _run(_cfg(steps=5, extra=["outer.method=streaming_diloco", "outer.inner_steps=4", "outer.fragments=2",
                                    "outer.overlap_steps=2", "outer.lr=1.0", "outer.momentum=0.0",
                                    "outer.nesterov=false"]))
    peer = next(r for r in run.mesh.dp_cp.ranks if r != run.mesh.rank)
    agreed, pending, sent = [], [], None
    for step in range(1, 6):
        run.trainer.train_step(run.train_loader)
        mine = _params(run)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        agreed.append(sorted(k for k in mine if torch.equal(mine[k], every[peer][k])))
        pending.append([(p.fragment, p.due) for p in run.trainer.outer.pending])
        if step == 2:  # what fragment 0 sends: each replica's weights now; plain averaging applies their mean
            sent = {k: (every[0][k] + every[1][k]) / 2 for k in mine}
        if step == 4:
            err = {k: float((mine[k] - sent[k]).abs().max()) for k in mine}
            scale = {k: float(sent[k].abs().max()) for k in mine}
    return {"agreed": agreed, "pending": pending, "names": sorted(mine), "err": err, "scale": scale,
            "line": run.trainer.outer.describe()}


# -- bitwise resume ----------------------------------------------------------------------------------
RESUME_CASES = {
    "diloco_topk": ["outer.method=diloco", "outer.inner_steps=3", "outer.compression=topk",
                    "outer.topk_fraction=0.1"],
    "streaming_int8": ["outer.method=streaming_diloco", "outer.inner_steps=2", "outer.fragments=2",
                       "outer.compression=int8", "outer.mix=0.5"],
    # each reduction overlapping 2 inner steps: both fragments in flight at the save (sent after steps 1 and 2);
    # tau = H needs mix < 1 (with mix 1 the fragment would stop training)
    "streaming_tau2": ["outer.method=streaming_diloco", "outer.inner_steps=2", "outer.fragments=2",
                       "outer.overlap_steps=2", "outer.mix=0.5"],
    # resumed in the middle of the plain warm-up (steps 1-3), crossing into compression at step 4
    "powersgd": ["optim.grad_compression=powersgd", "optim.powersgd_rank=2", "optim.powersgd_start_step=3"],
    "onebit": ["optim.grad_compression=onebit"],
    # saved inside the data-parallel warm-up (steps 1-3): resumed through the anchor's snapshot at step 3
    "diloco_warmup_inside": ["outer.method=diloco", "outer.inner_steps=2", "outer.start_step=3"],
    # saved right after the warm-up (snapshot taken at step 2), the first local steps after the resume
    "streaming_warmup_after": ["outer.method=streaming_diloco", "outer.inner_steps=2", "outer.fragments=2",
                               "outer.start_step=2"],
    # FP8 delayed scaling: each replica's own amax histories (inner steps reduce over tp only), saved per rank
    "diloco_fp8_delayed": ["outer.method=diloco", "outer.inner_steps=3", "model.fp8=delayed"],
}


def _resume(tmp: str, names: list[str], cases: dict | None = None):
    """4 steps straight vs 2 steps + an async save + a fresh run resuming them for 2 more: bitwise equal. The
    saving run trains its 2 more steps before the save commits (the outer state goes to the save uncloned:
    the save's host snapshot must hold the step-2 values), and they equal the straight run's too."""
    import torch.distributed as dist

    out = {}
    for name in names:
        extra = (cases or RESUME_CASES)[name] + ["checkpoint.async_save=true"]
        straight = _run(_cfg(steps=4, extra=extra))
        ref = [straight.trainer.train_step(straight.train_loader).loss for _ in range(4)]
        run_dir = os.path.join(tmp, name)
        first = _run(_cfg(steps=4, extra=extra), run_dir=run_dir, checkpoints=True)
        for _ in range(2):
            first.trainer.train_step(first.train_loader)
        saved = []
        save = first.checkpointer.save
        first.checkpointer.save = lambda **kw: saved.extend(kw["tensors"]) or save(**kw)
        first.save()
        live = first.trainer.outer.anchor if first.trainer.outer is not None else None
        uncloned = live is None or any(st.data.data_ptr() == live.data_ptr() for st in saved)
        after = [first.trainer.train_step(first.train_loader).loss for _ in range(2)]  # the save still open
        first.checkpointer.finalize()
        dist.barrier()
        second = _run(_cfg(steps=4, extra=extra), run_dir=run_dir, checkpoints=True)
        second.resume()
        got = [second.trainer.train_step(second.train_loader).loss for _ in range(2)]
        a, b = _params(straight), _params(second)
        out[name] = {"losses": (ref[2:], got), "equal": all(torch.equal(a[k], b[k]) for k in a),
                     "after_save": after, "uncloned": uncloned,
                     "start_step": getattr(second.trainer.ddp.grad_compressor, "start_step", None)}
    return out


def _local_normalisation():
    """DiLoCo's inner step at dp2 with replica 1's loss mask halved (8 of its 16 tokens per sequence): each
    replica's local gradient is that of its OWN token mean (as a run of its own would take), and the logged
    loss is still the global batch's token mean. The reference: torch.autograd.grad of the replica's own
    masked mean through the same (not yet stepped) model, which bypasses DataParallel's hooks."""
    import torch.distributed as dist

    run = _run(_cfg(extra=["outer.method=diloco", "outer.inner_steps=2"]))
    t = run.trainer
    micro = [t._to_device(next(run.train_loader)) for _ in range(t.num_micro)]
    if dist.get_rank() == 1:
        for mb in micro:
            mb["loss_mask"][:, : SEQ // 2] = 0  # (b, s): half the loss tokens of replica 0
    t.optimizer.zero_grad()
    t.outer.begin_step(1)
    with run.mesh.ledger.capture() as cap:  # forward and backward of an inner step: no dp collective at all
        losses = t._pipeline(micro, train=True)
    logged = t._global_mean_loss(losses)
    t.ddp.finish_grad_sync()
    params = [p for p in t.chunks.parameters() if p.requires_grad]
    got = [p.main_grad.clone() for p in params]
    chunk = t.chunks[0]
    token_sums = [chunk(mb["tokens"], labels=mb["labels"], position_ids=mb["position_ids"],
                        loss_mask=mb["loss_mask"]).sum() for mb in micro]  # each (b, s) masked, summed
    own = sum(float(mb["loss_mask"].sum()) for mb in micro)
    want = torch.autograd.grad(sum(token_sums) / own, params)
    both = torch.tensor([float(sum(token_sums)), own], dtype=torch.float64)
    dist.all_reduce(both)  # the global batch's token sum and count
    return {"grad_err": max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want)),
            "logged": logged, "global_mean": float(both[0] / both[1]), "dp_calls": len(cap.select(axis="dp_cp"))}


def _fp8_inner_steps():
    """DiLoCo H=3 with FP8 delayed scaling at dp2: the inner steps 1-2 send nothing over dp (their amaxes
    are reduced over tp only, each replica keeps its own histories, which then differ), the sync at step 3
    sends the pseudo-gradient."""
    import torch.distributed as dist

    from engine.ops.fp8_linear import delayed_states

    run = _run(_cfg(extra=["outer.method=diloco", "outer.inner_steps=3", "model.fp8=delayed"]))
    sent = []
    for _ in range(3):
        with run.mesh.ledger.capture() as cap:
            run.trainer.train_step(run.train_loader)
        sent.append(_grad_bytes(cap))
        if len(sent) == 2:  # after 2 inner steps: this replica's histories against the other's
            mine = torch.cat([s.amax_history.flatten() for _, s in delayed_states(run.trainer.chunks)])
            both = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(both, mine)
            differ = not torch.equal(*both)
            inner = {"params": _params(run), "histories": mine.clone()}  # before the sync at step 3
    return {"sent": sent, "histories_differ": differ, "layers": len(delayed_states(run.trainer.chunks)), **inner}


class _ReplicaShare:
    """The samples dp replica ``r`` of 2 reads (global batches of 4, micro-batches of 1: samples
    4k + 2r and 4k + 2r + 1 of step k; engine/data/loader.py), as one process's dataset of batches of 2."""

    def __init__(self, base, r: int):
        self.base, self.r = base, r

    def __len__(self) -> int:
        return len(self.base) // 2

    def __getitem__(self, i: int) -> dict:
        return self.base[(i // 2) * 4 + 2 * self.r + i % 2]


def _fp8_replica_reference():
    """One process trained 2 steps on replica r's samples alone, FP8 delayed (for each r): what each DiLoCo
    replica's inner steps must compute, its amaxes its own."""
    from engine.assembly import build_run
    from engine.ops.fp8_linear import delayed_states
    from models.hook import ModelHook

    out = []
    for r in range(2):
        cfg = _cfg(extra=["model.fp8=delayed", "train.global_batch_size=2"])  # train.steps=3: the same lr schedule
        model = ModelHook.from_hf(HF, dtype=torch.float32, seed=cfg.train.seed, sequence_parallel=False, fp8="delayed")
        run = build_run(cfg, model=model, train_data=_ReplicaShare(_tokens(4 * (cfg.train.steps + 2)), r),
                        checkpoints=False)
        for _ in range(2):
            run.trainer.train_step(run.train_loader)
        out.append({"params": _params(run), "histories": torch.cat([s.amax_history.flatten()
                                                                     for _, s in delayed_states(run.trainer.chunks)])})
    return out


def test_each_replicas_fp8_inner_steps_equal_one_process_on_its_data(dp2):
    """DiLoCo's inner steps with FP8 delayed scaling at dp2 (H=3, after 2 inner steps) against one process
    trained on the replica's own micro-batches: every parameter and amax history bitwise equal (fp32; the
    same kernels, the amaxes reduced over nothing in both)."""
    reference = run_distributed(_fp8_replica_reference, 1)[0]
    for rank, r in enumerate(x["fp8_inner"] for x in dp2):
        want = reference[rank]
        assert torch.equal(r["histories"], want["histories"]), rank
        diff = {k: float((v - want["params"][k]).abs().max()) for k, v in r["params"].items()}
        assert max(diff.values()) == 0.0, (rank, diff)


def _momentum_start():
    """DiLoCo H=1 at dp2 for 3 steps: with the paper's outer step (lr 0.7, Nesterov 0.9) after
    outer.momentum_start_step=2, and plain averaging throughout. Steps 1-2 (plain average) are bitwise the
    same in both; at step 3 both replicas' inner steps start from the same weights, so the averaged
    pseudo-gradient is the same too, and the first momentum step moves 0.7 x (1 + 0.9) of it (a zero
    buffer: m = avg, update = avg + 0.9 m)."""
    runs = {}
    for name, extra in {"switch": ["outer.momentum_start_step=2"],
                        "average": ["outer.lr=1.0", "outer.momentum=0.0", "outer.nesterov=false"]}.items():
        run, losses, _ = _train(_cfg(steps=3, extra=["outer.method=diloco", "outer.inner_steps=1", *extra]), 0)
        norms, params = [], []
        for _ in range(3):
            norms.append(run.trainer.train_step(run.train_loader).outer["outer_step_norm"])
            params.append(_params(run))
        runs[name] = (norms, params, run.trainer.outer.describe())
    (n_s, p_s, line), (n_a, p_a, _) = runs["switch"], runs["average"]
    return {"norms": (n_s, n_a), "equal_before": [all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(p_s, p_a)],
            "line": line}


def test_streaming_overlap_steps_apply_each_fragment_tau_steps_after_it_is_sent(dp2):
    """outer.overlap_steps=2 (_overlap): fragment 0, sent after step 2, is applied after step 4 (its weights then
    the replicas' step-2 mean, within fp32 rounding: the reduction's value, 2 local steps stale, with one step
    fewer the weights would be a local step away); fragment 1, sent after step 4 and due after step 6, is
    applied by the final step 5. Nothing is left in flight."""
    for rank, r in enumerate(x["overlap"] for x in dp2):
        frag = {f: sorted(k for k in r["names"] if k.startswith(pre)) for f, pre in FRAGMENT_NAMES.items()}
        assert r["agreed"] == [[], [], [], frag[0], frag[1]], (rank, r["agreed"])
        assert r["pending"] == [[], [(0, 4)], [(0, 4)], [(1, 6)], []], (rank, r["pending"])
        for k in frag[0]:
            assert r["err"][k] <= 1e-6 * r["scale"][k], (rank, k, r["err"][k], r["scale"][k])
        assert max(r["err"][k] / r["scale"][k] for k in frag[1]) > 1e-4, rank  # fragment 1 was not averaged then
        assert "each reduction overlapping 2 inner steps" in r["line"], r["line"]


def test_outer_momentum_starts_after_momentum_start_step(dp2):
    for rank, r in enumerate(x["momentum_start"] for x in dp2):
        (s1, s2, s3), (a1, a2, a3) = r["norms"]
        assert r["equal_before"] == [True, True, False], (rank, r)
        assert (s1, s2) == (a1, a2), (rank, r)
        assert s3 == pytest.approx(0.7 * 1.9 * a3, rel=1e-5), (rank, r)
        assert "syncs up to step 2 take the plain average (outer.momentum_start_step=2)" in r["line"]


def test_fp8_delayed_scaling_keeps_each_replicas_amax_on_inner_steps(dp2):
    for rank, r in enumerate(x["fp8_inner"] for x in dp2):
        assert r["layers"] > 0, (rank, r)
        assert r["sent"][:2] == [0, 0], (rank, r)  # before: the amax all-reduce over dp on every inner step
        assert r["sent"][2] > 0, (rank, r)  # the sync
        assert r["histories_differ"], (rank, r)  # each replica scales by its own amaxes (resume: RESUME_CASES)


def test_diloco_replicas_normalise_by_their_own_loss_tokens(dp2):
    for rank, r in enumerate(x["local_norm"] for x in dp2):
        assert r["grad_err"] < 1e-5, (rank, r)  # fp32; before: 4/3 and 2/3 of it (normalised by the global count)
        assert r["logged"] == pytest.approx(r["global_mean"], rel=1e-6), (rank, r)
        assert r["dp_calls"] == 0, (rank, r)  # the replica's own count needs no all-reduce before the forward


def _all_dp2(tmp: str):
    """Every dp2 part of this file and of tests/parallel/test_grad_compression.py in one 2-rank launch."""
    from tests.parallel.test_grad_compression import _compressed, _exact_rank1, _rank_check, _small_matrix_whole, _warmup

    return {"sanity": _sanity(1), "bytes": _bytes(), "fragments": _fragments(), "resume": _resume(tmp, list(RESUME_CASES)),
            "compressed": _compressed(), "exact_rank1": _exact_rank1(), "warmup": _warmup(),
            "rank_check": _rank_check(), "small_whole": _small_matrix_whole(), "local_norm": _local_normalisation(),
            "fp8_inner": _fp8_inner_steps(), "momentum_start": _momentum_start(), "overlap": _overlap()}


_LAUNCHED: dict[str, list] = {}  # one launch per pytest process, whichever of the two files asks first


def dp2_results(tmp_path_factory) -> list[dict]:
    if "dp2" not in _LAUNCHED:
        _LAUNCHED["dp2"] = run_distributed(_all_dp2, 2, str(tmp_path_factory.mktemp("outer_dp2")), timeout=500)
    return _LAUNCHED["dp2"]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return dp2_results(tmp_path_factory)


@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_resume_is_bitwise(dp2, name):
    for rank, r in enumerate(r["resume"] for r in dp2):
        ref, got = r[name]["losses"]
        assert ref == got, (rank, name, ref, got)
        assert r[name]["after_save"] == ref, (rank, name)  # an open async save changes nothing either
        assert r[name]["equal"], (rank, name)
        assert r[name]["uncloned"], (rank, name)  # the outer anchor went to the save without a device clone
        if name == "powersgd":  # optim.powersgd_start_step reaches the compressor the assembly builds
            assert r[name]["start_step"] == 3


# -- bad inputs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,needle", [
    (["outer.method=diloco", "optim.distributed=true"], "set optim.distributed=false"),
    (["optim.grad_compression=powersgd", "optim.distributed=true"], "set optim.distributed=false"),
    (["outer.method=diloco", "outer.inner_steps=0"], "outer.inner_steps=0 must be >= 1"),
    (["outer.inner_steps=5"], "outer.method='none'"),
    (["outer.method=diloco", "outer.fragments=2", "outer.inner_steps=4"], "outer.method='streaming_diloco'"),
    (["outer.method=streaming_diloco", "outer.fragments=4", "outer.inner_steps=2"], "raise inner_steps"),
    (["outer.method=diloco", "optim.grad_compression=onebit"], "outer.compression instead"),
    (["outer.method=diloco", "outer.topk_fraction=0.5"], "outer.compression='topk'"),
    (["outer.method=diloco", "outer.fragment_layout=contiguous"], "outer.fragment_layout='contiguous' is read only"),
    (["outer.method=streaming_diloco", "outer.fragments=5"], "set outer.fragments <= 4"),
    (["outer.method=streaming_diloco", "outer.fragments=2", "outer.fragment_layout=rows"],
     "outer.fragment_layout"),
    (["optim.powersgd_rank=8"], "optim.grad_compression='powersgd'"),
    (["optim.powersgd_start_step=5"], "optim.powersgd_start_step is read only"),
    (["optim.grad_compression=powersgd", "optim.powersgd_start_step=-1"], "must be an integer >= 0"),
    (["outer.method=diloco", "outer.start_step=-1"], "outer.start_step=-1 must be an integer >= 0"),
    (["outer.method=diloco", "outer.start_step=3"], "not below train.steps=3"),
    (["outer.start_step=2"], "outer.method='none'"),
    (["outer.method=diloco", "outer.momentum_start_step=-1"], "must be an integer >= 0"),
    (["outer.method=diloco", "outer.start_step=2", "outer.momentum_start_step=2"], "set it above outer.start_step"),
    (["outer.method=diloco", "outer.lr=1.0", "outer.momentum=0.0", "outer.nesterov=false",
      "outer.momentum_start_step=1"], "already takes the plain average"),
    (["outer.method=diloco", "outer.inner_steps=1", "outer.momentum_start_step=3"],
     "not below the run's last sync (applied at step 3 of train.steps=3)"),
    (["outer.method=streaming_diloco", "outer.inner_steps=2", "outer.fragments=2", "outer.momentum_start_step=3"],
     "not below the run's last sync (applied at step 3"),
    (["outer.method=diloco", "outer.inner_steps=2", "outer.momentum_start_step=1"],
     "before the first sync (applied at step 2)"),
    (["outer.method=diloco", "outer.momentum_start_step=1"], "no sync is applied in train.steps=3"),
    (["outer.method=diloco", "outer.inner_steps=1", "train.max_tokens=128", "outer.momentum_start_step=2"],
     "applied at step 2 of train.steps=3 (train.max_tokens stops it after step 2)"),
    (["outer.momentum_start_step=1"], "outer.method='none'"),
    (["outer.method=streaming_diloco", "outer.inner_steps=2", "outer.fragments=2", "outer.overlap_steps=3"],
     "outer.overlap_steps=3 must be an integer in [1, outer.inner_steps=2]"),
    (["outer.method=streaming_diloco", "outer.overlap_steps=0"], "must be an integer in [1, outer.inner_steps=10]"),
    (["outer.method=diloco", "outer.overlap_steps=2"], "is read by outer.method='streaming_diloco'"),
    (["outer.method=diloco", "outer.inner_steps=1", "outer.overlap_steps=2"], "is read by outer.method='stream"),
    (["outer.method=streaming_diloco", "outer.inner_steps=2", "outer.fragments=2", "outer.overlap_steps=2"],
     "the fragment would stop training; lower outer.overlap_steps below outer.inner_steps or set outer.mix below 1"),
    (["outer.method=streaming_diloco", "outer.inner_steps=1"], "equals outer.inner_steps=1 with outer.mix=1"),
    # stopped by train.max_tokens after step 14 (64 tokens a step), H = 4, tau = 3: the syncs sent after steps
    # 4 and 8 are applied after 7 and 11, the one sent after 12 not before the stop (it said 7 until 2026-11-28)
    (["train.steps=20", "train.max_tokens=896", "outer.method=streaming_diloco", "outer.inner_steps=4",
      "outer.overlap_steps=3", "outer.momentum_start_step=11"],
     "not below the run's last sync (applied at step 11 of train.steps=20 (train.max_tokens stops it after step 14))"),
    (["outer.overlap_steps=2"], "outer.method='none'"),
    # the first sync is applied tau = 2 steps after fragment 0 sends at step 2: at step 4 (tau = 1: at step 3)
    (["train.steps=8", "outer.method=streaming_diloco", "outer.inner_steps=4", "outer.fragments=2",
      "outer.overlap_steps=2", "outer.momentum_start_step=3"], "before the first sync (applied at step 4)"),
])
def test_bad_inputs_are_refused(extra, needle):
    with pytest.raises(ValueError, match=None) as err:
        _cfg(extra=extra)
    assert needle in str(err.value), str(err.value)


def test_a_momentum_switch_before_the_last_overlapped_sync_is_accepted():
    """The refusal just above, one step earlier: momentum_start_step=10 is before the sync applied after step 11
    (refused until 2026-11-28, whose check saw the last sync at step 7)."""
    cfg = _cfg(extra=["train.steps=20", "train.max_tokens=896", "outer.method=streaming_diloco", "outer.inner_steps=4",
                      "outer.overlap_steps=3", "outer.momentum_start_step=10"])
    assert cfg.outer.momentum_start_step == 10


def test_contiguous_fragments_with_tied_copies_on_two_stages_are_refused():
    from models.hook import ModelHook

    cfg = _cfg(extra=["parallel.pp=2", "outer.method=streaming_diloco", "outer.inner_steps=2", "outer.fragments=2",
                      "outer.fragment_layout=contiguous", "model.tie_word_embeddings=true"])
    with pytest.raises(ValueError, match="would sync at different steps.*outer.fragment_layout='strided'"):
        ModelHook.from_run_config(cfg, tokenizer_vocab=None)


def _nonfinite_on_one_replica():
    """DiLoCo's inner step at dp2, a NaN in rank 1's local gradient only: both replicas skip (no rank waits
    alone in the report's collective) and keep the same step count."""
    import torch.distributed as dist

    run = _run(_cfg(extra=["outer.method=diloco", "outer.inner_steps=2"]))
    opt = run.trainer.optimizer
    if dist.get_rank() == 1:
        prepare = opt.dist.prepare_grads

        def poisoned():
            prepare()
            opt.dist.pieces[0].grad[0] = float("nan")
        opt.dist.prepare_grads = poisoned
    st = run.trainer.train_step(run.train_loader)
    return st.applied, math.isnan(st.grad_norm), opt.step_count


def test_a_nonfinite_local_gradient_is_skipped_by_every_replica():
    assert run_distributed(_nonfinite_on_one_replica, 2, timeout=120) == [(False, True, 0)] * 2


def _model_only_load(tmp):
    """checkpoint.load of a model (no trainer state) into a DiLoCo run: the anchor is the loaded weights."""
    import torch.distributed as dist

    a = _run(_cfg(extra=["checkpoint.async_save=false"]), run_dir=os.path.join(tmp, "a"), checkpoints=True)
    for _ in range(2):
        a.trainer.train_step(a.train_loader)
    a.save()
    a.checkpointer.finalize()
    dist.barrier()
    b = _run(_cfg(extra=["checkpoint.async_save=false", f"checkpoint.load={a.checkpointer.latest()}",
                         "outer.method=diloco", "outer.inner_steps=2"]), run_dir=os.path.join(tmp, "b"), checkpoints=True)
    b.resume()
    st = b.trainer.outer.state_tensors()
    return float((st["anchor"] - st["local.master"]).abs().max()), float((st["anchor"] - b.trainer.outer.anchor).abs().max())


def test_a_model_only_load_anchors_the_outer_loop_at_the_loaded_weights(tmp_path):
    for gap, _ in run_distributed(_model_only_load, 2, str(tmp_path), timeout=180):
        assert gap == 0.0


def _resume_with_other_settings(tmp):
    """Saved with outer momentum 0 (no momentum state), resumed with 0.9: refused, not restarted silently."""
    import torch.distributed as dist

    base = ["checkpoint.async_save=false", "outer.method=diloco", "outer.inner_steps=2", "outer.nesterov=false"]
    a = _run(_cfg(extra=base + ["outer.momentum=0.0"]), run_dir=tmp, checkpoints=True)
    for _ in range(2):
        a.trainer.train_step(a.train_loader)
    a.save()
    a.checkpointer.finalize()
    dist.barrier()
    b = _run(_cfg(extra=base + ["outer.momentum=0.9"]), run_dir=tmp, checkpoints=True)
    try:
        b.resume()
    except ValueError as e:
        return str(e)
    return None


def test_resuming_with_other_outer_settings_is_refused(tmp_path):
    for msg in run_distributed(_resume_with_other_settings, 2, str(tmp_path), timeout=180):
        assert msg is not None and "outer state without momentum" in msg and "resume with the saved settings" in msg
