"""tools/bench_kernels.py: a tiny CPU reduced-mode run end to end, its arguments, its memory tracker.

The run uses Llama-3 8B layer widths with 32 tokens, a 512 vocab, one timed repetition and no
torch.compile baseline (a cold compile costs ~20 s per op on this machine), so it finishes in
seconds. Only consistency is asserted (rows present, positive times, rates = work / time,
percentages = rate / ceiling, peaks relative to eager), never speed.
"""
import contextlib
import io
import json

import pytest
import torch

from tests.conftest import TorchState
from tools import bench_kernels
from tools.bench_kernels import CPUMemoryPeak

OPS = ["rmsnorm", "swiglu", "rope", "linear_ce"]
TOKENS, VOCAB = 32, 512
HIDDEN = bench_kernels.MODELS["8b"]["hidden"]
LABELS = {"rmsnorm": "rmsnorm+residual", "swiglu": "swiglu", "rope": "rope(q+k)", "linear_ce": "linear+ce"}


def _main(*argv) -> str:
    """tools/bench_kernels.py's main() in this process (no interpreter start; its thread count and seed put
    back after): what it printed."""
    out = io.StringIO()
    with TorchState(), contextlib.redirect_stdout(out):
        bench_kernels.main(list(argv))
    return out.getvalue()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "kernels.json"
    stdout = _main("--cpu", "--models", "8b", "--ops", *OPS, "--tokens", str(TOKENS), "--vocab", str(VOCAB),
                   "--reps", "1", "--warmup", "0", "--no-compile", "--json", str(path))
    with open(path) as f:
        return json.load(f), stdout


def test_json_has_every_op_with_positive_times(tiny_run):
    result, _ = tiny_run
    assert result["mode"] == "cpu-reduced" and result["tokens"] == TOKENS and result["reps"] == 1
    rows = result["rows"]
    assert sorted({r["op"] for r in rows}) == sorted(OPS)
    for r in rows:
        assert "error" not in r, r
        assert r["size"] == "8b"
        for phase in ("fwd", "bwd", "total"):
            assert r[f"{phase}_ms"] > 0, (r["op"], r["impl"], phase)
        # Phases come from the same repetitions: the total is never below a part.
        assert r["total_ms"] >= max(r["fwd_ms"], r["bwd_ms"]), r
        assert r["peak_extra_bytes"] > 0 and r["peak_extra_MiB"] == r["peak_extra_bytes"] / 2 ** 20
    # CPU mode: the references everywhere, and Tessel's own path only where it differs (chunked CE)
    assert {(r["op"], r["impl"]) for r in rows} == {(op, "eager") for op in OPS} | {("linear_ce", "tessel")}
    ce = [r for r in rows if r["op"] == "linear_ce"]
    assert all(r["vocab"] == VOCAB and r["chunk_size"] == TOKENS // bench_kernels.CPU_CE_CHUNKS for r in ce)


def test_rates_and_fractions_are_consistent(tiny_run):
    result, _ = tiny_run
    ceilings = result["ceilings"]
    assert ceilings["copy_GBps"] > 0 and ceilings["matmul_bf16_TFLOPs"] > 0
    assert ceilings["copy_bytes"] > 0 and ceilings["matmul_n"] > 0
    for r in result["rows"]:
        unit = "TFLOPs" if r["op"] == "linear_ce" else "GBps"
        assert r["ceiling"] == ("matmul_bf16_TFLOPs" if unit == "TFLOPs" else "copy_GBps")
        for phase in ("fwd", "bwd", "total"):
            rate = r[f"{phase}_{unit}"]
            assert rate > 0
            assert r[f"{phase}_pct_ceiling"] == pytest.approx(100 * rate / ceilings[r["ceiling"]], rel=1e-9)
        # the work behind each rate adds up: total = forward + backward
        work = {p: r[f"{p}_{unit}"] * r[f"{p}_ms"] for p in ("fwd", "bwd", "total")}
        assert work["total"] == pytest.approx(work["fwd"] + work["bwd"], rel=1e-9)
        if unit == "TFLOPs":  # model FLOPs: 2*T*H*V forward, twice that backward
            assert work["total"] * 1e9 == pytest.approx(6 * TOKENS * HIDDEN * VOCAB, rel=1e-9)
    by = {(r["op"], r["impl"]): r for r in result["rows"]}
    for (op, impl), r in by.items():
        eager = by[(op, "eager")]
        assert r["speedup_vs_eager"] == pytest.approx(eager["total_ms"] / r["total_ms"])
        assert r["peak_vs_eager"] == pytest.approx(r["peak_extra_bytes"] / eager["peak_extra_bytes"])
    goal = [g for g in result["goals"] if g["goal"].startswith("linear+ce")]
    assert len(goal) == 1
    assert goal[0]["value_pct"] == pytest.approx(100 * by[("linear_ce", "tessel")]["peak_vs_eager"])
    assert goal[0]["met"] == (goal[0]["value_pct"] <= 10)


def test_printed_table_lists_every_op(tiny_run):
    _, stdout = tiny_run
    assert "CPU reduced mode" in stdout and "ceilings: copy" in stdout
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("op ") and "peak MiB" in line)
    table = lines[header + 2:]
    for op in OPS:
        assert any(line.startswith(LABELS[op]) and " eager " in line for line in table), op
    assert any(line.startswith("linear+ce") and " tessel " in line for line in table)
    assert "goal linear+ce peak <= 10% of unfused [8b]" in stdout


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "0"], "argument --tokens: expected a positive integer, got 0"),
    (["--reps", "two"], "argument --reps: expected a positive integer, got 'two'"),
    (["--vocab", "-3"], "argument --vocab: expected a positive integer, got -3"),
    (["--warmup", "-1"], "argument --warmup: expected an integer >= 0, got -1"),
    (["--ops", "softmax"], "argument --ops: invalid choice: 'softmax'"),
    (["--models", "405b"], "argument --models: invalid choice: '405b'"),
    (["--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    (["--json", "/nonexistent-dir/k.json"], "folder /nonexistent-dir does not exist"),
    (["--cpu", "--timing", "idle"], "Leave --timing out on the CPU"),
])
def test_bad_arguments_fail_clearly(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_kernels.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_queue_ahead_sleeps_past_the_hosts_issue_time(monkeypatch):
    """--timing queued: the sleep queued before each call lasts twice the previous call's host issue time,
    plus 0.5 ms, at most 50 ms (a compiling first call does not stretch later sleeps); timed calls whose
    issue outlasted their sleep are counted (their times then include launch gaps), warm-ups are not.
    CUDA's sleep and events are stood in for: 1000 cycles per ms."""
    slept = []

    class Event:
        def __init__(self, enable_timing=True):
            self.t = 0.0

        def record(self):
            self.t = sum(slept) / 1000  # ms of sleep queued so far

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: slept.append(cycles))
    q = bench_kernels.QueueAhead(torch.device("cuda"))
    assert q.cycles_per_ms == pytest.approx(1000)  # measured: 10**7 cycles over 10**4 ms of stand-in clock
    assert q.ahead() == pytest.approx(4.5) and slept[-1] == 4500  # 2 x the first guess of 2 ms, + 0.5
    q.seen(3000.0, 4.5, timed=False)  # a warm-up that compiled: not counted, and the next sleep is capped
    assert q.short == 0 and q.ahead() == pytest.approx(50.0)
    q.seen(1.0, 50.0, timed=True)
    assert q.short == 0 and q.ahead() == pytest.approx(2.5)  # the previous call's issue time
    q.seen(6.0, 2.5, timed=True)
    assert q.short == 1 and q.ahead() == pytest.approx(12.5)
    q.begin()  # the next op starts from the guess again
    assert q.ahead() == pytest.approx(4.5)


def test_cpu_memory_peak_counts_allocations_and_frees_exactly():
    mib = 1 << 20
    with CPUMemoryPeak() as mem:
        a = torch.empty(mib, dtype=torch.uint8)
        b = torch.empty(2 * mib, dtype=torch.uint8)
        del a  # 2 MiB live
        c = torch.empty(3 * mib, dtype=torch.uint8)  # 5 MiB live: the peak
        del b, c
        d = torch.empty(mib // 2, dtype=torch.uint8)  # kept past the window
    assert mem.peak_bytes == 5 * mib
    assert mem.end_bytes == mib // 2
    del d


def test_cpu_memory_peak_sees_autograd_temporaries():
    x = torch.randn(256, 1024, requires_grad=True)  # 1 MiB
    with CPUMemoryPeak() as mem:
        y = torch.exp(x)  # saved for backward: 1 MiB
        y.backward(torch.ones_like(y))  # upstream ones 1 MiB, grad = ones * y: 1 MiB (kept as x.grad)
    assert 3 * (1 << 20) <= mem.peak_bytes <= 3 * (1 << 20) + 4096
    assert mem.end_bytes == 2 * (1 << 20)  # y and x.grad remain; the upstream ones are freed


def test_fp32_dtype_reaches_inputs_and_ceiling(tmp_path):
    """--dtype fp32: the linear + CE inputs are fp32 (their gradients' bytes say so) and the matmul
    ceiling, the rows' rates and the printed ceiling line are fp32 too."""
    path = tmp_path / "fp32.json"
    stdout = _main("--cpu", "--ops", "linear_ce", "--dtype", "fp32", "--tokens", str(TOKENS), "--vocab", str(VOCAB),
                   "--reps", "1", "--warmup", "0", "--no-compile", "--json", str(path))
    assert "dtype fp32" in stdout and "fp32 matmul" in stdout
    with open(path) as f:
        result = json.load(f)
    assert result["dtype"] == "fp32" and result["ceilings"]["matmul_dtype"] == "fp32"
    assert result["ceilings"]["matmul_fp32_TFLOPs"] > 0 and "matmul_bf16_TFLOPs" not in result["ceilings"]
    assert {r["impl"] for r in result["rows"]} == {"eager", "tessel"}
    for r in result["rows"]:
        assert "error" not in r, r
        assert r["ceiling"] == "matmul_fp32_TFLOPs"
        assert r["input_grad_bytes"] == 4 * (TOKENS + VOCAB) * HIDDEN  # fp32 hidden and weight
        assert r["total_pct_ceiling"] == pytest.approx(
            100 * r["total_TFLOPs"] / result["ceilings"]["matmul_fp32_TFLOPs"], rel=1e-9)
