"""`fit_draft`: a draft cut where its request's grammar rejects it, plus the tokens it forces next.

Grammar-aware drafting for constrained requests. The request's own matcher walks the draft
(`accept_token` each, stopping at the first token the grammar rejects or the semantic guard's
`check_token` would reject, or one banned at the request's current position), then finds the
tokens forced after what it kept (`find_jump_forward_tokens`: the mask leaves exactly one),
then `rollback`s its walk, so the matcher ends exactly where it started. The target therefore
never verifies a token the grammar would mask, and a forced run after an n-gram draft (a key
name after `{`, the `", "` after a value) rides in the same verify forward.

It does not propose forced runs on their own when jump-forward is on: after every sampled
token the result processor already appends them and computes their KV in one extend, so
drafting them again would save nothing. It does not sample, mask logits or touch the KV pool;
outputs stay those of plain decoding because verification samples every position with the
grammar's mask (`Speculator.verify`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborlm.constrained.base import GrammarMatcher


@dataclass(frozen=True)
class FittedDraft:
    tokens: list[int]  # the kept draft tokens, then the forced ones
    pruned: int  # draft tokens cut (the first rejected one and all after it)
    forced: int  # forced tokens appended


def fit_draft(matcher: GrammarMatcher, draft: list[int], position: int, limit: int, *,
              forced_alone: bool) -> FittedDraft:
    """`draft` cut before its first token `matcher` rejects, followed by the tokens the grammar
    forces after the kept part (when nothing is kept, only if `forced_alone`), at most `limit`
    tokens in all. `position` is the output position of the draft's first token (where the
    guard's bans apply). `matcher`'s state is unchanged on return."""
    kept = 0
    banned = bool(draft) and bool(matcher.bans_at(position)) and \
        not _allowed_now(matcher, draft[0])
    try:
        for tok in [] if banned else draft[:limit]:
            if (matcher.is_terminated() or matcher.check_token(tok) is not None
                    or not matcher.accept_token(tok)):
                break
            kept += 1
        forced = matcher.find_jump_forward_tokens(limit - kept) \
            if limit > kept and (kept or forced_alone) else []
    finally:
        matcher.rollback(kept)
    return FittedDraft(draft[:kept] + forced, len(draft) - kept, len(forced))


def _allowed_now(matcher: GrammarMatcher, token: int) -> bool:
    """Whether `matcher`'s mask (its bans included) allows `token` next."""
    row = torch.zeros(1, (matcher.vocab_size + 31) // 32, dtype=torch.int32)  # [1, ceil(V/32)]
    matcher.fill_bitmask(row, 0)
    return 0 <= token < matcher.vocab_size and bool((int(row[0, token >> 5]) >> (token & 31)) & 1)
