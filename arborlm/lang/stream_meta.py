"""A streamed gen's `meta_info`: its chunks added up, and the part each streamed piece reports.

Runtimes stream logprobs the way SGLang 0.5 does: a chunk's output lists (`STREAMED_KEYS`) hold
the entries new since the previous chunk, `output_token_logprobs_length` counts all of them so
far, and every other field is the latest value. `accumulate` adds a chunk to a gen's running
`meta_info` (what `get_meta_info` returns once the gen is done: whole lists, as without
streaming); it also takes a server that sends cumulative lists (a list as long as the count is
the whole list). `since` is that total with the output lists cut to the entries after what was
already reported: what `text_async_iter(var, return_meta_data=True)` yields with each piece, so
the pieces' lists add up to the whole even when several chunks arrive between two pieces.
"""

from __future__ import annotations

from typing import Any

STREAMED_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
INPUT_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
LENGTH_KEY = "output_token_logprobs_length"


def accumulate(total: dict[str, Any] | None, chunk: dict[str, Any]) -> dict[str, Any]:
    """`total` (None before the first chunk) with `chunk` added; updated in place.

    The output lists of `total` only grow (so a caller holding the lock that guards `total`
    can slice them); an input list is replaced, unless the chunk's is empty (a runtime that
    sends the prompt's entries only once).
    """
    total = {} if total is None else total
    count = chunk.get(LENGTH_KEY)
    for key, value in chunk.items():
        if key in STREAMED_KEYS:
            entries = total.setdefault(key, [])
            new = list(value or [])
            if count is not None and len(new) == count:  # a cumulative list
                entries.extend(new[len(entries):])
            else:
                entries.extend(new)
        elif key in INPUT_KEYS:
            if value or key not in total:
                total[key] = value
        else:
            total[key] = value
    if "output_token_logprobs" in total and count is None:
        total[LENGTH_KEY] = len(total["output_token_logprobs"])
    return total


def since(total: dict[str, Any], sent: dict[str, int]) -> dict[str, Any]:
    """`total` with each output list cut to its entries after `sent[key]`; advances `sent`."""
    piece = dict(total)
    for key in STREAMED_KEYS:
        if key in total:
            piece[key] = total[key][sent.get(key, 0):]
            sent[key] = len(total[key])
    return piece
