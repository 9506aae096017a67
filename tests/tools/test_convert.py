"""tools/convert_checkpoint.py and models/convert.py: Hugging Face <-> Tessel at any layout.

Tiny random Hugging Face models of every family are built from a config here (no downloads) and saved
with save_pretrained; conversions must restore their files bit for bit and load in transformers. The
converter's derived stage parameters and checkpoint placements are checked against real model stages,
and its output against a checkpoint written by engine.checkpoint.save_checkpoint.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.models import tiny

FAMILIES = ("gpt2", "llama", "qwen2", "qwen3", "mistral")
WORDS = [f"w{i}" for i in range(90)]


# -- helpers shared with tests/tools/test_evaluate.py -----------------------------------------------

def write_tokenizer(path: Path) -> None:
    """A word-level tokenizer over ids < 100 (the tiny vocab): tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "unk_token": "<unk>"}))


def make_hf_dir(path: Path, family: str, *, seed: int = 0, shard_size: str | None = None) -> Path:
    """Save a tiny random ``family`` model (every weight perturbed, norms and biases included) with a
    tokenizer; ``shard_size`` saves sharded safetensors with an index."""
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**tiny.config(family))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path, max_shard_size=shard_size or "5GB")
    write_tokenizer(path)
    return path


def hf_logits(hf_dir: Path, token_lists) -> list[torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0] for ids in token_lists]


def file_tensors(d: Path) -> dict[str, torch.Tensor]:
    from models import SafetensorsState

    st = SafetensorsState(d)
    return {k: st[k] for k in st.keys()}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    # qwen2 and gpt2 are saved sharded, so the converter reads model.safetensors.index.json too.
    shard = {"qwen2": "30KB", "gpt2": "40KB"}
    return {f: make_hf_dir(root / f, f, seed=i, shard_size=shard.get(f)) for i, f in enumerate(FAMILIES)}


# -- derivation checks against real stages ----------------------------------------------------------

def _fake_tp_group(rank: int, size: int):
    from parallel.comm import Group, Ledger

    # A stage only communicates in forward; building it needs the group's rank and size alone.
    return Group(axis="tp", ranks=range(size), rank=rank, pg=object() if size > 1 else None, ledger=Ledger())


@pytest.mark.parametrize("family", FAMILIES)
def test_stage_params_and_placements_match_built_stages(family):
    from engine.checkpoint import ShardingContext, module_sharded_tensors
    from models import build_model, config_from_hf
    from models.convert import model_param_spec, placements, stage_layer_ranges, stage_params

    hf = tiny.config(family)
    cfg = config_from_hf(hf)
    tp, pp = 2, 2
    padded = cfg.padded_vocab_size(tp=tp, make_vocab_size_divisible_by=128)
    for pp_rank, lr in enumerate(stage_layer_ranges(cfg.num_layers, pp)):
        for tp_rank in range(tp):
            ends = dict(pre_process=pp_rank == 0, post_process=pp_rank == pp - 1)
            stage = build_model(hf, tp_group=_fake_tp_group(tp_rank, tp), layer_range=lr, dtype=torch.float32, **ends)
            derived = stage_params(cfg, tp_rank=tp_rank, tp_size=tp, layer_range=lr, padded_vocab=padded, **ends)
            real = dict(stage.named_parameters())
            assert sorted(p.name for p in derived) == sorted(real)
            for p in derived:
                q = real[p.name]
                assert p.local_shape == tuple(q.shape), p.name
                assert p.partition == ((q.partition_dim, q.partition_stride) if q.tensor_parallel else None), p.name
                assert p.shared_embedding == bool(getattr(q, "shared_embedding", False)), p.name
            ctx = ShardingContext(tp_rank=tp_rank, tp_size=tp)
            want = sorted((json.dumps(st.describe(), sort_keys=True) for st in
                           module_sharded_tensors(stage, ctx=ctx, hook=model_param_spec)))
            got = sorted(json.dumps(st.describe(), sort_keys=True) for p in derived
                         for st in placements(p, tp_rank=tp_rank, tp_size=tp, dtype=torch.float32))
            assert got == want


def test_param_spec_matches_trainer_checkpoint_hook():
    """The converter's keys are the trainer's: the model hook's param_spec on chunk-list names
    (``<chunk>.<name>``, any chunk index) gives the converter's spec of ``<name>``."""
    from models import build_model
    from models.convert import model_param_spec
    from models.hook import param_spec

    for family in ("gpt2", "llama"):
        hf = tiny.config(family, tie_word_embeddings=True)
        for ends in ({"pre_process": True, "post_process": True}, {"pre_process": False, "post_process": True},
                     {"pre_process": True, "post_process": False}):
            stage = build_model(hf, tp_group=_fake_tp_group(0, 1), layer_range=(0, 1), **ends)
            for name, p in stage.named_parameters():
                for chunk in (0, 3):
                    assert param_spec(f"{chunk}.{name}", p) == model_param_spec(name, p), name


def test_stage_layer_ranges():
    from models.convert import stage_layer_ranges

    assert stage_layer_ranges(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert stage_layer_ranges(4, 2) == [(0, 2), (2, 4)]
    assert stage_layer_ranges(5, 2, [1, 4]) == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match="summing to num_layers=5"):
        stage_layer_ranges(5, 2, [2, 2])
    with pytest.raises(ValueError, match="exceeds num_layers"):
        stage_layer_ranges(2, 3)


# -- round trips ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_roundtrip_tp2_pp2_is_bitwise_and_loads(family, hf_dirs, tmp_path):
    import transformers

    from engine.checkpoint import read_metadata, resolve_checkpoint
    from tools.convert_checkpoint import hf_to_tessel, tessel_to_hf

    src = hf_dirs[family]
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    hf_to_tessel(src, ckpt, tp=2, pp=2)
    step = resolve_checkpoint(ckpt)
    meta = read_metadata(step)
    assert sorted(meta["files"]) == [f"rank_{r:05d}.safetensors" for r in range(4)]
    assert meta["model_config"]["model_type"] == family and meta["layout"]["tp"] == 2
    assert all(k.startswith("model.") for k in meta["tensors"])
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"} <= set(
        os.listdir(ckpt / "hf"))
    # Small shards for half the families: the index and the size bound are exercised.
    shard = "25KB" if family in ("llama", "qwen3", "gpt2") else "2GB"
    tessel_to_hf(ckpt, back, max_shard_size=shard)
    orig, got = file_tensors(src), file_tensors(back)
    assert sorted(orig) == sorted(got)
    for k in orig:
        assert orig[k].dtype == got[k].dtype and torch.equal(orig[k].view(torch.uint8), got[k].view(torch.uint8)), k
    if shard == "25KB":
        index = json.loads((back / "model.safetensors.index.json").read_text())
        files = set(index["weight_map"].values())
        assert len(files) > 1 and sorted(index["weight_map"]) == sorted(orig)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in orig.values())
        for f in files:  # every file stays under the bound unless it holds a single larger entry
            with open(back / f, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            sizes = [v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"]
            assert sum(sizes) <= 25_000 or len({k.rsplit(".", 2)[0] for k in header if k != "__metadata__"}) <= 2
    else:
        assert (back / "model.safetensors").is_file() and not (back / "model.safetensors.index.json").exists()
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(os.listdir(back))
    a = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    b = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_same_format_as_save_checkpoint_and_reshards(hf_dirs, tmp_path):
    """TP=1 conversion == a checkpoint the engine saves from a loaded model (keys, shapes, dtypes, pieces,
    bytes); a TP=2 x PP=2 conversion loads into a TP=1 model equal to load_hf_state_dict."""
    from engine.checkpoint import ShardingContext, load_checkpoint, module_sharded_tensors, read_metadata, save_checkpoint
    from models import SafetensorsState, build_model, load_hf_state_dict
    from models.convert import model_param_spec
    from safetensors import safe_open
    from tools.convert_checkpoint import hf_to_tessel

    for family in ("gpt2", "llama"):  # tied and untied embeddings
        hf = json.loads((hf_dirs[family] / "config.json").read_text())
        model = build_model(hf, tp_group=_fake_tp_group(0, 1), dtype=torch.float32)
        load_hf_state_dict(model, SafetensorsState(hf_dirs[family]))
        ctx = ShardingContext()
        save_checkpoint(tmp_path / f"{family}_engine", step=0, group=None, model_config=hf,
                        tensors=module_sharded_tensors(model, ctx=ctx, hook=model_param_spec))
        hf_to_tessel(hf_dirs[family], tmp_path / f"{family}_conv", tp=1, pp=1)
        e_dir, c_dir = tmp_path / f"{family}_engine" / "step_00000000", tmp_path / f"{family}_conv" / "step_00000000"
        e, c = read_metadata(e_dir), read_metadata(c_dir)
        assert c["tensors"] == e["tensors"] and c["world_size"] == e["world_size"] == 1
        with safe_open(str(e_dir / "rank_00000.safetensors"), "pt") as fe, \
                safe_open(str(c_dir / "rank_00000.safetensors"), "pt") as fc:
            assert sorted(fe.keys()) == sorted(fc.keys())
            for k in fe.keys():
                assert torch.equal(fe.get_tensor(k), fc.get_tensor(k)), k
        # Resharding load of a TP=2 x PP=2 conversion into the TP=1 model's tensors.
        hf_to_tessel(hf_dirs[family], tmp_path / f"{family}_tp2pp2", tp=2, pp=2)
        fresh = build_model(hf, tp_group=_fake_tp_group(0, 1), dtype=torch.float32, seed=7)
        load_checkpoint(tmp_path / f"{family}_tp2pp2", tensors=module_sharded_tensors(fresh, ctx=ctx,
                                                                                       hook=model_param_spec))
        want = dict(model.named_parameters())
        for name, p in fresh.named_parameters():
            assert torch.equal(p, want[name]), name


def test_dtype_conversion(hf_dirs, tmp_path):
    from engine.checkpoint import read_metadata, resolve_checkpoint
    from tools.convert_checkpoint import hf_to_tessel, tessel_to_hf

    hf_to_tessel(hf_dirs["qwen3"], tmp_path / "ck", tp=2, pp=1, dtype="bf16")
    meta = read_metadata(resolve_checkpoint(tmp_path / "ck"))
    assert {t["dtype"] for t in meta["tensors"].values()} == {"bfloat16"}
    assert meta["model_config"]["dtype"] == "bfloat16"
    tessel_to_hf(tmp_path / "ck", tmp_path / "bf16")
    tessel_to_hf(tmp_path / "ck", tmp_path / "fp32", dtype="fp32")
    orig = file_tensors(hf_dirs["qwen3"])
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        got = file_tensors(tmp_path / name)
        for k, t in orig.items():
            assert got[k].dtype == dtype and torch.equal(got[k], t.to(torch.bfloat16).to(dtype)), k
        assert json.loads((tmp_path / name / "config.json").read_text())["dtype"] == str(dtype).split(".")[1]


# -- errors -----------------------------------------------------------------------------------------

def _rewrite(src: Path, dst: Path, *, drop=(), add=None, config_changes=None) -> Path:
    """A copy of a single-file HF dir with tensors dropped/added and config.json edited."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    tensors = file_tensors(src)
    for f in dst.glob("model*.safetensors*"):
        f.unlink()
    for k in drop:
        tensors.pop(k)
    tensors.update(add or {})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config_changes:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config_changes)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_hf_to_tessel_errors(hf_dirs, tmp_path):
    from tools.convert_checkpoint import hf_to_tessel, main

    llama = hf_dirs["llama"]
    cases = [
        (_rewrite(llama, tmp_path / "arch", config_changes={"model_type": "bert", "architectures": ["BertModel"]}),
         {}, "model_type='bert' is not supported"),
        (_rewrite(llama, tmp_path / "missing", drop=["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]), {},
         r"missing tensors \(2\): \['model.layers.1.mlp.up_proj.weight', 'model.norm.weight'\]"),
        (_rewrite(llama, tmp_path / "extra", add={"model.layers.9.foo.weight": torch.zeros(2)}), {},
         r"unexpected tensors \(1\): \['model.layers.9.foo.weight'\]"),
        (_rewrite(llama, tmp_path / "shape", config_changes={"intermediate_size": 128}), {},
         r"shape mismatches \(6\).*gate_proj.weight: file \(96, 64\), config.json implies \(128, 64\)"),
        (llama, {"tp": 3}, "num_attention_heads=8 is not divisible by tensor-parallel size 3"),
        (llama, {"dtype": "int8"}, "--dtype='int8' is not one of keep, bf16, fp16, fp32"),
        (llama, {"pp": 2, "pipeline_layout": [2, 1]}, "summing to num_layers=2"),
        (tmp_path / "nowhere", {}, "is not a directory"),
    ]
    for src, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            hf_to_tessel(src, tmp_path / "out", **kw)
        assert not (tmp_path / "out").exists()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((llama / "config.json").read_text())
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no .safetensors files \(it holds \['pytorch_model.bin'\]"):
        hf_to_tessel(tmp_path / "bin", tmp_path / "out")
    with pytest.raises(ValueError, match="is .or contains. the input"):
        hf_to_tessel(llama, llama.parent, force=True)
    assert main(["hf-to-tessel", "--hf", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]) == 2


def test_existing_output_needs_force_and_errors_leave_nothing(hf_dirs, tmp_path, monkeypatch, capsys):
    import tools.convert_checkpoint as cc

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="exists and is not empty; pass --force"):
        cc.hf_to_tessel(hf_dirs["mistral"], out, tp=2, pp=2)
    assert main_rc(cc, ["hf-to-tessel", "--hf", str(hf_dirs["mistral"]), "--out", str(out)]) == 2
    assert "pass --force" in capsys.readouterr().err
    # A failure in the middle of writing (the last rank file) leaves --out as it was and no temporary dir.
    calls = {"n": 0}
    real = cc.read_shard

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 25:
            raise OSError("disk full (injected)")
        return real(*a, **k)
    monkeypatch.setattr(cc, "read_shard", failing)
    with pytest.raises(OSError, match="injected"):
        cc.hf_to_tessel(hf_dirs["mistral"], out, tp=2, pp=2, force=True)
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["keep.txt"]
    monkeypatch.setattr(cc, "read_shard", real)
    assert main_rc(cc, ["hf-to-tessel", "--hf", str(hf_dirs["mistral"]), "--out", str(out), "--tp", "2", "--pp",
                        "2", "--force"]) == 0
    assert sorted(os.listdir(out)) == ["hf", "latest", "step_00000000"] and sorted(os.listdir(tmp_path)) == ["out"]


def main_rc(cc, argv) -> int:
    return cc.main(argv)


def test_tessel_to_hf_errors(hf_dirs, tmp_path):
    from engine.checkpoint import CheckpointError, ShardedTensor, save_checkpoint
    from tools.convert_checkpoint import hf_to_tessel, main, parse_size, tessel_to_hf

    ck = hf_to_tessel(hf_dirs["llama"], tmp_path / "ck", tp=2, pp=1)
    with pytest.raises(CheckpointError, match="is not a Tessel checkpoint"):
        tessel_to_hf(hf_dirs["llama"], tmp_path / "o")
    with pytest.raises(ValueError, match="--max-shard-size='lots' is not a size"):
        tessel_to_hf(ck, tmp_path / "o", max_shard_size="lots")
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1.5MiB") == 3 * 2**19 and parse_size("100") == 100
    data_dir = tmp_path / "data"  # a data directory: its tokenizer is not a Hugging Face directory's
    data_dir.mkdir()
    (data_dir / "text_document.tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"--hf-files .*data holds no Hugging Face tokenizer or generation files.*"
                                         r"text_document.tokenizer.json"):
        tessel_to_hf(ck, tmp_path / "o", hf_files=str(data_dir))
    assert not (tmp_path / "o").exists()  # refused before anything was written
    cfg = json.loads((hf_dirs["llama"] / "config.json").read_text())
    (tmp_path / "more.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"missing tensors \(6\): \['model.layers.2.input_norm.weight'"):
        tessel_to_hf(ck, tmp_path / "o", config_path=str(tmp_path / "more.json"))
    (tmp_path / "fewer.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match=r"unexpected tensors \(6\)"):
        tessel_to_hf(ck, tmp_path / "o", config_path=str(tmp_path / "fewer.json"))
    (tmp_path / "wide.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.fc1.weight: checkpoint \(192, 64\), config implies "
                                         r"\(256, 64\)"):
        tessel_to_hf(ck, tmp_path / "o", config_path=str(tmp_path / "wide.json"))
    save_checkpoint(tmp_path / "noconf", step=3, tensors=[ShardedTensor.replicated("model.x", torch.zeros(2))])
    with pytest.raises(ValueError, match="stores no model_config; pass --config"):
        tessel_to_hf(tmp_path / "noconf", tmp_path / "o")
    rank1 = tmp_path / "ck" / "step_00000000" / "rank_00001.safetensors"
    data = bytearray(rank1.read_bytes())
    data[-1] ^= 0xFF
    rank1.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch in .*rank_00001.safetensors"):
        tessel_to_hf(ck, tmp_path / "o")
    assert not (tmp_path / "o").exists()
    assert main(["tessel-to-hf", "--ckpt", str(ck), "--out", str(tmp_path / "o")]) == 2


# -- the pread reader ---------------------------------------------------------------------------------

def test_pread_reader_matches_safe_open(tmp_path, monkeypatch):
    import models.convert as mc
    from safetensors import safe_open
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(6, 10, 4, generator=gen), "b": torch.randn(7, generator=gen).to(torch.bfloat16),
               "c": torch.randn(5, 12, generator=gen).half()}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    st = mc.PreadSafetensors(tmp_path / "m.safetensors")
    assert sorted(st) == ["a", "b", "c"] and len(st) == 3 and "a" in st and "z" not in st
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as ref:
        for small_run in (1 << 30, 0):  # whole-tensor read + narrow, and one read per leading index
            monkeypatch.setattr(mc, "SMALL_RUN_BYTES", small_run)
            for k in tensors:
                assert torch.equal(st[k], ref.get_tensor(k)) and st.get_slice(k).get_shape() == list(tensors[k].shape)
                for dim in range(tensors[k].dim()):
                    n = tensors[k].shape[dim]
                    index = tuple([slice(None)] * dim + [slice(1, n - 1)])
                    got = st.get_slice(k)[index]
                    assert got.is_contiguous() and torch.equal(got, ref.get_slice(k)[index]), (k, dim, small_run)
    with pytest.raises(KeyError):
        st.get_slice("z")
    with pytest.raises(ValueError, match="unsupported index"):
        st.get_slice("a")[0]
    st.close()
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        mc.PreadSafetensors(tmp_path / "bad.safetensors")
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "short.safetensors").write_bytes(data[:-8])
    with pytest.raises(ValueError, match="ends early"):
        mc.PreadSafetensors(tmp_path / "short.safetensors")["c"]
    (tmp_path / "dup").mkdir()
    save_file({"a": torch.zeros(2)}, str(tmp_path / "dup" / "x.safetensors"))
    save_file({"a": torch.zeros(2)}, str(tmp_path / "dup" / "y.safetensors"))
    with pytest.raises(ValueError, match="appears in more than one file"):
        mc.PreadSafetensors(tmp_path / "dup")
