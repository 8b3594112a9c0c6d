"""`NgramIndex`: prompt-lookup drafts from a request's own prompt and output; `SharedNgramCache`.

The index maps every n-gram (n in [min_window, max_window]) of a token sequence to the end of
its latest occurrence that still has a token after it. A draft is what followed the latest
earlier occurrence of the sequence's current suffix, trying the longest window first. Tokens
are indexed incrementally as the sequence grows, so a lookup costs O(windows), not O(length).
`SharedNgramCache` is the server-wide fallback: a bounded, least-recently-written map from the
n-grams of finished requests' tokens to what followed them. `NgramDrafter` puts the two
together as NGRAM's drafter: an index per request, the shared cache as the fallback. None of
them knows the KV pool or verification (`speculator.py`).
"""

from __future__ import annotations

from collections import OrderedDict

from arborlm.runtime.request import Req

# The server-wide n-gram cache: n-grams of this many tokens (at least the min window), at most
# this many entries (each a tuple of up to the longest draft's ids).
SHARED_WINDOW = 3
SHARED_CAPACITY = 200_000


class NgramIndex:
    def __init__(self, min_window: int, max_window: int):
        assert 1 <= min_window <= max_window, (min_window, max_window)
        self.min_window = min_window
        self.max_window = max_window
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence
        self._indexed = 0  # n-grams ending at positions <= this are in `_ends`

    def _extend(self, tokens: list[int]) -> None:
        """Index the n-grams that end before the last token (each has a continuation)."""
        for end in range(max(self._indexed + 1, self.min_window), len(tokens)):
            for n in range(self.min_window, min(self.max_window, end) + 1):
                self._ends[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, len(tokens) - 1)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` (at least `min_window` long) seen before; [] when none recurs. `tokens`
        must extend the sequence of the previous calls."""
        if k <= 0:
            return []
        self._extend(tokens)
        last = len(tokens)
        for n in range(min(self.max_window, last - 1), self.min_window - 1, -1):
            end = self._ends.get(tuple(tokens[last - n:]))
            if end is not None:
                return tokens[end:min(end + k, last)]
        return []


class SharedNgramCache:
    """`window`-grams of finished sequences -> the (up to `max_draft`) tokens that followed,
    at most `capacity` entries (the least recently written go first)."""

    def __init__(self, window: int, max_draft: int, capacity: int):
        assert window >= 1 and max_draft >= 1 and capacity >= 1
        self.window = window
        self.max_draft = max_draft
        self.capacity = capacity
        self._next: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def clear(self) -> None:
        self._next.clear()

    def add(self, tokens: list[int], start: int = 0) -> None:
        """Record the n-grams of `tokens` that end at or after `start` (and have a token after
        them)."""
        w = self.window
        for end in range(max(w, start), len(tokens)):
            key = tuple(tokens[end - w:end])
            self._next[key] = tuple(tokens[end:end + self.max_draft])
            self._next.move_to_end(key)
        while len(self._next) > self.capacity:
            self._next.popitem(last=False)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the last `window` tokens of `tokens` elsewhere."""
        if k <= 0 or len(tokens) < self.window:
            return []
        return list(self._next.get(tuple(tokens[-self.window:]), ())[:k])


class NgramDrafter:
    """NGRAM's drafts: from each request's own tokens (`NgramIndex`, n-grams of `min_window` to
    `max_window` tokens), else from the n-grams of finished requests (`SharedNgramCache`)."""

    def __init__(self, min_window: int, max_window: int, max_draft: int):
        self.min_window = min_window
        self.max_window = max_window
        self.indexes: dict[Req, NgramIndex] = {}
        self.shared = SharedNgramCache(max(SHARED_WINDOW, min_window), max_draft,
                                       SHARED_CAPACITY)

    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        return [self._draft(r, k) if k > 0 else [] for r, k in zip(reqs, ks)]

    def _draft(self, req: Req, k: int) -> list[int]:
        index = self.indexes.get(req)
        if index is None:
            index = self.indexes[req] = NgramIndex(self.min_window, self.max_window)
        tokens = req.fill_ids
        return index.draft(tokens, k) or self.shared.draft(tokens, k)

    def release(self, req: Req) -> None:
        """A request finished: its tokens join the server-wide cache (unless aborted)."""
        self.indexes.pop(req, None)
        if req.output_ids and not (req.finished_reason and req.finished_reason.type == "abort"):
            self.shared.add(req.fill_ids)

    def reset(self) -> None:
        self.shared.clear()

    def check_integrity(self) -> None:
        assert not self.indexes, f"n-gram indexes held while idle: {len(self.indexes)}"
