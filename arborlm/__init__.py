"""ArborLM: a structured-generation runtime for LLM programs.

`import arborlm` stays light: it does not import FastAPI, Triton or FlashInfer, and it loads the
engine only when `arborlm.Engine` is first used. The frontend language's names (`function`,
`gen`, `select`, `user`, `RuntimeEndpoint`, `set_default_backend`, ...) are available here as
well, so an SGLang program runs with `import arborlm as sgl`; they load on first use too.
"""

from typing import Any

__version__ = "0.1.0"

_LANG_NAMES = (
    "BackendError", "ChatTemplate", "ChoicesDecision", "ChoicesSamplingMethod", "EngineBackend",
    "OpenAI", "ProgramError", "ProgramFunction", "ProgramState", "ProgramStateGroup",
    "RuntimeEndpoint", "assistant", "assistant_begin", "assistant_end", "flush_cache",
    "function", "gen", "gen_int", "gen_string", "get_chat_template", "get_default_backend",
    "get_server_info", "global_config", "greedy_token_selection", "register_chat_template",
    "select",
    "set_default_backend", "system", "system_begin", "system_end",
    "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin",
    "user_end",
)

__all__ = ["Engine", "EngineArgs", "__version__", *_LANG_NAMES]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from arborlm.runtime.engine import Engine

        return Engine
    if name == "EngineArgs":
        from arborlm.runtime.config import EngineArgs

        return EngineArgs
    if name in _LANG_NAMES:
        from arborlm import lang

        return getattr(lang, name)
    raise AttributeError(f"module 'arborlm' has no attribute {name!r}")
