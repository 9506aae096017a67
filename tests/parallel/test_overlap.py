"""Ring collective matmuls (parallel/tensor_parallel/overlap.py) against the plain sequence-parallel
path, on 4 gloo ranks at TP=2 (x DP 2) and TP=4.

Parity (fp32): the column-parallel forward output is bit for bit the plain path's (the same
products, nothing summed across ranks); every result that sums over ranks or over sequence chunks
(row-parallel output, input gradients, weight gradients) is within 1e-6 relative of the plain path's
(another summation order); at TP=2 the reduce-scatters add two terms (the same float in either
order), so the row output and the input gradient are bit for bit there too. Bytes: the ring moves
exactly the plain path's bytes on the tp axis, as tp - 1 sends of one (s/tp, b, h) chunk per ring:
3 rings for a column-parallel linear (forward gather, backward regather and reduce-scatter), 2 for a
row-parallel one. Rounds: a bidirectional ring needs tp // 2 rounds (batches of transfers, each
waited once), and the column backward's two rings share theirs: 4 (tp // 2) batches per linear pair.
"""
from __future__ import annotations

import pytest
import torch

from parallel.testing import run_distributed

S, B, H, F = 8, 2, 12, 20


def _layers(tp, impl, w1, w2, b1, b2):
    from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    col = ColumnParallelLinear(H, F, tp_group=tp, sequence_parallel=True, impl=impl, init_method=lambda t: t.copy_(w1))
    row = RowParallelLinear(F, H, tp_group=tp, sequence_parallel=True, impl=impl, init_method=lambda t: t.copy_(w2))
    with torch.no_grad():
        col.bias.copy_(b1.chunk(tp.size)[tp.rank])
        row.bias.copy_(b2)
    return col, row


def _run(tp, impl, x, dy, params):
    from parallel.flight import FlightRecorder

    col, row = _layers(tp, impl, *params)
    xi = x.clone().requires_grad_()
    tp.ledger.recorder = FlightRecorder(capacity=1024)  # to count the batches of transfers and the waits
    try:
        with tp.ledger.capture() as led:
            h = col(xi)
            y = row(torch.relu(h))
            (y * dy).sum().backward()
        flights = tp.ledger.recorder.snapshot()[0]
    finally:
        tp.ledger.recorder = None
    led.batches = sum(f.op == "batch_p2p" for f in flights)
    led.waits = sum(f.op == "wait" for f in flights)
    return {"h": h.detach(), "y": y.detach(), "dx": xi.grad, "dw1": col.weight.grad, "db1": col.bias.grad,
            "dw2": row.weight.grad, "db2": row.bias.grad}, led


def _worker():
    import torch.distributed as dist

    from parallel.mesh import Mesh, ParallelDims
    from parallel.tensor_parallel import DefaultLinearImpl
    from parallel.tensor_parallel.overlap import RingLinearImpl
    from parallel.tensor_parallel.symm_mem import SymmMemLinearImpl, reference_ops

    out = {}
    g = torch.Generator().manual_seed(3)
    x_full, dy_full = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    params = (torch.randn(F, H, generator=g), torch.randn(H, F, generator=g), torch.randn(F, generator=g),
              torch.randn(H, generator=g))
    for tp_size in (2, 4):
        mesh = Mesh.build(ParallelDims.for_world(dist.get_world_size(), tp=tp_size))
        tp = mesh.tp
        n = S // tp_size
        chunk = slice(tp.rank * n, (tp.rank + 1) * n)
        plain, led_plain = _run(tp, DefaultLinearImpl(), x_full[chunk], dy_full[chunk], params)
        ring, led_ring = _run(tp, RingLinearImpl(), x_full[chunk], dy_full[chunk], params)
        out[tp_size] = {
            "h_equal": torch.equal(plain["h"], ring["h"]),
            "equal": sorted(k for k in plain if torch.equal(plain[k], ring[k])),
            "batches": led_ring.batches, "waits": led_ring.waits,
            "rel": {k: ((ring[k] - plain[k]).abs().max() / plain[k].abs().max()).item() for k in plain},
            "plain_sent": led_plain.total("sent_bytes", axis="tp"),
            "ring_sent": led_ring.total("sent_bytes", axis="tp"),
            "ring_ops": sorted({r.op for r in led_ring.records if r.axis == "tp"}),
            "ring_sends": [r.payload_bytes for r in led_ring.records if r.op == "send" and r.axis == "tp"],
        }
        # symm_mem, through PyTorch's own unfused definitions of its two fused ops (the CUDA kernels need GPUs)
        symm, led_symm = _run(tp, SymmMemLinearImpl(reference_ops()), x_full[chunk], dy_full[chunk], params)
        out[tp_size]["symm"] = {
            "equal": sorted(k for k in plain if torch.equal(plain[k], symm[k])),
            "rel": {k: ((symm[k] - plain[k]).abs().max() / plain[k].abs().max()).item() for k in plain},
            "sent": led_symm.total("sent_bytes", axis="tp"),
            "calls": sorted((r.op, r.payload_bytes) for r in led_symm.records if r.axis == "tp"),
            "plain_calls": sorted((r.op, r.payload_bytes) for r in led_plain.records if r.axis == "tp"),
        }
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4, timeout=180)


@pytest.mark.parametrize("tp", [2, 4])
def test_ring_equals_plain_path(results, tp):
    for res in results:
        r = res[tp]
        assert r["h_equal"], r["rel"]
        assert max(r["rel"].values()) < 1e-6, r["rel"]
        if tp == 2:  # sums of two terms; only the weight gradients (accumulated over chunks) differ
            assert r["equal"] == ["db1", "db2", "dx", "h", "y"], r["rel"]


@pytest.mark.parametrize("tp", [2, 4])
def test_ring_moves_the_same_bytes_as_tp_minus_1_chunk_steps(results, tp):
    chunk_bytes = (S // tp) * B * H * 4  # one (s/tp, b, h) fp32 chunk (the column input and the row output)
    for res in results:
        r = res[tp]
        assert r["ring_sent"] == r["plain_sent"]
        assert r["ring_ops"] == ["recv", "send"]
        # column: gather x, regather x, reduce-scatter dx; row: reduce-scatter y, gather dy
        assert r["ring_sends"] == [chunk_bytes] * (5 * (tp - 1))
        # tp // 2 rounds per ring, the column backward's two rings in the same rounds: 4 rings' worth
        assert r["batches"] == r["waits"] == 4 * (tp // 2)


@pytest.mark.parametrize("tp", [2, 4])
def test_symm_mem_equals_plain_path_with_the_same_collectives(results, tp):
    """symm_mem's autograd, shapes and ledger, with PyTorch's reference definitions of the fused ops: the
    same outputs and gradients as the plain path (fp32; the reduce-scatter sums in the op's own order),
    and the same collectives with the same payloads, so the same tp bytes."""
    for rank, r in enumerate(results):
        s = r[tp]["symm"]
        assert max(s["rel"].values()) < 1e-6, (rank, s["rel"])
        assert {"h", "dw1", "db1", "db2"} <= set(s["equal"]), (rank, s["equal"])  # no sum across ranks there
        assert s["calls"] == s["plain_calls"] and s["sent"] == r[tp]["plain_sent"] > 0


def test_symm_mem_is_checked_against_the_device_before_any_process_group(monkeypatch):
    from engine.config import load_config
    from models.hook import ModelHook
    from parallel.tensor_parallel.overlap import check_tp_overlap

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU's answer, on any host
    cfg = load_config("tiny_llama_cpu", ["parallel.tp_overlap=symm_mem"])  # the config cannot know the device
    with pytest.raises(ValueError, match="symm_mem' needs CUDA GPUs with peer access.*use parallel.tp_overlap = 'ring'"):
        ModelHook.from_run_config(cfg, tokenizer_vocab=None)  # the run's checks know it: here the CPU
    with pytest.raises(ValueError, match="symm_mem' needs CUDA GPUs"):
        check_tp_overlap("symm_mem", tp=2, sequence_parallel=True, device_type="cpu")
    check_tp_overlap("symm_mem", tp=2, sequence_parallel=True, device_type="any")
    with pytest.raises(ValueError, match="needs parallel.tp >= 2"):
        check_tp_overlap("symm_mem", tp=1, sequence_parallel=True, device_type="cuda")


def test_symm_mem_with_fp8_is_refused_on_cuda(monkeypatch):
    from engine.config import load_config
    from models.hook import ModelHook

    # the checks only: nothing runs on a device (4 GPUs with peer access, 4 local ranks)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="model.fp8='tensorwise' with parallel.tp_overlap='symm_mem'.*'ring'"):
        cfg = load_config("tiny_llama_cpu", ["parallel.tp_overlap=symm_mem", "model.fp8=tensorwise"])
        ModelHook.from_run_config(cfg, tokenizer_vocab=None)


def test_symm_mem_needs_the_tp_group_on_one_node_with_peer_access():
    from parallel.tensor_parallel.symm_mem import check_platform

    check_platform(4, device_count=8, local_world=8, peer=lambda a, b: True)
    with pytest.raises(RuntimeError, match="must sit within one node: tp=8, but this node runs 4 ranks on 4 GPUs"):
        check_platform(8, device_count=4, local_world=4, peer=lambda a, b: True)
    with pytest.raises(RuntimeError, match="GPU 1 cannot access GPU 2's memory.*'ring'"):
        check_platform(4, device_count=4, local_world=4, peer=lambda a, b: {a, b} != {1, 2})


def test_bad_settings_are_refused_before_any_process_group():
    from engine.config import load_config

    with pytest.raises(ValueError, match="needs parallel.tp >= 2 and parallel.sequence_parallel = true"):
        load_config("tiny_llama_cpu", ["parallel.tp_overlap=ring", "parallel.sequence_parallel=false"])
    with pytest.raises(ValueError, match="not divisible by parallel.tp"):
        load_config("tiny_llama_cpu", ["parallel.tp_overlap=ring", "train.seq_length=127"])


class _Tokens:
    """Random token windows (b, s+1) -> the loader's dict; deterministic per index."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        import numpy as np

        ids = np.random.default_rng(7 + i).integers(0, 64, 17)
        return {"tokens": ids[:-1], "labels": ids[1:], "position_ids": np.arange(16),
                "loss_mask": np.ones(16, dtype=np.float32)}


def _model_worker(mode: str):
    """The whole model, TP2 x PP2 with SP (1F1B, 4 micro-batches), 3 steps: losses and final weights."""
    from engine.assembly import build_run
    from engine.config import load_config
    from models.hook import ModelHook

    hf = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 64,
          "tie_word_embeddings": False}
    cfg = load_config("tiny_llama_cpu", [
        "parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "parallel.sequence_parallel=true",
        f"parallel.tp_overlap={mode}", "train.steps=3", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.seq_length=16", "optim.lr=0.01", "optim.warmup_steps=0", "logging.progress_bar=off",
        "logging.tensorboard=false", "logging.jsonl=false", "logging.peak_tflops=1.0", "train.eval_interval=0"])
    model = ModelHook.from_hf(hf, dtype=torch.float32, seed=1, sequence_parallel=True, tp_overlap=mode)
    run = build_run(cfg, model=model, train_data=_Tokens(), checkpoints=False)
    losses = [run.trainer.train_step(run.train_loader).loss for _ in range(3)]
    return losses, {n: p.detach().clone() for n, p in run.trainer.chunks.named_parameters()}


@pytest.fixture(scope="module")
def plain_model():
    return run_distributed(_model_worker, 4, "none", timeout=180)


@pytest.mark.parametrize("mode", ["ring", "symm_mem"])
def test_whole_model_tp2_pp2_overlap_equals_plain(mode, plain_model):
    """Through the pipeline (1F1B, TP2 x PP2, SP), 3 optimizer steps: the losses of ring (and of symm_mem,
    on the CPU through PyTorch's reference definitions of its ops) equal the plain path's within 1e-6
    relative, the trained weights within 1e-4 absolute, 1% of one Adam step at lr 0.01 (fp32, summation
    order only; Adam normalises a near-zero gradient, so its rounding difference shows in the update at
    ~1e-5)."""
    plain = plain_model
    ring = run_distributed(_model_worker, 4, mode, timeout=180)
    for (lp, wp), (lr, wr) in zip(plain, ring):
        assert lr == pytest.approx(lp, rel=1e-6)
        for name in wp:
            torch.testing.assert_close(wr[name], wp[name], rtol=1e-5, atol=1e-4)


def _symm_mem_on_one_gpu():
    """On one GPU (a one-rank NCCL group): PyTorch's fused CUDA symm_mem ops through this module's autograd,
    against plain GEMMs. It checks that the real kernels run with these arguments, which operand is
    transposed and return_A; with one rank the gather and scatter dims cannot show (the gloo test covers
    them, with PyTorch's reference ops), and the overlap itself needs several GPUs."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from parallel.comm import Group, Ledger
    from parallel.tensor_parallel.symm_mem import _group_name, _SymmColumn, _SymmRow, cuda_ops

    torch.cuda.set_device(0)
    g = Group(axis="tp", ranks=[0], rank=0, pg=dist.group.WORLD, ledger=Ledger())
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return (torch.randn(*shape, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)

    # 4096 rows (> 2048): the ops' pipelined path, the one production shapes take (not the multicast one)
    x, w1, b1, w2, dy = randn(2048, 2, 512), randn(1024, 512), randn(1024), randn(512, 1024), randn(2048, 2, 512)
    outs = {}
    for name in ("symm_mem", "plain"):
        xi, w1i, b1i, w2i = (t.clone().requires_grad_() for t in (x, w1, b1, w2))
        if name == "symm_mem":
            gname = _group_name(g)
            y = _SymmRow.apply(F.silu(_SymmColumn.apply(xi, w1i, b1i, g, cuda_ops(), gname)), w2i, g, cuda_ops(),
                               gname)
        else:
            y = F.linear(F.silu(F.linear(xi, w1i, b1i)), w2i)
        (y.float() * dy.float()).sum().backward()
        outs[name] = {"y": y.detach(), "dx": xi.grad, "dw1": w1i.grad, "db1": b1i.grad, "dw2": w2i.grad}
    return {k: ((outs["symm_mem"][k].float() - outs["plain"][k].float()).abs().max()
                / outs["plain"][k].float().abs().max()).item() for k in outs["plain"]}


@pytest.mark.gpu
def test_symm_mem_cuda_ops_match_plain_gemms_on_one_gpu():
    rel = run_distributed(_symm_mem_on_one_gpu, 1, backend="nccl", timeout=60)[0]
    print(f"symm_mem vs plain, max |diff| / max |plain|: {rel}")
    assert max(rel.values()) < 1e-2, rel  # bf16: the same products, rounded in another order


def _symm_mem_split_backward():
    """tp2, symm_mem (reference ops): a backward inside a zero-bubble capture queues both weight-gradient
    GEMMs (B leaves the weights without gradients), and the W action's run gives the plain backward's."""
    import torch.distributed as dist

    from parallel.mesh import Mesh, ParallelDims
    from parallel.tensor_parallel.symm_mem import SymmMemLinearImpl, reference_ops
    from parallel.tensor_parallel.wgrad import WgradQueue, capture

    mesh = Mesh.build(ParallelDims.for_world(dist.get_world_size(), tp=2))
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(S // 2, B, H, generator=g), torch.randn(S // 2, B, H, generator=g)
    params = (torch.randn(F, H, generator=g), torch.randn(H, F, generator=g), torch.randn(F, generator=g),
              torch.randn(H, generator=g))
    grads, queued = [], None
    for split in (False, True):
        col, row = _layers(mesh.tp, SymmMemLinearImpl(reference_ops()), *params)
        queue = WgradQueue()
        with capture(queue) if split else torch.enable_grad():
            (row(torch.relu(col(x.clone().requires_grad_()))) * dy).sum().backward()
        if split:
            queued = (len(queue), col.weight.grad is None and row.weight.grad is None)
            queue.run()
        grads.append((col.weight.grad, row.weight.grad))
    return queued, all(torch.equal(a, b) for a, b in zip(*grads))


def test_symm_mem_defers_weight_gradients_to_the_w_action():
    for queued, equal in run_distributed(_symm_mem_split_backward, 2):
        assert queued == (2, True) and equal
