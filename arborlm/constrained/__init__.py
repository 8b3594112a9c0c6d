"""Grammar-constrained decoding, independent of the engine that drives it.

- `base`: the interface — `GrammarBackend.compile(kind, spec) -> CompiledGrammar`,
  `CompiledGrammar.matcher() -> GrammarMatcher` (accept_token, fill_bitmask, rollback,
  is_terminated, jump-forward, copy, reset, check_token). It imports no engine.
- This `__init__`: the registry of engines, `GRAMMAR_BACKENDS` and
  `create_grammar_backend(name, ...)`, which imports the named engine when it is asked for.
- `xgrammar_backend` (default) and `outlines_backend`: the two engines behind it.
- `compile_cache.GrammarCompiler`: compiles in a thread pool with a bounded cache keyed by
  (backend, kind, spec, strict), a time limit, and cached failures. It builds backends through the
  registry, so it is imported from `arborlm.constrained.compile_cache`, not re-exported here.
- `bitmask`: `allocate_token_bitmask` and `apply_token_bitmask_` (masked tokens -> -inf).
- `schema_prepare`: the json_schema path of both engines. Exact rewrites (`schema_allof`,
  `schema_branches`, `schema_required`) and narrowing ones (`schema_rewrite`); `schema_check`
  (+ `schema_oneof`) lists what the engine would still drop; the semantic guard
  (`schema_guard` over `json_tracker`, wrapped around matchers by `guarded_matcher`) checks
  that as values close (`GrammarMatcher.check_token`). What nobody enforces is refused in
  strict mode (a `GrammarError`) or listed in `CompiledGrammar.unenforced`; nothing is dropped
  silently.
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
    DEFAULT_COMPILE_TIMEOUT_S,
    GRAMMAR_KINDS,
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
)
from arborlm.errors import GrammarError

__all__ = [
    "ANY_JSON", "GRAMMAR_BACKENDS", "GRAMMAR_KINDS", "CompiledGrammar", "GrammarBackend",
    "GrammarMatcher", "allocate_token_bitmask", "apply_token_bitmask_",
    "check_schema_supported", "create_grammar_backend",
]

# The registry: every engine `create_grammar_backend` can build, by name.
GRAMMAR_BACKENDS = ("xgrammar", "outlines")

_LAZY = {
    "allocate_token_bitmask": "arborlm.constrained.bitmask",
    "apply_token_bitmask_": "arborlm.constrained.bitmask",
    "check_schema_supported": "arborlm.constrained.schema_check",
}


def create_grammar_backend(name: str, tokenizer: Any, vocab_size: int,
                           stop_token_ids: list[int] | tuple[int, ...], *,
                           any_whitespace: bool = False,
                           compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                           ) -> GrammarBackend:
    """Build the named backend for a Hugging Face `tokenizer` and a model vocabulary.

    `vocab_size` is the model's (the logits' width), which may exceed the tokenizer's; every
    id in `stop_token_ids` ends a complete grammar. `any_whitespace=False` (the default) makes
    JSON use fixed separators; True allows flexible whitespace, still bounded per gap by
    `base.ANY_WHITESPACE_MAX_RUN` characters.
    """
    from arborlm.constrained.vocab import TokenVocab

    if name not in GRAMMAR_BACKENDS:
        raise GrammarError(f"unknown grammar backend {name!r}; expected one of "
                           f"{', '.join(GRAMMAR_BACKENDS)}", param="grammar_backend")
    vocab = TokenVocab.from_tokenizer(tokenizer, vocab_size, stop_token_ids)
    if name == "xgrammar":
        from arborlm.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(vocab, any_whitespace=any_whitespace,
                               compile_timeout_s=compile_timeout_s)
    from arborlm.constrained.outlines_backend import OutlinesBackend

    return OutlinesBackend(vocab, any_whitespace=any_whitespace,
                           compile_timeout_s=compile_timeout_s)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'arborlm.constrained' has no attribute {name!r}")
