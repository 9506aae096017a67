"""Text/JSONL -> tokenized ``PREFIX.bin`` / ``PREFIX.idx`` (the engine of tools/preprocess_data.py).

Inputs are files or directories. A directory is walked recursively (sorted; hidden entries and
``__pycache__`` skipped) for ``.txt .md .rst .py`` (one document per file) and ``.jsonl``
(one document per line, text under ``json_key``). A file named explicitly is JSONL when it ends in
``.jsonl``/``.json``, else one text document. Documents whose text is empty are skipped (counted).

Each document becomes one sequence: its token ids followed by the tokenizer's EOD id. Worker
processes (spawned, so no Rust thread pool is forked) encode documents in input order, so the
output does not depend on ``workers``. Every bad input raises ``ValueError``/``FileNotFoundError``
naming the file (and line for JSONL); nothing is written unless the whole corpus succeeds.

Every output (``.bin``, ``.idx``, the tokenizer and its config) is written under a temporary name and
renamed into place only after the whole corpus succeeded, so a failed run leaves an existing dataset's
files byte-identical and a fresh prefix without any file (nor a directory it had to create). The renames
themselves are separate: a process killed between them (microseconds) can pair new data with the old
tokenizer.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from typing import Iterator

import numpy as np

from engine.data.indexed_dataset import IndexedDatasetBuilder
from engine.data.tokenizer import ByteTokenizer, _config_path, load_tokenizer, train_bpe_tokenizer

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
JSONL_SUFFIXES = (".jsonl", ".json")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkItem:
    """One document to encode: a text file, or one line of a JSONL file."""

    path: str
    line_number: int = 0  # 1-based for JSONL lines; 0 for a whole text file
    line: str | None = None


@dataclasses.dataclass(kw_only=True)
class PreprocessStats:
    documents: int
    skipped_empty: int
    tokens: int
    seconds: float  # encoding + writing (what tokens_per_second measures)
    tokenizer_seconds: float  # resolving / training the tokenizer
    tokenizer_path: str
    workers: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def discover_files(inputs: list[str]) -> list[str]:
    """The input files, in a deterministic order; raises for a missing path or no usable file."""
    if not inputs:
        raise ValueError("--input is empty: pass at least one file or directory")
    files: list[str] = []
    for path in inputs:
        if os.path.isfile(path):
            files.append(path)
        elif os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                found.extend(os.path.join(root, n) for n in names
                             if not n.startswith(".") and n.endswith(TEXT_SUFFIXES + (".jsonl",)))
            files.extend(sorted(found))
        else:
            raise FileNotFoundError(f"input {path} does not exist: pass existing files or directories to --input")
    if not files:
        raise ValueError(
            f"empty corpus: no {' '.join(TEXT_SUFFIXES + ('.jsonl',))} files under {inputs}"
        )
    return files


def _is_jsonl(path: str) -> bool:
    return path.endswith(JSONL_SUFFIXES)


def iter_work_items(files: list[str]) -> Iterator[WorkItem]:
    """One item per text file, one per non-blank JSONL line (read lazily, in order)."""
    for path in files:
        if not _is_jsonl(path):
            yield WorkItem(path=path)
            continue
        try:
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, start=1):
                    if line.strip():
                        yield WorkItem(path=path, line_number=number, line=line)
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not UTF-8 text ({err}); re-encode it as UTF-8") from err
        except OSError as err:
            raise ValueError(f"{path}: cannot read ({err})") from err


def read_text(item: WorkItem, *, json_key: str) -> str:
    """The document text of ``item``; raises ValueError naming file (and line) for bad input."""
    if item.line is None:
        try:
            with open(item.path, encoding="utf-8") as f:
                return f.read()
        except UnicodeDecodeError as err:
            raise ValueError(f"{item.path}: not UTF-8 text ({err}); re-encode it as UTF-8") from err
        except OSError as err:
            raise ValueError(f"{item.path}: cannot read ({err})") from err
    where = f"{item.path}:{item.line_number}"
    try:
        record = json.loads(item.line)
    except ValueError as err:
        raise ValueError(f"{where}: invalid JSON ({err})") from err
    if not isinstance(record, dict) or json_key not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where}: no key {json_key!r} (found {keys}); pass the right --json-key")
    text = record[json_key]
    if not isinstance(text, str):
        raise ValueError(f"{where}: {json_key!r} is a {type(text).__name__}, expected a string")
    return text


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(spec: str, eod_token: str | None):
    # One load per worker process (the cache lives in that process), not one per document.
    return load_tokenizer(spec, eod_token=eod_token)


def _worker_init() -> None:
    # Parallelism comes from processes; a Rust thread pool per worker would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def encode_item(item: WorkItem, *, spec: str, eod_token: str | None, json_key: str,
                dtype: str = "int64") -> np.ndarray | None:
    """Token ids of one document plus EOD in ``dtype``, or None for an empty document."""
    text = read_text(item, json_key=json_key)
    if not text:
        return None
    tok = _cached_tokenizer(spec, eod_token)
    ids = np.fromiter(tok.encode(text), dtype=np.int64)
    if ids.size and not 0 <= int(ids.min()) <= int(ids.max()) < tok.vocab_size:
        where = f"{item.path}:{item.line_number}" if item.line is not None else item.path
        raise ValueError(f"{where}: the tokenizer produced ids outside [0, {tok.vocab_size}), its vocab size")
    out = np.empty(ids.size + 1, dtype=dtype)  # checked above, so the narrowing cast is exact
    out[:-1] = ids
    out[-1] = tok.eod_id
    return out


def _iter_texts(files: list[str], json_key: str) -> Iterator[str]:
    for item in iter_work_items(files):
        text = read_text(item, json_key=json_key)
        if text:
            yield text


def _prepare_tokenizer(tokenizer: str, *, files: list[str], json_key: str, vocab_size: int,
                       eod_token: str | None, save_path: str):
    """Resolve/train the tokenizer and save it to ``save_path``; return (tokenizer, spec for workers)."""
    if tokenizer == "bpe":
        tok = train_bpe_tokenizer(_iter_texts(files, json_key), vocab_size=vocab_size)
    elif tokenizer == "byte":
        tok = ByteTokenizer()
    else:
        tok = load_tokenizer(tokenizer, eod_token=eod_token)
    tok.save(save_path)
    spec = "byte" if isinstance(tok, ByteTokenizer) else save_path
    return tok, spec


def tokenizer_path_for(output_prefix: str) -> str:
    """Where preprocessing saves the tokenizer: ``PREFIX.tokenizer.json``."""
    return output_prefix + ".tokenizer.json"


def preprocess(inputs: list[str], output_prefix: str, *, tokenizer: str = "bpe", json_key: str = "text",
               workers: int = 1, vocab_size: int = 4096, eod_token: str | None = None, chunksize: int = 16,
               progress: bool = True) -> PreprocessStats:
    """Tokenize ``inputs`` into ``output_prefix.{bin,idx}`` and save the tokenizer beside them.

    The saved tokenizer is ``output_prefix.tokenizer.json`` (plus ``.tokenizer_config.json`` for
    HF/BPE tokenizers). ``tokens`` in the result counts every written id, EODs included. With
    ``workers > 1`` call this under ``if __name__ == "__main__":`` (spawned workers re-import main).
    """
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")
    if chunksize < 1:
        raise ValueError(f"chunksize={chunksize} must be >= 1")
    if not json_key:
        raise ValueError("json_key is empty: pass the JSONL field holding the text, e.g. --json-key text")
    files = discover_files(list(inputs))
    parent = os.path.dirname(os.path.abspath(output_prefix))
    created = _missing_dirs(parent)
    os.makedirs(parent, exist_ok=True)
    # The tokenizer (and its config) is staged in a private directory and renamed beside the data last.
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(output_prefix)}.tokenizer.tmp.", dir=parent)
    try:
        return _preprocess(files, list(inputs), output_prefix, staging=staging, tokenizer=tokenizer, json_key=json_key,
                           workers=workers, vocab_size=vocab_size, eod_token=eod_token, chunksize=chunksize,
                           progress=progress)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # before the directories holding it
        for d in reversed(created):  # a fresh prefix's directories, innermost first, if still empty
            try:
                os.rmdir(d)
            except OSError:
                break
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # empty after a success


def _missing_dirs(path: str) -> list[str]:
    """The directories ``os.makedirs(path)`` would create, outermost first."""
    missing = []
    while path and not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing[::-1]


def _commit_tokenizer(staging: str, output_prefix: str) -> None:
    """Move the staged tokenizer files beside the data (their final names); a config the new tokenizer
    does not have (an earlier HF tokenizer's) is removed, so every file of the prefix is of this run."""
    saved = os.path.join(staging, "tokenizer.json")
    final = tokenizer_path_for(output_prefix)
    os.replace(saved, final)
    staged_config, final_config = _config_path(saved), _config_path(final)
    if os.path.exists(staged_config):
        os.replace(staged_config, final_config)
    elif os.path.exists(final_config):
        os.remove(final_config)


def _preprocess(files: list[str], inputs: list[str], output_prefix: str, *, staging: str, tokenizer: str, json_key: str,
                workers: int, vocab_size: int, eod_token: str | None, chunksize: int,
                progress: bool) -> PreprocessStats:
    start = time.perf_counter()
    tok, spec = _prepare_tokenizer(tokenizer, files=files, json_key=json_key, vocab_size=vocab_size,
                                   eod_token=eod_token, save_path=os.path.join(staging, "tokenizer.json"))
    tokenizer_seconds = time.perf_counter() - start
    start = time.perf_counter()
    builder = IndexedDatasetBuilder(output_prefix, vocab_size=tok.vocab_size)
    # Workers return the .bin dtype (uint16 for small vocabularies): a quarter of int64's pickling.
    encode = functools.partial(encode_item, spec=spec, eod_token=eod_token, json_key=json_key,
                               dtype=builder.dtype.name)
    documents = skipped = tokens = 0
    from tqdm import tqdm

    bar = tqdm(unit="doc", desc="tokenizing", disable=not progress, file=sys.stderr, mininterval=0.5)
    pool = None
    try:
        items = iter_work_items(files)
        if workers == 1:
            results = map(encode, items)
        else:
            pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_worker_init)
            results = pool.imap(encode, items, chunksize=chunksize)
        for ids in results:
            bar.update(1)
            if ids is None:
                skipped += 1
                continue
            builder.add_document(ids)
            documents += 1
            tokens += len(ids)
        if documents == 0:
            raise ValueError(
                f"empty corpus: every document in {inputs} has empty text ({skipped} skipped)"
            )
        builder.finalize()
        _commit_tokenizer(staging, output_prefix)
    except BaseException:
        builder.discard()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    seconds = time.perf_counter() - start
    return PreprocessStats(documents=documents, skipped_empty=skipped, tokens=tokens, seconds=seconds,
                           tokenizer_seconds=tokenizer_seconds, tokenizer_path=tokenizer_path_for(output_prefix),
                           workers=workers)
