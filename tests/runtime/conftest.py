"""Fixtures of the runtime tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def torch_threads():
    """`torch_threads(n)` sets torch's thread count for the test; the count is restored after."""
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)
