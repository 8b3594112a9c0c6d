"""Attention backends over the paged KV pool: the interface (`base`), the reference
(`torch_native`), `triton` and `flashinfer`, and the registry that creates them by name
(`registry`)."""
