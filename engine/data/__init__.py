"""Data: Megatron-compatible indexed datasets, sample/blending indices, packing."""
