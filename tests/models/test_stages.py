"""Single-process model checks: pipeline stages, packed documents, Hugging Face key loading/export
(sharding simulated per rank: loading never communicates), lazy reads, and load errors.

Tolerances: fp32; stage chaining and packing compare within atol 1e-6 (same ops, different
batching), loaded shards exactly.
"""
from __future__ import annotations

import pytest
import torch

from models import SafetensorsState, build_model, export_hf_from_shards, export_hf_state_dict, load_hf_state_dict
from parallel.comm import Group
from parallel.tensor_parallel import unshard_tensors
from tests.models.test_config import fake_group
from tests.models.tiny import config

TP1 = Group.trivial("tp")


def _params(m):
    return dict(m.named_parameters())


@pytest.mark.parametrize("name", ["gpt2", "qwen2"])  # both tied: the last stage holds a shared copy
def test_pipeline_stages_equal_full_model(name):
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    full = build_model(config(name), tp_group=TP1, seed=3)
    first = build_model(config(name), tp_group=TP1, seed=3, post_process=False, layer_range=(0, 1))
    last = build_model(config(name), tp_group=TP1, seed=3, pre_process=False, layer_range=(1, 2))
    # The stages' weights are the full model's (name-seeded init), the tied copy included.
    pf = _params(full)
    for stage in (first, last):
        for n, p in stage.named_parameters():
            src = "embedding.word_embeddings.weight" if n == "output_layer.weight" else n
            assert torch.equal(p, pf[src]), n
    # Megatron's marks: both copies shared_embedding (their gradients are summed over the embedding
    # group); only the replica is `shared` (counted once in the gradient norm). One stage: no marks.
    assert last.output_layer.weight.shared_embedding and first.embedding.word_embeddings.weight.shared_embedding
    assert last.output_layer.weight.shared and not getattr(first.embedding.word_embeddings.weight, "shared", False)
    assert not any(getattr(p, "shared_embedding", False) for p in full.parameters())
    assert last.output_layer.weight is not first.embedding.word_embeddings.weight
    loss = full(ids, labels=labels)
    loss.sum().backward()
    hidden = first(ids)
    assert hidden.shape == (8, 2, 64)
    h_in = hidden.detach().requires_grad_()
    loss2 = last(h_in, labels=labels)
    loss2.sum().backward()
    hidden.backward(h_in.grad)
    torch.testing.assert_close(loss2, loss, atol=1e-6, rtol=0)
    for n, p in first.named_parameters():
        g = p.grad
        if n == "embedding.word_embeddings.weight":  # the runtime all-reduces the shared copies
            g = g + last.output_layer.weight.grad
        torch.testing.assert_close(g, pf[n].grad, atol=1e-6, rtol=0, msg=n)
    for n, p in last.named_parameters():
        if n != "output_layer.weight":
            torch.testing.assert_close(p.grad, pf[n].grad, atol=1e-6, rtol=0, msg=n)


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2"])
def test_packed_documents_equal_separate_sequences(name):
    """Three documents packed in one row attend only within themselves (position_ids restart or
    cu_seqlens) and give the per-token logits of running each alone; mistral adds its window of 5."""
    lengths = (7, 3, 6)
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 100, (1, n), generator=g) for n in lengths]
    m = build_model(config(name), tp_group=TP1).eval()
    with torch.no_grad():
        alone = torch.cat([m(d) for d in docs], dim=1)
        packed_ids = torch.cat(docs, dim=1)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        by_pos = m(packed_ids, position_ids=pos)
        cu = torch.tensor([0, 7, 10, 16])
        by_cu = m(packed_ids, cu_seqlens=cu)
        causal_only = m(packed_ids)
    torch.testing.assert_close(by_pos, alone, atol=1e-6, rtol=0)
    torch.testing.assert_close(by_cu, alone, atol=1e-6, rtol=0)
    assert (causal_only[:, 7:] - alone[:, 7:]).abs().max() > 1e-3  # the mask matters


def test_dropout_rng_states_reproduce_a_step():
    m = build_model(config("gpt2", attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1), tp_group=TP1)
    ids = torch.randint(0, 100, (2, 8))
    torch.manual_seed(5)
    states = m.rng.get_states()
    default = torch.get_rng_state()
    a = m(ids, labels=ids)
    b = m(ids, labels=ids)
    assert not torch.equal(a, b)  # dropout is on
    torch.set_rng_state(default)
    m.rng.set_states(states)
    assert torch.equal(m(ids, labels=ids), a)
    assert torch.equal(m.eval()(ids, labels=ids), m(ids, labels=ids))  # eval: no dropout


class RecordingState(SafetensorsState):
    """Counts full-tensor reads separately from lazy slices."""

    def __init__(self, path):
        super().__init__(path)
        self.full_reads: set[str] = set()

    def __getitem__(self, key):
        self.full_reads.add(key)
        return super().__getitem__(key)


def _hf_files(name, tmp_path):
    """A Hugging Face-named safetensors file of the family's tiny model (written by our exporter)."""
    from safetensors.torch import save_file

    ref = build_model(config(name), tp_group=TP1, seed=11)
    for p in ref.parameters():  # non-trivial norms and biases
        torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(p.numel()))
        if p.shape[0] == ref.padded_vocab_size:
            p.data[100:] = 0  # padded vocab rows stay zero
    hf = export_hf_state_dict(ref)
    path = tmp_path / f"{name}.safetensors"
    save_file(hf, str(path))
    return ref, hf, path


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "qwen3", "mistral"])
def test_load_shards_and_export_roundtrip(name, tmp_path):
    """Each simulated TP rank loads its slices lazily; the shards equal the TP=1 weights sharded
    (qkv groups, [gate_r | up_r], padded vocab), and export from the shards restores the file."""
    ref, hf, path = _hf_files(name, tmp_path)
    tp = 2
    shards = []
    for rank in range(tp):
        m = build_model(config(name), tp_group=fake_group(tp, rank))
        src = RecordingState(path)
        load_hf_state_dict(m, src, tp_rank=rank, tp_size=tp)
        # Only replicated tensors (norms, biases, positions) are read whole.
        for key in src.full_reads:
            assert key.endswith(("norm.weight", "layernorm.weight", "ln_1.weight", "ln_1.bias", "ln_2.weight",
                                 "ln_2.bias", "ln_f.weight", "ln_f.bias", "o_proj.bias", "c_proj.bias",
                                 "down_proj.bias", "wpe.weight")), key
        shards.append({n: p.detach() for n, p in m.named_parameters()})
    for n, p in ref.named_parameters():
        got = [s[n] for s in shards]
        if getattr(p, "tensor_parallel", False):
            full = unshard_tensors(got, dim=p.partition_dim, stride=p.partition_stride)
            rows = min(full.shape[0], p.shape[0])  # vocab padding differs between TP sizes
            assert torch.equal(full[:rows], p.detach()[:rows]), n
            assert not full[rows:].any()
        else:
            assert all(torch.equal(g, p.detach()) for g in got), n
    back = export_hf_from_shards(config(name), shards)
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_stage_reads_only_its_tensors(tmp_path):
    _, hf, path = _hf_files("llama", tmp_path)
    m = build_model(config("llama"), tp_group=TP1, pre_process=False, layer_range=(1, 2))
    src = SafetensorsState(path)
    load_hf_state_dict(m, src)
    assert src.reads and all(k.startswith("model.layers.1.") or k in ("model.norm.weight", "lm_head.weight")
                             for k in src.reads), sorted(src.reads)


def test_gpt2_unprefixed_keys_and_old_buffers_load():
    ref = build_model(config("gpt2"), tp_group=TP1, seed=4)
    hf = {k.removeprefix("transformer."): v for k, v in export_hf_state_dict(ref).items()}
    hf["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)  # buffers of the original OpenAI-converted files
    hf["lm_head.weight"] = hf["wte.weight"]  # a tied copy some files carry
    m = build_model(config("gpt2"), tp_group=TP1, seed=5)
    load_hf_state_dict(m, hf)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters()))


def test_load_errors():
    ref = build_model(config("llama"), tp_group=TP1)
    hf = export_hf_state_dict(ref)
    m = build_model(config("llama"), tp_group=TP1)
    missing = dict(hf)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing keys \(1\): \['model.layers.1.mlp.up_proj.weight'\]"):
        load_hf_state_dict(m, missing)
    extra = dict(hf, **{"model.layers.2.mlp.up_proj.weight": torch.zeros(1), "vision.x": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"unexpected keys \(2\)"):
        load_hf_state_dict(m, extra)
    wrong = dict(hf, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)})
    with pytest.raises(ValueError, match=r"k_proj.weight: file \(64, 64\), model expects \(32, 64\)"):
        load_hf_state_dict(m, wrong)
    with pytest.raises(ValueError, match="tp_size=2.*built with tp_size=1"):
        load_hf_state_dict(m, hf, tp_size=2)
    with pytest.raises(ValueError, match="layer_range"):
        load_hf_state_dict(m, hf, layer_range=(0, 1))
    with pytest.raises(ValueError, match="missing from the shard"):
        export_hf_from_shards(config("llama"), [{}])


def test_bf16_build_equals_cast_model():
    """dtype=bf16 builds the bf16 cast of the fp32 weights; a model cast with .to(bf16) recomputes RoPE
    frequencies in fp32 rather than using its cast buffer, so both give identical logits."""
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(3))
    built = build_model(config("llama"), tp_group=TP1, dtype=torch.bfloat16).eval()
    cast = build_model(config("llama"), tp_group=TP1).to(torch.bfloat16).eval()
    assert cast.inv_freq.dtype == torch.bfloat16 and built.inv_freq.dtype == torch.float32
    with torch.no_grad():
        a, b = built(ids), cast(ids)
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    loss = built.train()(ids, labels=ids)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
