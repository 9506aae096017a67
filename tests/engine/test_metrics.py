"""MFU formula against Korthikanti et al. 2022 Eq. 7, peak FLOP/s sources, and the logger's outputs."""
import io
import json

import pytest
import torch

from engine import metrics
from engine.metrics import FlopsSpec, korthikanti_eq7, model_flops_per_step


@pytest.mark.parametrize("B,s,l,h,V", [
    (1, 2048, 96, 12288, 51200),  # GPT-3 175B
    (8, 1024, 24, 1024, 50304),   # GPT-2 medium-ish
    (3, 128, 2, 64, 1000),
])
def test_model_flops_reproduce_korthikanti_eq7(B, s, l, h, V):
    # A GPT configuration: MHA (kv heads = heads), plain 4h MLP, no recomputation.
    spec = FlopsSpec(num_layers=l, hidden_size=h, ffn_hidden_size=4 * h, vocab_size=V,
                     num_attention_heads=16, gated_mlp=False)
    ours = model_flops_per_step(spec, batch_size=B, seq_length=s)
    ref = korthikanti_eq7(batch_size=B, seq_length=s, num_layers=l, hidden_size=h, vocab_size=V)
    assert ours == pytest.approx(ref, rel=1e-12)


def test_gqa_and_gated_mlp_terms():
    # Llama-3 8B shapes, counted by hand: per token per layer fwd = 2h(h+2*1024) + 4sh + 2h^2 + 6hf.
    h, f, s, V, L = 4096, 14336, 8192, 128256, 32
    spec = FlopsSpec(num_layers=L, hidden_size=h, ffn_hidden_size=f, vocab_size=V, num_attention_heads=32,
                     num_key_value_heads=8)
    per_tok = L * (2 * h * (h + 2 * 1024) + 4 * s * h + 2 * h * h + 6 * h * f) + 2 * h * V
    assert model_flops_per_step(spec, batch_size=2, seq_length=s) == 3 * per_tok * 2 * s


def test_peak_sources():
    val, src = metrics.peak_tflops(override=989.0)
    assert val == 989.0 and "configured" in src
    val, src = metrics.peak_tflops()
    assert val > 0 and "measured" in src and "CPU" in src  # this machine has no GPU
    val, src = metrics.peak_tflops(dtype=torch.bfloat16)  # 15 s at 1024^3 on a CPU without bf16 units
    assert val > 0 and "measured bfloat16" in src
    # the size: 1024^3 unless a product would take longer than the budget (estimated from 256^3)
    assert metrics.cpu_matmul_size(torch.float32, budget_s=1e6) == 1024
    assert metrics.cpu_matmul_size(torch.float32, budget_s=0.0) == 256
    with pytest.raises(ValueError, match="logging.peak_tflops=0"):
        metrics.peak_tflops(override=0)
    with pytest.raises(ValueError, match="FlopsSpec.num_layers=0"):
        FlopsSpec(num_layers=0, hidden_size=1, ffn_hidden_size=1, vocab_size=1, num_attention_heads=1)


def test_logger_writes_jsonl_tensorboard_and_lines(tmp_path):
    out = io.StringIO()
    log = metrics.MetricsLogger(str(tmp_path), enabled=True, total_steps=2, stream=out)
    rec = {"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0,
           "tflops_per_device": 0.01, "mfu": 0.1, "mem_bytes": 2**20}
    log.log(rec)
    log.log({"step": 1, "loss": 2.4}, prefix="valid")
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["loss"] == 2.5 and lines[0]["split"] == "train" and lines[1]["split"] == "valid"
    assert "MFU 10.00%" in out.getvalue() and "valid step 1" in out.getvalue()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard").iterdir())
    assert metrics.memory_bytes() > 0
    with pytest.raises(ValueError, match="logging.progress_bar='sometimes'"):
        metrics.MetricsLogger(None, enabled=True, total_steps=1, progress_bar="sometimes")


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0),
                                        ("NVIDIA GB200", 2500.0), ("NVIDIA B200", 2250.0), ("NVIDIA A100-SXM4-80GB", 312.0)])
def test_datasheet_peak_by_device_name(monkeypatch, name, peak):
    """The datasheet lookup by CUDA device name: a GB200 is not taken for the B200 its name contains."""
    from engine.metrics import peak_tflops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert peak_tflops() == (peak, f"datasheet dense bf16 for {name}")
