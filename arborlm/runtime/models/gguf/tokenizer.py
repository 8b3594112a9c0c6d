"""A GGUF file's tokenizer, rebuilt with the `tokenizers` library as a `PreTrainedTokenizerFast`.

Two kinds, from `tokenizer.ggml.model`:

- `gpt2`: byte-level BPE. The vocabulary (`tokenizer.ggml.tokens`, already spelled in GPT-2's
  byte alphabet) and `tokenizer.ggml.merges` go into a BPE model; `tokenizer.ggml.pre` names
  the text-splitting regex the merges were learned with (llama.cpp's names, `_PRE_SPLITS`); an
  unknown name is refused rather than guessed.
- `llama`: SentencePiece BPE. The file has scores, not merges: a merge exists wherever a token
  splits into two tokens, ranked by the merged token's score (what SentencePiece's encoder
  does); byte tokens `<0xNN>` are the fallback, `▁` marks spaces, a space is prepended to the
  text when `tokenizer.ggml.add_space_prefix` says so (the default).

Tokens typed control (3) become special tokens, user-defined (4) plain added tokens, both
matched whole; BOS / EOS are added as `tokenizer.ggml.add_bos_token` / `add_eos_token` say
(default: BOS for `llama`, nothing for `gpt2`); the chat template is `tokenizer.chat_template`.

Not here: choosing between this and a `--tokenizer-path` directory (`tokenizer_utils.py`).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from arborlm.errors import ModelLoadError
from arborlm.runtime.models.gguf.files import metadata_value, open_gguf, require_value

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (1 normal, 2 unknown, 6 byte, ...)

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CASED_WORDS = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"{suffix}|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
                r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{suffix}")
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (_CASED_WORDS.replace("{suffix}", _CONTRACTIONS)
          + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (_CASED_WORDS.replace("{suffix}", "")
           + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# `tokenizer.ggml.pre` -> the regexes that split text before byte-level BPE, applied in order
# (llama.cpp's `llama-vocab.cpp` lists the same per pre-tokenizer type).
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2,), "gpt2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2), "starcoder": (r"\p{N}", _GPT2), "refact": (r"\p{N}", _GPT2),
    "llama3": (_LLAMA3,), "llama-v3": (_LLAMA3,), "llama-bpe": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,), "dbrx": (_LLAMA3,), "falcon3": (_LLAMA3,),
    "qwen2": (_QWEN2,), "deepseek-r1-qwen": (_QWEN2,),
    "gpt-4o": (_GPT4O,), "llama4": (_GPT4O,), "tekken": (_TEKKEN,),
}
# Pre-tokenizers whose reference tokenizer takes a whole word from the vocabulary before merging.
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"})


def gguf_tokenizer(file: str | os.PathLike) -> Any:
    """The tokenizer GGUF `file` describes, as a `transformers.PreTrainedTokenizerFast`."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    reader = open_gguf(file)
    kind = str(require_value(reader, "tokenizer.ggml.model", file))
    tokens = [str(t) for t in require_value(reader, "tokenizer.ggml.tokens", file)]
    types = metadata_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)

    def token(key: str) -> str | None:
        index = metadata_value(reader, f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and int(index) < len(tokens) else None

    if kind == "gpt2":
        pre = str(metadata_value(reader, "tokenizer.ggml.pre", "default"))
        merges = metadata_value(reader, "tokenizer.ggml.merges")
        if merges is None:
            raise ModelLoadError(f"{file}: a gpt2 tokenizer without tokenizer.ggml.merges")
        tok = _byte_level(tokens, types, merges, pre, file)
    elif kind == "llama":
        scores = require_value(reader, "tokenizer.ggml.scores", file)
        add_space = bool(metadata_value(reader, "tokenizer.ggml.add_space_prefix", True))
        tok = _sentencepiece(tokens, scores, token("unknown_token_id"), add_space)
    else:
        raise ModelLoadError(f"{file}: GGUF tokenizer model {kind!r} is not supported "
                             "(supported: gpt2, llama); pass --tokenizer-path")
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])
    add_bos = bool(metadata_value(reader, "tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(metadata_value(reader, "tokenizer.ggml.add_eos_token", False))
    bos, eos = token("bos_token_id"), token("eos_token_id")
    _set_post_processor(tok, bos if add_bos else None, eos if add_eos else None)
    assert isinstance(tok, Tokenizer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"), add_bos_token=add_bos and bos is not None,
        add_eos_token=add_eos and eos is not None, clean_up_tokenization_spaces=False)
    wrapped.chat_template = metadata_value(reader, "tokenizer.chat_template")
    return wrapped


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (bytes that print as themselves keep their
    character; the rest take code points from 256 up, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in keep}
    extra = (b for b in range(256) if b not in spelled)
    spelled.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return spelled


def _byte_level(tokens: list[str], types: list[int], merges: list[str], pre: str,
                file: str | os.PathLike) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if pre not in _PRE_SPLITS:
        raise ModelLoadError(f"{file}: GGUF pre-tokenizer {pre!r} is not supported (known: "
                             f"{', '.join(sorted(_PRE_SPLITS))}); pass --tokenizer-path")
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    vocab: dict[str, int] = {}
    for index, (text, kind) in enumerate(zip(tokens, types)):
        if kind not in (CONTROL, USER_DEFINED) and not set(text) <= letters:
            text = "".join(alphabet[b] for b in text.encode("utf-8"))  # a raw-spelled token
        vocab.setdefault(text, index)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False,
                               ignore_merges=pre in _IGNORE_MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a token into two tokens, best merged-token
    score first (ties: longer left piece, then longer right piece, then vocabulary order)."""
    ids = {t: i for i, t in reversed(list(enumerate(tokens)))}
    found: list[tuple[float, int, int, int, str, str]] = []
    for merged, score in zip(tokens, scores):
        local = [(merged[:i], merged[i:]) for i in range(1, len(merged))
                 if merged[:i] in ids and merged[i:] in ids]
        local.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        found.extend((-float(score), -len(a), -len(b), len(found) + n, a, b)
                     for n, (a, b) in enumerate(local))
    found.sort()
    return [(a, b) for *_, a, b in found]


def _sentencepiece(tokens: list[str], scores: list[float], unk: str | None,
                   add_space: bool) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab: dict[str, int] = {}
    for index, text in enumerate(tokens):
        vocab.setdefault(text, index)
    tok = Tokenizer(models.BPE(vocab, spm_merges(tokens, scores), unk_token=unk, fuse_unk=True,
                               byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _set_post_processor(tok: Any, bos: str | None, eos: str | None) -> None:
    from tokenizers import processors

    if bos is None and eos is None:
        return
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1",
                     *([f"{eos}:1"] if eos else [])])
    special = [(t, tok.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                       special_tokens=special)
