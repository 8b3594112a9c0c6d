"""`torch_native`, the reference backend, against a float64 attention computed from the
definition: extend steps with and without cached prefixes, decode steps over scattered slots
and page sizes above 1, in every head layout; and the registry's choice of class per device."""

from __future__ import annotations

import pytest
import torch

from arborlm.runtime.attention.registry import create_attention_backend
from arborlm.runtime.attention.torch_native import TorchNativeBackend
from arborlm.runtime.platforms.cpu.attention import CpuAttentionBackend
from tests.runtime.attention.batches import (
    assert_close,
    dense_reference,
    make_case,
    run_backend,
)

LAYOUTS = {"mha": (2, 2, 32), "gqa2": (4, 2, 64), "gqa4": (8, 2, 32), "mqa": (3, 1, 64)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("decode", [False, True], ids=["extend", "decode"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_matches_dense_reference(layout, dtype, decode, page_size):
    heads, kv_heads, head_dim = LAYOUTS[layout]
    if decode:
        prefix, extend = [0, 5, 40, 17], [1, 1, 1, 1]
    else:
        prefix, extend = [0, 5, 40, 0], [7, 1, 9, 30]
    case = make_case(prefix, extend, heads, kv_heads, head_dim, page_size, dtype, decode=decode,
                     seed=len(layout) + page_size)
    backend = TorchNativeBackend()
    assert_close(run_backend(backend, case), dense_reference(case).to(dtype), dtype)
    # Stateless: the same step again gives the same result.
    assert torch.equal(run_backend(backend, case), run_backend(TorchNativeBackend(), case))


def test_the_registry_serves_torch_native_on_a_cpu_with_the_cpu_backend():
    assert type(create_attention_backend("torch_native", "cpu")) is CpuAttentionBackend
    assert type(create_attention_backend("torch_native", "cuda")) is TorchNativeBackend
    with pytest.raises(ValueError, match="no deterministic mode"):
        create_attention_backend("torch_native", "cuda", deterministic=True)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        create_attention_backend("nope", "cpu")
