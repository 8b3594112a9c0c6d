"""`ForwardBatch`: the tensors one model forward step consumes.

Built by the model runner from a scheduled batch. Every tensor lives on the model's device.
Mode EXTEND covers prefill and chunked prefill (new tokens on top of a cached prefix); DECODE is
one new token per request. The attention backend reads `req_to_token`, `seq_lens`, the extend
lengths and `out_cache_loc` and keeps its own derived metadata in `attn_metadata`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from arborlm.runtime.memory_pool import KVPool, ReqToTokenPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64, T = total new tokens
    positions: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64 rows of req_to_token
    seq_lens: torch.Tensor  # [B] int64, length of each sequence after this step
    out_cache_loc: torch.Tensor  # [T] int64, KV slot of each new token
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool
    # Python copies of the lengths, for host-side loops and metadata.
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)  # [B], EXTEND only
    extend_seq_lens_cpu: list[int] = field(default_factory=list)  # [B], EXTEND only
    # Rows of the final hidden states whose logits are needed, [N] int64.
    logits_indices: torch.Tensor | None = None
    attn_backend: Any = None
    attn_metadata: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
