"""RoPE: frequencies vs Hugging Face, q/k rotation in one Triton launch vs reference vs HF."""
import pytest
import torch

from engine.ops.rope import (RotaryEmbedding, apply_rope, apply_rope_reference, rope_cos_sin,
                             rope_inv_freq)
from tests.engine.ops.helpers import assert_bf16_close

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _hf_inv_freq(head_dim, theta, scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         rope_parameters=params, max_position_embeddings=131072)
    return LlamaRotaryEmbedding(config).inv_freq


@pytest.mark.parametrize("head_dim, theta, scaling", [(128, 500000.0, LLAMA3), (64, 10000.0, None),
                                                      (128, 500000.0, None)])
def test_inv_freq_matches_huggingface(head_dim, theta, scaling):
    torch.testing.assert_close(rope_inv_freq(head_dim, theta, scaling), _hf_inv_freq(head_dim, theta, scaling),
                               rtol=1e-6, atol=0)


def test_llama3_scaling_shape_of_the_curve():
    base, scaled = rope_inv_freq(128, 500000.0), rope_inv_freq(128, 500000.0, LLAMA3)
    assert torch.equal(scaled[:8], base[:8])  # high frequencies (short wavelengths) untouched
    torch.testing.assert_close(scaled[-4:], base[-4:] / 8.0)  # low frequencies divided by factor


def test_rotation_matches_huggingface_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    s, b, nh, nkv, hd = 6, 2, 4, 2, 16
    q, k = torch.randn(s, b, nh, hd), torch.randn(s, b, nkv, hd)
    positions = torch.stack([torch.arange(s), torch.tensor([0, 1, 2, 0, 1, 2])], dim=1)  # (s, b) packed
    inv_freq = rope_inv_freq(hd, 10000.0)
    cos, sin = rope_cos_sin(positions, inv_freq)  # (s, b, hd/2)
    # HF: batch-first (b, heads, s, hd) with cos/sin (b, s, hd) repeated over the two halves.
    hf_cos = torch.cat([cos, cos], -1).transpose(0, 1)
    hf_sin = torch.cat([sin, sin], -1).transpose(0, 1)
    hq, hk = apply_rotary_pos_emb(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), hf_cos, hf_sin)
    for backend in ("reference", "triton"):
        oq, ok = apply_rope(q, k, cos, sin, backend=backend)
        torch.testing.assert_close(oq, hq.permute(2, 0, 1, 3), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ok, hk.permute(2, 0, 1, 3), rtol=1e-6, atol=1e-6)


def _run(q, k, cos, sin, dq, dk, backend):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    oq, ok = apply_rope(q, k, cos, sin, backend=backend)
    torch.autograd.backward([oq, ok], [dq, dk])
    return oq, ok, q.grad, k.grad


@pytest.mark.parametrize("per_sample_positions", [False, True])
def test_triton_matches_reference_fp32_strided_views(per_sample_positions):
    torch.manual_seed(1)
    s, b, nh, nkv, hd = 7, 3, 5, 3, 12  # odd sizes: head and head-dim blocks are masked
    qkv = torch.randn(s, b, (nh + 2 * nkv) * hd)
    q = qkv[..., : nh * hd].view(s, b, nh, hd)  # strided views of a fused projection
    k = qkv[..., nh * hd: (nh + nkv) * hd].view(s, b, nkv, hd)
    positions = torch.randint(0, 4096, (s, b) if per_sample_positions else (s,))
    cos, sin = rope_cos_sin(positions, rope_inv_freq(hd, 500000.0, LLAMA3))
    dq, dk = torch.randn(s, b, nh, hd), torch.randn(s, b, nkv, hd)
    got, want = _run(q, k, cos, sin, dq, dk, "triton"), _run(q, k, cos, sin, dq, dk, "reference")
    for name, a, c in zip(("q", "k", "dq", "dk"), got, want):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5, msg=name)
        assert a.is_contiguous()


def test_triton_bf16_error_within_twice_torch_error():
    torch.manual_seed(2)
    s, b, nh, nkv, hd = 9, 2, 4, 2, 128
    q, k = torch.randn(s, b, nh, hd).bfloat16(), torch.randn(s, b, nkv, hd).bfloat16()
    dq, dk = torch.randn(s, b, nh, hd).bfloat16(), torch.randn(s, b, nkv, hd).bfloat16()
    cos, sin = rope_cos_sin(torch.arange(s) * 997, rope_inv_freq(hd, 500000.0))
    got, low = _run(q, k, cos, sin, dq, dk, "triton"), _run(q, k, cos, sin, dq, dk, "reference")
    exact = _run(q.double(), k.double(), cos.double(), sin.double(), dq.double(), dk.double(), "reference")
    for name, a, c, e in zip(("q", "k", "dq", "dk"), got, low, exact):
        assert_bf16_close(a, c, e, name)


def test_module_and_auto_dispatch():
    torch.manual_seed(3)
    rope = RotaryEmbedding(8, theta=10000.0)
    q, k, pos = torch.randn(4, 2, 2, 8), torch.randn(4, 2, 1, 8), torch.arange(4)
    cos, sin = rope_cos_sin(pos, rope.inv_freq)
    for a, c in zip(rope(q, k, pos), apply_rope_reference(q, k, cos, sin)):
        assert torch.equal(a, c)
    assert "inv_freq" not in rope.state_dict()  # derived from config, never checkpointed


def test_opcheck_and_compile():
    from engine.ops.rope import _rope

    torch.manual_seed(4)
    q, k = torch.randn(3, 2, 2, 8, requires_grad=True), torch.randn(3, 2, 1, 8, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(3), rope_inv_freq(8, 10000.0))
    torch.library.opcheck(_rope, (q, k, cos, sin, False))

    def f(q, k):
        oq, ok = apply_rope(q, k, cos, sin, backend="triton")
        return oq.square().sum() + ok.sum()

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k)
    got.backward()
    g = q.grad.clone()
    q.grad = None
    f(q, k).backward()
    torch.testing.assert_close(got, f(q, k))
    torch.testing.assert_close(g, q.grad)


def _good():
    return dict(q=torch.ones(4, 2, 3, 8), k=torch.ones(4, 2, 1, 8), cos=torch.ones(4, 4), sin=torch.ones(4, 4))


@pytest.mark.parametrize("change, match", [
    (dict(q=torch.ones(4, 3, 8)), r"must be \(s, b, heads, head_dim\)"),
    (dict(k=torch.ones(4, 3, 1, 8)), "must share"),
    (dict(q=torch.ones(4, 2, 3, 7), k=torch.ones(4, 2, 1, 7)), "even head_dim"),
    (dict(cos=torch.ones(4, 8), sin=torch.ones(4, 8)), "cos/sin must both be"),
    (dict(sin=torch.ones(4, 2, 4)), "cos/sin must both be"),
    (dict(q=torch.ones(4, 2, 3, 8, dtype=torch.int64)), "floating dtype"),
])
def test_apply_rope_bad_inputs_raise(change, match):
    args = {**_good(), **change}
    with pytest.raises(ValueError, match=match):
        apply_rope(args["q"], args["k"], args["cos"], args["sin"])


def test_apply_rope_bad_backend_raises():
    args = _good()
    with pytest.raises(ValueError, match="backend='gpu' is not one of"):
        apply_rope(args["q"], args["k"], args["cos"], args["sin"], backend="gpu")


@pytest.mark.parametrize("call, match", [
    (lambda: rope_inv_freq(7, 10000.0), "positive even"),
    (lambda: rope_inv_freq(8, 0.0), "theta=0.0 must be positive"),
    (lambda: rope_inv_freq(8, 1e4, {"rope_type": "yarn", "factor": 4.0}), "only llama3 scaling"),
    (lambda: rope_inv_freq(8, 1e4, {"factor": 8.0}), "missing"),
    (lambda: rope_inv_freq(8, 1e4, {**LLAMA3, "low_freq_factor": 4.0}), "high_freq_factor > low_freq_factor"),
    (lambda: rope_cos_sin(torch.zeros(4), torch.ones(4)), "integer tensor"),
    (lambda: rope_cos_sin(torch.zeros(4, 2, 1, dtype=torch.long), torch.ones(4)), "integer tensor"),
    (lambda: rope_cos_sin(torch.zeros(4, dtype=torch.long), torch.ones(2, 2)), "inv_freq must be 1-D"),
])
def test_frequency_helpers_bad_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()
