"""Tokenizers rebuilt from GGUF metadata equal transformers' loading of the same file: a
SentencePiece (`llama`) vocabulary written with `GGUFWriter` (the real SmolLM2 file's byte-level
BPE is checked in tests/real_model/); decoding round-trips."""

from __future__ import annotations

from pathlib import Path

from arborlm.runtime.models.corpus import training_corpus
from arborlm.runtime.models.gguf.tokenizer import gguf_tokenizer, spm_merges

EDGE_CASES = [
    "", " ", "  ", "\n", "\n\n\n", "\t\tx", "hello   world", "a\r\nb", "12345", "3.14159 and 2,718",
    "x1y22z333", "café naïve résumé", "Ünïcödé ÆØÅ", "你好，世界", "日本語のテキスト", "한국어",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧", "Ελληνικά", "עברית", "mixed 中文 and English 123",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>", "a<|im_end|>b",
    "don't I'LL we've", "def f(x):\n    return x ** 2\n", "{\"key\": [1, 2, 3]}", "   leading",
    "trailing   ", "tabs\tand\tspaces", "💩" * 5, "\u00a0nbsp", "zero\u200bwidth",
]


def tokenizer_strings() -> list[str]:
    """Edge cases and ~300 lines of varied text, for tokenizer equality tests."""
    lines = [line for line in training_corpus(400) if line.strip()]
    return EDGE_CASES + lines[:300]


def _write_spm_gguf(path: Path) -> None:
    """A SentencePiece-style vocabulary (control <s>/</s>, <unk>, 256 byte tokens, then pieces
    scored by merge rank) learned from the repo's corpus, as a `llama` tokenizer."""
    from gguf import GGUFWriter
    from tokenizers import SentencePieceBPETokenizer

    trained = SentencePieceBPETokenizer(add_prefix_space=True)
    trained.train_from_iterator(training_corpus(2000), vocab_size=600, show_progress=False)
    pieces = [t for t, _ in sorted(trained.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [p for p in pieces if p not in tokens]
    types = [2, 3, 3, *([6] * 256), *([1] * (len(tokens) - 259))]
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_tokenizer_equals_transformers_gguf_loading(tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "spm.gguf"
    _write_spm_gguf(path)
    ours = gguf_tokenizer(path)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in tokenizer_strings():
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ids[:1] == [1]  # BOS
        assert ours.decode(ids, skip_special_tokens=True) == \
            ref.decode(ids, skip_special_tokens=True), text


def test_spm_merges_rank_by_merged_score_then_piece_lengths():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]
    assert spm_merges(tokens, scores) == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]
