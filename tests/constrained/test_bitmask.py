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


@pytest.fixture(params=["kernel", "numpy"])
def float32_path(request, monkeypatch) -> str:
    """float32 logits through the C++ kernel (skipped where the operators cannot be built) or
    through the numpy path it replaces."""
    from arborlm.constrained import bitmask
    from arborlm.runtime.platforms.cpu import kernels

    if request.param == "kernel":
        if not kernels.token_bitmask_available():
            pytest.skip("the CPU operators are not built here")
        calls = []
        real = kernels.apply_token_bitmask
        monkeypatch.setattr(kernels, "apply_token_bitmask",
                            lambda *args: (calls.append(args), real(*args)))
        yield request.param
        assert calls, "the kernel was not used"
    else:
        monkeypatch.setattr(bitmask, "_kernel_available", lambda: False)
        yield request.param


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 33, 300, 49157])
def test_float32_paths_match_the_reference(float32_path: str, vocab: int) -> None:
    """Vocabularies that end inside a 16-lane vector and inside a 32-bit word."""
    mask = _mask(3, vocab, 0.3, seed=vocab)
    logits = torch.randn(3, vocab)
    rows = [0, 2]
    if vocab > 1000:  # the reference, vectorized per row
        expected = logits.clone()
        for r in rows:
            bits = torch.tensor([(int(mask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)])
            expected[r, bits == 0] = float("-inf")
    else:
        expected = _reference(logits, mask, rows)
    apply_token_bitmask_(logits, mask, rows)
    assert torch.equal(logits, expected)


def test_kernel_rejects_a_row_outside_the_batch() -> None:
    from arborlm.runtime.platforms.cpu import kernels

    if not kernels.token_bitmask_available():
        pytest.skip("the CPU operators are not built here")
    with pytest.raises(RuntimeError, match="row 2 outside"):
        kernels.apply_token_bitmask(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32),
                                    [2], 64)
