"""`fit_draft`: a draft cut where its request's grammar rejects it, plus what the grammar forces.

Grammar-aware drafting for constrained requests. The request's own matcher walks the draft
(`accept_token` each, stopping at the first token the grammar rejects or the semantic guard's
`check_token` would reject, or one banned at the request's current position), then extends
what it kept, then `rollback`s its whole walk, so the matcher ends exactly where it started.
Two extensions, in this order:

- the tokens the grammar forces (`find_jump_forward_tokens`: the mask leaves exactly one), when
  something was kept or `forced_alone` (with jump-forward on, the result processor appends a
  forced run after every sampled token already, so there is none left to draft alone);
- the string the grammar forces (`find_jump_forward_string`: JSON's `"name": "` after `{`, or
  `, "born": ` after a value), spelled by the tokenizer (`encode`), when given. A string is
  forced where its tokens are not: the mask allows `name`, `na` and `n` alike after `{"`, so
  jump-forward, which appends only tokens any sampler would pick, leaves the model to spell a
  key token by token. As a draft the spelling costs nothing unless the model spells the string
  otherwise: verification then stops at the first token it would not have picked. The spelled
  tokens are walked like the draft's (cut at the first the grammar or guard rejects).

The target therefore never verifies a token the grammar would mask. Nothing here samples,
masks logits or touches the KV pool; outputs stay those of plain decoding because verification
samples every position with the grammar's mask (`Speculator.verify`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from arborlm.constrained.base import GrammarMatcher

# At most this many characters of a forced string are spelled per token of room in the draft
# (a `const` may force thousands).
MAX_TOKEN_CHARS = 32


@dataclass(frozen=True)
class FittedDraft:
    tokens: list[int]  # the kept draft tokens, the forced ones, then the spelled ones
    pruned: int  # draft tokens cut (the first rejected one and all after it)
    forced: int  # forced tokens appended
    spelled: int = 0  # tokens appended that spell the grammar's forced string


def fit_draft(matcher: GrammarMatcher, draft: list[int], position: int, limit: int, *,
              forced_alone: bool,
              encode: Callable[[str], list[int]] | None = None) -> FittedDraft:
    """`draft` cut before its first token `matcher` rejects, followed by the tokens the grammar
    forces after the kept part (when nothing is kept, only if `forced_alone`), then by
    `encode`'s spelling of the string it forces after those (when `encode` is given), at most
    `limit` tokens in all. `position` is the output position of the draft's first token (where
    the guard's bans apply). `matcher`'s state is unchanged on return."""
    walked = 0
    kept = forced = spelled = []

    def walk(tokens: list[int]) -> list[int]:
        """The leading tokens of `tokens` the matcher accepts from where it is (accepted)."""
        nonlocal walked
        taken: list[int] = []
        for tok in tokens:
            if walked == 0 and matcher.bans_at(position) and not _allowed_now(matcher, tok):
                break
            if (matcher.is_terminated() or matcher.check_token(tok) is not None
                    or not matcher.accept_token(tok)):
                break
            taken.append(tok)
            walked += 1
        return taken

    try:
        kept = walk(draft[:limit])
        if limit > walked and (kept or forced_alone):
            forced = walk(matcher.find_jump_forward_tokens(limit - walked))
        if encode is not None and limit > walked and not matcher.is_terminated():
            text = matcher.find_jump_forward_string()[:(limit - walked) * MAX_TOKEN_CHARS]
            if text:
                spelled = walk(encode(text)[:limit - walked])
    finally:
        matcher.rollback(walked)
    return FittedDraft(kept + forced + spelled, len(draft) - len(kept), len(forced),
                       len(spelled))


def _allowed_now(matcher: GrammarMatcher, token: int) -> bool:
    """Whether `matcher`'s mask (its bans included) allows `token` next."""
    row = torch.zeros(1, (matcher.vocab_size + 31) // 32, dtype=torch.int32)  # [1, ceil(V/32)]
    matcher.fill_bitmask(row, 0)
    return 0 <= token < matcher.vocab_size and bool((int(row[0, token >> 5]) >> (token & 31)) & 1)
