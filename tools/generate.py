"""Generate continuations from a Tessel checkpoint at any TP x PP layout, with a KV cache.

    torchrun --nproc-per-node 4 tools/generate.py --ckpt CKPT --tp 2 --pp 2 --tokens prompts.json \\
        --max-new-tokens 32 [--temperature 0] [--top-p 1.0] [--stop-token ID]... [--seed 0] --json out.json
    torchrun --nproc-per-node 1 tools/generate.py --ckpt CKPT --text prompts.json --max-new-tokens 32
    torchrun --nproc-per-node 1 tools/generate.py --ckpt CKPT --records heldout.jsonl --max-new-tokens 48

The checkpoint (written by tools/convert_checkpoint.py or by the trainer, any layout) is loaded into the
launch layout exactly as tools/evaluate.py loads it (world size = tp * pp; dp = 1). ``--tokens`` takes a
JSON list of token-id lists (one prompt each; a flat list is one prompt); ``--text`` a JSON list of strings,
tokenized with the checkpoint's tokenizer (``CKPT/hf``, or ``--tokenizer``). All prompts form one batch
(engine/posttrain/generate.py). ``--json`` gets ``{"tokens": [[continuation ids], ...]}`` (plus ``"text"``,
the decoded continuations, with ``--text``); each continuation ends at its first ``--stop-token`` (included)
or after ``--max-new-tokens``. ``--temperature 0`` (default) is greedy decoding.

``--records`` takes chat prompt records (JSONL ``{"messages": [...], "reward": NAME, ...}``, as GRPO reads
them): each is rendered with the tokenizer's chat template and its generation prompt, generation stops at
the tokenizer's end-of-turn token, and records naming a reward are scored (engine/posttrain/rewards.py;
``--reward-module`` adds yours): the JSON gets ``"reward"`` (the mean) and ``"rewards"`` (each record's).
A LoRA checkpoint generates as the adapted model (``--base BASE_CKPT`` when it holds only the adapters).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, ROOT)


from engine.fault import OnceArgumentParser  # noqa: E402
from engine.posttrain.generate import check_generate_args, generate  # noqa: E402
from parallel import comm  # noqa: E402
from tools.evaluate import (DTYPES, build_stage, check_heads, check_stages, checkpoint_model_config,  # noqa: E402
                            cli, launch_mesh, load_weights, read_token_file)


def build_parser() -> argparse.ArgumentParser:
    p = OnceArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint root (newest complete step) or step directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="JSON file: a list of token-id lists (or one flat list)")
    src.add_argument("--text", help="JSON file: a list of prompt strings (tokenized with the checkpoint's tokenizer)")
    src.add_argument("--records", help="JSONL chat prompt records, rendered with the chat template (and scored "
                                       "when they name a reward)")
    p.add_argument("--reward-module", action="append", default=[], metavar="MODULE",
                   help="a module whose register(registry) adds reward functions (repeatable)")
    p.add_argument("--base", default=None, help="base checkpoint of an adapter-only LoRA checkpoint")
    p.add_argument("--max-new-tokens", type=int, required=True, help="most tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampling")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: no cut)")
    p.add_argument("--stop-token", type=int, action="append", default=[], metavar="ID",
                   help="stop a sequence after this id (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same on every rank)")
    p.add_argument("--pad-id", type=int, default=0, help="id filling the batch's padding (never attended to)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--pipeline-layout", default=None, help="layers per stage, e.g. 8,8,7,7 (default: even)")
    p.add_argument("--dtype", default="fp32", help="fp32 (default) or bf16")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="vocab padding multiple (128)")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec for --text (default: the checkpoint's hf/)")
    p.add_argument("--config", default=None, help="config.json to use instead of the checkpoint's model_config")
    p.add_argument("--json", default=None, help="write the result as JSON to this file")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint files")
    return p


def _options(args: argparse.Namespace) -> dict:
    """The options tools/evaluate.py's build_stage reads, checked."""
    for name in ("tp", "pp"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} must be an integer >= 1")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype={args.dtype!r} must be one of {', '.join(DTYPES)}")
    layout = None
    if args.pipeline_layout is not None:
        try:
            layout = [int(x) for x in args.pipeline_layout.split(",")]
        except ValueError:
            raise ValueError(f"--pipeline-layout={args.pipeline_layout!r} must be comma-separated layer counts, "
                             "e.g. 8,8,7,7") from None
    return {"tp": args.tp, "pp": args.pp, "pipeline_layout": layout, "dtype": args.dtype,
            "make_vocab_size_divisible_by": args.make_vocab_size_divisible_by}


def _tokenizer_spec(args, step_dir: Path) -> str:
    """``--tokenizer``, else the checkpoint's hf/ directory (in the step directory or beside it)."""
    if args.tokenizer is not None:
        return args.tokenizer
    found = [p for p in (step_dir / "hf", step_dir.parent / "hf") if (p / "tokenizer.json").is_file()]
    if not found:
        raise ValueError(f"no tokenizer.json beside checkpoint {step_dir} (looked in hf/); pass --tokenizer")
    return str(found[0])


def _tokenizer(args, step_dir: Path):
    from engine.data.tokenizer import load_tokenizer

    return load_tokenizer(_tokenizer_spec(args, step_dir))


def _read_prompts(args, *, step_dir: Path, vocab_size: int):
    """(prompts as id lists, the tokenizer for --text/--records else None, the records for --records)."""
    if args.tokens is not None:
        return read_token_file(args.tokens, vocab_size=vocab_size)[0], None, None
    if args.records is not None:
        from engine.posttrain.chat import NoChatTemplate, check_messages, load_chat_template, prompt_ids, read_jsonl

        tok = _tokenizer(args, step_dir)
        spec = _tokenizer_spec(args, step_dir)
        try:
            template = load_chat_template(spec if os.path.isdir(spec) else os.path.dirname(os.path.abspath(spec)))
        except NoChatTemplate as e:  # the library names the config keys; here the fix is a flag
            raise ValueError(f"--records needs a chat template ({e.where}); pass --tokenizer DIR "
                             "with a tokenizer_config.json that has one (or a chat_template.jinja), or give "
                             "--text / --tokens prompts instead") from None
        records = read_jsonl(args.records)
        for rec in records:
            check_messages(rec.get("messages"), where=rec["_where"], need_assistant=False)
        return [prompt_ids(template, tok, r["messages"]) for r in records], tok, records
    try:
        with open(args.text, encoding="utf-8") as f:
            texts = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--text {args.text}: cannot read a JSON list of strings ({e})") from None
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"--text {args.text}: expected a non-empty JSON list of prompt strings")
    tok = _tokenizer(args, step_dir)
    return [tok.encode(t) for t in texts], tok, None


def run_generate(argv: list[str] | None = None) -> dict:
    """Everything but the process exit: returns ``{"tokens": [...]}`` (and ``"text"`` with --text or
    --records, ``"reward"``/``"rewards"`` for scored records) on every rank (collective)."""
    args = build_parser().parse_args(argv)
    opts = _options(args)
    step_dir, meta, model_config = checkpoint_model_config(args.ckpt, args.config)
    from models import config_from_hf

    cfg = config_from_hf(model_config)
    prompts, tok, records = _read_prompts(args, step_dir=step_dir, vocab_size=cfg.vocab_size)
    stops = args.stop_token or ([tok.eod_id] if records is not None else [])
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    stop_tokens=stops, seed=args.seed, pad_id=args.pad_id)
    scored = [r for r in records or [] if "reward" in r]
    if scored:
        from engine.posttrain.rollout import reward_registry

        registry = reward_registry(args.reward_module)
        registry.check_records(scored)
    check_generate_args(prompts, vocab_size=cfg.vocab_size, max_positions=cfg.max_position_embeddings, **sampling)
    check_heads(model_config, opts)  # before any process group
    check_stages(model_config, opts)  # likewise: a bad --pipeline-layout said once, not by every rank
    mesh, device = launch_mesh(opts, what="generation", flags="--tp/--pp")
    tp, pp = opts["tp"], opts["pp"]
    _, stage = build_stage(model_config, mesh, opts, device=device)
    load_weights(stage, mesh, step_dir, meta, base=args.base, verify=not args.no_verify)
    out = generate(stage, mesh=mesh, prompts=prompts, **sampling)
    result = {"tokens": out}
    if tok is not None:
        result["text"] = [tok.decode(ids) for ids in out]
    if scored:
        result["rewards"] = [registry.score(r, t) if "reward" in r else None for r, t in zip(records, result["text"])]
        result["reward"] = sum(x for x in result["rewards"] if x is not None) / len(scored)
    if mesh.rank == 0:
        n = sum(len(c) for c in out)
        print(f"generate: {n} tokens for {len(out)} prompts (tp={tp}, pp={pp}, {step_dir})"
              + (f"; mean reward {result['reward']:.4f} over {len(scored)} records" if scored else ""))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    comm.barrier(mesh.world)  # the JSON exists once every rank returns
    return result


def main(argv: list[str] | None = None) -> int:
    return cli(run_generate, argv, prog="generate.py")


if __name__ == "__main__":
    sys.exit(main())
