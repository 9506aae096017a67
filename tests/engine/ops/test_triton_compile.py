"""Compile-only check of every Triton kernel in engine/ops for Hopper (sm_90), no GPU needed.

The CPU tests run the kernels in the Triton interpreter, which accepts some programs the compiler
rejects (loop-carried type changes, int64/int32 mixes, scalar shapes). Here each op runs once on
small bf16 and fp32 CPU inputs while its launches are recorded; every distinct (kernel, argument
types, constexprs) seen is then compiled by Triton to a cubin for sm_90 with its bundled ptxas,
exactly as the first launch on an H100 would. Running it needs no driver.
"""
import inspect

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, mangle_type

from engine.ops import _triton
from engine.ops.fused_linear_ce import fused_linear_cross_entropy
from engine.ops.rmsnorm import rms_norm
from engine.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq
from engine.ops.swiglu import swiglu

pytestmark = pytest.mark.skipif(
    triton.knobs.runtime.interpret,
    reason="TRITON_INTERPRET=1 was set when triton was imported: Triton's own library functions are "
           "interpreter objects in this process and cannot be compiled")


def _exercise_all_ops(dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 24, dtype=dtype, requires_grad=True)
    w = torch.randn(24, dtype=dtype, requires_grad=True)
    y, h = rms_norm(x, w, 1e-6, residual=torch.randn(5, 24, dtype=dtype), backend="triton")
    (y.float().sum() + h.float().sum()).backward()
    rms_norm(x, w, 1e-6, backend="triton").float().sum().backward()
    swiglu(torch.randn(5, 48, dtype=dtype, requires_grad=True), backend="triton").float().sum().backward()
    q = torch.randn(3, 2, 4, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(3, 2, 2, 8, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(3), rope_inv_freq(8, 10000.0))
    qo, ko = apply_rope(q, k, cos, sin, backend="triton")
    (qo.float().sum() + ko.float().sum()).backward()
    hid = torch.randn(6, 16, dtype=dtype, requires_grad=True)
    wt = torch.randn(40, 16, dtype=dtype, requires_grad=True)
    loss = fused_linear_cross_entropy(hid, wt, torch.randint(0, 40, (6,)), label_smoothing=0.1,
                                      chunk_size=4, backend="triton")
    loss.sum().backward()


def _record_launches(monkeypatch):
    records = {}
    original_on = _triton.Kernel.on

    def on(kernel, device):
        launcher = original_on(kernel, device)

        class Recorder:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    names = list(inspect.signature(kernel.fn).parameters)
                    constexprs = {k: v for k, v in kwargs.items() if k in names}
                    signature = {n: mangle_type(a) for n, a in zip(names, args)}
                    signature.update({n: "constexpr" for n in constexprs})
                    key = (kernel.__name__, tuple(sorted(signature.items())), tuple(sorted(constexprs.items())))
                    records[key] = (kernel, signature, constexprs, kwargs.get("num_warps", 4))
                    return launcher[grid](*args, **kwargs)
                return launch

        return Recorder()

    monkeypatch.setattr(_triton.Kernel, "on", on)
    return records


def test_every_kernel_compiles_for_sm90(monkeypatch):
    records = _record_launches(monkeypatch)
    for dtype in (torch.bfloat16, torch.float32):
        _exercise_all_ops(dtype)
    kernels_defined = {name for module in ("rmsnorm", "swiglu", "rope", "fused_linear_ce")
                       for name, obj in vars(__import__(f"engine.ops.{module}", fromlist=["x"])).items()
                       if isinstance(obj, _triton.Kernel)}
    assert {key[0] for key in records} == kernels_defined, "some kernel was never launched by the ops"
    target = GPUTarget("cuda", 90, 32)
    for (name, _, _), (kernel, signature, constexprs, num_warps) in sorted(records.items(), key=lambda r: r[0][0]):
        fn = kernel.compiled if isinstance(kernel.compiled, JITFunction) else JITFunction(kernel.fn)
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=target, options={"num_warps": num_warps})
        assert len(compiled.asm["cubin"]) > 0, name
        assert ".target sm_90" in compiled.asm["ptx"], name
