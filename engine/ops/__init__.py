"""Fused ops, one file per op. A leaf package: imports torch/triton and engine._native only."""
