"""Incremental detokenization of one request's output: text deltas, UTF-8 boundaries, stop strings.

`IncrementalDetokenizer` is fed the token ids of one request as they are generated and returns
the newly visible text each time. It is pure logic over a Hugging Face tokenizer; it is not the
detokenizer *process* (that one owns sockets and a table of these objects, one per request).

Three rules shape what becomes visible:

- **UTF-8 boundaries.** A character whose bytes are split over several tokens decodes to U+FFFD
  until its last byte arrives, so a trailing U+FFFD is held back until a later token completes
  it; `finish()` emits whatever the bytes decode to.
- **Stop strings.** Text that could still grow into a stop string is held back. When a stop
  string appears, the text is cut at its start (or kept through its end with `no_stop_trim`),
  `matched_stop` is set, and no more text is added. The match that *completes first* wins (the
  smallest end offset; of those, the longest): it is the match a character-by-character stream
  would meet first, so the result does not depend on how tokens were grouped into `add` calls.
  An Aho-Corasick automaton (`stop_matcher.StopStringMatcher`) applies the rule one character
  at a time; `find_stop` states it directly and is the tests' reference.
- **Equal to a full decode.** At the end, `text` equals `decode_text(tokenizer, all_ids, ...)`
  (cut at the stop string, if one matched). `decode_text` is `tokenizer.decode` except for
  `spaces_between_special_tokens=True` with `skip_special_tokens=False`: the fast tokenizers of
  transformers 5 ignore that flag, so here it has the meaning it had in the slow tokenizers —
  the output is split at special tokens, each ordinary run is decoded on its own, and the
  non-empty pieces are joined with one space (`"<s> hello </s>"`).

Efficiency: each step decodes only a small window of recent tokens (the prefix offset / read
offset technique of vLLM and HF TGI): `decode(ids[prefix:])` minus `decode(ids[prefix:read])`
is the new text, and the context token(s) before `read` keep the decoder's leading-space
handling right. With `prompt_ids`, the last few prompt tokens serve as the first window's
context, so an output that starts with a word keeps its leading space under SentencePiece-style
decoders (which drop the first space of a decoded sequence); byte-level BPE decoders are not
affected. One limit: decoders that turn a whole group of *invalid* bytes into U+FFFD (the
`ByteFallback` decoder) may place replacement characters differently from a full decode when the
model emits invalid UTF-8; valid UTF-8 output is always exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from arborlm.runtime.stop_matcher import StopStringMatcher

REPLACEMENT_CHAR = "\ufffd"
# How many trailing prompt tokens give the first decode window its context.
PROMPT_CONTEXT_TOKENS = 5


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """First stop string to complete in `text[start:]`: `(index of its start, the string)`.

    "First to complete" means the smallest end offset; ties go to the longest string. Empty
    stop strings are ignored. Returns None when no stop string occurs. The definition the
    incremental automaton must agree with (O(len(text) x len(stops)); not for the hot path).
    """
    best: tuple[int, int, str] | None = None  # (end, -length, stop)
    for stop in stops:
        if not stop:
            continue
        idx = text.find(stop, start)
        if idx < 0:
            continue
        key = (idx + len(stop), -len(stop), stop)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    end, neg_len, stop = best
    return end + neg_len, stop


def special_token_texts(tokenizer: Any) -> dict[int, str]:
    """Ids of the tokenizer's special tokens (those `skip_special_tokens` drops) -> their text."""
    texts = {i: tok.content for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
    for i in tokenizer.all_special_ids:
        texts.setdefault(i, tokenizer.convert_ids_to_tokens(i))
    return texts


def decode_text(
    tokenizer: Any,
    ids: Sequence[int],
    *,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> str:
    """Full (non-incremental) decode with the semantics `IncrementalDetokenizer` reproduces."""
    ids = list(ids)
    decode = partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
    if skip_special_tokens or not spaces_between_special_tokens:
        return decode(ids)
    specials = special_token_texts(tokenizer)
    pieces: list[str] = []
    run: list[int] = []
    for t in ids:
        if t in specials:
            if run:
                pieces.append(decode(run))
                run = []
            pieces.append(specials[t])
        else:
            run.append(t)
    if run:
        pieces.append(decode(run))
    return " ".join(p for p in pieces if p)


class _WindowDecoder:
    """Windowed decoding of one run of tokens (the prefix offset / read offset technique).

    Invariants: `ids[:read_offset]` has been turned into text; `prefix_text` is the decode of
    `ids[prefix_offset:read_offset]`; `surfaced` characters past it were already returned from
    a window whose end is still an incomplete character (everything before a trailing U+FFFD
    run is final).
    """

    def __init__(self, decode: Callable[[list[int]], str], context: list[int]):
        self.decode = decode
        self.ids = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.prefix_text = decode(self.ids) if context else ""
        self.surfaced = 0

    def push(self, ids: list[int]) -> str:
        """Append ids; return the text that became final."""
        self.ids.extend(ids)
        new_text = self.decode(self.ids[self.prefix_offset :])
        done = len(self.prefix_text) + self.surfaced
        if len(new_text) > len(self.prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.prefix_text = self.decode(self.ids[self.prefix_offset : self.read_offset])
            self.surfaced = 0
            return new_text[done:]
        stable = new_text.rstrip(REPLACEMENT_CHAR)
        if len(stable) <= done:
            return ""
        self.surfaced += len(stable) - done
        return stable[done:]

    def flush(self) -> str:
        """End of the run: return the rest, incomplete characters decoded as they are."""
        new_text = self.decode(self.ids[self.prefix_offset :])
        done = len(self.prefix_text) + self.surfaced
        self.prefix_offset = self.read_offset = len(self.ids)
        self.prefix_text, self.surfaced = "", 0
        return new_text[done:]


class IncrementalDetokenizer:
    """Turns one request's token ids into text, a delta at a time (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        no_stop_trim: bool = False,
    ):
        self._decode = partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
        specials = special_token_texts(tokenizer)
        # Special tokens split the output into separately decoded pieces only in this mode.
        self._boundaries = (
            specials if spaces_between_special_tokens and not skip_special_tokens else {}
        )
        stops = [s for s in stop if s]
        self._stops = StopStringMatcher(stops) if stops else None
        self._no_stop_trim = no_stop_trim
        self._window = _WindowDecoder(self._decode, self._context(prompt_ids or [], specials))
        self._decoded = ""  # all text decoded so far, before stop-string handling
        self._visible = 0  # how much of `_decoded` has been surfaced
        self._scanned = 0  # `_decoded[:_scanned]` was fed to the stop-string automaton
        self._new_piece = False  # the next decoded text starts a new space-joined piece
        self._matched_stop: str | None = None
        self._finished = False

    def _context(self, prompt_ids: Sequence[int], specials: dict[int, str]) -> list[int]:
        """Trailing prompt tokens after the last special token, if they decode cleanly."""
        tail = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        for i in range(len(tail) - 1, -1, -1):
            if tail[i] in specials:
                tail = tail[i + 1 :]
                break
        if tail and self._decode(tail).endswith(REPLACEMENT_CHAR):
            return []
        return tail

    @property
    def text(self) -> str:
        """Cumulative visible text."""
        return self._decoded[: self._visible]

    @property
    def visible_len(self) -> int:
        """`len(self.text)`, without building the text."""
        return self._visible

    @property
    def decoded(self) -> str:
        """All text decoded so far (no copy); only its first `visible_len` characters are final."""
        return self._decoded

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._matched_stop

    @property
    def finished(self) -> bool:
        """True once a stop string matched or `finish()` was called."""
        return self._finished or self._matched_stop is not None

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed newly generated ids; return the newly visible text (possibly empty)."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.add() called after finish()")
        if self._matched_stop is not None:
            return ""
        run: list[int] = []
        for t in token_ids:
            if t in self._boundaries:
                self._append(self._window.push(run) + self._window.flush())
                run = []
                self._new_piece = True
                self._append(self._boundaries[t])
                self._new_piece = True
                self._window = _WindowDecoder(self._decode, [])
            else:
                run.append(t)
        if run:
            self._append(self._window.push(run))
        return self._surface(final=False)

    def finish(self) -> str:
        """End of generation: flush held-back text; return the last delta."""
        if self._finished:
            return ""
        self._finished = True
        if self._matched_stop is not None:
            return ""
        self._append(self._window.flush())
        return self._surface(final=True)

    def _append(self, text: str) -> None:
        if not text:
            return
        if self._new_piece and self._decoded:
            self._decoded += " "
        self._new_piece = False
        self._decoded += text

    def _surface(self, final: bool) -> str:
        """Move the visible end forward as far as stop strings allow; return the delta.

        Only the text decoded since the last call is fed to the automaton, so stop strings
        cost O(1) amortized per character however long the output grows."""
        end = len(self._decoded)
        if self._stops is not None:
            match = self._stops.feed(self._decoded[self._scanned:])
            if match is not None:
                stop_end = self._scanned + match[0]
                stop = match[1]
                self._matched_stop = stop
                end = stop_end if self._no_stop_trim else stop_end - len(stop)
            elif not final:
                end -= self._stops.held_len
            self._scanned = len(self._decoded)
        assert end >= self._visible, (end, self._visible)
        delta = self._decoded[self._visible : end]
        self._visible = end
        return delta
