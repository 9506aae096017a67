"""Pretrain a transformer over TP x PP x DP.

    torchrun --nproc-per-node N tools/pretrain.py --config configs/<preset>.toml [--set key=value ...] [--run-dir DIR]

The run directory holds config.json (the resolved config), metrics.jsonl, tensorboard/ and
checkpoints/; a run directory that already holds a complete checkpoint resumes from it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from engine.config import add_config_args, config_from_args  # noqa: E402
from engine.metrics import FlopsSpec  # noqa: E402
from parallel.mesh import init_distributed  # noqa: E402


def hf_config_dict(model_cfg, *, vocab_size: int) -> dict:
    """A Hugging Face config.json dict for the configured architecture (``model.hf_config`` wins,
    explicit fields override it)."""
    m = model_cfg
    base: dict = {}
    if m.hf_config:
        if not os.path.exists(m.hf_config):
            raise ValueError(f"model.hf_config={m.hf_config!r} does not exist; give the path of a config.json")
        with open(m.hf_config) as f:
            base = json.load(f)
    family = base.get("model_type", m.family)
    if family == "gpt2":
        names = {"hidden_size": "n_embd", "num_layers": "n_layer", "num_attention_heads": "n_head",
                 "ffn_hidden_size": "n_inner", "max_position_embeddings": "n_positions",
                 "norm_eps": "layer_norm_epsilon", "tie_word_embeddings": "tie_word_embeddings"}
        base.setdefault("attn_pdrop", 0.0)
        base.setdefault("resid_pdrop", 0.0)
        base.setdefault("embd_pdrop", 0.0)
    else:
        names = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
                 "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
                 "head_dim": "head_dim", "ffn_hidden_size": "intermediate_size",
                 "max_position_embeddings": "max_position_embeddings", "rope_theta": "rope_theta",
                 "norm_eps": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings"}
    out = dict(base)
    out["model_type"] = family
    for ours, theirs in names.items():
        v = getattr(m, ours, None)
        if v is not None:
            out[theirs] = v
    if m.vocab_size is not None:
        out["vocab_size"] = m.vocab_size
    out.setdefault("vocab_size", vocab_size)
    return out


def flops_spec(c) -> FlopsSpec:
    """FLOP-count shapes of a models.TransformerConfig."""
    return FlopsSpec(num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
                     vocab_size=c.vocab_size, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                     head_dim=c.head_dim, gated_mlp=c.mlp == "swiglu")


def check_data_paths(paths: list[str]) -> None:
    if not paths:
        raise ValueError("data.paths is empty: give the prefix of a preprocessed dataset "
                         "(--set data.paths=PREFIX; make one with tools/preprocess_data.py)")
    for p in paths:
        missing = [p + ext for ext in (".bin", ".idx") if not os.path.exists(p + ext)]
        if missing:
            hint = ("run `.venv/bin/python tools/prepare_corpus.py` to build the bundled corpus"
                    if "stdlib_corpus" in p else "make it with tools/preprocess_data.py --output-prefix " + p)
            raise ValueError(f"data path {p!r} is missing {', '.join(missing)}; {hint}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument("--run-dir", default=None, help="run directory (default: train.run_dir)")
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except (ValueError, FileNotFoundError) as e:
        if os.environ.get("RANK", "0") == "0":  # every rank fails the same way: say it once
            print(f"pretrain.py: {e}", file=sys.stderr)
        return 2
    rank, world = init_distributed()
    try:
        return run(cfg, args.run_dir, rank=rank, world=world)
    except ValueError as e:
        print(f"pretrain.py (rank {rank}): {e}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run(cfg, run_dir: str | None, *, rank: int, world: int) -> int:
    train_from_config(cfg, run_dir, rank=rank, world=world)
    return 0


def train_from_config(cfg, run_dir: str | None, *, rank: int, world: int):
    """Build data, model stages and trainer from ``cfg`` and train; returns the step stats."""
    from engine.checkpoint import Checkpointer, world_group
    from engine.checkpoint.trainer_state import load_trainer, save_trainer
    from engine.data.blending import build_gpt_datasets
    from engine.data.loader import DataParallelLoader
    from engine.data.tokenizer import load_tokenizer
    from engine.trainer import Trainer
    from models import build_model, config_from_hf

    cfg.validate_world(world)  # clear error before anything else if the layout does not fit
    check_data_paths(list(cfg.data.paths))
    run_dir = run_dir or cfg.train.run_dir
    tok = load_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None
    hf = hf_config_dict(cfg.model, vocab_size=tok.vocab_size if tok else None)
    if hf.get("vocab_size") is None:
        raise ValueError("model.vocab_size is not set and data.tokenizer is empty; set one of them")
    if tok is not None and tok.vocab_size > hf["vocab_size"]:
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but model.vocab_size={hf['vocab_size']}; "
                         f"set model.vocab_size >= {tok.vocab_size}")
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    device = "cuda" if torch.cuda.is_available() else "cpu"
    def build_stage(mesh, *, pre_process, post_process, layer_range):
        return build_model(hf, tp_group=mesh.tp, sequence_parallel=cfg.parallel.sequence_parallel,
                           pre_process=pre_process, post_process=post_process, layer_range=layer_range,
                           dtype=dtype, device=device, seed=cfg.train.seed,
                           make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
                           kernels=cfg.model.kernels, fused_cross_entropy=cfg.model.fused_cross_entropy)

    model_cfg = config_from_hf(hf)
    trainer = Trainer(cfg, build_stage=build_stage, flops=flops_spec(model_cfg), num_layers=model_cfg.num_layers,
                      hidden_size=model_cfg.hidden_size, run_dir=run_dir)

    t = cfg.train
    n_eval = (t.steps // t.eval_interval + 1) * t.eval_iters * t.global_batch_size if t.eval_interval else 0
    cache = cfg.data.cache_dir or os.path.join(os.path.dirname(cfg.data.paths[0]) or ".", "index_cache")
    train_ds, valid_ds, _ = build_gpt_datasets(
        list(cfg.data.paths), weights=list(cfg.data.weights) if cfg.data.weights else None, split=cfg.data.split,
        num_samples=[t.steps * t.global_batch_size, n_eval, 0], seq_length=t.seq_length, seed=t.seed,
        cache_dir=cache)
    dp_rank, dp = trainer.mesh.coords["dp"], trainer.dp
    train_loader = DataParallelLoader(train_ds, global_batch_size=t.global_batch_size,
                                      micro_batch_size=t.micro_batch_size, dp_rank=dp_rank, dp_size=dp,
                                      num_workers=cfg.data.num_workers)
    valid_loader = None
    if valid_ds is not None:
        valid_loader = DataParallelLoader(valid_ds, global_batch_size=t.global_batch_size,
                                          micro_batch_size=t.micro_batch_size, dp_rank=dp_rank, dp_size=dp)
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        cfg.to_json(os.path.join(run_dir, "config.json"))
        with open(os.path.join(run_dir, "model_config.json"), "w") as f:
            json.dump(hf, f, indent=2, sort_keys=True)
    ck = cfg.checkpoint
    ckpt_root = ck.dir or os.path.join(run_dir, "checkpoints")
    checkpointer = Checkpointer(ckpt_root, group=world_group(ledger=trainer.mesh.ledger), keep_last=ck.keep_last,
                                async_save=ck.async_save)
    latest = checkpointer.latest()
    if latest is not None:  # a run directory with a complete checkpoint resumes from it
        load_trainer(trainer, latest, group=world_group(ledger=trainer.mesh.ledger), loader=train_loader)
        trainer.logger.info(f"tessel: resumed from {latest} at step {trainer.step}")
    elif ck.load:  # initialise from another checkpoint (e.g. a converted Hugging Face model)
        load_trainer(trainer, ck.load, group=world_group(ledger=trainer.mesh.ledger), model_only=True)
        trainer.logger.info(f"tessel: initialised the weights from {ck.load} (model only)")

    def save(tr) -> None:  # every checkpoint.interval steps, at the end, and on SIGTERM/SIGINT
        save_trainer(checkpointer, tr, loader=train_loader, model_config=hf)

    # Commit a finished async save at the first step boundary after its writes land (collective).
    history = trainer.train(train_loader, valid_loader, save=save,
                            on_step=lambda tr, st: checkpointer.maybe_finalize())
    checkpointer.finalize()  # an async save must be committed before exit
    return history


if __name__ == "__main__":
    sys.exit(main())
