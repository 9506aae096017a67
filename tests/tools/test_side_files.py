"""The Hugging Face side files (a checkpoint's ``hf/``) through post-training, checkpoints and conversion.

Side files are data carried byte for byte: a binary ``tokenizer.model`` (sentencepiece, as Llama-2,
Mistral, Gemma and TinyLlama ship) survives hf-to-tessel, posttrain's prepare, a checkpoint save and
tessel-to-hf unchanged. A post-training run's checkpoints keep the tokenizer it trained with: when
``data.tokenizer`` names another folder than the base's, that folder's tokenizer files and the template the
run rendered with, so the next stage and an export chat the same way.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parallel.testing import run_distributed
from tests.tools.test_convert import make_hf_dir
from tests.tools.test_posttrain import TEMPLATE, _posttrain, chat_records, overrides, write_chat_tokenizer, write_jsonl

BLOB = bytes(range(256)) * 3  # not UTF-8: a sentencepiece model is a protobuf


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """(tessel checkpoint, data dir, instruct tokenizer dir): a tiny Llama base with no chat template and a
    binary tokenizer.model, and a tokenizer folder (same vocabulary) with a template."""
    from tools.convert_checkpoint import hf_to_tessel

    root = tmp_path_factory.mktemp("side_files")
    hf = make_hf_dir(root / "hf", "llama", seed=3)
    write_chat_tokenizer(hf, template=None)
    (hf / "tokenizer.model").write_bytes(BLOB)
    ckpt = hf_to_tessel(hf, root / "ckpt", tp=1, pp=1)
    inst = root / "instruct_tok"
    inst.mkdir()
    write_chat_tokenizer(inst)
    data = root / "data"
    data.mkdir()
    write_jsonl(data / "sft.jsonl", chat_records(8, 1))
    write_jsonl(data / "sft_valid.jsonl", chat_records(4, 2))
    return Path(ckpt), data, inst


def _prepare(ckpt, data, run_dir, extra):
    from engine.config import load_config
    from tools.posttrain import base_defaults, prepare

    return prepare(load_config(None, overrides(ckpt, data, run_dir, "sft", extra), defaults=base_defaults), world=1)


def _save(root: Path, side_files: dict) -> Path:
    from engine.checkpoint import ShardedTensor, save_checkpoint

    save_checkpoint(root, step=1, tensors=[ShardedTensor.replicated("w", torch.zeros(4))], side_files=side_files)
    return root / "step_00000001"


def test_binary_tokenizer_model_is_carried_byte_for_byte(bases, tmp_path):
    from tools.convert_checkpoint import tessel_to_hf
    from tools.posttrain import _side_files, base_hf_dir

    ckpt, _, _ = bases
    hf = base_hf_dir(str(ckpt))
    assert (hf / "tokenizer.model").read_bytes() == BLOB  # hf-to-tessel copied it
    files = _side_files(hf)
    assert files["hf/tokenizer.model"] == BLOB
    assert json.loads(files["hf/tokenizer_config.json"])["eos_token"] == "<|im_end|>"
    step_dir = _save(tmp_path / "run", files)
    for name, data in files.items():
        assert (step_dir / name).read_bytes() == data, name
    out = tessel_to_hf(ckpt, tmp_path / "export", hf_files=str(step_dir / "hf"))
    assert (out / "tokenizer.model").read_bytes() == BLOB


def test_prepare_keeps_a_binary_tokenizer_model(bases, tmp_path):
    """The base's own tokenizer (template given by posttrain.chat_template): prepare reads its binary
    tokenizer.model as bytes (it died with UnicodeDecodeError) and the checkpoint keeps it."""
    ckpt, data, _ = bases
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    prep = _prepare(ckpt, data, tmp_path / "run", [f"posttrain.chat_template={tmp_path / 'chat.jinja'}"])
    assert prep.side_files["hf/tokenizer.model"] == BLOB
    assert prep.side_files["hf/chat_template.jinja"] == TEMPLATE.encode()
    assert (_save(tmp_path / "ck", prep.side_files) / "hf" / "tokenizer.model").read_bytes() == BLOB


def test_checkpoint_keeps_the_tokenizer_folder_the_run_trained_with(bases, tmp_path):
    """A base with no template, data.tokenizer = an instruct tokenizer folder with one: a 1-step run's checkpoint
    holds that folder's tokenizer files (not the base's tokenizer.model) and its template, so the next stage
    prepares from the checkpoint alone and the tessel-to-hf export renders chats as the run did."""
    import transformers

    from engine.posttrain.chat import load_chat_template
    from tools.convert_checkpoint import tessel_to_hf

    ckpt, data, inst = bases
    run_dir = tmp_path / "run"
    run_distributed(_posttrain, 1, ckpt, data, str(run_dir), "sft",
                    [f"data.tokenizer={inst}", "train.steps=1", "train.eval_interval=0"], timeout=240)
    step_dir = run_dir / "checkpoints" / "step_00000001"
    hf = step_dir / "hf"
    assert load_chat_template(str(hf)).text == TEMPLATE
    assert (hf / "tokenizer.json").read_bytes() == (inst / "tokenizer.json").read_bytes()
    assert not (hf / "tokenizer.model").exists()  # the base's tokenizer, not the one the run used
    assert (hf / "config.json").is_file()
    prep = _prepare(run_dir / "checkpoints", data, tmp_path / "next", [])  # no data.tokenizer: the checkpoint's
    assert prep.side_files["hf/tokenizer.json"] == (inst / "tokenizer.json").read_bytes()
    out = tessel_to_hf(step_dir, tmp_path / "export")
    msgs = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]
    exported = transformers.AutoTokenizer.from_pretrained(str(out)).apply_chat_template(msgs, tokenize=False)
    assert exported == load_chat_template(str(inst)).render(msgs)


def test_tokenizer_file_spec_keeps_that_tokenizer_and_the_template(bases, tmp_path):
    """data.tokenizer = a tokenizer.json file: the checkpoint's hf/ holds that tokenizer and the template the run
    rendered with (from the file's folder) as chat_template.jinja and in tokenizer_config.json."""
    from engine.posttrain.chat import load_chat_template

    ckpt, data, inst = bases
    prep = _prepare(ckpt, data, tmp_path / "run", [f"data.tokenizer={inst / 'tokenizer.json'}"])
    assert "hf/tokenizer.model" not in prep.side_files
    hf = _save(tmp_path / "ck", prep.side_files) / "hf"
    assert json.loads((hf / "tokenizer.json").read_text()) == json.loads((inst / "tokenizer.json").read_text())
    assert (hf / "chat_template.jinja").read_text() == TEMPLATE
    assert load_chat_template(str(hf)).text == TEMPLATE
    assert json.loads((hf / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


def test_text_side_files_are_refused_before_anything_is_written(tmp_path):
    """Side files are bytes, written as given: a str (which would be encoded on the way) is refused, and the
    checkpoint root holds nothing afterwards."""
    from engine.checkpoint import ShardedTensor, save_checkpoint

    with pytest.raises(ValueError, match=r"side file 'hf/tokenizer.json' is a str: give its bytes"):
        save_checkpoint(tmp_path, step=1, tensors=[ShardedTensor.replicated("w", torch.zeros(4))],
                        side_files={"hf/tokenizer.json": "{}"})
    assert list(tmp_path.iterdir()) == []
