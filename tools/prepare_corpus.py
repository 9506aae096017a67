"""Prepare the bundled corpus: this interpreter's standard library, tokenized (no network).

    .venv/bin/python tools/prepare_corpus.py [--output-dir data/stdlib_corpus] [--max-mb 6]
        [--content source|docstrings|both] [--tokenizer bpe|byte] [--vocab-size 4096] [--workers 1] [--force]

Writes OUTPUT_DIR/text_document.{bin,idx}, text_document.tokenizer.json (+ _config.json),
raw.jsonl (the documents) and manifest.json. Running it again with the same options is a no-op
(it checks the manifest and the output sizes). Train on the prefix OUTPUT_DIR/text_document.
"""
from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from engine.data.corpus import CONTENT_KINDS, CorpusConfig, default_stdlib_root, prepare_stdlib_corpus  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default=os.path.join(REPO, "data", "stdlib_corpus"))
    p.add_argument("--root", default=None, help="standard library directory (default: this interpreter's)")
    p.add_argument("--max-mb", type=float, default=6.0, help="text size cap in MB (default 6)")
    p.add_argument("--max-file-kb", type=int, default=200, help="skip files larger than this (default 200 KB)")
    p.add_argument("--content", choices=CONTENT_KINDS, default="source")
    p.add_argument("--tokenizer", default="bpe", help="bpe (default), byte, or a tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--force", action="store_true", help="rebuild even when an up-to-date corpus exists")
    args = p.parse_args(argv)
    try:
        config = CorpusConfig(root=args.root or default_stdlib_root(), max_bytes=int(args.max_mb * 1e6),
                              max_file_bytes=args.max_file_kb * 1000, content=args.content,
                              tokenizer=args.tokenizer, vocab_size=args.vocab_size)
        manifest = prepare_stdlib_corpus(args.output_dir, config=config, workers=args.workers, force=args.force,
                                         progress=True)
    except (ValueError, OSError) as err:
        print(f"prepare_corpus.py: error: {err}", file=sys.stderr)
        return 2
    out = manifest["outputs"]
    prefix = os.path.join(args.output_dir, "text_document")
    if manifest["skipped"]:
        print(f"corpus up to date: {prefix} ({out['documents']} documents, {out['tokens']} tokens)")
    else:
        t = manifest["timing"]
        print(f"wrote {prefix}.bin/.idx: {out['documents']} documents, {out['text_bytes'] / 1e6:.2f} MB text, "
              f"{out['tokens']} tokens; tokenizer {t['tokenizer_seconds']:.1f} s, encoding "
              f"{t['tokens_per_second']:,} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
