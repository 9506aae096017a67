"""engine/optim: LR schedules against hand-computed values, no-decay groups, the AdamW kernels against
torch.optim.AdamW, the global norm's counting rules, one-process parity with clipping, non-finite
skip/stop, and every bad-input error. (Distributed parity: tests/parallel/test_data_parallel.py.)"""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.optim import (LRSchedule, NonFiniteGradError, Optimizer, adamw_update, build_param_groups,
                          counts_in_norm, global_grad_norm, lr_at, resolve_adamw)
from parallel.comm import Group
from parallel.data_parallel import DataParallel


# --------------------------------------------------------------------------------------------- schedules
def _lrs(style, *, lr=1.0, min_lr=0.1, warmup=2, total=6, frac=0.2, upto=None):
    s = LRSchedule(lr=lr, min_lr=min_lr, warmup_steps=warmup, total_steps=total, decay_style=style,
                   wsd_decay_fraction=frac)
    return [s(i) for i in range(upto or total + 1)]


def test_cosine_with_warmup_hand_values():
    # warmup: 1/2, 2/2; decay p = (s-2)/3: cos -> f = 1, .75, .25, 0; lr = .1 + .9 f; past the end: min
    assert _lrs("cosine") == pytest.approx([0.5, 1.0, 1.0, 0.775, 0.325, 0.1, 0.1], abs=1e-12)


def test_cosine_without_warmup_starts_at_peak_and_ends_at_min():
    vals = _lrs("cosine", lr=2.0, min_lr=0.0, warmup=0, total=5, upto=5)
    c = 0.5 * (1 + math.cos(math.pi / 4))  # p = 1/4
    assert vals == pytest.approx([2.0, 2 * c, 1.0, 2 * (1 - c), 0.0], abs=1e-12)


def test_linear_constant_and_wsd_hand_values():
    assert _lrs("linear") == pytest.approx([0.5, 1.0, 1.0, 0.7, 0.4, 0.1, 0.1], abs=1e-12)
    assert _lrs("constant") == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], abs=1e-12)
    # wsd: total 10, fraction 0.3 -> the last 3 steps (7, 8, 9) decay linearly to min_lr.
    assert _lrs("wsd", warmup=1, total=10, frac=0.3) == pytest.approx(
        [1.0] * 8 + [0.55, 0.1, 0.1], abs=1e-12)
    # wsd whose decay would start inside the warmup starts after it instead.
    assert _lrs("wsd", warmup=3, total=4, frac=1.0, upto=4) == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0], abs=1e-12)


def test_lr_at_equals_the_schedule_object():
    s = LRSchedule(lr=3e-4, min_lr=3e-5, warmup_steps=10, total_steps=100, decay_style="cosine")
    assert all(lr_at(i, lr=3e-4, min_lr=3e-5, warmup_steps=10, total_steps=100) == s(i) for i in range(120))


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=0.0), "lr=0.0 must be a finite number > 0"),
    (dict(lr=float("inf")), "lr=inf must be a finite number > 0"),
    (dict(min_lr=2.0), r"min_lr=2.0 must be in \[0, lr=1.0\]"),
    (dict(min_lr=-1.0), r"min_lr=-1.0 must be in \[0, lr"),
    (dict(total_steps=0), "total_steps=0 must be an integer >= 1"),
    (dict(warmup_steps=11), r"warmup_steps=11 must be an integer in \[0, total_steps=10\]"),
    (dict(warmup_steps=-1), r"warmup_steps=-1 must be an integer in"),
    (dict(decay_style="exp"), "decay_style='exp' is not valid; choose one of: cosine, linear, constant, wsd"),
    (dict(wsd_decay_fraction=0.0), r"wsd_decay_fraction=0.0 must be in \(0, 1\]"),
    (dict(wsd_decay_fraction=1.5), r"wsd_decay_fraction=1.5 must be in \(0, 1\]"),
])
def test_schedule_bad_arguments(kwargs, match):
    args = dict(lr=1.0, min_lr=0.0, total_steps=10, warmup_steps=0, decay_style="cosine", wsd_decay_fraction=0.2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        LRSchedule(**args)
    with pytest.raises(ValueError, match=match):
        lr_at(0, **args)


def test_schedule_bad_step():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="must be an integer >= 0"):
            lr_at(bad, lr=1.0, total_steps=10)


# ---------------------------------------------------------------------------------------- param groups
class RMSNorm(nn.Module):  # a user norm class: recognised by its name
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(10, 4)
        self.ln = nn.LayerNorm(4)
        self.norm = RMSNorm(4)
        self.proj = nn.Linear(4, 4)
        self.gate_bias = nn.Parameter(torch.zeros(4))
        self.scale = nn.Parameter(torch.ones(4))
        self.frozen = nn.Parameter(torch.ones(4), requires_grad=False)


def _split(groups):
    return {g["weight_decay"]: sorted(g["names"]) for g in groups}


def test_default_no_decay_on_norms_biases_embeddings():
    m = Tiny()
    groups = _split(build_param_groups(m, weight_decay=0.1))
    assert groups == {0.1: ["proj.weight", "scale"],
                      0.0: sorted(["tok.weight", "ln.weight", "ln.bias", "norm.weight", "proj.bias", "gate_bias"])}


def test_no_decay_configurable_by_groups_patterns_and_attributes():
    m = Tiny()
    assert _split(build_param_groups(m, weight_decay=0.1, no_decay_on=("norms", "biases")))[0.1] == \
        ["proj.weight", "scale", "tok.weight"]
    assert _split(build_param_groups(m, weight_decay=0.1, no_decay_on=(), no_decay_patterns=("sca*",)))[0.0] == \
        ["scale"]
    m.proj.weight.no_weight_decay = True   # the attribute wins over the rules, both ways
    m.ln.weight.no_weight_decay = False
    g = _split(build_param_groups(m, weight_decay=0.1))
    assert "proj.weight" in g[0.0] and "ln.weight" in g[0.1]
    tied = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    tied[1].weight = tied[0].weight  # a shared parameter appears once
    assert sum(len(x["params"]) for x in build_param_groups(tied, weight_decay=0.1)) == 1


def test_param_group_errors():
    with pytest.raises(ValueError, match="no_decay_on\\[1\\]='bias' is not a parameter group; choose from: "
                                         "norms, biases, embeddings"):
        build_param_groups(Tiny(), weight_decay=0.1, no_decay_on=("norms", "bias"))
    with pytest.raises(ValueError, match="weight_decay=-0.1 must be a finite number >= 0"):
        build_param_groups(Tiny(), weight_decay=-0.1)


# ---------------------------------------------------------------------------------------------- kernels
def _impls():
    out = ["foreach", "torch_fused"]
    try:
        import engine.ops.fused_adamw  # noqa: F401
        out.append("fused_op")
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("impl", _impls())
def test_adamw_kernels_match_torch_adamw(impl):
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (13,), (3, 4, 2)]
    params = [torch.randn(s, generator=g) for s in shapes]
    ref = [nn.Parameter(p.clone()) for p in params]
    topt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(1, 4):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for r, gr in zip(ref, grads):
            r.grad = gr.clone()
        topt.step()
        adamw_update(params, grads, m, v, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step,
                     impl=impl)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.detach(), atol=1e-6, rtol=1e-6)
        assert not torch.equal(p, r.detach() * 0)  # moved


def test_resolve_adamw_choices_and_errors():
    assert resolve_adamw("auto", device="cpu")[0] == "torch_fused"  # fastest on CPU (measured)
    assert resolve_adamw("foreach")[0] == "foreach"
    with pytest.raises(ValueError, match="adamw impl='sgd' is not valid; choose one of: auto, fused_op"):
        resolve_adamw("sgd")
    with pytest.raises(ValueError, match="'torch_fused' is not available for device meta"):
        resolve_adamw("torch_fused", device="meta")


# ------------------------------------------------------------------------------------------ grad norm
def test_global_norm_counting_rules():
    a, b, c = (nn.Parameter(torch.zeros(3)) for _ in range(3))
    b.tensor_parallel = True
    c.shared_embedding = True
    c.shared = True
    ga, gb, gc = torch.tensor([3.0, 0, 0]), torch.tensor([0, 4.0, 0]), torch.tensor([100.0, 0, 0])
    norm = global_grad_norm([(a, ga), (b, gb), (c, gc)], tp_group=Group.trivial("tp"))
    assert float(norm) == pytest.approx(5.0)  # the last stage's tied copy is not counted
    tp_rank1 = Group(axis="tp", ranks=(0, 1), rank=1, pg=object(), ledger=Group.trivial("tp").ledger)
    assert counts_in_norm(b, tp_group=tp_rank1) and not counts_in_norm(a, tp_group=tp_rank1)
    assert counts_in_norm(a, tp_group=None) and not counts_in_norm(c, tp_group=None)
    first_copy = nn.Parameter(torch.zeros(3))
    first_copy.shared_embedding = True  # the first stage's tied copy: deferred reduction, but it counts
    assert counts_in_norm(first_copy, tp_group=None)
    assert float(global_grad_norm([], tp_group=None)) == 0.0


# --------------------------------------------------------------------------------- optimizer, 1 process
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.GELU(), nn.Linear(12, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_single_process_parity_with_torch_adamw_and_clipping(zero_stage):
    """dp=1, 2 micro-batches of 4 (accumulated in fp32 main_grad), warmup + linear decay, clip 0.3."""
    X, Y = _data()
    sched = LRSchedule(lr=5e-3, min_lr=5e-4, warmup_steps=1, total_steps=4, decay_style="linear")
    model = _mlp()
    ddp = DataParallel(model, dp_group=Group.trivial("dp"), zero_stage=zero_stage, bucket_size=50)
    opt = Optimizer(ddp, schedule=sched, weight_decay=0.05, betas=(0.9, 0.95), clip_grad=0.3)
    ref = _mlp()
    groups = build_param_groups(ref, weight_decay=0.05)
    topt = torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
                             lr=5e-3, betas=(0.9, 0.95), foreach=False)
    for step in range(4):
        opt.zero_grad()
        with ddp.no_sync():
            (F.mse_loss(ddp(X[:4]), Y[:4]) / 2).backward()
        (F.mse_loss(ddp(X[4:]), Y[4:]) / 2).backward()
        res = opt.step()
        topt.zero_grad()
        F.mse_loss(ref(X), Y).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        for g in topt.param_groups:
            g["lr"] = sched(step)
        topt.step()
        assert res.applied and res.lr == sched(step) and res.grad_norm == pytest.approx(float(norm), rel=1e-5)
        assert res.clip_coef == pytest.approx(min(1.0, 0.3 / (float(norm) + 1e-6)), rel=1e-5)
    assert opt.step_count == 4
    if zero_stage == 3:  # sharded parameters are empty placeholders outside a gather
        assert all(p.numel() == 0 for p in model.parameters())
    with ddp.gathered():
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), r.detach(), atol=1e-6, rtol=1e-5)


def test_nonfinite_skip_and_stop():
    X, Y = _data()
    for action in ("skip", "stop"):
        model = _mlp()
        ddp = DataParallel(model, dp_group=Group.trivial("dp"))
        opt = Optimizer(ddp, schedule=LRSchedule(lr=1e-3, total_steps=5), nonfinite=action)
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        F.mse_loss(ddp(X), Y).backward()
        model[3].weight.main_grad[1, 2] = float("inf")
        model[1].bias.main_grad[0] = float("nan")
        if action == "skip":
            res = opt.step()
            assert not res.applied and math.isnan(res.grad_norm) and opt.step_count == 0
            assert "rank 0: first non-finite gradient in parameter '1.bias'" in res.message  # registration order
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
            opt.zero_grad()
            F.mse_loss(ddp(X), Y).backward()
            assert opt.step().applied and opt.step_count == 1  # recovers on the next step
        else:
            with pytest.raises(NonFiniteGradError, match=r"non-finite gradient norm \(nan\) at update 0; rank 0: "
                                                         r"first non-finite gradient in parameter '1.bias'.*stopping"):
                opt.step()


def test_optimizer_from_config_fields():
    cfg = SimpleNamespace(lr=1e-3, min_lr=1e-4, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, warmup_steps=2,
                          decay_style="wsd", wsd_decay_fraction=0.5, clip_grad=1.0, nonfinite="stop",
                          no_decay_on=["norms", "biases"])
    ddp = DataParallel(_mlp(), dp_group=Group.trivial("dp"))
    opt = Optimizer.from_config(ddp, cfg, total_steps=10)
    assert opt.schedule(9) == pytest.approx(1e-4) and opt.schedule(4) == 1e-3 and opt.nonfinite == "stop"
    assert opt.dist.betas == (0.9, 0.95) and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(nonfinite="ignore"), "nonfinite='ignore' is not valid; choose 'skip' or 'stop'"),
    (dict(clip_grad=-1.0), r"clip_grad=-1.0 must be >= 0 \(0 disables clipping\)"),
    (dict(betas=(0.9, 1.0)), r"betas\[1\]=1.0 must be in \[0, 1\)"),
    (dict(eps=0.0), "eps=0.0 must be > 0"),
    (dict(impl="sgd"), "adamw impl='sgd' is not valid"),
])
def test_optimizer_bad_arguments(kwargs, match):
    ddp = DataParallel(_mlp(), dp_group=Group.trivial("dp"))
    with pytest.raises(ValueError, match=match):
        Optimizer(ddp, schedule=LRSchedule(lr=1e-3, total_steps=5), **kwargs)


def test_optimizer_needs_a_data_parallel_module():
    with pytest.raises(ValueError, match="needs a parallel.data_parallel.DataParallel"):
        Optimizer(_mlp(), schedule=LRSchedule(lr=1e-3, total_steps=5))


def test_fused_op_writes_bf16_params_in_the_update():
    pytest.importorskip("engine.ops.fused_adamw")
    X, Y = (t.bfloat16() for t in _data())
    masters = {}
    for impl in ("torch_fused", "fused_op"):
        model = _mlp().bfloat16()
        ddp = DataParallel(model, dp_group=Group.trivial("dp"), zero_stage=1)
        opt = Optimizer(ddp, schedule=LRSchedule(lr=1e-2, total_steps=3), weight_decay=0.1, impl=impl)
        assert opt.dist.update_writes_bf16 == (impl == "fused_op")
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(ddp(X), Y).backward()
            opt.step()
        for pc in opt.dist.pieces:  # written by the kernel (fused_op) or copied (torch_fused): same values
            assert torch.equal(pc.model, pc.master.bfloat16())
        masters[impl] = torch.cat([pc.master for pc in opt.dist.pieces])
    torch.testing.assert_close(masters["fused_op"], masters["torch_fused"], atol=1e-6, rtol=1e-5)


def test_tied_embedding_copy_on_the_last_stage_is_not_decayed():
    """The last stage's tied copy (a linear weight marked shared_embedding) must step like the
    first stage's embedding, or the two copies drift apart under weight decay."""
    head = nn.Linear(4, 8, bias=False)
    head.weight.shared_embedding = True
    other = nn.Linear(4, 4, bias=False)
    groups = build_param_groups(nn.ModuleList([head, other]), weight_decay=0.1)
    no_decay = next(g for g in groups if g["weight_decay"] == 0.0)
    assert any(p is head.weight for p in no_decay["params"])
    assert all(p is not other.weight for p in no_decay["params"])
