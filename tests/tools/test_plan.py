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
