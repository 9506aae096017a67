"""Activation recompute (``build_model(recompute=...)``, docs/memory.md) changes nothing but memory.

* Bitwise: none, selective, full and full with ``recompute_num_layers=1`` give equal losses and every
  gradient, fp32 with dropout on (attention dropout everywhere; residual and embedding dropout on
  GPT-2), over two micro-batches (the RNG streams advance between them), single process for Llama
  and GPT-2, and in one 4-rank gloo run at TP2+SP x PP2 (1F1B) and PP2 x VP2 (interleaved, dp=2).
  The recompute really runs (core attention is called twice per layer) and leaves the RNG streams
  where the plain run leaves them.
* Also on the Triton kernels (interpreted on CPU) with the fused linear + cross-entropy.
* Memory: the bytes one layer's forward saves for backward (saved-tensor hooks, unique storages,
  only storages the forward created: parameters and the stage's shared rope tables excluded) equal
  docs/memory.md's formulas exactly, Llama and GPT-2 blocks, at TP=1 (two sequence lengths) and on
  every rank at TP=2 and TP=4 with and without SP; so full < selective < none, and under full they
  are exactly the layer input's bytes.
* Off without autograd: under ``torch.no_grad`` and with a KV cache the recompute never runs.
"""
from __future__ import annotations

import gc
import itertools

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import models.attention as attention_module
from models import build_model
from models.attention import AttentionMasks
from parallel.comm import Group
from parallel.testing import run_distributed
from tests.models.tiny import config

B, S, SEED, VOCAB = 2, 8, 7, 100
MODES = (("none", None), ("selective", None), ("full", None), ("full", 1))


def _config(family: str, **kw) -> dict:
    if family == "gpt2":
        return config("gpt2", attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1, **kw)
    return config(family, attention_dropout=0.1, **kw)


def _batches(m: int):
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, VOCAB, (B, S), generator=g), torch.randint(0, VOCAB, (B, S), generator=g))
            for _ in range(m)]


class _CountCoreAttention:
    """Counts calls of models.attention.core_attention (the recompute calls it again)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        inner = attention_module.core_attention

        def counted(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)
        monkeypatch.setattr(attention_module, "core_attention", counted)


def _single_process(family: str, recompute: str, num_layers: int | None):
    torch.manual_seed(SEED)
    model = build_model(_config(family), tp_group=Group.trivial("tp"), seed=SEED, recompute=recompute,
                        recompute_num_layers=num_layers)
    model.train()
    losses = []
    for ids, labels in _batches(2):
        loss = model(ids, labels=labels).mean()
        loss.backward()
        losses.append(loss.detach())
    return (torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters()},
            torch.get_rng_state(), model.rng.get_states())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_recompute_is_bitwise_identical_single_process(family, monkeypatch):
    counter = _CountCoreAttention(monkeypatch)
    ref_losses, ref_grads, ref_rng, ref_tracker = _single_process(family, "none", None)
    layers = _config(family).get("n_layer", _config(family).get("num_hidden_layers"))
    assert counter.calls == 2 * layers  # two micro-batches, one call per layer
    for recompute, n in MODES[1:]:
        counter.calls = 0
        losses, grads, rng, tracker = _single_process(family, recompute, n)
        recomputed = layers if n is None else n
        assert counter.calls == 2 * (layers + recomputed), (recompute, n)
        assert torch.equal(losses, ref_losses), (recompute, n)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            assert torch.equal(g, ref_grads[name]), (recompute, n, name)
        assert torch.equal(rng, ref_rng), "the recompute advanced the default generator"
        assert all(torch.equal(tracker[k], ref_tracker[k]) for k in ref_tracker), "tracker streams advanced"


def test_recompute_on_the_triton_kernels_and_the_fused_cross_entropy():
    """kernels="triton" (Triton's interpreter on CPU: RMSNorm + residual, SwiGLU, RoPE) and the fused
    linear + cross-entropy, one micro-batch: selective and full equal none bitwise."""
    ids, labels = _batches(1)[0]
    ref = None
    for recompute in ("none", "selective", "full"):
        torch.manual_seed(SEED)
        model = build_model(_config("llama"), tp_group=Group.trivial("tp"), seed=SEED, recompute=recompute,
                            kernels="triton", fused_cross_entropy=True)
        loss = model(ids, labels=labels).mean()
        loss.backward()
        got = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
        if ref is None:
            ref = got
            continue
        assert torch.equal(got[0], ref[0]), recompute
        for name, g in got[1].items():
            assert torch.equal(g, ref[1][name]), (recompute, name)


def test_no_recompute_without_autograd_or_with_a_kv_cache(monkeypatch):
    counter = _CountCoreAttention(monkeypatch)
    model = build_model(_config("llama"), tp_group=Group.trivial("tp"), seed=SEED, recompute="full")
    ids = _batches(1)[0][0]
    with torch.no_grad():
        plain = model(ids)
    assert counter.calls == 2
    model.eval()
    cache = model.new_kv_cache(batch=B, max_len=S)
    positions = torch.arange(S).expand(B, S)
    cached = model(ids, position_ids=positions, kv_cache=cache)  # grad mode on: the cache path never checkpoints
    assert counter.calls == 4
    ref = build_model(_config("llama"), tp_group=Group.trivial("tp"), seed=SEED).eval()
    assert torch.equal(cached, ref(ids, position_ids=positions, kv_cache=ref.new_kv_cache(batch=B, max_len=S)))
    assert plain.shape == cached.shape


def test_recompute_options_are_validated():
    from engine.config.sections import RECOMPUTE as CONFIG_CHOICES
    from models.transformer import RECOMPUTE

    assert CONFIG_CHOICES == RECOMPUTE  # the config lists the model's modes (engine/ cannot import models/)
    with pytest.raises(ValueError, match="recompute='partial' is not valid"):
        build_model(_config("llama"), tp_group=Group.trivial("tp"), recompute="partial")
    with pytest.raises(ValueError, match="applies to full recompute only"):
        build_model(_config("llama"), tp_group=Group.trivial("tp"), recompute="selective", recompute_num_layers=1)
    with pytest.raises(ValueError, match="must be an int >= 1"):
        build_model(_config("llama"), tp_group=Group.trivial("tp"), recompute="full", recompute_num_layers=0)


# -- saved bytes of one layer ---------------------------------------------------------------------------

class _Created(TorchDispatchMode):
    """Weak references to the storage of every tensor an op creates under this mode."""

    def __init__(self):
        super().__init__()
        self.cdata: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.cdata.add(StorageWeakRef(t.untyped_storage()).cdata)
        return out


def layer_saved_bytes(family: str, recompute: str, *, seq: int = 16, batch: int = 2, tp_group: Group | None = None,
                      sp: bool = False, dropout: bool = True) -> tuple[int, int]:
    """(bytes one training-mode layer's forward saves for backward, bytes of its input): unique
    storages packed by saved-tensor hooks that the forward itself created, parameters excluded (so
    neither weights nor the rope tables shared by all layers of a stage). The input is made inside the
    forward."""
    tp_group = tp_group or Group.trivial("tp")
    model = build_model(_config(family) if dropout else config(family), tp_group=tp_group, sequence_parallel=sp,
                        seed=SEED, recompute=recompute)
    model.train()
    layer = model.layers["0"]
    s_local = seq // tp_group.size if sp else seq
    x0 = torch.randn(s_local, batch, model.config.hidden_size, requires_grad=True)  # (s, b, h) or (s/tp, b, h)
    rope = model._rope(torch.arange(seq).unsqueeze(0))
    masks = AttentionMasks(seq_len=seq, doc_ids=None, device="cpu")
    layer(x0, rope=rope, masks=masks).sum().backward()  # builds the cached rope tables outside the count
    saved: dict[int, int] = {}
    keep = []  # the packed tensors stay alive until counted, so storage ids are not reused

    def pack(t):
        st = t.untyped_storage()
        saved[StorageWeakRef(st).cdata] = st.nbytes()
        keep.append(t)
        return t

    created = _Created()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), created:
        x = x0 * 1.0  # (s, b, h): the layer input, created here (a scalar mul saves nothing)
        y = layer(x, rope=rope, masks=masks)
    # A linear saves its weight's transpose: a view of the parameter, created by the forward, but no
    # activation (and kept anyway): parameter storages are left out.
    params = {StorageWeakRef(p.untyped_storage()).cdata for p in model.parameters()}
    total = sum(n for cdata, n in saved.items() if cdata in created.cdata and cdata not in params)
    del y
    keep.clear()
    gc.collect()
    return total, x.numel() * x.element_size()


def formula_saved_bytes(family: str, recompute: str, *, s: int, b: int, tp: int = 1, sp: bool = False,
                        elem: int = 4, dropout: bool = True) -> int:
    """docs/memory.md's per-layer saved bytes on one TP rank: the library's formula
    (engine.memory.layer_saved_bytes, which the start-up memory report uses) for the tiny config, with
    dropout on (SDPA's math path on CPU) or off (its flash path)."""
    from engine.memory import LayerShape, layer_saved_bytes
    from models.registry import config_from_hf

    shape = LayerShape.of(config_from_hf(_config(family) if dropout else config(family)))
    return layer_saved_bytes(shape, s=s, b=b, tp=tp, sp=sp, recompute=recompute, elem=elem)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("seq", [16, 32])
def test_recompute_saves_memory_as_the_formula_says_at_tp1(family, seq):
    measured = {}
    for recompute in ("none", "selective", "full"):
        measured[recompute], x_bytes = layer_saved_bytes(family, recompute, seq=seq)
        assert measured[recompute] == formula_saved_bytes(family, recompute, s=seq, b=2), (recompute, measured)
    assert measured["full"] == x_bytes  # only the layer input (torch's checkpoint saves its tensor arguments)
    assert measured["full"] < measured["selective"] < measured["none"]


# -- pipelines: TP2+SP x PP2 and PP2 x VP2 --------------------------------------------------------------

PIPE_LAYERS, HIDDEN = 4, 64
# (pp, tp, sp, schedule, vp, family)
PIPE_CASES = [(2, 2, True, "1f1b", 1, "gpt2"), (2, 2, True, "1f1b", 1, "llama"),
              (2, 1, False, "interleaved", 2, "llama")]


def _pipeline_run(mesh, *, schedule_name, vp, family, sp, recompute, num_layers, m=2):
    from parallel.pipeline import build_schedule
    from parallel.pipeline.runtime import run_schedule

    pp, pp_rank, tp = mesh.dims.pp, mesh.coords["pp"], mesh.tp
    num_stages = pp * vp
    per_stage = PIPE_LAYERS // num_stages
    mine = [s for s in range(num_stages) if s % pp == pp_rank]
    last = num_stages - 1
    cfg = _config(family, **({"n_layer": PIPE_LAYERS} if family == "gpt2" else {"num_hidden_layers": PIPE_LAYERS}))
    torch.manual_seed(SEED + 100 * pp_rank)  # Megatron's seeding: stages differ, TP ranks agree
    chunks = [build_model(cfg, tp_group=tp, sequence_parallel=sp, pre_process=s == 0, post_process=s == last,
                          layer_range=(s * per_stage, (s + 1) * per_stage), seed=SEED,
                          recompute=recompute, recompute_num_layers=num_layers) for s in mine]
    data = _batches(m)

    def forward_step(chunk, x, mb):
        stage = mine[chunk]
        ids, labels = data[mb]
        if stage == last:
            return chunks[chunk](ids if stage == 0 else x, labels=labels).mean()
        return chunks[chunk](ids if stage == 0 else x)

    act_shape = (S // tp.size if sp else S, B, HIDDEN)
    res = run_schedule(build_schedule(schedule_name, pp=pp, vp=vp, microbatches=m), rank=pp_rank,
                       pp_group=mesh.pp, forward_step=forward_step, act_shape=act_shape, dtype=torch.float32)
    grads = {f"{c}.{n}": p.grad.clone() for c, chunk in enumerate(chunks) for n, p in chunk.named_parameters()}
    return [float(v) for v in res.losses], grads


def _dist_worker():
    import torch.distributed as dist

    from parallel.mesh import Mesh, ParallelDims

    meshes, out = {}, {}
    for tp in (2, 4):  # saved bytes per layer on each TP rank (the test compares with the formula)
        mesh = Mesh.build(ParallelDims.for_world(dist.get_world_size(), tp=tp))
        for family, sp, recompute in itertools.product(("llama", "gpt2"), (False, True), ("none", "selective", "full")):
            out["saved", tp, family, sp, recompute] = layer_saved_bytes(family, recompute, seq=16, tp_group=mesh.tp,
                                                                       sp=sp)
    for case in PIPE_CASES:
        pp, tp, sp, name, vp, family = case
        if (pp, tp) not in meshes:
            meshes[pp, tp] = Mesh.build(ParallelDims.for_world(dist.get_world_size(), pp=pp, tp=tp))
        for recompute, n in MODES:
            out[case, recompute, n] = _pipeline_run(meshes[pp, tp], schedule_name=name, vp=vp, family=family,
                                                    sp=sp, recompute=recompute, num_layers=n)
    return out


def _case_id(case):
    pp, tp, sp, name, vp, family = case
    return f"{family}-pp{pp}-tp{tp}{'-sp' if sp else ''}-{name}-v{vp}"


@pytest.fixture(scope="module")
def dist_results():
    return run_distributed(_dist_worker, 4, timeout=180)


@pytest.mark.parametrize("case", PIPE_CASES, ids=_case_id)
def test_recompute_is_bitwise_identical_in_pipelines(dist_results, case):
    for rank, out in enumerate(dist_results):
        ref_losses, ref_grads = out[case, "none", None]
        for recompute, n in MODES[1:]:
            losses, grads = out[case, recompute, n]
            assert losses == ref_losses, (rank, recompute, n)  # floats: bitwise
            assert grads.keys() == ref_grads.keys()
            for name, g in grads.items():
                assert torch.equal(g, ref_grads[name]), (rank, recompute, n, name)
    assert any(out[case, "none", None][0] for out in dist_results)  # the last stage reported losses


# -- wiring: run config -> ModelHook -> stage --------------------------------------------------------------

def test_run_config_reaches_the_layers():
    from types import SimpleNamespace

    from engine.config import load_config
    from models.hook import ModelHook

    cfg = load_config("tiny_llama_cpu", ["train.activation_checkpointing=full", "train.recompute_num_layers=1"])
    hook = ModelHook.from_run_config(cfg, tokenizer_vocab=None)
    assert (hook.recompute, hook.recompute_num_layers) == ("full", 1)
    stage = hook.build_stage(SimpleNamespace(tp=Group.trivial("tp")), pre_process=True, post_process=False,
                             layer_range=(1, 3))
    assert [layer.recompute for layer in stage.layers.values()] == [True, False]  # the stage's first layer
    cfg = load_config("tiny_llama_cpu", ["train.activation_checkpointing=selective"])
    stage = ModelHook.from_run_config(cfg, tokenizer_vocab=None).build_stage(
        SimpleNamespace(tp=Group.trivial("tp")), pre_process=True, post_process=True, layer_range=(0, 2))
    assert all(layer.attention.recompute_core_attention and not layer.recompute for layer in stage.layers.values())
    n = cfg.model.num_layers
    with pytest.raises(ValueError, match=f"train.recompute_num_layers={n + 1} exceeds the model's {n} layers"):
        ModelHook.from_run_config(load_config("tiny_llama_cpu", ["train.activation_checkpointing=full",
                                                                 f"train.recompute_num_layers={n + 1}"]),
                                  tokenizer_vocab=None)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_saved_bytes_equal_the_formula_under_tensor_parallelism(dist_results, tp, family, sp):
    measured = {}
    for rank, out in enumerate(dist_results):
        for recompute in ("none", "selective", "full"):
            got, x_bytes = out["saved", tp, family, sp, recompute]
            assert got == formula_saved_bytes(family, recompute, s=16, b=2, tp=tp, sp=sp), (rank, recompute, got)
            measured[recompute] = got
        assert measured["full"] == x_bytes  # (s/tp, b, h) with SP
        assert measured["full"] < measured["selective"] < measured["none"]
