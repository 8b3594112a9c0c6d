"""`apply_token_bitmask_` against a plain reference: dtypes, row subsets, padding, layout."""

from __future__ import annotations

import pytest
import torch

from arborlm.constrained.bitmask import allocate_token_bitmask, apply_token_bitmask_


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    covered = min(logits.shape[1], bitmask.shape[1] * 32)
    for r in rows:
        for t in range(logits.shape[1]):
            allowed = t < covered and (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            if not allowed:
                out[r, t] = float("-inf")
    return out


def _mask(batch: int, vocab: int, density: float, seed: int) -> torch.Tensor:
    """Random mask: `density` of the words fully allowed, the rest partial or empty."""
    gen = torch.Generator().manual_seed(seed)
    mask = allocate_token_bitmask(batch, vocab)  # [B, W]
    words = torch.randint(-2**31, 2**31 - 1, mask.shape, generator=gen, dtype=torch.int64)
    full = torch.rand(mask.shape, generator=gen) < density
    empty = torch.rand(mask.shape, generator=gen) < 0.5
    mask.copy_(torch.where(full, -1, torch.where(empty, 0, words)).to(torch.int32))
    return mask


def test_allocate_is_all_allowed() -> None:
    mask = allocate_token_bitmask(3, 1000)
    assert mask.shape == (3, 32) and mask.dtype == torch.int32 and (mask == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("density", [0.98, 0.05])  # mostly allowed, mostly masked
def test_matches_reference(dtype: torch.dtype, density: float) -> None:
    vocab, batch = 300, 4
    mask = _mask(batch, vocab, density, seed=int(density * 100))
    rows = [0, 2, 3]
    logits = torch.randn(batch, vocab).to(dtype)
    expected = _reference(logits, mask, rows)
    apply_token_bitmask_(logits, mask, torch.tensor(rows))
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[1]).all()  # a row without a grammar is untouched


def test_padded_logits_and_all_rows() -> None:
    mask = _mask(2, 96, 0.5, seed=7)  # covers 96 tokens
    logits = torch.randn(2, 130)  # a wider, padded lm_head
    expected = _reference(logits, mask, [0, 1])
    apply_token_bitmask_(logits, mask)
    assert torch.equal(logits, expected) and torch.isinf(logits[:, 96:]).all()


@pytest.mark.parametrize("density", [0.98, 0.05])
def test_non_contiguous_logits(density: float) -> None:
    mask = _mask(2, 64, density, seed=3)
    base = torch.randn(64, 2)
    logits = base.t()  # [2, 64] non-contiguous view
    expected = _reference(logits, mask, [0, 1])
    apply_token_bitmask_(logits, mask)
    assert torch.equal(logits, expected)


def test_no_rows_is_a_no_op() -> None:
    logits = torch.randn(2, 64)
    before = logits.clone()
    apply_token_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int32), [])
    assert torch.equal(logits, before)
