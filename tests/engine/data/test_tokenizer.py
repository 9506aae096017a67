"""Tokenizers: byte exactness, BPE determinism and round trip, HF tokenizer.json loading, saved files."""
import json

import pytest

from engine.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe_tokenizer

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "Unicode: héllo wörld, 日本語, emoji 😀, tabs\tand\r\nCRLF, NUL \x00 end  ",
    "class A:\n    '''Docstring.'''\n    pass\n" * 20,
]


def test_byte_tokenizer_exact_round_trip(tmp_path):
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eod_id) == (257, 256)
    for text in TEXTS:
        ids = tok.encode(text)
        assert max(ids) < 256
        assert tok.decode(ids + [tok.eod_id]) == text
    path = tok.save(str(tmp_path / "t.tokenizer.json"))
    assert json.load(open(path)) == {"tessel_tokenizer": "byte", "vocab_size": 257, "eod_id": 256}
    assert isinstance(load_tokenizer(path), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_bpe_deterministic_round_trip_and_saved_files(tmp_path):
    a = train_bpe_tokenizer(TEXTS * 5, vocab_size=400)
    b = train_bpe_tokenizer(TEXTS * 5, vocab_size=400)
    assert a.backend.to_str() == b.backend.to_str()
    assert a.eod_id == a.backend.token_to_id("<|endoftext|>")
    assert 257 <= a.vocab_size <= 400
    for text in TEXTS:
        ids = a.encode(text)
        assert a.decode(ids + [a.eod_id]) == text
    # Merges were learned: the repeated text takes far fewer tokens than bytes.
    assert len(a.encode(TEXTS[2])) < len(TEXTS[2].encode()) / 3

    path = a.save(str(tmp_path / "corpus.tokenizer.json"))
    cfg = json.load(open(tmp_path / "corpus.tokenizer_config.json"))
    assert cfg == {"eos_token": "<|endoftext|>", "tessel_kind": "bpe"}
    loaded = load_tokenizer(path)
    assert isinstance(loaded, HFTokenizer) and loaded.kind == "bpe"
    assert loaded.eod_id == a.eod_id and loaded.encode(TEXTS[1]) == a.encode(TEXTS[1])
    # A directory save is the Hugging Face layout (tokenizer.json + tokenizer_config.json).
    a.save(str(tmp_path))
    assert load_tokenizer(str(tmp_path)).eod_id == a.eod_id


def _word_level_tokenizer(path, vocab):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def test_hf_tokenizer_json_eod_resolution(tmp_path):
    path = tmp_path / "tokenizer.json"
    _word_level_tokenizer(path, {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3, "<stop>": 4})
    tok = load_tokenizer(str(path))
    assert tok.eod_id == 3  # a known EOD name found in the vocabulary
    assert tok.encode("hello world") == [1, 2]
    assert load_tokenizer(str(path), eod_token="<stop>").eod_id == 4
    with pytest.raises(ValueError, match="eod_token='<nope>' is not in the tokenizer's vocabulary"):
        load_tokenizer(str(path), eod_token="<nope>")
    # tokenizer_config.json beside it (HF convention) names the EOS.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<stop>"}}))
    assert load_tokenizer(str(tmp_path)).eod_id == 4


def test_hf_tokenizer_without_eod_errors(tmp_path):
    path = tmp_path / "tokenizer.json"
    _word_level_tokenizer(path, {"[UNK]": 0, "hello": 1})
    with pytest.raises(ValueError, match="cannot tell the end-of-document token .*--eod-token"):
        load_tokenizer(str(path))


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer 'missing.json' not found"):
        load_tokenizer("missing.json")
    with pytest.raises(ValueError, match="'bpe' is trained on a corpus"):
        load_tokenizer("bpe")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON tokenizer file"):
        load_tokenizer(str(bad))
    bad.write_text(json.dumps({"model": 3}))
    with pytest.raises(ValueError, match="not a Hugging Face tokenizers file"):
        load_tokenizer(str(bad))
    with pytest.raises(ValueError, match="vocab_size=100 must be in"):
        train_bpe_tokenizer(["abc"], vocab_size=100)


def test_bpe_identical_in_a_fresh_process():
    # Hash-map seeds differ between processes; the trained merges must not depend on them.
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    code = ("import json, sys; from engine.data.tokenizer import train_bpe_tokenizer; "
            "texts = json.loads(sys.stdin.read()); "
            "sys.stdout.write(train_bpe_tokenizer(texts, vocab_size=400).backend.to_str())")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(TEXTS * 5), capture_output=True, text=True,
                         cwd=repo, timeout=60, check=True).stdout
    assert out == train_bpe_tokenizer(TEXTS * 5, vocab_size=400).backend.to_str()
