"""Triton kernels for paged attention over the KV pool: decode (split-K) and extend (prefill).

Importing this package imports Triton; only `arborlm.runtime.attention.triton_backend` does so,
and only when the `triton` backend is chosen. Set `TRITON_INTERPRET=1` before the first import
to run the kernels on CPU in Triton's interpreter (the kernel tests do).
"""

from arborlm.runtime.attention.triton_kernels.common import INTERPRET
from arborlm.runtime.attention.triton_kernels.decode_attention import (
    MAX_KV_SPLITS,
    decode_attention_fwd,
    num_kv_splits,
    request_kv_splits,
)
from arborlm.runtime.attention.triton_kernels.extend_attention import extend_attention_fwd

__all__ = ["INTERPRET", "MAX_KV_SPLITS", "decode_attention_fwd", "extend_attention_fwd",
           "num_kv_splits", "request_kv_splits"]
