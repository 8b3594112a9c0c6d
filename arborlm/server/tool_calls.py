"""Tool calls in the chat template's format: the grammar that forces them, and the parser that
reads them back out of the model's text.

The format is the built-in ChatML template's (Hermes / Qwen2.5 style): each call is
`<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>`, calls written one after another.
The grammar also lets a newline follow `<tool_call>` and precede `</tool_call>`, as Qwen2.5's
own template writes them, and the parser accepts any whitespace there.

- `tool_policy(tools, tool_choice, parallel_tool_calls) -> ToolPolicy`: which tools the prompt
  offers, which ones a grammar forces (`required`: any of them; a named function: that one,
  once), and which names the parser takes calls of (`auto`: every offered tool; `none`: none).
- `ToolPolicy.grammar(max_whitespace)`: the forced calls as an xgrammar structural tag (the
  `structural_tag` sampling parameter): one or more calls — exactly one without
  `parallel_tool_calls` — each a `<tool_call>` block whose name is one tool's and whose
  arguments are JSON valid for that tool's `parameters` schema. Each schema first goes through
  the checks of the engine's `json_schema` path (`schema_check`: keywords xgrammar would drop
  are a 400 naming the tool). Structural tags are an xgrammar feature, so forced calls always
  use that backend.
- `parse_tool_calls(text, names)`: the calls found in a finished text, and what remains of it.
  A block whose body is not a JSON object naming a known tool stays in the content. Arguments
  come back re-serialized (`json.dumps`), so they are strict JSON even when the model wrote a
  raw control character inside a string (xgrammar's length-bounded JSON strings admit those).
- `ToolCallStream`: the same split for a streamed choice: text that cannot begin a call goes
  out at once; from the first `<tool_call>` on, text is held and parsed when the choice ends.

Not here: rendering tools into the prompt (`chat.py`) and OpenAI's response shapes
(`openai_format.py`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from arborlm.constrained.schema_check import checked_schema
from arborlm.constrained.schema_rewrite import rewrite_schema
from arborlm.errors import GrammarError, InvalidRequestError
from arborlm.server.openai_protocol import NamedToolChoice, Tool

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# What `parameters` means when a function omits it: no arguments (OpenAI's reading).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
_TAG_NEWLINE = {"type": "optional", "content": {"type": "const_string", "value": "\n"}}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ToolPolicy:
    """What a chat request asks of its tools."""

    offered: list[Tool] | None  # rendered into the prompt
    forced: list[Tool] | None  # the output must be calls of these (enforced by a grammar)
    parallel: bool  # forced: more than one call may be made
    names: frozenset[str]  # calls of these tools are parsed out of the output

    def grammar(self, max_whitespace: int) -> str | None:
        """The forced calls as a structural tag (None when nothing is forced); JSON inside the
        arguments has at most `max_whitespace` whitespace characters per gap."""
        if not self.forced:
            return None
        tags = [_call_tag(i, tool, max_whitespace) for i, tool in enumerate(self.forced)]
        return json.dumps({"type": "structural_tag", "format": {
            "type": "tags_with_separator", "tags": tags, "separator": "",
            "at_least_one": True, "stop_after_first": not self.parallel}})


def tool_policy(tools: list[Tool] | None, choice: str | NamedToolChoice | None,
                parallel: bool | None) -> ToolPolicy:
    """The policy of `tools` + `tool_choice` (default `auto` with tools, else `none`) +
    `parallel_tool_calls` (default true; it binds forced calls only, since `auto` parses
    whatever calls the model wrote); 400s for a choice that names nothing offered."""
    named = isinstance(choice, NamedToolChoice)
    if not tools:
        if choice == "required" or named:
            raise InvalidRequestError("tool_choice 'required' or a named function needs tools",
                                      "tool_choice")
        return ToolPolicy(None, None, False, frozenset())
    names = [t.function.name for t in tools]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise InvalidRequestError(f"tools: function names must be unique, {repeated[0]!r} "
                                  "appears more than once", "tools")
    parallel = parallel is not False
    if choice == "none":
        return ToolPolicy(None, None, False, frozenset())
    if choice is None or choice == "auto":
        return ToolPolicy(tools, None, parallel, frozenset(names))
    if named:
        forced = [t for t in tools if t.function.name == choice.function.name]
        if not forced:
            raise InvalidRequestError(f"tool_choice names function {choice.function.name!r}, "
                                      f"which is not among the tools ({', '.join(names)})",
                                      "tool_choice")
        return ToolPolicy(tools, forced, False, frozenset([choice.function.name]))
    return ToolPolicy(tools, tools, parallel, frozenset(names))


def _call_tag(index: int, tool: Tool, max_whitespace: int) -> dict[str, Any]:
    """One tool's `<tool_call>` block: its name as a constant, its arguments by its schema."""
    head = '{"name": ' + json.dumps(tool.function.name, ensure_ascii=False) + ', "arguments": '
    return {"type": "tag", "begin": TOOL_CALL_START, "end": TOOL_CALL_END, "content": {
        "type": "sequence", "elements": [
            _TAG_NEWLINE,
            {"type": "const_string", "value": head},
            {"type": "json_schema", "json_schema": _parameters(index, tool),
             "max_whitespace_cnt": max_whitespace},
            {"type": "const_string", "value": "}"},
            _TAG_NEWLINE]}}


def _parameters(index: int, tool: Tool) -> dict[str, Any] | bool:
    """A tool's parameters schema, checked and rewritten as the engine's json_schema path does."""
    params = tool.function.parameters
    where = f"tools[{index}].function.parameters"
    try:
        schema = checked_schema(json.dumps(NO_PARAMETERS if params is None else params),
                                "xgrammar")
    except GrammarError as e:
        detail = e.message.removeprefix("json_schema ")
        sep = " " if detail != e.message else ": "
        raise InvalidRequestError(f"{where}{sep}{detail}", "tools") from e
    return rewrite_schema(schema, "xgrammar")


def parse_tool_calls(text: str, names: frozenset[str]) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished text. Without calls the text is returned unchanged;
    with calls, the text around them (stripped), or None when nothing remains."""
    if not names or TOOL_CALL_START not in text:
        return text, []
    calls: list[ParsedCall] = []
    kept: list[str] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        call = _parse_call(match.group(1), names)
        if call is None:
            continue
        kept.append(text[pos:match.start()])
        pos = match.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[pos:])
    return "".join(kept).strip() or None, calls


def _parse_call(body: str, names: frozenset[str]) -> ParsedCall | None:
    try:
        call = json.loads(body, strict=False)  # strict=False: raw control characters in strings
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(call["name"], arguments)


class ToolCallStream:
    """Splits one streamed choice into content to send now and tool calls at its end.

    Feed it the cumulative text of each event: `content(text)` is the new text that cannot be
    part of a call (a tail that could still grow into `<tool_call>` waits for the next event);
    `finish(text)` returns the rest of the content and the calls. With no tool names it
    passes the text straight through.
    """

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.sent = 0  # characters of the text already returned as content
        self.calling = False  # a `<tool_call>` has started: hold everything from there

    def content(self, text: str) -> str:
        if self.calling:
            return ""
        end = len(text)
        if self.names:
            start = text.find(TOOL_CALL_START, self.sent)
            self.calling = start >= 0
            end = start if self.calling else end - _partial_suffix(text, TOOL_CALL_START)
        end = max(end, self.sent)
        new, self.sent = text[self.sent:end], end
        return new

    def finish(self, text: str) -> tuple[str, list[ParsedCall]]:
        head = self.content(text)
        rest, calls = parse_tool_calls(text[self.sent:], self.names)
        self.sent = len(text)
        return head + (rest or ""), calls


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
