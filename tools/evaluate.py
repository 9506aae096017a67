"""Evaluate a Tessel checkpoint at any TP x PP layout: token-weighted loss and perplexity, or the logits.

    torchrun --nproc-per-node 4 tools/evaluate.py --ckpt CKPT --tp 2 --pp 2 --text FILE [--json out.json]
    torchrun --nproc-per-node 4 tools/evaluate.py --ckpt CKPT --set parallel.tp=2 --set parallel.pp=2 --data PREFIX
    torchrun --nproc-per-node 4 tools/evaluate.py --ckpt CKPT --tp 2 --pp 2 --tokens ids.json --dump-logits out.safetensors
    torchrun --nproc-per-node 4 tools/evaluate.py --ckpt CKPT --cp 4 --text FILE [--set parallel.cp_comm=a2a]
    torchrun --nproc-per-node 8 tools/evaluate.py --ckpt MOE_CKPT --ep 2 --tp 2 --pp 2 --tokens ids.json

The checkpoint (written by tools/convert_checkpoint.py or by the trainer, any layout) is resharded into
the launch layout (world size = tp * pp * cp * ep; dp = ep). ``--ep`` (mixture-of-experts models,
docs/moe.md) splits each MoE layer's experts over ep ranks that run the same samples, so only the
experts' memory is divided; ``parallel.moe_dispatcher`` by ``--set``; ``--set parallel.expert_tp=1`` keeps every
expert whole on each tp rank and needs ``--set parallel.sequence_parallel=true`` at tp > 1, as in training
(sequence parallelism right-pads each sequence to a multiple of tp, padding predicting nothing).
``--cp`` splits every sequence over cp ranks
(context parallelism, docs/context_parallel.md; ``parallel.cp_comm`` / ``parallel.cp_a2a_size`` by
``--set``): sequences are right-padded to a multiple of 2*cp (padding predicts nothing) and each rank
takes its zigzag share; sums and dumped logits are gathered over cp. Forward only: a forward-only schedule through the
training runtime, pipelined across batches of one shape.
``--text`` is tokenized with the checkpoint's tokenizer (``CKPT/hf``, or ``--tokenizer``) and cut into
windows of ``--seq-length`` predicted tokens (each window sees the previous window's last token as its
first input); ``--data`` does the same over the token stream of a preprocessed dataset. ``--tokens`` takes
a JSON list of ids or a list of lists (each evaluated as its own sequence); ``--dump-logits`` writes the
full-vocabulary fp32 logits for them (padding cut off): key ``logits`` (s, vocab) for a flat list,
``logits.<i>`` (s_i, vocab) for each sequence of a list of lists. The loss is the summed next-token
negative log-likelihood divided by the number of predicted tokens; perplexity = exp(loss).
A LoRA run's checkpoint (``trainer_state.lora`` in its metadata) is evaluated as the adapted model:
adapters are added with the recorded settings (engine/posttrain/lora.py); a checkpoint holding only
the adapters takes its base weights from ``--base BASE_CKPT`` (the run's checkpoint.load).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.checkpoint import (CheckpointError, ShardingContext, load_checkpoint, module_sharded_tensors,  # noqa: E402
                               read_metadata, resolve_checkpoint)
from engine.fault import OnceArgumentParser, launcher_rank, say_once  # noqa: E402
from parallel import comm  # noqa: E402
from parallel.context_parallel import zigzag_shard, zigzag_unshard  # noqa: E402
from parallel.mesh import Mesh, ParallelDims, init_distributed  # noqa: E402
from parallel.pipeline import forward_only  # noqa: E402
from parallel.pipeline.runtime import run_schedule  # noqa: E402

# --set keys this tool reads (the rest of the training config does not apply to evaluation)
SET_KEYS = {"parallel.tp": "tp", "parallel.pp": "pp", "parallel.cp": "cp", "parallel.cp_comm": "cp_comm",
            "parallel.ep": "ep", "parallel.moe_dispatcher": "moe_dispatcher", "parallel.expert_tp": "expert_tp",
            "parallel.sequence_parallel": "sequence_parallel",
            "parallel.cp_a2a_size": "cp_a2a_size", "parallel.pipeline_layout": "pipeline_layout",
            "train.seq_length": "seq_length", "train.micro_batch_size": "batch_size", "model.dtype": "dtype",
            "model.make_vocab_size_divisible_by": "make_vocab_size_divisible_by", "data.paths": "data",
            "data.tokenizer": "tokenizer"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    p = OnceArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint root (newest complete step) or step directory")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", help="UTF-8 text file to score")
    src.add_argument("--data", help="prefix of a preprocessed dataset (PREFIX.bin / PREFIX.idx)")
    src.add_argument("--tokens", help="JSON file: a list of token ids, or a list of lists")
    p.add_argument("--dump-logits", help="with --tokens: write the fp32 logits to this .safetensors file")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (or --set parallel.tp=N)")
    p.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (or --set parallel.pp=N)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel size (or --set parallel.cp=N)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size, MoE models (or --set parallel.ep=N)")
    p.add_argument("--pipeline-layout", default=None, help="layers per stage, e.g. 8,8,7,7 (default: even)")
    p.add_argument("--seq-length", type=int, default=None, help="tokens per window (default min(1024, positions))")
    p.add_argument("--batch-size", type=int, default=None, help="windows per forward (default 1)")
    p.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens of --text/--data")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec (default: the checkpoint's hf/ directory)")
    p.add_argument("--dtype", default=None, help="fp32 (default) or bf16")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None, help="vocab padding multiple (128)")
    p.add_argument("--config", default=None, help="config.json to use instead of the checkpoint's model_config")
    p.add_argument("--base", default=None, help="base checkpoint of an adapter-only LoRA checkpoint")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="training-config overrides this tool reads: " + ", ".join(SET_KEYS))
    p.add_argument("--json", default=None, help="also write the result as JSON to this file")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint files")
    return p


def resolve_options(args: argparse.Namespace) -> dict:
    """Merge --set overrides (parsed with the training config's types) under the explicit flags."""
    from engine.config.loader import apply_overrides

    opts = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "moe_dispatcher": "alltoall", "expert_tp": None,
            "sequence_parallel": False, "cp_comm": "ring", "cp_a2a_size": None, "pipeline_layout": None,
            "seq_length": None, "batch_size": 1, "dtype": "fp32",
            "make_vocab_size_divisible_by": 128, "data": None, "tokenizer": None}
    parsed = apply_overrides({}, list(args.overrides))  # validates SECTION.KEY and value types
    for section, table in parsed.items():
        for key, value in table.items():
            name = f"{section}.{key}"
            if name not in SET_KEYS:
                raise ValueError(f"--set {name}: evaluate.py reads only {', '.join(SET_KEYS)}; drop the others")
            opts[SET_KEYS[name]] = value
    if isinstance(opts["data"], list):
        if len(opts["data"]) != 1:
            raise ValueError(f"--set data.paths={opts['data']}: evaluate.py scores one dataset; give one prefix")
        opts["data"] = opts["data"][0]
    for name in ("tp", "pp", "cp", "ep", "seq_length", "batch_size", "dtype", "make_vocab_size_divisible_by",
                 "tokenizer"):
        if getattr(args, name) is not None:
            opts[name] = getattr(args, name)
    if args.pipeline_layout is not None:
        try:
            opts["pipeline_layout"] = [int(x) for x in args.pipeline_layout.split(",")]
        except ValueError:
            raise ValueError(f"--pipeline-layout={args.pipeline_layout!r} must be comma-separated layer counts, "
                             "e.g. 8,8,7,7") from None
    if args.data is not None:
        opts["data"] = args.data
    for name in ("tp", "pp", "cp", "ep", "batch_size"):
        if not isinstance(opts[name], int) or opts[name] < 1:
            raise ValueError(f"{name}={opts[name]!r} must be an integer >= 1")
    # lengths: unset (the default) or >= 1; 0 is not "the default" and a negative one scores nothing or cuts the end
    seq = opts["seq_length"]
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
        flag = f"--seq-length {seq}" if args.seq_length is not None else f"--set train.seq_length={seq}"
        raise ValueError(f"{flag}: the window length must be an integer >= 1; give a positive length, or leave it "
                         "out for the default min(1024, max_position_embeddings)")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: the token cap must be >= 1; give a positive count, or "
                         "leave it out to score the whole input")
    from engine.config.sections import ParallelConfig

    ParallelConfig(tp=opts["tp"], cp=opts["cp"], cp_comm=opts["cp_comm"], cp_a2a_size=opts["cp_a2a_size"],
                   ep=opts["ep"], moe_dispatcher=opts["moe_dispatcher"], expert_tp=opts["expert_tp"],
                   sequence_parallel=opts["sequence_parallel"])  # the training rules
    if opts["dtype"] not in DTYPES:
        raise ValueError(f"dtype={opts['dtype']!r} must be one of {', '.join(DTYPES)}")
    if sum(x is not None for x in (args.text, opts["data"], args.tokens)) != 1:
        raise ValueError("give exactly one input: --text FILE, --data PREFIX (or --set data.paths=PREFIX), or "
                         "--tokens FILE.json")
    for flag, path in (("--text", args.text), ("--tokens", args.tokens)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path!r} does not exist; give an existing file")
    if args.dump_logits and not args.tokens:
        raise ValueError("--dump-logits needs --tokens FILE.json (logits are written for given token ids)")
    return opts


# -- inputs -------------------------------------------------------------------------------------------

def read_token_file(path: str, *, vocab_size: int) -> tuple[list[list[int]], bool]:
    """(sequences, was_flat) from a JSON list of ids or list of lists; ValueError on anything else."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--tokens {path}: cannot read a JSON list of token ids ({e})") from None
    flat = isinstance(data, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in data)
    seqs = [data] if flat else data
    if not isinstance(seqs, list) or not seqs or not all(
            isinstance(s, list) and s and all(isinstance(x, int) and not isinstance(x, bool) for x in s) for s in seqs):
        raise ValueError(f"--tokens {path}: expected a non-empty JSON list of ints or a list of non-empty lists "
                         "of ints")
    bad = sorted({x for s in seqs for x in s if not 0 <= x < vocab_size})
    if bad:
        raise ValueError(f"--tokens {path}: ids {bad[:10]} lie outside the vocabulary [0, {vocab_size})")
    return seqs, flat


def windows(ids: list[int], *, seq_length: int) -> list[tuple[list[int], list[int]]]:
    """(inputs, targets) windows predicting every token after the first exactly once."""
    out = []
    for start in range(0, max(0, len(ids) - 1), seq_length):
        chunk = ids[start:start + seq_length + 1]
        if len(chunk) >= 2:
            out.append((chunk[:-1], chunk[1:]))
    return out


def _stream_tokens(args, opts, *, step_dir: Path, vocab_size: int) -> list[int]:
    if args.text is not None:
        from engine.data.tokenizer import load_tokenizer

        spec = opts["tokenizer"]
        if spec is None:
            found = [p for p in (step_dir / "hf", step_dir.parent / "hf") if (p / "tokenizer.json").is_file()]
            if not found:
                raise ValueError(f"no tokenizer.json beside checkpoint {step_dir} (looked in hf/); pass --tokenizer")
            spec = str(found[0])
        with open(args.text, encoding="utf-8") as f:
            ids = load_tokenizer(spec).encode(f.read())
    else:
        import numpy as np

        from engine.data.indexed_dataset import IndexedDataset

        ds = IndexedDataset(opts["data"])
        ids, need = [], args.max_tokens + 1 if args.max_tokens is not None else None
        for i in range(len(ds)):
            ids.extend(np.asarray(ds[i], dtype=np.int64).tolist())
            if need is not None and len(ids) >= need:
                break
    if args.max_tokens is not None:  # >= 1 (resolve_options)
        ids = ids[:args.max_tokens + 1]
    bad = sorted({x for x in ids if not 0 <= x < vocab_size})
    if bad:
        raise ValueError(f"token ids {bad[:10]} lie outside the model's vocabulary [0, {vocab_size}); the "
                         "tokenizer or dataset does not belong to this model")
    if len(ids) < 2:
        raise ValueError("the input has fewer than 2 tokens: nothing to predict")
    return ids


def _batches(samples, batch_size: int):
    """Consecutive samples of equal length, at most ``batch_size`` per batch, with their indices."""
    batch: list[int] = []
    for i, (inp, _) in enumerate(samples):
        if batch and (len(batch) == batch_size or len(samples[batch[0]][0]) != len(inp)):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


# -- the model ------------------------------------------------------------------------------------------

def build_stage(model_config: dict, mesh: Mesh, opts: dict, *, device):
    from models import build_model, config_from_hf
    from models.convert import stage_layer_ranges

    cfg = config_from_hf(model_config)
    pp, pp_rank = mesh.dims.pp, mesh.coords["pp"]
    ranges = stage_layer_ranges(cfg.num_layers, pp, opts["pipeline_layout"])
    cp_comm = opts.get("cp_comm", "ring")
    ep = opts.get("ep", 1)
    if ep > 1:  # before the model allocates: experts divisible by ep (the message names the fix)
        from models.convert import stage_params
        stage_params(cfg, tp_rank=0, tp_size=1, layer_range=(0, 0), pre_process=False, post_process=False,
                     padded_vocab=cfg.vocab_size, ep_size=ep)
    stage = build_model(model_config, tp_group=mesh.tp, ep_group=mesh.ep if ep > 1 else None,
                        sequence_parallel=opts.get("sequence_parallel", False), expert_tp=opts.get("expert_tp"),
                        moe_dispatcher=opts.get("moe_dispatcher", "alltoall"), pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                        layer_range=ranges[pp_rank], dtype=DTYPES[opts["dtype"]], device=device,
                        make_vocab_size_divisible_by=opts["make_vocab_size_divisible_by"], cp_group=mesh.cp,
                        cp_comm=cp_comm, cp_subgroups=(mesh.cp_a2a, mesh.cp_ring) if cp_comm == "hybrid" else None)
    return cfg, stage.eval()


def run_evaluate(argv: list[str] | None = None) -> dict:
    """Everything but the process exit: returns the result dict on every rank (collective)."""
    args = build_parser().parse_args(argv)
    opts = resolve_options(args)
    step_dir, meta, model_config = checkpoint_model_config(args.ckpt, args.config)
    check_heads(model_config, opts)  # before any process group
    check_stages(model_config, opts)  # likewise: said once, not by every rank after init
    mesh, device = launch_mesh(opts, what="evaluation")
    tp, pp, cp = opts["tp"], opts["pp"], opts["cp"]
    cfg, stage = build_stage(model_config, mesh, opts, device=device)
    load_weights(stage, mesh, step_dir, meta, base=args.base, verify=not args.no_verify)

    flat = False
    if args.tokens:
        seqs, flat = read_token_file(args.tokens, vocab_size=cfg.vocab_size)
        samples = [(s, s[1:] + [-100]) for s in seqs]  # the last position has no target
    else:
        seq_length = opts["seq_length"] or min(1024, cfg.max_position_embeddings)
        ids = _stream_tokens(args, opts, step_dir=step_dir, vocab_size=cfg.vocab_size)
        samples = windows(ids, seq_length=seq_length)
    too_long = [len(s) for s, _ in samples if len(s) > cfg.max_position_embeddings]
    if too_long:
        fix = "split the --tokens lists" if args.tokens else "lower --seq-length"
        raise ValueError(f"a sequence of {max(too_long)} tokens exceeds max_position_embeddings="
                         f"{cfg.max_position_embeddings}; {fix}")
    nll, count, logits = forward_all(stage, mesh, samples, opts, device=device, want_logits=bool(args.dump_logits))
    result = {"checkpoint": str(step_dir), "tp": tp, "pp": pp, "cp": cp, "ep": opts["ep"], "sequences": len(samples),
              "tokens": int(count),
              "loss": nll / count if count else float("nan"),
              "perplexity": math.exp(min(nll / count, 700.0)) if count else float("nan")}
    writer = mesh.coords["pp"] == pp - 1 and mesh.coords["tp"] == 0 and mesh.coords["cp"] == 0 and mesh.coords["dp"] == 0
    if args.dump_logits and writer:
        _write_logits(args.dump_logits, logits, flat=flat)
    if mesh.rank == 0:
        print(f"evaluate: {result['tokens']} tokens in {result['sequences']} sequences: loss {result['loss']:.6f}, "
              f"perplexity {result['perplexity']:.4f} (tp={tp}, pp={pp}, cp={cp}, ep={opts['ep']}, {step_dir})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    if dist.is_initialized():
        dist.barrier()  # the logits file and JSON exist once every rank returns
    return result


def check_heads(model_config: dict, opts: dict) -> None:
    """The model's attention heads split over ``--tp`` and, with ``parallel.cp_comm`` a2a or hybrid, each TP
    rank's heads over the all-to-all block of cp ranks (the training config's rules; ValueError naming the fix)."""
    from engine.config.sections import ParallelConfig
    from models import config_from_hf

    cfg = config_from_hf(model_config)
    tp, comm = opts["tp"], opts.get("cp_comm", "ring")
    a2a = ParallelConfig(tp=tp, cp=opts.get("cp", 1), cp_comm=comm, cp_a2a_size=opts.get("cp_a2a_size")).cp_head_scatter
    for what, heads in (("attention heads", cfg.num_heads), ("key/value heads", cfg.num_kv_heads)):
        if heads % tp:
            raise ValueError(f"--tp {tp} does not divide the model's {heads} {what}; choose a divisor of {heads}")
        if a2a > 1 and (heads // tp) % a2a:
            raise ValueError(f"the model's {heads} {what} over --tp {tp} leave {heads // tp} per rank, not divisible "
                             f"by {a2a}: parallel.cp_comm={comm!r} scatters heads over {a2a} cp ranks; use "
                             "--set parallel.cp_comm=ring (or a smaller cp_a2a_size with hybrid)")


def check_stages(model_config: dict, opts: dict) -> None:
    """The model's layers split over ``pp`` stages by ``--pipeline-layout`` (one count per stage, summing to
    the layers) or evenly (pp at most the layers): build_stage's split, checked before any process group
    (ValueError naming the fix)."""
    from models import config_from_hf
    from models.convert import stage_layer_ranges

    layout = opts.get("pipeline_layout")
    try:
        stage_layer_ranges(config_from_hf(model_config).num_layers, opts["pp"], layout)
    except ValueError as e:
        flag = f"--pp {opts['pp']}" if layout is None else f"--pipeline-layout {','.join(map(str, layout))}"
        raise ValueError(f"{flag}: {e}") from None


def launch_mesh(opts: dict, *, what: str, flags: str = "--tp/--pp/--cp/--ep") -> tuple[Mesh, torch.device]:
    """The process group and the tp x pp (x cp) mesh (dp = ep, 1 without experts) of a forward-only tool, and
    this rank's device. ``flags``: the tool's layout options, named when the world size does not match."""
    init_distributed()
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp, pp, cp, ep = opts["tp"], opts["pp"], opts.get("cp", 1), opts.get("ep", 1)
    if world != tp * pp * cp * ep:
        names, sizes = ("tp*pp", f"{tp}*{pp}") if cp == 1 else ("tp*pp*cp", f"{tp}*{pp}*{cp}")
        if ep > 1:
            names, sizes = names + "*ep", sizes + f"*{ep}"
        raise ValueError(f"world size {world} != {names} = {sizes}; launch {tp * pp * cp * ep} processes (torchrun "
                         f"--nproc-per-node) or change {flags} ({what} runs with dp={ep})")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    a2a = opts.get("cp_a2a_size") if opts.get("cp_comm") == "hybrid" else None
    return Mesh.build(ParallelDims(dp=ep, pp=pp, tp=tp, cp=cp, ep=ep), cp_a2a_size=a2a), device


def checkpoint_model_config(ckpt: str, config_path: str | None) -> tuple[Path, dict, dict]:
    """(step directory, metadata, model config.json dict) of checkpoint ``ckpt``; ``config_path`` (a
    config.json) replaces the model_config the checkpoint stores."""
    step_dir = resolve_checkpoint(ckpt, what="--ckpt")
    meta = read_metadata(step_dir)
    if config_path is not None:
        with open(config_path) as f:
            return step_dir, meta, json.load(f)
    if not meta.get("model_config"):
        raise ValueError(f"checkpoint {step_dir} stores no model_config; pass --config CONFIG.JSON")
    return step_dir, meta, meta["model_config"]


def load_weights(stage, mesh: Mesh, step_dir: Path, meta: dict, *, base: str | None, verify: bool) -> None:
    """Load the checkpoint into ``stage``; a LoRA checkpoint gets its adapters first (and its base
    weights from ``base`` when it holds only the adapters)."""
    from engine.checkpoint.trainer_state import select_params
    from engine.posttrain.lora import apply_lora, settings_from_metadata
    from engine.checkpoint.trainer_state import model_vocab, same_vocab
    from models.convert import model_param_spec

    lora = settings_from_metadata(meta)
    if lora is None and base is not None:
        raise ValueError(f"--base applies to adapter-only LoRA checkpoints; {step_dir} is not one")
    parts = [(step_dir, "all")]
    if lora is not None:
        settings, adapters_only = lora
        apply_lora(stage, rank=settings.rank, alpha=settings.alpha, dropout=settings.dropout,
                   targets=settings.targets)
        if adapters_only and base is None:
            raise ValueError(f"checkpoint {step_dir} holds only LoRA adapters; pass --base BASE_CKPT, the "
                             "checkpoint the run loaded its base weights from (checkpoint.load)")
        if base is not None:
            parts = [(resolve_checkpoint(base, what="--base"), "frozen"), (step_dir, "trainable")]
    ctx = ShardingContext.from_mesh(mesh)
    biases = _routing_biases(stage, meta)
    for path, params in parts:
        tensors = module_sharded_tensors(stage, ctx=ctx, hook=select_params(model_param_spec, params))
        if params != "frozen":
            tensors += biases
        load_checkpoint(path, tensors=tensors, group=mesh.world, strict=True, verify=verify, allow_dtype_cast=True,
                        check_meta=same_vocab(model_vocab(stage), path), unexpected="model." if params == "all" else None)


def _routing_biases(stage, meta: dict) -> list:
    """A checkpoint trained with aux-loss-free balancing (``moe.<layer>.router.expert_bias``): the stage's
    routers get their bias buffers and these load them (routing uses them; the update rate is unused here)."""
    from engine.checkpoint.sharded import ShardedTensor
    from parallel.expert_parallel import MoELayer

    saved = meta.get("tensors") or {}
    out = []
    for name, m in stage.named_modules():
        key = f"moe.{name}.router.expert_bias"
        if isinstance(m, MoELayer) and key in saved:
            m.router.enable_bias_balancing(1.0)
            out.append(ShardedTensor.replicated(key, m.router.expert_bias, replica_id=1))  # read only
    return out


@torch.no_grad()
def forward_all(stage, mesh: Mesh, samples, opts: dict, *, device, want_logits: bool):
    """Run every sample through the pipeline; returns (summed NLL, predicted tokens, logits per sample).

    Consecutive batches of one shape form the micro-batches of one forward-only schedule
    (``parallel.pipeline.forward_only``), run by the trainer's runtime, so the stages work on different
    micro-batches at once. The sums are known on every rank; logits only on the last stage.
    """
    pp, pp_rank = mesh.dims.pp, mesh.coords["pp"]
    first, last = pp_rank == 0, pp_rank == pp - 1
    h = stage.config.hidden_size
    dtype = next(stage.parameters()).dtype
    nll = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of NLL, predicted tokens)
    logits_out: list[torch.Tensor] = [None] * len(samples)
    sp = mesh.tp.size if opts.get("sequence_parallel") and mesh.tp.size > 1 else 1  # sequence shards per cp rank
    batches = [(idx, *_cp_share(torch.tensor([samples[i][0] for i in idx], dtype=torch.int64, device=device),
                                torch.tensor([samples[i][1] for i in idx], dtype=torch.int64, device=device),
                                mesh.cp, sp=sp))  # (b, s/cp) each
               for idx in _batches(samples, opts["batch_size"])]
    start = 0
    while start < len(batches):  # one schedule per run of equal-shape batches
        shape = batches[start][1].shape
        end = start
        while end < len(batches) and batches[end][1].shape == shape:
            end += 1
        micro = batches[start:end]

        def step(chunk: int, x, mb: int) -> torch.Tensor:
            idx, tokens, labels = micro[mb]
            x = tokens if first else x
            if not last:
                return stage(x)  # (s, b, h)
            b, s = tokens.shape
            nll[1] += (labels != -100).sum()
            if want_logits:
                full = stage.gather_logits(stage(x)).float()  # (b, s/cp, vocab)
                whole = zigzag_unshard(comm.all_gather(full, mesh.cp, dim=1), cp=mesh.cp.size, dim=1)  # (b, s_pad, V)
                for j, i in enumerate(idx):
                    logits_out[i] = whole[j, :len(samples[i][0])].cpu()
                loss = F.cross_entropy(full.reshape(b * s, -1), labels.reshape(-1), ignore_index=-100,
                                       reduction="sum")
            else:
                loss = stage(x, labels=labels).sum()  # (b, s) per-token loss, 0 where the label is -100
            nll[0] += loss.double()
            return loss

        run_schedule(forward_only(pp, 1, len(micro)), rank=pp_rank, pp_group=mesh.pp, forward_step=step,
                     act_shape=(shape[1] // sp, shape[0], h), dtype=dtype, device=device)  # (s/cp/sp, b, h)
        start = end
    comm.all_reduce(nll, mesh.pp)  # only the last stage contributed; every TP rank holds the same sums
    comm.all_reduce(nll, mesh.cp)  # each cp rank summed its own tokens
    return float(nll[0]), int(nll[1]), logits_out


def _cp_share(tokens: torch.Tensor, labels: torch.Tensor, group, *, sp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This cp rank's zigzag share of (b, s) tokens and labels, right-padded first to a multiple of 2*cp
    (padding comes after every real token, so causal attention never sees it; its labels are -100); with
    ``sp`` sequence-parallel shards to a multiple of 2*cp*sp (of sp at cp = 1), so each share splits over tp."""
    cp = group.size
    if cp == 1 and sp == 1:
        return tokens, labels
    pad = -tokens.shape[1] % (sp if cp == 1 else 2 * cp * sp)
    if pad:
        tokens = F.pad(tokens, (0, pad), value=0)
        labels = F.pad(labels, (0, pad), value=-100)
    return (zigzag_shard(tokens, cp=cp, rank=group.rank, dim=1),  # (b, s_pad/cp)
            zigzag_shard(labels, cp=cp, rank=group.rank, dim=1))


def _write_logits(path: str, logits: list[torch.Tensor], *, flat: bool) -> None:
    from safetensors.torch import save_file

    tensors = {"logits": logits[0].contiguous()} if flat else {f"logits.{i}": t.contiguous() for i, t in enumerate(logits)}
    tmp = f"{path}.tmp.{os.getpid()}"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)


def cli(run, argv: list[str] | None, *, prog: str) -> int:
    """A forward-only tool's exit: ``run(argv)``; errors one line each (exit 2); the process group freed
    under torchrun. An error raised before the process group exists (every check of the arguments, the
    checkpoint and the inputs: every rank raises it alike), or marked ``on_every_rank``, is said once, by
    rank 0; one raised later names its rank."""
    rank = launcher_rank()
    try:
        run(argv)
    except (ValueError, CheckpointError, FileNotFoundError) as e:
        if not dist.is_initialized() or getattr(e, "on_every_rank", False):
            say_once(f"{prog}: error: {e}", rank)
        else:
            print(f"{prog} (rank {rank}): error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized() and "TORCHELASTIC_RUN_ID" in os.environ:
            dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli(run_evaluate, argv, prog="evaluate.py")


if __name__ == "__main__":
    sys.exit(main())
