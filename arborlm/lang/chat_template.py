"""Chat templates as the DSL uses them: a text prefix and suffix per role.

A program builds its prompt incrementally (`s += user(...)` appends the user prefix, the
content and the user suffix), so a template here is a table of strings rather than a Jinja
program. Backends get the model's own template from its tokenizer when they can (see
`model_template.py`, which derives such a table from the Jinja template and checks it); this
module holds the registry used otherwise — `chatml`, `llama-3`, `mistral` and a plain `default`
— and picks one by model name. Templates leave out the tokenizer's BOS token, which the runtime
adds when it tokenizes the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()
    # Text before the first message (a template's fixed preamble; not the tokenizer's BOS).
    preamble: str = ""
    aliases: tuple[str, ...] = field(default=(), compare=False)

    def get_prefix_and_suffix(self, role: str, hist_messages: list[dict]) -> tuple[str, str]:
        """The strings around a message of `role` that follows `hist_messages`."""
        if role not in self.role_prefix_and_suffix:
            raise ValueError(f"chat template {self.name!r} has no role {role!r}; "
                             f"roles: {', '.join(self.role_prefix_and_suffix)}")
        prefix, suffix = self.role_prefix_and_suffix[role]
        if not hist_messages:
            prefix = self.preamble + prefix
        return prefix, suffix

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The text a program produces by adding `messages` in order (default system prompt
        included when the first message is not a system one)."""
        if messages and messages[0]["role"] != "system" and self.default_system_prompt:
            messages = [{"role": "system", "content": self.default_system_prompt}, *messages]
        out: list[str] = []
        for i, msg in enumerate(messages):
            prefix, suffix = self.get_prefix_and_suffix(msg["role"], messages[:i])
            out.append(prefix + msg["content"] + suffix)
        if add_generation_prompt:
            out.append(self.get_prefix_and_suffix("assistant", messages)[0])
        return "".join(out)


_REGISTRY: dict[str, ChatTemplate] = {}


def register_chat_template(template: ChatTemplate) -> None:
    for name in (template.name, *template.aliases):
        _REGISTRY[name] = template


def get_chat_template(name: str) -> ChatTemplate:
    if name not in _REGISTRY:
        raise ValueError(f"unknown chat template {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def chat_template_names() -> list[str]:
    return sorted(_REGISTRY)


def get_chat_template_by_model_path(model_path: str | None) -> ChatTemplate:
    """The registry's guess from a model's name or path; `default` when nothing matches."""
    path = (model_path or "").lower()
    if "llama-3" in path or "llama3" in path:
        return get_chat_template("llama-3")
    if "mistral" in path or "mixtral" in path:
        return get_chat_template("mistral")
    if any(key in path for key in ("qwen", "chatml", "hermes", "yi-", "smollm")):
        return get_chat_template("chatml")
    return get_chat_template("default")


register_chat_template(ChatTemplate(
    name="default",
    role_prefix_and_suffix={"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"),
                            "assistant": ("ASSISTANT:", "\n")},
))

register_chat_template(ChatTemplate(
    name="chatml",
    role_prefix_and_suffix={role: (f"<|im_start|>{role}\n", "<|im_end|>\n") for role in ROLES},
    stop_str=("<|im_end|>",),
))

register_chat_template(ChatTemplate(
    name="llama-3",
    role_prefix_and_suffix={
        role: (f"<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>") for role in ROLES},
    stop_str=("<|eot_id|>",),
    aliases=("llama-3-instruct",),
))

register_chat_template(ChatTemplate(
    name="mistral",
    role_prefix_and_suffix={"system": ("[SYSTEM_PROMPT] ", " [/SYSTEM_PROMPT]"),
                            "user": ("[INST] ", " [/INST]"), "assistant": ("", "</s>")},
    stop_str=("</s>",),
))
