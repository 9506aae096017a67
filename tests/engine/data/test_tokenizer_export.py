"""Tokenizers export as Hugging Face files: transformers.AutoTokenizer loads them and encodes as Tessel does."""
import pytest
from transformers import AutoTokenizer

from engine.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe_tokenizer

TEXTS = ["hello world", "héllo\n\tüñí ☃ x  y", "def f(x):\n    return x ** 2\n"]


def _auto(tmp_path, files):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return AutoTokenizer.from_pretrained(tmp_path)


def test_byte_tokenizer_exports_as_byte_level_bpe(tmp_path):
    tok = ByteTokenizer()
    auto = _auto(tmp_path, tok.hf_files(model_max_length=64))
    for text in TEXTS:
        ids = auto(text)["input_ids"]
        assert ids == tok.encode(text) and auto.decode(ids) == text
    assert auto.eos_token_id == tok.eod_id == 256 and auto.model_max_length == 64 and len(auto) == 257


def test_bpe_tokenizer_exports_as_itself(tmp_path):
    texts = [t * 20 for t in TEXTS]
    trained = train_bpe_tokenizer(iter(texts), vocab_size=300)
    trained.save(str(tmp_path / "src.tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "src.tokenizer.json"))
    out = tmp_path / "hf"
    out.mkdir()
    auto = _auto(out, tok.hf_files(model_max_length=128))
    for text in TEXTS:
        assert auto(text)["input_ids"] == tok.encode(text)
    assert auto.eos_token_id == tok.eod_id
