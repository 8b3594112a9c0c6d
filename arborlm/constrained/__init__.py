"""Grammar-constrained decoding, independent of the engine that drives it.

- `base`: the interface — `GrammarBackend.compile(kind, spec) -> CompiledGrammar`,
  `CompiledGrammar.matcher() -> GrammarMatcher` (accept_token, fill_bitmask, rollback,
  is_terminated, jump-forward, copy, reset) — and `create_grammar_backend(name, ...)`.
- `xgrammar_backend` (default) and `outlines_backend`: the two engines behind it.
- `compile_cache.GrammarCompiler`: compiles in a thread pool with a bounded cache keyed by
  (backend, kind, spec), a time limit, and cached failures.
- `bitmask`: `allocate_token_bitmask` and `apply_token_bitmask_` (masked tokens -> -inf).
- `schema_check` (+ `schema_allof`, `schema_oneof`): JSON-schema keywords an engine would
  silently drop are reported as a `GrammarError` instead.
- `vocab.TokenVocab`: token bytes with special tokens blanked, shared by both engines.

Kinds: `json_schema` (a schema as a JSON string, or "$$ANY$$" for any JSON value), `regex`,
`ebnf` (xgrammar only), `choices` (a JSON list of strings), `structural_tag` (xgrammar only).
Every failure is a `GrammarError` (HTTP 400) that says what is wrong.

Not here: the scheduler's grammar wait state, the sampler's call into the mask, jump-forward in
the decode loop, and the HTTP fields; they use this package through the names exported below.
Importing this package does not import either engine.
"""

from typing import Any

from arborlm.constrained.base import (
    ANY_JSON,
    GRAMMAR_BACKENDS,
    GRAMMAR_KINDS,
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    create_grammar_backend,
)

__all__ = [
    "ANY_JSON", "GRAMMAR_BACKENDS", "GRAMMAR_KINDS", "CompiledGrammar", "GrammarBackend",
    "GrammarCompiler", "GrammarMatcher", "allocate_token_bitmask", "apply_token_bitmask_",
    "check_schema_supported", "create_grammar_backend",
]

_LAZY = {
    "GrammarCompiler": "arborlm.constrained.compile_cache",
    "allocate_token_bitmask": "arborlm.constrained.bitmask",
    "apply_token_bitmask_": "arborlm.constrained.bitmask",
    "check_schema_supported": "arborlm.constrained.schema_check",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'arborlm.constrained' has no attribute {name!r}")
