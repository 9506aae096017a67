"""Post-train a converted model over TP x PP x DP: supervised fine-tuning on chat records, DPO or GRPO.

    torchrun --nproc-per-node N tools/posttrain.py --config configs/<preset>.toml \\
        --set checkpoint.load=BASE_CKPT --set posttrain.method=sft --set posttrain.data=chat.jsonl [--run-dir DIR]

The same assembly line and loop as tools/pretrain.py (docs/architecture.md) with post-training data
and, for DPO and GRPO, a different step loss (engine/posttrain/); GRPO's data are rollouts generated
by the model being trained (engine/posttrain/rollout.py). The base weights come from ``checkpoint.load``
(a checkpoint written by ``convert_checkpoint.py hf-to-tessel`` or by a run); its ``hf/`` directory
supplies the architecture (``model.hf_config``), the tokenizer (``data.tokenizer``) and the chat
template unless the config names them. The run directory holds what pretraining's holds; its
checkpoints' ``hf/`` holds the tokenizer files and the chat template the run used (byte for byte: a
sentencepiece tokenizer.model is binary), so the next stage and ``tessel-to-hf`` chat the same way.
A run directory that already holds a complete checkpoint resumes from it; as in tools/pretrain.py, a
non-empty directory that is not a Tessel run, and a resume that changes the model, the records, the global
batch or the sequence length, are refused before anything starts (engine/fault.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, ROOT)

from engine.config import add_config_args, load_config  # noqa: E402
from engine.fault import OnceArgumentParser  # noqa: E402

HF_SUBDIR = "hf"


def base_defaults(data: dict[str, Any]) -> None:
    """Fill ``model.hf_config`` and ``data.tokenizer`` from the base checkpoint's ``hf/`` directory
    when the config leaves them unset (raw config dict, before validation)."""
    load = (data.get("checkpoint") or {}).get("load")
    if not load:
        return
    hf = base_hf_dir(load)
    if hf is None:
        return
    model = data.setdefault("model", {})
    if not model.get("hf_config") and not any(model.get(k) for k in ("hidden_size", "num_layers")) \
            and (hf / "config.json").is_file():
        model["hf_config"] = str(hf / "config.json")
    d = data.setdefault("data", {})
    if not d.get("tokenizer") and (hf / "tokenizer.json").is_file():
        d["tokenizer"] = str(hf)


def base_hf_dir(load: str) -> Path | None:
    """The Hugging Face side files of the checkpoint ``load``: ``hf/`` in its step directory (trainer
    checkpoints) or beside the step directories (hf-to-tessel conversions); None when neither exists."""
    from engine.checkpoint import CheckpointError, resolve_checkpoint

    try:
        step_dir = resolve_checkpoint(load)
    except CheckpointError as e:
        hint = ""
        if not Path(load).exists():  # the SmolLM2 presets' base is written by tools/smollm2.py
            hint = ("; convert a Hugging Face model with tools/convert_checkpoint.py hf-to-tessel, or, for the "
                    "smollm2_* presets (runs/smollm2/tessel), run `python tools/smollm2.py` first (docs/posttrain.md)")
        raise ValueError(f"checkpoint.load: {e}{hint}") from None
    for hf in (step_dir / HF_SUBDIR, step_dir.parent / HF_SUBDIR):
        if hf.is_dir():
            return hf
    return None


@dataclass
class Prepared:
    """Everything checked and built before any process group exists."""

    model: Any  # models.hook.ModelHook
    plan: Any  # engine.assembly.MemoryPlan
    tokenizer: Any
    train_data: Any
    valid_data: Any = None
    side_files: dict[str, bytes] = field(default_factory=dict)  # hf/ files, written into every checkpoint
    grpo: dict = field(default_factory=dict)  # GRPO: records, prompt ids, the reward registry


def _hf_files(folder: Path) -> dict[str, bytes]:
    """The Hugging Face side files of ``folder`` (the ones conversions carry, SIDE_FILE_RE; config.json is not
    one: a checkpoint's model_config is), as ``hf/<name>`` -> bytes: data kept byte for byte (a sentencepiece
    tokenizer.model is binary)."""
    from tools.convert_checkpoint import SIDE_FILE_RE

    return {f"{HF_SUBDIR}/{p.name}": p.read_bytes() for p in sorted(folder.iterdir())
            if p.is_file() and p.name != "config.json" and SIDE_FILE_RE.match(p.name)}


def _side_files(hf: Path | None, *, tokenizer_files: dict[str, bytes] | None = None,
                chat_template: str | None = None) -> dict[str, bytes]:
    """The hf/ files kept in every checkpoint of the run: the base's (tokenizer, its config with the chat
    template, generation config). ``tokenizer_files``: the tokenizer the run used (``hf/<name>`` -> bytes)
    when ``data.tokenizer`` names it: they replace the base's tokenizer files (only its
    generation_config.json stays). ``chat_template``: the text of the template the run trained with when
    the kept files do not hold it (``posttrain.chat_template``, or a template read beside a tokenizer
    file): it replaces the template in tokenizer_config.json (where there is one) and is written as
    chat_template.jinja, so the next stage and ``tessel-to-hf`` chat the same way."""
    files = {} if hf is None else _hf_files(hf)
    if tokenizer_files is not None:
        generation = f"{HF_SUBDIR}/generation_config.json"
        files = {**({generation: files[generation]} if generation in files else {}), **tokenizer_files}
    if chat_template is not None:
        key = f"{HF_SUBDIR}/tokenizer_config.json"
        if key in files:
            config = json.loads(files[key])
            config["chat_template"] = chat_template
            files[key] = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()
        files[f"{HF_SUBDIR}/chat_template.jinja"] = chat_template.encode()
    return files


def _run_tokenizer_files(spec: str, tok, *, max_length: int) -> dict[str, bytes]:
    """The files of the tokenizer ``data.tokenizer`` names, as the checkpoint keeps them: a folder's side
    files byte for byte; for a tokenizer file (or ``byte``), the tokenizer as loaded, in the Hugging Face
    files pretraining writes (engine/data/tokenizer.py ``hf_files``)."""
    if os.path.isdir(spec):
        return _hf_files(Path(spec))
    return {f"{HF_SUBDIR}/{name}": text.encode() for name, text in tok.hf_files(model_max_length=max_length).items()}


def _tokenizer_dir(spec: str) -> str | None:
    return spec if os.path.isdir(spec) else os.path.dirname(os.path.abspath(spec))


def prepare(cfg, *, world: int) -> Prepared:
    """The checks that need no communication, in order: method, layout, base checkpoint, tokenizer,
    chat template, every record (tokenized here, so a bad record fails before training), model,
    memory plan. Raises ValueError naming the problem and the fix."""
    from engine.assembly import check_microbatches, memory_plan
    from engine.data.tokenizer import load_tokenizer
    from engine.posttrain.chat import load_chat_template, read_jsonl
    from engine.posttrain.datasets import ChatSFTDataset, PreferenceDataset
    from models.hook import ModelHook

    pt, t = cfg.posttrain, cfg.train
    if pt.method == "none":
        raise ValueError("posttrain.method is 'none': set posttrain.method=sft, dpo or grpo (tools/pretrain.py "
                         "pretrains)")
    check_microbatches(cfg, cfg.validate_world(world))
    if cfg.data.paths:
        raise ValueError("data.paths names pretraining data, which post-training does not read: give the records "
                         "as posttrain.data (and posttrain.valid_data), and remove data.paths")
    if pt.lora.rank:
        from engine.posttrain.lora import check_lora

        check_lora(rank=pt.lora.rank, alpha=pt.lora.alpha, dropout=pt.lora.dropout, targets=pt.lora.targets,
                   fp8=cfg.model.fp8, tp_overlap=cfg.parallel.tp_overlap)
    if not cfg.checkpoint.load:
        raise ValueError("post-training starts from a model: set checkpoint.load to a Tessel checkpoint (convert a "
                         "Hugging Face model with tools/convert_checkpoint.py hf-to-tessel)")
    hf = base_hf_dir(cfg.checkpoint.load)
    if not cfg.data.tokenizer:
        raise ValueError(f"no tokenizer: the base checkpoint {cfg.checkpoint.load} has no hf/tokenizer.json; set "
                         "data.tokenizer")
    tok = load_tokenizer(cfg.data.tokenizer)
    template = load_chat_template(_tokenizer_dir(cfg.data.tokenizer), override=pt.chat_template)
    n_eval = (t.steps // t.eval_interval + 1) * t.eval_iters * t.global_batch_size if t.eval_interval else 0

    def dataset(path, num_samples):
        kw = dict(template=template, tokenizer=tok, seq_length=t.seq_length, num_samples=num_samples, seed=t.seed,
                  truncate=pt.truncate)
        if pt.method == "sft":
            return ChatSFTDataset(read_jsonl(path), pack=pt.packed, **kw)
        return PreferenceDataset(read_jsonl(path), **kw)

    if t.eval_interval and pt.valid_data is None:
        raise ValueError(f"train.eval_interval={t.eval_interval} but posttrain.valid_data is unset; give held-out "
                         "records or set train.eval_interval=0")
    grpo = {}
    if pt.method == "grpo":
        from engine.posttrain.rollout import check_rollout_shape, prompt_records, reward_registry

        g = pt.grpo
        check_rollout_shape(g, global_batch_size=t.global_batch_size, dp=cfg.validate_world(world))
        if cfg.checkpoint.interval % g.steps_per_rollout:
            raise ValueError(f"checkpoint.interval={cfg.checkpoint.interval} is not a multiple of "
                             f"posttrain.grpo.steps_per_rollout={g.steps_per_rollout}: save on rollout boundaries, so "
                             "a resume regenerates the same rollout")
        registry = reward_registry(g.reward_modules)
        kw = dict(template=template, tokenizer=tok, registry=registry, seq_length=t.seq_length,
                  max_new_tokens=g.max_new_tokens)
        grpo["registry"] = registry
        grpo["records"] = read_jsonl(pt.data)
        grpo["prompts"] = prompt_records(grpo["records"], **kw)
        if pt.valid_data:
            grpo["valid_records"] = read_jsonl(pt.valid_data)
            grpo["valid_prompts"] = prompt_records(grpo["valid_records"], **kw)
        train = valid = None
    else:
        train = dataset(pt.data, t.steps * t.global_batch_size)
        valid = dataset(pt.valid_data, n_eval) if pt.valid_data and n_eval else None
    model = ModelHook.from_run_config(cfg, tokenizer_vocab=tok.vocab_size)
    if pt.lora.rank and model.config.num_experts:  # expert MLPs take no adapters: refused before any process group
        from engine.posttrain.lora import check_lora

        check_lora(rank=pt.lora.rank, alpha=pt.lora.alpha, dropout=pt.lora.dropout, targets=pt.lora.targets,
                   num_experts=model.config.num_experts)
    plan = memory_plan(cfg, model, world=world)
    if not plan.fits:
        raise ValueError(plan.error())
    # The checkpoints keep the tokenizer and template the run used: data.tokenizer's files (the base's hf/
    # when the config leaves it unset), and the template itself unless those files hold it.
    keep_template = bool(pt.chat_template) or not os.path.isdir(cfg.data.tokenizer)
    side = _side_files(hf, tokenizer_files=_run_tokenizer_files(cfg.data.tokenizer, tok,
                                                                max_length=model.config.max_position_embeddings),
                       chat_template=template.text if keep_template else None)
    return Prepared(model=model, plan=plan, tokenizer=tok, train_data=train, valid_data=valid, side_files=side,
                    grpo=grpo)


def run_posttrain(cfg, prep: Prepared, run_dir: str | None, *, world: int, keep_history: bool = True):
    """Build, (DPO: score the reference once), resume, train. Returns the step stats (``[]`` with
    ``keep_history=False``, as the job runs: no per-step record grows over a long run)."""
    from engine.assembly import build_run
    from engine.posttrain.datasets import collate_pairs
    from engine.posttrain.objectives import DPOObjective, attach_reference_logps

    pt = cfg.posttrain
    if pt.method == "grpo":
        return _run_grpo(cfg, prep, run_dir, world=world, keep_history=keep_history)
    objective = None
    if pt.method == "dpo":
        objective = DPOObjective(beta=pt.dpo.beta, label_smoothing=pt.dpo.label_smoothing, loss_type=pt.dpo.loss_type)
    kw = dict(objective=objective, rows_per_sample=2, collate_fn=collate_pairs) if objective else {}
    run = build_run(cfg, model=prep.model, run_dir=run_dir or cfg.train.run_dir, world=world, plan=prep.plan,
                    train_data=prep.train_data, valid_data=prep.valid_data, side_files=prep.side_files, **kw)
    if objective is not None:
        # The reference is the base model: scored before any resume, so a resumed run uses the same numbers.
        run.load_base()
        for data in (prep.train_data, prep.valid_data):
            if data is not None:
                attach_reference_logps(run.trainer, data, objective, micro_batch_size=cfg.train.micro_batch_size)
        run.trainer.logger.info(f"tessel: reference log-probabilities of {prep.train_data.num_records} preference "
                                "pairs computed with the base weights")
    run.resume()
    return _train_and_close(run, keep_history=keep_history)


def _train_and_close(run, **kw):
    """Train, then close the run (a clean exit: peer replicas removed, the mesh's process groups destroyed)."""
    history = run.train(**kw)
    run.close()
    return history


def _run_grpo(cfg, prep: Prepared, run_dir: str | None, *, world: int, keep_history: bool = True):
    """Rollouts as the loader, GRPO as the step loss; held-out greedy reward as the evaluation (logged
    before the first step and every ``train.eval_interval`` steps)."""
    from engine.assembly import build_run
    from engine.posttrain.rollout import GRPOObjective, RolloutLoader, heldout_reward

    t, g, d = cfg.train, cfg.posttrain.grpo, prep.grpo
    run = build_run(cfg, model=prep.model, run_dir=run_dir or t.run_dir, world=world, plan=prep.plan, data=False,
                    objective=GRPOObjective(g), side_files=prep.side_files)
    tr = run.trainer
    reference = None
    if g.kl_beta > 0 and not run.lora:  # the KL's reference: the base weights (under LoRA: adapters off)
        run.load_base()
        tr.ddp.finish_param_sync()
        reference = [p.detach().clone() for p in tr.chunks.parameters()]
    run.train_loader = RolloutLoader(tr, d["records"], d["prompts"], tokenizer=prep.tokenizer, registry=d["registry"],
                                     grpo=g, seq_length=t.seq_length, global_batch_size=t.global_batch_size,
                                     micro_batch_size=t.micro_batch_size, seed=t.seed, reference=reference)
    run.resume()
    if "valid_records" not in d:
        return _train_and_close(run, keep_history=keep_history)

    def evaluate(step: int):
        r = heldout_reward(tr, d["valid_records"], d["valid_prompts"], tokenizer=prep.tokenizer,
                           registry=d["registry"], max_new_tokens=g.max_new_tokens)
        tr.logger.log({"step": step, "reward": r}, prefix="valid")

    def on_step(trainer, st):
        if t.eval_interval and trainer.step % t.eval_interval == 0:
            evaluate(trainer.step)
    evaluate(tr.step)  # before this run's first step
    return _train_and_close(run, on_step=on_step, keep_history=keep_history)


def posttrain_from_config(cfg, run_dir: str | None, *, world: int):
    """Prepare, build, train in-process (tests and tools). Returns the step stats."""
    return run_posttrain(cfg, prepare(cfg, world=world), run_dir, world=world)


def main(argv=None) -> int:
    from tools.pretrain import launch

    parser = OnceArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument("--run-dir", default=None, help="run directory (default: train.run_dir)")
    args = parser.parse_args(argv)

    def checked():
        from engine.fault import POSTTRAIN_RESUME_KEYS, check_run_dir, check_unfinished

        cfg = load_config(args.config, args.config_overrides or [], defaults=base_defaults)
        prep = prepare(cfg, world=int(os.environ.get("WORLD_SIZE", "1")))
        # A foreign directory is never written into; a resume must not change what its checkpoint depends on.
        run_dir = args.run_dir or cfg.train.run_dir
        check_unfinished(cfg, check_run_dir(cfg, run_dir, model_config=prep.model.hf_config,
                                            keys=POSTTRAIN_RESUME_KEYS), run_dir,
                         rows_per_sample=2 if cfg.posttrain.method == "dpo" else 1)
        return cfg, prep
    return launch("posttrain.py", checked,
                  lambda p, world: run_posttrain(p[0], p[1], args.run_dir, world=world, keep_history=False),
                  timeout_s=lambda p: p[0].fault.collective_timeout_s)


if __name__ == "__main__":
    sys.exit(main())
