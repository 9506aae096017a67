"""Print what a Tessel checkpoint holds; ``--verify`` checks every file's sha256.

    .venv/bin/python tools/inspect_checkpoint.py DIR [--verify] [--tensors N]

DIR is a step directory (``.../step_00000010``) or a checkpoint root (then the newest complete
checkpoint is shown, as auto-resume would pick it). Prints the parallel layout, the model config,
every logical tensor (name, global shape, dtype, number of pieces, size), the files with their
sizes, the totals and the trainer state. Exit status: 0 when fine, 1 when a checksum does not
match or a file is missing (with --verify), 2 when DIR is not a readable checkpoint.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.checkpoint.format import CheckpointError, dtype_from_name, read_metadata, resolve_checkpoint  # noqa: E402
from engine.checkpoint.safetensors_io import verify_files  # noqa: E402


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _short_json(value, limit: int = 400) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit] + " ..."


def describe(step_dir: Path, meta: dict, *, max_tensors: int | None) -> list[str]:
    lines = [f"checkpoint {step_dir}", f"  step {meta['step']}, written {meta.get('created')} by "
             f"{meta.get('world_size')} rank(s), format {meta['format']} v{meta['version']}",
             f"  layout: {_short_json(meta.get('layout'))}", f"  model_config: {_short_json(meta.get('model_config'))}"]
    tensors = meta["tensors"]
    total_logical = 0
    rows = []
    for key in sorted(tensors):
        t = tensors[key]
        nbytes = math.prod(t["shape"]) * dtype_from_name(t["dtype"]).itemsize
        total_logical += nbytes
        flat = sum(1 for p in t["pieces"] if p["flat_range"] is not None)
        kind = f"{len(t['pieces'])} pieces" + (f" ({flat} flat)" if flat else "")
        rows.append(f"  {key:<48} {str(tuple(t['shape'])):<18} {t['dtype']:<10} {kind:<20} {_size(nbytes)}")
    lines.append(f"tensors ({len(tensors)}):")
    lines.extend(rows if max_tensors is None else rows[:max_tensors])
    if max_tensors is not None and len(rows) > max_tensors:
        lines.append(f"  ... {len(rows) - max_tensors} more (use --tensors 0 for all)")
    files = meta["files"]
    total_files = sum(f["bytes"] for f in files.values())
    lines.append(f"files ({len(files)}):")
    for name in sorted(files):
        lines.append(f"  {name:<28} rank {files[name]['rank']:<5} {_size(files[name]['bytes']):>12}  "
                     f"sha256 {files[name]['sha256'][:16]}...")
    lines.append(f"total: {_size(total_logical)} of tensor data in {len(tensors)} tensors, "
                 f"{_size(total_files)} on disk in {len(files)} files")
    lines.append(f"trainer_state: {_short_json(meta.get('trainer_state'))}")
    ranks = meta.get("rank_states") or []
    with_state = sum(1 for r in ranks if r)
    lines.append(f"rank_states: {with_state} of {len(ranks)} ranks saved one "
                 f"(keys: {sorted(next((r for r in ranks if r), {}) or [])})")
    return lines


def verify(step_dir: Path, meta: dict) -> list[str]:
    """Problems found (empty when every file matches its recorded sha256 and size)."""
    return verify_files(step_dir, meta["files"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="a step directory or a checkpoint root")
    ap.add_argument("--verify", action="store_true", help="check every file's sha256 (non-zero exit on mismatch)")
    ap.add_argument("--tensors", type=int, default=50, help="show at most N tensors (0: all)")
    args = ap.parse_args(argv)
    try:
        step_dir = resolve_checkpoint(args.dir)
        meta = read_metadata(step_dir)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(describe(step_dir, meta, max_tensors=args.tensors or None)))
    if args.verify:
        problems = verify(step_dir, meta)
        for p in problems:
            print(f"VERIFY FAILED {p}")
        if problems:
            return 1
        print(f"verify: all {len(meta['files'])} files match their sha256")
    return 0


if __name__ == "__main__":
    sys.exit(main())
