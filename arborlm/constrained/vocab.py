"""`TokenVocab`: the bytes each token id stands for, as both grammar engines need them.

Decoding a Hugging Face vocabulary to raw bytes is tokenizer-specific (byte-level BPE's "Ġ",
SentencePiece's "▁" and "<0x0A>" byte fallback, tiktoken); xgrammar's `TokenizerInfo` already
knows every scheme, so this module borrows its decoder once and hands the same bytes to both
backends. Special tokens (`<s>`, `<unk>`, chat markers...) are blanked to b"" here: xgrammar
treats an empty token as special and never allows it, and outlines-core never sees it, so no
special token can appear as literal text inside a JSON string or a regex match. Ids from the
tokenizer's length up to the model's `vocab_size` (padding) are likewise empty.

This module does not compile grammars or build masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from arborlm.errors import GrammarError


@dataclass(frozen=True)
class TokenVocab:
    decoded: tuple[bytes, ...]  # the text of ids 0..len-1 (len <= vocab_size); b"" = never text
    vocab_size: int  # the model's vocabulary (logits width)
    stop_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int]
    add_prefix_space: bool  # the tokenizer prepends a space when encoding (SentencePiece)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int,
                       stop_token_ids: list[int] | tuple[int, ...]) -> TokenVocab:
        """Decode a Hugging Face tokenizer's vocabulary, truncated or padded to `vocab_size`."""
        import xgrammar as xgr

        stops = tuple(dict.fromkeys(int(t) for t in stop_token_ids))
        if not stops:
            raise GrammarError("a grammar backend needs at least one stop token id")
        bad = [t for t in stops if not 0 <= t < vocab_size]
        if bad:
            raise GrammarError(f"stop token ids {bad} are outside the vocabulary [0, {vocab_size})")
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stops))
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(added, "special", False):
                special.add(int(token_id))
        special |= set(stops)
        decoded = [bytes(b) for b in info.decoded_vocab[:vocab_size]]
        for token_id in special:
            if token_id < len(decoded):
                decoded[token_id] = b""
        return cls(decoded=tuple(decoded), vocab_size=vocab_size, stop_token_ids=stops,
                   special_token_ids=frozenset(special), add_prefix_space=info.add_prefix_space)

    def text_token_ids(self) -> dict[bytes, list[int]]:
        """Map each non-empty token text to the ids that spell it (ids below `vocab_size`)."""
        by_text: dict[bytes, list[int]] = {}
        for token_id, text in enumerate(self.decoded):
            if text:
                by_text.setdefault(text, []).append(token_id)
        return by_text
