"""Chat messages -> prompt token ids, through a Jinja chat template.

The template is the tokenizer's own, or the one given with `--chat-template` (a file path or
a template string). Content given as parts keeps its text parts (joined by newlines); other
parts (images, audio) are refused, since ArborLM serves text-only models. A rendered prompt
that already starts with the BOS token is encoded without special tokens, so BOS is never
doubled. This module renders and encodes only: which fields of a chat request become sampling
parameters is `openai_api.py`'s business.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from arborlm.errors import InvalidRequestError
from arborlm.server.openai_protocol import ChatMessage, Tool


def load_template(template: str | None) -> str | None:
    """`--chat-template`: the contents of an existing file, else the string itself."""
    if template is None:
        return None
    path = Path(template)
    try:
        if len(template) < 4096 and path.is_file():
            return path.read_text()
    except OSError:
        pass
    return template


def message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it: string content, tool calls as plain dicts."""
    out: dict[str, Any] = {"role": message.role, "content": _content(index, message.content)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _content(index: int, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise InvalidRequestError(
                f"messages[{index}].content[{j}]: only text parts are supported by this "
                f"text-only model, got type {part.type!r}", f"messages[{index}].content")
        texts.append(part.text)
    return "\n".join(texts)


class ChatRenderer:
    def __init__(self, tokenizer: Any, template: str | None = None):
        self.tokenizer = tokenizer
        self.template = load_template(template)
        self.bos = getattr(tokenizer, "bos_token", None)

    @property
    def available(self) -> bool:
        return self.template is not None or getattr(self.tokenizer, "chat_template", None)

    def render(self, messages: list[ChatMessage], tools: list[Tool] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        if not self.available:
            raise InvalidRequestError(
                "this model's tokenizer has no chat template; start the server with "
                "--chat-template", "messages")
        dicts = [message_dict(i, m) for i, m in enumerate(messages)]
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        try:
            return self.tokenizer.apply_chat_template(
                dicts, tools=tool_dicts, chat_template=self.template, tokenize=False,
                add_generation_prompt=True, **(template_kwargs or {}))
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001 - a template's own error (e.g. role order)
            raise InvalidRequestError(f"the chat template cannot render these messages: {e}",
                                      "messages") from e

    def encode(self, text: str) -> list[int]:
        starts_with_bos = bool(self.bos) and text.startswith(self.bos)
        return list(self.tokenizer.encode(text, add_special_tokens=not starts_with_bos))
