"""Chat templates: the registry, picking by model name, and deriving a model's own template."""

from __future__ import annotations

import jinja2
import pytest

from arborlm.lang.chat_template import (
    chat_template_names,
    get_chat_template,
    get_chat_template_by_model_path,
)
from arborlm.lang.model_template import chat_template_from_tokenizer, derive_chat_template

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "Only a user turn"}],
]

LLAMA3_JINJA = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = 'Cutting Knowledge.' %}"
    "{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content']|trim"
    " + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

# System text folded into the first user turn: not expressible as per-role prefixes.
LLAMA2_JINJA = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] }}"
    "<</SYS>>{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }} </s>{% endif %}{% endfor %}")


def jinja_render(source: str, bos: str):
    template = jinja2.Environment().from_string(source)
    return lambda messages, add: template.render(messages=messages, add_generation_prompt=add,
                                                 bos_token=bos)


def test_registry_has_the_common_templates():
    assert {"chatml", "llama-3", "mistral", "default"} <= set(chat_template_names())
    chatml = get_chat_template("chatml")
    assert chatml.render(CONVERSATIONS[0], add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\nHi!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="unknown chat template"):
        get_chat_template("nope")
    with pytest.raises(ValueError, match="no role"):
        chatml.get_prefix_and_suffix("narrator", [])


@pytest.mark.parametrize("path, name", [
    ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3"),
    ("/models/llama3.1-70b", "llama-3"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistral"),
    ("Qwen/Qwen2-7B-Instruct", "chatml"),
    ("/models/some-other-model", "default"),
    (None, "default"),
])
def test_template_chosen_by_model_name(path, name):
    assert get_chat_template_by_model_path(path).name == name


def test_derived_from_tiny_model_tokenizer_matches_its_jinja(tiny_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_path))
    template = chat_template_from_tokenizer(tok)
    assert template is not None
    assert template.role_prefix_and_suffix["user"] == ("<|im_start|>user\n", "<|im_end|>\n")
    assert template.stop_str == ("<|im_end|>",)
    for conv in CONVERSATIONS:
        for add in (False, True):
            jinja = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add)
            # The tokenizer adds BOS itself, so the derived table leaves it out.
            assert jinja == tok.bos_token + template.render(conv, add)


def test_derived_llama3_style_finds_default_system_prompt():
    render = jinja_render(LLAMA3_JINJA, "<|begin_of_text|>")
    template = derive_chat_template(render, "<|begin_of_text|>", drop_bos=False)
    assert template is not None
    assert template.default_system_prompt == "Cutting Knowledge."
    assert template.preamble == "<|begin_of_text|>"
    assert template.stop_str == ("<|eot_id|>",)
    for conv in CONVERSATIONS:
        assert template.render(conv, True) == render(conv, True)
    dropped = derive_chat_template(render, "<|begin_of_text|>")
    assert dropped.preamble == ""


def test_underivable_template_returns_none():
    assert derive_chat_template(jinja_render(LLAMA2_JINJA, "<s>"), "<s>") is None

    def broken(messages, add):
        raise jinja2.TemplateError("only user messages")

    assert derive_chat_template(broken, "<s>") is None
