"""Bundled post-training data (JSONL) and the deterministic scripts that write it; see README.md."""
