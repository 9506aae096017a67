"""tools/generate.py: greedy continuations of converted checkpoints equal transformers' generate().

Llama, Qwen3 (q/k norm) and GPT-2 (learned positions) are converted at TP=2 x PP=2 and generated from in
ONE 4-rank run (run_distributed calling the entry function in-process): prompts of three lengths in one
batch, a stop token, --text prompts, and a resharded TP=4 x PP=1 launch.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.tools.test_convert import make_hf_dir

FAMILIES = ("llama", "qwen3", "gpt2")
PROMPTS = [[5, 17, 3, 99, 42, 8, 60, 2], [11, 12, 13], [7, 1, 4, 4, 9]]
NEW = 8


def _generate_jobs(jobs: list[list[str]]) -> list[dict]:
    from tools.generate import run_generate

    return [run_generate(argv) for argv in jobs]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tools.convert_checkpoint import hf_to_tessel

    root = tmp_path_factory.mktemp("gen")
    out = {}
    for i, fam in enumerate(FAMILIES):
        hf = make_hf_dir(root / f"{fam}_hf", fam, seed=20 + i)
        out[fam] = (hf, hf_to_tessel(hf, root / f"{fam}_ckpt", tp=2, pp=2))
    return out


def hf_greedy(hf_dir, prompts, *, max_new_tokens: int, stop: int | None = None) -> list[list[int]]:
    """transformers' greedy generate() of each prompt alone (no padding), stopping only at ``stop``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the tiny configs' eos ids must not stop the reference
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stop, pad_token_id=0)
        out.append(seq[0, len(p):].tolist())
    return out


def test_generate_matches_transformers_on_4_ranks(converted, tmp_path):
    from engine.data.tokenizer import load_tokenizer
    from parallel.testing import run_distributed

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    texts = ["w3 w7 w1 w40", "w5 w5"]
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    refs = {fam: hf_greedy(hf, PROMPTS, max_new_tokens=NEW) for fam, (hf, _) in converted.items()}
    stop = refs["llama"][0][3]  # a token prompt 0's greedy continuation reaches at step 4
    jobs, want = [], []
    for fam in FAMILIES:
        jobs.append(["--ckpt", str(converted[fam][1]), "--tp", "2", "--pp", "2", "--tokens", str(prompts),
                     "--max-new-tokens", str(NEW), "--json", str(tmp_path / f"{fam}.json")])
        want.append(refs[fam])
    llama_hf, llama_ck = converted["llama"]
    jobs.append(["--ckpt", str(llama_ck), "--tp", "2", "--pp", "2", "--tokens", str(prompts), "--max-new-tokens",
                 str(NEW), "--stop-token", str(stop), "--stop-token", "99"])
    want.append(hf_greedy(llama_hf, PROMPTS, max_new_tokens=NEW, stop=[stop, 99]))
    jobs.append(["--ckpt", str(llama_ck), "--tp", "4", "--pp", "1", "--tokens", str(prompts),
                 "--max-new-tokens", str(NEW)])
    want.append(refs["llama"])
    text_ids = [load_tokenizer(str(converted["qwen3"][0])).encode(t) for t in texts]
    jobs.append(["--ckpt", str(converted["qwen3"][1]), "--tp", "2", "--pp", "2", "--text",
                 str(tmp_path / "texts.json"), "--max-new-tokens", "5"])
    want.append(hf_greedy(converted["qwen3"][0], text_ids, max_new_tokens=5))
    results = run_distributed(_generate_jobs, 4, jobs, timeout=180)
    assert all(r == results[0] for r in results)  # every rank returns the same continuations
    for job, res, ref in zip(jobs, results[0], want):
        assert res["tokens"] == ref, job
    for fam, ref in zip(FAMILIES, want):
        assert json.loads((tmp_path / f"{fam}.json").read_text()) == {"tokens": ref}
    stopped = results[0][3]["tokens"]
    assert stopped[0] == refs["llama"][0][:refs["llama"][0].index(stop) + 1] and len(stopped[0]) <= 4
    assert results[0][5]["text"] == [load_tokenizer(str(converted["qwen3"][0])).decode(c) for c in want[5]]


def test_generate_errors(converted, tmp_path, capsys):
    """Every argument error is a ValueError before the process group is used (one process here)."""
    from tools.generate import main, run_generate

    ck = str(converted["llama"][1])
    good = tmp_path / "ids.json"
    good.write_text(json.dumps(PROMPTS))
    cases = [
        (["--tokens", str(good), "--max-new-tokens", "2", "--tp", "2"], r"world size 1 != tp\*pp = 2\*1"),
        (["--tokens", str(good), "--max-new-tokens", "0"], "max_new_tokens=0 must be an integer >= 1"),
        (["--tokens", str(good), "--max-new-tokens", "121"], r"\(8 tokens\) \+ max_new_tokens=121 exceeds the "
                                                              "model's 128 positions"),
        (["--tokens", str(good), "--max-new-tokens", "2", "--stop-token", "100"], r"stop token\(s\) \[100\] lie "
                                                                                   "outside the vocabulary"),
        (["--tokens", str(good), "--max-new-tokens", "2", "--top-p", "1.5"], r"top_p=1.5 must be in \(0, 1\]"),
        (["--tokens", str(good), "--max-new-tokens", "2", "--dtype", "fp8"], "--dtype='fp8' must be one of"),
    ]
    for name, data in {"empty": [[1, 2], []], "oov": [[1, 100]], "strings": ["w1"]}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    cases.append((["--tokens", str(tmp_path / "empty.json"), "--max-new-tokens", "2"], "non-empty lists"))
    cases.append((["--tokens", str(tmp_path / "oov.json"), "--max-new-tokens", "2"], r"ids \[100\] lie outside"))
    cases.append((["--text", str(tmp_path / "oov.json"), "--max-new-tokens", "2"], "a non-empty JSON list of prompt "
                                                                                 "strings"))
    cases.append((["--text", str(tmp_path / "strings.json"), "--max-new-tokens", "2", "--tokenizer",
                   str(tmp_path / "nothing")], "not found"))
    for argv, msg in cases:
        with pytest.raises((ValueError, FileNotFoundError), match=msg):
            run_generate(["--ckpt", ck, *argv])
    assert main(["--ckpt", ck, "--tokens", str(tmp_path / "oov.json"), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err  # said once: before the process group, or by rank 0 after it
    assert err.count("error: --tokens") == 1 and err.startswith("generate.py")


def test_generate_single_process(converted, tmp_path):
    """TP=1 x PP=1 in this process (the TP2 x PP2 checkpoint resharded), JSON written."""
    from tools.generate import run_generate

    hf, ck = converted["gpt2"]
    (tmp_path / "p.json").write_text(json.dumps(PROMPTS[1]))  # a flat list: one prompt
    res = run_generate(["--ckpt", str(ck), "--tokens", str(tmp_path / "p.json"), "--max-new-tokens", "4",
                        "--json", str(tmp_path / "o.json")])
    assert res == {"tokens": hf_greedy(hf, [PROMPTS[1]], max_new_tokens=4)}
    assert json.loads((tmp_path / "o.json").read_text()) == res
