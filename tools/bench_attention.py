"""Benchmark: context-parallel attention (docs/context_parallel.md) on CPU -- ring vs all-to-all vs one process.

One causal attention layer's core (no projections), fp32, forward + backward of q, k and v, at each
``--seqs`` length, with tiny heads (``--heads`` query heads over ``--kv-heads`` kv heads, ``--head-dim``):

* ``one process (SDPA)``: ``F.scaled_dot_product_attention`` over the whole sequence with ``--cp``
  threads -- the baseline every ratio is against, measured in the same run on the same cores;
* ``one process (blocks)``: the ring's own block kernels (``parallel.context_parallel.ring``) over the
  whole sequence in one process with ``--cp`` threads: the kernels' cost without communication, with the
  fused flash kernel on full and causal blocks (the default) and with the explicit kernel everywhere
  (``fused=False``: matmuls and a softmax over the L x L scores);
* ``ring`` and ``a2a``: ``--cp`` gloo ranks of one thread each (``parallel.testing.run_distributed``),
  each holding its zigzag shard; a step's time is the slowest rank's. Beside each: the bytes a rank
  sent (from parallel/comm's ledger) and the seconds it was blocked in communication (``comm.wait``
  and synchronous collectives: what the compute did not hide).

* ``ring (explicit)``: the ring with the explicit block kernel, to show what the flash blocks save.

After one untimed warm-up, ``--repeats`` timed rounds; medians. Masked blocks (documents, sliding
windows) always take the explicit kernel; this benchmark's plain causal mask has none.

    .venv/bin/python tools/bench_attention.py --json docs/benchmarks/attention.json --md docs/benchmarks/attention.md

``--device cuda`` (a lent GPU; one device, so no ring communication): the kernel-level cost of cutting
attention into the ring's blocks. bf16 causal attention fwd + bwd at the model's head shape (``--heads``,
``--kv-heads``, ``--head-dim``, default Llama-3 8B's 32 over 8 of 128), ``--seqs`` tokens: SDPA (flash)
over the whole sequence against the ring's block kernels in one process over the ``2 cp`` zigzag chunks
(flash per block, and the explicit kernel), for cp = ``--cuda-cps``; CUDA events, medians.

``--profile-cp CP`` (either device): instead of timing, SDPA against the ring's flash blocks at that cp,
kernel by kernel (tools/kernel_profile.py), at the first ``--seqs`` length.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

COMMS = ("ring", "a2a", "ring_explicit")


def _inputs(s: int, args: dict):
    """Full-sequence q (s, 1, nh, hd), k, v (s, 1, g, hd) and the output gradient, from ``args['seed']``."""
    g = torch.Generator().manual_seed(args["seed"] + s)
    q = torch.randn(s, 1, args["heads"], args["head_dim"], generator=g)
    k = torch.randn(s, 1, args["kv_heads"], args["head_dim"], generator=g)
    v = torch.randn(s, 1, args["kv_heads"], args["head_dim"], generator=g)
    go = torch.randn(s, 1, args["heads"] * args["head_dim"], generator=g)
    return q, k, v, go


def _timed(step, repeats: int) -> list[float]:
    step()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def _sdpa_step(q, k, v, go, scale):
    def step():
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs.permute(1, 2, 0, 3), ks.permute(1, 2, 0, 3), vs.permute(1, 2, 0, 3),
                                           is_causal=True, scale=scale, enable_gqa=True)  # (1, nh, s, hd)
        o.permute(2, 0, 1, 3).reshape(go.shape).backward(go)
    return step


def _cp_step(cp, q, k, v, go, masks, scale, *, explicit: bool = False):
    from parallel.context_parallel import ring_attention, zigzag_chunks

    def step():
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        if explicit:  # the ring with the explicit block kernel everywhere
            out = ring_attention(qs, ks, vs, group=cp.group, chunks_of=lambda r: zigzag_chunks(r, cp.size),
                                 masks=masks, scale=scale, fused=False)
        else:
            out = cp.attention(qs, ks, vs, masks=masks, scale=scale)
        out.backward(go)
    return step


def _one_process(args: dict) -> dict:
    from parallel.comm import Group
    from parallel.context_parallel import BlockMasks, ring_attention

    torch.set_num_threads(args["cp"])
    scale = args["head_dim"] ** -0.5
    out = {}
    for s in args["seqs"]:
        q, k, v, go = _inputs(s, args)
        masks = BlockMasks(seq_len=s, num_chunks=2 * args["cp"], doc_ids=None, window=None)
        every = list(range(2 * args["cp"]))

        def blocks(fused):
            def step():
                qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
                ring_attention(qs, ks, vs, group=Group.trivial("cp"), chunks_of=lambda r: every, masks=masks,
                               scale=scale, fused=fused).backward(go)
            return step
        out[s] = {"sdpa": _timed(_sdpa_step(q, k, v, go, scale), args["repeats"]),
                  "blocks": _timed(blocks(None), args["repeats"]),
                  "blocks_explicit": _timed(blocks(False), args["repeats"])}
    return out


def _ranks(args: dict) -> dict:
    """On each cp rank (spawned): times, bytes sent and blocked seconds of ring and a2a per length."""
    from parallel.context_parallel import BlockMasks, ContextParallel, zigzag_shard
    from parallel.mesh import Mesh, ParallelDims

    cp_size = args["cp"]
    mesh = Mesh.build(ParallelDims(cp=cp_size))
    scale = args["head_dim"] ** -0.5
    out = {}
    for s in args["seqs"]:
        full = _inputs(s, args)
        q, k, v, go = (zigzag_shard(t, cp=cp_size, rank=mesh.cp.rank, dim=0).contiguous() for t in full)
        masks = BlockMasks(seq_len=s, num_chunks=2 * cp_size, doc_ids=None, window=None)
        for comm_kind in COMMS:
            cp = ContextParallel(group=mesh.cp, comm="ring" if comm_kind == "ring_explicit" else comm_kind)
            step = _cp_step(cp, q, k, v, go, masks, scale, explicit=comm_kind == "ring_explicit")
            step()  # warm-up
            sent0, blocked0 = mesh.ledger.total(axis="cp"), mesh.ledger.blocked_s.get("cp", 0.0)
            times = []
            for _ in range(args["repeats"]):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            n = args["repeats"]
            out[(s, comm_kind)] = {"times": times, "sent_bytes": (mesh.ledger.total(axis="cp") - sent0) / n,
                                   "blocked_s": (mesh.ledger.blocked_s.get("cp", 0.0) - blocked0) / n}
    return out


def run_cuda(args: argparse.Namespace) -> dict:
    """One GPU: SDPA over the whole sequence vs the ring's blocks (flash, explicit) at each cp, bf16."""
    from parallel.comm import Group
    from parallel.context_parallel import BlockMasks, ring_attention
    from parallel.context_parallel.ring import BLOCK_PATHS
    from tools.bench_train_step import _time_cuda

    scale, rows = args.head_dim ** -0.5, []
    for s in args.seqs:
        g = torch.Generator().manual_seed(args.seed + s)
        q, k, v = (torch.randn(s, 1, h, args.head_dim, generator=g).cuda().bfloat16()
                   for h in (args.heads, args.kv_heads, args.kv_heads))
        go = torch.randn(s, 1, args.heads * args.head_dim, generator=g).cuda().bfloat16()
        flops = 4 * s * s * args.heads * args.head_dim / 2 * 3.5  # causal fwd (2 GEMMs) + bwd (5): 3.5x fwd
        def timed(fn):  # two warm-ups (kernel selection, allocator), then CUDA events
            fn()
            fn()
            return statistics.median(_time_cuda(fn, n=args.repeats)[1])
        sdpa = timed(_sdpa_step(q, k, v, go, scale))
        row = {"seq": s, "sdpa_s": sdpa, "sdpa_tflops": flops / sdpa / 1e12}
        for cp in args.cuda_cps:
            masks = BlockMasks(seq_len=s, num_chunks=2 * cp, doc_ids=None, window=None, device="cuda")
            every = list(range(2 * cp))
            variants = (("flash", True), ("explicit", False)) if s <= args.explicit_max_seq else (("flash", True),)
            for name, fused in variants:
                def step():
                    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
                    ring_attention(qs, ks, vs, group=Group.trivial("cp"), chunks_of=lambda r: every, masks=masks,
                                   scale=scale, fused=fused).backward(go)
                try:
                    t = timed(step)
                    row[f"cp{cp}_{name}_s"], row[f"cp{cp}_{name}_ratio"] = t, t / sdpa
                    row[f"cp{cp}_{name}_path"] = BLOCK_PATHS.get("cuda")
                except (RuntimeError, ValueError) as e:  # recorded: the next variant still runs
                    row[f"cp{cp}_{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"benchmark": "tools/bench_attention.py --device cuda",
            "command": "python3 tools/bench_attention.py " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}, "args": vars(args),
            "rows": rows}


def run_profile(args: argparse.Namespace) -> dict:
    """``--profile-cp CP``: one process, the first ``--seqs`` length, kernel by kernel (tools/kernel_profile.py):
    SDPA over the whole sequence against the ring's flash blocks over the 2 CP zigzag chunks (bf16 on
    CUDA, fp32 on the CPU), forward + backward. Where the blocks' time goes beyond SDPA's."""
    from parallel.comm import Group
    from parallel.context_parallel import BlockMasks, ring_attention
    from tools.kernel_profile import kernel_table, print_kernel_table

    dev, cp, s = args.device, args.profile_cp, args.seqs[0]
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator().manual_seed(args.seed + s)
    q, k, v = (torch.randn(s, 1, h, args.head_dim, generator=g).to(dev, dtype)
               for h in (args.heads, args.kv_heads, args.kv_heads))
    go = torch.randn(s, 1, args.heads * args.head_dim, generator=g).to(dev, dtype)
    scale = args.head_dim ** -0.5
    masks = BlockMasks(seq_len=s, num_chunks=2 * cp, doc_ids=None, window=None, device=dev)
    every = list(range(2 * cp))

    def blocks():
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        ring_attention(qs, ks, vs, group=Group.trivial("cp"), chunks_of=lambda r: every, masks=masks,
                       scale=scale, fused=None).backward(go)
    out = {"seq": s, "cp": cp, "device": dev, "sides": {}}
    for name, fn in (("sdpa", _sdpa_step(q, k, v, go, scale)), (f"cp{cp}_blocks", blocks)):
        table = kernel_table(fn, device=dev, repeats=args.repeats)
        out["sides"][name] = {"total_us": table["total_us"], "kernels": table["kernels"][:args.profile_top]}
        print_kernel_table(f"{name}, forward + backward, {s} tokens, {dtype}", table, top=args.profile_top)
    return out


def run(args: argparse.Namespace) -> dict:
    from parallel.context_parallel import check_a2a_heads, check_cp_sequence
    from parallel.testing import run_distributed

    a = {k: v for k, v in vars(args).items() if k not in ("json", "md")}
    for s in args.seqs:
        check_cp_sequence(s, cp=args.cp)
    check_a2a_heads(heads=args.heads, kv_heads=args.kv_heads, size=args.cp)
    single = _one_process(a)
    ranks = run_distributed(_ranks, args.cp, a, timeout=3600)
    rows = []
    for s in args.seqs:
        base = statistics.median(single[s]["sdpa"])
        row = {"seq": s, "one_process_sdpa_s": base,
               "one_process_blocks_s": statistics.median(single[s]["blocks"])}
        row["one_process_blocks_ratio"] = row["one_process_blocks_s"] / base
        row["one_process_blocks_explicit_s"] = statistics.median(single[s]["blocks_explicit"])
        row["one_process_blocks_explicit_ratio"] = row["one_process_blocks_explicit_s"] / base
        for comm_kind in COMMS:
            per = [r[(s, comm_kind)] for r in ranks]
            slowest = [max(p["times"][i] for p in per) for i in range(args.repeats)]
            row[f"{comm_kind}_s"] = statistics.median(slowest)
            row[f"{comm_kind}_ratio"] = row[f"{comm_kind}_s"] / base
            row[f"{comm_kind}_sent_bytes_per_rank"] = per[0]["sent_bytes"]
            row[f"{comm_kind}_blocked_s_max"] = max(p["blocked_s"] for p in per)
        rows.append(row)
    return {"benchmark": "tools/bench_attention.py",
            "command": "python tools/bench_attention.py " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "cpu_count": os.cpu_count(), "torch": torch.__version__,
                        "loadavg_1min_at_end": os.getloadavg()[0]},  # other work on the machine skews ratios
            "args": a, "rows": rows}


def format_table(res: dict) -> str:
    a = res["args"]
    lines = [f"causal attention fwd+bwd, fp32, 1 x {a['heads']} heads over {a['kv_heads']} kv heads x {a['head_dim']}, "
             f"cp={a['cp']} (one thread per rank; one process with {a['cp']} threads); medians of {a['repeats']}; "
             "ratios vs one process (SDPA), this run",
             "| seq | one process SDPA s | one process blocks s (x) | same, explicit blocks s (x) | ring s (x) "
             "| ring, explicit blocks s (x) | ring MiB sent/rank | ring blocked s "
             "| a2a s (x) | a2a MiB sent/rank | a2a blocked s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['seq']} | {r['one_process_sdpa_s']:.3f} | {r['one_process_blocks_s']:.3f} "
                     f"({r['one_process_blocks_ratio']:.2f}) | {r['one_process_blocks_explicit_s']:.3f} "
                     f"({r['one_process_blocks_explicit_ratio']:.2f}) | {r['ring_s']:.3f} ({r['ring_ratio']:.2f}) | "
                     f"{r['ring_explicit_s']:.3f} ({r['ring_explicit_ratio']:.2f}) | "
                     f"{r['ring_sent_bytes_per_rank'] / 2**20:.2f} | {r['ring_blocked_s_max']:.3f} | "
                     f"{r['a2a_s']:.3f} ({r['a2a_ratio']:.2f}) | {r['a2a_sent_bytes_per_rank'] / 2**20:.2f} | "
                     f"{r['a2a_blocked_s_max']:.3f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--cuda-cps", type=int, nargs="+", default=None,
                   help="--device cuda: the cp sizes whose 2 cp blocks are timed (default 2 4 8)")
    p.add_argument("--seqs", type=int, nargs="+", default=None,
                   help="sequence lengths (default 4096 8192 16384 on CPU, 8192 32768 on CUDA)")
    p.add_argument("--cp", type=int, default=2, help="context-parallel ranks (spawned, gloo)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 4 CPU, 32 CUDA)")
    p.add_argument("--kv-heads", type=int, default=None, help="kv heads (default 2 CPU, 8 CUDA)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 32 CPU, 128 CUDA)")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions (default 3 on CPU, 10 on CUDA)")
    p.add_argument("--explicit-max-seq", type=int, default=None,
                   help="--device cuda: the explicit block kernel only up to this length (default 8192; at 32K it "
                        "runs ~2 s a step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-cp", type=int, default=None, metavar="CP",
                   help="only profile, kernel by kernel, SDPA against the ring's flash blocks at this cp (one process, "
                        "the first --seqs length)")
    p.add_argument("--profile-top", type=int, default=None, help="kernels listed per side with --profile-cp "
                   "(default 15)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--md", default=None, help="write a markdown page (table, machine, command, date) here")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.heads = args.heads or (32 if cuda else 4)
    args.kv_heads = args.kv_heads or (8 if cuda else 2)
    args.head_dim = args.head_dim or (128 if cuda else 32)
    if args.cuda_cps is not None and not cuda:
        p.error("--cuda-cps is read with --device cuda only (the CPU run times --cp ranks)")
    # options whose default depends on another one are None unless given, so "given" is exact (abbreviations
    # and --flag=value included)
    if not cuda and args.explicit_max_seq is not None:
        p.error("--explicit-max-seq is read with --device cuda only (the CPU run times both kernels at every length)")
    if args.profile_cp is not None and args.profile_cp < 1:
        p.error(f"--profile-cp={args.profile_cp} must be a cp degree >= 1")
    if args.profile_cp is None and args.profile_top is not None:
        p.error("--profile-top is read with --profile-cp only")
    args.cuda_cps = args.cuda_cps or [2, 4, 8]
    args.seqs = args.seqs or ([8192, 32768] if cuda else [4096, 8192, 16384])
    args.repeats = args.repeats if args.repeats is not None else (10 if cuda else 3)
    args.explicit_max_seq = args.explicit_max_seq if args.explicit_max_seq is not None else 8192
    args.profile_top = args.profile_top if args.profile_top is not None else 15
    return args


def _write_json(path: str | None, res: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.repeats < 1 or args.cp < 2:
        raise SystemExit("--repeats must be >= 1 and --cp >= 2")
    if args.profile_cp is not None:
        from parallel.context_parallel import check_cp_sequence

        check_cp_sequence(args.seqs[0], cp=args.profile_cp)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: no GPU visible to torch")
        _write_json(args.json, run_profile(args))
        return 0
    if args.device == "cuda":
        from parallel.context_parallel import check_cp_sequence

        for s in args.seqs:  # a bad length fails here, not as an error row of the table
            for cp in args.cuda_cps:
                check_cp_sequence(s, cp=cp)
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no GPU visible to torch")
        _write_json(args.json, run_cuda(args))
        return 0
    res = run(args)
    table = format_table(res)
    print(table)
    _write_json(args.json, res)
    if args.md:
        m = res["machine"]
        with open(args.md, "w") as f:
            f.write(f"# Context-parallel attention on CPU (tools/bench_attention.py)\n\n"
                    f"`{res['command']}` on {m['processor']}, {m['cpu_count']} cores, {m['platform']}, torch "
                    f"{m['torch']}, {res['date']}. JSON beside this page. What each column is: the docstring "
                    f"of tools/bench_attention.py and docs/context_parallel.md.\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
