"""`StopChecker`: one request's stop strings and stop regexes, checked token by token.

The scheduler must know when a request's *text* reaches a stop string or a `stop_regex` match,
so each such request carries a checker: an `IncrementalDetokenizer` (which holds back text that
could still become a stop string, and finds stop strings with an Aho-Corasick automaton) and a
`StopRegexScanner` (RE2 over a bounded window of the visible text). Per token both cost time
bounded by the token's text and the window, not by the output's length. The detokenizing side
trims the final text the same way (`stop_matcher.regex_stop_start`). This module decides
nothing else about finishing (stop tokens, length and grammars are `results.py`'s).
"""

from __future__ import annotations

from typing import Any

from arborlm.runtime.detokenizer import IncrementalDetokenizer
from arborlm.runtime.stop_matcher import StopRegexScanner


class StopChecker:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: list[str],
                 stop_regex: list[str], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool):
        self._args = (tokenizer, prompt_ids, stop, stop_regex, skip_special_tokens,
                      spaces_between_special_tokens)
        self.detok = IncrementalDetokenizer(
            tokenizer, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens, stop=stop,
            no_stop_trim=True)
        self.regex = StopRegexScanner(stop_regex) if stop_regex else None

    def restart(self, output_ids: list[int]) -> None:
        """Start again from the prompt and `output_ids` (after output tokens were dropped)."""
        self.__init__(*self._args)
        if output_ids:
            self.detok.add(output_ids)

    def add(self, token_ids: list[int]) -> None:
        """Feed tokens without checking for a match (before `min_new_tokens`)."""
        self.detok.add(token_ids)

    def check(self, token: int) -> str | None:
        """Feed one token; the stop string or the text of the `stop_regex` match it completes."""
        self.detok.add([token])
        if self.detok.matched_stop is not None:
            return self.detok.matched_stop
        if self.regex is not None:
            found = self.regex.scan(self.detok.decoded, self.detok.visible_len)
            if found is not None:
                return found[1]
        return None
