"""Tokenize text into a Megatron-compatible indexed dataset: PREFIX.bin + PREFIX.idx.

    python tools/preprocess_data.py --input corpus.jsonl docs/ --output-prefix data/my/text_document \
        [--tokenizer bpe|byte|path/to/tokenizer.json] [--json-key text] [--workers 2] [--vocab-size 4096]

Inputs: JSONL files (one document per line, text under --json-key), plain text files (one document
each), and directories (walked recursively for .txt .md .rst .py .jsonl). Every document is
followed by the tokenizer's end-of-document id. The tokenizer is saved beside the data as
PREFIX.tokenizer.json (+ PREFIX.tokenizer_config.json naming the EOD token for bpe / HF
tokenizers); training loads it from there when data.tokenizer is unset, and refuses a data.tokenizer of
another vocabulary. See docs/data.md.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.data.preprocess import preprocess  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files and/or directories")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.tokenizer.json")
    p.add_argument("--tokenizer", default="bpe",
                   help="'bpe' (train a byte-level BPE on the inputs; default), 'byte', or a tokenizer.json")
    p.add_argument("--json-key", default="text", help="JSONL field holding the document text (default: text)")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size of a trained 'bpe' (default 4096)")
    p.add_argument("--eod-token", default=None,
                   help="end-of-document token of a HF tokenizer.json when it cannot be inferred")
    p.add_argument("--chunksize", type=int, default=16, help="documents per worker task (default 16)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        stats = preprocess(
            args.input, args.output_prefix, tokenizer=args.tokenizer, json_key=args.json_key,
            workers=args.workers, vocab_size=args.vocab_size, eod_token=args.eod_token,
            chunksize=args.chunksize, progress=not args.no_progress,
        )
    except (ValueError, OSError) as err:
        print(f"preprocess_data.py: error: {err}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.output_prefix}.bin/.idx: {stats.documents} documents, {stats.tokens} tokens "
        f"({stats.skipped_empty} empty skipped); tokenizer {stats.tokenizer_path} "
        f"(ready in {stats.tokenizer_seconds:.2f} s)\n"
        f"encoded in {stats.seconds:.2f} s with {stats.workers} worker(s): {stats.tokens_per_second:,.0f} tokens/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
