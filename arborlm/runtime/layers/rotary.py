"""Rotary position embeddings (RoPE) with a precomputed cos/sin table, incl. Llama 3 scaling.

`rope_parameters(hf_config)` reads the rope settings from a `config.json` dict in either
layout: the classic `rope_theta` + `rope_scaling` keys, or transformers 5's `rope_parameters`.
`RotaryEmbedding` computes the inverse frequencies the way `transformers` does (same formulas,
float32), builds cos/sin for every position up to the context length once, and at run time only
indexes that table by position. The table is stored in the model dtype: `transformers` casts
its float32 cos/sin to the activation dtype before rotating, so this is the same arithmetic.

Supported rope types: default, linear, llama3, and dynamic (NTK) within the original context
(where it equals the default); GGUF files' per-frequency divisors (`rope_freq_factors`, how
llama.cpp stores Llama 3.1 scaling) apply on top of the default. YaRN, LongRoPE and partial
rotary are not supported: they raise `ModelLoadError` when the model is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from arborlm.errors import ModelLoadError


@dataclass(frozen=True)
class RopeParameters:
    """Rope settings resolved from a Hugging Face config."""

    rope_type: str  # "default" | "linear" | "llama3" | "dynamic"
    theta: float
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None  # per-frequency divisors (GGUF rope_freqs)


def rope_parameters(hf: dict[str, Any]) -> RopeParameters:
    """Read rope settings from a `config.json` dict (old or transformers-5 layout)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    partial = merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelLoadError(f"partial rotary embeddings (factor {partial}) are not supported")
    max_pos = hf.get("max_position_embeddings", 4096)
    factors = hf.get("rope_freq_factors")
    if factors is not None and rope_type != "default":
        raise ModelLoadError(f"rope_freq_factors with rope type {rope_type!r}")
    if rope_type == "default":
        return RopeParameters("default", float(theta),
                              freq_factors=None if factors is None else tuple(factors))
    if rope_type in ("linear", "dynamic"):
        return RopeParameters(rope_type, float(theta), factor=float(merged["factor"]))
    if rope_type == "llama3":
        orig = merged.get("original_max_position_embeddings",
                          hf.get("original_max_position_embeddings", max_pos))
        return RopeParameters("llama3", float(theta), factor=float(merged["factor"]),
                              low_freq_factor=float(merged["low_freq_factor"]),
                              high_freq_factor=float(merged["high_freq_factor"]),
                              original_max_position_embeddings=int(orig))
    raise ModelLoadError(f"rope type {rope_type!r} is not supported "
                         "(supported: default, linear, llama3, dynamic)")


def inverse_frequencies(params: RopeParameters, head_dim: int) -> torch.Tensor:
    """`[head_dim // 2]` float32 inverse frequencies, as `transformers` computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (params.theta ** exponents)  # [D/2]
    if params.rope_type == "linear":
        return inv_freq / params.factor
    if params.rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    if params.freq_factors is not None:
        assert len(params.freq_factors) == head_dim // 2
        return inv_freq / torch.tensor(params.freq_factors, dtype=torch.float32)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, p: RopeParameters) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept, the
    band between them interpolated smoothly (transformers' `_compute_llama3_parameters`)."""
    old_ctx = p.original_max_position_embeddings
    low_freq_wavelen = old_ctx / p.low_freq_factor
    high_freq_wavelen = old_ctx / p.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / p.factor, inv_freq)
    smooth = (old_ctx / wavelen - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor)
    smoothed = (1 - smooth) * scaled / p.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """A cos/sin table for positions `[0, max_positions)`, applied to query and key heads.

    Rotation follows the "rotate half" convention of Hugging Face Llama checkpoints: the first
    and second halves of each head are the two coordinates of each rotated pair.
    """

    def __init__(self, head_dim: int, max_positions: int, params: RopeParameters,
                 dtype: torch.dtype, max_position_embeddings: int):
        super().__init__()
        if params.rope_type == "dynamic" and max_positions > max_position_embeddings:
            raise ModelLoadError(
                f"dynamic NTK rope beyond the original {max_position_embeddings} positions is "
                f"not supported; use context_length <= {max_position_embeddings}")
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq = inverse_frequencies(params, head_dim)  # [D/2]
        pos = torch.arange(max_positions, dtype=torch.float32)  # [P]
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2] float32
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        # Full-width tables: cos for both halves; sin negated for the first half, so that
        # rotating is `x * cos + swap_halves(x) * sin`, three elementwise ops and a cat.
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1), persistent=False)  # [P, D]
        self.register_buffer("sin", torch.cat([-sin, sin], dim=-1), persistent=False)  # [P, D]

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for `positions` `[T]`, each `[T, 1, D]` (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads `x` `[T, H, D]` by `cos`/`sin` `[T, 1, D]` (from `lookup`); new `[T, H, D]`.

    `transformers` computes `x * cos + rotate_half(x) * sin` with `rotate_half(x) = [-x2, x1]`;
    here the sign sits in the table (`(-x2) * s == x2 * (-s)` exactly) and the halves are
    swapped by one cat, so every product and sum is the same, in the same dtype: the result is
    identical in bfloat16 too.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)  # [T, H, D]
    return swapped.mul_(sin).add_(x * cos)
