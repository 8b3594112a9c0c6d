"""Token ids -> the text and raw bytes OpenAI's logprob entries report for them.

Byte-level BPE tokenizers (GPT-2 style) store each byte as a printable stand-in character;
SentencePiece-style ones use `<0xNN>` byte tokens and `▁` for spaces. `TokenTexts` undoes
either, so `bytes` holds the token's real UTF-8 bytes even when the token is a fragment of a
character (whose `text` is then the replacement character, as a lone decode gives it).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character -> byte (inverse of `bytes_to_unicode`)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


class TokenTexts:
    """Cached `text(id)` (a lone decode) and `bytes(id)` (the raw UTF-8 bytes) of token ids."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return list(self.text(token_id).encode())
        if token_id in self.special:
            return list(piece.encode())
        if self.byte_level:
            table = byte_decoder()
            if all(c in table for c in piece):
                return [table[c] for c in piece]
            return list(piece.encode())
        m = _BYTE_TOKEN.fullmatch(piece)
        if m is not None:
            return [int(m.group(1), 16)]
        return list(piece.replace("▁", " ").encode())
