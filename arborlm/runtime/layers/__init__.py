"""Model building blocks: RMSNorm, rotary embeddings (incl. Llama 3 scaling), SwiGLU activation,
and CPU linears that pick the fastest kernel per batch size (oneDNN-packed weights)."""
