"""The CUDA platform: decode steps replayed from captured CUDA graphs (`graph_runner`).

The Triton and FlashInfer attention backends live with the other backends
(`arborlm.runtime.attention`): they are attention implementations, chosen by name.
"""
