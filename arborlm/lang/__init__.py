"""The frontend language (not built yet; see issue "The frontend language").

Will hold the SGLang-style DSL: `@function` programs with `gen`, `select`, `fork`/`join`, chat
roles, the interpreter that runs each program state on its own worker, choice scoring, chat
templates, tracing, and backends (HTTP runtime endpoint, in-process Engine, OpenAI-compatible).
"""
