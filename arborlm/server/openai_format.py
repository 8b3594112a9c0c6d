"""Native engine events -> OpenAI response objects: choices, logprobs, usage, stream chunks.

Pure functions over the native events (`text`, `output_ids`, `meta_info`, logprob entries
`[logprob, token_id, text]`); `TokenTexts` supplies each token's text and raw bytes. A
logprob that is not finite (a banned token) is reported as `LOGPROB_FLOOR`, because OpenAI's
fields are numbers. A chat choice whose text holds tool calls (`tool_calls.py` finds them)
gets `message.tool_calls`, the remaining text (or null) as `content`, and finish reason
`tool_calls` when generation stopped on its own.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from arborlm.server.tokens import TokenTexts
from arborlm.server.tool_calls import ParsedCall, parse_tool_calls

LOGPROB_FLOOR = -9999.0


def finish_reason(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    return {"stop": "stop", "length": "length"}.get(reason["type"], reason["type"])


def matched_stop(meta: dict[str, Any]) -> int | str | None:
    reason = meta.get("finish_reason") or {}
    return reason.get("matched") if reason.get("type") == "stop" else None


def _lp(value: float | None) -> float | None:
    if value is None:
        return None
    return value if math.isfinite(value) else LOGPROB_FLOOR


def usage(finals: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (its n samples share it); completions add up."""
    prompt = cached = 0
    for start in range(0, len(finals), n):
        group = [f["meta_info"] for f in finals[start:start + n]]
        prompt += group[0]["prompt_tokens"]
        cached += max(m.get("cached_tokens", 0) for m in group)
    completion = sum(f["meta_info"]["completion_tokens"] for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


Segment = tuple[list, list, int]  # (logprob entries, top-logprob rows, text offset of the first)


def completion_logprobs(texts: TokenTexts, segments: list[Segment]) -> dict[str, Any]:
    """Completions' `logprobs`: tokens, token_logprobs, top_logprobs, text_offset.

    Segments are runs of tokens laid out from a known offset in the returned text (the echoed
    prompt from 0, the completion after it); special tokens (BOS, ...) take no room there."""
    tokens, token_lps, top_lps, offsets = [], [], [], []
    for entries, tops, offset in segments:
        for i, (lp, tid, _) in enumerate(entries):
            text = texts.text(tid)
            tokens.append(text)
            token_lps.append(_lp(lp))
            row = tops[i] if i < len(tops) else None
            top_lps.append(None if row is None else
                           {texts.text(t): _lp(v) for v, t, _ in row})
            offsets.append(offset)
            offset += 0 if tid in texts.special else len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top_lps,
            "text_offset": offsets}


def chat_logprobs(texts: TokenTexts, entries: list[list], tops: list) -> dict[str, Any]:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
    content = []
    for i, (lp, tid, _) in enumerate(entries):
        row = tops[i] if i < len(tops) and tops[i] is not None else []
        content.append({
            "token": texts.text(tid), "logprob": _lp(lp), "bytes": texts.bytes(tid),
            "top_logprobs": [{"token": texts.text(t), "logprob": _lp(v),
                              "bytes": texts.bytes(t)} for v, t, _ in row]})
    return {"content": content}


def completion_choice(index: int, final: dict[str, Any], texts: TokenTexts, *,
                      logprobs: bool, echo: str | None) -> dict[str, Any]:
    meta = final["meta_info"]
    prefix = echo or ""
    choice: dict[str, Any] = {"index": index, "text": prefix + final["text"], "logprobs": None,
                              "finish_reason": finish_reason(meta),
                              "matched_stop": matched_stop(meta)}
    if logprobs:
        choice["logprobs"] = completion_logprobs(texts, completion_segments(meta, echo, 0))
    return choice


def completion_segments(meta: dict[str, Any], echo: str | None, sent: int) -> list[Segment]:
    """The logprob segments of one event: the echoed prompt's (when given), then the output's,
    which starts after the echo and the `sent` characters already returned."""
    segments = []
    if echo is not None and meta.get("input_token_logprobs"):
        segments.append((meta["input_token_logprobs"], meta.get("input_top_logprobs", []), 0))
    segments.append((meta.get("output_token_logprobs", []), meta.get("output_top_logprobs", []),
                     len(echo or "") + sent))
    return segments


def chat_choice(index: int, final: dict[str, Any], texts: TokenTexts, *, logprobs: bool,
                tool_names: frozenset[str] = frozenset()) -> dict[str, Any]:
    """One chat choice; calls of the tools in `tool_names` are parsed out of the text."""
    meta = final["meta_info"]
    content, calls = parse_tool_calls(final["text"], tool_names)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [tool_call(call) for call in calls]
    choice: dict[str, Any] = {
        "index": index, "message": message, "logprobs": None,
        "finish_reason": tool_finish_reason(finish_reason(meta), calls),
        "matched_stop": matched_stop(meta)}
    if logprobs:
        choice["logprobs"] = chat_logprobs(texts, meta.get("output_token_logprobs", []),
                                           meta.get("output_top_logprobs", []))
    return choice


def tool_call(call: ParsedCall, index: int | None = None) -> dict[str, Any]:
    """OpenAI's tool call object; `index` is set in streamed deltas."""
    out: dict[str, Any] = {} if index is None else {"index": index}
    out.update({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}})
    return out


def tool_finish_reason(reason: str | None, calls: list[ParsedCall]) -> str | None:
    """`tool_calls` for a choice that made calls and stopped on its own (not at a length)."""
    return "tool_calls" if calls and reason == "stop" else reason
