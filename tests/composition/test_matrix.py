"""Every row of tests/composition/matrix.py, through tools/pretrain.py's own path (``train_from_config``):

1. train STEPS steps uninterrupted, with a checkpoint after step STOP (``checkpoint.interval``) and one at
   the end, and the memory report (its profiled first step; the other runs of a row go without it: a
   profiler window per build, with the gc.collect it then made, was 40% of this test's time);
2. that run's step-STOP checkpoint resumed in a new build from another run directory: the losses equal the
   uninterrupted run's **bitwise** (until 2026-11-28 a third run stopped at STOP by ``train.max_tokens``
   wrote that checkpoint: one build and STOP steps more per row, 20% of this test's time; the stop itself is
   tested in tests/tools/test_pretrain_fault.py and tests/tools/test_restart.py);
3. the step-STOP checkpoint resumed into the row's second layout (and optimizer mode), stopped by
   ``train.max_tokens`` after one step: the loss equals the uninterrupted run's within 1e-5 relative in fp32
   (2e-2 in bf16: another layout sums in another order);
4. the final checkpoint exported with ``tessel-to-hf`` and loaded with transformers: its logits equal
   ``tools/evaluate.py --dump-logits`` of the checkpoint within 1e-4 (exported and evaluated in fp32), and
   ``AutoTokenizer`` loads the run's tokenizer from it (no ``--hf-files``) and encodes as the run did.

Post-training rows (``method`` sft, dpo, grpo) run tools/posttrain.py's path instead, from a base made
here (a random transformers model of the same architecture with the byte tokenizer and a chat template,
converted with hf-to-tessel) on small chat, preference and prompt records; a LoRA row exports merged
weights with ``lora-to-peft --merge --base`` and evaluates with ``--base``.

Rows of one world size share one process group (one launch per world size), on a tiny model and a
byte-tokenized corpus built here. ``pytest -m composition_full`` runs the cross product instead.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel.testing import run_distributed
from tests.composition.matrix import DEFAULT_ROWS, OPTIMIZERS, REFUSED, Row, full_rows

ROOT = Path(__file__).resolve().parents[2]
STEPS, STOP, SEQ = 4, 2, 16
# Sequences per step: 4 in the default rows (one micro-batch per rank at dp4, two at dp2: gradient accumulation
# stays covered; the rows' steps are mostly small collectives, so 8 sequences took 1.5x as long), 8 in the
# full cross product, whose results docs/composition.md records at 8.
GBS, FULL_GBS = 4, 8
TOKENS = [[5, 17, 3, 99, 42, 8, 60, 2, 200, 31], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
MODEL = {
    "llama": ["model.family=llama", "model.num_attention_heads=8", "model.num_key_value_heads=4"],
    "gpt2": ["model.family=gpt2", "model.num_attention_heads=4", "model.rope_theta=none", "model.num_key_value_heads=none"],
    # No model.head_dim: the export must still tell transformers (whose Qwen3 default is 128).
    "qwen3": ["model.family=qwen3", "model.num_attention_heads=8", "model.num_key_value_heads=4"],
    # + model.hf_config: MOE_HF[family], written to the rows' root by _run_rows
    "mixtral": ["model.family=mixtral", "model.num_attention_heads=8", "model.num_key_value_heads=4"],
}
MOE_HF = {  # family -> the MoE keys the [model] section has no field for (a config.json)
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
                "router_aux_loss_coef": 0.02},
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import textwrap

    d = tmp_path_factory.mktemp("composition_corpus")
    docs = [textwrap.dedent(m.__doc__ or "") for m in (os, subprocess, json, textwrap, pytest, shutil)] * 6
    src = d / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs if t.strip()))
    prefix = str(d / "text_document")
    subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(src),
                    "--output-prefix", prefix, "--tokenizer", "byte", "--workers", "1"], check=True,
                   capture_output=True)
    return prefix


POSTTRAIN_SEQ = 64
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}"
            "<|endoftext|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
POSTTRAIN = {  # method -> (records file, extra overrides)
    "sft": ("chat.jsonl", ["posttrain.method=sft"]),
    "dpo": ("pairs.jsonl", ["posttrain.method=dpo"]),
    # kl_beta > 0 and two steps per rollout: a loss that is not 0 by construction (at ratio 1 with equal
    # completion lengths the surrogate's value is exactly 0, its gradient is not)
    "grpo": ("prompts.jsonl", ["posttrain.method=grpo", "posttrain.grpo.group_size=4", "posttrain.grpo.max_new_tokens=8",
                               "posttrain.grpo.reward_modules=tests.tools.grpo_rewards", "posttrain.grpo.kl_beta=0.1",
                               "posttrain.grpo.steps_per_rollout=2"]),
}


def _posttrain_data(root: Path) -> Path:
    """Chat, preference and prompt records in plain words (byte-tokenized)."""
    d = root / "posttrain_data"
    if d.exists():
        return d
    d.mkdir(parents=True)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    chat, pairs, prompts = [], [], []
    for i in range(16):
        q, a, b = words[i % 10], words[(i * 3 + 1) % 10], words[(i * 7 + 2) % 10]
        chat.append({"messages": [{"role": "user", "content": f"{q} {a}?"}, {"role": "assistant", "content": f"{b} {a}"}]})
        pairs.append({"prompt": f"{q}?", "chosen": f"{a} {b}", "rejected": f"{b}"})
        prompts.append({"messages": [{"role": "user", "content": f"{q} {b}"}], "reward": "words_over_6"})
    for name, recs in (("chat.jsonl", chat), ("pairs.jsonl", pairs), ("prompts.jsonl", prompts)):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def _posttrain_base(row: Row, root: Path) -> Path:
    """A Tessel checkpoint of a random transformers model with the row's architecture, whose hf/ holds the
    byte tokenizer (as Hugging Face files) with a chat template."""
    import transformers

    from engine.config import load_config
    from engine.data.tokenizer import ByteTokenizer
    from models.hook import hf_config_from_run
    from tools.convert_checkpoint import hf_to_tessel

    out = root / f"base-{row.family}-{'tied' if row.tied else 'untied'}"
    if out.exists():
        return out
    cfg = load_config("tiny_llama_cpu", _model_overrides(row) + [f"train.seq_length={POSTTRAIN_SEQ}"])
    hf_cfg = hf_config_from_run(cfg.model, vocab_size=257)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_cfg))
    hf = root / (out.name + "-hf")
    model.save_pretrained(hf)
    files = ByteTokenizer().hf_files(model_max_length=64)
    tok_cfg = json.loads(files["tokenizer_config.json"])
    tok_cfg["chat_template"] = TEMPLATE
    (hf / "tokenizer.json").write_text(files["tokenizer.json"])
    (hf / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return hf_to_tessel(hf, out)


def _model_overrides(row: Row) -> list[str]:
    return ["model.vocab_size=257", "model.hidden_size=32", "model.num_layers=4", "model.ffn_hidden_size=64",
            "model.max_position_embeddings=64", f"model.dtype={row.dtype}",
            f"model.tie_word_embeddings={str(row.tied).lower()}", f"model.fp8={row.fp8}",
            f"train.activation_checkpointing={row.recompute}", *MODEL[row.family]]


def _overrides(row: Row, layout, optimizer: str, prefix: str, run_dir: str, *, max_steps: int | None = None,
               memory_report: bool = False, gbs: int = GBS, interval: int = 0):
    seq = SEQ if row.method == "pretrain" else POSTTRAIN_SEQ
    if row.method == "pretrain":
        data = [f"data.paths={prefix}", f"data.tokenizer={prefix}.tokenizer.json", f"data.cache_dir={run_dir}/cache"]
    else:
        root = Path(run_dir).parent.parent  # run_dir = ROOT/<row>/<straight|resumed|reshard>
        records, extra = POSTTRAIN[row.method]
        data = [f"checkpoint.load={root / ('base-' + row.family + '-' + ('tied' if row.tied else 'untied'))}",
                f"posttrain.data={root / 'posttrain_data' / records}", *extra, "data.num_workers=0"]
        if row.lora:
            data += ["posttrain.lora.rank=4", "posttrain.lora.alpha=8"]
    if row.family in MOE_HF:
        data.append(f"model.hf_config={Path(run_dir).parent.parent / ('moe-' + row.family + '.json')}")
    out = [*data, *_model_overrides(row), *layout.overrides(),
           *OPTIMIZERS[optimizer], f"train.seq_length={seq}", f"train.global_batch_size={gbs}",
           "train.micro_batch_size=1", f"train.steps={STEPS}", "train.eval_interval=0", "train.log_interval=100",
           "optim.warmup_steps=1", "optim.lr=0.01", f"checkpoint.interval={interval}", "logging.tensorboard=false",
           "logging.jsonl=false", "logging.progress_bar=off", "logging.peak_tflops=1.0", f"train.run_dir={run_dir}",
           f"logging.memory_report={str(memory_report).lower()}", *row.extra]
    if max_steps is not None:
        rows = 2 if row.method == "dpo" else 1  # a preference pair is two rows
        out.append(f"train.max_tokens={max_steps * gbs * rows * seq}")
    return out


def _train(row: Row, layout, optimizer: str, prefix: str, run_dir: str, *, max_steps: int | None = None,
           memory_report: bool = False, gbs: int = GBS, interval: int = 0):
    import torch.distributed as dist

    from engine.config import load_config
    from tools.pretrain import train_from_config

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    overrides = _overrides(row, layout, optimizer, prefix, run_dir, max_steps=max_steps,
                           memory_report=memory_report, gbs=gbs, interval=interval)
    if row.method != "pretrain":
        from tools.posttrain import base_defaults, posttrain_from_config

        cfg = load_config("tiny_llama_cpu", overrides + ["data.paths=[]", "data.tokenizer=none"], defaults=base_defaults)
        return [h.loss for h in posttrain_from_config(cfg, run_dir, world=world)]
    cfg = load_config("tiny_llama_cpu", overrides)
    return [h.loss for h in train_from_config(cfg, run_dir, rank=rank, world=world)]


def _rows_of_world(rows: list[Row], prefix: str, root: str, gbs: int) -> dict:
    import torch.distributed as dist

    from engine.checkpoint.format import LATEST_FILE, step_dirname

    out = {}
    for row in rows:
        d = Path(root) / row.name
        # the memory report (a profiled first step) once per row, in its straight run: each row's first layout
        straight = _train(row, row.layout, row.optimizer, prefix, str(d / "straight"), memory_report=True, gbs=gbs,
                          interval=STOP)
        if not dist.is_initialized() or dist.get_rank() == 0:  # its step-STOP checkpoint, for both resumes
            for run in ("resumed", "reshard"):
                dst = d / run / "checkpoints"
                shutil.copytree(d / "straight" / "checkpoints" / step_dirname(STOP), dst / step_dirname(STOP))
                (dst / LATEST_FILE).write_text(step_dirname(STOP) + "\n")
        if dist.is_initialized():
            dist.barrier()
        reshard = None
        resumed = _train(row, row.layout, row.optimizer, prefix, str(d / "resumed"), gbs=gbs)
        if row.reshard is not None:
            reshard = _train(row, row.reshard, row.reshard_optimizer or row.optimizer, prefix, str(d / "reshard"),
                             max_steps=STOP + 1, gbs=gbs)
        out[row.name] = {"straight": straight, "resumed": resumed, "reshard": reshard}
        if dist.is_initialized():  # every run closed its mesh: only the launch's default group is left
            from torch.distributed import distributed_c10d as c10d

            assert len(c10d._world.pg_map) == 1, f"{row.name}: {len(c10d._world.pg_map)} process groups left"
    return out


def _export_and_compare(row: Row, root: Path) -> float:
    """Max |logits| difference between transformers on the export and tools/evaluate.py."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tools.convert_checkpoint import tessel_to_hf
    from tools.evaluate import run_evaluate

    d = root / row.name
    hf = d / "hf"
    base = []
    if row.lora:  # adapter-only checkpoints: merged weights out, the base in for evaluation
        from tools.lora_export import lora_to_peft

        base = ["--base", str(root / f"base-{row.family}-{'tied' if row.tied else 'untied'}")]
        lora_to_peft(d / "straight" / "checkpoints", hf, merge=True, base=base[1], dtype="fp32")
    else:
        tessel_to_hf(d / "straight" / "checkpoints", hf, dtype="fp32")
    (d / "tokens.json").write_text(json.dumps(TOKENS))
    run_evaluate(["--ckpt", str(d / "straight" / "checkpoints"), "--tokens", str(d / "tokens.json"),
                  "--dump-logits", str(d / "logits.safetensors"), "--set", "model.dtype=fp32", *base])
    ours = load_file(str(d / "logits.safetensors"))
    # The run's tokenizer travelled with its checkpoints into the export.
    from transformers import AutoTokenizer

    from engine.data.tokenizer import ByteTokenizer

    text = "def f(x):\n    return x"
    assert AutoTokenizer.from_pretrained(hf)(text)["input_ids"] == ByteTokenizer().encode(text)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for i, ids in enumerate(TOKENS):
            theirs = model(torch.tensor([ids])).logits[0]
            mine = ours[f"logits.{i}"]  # (s, vocab)
            worst = max(worst, float((theirs - mine).abs().max()))
    return worst


def _check_row(row: Row, r: dict, root: Path) -> str:
    assert len(r["straight"]) == STEPS, r
    assert all(loss != 0.0 for loss in r["straight"][STOP:]), f"a zero loss proves nothing: {r}"
    assert r["resumed"] == r["straight"][STOP:], f"the resume from step {STOP} differs from straight: {r}"
    line = "train, resume bitwise"
    if row.reshard is not None:
        # another layout sums in another order; with FP8 a moved rounding can also move a quantisation step
        rel = (1e-5 if row.fp8 == "none" else 1e-3) if row.dtype == "fp32" else 2e-2
        assert r["reshard"] == pytest.approx([r["straight"][STOP]], rel=rel), r
        line += f", reshard rel {abs(r['reshard'][0] / r['straight'][STOP] - 1):.1e}"
    diff = _export_and_compare(row, root)
    assert diff < 1e-4, f"exported logits differ by {diff}"
    return line + f", export logits {diff:.1e}"


def _check(rows: list[Row], results: dict, root: Path) -> dict[str, str]:
    """Every row's result line; all rows are checked before any failure is raised."""
    summary, failed = {}, []
    for row in rows:
        try:
            summary[row.name] = _check_row(row, results[row.name], root)
        except AssertionError as e:
            summary[row.name] = f"FAILED: {str(e).splitlines()[0][:200]}"
            failed.append(row.name)
    out = os.environ.get("TESSEL_COMPOSITION_RESULTS")
    if out:  # docs/composition.md is generated from this: python -m tests.composition.matrix RESULTS
        Path(out).write_text(json.dumps(summary, indent=1))
    assert not failed, {n: summary[n] for n in failed}
    return summary


def _run_rows(rows: list[Row], corpus: str, root: Path, gbs: int = GBS) -> dict[str, str]:
    by_world: dict[int, list[Row]] = {}
    for row in rows:
        by_world.setdefault(row.layout.world, []).append(row)
        if row.family in MOE_HF:
            (root / f"moe-{row.family}.json").write_text(json.dumps(MOE_HF[row.family]))
        if row.method != "pretrain":  # made once, before any rank needs them
            _posttrain_data(root)
            _posttrain_base(row, root)
    results = {}
    for world, group in sorted(by_world.items()):
        for start in range(0, len(group), 40):  # a fresh process group every 40 rows
            batch = group[start:start + 40]
            if world == 1:
                results.update(_rows_of_world(batch, corpus, str(root), gbs))
            else:
                results.update(run_distributed(_rows_of_world, world, batch, corpus, str(root), gbs,
                                               timeout=120 + 20 * len(batch))[0])
    return _check(rows, results, root)


def test_default_rows(corpus, tmp_path):
    _run_rows(list(DEFAULT_ROWS), corpus, tmp_path)


@pytest.mark.parametrize("overrides, message", REFUSED)
def test_unsupported_combinations_are_refused_at_config_time(overrides, message, monkeypatch):
    """Refused by the config or by the model's plan (models/hook.py): both before any process group. The
    plan's checks see a CPU host, as CI's (symm_mem is refused there and runs on GPUs)."""
    from engine.config import load_config
    from models.hook import ModelHook

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises((ValueError, ImportError), match=message):
        ModelHook.from_run_config(load_config("tiny_llama_cpu", list(overrides)), tokenizer_vocab=None)


@pytest.mark.composition_full
def test_full_cross_product(corpus, tmp_path):
    """``TESSEL_COMPOSITION_FILTER=fp8`` runs only the rows whose name contains that text."""
    text = os.environ.get("TESSEL_COMPOSITION_FILTER", "")
    rows = [r for r in full_rows() if text in r.name]
    assert rows, f"TESSEL_COMPOSITION_FILTER={text!r} selects no row"
    _run_rows(rows, corpus, tmp_path, FULL_GBS)
