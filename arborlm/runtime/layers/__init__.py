"""Model building blocks: RMSNorm, rotary embeddings (incl. Llama 3 scaling), SwiGLU activation."""
