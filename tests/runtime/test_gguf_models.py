"""GGUF checkpoints written from the repo's tiny models: loaded weights equal a reference decode
of the file (exactly the HF model's for F32, Q/K permutation included), greedy tokens equal
transformers loading the same file, and what is refused is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from arborlm.errors import ModelLoadError
from arborlm.runtime.config import ModelConfig
from arborlm.runtime.models.factory import LLAMA3_ROPE_SCALING, tiny_model
from arborlm.runtime.models.gguf.tensors import hf_tensor_name
from arborlm.runtime.models.registry import load_model
from arborlm.runtime.tokenizer_utils import load_tokenizer
from tests.runtime.engine_helpers import DirectScheduler, hf_greedy
from tests.runtime.gguf_reference import T, reference_dequantize
from tests.runtime.gguf_writer import llama3_rope_factors, write_gguf

SIZE = {"hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "num_kv_heads": 2}
PROMPTS = ["The quick brown fox", "def add(a, b):", "1 2 3 4", "Hello"]
NEW_TOKENS = 12


def _tiny(arch: str):
    if arch == "qwen3":  # transformers' GGUF loader ignores qwen3.attention.key_length and
        # takes Qwen3Config's default head_dim, 128: give the model that head size
        return tiny_model(arch, **{**SIZE, "num_heads": 2, "num_kv_heads": 1})
    return tiny_model(arch, **SIZE)


def _loaded_weights(path) -> dict[str, torch.Tensor]:
    model = load_model(ModelConfig.from_path(path, "float32"))
    return {name: (param.data if rows is None else param.data[rows])
            for name, (param, rows) in model._weight_targets().items()}


def _hf_weights(hf_dir) -> dict[str, torch.Tensor]:
    from arborlm.runtime.models.loader import iter_checkpoint

    return {name: t.float() for name, t in iter_checkpoint(hf_dir)}


def _greedy_arborlm(path) -> list[list[int]]:
    runner = DirectScheduler(str(path))
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    rids = runner.submit(PROMPTS, params)
    runner.run()
    return runner.output_ids(rids)


def _greedy_transformers(path, tokenizer) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        out.append(gen[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_file_loads_the_hf_weights_exactly_and_decodes_like_transformers(arch, tmp_path):
    hf_dir = _tiny(arch)
    path = write_gguf(hf_dir, tmp_path / f"{arch}.gguf")
    loaded, original = _loaded_weights(path), _hf_weights(hf_dir)
    for name, tensor in original.items():
        if name == "lm_head.weight" and name not in loaded:
            continue  # tied
        assert torch.equal(loaded[name], tensor), name
    tokenizer = load_tokenizer(str(path))
    assert _greedy_arborlm(path) == _greedy_transformers(path, tokenizer)


QUANT_TYPES = [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]


def _reference_weights(path, heads: int, kv_heads: int) -> dict[str, np.ndarray]:
    """Each tensor of the file decoded in float64, q/k rows put back in HF order."""
    ref = {}
    for t in GGUFReader(str(path)).tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        raw = np.asarray(t.data).view(np.uint8).reshape(int(np.prod(shape[:-1])), -1)
        values, _ = reference_dequantize(raw, t.tensor_type)
        values = values.reshape(shape)
        if ".attn_q." in t.name or ".attn_k." in t.name:
            n = heads if ".attn_q." in t.name else kv_heads
            values = values.reshape(n, shape[0] // n // 2, 2, *shape[1:]).swapaxes(1, 2) \
                .reshape(shape)
        ref[hf_tensor_name(t.name)] = values
    return ref


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_quantized_llama_file_matches_reference_decode_and_transformers(qtype, tmp_path):
    hf_dir = _tiny("llama")
    path = write_gguf(hf_dir, tmp_path / f"llama-{qtype.name}.gguf", qtype)
    loaded = _loaded_weights(path)
    reference = _reference_weights(path, SIZE["num_heads"], SIZE["num_kv_heads"])
    assert set(reference) <= set(loaded) | {"lm_head.weight"}
    for name, ref in reference.items():
        got = loaded[name].double().numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7 * np.abs(ref).max(),
                                   err_msg=name)
    tokenizer = load_tokenizer(str(path))
    assert _greedy_arborlm(path) == _greedy_transformers(path, tokenizer)


def test_llama3_rope_freqs_decode_like_the_hf_checkpoint(tmp_path):
    """Llama 3.1 scaling lives in the `rope_freqs` tensor of a GGUF file (transformers ignores
    it), so the reference is the HF checkpoint the file was written from."""
    hf_dir = _tiny("llama3")
    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {**cfg["rope_scaling"], "rope_theta": cfg["rope_theta"]}
    assert rope["rope_type"] == "llama3" and rope["factor"] == LLAMA3_ROPE_SCALING["factor"]
    factors = llama3_rope_factors(rope, SIZE["hidden_size"] // SIZE["num_heads"])
    assert len(set(factors.tolist())) > 2  # some frequencies in the smoothed band
    path = write_gguf(hf_dir, tmp_path / "llama3.gguf", rope_freqs=factors)
    assert ModelConfig.from_path(path).hf_config["rope_freq_factors"] == factors.tolist()
    tokenizer = load_tokenizer(str(path))
    expected = [hf_greedy(str(hf_dir), tokenizer.encode(p), NEW_TOKENS) for p in PROMPTS]
    assert _greedy_arborlm(path) == expected


def test_directory_with_one_gguf_file_is_that_file(tmp_path):
    path = write_gguf(_tiny("qwen2"), tmp_path / "model.gguf")
    assert ModelConfig.from_path(tmp_path).path == str(path)
    (tmp_path / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(ModelLoadError, match="2 GGUF files"):
        ModelConfig.from_path(tmp_path)


def test_unknown_architecture_is_refused_by_name(tmp_path):
    from gguf import GGUFWriter

    writer = GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="architecture 'falcon'"):
        ModelConfig.from_path(tmp_path / "falcon.gguf")


def test_unsupported_tensor_type_is_refused_naming_tensor_and_type(tmp_path):
    path = write_gguf(_tiny("llama"), tmp_path / "q2k.gguf", T.F32,
                      zero_typed={"blk.1.ffn_up.weight": T.Q2_K})
    with pytest.raises(ModelLoadError, match=r"'blk\.1\.ffn_up\.weight' has GGUF type Q2_K"):
        load_model(ModelConfig.from_path(path, "float32"))


def test_split_files_are_refused(tmp_path):
    hf_dir = _tiny("llama")
    named = write_gguf(hf_dir, tmp_path / "m-00001-of-00002.gguf")
    with pytest.raises(ModelLoadError, match="split GGUF"):
        ModelConfig.from_path(named)
    marked = write_gguf(hf_dir, tmp_path / "marked.gguf", metadata={"split.count": 2})
    with pytest.raises(ModelLoadError, match="split GGUF"):
        ModelConfig.from_path(marked)


def test_tokenizer_path_overrides_the_files_own_tokenizer(tmp_path):
    """`--tokenizer-path` with a GGUF model: the engine tokenizes with that Hugging Face
    tokenizer (here the one the file was written from, so the outputs must not change)."""
    import arborlm

    hf_dir = _tiny("llama")
    path = write_gguf(hf_dir, tmp_path / "llama.gguf")
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    outputs = []
    for tokenizer_path in (None, str(hf_dir)):
        engine = arborlm.Engine(str(path), dtype="float32", tokenizer_path=tokenizer_path)
        try:
            assert engine.config.tokenizer_path == (tokenizer_path or str(path))
            assert (engine.tokenizer.name_or_path == str(hf_dir)) == (tokenizer_path is not None)
            outputs.append([o["output_ids"] for o in engine.generate(PROMPTS, params)])
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]
