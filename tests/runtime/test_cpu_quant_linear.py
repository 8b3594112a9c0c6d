"""`arborlm::quant_linear`, linears computed from GGUF blocks kept packed, against float64.

Every block type, on random blocks whose f16 scales include zero, both f16 extremes and
subnormals (`gguf_reference.random_blocks`), decoded by the float64 reference written from
ggml's loops (`gguf_reference.py`). Output counts that are not multiples of the 4-column groups,
the 4- and 6-row tiles or the 64-column tiles, one to 130 rows, inputs of one block and of
several, an all-zero row and rows with one huge value. Every path this CPU grants:

- portable (blocks dequantized, x as is), avx2 (blocks dequantized in registers, 8-lane FMAs)
  and float with float32 x (weights dequantized in registers, FMAs): the float64 product to
  float32 summation error;
- bf16, bfloat16 x on the kernel's float path (the AVX512-BF16 dot product where the CPU has
  it, weights rounded once to bfloat16): the float64 product to that rounding (2^-9 of each
  weight) and the output's; float32 x on it is the float path;
- vnni (x quantized per 32-value block to int8 first, as llama.cpp does): the float64 product of
  the same int8 activations to summation error, and of x itself to within the activations'
  rounding bound (half a quant step of each block times the block's weight magnitude);
- vnni2 (x in two int8 terms): the float64 product of x to within a 256th of that bound;
  avx2_int (vnni2 with AVX2's byte products) the same, and equal to vnni2 bit for bit where
  both run.

A row's result must not depend on the other rows of the call; bias adds; bfloat16 x gives the
float32 result rounded where a path widens it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES

from arborlm.runtime.platforms.cpu import capabilities
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu.quant_linear import (
    QuantLinear,
    quantize_linears,
    quantize_weight,
)
from tests.runtime.gguf_reference import T, random_blocks, reference_dequantize

TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
# Taken four blocks at a time by vnni / vnni2 (with AVX512-VBMI) and avx2_int.
WIDE_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q6_K]
PATHS = ["portable", "avx2", "avx2_int", "float", "bf16", "vnni2", "vnni", "amx"]
EPS32 = 2.0 ** -24
# Ordinary f16 scales (no extremes), for the checks where x's own extremes are under test.
PLAIN_SCALES = np.array([0.0, 1.0, 1e-3, -2.5, 0.0625, 3.0], dtype=np.float16)


def _skip_unless(path: str) -> None:
    if not capabilities.is_x86_64():
        pytest.skip("ArborLM's CPU operators are built for x86-64 only")
    assert cpu_kernels.quant_linear_available(), "quant_linear did not build"
    if path not in cpu_kernels.quant_paths():
        pytest.skip(f"this CPU lacks what quant_linear's {path} path needs")


def _weight(qtype: T, out: int, inp: int, seed: int,
            scales: np.ndarray | None = None) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """Random packed rows `[out, row bytes]` uint8 and their float64 values and magnitudes."""
    block = GGML_QUANT_SIZES[qtype][0]
    rng = np.random.default_rng(seed)
    kwargs = {} if scales is None else {"scales": scales}
    raw = random_blocks(qtype, out * inp // block, rng, **kwargs).reshape(out, -1)
    values, magnitude = reference_dequantize(raw, qtype)
    return torch.from_numpy(raw.copy()), values, magnitude


def _quantized_activations(x: np.ndarray) -> np.ndarray:
    """x `[T, in]` float32 as the VNNI path sees it: per 32-value block, d = max|x| / 127 and
    q = round(x * (1 / d)) in float32 (nearest even), returned as q * d in float64."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint((blocks * inv).astype(np.float32))
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def _check(y: torch.Tensor, x: torch.Tensor, values: np.ndarray, magnitude: np.ndarray,
           path: str) -> None:
    path = "vnni2" if path == "avx2_int" else path  # the same arithmetic
    x64 = x.double().numpy()
    got = y.double().numpy()
    inp = x.shape[1]
    seen = _quantized_activations(x.float().numpy()) if path == "vnni" else x64
    ref = seen @ values.T
    # Summation error of `in` float32 terms, plus a few roundings of each term's scale.
    bound = (inp + 16) * EPS32 * (np.abs(seen) @ magnitude.T)
    if x.dtype == torch.bfloat16:  # bfloat16 output: rounded once
        bound += 2.0 ** -8 * np.abs(ref) + bound
    if x.dtype == torch.bfloat16 and path in ("bf16", "amx") and capabilities.has_native_bf16():
        bound += 2.0 ** -8 * (np.abs(x64) @ magnitude.T)  # each weight rounded to bfloat16
    error = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    # (vnni2: x's two-term rounding is absolute per block, checked below instead)
    assert path == "vnni2" or np.all(error <= bound), (path, worst, got[worst], ref[worst],
                                                        bound[worst])
    if path in ("vnni", "vnni2"):  # and against x itself: each block off by at most half a step
        step = np.abs(x64.reshape(x.shape[0], -1, 32)).max(axis=-1) / 127  # [T, blocks]
        if path == "vnni2":  # the second term's step (a clamped 128 is one step off)
            step = 2 * step / 256
        weight_l1 = np.abs(values).reshape(values.shape[0], -1, 32).sum(axis=-1)  # [out, blocks]
        rounding = (0.5 + 1e-4) * step @ weight_l1.T
        exact = x64 @ values.T
        bound = (inp + 16) * EPS32 * (np.abs(x64) @ magnitude.T)
        assert np.all(np.abs(got - exact) <= rounding + bound), path


def _x(rows: int, inp: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inp, generator=g)
    if rows > 2:
        x[1] = 0  # an all-zero row: zero activation scales
        x[2, inp // 3] = 3.0e4  # one huge value: the rest of its block quantizes to zero
    return x


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,out", [(1, 67), (3, 5), (7, 130), (130, 33)])
def test_matches_float64_reference(qtype, path, rows, out):
    _skip_unless(path)
    inp = 512  # two K-quant super-blocks, sixteen 32-value blocks
    w, values, magnitude = _weight(qtype, out, inp, seed=int(qtype) * 101 + rows)
    x = _x(rows, inp, seed=rows)
    y = cpu_kernels.quant_linear(x, w, int(qtype), path=path)
    assert y.dtype == torch.float32 and y.shape == (rows, out)
    _check(y, x, values, magnitude, path)


@pytest.mark.parametrize("path", ["bf16", "amx"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,out", [(1, 67), (7, 130), (17, 45), (100, 70), (130, 33),
                                      (40, 2100)])
def test_bf16_path_matches_float64_reference(qtype, rows, out, path):
    """bfloat16 x on the kernel's float path: `vdpbf16ps` against weights rounded once to
    bfloat16 where the CPU has AVX512-BF16, x widened to float32 otherwise (the fallback: the
    FMA kernel); on "amx", AMX tiles against the same bfloat16 weights up to 128 rows (17 and
    100 rows: a part tile of x, an odd number of tiles; 45, 70 and 2100 outputs: part groups of
    32 weight rows), oneDNN's GEMM above (130 rows)."""
    _skip_unless(path)
    inp = 512
    w, values, magnitude = _weight(qtype, out, inp, seed=int(qtype) * 7 + rows)
    x = _x(rows, inp, seed=rows).bfloat16()
    bias = torch.randn(out, generator=torch.Generator().manual_seed(rows))
    y = cpu_kernels.quant_linear(x, w, int(qtype), bias, path=path)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out)
    _check_bias(y, bias, x, values, magnitude, path)


def _check_bias(y: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, values: np.ndarray,
                magnitude: np.ndarray, path: str = "bf16") -> None:
    """y = x values^T + bias in bfloat16: the float64 reference with the bias, bounded as
    `_check` bounds the product (the bias adds its own magnitude to the output's rounding;
    "amx": above 128 rows oneDNN rounds the product to bfloat16 before it adds the bias, itself
    in bfloat16, so two more roundings)."""
    x64 = x.double().numpy()
    ref = x64 @ values.T + bias.double().numpy()
    scale = np.abs(x64) @ magnitude.T
    bound = 2 * (x.shape[1] + 16) * EPS32 * scale + 2.0 ** -8 * np.abs(ref)
    if capabilities.has_native_bf16():
        bound += 2.0 ** -8 * scale
    if path == "amx":
        bound += 2.0 ** -8 * (scale + np.abs(bias.double().numpy()))
    error = np.abs(y.double().numpy() - ref)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert np.all(error <= bound), (worst, y[worst].item(), ref[worst], bound[worst])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1],
                         ids=lambda t: t.name)
def test_block_counts_that_are_not_a_multiple_of_four(qtype, path):
    """Inputs of 1, 3, 5 and 18 blocks (32 to 576 values), ordinary scales: fewer blocks than
    a vector or group of them, and whole groups of four with a part group after."""
    _skip_unless(path)
    for inp in (32, 96, 160, 576):
        w, values, magnitude = _weight(qtype, 9, inp, seed=inp, scales=PLAIN_SCALES)
        x = _x(5, inp, seed=inp)
        _check(cpu_kernels.quant_linear(x, w, int(qtype), path=path), x, values, magnitude,
               path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_rows_do_not_depend_on_the_batch_and_bias_adds(qtype, path):
    _skip_unless(path)
    w, _, _ = _weight(qtype, 70, 256, seed=5, scales=PLAIN_SCALES)
    x = _x(11, 256, seed=5)
    y = cpu_kernels.quant_linear(x, w, int(qtype), path=path)
    for i in range(x.shape[0]):
        one = cpu_kernels.quant_linear(x[i:i + 1], w, int(qtype), path=path)
        assert torch.equal(one, y[i:i + 1])
    bias = torch.randn(70)
    assert torch.equal(cpu_kernels.quant_linear(x, w, int(qtype), bias, path=path), y + bias)
    xb = x.bfloat16()
    yb = cpu_kernels.quant_linear(xb, w, int(qtype), path=path)
    assert yb.dtype == torch.bfloat16
    if path == "bf16" and capabilities.has_native_bf16():  # its own kernel: batch-invariant
        for i in range(x.shape[0]):
            one = cpu_kernels.quant_linear(xb[i:i + 1], w, int(qtype), path=path)
            assert torch.equal(one, yb[i:i + 1])
    elif path == "amx":  # AMX's order of sums, not "bf16"'s: "bf16"'s values, not its bits
        ours = cpu_kernels.quant_linear(xb, w, int(qtype), path="bf16").float()
        assert torch.allclose(yb.float(), ours, rtol=2.0 ** -7, atol=1e-3 * ours.abs().max())
    else:  # widened to float32
        widened = cpu_kernels.quant_linear(xb.float(), w, int(qtype), path=path)
        assert torch.equal(yb, widened.bfloat16())


@pytest.mark.parametrize("path,within", [("vnni", 1e-2), ("vnni2", 1e-4), ("float", 1e-5),
                                         ("bf16", 1e-5), ("avx2", 1e-5), ("amx", 1e-5),
                                         ("avx2_int", 1e-4)])
def test_paths_agree_on_real_scales(path, within):
    """Each path differs from the portable one only by its activations' rounding: on ordinary
    weights and activations, int8 well under 1% of the output's scale, two int8 terms under
    0.01%, float32 activations to float32 rounding."""
    _skip_unless(path)
    for qtype in TYPES:
        w, values, _ = _weight(qtype, 96, 512, seed=9, scales=np.array([0.01, 0.02], np.float16))
        x = torch.randn(4, 512, generator=torch.Generator().manual_seed(9))
        a = cpu_kernels.quant_linear(x, w, int(qtype), path=path)
        b = cpu_kernels.quant_linear(x, w, int(qtype), path="portable")
        assert (a - b).abs().max() <= within * b.abs().max(), qtype.name


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_avx2_int_is_vnni2_bit_for_bit(qtype):
    """The AVX2 integer path forms the int32 lanes `vpdpbusd` does and runs the same float
    operations, so on a CPU with both it gives "vnni2"'s outputs exactly: awkward scales, odd
    shapes, rows of zeros and of one huge value, 1 to 9 rows."""
    _skip_unless("vnni2")
    _skip_unless("avx2_int")
    if qtype in WIDE_TYPES and "avx512vbmi" not in capabilities.cpu_flags():
        pytest.skip("without AVX512-VBMI, vnni2 takes these types a block at a time")
    for rows, out in [(1, 67), (4, 64), (9, 130)]:
        w, _, _ = _weight(qtype, out, 512, seed=int(qtype) * 7 + rows)
        x = _x(rows, 512, seed=rows + 40)
        a = cpu_kernels.quant_linear(x, w, int(qtype), path="avx2_int")
        b = cpu_kernels.quant_linear(x, w, int(qtype), path="vnni2")
        assert torch.equal(a, b), (qtype.name, rows, (a - b).abs().max().item())


def test_the_path_is_chosen_by_rows_and_can_be_forced(monkeypatch):
    """The float path on the activations as they are ("bf16") from `FLOAT_PATH_ROWS` rows, or
    "amx" from `AMX_ROWS` where the CPU grants AMX tiles (but never for deterministic
    inference), two int8 terms below (where the CPU has VNNI); without AVX-512 "avx2" from
    `FLOAT_PATH_ROWS` rows and "avx2_int" below; without AVX2 "portable";
    int8 activations, or bfloat16 ones widened to float32, only when asked for; an unknown name
    is refused."""
    _skip_unless("portable")
    here = cpu_kernels.quant_paths()
    monkeypatch.delenv("ARBORLM_QUANT_PATH", raising=False)
    floats = "bf16" if "bf16" in here else "avx2" if "avx2" in here else "portable"
    many, few = cpu_kernels.quant_path(cpu_kernels.FLOAT_PATH_ROWS), cpu_kernels.quant_path(1)
    amx_from_many = "amx" in here and cpu_kernels.AMX_ROWS <= cpu_kernels.FLOAT_PATH_ROWS
    assert many == ("amx" if amx_from_many else floats)
    assert ("avx2" in here) == ("avx2_int" in here) == capabilities.has_avx2_fma()
    assert few == ("vnni2" if "vnni2" in here else "bf16" if "bf16" in here
                   else "avx2_int" if "avx2" in here else "portable")
    assert cpu_kernels.batch_invariant_quant_path() == floats  # never "amx"
    batch = cpu_kernels.quant_path(max(cpu_kernels.AMX_ROWS, cpu_kernels.FLOAT_PATH_ROWS))
    assert batch == ("amx" if "amx" in here else floats)
    assert ("amx" in here) == ("bf16" in here and capabilities.has_amx_bf16())
    assert not {"vnni", "float"} & {many, few}
    monkeypatch.setenv("ARBORLM_QUANT_PATH", "portable")
    assert cpu_kernels.quant_path(1) == cpu_kernels.quant_path(512) == "portable"
    monkeypatch.setenv("ARBORLM_QUANT_PATH", "int4")
    with pytest.raises(ValueError, match="ARBORLM_QUANT_PATH='int4'"):
        cpu_kernels.quant_path(1)


def test_bad_arguments_are_refused():
    _skip_unless("portable")
    w, _, _ = _weight(T.Q4_0, 4, 64, seed=1)
    with pytest.raises(RuntimeError, match="multiple of the type's 32-value block"):
        cpu_kernels.quant_linear(torch.randn(2, 48), w, int(T.Q4_0), path="portable")
    with pytest.raises(RuntimeError, match="weight must be contiguous uint8"):
        cpu_kernels.quant_linear(torch.randn(2, 96), w, int(T.Q4_0), path="portable")
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        cpu_kernels.quant_linear(torch.randn(2, 64), w, int(T.Q2_K), path="portable")
    with pytest.raises(RuntimeError,
                       match="path must be portable, avx2, avx2_int, vnni, vnni2, float or amx"):
        cpu_kernels.quant_linear(torch.randn(2, 64), w, int(T.Q4_0), path="int4")
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_kernels.quant_linear(torch.randn(2, 64), w, int(T.Q4_0), torch.zeros(3),
                                 path="portable")


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_quant_linear_module_quantizes_and_computes_from_blocks(qtype):
    _skip_unless("portable")
    torch.manual_seed(int(qtype))
    linear = torch.nn.Linear(96, 40, bias=True)
    blocks = quantize_weight(linear.weight, qtype)
    layer = QuantLinear(blocks, qtype, 96, linear.bias)
    assert layer.blocks.nbytes == 40 * 96 // 32 * GGML_QUANT_SIZES[qtype][1]
    # gguf's quantizer: within half a quant step of each 32-value block (Q8_0: max|w| / 127;
    # min types: the block's range over 15 or 31), Q4_0 / Q5_0 within a whole step (max|w| / 8
    # or / 16: the value opposite the largest clips to the last level), plus the f16 rounding
    # of the block's scale and minimum.
    blocks_w = linear.weight.detach().reshape(40, 3, 32)
    amax = blocks_w.abs().amax(-1, keepdim=True)
    span = blocks_w.amax(-1, keepdim=True) - blocks_w.amin(-1, keepdim=True)
    within = {T.Q8_0: amax / 254, T.Q4_0: amax / 8, T.Q5_0: amax / 16, T.Q4_1: span / 30,
              T.Q5_1: span / 62}[qtype]
    error = (layer.dequantized().reshape(40, 3, 32) - blocks_w).abs()
    assert (error <= within + 2.0 ** -10 * (amax + span)).all()
    weight = layer.dequantized()
    x = torch.randn(2, 3, 96)
    y = layer(x)
    assert y.shape == (2, 3, 40)
    ref = torch.nn.functional.linear(x, weight, linear.bias.detach())
    assert (y - ref).abs().max() <= 0.02 * ref.abs().max()


def test_quantize_linears_on_a_model_matches_its_dequantized_weights(make_tiny_model):
    """A real (tiny, random) Llama quantized to Q8_0: every linear (the output head too, unless
    tied to the embedding) becomes a QuantLinear holding only its packed bytes, and its logits
    agree with the same model computed in float32 from the dequantized weights."""
    _skip_unless("portable")
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    count = quantize_linears(model, T.Q8_0)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert count == len(layers) == 7 * model.config.num_hidden_layers + (0 if tied else 1)
    for name, layer in model.named_modules():
        if isinstance(layer, QuantLinear):
            assert not hasattr(layer, "weight")  # only the packed bytes are kept
            ref.get_submodule(name).weight.data.copy_(layer.dequantized())
    ids = torch.randint(0, model.config.vocab_size, (1, 48),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids).logits.float().log_softmax(-1)
        want = ref(ids).logits.float().log_softmax(-1)
    kl = (want.exp() * (want - got)).sum(-1).mean().item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    # The bound on real text is KL <= 0.01 (a random model's flat logits flip more).
    assert kl <= 0.01 and agree >= 0.9, (kl, agree)


@pytest.mark.parametrize("path", ["vnni2", "float"])
def test_bfloat16_outputs_are_torchs_rounding_of_the_float32_ones(path):
    """bfloat16 x gives the float32 result rounded as torch rounds it (the conversions run on
    the kernels' thread pool, `arborlm_cpu::convert`, not through torch's copy, which would
    wake OpenMP), across the pool's chunks: 40,000 outputs, as a vocabulary-wide head has."""
    _skip_unless(path)
    w, _, _ = _weight(T.Q8_0, 40_000, 64, seed=5)
    x = _x(2, 64, seed=6).bfloat16()
    want = cpu_kernels.quant_linear(x.float(), w, int(T.Q8_0), path=path)
    got = cpu_kernels.quant_linear(x, w, int(T.Q8_0), path=path)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.bfloat16())  # x widened exactly: the same float32 sums
