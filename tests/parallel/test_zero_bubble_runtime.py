"""Split backward in the pipeline runtime (ZB-H1, ZB-V, DualPipeV): losses and every gradient equal
one process with gradient accumulation (fp64, 1e-12) at pp = 2 and 4; the measured peak of held
(stage, micro-batch) pairs equals the simulator's; the weight-gradient GEMMs really wait for W (none
has run when B returns; each weight's post-accumulate hook fires once per W, as data parallelism needs)."""
import pytest
import torch
import torch.distributed as dist

from parallel.comm import Group, Ledger
from parallel.pipeline import build_schedule, peak_inflight
from parallel.pipeline.runtime import run_schedule
from parallel.testing import run_distributed

S, B, H = 4, 2, 6
PER_STAGE = 2
CASES = {2: [("1f1b", 1, 4), ("zb-h1", 1, 2), ("zb-h1", 1, 4), ("zbv", 2, 2), ("zbv", 2, 3), ("dualpipev", 2, 4)],
         4: [("zb-h1", 1, 6), ("zbv", 2, 4), ("dualpipev", 2, 8)]}


def _weights(num_layers):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(H, H, generator=g, dtype=torch.float64) / H ** 0.5,
             torch.randn(H, generator=g, dtype=torch.float64) * 0.1) for _ in range(num_layers)]


def _layers(num_layers):
    """Column-parallel linears on a size-1 TP group (the deferrable path), fp64, seeded."""
    from parallel.tensor_parallel import ColumnParallelLinear

    out = []
    for w, b in _weights(num_layers):
        lyr = ColumnParallelLinear(H, H, tp_group=Group.trivial("tp"), dtype=torch.float64)
        with torch.no_grad():
            lyr.weight.copy_(w)
            lyr.bias.copy_(b)
        out.append(lyr)
    return out


def _data(m):
    g = torch.Generator().manual_seed(99)
    return ([torch.randn(S, B, H, generator=g, dtype=torch.float64) for _ in range(m)],
            [torch.randn(S, B, H, generator=g, dtype=torch.float64) for _ in range(m)])


def _run(layers, x):
    for lyr in layers:
        x = torch.tanh(lyr(x))
    return x


def _reference(num_stages, m):
    layers = _layers(num_stages * PER_STAGE)
    xs, ys = _data(m)
    losses = []
    for x, y in zip(xs, ys):
        loss = ((_run(layers, x) - y) ** 2).mean()
        losses.append(loss.item())
        (loss / m).backward()
    return losses, [(lyr.weight.grad, lyr.bias.grad) for lyr in layers]


def _rank(name, vp, m):
    pp, rank = dist.get_world_size(), dist.get_rank()
    group = Group(axis="pp", ranks=list(range(pp)), rank=rank, pg=dist.group.WORLD, ledger=Ledger())
    sched = build_schedule(name, pp=pp, vp=vp, microbatches=m)
    stages = sched.stages_of(rank)
    layers = _layers(pp * vp * PER_STAGE)
    mine = [layers[s * PER_STAGE:(s + 1) * PER_STAGE] for s in stages]
    xs, ys = _data(m)
    last = pp * vp - 1
    fired = {}   # weight -> post-accumulate hook calls with a gradient (autograd also calls it with none in B)

    def hook(p):
        if p.grad is not None:
            fired[id(p)] = fired.get(id(p), 0) + 1
            p.grad_seen = p.grad.clone() if not hasattr(p, "grad_seen") else p.grad_seen + p.grad
            p.grad = None   # as data parallelism does: move it out, so each call sees one micro-batch's
    for chunk in mine:
        for lyr in chunk:
            lyr.weight.register_post_accumulate_grad_hook(hook)

    def forward_step(chunk, x, mb):
        stage = stages[chunk]
        out = _run(mine[chunk], xs[mb] if stage == 0 else x)
        return ((out - ys[mb]) ** 2).mean() if stage == last else out

    res = run_schedule(sched, rank=rank, pp_group=group, forward_step=forward_step, act_shape=(S, B, H),
                       dtype=torch.float64)
    grads = {s: [(lyr.weight.grad_seen, lyr.bias.grad) for lyr in chunk] for s, chunk in zip(stages, mine)}
    calls = sorted(set(fired.values()))
    return res.losses, grads, res.peak_live, calls


def _all(pp):
    return {case: _rank(*case) for case in CASES[pp]}


@pytest.mark.parametrize("pp", [2, 4])
def test_split_backward_parity_and_peak(pp):
    results = run_distributed(_all, pp, pp, timeout=240)
    for name, vp, m in CASES[pp]:
        sched = build_schedule(name, pp=pp, vp=vp, microbatches=m)
        ref_losses, ref_grads = _reference(pp * vp, m)
        predicted = peak_inflight(sched)
        for rank in range(pp):
            losses, grads, peak, calls = results[rank][(name, vp, m)]
            if rank == sched.rank_of(pp * vp - 1):
                assert losses == pytest.approx(ref_losses, abs=1e-12, rel=0)
            else:
                assert losses == []
            for s, gl in grads.items():
                for (gw, gb), (rw, rb) in zip(gl, ref_grads[s * PER_STAGE:(s + 1) * PER_STAGE]):
                    torch.testing.assert_close(gw, rw, rtol=0, atol=1e-12)
                    torch.testing.assert_close(gb, rb, rtol=0, atol=1e-12)
            assert peak == predicted[rank], (name, m, rank)
            assert calls == [m], (name, m, rank)   # one accumulation per micro-batch and weight


def test_b_defers_the_weight_gradient_and_w_accumulates_it():
    """One stage by hand: after B under capture the weights have no gradient and the queue holds one
    GEMM per linear; W accumulates exactly the plain backward's gradients and empties the queue."""
    from parallel.tensor_parallel import wgrad

    layers, ref = _layers(2), _layers(2)
    x = torch.randn(S, B, H, dtype=torch.float64, requires_grad=True)
    with wgrad.deferrable():
        out = _run(layers, x)
    q = wgrad.WgradQueue()
    with wgrad.capture(q):
        out.sum().backward()
    assert len(q) == 2 and all(lyr.weight.grad is None for lyr in layers)
    assert all(lyr.bias.grad is not None for lyr in layers)   # biases get theirs in B
    q.run()
    assert len(q) == 0
    xr = x.detach().clone().requires_grad_()
    _run(ref, xr).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)
    for a, b in zip(layers, ref):
        torch.testing.assert_close(a.weight.grad, b.weight.grad, rtol=0, atol=1e-14)


# -- Llama (fp32, 1e-6): pp = 4; pp = 2 with dp = 2 through DataParallel's hooks; pp = 2 x tp = 2 + SP ------------

LLAMA_LAYERS, LB, LS, SEED, VOCAB, HIDDEN = 8, 2, 8, 11, 100, 64
# (pp, tp, sp, data_parallel, schedule, vp, m, tied)
LLAMA_CASES = [(4, 1, False, False, "zb-h1", 1, 4, True), (4, 1, False, False, "zbv", 2, 4, False),
               (2, 1, False, True, "zb-h1", 1, 4, True), (2, 1, False, True, "dualpipev", 2, 4, False),
               (2, 2, True, False, "zb-h1", 1, 2, True), (2, 2, True, False, "zbv", 2, 2, False)]


def _llama_config(tied):
    from tests.models.tiny import config
    return config("llama", num_hidden_layers=LLAMA_LAYERS, tie_word_embeddings=tied)


def _llama_batches(m):
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, VOCAB, (LB, LS), generator=g), torch.randint(0, VOCAB, (LB, LS), generator=g))
            for _ in range(m)]


def _llama_reference(tied, m):
    from models import build_model
    model = build_model(_llama_config(tied), tp_group=Group.trivial("tp"), seed=SEED)
    losses = []
    for ids, labels in _llama_batches(m):
        loss = model(ids, labels=labels).mean()
        losses.append(loss.item())
        (loss / m).backward()
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def _llama_case(mesh, *, name, vp, m, tied, sp, data_parallel):
    from models import build_model
    from parallel.data_parallel import DataParallel
    from parallel.pipeline.runtime import allreduce_tied_embedding_grads
    from parallel.tensor_parallel import allreduce_sequence_parallel_grads, full_param

    pp, tp = mesh.dims.pp, mesh.tp
    sched = build_schedule(name, pp=pp, vp=vp, microbatches=m)
    stages = sched.stages_of(mesh.coords["pp"])
    last, per = pp * vp - 1, LLAMA_LAYERS // (pp * vp)
    chunks = torch.nn.ModuleList([
        build_model(_llama_config(tied), tp_group=tp, sequence_parallel=sp, pre_process=s == 0, post_process=s == last,
                    layer_range=(s * per, (s + 1) * per), seed=SEED) for s in stages])
    data = _llama_batches(m)
    ddp = DataParallel(chunks, dp_group=mesh.dp, tp_group=tp, chunks=True) if data_parallel else None

    def forward_step(chunk, x, mb):
        ids, labels = data[mb]
        inp = ids if stages[chunk] == 0 else x
        return chunks[chunk](inp, labels=labels).mean() if stages[chunk] == last else chunks[chunk](inp)

    if ddp is not None:
        ddp.is_last_microbatch = False
    res = run_schedule(sched, rank=mesh.coords["pp"], pp_group=mesh.pp, forward_step=forward_step,
                       act_shape=(LS // tp.size if sp else LS, LB, HIDDEN), dtype=torch.float32,
                       grad_sync=ddp.enable_grad_sync if ddp is not None else None)
    if ddp is not None:
        ddp.finish_grad_sync()   # every main_grad: the dp mean (both replicas ran the same batches)
        for p in chunks.parameters():
            p.grad = p.main_grad
    tied_params = [p for c in chunks for p in c.parameters() if getattr(p, "shared_embedding", False)]
    allreduce_tied_embedding_grads(tied_params, mesh.embedding)
    grads = {}
    for chunk in chunks:
        allreduce_sequence_parallel_grads(chunk, tp)
        for n, p in chunk.named_parameters():
            grads[n + (" (tied copy)" if tied and n == "output_layer.weight" else "")] = full_param(p, tp, grad=True)
    return {"losses": res.losses, "grads": grads, "peak": res.peak_live,
            "predicted": peak_inflight(sched)[mesh.coords["pp"]], "last": mesh.coords["pp"] == sched.rank_of(last)}


def _llama_worker():
    from parallel.mesh import Mesh, ParallelDims
    meshes, out = {}, {}
    for case in LLAMA_CASES:
        pp, tp, sp, data_parallel, name, vp, m, tied = case
        if (pp, tp) not in meshes:
            meshes[pp, tp] = Mesh.build(ParallelDims.for_world(dist.get_world_size(), pp=pp, tp=tp))
        out[case] = _llama_case(meshes[pp, tp], name=name, vp=vp, m=m, tied=tied, sp=sp, data_parallel=data_parallel)
    return out


def test_llama_split_backward_parity():
    results = run_distributed(_llama_worker, 4, timeout=240)
    refs = {}
    for case in LLAMA_CASES:
        pp, tp, sp, data_parallel, name, vp, m, tied = case
        if (tied, m) not in refs:
            refs[tied, m] = _llama_reference(tied, m)
        ref_losses, ref_grads = refs[tied, m]
        seen = set()
        for rank_out in results:
            r = rank_out[case]
            assert r["peak"] == r["predicted"], case
            assert r["losses"] == (pytest.approx(ref_losses, abs=1e-6, rel=0) if r["last"] else [])
            for n, g in r["grads"].items():
                ref = ref_grads["embedding.word_embeddings.weight" if n.endswith("(tied copy)") else n]
                if g.shape != ref.shape:  # vocab padding at tp=2 stays zero
                    assert not g[ref.shape[0]:].any(), n
                    g = g[:ref.shape[0]]
                torch.testing.assert_close(g, ref, atol=1e-6, rtol=0, msg=lambda msg: f"{case} {n}: {msg}")
                seen.add(n)
        assert seen >= set(ref_grads), case


# -- the trainer: parallel.schedule='zb-h1' at pp=2 x dp=2 trains like one process ----------------------------------

def _engine_zb_h1(steps):
    from tests.engine.test_assembly import HF, _cfg, _run
    cfg = _cfg(mbs=1, gbs=4, steps=steps, extra=["parallel.pp=2", "parallel.schedule=zb-h1"])
    run = _run(cfg, {**HF, "num_hidden_layers": 4}, n=4 * (steps + 1))
    losses = [run.trainer.train_step(run.train_loader).loss for _ in range(steps)]
    return losses + [run.trainer.evaluate(run.train_loader, 1)]


def test_trainer_runs_zb_h1_like_one_process():
    from tests.engine.test_assembly import HF, _cfg, _losses
    steps = 2
    ref = _losses(_cfg(mbs=1, gbs=4, steps=steps), {**HF, "num_hidden_layers": 4})
    for losses in run_distributed(_engine_zb_h1, 4, steps, timeout=300):
        assert max(abs(a - b) for a, b in zip(losses, ref)) < 1e-5, (losses, ref)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_split_backward_under_activation_recompute(recompute):
    """The recompute inside B builds the same deferrable linears: 9 GEMMs queued (4 per layer + the
    output layer), and after W every gradient equals the plain backward's bit for bit."""
    from models import build_model
    from parallel.tensor_parallel import wgrad
    from tests.models.tiny import config

    def model(**kw):
        return build_model(config("llama", num_hidden_layers=2, tie_word_embeddings=False),
                           tp_group=Group.trivial("tp"), seed=1, **kw)

    ours, ref = model(recompute=recompute), model()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    with wgrad.deferrable():
        loss = ours(ids, labels=ids).mean()
    q = wgrad.WgradQueue()
    with wgrad.capture(q):
        loss.backward()
    assert len(q) == 9
    q.run()
    ref(ids, labels=ids).mean().backward()
    for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad), n


def _launch_order(schedule: str):
    """pp2 x dp2, tiny Llama: the order of DataParallel's bucket reductions against finish_grad_sync (the
    optimizer's), and the case's gradients."""
    from parallel.data_parallel import ddp as D
    from parallel.mesh import Mesh, ParallelDims

    order, launch, finish = [], D.DataParallel._launch, D.DataParallel.finish_grad_sync

    def spy_launch(self, buf, b):
        order.append("bucket")
        return launch(self, buf, b)

    def spy_finish(self):
        order.append("finish")
        return finish(self)
    D.DataParallel._launch, D.DataParallel.finish_grad_sync = spy_launch, spy_finish
    try:
        mesh = Mesh.build(ParallelDims.for_world(dist.get_world_size(), pp=2, tp=1))
        _llama_case(mesh, name=schedule, vp=1, m=4, tied=False, sp=False, data_parallel=True)
    finally:
        D.DataParallel._launch, D.DataParallel.finish_grad_sync = launch, finish
    return order


def test_split_backward_reduces_buckets_under_the_schedule():
    """zb-h1: the norms, biases and embeddings get their last gradient in the last B, the linears' weights in the
    last W; once that W's weights arrive, the chunk's buckets reduce at once, under the rest of the schedule, as
    1F1B's do, not all after it in the optimizer's finish_grad_sync (before 2026-11-28)."""
    for order in run_distributed(_launch_order, 4, "zb-h1", timeout=180):
        assert "bucket" in order and order.index("bucket") < order.index("finish"), order
