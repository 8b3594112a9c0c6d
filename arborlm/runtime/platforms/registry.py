"""`choose_decode_executor`: the one decode executor of a model runner, picked at start-up.

The candidates and their order are `arborlm.runtime.decode_executor`'s; each is imported only when
it is considered.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from arborlm.runtime.decode_executor import DecodeExecutor, DecodeParts

logger = logging.getLogger(__name__)


def choose_decode_executor(parts: DecodeParts) -> DecodeExecutor:
    """The first decode executor that applies (the order is `arborlm.runtime.decode_executor`'s);
    the candidates log why they do not where that is worth knowing."""
    from arborlm.runtime.decode_executor import EagerDecode
    from arborlm.runtime.platforms.cuda.graph_runner import create_cuda_graph_runner

    if parts.tp_size > 1:
        logger.info("decode steps run eagerly: the model is sharded over %d tensor-parallel "
                    "ranks", parts.tp_size)
        return EagerDecode()
    graphs = create_cuda_graph_runner(parts)
    if graphs is not None:
        return graphs
    if parts.device == "cpu":
        from arborlm.runtime.platforms.cpu import compiled_decode, fused_decode

        fused = fused_decode.create_fused_decode(parts)
        if fused is not None:
            return fused
        compiled = compiled_decode.create_compiled_decode(parts)
        if compiled is not None:
            return compiled
    return EagerDecode()
