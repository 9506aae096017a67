"""engine/posttrain/generate.py and the KV-cache path of models/: cached logits equal a full forward's,
generation at TP2 x PP2 (sequence-parallel stages, two virtual stages per rank) equals one process,
seeded sampling agrees across ranks and repeats, and bad inputs are refused before any communication.
(tests/tools/test_generate.py compares tools/generate.py with transformers' generate.)"""
from __future__ import annotations

import pytest
import torch

from tests.models import tiny

PROMPTS = [[5, 17, 3, 99, 42, 8, 60, 2], [11, 12, 13], [7, 1, 4, 4, 9]]
CACHE_ATOL = 1e-5  # fp32 cached logits vs a full forward's (observed ~1e-6)


def _stage(family: str, **kw):
    from models import build_model

    return build_model(tiny.config(family, **kw.pop("hf", {})), tp_group=None, dtype=torch.float32, seed=7,
                       **kw).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "mistral"])
@torch.no_grad()
def test_cached_logits_equal_full_forward(family):
    """Right-padded prefill of three prompts of different lengths, then four one-token steps: each
    row's logits equal those of its unpadded sequence through the training forward (Mistral's window
    of 5 is shorter than the sequences; GPT-2 uses learned positions; Qwen3 its q/k norm)."""
    stage = _stage(family)
    b, longest, steps = len(PROMPTS), max(map(len, PROMPTS)), 4
    cache = stage.new_kv_cache(batch=b, max_len=longest + steps)
    assert cache.k[0].shape == (b, longest + steps, stage.config.num_kv_heads, stage.config.head_dim)
    tokens = torch.zeros(b, longest, dtype=torch.int64)  # (b, s) right-padded with 0
    for i, p in enumerate(PROMPTS):
        tokens[i, :len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in PROMPTS])
    seqs = [list(p) for p in PROMPTS]
    logits = stage(tokens, position_ids=torch.arange(longest).expand(b, longest), kv_cache=cache,
                   logits_index=lengths - 1)  # (b, 1, V_local)
    for t in range(steps + 1):
        for i, seq in enumerate(seqs):
            full = stage(torch.tensor([seq]))[0, -1]  # (V_local,) the no-cache forward's last position
            torch.testing.assert_close(logits[i, 0], full, atol=CACHE_ATOL, rtol=0, msg=f"{family} row {i} step {t}")
        if t == steps:
            break
        new = (logits[:, 0, :stage.config.vocab_size].argmax(-1) + 3 * t) % stage.config.vocab_size  # any ids
        for i, seq in enumerate(seqs):
            seq.append(int(new[i]))
        logits = stage(new.unsqueeze(1), position_ids=(lengths + t).unsqueeze(1), kv_cache=cache,
                       logits_index=torch.zeros(b, dtype=torch.int64))


def test_sample_tokens():
    from engine.posttrain.generate import sample_tokens

    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    assert sample_tokens(logits, temperature=0.0, top_p=1.0, generator=None).tolist() == [1, 0]  # first maximum
    many = logits.repeat(500, 1)  # (1000, 4)

    def draw(seed, **kw):
        return sample_tokens(many, generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(draw(3, temperature=1.0, top_p=1.0), draw(3, temperature=1.0, top_p=1.0))
    assert not torch.equal(draw(3, temperature=1.0, top_p=1.0), draw(4, temperature=1.0, top_p=1.0))
    assert set(draw(3, temperature=1.0, top_p=1.0)[0::2].tolist()) == {0, 1, 2, 3}
    # Row 0's probabilities: 0.04, 0.42, 0.12 (rounded), 0.42; top_p 0.5 keeps the two tied leaders.
    assert set(draw(3, temperature=1.0, top_p=0.5)[0::2].tolist()) == {1, 3}
    assert set(draw(3, temperature=1.0, top_p=1e-6)[1::2].tolist()) == {0}  # the leader always stays
    assert set(draw(3, temperature=1e-3, top_p=1.0)[1::2].tolist()) == {0}


def _distributed_generate(hf: dict, prompts, stop: int) -> dict:
    from engine.posttrain.generate import generate
    from models import build_model
    from parallel.mesh import Mesh, ParallelDims
    from parallel.pipeline.split import split_layers

    mesh = Mesh.build(ParallelDims(tp=2, pp=2))
    pp, r = 2, mesh.coords["pp"]

    def chunks(vp: int, dtype):
        ranges = split_layers(4, pp * vp)
        return [build_model(hf, tp_group=mesh.tp, sequence_parallel=True, pre_process=s == 0,
                            post_process=s == pp * vp - 1, layer_range=ranges[s], dtype=dtype, seed=7).train()
                for s in range(r, pp * vp, pp)]

    fp32 = chunks(2, torch.float32)  # two virtual stages per rank, built with SP, in train mode
    flags = [m.sequence_parallel for c in fp32 for m in c.modules() if hasattr(m, "sequence_parallel")]
    out = {"greedy": generate(fp32, mesh=mesh, prompts=prompts, max_new_tokens=6),
           "stopped": generate(fp32, tp_group=mesh.tp, pp_group=mesh.pp, prompts=prompts, max_new_tokens=6,
                               stop_tokens=[stop])}
    with mesh.ledger.capture() as cap:
        out["sampled"] = [generate(fp32, mesh=mesh, prompts=prompts, max_new_tokens=6, temperature=1.0,
                                   top_p=0.9, seed=s) for s in (1, 1, 2)]
    out["pp_sends"] = cap.count(op="send", axis="pp")
    out["restored"] = (all(m.training for c in fp32 for m in c.modules())
                       and flags == [m.sequence_parallel for c in fp32 for m in c.modules()
                                     if hasattr(m, "sequence_parallel")] and all(flags))
    bf16 = chunks(1, torch.bfloat16)
    out["bf16"] = generate(bf16, mesh=mesh, prompts=prompts, max_new_tokens=6)
    out["bf16_cache"] = str(bf16[0].new_kv_cache(batch=1, max_len=2).k[int(next(iter(bf16[0].layers)))].dtype)
    return out


def test_generate_tp2_pp2_sequence_parallel_interleaved_equals_one_process():
    """TP2 x PP2 with vp=2 (4 virtual stages of a 4-layer Llama), stages built with SP and left in train
    mode: greedy continuations equal one process's; a stop token cuts each row after it; seeded sampling
    is the same on every rank and repeats; SP flags and modes come back; bf16 runs."""
    from engine.posttrain.generate import generate
    from models import build_model
    from parallel.testing import run_distributed

    hf = tiny.config("llama", num_hidden_layers=4)
    ref_model = build_model(hf, tp_group=None, dtype=torch.float32, seed=7)
    ref = generate(ref_model, prompts=PROMPTS, max_new_tokens=6)
    stop = ref[1][2]  # the third token of prompt 1's continuation
    results = run_distributed(_distributed_generate, 4, hf, PROMPTS, stop, timeout=120)
    sends = [res.pop("pp_sends") for res in results]
    assert all(res == results[0] for res in results)  # every rank returns the same tokens
    res = results[0]
    assert res["greedy"] == ref and [len(c) for c in ref] == [6, 6, 6]
    for got, full in zip(res["stopped"], ref):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert got == full[:cut]
    assert len(res["stopped"][1]) <= 3
    first, again, other = res["sampled"]
    assert first == again and first != other
    # Per step, each of the 2 pipeline boundaries of a rank pair (stage 0->1, 2->3 on rank 0; 1->2 on
    # rank 1) sends one hidden state: rank 0 sends twice per step, rank 1 once; 3 runs of 6 steps.
    assert sends == [3 * 6 * 2, 3 * 6 * 2, 3 * 6, 3 * 6]  # ranks 0, 1 are pp rank 0 (tp innermost)
    assert res["restored"]
    assert res["bf16_cache"] == "torch.bfloat16"
    assert [len(c) for c in res["bf16"]] == [6, 6, 6] and all(0 <= t < 100 for c in res["bf16"] for t in c)


def test_generate_refuses_bad_input_before_communicating():
    """Errors come from local checks only: the pipeline group below is a stand-in of 2 ranks without a
    process group, so any collective would fail differently."""
    from engine.posttrain.generate import generate
    from parallel.comm import Group, Ledger

    pp_group = Group(axis="pp", ranks=range(2), rank=0, pg=object(), ledger=Ledger())
    first = _stage("llama", post_process=False, layer_range=(0, 1))  # stage 0 of 2; 128 positions, vocab 100
    ok = dict(prompts=PROMPTS, max_new_tokens=4)
    cases = [
        (dict(prompts=[]), "prompts must be a non-empty list"),
        (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
        (dict(prompts=[[1, 100]]), r"prompt 0: ids \[100\] lie outside the vocabulary \[0, 100\)"),
        (dict(prompts=[["a"]]), "non-integer ids"),
        (dict(prompts=[list(range(100))], max_new_tokens=29), r"\(100 tokens\) \+ max_new_tokens=29 exceeds the "
                                                               "model's 128 positions"),
        (dict(max_new_tokens=0), "max_new_tokens=0 must be an integer >= 1"),
        (dict(stop_tokens=[3, 100]), r"stop token\(s\) \[100\] lie outside the vocabulary"),
        (dict(temperature=-1.0), "temperature=-1.0 must be a finite number >= 0"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(pad_id=100), r"pad_id=100 must be a token id in \[0, 100\)"),
    ]
    for change, msg in cases:
        with pytest.raises(ValueError, match=msg):
            generate(first, pp_group=pp_group, **{**ok, **change})
    last = _stage("llama", pre_process=False, layer_range=(1, 2))
    with pytest.raises(ValueError, match=r"virtual stage 0 of 2 .* should have pre_process=True"):
        generate(last, pp_group=pp_group, **ok)
    with pytest.raises(ValueError, match="either mesh= or tp_group="):
        generate(first, mesh=object(), pp_group=pp_group, **ok)


def test_two_chunks_on_one_pipeline_rank_equal_one_stage():
    """pp=1 with vp=2: the second chunk takes the first's hidden state in-process; a ModuleList works."""
    from engine.posttrain.generate import generate

    whole = _stage("llama")
    chunks = torch.nn.ModuleList([_stage("llama", post_process=False, layer_range=(0, 1)),
                                  _stage("llama", pre_process=False, layer_range=(1, 2))])
    kw = dict(prompts=PROMPTS, max_new_tokens=5, temperature=0.7, top_p=0.8, seed=3)
    assert generate(chunks, **kw) == generate(whole, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (marked gpu)")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_on_cuda_equals_transformers_greedy(family, tmp_path):
    """One GPU: Tessel's KV-cache greedy decoding (fp32, models/ops' CUDA kernels) equals transformers'
    generate() on the same weights."""
    import transformers

    from engine.posttrain.generate import generate
    from models import SafetensorsState, build_model, load_hf_state_dict
    from parallel.comm import Group

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**tiny.config(family)))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path)
    hf = hf.to("cuda", torch.float32).eval()
    stage = build_model(tiny.config(family), tp_group=Group.trivial("tp"), dtype=torch.float32, device="cuda")
    load_hf_state_dict(stage, SafetensorsState(str(tmp_path)))
    out = generate(stage, prompts=PROMPTS, max_new_tokens=6, tp_group=Group.trivial("tp"),
                   pp_group=Group.trivial("pp"))
    for p, got in zip(PROMPTS, out):
        ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert got == ref[0, len(p):].tolist(), (family, p)
