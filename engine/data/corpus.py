"""The bundled corpus: the running interpreter's standard library, tokenized, no network needed.

:func:`prepare_stdlib_corpus` picks standard-library ``.py`` files (tests and site-packages left
out) in a fixed pseudo-random order (sha1 of the relative path) until a byte cap, writes them as
JSONL (one document per file: the source, the docstrings, or both), trains the byte-level BPE on it
and writes ``<output_dir>/text_document.{bin,idx}`` plus the tokenizer. A ``manifest.json`` records
the parameters and outputs; a second call with the same parameters finds it and does nothing.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import sys
import sysconfig

from engine.data.indexed_dataset import IndexedDataset, data_file_path, dataset_exists, index_file_path
from engine.data.preprocess import preprocess, tokenizer_path_for

CORPUS_FORMAT = 1
CONTENT_KINDS = ("source", "docstrings", "both")
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "__phello__"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    """What goes into the corpus; every field is part of the manifest."""

    root: str  # the standard library directory
    max_bytes: int = 6_000_000  # stop adding files past this many UTF-8 bytes of text
    max_file_bytes: int = 200_000  # skip single files larger than this (generated tables)
    content: str = "source"
    tokenizer: str = "bpe"
    vocab_size: int = 4096

    def __post_init__(self):
        if self.content not in CONTENT_KINDS:
            raise ValueError(f"content={self.content!r}: use one of {CONTENT_KINDS}")
        if self.max_bytes < 1 or self.max_file_bytes < 1:
            raise ValueError(f"max_bytes={self.max_bytes} and max_file_bytes={self.max_file_bytes} must be >= 1")
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"root={self.root} is not a directory: point it at a Python standard library")


def default_stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_stdlib_files(root: str) -> list[str]:
    """Relative paths of the .py files under ``root``, tests and third-party packages excluded, sorted."""
    out = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        rel_dir = os.path.relpath(dirpath, root)
        for name in names:
            if name.endswith(".py") and not name.startswith("test_"):
                out.append(os.path.normpath(os.path.join(rel_dir, name)))
    return sorted(out)


def _docstrings(source: str) -> str:
    """Module, class and function docstrings of ``source``, in source order, blank-line separated."""
    tree = ast.parse(source)
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef,
                                                                     ast.AsyncFunctionDef))]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    docs = [ast.get_docstring(n, clean=True) for n in nodes]
    return "\n\n".join(d for d in docs if d)


def _document_text(source: str, content: str) -> str:
    if content == "source":
        return source
    try:
        docs = _docstrings(source)
    except SyntaxError:  # a few stdlib files are templates; their docstrings are not needed
        docs = ""
    return docs if content == "docstrings" else (source + ("\n\n" + docs if docs else ""))


def collect_documents(config: CorpusConfig) -> list[dict]:
    """``[{"path": relative path, "text": ...}]`` in the corpus order, within ``config.max_bytes``."""
    files = list_stdlib_files(config.root)
    # A hash order samples the whole library instead of its alphabetically first packages.
    files.sort(key=lambda rel: hashlib.sha1(rel.encode()).hexdigest())
    docs, total = [], 0
    for rel in files:
        path = os.path.join(config.root, rel)
        if os.path.getsize(path) > config.max_file_bytes:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except (UnicodeDecodeError, OSError):
            continue  # a handful of stdlib files are deliberately not UTF-8 (encoding tests)
        text = _document_text(source, config.content)
        size = len(text.encode("utf-8"))
        if not text.strip():
            continue
        if total + size > config.max_bytes:
            if total:
                break
            raise ValueError(f"max_bytes={config.max_bytes} is smaller than the first file ({rel}, {size} bytes)")
        docs.append({"path": rel.replace(os.sep, "/"), "text": text})
        total += size
    if not docs:
        raise ValueError(f"empty corpus: no readable .py files under {config.root}")
    return docs


def _manifest_matches(manifest_path: str, params: dict, prefix: str) -> bool:
    if not (os.path.isfile(manifest_path) and dataset_exists(prefix)):
        return False
    with open(manifest_path) as f:
        try:
            manifest = json.load(f)
        except ValueError:
            return False
    if manifest.get("params") != params:
        return False
    outputs = manifest.get("outputs", {})
    return (outputs.get("bin_bytes") == os.path.getsize(data_file_path(prefix))
            and outputs.get("idx_bytes") == os.path.getsize(index_file_path(prefix))
            and os.path.isfile(tokenizer_path_for(prefix)))


def prepare_stdlib_corpus(output_dir: str, *, config: CorpusConfig, workers: int = 1, force: bool = False,
                          progress: bool = False) -> dict:
    """Build (or find up to date) ``output_dir/text_document.{bin,idx}``; return the manifest.

    The manifest's ``"skipped"`` is True when an up-to-date corpus was already there.
    """
    os.makedirs(output_dir, exist_ok=True)
    prefix = os.path.join(output_dir, "text_document")
    manifest_path = os.path.join(output_dir, "manifest.json")
    docs = collect_documents(config)
    listing = hashlib.sha256("\n".join(d["path"] for d in docs).encode())
    params = {"format": CORPUS_FORMAT, "python": sys.version.split()[0], **dataclasses.asdict(config),
              "documents": len(docs), "files_sha256": listing.hexdigest()}
    if not force and _manifest_matches(manifest_path, params, prefix):
        with open(manifest_path) as f:
            return {**json.load(f), "skipped": True}
    raw_path = os.path.join(output_dir, "raw.jsonl")
    with open(raw_path + ".tmp", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    os.replace(raw_path + ".tmp", raw_path)
    stats = preprocess([raw_path], prefix, tokenizer=config.tokenizer, vocab_size=config.vocab_size,
                       workers=workers, progress=progress)
    ds = IndexedDataset(prefix)
    manifest = {
        "params": params,
        "outputs": {"prefix": "text_document", "bin_bytes": os.path.getsize(data_file_path(prefix)),
                    "idx_bytes": os.path.getsize(index_file_path(prefix)), "documents": ds.num_documents,
                    "tokens": ds.num_tokens, "text_bytes": sum(len(d["text"].encode()) for d in docs),
                    "tokenizer": os.path.basename(stats.tokenizer_path)},
        "timing": {"tokenizer_seconds": round(stats.tokenizer_seconds, 3), "encode_seconds": round(stats.seconds, 3),
                   "tokens_per_second": round(stats.tokens_per_second), "workers": workers},
    }
    with open(manifest_path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(manifest_path + ".tmp", manifest_path)
    return {**manifest, "skipped": False}
