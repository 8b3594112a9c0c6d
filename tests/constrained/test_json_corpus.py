"""Every JSON output over the project's schema corpus parses and validates, on both backends.

For each schema in `schema_corpus.CORPUS` a backend either compiles it or refuses it with a
`GrammarError` saying why (the test prints the refusals per backend). Each compiled schema is
sampled under its grammar from seeded noise; every output that terminates must `json.loads` and
pass `jsonschema.validate` (formats checked where jsonschema can), and nearly all terminate.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from arborlm.constrained.base import GrammarBackend
from arborlm.errors import GrammarError
from tests.constrained.driver import closing_bias, generate
from tests.constrained.schema_corpus import CORPUS

FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
# outlines-core takes 8-12 s to index an unconstrained object or array even with a 1k
# vocabulary (measured); they exceed this suite's budget, and compile timeouts are tested in
# test_compile_cache with a real slow schema instead.
OUTLINES_TOO_SLOW = {"any_object", "any_array"}


def test_corpus_is_large_and_varied() -> None:
    assert len(CORPUS) >= 100
    assert len({name for name, _ in CORPUS}) == len(CORPUS)
    text = json.dumps([schema for _, schema in CORPUS])
    for feature in ('"$ref"', '"$defs"', '"anyOf"', '"oneOf"', '"allOf"', '"enum"', '"const"',
                    '"pattern"', '"format"', '"minimum"', '"maxItems"', '"minItems"',
                    '"required"', '"additionalProperties": false'):
        assert feature in text, feature


def test_corpus_outputs_validate(backend: GrammarBackend, capsys: pytest.CaptureFixture) -> None:
    refused: dict[str, str] = {}
    aborted: dict[str, str] = {}  # the semantic guard found no valid continuation
    unfinished: list[str] = []  # guarded schemas the noise model did not finish in budget
    outputs = terminated = 0
    bias = closing_bias(backend.vocab)
    for seed, (name, schema) in enumerate(CORPUS):
        if backend.name == "outlines" and name in OUTLINES_TOO_SLOW:
            continue
        try:
            compiled = backend.compile("json_schema", json.dumps(schema))
        except GrammarError as e:
            refused[name] = str(e)
            continue
        result = generate(compiled.matcher(), backend.vocab, seed=seed, bias=bias)
        outputs += 1
        if result.aborted:
            aborted[name] = result.aborted
        if not result.terminated:
            if getattr(compiled, "guard", None) is not None:
                unfinished.append(name)
            continue
        terminated += 1
        value = json.loads(result.text(backend.vocab))
        jsonschema.validate(value, schema, format_checker=FORMATS)
    with capsys.disabled():
        skipped = len(OUTLINES_TOO_SLOW) if backend.name == "outlines" else 0
        print(f"\n[{backend.name}] compiled {outputs}/{len(CORPUS)} corpus schemas "
              f"({skipped} skipped as too slow); refused {len(refused)}:")
        for name, reason in refused.items():
            print(f"  {name}: {reason}")
        print(f"  guarded, unfinished: {unfinished}; aborted by the guard: {aborted}")
    assert all(reason.strip() for reason in refused.values())
    # Schemas whose grammar enforces everything finish. Those that need the semantic guard
    # (outlines drops integer bounds and formats: the grammar allows any integer or string)
    # may run past the noise model's budget or abort; they were refused before the guard.
    assert terminated >= 0.9 * (outputs - len(unfinished))
    if backend.name == "xgrammar":
        assert outputs >= 0.95 * len(CORPUS), refused


def test_outlines_refusals_name_their_reason(backends: dict[str, GrammarBackend]) -> None:
    """What outlines-core drops is refused, with its pointer, only where the semantic guard
    cannot check it either (names it would write as invalid JSON); the rest is guarded."""
    outlines = backends["outlines"]
    guarded = {
        "int_range": "#/minimum",
        "additional_true": "#/additionalProperties",
        "format_ipv4": "#/format",
    }
    schemas = dict(CORPUS)
    for name, pointer in guarded.items():
        compiled = outlines.compile("json_schema", json.dumps(schemas[name]))
        assert compiled.guard is not None and compiled.unenforced == ()
        assert any(str(p).startswith(pointer) for p in compiled.guard.problems), name
    with pytest.raises(GrammarError, match="#/properties"):
        outlines.compile("json_schema", json.dumps(schemas["escaped_keys"]))
    with pytest.raises(GrammarError, match="for outlines"):  # the engine's own refusal
        outlines.compile("json_schema", json.dumps(schemas["pattern_properties"]))
