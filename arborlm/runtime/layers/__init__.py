"""Model building blocks: RMSNorm, rotary embeddings (incl. Llama 3 scaling), SwiGLU, and the
registry of the elementwise operators they call (`registry.ops_for`)."""
