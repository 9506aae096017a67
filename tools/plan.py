"""Choose a parallel layout: predicted memory per GPU, step time, TFLOP/s and MFU of every legal layout.

    python tools/plan.py --config llama3_70b --gpu h100-sxm --nodes 8
    python tools/plan.py --hf-config path/config.json --gpu a100-80gb --nodes 4 --seq-length 4096 \\
        --global-batch-size 256 --tp 4 --json plan.json
    python tools/plan.py --family llama --hidden-size 4096 --num-layers 32 --num-heads 32 --num-kv-heads 8 \\
        --ffn-hidden-size 14336 --vocab-size 128256 --gpu h100-sxm --nodes 1 --seq-length 8192 --global-batch-size 64
    python tools/plan.py --validate          # published runs (docs/planner.md)
    python tools/plan.py --calibrate         # this machine, and the tiny preset measured (docs/planner.md)

Prints the best layouts (fitting first, fastest first) with the breakdown of the best; ``--json PATH``
writes ``{"layouts": [{"tp", "pp", "vp", "dp", "cp", "ep", "mbs", "memory_gib_per_gpu", "step_time_s",
"tflops_per_gpu", "mfu", ...}, ...]}`` best first ("-": stdout). When no layout fits, it says the
smallest cluster (node count) that fits and the least memory per GPU any layout needs. Bad input exits
with status 2 and a message naming the fix. The model behind the numbers: docs/planner.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from engine.planner import (GPUS, Cluster, Training, fp8_gpus, from_dims, from_hf_config, from_preset, gpu,  # noqa: E402
                            plan, smallest_fit)
from models.hook import MissingModelKey  # noqa: E402

GIB = 2 ** 30
PINS = ("tp", "pp", "vp", "dp", "cp", "ep", "mbs")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    m = ap.add_argument_group("model (one of --config, --hf-config or --family with dimensions)")
    m.add_argument("--config", help="a Tessel preset name (configs/) or TOML file")
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override of --config")
    m.add_argument("--hf-config", help="a Hugging Face config.json")
    m.add_argument("--family")
    for k in ("hidden-size", "num-layers", "num-heads", "num-kv-heads", "ffn-hidden-size", "vocab-size",
              "num-experts", "top-k"):
        m.add_argument(f"--{k}", type=int)
    c = ap.add_argument_group("cluster")
    c.add_argument("--gpu", default="h100-sxm", help=f"one of {', '.join(GPUS)}")
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--intra-gbps", type=float, help="NVLink GB/s per GPU, one direction (default: the GPU's)")
    c.add_argument("--inter-gbps", type=float, help="inter-node GB/s per GPU (default: the GPU's)")
    c.add_argument("--intra-alpha-us", type=float)
    c.add_argument("--inter-alpha-us", type=float)
    c.add_argument("--memory-fraction", type=float, default=0.92, help="share of HBM a plan may fill")
    t = ap.add_argument_group("training")
    t.add_argument("--seq-length", type=int, help="default: the preset's train.seq_length")
    t.add_argument("--global-batch-size", type=int, help="sequences per step; default: the preset's")
    t.add_argument("--precision", default=None, choices=["bf16", "fp8"],
                   help="default: the preset's (fp8 where model.fp8 is set), else bf16")
    t.add_argument("--recompute", default=None, choices=["none", "selective", "full"],
                   help="default: the preset's, else selective")
    t.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3],
                   help="default: the preset's (optim.zero_stage with optim.distributed, else 0), else 1")
    t.add_argument("--attention", default="flash", choices=["flash", "unfused"])
    t.add_argument("--tp-overlap", choices=["none", "ring", "symm_mem"],
                   help="parallel.tp_overlap: 'ring' runs each sequence-parallel all-gather / reduce-scatter as tp - 1 "
                        "p2p steps under the linear's GEMM chunks (docs/overlap.md); 'symm_mem', the same through "
                        "PyTorch's symmetric-memory ops, is modelled as the ring; default: the preset's, else none")
    t.add_argument("--overlap-param-gather", choices=["on", "off"],
                   help="optim.overlap_param_gather (ZeRO 1/2): the post-step parameter all-gather hidden under the "
                        "next forward (on) or waited for after the update (off); default: the preset's, else off "
                        "(Tessel's default)")
    p = ap.add_argument_group("pins (keep one value of a degree)")
    for k in PINS:
        p.add_argument(f"--{k}", type=int)
    o = ap.add_argument_group("output")
    o.add_argument("--top", type=int, default=10, help="layouts printed")
    o.add_argument("--json", metavar="PATH", help="write the layouts as JSON ('-': stdout)")
    o.add_argument("--validate", action="store_true", help="reproduce the published runs")
    o.add_argument("--calibrate", action="store_true", help="measure this machine; predict and run the tiny preset")
    o.add_argument("--repeats", type=int, default=3, help="--calibrate: measured runs per layout")
    return ap.parse_args(argv)


def build_model(a):
    sources = [x for x in (a.config, a.hf_config, a.family) if x]
    if len(sources) != 1:
        raise ValueError("give exactly one model source: --config PRESET, --hf-config config.json, or --family with "
                         "--hidden-size --num-layers --num-heads [--num-kv-heads --ffn-hidden-size --vocab-size "
                         "--num-experts --top-k]")
    if a.config:
        return from_preset(a.config, a.set)
    if a.set:
        raise ValueError("--set overrides a --config preset; with --hf-config or --family give the dimensions directly")
    if a.hf_config:
        return from_hf_config(a.hf_config)
    missing = [k for k in ("hidden_size", "num_layers", "num_heads") if getattr(a, k) is None]
    if missing:
        raise ValueError(f"--family {a.family} needs {', '.join('--' + k.replace('_', '-') for k in missing)} "
                         "(the model's dimensions: --hidden-size, --num-layers, --num-heads)")
    try:
        return from_dims(family=a.family, hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=a.num_heads,
                         num_kv_heads=a.num_kv_heads, ffn_hidden_size=a.ffn_hidden_size,
                         vocab_size=a.vocab_size or 32000, num_experts=a.num_experts or 0, top_k=a.top_k or 0,
                         max_positions=a.seq_length or 8192)
    except MissingModelKey as e:  # the run config names its [model] keys; here they are flags
        if e.key not in MODEL_FLAGS:
            raise
        raise ValueError(f"--family {a.family} needs {MODEL_FLAGS[e.key]}") from None


# [model] keys a --family plan can still miss after the checks above (the others are checked or defaulted)
MODEL_FLAGS = {"ffn_hidden_size": "--ffn-hidden-size (the MLP width)"}


def build_training(a, model) -> Training:
    # Only a --config preset has training settings; a model from --hf-config or --family carries the engine's
    # defaults in its base config, which are not the user's choice.
    preset = model.base if a.config else {}
    tr = preset.get("train", {})
    seq = a.seq_length or tr.get("seq_length")
    gbs = a.global_batch_size or tr.get("global_batch_size")
    if seq is None or gbs is None:
        raise ValueError("give --seq-length and --global-batch-size (no preset to take them from)")
    recompute = a.recompute or tr.get("activation_checkpointing") or "selective"
    optim = preset.get("optim", {})
    if a.zero is None:  # the preset's (its --set overrides included), else the planner's default 1
        a.zero = (optim.get("zero_stage", 1) if optim.get("distributed") else 0) if preset else 1
    m = preset.get("model", {})
    if m.get("fp8_backend") == "te" and m.get("fp8", "none") != "none":  # what the trainer would refuse
        from parallel.tensor_parallel.fp8_te import check_te_recipe

        check_te_recipe(m["fp8"])
        if m["fp8"] == "mxfp8" and a.gpu != "b200":
            raise ValueError(f"model.fp8 = 'mxfp8' with model.fp8_backend = 'te' runs on Blackwell (sm_100/sm_103) "
                             f"only, not on --gpu {a.gpu}; plan it with --gpu b200, or use model.fp8 = 'blockwise'")
    if a.precision is None:
        if m.get("fp8") == "mxfp8" and m.get("fp8_backend", "tessel") == "tessel":
            raise ValueError("model.fp8 = 'mxfp8' on the tessel backend runs its GEMMs as fp32 matmuls (emulated, "
                             "docs/fp8.md): no FP8 peak applies; give --precision bf16 or fp8 to plan the layout "
                             "anyway, or set model.fp8_backend = 'te' (TE's MXFP8 on Blackwell)")
        a.precision = "fp8" if m.get("fp8", "none") != "none" else "bf16"
        if a.precision == "fp8" and gpu(a.gpu).fp8_tflops is None:  # implied by model.fp8: say so
            raise ValueError(f"model.fp8 = {m['fp8']!r} (the preset's, or --set) plans at FP8 precision, and the "
                             f"{gpu(a.gpu).name} has no FP8 tensor cores; give --precision bf16 to plan it in bf16, "
                             f"or an fp8-capable --gpu ({', '.join(fp8_gpus())})")
    overlap = a.tp_overlap or preset.get("parallel", {}).get("tp_overlap") or "none"
    if overlap not in ("none", "ring", "symm_mem"):
        raise ValueError(f"parallel.tp_overlap={overlap!r} (the preset's) is not planned: use --tp-overlap none, ring "
                         "or symm_mem")
    if a.overlap_param_gather and a.zero not in (1, 2):
        raise ValueError(f"--overlap-param-gather is read at --zero 1 or 2 (the post-step parameter all-gather), "
                         f"not --zero {a.zero}; drop it")
    gather = (a.overlap_param_gather == "on" if a.overlap_param_gather
              else bool(preset.get("optim", {}).get("overlap_param_gather", False)))
    return Training(seq_length=seq, global_batch_size=gbs, precision=a.precision, recompute=recompute, zero=a.zero,
                    attention=a.attention, tp_overlap=overlap, overlap_param_gather=gather)


def _fmt_row(p) -> str:
    lay = p.layout
    return (f"{lay.tp:>3} {lay.pp:>3} {lay.vp:>3} {lay.dp:>4} {lay.cp:>3} {lay.ep:>3} {lay.mbs:>4} "
            f"{p.memory_bytes / GIB:>9.1f} {p.step_time_s:>10.3f} {p.tflops_per_gpu:>9.1f} {100 * p.mfu:>6.1f}% "
            f"{100 * p.mfu_causal:>6.1f}%  {'yes' if p.fits else 'NO'}")


def report(preds, model, cluster, tr, *, top: int, out=sys.stdout) -> None:
    print(f"{model.name} on {cluster.world} x {cluster.gpu.name} ({cluster.nodes} nodes x {cluster.gpus_per_node}), "
          f"seq {tr.seq_length}, global batch {tr.global_batch_size}, {tr.precision}, {tr.recompute} recompute, "
          f"ZeRO {tr.zero}" + {"ring": ", TP ring overlap", "symm_mem": ", TP symm_mem overlap (modelled as the ring)"}
          .get(tr.tp_overlap, "")
          + ({True: ", parameter gather overlapped", False: ", parameter gather after the update"}
             .get(tr.overlap_param_gather, "") if tr.zero in (1, 2) else "")
          + f"; fits = at most {cluster.capacity_bytes / GIB:.1f} GiB "
          f"({100 * cluster.memory_fraction:.0f}% of {cluster.gpu.hbm_gb:g} GB)", file=out)
    print(f"{'tp':>3} {'pp':>3} {'vp':>3} {'dp':>4} {'cp':>3} {'ep':>3} {'mbs':>4} {'mem GiB':>9} {'step s':>10} "
          f"{'TFLOP/s':>9} {'MFU':>7} {'causal':>7}  fits", file=out)
    for p in preds[:top]:
        print(_fmt_row(p), file=out)
    best = preds[0]
    r = best.memory.largest
    print(f"\nbest: {best.layout.label()} - memory per GPU (pp rank {r.pp_rank}): parameters {r.params / GIB:.2f}, "
          f"gradients {r.grads / GIB:.2f}, optimizer {r.optimizer / GIB:.2f}, activations {r.activations / GIB:.2f} "
          f"({r.inflight} micro-batches in flight), transients {r.transient / GIB:.2f} GiB", file=out)
    parts = ", ".join(f"{k} {v:.3f}" for k, v in best.breakdown.items() if v)
    print(f"best: time per step on its busiest pipeline rank (s, summed; compute overlaps nothing but the "
          f"*_overlapped entries): {parts}", file=out)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        if a.validate:
            from engine.planner.validate import main_validate
            return main_validate(json_path=a.json)
        if a.calibrate:
            from engine.planner.calibrate import main_calibrate
            return main_calibrate(repeats=a.repeats, json_path=a.json)
        model = build_model(a)
        tr = build_training(a, model)
        g = gpu(a.gpu).with_links(intra_gbps=a.intra_gbps, inter_gbps=a.inter_gbps, intra_alpha_us=a.intra_alpha_us,
                                  inter_alpha_us=a.inter_alpha_us)
        cluster = Cluster(gpu=g, nodes=a.nodes, gpus_per_node=a.gpus_per_node, memory_fraction=a.memory_fraction)
        pins = {k: getattr(a, k) for k in PINS}
        preds, _ = plan(model, cluster, tr, pins)
    except ValueError as e:
        print(f"plan.py: error: {e}", file=sys.stderr)
        return 2
    doc = {"model": model.name, "gpu": cluster.gpu.name, "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
           "seq_length": tr.seq_length, "global_batch_size": tr.global_batch_size, "precision": tr.precision,
           "recompute": tr.recompute, "zero": tr.zero, "tp_overlap": tr.tp_overlap,
           "overlap_param_gather": tr.overlap_param_gather,
           "layouts": [p.as_dict() for p in preds]}
    out = sys.stderr if a.json == "-" else sys.stdout
    report(preds, model, cluster, tr, top=a.top, out=out)
    if not preds[0].fits:
        nodes, least = smallest_fit(model, cluster, tr, {k: getattr(a, k) for k in PINS})
        doc["fits"] = False
        doc["least_memory_gib_per_gpu"] = least / GIB
        doc["smallest_fitting_nodes"] = nodes
        where = (f"the smallest cluster that fits has {nodes} nodes of {cluster.gpus_per_node} {cluster.gpu.name}"
                 if nodes else "no cluster up to 4096 nodes fits with these pins")
        print(f"\nNO LAYOUT FITS: the least memory any layout needs is {least / GIB:.1f} GiB per GPU "
              f"(capacity {cluster.capacity_bytes / GIB:.1f} GiB); {where}", file=out)
    else:
        doc["fits"] = True
    if a.json:
        text = json.dumps(doc, indent=1)
        if a.json == "-":
            print(text)
        else:
            with open(a.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
