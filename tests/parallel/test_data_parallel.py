"""Data parallelism: bucket layout, overlapped reduction, ZeRO-1/2 optimizer, clipping, ledger, memory.

Parity: after 3 AdamW steps (warmup + cosine LR, weight decay with no-decay groups, global clipping
active) the parameters equal a single-process ``torch.optim.AdamW(foreach=False)`` +
``clip_grad_norm_`` run on the same global batch within fp32 tolerance ``atol=2e-6, rtol=1e-5``
(different summation order of the reductions), and the global gradient norm equals
``clip_grad_norm_``'s within ``rtol=1e-5``, in every layout: dp=2, dp=4 (zero 0/1/2), dp=2 x pp=2
(pipeline runtime, tied embedding), dp=2 x tp=2 (TP/SP layers). Ledger and optimizer bytes are
asserted exactly against their formulas.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.optim import LRSchedule, NonFiniteGradError, Optimizer
from parallel.comm import Group
from parallel.data_parallel import DataParallel, num_microbatches, plan_buckets
from parallel.testing import run_distributed

IN, H, OUT = 8, 16, 4
GLOBAL_BATCH, MBS, STEPS = 16, 4, 3
BUCKET = 600  # elements: ~7 buckets for the 3556-parameter MLP
LR, MIN_LR, WARMUP, WD, BETAS, EPS, CLIP = 1e-2, 1e-3, 1, 0.1, (0.9, 0.95), 1e-8, 0.5
ATOL, RTOL = 2e-6, 1e-5


def _schedule():
    return LRSchedule(lr=LR, min_lr=MIN_LR, warmup_steps=WARMUP, total_steps=STEPS, decay_style="cosine")


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 2 * h)
        self.fc2 = nn.Linear(2 * h, h)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def make_mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, H), Block(H), Block(H), Block(H), nn.LayerNorm(H), nn.Linear(H, OUT)).to(dtype)


def global_batch():
    g = torch.Generator().manual_seed(7)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def reference_run(model, loss_of_model, steps=STEPS, skip=None):
    """Single process: torch AdamW (single-tensor path) on the whole global batch, clip_grad_norm_.
    Step ``skip`` is dropped (its gradient discarded; the LR schedule and Adam's count do not advance)."""
    decay = [p for p in model.parameters() if p.ndim >= 2 and not getattr(p, "no_weight_decay", False)]
    no_decay = [p for p in model.parameters() if not (p.ndim >= 2 and not getattr(p, "no_weight_decay", False))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS, foreach=False)
    sched, norms, applied = _schedule(), [], 0
    for step in range(steps):
        if step == skip:
            continue
        opt.zero_grad()
        loss_of_model(model).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        for g in opt.param_groups:
            g["lr"] = sched(applied)
        opt.step()
        applied += 1
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _mlp_reference():
    X, Y = global_batch()
    return reference_run(make_mlp(), lambda m: F.mse_loss(m(X), Y))


def _records(cap, start):
    return [(r.op, r.axis, r.payload_bytes, r.sent_bytes, r.recv_bytes) for r in cap.records[start:]]


def _pending_gathers(ddp):
    return sum(b.gather_work is not None for _, b in ddp.buckets())


def _layout(ddp):
    return [dict(numel=buf.numel, unpadded=buf.numel_unpadded, itemsize=buf.param_data.element_size(),
                 buckets=[b.numel for b in buf.buckets]) for buf in ddp.flat_buffers]


def _train(mesh, ddp, opt, xs, ys, *, steps, inject=None):
    """Run ``steps`` optimizer steps over this rank's micro-batches; record what the tests assert."""
    with mesh.ledger.capture() as cap:
        return _train_captured(cap, mesh, ddp, opt, xs, ys, steps=steps, inject=inject)


def _train_captured(ledger, mesh, ddp, opt, xs, ys, *, steps, inject):
    m = len(xs)
    marks = []  # dp reductions launched when the first layer's weight gradient is final
    start = [0]
    first = ddp.module[0].weight
    first.register_post_accumulate_grad_hook(
        lambda p: marks.append(sum(1 for r in ledger.records[start[0]:]
                                   if r.axis == mesh.dp.axis and r.op in ("all_reduce", "reduce_scatter"))))
    out = dict(norms=[], lrs=[], coefs=[], applied=[], messages=[], ledger=[], at_first_layer=[],
               at_backward_end=[], pending_after_step=[], pending_after_forward=[], errors=[])
    for step in range(steps):
        start[0] = len(ledger.records)
        opt.zero_grad()
        for i in range(m):
            with ddp.no_sync() if i < m - 1 else contextlib.nullcontext():
                pred = ddp(xs[i])
                if i == 0:
                    out["pending_after_forward"].append(_pending_gathers(ddp))
                (F.mse_loss(pred, ys[i]) / m).backward()
        out["at_first_layer"].append(marks[-1])
        out["at_backward_end"].append(sum(1 for r in ledger.records[start[0]:] if r.axis == mesh.dp.axis))
        if inject is not None and step == inject["step"]:
            if mesh.dp.rank == inject["rank"]:
                with torch.no_grad():
                    dict(ddp.module.named_parameters())[inject["name"]].main_grad.view(-1)[0] = inject["value"]
        try:
            res = opt.step()
        except NonFiniteGradError as e:
            out["errors"].append(str(e))
            return out
        out["pending_after_step"].append(_pending_gathers(ddp))
        out["ledger"].append(_records(ledger, start[0]))
        for k, v in (("norms", res.grad_norm), ("lrs", res.lr), ("coefs", res.clip_coef), ("applied", res.applied),
                     ("messages", res.message)):
            out[k].append(v)
    ddp.finish_param_sync()
    return out


def _run_mlp_config(mesh, cfg):
    dp, rank = mesh.dp.size, mesh.dp.rank
    model = make_mlp(cfg.get("dtype", torch.float32))
    ddp = DataParallel(model, dp_group=mesh.dp, tp_group=mesh.tp, zero_stage=cfg["zero"], bucket_size=BUCKET,
                       overlap_grad_reduce=cfg.get("overlap", True), overlap_param_gather=cfg.get("overlap_param", False),
                       max_inflight_buckets=cfg.get("max_inflight"))
    opt = Optimizer(ddp, schedule=_schedule(), weight_decay=WD, betas=BETAS, eps=EPS, clip_grad=CLIP,
                    nonfinite=cfg.get("nonfinite", "skip"), tp_group=mesh.tp, pp_group=mesh.pp)
    X, Y = (t.to(cfg.get("dtype", torch.float32)) for t in global_batch())
    mbs = cfg.get("mbs", MBS)
    per = GLOBAL_BATCH // dp
    m = num_microbatches(GLOBAL_BATCH, mbs, dp)
    xs, ys = X[rank * per:(rank + 1) * per].split(mbs), Y[rank * per:(rank + 1) * per].split(mbs)
    assert len(xs) == m
    out = _train(mesh, ddp, opt, xs, ys, steps=cfg.get("steps", STEPS), inject=cfg.get("inject"))
    out["params"] = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    out["layout"] = _layout(ddp)
    out["state_bytes"] = opt.state_bytes()
    out["grad_bytes"] = ddp.grad_buffer_bytes()
    out["lazy_peak"] = ddp.lazy_grad_bytes_peak
    out["main_grad_fp32"] = all(pc.grad.dtype == torch.float32 and pc.master.dtype == torch.float32
                                for pc in opt.dist.pieces)
    # Each rank's updated params equal its fp32 masters cast to the param dtype.
    out["params_match_masters"] = all(
        torch.equal(pc.param.detach().view(-1)[pc.lo:pc.hi], pc.master.to(pc.param.dtype)) for pc in opt.dist.pieces)
    return out


def _sum_vs_mean(mesh):
    """grad_reduce="sum" gives dp times the "mean" gradient (same data, same model)."""
    X, Y = global_batch()
    x, y = X.chunk(mesh.dp.size)[mesh.dp.rank], Y.chunk(mesh.dp.size)[mesh.dp.rank]
    grads = {}
    for mode in ("mean", "sum"):
        ddp = DataParallel(make_mlp(), dp_group=mesh.dp, grad_reduce=mode, bucket_size=BUCKET)
        F.mse_loss(ddp(x), y).backward()
        ddp.finish_grad_sync()
        grads[mode] = torch.cat([p.main_grad.view(-1) for p in ddp.module.parameters()])
    return float((grads["sum"] - mesh.dp.size * grads["mean"]).abs().max()), float(grads["mean"].abs().max())


def _dp_worker(dp, configs, extras=False):
    from parallel.mesh import Mesh, ParallelDims
    mesh = Mesh.build(ParallelDims(dp=dp))
    out = {name: _run_mlp_config(mesh, cfg) for name, cfg in configs.items()}
    if extras:
        out["_sum_vs_mean"] = _sum_vs_mean(mesh)
    return out


def _check_parity(res, ref_params, ref_norms, *, steps=STEPS):
    for name, p in ref_params.items():
        torch.testing.assert_close(res["params"][name], p, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")
    assert res["norms"] == pytest.approx(ref_norms[:steps], rel=RTOL)
    assert res["lrs"] == pytest.approx([_schedule()(s) for s in range(steps)], rel=1e-12)
    assert min(res["coefs"]) < 1.0  # clipping really acted


def _check_ledger(res, *, dp, zero):
    """Exact bytes on the dp axis per step: the buffer is reduced once (one call per bucket)."""
    (lay,) = res["layout"]
    numel, nb = lay["numel"], len(lay["buckets"])
    for recs in res["ledger"]:
        dp_recs = [r for r in recs if r[1] == "dp"]
        by_op = {}
        for op, _, payload, sent, recv in dp_recs:
            by_op.setdefault(op, []).append((payload, sent, recv))
        if zero == 0:
            assert set(by_op) == {"all_reduce"}
            assert sorted(x[0] for x in by_op["all_reduce"]) == sorted(4 * n for n in lay["buckets"])
            assert sum(x[0] for x in by_op["all_reduce"]) == 4 * numel  # fp32 buffer bytes incl. padding
            assert sum(x[1] for x in by_op["all_reduce"]) == pytest.approx(2 * (dp - 1) / dp * 4 * numel)
        else:
            assert set(by_op) == {"reduce_scatter", "all_gather", "all_reduce"}
            assert len(by_op["reduce_scatter"]) == nb and len(by_op["all_gather"]) == nb
            assert sum(x[0] for x in by_op["reduce_scatter"]) == 4 * numel
            assert sum(x[1] for x in by_op["reduce_scatter"]) == pytest.approx((dp - 1) / dp * 4 * numel)
            assert sum(x[0] for x in by_op["all_gather"]) == lay["itemsize"] * numel // dp  # shards of params
            assert sum(x[1] for x in by_op["all_gather"]) == (dp - 1) * lay["itemsize"] * numel // dp
            assert by_op["all_reduce"] == [(4, 2 * (dp - 1) / dp * 4, 2 * (dp - 1) / dp * 4)]  # the norm's sum


def _check_memory(res, *, dp, zero, master_bytes):
    (lay,) = res["layout"]
    numel, psi = lay["numel"], lay["unpadded"]
    owned = numel // dp if zero else numel
    assert all(n % dp == 0 for n in lay["buckets"]) and numel - psi < dp * len(lay["buckets"])
    assert res["state_bytes"] == (master_bytes + 8) * owned  # = K*Psi/dp + K*padding/dp
    assert res["grad_bytes"] == (4 * numel // dp if zero == 2 else 4 * numel)


MLP_CONFIGS = {
    "zero0": dict(zero=0),
    "zero0_no_overlap": dict(zero=0, overlap=False),
    "zero1": dict(zero=1),
    "zero1_overlap_param": dict(zero=1, overlap_param=True),
    "zero2": dict(zero=2, mbs=8, max_inflight=1),  # one micro-batch: the lazy-gradient memory bound applies
}


def test_dp2_parity_overlap_ledger_memory_nonfinite():
    configs = dict(MLP_CONFIGS)
    configs["bf16_zero1"] = dict(zero=1, dtype=torch.bfloat16, steps=1)
    configs["nan_skip"] = dict(zero=0, overlap=False, inject=dict(step=1, rank=1, name="2.fc1.weight",
                                                                   value=float("nan")))
    configs["inf_stop"] = dict(zero=1, overlap=False, nonfinite="stop",
                               inject=dict(step=0, rank=1, name="2.fc1.weight", value=float("inf")))
    results = run_distributed(_dp_worker, 2, 2, configs, extras=True, timeout=170)
    ref_params, ref_norms = _mlp_reference()
    diff, scale = results[0]["_sum_vs_mean"]
    assert diff <= 1e-6 * scale and scale > 0
    for name in MLP_CONFIGS:
        for rank in range(2):
            res = results[rank][name]
            _check_parity(res, ref_params, ref_norms)
            _check_ledger(res, dp=2, zero=configs[name]["zero"])
            _check_memory(res, dp=2, zero=configs[name]["zero"], master_bytes=0)  # fp32: master = params
            assert res["main_grad_fp32"] and res["params_match_masters"]
    # Overlap: all buckets but the first layer's were launched before backward reached the first
    # layer, all of them before backward returned; with overlap off, none until the optimizer step.
    nb = len(results[0]["zero0"]["layout"][0]["buckets"])
    assert nb >= 4
    for name in ("zero0", "zero1", "zero2"):
        assert all(n >= nb - 1 for n in results[0][name]["at_first_layer"]), results[0][name]["at_first_layer"]
        assert results[0][name]["at_backward_end"] == [nb] * STEPS
    assert results[0]["zero0_no_overlap"]["at_first_layer"] == [0] * STEPS
    assert results[0]["zero0_no_overlap"]["at_backward_end"] == [0] * STEPS
    # Overlapped parameter all-gather: every bucket pending after the step, none after the next forward.
    assert results[0]["zero1_overlap_param"]["pending_after_step"] == [nb] * STEPS
    assert results[0]["zero1_overlap_param"]["pending_after_forward"] == [0] * STEPS
    assert results[0]["zero1"]["pending_after_step"] == [0] * STEPS
    # ZeRO-2, one micro-batch, at most one bucket in flight: the full fp32 gradient never exists at once.
    lay = results[0]["zero2"]["layout"][0]
    assert 0 < results[0]["zero2"]["lazy_peak"] <= 4 * 2 * max(lay["buckets"]) < 4 * lay["numel"]
    # Mixed precision: bf16 params, fp32 main grads and masters, 12 bytes of state per owned element.
    for rank in range(2):
        bf = results[rank]["bf16_zero1"]
        assert bf["layout"][0]["itemsize"] == 2 and bf["main_grad_fp32"] and bf["params_match_masters"]
        _check_memory(bf, dp=2, zero=1, master_bytes=4)
        _check_ledger(bf, dp=2, zero=1)
    for n, p in results[0]["bf16_zero1"]["params"].items():
        assert torch.equal(p, results[1]["bf16_zero1"]["params"][n]), n  # replicas identical after all-gather
    # NaN, skip: step 1 skipped on both ranks (no update), training continues.
    X, Y = global_batch()
    ref2, _ = reference_run(make_mlp(), lambda m: F.mse_loss(m(X), Y), skip=1)
    for rank in range(2):
        res = results[rank]["nan_skip"]
        assert res["applied"] == [True, False, True]
        # After the all-reduce every replica holds the NaN: each names the parameter and the lowest rank.
        assert "rank %d: first non-finite gradient in parameter '2.fc1.weight'" % rank in res["messages"][1]
        assert "lowest rank with a non-finite gradient: 0" in res["messages"][1]
        for name, p in ref2.items():
            torch.testing.assert_close(res["params"][name], p, atol=ATOL, rtol=RTOL)
    # Inf, stop: every rank raises; the owner of the element names the parameter, all name the rank.
    msgs = [results[r]["inf_stop"]["errors"] for r in range(2)]
    assert all(len(m) == 1 for m in msgs)
    owner = [r for r in range(2) if "'2.fc1.weight'" in msgs[r][0]]
    assert len(owner) == 1
    assert f"lowest rank with a non-finite gradient: {owner[0]}" in msgs[1 - owner[0]][0]
    assert "local gradients finite" in msgs[1 - owner[0]][0] and "nonfinite='stop'" in msgs[0][0]


def test_dp4_parity_ledger_memory():
    # 2 micro-batches of 2 samples per rank (gradient accumulation), every stage.
    configs = {"zero0": dict(zero=0, mbs=2), "zero1": dict(zero=1, mbs=2), "zero2": dict(zero=2, mbs=2)}
    results = run_distributed(_dp_worker, 4, 4, configs, timeout=170)
    ref_params, ref_norms = _mlp_reference()
    for name, cfg in configs.items():
        for rank in range(4):
            res = results[rank][name]
            _check_parity(res, ref_params, ref_norms)
            _check_ledger(res, dp=4, zero=cfg["zero"])
            _check_memory(res, dp=4, zero=cfg["zero"], master_bytes=0)


# ---------------------------------------------------------------------------------------------------
# dp=2 x pp=2: the pipeline runtime (1F1B), a tied embedding whose last-stage copy is shared_embedding
# ---------------------------------------------------------------------------------------------------
V, SEQ = 32, 4


class TiedLM(nn.Module):
    """Reference: embedding, 4 blocks, final norm, logits = h @ embedding^T (tied)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Block(H) for _ in range(4))
        self.ln = nn.LayerNorm(H)
        self.emb.weight.no_weight_decay = True

    def forward(self, ids):
        h = self.emb(ids)  # (b, s, h)
        for blk in self.blocks:
            h = blk(h)
        return self.ln(h) @ self.emb.weight.t()  # (b, s, V)


class Stage0(nn.Module):
    def __init__(self, full):
        super().__init__()
        self.emb = full.emb
        self.blocks = nn.ModuleList(full.blocks[:2])
        self.emb.weight.defer_grad_reduce = True  # summed with the last stage's copy before the DP reduction

    def forward(self, ids):
        h = self.emb(ids)
        for blk in self.blocks:
            h = blk(h)
        return h


class Stage1(nn.Module):
    def __init__(self, full):
        super().__init__()
        self.blocks = nn.ModuleList(full.blocks[2:])
        self.ln = full.ln
        self.head = nn.Parameter(full.emb.weight.detach().clone())
        self.head.shared_embedding = True  # reduced after the tied-copy sum (deferred bucket)
        self.head.shared = True  # counted once in the norm (the first stage's copy counts)
        self.head.no_weight_decay = True

    def forward(self, h):
        for blk in self.blocks:
            h = blk(h)
        return self.ln(h) @ self.head.t()


def lm_batch():
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, V, (GLOBAL_BATCH, SEQ), generator=g), torch.randint(0, V, (GLOBAL_BATCH, SEQ), generator=g)


def _lm_loss(logits, tgt):
    return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))  # (b*s, V)


def _pp_stage_names(stage):
    """Stage parameter name -> reference parameter name."""
    full = TiedLM()
    mod = Stage0(full) if stage == 0 else Stage1(full)
    out = {}
    for n, _ in mod.named_parameters():
        if n.startswith("blocks."):
            i, rest = n.split(".", 2)[1:]
            out[n] = f"blocks.{int(i) + 2 * stage}.{rest}"
        else:
            out[n] = {"head": "emb.weight"}.get(n, n)
    return out


def _pp_worker(configs):
    from parallel.mesh import Mesh, ParallelDims
    from parallel.pipeline import build_schedule
    from parallel.pipeline.runtime import allreduce_tied_embedding_grads, run_schedule
    mesh = Mesh.build(ParallelDims(dp=2, pp=2))
    dp, stage = mesh.dp.size, mesh.pp.rank
    ids, tgt = lm_batch()
    per = GLOBAL_BATCH // dp
    results = {}
    for name, cfg in configs.items():
        m = num_microbatches(GLOBAL_BATCH, cfg["mbs"], dp)
        sl = slice(mesh.dp.rank * per, (mesh.dp.rank + 1) * per)
        mb_ids, mb_tgt = ids[sl].split(cfg["mbs"]), tgt[sl].split(cfg["mbs"])
        full = TiedLM()
        model = Stage0(full) if stage == 0 else Stage1(full)
        ddp = DataParallel(model, dp_group=mesh.dp, zero_stage=cfg["zero"], bucket_size=BUCKET)
        opt = Optimizer(ddp, schedule=_schedule(), weight_decay=WD, betas=BETAS, eps=EPS, clip_grad=CLIP,
                        tp_group=mesh.tp, pp_group=mesh.pp)
        tied = [model.emb.weight] if stage == 0 else [model.head]
        sched = build_schedule("1f1b", pp=2, vp=1, microbatches=m)

        def forward_step(chunk, x, mb):
            if stage == 0:
                return ddp(mb_ids[mb])
            return _lm_loss(ddp(x), mb_tgt[mb])

        out = dict(norms=[], ledger=[])
        for _ in range(STEPS):
            with mesh.ledger.capture() as cap:
                opt.zero_grad()
                ddp.is_last_microbatch = False  # the runtime re-enables it before each chunk's last backward
                run_schedule(sched, rank=stage, pp_group=mesh.pp, forward_step=forward_step,
                             act_shape=(cfg["mbs"], SEQ, H), dtype=torch.float32,
                             grad_sync=lambda chunk: setattr(ddp, "is_last_microbatch", True))
                allreduce_tied_embedding_grads(tied, mesh.embedding)
                res = opt.step()
            out["norms"].append(res.grad_norm)
            out["ledger"].append(_records(cap, 0))
        out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["layout"] = _layout(ddp)
        out["state_bytes"] = opt.state_bytes()
        out["grad_bytes"] = ddp.grad_buffer_bytes()
        results[name] = out
    return stage, results


def test_dp2_pp2_pipeline_runtime_tied_embedding():
    configs = {"zero0": dict(zero=0, mbs=2), "zero1": dict(zero=1, mbs=2), "zero2": dict(zero=2, mbs=4)}
    results = run_distributed(_pp_worker, 4, configs, timeout=170)
    ids, tgt = lm_batch()
    ref_params, ref_norms = reference_run(TiedLM(), lambda m: _lm_loss(m(ids), tgt))
    for name, cfg in configs.items():
        for stage, res_all in results:
            res = res_all[name]
            for n, ref_name in _pp_stage_names(stage).items():
                torch.testing.assert_close(res["params"][n], ref_params[ref_name], atol=ATOL, rtol=RTOL,
                                           msg=lambda msg: f"{name} stage {stage} {n}: {msg}")
            assert res["norms"] == pytest.approx(ref_norms, rel=RTOL)
            _check_memory(res, dp=2, zero=cfg["zero"], master_bytes=0)
            for recs in res["ledger"]:
                dp_reduce = [r for r in recs if r[1] == "dp" and r[0] in ("all_reduce", "reduce_scatter")
                             and r[2] > 4]  # the 4-byte norm all-reduce aside
                assert sum(r[2] for r in dp_reduce) == 4 * res["layout"][0]["numel"]
                assert sum(1 for r in recs if r[1] == "embedding") == 1  # the tied-gradient sum


# ---------------------------------------------------------------------------------------------------
# dp=2 x tp=2: tensor/sequence-parallel layers (replicated, sharded and sequence-parallel params)
# ---------------------------------------------------------------------------------------------------
S_TP = 4  # sequence length (divisible by tp for sequence parallelism)


class TPBlock(nn.Module):
    def __init__(self, tp_group):
        super().__init__()
        from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, mark_replicated
        self.ln = nn.LayerNorm(H)
        for p in self.ln.parameters():
            mark_replicated(p, sequence_parallel=True)  # applied to (s/tp) tokens: partial gradient
        self.fc1 = ColumnParallelLinear(H, 2 * H, tp_group=tp_group, sequence_parallel=True)
        self.fc2 = RowParallelLinear(2 * H, H, tp_group=tp_group, sequence_parallel=True)

    def forward(self, x):  # (s/tp, b, h)
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TPModel(nn.Module):
    """Replicated input/output projections around 2 sequence-parallel blocks; (s, b, in) -> (s, b, out)."""

    def __init__(self, tp_group):
        super().__init__()
        from parallel.tensor_parallel import mark_replicated
        torch.manual_seed(3)
        self.tp_group = tp_group
        self.inp = nn.Linear(IN, H)
        self.blocks = nn.ModuleList(TPBlock(tp_group) for _ in range(2))
        self.ln = nn.LayerNorm(H)
        self.head = nn.Linear(H, OUT)
        for p in [*self.inp.parameters(), *self.head.parameters()]:
            mark_replicated(p)
        for p in self.ln.parameters():
            mark_replicated(p, sequence_parallel=True)

    def forward(self, x):
        from parallel.mappings import gather_from_sp, scatter_to_sp
        h = scatter_to_sp(self.inp(x), self.tp_group)  # (s/tp, b, h)
        for blk in self.blocks:
            h = blk(h)
        h = gather_from_sp(self.ln(h), self.tp_group, grad_is_partial=False)  # (s, b, h), loss on every rank
        return self.head(h)


def tp_batch():
    g = torch.Generator().manual_seed(5)
    return torch.randn(S_TP, GLOBAL_BATCH, IN, generator=g), torch.randn(S_TP, GLOBAL_BATCH, OUT, generator=g)


def _tp_worker(configs):
    from parallel.mesh import Mesh, ParallelDims
    from parallel.tensor_parallel import full_param
    mesh = Mesh.build(ParallelDims(dp=2, tp=2))
    X, Y = tp_batch()
    per = GLOBAL_BATCH // mesh.dp.size
    sl = slice(mesh.dp.rank * per, (mesh.dp.rank + 1) * per)
    results = {}
    for name, cfg in configs.items():
        m = num_microbatches(GLOBAL_BATCH, cfg["mbs"], mesh.dp.size)
        xs, ys = X[:, sl].split(cfg["mbs"], dim=1), Y[:, sl].split(cfg["mbs"], dim=1)  # (s, mbs, .)
        model = TPModel(mesh.tp)
        ddp = DataParallel(model, dp_group=mesh.dp, tp_group=mesh.tp, zero_stage=cfg["zero"], bucket_size=BUCKET)
        opt = Optimizer(ddp, schedule=_schedule(), weight_decay=WD, betas=BETAS, eps=EPS, clip_grad=CLIP,
                        tp_group=mesh.tp, pp_group=mesh.pp)
        norms, ledgers = [], []
        for _ in range(STEPS):
            with mesh.ledger.capture() as cap:
                opt.zero_grad()
                for i in range(m):
                    with ddp.no_sync() if i < m - 1 else contextlib.nullcontext():
                        (F.mse_loss(ddp(xs[i]), ys[i]) / m).backward()
                norms.append(opt.step().grad_norm)
            ledgers.append(_records(cap, 0))
        results[name] = dict(norms=norms, ledger=ledgers, layout=_layout(ddp),
                             params={n: full_param(p, mesh.tp).clone() for n, p in model.named_parameters()})
    return results


def test_dp2_tp2_sequence_parallel():
    pytest.importorskip("parallel.tensor_parallel", reason="parallel.tensor_parallel layers not in the repo yet")
    configs = {"zero0": dict(zero=0, mbs=4), "zero1": dict(zero=1, mbs=4)}
    results = run_distributed(_tp_worker, 4, configs, timeout=170)
    X, Y = tp_batch()
    ref_params, ref_norms = reference_run(TPModel(Group.trivial("tp")), lambda m: F.mse_loss(m(X), Y))
    for name, cfg in configs.items():
        for rank in range(4):
            res = results[rank][name]
            for n, p in ref_params.items():
                torch.testing.assert_close(res["params"][n], p, atol=ATOL, rtol=RTOL,
                                           msg=lambda msg: f"{name} rank {rank} {n}: {msg}")
            assert res["norms"] == pytest.approx(ref_norms, rel=RTOL)
            for recs in res["ledger"]:
                dp_reduce = [r for r in recs if r[1] == "dp" and r[0] in ("all_reduce", "reduce_scatter") and r[2] > 4]
                assert sum(r[2] for r in dp_reduce) == 4 * res["layout"][0]["numel"]


# ---------------------------------------------------------------------------------------------------
# Single process: layout, hooks, bad input
# ---------------------------------------------------------------------------------------------------
def test_plan_buckets_closes_at_size_and_pads_to_dp():
    # placement order as given; bucket_size 25, dp 4: [10, 20] -> 30 (pad 32), [30] -> 30 (pad 32), [5] -> 8
    offsets, buckets, total = plan_buckets([10, 20, 30, 5], bucket_size=25, dp=4)
    assert offsets == [(0, 10), (10, 30), (32, 62), (64, 69)]
    assert [(b.start, b.end, b.members) for b in buckets] == [(0, 32, (0, 1)), (32, 64, (2,)), (64, 72, (3,))]
    assert total == 72 and all(b.numel % 4 == 0 for b in buckets)
    _, buckets, total = plan_buckets([10, 20, 30, 5], bucket_size=25, dp=2, align=8)  # quantum 16
    assert [(b.start, b.end) for b in buckets] == [(0, 32), (32, 64), (64, 80)] and total == 80
    _, buckets, _ = plan_buckets([4, 4, 4], bucket_size=100, dp=1, separate=[False, True, False])
    assert [b.members for b in buckets] == [(0,), (1,), (2,)]  # a deferred tensor gets a bucket of its own
    _, buckets, _ = plan_buckets([4, 4, 4], bucket_size=None, dp=1)
    assert [b.members for b in buckets] == [(0, 1, 2)]


def test_buffers_place_params_in_reverse_order_as_views():
    model = make_mlp()
    names = [n for n, _ in model.named_parameters()]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp = DataParallel(model, dp_group=Group.trivial("dp"), bucket_size=BUCKET)
    (buf,) = ddp.flat_buffers
    placed = [ddp.param_names[id(p)] for b in buf.buckets for p in b.params]
    assert placed == names[::-1]  # the head's bias first: backward reaches it first
    base = buf.param_data.data_ptr()
    for n, p in model.named_parameters():
        s, e = buf.offsets[id(p)]
        assert p.data_ptr() == base + 4 * s and torch.equal(p.detach(), before[n])
        assert p.main_grad.dtype == torch.float32 and p.main_grad.data_ptr() == buf.grad_data.data_ptr() + 4 * s
    assert sum(b.numel for b in buf.buckets) == buf.numel == sum(p.numel() for p in model.parameters())


def test_bf16_params_get_fp32_main_grads_and_masters():
    model = make_mlp(torch.bfloat16)
    ddp = DataParallel(model, dp_group=Group.trivial("dp"), bucket_size=BUCKET)
    opt = Optimizer(ddp, schedule=_schedule(), weight_decay=WD, clip_grad=CLIP)
    X, Y = (t.bfloat16() for t in global_batch())
    opt.zero_grad()
    F.mse_loss(ddp(X), Y).backward()
    assert all(p.grad is None and p.main_grad.dtype == torch.float32 for p in model.parameters())
    grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    assert opt.step().applied
    numel = ddp.flat_buffers[0].numel
    assert opt.state_bytes() == 12 * numel  # fp32 master + 2 moments, not sharded
    for pc in opt.dist.pieces:
        assert torch.equal(pc.param.detach().view(-1), pc.master.bfloat16())
        assert pc.master.dtype == torch.float32 and pc.grad.abs().sum() > 0
    assert any(g.abs().sum() > 0 for g in grads.values())
    model.load_state_dict(make_mlp(torch.bfloat16).state_dict())  # writes into the param buffer
    opt.dist.load_masters_from_params()
    for (n, p), q in zip(model.named_parameters(), make_mlp(torch.bfloat16).parameters()):
        assert torch.equal(p.detach(), q.detach()), n
    assert all(torch.equal(pc.master, pc.param.detach().view(-1).float()) for pc in opt.dist.pieces)


def test_zero1_state_shards_describe_the_flat_layout():
    model = make_mlp()
    ddp = DataParallel(model, dp_group=Group.trivial("dp"), zero_stage=1, bucket_size=BUCKET)
    opt = Optimizer(ddp, schedule=_schedule(), weight_decay=WD)
    (entry,) = opt.dist.state_shards()
    (buf,) = ddp.flat_buffers
    assert sorted(n for n, _, _ in entry["placements"]) == sorted(n for n, _ in model.named_parameters())
    assert [(s, e) for s, e, _ in entry["shards"]] == [(b.start, b.end) for b in buf.buckets]
    for s, e, states in entry["shards"]:
        assert set(states) == {"master", "exp_avg", "exp_avg_sq"}
        assert all(t.shape == (e - s,) for t in states.values())
        assert states["master"].data_ptr() == buf.param_data.data_ptr() + 4 * s  # fp32: master is the param


def test_hook_misuse_and_lifecycle_errors():
    model = make_mlp()
    ddp = DataParallel(model, dp_group=Group.trivial("dp"), bucket_size=BUCKET)
    X, Y = global_batch()
    F.mse_loss(ddp(X), Y).backward()  # last micro-batch: buckets launched
    with pytest.raises(RuntimeError, match="in flight"):
        ddp.zero_grad_buffer()
    ddp.finish_grad_sync()
    with pytest.raises(RuntimeError, match="zero_grad_buffer"):
        F.mse_loss(ddp(X), Y).backward()  # forgot zero_grad: the bucket was already reduced
    ddp2 = DataParallel(make_mlp(), dp_group=Group.trivial("dp"), zero_stage=1, overlap_param_gather=True)
    ddp2.start_param_sync()
    with pytest.raises(RuntimeError, match="finish_param_sync"):
        ddp2.start_param_sync()


@pytest.mark.parametrize("zero_stage, overlap", [(0, True), (1, False), (2, True), (3, True)])
def test_a_dropped_data_parallel_frees_its_model(zero_stage, overlap):
    """Each parameter's gradient hook is held by C++ (its gradient accumulator), out of the garbage
    collector's sight: the hooks reach the DataParallel through a weak reference, so a DataParallel and its
    model that are no longer referenced are collected (a process that builds several, as a benchmark's
    sides or a test suite do, no longer keeps every model to the end)."""
    import gc
    import weakref

    ddp = DataParallel(make_mlp(), dp_group=Group.trivial("dp"), bucket_size=BUCKET, zero_stage=zero_stage,
                       overlap_grad_reduce=overlap)
    X, Y = global_batch()
    F.mse_loss(ddp(X), Y).backward()
    ddp.finish_grad_sync()
    refs = [weakref.ref(ddp), weakref.ref(next(iter(ddp.parameters())))]
    del ddp
    gc.collect()
    assert [r() for r in refs] == [None, None]


@pytest.mark.parametrize("kwargs, match", [
    (dict(bucket_size=0), "bucket_size=0 must be a positive"),
    (dict(bucket_size=-5), "bucket_size=-5 must be a positive"),
    (dict(bucket_size=2.5), "bucket_size=2.5 must be a positive"),
    (dict(bucket_size_mb=0.0), "bucket_size_mb=0.0 must be a positive"),
    (dict(bucket_size_mb=float("nan")), "bucket_size_mb=nan must be a positive"),
    (dict(bucket_size=10, bucket_size_mb=1.0), "both set"),
    (dict(zero_stage=4), "zero_stage=4"),
    (dict(zero_stage=3, overlap_param_gather=True), "prefetches the next by itself"),
    (dict(grad_reduce="avg"), "grad_reduce='avg'"),
    (dict(overlap_param_gather=True), "needs a sharded optimizer"),
    (dict(align=0), "align=0"),
    (dict(max_inflight_buckets=0), "max_inflight_buckets=0"),
])
def test_data_parallel_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataParallel(make_mlp(), dp_group=Group.trivial("dp"), **kwargs)


def test_data_parallel_needs_trainable_params():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        DataParallel(frozen, dp_group=Group.trivial("dp"))


def test_num_microbatches():
    assert num_microbatches(16, 4, 2) == 2 and num_microbatches(16, 2, 4) == 2 and num_microbatches(8, 8, 1) == 1
    with pytest.raises(ValueError, match=r"global_batch_size=10 is not divisible by micro_batch_size \* dp = "
                                         r"4 \* 2 = 8; use a multiple of 8 \(e.g. 8 or 16\)"):
        num_microbatches(10, 4, 2)
    for bad in [(0, 1, 1), (8, 0, 1), (8, 1, 0), (8, 1, -2), (8.0, 1, 1), (True, 1, 1)]:
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            num_microbatches(*bad)


def test_distributed_optimizer_group_errors():
    from engine.optim import adamw_update
    from parallel.data_parallel import DistributedOptimizer
    model = make_mlp()
    ddp = DataParallel(model, dp_group=Group.trivial("dp"))
    ps = list(model.parameters())
    with pytest.raises(ValueError, match="in param groups 0 and 1"):
        DistributedOptimizer(ddp, param_groups=[{"params": ps}, {"params": ps[:1]}], update_fn=adamw_update)
    with pytest.raises(ValueError, match="are in no param group"):
        DistributedOptimizer(ddp, param_groups=[{"params": ps[1:]}], update_fn=adamw_update)
    with pytest.raises(ValueError, match="not trainable parameters of the wrapped module"):
        DistributedOptimizer(ddp, param_groups=[{"params": ps + [nn.Parameter(torch.ones(2))]}],
                             update_fn=adamw_update)
