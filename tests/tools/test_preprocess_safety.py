"""tools/preprocess_data.py never destroys data (issue 22): a run that fails (an empty corpus, non-UTF-8
input) leaves an existing dataset's files byte-identical, tokenizer included, and a fresh prefix without
any file or directory; a successful run replaces every file of the prefix, the tokenizer config too."""
import json
import os
import sys

from engine.data.indexed_dataset import IndexedDataset
from engine.data.tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))
import preprocess_data  # noqa: E402

TEXTS = ["the quick brown fox jumps over the lazy dog\n" * 4, "def f(x):\n    return x + 1\n" * 3]


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return str(path)


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _run(inputs, prefix, tokenizer):
    return preprocess_data.main(["--input", *inputs, "--output-prefix", prefix, "--tokenizer", tokenizer,
                                 "--vocab-size", "300", "--no-progress"])


def _decoded(prefix):
    ds, tok = IndexedDataset(prefix), load_tokenizer(prefix + ".tokenizer.json")
    return [tok.decode(ds[i][:-1]) for i in range(len(ds))]


def test_a_failed_run_leaves_an_existing_dataset_byte_identical(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    out = tmp_path / "data"
    out.mkdir()
    prefix = str(out / "text_document")
    assert _run([_jsonl(src / "good.jsonl", TEXTS)], prefix, "bpe") == 0  # a BPE dataset (tokenizer + config)
    before = _snapshot(out)
    assert set(before) == {"text_document.bin", "text_document.idx", "text_document.tokenizer.json",
                           "text_document.tokenizer_config.json"}
    empty = _jsonl(src / "empty.jsonl", ["", ""])
    bad = src / "latin1.txt"
    bad.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    # Each of these saved the new tokenizer over the dataset's before failing; bpe fails while training,
    # byte after its tokenizer was ready.
    for inputs, tokenizer, error in (([empty], "byte", "empty corpus"), ([empty], "bpe", "empty corpus"),
                                     ([str(bad)], "byte", "not UTF-8"), ([str(bad)], "bpe", "not UTF-8"),
                                     ([_jsonl(src / "ok.jsonl", TEXTS), str(bad)], "byte", "not UTF-8")):
        capsys.readouterr()
        assert _run(inputs, prefix, tokenizer) == 2
        assert error in capsys.readouterr().err
        assert _snapshot(out) == before, (inputs, tokenizer)  # byte-identical, and no stray file
    assert _decoded(prefix) == TEXTS  # still decodes
    # A success replaces every file of the prefix: a byte tokenizer leaves no BPE config behind.
    assert _run([_jsonl(src / "again.jsonl", TEXTS[:1])], prefix, "byte") == 0
    assert sorted(p.name for p in out.iterdir()) == ["text_document.bin", "text_document.idx",
                                                    "text_document.tokenizer.json"]
    assert _decoded(prefix) == TEXTS[:1]


def test_a_failed_run_on_a_fresh_prefix_leaves_nothing(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    empty = _jsonl(src / "empty.jsonl", [""])
    for tokenizer in ("byte", "bpe"):
        assert _run([empty], str(tmp_path / "new" / "deeper" / "text_document"), tokenizer) == 2
        assert _run([empty], str(tmp_path / "text_document"), tokenizer) == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no stray tokenizer, no directory
