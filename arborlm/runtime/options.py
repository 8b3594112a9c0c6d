"""The engine's options with a fixed set of values, each declared once as a `StrEnum`.

`EngineMode`, `DType`, `AttentionBackend`, `SchedulePolicy`, `Quantization`,
`GrammarBackendName` and `SpeculativeAlgorithm`, and the helpers that read them: the CLI's
`choices=` (`choices`), `resolve()`'s and the server's checks (`check_choice`) and documented
dataclass fields (`option`). Fields keep plain `str` values: a member equals its value.
`arborlm.runtime.config` re-exports every name here.
"""

from __future__ import annotations

import enum
from dataclasses import field
from typing import Any

import torch

from arborlm.constrained import GRAMMAR_BACKENDS
from arborlm.errors import InvalidRequestError


class EngineMode(enum.StrEnum):
    """Where the scheduler runs: a thread of the caller's process, or child processes."""

    INPROCESS = "inprocess"
    MULTIPROCESS = "multiprocess"


class DType(enum.StrEnum):
    """Weight and activation dtype; `auto` is resolved from the CPU and the checkpoint."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class AttentionBackend(enum.StrEnum):
    """Attention implementation; `auto` is resolved from the device (`resolve()`)."""

    AUTO = "auto"
    TORCH_NATIVE = "torch_native"
    TRITON = "triton"
    FLASHINFER = "flashinfer"


class SchedulePolicy(enum.StrEnum):
    """Order of the scheduler's waiting queue (see `scheduler/policy.py`)."""

    FCFS = "fcfs"
    LPM = "lpm"
    DFS_WEIGHT = "dfs-weight"


class Quantization(enum.StrEnum):
    """`quantization`: a GGUF block type a float checkpoint's linears are quantized to at load,
    or `gguf`, a GGUF file's quantized linears kept as the file packs them."""

    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    Q5_0 = "q5_0"
    Q5_1 = "q5_1"
    Q4_K = "q4_k"
    Q6_K = "q6_k"
    GGUF = "gguf"


# The grammar engines, as `arborlm.constrained` (their registry) names them.
GrammarBackendName = enum.StrEnum(
    "GrammarBackendName", {name.upper(): name for name in GRAMMAR_BACKENDS})

DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16,
          DType.FLOAT16: torch.float16}


class SpeculativeAlgorithm(enum.StrEnum):
    NGRAM = "NGRAM"
    STANDALONE = "STANDALONE"


# Limits on the speculative options.
MAX_DRAFT_TOKENS = 64
MAX_NGRAM_WINDOW = 64


def choices(kind: type[enum.StrEnum]) -> tuple[str, ...]:
    """The values of `kind` as plain strings, in declaration order (argparse `choices=`)."""
    return tuple(member.value for member in kind)


def check_choice(kind: type[enum.StrEnum], value: str, param: str) -> str:
    """`value` when it is one of `kind`'s values, else `InvalidRequestError` naming `param`."""
    allowed = choices(kind)
    if value not in allowed:
        raise InvalidRequestError(f"{param} must be one of {', '.join(allowed)}, got {value!r}",
                                  param)
    return value


def option(text: str, **kw: Any) -> Any:
    """A dataclass field whose `help` metadata documents it (the CLI's help text)."""
    return field(metadata={"help": text}, **kw)
