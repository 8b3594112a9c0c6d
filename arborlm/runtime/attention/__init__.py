"""Attention backends over the paged KV pool: torch_native (reference), triton, flashinfer."""
