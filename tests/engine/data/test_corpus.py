"""The bundled stdlib corpus: deterministic selection, cap, idempotent preparation."""
import json
import os
import subprocess
import sys

import pytest

from engine.data.corpus import CorpusConfig, collect_documents, default_stdlib_root, list_stdlib_files, \
    prepare_stdlib_corpus
from engine.data.indexed_dataset import IndexedDataset
from engine.data.tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def fake_stdlib(root):
    (root / "pkg").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "site-packages" / "thirdparty").mkdir(parents=True)
    for i in range(12):
        (root / f"mod{i}.py").write_text(f'"""Module {i} docstring."""\n\ndef f{i}():\n    """Doc of f{i}."""\n    '
                                         f"return {i}\n")
    (root / "pkg" / "__init__.py").write_text("X = 1\n")
    (root / "test" / "test_x.py").write_text("skipped\n")
    (root / "site-packages" / "thirdparty" / "y.py").write_text("skipped\n")
    (root / "bad.py").write_bytes(b"# coding: latin-1\nx = '\xe9'\n")
    return root


def test_selection_deterministic_capped_and_filtered(tmp_path):
    root = fake_stdlib(tmp_path / "lib")
    files = list_stdlib_files(str(root))
    assert "test/test_x.py" not in files and not any("site-packages" in f for f in files)
    assert "pkg/__init__.py" in files and files == sorted(files)
    docs = collect_documents(CorpusConfig(root=str(root), max_bytes=10_000))
    assert [d["path"] for d in docs] == [d["path"] for d in collect_documents(CorpusConfig(root=str(root)))]
    assert "bad.py" not in {d["path"] for d in docs}  # not UTF-8: left out
    capped = collect_documents(CorpusConfig(root=str(root), max_bytes=200))
    assert sum(len(d["text"].encode()) for d in capped) <= 200
    assert [d["path"] for d in capped] == [d["path"] for d in docs[:len(capped)]]
    only_docs = collect_documents(CorpusConfig(root=str(root), content="docstrings"))
    assert any(d["text"] == "Module 3 docstring.\n\nDoc of f3." for d in only_docs)
    with pytest.raises(ValueError, match="content='all'"):
        CorpusConfig(root=str(root), content="all")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        CorpusConfig(root=str(tmp_path / "none"))


def test_prepare_is_idempotent(tmp_path):
    root = fake_stdlib(tmp_path / "lib")
    out = str(tmp_path / "corpus")
    config = CorpusConfig(root=str(root), tokenizer="byte")
    first = prepare_stdlib_corpus(out, config=config)
    assert not first["skipped"]
    ds = IndexedDataset(os.path.join(out, "text_document"))
    tok = load_tokenizer(os.path.join(out, "text_document.tokenizer.json"))
    raw = [json.loads(line) for line in open(os.path.join(out, "raw.jsonl"))]
    assert [tok.decode(ds[i]) for i in range(len(ds))] == [r["text"] for r in raw]
    mtime = os.path.getmtime(os.path.join(out, "text_document.bin"))
    again = prepare_stdlib_corpus(out, config=config)
    assert again["skipped"] and os.path.getmtime(os.path.join(out, "text_document.bin")) == mtime
    # A different parameter, or a damaged output, rebuilds.
    assert not prepare_stdlib_corpus(out, config=CorpusConfig(root=str(root), tokenizer="byte", max_bytes=300))["skipped"]
    with open(os.path.join(out, "text_document.bin"), "ab") as f:
        f.write(b"xx")
    assert not prepare_stdlib_corpus(out, config=CorpusConfig(root=str(root), tokenizer="byte", max_bytes=300))["skipped"]


def test_cli_on_real_stdlib_small_cap(tmp_path):
    out = str(tmp_path / "stdlib")
    cmd = [sys.executable, os.path.join(REPO, "tools", "prepare_corpus.py"), "--output-dir", out, "--max-mb", "0.3",
           "--vocab-size", "512"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout
    ds = IndexedDataset(os.path.join(out, "text_document"))
    tok = load_tokenizer(os.path.join(out, "text_document.tokenizer.json"))
    assert tok.kind == "bpe" and tok.vocab_size <= 512
    raw = [json.loads(line) for line in open(os.path.join(out, "raw.jsonl"))]
    first_path = os.path.join(default_stdlib_root(), raw[0]["path"])
    assert tok.decode(ds[0]) == open(first_path, encoding="utf-8").read()  # BPE round trip on real source
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "up to date" in proc.stdout
