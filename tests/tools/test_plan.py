"""tools/plan.py: the --json schema (best first), the printed table, and bad input (exit 2, the fix named)."""
from __future__ import annotations

import json
import os

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
    assert main(["--config", "tiny_llama_cpu", "--set", "model.fp8=mxfp8"]) == 2  # emulated: no FP8 peak applies
    assert "runs its GEMMs as fp32 matmuls" in capsys.readouterr().err
    assert main(["--config", "tiny_llama_cpu", "--set", "model.fp8=mxfp8", "--precision", "bf16", "--json",
                 os.devnull]) == 0
    te = ["--config", "tiny_llama_cpu", "--set", "model.fp8_backend=te"]  # what the trainer refuses is not planned
    assert main(te + ["--set", "model.fp8=rowwise"]) == 2
    assert "has no Transformer Engine recipe" in capsys.readouterr().err
    assert main(te + ["--set", "model.fp8=mxfp8"]) == 2
    assert "not on --gpu h100-sxm; plan it with --gpu b200" in capsys.readouterr().err
    assert main(te + ["--set", "model.fp8=mxfp8", "--gpu", "b200", "--json", os.devnull]) == 0
    # FP8 implied by the preset on a GPU without FP8 tensor cores: the message says where fp8 came from
    assert main(["--config", "tiny_llama_cpu", "--set", "model.fp8=tensorwise", "--gpu", "a100-80gb"]) == 2
    err = capsys.readouterr().err
    assert "model.fp8 = 'tensorwise' (the preset's, or --set) plans at FP8 precision" in err and "h100-sxm" in err
    assert main(["--config", "tiny_llama_cpu", "--set", "model.fp8=tensorwise", "--gpu", "a100-80gb",
                 "--precision", "bf16", "--json", os.devnull]) == 0


def test_moe_plan_lists_ep_at_every_zero_stage(tmp_path, capsys):
    from tests.parallel.test_moe_training import HF

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(HF))
    base = ["--hf-config", str(cfg), "--gpus-per-node", "4", "--seq-length", "16", "--global-batch-size", "8"]
    out = tmp_path / "plan.json"
    for zero in ("0", "1"):
        assert main(base + ["--zero", zero, "--json", str(out)]) == 0
        assert {x["ep"] for x in json.loads(out.read_text())["layouts"]} == {1, 2, 4}
    assert main(base + ["--zero", "1", "--ep", "2", "--dp", "1"]) == 2
    assert "--ep 2 must divide --dp 1" in capsys.readouterr().err


def test_tp_overlap_ring_flag(tmp_path, capsys):
    """--tp-overlap ring: recorded in the JSON and the header; tp > 1 layouts spend less exposed TP time than
    the plain plan's, tp 1 layouts are unchanged."""
    plain, ring = tmp_path / "plain.json", tmp_path / "ring.json"
    base = ["--config", "tiny_llama_cpu", "--gpu", "h100-sxm", "--gpus-per-node", "4", "--mbs", "2"]
    assert main(base + ["--json", str(plain)]) == 0
    assert main(base + ["--tp-overlap", "ring", "--json", str(ring)]) == 0
    assert "TP ring overlap" in capsys.readouterr().out
    a, b = json.loads(plain.read_text()), json.loads(ring.read_text())
    assert (a["tp_overlap"], b["tp_overlap"]) == ("none", "ring")
    key = ("tp", "pp", "vp", "dp", "cp")
    by = {tuple(x[k] for k in key): x for x in a["layouts"]}
    symm = tmp_path / "symm.json"  # modelled as the ring: the same predictions
    assert main(base + ["--tp-overlap", "symm_mem", "--json", str(symm)]) == 0
    assert "TP symm_mem overlap (modelled as the ring)" in capsys.readouterr().out
    s = json.loads(symm.read_text())
    assert s["tp_overlap"] == "symm_mem" and [x["step_time_s"] for x in s["layouts"]] == [
        x["step_time_s"] for x in b["layouts"]]
    for x in b["layouts"]:
        y = by[tuple(x[k] for k in key)]
        if x["tp"] == 1:
            assert x["step_time_s"] == y["step_time_s"]
        else:
            assert x["time_s"]["tp_comm"] < y["time_s"]["tp_comm"]



def test_overlap_param_gather_flag(tmp_path, capsys):
    """--overlap-param-gather: the tiny preset leaves it off (Tessel's default), so ZeRO 1's post-step parameter
    gather is exposed in every layout with dp x cp > 1 (ZeRO's group); 'on' hides it under the next forward
    (the same layouts are faster by it, dp x cp = 1 unchanged), recorded in the JSON and the header; read at ZeRO 1 and 2 only."""
    off, on = tmp_path / "off.json", tmp_path / "on.json"
    base = ["--config", "tiny_llama_cpu", "--gpu", "h100-sxm", "--gpus-per-node", "4", "--mbs", "2"]
    assert main(base + ["--json", str(off)]) == 0
    assert "parameter gather after the update" in capsys.readouterr().out
    assert main(base + ["--overlap-param-gather", "on", "--json", str(on)]) == 0
    assert "parameter gather overlapped" in capsys.readouterr().out
    a, b = json.loads(off.read_text()), json.loads(on.read_text())
    assert (a["overlap_param_gather"], b["overlap_param_gather"]) == (False, True)
    key = ("tp", "pp", "vp", "dp", "cp")
    by = {tuple(x[k] for k in key): x for x in a["layouts"]}
    assert any(x["dp"] * x["cp"] > 1 for x in b["layouts"])
    for x in b["layouts"]:
        y = by[tuple(x[k] for k in key)]
        if x["dp"] * x["cp"] == 1:
            assert x["step_time_s"] == y["step_time_s"]
        else:
            assert x["time_s"]["dp_comm_exposed"] < y["time_s"]["dp_comm_exposed"]
            assert x["step_time_s"] < y["step_time_s"]
    assert main(base + ["--zero", "0", "--overlap-param-gather", "on"]) == 2
    assert "read at --zero 1 or 2" in capsys.readouterr().err

def test_explicit_dimensions_take_their_training_settings_from_the_flags(tmp_path, capsys):
    """--family: no preset, so --seq-length and --global-batch-size are required and --recompute defaults to
    selective (not the engine's defaults); a Mixtral from explicit dimensions plans; a missing width names
    its flag."""
    dims = ["--family", "llama", "--hidden-size", "1024", "--num-layers", "4", "--num-heads", "8",
            "--ffn-hidden-size", "2816", "--gpus-per-node", "2"]
    assert main(dims) == 2
    assert "give --seq-length and --global-batch-size" in capsys.readouterr().err
    out = tmp_path / "plan.json"
    assert main(dims + ["--seq-length", "512", "--global-batch-size", "4", "--json", str(out)]) == 0
    assert "selective recompute" in capsys.readouterr().out
    moe = ["--family", "mixtral", "--hidden-size", "512", "--num-layers", "2", "--num-heads", "8",
           "--ffn-hidden-size", "1024", "--num-experts", "4", "--top-k", "2", "--gpus-per-node", "2",
           "--seq-length", "512", "--global-batch-size", "4"]
    assert main(moe) == 0
    capsys.readouterr()
    assert main([a for a in dims if a not in ("--ffn-hidden-size", "2816")] + ["--seq-length", "512",
                                                                                "--global-batch-size", "4"]) == 2
    assert "needs --ffn-hidden-size" in capsys.readouterr().err


def test_set_of_a_key_the_planner_replaces_is_refused(tmp_path, capsys):
    """--config X --set of a key every layout replaces (the degrees, the micro-batch, the schedule, ...) would be
    dropped without a word: exit 2 naming the pin flag, or saying the planner sets it; keys the planner reads
    still change the plan."""
    base = ["--config", "tiny_llama_cpu", "--gpus-per-node", "4", "--top", "1"]
    for kv, fix in (("parallel.tp=2", "pin it with --tp 2 instead"), ("parallel.pp=2", "pin it with --pp 2 instead"),
                    ("train.micro_batch_size=4", "pin it with --mbs 4 instead"),
                    ("parallel.schedule=zb-h1", "drop it: the planner chooses it"),
                    ("train.recompute_num_layers=1", "drop it: the planner applies the --recompute mode")):
        assert main(base + ["--set", kv]) == 2, kv
        err = capsys.readouterr().err
        assert err.startswith(f"plan.py: error: --set {kv}: the planner sets {kv.split('=')[0]} itself") and fix in err
        assert err.count("\n") == 1
    out = tmp_path / "plan.json"
    assert main(base + ["--set", "train.seq_length=64", "--set", "parallel.tp_overlap=ring", "--json", str(out)]) == 0
    assert "seq 64" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["seq_length"] == 64 and doc["tp_overlap"] == "ring"
