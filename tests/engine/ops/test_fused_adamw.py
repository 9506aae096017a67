"""Multi-tensor fused AdamW (engine._adamw C++ path and the PyTorch reference) vs torch.optim.AdamW."""
import pytest
import torch

from engine import _native
from engine.ops.fused_adamw import fused_adamw_

needs_native = pytest.mark.skipif(not _native.available("adamw"),
                                  reason="engine._adamw not built (run setup.py build_ext --inplace)")
# Sizes around the native chunk (16384 elements): several chunks, a ragged tail, tiny and empty.
SHAPES = [(37,), (129, 257), (3,), (0,), (16384,), (5, 7, 11)]


def _compare_with_torch(backend, *, lr, betas, weight_decay, steps=5, bf16=True):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    ref = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(ref, lr=lr, betas=betas, eps=1e-8, weight_decay=weight_decay, foreach=False)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    out = [torch.empty(s, dtype=torch.bfloat16) for s in SHAPES] if bf16 else None
    for step in range(1, steps + 1):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=betas[0], beta2=betas[1],
                     eps=1e-8, weight_decay=weight_decay, step=step, bf16_out=out, backend=backend)
        for i, r in enumerate(ref):
            state = opt.state[r]
            # fp32, tight (a few ulp of O(1) values): torch's CPU lerp is an FMA where ours rounds twice.
            torch.testing.assert_close(params[i], r.detach(), rtol=1e-6, atol=3e-7)
            torch.testing.assert_close(exp_avgs[i], state["exp_avg"], rtol=1e-6, atol=3e-7)
            torch.testing.assert_close(exp_avg_sqs[i], state["exp_avg_sq"], rtol=1e-6, atol=1e-9)
            if out is not None:
                assert torch.equal(out[i], params[i].to(torch.bfloat16))  # round-to-nearest-even copy


@pytest.mark.parametrize("backend", [pytest.param("native", marks=needs_native), "reference"])
@pytest.mark.parametrize("lr, betas, weight_decay", [
    (1e-2, (0.9, 0.95), 0.1),
    (3e-3, (0.3, 0.999), 0.0),  # lerp weight 0.7 >= 0.5 takes torch's other lerp formula; no decay
])
def test_matches_torch_adamw_over_steps(backend, lr, betas, weight_decay):
    _compare_with_torch(backend, lr=lr, betas=betas, weight_decay=weight_decay)


@needs_native
def test_native_and_reference_agree_closely():
    gen = torch.Generator().manual_seed(1)
    a = [torch.randn(s, generator=gen) for s in SHAPES]
    g = [torch.randn(s, generator=gen) for s in SHAPES]
    b = [t.clone() for t in a]
    states = [[torch.zeros_like(t) for t in a] for _ in range(4)]
    for params, m, v in ((a, states[0], states[1]), (b, states[2], states[3])):
        backend = "native" if params is a else "reference"
        fused_adamw_(params, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                     step=1, backend=backend)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


@needs_native
def test_module_reports_cuda_flag():
    assert isinstance(_native.load("adamw").WITH_CUDA, bool)


def _lists(n=2, **override):
    lists = dict(params=[torch.zeros(4, 3) for _ in range(n)], grads=[torch.zeros(4, 3) for _ in range(n)],
                 exp_avgs=[torch.zeros(4, 3) for _ in range(n)], exp_avg_sqs=[torch.zeros(4, 3) for _ in range(n)])
    lists.update(override)
    return lists


HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1)


@pytest.mark.parametrize("backend", [pytest.param("native", marks=needs_native), "reference"])
@pytest.mark.parametrize("override, match", [
    (dict(grads=[torch.zeros(4, 3)]), r"grads has 1 tensors but params has 2"),
    (dict(exp_avgs=[torch.zeros(4, 3), torch.zeros(3, 4)]), r"exp_avgs\[1\] has shape"),
    (dict(grads=[torch.zeros(4, 3), torch.zeros(4, 3, dtype=torch.bfloat16)]), r"grads\[1\] is .*expected"),
    (dict(params=[torch.zeros(4, 3, dtype=torch.float64)] * 2), r"params\[0\] is .*expected"),
    (dict(bf16_out=[torch.zeros(4, 3), torch.zeros(4, 3)]), r"bf16_out\[0\] is .*expected"),
])
def test_bad_tensors_raise_before_writing(backend, override, match):
    lists = _lists(**override)
    bf16_out = lists.pop("bf16_out", None)
    before = [p.clone() for p in lists["params"]]
    with pytest.raises(ValueError, match=match):
        fused_adamw_(**lists, **HYPER, bf16_out=bf16_out, backend=backend)
    assert all(torch.equal(p, q) for p, q in zip(lists["params"], before))


@needs_native
def test_native_rejects_non_contiguous():
    lists = _lists(exp_avg_sqs=[torch.zeros(3, 4).t(), torch.zeros(4, 3)])
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[0\] is not contiguous"):
        fused_adamw_(**lists, **HYPER, backend="native")


@pytest.mark.parametrize("change, match", [
    (dict(lr=-1.0), "lr=-1.0 must be >= 0"),
    (dict(beta1=1.0), r"beta1=1.0 must be in \[0, 1\)"),
    (dict(beta2=-0.1), r"beta2=-0.1 must be in \[0, 1\)"),
    (dict(eps=0.0), "eps=0.0 must be > 0"),
    (dict(weight_decay=-0.1), "weight_decay=-0.1 must be >= 0"),
    (dict(step=0), "step=0 must be an int >= 1"),
    (dict(step=1.0), "step=1.0 must be an int >= 1"),
])
def test_bad_hyperparameters_raise(change, match):
    with pytest.raises(ValueError, match=match):
        fused_adamw_(**_lists(), **{**HYPER, **change})


def test_bad_backend_and_list_types_raise():
    with pytest.raises(ValueError, match="backend='apex' is not one of"):
        fused_adamw_(**_lists(), **HYPER, backend="apex")
    lists = _lists()
    lists["grads"] = torch.zeros(2, 4, 3)
    with pytest.raises(ValueError, match="grads must be a list of tensors"):
        fused_adamw_(**lists, **HYPER)
