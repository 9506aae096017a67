"""tools/preprocess_data.py: round trips, worker independence, and every input error."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from engine.data.indexed_dataset import IndexedDataset
from engine.data.preprocess import preprocess
from engine.data.tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "tools"))
import preprocess_data  # noqa: E402

DOCS = [
    "first document\nwith two lines\n",
    "Ünïcödé 😀 \x00 \t mixed\r\n",
    "def g():\n    return 'x' * 3\n" * 30,
    "x",
]


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t, "other": 1}) + "\n")


def read_back(prefix):
    ds = IndexedDataset(prefix)
    tok = load_tokenizer(prefix + ".tokenizer.json")
    out = []
    for i in range(len(ds)):
        ids = ds[i]
        assert ids[-1] == tok.eod_id  # one EOD closes every document
        out.append(tok.decode(ids[:-1]))
    return out, ds, tok


def test_byte_round_trip_exact_via_cli(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, DOCS)
    prefix = str(tmp_path / "out" / "text_document")
    rc = preprocess_data.main(["--input", str(src), "--output-prefix", prefix, "--tokenizer", "byte",
                               "--no-progress"])
    assert rc == 0
    assert "tokens/s" in capsys.readouterr().out
    texts, ds, _ = read_back(prefix)
    assert texts == DOCS
    assert ds.dtype == np.uint16
    assert ds.num_tokens == sum(len(d.encode()) + 1 for d in DOCS)


def test_bpe_round_trip_text_and_directories(tmp_path):
    root = tmp_path / "tree"
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "a.md").write_text(DOCS[0])
    (root / "pkg" / "b.py").write_text(DOCS[2])
    (root / "pkg" / "c.jsonl").write_text(json.dumps({"text": DOCS[1]}) + "\n")
    (root / "pkg" / "ignored.bin").write_bytes(b"\xff\xfe")
    (root / "pkg" / "__pycache__" / "d.py").write_text("skipped")
    (root / ".hidden" / "e.txt").write_text("skipped")
    prefix = str(tmp_path / "bpe")
    stats = preprocess([str(root)], prefix, tokenizer="bpe", vocab_size=300, progress=False)
    texts, _, tok = read_back(prefix)
    # sorted walk: a.md, pkg/b.py, pkg/c.jsonl
    assert texts == [DOCS[0], DOCS[2], DOCS[1]]
    assert tok.kind == "bpe" and tok.vocab_size <= 300
    assert stats.documents == 3 and stats.tokens_per_second > 0


def test_two_workers_write_identical_files(tmp_path):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [f"document number {i} " * (i % 7 + 1) for i in range(200)])
    outs = []
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}")
        preprocess([str(src)], prefix, tokenizer="bpe", vocab_size=300, workers=workers, chunksize=8,
                   progress=False)
        outs.append([open(prefix + ext, "rb").read() for ext in (".bin", ".idx", ".tokenizer.json")])
    assert outs[0] == outs[1]


def test_hf_tokenizer_json_input(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1, "b": 2, "</s>": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = tmp_path / "in.txt"
    src.write_text("a b a zzz")
    prefix = str(tmp_path / "hf")
    preprocess([str(src)], prefix, tokenizer=str(tmp_path / "tokenizer.json"), progress=False)
    assert IndexedDataset(prefix)[0].tolist() == [1, 2, 1, 0, 3]
    assert load_tokenizer(prefix + ".tokenizer.json").eod_id == 3


def assert_nothing_written(tmp_path, prefix):
    assert not any(os.path.exists(prefix + ext) for ext in (".bin", ".idx", ".bin.tmp", ".idx.tmp"))


def test_missing_input(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"input .*nope\.jsonl does not exist"):
        preprocess([str(tmp_path / "nope.jsonl")], str(tmp_path / "o"), tokenizer="byte", progress=False)


def test_empty_corpus(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.bin").write_bytes(b"1")
    with pytest.raises(ValueError, match="empty corpus: no .* files"):
        preprocess([str(tmp_path / "d")], str(tmp_path / "o"), tokenizer="byte", progress=False)
    src = tmp_path / "empty.jsonl"
    write_jsonl(src, ["", ""])
    with pytest.raises(ValueError, match="empty corpus: every document .* has empty text"):
        preprocess([str(src)], str(tmp_path / "o"), tokenizer="byte", progress=False)
    assert_nothing_written(tmp_path, str(tmp_path / "o"))


@pytest.mark.parametrize("workers", [1, 2])
def test_jsonl_line_without_key_names_file_and_line(tmp_path, workers):
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"doc {i}"}) + "\n")
        f.write(json.dumps({"body": "wrong key"}) + "\n")
    prefix = str(tmp_path / "o")
    # With 2 workers the error is raised inside a worker process and must still surface here.
    with pytest.raises(ValueError, match=r"in\.jsonl:41: no key 'text' \(found \['body'\]\).*--json-key"):
        preprocess([str(src)], prefix, tokenizer="byte", workers=workers, chunksize=4, progress=False)
    assert_nothing_written(tmp_path, prefix)


def test_bad_json_and_non_string_and_encoding(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        preprocess([str(src)], str(tmp_path / "o"), tokenizer="byte", progress=False)
    src.write_text('{"text": 5}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: 'text' is a int, expected a string"):
        preprocess([str(src)], str(tmp_path / "o"), tokenizer="byte", progress=False)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin\.txt: not UTF-8 text"):
        preprocess([str(latin)], str(tmp_path / "o"), tokenizer="byte", progress=False)


def test_cli_reports_errors_with_exit_code(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", str(tmp_path / "missing"),
         "--output-prefix", str(tmp_path / "o"), "--tokenizer", "byte"],
        capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2
    assert "error: input" in proc.stderr and "missing does not exist" in proc.stderr


def test_bad_arguments(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("x")
    with pytest.raises(ValueError, match="workers=0 must be >= 1"):
        preprocess([str(src)], str(tmp_path / "o"), workers=0, progress=False)
    with pytest.raises(ValueError, match="--input is empty"):
        preprocess([], str(tmp_path / "o"), progress=False)


def test_tokenizer_ids_beyond_its_vocab_size_rejected(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    # A vocabulary with a hole: 3 entries, but "b" has id 10 (would not fit the dataset's vocab).
    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "</s>": 1, "b": 10}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = tmp_path / "in.txt"
    src.write_text("b b")
    with pytest.raises(ValueError, match=r"in\.txt: the tokenizer produced ids outside \[0, 3\)"):
        preprocess([str(src)], str(tmp_path / "o"), tokenizer=str(tmp_path / "tokenizer.json"), progress=False)
