"""In-batch prefix deduplication at admission.

Requests that arrive together with a long common prefix (a shared system prompt, the branches
of a fork) would all miss the cache if they were prefilled in the same step: the prefix is only
inserted into the radix tree after the step. So while a prefill batch is being built, a waiting
request whose prompt shares at least `min_shared` more tokens with an already admitted request
than it found in the cache is held back one step; by then the admitted request's prompt is in
the tree and the held-back request reuses it. The first request of a step is never held back,
so this cannot stall the queue.
"""

from __future__ import annotations

from arborlm.runtime.request import Req

IN_BATCH_MIN_SHARED = 32


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    step = 64
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


class InBatchPrefixFilter:
    def __init__(self, min_shared: int = IN_BATCH_MIN_SHARED):
        self.min_shared = min_shared
        self._admitted: list[tuple[str | None, list[int]]] = []

    def start_batch(self) -> None:
        self._admitted = []

    def should_defer(self, req: Req) -> bool:
        ids = req.fill_ids
        for key, other in self._admitted:
            if key == req.extra_key and (
                    common_prefix_len(ids, other) >= req.cached_len + self.min_shared):
                return True
        return False

    def admitted(self, req: Req) -> None:
        self._admitted.append((req.extra_key, req.fill_ids))


class NoInBatchFilter(InBatchPrefixFilter):
    """Without a prefix cache nothing is gained by holding requests back."""

    def should_defer(self, req: Req) -> bool:
        return False

    def admitted(self, req: Req) -> None:
        return None
