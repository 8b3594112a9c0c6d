"""Platform code: what runs only on one kind of device, reached through registries.

`cpu/` holds everything CPU-specific (ArborLM's C++ kernels and their build, CPU linears,
the CPU attention backend with its decode workspace and cascade, the fused and compiled decode
steps, huge pages and allocator tuning); `cuda/` the CUDA-graph decode executor. Generic code
reaches a platform through a registry: `platforms.registry.choose_decode_executor`,
`layers.registry.ops_for` (the layers' elementwise operators) and
`attention.registry.create_attention_backend`. This `__init__` imports nothing, so that importing
any platform module never runs a registry.
"""
