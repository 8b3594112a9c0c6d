"""The `triton` and `flashinfer` backends against `torch_native` through the same ForwardBatch.

Each case is a random batch of mixed lengths whose prefixes run from 0 to the whole sequence but
one token, over the head layouts a Llama-family model uses (MHA, GQA 2:1 and 4:1, MQA), head
sizes 32 and 64, page sizes 1 and 4 and float32 / float16 / bfloat16, for both an extend
(prefill) step and a decode step. The layer's `forward` writes the new tokens' K/V into the pool
first, as in a real model. Tolerances per dtype are in `batches.TOLERANCES`.

Triton cases run in Triton's CPU interpreter by default; `ARBORLM_TEST_DEVICE=cuda` runs them,
and the FlashInfer cases, on a GPU. FlashInfer cases skip without CUDA or flashinfer; its
float32 fallback (the Triton kernels) and its missing-package error are tested on CPU too.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from arborlm.errors import ArborLMError
from arborlm.runtime.attention.registry import create_attention_backend
from arborlm.runtime.attention.torch_native import TorchNativeBackend
from tests.runtime.attention.batches import (
    DEVICE,
    Case,
    assert_close,
    make_case,
    run_backend,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (num_heads, num_kv_heads, head_dim, page_size): each layout once, head sizes and page sizes
# spread over them. MQA uses 3 query heads so that the padded head rows of a tile are exercised.
LAYOUTS = {
    "mha": (2, 2, 32, 1),
    "gqa2": (4, 2, 64, 4),
    "gqa4": (8, 2, 32, 4),
    "mqa": (3, 1, 64, 1),
}
# FlashInfer builds kernels for head sizes 64/128/256 and a fixed set of group sizes only.
FLASHINFER_LAYOUTS = {
    "mha": (4, 4, 64, 1),
    "gqa2": (4, 2, 64, 4),
    "gqa4": (8, 2, 64, 4),
    "mqa": (4, 1, 128, 1),
}


def _random_case(layout: tuple[int, int, int, int], dtype: torch.dtype, decode: bool,
                 seed: int) -> Case:
    """Four requests: a fresh prompt, one new token on a long prefix, and two random splits."""
    heads, kv_heads, head_dim, page = layout
    gen = torch.Generator().manual_seed(seed)
    totals = torch.randint(2, 48, (4,), generator=gen).tolist()
    if decode:
        prefix = [t - 1 for t in totals]
        prefix[0] = 0  # a request whose only token is the new one
        extend = [1] * 4
    else:
        cuts = [0, totals[1] - 1] + [int(torch.randint(0, t, (1,), generator=gen))
                                     for t in totals[2:]]
        prefix, extend = cuts, [t - c for t, c in zip(totals, cuts)]
    return make_case(prefix, extend, heads, kv_heads, head_dim, page, dtype, decode=decode,
                     seed=seed)


def _check(backend_name: str, layout: tuple[int, int, int, int], dtype: torch.dtype,
           decode: bool) -> None:
    seed = sum(layout) * 10 + DTYPES.index(dtype) * 2 + int(decode)
    case = _random_case(layout, dtype, decode, seed)
    expected = run_backend(TorchNativeBackend(), case)
    actual = run_backend(create_attention_backend(backend_name, DEVICE), case)
    assert actual.dtype == dtype and actual.shape == expected.shape
    assert_close(actual, expected, dtype)


@pytest.mark.triton_interpret
@pytest.mark.parametrize("decode", [False, True], ids=["extend", "decode"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_triton_matches_torch_native(layout, dtype, decode):
    _check("triton", LAYOUTS[layout], dtype, decode)


@pytest.mark.triton_interpret
def test_triton_backend_keeps_steps_apart():
    """One backend object serves an extend step, then a decode step of other requests."""
    backend = create_attention_backend("triton", DEVICE)
    for decode in (False, True):
        case = _random_case(LAYOUTS["gqa2"], torch.float32, decode, seed=99)
        assert_close(run_backend(backend, case), run_backend(TorchNativeBackend(), case),
                     torch.float32)


def _skip_without_flashinfer() -> None:
    if DEVICE != "cuda" or not torch.cuda.is_available():
        pytest.skip("flashinfer needs an NVIDIA GPU (run with ARBORLM_TEST_DEVICE=cuda)")
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed")


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [False, True], ids=["extend", "decode"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("layout", list(FLASHINFER_LAYOUTS))
def test_flashinfer_matches_torch_native(layout, dtype, decode):
    """float32 pools go through FlashInfer's Triton fallback; half precision through FlashInfer."""
    _skip_without_flashinfer()
    _check("flashinfer", FLASHINFER_LAYOUTS[layout], dtype, decode)


@pytest.mark.triton_interpret
def test_flashinfer_backend_serves_float32_through_triton():
    """FlashInfer has no float32 kernels; a float32 pool goes to the Triton kernels instead."""
    for decode in (False, True):
        case = _random_case(LAYOUTS["gqa4"], torch.float32, decode, seed=7)
        backend = create_attention_backend("flashinfer", DEVICE)
        assert_close(run_backend(backend, case), run_backend(TorchNativeBackend(), case),
                     torch.float32)


def test_flashinfer_missing_is_a_clear_error():
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("flashinfer is installed")
    case = _random_case(LAYOUTS["gqa2"], torch.bfloat16, False, seed=8)
    with pytest.raises(ArborLMError, match="flashinfer-python"):
        create_attention_backend("flashinfer", DEVICE).init_forward_metadata(case.batch)
