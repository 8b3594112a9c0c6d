"""Attention backends over the paged KV pool: torch_native (CPU/GPU reference), triton, flashinfer."""
