"""The frontend language: SGLang-style `@function` programs with gen, select, fork and roles.

    import arborlm as sgl          # the names below are also on `arborlm` itself

    @sgl.function
    def pick(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.select("answer", choices=["yes", "no"]))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://localhost:30000"))
    pick.run(question="Is the sky blue?")["answer"]

Modules: `ir` (expressions, gen params), `api` (the primitives), `program` (`@function`,
run / run_batch, the default backend), `interpreter` (one worker per program state), `state`
(`ProgramState`, fork groups), `choices` (select's scoring methods), `chat_template` and
`model_template` (role markers), `tracer` (constant prefixes), `backends/`.

Importing this package loads neither torch nor an HTTP client; backends load on first use.
"""

from typing import Any

from arborlm.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from arborlm.lang.chat_template import ChatTemplate, get_chat_template, register_chat_template
from arborlm.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from arborlm.lang.errors import BackendError, ProgramError
from arborlm.lang.program import ProgramFunction, global_config
from arborlm.lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "BackendError", "ChatTemplate", "ChoicesDecision", "ChoicesSamplingMethod", "EngineBackend",
    "OpenAI", "ProgramError", "ProgramFunction", "ProgramState", "ProgramStateGroup",
    "RuntimeEndpoint", "assistant", "assistant_begin", "assistant_end", "flush_cache",
    "function", "gen", "gen_int", "gen_string", "get_chat_template", "get_default_backend",
    "get_server_info", "global_config", "greedy_token_selection", "register_chat_template",
    "select",
    "set_default_backend", "system", "system_begin", "system_end",
    "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin",
    "user_end",
]

_BACKENDS = ("RuntimeEndpoint", "EngineBackend", "OpenAI")


def __getattr__(name: str) -> Any:
    if name in _BACKENDS:
        from arborlm.lang import backends

        return getattr(backends, name)
    raise AttributeError(f"module 'arborlm.lang' has no attribute {name!r}")
