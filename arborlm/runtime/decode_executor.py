"""`DecodeExecutor`: how decode steps run, one executor per engine, picked at start-up.

A model runner computes extends (prefill) eagerly, through its model and attention backend. A
decode step may instead go through a faster executor, picked once by
`arborlm.runtime.platforms.registry.choose_decode_executor` from what the device and the engine's
options allow, in this order:

- `CudaGraphRunner` (`platforms/cuda/graph_runner.py`): steps replayed from captured CUDA graphs;
- `FusedDecode` (`platforms/cpu/fused_decode.py`): on CPU, a Llama-family step as one C++ call,
  which also runs several greedy steps per call (`run_ahead`);
- `CompiledDecode` (`platforms/cpu/compiled_decode.py`): on CPU with `enable_torch_compile`,
  the model's forward compiled by Inductor (models the fused step does not take);
- `EagerDecode`: none of them; every step runs eagerly. Always so for a model sharded over
  tensor-parallel ranks: the fused C++ step, the compiled step and the captured graphs do not
  run the collectives between its layers.

An executor takes the steps it `can_run`; the runner runs the others (extends, batches too
large or of a shape the executor does not take) eagerly. Executors get the parts of the
runner they need (`DecodeParts`), never the runner itself.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
from torch import nn

from arborlm.runtime.attention.base import AttentionBackend
from arborlm.runtime.config import EngineArgs
from arborlm.runtime.forward_batch import ForwardBatch
from arborlm.runtime.memory_pool import KVPool, ReqToTokenPool


@dataclass(frozen=True, kw_only=True)
class DecodeParts:
    """What a decode executor is built from: the runner's model and memory, not the runner."""

    model: nn.Module
    kv_pool: KVPool
    req_to_token_pool: ReqToTokenPool
    attn_backend: AttentionBackend
    device: str
    args: EngineArgs
    deterministic: bool  # batch-invariant kernels only (no cascade, no compiled sums)
    tp_size: int = 1  # tensor-parallel ranks; sharded models decode eagerly


class DecodeExecutor(abc.ABC):
    """Runs the decode steps it takes; the null twin (`EagerDecode`) takes none."""

    @abc.abstractmethod
    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether `run` takes this batch (a decode step of a size and shape it serves)."""

    @abc.abstractmethod
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[B, vocab]` float32 of a batch that `can_run`."""

    def can_run_ahead(self, batch: ForwardBatch) -> bool:
        """Whether `run_ahead` takes this greedy decode batch (by default no executor does)."""
        return False

    def run_ahead(self, batch: ForwardBatch, slots: torch.Tensor) -> torch.Tensor:
        """Greedy tokens `[S, B]` of S = len(slots) decode steps in one call, the first being
        `batch`'s; step i writes its keys to `slots[i]`. Needs `can_run_ahead`."""
        raise NotImplementedError(f"{type(self).__name__} runs one decode step per call")


class EagerDecode(DecodeExecutor):
    """No executor: every decode step runs eagerly through the model and attention backend."""

    def can_run(self, batch: ForwardBatch) -> bool:
        return False

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError("eager decode steps are the model runner's own")


def decode_fits(batch: ForwardBatch, max_bs: int) -> bool:
    """A decode step of at most `max_bs` requests whose logits are wanted for every row (what
    the executors take; a step that wants fewer rows runs eagerly)."""
    if not batch.mode.is_decode or batch.batch_size > max_bs:
        return False
    rows = batch.logits_indices
    return rows is None or rows.numel() == batch.batch_size
