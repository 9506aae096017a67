"""tools/plan.py: the --json schema (best first), the printed table, and bad input (exit 2, the fix named)."""
from __future__ import annotations

import json

from tools.plan import main

KEYS = {"tp", "pp", "vp", "dp", "cp", "ep", "mbs", "memory_gib_per_gpu", "step_time_s", "tflops_per_gpu", "mfu"}


def test_json_schema_best_first(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["--config", "tiny_llama_cpu", "--gpu", "h100-sxm", "--gpus-per-node", "4", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    layouts = doc["layouts"]
    assert layouts and all(KEYS <= set(x) for x in layouts)
    assert all(x["tp"] * x["pp"] * x["cp"] * x["dp"] == 4 for x in layouts)
    times = [x["step_time_s"] for x in layouts]
    assert times == sorted(times) and doc["fits"] is True
    best = layouts[0]
    assert 0 < best["mfu_causal"] < best["mfu"] < 1 and best["memory_gib_per_gpu"] > 0
    printed = capsys.readouterr().out
    assert "tp  pp  vp" in printed and printed.count("\n") > 5 and "best:" in printed


def test_pins_are_honoured(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["--config", "tiny_llama_cpu", "--gpus-per-node", "4", "--tp", "2", "--mbs", "1", "--json",
                 str(out)]) == 0
    layouts = json.loads(out.read_text())["layouts"]
    assert layouts and all(x["tp"] == 2 and x["mbs"] == 1 for x in layouts)


def test_bad_input_exits_2_naming_the_fix(capsys):
    assert main(["--config", "tiny_llama_cpu", "--tp", "16"]) == 2
    assert "pin --tp to a divisor of 4" in capsys.readouterr().err
    assert main(["--config", "tiny_llama_cpu", "--gpus-per-node", "6", "--tp", "2", "--pp", "4"]) == 2
    assert "do not divide the world of 6 GPUs" in capsys.readouterr().err
    assert main(["--family", "llama", "--hidden-size", "64"]) == 2
    assert "--num-layers" in capsys.readouterr().err
    assert main(["--config", "tiny_llama_cpu", "--hf-config", "x.json"]) == 2
    assert "exactly one model source" in capsys.readouterr().err


def test_moe_plan_lists_ep_at_zero_0_and_says_why_not_with_zero(tmp_path, capsys):
    from tests.parallel.test_moe_training import HF

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(HF))
    base = ["--hf-config", str(cfg), "--gpus-per-node", "4", "--seq-length", "16", "--global-batch-size", "8"]
    out = tmp_path / "plan.json"
    assert main(base + ["--zero", "0", "--json", str(out)]) == 0
    assert {x["ep"] for x in json.loads(out.read_text())["layouts"]} == {1, 2, 4}
    assert main(base + ["--zero", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {x["ep"] for x in doc["layouts"]} == {1} and "plan with --zero 0" in doc["notes"][0]
    assert "note: expert parallelism not enumerated" in capsys.readouterr().out
    assert main(base + ["--zero", "1", "--ep", "2"]) == 2
    assert "--ep 2 with --zero 1" in capsys.readouterr().err
