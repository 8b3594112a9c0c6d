"""A model's own chat template (Jinja, from its tokenizer) as the DSL's per-role table.

Method: render short conversations whose contents are unique sentinel words, and read each
role's prefix and suffix off the text between the sentinels:

    [system S, user U1, assistant A, user U2]  ->  P0 S X1 U1 X2 A X3 U2 X4
    ... + add_generation_prompt                ->  the assistant prefix
    [system S, user U1, assistant A]           ->  ... A Y    (Y: the assistant suffix)
    [user U1]                                  ->  Pu U1 ...  (a default system prompt?)

user suffix = X4; X2 = user suffix + assistant prefix; X3 = assistant suffix + user prefix;
X1 = system suffix + user prefix; P0 = preamble + system prefix (the preamble is the BOS token
when P0 starts with it). The derived table is then checked against the Jinja rendering of
other conversations; templates that this table cannot express (system text folded into the
first user turn, per-turn special cases) fail the check and the caller falls back to the
registry (`chat_template.get_chat_template_by_model_path`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from arborlm.lang.chat_template import ChatTemplate

logger = logging.getLogger(__name__)

Render = Callable[[list[dict], bool], str]

_S, _U1, _A, _U2 = "ArborSentinelSystem", "ArborSentinelUserOne", "ArborSentinelReply", \
    "ArborSentinelUserTwo"
_CHECKS = (
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello! Ask away."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "First question"}, {"role": "assistant", "content": "Answer"},
     {"role": "user", "content": "Second"}],
)


def _msgs(*pairs: tuple[str, str]) -> list[dict]:
    return [{"role": r, "content": c} for r, c in pairs]


def _split(text: str, sentinels: list[str]) -> list[str] | None:
    """Text around each sentinel, in order; None unless each occurs exactly once."""
    parts, rest = [], text
    for s in sentinels:
        if rest.count(s) != 1:
            return None
        before, rest = rest.split(s)
        parts.append(before)
    return [*parts, rest]


def _strip_prefix(text: str, prefix: str) -> str | None:
    return text[len(prefix):] if text.startswith(prefix) else None


def _strip_suffix(text: str, suffix: str) -> str | None:
    if not suffix:
        return text
    return text[:-len(suffix)] if text.endswith(suffix) else None


def derive_chat_template(render: Render, bos_token: str | None = None, *, drop_bos: bool = True,
                         name: str = "model") -> ChatTemplate | None:
    """The per-role table of the template behind `render(messages, add_generation_prompt)`.

    `drop_bos`: leave a leading `bos_token` out of the table (the runtime adds it when it
    tokenizes). None when the template cannot be expressed as a table or fails the check.
    """
    try:
        table = _derive(render, bos_token or "")
    except Exception as e:  # noqa: BLE001 - a Jinja template may raise anything
        logger.info("chat template not derivable: %r", e)
        return None
    if table is None:
        return None
    preamble, roles, default_system = table
    full = ChatTemplate(name, roles, default_system, _stop_str(roles), preamble)
    try:
        ok = all(render(m, add) == full.render(m, add) for m in _CHECKS for add in (False, True))
    except Exception:  # noqa: BLE001
        ok = False
    if not ok:
        logger.info("derived chat template does not reproduce the model's template")
        return None
    if drop_bos and bos_token and preamble.startswith(bos_token):
        preamble = preamble[len(bos_token):]
    return ChatTemplate(name, roles, default_system, _stop_str(roles), preamble)


def _stop_str(roles: dict[str, tuple[str, str]]) -> tuple[str, ...]:
    end = roles["assistant"][1].strip()
    return (end,) if end else ()


def _derive(render: Render, bos: str) -> tuple[str, dict, str | None] | None:
    conv = _msgs(("system", _S), ("user", _U1), ("assistant", _A), ("user", _U2))
    parts = _split(render(conv, False), [_S, _U1, _A, _U2])
    with_gen = render(conv, True)
    replied = _split(render(conv[:3], False), [_S, _U1, _A])
    user_only = _split(render(conv[1:2], False), [_U1])
    if parts is None or replied is None or user_only is None:
        return None
    p0, x1, x2, x3, user_suffix = parts
    assistant_prefix = _strip_prefix(with_gen, render(conv, False))
    assistant_suffix = replied[-1]
    if assistant_prefix is None or x2 != user_suffix + assistant_prefix:
        return None
    user_prefix = _strip_prefix(x3, assistant_suffix)
    system_suffix = None if user_prefix is None else _strip_suffix(x1, user_prefix)
    if user_prefix is None or system_suffix is None:
        return None
    preamble = bos if bos and p0.startswith(bos) else ""
    system_prefix = p0[len(preamble):]
    roles = {"system": (system_prefix, system_suffix), "user": (user_prefix, user_suffix),
             "assistant": (assistant_prefix, assistant_suffix)}
    default_system = _default_system(user_only[0], preamble, roles)
    if default_system is False:
        return None
    return preamble, roles, default_system or None


def _default_system(before_user: str, preamble: str, roles: dict) -> str | None | bool:
    """The system text a template inserts when a chat starts without one: None when it
    inserts nothing, False when the text before the first user message is unexplained."""
    user_prefix = roles["user"][0]
    if before_user == preamble + user_prefix:
        return None
    system_prefix, system_suffix = roles["system"]
    middle = _strip_prefix(before_user, preamble + system_prefix)
    middle = None if middle is None else _strip_suffix(middle, system_suffix + user_prefix)
    return False if middle is None else middle


def chat_template_from_tokenizer(tokenizer: Any, name: str | None = None) -> ChatTemplate | None:
    """The model's own template from a Hugging Face tokenizer, or None (no template, or not
    expressible as a table)."""
    if not getattr(tokenizer, "chat_template", None):
        return None

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)

    bos = getattr(tokenizer, "bos_token", None)
    adds_bos = bos is not None and tokenizer.bos_token_id in tokenizer.encode("")
    return derive_chat_template(render, bos, drop_bos=adds_bos,
                                name=name or str(getattr(tokenizer, "name_or_path", "model")))
