"""The primitives as values: gen options, typed gens, select checks, roles, `@function`,
the lazy re-exports, and constant-prefix tracing."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import arborlm
import arborlm.lang as sgl
from arborlm.lang.interpreter import convert_dtype
from arborlm.lang.ir import REGEX_INT, ConstantText, ExprList, Gen, GenParams, RoleBegin, RoleEnd


def test_import_arborlm_stays_light_and_reexports_the_language():
    code = ("import sys, arborlm; f = arborlm.function; g = arborlm.gen; "
            "r = arborlm.RuntimeEndpoint; "
            "print(sorted(m for m in ('torch', 'transformers', 'requests', 'fastapi') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
    assert arborlm.gen is sgl.gen and arborlm.select is sgl.select
    assert arborlm.EngineBackend is sgl.EngineBackend


def test_gen_maps_sglang_names_to_native_sampling_params():
    g = sgl.gen("x", max_tokens=7, min_tokens=2, stop=["\n"], temperature=0.5, top_k=4,
                return_logprob=True, top_logprobs_num=2)
    assert isinstance(g, Gen) and g.name == "x"
    assert g.params.sampling_params() == {"max_new_tokens": 7, "min_new_tokens": 2,
                                          "stop": ["\n"], "temperature": 0.5, "top_k": 4}
    assert g.params.logprob_options() == {"return_logprob": True, "top_logprobs_num": 2}


def test_program_defaults_fill_only_unset_options():
    defaults = GenParams.program_defaults(max_new_tokens=32, temperature=0.0)
    merged = sgl.gen(max_tokens=5).params.merged_over(defaults)
    assert merged.max_new_tokens == 5 and merged.temperature == 0.0 and merged.top_p == 1.0


def test_typed_gens_use_regexes_and_parse_values():
    assert sgl.gen_int("n").params.sampling_params()["regex"] == REGEX_INT
    assert sgl.gen("f", dtype=float).params.dtype == "float"
    assert sgl.gen("b", dtype="bool").params.sampling_params()["regex"] == "(True|False)"
    assert sgl.gen_string("s").params.dtype == "str"
    assert convert_dtype("n", "int", " -42\n") == -42
    assert convert_dtype("f", "float", "3.5") == 3.5
    assert convert_dtype("b", "bool", "False") is False
    assert convert_dtype("s", "str", '"hi there"') == "hi there"
    with pytest.raises(ValueError, match="not an int"):
        convert_dtype("n", "int", "-")
    with pytest.raises(ValueError, match="dtype"):
        sgl.gen("x", dtype=list)


def test_gen_constraints():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert sgl.gen("j", json_schema=schema).params.sampling_params()["json_schema"] == \
        '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    regex = sgl.gen("c", choices=["a.b", "c|d", "plain"]).params.regex
    assert [bool(re.fullmatch(regex, s)) for s in ("a.b", "c|d", "plain", "axb")] == \
        [True, True, True, False]
    with pytest.raises(ValueError, match="at most one"):
        sgl.gen("x", regex="a+", json_schema="{}")
    with pytest.raises(re.error):
        sgl.gen("x", regex="(unclosed")


def test_select_validates_its_choices():
    s = sgl.select("c", choices=["a", "b"])
    assert s.choices == ["a", "b"] and s.choices_method is sgl.token_length_normalized
    for bad in ([], ["a", ""]):
        with pytest.raises(ValueError):
            sgl.select("c", choices=bad)
    with pytest.raises(ValueError, match="temperature"):
        sgl.select("c", choices=["a"], temperature=0.7)


def test_roles_and_concatenation_build_expression_lists():
    expr = sgl.user("Q: " + sgl.gen("q"))
    kinds = [type(e) for e in expr.items]
    assert kinds == [RoleBegin, ConstantText, Gen, RoleEnd]
    assert [type(e) for e in sgl.assistant().items] == [RoleBegin, RoleEnd]
    assert isinstance(sgl.gen("a") + "tail", ExprList)


def test_function_decorator_forms_and_bind():
    @sgl.function
    def bare(s, a, b=1):
        s += "x"

    @sgl.function()
    def called(s):
        s += "y"

    assert bare.arg_names == ["a", "b"] and called.arg_names == []
    assert bare.bind(a=3).bind_arguments == {"a": 3}
    with pytest.raises(TypeError, match="no argument"):
        bare.bind(c=1)
    with pytest.raises(TypeError, match="state"):
        sgl.function(lambda: None)


def test_run_without_backend_is_an_error(monkeypatch):
    monkeypatch.setattr("arborlm.lang.program._default_backend", None)

    @sgl.function
    def prog(s):
        s += "x"

    with pytest.raises(ValueError, match="no backend"):
        prog.run()


def test_tracing_finds_the_constant_prefix(engine_backend):
    @sgl.function
    def few_shot(s, question, examples):
        s += sgl.system("You answer questions.")
        s += "Example: 1+1=2\n"
        s += examples
        s += sgl.user("Q: " + question)
        s += sgl.assistant(sgl.gen("answer"))

    prefix = few_shot.constant_prefix(engine_backend)
    assert prefix == "<|im_start|>system\nYou answer questions.<|im_end|>\nExample: 1+1=2\n"
    bound = few_shot.bind(examples="Example: 2+2=4\n").constant_prefix(engine_backend)
    assert bound == prefix + "Example: 2+2=4\n<|im_start|>user\nQ: "

    @sgl.function
    def starts_with_gen(s):
        s += sgl.gen("x")
        s += "constant but after a gen"

    assert starts_with_gen.constant_prefix(engine_backend) == ""
