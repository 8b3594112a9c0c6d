"""`TPShard`: which part of each weight a tensor-parallel rank holds (Megatron-style).

Column-parallel linears (q/k/v, gate/up) keep a slice of their output rows; row-parallel ones
(o, down) the matching slice of their input columns, and their outputs are summed over the
ranks (an all-reduce). Attention heads split evenly; KV heads too, or, when there are fewer KV
heads than ranks, each rank keeps the one KV head its query heads read (replicated on
`size / num_kv_heads` ranks). The embedding and the LM head are split by vocabulary rows, each
rank holding `ceil(vocab / size)` rows (the last padded with zeros).

A row-parallel bias is added once: rank 0 keeps it, the others hold zeros. Norms and rotary
tables are replicated. Packed GGUF weights (`take_packed`, `--quantization`) split the same way
on whole blocks: a column-parallel linear keeps its rows' blocks, a row-parallel one the bytes of
its input columns' blocks, which needs each rank's input width to be a whole number of blocks
(`check_blocks`). This module is pure arithmetic on shapes and tensors; it sends nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborlm.errors import ModelLoadError
from arborlm.runtime.config import ModelConfig


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size`: the head, KV-head, intermediate and vocabulary ranges it holds."""

    rank: int
    size: int
    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads
    kv_head_start: int  # first global KV head this rank holds
    intermediate_size: int  # local MLP width
    vocab_rows: int  # local embedding / LM-head rows (padded)
    head_dim: int

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, size: int = 1) -> TPShard:
        """The shard of rank `rank`; `ModelLoadError` when the model cannot split `size` ways."""
        heads, kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
        problems = []
        if heads % size:
            problems.append(f"{heads} attention heads")
        if kv % size and size % kv:
            problems.append(f"{kv} KV heads (neither a multiple nor a divisor of it)")
        if inter % size:
            problems.append(f"an MLP width of {inter}")
        if problems:
            raise ModelLoadError(f"{config.path}: tp_size {size} does not divide "
                                 + ", ".join(problems))
        local_kv = max(1, kv // size)
        kv_start = rank * local_kv if kv >= size else rank // (size // kv)
        return cls(rank=rank, size=size, num_heads=heads // size, num_kv_heads=local_kv,
                   kv_head_start=kv_start, intermediate_size=inter // size,
                   vocab_rows=-(-config.vocab_size // size), head_dim=config.head_dim)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def row_parallel_widths(self) -> dict[str, int]:
        """Each row-parallel linear kind -> the input columns one rank holds."""
        return {"o_proj": self.num_heads * self.head_dim, "down_proj": self.intermediate_size}

    def check_blocks(self, block: int, qtype: str) -> None:
        """`ModelLoadError` when a rank's input columns of a row-parallel linear would cut one
        of `qtype`'s `block`-value blocks (a block's scale covers values of two ranks)."""
        if self.size == 1:
            return
        cut = [f"{kind} input of {width} values" for kind, width in
               self.row_parallel_widths().items() if width % block]
        if cut:
            raise ModelLoadError(f"tp_size {self.size} cuts {qtype} blocks of {block} values: "
                                 f"each rank's {' and '.join(cut)} is not a multiple of {block}")

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (Hugging Face names); the whole tensor
        for replicated ones."""
        if self.size == 1:
            return tensor
        module, _, leaf = name.rpartition(".")
        kind = module.rpartition(".")[2]
        rows = self._column_rows(kind)
        if rows is not None:
            return _rows(tensor, *rows)
        if kind in self.row_parallel_widths():
            if leaf == "bias":
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            width = self.row_parallel_widths()[kind]
            return tensor.narrow(1, self.rank * width, width)
        if kind in ("embed_tokens", "lm_head"):
            part = tensor[self.vocab_start:self.vocab_start + self.vocab_rows]
            if part.shape[0] == self.vocab_rows:
                return part
            pad = tensor.new_zeros(self.vocab_rows - part.shape[0], *tensor.shape[1:])
            return torch.cat([part, pad])
        return tensor


    def take_packed(self, name: str, blocks: torch.Tensor, block: int, type_size: int
                    ) -> torch.Tensor:
        """This rank's part of linear weight `name` stored as GGUF rows `blocks` `[out, row
        bytes]` uint8 of `block`-value blocks of `type_size` bytes: its rows' blocks
        (column-parallel) or, in every row, the blocks of its input columns (row-parallel;
        `check_blocks` first). A fresh tensor, not a view of the whole."""
        if self.size == 1:
            return blocks
        kind = name.removesuffix(".weight").rpartition(".")[2]
        rows = self._column_rows(kind)
        if rows is not None:
            return _rows(blocks, *rows).clone()
        width = self.row_parallel_widths()[kind]
        assert width % block == 0, (name, width, block)  # check_blocks refused it
        row_bytes = width // block * type_size
        return blocks.narrow(1, self.rank * row_bytes, row_bytes).contiguous()

    def _column_rows(self, kind: str) -> tuple[int, int] | None:
        """(first row, rows) this rank keeps of a column-parallel linear kind; None for others."""
        d = self.head_dim
        if kind == "q_proj":
            return self.rank * self.num_heads * d, self.num_heads * d
        if kind in ("k_proj", "v_proj"):
            return self.kv_head_start * d, self.num_kv_heads * d
        if kind in ("gate_proj", "up_proj"):
            return self.rank * self.intermediate_size, self.intermediate_size
        return None


def _rows(tensor: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return tensor.narrow(0, start, length)
