"""The CPU platform: ArborLM's C++ kernels and everything that decides on or around them.

`capabilities` (the CPU's instruction sets, read once), `kernels` (the operators' build and
Python entry points, sources in `csrc/`), `ops` (the layers' elementwise operators on them),
`linear` (packed and panel linears), `attention` (the CPU attention backend, with `cascade` and
`decode_workspace`), `fused_decode` and `compiled_decode` (decode executors), `huge_pages` and
`allocator` (memory). Nothing outside `arborlm.runtime.platforms` and the engine's start-up
imports these modules directly; this package imports none of them itself.
"""
