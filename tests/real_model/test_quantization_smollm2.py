"""`--quantization gguf` on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): its linears
compute from the file's own blocks, and it answers and follows the dequantized model.

The reference is ArborLM's float32 model of the same file unquantized (every tensor dequantized;
equal to transformers' loading to float32 rounding, `test_gguf_smollm2.py`). The text is
`training_corpus`'s first lines (ArborLM's built-in English-like prose, code- and JSON-like lines,
accented and CJK words), tokenized by the file's tokenizer: all but the last 8 positions in one
extend step, those 8 as decode steps; 2,000 positions on the default path (80 on the portable
path, whose scalar code is ~4x slower here; 400 on each other path forced). Both models run in
float32, so what differs is the packed kernel's arithmetic, checked on each of `quant_linear`'s
paths:

- the default (`quant_path`: the float path for the extend, two-term int8 activations for the
  decode steps), float (x as it is) and vnni2 (x in two int8 terms), and without AVX-512 avx2
  (x as it is) and avx2_int (vnni2's arithmetic) must meet the issue's targets: top-1 >= 98%
  and mean KL <= 0.01; portable is equal to the reference (measured top-1 100%, KL 1e-8). The
  chat answer to "What is the capital of France?" names Paris on the portable, vnni2 and
  avx2_int paths and on the default one in a float32 engine; in a bfloat16 engine
  the default's float-path prefill turns it astray (a strict xfail: see `BF16_TIE`).
- vnni (int8 activations, as llama.cpp does; opt-in only, `ARBORLM_QUANT_PATH=vnni`): mean KL
  0.0024, within 0.01, but top-1 97.25% at 400 positions, and the chat answer goes astray at
  its first token ("L'Étoile, la Marseillaise, ..."). Those two checks stay strict xfails on
  that path: the accuracy gap of int8 activations on this 135M model, why it is not a default
  (93.75% since the tied output head is packed too: Q8_0 over int8 activations).
The linears are the file's Q4_1 blocks; the tied embedding and head its Q8_0 table, held once.
"""

from __future__ import annotations

import functools

import pytest
import torch

from arborlm.errors import InvalidRequestError
from arborlm.runtime.config import EngineArgs, ModelConfig
from arborlm.runtime.models.corpus import training_corpus
from arborlm.runtime.models.registry import load_model
from arborlm.runtime.platforms.cpu import capabilities
from arborlm.runtime.platforms.cpu.quant_linear import QuantLinear
from tests.runtime.model_harness import ModelHarness
from tests.runtime.test_cpu_quant_linear import _skip_unless

POSITIONS = {"portable": 80, "default": 2000, "float": 400, "vnni2": 400, "vnni": 400,
             "avx2": 400, "avx2_int": 400}
DECODED = 8
VNNI_GAP = ("int8 activations (the opt-in vnni path) on SmolLM2-135M: top-1 93.75% of positions, "
            "and the chat answer goes astray; why that path is not a default")
INT8 = pytest.param("vnni", marks=pytest.mark.xfail(strict=True, reason=VNNI_GAP))
PATHS = ["default", "portable", "float", "vnni2", "avx2", "avx2_int", INT8]


@pytest.fixture
def force_path(monkeypatch):
    """`force_path(path)`: QuantLinear calls run `quant_linear`'s `path` from now on (through
    `ARBORLM_QUANT_PATH`, which the engine's scheduler process inherits), or `quant_path`'s
    choice per call for "default"."""
    def force(path: str) -> None:
        monkeypatch.delenv("ARBORLM_QUANT_PATH", raising=False)
        if path == "default":
            _skip_unless("portable")
            return
        _skip_unless(path)
        monkeypatch.setenv("ARBORLM_QUANT_PATH", path)
    return force


@functools.cache
def _models(path: str) -> tuple[ModelConfig, torch.nn.Module, torch.nn.Module]:
    config = ModelConfig.from_path(path, "float32")
    return config, load_model(config, quantization="gguf"), load_model(config)


def _corpus_ids(path: str, n: int) -> list[int]:
    from arborlm.runtime.models.gguf.tokenizer import gguf_tokenizer

    ids = gguf_tokenizer(path).encode("\n".join(training_corpus(2000)))[:n]
    assert len(ids) == n
    return ids


def _log_probs(model: torch.nn.Module, config: ModelConfig, ids: list[int]) -> torch.Tensor:
    h = ModelHarness(model, config, max_context=len(ids) + 8, num_slots=len(ids) + 8)
    row = h.new_request()
    steps = [h.extend([row], [ids[:-DECODED]])] + [h.decode([row], [t]) for t in ids[-DECODED:]]
    return torch.cat(steps).log_softmax(-1)  # [POSITIONS, vocab]


@functools.cache
def _agreement(gguf_path: str, kernel_path: str) -> tuple[float, float]:
    """(top-1 agreement, mean KL) of the packed model against the dequantized one."""
    config, quantized, ref = _models(gguf_path)
    packed = [m for m in quantized.model.layers.modules() if isinstance(m, QuantLinear)]
    assert len(packed) == 4 * config.num_layers  # q/k/v and gate/up stacked: all Q4_1
    assert {m.qtype.name for m in packed} == {"Q4_1"}
    assert quantized.lm_head.qtype.name == "Q8_0"  # the tied embedding's table
    ids = _corpus_ids(gguf_path, POSITIONS[kernel_path])
    got, want = _log_probs(quantized, config, ids), _log_probs(ref, config, ids)
    kl = (want.exp() * (want - got)).sum(-1).mean().item()
    return (got.argmax(-1) == want.argmax(-1)).float().mean().item(), kl


@pytest.mark.parametrize("kernel_path", ["default", "portable", "float", "vnni2", "avx2",
                                         "avx2_int", "vnni"])
def test_mean_kl_to_the_dequantized_model_is_small(smollm2_gguf, force_path, kernel_path):
    force_path(kernel_path)
    _, kl = _agreement(str(smollm2_gguf), kernel_path)
    assert kl <= 0.01, kl


@pytest.mark.parametrize("kernel_path", PATHS)
def test_top1_agrees_with_the_dequantized_model(smollm2_gguf, force_path, kernel_path):
    force_path(kernel_path)
    agree, _ = _agreement(str(smollm2_gguf), kernel_path)
    assert agree >= 0.98, agree


BF16_TIE = ("bfloat16 engine with deterministic inference (float-path prefill, prompt tokens "
            "attending one by one): the first token goes astray (\"L'Étoile\"); the default "
            "engine, whose prefill differs from it only by float32 summation orders, says Paris: "
            "a near tie in bfloat16")


@pytest.mark.parametrize("kernel_path,dtype,deterministic", [
    ("portable", None, None), ("vnni2", None, None), ("avx2_int", None, None),
    ("default", "float32", None), ("default", None, None),
    pytest.param("default", None, True, marks=pytest.mark.xfail(
        capabilities.has_native_bf16(), strict=True, reason=BF16_TIE)),
    pytest.param("vnni", None, None, marks=pytest.mark.xfail(strict=True, reason=VNNI_GAP))])
def test_engine_answers_the_capital_of_france(smollm2_gguf, force_path, kernel_path, dtype,
                                              deterministic):
    """In the engine's default dtype (bfloat16 where the CPU has AVX512-BF16, else float32)
    unless `dtype` says otherwise; deterministic inference as by default unless asked."""
    import arborlm

    if deterministic and not capabilities.kernel_instructions(torch.bfloat16):
        pytest.skip("deterministic inference needs AVX-512 with AVX512-BF16")
    force_path(kernel_path)
    options = {"dtype": dtype} if dtype else {}
    if deterministic is not None:
        options["enable_deterministic_inference"] = deterministic
    engine = arborlm.Engine(model_path=str(smollm2_gguf), quantization="gguf", **options)
    try:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
            add_generation_prompt=True)
        out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 16})
    finally:
        engine.shutdown()
    assert "Paris" in out["text"], out["text"]


def test_requantizing_a_gguf_file_is_refused(smollm2_gguf):
    if not capabilities.is_x86_64():
        pytest.skip("ArborLM's CPU operators are built for x86-64 only")
    with pytest.raises(InvalidRequestError, match="--quantization gguf") as e:
        EngineArgs(model_path=str(smollm2_gguf), quantization="q4_0").resolve()
    assert e.value.param == "quantization"


def _bfloat16_against_float32(gguf_path: str, force_path, kernel_path: str) -> tuple:
    """(top-1 agreement, mean KL) over 400 positions of the packed model in bfloat16 on
    `kernel_path` against the dequantized model in float32."""
    force_path(kernel_path)
    config = ModelConfig.from_path(gguf_path, "bfloat16")
    model = load_model(config, quantization="gguf")
    ref_config, _, ref = _models(gguf_path)
    ids = _corpus_ids(gguf_path, 400)
    got = _log_probs(model, config, ids).float()
    want = _log_probs(ref, ref_config, ids)
    kl = (want.exp() * (want - got)).sum(-1).mean().item()
    return (got.argmax(-1) == want.argmax(-1)).float().mean().item(), kl


def test_amx_is_as_close_to_float32_as_the_float_path(smollm2_gguf, force_path):
    """The packed model in bfloat16 (the default dtype on AVX512-BF16 CPUs) on "amx" (oneDNN on
    the weights dequantized to bfloat16, which batches take) and on the kernel's own float path
    ("bf16"), against the dequantized model in float32. bfloat16 activations alone move the
    model this far (measured: top-1 94.75%, mean KL 1.6e-3 on "bf16"); "amx", the same weights
    summed in other orders, must add nothing measurable."""
    _skip_unless("amx")
    path = str(smollm2_gguf)
    amx_top1, amx_kl = _bfloat16_against_float32(path, force_path, "amx")
    top1, kl = _bfloat16_against_float32(path, force_path, "bf16")
    assert amx_kl <= 0.01 and amx_kl <= 1.25 * kl, (amx_kl, kl)
    assert amx_top1 >= top1 - 0.02, (amx_top1, top1)
