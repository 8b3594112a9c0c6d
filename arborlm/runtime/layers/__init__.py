"""Model building blocks: RMSNorm, rotary embeddings (incl. Llama 3 scaling), fused linears."""
