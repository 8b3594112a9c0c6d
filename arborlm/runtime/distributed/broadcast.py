"""What rank 0 broadcasts to the other tensor-parallel ranks, and how they rebuild it.

Rank 0 owns the scheduler, the radix cache, the KV slot allocator and the grammars; the other
ranks own only their share of the weights and of the KV pool (their KV heads, the same slots).
Before each forward rank 0 sends a `RankCommand` holding the batch: token ids, positions, KV
slots of the new tokens, sequence lengths, the rows of logits wanted, and the `req_to_token`
rows of the batch's requests (the KV slots of their whole sequences, which only rank 0's
scheduler writes). The other ranks write those rows into their own `req_to_token` table and run
the same forward; every rank gets the gathered logits, and rank 0's scheduler samples from its
copy. (Whole rows, every step: the prefix cache may repoint a running request's row at other
slots holding the same keys, so a row's earlier entries are not fixed.) A keep-alive command
holds the ranks' collectives inside their timeout while rank 0 idles; a stop command ends them.

Not here: the process group (`group.py`) or the processes (`launch.py`).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from arborlm.runtime.forward_batch import ForwardBatch, ForwardMode
from arborlm.runtime.memory_pool import KVPool, ReqToTokenPool

_TENSORS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")
_LISTS = ("seq_lens_cpu", "extend_prefix_lens_cpu", "extend_seq_lens_cpu")
# The ForwardBatch fields each rank has of its own, or builds in its forward.
_RANK_LOCAL = ("req_to_token_pool", "kv_pool", "attn_backend", "attn_metadata")


class CommandKind(enum.Enum):
    FORWARD = "forward"
    KEEP_ALIVE = "keep_alive"
    STOP = "stop"


@dataclass
class RankCommand:
    """One broadcast from rank 0; `batch` holds a FORWARD's tensors (CPU) and lengths."""

    kind: CommandKind
    batch: dict[str, Any] = field(default_factory=dict)


def forward_command(batch: ForwardBatch) -> RankCommand:
    """The FORWARD command for `batch` as rank 0's scheduler built it."""
    known = {*_TENSORS, *_LISTS, *_RANK_LOCAL, "mode", "batch_size", "logits_indices"}
    assert {f.name for f in dataclasses.fields(batch)} == known, \
        "ForwardBatch has a field that tensor parallelism does not broadcast"
    longest = max(batch.seq_lens_cpu)
    rows = batch.req_to_token_pool.req_to_token[batch.req_pool_indices, :longest]  # [B, L]
    logits = batch.logits_indices
    return RankCommand(CommandKind.FORWARD, {
        **{name: getattr(batch, name).cpu() for name in _TENSORS},
        **{name: list(getattr(batch, name)) for name in _LISTS},
        "mode": batch.mode.value, "batch_size": batch.batch_size,
        "logits_indices": None if logits is None else logits.cpu(),
        "req_to_token_rows": rows.cpu()})


def forward_batch_of(cmd: RankCommand, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool,
                     device: str) -> ForwardBatch:
    """A worker rank's `ForwardBatch` for rank 0's FORWARD `cmd`, after writing the batch's
    `req_to_token` rows into this rank's table."""
    assert cmd.kind is CommandKind.FORWARD, cmd.kind
    b = cmd.batch
    dev = {name: b[name].to(device) for name in _TENSORS}
    table = req_to_token_pool.req_to_token
    rows = b["req_to_token_rows"].to(table.device)  # [B, L]
    for i, length in enumerate(b["seq_lens_cpu"]):
        table[int(b["req_pool_indices"][i]), :length] = rows[i, :length]
    logits = b["logits_indices"]
    return ForwardBatch(
        mode=ForwardMode(b["mode"]), batch_size=b["batch_size"],
        req_to_token_pool=req_to_token_pool, kv_pool=kv_pool,
        logits_indices=None if logits is None else logits.to(device),
        **{name: b[name] for name in _LISTS}, **dev)
