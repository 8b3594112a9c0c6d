"""Model registry: architecture name -> model class, and `load_model`, the one entry point that
turns a `ModelConfig` into a ready model (built on the device in its dtype, weights loaded,
eval mode).

Architecture names are the ones `ModelConfig.from_path` resolves (it already rejects unknown
`architectures` with `ModelLoadError`). Not here: reading config.json, or the attention backend.
"""

from __future__ import annotations

import torch
from torch import nn

from arborlm.errors import ModelLoadError
from arborlm.runtime.config import ModelConfig
from arborlm.runtime.distributed.group import TPGroup
from arborlm.runtime.models.gguf.files import find_gguf_file
from arborlm.runtime.models.llama import LlamaForCausalLM
from arborlm.runtime.models.loader import iter_checkpoint

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,  # Llama 2/3 and Mistral
    "qwen2": LlamaForCausalLM,  # + q/k/v bias
    "qwen3": LlamaForCausalLM,  # + q/k RMSNorm
}


def get_model_class(architecture: str) -> type[nn.Module]:
    cls = MODEL_CLASSES.get(architecture)
    if cls is None:
        raise ModelLoadError(f"no model implementation for architecture {architecture!r}; "
                             f"supported: {', '.join(sorted(MODEL_CLASSES))}")
    return cls


def load_model(config: ModelConfig, device: str = "cpu", tp: TPGroup | None = None,
               quantization: str | None = None) -> nn.Module:
    """Build the model for `config.architecture` on `device` in `config.dtype`, load its
    safetensors or GGUF weights (cast to that dtype as they are copied), and return it in eval
    mode. With `tp`, the model is this rank's shard (each checkpoint tensor is read whole and
    only this rank's part kept). With `quantization` (`EngineArgs.quantization`, already checked
    to apply), the linears and embedding compute from packed blocks: a GGUF file's own (`gguf`)
    or the float weights quantized at load (`platforms/cpu/quant_loading.py`); with `tp`, this
    rank's blocks of them.

    Raises `ModelLoadError` (with the model directory) for missing or unreadable weight files,
    missing, unexpected or misshapen tensors.
    """
    cls = get_model_class(config.architecture)
    if quantization is not None:
        from arborlm.runtime.platforms.cpu import kernels as cpu_kernels

        if not cpu_kernels.quant_linear_available():  # loads them: the modules call them
            raise ModelLoadError(f"quantization {quantization}: {cpu_kernels.OPERATORS_MISSING}")
    with torch.device(device):
        model = cls(config) if tp is None else cls(config, tp)
    if quantization is not None and tp is not None:
        from arborlm.runtime.platforms.cpu.quant_loading import check_tp_blocks

        check_tp_blocks(config, quantization, model.shard)
    if find_gguf_file(config.path) is not None:
        from arborlm.runtime.models.gguf.tensors import iter_gguf_tensors  # imports gguf

        if quantization == "gguf":
            from arborlm.runtime.platforms.cpu.quant_linear import PACKED_TYPES
            from arborlm.runtime.platforms.cpu.quant_loading import keep_packed

            weights = keep_packed(model, iter_gguf_tensors(config.path, config.dtype,
                                                           PACKED_TYPES), config.dtype)
        else:
            weights = iter_gguf_tensors(config.path, config.dtype)
    else:
        weights = iter_checkpoint(config.path, device=str(device))
    try:
        model.load_weights(weights)
    except ModelLoadError as e:
        if config.path in str(e):
            raise
        raise ModelLoadError(f"{config.path}: {e}") from e
    if quantization not in (None, "gguf"):
        from arborlm.runtime.platforms.cpu.quant_loading import quantize_model

        quantize_model(model, quantization)
    return model.eval()
