"""Training over a weak data-parallel link: tokens/s of DDP, DiLoCo and Streaming DiLoCo (and the per-step
compressors) with an injected per-byte delay on every data-parallel collective.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 tools/bench_decentralised.py \
        [--bandwidth-mbps 20] [--steps 20] [--warmup 2] [--json out.json]

Every rank builds the CPU preset (configs/tiny_llama_cpu.toml) at tp=1, pp=1 (dp = the world) through the
main job's assembly line, once per method, on synthetic tokens. The link (:class:`Link`): each rank's dp
collectives share one simulated link of ``--bandwidth-mbps`` MB/s (1e6 B), its rate split evenly between
the transfers in flight, no latency term. A collective's bytes (the ledger's ``sent_bytes`` on the dp axis)
start when it is issued; a synchronous collective returns once they are through, an asynchronous one at
once, and its ``wait()`` blocks until they are through. (An NCCL communicator runs its collectives in
order, one at a time: there a small collective would wait behind a large one in flight, which this
model, like gloo's worker threads, does not make it do.) So compute that runs between an async collective and
its wait hides the transfer, as on a real link: DDP's bucket all-reduces overlap the rest of backward,
and Streaming DiLoCo's fragment reduction overlaps the next inner step (until 2026-11-28 every
collective slept its bytes when issued, which credited neither). Prints one row per method: tokens/s, dp
bytes per step (ledger) and the ratio to DDP in the same run; ``--json`` writes the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

TAIL = 10  # steps the run has after the timed window (>= H)
METHODS = {
    "ddp": [],
    "diloco_h10": ["outer.method=diloco", "outer.inner_steps=10"],
    "diloco_h10_int8": ["outer.method=diloco", "outer.inner_steps=10", "outer.compression=int8"],
    "streaming_h10_f4": ["outer.method=streaming_diloco", "outer.inner_steps=10", "outer.fragments=4",
                         "outer.mix=0.5"],
    # each fragment's reduction overlapping 3 inner steps, not 1 (outer.overlap_steps, tau)
    "streaming_h10_f4_tau3": ["outer.method=streaming_diloco", "outer.inner_steps=10", "outer.fragments=4",
                              "outer.mix=0.5", "outer.overlap_steps=3"],
    "powersgd_r4": ["optim.grad_compression=powersgd", "optim.powersgd_rank=4"],
    "onebit": ["optim.grad_compression=onebit"],
}


class _Synthetic:
    def __init__(self, n: int, *, seq: int, vocab: int):
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = np.random.default_rng(i).integers(0, self.vocab, self.seq + 1)
        return {"tokens": ids[:-1], "labels": ids[1:], "position_ids": np.arange(self.seq),
                "loss_mask": np.ones(self.seq, dtype=np.float32)}


class Link:
    """One rank's simulated data-parallel link of ``bytes_per_s``, shared fairly by the transfers in flight
    (processor sharing: ``n`` concurrent transfers get ``1/n`` of the rate each, as interleaved packets of
    separate messages do), so a small synchronous collective is not stuck behind a large transfer in
    flight. :meth:`send` starts a transfer and returns its id; :meth:`block_until_done` sleeps until it is
    through. ``clock`` and ``sleep`` are injectable for tests."""

    def __init__(self, bytes_per_s: float, *, clock=time.perf_counter, sleep=time.sleep):
        if bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s={bytes_per_s} must be > 0")
        self.bytes_per_s, self.clock, self.sleep = bytes_per_s, clock, sleep
        self.left: dict[int, float] = {}  # transfer id -> bytes still to go
        self.t = 0.0  # the time self.left describes
        self.blocked_s = 0.0  # time spent waiting on the link (what the compute did not hide)
        self._next = 0

    @staticmethod
    def _run(left: dict[int, float], t: float, until: float | None, bps: float, target: int | None = None):
        """Share the rate over ``left`` from ``t`` (in place) until time ``until`` or until ``target`` is
        through; returns the time reached."""
        while left:
            rate = bps / len(left)
            fid, smallest = min(left.items(), key=lambda kv: kv[1])
            done_at = t + smallest / rate
            if until is not None and done_at > until:
                for k in left:
                    left[k] -= (until - t) * rate
                return until
            for k in left:
                left[k] -= smallest
            t = done_at
            for k in [k for k, v in left.items() if v <= 1e-9]:
                del left[k]
                if k == target:
                    return t
        return t if until is None else max(t, until)

    def send(self, nbytes: float) -> int:
        now = self.clock()
        self.t = self._run(self.left, self.t, max(now, self.t), self.bytes_per_s)
        fid, self._next = self._next, self._next + 1
        self.left[fid] = float(nbytes)
        return fid

    def done_at(self, fid: int) -> float:
        """When transfer ``fid`` is through if nothing else starts meanwhile (this rank is blocked on it)."""
        if fid not in self.left:
            return self.t
        return self._run(dict(self.left), self.t, None, self.bytes_per_s, target=fid)

    def block_until_done(self, fid: int) -> None:
        left = self.done_at(fid) - self.clock()
        if left > 0:
            self.blocked_s += left
            self.sleep(left)


class _LinkWork:
    """An async collective's handle whose ``wait()`` first waits for its bytes on the link."""

    def __init__(self, work, link: Link, transfers: list[int]):
        self._work, self._link, self._transfers = work, link, transfers

    def wait(self, *args, **kwargs):
        for fid in self._transfers:
            self._link.block_until_done(fid)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


ASYNC_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def install_link(ledger, comm_module, *, axis: str, link: Link) -> None:
    """Route ``axis``'s collectives over ``link``: wrap ``ledger.add`` (where each collective's bytes are
    recorded, when it is issued) and ``comm_module``'s collectives (which say whether a call is async and
    hand out its work handle)."""
    calls: list[dict] = []  # the comm calls in progress, innermost last: {"async": bool, "transfers": [...]}
    add = ledger.add

    def link_add(rec):
        if rec.axis == axis and rec.sent_bytes > 0:
            fid = link.send(rec.sent_bytes)
            if calls and calls[-1]["async"]:
                calls[-1]["transfers"].append(fid)  # paid at the handle's wait()
            else:
                link.block_until_done(fid)  # a synchronous collective: through before it returns
        add(rec)
    ledger.add = link_add

    def wrap(fn):
        def call(*args, **kwargs):
            calls.append({"async": bool(kwargs.get("async_op")), "transfers": []})
            try:
                out = fn(*args, **kwargs)
            finally:
                frame = calls.pop()
            if not frame["transfers"]:
                return out
            fids = frame["transfers"]
            if isinstance(out, tuple):  # (result, work)
                return tuple(_LinkWork(o, link, fids) if hasattr(o, "wait") and not torch.is_tensor(o) else o
                             for o in out)
            return _LinkWork(out, link, fids)
        return call

    for name in ASYNC_OPS:
        setattr(comm_module, name, wrap(getattr(comm_module, name)))


def bench(method: str, *, steps: int, warmup: int, bandwidth: float, seq: int):
    from engine.assembly import build_run
    from engine.config import load_config
    from models.hook import ModelHook

    n = torch.distributed.get_world_size()
    cfg = load_config("tiny_llama_cpu", [
        "parallel.tp=1", "parallel.pp=1", "parallel.dp=-1", "optim.distributed=false",
        # the run's last step applies a Streaming fragment at once (no compute after it to hide it): beyond the
        # timed window, which then sees the steady state only
        f"train.steps={steps + warmup + TAIL}",
        "optim.warmup_steps=0",  # the lr schedule does not change the timing; the preset's 15 would need 15 steps
        f"train.seq_length={seq}", "train.eval_interval=0", "logging.progress_bar=off", "logging.tensorboard=false",
        "logging.jsonl=false", "logging.memory_report=false", *METHODS[method]])
    model = ModelHook.from_run_config(cfg, tokenizer_vocab=None)
    gbs = cfg.train.global_batch_size
    run = build_run(cfg, model=model, train_data=_Synthetic(gbs * (steps + warmup + TAIL + 1), seq=seq,
                                                            vocab=cfg.model.vocab_size),
                    checkpoints=False, log_stream=open(os.devnull, "w"))
    from parallel import comm

    axis = run.trainer.ddp.dp_group.axis
    link = Link(bandwidth)
    saved = {name: getattr(comm, name) for name in ASYNC_OPS}
    install_link(run.mesh.ledger, comm, axis=axis, link=link)
    for _ in range(warmup):
        run.trainer.train_step(run.train_loader)
    torch.distributed.barrier()
    sent0 = run.mesh.ledger.by_axis().get(axis, 0.0)
    # the timed steps' waits only; a transfer still in flight at either edge is charged where it is waited on
    # (one launched by the last warm-up step, inside the window; one launched by the last timed step, after
    # it), so the window pays for exactly its own launches' worth
    link.blocked_s = 0.0
    t0 = time.perf_counter()
    losses = [run.trainer.train_step(run.train_loader).loss for _ in range(steps)]
    torch.distributed.barrier()
    seconds = time.perf_counter() - t0
    sent = run.mesh.ledger.by_axis().get(axis, 0.0) - sent0
    for name, fn in saved.items():  # the next method installs its own link
        setattr(comm, name, fn)
    run.close()
    return {"method": method, "dp": n, "tokens_per_s": gbs * seq * steps / seconds, "seconds": seconds,
            "dp_bytes_per_step": sent / steps, "link_blocked_s_per_step": link.blocked_s / steps,
            "last_loss": losses[-1]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bandwidth-mbps", type=float, default=20.0, help="dp link bandwidth per rank, MB/s (1e6 B)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per method (use a multiple of 10: H=10)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        p.error(f"unknown method(s) {bad}; choose from {', '.join(METHODS)}")
    if args.bandwidth_mbps <= 0 or args.steps < 1:
        p.error("--bandwidth-mbps must be > 0 and --steps >= 1")
    from parallel.mesh import init_distributed

    rank, world = init_distributed()
    if world < 2:
        p.error("run under torchrun with >= 2 processes (the dp group is the world), e.g. --nproc-per-node 4")
    rows = [bench(m, steps=args.steps, warmup=args.warmup, bandwidth=args.bandwidth_mbps * 1e6, seq=args.seq_length)
            for m in methods]
    if rank == 0:
        base = next((r for r in rows if r["method"] == "ddp"), rows[0])
        print(f"dp={world} over gloo, dp link {args.bandwidth_mbps:g} MB/s per rank (injected), {args.steps} steps "
              f"of the tiny_llama_cpu preset at tp=1 pp=1, seq {args.seq_length}")
        print(f"{'method':<20}{'tokens/s':>12}{'x ' + base['method']:>12}{'dp MB/step':>14}{'x bytes':>10}"
              f"{'link wait s/step':>18}")
        for r in rows:
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["bytes_ratio"] = r["dp_bytes_per_step"] / base["dp_bytes_per_step"] if base["dp_bytes_per_step"] else None
            print(f"{r['method']:<20}{r['tokens_per_s']:>12,.0f}{r['speedup']:>12.2f}"
                  f"{r['dp_bytes_per_step'] / 1e6:>14.3f}{(r['bytes_ratio'] or 0):>10.4f}"
                  f"{r['link_blocked_s_per_step']:>18.4f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bandwidth_mbps": args.bandwidth_mbps, "steps": args.steps, "world": world, "rows": rows},
                          f, indent=2)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
