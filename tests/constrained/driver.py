"""Drive a grammar matcher the way the decode loop will: mask random logits, sample, accept.

`generate` plays a model whose logits are seeded noise, applies the matcher's bitmask with
`apply_token_bitmask_`, samples, and accepts the token, until the matcher terminates or the
budget runs out. A growing bias towards tokens holding a closing character (`"`, `]`, `}`,
`,`) stands in for a model that wants to finish, so most outputs complete within the budget;
the bias only reorders allowed tokens, the mask still decides what is legal. A token the
matcher's semantic guard rejects (`check_token`) is banned for the step and another sampled, at
most `MAX_GUARD_RETRIES` times, as the decode loop does; then the generation aborts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborlm.constrained.base import GrammarMatcher
from arborlm.constrained.bitmask import allocate_token_bitmask, apply_token_bitmask_
from arborlm.constrained.vocab import TokenVocab

MAX_GUARD_RETRIES = 16


@dataclass
class Generation:
    token_ids: list[int]  # without the final stop token
    terminated: bool
    aborted: str | None = None  # the guard's last reason when every retry was rejected

    def text(self, vocab: TokenVocab) -> str:
        return b"".join(vocab.decoded[t] for t in self.token_ids).decode("utf-8")


def force_text(matcher: GrammarMatcher, vocab: TokenVocab, text: str) -> list[int] | None:
    """Spell `text` with tokens the grammar allows (longest allowed prefix each step); the ids,
    or None when the grammar admits no spelling this greedy walk finds."""
    data, ids = text.encode(), []
    mask = allocate_token_bitmask(1, vocab.vocab_size)  # [1, W]
    while data:
        matcher.fill_bitmask(mask, 0)
        bits = mask[0]
        best = max((t for t, piece in enumerate(vocab.decoded)
                    if piece and data.startswith(piece) and (int(bits[t // 32]) >> (t % 32)) & 1),
                   key=lambda t: len(vocab.decoded[t]), default=None)
        if best is None or not matcher.accept_token(best):
            return None
        ids.append(best)
        data = data[len(vocab.decoded[best]):]
    return ids


def closing_bias(vocab: TokenVocab) -> torch.Tensor:
    bias = torch.zeros(vocab.vocab_size)  # [V]
    for token_id, text in enumerate(vocab.decoded):
        if any(ch in text for ch in b'"]},'):
            bias[token_id] = 1.0
    return bias


def generate(matcher: GrammarMatcher, vocab: TokenVocab, seed: int, budget: int = 400,
             bias: torch.Tensor | None = None, greedy: bool = False) -> Generation:
    """Sample under the grammar until it terminates (stop token accepted) or `budget` tokens."""
    gen = torch.Generator().manual_seed(seed)
    mask = allocate_token_bitmask(1, vocab.vocab_size)  # [1, W]
    out: list[int] = []
    for step in range(budget):
        logits = torch.randn(1, vocab.vocab_size, generator=gen)  # [1, V]
        if bias is not None:
            logits += bias * (step / 40.0)
        matcher.fill_bitmask(mask, 0)
        apply_token_bitmask_(logits, mask)
        reason = None
        for _ in range(MAX_GUARD_RETRIES):
            if not torch.isfinite(logits).any():
                break
            if greedy:
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            reason = matcher.check_token(token)
            if reason is None:
                break
            logits[0, token] = float("-inf")
        if reason is not None or not torch.isfinite(logits).any():
            return Generation(out, False, reason or "every allowed token was rejected")
        assert matcher.accept_token(token), f"sampled token {token} was masked in"
        if matcher.is_terminated():
            return Generation(out, True)
        out.append(token)
    return Generation(out, False)
