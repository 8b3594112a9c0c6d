"""Stop strings and stop regexes matched in time linear in the output, memory linear in the stops.

`StopStringMatcher` is an Aho-Corasick automaton over a request's stop strings, advanced one
character at a time as the text grows. It reports the match that *completes first* (the
smallest end offset; of the stop strings ending there, the longest), which is `find_stop`'s
rule, and its state's depth is the longest tail of the text that is a proper prefix of a stop
string: the text a detokenizer must hold back. Memory is one trie node per stop character.

`StopRegexScanner` matches `stop_regex` patterns with RE2 (linear time, no backtracking; see
`request_limits.compile_stop_regex`). After each token it searches only a window: the text
added since its previous scan plus the `STOP_REGEX_WINDOW_CHARS` characters before it, so a
match of up to that many characters is always found, in the step its last character arrives,
and a long output costs O(window) per step rather than a rescan of everything. Within the
window the patterns are tried in order; the first that matches wins, at its leftmost match.
`^`, `\\A` and `\\b` keep their meaning relative to the whole text.

`regex_stop_start` is the response side's half: given the text before and after the token that
completed a `stop_regex` match, it finds the same match again, so the final text is cut where
the scheduler stopped. This module knows text only; tokens are the detokenizer's business.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from arborlm.runtime.request_limits import STOP_REGEX_WINDOW_CHARS, compile_stop_regex


class StopStringMatcher:
    """Aho-Corasick automaton over non-empty stop strings, fed one character at a time.

    Node 0 is the root. `_next[n]` holds n's trie children, `_fail[n]` its failure link (the
    longest proper suffix of n's string that is also a trie node), `_depth[n]` the length of
    n's string, `_best[n]` the index of the longest stop string that is a suffix of n's string
    (-1 for none).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._next: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._best = [-1]
        for index, stop in enumerate(self.stops):
            node = 0
            for ch in stop:
                child = self._next[node].get(ch)
                if child is None:
                    child = len(self._next)
                    self._next[node][ch] = child
                    self._next.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._best.append(-1)
                node = child
            if self._best[node] < 0:  # duplicates: the first keeps the index
                self._best[node] = index
        self._fail = [0] * len(self._next)
        self._link_failures()
        self.state = 0

    def _link_failures(self) -> None:
        """Breadth-first: a node's failure link and inherited best match come from shallower
        nodes, whose links are already final."""
        queue = deque(self._next[0].values())
        while queue:
            node = queue.popleft()
            if self._best[node] < 0:
                self._best[node] = self._best[self._fail[node]]
            for ch, child in self._next[node].items():
                fail = self._fail[node]
                while fail and ch not in self._next[fail]:
                    fail = self._fail[fail]
                target = self._next[fail].get(ch, 0)
                self._fail[child] = target if target != child else 0
                queue.append(child)

    @property
    def held_len(self) -> int:
        """Characters at the end of the text fed so far that could still start a stop string."""
        return self._depth[self.state]

    def feed(self, text: str) -> tuple[int, str] | None:
        """Advance over `text`; at the first stop string completed, stop there and return
        (offset in `text` just past the match, the stop string)."""
        nxt, fail, best = self._next, self._fail, self._best
        state = self.state
        for i, ch in enumerate(text):
            while state and ch not in nxt[state]:
                state = fail[state]
            state = nxt[state].get(ch, 0)
            if best[state] >= 0:
                self.state = state
                return i + 1, self.stops[best[state]]
        self.state = state
        return None


def find_stop_regex(programs: Sequence[Any], text: str, start: int,
                    end: int) -> tuple[int, str] | None:
    """(offset, matched text) of the first program, in order, that matches in `text` at or after
    `start` and ending by `end`. Only `text[start - 1:end]` is handed to RE2 (the character
    before `start` keeps `\\b` and `^` right), so the cost is that of the window."""
    context = max(0, start - 1)
    window = text[context:end]
    for program in programs:
        m = program.search(window, start - context)
        if m is not None:
            return context + m.start(), m.group(0)
    return None


class StopRegexScanner:
    """`stop_regex` patterns matched over a growing text, a bounded window per scan."""

    def __init__(self, patterns: Sequence[str]):
        self.programs = [compile_stop_regex(p) for p in patterns]
        self.scanned = 0  # text length at the previous scan

    def scan(self, text: str, end: int) -> tuple[int, str] | None:
        """Search `text[:end]` (the text so far) for a match not seen by earlier scans."""
        start = max(0, self.scanned - STOP_REGEX_WINDOW_CHARS)
        self.scanned = end
        return find_stop_regex(self.programs, text, start, end)


def regex_stop_start(patterns: Sequence[str], text: str, before: int, end: int,
                     scanned_before: bool) -> int | None:
    """Where the `stop_regex` match that finished a request starts in `text`.

    `before` / `end` are the lengths of the text (as the scheduler's stop checker saw it) before
    and after the last token, and `scanned_before` whether the scheduler scanned after the token
    before it (it does not before `min_new_tokens`): the scheduler's last window, rebuilt."""
    start = max(0, before - STOP_REGEX_WINDOW_CHARS) if scanned_before else 0
    found = find_stop_regex([compile_stop_regex(p) for p in patterns], text, start, end)
    return None if found is None else found[0]


def finish_text(detok: Any, ids: list[int], reason: dict[str, Any], *, stop: Sequence[str],
                stop_regex: Sequence[str], no_stop_trim: bool, min_new_tokens: int,
                completion_tokens: int) -> str:
    """Feed a request's last token ids to its `IncrementalDetokenizer`, finish it, and return
    the final text, cut at the start of the `stop_regex` match that ended it (unless
    `no_stop_trim`). The response builders of both engine modes end a request through here.

    The scheduler scanned after each token, once `min_new_tokens` were out; its last window is
    rebuilt from the text before and after the last token (`regex_stop_start`)."""
    matched = reason.get("matched")
    by_regex = (reason.get("type") == "stop" and isinstance(matched, str) and bool(stop_regex)
                and matched not in stop and not no_stop_trim)
    if not by_regex:
        detok.add(ids)
        detok.finish()
        return detok.text
    detok.add(ids[:-1])
    before = detok.visible_len
    detok.add(ids[-1:])
    end = detok.visible_len
    detok.finish()
    scanned_before = completion_tokens - 1 >= max(1, min_new_tokens)
    cut = regex_stop_start(stop_regex, detok.decoded, before, end, scanned_before)
    return detok.text if cut is None else detok.text[:cut]
