"""SwiGLU over a fused [gate | up] input: Triton kernels (interpreter on CPU) vs reference."""
import pytest
import torch

from engine.ops.swiglu import SwiGLU, swiglu, swiglu_reference
from tests.engine.ops.helpers import assert_bf16_close


def _run(x, dy, backend):
    x = x.detach().requires_grad_()
    y = swiglu(x, backend=backend)
    y.backward(dy)
    return y, x.grad


@pytest.mark.parametrize("shape", [(37, 2 * 127), (3, 5, 2 * 1000), (2, 2 * 1500)])
def test_triton_matches_reference_fp32(shape):
    torch.manual_seed(0)
    x = 3 * torch.randn(shape)
    dy = torch.randn(*shape[:-1], shape[-1] // 2)
    for a, b, name in zip(_run(x, dy, "triton"), _run(x, dy, "reference"), ("y", "dx")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_triton_bf16_error_within_twice_torch_error():
    torch.manual_seed(1)
    x, dy = (3 * torch.randn(37, 2 * 1000)).bfloat16(), torch.randn(37, 1000).bfloat16()
    got, low, exact = _run(x, dy, "triton"), _run(x, dy, "reference"), _run(x.double(), dy.double(), "reference")
    for name, a, b, c in zip(("y", "dx"), got, low, exact):
        assert_bf16_close(a, b, c, name)


def test_layout_is_gate_then_up():
    gate, up = torch.tensor([[1.0, -2.0]]), torch.tensor([[3.0, 5.0]])
    want = torch.nn.functional.silu(gate) * up
    x = torch.cat([gate, up], dim=-1)  # (1, 4): [gate | up]
    for backend in ("reference", "triton"):
        torch.testing.assert_close(swiglu(x, backend=backend), want)
    torch.testing.assert_close(SwiGLU()(x), want)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(1000) = inf, by design
def test_extreme_gates_are_finite():
    x = torch.tensor([[-1000.0, 1000.0, 0.0, 2.0, 3.0, 4.0]])  # gates -1000, 1000, 0
    x.requires_grad_()
    y = swiglu(x, backend="triton")
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    torch.testing.assert_close(y, swiglu_reference(x.detach()))


def test_opcheck_and_compile():
    from engine.ops.swiglu import _swiglu_fwd

    torch.manual_seed(2)
    x = torch.randn(4, 2 * 24, requires_grad=True)
    torch.library.opcheck(_swiglu_fwd, (x,))
    f = lambda t: swiglu(t, backend="triton").square().sum()  # noqa: E731
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    got.backward()
    g = x.grad.clone()
    x.grad = None
    f(x).backward()
    torch.testing.assert_close(got, f(x))
    torch.testing.assert_close(g, x.grad)


@pytest.mark.parametrize("x, backend, match", [
    (torch.ones(3, 7), "auto", "even last dim"),
    (torch.ones(()), "auto", "even last dim"),
    (torch.ones(3, 8, dtype=torch.int32), "auto", "floating dtype"),
    (torch.ones(3, 8), "fast", "backend='fast' is not one of"),
    (torch.ones(3, 8, dtype=torch.float64), "triton", "does not support float64"),
])
def test_bad_inputs_raise(x, backend, match):
    with pytest.raises(ValueError, match=match):
        swiglu(x, backend=backend)
