"""Stop strings (Aho-Corasick) and stop regexes (RE2 over a window) against their definitions:
`find_stop` for strings, a whole-text search for regexes; linear cost on the inputs that made
the old matchers quadratic or exponential."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arborlm.errors import InvalidRequestError
from arborlm.runtime.detokenizer import find_stop
from arborlm.runtime.request_limits import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    STOP_REGEX_WINDOW_CHARS,
    compile_stop_regex,
)
from arborlm.runtime.stop_matcher import (
    StopRegexScanner,
    StopStringMatcher,
    find_stop_regex,
    regex_stop_start,
)

ALPHABET = "ab c😀é"


def _chunks(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _held_reference(text: str, stops: list[str]) -> int:
    """Longest tail of `text` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s))
                if k <= len(text) and text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40),
       stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), min_size=1,
                      max_size=5),
       cuts=st.lists(st.integers(0, 60), max_size=6))
def test_automaton_agrees_with_find_stop_however_the_text_arrives(text, stops, cuts):
    matcher = StopStringMatcher(stops)
    fed = 0
    for chunk in _chunks(text, cuts):
        found = matcher.feed(chunk)
        if found is not None:
            end = fed + found[0]
            assert find_stop(text, stops) == (end - len(found[1]), found[1])
            return
        fed += len(chunk)
        assert find_stop(text[:fed], stops) is None
        assert matcher.held_len == _held_reference(text[:fed], stops)
    assert find_stop(text, stops) is None


def test_automaton_ties_go_to_the_longest_and_first_completion_wins():
    assert StopStringMatcher(["bc", "abc"]).feed("xabcd") == (4, "abc")
    assert StopStringMatcher(["abcd", "bc", "c"]).feed("xxabcd") == (5, "bc")
    assert StopStringMatcher(["aab"]).feed("aaab") == (4, "aab")  # a failure link, not a reset


def test_automaton_memory_is_linear_in_the_stop_strings():
    """Bug: the detokenizer kept every prefix of every stop string (a 1,000,000-character stop
    string grew the scheduler to ~18 GB). The automaton has one node per stop character."""
    stops = [f"{i:03d}" + "x" * (MAX_STOP_STRING_CHARS - 3) for i in range(MAX_STOP_STRINGS)]
    matcher = StopStringMatcher(stops)
    assert len(matcher._depth) <= sum(map(len, stops)) + 1
    text = "x" * 50_000
    assert matcher.feed(text) is None
    assert matcher.held_len == 0  # no stop string starts with "x"
    assert matcher.feed(stops[7]) == (len(stops[7]), stops[7])


def test_catastrophic_stop_regex_runs_in_linear_time():
    """Bug: `"stop_regex": "(a+)+b"` over 26 "a"s backtracked for 14 s in Python's `re`."""
    scanner = StopRegexScanner(["(a+)+b"])
    text = ""
    for _ in range(2000):
        text += "a"
        assert scanner.scan(text, len(text)) is None
    text += "b"
    assert scanner.scan(text, len(text)) == (len(text) - STOP_REGEX_WINDOW_CHARS - 1,
                                              "a" * STOP_REGEX_WINDOW_CHARS + "b")


@pytest.mark.parametrize("pattern, reason", [
    ("([", "missing ]"),
    (r"(a)\1", "invalid escape"),
    ("(?=a)b", "invalid perl operator"),
    ("(?<!a)b", "invalid perl operator"),
    ("a{1000}{1000}", "bad repetition operator"),
    (r"\pL{1000}", "pattern too large"),  # over STOP_REGEX_MAX_MEM
])
def test_patterns_re2_cannot_run_are_refused_with_the_reason(pattern, reason):
    """Bug: `"stop_regex": "(["` killed the scheduler process (unterminated character set)."""
    with pytest.raises(InvalidRequestError, match="stop_regex") as info:
        compile_stop_regex(pattern)
    assert reason in info.value.message and info.value.param == "stop_regex"


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab \n", max_size=60),
       pattern=st.sampled_from(["a b", r"\bab\b", "^b", "b+a", r"a\s*\n", "(a|b){3}$"]),
       cuts=st.lists(st.integers(0, 80), max_size=8))
def test_window_finds_what_a_whole_text_search_finds(text, pattern, cuts):
    """Matches shorter than the window: the scanner stops at the first text that contains one
    (anchors and word boundaries relative to the whole text), and the response side's
    `regex_stop_start` finds the same match from the lengths before and after the last piece."""
    program = compile_stop_regex(pattern)
    scanner = StopRegexScanner([pattern])
    shown, before = "", 0
    for chunk in _chunks(text, cuts):
        shown += chunk
        found = scanner.scan(shown, len(shown))
        whole = program.search(shown)
        if found is not None:
            assert whole is not None and found == (whole.start(), whole.group(0))
            assert regex_stop_start([pattern], shown, before, len(shown), before > 0) == found[0]
            return
        assert whole is None
        before = len(shown)


def test_regex_window_is_bounded():
    """Each scan hands RE2 the new text plus the window before it, not the whole output."""
    seen: list[int] = []

    class Spy:
        def search(self, window, pos):
            seen.append(len(window))
            return None

    text = "x" * 100_000
    assert find_stop_regex([Spy()], text, len(text) - 10, len(text)) is None
    scanner = StopRegexScanner(["q"])
    scanner.programs = [Spy()]
    for end in range(1, 5000, 7):
        scanner.scan(text, end)
    assert max(seen) <= STOP_REGEX_WINDOW_CHARS + 8
