"""Admission of waiting requests into a prefill batch: a per-step budget object.

The budget counts, in tokens:
- `rem_total`: KV slots that are free or evictable from the prefix cache, minus the future
  tokens that running requests are expected to still need (their remaining `max_new_tokens`,
  clipped and scaled by `new_token_ratio`, which decode scheduling (`decode.py`) lowers while
  memory is plentiful and raises after a retraction);
- `rem_input`: new prompt tokens this step may prefill (`max_prefill_tokens`);
- `rem_chunk`: the chunk size for chunked prefill (only one request is chunked at a time);
- `rem_reqs`: request slots (rows) left.
It decides; the scheduler allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

from arborlm.runtime.request import Req

# Future decode tokens counted per running request are clipped to this many.
RESERVE_CLIP = 4096


def reserved_tokens(req: Req) -> int:
    """Decode tokens `req` may still need."""
    left = req.sampling_params.max_new_tokens - len(req.output_ids)
    return max(0, min(left, RESERVE_CLIP))


@dataclass
class Admission:
    extend_len: int  # new tokens to prefill this step
    chunked: bool  # True if the prompt continues in a later step


class PrefillBudget:
    def __init__(self, rem_total: int, rem_input: int, rem_chunk: int | None, rem_reqs: int,
                 new_token_ratio: float, page_size: int):
        self.rem_total = rem_total
        self.rem_input = rem_input
        self.rem_chunk = rem_chunk  # None: chunking disabled
        self.rem_reqs = rem_reqs
        self.ratio = new_token_ratio
        self.page_size = page_size
        self.has_chunked = False
        self.empty = True

    def try_admit(self, req: Req, prefix_len: int) -> Admission | None:
        """Admit `req` (whose first `prefix_len` tokens are cached) or return None if full."""
        if self.rem_reqs <= 0:
            return None
        extend = req.total_len - prefix_len
        assert extend > 0, "the last prompt token is always recomputed"
        future = int(reserved_tokens(req) * self.ratio)
        fits_input = extend <= self.rem_input or self.empty
        fits_chunk = self.rem_chunk is None or extend <= self.rem_chunk
        if fits_input and fits_chunk:
            if extend + future + self.page_size > self.rem_total:
                return None
            self._take(extend, extend + future + self.page_size)
            return Admission(extend, chunked=False)
        if self.rem_chunk is None or self.has_chunked:
            return None
        # Chunk: a page-aligned piece of the prompt that fits this step's token budgets.
        size = min(self.rem_chunk, self.rem_input, self.rem_total - self.page_size)
        end = (prefix_len + size) // self.page_size * self.page_size
        size = end - prefix_len
        if size <= 0:
            return None
        self.has_chunked = True
        self._take(size, size + self.page_size)
        return Admission(size, chunked=True)

    def _take(self, extend: int, total: int) -> None:
        self.rem_input -= extend
        if self.rem_chunk is not None:
            self.rem_chunk -= extend
        self.rem_total -= total
        self.rem_reqs -= 1
        self.empty = False
